//! `deploy/` is a kustomize base that `kubectl kustomize` renders into what a cluster needs
//! and nothing else: the CRDs, RBAC, the DaemonSet and a headless metrics Service, with the
//! image named once (`images:` in kustomization.yaml) and the metrics endpoint bound where
//! the Service and the kubelet's probes reach it. Needs `kubectl` (`cargo xtask bootstrap`)
//! and the debug `egress-agent` (`cargo xtask test` builds it) to check the flags.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;

fn workspace() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn render() -> Vec<Value> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(workspace().join("deploy"))
        .output()
        .expect("failed to run kubectl (cargo xtask bootstrap installs it)");
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn one<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<_> = objects.iter().filter(|o| o["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind}");
    found[0]
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

#[test]
fn the_base_renders_crds_rbac_daemonset_and_metrics_service() {
    let objects = render();
    let mut kinds: Vec<String> = objects
        .iter()
        .map(|o| {
            format!(
                "{}/{}",
                o["kind"].as_str().unwrap(),
                o["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "ClusterRole/egress-agent",
            "ClusterRoleBinding/egress-agent",
            "CustomResourceDefinition/egressgatewaypolicies.egress.dev",
            "CustomResourceDefinition/egressnodes.egress.dev",
            "DaemonSet/egress-agent",
            "Namespace/egress-system",
            "Service/egress-agent-metrics",
            "ServiceAccount/egress-agent",
        ]
    );

    // The image: the kustomization's reference, which is what `cargo xtask image` builds.
    let ds = one(&objects, "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    let images: Vec<&str> = pod["containers"]
        .as_array()
        .unwrap()
        .iter()
        .chain(pod["initContainers"].as_array().into_iter().flatten())
        .map(|c| c["image"].as_str().unwrap())
        .collect();
    // The agent and the init container that installs the CNI plugin: the same image.
    let reference = format!("localhost/egress-agent:{}", env!("CARGO_PKG_VERSION"));
    assert_eq!(images, [reference.clone(), reference]);
    let init = &pod["initContainers"][0];
    assert_eq!(
        strings(&init["args"]),
        ["install-cni", "--dir=/host/opt/cni/bin"]
    );

    // The ServiceAccount the DaemonSet runs as is the one bound to the ClusterRole.
    let sa = one(&objects, "ServiceAccount");
    let binding = one(&objects, "ClusterRoleBinding");
    assert_eq!(pod["serviceAccountName"], sa["metadata"]["name"]);
    assert_eq!(binding["subjects"][0]["name"], sa["metadata"]["name"]);
    assert_eq!(
        binding["subjects"][0]["namespace"],
        ds["metadata"]["namespace"]
    );
    assert_eq!(
        binding["roleRef"]["name"],
        one(&objects, "ClusterRole")["metadata"]["name"]
    );

    // Gateways by label only: every node runs the same agent, no node selection and no
    // per-node configuration (no ConfigMap, no file but bpffs and the lock directory).
    assert!(
        pod["nodeSelector"].is_null() && pod["affinity"].is_null(),
        "{pod:#}"
    );
    assert_eq!(
        pod["tolerations"],
        serde_json::json!([{"operator": "Exists"}])
    );
    let volumes: Vec<&str> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            v["hostPath"]["path"]
                .as_str()
                .expect("hostPath volumes only")
        })
        .collect();
    assert_eq!(
        volumes,
        ["/sys/fs/bpf", "/run/egress-agent", "/opt/cni/bin"]
    );

    // Metrics on the node's address (status.hostIP): what the Service and probes reach.
    let agent = &pod["containers"][0];
    let args = strings(&agent["args"]);
    assert!(
        args.contains(&"--metrics-addr=$(HOST_IP):9465"),
        "metrics address in {args:?}"
    );
    let env: BTreeMap<&str, &Value> = agent["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap(), e))
        .collect();
    assert_eq!(
        env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"],
        "status.hostIP"
    );
    assert_eq!(
        env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"],
        "spec.nodeName"
    );
    let metrics_port = agent["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "metrics")
        .expect("a metrics port")["containerPort"]
        .clone();
    assert_eq!(metrics_port, 9465);
    for probe in ["livenessProbe", "readinessProbe"] {
        let get = &agent[probe]["httpGet"];
        assert!(
            get["host"].is_null(),
            "{probe} must probe the node's address: {get}"
        );
        assert_eq!(get["port"], "metrics", "{probe}");
    }

    // A headless Service over the agents' metrics port, annotated for Prometheus.
    let svc = one(&objects, "Service");
    assert_eq!(svc["spec"]["clusterIP"], "None");
    assert_eq!(
        svc["spec"]["selector"],
        ds["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(svc["spec"]["ports"][0]["port"], metrics_port);
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "metrics");
    let annotations = &svc["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], metrics_port.to_string());
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
}

/// RBAC: read and watch what the compiler reads, write only the agent's own objects, no
/// `update`, `delete` or wildcard.
#[test]
fn the_cluster_role_grants_what_the_agent_uses() {
    let objects = render();
    let role = one(&objects, "ClusterRole");
    let mut grants: Vec<String> = Vec::new();
    for rule in role["rules"].as_array().unwrap() {
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                let mut verbs = strings(&rule["verbs"]);
                verbs.sort_unstable();
                let group = if group.is_empty() { "core" } else { group };
                grants.push(format!("{group}/{resource}: {}", verbs.join(" ")));
            }
        }
    }
    grants.sort();
    assert_eq!(
        grants,
        [
            "core/events: create",
            "core/namespaces: list watch",
            "core/nodes: list watch",
            "core/pods: list watch",
            "egress.dev/egressgatewaypolicies/status: get patch",
            "egress.dev/egressgatewaypolicies: get list watch",
            "egress.dev/egressnodes/status: patch",
            "egress.dev/egressnodes: create list patch watch",
            "k8s.ovn.org/egressfirewalls: list watch",
            "k8s.ovn.org/egressips: list watch",
            "networking.k8s.io/networkpolicies: list watch",
            "policy.networking.k8s.io/adminnetworkpolicies: list watch",
            "policy.networking.k8s.io/baselineadminnetworkpolicies: list watch",
        ]
    );
}

/// Every flag and variable the DaemonSet gives the agent is one `egress-agent run` knows
/// (clap would refuse an unknown flag; an unknown variable would be silently ignored).
#[test]
fn the_daemonset_speaks_the_agents_flags() {
    let objects = render();
    let agent = &one(&objects, "DaemonSet")["spec"]["template"]["spec"]["containers"][0];
    let help = Command::new(agent_bin())
        .args(["run", "--help"])
        .output()
        .expect("egress-agent run --help");
    let help = String::from_utf8_lossy(&help.stdout);
    let args = strings(&agent["args"]);
    assert_eq!(args.first(), Some(&"run"));
    let is_flag = |flag: &str| {
        help.lines().any(|l| {
            l.trim_start()
                .strip_prefix(flag)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '<']))
        })
    };
    for arg in &args[1..] {
        let flag = arg.split('=').next().unwrap();
        assert!(
            is_flag(flag),
            "{flag} is no flag of `egress-agent run`:\n{help}"
        );
    }
    for e in agent["env"].as_array().unwrap() {
        let name = e["name"].as_str().unwrap();
        if name != "HOST_IP" {
            assert!(
                help.contains(&format!("[env: {name}=")),
                "{name} is no variable of `egress-agent run`"
            );
        }
    }
}

/// `egress-agent` next to the test binary's directory (`<target>/<profile>/egress-agent`),
/// or `$EGRESS_AGENT_BIN`.
fn agent_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("EGRESS_AGENT_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap();
    let bin = exe.ancestors().nth(2).unwrap().join("egress-agent");
    assert!(
        bin.is_file(),
        "{} is missing: build it (cargo build -p egress-agent) or set EGRESS_AGENT_BIN",
        bin.display()
    );
    bin
}
