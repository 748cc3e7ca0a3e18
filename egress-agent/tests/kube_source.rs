//! The Kubernetes source and writers against a fake API server: a small HTTP/1.1 server on
//! 127.0.0.1 that serves LIST (with a resourceVersion) and WATCH (chunked, newline-delimited
//! JSON events) for the five watched kinds, GET and PATCH of single objects, and POST of
//! events.k8s.io/v1 Events, and that the tests script: send events, end a watch, answer
//! `410 Gone`, drop the connection mid-chunk. No real cluster is needed.
//!
//! Every wait is bounded: a test fails, it does not hang.

use std::{
    net::IpAddr,
    sync::{Arc, Mutex},
};

use egress_agent::{
    api::{ConditionStatus, EgressIpStatus, PodScope, PolicyCondition, PolicyStatus},
    source::{
        Snapshot,
        kube::{self as kube_source, EventType},
    },
};
use serde_json::{Value, json};
use support::*;
use tokio::{sync::watch, time::timeout};

mod support;

// ---------------------------------------------------------------------------------------
// Objects

fn pod(ns: &str, name: &str, ip: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "api"}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
    })
}

fn namespace(name: &str) -> Value {
    json!({"metadata": {"name": name, "labels": {"team": "payments"}}})
}

fn node(name: &str, ip: &str) -> Value {
    json!({
        "metadata": {"name": name, "labels": {"egress.dev/gateway": "true"}},
        "status": {
            "addresses": [{"type": "InternalIP", "address": ip}],
            "conditions": [{"type": "Ready", "status": "True"}]
        }
    })
}

fn policy(name: &str) -> Value {
    json!({
        "metadata": {"name": name, "generation": 3},
        "spec": {
            "gatewaySelector": {"matchLabels": {"egress.dev/gateway": "true"}},
            "rules": [{"destinations": ["192.0.2.0/24"], "egressIP": "198.51.100.10"}]
        }
    })
}

fn egress_node(name: &str, underlay: &str) -> Value {
    json!({
        "metadata": {"name": name},
        "spec": {"underlayIP": underlay},
        "status": {"interfaces": [{"name": "ens224", "up": true,
                                   "addresses": ["198.51.100.2/24"]}]}
    })
}

/// A NetworkPolicy of namespace payments isolating every pod for egress, allowing TCP 443
/// to `cidr`.
fn network_policy(name: &str, cidr: &str) -> Value {
    json!({
        "metadata": {"namespace": "payments", "name": name},
        "spec": {"podSelector": {}, "policyTypes": ["Egress"],
                 "egress": [{"to": [{"ipBlock": {"cidr": cidr}}],
                             "ports": [{"protocol": "TCP", "port": 443}]}]}
    })
}

/// A server holding a small cluster: namespace payments, pods a and b, one node, one
/// policy, one EgressNode, one NetworkPolicy.
async fn cluster() -> Fake {
    let fake = Fake::start().await;
    fake.put_silently(NAMESPACES, namespace("payments"));
    fake.put_silently(PODS, pod("payments", "a", "10.0.0.1"));
    fake.put_silently(PODS, pod("payments", "b", "10.0.0.2"));
    fake.put_silently(NODES, node("node-1", "172.16.0.1"));
    fake.put_silently(POLICIES, policy("payments"));
    fake.put_silently(EGRESS_NODES, egress_node("node-1", "172.16.0.1"));
    fake.put_silently(
        NETWORK_POLICIES,
        network_policy("https-only", "192.0.2.0/24"),
    );
    fake
}

async fn start_watch(fake: &Fake) -> watch::Receiver<Arc<Snapshot>> {
    timeout(WAIT, kube_source::watch(fake.client(), Vec::new()))
        .await
        .expect("initial lists within the time limit")
        .expect("watch")
}

fn pod_names(snapshot: &Snapshot) -> Vec<String> {
    let mut names: Vec<String> = snapshot.view.pods.iter().map(|p| p.name.clone()).collect();
    names.sort();
    names
}

