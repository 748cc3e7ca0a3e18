//! The collect-metadata VXLAN tunnel between nodes: the VNI carries the rule id (or
//! `RETURN_VNI` for replies), the outer source tells who sent the packet.

use core::mem::{size_of, zeroed};

use aya_ebpf::{
    bindings::bpf_tunnel_key,
    helpers::generated::{bpf_redirect, bpf_skb_get_tunnel_key, bpf_skb_set_tunnel_key},
    programs::TcContext,
};

/// Set by tests only (`EbpfLoader::set_global`): `BPF_PROG_TEST_RUN` has no tunnel
/// metadata, so the sender and VNI are read from `__sk_buff.cb[0..2]` instead. The agent
/// never sets it; the verifier then removes the branch (the value sits in `.rodata`).
#[unsafe(no_mangle)]
static TEST_TUNNEL_FROM_CB: u8 = 0;

/// Tunnel metadata of a received packet.
pub struct Received {
    pub sender: [u8; 4],
    pub vni: u32,
}

#[inline(always)]
pub fn received(ctx: &TcContext) -> Option<Received> {
    // SAFETY: a plain read of a load-time constant.
    if unsafe { core::ptr::read_volatile(&TEST_TUNNEL_FROM_CB) } != 0 {
        let cb = ctx.cb();
        return Some(Received {
            sender: cb[0].to_be_bytes(),
            vni: cb[1],
        });
    }
    // SAFETY: zeroed is a valid bpf_tunnel_key; the helper writes at most `size_of` bytes.
    let mut key: bpf_tunnel_key = unsafe { zeroed() };
    let ret = unsafe {
        bpf_skb_get_tunnel_key(ctx.skb.skb, &mut key, size_of::<bpf_tunnel_key>() as u32, 0)
    };
    if ret != 0 {
        return None;
    }
    Some(Received {
        // remote_ipv4 is in host order.
        sender: unsafe { key.__bindgen_anon_1.remote_ipv4 }.to_be_bytes(),
        vni: key.tunnel_id,
    })
}

/// Encapsulate towards `remote` with `vni` and redirect to the tunnel device.
/// `Err` when the key could not be set.
#[inline(always)]
pub fn send(ctx: &TcContext, tunnel_ifindex: u32, remote: [u8; 4], vni: u32) -> Result<i32, ()> {
    // SAFETY: as above.
    let mut key: bpf_tunnel_key = unsafe { zeroed() };
    send_with(ctx, &mut key, tunnel_ifindex, remote, vni)
}

/// [`send`] with the key built in `key` (the per-CPU scratch slot on the IPv6 paths).
#[inline(always)]
pub fn send_with(
    ctx: &TcContext,
    key: &mut bpf_tunnel_key,
    tunnel_ifindex: u32,
    remote: [u8; 4],
    vni: u32,
) -> Result<i32, ()> {
    // SAFETY: as above.
    *key = unsafe { zeroed() };
    key.tunnel_id = vni;
    key.__bindgen_anon_1.remote_ipv4 = u32::from_be_bytes(remote);
    key.tunnel_ttl = 64;
    let ret =
        unsafe { bpf_skb_set_tunnel_key(ctx.skb.skb, key, size_of::<bpf_tunnel_key>() as u32, 0) };
    if ret != 0 {
        return Err(());
    }
    Ok(unsafe { bpf_redirect(tunnel_ifindex, 0) } as i32)
}

/// IP header lengths without options, for [`clamp_syn`].
pub const IP4_HDR_LEN: u16 = 20;
pub const IP6_HDR_LEN: u16 = 40;

/// Before a TCP SYN or SYN-ACK enters the tunnel: lower its MSS option so that full-size
/// segments still fit the tunnel MTU (`tunnel_mtu - IP header - 20`), counted as
/// `MSS_CLAMPED`. Anything else is left alone.
#[inline(always)]
pub fn clamp_syn(
    ctx: &TcContext,
    proto: u8,
    l4_off: usize,
    l4: &crate::parse::L4,
    tunnel_mtu: u16,
    ip_hdr_len: u16,
) {
    if proto == crate::parse::PROTO_TCP
        && l4.tcp_flags & crate::parse::TCP_SYN != 0
        && matches!(
            crate::rewrite::clamp_mss(ctx, l4_off, l4, tunnel_mtu.saturating_sub(ip_hdr_len + 20)),
            Ok(true)
        )
    {
        crate::counters::count(ctx, egress_common::counters::reason::MSS_CLAMPED);
    }
}
