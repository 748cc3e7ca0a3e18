//! Next hop selection: a FIB lookup, then a redirect with the right MAC addresses.

use core::mem::size_of;

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        BPF_FIB_LOOKUP_OUTPUT, bpf_check_mtu_ret::BPF_MTU_CHK_RET_FRAG_NEEDED,
        bpf_fib_lookup as FibParams, bpf_redir_neigh,
    },
    helpers::generated::{bpf_check_mtu, bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};

use egress_common::conntrack::{self, NextHop};

use crate::{parse::Ipv4, rewrite};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// Where the lookup starts.
pub enum From {
    /// As if sent out of this interface: only routes through it qualify (egress path,
    /// so a rule's packets never leave by another interface).
    Output(u32),
    /// As if received on this interface (delivery towards a local pod).
    Input(u32),
}

/// Route the (already rewritten) packet from `src` to `dst` and redirect it. `Err` when
/// there is no usable route, or the route leaves by another interface than required.
#[inline(always)]
pub fn redirect(
    ctx: &TcContext,
    ip: &Ipv4,
    src: [u8; 4],
    dst: [u8; 4],
    from: From,
) -> Result<i32, ()> {
    // SAFETY: all-zero is a valid bpf_fib_lookup.
    let mut slot = core::mem::MaybeUninit::<FibParams>::uninit();
    let p = unsafe { crate::mem::zeroed_in(&mut slot) };
    p.family = AF_INET;
    p.l4_protocol = ip.proto;
    // tot_len stays 0: see `lookup4`.
    p.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(src);
    p.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(dst);
    // Not `lookup4` + `send4`: the ICMP-error and local-delivery paths that call this
    // are deep in `from_secondary`'s call chain, and the `Next4` copy would take their
    // stack past 512 bytes.
    let mut kind = UNROUTED;
    lookup_and_redirect(ctx, p, from, 0, &mut kind)
}

/// [`Next4::kind`]: no usable route (or one out of another interface than required).
pub const UNROUTED: u32 = 0;
/// The next hop is resolved: `nh` is what a conntrack entry caches (`generation` and
/// `filled` left 0 for the caller).
pub const RESOLVED: u32 = 1;
/// A route, but its neighbour is not resolved (yet): `nh.ifindex` and `via` say where,
/// and the kernel resolves the neighbour when the packet goes (`bpf_redirect_neigh`).
/// Never cached.
pub const NO_NEIGH: u32 = 2;
/// A route, but the packet is larger than its device's MTU (`nh.mtu`): the kernel's
/// `is_skb_forwardable` refused it, or, a GSO packet, which that check lets through
/// whatever its size, its segments are larger ([`gso_too_big`]). Answered with
/// "fragmentation needed" or "packet too big" (`answer`), never sent.
pub const TOO_BIG: u32 = 3;

/// Where the FIB sends an IPv4 packet, before it is sent ([`send4`]). Plain integers,
/// every field set on every path: an enum with data let LLVM copy uninitialised bytes
/// between variants, which the verifier refuses.
#[repr(C)]
pub struct Next4 {
    pub nh: NextHop,
    pub kind: u32,
    /// The next hop's address ([`NO_NEIGH`]).
    pub via: u32,
}

/// The FIB lookup of [`redirect`] alone, so that a new flow's conntrack entry can be
/// made with its next hop in it (one lookup for both). `headers`: those of each segment
/// of a GSO packet ([`segment_headers`]). `p`: the lookup's room, the per-CPU scratch
/// slot's (on the stack, its 64 bytes took `from_tunnel`'s frame, with a new flow's port
/// allocation, past the verifier's 512 bytes).
#[inline(always)]
pub fn lookup4(
    ctx: &TcContext,
    p: &mut FibParams,
    proto: u8,
    src: [u8; 4],
    dst: [u8; 4],
    from: From,
    headers: u32,
) -> Next4 {
    // SAFETY: all-zero is a valid bpf_fib_lookup.
    unsafe { crate::mem::zero(p) };
    p.family = AF_INET;
    p.l4_protocol = proto;
    // tot_len stays 0: the kernel then checks the MTU with is_skb_forwardable(), which
    // lets every GSO/GRO packet through (a non-zero tot_len would refuse every aggregated
    // TCP packet as "fragmentation needed"; their segments are measured here instead:
    // `gso_too_big`), and returns the device's MTU.
    p.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(src);
    p.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(dst);
    let mut kind = match fib_call(ctx, p, from) {
        Ok(r)
            if r == i64::from(BPF_FIB_LKUP_RET_SUCCESS)
            // SAFETY: a plain u16 (on success the kernel wrote the device's MTU there).
            && gso_too_big(ctx, headers, unsafe { p.__bindgen_anon_1.mtu_result }) =>
        {
            TOO_BIG
        }
        Ok(r) if r == i64::from(BPF_FIB_LKUP_RET_SUCCESS) => RESOLVED,
        Ok(r) if r == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) => NO_NEIGH,
        Ok(r) if r == i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED) => TOO_BIG,
        _ => UNROUTED,
    };
    // SAFETY: a plain u16 (on success and on "fragmentation needed" the kernel wrote the
    // device's MTU there).
    let mut mtu = unsafe { p.__bindgen_anon_1.mtu_result };
    if kind == NO_NEIGH
        && let Some(m) = unresolved_too_big(ctx, p.ifindex, headers)
    {
        kind = TOO_BIG;
        mtu = m;
    }
    Next4 {
        nh: NextHop {
            dmac: p.dmac,
            smac: p.smac,
            mtu,
            generation: 0,
            ifindex: p.ifindex,
            filled: 0,
        },
        kind,
        // The lookup left the next hop in the destination field.
        via: unsafe { p.__bindgen_anon_4.ipv4_dst },
    }
}

