//! Kubernetes as the source of cluster state, and the place the agent writes back to.
//!
//! [`watch`] runs one kube-rs [`watcher`] and reflector store per kind (Pods, Namespaces,
//! Nodes, EgressGatewayPolicies, EgressNodes, NetworkPolicies, and the optional kinds the
//! API server serves) and publishes a [`Snapshot`] of the stores, the same type the YAML
//! directory source produces, whenever one of them changes. [`watch_node`], the agent's,
//! watches only the Pods its node needs ([`pods`]).
//! Watch trouble (a watch that ends, `410 Gone`, a dropped connection, an API server that is
//! away) is the watcher's to recover from: it resumes or re-lists with backoff
//! ([`WatchStreamExt::default_backoff`]), and the stores, hence the published view, keep the
//! last good state meanwhile (a re-list replaces a store only once it is complete).
//!
//! An object that does not decode, or fails the checks the YAML source runs on it too
//! ([`objects`]: a Pod's addresses, a Node's, an EgressNode's), never stops its kind: it is
//! left out of the view and reported in [`Snapshot::errors`], naming kind, name and field.
//!
//! The writers: [`publish_egress_node`] (server-side apply of this node's EgressNode),
//! [`publish_policy_status`] (merge patch of a policy's status subresource, only when it
//! changed) and [`record_event`] (a core/v1 Event on a policy, for holder changes).
//!
//! RBAC the agent needs: list and watch on pods, namespaces, nodes, egressgatewaypolicies
//! and egressnodes; get and patch on egressgatewaypolicies/status; patch on egressnodes and
//! egressnodes/status; get on egressgatewaypolicies and create on events (namespace
//! [`EVENT_NAMESPACE`]) for [`record_event`].

use std::{
    borrow::Cow,
    fmt::Debug,
    path::PathBuf,
    pin::pin,
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use futures::StreamExt as _;
use k8s_openapi::{
    api::{
        core::v1::{Event as CoreEvent, EventSource, Namespace, Node, ObjectReference, Pod},
        networking::v1::NetworkPolicy,
    },
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Client, Resource,
    api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        WatchStreamExt as _,
        reflector::{self, Store},
        watcher,
    },
};
use serde::{Deserialize, Deserializer, de::DeserializeOwned};
use tokio::{sync::Notify, task::AbortHandle};
use tracing::{debug, info, warn};

use super::{
    ClusterView, PodScope, PodSummary, admin,
    objects::{self, FieldError},
    openshift, ovn,
    yaml::{DocumentError, LoadError, Snapshot},
};
use crate::api::{API_VERSION, EgressGatewayPolicy, EgressNode, PolicyStatus};

/// Field manager of everything the agent writes.
pub const FIELD_MANAGER: &str = "egress-agent";
/// Namespace of the Events [`record_event`] creates (the policies are cluster-scoped; this
/// is where Kubernetes itself puts events about cluster-scoped objects).
pub const EVENT_NAMESPACE: &str = "default";
/// How long a change waits for the changes that follow it before a snapshot is published:
/// a burst (a re-list, a rollout) becomes one snapshot, and a lone change is seen within
/// this delay plus the time to build the snapshot.
pub const DEBOUNCE: Duration = Duration::from_millis(50);
/// How long one writer call may take: the agent's loop must not stall on an API server
/// that does not answer.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

