//! The Pods an agent's Kubernetes source watches: every pod of the cluster, or only its
//! node's (`fieldSelector=spec.nodeName=<node>`), as the node's roles need
//! ([`NodePods::needs`](super::NodePods::needs) and what its compiles ask for), and the switch between the two when they change.
//!
//! A switch never serves a partial view: the new watch lists while the old one keeps
//! serving, and the stores change over only once that list is complete (a gateway label
//! added starts the full list at once; the view it replaces was right for a worker).
//!
//! A watch keeps no Pod: each event is checked and summarized as it arrives, into a table
//! sorted by namespace and name ([`PodIndex`]), so that a snapshot costs a copy of
//! pointers, not a sort and a conversion of every pod (at 100,000 pods those took about
//! 200 ms of CPU per event; a gateway watches every pod of the cluster).

use std::{
    collections::BTreeMap,
    pin::pin,
    sync::{Arc, Mutex, MutexGuard},
};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api, Client,
    runtime::{WatchStreamExt as _, watcher},
};
use tokio::{sync::Notify, task::AbortHandle};
use tracing::{debug, info, warn};

use super::decode::{Decoded, served};
use crate::source::{LoadError, PodScope, PodSummary, objects};

/// One watch of Pods: its scope, its pods, and the task that fills them (stopped when
/// this is dropped).
pub(super) struct PodWatch {
    pub(super) scope: PodScope,
    pub(super) index: Arc<PodIndex>,
    task: AbortHandle,
}

impl Drop for PodWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PodWatch {
    /// Watch the pods of `scope` (those of node `node` for [`PodScope::Node`]); `changed`
    /// is notified whenever the store changes, its first list included.
    pub(super) fn start(
        client: &Client,
        scope: PodScope,
        node: &str,
        changed: &Arc<Notify>,
    ) -> Self {
        // Any semantic: lists and re-lists are served from the API server's watch cache,
        // as client-go informers do (a field selector on spec.nodeName is served there
        // too, indexed: the kubelet watches its pods so).
        let config = watcher::Config::default().any_semantic();
        let config = match scope {
            PodScope::Cluster => config,
            PodScope::Node => config.fields(&format!("spec.nodeName={node}")),
        };
        let index = Arc::new(PodIndex::new());
        let task = tokio::spawn(fill(
            Api::all(client.clone()),
            config,
            Arc::clone(&index),
            Arc::clone(changed),
        ));
        Self {
            scope,
            index,
            task: task.abort_handle(),
        }
    }

    /// Whether its first list is complete (it serves a whole view).
    pub(super) fn listed(&self) -> bool {
        *self.index.listed.borrow()
    }
}

/// Keep `index` as the watch of `api` with `config` says, notifying `changed` whenever it
/// changes (its first list included).
async fn fill(
    api: Api<Decoded<Pod>>,
    config: watcher::Config,
    index: Arc<PodIndex>,
    changed: Arc<Notify>,
) {
    let mut stream = pin!(watcher(api, config).default_backoff());
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => {
                if index.apply_decoded(event) {
                    changed.notify_one();
                }
            }
            Err(watcher::Error::WatchError(status)) if status.code == 410 => {
                info!("watch expired (410 Gone), listing Pods again");
            }
            Err(e) => warn!("failed to watch Pods (retrying with backoff): {e}"),
        }
    }
}

/// The pods of a watch, each checked and summarized once, as it arrived, in namespace and
/// name order. Public for `egress-bench`, which measures it against the work it replaced.
pub struct PodIndex {
    state: Mutex<IndexState>,
    /// Whether a first list is complete (it serves a whole view).
    listed: tokio::sync::watch::Sender<bool>,
}

#[derive(Default)]
struct IndexState {
    /// What is served.
    served: PodTable,
    /// A list under way (from its `Init` to its `InitDone`, which makes it served).
    listing: Option<PodTable>,
    /// The served pods in order, kept until they change.
    pods: Option<Vec<Arc<PodSummary>>>,
}

