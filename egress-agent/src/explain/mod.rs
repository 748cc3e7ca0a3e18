//! `egress-agent explain` (and `kubectl egress explain`): why a pod's traffic to one
//! destination leaves the way it does, in words.
//!
//! The answer comes from the view the agents compile ([`compiler::compile`], for the pod's
//! node): the pod's policy entries are what its node's datapath holds, and the longest
//! entry containing the destination is the one `from_pod` finds. [`explain`] turns that
//! into an [`Explanation`] (pure, unit-tested on crafted views), [`render`] into text;
//! [`counters`] adds what the pinned maps of the node it runs on have counted, and
//! [`cli`] loads the view (a state directory, or the Kubernetes API) for both binaries.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::{
    api::{EgressGatewayPolicy, EgressRule, FailurePolicy},
    compiler::{self, Compiled, PodRoute, Selection, condition, netpol},
    desired::{Desired, Family, PolicyAction, PortSet},
    source::{ClusterView, PodSummary},
};

pub mod cli;
pub mod counters;
mod query;
pub mod render;
#[cfg(test)]
mod tests;

pub use query::{Destination, PodRef, Proto};

/// Errors of `explain`: each names what the user must fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("failed to parse --pod {text:?}: expected NAMESPACE/NAME, such as shop/api-1")]
    BadPod { text: String },
    #[error(
        "failed to parse --to {text:?}: {detail}; expected ADDR[:PORT][/PROTO], such as \
         192.0.2.7:443/tcp or [2001:db8::7]:53/udp"
    )]
    BadTo { text: String, detail: String },
    #[error("failed to read state directory {}: it is not a directory", dir.display())]
    StateDir { dir: std::path::PathBuf },
    #[error(transparent)]
    Kube(#[from] crate::source::kube::Error),
    #[error(
        "failed to list the cluster within {secs} s: is the API server reachable, and may \
         this user list pods, namespaces, nodes, networkpolicies, egressgatewaypolicies and \
         egressnodes (are the CRDs installed)? (--timeout-secs)"
    )]
    ListTimeout { secs: u64 },
    #[error("failed to find pod {pod}: no such pod in the view{}", elsewhere_text(.elsewhere))]
    UnknownPod {
        pod: PodRef,
        /// Namespaces that have a pod of that name.
        elsewhere: Vec<String>,
    },
}

fn elsewhere_text(namespaces: &[String]) -> String {
    if namespaces.is_empty() {
        " (check the namespace and the name)".to_owned()
    } else {
        format!(
            " (a pod of that name is in namespace {}: did you mean {}?)",
            namespaces.join(", "),
            namespaces
                .iter()
                .map(|ns| format!("--pod {ns}/..."))
                .collect::<Vec<_>>()
                .join(" or ")
        )
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a pod's traffic to a destination goes where it goes.
#[derive(Clone, Debug, PartialEq)]
pub struct Explanation {
    pub pod: PodRef,
    pub destination: Destination,
    /// The pod's node (`spec.nodeName`), whose datapath sees its packets first.
    pub node: Option<String>,
    /// That node's underlay address, when the view knows it.
    pub node_ip: Option<IpAddr>,
    /// The pod's address of the destination's family.
    pub pod_ip: Option<IpAddr>,
    pub outcome: Outcome,
}

/// What happens to the pod's packets to the destination.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The datapath does not steer this pod at all.
    NotSteered(NotSteered),
    /// A policy entry of the pod matched the destination.
    Matched(Box<Match>),
    /// No entry matched: the packets leave untouched (the node's routing, the pod's own
    /// address, as the CNI sends them); why, for every policy.
    Untouched(Vec<Miss>),
}

/// Why a pod is not steered, whatever the policies say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotSteered {
    /// No `spec.nodeName`.
    NotScheduled,
    /// `spec.hostNetwork: true`: its packets are the node's.
    HostNetwork,
    /// Its `status.phase` is not `Running`.
    NotRunning,
    /// It has no address of the destination's family.
    NoAddressOfFamily {
        family: &'static str,
        ips: Vec<IpAddr>,
    },
}