mod pods;
/// Errors of the Kubernetes source and writers.
pub mod writer;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("failed to read kubeconfig {path}: {source}")]
    ReadKubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error(
        "failed to find a Kubernetes configuration (no usable kubeconfig in $KUBECONFIG or \
         ~/.kube/config, and not running in a cluster): {0}"
    )]
    Infer(#[source] kube::config::InferConfigError),
    #[error("failed to create the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error("failed to watch {kind}: the watcher stopped before its first list completed")]
    WatcherStopped { kind: &'static str },
    #[error("failed to publish EgressNode: metadata.name is missing or empty")]
    EgressNodeName,
    #[error("failed to serialize {what}: {source}")]
    Serialize {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("failed to apply EgressNode {name} ({part}): {source}")]
    ApplyEgressNode {
        name: String,
        part: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("failed to read EgressGatewayPolicy {name}: {source}")]
    GetPolicy {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("failed to patch EgressGatewayPolicy {name} status: {source}")]
    PatchPolicyStatus {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("failed to {what}: no answer within {} s", WRITE_TIMEOUT.as_secs())]
    Timeout { what: String },
    #[error("failed to record Event {reason} on EgressGatewayPolicy {name}: {source}")]
    RecordEvent {
        name: String,
        reason: String,
        #[source]
        source: kube::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A Kubernetes client: from the kubeconfig at `kubeconfig` (its current context) if given,
/// else inferred (`$KUBECONFIG` or `~/.kube/config`, then the in-cluster service account).
pub async fn client(kubeconfig: Option<PathBuf>) -> Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let read_error = |source| Error::ReadKubeconfig {
                path: path.clone(),
                source,
            };
            let kubeconfig = Kubeconfig::read_from(&path).map_err(read_error)?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(read_error)?
        }
        None => kube::Config::infer().await.map_err(Error::Infer)?,
    };
    Client::try_from(config).map_err(Error::Client)
}

// ---------------------------------------------------------------------------------------
// Reading

/// An object as the API server sent it, decoded as `K` if it could be. Watching this
/// instead of `K` keeps one undecodable object from failing a whole list or watch.
#[derive(Clone, Debug)]
struct Decoded<K> {
    metadata: ObjectMeta,
    object: Result<K, DecodeFailure>,
}

/// Why an object did not decode.
#[derive(Clone, Debug)]
struct DecodeFailure {
    /// Path of the offending field (`status.podIPs[0]`), when known.
    field: Option<String>,
    message: String,
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

/// Stops the watcher tasks when the publisher stops (or `watch` is abandoned).
struct Tasks(Vec<AbortHandle>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// Start the watcher and store of one kind; `changed` is notified whenever the store
/// changes (an object applied or deleted, or a list completed).
fn start<K>(client: &Client, changed: &Arc<Notify>, tasks: &mut Tasks) -> Store<Decoded<K>>
where
    K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Debug + Send + Sync + 'static,
{
    // Any semantic: initial lists and re-lists are served from the API server's watch
    // cache, as client-go informers do: every agent of a DaemonSet lists these kinds.
    let config = watcher::Config::default().any_semantic();
    let (store, task) = start_with(client, config, changed);
    tasks.0.push(task);
    store
}

/// [`start`] with the watcher's `config` (selectors), returning the task that fills the
/// store, for the caller to stop.
fn start_with<K>(
    client: &Client,
    config: watcher::Config,
    changed: &Arc<Notify>,
) -> (Store<Decoded<K>>, AbortHandle)
where
    K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Debug + Send + Sync + 'static,
{
    let api: Api<Decoded<K>> = Api::all(client.clone());
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, config).default_backoff());
    let changed = changed.clone();
    let task = tokio::spawn(async move {
        let kind = K::kind(&());
        let mut stream = pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_)) => {
                    changed.notify_one();
                }
                Ok(watcher::Event::InitDone) => {
                    debug!(%kind, "list complete");
                    changed.notify_one();
                }
                Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
                Err(watcher::Error::WatchError(status)) if status.code == 410 => {
                    info!(%kind, "watch expired (410 Gone), listing again");
                }
                Err(e) => warn!(%kind, "failed to watch {kind} (retrying with backoff): {e}"),
            }
        }
    });
    (store, task.abort_handle())
}

