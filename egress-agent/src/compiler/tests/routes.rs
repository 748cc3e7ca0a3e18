//! `destinationsFrom: Routes`: destinations learned from the routes each gateway publishes
//! out of the rule's interface.

use super::*;

/// Set the routes `node` publishes out of `iface` (an interface it already lists).
pub(super) fn set_routes(view: &mut ClusterView, node: &str, iface: &str, routes: &[&str]) {
    let en = view
        .egress_nodes
        .iter_mut()
        .find(|en| en.metadata.name.as_deref() == Some(node))
        .expect("test EgressNode");
    let status = en.status.as_mut().expect("test EgressNode status");
    let entry = status
        .interfaces
        .iter_mut()
        .find(|i| i.name == iface)
        .expect("test interface");
    entry.routes = routes.iter().map(|r| (*r).to_owned()).collect();
}

/// Set the same routes out of `iface` on both gateways of the base view.
fn set_routes_on_both(view: &mut ClusterView, iface: &str, routes: &[&str]) {
    for gw in ["gw-1", "gw-2"] {
        set_routes(view, gw, iface, routes);
    }
}

/// The base cluster where both gateways route 198.51.100.0/24 (connected) and
/// 10.50.0.0/16 (static) out of ens224, and 203.0.113.0/24 out of ens256.
fn routed() -> ClusterView {
    let mut view = base();
    set_routes_on_both(&mut view, "ens224", &["198.51.100.0/24", "10.50.0.0/16"]);
    set_routes_on_both(&mut view, "ens256", &["203.0.113.0/24"]);
    view
}

/// The address of pod shop/api-1, selected and local to worker-1.
const API_1: &str = "10.244.1.11";

/// What worker-1 compiles from `view` with `spec` as its one policy, `p`.
fn compile_p(view: ClusterView, spec: &str) -> Compiled {
    compile(&with_policies(view, vec![policy("p", spec)]), "worker-1")
}

pub(super) const LEARNED: &str = r#"
namespaceSelector: {matchLabels: {team: payments}}
podSelector: {matchLabels: {app: api}}
gatewaySelector: {matchLabels: {egress.dev/gateway: "true"}}
rules:
- {destinationsFrom: Routes, egressIP: 198.51.100.10}
"#;

/// A spec selecting the `api` pods of team payments, over every gateway, with `rules`.
fn with_rules(rules: &str) -> String {
    format!(
        "namespaceSelector: {{matchLabels: {{team: payments}}}}\n\
         podSelector: {{matchLabels: {{app: api}}}}\n\
         gatewaySelector: {{matchLabels: {{egress.dev/gateway: \"true\"}}}}\n\
         rules:\n{rules}\n"
    )
}

/// The source entries of `pod` on its node, as (prefix, action, gateway node name).
fn entries_v4(c: &Compiled, pod: &str) -> Vec<(String, PolicyAction, Option<IpAddr>)> {
    let pod = ip(pod);
    c.desired
        .v4
        .policy
        .iter()
        .filter(|((p, _), _)| *p == pod)
        .map(|((_, prefix), e)| (prefix.to_string(), e.action, e.gateway))
        .collect()
}

fn prefixes_v4(c: &Compiled, pod: &str, action: PolicyAction) -> Vec<String> {
    entries_v4(c, pod)
        .into_iter()
        .filter(|(_, a, _)| *a == action)
        .map(|(p, _, _)| p)
        .collect()
}

/// The prefixes api-1 forwards to a gateway.
fn forwarded(c: &Compiled) -> Vec<String> {
    prefixes_v4(c, API_1, PolicyAction::Forward)
}

/// The prefixes api-1 keeps off the gateway.
fn excluded(c: &Compiled) -> Vec<String> {
    prefixes_v4(c, API_1, PolicyAction::Exclude)
}

