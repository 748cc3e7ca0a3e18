//! The TCP RST that answers a segment, made of the segment itself, in place: what the
//! gateway sends a pod whose flow it cannot carry (`gateway`). Formed as RFC 793 and
//! Linux's `tcp_v4_send_reset` form it: addresses and ports swapped; a segment with ACK
//! is answered by RST with seq = its ack number (the pod's `rcv_nxt`: accepted at once,
//! RFC 5961), one without by RST+ACK with seq 0 and ack = its seq + length. Its options
//! and payload are cut off (`bpf_skb_change_tail`, which also drops GSO); the IP header
//! keeps its options, its ID and TTL (so a CHECKSUM_PARTIAL packet's checksum start stays
//! where it was).
//!
//! The RST goes the way a reply goes: back through the tunnel to the pod's node
//! (`RETURN_VNI`), or, for a pod on this node, back out of its device. It is made and
//! sent from the entry point's frame ([`deferred4`], [`deferred6`]): the gateway path
//! that decides on it runs a frame or three deep under large ones, and the verifier allows
//! 512 bytes for all the frames of a call chain. The gateway path leaves what the RST
//! needs in the per-CPU scratch slot and returns [`RESET`]; the RST's temporaries live
//! there too.
//!
//! The TCP checksum must come out right in whichever checksum state the skb is, and a
//! program cannot see that state. Two updates of the field do it: the pseudo-header's
//! length change, which the kernel applies in every state (for CHECKSUM_PARTIAL the field
//! holds the pseudo-header sum, which the device completes), then the step from what the
//! field holds to the RST's full checksum, computed here from scratch, as a plain update,
//! which the kernel skips for CHECKSUM_PARTIAL.

