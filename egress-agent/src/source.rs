//! Sources of cluster state: a YAML directory ([`yaml`]), or Kubernetes ([`kube`]).
//!
//! Every source produces the same [`Snapshot`]: a [`ClusterView`] (the objects the
//! compiler needs, in the types Kubernetes serves them as, except Pods, of which it keeps a
//! [`PodSummary`]) and the [`LoadError`]s of what it left out. Each source also has a
//! [`StatusWriter`], the way an agent tells the cluster what it decided.

use std::{collections::BTreeMap, fmt, net::IpAddr, path::PathBuf, sync::Arc};

use k8s_openapi::{
    api::{
        core::v1::{Namespace, Node, Pod},
        networking::v1::NetworkPolicy,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

pub use crate::api::PodScope;
use crate::api::{EgressGatewayPolicy, EgressNode, PolicyStatus};

pub mod admin;
pub mod intern;
pub mod kube;
pub mod objects;
pub mod openshift;
pub mod ovn;
pub mod yaml;

/// Where an agent tells the cluster what it decided: its EgressNode, the policy statuses
/// (when it is the elected writer) and Events. Each source has its own, next to its
/// reader: [`yaml::DirWriter`] (the EgressNode as a file in the state directory; statuses
/// and Events only in the log), [`kube::writer::Writer`] (the API, in the background).
pub trait StatusWriter: Send + Sync {
    /// Publish this node's EgressNode (the latest one wins).
    fn egress_node(&self, doc: &EgressNode) -> anyhow::Result<()>;
    /// The status of every policy, as this node computed it.
    fn policy_statuses(&self, statuses: &BTreeMap<String, PolicyStatus>);
    /// Record an Event on a policy.
    fn event(&self, ev: Event);
    /// The pods this node needs, as its last compile found ([`crate::compiler::pods_needed`]
    /// with liveness and the policies' last accepted versions): a source that watches
    /// fewer than every pod widens or narrows its watch to that (see [`kube::watch_node`]).
    /// A source that always holds every pod ignores it.
    fn pods_needed(&self, _scope: PodScope) {}
}

/// What one read of a source found: the view, and every object it left out and why.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub view: ClusterView,
    /// Every problem met, in file and document order (the YAML source) or by kind and
    /// name (the Kubernetes source). A document listed here is not in `view` (though the
    /// last good version of its object may be: [`LoadError::Kept`]).
    pub errors: Vec<LoadError>,
}

/// One document (the YAML source) or object (the Kubernetes source) that could not be
/// used, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DocumentError {
    /// File name, relative to the state directory; the object's API path for the
    /// Kubernetes source.
    pub file: String,
    /// 1-based position of the document in the file.
    pub doc: usize,
    /// `Kind namespace/name` or `Kind name`, when the document got that far.
    pub object: Option<String>,
    /// Path of the offending field (`status.podIPs[0].ip`), when known.
    pub field: Option<String>,
    pub message: String,
}

impl fmt::Display for DocumentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "file {} doc {}", self.file, self.doc)?;
        if let Some(object) = &self.object {
            write!(f, " ({object})")?;
        }
        f.write_str(": ")?;
        if let Some(field) = &self.field {
            write!(f, "{field}: ")?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for DocumentError {}

/// Why (part of) a source could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("failed to read directory {dir}: {detail}")]
    ReadDir { dir: PathBuf, detail: String },
    #[error("failed to read file {file}: {detail}")]
    ReadFile { file: String, detail: String },
    #[error("{0}")]
    Document(#[from] DocumentError),
    #[error("{0}")]
    Kept(#[from] Kept),
}

/// Objects served from their last good version because what now stands for them could not
/// be read (only the YAML watcher remembers: [`yaml::load_dir`] never keeps anything).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept {
    /// File name, relative to the directory.
    pub file: String,
    /// The document that stands for the one object kept; `None` when the whole file is
    /// kept (empty, unreadable, or with a document whose object cannot be told).
    pub doc: Option<usize>,
    /// What is wrong, after "file F" (`is empty`, `could not be read`, ...).
    pub reason: String,
    /// `Kind namespace/name` or `Kind name` of each object kept, in file order.
    pub objects: Vec<String>,
}

/// How many kept objects an error names before it counts the rest.
pub const KEPT_NAMED: usize = 5;

impl fmt::Display for Kept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "file {} ", self.file)?;
        if let Some(doc) = self.doc {
            write!(f, "doc {doc} ")?;
        }
        write!(f, "{}: keeping the last good version of ", self.reason)?;
        let named = self.objects.iter().take(KEPT_NAMED);
        for (i, object) in named.enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(object)?;
        }
        if let Some(more) = self
            .objects
            .len()
            .checked_sub(KEPT_NAMED)
            .filter(|&n| n > 0)
        {
            write!(f, " and {more} more")?;
        }
        match self.doc {
            Some(_) => {
                f.write_str(" until the document is fixed (deleting the document removes it)")
            }
            None => f.write_str(" until the file is fixed (deleting the file removes them)"),
        }
    }
}