/// The stores of every kind.
struct Stores {
    policies: Store<Decoded<EgressGatewayPolicy>>,
    namespaces: Store<Decoded<Namespace>>,
    /// None only before the agent's first view decided which pods to watch.
    pods: Option<pods::Pods>,
    nodes: Store<Decoded<Node>>,
    egress_nodes: Store<Decoded<EgressNode>>,
    network_policies: Store<Decoded<NetworkPolicy>>,
    /// OVN-Kubernetes `EgressIP`s, when the cluster has that CRD.
    ovn_egress_ips: Option<Store<Decoded<ovn::EgressIP>>>,
    /// The policy kinds not applied to redirected traffic, when the cluster has them.
    anps: Option<Store<Decoded<admin::AdminNetworkPolicy>>>,
    banps: Option<Store<Decoded<admin::BaselineAdminNetworkPolicy>>>,
    egress_firewalls: Option<Store<Decoded<admin::EgressFirewall>>>,
    /// OpenShift's cluster network configuration, when the cluster has that kind.
    openshift_networks: Option<Store<Decoded<openshift::Network>>>,
    /// Set on every view (from the agent's flags), with OpenShift's networks added.
    cluster_cidrs: Vec<ipnet::IpNet>,
}

impl Stores {
    async fn wait_until_ready(&self) -> Result<()> {
        async fn ready<K>(store: &Store<Decoded<K>>) -> Result<()>
        where
            K: Resource<DynamicType = ()> + Clone + 'static,
        {
            store
                .wait_until_ready()
                .await
                .map_err(|_| Error::WatcherStopped {
                    kind: static_kind(&K::kind(&())),
                })
        }
        if let Some(pods) = &self.pods {
            ready(&pods.serving.store).await?;
        }
        tokio::try_join!(
            ready(&self.policies),
            ready(&self.namespaces),
            ready(&self.nodes),
            ready(&self.egress_nodes),
            ready(&self.network_policies),
        )?;
        if let Some(store) = &self.ovn_egress_ips {
            ready(store).await?;
        }
        if let Some(store) = &self.anps {
            ready(store).await?;
        }
        if let Some(store) = &self.banps {
            ready(store).await?;
        }
        if let Some(store) = &self.egress_firewalls {
            ready(store).await?;
        }
        if let Some(store) = &self.openshift_networks {
            ready(store).await?;
        }
        Ok(())
    }

    fn snapshot(&self) -> Snapshot {
        let mut errors = Vec::new();
        let view = ClusterView {
            policies: collect(&self.policies, &mut errors, Clone::clone),
            namespaces: collect(&self.namespaces, &mut errors, Clone::clone),
            pods: self
                .pods
                .as_ref()
                .map(|pods| {
                    collect_checked(
                        &pods.serving.store,
                        &mut errors,
                        objects::check_pod,
                        |p: &Pod| PodSummary::from(p),
                    )
                })
                .unwrap_or_default(),
            pod_scope: self
                .pods
                .as_ref()
                .map_or(PodScope::Cluster, |pods| pods.serving.scope),
            nodes: collect_checked(&self.nodes, &mut errors, objects::check_node, Clone::clone),
            egress_nodes: collect_checked(
                &self.egress_nodes,
                &mut errors,
                objects::check_egress_node,
                super::view_egress_node,
            ),
            network_policies: collect(&self.network_policies, &mut errors, Clone::clone),
            cluster_cidrs: self.cluster_cidrs_with(&mut errors),
            ovn_egress_ips: self
                .ovn_egress_ips
                .as_ref()
                .map(|s| collect(s, &mut errors, Clone::clone))
                .unwrap_or_default(),
            unapplied: Vec::new(),
        };
        let mut view = view;
        let of = |kind: &'static str| move |m: &ObjectMeta| admin::Unapplied::of(kind, m);
        if let Some(s) = &self.anps {
            let meta = of("AdminNetworkPolicy");
            view.unapplied
                .extend(collect(s, &mut errors, |o| meta(&o.metadata)));
        }
        if let Some(s) = &self.banps {
            let meta = of("BaselineAdminNetworkPolicy");
            view.unapplied
                .extend(collect(s, &mut errors, |o| meta(&o.metadata)));
        }
        if let Some(s) = &self.egress_firewalls {
            let meta = of("EgressFirewall");
            view.unapplied
                .extend(collect(s, &mut errors, |o| meta(&o.metadata)));
        }
        Snapshot { view, errors }
    }

