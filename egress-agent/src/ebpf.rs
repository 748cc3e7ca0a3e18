//! The eBPF object, built by `build.rs` (aya-build) and embedded in the agent.

/// The object file: programs `from_pod`, `from_tunnel`, `from_underlay`, `from_secondary`
/// and their maps.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/egress"));

/// Program names in the object.
pub const FROM_POD: &str = "from_pod";
pub const FROM_TUNNEL: &str = "from_tunnel";
pub const FROM_SECONDARY: &str = "from_secondary";
/// On the underlay interface: our VXLAN packets decapsulated before the tunnel device.
pub const FROM_UNDERLAY: &str = "from_underlay";
/// Every program the agent attaches.
pub const PROGRAMS: [&str; 4] = [FROM_POD, FROM_TUNNEL, FROM_UNDERLAY, FROM_SECONDARY];
/// The programs loaded when the datapath opens: every node attaches the tunnel's and the
/// underlay's, and `from_pod` goes on a new pod device before the pod can send
/// (`--unknown-pods drop`). `from_secondary` only a gateway needs: most nodes never do.
pub const AT_OPEN: [&str; 3] = [FROM_POD, FROM_TUNNEL, FROM_UNDERLAY];

/// Global holding the tunnel's UDP port, which `from_underlay` decapsulates: set by the
/// agent when it loads the object (default `egress_common::config::DEFAULT_TUNNEL_PORT`).
pub const TUNNEL_PORT: &str = "TUNNEL_PORT";

/// Global that makes `from_tunnel` read (sender, VNI) from `__sk_buff.cb[0..2]`:
/// for `BPF_PROG_TEST_RUN` only, never set by the agent.
pub const TEST_TUNNEL_FROM_CB: &str = "TEST_TUNNEL_FROM_CB";

/// Default pin directory of an agent: one directory per agent, maps by name, TCX links as
/// `link-<program>@<ifname>@<ifindex>`, legacy tc filters recorded as
/// `tc-<program>@<ifname>@<ifindex>`.
pub const DEFAULT_BPFFS_DIR: &str = "/sys/fs/bpf/egress";
