//! `from_pod`: packets leaving local pods. Unselected pods cost one hash lookup (and, with
//! `--unknown-pods drop`, the checks of [`unknown`]); a
//! selected (pod, destination) goes to its gateway through the tunnel, or straight into
//! the gateway path when this node is the gateway (whose RSTs are sent from `run`'s
//! frame: `reset::deferred4`).

use aya_ebpf::{btf_maps::lpm_trie::Key, programs::TcContext};
use egress_common::{
    counters::reason,
    policy::{action, selected_flags},
};

use crate::{
    counters::{OK, SHOT, count, verdict},
    gateway,
    handoff::Origin,
    maps::{self, SELECTED_V4, SELECTED_V6},
    netpol, parse, parse6, policy, reset, scratch, source, tunnel, underlay, unknown,
};

#[inline(always)]
pub fn run(ctx: &TcContext) -> i32 {
    if let Some(src) = parse::ipv4_src(ctx) {
        let Some(sel) = (unsafe { SELECTED_V4.get(src) }) else {
            return unknown::check4(ctx, &src);
        };
        if source::elsewhere4(ctx, &src) {
            return verdict(ctx, reason::DROP_SOURCE_DEVICE, SHOT);
        }
        return reset::deferred4(ctx, selected(ctx, sel.lengths, sel.flags));
    }
    if !parse6::IPV6_DATAPATH {
        return OK;
    }
    if let Some(src) = parse6::ipv6_src(ctx) {
        let Some(sel) = (unsafe { SELECTED_V6.get(src.bytes()) }) else {
            return unknown::check6(ctx, src.bytes());
        };
        if source::elsewhere6(ctx, src.bytes()) {
            return verdict(ctx, reason::DROP_SOURCE_DEVICE, SHOT);
        }
        let l = &sel.lengths;
        return reset::deferred6(ctx, selected6(ctx, l[0], l[1], l[2], sel.flags));
    }
    OK
}

/// What `from_pod` does with a policy hit, by action; `None` for `FORWARD`.
#[inline(always)]
fn non_forward(ctx: &TcContext, act: u8) -> Option<i32> {
    match act {
        action::FORWARD => None,
        action::EXCLUDE => Some(verdict(ctx, reason::EXCLUDED, OK)),
        action::NO_GATEWAY_PASS => Some(verdict(ctx, reason::FALLTHROUGH, OK)),
        action::DENY => Some(verdict(ctx, reason::DROP_NETWORK_POLICY, SHOT)),
        // NO_GATEWAY_DROP, and any value this program does not know: fail closed.
        _ => Some(verdict(ctx, reason::DROP_NO_GATEWAY, SHOT)),
    }
}

/// A packet of a selected IPv6 pod. Neighbour discovery and link-scoped destinations
/// (link-local, multicast) are the kernel's whatever the policy says: a `::/0` rule must
/// not tunnel a neighbour solicitation. The parsed headers and the policy key live in the
/// per-CPU scratch slot, which the gateway path then reads. `l0..l2`: the pod's prefix
/// lengths (`SelectedValueV6::lengths`), as scalars (an array would be copied to the
/// caller's stack, and the deepest chains of `from_pod` are at the verifier's 512 bytes);
/// `flags`: its `selected_flags`.
#[inline(never)]
fn selected6(ctx: &TcContext, l0: u64, l1: u64, l2: u64, flags: u32) -> i32 {
    let Some(s) = scratch::scratch() else {
        return OK;
    };
    match parse6::parse(ctx, &mut s.ip6) {
        parse6::PARSED => {}
        parse6::NOT_IPV6 => return OK,
        _ => return verdict(ctx, reason::MALFORMED_PASSED, OK),
    }
    if parse6::link_scoped(&s.ip6.dst) || parse6::is_ndp(ctx, &s.ip6) {
        return OK;
    }
    s.policy6.pod = s.ip6.src;
    s.dest6 = Key::new(128, s.ip6.dst);
    // No entry: the destination is outside every rule of this pod, or the pod's entries
    // did not fit the map (then it is dropped wherever a rule covers it).
    let Some(entry) = policy::lookup6(&mut s.policy6, &s.dest6, &[l0, l1, l2]) else {
        if flags & selected_flags::INCOMPLETE != 0 {
            return incomplete6(ctx, &s.ip6.dst);
        }
        return OK;
    };
    if let Some(v) = non_forward(ctx, entry.action) {
        return v;
    }
    let Some(cfg) = maps::config() else {
        return verdict(ctx, reason::DROP_NOT_READY, SHOT);
    };
    s.l4 = match parse6::l4(ctx, &s.ip6) {
        Ok(l4) => l4,
        Err(b) => return verdict(ctx, b.drop_reason(), SHOT),
    };
    if entry.filter != 0 && !netpol::allows(u32::from(entry.filter), s.ip6.proto, s.l4.dport_be) {
        return verdict(ctx, reason::DROP_NETWORK_POLICY, SHOT);
    }
    let gw = underlay::gateway6(entry);
    if gw == underlay::node_ip(cfg) {
        count(ctx, reason::LOCAL_GATEWAY);
        s.x6.origin = Origin {
            rule_id: entry.rule_id,
            pod_node: cfg.node_ip,
        };
        return gateway::forward6(ctx, cfg, s);
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
        gw,
        entry.rule_id,
        reason::TUNNELED,
    )
}

