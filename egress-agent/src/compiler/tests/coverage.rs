//! `--unknown-pods drop`: what an unseen pod may not reach, and which pods are seen.

use super::*;

fn covered(c: &Compiled) -> Vec<(String, bool)> {
    c.desired
        .covered
        .iter()
        .map(|(p, v)| (p.to_string(), *v))
        .collect()
}

/// The base view with PAYMENTS and a policy `other` that sends team x's `api` pods to
/// `destination` by 198.51.100.20.
fn payments_and_other(destination: &str) -> ClusterView {
    let other = format!(
        r#"
namespaceSelector: {{matchLabels: {{team: x}}}}
podSelector: {{matchLabels: {{app: api}}}}
gatewaySelector: {{matchLabels: {{egress.dev/gateway: "true"}}}}
rules:
- {{destinations: ["{destination}"], egressIP: 198.51.100.20}}
"#
    );
    with_policies(
        base(),
        vec![policy("payments", PAYMENTS), policy("other", &other)],
    )
}

#[test]
fn every_rules_destinations_are_covered_with_their_except_holes() {
    let view = payments_and_other("192.0.2.128/26");
    for node in ["worker-1", "worker-2", "gw-1"] {
        let c = compile(&view, node);
        assert_eq!(
            covered(&c),
            [
                ("192.0.2.0/24", true),
                // payments' except, with the other policy's destination inside it
                ("192.0.2.128/25", false),
                ("192.0.2.128/26", true),
                ("203.0.113.0/24", true),
            ]
            .map(|(p, v)| (p.to_owned(), v)),
            "the same on every node ({node}): an unseen pod is selected by nothing yet"
        );
    }
}

#[test]
fn a_destination_one_rule_excepts_and_another_covers_is_covered() {
    let view = payments_and_other("192.0.2.128/25");
    let c = compile(&view, "worker-1");
    assert_eq!(
        c.desired.covered.get(&"192.0.2.128/25".parse().unwrap()),
        Some(&true)
    );
}

#[test]
fn learned_destinations_of_every_gateway_are_covered() {
    let mut view = with_policies(base(), vec![policy("payments", routes::LEARNED)]);
    routes::set_routes(
        &mut view,
        "gw-1",
        "ens224",
        &["198.51.100.0/24", "10.9.0.0/16"],
    );
    routes::set_routes(
        &mut view,
        "gw-2",
        "ens224",
        &["198.51.100.0/24", "10.8.0.0/16"],
    );
    let c = compile(&view, "worker-1");
    let got: Vec<String> = covered(&c).into_iter().map(|(p, _)| p).collect();
    assert_eq!(got, ["10.8.0.0/16", "10.9.0.0/16", "198.51.100.0/24"]);
}

#[test]
fn known_pods_are_this_nodes_running_pods_selected_or_not() {
    let mut view = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    std::sync::Arc::make_mut(&mut view.pods[1]).running = false;
    let c = compile(&view, "worker-1");
    let known: Vec<String> = c
        .desired
        .known_pods
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(known, ["10.244.1.11", "10.244.1.21", "10.244.1.99"]);
    assert!(compile(&view, "gw-1").desired.known_pods.is_empty());
}
