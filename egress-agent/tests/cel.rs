//! The CRDs' CEL rules (`x-kubernetes-validations` in `deploy/base/crds.yaml`), evaluated by a
//! CEL interpreter on a table of good and bad objects: what a user's API server rejects is
//! known, not assumed.
//!
//! The test walks each CRD's schema and finds every rule with its path (`self` is the value
//! at that path: a rule under `items` runs once per list element). Each case is a whole
//! object; every rule runs on every value of the object at its path, and the rules that
//! say no must be exactly the ones the case names. Every rule must be passed by some good
//! case and refused by some bad one, so a rule added without cases fails this test. Policy
//! cases also go through the compiler, which guards the same things for the YAML source
//! (no API server there): a case CEL refuses must leave the policy `Accepted=False`, a good
//! one `Accepted=True`.
//!
//! The rules use Kubernetes' IP and CIDR library (`isIP`, `ip`, `family`, `isCIDR`, `cidr`,
//! `masked`, `containsCIDR`), which the `cel` crate does not have: [`kubernetes_net`]
//! implements the part the rules use, with Kubernetes' semantics (an IPv4-mapped IPv6
//! address or a zone is not an IP; `cidr(..).ip()` is the address as written; two CIDRs are
//! equal when address and length are; a CIDR with host bits differs from its `masked()`).
//! `has()`, `all()`, `exists()` and list indexing are the crate's own.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

use cel::{Context, ExecutionError, Program, Value, extractors::This, objects::Opaque, to_value};
use egress_agent::{
    api::{ConditionStatus, EgressGatewayPolicy},
    compiler::{compile, condition},
    source::ClusterView,
};
use serde_json::Value as Json;

const CRDS: &str = include_str!("../../deploy/base/crds.yaml");

// ---------------------------------------------------------------------------------------
// The cases

/// One object and the rules that must refuse it (none: a good object).
struct Case {
    name: &'static str,
    kind: &'static str,
    /// The whole object, as YAML.
    object: String,
    /// `"<schema path>: <message>"` of every rule that says no.
    refused_by: &'static [&'static str],
}

