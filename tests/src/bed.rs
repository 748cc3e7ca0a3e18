//! The bed both packet tables (`datapath_v4`, `datapath_v6`) run on, written once over the
//! address family: the namespace (devices, addresses, routes, neighbours), the maps every
//! case starts from, the cluster's addresses, the frame builders and the steps. A table
//! over IPv4 pods is a table of `Case<Net<Ipv4Addr>>`, one over IPv6 pods of
//! `Case<Net<Ipv6Addr>>`; the cases whose logic is the same for both live in [`cases`].
//!
//! The namespace (one node that is both a source node and a gateway), for a family's
//! addresses (see [`Cluster`]):
//!
//! ```text
//!   pod0  veth 02:00:00:00:bb:01 -- pod LOCAL_POD (02:00:00:00:aa:01), host route
//!   tun0  veth: stands in for the collect-metadata VXLAN device
//!   ul0   veth: the underlay address of this node (IPv4 or IPv6: `UnderlayNet`)
//!   (veths everywhere: the test kernel may lack the dummy driver)
//!   sec0  veth 02:00:00:00:0a:02, SHARED_A on network A: egress IP EGRESS_A (rule A); its
//!         own address serves an `interface:` rule (RULE_SHARED)
//!         neighbours DEST_A and ROUTER_A (router to FAR_NET)
//!   sec1  veth 02:00:00:00:0b:02, network B: egress IP EGRESS_B (rule B)
//!         neighbour DEST_B
//! ```
//!
//! IPv6 addresses carry `nodad` (usable at once), and forwarding is on for the family
//! (the FIB helper refuses to forward otherwise).

pub mod answers;
pub mod cases;
pub mod gso;

use std::{
    fmt::{Debug, Display},
    marker::PhantomData,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use egress_common::{
    config::Config,
    conntrack::{CtEntryV4, CtEntryV6, CtKeyV4, CtKeyV6, NextHop},
    policy::{PolicyValueV4, PolicyValueV6, action, egress_ip_flags},
    underlay,
};

use crate::{
    packet::{Ipv4Packet, L4, POD_MAC, PROTO_ICMP, checksum, icmp_error},
    packet6::{
        Ipv6Packet, NEXTHDR_DEST, NEXTHDR_HOP, PROTO_ICMPV6, icmp6_error, l4_offset, pseudo_header6,
    },
    table::{self, Bed, Case, Check, Dev, Frame, Step, frame_diff, step},
    testrun::{Datapath, ifindex, ip, ready_config, sysctl},
};

pub const fn a(a: u8, b: u8, c: u8, d: u8) -> Ipv4Addr {
    Ipv4Addr::new(a, b, c, d)
}

pub const fn v6(a: u16, b: u16, c: u16, h: u16) -> Ipv6Addr {
    Ipv6Addr::new(a, b, c, 0, 0, 0, 0, h)
}

/// The underlay as this node sees it. The IPv4 tables run over [`UL4`]; every IPv6 table
/// runs twice, over [`UL4`] and over [`UL6`].
#[derive(Clone, Copy, Debug)]
pub struct UnderlayNet {
    /// This node (source node and gateway).
    pub node: IpAddr,
    /// Another known node, and a gateway for some rules.
    pub peer: IpAddr,
    /// Not a node.
    pub stranger: IpAddr,
    /// `ul0`'s address.
    pub cidr: &'static str,
}

/// This node on the IPv4 underlay.
pub const NODE_V4: Ipv4Addr = a(192, 168, 0, 10);
/// Another node on the IPv4 underlay.
pub const PEER_V4: Ipv4Addr = a(192, 168, 0, 20);
/// Not a node, on the IPv4 underlay.
pub const STRANGER_V4: Ipv4Addr = a(192, 168, 0, 99);

pub const UL4: UnderlayNet = UnderlayNet {
    node: IpAddr::V4(NODE_V4),
    peer: IpAddr::V4(PEER_V4),
    stranger: IpAddr::V4(STRANGER_V4),
    cidr: "192.168.0.10/24",
};

pub const UL6: UnderlayNet = UnderlayNet {
    node: IpAddr::V6(v6(0xfd00, 0xff, 0, 0x10)),
    peer: IpAddr::V6(v6(0xfd00, 0xff, 0, 0x20)),
    stranger: IpAddr::V6(v6(0xfd00, 0xff, 0, 0x99)),
    cidr: "fd00:ff::10/64 nodad",
};

pub const RULE_A: u32 = 1;
pub const RULE_B: u32 = 2;
/// A rule id the IPv6 table's gateway serves for IPv4 only.
pub const RULE_V4_ONLY: u32 = 3;

pub const POD0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xbb, 0x01];
pub const SEC0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0x02];
pub const SEC1_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0b, 0x02];
pub const DEST_A_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0x07];
pub const ROUTER_A_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0x01];
pub const DEST_B_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0b, 0x09];

pub use crate::testrun::{PORT_MAX, PORT_MIN, TUNNEL_MTU};

/// A segment's PSH flag.
pub const TCP_PSH: u8 = 0x08;

