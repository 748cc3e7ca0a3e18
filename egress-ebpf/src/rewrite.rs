//! Packet rewrites with incremental checksum updates: addresses, ports, TTL, MSS, MACs.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::generated::bpf_csum_diff,
    programs::TcContext,
};

use crate::{
    parse::{
        IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF, IP_TTL_OFF, IP6_DST_OFF, IP6_HOP_LIMIT_OFF,
        IP6_SRC_OFF, Ipv4, L4, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
    },
    parse6::Ipv6,
};

/// `BPF_F_IPV6` (Linux 6.16): tells `bpf_l4_csum_replace` that the pseudo-header change
/// sits in an IPv6 header, so a CHECKSUM_COMPLETE `skb->csum` is left alone (no IPv4
/// header checksum compensates the address change). Older kernels refuse the flag, and
/// the call is then repeated without it.
const BPF_F_IPV6: u64 = 1 << 7;
const EINVAL: i64 = 22;

/// Failed to write the packet (the skb could not be made writable).
pub struct WriteFailed;

pub type Result<T = ()> = core::result::Result<T, WriteFailed>;

/// A helper's result as a [`Result`].
pub fn ok(r: core::result::Result<(), i64>) -> Result {
    r.map_err(|_| WriteFailed)
}

/// Offset of the transport checksum, and the flags its updates need.
#[inline(always)]
fn l4_csum(proto: u8, l4_off: usize) -> (usize, u64) {
    match proto {
        PROTO_TCP => (l4_off + 16, 0),
        // A zero UDP checksum means "none": keep it zero, and never produce zero.
        PROTO_UDP => (l4_off + 6, u64::from(BPF_F_MARK_MANGLED_0)),
        // ICMP and ICMPv6.
        _ => (l4_off + 2, 0),
    }
}

/// Replace one IPv4 address (at `addr_off`) and the port at `port_off`.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the old and new value of each field; a struct would only rename them"
)]
fn rewrite_addr_port(
    ctx: &TcContext,
    ip: &Ipv4,
    addr_off: usize,
    old_addr: [u8; 4],
    new_addr: [u8; 4],
    port_off: usize,
    old_port_be: u16,
    new_port_be: u16,
) -> Result {
    let (csum_off, extra) = l4_csum(ip.proto, ip.l4);
    let old_a = u64::from(u32::from_ne_bytes(old_addr));
    let new_a = u64::from(u32::from_ne_bytes(new_addr));
    if old_addr != new_addr {
        // ICMP has no pseudo-header: only the IP header checksum sees the address.
        if ip.proto != PROTO_ICMP {
            ok(ctx.l4_csum_replace(
                csum_off,
                old_a,
                new_a,
                u64::from(BPF_F_PSEUDO_HDR) | extra | 4,
            ))?;
        }
        ok(ctx.l3_csum_replace(IP_CSUM_OFF, old_a, new_a, 4))?;
        ok(ctx.store(addr_off, &new_addr, 0))?;
    }
    rewrite_port(ctx, csum_off, extra, port_off, old_port_be, new_port_be)
}

/// Replace the 16-bit field at `port_off` (a port, an ICMP identifier), updating the
/// checksum at `csum_off` with `extra` flags (0 for a field the checksum covers as data).
#[inline(always)]
pub fn rewrite_port(
    ctx: &TcContext,
    csum_off: usize,
    extra: u64,
    port_off: usize,
    old_port_be: u16,
    new_port_be: u16,
) -> Result {
    if old_port_be != new_port_be {
        ok(ctx.l4_csum_replace(
            csum_off,
            u64::from(old_port_be),
            u64::from(new_port_be),
            extra | 2,
        ))?;
        ok(ctx.store(port_off, &new_port_be, 0))?;
    }
    Ok(())
}