#[test]
fn a_rule_learns_the_holders_routes_out_of_the_egress_ips_interface() {
    let view = with_policies(routed(), vec![policy("p", LEARNED)]);
    let c = compile(&view, "worker-1");
    let holder = holder_of(&c, "198.51.100.10").expect("a holder");
    let gw = underlay_of(&view, &holder);
    assert_eq!(
        entries_v4(&c, API_1),
        vec![
            ("10.50.0.0/16".to_owned(), PolicyAction::Forward, Some(gw)),
            (
                "198.51.100.0/24".to_owned(),
                PolicyAction::Forward,
                Some(gw)
            ),
        ],
        "the holder's ens224 routes, not ens256's"
    );
    assert_eq!(status(&c, "p", condition::READY).status, "True");
    assert!(
        c.statuses["p"]
            .conditions
            .iter()
            .all(|c| c.type_ != condition::ROUTES_DEGRADED),
        "gateways agree: {:?}",
        c.statuses["p"]
    );
    // The unselected pod and the other worker's pods get nothing here.
    assert!(entries_v4(&c, "10.244.1.21").is_empty());
    assert!(entries_v4(&c, "10.244.2.13").is_empty());
}

#[test]
fn a_route_added_or_removed_on_the_gateways_changes_the_entries_without_a_policy_edit() {
    let mut view = with_policies(routed(), vec![policy("p", LEARNED)]);
    let before = compile(&view, "worker-1");
    set_routes_on_both(
        &mut view,
        "ens224",
        &["198.51.100.0/24", "10.50.0.0/16", "10.60.0.0/16"],
    );
    let added = compile(&view, "worker-1");
    assert_eq!(
        forwarded(&added),
        ["10.50.0.0/16", "10.60.0.0/16", "198.51.100.0/24"]
    );
    assert_eq!(before.statuses, added.statuses, "no status churn");
    set_routes_on_both(&mut view, "ens224", &["198.51.100.0/24"]);
    let removed = compile(&view, "worker-1");
    assert_eq!(forwarded(&removed), ["198.51.100.0/24"]);
}

#[test]
fn default_routes_only_with_include_default_and_then_the_cluster_is_carved_out() {
    let mut view = routed();
    view.cluster_cidrs = vec!["10.96.0.0/12".parse().expect("cidr")];
    set_routes_on_both(&mut view, "ens224", &["0.0.0.0/0", "198.51.100.0/24"]);
    let without = compile_p(view.clone(), LEARNED);
    assert_eq!(forwarded(&without), ["198.51.100.0/24"]);
    let with = LEARNED.replace("egressIP:", "includeDefault: true, egressIP:");
    let c = compile_p(view, &with);
    assert_eq!(forwarded(&c), ["0.0.0.0/0", "198.51.100.0/24"]);
    // The service CIDR, every node's underlay and every running pod's address stay off
    // the gateway, and so does what the gateways route out of another interface (ens256).
    assert_eq!(
        excluded(&c),
        [
            "10.0.0.1/32",
            "10.0.0.2/32",
            "10.0.0.11/32",
            "10.0.0.12/32",
            "10.96.0.0/12",
            "10.244.1.11/32",
            "10.244.1.12/32",
            "10.244.1.21/32",
            "10.244.1.99/32",
            "10.244.2.13/32",
            "203.0.113.0/24"
        ]
    );
}

#[test]
fn routes_that_overlap_the_cluster_are_ignored_and_reported() {
    let mut view = routed();
    view.cluster_cidrs = vec!["10.96.0.0/12".parse().expect("cidr")];
    set_routes_on_both(
        &mut view,
        "ens224",
        &[
            "198.51.100.0/24",
            "10.244.0.0/16", // holds pods
            "10.0.0.0/24",   // holds node underlays
            "10.100.0.0/16", // inside the service CIDR
            "10.50.0.0/16",
        ],
    );
    let c = compile_p(view, LEARNED);
    assert_eq!(forwarded(&c), ["10.50.0.0/16", "198.51.100.0/24"]);
    let degraded = status(&c, "p", condition::ROUTES_DEGRADED);
    assert_eq!(degraded.status, "True");
    assert_eq!(degraded.reason, reason::ROUTES_OVERLAP_CLUSTER);
    for needle in [
        "rules[0].destinationsFrom",
        "10.244.0.0/16 (address 10.244.1.11 of pod shop/api-1)",
        "10.0.0.0/24 (address 10.0.0.1 of node worker-1)",
        "10.100.0.0/16 (cluster CIDR 10.96.0.0/12)",
        "ignored",
    ] {
        assert!(
            degraded.message.contains(needle),
            "{needle:?} in {degraded:?}"
        );
    }
    assert_eq!(status(&c, "p", condition::READY).status, "True");
    assert!(
        c.problems
            .iter()
            .any(|p| p.reason == reason::ROUTES_OVERLAP_CLUSTER)
    );
}

