//! End to end for IPv6 pods: the family-dependent cases of `e2e_v4` (each network, ping,
//! colliding source ports, failover, full-size segments) for IPv6-only pods, and the
//! dual-stack case, whose traffic of each family must leave with that family's egress IP;
//! over an IPv6 and over an IPv4 underlay. Each case that names an underlay proves it: the
//! nodes drop tunnel packets of the other family, and count those of this one.

use std::{net::IpAddr, time::Duration};

use egress_common::config::DEFAULT_TUNNEL_PORT;
use egress_tests::{
    cluster::{
        colliding_connections, holder, ping_captured, seen, spec_for, spec_on, up_with_agents,
        wait_until,
    },
    lab::{Family, Lab, Proto, Query, Underlay, addr, addr6},
};

const NODES: [&str; 4] = ["w1", "w2", "gw1", "gw2"];

/// On every node: drop tunnel packets sent over the other family, count those sent over
/// `underlay` (table `egress_test`, removed with the node's namespace).
fn only_underlay(lab: &Lab, underlay: Underlay) {
    let (this, other) = match underlay {
        Underlay::V4 => ("ip", "ip6"),
        Underlay::V6 => ("ip6", "ip"),
    };
    let port = DEFAULT_TUNNEL_PORT;
    let rules = format!(
        "table {this} egress_test {{
           chain out {{
             type filter hook output priority 0;
             udp dport {port} counter
           }}
         }}
         table {other} egress_test {{
           chain out {{
             type filter hook output priority 0;
             udp dport {port} counter drop
           }}
         }}
