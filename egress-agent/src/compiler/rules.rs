//! Static checks of a rule: what the CRD's schema and CEL rules check in a cluster (a
//! YAML directory has no API server to check it), as conditions naming rule and field.

use std::net::IpAddr;

use ipnet::IpNet;

use super::{reason, status::PolicyReport};
use crate::api::{EgressRule, MAX_RULE_EGRESS_IPS};

fn family_name(v6: bool) -> &'static str {
    if v6 { "IPv6" } else { "IPv4" }
}

/// A rule after static checks.
pub(super) struct CheckedRule {
    /// Every check passed.
    pub(super) valid: bool,
    /// The rule is IPv6 (its destinations, or its egress IP when destinations are absent).
    pub(super) v6: bool,
    /// Parsed destinations/excepts (both families only in an invalid rule).
    pub(super) destinations: Vec<IpNet>,
    pub(super) except: Vec<IpNet>,
    /// Its dedicated egress addresses (`egressIP`, or `egressIPs` in the order written)
    /// that parse; empty for an `interface:` rule.
    pub(super) egress_ips: Vec<IpAddr>,
    /// The rule's interface (an `interface:` rule).
    pub(super) interface: Option<String>,
    /// `destinationsFrom: Routes`: the destinations are learned from the gateways'
    /// routes; `Some(include_default)`.
    pub(super) from_routes: Option<bool>,
}

/// Parse a prefix that must have no host bits.
fn parse_prefix(text: &str, field: &str) -> Result<IpNet, (&'static str, String)> {
    let net: IpNet = text.parse().map_err(|_| {
        (
            reason::INVALID_CIDR,
            format!("{field}: invalid CIDR {text:?} (expected e.g. 192.0.2.0/24)"),
        )
    })?;
    if net.trunc() != net {
        return Err((
            reason::INVALID_CIDR,
            format!(
                "{field}: {text} has host bits set (did you mean {}?)",
                net.trunc()
            ),
        ));
    }
    Ok(net)
}

/// Static checks of one rule (what CEL checks in a cluster; a YAML directory has none).
/// Returns `None` when nothing usable is left (no destination parsed, and none to learn).
pub(super) fn check_rule(
    index: usize,
    rule: &EgressRule,
    report: &mut PolicyReport,
) -> Option<CheckedRule> {
    let at = format!("rules[{index}]");
    let before = report.invalid_count();
    let from_routes = check_destination_kind(&at, rule, report);
    let destinations = parse_destinations(&at, rule, report);
    let except = parse_except(&at, rule, from_routes.is_some(), &destinations, report);
    let egress_ips = check_target(&at, rule, report);
    let listed = !rule.egress_ips.is_empty();
    let (v6, mixed) = check_family(&at, &destinations, (&egress_ips, listed), report);
    let valid = report.invalid_count() == before;
    if destinations.is_empty() && from_routes.is_none() {
        return None;
    }
    Some(CheckedRule {
        valid,
        // A mixed rule is invalid: both families follow the failure policy.
        v6: v6 && !mixed,
        destinations,
        except,
        egress_ips,
        interface: rule.interface.clone(),
        from_routes,
    })
}

/// Listed destinations or `destinationsFrom`, exactly one; `includeDefault` only with the
/// latter. Returns whether the destinations are learned (`Some(include_default)`).
fn check_destination_kind(at: &str, rule: &EgressRule, report: &mut PolicyReport) -> Option<bool> {
    let from_routes = rule
        .destinations_from
        .map(|_| rule.include_default == Some(true));
    match (rule.destinations.is_empty(), from_routes.is_some()) {
        (true, false) => report.invalid(
            reason::NO_DESTINATIONS,
            format!(
                "{at}.destinations: at least one destination is required (or \
                 destinationsFrom: Routes)"
            ),
        ),
        (false, true) => report.invalid(
            reason::INVALID_DESTINATIONS,
            format!(
                "{at}.destinationsFrom: exactly one of destinations or destinationsFrom must \
                 be set"
            ),
        ),
        _ => {}
    }
    if rule.include_default.is_some() && from_routes.is_none() {
        report.invalid(
            reason::INVALID_DESTINATIONS,
            format!("{at}.includeDefault: applies only with destinationsFrom"),
        );
    }
    from_routes
}

/// The listed destinations that parse (each one that does not is reported).
fn parse_destinations(at: &str, rule: &EgressRule, report: &mut PolicyReport) -> Vec<IpNet> {
    let mut destinations = Vec::new();
    for (i, text) in rule.destinations.iter().enumerate() {
        match parse_prefix(text, &format!("{at}.destinations[{i}]")) {
            Ok(net) => destinations.push(net),
            Err((reason, message)) => report.invalid(reason, message),
        }
    }
    destinations
}

/// The `except` prefixes that parse and fall inside a listed destination (any, when the
/// destinations are learned: they are not known here, and an except applies where it
/// falls).
fn parse_except(
    at: &str,
    rule: &EgressRule,
    learned: bool,
    destinations: &[IpNet],
    report: &mut PolicyReport,
) -> Vec<IpNet> {
    let mut except = Vec::new();
    for (i, text) in rule.except.iter().enumerate() {
        let field = format!("{at}.except[{i}]");
        match parse_prefix(text, &field) {
            Ok(net) if learned || destinations.iter().any(|d| d.contains(&net)) => {
                except.push(net);
            }
            Ok(net) => report.invalid(
                reason::EXCEPT_OUTSIDE_DESTINATIONS,
                format!("{field}: {net} is not inside any of the destinations"),
            ),
            Err((reason, message)) => report.invalid(reason, message),
        }
    }
    except
}

