//! Egress NetworkPolicy over redirected traffic (issue 29): what a restricted pod's
//! entries become, for each way a policy can allow or deny.

use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::*;
use crate::compiler::netpol::reason as np_reason;

/// A NetworkPolicy of namespace `ns` from the YAML of its spec.
fn netpol(ns: &str, name: &str, spec_yaml: &str) -> NetworkPolicy {
    NetworkPolicy {
        metadata: ObjectMeta {
            namespace: Some(ns.to_owned()),
            name: Some(name.to_owned()),
            ..Default::default()
        },
        spec: Some(serde_yaml_ng::from_str(spec_yaml).expect("test NetworkPolicy spec")),
    }
}

/// worker-1's compile of PAYMENTS (192.0.2.0/24 except 192.0.2.128/25 by egress IP;
/// 203.0.113.0/24 by interface) with `nps`.
fn compiled(nps: Vec<NetworkPolicy>) -> Compiled {
    let mut view = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    view.network_policies = nps;
    compile(&view, "worker-1")
}

/// `pod`'s entries of family `F`: prefix -> (action, allowed ports as the golden files
/// show them).
fn entries_of<F: crate::desired::Family>(
    c: &Compiled,
    pod: F::Addr,
) -> BTreeMap<String, (PolicyAction, String)> {
    F::part(&c.desired)
        .policy
        .iter()
        .filter(|((p, _), _)| *p == pod)
        .map(|((_, prefix), e)| {
            let ports = c
                .desired
                .port_filters
                .get(&e.filter)
                .map(crate::compiler::render::ports)
                .unwrap_or_default();
            (prefix.to_string(), (e.action, ports))
        })
        .collect()
}

/// api-1's IPv4 entries ([`entries_of`]).
fn of_api_1(c: &Compiled) -> BTreeMap<String, (PolicyAction, String)> {
    entries_of::<crate::desired::V4>(c, ip("10.244.1.11"))
}

fn row(prefix: &str, action: PolicyAction, ports: &str) -> (String, (PolicyAction, String)) {
    (prefix.to_owned(), (action, ports.to_owned()))
}

use PolicyAction::{Deny, Exclude, Forward};

#[test]
fn without_an_egress_networkpolicy_nothing_changes() {
    let plain = compiled(Vec::new());
    // An ingress-only policy, and an egress one of another namespace or other pods.
    let c = compiled(vec![
        netpol(
            "shop",
            "ingress-only",
            "podSelector: {}\npolicyTypes: [Ingress]\n",
        ),
        netpol(
            "other",
            "elsewhere",
            "podSelector: {}\npolicyTypes: [Egress]\n",
        ),
        netpol(
            "shop",
            "web-only",
            "podSelector: {matchLabels: {app: web}}\npolicyTypes: [Egress]\n",
        ),
    ]);
    assert_eq!(c.desired, plain.desired);
    assert!(c.desired.port_filters.is_empty());
}

#[test]
fn an_egress_policy_allowing_only_network_b_denies_network_a() {
    // The probe: egress allowed only to network B's prefix.
    let c = compiled(vec![netpol(
        "shop",
        "only-b",
        "podSelector: {matchLabels: {app: api}}\npolicyTypes: [Egress]\n\
         egress:\n- to: [{ipBlock: {cidr: 203.0.113.0/24}}]\n",
    )]);
    assert_eq!(
        of_api_1(&c),
        BTreeMap::from([
            row("192.0.2.0/24", Deny, ""),
            row("192.0.2.128/25", Exclude, ""),
            row("203.0.113.0/24", Forward, ""),
        ])
    );
    assert_eq!(c.desired.v4.selected[&ip("10.244.1.11")], 3);
    // A pod no NetworkPolicy selects keeps its entries (api-2 is selected too: both).
    let deny = c.desired.v4.policy[&(ip("10.244.1.11"), net("192.0.2.0/24"))];
    assert_eq!((deny.gateway, deny.rule_id), (None, rule_id("payments", 0)));
}

