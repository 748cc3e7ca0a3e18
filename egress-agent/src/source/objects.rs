//! What an object must be to be served, whichever source read it: each check names the
//! field to fix ([`FieldError`]); the source names the object (kind, namespace/name) and
//! leaves it out. The YAML source runs every check (it stands in for the API server's
//! validation); the Kubernetes source runs the ones on fields the compiler reads as
//! addresses ([`check_pod`], [`check_node`], [`check_egress_node`]), where a value the
//! API server let through would otherwise be dropped without a word.

use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::{
    core::v1::{Node, Pod},
    networking::v1::NetworkPolicy,
};

use crate::api::EgressNode;

/// A field-level problem found after a document deserialized.
pub struct FieldError {
    /// `None` for the object as a whole.
    pub field: Option<String>,
    pub message: String,
}

pub fn field_error(field: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        field: Some(field.into()),
        message: message.into(),
    }
}

/// Longest DNS label (a Namespace's name, a label's name part), as Kubernetes allows.
pub const MAX_LABEL: usize = 63;

/// Longest DNS subdomain (most objects' names, a label key's prefix).
pub const MAX_SUBDOMAIN: usize = 253;

/// At most `limit` characters of `text`, for messages.
pub fn shown(text: &str) -> String {
    const SHOWN: usize = 64;
    if text.chars().count() <= SHOWN {
        format!("{text:?}")
    } else {
        let head: String = text.chars().take(SHOWN).collect();
        format!("{head:?}... ({} bytes)", text.len())
    }
}

/// Whether `name` is a DNS label (`label`) or subdomain, as Kubernetes names are (empty:
/// none given, fine); the message if not.
pub fn dns_name(name: &str, label: bool) -> Result<(), String> {
    if name.is_empty() {
        return Ok(());
    }
    let (limit, what) = if label {
        (MAX_LABEL, "a DNS label")
    } else {
        (MAX_SUBDOMAIN, "a DNS subdomain")
    };
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !p.starts_with('-')
            && !p.ends_with('-')
    };
    let ok = name.len() <= limit
        && if label {
            part_ok(name)
        } else {
            name.split('.').all(|p| p.len() <= MAX_LABEL && part_ok(p))
        };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{} is not {what} (at most {limit} characters: lowercase letters, digits and \
             '-'{}, starting and ending with a letter or digit)",
            shown(name),
            if label {
                ""
            } else {
                ", in parts joined by '.'"
            }
        ))
    }
}

/// Whether `key` and `value` make a Kubernetes label (`[prefix/]name`, name and value
/// at most 63 characters of letters, digits, `-`, `_` and `.`, beginning and ending with
/// a letter or digit; the prefix a DNS subdomain); the message if not.
pub fn label_ok(key: &str, value: &str) -> Result<(), String> {
    let part_ok = |p: &str, empty_ok: bool| {
        (empty_ok && p.is_empty())
            || (p.len() <= MAX_LABEL
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
                && p.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
                && p.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric()))
    };
    let (prefix, name) = key
        .rsplit_once('/')
        .map_or((None, key), |(p, n)| (Some(p), n));
    if let Some(prefix) = prefix
        && (prefix.is_empty() || dns_name(prefix, false).is_err())
    {
        return Err(format!(
            "key {}: its prefix is not a DNS subdomain",
            shown(key)
        ));
    }
    if !part_ok(name, false) {
        return Err(format!(
            "key {}: the name part must be 1 to 63 letters, digits, '-', '_' or '.', \
             beginning and ending with a letter or digit",
            shown(key)
        ));
    }
    if !part_ok(value, true) {
        return Err(format!(
            "key {}: value {} must be at most 63 letters, digits, '-', '_' or '.', \
             beginning and ending with a letter or digit",
            shown(key),
            shown(value)
        ));
    }
    Ok(())
}

/// Most addresses a Pod lists in `status.podIPs`: one of each family, as the API server
/// allows.
pub const MAX_POD_IPS: usize = 2;

/// A NetworkPolicy's checks: what the compiler reads of it must read (each error names
/// its field), as the API server would have refused it.
pub fn check_network_policy(np: &NetworkPolicy) -> Vec<FieldError> {
    match crate::netpol::parse(np) {
        Ok(_) => Vec::new(),
        Err(errors) => errors
            .into_iter()
            .map(|e| match e.split_once(": ") {
                Some((field, message)) => field_error(field, message.to_owned()),
                None => FieldError {
                    field: None,
                    message: e,
                },
            })
            .collect(),
    }
}

pub fn check_ip(field: String, text: &str, out: &mut Vec<FieldError>) {
    if text.parse::<IpAddr>().is_err() {
        out.push(field_error(field, format!("invalid IP address {text:?}")));
    }
}

pub fn check_pod(pod: &Pod) -> Vec<FieldError> {
    let mut out = Vec::new();
    if let Some(status) = &pod.status {
        if let Some(ip) = &status.pod_ip {
            check_ip("status.podIP".to_owned(), ip, &mut out);
        }
        let ips = status.pod_ips.as_deref().unwrap_or_default();
        for (i, ip) in ips.iter().enumerate() {
            check_ip(format!("status.podIPs[{i}].ip"), &ip.ip, &mut out);
        }
        let parsed: Vec<IpAddr> = ips.iter().filter_map(|i| i.ip.parse().ok()).collect();
        if ips.len() > MAX_POD_IPS
            || (parsed.len() == 2 && parsed[0].is_ipv6() == parsed[1].is_ipv6())
        {
            out.push(field_error(
                "status.podIPs",
                format!(
                    "{} addresses: a Pod has at most {MAX_POD_IPS}, one of each family",
                    ips.len()
                ),
            ));
        }
    }
    out
}

pub fn check_node(node: &Node) -> Vec<FieldError> {
    let mut out = Vec::new();
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    for (i, address) in addresses.into_iter().flatten().enumerate() {
        if address.type_ == "InternalIP" || address.type_ == "ExternalIP" {
            check_ip(
                format!("status.addresses[{i}].address"),
                &address.address,
                &mut out,
            );
        }
    }
    out
}

pub fn check_egress_node(node: &EgressNode) -> Vec<FieldError> {
    let mut out = Vec::new();
    if let Some(ip) = &node.spec.underlay_ip {
        check_ip("spec.underlayIP".to_owned(), ip, &mut out);
    }
    if let Some(status) = &node.status {
        for (i, interface) in status.interfaces.iter().enumerate() {
            for (j, address) in interface.addresses.iter().enumerate() {
                if address.parse::<IpNet>().is_err() {
                    out.push(field_error(
                        format!("status.interfaces[{i}].addresses[{j}]"),
                        format!(
                            "invalid address with prefix length {address:?} (expected e.g. \
                             10.1.0.5/24)"
                        ),
                    ));
                }
            }
        }
        for (i, held) in status.egress_ips.iter().enumerate() {
            check_ip(format!("status.egressIPs[{i}].ip"), &held.ip, &mut out);
        }
    }
    out
}