/// Replace the IPv4 address at `addr_off`, covered by the header checksum at `csum_off`:
/// the outer header's, or that of a header quoted in an ICMP error (whose own checksum
/// then changes by as much as the address, the opposite way, so that the ICMP checksum
/// over both stays right as it is).
#[inline(always)]
pub fn replace_addr4(
    ctx: &TcContext,
    csum_off: usize,
    addr_off: usize,
    old: [u8; 4],
    new: [u8; 4],
) -> Result {
    let o = u64::from(u32::from_ne_bytes(old));
    let n = u64::from(u32::from_ne_bytes(new));
    ok(ctx.l3_csum_replace(csum_off, o, n, 4))?;
    ok(ctx.store(addr_off, &new, 0))
}

/// Which side of an IPv4 packet [`nat4`] translates.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Source address and port (SNAT of a packet going out).
    Source,
    /// Destination address and port (a reply translated back).
    Destination,
}

/// Translate `side` of an IPv4 packet to `addr` and the pod-side port (or ICMP echo
/// identifier) `port_be`, decrement the TTL (the caller has checked that it is above
/// one), and write the Ethernet addresses `macs` (destination, source) when given:
/// in place where the packet allows ([`nat4_direct`]), else through the helpers.
#[inline(always)]
pub fn nat4(
    ctx: &TcContext,
    ip: &Ipv4,
    l4: &L4,
    side: Side,
    addr: [u8; 4],
    port_be: u16,
    macs: Option<(&[u8; 6], &[u8; 6])>,
) -> Result {
    if nat4_direct(ctx, ip, side, addr, port_be, macs)? {
        return Ok(());
    }
    // TCP/UDP ports at +0 (source) and +2 (destination); the ICMP echo identifier at +4
    // either way, and in whichever of `sport_be` (a request) and `dport_be` (a reply)
    // holds it, the other 0.
    let icmp = ip.proto == PROTO_ICMP;
    let (addr_off, old_addr, port_off, old_port_be) = match side {
        Side::Source => (
            IP_SRC_OFF,
            ip.src,
            if icmp { ip.l4 + 4 } else { ip.l4 },
            if icmp {
                l4.sport_be | l4.dport_be
            } else {
                l4.sport_be
            },
        ),
        Side::Destination => (
            IP_DST_OFF,
            ip.dst,
            if icmp { ip.l4 + 4 } else { ip.l4 + 2 },
            if icmp {
                l4.sport_be | l4.dport_be
            } else {
                l4.dport_be
            },
        ),
    };
    // Through the helpers: any IPv4 packet (IP options, ICMP echo, headers outside the
    // linear part).
    rewrite_addr_port(
        ctx,
        ip,
        addr_off,
        old_addr,
        addr,
        port_off,
        old_port_be,
        port_be,
    )?;
    dec_ttl(ctx, ip)?;
    match macs {
        Some((dst, src)) => set_macs(ctx, dst, src),
        None => Ok(()),
    }
}

/// One's complement sum of 16-bit words folded to 16 bits.
#[inline(always)]
fn fold(mut s: u32) -> u32 {
    s = (s & 0xffff) + (s >> 16);
    (s & 0xffff) + (s >> 16)
}

/// The checksum difference of replacing the 32-bit `old` by `new` (RFC 1624: add the
/// complement of each old 16-bit word and each new one), folded, as
/// `bpf_l4_csum_replace` takes it with size 0.
#[inline(always)]
fn diff32(old: u32, new: u32) -> u32 {
    fold((!old & 0xffff) + (!old >> 16) + (new & 0xffff) + (new >> 16))
}

/// Where a direct translation writes: the start of the packet, the transport checksum's
/// offset and its update flags, the offsets of the translated address and port.
struct Direct {
    start: usize,
    csum_off: usize,
    extra: u64,
    addr_off: usize,
    port_off: usize,
}

