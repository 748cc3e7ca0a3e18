//! `explain` and `kubectl egress` against a fake API server, through a kubeconfig that
//! points at it: what the user reads.

use std::{path::Path, process::Output};

use egress_agent::explain::cli::{ExplainArgs, run};
use serde_json::{Value, json};
use support::*;
use tokio::time::timeout;

mod support;

fn namespace(name: &str) -> Value {
    json!({"metadata": {"name": name, "labels": {"team": "payments"}}})
}

fn pod(name: &str, app: &str, node: &str, ip: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "shop", "labels": {"app": app}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
    })
}

fn node(name: &str, ip: &str, gateway: bool) -> Value {
    let labels = if gateway {
        json!({"egress.dev/gateway": "true"})
    } else {
        json!({})
    };
    json!({
        "metadata": {"name": name, "labels": labels},
        "status": {
            "addresses": [{"type": "InternalIP", "address": ip}],
            "conditions": [{"type": "Ready", "status": "True"}]
        }
    })
}

fn egress_node(name: &str, underlay: &str, address: &str, held: Option<&str>) -> Value {
    let held: Vec<Value> = held
        .into_iter()
        .map(|ip| json!({"ip": ip, "interface": "ens224", "epoch": 1, "reason": "Assigned"}))
        .collect();
    json!({
        "metadata": {"name": name},
        "spec": {"underlayIP": underlay},
        "status": {"interfaces": [{"name": "ens224", "up": true, "addresses": [address]}],
                   "egressIPs": held, "agentVersion": "0.1.0"}
    })
}

/// One worker (pods api-1 and web-1 of shop), one gateway; policy payments sends app=api
/// to 192.0.2.0/24 as 198.51.100.10 (its status as the agents wrote it); a NetworkPolicy
/// lets app=api reach TCP 443 there only.
async fn cluster() -> Fake {
    let fake = Fake::start().await;
    fake.put_silently(NAMESPACES, namespace("shop"));
    fake.put_silently(PODS, pod("api-1", "api", "worker-1", "10.244.1.11"));
    fake.put_silently(PODS, pod("web-1", "web", "worker-1", "10.244.1.12"));
    fake.put_silently(NODES, node("worker-1", "10.0.0.1", false));
    fake.put_silently(NODES, node("gw-1", "10.0.0.11", true));
    fake.put_silently(
        EGRESS_NODES,
        egress_node(
            "gw-1",
            "10.0.0.11",
            "198.51.100.2/24",
            Some("198.51.100.10"),
        ),
    );
    fake.put_silently(
        POLICIES,
        json!({
            "metadata": {"name": "payments", "generation": 1},
            "spec": {
                "namespaceSelector": {"matchLabels": {"team": "payments"}},
                "podSelector": {"matchLabels": {"app": "api"}},
                "gatewaySelector": {"matchLabels": {"egress.dev/gateway": "true"}},
                "rules": [{"destinations": ["192.0.2.0/24"], "egressIP": "198.51.100.10"}]
            },
            "status": {
                "observedGeneration": 1,
                "conditions": [
                    {"type": "Accepted", "status": "True", "reason": "Accepted",
                     "message": "the policy is valid"},
                    {"type": "Ready", "status": "True", "reason": "Ready",
                     "message": "every rule (1) has a gateway"}
                ],
                "egressIPs": [{"ip": "198.51.100.10", "node": "gw-1", "interface": "ens224",
                               "reason": "Assigned", "pods": 1}]
            }
        }),
    );
    fake.put_silently(
        NETWORK_POLICIES,
        json!({
            "metadata": {"namespace": "shop", "name": "https-only"},
            "spec": {"podSelector": {"matchLabels": {"app": "api"}}, "policyTypes": ["Egress"],
                     "egress": [{"to": [{"ipBlock": {"cidr": "192.0.2.0/24"}}],
                                 "ports": [{"protocol": "TCP", "port": 443}]}]}
        }),
    );
    fake
}

fn args(kubeconfig: &Path, pod: &str, to: &str, pins: &Path) -> ExplainArgs {
    ExplainArgs {
        pod: pod.to_owned(),
        to: to.to_owned(),
        state_dir: None,
        kubeconfig: Some(kubeconfig.to_owned()),
        cluster_cidrs: Vec::new(),
        bpffs_dir: pins.to_owned(),
        timeout_secs: 10,
    }
}

async fn explain(kubeconfig: &Path, pod: &str, to: &str, pins: &Path) -> String {
    timeout(WAIT, run(&args(kubeconfig, pod, to, pins)))
        .await
        .expect("explained within the time limit")
        .expect("explains")
}

