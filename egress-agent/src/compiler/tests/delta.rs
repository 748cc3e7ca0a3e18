//! The compile patched for pods no policy selects (issue 49, `compiler::delta`): the
//! memo's result equals a full compile after every edit of random edit sequences, and
//! the pods that may be patched in are patched in.

use std::sync::Arc;

use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::*;
use crate::source::Snapshot;

fn snapshot(view: &ClusterView) -> Arc<Snapshot> {
    Arc::new(Snapshot {
        view: view.clone(),
        errors: Vec::new(),
    })
}

/// The cluster's pod addresses, declared (the pods of [`base`] and [`gen_pod_ips`]).
fn declared() -> Vec<IpNet> {
    ["10.244.0.0/16", "fd00:244::/64"]
        .iter()
        .map(|c| c.parse().expect("test CIDR"))
        .collect()
}

/// Put `pod` in its place in `view` (sorted by namespace and name, as the sources hand
/// pods over), in place of the pod of its name.
fn put(view: &mut ClusterView, pod: PodSummary) {
    let key = |p: &PodSummary| (p.namespace.to_string(), p.name.clone());
    let at = view.pods.partition_point(|p| key(p) < key(&pod));
    if view.pods.get(at).is_some_and(|p| key(p) == key(&pod)) {
        view.pods[at] = Arc::new(pod);
    } else {
        view.pods.insert(at, Arc::new(pod));
    }
}

/// An egress NetworkPolicy of namespace `ns` that isolates all its pods.
fn isolating(ns: &str) -> NetworkPolicy {
    NetworkPolicy {
        metadata: ObjectMeta {
            namespace: Some(ns.to_owned()),
            name: Some("deny-egress".to_owned()),
            ..Default::default()
        },
        spec: Some(
            serde_yaml_ng::from_str("{podSelector: {}, policyTypes: [Egress]}")
                .expect("test NetworkPolicy spec"),
        ),
    }
}

/// PAYMENTS on [`base`] with the pod addresses declared, and a compile of it for `me`
/// through a memo.
fn payments(me: &str) -> (ClusterView, Memo) {
    let mut view = with_policies(base(), vec![policy("payments", PAYMENTS)]);
    view.cluster_cidrs = declared();
    view.pods
        .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let mut memo = Memo::default();
    let (_, made) = memo.compile(&snapshot(&view), &PeerView::default(), &BTreeMap::new(), me);
    assert_eq!(made, Made::Compiled);
    (view, memo)
}

/// The memo's compile of `view` for `me`, checked against a full compile.
fn step(memo: &mut Memo, view: &ClusterView, me: &str) -> (Arc<Compiled>, Made) {
    let none = BTreeMap::new();
    let (c, made) = memo.compile(&snapshot(view), &PeerView::default(), &none, me);
    assert_eq!(
        *c,
        compile_remembering(view, &PeerView::default(), &none, me)
    );
    (c, made)
}

#[test]
fn a_pod_no_policy_selects_is_patched_in_and_out() {
    let (mut view, mut memo) = payments("gw-1");
    // PAYMENTS selects app=api in namespaces of team payments: a web pod is nobody's.
    let web = pod("shop", "web-5", "web", "worker-2", "10.244.2.40");
    put(&mut view, web.clone());
    let (c, made) = step(&mut memo, &view, "gw-1");
    assert_eq!(made, Made::Patched);
    // A gateway records every pod's owner.
    assert_eq!(
        c.desired.v4.pod_owner.get(&ip("10.244.2.40")),
        Some(&underlay_of(&view, "worker-2"))
    );
    // Moved to worker-1 with another address, then gone.
    put(
        &mut view,
        pod("shop", "web-5", "web", "worker-1", "10.244.1.41"),
    );
    let (c, made) = step(&mut memo, &view, "gw-1");
    assert_eq!(made, Made::Patched);
    assert!(!c.desired.v4.pod_owner.contains_key(&ip("10.244.2.40")));
    view.pods.retain(|p| p.name != "web-5");
    let (c, made) = step(&mut memo, &view, "gw-1");
    assert_eq!(made, Made::Patched);
    assert!(!c.desired.v4.pod_owner.contains_key(&ip("10.244.1.41")));

    // On its own node: a known pod and its owner; another node's pod: nothing.
    let (mut view, mut memo) = payments("worker-1");
    put(
        &mut view,
        pod("shop", "web-5", "web", "worker-1", "10.244.1.40"),
    );
    put(
        &mut view,
        pod("shop", "web-6", "web", "worker-2", "10.244.2.40"),
    );
    let (c, made) = step(&mut memo, &view, "worker-1");
    assert_eq!(made, Made::Patched);
    assert!(
        c.desired
            .known_pods
            .contains(&IpAddr::V4(ip("10.244.1.40")))
    );
    assert!(c.desired.v4.pod_owner.contains_key(&ip("10.244.1.40")));
    assert!(!c.desired.v4.pod_owner.contains_key(&ip("10.244.2.40")));
    // Taken again when nothing changed, even from a new snapshot.
    let (d, made) = step(&mut memo, &view, "worker-1");
    assert!(made == Made::Again && Arc::ptr_eq(&c, &d));
}