#[test]
fn ports_limit_an_allowed_destination_and_policies_union() {
    let c = compiled(vec![
        netpol(
            "shop",
            "https-to-a",
            "podSelector: {matchLabels: {app: api}}\npolicyTypes: [Egress]\n\
             egress:\n- to: [{ipBlock: {cidr: 192.0.2.0/25}}]\n  ports:\n  \
             - {protocol: TCP, port: 443}\n  - {protocol: TCP, port: 8000, endPort: 8080}\n",
        ),
        netpol(
            "shop",
            "dns-anywhere",
            "podSelector: {}\npolicyTypes: [Egress]\n\
             egress:\n- ports: [{protocol: UDP, port: 53}]\n",
        ),
    ]);
    assert_eq!(
        of_api_1(&c),
        BTreeMap::from([
            row("192.0.2.0/24", Forward, "udp/53"),
            row("192.0.2.0/25", Forward, "tcp/443,tcp/8000-8080,udp/53"),
            row("192.0.2.128/25", Exclude, ""),
            row("203.0.113.0/24", Forward, "udp/53"),
        ])
    );
    assert_eq!(c.desired.port_filters.len(), 2);
    assert_eq!(c.desired.v4.selected[&ip("10.244.1.11")], 4);
}

#[test]
fn an_except_inside_an_allowed_block_is_denied() {
    let c = compiled(vec![netpol(
        "shop",
        "a-but-not-the-first-64",
        "podSelector: {}\negress:\n\
         - to: [{ipBlock: {cidr: 192.0.0.0/16, except: [192.0.2.0/26]}}]\n",
    )]);
    assert_eq!(
        of_api_1(&c),
        BTreeMap::from([
            row("192.0.2.0/24", Forward, ""),
            row("192.0.2.0/26", Deny, ""),
            row("192.0.2.128/25", Exclude, ""),
            row("203.0.113.0/24", Deny, ""),
        ])
    );
}

#[test]
fn pod_and_namespace_peers_and_named_ports_allow_nothing_outside_the_cluster() {
    let c = compiled(vec![
        netpol(
            "shop",
            "to-pods",
            "podSelector: {}\npolicyTypes: [Egress]\n\
             egress:\n- to: [{podSelector: {}}, {namespaceSelector: {}}]\n",
        ),
        netpol(
            "shop",
            "named",
            "podSelector: {}\npolicyTypes: [Egress]\n\
             egress:\n- ports: [{port: https}]\n",
        ),
    ]);
    assert_eq!(
        of_api_1(&c),
        BTreeMap::from([
            row("192.0.2.0/24", Deny, ""),
            row("192.0.2.128/25", Exclude, ""),
            row("203.0.113.0/24", Deny, ""),
        ])
    );
    let named: Vec<&Problem> = c
        .problems
        .iter()
        .filter(|p| p.reason == np_reason::NAMED_PORT_NOT_APPLIED)
        .collect();
    assert_eq!(named.len(), 1, "{:?}", c.problems);
    assert_eq!(named[0].object, Object::NetworkPolicy("shop/named".into()));
    assert!(
        named[0]
            .message
            .starts_with("spec.egress[0].ports[0].port: named port \"https\""),
        "{}",
        named[0].message
    );
}

#[test]
fn a_policy_that_does_not_read_isolates_its_pods_and_allows_nothing() {
    let c = compiled(vec![netpol(
        "shop",
        "typo",
        "podSelector: {}\npolicyTypes: [Egress]\n\
         egress:\n- to: [{ipBlock: {cidr: 192.0.2.0/33}}]\n",
    )]);
    assert_eq!(of_api_1(&c)["192.0.2.0/24"].0, Deny);
    let p = c
        .problems
        .iter()
        .find(|p| p.reason == np_reason::INVALID_NETWORK_POLICY)
        .expect("a problem");
    assert!(
        p.message
            .starts_with("spec.egress[0].to[0].ipBlock.cidr: \"192.0.2.0/33\""),
        "{}",
        p.message
    );
}

