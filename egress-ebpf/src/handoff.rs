//! The plain values that the gateway and RST paths leave for one another in the per-CPU
//! scratch slot (`scratch`): who sent a packet, an IPv6 flow's translation, a segment to
//! answer with a RST and that RST's header. Data only, apart from the code that fills and
//! reads them, so that the slot can hold them without importing that code.

use egress_common::{conntrack::NextHop, underlay::Underlay};

use crate::parse::{Ipv4, L4};

/// Who sent a packet into the gateway path: its rule and the pod's node.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Origin {
    pub rule_id: u32,
    pub pod_node: Underlay,
}

/// The translation of an IPv6 flow: in, who sent it; out, its egress IP, port and
/// interface, and its next hop when the flow's entry has a valid one cached. Lives in
/// the per-CPU scratch slot.
#[repr(C)]
pub struct Xlate6 {
    pub origin: Origin,
    pub egress_ip: [u8; 16],
    pub port_be: u16,
    pub ifindex: u32,
    /// `NH_GEN` as this packet found it, before any FIB lookup: a next hop that a lookup
    /// finds is cached under it (a change meanwhile makes the cache stale, never wrong).
    pub generation: u32,
    /// 1 when `nh` holds the flow's valid cached next hop (`gateway::lookup6`).
    pub cached: u32,
    pub nh: NextHop,
}

/// What an IPv4 RST or "fragmentation needed" needs of the packet it answers (the IPv4
/// paths keep these on the stack).
#[repr(C)]
pub struct Segment4 {
    pub ip: Ipv4,
    pub l4: L4,
    pub pod_node: Underlay,
}

/// What `answer` needs besides the packet: which answer (`answer::TOO_BIG`,
/// `answer::TIME_EXCEEDED`), the MTU of the device the packet did not fit, and (IPv4;
/// IPv6 has it in `Xlate6`) the egress IP it would have left with.
#[repr(C)]
pub struct Pending {
    pub what: u32,
    pub mtu: u32,
    pub from4: [u8; 4],
}

/// How much of a packet its ICMP answer (`answer`) quotes: its IP
/// header and at least 24 bytes of its transport header (RFC 792 asks for 8), within what
/// `bpf_csum_diff` sums at once.
pub const QUOTE: usize = 64;

/// An ICMP (ICMPv6) error message as `answer` builds it: its header and the quote.
#[repr(C)]
pub struct Icmp {
    pub hdr: [u8; 8],
    pub quote: [u8; QUOTE],
}

/// `answer`'s IPv4 answer after the Ethernet header: the IP header with its 40-byte
/// option, the ICMP message.
#[repr(C)]
pub struct Answer4 {
    pub ip: [u8; 60],
    pub icmp: Icmp,
}

/// `answer`'s IPv6 answer after the Ethernet header: the fixed header, a destination
/// options header, the ICMPv6 message.
#[repr(C)]
pub struct Answer6 {
    pub ip: [u8; 40],
    pub opts: [u8; 24],
    pub icmp: Icmp,
}

/// A TCP header without its options, as it sits in the packet (network order): the
/// RST's, built by `reset`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TcpHdr {
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    /// Data offset (high nibble), then the flags.
    pub off_flags: [u8; 2],
    pub window: u16,
    pub check: u16,
    pub urg: u16,
}
