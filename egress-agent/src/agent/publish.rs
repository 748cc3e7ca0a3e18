//! What the agent tells the cluster: its EgressNode (inventory, held IPs, peers), and,
//! in Kubernetes mode, policy statuses and Events. Writes to the API never block the
//! reconcile loop (failover must not wait for an API server that may be the thing that
//! is down): a background writer takes the latest EgressNode and statuses, and a bounded
//! queue of Events.

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf, time::Duration};

use tokio::sync::{mpsc, watch};
use tracing::warn;

use super::holding::Holding;
use crate::{
    api::{
        EgressNode, EgressNodeSpec, EgressNodeStatus, HeldEgressIp, NodeInterface, PeerLiveness,
        PolicyStatus,
    },
    iface,
    liveness::PeerStatus,
    source::{kube as kube_source, yaml},
};

/// Where this node's EgressNode, policy statuses and events go.
pub enum Sink {
    Yaml(PathBuf),
    Kube(KubeWriter),
}

/// An Event to record on a policy.
pub struct Event {
    pub policy: String,
    pub reason: &'static str,
    pub message: String,
}

/// The background writer's inputs.
pub struct KubeWriter {
    node: watch::Sender<Option<EgressNode>>,
    statuses: watch::Sender<BTreeMap<String, PolicyStatus>>,
    events: mpsc::Sender<Event>,
}

/// Events waiting for the API beyond this are dropped (and logged).
const EVENT_QUEUE: usize = 256;
/// Between two attempts at a write that failed.
const RETRY: Duration = Duration::from_secs(1);

impl KubeWriter {
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
                while let Err(e) = kube_source::publish_egress_node(&c, &doc).await {
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
                    if let Err(e) = kube_source::publish_policy_status(&c, name, status).await {
                        warn!("{e}");
                    }
                }
            }
        });
        let node_name = node_name.to_owned();
        tokio::spawn(async move {
            while let Some(ev) = event_rx.recv().await {
                if let Err(e) = kube_source::record_event(
                    &client,
                    &ev.policy,
                    &node_name,
                    kube_source::EventType::Normal,
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
        }
    }

    pub fn statuses(&self, statuses: &BTreeMap<String, PolicyStatus>) {
        self.statuses.send_if_modified(|s| {
            if s == statuses {
                false
            } else {
                s.clone_from(statuses);
                true
            }
        });
    }

    pub fn event(&self, ev: Event) {
        if let Err(e) = self.events.try_send(ev) {
            warn!("failed to queue an Event (the API is slow or down): {e}");
        }
    }
}

impl Sink {
    /// Publish this node's EgressNode.
    pub fn egress_node(&self, doc: &EgressNode) -> anyhow::Result<()> {
        match self {
            Sink::Yaml(dir) => yaml::write_egress_node(dir, doc).map(drop).map_err(|e| {
                anyhow::anyhow!(
                    "failed to publish EgressNode {}: {e}",
                    doc.metadata.name.as_deref().unwrap_or_default()
                )
            }),
            Sink::Kube(w) => {
                w.node.send_replace(Some(doc.clone()));
                Ok(())
            }
        }
    }
}

/// This node's EgressNode: its interfaces (without the egress IPs it holds), what it
/// holds, and the peers it probes.
pub fn egress_node_doc(
    name: &str,
    underlay: Option<IpAddr>,
    ifaces: &[iface::Interface],
    tunnel: &str,
    holdings: &BTreeMap<IpAddr, Holding>,
    peers: &[PeerStatus],
    cut_off: bool,
) -> EgressNode {
    let interfaces = ifaces
        .iter()
        .filter(|i| i.name != "lo" && i.name != tunnel && !i.addresses.is_empty())
        .map(|i| NodeInterface {
            name: i.name.clone(),
            up: i.up,
            addresses: i
                .addresses
                .iter()
                // Our own egress IPs are not part of the inventory.
                .filter(|(a, _)| !holdings.contains_key(a))
                .map(|(a, l)| format!("{a}/{l}"))
                .collect(),
            routes: Vec::new(),
            routes_omitted: 0,
        })
        .collect();
    let mut doc = EgressNode::new(
        name,
        EgressNodeSpec {
            underlay_ip: underlay.map(|u| u.to_string()),
        },
    );
    doc.status = Some(EgressNodeStatus {
        interfaces,
        egress_ips: holdings
            .iter()
            .map(|(ip, h)| HeldEgressIp {
                ip: ip.to_string(),
                interface: h.interface.clone(),
                epoch: h.epoch,
                since: Some(h.since.clone()),
                reason: Some(h.reason.clone()),
            })
            .collect(),
        peers: peers
            .iter()
            .map(|p| PeerLiveness {
                name: p.name.clone(),
                alive: p.alive,
            })
            .collect(),
        cut_off,
    });
    doc
}
