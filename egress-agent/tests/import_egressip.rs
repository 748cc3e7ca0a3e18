//! `import-egressip --from-cluster` against a fake API server that serves OVN-Kubernetes'
//! `EgressIP` objects (`/apis/k8s.ovn.org/v1/egressips`): both binaries
//! (`egress-agent`, `kubectl-egress`) through a kubeconfig that points at it, and the
//! library's run for the causes a list fails by. What the user reads, and the exit code.

use std::{path::PathBuf, process::Output};

use egress_agent::import::{
    Options,
    cli::{ImportArgs, run},
    cluster::Error,
    documents, import,
};
use serde_json::{Value, json};
use support::*;
use tokio::time::timeout;

mod support;

/// An `EgressIP` of the namespaces labelled `team=<name>`, with `ips`, held (by OVN) on
/// worker-1.
fn egress_ip(name: &str, ips: &[&str]) -> Value {
    json!({
        "apiVersion": "k8s.ovn.org/v1",
        "kind": "EgressIP",
        "metadata": {"name": name},
        "spec": {"egressIPs": ips, "namespaceSelector": {"matchLabels": {"team": name}}},
        "status": {"items": [{"node": "worker-1", "egressIP": ips[0]}]}
    })
}

/// `shop` translates; `legacy`'s address is not one.
fn objects() -> [Value; 2] {
    [
        egress_ip("shop", &["192.0.2.10"]),
        egress_ip("legacy", &["192.0.2.300"]),
    ]
}

/// A cluster with [`objects`].
async fn cluster() -> Fake {
    let fake = Fake::start().await;
    for o in objects() {
        fake.put_silently(EGRESS_IPS, o);
    }
    fake
}

/// What the importer prints for [`objects`] read from a file (whose translation
/// `src/import/tests.rs` specifies): the API's objects must take the same path.
fn from_a_file() -> String {
    let file: Vec<String> = objects()
        .iter()
        .map(|o| serde_json::to_string(o).expect("JSON"))
        .collect();
    let (docs, refused) = documents(&file.join("\n---\n"), "objects.yaml");
    assert_eq!(refused, []);
    let (yaml, refused) = import(&docs, &Options::default());
    let refused: Vec<String> = refused.iter().map(ToString::to_string).collect();
    assert_eq!(refused, [LEGACY_REFUSED]);
    yaml
}

const LEGACY_REFUSED: &str =
    "EgressIP \"legacy\": spec.egressIPs[0]: \"192.0.2.300\" is not an IP address";

/// The output's documents after its header comment.
fn policies(stdout: &str) -> Vec<&str> {
    stdout.split("---\n").skip(1).collect()
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn both_binaries_translate_the_clusters_egressips_and_refuse_the_bad_one() {
    let fake = cluster().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = kubeconfig(&fake, dir.path());
    for (bin, says, last) in [
        (env!("CARGO_BIN_EXE_egress-agent"), "egress-agent", ""),
        (
            env!("CARGO_BIN_EXE_kubectl-egress"),
            "kubectl egress",
            "kubectl egress: 1 refusal(s) above: those objects were not translated\n",
        ),
    ] {
        let lists = fake.lists(EGRESS_IPS);
        let out = run_bin(bin, &config, &["import-egressip", "--from-cluster"]).await;
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{says}: {stdout}{stderr}");
        assert_eq!(stdout, from_a_file(), "{says}");
        let [shop] = policies(&stdout)[..] else {
            panic!("{says}: one policy: {stdout}");
        };
        assert!(
            shop.starts_with("# From OVN-Kubernetes EgressIP \"shop\".\n")
                && shop.contains("\n  name: shop\n")
                && shop.ends_with("\n    egressIP: 192.0.2.10\n"),
            "{says}: {shop}"
        );
        assert_eq!(
            stderr,
            format!("{says} import-egressip: {LEGACY_REFUSED}\n{last}"),
            "{says}"
        );
        // Read from the API, once.
        assert_eq!(fake.lists(EGRESS_IPS), lists + 1, "{says}");
    }
}

#[tokio::test]
async fn a_cluster_without_ovn_kubernetes_egressip_crd_is_named() {
    let fake = cluster().await;
    fake.unserve(EGRESS_IPS);
    let dir = tempfile::tempdir().expect("tempdir");
    let config = kubeconfig(&fake, dir.path());
    let out = run_bin(
        env!("CARGO_BIN_EXE_egress-agent"),
        &config,
        &["import-egressip", "--from-cluster"],
    )
    .await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert_eq!(stdout, "");
    assert_eq!(
        stderr,
        "egress-agent: failed to list egressips.k8s.ovn.org: OVN-Kubernetes' EgressIP CRD is \
         not served by this cluster (404 for k8s.ovn.org/v1 egressips): not an \
         OVN-Kubernetes cluster, or the kubeconfig's current context names another cluster\n"
    );
}

fn args(kubeconfig: PathBuf, names: &[&str]) -> ImportArgs {
    ImportArgs {
        files: Vec::new(),
        from_cluster: true,
        names: names.iter().map(|n| (*n).to_owned()).collect(),
        kubeconfig: Some(kubeconfig),
        timeout_secs: 10,
        gateway_selector: Vec::new(),
        failure_policy: egress_agent::api::FailurePolicy::Drop,
    }
}

#[tokio::test]
async fn names_pick_objects_and_a_name_the_cluster_lacks_is_refused() {
    let fake = cluster().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let a = args(kubeconfig(&fake, dir.path()), &["shop", "gone", "shop"]);
    let (yaml, refused) = timeout(WAIT, run(&a))
        .await
        .expect("within the time limit")
        .expect("listed");
    // `legacy` not picked, so not refused: the policy of `shop` alone.
    assert_eq!(yaml, from_a_file());
    assert_eq!(policies(&yaml).len(), 1, "{yaml}");
    let refused: Vec<String> = refused.iter().map(ToString::to_string).collect();
    assert_eq!(
        refused,
        [
            "EgressIP \"gone\": --name: the cluster has no EgressIP of that name \
          (egressips.k8s.ovn.org)"
        ]
    );
}

#[tokio::test]
async fn forbidden_and_unreachable_say_what_to_fix() {
    let fake = cluster().await;
    fake.forbid(EGRESS_IPS);
    let dir = tempfile::tempdir().expect("tempdir");
    let a = args(kubeconfig(&fake, dir.path()), &[]);
    let e = timeout(WAIT, run(&a))
        .await
        .expect("within the time limit")
        .expect_err("forbidden");
    assert!(matches!(e, Error::Forbidden { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "failed to list egressips.k8s.ovn.org: forbidden (403): RBAC must grant this user the \
         verb list on the resource egressips in the API group k8s.ovn.org, cluster-wide (a \
         ClusterRole and a ClusterRoleBinding); the API server said: egressips.k8s.ovn.org is \
         forbidden: User \"system:anonymous\" cannot list resource \"egressips\" in API group \
         \"k8s.ovn.org\" at the cluster scope"
    );

    // A port nobody listens on (bound, then let go).
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let a = args(kubeconfig_at(closed, dir.path()), &[]);
    let e = timeout(WAIT, run(&a))
        .await
        .expect("within the time limit")
        .expect_err("unreachable");
    assert!(matches!(e, Error::Unreachable { .. }), "{e:?}");
    let said = egress_agent::report::chain(&e);
    assert!(
        said.starts_with(
            "failed to list egressips.k8s.ovn.org: the API server is unreachable (the \
             kubeconfig's current context, or the in-cluster service account): "
        ) && said.contains("Connection refused"),
        "{said}"
    );
}
