//! The capabilities the manifests grant the agent's container (base and OpenShift
//! overlay, as rendered) are those the agent uses (`doctor::host::CAPABILITIES`, which its
//! preflight checks) and CAP_SYS_RESOURCE (memlock, before Linux 5.11): no more, no fewer.
//! `cni_plugin.rs` runs the agent under them and checks what it can do.

use egress_agent::doctor::host::CAPABILITIES;
use egress_tests::deployed::AgentContainer;

/// Granted although the agent's preflight does not require it: raising RLIMIT_MEMLOCK on
/// kernels that charge maps to it (docs/operations.md, "What the DaemonSet grants").
const FOR_OLD_KERNELS: &[&str] = &["SYS_RESOURCE"];

#[test]
fn the_manifests_grant_exactly_the_capabilities_the_agent_uses() {
    let mut used: Vec<String> = CAPABILITIES
        .iter()
        .map(|(_, name, _)| name.trim_start_matches("CAP_").to_owned())
        .chain(FOR_OLD_KERNELS.iter().map(|s| (*s).to_owned()))
        .collect();
    used.sort();
    for dir in ["deploy", "deploy/openshift"] {
        let container = AgentContainer::from_kustomization(dir).unwrap();
        assert!(!container.privileged, "{dir}: the agent is not privileged");
        let mut granted = container.capabilities.clone();
        granted.sort();
        let unused: Vec<_> = granted.iter().filter(|c| !used.contains(c)).collect();
        let lacking: Vec<_> = used.iter().filter(|c| !granted.contains(c)).collect();
        assert!(
            unused.is_empty() && lacking.is_empty(),
            "{dir}: the agent's container asks for {unused:?}, which the agent never uses, \
             and lacks {lacking:?}, which it needs"
        );
    }
}

/// The runner refuses manifests that do not drop every capability first, and reads the
/// container's literal environment, leaving out files under a Secret's mount.
#[test]
fn the_runner_reads_the_container_as_declared() {
    let yaml = r#"
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: egress-agent}
spec:
  template:
    spec:
      containers:
      - name: agent
        env:
        - {name: A, value: "1"}
        - {name: KEY, value: /etc/key/k}
        - name: NODE_NAME
          valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
        securityContext:
          capabilities: {drop: [ALL], add: [BPF, NET_ADMIN]}
        volumeMounts:
        - {name: key, mountPath: /etc/key}
      volumes:
      - {name: key, secret: {secretName: k}}
"#;
    let c = AgentContainer::parse(yaml).unwrap();
    assert_eq!(c.capabilities, ["BPF", "NET_ADMIN"]);
    assert_eq!(c.env, [("A".to_owned(), "1".to_owned())]);
    let e = AgentContainer::parse(&yaml.replace("drop: [ALL], ", "")).unwrap_err();
    assert!(e.to_string().contains("capabilities.drop"), "{e}");
}
