//! Splitting a state file into its documents and reading each one as an object: bounded in
//! size and depth before the YAML parser sees it, identified (kind, namespace, name),
//! typed and checked.

use k8s_openapi::api::{
    core::v1::{Namespace, Node, Pod},
    networking::v1::NetworkPolicy,
};
use serde::de::DeserializeOwned;

use crate::api::{API_VERSION, EgressGatewayPolicy, EgressNode};
use crate::source::objects::{
    FieldError, check_egress_node, check_network_policy, check_node, check_pod, dns_name,
    field_error, label_ok,
};
use crate::source::{DocumentError, KEPT_NAMED, LoadError, PodSummary, Unapplied, admin, ovn};

/// Largest document parsed, in bytes (2 MiB): no Kubernetes object is bigger (etcd takes
/// 1.5 MiB per request by default). The parser's memory grows several times faster than
/// the document, so a bigger one is refused before the parser sees it.
pub const MAX_DOCUMENT_BYTES: usize = 2 << 20;

/// Deepest nesting of a document, flow brackets (`[`, `{`) and indentation levels
/// together, checked by a linear scan before the YAML parser sees the text (which slows
/// down badly on deep nesting). Kubernetes objects nest about 10 deep.
pub const MAX_DEPTH: usize = 64;

/// One document of a file.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Document<'a> {
    /// 1-based position in the file.
    pub(super) number: usize,
    /// 1-based line of the file its text starts on.
    pub(super) line: usize,
    pub(super) text: &'a str,
}

/// Split a YAML stream into its documents, borrowing the text. A leading `---` does not
/// open an empty first document.
pub(super) fn split_documents(text: &str) -> Vec<Document<'_>> {
    let mut docs = Vec::new();
    let mut number = 1;
    let (mut start, mut start_line) = (0, 1);
    // Only blank and comment lines so far.
    let mut leading = true;
    let mut offset = 0;
    for (i, line) in text.split_inclusive('\n').enumerate() {
        let bare = line.trim_end_matches(['\n', '\r']);
        let marker = bare == "---" || bare.starts_with("--- ") || bare.starts_with("---\t");
        if marker {
            if !leading {
                docs.push(Document {
                    number,
                    line: start_line,
                    text: &text[start..offset],
                });
                number += 1;
            }
            leading = false;
            // What follows the marker on its line (`--- {a: 1}`) belongs to the document.
            if bare[3..].trim().is_empty() {
                (start, start_line) = (offset + line.len(), i + 2);
            } else {
                (start, start_line) = (offset + 3, i + 1);
            }
        } else if !bare.trim().is_empty() && !bare.trim_start().starts_with('#') {
            leading = false;
        }
        offset += line.len();
    }
    docs.push(Document {
        number,
        line: start_line,
        text: &text[start..],
    });
    docs
}

/// The first line of `text` (1-based) where nesting goes deeper than `max`, counting flow
/// collections (`[`, `{`) and block indentation levels (each `- ` of a compact sequence
/// too) together. Linear, and cautious: quoted scalars, comments and block scalars (`|`,
/// `>`) are skipped; a bracket inside a plain scalar is not counted.
pub(super) fn too_deep(text: &str, max: usize) -> Option<usize> {
    let mut depth = Depth {
        max,
        ..Depth::default()
    };
    text.lines()
        .position(|line| depth.too_deep(line))
        .map(|i| i + 1)
}

/// [`too_deep`]'s state between lines.
#[derive(Default)]
pub(super) struct Depth {
    max: usize,
    /// Columns of the open block levels.
    levels: Vec<usize>,
    /// Open flow collections.
    flow: usize,
    /// An open quoted scalar (its quote), which may span lines.
    quote: Option<u8>,
    /// Inside a block scalar: the column its content must be deeper than.
    block_scalar: Option<usize>,
}

