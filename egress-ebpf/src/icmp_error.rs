//! ICMP and ICMPv6 errors about translated flows, arriving on an egress interface for an
//! egress IP: fragmentation needed / packet too big, destination and port unreachable,
//! time exceeded. Without them a pod behind the gateway never learns a smaller path MTU
//! (a PMTU black hole) and a UDP send to a closed port times out instead of failing.
//!
//! An error quotes the packet it is about: the one the gateway sent, from the egress IP
//! and its translated port to the remote. Its flow's reply entry (the key a reply of that
//! packet would have) names the pod; the error is then translated back like a reply: the
//! outer destination becomes the pod, the quoted source address and port the pod's, and
//! it goes back through the tunnel to the pod's node with `RETURN_VNI` (or to a local
//! pod), where `from_tunnel` delivers it as it delivers replies.
//!
//! Checksums: the outer IPv4 header's (destination), the quoted IPv4 header's (source),
//! and the ICMP checksum, which covers the quoted bytes: the quoted address and its header
//! checksum change by opposite amounts, so only the quoted port moves the ICMP checksum.
//! ICMPv6 covers the outer addresses in its pseudo-header and the quoted header as data.
//! The quoted transport checksum is left as it is (that of the packet the gateway sent):
//! routers often quote only 8 bytes of it (RFC 792), so a TCP checksum is not even there,
//! and receivers (Linux's `tcp_v4_err`, `udp_err`, ...) match the quoted addresses and
//! ports to a socket without checking it.
//!
//! Only what a pod needs is read: a quoted IPv4 header without options, a quoted IPv6
//! header followed directly by TCP, UDP or an echo request (no extension headers walked),
//! and 8 bytes of its transport header; anything else is `DROP_ICMP_QUOTE`. An error
//! quoting a flow without a live entry is `DROP_ICMP_UNKNOWN_FLOW`. For a shared address
//! (the interface's own, which the host uses too), both pass to the host instead. An
//! error never creates an entry, nor refreshes one.

use aya_ebpf::programs::TcContext;
use egress_common::{
    conntrack::{CtKeyV4, dir},
    counters::reason,
};
use network_types::ip::Ipv4Hdr;

use crate::{
    back,
    conntrack::{self, v4, v6},
    counters::{OK, SHOT, count, verdict},
    maps,
    parse::{
        ETH_LEN, IP_CSUM_OFF, IP_DST_OFF, IP6_DST_OFF, IP6_HDR_LEN, Ipv4, L4, PROTO_ICMP,
        PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
    },
    parse6::{self, Ipv6, STOP_NONE},
    rewrite,
    scratch::Scratch,
    underlay,
};

/// The ICMP header before the quoted packet: type, code, checksum, 4 more bytes.
const ICMP_HDR_LEN: usize = 8;
const ICMP_CSUM_OFF: usize = 2;
const IP4_HDR_LEN: usize = 20;
/// Quoted transport bytes read: the ports (or the echo identifier), what every router
/// quotes.
const QUOTED_L4_LEN: usize = 8;
/// Offsets in a quoted IPv4 header (checksum, source) and IPv6 header (source,
/// destination).
const Q4_CSUM_OFF: usize = 10;
const Q4_SRC_OFF: usize = 12;
const Q6_SRC_OFF: usize = 8;
const Q6_DST_OFF: usize = 24;

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_ECHO_REQUEST: u8 = 8;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PKT_TOO_BIG: u8 = 2;
const ICMPV6_TIME_EXCEEDED: u8 = 3;
const ICMPV6_ECHO_REQUEST: u8 = 128;

/// The quoted packet's transport part: its protocol, its ports as the gateway sent them
/// (for an echo request: identifier, 0, as conntrack keys it), and the offset of the
/// source port (or identifier).
#[derive(Clone, Copy)]
struct Quote {
    proto: u8,
    sport_be: u16,
    dport_be: u16,
    port_off: usize,
}

/// Whether an IPv4 packet is an ICMP error this module translates (every code of
/// destination unreachable, fragmentation needed included; time exceeded).
#[inline(always)]
pub fn is_error4(ctx: &TcContext, ip: &Ipv4) -> bool {
    ip.proto == PROTO_ICMP
        && !ip.fragment
        && matches!(
            ctx.load::<u8>(ip.l4),
            Ok(ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED)
        )
}

