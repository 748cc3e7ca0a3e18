//! `egress-agent check`: validate a state directory offline, the way the agents would see
//! it, and say what to fix.

use std::{fmt, path::Path};

use ipnet::IpNet;

use crate::{
    compiler::{self, compile},
    source::{LoadError, yaml},
};

/// One thing to fix (or to know) about a state directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// A file or document that could not be read (it is left out of the view).
    Load(LoadError),
    /// A guardrail, conflict or unusable object found by the compiler.
    Compile(compiler::Problem),
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Load(e) => e.fmt(f),
            Self::Compile(p) => p.fmt(f),
        }
    }
}

/// Read `dir` and compile it: every parse error first (file and document order), then
/// every compiler problem (sorted by object). Empty when all is well.
///
/// Policy problems do not depend on the node being compiled for (statuses are
/// cluster-wide), so one compilation covers every node. `cluster_cidrs` are the cluster's
/// pod and service CIDRs, as the agents are given them.
pub fn check_dir(dir: &Path, cluster_cidrs: &[IpNet]) -> Vec<Problem> {
    let mut snapshot = yaml::load_dir(dir);
    snapshot.view.cluster_cidrs = cluster_cidrs.to_vec();
    let mut problems: Vec<Problem> = snapshot.errors.into_iter().map(Problem::Load).collect();
    let node = snapshot
        .view
        .nodes
        .iter()
        .find_map(|n| n.metadata.name.clone())
        .unwrap_or_default();
    let compiled = compile(&snapshot.view, &node);
    problems.extend(compiled.problems.into_iter().map(Problem::Compile));
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: gw-1, labels: {egress.dev/gateway: "true"}}
status:
  addresses: [{type: InternalIP, address: 10.0.0.11}]
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: egress.dev/v1alpha1
kind: EgressNode
metadata: {name: gw-1}
status:
  interfaces: [{name: ens224, up: true, addresses: ["198.51.100.2/24"]}]
"#;

    const PODS: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: ok, namespace: default}
spec: {nodeName: gw-1}
status: {phase: Running, podIPs: [{ip: 10.244.0.5}]}
---
apiVersion: v1
kind: Pod
metadata: {name: x, namespace: default}
spec: {nodeName: gw-1}
status: {phase: Running, podIPs: [{ip: 1.2.3}]}
"#;

    const POLICIES: &str = r#"
apiVersion: egress.dev/v1alpha1
kind: EgressGatewayPolicy
metadata: {name: payments}
spec:
  gatewaySelector: {matchLabels: {egress.dev/gateway: "true"}}
  rules:
  - destinations: ["192.0.2.0/24"]
    egressIP: 198.51.100.10
  - destinations: ["192.0.3.0/24"]
    egressIP: 100.64.0.10
---
apiVersion: egress.dev/v1alpha1
kind: EgressGatewayPolicy
metadata: {name: fine}
spec:
  gatewaySelector: {matchLabels: {egress.dev/gateway: "true"}}
  rules:
  - destinations: ["192.0.4.0/24"]
    interface: ens224
"#;

    /// What `check` prints for `dir`, one line per problem.
    fn shown(dir: &Path) -> Vec<String> {
        check_dir(dir, &[])
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn reports_parse_errors_and_guardrails_naming_object_and_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("cluster.yaml"), CLUSTER).expect("write");
        std::fs::write(dir.path().join("pods.yaml"), PODS).expect("write");
        std::fs::write(dir.path().join("policies.yaml"), POLICIES).expect("write");
        let shown = shown(dir.path());
        assert_eq!(
            shown,
            [
                r#"file pods.yaml doc 2 (Pod default/x): status.podIPs[0].ip: invalid IP address "1.2.3""#,
                "policy payments: rules[1].egressIP: 100.64.0.10 is in no subnet of an up \
                 interface of any eligible gateway (gw-1)",
            ]
        );
    }

    #[test]
    fn a_clean_directory_has_no_problems() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("cluster.yaml"), CLUSTER).expect("write");
        assert_eq!(check_dir(dir.path(), &[]), []);
    }

    #[test]
    fn deep_nesting_is_a_problem_reported_without_parsing() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("cluster.yaml"), CLUSTER).expect("write");
        std::fs::write(dir.path().join("deep.yaml"), "[".repeat(200_000)).expect("write");
        let shown = shown(dir.path());
        assert_eq!(
            shown,
            [
                "file deep.yaml doc 1: failed to parse YAML: nested deeper than 64 levels \
              (brackets and indentation together) at line 1"
            ]
        );
    }

    #[test]
    fn a_missing_directory_is_a_problem() {
        let problems = check_dir(Path::new("/nonexistent/egress-check"), &[]);
        assert_eq!(problems.len(), 1);
        assert!(problems[0].to_string().contains("failed to read directory"));
    }
}
