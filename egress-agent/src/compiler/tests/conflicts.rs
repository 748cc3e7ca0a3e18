//! Conflicts between policies and between pods, each resolved by a stated rule and shown
//! on every policy involved (issue 28's fourth and eighth probes).

use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

use super::*;

/// `spec` for the pods of team `team` with app `app`, one rule to `destination` via
/// `egress_ip`.
fn spec(team: &str, app: &str, destination: &str, egress_ip: &str) -> String {
    format!(
        "namespaceSelector: {{matchLabels: {{team: {team}}}}}\n\
         podSelector: {{matchLabels: {{app: {app}}}}}\n\
         gatewaySelector: {{matchLabels: {{egress.dev/gateway: \"true\"}}}}\n\
         rules:\n- destinations: [\"{destination}\"]\n  egressIP: {egress_ip}\n"
    )
}

fn created(mut p: EgressGatewayPolicy, at: &str) -> EgressGatewayPolicy {
    p.metadata.creation_timestamp = Some(Time(at.parse::<Timestamp>().expect("timestamp")));
    p
}

/// The Conflict condition of `policy`, which must be there.
fn conflict<'a>(c: &'a Compiled, policy: &str) -> &'a PolicyCondition {
    let cond = status(c, policy, condition::CONFLICT);
    assert_eq!(cond.status, ConditionStatus::True, "{cond:?}");
    cond
}

/// Entries of `pod` (an address) in `node`'s compile: (prefix, action, egress IP).
fn entries(c: &Compiled, pod: &str) -> Vec<(String, PolicyAction, Option<Ipv4Addr>)> {
    let pod: Ipv4Addr = pod.parse().expect("pod");
    c.desired
        .v4
        .policy
        .iter()
        .filter(|((p, _), _)| *p == pod)
        .map(|((_, prefix), e)| (prefix.to_string(), e.action, e.egress_ip))
        .collect()
}

#[test]
fn an_egress_ip_named_by_two_policies_belongs_to_the_older_one_whatever_the_names() {
    let mut view = base();
    // Team x's api-9 (worker-1) by the newer "aa-newer", the shop's api pods by the older
    // "zz-older": the name sorts first, the age decides.
    view.policies = vec![
        created(
            policy(
                "aa-newer",
                &spec("x", "api", "192.0.2.0/24", "198.51.100.10"),
            ),
            "2026-06-01T00:00:00Z",
        ),
        created(
            policy(
                "zz-older",
                &spec("payments", "api", "192.0.2.0/24", "198.51.100.10"),
            ),
            "2025-01-01T00:00:00Z",
        ),
    ];
    let c = compile(&view, "worker-1");
    assert_eq!(
        entries(&c, "10.244.1.11"),
        [(
            "192.0.2.0/24".to_owned(),
            PolicyAction::Forward,
            Some("198.51.100.10".parse().unwrap())
        )]
    );
    // The newer policy's pod never leaves with it: no gateway, failure policy Drop.
    assert_eq!(
        entries(&c, "10.244.1.99"),
        [(
            "192.0.2.0/24".to_owned(),
            PolicyAction::NoGatewayDrop,
            Some("198.51.100.10".parse().unwrap())
        )]
    );
    let newer = conflict(&c, "aa-newer");
    assert_eq!(newer.reason, reason::EGRESS_IP_CONFLICT);
    assert!(
        newer
            .message
            .contains("198.51.100.10 belongs to policy zz-older"),
        "{newer:?}"
    );
    assert_eq!(
        status(&c, "aa-newer", condition::READY).reason,
        reason::EGRESS_IP_IN_USE
    );
    let older = conflict(&c, "zz-older");
    assert_eq!(older.reason, reason::EGRESS_IP_CONFLICT);
    assert!(
        older.message.contains("also named by policy aa-newer"),
        "{older:?}"
    );
    assert_eq!(status(&c, "zz-older", condition::READY).status, "True");
    // The same without timestamps (a YAML directory): by name.
    for p in &mut view.policies {
        p.metadata.creation_timestamp = None;
    }
    let c = compile(&view, "worker-1");
    assert!(
        conflict(&c, "zz-older")
            .message
            .contains("belongs to policy aa-newer")
    );
}

#[test]
fn a_narrower_gateway_selector_of_a_second_policy_does_not_move_the_first_ones_ip() {
    // The probe: the same egress IP in a policy whose name sorts first and whose
    // gatewaySelector matches only gw-2 moved the first policy's IP to gw-2
    // (HolderNotSelected). Now the older policy keeps it where it was.
    let mut view = base();
    view.policies = vec![created(
        policy(
            "payments",
            &spec("payments", "api", "192.0.2.0/24", "198.51.100.10"),
        ),
        "2025-01-01T00:00:00Z",
    )];
    let alone = compile(&view, "worker-1");
    let holder = holder_of(&alone, "198.51.100.10").expect("a holder");
    let other = if holder == "gw-1" { "gw-2" } else { "gw-1" };
    for n in &mut view.nodes {
        if n.metadata.name.as_deref() == Some(other) {
            n.metadata
                .labels
                .get_or_insert_with(Default::default)
                .insert("only".to_owned(), "me".to_owned());
        }
    }
    let narrow = spec("x", "api", "192.0.2.0/24", "198.51.100.10")
        .replace("{egress.dev/gateway: \"true\"}", "{only: me}");
    view.policies
        .push(created(policy("aaa", &narrow), "2026-01-01T00:00:00Z"));
    let c = compile(&view, "worker-1");
    assert_eq!(
        holder_of(&c, "198.51.100.10").as_deref(),
        Some(holder.as_str())
    );
    assert_eq!(conflict(&c, "aaa").reason, reason::EGRESS_IP_CONFLICT);
}

