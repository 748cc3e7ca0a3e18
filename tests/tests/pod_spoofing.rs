//! A pod cannot send as another pod of its node (issue 45, item 1), across namespaces:
//! the lab with `--unknown-pods drop` (so `from_pod` is on every pod device), `w1-p2`
//! (unselected) sends UDP to host-a with `w1-p1`'s address (selected: network A through
//! egress IP A) as its source, the way a pod with CAP_NET_RAW can. Asserted on what
//! host-a captured (nothing from egress IP A beyond w1-p1's own datagrams) and on w1's
//! counters (`DROP_SOURCE_DEVICE`, no `TUNNELED`). Before the binding, 5 of 5 spoofed
//! datagrams reached host-a as egress IP A.

use std::{net::IpAddr, time::Duration};

use anyhow::{Context as _, Result};
use egress_common::counters::reason::{DROP_SOURCE_DEVICE, TUNNELED};
use egress_tests::{
    cluster::{agent_bin, capture, counted, default_spec, seen, wait_until},
    lab::{Lab, Proto, addr},
};

/// Datagrams the spoofing pod sends.
const SPOOFED: u64 = 5;
/// The spoofed datagrams' payload: host-a's capture tells them from w1-p1's queries.
const MARK: &str = "spoofed-by-w1-p2";

fn lab() -> Result<Lab> {
    let mut lab = Lab::up(default_spec()?)?;
    lab.connect_router_to('a')?;
    for node in ["w1", "w2", "gw1", "gw2"] {
        lab.start_agent(node, &agent_bin()?, &["--unknown-pods", "drop"])?;
    }
    wait_until(Duration::from_secs(30), || {
        seen(&lab, "w1-p1", Proto::Udp, addr::HOST_A) == Some(IpAddr::V4(addr::EGRESS_IP_A))
    })
    .with_context(|| format!("agents did not converge:\n{}", lab.agent_log("w1")))?;
    Ok(lab)
}

/// `SPOOFED` UDP datagrams from `pod` with source `as_addr` to host-a's echo port: the
/// address added to the pod's own interface (as a pod with CAP_NET_ADMIN could; raw
/// sockets do the same with CAP_NET_RAW).
fn send_as(lab: &Lab, pod: &str, as_addr: IpAddr) -> Result<()> {
    let ns = lab.ns(pod)?;
    ns.exec(
        "ip",
        &["addr", "add", &format!("{as_addr}/32"), "dev", "eth0"],
    )?;
    let script = format!(
        "import socket\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         s.bind(('{as_addr}', 40123))\n\
         for _ in range({SPOOFED}):\n    s.sendto(b'{MARK}', ('{}', {}))\n",
        addr::HOST_A,
        addr::ECHO_PORT
    );
    ns.exec("python3", &["-c", &script])?;
    Ok(())
}

#[test]
fn a_pod_cannot_send_as_another_pod_of_its_node() -> Result<()> {
    let lab = lab()?;
    let (mut dump, capture) = capture(&lab, "host-a", "udp dst port 7777", "host-a.pcap.txt")?;
    let (tunneled0, dropped0) = (
        counted(&lab, "w1", TUNNELED),
        counted(&lab, "w1", DROP_SOURCE_DEVICE),
    );
    send_as(&lab, "w1-p2", IpAddr::V4(addr::W1_P1))?;
    std::thread::sleep(Duration::from_millis(500));
    let (tunneled, dropped) = (
        counted(&lab, "w1", TUNNELED) - tunneled0,
        counted(&lab, "w1", DROP_SOURCE_DEVICE) - dropped0,
    );
    // w1-p1 itself still leaves by egress IP A.
    let own = seen(&lab, "w1-p1", Proto::Udp, addr::HOST_A);
    std::thread::sleep(Duration::from_millis(300));
    let _ = dump.terminate(Duration::from_secs(1));
    let lines = std::fs::read_to_string(&capture)?;
    let spoofed_arrived = lines.matches(MARK).count();
    println!(
        "w1-p2 sent {SPOOFED} datagrams as w1-p1: {spoofed_arrived} reached host-a, w1 \
         counted {dropped} DROP_SOURCE_DEVICE and {tunneled} TUNNELED"
    );
    assert_eq!(spoofed_arrived, 0, "spoofed datagrams at host-a:\n{lines}");
    assert_eq!(dropped, SPOOFED, "DROP_SOURCE_DEVICE on w1");
    assert_eq!(
        tunneled, 0,
        "TUNNELED on w1 while only the spoofing pod sent"
    );
    assert_eq!(
        own,
        Some(IpAddr::V4(addr::EGRESS_IP_A)),
        "w1-p1's own traffic"
    );
    Ok(())
}