#[test]
fn ipv6_entries_are_restricted_alike() {
    // PAYMENTS_DUAL: 2001:db8:100::/48 except 2001:db8:100:ff::/64 by egress IP, and
    // 2001:db8:200::/48 by interface. Allowed: the first /48's first /56, HTTPS only.
    let mut view = with_policies(base(), vec![policy("payments", super::PAYMENTS_DUAL)]);
    super::dual_stack_gateways(&mut view);
    super::dual_stack_pods(&mut view);
    view.network_policies = vec![netpol(
        "shop",
        "v6",
        "podSelector: {}\npolicyTypes: [Egress]\negress:\n\
         - to: [{ipBlock: {cidr: \"2001:db8:100::/56\"}}]\n  ports: [{protocol: TCP, port: 443}]\n",
    )];
    let c = compile(&view, "worker-1");
    let got = entries_of::<crate::desired::V6>(&c, ip6("fd00:244:1::11"));
    assert_eq!(
        got,
        BTreeMap::from([
            row("2001:db8:100::/48", Deny, ""),
            row("2001:db8:100::/56", Forward, "tcp/443"),
            row("2001:db8:100:ff::/64", Exclude, ""),
            row("2001:db8:200::/48", Deny, ""),
        ])
    );
    // The IPv4 entries of the same pod: nothing allowed there.
    assert!(
        of_api_1(&c)
            .values()
            .all(|(a, _)| *a == Deny || *a == Exclude)
    );
}

#[test]
fn filter_ids_follow_their_ports_not_the_order_of_policies() {
    let a =
        "podSelector: {}\npolicyTypes: [Egress]\negress:\n- ports: [{protocol: TCP, port: 443}]\n";
    let b = "podSelector: {matchLabels: {app: api}}\npolicyTypes: [Egress]\negress:\n\
             - to: [{ipBlock: {cidr: 203.0.113.0/24}}]\n  ports: [{protocol: UDP, port: 53}]\n";
    let one = compiled(vec![netpol("shop", "a", a)]);
    let two = compiled(vec![netpol("shop", "b", b), netpol("shop", "a", a)]);
    let id_of = |c: &Compiled, ports: &str| {
        c.desired
            .port_filters
            .iter()
            .find(|(_, s)| crate::compiler::render::ports(s) == ports)
            .map(|(id, _)| *id)
    };
    assert!(id_of(&one, "tcp/443").is_some());
    assert_eq!(id_of(&one, "tcp/443"), id_of(&two, "tcp/443"));
}

#[test]
fn admin_policies_and_egress_firewalls_are_said_not_to_hold_for_redirected_traffic() {
    use crate::source::Unapplied;
    let mut view = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    let c = compile(&view, "worker-1");
    let types: Vec<&str> = c.statuses["payments"]
        .conditions
        .iter()
        .map(|c| c.type_.as_str())
        .collect();
    assert!(!types.contains(&condition::ADMIN_POLICIES_NOT_APPLIED));
    // An EgressFirewall of another namespace does not cover the policy's pods.
    view.unapplied = vec![Unapplied {
        kind: "EgressFirewall",
        namespace: Some("other".into()),
        name: "default".into(),
    }];
    let c = compile(&view, "worker-1");
    assert!(
        !c.statuses["payments"]
            .conditions
            .iter()
            .any(|c| c.type_ == condition::ADMIN_POLICIES_NOT_APPLIED)
    );
    view.unapplied.push(Unapplied {
        kind: "EgressFirewall",
        namespace: Some("shop".into()),
        name: "default".into(),
    });
    view.unapplied.push(Unapplied {
        kind: "AdminNetworkPolicy",
        namespace: None,
        name: "cluster-egress".into(),
    });
    let c = compile(&view, "worker-1");
    let cond = status(&c, "payments", condition::ADMIN_POLICIES_NOT_APPLIED);
    assert_eq!(
        (cond.status.as_str(), cond.reason.as_str()),
        ("True", reason::NOT_APPLIED_TO_REDIRECTED_TRAFFIC)
    );
    assert!(
        cond.message.starts_with(
            "AdminNetworkPolicy cluster-egress, EgressFirewall shop/default may cover"
        ),
        "{}",
        cond.message
    );
    // The rules are served all the same.
    assert_eq!(status(&c, "payments", condition::READY).status, "True");
}
