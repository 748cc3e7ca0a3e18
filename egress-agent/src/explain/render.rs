//! An [`Explanation`] in words: one `label: text` line per fact, the verdict first.

use std::{fmt::Write as _, net::IpAddr};

use super::{
    Explanation, Hop, Match, Miss, NetworkPolicyVerdict, NotSteered, Origin, Outcome, Target,
};
use crate::{api::FailurePolicy, compiler::render::ports, desired::PolicyAction};

/// Width of the labels.
const LABEL: usize = 16;

fn line(s: &mut String, label: &str, text: impl std::fmt::Display) {
    let _ = writeln!(s, "{:<LABEL$}{text}", format!("{label}:"));
}

/// A continuation line under the previous one.
fn more(s: &mut String, text: impl std::fmt::Display) {
    let _ = writeln!(s, "{:<LABEL$}{text}", "");
}

fn list(ips: &[IpAddr]) -> String {
    ips.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The whole explanation.
pub fn text(e: &Explanation) -> String {
    let mut s = String::new();
    let addr = e.pod_ip.map_or(String::new(), |ip| format!("{ip}, "));
    let node = e
        .node
        .as_deref()
        .map_or("not scheduled".to_owned(), |n| format!("on node {n}"));
    line(&mut s, "pod", format!("{} ({addr}{node})", e.pod));
    line(&mut s, "destination", e.destination);
    match &e.outcome {
        Outcome::NotSteered(why) => not_steered(&mut s, why),
        Outcome::Matched(m) => matched(&mut s, m),
        Outcome::Untouched(misses) => untouched(&mut s, misses),
    }
    s
}

fn not_steered(s: &mut String, why: &NotSteered) {
    let (what, fix) = match why {
        NotSteered::NotScheduled => (
            "the pod has no node yet (spec.nodeName is empty)".to_owned(),
            "no datapath sees it until it is scheduled",
        ),
        NotSteered::HostNetwork => (
            "the pod uses the host's network (spec.hostNetwork: true)".to_owned(),
            "its packets are the node's own: no policy applies to them",
        ),
        NotSteered::NotRunning => (
            "the pod is not Running (status.phase)".to_owned(),
            "policies apply to running pods only",
        ),
        NotSteered::NoAddressOfFamily { family, ips } => (
            format!(
                "the pod has no {family} address (status.podIPs: {})",
                if ips.is_empty() {
                    "none".to_owned()
                } else {
                    list(ips)
                }
            ),
            "nothing of that family is steered for it",
        ),
    };
    line(s, "verdict", "untouched: not steered by any policy");
    line(s, "why", what);
    more(s, fix);
}

fn matched(s: &mut String, m: &Match) {
    line(s, "verdict", verdict(m));
    line(
        s,
        "policy",
        format!("{} rules[{}] (rule id {})", m.policy, m.rule, m.rule_id),
    );
    let origin = match &m.origin {
        Origin::Listed(p) if *p == m.prefix => format!("destination {p} of the rule"),
        Origin::Listed(p) => format!(
            "inside destination {p} of the rule (split where a NetworkPolicy ipBlock or \
             an except ends)"
        ),
        Origin::Except(p) => format!("except {p} of the rule"),
        Origin::Learned => {
            "learned from the gateway's routes (destinationsFrom: Routes)".to_owned()
        }
        Origin::Cluster => "the cluster's own addresses, carved out of the rule".to_owned(),
    };
    line(
        s,
        "matched",
        format!(
            "{} ({origin}; the longest of the pod's {} prefixes containing it)",
            m.prefix, m.entries
        ),
    );
    if let Some(hop) = &m.gateway {
        line(s, "gateway", hop_text(hop));
    }
    match m.action {
        PolicyAction::Forward => {
            if let Some(text) = egress_text(m) {
                line(s, "egress IP", text);
            }
        }
        PolicyAction::NoGatewayDrop | PolicyAction::NoGatewayPass => {
            if let Some(text) = egress_text(m) {
                line(s, "egress IP", format!("{text}; no gateway serves it now"));
            }
        }
        // The pod's own address, or nothing.
        PolicyAction::Exclude | PolicyAction::Deny => {}
    }
    line(s, "NetworkPolicy", network_policy(&m.network_policy));
    if m.action != PolicyAction::Exclude {
        line(s, "no gateway", failure(m.failure_policy));
    }
    if let Some((node, why)) = &m.status_holder {
        let why = why.as_deref().map_or(String::new(), |w| format!(" ({w})"));
        line(
            s,
            "note",
            format!(
                "the policy's status puts {} on {node}{why}: the agents probe the gateways, \
                 explain takes every gateway with an EgressNode as alive; the status is what \
                 they serve",
                m.egress_ip
                    .map_or("the address".to_owned(), |ip| ip.to_string())
            ),
        );
    }
    for (type_, status, reason, message) in &m.conditions {
        line(
            s,
            "condition",
            format!("{type_}={status} {reason}: {message}"),
        );
    }
}

/// The one-line verdict of a match.
fn verdict(m: &Match) -> String {
    match m.action {
        PolicyAction::Forward if m.network_policy.drops() => {
            "dropped: its egress NetworkPolicies do not allow it (DROP_NETWORK_POLICY)".to_owned()
        }
        PolicyAction::Forward => {
            let via = m
                .gateway
                .as_ref()
                .map_or("a gateway".to_owned(), |h| match &h.interface {
                    Some(i) => format!("gateway {} by {i}", h.node),
                    None => format!("gateway {}", h.node),
                });
            match m.egress_ip {
                Some(ip) => format!("redirected: leaves {via} as {ip}"),
                None => format!("redirected: leaves {via}"),
            }
        }
        PolicyAction::Exclude => {
            "untouched: an except of the policy (leaves with the pod's own address, as \
             the CNI sends it)"
                .to_owned()
        }
        PolicyAction::NoGatewayDrop => {
            "dropped: the rule has no usable gateway (failurePolicy Drop; DROP_NO_GATEWAY)"
                .to_owned()
        }
        PolicyAction::NoGatewayPass => {
            "untouched: the rule has no usable gateway (failurePolicy Fallthrough; the \
             pod's own address)"
                .to_owned()
        }
        PolicyAction::Deny => {
            "dropped: its egress NetworkPolicies allow nothing toward it (DROP_NETWORK_POLICY)"
                .to_owned()
        }
    }
}

fn hop_text(hop: &Hop) -> String {
    let mut t = hop.node.clone();
    if let Some(u) = hop.underlay {
        let _ = write!(t, " (underlay {u})");
    }
    if let Some(i) = &hop.interface {
        let _ = write!(t, ", interface {i}");
    }
    if hop.local {
        t.push_str("; the pod's own node: no tunnel");
    } else {
        t.push_str("; through the tunnel");
    }
    t
}

fn egress_text(m: &Match) -> Option<String> {
    let ip = m.egress_ip;
    match &m.target {
        Target::EgressIp(want) => Some(format!("{} (the rule's egressIP)", ip.unwrap_or(*want))),
        Target::EgressIps(all) => ip.map(|ip| {
            format!(
                "{ip}, the one of egressIPs {} this pod's address hashes to (it keeps it \
                 while that address is held anywhere)",
                list(all)
            )
        }),
        Target::Interface(name) => Some(match ip {
            Some(ip) => format!(
                "{ip}, the gateway's own address on {name} (interface rule; pods spread \
                 over the gateways that have {name})"
            ),
            None => format!("the gateway's own address on {name} (interface rule)"),
        }),
    }
}

fn by(policies: &[String]) -> String {
    policies.join(", ")
}

fn network_policy(v: &NetworkPolicyVerdict) -> String {
    match v {
        NetworkPolicyVerdict::LeftToCni => {
            "not applied here: the datapath leaves these packets to the host, where the CNI \
             applies NetworkPolicy"
                .to_owned()
        }
        NetworkPolicyVerdict::NotRestricted => {
            "allowed (no NetworkPolicy selects the pod for Egress)".to_owned()
        }
        NetworkPolicyVerdict::Allowed { by: b } => {
            format!("allowed on every port (by {})", by(b))
        }
        NetworkPolicyVerdict::Ports {
            by: b,
            ports: p,
            asked,
        } => {
            let allowed = if p.is_empty() {
                "no port".to_owned()
            } else {
                ports(p)
            };
            match asked {
                Some(true) => format!("allowed: {} allow {allowed} there", by(b)),
                Some(false) => format!(
                    "denied: {} allow only {allowed} there (DROP_NETWORK_POLICY)",
                    by(b)
                ),
                None => format!("only {allowed} allowed there (by {})", by(b)),
            }
        }
        NetworkPolicyVerdict::Denied { by: b } if b.is_empty() => {
            "denied (DROP_NETWORK_POLICY)".to_owned()
        }
        NetworkPolicyVerdict::Denied { by: b } => {
            format!(
                "denied: {} isolate the pod for Egress and allow nothing toward it \
                 (DROP_NETWORK_POLICY)",
                by(b)
            )
        }
    }
}

/// What the rule's traffic does when no gateway is alive.
pub(super) fn failure(policy: FailurePolicy) -> &'static str {
    match policy {
        FailurePolicy::Drop => {
            "failurePolicy Drop: dropped and counted (DROP_NO_GATEWAY), never sent with \
             another address"
        }
        FailurePolicy::Fallthrough => {
            "failurePolicy Fallthrough: leaves untouched, with the pod's own address \
             (FALLTHROUGH)"
        }
    }
}

