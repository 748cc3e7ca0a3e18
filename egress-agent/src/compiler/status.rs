//! Policy status: the conditions each plan gathered, turned into `Accepted`, `Ready` and
//! `Conflict`, and the problems every agent logs and counts.

use std::collections::{BTreeMap, BTreeSet};

use super::{
    compiled::{Object, Problem},
    condition, reason,
};
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
        let mut conditions = vec![accepted(report), ready(report, plan.rules)];
        conditions.extend(degraded(report));
        let conflicts = conflicts(report);
        conditions.extend(conflict(&conflicts));
        for c in &mut conditions {
            c.observed_generation = plan.generation;
        }
        let told = told(report).chain(conflicts.iter().flat_map(ConflictKind::told));
        problems.extend(told.map(|(reason, message)| Problem {
            object: object.clone(),
            reason: reason.to_owned(),
            message,
        }));
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

/// The (reason, message) of every problem a report tells besides its conflicts.
fn told(report: &PolicyReport) -> impl Iterator<Item = (&'static str, String)> + '_ {
    let serving_last = report.serving_last.map(|_| {
        (
            reason::SERVING_LAST_ACCEPTED,
            "spec: not accepted: the last accepted version is served".to_owned(),
        )
    });
    let all = report
        .invalid
        .iter()
        .chain(&report.unready)
        .chain(&report.routes)
        .chain(&report.cluster)
        .chain(&report.shared_gateways);
    serving_last
        .into_iter()
        .chain(all.map(|(reason, message)| (*reason, message.clone())))
}

/// The conditions that say a served policy is degraded: `RoutesDegraded`,
/// `ClusterExcluded`, `EgressIPsShareGateway`, `AdminPoliciesNotApplied` (those that hold).
fn degraded(report: &PolicyReport) -> Vec<PolicyCondition> {
    let lists = [
        (condition::ROUTES_DEGRADED, &report.routes),
        (condition::CLUSTER_EXCLUDED, &report.cluster),
        (condition::EGRESS_IPS_SHARE_GATEWAY, &report.shared_gateways),
    ];
    let mut out: Vec<PolicyCondition> = lists
        .into_iter()
        .filter_map(|(type_, items)| {
            let (reason, _) = items.first()?;
            Some(condition(type_, true, reason, joined(items)))
        })
        .collect();
    if let Some(message) = &report.unapplied {
        out.push(condition(
            condition::ADMIN_POLICIES_NOT_APPLIED,
            true,
            reason::NOT_APPLIED_TO_REDIRECTED_TRAFFIC,
            message.clone(),
        ));
    }
    out
}

/// How the messages of a kind of conflict are told among the problems.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Told {
    /// Each message is a problem.
    Each,
    /// The first message is (the rest are counted in it).
    First,
    /// Already told under another reason (a `Ready=False` one).
    Already,
}

/// The messages of one kind of conflict a policy is in.
#[derive(Debug)]
struct ConflictKind {
    reason: &'static str,
    messages: Vec<String>,
    told: Told,
}