/// Wait until the published snapshot satisfies `done`.
async fn wait_for(
    rx: &mut watch::Receiver<Arc<Snapshot>>,
    what: &str,
    done: impl Fn(&Snapshot) -> bool,
) -> Arc<Snapshot> {
    let result = timeout(WAIT, async {
        loop {
            let snapshot = rx.borrow_and_update().clone();
            if done(&snapshot) {
                return snapshot;
            }
            if rx.changed().await.is_err() {
                panic!("the source stopped while waiting for {what}");
            }
        }
    })
    .await;
    match result {
        Ok(snapshot) => snapshot,
        Err(_) => panic!(
            "{what}: not seen within {WAIT:?}; last pods: {:?}",
            pod_names(&rx.borrow())
        ),
    }
}

/// Records whether any snapshot published after the first lost every pod: the view must
/// keep the last good state while watches recover.
fn watch_for_empty_views(mut rx: watch::Receiver<Arc<Snapshot>>) -> Arc<Mutex<bool>> {
    let emptied = Arc::new(Mutex::new(false));
    let flag = emptied.clone();
    tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            if rx.borrow_and_update().view.pods.is_empty() {
                *flag.lock().unwrap_or_else(|e| e.into_inner()) = true;
            }
        }
    });
    emptied
}

fn assert_never_emptied(emptied: &Mutex<bool>) {
    assert!(
        !*emptied.lock().unwrap_or_else(|e| e.into_inner()),
        "a snapshot without pods was published while the watch recovered"
    );
}

/// A watched `cluster()` whose pods' first watch is open, with a guard that no view
/// published from then on loses every pod.
struct Recovering {
    fake: Fake,
    rx: watch::Receiver<Arc<Snapshot>>,
    emptied: Arc<Mutex<bool>>,
}

async fn recovering() -> Recovering {
    let fake = cluster().await;
    let rx = start_watch(&fake).await;
    let emptied = watch_for_empty_views(rx.clone());
    fake.wait_watches(PODS, 1).await;
    Recovering { fake, rx, emptied }
}

impl Recovering {
    /// Once the pods' second watch is open, pod `name` is added: the view must come to
    /// hold the pods `want` (`what` names the wait), and never have been empty.
    async fn a_pod_added_arrives(&mut self, what: &str, name: &str, ip: &str, want: &[&str]) {
        self.fake.wait_watches(PODS, 2).await;
        self.fake.apply(PODS, pod("payments", name, ip));
        wait_for(&mut self.rx, what, |s| pod_names(s) == want).await;
        assert_never_emptied(&self.emptied);
    }
}

// ---------------------------------------------------------------------------------------
// Reading

#[tokio::test]
async fn initial_list_produces_the_view() {
    let fake = cluster().await;
    // An object the agent cannot decode is reported, naming kind, name and field, and the
    // rest of its kind still arrives.
    fake.put_silently(
        PODS,
        json!({"metadata": {"name": "bad", "namespace": "payments"},
               "spec": {"containers": []}, "status": {"podIPs": "10.0.0.9"}}),
    );
    let rx = start_watch(&fake).await;
    let snapshot = rx.borrow().clone();
    let view = &snapshot.view;
    assert_eq!(pod_names(&snapshot), ["a", "b"]);
    assert_eq!(
        view.pods[0].ips,
        ["10.0.0.1".parse::<IpAddr>().expect("ip")]
    );
    assert_eq!(view.pods[0].node_name.as_deref(), Some("node-1"));
    assert_eq!(view.namespaces.len(), 1);
    assert_eq!(view.nodes.len(), 1);
    assert_eq!(view.policies.len(), 1);
    assert_eq!(view.policies[0].metadata.name.as_deref(), Some("payments"));
    assert_eq!(
        view.policies[0].spec.rules[0].egress_ip.as_deref(),
        Some("198.51.100.10")
    );
    assert_eq!(view.network_policies.len(), 1);
    assert_eq!(
        view.network_policies[0].metadata.name.as_deref(),
        Some("https-only")
    );
    assert_eq!(view.egress_nodes.len(), 1);
    assert_eq!(
        view.egress_nodes[0].spec.underlay_ip.as_deref(),
        Some("172.16.0.1")
    );
    let errors: Vec<String> = snapshot.errors.iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("(Pod payments/bad): status.podIPs:"),
        "{}",
        errors[0]
    );
}

