//! `import-egressip`: OVN-Kubernetes `EgressIP` objects (`k8s.ovn.org/v1`) as
//! `EgressGatewayPolicy` objects, for moving a namespace from one to the other
//! (docs/openshift.md, "Migrating from EgressIP").
//!
//! An `EgressIP` says which pods (`spec.namespaceSelector`, `spec.podSelector`) leave with
//! which addresses (`spec.egressIPs`), for every destination outside the cluster, through
//! the nodes labelled `k8s.ovn.org/egress-assignable`. A policy says the same with one
//! rule per address family (`0.0.0.0/0`, `::/0`: the agents carve the cluster's networks
//! and its nodes' addresses out of every rule), a `gatewaySelector` on that label unless told another, and a
//! failure policy. What an `EgressIP` has that a policy cannot say (a field this importer
//! does not know) is refused, naming the object and field, and so is what is malformed;
//! one refused object does not stop the others.
//!
//! Steps: [`documents`] splits the input into objects (multi-document YAML, `List`s
//! expanded), [`translate`] judges and maps one object, [`render`] writes the policies as
//! YAML with what was assumed in comments. [`cli`] reads files or stdin, or has
//! [`cluster`] list the objects from the API.

use std::{collections::BTreeMap, fmt, net::IpAddr};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::Value;

use crate::{
    api::{EgressGatewayPolicy, EgressGatewayPolicySpec, EgressRule, FailurePolicy},
    source::ovn,
};

pub mod cli;
pub mod cluster;
#[cfg(test)]
mod tests;

/// The node label OVN-Kubernetes assigns egress IPs by: the default gateway selector.
pub const EGRESS_ASSIGNABLE: &str = "k8s.ovn.org/egress-assignable";

/// The spec fields of an `EgressIP` this importer translates; any other is refused.
const KNOWN_SPEC_FIELDS: [&str; 3] = ["egressIPs", "namespaceSelector", "podSelector"];

/// What the `EgressIP` objects do not say, given by flags.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// The policies' `gatewaySelector.matchLabels`.
    pub gateway_labels: BTreeMap<String, String>,
    pub failure_policy: FailurePolicy,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            gateway_labels: BTreeMap::from([(EGRESS_ASSIGNABLE.to_owned(), String::new())]),
            failure_policy: FailurePolicy::Drop,
        }
    }
}

/// One object that does not translate: which, which field, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// `EgressIP "shop"`, or `stdin, document 2` for an object without a name.
    pub object: String,
    /// The field at fault, as a path (`spec.egressIPs[1]`).
    pub field: String,
    pub problem: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.object, self.field, self.problem)
    }
}

/// An object of the input, with where it came from (`file, document N`).
#[derive(Clone, Debug, PartialEq)]
pub struct Document {
    pub origin: String,
    pub value: Value,
}

/// A translated `EgressIP`: the policy, and what a reader should know about it.
#[derive(Clone, Debug, PartialEq)]
pub struct Imported {
    pub from: String,
    pub policy: EgressGatewayPolicy,
    pub notes: Vec<String>,
}

/// The objects of `text` (YAML, one or more documents; `kubectl get -o yaml`'s `List`
/// and `EgressIPList` expanded into their items), named after `source` in refusals.
pub fn documents(text: &str, source: &str) -> (Vec<Document>, Vec<Refusal>) {
    let mut found = Vec::new();
    let mut refused = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let origin = format!("{source}, document {}", i + 1);
        match <Value as serde::Deserialize>::deserialize(doc) {
            Ok(Value::Null) => {}
            Ok(value) if value["kind"].as_str().is_some_and(|k| k.ends_with("List")) => {
                let items = value["items"].as_array().cloned().unwrap_or_default();
                found.extend(items.into_iter().enumerate().map(|(j, value)| Document {
                    origin: format!("{origin}, items[{j}]"),
                    value,
                }));
            }
            Ok(value) => found.push(Document { origin, value }),
            Err(e) => {
                refused.push(Refusal {
                    object: origin,
                    field: "(document)".into(),
                    problem: format!("not YAML: {e}"),
                });
                // The parser cannot resynchronise after a syntax error.
                break;
            }
        }
    }
    (found, refused)
}

