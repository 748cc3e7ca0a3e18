//! Every bounds-checked read of packet headers lives here. The ethertype, the IPv4 and
//! fixed IPv6 headers, an IPv6 source (`parse6::ipv6_src`) and the transport headers of
//! the fast paths are read in place when the linear part of the skb holds them (every frame a veth or the tunnel device hands over: [`read`]);
//! every other read, and these ones when the headers are not linear, goes through
//! `bpf_skb_load_bytes` (`TcContext::load`), which is correct for non-linear skbs too.

use core::mem::{MaybeUninit, size_of};

use aya_ebpf::{helpers::generated::bpf_skb_load_bytes, programs::TcContext};
use egress_common::counters::reason;
use network_types::{eth::EthHdr, ip::Ipv4Hdr, tcp::TcpHdr, udp::UdpHdr};

pub const ETH_LEN: usize = EthHdr::LEN;
/// Offset of the ethertype in the Ethernet header.
pub const ETH_TYPE_OFF: usize = 12;
pub const ETH_P_IP_BE: u16 = 0x0800u16.to_be();

pub const IP_TTL_OFF: usize = ETH_LEN + 8;
pub const IP_CSUM_OFF: usize = ETH_LEN + 10;
pub const IP_SRC_OFF: usize = ETH_LEN + 12;
pub const IP_DST_OFF: usize = ETH_LEN + 16;

/// The fixed IPv6 header's length and offsets (`parse6` walks what follows it).
pub const IP6_HDR_LEN: usize = 40;
pub const IP6_HOP_LIMIT_OFF: usize = ETH_LEN + 7;
pub const IP6_SRC_OFF: usize = ETH_LEN + 8;
pub const IP6_DST_OFF: usize = ETH_LEN + 24;

pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;

const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;
const ICMPV6_ECHO_REQUEST: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// Why a packet could not be parsed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Bad {
    /// Truncated or inconsistent headers.
    Malformed,
    /// A fragment: ports are not (all) there.
    Fragment,
    /// Not TCP, UDP or ICMP echo.
    Unsupported,
    /// IPv6 extension headers this datapath does not walk (too many, a routing header
    /// with segments left, or one of unknown length).
    ExtHeader,
}

impl Bad {
    /// The counter reason of a selected packet dropped for this.
    #[inline(always)]
    pub fn drop_reason(self) -> u32 {
        match self {
            Bad::Malformed => reason::DROP_MALFORMED,
            Bad::Fragment => reason::DROP_FRAGMENT,
            Bad::Unsupported => reason::DROP_UNSUPPORTED_PROTO,
            Bad::ExtHeader => reason::DROP_IPV6_EXT_HDR,
        }
    }
}

/// The IPv4 header fields the datapath uses. `l4` is the offset of the transport header
/// (IP options are skipped, not refused).
#[derive(Clone, Copy)]
pub struct Ipv4 {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub proto: u8,
    pub ttl: u8,
    pub fragment: bool,
    /// The "don't fragment" flag: a packet too big for its egress interface is answered
    /// with "fragmentation needed" only when it is set (`answer`).
    pub df: bool,
    pub l4: usize,
    /// The total length; of a BIG TCP (or GRO beyond 64 KiB) packet, whose header says 0
    /// (Linux's `skb_ip_totlen`, which the IPv4 stack accepts for a GSO packet), the
    /// skb's length, at most 65,535: its headers are read as any packet's. (A rewrite of
    /// the length field reads the header's.)
    pub tot_len: u16,
}

/// Transport fields. For ICMP echo the identifier stands in for the pod-side port: an
/// echo request carries it as `sport_be`, an echo reply as `dport_be` (the other is 0).
#[derive(Clone, Copy)]
pub struct L4 {
    pub sport_be: u16,
    pub dport_be: u16,
    /// TCP flags, 0 for other protocols.
    pub tcp_flags: u8,
    /// TCP data offset in bytes (0 for other protocols).
    pub tcp_hdr_len: usize,
}

/// The ethertype (network order), `None` for a frame too short to have one.
#[inline(always)]
pub fn ethertype(ctx: &TcContext) -> Option<u16> {
    read_with(ctx, ETH_TYPE_OFF, |t: &[u8; 2]| u16::from_ne_bytes(half(t))).ok()
}

