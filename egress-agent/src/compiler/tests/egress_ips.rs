//! Several egress IPs for one rule (`egressIPs`, issue 33): each address on its own gateway
//! where there are enough, each pod on one address while it lives, only the pods of an
//! address that goes moving.

use super::*;
use crate::compiler::plans::{Dedicated, Destinations, GatewayAddr, RulePlan, Target};
use crate::compiler::routes::Prefixes;

const THREE: [&str; 3] = ["198.51.100.10", "198.51.100.11", "198.51.100.12"];

/// `count` pods of team payments, app api, spread over worker-1 and worker-2.
fn many_pods(count: usize) -> Vec<std::sync::Arc<PodSummary>> {
    (0..count)
        .map(|i| {
            let node = if i % 2 == 0 { "worker-1" } else { "worker-2" };
            let ip = format!("10.244.{}.{}", 10 + i / 200, i % 200 + 2);
            pod("shop", &format!("api-{i}"), "api", node, &ip).into()
        })
        .collect()
}

/// The base view with a third gateway (gw-3, ens224 198.51.100.4/24), `pods` pods and
/// one policy `p` whose one rule leaves by `ips`.
fn view_with(ips: &[&str], pods: usize) -> ClusterView {
    let spec = format!(
        "namespaceSelector: {{matchLabels: {{team: payments}}}}\n\
         podSelector: {{matchLabels: {{app: api}}}}\n\
         gatewaySelector: {{matchLabels: {{egress.dev/gateway: \"true\"}}}}\n\
         rules:\n- destinations: [\"192.0.2.0/24\"]\n  egressIPs: [{}]\n",
        ips.join(", ")
    );
    let mut view = with_policies(base(), vec![policy("p", &spec)]);
    view.nodes.push(node("gw-3", "10.0.0.13", true, true));
    view.egress_nodes.push(egress_node(
        "gw-3",
        &[("ens224", &["198.51.100.4/24"])],
        &[],
    ));
    view.pods = many_pods(pods);
    view
}

/// Every selected pod address (of every node) and the egress IP its entry to 192.0.2.0/24
/// carries, from each worker's compile.
fn addresses_of_pods(view: &ClusterView, peers: &PeerView) -> BTreeMap<Ipv4Addr, Ipv4Addr> {
    let mut out = BTreeMap::new();
    for me in ["worker-1", "worker-2"] {
        let c = compile_with(view, peers, me);
        for ((pod, prefix), e) in &c.desired.v4.policy {
            if prefix.to_string() == "192.0.2.0/24" {
                assert_eq!(e.action, PolicyAction::Forward, "{pod}: {e:?}");
                out.insert(
                    *pod,
                    e.egress_ip.expect("a forward entry has its egress IP"),
                );
            }
        }
    }
    out
}