impl std::error::Error for Kept {}

/// An Event to record on a policy.
pub struct Event {
    pub policy: String,
    pub reason: &'static str,
    pub message: String,
}

/// An EgressNode as a [`ClusterView`] holds it: without `status.peers`, the publishing
/// agent's own view of its peers' liveness, which no compile reads (each agent decides by
/// its own hellos; `kubectl egress status` reads the list from the API). An agent whose
/// peers flap then rewrites its EgressNode without waking every other agent for a pass:
/// in the lab at 100 nodes on 2 cores, such rewrites woke about 2,000 passes a minute and
/// kept the machine too busy to answer probes (docs/benchmarks.md).
///
/// Its `resourceVersion` goes too (the API's, changed by every write, peers' included);
/// nothing in the agent reads an EgressNode's.
pub fn view_egress_node(node: &EgressNode) -> EgressNode {
    let mut node = node.clone();
    node.metadata.resource_version = None;
    if let Some(status) = node.status.as_mut() {
        status.peers.clear();
    }
    node
}

/// Pod addresses of both families (`status.podIPs`, else `status.podIP`), invalid ones
/// left out, in listed order.
pub fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(status) = &pod.status else {
        return Vec::new();
    };
    let mut ips: Vec<IpAddr> = match &status.pod_ips {
        Some(list) if !list.is_empty() => list.iter().filter_map(|p| p.ip.parse().ok()).collect(),
        _ => status
            .pod_ip
            .iter()
            .filter_map(|ip| ip.parse().ok())
            .collect(),
    };
    ips.dedup();
    ips
}

/// Everything the compiler reads about the cluster. Order does not matter: the compiler
/// sorts what it uses.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterView {
    pub policies: Vec<EgressGatewayPolicy>,
    pub namespaces: Vec<Namespace>,
    /// Shared with the source's table and the views before: a new view copies pointers,
    /// and a pod that did not change is the very same `Arc`.
    pub pods: Vec<Arc<PodSummary>>,
    /// Which pods `pods` holds: every pod of the cluster, or (a worker's view from the
    /// Kubernetes source) those of the node the view is for. The compiler gives a node the
    /// same datapath state from either when it needs no more ([`crate::compiler::pods_needed`]).
    pub pod_scope: PodScope,
    pub nodes: Vec<Node>,
    pub egress_nodes: Vec<EgressNode>,
    /// The cluster's own prefixes that no route may steer to a gateway (pod and service
    /// CIDRs, from `--cluster-cidr`, and OpenShift's cluster `Network` object where the
    /// API serves it); Nodes' `spec.podCIDRs`, pod and node addresses are
    /// added by the compiler.
    pub cluster_cidrs: Vec<ipnet::IpNet>,
    /// OVN-Kubernetes `EgressIP` objects (`k8s.ovn.org/v1`), where that CRD exists: their
    /// addresses are not ours to take.
    pub ovn_egress_ips: Vec<ovn::EgressIP>,
    /// `networking.k8s.io/v1` NetworkPolicies: their egress rules hold for the traffic
    /// the datapath redirects (`compiler::netpol`).
    pub network_policies: Vec<NetworkPolicy>,
    /// AdminNetworkPolicies, BaselineAdminNetworkPolicies and OVN-Kubernetes
    /// EgressFirewalls, where they exist: not applied to redirected traffic, which the
    /// policies that may redirect their pods say.
    pub unapplied: Vec<Unapplied>,
}

/// An AdminNetworkPolicy, BaselineAdminNetworkPolicy or EgressFirewall (the kinds of
/// [`admin`]), as the compiler sees it: not applied to redirected traffic.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Unapplied {
    /// `AdminNetworkPolicy`, `BaselineAdminNetworkPolicy` or `EgressFirewall`.
    pub kind: &'static str,
    /// `Some` for an `EgressFirewall`: it covers that namespace's pods only.
    pub namespace: Option<String>,
    pub name: String,
}

impl Unapplied {
    pub fn of(kind: &'static str, meta: &ObjectMeta) -> Self {
        Self {
            kind,
            namespace: meta.namespace.clone(),
            name: meta.name.clone().unwrap_or_default(),
        }
    }
}

impl fmt::Display for Unapplied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {ns}/{}", self.kind, self.name),
            None => write!(f, "{} {}", self.kind, self.name),
        }
    }
}