#[tokio::test]
async fn objects_that_fail_their_checks_are_reported_and_the_rest_served() {
    let fake = cluster().await;
    // Decodes, but its address is no address: reported as the YAML source reports it.
    fake.put_silently(PODS, pod("payments", "bad-ip", "10.0.0"));
    fake.put_silently(EGRESS_NODES, egress_node("node-2", "172.16.0.300"));
    let rx = start_watch(&fake).await;
    let snapshot = rx.borrow().clone();
    assert_eq!(pod_names(&snapshot), ["a", "b"]);
    assert_eq!(snapshot.view.egress_nodes.len(), 1);
    let errors: Vec<String> = snapshot.errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        errors,
        [
            "file /api/v1/namespaces/payments/pods/bad-ip doc 1 (Pod payments/bad-ip): \
             status.podIP: invalid IP address \"10.0.0\"",
            "file /api/v1/namespaces/payments/pods/bad-ip doc 1 (Pod payments/bad-ip): \
             status.podIPs[0].ip: invalid IP address \"10.0.0\"",
            "file /apis/egress.dev/v1alpha1/egressnodes/node-2 doc 1 (EgressNode node-2): \
             spec.underlayIP: invalid IP address \"172.16.0.300\"",
        ]
    );
}

#[tokio::test]
async fn failing_first_lists_are_retried_before_the_first_view() {
    let fake = cluster().await;
    fake.fail_lists(EGRESS_NODES, 1);
    let rx = start_watch(&fake).await;
    // The first view is complete: never published before every kind was listed.
    let snapshot = rx.borrow().clone();
    assert_eq!(snapshot.view.egress_nodes.len(), 1);
    assert_eq!(pod_names(&snapshot), ["a", "b"]);
    assert_eq!(fake.lists(EGRESS_NODES), 2);
}

#[tokio::test]
async fn watch_events_update_the_view() {
    let fake = cluster().await;
    let mut rx = start_watch(&fake).await;
    fake.wait_watches(PODS, 1).await;

    fake.apply(PODS, pod("payments", "c", "10.0.0.3"));
    wait_for(&mut rx, "ADDED pod c", |s| pod_names(s) == ["a", "b", "c"]).await;

    let mut moved = pod("payments", "c", "10.0.0.3");
    moved["metadata"]["labels"]["app"] = json!("web");
    fake.apply(PODS, moved);
    wait_for(&mut rx, "MODIFIED pod c", |s| {
        s.view
            .pods
            .iter()
            .any(|p| p.name == "c" && p.labels.get("app").map(String::as_str) == Some("web"))
    })
    .await;

    fake.delete(PODS, "payments/a");
    wait_for(&mut rx, "DELETED pod a", |s| pod_names(s) == ["b", "c"]).await;

    // Other kinds too.
    fake.wait_watches(POLICIES, 1).await;
    fake.apply(POLICIES, policy("second"));
    wait_for(&mut rx, "ADDED policy", |s| s.view.policies.len() == 2).await;
}

// ---------------------------------------------------------------------------------------
// An agent's pods: its node's, or every pod (issue 34)

fn pod_on(name: &str, ip: &str, node: &str) -> Value {
    let mut p = pod("payments", name, ip);
    p["spec"]["nodeName"] = json!(node);
    p
}

/// `cluster()` and a worker, node-2 (not selected by the policy, not the first node by
/// name), with pods c and d.
async fn cluster_with_a_worker() -> Fake {
    let fake = cluster().await;
    let mut worker = node("node-2", "172.16.0.2");
    worker["metadata"]["labels"] = json!({});
    fake.put_silently(NODES, worker);
    fake.put_silently(PODS, pod_on("c", "10.0.0.3", "node-2"));
    fake.put_silently(PODS, pod_on("d", "10.0.0.4", "node-2"));
    fake
}

/// Watch as node `name`'s agent does, with the cluster's pods in 10.0.0.0/16; returns
/// the sender of what its compiles need.
async fn start_node_watch(
    fake: &Fake,
    name: &str,
) -> (watch::Receiver<Arc<Snapshot>>, watch::Sender<PodScope>) {
    let (needed, wanted) = watch::channel(PodScope::Node);
    let node = kube_source::NodePods {
        name: name.to_owned(),
        wanted,
        needs: egress_agent::compiler::pods_needed,
    };
    let cidrs = vec!["10.0.0.0/16".parse().expect("CIDR")];
    let rx = timeout(WAIT, kube_source::watch_node(fake.client(), cidrs, node))
        .await
        .expect("initial lists within the time limit")
        .expect("watch");
    (rx, needed)
}

