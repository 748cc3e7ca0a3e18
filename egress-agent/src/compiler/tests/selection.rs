//! Which selectors of a policy select a pod, as `explain` asks the compiler.

use super::*;

/// The spec of a policy with `selectors` (YAML lines) and one rule.
fn selecting(selectors: &str) -> crate::api::EgressGatewayPolicySpec {
    let rest = "gatewaySelector: {matchLabels: {egress.dev/gateway: \"true\"}}\n\
                rules: [{destinations: [\"192.0.2.0/24\"], egressIP: 198.51.100.10}]\n";
    policy("p", &format!("{selectors}\n{rest}")).spec
}

#[test]
fn selection_says_which_selector_leaves_a_pod_out() {
    let view = base();
    let spec = policy("payments", PAYMENTS).spec;
    let api = labels(&[("app", "api")]).unwrap_or_default();
    let web = labels(&[("app", "web")]).unwrap_or_default();
    let cases = [
        (&spec, "shop", &api, Selection::Selected),
        (&spec, "shop", &web, Selection::PodNotSelected),
        (&spec, "other", &api, Selection::NamespaceNotSelected),
    ];
    for (spec, namespace, labels, want) in cases {
        assert_eq!(
            selection(&view, spec, namespace, labels),
            want,
            "{namespace} {labels:?}"
        );
    }
    // A namespace without a Namespace object still has its implicit name label.
    let by_name =
        selecting("namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: ghost}}");
    assert_eq!(
        selection(&view, &by_name, "ghost", &web),
        Selection::Selected
    );
    assert_eq!(
        selection(&view, &by_name, "shop", &web),
        Selection::NamespaceNotSelected
    );
    // An invalid selector selects nothing, as in the compile's plan.
    let invalid =
        selecting("podSelector: {matchExpressions: [{key: app, operator: Like, values: [api]}]}");
    assert_eq!(
        selection(&view, &invalid, "shop", &api),
        Selection::PodNotSelected
    );
}
