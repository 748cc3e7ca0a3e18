//! Which pods a node needs (issue 34), and that a worker compiles the same maps from
//! its own node's pods (what a `fieldSelector=spec.nodeName=<node>` watch gives) as from
//! every pod of the cluster.

use super::*;

/// The cluster's pod addresses of [`base`] and of [`build_view`]'s pods, declared.
fn declared() -> Vec<IpNet> {
    ["10.244.0.0/16", "fd00:244::/64"]
        .iter()
        .map(|c| c.parse().expect("test CIDR"))
        .collect()
}

/// `view` as a worker's source serves it: the pods of `me` (every phase, host network
/// included: the field selector does not look at them).
fn narrowed(view: &ClusterView, me: &str) -> ClusterView {
    let mut narrow = view.clone();
    narrow.pods.retain(|p| p.node_name.as_deref() == Some(me));
    narrow.pod_scope = PodScope::Node;
    narrow
}

/// Holders without their pod counts (cluster-wide only from a view of every pod).
fn uncounted(holders: &[Holder]) -> Vec<Holder> {
    holders
        .iter()
        .map(|h| Holder {
            pods: 0,
            ..h.clone()
        })
        .collect()
}

/// What a node's compile must give alike from its own pods and from every pod: the
/// maps, its pods' routes, and what it derives about the cluster without counting pods.
fn assert_same_for_the_node(narrow: &Compiled, full: &Compiled, me: &str) {
    assert_eq!(narrow.desired, full.desired, "{me}: desired maps");
    assert_eq!(narrow.pod_routes, full.pod_routes, "{me}: pod routes");
    assert_eq!(uncounted(&narrow.holders), uncounted(&full.holders), "{me}");
    assert_eq!(narrow.membership, full.membership, "{me}");
    assert_eq!(narrow.status_writer, full.status_writer, "{me}");
    assert_eq!(narrow.accepted, full.accepted, "{me}");
    assert_eq!(narrow.policy_egress_ips, full.policy_egress_ips, "{me}");
    assert_eq!(narrow.pods_needed, full.pods_needed, "{me}");
}

#[test]
fn each_role_needs_the_pods_it_compiles_from() {
    let with_cidrs = || {
        let mut view = with_policies(base(), vec![policy("payments", PAYMENTS)]);
        view.cluster_cidrs = declared();
        view
    };
    let view = with_cidrs();
    // (view, liveness, node, needed), in words.
    let cases: Vec<(&str, ClusterView, PeerView, &str, PodScope)> = vec![
        (
            "a worker: its own pods",
            with_cidrs(),
            PeerView::default(),
            "worker-2",
            PodScope::Node,
        ),
        (
            "a gateway: every pod (it admits and owns them)",
            with_cidrs(),
            PeerView::default(),
            "gw-2",
            PodScope::Cluster,
        ),
        (
            "the status writer (the first Ready node by name): every pod",
            with_cidrs(),
            PeerView::default(),
            "gw-1",
            PodScope::Cluster,
        ),
        (
            "the status writer once the probes find both gateways dead",
            with_cidrs(),
            dead(&["gw-1", "gw-2"]),
            "worker-1",
            PodScope::Cluster,
        ),
        (
            "a worker of a cluster whose CIDRs are not declared: every pod",
            with_policies(base(), vec![policy("payments", PAYMENTS)]),
            PeerView::default(),
            "worker-2",
            PodScope::Cluster,
        ),
        (
            "a worker without any policy: its own pods",
            {
                let mut v = view.clone();
                v.policies.clear();
                v
            },
            PeerView::default(),
            "worker-2",
            PodScope::Node,
        ),
    ];
    for (what, view, peers, me, want) in cases {
        let c = compile_with(&view, &peers, me);
        assert_eq!(c.pods_needed, want, "{what}");
        if peers.dead.is_empty() {
            assert_eq!(pods_needed(&view, me), want, "{what}: from the view alone");
        }
    }
}

#[test]
fn a_worker_compiles_the_same_maps_from_its_own_pods() {
    let mut view = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    view.cluster_cidrs = declared();
    // A pod of another node inside a destination: carved out alike (by the cluster CIDR).
    let mut routed = policy(
        "routed",
        &PAYMENTS
            .replace("192.0.2.0/24", "10.0.0.0/8")
            .replace("192.0.2.128/25", "10.1.0.0/16")
            .replace("198.51.100.10", "198.51.100.11"),
    );
    routed.metadata.generation = Some(1);
    view.policies.push(routed);
    for me in ["worker-1", "worker-2"] {
        let full = compile(&view, me);
        assert_eq!(full.pods_needed, PodScope::Node, "{me}");
        let narrow = compile(&narrowed(&view, me), me);
        assert_same_for_the_node(&narrow, &full, me);
        assert!(!full.desired.v4.policy.is_empty(), "{me} has entries");
        assert_eq!(narrow.pod_scope, PodScope::Node);
    }
    // A gateway's maps are another matter: it owns and admits every selected pod.
    let gw = compile(&view, "gw-1");
    assert_eq!(gw.desired.v4.pod_owner.len(), 5);
    assert_ne!(
        compile(&narrowed(&view, "gw-1"), "gw-1").desired,
        gw.desired
    );
}

