//! The gateway side: who uses which egress address (the same on every node), and what
//! this node serves when it is a gateway (rules by id, egress addresses to hold, the
//! interfaces that need `from_secondary`).

use std::collections::{BTreeMap, BTreeSet};

use super::{
    compiled::Holder,
    plans::{GatewayAddr, PolicyPlan, Served},
    spread::Counts,
};
use crate::{
    api::EgressIpStatus,
    by_family,
    desired::{Desired, Family, GatewayRule, HeldIp},
};

/// The holders of every plan's addresses (sorted), the addresses by policy (for the
/// statuses), and this node's gateway-side state in `desired`.
pub(super) fn serve(
    plans: &[PolicyPlan<'_>],
    counts: &Counts,
    node_name: &str,
    desired: &mut Desired,
) -> (Vec<Holder>, BTreeMap<String, BTreeSet<EgressIpStatus>>) {
    let mut holders = Vec::new();
    let mut egress_ips: BTreeMap<String, BTreeSet<EgressIpStatus>> = BTreeMap::new();
    for plan in plans {
        let ips = egress_ips.entry(plan.name.clone()).or_default();
        for rule in &plan.rules {
            for Served {
                gateway: g,
                shared,
                id,
            } in rule.served()
            {
                let pods = counts
                    .get(&(plan.name.clone(), g.ip, g.node.clone()))
                    .copied()
                    .unwrap_or(0);
                holders.push(Holder {
                    ip: g.ip,
                    node: g.node.clone(),
                    interface: g.interface.clone(),
                    policy: plan.name.clone(),
                    rule: rule.index,
                    rule_id: id,
                    shared,
                    epoch: g.epoch,
                    reason: g.reason,
                    pods,
                });
                ips.insert(EgressIpStatus {
                    ip: g.ip.to_string(),
                    node: g.node.clone(),
                    interface: g.interface.clone(),
                    since: (!shared).then(|| g.since.clone()).flatten(),
                    reason: (!shared).then(|| g.reason.to_owned()),
                    pods: Some(pods),
                });
                if g.node == node_name {
                    serve_locally(desired, id, g, shared);
                }
            }
        }
    }
    holders.sort();
    (holders, egress_ips)
}

/// This node serves rule `rule_id` with `g`'s address.
fn serve_locally(desired: &mut Desired, rule_id: u32, g: &GatewayAddr, shared: bool) {
    let held = HeldIp {
        interface: g.interface.clone(),
        prefix_len: g.prefix_len,
        shared,
    };
    by_family!(g.ip, |a: F| hold_and_serve::<F>(desired, rule_id, a, held));
    desired.egress_interfaces.insert(g.interface.clone());
}

/// Rule `rule_id` leaves by `held`'s interface with `egress_ip`, which this node holds.
fn hold_and_serve<F: Family>(
    desired: &mut Desired,
    rule_id: u32,
    egress_ip: F::Addr,
    held: HeldIp,
) {
    let part = F::part_mut(desired);
    let interface = held.interface.clone();
    part.rules.insert(
        rule_id,
        GatewayRule {
            egress_ip,
            interface,
        },
    );
    part.egress_ips.insert(egress_ip, held);
}
