//! The Pods an agent's Kubernetes source watches: every pod of the cluster, or only its
//! node's (`fieldSelector=spec.nodeName=<node>`), as the node's roles need
//! ([`NodePods::needs`](super::NodePods::needs) and what its compiles ask for), and the switch between the two when they change.
//!
//! A switch never serves a partial view: the new watch lists while the old one keeps
//! serving, and the stores change over only once that list is complete (a gateway label
//! added starts the full list at once; the view it replaces was right for a worker).

use std::sync::Arc;

use futures::FutureExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Client,
    runtime::{reflector::Store, watcher},
};
use tokio::{sync::Notify, task::AbortHandle};
use tracing::info;

use super::decode::Decoded;
use crate::source::PodScope;

/// One watch of Pods: its scope, its store, and the task that fills it (stopped when
/// this is dropped).
pub(super) struct PodWatch {
    pub(super) scope: PodScope,
    pub(super) store: Store<Decoded<Pod>>,
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
        let (store, task) = super::watch::start_with::<Pod>(client, config, changed);
        Self { scope, store, task }
    }

    /// Whether its first list is complete (the store serves a whole view).
    pub(super) fn listed(&self) -> bool {
        matches!(self.store.wait_until_ready().now_or_never(), Some(Ok(())))
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
                    listed = next.store.len(),
                    "switched the pods watch"
                );
                self.serving = next;
                true
            }
            None => false,
        }
    }
}
