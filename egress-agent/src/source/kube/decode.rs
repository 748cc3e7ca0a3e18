//! Decoding what the API server sends: an object that does not decode, or fails the checks
//! the YAML source runs on it too ([`objects`](crate::source::objects)), never stops its kind: it is left out of
//! the view and reported as a [`LoadError`] naming kind, name and field.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::{Deserialize, Deserializer, de::DeserializeOwned};

use crate::source::{DocumentError, LoadError, objects::FieldError};

/// An object as the API server sent it, decoded as `K` if it could be. Watching this
/// instead of `K` keeps one undecodable object from failing a whole list or watch.
#[derive(Clone, Debug)]
pub(super) struct Decoded<K> {
    pub(super) metadata: ObjectMeta,
    pub(super) object: Result<K, DecodeFailure>,
}

/// Why an object did not decode.
#[derive(Clone, Debug)]
pub(super) struct DecodeFailure {
    /// Path of the offending field (`status.podIPs[0]`), when known.
    pub(super) field: Option<String>,
    pub(super) message: String,
}

impl<K: Resource<DynamicType = ()>> Resource for Decoded<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }

    fn api_version(dt: &()) -> Cow<'_, str> {
        K::api_version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl<'de, K> Deserialize<'de> for Decoded<K>
where
    K: Resource<DynamicType = ()> + DeserializeOwned,
{
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut value = serde_json::Value::deserialize(deserializer)?;
        trim(&K::kind(&()), &mut value);
        let raw_metadata = value.get("metadata").unwrap_or(&serde_json::Value::Null);
        let metadata = match Option::<ObjectMeta>::deserialize(raw_metadata) {
            Ok(metadata) => metadata.unwrap_or_default(),
            Err(e) => {
                // Keep what identifies the object, so that it can be named and replaced.
                let text = |key: &str| {
                    raw_metadata
                        .get(key)
                        .and_then(serde_json::Value::as_str)
                        .map(str::to_owned)
                };
                let metadata = ObjectMeta {
                    name: text("name"),
                    namespace: text("namespace"),
                    resource_version: text("resourceVersion"),
                    ..ObjectMeta::default()
                };
                let object = Err(DecodeFailure {
                    field: Some("metadata".to_owned()),
                    message: e.to_string(),
                });
                return Ok(Self { metadata, object });
            }
        };
        let object = serde_path_to_error::deserialize::<_, K>(value).map_err(|e| {
            let path = e.path().to_string();
            DecodeFailure {
                field: (path != ".").then_some(path),
                message: e.into_inner().to_string(),
            }
        });
        Ok(Self { metadata, object })
    }
}

/// Drop what the agent never reads and what costs the most memory: managed fields, the
/// last-applied annotation, and the containers and volumes of Pods (the compiler reads a
/// Pod's node, network mode, labels, phase and addresses). Also gives an EgressNode written
/// without a spec the empty one, as the YAML source does.
fn trim(kind: &str, value: &mut serde_json::Value) {
    let Some(object) = value.as_object_mut() else {
        return;
    };
    if let Some(metadata) = object
        .get_mut("metadata")
        .and_then(serde_json::Value::as_object_mut)
    {
        metadata.remove("managedFields");
        if let Some(annotations) = metadata
            .get_mut("annotations")
            .and_then(serde_json::Value::as_object_mut)
        {
            annotations.remove("kubectl.kubernetes.io/last-applied-configuration");
        }
    }
    match kind {
        "Pod" => {
            if let Some(spec) = object
                .get_mut("spec")
                .and_then(serde_json::Value::as_object_mut)
            {
                spec.insert(
                    "containers".to_owned(),
                    serde_json::Value::Array(Vec::new()),
                );
                for key in ["initContainers", "ephemeralContainers", "volumes"] {
                    spec.remove(key);
                }
            }
            if let Some(status) = object
                .get_mut("status")
                .and_then(serde_json::Value::as_object_mut)
            {
                for key in [
                    "containerStatuses",
                    "initContainerStatuses",
                    "ephemeralContainerStatuses",
                ] {
                    status.remove(key);
                }
            }
        }
        "EgressNode" => {
            object
                .entry("spec")
                .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
        }
        _ => {}
    }
}

/// The objects of `entries` that decoded and pass `check`, as `convert` makes them; an error
/// for each that did not decode and for each field that failed its check. One bad object
/// never hides the others.
pub(super) fn served<'a, K, T>(
    entries: impl Iterator<Item = &'a Decoded<K>>,
    errors: &mut Vec<LoadError>,
    check: impl Fn(&K) -> Vec<FieldError>,
    convert: impl Fn(&K) -> T,
) -> Vec<T>
where
    K: Resource<DynamicType = ()> + 'a,
{
    let mut out = Vec::new();
    for entry in entries {
        match &entry.object {
            Ok(object) => {
                let failed = check(object);
                if failed.is_empty() {
                    out.push(convert(object));
                }
                for f in failed {
                    errors.push(object_error::<K>(&entry.metadata, f.field, f.message));
                }
            }
            Err(failure) => errors.push(decode_error::<K>(&entry.metadata, failure)),
        }
    }
    out
}

