//! A node's policy map too small for its selected pods (its agent says so in its
//! EgressNode) makes the policies of the pods left out `Ready=False`, on every node.

use super::*;
use crate::api::FullPolicyMap;

/// `node`'s EgressNode says its `POLICY_V4` (of 4 entries) left out 2 pods of `policies`.
fn full_map_on(view: &mut ClusterView, node: &str, policies: &[&str]) {
    if !view
        .egress_nodes
        .iter()
        .any(|e| e.metadata.name.as_deref() == Some(node))
    {
        view.egress_nodes.push(egress_node(node, &[], &[]));
    }
    let en = view
        .egress_nodes
        .iter_mut()
        .find(|e| e.metadata.name.as_deref() == Some(node))
        .expect("EgressNode just added");
    en.status
        .get_or_insert_with(Default::default)
        .full_policy_maps = vec![FullPolicyMap {
        map: "POLICY_V4".to_owned(),
        capacity: 4,
        pods_left_out: 2,
        policies: policies.iter().map(|p| (*p).to_owned()).collect(),
    }];
}

const WEB: &str = r#"
namespaceSelector: {matchLabels: {team: payments}}
podSelector: {matchLabels: {app: web}}
gatewaySelector: {matchLabels: {egress.dev/gateway: "true"}}
rules:
- destinations: ["192.0.2.0/24"]
  interface: ens224
"#;

#[test]
fn a_full_policy_map_makes_the_policies_it_names_not_ready_naming_node_and_flag() {
    let mut view = with_policies(
        base(),
        vec![policy("payments", PAYMENTS), policy("web", WEB)],
    );
    full_map_on(&mut view, "worker-1", &["payments"]);
    let c = compile(&view, "gw-1");
    let ready = status(&c, "payments", condition::READY);
    assert_eq!(
        (ready.status, ready.reason.as_str()),
        (ConditionStatus::False, reason::POLICY_MAP_FULL),
        "{ready:?}"
    );
    for needle in [
        "node worker-1: map POLICY_V4 is full at 4 entries",
        "2 selected pods",
        "DROP_POLICY_MAP_FULL",
        "raise --policy-map-entries",
    ] {
        assert!(ready.message.contains(needle), "{needle:?} in {ready:?}");
    }
    assert_eq!(status(&c, "payments", condition::ACCEPTED).status, "True");
    // The policy the map's pods do not belong to is served.
    assert_eq!(status(&c, "web", condition::READY).status, "True");
    // Every node says the same.
    assert_eq!(compile(&view, "worker-2").statuses, c.statuses);
    // Every agent logs and counts it.
    assert!(
        c.problems
            .iter()
            .any(|p| p.reason == reason::POLICY_MAP_FULL
                && p.object == Object::Policy("payments".to_owned())),
        "{:?}",
        c.problems
    );
}

#[test]
fn a_full_map_of_a_deleted_node_or_one_that_fits_again_says_nothing() {
    let mut view = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    full_map_on(&mut view, "gone", &["payments"]);
    let c = compile(&view, "gw-1");
    assert_eq!(status(&c, "payments", condition::READY).status, "True");

    full_map_on(&mut view, "worker-1", &["payments"]);
    assert_eq!(
        status(&compile(&view, "gw-1"), "payments", condition::READY).status,
        "False"
    );
    // The agent fits its pods again and publishes no full map.
    for en in &mut view.egress_nodes {
        if let Some(st) = en.status.as_mut() {
            st.full_policy_maps.clear();
        }
    }
    let c = compile(&view, "gw-1");
    assert_eq!(status(&c, "payments", condition::READY).status, "True");
}