#[tokio::test]
async fn explain_reads_the_cluster_through_kubeconfig() {
    let fake = cluster().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = kubeconfig(&fake, dir.path());
    let pins = dir.path().join("no-pins");
    let text = explain(&config, "shop/api-1", "192.0.2.7:443", &pins).await;
    assert_eq!(
        text,
        format!(
            "pod:            shop/api-1 (10.244.1.11, on node worker-1)\n\
             destination:    192.0.2.7:443/tcp\n\
             verdict:        redirected: leaves gateway gw-1 by ens224 as 198.51.100.10\n\
             policy:         payments rules[0] (rule id {id})\n\
             matched:        192.0.2.0/24 (destination 192.0.2.0/24 of the rule; the longest \
             of the pod's 1 prefixes containing it)\n\
             gateway:        gw-1 (underlay 10.0.0.11), interface ens224; through the tunnel\n\
             egress IP:      198.51.100.10 (the rule's egressIP)\n\
             NetworkPolicy:  allowed: shop/https-only allow tcp/443 there\n\
             no gateway:     failurePolicy Drop: dropped and counted (DROP_NO_GATEWAY), never \
             sent with another address\n\
             counters:       not available: no agent's maps pinned under {} (run this on the \
             pod's node or its gateway, or pass --bpffs-dir)\n",
            pins.display(),
            id = egress_agent::compiler::rule_ids([("payments", 0)])[&("payments".to_owned(), 0)],
        )
    );

    let text = explain(&config, "shop/api-1", "192.0.2.7:53/udp", &pins).await;
    assert!(
        text.contains(
            "verdict:        dropped: its egress NetworkPolicies do not allow it \
             (DROP_NETWORK_POLICY)\n"
        ),
        "{text}"
    );
    let text = explain(&config, "shop/web-1", "192.0.2.7", &pins).await;
    assert!(
        text.contains(
            "why:            policy payments does not select the pod (spec.podSelector)\n"
        ),
        "{text}"
    );
}

#[tokio::test]
async fn explain_errors_name_what_to_fix() {
    let fake = cluster().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = kubeconfig(&fake, dir.path());
    let pins = dir.path().join("no-pins");
    let error = |pod: &str, to: &str| {
        let a = args(&config, pod, to, &pins);
        async move {
            timeout(WAIT, run(&a))
                .await
                .expect("answered within the time limit")
                .expect_err("an error")
                .to_string()
        }
    };
    assert_eq!(
        error("default/api-1", "192.0.2.7").await,
        "failed to find pod default/api-1: no such pod in the view (a pod of that name is in \
         namespace shop: did you mean --pod shop/...?)"
    );
    assert_eq!(
        error("api-1", "192.0.2.7").await,
        "failed to parse --pod \"api-1\": expected NAMESPACE/NAME, such as shop/api-1"
    );
    assert!(error("shop/api-1", "192.0.2.0/24").await.starts_with(
        "failed to parse --to \"192.0.2.0/24\": \"24\" after the slash is not a protocol"
    ));
}

/// Run the `kubectl-egress` binary with `args` and `$KUBECONFIG` at `config`.
async fn kubectl_egress(config: &Path, args: &[&str]) -> Output {
    run_bin(env!("CARGO_BIN_EXE_kubectl-egress"), config, args).await
}

#[tokio::test]
async fn the_kubectl_plugin_explains_and_shows_the_status() {
    let fake = cluster().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = kubeconfig(&fake, dir.path());
    let pins = dir.path().join("no-pins");
    let pins = pins.to_string_lossy();
    let out = kubectl_egress(
        &config,
        &[
            "explain",
            "--pod",
            "shop/api-1",
            "--to",
            "192.0.2.7:443",
            "--bpffs-dir",
            &pins,
        ],
    )
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(
            "verdict:        redirected: leaves gateway gw-1 by ens224 as 198.51.100.10\n"
        ),
        "{stdout}"
    );

    let out = kubectl_egress(&config, &["status"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout,
        "policy payments: Accepted=True Ready=True\n  \
         198.51.100.10 on gw-1 (ens224): 1 pod, Assigned\n\
         \nnodes (1):\n  \
         gw-1 (10.0.0.11): agent 0.1.0, peers 0/0 alive\n    \
         holds 198.51.100.10 on ens224 (epoch 1, Assigned)\n"
    );

    let out = kubectl_egress(
        &config,
        &["explain", "--pod", "shop/nope", "--to", "192.0.2.7"],
    )
    .await;
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "kubectl egress: failed to find pod shop/nope: no such pod in the view (check the \
         namespace and the name)\n"
    );
}

#[tokio::test]
async fn status_without_the_crds_says_to_install_them() {
    let fake = cluster().await;
    fake.unserve(POLICIES);
    let dir = tempfile::tempdir().expect("tempdir");
    let config = kubeconfig(&fake, dir.path());
    let out = kubectl_egress(&config, &["status"]).await;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("kubectl egress: failed to list egressgatewaypolicies: ")
            && stderr.contains("(is the CRD installed? `egress-agent crd | kubectl apply -f -`)"),
        "{stderr}"
    );
}