#[test]
fn a_longer_prefix_of_another_policy_for_the_same_pod_is_a_conflict_on_both() {
    // The probe: policy C's /32 with an egress IP on another network silently took
    // policy A's /24 for that host (and black-holed it).
    let mut view = base();
    view.policies = vec![
        policy(
            "a",
            &spec("payments", "api", "192.0.2.0/24", "198.51.100.10"),
        ),
        policy(
            "c",
            &spec("payments", "api", "192.0.2.7/32", "203.0.113.10"),
        ),
    ];
    let c = compile(&view, "worker-1");
    let a = conflict(&c, "a");
    assert_eq!(a.reason, reason::DESTINATION_OVERRIDDEN);
    assert!(
        a.message.contains(
            "rules[0]: pod shop/api-1 destination 192.0.2.7/32 inside 192.0.2.0/24 is taken \
             by policy c rules[0] (the longest prefix wins)"
        ),
        "{a:?}"
    );
    let cc = conflict(&c, "c");
    assert!(
        cc.message
            .contains("destination 192.0.2.7/32 overrides policy a rules[0]'s 192.0.2.0/24"),
        "{cc:?}"
    );
    assert!(
        c.problems
            .iter()
            .any(|p| p.reason == reason::DESTINATION_OVERRIDDEN)
    );
    // Within one policy a longer prefix of a later rule is the author's intent: no
    // conflict.
    let mut one = base();
    one.policies = vec![policy(
        "a",
        &(spec("payments", "api", "192.0.2.0/24", "198.51.100.10")
            + "- destinations: [\"192.0.2.7/32\"]\n  egressIP: 203.0.113.10\n"),
    )];
    let c = compile(&one, "worker-1");
    assert!(
        c.statuses["a"]
            .conditions
            .iter()
            .all(|c| c.type_ != condition::CONFLICT),
        "{:?}",
        c.statuses["a"]
    );
}

#[test]
fn a_pod_address_claimed_twice_or_by_a_node_is_nobodys() {
    // The probe: a Pod listing another pod's address and the node's: the unselected pod
    // then left with the egress IP.
    let mut view = base();
    view.pods
        .push(pod("other", "thief", "api", "worker-1", "10.244.1.21").into());
    view.pods
        .push(pod("other", "node-ip", "api", "worker-1", "10.0.0.1").into());
    view.policies = vec![policy("payments", PAYMENTS)];
    let c = compile(&view, "worker-1");
    // shop/web-1 (unselected) and other/thief both claim 10.244.1.21: no entries for it,
    // no owner entry; other/node-ip claims worker-1's address.
    assert!(entries(&c, "10.244.1.21").is_empty());
    assert!(
        !c.desired
            .v4
            .pod_owner
            .contains_key(&"10.244.1.21".parse().unwrap())
    );
    assert!(
        !c.desired
            .v4
            .pod_owner
            .contains_key(&"10.0.0.1".parse().unwrap())
    );
    assert!(entries(&c, "10.0.0.1").is_empty());
    // The policy selects neither claimant (team x is not payments): no condition on it.
    assert!(
        c.statuses["payments"]
            .conditions
            .iter()
            .all(|c| c.type_ != condition::CONFLICT)
    );
    // A policy that selects a claimant says so.
    view.policies.push(policy(
        "x",
        &spec("x", "api", "192.0.2.0/24", "198.51.100.20"),
    ));
    let c = compile(&view, "worker-1");
    let x = conflict(&c, "x");
    assert_eq!(x.reason, reason::POD_ADDRESS_CONFLICT);
    assert!(
        x.message
            .contains("address 10.244.1.21 is claimed by pods other/thief and shop/web-1"),
        "{x:?}"
    );
    assert!(
        x.message
            .contains("address 10.0.0.1 is claimed by pod other/node-ip and node worker-1"),
        "{x:?}"
    );
    // The other pods are untouched.
    assert!(!entries(&c, "10.244.1.99").is_empty());
}

#[test]
fn a_prefix_two_rules_of_one_policy_name_is_the_earlier_rules_and_a_conflict() {
    // Rules whose prefixes are disjoint have every pair without claims (the fast path at
    // scale); one prefix named twice still goes through them.
    let mut view = base();
    view.policies = vec![policy(
        "a",
        &(spec("payments", "api", "192.0.2.0/24", "198.51.100.10")
            + "- destinations: [\"192.0.2.0/24\", \"198.18.0.0/16\"]\n  egressIP: 203.0.113.10\n"),
    )];
    let c = compile(&view, "worker-1");
    let a = conflict(&c, "a");
    assert!(
        a.message.contains(
            "rules[1]: pod shop/api-1 destination 192.0.2.0/24 is claimed by rules[0] of \
             this policy"
        ),
        "{a:?}"
    );
    let mut got = entries(&c, "10.244.1.11");
    got.sort();
    assert_eq!(
        got,
        vec![
            (
                "192.0.2.0/24".to_owned(),
                PolicyAction::Forward,
                Some("198.51.100.10".parse().unwrap())
            ),
            (
                "198.18.0.0/16".to_owned(),
                PolicyAction::Forward,
                Some("203.0.113.10".parse().unwrap())
            ),
        ]
    );
}
