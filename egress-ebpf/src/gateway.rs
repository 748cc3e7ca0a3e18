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

/// The translation of an IPv6 flow: in, who sent it; out, its egress IP, port and
/// interface.
struct Xlate6 {
    origin: Origin,
    egress_ip: [u8; 16],
    port_be: u16,
    ifindex: u32,
}

/// [`forward`] for IPv6: NAT66 to the rule's egress IPv6, hop limit, FIB lookup (IPv6)
/// restricted to the rule's interface. Out of line, and in out-of-line steps
/// ([`translate6`], [`fib::redirect6`]) called one after the other: BPF calls nest their
/// stack frames into one 512-byte budget, and 40-byte conntrack keys and entries add up.
/// (A BPF call takes at most five arguments, hence [`Origin`].)
#[inline(never)]
pub fn forward6(ctx: &TcContext, cfg: &Config, ip: &Ipv6, l4: &L4, origin: Origin) -> i32 {
    if ip.hop_limit <= 1 {
        return verdict(ctx, reason::DROP_TTL_EXCEEDED, SHOT);
    }
    let mut x = Xlate6 {
        origin,
        egress_ip: [0; 16],
        port_be: 0,
        ifindex: 0,
    };
    let v = translate6(ctx, cfg, ip, l4, &mut x);
    if v != TRANSLATED {
        return v;
    }
    if rewrite::snat6(ctx, ip, l4, &x.egress_ip, x.port_be).is_err()
        || rewrite::dec_hop_limit(ctx, ip).is_err()
    {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    }
    match fib::redirect6(
        ctx,
        ip.proto,
        &x.egress_ip,
        &ip.dst,
        &fib::From::Output(x.ifindex),
    ) {
        Ok(v) => verdict(ctx, reason::FORWARDED, v),
        Err(()) => verdict(ctx, reason::DROP_FIB, SHOT),
    }
}

/// What [`translate6`] returns when `x` is filled in: not a TC verdict.
const TRANSLATED: i32 = i32::MIN;

/// The flow's translation: its conntrack entry, or a new one from its rule. An
/// established flow keeps what it started with. Returns [`TRANSLATED`], or the verdict
/// of a refused packet (a plain integer: a `Result` would travel through a hidden
/// argument, and BPF calls take five). Lookup and creation are sibling calls, so their
/// 40-byte keys and entries never sit on the stack at the same time.
#[inline(always)]
fn translate6(ctx: &TcContext, cfg: &Config, ip: &Ipv6, l4: &L4, x: &mut Xlate6) -> i32 {
    if lookup6(ip, l4, x) {
        count(ctx, reason::SNAT_HIT);
        return TRANSLATED;
    }
    create6(ctx, cfg, ip, l4, x)
}

/// Whether the flow has a live entry; fills in `x` from it.
#[inline(never)]
fn lookup6(ip: &Ipv6, l4: &L4, x: &mut Xlate6) -> bool {
    match v6::lookup(&v6::original_key(ip, l4), l4.tcp_flags, conntrack::now()) {
        Some(e) => {
            x.egress_ip = e.xlate_addr;
            x.port_be = e.xlate_port_be;
            x.ifindex = e.ifindex;
            true
        }
        None => false,
    }
}

/// A new flow: its rule's egress IP and a port, both conntrack entries.
#[inline(never)]
fn create6(ctx: &TcContext, cfg: &Config, ip: &Ipv6, l4: &L4, x: &mut Xlate6) -> i32 {
    let Origin { rule_id, pod_node } = x.origin;
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
        conntrack::now(),
    ) {
        Ok(port_be) => {
            count(ctx, reason::SNAT_NEW);
            x.egress_ip = rule.egress_ip;
            x.port_be = port_be;
            x.ifindex = rule.ifindex;
            TRANSLATED
        }
        Err(AllocError::PortsExhausted) => verdict(ctx, reason::DROP_PORT_EXHAUSTED, SHOT),
        Err(AllocError::InsertFailed) => verdict(ctx, reason::DROP_CT_INSERT, SHOT),
    }
}