/// The source address of an IPv4 packet, or `None` for anything else. The cheapest read
/// of the miss path: one ethertype and one address, by direct packet access when the
/// headers are in the linear part of the skb (always, for frames from a pod's veth),
/// else through `bpf_skb_load_bytes`.
#[inline(always)]
pub fn ipv4_src(ctx: &TcContext) -> Option<[u8; 4]> {
    let start = ctx.data();
    if start + IP_SRC_OFF + 4 > ctx.data_end() {
        let ethertype: u16 = ctx.load(ETH_TYPE_OFF).ok()?;
        if ethertype != ETH_P_IP_BE {
            return None;
        }
        return ctx.load::<[u8; 4]>(IP_SRC_OFF).ok();
    }
    // SAFETY: both reads are within [data, data_end), checked just above.
    let ethertype = half(unsafe { &*((start + ETH_TYPE_OFF) as *const [u8; 2]) });
    if u16::from_ne_bytes(ethertype) != ETH_P_IP_BE {
        return None;
    }
    Some(word(unsafe { &*((start + IP_SRC_OFF) as *const [u8; 4]) }))
}

/// Whether an IPv4 destination is the node's business, never a gateway's: link-local
/// 169.254.0.0/16 (NodeLocal DNSCache's 169.254.20.10, the clouds' metadata at
/// 169.254.169.254), multicast 224.0.0.0/4, class E 240.0.0.0/4 and the limited
/// broadcast. A `0.0.0.0/0` rule covers them by its prefix, not by intent; IPv6's
/// counterpart is `parse6::link_scoped`.
#[inline(always)]
pub fn link_scoped4(dst: [u8; 4]) -> bool {
    dst[0] >= 224 || (dst[0] == 169 && dst[1] == 254)
}

/// The transport header's offset in a packet without IP options, and in an IPv6 packet
/// without extension headers.
const L4_OFF_V4: usize = ETH_LEN + Ipv4Hdr::LEN;
const L4_OFF_V6: usize = ETH_LEN + IP6_HDR_LEN;

/// The header `T` at the constant offset `OFF`, where the linear part of the skb holds
/// it (every frame a veth or the tunnel device hands over); `None` when it does not. A
/// constant offset, so that the verifier checks the access against one bound.
/// `bpf_skb_load_bytes` costs about as much as the rest of a header's parse.
#[inline(always)]
fn in_place<T: Copy, const OFF: usize>(ctx: &TcContext) -> Option<*const T> {
    let start = ctx.data();
    if start + OFF + core::mem::size_of::<T>() > ctx.data_end() {
        return None;
    }
    Some((start + OFF) as *const T)
}

/// The header `T` at offset `off`: in place at the usual offsets ([`in_place`]), else
/// through `bpf_skb_load_bytes`. The paths join right after the read.
#[inline(always)]
pub fn read<T: Copy>(ctx: &TcContext, off: usize) -> Result<T, Bad> {
    match at(ctx, off) {
        // SAFETY: `in_place` checked the whole `T` against `data_end`; `T` is a plain
        // header, valid for any bytes.
        Some(p) => Ok(unsafe { core::ptr::read_unaligned(p) }),
        None => ctx.load(off).map_err(|_| Bad::Malformed),
    }
}

/// Where the header `T` at offset `off` sits in the linear part, at the usual offsets.
#[inline(always)]
fn at<T: Copy>(ctx: &TcContext, off: usize) -> Option<*const T> {
    match off {
        ETH_TYPE_OFF => in_place::<T, ETH_TYPE_OFF>(ctx),
        ETH_LEN => in_place::<T, ETH_LEN>(ctx),
        L4_OFF_V4 => in_place::<T, L4_OFF_V4>(ctx),
        L4_OFF_V6 => in_place::<T, L4_OFF_V6>(ctx),
        IP6_SRC_OFF => in_place::<T, IP6_SRC_OFF>(ctx),
        _ => None,
    }
}