/// An EgressGatewayPolicy with one rule (`rule` is a YAML flow mapping).
fn policy(name: &'static str, rule: &str, refused_by: &'static [&'static str]) -> Case {
    Case {
        name,
        kind: "EgressGatewayPolicy",
        object: format!(
            "apiVersion: egress.dev/v1alpha1\nkind: EgressGatewayPolicy\n\
             metadata: {{name: p}}\n\
             spec:\n  gatewaySelector: {{matchLabels: {{egress.dev/gateway: \"true\"}}}}\n  \
             rules:\n  - {rule}\n"
        ),
        refused_by,
    }
}

/// An EgressGatewayPolicy with a good rule and `gateways` (a YAML flow mapping) as its
/// `gatewaySelector`.
fn gateways(name: &'static str, gateways: &str, refused_by: &'static [&'static str]) -> Case {
    Case {
        name,
        kind: "EgressGatewayPolicy",
        object: format!(
            "apiVersion: egress.dev/v1alpha1\nkind: EgressGatewayPolicy\n\
             metadata: {{name: p}}\n\
             spec:\n  gatewaySelector: {gateways}\n  \
             rules:\n  - {{destinations: [192.168.101.0/24], egressIP: 192.168.101.50}}\n"
        ),
        refused_by,
    }
}

/// An EgressNode (`body` is its spec and status, as YAML at the top level).
fn egress_node(name: &'static str, body: &str, refused_by: &'static [&'static str]) -> Case {
    Case {
        name,
        kind: "EgressNode",
        object: format!(
            "apiVersion: egress.dev/v1alpha1\nkind: EgressNode\nmetadata: {{name: gw1}}\n{body}"
        ),
        refused_by,
    }
}

const GATEWAY_SELECTOR: &str = "spec.gatewaySelector: gatewaySelector must not be empty (it \
                                would make every node a gateway): select the gateway nodes by \
                                label, such as matchLabels: {egress.dev/gateway: \"true\"}";
const TARGET: &str = "spec.rules[]: exactly one of egressIP, egressIPs or interface must be set";
const EGRESS_IPS_TWICE: &str = "spec.rules[]: egressIPs must not list an address twice";
const EGRESS_IPS_FAMILY: &str = "spec.rules[]: egressIPs must all be of one address family";
const FAMILY_EGRESS_IPS: &str =
    "spec.rules[]: destinations must be of the same address family as egressIPs";
const EGRESS_IPS_ITEM: &str =
    "spec.rules[].egressIPs[]: must be an IP address such as 198.51.100.10";
const DESTINATIONS: &str =
    "spec.rules[]: exactly one of destinations or destinationsFrom must be set";
const INCLUDE_DEFAULT: &str = "spec.rules[]: includeDefault applies only with destinationsFrom";
const FAMILY_EGRESS_IP: &str =
    "spec.rules[]: destinations must be of the same address family as egressIP";
const FAMILY_ONE: &str = "spec.rules[]: destinations must all be of one address family";
const EXCEPT_INSIDE: &str =
    "spec.rules[]: every except prefix must lie inside one of the destinations";
const DEST_CIDR: &str = "spec.rules[].destinations[]: must be a CIDR prefix such as 192.0.2.0/24";
const DEST_MASKED: &str = "spec.rules[].destinations[]: must not have host bits set (write the \
                           network address, such as 192.0.2.0/24)";
const EXCEPT_CIDR: &str = "spec.rules[].except[]: must be a CIDR prefix such as 192.0.2.0/24";
const EXCEPT_MASKED: &str = "spec.rules[].except[]: must not have host bits set (write the \
                             network address, such as 192.0.2.0/24)";
const EGRESS_IP: &str = "spec.rules[].egressIP: must be an IP address such as 198.51.100.10";
const UNDERLAY_IP: &str = "spec.underlayIP: must be an IP address such as 198.51.100.10";
const HELD_IP: &str = "status.egressIPs[].ip: must be an IP address such as 198.51.100.10";
const INTERFACE_ADDRESS: &str = "status.interfaces[].addresses[]: must be an address with its \
                                 prefix length such as 10.1.0.5/24";

fn cases() -> Vec<Case> {
    vec![
        // Good policies: the README's rules and their IPv6 twins.
        policy(
            "listed destinations, egress IP",
            "{destinations: [192.168.101.0/24, 192.168.104.0/24], egressIP: 192.168.101.50}",
            &[],
        ),
        policy(
            "learned destinations with defaults, egress IP",
            "{destinationsFrom: Routes, includeDefault: true, egressIP: 192.168.102.50}",
            &[],
        ),
        policy(
            "learned destinations, interface, an except",
            "{destinationsFrom: Routes, except: [192.168.104.0/24], interface: ens256}",
            &[],
        ),
        policy(
            "listed destinations, interface, excepts inside",
            "{destinations: [10.0.0.0/8, 172.16.0.0/12], except: [10.1.0.0/16, 172.16.0.0/12], \
             interface: ens224}",
            &[],
        ),
        policy(
            "IPv6 destinations, IPv6 egress IP, an except",
            "{destinations: ['fd00:101::/64', '2001:db8::/32'], except: ['2001:db8:1::/48'], \
             egressIP: 'fd00:101::50'}",
            &[],
        ),
        policy(
            "a default route listed",
            "{destinations: [0.0.0.0/0], egressIP: 192.168.101.50}",
            &[],
        ),
        // Target: exactly one of egressIP and interface.
        policy(
            "egressIP and interface",
            "{destinations: [192.168.101.0/24], egressIP: 192.168.101.50, interface: sec-a}",
            &[TARGET],
        ),
        policy(
            "neither egressIP nor interface",
            "{destinations: [192.168.101.0/24]}",
            &[TARGET],
        ),
        // egressIPs: several addresses, one family, each once.
        policy(
            "listed destinations, two egress IPs",
            "{destinations: [192.168.101.0/24], egressIPs: [192.168.101.50, 192.168.101.51]}",
            &[],
        ),
        policy(
            "learned destinations, two IPv6 egress IPs",
            "{destinationsFrom: Routes, egressIPs: ['fd00:101::50', 'fd00:101::51']}",
            &[],
        ),
        policy(
            "egressIP and egressIPs",
            "{destinations: [192.168.101.0/24], egressIP: 192.168.101.50, \
             egressIPs: [192.168.101.51]}",
            &[TARGET],
        ),
        policy(
            "egressIPs and interface",
            "{destinations: [192.168.101.0/24], egressIPs: [192.168.101.51], interface: sec-a}",
            &[TARGET],
        ),
        policy(
            "an address listed twice in egressIPs",
            "{destinations: [192.168.101.0/24], \
             egressIPs: [192.168.101.50, 192.168.101.51, 192.168.101.50]}",
            &[EGRESS_IPS_TWICE],
        ),
        policy(
            "egressIPs of both families",
            "{destinationsFrom: Routes, egressIPs: [192.168.101.50, 'fd00:101::50']}",
            &[EGRESS_IPS_FAMILY],
        ),
        policy(
            "IPv4 destinations, IPv6 egressIPs",
            "{destinations: [192.168.101.0/24], egressIPs: ['fd00:101::50']}",
            &[FAMILY_EGRESS_IPS],
        ),
        policy(
            "an egressIPs item that is no address",
            "{destinations: [192.168.101.0/24], egressIPs: [192.168.101.50, gw-a]}",
            &[EGRESS_IPS_ITEM],
        ),
        // Destinations: exactly one of destinations and destinationsFrom.
        policy(
            "destinations and destinationsFrom",
            "{destinations: [192.168.101.0/24], destinationsFrom: Routes, \
             egressIP: 192.168.101.50}",
            &[DESTINATIONS],
        ),
        policy(
            "neither destinations nor destinationsFrom",
            "{egressIP: 192.168.101.50}",
            &[DESTINATIONS],
        ),
        policy(
            "includeDefault without destinationsFrom",
            "{destinations: [192.168.101.0/24], includeDefault: false, \
             egressIP: 192.168.101.50}",
            &[INCLUDE_DEFAULT],
        ),
        policy(
            "includeDefault alone",
            "{includeDefault: true, interface: sec-b}",
            &[DESTINATIONS, INCLUDE_DEFAULT],
        ),
        // Addresses and prefixes.
        policy(
            "a destination without a prefix length",
            "{destinations: [192.168.101.0], egressIP: 192.168.101.50}",
            &[DEST_CIDR],
        ),
        policy(
            "a destination that is a name",
            "{destinations: [192.168.101.0/24, host-a], egressIP: 192.168.101.50}",
            &[DEST_CIDR],
        ),
        policy(
            "a prefix length over 32",
            "{destinations: [192.168.101.0/33], interface: sec-a}",
            &[DEST_CIDR],
        ),
        policy(
            "a destination with host bits",
            "{destinations: [192.168.101.1/24], egressIP: 192.168.101.50}",
            &[DEST_MASKED],
        ),
        policy(
            "an IPv6 destination with host bits",
            "{destinations: ['fd00:101::1/64'], egressIP: 'fd00:101::50'}",
            &[DEST_MASKED],
        ),
        policy(
            "an egress IP out of range",
            "{destinations: [192.168.101.0/24], egressIP: 192.168.101.500}",
            &[EGRESS_IP],
        ),
        policy(
            "an egress IP with a prefix length",
            "{destinationsFrom: Routes, egressIP: 192.168.101.50/24}",
            &[EGRESS_IP],
        ),
        policy(
            "an except without a prefix length",
            "{destinations: [10.0.0.0/8], except: [10.1.0.0], interface: sec-a}",
            &[EXCEPT_CIDR],
        ),
        policy(
            "an except with host bits",
            "{destinations: [10.0.0.0/8], except: [10.1.0.1/16], interface: sec-a}",
            &[EXCEPT_MASKED],
        ),
        // Families.
        policy(
            "IPv4 destinations, IPv6 egress IP",
            "{destinations: [192.168.101.0/24], egressIP: 'fd00:101::50'}",
            &[FAMILY_EGRESS_IP],
        ),
        policy(
            "IPv6 destinations, IPv4 egress IP",
            "{destinations: ['fd00:101::/64'], egressIP: 192.168.101.50}",
            &[FAMILY_EGRESS_IP],
        ),
        policy(
            "mixed destinations, interface",
            "{destinations: [192.168.101.0/24, 'fd00:101::/64'], interface: sec-a}",
            &[FAMILY_ONE],
        ),
        policy(
            "mixed destinations, IPv4 egress IP",
            "{destinations: [192.168.101.0/24, 'fd00:101::/64'], egressIP: 192.168.101.50}",
            &[FAMILY_EGRESS_IP, FAMILY_ONE],
        ),
        // Excepts.
        policy(
            "an except outside the destinations",
            "{destinations: [10.0.0.0/8], except: [192.168.0.0/16], interface: sec-a}",
            &[EXCEPT_INSIDE],
        ),
        policy(
            "an except wider than its destination",
            "{destinations: [10.1.0.0/16], except: [10.0.0.0/8], interface: sec-a}",
            &[EXCEPT_INSIDE],
        ),
        policy(
            "an except of the other family",
            "{destinations: [0.0.0.0/0], except: ['::/0'], egressIP: 192.168.101.50}",
            &[EXCEPT_INSIDE],
        ),
        // gatewaySelector: labels or expressions, never empty (every node a gateway).
        gateways(
            "gateways by an expression",
            "{matchExpressions: [{key: egress.dev/gateway, operator: Exists}]}",
            &[],
        ),
        gateways(
            "gateways by labels, no expressions",
            "{matchLabels: {egress.dev/gateway: 'true'}, matchExpressions: []}",
            &[],
        ),
        gateways("an empty gatewaySelector", "{}", &[GATEWAY_SELECTOR]),
        gateways(
            "a gatewaySelector of empty lists",
            "{matchLabels: {}, matchExpressions: []}",
            &[GATEWAY_SELECTOR],
        ),
        // EgressNodes, as agents publish them.
        egress_node(
            "an agent's EgressNode",
            "spec: {underlayIP: 10.200.0.11}\n\
             status:\n  \
               egressIPs: [{ip: 192.168.101.50, interface: sec-a, epoch: 3}, \
                           {ip: 'fd00:101::50', interface: sec-a, epoch: 1}]\n  \
               interfaces:\n  \
               - {name: sec-a, up: true, addresses: [192.168.101.11/24, 'fd00:101::11/64'], \
                  routes: [192.168.101.0/24]}\n  \
               - {name: eth0, up: true, addresses: [10.200.0.11/24]}\n",
            &[],
        ),
        egress_node(
            "an IPv6 underlay, nothing held",
            "spec: {underlayIP: 'fd00:200::11'}\nstatus: {egressIPs: [], interfaces: []}\n",
            &[],
        ),
        egress_node(
            "an underlay that is a name",
            "spec: {underlayIP: gw1.example}\n",
            &[UNDERLAY_IP],
        ),
        egress_node(
            "a held IP that is no address",
            "spec: {underlayIP: 10.200.0.11}\n\
             status: {egressIPs: [{ip: 192.168.101.500, interface: sec-a, epoch: 1}]}\n",
            &[HELD_IP],
        ),
        egress_node(
            "an interface address without its prefix length",
            "spec: {underlayIP: 10.200.0.11}\n\
             status: {interfaces: [{name: sec-a, up: true, addresses: [192.168.101.11]}]}\n",
            &[INTERFACE_ADDRESS],
        ),
        egress_node(
            "an IPv4-mapped IPv6 underlay",
            "spec: {underlayIP: '::ffff:10.200.0.11'}\n",
            &[UNDERLAY_IP],
        ),
    ]
}

// ---------------------------------------------------------------------------------------
// The test

#[test]
fn every_cel_rule_passes_good_objects_and_refuses_bad_ones() {
    let rules = rules_of(CRDS);
    let programs: Vec<Program> = rules
        .iter()
        .map(|r| {
            Program::compile(&r.rule)
                .unwrap_or_else(|e| panic!("{}: rule {:?} does not parse: {e}", r.id(), r.rule))
        })
        .collect();
    let mut passed_by_good = vec![0_usize; rules.len()];
    let mut refused_by_bad = vec![0_usize; rules.len()];
    let mut failures = Vec::new();
    for case in cases() {
        let object: Json = serde_yaml_ng::from_str(&case.object)
            .unwrap_or_else(|e| panic!("case {:?}: bad YAML: {e}", case.name));
        let mut outcomes = Vec::new();
        for (i, rule) in rules.iter().enumerate() {
            if rule.kind != case.kind {
                continue;
            }
            for (at, value) in values_at(&object, &rule.path) {
                let result = evaluate(&programs[i], value);
                outcomes.push((i, at, result));
            }
        }
        let mut refused = BTreeSet::new();
        for (i, at, result) in &outcomes {
            match result {
                Ok(true) => {
                    if case.refused_by.is_empty() {
                        passed_by_good[*i] += 1;
                    }
                }
                Ok(false) => {
                    refused.insert(rules[*i].id());
                    refused_by_bad[*i] += 1;
                }
                // The rules guard every conversion (`!isCIDR(d) || cidr(d)...`): an error is
                // a rule bug, and the API server would answer it with a cryptic message.
                Err(e) => failures.push(format!(
                    "case {:?}: {} at {at}: evaluation failed: {e}",
                    case.name,
                    rules[*i].id()
                )),
            }
        }
        let expected: BTreeSet<String> = case.refused_by.iter().map(|s| (*s).to_owned()).collect();
        if refused != expected {
            failures.push(format!(
                "case {:?}: refused by {refused:#?}, expected {expected:#?}",
                case.name
            ));
        }
        if case.kind == "EgressGatewayPolicy"
            && let Some(problem) = compiler_disagrees(&object, case.refused_by.is_empty())
        {
            failures.push(format!("case {:?}: {problem}", case.name));
        }
    }
    for (i, rule) in rules.iter().enumerate() {
        if passed_by_good[i] == 0 {
            failures.push(format!("{}: no good case passes through it", rule.id()));
        }
        if refused_by_bad[i] == 0 {
            failures.push(format!("{}: no bad case is refused by it", rule.id()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // What the walk found, for a reviewer: 15 rules today.
    assert!(rules.len() >= 15, "the walk lost rules: {rules:#?}");
}

/// The walk finds rules at every depth: under properties, items and the root.
#[test]
fn the_walk_finds_rules_at_every_depth() {
    let crd = "spec:\n  names: {kind: K}\n  versions:\n  - schema:\n      openAPIV3Schema:\n        \
               x-kubernetes-validations: [{rule: 'true', message: root}]\n        \
               properties:\n          a:\n            items:\n              \
               x-kubernetes-validations: [{rule: 'self > 0', message: item}]\n";
    let ids: Vec<String> = rules_of(crd).iter().map(Rule::id).collect();
    assert_eq!(ids, ["(root): root", "a[]: item"]);
}

/// Whether the compiler's verdict on a policy differs from CEL's (`Accepted` must be
/// `True` exactly when every rule passed).
fn compiler_disagrees(object: &Json, cel_accepts: bool) -> Option<String> {
    let policy: EgressGatewayPolicy = match serde_json::from_value(object.clone()) {
        Ok(p) => p,
        Err(e) => return Some(format!("does not deserialize as a policy: {e}")),
    };
    let view = ClusterView {
        policies: vec![policy],
        ..ClusterView::default()
    };
    let compiled = compile(&view, "w1");
    let Some(accepted) = compiled
        .statuses
        .get("p")
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == condition::ACCEPTED))
    else {
        return Some(format!(
            "the compiler gives no Accepted condition: {compiled:?}"
        ));
    };
    let compiler_accepts = accepted.status == ConditionStatus::True;
    (compiler_accepts != cel_accepts).then(|| {
        format!(
            "CEL {} it, the compiler says Accepted={} ({}: {})",
            if cel_accepts { "accepts" } else { "refuses" },
            accepted.status,
            accepted.reason,
            accepted.message
        )
    })
}

// ---------------------------------------------------------------------------------------
// Rules and where they apply

/// One `x-kubernetes-validations` entry of a CRD's schema.
#[derive(Debug)]
struct Rule {
    kind: String,
    /// Where `self` is: `spec.rules[]` (every element of `spec.rules`), `spec.underlayIP`.
    path: String,
    rule: String,
    message: String,
}

impl Rule {
    fn id(&self) -> String {
        let path = if self.path.is_empty() {
            "(root)"
        } else {
            &self.path
        };
        format!("{path}: {}", self.message)
    }
}

/// Every rule of every version of every CRD in a YAML stream.
fn rules_of(crds: &str) -> Vec<Rule> {
    let mut rules = Vec::new();
    for document in serde_yaml_ng::Deserializer::from_str(crds) {
        let crd: Json = serde::Deserialize::deserialize(document).expect("CRD YAML");
        if crd.is_null() {
            continue;
        }
        let kind = crd["spec"]["names"]["kind"]
            .as_str()
            .expect("spec.names.kind");
        for version in crd["spec"]["versions"].as_array().expect("spec.versions") {
            let schema = &version["schema"]["openAPIV3Schema"];
            walk(kind, schema, String::new(), &mut rules);
        }
    }
    rules
}

fn walk(kind: &str, schema: &Json, path: String, rules: &mut Vec<Rule>) {
    for v in schema["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
    {
        rules.push(Rule {
            kind: kind.to_owned(),
            path: path.clone(),
            rule: v["rule"].as_str().expect("rule").to_owned(),
            message: v["message"].as_str().unwrap_or_default().to_owned(),
        });
    }
    if let Some(properties) = schema["properties"].as_object() {
        for (name, sub) in properties {
            let sub_path = if path.is_empty() {
                name.clone()
            } else {
                format!("{path}.{name}")
            };
            walk(kind, sub, sub_path, rules);
        }
    }
    if schema["items"].is_object() {
        walk(kind, &schema["items"], format!("{path}[]"), rules);
    }
    if schema["additionalProperties"].is_object() {
        walk(
            kind,
            &schema["additionalProperties"],
            format!("{path}{{}}"),
            rules,
        );
    }
}

/// The values of `object` at a schema path, each with its concrete path (`spec.rules[1]`).
/// Absent and null values have none: Kubernetes runs a rule only where a value is.
fn values_at<'a>(object: &'a Json, path: &str) -> Vec<(String, &'a Json)> {
    let mut found = vec![(String::new(), object)];
    for step in path.split('.').filter(|s| !s.is_empty()) {
        let name = step.trim_end_matches(['[', ']', '{', '}']);
        found = found
            .into_iter()
            .filter_map(|(at, v)| match name {
                "" => Some((at, v)),
                _ => v.get(name).filter(|v| !v.is_null()).map(|v| {
                    (
                        if at.is_empty() {
                            name.to_owned()
                        } else {
                            format!("{at}.{name}")
                        },
                        v,
                    )
                }),
            })
            .collect();
        for marker in step.as_bytes()[name.len()..].chunks(2) {
            found = found
                .into_iter()
                .flat_map(|(at, v)| -> Vec<(String, &Json)> {
                    match (marker, v) {
                        (b"[]", Json::Array(items)) => items
                            .iter()
                            .enumerate()
                            .map(|(i, x)| (format!("{at}[{i}]"), x))
                            .collect(),
                        (b"{}", Json::Object(map)) => map
                            .iter()
                            .map(|(k, x)| (format!("{at}[{k:?}]"), x))
                            .collect(),
                        _ => Vec::new(),
                    }
                })
                .collect();
        }
    }
    found
}

/// Run one rule with `self` bound to `value`.
fn evaluate(program: &Program, value: &Json) -> Result<bool, String> {
    let mut context = Context::default();
    kubernetes_net(&mut context);
    let value = to_value(value).map_err(|e| format!("not a CEL value: {e}"))?;
    context.add_variable_from_value("self", value);
    match program.execute(&context) {
        Ok(Value::Bool(b)) => Ok(b),
        Ok(other) => Err(format!("not a bool: {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}

// ---------------------------------------------------------------------------------------
// Kubernetes' IP and CIDR library, the part the rules use

/// `ip(..)`: an address.
#[derive(Debug, PartialEq, Eq)]
struct Ip(IpAddr);

impl Opaque for Ip {
    fn runtime_type_name(&self) -> &str {
        "net.IP"
    }
}

/// `cidr(..)`: an address (as written, host bits and all) and a prefix length.
#[derive(Debug, PartialEq, Eq)]
struct Cidr {
    addr: IpAddr,
    len: u8,
}

impl Opaque for Cidr {
    fn runtime_type_name(&self) -> &str {
        "net.CIDR"
    }
}

impl Cidr {
    fn masked(&self) -> Cidr {
        let addr = match self.addr {
            IpAddr::V4(a) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                IpAddr::V4((u32::from(a) & mask).into())
            }
            IpAddr::V6(a) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                IpAddr::V6((u128::from(a) & mask).into())
            }
        };
        Cidr {
            addr,
            len: self.len,
        }
    }

    fn contains(&self, other: &Cidr) -> bool {
        self.addr.is_ipv4() == other.addr.is_ipv4()
            && other.len >= self.len
            && Cidr {
                addr: other.addr,
                len: self.len,
            }
            .masked()
                == self.masked()
    }
}

/// An address as Kubernetes' `isIP` takes it: no zone (Rust's parser has none either), no
/// IPv4-mapped IPv6 form, no leading zeros in IPv4 (Rust's parser refuses them too).
fn parse_ip(text: &str) -> Option<IpAddr> {
    let ip: IpAddr = text.parse().ok()?;
    match ip {
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => None,
        _ => Some(ip),
    }
}

/// A prefix as Kubernetes' `isCIDR` takes it: an address as [`parse_ip`], `/`, a length
/// of the family's range in decimal without leading zeros.
fn parse_cidr(text: &str) -> Option<Cidr> {
    let (addr, len) = text.split_once('/')?;
    let addr = parse_ip(addr)?;
    if len.is_empty()
        || !len.bytes().all(|b| b.is_ascii_digit())
        || len.len() > 1 && len.starts_with('0')
    {
        return None;
    }
    let len: u8 = len.parse().ok()?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    (len <= max).then_some(Cidr { addr, len })
}

fn opaque<T: Opaque>(value: &Value) -> Option<&T> {
    match value {
        Value::Opaque(o) => o.downcast_ref::<T>(),
        _ => None,
    }
}

fn string(value: &Value) -> Option<&str> {
    match value {
        Value::String(s) => Some(s.as_str()),
        _ => None,
    }
}

fn error(function: &str, message: impl ToString) -> ExecutionError {
    ExecutionError::function_error(function, message)
}

/// `isIP`, `ip`, `family`, `isCIDR`, `cidr`, `masked` and `containsCIDR`, as functions and
/// (where Kubernetes has them so) methods.
fn kubernetes_net(context: &mut Context<'_, '_>) {
    context
        .add_function("isIP", |This(s): This<Arc<String>>| parse_ip(&s).is_some())
        .expect("a name the standard library does not use");
    context
        .add_function("isCIDR", |This(s): This<Arc<String>>| {
            parse_cidr(&s).is_some()
        })
        .expect("a name the standard library does not use");
    // ip("1.2.3.4") parses; cidr(..).ip() is the CIDR's address.
    context
        .add_function(
            "ip",
            |This(v): This<Value>| -> Result<Value, ExecutionError> {
                if let Some(c) = opaque::<Cidr>(&v) {
                    return Ok(Value::Opaque(Arc::new(Ip(c.addr))));
                }
                let text =
                    string(&v).ok_or_else(|| error("ip", format!("no overload for {v:?}")))?;
                let ip = parse_ip(text)
                    .ok_or_else(|| error("ip", format!("IP Address {text:?} parse error")))?;
                Ok(Value::Opaque(Arc::new(Ip(ip))))
            },
        )
        .expect("a name the standard library does not use");
    context
        .add_function(
            "family",
            |This(v): This<Value>| -> Result<Value, ExecutionError> {
                let ip = opaque::<Ip>(&v)
                    .ok_or_else(|| error("family", format!("no overload for {v:?}")))?;
                Ok(Value::Int(if ip.0.is_ipv4() { 4 } else { 6 }))
            },
        )
        .expect("a name the standard library does not use");
    context
        .add_function(
            "cidr",
            |This(v): This<Value>| -> Result<Value, ExecutionError> {
                let text =
                    string(&v).ok_or_else(|| error("cidr", format!("no overload for {v:?}")))?;
                let c = parse_cidr(text).ok_or_else(|| {
                    error("cidr", format!("network address {text:?} parse error"))
                })?;
                Ok(Value::Opaque(Arc::new(c)))
            },
        )
        .expect("a name the standard library does not use");
    context
        .add_function(
            "masked",
            |This(v): This<Value>| -> Result<Value, ExecutionError> {
                let c = opaque::<Cidr>(&v)
                    .ok_or_else(|| error("masked", format!("no overload for {v:?}")))?;
                Ok(Value::Opaque(Arc::new(c.masked())))
            },
        )
        .expect("a name the standard library does not use");
    // cidr(..).containsCIDR(cidr(..) or a string).
    context
        .add_function(
            "containsCIDR",
            |This(v): This<Value>, other: Value| -> Result<Value, ExecutionError> {
                let c = opaque::<Cidr>(&v)
                    .ok_or_else(|| error("containsCIDR", format!("no overload for {v:?}")))?;
                let parsed;
                let other = match (opaque::<Cidr>(&other), string(&other)) {
                    (Some(o), _) => o,
                    (None, Some(text)) => {
                        parsed = parse_cidr(text).ok_or_else(|| {
                            error(
                                "containsCIDR",
                                format!("network address {text:?} parse error"),
                            )
                        })?;
                        &parsed
                    }
                    (None, None) => {
                        return Err(error("containsCIDR", format!("no overload for {other:?}")));
                    }
                };
                Ok(Value::Bool(c.contains(other)))
            },
        )
        .expect("a name the standard library does not use");
}

/// The library itself, on Kubernetes' own examples.
#[test]
fn kubernetes_net_library() {
    let cases: &[(&str, bool)] = &[
        ("isIP('192.168.0.1')", true),
        ("isIP('fd00::1')", true),
        ("isIP('192.168.0.1/24')", false),
        ("isIP('::ffff:192.168.0.1')", false),
        ("isIP('fe80::1%eth0')", false),
        ("isIP('010.0.0.1')", false),
        ("ip('192.168.0.1').family() == 4", true),
        ("ip('::1').family() == 6", true),
        ("isCIDR('192.168.0.0/24')", true),
        ("isCIDR('192.168.0.1/24')", true),
        ("isCIDR('192.168.0.0/33')", false),
        ("isCIDR('192.168.0.0/08')", false),
        ("isCIDR('192.168.0.0')", false),
        ("cidr('192.168.0.1/24').ip() == ip('192.168.0.1')", true),
        (
            "cidr('192.168.0.1/24').masked() == cidr('192.168.0.0/24')",
            true,
        ),
        ("cidr('192.168.0.1/24') == cidr('192.168.0.0/24')", false),
        ("cidr('fd00::1/64').masked() == cidr('fd00::/64')", true),
        ("cidr('0.0.0.0/0').masked() == cidr('0.0.0.0/0')", true),
        ("cidr('10.0.0.0/8').containsCIDR('10.1.0.0/16')", true),
        ("cidr('10.0.0.0/8').containsCIDR(cidr('10.0.0.0/8'))", true),
        ("cidr('10.1.0.0/16').containsCIDR('10.0.0.0/8')", false),
        ("cidr('0.0.0.0/0').containsCIDR('::/0')", false),
        (
            "['a', 'b'].exists(x, x == 'b') && has(self.a) && !has(self.b)",
            true,
        ),
    ];
    let mut wrong = BTreeMap::new();
    for (expr, want) in cases {
        let program = Program::compile(expr).expect("parse");
        match evaluate(&program, &serde_json::json!({"a": 1})) {
            Ok(got) if got == *want => {}
            other => {
                wrong.insert(*expr, format!("{other:?}, want {want}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}
