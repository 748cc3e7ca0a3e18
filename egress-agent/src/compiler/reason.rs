//! Condition reasons (stable: users and alerts match on them).

// Accepted=True / Ready=True
pub const ACCEPTED: &str = "Accepted";
pub const READY: &str = "Ready";
// Accepted=False: the spec itself is wrong.
pub const INVALID_CIDR: &str = "InvalidCIDR";
pub const INVALID_IP: &str = "InvalidIP";
pub const INVALID_INTERFACE: &str = "InvalidInterface";
pub const INVALID_TARGET: &str = "InvalidTarget";
pub const INVALID_SELECTOR: &str = "InvalidSelector";
pub const NO_DESTINATIONS: &str = "NoDestinations";
pub const INVALID_DESTINATIONS: &str = "InvalidDestinations";
pub const EXCEPT_OUTSIDE_DESTINATIONS: &str = "ExceptOutsideDestinations";
pub const FAMILY_MISMATCH: &str = "FamilyMismatch";
pub const NO_RULES: &str = "NoRules";
// Ready=False: the spec is fine, the cluster cannot serve (all of) it.
pub const NOT_ACCEPTED: &str = "NotAccepted";
/// The spec is not accepted; its last accepted version is served meanwhile.
pub const SERVING_LAST_ACCEPTED: &str = "ServingLastAccepted";
pub const NO_MATCHING_GATEWAY: &str = "NoMatchingGateway";
pub const NO_ELIGIBLE_GATEWAY: &str = "NoEligibleGateway";
pub const EGRESS_IP_NOT_HOSTABLE: &str = "EgressIPNotHostable";
pub const EGRESS_IP_IS_NODE_ADDRESS: &str = "EgressIPIsNodeAddress";
pub const EGRESS_IP_IN_USE: &str = "EgressIPInUse";
/// An egress IP that two policies name: it belongs to the older one (`Conflict=True`
/// on both; the other's rules get no gateway).
pub const EGRESS_IP_CONFLICT: &str = "EgressIPConflict";
/// A pod address that two pods list, or a pod and a node: nobody's (`Conflict=True` on
/// every policy selecting a claimant).
pub const POD_ADDRESS_CONFLICT: &str = "PodAddressConflict";
/// A selected pod's destination of this policy that another policy's longer prefix
/// takes for that pod (`Conflict=True` on both).
pub const DESTINATION_OVERRIDDEN: &str = "DestinationOverridden";
/// An egress IP that another implementation's object claims too (an OVN-Kubernetes
/// `EgressIP`): `Conflict=True`, and this policy leaves the address alone.
pub const EGRESS_IP_CLAIMED_ELSEWHERE: &str = "EgressIPClaimedElsewhere";
pub const INTERFACE_NOT_FOUND: &str = "InterfaceNotFound";
pub const NO_ROUTES: &str = "NoRoutes";
/// A node's policy map cannot hold the entries of every selected pod there: the pods
/// left out (some selected by this policy) have their covered traffic dropped.
pub const POLICY_MAP_FULL: &str = "PolicyMapFull";
// Conflict=True
pub const DESTINATION_CLAIMED: &str = "DestinationClaimed";
// RoutesDegraded=True
pub const ROUTES_DISAGREE: &str = "RoutesDisagree";
pub const ROUTES_OVERLAP_CLUSTER: &str = "RoutesOverlapCluster";
pub const ROUTES_TRUNCATED: &str = "RoutesTruncated";
// ClusterExcluded=True
pub const DESTINATIONS_COVER_CLUSTER: &str = "DestinationsCoverCluster";
// AdminPoliciesNotApplied=True
pub const NOT_APPLIED_TO_REDIRECTED_TRAFFIC: &str = "NotAppliedToRedirectedTraffic";
// EgressIPsShareGateway=True
pub const FEWER_GATEWAYS_THAN_EGRESS_IPS: &str = "FewerGatewaysThanEgressIPs";
// Problems about other objects.
pub const NO_UNDERLAY_ADDRESS: &str = "NoUnderlayAddress";
pub const UNDERLAY_FAMILY_MISMATCH: &str = "UnderlayFamilyMismatch";
/// Pods of a node have addresses outside the declared cluster CIDRs and the nodes'
/// pod CIDRs.
pub const POD_OUTSIDE_CLUSTER_CIDRS: &str = "PodOutsideClusterCIDRs";