    /// The flags' cluster CIDRs and OpenShift's cluster and service networks, once each.
    fn cluster_cidrs_with(&self, errors: &mut Vec<LoadError>) -> Vec<ipnet::IpNet> {
        let mut cidrs = self.cluster_cidrs.clone();
        if let Some(s) = &self.openshift_networks {
            for c in openshift::cluster_cidrs(&collect(s, errors, Clone::clone)) {
                if !cidrs.contains(&c) {
                    cidrs.push(c);
                }
            }
        }
        cidrs
    }
}

/// The watched kinds, as `'static` names for errors.
fn static_kind(kind: &str) -> &'static str {
    match kind {
        "Pod" => "Pod",
        "Namespace" => "Namespace",
        "Node" => "Node",
        "EgressGatewayPolicy" => "EgressGatewayPolicy",
        "EgressNode" => "EgressNode",
        "EgressIP" => "EgressIP",
        "NetworkPolicy" => "NetworkPolicy",
        "AdminNetworkPolicy" => "AdminNetworkPolicy",
        "BaselineAdminNetworkPolicy" => "BaselineAdminNetworkPolicy",
        "EgressFirewall" => "EgressFirewall",
        "Network" => "Network",
        _ => "object",
    }
}

/// The decoded objects of `store` as `convert` makes them, sorted by namespace and name (so
/// that equal stores give equal views), and an error for each object that did not decode.
fn collect<K, T>(
    store: &Store<Decoded<K>>,
    errors: &mut Vec<LoadError>,
    convert: impl Fn(&K) -> T,
) -> Vec<T>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    collect_checked(store, errors, |_| Vec::new(), convert)
}

/// [`collect`], leaving out each object that fails `check` (one of [`objects`]'s), with an
/// error for each field to fix, as the YAML source reports it.
fn collect_checked<K, T>(
    store: &Store<Decoded<K>>,
    errors: &mut Vec<LoadError>,
    check: impl Fn(&K) -> Vec<FieldError>,
    convert: impl Fn(&K) -> T,
) -> Vec<T>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    let mut entries = store.state();
    entries.sort_by(|a, b| {
        (&a.metadata.namespace, &a.metadata.name).cmp(&(&b.metadata.namespace, &b.metadata.name))
    });
    served(entries.iter().map(|e| &**e), errors, check, convert)
}

/// The objects of `entries` that decoded and pass `check`, as `convert` makes them; an error
/// for each that did not decode and for each field that failed its check. One bad object
/// never hides the others.
fn served<'a, K, T>(
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
fn decode_error<K: Resource<DynamicType = ()>>(
    metadata: &ObjectMeta,
    failure: &DecodeFailure,
) -> LoadError {
    let kind = K::kind(&());
    let message = format!("failed to decode {kind}: {}", failure.message);
    object_error::<K>(metadata, failure.field.clone(), message)
}