/// Send the packet where [`lookup4`] said: MACs written and redirected, or handed to
/// the kernel to resolve the neighbour.
#[inline(always)]
pub fn send4(ctx: &TcContext, next: &Next4) -> Result<i32, ()> {
    match next.kind {
        RESOLVED => {
            rewrite::set_macs(ctx, &next.nh.dmac, &next.nh.smac).map_err(|_| ())?;
            Ok(unsafe { bpf_redirect(next.nh.ifindex, 0) } as i32)
        }
        NO_NEIGH => {
            // SAFETY: all-zero is a valid bpf_redir_neigh.
            let mut slot = core::mem::MaybeUninit::<bpf_redir_neigh>::uninit();
            let nh = unsafe { crate::mem::zeroed_in(&mut slot) };
            nh.nh_family = u32::from(AF_INET);
            nh.__bindgen_anon_1.ipv4_nh = next.via;
            Ok(unsafe {
                bpf_redirect_neigh(next.nh.ifindex, nh, size_of::<bpf_redir_neigh>() as i32, 0)
            } as i32)
        }
        _ => Err(()),
    }
}

/// Whether `nh`, a conntrack entry's cached next hop, may carry this packet: filled, of
/// the current generation `generation` (`maps::nh_gen`, its low 16 bits), younger than
/// [`conntrack::NEXT_HOP_MAX_AGE_NS`] at `now` ([`conntrack::fresh`]), and the packet
/// within the device's MTU (a GSO packet by its segments: [`gso_too_big`]). Otherwise
/// the packet takes the FIB lookup, which refreshes the cache or answers [`TOO_BIG`].
#[inline(always)]
pub fn cache_valid(ctx: &TcContext, nh: &NextHop, generation: u32, now: u64, headers: u32) -> bool {
    // Frame = MTU + Ethernet header + one VLAN tag, as `is_skb_forwardable` allows.
    const L2_ROOM: u32 = 14 + 4;
    // SAFETY: the context pointer is valid for the program's lifetime.
    let gso_size = unsafe { (*ctx.skb.skb).gso_size };
    let fits = if gso_size == 0 {
        ctx.len() <= u32::from(nh.mtu) + L2_ROOM
    } else {
        !gso_too_big(ctx, headers, nh.mtu)
    };
    nh.ifindex != 0
        && nh.generation == conntrack::generation(generation)
        && conntrack::fresh(nh.filled, now)
        && fits
}

/// Store `nh` (a [`Next4::Resolved`] result) as the cached next hop `slot` of a
/// conntrack entry, stamped with `generation` and `now`. Another CPU may read the entry
/// meanwhile: `ifindex`, which makes the cache valid, is cleared first and set last
/// (x86 keeps stores in order; volatile keeps the compiler from merging them), so a
/// reader sees the old next hop, none, or the new one, never half of each.
#[inline(always)]
pub fn cache_store(slot: &mut NextHop, nh: &NextHop, generation: u32, now: u64) {
    // SAFETY: `slot` is a valid, aligned map value field.
    unsafe {
        core::ptr::write_volatile(&mut slot.ifindex, 0);
        core::ptr::write_volatile(&mut slot.dmac, nh.dmac);
        core::ptr::write_volatile(&mut slot.smac, nh.smac);
        core::ptr::write_volatile(&mut slot.mtu, nh.mtu);
        core::ptr::write_volatile(&mut slot.generation, conntrack::generation(generation));
        core::ptr::write_volatile(&mut slot.filled, conntrack::stamp(now));
        core::ptr::write_volatile(&mut slot.ifindex, nh.ifindex);
    }
}

