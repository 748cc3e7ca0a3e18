//! A compilation in plain text, one fact per line, stable: what the golden tests
//! (`egress-agent/tests/golden/`) compare, so that a change to the compiler shows as a
//! reviewable diff of entries, holders and statuses.

use std::{fmt::Write as _, net::IpAddr};

use super::compiled::Compiled;
use crate::desired::{Family, PolicyAction, PolicyEntry, PortSet};

fn action(a: PolicyAction) -> &'static str {
    match a {
        PolicyAction::Forward => "forward",
        PolicyAction::Exclude => "exclude",
        PolicyAction::NoGatewayDrop => "no-gateway-drop",
        PolicyAction::NoGatewayPass => "no-gateway-pass",
        PolicyAction::Deny => "deny (NetworkPolicy)",
    }
}

fn or_dash(x: Option<impl std::fmt::Display>) -> String {
    x.map_or_else(|| "-".to_owned(), |x| x.to_string())
}

/// A port filter as `tcp/80,udp/53-54`.
pub fn ports(set: &PortSet) -> String {
    let name = |p: u8| match p {
        6 => "tcp".to_owned(),
        17 => "udp".to_owned(),
        132 => "sctp".to_owned(),
        p => format!("proto{p}"),
    };
    set.iter()
        .map(|(p, a, b)| {
            if a == b {
                format!("{}/{a}", name(*p))
            } else {
                format!("{}/{a}-{b}", name(*p))
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// One policy entry, the same line for both families (its allowed ports after it, if
/// NetworkPolicy limits them: `filter`).
fn policy_line<F: Family>(
    s: &mut String,
    (pod, dst): (&F::Addr, &F::Net),
    e: &PolicyEntry<F>,
    filter: Option<&PortSet>,
) {
    let _ = writeln!(
        s,
        "policy {pod} -> {dst}: {} gw {} egress {} rule {}{}",
        action(e.action),
        or_dash(e.gateway),
        or_dash(e.egress_ip.map(Into::<IpAddr>::into)),
        e.rule_id,
        filter.map_or(String::new(), |f| format!(" ports {}", ports(f))),
    );
}

/// This node's desired datapath state (the source side, then the gateway side).
pub fn node(c: &Compiled) -> String {
    let d = &c.desired;
    let mut s = String::new();
    let _ = writeln!(s, "node address {}", or_dash(d.node_ip));
    for ((pod, dst), e) in &d.v4.policy {
        policy_line(&mut s, (pod, dst), e, d.port_filters.get(&e.filter));
    }
    for ((pod, dst), e) in &d.v6.policy {
        policy_line(&mut s, (pod, dst), e, d.port_filters.get(&e.filter));
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
            "holder {} ({}/rules[{}], rule {}): {} on {}{}, {}, pods {}",
            h.ip,
            h.policy,
            h.rule,
            h.rule_id,
            h.node,
            h.interface,
            if h.shared {
                " (shared)".to_owned()
            } else {
                format!(" epoch {}", h.epoch)
            },
            h.reason,
            h.pods
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
