//! The IPv6 addresses of the lab (family `V6` or `Dual`), by name.

use std::net::Ipv6Addr;

const fn a(s: [u16; 8]) -> Ipv6Addr {
    Ipv6Addr::new(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7])
}

pub const UNDERLAY: &str = "fd00:200::/64";
pub const ROUTER: Ipv6Addr = a([0xfd00, 0x200, 0, 0, 0, 0, 0, 0x1]);
pub const NET_A: &str = "fd00:101::/64";
pub const NET_B: &str = "fd00:102::/64";
pub const NET_C: &str = "fd00:103::/64";
pub const NET_D: &str = "fd00:104::/64";
pub const NET_E: &str = "fd00:105::/64";
pub const GW1_SEC_A: Ipv6Addr = a([0xfd00, 0x101, 0, 0, 0, 0, 0, 0x11]);
pub const GW2_SEC_A: Ipv6Addr = a([0xfd00, 0x101, 0, 0, 0, 0, 0, 0x12]);
pub const GW1_SEC_B: Ipv6Addr = a([0xfd00, 0x102, 0, 0, 0, 0, 0, 0x11]);
pub const GW2_SEC_B: Ipv6Addr = a([0xfd00, 0x102, 0, 0, 0, 0, 0, 0x12]);
pub const ROUTER_NET_C: Ipv6Addr = a([0xfd00, 0x103, 0, 0, 0, 0, 0, 0x1]);
pub const RTR_B: Ipv6Addr = a([0xfd00, 0x102, 0, 0, 0, 0, 0, 0x1]);
pub const RTR_B_NET_D: Ipv6Addr = a([0xfd00, 0x104, 0, 0, 0, 0, 0, 0x1]);
pub const RTR_B_NET_E: Ipv6Addr = a([0xfd00, 0x105, 0, 0, 0, 0, 0, 0x1]);
pub const HOST_A: Ipv6Addr = a([0xfd00, 0x101, 0, 0, 0, 0, 0, 0x100]);
pub const HOST_B: Ipv6Addr = a([0xfd00, 0x102, 0, 0, 0, 0, 0, 0x100]);
pub const HOST_C: Ipv6Addr = a([0xfd00, 0x103, 0, 0, 0, 0, 0, 0x100]);
pub const HOST_D: Ipv6Addr = a([0xfd00, 0x104, 0, 0, 0, 0, 0, 0x100]);
pub const HOST_E: Ipv6Addr = a([0xfd00, 0x105, 0, 0, 0, 0, 0, 0x100]);
/// The sample policy's IPv6 egress IPs.
pub const EGRESS_IP_A: Ipv6Addr = a([0xfd00, 0x101, 0, 0, 0, 0, 0, 0x50]);
pub const EGRESS_IP_B: Ipv6Addr = a([0xfd00, 0x102, 0, 0, 0, 0, 0, 0x50]);
/// Pods' default gateway: a link-local address of every node-side pod veth.
pub const POD_GATEWAY: Ipv6Addr = a([0xfe80, 0, 0, 0, 0, 0, 0, 0x1]);