/// Why [`redirect6`] sent nothing.
pub enum Unsent {
    /// No usable route (or one out of another interface than required).
    NoRoute,
    /// The packet is larger than the route's device takes ([`TOO_BIG`]): its MTU is in
    /// `p.mtu_result`.
    TooBig,
}

/// [`redirect`] for IPv6 (the same rules; tot_len 0 for the same reason), also saying
/// whether the next hop was resolved: then `p` holds what a conntrack entry caches (MACs,
/// output ifindex, MTU). The lookup's parameters live in `p` (the per-CPU scratch slot),
/// not on the stack. `headers`: those of each segment of a GSO packet
/// ([`segment_headers`]), or 0 where the device's MTU is not this path's business.
#[inline(always)]
pub fn redirect6(
    ctx: &TcContext,
    p: &mut FibParams,
    proto: u8,
    src: &[u8; 16],
    dst: &[u8; 16],
    from: &From,
    headers: u32,
) -> Result<(i32, bool), Unsent> {
    let mut q = Lookup6 {
        proto,
        output: u8::from(matches!(from, From::Output(_))),
        kind: 0,
        _pad: 0,
        ifindex: match from {
            From::Output(i) | From::Input(i) => *i,
        },
        headers,
    };
    match redirect6_call(ctx, p, &mut q, src, dst) {
        NO_ROUTE if u32::from(q.kind) == TOO_BIG => Err(Unsent::TooBig),
        NO_ROUTE => Err(Unsent::NoRoute),
        v => Ok((v, u32::from(q.kind) == RESOLVED)),
    }
}

/// [`redirect6`]'s question, as plain integers (it crosses a BPF call, so BTF describes
/// it, and BTF has no Rust enums with data); `kind` is the answer's ([`Next4::kind`]'s
/// values).
#[repr(C)]
struct Lookup6 {
    proto: u8,
    output: u8,
    kind: u8,
    _pad: u8,
    ifindex: u32,
    headers: u32,
}

/// What [`redirect6_call`] returns instead of `Err`: not a TC verdict.
const NO_ROUTE: i32 = i32::MIN;

/// Out of line, a leaf of the IPv6 paths' call chains. A BPF call takes five arguments
/// in registers and nothing on the stack, so the result is a plain integer (a `Result`
/// would be returned through a hidden pointer argument).
#[inline(never)]
fn redirect6_call(
    ctx: &TcContext,
    p: &mut FibParams,
    q: &mut Lookup6,
    src: &[u8; 16],
    dst: &[u8; 16],
) -> i32 {
    // SAFETY: all-zero is a valid bpf_fib_lookup.
    unsafe { crate::mem::zero(p) };
    p.family = AF_INET6;
    p.l4_protocol = q.proto;
    p.__bindgen_anon_3.ipv6_src = words(src);
    p.__bindgen_anon_4.ipv6_dst = words(dst);
    let from = if q.output != 0 {
        From::Output(q.ifindex)
    } else {
        From::Input(q.ifindex)
    };
    let mut kind = UNROUTED;
    let v = lookup_and_redirect(ctx, p, from, q.headers, &mut kind).unwrap_or(NO_ROUTE);
    q.kind = kind as u8;
    v
}

/// An IPv6 address as the four network-order words of `bpf_fib_lookup`.
#[inline(always)]
fn words(a: &[u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([a[0], a[1], a[2], a[3]]),
        u32::from_ne_bytes([a[4], a[5], a[6], a[7]]),
        u32::from_ne_bytes([a[8], a[9], a[10], a[11]]),
        u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
    ]
}

/// `bpf_fib_lookup` from `from`; `Err` when the route leaves by another interface than
/// an `Output` lookup requires. Returns the helper's result.
#[inline(always)]
fn fib_call(ctx: &TcContext, p: &mut FibParams, from: From) -> Result<i64, ()> {
    let (flags, required) = match from {
        From::Output(ifindex) => {
            p.ifindex = ifindex;
            (BPF_FIB_LOOKUP_OUTPUT, ifindex)
        }
        From::Input(ifindex) => {
            p.ifindex = ifindex;
            (0, 0)
        }
    };
    let ret = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb as *mut _,
            p as *mut FibParams,
            size_of::<FibParams>() as i32,
            flags,
        )
    };
    if required != 0 && p.ifindex != required {
        return Err(());
    }
    Ok(ret)
}