/// What `f` takes from the header `T` at offset `off`. In place at the usual offsets, `f`
/// reads the packet itself: the paths join on `f`'s small result, not on a copy of the
/// header, which LLVM would otherwise stage on the stack byte by byte and read back in
/// words (each such read stalls on the byte stores before it). Else `f` reads a copy
/// that `bpf_skb_load_bytes` made.
#[inline(always)]
pub fn read_with<T: Copy, R>(
    ctx: &TcContext,
    off: usize,
    f: impl FnOnce(&T) -> R,
) -> Result<R, Bad> {
    const { assert!(core::mem::align_of::<T>() == 1, "headers are byte arrays") };
    match at::<T>(ctx, off) {
        // SAFETY: `in_place` checked the whole `T` against `data_end`; `T` has alignment
        // one and is valid for any bytes.
        Some(p) => Ok(f(unsafe { &*p })),
        None => {
            // 8-aligned, so that `f`'s [`word`] and [`half`] loads of naturally aligned
            // fields are aligned on the stack (the verifier refuses misaligned stack
            // accesses).
            let mut copy = MaybeUninit::<Aligned<T>>::uninit();
            // SAFETY: the helper writes at most `size_of::<T>()` bytes into the copy.
            let ret = unsafe {
                bpf_skb_load_bytes(
                    ctx.skb.skb.cast(),
                    off as u32,
                    copy.as_mut_ptr().cast(),
                    size_of::<T>() as u32,
                )
            };
            if ret < 0 {
                return Err(Bad::Malformed);
            }
            // SAFETY: the helper filled the whole `T`, valid for any bytes.
            Ok(f(unsafe { &copy.assume_init_ref().0 }))
        }
    }
}

/// A header copy aligned for [`word`] and [`half`] loads.
#[repr(C, align(8))]
struct Aligned<T>(T);

