//! Placement: each policy checked and resolved into a plan (its selectors, its eligible
//! gateways, each rule's target: the holder of its egress IP, or the gateways serving its
//! interface).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::{
    DRAIN_ANNOTATION, Selector, hash, move_reason,
    nodes::NodeInfo,
    reason,
    rules::{self, CheckedRule},
    status::PolicyReport,
};
use crate::{
    api::{EgressGatewayPolicy, FailurePolicy},
    liveness::PeerView,
};

/// A policy checked and resolved.
pub(super) struct PolicyPlan<'a> {
    pub(super) name: String,
    pub(super) policy: &'a EgressGatewayPolicy,
    /// (namespace, pod) selectors, when both are valid.
    pub(super) selectors: Option<(Selector, Selector)>,
    pub(super) failure_policy: FailurePolicy,
    pub(super) rules: Vec<RulePlan>,
    /// Its conditions, as far as they are known.
    pub(super) report: PolicyReport,
}

/// A rule checked and resolved.
pub(super) struct RulePlan {
    pub(super) index: usize,
    pub(super) rule_id: u32,
    /// Destination and except prefixes that parsed (one family unless the rule is
    /// invalid); each applies to the pod addresses of its family.
    pub(super) destinations: Vec<IpNet>,
    pub(super) except: Vec<IpNet>,
    pub(super) target: Target,
}

pub(super) enum Target {
    /// A dedicated egress IP and its holder.
    Dedicated {
        ip: IpAddr,
        holder: Option<GatewayAddr>,
    },
    /// An interface rule and the gateways serving it, by node name.
    Interface {
        gateways: BTreeMap<String, GatewayAddr>,
    },
    /// No gateway at all (invalid, unhostable, ...): the failure policy applies.
    None,
}

/// One gateway's address serving a rule.
#[derive(Clone, Debug)]
pub(super) struct GatewayAddr {
    pub(super) node: String,
    pub(super) underlay: IpAddr,
    pub(super) interface: String,
    pub(super) ip: IpAddr,
    pub(super) prefix_len: u8,
    /// The holding (dedicated addresses): its epoch, why, and since when (as published).
    pub(super) epoch: u64,
    pub(super) reason: &'static str,
    pub(super) since: Option<String>,
}

impl GatewayAddr {
    fn new(node: &NodeInfo<'_>, underlay: IpAddr, interface: &str, ip: IpAddr, len: u8) -> Self {
        Self {
            node: node.name.to_owned(),
            underlay,
            interface: interface.to_owned(),
            ip,
            prefix_len: len,
            epoch: 0,
            reason: move_reason::ASSIGNED,
            since: None,
        }
    }
}

impl RulePlan {
    /// The gateway serving pod address `ip` under this rule: the holder of its egress IP,
    /// or the rendezvous winner among the gateways of its interface (per pod address and
    /// rule, so pods spread and each stays put while its gateway lives).
    pub(super) fn gateway_for(&self, ip: IpAddr) -> Option<&GatewayAddr> {
        match &self.target {
            Target::Dedicated {
                holder: Some(h), ..
            } => Some(h),
            Target::Interface { gateways } => {
                let rule_id = self.rule_id.to_be_bytes();
                let octets = ip_bytes(ip);
                hash::rendezvous(&[&octets, &rule_id], gateways.keys().map(String::as_str))
                    .and_then(|node| gateways.get(node))
            }
            _ => None,
        }
    }

    /// Every gateway address serving this rule (with `true` for a shared one: an
    /// interface's own address).
    pub(super) fn served(&self) -> Vec<(&GatewayAddr, bool)> {
        match &self.target {
            Target::Dedicated {
                holder: Some(h), ..
            } => vec![(h, false)],
            Target::Interface { gateways } => gateways.values().map(|g| (g, true)).collect(),
            _ => Vec::new(),
        }
    }
}

/// Plan every policy (sorted by name). The first policy (in name order) that can place an
/// egress IP decides where it lives; later users must agree.
pub(super) fn plan<'a>(
    policies: &[&'a EgressGatewayPolicy],
    nodes: &[NodeInfo<'_>],
    peers: &PeerView,
) -> Vec<PolicyPlan<'a>> {
    let ids = hash::rule_ids(policies.iter().flat_map(|p| {
        let name = p.metadata.name.as_deref().unwrap_or_default();
        (0..p.spec.rules.len()).map(move |i| (name, i))
    }));
    let mut placed = Placed::new();
    policies
        .iter()
        .map(|policy| {
            let name = policy.metadata.name.clone().unwrap_or_default();
            let ids: Vec<u32> = (0..policy.spec.rules.len())
                .map(|i| ids.get(&(name.clone(), i)).copied().unwrap_or(0))
                .collect();
            plan_policy(policy, &ids, nodes, peers, &mut placed)
        })
        .collect()
}