/// A packet of a selected IPv4 pod whose prefix lengths are `lengths`
/// (`SelectedValueV4::lengths`), with `flags` (`selected_flags`). Link-local, multicast
/// and broadcast destinations are the node's whatever the policy says
/// ([`parse::link_scoped4`]): a `0.0.0.0/0` rule must not tunnel DNS to NodeLocal
/// DNSCache (169.254.20.10) or a request for the cloud's metadata.
#[inline(never)]
fn selected(ctx: &TcContext, lengths: u64, flags: u32) -> i32 {
    let ip = match parse::ipv4(ctx) {
        Ok(ip) => ip,
        Err(_) => return verdict(ctx, reason::MALFORMED_PASSED, OK),
    };
    if parse::link_scoped4(ip.dst) {
        return OK;
    }
    // No entry: the destination is outside every rule of this pod, or the pod's entries
    // did not fit the map (then it is dropped wherever a rule covers it).
    let Some(entry) = policy::lookup4(ip.src, ip.dst, lengths) else {
        if flags & selected_flags::INCOMPLETE != 0 {
            return incomplete4(ctx, ip.dst);
        }
        return OK;
    };
    if let Some(v) = non_forward(ctx, entry.action) {
        return v;
    }
    let Some(cfg) = maps::config() else {
        return verdict(ctx, reason::DROP_NOT_READY, SHOT);
    };
    let l4 = match parse::l4(ctx, &ip) {
        Ok(l4) => l4,
        Err(b) => return verdict(ctx, b.drop_reason(), SHOT),
    };
    if entry.filter != 0 && !netpol::allows(u32::from(entry.filter), ip.proto, l4.dport_be) {
        return verdict(ctx, reason::DROP_NETWORK_POLICY, SHOT);
    }
    let gw = underlay::gateway(entry);
    if gw == underlay::node_ip(cfg) {
        count(ctx, reason::LOCAL_GATEWAY);
        return gateway::forward(ctx, cfg, &ip, &l4, entry.rule_id, cfg.node_ip);
    }
    let inner = tunnel::Inner {
        proto: ip.proto,
        l4_off: ip.l4,
        l4: &l4,
        ip_hdr_len: tunnel::IP4_HDR_LEN,
    };
    tunnel::enter(ctx, cfg, &inner, gw, entry.rule_id, reason::TUNNELED)
}

/// A packet of a pod whose policy entries did not fit the map, to `dst`: dropped where a
/// rule covers it. A frame of its own: the LPM key stays off the stack of `selected`,
/// whose deep chains into the gateway path are near the verifier's 512-byte limit (Linux
/// 6.1 refused `from_pod` with the check inlined: 544 bytes).
#[inline(never)]
fn incomplete4(ctx: &TcContext, dst: [u8; 4]) -> i32 {
    if unknown::covered4(dst) {
        return verdict(ctx, reason::DROP_POLICY_MAP_FULL, SHOT);
    }
    OK
}

/// [`incomplete4`] for an IPv6 destination (read from the scratch slot).
#[inline(never)]
fn incomplete6(ctx: &TcContext, dst: &[u8; 16]) -> i32 {
    if unknown::covered6(*dst) {
        return verdict(ctx, reason::DROP_POLICY_MAP_FULL, SHOT);
    }
    OK
}
