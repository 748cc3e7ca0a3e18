//! `from_tunnel`: packets arriving on our VXLAN device, or decapsulated by `from_underlay`
//! (`crate::decap`) before they reach it. A rule id in the VNI means "egress
//! this for me" (gateway role); `RETURN_VNI` means "a reply for one of your pods".
//! Either way the sender must be a known node, and the inner address must belong to it
//! (forward) or to us (return). The inner packet is IPv4 or IPv6, and so is the underlay.
//!
//! On the forward path one lookup answers both: every pod owner names a known node (the
//! agent inserts a node into `NODES` before its pods' owners and removes it after them),
//! so an inner source owned by the sender proves the sender known. Only a packet that
//! fails the owner check asks `NODES`, to count the right reason.

use aya_ebpf::programs::TcContext;
use egress_common::{config::Config, counters::reason, policy::RETURN_VNI};

use crate::{
    counters::{OK, SHOT, verdict},
    fib, gateway,
    handoff::Origin,
    maps::{self, NODES, POD_OWNER_V4, POD_OWNER_V6},
    parse, parse6, pod_device, reset, scratch,
    tunnel::{self, Received},
};

/// A packet the tunnel device decapsulated: its metadata is the device's.
#[inline(always)]
pub fn run(ctx: &TcContext) -> i32 {
    run_from(ctx, None)
}

/// A tunneled packet, its metadata the device's (`pre` is `None`) or read from the
/// headers that `crate::decap` removed.
#[inline(always)]
pub fn run_from(ctx: &TcContext, pre: Option<&Received>) -> i32 {
    match parse::ethertype(ctx) {
        // The gateway path's RSTs are sent from this frame (`reset::deferred4`, `6`).
        Some(parse::ETH_P_IP_BE) => reset::deferred4(ctx, run4(ctx, pre)),
        Some(parse6::ETH_P_IPV6_BE) if parse6::IPV6_DATAPATH => {
            reset::deferred6(ctx, run6(ctx, pre))
        }
        // ARP and anything else.
        _ => OK,
    }
}

/// An inner IPv4 packet. Each family's path is a function of its own, so that the entry
/// point's stack frame stays empty under the other family's calls.
#[inline(never)]
fn run4(ctx: &TcContext, pre: Option<&Received>) -> i32 {
    let ip = match parse::ipv4_big(ctx) {
        Ok(ip) => ip,
        Err(_) => return verdict(ctx, reason::DROP_MALFORMED, SHOT),
    };
    let (cfg, meta) = match sender(ctx, pre) {
        Ok(s) => s,
        Err(v) => return v,
    };
    if meta.vni == RETURN_VNI {
        if !known(&meta) {
            return verdict(ctx, reason::DROP_UNKNOWN_SENDER, SHOT);
        }
        // A reply the gateway translated back: the destination must be a pod of ours.
        match unsafe { POD_OWNER_V4.get(ip.dst) } {
            Some(o) if o.node == cfg.node_ip => {}
            _ => return verdict(ctx, reason::DROP_NOT_LOCAL_POD, SHOT),
        }
        if let Some(v) = pod_device::from_gateway4(ctx, &ip.dst, &ip.src, &meta.sender) {
            return verdict(ctx, reason::RETURN_DELIVERED, v);
        }
        return match fib::redirect(
            ctx,
            &ip,
            ip.src,
            ip.dst,
            fib::From::Input(fib::ingress_ifindex(ctx)),
        ) {
            Ok(v) => verdict(ctx, reason::RETURN_DELIVERED, v),
            Err(()) => verdict(ctx, reason::DROP_FIB, SHOT),
        };
    }
    // Gateway role: the inner source must be a pod of the sending node (which is then
    // known: see the module comment).
    match unsafe { POD_OWNER_V4.get(ip.src) } {
        Some(o) if o.node == meta.sender => {}
        _ => return not_owned(ctx, &meta),
    }
    let l4 = match parse::l4(ctx, &ip) {
        Ok(l4) => l4,
        Err(b) => return verdict(ctx, b.drop_reason(), SHOT),
    };
    gateway::forward(ctx, cfg, &ip, &l4, meta.vni, meta.sender)
}

