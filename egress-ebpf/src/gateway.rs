//! The gateway's forward path, shared by `from_tunnel` (pods of other nodes) and
//! `from_pod` (pods on the gateway itself): SNAT with conntrack, TTL, next hop. One
//! function per family: IPv6 (NAT66) takes its rule from `RULES_V6`, its flows from
//! `CT_V6`, and has a hop limit without a header checksum.

use aya_ebpf::programs::TcContext;
use egress_common::{config::Config, counters::reason};

use crate::{
    conntrack::{self, AllocError, v4, v6},
    counters::{SHOT, count, verdict},
    fib,
    maps::{RULES_V4, RULES_V6},
    parse::{Ipv4, L4},
    parse6::Ipv6,
    rewrite,
};

/// Translate and send out a packet of `rule_id` from a pod of `pod_node`.
#[inline(always)]
pub fn forward(
    ctx: &TcContext,
    cfg: &Config,
    ip: &Ipv4,
    l4: &L4,
    rule_id: u32,
    pod_node: [u8; 4],
) -> i32 {
    if ip.ttl <= 1 {
        return verdict(ctx, reason::DROP_TTL_EXCEEDED, SHOT);
    }
    let now = conntrack::now();
    // An established flow keeps the egress IP and interface it started with, even if the
    // rule changed since: decided once per flow.
    let (egress_ip, port_be, ifindex) =
        match v4::lookup(&v4::original_key(ip, l4), l4.tcp_flags, now) {
            Some(e) => {
                count(ctx, reason::SNAT_HIT);
                (e.xlate_addr, e.xlate_port_be, e.ifindex)
            }
            None => {
                let Some(rule) = (unsafe { RULES_V4.get(rule_id) }) else {
                    return verdict(ctx, reason::DROP_UNKNOWN_RULE, SHOT);
                };
                match v4::create(
                    cfg,
                    ip,
                    l4,
                    rule.egress_ip,
                    rule.ifindex,
                    rule_id,
                    pod_node,
                    now,
                ) {
                    Ok(port_be) => {
                        count(ctx, reason::SNAT_NEW);
                        (rule.egress_ip, port_be, rule.ifindex)
                    }
                    Err(AllocError::PortsExhausted) => {
                        return verdict(ctx, reason::DROP_PORT_EXHAUSTED, SHOT);
                    }
                    Err(AllocError::InsertFailed) => {
                        return verdict(ctx, reason::DROP_CT_INSERT, SHOT);
                    }
                }
            }
        };
    if rewrite::snat(ctx, ip, l4, egress_ip, port_be).is_err() || rewrite::dec_ttl(ctx, ip).is_err()
    {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    }
    match fib::redirect(ctx, ip, egress_ip, ip.dst, fib::From::Output(ifindex)) {
        Ok(v) => verdict(ctx, reason::FORWARDED, v),
        Err(()) => verdict(ctx, reason::DROP_FIB, SHOT),
    }
}

/// Who sent a packet into the gateway path: its rule and the pod's node.
#[derive(Clone, Copy)]
pub struct Origin {
    pub rule_id: u32,
    pub pod_node: [u8; 4],
}

/// [`forward`] for IPv6: NAT66 to the rule's egress IPv6, hop limit, FIB lookup (IPv6)
/// restricted to the rule's interface. Out of line (a BPF call takes at most five
/// arguments, hence [`Origin`]): its conntrack keys and entries are 40 bytes each, and
/// inlined into its callers they would not fit their 512-byte stack frames.
#[inline(never)]
pub fn forward6(ctx: &TcContext, cfg: &Config, ip: &Ipv6, l4: &L4, origin: Origin) -> i32 {
    let Origin { rule_id, pod_node } = origin;
    if ip.hop_limit <= 1 {
        return verdict(ctx, reason::DROP_TTL_EXCEEDED, SHOT);
    }
    let now = conntrack::now();
    let (egress_ip, port_be, ifindex) =
        match v6::lookup(&v6::original_key(ip, l4), l4.tcp_flags, now) {
            Some(e) => {
                count(ctx, reason::SNAT_HIT);
                (e.xlate_addr, e.xlate_port_be, e.ifindex)
            }
            None => {
                let Some(rule) = (unsafe { RULES_V6.get(rule_id) }) else {
                    return verdict(ctx, reason::DROP_UNKNOWN_RULE, SHOT);
                };
                match v6::create(
                    cfg,
                    ip,
                    l4,
                    rule.egress_ip,
                    rule.ifindex,
                    rule_id,
                    pod_node,
                    now,
                ) {
                    Ok(port_be) => {
                        count(ctx, reason::SNAT_NEW);
                        (rule.egress_ip, port_be, rule.ifindex)
                    }
                    Err(AllocError::PortsExhausted) => {
                        return verdict(ctx, reason::DROP_PORT_EXHAUSTED, SHOT);
                    }
                    Err(AllocError::InsertFailed) => {
                        return verdict(ctx, reason::DROP_CT_INSERT, SHOT);
                    }
                }
            }
        };
    if rewrite::snat6(ctx, ip, l4, &egress_ip, port_be).is_err()
        || rewrite::dec_hop_limit(ctx, ip).is_err()
    {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    }
    match fib::redirect6(
        ctx,
        ip.proto,
        &egress_ip,
        &ip.dst,
        fib::From::Output(ifindex),
    ) {
        Ok(v) => verdict(ctx, reason::FORWARDED, v),
        Err(()) => verdict(ctx, reason::DROP_FIB, SHOT),
    }
}
