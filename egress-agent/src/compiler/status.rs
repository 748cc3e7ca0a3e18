//! Policy status: the conditions each plan gathered, turned into `Accepted`, `Ready` and
//! `Conflict`, and the problems every agent logs and counts.

use std::collections::{BTreeMap, BTreeSet};

use super::{Object, Problem, condition, reason};
use crate::api::{EgressIpStatus, MAX_CONDITION_MESSAGE, PolicyCondition, PolicyStatus};

/// Most conflict pairs named in a condition message; the rest are counted.
const MAX_CONFLICTS_NAMED: usize = 3;

/// Conditions being built for one policy.
#[derive(Default)]
pub(super) struct PolicyReport {
    /// (reason, message) of static errors.
    invalid: Vec<(&'static str, String)>,
    /// (reason, message) of what keeps rules from being served.
    unready: Vec<(&'static str, String)>,
    /// (reason, message) of destinations learned from routes that are left out or differ.
    routes: Vec<(&'static str, String)>,
    /// Messages of listed destinations that cover the cluster's own addresses (carved
    /// out).
    cluster: Vec<(&'static str, String)>,
    /// Planned from its last accepted spec (of this generation), the current one being
    /// invalid.
    serving_last: Option<Option<i64>>,
    /// (pod, prefix) pairs lost to another policy or an earlier rule, the first few named.
    conflicts: Vec<String>,
    conflict_count: usize,
    /// Egress IPs another implementation claims too (left to it).
    claimed_elsewhere: Vec<String>,
    /// Egress IPs another policy names too (kept by the older policy).
    shared_ips: Vec<String>,
    /// Pod addresses of selected pods that another pod or a node claims too.
    disputed: Vec<String>,
    /// Destinations of selected pods that another policy's longer prefix takes.
    overridden: Vec<String>,
    overridden_count: usize,
    /// Policy kinds that may cover its pods and that redirected traffic escapes.
    unapplied: Option<String>,
    /// Rules whose `egressIPs` share gateways (fewer host them than there are).
    shared_gateways: Vec<(&'static str, String)>,
}

impl PolicyReport {
    /// Several addresses of a rule's `egressIPs` share a gateway
    /// (`EgressIPsShareGateway=True`); the rule is served.
    pub(super) fn shared_gateways(&mut self, message: String) {
        self.shared_gateways
            .push((reason::FEWER_GATEWAYS_THAN_EGRESS_IPS, message));
    }

    /// Policy kinds not applied to redirected traffic may cover its pods
    /// (`AdminPoliciesNotApplied=True`).
    pub(super) fn unapplied(&mut self, message: String) {
        self.unapplied = Some(message);
    }

    /// The spec is wrong (`Accepted=False`).
    pub(super) fn invalid(&mut self, reason: &'static str, message: String) {
        self.invalid.push((reason, message));
    }

    /// The spec is fine but the cluster cannot serve (all of) it (`Ready=False`).
    pub(super) fn unready(&mut self, reason: &'static str, message: String) {
        self.unready.push((reason, message));
    }

    /// Learned destinations are degraded (`RoutesDegraded=True`); the rules are served.
    pub(super) fn routes(&mut self, reason: &'static str, message: String) {
        self.routes.push((reason, message));
    }

    /// A listed destination covers the cluster's own addresses, which are carved out of
    /// it (`ClusterExcluded=True`); the rule is served.
    pub(super) fn cluster(&mut self, message: String) {
        self.cluster
            .push((reason::DESTINATIONS_COVER_CLUSTER, message));
    }

    /// The current spec is invalid (`fresh` says why) and the last accepted one (of
    /// `generation`) is served instead: the policy is not accepted, and not ready.
    pub(super) fn serve_last_accepted(&mut self, fresh: PolicyReport, generation: Option<i64>) {
        self.invalid = fresh.invalid;
        self.serving_last = Some(generation);
    }

    pub(super) fn invalid_count(&self) -> usize {
        self.invalid.len()
    }

    pub(super) fn accepted(&self) -> bool {
        self.invalid.is_empty()
    }

    /// An egress IP that another implementation claims too: the rule has no gateway
    /// (`Ready=False`) and the policy reports the conflict.
    pub(super) fn claimed_elsewhere(&mut self, message: String) {
        self.unready
            .push((reason::EGRESS_IP_CLAIMED_ELSEWHERE, message.clone()));
        self.claimed_elsewhere.push(message);
    }

    /// An egress IP that another policy names too: kept by the older policy, refused to
    /// the others (`Conflict=True`, reason `EgressIPConflict`, on both).
    pub(super) fn egress_ip_conflict(&mut self, message: String) {
        self.shared_ips.push(message);
    }

    /// A selected pod's address that another pod or a node claims too.
    pub(super) fn address_conflict(&mut self, message: String) {
        self.disputed.push(message);
    }

    /// A selected pod's destination that another policy's longer prefix takes for it
    /// (the first few named, the rest counted).
    pub(super) fn overridden(&mut self, message: String) {
        if self.overridden.len() < MAX_CONFLICTS_NAMED {
            self.overridden.push(message);
        }
        self.overridden_count += 1;
    }

    /// A (pod, prefix) pair this policy lost.
    pub(super) fn conflict(&mut self, message: String) {
        if self.conflicts.len() < MAX_CONFLICTS_NAMED {
            self.conflicts.push(message);
        }
        self.conflict_count += 1;
    }
}

/// What a policy's status is made of: its name, generation and number of rules, and the
/// report its plan gathered.
pub(super) struct Reported<'a> {
    pub(super) name: &'a str,
    pub(super) generation: Option<i64>,
    pub(super) rules: usize,
    pub(super) report: &'a PolicyReport,
}

/// Every policy's status, and the problems its conditions describe (appended to
/// `problems`). `egress_ips`: the addresses in use, by policy.
pub(super) fn statuses<'a>(
    plans: impl IntoIterator<Item = Reported<'a>>,
    mut egress_ips: BTreeMap<String, BTreeSet<EgressIpStatus>>,
    problems: &mut Vec<Problem>,
) -> BTreeMap<String, PolicyStatus> {
    let mut out = BTreeMap::new();
    for plan in plans {
        let report = plan.report;
        let object = Object::Policy(plan.name.to_owned());
        if report.serving_last.is_some() {
            problems.push(Problem {
                object: object.clone(),
                reason: reason::SERVING_LAST_ACCEPTED.to_owned(),
                message: "spec: not accepted: the last accepted version is served".to_owned(),
            });
        }
        let all = report
            .invalid
            .iter()
            .chain(&report.unready)
            .chain(&report.routes)
            .chain(&report.cluster)
            .chain(&report.shared_gateways);
        for (reason, message) in all {
            problems.push(Problem {
                object: object.clone(),
                reason: (*reason).to_owned(),
                message: message.clone(),
            });
        }
        let mut conditions = vec![accepted(report), ready(report, plan.rules)];
        if let Some((reason, _)) = report.routes.first() {
            conditions.push(condition(
                condition::ROUTES_DEGRADED,
                true,
                reason,
                joined(&report.routes),
            ));
        }
        if let Some((reason, _)) = report.cluster.first() {
            conditions.push(condition(
                condition::CLUSTER_EXCLUDED,
                true,
                reason,
                joined(&report.cluster),
            ));
        }
        if let Some((reason, _)) = report.shared_gateways.first() {
            conditions.push(condition(
                condition::EGRESS_IPS_SHARE_GATEWAY,
                true,
                reason,
                joined(&report.shared_gateways),
            ));
        }
        if let Some(message) = &report.unapplied {
            conditions.push(condition(
                condition::ADMIN_POLICIES_NOT_APPLIED,
                true,
                reason::NOT_APPLIED_TO_REDIRECTED_TRAFFIC,
                message.clone(),
            ));
        }
        // Every kind of conflict in one condition, its reason the first kind present.
        let destinations = conflict_message(report);
        if let Some(message) = &destinations {
            problems.push(Problem {
                object: object.clone(),
                reason: reason::DESTINATION_CLAIMED.to_owned(),
                message: message.clone(),
            });
        }
        let mut overridden = report.overridden.clone();
        let more = report.overridden_count.saturating_sub(overridden.len());
        if more > 0 {
            overridden.push(format!("and {more} more destinations overridden"));
        }
        let kinds = [
            (
                reason::EGRESS_IP_CLAIMED_ELSEWHERE,
                report.claimed_elsewhere.clone(),
            ),
            (reason::EGRESS_IP_CONFLICT, report.shared_ips.clone()),
            (reason::POD_ADDRESS_CONFLICT, report.disputed.clone()),
            (
                reason::DESTINATION_CLAIMED,
                destinations.into_iter().collect(),
            ),
            (reason::DESTINATION_OVERRIDDEN, overridden),
        ];
        for (reason, messages) in &kinds[1..3] {
            for message in messages {
                problems.push(Problem {
                    object: object.clone(),
                    reason: (*reason).to_owned(),
                    message: message.clone(),
                });
            }
        }
        if let Some(message) = kinds[4].1.first() {
            problems.push(Problem {
                object: object.clone(),
                reason: reason::DESTINATION_OVERRIDDEN.to_owned(),
                message: message.clone(),
            });
        }
        if let Some((reason, _)) = kinds.iter().find(|(_, m)| !m.is_empty()) {
            let message = kinds
                .iter()
                .flat_map(|(_, m)| m.iter().cloned())
                .collect::<Vec<_>>()
                .join("; ");
            conditions.push(condition(condition::CONFLICT, true, reason, message));
        }
        for c in &mut conditions {
            c.observed_generation = plan.generation;
        }
        out.insert(
            plan.name.to_owned(),
            PolicyStatus {
                observed_generation: plan.generation,
                conditions,
                egress_ips: egress_ips
                    .remove(plan.name)
                    .unwrap_or_default()
                    .into_iter()
                    .collect(),
            },
        );
    }
    out
}

fn joined(items: &[(&'static str, String)]) -> String {
    items
        .iter()
        .map(|(_, m)| m.as_str())
        .collect::<Vec<_>>()
        .join("; ")
}

fn accepted(report: &PolicyReport) -> PolicyCondition {
    match report.invalid.first() {
        None => condition(
            condition::ACCEPTED,
            true,
            reason::ACCEPTED,
            "the policy is valid".to_owned(),
        ),
        Some((reason, _)) => condition(condition::ACCEPTED, false, reason, joined(&report.invalid)),
    }
}

fn ready(report: &PolicyReport, rules: usize) -> PolicyCondition {
    if let Some(generation) = report.serving_last {
        let which = generation.map_or(String::new(), |g| format!(" (generation {g})"));
        condition(
            condition::READY,
            false,
            reason::SERVING_LAST_ACCEPTED,
            format!(
                "the spec is not accepted (see Accepted): its last accepted version{which} is \
                 served until the spec is fixed"
            ),
        )
    } else if !report.invalid.is_empty() {
        condition(
            condition::READY,
            false,
            reason::NOT_ACCEPTED,
            "the policy is not accepted: invalid rules have no gateway and follow the \
             failure policy"
                .to_owned(),
        )
    } else if let Some((reason, _)) = report.unready.first() {
        condition(condition::READY, false, reason, joined(&report.unready))
    } else {
        condition(
            condition::READY,
            true,
            reason::READY,
            format!("every rule ({rules}) has a gateway"),
        )
    }
}

fn conflict_message(report: &PolicyReport) -> Option<String> {
    if report.conflict_count == 0 {
        return None;
    }
    let mut message = report.conflicts.join("; ");
    let more = report.conflict_count.saturating_sub(report.conflicts.len());
    if more > 0 {
        message.push_str(&format!(" (and {more} more)"));
    }
    Some(message)
}

/// A condition of `type_` that holds (`ok`) or not. The writer sets its transition
/// time, [`statuses`] its generation; a message too long for the API is cut.
fn condition(type_: &str, ok: bool, reason: &str, mut message: String) -> PolicyCondition {
    if message.len() > MAX_CONDITION_MESSAGE {
        let mut end = MAX_CONDITION_MESSAGE - 3;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("...");
    }
    PolicyCondition {
        type_: type_.to_owned(),
        status: ok.into(),
        observed_generation: None,
        last_transition_time: None,
        reason: reason.to_owned(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_too_long_for_the_api_is_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_CONDITION_MESSAGE);
        let c = condition(condition::READY, false, reason::NO_ELIGIBLE_GATEWAY, long);
        assert!(
            c.message.len() <= MAX_CONDITION_MESSAGE,
            "{}",
            c.message.len()
        );
        assert!(c.message.ends_with("é..."));
        let short = condition(condition::READY, true, reason::READY, "fine".to_owned());
        assert_eq!(
            (short.message.as_str(), short.status),
            ("fine", crate::api::ConditionStatus::True)
        );
    }
}
