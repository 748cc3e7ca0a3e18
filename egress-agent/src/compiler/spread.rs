//! Which pod leaves by which egress address: each selected pod address's route under
//! each rule (the rendezvous choice of [`RulePlan::route_for`]), counted per address for
//! the statuses, and listed for this node's own pods (`egress-agent status`, metrics).

use std::{collections::BTreeMap, net::IpAddr};

use super::{
    plans::{GatewayAddr, PolicyPlan, RulePlan},
    pods::PodInfo,
};

/// One of this node's pods and the address it leaves with under one rule.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodRoute {
    /// `namespace/name`.
    pub pod: String,
    pub pod_ip: IpAddr,
    pub policy: String,
    pub rule: usize,
    /// The egress address (none: an interface rule without a gateway, or an invalid rule).
    pub egress_ip: Option<IpAddr>,
    /// The gateway it leaves through (none: the failure policy applies).
    pub gateway: Option<String>,
    /// The rule's id (what its `except` entries carry).
    pub rule_id: u32,
    /// The wire id of the route (what its forwarded entries carry): the rule's id, or
    /// the own id of a later address of its `egressIPs`.
    pub wire_id: u32,
}

/// Pods per (policy, egress address, gateway), cluster-wide.
pub(super) type Counts = BTreeMap<(String, IpAddr, String), u32>;

/// The pods that leave by each served address (counted once per pod and address), and
/// the routes of the pods of the node the compile is for, sorted.
pub(super) fn spread(
    plans: &[PolicyPlan<'_>],
    selected: &[Vec<&PodInfo<'_>>],
) -> (Counts, Vec<PodRoute>) {
    let mut counts = Counts::new();
    let mut local = Vec::new();
    for (plan, pods) in plans.iter().zip(selected) {
        for rule in &plan.rules {
            let mut families = Families::default();
            // Counted by gateway address (the very one: a rule has a few), named after.
            let mut tally: Vec<(&GatewayAddr, u32)> = Vec::new();
            for pod in pods {
                for ip in pod.ips.iter() {
                    let route = rule.route_for(*ip);
                    if !families.serves(rule, route.gateway, *ip) {
                        continue;
                    }
                    if let Some(g) = route.gateway {
                        match tally.iter_mut().find(|(t, _)| std::ptr::eq(*t, g)) {
                            Some((_, n)) => *n += 1,
                            None => tally.push((g, 1)),
                        }
                    }
                    if pod.local {
                        local.push(PodRoute {
                            pod: format!("{}/{}", pod.namespace, pod.name),
                            pod_ip: *ip,
                            policy: plan.name.clone(),
                            rule: rule.index,
                            egress_ip: route.egress_ip,
                            gateway: route.gateway.map(|g| g.node.clone()),
                            rule_id: rule.rule_id,
                            wire_id: route.id,
                        });
                    }
                }
            }
            for (g, n) in tally {
                *counts
                    .entry((plan.name.clone(), g.ip, g.node.clone()))
                    .or_default() += n;
            }
        }
    }
    local.sort();
    local.dedup();
    (counts, local)
}

/// Which families one rule forwards through each of its routes' gateways, found once per
/// gateway (a rule has a few; its pods, thousands).
#[derive(Default)]
struct Families {
    /// (gateway, forwards IPv4, forwards IPv6).
    known: Vec<(Option<*const GatewayAddr>, bool, bool)>,
}

impl Families {
    /// Whether `rule` steers pod address `ip` at all: it forwards a prefix of the
    /// address's family (`gateway`: the address's route under it).
    fn serves(&mut self, rule: &RulePlan, gateway: Option<&GatewayAddr>, ip: IpAddr) -> bool {
        let key = gateway.map(std::ptr::from_ref);
        let (_, v4, v6) = match self.known.iter().find(|k| k.0 == key) {
            Some(k) => *k,
            None => {
                let forwards = || rule.prefixes(gateway).forwards();
                let k = (
                    key,
                    forwards().any(|p| p.addr().is_ipv4()),
                    forwards().any(|p| p.addr().is_ipv6()),
                );
                self.known.push(k);
                k
            }
        };
        if ip.is_ipv6() { v6 } else { v4 }
    }
}