/// Pods by namespace and name: those that pass their checks, summarized, and the errors of
/// those that do not (or did not decode).
#[derive(Default)]
struct PodTable {
    pods: BTreeMap<Key, Arc<PodSummary>>,
    errors: BTreeMap<Key, Vec<LoadError>>,
}

/// A pod's namespace and name, as its metadata has them.
type Key = (Option<String>, Option<String>);

fn key(pod: &Decoded<Pod>) -> Key {
    (pod.metadata.namespace.clone(), pod.metadata.name.clone())
}

impl PodTable {
    /// `pod` as it is now; whether what is served of it changed.
    fn apply(&mut self, pod: &Decoded<Pod>) -> bool {
        let key = key(pod);
        let mut errors = Vec::new();
        let summary = served(
            std::iter::once(pod),
            &mut errors,
            objects::check_pod,
            |p: &Pod| PodSummary::from(p),
        )
        .pop();
        let had_errors = if errors.is_empty() {
            self.errors.remove(&key).is_some()
        } else {
            self.errors.insert(key.clone(), errors);
            true
        };
        match summary {
            // The same summary (a field the agent does not read changed): kept as it was.
            Some(s) if self.pods.get(&key).is_some_and(|old| **old == s) => had_errors,
            Some(s) => {
                self.pods.insert(key, Arc::new(s));
                true
            }
            None => self.pods.remove(&key).is_some() || had_errors,
        }
    }

    /// `pod` is gone; whether it was served or reported.
    fn remove(&mut self, pod: &Decoded<Pod>) -> bool {
        let key = key(pod);
        let errors = self.errors.remove(&key).is_some();
        self.pods.remove(&key).is_some() || errors
    }
}