#[test]
fn a_gateway_whose_agent_holds_only_its_node_pods_is_not_eligible() {
    let mut view = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    for en in &mut view.egress_nodes {
        if let Some(st) = &mut en.status {
            st.pod_scope = PodScope::Node;
        }
    }
    let c = compile(&view, "worker-1");
    assert!(c.holders.is_empty(), "{:?}", c.holders);
    let ready = status(&c, "payments", condition::READY);
    assert_eq!(ready.reason, reason::NO_ELIGIBLE_GATEWAY);
    assert!(
        ready
            .message
            .contains("gw-1 is still listing the cluster's pods"),
        "{ready:?}"
    );
    // Once one says Cluster (or nothing: an older agent), it serves.
    view.egress_nodes[1]
        .status
        .as_mut()
        .expect("status")
        .pod_scope = PodScope::Cluster;
    let c = compile(&view, "worker-1");
    assert!(
        c.holders.iter().all(|h| h.node == "gw-2"),
        "{:?}",
        c.holders
    );
    assert!(!c.holders.is_empty());
}

#[test]
fn the_gateways_of_a_last_accepted_version_keep_every_pod() {
    // gw-1 and gw-2 serve the accepted version; a broken edit selects other nodes.
    let good = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    let first = compile(&good, "gw-1");
    let mut broken = policy(
        "payments",
        &PAYMENTS
            .replace("egress.dev/gateway: \"true\"", "role: none")
            .replace("192.0.2.0/24", "192.0.2.0/33"),
    );
    broken.metadata.generation = Some(2);
    let mut view = with_policies(base(), vec![broken]);
    view.cluster_cidrs = declared();
    // gw-1 writes the statuses; gw-2 is a gateway by the served version only.
    assert_eq!(pods_needed(&view, "gw-2"), PodScope::Node, "the view alone");
    let c = compile_remembering(&view, &PeerView::default(), &first.accepted, "gw-2");
    assert_eq!(c.pods_needed, PodScope::Cluster);
    assert_eq!(c.desired.v4.pod_owner.len(), 5, "it owns every pod");
}

#[test]
fn pods_outside_the_declared_cidrs_are_a_problem_on_a_view_of_every_pod() {
    let mut view = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    view.cluster_cidrs = vec!["10.244.1.0/24".parse().expect("CIDR")];
    let c = compile(&view, "gw-1");
    let outside: Vec<&Problem> = c
        .problems
        .iter()
        .filter(|p| p.reason == reason::POD_OUTSIDE_CLUSTER_CIDRS)
        .collect();
    assert_eq!(outside.len(), 1, "{:?}", c.problems);
    assert_eq!(outside[0].object, Object::Node("worker-2".to_owned()));
    assert!(
        outside[0]
            .message
            .starts_with("1 pods of this node have addresses outside the cluster's CIDRs"),
        "{}",
        outside[0].message
    );
    assert!(outside[0].message.contains("pod shop/api-3 at 10.244.2.13"));
    // A Node's pod CIDR holds them as well.
    node_mut(&mut view, "worker-2").spec = Some(k8s_openapi::api::core::v1::NodeSpec {
        pod_cidrs: Some(vec!["10.244.2.0/24".to_owned()]),
        ..Default::default()
    });
    let c = compile(&view, "gw-1");
    assert!(
        c.problems
            .iter()
            .all(|p| p.reason != reason::POD_OUTSIDE_CLUSTER_CIDRS),
        "{:?}",
        c.problems
    );
    // Nothing to say from a view of one node's pods, nor without declared CIDRs (every
    // node watches every pod then).
    node_mut(&mut view, "worker-2").spec = None;
    let c = compile(&narrowed(&view, "worker-2"), "worker-2");
    assert!(c.problems.is_empty(), "{:?}", c.problems);
    view.cluster_cidrs.clear();
    assert!(compile(&view, "gw-1").problems.is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Whatever the cluster: a node that needs only its own pods compiles, from them,
    /// the maps it compiles from every pod (the pods' addresses inside the declared
    /// CIDRs, no address listed by pods of two nodes: see docs/operations.md).
    #[test]
    fn a_node_that_needs_its_own_pods_compiles_the_same_from_them(
        nodes in proptest::collection::vec(gen_node(), 1..6),
        pods in proptest::collection::vec(
            (0..6usize, 0..3usize, any::<bool>(), 0..3usize),
            0..24,
        ),
        policies in proptest::collection::vec(gen_policy(), 0..4),
        first_dead in any::<bool>(),
    ) {
        let mut view = build_view(&nodes, &pods, &policies);
        view.cluster_cidrs = declared();
        let peers = if first_dead { dead(&["n0"]) } else { PeerView::default() };
        for i in 0..nodes.len() {
            let me = format!("n{i}");
            let full = compile_with(&view, &peers, &me);
            if full.pods_needed != PodScope::Node {
                continue;
            }
            // It serves nothing: a gateway is selected, hence needs every pod.
            let d = &full.desired;
            prop_assert!(d.v4.rules.is_empty() && d.v6.rules.is_empty() && d.admitted.is_empty());
            let narrow = compile_with(&narrowed(&view, &me), &peers, &me);
            prop_assert_eq!(&narrow.desired, &full.desired, "{}", me);
            prop_assert_eq!(&narrow.pod_routes, &full.pod_routes, "{}", me);
            prop_assert_eq!(uncounted(&narrow.holders), uncounted(&full.holders), "{}", me);
            prop_assert_eq!(&narrow.membership, &full.membership, "{}", me);
            prop_assert_eq!(&narrow.status_writer, &full.status_writer, "{}", me);
            prop_assert_eq!(narrow.pods_needed, PodScope::Node, "{}", me);
        }
    }
}
