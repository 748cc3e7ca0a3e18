//! Every address of the lab, by name.

use std::net::Ipv4Addr;

pub const UNDERLAY: &str = "10.200.0.0/24";
pub const ROUTER: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 1);
pub const W1: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 11);
pub const W2: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 12);
pub const GW1: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 21);
pub const GW2: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 22);

pub const NET_A: &str = "192.168.101.0/24";
pub const NET_B: &str = "192.168.102.0/24";
pub const NET_C: &str = "192.168.103.0/24";
/// Behind rtr-b: D is routed by the gateways from the start, E by nobody.
pub const NET_D: &str = "192.168.104.0/24";
pub const NET_E: &str = "192.168.105.0/24";
pub const GW1_SEC_A: Ipv4Addr = Ipv4Addr::new(192, 168, 101, 11);
pub const GW2_SEC_A: Ipv4Addr = Ipv4Addr::new(192, 168, 101, 12);
pub const GW1_SEC_B: Ipv4Addr = Ipv4Addr::new(192, 168, 102, 11);
pub const GW2_SEC_B: Ipv4Addr = Ipv4Addr::new(192, 168, 102, 12);
pub const ROUTER_NET_C: Ipv4Addr = Ipv4Addr::new(192, 168, 103, 1);
/// rtr-b, the router on network B in front of D and E, and its legs on D and E.
pub const RTR_B: Ipv4Addr = Ipv4Addr::new(192, 168, 102, 1);
pub const RTR_B_NET_D: Ipv4Addr = Ipv4Addr::new(192, 168, 104, 1);
pub const RTR_B_NET_E: Ipv4Addr = Ipv4Addr::new(192, 168, 105, 1);
pub const HOST_A: Ipv4Addr = Ipv4Addr::new(192, 168, 101, 100);
pub const HOST_B: Ipv4Addr = Ipv4Addr::new(192, 168, 102, 100);
pub const HOST_C: Ipv4Addr = Ipv4Addr::new(192, 168, 103, 100);
pub const HOST_D: Ipv4Addr = Ipv4Addr::new(192, 168, 104, 100);
pub const HOST_E: Ipv4Addr = Ipv4Addr::new(192, 168, 105, 100);
/// The address of an OVN-Kubernetes EgressIP on the primary network
/// ([`super::Lab::add_ovn_egress_ip`]).
pub const OVN_EGRESS_IP: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 100);
/// A second one, for a pod no policy of ours selects (`cargo xtask lab --cni ovn`).
pub const OVN_EGRESS_IP_2: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 101);
/// Egress IPs of the sample policy.
pub const EGRESS_IP_A: Ipv4Addr = Ipv4Addr::new(192, 168, 101, 50);
pub const EGRESS_IP_B: Ipv4Addr = Ipv4Addr::new(192, 168, 102, 50);

/// The pods' default gateway (answered by proxy ARP on the node's veth).
pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// `egress-echo serve` listens here, TCP and UDP, on every host.
pub const ECHO_PORT: u16 = 7777;

pub const W1_P1: Ipv4Addr = Ipv4Addr::new(10, 244, 11, 11);
pub const W1_P2: Ipv4Addr = Ipv4Addr::new(10, 244, 11, 12);
pub const W2_P1: Ipv4Addr = Ipv4Addr::new(10, 244, 12, 11);
pub const W2_P2: Ipv4Addr = Ipv4Addr::new(10, 244, 12, 12);
pub const GW1_P1: Ipv4Addr = Ipv4Addr::new(10, 244, 21, 11);