/// Exactly one of `egressIP`, `egressIPs` (the addresses that parse are returned, each
/// once) and `interface` (a valid name).
fn check_target(at: &str, rule: &EgressRule, report: &mut PolicyReport) -> Vec<IpAddr> {
    let set = [
        rule.egress_ip.is_some(),
        !rule.egress_ips.is_empty(),
        rule.interface.is_some(),
    ];
    if set.iter().filter(|s| **s).count() != 1 {
        report.invalid(
            reason::INVALID_TARGET,
            format!("{at}: exactly one of egressIP, egressIPs or interface must be set"),
        );
        return Vec::new();
    }
    if let Some(text) = &rule.egress_ip {
        return match text.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) => {
                report.invalid(
                    reason::INVALID_IP,
                    format!("{at}.egressIP: invalid IP address {text:?}"),
                );
                Vec::new()
            }
        };
    }
    if let Some(name) = &rule.interface {
        if name.is_empty()
            || name.len() > 15
            || name.contains(['/', ':'])
            || name.contains(char::is_whitespace)
        {
            report.invalid(
                reason::INVALID_INTERFACE,
                format!("{at}.interface: {name:?} is not a valid interface name"),
            );
        }
        return Vec::new();
    }
    check_egress_ips(at, &rule.egress_ips, report)
}

/// The addresses of an `egressIPs` list: each parses, none twice, one family, at most
/// [`MAX_RULE_EGRESS_IPS`].
fn check_egress_ips(at: &str, texts: &[String], report: &mut PolicyReport) -> Vec<IpAddr> {
    if texts.len() > MAX_RULE_EGRESS_IPS {
        report.invalid(
            reason::INVALID_TARGET,
            format!(
                "{at}.egressIPs: lists {} addresses; at most {MAX_RULE_EGRESS_IPS}",
                texts.len()
            ),
        );
    }
    let mut ips: Vec<IpAddr> = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let field = format!("{at}.egressIPs[{i}]");
        match text.parse::<IpAddr>() {
            Err(_) => report.invalid(
                reason::INVALID_IP,
                format!("{field}: invalid IP address {text:?}"),
            ),
            Ok(ip) => match ips.iter().position(|a| *a == ip) {
                Some(first) => report.invalid(
                    reason::INVALID_IP,
                    format!("{field}: {ip} is listed already (egressIPs[{first}])"),
                ),
                None => {
                    if let Some(first) = ips.first()
                        && first.is_ipv6() != ip.is_ipv6()
                    {
                        report.invalid(
                            reason::FAMILY_MISMATCH,
                            format!(
                                "{field}: {ip} is {} but egressIPs[0] is {}",
                                family_name(ip.is_ipv6()),
                                family_name(first.is_ipv6())
                            ),
                        );
                    }
                    ips.push(ip);
                }
            },
        }
    }
    ips
}

/// The rule's family: (IPv6, mixed). Destinations of both families, or an egress IP of
/// the other family than the destinations', are reported (`listed`: the addresses are an
/// `egressIPs` list).
fn check_family(
    at: &str,
    destinations: &[IpNet],
    (egress_ips, listed): (&[IpAddr], bool),
    report: &mut PolicyReport,
) -> (bool, bool) {
    let v6_dest = destinations
        .iter()
        .filter(|d| matches!(d, IpNet::V6(_)))
        .count();
    let mixed = v6_dest != 0 && v6_dest != destinations.len();
    if mixed {
        report.invalid(
            reason::FAMILY_MISMATCH,
            format!("{at}.destinations: mixes IPv4 and IPv6 prefixes"),
        );
    }
    let v6 = if destinations.is_empty() {
        egress_ips.first().is_some_and(IpAddr::is_ipv6)
    } else {
        v6_dest == destinations.len()
    };
    // One address of the other family is enough to say (egressIPs are one family, or
    // said so already).
    if let Some((i, ip)) = egress_ips
        .iter()
        .enumerate()
        .find(|(_, ip)| ip.is_ipv6() != v6)
        && !mixed
        && !destinations.is_empty()
    {
        let field = if listed {
            format!("egressIPs[{i}]")
        } else {
            "egressIP".to_owned()
        };
        report.invalid(
            reason::FAMILY_MISMATCH,
            format!(
                "{at}.{field}: {ip} is {} but the destinations are {}",
                family_name(ip.is_ipv6()),
                family_name(v6)
            ),
        );
    }
    (v6, mixed)
}

/// An address of an `egressIPs` list must be in no other rule of the spec (as `egressIP`
/// or in its `egressIPs`): each address is placed and spread for one rule. Reports each
/// later naming, and returns the indexes of the rules that name one.
pub(super) fn check_addresses_across_rules(
    rules: &[EgressRule],
    report: &mut PolicyReport,
) -> std::collections::BTreeSet<usize> {
    let mut refused = std::collections::BTreeSet::new();
    let mut first: Vec<(IpAddr, usize, bool)> = Vec::new();
    for (index, rule) in rules.iter().enumerate() {
        let listed = !rule.egress_ips.is_empty();
        for (k, ip) in rule.dedicated_ips().enumerate() {
            let earlier = first
                .iter()
                .find(|(a, i, _)| *a == ip && *i != index)
                .copied();
            match earlier {
                Some((_, i, earlier_listed)) if listed || earlier_listed => {
                    let field = if listed {
                        format!("rules[{index}].egressIPs[{k}]")
                    } else {
                        format!("rules[{index}].egressIP")
                    };
                    report.invalid(
                        reason::INVALID_IP,
                        format!(
                            "{field}: {ip} is also in rules[{i}]: an address of an egressIPs \
                             list belongs to that rule alone"
                        ),
                    );
                    refused.insert(index);
                }
                Some(_) => {}
                None => first.push((ip, index, listed)),
            }
        }
    }
    refused
}
