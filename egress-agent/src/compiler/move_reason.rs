//! Why an egress IP is held where it is (stable: `EgressIpStatus.reason`, Events and the
//! `egress_failovers_total` metric use them).

/// No node held it before.
pub const ASSIGNED: &str = "Assigned";
/// The previous holder stopped answering probes (dead, or cut off from the others).
pub const HOLDER_UNREACHABLE: &str = "HolderUnreachable";
pub const HOLDER_NOT_READY: &str = "HolderNotReady";
/// The previous holder is drained (`egress.dev/drain: "true"`) or cordoned.
pub const HOLDER_DRAINED: &str = "HolderDrained";
/// The previous holder's interface for the address is down or gone.
pub const HOLDER_INTERFACE_DOWN: &str = "HolderInterfaceDown";
/// The previous holder is no longer selected by the policy's gatewaySelector.
pub const HOLDER_NOT_SELECTED: &str = "HolderNotSelected";
/// Anything else (the policy changed, several nodes claimed it).
pub const REASSIGNED: &str = "Reassigned";
/// The previous holder holds another address of the rule's `egressIPs`, and an
/// eligible gateway that holds none can host this one.
pub const REBALANCED: &str = "Rebalanced";

pub const ALL: [&str; 8] = [
    ASSIGNED,
    HOLDER_UNREACHABLE,
    HOLDER_NOT_READY,
    HOLDER_DRAINED,
    HOLDER_INTERFACE_DOWN,
    HOLDER_NOT_SELECTED,
    REASSIGNED,
    REBALANCED,
];

/// The constant spelled `text`, if any.
pub fn parse(text: &str) -> Option<&'static str> {
    ALL.into_iter().find(|r| *r == text)
}