/// Egress IP -> (holder, deciding policy).
type Placed = BTreeMap<IpAddr, (GatewayAddr, String)>;

fn plan_policy<'a>(
    policy: &'a EgressGatewayPolicy,
    ids: &[u32],
    nodes: &[NodeInfo<'_>],
    peers: &PeerView,
    placed: &mut Placed,
) -> PolicyPlan<'a> {
    let name = policy.metadata.name.clone().unwrap_or_default();
    let spec = &policy.spec;
    let mut report = PolicyReport::default();
    let mut selector = |sel: Option<&LabelSelector>, field: &str| match sel {
        None => Some(Selector::everything()),
        Some(sel) => match Selector::new(sel, field) {
            Ok(s) => Some(s),
            Err(message) => {
                report.invalid(reason::INVALID_SELECTOR, message);
                None
            }
        },
    };
    let ns_sel = selector(spec.namespace_selector.as_ref(), "spec.namespaceSelector");
    let pod_sel = selector(spec.pod_selector.as_ref(), "spec.podSelector");
    let gw_sel = selector(Some(&spec.gateway_selector), "spec.gatewaySelector");
    if spec.rules.is_empty() {
        report.invalid(
            reason::NO_RULES,
            "spec.rules: at least one rule is required".to_owned(),
        );
    }
    let gateways = gw_sel
        .map(|sel| Gateways::select(&sel, nodes, &mut report))
        .unwrap_or_default();
    let rules = spec
        .rules
        .iter()
        .enumerate()
        .map(|(index, rule)| {
            let checked = rules::check_rule(index, rule, &mut report);
            let mut plan = RulePlan {
                index,
                rule_id: ids.get(index).copied().unwrap_or(0),
                destinations: Vec::new(),
                except: Vec::new(),
                target: Target::None,
            };
            if let Some(checked) = checked {
                plan.target = target(
                    &name,
                    index,
                    &checked,
                    &gateways,
                    nodes,
                    peers,
                    placed,
                    &mut report,
                );
                plan.destinations = checked.destinations;
                plan.except = checked.except;
            }
            plan
        })
        .collect();
    PolicyPlan {
        name,
        policy,
        selectors: ns_sel.zip(pod_sel),
        failure_policy: spec.failure_policy,
        rules,
        report,
    }
}

/// The nodes a policy's gatewaySelector matches, and those of them that are eligible.
#[derive(Default)]
struct Gateways<'n, 'a> {
    eligible: Vec<&'n NodeInfo<'a>>,
    selected: BTreeSet<&'a str>,
}