/// The policy entry that matched, and what it does.
#[derive(Clone, Debug, PartialEq)]
pub struct Match {
    pub policy: String,
    /// Index of the rule in the policy.
    pub rule: usize,
    /// The id the entry carries (the rule's, or an `egressIPs` address's own).
    pub rule_id: u32,
    /// The entry's prefix: the longest of the pod's entries containing the destination.
    pub prefix: IpNet,
    /// Where the prefix comes from in the rule.
    pub origin: Origin,
    /// The pod address's entries, of every prefix.
    pub entries: usize,
    pub action: PolicyAction,
    /// What the rule names as its address.
    pub target: Target,
    /// The gateway the packets go to (forwarded entries only).
    pub gateway: Option<Hop>,
    /// The egress address they leave with (when known, also without a gateway).
    pub egress_ip: Option<IpAddr>,
    pub failure_policy: FailurePolicy,
    pub network_policy: NetworkPolicyVerdict,
    /// The policy's conditions that are not as they should be (`Ready=False`,
    /// `Conflict=True`, ...): type, status, reason, message.
    pub conditions: Vec<Condition>,
    /// Where the policy's status (as the agents wrote it) puts the egress IP, when that is
    /// another gateway than this compile's: the agents probe the gateways, `explain` takes
    /// every gateway with an EgressNode as alive. Node, and why it is there.
    pub status_holder: Option<(String, Option<String>)>,
}

/// A condition of a policy status: type, status, reason, message.
pub type Condition = (String, String, String, String);

/// Where a matched prefix comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// One of the rule's `destinations` (the longest containing the destination).
    Listed(IpNet),
    /// One of the rule's `except` prefixes.
    Except(IpNet),
    /// Learned from the gateway's routes (`destinationsFrom: Routes`).
    Learned,
    /// The cluster's own addresses, carved out of the rule's destinations.
    Cluster,
}

/// What a rule names as its address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    EgressIp(IpAddr),
    /// `egressIPs`, as written: each pod leaves by the one it hashes to.
    EgressIps(Vec<IpAddr>),
    /// `interface`: each gateway's own address there.
    Interface(String),
}

/// A gateway hop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hop {
    pub node: String,
    pub underlay: Option<IpAddr>,
    /// The interface the packets leave by there.
    pub interface: Option<String>,
    /// The gateway is the pod's own node (no tunnel).
    pub local: bool,
}

/// What the pod's egress NetworkPolicies say about the destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NetworkPolicyVerdict {
    /// The datapath leaves these packets to the host, where the CNI applies
    /// NetworkPolicy as for any other packet.
    LeftToCni,
    /// No NetworkPolicy selects the pod for `Egress`.
    NotRestricted,
    /// Allowed on every port and protocol (`by`: the policies isolating the pod).
    Allowed { by: Vec<String> },
    /// Allowed on these ports only; `asked`: whether the destination's port and protocol
    /// are among them (none when neither was given).
    Ports {
        by: Vec<String>,
        ports: PortSet,
        asked: Option<bool>,
    },
    /// Nothing toward the destination is allowed: dropped (`DROP_NETWORK_POLICY`).
    Denied { by: Vec<String> },
}

impl NetworkPolicyVerdict {
    /// Whether it drops the asked packet.
    pub fn drops(&self) -> bool {
        matches!(
            self,
            Self::Denied { .. }
                | Self::Ports {
                    asked: Some(false),
                    ..
                }
        )
    }
}

/// Why one policy does not take the pod's traffic to the destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Miss {
    /// Not accepted (and never accepted before): nothing of it is served.
    NotAccepted {
        policy: String,
        reason: String,
        message: String,
    },
    /// Its `namespaceSelector` does not select the pod's namespace.
    NamespaceNotSelected { policy: String },
    /// Its `podSelector` does not select the pod.
    PodNotSelected { policy: String },
    /// It selects the pod, but none of its prefixes for the pod contains the destination.
    NotCovered {
        policy: String,
        /// The prefixes it redirects for the pod's address (forwarded ones).
        prefixes: Vec<IpNet>,
    },
    /// It selects the pod, but has no entry for the pod's address of this family (its
    /// destinations are of the other family, none was learned, or another policy took
    /// them: `conflicts`).
    NoEntries {
        policy: String,
        conflicts: Vec<String>,
    },
}

