//! The collect-metadata VXLAN tunnel between nodes: the VNI carries the rule id (or
//! `RETURN_VNI` for replies), the outer source tells who sent the packet. The underlay is
//! IPv4 or IPv6, per peer: an IPv4-mapped [`Underlay`] address goes over IPv4.

use core::mem::{MaybeUninit, offset_of, size_of};

use aya_ebpf::{
    bindings::{BPF_F_TUNINFO_IPV6, bpf_tunnel_key},
    helpers::generated::{bpf_redirect, bpf_skb_get_tunnel_key, bpf_skb_set_tunnel_key},
    programs::TcContext,
};
use egress_common::{
    config::Config,
    counters::reason,
    underlay::{self, TUNNEL_KEY_SIZE, Underlay},
};

use crate::{
    counters::{SHOT, verdict},
    underlay::Words,
};

/// Set by tests only (`EbpfLoader::set_global`): `BPF_PROG_TEST_RUN` has no tunnel
/// metadata, so the sender is read from `__sk_buff.cb[0..4]` (its 16 underlay bytes as
/// they sit in memory) and the VNI from `cb[4]`. The agent never sets it; the verifier
/// then removes the branch (the value sits in `.rodata`).
#[unsafe(no_mangle)]
static TEST_TUNNEL_FROM_CB: u8 = 0;

// The key's first `TUNNEL_KEY_SIZE` bytes are the layout every kernel accepts (see
// `egress_common::underlay::TUNNEL_KEY_SIZE`): they end with `tunnel_label`, where the
// 16 bytes of `local_ipv4` / `local_ipv6` (5.19, never set here) begin.
const _: () = assert!(offset_of!(bpf_tunnel_key, tunnel_label) + 4 == TUNNEL_KEY_SIZE as usize);
const _: () = assert!(size_of::<bpf_tunnel_key>() == TUNNEL_KEY_SIZE as usize + 16);

/// Tunnel metadata of a received packet.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Received {
    /// The outer source: an IPv4 underlay sender IPv4-mapped.
    pub sender: Underlay,
    pub vni: u32,
}

#[inline(always)]
fn bytes(w: [u32; 4]) -> Underlay {
    let mut u = [0u8; 16];
    u[0..4].copy_from_slice(&w[0].to_ne_bytes());
    u[4..8].copy_from_slice(&w[1].to_ne_bytes());
    u[8..12].copy_from_slice(&w[2].to_ne_bytes());
    u[12..16].copy_from_slice(&w[3].to_ne_bytes());
    u
}

#[inline(always)]
pub fn received(ctx: &TcContext) -> Option<Received> {
    // SAFETY: a plain read of a load-time constant.
    if unsafe { core::ptr::read_volatile(&TEST_TUNNEL_FROM_CB) } != 0 {
        let cb = ctx.cb();
        return Some(Received {
            sender: bytes([cb[0], cb[1], cb[2], cb[3]]),
            vni: cb[4],
        });
    }
    // SAFETY: all-zero is a valid bpf_tunnel_key; the helper writes at most `size` bytes.
    let mut slot = MaybeUninit::<bpf_tunnel_key>::uninit();
    let key = unsafe { crate::mem::zeroed_in(&mut slot) };
    let size = TUNNEL_KEY_SIZE;
    // IPv4 underlay first (the common case); the helper refuses a family mismatch
    // (-EPROTO), and then the packet came over IPv6. Without metadata both calls fail.
    let ret = unsafe { bpf_skb_get_tunnel_key(ctx.skb.skb, &mut *key, size, 0) };
    if ret == 0 {
        return Some(Received {
            // remote_ipv4 is in host order.
            sender: underlay::from_v4(unsafe { key.__bindgen_anon_1.remote_ipv4 }.to_be_bytes()),
            vni: key.tunnel_id,
        });
    }
    let ret = unsafe {
        bpf_skb_get_tunnel_key(ctx.skb.skb, &mut *key, size, u64::from(BPF_F_TUNINFO_IPV6))
    };
    if ret != 0 {
        return None;
    }
    Some(Received {
        // remote_ipv6 holds the address bytes as they sit in the packet.
        sender: bytes(unsafe { key.__bindgen_anon_1.remote_ipv6 }),
        vni: key.tunnel_id,
    })
}