/// gw-1 routes 10.50.0.0/16 out of ens224, gw-2 10.70.0.0/16 instead.
fn disagreeing() -> ClusterView {
    let mut view = routed();
    set_routes(
        &mut view,
        "gw-1",
        "ens224",
        &["198.51.100.0/24", "10.50.0.0/16"],
    );
    set_routes(
        &mut view,
        "gw-2",
        "ens224",
        &["198.51.100.0/24", "10.70.0.0/16"],
    );
    view
}

#[test]
fn gateways_that_disagree_are_named_and_traffic_follows_the_holders_routes() {
    let mut view = disagreeing();
    let c = compile_p(view.clone(), LEARNED);
    let degraded = status(&c, "p", condition::ROUTES_DEGRADED);
    assert_eq!(degraded.reason, reason::ROUTES_DISAGREE);
    assert!(
        degraded.message.contains(
            "out of ens224, gw-1 and gw-2 route different prefixes (only gw-1: 10.50.0.0/16; \
             only gw-2: 10.70.0.0/16)"
        ),
        "{degraded:?}"
    );
    let holder = holder_of(&c, "198.51.100.10").expect("a holder");
    let expected = if holder == "gw-1" {
        ["10.50.0.0/16", "198.51.100.0/24"]
    } else {
        ["10.70.0.0/16", "198.51.100.0/24"]
    };
    assert_eq!(forwarded(&c), expected, "held by {holder}");
    // The other gateway takes over (the holder is not Ready): its routes follow.
    let other = if holder == "gw-1" { "gw-2" } else { "gw-1" };
    mark_not_ready(&mut view, &holder);
    let after = compile_p(view, LEARNED);
    assert_eq!(holder_of(&after, "198.51.100.10").as_deref(), Some(other));
    let expected = if other == "gw-1" {
        ["10.50.0.0/16", "198.51.100.0/24"]
    } else {
        ["10.70.0.0/16", "198.51.100.0/24"]
    };
    assert_eq!(forwarded(&after), expected);
}

#[test]
fn more_specific_routes_out_of_other_interfaces_are_carved_out() {
    let mut view = routed();
    set_routes_on_both(&mut view, "ens224", &["10.50.0.0/16", "198.51.100.0/24"]);
    // Inside 10.50.0.0/16, one /24 leaves by ens256 instead.
    set_routes_on_both(&mut view, "ens256", &["10.50.7.0/24", "203.0.113.0/24"]);
    let c = compile_p(view, LEARNED);
    assert_eq!(forwarded(&c), ["10.50.0.0/16", "198.51.100.0/24"]);
    assert_eq!(excluded(&c), ["10.50.7.0/24"]);
}

#[test]
fn listed_destinations_win_over_the_same_learned_prefix_and_longest_prefix_wins_across_both() {
    let spec = with_rules(
        r#"- {destinationsFrom: Routes, egressIP: 198.51.100.10}
- {destinations: ["10.50.0.0/16", "10.50.9.0/24"], interface: ens256}"#,
    );
    let c = compile_p(routed(), &spec);
    let entries = entries_v4(&c, API_1);
    let rule_of = |prefix: &str| {
        c.desired
            .v4
            .policy
            .iter()
            .find(|((p, n), _)| *p == ip(API_1) && n.to_string() == prefix)
            .map(|(_, e)| e.rule_id)
    };
    assert_eq!(
        rule_of("10.50.0.0/16"),
        Some(rule_id("p", 1)),
        "listed wins"
    );
    assert_eq!(rule_of("10.50.9.0/24"), Some(rule_id("p", 1)));
    assert_eq!(
        rule_of("198.51.100.0/24"),
        Some(rule_id("p", 0)),
        "{entries:?}"
    );
    assert!(
        c.statuses["p"]
            .conditions
            .iter()
            .all(|c| c.type_ != condition::CONFLICT),
        "a listed destination over a learned one is no conflict: {:?}",
        c.statuses["p"]
    );
}