/// The FIB lookup of `p` from `from`, and the redirect where it says; `kind` set to
/// [`RESOLVED`] when the next hop was resolved (`p` then holds its MACs, ifindex and
/// MTU), to [`TOO_BIG`] when the packet does not fit the route's device (`Err`: nothing
/// sent; the MTU is in `p`), a GSO packet's segments of `headers` included (unless 0).
#[inline(always)]
fn lookup_and_redirect(
    ctx: &TcContext,
    p: &mut FibParams,
    from: From,
    headers: u32,
    kind: &mut u32,
) -> Result<i32, ()> {
    let ret = fib_call(ctx, p, from)?;
    // SAFETY: a plain u16 (on success the kernel wrote the device's MTU there).
    let mtu = unsafe { p.__bindgen_anon_1.mtu_result };
    if ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS) && headers != 0 && gso_too_big(ctx, headers, mtu)
    {
        *kind = TOO_BIG;
        Err(())
    } else if ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        *kind = RESOLVED;
        rewrite::set_macs(ctx, &p.dmac, &p.smac).map_err(|_| ())?;
        Ok(unsafe { bpf_redirect(p.ifindex, 0) } as i32)
    } else if ret == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH)
        && headers != 0
        && let Some(m) = unresolved_too_big(ctx, p.ifindex, headers)
    {
        *kind = TOO_BIG;
        p.__bindgen_anon_1.mtu_result = m;
        Err(())
    } else if ret == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        // The kernel resolves the neighbour (ARP / ND) and fills in the MACs. The lookup
        // left the next hop in the destination field.
        // SAFETY: all-zero is a valid bpf_redir_neigh.
        let mut slot = core::mem::MaybeUninit::<bpf_redir_neigh>::uninit();
        let nh = unsafe { crate::mem::zeroed_in(&mut slot) };
        if p.family == AF_INET6 {
            nh.nh_family = u32::from(AF_INET6);
            nh.__bindgen_anon_1.ipv6_nh = unsafe { p.__bindgen_anon_4.ipv6_dst };
        } else {
            nh.nh_family = u32::from(AF_INET);
            nh.__bindgen_anon_1.ipv4_nh = unsafe { p.__bindgen_anon_4.ipv4_dst };
        }
        Ok(
            unsafe { bpf_redirect_neigh(p.ifindex, nh, size_of::<bpf_redir_neigh>() as i32, 0) }
                as i32,
        )
    } else {
        if ret == i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED) {
            *kind = TOO_BIG;
        }
        Err(())
    }
}

/// Whether a GSO packet's segments, each `headers` (IP and transport headers, see
/// [`segment_headers`]) and `gso_size` bytes, are larger than `mtu`: what the kernel's
/// `skb_gso_validate_network_len` measures, which the FIB lookup's own check
/// (`is_skb_forwardable`) skips for GSO. False for any other packet.
#[inline(always)]
pub fn gso_too_big(ctx: &TcContext, headers: u32, mtu: u16) -> bool {
    // SAFETY: the context pointer is valid for the program's lifetime.
    let gso_size = unsafe { (*ctx.skb.skb).gso_size };
    gso_size != 0 && headers + gso_size > u32::from(mtu)
}

/// The MTU of device `ifindex` when the packet is too big for it (a GSO packet by its
/// segments of `headers`): what the FIB leaves unmeasured when the next hop is not
/// resolved (`NO_NEIGH`: no `mtu_result`, no size check). `bpf_check_mtu` (5.12) reads
/// the device's MTU. `None` when it fits, for `headers` 0, or when the helper fails.
#[inline(never)]
fn unresolved_too_big(ctx: &TcContext, ifindex: u32, headers: u32) -> Option<u16> {
    if headers == 0 {
        return None;
    }
    let mut mtu: u32 = 0;
    // SAFETY: a helper call on the program's own skb; `mtu` is valid for the write.
    let ret = unsafe { bpf_check_mtu(ctx.skb.skb.cast(), ifindex, &mut mtu, 0, 0) };
    let too_big = if crate::parse::gso(ctx) {
        gso_too_big(ctx, headers, mtu as u16)
    } else {
        ret == i64::from(BPF_MTU_CHK_RET_FRAG_NEEDED)
    };
    (ret >= 0 && too_big).then_some(mtu as u16)
}

/// The IP and transport headers of each segment of a GSO packet (`cache_valid`): the IP
/// header, `ip_hdr_len`, and the TCP header of `tcp_hdr_len` (0 for another protocol,
/// counted as UDP's 8).
#[inline(always)]
pub fn segment_headers(ip_hdr_len: usize, tcp_hdr_len: usize) -> u32 {
    let l4 = if tcp_hdr_len == 0 { 8 } else { tcp_hdr_len };
    (ip_hdr_len + l4) as u32
}

/// The interface the packet arrived on.
#[inline(always)]
pub fn ingress_ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: the context pointer is valid for the program's lifetime.
    unsafe { (*ctx.skb.skb).ifindex }
}