use aya_ebpf::{
    bindings::{BPF_F_PSEUDO_HDR, bpf_tunnel_key},
    helpers::generated::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use egress_common::{config::Config, counters::reason, policy::RETURN_VNI};

use crate::{
    answer,
    counters::{SHOT, verdict},
    handoff::TcpHdr,
    maps,
    parse::{
        ETH_LEN, IP_CSUM_OFF, IP_SRC_OFF, IP6_DST_OFF, IP6_HDR_LEN, IP6_SRC_OFF, Ipv4, L4,
        PROTO_TCP, TCP_ACK, TCP_FIN, TCP_RST,
    },
    parse6::Ipv6,
    rewrite::{Result, WriteFailed, ok},
    scratch::{self, Scratch},
    tunnel,
    underlay::{self, Words},
};

/// What a gateway path returns for a segment to answer with a RST: not a TC verdict (nor
/// `gateway`'s `TRANSLATED`). What the RST needs is in the scratch slot: for IPv4 in
/// `segment4`, for IPv6 in `ip6`, `l4` and `x6.origin`, where the IPv6 paths keep them
/// anyway.
pub const RESET: i32 = i32::MIN + 1;

/// The verdict of an IPv4 path that may reach the gateway path and returned `v`: `v`
/// itself, or, for [`RESET`], that of the RST, and for `answer::ANSWER` that of the ICMP
/// error, made and sent from the caller's frame (an entry point's).
#[inline(always)]
pub fn deferred4(ctx: &TcContext, v: i32) -> i32 {
    if v == RESET {
        reset4(ctx)
    } else {
        answer::deferred4(ctx, v)
    }
}

/// [`deferred4`] for IPv6.
#[inline(always)]
pub fn deferred6(ctx: &TcContext, v: i32) -> i32 {
    if v == RESET {
        reset6(ctx)
    } else {
        answer::deferred6(ctx, v)
    }
}

/// The node's configuration and the scratch slot an answer is made from, or the verdict
/// without them.
#[inline(always)]
pub fn slots(
    ctx: &TcContext,
) -> core::result::Result<(&'static Config, &'static mut Scratch), i32> {
    let Some(cfg) = maps::config() else {
        return Err(verdict(ctx, reason::DROP_NOT_READY, SHOT));
    };
    let Some(s) = scratch::scratch() else {
        return Err(verdict(ctx, reason::DROP_MALFORMED, SHOT));
    };
    Ok((cfg, s))
}

#[inline(never)]
fn reset4(ctx: &TcContext) -> i32 {
    let (cfg, s) = match slots(ctx) {
        Ok(x) => x,
        Err(v) => return v,
    };
    let seg = &s.segment4;
    if tcp_rst4(ctx, &seg.ip, &seg.l4, &mut s.rst).is_err() {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    }
    let rst = rst_at(seg.ip.l4, tunnel::IP4_HDR_LEN);
    let node = Words::of(&seg.pod_node);
    send_back(ctx, cfg, &rst, &mut s.tunnel, node, reason::RESET_MIDSTREAM)
}

#[inline(never)]
fn reset6(ctx: &TcContext) -> i32 {
    let (cfg, s) = match slots(ctx) {
        Ok(x) => x,
        Err(v) => return v,
    };
    if tcp_rst6(ctx, &s.ip6, &s.l4, &mut s.rst).is_err() {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    }
    let rst = rst_at(s.ip6.l4, tunnel::IP6_HDR_LEN);
    let node = underlay::origin(&s.x6.origin);
    send_back(ctx, cfg, &rst, &mut s.tunnel, node, reason::RESET_MIDSTREAM)
}

/// An answer made of a pod's packet, as the tunnel must know it: its protocol, its TCP
/// flags (a RST's: no MSS to clamp; said with constants, the clamp is compiled out), its
/// transport header's offset and its IP header's length.
pub struct Answer {
    pub proto: u8,
    pub tcp_flags: u8,
    pub l4_off: usize,
    pub ip_hdr_len: u16,
}

/// The RST at `l4_off` behind an IP header of `ip_hdr_len`.
#[inline(always)]
fn rst_at(l4_off: usize, ip_hdr_len: u16) -> Answer {
    Answer {
        proto: PROTO_TCP,
        tcp_flags: TCP_RST,
        l4_off,
        ip_hdr_len,
    }
}

/// Send an answer made of a pod's packet (a RST, an ICMP error) back to the pod on
/// `pod_node`, counted `sent`: out of the device it came from for a pod of this node,
/// else through the tunnel with `RETURN_VNI` (the tunnel key built in `key`).
#[inline(always)]
pub fn send_back(
    ctx: &TcContext,
    cfg: &Config,
    a: &Answer,
    key: &mut bpf_tunnel_key,
    pod_node: Words,
    sent: u32,
) -> i32 {
    if pod_node == underlay::node_ip(cfg) {
        return match back_out(ctx) {
            Ok(v) => verdict(ctx, sent, v),
            Err(_) => verdict(ctx, reason::DROP_MALFORMED, SHOT),
        };
    }
    let l4 = L4 {
        sport_be: 0,
        dport_be: 0,
        tcp_flags: a.tcp_flags,
        tcp_hdr_len: if a.proto == PROTO_TCP { RST_LEN } else { 0 },
    };
    let inner = tunnel::Inner {
        proto: a.proto,
        l4_off: a.l4_off,
        l4: &l4,
        ip_hdr_len: a.ip_hdr_len,
    };
    tunnel::enter_with(ctx, cfg, &inner, key, pod_node, RETURN_VNI, sent)
}

/// The RST's TCP header: no options.
const RST_LEN: usize = 20;
/// Offset of the checksum in the TCP header.
const CHECK_OFF: usize = 16;
const IP_TOT_LEN_OFF: usize = ETH_LEN + 2;
const IP6_PAYLOAD_LEN_OFF: usize = ETH_LEN + 4;

/// Turn `h`, the header of a segment with `flags` and `payload` bytes of data, into the
/// header of the RST that answers it. The checksum field keeps its value.
#[inline(always)]
fn answer(h: &mut TcpHdr, flags: u8, payload: u32) {
    core::mem::swap(&mut h.sport, &mut h.dport);
    if flags & TCP_ACK != 0 {
        h.seq = h.ack;
        h.ack = 0;
        h.off_flags = [0x50, TCP_RST];
    } else {
        let fin = u32::from(flags & TCP_FIN != 0);
        h.ack = u32::from_be(h.seq)
            .wrapping_add(payload)
            .wrapping_add(fin)
            .to_be();
        h.seq = 0;
        h.off_flags = [0x50, TCP_RST | TCP_ACK];
    }
    h.window = 0;
    h.urg = 0;
}

/// Cut the packet after the RST's header (when there is anything behind it).
#[inline(always)]
fn trim(ctx: &TcContext, l4_off: usize) -> Result {
    let len = (l4_off + RST_LEN) as u32;
    if ctx.len() == len {
        return Ok(());
    }
    // SAFETY: the context's skb is valid for the program's run.
    match unsafe { bpf_skb_change_tail(ctx.skb.skb, len, 0) } {
        0 => Ok(()),
        _ => Err(WriteFailed),
    }
}

/// The 16-bit words of `b` (as they sit in memory) summed, unfolded.
#[inline(always)]
pub fn sum<const N: usize>(b: &[u8; N]) -> u32 {
    let mut s = 0u32;
    for i in 0..N / 2 {
        s += u32::from(u16::from_ne_bytes([b[2 * i], b[2 * i + 1]]));
    }
    s
}

/// `s` folded to 16 bits, ones'-complement (the end-around carry added back).
#[inline(always)]
pub fn fold(s: u32) -> u16 {
    let s = (s & 0xffff) + (s >> 16);
    ((s & 0xffff) + (s >> 16)) as u16
}

/// The words of a header, its checksum field counted as zero.
#[inline(always)]
fn header_sum(h: &TcpHdr) -> u32 {
    u32::from(h.sport)
        + u32::from(h.dport)
        + (h.seq & 0xffff)
        + (h.seq >> 16)
        + (h.ack & 0xffff)
        + (h.ack >> 16)
        + u32::from(u16::from_ne_bytes(h.off_flags))
        + u32::from(h.window)
        + u32::from(h.urg)
}

/// Make the checksum of the RST header `h` (at `l4_off`) right in every checksum state:
/// see the module's documentation. `old_len` is the segment's TCP length (header and
/// data), `addrs` the sum of the addresses' words.
#[inline(always)]
fn set_checksum(ctx: &TcContext, l4_off: usize, old_len: u32, addrs: u32, h: &TcpHdr) -> Result {
    let off = l4_off + CHECK_OFF;
    ok(ctx.l4_csum_replace(
        off,
        u64::from(old_len.to_be()),
        u64::from((RST_LEN as u32).to_be()),
        u64::from(BPF_F_PSEUDO_HDR) | 4,
    ))?;
    let field: u16 = ctx.load(off).map_err(|_| WriteFailed)?;
    // The pseudo-header's protocol and length words are the same for both families
    // (IPv6 widens both to 32 bits with zeros).
    let pseudo = u32::from(u16::from_ne_bytes([0, PROTO_TCP]))
        + u32::from(u16::from_ne_bytes([0, RST_LEN as u8]));
    let s = fold(addrs + pseudo + header_sum(h));
    // The checksum is !s; the helper takes the field to it by the difference (!field
    // removed, !s added, in ones' complement: s + field).
    ok(ctx.l4_csum_replace(off, 0, u64::from(u32::from(s) + u32::from(field)), 0))
}

/// Read the TCP header at `off` into `h` and turn it into the RST's.
#[inline(always)]
fn load_answer(ctx: &TcContext, off: usize, l4: &L4, tcp_len: usize, h: &mut TcpHdr) -> Result {
    *h = ctx.load(off).map_err(|_| WriteFailed)?;
    answer(h, l4.tcp_flags, (tcp_len - l4.tcp_hdr_len) as u32);
    Ok(())
}

/// Turn the IPv4 TCP segment (`ip`, `l4`) into the RST that answers it, from its
/// destination to its source; its header is built in `h`.
#[inline(always)]
fn tcp_rst4(ctx: &TcContext, ip: &Ipv4, l4: &L4, h: &mut TcpHdr) -> Result {
    let ip_hdr_len = ip.l4 - ETH_LEN;
    let tcp_len = usize::from(ip.tot_len) - ip_hdr_len;
    load_answer(ctx, ip.l4, l4, tcp_len, h)?;
    trim(ctx, ip.l4)?;
    ok(ctx.store(ip.l4, h, 0))?;
    // Swapped addresses change neither the header checksum nor the pseudo-header's sum.
    ok(ctx.store(IP_SRC_OFF, &ip.dst, 0))?;
    ok(ctx.store(IP_SRC_OFF + 4, &ip.src, 0))?;
    // As the header says it (a BIG TCP segment's says 0, not `ip.tot_len`).
    let old_tot: u16 = ctx.load(IP_TOT_LEN_OFF).map_err(|_| WriteFailed)?;
    let new_tot = ((ip_hdr_len + RST_LEN) as u16).to_be();
    ok(ctx.l3_csum_replace(IP_CSUM_OFF, u64::from(old_tot), u64::from(new_tot), 2))?;
    ok(ctx.store(IP_TOT_LEN_OFF, &new_tot, 0))?;
    set_checksum(ctx, ip.l4, tcp_len as u32, sum(&ip.src) + sum(&ip.dst), h)
}

/// [`tcp_rst4`] for IPv6 (extension headers are kept, as IP options are).
#[inline(always)]
fn tcp_rst6(ctx: &TcContext, ip: &Ipv6, l4: &L4, h: &mut TcpHdr) -> Result {
    let tcp_len = ip.end - ip.l4;
    load_answer(ctx, ip.l4, l4, tcp_len, h)?;
    trim(ctx, ip.l4)?;
    ok(ctx.store(ip.l4, h, 0))?;
    ok(ctx.store(IP6_SRC_OFF, &ip.dst, 0))?;
    ok(ctx.store(IP6_DST_OFF, &ip.src, 0))?;
    let payload_len = ((ip.l4 - ETH_LEN - IP6_HDR_LEN + RST_LEN) as u16).to_be();
    ok(ctx.store(IP6_PAYLOAD_LEN_OFF, &payload_len, 0))?;
    set_checksum(ctx, ip.l4, tcp_len as u32, sum(&ip.src) + sum(&ip.dst), h)
}

/// Send the packet back out of the device it arrived on, its Ethernet addresses swapped:
/// the answer a pod on this gateway gets, the way its own gateway would send it (no route
/// to look up: the pod is behind that device).
#[inline(always)]
fn back_out(ctx: &TcContext) -> Result<i32> {
    let macs: [[u8; 6]; 2] = ctx.load(0).map_err(|_| WriteFailed)?;
    ok(ctx.store(0, &[macs[1], macs[0]], 0))?;
    // SAFETY: a plain helper call on the program's own skb.
    Ok(unsafe { bpf_redirect(crate::fib::ingress_ifindex(ctx), 0) } as i32)
}
