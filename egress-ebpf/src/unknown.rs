//! `--unknown-pods drop`: a packet from a pod address that is neither selected nor known
//! to the agent yet (a pod whose Pod object has not reached it) is dropped when a rule of
//! any policy covers its destination, so that it never leaves with the pod's or the node's
//! address before the agent has decided. Off (`--unknown-pods pass`), this costs the
//! unselected path one array read.

use aya_ebpf::{btf_maps::lpm_trie::Key, programs::TcContext};
use egress_common::{
    config::flags,
    counters::reason,
    policy::{CoveredValue, coverage},
};

use crate::{
    counters::{OK, SHOT, verdict},
    maps::{CONFIG, COVERED_V4, COVERED_V6, KNOWN_PODS_V4, KNOWN_PODS_V6},
    parse::{self, IP_DST_OFF, IP6_DST_OFF, IP6_HDR_LEN},
    parse6, source,
};

/// Whether the node drops packets of unknown pods (the agent has written `CONFIG` with
/// `UNKNOWN_PODS_DROP`).
#[inline(always)]
fn enabled() -> bool {
    CONFIG.get(0).is_some_and(|c| {
        c.flags & (flags::READY | flags::UNKNOWN_PODS_DROP)
            == flags::READY | flags::UNKNOWN_PODS_DROP
    })
}

#[inline(always)]
fn covered(v: Option<&CoveredValue>) -> bool {
    v.is_some_and(|v| v.covered == coverage::COVERED)
}

/// An IPv4 packet of an unselected pod address `src`.
#[inline(always)]
pub fn check4(ctx: &TcContext, src: &[u8; 4]) -> i32 {
    if !enabled() {
        return OK;
    }
    unknown4(ctx, src)
}

#[inline(never)]
fn unknown4(ctx: &TcContext, src: &[u8; 4]) -> i32 {
    // SAFETY: presence only; the value is not read.
    if unsafe { KNOWN_PODS_V4.get(src) }.is_some() {
        return known(ctx, source::elsewhere4(ctx, src));
    }
    let Ok(dst) = ctx.load::<[u8; 4]>(IP_DST_OFF) else {
        return verdict(ctx, reason::MALFORMED_PASSED, OK);
    };
    if covered4(dst) {
        return verdict(ctx, reason::DROP_UNKNOWN_POD, SHOT);
    }
    OK
}

/// A known pod's packet passes, unless it came from another device than the one the
/// agent bound its source address to (`elsewhere`: a pod sending as another pod).
#[inline(always)]
fn known(ctx: &TcContext, elsewhere: bool) -> i32 {
    if elsewhere {
        return verdict(ctx, reason::DROP_SOURCE_DEVICE, SHOT);
    }
    OK
}

/// Whether a rule of any policy covers `dst` (`COVERED_V4`); link-local, multicast,
/// limited broadcast and class E never leave through a gateway
/// ([`parse::link_scoped4`]).
#[inline(always)]
pub fn covered4(dst: [u8; 4]) -> bool {
    !parse::link_scoped4(dst) && covered(COVERED_V4.get(&Key::new(32, dst)))
}

/// An IPv6 packet of an unselected pod address `src`.
#[inline(always)]
pub fn check6(ctx: &TcContext, src: &[u8; 16]) -> i32 {
    if !enabled() {
        return OK;
    }
    unknown6(ctx, src)
}

#[inline(never)]
fn unknown6(ctx: &TcContext, src: &[u8; 16]) -> i32 {
    // SAFETY: presence only; the value is not read.
    if unsafe { KNOWN_PODS_V6.get(src) }.is_some() {
        return known(ctx, source::elsewhere6(ctx, src));
    }
    let Ok(dst) = ctx.load::<[u8; 16]>(IP6_DST_OFF) else {
        return verdict(ctx, reason::MALFORMED_PASSED, OK);
    };
    if parse6::link_scoped(&dst) || ndp(ctx) {
        return OK;
    }
    if covered6(dst) {
        return verdict(ctx, reason::DROP_UNKNOWN_POD, SHOT);
    }
    OK
}

/// Whether a rule of any policy covers `dst` (`COVERED_V6`).
#[inline(always)]
pub fn covered6(dst: [u8; 16]) -> bool {
    covered(COVERED_V6.get(&Key::new(128, dst)))
}

/// Neighbour discovery right after the fixed header (the kernel's business, always).
#[inline(always)]
fn ndp(ctx: &TcContext) -> bool {
    const NEXT_HEADER_OFF: usize = parse::ETH_LEN + 6;
    if ctx.load::<u8>(NEXT_HEADER_OFF).ok() != Some(parse::PROTO_ICMPV6) {
        return false;
    }
    ctx.load::<u8>(parse::ETH_LEN + IP6_HDR_LEN)
        .is_ok_and(|t| (parse6::NDP_FIRST..=parse6::NDP_LAST).contains(&t))
}