/// The packet about to enter the tunnel: where its transport header is, for the MSS clamp.
pub struct Inner<'a> {
    pub proto: u8,
    pub l4_off: usize,
    pub l4: &'a crate::parse::L4,
    /// [`IP4_HDR_LEN`] or [`IP6_HDR_LEN`].
    pub ip_hdr_len: u16,
}

/// Send the packet into the tunnel towards `remote`, tagged `vni`: clamp a SYN's MSS to
/// the tunnel, set the key, redirect to the tunnel device. Counted as `sent`, or as
/// `DROP_TUNNEL_KEY` (and dropped) when the key could not be set. The key is built on the
/// stack; see [`enter_with`] for the IPv6 paths.
#[inline(always)]
pub fn enter(
    ctx: &TcContext,
    cfg: &Config,
    inner: &Inner,
    remote: Words,
    vni: u32,
    sent: u32,
) -> i32 {
    let mut slot = MaybeUninit::<bpf_tunnel_key>::uninit();
    // SAFETY: all-zero is a valid bpf_tunnel_key.
    let key = unsafe { crate::mem::zeroed_in(&mut slot) };
    finish(ctx, cfg, inner, key, remote, vni, sent)
}

/// [`enter`] with the key built in `key` (the per-CPU scratch slot: the IPv6 paths keep
/// their stack small).
#[inline(always)]
pub fn enter_with(
    ctx: &TcContext,
    cfg: &Config,
    inner: &Inner,
    key: &mut bpf_tunnel_key,
    remote: Words,
    vni: u32,
    sent: u32,
) -> i32 {
    // SAFETY: as above.
    unsafe { crate::mem::zero(key) };
    finish(ctx, cfg, inner, key, remote, vni, sent)
}

/// [`enter`] with `key` zeroed. An IPv4-mapped `remote` goes over the IPv4 underlay,
/// anything else over IPv6. `remote` comes in words (`crate::underlay`): read byte by
/// byte, checking its family and copying it into the key took a hundred instructions.
#[inline(always)]
fn finish(
    ctx: &TcContext,
    cfg: &Config,
    inner: &Inner,
    key: &mut bpf_tunnel_key,
    remote: Words,
    vni: u32,
    sent: u32,
) -> i32 {
    clamp_syn(ctx, inner, cfg.tunnel_mtu);
    key.tunnel_id = vni;
    key.tunnel_ttl = 64;
    let flags = match remote.v4_host() {
        Some(v4) => {
            key.__bindgen_anon_1.remote_ipv4 = v4;
            0
        }
        None => {
            key.__bindgen_anon_1.remote_ipv6 = remote.0;
            u64::from(BPF_F_TUNINFO_IPV6)
        }
    };
    let ret = unsafe { bpf_skb_set_tunnel_key(ctx.skb.skb, key, TUNNEL_KEY_SIZE, flags) };
    if ret != 0 {
        return verdict(ctx, reason::DROP_TUNNEL_KEY, SHOT);
    }
    verdict(ctx, sent, unsafe { bpf_redirect(cfg.tunnel_ifindex, 0) }
        as i32)
}

/// IP header lengths without options, for [`clamp_syn`] (IPv6's is the parser's).
pub const IP4_HDR_LEN: u16 = 20;
pub const IP6_HDR_LEN: u16 = crate::parse::IP6_HDR_LEN as u16;

/// Before a TCP SYN or SYN-ACK enters the tunnel: lower its MSS option so that full-size
/// segments still fit the tunnel MTU (`tunnel_mtu - IP header - 20`), counted as
/// `MSS_CLAMPED`. Anything else is left alone.
#[inline(always)]
fn clamp_syn(ctx: &TcContext, inner: &Inner, tunnel_mtu: u16) {
    let mss = tunnel_mtu.saturating_sub(inner.ip_hdr_len + 20);
    if inner.proto == crate::parse::PROTO_TCP
        && inner.l4.tcp_flags & crate::parse::TCP_SYN != 0
        && matches!(
            crate::rewrite::clamp_mss(ctx, inner.l4_off, inner.l4, mss),
            Ok(true)
        )
    {
        crate::counters::count(ctx, reason::MSS_CLAMPED);
    }
}