/// Explain `pod`'s traffic to `to` in `view`, as the pod's node compiles it.
pub fn explain(view: &ClusterView, pod: &PodRef, to: Destination) -> Result<Explanation> {
    let summary = find_pod(view, pod)?;
    let mut explanation = Explanation {
        pod: pod.clone(),
        destination: to,
        node: summary.node_name.as_deref().map(str::to_owned),
        node_ip: None,
        pod_ip: summary
            .ips
            .iter()
            .copied()
            .find(|ip| ip.is_ipv6() == to.ip.is_ipv6()),
        outcome: Outcome::Untouched(Vec::new()),
    };
    let not_steered = if summary.node_name.is_none() {
        Some(NotSteered::NotScheduled)
    } else if summary.host_network {
        Some(NotSteered::HostNetwork)
    } else if !summary.running {
        Some(NotSteered::NotRunning)
    } else if explanation.pod_ip.is_none() {
        Some(NotSteered::NoAddressOfFamily {
            family: if to.ip.is_ipv6() { "IPv6" } else { "IPv4" },
            ips: summary.ips.clone(),
        })
    } else {
        None
    };
    let (Some(node), Some(pod_ip), None) = (&explanation.node, explanation.pod_ip, &not_steered)
    else {
        explanation.outcome = Outcome::NotSteered(not_steered.unwrap_or(NotSteered::NotRunning));
        return Ok(explanation);
    };
    let compiled = compiler::compile(view, node);
    explanation.node_ip = compiled.desired.node_ip;
    let entries = entries_of(&compiled.desired, pod_ip);
    let hit = entries
        .iter()
        .filter(|e| e.prefix.contains(&to.ip))
        .max_by_key(|e| e.prefix.prefix_len());
    explanation.outcome = match hit {
        Some(hit) => Outcome::Matched(Box::new(matched(
            view, &compiled, summary, pod_ip, to, hit, &entries,
        ))),
        None => Outcome::Untouched(misses(view, &compiled, summary, pod_ip, &entries)),
    };
    Ok(explanation)
}

/// The pod, or an error naming the namespaces that have a pod of that name.
fn find_pod<'v>(view: &'v ClusterView, pod: &PodRef) -> Result<&'v PodSummary> {
    view.pods
        .iter()
        .find(|p| *p.namespace == *pod.namespace && p.name == pod.name)
        .map(|p| &**p)
        .ok_or_else(|| {
            let mut elsewhere: Vec<String> = view
                .pods
                .iter()
                .filter(|p| p.name == pod.name)
                .map(|p| p.namespace.to_string())
                .collect();
            elsewhere.sort();
            elsewhere.dedup();
            Error::UnknownPod {
                pod: pod.clone(),
                elsewhere,
            }
        })
}

/// One policy entry of the pod's address, of either family.
#[derive(Clone, Debug)]
struct Entry {
    prefix: IpNet,
    action: PolicyAction,
    gateway: Option<IpAddr>,
    egress_ip: Option<IpAddr>,
    rule_id: u32,
    filter: u16,
}

/// The policy entries of pod address `ip` on its node.
fn entries_of(desired: &Desired, ip: IpAddr) -> Vec<Entry> {
    fn of<F: Family>(desired: &Desired, pod: F::Addr) -> Vec<Entry> {
        F::part(desired)
            .policy
            .iter()
            .filter(|((p, _), _)| *p == pod)
            .map(|((_, net), e)| Entry {
                prefix: (*net).into(),
                action: e.action,
                gateway: e.gateway,
                egress_ip: e.egress_ip.map(Into::into),
                rule_id: e.rule_id,
                filter: e.filter,
            })
            .collect()
    }
    crate::by_family!(ip, |a: F| of::<F>(desired, a))
}