/// One `EgressIP` as a policy, or every reason it is not one.
pub fn translate(doc: &Document, opts: &Options) -> Result<Imported, Vec<Refusal>> {
    let v = &doc.value;
    let name = v["metadata"]["name"].as_str().filter(|n| !n.is_empty());
    let object = name.map_or_else(|| doc.origin.clone(), |n| format!("EgressIP {n:?}"));
    let mut refusals = Vec::new();
    let mut refuse = |field: &str, problem: String| {
        refusals.push(Refusal {
            object: object.clone(),
            field: field.to_owned(),
            problem,
        });
    };
    let (api_version, kind) = (v["apiVersion"].as_str(), v["kind"].as_str());
    if api_version != Some(ovn::API_VERSION) || kind != Some(ovn::KIND) {
        refuse(
            "kind",
            format!(
                "{}/{} is not an OVN-Kubernetes EgressIP ({}/{})",
                api_version.unwrap_or("?"),
                kind.unwrap_or("?"),
                ovn::API_VERSION,
                ovn::KIND
            ),
        );
        return Err(refusals);
    }
    if name.is_none() {
        refuse("metadata.name", "missing".into());
    }
    let spec = &v["spec"];
    for field in spec.as_object().into_iter().flat_map(|m| m.keys()) {
        if !KNOWN_SPEC_FIELDS.contains(&field.as_str()) {
            refuse(
                &format!("spec.{field}"),
                "not translated: import-egressip knows egressIPs, namespaceSelector and \
                 podSelector only; move this object by hand"
                    .into(),
            );
        }
    }
    let ips = egress_ips(&spec["egressIPs"], &mut refuse);
    let namespaces = match &spec["namespaceSelector"] {
        Value::Null => {
            refuse(
                "spec.namespaceSelector",
                "missing (OVN-Kubernetes requires it; a policy without one would select the \
                 pods of every namespace)"
                    .into(),
            );
            None
        }
        s => selector(s, "spec.namespaceSelector", &mut refuse),
    };
    let pods = match &spec["podSelector"] {
        Value::Null => None,
        s => selector(s, "spec.podSelector", &mut refuse),
    };
    if !refusals.is_empty() {
        return Err(refusals);
    }
    let name = name.unwrap_or_default();
    let spec = EgressGatewayPolicySpec {
        namespace_selector: namespaces,
        pod_selector: pods,
        gateway_selector: LabelSelector {
            match_labels: Some(opts.gateway_labels.clone()),
            match_expressions: None,
        },
        failure_policy: opts.failure_policy,
        rules: rules(&ips),
    };
    Ok(Imported {
        from: object,
        policy: EgressGatewayPolicy::new(name, spec),
        notes: notes(v, &ips),
    })
}

/// `spec.egressIPs`: at least one address, each once.
fn egress_ips(list: &Value, refuse: &mut impl FnMut(&str, String)) -> Vec<IpAddr> {
    let Some(list) = list.as_array().filter(|l| !l.is_empty()) else {
        refuse(
            "spec.egressIPs",
            "missing or empty: an EgressIP without addresses has nothing to translate".into(),
        );
        return Vec::new();
    };
    let mut ips = Vec::new();
    for (i, item) in list.iter().enumerate() {
        let field = format!("spec.egressIPs[{i}]");
        match item.as_str().map(|s| (s, s.parse::<IpAddr>())) {
            Some((_, Ok(ip))) if ips.contains(&ip) => {
                refuse(&field, format!("{ip} is listed twice"));
            }
            Some((_, Ok(ip))) => ips.push(ip),
            Some((s, Err(_))) => refuse(&field, format!("{s:?} is not an IP address")),
            None => refuse(&field, format!("{item} is not an IP address")),
        }
    }
    ips
}

/// A label selector, as Kubernetes writes it.
fn selector(
    value: &Value,
    field: &str,
    refuse: &mut impl FnMut(&str, String),
) -> Option<LabelSelector> {
    match serde_path_to_error::deserialize::<_, LabelSelector>(value.clone()) {
        Ok(s) => Some(s),
        Err(e) => {
            let at = e.path().to_string();
            let field = if at == "." {
                field.to_owned()
            } else {
                format!("{field}.{at}")
            };
            refuse(&field, format!("not a label selector: {}", e.inner()));
            None
        }
    }
}

