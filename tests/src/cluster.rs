//! The lab with agents running: finding the agent binary, waiting for convergence,
//! reading which gateway holds an egress IP. Shared by the demo and the end-to-end tests.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::lab::{
    Family, Lab, LabSpec, Proto, Query, Seen, Underlay, addr, addr6, locate_echo_bin,
};

/// The `egress-agent` binary next to the running executable (or one directory up, for
/// test binaries in `deps/`), or `$EGRESS_AGENT_BIN`.
pub fn agent_bin() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("EGRESS_AGENT_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("failed to find the current executable")?;
    for dir in exe.ancestors().skip(1).take(2) {
        let p = dir.join("egress-agent");
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "failed to find the egress-agent binary next to {}: build it first \
         (`cargo build -p egress-agent`; `cargo xtask test` does) or set EGRESS_AGENT_BIN",
        exe.display()
    )
}

/// Bring up a lab and one agent per node, and wait until the sample policy's egress IPs
/// (of the lab's families) are held and a selected pod gets through with each.
pub fn up_with_agents(spec: LabSpec) -> Result<Lab> {
    up_with_agent_args(spec, &[])
}

/// [`up_with_agents`], every agent started with `extra` flags.
pub fn up_with_agent_args(spec: LabSpec, extra: &[&str]) -> Result<Lab> {
    let mut lab = Lab::up(spec)?;
    start_agents_and_wait(&mut lab, extra)?;
    Ok(lab)
}

/// Start one agent per node of a lab that has none, with `extra` flags, and wait as
/// [`up_with_agents`] does.
pub fn start_agents_and_wait(lab: &mut Lab, extra: &[&str]) -> Result<()> {
    let bin = agent_bin()?;
    let keyed = lab.spec().liveness_key;
    start_agents_of(lab, &bin, extra, keyed)
}

/// [`start_agents_and_wait`] with the agent at `bin`, with the lab's liveness key or not.
pub fn start_agents_of(lab: &mut Lab, bin: &Path, extra: &[&str], keyed: bool) -> Result<()> {
    let family = lab.family();
    for node in lab.nodes().to_vec() {
        lab.start_agent_as(node.name, bin, extra, keyed)?;
    }
    lab.node_forwarding()?;
    let lab = &*lab;
    // Converged when every agent has it: both egress IPs held, and every selected pod (on
    // both workers and on a gateway) gets through to both networks with the right address.
    let through = |lab: &Lab, host_a: IpAddr, ea: IpAddr, host_b: IpAddr, eb: IpAddr| {
        ["w1-p1", "w2-p1", "gw1-p1"].iter().all(|pod| {
            [(host_a, ea), (host_b, eb)]
                .iter()
                .all(|(host, egress)| seen(lab, pod, Proto::Tcp, *host) == Some(*egress))
        })
    };
    wait_until(Duration::from_secs(30), || {
        let v4 = !family.has_v4()
            || holder(lab, addr::EGRESS_IP_A).is_some()
                && holder(lab, addr::EGRESS_IP_B).is_some()
                && through(
                    lab,
                    IpAddr::V4(addr::HOST_A),
                    IpAddr::V4(addr::EGRESS_IP_A),
                    IpAddr::V4(addr::HOST_B),
                    IpAddr::V4(addr::EGRESS_IP_B),
                );
        let v6 = !family.has_v6()
            || holder(lab, addr6::EGRESS_IP_A).is_some()
                && holder(lab, addr6::EGRESS_IP_B).is_some()
                && through(
                    lab,
                    IpAddr::V6(addr6::HOST_A),
                    IpAddr::V6(addr6::EGRESS_IP_A),
                    IpAddr::V6(addr6::HOST_B),
                    IpAddr::V6(addr6::EGRESS_IP_B),
                );
        v4 && v6
    })
    .with_context(|| {
        let warnings: String = lab
            .nodes()
            .iter()
            .map(|n| {
                let log = lab.agent_log(n.name);
                let lines: Vec<&str> = log.lines().filter(|l| l.contains(" WARN ")).collect();
                format!(
                    "{}: {}\n",
                    n.name,
                    lines[lines.len().saturating_sub(8)..].join("\n")
                )
            })
            .collect();
        format!(
            "agents did not converge; their last warnings:\n{warnings}gw1 log:\n{}",
            lab.agent_log("gw1")
        )
    })?;
    Ok(())
}