impl<'n, 'a> Gateways<'n, 'a> {
    /// Eligible: Ready, heard by the probes, not drained, with an EgressNode and an
    /// underlay address. Says why none is, when none is.
    fn select(sel: &Selector, nodes: &'n [NodeInfo<'a>], report: &mut PolicyReport) -> Self {
        let candidates: Vec<&NodeInfo<'_>> =
            nodes.iter().filter(|n| sel.matches(&n.labels)).collect();
        let mut out = Self {
            eligible: Vec::new(),
            selected: candidates.iter().map(|n| n.name).collect(),
        };
        let mut why_not = Vec::new();
        for node in candidates {
            if !node.ready {
                why_not.push(format!("{} is not Ready", node.name));
            } else if node.dead {
                why_not.push(format!(
                    "{} is unreachable (no probe heard within the detection time)",
                    node.name
                ));
            } else if node.drained {
                why_not.push(format!(
                    "{} is drained ({DRAIN_ANNOTATION} or cordoned)",
                    node.name
                ));
            } else if node.egress.is_none() {
                why_not.push(format!(
                    "{} has no EgressNode (is its agent running?)",
                    node.name
                ));
            } else if node.underlay.is_none() {
                why_not.push(format!("{} has no InternalIP address", node.name));
            } else {
                out.eligible.push(node);
            }
        }
        if out.selected.is_empty() {
            report.unready(
                reason::NO_MATCHING_GATEWAY,
                "spec.gatewaySelector: matches no node".to_owned(),
            );
        } else if out.eligible.is_empty() {
            report.unready(
                reason::NO_ELIGIBLE_GATEWAY,
                format!(
                    "spec.gatewaySelector: no selected node is eligible: {}",
                    why_not.join(", ")
                ),
            );
        }
        out
    }

    fn names(&self) -> String {
        self.eligible
            .iter()
            .map(|n| n.name)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Where a checked rule's traffic goes.
#[expect(
    clippy::too_many_arguments,
    reason = "the placement context of one rule; a struct for it would be used once"
)]
fn target(
    policy: &str,
    index: usize,
    checked: &CheckedRule,
    gateways: &Gateways<'_, '_>,
    nodes: &[NodeInfo<'_>],
    peers: &PeerView,
    placed: &mut Placed,
    report: &mut PolicyReport,
) -> Target {
    if !checked.valid {
        return Target::None;
    }
    match (checked.egress_ip, checked.interface.as_deref()) {
        (Some(ip), None) => Target::Dedicated {
            ip,
            holder: place_egress_ip(policy, index, ip, gateways, nodes, peers, placed, report),
        },
        (None, Some(interface)) => {
            interface_gateways(index, interface, checked.v6, gateways, report)
                .map_or(Target::None, |gateways| Target::Interface { gateways })
        }
        _ => Target::None,
    }
}

/// The holder of a rule's dedicated egress IP `ip`, if it has one.
#[expect(
    clippy::too_many_arguments,
    reason = "the placement context of one rule; a struct for it would be used once"
)]
fn place_egress_ip(
    policy: &str,
    index: usize,
    ip: IpAddr,
    gateways: &Gateways<'_, '_>,
    nodes: &[NodeInfo<'_>],
    peers: &PeerView,
    placed: &mut Placed,
    report: &mut PolicyReport,
) -> Option<GatewayAddr> {
    if let Some((node, how)) = nodes.iter().find_map(|n| {
        n.own_addresses
            .iter()
            .find(|(a, _)| *a == ip)
            .map(|(_, how)| (n.name, how))
    }) {
        report.unready(
            reason::EGRESS_IP_IS_NODE_ADDRESS,
            format!(
                "rules[{index}].egressIP: {ip} is an address of node {node} ({how}); use a \
                 free address of that subnet, or `interface:` to SNAT to the gateways' own \
                 addresses"
            ),
        );
        return None;
    }
    if gateways.eligible.is_empty() {
        // Said once for the policy (spec.gatewaySelector).
        return None;
    }
    let hosts: Vec<GatewayAddr> = gateways
        .eligible
        .iter()
        .filter_map(|n| {
            let (iface, prefix_len) = n.egress.as_ref()?.hosting_interface(ip)?;
            Some(GatewayAddr::new(n, n.underlay?, iface, ip, prefix_len))
        })
        .collect();
    if let Some((placed_at, decider)) = placed.get(&ip) {
        let agreed = hosts
            .iter()
            .any(|h| h.node == placed_at.node)
            .then(|| placed_at.clone());
        if agreed.is_none() {
            report.unready(
                reason::EGRESS_IP_IN_USE,
                format!(
                    "rules[{index}].egressIP: {ip} is held by {} for policy {decider}, which \
                     is not an eligible gateway here",
                    placed_at.node
                ),
            );
        }
        return agreed;
    }
    if hosts.is_empty() {
        report.unready(
            reason::EGRESS_IP_NOT_HOSTABLE,
            format!(
                "rules[{index}].egressIP: {ip} is in no subnet of an up interface of any \
                 eligible gateway ({})",
                gateways.names()
            ),
        );
        return None;
    }
    let chosen = choose_holder(
        ip,
        &hosts,
        nodes,
        &gateways.selected,
        peers.last_claims.get(&ip),
    );
    if let Some(h) = &chosen {
        placed.insert(ip, (h.clone(), policy.to_owned()));
    }
    chosen
}

/// The eligible gateways with an up `interface` that has an address of the rule's
/// family, by node name; `None` (and a condition) when there is none.
fn interface_gateways(
    index: usize,
    interface: &str,
    v6: bool,
    gateways: &Gateways<'_, '_>,
    report: &mut PolicyReport,
) -> Option<BTreeMap<String, GatewayAddr>> {
    let serving: BTreeMap<String, GatewayAddr> = gateways
        .eligible
        .iter()
        .filter_map(|n| {
            let (ip, prefix_len) = n.egress.as_ref()?.own_address(interface, v6)?;
            Some((
                n.name.to_owned(),
                GatewayAddr::new(n, n.underlay?, interface, ip, prefix_len),
            ))
        })
        .collect();
    if gateways.eligible.is_empty() {
        // Said once for the policy (spec.gatewaySelector).
        return None;
    }
    if serving.is_empty() {
        report.unready(
            reason::INTERFACE_NOT_FOUND,
            format!(
                "rules[{index}].interface: no eligible gateway ({}) has an up interface \
                 {interface} with {} address",
                gateways.names(),
                if v6 { "a global IPv6" } else { "an IPv4" }
            ),
        );
        return None;
    }
    Some(serving)
}

/// Address bytes as hashed by rendezvous (4 for IPv4, 16 for IPv6).
fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(ip) => ip.octets().to_vec(),
        IpAddr::V6(ip) => ip.octets().to_vec(),
    }
}