/// What a case does to the view, in words and in code.
type Case = (&'static str, fn(&mut ClusterView));

#[test]
fn pods_that_change_more_than_their_entries_compile_anew() {
    let cases: [Case; 6] = [
        ("a selected pod", |v| {
            put(v, pod("shop", "api-9", "api", "worker-2", "10.244.2.40"));
        }),
        ("another pod's address", |v| {
            put(v, pod("shop", "web-5", "web", "worker-2", "10.244.1.11"));
        }),
        ("an address outside the declared CIDRs", |v| {
            put(v, pod("shop", "web-5", "web", "worker-2", "10.99.0.1"));
        }),
        ("a pod of an isolated namespace on this node", |v| {
            put(v, pod("shop", "web-5", "web", "worker-1", "10.244.1.40"));
        }),
        ("a policy edited beside it", |v| {
            put(v, pod("shop", "web-5", "web", "worker-2", "10.244.2.40"));
            v.policies[0].metadata.generation = Some(7);
        }),
        ("pods out of order", |v| {
            v.pods.reverse();
            put(v, pod("shop", "web-5", "web", "worker-2", "10.244.2.40"));
        }),
    ];
    for (what, edit) in cases {
        let (mut view, mut memo) = payments("worker-1");
        if what.contains("isolated") {
            view.network_policies = vec![isolating("shop")];
            step(&mut memo, &view, "worker-1");
        }
        edit(&mut view);
        let (_, made) = step(&mut memo, &view, "worker-1");
        assert_eq!(made, Made::Compiled, "{what}");
    }
    // A node's address taken by a pod: with the node's range declared, still anew.
    let (mut view, mut memo) = payments("gw-1");
    view.cluster_cidrs.push("10.0.0.0/8".parse().expect("CIDR"));
    step(&mut memo, &view, "gw-1");
    let node = underlay_of(&view, "worker-2").to_string();
    put(&mut view, pod("shop", "web-5", "web", "worker-2", &node));
    let (c, made) = step(&mut memo, &view, "gw-1");
    assert_eq!(made, Made::Compiled);
    // Disputed: nobody's pod address.
    let IpAddr::V4(node) = underlay_of(&view, "worker-2") else {
        panic!("an IPv4 underlay");
    };
    assert!(!c.desired.v4.pod_owner.contains_key(&node));
}

/// One edit of the property test; indices are taken modulo what there is.
#[derive(Clone, Debug)]
enum Edit {
    /// A pod: its node, app label, namespace (`np`: isolated), running, family, address.
    Add(usize, usize, bool, bool, usize, Address),
    Remove(usize),
    Relabel(usize, usize),
    Move(usize, usize),
    Readdress(usize, Address),
    Stop(usize),
    /// A change beside the pods: the declared CIDRs changed.
    Cidrs,
}

#[derive(Clone, Debug)]
enum Address {
    Fresh,
    OfPod(usize),
    OfNode(usize),
    Outside,
}

fn gen_address() -> impl Strategy<Value = Address> {
    prop_oneof![
        6 => Just(Address::Fresh),
        2 => (0..64usize).prop_map(Address::OfPod),
        2 => (0..8usize).prop_map(Address::OfNode),
        1 => Just(Address::Outside),
    ]
}

fn gen_edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        6 => (0..8usize, 0..6usize, any::<bool>(), prop::bool::weighted(0.9), 0..3usize, gen_address())
            .prop_map(|(n, a, np, r, f, ad)| Edit::Add(n, a, np, r, f, ad)),
        3 => (0..64usize).prop_map(Edit::Remove),
        2 => (0..64usize, 0..6usize).prop_map(|(i, a)| Edit::Relabel(i, a)),
        1 => (0..64usize, 0..8usize).prop_map(|(i, n)| Edit::Move(i, n)),
        1 => (0..64usize, gen_address()).prop_map(|(i, a)| Edit::Readdress(i, a)),
        1 => (0..64usize).prop_map(Edit::Stop),
        2 => Just(Edit::Cidrs),
    ]
}