/// [`Direct`] for a TCP or UDP packet whose transport header sits at `L4_OFF` (no IP
/// options or extension headers) and whose headers through the TCP checksum are in the
/// linear part of the skb; `None` for any other. `SRC_OFF`, `DST_OFF`: the addresses'
/// offsets. Every offset is a constant the verifier checks against one bound.
#[inline(always)]
fn direct<const L4_OFF: usize, const SRC_OFF: usize, const DST_OFF: usize>(
    ctx: &TcContext,
    proto: u8,
    l4: usize,
    side: Side,
) -> Option<Direct> {
    let (csum_at, extra) = match proto {
        PROTO_TCP => (16, 0),
        PROTO_UDP => (6, u64::from(BPF_F_MARK_MANGLED_0)),
        _ => return None,
    };
    if l4 != L4_OFF {
        return None;
    }
    let (addr_off, port_off) = match side {
        Side::Source => (SRC_OFF, L4_OFF),
        Side::Destination => (DST_OFF, L4_OFF + 2),
    };
    let start = ctx.data();
    // Through the TCP checksum (the UDP header is within it too).
    if start + L4_OFF + 18 > ctx.data_end() {
        return None;
    }
    Some(Direct {
        start,
        csum_off: L4_OFF + csum_at,
        extra,
        addr_off,
        port_off,
    })
}

/// [`nat4`] for a TCP or UDP packet whose headers sit in the linear part of the skb
/// without IP options (every packet the lab sends): the address, the port and the TTL
/// are written in place, the IP header checksum is updated once for all three (RFC
/// 1624), and the transport checksum by one `bpf_l4_csum_replace` for the address (and
/// one more only when the port changes). The helper stays for the transport checksum
/// because the program cannot see `skb->ip_summed`: a CHECKSUM_PARTIAL skb (GSO TCP)
/// holds the pseudo-header sum there, which a port change must not touch, and a
/// CHECKSUM_COMPLETE one needs `skb->csum` adjusted; the helper knows which.
///
/// `Ok(false)`, with nothing written, for any other packet: the caller then uses the
/// helpers. Replaces eight helper calls (two loads, three stores, three checksum updates)
/// by one or two.
#[inline(always)]
fn nat4_direct(
    ctx: &TcContext,
    ip: &Ipv4,
    side: Side,
    addr: [u8; 4],
    port_be: u16,
    macs: Option<(&[u8; 6], &[u8; 6])>,
) -> Result<bool> {
    // No IP options.
    let Some(d) = direct::<{ IP_SRC_OFF + 8 }, IP_SRC_OFF, IP_DST_OFF>(ctx, ip.proto, ip.l4, side)
    else {
        return Ok(false);
    };
    let (addr_off, port_off, csum_off, extra) = (d.addr_off, d.port_off, d.csum_off, d.extra);
    let at = |off: usize| (d.start + off) as *mut u8;
    // SAFETY: every access is within the bytes `direct` checked against `data_end`; packet
    // memory is writable (the verifier unclones a cloned skb in the program's prologue).
    let (old_addr, old_port, ttl_word) = unsafe {
        (
            core::ptr::read_unaligned(at(addr_off) as *const u32),
            core::ptr::read_unaligned(at(port_off) as *const u16),
            core::ptr::read_unaligned(at(IP_TTL_OFF) as *const u16),
        )
    };
    let new_addr = u32::from_ne_bytes(addr);
    // TTL and protocol form one 16-bit word (byte order as in the packet).
    let new_ttl_word = u16::from_ne_bytes([ip.ttl - 1, ip.proto]);
    unsafe {
        if let Some((dst, src)) = macs {
            write_macs(at(0), dst, src);
        }
        let hc = u32::from(core::ptr::read_unaligned(at(IP_CSUM_OFF) as *const u16));
        let sum = (!hc & 0xffff)
            + diff32(old_addr, new_addr)
            + (u32::from(!ttl_word))
            + u32::from(new_ttl_word);
        core::ptr::write_unaligned(at(IP_CSUM_OFF) as *mut u16, !(fold(sum) as u16));
        core::ptr::write_unaligned(at(IP_TTL_OFF), ip.ttl - 1);
        core::ptr::write_unaligned(at(addr_off) as *mut u32, new_addr);
        core::ptr::write_unaligned(at(port_off) as *mut u16, port_be);
    }
    // Packet pointers are stale from here (the helper may move the data).
    if old_addr != new_addr {
        ok(ctx.l4_csum_replace(
            csum_off,
            0,
            u64::from(diff32(old_addr, new_addr)),
            u64::from(BPF_F_PSEUDO_HDR) | extra,
        ))?;
    }
    if old_port != port_be {
        ok(ctx.l4_csum_replace(csum_off, u64::from(old_port), u64::from(port_be), extra | 2))?;
    }
    Ok(true)
}