#[test]
fn the_addresses_of_a_rule_go_to_distinct_gateways_and_the_pods_spread_over_them() {
    let view = view_with(&THREE, 300);
    let c = compile(&view, "worker-1");
    let holders: BTreeSet<String> = THREE
        .iter()
        .map(|ip| holder_of(&c, ip).expect("every address is held"))
        .collect();
    assert_eq!(holders.len(), 3, "one gateway each: {:?}", c.holders);
    // Each pod leaves with one of them, and each address carries a fair share.
    let by_pod = addresses_of_pods(&view, &PeerView::default());
    assert_eq!(by_pod.len(), 300);
    let mut share: BTreeMap<Ipv4Addr, u32> = BTreeMap::new();
    for egress in by_pod.values() {
        *share.entry(*egress).or_default() += 1;
    }
    assert_eq!(share.len(), 3, "{share:?}");
    for (ip, n) in &share {
        assert!((60..=140).contains(n), "{ip} carries {n} of 300 pods");
    }
    // The status says so: each address, its holder and its pods.
    let st = &c.statuses["p"];
    assert_eq!(st.egress_ips.len(), 3, "{st:?}");
    for s in &st.egress_ips {
        let ip: Ipv4Addr = s.ip.parse().expect("ip");
        assert_eq!(s.pods, Some(share[&ip]), "{s:?}");
    }
    assert_eq!(status(&c, "p", condition::READY).status, "True");
    assert!(
        !st.conditions
            .iter()
            .any(|c| c.type_ == condition::EGRESS_IPS_SHARE_GATEWAY),
        "{st:?}"
    );
    // Each address has its own wire id; the holder serves exactly its own address under
    // it, and admits exactly the pods that leave with it.
    let ids: BTreeSet<u32> = c.holders.iter().map(|h| h.rule_id).collect();
    assert_eq!(ids.len(), 3, "{:?}", c.holders);
    for h in &c.holders {
        let g = compile(&view, &h.node);
        let IpAddr::V4(ip) = h.ip else { panic!("IPv4") };
        assert_eq!(g.desired.v4.rules[&h.rule_id].egress_ip, ip);
        let admitted: BTreeSet<IpAddr> = g
            .desired
            .admitted
            .iter()
            .filter(|(_, id)| *id == h.rule_id)
            .map(|(pod, _)| *pod)
            .collect();
        let expected: BTreeSet<IpAddr> = by_pod
            .iter()
            .filter(|(_, e)| **e == ip)
            .map(|(p, _)| IpAddr::V4(*p))
            .collect();
        assert_eq!(admitted, expected, "{}", h.ip);
    }
    // A worker's entries carry the id of the pod's address.
    let w1 = compile(&view, "worker-1");
    for ((_, prefix), e) in &w1.desired.v4.policy {
        if prefix.to_string() == "192.0.2.0/24" {
            let h = c
                .holders
                .iter()
                .find(|h| Some(h.ip) == e.egress_ip.map(IpAddr::V4))
                .expect("a holder");
            assert_eq!(e.rule_id, h.rule_id);
        }
    }
    // And the worker's own pods are listed with their address.
    assert_eq!(w1.pod_routes.len(), 150);
    for r in &w1.pod_routes {
        let IpAddr::V4(pod) = r.pod_ip else {
            panic!("IPv4")
        };
        assert_eq!(r.egress_ip, Some(IpAddr::V4(by_pod[&pod])), "{r:?}");
    }
}

#[test]
fn a_failed_gateway_moves_its_address_and_no_pod_changes_address() {
    let mut view = view_with(&THREE, 300);
    let c = compile(&view, "worker-1");
    publish_holders(&mut view, &c);
    let before = addresses_of_pods(&view, &PeerView::default());
    for failed in ["gw-1", "gw-2", "gw-3"] {
        let peers = dead(&[failed]);
        let after = addresses_of_pods(&view, &peers);
        assert_eq!(after, before, "{failed} failed: pods changed address");
        let c = compile_with(&view, &peers, "worker-1");
        // Its address lives on a surviving gateway, which now holds two: said.
        let holders: Vec<String> = THREE
            .iter()
            .map(|ip| holder_of(&c, ip).expect("held"))
            .collect();
        assert!(!holders.iter().any(|h| h == failed), "{holders:?}");
        let shared = status(&c, "p", condition::EGRESS_IPS_SHARE_GATEWAY);
        assert_eq!(shared.reason, reason::FEWER_GATEWAYS_THAN_EGRESS_IPS);
        assert!(
            shared
                .message
                .contains("rules[0].egressIPs: fewer eligible gateways"),
            "{shared:?}"
        );
        assert_eq!(status(&c, "p", condition::READY).status, "True");
    }
}

