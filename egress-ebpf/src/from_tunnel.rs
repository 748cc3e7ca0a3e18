//! `from_tunnel`: packets arriving on our VXLAN device. A rule id in the VNI means "egress
//! this for me" (gateway role); `RETURN_VNI` means "a reply for one of your pods".
//! Either way the sender must be a known node, and the inner address must belong to it
//! (forward) or to us (return).

use aya_ebpf::programs::TcContext;
use egress_common::{counters::reason, policy::RETURN_VNI};

use crate::{
    counters::{OK, SHOT, verdict},
    fib, gateway,
    maps::{self, NODES, POD_OWNER_V4},
    parse::{self, Bad},
    tunnel,
};

#[inline(always)]
pub fn run(ctx: &TcContext) -> i32 {
    let ip = match parse::ipv4(ctx) {
        Ok(Some(ip)) => ip,
        // ARP and anything else that is not IPv4: not ours.
        Ok(None) => return OK,
        Err(_) => return verdict(ctx, reason::DROP_MALFORMED, SHOT),
    };
    let Some(cfg) = maps::config() else {
        return verdict(ctx, reason::DROP_NOT_READY, SHOT);
    };
    let Some(meta) = tunnel::received(ctx) else {
        return verdict(ctx, reason::DROP_UNKNOWN_SENDER, SHOT);
    };
    if unsafe { NODES.get(meta.sender) }.is_none() {
        return verdict(ctx, reason::DROP_UNKNOWN_SENDER, SHOT);
    }
    if meta.vni == RETURN_VNI {
        // A reply the gateway translated back: the destination must be a pod of ours.
        match unsafe { POD_OWNER_V4.get(ip.dst) } {
            Some(o) if o.node == cfg.node_ip => {}
            _ => return verdict(ctx, reason::DROP_NOT_LOCAL_POD, SHOT),
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
    // Gateway role: the inner source must be a pod of the sending node.
    match unsafe { POD_OWNER_V4.get(ip.src) } {
        Some(o) if o.node == meta.sender => {}
        _ => return verdict(ctx, reason::DROP_SPOOFED_SOURCE, SHOT),
    }
    let l4 = match parse::l4(ctx, &ip) {
        Ok(l4) => l4,
        Err(Bad::Fragment) => return verdict(ctx, reason::DROP_FRAGMENT, SHOT),
        Err(Bad::Unsupported) => return verdict(ctx, reason::DROP_UNSUPPORTED_PROTO, SHOT),
        Err(Bad::Malformed) => return verdict(ctx, reason::DROP_MALFORMED, SHOT),
    };
    gateway::forward(ctx, cfg, &ip, &l4, meta.vni, meta.sender)
}