/// `m` as `ip` writes it.
pub fn mac(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The per-family constants, each declared once with its IPv4 and its IPv6 value: the
/// trait [`Cluster`] (implemented by `Ipv4Addr` and `Ipv6Addr`) and the plain constants of
/// [`v4`] and [`v6`] for the family's own cases.
macro_rules! cluster {
    (
        addresses { $($(#[$adoc:meta])* $addr:ident: $a4:expr, $a6:expr;)* }
        values { $($(#[$vdoc:meta])* $val:ident: $ty:ty = $v4:expr, $v6:expr;)* }
    ) => {
        /// The cluster as a family's table sees it: its addresses and what else differs.
        pub trait Cluster: Sized + 'static {
            $($(#[$adoc])* const $addr: Self;)*
            $($(#[$vdoc])* const $val: $ty;)*
        }
        impl Cluster for Ipv4Addr {
            $(const $addr: Self = $a4;)*
            $(const $val: $ty = $v4;)*
        }
        impl Cluster for Ipv6Addr {
            $(const $addr: Self = $a6;)*
            $(const $val: $ty = $v6;)*
        }
        /// The IPv4 cluster, as plain constants.
        pub mod v4 {
            use super::*;
            $($(#[$adoc])* pub const $addr: Ipv4Addr = <Ipv4Addr as Cluster>::$addr;)*
        }
        /// The IPv6 cluster, as plain constants.
        pub mod v6 {
            use super::*;
            $($(#[$adoc])* pub const $addr: Ipv6Addr = <Ipv6Addr as Cluster>::$addr;)*
        }
    };
}

cluster! {
    addresses {
        LOCAL_POD: a(10, 244, 1, 5), v6(0xfd00, 0x244, 1, 5);
        UNSELECTED_POD: a(10, 244, 1, 9), v6(0xfd00, 0x244, 1, 9);
        REMOTE_POD: a(10, 244, 2, 5), v6(0xfd00, 0x244, 2, 5);
        REMOTE_POD2: a(10, 244, 2, 6), v6(0xfd00, 0x244, 2, 6);
        REMOTE_POD3: a(10, 244, 2, 7), v6(0xfd00, 0x244, 2, 7);
        /// A pod of the peer that no policy selects: in `POD_OWNER_*`, not in `ADMITTED_*`.
        REMOTE_UNSELECTED: a(10, 244, 2, 9), v6(0xfd00, 0x244, 2, 9);
        /// In the pod network, but no node's pod.
        NOT_A_POD: a(10, 244, 9, 9), v6(0xfd00, 0x244, 9, 9);
        /// Network A (sec0), of length `NET_A_LEN`.
        NET_A: a(10, 100, 0, 0), v6(0xfd00, 0x100, 0, 0);
        /// On network A, directly connected.
        DEST_A: a(10, 100, 0, 7), v6(0xfd00, 0x100, 0, 7);
        /// On network A, no neighbour entry.
        DEST_A_NO_NEIGH: a(10, 100, 0, 8), v6(0xfd00, 0x100, 0, 8);
        /// On network A beside `DEST_A`: outside its host route.
        NEAR_A: a(10, 100, 0, 6), v6(0xfd00, 0x100, 0, 6);
        /// On network A, past the except prefix of length `EXCEPT_LEN` at `NET_A`.
        PAST_EXCEPT_A: a(10, 100, 0, 9), v6(0xfd00, 0x100, 0, 9);
        /// An except hole of length `HOLE_LEN` in network A, for the coverage map.
        HOLE_A: a(10, 100, 0, 128), v6(0xfd00, 0x100, 0, 0x80);
        /// A pod address of this node that no Pod object has announced yet.
        UNKNOWN_POD: a(10, 244, 1, 77), v6(0xfd00, 0x244, 1, 0x77);
        /// On network A, neither an egress IP nor a neighbour.
        UNRELATED_A: a(10, 100, 0, 99), v6(0xfd00, 0x100, 0, 0x99);
        /// The router on network A.
        ROUTER_A: a(10, 100, 0, 1), v6(0xfd00, 0x100, 0, 1);
        /// Behind the router on network A.
        DEST_FAR: a(172, 16, 5, 5), v6(0xfd00, 0x172, 0x16, 5);
        /// On network B (sec1).
        DEST_B: a(10, 200, 0, 9), v6(0xfd00, 0x200, 0, 9);
        /// Outside every rule.
        INTERNET: a(8, 8, 8, 8), v6(0x2001, 0xdb8, 0, 8);
        EGRESS_A: a(10, 100, 0, 50), v6(0xfd00, 0x100, 0, 0x50);
        EGRESS_B: a(10, 200, 0, 50), v6(0xfd00, 0x200, 0, 0x50);
        /// sec0's own address, used by an `interface:` rule (shared with the host).
        SHARED_A: a(10, 100, 0, 2), v6(0xfd00, 0x100, 0, 2);
    }
    values {
        /// What failure messages call the family.
        NAME: &'static str = "IPv4", "IPv6";
        /// What case names call the translation.
        NAT: &'static str = "SNAT", "NAT66";
        /// What case names call the hop count.
        HOPS: &'static str = "TTL", "hop limit";
        /// What case names call the headers between the IP header and the transport.
        OPTIONS: &'static str = "IP options", "extension headers";
        /// `ip`'s family flag.
        IP_FLAG: &'static str = "-4", "-6";
        /// sec0's and sec1's addresses.
        SEC0_CIDR: &'static str = "10.100.0.2/24", "fd00:100::2/64 nodad";
        SEC1_CIDR: &'static str = "10.200.0.2/24", "fd00:200::2/64 nodad";
        /// The network behind `ROUTER_A`.
        FAR_NET: &'static str = "172.16.0.0/16", "fd00:172:16::/48";
        /// The forwarding sysctls the family's FIB lookups need.
        FORWARDING: &'static [&'static str] = &["net/ipv4/conf/all/forwarding"],
            &["net/ipv4/conf/all/forwarding", "net/ipv6/conf/all/forwarding"];
        /// Network A's prefix length.
        NET_A_LEN: u32 = 24, 64;
        /// An except prefix at `NET_A` holding `DEST_A`, not `PAST_EXCEPT_A`.
        EXCEPT_LEN: u32 = 29, 125;
        /// `HOLE_A`'s prefix length.
        HOLE_LEN: u32 = 28, 124;
        /// A host route's prefix length.
        HOST_LEN: u32 = 32, 128;
        /// The IP header without options or extension headers.
        L3_LEN: usize = 20, 40;
        /// The IP and TCP headers an MSS leaves out of the MTU.
        MSS_OVERHEAD: u16 = 40, 60;
        /// The UDP payload that fits the tunnel MTU.
        BIG_PAYLOAD: u32 = 1400, 1380;
        /// An `interface:` rule: out of sec0 with sec0's own address.
        RULE_SHARED: u32 = 3, 4;
        /// Whether the gateway also serves `RULE_V4_ONLY` (a rule of the other family).
        SERVES_V4_ONLY_RULE: bool = false, true;
        /// What case names call the family's ICMP.
        ICMP: &'static str = "ICMP", "ICMPv6";
        /// The error that says a packet was too big: (type, code, name).
        TOO_BIG: (u8, u8, &'static str) = (3, 4, "fragmentation needed"), (2, 0, "packet too big");
        /// Port unreachable: (type, code).
        PORT_UNREACH: (u8, u8) = (3, 3), (1, 4);
        /// Time (hop limit) exceeded in transit: (type, code).
        TIME_EXCEEDED: (u8, u8) = (11, 0), (3, 0);
    }
}

/// A family of the tables: its addresses ([`Cluster`]), its packets and its maps.
pub trait Ip: Cluster + Copy + Into<IpAddr> + Display + Debug + PartialEq + Send + Sync {
    type Packet: Packet<Ip = Self>;
    type Policy: Copy + Send + 'static;
    type CtKey: Copy + Debug + PartialEq + Send + 'static;
    type CtEntry: Copy + Debug + PartialEq + Send + 'static;

    /// A policy entry for (pod, dst/len), the pod's selection kept up (`POLICY_*`).
    fn policy(dp: &mut Datapath, pod: Self, dst: Self, len: u32, value: Self::Policy);
    /// Select `pod` with the prefix lengths of its entries so far (`SELECTED_*`).
    fn selected(dp: &mut Datapath, pod: Self);
    /// Forward through the gateway at `gateway` under `rule_id`.
    fn forward(gateway: impl Into<IpAddr>, rule_id: u32) -> Self::Policy;
    /// A policy entry of action `act` and nothing else.
    fn sentinel(act: u8) -> Self::Policy;
    fn ct(dp: &mut Datapath) -> Vec<(Self::CtKey, Self::CtEntry)>;
    fn ct_insert(dp: &mut Datapath, key: Self::CtKey, entry: Self::CtEntry);
    fn ct_key(src: Self, dst: Self, ports: (u16, u16), proto: u8, dir: u8) -> Self::CtKey;
    fn ct_dir(key: &Self::CtKey) -> u8;
    /// An entry translating to `xlate`:`port`, everything else as `like`'s.
    fn ct_entry(like: &CtLike, xlate: Self, port: u16) -> Self::CtEntry;
    fn next_hop(entry: &mut Self::CtEntry) -> &mut NextHop;
    fn last_seen(entry: &mut Self::CtEntry) -> &mut u64;
    /// The entry's TCP state (`egress_common::conntrack::state`).
    fn state(entry: &mut Self::CtEntry) -> &mut u8;
    /// The pseudo-header of a transport checksum.
    fn pseudo_header(src: Self, dst: Self, proto: u8, len: usize) -> Vec<u8>;
    /// Source port (or echo identifier) of an output frame without options.
    fn sport_of(f: &[u8]) -> u16;
    /// `p` with IP options (IPv4) or extension headers (IPv6) before its transport.
    fn with_options(p: &Self::Packet) -> Self::Packet;
    /// An ICMP (ICMPv6) error message quoting `quoted`.
    fn icmp_error(kind: u8, code: u8, rest: [u8; 4], quoted: &[u8]) -> L4;
    /// See [`error_back`].
    fn error_back(e: &Self::Packet, q: &[u8], pod: Self, port: u16, port_at: usize)
    -> Self::Packet;
    /// See [`valid_error`].
    fn valid_error(want: &Self::Packet) -> Check;
}

/// The fields a conntrack entry of either family has, but its address.
#[derive(Clone, Copy, Debug)]
pub struct CtLike {
    pub state: u8,
    pub pod_node: IpAddr,
    pub ifindex: u32,
    pub rule_id: u32,
    pub last_seen_ns: u64,
    pub next_hop: NextHop,
}

/// A packet of either family, built from scratch.
pub trait Packet: Frame + Clone + Debug + Send + Sync + 'static {
    type Ip: Ip<Packet = Self>;
    fn new(src: Self::Ip, dst: Self::Ip, l4: L4) -> Self;
    fn src(self, src: Self::Ip) -> Self;
    fn dst(self, dst: Self::Ip) -> Self;
    fn l4(self, l4: L4) -> Self;
    fn macs(self, dst: [u8; 6], src: [u8; 6]) -> Self;
    /// Set the TTL or hop limit.
    fn hops(self, hops: u8) -> Self;
    fn hops_left(&self) -> u8;
    fn transport(&self) -> &L4;
    /// (source, destination).
    fn ends(&self) -> (Self::Ip, Self::Ip);
    /// The frame, checksums computed.
    fn build(&self) -> Vec<u8>;
}

/// Both families' [`Ip`] and [`Packet`] from one template: the map setters, policy
/// values and conntrack entries differ by type and by name only.
macro_rules! family {
    ($(
        $Ip:ident {
            packet: $P:ident, hops: $hops:ident, octets: $n:literal,
            policy: $Policy:ident, key: $Key:ident, entry: $Entry:ident { $($pad:ident: $padv:expr),* },
            policy_fn: $policy:ident, selected_fn: $selected:ident,
            ct_fn: $ct:ident, ct_insert_fn: $ct_insert:ident,
            pseudo: $pseudo:path, sport_of: $sport:path, options: $options:path,
            icmp_error: $icmp:path, error_back: $back:path, valid_error: $valid:path,
        }
    )*) => {$(
        impl Ip for $Ip {
            type Packet = $P;
            type Policy = $Policy;
            type CtKey = $Key;
            type CtEntry = $Entry;

            fn policy(dp: &mut Datapath, pod: Self, dst: Self, len: u32, value: $Policy) {
                dp.$policy(pod, dst, len, value);
            }
            fn selected(dp: &mut Datapath, pod: Self) {
                dp.$selected(pod);
            }
            fn forward(gateway: impl Into<IpAddr>, rule_id: u32) -> $Policy {
                $Policy {
                    gateway: underlay::from_ip(gateway.into()),
                    egress_ip: Self::EGRESS_A.octets(),
                    rule_id,
                    action: action::FORWARD,
                    _pad: 0,
                    filter: 0,
                }
            }
            fn sentinel(act: u8) -> $Policy {
                $Policy {
                    gateway: [0; 16],
                    egress_ip: [0; $n],
                    rule_id: 0,
                    action: act,
                    _pad: 0,
                    filter: 0,
                }
            }
            fn ct(dp: &mut Datapath) -> Vec<($Key, $Entry)> {
                dp.$ct()
            }
            fn ct_insert(dp: &mut Datapath, key: $Key, entry: $Entry) {
                dp.$ct_insert(key, entry);
            }
            fn ct_key(src: Self, dst: Self, (sport, dport): (u16, u16), proto: u8, dir: u8) -> $Key {
                $Key {
                    src: src.octets(),
                    dst: dst.octets(),
                    src_port_be: sport.to_be(),
                    dst_port_be: dport.to_be(),
                    proto,
                    dir,
                    _pad: [0; 2],
                }
            }
            fn ct_dir(key: &$Key) -> u8 {
                key.dir
            }
            fn ct_entry(like: &CtLike, xlate: Self, port: u16) -> $Entry {
                $Entry {
                    xlate_addr: xlate.octets(),
                    xlate_port_be: port.to_be(),
                    state: like.state,
                    _pad0: 0,
                    pod_node: underlay::from_ip(like.pod_node),
                    ifindex: like.ifindex,
                    rule_id: like.rule_id,
                    $($pad: $padv,)*
                    last_seen_ns: like.last_seen_ns,
                    next_hop: like.next_hop,
                }
            }
            fn next_hop(entry: &mut $Entry) -> &mut NextHop {
                &mut entry.next_hop
            }
            fn last_seen(entry: &mut $Entry) -> &mut u64 {
                &mut entry.last_seen_ns
            }
            fn state(entry: &mut $Entry) -> &mut u8 {
                &mut entry.state
            }
            fn pseudo_header(src: Self, dst: Self, proto: u8, len: usize) -> Vec<u8> {
                $pseudo(src, dst, proto, len)
            }
            fn sport_of(f: &[u8]) -> u16 {
                $sport(f)
            }
            fn with_options(p: &$P) -> $P {
                $options(p)
            }
            fn icmp_error(kind: u8, code: u8, rest: [u8; 4], quoted: &[u8]) -> L4 {
                $icmp(kind, code, rest, quoted)
            }
            fn error_back(e: &$P, q: &[u8], pod: Self, port: u16, port_at: usize) -> $P {
                $back(e, q, pod, port, port_at)
            }
            fn valid_error(want: &$P) -> Check {
                Box::new($valid(want))
            }
        }

        impl Packet for $P {
            type Ip = $Ip;
            fn new(src: $Ip, dst: $Ip, l4: L4) -> Self {
                $P::new(src, dst, l4)
            }
            fn src(self, src: $Ip) -> Self {
                $P::src(self, src)
            }
            fn dst(self, dst: $Ip) -> Self {
                $P::dst(self, dst)
            }
            fn l4(self, l4: L4) -> Self {
                $P::l4(self, l4)
            }
            fn macs(self, dst: [u8; 6], src: [u8; 6]) -> Self {
                $P::macs(self, dst, src)
            }
            fn hops(self, hops: u8) -> Self {
                $P::$hops(self, hops)
            }
            fn hops_left(&self) -> u8 {
                self.$hops
            }
            fn transport(&self) -> &L4 {
                &self.l4
            }
            fn ends(&self) -> ($Ip, $Ip) {
                (self.src, self.dst)
            }
            fn build(&self) -> Vec<u8> {
                $P::build(self)
            }
        }
    )*};
}

family! {
    Ipv4Addr {
        packet: Ipv4Packet, hops: ttl, octets: 4,
        policy: PolicyValueV4, key: CtKeyV4, entry: CtEntryV4 {},
        policy_fn: policy, selected_fn: selected,
        ct_fn: ct, ct_insert_fn: ct_insert,
        pseudo: pseudo_header4, sport_of: sport_of4, options: options4,
        icmp_error: icmp_error, error_back: error_back4, valid_error: valid_error4,
    }
    Ipv6Addr {
        packet: Ipv6Packet, hops: hop_limit, octets: 16,
        policy: PolicyValueV6, key: CtKeyV6, entry: CtEntryV6 { _pad1: 0 },
        policy_fn: policy_v6, selected_fn: selected_v6,
        ct_fn: ct_v6, ct_insert_fn: ct_insert_v6,
        pseudo: pseudo_header6, sport_of: sport_of6, options: options6,
        icmp_error: icmp6_error, error_back: error_back6, valid_error: valid_error6,
    }
}

fn pseudo_header4(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> Vec<u8> {
    let mut h = [src.octets(), dst.octets()].concat();
    h.extend_from_slice(&[0, proto]);
    h.extend_from_slice(&(len as u16).to_be_bytes());
    h
}

/// Source port (or ICMP identifier) of an output frame without IP options.
fn sport_of4(f: &[u8]) -> u16 {
    let off = if f[23] == PROTO_ICMP { 38 } else { 34 };
    u16::from_be_bytes([f[off], f[off + 1]])
}

/// Source port (or ICMPv6 echo identifier) of an output frame.
fn sport_of6(f: &[u8]) -> u16 {
    let off = l4_offset(f);
    let off = if f[20] == PROTO_ICMPV6 { off + 4 } else { off };
    u16::from_be_bytes([f[off], f[off + 1]])
}

fn options4(p: &Ipv4Packet) -> Ipv4Packet {
    p.clone().options(&[1, 1, 148, 4, 0, 0])
}

fn options6(p: &Ipv6Packet) -> Ipv6Packet {
    p.clone().pad_options(NEXTHDR_HOP).pad_options(NEXTHDR_DEST)
}

/// Ifindexes of the devices of [`Net::build`], and the underlay they were built over.
pub struct Net<A> {
    pub ul: UnderlayNet,
    pub pod0: u32,
    /// Another pod's device (no pod behind it in the namespace): where a pod sending as
    /// `LOCAL_POD` would come from.
    pub pod1: u32,
    pub tun0: u32,
    pub sec0: u32,
    pub sec1: u32,
    family: PhantomData<A>,
}

impl<A: Ip> Net<A> {
    /// The devices, addresses, routes and neighbours of a case's namespace.
    pub fn build(ul: UnderlayNet) -> Self {
        for (dev, m, addr) in [
            ("ul0", [0x02, 0, 0, 0, 0xcc, 0x01], Some(ul.cidr)),
            ("tun0", [0x02, 0, 0, 0, 0xdd, 0x01], None),
            ("pod0", POD0_MAC, None),
            ("pod1", [0x02, 0, 0, 0, 0xbb, 0x02], None),
            ("sec0", SEC0_MAC, Some(A::SEC0_CIDR)),
            ("sec1", SEC1_MAC, Some(A::SEC1_CIDR)),
        ] {
            ip(&format!(
                "link add {dev} address {} type veth peer name {dev}p",
                mac(m)
            ));
            if let Some(addr) = addr {
                ip(&format!("addr add {addr} dev {dev}"));
            }
            ip(&format!("link set {dev} up"));
            ip(&format!("link set {dev}p up"));
        }
        let f = A::IP_FLAG;
        ip(&format!(
            "{f} route add {}/{} dev pod0",
            A::LOCAL_POD,
            A::HOST_LEN
        ));
        ip(&format!(
            "{f} route add {} via {} dev sec0",
            A::FAR_NET,
            A::ROUTER_A
        ));
        for (addr, m, dev) in [
            (A::LOCAL_POD, POD_MAC, "pod0"),
            (A::DEST_A, DEST_A_MAC, "sec0"),
            (A::ROUTER_A, ROUTER_A_MAC, "sec0"),
            (A::DEST_B, DEST_B_MAC, "sec1"),
        ] {
            ip(&format!(
                "{f} neigh replace {addr} lladdr {} dev {dev} nud permanent",
                mac(m)
            ));
        }
        for path in A::FORWARDING {
            sysctl(path, "1");
        }
        Net {
            ul,
            pod0: ifindex("pod0"),
            pod1: ifindex("pod1"),
            tun0: ifindex("tun0"),
            sec0: ifindex("sec0"),
            sec1: ifindex("sec1"),
            family: PhantomData,
        }
    }
}

impl<A> Bed for Net<A> {
    fn ifindex(&self, dev: Dev) -> u32 {
        match dev {
            Dev::Pod => self.pod0,
            Dev::OtherPod => self.pod1,
            Dev::Tunnel => self.tun0,
            Dev::Secondary => self.sec0,
        }
    }
}

/// This node's configuration: ready, the tests' port range and tunnel MTU.
pub fn config<A>(net: &Net<A>) -> Config {
    ready_config(net.ul.node, net.tun0)
}

/// What every case starts from: configuration, nodes, pod owners, the (pod, rule) pairs
/// admitted, the gateway's rules and egress IPs (and, beside the IPv6 ones, one rule id
/// served for IPv4 only). Policy entries (source side) are per case.
pub fn base<A: Ip>(dp: &mut Datapath, net: &Net<A>) {
    dp.config(config(net));
    let ul = net.ul;
    dp.node(ul.node, 1);
    dp.node(ul.peer, 2);
    dp.pod_owner(A::LOCAL_POD, ul.node);
    dp.pod_owner(A::UNSELECTED_POD, ul.node);
    for pod in [
        A::REMOTE_POD,
        A::REMOTE_POD2,
        A::REMOTE_POD3,
        A::REMOTE_UNSELECTED,
    ] {
        dp.pod_owner(pod, ul.peer);
    }
    // Every pod but the unselected ones may use every rule.
    for pod in [A::LOCAL_POD, A::REMOTE_POD, A::REMOTE_POD2, A::REMOTE_POD3] {
        for rule in [RULE_A, RULE_B, A::RULE_SHARED] {
            dp.admit(pod, rule);
        }
    }
    dp.rule(RULE_A, A::EGRESS_A, net.sec0);
    dp.rule(RULE_B, A::EGRESS_B, net.sec1);
    if A::SERVES_V4_ONLY_RULE {
        dp.rule(RULE_V4_ONLY, <Ipv4Addr as Cluster>::EGRESS_A, net.sec0);
    }
    dp.rule(A::RULE_SHARED, A::SHARED_A, net.sec0);
    dp.egress_ip(A::EGRESS_A, net.sec0, 0);
    dp.egress_ip(A::EGRESS_B, net.sec1, 0);
    dp.egress_ip(A::SHARED_A, net.sec0, egress_ip_flags::SHARED);
}

/// A fresh namespace with [`Net::build`]'s devices and a datapath with [`base`]'s maps.
pub fn bed<A: Ip>(ul: UnderlayNet) -> (Net<A>, Datapath) {
    let net = Net::build(ul);
    let mut dp = Datapath::load();
    base(&mut dp, &net);
    (net, dp)
}

/// Run every case (each in its own namespace, two at a time) from the namespace over `ul`
/// and the base maps, and report all failures.
pub fn run_table<A: Ip>(ul: UnderlayNet, cases: Vec<Case<Net<A>>>) {
    let what = format!("the {} table over the {ul:?}", A::NAME);
    table::run_table(&what, cases, move |dp| {
        let net = Net::build(ul);
        base(dp, &net);
        net
    });
}

/// `LOCAL_POD` selected, network A through rule A at `gateway`.
pub fn local_pod_to_a<A: Ip>(dp: &mut Datapath, gateway: impl Into<IpAddr>) {
    A::selected(dp, A::LOCAL_POD);
    let to_a = A::forward(gateway, RULE_A);
    A::policy(dp, A::LOCAL_POD, A::NET_A, A::NET_A_LEN, to_a);
}

// ---- steps ----

pub fn from_pod(p: &impl Frame) -> Step {
    step(egress_agent::ebpf::FROM_POD, Dev::Pod, None, p)
}

/// `p` into `from_pod` on another pod's device than `LOCAL_POD`'s (`Net::pod1`).
pub fn from_other_pod(p: &impl Frame) -> Step {
    step(egress_agent::ebpf::FROM_POD, Dev::OtherPod, None, p)
}

pub fn from_tunnel(sender: impl Into<IpAddr>, vni: u32, p: &impl Frame) -> Step {
    let tunnel = Some((sender.into(), vni));
    step(egress_agent::ebpf::FROM_TUNNEL, Dev::Tunnel, tunnel, p)
}

pub fn from_secondary(p: &impl Frame) -> Step {
    step(egress_agent::ebpf::FROM_SECONDARY, Dev::Secondary, None, p)
}

// ---- packets ----

pub fn tcp<A: Ip>(src: A, sport: u16, dst: A, dport: u16, flags: u8) -> A::Packet {
    A::Packet::new(src, dst, L4::tcp(sport, dport, flags))
}

pub fn syn<A: Ip>(src: A, sport: u16, dst: A, dport: u16, mss: u16) -> A::Packet {
    A::Packet::new(src, dst, L4::syn(sport, dport, mss))
}

pub fn udp<A: Ip>(src: A, sport: u16, dst: A, dport: u16) -> A::Packet {
    A::Packet::new(src, dst, L4::udp(sport, dport, b"hello, gateway!"))
}

/// A UDP packet with the largest payload the 1450-byte tunnel MTU takes.
pub fn big_udp<A: Ip>(src: A, sport: u16, dst: A, dport: u16) -> A::Packet {
    let payload: Vec<u8> = (0..A::BIG_PAYLOAD).map(|i| (i * 7 + 3) as u8).collect();
    A::Packet::new(src, dst, L4::udp(sport, dport, &payload))
}

pub fn echo<A: Ip>(src: A, dst: A, id: u16) -> A::Packet {
    A::Packet::new(src, dst, L4::echo_request(id, 1))
}

pub fn echo_reply<A: Ip>(src: A, dst: A, id: u16) -> A::Packet {
    A::Packet::new(src, dst, L4::echo_reply(id, 1))
}

/// `p` after source NAT to `src:sport` on the gateway, leaving by an interface with MAC
/// `smac` towards `dmac`.
pub fn snatted<P: Packet>(p: &P, src: P::Ip, sport: u16, smac: [u8; 6], dmac: [u8; 6]) -> P {
    let hops = p.hops_left() - 1;
    let l4 = p.transport().clone().with_sport(sport);
    p.clone().src(src).l4(l4).hops(hops).macs(dmac, smac)
}

/// `p` (a reply) after reverse NAT to `dst:dport`, MACs untouched (tunnel).
pub fn unnatted<P: Packet>(p: &P, dst: P::Ip, dport: u16) -> P {
    let hops = p.hops_left() - 1;
    let l4 = p.transport().clone().with_dport(dport);
    p.clone().dst(dst).l4(l4).hops(hops)
}

/// `p` translated to `EGRESS_A` out of sec0 on a port of the configured range other than
/// `not`.
pub fn snatted_in_range<P: Packet>(
    p: &P,
    not: u16,
) -> impl Fn(&[u8]) -> Result<(), String> + use<P> {
    let p = p.clone();
    move |out: &[u8]| {
        let port = <P::Ip as Ip>::sport_of(out);
        if port == not || !(PORT_MIN..=PORT_MAX).contains(&port) {
            return Err(format!(
                "translated port {port}: not a fresh port of the range"
            ));
        }
        let egress = <P::Ip as Cluster>::EGRESS_A;
        frame_diff(
            out,
            &snatted(&p, egress, port, SEC0_MAC, DEST_A_MAC).build(),
        )
    }
}

/// A segment of an established TCP flow: timestamps and 37 bytes of data.
pub fn segment(sport: u16, dport: u16, flags: u8) -> L4 {
    L4::Tcp {
        sport,
        dport,
        flags,
        seq: 0x1111_2222,
        ack: 0x3333_4444,
        // NOP, NOP, timestamps.
        options: vec![1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2],
        payload: b"GET /index.html HTTP/1.1\r\nHost: a\r\n\r\n".to_vec(),
    }
}

/// The RST that answers the segment `p` (MACs as in `p`): from its destination to its
/// source, with seq = its ack number (RST+ACK, seq 0 and ack = its seq + length if it has
/// no ACK), window 0, no options or data; the IP header as it was (options or extension
/// headers, ID, TTL or hop limit, flow label) but for the addresses and the length.
/// Checksums computed here.
pub fn rst_for<P: Packet>(p: &P) -> Vec<u8> {
    use crate::packet::{PROTO_TCP, TCP_ACK, TCP_FIN, TCP_RST};
    let L4::Tcp {
        sport,
        dport,
        flags,
        seq,
        ack,
        payload,
        ..
    } = p.transport()
    else {
        panic!("not TCP: {p:?}");
    };
    let (seq, ack, flags) = if flags & TCP_ACK != 0 {
        (*ack, 0, TCP_RST)
    } else {
        let len = payload.len() as u32 + u32::from(flags & TCP_FIN != 0);
        (0, seq + len, TCP_RST | TCP_ACK)
    };
    let (src, dst) = p.ends();
    let mut f = p
        .clone()
        .src(dst)
        .dst(src)
        .l4(L4::Tcp {
            sport: *dport,
            dport: *sport,
            flags,
            seq,
            ack,
            options: Vec::new(),
            payload: Vec::new(),
        })
        .build();
    let tcp = f.len() - 20;
    // Window 0 (the builder's is fixed), then the checksum again.
    f[tcp + 14..tcp + 18].fill(0);
    let pseudo = <P::Ip as Ip>::pseudo_header(dst, src, PROTO_TCP, 20);
    let c = checksum(&[&pseudo, &f[tcp..]]);
    f[tcp + 16..tcp + 18].copy_from_slice(&c.to_be_bytes());
    f
}

/// `step` answered with the RST for `p`.
pub fn rst(step: Step, p: &impl Packet) -> Step {
    step.expect(
        crate::testrun::TC_ACT_REDIRECT,
        table::Out::Frame(rst_for(p)),
    )
}

// ---- ICMP errors about translated flows ----

/// An ICMP (ICMPv6) error from the router on network A to `to`, quoting `q`.
pub fn error_to<A: Ip>(to: A, kind: u8, code: u8, rest: [u8; 4], q: &[u8]) -> A::Packet {
    A::Packet::new(A::ROUTER_A, to, A::icmp_error(kind, code, rest, q)).macs(SEC0_MAC, ROUTER_A_MAC)
}

/// The error `e` (quoting `q`, a packet the gateway sent from the egress IP) translated
/// back to `pod`: the destination, the TTL or hop limit, the quoted source and source port
/// (or echo identifier, `port_at` into the quoted transport header); the quoted transport
/// checksum stays that of the translated packet (see `icmp_error` in the datapath); every
/// other checksum computed from scratch.
pub fn error_back<P: Packet>(e: &P, q: &[u8], pod: P::Ip, port: u16, port_at: usize) -> P {
    <P::Ip as Ip>::error_back(e, q, pod, port, port_at)
}

/// Checks that a frame is `want` byte for byte and, on its own, that its checksums verify:
/// the outer IPv4 header, the ICMP message and the quoted IPv4 header; or the ICMPv6
/// message over its pseudo-header.
pub fn valid_error<P: Packet>(want: &P) -> Check {
    <P::Ip as Ip>::valid_error(want)
}

/// The rest of an ICMP (ICMPv6) error `e`: (type, code, the 4 bytes after the checksum).
fn error_head<P: Packet>(e: &P) -> (u8, u8, [u8; 4]) {
    let L4::Raw { payload, .. } = e.transport() else {
        panic!("not an ICMP error: {e:?}")
    };
    let rest = [payload[4], payload[5], payload[6], payload[7]];
    (payload[0], payload[1], rest)
}

/// `q` (a quote of a packet the gateway sent from the egress IP) as its pod sent it:
/// source `src`, source port (or echo identifier, `port_at` into the transport header)
/// `port`, its header checksum recomputed; its transport checksum stays that of the
/// translated packet (see `icmp_error` in the datapath).
fn requoted(q: &[u8], src: Ipv4Addr, port: u16, port_at: usize) -> Vec<u8> {
    let mut q = q.to_vec();
    q[12..16].copy_from_slice(&src.octets());
    q[20 + port_at..22 + port_at].copy_from_slice(&port.to_be_bytes());
    q[10..12].copy_from_slice(&[0, 0]);
    let c = checksum(&[&q[..20]]);
    q[10..12].copy_from_slice(&c.to_be_bytes());
    q
}

fn error_back4(e: &Ipv4Packet, q: &[u8], pod: Ipv4Addr, port: u16, port_at: usize) -> Ipv4Packet {
    let (kind, code, rest) = error_head(e);
    e.clone().dst(pod).ttl(e.ttl - 1).l4(icmp_error(
        kind,
        code,
        rest,
        &requoted(q, pod, port, port_at),
    ))
}

fn error_back6(e: &Ipv6Packet, q: &[u8], pod: Ipv6Addr, port: u16, port_at: usize) -> Ipv6Packet {
    let (kind, code, rest) = error_head(e);
    let mut q = q.to_vec();
    q[8..24].copy_from_slice(&pod.octets());
    q[40 + port_at..42 + port_at].copy_from_slice(&port.to_be_bytes());
    e.clone()
        .dst(pod)
        .hop_limit(e.hop_limit - 1)
        .l4(icmp6_error(kind, code, rest, &q))
}

fn valid_error4(want: &Ipv4Packet) -> impl Fn(&[u8]) -> Result<(), String> + Send + use<> {
    let want = want.build();
    move |f: &[u8]| {
        frame_diff(f, &want)?;
        let ihl = usize::from(f[14] & 0xf) * 4;
        let icmp = &f[14 + ihl..];
        for (what, bytes) in [
            ("outer IPv4 header", &f[14..14 + ihl]),
            ("ICMP message", icmp),
            ("quoted IPv4 header", &icmp[8..28]),
        ] {
            if checksum(&[bytes]) != 0 {
                return Err(format!("{what}: checksum does not verify"));
            }
        }
        Ok(())
    }
}

fn valid_error6(want: &Ipv6Packet) -> impl Fn(&[u8]) -> Result<(), String> + Send + use<> {
    let (src, dst) = (want.src, want.dst);
    let want = want.build();
    move |f: &[u8]| {
        frame_diff(f, &want)?;
        let icmp = &f[14 + 40..];
        if checksum(&[&pseudo_header6(src, dst, PROTO_ICMPV6, icmp.len()), icmp]) != 0 {
            return Err("ICMPv6 checksum does not verify".into());
        }
        Ok(())
    }
}
