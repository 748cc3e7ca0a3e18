//! `import-egressip --from-cluster`: the cluster's OVN-Kubernetes `EgressIP` objects, listed
//! through the Kubernetes API (`list` on `egressips.k8s.ovn.org`, cluster-scoped), as the
//! [`Document`]s a file would have given, so that they take the same translation.
//!
//! The objects are read as [`DynamicObject`]s, not as [`ovn::EgressIP`]: that type keeps
//! only the addresses, and the translation must see every spec field to refuse those it
//! does not know. What can go wrong with the list as a whole is an [`Error`] naming the
//! cause (the CRD not served, RBAC, an API server out of reach); what is wrong with one
//! object is a [`Refusal`] of that object, as for a file.

use std::{collections::BTreeSet, time::Duration};

use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, ListParams, TypeMeta},
};
use serde_json::Value;

use super::{Document, Refusal};
use crate::source::ovn;

/// The resource, as RBAC and `kubectl` name it.
pub const RESOURCE: &str = "egressips.k8s.ovn.org";

/// Why the `EgressIP` objects could not be listed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Client(#[from] crate::source::kube::Error),
    #[error(
        "failed to list {RESOURCE}: OVN-Kubernetes' EgressIP CRD is not served by this \
         cluster (404 for k8s.ovn.org/v1 egressips): not an OVN-Kubernetes cluster, or the \
         kubeconfig's current context names another cluster"
    )]
    NotServed,
    #[error(
        "failed to list {RESOURCE}: forbidden (403): RBAC must grant this user the verb list \
         on the resource egressips in the API group k8s.ovn.org, cluster-wide (a ClusterRole \
         and a ClusterRoleBinding); the API server said: {message}"
    )]
    Forbidden { message: String },
    #[error(
        "failed to list {RESOURCE}: unauthorized (401): the API server does not accept the \
         credentials of the kubeconfig's current context (log in again): {message}"
    )]
    Unauthorized { message: String },
    #[error(
        "failed to list {RESOURCE}: the API server is unreachable (the kubeconfig's current \
         context, or the in-cluster service account): {source}"
    )]
    Unreachable {
        #[source]
        source: kube::Error,
    },
    #[error("failed to list {RESOURCE}: no answer within {secs} s: is the API server reachable?")]
    Timeout { secs: u64 },
    #[error("failed to list {RESOURCE}: {source}")]
    List {
        #[source]
        source: kube::Error,
    },
}

/// `EgressIP` as a dynamic resource: group, version, kind and plural as [`ovn::EgressIP`]
/// declares them.
pub fn api_resource() -> ApiResource {
    ApiResource::erase::<ovn::EgressIP>(&())
}

/// The `EgressIP` objects of the cluster, or those named in `names` (a name the cluster
/// does not have is a refusal), each list within `timeout`.
pub async fn documents(
    client: &Client,
    names: &[String],
    timeout: Duration,
) -> Result<(Vec<Document>, Vec<Refusal>), Error> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &api_resource());
    let list = tokio::time::timeout(timeout, api.list(&ListParams::default()))
        .await
        .map_err(|_| Error::Timeout {
            secs: timeout.as_secs(),
        })?
        .map_err(listing_error)?;
    let objects = list.items.into_iter().map(as_value).collect();
    Ok(picked(objects, names))
}

/// What went wrong with the list, as the user must fix it.
fn listing_error(e: kube::Error) -> Error {
    match e {
        kube::Error::Api(status) => match status.code {
            404 => Error::NotServed,
            403 => Error::Forbidden {
                message: status.message,
            },
            401 => Error::Unauthorized {
                message: status.message,
            },
            _ => Error::List {
                source: kube::Error::Api(status),
            },
        },
        e @ (kube::Error::Service(_) | kube::Error::HyperError(_)) => {
            Error::Unreachable { source: e }
        }
        e => Error::List { source: e },
    }
}

/// One listed object as its JSON, with the kind and apiVersion it was listed as (an API
/// server may leave them out of a list's items).
fn as_value(mut object: DynamicObject) -> Value {
    let resource = api_resource();
    object.types.get_or_insert(TypeMeta {
        api_version: resource.api_version,
        kind: resource.kind,
    });
    serde_json::to_value(object).expect("a listed object serialises to JSON")
}

/// The listed `objects` (all, or those of `names`) as documents named after the list, and
/// a refusal for each name that is not among them.
pub fn picked(objects: Vec<Value>, names: &[String]) -> (Vec<Document>, Vec<Refusal>) {
    let wanted: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    let name_of = |v: &Value| {
        v["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let listed: BTreeSet<String> = objects.iter().map(name_of).collect();
    let docs = objects
        .into_iter()
        .enumerate()
        .filter(|(_, v)| wanted.is_empty() || wanted.contains(name_of(v).as_str()))
        .map(|(i, value)| Document {
            origin: format!("{RESOURCE} (the API), items[{i}]"),
            value,
        })
        .collect();
    let missing = wanted
        .into_iter()
        .filter(|n| !listed.contains(*n))
        .map(|n| Refusal {
            object: format!("EgressIP {n:?}"),
            field: "--name".into(),
            problem: format!("the cluster has no EgressIP of that name ({RESOURCE})"),
        })
        .collect();
    (docs, missing)
}