#[test]
fn a_returning_gateway_takes_back_one_address_from_a_gateway_holding_two() {
    let mut view = view_with(&THREE, 30);
    let c = compile(&view, "worker-1");
    publish_holders(&mut view, &c);
    let failed = holder_of(&c, THREE[2]).expect("held");
    let peers = dead(&[&failed]);
    let c = compile_with(&view, &peers, "worker-1");
    publish_holders(&mut view, &c);
    let sharing = holder_of(&c, THREE[2]).expect("held");
    assert_ne!(sharing, failed);
    // Back: the later address of the two on one gateway moves to the free one, planned
    // (Rebalanced, a newer epoch); the others stay where they are.
    let back = compile(&view, "worker-1");
    let moved: Vec<&Holder> = back
        .holders
        .iter()
        .filter(|h| {
            let before = c
                .holders
                .iter()
                .find(|b| b.ip == h.ip)
                .expect("held before");
            before.node != h.node
        })
        .collect();
    assert_eq!(moved.len(), 1, "{:?}", back.holders);
    assert_eq!(moved[0].node, failed);
    assert_eq!(moved[0].reason, move_reason::REBALANCED);
    let holders: BTreeSet<String> = THREE
        .iter()
        .map(|ip| holder_of(&back, ip).expect("held"))
        .collect();
    assert_eq!(holders.len(), 3);
    // Stable: compiling again with the move published moves nothing.
    publish_holders(&mut view, &back);
    let again = compile(&view, "worker-1");
    for ip in THREE {
        assert_eq!(holder_of(&again, ip), holder_of(&back, ip), "{ip}");
    }
}

#[test]
fn fewer_gateways_than_addresses_share_and_say_so() {
    let mut view = view_with(
        &[
            "198.51.100.10",
            "198.51.100.11",
            "198.51.100.12",
            "198.51.100.13",
        ],
        40,
    );
    // Only gw-1 and gw-2 host the subnet.
    view.egress_nodes
        .retain(|en| en.metadata.name.as_deref() != Some("gw-3"));
    view.nodes
        .retain(|n| n.metadata.name.as_deref() != Some("gw-3"));
    let c = compile(&view, "worker-1");
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for h in c.holders.iter().filter(|h| !h.shared) {
        *per_node.entry(h.node.clone()).or_default() += 1;
    }
    assert_eq!(
        per_node.values().copied().collect::<Vec<_>>(),
        [2, 2],
        "{per_node:?}"
    );
    let shared = status(&c, "p", condition::EGRESS_IPS_SHARE_GATEWAY);
    assert!(
        shared
            .message
            .contains("(2) than the rule has addresses (4)"),
        "{shared:?}"
    );
    assert!(
        c.problems
            .iter()
            .any(|p| p.reason == reason::FEWER_GATEWAYS_THAN_EGRESS_IPS),
        "{:?}",
        c.problems
    );
}

/// A dedicated rule with `n` addresses, `held` of them with a holder.
fn rule_with(n: usize, held: &[bool]) -> RulePlan {
    let addresses = (0..n)
        .map(|k| {
            let ip = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 10 + k as u8));
            Dedicated {
                ip,
                name: ip.to_string(),
                id: 100 + k as u32,
                holder: held[k].then(|| GatewayAddr {
                    node: format!("gw-{k}"),
                    underlay: IpAddr::V4(Ipv4Addr::new(10, 0, 0, 10 + k as u8)),
                    interface: "ens224".to_owned(),
                    ip,
                    prefix_len: 24,
                    epoch: 1,
                    reason: move_reason::ASSIGNED,
                    since: None,
                }),
            }
        })
        .collect();
    RulePlan {
        index: 0,
        rule_id: 7,
        destinations: Destinations::Listed(Prefixes::default()),
        target: Target::Dedicated { addresses },
    }
}

#[test]
fn losing_any_one_address_moves_only_its_own_pods() {
    // Rendezvous: over many pods and every single failure, a pod changes address only
    // when its own address lost every holder; the failed address's pods spread over all
    // the others.
    let pods: Vec<IpAddr> = (0..5000u32)
        .map(|i| IpAddr::V4(Ipv4Addr::from(0x0af4_0000 + i)))
        .collect();
    for n in 2..=5 {
        let all = rule_with(n, &vec![true; n]);
        let before: Vec<IpAddr> = pods
            .iter()
            .map(|p| all.route_for(*p).egress_ip.expect("an address"))
            .collect();
        for failed in 0..n {
            let mut held = vec![true; n];
            held[failed] = false;
            let rule = rule_with(n, &held);
            let failed_ip = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 10 + failed as u8));
            let mut landed: BTreeMap<IpAddr, u32> = BTreeMap::new();
            for (pod, was) in pods.iter().zip(&before) {
                let route = rule.route_for(*pod);
                let now = route.egress_ip.expect("an address");
                assert!(route.gateway.is_some());
                if *was == failed_ip {
                    assert_ne!(now, failed_ip);
                    *landed.entry(now).or_default() += 1;
                } else {
                    assert_eq!(now, *was, "pod {pod} moved though {was} lives");
                }
                // The id is the address's own.
                let k = usize::from(match now {
                    IpAddr::V4(a) => a.octets()[3] - 10,
                    IpAddr::V6(_) => unreachable!(),
                });
                assert_eq!(route.id, 100 + k as u32);
            }
            assert_eq!(landed.len(), n - 1, "n={n} failed={failed}: {landed:?}");
        }
        // With none held, each pod keeps naming its address (for the failure policy's
        // entry), without a gateway.
        let none = rule_with(n, &vec![false; n]);
        for (pod, was) in pods.iter().zip(&before) {
            let route = none.route_for(*pod);
            assert_eq!(route.egress_ip, Some(*was));
            assert!(route.gateway.is_none());
        }
    }
}

