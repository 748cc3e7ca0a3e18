//! Which pod leaves by which egress address: each selected pod address's route under
//! each rule (the rendezvous choice of [`RulePlan::route_for`]), counted per address for
//! the statuses, and listed for this node's own pods (`egress-agent status`, metrics).

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
};

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
/// the routes of `node_name`'s own pods, sorted.
pub(super) fn spread(
    plans: &[PolicyPlan<'_>],
    selected: &[Vec<&PodInfo<'_>>],
    node_name: &str,
) -> (Counts, Vec<PodRoute>) {
    // Counted under borrowed keys, owned once per key at the end.
    let mut counts: HashMap<(&str, IpAddr, &str), u32> = HashMap::new();
    let mut local = Vec::new();
    for (plan, pods) in plans.iter().zip(selected) {
        for pod in pods {
            for rule in &plan.rules {
                for ip in &pod.ips {
                    let route = rule.route_for(*ip);
                    if !serves_family(rule, route.gateway, *ip) {
                        continue;
                    }
                    if let Some(g) = route.gateway {
                        *counts
                            .entry((plan.name.as_str(), g.ip, g.node.as_str()))
                            .or_default() += 1;
                    }
                    if pod.node == node_name {
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
        }
    }
    local.sort();
    local.dedup();
    let counts = counts
        .into_iter()
        .map(|((policy, ip, node), n)| ((policy.to_owned(), ip, node.to_owned()), n))
        .collect();
    (counts, local)
}

/// Whether `rule` steers pod address `ip` at all: it forwards a prefix of the address's
/// family (`gateway`: the address's route under it).
fn serves_family(rule: &RulePlan, gateway: Option<&GatewayAddr>, ip: IpAddr) -> bool {
    rule.prefixes(gateway)
        .forwards()
        .any(|p| p.addr().is_ipv6() == ip.is_ipv6())
}
