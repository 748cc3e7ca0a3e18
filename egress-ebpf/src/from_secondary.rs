//! `from_secondary`: packets arriving on an egress interface. Replies to an egress IP
//! with a conntrack entry are translated back to the pod and sent to its node (`back`); packets to
//! a dedicated egress IP without an entry are dropped (never handed to the host, which
//! would answer with RSTs for flows another gateway may take over). ICMP errors about a
//! translated flow go back to its pod the same way (`icmp_error`). Everything else passes,
//! and so does ICMPv6 neighbour discovery even to an egress IP: the kernel must answer
//! neighbour solicitations for the addresses it holds.

use aya_ebpf::programs::TcContext;
use egress_common::{counters::reason, policy::egress_ip_flags};

use crate::{
    back,
    conntrack::{self, v4, v6},
    counters::{OK, SHOT, count, verdict},
    icmp_error,
    maps::{self, EGRESS_IPS_V4, EGRESS_IPS_V6},
    parse, parse6, rewrite, scratch, underlay,
};

#[inline(always)]
pub fn run(ctx: &TcContext) -> i32 {
    match parse::ethertype(ctx) {
        Some(parse::ETH_P_IP_BE) => run4(ctx),
        Some(parse6::ETH_P_IPV6_BE) if parse6::IPV6_DATAPATH => run6(ctx),
        _ => OK,
    }
}

/// An IPv4 packet (out of line: see `from_tunnel::run4`).
#[inline(never)]
fn run4(ctx: &TcContext) -> i32 {
    let ip = match parse::ipv4_big(ctx) {
        Ok(ip) => ip,
        // Not parseable, so not known to be ours: the host decides.
        Err(_) => return OK,
    };
    let Some(eip) = (unsafe { EGRESS_IPS_V4.get(ip.dst) }) else {
        return OK;
    };
    let shared = eip.flags & egress_ip_flags::SHARED != 0;
    // Not ours after all (host traffic to a shared address), or refused.
    let miss = |r| if shared { OK } else { verdict(ctx, r, SHOT) };
    let Some(cfg) = maps::config() else {
        return miss(reason::DROP_NOT_READY);
    };
    if icmp_error::is_error4(ctx, &ip) {
        return icmp_error::translate4(ctx, &ip, shared);
    }
    let l4 = match parse::l4(ctx, &ip) {
        Ok(l4) => l4,
        Err(b) => return miss(b.drop_reason()),
    };
    let Some(e) = v4::lookup(&v4::reply_key(&ip, &l4), l4.tcp_flags, conntrack::now()) else {
        return miss(reason::DROP_NO_CONNTRACK);
    };
    if ip.ttl <= 1 {
        return verdict(ctx, reason::DROP_TTL_EXCEEDED, SHOT);
    }
    let (pod, port_be) = (e.xlate_addr, e.xlate_port_be);
    if rewrite::nat4(
        ctx,
        &ip,
        &l4,
        rewrite::Side::Destination,
        pod,
        port_be,
        None,
    )
    .is_err()
    {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    }
    count(ctx, reason::REVERSE_NAT);
    back::send4(ctx, cfg, &ip, &l4, e.xlate_addr, underlay::pod_node(e))
}

/// The same for IPv6: NAT66 reversed, hop limit, back through the tunnel or to a local
/// pod. The parsed headers, the conntrack key, the FIB parameters and the tunnel key live
/// in the per-CPU scratch slot.
#[inline(never)]
fn run6(ctx: &TcContext) -> i32 {
    let Some(s) = scratch::scratch() else {
        return OK;
    };
    if parse6::parse(ctx, &mut s.ip6) != parse6::PARSED {
        return OK;
    }
    // By reference: the key stays where `parse6::parse` stored it in words (a copy would
    // be made byte by byte, and the hash would wait on it).
    let dst: &[u8; 16] = &s.ip6.dst;
    let Some(eip) = (unsafe { EGRESS_IPS_V6.get(dst) }) else {
        return OK;
    };
    if parse6::is_ndp(ctx, &s.ip6) {
        return OK;
    }
    let shared = eip.flags & egress_ip_flags::SHARED != 0;
    let miss = |r| if shared { OK } else { verdict(ctx, r, SHOT) };
    let Some(cfg) = maps::config() else {
        return miss(reason::DROP_NOT_READY);
    };
    if icmp_error::is_error6(ctx, &s.ip6) {
        return icmp_error::translate6(ctx, s, shared);
    }
    s.l4 = match parse6::l4(ctx, &s.ip6) {
        Ok(l4) => l4,
        Err(b) => return miss(b.drop_reason()),
    };
    s.ct6.key = v6::reply_key(&s.ip6, &s.l4);
    let Some(e) = v6::lookup_in(
        &s.ct6.key,
        s.l4.tcp_flags,
        conntrack::now(),
        &mut s.ct6.peer,
    ) else {
        return miss(reason::DROP_NO_CONNTRACK);
    };
    if s.ip6.hop_limit <= 1 {
        return verdict(ctx, reason::DROP_TTL_EXCEEDED, SHOT);
    }
    let side = rewrite::Side::Destination;
    if rewrite::nat6(
        ctx,
        &s.ip6,
        &s.l4,
        side,
        &e.xlate_addr,
        e.xlate_port_be,
        None,
    )
    .is_err()
    {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    }
    count(ctx, reason::REVERSE_NAT);
    back::send6(ctx, cfg, s, &e.xlate_addr, underlay::pod_node6(e))
}
