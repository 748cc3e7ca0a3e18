//! OVN-Kubernetes' own `EgressIP` objects (`k8s.ovn.org/v1`), read only: on a cluster whose
//! primary network's egress IPs OVN-Kubernetes assigns, an address that both an OVN
//! `EgressIP` and one of our policies claim is reported as a conflict and left to OVN,
//! instead of two implementations answering for it (the compiler's
//! `nodes::claimed_elsewhere` reads them from the view).

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const GROUP: &str = "k8s.ovn.org";
pub const VERSION: &str = "v1";
pub const API_VERSION: &str = "k8s.ovn.org/v1";
pub const KIND: &str = "EgressIP";

/// The part of OVN-Kubernetes' `EgressIP` spec we read (the rest is ignored).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "k8s.ovn.org",
    version = "v1",
    kind = "EgressIP",
    plural = "egressips",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct EgressIPSpec {
    /// The addresses OVN-Kubernetes assigns to nodes for this object.
    #[serde(default, rename = "egressIPs")]
    pub egress_ips: Vec<String>,
}
