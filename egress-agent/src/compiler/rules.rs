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
    let mut fail = |reason: &'static str, message: String| {
        report.invalid(reason, message);
    };
    let from_routes = rule
        .destinations_from
        .map(|_| rule.include_default == Some(true));
    match (rule.destinations.is_empty(), from_routes.is_some()) {
        (true, false) => fail(
            reason::NO_DESTINATIONS,
            format!(
                "{at}.destinations: at least one destination is required (or \
                 destinationsFrom: Routes)"
            ),
        ),
        (false, true) => fail(
            reason::INVALID_DESTINATIONS,
            format!(
                "{at}.destinationsFrom: exactly one of destinations or destinationsFrom must \
                 be set"
            ),
        ),
        _ => {}
    }
    if rule.include_default.is_some() && from_routes.is_none() {
        fail(
            reason::INVALID_DESTINATIONS,
            format!("{at}.includeDefault: applies only with destinationsFrom"),
        );
    }
    let mut destinations = Vec::new();
    for (i, text) in rule.destinations.iter().enumerate() {
        match parse_prefix(text, &format!("{at}.destinations[{i}]")) {
            Ok(net) => destinations.push(net),
            Err((reason, message)) => fail(reason, message),
        }
    }
    let mut except = Vec::new();
    for (i, text) in rule.except.iter().enumerate() {
        let field = format!("{at}.except[{i}]");
        match parse_prefix(text, &field) {
            // Learned destinations are not known here: an except applies where it falls.
            Ok(net) if from_routes.is_some() || destinations.iter().any(|d| d.contains(&net)) => {
                except.push(net);
            }
            Ok(net) => fail(
                reason::EXCEPT_OUTSIDE_DESTINATIONS,
                format!("{field}: {net} is not inside any of the destinations"),
            ),
            Err((reason, message)) => fail(reason, message),
        }
    }
    let mut egress_ip: Option<IpAddr> = None;
    match (&rule.egress_ip, &rule.interface) {
        (Some(_), Some(_)) | (None, None) => fail(
            reason::INVALID_TARGET,
            format!("{at}: exactly one of egressIP or interface must be set"),
        ),
        (Some(text), None) => match text.parse::<IpAddr>() {
            Ok(ip) => egress_ip = Some(ip),
            Err(_) => fail(
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
                fail(
                    reason::INVALID_INTERFACE,
                    format!("{at}.interface: {name:?} is not a valid interface name"),
                );
            }
        }
    }
    // Families.
    let v6_dest = destinations
        .iter()
        .filter(|d| matches!(d, IpNet::V6(_)))
        .count();
    let mixed = v6_dest != 0 && v6_dest != destinations.len();
    if mixed {
        fail(
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
        fail(
            reason::FAMILY_MISMATCH,
            format!(
                "{at}.egressIP: {ip} is {} but the destinations are {}",
                family_name(ip.is_ipv6()),
                family_name(v6)
            ),
        );
    }
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