/// The holder of dedicated egress IP `ip` among `hosts` (all eligible; `selected`: the
/// nodes the policy's gatewaySelector matches; `heard`: the newest claim heard in a
/// hello, perhaps released since). Sticky: a host holding the newest claim keeps it (a
/// holder back from the dead has an older one). Otherwise a host that claims it anyway
/// (the largest epoch first), else the rendezvous winner, takes it with the newest epoch
/// + 1, and the reason says why the last claimant lost it.
fn choose_holder(
    ip: IpAddr,
    hosts: &[GatewayAddr],
    nodes: &[NodeInfo<'_>],
    selected: &BTreeSet<&str>,
    heard: Option<&(String, u64)>,
) -> Option<GatewayAddr> {
    let octets = ip_bytes(ip);
    let node_info = |name: &str| nodes.iter().find(|n| n.name == name);
    let claim =
        |name: &str| node_info(name).and_then(|n| n.egress.as_ref()?.held.get(&ip).copied());
    // The last claimant, wherever it is: the newest claim published, or heard.
    let published = nodes
        .iter()
        .filter_map(|n| Some((n.egress.as_ref()?.held.get(&ip).copied()?, n)))
        .max_by(|(a, na), (b, nb)| a.cmp(b).then(nb.name.cmp(na.name)));
    let heard = heard.and_then(|(name, e)| Some((*e, node_info(name)?)));
    let last = match (published, heard) {
        (Some(p), Some(h)) if h.0 > p.0 => Some(h),
        (p @ Some(_), _) => p,
        (None, h) => h,
    };
    let newest = last.map(|(e, _)| e);
    let claimants: Vec<(&GatewayAddr, u64)> = hosts
        .iter()
        .filter_map(|h| Some((h, claim(&h.node)?)))
        .collect();
    let pool: Vec<&GatewayAddr> = match claimants.iter().map(|(_, e)| *e).max() {
        Some(top) => claimants
            .iter()
            .filter(|(_, e)| *e == top)
            .map(|(h, _)| *h)
            .collect(),
        None => hosts.iter().collect(),
    };
    let node = hash::rendezvous(&[&octets], pool.iter().map(|h| h.node.as_str()))?;
    let mut g = pool.into_iter().find(|h| h.node == node)?.clone();
    let kept = claim(node);
    if kept.is_some() && kept == newest {
        // Sticky: it holds the newest claim.
        g.epoch = kept.unwrap_or_default();
        let published =
            node_info(node).and_then(|n| n.egress.as_ref()?.held_meta.get(&ip).cloned());
        if let Some((epoch, since, why)) = published
            && Some(epoch) == kept
        {
            g.since = since;
            g.reason = why
                .as_deref()
                .and_then(move_reason::parse)
                .unwrap_or(move_reason::ASSIGNED);
        }
        return Some(g);
    }
    g.epoch = newest.map_or(1, |e| e + 1);
    g.reason = match last {
        None => move_reason::ASSIGNED,
        Some((_, n)) if n.dead => move_reason::HOLDER_UNREACHABLE,
        Some((_, n)) if !n.ready => move_reason::HOLDER_NOT_READY,
        Some((_, n)) if n.drained => move_reason::HOLDER_DRAINED,
        Some((_, n)) if !selected.contains(n.name) => move_reason::HOLDER_NOT_SELECTED,
        Some((_, n))
            if n.egress
                .as_ref()
                .is_none_or(|e| e.hosting_interface(ip).is_none()) =>
        {
            move_reason::HOLDER_INTERFACE_DOWN
        }
        Some(_) => move_reason::REASSIGNED,
    };
    Some(g)
}
