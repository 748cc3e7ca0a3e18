//! The last step of the return path: a packet already translated back to its pod (a
//! reply, from `from_secondary`, or an ICMP error about its flow, from `icmp_error`) goes
//! to the pod, through the tunnel to the pod's node with `RETURN_VNI`, or, for a pod on
//! this node, straight to its device (into the pod: `crate::pod_device`).

use aya_ebpf::programs::TcContext;
use egress_common::{config::Config, counters::reason, policy::RETURN_VNI};

use crate::{
    counters::{SHOT, verdict},
    fib,
    parse::{Ipv4, L4},
    pod_device,
    scratch::Scratch,
    tunnel,
    underlay::{self, Words},
};

/// Send a packet translated back to `pod` (a reply, or an ICMP error about its flow) to
/// the pod: through the tunnel to its node `pod_node` with `RETURN_VNI`, or, for a pod
/// on this node, to its device.
#[inline(always)]
pub fn send4(
    ctx: &TcContext,
    cfg: &Config,
    ip: &Ipv4,
    l4: &L4,
    pod: [u8; 4],
    pod_node: Words,
) -> i32 {
    if pod_node == underlay::node_ip(cfg) {
        if let Some(v) = pod_device::into4(ctx, &pod) {
            return verdict(ctx, reason::FORWARDED, v);
        }
        return match fib::redirect(
            ctx,
            ip,
            ip.src,
            pod,
            fib::From::Input(fib::ingress_ifindex(ctx)),
        ) {
            Ok(v) => verdict(ctx, reason::FORWARDED, v),
            Err(()) => verdict(ctx, reason::DROP_FIB, SHOT),
        };
    }
    let inner = tunnel::Inner {
        proto: ip.proto,
        l4_off: ip.l4,
        l4,
        ip_hdr_len: tunnel::IP4_HDR_LEN,
    };
    tunnel::enter(
        ctx,
        cfg,
        &inner,
        pod_node,
        RETURN_VNI,
        reason::RETURN_TUNNELED,
    )
}

/// [`send4`] for IPv6: the packet's headers (`s.ip6`, `s.l4`), the FIB parameters and
/// the tunnel key are in the scratch slot `s`.
#[inline(always)]
pub fn send6(
    ctx: &TcContext,
    cfg: &Config,
    s: &mut Scratch,
    pod: &[u8; 16],
    pod_node: Words,
) -> i32 {
    if pod_node == underlay::node_ip(cfg) {
        if let Some(v) = pod_device::into6(ctx, pod) {
            return verdict(ctx, reason::FORWARDED, v);
        }
        return match fib::redirect6(
            ctx,
            &mut s.fib,
            s.ip6.proto,
            &s.ip6.src,
            pod,
            &fib::From::Input(fib::ingress_ifindex(ctx)),
            0,
        ) {
            Ok((v, _)) => verdict(ctx, reason::FORWARDED, v),
            Err(_) => verdict(ctx, reason::DROP_FIB, SHOT),
        };
    }
    let inner = tunnel::Inner {
        proto: s.ip6.proto,
        l4_off: s.ip6.l4,
        l4: &s.l4,
        ip_hdr_len: tunnel::IP6_HDR_LEN,
    };
    tunnel::enter_with(
        ctx,
        cfg,
        &inner,
        &mut s.tunnel,
        pod_node,
        RETURN_VNI,
        reason::RETURN_TUNNELED,
    )
}