impl Default for PodIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl PodIndex {
    /// No pod, not listed yet.
    pub fn new() -> Self {
        Self {
            state: Mutex::default(),
            listed: tokio::sync::watch::Sender::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, IndexState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A watch's `event` of Pods that decoded, applied as [`PodIndex::apply_decoded`].
    pub fn apply(&self, event: watcher::Event<Pod>) -> bool {
        let decoded = |pod: Pod| Decoded {
            metadata: pod.metadata.clone(),
            object: Ok(pod),
        };
        self.apply_decoded(match event {
            watcher::Event::Apply(pod) => watcher::Event::Apply(decoded(pod)),
            watcher::Event::Delete(pod) => watcher::Event::Delete(decoded(pod)),
            watcher::Event::Init => watcher::Event::Init,
            watcher::Event::InitApply(pod) => watcher::Event::InitApply(decoded(pod)),
            watcher::Event::InitDone => watcher::Event::InitDone,
        })
    }

    /// The watch's `event` applied; whether what is served changed (or a list completed).
    fn apply_decoded(&self, event: watcher::Event<Decoded<Pod>>) -> bool {
        let mut s = self.lock();
        let changed = match event {
            watcher::Event::Apply(pod) => s.served.apply(&pod),
            watcher::Event::Delete(pod) => s.served.remove(&pod),
            watcher::Event::Init => {
                s.listing = Some(PodTable::default());
                false
            }
            watcher::Event::InitApply(pod) => {
                if let Some(listing) = &mut s.listing {
                    listing.apply(&pod);
                }
                false
            }
            watcher::Event::InitDone => {
                if let Some(listing) = s.listing.take() {
                    s.served = listing;
                }
                debug!(pods = s.served.pods.len(), "Pods: list complete");
                // Said once the list is served (a waiter reads it next).
                self.listed.send_replace(true);
                true
            }
        };
        if changed {
            s.pods = None;
        }
        changed
    }

    /// The served pods in namespace and name order, and their errors added to `errors`.
    pub fn view(&self, errors: &mut Vec<LoadError>) -> Vec<Arc<PodSummary>> {
        let mut s = self.lock();
        errors.extend(s.served.errors.values().flatten().cloned());
        let IndexState { served, pods, .. } = &mut *s;
        pods.get_or_insert_with(|| served.pods.values().cloned().collect())
            .clone()
    }

    /// How many pods are served.
    pub fn len(&self) -> usize {
        self.lock().served.pods.len()
    }

    /// Whether no pod is served.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Wait until a first list is complete.
    pub(super) async fn wait_until_listed(&self) {
        // The sender lives as long as `self`: waiting cannot fail.
        let _ = self.listed.subscribe().wait_for(|listed| *listed).await;
    }
}

/// The pods watch a source serves from, and the one it is switching to.
pub(super) struct Pods {
    client: Client,
    /// The node whose pods [`PodScope::Node`] means.
    node: String,
    pub(super) serving: PodWatch,
    next: Option<PodWatch>,
}

impl Pods {
    /// Serve the pods of `scope` (its first list is not waited for here).
    pub(super) fn start(
        client: Client,
        node: &str,
        scope: PodScope,
        changed: &Arc<Notify>,
    ) -> Self {
        Self {
            serving: PodWatch::start(&client, scope, node, changed),
            client,
            node: node.to_owned(),
            next: None,
        }
    }

    /// Move toward serving the pods of `wanted`: start a watch of them unless one is
    /// under way, and serve it once its first list is complete (the watch it replaces
    /// stops). Returns whether the pods served changed.
    pub(super) fn steer(&mut self, wanted: PodScope, changed: &Arc<Notify>) -> bool {
        if wanted == self.serving.scope {
            if let Some(next) = self.next.take() {
                info!(
                    pods = ?self.serving.scope,
                    "the pods watch stays (the switch to {:?} is abandoned)",
                    next.scope
                );
            }
            return false;
        }
        if self.next.as_ref().is_none_or(|n| n.scope != wanted) {
            info!(
                from = ?self.serving.scope,
                to = ?wanted,
                "switching the pods watch: listing the new one while the old one serves"
            );
            self.next = Some(PodWatch::start(&self.client, wanted, &self.node, changed));
        }
        match self.next.take_if(|n| n.listed()) {
            Some(next) => {
                info!(
                    pods = ?next.scope,
                    listed = next.index.len(),
                    "switched the pods watch"
                );
                self.serving = next;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::{
        api::core::v1::{PodIP, PodSpec, PodStatus},
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;

    fn pod(ns: &str, name: &str, ip: &str) -> Decoded<Pod> {
        let metadata = ObjectMeta {
            namespace: Some(ns.to_owned()),
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([("app".to_owned(), "api".to_owned())])),
            ..Default::default()
        };
        let pod = Pod {
            metadata: metadata.clone(),
            spec: Some(PodSpec {
                node_name: Some("worker-1".to_owned()),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".to_owned()),
                pod_ips: Some(vec![PodIP { ip: ip.to_owned() }]),
                ..Default::default()
            }),
        };
        Decoded {
            metadata,
            object: Ok(pod),
        }
    }

    fn names(index: &PodIndex) -> Vec<String> {
        index
            .view(&mut Vec::new())
            .iter()
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect()
    }

    fn list(index: &PodIndex, pods: Vec<Decoded<Pod>>) {
        index.apply_decoded(watcher::Event::Init);
        for p in pods {
            assert!(
                !index.apply_decoded(watcher::Event::InitApply(p)),
                "not served yet"
            );
        }
        assert!(index.apply_decoded(watcher::Event::InitDone));
    }

    #[test]
    fn a_list_is_served_whole_in_namespace_and_name_order_once_complete() {
        let index = PodIndex::new();
        index.apply_decoded(watcher::Event::Init);
        index.apply_decoded(watcher::Event::InitApply(pod("shop", "b", "10.244.1.2")));
        index.apply_decoded(watcher::Event::InitApply(pod("other", "z", "10.244.1.3")));
        index.apply_decoded(watcher::Event::InitApply(pod("shop", "a", "10.244.1.1")));
        assert!(!*index.listed.borrow() && names(&index).is_empty());
        assert!(index.apply_decoded(watcher::Event::InitDone));
        assert!(*index.listed.borrow());
        assert_eq!(names(&index), ["other/z", "shop/a", "shop/b"]);
        // A list again (a watch expired): the old pods serve until it completes, and a
        // pod it does not have is gone then.
        index.apply_decoded(watcher::Event::Init);
        index.apply_decoded(watcher::Event::InitApply(pod("shop", "c", "10.244.1.4")));
        assert_eq!(names(&index), ["other/z", "shop/a", "shop/b"]);
        index.apply_decoded(watcher::Event::InitDone);
        assert_eq!(names(&index), ["shop/c"]);
    }

    #[test]
    fn each_event_changes_its_pod_only_and_an_unread_field_changes_nothing() {
        let index = PodIndex::new();
        list(
            &index,
            vec![
                pod("shop", "a", "10.244.1.1"),
                pod("shop", "b", "10.244.1.2"),
            ],
        );
        let before = index.view(&mut Vec::new());
        // An annotation (not read by the agent) changed: the same summary, not a change.
        let mut annotated = pod("shop", "a", "10.244.1.1");
        annotated.metadata.annotations = Some(BTreeMap::from([("x".into(), "y".into())]));
        assert!(!index.apply_decoded(watcher::Event::Apply(annotated)));
        let after = index.view(&mut Vec::new());
        assert!(Arc::ptr_eq(&before[0], &after[0]) && Arc::ptr_eq(&before[1], &after[1]));
        // Its address changed: that pod anew, the other as it was.
        assert!(index.apply_decoded(watcher::Event::Apply(pod("shop", "a", "10.244.1.9"))));
        let moved = index.view(&mut Vec::new());
        assert_eq!(
            moved[0].ips,
            ["10.244.1.9".parse::<std::net::IpAddr>().unwrap()]
        );
        assert!(Arc::ptr_eq(&before[1], &moved[1]));
        assert!(index.apply_decoded(watcher::Event::Apply(pod("shop", "0", "10.244.1.5"))));
        assert!(index.apply_decoded(watcher::Event::Delete(pod("shop", "b", "10.244.1.2"))));
        assert_eq!(names(&index), ["shop/0", "shop/a"]);
        assert!(!index.apply_decoded(watcher::Event::Delete(pod("shop", "b", "10.244.1.2"))));
    }

    #[test]
    fn a_pod_failing_its_checks_is_left_out_and_named_until_fixed() {
        let index = PodIndex::new();
        list(&index, vec![pod("shop", "a", "10.244.1.1")]);
        assert!(index.apply_decoded(watcher::Event::Apply(pod("shop", "bad", "10.244.1.300"))));
        let mut errors = Vec::new();
        assert_eq!(index.view(&mut errors).len(), 1);
        let said = errors.iter().map(ToString::to_string).collect::<Vec<_>>();
        assert!(
            said.len() == 1 && said[0].contains("bad") && said[0].contains("status.podIPs[0].ip"),
            "{said:?}"
        );
        assert!(index.apply_decoded(watcher::Event::Apply(pod("shop", "bad", "10.244.1.30"))));
        let mut errors = Vec::new();
        assert_eq!(index.view(&mut errors).len(), 2);
        assert!(errors.is_empty(), "{errors:?}");
        // Broken again, then deleted: its error goes with it.
        index.apply_decoded(watcher::Event::Apply(pod("shop", "bad", "x")));
        assert!(index.apply_decoded(watcher::Event::Delete(pod("shop", "bad", "x"))));
        let mut errors = Vec::new();
        assert_eq!(names(&index), ["shop/a"]);
        index.view(&mut errors);
        assert!(errors.is_empty(), "{errors:?}");
    }
}
