//! The source side: which policy rule each (pod, destination prefix) pair belongs to,
//! over every pod of the cluster (so conflicts, and thus statuses, are the same on every
//! node), and the policy entries of this node's own pods.

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
};

use ipnet::IpNet;

use super::{
    plans::{Destinations, PolicyPlan, Route},
    pods::PodInfo,
    routes::{Kind, Prefixes},
};
use crate::{
    api::FailurePolicy,
    by_family,
    desired::{Desired, Family, PolicyAction, PolicyEntry},
};

/// Who claimed a (pod address, prefix) pair: policy index, rule index, and whether the
/// rule lists its destinations (a listed destination wins over the same prefix learned
/// from routes, without a conflict).
type Claims = HashMap<(IpAddr, IpNet), (usize, usize, bool)>;

/// The claiming passes, in order: listed destinations, then learned ones, then the
/// carve-outs of learned ones (which never take a pair anyone claims).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Listed,
    Learned,
    Carve,
}

/// Claim every selected (pod, prefix) pair for its rule and fill this node's entries.
/// Accepted policies claim first (in name order), so that a broken policy never takes a
/// pair from a working one; among accepted ones the smaller name wins, and within a
/// policy the earlier rule. Lost pairs are conflicts in the loser's report.
pub(super) fn claim(
    plans: &mut [PolicyPlan<'_>],
    (selected, pods): (&[Vec<&PodInfo<'_>>], usize),
    node_name: &str,
    desired: &mut Desired,
) {
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by_key(|i| (!plans[*i].report.accepted(), *i));
    let contested = contested(plans, selected, pods);
    let mut claimer = Claimer {
        plans: &*plans,
        node_name,
        claims: Claims::new(),
        contested,
        lost: Vec::new(),
        cluster: HashSet::new(),
        listed: HashMap::new(),
        admitted: Vec::new(),
    };
    for pass in [Pass::Listed, Pass::Learned, Pass::Carve] {
        for &p_idx in &order {
            for r_idx in 0..claimer.plans[p_idx].rules.len() {
                let rule = &claimer.plans[p_idx].rules[r_idx];
                if rule.learned() == (pass == Pass::Listed) {
                    continue;
                }
                let served_here = rule.served_by(node_name);
                for pod in &selected[p_idx] {
                    claimer.pod(pass, (p_idx, r_idx, served_here), pod, desired);
                }
            }
        }
    }
    let overrides = claimer.overrides();
    let admitted = std::mem::take(&mut claimer.admitted);
    if desired.admitted.is_empty() {
        desired.admitted = admitted.into_iter().collect();
    } else {
        desired.admitted.extend(admitted);
    }
    let lost = claimer.lost;
    for (p_idx, message) in lost {
        plans[p_idx].report.conflict(message);
    }
    for (p_idx, message) in overrides {
        plans[p_idx].report.overridden(message);
    }
}

/// Pod addresses whose pairs more than one rule may claim: those of pods that rules of
/// two policies select (an address is one pod's: `Pods::index` takes disputed ones
/// out), or that two rules of a policy whose rules may name one prefix twice select
/// ([`rules_disjoint`]). Every pair of the others is its one rule's.
fn contested(
    plans: &[PolicyPlan<'_>],
    selected: &[Vec<&PodInfo<'_>>],
    pods: usize,
) -> HashSet<IpAddr> {
    // The first policy with a rule that selects each pod, by its place.
    let mut first: Vec<Option<usize>> = vec![None; pods];
    let mut contested = HashSet::new();
    for (p_idx, selected) in selected.iter().enumerate() {
        let rules = plans[p_idx].rules.len();
        if rules == 0 {
            continue;
        }
        let shared = rules > 1 && !rules_disjoint(&plans[p_idx]);
        for pod in selected {
            let by = *first[pod.at].get_or_insert(p_idx);
            if by != p_idx || shared {
                contested.extend(pod.ips.iter().copied());
            }
        }
    }
    contested
}

/// Whether no prefix of `plan`'s rules, whichever gateway serves them, appears twice: in
/// two rules, or twice in one rule's list. A pod address that only this policy selects
/// then has one claimant for each of its pairs (nothing lost, nothing overridden), and
/// claiming them gives what its rules give it unclaimed.
fn rules_disjoint(plan: &PolicyPlan<'_>) -> bool {
    let mut rule_of: HashMap<IpNet, usize> = HashMap::new();
    for (r_idx, rule) in plan.rules.iter().enumerate() {
        let lists: Vec<&Prefixes> = match &rule.destinations {
            Destinations::Listed(prefixes) => vec![prefixes],
            Destinations::Learned { by_node, fallback } => {
                by_node.values().chain(std::iter::once(fallback)).collect()
            }
        };
        for list in lists {
            let mut in_list = HashSet::new();
            for (prefix, _) in &list.0 {
                if !in_list.insert(*prefix) || *rule_of.entry(*prefix).or_insert(r_idx) != r_idx {
                    return false;
                }
            }
        }
    }
    true
}

struct Claimer<'p, 'a, 'n> {
    plans: &'p [PolicyPlan<'a>],
    node_name: &'n str,
    claims: Claims,
    /// Pod addresses selected by more than one rule: the others need no claims (their
    /// one rule has every pair), which keeps the work per pass to this node's pods when
    /// rules learn thousands of routes.
    contested: HashSet<IpAddr>,
    /// (policy index, message) of each pair lost.
    lost: Vec<(usize, String)>,
    /// Claimed pairs that carve the cluster's own addresses out ([`Kind::Cluster`]).
    cluster: HashSet<(IpAddr, IpNet)>,
    /// The listed prefixes each contested pod address claimed, by whom.
    listed: HashMap<IpAddr, Vec<ListedClaim>>,
    /// (pod address, wire id) pairs this node admits, put in `Desired::admitted` at
    /// the end (at once: a gateway admits every pod it serves).
    admitted: Vec<(IpAddr, u32)>,
}

/// A listed destination or except a contested pod address claimed.
struct ListedClaim {
    prefix: IpNet,
    policy: usize,
    rule: usize,
    /// `namespace/name` of the pod.
    pod: String,
}

impl Claimer<'_, '_, '_> {
    /// Where one policy's listed prefix for a pod lies inside another policy's for the
    /// same pod: the longer one takes the pod's traffic to it (the datapath's longest
    /// prefix match), which both policies say (policy index, message).
    fn overrides(&self) -> Vec<(usize, String)> {
        let mut out = Vec::new();
        let mut ips: Vec<&IpAddr> = self.listed.keys().collect();
        ips.sort();
        for ip in ips {
            let claims = &self.listed[ip];
            let by_prefix: HashMap<IpNet, Vec<&ListedClaim>> =
                claims.iter().fold(HashMap::new(), |mut m, c| {
                    m.entry(c.prefix).or_default().push(c);
                    m
                });
            let mut lens: Vec<u8> = claims.iter().map(|c| c.prefix.prefix_len()).collect();
            lens.sort_unstable();
            lens.dedup();
            for inner in claims {
                for len in lens.iter().take_while(|l| **l < inner.prefix.prefix_len()) {
                    let Ok(outer) = IpNet::new(inner.prefix.addr(), *len) else {
                        continue;
                    };
                    let outers = by_prefix.get(&outer.trunc()).into_iter().flatten();
                    for outer in outers.filter(|o| o.policy != inner.policy) {
                        let (op, ip_) = (&self.plans[outer.policy], &self.plans[inner.policy]);
                        out.push((
                            outer.policy,
                            format!(
                                "rules[{}]: pod {} destination {} inside {} is taken by \
                                 policy {} rules[{}] (the longest prefix wins)",
                                outer.rule,
                                inner.pod,
                                inner.prefix,
                                outer.prefix,
                                ip_.name,
                                inner.rule
                            ),
                        ));
                        out.push((
                            inner.policy,
                            format!(
                                "rules[{}]: pod {} destination {} overrides policy {} \
                                 rules[{}]'s {} for it (the longest prefix wins)",
                                inner.rule,
                                inner.pod,
                                inner.prefix,
                                op.name,
                                outer.rule,
                                outer.prefix
                            ),
                        ));
                    }
                }
            }
        }
        out
    }
}

impl Claimer<'_, '_, '_> {
    /// Claim the pairs of one pod under one rule (`served_here`: a gateway address of
    /// this node serves it) in one pass.
    fn pod(
        &mut self,
        pass: Pass,
        (p_idx, r_idx, served_here): (usize, usize, bool),
        pod: &PodInfo<'_>,
        desired: &mut Desired,
    ) {
        let plans = self.plans;
        let policy = &plans[p_idx];
        let rule = &policy.rules[r_idx];
        for ip in pod.ips.iter() {
            let contested = self.contested.contains(ip);
            // Another node's pod address that only this rule claims, served elsewhere:
            // nothing of it is this node's (no entries, no admission, no conflict).
            if !contested && !pod.local && !served_here {
                continue;
            }
            let route = rule.route_for(*ip);
            let gateway = route.gateway;
            // A prefix applies to the pod's address of its own family.
            let prefixes = rule.prefixes(gateway).0.iter().filter(|(p, kind)| {
                p.addr().is_ipv6() == ip.is_ipv6()
                    && ((*kind == Kind::Carve) == (pass == Pass::Carve))
            });
            let claimant = Claimant {
                pass,
                policy: p_idx,
                rule: rule.index,
                rule_id: rule.rule_id,
                failure_policy: policy.failure_policy,
                ip: *ip,
                pod,
                local: pod.local,
                serves_here: gateway.is_some_and(|g| g.node == self.node_name),
                route,
            };
            if !contested {
                claimant.take_all(prefixes, (desired, &mut self.admitted));
                continue;
            }
            for (prefix, kind) in prefixes {
                self.pair(&claimant, *prefix, *kind, desired);
            }
        }
    }

    /// Claim (pod address, `prefix`) for `claimant`'s rule, or say that it lost the pair.
    fn pair(
        &mut self,
        claimant: &Claimant<'_, '_>,
        prefix: IpNet,
        kind: Kind,
        desired: &mut Desired,
    ) {
        let (pass, ip) = (claimant.pass, claimant.ip);
        let (p_idx, rule) = (claimant.policy, claimant.rule);
        if let Some(&(w_policy, w_rule, w_listed)) = self.claims.get(&(ip, prefix)) {
            let own = w_policy == p_idx && w_rule == rule;
            // The cluster's own addresses are carved out of every rule alike:
            // nobody wins them from anybody.
            let cluster = kind == Kind::Cluster || self.cluster.contains(&(ip, prefix));
            let yields = cluster || pass == Pass::Carve || (pass == Pass::Learned && w_listed);
            if !own && !yields {
                let winner = if w_policy == p_idx {
                    format!("rules[{w_rule}] of this policy")
                } else {
                    format!("policy {}", self.plans[w_policy].name)
                };
                self.lost.push((
                    p_idx,
                    format!(
                        "rules[{rule}]: pod {} destination {prefix} is claimed by {winner}",
                        claimant.pod_name()
                    ),
                ));
            }
            return;
        }
        self.claims
            .insert((ip, prefix), (p_idx, rule, pass == Pass::Listed));
        if kind == Kind::Cluster {
            self.cluster.insert((ip, prefix));
        } else if pass == Pass::Listed {
            self.listed.entry(ip).or_default().push(ListedClaim {
                prefix,
                policy: p_idx,
                rule,
                pod: claimant.pod_name(),
            });
        }
        if kind == Kind::Forward && claimant.serves_here {
            self.admitted.push((ip, claimant.route.id));
        }
        if claimant.local {
            claimant.entry(kind).insert(desired, ip, prefix, true);
        }
    }
}

/// One pod address under one rule in one pass: how it leaves, and where.
struct Claimant<'r, 'a> {
    pass: Pass,
    /// Policy index.
    policy: usize,
    /// Rule index in the policy, and the rule's id.
    rule: usize,
    rule_id: u32,
    failure_policy: FailurePolicy,
    ip: IpAddr,
    pod: &'r PodInfo<'a>,
    route: Route<'r>,
    /// The pod is on this node.
    local: bool,
    /// The pod address's gateway for the rule is this node.
    serves_here: bool,
}

impl Claimant<'_, '_> {
    /// `namespace/name` of the pod.
    fn pod_name(&self) -> String {
        format!("{}/{}", self.pod.namespace, self.pod.name)
    }

    /// The entry for a prefix of `kind`: forwarded by the route, or left alone.
    fn entry(&self, kind: Kind) -> Entry {
        match kind {
            Kind::Forward => Entry::of(&self.route, self.failure_policy),
            Kind::Except | Kind::Carve | Kind::Cluster => Entry::exclude(self.rule_id),
        }
    }

    /// An uncontested pod address: its only rule has every pair: entries if local (the
    /// first of equal prefixes wins, as an except over a destination), admission if
    /// served here.
    fn take_all<'p>(
        &self,
        prefixes: impl Iterator<Item = &'p (IpNet, Kind)> + Clone,
        (desired, admitted): (&mut Desired, &mut Vec<(IpAddr, u32)>),
    ) {
        if self.serves_here && prefixes.clone().any(|(_, k)| *k == Kind::Forward) {
            admitted.push((self.ip, self.route.id));
        }
        if self.local {
            for (prefix, kind) in prefixes {
                self.entry(*kind).insert(desired, self.ip, *prefix, false);
            }
        }
    }
}