/// A [`DocumentError`] about the object of `metadata`: `file` is its API path, `object` its
/// kind and name, `field` what to fix.
fn object_error<K: Resource<DynamicType = ()>>(
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

/// Whether the API server serves OVN-Kubernetes' `EgressIP` (`k8s.ovn.org/v1`): watched
/// only then (a watch of a missing kind would keep the first list from completing).
async fn serves_ovn_egress_ips(client: &Client) -> bool {
    serves(client, ovn::API_VERSION, ovn::KIND).await
}

/// Whether the API server serves `kind` of `api_version`.
async fn serves(client: &Client, api_version: &str, kind: &str) -> bool {
    match client.list_api_group_resources(api_version).await {
        Ok(list) => list.resources.iter().any(|r| r.kind == kind),
        Err(e) => {
            debug!("no {api_version} resources: {e}");
            false
        }
    }
}

/// Start the watcher of `K` (of `api_version`) if the API server serves it.
async fn start_if_served<K>(
    client: &Client,
    api_version: &str,
    changed: &Arc<Notify>,
    tasks: &mut Tasks,
) -> Option<Store<Decoded<K>>>
where
    K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Debug + Send + Sync + 'static,
{
    let kind = K::kind(&());
    if !serves(client, api_version, &kind).await {
        return None;
    }
    info!(
        "{kind}s found ({api_version}): they are not applied to redirected traffic, which \
           the policies that may redirect their pods say"
    );
    Some(start(client, changed, tasks))
}

/// Watch the cluster: returns once every kind has been listed, with a receiver that holds
/// the [`Snapshot`] of that list and then changes whenever a watched object changes
/// (batched over [`DEBOUNCE`]; an unchanged view is not sent again). Every pod of the
/// cluster is watched: [`watch_node`] watches those an agent's node needs.
///
/// Until the first lists complete this waits, retrying with backoff and logging why (an
/// unreachable API server, missing RBAC, CRDs not installed): publishing a partial view
/// would make the agent remove state it must keep. The watcher tasks stop when every
/// receiver is dropped. Must be called inside a Tokio runtime. Every view carries
/// `cluster_cidrs`.
pub async fn watch(
    client: Client,
    cluster_cidrs: Vec<ipnet::IpNet>,
) -> Result<tokio::sync::watch::Receiver<Arc<Snapshot>>> {
    watch_with(client, cluster_cidrs, None).await
}

/// The node an agent's source watches for, and the pods its compiles ask for.
pub struct NodePods {
    /// The node's name: [`PodScope::Node`] means its pods.
    pub name: String,
    /// The pods its last compile needs ([`crate::compiler::Compiled::pods_needed`]), as
    /// the agent tells its [`writer::Writer`].
    pub wanted: tokio::sync::watch::Receiver<PodScope>,
}

/// [`watch`] for the agent of node `node.name`: of the Pods, only those the node needs,
/// the larger of what the view says ([`crate::compiler::pods_needed`]: a gateway or the
/// status writer needs every pod, a worker its own, when the cluster's CIDRs are
/// declared) and what its last compile asked for (`node.wanted`). The other kinds are
/// listed first, to decide; when the need changes, the pods are listed again in the new
/// scope while the old watch serves, and the view changes over once that list is
/// complete ([`pods::Pods::steer`]). Each view says which pods it holds
/// ([`ClusterView::pod_scope`]).
pub async fn watch_node(
    client: Client,
    cluster_cidrs: Vec<ipnet::IpNet>,
    node: NodePods,
) -> Result<tokio::sync::watch::Receiver<Arc<Snapshot>>> {
    watch_with(client, cluster_cidrs, Some(node)).await
}

async fn watch_with(
    client: Client,
    cluster_cidrs: Vec<ipnet::IpNet>,
    mut node: Option<NodePods>,
) -> Result<tokio::sync::watch::Receiver<Arc<Snapshot>>> {
    let changed = Arc::new(Notify::new());
    let mut tasks = Tasks(Vec::new());
    let mut stores = Stores {
        policies: start(&client, &changed, &mut tasks),
        namespaces: start(&client, &changed, &mut tasks),
        pods: None,
        nodes: start(&client, &changed, &mut tasks),
        egress_nodes: start(&client, &changed, &mut tasks),
        network_policies: start(&client, &changed, &mut tasks),
        ovn_egress_ips: if serves_ovn_egress_ips(&client).await {
            info!("OVN-Kubernetes EgressIPs found (k8s.ovn.org/v1): their addresses are theirs");
            Some(start(&client, &changed, &mut tasks))
        } else {
            None
        },
        anps: start_if_served(&client, admin::ANP_API_VERSION, &changed, &mut tasks).await,
        banps: start_if_served(&client, admin::ANP_API_VERSION, &changed, &mut tasks).await,
        egress_firewalls: start_if_served(&client, admin::OVN_API_VERSION, &changed, &mut tasks)
            .await,
        openshift_networks: if serves(&client, openshift::API_VERSION, openshift::KIND).await {
            info!(
                "OpenShift's cluster Network found (config.openshift.io/v1): its cluster and \
                 service networks are the cluster's own prefixes"
            );
            Some(start(&client, &changed, &mut tasks))
        } else {
            None
        },
        cluster_cidrs,
    };
    let scope = match node.as_mut() {
        None => PodScope::Cluster,
        Some(n) => {
            // Every kind but Pods, to decide which pods.
            stores.wait_until_ready().await?;
            let wanted = *n.wanted.borrow_and_update();
            crate::compiler::pods_needed(&stores.snapshot().view, &n.name).max(wanted)
        }
    };
    let name = node.as_ref().map_or("", |n| n.name.as_str());
    stores.pods = Some(pods::Pods::start(client.clone(), name, scope, &changed));
    stores.wait_until_ready().await?;
    let first = stores.snapshot();
    info!(
        policies = first.view.policies.len(),
        namespaces = first.view.namespaces.len(),
        pods = first.view.pods.len(),
        pod_scope = ?first.view.pod_scope,
        nodes = first.view.nodes.len(),
        egress_nodes = first.view.egress_nodes.len(),
        network_policies = first.view.network_policies.len(),
        errors = first.errors.len(),
        "listed the cluster"
    );
    let (tx, rx) = tokio::sync::watch::channel(Arc::new(first));
    tokio::spawn(async move {
        let _tasks = tasks;
        // Until the agent's writer is gone.
        let mut asking = node.is_some();
        loop {
            let wanted = node.as_mut().filter(|_| asking).map(|n| &mut n.wanted);
            let asked = async move {
                match wanted {
                    Some(w) => w.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = tx.closed() => break,
                () = changed.notified() => {}
                open = asked => asking = open,
            }
            tokio::select! {
                () = tx.closed() => break,
                () = tokio::time::sleep(DEBOUNCE) => {}
            }
            let mut snapshot = stores.snapshot();
            if let (Some(n), Some(pods)) = (node.as_mut(), stores.pods.as_mut()) {
                let view_needs = crate::compiler::pods_needed(&snapshot.view, &n.name);
                let wanted = view_needs.max(*n.wanted.borrow_and_update());
                if pods.steer(wanted, &changed) {
                    snapshot = stores.snapshot();
                }
            }
            tx.send_if_modified(|current| {
                if **current == snapshot {
                    false
                } else {
                    *current = Arc::new(snapshot);
                    true
                }
            });
        }
    });
    Ok(rx)
}

/// List the cluster once: the first [`Snapshot`] [`watch`] publishes, for one-shot tools
/// (`egress-agent explain`). Waits, as `watch` does, until every kind has been listed: the
/// caller bounds it.
pub async fn list(client: Client, cluster_cidrs: Vec<ipnet::IpNet>) -> Result<Snapshot> {
    let rx = watch(client, cluster_cidrs).await?;
    let snapshot = (**rx.borrow()).clone();
    Ok(snapshot)
}

// ---------------------------------------------------------------------------------------
// Writing

/// `write`, given up after [`WRITE_TIMEOUT`].
async fn bounded<T>(what: String, write: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(WRITE_TIMEOUT, write)
        .await
        .map_err(|_| Error::Timeout { what })?
}

fn dynamic_api<K: Resource<DynamicType = ()>>(client: &Client) -> Api<DynamicObject> {
    Api::all_with(client.clone(), &ApiResource::erase::<K>(&()))
}

fn to_json<T: serde::Serialize>(what: &str, value: &T) -> Result<serde_json::Value> {
    serde_json::to_value(value).map_err(|source| Error::Serialize {
        what: what.to_owned(),
        source,
    })
}

/// Publish this node's EgressNode: server-side apply (field manager [`FIELD_MANAGER`],
/// forced: the object is this agent's alone) of its labels and spec, then of its status
/// (a subresource). Fields the agent applied before and no longer sets are removed.
pub async fn publish_egress_node(client: &Client, node: &EgressNode) -> Result<()> {
    let what = format!(
        "publish EgressNode {}",
        node.metadata.name.as_deref().unwrap_or_default()
    );
    bounded(what, apply_egress_node(client, node)).await
}

async fn apply_egress_node(client: &Client, node: &EgressNode) -> Result<()> {
    let name = node
        .metadata
        .name
        .clone()
        .filter(|n| !n.is_empty())
        .ok_or(Error::EgressNodeName)?;
    let api = dynamic_api::<EgressNode>(client);
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let mut metadata = serde_json::json!({ "name": name });
    if let Some(labels) = node.metadata.labels.as_ref().filter(|l| !l.is_empty()) {
        metadata["labels"] = to_json(&format!("EgressNode {name} labels"), labels)?;
    }
    let spec = to_json(&format!("EgressNode {name} spec"), &node.spec)?;
    let status = to_json(
        &format!("EgressNode {name} status"),
        &node.status.clone().unwrap_or_default(),
    )?;
    for (part, metadata, body) in [
        ("spec", metadata, spec),
        ("status", serde_json::json!({ "name": name }), status),
    ] {
        let object = serde_json::json!({
            "apiVersion": API_VERSION,
            "kind": "EgressNode",
            "metadata": metadata,
            part: body,
        });
        let patch = Patch::Apply(&object);
        let applied = if part == "spec" {
            api.patch(&name, &params, &patch).await
        } else {
            api.patch_status(&name, &params, &patch).await
        };
        applied.map_err(|source| Error::ApplyEgressNode {
            name: name.clone(),
            part,
            source,
        })?;
    }
    Ok(())
}

/// `status` with every condition's `lastTransitionTime` filled in: kept from the
/// condition of the same type in `current` when its status is unchanged, else `now`.
fn with_transition_times(
    status: &PolicyStatus,
    current: Option<&PolicyStatus>,
    now: &str,
) -> PolicyStatus {
    let mut out = status.clone();
    for condition in &mut out.conditions {
        if condition.last_transition_time.is_some() {
            continue;
        }
        let before = current
            .into_iter()
            .flat_map(|c| &c.conditions)
            .find(|c| c.type_ == condition.type_ && c.status == condition.status)
            .and_then(|c| c.last_transition_time.clone());
        condition.last_transition_time = Some(before.unwrap_or_else(|| now.to_owned()));
    }
    out
}

/// RFC 3339 UTC, to the second, as Kubernetes writes times.
pub fn now_rfc3339() -> String {
    Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Set the status of policy `name` (a merge patch of its status subresource) unless it
/// already says the same. Conditions without a `lastTransitionTime` get one: the current
/// one when the condition's status did not change, else now. Returns whether a patch was
/// sent; a policy that no longer exists is not an error (`Ok(false)`).
pub async fn publish_policy_status(
    client: &Client,
    name: &str,
    status: &PolicyStatus,
) -> Result<bool> {
    let what = format!("publish EgressGatewayPolicy {name} status");
    bounded(what, patch_policy_status(client, name, status)).await
}

async fn patch_policy_status(client: &Client, name: &str, status: &PolicyStatus) -> Result<bool> {
    let api = dynamic_api::<EgressGatewayPolicy>(client);
    let current = match api.get_status(name).await {
        Ok(object) => object,
        Err(kube::Error::Api(s)) if s.code == 404 => {
            debug!(policy = name, "policy gone, status not published");
            return Ok(false);
        }
        Err(source) => {
            return Err(Error::GetPolicy {
                name: name.to_owned(),
                source,
            });
        }
    };
    // A status this agent cannot read is replaced.
    let current: Option<PolicyStatus> = current
        .data
        .get("status")
        .and_then(|s| PolicyStatus::deserialize(s).ok());
    let desired = with_transition_times(status, current.as_ref(), &now_rfc3339());
    if current.as_ref() == Some(&desired) {
        return Ok(false);
    }
    let mut body = to_json(&format!("EgressGatewayPolicy {name} status"), &desired)?;
    if desired.observed_generation.is_none()
        && let Some(map) = body.as_object_mut()
    {
        // Merge patch: null removes a value an earlier status had.
        map.insert("observedGeneration".to_owned(), serde_json::Value::Null);
    }
    let patch = serde_json::json!({ "status": body });
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    api.patch_status(name, &params, &Patch::Merge(&patch))
        .await
        .map_err(|source| Error::PatchPolicyStatus {
            name: name.to_owned(),
            source,
        })?;
    Ok(true)
}

/// The type of an Event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "Normal",
            Self::Warning => "Warning",
        }
    }
}