#[test]
fn egress_ips_are_checked_naming_the_field() {
    let cases = [
        (
            "[198.51.100.10, 198.51.100.10]",
            "rules[0].egressIPs[1]: 198.51.100.10 is listed already (egressIPs[0])",
        ),
        (
            "[198.51.100.10, gw-a]",
            "rules[0].egressIPs[1]: invalid IP address \"gw-a\"",
        ),
        (
            "[198.51.100.10, \"2001:db8:a::10\"]",
            "rules[0].egressIPs[1]: 2001:db8:a::10 is IPv6 but egressIPs[0] is IPv4",
        ),
        (
            "[\"2001:db8:a::10\"]",
            "rules[0].egressIPs[0]: 2001:db8:a::10 is IPv6 but the destinations are IPv4",
        ),
    ];
    for (list, message) in cases {
        let view = view_with(&[list.trim_matches(['[', ']'])], 4);
        let c = compile(&view, "worker-1");
        let accepted = status(&c, "p", condition::ACCEPTED);
        assert_eq!(accepted.status, "False", "{list}");
        assert!(accepted.message.contains(message), "{list}: {accepted:?}");
    }
    // With egressIP or interface as well.
    let mut view = view_with(&THREE, 4);
    view.policies[0].spec.rules[0].egress_ip = Some("198.51.100.20".to_owned());
    let c = compile(&view, "worker-1");
    assert!(
        status(&c, "p", condition::ACCEPTED)
            .message
            .contains("rules[0]: exactly one of egressIP, egressIPs or interface must be set")
    );
}

#[test]
fn an_address_of_a_list_that_another_policy_owns_is_refused_by_name() {
    let mut view = view_with(&THREE, 4);
    let mut older = policy(
        "a-older",
        "gatewaySelector: {matchLabels: {egress.dev/gateway: \"true\"}}\n\
         rules:\n- destinations: [\"192.0.3.0/24\"]\n  egressIP: 198.51.100.11\n",
    );
    older.metadata.creation_timestamp = None;
    view.policies.push(older);
    let c = compile(&view, "worker-1");
    let ready = status(&c, "p", condition::READY);
    assert!(
        ready
            .message
            .contains("rules[0].egressIPs[1]: 198.51.100.11 is policy a-older's"),
        "{ready:?}"
    );
    // The other two still serve p's pods, which all leave with one of them.
    let by_pod = addresses_of_pods(&view, &PeerView::default());
    assert_eq!(by_pod.len(), 4);
    assert!(
        by_pod.values().all(|e| e.to_string() != THREE[1]),
        "{by_pod:?}"
    );
}

#[test]
fn an_egress_ip_keeps_its_wire_id_when_the_rule_turns_into_a_list() {
    let single = {
        let mut view = view_with(&THREE[..1], 4);
        let rule = &mut view.policies[0].spec.rules[0];
        rule.egress_ip = rule.egress_ips.pop();
        compile(&view, "worker-1")
    };
    let listed = compile(&view_with(&THREE, 4), "worker-1");
    let id_of = |c: &Compiled, ip: &str| {
        let ip: IpAddr = ip.parse().expect("ip");
        c.holders.iter().find(|h| h.ip == ip).map(|h| h.rule_id)
    };
    assert_eq!(id_of(&single, THREE[0]), Some(rule_id("p", 0)));
    assert_eq!(id_of(&listed, THREE[0]), Some(rule_id("p", 0)));
    // The others keep theirs when the list changes around them.
    let fewer = compile(&view_with(&[THREE[0], THREE[2]], 4), "worker-1");
    assert_eq!(id_of(&fewer, THREE[2]), id_of(&listed, THREE[2]));
}

