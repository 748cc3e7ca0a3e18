//! Pods and namespaces as the compiler sees them, and which pods a policy selects.

use std::{
    borrow::Cow,
    cmp::Ordering,
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::IpAddr,
    ops::Range,
};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Namespace;

use super::{
    compiled::{Object, Problem},
    nodes::NodeInfo,
    reason,
};
use crate::{
    api::EgressGatewayPolicySpec,
    desired::Desired,
    selector::Selector,
    source::{ClusterView, PodScope, PodSummary},
};

/// A pod as the compiler sees it.
pub(super) struct PodInfo<'a> {
    pub(super) namespace: &'a str,
    pub(super) name: &'a str,
    pub(super) labels: &'a BTreeMap<String, String>,
    pub(super) node: &'a str,
    /// The pod runs on the node the compile is for.
    pub(super) local: bool,
    /// Its place in [`Pods::pods`] (entries of one namespace and name share the first's).
    pub(super) at: usize,
    /// Both families (dual-stack pods have one of each): the view's list, copied only
    /// where a disputed address is taken out.
    pub(super) ips: Cow<'a, [IpAddr]>,
}

/// The running, pod-network pods of the cluster (sorted by namespace and name) and the
/// namespaces' labels.
pub(super) struct Pods<'a> {
    pub(super) pods: Vec<PodInfo<'a>>,
    /// Each namespace's run of `pods`, in order.
    runs: Vec<(&'a str, Range<usize>)>,
    /// Every address of `pods` with the index of its pod, sorted (by address, then
    /// index).
    pub(super) by_address: Vec<(IpAddr, usize)>,
    namespaces: Namespaces<'a>,
    /// Addresses that two running pods list, or a pod and a node: taken from every pod
    /// that lists them (no pod owns them), with the pods (`namespace/name`) that claimed
    /// each and what else holds it (a node), for the conditions.
    pub(super) disputed: Vec<Disputed>,
}

/// A pod address that is not one pod's alone.
pub(super) struct Disputed {
    pub(super) ip: IpAddr,
    /// `namespace/name` of each pod that lists it.
    pub(super) pods: Vec<String>,
    /// The node it is an address of, if it is one.
    pub(super) node: Option<String>,
}

impl Disputed {
    /// The condition message.
    pub(super) fn message(&self) -> String {
        let by = match &self.node {
            Some(node) => format!("pod {} and node {node}", self.pods.join(", ")),
            None => format!("pods {}", self.pods.join(" and ")),
        };
        format!(
            "address {} is claimed by {by}: it is nobody's pod address (no entries, no \
             owner; its traffic is not steered and tunnel packets from it are dropped) \
             until one claim goes",
            self.ip
        )
    }
}

/// Every address of every Node (its `status.addresses`, held egress IPs `held` left out)
/// and EgressNode underlay, by node.
pub(super) fn node_addresses(
    view: &ClusterView,
    held: &BTreeSet<IpAddr>,
) -> BTreeMap<IpAddr, String> {
    let mut out = BTreeMap::new();
    for n in &view.nodes {
        let Some(name) = n.metadata.name.as_deref() else {
            continue;
        };
        for (ip, _) in super::nodes::node_addresses(n, held) {
            out.entry(ip).or_insert_with(|| name.to_owned());
        }
    }
    for en in &view.egress_nodes {
        let name = en.metadata.name.as_deref().unwrap_or_default();
        if let Some(ip) = en.spec.underlay_ip.as_deref().and_then(|t| t.parse().ok()) {
            out.entry(ip).or_insert_with(|| name.to_owned());
        }
    }
    out
}

/// The namespaces' labels, each with its implicit `kubernetes.io/metadata.name`.
struct Namespaces<'a>(BTreeMap<&'a str, BTreeMap<String, String>>);

/// A Namespace's name and labels, with its implicit `kubernetes.io/metadata.name`.
fn namespace_labels(ns: &Namespace) -> Option<(&str, BTreeMap<String, String>)> {
    let name = ns.metadata.name.as_deref()?;
    let mut labels = ns.metadata.labels.clone().unwrap_or_default();
    labels
        .entry("kubernetes.io/metadata.name".to_owned())
        .or_insert_with(|| name.to_owned());
    Some((name, labels))
}

/// Whether `ns_sel` selects `namespace`, whose labels are `labels` (`None`: it has no
/// Namespace object, and still has its implicit `kubernetes.io/metadata.name` label).
fn labels_selected(
    namespace: &str,
    labels: Option<&BTreeMap<String, String>>,
    ns_sel: &Selector,
) -> bool {
    match labels {
        Some(labels) if !labels.is_empty() => ns_sel.matches(labels),
        _ => {
            let implicit = BTreeMap::from([(
                "kubernetes.io/metadata.name".to_owned(),
                namespace.to_owned(),
            )]);
            ns_sel.matches(&implicit)
        }
    }
}