impl Depth {
    /// Read the next line: whether nesting goes deeper than `max` on it.
    fn too_deep(&mut self, line: &str) -> bool {
        let bytes = line.as_bytes();
        let indent = bytes.iter().take_while(|&&b| b == b' ').count();
        let blank = bytes[indent..].iter().all(u8::is_ascii_whitespace);
        if let Some(parent) = self.block_scalar {
            if blank || indent > parent {
                return false;
            }
            self.block_scalar = None;
        }
        if blank && self.quote.is_none() {
            return false;
        }
        let mut pos = indent;
        if self.quote.is_none() && self.flow == 0 {
            if bytes[indent] == b'#' {
                return false;
            }
            pos = self.open_block_levels(bytes, indent);
            if self.levels.len() > self.max {
                return true;
            }
        }
        self.scan(line, pos)
    }

    /// Close the block levels deeper than `indent` and open this line's (its own, and
    /// one at each entry's content for `- - x` and `- key: v`). Returns where the
    /// content starts.
    fn open_block_levels(&mut self, bytes: &[u8], indent: usize) -> usize {
        while self.levels.last().is_some_and(|&top| top > indent) {
            self.levels.pop();
        }
        if self.levels.last() != Some(&indent) {
            self.levels.push(indent);
        }
        let mut pos = indent;
        while bytes.get(pos) == Some(&b'-') && matches!(bytes.get(pos + 1), None | Some(b' ')) {
            pos += 1;
            while bytes.get(pos) == Some(&b' ') {
                pos += 1;
            }
            if pos < bytes.len() {
                self.levels.push(pos);
            }
        }
        pos
    }

    /// Scan `line` from `pos` for quotes, flow collections and block scalar headers:
    /// whether flow nesting goes deeper than `max`.
    fn scan(&mut self, line: &str, mut pos: usize) -> bool {
        let bytes = line.as_bytes();
        // Could a flow collection, quoted or block scalar start here?
        let mut token_start = self.quote.is_none();
        let mut after_space = true;
        while pos < bytes.len() {
            let b = bytes[pos];
            pos += 1;
            if let Some(q) = self.quote {
                match (q, b) {
                    (b'"', b'\\') => pos += 1,
                    (b'\'', b'\'') if bytes.get(pos) == Some(&b'\'') => pos += 1,
                    _ if b == q => self.quote = None,
                    _ => {}
                }
                after_space = false;
                continue;
            }
            match b {
                b'#' if after_space => break,
                b'"' | b'\'' if token_start => self.quote = Some(b),
                b'[' | b'{' if token_start || self.flow > 0 => {
                    self.flow += 1;
                    if self.levels.len() + self.flow > self.max {
                        return true;
                    }
                }
                b']' | b'}' if self.flow > 0 => self.flow -= 1,
                b'|' | b'>' if token_start && self.flow == 0 => {
                    let header = bytes[pos..]
                        .iter()
                        .take_while(|b| matches!(b, b'-' | b'+' | b'0'..=b'9'))
                        .count();
                    let rest = line[pos + header..].trim_start();
                    if rest.is_empty() || rest.starts_with('#') {
                        self.block_scalar = Some(self.levels.last().copied().unwrap_or(0));
                        break;
                    }
                }
                _ => {}
            }
            let space = b == b' ' || b == b'\t';
            token_start = match b {
                _ if space => token_start,
                b'[' | b'{' | b',' => self.flow > 0 || token_start,
                b':' => matches!(bytes.get(pos), None | Some(b' ' | b'\t')),
                _ => false,
            };
            after_space = space;
        }
        false
    }
}

/// Key of an object for duplicate detection: (kind, namespace, name).
pub(super) type ObjectKey = (String, String, String);

/// `Kind namespace/name` or `Kind name`.
pub(super) fn object_label((kind, namespace, name): &ObjectKey) -> String {
    if namespace.is_empty() {
        format!("{kind} {name}")
    } else {
        format!("{kind} {namespace}/{name}")
    }
}

/// What one document holds.
#[derive(Clone)]
pub(super) enum Parsed {
    /// Nothing (comments only).
    Empty,
    Object(ObjectKey, Added),
    /// Unusable; `key` says which object it stands for, when that much could be read.
    Invalid {
        key: Option<ObjectKey>,
        errors: Vec<LoadError>,
    },
}

