//! Pods and namespaces as the compiler sees them, and which pods a policy selects.

use std::{collections::BTreeMap, net::IpAddr};

use super::{Selector, nodes::NodeInfo};
use crate::{desired::Desired, source::ClusterView};

/// A pod as the compiler sees it.
pub(super) struct PodInfo<'a> {
    pub(super) namespace: &'a str,
    pub(super) name: &'a str,
    pub(super) labels: &'a BTreeMap<String, String>,
    pub(super) node: &'a str,
    /// Both families (dual-stack pods have one of each).
    pub(super) ips: Vec<IpAddr>,
}

/// The running, pod-network pods of the cluster (sorted by namespace and name) and the
/// namespaces' labels.
pub(super) struct Pods<'a> {
    pub(super) pods: Vec<PodInfo<'a>>,
    namespace_labels: BTreeMap<&'a str, BTreeMap<String, String>>,
}

impl<'a> Pods<'a> {
    pub(super) fn index(view: &'a ClusterView) -> Self {
        let mut namespace_labels: BTreeMap<&str, BTreeMap<String, String>> = BTreeMap::new();
        for ns in &view.namespaces {
            if let Some(name) = ns.metadata.name.as_deref() {
                let mut labels = ns.metadata.labels.clone().unwrap_or_default();
                labels
                    .entry("kubernetes.io/metadata.name".to_owned())
                    .or_insert_with(|| name.to_owned());
                namespace_labels.insert(name, labels);
            }
        }
        let mut pods: Vec<PodInfo<'_>> = view
            .pods
            .iter()
            .filter_map(|pod| {
                if pod.host_network || !pod.running || pod.ips.is_empty() || pod.name.is_empty() {
                    return None;
                }
                Some(PodInfo {
                    namespace: &pod.namespace,
                    name: &pod.name,
                    labels: &pod.labels,
                    node: pod.node_name.as_deref()?,
                    ips: pod.ips.clone(),
                })
            })
            .collect();
        pods.sort_by(|a, b| (a.namespace, a.name).cmp(&(b.namespace, b.name)));
        pods.sort_by(|a, b| (a.namespace, a.name).cmp(&(b.namespace, b.name)));
        Self {
            pods,
            namespace_labels,
        }
    }

    /// Every pod address of the cluster -> the underlay address of its node (spoofing
    /// check and return path, on every node).
    pub(super) fn record_owners(&self, nodes: &[NodeInfo<'_>], desired: &mut Desired) {
        let underlay_of: BTreeMap<&str, IpAddr> = nodes
            .iter()
            .filter_map(|n| Some((n.name, n.underlay?)))
            .collect();
        for pod in &self.pods {
            let Some(underlay) = underlay_of.get(pod.node) else {
                continue;
            };
            for ip in &pod.ips {
                match ip {
                    IpAddr::V4(ip) => {
                        desired.v4.pod_owner.insert(*ip, *underlay);
                    }
                    IpAddr::V6(ip) => {
                        desired.v6.pod_owner.insert(*ip, *underlay);
                    }
                }
            }
        }
    }

    /// The pods that a policy's namespace and pod selectors select. A namespace without a
    /// Namespace object still has its implicit `kubernetes.io/metadata.name` label.
    pub(super) fn selected(&self, ns_sel: &Selector, pod_sel: &Selector) -> Vec<&PodInfo<'a>> {
        self.pods
            .iter()
            .filter(|pod| {
                let matches_ns = match self.namespace_labels.get(pod.namespace) {
                    Some(labels) if !labels.is_empty() => ns_sel.matches(labels),
                    _ => {
                        let implicit = BTreeMap::from([(
                            "kubernetes.io/metadata.name".to_owned(),
                            pod.namespace.to_owned(),
                        )]);
                        ns_sel.matches(&implicit)
                    }
                };
                matches_ns && pod_sel.matches(pod.labels)
            })
            .collect()
    }
}