/// Whether `ns_sel` selects `namespace` of `view`, as [`Pods::selected`] matches it: for
/// one pod, without indexing every namespace.
pub(super) fn namespace_selected(view: &ClusterView, namespace: &str, ns_sel: &Selector) -> bool {
    // The last of one name counts, as in [`Namespaces::index`].
    let labels = view
        .namespaces
        .iter()
        .rev()
        .filter_map(namespace_labels)
        .find(|(name, _)| *name == namespace)
        .map(|(_, labels)| labels);
    labels_selected(namespace, labels.as_ref(), ns_sel)
}

impl<'a> Namespaces<'a> {
    fn index(view: &'a ClusterView) -> Self {
        Self(
            view.namespaces
                .iter()
                .filter_map(namespace_labels)
                .collect(),
        )
    }

    /// Whether `ns_sel` selects `namespace`. A namespace without a Namespace object still
    /// has its implicit `kubernetes.io/metadata.name` label.
    fn matches(&self, namespace: &str, ns_sel: &Selector) -> bool {
        labels_selected(namespace, self.0.get(namespace), ns_sel)
    }
}

/// Whether a policy's selectors select a pod, and if not, the first that does not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    Selected,
    /// Its `namespaceSelector` does not select the pod's namespace (or is invalid).
    NamespaceNotSelected,
    /// Its `podSelector` does not select the pod (or is invalid).
    PodNotSelected,
}