#[test]
fn except_applies_inside_learned_destinations() {
    let spec = LEARNED.replace(
        "egressIP: 198.51.100.10",
        "except: [10.50.3.0/24, 10.51.0.0/16], egressIP: 198.51.100.10",
    );
    let mut view = routed();
    set_routes_on_both(
        &mut view,
        "ens224",
        &["10.50.0.0/16", "10.51.4.0/24", "198.51.100.0/24"],
    );
    let c = compile_p(view, &spec);
    assert_eq!(
        forwarded(&c),
        ["10.50.0.0/16", "198.51.100.0/24"],
        "10.51.4.0/24 lies inside an except"
    );
    assert_eq!(excluded(&c), ["10.50.3.0/24"]);
}

#[test]
fn with_no_gateway_the_failure_policy_covers_every_route_a_selected_gateway_publishes() {
    let mut view = disagreeing();
    for gw in ["gw-1", "gw-2"] {
        mark_not_ready(&mut view, gw);
    }
    let c = compile_p(view, LEARNED);
    assert_eq!(holder_of(&c, "198.51.100.10"), None);
    assert_eq!(
        prefixes_v4(&c, API_1, PolicyAction::NoGatewayDrop),
        ["10.50.0.0/16", "10.70.0.0/16", "198.51.100.0/24"]
    );
}

#[test]
fn an_interface_rule_learns_each_family_from_the_gateway_each_pod_is_spread_to() {
    let spec = with_rules("- {destinationsFrom: Routes, interface: ens256}");
    let mut view = routed();
    dual_stack_gateways(&mut view);
    dual_stack_pods(&mut view);
    set_routes(
        &mut view,
        "gw-1",
        "ens256",
        &[
            "203.0.113.0/24",
            "10.81.0.0/16",
            "2001:db8:b::/64",
            "2001:db8:81::/48",
        ],
    );
    set_routes(
        &mut view,
        "gw-2",
        "ens256",
        &[
            "203.0.113.0/24",
            "10.82.0.0/16",
            "2001:db8:b::/64",
            "2001:db8:82::/48",
        ],
    );
    let c = compile_p(view.clone(), &spec);
    let by_gateway: BTreeMap<IpAddr, &str> = [
        (underlay_of(&view, "gw-1"), "gw-1"),
        (underlay_of(&view, "gw-2"), "gw-2"),
    ]
    .into();
    // Each pod address (of either family) gets its own gateway's prefixes, never the
    // other's.
    let v4 = as_text(&c.desired.v4);
    let v6 = as_text(&c.desired.v6);
    for (pod, prefix, gateway) in v4.into_iter().chain(v6) {
        let gw = by_gateway[&gateway.expect("forward")];
        let others = if gw == "gw-1" {
            ["10.82.0.0/16", "2001:db8:82::/48"]
        } else {
            ["10.81.0.0/16", "2001:db8:81::/48"]
        };
        assert!(
            !others.contains(&prefix.as_str()),
            "{pod} via {gw}: {prefix}"
        );
    }
    assert!(c.desired.v6.policy.values().all(|e| e.egress_ip.is_some()));
    assert!(
        !c.desired.v6.policy.is_empty(),
        "IPv6 routes are learned too"
    );
    let degraded = status(&c, "p", condition::ROUTES_DEGRADED);
    assert_eq!(degraded.reason, reason::ROUTES_DISAGREE);
    assert_eq!(status(&c, "p", condition::READY).status, "True");
    // Every local pod address has its gateway's own prefix.
    for pod in [API_1, "10.244.1.12"] {
        let forwards = prefixes_v4(&c, pod, PolicyAction::Forward);
        assert_eq!(forwards.len(), 2, "{pod}: {forwards:?}");
        assert!(forwards.contains(&"203.0.113.0/24".to_owned()));
    }
}

