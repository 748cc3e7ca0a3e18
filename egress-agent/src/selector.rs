//! Kubernetes label selectors (`matchLabels` and `matchExpressions`), checked once and
//! then matched many times.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

/// The field [`Selector::gateways`] checks, for messages.
const GATEWAY_SELECTOR: &str = "spec.gatewaySelector";

/// A checked selector. The empty selector matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

impl Selector {
    /// Everything.
    pub fn everything() -> Self {
        Self::default()
    }

    /// Check `selector`; `field` is its path in the object, for messages such as
    /// `spec.podSelector.matchExpressions[0].values: must be non-empty for operator In`.
    pub fn new(selector: &LabelSelector, field: &str) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for (key, value) in selector.match_labels.iter().flatten() {
            requirements.push(Requirement::Equals(key.clone(), value.clone()));
        }
        for (i, expr) in selector.match_expressions.iter().flatten().enumerate() {
            let values = expr.values.clone().unwrap_or_default();
            let at = format!("{field}.matchExpressions[{i}]");
            let key = expr.key.clone();
            if key.is_empty() {
                return Err(format!("{at}.key: must not be empty"));
            }
            let requirement = match expr.operator.as_str() {
                "In" | "NotIn" if values.is_empty() => {
                    return Err(format!(
                        "{at}.values: must be non-empty for operator {}",
                        expr.operator
                    ));
                }
                "Exists" | "DoesNotExist" if !values.is_empty() => {
                    return Err(format!(
                        "{at}.values: must be empty for operator {}",
                        expr.operator
                    ));
                }
                "In" => Requirement::In(key, values),
                "NotIn" => Requirement::NotIn(key, values),
                "Exists" => Requirement::Exists(key),
                "DoesNotExist" => Requirement::DoesNotExist(key),
                other => {
                    return Err(format!(
                        "{at}.operator: {other:?} is not one of In, NotIn, Exists, DoesNotExist"
                    ));
                }
            };
            requirements.push(requirement);
        }
        Ok(Self { requirements })
    }

    /// Check a policy's namespace or pod selector, absent (everything) or not, as the
    /// policy's plan checks it.
    pub fn optional(selector: Option<&LabelSelector>, field: &str) -> Result<Self, String> {
        selector.map_or_else(|| Ok(Self::everything()), |s| Self::new(s, field))
    }

    /// Check a policy's `spec.gatewaySelector`: as [`Selector::new`], and never empty (an
    /// empty selector would make every node a gateway).
    pub fn gateways(selector: &LabelSelector) -> Result<Self, String> {
        let checked = Self::new(selector, GATEWAY_SELECTOR)?;
        if checked.requirements.is_empty() {
            return Err(format!(
                "{GATEWAY_SELECTOR}: must not be empty (it would make every node a gateway): \
                 select the gateway nodes by label, such as \
                 `gatewaySelector: {{matchLabels: {{egress.dev/gateway: \"true\"}}}}`"
            ));
        }
        Ok(checked)
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| match r {
            Requirement::Equals(k, v) => labels.get(k) == Some(v),
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::DoesNotExist(k) => !labels.contains_key(k),
        })
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.to_owned(),
            operator: op.to_owned(),
            values: (!values.is_empty()).then(|| values.iter().map(|v| (*v).to_owned()).collect()),
        }
    }

    #[test]
    fn match_labels_and_expressions_are_both_honoured() {
        let sel = LabelSelector {
            match_labels: Some(labels(&[("app", "api")])),
            match_expressions: Some(vec![
                expr("tier", "In", &["a", "b"]),
                expr("canary", "DoesNotExist", &[]),
                expr("zone", "NotIn", &["z9"]),
                expr("team", "Exists", &[]),
            ]),
        };
        let sel = Selector::new(&sel, "spec.podSelector").expect("valid");
        let cases: &[(&[(&str, &str)], bool)] = &[
            (&[("app", "api"), ("tier", "a"), ("team", "x")], true),
            (
                &[("app", "api"), ("tier", "b"), ("team", "x"), ("zone", "z1")],
                true,
            ),
            (&[("app", "api"), ("tier", "c"), ("team", "x")], false),
            (&[("app", "web"), ("tier", "a"), ("team", "x")], false),
            (
                &[
                    ("app", "api"),
                    ("tier", "a"),
                    ("team", "x"),
                    ("canary", "1"),
                ],
                false,
            ),
            (
                &[("app", "api"), ("tier", "a"), ("team", "x"), ("zone", "z9")],
                false,
            ),
            (&[("app", "api"), ("tier", "a")], false),
        ];
        for (l, want) in cases {
            assert_eq!(sel.matches(&labels(l)), *want, "{l:?}");
        }
        assert!(Selector::everything().matches(&labels(&[])));
        let empty = Selector::new(&LabelSelector::default(), "x").expect("valid");
        assert!(empty.matches(&labels(&[("a", "b")])));
    }

    #[test]
    fn invalid_expressions_name_the_field() {
        let cases = [
            (
                expr("a", "Like", &["x"]),
                "spec.podSelector.matchExpressions[0].operator: \"Like\" is not one of In, NotIn, Exists, DoesNotExist",
            ),
            (
                expr("a", "In", &[]),
                "spec.podSelector.matchExpressions[0].values: must be non-empty for operator In",
            ),
            (
                expr("a", "Exists", &["x"]),
                "spec.podSelector.matchExpressions[0].values: must be empty for operator Exists",
            ),
        ];
        for (e, want) in cases {
            let sel = LabelSelector {
                match_labels: None,
                match_expressions: Some(vec![e]),
            };
            assert_eq!(
                Selector::new(&sel, "spec.podSelector"),
                Err(want.to_owned())
            );
        }
    }
}