"
    );
    let file = std::env::temp_dir().join(format!("{}-underlay.nft", lab.prefix()));
    std::fs::write(&file, rules).unwrap();
    for node in NODES {
        let o = lab
            .exec(node, "nft", &["-f", &file.to_string_lossy()])
            .unwrap();
        assert!(
            o.status.success(),
            "nft on {node}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let _ = std::fs::remove_file(&file);
}

/// Tunnel packets `node` sent over (`this`) and dropped on (`other`) each family, as
/// counted by the rules of [`only_underlay`].
fn tunnel_packets(lab: &Lab, node: &str, family: &str) -> u64 {
    let o = lab
        .exec(node, "nft", &["list", "table", family, "egress_test"])
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    out.split_whitespace()
        .skip_while(|w| *w != "packets")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counter in {family} egress_test on {node}: {out}"))
}

/// Every node's tunnel traffic went over `underlay`, and some did.
fn assert_underlay(lab: &Lab, underlay: Underlay) {
    let (this, other) = match underlay {
        Underlay::V4 => ("ip", "ip6"),
        Underlay::V6 => ("ip6", "ip"),
    };
    let sent: u64 = NODES.iter().map(|n| tunnel_packets(lab, n, this)).sum();
    let dropped: u64 = NODES.iter().map(|n| tunnel_packets(lab, n, other)).sum();
    assert!(sent > 0, "no tunnel packet crossed the {underlay} underlay");
    assert_eq!(dropped, 0, "tunnel packets sent over the wrong family");
}

fn v4(a: std::net::Ipv4Addr) -> Option<IpAddr> {
    Some(IpAddr::V4(a))
}

fn v6(a: std::net::Ipv6Addr) -> Option<IpAddr> {
    Some(IpAddr::V6(a))
}

/// A pod's IPv6 address in the lab.
fn pod6(lab: &Lab, pod: &str) -> std::net::Ipv6Addr {
    lab.pod(pod)
        .ok()
        .and_then(|p| p.ipv6)
        .unwrap_or_else(|| panic!("pod {pod} has no IPv6 address"))
}

/// (pod, proto, host, expected source) for the IPv6 side of the sample policy.
fn v6_table(lab: &Lab) -> Vec<(&'static str, Proto, IpAddr, Option<IpAddr>)> {
    let (a, b, c) = (
        IpAddr::V6(addr6::HOST_A),
        IpAddr::V6(addr6::HOST_B),
        IpAddr::V6(addr6::HOST_C),
    );
    let (ea, eb) = (v6(addr6::EGRESS_IP_A), v6(addr6::EGRESS_IP_B));
    vec![
        ("w1-p1", Proto::Tcp, a, ea),
        ("w1-p1", Proto::Udp, a, ea),
        ("w1-p1", Proto::Tcp, b, eb),
        ("w1-p1", Proto::Udp, b, eb),
        ("w2-p1", Proto::Tcp, a, ea),
        ("w2-p1", Proto::Udp, b, eb),
        // The pod runs on a gateway node.
        ("gw1-p1", Proto::Tcp, a, ea),
        ("gw1-p1", Proto::Udp, b, eb),
        // A destination outside every rule: untouched, over the IPv6 underlay.
        ("w1-p1", Proto::Tcp, c, v6(pod6(lab, "w1-p1"))),
        ("w1-p1", Proto::Udp, c, v6(pod6(lab, "w1-p1"))),
        // Pods no rule selects: untouched; the secondary networks stay out of reach.
        ("w1-p2", Proto::Tcp, c, v6(pod6(lab, "w1-p2"))),
        ("w1-p2", Proto::Tcp, a, None),
        ("w2-p2", Proto::Udp, b, None),
    ]
}

fn check(lab: &Lab, table: &[(&str, Proto, IpAddr, Option<IpAddr>)]) {
    let mut failures = Vec::new();
    for (pod, proto, host, want) in table {
        let got = seen(lab, pod, *proto, *host);
        if got != *want {
            failures.push(format!(
                "{pod} {proto} -> {host}: saw {got:?}, want {want:?}"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{}\ngw1 log:\n{}",
        failures.join("\n"),
        lab.agent_log("gw1")
    );
}

#[test]
fn ipv6_pods_leave_through_each_network_with_that_networks_egress_ip() {
    // An IPv6-only cluster: IPv6 pods over the IPv6 underlay.
    let lab = up_with_agents(spec_for(Family::V6).unwrap()).unwrap();
    only_underlay(&lab, Underlay::V6);
    check(&lab, &v6_table(&lab));
    assert_underlay(&lab, Underlay::V6);
    // The IPv6 egress IPs live on the secondary interfaces of one gateway each.
    for ip in [addr6::EGRESS_IP_A, addr6::EGRESS_IP_B] {
        assert!(holder(&lab, ip).is_some(), "{ip} has a holder");
    }
}

#[test]
fn ipv6_pods_over_an_ipv4_underlay() {
    let lab = up_with_agents(spec_on(Family::V6, Underlay::V4).unwrap()).unwrap();
    only_underlay(&lab, Underlay::V4);
    check(&lab, &v6_table(&lab));
    assert_underlay(&lab, Underlay::V4);
}

#[test]
fn full_size_segments_cross_the_ipv6_underlay() {
    // The IPv6 underlay costs 70 bytes: the agent sets the tunnel MTU to 1430, and SYNs
    // entering the tunnel get their MSS clamped to 1430 - 60.
    let lab = up_with_agents(spec_for(Family::V6).unwrap()).unwrap();
    only_underlay(&lab, Underlay::V6);
    // Each agent sets it once it has started (a loaded machine can hold a gateway's start
    // back after the lab answers through the other).
    for node in NODES {
        let link = || {
            let o = lab
                .exec(node, "ip", &["-o", "link", "show", "egress0"])
                .unwrap();
            String::from_utf8_lossy(&o.stdout).into_owned()
        };
        let set = wait_until(Duration::from_secs(30), || link().contains(" mtu 1430 "));
        assert!(set.is_ok(), "{node}: {}", link());
    }
    let s = lab
        .query_with(
            "w2-p1",
            &Query::new(Proto::Tcp, addr6::HOST_B, addr::ECHO_PORT)
                .size(200_000)
                .timeout(Duration::from_secs(10)),
        )
        .unwrap();
    assert_eq!(s.ip, IpAddr::V6(addr6::EGRESS_IP_B));
    let s = lab
        .query_with(
            "w1-p1",
            &Query::new(Proto::Udp, addr6::HOST_A, addr::ECHO_PORT)
                .size(1300)
                .attempts(3),
        )
        .unwrap();
    assert_eq!(s.ip, IpAddr::V6(addr6::EGRESS_IP_A));
    assert_underlay(&lab, Underlay::V6);
}

/// The dual-stack table: both families' rows.
fn dual_table(lab: &Lab) -> Vec<(&'static str, Proto, IpAddr, Option<IpAddr>)> {
    let mut table = v6_table(lab);
    let (a, b, c) = (
        IpAddr::V4(addr::HOST_A),
        IpAddr::V4(addr::HOST_B),
        IpAddr::V4(addr::HOST_C),
    );
    let (ea, eb) = (v4(addr::EGRESS_IP_A), v4(addr::EGRESS_IP_B));
    table.extend([
        ("w1-p1", Proto::Tcp, a, ea),
        ("w1-p1", Proto::Udp, b, eb),
        ("w2-p1", Proto::Udp, a, ea),
        ("gw1-p1", Proto::Tcp, b, eb),
        ("w1-p1", Proto::Tcp, c, v4(addr::W1_P1)),
        ("w1-p2", Proto::Udp, c, v4(addr::W1_P2)),
        ("w1-p2", Proto::Tcp, a, None),
    ]);
    table
}

#[test]
fn dual_stack_pods_leave_with_each_familys_egress_ip() {
    let lab = up_with_agents(spec_for(Family::Dual).unwrap()).unwrap();
    only_underlay(&lab, Underlay::V4);
    check(&lab, &dual_table(&lab));
    assert_underlay(&lab, Underlay::V4);
}

#[test]
fn dual_stack_pods_over_an_ipv6_underlay() {
    // IPv4 pods' packets in IPv6 tunnel packets, too.
    let lab = up_with_agents(spec_on(Family::Dual, Underlay::V6).unwrap()).unwrap();
    only_underlay(&lab, Underlay::V6);
    check(&lab, &dual_table(&lab));
    assert_underlay(&lab, Underlay::V6);
}

#[test]
fn when_the_ipv6_holder_fails_another_gateway_takes_the_egress_ip() {
    let mut lab = up_with_agents(spec_for(Family::V6).unwrap()).unwrap();
    let (old, _) = holder(&lab, addr6::EGRESS_IP_A).unwrap();
    let other = if old == "gw1" { "gw2" } else { "gw1" };
    lab.kill_agent(&old).unwrap();
    for l in ["sec-a", "sec-b"] {
        lab.exec(&old, "ip", &["link", "set", l, "down"]).unwrap();
    }
    lab.set_node_ready(&old, false).unwrap();
    // The new holder announces the address with an unsolicited neighbour advertisement:
    // host-a's neighbour entry for it must move without waiting for it to go stale.
    let took = wait_until(Duration::from_secs(10), || {
        holder(&lab, addr6::EGRESS_IP_A).is_some_and(|(gw, _)| gw == other)
            && seen(&lab, "w1-p1", Proto::Tcp, addr6::HOST_A) == v6(addr6::EGRESS_IP_A)
    })
    .unwrap();
    eprintln!(
        "failover of {} from {old} to {other}: {took:?}",
        addr6::EGRESS_IP_A
    );
}

#[test]
fn ping6_leaves_with_the_egress_ip_and_the_reply_comes_back() {
    let lab = up_with_agents(spec_for(Family::V6).unwrap()).unwrap();
    for (host_ns, host, egress) in [
        ("host-a", addr6::HOST_A, addr6::EGRESS_IP_A),
        ("host-b", addr6::HOST_B, addr6::EGRESS_IP_B),
    ] {
        let filter = "icmp6 and ip6[40] == 128";
        let text = ping_captured(&lab, "w1-p1", host_ns, host.into(), filter).unwrap();
        assert!(
            text.contains(&format!("IP6 {egress} > {host}: ICMP6, echo request")),
            "{host_ns} saw: {text}"
        );
    }
}

#[test]
fn fifty_concurrent_ipv6_connections_with_colliding_source_ports_get_distinct_translations() {
    let lab = up_with_agents(spec_for(Family::V6).unwrap()).unwrap();
    let mut ports = std::collections::BTreeSet::new();
    for r in colliding_connections(&lab, addr6::HOST_A.into()) {
        let s = r.expect("every connection works");
        assert_eq!(s.ip, IpAddr::V6(addr6::EGRESS_IP_A));
        ports.insert(s.port);
    }
    assert_eq!(ports.len(), 50, "translations must be distinct: {ports:?}");
}