/// Write the Ethernet addresses at `frame`, the start of the packet, as words: a 6-byte
/// array write becomes a byte-loop `memmove` call.
///
/// # Safety
///
/// `frame` must point at 12 writable bytes of packet, checked against `data_end`.
#[inline(always)]
unsafe fn write_macs(frame: *mut u8, dst: &[u8; 6], src: &[u8; 6]) {
    let w32 = |m: &[u8; 6], i: usize| u32::from_ne_bytes([m[i], m[i + 1], m[i + 2], m[i + 3]]);
    let w16 = |m: &[u8; 6], i: usize| u16::from_ne_bytes([m[i], m[i + 1]]);
    unsafe {
        core::ptr::write_unaligned(frame as *mut u32, w32(dst, 0));
        core::ptr::write_unaligned(frame.add(4) as *mut u16, w16(dst, 4));
        core::ptr::write_unaligned(frame.add(6) as *mut u16, w16(src, 0));
        core::ptr::write_unaligned(frame.add(8) as *mut u32, w32(src, 2));
    }
}

/// Decrement the TTL by one. The caller has checked that it is above one.
#[inline(always)]
pub fn dec_ttl(ctx: &TcContext, ip: &Ipv4) -> Result {
    // TTL and protocol form one 16-bit word of the header checksum.
    let old: u16 = ctx.load(IP_TTL_OFF).map_err(|_| WriteFailed)?;
    let new = u16::from_ne_bytes([ip.ttl - 1, ip.proto]);
    ok(ctx.l3_csum_replace(IP_CSUM_OFF, u64::from(old), u64::from(new), 2))?;
    ok(ctx.store(IP_TTL_OFF, &(ip.ttl - 1), 0))
}

/// Replace one IPv6 address (at `addr_off`) and the port at `port_off`. IPv6 has no
/// header checksum; TCP, UDP and ICMPv6 all cover the address in their pseudo-header, so
/// the transport checksum takes the difference of the two addresses in one update.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the old and new value of each field; a struct would only rename them"
)]
fn rewrite_addr6_port(
    ctx: &TcContext,
    ip: &Ipv6,
    addr_off: usize,
    old_addr: &[u8; 16],
    new_addr: &[u8; 16],
    port_off: usize,
    old_port_be: u16,
    new_port_be: u16,
) -> Result {
    let (csum_off, extra) = l4_csum(ip.proto, ip.l4);
    if old_addr != new_addr {
        replace_addr6(ctx, csum_off, extra, true, addr_off, old_addr, new_addr)?;
    }
    rewrite_port(ctx, csum_off, extra, port_off, old_port_be, new_port_be)
}

/// Replace the IPv6 address at `addr_off`, which the transport checksum at `csum_off`
/// covers in its pseudo-header (`pseudo`: an address of the packet's own header) or as
/// data (an address of a header quoted in an ICMPv6 error).
#[inline(always)]
pub fn replace_addr6(
    ctx: &TcContext,
    csum_off: usize,
    extra: u64,
    pseudo: bool,
    addr_off: usize,
    old_addr: &[u8; 16],
    new_addr: &[u8; 16],
) -> Result {
    if pseudo {
        pseudo_diff6(ctx, csum_off, extra, old_addr, new_addr)?;
    } else {
        let diff = csum_diff16(old_addr, new_addr)?;
        ok(ctx.l4_csum_replace(csum_off, 0, diff, extra))?;
    }
    ok(ctx.store(addr_off, new_addr, 0))
}

/// The checksum difference of replacing the 16 bytes `old` by `new` (`bpf_csum_diff`).
#[inline(always)]
fn csum_diff16(old: &[u8; 16], new: &[u8; 16]) -> Result<u64> {
    // SAFETY: both buffers are 16 readable bytes; the helper only reads them.
    let diff = unsafe {
        bpf_csum_diff(
            old.as_ptr() as *mut u32,
            16,
            new.as_ptr() as *mut u32,
            16,
            0,
        )
    };
    if diff < 0 {
        return Err(WriteFailed);
    }
    Ok(diff as u64)
}