/// A policy entry of either family, before it goes to `policy_v4` or `policy_v6`.
struct Entry {
    action: PolicyAction,
    gateway: Option<IpAddr>,
    egress_ip: Option<IpAddr>,
    rule_id: u32,
}

impl Entry {
    /// Store the entry for (pod, prefix) in the maps of their family (the caller pairs
    /// pod addresses and prefixes of one family; a stray pair is left out). An entry
    /// already there for (pod, prefix) stays unless `replace`.
    fn insert(self, desired: &mut Desired, pod: IpAddr, prefix: IpNet, replace: bool) {
        by_family!(pod, |pod: F| {
            if let Some(p) = F::net(prefix) {
                self.insert_in::<F>(desired, pod, p, replace);
            }
        });
    }

    /// [`Entry::insert`] in family `F`'s part; an entry already there stays unless
    /// `replace`. A pod's first entry selects it; the count is of its entries.
    fn insert_in<F: Family>(
        self,
        desired: &mut Desired,
        pod: F::Addr,
        prefix: F::Net,
        replace: bool,
    ) {
        let part = F::part_mut(desired);
        let entry = PolicyEntry {
            action: self.action,
            gateway: self.gateway,
            egress_ip: self.egress_ip.and_then(F::addr),
            rule_id: self.rule_id,
            filter: 0,
        };
        match part.policy.entry((pod, prefix)) {
            std::collections::btree_map::Entry::Occupied(mut o) => {
                if replace {
                    o.insert(entry);
                }
            }
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(entry);
                *part.selected.entry(pod).or_insert(0) += 1;
            }
        }
    }

    /// An `except` prefix: left untouched.
    fn exclude(rule_id: u32) -> Self {
        Self {
            action: PolicyAction::Exclude,
            gateway: None,
            egress_ip: None,
            rule_id,
        }
    }

    /// The entry for destination traffic of a pod address that leaves by `route`: forward
    /// to its gateway, or the failure policy when there is none.
    fn of(route: &Route<'_>, failure_policy: FailurePolicy) -> Self {
        match route.gateway {
            Some(g) => Self {
                action: PolicyAction::Forward,
                gateway: Some(g.underlay),
                egress_ip: Some(g.ip),
                rule_id: route.id,
            },
            None => Self {
                action: match failure_policy {
                    FailurePolicy::Drop => PolicyAction::NoGatewayDrop,
                    FailurePolicy::Fallthrough => PolicyAction::NoGatewayPass,
                },
                gateway: None,
                egress_ip: route.egress_ip,
                rule_id: route.id,
            },
        }
    }
}
