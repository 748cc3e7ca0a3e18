//! The API's fan-out (issue 34): what each agent's Kubernetes source receives from the API
//! server, against the fake one (`support`), by role. Before, every agent listed and
//! watched every pod; now a worker lists and watches its node's pods
//! (`fieldSelector=spec.nodeName=<node>`) and only a gateway or the status writer every
//! pod ([`egress_agent::compiler::pods_needed`]).
//!
//! `fan_out_at_100_nodes_and_100k_pods` (ignored: a minute or more in a debug build;
//! `cargo xtask bench` runs it) prints the table of docs/benchmarks.md:
//!
//! ```text
//! cargo test -p egress-agent --release --test fan_out -- --ignored --nocapture
//! ```
//!
//! The pods are shaped as a Deployment's are served (managed fields, one container with a
//! service-account volume, conditions, a running container status): about 3.6 KB of JSON
//! each.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use egress_agent::{
    api::PodScope,
    compiler::compile,
    source::{Snapshot, kube as kube_source},
};
use serde_json::{Value, json};
use support::*;
use tokio::{sync::watch, time::timeout};

mod support;

/// The shape of a synthetic cluster.
#[derive(Clone, Copy, Debug)]
struct Shape {
    nodes: usize,
    pods_per_node: usize,
    /// Nodes `node-001` .. that the policies' gatewaySelector selects (`node-000`, the
    /// first by name, writes the statuses).
    gateways: usize,
    teams: usize,
}

impl Shape {
    fn pods(&self) -> usize {
        self.nodes * self.pods_per_node
    }
}

fn node_name(n: usize) -> String {
    format!("node-{n:03}")
}

fn node_ip(n: usize) -> String {
    format!("10.98.{}.{}", n / 250, n % 250 + 1)
}

/// Node `n`'s pod CIDR, a /21 of 100.64.0.0/10, and its `k`th pod's address.
fn pod_cidr(n: usize) -> String {
    let base = (100u32 << 24) | (64 << 16);
    let net = base + (n as u32) * 2048;
    format!("{}/21", std::net::Ipv4Addr::from(net))
}

fn pod_ip(n: usize, k: usize) -> String {
    let base = (100u32 << 24) | (64 << 16);
    std::net::Ipv4Addr::from(base + (n as u32) * 2048 + k as u32 + 1).to_string()
}

const TIME: &str = "2026-12-01T10:00:00Z";
const IMAGE_ID: &str = "registry.example.com/team/api@sha256:\
                        3f1e0c5b9a7d4e2f8c6b1a0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f";

