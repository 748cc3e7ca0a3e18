//! `destinationsFrom: Routes` end to end: the sample policy's second rule learns its
//! destinations from what the holder of egress IP B routes out of `sec-b` (network B and,
//! through rtr-b, network D). A route to network E added on both gateways makes a selected
//! pod's new traffic to E leave with egress IP B, with no policy edit; deleting it takes the
//! pod's entries for E away and E is unreachable again. A UDP stream to host-e runs through
//! it all: it is answered only while the route exists, and only ever from egress IP B.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::{Duration, Instant},
};

use aya::maps::{HashMap, Map, MapData};
use egress_common::{
    maps as names,
    policy::{PolicyKeyV4, PolicyKeyV6, PolicyValueV4, PolicyValueV6},
};
use egress_tests::{
    cluster::{seen, spec_for, up_with_agents, wait_until},
    lab::{Family, GatewayRoute, Lab, Proto, addr, addr6},
    stream::{Summary, unix_ms},
};

const POD: &str = "w1-p1";
const GATEWAYS: [&str; 2] = ["gw1", "gw2"];
/// A loose bound: the target is about a second, CI machines are noisy.
const WITHIN: Duration = Duration::from_secs(10);

/// The destination prefixes of `pod`'s entries in `node`'s pinned policy map (of the
/// pod address's family), as `ip/len`.
fn policy_prefixes(lab: &Lab, node: &str, pod: IpAddr) -> Vec<String> {
    let open = |name: &str| {
        let path = lab.bpffs_dir(node).join(name);
        let data = MapData::from_pin(&path)
            .unwrap_or_else(|e| panic!("failed to open {}: {e}", path.display()));
        Map::HashMap(data)
    };
    match pod {
        IpAddr::V4(pod) => {
            let t: HashMap<_, PolicyKeyV4, PolicyValueV4> =
                HashMap::try_from(open(names::POLICY_V4)).unwrap();
            t.keys()
                .map(Result::unwrap)
                .filter(|k| k.pod == pod.octets())
                .map(|k| format!("{}/{}", Ipv4Addr::from(k.dst), k.dst_len))
                .collect()
        }
        IpAddr::V6(pod) => {
            let t: HashMap<_, PolicyKeyV6, PolicyValueV6> =
                HashMap::try_from(open(names::POLICY_V6)).unwrap();
            t.keys()
                .map(Result::unwrap)
                .filter(|k| k.pod == pod.octets())
                .map(|k| format!("{}/{}", Ipv6Addr::from(k.dst), k.dst_len))
                .collect()
        }
    }
}

/// What a host's echo server prints for a source address (`a.b.c.d:` or `[v6]:`).
fn logged(ip: IpAddr) -> String {
    let sa = SocketAddr::new(ip, 0).to_string();
    sa.trim_end_matches('0').to_owned()
}