/// Every source entry of one family as (pod, prefix, gateway), addresses as text.
fn as_text<F: crate::family::Family>(
    d: &crate::desired::FamilyDesired<F>,
) -> Vec<(String, String, Option<IpAddr>)> {
    d.policy
        .iter()
        .map(|((pod, prefix), e)| (pod.to_string(), prefix.to_string(), e.gateway))
        .collect()
}

#[test]
fn ipv6_egress_ip_rules_learn_only_ipv6_routes() {
    let spec = with_rules(r#"- {destinationsFrom: Routes, egressIP: "2001:db8:a::10"}"#);
    let mut view = routed();
    dual_stack_gateways(&mut view);
    dual_stack_pods(&mut view);
    set_routes_on_both(
        &mut view,
        "ens224",
        &[
            "198.51.100.0/24",
            "2001:db8:a::/64",
            "2001:db8:99::/48",
            "::/0",
        ],
    );
    let c = compile_p(view, &spec);
    assert!(c.desired.v4.policy.is_empty(), "{:?}", c.desired.v4.policy);
    let v6: BTreeSet<String> = c
        .desired
        .v6
        .policy
        .keys()
        .map(|(_, n)| n.to_string())
        .collect();
    assert_eq!(
        v6,
        BTreeSet::from(["2001:db8:a::/64".to_owned(), "2001:db8:99::/48".to_owned()])
    );
}

#[test]
fn a_gateway_over_the_route_cap_is_reported_not_silently_truncated() {
    let mut view = routed();
    for en in &mut view.egress_nodes {
        let status = en.status.as_mut().expect("status");
        for i in &mut status.interfaces {
            if i.name == "ens224" {
                i.routes_omitted = 3_616;
            }
        }
    }
    let c = compile_p(view, LEARNED);
    let degraded = status(&c, "p", condition::ROUTES_DEGRADED);
    assert_eq!(degraded.reason, reason::ROUTES_TRUNCATED);
    assert!(
        degraded
            .message
            .contains("3616 left out, over the cap of 16384")
    );
}

#[test]
fn ten_thousand_routes_compile_into_entries_for_each_local_pod() {
    let mut view = routed();
    let routes: Vec<String> = (0..10_000u32)
        .map(|i| format!("10.{}.{}.0/24", 100 + i / 256, i % 256))
        .collect();
    let refs: Vec<&str> = routes.iter().map(String::as_str).collect();
    set_routes_on_both(&mut view, "ens224", &refs);
    let c = compile_p(view, LEARNED);
    // api-1 and api-2 are local: 10k entries each.
    assert_eq!(c.desired.v4.policy.len(), 20_000);
    assert_eq!(c.desired.v4.selected[&ip(API_1)], 10_000);
}

#[test]
fn a_rule_gives_exactly_one_of_destinations_and_destinations_from() {
    let cases = [
        (
            "- {destinations: [192.0.2.0/24], destinationsFrom: Routes, egressIP: 198.51.100.10}",
            reason::INVALID_DESTINATIONS,
            "rules[0].destinationsFrom: exactly one of destinations or destinationsFrom",
        ),
        (
            "- {egressIP: 198.51.100.10}",
            reason::NO_DESTINATIONS,
            "rules[0].destinations: at least one destination is required (or destinationsFrom",
        ),
        (
            "- {destinations: [192.0.2.0/24], includeDefault: true, egressIP: 198.51.100.10}",
            reason::INVALID_DESTINATIONS,
            "rules[0].includeDefault: applies only with destinationsFrom",
        ),
    ];
    for (rule, want_reason, want_message) in cases {
        let spec = format!(
            "gatewaySelector: {{matchLabels: {{egress.dev/gateway: \"true\"}}}}\nrules:\n{rule}\n"
        );
        let c = compile_p(routed(), &spec);
        let accepted = status(&c, "p", condition::ACCEPTED);
        assert_eq!(accepted.status, "False", "{rule}");
        assert_eq!(accepted.reason, want_reason, "{rule}");
        assert!(
            accepted.message.contains(want_message),
            "{rule}: {accepted:?}"
        );
    }
}

/// The base view with the gateways' underlay interface (eth0, 10.0.0.0/24) in their
/// EgressNodes.
fn with_underlay_interface(mut view: ClusterView) -> ClusterView {
    for (gw, address) in [("gw-1", "10.0.0.11/24"), ("gw-2", "10.0.0.12/24")] {
        let en = view
            .egress_nodes
            .iter_mut()
            .find(|en| en.metadata.name.as_deref() == Some(gw))
            .expect("test EgressNode");
        en.status
            .as_mut()
            .expect("status")
            .interfaces
            .push(crate::api::NodeInterface {
                name: "eth0".to_owned(),
                up: true,
                addresses: vec![address.to_owned()],
                ..Default::default()
            });
    }
    view
}

#[test]
fn a_route_into_the_underlay_subnet_is_refused_even_where_it_holds_no_node() {
    // The issue's probe: 10.0.0.0/25 holds every node, 10.0.0.128/30 none; both are part
    // of the underlay subnet, which the gateways reach out of eth0.
    let mut view = with_underlay_interface(routed());
    set_routes_on_both(
        &mut view,
        "ens224",
        &["198.51.100.0/24", "10.0.0.0/25", "10.0.0.128/30"],
    );
    let c = compile_p(view, LEARNED);
    assert_eq!(forwarded(&c), ["198.51.100.0/24"]);
    let degraded = status(&c, "p", condition::ROUTES_DEGRADED);
    assert_eq!(degraded.reason, reason::ROUTES_OVERLAP_CLUSTER);
    assert!(
        degraded
            .message
            .contains("10.0.0.128/30 (underlay subnet 10.0.0.0/24 (eth0 of node gw-1))"),
        "{degraded:?}"
    );
    assert!(degraded.message.contains("10.0.0.0/25"), "{degraded:?}");
}

#[test]
fn a_listed_destination_over_the_cluster_has_the_cluster_carved_out_and_says_so() {
    let mut view = with_underlay_interface(base());
    view.cluster_cidrs = vec![
        "10.244.0.0/16".parse().expect("cidr"),
        "10.96.0.0/12".parse().expect("cidr"),
    ];
    let spec = with_rules("- {destinations: [192.0.2.0/24, 0.0.0.0/0], egressIP: 198.51.100.10}");
    let c = compile_p(view, &spec);
    // The pod and service CIDRs (the pods are inside the first) and the underlay subnet
    // (every node is inside it): nothing else.
    assert_eq!(
        excluded(&c),
        ["10.0.0.0/24", "10.96.0.0/12", "10.244.0.0/16"]
    );
    let excluded = status(&c, "p", condition::CLUSTER_EXCLUDED);
    assert_eq!(excluded.status, "True");
    assert_eq!(excluded.reason, reason::DESTINATIONS_COVER_CLUSTER);
    assert!(
        excluded
            .message
            .starts_with("rules[0].destinations[1]: 0.0.0.0/0 covers the cluster's own addresses"),
        "{excluded:?}"
    );
    assert!(excluded.message.contains("cluster CIDR 10.244.0.0/16"));
    assert!(
        !excluded.message.contains("destinations[0]"),
        "{excluded:?}"
    );
    // Served all the same.
    assert_eq!(status(&c, "p", condition::READY).status, "True");
    assert!(
        c.problems
            .iter()
            .any(|p| p.reason == reason::DESTINATIONS_COVER_CLUSTER)
    );
}

#[test]
fn a_listed_destination_inside_the_cluster_is_carved_out_whole() {
    let mut view = base();
    view.cluster_cidrs = vec!["10.96.0.0/12".parse().expect("cidr")];
    // A /32 of another pod, and a prefix inside the service CIDR.
    let spec = with_rules(
        "- {destinations: [10.244.2.13/32, 10.100.0.0/16, 192.0.2.0/24], egressIP: 198.51.100.10}",
    );
    let c = compile_p(view, &spec);
    assert_eq!(forwarded(&c), ["192.0.2.0/24"]);
    let message = &status(&c, "p", condition::CLUSTER_EXCLUDED).message;
    assert!(
        message.contains("rules[0].destinations[0]: 10.244.2.13/32 covers")
            && message.contains("address 10.244.2.13 of pod shop/api-3")
            && message.contains("rules[0].destinations[1]: 10.100.0.0/16 covers"),
        "{message}"
    );
}