/// Parse and check one document: bounded in size and depth before the YAML parser sees it.
pub(super) fn parse_document(file: &str, doc: &Document<'_>) -> Parsed {
    let error = |object: Option<String>, field: Option<String>, message: String| {
        LoadError::Document(DocumentError {
            file: file.to_owned(),
            doc: doc.number,
            object,
            field,
            message,
        })
    };
    let value = match read_value(doc) {
        Ok(Some(v)) => v,
        Ok(None) => return Parsed::Empty,
        Err(message) => {
            return Parsed::Invalid {
                key: None,
                errors: vec![error(None, None, message)],
            };
        }
    };
    let (api_version, key, value) = match identify(value) {
        Ok(identified) => identified,
        Err((kind, field, message)) => {
            return Parsed::Invalid {
                key: None,
                errors: vec![error(kind, Some(field.to_owned()), message)],
            };
        }
    };
    let object = Some(object_label(&key));
    match decode(&api_version, &key.0, value) {
        Ok(added) => Parsed::Object(key, added),
        Err(field_errors) => Parsed::Invalid {
            key: Some(key),
            errors: field_errors
                .into_iter()
                .map(|fe| error(object.clone(), fe.field, fe.message))
                .collect(),
        },
    }
}

/// The document as a JSON value within the size and depth limits; `None` for an empty
/// document; the message when it is not a YAML mapping.
pub(super) fn read_value(doc: &Document<'_>) -> Result<Option<serde_json::Value>, String> {
    if doc.text.len() > MAX_DOCUMENT_BYTES {
        return Err(format!(
            "failed to parse YAML: the document is {} bytes, over the limit of {} MiB per \
             object",
            doc.text.len(),
            MAX_DOCUMENT_BYTES >> 20
        ));
    }
    if let Some(line) = too_deep(doc.text, MAX_DEPTH) {
        return Err(format!(
            "failed to parse YAML: nested deeper than {MAX_DEPTH} levels (brackets and \
             indentation together) at line {}",
            doc.line + line - 1
        ));
    }
    // Through YAML's own value first: its mappings refuse a key given twice (a second
    // `destinations:` in a rule, a label repeated), where a JSON object would keep the
    // last silently.
    let yaml: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(doc.text).map_err(|e| format!("failed to parse YAML: {e}"))?;
    let value = serde_json::to_value(&yaml).map_err(|e| format!("failed to read YAML: {e}"))?;
    if value.is_null() {
        return Ok(None);
    }
    if !value.is_object() {
        return Err("failed to read object: the document is not a mapping".to_owned());
    }
    Ok(Some(value))
}

/// An object's apiVersion and key (kind, namespace, name), with the value (an EgressNode
/// given an empty spec if it had none); else (the kind if known, the field, what is
/// wrong with it).
#[allow(clippy::type_complexity)]
pub(super) fn identify(
    mut value: serde_json::Value,
) -> Result<(String, ObjectKey, serde_json::Value), (Option<String>, &'static str, String)> {
    let text_field = |value: &serde_json::Value, key: &str| {
        value
            .get(key)
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
    };
    let missing = || "missing or not a string".to_owned();
    let api_version = text_field(&value, "apiVersion").ok_or((None, "apiVersion", missing()))?;
    let kind = text_field(&value, "kind").ok_or((None, "kind", missing()))?;
    // The agent's own EgressNodes always have a spec; hand-written ones may omit it.
    if kind == "EgressNode"
        && let Some(map) = value.as_object_mut()
    {
        map.entry("spec")
            .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
    }
    let meta_text = |key: &str| {
        value
            .get("metadata")
            .and_then(|m| m.get(key))
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
    };
    let namespace = if kind == "Pod" {
        meta_text("namespace").unwrap_or_else(|| "default".to_owned())
    } else {
        String::new()
    };
    if let Err(message) = dns_name(&namespace, true) {
        return Err((Some(kind), "metadata.namespace", message));
    }
    let Some(name) = meta_text("name").filter(|n| !n.is_empty()) else {
        return Err((Some(kind), "metadata.name", "missing or empty".to_owned()));
    };
    // A Namespace's name is a DNS label, the others' a DNS subdomain, as the API server
    // requires: a 1 MB name would otherwise be in every line that names the object.
    if let Err(message) = dns_name(&name, kind == "Namespace") {
        return Err((Some(kind), "metadata.name", message));
    }
    Ok((api_version, (kind, namespace, name), value))
}

