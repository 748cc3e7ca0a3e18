//! The source side: which policy rule each (pod, destination prefix) pair belongs to,
//! over every pod of the cluster (so conflicts, and thus statuses, are the same on every
//! node), and the policy entries of this node's own pods.

use std::{collections::HashMap, net::IpAddr};

use ipnet::IpNet;

use super::{
    placement::{PolicyPlan, RulePlan, Target},
    pods::Pods,
};
use crate::{
    api::FailurePolicy,
    desired::{Desired, PolicyAction, PolicyEntryV4, PolicyEntryV6},
};

/// (policy index, rule index) that claimed a (pod address, prefix) pair.
type Claims = HashMap<(IpAddr, IpNet), (usize, usize)>;

/// Claim every selected (pod, prefix) pair for its rule and fill this node's entries.
/// Accepted policies claim first (in name order), so that a broken policy never takes a
/// pair from a working one; among accepted ones the smaller name wins, and within a
/// policy the earlier rule. Lost pairs are conflicts in the loser's report.
pub(super) fn claim(
    plans: &mut [PolicyPlan<'_>],
    pods: &Pods<'_>,
    node_name: &str,
    desired: &mut Desired,
) {
    let mut claims = Claims::new();
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by_key(|i| (!plans[*i].report.accepted(), *i));
    let mut lost: Vec<(usize, String)> = Vec::new();
    for p_idx in order {
        let policy = &plans[p_idx];
        let Some((ns_sel, pod_sel)) = &policy.selectors else {
            continue;
        };
        let selected = pods.selected(ns_sel, pod_sel);
        for rule in &policy.rules {
            // Excepts first: within a rule, an except equal to a destination wins.
            let prefixes: Vec<(IpNet, bool)> = rule
                .except
                .iter()
                .map(|p| (*p, true))
                .chain(rule.destinations.iter().map(|p| (*p, false)))
                .collect();
            for pod in &selected {
                let local = pod.node == node_name;
                for ip in &pod.ips {
                    // A prefix applies to the pod's address of its own family.
                    let same_family = prefixes
                        .iter()
                        .filter(|(p, _)| p.addr().is_ipv6() == ip.is_ipv6());
                    for (prefix, is_except) in same_family {
                        if let Some(&(w_policy, w_rule)) = claims.get(&(*ip, *prefix)) {
                            if w_policy == p_idx && w_rule == rule.index {
                                continue; // the rule's own except
                            }
                            let winner = if w_policy == p_idx {
                                format!("rules[{w_rule}] of this policy")
                            } else {
                                format!("policy {}", plans[w_policy].name)
                            };
                            lost.push((
                                p_idx,
                                format!(
                                    "rules[{}]: pod {}/{} destination {prefix} is claimed by \
                                     {winner}",
                                    rule.index, pod.namespace, pod.name
                                ),
                            ));
                            continue;
                        }
                        claims.insert((*ip, *prefix), (p_idx, rule.index));
                        if !local {
                            continue;
                        }
                        let entry = if *is_except {
                            Entry::exclude(rule.rule_id)
                        } else {
                            Entry::of(rule, *ip, policy.failure_policy)
                        };
                        entry.insert(desired, *ip, *prefix);
                    }
                }
            }
        }
    }
    for (p_idx, message) in lost {
        plans[p_idx].report.conflict(message);
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
    /// pod addresses and prefixes of one family; a stray pair is left out).
    fn insert(self, desired: &mut Desired, pod: IpAddr, prefix: IpNet) {
        match (pod, prefix) {
            (IpAddr::V4(pod), IpNet::V4(prefix)) => {
                desired.policy_v4.insert(
                    (pod, prefix),
                    PolicyEntryV4 {
                        action: self.action,
                        gateway: self.gateway,
                        egress_ip: match self.egress_ip {
                            Some(IpAddr::V4(ip)) => Some(ip),
                            _ => None,
                        },
                        rule_id: self.rule_id,
                    },
                );
                *desired.selected_v4.entry(pod).or_insert(0) += 1;
            }
            (IpAddr::V6(pod), IpNet::V6(prefix)) => {
                desired.policy_v6.insert(
                    (pod, prefix),
                    PolicyEntryV6 {
                        action: self.action,
                        gateway: self.gateway,
                        egress_ip: match self.egress_ip {
                            Some(IpAddr::V6(ip)) => Some(ip),
                            _ => None,
                        },
                        rule_id: self.rule_id,
                    },
                );
                *desired.selected_v6.entry(pod).or_insert(0) += 1;
            }
            _ => {}
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

    /// The entry for destination traffic of pod address `ip` under `rule`: forward to its
    /// gateway, or the failure policy when it has none.
    fn of(rule: &RulePlan, ip: IpAddr, failure_policy: FailurePolicy) -> Self {
        match rule.gateway_for(ip) {
            Some(g) => Self {
                action: PolicyAction::Forward,
                gateway: Some(g.underlay),
                egress_ip: Some(g.ip),
                rule_id: rule.rule_id,
            },
            None => Self {
                action: match failure_policy {
                    FailurePolicy::Drop => PolicyAction::NoGatewayDrop,
                    FailurePolicy::Fallthrough => PolicyAction::NoGatewayPass,
                },
                gateway: None,
                egress_ip: match &rule.target {
                    Target::Dedicated { ip, .. } => Some(*ip),
                    _ => None,
                },
                rule_id: rule.rule_id,
            },
        }
    }
}
