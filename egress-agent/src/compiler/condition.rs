//! Condition types.

pub const ACCEPTED: &str = "Accepted";
pub const READY: &str = "Ready";
pub const CONFLICT: &str = "Conflict";
/// Some destinations learned from routes are left out or differ between gateways.
pub const ROUTES_DEGRADED: &str = "RoutesDegraded";
/// Some listed destinations cover the cluster's own addresses, which are carved out.
pub const CLUSTER_EXCLUDED: &str = "ClusterExcluded";
/// AdminNetworkPolicies, BaselineAdminNetworkPolicies or EgressFirewalls exist that
/// may cover the pods this policy redirects: they do not hold for that traffic.
pub const ADMIN_POLICIES_NOT_APPLIED: &str = "AdminPoliciesNotApplied";
/// Several addresses of one rule's `egressIPs` share a gateway: fewer eligible
/// gateways host them than the rule has addresses.
pub const EGRESS_IPS_SHARE_GATEWAY: &str = "EgressIPsShareGateway";

/// Every type the compiler emits (the CRD's description of `type` names them all).
pub const ALL: [&str; 7] = [
    ACCEPTED,
    READY,
    CONFLICT,
    ROUTES_DEGRADED,
    CLUSTER_EXCLUDED,
    ADMIN_POLICIES_NOT_APPLIED,
    EGRESS_IPS_SHARE_GATEWAY,
];