/// Update the transport checksum at `csum_off` for an address of the packet's own IPv6
/// header changed from `old` to `new` (a pseudo-header field).
#[inline(always)]
fn pseudo_diff6(
    ctx: &TcContext,
    csum_off: usize,
    extra: u64,
    old: &[u8; 16],
    new: &[u8; 16],
) -> Result {
    let diff = csum_diff16(old, new)?;
    // Size 0: `to` is a checksum difference, not a 16/32-bit field.
    let flags = u64::from(BPF_F_PSEUDO_HDR) | extra;
    if let Err(e) = ctx.l4_csum_replace(csum_off, 0, diff, flags | BPF_F_IPV6) {
        if e != -EINVAL {
            return Err(WriteFailed);
        }
        ok(ctx.l4_csum_replace(csum_off, 0, diff, flags))?;
    }
    Ok(())
}

/// Offset of the pod-side port (or ICMPv6 echo identifier) of a packet going out
/// (`source`) or coming back.
#[inline(always)]
fn port_off6(ip: &Ipv6, source: bool) -> usize {
    if ip.proto == PROTO_ICMPV6 {
        ip.l4 + 4
    } else if source {
        ip.l4
    } else {
        ip.l4 + 2
    }
}

/// Translate `side` of an IPv6 packet to `addr` and the pod-side port (or ICMPv6 echo
/// identifier) `port_be` (NAT66), decrement the hop limit (the caller has checked that it
/// is above one), and write the Ethernet addresses `macs` (destination, source) when
/// given: in place where the packet allows ([`nat6_direct`]), else through the helpers.
#[inline(always)]
pub fn nat6(
    ctx: &TcContext,
    ip: &Ipv6,
    l4: &L4,
    side: Side,
    addr: &[u8; 16],
    port_be: u16,
    macs: Option<(&[u8; 6], &[u8; 6])>,
) -> Result {
    if nat6_direct(ctx, ip, side, addr, port_be, macs)? {
        return Ok(());
    }
    // Through the helpers: extension headers, ICMPv6 echo, headers outside the linear
    // part.
    // An ICMPv6 echo identifier is in `sport_be` (a request) or `dport_be` (a reply).
    let echo = ip.proto == PROTO_ICMPV6;
    let (addr_off, old_addr, old_port_be) = match side {
        Side::Source if echo => (IP6_SRC_OFF, &ip.src, l4.sport_be | l4.dport_be),
        Side::Source => (IP6_SRC_OFF, &ip.src, l4.sport_be),
        Side::Destination if echo => (IP6_DST_OFF, &ip.dst, l4.sport_be | l4.dport_be),
        Side::Destination => (IP6_DST_OFF, &ip.dst, l4.dport_be),
    };
    rewrite_addr6_port(
        ctx,
        ip,
        addr_off,
        old_addr,
        addr,
        port_off6(ip, side == Side::Source),
        old_port_be,
        port_be,
    )?;
    dec_hop_limit(ctx, ip)?;
    match macs {
        Some((dst, src)) => set_macs(ctx, dst, src),
        None => Ok(()),
    }
}

