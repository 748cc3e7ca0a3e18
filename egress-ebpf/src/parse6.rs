//! Bounds-checked reads of IPv6 headers: the fixed header, a bounded walk over the
//! extension headers whose layout we know, and the transport header behind them.

use aya_ebpf::{helpers::generated::bpf_skb_load_bytes, programs::TcContext};

use crate::parse::{
    self, Bad, ETH_LEN, IP6_HDR_LEN, IP6_SRC_OFF, L4, PROTO_ICMPV6, PROTO_UDP, transport,
};

pub const ETH_P_IPV6_BE: u16 = 0x86ddu16.to_be();

const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_ROUTING: u8 = 43;
const NEXTHDR_FRAGMENT: u8 = 44;
const NEXTHDR_DEST: u8 = 60;

/// How many hop-by-hop, routing and destination options headers are walked before the
/// packet counts as `DROP_IPV6_EXT_HDR`.
pub const MAX_EXT_HDRS: usize = 4;

/// ICMPv6 neighbour discovery: router solicitation (133) to redirect (137).
pub const NDP_FIRST: u8 = 133;
pub const NDP_LAST: u8 = 137;

/// The IPv6 header fields the datapath uses. `proto` and `l4` are those of the upper-layer
/// header behind the walked extension headers; `stop` says why there is none we can use.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ipv6 {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub proto: u8,
    pub hop_limit: u8,
    pub l4: usize,
    /// Offset of the end of the IP payload (from `payload_len`).
    pub end: usize,
    /// Why the transport header is out of reach: [`STOP_NONE`], [`STOP_FRAGMENT`] or
    /// [`STOP_EXT_HDR`] (an integer, not an `Option<Bad>`: this struct crosses BPF calls,
    /// so it appears in BTF, which has no Rust enums with data).
    pub stop: u8,
}

/// Whether the programs take the IPv6 paths. Their call chains fit the verifier's
/// 512-byte combined stack because their large temporaries (headers, conntrack keys and
/// entries, FIB and tunnel parameters) live in the per-CPU `scratch::SCRATCH` slot. Turned
/// off, IPv6 passes untouched and LLVM drops the IPv6 code from the object.
pub const IPV6_DATAPATH: bool = true;

pub const STOP_NONE: u8 = 0;
pub const STOP_FRAGMENT: u8 = 1;
pub const STOP_EXT_HDR: u8 = 2;

/// An IPv6 address as four words in packet order, for a map key: LLVM stores it with
/// four word stores. The kernel's hash reads a key by words, and a key stored byte by
/// byte (as a `[u8; 16]` built from packet bytes is) makes each of those reads wait for
/// the byte stores before it.
#[repr(C, align(4))]
#[derive(Clone, Copy)]
pub struct Addr6([u32; 4]);

impl Addr6 {
    /// The address's 16 bytes, as the maps key them.
    #[inline(always)]
    pub fn bytes(&self) -> &[u8; 16] {
        // SAFETY: `[u32; 4]` is 16 initialised bytes; `[u8; 16]` has alignment one and
        // is valid for any bytes.
        unsafe { &*self.0.as_ptr().cast::<[u8; 16]>() }
    }
}

/// The source address of an IPv6 packet, or `None` for anything else; read in place
/// when the skb's linear part holds it (`parse::read_with`).
#[inline(always)]
pub fn ipv6_src(ctx: &TcContext) -> Option<Addr6> {
    if parse::ethertype(ctx)? != ETH_P_IPV6_BE {
        return None;
    }
    parse::read_with(ctx, IP6_SRC_OFF, |s: &[u8; 16]| Addr6(words(s))).ok()
}

/// The address `a` (in a header, for `parse::read_with`'s closures) as four words, each
/// four of its bytes in order, read with one load each (`parse::word`).
#[inline(always)]
fn words(a: &[u8; 16]) -> [u32; 4] {
    let w = |b: &[u8; 4]| u32::from_ne_bytes(parse::word(b));
    [
        w(parse::bytes_at::<0, 4, 16>(a)),
        w(parse::bytes_at::<4, 4, 16>(a)),
        w(parse::bytes_at::<8, 4, 16>(a)),
        w(parse::bytes_at::<12, 4, 16>(a)),
    ]
}

/// Store `w` (four words, each four of the address's bytes in order) into `a`, an
/// address field of [`Ipv6`] (4-aligned: checked below).
#[inline(always)]
fn set_words(a: &mut [u8; 16], w: [u32; 4]) {
    let p = a.as_mut_ptr().cast::<u32>();
    // SAFETY: 16 writable bytes; `a` is `Ipv6::src` or `Ipv6::dst`, 4-aligned fields of
    // a `repr(C)` struct aligned to 8 (asserted below); any bytes are valid.
    unsafe {
        p.write(w[0]);
        p.add(1).write(w[1]);
        p.add(2).write(w[2]);
        p.add(3).write(w[3]);
    }
}
const _: () = {
    assert!(core::mem::offset_of!(Ipv6, src) % 4 == 0);
    assert!(core::mem::offset_of!(Ipv6, dst) % 4 == 0);
    assert!(core::mem::align_of::<Ipv6>() >= 4);
};

/// What [`parse`] returns: the header is in `out`.
pub const PARSED: i32 = 1;
/// What [`parse`] returns: the frame is not IPv6.
pub const NOT_IPV6: i32 = 0;
/// What [`parse`] returns: a truncated or inconsistent header.
pub const MALFORMED: i32 = -1;