/// Whether an IPv6 packet is an ICMPv6 error this module translates (destination
/// unreachable, packet too big, time exceeded).
#[inline(always)]
pub fn is_error6(ctx: &TcContext, ip: &Ipv6) -> bool {
    ip.proto == PROTO_ICMPV6
        && ip.stop == STOP_NONE
        && matches!(
            ctx.load::<u8>(ip.l4),
            Ok(ICMPV6_DEST_UNREACH | ICMPV6_PKT_TOO_BIG | ICMPV6_TIME_EXCEEDED)
        )
}

/// The transport part of a quoted packet of protocol `proto` at `off`.
#[inline(always)]
fn quoted_l4(ctx: &TcContext, proto: u8, off: usize) -> Option<Quote> {
    let h: [u8; QUOTED_L4_LEN] = ctx.load(off).ok()?;
    match proto {
        PROTO_TCP | PROTO_UDP => Some(Quote {
            proto,
            sport_be: u16::from_ne_bytes([h[0], h[1]]),
            dport_be: u16::from_ne_bytes([h[2], h[3]]),
            port_off: off,
        }),
        PROTO_ICMP | PROTO_ICMPV6
            if h[0]
                == if proto == PROTO_ICMP {
                    ICMP_ECHO_REQUEST
                } else {
                    ICMPV6_ECHO_REQUEST
                } =>
        {
            Some(Quote {
                proto,
                sport_be: u16::from_ne_bytes([h[4], h[5]]),
                dport_be: 0,
                port_off: off + 4,
            })
        }
        _ => None,
    }
}

/// What the tunnel needs of a packet that is not a TCP SYN: nothing (no MSS to clamp).
const NO_L4: L4 = L4 {
    sport_be: 0,
    dport_be: 0,
    tcp_flags: 0,
    tcp_hdr_len: 0,
};

/// Translate an IPv4 ICMP error ([`is_error4`]) to the egress IP `ip.dst` back to its
/// pod, and send it the way replies go. `shared`: the address is the interface's own.
/// (The configuration is looked up again rather than passed: LLVM would pass the fields
/// it uses by value, and a BPF call takes five registers.)
#[inline(never)]
pub fn translate4(ctx: &TcContext, ip: &Ipv4, shared: bool) -> i32 {
    let miss = |r| if shared { OK } else { verdict(ctx, r, SHOT) };
    let Some(cfg) = maps::config() else {
        return miss(reason::DROP_NOT_READY);
    };
    let q_ip = ip.l4 + ICMP_HDR_LEN;
    let msg_len = usize::from(ip.tot_len) - (ip.l4 - ETH_LEN);
    if msg_len < ICMP_HDR_LEN + IP4_HDR_LEN + QUOTED_L4_LEN {
        return miss(reason::DROP_ICMP_QUOTE);
    }
    let Ok(h) = ctx.load::<Ipv4Hdr>(q_ip) else {
        return miss(reason::DROP_ICMP_QUOTE);
    };
    // No options, not a later fragment (no ports), sent from this egress IP.
    if h.version() != 4
        || usize::from(h.ihl()) != IP4_HDR_LEN
        || h.frag_offset() != 0
        || h.src_addr != ip.dst
    {
        return miss(reason::DROP_ICMP_QUOTE);
    }
    let Some(q) = quoted_l4(ctx, h.proto, q_ip + IP4_HDR_LEN) else {
        return miss(reason::DROP_ICMP_QUOTE);
    };
    // The key a reply to the quoted packet would have.
    let key = CtKeyV4 {
        src: h.dst_addr,
        dst: h.src_addr,
        src_port_be: q.dport_be,
        dst_port_be: q.sport_be,
        proto: q.proto,
        dir: dir::REPLY,
        _pad: [0; 2],
    };
    let Some(e) = v4::peek(&key, conntrack::now()) else {
        return miss(reason::DROP_ICMP_UNKNOWN_FLOW);
    };
    if ip.ttl <= 1 {
        return verdict(ctx, reason::DROP_TTL_EXCEEDED, SHOT);
    }
    let icmp_csum = ip.l4 + ICMP_CSUM_OFF;
    if rewrite::replace_addr4(
        ctx,
        q_ip + Q4_CSUM_OFF,
        q_ip + Q4_SRC_OFF,
        h.src_addr,
        e.xlate_addr,
    )
    .is_err()
        || rewrite::rewrite_port(ctx, icmp_csum, 0, q.port_off, q.sport_be, e.xlate_port_be)
            .is_err()
        || rewrite::replace_addr4(ctx, IP_CSUM_OFF, IP_DST_OFF, ip.dst, e.xlate_addr).is_err()
        || rewrite::dec_ttl(ctx, ip).is_err()
    {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    }
    count(ctx, reason::ICMP_ERROR_XLATED);
    back::send4(ctx, cfg, ip, &NO_L4, e.xlate_addr, underlay::pod_node(e))
}

