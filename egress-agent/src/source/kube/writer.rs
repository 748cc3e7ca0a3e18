//! The Kubernetes [`StatusWriter`]: writes to the API never block the reconcile loop
//! (failover must not wait for an API server that may be the thing that is down): a
//! background task takes the latest EgressNode, another the latest policy statuses, and
//! a third a bounded queue of Events.

use std::{collections::BTreeMap, time::Duration};

use tokio::sync::{mpsc, watch};
use tracing::warn;

use crate::{
    api::{EgressNode, PolicyStatus},
    source::{Event, PodScope, StatusWriter},
};

/// The background writer's inputs.
pub struct Writer {
    node: watch::Sender<Option<EgressNode>>,
    statuses: watch::Sender<BTreeMap<String, PolicyStatus>>,
    events: mpsc::Sender<Event>,
    /// The pods the agent's compiles need, to its source ([`super::watch_node`]).
    pods: Option<watch::Sender<PodScope>>,
}

/// Events waiting for the API beyond this are dropped (and logged).
const EVENT_QUEUE: usize = 256;
/// Between two attempts at a write that failed.
const RETRY: Duration = Duration::from_secs(1);

impl Writer {
    pub fn start(client: ::kube::Client, node_name: &str) -> Self {
        let (node, mut node_rx) = watch::channel::<Option<EgressNode>>(None);
        let (statuses, mut status_rx) =
            watch::channel::<BTreeMap<String, PolicyStatus>>(BTreeMap::new());
        let (events, mut event_rx) = mpsc::channel::<Event>(EVENT_QUEUE);
        let c = client.clone();
        tokio::spawn(async move {
            while node_rx.changed().await.is_ok() {
                let doc = node_rx.borrow_and_update().clone();
                let Some(doc) = doc else { continue };
                while let Err(e) = super::publish_egress_node(&c, &doc).await {
                    warn!("{e}");
                    tokio::time::sleep(RETRY).await;
                    if node_rx.has_changed().unwrap_or(true) {
                        break;
                    }
                }
            }
        });
        let c = client.clone();
        tokio::spawn(async move {
            while status_rx.changed().await.is_ok() {
                let all = status_rx.borrow_and_update().clone();
                for (name, status) in &all {
                    if let Err(e) = super::publish_policy_status(&c, name, status).await {
                        warn!("{e}");
                    }
                }
            }
        });
        let node_name = node_name.to_owned();
        tokio::spawn(async move {
            while let Some(ev) = event_rx.recv().await {
                if let Err(e) = super::record_event(
                    &client,
                    &ev.policy,
                    &node_name,
                    super::EventType::Normal,
                    ev.reason,
                    &ev.message,
                )
                .await
                {
                    warn!("{e}");
                }
            }
        });
        Self {
            node,
            statuses,
            events,
            pods: None,
        }
    }

    /// Tell the source behind `pods` (the sender of [`super::NodePods::wanted`]) which
    /// pods the agent's compiles need.
    pub fn with_pods_needed(mut self, pods: watch::Sender<PodScope>) -> Self {
        self.pods = Some(pods);
        self
    }
}

impl StatusWriter for Writer {
    fn egress_node(&self, doc: &EgressNode) -> anyhow::Result<()> {
        self.node.send_replace(Some(doc.clone()));
        Ok(())
    }

    fn policy_statuses(&self, statuses: &BTreeMap<String, PolicyStatus>) {
        self.statuses.send_if_modified(|s| {
            if s == statuses {
                false
            } else {
                s.clone_from(statuses);
                true
            }
        });
    }

    fn event(&self, ev: Event) {
        if let Err(e) = self.events.try_send(ev) {
            warn!("failed to queue an Event (the API is slow or down): {e}");
        }
    }

    fn pods_needed(&self, scope: PodScope) {
        if let Some(pods) = &self.pods {
            pods.send_if_modified(|s| std::mem::replace(s, scope) != scope);
        }
    }
}