/// One rule per address family, to every destination of that family.
fn rules(ips: &[IpAddr]) -> Vec<EgressRule> {
    let (v4, v6): (Vec<IpAddr>, Vec<IpAddr>) = ips.iter().partition(|ip| ip.is_ipv4());
    [(v4, "0.0.0.0/0"), (v6, "::/0")]
        .into_iter()
        .filter(|(ips, _)| !ips.is_empty())
        .map(|(ips, everything)| {
            let mut rule = EgressRule {
                destinations: vec![everything.to_owned()],
                ..EgressRule::default()
            };
            let ips: Vec<String> = ips.iter().map(ToString::to_string).collect();
            match ips.as_slice() {
                [one] => rule.egress_ip = Some(one.clone()),
                _ => rule.egress_ips = ips,
            }
            rule
        })
        .collect()
}

/// What a reader should know of one translation: where OVN-Kubernetes put the addresses
/// (`status.items`), and how several addresses differ.
fn notes(v: &Value, ips: &[IpAddr]) -> Vec<String> {
    let mut notes: Vec<String> = v["status"]["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| {
            Some(format!(
                "OVN-Kubernetes holds {} on node {} (status.items)",
                item["egressIP"].as_str()?,
                item["node"].as_str()?
            ))
        })
        .collect();
    if ips.iter().filter(|ip| ip.is_ipv4()).count() > 1
        || ips.iter().filter(|ip| ip.is_ipv6()).count() > 1
    {
        notes.push(
            "several addresses of one family: OVN-Kubernetes spreads a pod's flows over them; \
             egressIPs gives each pod one of them, the same while it lives"
                .into(),
        );
    }
    notes
}

/// What every imported policy assumes, as the output's header says it.
fn header(opts: &Options) -> String {
    let labels: Vec<String> = opts
        .gateway_labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let failure = match opts.failure_policy {
        FailurePolicy::Drop => {
            "Drop (--failure-policy): with no usable gateway, the selected pods'\n\
             #   traffic is dropped and counted"
        }
        FailurePolicy::Fallthrough => {
            "Fallthrough (--failure-policy): with no usable gateway, the selected\n\
             #   pods' traffic leaves as if unselected"
        }
    };
    format!(
        "# EgressGatewayPolicies from OVN-Kubernetes EgressIPs (egress-agent import-egressip).\n\
         # What an EgressIP does not say, and these policies assume:\n\
         # * destinations: everything (0.0.0.0/0, ::/0), as an EgressIP applies to all traffic\n\
         #   leaving the cluster; the agents carve the cluster's pod and service networks and its\n\
         #   nodes' addresses out of every rule (the policy's ClusterExcluded condition names them).\n\
         # * gatewaySelector: the nodes labelled {} (--gateway-selector).\n\
         # * failurePolicy: {failure}.\n\
         # While an EgressIP lists an address, a policy's rule with it is left to OVN-Kubernetes\n\
         # (Conflict=True) and its pods' traffic follows failurePolicy: with Drop it is dropped\n\
         # until the EgressIP is gone. The order of a move: docs/openshift.md, \"Migrating from\n\
         # EgressIP\".\n",
        labels.join(",")
    )
}

/// The policies as YAML documents, each after comments naming its `EgressIP` and notes.
pub fn render(imported: &[Imported], opts: &Options) -> String {
    let mut out = header(opts);
    for i in imported {
        out.push_str("---\n");
        out.push_str(&format!("# From OVN-Kubernetes {}.\n", i.from));
        for n in &i.notes {
            out.push_str(&format!("# {n}.\n"));
        }
        out.push_str(&serde_yaml_ng::to_string(&i.policy).expect("a policy serialises to YAML"));
    }
    out
}

/// Every object of `docs` translated: the policies' YAML and the refusals.
pub fn import(docs: &[Document], opts: &Options) -> (String, Vec<Refusal>) {
    let mut imported = Vec::new();
    let mut refused = Vec::new();
    for d in docs {
        match translate(d, opts) {
            Ok(i) => imported.push(i),
            Err(r) => refused.extend(r),
        }
    }
    (render(&imported, opts), refused)
}