/// The default lab spec with the echo binary found from this process.
pub fn default_spec() -> Result<LabSpec> {
    Ok(LabSpec::new(locate_echo_bin()?))
}

/// The default lab spec with pods of `family` on its usual underlay ([`LabSpec::with_family`]).
pub fn spec_for(family: Family) -> Result<LabSpec> {
    Ok(default_spec()?.with_family(family))
}

/// [`spec_for`] on an explicit underlay family.
pub fn spec_on(family: Family, underlay: Underlay) -> Result<LabSpec> {
    let mut spec = spec_for(family)?;
    spec.underlay = underlay;
    Ok(spec)
}

/// Which gateway and interface hold `ip` (read from the gateways' interfaces that are up);
/// the first of [`holders`].
pub fn holder(lab: &Lab, ip: impl Into<IpAddr>) -> Option<(String, String)> {
    holders(lab, ip).into_iter().next()
}

/// Every gateway that has `ip` on an interface that is up, with that interface: more than
/// one means two gateways answer for the same egress IP.
pub fn holders(lab: &Lab, ip: impl Into<IpAddr>) -> Vec<(String, String)> {
    let ip: IpAddr = ip.into();
    let mut out = Vec::new();
    for gw in lab.gateways() {
        let addrs = lab
            .ns(gw)
            .and_then(|ns| ns.up_addresses())
            .unwrap_or_default();
        if let Some((ifc, _)) = addrs.into_iter().find(|(_, a)| *a == ip) {
            out.push((gw.to_owned(), ifc));
        }
    }
    out
}

/// The source address `host` saw for a short query from `pod`, or `None` if it failed.
pub fn seen(lab: &Lab, pod: &str, proto: Proto, host: impl Into<IpAddr>) -> Option<IpAddr> {
    let q = Query::new(proto, host, addr::ECHO_PORT)
        .timeout(Duration::from_millis(700))
        .attempts(2);
    lab.query_with(pod, &q).ok().map(|s| s.ip)
}

