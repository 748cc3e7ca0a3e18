//! The gateway's forward path, shared by `from_tunnel` (pods of other nodes) and
//! `from_pod` (pods on the gateway itself): SNAT with conntrack, TTL, next hop.

use aya_ebpf::programs::TcContext;
use egress_common::{config::Config, counters::reason};

use crate::{
    conntrack::{self, AllocError},
    counters::{SHOT, count, verdict},
    fib,
    maps::RULES_V4,
    parse::{Ipv4, L4},
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
        match conntrack::lookup(&conntrack::original_key(ip, l4), l4.tcp_flags, now) {
            Some(e) => {
                count(ctx, reason::SNAT_HIT);
                (e.xlate_addr, e.xlate_port_be, e.ifindex)
            }
            None => {
                let Some(rule) = (unsafe { RULES_V4.get(rule_id) }) else {
                    return verdict(ctx, reason::DROP_UNKNOWN_RULE, SHOT);
                };
                match conntrack::create(
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
