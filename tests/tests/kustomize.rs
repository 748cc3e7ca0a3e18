//! `deploy/` (its base, `deploy/base/`) is a kustomize base that `kubectl kustomize` renders into what a cluster needs
//! and nothing else: the CRDs, RBAC, the DaemonSet and a headless metrics Service, with the
//! image named once (`images:` in deploy/image/kustomization.yaml) and the metrics endpoint bound where
//! the Service and the kubelet's probes reach it. `deploy/openshift/` renders the same
//! objects for OpenShift, with an SCC that allows exactly what the DaemonSet asks for.
//! `deploy/uninstall/` (and its OpenShift overlay) runs `egress-agent cleanup` on every
//! node with the agent's flags and host paths.
//! Needs `kubectl` (`cargo xtask bootstrap`) and the debug `egress-agent` (`cargo xtask
//! test` builds it) to check the flags.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;

fn workspace() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The base, as `kubectl apply -k deploy/` renders it.
fn render() -> Vec<Value> {
    render_dir("deploy", &[])
}

/// The OpenShift overlay (over `deploy/base`), as `oc apply -k deploy/openshift` renders it.
fn render_openshift() -> Vec<Value> {
    render_dir("deploy/openshift", &[])
}

/// `kubectl kustomize <dir> <flags>`, `dir` relative to the workspace: the objects.
fn render_dir(dir: &str, flags: &[&str]) -> Vec<Value> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(workspace().join(dir))
        .args(flags)
        .output()
        .expect("failed to run kubectl (cargo xtask bootstrap installs it)");
    assert!(
        out.status.success(),
        "kubectl kustomize {dir}/: {}",
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

/// The object of `kind` named `name`.
fn named<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// `Kind/name` of every object.
fn kinds_and_names(objects: &[Value]) -> BTreeSet<String> {
    objects
        .iter()
        .map(|o| {
            format!(
                "{}/{}",
                o["kind"].as_str().unwrap(),
                o["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect()
}

/// A container's environment, by name.
fn env_of(container: &Value) -> BTreeMap<&str, &Value> {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap(), e))
        .collect()
}

/// What a ClusterRole grants, one `group/resource: verbs` line each (`core` for "").
fn grants(role: &Value) -> Vec<String> {
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
    grants
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
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    assert_eq!(
        volumes,
        ["/sys/fs/bpf", "/run/egress-agent", "/opt/cni/bin"]
    );
    // Besides the host paths, only the liveness key's Secret, read-only, where
    // EGRESS_LIVENESS_KEY_FILE points.
    let others: Vec<&serde_json::Value> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["hostPath"].is_null())
        .collect();
    assert_eq!(others.len(), 1, "{others:#?}");
    assert_eq!(others[0]["secret"]["secretName"], "egress-liveness-key");
    let key_env = pod["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "EGRESS_LIVENESS_KEY_FILE")
        .expect("the DaemonSet sets the liveness key file");
    let key_dir = pod["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == others[0]["name"])
        .expect("the key is mounted");
    assert_eq!(key_dir["readOnly"], true);
    assert!(
        key_env["value"]
            .as_str()
            .unwrap()
            .starts_with(key_dir["mountPath"].as_str().unwrap()),
        "{key_env} under {key_dir}"
    );

    // Metrics on the node's address (status.hostIP): what the Service and probes reach.
    let agent = &pod["containers"][0];
    let args = strings(&agent["args"]);
    assert!(
        args.contains(&"--metrics-addr=$(HOST_IP):9465"),
        "metrics address in {args:?}"
    );
    let env = env_of(agent);
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

/// The liveness key's Secret is required, in the base and the OpenShift overlay alike: a
/// missing Secret keeps the pods in ContainerCreating with an event naming it, where an
/// optional volume would start agents that find no key file and crash-loop. The file
/// `EGRESS_LIVENESS_KEY_FILE` names is the Secret's entry that the install steps create.
#[test]
fn the_liveness_secret_is_required_where_the_agent_reads_its_key() {
    for (dir, objects) in [
        ("deploy", render()),
        ("deploy/openshift", render_openshift()),
    ] {
        let pod = &one(&objects, "DaemonSet")["spec"]["template"]["spec"];
        let volume = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["secret"]["secretName"] == "egress-liveness-key")
            .unwrap_or_else(|| panic!("{dir}: no volume of the Secret egress-liveness-key"));
        assert!(
            matches!(
                volume["secret"]["optional"],
                Value::Null | Value::Bool(false)
            ),
            "{dir}: the liveness key's Secret is optional: {volume:#}"
        );
        let agent = &pod["containers"][0];
        let mount = agent["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == volume["name"])
            .unwrap_or_else(|| panic!("{dir}: the Secret is not mounted in the agent"));
        let file = env_of(agent)["EGRESS_LIVENESS_KEY_FILE"]["value"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(
            Path::new(&file).parent().unwrap(),
            Path::new(mount["mountPath"].as_str().unwrap()),
            "{dir}"
        );
        assert_eq!(Path::new(&file).file_name().unwrap(), LIVENESS_KEY_ENTRY);
    }
}

/// The Secret's entry that holds the key: the install steps' `--from-literal=key=...`.
const LIVENESS_KEY_ENTRY: &str = "key";

/// The text of `file`'s section under `heading` (a whole heading line, such as `##
/// Install`), to the next heading of its level or above.
fn section(file: &str, heading: &str) -> String {
    let text = std::fs::read_to_string(workspace().join(file)).unwrap();
    let level = heading.split(' ').next().unwrap();
    let mut lines = text.lines().skip_while(|l| *l != heading);
    assert!(lines.next().is_some(), "{file}: no section {heading:?}");
    let mut fenced = false;
    lines
        .take_while(|l| {
            if l.starts_with("```") {
                fenced = !fenced;
            }
            fenced
                || !l.starts_with('#')
                || l.split(' ').next().is_some_and(|h| h.len() > level.len())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every install path creates the liveness Secret (after its namespace, before the
/// DaemonSet), with the entry the DaemonSet reads: README's "Deploying",
/// docs/openshift.md's "Install" and docs/operations.md's "Liveness keys".
#[test]
fn every_install_path_creates_the_liveness_secret_first() {
    let create = format!(
        "create secret generic egress-liveness-key \\\n  --from-literal={LIVENESS_KEY_ENTRY}=$(openssl rand -hex 32)"
    );
    for (file, heading, namespace, apply) in [
        (
            "README.md",
            "## Deploying",
            "kubectl apply -f deploy/base/namespace.yaml",
            Some("kubectl apply -k deploy/"),
        ),
        (
            "docs/openshift.md",
            "## Install",
            "oc apply -f deploy/openshift/namespace.yaml",
            Some("oc apply -k deploy/openshift"),
        ),
        (
            "docs/operations.md",
            "## Liveness keys",
            "kubectl apply -f deploy/base/namespace.yaml",
            None,
        ),
    ] {
        let text = section(file, heading);
        let at = |what: &str| {
            text.find(what)
                .unwrap_or_else(|| panic!("{file}, {heading:?}: no `{what}`"))
        };
        let secret = at(&create);
        assert!(
            at(namespace) < secret,
            "{file}: the namespace after the Secret"
        );
        if let Some(apply) = apply {
            assert!(secret < at(apply), "{file}: `{apply}` before the Secret");
        }
    }
}

/// RBAC: read and watch what the compiler reads, write only the agent's own objects, no
/// `update`, `delete` or wildcard.
#[test]
fn the_cluster_role_grants_what_the_agent_uses() {
    let objects = render();
    assert_eq!(
        grants(one(&objects, "ClusterRole")),
        [
            "config.openshift.io/networks: list watch",
            "core/namespaces: list watch",
            "core/nodes: list watch",
            "core/pods: list watch",
            "egress.dev/egressgatewaypolicies/status: get patch",
            "egress.dev/egressgatewaypolicies: get list watch",
            "egress.dev/egressnodes/status: patch",
            "egress.dev/egressnodes: create list patch watch",
            "events.k8s.io/events: create",
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
    assert_speaks_the_agents_flags(agent);
}

/// Every flag in the container's args and every variable in its env (but HOST_IP, which
/// only the args use) is one of `egress-agent run`.
fn assert_speaks_the_agents_flags(agent: &Value) {
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

/// `deploy/openshift/`: the base's objects for OpenShift with OVN-Kubernetes. The SCC
/// allows what the DaemonSet asks for and no more (its capabilities, hostPath volumes, the
/// host network, root, SELinux type spc_t, which every container asks for exactly, as
/// `MustRunAs` compares the whole label), the agent's ServiceAccount may use it, the
/// agent reaches Open vSwitch's socket, pod security admission lets the pods into their
/// namespace, and the agent may read the cluster's Network object.
#[test]
fn the_openshift_overlay_allows_what_the_daemonset_uses() {
    let objects = render_openshift();
    let base = kinds_and_names(&render());
    let rendered = kinds_and_names(&objects);
    assert!(
        base.is_subset(&rendered),
        "base objects missing from deploy/openshift: {:?}",
        base.difference(&rendered).collect::<Vec<_>>()
    );
    assert_eq!(
        rendered.difference(&base).collect::<Vec<_>>(),
        [
            "ClusterRole/egress-agent-scc",
            "ClusterRoleBinding/egress-agent-scc",
            "SecurityContextConstraints/egress-agent",
        ]
    );

    let ds = one(&objects, "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    let agent = &pod["containers"][0];
    let scc = one(&objects, "SecurityContextConstraints");
    assert_eq!(scc["apiVersion"], "security.openshift.io/v1");

    // Exactly the capabilities the agent's container adds; no privileged container.
    assert_eq!(
        strings(&scc["allowedCapabilities"]),
        strings(&agent["securityContext"]["capabilities"]["add"])
    );
    assert!(strings(&scc["requiredDropCapabilities"]).is_empty());
    assert!(strings(&scc["defaultAddCapabilities"]).is_empty());
    assert_eq!(scc["allowPrivilegedContainer"], false);
    assert_eq!(scc["allowHostNetwork"], pod["hostNetwork"]);
    assert_eq!(scc["allowHostPID"], false);
    assert_eq!(scc["allowHostIPC"], false);
    // Root (the image names no user).
    assert_eq!(scc["runAsUser"]["type"], "RunAsAny");

    // spc_t: the SCC's label, and every container's, init containers included.
    assert_eq!(scc["seLinuxContext"]["type"], "MustRunAs");
    let label = &scc["seLinuxContext"]["seLinuxOptions"];
    assert_eq!(label["type"], "spc_t");
    let containers = pod["containers"].as_array().unwrap().iter();
    for c in containers.chain(pod["initContainers"].as_array().into_iter().flatten()) {
        let sc = &c["securityContext"];
        assert_eq!(sc["seLinuxOptions"], *label, "container {}", c["name"]);
        assert_ne!(sc["privileged"], true, "container {}", c["name"]);
        for cap in strings(&sc["capabilities"]["add"]) {
            assert!(
                strings(&scc["allowedCapabilities"]).contains(&cap),
                "container {} adds {cap}, which the SCC does not allow",
                c["name"]
            );
        }
    }

    // hostPath volumes (the SCC allows them), Open vSwitch's directory among them, and the key.
    assert_eq!(scc["allowHostDirVolumePlugin"], true);
    assert!(strings(&scc["volumes"]).contains(&"hostPath"), "{scc:#}");
    for v in pod["volumes"].as_array().unwrap() {
        let kind = if v["hostPath"].is_null() {
            "secret"
        } else {
            "hostPath"
        };
        assert!(!v[kind].is_null(), "hostPath or secret volumes only: {v:#}");
        assert!(strings(&scc["volumes"]).contains(&kind), "{scc:#}");
    }
    let mut host_paths: Vec<&str> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    host_paths.sort_unstable();
    assert_eq!(
        host_paths,
        [
            "/opt/cni/bin",
            "/run/egress-agent",
            "/sys/fs/bpf",
            "/var/run/openvswitch"
        ]
    );

    // The agent reads OVSDB through that directory, mounted read-only, and finds pod
    // devices without host routes; the cluster CIDRs come from the Network object.
    let ovs = agent["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "ovsdb")
        .expect("the ovsdb mount");
    assert_eq!(ovs["mountPath"], "/var/run/openvswitch");
    assert_eq!(ovs["readOnly"], true);
    let env = env_of(agent);
    assert_eq!(env["EGRESS_POD_DEVICES"]["value"], "auto");
    assert_eq!(env["EGRESS_OVSDB"]["value"], "/var/run/openvswitch/db.sock");
    assert!(!env.contains_key("EGRESS_CLUSTER_CIDRS"), "{env:?}");
    assert_speaks_the_agents_flags(agent);

    // /metrics over HTTPS with the service CA's certificate for the metrics Service: the
    // Service asks for the Secret the DaemonSet mounts, the flags name files in that
    // mount, and the kubelet's probes speak HTTPS.
    let service = named(&objects, "Service", "egress-agent-metrics");
    let secret =
        service["metadata"]["annotations"]["service.beta.openshift.io/serving-cert-secret-name"]
            .as_str()
            .expect("a serving certificate for the metrics Service");
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["secret"]["secretName"] == secret)
        .expect("the serving certificate's volume");
    let mount = agent["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == volume["name"])
        .expect("its mount");
    let dir = mount["mountPath"].as_str().unwrap();
    assert_eq!(
        env["EGRESS_METRICS_TLS_CERT_FILE"]["value"],
        format!("{dir}/tls.crt")
    );
    assert_eq!(
        env["EGRESS_METRICS_TLS_KEY_FILE"]["value"],
        format!("{dir}/tls.key")
    );
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(agent[probe]["httpGet"]["scheme"], "HTTPS", "{probe}");
        assert_eq!(agent[probe]["httpGet"]["port"], "metrics", "{probe}");
    }

    // Pod security admission: only `privileged` admits these pods, and OpenShift's label
    // synchronizer leaves the labels as written.
    let labels = &one(&objects, "Namespace")["metadata"]["labels"];
    for mode in ["enforce", "audit", "warn"] {
        assert_eq!(
            labels[format!("pod-security.kubernetes.io/{mode}")],
            "privileged",
            "{labels:#}"
        );
    }
    assert_eq!(
        labels["security.openshift.io/scc.podSecurityLabelSync"],
        "false"
    );

    // `use` of this SCC, and nothing else, for the DaemonSet's ServiceAccount.
    let scc_name = scc["metadata"]["name"].as_str().unwrap();
    let role = named(&objects, "ClusterRole", "egress-agent-scc");
    assert_eq!(
        role["rules"],
        serde_json::json!([{
            "apiGroups": ["security.openshift.io"],
            "resources": ["securitycontextconstraints"],
            "resourceNames": [scc_name],
            "verbs": ["use"],
        }])
    );
    let binding = named(&objects, "ClusterRoleBinding", "egress-agent-scc");
    assert_eq!(binding["roleRef"]["kind"], "ClusterRole");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    assert_eq!(binding["subjects"][0]["kind"], "ServiceAccount");
    assert_eq!(binding["subjects"][0]["name"], pod["serviceAccountName"]);
    assert_eq!(
        binding["subjects"][0]["namespace"],
        ds["metadata"]["namespace"]
    );

    // The cluster and service networks: OpenShift's Network object, read as the agent
    // watches it (list, then watch).
    let agent_role = grants(named(&objects, "ClusterRole", "egress-agent"));
    assert!(
        agent_role
            .iter()
            .any(|g| g == "config.openshift.io/networks: list watch"),
        "{agent_role:#?}"
    );
}

/// The value of `--flag` in `args` (`--flag=value` or `--flag value`).
fn flag<'a>(args: &[&'a str], flag: &str) -> Option<&'a str> {
    let eq = format!("{flag}=");
    args.iter().enumerate().find_map(|(i, a)| {
        a.strip_prefix(eq.as_str())
            .or_else(|| (*a == flag).then(|| args.get(i + 1).copied()).flatten())
    })
}

/// The default of `--flag` as `egress-agent <subcommand> --help` states it.
fn default_of(subcommand: &str, flag: &str) -> Option<String> {
    let help = Command::new(agent_bin())
        .args([subcommand, "--help"])
        .output()
        .expect("egress-agent --help");
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let mut lines = help
        .lines()
        .skip_while(|l| !l.trim_start().starts_with(&format!("{flag} ")));
    lines.next()?;
    lines
        .take_while(|l| !l.trim_start().starts_with('-'))
        .find_map(|l| l.trim().strip_prefix("[default: ")?.strip_suffix(']'))
        .map(str::to_owned)
}

/// The container (or init container) `name` of the pod template `pod`.
fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    pod["containers"]
        .as_array()
        .into_iter()
        .chain(pod["initContainers"].as_array())
        .flatten()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// `host path -> mountPath` of each hostPath volume `c` mounts in pod template `pod`.
fn host_mounts(pod: &Value, c: &Value) -> BTreeMap<String, String> {
    c["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let volume = pod["volumes"]
                .as_array()?
                .iter()
                .find(|v| v["name"] == m["name"])?;
            Some((
                volume["hostPath"]["path"].as_str()?.to_owned(),
                m["mountPath"].as_str()?.to_owned(),
            ))
        })
        .collect()
}

/// `deploy/uninstall` (and `deploy/openshift/uninstall`): one DaemonSet in the agent's
/// namespace, on every node the agent runs on (its tolerations, the host network), whose
/// init container runs `egress-agent cleanup` from the agent's image with the agent's pin
/// directory and tunnel device (flags resolved with their defaults), the host's bpffs and
/// lock directory where the agent mounts them (the lock is how cleanup knows no agent
/// runs), and the CNI bin directory where install-cni wrote the plugin; with BPF and
/// NET_ADMIN only; then a container with nothing (no capability, no mount) that pauses.
/// On OpenShift the agent's SCC admits it: its ServiceAccount, capabilities within the
/// SCC's, spc_t on each container.
#[test]
fn the_uninstall_runs_cleanup_with_the_agents_paths_on_every_node() {
    for (dir, agent_dir) in [
        ("deploy/uninstall", "deploy"),
        ("deploy/openshift/uninstall", "deploy/openshift"),
    ] {
        let objects = render_dir(dir, &[]);
        assert_eq!(
            kinds_and_names(&objects).into_iter().collect::<Vec<_>>(),
            ["DaemonSet/egress-uninstall"],
            "{dir}"
        );
        let installed = render_dir(agent_dir, &[]);
        let agent_ds = named(&installed, "DaemonSet", "egress-agent");
        let agent_pod = &agent_ds["spec"]["template"]["spec"];
        let agent = container(agent_pod, "agent");
        let ds = one(&objects, "DaemonSet");
        let pod = &ds["spec"]["template"]["spec"];
        assert_eq!(
            ds["metadata"]["namespace"],
            agent_ds["metadata"]["namespace"]
        );
        assert_eq!(pod["serviceAccountName"], agent_pod["serviceAccountName"]);
        assert_eq!(pod["automountServiceAccountToken"], false, "{dir}");
        assert_eq!(pod["hostNetwork"], true, "{dir}");
        assert_eq!(pod["tolerations"], agent_pod["tolerations"], "{dir}");
        assert!(pod["nodeSelector"].is_null() && pod["affinity"].is_null());

        let cleanup = container(pod, "cleanup");
        assert!(
            pod["initContainers"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["name"] == "cleanup"),
            "{dir}: cleanup runs as an init container (the pod is Ready once it succeeded)"
        );
        let args = strings(&cleanup["args"]);
        assert_eq!(args.first(), Some(&"cleanup"), "{dir}");
        let agent_args = strings(&agent["args"]);
        for f in ["--bpffs-dir", "--tunnel-device"] {
            let resolve = |sub: &str, args: &[&str]| {
                flag(args, f)
                    .map(str::to_owned)
                    .or_else(|| default_of(sub, f))
            };
            let theirs = resolve("run", &agent_args);
            assert!(theirs.is_some(), "{f} of run");
            assert_eq!(resolve("cleanup", &args), theirs, "{dir}: {f}");
        }
        let help = Command::new(agent_bin())
            .args(["cleanup", "--help"])
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&help.stdout);
        for a in &args[1..] {
            let f = a.split('=').next().unwrap();
            assert!(
                help.lines()
                    .any(|l| l.trim_start().starts_with(&format!("{f} "))),
                "{dir}: {f} is no flag of `egress-agent cleanup`"
            );
        }

        // The host paths: the agent's, at the agent's places; the CNI bin directory where
        // install-cni wrote the plugin.
        let mounts = host_mounts(pod, cleanup);
        assert_eq!(
            mounts.keys().collect::<Vec<_>>(),
            ["/opt/cni/bin", "/run/egress-agent", "/sys/fs/bpf"],
            "{dir}"
        );
        let agent_mounts = host_mounts(agent_pod, agent);
        for host in ["/sys/fs/bpf", "/run/egress-agent"] {
            assert_eq!(mounts[host], agent_mounts[host], "{dir}: {host}");
        }
        let install = container(agent_pod, "install-cni");
        let cni_dir = flag(&strings(&install["args"]), "--dir").unwrap();
        assert_eq!(host_mounts(agent_pod, install)["/opt/cni/bin"], cni_dir);
        assert_eq!(mounts["/opt/cni/bin"], cni_dir, "{dir}");
        assert_eq!(flag(&args, "--cni-bin-dir"), Some(cni_dir), "{dir}");

        // Capabilities: what cleanup uses, within the agent's.
        let sc = &cleanup["securityContext"];
        assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"], "{dir}");
        assert_eq!(
            strings(&sc["capabilities"]["add"]),
            ["BPF", "NET_ADMIN"],
            "{dir}"
        );
        let agent_caps = strings(&agent["securityContext"]["capabilities"]["add"]);
        for c in strings(&sc["capabilities"]["add"]) {
            assert!(agent_caps.contains(&c), "{dir}: {c} is not the agent's");
        }

        // The container that stays: the same image, nothing granted, nothing mounted.
        let done = container(pod, "done");
        assert_eq!(strings(&done["args"]), ["pause"], "{dir}");
        assert!(done["volumeMounts"].is_null(), "{dir}");
        assert_eq!(
            strings(&done["securityContext"]["capabilities"]["drop"]),
            ["ALL"]
        );
        assert!(done["securityContext"]["capabilities"]["add"].is_null());
        for c in [cleanup, done] {
            assert_eq!(c["image"], agent["image"], "{dir}: {}", c["name"]);
            assert_ne!(c["securityContext"]["privileged"], true, "{dir}");
            // The agent's SELinux label (spc_t on OpenShift, none in the base).
            assert_eq!(
                c["securityContext"]["seLinuxOptions"], agent["securityContext"]["seLinuxOptions"],
                "{dir}: {}",
                c["name"]
            );
        }
        if dir.contains("openshift") {
            let scc = one(&installed, "SecurityContextConstraints");
            for c in strings(&sc["capabilities"]["add"]) {
                assert!(strings(&scc["allowedCapabilities"]).contains(&c), "{c}");
            }
        }
    }
}

/// The body rows of the tables in `text` (header and separator rows left out), as cells.
fn table_rows(text: &str) -> Vec<Vec<String>> {
    let lines: Vec<&str> = text.lines().collect();
    lines
        .iter()
        .enumerate()
        .filter(|(i, l)| {
            l.starts_with('|')
                && !l.starts_with("|---")
                && !lines.get(i + 1).is_some_and(|n| n.starts_with("|---"))
        })
        .map(|(_, l)| {
            l.trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_owned())
                .collect()
        })
        .collect()
}

/// The `quoted` words of a table cell.
fn quoted(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

/// docs/operations.md says, per capability and per host path, what uses it: its tables
/// name exactly the capabilities the agent's container adds (and SYS_ADMIN as not
/// granted), every host path and Secret the DaemonSet mounts (base and OpenShift overlay)
/// at its mountPath, and, for the uninstall's containers, exactly their capabilities and
/// host paths.
#[test]
fn the_operations_tables_name_every_grant_and_host_path() {
    let grants = section(
        "docs/operations.md",
        "### What the DaemonSet grants, and what uses it",
    );
    let rows = table_rows(&grants);
    let mut named_caps: Vec<&str> = rows
        .iter()
        .filter(|r| r.len() == 2 && !r[0].contains("not granted"))
        .filter_map(|r| quoted(&r[0]).first().copied())
        .collect();
    named_caps.sort_unstable();
    let mut documented = BTreeMap::new();
    for r in rows.iter().filter(|r| r.len() == 3) {
        let what = if r[0].starts_with("Secret ") {
            format!("secret {}", quoted(&r[0])[0])
        } else {
            quoted(&r[0])[0].to_owned()
        };
        documented.insert(what, quoted(&r[1]).first().map(|m| (*m).to_owned()));
    }
    let mut mounted = BTreeMap::new();
    for dir in ["deploy", "deploy/openshift"] {
        let objects = render_dir(dir, &[]);
        let pod = &named(&objects, "DaemonSet", "egress-agent")["spec"]["template"]["spec"];
        let agent = container(pod, "agent");
        let mut caps = strings(&agent["securityContext"]["capabilities"]["add"]);
        caps.sort_unstable();
        assert_eq!(named_caps, caps, "{dir}: the capability table");
        for c in pod["containers"]
            .as_array()
            .into_iter()
            .chain(pod["initContainers"].as_array())
            .flatten()
        {
            for m in c["volumeMounts"].as_array().into_iter().flatten() {
                let v = pod["volumes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|v| v["name"] == m["name"])
                    .unwrap();
                let what = match v["hostPath"]["path"].as_str() {
                    Some(p) => p.to_owned(),
                    None => format!("secret {}", v["secret"]["secretName"].as_str().unwrap()),
                };
                mounted.insert(what, m["mountPath"].as_str().map(str::to_owned));
            }
        }
    }
    // /proc/sys is the container's own, listed for what reads it.
    documented.remove("/proc/sys");
    assert_eq!(
        documented, mounted,
        "the host path table against the DaemonSet's mounts"
    );

    // The uninstall's table: its containers' capabilities and host paths.
    let uninstall = section("docs/operations.md", "## Uninstall");
    let objects = render_dir("deploy/uninstall", &[]);
    let pod = &one(&objects, "DaemonSet")["spec"]["template"]["spec"];
    for r in table_rows(&uninstall) {
        let name = quoted(&r[0])[0];
        let c = container(pod, name);
        let mut caps: Vec<&str> = quoted(&r[1])
            .into_iter()
            .filter(|w| w.chars().all(|ch| ch.is_ascii_uppercase() || ch == '_'))
            .collect();
        caps.sort_unstable();
        let mut want = strings(&c["securityContext"]["capabilities"]["add"]);
        want.sort_unstable();
        assert_eq!(caps, want, "the uninstall table's {name}");
        let paths: BTreeSet<&str> = quoted(&r[2]).into_iter().collect();
        for (host, at) in host_mounts(pod, c) {
            assert!(
                paths.contains(host.as_str()) && paths.contains(at.as_str()),
                "the uninstall table's {name} lacks {host} at {at}: {paths:?}"
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