fn untouched(s: &mut String, misses: &[Miss]) {
    line(
        s,
        "verdict",
        "untouched: no policy takes it (leaves with the pod's own address, as the CNI \
         sends it)",
    );
    if misses.is_empty() {
        line(s, "why", "no EgressGatewayPolicy exists");
        return;
    }
    for miss in misses {
        line(s, "why", miss_text(miss));
    }
}

fn miss_text(miss: &Miss) -> String {
    match miss {
        Miss::NotAccepted {
            policy,
            reason,
            message,
        } => format!("policy {policy} is not accepted ({reason}: {message})"),
        Miss::NamespaceNotSelected { policy } => {
            format!("policy {policy} does not select the pod's namespace (spec.namespaceSelector)")
        }
        Miss::PodNotSelected { policy } => {
            format!("policy {policy} does not select the pod (spec.podSelector)")
        }
        Miss::NotCovered { policy, prefixes } => {
            let names: Vec<String> = prefixes.iter().map(ToString::to_string).collect();
            format!(
                "policy {policy} selects the pod, but the destination is in none of its \
                 prefixes for it ({})",
                names.join(", ")
            )
        }
        Miss::NoEntries { policy, conflicts } if conflicts.is_empty() => format!(
            "policy {policy} selects the pod, but steers none of its traffic of this \
             address family (destinations of the other family, or none learned)"
        ),
        Miss::NoEntries { policy, conflicts } => format!(
            "policy {policy} selects the pod, but its destinations for it are taken: {}",
            conflicts.join("; ")
        ),
    }
}