/// 16 bytes of the packet at `off` into `out` (a fixed length: `TcContext::load_bytes`
/// clamps its length to the packet, which the verifier sees as a possibly empty read).
#[inline(always)]
pub fn load16(ctx: &TcContext, off: usize, out: &mut [u8; 16]) -> bool {
    // SAFETY: `out` is 16 writable bytes.
    let ret = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb as *const _,
            off as u32,
            out.as_mut_ptr() as *mut _,
            16,
        )
    };
    ret == 0
}

/// Out of line: the walk's temporaries then stay off the stack frames of the callers
/// (BPF calls nest their frames into one 512-byte budget). The addresses are loaded
/// straight into `out`.
/// Returns [`PARSED`], [`NOT_IPV6`] or [`MALFORMED`] (a plain integer across the call).
#[inline(never)]
pub fn parse(ctx: &TcContext, out: &mut Ipv6) -> i32 {
    let Some(ethertype) = parse::ethertype(ctx) else {
        return MALFORMED;
    };
    if ethertype != ETH_P_IPV6_BE {
        return NOT_IPV6;
    }
    // The whole fixed header, read in place where the skb's linear part holds it:
    // version/class/flow (4), payload length (2), next header, hop limit, the addresses
    // (straight into `out`).
    let fields = parse::read_with(ctx, ETH_LEN, |h: &[u8; IP6_HDR_LEN]| {
        if h[0] >> 4 != 6 {
            return None;
        }
        // Word by word, loads and stores: a 16-byte slice copy becomes a byte-loop
        // `memcpy` call, and byte stores would stall the hash's word reads of the keys
        // built from these.
        const L: usize = IP6_HDR_LEN;
        set_words(&mut out.src, words(parse::bytes_at::<8, 16, L>(h)));
        set_words(&mut out.dst, words(parse::bytes_at::<24, 16, L>(h)));
        let len = parse::half(parse::bytes_at::<4, 2, L>(h));
        Some((u16::from_be_bytes(len), h[6], h[7]))
    });
    let Ok(Some((payload_len, next, hop_limit))) = fields else {
        return MALFORMED;
    };
    // 0 with a GSO packet: BIG TCP (Linux keeps no jumbo option in the skb), the payload
    // is the rest of the skb.
    let end = if payload_len == 0 && parse::gso(ctx) {
        ctx.len() as usize
    } else {
        ETH_LEN + IP6_HDR_LEN + usize::from(payload_len)
    };
    if end > ctx.len() as usize {
        return MALFORMED;
    }
    let mut next = next;
    let mut off = ETH_LEN + IP6_HDR_LEN;
    let mut stop = STOP_NONE;
    for _ in 0..MAX_EXT_HDRS {
        if next != NEXTHDR_HOP && next != NEXTHDR_ROUTING && next != NEXTHDR_DEST {
            break;
        }
        // Next header, length in 8-octet units beyond the first; for a routing header
        // also its type and the segments left.
        let Ok(e) = ctx.load::<[u8; 4]>(off) else {
            return MALFORMED;
        };
        if next == NEXTHDR_ROUTING && e[3] != 0 {
            // The final destination is in the routing header: the pseudo-header and the
            // policy would both see the wrong address.
            stop = STOP_EXT_HDR;
            break;
        }
        next = e[0];
        off += (usize::from(e[1]) + 1) * 8;
        if off > end {
            return MALFORMED;
        }
    }
    if stop == STOP_NONE {
        if next == NEXTHDR_HOP || next == NEXTHDR_ROUTING || next == NEXTHDR_DEST {
            stop = STOP_EXT_HDR;
        } else if next == NEXTHDR_FRAGMENT {
            stop = STOP_FRAGMENT;
        }
    }
    out.proto = next;
    out.hop_limit = hop_limit;
    out.l4 = off;
    out.end = end;
    out.stop = stop;
    PARSED
}

/// The transport header of a TCP, UDP or ICMPv6 echo packet. A zero UDP checksum is
/// malformed in IPv6 (RFC 8200 8.1).
#[inline(always)]
pub fn l4(ctx: &TcContext, ip: &Ipv6) -> Result<L4, Bad> {
    match ip.stop {
        STOP_NONE => {}
        STOP_FRAGMENT => return Err(Bad::Fragment),
        _ => return Err(Bad::ExtHeader),
    }
    let l4 = transport(ctx, ip.proto, ip.l4, ip.end - ip.l4)?;
    if ip.proto == PROTO_UDP {
        let csum: u16 = ctx.load(ip.l4 + 6).map_err(|_| Bad::Malformed)?;
        if csum == 0 {
            return Err(Bad::Malformed);
        }
    }
    Ok(l4)
}

/// Whether the packet is ICMPv6 neighbour discovery: the kernel's business, always.
#[inline(always)]
pub fn is_ndp(ctx: &TcContext, ip: &Ipv6) -> bool {
    if ip.stop != STOP_NONE || ip.proto != PROTO_ICMPV6 {
        return false;
    }
    match ctx.load::<u8>(ip.l4) {
        Ok(t) => (NDP_FIRST..=NDP_LAST).contains(&t),
        Err(_) => false,
    }
}

/// Link-local (fe80::/10) and multicast (ff00::/8) destinations never leave the link,
/// so never through a gateway.
#[inline(always)]
pub fn link_scoped(dst: &[u8; 16]) -> bool {
    dst[0] == 0xff || (dst[0] == 0xfe && dst[1] & 0xc0 == 0x80)
}