/// The node's configuration and the tunnel metadata of a packet (`pre`, or the
/// device's), or the verdict of one without. Whether the sender is known is the caller's check ([`known`], or the owner
/// check with [`not_owned`]).
#[inline(always)]
fn sender(ctx: &TcContext, pre: Option<&Received>) -> Result<(&'static Config, Received), i32> {
    let Some(cfg) = maps::config() else {
        return Err(verdict(ctx, reason::DROP_NOT_READY, SHOT));
    };
    let meta = match pre {
        Some(m) => *m,
        None => match tunnel::received(ctx) {
            Some(m) => m,
            None => return Err(verdict(ctx, reason::DROP_UNKNOWN_SENDER, SHOT)),
        },
    };
    Ok((cfg, meta))
}

/// Whether the packet's sender is a known node.
#[inline(always)]
fn known(meta: &Received) -> bool {
    unsafe { NODES.get(meta.sender) }.is_some()
}

/// The verdict of a packet whose inner source is not a pod of its sender: from an
/// unknown sender, or spoofed by a known one.
#[inline(always)]
fn not_owned(ctx: &TcContext, meta: &Received) -> i32 {
    if known(meta) {
        verdict(ctx, reason::DROP_SPOOFED_SOURCE, SHOT)
    } else {
        verdict(ctx, reason::DROP_UNKNOWN_SENDER, SHOT)
    }
}

/// The same for an inner IPv6 packet (kept out of line: the verifier sees each family's
/// path once). Its parsed headers live in the per-CPU scratch slot.
#[inline(never)]
fn run6(ctx: &TcContext, pre: Option<&Received>) -> i32 {
    let Some(s) = scratch::scratch() else {
        return OK;
    };
    match parse6::parse(ctx, &mut s.ip6) {
        parse6::PARSED => {}
        parse6::NOT_IPV6 => return OK,
        _ => return verdict(ctx, reason::DROP_MALFORMED, SHOT),
    }
    let (cfg, meta) = match sender(ctx, pre) {
        Ok(s) => s,
        Err(v) => return v,
    };
    if meta.vni == RETURN_VNI {
        if !known(&meta) {
            return verdict(ctx, reason::DROP_UNKNOWN_SENDER, SHOT);
        }
        // By reference (also below): the key stays where `parse6::parse` stored it in
        // words; a copy would be made byte by byte, and the hash would wait on it.
        let dst: &[u8; 16] = &s.ip6.dst;
        match unsafe { POD_OWNER_V6.get(dst) } {
            Some(o) if o.node == cfg.node_ip => {}
            _ => return verdict(ctx, reason::DROP_NOT_LOCAL_POD, SHOT),
        }
        s.x6.origin.pod_node = meta.sender;
        if let Some(v) = pod_device::from_gateway6(ctx, s) {
            return verdict(ctx, reason::RETURN_DELIVERED, v);
        }
        return match fib::redirect6(
            ctx,
            &mut s.fib,
            s.ip6.proto,
            &s.ip6.src,
            &s.ip6.dst,
            &fib::From::Input(fib::ingress_ifindex(ctx)),
            0,
        ) {
            Ok((v, _)) => verdict(ctx, reason::RETURN_DELIVERED, v),
            Err(_) => verdict(ctx, reason::DROP_FIB, SHOT),
        };
    }
    let src: &[u8; 16] = &s.ip6.src;
    match unsafe { POD_OWNER_V6.get(src) } {
        Some(o) if o.node == meta.sender => {}
        _ => return not_owned(ctx, &meta),
    }
    s.l4 = match parse6::l4(ctx, &s.ip6) {
        Ok(l4) => l4,
        Err(b) => return verdict(ctx, b.drop_reason(), SHOT),
    };
    s.x6.origin = Origin {
        rule_id: meta.vni,
        pod_node: meta.sender,
    };
    gateway::forward6(ctx, cfg, s)
}