/// Whether the policy of `spec` selects a pod of `namespace` with `labels`, as a compile
/// of `view` selects pods ([`Pods::selected`]): the namespace first, by its labels and
/// its implicit name label, then the pod; an invalid selector selects nothing. What
/// `explain` asks of a policy that does not take a pod's traffic.
pub fn selection(
    view: &ClusterView,
    spec: &EgressGatewayPolicySpec,
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> Selection {
    let ns_sel = Selector::optional(spec.namespace_selector.as_ref(), "spec.namespaceSelector");
    let pod_sel = Selector::optional(spec.pod_selector.as_ref(), "spec.podSelector");
    if !ns_sel.is_ok_and(|s| namespace_selected(view, namespace, &s)) {
        return Selection::NamespaceNotSelected;
    }
    if !pod_sel.is_ok_and(|s| s.matches(labels)) {
        return Selection::PodNotSelected;
    }
    Selection::Selected
}

/// The declared cluster CIDRs and every node's pod CIDRs: where pod addresses belong.
pub(super) fn pod_cidrs(view: &ClusterView, nodes: &[NodeInfo<'_>]) -> Vec<IpNet> {
    view.cluster_cidrs
        .iter()
        .chain(nodes.iter().flat_map(|n| &n.pod_cidrs))
        .map(IpNet::trunc)
        .collect()
}

/// The node of a pod the compiler sees (running, on the pod network, named, with an
/// address and a node); `None` for a pod it leaves out.
pub(super) fn seen(pod: &PodSummary) -> Option<&str> {
    if pod.host_network || !pod.running || pod.ips.is_empty() || pod.name.is_empty() {
        return None;
    }
    pod.node_name.as_deref()
}

impl<'a> Pods<'a> {
    /// The running pod-network pods of `view`, sorted, for a compile for node `me`.
    pub(super) fn index(view: &'a ClusterView, held: &BTreeSet<IpAddr>, me: &str) -> Self {
        let running: Vec<PodInfo<'_>> = view
            .pods
            .iter()
            .filter_map(|pod| {
                let node = seen(pod)?;
                Some(PodInfo {
                    namespace: &pod.namespace,
                    name: &pod.name,
                    labels: &pod.labels,
                    node,
                    local: node == me,
                    at: 0,
                    ips: Cow::Borrowed(&pod.ips),
                })
            })
            .collect();
        let mut pods = running;
        let runs = match places(&mut pods) {
            Some(runs) => runs,
            None => {
                pods.sort_by(|a, b| (a.namespace, a.name).cmp(&(b.namespace, b.name)));
                places(&mut pods).unwrap_or_default()
            }
        };
        let mut by_address = addresses(&pods);
        let disputed = disputed(&pods, &by_address, &node_addresses(view, held));
        if !disputed.is_empty() {
            let taken: HashSet<IpAddr> = disputed.iter().map(|d| d.ip).collect();
            for pod in &mut pods {
                if pod.ips.iter().any(|ip| taken.contains(ip)) {
                    pod.ips.to_mut().retain(|ip| !taken.contains(ip));
                }
            }
            by_address.retain(|(ip, _)| !taken.contains(ip));
        }
        Self {
            runs,
            by_address,
            pods,
            namespaces: Namespaces::index(view),
            disputed,
        }
    }

    /// Pod address -> the underlay address of its node: of every pod of the cluster
    /// (`only`: `None`) on a gateway, where `from_tunnel` checks a forwarded packet's
    /// inner source against the sender and `from_secondary` tunnels a reply back to the
    /// pod's node; of the pods of node `only` elsewhere, which needs them for the return
    /// path's check (a reply the gateway tunnels back is for a pod of this node).
    pub(super) fn record_owners(
        &self,
        nodes: &[NodeInfo<'_>],
        local_only: bool,
        desired: &mut Desired,
    ) {
        let underlay_of: HashMap<&str, IpAddr> = nodes
            .iter()
            .filter_map(|n| Some((n.name, n.underlay?)))
            .collect();
        let (mut v4, mut v6) = (Vec::new(), Vec::new());
        let mut record = |ip: &IpAddr, pod: &PodInfo<'_>| {
            if let Some(underlay) = underlay_of.get(pod.node) {
                match ip {
                    IpAddr::V4(ip) => v4.push((*ip, *underlay)),
                    IpAddr::V6(ip) => v6.push((*ip, *underlay)),
                }
            }
        };
        if local_only {
            for pod in self.pods.iter().filter(|p| p.local) {
                pod.ips.iter().for_each(|ip| record(ip, pod));
            }
        } else {
            // By address, the order of the maps' keys ([`Pods::by_address`] holds every
            // pod address but the disputed, as the pods' `ips` do).
            for (ip, i) in &self.by_address {
                record(ip, &self.pods[*i]);
            }
        }
        // Built in bulk (sorted, then the tree at once): a gateway records every pod.
        bulk_insert(&mut desired.v4.pod_owner, v4);
        bulk_insert(&mut desired.v6.pod_owner, v6);
    }

    /// The pods that a policy's namespace and pod selectors select ([`Namespaces::matches`]).
    /// The namespace is matched once for each run of its pods (they are sorted by it).
    pub(super) fn selected(&self, ns_sel: &Selector, pod_sel: &Selector) -> Vec<&PodInfo<'a>> {
        self.runs
            .iter()
            .filter(|(namespace, _)| self.namespaces.matches(namespace, ns_sel))
            .flat_map(|(_, run)| &self.pods[run.clone()])
            .filter(|pod| pod_sel.matches(pod.labels))
            .collect()
    }
}

/// Insert `entries` into `map` (later ones win), as one bulk build when it is empty.
fn bulk_insert<K: Ord, V>(map: &mut BTreeMap<K, V>, entries: Vec<(K, V)>) {
    if map.is_empty() {
        *map = BTreeMap::from_iter(entries);
    } else {
        map.extend(entries);
    }
}

/// Set each of `pods`' place ([`PodInfo::at`]) and find each namespace's run, if they
/// are sorted by namespace and name, as the Kubernetes source hands them over (`None`:
/// they are not, sort them first). One pass, each pod's name read once: at 100,000 pods
/// loading the names is most of its cost.
fn places<'a>(pods: &mut [PodInfo<'a>]) -> Option<Vec<(&'a str, Range<usize>)>> {
    let mut runs: Vec<(&'a str, Range<usize>)> = Vec::new();
    for i in 0..pods.len() {
        let namespace = pods[i].namespace;
        match runs.last_mut() {
            // Pods of one namespace share its name ([`crate::source::intern`]).
            Some((ns, run)) if std::ptr::eq(*ns, namespace) || *ns == namespace => {
                run.end = i + 1;
                let before = pods[i - 1].at;
                pods[i].at = match pods[i - 1].name.cmp(pods[i].name) {
                    Ordering::Less => i,
                    Ordering::Equal => before,
                    Ordering::Greater => return None,
                };
            }
            Some((ns, _)) if *ns > namespace => return None,
            _ => {
                runs.push((namespace, i..i + 1));
                pods[i].at = i;
            }
        }
    }
    Some(runs)
}

/// Every address of `pods` with the index of its pod, sorted by address, then index.
/// Sorted by integer keys (the family, the address's bits), cheaper to compare than
/// `IpAddr`s (whose sort was a tenth of the compile at 100,000 pods).
fn addresses(pods: &[PodInfo<'_>]) -> Vec<(IpAddr, usize)> {
    let mut keyed: Vec<(bool, u128, usize)> = pods
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            p.ips.iter().map(move |ip| match ip {
                IpAddr::V4(a) => (false, u128::from(a.to_bits()), i),
                IpAddr::V6(a) => (true, a.to_bits(), i),
            })
        })
        .collect();
    keyed.sort_unstable();
    keyed
        .into_iter()
        .map(|(v6, bits, i)| {
            let ip = if v6 {
                IpAddr::V6(std::net::Ipv6Addr::from_bits(bits))
            } else {
                IpAddr::V4(std::net::Ipv4Addr::from_bits(bits as u32))
            };
            (ip, i)
        })
        .collect()
}