impl ConflictKind {
    /// The (reason, message) of the problems these messages make.
    fn told(&self) -> impl Iterator<Item = (&'static str, String)> + '_ {
        let count = match self.told {
            Told::Each => self.messages.len(),
            Told::First => 1,
            Told::Already => 0,
        };
        self.messages
            .iter()
            .take(count)
            .map(|m| (self.reason, m.clone()))
    }
}

/// Every kind of conflict, in precedence order: the `Conflict` condition takes the
/// reason of the first kind present. An egress IP left to another implementation comes
/// first, then one another policy names, a disputed pod address, a destination another
/// rule claimed, and last a destination another policy's longer prefix overrides.
fn conflicts(report: &PolicyReport) -> [ConflictKind; 5] {
    let mut overridden = report.overridden.clone();
    let more = report.overridden_count.saturating_sub(overridden.len());
    if more > 0 {
        overridden.push(format!("and {more} more destinations overridden"));
    }
    let kind = |reason, messages, told| ConflictKind {
        reason,
        messages,
        told,
    };
    [
        kind(
            reason::EGRESS_IP_CLAIMED_ELSEWHERE,
            report.claimed_elsewhere.clone(),
            Told::Already,
        ),
        kind(
            reason::EGRESS_IP_CONFLICT,
            report.shared_ips.clone(),
            Told::Each,
        ),
        kind(
            reason::POD_ADDRESS_CONFLICT,
            report.disputed.clone(),
            Told::Each,
        ),
        kind(
            reason::DESTINATION_CLAIMED,
            conflict_message(report).into_iter().collect(),
            Told::Each,
        ),
        kind(reason::DESTINATION_OVERRIDDEN, overridden, Told::First),
    ]
}

/// Every kind of conflict in one condition, its reason the first kind present
/// ([`conflicts`] gives the precedence).
fn conflict(kinds: &[ConflictKind]) -> Option<PolicyCondition> {
    let first = kinds.iter().find(|k| !k.messages.is_empty())?;
    let message = kinds
        .iter()
        .flat_map(|k| k.messages.iter().cloned())
        .collect::<Vec<_>>()
        .join("; ");
    Some(condition(condition::CONFLICT, true, first.reason, message))
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

    /// A report with one message of each named kind of conflict.
    fn report_with(kinds: &[&str]) -> PolicyReport {
        let mut report = PolicyReport::default();
        for kind in kinds {
            let message = format!("{kind} message");
            match *kind {
                "elsewhere" => report.claimed_elsewhere(message),
                "egress-ip" => report.egress_ip_conflict(message),
                "address" => report.address_conflict(message),
                "claimed" => report.conflict(message),
                "overridden" => report.overridden(message),
                other => panic!("no kind {other}"),
            }
        }
        report
    }

    #[test]
    fn the_conflict_condition_takes_the_reason_of_the_first_kind_in_precedence_order() {
        let cases: [(&[&str], &str, &str); 6] = [
            (
                &["overridden", "claimed", "address", "egress-ip", "elsewhere"],
                reason::EGRESS_IP_CLAIMED_ELSEWHERE,
                "elsewhere message; egress-ip message; address message; claimed message; \
                 overridden message",
            ),
            (
                &["overridden", "address", "egress-ip"],
                reason::EGRESS_IP_CONFLICT,
                "egress-ip message; address message; overridden message",
            ),
            (
                &["overridden", "claimed", "address"],
                reason::POD_ADDRESS_CONFLICT,
                "address message; claimed message; overridden message",
            ),
            (
                &["overridden", "claimed"],
                reason::DESTINATION_CLAIMED,
                "claimed message; overridden message",
            ),
            (
                &["overridden"],
                reason::DESTINATION_OVERRIDDEN,
                "overridden message",
            ),
            (
                &["elsewhere"],
                reason::EGRESS_IP_CLAIMED_ELSEWHERE,
                "elsewhere message",
            ),
        ];
        for (kinds, want_reason, want_message) in cases {
            let c = conflict(&conflicts(&report_with(kinds))).expect("a conflict");
            assert_eq!(
                (c.type_.as_str(), c.reason.as_str(), c.message.as_str()),
                (condition::CONFLICT, want_reason, want_message),
                "{kinds:?}"
            );
        }
        assert!(conflict(&conflicts(&PolicyReport::default())).is_none());
    }

    #[test]
    fn each_kind_of_conflict_is_told_among_the_problems_as_its_kind_says() {
        let mut report = report_with(&["elsewhere", "egress-ip", "egress-ip", "address"]);
        for _ in 0..5 {
            report.overridden("overridden message".to_owned());
        }
        for _ in 0..2 {
            report.conflict("claimed message".to_owned());
        }
        let plan = Reported {
            name: "p",
            generation: Some(1),
            rules: 1,
            report: &report,
        };
        let mut problems = Vec::new();
        statuses([plan], BTreeMap::new(), &mut problems);
        let told: Vec<(&str, &str)> = problems
            .iter()
            .map(|p| (p.reason.as_str(), p.message.as_str()))
            .collect();
        assert_eq!(
            told,
            [
                // Told once, as what keeps the rule from being served.
                (reason::EGRESS_IP_CLAIMED_ELSEWHERE, "elsewhere message"),
                // Each message.
                (reason::EGRESS_IP_CONFLICT, "egress-ip message"),
                (reason::EGRESS_IP_CONFLICT, "egress-ip message"),
                (reason::POD_ADDRESS_CONFLICT, "address message"),
                // One message with the rest counted in it.
                (
                    reason::DESTINATION_CLAIMED,
                    "claimed message; claimed message"
                ),
                // The first message only.
                (reason::DESTINATION_OVERRIDDEN, "overridden message"),
            ]
        );
    }
}