/// Poll `f` every 50 ms until it holds; `Err` after `timeout`. Returns the time it took.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> Result<Duration> {
    let timeout = timeout * time_scale();
    let start = Instant::now();
    loop {
        if f() {
            return Ok(start.elapsed());
        }
        if start.elapsed() > timeout {
            bail!("condition not met within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// How much longer every [`wait_until`] may take: `EGRESS_TEST_TIME_SCALE` (default 1).
/// `cargo xtask test` sets it for the runs under emulation (the Linux 6.1 VM, TCG), where
/// agents and their verifier runs are several times slower; outcomes are asserted the
/// same way.
pub fn time_scale() -> u32 {
    std::env::var("EGRESS_TEST_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n >= 1)
        .unwrap_or(1)
}

/// First of the fixed source ports tests bind in a pod. Below the kernel's ephemeral range
/// (32768-60999 in a new namespace), so no connection the lab made before (a readiness
/// query, a probe still in TIME_WAIT) can hold one of them: CI once failed a bind of port
/// 41022 with EADDRINUSE.
const FIXED_SPORT: u16 = 21_000;

/// Two pods on two nodes (`w1-p1`, `w2-p1`) open 25 TCP connections each to `host` at
/// once, from the same 25 source ports: what the host saw of each. After SNAT to one
/// egress IP the tuples would collide unless the translations differ.
pub fn colliding_connections(lab: &Lab, host: IpAddr) -> Vec<Result<Seen>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ["w1-p1", "w2-p1"]
            .iter()
            .flat_map(|pod| (0..25u16).map(move |i| (*pod, FIXED_SPORT + i)))
            .map(|(pod, sport)| {
                s.spawn(move || {
                    lab.query_with(
                        pod,
                        &Query::new(Proto::Tcp, host, addr::ECHO_PORT)
                            .sport(sport)
                            .timeout(Duration::from_secs(5)),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Start capturing what `host_ns` receives on eth0 matching the tcpdump `filter`, with
/// each packet's contents in ASCII (`-A`), into `file` under the lab's directory; returns
/// once tcpdump has had half a second to start. Stop it with `terminate` (or drop it),
/// then read the file.
pub fn capture(
    lab: &Lab,
    host_ns: &str,
    filter: &str,
    file: &str,
) -> Result<(crate::netns::NsChild, PathBuf)> {
    let path = lab.dir().join(file);
    let dump =
        lab.ns(host_ns)?
            .spawn("tcpdump", &["-n", "-l", "-A", "-i", "eth0", filter], &path)?;
    std::thread::sleep(Duration::from_millis(500));
    Ok((dump, path))
}

/// `pod` pings `host` twice (both must be answered) while `host_ns` captures the first
/// packet matching the tcpdump `filter`: what tcpdump printed.
pub fn ping_captured(
    lab: &Lab,
    pod: &str,
    host_ns: &str,
    host: IpAddr,
    filter: &str,
) -> Result<String> {
    let log = lab.dir().join(format!("tcpdump-{pod}-{host_ns}.log"));
    let mut dump = lab.ns(host_ns)?.spawn(
        "tcpdump",
        &["-n", "-l", "-i", "eth0", "-c", "1", filter],
        &log,
    )?;
    std::thread::sleep(Duration::from_millis(500));
    let family = if host.is_ipv6() { "-6" } else { "-4" };
    let ping = lab.exec(
        pod,
        "ping",
        &[family, "-c", "2", "-W", "2", &host.to_string()],
    )?;
    if !ping.status.success() {
        bail!(
            "{pod} pinging {host}: {}",
            String::from_utf8_lossy(&ping.stdout)
        );
    }
    let captured = wait_until(Duration::from_secs(3), || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("echo request"))
    });
    let _ = dump.terminate(Duration::from_secs(1));
    captured.with_context(|| format!("{host_ns} captured no echo request"))?;
    Ok(std::fs::read_to_string(&log)?)
}

/// Packets counted as `reason` by a node's datapath (its pinned counters, read with
/// bpftool), summed over CPUs.
pub fn counted(lab: &Lab, node: &str, reason: u32) -> u64 {
    let pin = lab.bpffs_dir(node).join(egress_common::maps::COUNTERS);
    let out = std::process::Command::new("bpftool")
        .args(["-j", "map", "lookup", "pinned"])
        .arg(&pin)
        .args(["key"])
        .args(reason.to_le_bytes().map(|b| b.to_string()))
        .output()
        .expect("failed to run bpftool");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bpftool on {}: {e}", pin.display()));
    // With BTF, bpftool adds the values with their field names under "formatted".
    let values = v["formatted"]["values"]
        .as_array()
        .unwrap_or_else(|| panic!("no formatted per-CPU values: {v}"));
    values
        .iter()
        .map(|cpu| cpu["value"]["packets"].as_u64().expect("packets"))
        .sum()
}

/// A stream (`egress-echo stream <proto>`, a line or datagram every 50 ms for up to two
/// minutes) from `pod` to `host`'s echo port, logged to `<lab dir>/<name>.log`.
pub fn start_stream(
    lab: &Lab,
    pod: &str,
    proto: &str,
    host: IpAddr,
    name: &str,
) -> Result<(crate::netns::NsChild, PathBuf)> {
    let log = lab.dir().join(format!("{name}.log"));
    let target = std::net::SocketAddr::new(host, addr::ECHO_PORT).to_string();
    let child = lab.ns(pod)?.spawn(
        &lab.spec().echo_bin,
        &[
            "stream",
            proto,
            &target,
            "--interval-ms",
            "50",
            "--duration-ms",
            "120000",
        ],
        &log,
    )?;
    Ok((child, log))
}

/// Stop a [`start_stream`] stream and read its summary.
pub fn stop_stream(
    mut child: crate::netns::NsChild,
    log: &std::path::Path,
) -> Result<crate::stream::Summary> {
    child.signal_term();
    child.wait_for(Duration::from_secs(3))?;
    let out = std::fs::read_to_string(log)
        .with_context(|| format!("failed to read {}", log.display()))?;
    crate::stream::Summary::find_in(&out).with_context(|| format!("no summary in: {out}"))
}

/// The names of the interfaces in `member`'s namespace (`ip -o link show`).
pub fn interface_names(lab: &Lab, member: &str) -> Result<Vec<String>> {
    let out = lab.exec(member, "ip", &["-o", "link", "show"])?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .collect())
}