/// Apply `edit` to `view` (`k`: a number no pod name or fresh address has used).
fn apply(view: &mut ClusterView, nodes: usize, edit: &Edit, k: usize) {
    let addresses = |view: &ClusterView, a: &Address, family: usize| match a {
        Address::Fresh => gen_pod_ips(1000 + k, family),
        Address::OfPod(i) if !view.pods.is_empty() => view.pods[i % view.pods.len()].ips.clone(),
        Address::OfPod(_) | Address::Outside => {
            vec![IpAddr::V4(ip(&format!("10.99.0.{}", k % 250 + 1)))]
        }
        Address::OfNode(n) => vec![underlay_of(view, &format!("n{}", n % nodes))],
    };
    let existing = |view: &ClusterView, i: usize| {
        (!view.pods.is_empty()).then(|| (*view.pods[i % view.pods.len()]).clone())
    };
    match edit {
        Edit::Add(n, app, np, running, family, a) => {
            let ns = if *np { "np" } else { "default" };
            let mut p = pod(
                ns,
                &format!("q{k}"),
                &format!("app{app}"),
                &format!("n{}", n % nodes),
                "0.0.0.0",
            );
            p.ips = addresses(view, a, *family);
            p.running = *running;
            put(view, p);
        }
        Edit::Remove(i) => {
            if let Some(p) = existing(view, *i) {
                view.pods
                    .retain(|q| q.name != p.name || q.namespace != p.namespace);
            }
        }
        Edit::Relabel(i, app) => {
            if let Some(mut p) = existing(view, *i) {
                p.labels = Arc::new(labels(&[("app", &format!("app{app}"))]).unwrap_or_default());
                put(view, p);
            }
        }
        Edit::Move(i, n) => {
            if let Some(mut p) = existing(view, *i) {
                p.node_name = Some(format!("n{}", n % nodes).into());
                put(view, p);
            }
        }
        Edit::Readdress(i, a) => {
            if let Some(mut p) = existing(view, *i) {
                p.ips = addresses(view, a, k % 3);
                put(view, p);
            }
        }
        Edit::Stop(i) => {
            if let Some(mut p) = existing(view, *i) {
                p.running = false;
                put(view, p);
            }
        }
        // Declared, then with the nodes' range (pods may take a node's address), then
        // none.
        Edit::Cidrs => match view.cluster_cidrs.len() {
            0 => view.cluster_cidrs = declared(),
            2 => view
                .cluster_cidrs
                .push("10.0.0.0/24".parse().expect("CIDR")),
            _ => view.cluster_cidrs.clear(),
        },
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Whatever the cluster and the pod edits: after every edit, the memo's result
    /// (patched, taken again or compiled anew) is the full compile's, on every node.
    #[test]
    fn an_incremental_compile_equals_a_full_one(
        nodes in proptest::collection::vec(gen_node(), 1..5),
        pods in proptest::collection::vec((0..5usize, 0..6usize, any::<bool>(), 0..3usize), 0..16),
        policies in proptest::collection::vec(gen_policy(), 0..3),
        isolated in any::<bool>(),
        edits in proptest::collection::vec(gen_edit(), 1..24),
    ) {
        let mut view = build_view(&nodes, &pods, &policies);
        view.cluster_cidrs = declared();
        view.pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        if isolated {
            view.network_policies = vec![isolating("np")];
        }
        let names: Vec<String> = (0..nodes.len()).map(|i| format!("n{i}")).collect();
        let mut memos: Vec<Memo> = names.iter().map(|_| Memo::default()).collect();
        let mut accepted: Vec<BTreeMap<String, EgressGatewayPolicy>> = vec![BTreeMap::new(); names.len()];
        let peers = PeerView::default();
        for (k, edit) in std::iter::once(None).chain(edits.iter().map(Some)).enumerate() {
            if let Some(edit) = edit {
                apply(&mut view, nodes.len(), edit, k);
            }
            let snap = snapshot(&view);
            for (i, me) in names.iter().enumerate() {
                let (inc, made) = memos[i].compile(&snap, &peers, &accepted[i], me);
                let full = compile_remembering(&view, &peers, &accepted[i], me);
                prop_assert_eq!(&*inc, &full, "{} after {:?} ({:?})", me, edit, made);
                accepted[i] = full.accepted;
            }
        }
    }
}