/// [`translate4`] for an ICMPv6 error ([`is_error6`]); its headers are in the scratch
/// slot `s`, and so are the conntrack key and the partner key's room.
#[inline(never)]
pub fn translate6(ctx: &TcContext, s: &mut Scratch, shared: bool) -> i32 {
    let miss = |r| if shared { OK } else { verdict(ctx, r, SHOT) };
    let Some(cfg) = maps::config() else {
        return miss(reason::DROP_NOT_READY);
    };
    let q_ip = s.ip6.l4 + ICMP_HDR_LEN;
    if s.ip6.end - s.ip6.l4 < ICMP_HDR_LEN + IP6_HDR_LEN + QUOTED_L4_LEN {
        return miss(reason::DROP_ICMP_QUOTE);
    }
    let Ok(fixed) = ctx.load::<[u8; 8]>(q_ip) else {
        return miss(reason::DROP_ICMP_QUOTE);
    };
    // The quoted source (this egress IP) and destination become the reply key's
    // destination and source.
    if fixed[0] >> 4 != 6
        || !parse6::load16(ctx, q_ip + Q6_SRC_OFF, &mut s.ct6.key.dst)
        || !parse6::load16(ctx, q_ip + Q6_DST_OFF, &mut s.ct6.key.src)
        || s.ct6.key.dst != s.ip6.dst
    {
        return miss(reason::DROP_ICMP_QUOTE);
    }
    // The transport header right behind the quoted header: extension headers are not
    // walked (an unknown next header is refused like one).
    let Some(q) = quoted_l4(ctx, fixed[6], q_ip + IP6_HDR_LEN) else {
        return miss(reason::DROP_ICMP_QUOTE);
    };
    s.ct6.key.src_port_be = q.dport_be;
    s.ct6.key.dst_port_be = q.sport_be;
    s.ct6.key.proto = q.proto;
    s.ct6.key.dir = dir::REPLY;
    s.ct6.key._pad = [0; 2];
    let Some(e) = v6::peek_in(&s.ct6.key, conntrack::now(), &mut s.ct6.peer) else {
        return miss(reason::DROP_ICMP_UNKNOWN_FLOW);
    };
    if s.ip6.hop_limit <= 1 {
        return verdict(ctx, reason::DROP_TTL_EXCEEDED, SHOT);
    }
    let csum = s.ip6.l4 + ICMP_CSUM_OFF;
    if rewrite::replace_addr6(
        ctx,
        csum,
        0,
        false,
        q_ip + Q6_SRC_OFF,
        &s.ct6.key.dst,
        &e.xlate_addr,
    )
    .is_err()
        || rewrite::rewrite_port(ctx, csum, 0, q.port_off, q.sport_be, e.xlate_port_be).is_err()
        || rewrite::replace_addr6(ctx, csum, 0, true, IP6_DST_OFF, &s.ip6.dst, &e.xlate_addr)
            .is_err()
        || rewrite::dec_hop_limit(ctx, &s.ip6).is_err()
    {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    }
    count(ctx, reason::ICMP_ERROR_XLATED);
    // No MSS to clamp (`NO_L4`), zeroed word by word: a plain store of zeros becomes a
    // `memset` call.
    // SAFETY: all-zero is a valid `L4`.
    unsafe { crate::mem::zero(&mut s.l4) };
    back::send6(ctx, cfg, s, &e.xlate_addr, underlay::pod_node6(e))
}