/// The route (policy, rule) of the pod address that an entry's id belongs to.
fn route_of(compiled: &Compiled, pod_ip: IpAddr, id: u32) -> Option<&PodRoute> {
    let mine = || compiled.pod_routes.iter().filter(|r| r.pod_ip == pod_ip);
    mine()
        .find(|r| r.wire_id == id)
        .or_else(|| mine().find(|r| r.rule_id == id))
}

/// The accepted spec of policy `name` (what the compiler serves).
fn accepted<'c>(compiled: &'c Compiled, name: &str) -> Option<&'c EgressGatewayPolicy> {
    compiled.accepted.get(name)
}

fn matched(
    view: &ClusterView,
    compiled: &Compiled,
    pod: &PodSummary,
    pod_ip: IpAddr,
    to: Destination,
    hit: &Entry,
    entries: &[Entry],
) -> Match {
    let route = route_of(compiled, pod_ip, hit.rule_id);
    let policy = route.map(|r| r.policy.clone()).unwrap_or_default();
    let rule_index = route.map_or(0, |r| r.rule);
    let spec = accepted(compiled, &policy);
    let rule = spec.and_then(|p| p.spec.rules.get(rule_index));
    let gateway = match (hit.action, route.and_then(|r| r.gateway.clone())) {
        (PolicyAction::Forward, Some(node)) => Some(Hop {
            interface: compiled
                .holders
                .iter()
                .find(|h| {
                    h.policy == policy
                        && h.rule == rule_index
                        && h.node == node
                        && Some(h.ip) == hit.egress_ip
                })
                .map(|h| h.interface.clone()),
            local: pod.node_name.as_deref() == Some(node.as_str()),
            underlay: hit.gateway,
            node,
        }),
        _ => None,
    };
    let network_policy = match hit.action {
        PolicyAction::Forward | PolicyAction::Deny => verdict(view, compiled, pod, to, hit),
        _ => NetworkPolicyVerdict::LeftToCni,
    };
    let status_holder = status_holder(view, &policy, hit.egress_ip, gateway.as_ref());
    Match {
        status_holder,
        rule: rule_index,
        rule_id: hit.rule_id,
        prefix: hit.prefix,
        origin: origin(rule, hit, to.ip),
        entries: entries.len(),
        action: hit.action,
        target: rule.map_or(Target::Interface(String::new()), target),
        gateway,
        egress_ip: hit.egress_ip,
        failure_policy: spec.map_or_else(FailurePolicy::default, |p| p.spec.failure_policy),
        network_policy,
        conditions: troubles(compiled, &policy),
        policy,
    }
}

/// The holder of `egress_ip` in policy `name`'s status, when it is not `gateway`.
fn status_holder(
    view: &ClusterView,
    name: &str,
    egress_ip: Option<IpAddr>,
    gateway: Option<&Hop>,
) -> Option<(String, Option<String>)> {
    let ip = egress_ip?;
    let listed = view
        .policies
        .iter()
        .filter(|p| p.metadata.name.as_deref() == Some(name))
        .filter_map(|p| p.status.as_ref())
        .flat_map(|s| &s.egress_ips)
        .find(|e| e.ip.parse::<IpAddr>().ok() == Some(ip))?;
    (gateway.map(|g| g.node.as_str()) != Some(listed.node.as_str()))
        .then(|| (listed.node.clone(), listed.reason.clone()))
}

/// Where the matched prefix comes from in `rule`.
fn origin(rule: Option<&EgressRule>, hit: &Entry, dst: IpAddr) -> Origin {
    let longest = |prefixes: &[String]| {
        prefixes
            .iter()
            .filter_map(|p| p.parse::<IpNet>().ok())
            .filter(|p| p.contains(&dst))
            .max_by_key(IpNet::prefix_len)
    };
    let Some(rule) = rule else {
        return Origin::Learned;
    };
    if hit.action == PolicyAction::Exclude {
        return match longest(&rule.except) {
            Some(p) => Origin::Except(p),
            None => Origin::Cluster,
        };
    }
    match longest(&rule.destinations) {
        Some(p) => Origin::Listed(p),
        None => Origin::Learned,
    }
}

