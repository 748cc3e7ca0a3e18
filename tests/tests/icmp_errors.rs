//! End to end: ICMP errors about translated flows reach the pod (issue 12). Network D sits
//! behind rtr-b on network B; the sample policy's `destinationsFrom: Routes` rule sends
//! a pod's traffic to D out of egress IP B (the gateways route D via rtr-b from the
//! start). Here rtr-b's leg on D and host-d's link get an MTU of 1,300, so that rtr-b
//! answers a full-size segment from the pod with "fragmentation needed" (IPv6: "packet
//! too big") to egress IP B; the gateway must translate it back to the pod, or the
//! upload hangs (a PMTU black hole). host-d advertises the MSS of a 1,500-byte link
//! (`advmss`), as a host behind a narrower hop in the middle of the path would: with its
//! own MTU's MSS the pod would never send a segment too large for the hop.
//!
//! And a UDP send to a closed port of host-d fails at the pod with ECONNREFUSED: the
//! port unreachable that host-d sends to egress IP B is delivered.
//!
//! Then the gateways' own egress interface on B narrows to 1,280 bytes (issue 45, item
//! 5): the gateway itself answers the pod's segments of the 1,300-byte path with
//! "fragmentation needed" (IPv6: "packet too big") for 1,280, made by the datapath from
//! the segment (a GSO segment train, CHECKSUM_PARTIAL over the lab's veths); the pod's
//! kernel takes it (its route cache says `mtu 1280`) and the upload completes.
//!
//! And a ping from the pod with a TTL (hop limit) of 1 is answered by the gateway with
//! "time exceeded" from egress IP B, as `ping` itself reports it.

use std::{net::IpAddr, time::Duration};

use egress_common::counters::reason::{FRAG_NEEDED_SENT, ICMP_ERROR_XLATED, TIME_EXCEEDED_SENT};
use egress_tests::{
    cluster::{counted, spec_for, spec_on, up_with_agents},
    lab::{Family, Lab, Proto, Query, Underlay, addr, addr6},
};

const POD: &str = "w1-p1";
const NARROW_MTU: &str = "1300";
/// The gateways' egress interface on network B, narrower than the hop.
const GATEWAY_MTU: &str = "1280";
/// A port nothing listens on at host-d.
const CLOSED_PORT: u16 = 9;

/// rtr-b's leg on D and host-d's link at 1,300 bytes, host-d's routes advertising the MSS
/// of 1,500 bytes.
fn narrow_network_d(lab: &Lab, v6: bool) {
    lab.exec("rtr-b", "ip", &["link", "set", "net-d", "mtu", NARROW_MTU])
        .unwrap();
    lab.exec("host-d", "ip", &["link", "set", "eth0", "mtu", NARROW_MTU])
        .unwrap();
    let (fam, default, via, mss) = if v6 {
        ("-6", "::/0", addr6::RTR_B_NET_D.to_string(), "1440")
    } else {
        ("-4", "default", addr::RTR_B_NET_D.to_string(), "1460")
    };
    lab.exec(
        "host-d",
        "ip",
        &[
            fam, "route", "replace", default, "via", &via, "dev", "eth0", "advmss", mss,
        ],
    )
    .unwrap();
}

/// Packets counted as `reason` by both gateways' datapaths.
fn gateway_count(lab: &Lab, reason: u32) -> u64 {
    ["gw1", "gw2"]
        .iter()
        .map(|gw| counted(lab, gw, reason))
        .sum()
}

/// 4 kB each way between the pod and host-d over TCP through `what`: the address host-d
/// saw.
fn upload(lab: &Lab, host_d: IpAddr, what: &str) -> IpAddr {
    lab.query_with(
        POD,
        &Query::new(Proto::Tcp, host_d, addr::ECHO_PORT)
            .size(4000)
            .timeout(Duration::from_secs(10)),
    )
    .unwrap_or_else(|e| panic!("4 kB upload through {what}: {e:#}"))
    .ip
}

fn pmtu_and_port_unreachable(family: Family, underlay: Option<Underlay>) {
    let v6 = family == Family::V6;
    let spec = match underlay {
        Some(u) => spec_on(family, u),
        None => spec_for(family),
    };
    let lab = up_with_agents(spec.unwrap()).unwrap();
    let (host_d, egress_b) = if v6 {
        (IpAddr::V6(addr6::HOST_D), IpAddr::V6(addr6::EGRESS_IP_B))
    } else {
        (IpAddr::V4(addr::HOST_D), IpAddr::V4(addr::EGRESS_IP_B))
    };
    // The path works before the hop narrows (and the pod's route cache is fresh).
    let s = lab
        .query_with(
            POD,
            &Query::new(Proto::Tcp, host_d, addr::ECHO_PORT).attempts(3),
        )
        .unwrap();
    assert_eq!(s.ip, egress_b);
    narrow_network_d(&lab, v6);

    // 4 kB each way: the first full-size segments meet the 1,300-byte hop.
    assert_eq!(upload(&lab, host_d, "a 1,300-byte hop"), egress_b);
    let frag_needed = gateway_count(&lab, ICMP_ERROR_XLATED);
    assert!(
        frag_needed >= 1,
        "the upload crossed without a translated ICMP error: the hop did not bite"
    );

    let err = lab
        .query_with(
            POD,
            &Query::new(Proto::Udp, host_d, CLOSED_PORT).timeout(Duration::from_secs(3)),
        )
        .expect_err("UDP to a closed port must fail");
    let text = format!("{err:#}");
    assert!(
        text.contains("Connection refused"),
        "UDP to a closed port: expected ECONNREFUSED, got: {text}"
    );
    assert!(gateway_count(&lab, ICMP_ERROR_XLATED) > frag_needed);

    for gw in ["gw1", "gw2"] {
        lab.exec(gw, "ip", &["link", "set", "sec-b", "mtu", GATEWAY_MTU])
            .unwrap();
    }
    assert_eq!(upload(&lab, host_d, "the gateway's 1,280 bytes"), egress_b);
    assert!(
        gateway_count(&lab, FRAG_NEEDED_SENT) >= 1,
        "no gateway answered a packet too big for its egress interface"
    );
    let fam = if v6 { "-6" } else { "-4" };
    let route = lab
        .exec(POD, "ip", &[fam, "route", "get", &host_d.to_string()])
        .unwrap();
    let route = String::from_utf8_lossy(&route.stdout);
    assert!(
        route.contains(&format!("mtu {GATEWAY_MTU}")),
        "the pod's route to host-d after the gateway's answer: {route}"
    );

    let ping = lab
        .ns(POD)
        .unwrap()
        .exec_unchecked(
            "ping",
            &[fam, "-c", "1", "-W", "3", "-t", "1", &host_d.to_string()],
        )
        .unwrap();
    let ping = String::from_utf8_lossy(&ping.stdout);
    assert!(
        ping.contains(&format!("From {egress_b}")) && ping.contains("exceeded"),
        "ping with TTL 1: expected time exceeded from {egress_b}, got: {ping}"
    );
    assert!(gateway_count(&lab, TIME_EXCEEDED_SENT) >= 1);
}

#[test]
fn ipv4_pod_learns_the_path_mtu_and_a_closed_port_refuses() {
    pmtu_and_port_unreachable(Family::V4, None);
}

#[test]
fn ipv6_pod_learns_the_path_mtu_and_a_closed_port_refuses() {
    pmtu_and_port_unreachable(Family::V6, Some(Underlay::V6));
}

#[test]
fn ipv6_pod_over_an_ipv4_underlay_learns_the_path_mtu() {
    pmtu_and_port_unreachable(Family::V6, Some(Underlay::V4));
}
