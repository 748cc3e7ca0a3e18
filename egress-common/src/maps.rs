//! Map names as they appear in the object file and under the pin directory.
//!
//! The kernel truncates map names to 15 characters; every name here fits.

pub const POLICY_V4: &str = "POLICY_V4";
pub const SELECTED_V4: &str = "SELECTED_V4";
pub const RULES_V4: &str = "RULES_V4";
pub const NODES: &str = "NODES";
pub const POD_OWNER_V4: &str = "POD_OWNER_V4";
pub const CT_V4: &str = "CT_V4";
pub const EGRESS_IPS_V4: &str = "EGRESS_IPS_V4";
pub const POLICY_V6: &str = "POLICY_V6";
pub const SELECTED_V6: &str = "SELECTED_V6";
pub const RULES_V6: &str = "RULES_V6";
pub const POD_OWNER_V6: &str = "POD_OWNER_V6";
pub const CT_V6: &str = "CT_V6";
pub const EGRESS_IPS_V6: &str = "EGRESS_IPS_V6";
pub const COUNTERS: &str = "COUNTERS";
pub const CONFIG: &str = "CONFIG";

/// Every map the agent pins, in a stable order.
pub const ALL: &[&str] = &[
    POLICY_V4,
    SELECTED_V4,
    RULES_V4,
    NODES,
    POD_OWNER_V4,
    CT_V4,
    EGRESS_IPS_V4,
    POLICY_V6,
    SELECTED_V6,
    RULES_V6,
    POD_OWNER_V6,
    CT_V6,
    EGRESS_IPS_V6,
    COUNTERS,
    CONFIG,
];

/// Capacities. The policy trie holds only this node's pods (source side), so 64k entries
/// cover 1,000 local pods with 64 prefixes each; conntrack is sized for a busy gateway.
pub const POLICY_MAX_ENTRIES: u32 = 65_536;
pub const RULES_MAX_ENTRIES: u32 = 16_384;
pub const NODES_MAX_ENTRIES: u32 = 16_384;
pub const POD_OWNER_MAX_ENTRIES: u32 = 262_144;
pub const CT_MAX_ENTRIES: u32 = 262_144;
pub const EGRESS_IPS_MAX_ENTRIES: u32 = 4_096;