/// [`nat6`] for a TCP or UDP packet without extension headers whose headers sit in the
/// linear part of the skb (every packet the lab sends): the address, the port, the hop
/// limit and the MACs are written in place; the transport checksum is updated by one
/// `bpf_l4_csum_replace` for the address (its difference from `bpf_csum_diff`) and one
/// more only when the port changes, for the reasons given at [`nat4_direct`]. IPv6 has
/// no header checksum.
///
/// `Ok(false)`, with nothing written, for any other packet: the caller then uses the
/// helpers. Replaces eight helper calls by two or three.
#[inline(always)]
fn nat6_direct(
    ctx: &TcContext,
    ip: &Ipv6,
    side: Side,
    addr: &[u8; 16],
    port_be: u16,
    macs: Option<(&[u8; 6], &[u8; 6])>,
) -> Result<bool> {
    // No extension headers.
    let Some(d) =
        direct::<{ IP6_SRC_OFF + 32 }, IP6_SRC_OFF, IP6_DST_OFF>(ctx, ip.proto, ip.l4, side)
    else {
        return Ok(false);
    };
    let (addr_off, port_off, csum_off, extra) = (d.addr_off, d.port_off, d.csum_off, d.extra);
    let at = |off: usize| (d.start + off) as *mut u8;
    let old_addr = match side {
        Side::Source => &ip.src,
        Side::Destination => &ip.dst,
    };
    // SAFETY: every access is within the bytes `direct` checked against `data_end`; packet
    // memory is writable (the verifier unclones a cloned skb in the program's prologue).
    // The address is copied byte by byte: LLVM knows no alignment of packet memory, and
    // words assembled from bytes would spill registers onto a stack the IPv6 call chains
    // do not have.
    let old_port = unsafe {
        let old_port = core::ptr::read_unaligned(at(port_off) as *const u16);
        core::ptr::copy_nonoverlapping(addr.as_ptr(), at(addr_off), 16);
        if let Some((dst, src)) = macs {
            write_macs(at(0), dst, src);
        }
        core::ptr::write_unaligned(at(IP6_HOP_LIMIT_OFF), ip.hop_limit - 1);
        core::ptr::write_unaligned(at(port_off) as *mut u16, port_be);
        old_port
    };
    // Packet pointers are stale from here (the helper may move the data).
    if old_addr != addr {
        pseudo_diff6(ctx, csum_off, extra, old_addr, addr)?;
    }
    if old_port != port_be {
        ok(ctx.l4_csum_replace(csum_off, u64::from(old_port), u64::from(port_be), extra | 2))?;
    }
    Ok(true)
}

/// Decrement the hop limit by one (no header checksum in IPv6). The caller has checked
/// that it is above one.
#[inline(always)]
pub fn dec_hop_limit(ctx: &TcContext, ip: &Ipv6) -> Result {
    ok(ctx.store(IP6_HOP_LIMIT_OFF, &(ip.hop_limit - 1), 0))
}

/// Write the Ethernet addresses.
#[inline(always)]
pub fn set_macs(ctx: &TcContext, dst: &[u8; 6], src: &[u8; 6]) -> Result {
    ok(ctx.store(0, dst, 0))?;
    ok(ctx.store(6, src, 0))
}

const TCPOPT_EOL: u8 = 0;
const TCPOPT_NOP: u8 = 1;
const TCPOPT_MSS: u8 = 2;
/// At most 40 bytes of TCP options.
const MAX_OPT_STEPS: usize = 40;

/// Lower the MSS option of a SYN to `max_mss`. Returns whether the packet changed.
#[inline(always)]
pub fn clamp_mss(ctx: &TcContext, l4_off: usize, l4: &L4, max_mss: u16) -> Result<bool> {
    let opts_end = l4_off + l4.tcp_hdr_len;
    let mut off = l4_off + 20;
    for _ in 0..MAX_OPT_STEPS {
        if off >= opts_end {
            break;
        }
        let kind: u8 = ctx.load(off).map_err(|_| WriteFailed)?;
        match kind {
            TCPOPT_EOL => break,
            TCPOPT_NOP => off += 1,
            _ => {
                let len: u8 = ctx.load(off + 1).map_err(|_| WriteFailed)?;
                if len < 2 {
                    break;
                }
                if kind == TCPOPT_MSS && len == 4 && off + 4 <= opts_end {
                    let old_be: u16 = ctx.load(off + 2).map_err(|_| WriteFailed)?;
                    if u16::from_be(old_be) <= max_mss {
                        return Ok(false);
                    }
                    let new_be = max_mss.to_be();
                    ok(ctx.l4_csum_replace(l4_off + 16, u64::from(old_be), u64::from(new_be), 2))?;
                    ok(ctx.store(off + 2, &new_be, 0))?;
                    return Ok(true);
                }
                off += usize::from(len);
            }
        }
    }
    Ok(false)
}