/// What the compiler reads of a Pod. Gateways hold every pod of the cluster, and a whole
/// `Pod` takes over 1.6 KiB before its first container or label (its `spec` and `status`
/// are wide structs of optional fields): this takes a tenth of that, and its namespace,
/// node and labels are shared with the pods that have the same ([`intern`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodSummary {
    /// `metadata.namespace`, `default` when unset.
    pub namespace: Arc<str>,
    pub name: String,
    pub labels: intern::Labels,
    /// `spec.nodeName`.
    pub node_name: Option<Arc<str>>,
    /// `spec.hostNetwork`.
    pub host_network: bool,
    /// `status.phase` is `Running`.
    pub running: bool,
    /// `status.podIPs`, else `status.podIP`, in listed order; invalid ones left out.
    pub ips: Vec<IpAddr>,
}

impl From<&Pod> for PodSummary {
    fn from(pod: &Pod) -> Self {
        let spec = pod.spec.as_ref();
        Self {
            namespace: intern::name(pod.metadata.namespace.as_deref().unwrap_or("default")),
            name: pod.metadata.name.clone().unwrap_or_default(),
            labels: intern::labels(pod.metadata.labels.clone().unwrap_or_default()),
            node_name: spec.and_then(|s| s.node_name.as_deref()).map(intern::name),
            host_network: spec.and_then(|s| s.host_network) == Some(true),
            running: pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"),
            ips: pod_ips(pod),
        }
    }
}

impl From<Pod> for PodSummary {
    fn from(pod: Pod) -> Self {
        Self::from(&pod)
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::core::v1::{PodIP, PodSpec, PodStatus},
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;

    #[test]
    fn a_pod_summary_keeps_what_the_compiler_reads() {
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some("api-0".to_owned()),
                labels: Some(BTreeMap::from([("app".to_owned(), "api".to_owned())])),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("worker-1".to_owned()),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".to_owned()),
                pod_ip: Some("10.244.1.9".to_owned()),
                pod_ips: Some(vec![
                    PodIP {
                        ip: "10.244.1.5".to_owned(),
                    },
                    PodIP {
                        ip: "not an IP".to_owned(),
                    },
                    PodIP {
                        ip: "fd00::5".to_owned(),
                    },
                ]),
                ..Default::default()
            }),
        };
        let summary = PodSummary::from(&pod);
        assert_eq!(
            summary,
            PodSummary {
                namespace: "default".into(),
                name: "api-0".to_owned(),
                labels: BTreeMap::from([("app".to_owned(), "api".to_owned())]).into(),
                node_name: Some("worker-1".into()),
                host_network: false,
                running: true,
                ips: vec![
                    "10.244.1.5".parse().expect("ip"),
                    "fd00::5".parse().expect("ip")
                ],
            }
        );
        // A second pod of the same namespace, node and labels shares them.
        let again = PodSummary::from(&pod);
        assert!(Arc::ptr_eq(&summary.namespace, &again.namespace));
        assert!(Arc::ptr_eq(&summary.labels, &again.labels));
        let (a, b) = (summary.node_name.as_ref(), again.node_name.as_ref());
        assert!(a.zip(b).is_some_and(|(a, b)| Arc::ptr_eq(a, b)));
        let pending_on_host = Pod {
            spec: Some(PodSpec {
                host_network: Some(true),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some("Pending".to_owned()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let summary = PodSummary::from(pending_on_host);
        assert!(summary.host_network && !summary.running);
        let bare = PodSummary::from(Pod::default());
        assert!(!bare.running && bare.ips.is_empty() && bare.node_name.is_none());
    }
}

#[cfg(test)]
mod view_tests {
    use super::*;
    use crate::api::{EgressNodeStatus, PeerLiveness};

    #[test]
    fn a_peers_only_rewrite_of_an_egress_node_leaves_the_view_unchanged() {
        let mut a = EgressNode::new("gw1", Default::default());
        a.metadata.resource_version = Some("1".to_owned());
        a.status = Some(EgressNodeStatus {
            peers: vec![PeerLiveness {
                name: "w1".to_owned(),
                alive: true,
            }],
            cut_off: false,
            ..Default::default()
        });
        let mut b = a.clone();
        b.metadata.resource_version = Some("2".to_owned());
        if let Some(s) = b.status.as_mut() {
            s.peers[0].alive = false;
        }
        assert_ne!(a, b);
        assert_eq!(view_egress_node(&a), view_egress_node(&b));
        // What the compiler reads still counts.
        if let Some(s) = b.status.as_mut() {
            s.cut_off = true;
        }
        assert_ne!(view_egress_node(&a), view_egress_node(&b));
    }
}
