//! Per-node configuration, index 0 of the `CONFIG` array, written by the agent.

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    /// This node's underlay address (see [`crate::underlay`]).
    pub node_ip: crate::underlay::Underlay,
    /// Ifindex of the agent's collect-metadata VXLAN device.
    pub tunnel_ifindex: u32,
    /// SNAT port range, inclusive, host order.
    pub port_min: u16,
    pub port_max: u16,
    /// MTU of the path inside the tunnel (underlay MTU - 50, or - 70 over IPv6): TCP SYNs
    /// and SYN-ACKs entering the tunnel get their MSS clamped to fit it. Larger packets are
    /// left to the tunnel device; the gateway answers a packet too big for its egress
    /// interface with "fragmentation needed" / "packet too big" (`too_big`).
    pub tunnel_mtu: u16,
    /// Bit set of [`flags`].
    pub flags: u16,
    /// Live flows a pod may hold on this gateway (translated new flows beyond it are
    /// dropped as `DROP_POD_FLOW_LIMIT`); 0: no limit. Approximate from above: counted up
    /// by the datapath, corrected down by the agent's conntrack sweeper.
    pub max_flows_per_pod: u32,
}
const _: () = assert!(core::mem::size_of::<Config>() == 32);

pub mod flags {
    /// The agent has written this entry; until then every program passes everything.
    pub const READY: u16 = 1 << 0;
    /// `--unknown-pods drop`: `from_pod` drops packets of pod addresses the agent has not
    /// seen yet (`KNOWN_PODS_*`) toward covered destinations (`COVERED_*`).
    pub const UNKNOWN_PODS_DROP: u16 = 1 << 1;
}

pub const DEFAULT_PORT_MIN: u16 = 1024;
pub const DEFAULT_PORT_MAX: u16 = 65_535;
/// Our tunnel's UDP port: clear of VXLAN (4789), Flannel (8472) and Geneve (6081).
pub const DEFAULT_TUNNEL_PORT: u16 = 4797;