fn target(rule: &EgressRule) -> Target {
    if let Some(name) = &rule.interface {
        return Target::Interface(name.clone());
    }
    let ips: Vec<IpAddr> = rule.dedicated_ips().collect();
    match ips.as_slice() {
        [one] if rule.egress_ips.is_empty() => Target::EgressIp(*one),
        _ => Target::EgressIps(ips),
    }
}

/// The conditions of policy `name` that want attention.
fn troubles(compiled: &Compiled, name: &str) -> Vec<Condition> {
    let Some(status) = compiled.statuses.get(name) else {
        return Vec::new();
    };
    status
        .conditions
        .iter()
        .filter(|c| {
            let healthy = matches!(c.type_.as_str(), condition::ACCEPTED | condition::READY);
            (c.status == "True") != healthy
        })
        .map(|c| {
            (
                c.type_.clone(),
                c.status.to_string(),
                c.reason.clone(),
                c.message.clone(),
            )
        })
        .collect()
}

/// What the pod's egress NetworkPolicies say about a forwarded (or denied) entry.
fn verdict(
    view: &ClusterView,
    compiled: &Compiled,
    pod: &PodSummary,
    to: Destination,
    hit: &Entry,
) -> NetworkPolicyVerdict {
    let by = netpol::isolating(view, &pod.namespace, &pod.labels);
    if hit.action == PolicyAction::Deny {
        return NetworkPolicyVerdict::Denied { by };
    }
    if by.is_empty() {
        return NetworkPolicyVerdict::NotRestricted;
    }
    if hit.filter == 0 {
        return NetworkPolicyVerdict::Allowed { by };
    }
    let ports = compiled
        .desired
        .port_filters
        .get(&hit.filter)
        .cloned()
        .unwrap_or_default();
    let asked = to.proto.map(|proto| {
        let number = proto.number(to.ip);
        ports.iter().any(|(p, first, last)| {
            *p == number && to.port.is_none_or(|port| (*first..=*last).contains(&port))
        })
    });
    NetworkPolicyVerdict::Ports { by, ports, asked }
}

/// Why no policy takes the pod's traffic to the destination: one reason per policy.
fn misses(
    view: &ClusterView,
    compiled: &Compiled,
    pod: &PodSummary,
    pod_ip: IpAddr,
    entries: &[Entry],
) -> Vec<Miss> {
    let mut names: Vec<&str> = view
        .policies
        .iter()
        .filter_map(|p| p.metadata.name.as_deref())
        .collect();
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .map(|name| {
            let policy = name.to_owned();
            let Some(spec) = accepted(compiled, name) else {
                let (reason, message) = compiled
                    .statuses
                    .get(name)
                    .and_then(|s| s.conditions.iter().find(|c| c.type_ == condition::ACCEPTED))
                    .map(|c| (c.reason.clone(), c.message.clone()))
                    .unwrap_or_default();
                return Miss::NotAccepted {
                    policy,
                    reason,
                    message,
                };
            };
            match compiler::selection(view, &spec.spec, &pod.namespace, &pod.labels) {
                Selection::NamespaceNotSelected => return Miss::NamespaceNotSelected { policy },
                Selection::PodNotSelected => return Miss::PodNotSelected { policy },
                Selection::Selected => {}
            }
            let mut prefixes: Vec<IpNet> = entries
                .iter()
                .filter(|e| e.action != PolicyAction::Exclude)
                .filter(|e| route_of(compiled, pod_ip, e.rule_id).is_some_and(|r| r.policy == name))
                .map(|e| e.prefix)
                .collect();
            prefixes.sort();
            prefixes.dedup();
            if prefixes.is_empty() {
                let conflicts = troubles(compiled, name)
                    .into_iter()
                    .filter(|c| c.0 == condition::CONFLICT)
                    .map(|c| c.3)
                    .collect();
                return Miss::NoEntries { policy, conflicts };
            }
            Miss::NotCovered { policy, prefixes }
        })
        .collect()
}