/// The pods of one node whose addresses lie outside the given CIDRs.
pub(super) struct Outside<'a> {
    pub(super) node: &'a str,
    pub(super) pods: usize,
    /// The first of them (`namespace/name`) and its first address outside.
    pub(super) example: String,
    pub(super) ip: IpAddr,
}

impl<'a> Pods<'a> {
    /// The pods with an address that none of `cidrs` holds, by node (sorted by name).
    pub(super) fn outside(&self, cidrs: &[IpNet]) -> Vec<Outside<'a>> {
        let mut by_node: BTreeMap<&'a str, Outside<'a>> = BTreeMap::new();
        for pod in &self.pods {
            let Some(ip) = pod
                .ips
                .iter()
                .find(|ip| !cidrs.iter().any(|c| c.contains(*ip)))
            else {
                continue;
            };
            by_node
                .entry(pod.node)
                .or_insert_with(|| Outside {
                    node: pod.node,
                    pods: 0,
                    example: format!("{}/{}", pod.namespace, pod.name),
                    ip: *ip,
                })
                .pods += 1;
        }
        by_node.into_values().collect()
    }

    /// Pods whose addresses no declared cluster CIDR and no node's pod CIDR holds, one
    /// problem per node: a worker that watches only its own node's pods
    /// ([`members::needed`]) does not carve them out of the destinations, as a view of every
    /// pod does. Only a view of every pod sees them, and only declared CIDRs make workers
    /// watch less.
    pub(super) fn report_outside_cidrs(
        &self,
        view: &ClusterView,
        nodes: &[NodeInfo<'_>],
        problems: &mut Vec<Problem>,
    ) {
        if view.pod_scope != PodScope::Cluster || view.cluster_cidrs.is_empty() {
            return;
        }
        let cidrs = pod_cidrs(view, nodes);
        let declared: Vec<String> = view.cluster_cidrs.iter().map(ToString::to_string).collect();
        for outside in self.outside(&cidrs) {
            problems.push(Problem {
                object: Object::Node(outside.node.to_owned()),
                reason: reason::POD_OUTSIDE_CLUSTER_CIDRS.to_owned(),
                message: format!(
                    "{} pods of this node have addresses outside the cluster's CIDRs ({}) and \
                     every node's pod CIDRs, such as pod {} at {}: the agents that watch only \
                     their own node's pods do not carve these addresses out of the policies' \
                     destinations, so their pods' traffic to them may be steered to a gateway; \
                     add the range to --cluster-cidr",
                    outside.pods,
                    declared.join(", "),
                    outside.example,
                    outside.ip
                ),
            });
        }
    }
}

/// The addresses listed by more than one of `pods`, or by a pod and a node (`nodes`);
/// `listed`: every (address, pod index) of `pods`, sorted.
fn disputed(
    pods: &[PodInfo<'_>],
    listed: &[(IpAddr, usize)],
    nodes: &BTreeMap<IpAddr, String>,
) -> Vec<Disputed> {
    // Both sorted: a node's address is met walking along.
    let mut node_ips = nodes.iter().peekable();
    listed
        .chunk_by(|a, b| a.0 == b.0)
        .filter_map(|by_ip| {
            let ip = by_ip[0].0;
            while node_ips.next_if(|(n, _)| **n < ip).is_some() {}
            let node = node_ips
                .next_if(|(n, _)| **n == ip)
                .map(|(_, name)| name.clone());
            if by_ip.len() == 1 && node.is_none() {
                return None;
            }
            let mut claimants: Vec<&PodInfo<'_>> = by_ip.iter().map(|(_, i)| &pods[*i]).collect();
            claimants.dedup_by(|a, b| (a.namespace, a.name) == (b.namespace, b.name));
            (claimants.len() > 1 || node.is_some()).then(|| Disputed {
                ip,
                pods: claimants
                    .iter()
                    .map(|p| format!("{}/{}", p.namespace, p.name))
                    .collect(),
                node,
            })
        })
        .collect()
}
