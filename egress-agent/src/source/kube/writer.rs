//! Writing to the API: [`publish_egress_node`] (server-side apply of this node's
//! EgressNode), [`publish_policy_status`] (merge patch of a policy's status subresource,
//! only when it changed) and [`record_event`] (an events.k8s.io/v1 Event on a policy, for
//! holder changes, through kube-runtime's `Recorder`),
//! each bounded by [`WRITE_TIMEOUT`].
//!
//! And the Kubernetes [`StatusWriter`] that makes them: writes to the API never block the
//! reconcile loop (failover must not wait for an API server that may be the thing that is
//! down): a background task takes the latest EgressNode, another the latest policy
//! statuses, and a third a bounded queue of Events.

use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::{api::core::v1::ObjectReference, jiff::Timestamp};
pub use kube::runtime::events::EventType;
use kube::{
    Api, Client, Resource,
    api::{ApiResource, DynamicObject, Patch, PatchParams},
    runtime::events::{Event as RecorderEvent, Recorder, Reporter},
};
use serde::Deserialize;
use tokio::sync::{mpsc, watch};
use tracing::{debug, warn};

use super::{Error, FIELD_MANAGER, Result, WRITE_TIMEOUT};
use crate::{
    api::{API_VERSION, EgressGatewayPolicy, EgressNode, PolicyStatus},
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
    pub fn start(client: Client, node_name: &str) -> Self {
        let (node, mut node_rx) = watch::channel::<Option<EgressNode>>(None);
        let (statuses, mut status_rx) =
            watch::channel::<BTreeMap<String, PolicyStatus>>(BTreeMap::new());
        let (events, mut event_rx) = mpsc::channel::<Event>(EVENT_QUEUE);
        let c = client.clone();
        tokio::spawn(async move {
            while node_rx.changed().await.is_ok() {
                let doc = node_rx.borrow_and_update().clone();
                let Some(doc) = doc else { continue };
                while let Err(e) = publish_egress_node(&c, &doc).await {
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
                    if let Err(e) = publish_policy_status(&c, name, status).await {
                        warn!("{e}");
                    }
                }
            }
        });
        let node_name = node_name.to_owned();
        tokio::spawn(async move {
            while let Some(ev) = event_rx.recv().await {
                if let Err(e) = record_event(
                    &client,
                    &ev.policy,
                    &node_name,
                    EventType::Normal,
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

/// What the agent did when it records an Event (the `action` of an events.k8s.io/v1
/// Event; `kubectl describe` does not show it).
pub const EVENT_ACTION: &str = "Reconcile";

/// Record an Event about policy `policy_name` with kube-runtime's [`Recorder`]: an
/// events.k8s.io/v1 Event in namespace [`EVENT_NAMESPACE`](super::EVENT_NAMESPACE) (where Kubernetes puts the
/// Events of cluster-scoped objects), reported by [`FIELD_MANAGER`] on `node`, such as
/// `EgressIPMoved` when an egress IP changes holder. `reason` is a CamelCase word,
/// `message` a sentence for humans.
///
/// Each Event gets a fresh `Recorder`: a Recorder's own cache makes an Event whose type,
/// reason and action repeat within 6 minutes a series of the first (a patch of its count),
/// keeping the first one's note, so a second move of a policy's egress IP would be
/// recorded as the first move again.
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
        // `kubectl describe` finds events by the object's uid.
        let policy = dynamic_api::<EgressGatewayPolicy>(client)
            .get(policy_name)
            .await
            .map_err(|source| Error::GetPolicy {
                name: policy_name.to_owned(),
                source,
            })?;
        let regarding = ObjectReference {
            api_version: Some(API_VERSION.to_owned()),
            kind: Some("EgressGatewayPolicy".to_owned()),
            name: Some(policy_name.to_owned()),
            uid: policy.metadata.uid.clone(),
            resource_version: policy.metadata.resource_version.clone(),
            ..ObjectReference::default()
        };
        let reporter = Reporter {
            controller: FIELD_MANAGER.to_owned(),
            instance: Some(node.to_owned()),
        };
        let event = RecorderEvent {
            type_,
            reason: reason.to_owned(),
            note: Some(message.to_owned()),
            action: EVENT_ACTION.to_owned(),
            secondary: None,
        };
        Recorder::new(client.clone(), reporter)
            .publish(&event, &regarding)
            .await
            .map_err(|source| Error::RecordEvent {
                name: policy_name.to_owned(),
                reason: reason.to_owned(),
                source,
            })
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
}
