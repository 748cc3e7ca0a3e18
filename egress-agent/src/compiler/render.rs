//! A compilation in plain text, one fact per line, stable: what the golden tests
//! (`egress-agent/tests/golden/`) compare, so that a change to the compiler shows as a
//! reviewable diff of entries, holders and statuses.

use std::{fmt::Write as _, net::IpAddr};

use super::Compiled;
use crate::desired::PolicyAction;

fn action(a: PolicyAction) -> &'static str {
    match a {
        PolicyAction::Forward => "forward",
        PolicyAction::Exclude => "exclude",
        PolicyAction::NoGatewayDrop => "no-gateway-drop",
        PolicyAction::NoGatewayPass => "no-gateway-pass",
    }
}

fn or_dash(x: Option<impl std::fmt::Display>) -> String {
    x.map_or_else(|| "-".to_owned(), |x| x.to_string())
}

/// One policy entry, the same line for both families.
fn policy_line(
    s: &mut String,
    pod: &dyn std::fmt::Display,
    dst: &dyn std::fmt::Display,
    act: PolicyAction,
    gateway: Option<IpAddr>,
    egress: Option<IpAddr>,
    rule: u32,
) {
    let _ = writeln!(
        s,
        "policy {pod} -> {dst}: {} gw {} egress {} rule {rule}",
        action(act),
        or_dash(gateway),
        or_dash(egress),
    );
}

/// This node's desired datapath state (the source side, then the gateway side).
pub fn node(c: &Compiled) -> String {
    let d = &c.desired;
    let mut s = String::new();
    let _ = writeln!(s, "node address {}", or_dash(d.node_ip));
    for ((pod, dst), e) in &d.v4.policy {
        let egress = e.egress_ip.map(IpAddr::V4);
        policy_line(&mut s, pod, dst, e.action, e.gateway, egress, e.rule_id);
    }
    for ((pod, dst), e) in &d.v6.policy {
        let egress = e.egress_ip.map(IpAddr::V6);
        policy_line(&mut s, pod, dst, e.action, e.gateway, egress, e.rule_id);
    }
    for (id, r) in &d.v4.rules {
        let _ = writeln!(
            s,
            "serves rule {id}: egress {} on {}",
            r.egress_ip, r.interface
        );
    }
    for (id, r) in &d.v6.rules {
        let _ = writeln!(
            s,
            "serves rule {id}: egress {} on {}",
            r.egress_ip, r.interface
        );
    }
    let held =
        d.v4.egress_ips
            .iter()
            .map(|(ip, h)| (ip.to_string(), h))
            .chain(d.v6.egress_ips.iter().map(|(ip, h)| (ip.to_string(), h)));
    for (ip, h) in held {
        let how = if h.shared { "uses" } else { "holds" };
        let _ = writeln!(s, "{how} {ip}/{} on {}", h.prefix_len, h.interface);
    }
    for (pod, rule) in &d.admitted {
        let _ = writeln!(s, "admits {pod} for rule {rule}");
    }
    for (prefix, covered) in &d.covered {
        let what = if *covered { "covered" } else { "except" };
        let _ = writeln!(s, "unknown pods: {prefix} {what}");
    }
    s
}

/// What is the same on every node: holders, policy statuses, problems.
pub fn cluster(c: &Compiled) -> String {
    let mut s = String::new();
    for h in &c.holders {
        let _ = writeln!(
            s,
            "holder {} ({}/rules[{}], rule {}): {} on {}{}, {}",
            h.ip,
            h.policy,
            h.rule,
            h.rule_id,
            h.node,
            h.interface,
            if h.shared { " (shared)" } else { "" },
            h.reason
        );
    }
    for (name, st) in &c.statuses {
        for cond in &st.conditions {
            let _ = writeln!(
                s,
                "policy {name}: {}={} {}: {}",
                cond.type_, cond.status, cond.reason, cond.message
            );
        }
    }
    for p in &c.problems {
        let _ = writeln!(s, "problem {p}");
    }
    s
}
