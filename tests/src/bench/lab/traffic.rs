//! Traffic generators of the lab sections: iperf3 (TCP bulk, 64-byte UDP) and
//! `egress-echo flood` (new TCP flows), run inside a pod's namespace.

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::lab::{Lab, addr};

/// Port of the iperf3 server on host-a.
pub const IPERF_PORT: u16 = 5201;

/// One iperf3 run's result.
#[derive(Clone, Copy, Debug)]
pub struct Iperf {
    /// TCP: received Gbit/s. UDP: packets/s that arrived at the server.
    pub received: f64,
    /// UDP: packets/s the client sent (TCP: same as `received`).
    pub sent: f64,
}

fn num(v: &Value, path: &[&str]) -> Option<f64> {
    let mut cur = v;
    for p in path {
        cur = cur.get(p)?;
    }
    cur.as_f64()
}

/// `iperf3 -c host-a -t secs -J` (TCP), or with `-u -l 64 -b 0` (UDP), from `pod`.
pub fn iperf(lab: &Lab, pod: &str, udp: bool, secs: u32) -> Result<Iperf> {
    iperf_to(lab, pod, addr::HOST_A, udp, secs)
}

/// [`iperf`] to `host` (which runs an iperf3 server on [`IPERF_PORT`]).
pub fn iperf_to(
    lab: &Lab,
    pod: &str,
    host: std::net::Ipv4Addr,
    udp: bool,
    secs: u32,
) -> Result<Iperf> {
    iperf_at(lab, pod, (host, IPERF_PORT), udp, secs)
}

/// [`iperf_to`] the iperf3 server at `(host, port)`.
pub fn iperf_at(
    lab: &Lab,
    pod: &str,
    (host, port): (std::net::Ipv4Addr, u16),
    udp: bool,
    secs: u32,
) -> Result<Iperf> {
    let host = host.to_string();
    let (t, limit) = (secs.to_string(), (secs + 15).to_string());
    let port = port.to_string();
    let mut args = vec![
        limit.as_str(),
        "iperf3",
        "-c",
        &host,
        "-p",
        &port,
        "-t",
        &t,
        "-J",
        "--connect-timeout",
        "3000",
    ];
    if udp {
        args.extend(["-u", "-l", "64", "-b", "0"]);
    }
    let out = lab.ns(pod)?.exec_unchecked("timeout", &args)?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("iperf3 printed no JSON: {text:.300}"))?;
    if let Some(e) = v.get("error").and_then(Value::as_str) {
        bail!("iperf3 from {pod}: {e}");
    }
    if !out.status.success() {
        bail!("iperf3 from {pod} exited with {}", out.status);
    }
    if udp {
        // The client's JSON carries the server's counts (packets sent, lost).
        let sum = v
            .pointer("/end/sum")
            .context("iperf3 UDP JSON without end.sum")?;
        let packets = num(sum, &["packets"]).context("no end.sum.packets")?;
        let lost = num(sum, &["lost_packets"]).unwrap_or(0.0);
        let secs = num(sum, &["seconds"])
            .filter(|s| *s > 0.0)
            .unwrap_or(f64::from(secs));
        Ok(Iperf {
            received: (packets - lost).max(0.0) / secs,
            sent: packets / secs,
        })
    } else {
        let bps = v
            .pointer("/end/sum_received/bits_per_second")
            .and_then(Value::as_f64)
            .context("iperf3 TCP JSON without end.sum_received.bits_per_second")?;
        Ok(Iperf {
            received: bps / 1e9,
            sent: bps / 1e9,
        })
    }
}

/// New TCP flows per second from `pod` to the echo server on host-a: `parallel` threads
/// of sequential short connections for `secs` seconds. Returns (flows/s, failures).
pub fn flood(lab: &Lab, echo_bin: &str, pod: &str, secs: f64, parallel: u32) -> Result<(f64, u64)> {
    let target = format!("{}:{}", addr::HOST_A, addr::ECHO_PORT);
    let (s, p) = (format!("{secs}"), parallel.to_string());
    let limit = format!("{}", secs.ceil() as u64 + 15);
    let out = lab.ns(pod)?.exec_unchecked(
        "timeout",
        &[
            limit.as_str(),
            echo_bin,
            "flood",
            "tcp",
            &target,
            "--seconds",
            &s,
            "--parallel",
            &p,
        ],
    )?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "egress-echo flood from {pod} failed ({}): {}{}",
            out.status,
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    // "connections N failures F elapsed_ms T"
    let words: Vec<&str> = text.split_whitespace().collect();
    let field = |name: &str| -> Result<f64> {
        let i = words
            .iter()
            .position(|w| *w == name)
            .with_context(|| format!("no {name} in {text:?}"))?;
        words
            .get(i + 1)
            .and_then(|w| w.parse().ok())
            .with_context(|| format!("bad {name} in {text:?}"))
    };
    let (n, failed, ms) = (
        field("connections")?,
        field("failures")?,
        field("elapsed_ms")?,
    );
    if ms <= 0.0 {
        bail!("flood from {pod}: elapsed time 0");
    }
    Ok((n / (ms / 1e3), failed as u64))
}