#[test]
fn learned_destinations_follow_the_gateway_of_each_pods_address() {
    // gw-1 routes 10.50.0.0/16 out of ens224, gw-2 routes 10.60.0.0/16: each pod learns
    // the routes of the gateway that holds its address.
    let spec = "namespaceSelector: {matchLabels: {team: payments}}\n\
                podSelector: {matchLabels: {app: api}}\n\
                gatewaySelector: {matchLabels: {egress.dev/gateway: \"true\"}}\n\
                rules:\n- {destinationsFrom: Routes, egressIPs: [198.51.100.10, 198.51.100.11]}\n";
    let mut view = with_policies(base(), vec![policy("p", spec)]);
    view.pods = many_pods(40);
    super::routes::set_routes(&mut view, "gw-1", "ens224", &["10.50.0.0/16"]);
    super::routes::set_routes(&mut view, "gw-2", "ens224", &["10.60.0.0/16"]);
    let c = compile(&view, "worker-1");
    let holder: BTreeMap<IpAddr, String> =
        c.holders.iter().map(|h| (h.ip, h.node.clone())).collect();
    assert_eq!(holder.len(), 2, "{:?}", c.holders);
    let mut seen = BTreeSet::new();
    for ((pod, prefix), e) in &c.desired.v4.policy {
        let egress = IpAddr::V4(e.egress_ip.expect("forward entries name the address"));
        let want = match holder[&egress].as_str() {
            "gw-1" => "10.50.0.0/16",
            _ => "10.60.0.0/16",
        };
        assert_eq!(prefix.to_string(), want, "{pod} leaves by {egress}");
        seen.insert(egress);
    }
    assert_eq!(seen.len(), 2, "pods on both addresses");
}

#[test]
fn an_address_of_a_list_in_another_rule_is_refused_naming_both() {
    let spec = "namespaceSelector: {matchLabels: {team: payments}}\n\
                podSelector: {matchLabels: {app: api}}\n\
                gatewaySelector: {matchLabels: {egress.dev/gateway: \"true\"}}\n\
                rules:\n\
                - {destinations: [192.0.2.0/24], egressIPs: [198.51.100.10, 198.51.100.11]}\n\
                - {destinations: [192.0.3.0/24], egressIP: 198.51.100.11}\n\
                - {destinations: [192.0.4.0/24], egressIP: 198.51.100.20}\n\
                - {destinations: [192.0.5.0/24], egressIP: 198.51.100.20}\n";
    let view = with_policies(base(), vec![policy("p", spec)]);
    let c = compile(&view, "worker-1");
    let accepted = status(&c, "p", condition::ACCEPTED);
    assert_eq!(accepted.status, "False");
    assert!(
        accepted.message.contains(
            "rules[1].egressIP: 198.51.100.11 is also in rules[0]: an address of an \
             egressIPs list belongs to that rule alone"
        ),
        "{accepted:?}"
    );
    // Two rules naming one egressIP (no list) stay allowed, as before.
    assert!(!accepted.message.contains("rules[3]"), "{accepted:?}");
    // The refused rule follows the failure policy; the list's rule is served.
    let pod: Ipv4Addr = "10.244.1.11".parse().expect("pod");
    let entry = |prefix: &str| {
        c.desired
            .v4
            .policy
            .iter()
            .find(|((p, n), _)| *p == pod && n.to_string() == prefix)
            .map(|(_, e)| e.action)
    };
    assert_eq!(entry("192.0.3.0/24"), Some(PolicyAction::NoGatewayDrop));
    assert_eq!(entry("192.0.2.0/24"), Some(PolicyAction::Forward));
}
