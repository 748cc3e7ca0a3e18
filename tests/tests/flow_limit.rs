//! End to end: one pod's flood of new flows through a gateway (issue 12). The gateways
//! run with `--max-flows-per-pod 50`; w1-p1 opens short TCP connections to host-a as fast
//! as it can (each closed at once: its conntrack entries stay for the closing timeout,
//! 30 s). Past 50 live flows the holder refuses w1-p1's new flows (`DROP_POD_FLOW_LIMIT`,
//! counted against the pod), while another pod's new flows to the same destination still
//! leave through egress IP A. When the closed flows expire, the sweeper counts them down
//! and w1-p1 connects again.

use std::{net::IpAddr, time::Duration};

use anyhow::{Context as _, Result, ensure};
use egress_common::{counters::reason::DROP_POD_FLOW_LIMIT, maps};
use egress_tests::{
    cluster::{counted, default_spec, holder, seen, up_with_agent_args, wait_until},
    lab::{Lab, Proto, addr},
};

const LIMIT: u32 = 50;

/// `gw`'s `FLOWS_V4` count for `pod` (bpftool; 0 when it has no entry).
fn flows_of(lab: &Lab, gw: &str, pod: std::net::Ipv4Addr) -> u64 {
    let pin = lab.bpffs_dir(gw).join(maps::FLOWS_V4);
    let out = std::process::Command::new("bpftool")
        .args(["-j", "map", "lookup", "pinned"])
        .arg(&pin)
        .arg("key")
        .args(pod.octets().map(|b| b.to_string()))
        .output()
        .expect("bpftool");
    serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .ok()
        .and_then(|v| v["formatted"]["value"]["flows"].as_u64())
        .unwrap_or(0)
}

#[test]
fn a_pods_flood_is_capped_at_its_flow_limit_others_go_on_and_it_recovers() -> Result<()> {
    let limit = LIMIT.to_string();
    let lab = up_with_agent_args(default_spec()?, &["--max-flows-per-pod", &limit])?;
    let (gw, _) = holder(&lab, addr::EGRESS_IP_A).context("nobody holds egress IP A")?;
    let target = std::net::SocketAddr::new(addr::HOST_A.into(), addr::ECHO_PORT).to_string();
    let out = lab.exec(
        "w1-p1",
        &lab.spec().echo_bin.to_string_lossy(),
        &["flood", "tcp", &target, "--seconds", "4", "--parallel", "4"],
    )?;
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let refused = counted(&lab, &gw, DROP_POD_FLOW_LIMIT);
    let held = flows_of(&lab, &gw, addr::W1_P1);
    println!(
        "flood from w1-p1: {} ; holder {gw}: {held} live flows counted, {refused} SYNs refused",
        said.trim()
    );
    ensure!(refused > 0, "no new flow was refused: {said}");
    ensure!(
        held <= u64::from(LIMIT) + 4,
        "w1-p1 holds {held} flows, over the limit of {LIMIT}"
    );
    // Another pod is not affected.
    ensure!(
        seen(&lab, "w2-p1", Proto::Tcp, addr::HOST_A) == Some(IpAddr::V4(addr::EGRESS_IP_A)),
        "w2-p1 could not open a flow while w1-p1 was at its limit"
    );
    // The closed flows expire (30 s) and the sweeper counts them down on the holder that
    // refused; then w1-p1 connects again. Read on that gateway, not through a connection
    // that succeeds: under load a holder change would admit the pod elsewhere.
    let swept = wait_until(Duration::from_secs(75), || {
        flows_of(&lab, &gw, addr::W1_P1) < u64::from(LIMIT)
    })
    .with_context(|| {
        format!(
            "{} flows still counted on {gw} 75 s after the flood",
            flows_of(&lab, &gw, addr::W1_P1)
        )
    })?;
    let took = wait_until(Duration::from_secs(15), || {
        seen(&lab, "w1-p1", Proto::Tcp, addr::HOST_A) == Some(IpAddr::V4(addr::EGRESS_IP_A))
    })
    .context("w1-p1 never connected again")?;
    let now_held = holder(&lab, addr::EGRESS_IP_A).map(|(g, _)| g);
    println!(
        "{gw} counted w1-p1 under its limit {} s after the flood ({} flows); w1-p1 connected \
         {} ms later (egress IP A held by {now_held:?})",
        swept.as_secs(),
        flows_of(&lab, &gw, addr::W1_P1),
        took.as_millis()
    );
    Ok(())
}