/// A pod as the API server serves a Deployment's.
fn pod(shape: &Shape, n: usize, k: usize) -> Value {
    let team = (n * shape.pods_per_node + k) % shape.teams;
    let hash = format!("{:010x}", 0x005d_8f7c_u64 + team as u64);
    let name = format!("api-{hash}-{n:03}x{k:04}");
    let (ip, host) = (pod_ip(n, k), node_ip(n));
    json!({
        "metadata": {
            "name": name, "generateName": format!("api-{hash}-"),
            "namespace": format!("team-{team}"),
            "uid": format!("0b1c2d3e-{n:04}-{k:04}-8000-00000000{team:04}"),
            "creationTimestamp": TIME,
            "labels": {"app": "api", "pod-template-hash": hash},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "name": format!("api-{hash}"), "uid": format!("7e6f5a4b-0000-4000-8000-{team:012}"),
                "controller": true, "blockOwnerDeletion": true}],
            "managedFields": [
                {"manager": "kube-controller-manager", "operation": "Update",
                 "apiVersion": "v1", "time": TIME, "fieldsType": "FieldsV1",
                 "fieldsV1": {"f:metadata": {"f:generateName": {}, "f:labels": {".": {},
                    "f:app": {}, "f:pod-template-hash": {}}, "f:ownerReferences": {".": {},
                    "k:{\"uid\":\"7e6f5a4b\"}": {}}}, "f:spec": {"f:containers":
                    {"k:{\"name\":\"api\"}": {".": {}, "f:image": {}, "f:imagePullPolicy": {},
                    "f:name": {}, "f:ports": {}, "f:resources": {}}}, "f:dnsPolicy": {},
                    "f:enableServiceLinks": {}, "f:restartPolicy": {}, "f:schedulerName": {},
                    "f:securityContext": {}, "f:terminationGracePeriodSeconds": {}}}},
                {"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
                 "time": TIME, "fieldsType": "FieldsV1", "subresource": "status",
                 "fieldsV1": {"f:status": {"f:conditions": {}, "f:containerStatuses": {},
                    "f:hostIP": {}, "f:hostIPs": {}, "f:phase": {}, "f:podIP": {},
                    "f:podIPs": {".": {}, "k:{\"ip\":\"ip\"}": {".": {}, "f:ip": {}}},
                    "f:startTime": {}}}}
            ]
        },
        "spec": {
            "containers": [{
                "name": "api", "image": "registry.example.com/team/api:1.4.2",
                "imagePullPolicy": "IfNotPresent",
                "ports": [{"containerPort": 8080, "name": "http", "protocol": "TCP"}],
                "resources": {"limits": {"memory": "256Mi"},
                              "requests": {"cpu": "100m", "memory": "128Mi"}},
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File",
                "volumeMounts": [{"mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                    "name": "kube-api-access-x7k2p", "readOnly": true}]
            }],
            "dnsPolicy": "ClusterFirst", "enableServiceLinks": true,
            "nodeName": node_name(n), "preemptionPolicy": "PreemptLowerPriority",
            "priority": 0, "restartPolicy": "Always", "schedulerName": "default-scheduler",
            "securityContext": {}, "serviceAccount": "default",
            "serviceAccountName": "default", "terminationGracePeriodSeconds": 30,
            "tolerations": [
                {"effect": "NoExecute", "key": "node.kubernetes.io/not-ready",
                 "operator": "Exists", "tolerationSeconds": 300},
                {"effect": "NoExecute", "key": "node.kubernetes.io/unreachable",
                 "operator": "Exists", "tolerationSeconds": 300}
            ],
            "volumes": [{"name": "kube-api-access-x7k2p", "projected": {
                "defaultMode": 420, "sources": [
                    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                    {"configMap": {"name": "kube-root-ca.crt",
                                   "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                    {"downwardAPI": {"items": [{"path": "namespace", "fieldRef":
                        {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}
                ]}}]
        },
        "status": {
            "phase": "Running",
            "conditions": conditions(),
            "hostIP": host, "hostIPs": [{"ip": host}],
            "podIP": ip, "podIPs": [{"ip": ip}],
            "startTime": TIME, "qosClass": "Burstable",
            "containerStatuses": [{
                "name": "api", "ready": true, "restartCount": 0, "started": true,
                "image": "registry.example.com/team/api:1.4.2",
                "imageID": IMAGE_ID,
                "containerID": format!("containerd://{:064x}", n * 1_000_003 + k),
                "lastState": {}, "state": {"running": {"startedAt": TIME}}
            }]
        }
    })
}

/// A running pod's conditions.
fn conditions() -> Vec<Value> {
    [
        "PodReadyToStartContainers",
        "Initialized",
        "Ready",
        "ContainersReady",
        "PodScheduled",
    ]
    .iter()
    .map(
        |t| json!({"type": t, "status": "True", "lastProbeTime": null, "lastTransitionTime": TIME}),
    )
    .collect()
}

fn node(shape: &Shape, n: usize) -> Value {
    let labels = if (1..=shape.gateways).contains(&n) {
        json!({"kubernetes.io/hostname": node_name(n), "egress.dev/gateway": "true"})
    } else {
        json!({"kubernetes.io/hostname": node_name(n)})
    };
    json!({
        "metadata": {"name": node_name(n), "labels": labels},
        "spec": {"podCIDR": pod_cidr(n), "podCIDRs": [pod_cidr(n)]},
        "status": {
            "addresses": [{"type": "InternalIP", "address": node_ip(n)},
                          {"type": "Hostname", "address": node_name(n)}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "lastHeartbeatTime": TIME, "lastTransitionTime": TIME}]
        }
    })
}

fn egress_node(n: usize) -> Value {
    json!({
        "metadata": {"name": node_name(n)},
        "spec": {"underlayIP": node_ip(n)},
        "status": {"interfaces": [{"name": "ens224", "up": true,
                                   "addresses": [format!("192.168.101.{}/24", n + 2)]}],
                   "helloVersion": 2}
    })
}

fn policy(t: usize) -> Value {
    let destinations: Vec<String> = (0..10)
        .map(|j| format!("198.18.{}.0/24", t * 10 + j))
        .collect();
    json!({
        "metadata": {"name": format!("team-{t}"), "generation": 1},
        "spec": {
            "namespaceSelector": {"matchLabels": {"team": format!("team-{t}")}},
            "podSelector": {"matchLabels": {"app": "api"}},
            "gatewaySelector": {"matchLabels": {"egress.dev/gateway": "true"}},
            "rules": [{"destinations": destinations,
                       "egressIP": format!("192.168.101.{}", 200 + t)}]
        }
    })
}

/// A fake API server holding the cluster of `shape`.
async fn cluster(shape: &Shape) -> Fake {
    let fake = Fake::start().await;
    for t in 0..shape.teams {
        fake.put_silently(
            NAMESPACES,
            json!({"metadata": {"name": format!("team-{t}"),
                                "labels": {"team": format!("team-{t}")}}}),
        );
        fake.put_silently(POLICIES, policy(t));
    }
    for n in 0..shape.nodes {
        fake.put_silently(NODES, node(shape, n));
        fake.put_silently(EGRESS_NODES, egress_node(n));
        for k in 0..shape.pods_per_node {
            fake.put_silently(PODS, pod(shape, n, k));
        }
    }
    fake
}

/// The agents compared: before (every pod, as every agent watched), then a worker, a
/// gateway and the status writer (node-000: the first Ready node by name, not a gateway)
/// as they watch now.
#[derive(Clone, Copy, Debug)]
enum Agent {
    Before,
    Worker,
    Gateway,
    Writer,
}

impl Agent {
    const ALL: [Self; 4] = [Self::Before, Self::Worker, Self::Gateway, Self::Writer];

    fn node(self, shape: &Shape) -> String {
        match self {
            Self::Before | Self::Worker => node_name(shape.nodes / 2),
            Self::Gateway => node_name(1),
            Self::Writer => node_name(0),
        }
    }

    fn label(self, shape: &Shape) -> String {
        match self {
            Self::Before => format!("any agent before ({} here)", self.node(shape)),
            Self::Worker => format!("worker ({})", self.node(shape)),
            Self::Gateway => format!("gateway ({})", self.node(shape)),
            Self::Writer => format!("status writer ({})", self.node(shape)),
        }
    }
}

/// What one agent received.
struct Received {
    agent: Agent,
    first_view: Duration,
    pods_in_view: usize,
    scope: PodScope,
    /// Its compile of the first view (the fastest of three), and the pod owners and
    /// policy entries it gave.
    compile_took: Duration,
    owners: usize,
    entries: usize,
    desired: egress_agent::desired::Desired,
    pods_listed: Sent,
    others_listed: Sent,
    pods_watched: Sent,
    others_watched: Sent,
}

const OTHER_KINDS: [&str; 5] = [NAMESPACES, NODES, POLICIES, EGRESS_NODES, NETWORK_POLICIES];

fn others(fake: &Fake) -> Sent {
    let mut sum = Sent::default();
    for path in OTHER_KINDS {
        sum += fake.sent(path);
    }
    sum
}

/// Start `agent`'s source, count its initial lists, then `changes` pod updates spread
/// over every node (one each, round robin) and one EgressNode update per node, and count
/// what its watches received of them.
async fn run(fake: &Fake, shape: &Shape, agent: Agent, changes: usize) -> Received {
    fake.reset_sent();
    let watching = [PODS, NODES, EGRESS_NODES].map(|p| (p, fake.watches_started(p)));
    let cidrs = vec!["100.64.0.0/10".parse().expect("CIDR")];
    let t0 = Instant::now();
    let (rx, _needed): (
        watch::Receiver<Arc<Snapshot>>,
        Option<watch::Sender<PodScope>>,
    ) = match agent {
        Agent::Before => (
            timeout(WAIT * 30, kube_source::watch(fake.client(), cidrs))
                .await
                .expect("listed in time")
                .expect("watch"),
            None,
        ),
        _ => {
            let (needed, wanted) = watch::channel(PodScope::Node);
            let node = kube_source::NodePods {
                name: agent.node(shape),
                wanted,
                needs: egress_agent::compiler::pods_needed,
            };
            let rx = timeout(
                WAIT * 30,
                kube_source::watch_node(fake.client(), cidrs, node),
            )
            .await
            .expect("listed in time")
            .expect("watch");
            (rx, Some(needed))
        }
    };
    let first_view = t0.elapsed();
    let first = rx.borrow().clone();
    let (pods_in_view, scope) = (first.view.pods.len(), first.view.pod_scope);
    // What a pass costs the node from that view: its compile (the fastest of three, on a
    // shared machine).
    let mut compile_took = Duration::MAX;
    let mut compiled = None;
    for _ in 0..3 {
        let t1 = Instant::now();
        compiled = Some(compile(&first.view, &agent.node(shape)));
        compile_took = compile_took.min(t1.elapsed());
    }
    let compiled = compiled.expect("compiled");
    drop(first);
    let pods_listed = fake.sent(PODS);
    let others_listed = others(fake);
    // Its own watches are open (the watches of the agents before it are closed).
    for (path, before) in watching {
        fake.wait_watches(path, before + 1).await;
    }
    fake.reset_sent();
    for c in 0..changes {
        let (n, k) = (c % shape.nodes, (c / shape.nodes) % shape.pods_per_node);
        let mut p = pod(shape, n, k);
        p["status"]["conditions"][2]["status"] = json!(if c % 2 == 0 { "False" } else { "True" });
        fake.apply(PODS, p);
    }
    for n in 0..shape.nodes {
        let mut e = egress_node(n);
        e["status"]["peers"] = json!([{"name": node_name((n + 1) % shape.nodes), "alive": true}]);
        fake.apply(EGRESS_NODES, e);
    }
    // Every event written before it is counted (the watches' tasks write them).
    let want_full = changes;
    let settle = Instant::now();
    while settle.elapsed() < Duration::from_secs(300) {
        let full = matches!(scope, PodScope::Cluster);
        if (!full || fake.sent(PODS).watch_events >= want_full)
            && fake.sent(EGRESS_NODES).watch_events >= shape.nodes
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let received = Received {
        agent,
        first_view,
        pods_in_view,
        scope,
        compile_took,
        owners: compiled.desired.v4.pod_owner.len(),
        entries: compiled.desired.v4.policy.len(),
        desired: compiled.desired,
        pods_listed,
        others_listed,
        pods_watched: fake.sent(PODS),
        others_watched: others(fake),
    };
    drop(rx);
    // Its watches close once their tasks see the receiver gone; the next agent's are
    // counted alone.
    tokio::time::sleep(Duration::from_millis(200)).await;
    received
}

fn mb(bytes: usize) -> String {
    if bytes >= 100_000 {
        format!("{:.1} MB", bytes as f64 / 1e6)
    } else {
        format!("{:.1} kB", bytes as f64 / 1e3)
    }
}

fn report(shape: &Shape, changes: usize, rows: &[Received]) {
    println!(
        "\n{} nodes, {} pods ({} per node), {} gateways, {} policies; {} pod updates \
         (round robin over the nodes) and {} EgressNode updates after the first view\n",
        shape.nodes,
        shape.pods(),
        shape.pods_per_node,
        shape.gateways,
        shape.teams,
        changes,
        shape.nodes,
    );
    println!(
        "| agent | pods in its view | initial list: pods | initial list: other kinds | \
         watch: pod events | watch: other kinds | total | first view | its compile |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let total = r.pods_listed.bytes()
            + r.others_listed.bytes()
            + r.pods_watched.bytes()
            + r.others_watched.bytes();
        println!(
            "| {} | {} ({:?}) | {} objects, {} | {} objects, {} | {} events, {} | \
             {} events, {} | **{}** | {:.1} s | {:.0} ms ({} owners, {} entries) |",
            r.agent.label(shape),
            r.pods_in_view,
            r.scope,
            r.pods_listed.list_objects,
            mb(r.pods_listed.list_bytes),
            r.others_listed.list_objects,
            mb(r.others_listed.list_bytes),
            r.pods_watched.watch_events,
            mb(r.pods_watched.watch_bytes),
            r.others_watched.watch_events,
            mb(r.others_watched.watch_bytes),
            mb(total),
            r.first_view.as_secs_f64(),
            r.compile_took.as_secs_f64() * 1e3,
            r.owners,
            r.entries,
        );
    }
    let pod_bytes = rows[0].pods_listed.list_bytes / rows[0].pods_listed.list_objects.max(1);
    println!("\none pod: {pod_bytes} bytes of JSON");
}

async fn measure(shape: Shape, changes: usize) -> Vec<Received> {
    let t0 = Instant::now();
    let fake = cluster(&shape).await;
    println!(
        "built the fake cluster in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let mut rows = Vec::new();
    for agent in Agent::ALL {
        rows.push(run(&fake, &shape, agent, changes).await);
    }
    report(&shape, changes, &rows);
    rows
}

/// What each role must receive, whatever the scale: a worker its own pods in its list and
/// their changes only; every other agent every pod and every change; all the same other
/// kinds.
fn check(shape: &Shape, changes: usize, rows: &[Received]) {
    for r in rows {
        let worker = matches!(r.agent, Agent::Worker);
        let pods = if worker {
            shape.pods_per_node
        } else {
            shape.pods()
        };
        assert_eq!(r.pods_in_view, pods, "{:?}", r.agent);
        assert_eq!(r.pods_listed.list_objects, pods, "{:?}", r.agent);
        assert_eq!(r.pods_listed.lists, 1, "{:?}: one list", r.agent);
        let events = if worker {
            changes / shape.nodes
        } else {
            changes
        };
        assert_eq!(r.pods_watched.watch_events, events, "{:?}", r.agent);
        assert_eq!(
            r.others_listed.list_objects,
            rows[0].others_listed.list_objects
        );
        assert_eq!(r.others_watched.watch_events, shape.nodes, "{:?}", r.agent);
        let scope = if worker {
            PodScope::Node
        } else {
            PodScope::Cluster
        };
        assert_eq!(r.scope, scope, "{:?}", r.agent);
    }
    // The worker's maps from its own pods are those it compiled from every pod before.
    let (before, worker) = (&rows[0], &rows[1]);
    assert_eq!(before.agent.node(shape), worker.agent.node(shape));
    assert!(worker.desired == before.desired, "the worker's maps differ");
    assert_eq!(worker.owners, shape.pods_per_node);
    assert!(worker.entries > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_receives_the_pods_it_needs() {
    let shape = Shape {
        nodes: 10,
        pods_per_node: 20,
        gateways: 2,
        teams: 3,
    };
    let rows = measure(shape, 50).await;
    check(&shape, 50, &rows);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "100k pods: a minute or more in a debug build; run with --ignored --nocapture"]
async fn fan_out_at_100_nodes_and_100k_pods() {
    let shape = Shape {
        nodes: 100,
        pods_per_node: 1_000,
        gateways: 4,
        teams: 10,
    };
    let changes = 10_000;
    let rows = measure(shape, changes).await;
    check(&shape, changes, &rows);
}