/// The label checks of `value`'s `metadata.labels`.
pub(super) fn check_labels(value: &serde_json::Value) -> Vec<FieldError> {
    let labels = value
        .get("metadata")
        .and_then(|m| m.get("labels"))
        .and_then(serde_json::Value::as_object);
    labels
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| {
            let v = v.as_str().unwrap_or_default();
            label_ok(k, v)
                .err()
                .map(|m| field_error("metadata.labels", m))
        })
        .take(KEPT_NAMED)
        .collect()
}

/// The object `value` of `api_version` and `kind`, typed and checked.
pub(super) fn decode(
    api_version: &str,
    kind: &str,
    value: serde_json::Value,
) -> Result<Added, Vec<FieldError>> {
    let labels = check_labels(&value);
    if !labels.is_empty() {
        return Err(labels);
    }
    match (api_version, kind) {
        ("v1", "Pod") => typed::<Pod>(value, check_pod)
            .map(|p| Added::Pod(std::sync::Arc::new(PodSummary::from(&p)))),
        ("v1", "Node") => typed::<Node>(value, check_node).map(|n| Added::Node(Box::new(n))),
        ("v1", "Namespace") => {
            typed::<Namespace>(value, |_| Vec::new()).map(|n| Added::Namespace(Box::new(n)))
        }
        (API_VERSION, "EgressGatewayPolicy") => {
            // Rule contents are the compiler's to judge (as conditions), like the API
            // server would let a CEL-less cluster store them.
            typed::<EgressGatewayPolicy>(value, |_| Vec::new()).map(|p| Added::Policy(Box::new(p)))
        }
        (API_VERSION, "EgressNode") => {
            typed::<EgressNode>(value, check_egress_node).map(|n| Added::EgressNode(Box::new(n)))
        }
        (ovn::API_VERSION, ovn::KIND) => {
            typed::<ovn::EgressIP>(value, |_| Vec::new()).map(|e| Added::OvnEgressIp(Box::new(e)))
        }
        ("networking.k8s.io/v1", "NetworkPolicy") => {
            typed::<NetworkPolicy>(value, check_network_policy)
                .map(|n| Added::NetworkPolicy(Box::new(n)))
        }
        (admin::ANP_API_VERSION, "AdminNetworkPolicy") => {
            typed::<admin::AdminNetworkPolicy>(value, |_| Vec::new())
                .map(|o| Added::Unapplied(Unapplied::of("AdminNetworkPolicy", &o.metadata)))
        }
        (admin::ANP_API_VERSION, "BaselineAdminNetworkPolicy") => {
            typed::<admin::BaselineAdminNetworkPolicy>(value, |_| Vec::new())
                .map(|o| Added::Unapplied(Unapplied::of("BaselineAdminNetworkPolicy", &o.metadata)))
        }
        (admin::OVN_API_VERSION, "EgressFirewall") => {
            typed::<admin::EgressFirewall>(value, |_| Vec::new())
                .map(|o| Added::Unapplied(Unapplied::of("EgressFirewall", &o.metadata)))
        }
        _ => Err(vec![field_error(
            "kind",
            format!(
                "unsupported apiVersion/kind {api_version}/{kind} (expected v1 Pod, Node or \
                 Namespace, {API_VERSION} EgressGatewayPolicy or EgressNode, \
                 networking.k8s.io/v1 NetworkPolicy, {} AdminNetworkPolicy or \
                 BaselineAdminNetworkPolicy, or {} {} or EgressFirewall)",
                admin::ANP_API_VERSION,
                ovn::API_VERSION,
                ovn::KIND
            ),
        )]),
    }
}

#[derive(Clone)]
pub(super) enum Added {
    /// Only what the compiler reads: the whole `Pod` is dropped at once.
    Pod(std::sync::Arc<PodSummary>),
    Node(Box<Node>),
    Namespace(Box<Namespace>),
    Policy(Box<EgressGatewayPolicy>),
    EgressNode(Box<EgressNode>),
    OvnEgressIp(Box<ovn::EgressIP>),
    NetworkPolicy(Box<NetworkPolicy>),
    Unapplied(Unapplied),
}

