//! Forwarding on the devices the datapath looks routes up from, and nowhere else (issue
//! 48): on gateway gw1, `net.ipv4.conf.all.forwarding` and `default` are off (which turns
//! every device off) before the agents start as the manifests deploy them (/proc/sys
//! read-only). gw1's agent names each device and setting it could not turn on; once those
//! devices forward (the node's business), a pod leaves through gw1 with its egress IP
//! while `all` stays off.

use std::{net::IpAddr, time::Duration};

use anyhow::{Context as _, Result, ensure};
use egress_tests::{
    cluster::{agent_bin, default_spec, seen, wait_until},
    deployed::AgentContainer,
    lab::{Lab, Proto, addr},
};

#[test]
fn forwarding_on_the_datapaths_devices_only_is_enough_and_its_absence_is_named() -> Result<()> {
    ensure!(
        AgentContainer::enabled(),
        "the test needs the agent as deployed (read-only /proc/sys)"
    );
    let mut lab = Lab::up(default_spec()?)?;
    for kv in [
        "net.ipv4.conf.all.forwarding=0",
        "net.ipv4.conf.default.forwarding=0",
    ] {
        lab.exec("gw1", "sysctl", &["-qw", kv])?;
    }
    lab.start_agents(&agent_bin()?)?;
    // The tunnel device (made by the agent, with default's 0), the underlay and the egress
    // interfaces of network A and B.
    let devices = ["egress0", "eth0", "sec-a", "sec-b"];
    wait_until(Duration::from_secs(30), || {
        let log = lab.agent_log("gw1");
        devices
            .iter()
            .all(|d| log.contains(&format!("sysctl -w net.ipv4.conf.{d}.forwarding=1")))
    })
    .with_context(|| format!("gw1 did not name every device:\n{}", lab.agent_log("gw1")))?;
    for d in devices {
        lab.exec(
            "gw1",
            "sysctl",
            &["-qw", &format!("net.ipv4.conf.{d}.forwarding=1")],
        )?;
    }
    wait_until(Duration::from_secs(30), || {
        seen(&lab, "w1-p1", Proto::Udp, addr::HOST_A) == Some(IpAddr::V4(addr::EGRESS_IP_A))
    })
    .with_context(|| format!("w1-p1 did not leave through gw1:\n{}", lab.agent_log("gw1")))?;
    let all = lab.exec("gw1", "sysctl", &["-n", "net.ipv4.conf.all.forwarding"])?;
    ensure!(
        String::from_utf8_lossy(&all.stdout).trim() == "0",
        "all stays off"
    );
    Ok(())
}