fn route_added_on_the_gateways_steers_new_traffic_without_a_policy_edit(family: Family) {
    let v6 = family == Family::V6;
    let lab = up_with_agents(spec_for(family).unwrap()).unwrap();
    let pod = lab.pod(POD).unwrap();
    let (pod_ip, host_d, host_e, egress, host_e_log) = if v6 {
        (
            IpAddr::V6(pod.ipv6.unwrap()),
            IpAddr::V6(addr6::HOST_D),
            IpAddr::V6(addr6::HOST_E),
            IpAddr::V6(addr6::EGRESS_IP_B),
            "host-e-v6.log",
        )
    } else {
        (
            IpAddr::V4(pod.ip),
            IpAddr::V4(addr::HOST_D),
            IpAddr::V4(addr::HOST_E),
            IpAddr::V4(addr::EGRESS_IP_B),
            "host-e.log",
        )
    };
    let (net_d, route) = (GatewayRoute::net_d(v6).prefix, GatewayRoute::net_e(v6));
    let prefixes = || policy_prefixes(&lab, "w1", pod_ip);

    // Learned from the start: B (connected) and D (the gateways' static route); not E.
    assert_eq!(seen(&lab, POD, Proto::Tcp, host_d), Some(egress));
    let before = prefixes();
    assert!(before.iter().any(|p| p == net_d), "{before:?}");
    assert!(!before.iter().any(|p| p == route.prefix), "{before:?}");

    // One UDP flow to host-e for the whole test, a datagram every 50 ms.
    let stream_log = lab.dir().join("routes-stream.log");
    let target = SocketAddr::new(host_e, addr::ECHO_PORT).to_string();
    let mut stream = lab
        .ns(POD)
        .unwrap()
        .spawn(
            &lab.spec().echo_bin,
            &[
                "stream",
                "udp",
                &target,
                "--interval-ms",
                "50",
                "--duration-ms",
                "120000",
            ],
            &stream_log,
        )
        .unwrap();
    assert_eq!(
        seen(&lab, POD, Proto::Udp, host_e),
        None,
        "E before the route"
    );

    let added_ms = unix_ms();
    let t = Instant::now();
    for gw in GATEWAYS {
        lab.add_gateway_route(gw, &route).unwrap();
    }
    wait_until(WITHIN, || {
        seen(&lab, POD, Proto::Tcp, host_e) == Some(egress)
    })
    .unwrap_or_else(|_| panic!("{POD} reaches {host_e} via {egress} after {route}"));
    eprintln!(
        "route {route} added -> new traffic leaves via {egress}: {:?}",
        t.elapsed()
    );
    assert_eq!(seen(&lab, POD, Proto::Udp, host_e), Some(egress));
    assert!(prefixes().iter().any(|p| p == route.prefix));
    let log = std::fs::read_to_string(lab.dir().join(host_e_log)).unwrap();
    let sources: Vec<&str> = log.lines().filter(|l| l.contains(" seen ")).collect();
    assert!(!sources.is_empty(), "host-e saw nothing: {log}");
    assert!(
        sources.iter().all(|l| l.contains(&logged(egress))),
        "host-e saw only {egress}: {log}"
    );

    let t = Instant::now();
    for gw in GATEWAYS {
        lab.del_gateway_route(gw, &route).unwrap();
    }
    wait_until(WITHIN, || !prefixes().iter().any(|p| p == route.prefix))
        .unwrap_or_else(|_| panic!("w1 drops {POD}'s entry for {}", route.prefix));
    let gone_ms = unix_ms();
    eprintln!(
        "route {route} deleted -> {POD}'s entry gone: {:?}",
        t.elapsed()
    );
    assert_eq!(
        seen(&lab, POD, Proto::Tcp, host_e),
        None,
        "E after the route"
    );
    assert_eq!(
        seen(&lab, POD, Proto::Udp, host_e),
        None,
        "E after the route"
    );
    // D and B are untouched.
    assert_eq!(seen(&lab, POD, Proto::Tcp, host_d), Some(egress));

    std::thread::sleep(Duration::from_millis(1000));
    stream.signal_term();
    stream.wait_for(Duration::from_secs(3)).unwrap();
    let out = std::fs::read_to_string(&stream_log).unwrap();
    let s = Summary::find_in(&out).unwrap();
    let first = s.replies_unix_ms.iter().copied().min();
    let last = s.last_reply();
    eprintln!(
        "stream: {} sent, {} replies from {:?}, the first {:?} ms after the route add",
        s.sent,
        s.received,
        s.sources,
        s.first_reply_after(added_ms),
    );
    let (first, last) = (first.unwrap(), last.unwrap());
    assert!(first >= added_ms, "no reply before the route: {out}");
    assert!(
        last <= gone_ms + 200,
        "no reply once the entry is gone: {out}"
    );
    assert!(
        s.sources.iter().all(|src| src.starts_with(&logged(egress))),
        "every reply from {egress}: {:?}",
        s.sources
    );
}

#[test]
fn a_route_added_on_the_gateways_steers_new_traffic_without_a_policy_edit() {
    route_added_on_the_gateways_steers_new_traffic_without_a_policy_edit(Family::V4);
}

#[test]
fn an_ipv6_route_added_on_the_gateways_steers_new_traffic_without_a_policy_edit() {
    route_added_on_the_gateways_steers_new_traffic_without_a_policy_edit(Family::V6);
}
