//! For `--unknown-pods drop`: what a pod the agent has not seen yet may not reach (every
//! destination any rule of any policy covers, with the rules' `except` holes) and which
//! local addresses are pods it has seen.

use std::collections::BTreeMap;

use ipnet::IpNet;

use super::{
    plans::{Destinations, PolicyPlan},
    pods::Pods,
    routes::{Kind, Prefixes},
};
use crate::desired::Desired;

/// Fill `desired.covered` from every planned rule and `desired.known_pods` with this
/// node's running pods.
pub(super) fn cover(plans: &[PolicyPlan<'_>], pods: &Pods<'_>, desired: &mut Desired) {
    desired.known_pods = pods
        .pods
        .iter()
        .filter(|p| p.local)
        .flat_map(|p| p.ips.iter().copied())
        .collect();
    desired.covered = covered(plans);
}

/// Every rule's destinations (listed; learned from any gateway, or the fallback) as
/// `true`, its `except` prefixes as `false`. Where rules disagree on one prefix, covered
/// wins: an unknown pod is dropped wherever some rule would take its traffic.
fn covered(plans: &[PolicyPlan<'_>]) -> BTreeMap<IpNet, bool> {
    let mut out = BTreeMap::new();
    let all = plans
        .iter()
        .flat_map(|p| &p.rules)
        .flat_map(|r| match &r.destinations {
            Destinations::Listed(prefixes) => vec![prefixes],
            Destinations::Learned { by_node, fallback } => {
                by_node.values().chain(std::iter::once(fallback)).collect()
            }
        });
    let all: Vec<&Prefixes> = all.collect();
    for prefixes in &all {
        add(&mut out, prefixes);
    }
    // The cluster's own addresses stay reachable for unknown pods too, whatever covers
    // them.
    for (prefix, _) in all
        .iter()
        .flat_map(|p| &p.0)
        .filter(|(_, k)| *k == Kind::Cluster)
    {
        out.insert(prefix.trunc(), false);
    }
    out
}

fn add(out: &mut BTreeMap<IpNet, bool>, prefixes: &Prefixes) {
    for (prefix, kind) in &prefixes.0 {
        match kind {
            Kind::Forward => {
                out.insert(prefix.trunc(), true);
            }
            Kind::Except => {
                out.entry(prefix.trunc()).or_insert(false);
            }
            // Routed elsewhere by one gateway: still covered by the rule around it.
            Kind::Carve => {}
            // Set after every rule's destinations (below).
            Kind::Cluster => {}
        }
    }
}
