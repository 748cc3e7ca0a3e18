//! End to end for IPv6 pods (over the IPv4 underlay): the first cases of `e2e_v4`, for
//! IPv6-only pods and for dual-stack pods, whose traffic of each family must leave with
//! that family's egress IP.

use std::{net::IpAddr, time::Duration};

use egress_tests::{
    cluster::{holder, seen, spec_for, up_with_agents, wait_until},
    lab::{Family, Lab, Proto, addr, addr6},
};

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
    let lab = up_with_agents(spec_for(Family::V6).unwrap()).unwrap();
    check(&lab, &v6_table(&lab));
    // The IPv6 egress IPs live on the secondary interfaces of one gateway each.
    for ip in [addr6::EGRESS_IP_A, addr6::EGRESS_IP_B] {
        assert!(holder(&lab, ip).is_some(), "{ip} has a holder");
    }
}

#[test]
fn dual_stack_pods_leave_with_each_familys_egress_ip() {
    let lab = up_with_agents(spec_for(Family::Dual).unwrap()).unwrap();
    let mut table = v6_table(&lab);
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
    check(&lab, &table);
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
