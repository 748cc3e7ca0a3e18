//! Static checks of a rule: what the CRD's schema and CEL rules check in a cluster (a
//! YAML directory has no API server to check it), as conditions naming rule and field.

use std::net::IpAddr;

use ipnet::IpNet;

use super::{reason, status::PolicyReport};
use crate::api::EgressRule;

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
    pub(super) egress_ip: Option<IpAddr>,
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
    let egress_ip = check_target(&at, rule, report);
    let (v6, mixed) = check_family(&at, &destinations, egress_ip, report);
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
        egress_ip,
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

/// Exactly one of `egressIP` (returned when it parses) and `interface` (a valid name).
fn check_target(at: &str, rule: &EgressRule, report: &mut PolicyReport) -> Option<IpAddr> {
    match (&rule.egress_ip, &rule.interface) {
        (Some(_), Some(_)) | (None, None) => report.invalid(
            reason::INVALID_TARGET,
            format!("{at}: exactly one of egressIP or interface must be set"),
        ),
        (Some(text), None) => match text.parse::<IpAddr>() {
            Ok(ip) => return Some(ip),
            Err(_) => report.invalid(
                reason::INVALID_IP,
                format!("{at}.egressIP: invalid IP address {text:?}"),
            ),
        },
        (None, Some(name)) => {
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
        }
    }
    None
}

/// The rule's family: (IPv6, mixed). Destinations of both families, or an egress IP of
/// the other family than the destinations', are reported.
fn check_family(
    at: &str,
    destinations: &[IpNet],
    egress_ip: Option<IpAddr>,
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
        matches!(egress_ip, Some(IpAddr::V6(_)))
    } else {
        v6_dest == destinations.len()
    };
    if let Some(ip) = egress_ip
        && !mixed
        && !destinations.is_empty()
        && ip.is_ipv6() != v6
    {
        report.invalid(
            reason::FAMILY_MISMATCH,
            format!(
                "{at}.egressIP: {ip} is {} but the destinations are {}",
                family_name(ip.is_ipv6()),
                family_name(v6)
            ),
        );
    }
    (v6, mixed)
}
