//! Kubernetes as the source of cluster state, and the place the agent writes back to.
//!
//! [`watch`] runs one kube-rs [`watcher`](kube::runtime::watcher) and reflector store per kind (Pods, Namespaces,
//! Nodes, EgressGatewayPolicies, EgressNodes, NetworkPolicies, and the optional kinds the
//! API server serves) and publishes a [`Snapshot`](super::Snapshot) of the stores, the same type the YAML
//! directory source produces, whenever one of them changes. [`watch_node`], the agent's,
//! watches only the Pods its node needs ([`pods`]).
//! Watch trouble (a watch that ends, `410 Gone`, a dropped connection, an API server that is
//! away) is the watcher's to recover from: it resumes or re-lists with backoff
//! ([`WatchStreamExt::default_backoff`](kube::runtime::WatchStreamExt::default_backoff)), and the stores, hence the published view, keep the
//! last good state meanwhile (a re-list replaces a store only once it is complete).
//!
//! An object that does not decode, or fails the checks the YAML source runs on it too
//! ([`objects`](super::objects): a Pod's addresses, a Node's, an EgressNode's), never
//! stops its kind: it is left out of the view and reported in
//! [`Snapshot::errors`](super::Snapshot::errors), naming kind, name and field.
//!
//! The writers: [`publish_egress_node`] (server-side apply of this node's EgressNode),
//! [`publish_policy_status`] (merge patch of a policy's status subresource, only when it
//! changed) and [`record_event`] (an events.k8s.io/v1 Event on a policy, for holder
//! changes).
//!
//! One module per job: [`decode`] (an object as the API server sent it, checked, or the
//! error naming it), [`watch`] (the watchers, their stores, the published snapshots;
//! [`pods`] the Pods an agent watches) and [`writer`] (the writes, and the
//! [`StatusWriter`](super::StatusWriter) that makes them in the background).
//!
//! RBAC the agent needs: list and watch on pods, namespaces, nodes, egressgatewaypolicies
//! and egressnodes; get and patch on egressgatewaypolicies/status; patch on egressnodes and
//! egressnodes/status; get on egressgatewaypolicies and create on events.k8s.io events
//! (namespace [`EVENT_NAMESPACE`]) for [`record_event`].

use std::{path::PathBuf, time::Duration};

use kube::{
    Client,
    config::{KubeConfigOptions, Kubeconfig},
};

/// Field manager of everything the agent writes.
pub const FIELD_MANAGER: &str = "egress-agent";
/// Namespace of the Events [`record_event`] creates (the policies are cluster-scoped; this
/// is where Kubernetes itself, and kube-runtime's `Recorder`, put events about
/// cluster-scoped objects).
pub const EVENT_NAMESPACE: &str = "default";
/// How long a change waits for the changes that follow it before a snapshot is published:
/// a burst (a re-list, a rollout) becomes one snapshot, and a lone change is seen within
/// this delay plus the time to build the snapshot.
pub const DEBOUNCE: Duration = Duration::from_millis(50);
/// How long one writer call may take: the agent's loop must not stall on an API server
/// that does not answer.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

mod decode;
mod pods;
pub use pods::PodIndex;
mod watch;
pub mod writer;

pub use watch::{NodePods, list, watch, watch_node};
pub use writer::{
    EventType, now_rfc3339, publish_egress_node, publish_policy_status, record_event,
};

/// Errors of the Kubernetes source and writers.
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
