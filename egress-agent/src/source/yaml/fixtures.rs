//! What the tests of the YAML source share: a directory's worth of documents and the
//! questions they ask of a snapshot.

use crate::source::Snapshot;

pub(super) const GOOD: &str = r#"
# a comment before the first document
---
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: payments}}
---
apiVersion: v1
kind: Node
metadata: {name: gw-1, labels: {egress.dev/gateway: "true"}}
status:
  addresses:
  - {type: Hostname, address: gw-1}
  - {type: InternalIP, address: 10.0.0.11}
  conditions:
  - {type: Ready, status: "True"}
---
apiVersion: v1
kind: Pod
metadata: {name: api-0, namespace: shop, labels: {app: api}}
spec:
  nodeName: worker-1
  containers: [{name: c, image: x}]
status:
  phase: Running
  podIPs: [{ip: 10.244.1.5}]
---
apiVersion: egress.dev/v1alpha1
kind: EgressGatewayPolicy
metadata: {name: payments, generation: 3}
spec:
  gatewaySelector: {matchLabels: {egress.dev/gateway: "true"}}
  rules:
  - destinations: ["192.0.2.0/24"]
egressIP: 198.51.100.10
---
apiVersion: egress.dev/v1alpha1
kind: EgressNode
metadata: {name: gw-1}
spec: {underlayIP: 10.0.0.11}
status:
  interfaces:
  - {name: ens224, up: true, addresses: ["198.51.100.2/24"]}
  egressIPs: [{ip: 198.51.100.10, interface: ens224}]
...
"#;

pub(super) fn messages(snap: &Snapshot) -> Vec<String> {
    snap.errors.iter().map(ToString::to_string).collect()
}

/// A Namespace document for `name`.
pub(super) fn namespace_doc(name: &str) -> String {
    format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}}}\n")
}

pub(super) fn names(snap: &Snapshot) -> Vec<&str> {
    snap.view
        .namespaces
        .iter()
        .filter_map(|n| n.metadata.name.as_deref())
        .collect()
}

pub(super) fn ns(name: &str, team: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}, labels: {{team: {team}}}}}\n"
    )
}

pub(super) fn teams(snap: &Snapshot) -> Vec<String> {
    snap.view
        .namespaces
        .iter()
        .map(|n| {
            let name = n.metadata.name.clone().unwrap_or_default();
            let team = n.metadata.labels.as_ref().and_then(|l| l.get("team"));
            format!("{name}:{}", team.map_or("", String::as_str))
        })
        .collect()
}
