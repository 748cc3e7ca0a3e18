//! Selection: the pods each plan selects, once per compile, and what the plans learn
//! from them: addresses another pod or a node claims too, and policy kinds that may cover
//! them but do not hold for redirected traffic.

use std::collections::BTreeSet;

use super::{
    plans::PolicyPlan,
    pods::{PodInfo, Pods},
};
use crate::source::Unapplied;

/// The pods each plan selects (none for a plan without valid selectors), by plan; each
/// plan's report says what [`report_disputed`] and [`report_unapplied`] find among them.
pub(super) fn select<'p, 'a>(
    plans: &mut [PolicyPlan<'_>],
    pods: &'p Pods<'a>,
    unapplied: &[Unapplied],
) -> Vec<Vec<&'p PodInfo<'a>>> {
    let selected: Vec<Vec<&PodInfo<'a>>> = plans
        .iter()
        .map(|p| match &p.selectors {
            Some((ns_sel, pod_sel)) => pods.selected(ns_sel, pod_sel),
            None => Vec::new(),
        })
        .collect();
    report_disputed(plans, pods, &selected);
    report_unapplied(plans, &selected, unapplied);
    selected
}

/// A pod address claimed twice is a conflict on every policy that selects a claimant.
fn report_disputed(
    plans: &mut [PolicyPlan<'_>],
    pods: &Pods<'_>,
    selected_by: &[Vec<&PodInfo<'_>>],
) {
    if pods.disputed.is_empty() {
        return;
    }
    for (plan, selected) in plans.iter_mut().zip(selected_by) {
        if plan.selectors.is_none() {
            continue;
        }
        let selected: BTreeSet<String> = selected
            .iter()
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect();
        for d in &pods.disputed {
            if d.pods.iter().any(|p| selected.contains(p)) {
                plan.report.address_conflict(d.message());
            }
        }
    }
}

/// Objects named in an `AdminPoliciesNotApplied` message; the rest are counted.
const UNAPPLIED_NAMED: usize = 3;

/// Every policy that selects pods an AdminNetworkPolicy or BaselineAdminNetworkPolicy
/// (cluster-wide) or an EgressFirewall (of a selected pod's namespace) may cover says that
/// they do not hold for the traffic it redirects.
fn report_unapplied(
    plans: &mut [PolicyPlan<'_>],
    selected_by: &[Vec<&PodInfo<'_>>],
    unapplied: &[Unapplied],
) {
    if unapplied.is_empty() {
        return;
    }
    let mut sorted: Vec<&Unapplied> = unapplied.iter().collect();
    sorted.sort();
    for (plan, selected) in plans.iter_mut().zip(selected_by) {
        if plan.selectors.is_none() {
            continue;
        }
        let namespaces: BTreeSet<&str> = selected.iter().map(|p| p.namespace).collect();
        if namespaces.is_empty() {
            continue;
        }
        let applies: Vec<String> = sorted
            .iter()
            .filter(|u| {
                u.namespace
                    .as_deref()
                    .is_none_or(|ns| namespaces.contains(ns))
            })
            .map(|u| u.to_string())
            .collect();
        if applies.is_empty() {
            continue;
        }
        let mut named: Vec<String> = applies.iter().take(UNAPPLIED_NAMED).cloned().collect();
        if applies.len() > UNAPPLIED_NAMED {
            named.push(format!("and {} more", applies.len() - UNAPPLIED_NAMED));
        }
        plan.report.unapplied(format!(
            "{} may cover pods this policy redirects: the datapath takes their traffic \
             before the CNI applies these kinds, and does not apply them itself (egress \
             NetworkPolicies it does apply; docs/networkpolicy.md)",
            named.join(", ")
        ));
    }
}