/// The views published, as (pod scope, pod names).
type Views = Arc<Mutex<Vec<(PodScope, Vec<String>)>>>;

/// Every view published from now on, as (pod scope, pod names).
fn record_views(mut rx: watch::Receiver<Arc<Snapshot>>) -> Views {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let out = seen.clone();
    tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let s = rx.borrow_and_update().clone();
            let views = &mut *out.lock().unwrap_or_else(|e| e.into_inner());
            views.push((s.view.pod_scope, pod_names(&s)));
        }
    });
    seen
}

#[tokio::test]
async fn a_worker_lists_and_watches_only_its_nodes_pods() {
    let fake = cluster_with_a_worker().await;
    let (mut rx, _needed) = start_node_watch(&fake, "node-2").await;
    let first = rx.borrow_and_update().clone();
    assert_eq!(first.view.pod_scope, PodScope::Node);
    assert_eq!(pod_names(&first), ["c", "d"]);
    let sent = fake.sent(PODS);
    assert_eq!((sent.lists, sent.list_objects), (1, 2), "{sent:?}");
    // Everything else as before.
    assert_eq!(first.view.nodes.len(), 2);
    assert_eq!(first.view.policies.len(), 1);

    fake.wait_watches(PODS, 1).await;
    fake.apply(PODS, pod_on("e", "10.0.0.5", "node-1"));
    fake.apply(PODS, pod_on("f", "10.0.0.6", "node-2"));
    wait_for(&mut rx, "pod f of node-2", |s| {
        pod_names(s) == ["c", "d", "f"]
    })
    .await;
    fake.delete(PODS, "payments/c");
    wait_for(&mut rx, "pod c deleted", |s| pod_names(s) == ["d", "f"]).await;
    assert_eq!(fake.sent(PODS).watch_events, 2, "f added, c deleted; not e");
}

#[tokio::test]
async fn a_gateway_and_the_status_writer_watch_every_pod() {
    let fake = cluster_with_a_worker().await;
    // node-1 is both: selected by the policy and the first Ready node by name.
    let (rx, _needed) = start_node_watch(&fake, "node-1").await;
    let first = rx.borrow().clone();
    assert_eq!(first.view.pod_scope, PodScope::Cluster);
    assert_eq!(pod_names(&first), ["a", "b", "c", "d"]);
}