/// A [`DocumentError`] for an object that did not decode: `file` is the object's API path,
/// `object` its kind and name.
pub(super) fn decode_error<K: Resource<DynamicType = ()>>(
    metadata: &ObjectMeta,
    failure: &DecodeFailure,
) -> LoadError {
    let kind = K::kind(&());
    let message = format!("failed to decode {kind}: {}", failure.message);
    object_error::<K>(metadata, failure.field.clone(), message)
}

/// A [`DocumentError`] about the object of `metadata`: `file` is its API path, `object` its
/// kind and name, `field` what to fix.
pub(super) fn object_error<K: Resource<DynamicType = ()>>(
    metadata: &ObjectMeta,
    field: Option<String>,
    message: String,
) -> LoadError {
    let kind = K::kind(&());
    let name = metadata.name.as_deref().unwrap_or_default();
    let namespace = metadata.namespace.as_deref();
    let object = match namespace {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    };
    LoadError::Document(DocumentError {
        file: format!("{}/{name}", K::url_path(&(), namespace)),
        doc: 1,
        object: Some(object),
        field,
        message,
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Pod;

    use super::*;
    use crate::{
        api::EgressNode,
        source::{PodSummary, objects},
    };

    #[test]
    fn undecodable_object_is_kept_as_an_error_naming_the_field() {
        let doc = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web", "namespace": "shop", "resourceVersion": "7",
                         "managedFields": [{"manager": "kubectl"}]},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
            "status": {"podIPs": [{"ip": 5}]}
        });
        let decoded: Decoded<Pod> = serde_json::from_value(doc).expect("lenient decode");
        assert_eq!(decoded.metadata.name.as_deref(), Some("web"));
        assert_eq!(decoded.metadata.managed_fields, None);
        let failure = decoded.object.expect_err("podIPs[0].ip is a number");
        assert_eq!(failure.field.as_deref(), Some("status.podIPs[0].ip"));
        let error = decode_error::<Pod>(&decoded.metadata, &failure).to_string();
        assert!(
            error.contains("(Pod shop/web): status.podIPs[0].ip:"),
            "{error}"
        );
    }

    #[test]
    fn pods_are_trimmed_and_egress_nodes_get_a_spec() {
        let pod = serde_json::json!({
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"nodeName": "n1", "hostNetwork": false,
                     "containers": [{"name": "c", "image": "i"}], "volumes": []},
            "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.1"}],
                       "containerStatuses": []}
        });
        let pod: Decoded<Pod> = serde_json::from_value(pod).expect("decode");
        let pod = pod.object.expect("valid pod");
        let spec = pod.spec.expect("spec");
        assert_eq!(spec.node_name.as_deref(), Some("n1"));
        assert!(spec.containers.is_empty());
        assert_eq!(spec.volumes, None);
        let node = serde_json::json!({"metadata": {"name": "gw-1"}});
        let node: Decoded<EgressNode> = serde_json::from_value(node).expect("decode");
        assert!(node.object.is_ok());
    }

    /// Pods as the API server would list them: `ips` in `status.podIPs`.
    fn pod(name: &str, ips: &[&str]) -> Decoded<Pod> {
        let ips: Vec<_> = ips
            .iter()
            .map(|ip| serde_json::json!({ "ip": ip }))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"nodeName": "n1", "containers": []},
            "status": {"phase": "Running", "podIPs": ips}
        }))
        .expect("decode")
    }

    fn messages(errors: &[LoadError]) -> Vec<String> {
        errors.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn a_pod_with_a_bad_address_is_reported_by_name_and_the_others_served() {
        let pods = [
            pod("a", &["10.0.0.1"]),
            pod("bad", &["10.0.0"]),
            pod("b", &["10.0.0.2", "fd00::2"]),
            pod("twice", &["10.0.0.3", "10.0.0.4"]),
        ];
        let mut errors = Vec::new();
        let served = served(pods.iter(), &mut errors, objects::check_pod, |p: &Pod| {
            PodSummary::from(p)
        });
        let names: Vec<_> = served.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(
            messages(&errors),
            [
                "file /api/v1/namespaces/shop/pods/bad doc 1 (Pod shop/bad): \
                 status.podIPs[0].ip: invalid IP address \"10.0.0\"",
                "file /api/v1/namespaces/shop/pods/twice doc 1 (Pod shop/twice): \
                 status.podIPs: 2 addresses: a Pod has at most 2, one of each family",
            ]
        );
    }

    #[test]
    fn an_egress_node_with_a_bad_underlay_address_is_reported_by_name() {
        let node = |name: &str, underlay: &str| -> Decoded<EgressNode> {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name}, "spec": {"underlayIP": underlay}
            }))
            .expect("decode")
        };
        let nodes = [node("gw-1", "10.0.0.11"), node("gw-2", "10.0.0.300")];
        let mut errors = Vec::new();
        let served = served(
            nodes.iter(),
            &mut errors,
            objects::check_egress_node,
            Clone::clone,
        );
        assert_eq!(served.len(), 1);
        assert_eq!(served[0].metadata.name.as_deref(), Some("gw-1"));
        assert_eq!(
            messages(&errors),
            [
                "file /apis/egress.dev/v1alpha1/egressnodes/gw-2 doc 1 (EgressNode gw-2): \
                 spec.underlayIP: invalid IP address \"10.0.0.300\""
            ]
        );
    }
}
