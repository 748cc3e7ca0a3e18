//! The egress gateway agent: watches cluster state (Kubernetes or a YAML directory),
//! compiles it into the desired datapath state of this node, and keeps the eBPF maps,
//! the tunnel device and the egress addresses in line with it.

/// This agent's version and the commit it was built from (`egress-agent --version`, the
/// EgressNode's `agentVersion`).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("EGRESS_COMMIT"),
    ")"
);

pub mod agent;
pub mod api;
pub mod check;
pub mod cni;
pub mod compiler;
pub mod datapath;
pub mod desired;
pub mod doctor;
pub mod ebpf;
pub mod endpoints;
pub mod explain;
pub mod family;
pub mod iface;
pub mod import;
pub mod liveness;
pub mod logs;
pub mod metrics;
pub mod netpol;
pub mod overview;
pub mod priority;
pub mod report;
pub mod selector;
pub mod source;