/// The four bytes of a header field in one load, for [`read_with`]'s closures. A field
/// of alignment one is read byte by byte otherwise (the BPF target emits no wider load
/// it cannot prove aligned), and put together with shifts. The verifier takes a
/// misaligned load from the packet (no strict alignment on x86, the only target the
/// datapath is built for); the helper path's copy is 8-aligned and the fields passed
/// here sit at offsets of their own size in their headers, so its loads are aligned.
#[inline(always)]
pub fn word(b: &[u8; 4]) -> [u8; 4] {
    let v: u32;
    // SAFETY: reads the four bytes `b` refers to, nothing else.
    unsafe {
        core::arch::asm!(
            "{v} = *(u32 *)({p} + 0)",
            p = in(reg) b.as_ptr(),
            v = lateout(reg) v,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    v.to_ne_bytes()
}

/// The `N` bytes at offset `O` of the `L`-byte header `h`, in place.
#[inline(always)]
pub fn bytes_at<const O: usize, const N: usize, const L: usize>(h: &[u8; L]) -> &[u8; N] {
    const { assert!(O + N <= L) };
    // SAFETY: `O + N <= L` (asserted above): the `N` bytes lie inside `h`.
    unsafe { &*h.as_ptr().add(O).cast::<[u8; N]>() }
}

/// [`word`] for a 2-byte field.
#[inline(always)]
pub fn half(b: &[u8; 2]) -> [u8; 2] {
    let v: u16;
    // SAFETY: reads the two bytes `b` refers to, nothing else.
    unsafe {
        core::arch::asm!(
            "{v} = *(u16 *)({p} + 0)",
            p = in(reg) b.as_ptr(),
            v = lateout(reg) v,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    v.to_ne_bytes()
}

/// The IPv4 header of a frame whose ethertype the caller has already found to be IPv4
/// ([`ethertype`], [`ipv4_src`]): it is not read again. A length field of 0 is malformed
/// (see [`ipv4_big`]).
#[inline(always)]
pub fn ipv4(ctx: &TcContext) -> Result<Ipv4, Bad> {
    ipv4_with(ctx, false)
}

/// [`ipv4`], a length field of 0 in a GSO packet read as BIG TCP (or GRO beyond 64 KiB):
/// Linux's `skb_ip_totlen` takes the skb's length, and so does this. Not in `from_pod`,
/// whose call chains are at Linux 6.1's verifier limit of a million instructions with
/// it: there a selected pod's malformed GSO packet is dropped instead.
#[inline(always)]
pub fn ipv4_big(ctx: &TcContext) -> Result<Ipv4, Bad> {
    ipv4_with(ctx, true)
}

#[inline(always)]
fn ipv4_with(ctx: &TcContext, big_tcp: bool) -> Result<Ipv4, Bad> {
    // The fields first (from the packet itself where it can), then the checks.
    let (version, ihl, tot_len, fragment, df, src, dst, proto, ttl) =
        read_with(ctx, ETH_LEN, |h: &Ipv4Hdr| {
            (
                h.version(),
                // network-types' `ihl()` is already in bytes (the field times four).
                usize::from(h.ihl()),
                h.tot_len(),
                // More-fragments flag or a non-zero offset.
                (h.frag_flags() & 0x1) != 0 || h.frag_offset() != 0,
                (h.frag_flags() & 0x2) != 0,
                word(&h.src_addr),
                word(&h.dst_addr),
                h.proto,
                h.ttl,
            )
        })?;
    let tot_len = if big_tcp && tot_len == 0 && gso(ctx) {
        (ctx.len() as usize - ETH_LEN).min(usize::from(u16::MAX)) as u16
    } else {
        tot_len
    };
    if version != 4 || ihl < Ipv4Hdr::LEN || usize::from(tot_len) < ihl {
        return Err(Bad::Malformed);
    }
    if ETH_LEN + usize::from(tot_len) > ctx.len() as usize {
        return Err(Bad::Malformed);
    }
    Ok(Ipv4 {
        src,
        dst,
        proto,
        ttl,
        fragment,
        df,
        l4: ETH_LEN + ihl,
        tot_len,
    })
}

/// Whether the skb is a GSO packet (a segment train: BIG TCP's length fields are 0).
#[inline(always)]
pub fn gso(ctx: &TcContext) -> bool {
    // SAFETY: the context pointer is valid for the program's lifetime.
    unsafe { (*ctx.skb.skb).gso_size != 0 }
}

/// The transport header of a TCP, UDP or ICMP echo packet.
#[inline(always)]
pub fn l4(ctx: &TcContext, ip: &Ipv4) -> Result<L4, Bad> {
    if ip.fragment {
        return Err(Bad::Fragment);
    }
    let room = usize::from(ip.tot_len) - (ip.l4 - ETH_LEN);
    transport(ctx, ip.proto, ip.l4, room)
}

/// The transport header of protocol `proto` at offset `off`, with `room` bytes of IP
/// payload from there. Shared by both families: ICMP and ICMPv6 echo differ only in their
/// type numbers.
#[inline(always)]
pub fn transport(ctx: &TcContext, proto: u8, off: usize, room: usize) -> Result<L4, Bad> {
    match proto {
        PROTO_TCP => {
            // As bytes: the data offset (byte 12, high nibble) and the flags (byte 13)
            // are plain bytes there.
            let l4 = read_with(ctx, off, |t: &[u8; TcpHdr::LEN]| L4 {
                sport_be: u16::from_ne_bytes(half(bytes_at::<0, 2, { TcpHdr::LEN }>(t))),
                dport_be: u16::from_ne_bytes(half(bytes_at::<2, 2, { TcpHdr::LEN }>(t))),
                tcp_flags: t[13],
                tcp_hdr_len: usize::from(t[12] >> 4) * 4,
            })?;
            let hdr_len = l4.tcp_hdr_len;
            if room < TcpHdr::LEN || hdr_len < TcpHdr::LEN || hdr_len > room {
                return Err(Bad::Malformed);
            }
            Ok(l4)
        }
        PROTO_UDP => {
            let l4 = read_with(ctx, off, |u: &UdpHdr| L4 {
                sport_be: u16::from_ne_bytes(half(&u.src)),
                dport_be: u16::from_ne_bytes(half(&u.dst)),
                tcp_flags: 0,
                tcp_hdr_len: 0,
            })?;
            if room < UdpHdr::LEN {
                return Err(Bad::Malformed);
            }
            Ok(l4)
        }
        PROTO_ICMP | PROTO_ICMPV6 => {
            let h: [u8; 8] = read(ctx, off)?;
            if room < 8 {
                return Err(Bad::Malformed);
            }
            let id_be = u16::from_ne_bytes([h[4], h[5]]);
            let (request, reply) = if proto == PROTO_ICMP {
                (ICMP_ECHO_REQUEST, ICMP_ECHO_REPLY)
            } else {
                (ICMPV6_ECHO_REQUEST, ICMPV6_ECHO_REPLY)
            };
            if h[0] == request {
                Ok(L4 {
                    sport_be: id_be,
                    dport_be: 0,
                    tcp_flags: 0,
                    tcp_hdr_len: 0,
                })
            } else if h[0] == reply {
                Ok(L4 {
                    sport_be: 0,
                    dport_be: id_be,
                    tcp_flags: 0,
                    tcp_hdr_len: 0,
                })
            } else {
                Err(Bad::Unsupported)
            }
        }
        _ => Err(Bad::Unsupported),
    }
}