#[tokio::test]
async fn a_role_change_switches_the_watch_without_a_partial_view() {
    let fake = cluster_with_a_worker().await;
    let (mut rx, needed) = start_node_watch(&fake, "node-2").await;
    let views = record_views(rx.clone());
    let all = ["a", "b", "c", "d"];
    let own = ["c", "d"];
    fake.wait_watches(NODES, 1).await;

    // A gateway label: every pod, listed while its own pods are served.
    fake.apply(NODES, node("node-2", "172.16.0.2"));
    wait_for(&mut rx, "every pod", |s| {
        s.view.pod_scope == PodScope::Cluster
    })
    .await;
    assert_eq!(pod_names(&rx.borrow()), all);
    assert_eq!(fake.lists(PODS), 2);
    // Its pods come from the new watch: a pod of node-1 arrives.
    fake.wait_watches(PODS, 2).await;
    fake.apply(PODS, pod_on("e", "10.0.0.5", "node-1"));
    wait_for(&mut rx, "pod e", |s| pod_names(s).len() == 5).await;
    fake.delete(PODS, "payments/e");

    // The label gone, and its last compile still a gateway's: every pod still.
    let mut worker = node("node-2", "172.16.0.2");
    worker["metadata"]["labels"] = json!({});
    needed.send_replace(PodScope::Cluster);
    fake.apply(NODES, worker);
    wait_for(&mut rx, "node-2 unlabeled", |s| {
        s.view.nodes.iter().any(|n| {
            n.metadata.name.as_deref() == Some("node-2")
                && n.metadata.labels.as_ref().is_some_and(|l| l.is_empty())
        })
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(rx.borrow().view.pod_scope, PodScope::Cluster);
    // Once its compile needs its own pods only: back to those.
    needed.send_replace(PodScope::Node);
    wait_for(&mut rx, "its own pods", |s| {
        s.view.pod_scope == PodScope::Node
    })
    .await;
    assert_eq!(pod_names(&rx.borrow()), own);

    // And the agent's compile alone can widen it (it became the status writer).
    needed.send_replace(PodScope::Cluster);
    wait_for(&mut rx, "every pod again", |s| {
        s.view.pod_scope == PodScope::Cluster
    })
    .await;
    assert_eq!(pod_names(&rx.borrow()), all);

    // No view on the way held a part of the pods of its scope.
    let views = views.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert!(views.len() >= 3, "{views:?}");
    for (scope, pods) in &views {
        let ok = match scope {
            PodScope::Cluster => pods.len() >= all.len(),
            PodScope::Node => pods == &own,
        };
        assert!(
            ok,
            "a partial view was published: {scope:?} {pods:?} in {views:?}"
        );
    }
}

#[tokio::test]
async fn a_watch_that_ends_is_reestablished() {
    let mut r = recovering().await;
    let lists = r.fake.lists(PODS);

    r.fake.end_watches(PODS);
    r.a_pod_added_arrives(
        "pod c after the watch ended",
        "c",
        "10.0.0.3",
        &["a", "b", "c"],
    )
    .await;
    // Resumed from the last resourceVersion, without a new list.
    assert_eq!(r.fake.lists(PODS), lists);
}

#[tokio::test]
async fn gone_410_relists_and_the_view_converges() {
    let mut r = recovering().await;
    let lists = r.fake.lists(PODS);

    // What happened while the watch was away: a went, c came.
    r.fake.remove_silently(PODS, "payments/a");
    r.fake.put_silently(PODS, pod("payments", "c", "10.0.0.3"));
    r.fake.gone(PODS);
    // The last good view is kept meanwhile.
    assert_eq!(pod_names(&r.rx.borrow()), ["a", "b"]);
    wait_for(&mut r.rx, "the re-listed pods", |s| {
        pod_names(s) == ["b", "c"]
    })
    .await;
    assert!(r.fake.lists(PODS) > lists, "410 Gone must cause a new list");

    // And the new watch delivers later events.
    r.a_pod_added_arrives("pod d after the re-list", "d", "10.0.0.4", &["b", "c", "d"])
        .await;
}

#[tokio::test]
async fn a_dropped_connection_is_survived() {
    let mut r = recovering().await;

    r.fake.drop_watches(PODS);
    assert_eq!(pod_names(&r.rx.borrow()), ["a", "b"]);
    r.a_pod_added_arrives(
        "pod c after the connection dropped",
        "c",
        "10.0.0.3",
        &["a", "b", "c"],
    )
    .await;
}

#[tokio::test]
async fn every_kind_survives_dropped_connections() {
    let fake = cluster().await;
    let mut rx = start_watch(&fake).await;
    for path in [NAMESPACES, NODES, POLICIES, EGRESS_NODES, NETWORK_POLICIES] {
        fake.wait_watches(path, 1).await;
        fake.drop_watches(path);
    }
    for path in [NAMESPACES, NODES, POLICIES, EGRESS_NODES, NETWORK_POLICIES] {
        fake.wait_watches(path, 2).await;
    }
    fake.apply(NAMESPACES, namespace("shop"));
    fake.apply(NODES, node("node-2", "172.16.0.2"));
    fake.apply(POLICIES, policy("second"));
    fake.apply(EGRESS_NODES, egress_node("node-2", "172.16.0.2"));
    fake.apply(
        NETWORK_POLICIES,
        network_policy("second", "198.51.100.0/24"),
    );
    wait_for(&mut rx, "one more object of every kind", |s| {
        s.view.namespaces.len() == 2
            && s.view.nodes.len() == 2
            && s.view.policies.len() == 2
            && s.view.egress_nodes.len() == 2
            && s.view.network_policies.len() == 2
            && s.view.pods.len() == 2
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Writing

fn status(ready: &str) -> PolicyStatus {
    PolicyStatus {
        observed_generation: Some(3),
        conditions: vec![
            PolicyCondition {
                type_: "Accepted".to_owned(),
                status: ConditionStatus::True,
                observed_generation: Some(3),
                last_transition_time: None,
                reason: "Accepted".to_owned(),
                message: "policy accepted".to_owned(),
            },
            PolicyCondition {
                type_: "Ready".to_owned(),
                status: (ready == "True").into(),
                observed_generation: Some(3),
                last_transition_time: None,
                reason: "Held".to_owned(),
                message: "every egress IP is held".to_owned(),
            },
        ],
        egress_ips: vec![EgressIpStatus {
            ip: "198.51.100.10".to_owned(),
            node: "gw-1".to_owned(),
            interface: "ens224".to_owned(),
            ..Default::default()
        }],
    }
}

fn patches(fake: &Fake) -> Vec<Recorded> {
    fake.recorded()
        .into_iter()
        .filter(|r| r.method == "PATCH")
        .collect()
}

fn is_rfc3339_utc(text: &str) -> bool {
    text.len() == 20 && text.ends_with('Z') && text.as_bytes().get(10) == Some(&b'T')
}

#[tokio::test]
async fn publish_policy_status_patches_the_status_subresource_when_changed() {
    let fake = cluster().await;
    let client = fake.client();
    let run = |s: PolicyStatus| {
        let client = client.clone();
        async move {
            timeout(
                WAIT,
                kube_source::publish_policy_status(&client, "payments", &s),
            )
            .await
            .expect("within the time limit")
            .expect("publish")
        }
    };

    assert!(run(status("True")).await, "a new status is sent");
    let sent = patches(&fake);
    assert_eq!(sent.len(), 1);
    let patch = &sent[0];
    assert_eq!(
        patch.path,
        "/apis/egress.dev/v1alpha1/egressgatewaypolicies/payments/status"
    );
    assert_eq!(patch.content_type, "application/merge-patch+json");
    assert!(
        patch.query.contains("fieldManager=egress-agent"),
        "{}",
        patch.query
    );
    let mut body = patch.body.clone();
    for condition in body["status"]["conditions"]
        .as_array_mut()
        .expect("conditions")
    {
        let time = condition
            .as_object_mut()
            .and_then(|c| c.remove("lastTransitionTime"))
            .expect("lastTransitionTime set by the writer");
        assert!(is_rfc3339_utc(time.as_str().unwrap_or_default()), "{time}");
    }
    assert_eq!(
        body,
        json!({"status": {
            "observedGeneration": 3,
            "conditions": [
                {"type": "Accepted", "status": "True", "observedGeneration": 3,
                 "reason": "Accepted", "message": "policy accepted"},
                {"type": "Ready", "status": "True", "observedGeneration": 3,
                 "reason": "Held", "message": "every egress IP is held"}
            ],
            "egressIPs": [{"ip": "198.51.100.10", "node": "gw-1", "interface": "ens224"}]
        }})
    );

    // The same status again: nothing is sent.
    assert!(
        !run(status("True")).await,
        "an unchanged status is not sent"
    );
    assert_eq!(patches(&fake).len(), 1);

    // Ready flips: sent, and Accepted keeps its transition time.
    assert!(run(status("False")).await);
    let sent = patches(&fake);
    assert_eq!(sent.len(), 2);
    let times = |r: &Recorded| -> Vec<String> {
        r.body["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                c["lastTransitionTime"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect()
    };
    assert_eq!(times(&sent[1])[0], times(&sent[0])[0]);
    assert_eq!(sent[1].body["status"]["conditions"][1]["status"], "False");

    // A policy that is gone is not an error.
    let gone = timeout(
        WAIT,
        kube_source::publish_policy_status(&client, "nope", &status("True")),
    )
    .await
    .expect("within the time limit")
    .expect("publish");
    assert!(!gone);
}

#[tokio::test]
async fn publish_egress_node_applies_spec_and_status() {
    let fake = Fake::start().await;
    let client = fake.client();
    let doc: egress_agent::api::EgressNode =
        serde_json::from_value(egress_node("gw-1", "172.16.0.9")).expect("EgressNode");
    timeout(WAIT, kube_source::publish_egress_node(&client, &doc))
        .await
        .expect("within the time limit")
        .expect("publish");
    let sent = patches(&fake);
    assert_eq!(sent.len(), 2, "{sent:?}");
    for (r, path) in sent.iter().zip([
        "/apis/egress.dev/v1alpha1/egressnodes/gw-1",
        "/apis/egress.dev/v1alpha1/egressnodes/gw-1/status",
    ]) {
        assert_eq!(r.path, path);
        assert_eq!(r.content_type, "application/apply-patch+yaml");
        assert!(r.query.contains("fieldManager=egress-agent"), "{}", r.query);
        assert!(r.query.contains("force=true"), "{}", r.query);
        assert_eq!(r.body["apiVersion"], "egress.dev/v1alpha1");
        assert_eq!(r.body["kind"], "EgressNode");
        assert_eq!(r.body["metadata"], json!({"name": "gw-1"}));
    }
    assert_eq!(sent[0].body["spec"], json!({"underlayIP": "172.16.0.9"}));
    assert_eq!(sent[0].body.get("status"), None);
    assert_eq!(
        sent[1].body["status"]["interfaces"][0]["name"],
        json!("ens224")
    );

    let mut nameless = doc.clone();
    nameless.metadata.name = None;
    assert!(
        kube_source::publish_egress_node(&client, &nameless)
            .await
            .is_err()
    );
}

/// Record an `EgressIPMoved` Event on policy `payments`, as the agent of `gw-2` does.
async fn record_move(client: &kube::Client, message: &str) {
    timeout(
        WAIT,
        kube_source::record_event(
            client,
            "payments",
            "gw-2",
            EventType::Normal,
            "EgressIPMoved",
            message,
        ),
    )
    .await
    .expect("within the time limit")
    .expect("record");
}

/// The Events POSTed to the fake API server, in order.
fn posted_events(fake: &Fake) -> Vec<Recorded> {
    fake.recorded()
        .into_iter()
        .filter(|r| r.method == "POST" && r.path == EVENTS)
        .collect()
}

#[tokio::test]
async fn record_event_creates_an_events_k8s_io_event_on_the_policy() {
    let fake = cluster().await;
    record_move(
        &fake.client(),
        "egress IP 198.51.100.10 moved from gw-1 to gw-2",
    )
    .await;
    let posted = posted_events(&fake);
    assert_eq!(posted.len(), 1);
    let event = &posted[0].body;
    assert_eq!(event["apiVersion"], "events.k8s.io/v1");
    assert_eq!(event["kind"], "Event");
    assert_eq!(
        event["regarding"],
        json!({"apiVersion": "egress.dev/v1alpha1", "kind": "EgressGatewayPolicy",
               "name": "payments", "uid": "uid-payments",
               "resourceVersion": event["regarding"]["resourceVersion"]})
    );
    assert_eq!(event["type"], "Normal");
    assert_eq!(event["reason"], "EgressIPMoved");
    assert_eq!(event["action"], kube_source::writer::EVENT_ACTION);
    assert_eq!(
        event["note"],
        "egress IP 198.51.100.10 moved from gw-1 to gw-2"
    );
    assert_eq!(event["reportingController"], "egress-agent");
    assert_eq!(event["reportingInstance"], "gw-2");
    assert!(event["eventTime"].is_string(), "{event}");
    // In namespace default: the path (`EVENTS`) names it, the body does not.
    assert_eq!(event["metadata"].get("namespace"), None);
}

/// A Recorder kept across Events would make the second move a series of the first (a
/// PATCH of its count, the first note kept): each move is an Event of its own.
#[tokio::test]
async fn each_move_of_a_policy_egress_ip_is_an_event_with_its_own_note() {
    let fake = cluster().await;
    let client = fake.client();
    let moves = [
        "egress IP 198.51.100.10 moved from gw-1 to gw-2",
        "egress IP 198.51.100.10 moved from gw-2 to gw-1",
    ];
    for message in moves {
        record_move(&client, message).await;
    }
    let notes: Vec<Value> = posted_events(&fake)
        .into_iter()
        .map(|r| r.body["note"].clone())
        .collect();
    assert_eq!(notes, moves.map(|m| json!(m)));
    assert!(
        fake.recorded()
            .iter()
            .all(|r| r.method != "PATCH" || !r.path.starts_with(EVENTS)),
        "no Event is patched into a series"
    );
}