/// Record a core/v1 Event about policy `policy_name` (in namespace [`EVENT_NAMESPACE`],
/// reported by [`FIELD_MANAGER`] on `node`), such as `EgressIPMoved` when an egress IP
/// changes holder. `reason` is a CamelCase word, `message` a sentence for humans.
pub async fn record_event(
    client: &Client,
    policy_name: &str,
    node: &str,
    type_: EventType,
    reason: &str,
    message: &str,
) -> Result<()> {
    let what = format!("record Event {reason} on EgressGatewayPolicy {policy_name}");
    bounded(what, async {
        let event_error = |source| Error::RecordEvent {
            name: policy_name.to_owned(),
            reason: reason.to_owned(),
            source,
        };
        // `kubectl describe` finds events by the object's uid.
        let policy = dynamic_api::<EgressGatewayPolicy>(client)
            .get(policy_name)
            .await
            .map_err(|source| Error::GetPolicy {
                name: policy_name.to_owned(),
                source,
            })?;
        let now = Time(Timestamp::now());
        let unique = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let event = CoreEvent {
            metadata: ObjectMeta {
                name: Some(format!("{policy_name}.{unique:x}")),
                namespace: Some(EVENT_NAMESPACE.to_owned()),
                ..ObjectMeta::default()
            },
            involved_object: ObjectReference {
                api_version: Some(API_VERSION.to_owned()),
                kind: Some("EgressGatewayPolicy".to_owned()),
                name: Some(policy_name.to_owned()),
                uid: policy.metadata.uid.clone(),
                resource_version: policy.metadata.resource_version.clone(),
                ..ObjectReference::default()
            },
            type_: Some(type_.as_str().to_owned()),
            reason: Some(reason.to_owned()),
            message: Some(message.to_owned()),
            count: Some(1),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            source: Some(EventSource {
                component: Some(FIELD_MANAGER.to_owned()),
                host: Some(node.to_owned()),
            }),
            reporting_component: Some(FIELD_MANAGER.to_owned()),
            reporting_instance: Some(node.to_owned()),
            ..CoreEvent::default()
        };
        let api: Api<CoreEvent> = Api::namespaced(client.clone(), EVENT_NAMESPACE);
        api.create(&PostParams::default(), &event)
            .await
            .map_err(event_error)?;
        Ok(())
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::PolicyCondition;

    fn condition(type_: &str, status: &str, time: Option<&str>) -> PolicyCondition {
        PolicyCondition {
            type_: type_.to_owned(),
            status: (status == "True").into(),
            observed_generation: Some(1),
            last_transition_time: time.map(str::to_owned),
            reason: "R".to_owned(),
            message: "m".to_owned(),
        }
    }

    #[test]
    fn transition_times_kept_while_status_unchanged() {
        let current = PolicyStatus {
            conditions: vec![
                condition("Accepted", "True", Some("2020-01-01T00:00:00Z")),
                condition("Ready", "False", Some("2020-01-01T00:00:00Z")),
            ],
            ..PolicyStatus::default()
        };
        let desired = PolicyStatus {
            conditions: vec![
                condition("Accepted", "True", None),
                condition("Ready", "True", None),
                condition("Conflict", "True", None),
            ],
            ..PolicyStatus::default()
        };
        let out = with_transition_times(&desired, Some(&current), "2030-01-01T00:00:00Z");
        let times: Vec<_> = out
            .conditions
            .iter()
            .map(|c| c.last_transition_time.as_deref())
            .collect();
        assert_eq!(
            times,
            [
                Some("2020-01-01T00:00:00Z"),
                Some("2030-01-01T00:00:00Z"),
                Some("2030-01-01T00:00:00Z")
            ]
        );
    }

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
