//! `from_pod`: packets leaving local pods. Unselected pods cost one hash lookup; a
//! selected (pod, destination) goes to its gateway through the tunnel, or straight into
//! the gateway path when this node is the gateway.

use aya_ebpf::{btf_maps::lpm_trie::Key, programs::TcContext};
use egress_common::{
    counters::reason,
    policy::{POD_PREFIX_BITS_V4, PolicyKeyV4, action},
};

use crate::{
    counters::{OK, SHOT, count, verdict},
    gateway,
    maps::{self, POLICY_V4, SELECTED_V4},
    parse::{self, Bad, PROTO_TCP, TCP_SYN},
    rewrite, tunnel,
};

/// IPv4 + TCP headers without options.
const TCP_IP_HDRS: u16 = 40;

#[inline(always)]
pub fn run(ctx: &TcContext) -> i32 {
    let Some(src) = parse::ipv4_src(ctx) else {
        return OK;
    };
    if unsafe { SELECTED_V4.get(src) }.is_none() {
        return OK;
    }
    selected(ctx)
}

#[inline(never)]
fn selected(ctx: &TcContext) -> i32 {
    let ip = match parse::ipv4(ctx) {
        Ok(Some(ip)) => ip,
        Ok(None) => return OK,
        Err(_) => return verdict(ctx, reason::MALFORMED_PASSED, OK),
    };
    let key = Key::new(
        POD_PREFIX_BITS_V4 + 32,
        PolicyKeyV4 {
            pod: ip.src,
            dst: ip.dst,
        },
    );
    // No entry: the destination is outside every rule of this pod.
    let Some(entry) = POLICY_V4.get(&key) else {
        return OK;
    };
    match entry.action {
        action::FORWARD => {}
        action::EXCLUDE => return verdict(ctx, reason::EXCLUDED, OK),
        action::NO_GATEWAY_PASS => return verdict(ctx, reason::FALLTHROUGH, OK),
        // NO_GATEWAY_DROP, and any value this program does not know: fail closed.
        _ => return verdict(ctx, reason::DROP_NO_GATEWAY, SHOT),
    }
    let Some(cfg) = maps::config() else {
        return verdict(ctx, reason::DROP_NOT_READY, SHOT);
    };
    let l4 = match parse::l4(ctx, &ip) {
        Ok(l4) => l4,
        Err(Bad::Fragment) => return verdict(ctx, reason::DROP_FRAGMENT, SHOT),
        Err(Bad::Unsupported) => return verdict(ctx, reason::DROP_UNSUPPORTED_PROTO, SHOT),
        Err(Bad::Malformed) => return verdict(ctx, reason::DROP_MALFORMED, SHOT),
    };
    if entry.gateway == cfg.node_ip {
        count(ctx, reason::LOCAL_GATEWAY);
        return gateway::forward(ctx, cfg, &ip, &l4, entry.rule_id, cfg.node_ip);
    }
    if ip.proto == PROTO_TCP
        && l4.tcp_flags & TCP_SYN != 0
        && matches!(
            rewrite::clamp_mss(ctx, &ip, &l4, cfg.tunnel_mtu.saturating_sub(TCP_IP_HDRS)),
            Ok(true)
        )
    {
        count(ctx, reason::MSS_CLAMPED);
    }
    match tunnel::send(ctx, cfg.tunnel_ifindex, entry.gateway, entry.rule_id) {
        Ok(v) => verdict(ctx, reason::TUNNELED, v),
        Err(()) => verdict(ctx, reason::DROP_TUNNEL_KEY, SHOT),
    }
}
