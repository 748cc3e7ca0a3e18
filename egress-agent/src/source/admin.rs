//! Policy kinds that restrict pod egress but that the datapath does not apply to the
//! traffic it redirects: `AdminNetworkPolicy` and `BaselineAdminNetworkPolicy`
//! (`policy.networking.k8s.io/v1alpha1`, cluster-scoped) and OVN-Kubernetes'
//! `EgressFirewall` (`k8s.ovn.org/v1`, namespaced). Only their names are read (each as a
//! [`Unapplied`](super::Unapplied)): a policy
//! that redirects pods they may cover says, in a condition, that they do not hold there
//! (docs/networkpolicy.md).

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const ANP_API_VERSION: &str = "policy.networking.k8s.io/v1alpha1";
pub const OVN_API_VERSION: &str = "k8s.ovn.org/v1";

/// Nothing of the spec is read.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1alpha1",
    kind = "AdminNetworkPolicy",
    plural = "adminnetworkpolicies",
    derive = "PartialEq",
    derive = "Default"
)]
pub struct AdminNetworkPolicySpec {}

/// Nothing of the spec is read.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1alpha1",
    kind = "BaselineAdminNetworkPolicy",
    plural = "baselineadminnetworkpolicies",
    derive = "PartialEq",
    derive = "Default"
)]
pub struct BaselineAdminNetworkPolicySpec {}

/// Nothing of the spec is read.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "k8s.ovn.org",
    version = "v1",
    kind = "EgressFirewall",
    plural = "egressfirewalls",
    namespaced,
    derive = "PartialEq",
    derive = "Default"
)]
pub struct EgressFirewallSpec {}
