//! The plans placement makes and the later steps read: each policy checked and resolved
//! (its selectors, its report), each rule's destinations and target (the holders of its
//! egress IPs, or the gateways serving its interface), and how a pod address leaves under
//! a rule.

use std::{collections::BTreeMap, net::IpAddr};

use super::{
    hash, move_reason,
    nodes::NodeInfo,
    routes::Prefixes,
    status::{PolicyReport, Reported},
};
use crate::{
    api::{EgressGatewayPolicy, FailurePolicy},
    selector::Selector,
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
    /// The accepted version it is planned from: itself, or its last accepted version;
    /// `None` when it is not accepted and was never accepted before.
    pub(super) accepted: Option<&'a EgressGatewayPolicy>,
}

impl PolicyPlan<'_> {
    /// What its status is made of.
    pub(super) fn reported(&self) -> Reported<'_> {
        Reported {
            name: &self.name,
            generation: self.policy.metadata.generation,
            rules: self.rules.len(),
            report: &self.report,
        }
    }
}

/// A rule checked and resolved (for one family, when its destinations are learned from
/// an interface's routes: such a rule serves both, as two plans with one index and id).
pub(super) struct RulePlan {
    pub(super) index: usize,
    pub(super) rule_id: u32,
    pub(super) destinations: Destinations,
    pub(super) target: Target,
}

/// A rule's prefixes; each applies to the pod addresses of its family.
pub(super) enum Destinations {
    /// Listed destination and except prefixes that parsed (one family unless the rule is
    /// invalid).
    Listed(Prefixes),
    /// Learned from the routes of each gateway that may serve the rule (by node name);
    /// `fallback` when none serves it.
    Learned {
        by_node: BTreeMap<String, Prefixes>,
        fallback: Prefixes,
    },
}

pub(super) enum Target {
    /// Dedicated egress IPs (`egressIP`, or each of `egressIPs`) and their holders.
    Dedicated { addresses: Vec<Dedicated> },
    /// An interface rule and the gateways serving it, by node name.
    Interface {
        gateways: BTreeMap<String, GatewayAddr>,
    },
    /// No gateway at all (invalid, unhostable, ...): the failure policy applies.
    None,
}

/// One dedicated egress IP of a rule.
pub(super) struct Dedicated {
    pub(super) ip: IpAddr,
    /// `ip` as text: what rendezvous hashes to pick among a rule's addresses.
    pub(super) name: String,
    /// Its wire id: the rule's for `egressIP` and the first address of `egressIPs`, its
    /// own for each other address.
    pub(super) id: u32,
    pub(super) holder: Option<GatewayAddr>,
}

/// How a pod address leaves under a rule: the wire id, the gateway (none: the failure
/// policy applies) and the egress address.
pub(super) struct Route<'a> {
    pub(super) id: u32,
    pub(super) gateway: Option<&'a GatewayAddr>,
    pub(super) egress_ip: Option<IpAddr>,
}

/// One gateway address serving a rule, with its wire id (`shared`: an interface's own
/// address, not a dedicated egress IP).
pub(super) struct Served<'a> {
    pub(super) gateway: &'a GatewayAddr,
    pub(super) shared: bool,
    pub(super) id: u32,
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
    pub(super) fn new(
        node: &NodeInfo<'_>,
        underlay: IpAddr,
        interface: &str,
        ip: IpAddr,
        len: u8,
    ) -> Self {
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
    /// The prefixes of this rule for traffic through `gateway` (`None`: no gateway).
    pub(super) fn prefixes(&self, gateway: Option<&GatewayAddr>) -> &Prefixes {
        match &self.destinations {
            Destinations::Listed(prefixes) => prefixes,
            Destinations::Learned { by_node, fallback } => gateway
                .and_then(|g| by_node.get(&g.node))
                .unwrap_or(fallback),
        }
    }

    pub(super) fn learned(&self) -> bool {
        matches!(self.destinations, Destinations::Learned { .. })
    }

    /// How pod address `ip` leaves under this rule. A dedicated rule's pod takes the
    /// rendezvous winner among its addresses that have a holder (per pod address and
    /// rule, so pods spread over the addresses, each keeps its address while that address
    /// is held anywhere, and only the pods of an address that loses every holder move);
    /// with none held, the winner among all, without a gateway. An interface rule's pod
    /// takes the rendezvous winner among the gateways of its interface.
    pub(super) fn route_for(&self, ip: IpAddr) -> Route<'_> {
        let rule_id = self.rule_id.to_be_bytes();
        let octets = IpBytes::of(ip);
        let key: [&[u8]; 2] = [octets.bytes(), &rule_id];
        match &self.target {
            // One address is the pool whether it is held or not.
            Target::Dedicated { addresses } if addresses.len() == 1 => {
                let chosen = &addresses[0];
                Route {
                    id: chosen.id,
                    gateway: chosen.holder.as_ref(),
                    egress_ip: Some(chosen.ip),
                }
            }
            Target::Dedicated { addresses } => {
                let any_held = addresses.iter().any(|a| a.holder.is_some());
                let pool = || {
                    addresses
                        .iter()
                        .filter(move |a| !any_held || a.holder.is_some())
                };
                let Some(chosen) = hash::rendezvous(&key, pool().map(|a| a.name.as_str()))
                    .and_then(|winner| pool().find(|a| a.name == winner))
                else {
                    return self.no_route();
                };
                Route {
                    id: chosen.id,
                    gateway: chosen.holder.as_ref(),
                    egress_ip: Some(chosen.ip),
                }
            }
            Target::Interface { gateways } => {
                let gateway = hash::rendezvous(&key, gateways.keys().map(String::as_str))
                    .and_then(|node| gateways.get(node));
                Route {
                    id: self.rule_id,
                    gateway,
                    egress_ip: gateway.map(|g| g.ip),
                }
            }
            Target::None => self.no_route(),
        }
    }

    fn no_route(&self) -> Route<'_> {
        Route {
            id: self.rule_id,
            gateway: None,
            egress_ip: None,
        }
    }

    /// Whether a gateway address of node `node` serves this rule: whether a route of
    /// [`RulePlan::route_for`] may lead there.
    pub(super) fn served_by(&self, node: &str) -> bool {
        self.served().iter().any(|s| s.gateway.node == node)
    }

    /// Every gateway address serving this rule.
    pub(super) fn served(&self) -> Vec<Served<'_>> {
        match &self.target {
            Target::Dedicated { addresses } => addresses
                .iter()
                .filter_map(|a| {
                    Some(Served {
                        gateway: a.holder.as_ref()?,
                        shared: false,
                        id: a.id,
                    })
                })
                .collect(),
            Target::Interface { gateways } => gateways
                .values()
                .map(|g| Served {
                    gateway: g,
                    shared: true,
                    id: self.rule_id,
                })
                .collect(),
            Target::None => Vec::new(),
        }
    }
}

/// Address bytes as hashed by rendezvous (4 for IPv4, 16 for IPv6), without allocating.
pub(super) struct IpBytes {
    octets: [u8; 16],
    len: usize,
}

impl IpBytes {
    pub(super) fn of(ip: IpAddr) -> Self {
        let mut octets = [0; 16];
        let len = match ip {
            IpAddr::V4(ip) => {
                octets[..4].copy_from_slice(&ip.octets());
                4
            }
            IpAddr::V6(ip) => {
                octets = ip.octets();
                16
            }
        };
        Self { octets, len }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.octets[..self.len]
    }
}