/// Deserialize `value` as `T`, naming the field on failure, then run `check` on it.
pub(super) fn typed<T: DeserializeOwned>(
    value: serde_json::Value,
    check: impl FnOnce(&T) -> Vec<FieldError>,
) -> Result<T, Vec<FieldError>> {
    let object: T = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let field = (path != ".").then_some(path);
        let message = e.into_inner().to_string();
        vec![FieldError { field, message }]
    })?;
    let errors = check(&object);
    if errors.is_empty() {
        Ok(object)
    } else {
        Err(errors)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{fixtures::*, loading::*};
    use super::*;

    #[test]
    fn good_documents_are_all_read() {
        let snap = load_str("cluster.yaml", GOOD);
        assert_eq!(snap.errors, []);
        assert_eq!(snap.view.namespaces.len(), 1);
        assert_eq!(snap.view.nodes.len(), 1);
        assert_eq!(snap.view.pods.len(), 1);
        assert_eq!(snap.view.policies.len(), 1);
        assert_eq!(snap.view.egress_nodes.len(), 1);
        let pod = &snap.view.pods[0];
        assert_eq!(pod.node_name.as_deref(), Some("worker-1"));
        assert_eq!(snap.view.policies[0].metadata.generation, Some(3));
        let en = &snap.view.egress_nodes[0];
        assert_eq!(en.spec.underlay_ip.as_deref(), Some("10.0.0.11"));
    }

    #[test]
    fn bad_documents_are_reported_and_never_hide_good_ones() {
        let text = r#"
apiVersion: v1
kind: Namespace
metadata: {name: one}
---
apiVersion: v1
kind: Pod
metadata: {name: x, namespace: default}
status:
  podIPs: [{ip: 1.2.3}]
---
apiVersion: v1
kind: Pod
metadata: {name: y}
spec: {nodeName: [not, a, string]}
---
this: [is, not: valid
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: d}
---
kind: Node
metadata: {name: n}
---
apiVersion: v1
kind: Node
metadata: {labels: {a: b}}
---
apiVersion: v1
kind: Namespace
metadata: {name: one}
---
apiVersion: egress.dev/v1alpha1
kind: EgressNode
metadata: {name: gw-9}
status:
  interfaces: [{name: ens224, up: true, addresses: ["198.51.100.2"]}]
---
apiVersion: v1
kind: Namespace
metadata: {name: two}
"#;
        let snap = load_str("pods.yaml", text);
        let got = messages(&snap);
        let expected = [
            r#"file pods.yaml doc 2 (Pod default/x): status.podIPs[0].ip: invalid IP address "1.2.3""#,
            "file pods.yaml doc 3 (Pod default/y): spec.nodeName: invalid type: sequence, expected a string",
            "file pods.yaml doc 4: failed to parse YAML:",
            "file pods.yaml doc 5 (Deployment d): kind: unsupported apiVersion/kind apps/v1/Deployment",
            "file pods.yaml doc 6: apiVersion: missing or not a string",
            "file pods.yaml doc 7 (Node): metadata.name: missing or empty",
            "file pods.yaml doc 8 (Namespace one): metadata.name: duplicate object: already defined in file pods.yaml doc 1",
            "file pods.yaml doc 9 (EgressNode gw-9): status.interfaces[0].addresses[0]: invalid address with prefix length \"198.51.100.2\"",
        ];
        assert_eq!(got.len(), expected.len(), "{got:#?}");
        for (g, e) in got.iter().zip(expected) {
            assert!(
                g.starts_with(e),
                "got {g:?}, expected it to start with {e:?}"
            );
        }
        let names: Vec<_> = snap
            .view
            .namespaces
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        assert_eq!(names, ["one", "two"]);
        assert!(snap.view.pods.is_empty());
    }

    #[test]
    fn documents_are_numbered_as_written() {
        let doc = |number, line, text| Document { number, line, text };
        assert_eq!(
            split_documents("a: 1\n---\nb: 2\n--- {c: 3}\n"),
            [
                doc(1, 1, "a: 1\n"),
                doc(2, 3, "b: 2\n"),
                doc(3, 4, " {c: 3}\n")
            ]
        );
        assert_eq!(
            split_documents("# header\n---\nb: 2\n"),
            [doc(1, 3, "b: 2\n")]
        );
        assert_eq!(split_documents(""), [doc(1, 1, "")]);
    }

    #[test]
    fn network_policies_are_read_and_their_mistakes_named_by_field() {
        let good = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
                    metadata: {name: https-only, namespace: shop}\n\
                    spec:\n  podSelector: {}\n  policyTypes: [Egress]\n  egress:\n  \
                    - to: [{ipBlock: {cidr: 192.0.2.0/24, except: [192.0.2.0/28]}}]\n    \
                    ports: [{protocol: TCP, port: 8000, endPort: 8080}]\n";
        let snap = load_str("np.yaml", good);
        assert_eq!(snap.errors, []);
        assert_eq!(snap.view.network_policies.len(), 1);
        let cases = [
            (
                "cidr: 192.0.2.0/24, except: [198.51.100.0/28]",
                "spec.egress[0].to[0].ipBlock.except[0]: 198.51.100.0/28 must be strictly inside 192.0.2.0/24",
            ),
            (
                "cidr: 192.0.2.1/24",
                "spec.egress[0].to[0].ipBlock.cidr: 192.0.2.1/24 has host bits set",
            ),
            (
                "cidr: nope",
                "spec.egress[0].to[0].ipBlock.cidr: \"nope\" is not a CIDR",
            ),
        ];
        for (block, want) in cases {
            let doc = good.replace("cidr: 192.0.2.0/24, except: [192.0.2.0/28]", block);
            let snap = load_str("np.yaml", &doc);
            let text = messages(&snap).join("\n");
            assert!(text.contains(want), "{want:?} in {text}");
            assert!(snap.view.network_policies.is_empty());
        }
        let doc = good.replace("endPort: 8080", "endPort: 80");
        let text = messages(&load_str("np.yaml", &doc)).join("\n");
        assert!(
            text.contains(
                "spec.egress[0].ports[0].endPort: 80 must be a port (to 65535) at least port 8000"
            ),
            "{text}"
        );
    }

    #[test]
    fn names_labels_and_pod_addresses_are_bounded_as_the_api_server_bounds_them() {
        let long = "a".repeat(1 << 20);
        let cases = [
            (
                format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {long}}}\n"),
                "metadata.name: \"aaaa",
            ),
            (
                "apiVersion: v1\nkind: Namespace\nmetadata: {name: Shop_1}\n".to_owned(),
                "metadata.name: \"Shop_1\" is not a DNS label",
            ),
            (
                "apiVersion: v1\nkind: Node\nmetadata: {name: w1.example.com}\n".to_owned(),
                "",
            ),
            (
                format!(
                    "apiVersion: v1\nkind: Namespace\nmetadata: {{name: a, labels: {{team: {}}}}}\n",
                    "x".repeat(64)
                ),
                "metadata.labels: key \"team\": value",
            ),
            (
                "apiVersion: v1\nkind: Namespace\nmetadata: {name: a, labels: {\"-x\": y}}\n"
                    .to_owned(),
                "metadata.labels: key \"-x\": the name part",
            ),
            (
                "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: shop}\n\
                 spec: {nodeName: w1}\nstatus: {phase: Running, podIPs: [{ip: 10.0.0.1}, \
                 {ip: 10.0.0.2}]}\n"
                    .to_owned(),
                "status.podIPs: 2 addresses: a Pod has at most 2, one of each family",
            ),
        ];
        for (doc, want) in cases {
            let snap = load_str("x.yaml", &doc);
            let text = messages(&snap).join("\n");
            if want.is_empty() {
                assert_eq!(snap.errors, [], "{doc:.80}");
                continue;
            }
            assert!(text.contains(want), "{want:?} in {text:.300}");
            assert!(text.len() < 1024, "a bounded message: {} bytes", text.len());
            assert!(snap.view.namespaces.is_empty() && snap.view.pods.is_empty());
        }
    }

    #[test]
    fn a_key_given_twice_is_an_error_naming_it_not_the_last_one_winning() {
        // The issue's probes: a rule with a second `destinations` (the last, 0.0.0.0/0,
        // won), and a label given twice.
        let policy = "apiVersion: egress.dev/v1alpha1\nkind: EgressGatewayPolicy\n\
                      metadata: {name: p}\nspec:\n  rules:\n  - destinations: [192.0.2.0/24]\n\
                      \x20   egressIP: 198.51.100.10\n    destinations: [0.0.0.0/0]\n";
        let snap = load_str("p.yaml", policy);
        assert!(snap.view.policies.is_empty(), "{:?}", snap.view.policies);
        let text = messages(&snap).join("\n");
        assert!(
            text.contains("duplicate entry with key \"destinations\""),
            "{text}"
        );
        assert!(text.contains("p.yaml"), "{text}");
        let labels = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: a\n  labels:\n\
                      \x20   team: x\n    team: y\n";
        let snap = load_str("ns.yaml", labels);
        assert!(snap.view.namespaces.is_empty());
        assert!(
            messages(&snap)
                .join("\n")
                .contains("duplicate entry with key \"team\""),
            "{:?}",
            messages(&snap)
        );
    }

    #[test]
    fn a_document_over_the_size_limit_is_refused_before_parsing() {
        let big = format!(
            "{}---\n# {}\n",
            ns("a", "x"),
            "x".repeat(MAX_DOCUMENT_BYTES)
        );
        let snap = load_str("big.yaml", &big);
        assert_eq!(teams(&snap), ["a:x"]);
        assert_eq!(
            messages(&snap),
            [format!(
                "file big.yaml doc 2: failed to parse YAML: the document is {} bytes, over the \
                 limit of 2 MiB per object",
                MAX_DOCUMENT_BYTES + 3
            )]
        );
    }

    /// Deep nesting of every kind: (case, text, line of the file where it goes too deep).
    fn deep_documents() -> Vec<(&'static str, String, usize)> {
        let indented: String = (0..100)
            .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
            .collect();
        let dashes = format!("x:\n{}1\n", "- ".repeat(100));
        vec![
            ("200 kB of brackets", "[".repeat(200_000), 1),
            (
                "braces after a key",
                format!("a: 1\nb: {}", "{c: ".repeat(1000)),
                2,
            ),
            ("mixed", format!("a:\n  - {}\n", "[{".repeat(50)), 2),
            ("indentation", indented, MAX_DEPTH + 1),
            ("compact sequences", dashes, 2),
            (
                "brackets over lines",
                format!("a: [\n{}", "[\n".repeat(200)),
                MAX_DEPTH,
            ),
        ]
    }

    #[test]
    fn deep_nesting_is_refused_naming_file_and_line_before_parsing() {
        for (case, deep, line) in deep_documents() {
            let text = format!("{}---\n# comment\n{deep}", ns("a", "x"));
            let snap = load_str("deep.yaml", &text);
            assert_eq!(teams(&snap), ["a:x"], "{case}");
            assert_eq!(
                messages(&snap),
                [format!(
                    "file deep.yaml doc 2: failed to parse YAML: nested deeper than 64 levels \
                     (brackets and indentation together) at line {}",
                    line + 5
                )],
                "{case}"
            );
        }
    }

    #[test]
    fn ordinary_yaml_is_not_mistaken_for_deep_nesting() {
        let brackets = "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[";
        let texts = [
            GOOD.to_owned(),
            format!("a: \"{brackets}\"\nb: '{brackets}'\n"),
            format!("a: text{brackets}\nb: x # {brackets}\n# {brackets}\n"),
            format!("script: |\n  {brackets}\n\n  {brackets}\nnext: >-\n  {brackets}\nc: 1\n"),
            format!("- key: |\n    {brackets}\n  other: 1\n"),
            format!("a: \"multi\n  line {brackets}\n  end\"\nb: [1, \"]]]\", '[', {{c: d}}]\n"),
            format!("url: http://x/{brackets}\nd: 'it''s {brackets}'\n"),
            (0..1000).map(|i| format!("k{i}: [{{a: [1]}}]\n")).collect(),
        ];
        for text in texts {
            assert_eq!(too_deep(&text, MAX_DEPTH), None, "{text}");
        }
        // The line's own block level counts too.
        assert_eq!(too_deep(&"[".repeat(MAX_DEPTH - 1), MAX_DEPTH), None);
        assert_eq!(too_deep(&"[".repeat(MAX_DEPTH), MAX_DEPTH), Some(1));
    }
}
