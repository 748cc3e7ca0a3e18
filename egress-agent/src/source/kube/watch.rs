//! Watching the cluster: one kube-rs [`watcher`] and reflector store per kind, and a
//! [`Snapshot`] of the stores published whenever one of them changes.

use std::{fmt::Debug, pin::pin, sync::Arc};

use futures::StreamExt as _;
use k8s_openapi::{
    api::{
        core::v1::{Namespace, Node},
        networking::v1::NetworkPolicy,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, Client, Resource,
    runtime::{
        WatchStreamExt as _,
        reflector::{self, Store},
        watcher,
    },
};
use serde::de::DeserializeOwned;
use tokio::{sync::Notify, task::AbortHandle};
use tracing::{debug, info, warn};

use super::{
    DEBOUNCE, Error, Result,
    decode::{Decoded, served},
    pods,
};
use crate::{
    api::{EgressGatewayPolicy, EgressNode},
    source::{
        ClusterView, LoadError, PodScope, Snapshot, Unapplied, admin,
        objects::{self, FieldError},
        openshift, ovn, view_egress_node,
    },
};

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
pub(super) fn start_with<K>(
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
    /// Start the watcher of every kind the API server serves, but Pods (the caller
    /// decides which pods).
    async fn start(
        client: &Client,
        cluster_cidrs: Vec<ipnet::IpNet>,
        changed: &Arc<Notify>,
        tasks: &mut Tasks,
    ) -> Self {
        Self {
            policies: start(client, changed, tasks),
            namespaces: start(client, changed, tasks),
            pods: None,
            nodes: start(client, changed, tasks),
            egress_nodes: start(client, changed, tasks),
            network_policies: start(client, changed, tasks),
            ovn_egress_ips: if serves_ovn_egress_ips(client).await {
                info!(
                    "OVN-Kubernetes EgressIPs found (k8s.ovn.org/v1): their addresses are theirs"
                );
                Some(start(client, changed, tasks))
            } else {
                None
            },
            anps: start_if_served(client, admin::ANP_API_VERSION, changed, tasks).await,
            banps: start_if_served(client, admin::ANP_API_VERSION, changed, tasks).await,
            egress_firewalls: start_if_served(client, admin::OVN_API_VERSION, changed, tasks).await,
            openshift_networks: if serves(client, openshift::API_VERSION, openshift::KIND).await {
                info!(
                    "OpenShift's cluster Network found (config.openshift.io/v1): its cluster \
                     and service networks are the cluster's own prefixes"
                );
                Some(start(client, changed, tasks))
            } else {
                None
            },
            cluster_cidrs,
        }
    }

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
            pods.serving.index.wait_until_listed().await;
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
                .map(|pods| pods.serving.index.view(&mut errors))
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
                view_egress_node,
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
        let of = |kind: &'static str| move |m: &ObjectMeta| Unapplied::of(kind, m);
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

/// The pods a node needs as a view says (the compiler's
/// [`pods_needed`](crate::compiler::pods_needed), which the agent passes in: a source
/// does not call the compiler).
pub type PodsNeeded = fn(&ClusterView, &str) -> PodScope;

/// The node an agent's source watches for, and the pods its compiles ask for.
pub struct NodePods {
    /// The node's name: [`PodScope::Node`] means its pods.
    pub name: String,
    /// The pods its last compile needs ([`crate::compiler::Compiled::pods_needed`]), as
    /// the agent tells its [`writer::Writer`](super::writer::Writer).
    pub wanted: tokio::sync::watch::Receiver<PodScope>,
    /// The pods the node needs as a view says.
    pub needs: PodsNeeded,
}

impl NodePods {
    /// The larger of what `view` says the node needs and what its last compile asked for.
    fn scope(&mut self, view: &ClusterView) -> PodScope {
        (self.needs)(view, &self.name).max(*self.wanted.borrow_and_update())
    }
}

/// [`watch`] for the agent of node `node.name`: of the Pods, only those the node needs,
/// the larger of what the view says (`node.needs`: a gateway or the status writer needs
/// every pod, a worker its own, when the cluster's CIDRs are declared) and what its last
/// compile asked for (`node.wanted`). The other kinds are listed first, to decide; when
/// the need changes, the pods are listed again in the new scope while the old watch
/// serves, and the view changes over once that list is complete
/// ([`pods::Pods::steer`]). Each view says which pods it holds
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
    let mut stores = Stores::start(&client, cluster_cidrs, &changed, &mut tasks).await;
    let scope = match node.as_mut() {
        None => PodScope::Cluster,
        Some(n) => {
            // Every kind but Pods, to decide which pods.
            stores.wait_until_ready().await?;
            n.scope(&stores.snapshot().view)
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
    let publisher = Publisher {
        stores,
        _tasks: tasks,
        node,
        changed,
    };
    tokio::spawn(publisher.run(tx));
    Ok(rx)
}

/// What publishes the snapshots once the first is out: the stores, the tasks that fill
/// them (stopped when this is dropped), the agent's node, if any, and the store changes.
struct Publisher {
    stores: Stores,
    _tasks: Tasks,
    node: Option<NodePods>,
    changed: Arc<Notify>,
}

impl Publisher {
    /// Publish a snapshot after each change (batched over [`DEBOUNCE`]; an unchanged view
    /// is not sent again), steering the pods watch to what the node needs, until every
    /// receiver of `tx` is gone.
    async fn run(mut self, tx: tokio::sync::watch::Sender<Arc<Snapshot>>) {
        // Until the agent's writer is gone.
        let mut asking = self.node.is_some();
        loop {
            let wanted = self.node.as_mut().filter(|_| asking).map(|n| &mut n.wanted);
            let asked = async move {
                match wanted {
                    Some(w) => w.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = tx.closed() => break,
                () = self.changed.notified() => {}
                open = asked => asking = open,
            }
            tokio::select! {
                () = tx.closed() => break,
                () = tokio::time::sleep(DEBOUNCE) => {}
            }
            let snapshot = self.snapshot();
            tx.send_if_modified(|current| {
                if **current == snapshot {
                    false
                } else {
                    *current = Arc::new(snapshot);
                    true
                }
            });
        }
    }

    /// The stores' snapshot, once the pods watch is steered to what it says the node
    /// needs (and again if that changed the pods served).
    fn snapshot(&mut self) -> Snapshot {
        let snapshot = self.stores.snapshot();
        let (Some(node), Some(pods)) = (self.node.as_mut(), self.stores.pods.as_mut()) else {
            return snapshot;
        };
        if pods.steer(node.scope(&snapshot.view), &self.changed) {
            self.stores.snapshot()
        } else {
            snapshot
        }
    }
}

/// List the cluster once: the first [`Snapshot`] [`watch`] publishes, for one-shot tools
/// (`egress-agent explain`). Waits, as `watch` does, until every kind has been listed: the
/// caller bounds it.
pub async fn list(client: Client, cluster_cidrs: Vec<ipnet::IpNet>) -> Result<Snapshot> {
    let rx = watch(client, cluster_cidrs).await?;
    let snapshot = (**rx.borrow()).clone();
    Ok(snapshot)
}
