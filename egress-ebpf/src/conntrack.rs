//! Conntrack for the SNAT on the gateway: lookups with idle timeouts, TCP state, and
//! port allocation that claims the reply tuple atomically. One body of code, stamped out
//! per address family ([`v4`] on `CT_V4`, [`v6`] on `CT_V6`): the two differ only in
//! their types.

use aya_ebpf::helpers::generated::bpf_ktime_get_ns;
use egress_common::conntrack::{state, timeout};

use crate::parse::{PROTO_TCP, PROTO_UDP, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

#[inline(always)]
pub fn now() -> u64 {
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
pub fn idle_timeout(proto: u8, st: u8) -> u64 {
    match (proto, st) {
        (PROTO_TCP, state::ESTABLISHED) => timeout::TCP_ESTABLISHED,
        (PROTO_TCP, state::CLOSING) => timeout::TCP_CLOSING,
        (PROTO_TCP, _) => timeout::TCP_NEW,
        (PROTO_UDP, _) => timeout::UDP,
        _ => timeout::ICMP,
    }
}

#[inline(always)]
pub fn next_state(proto: u8, cur: u8, tcp_flags: u8) -> u8 {
    if proto != PROTO_TCP {
        return state::ESTABLISHED;
    }
    if tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        state::CLOSING
    } else if tcp_flags & TCP_SYN == 0 && tcp_flags & TCP_ACK != 0 && cur == state::NEW {
        state::ESTABLISHED
    } else {
        cur
    }
}

pub enum AllocError {
    PortsExhausted,
    InsertFailed,
}

/// The conntrack functions of one family: `$Ip` is its parsed header (with `src`, `dst`
/// and `proto`), `$Addr` its address, `$pad` the entry's padding field if it has one.
macro_rules! family {
    ($(#[$doc:meta])* $name:ident, $Ip:ty, $Addr:ty, $Key:ident, $Entry:ident, $MAP:ident $(, $pad:ident)?) => {
        $(#[$doc])*
        pub mod $name {
            use aya_ebpf::{
                bindings::{BPF_ANY, BPF_NOEXIST},
                helpers::generated::bpf_get_prandom_u32,
            };
            use egress_common::{
                config::Config,
                conntrack::{$Entry, $Key, PORT_ALLOC_TRIES, dir, state},
            };

            use super::{AllocError, idle_timeout, next_state};
            use crate::{
                maps::$MAP,
                parse::{L4, PROTO_TCP},
            };

            /// The original-direction key of a packet from a pod.
            #[inline(always)]
            pub fn original_key(ip: &$Ip, l4: &L4) -> $Key {
                $Key {
                    src: ip.src,
                    dst: ip.dst,
                    src_port_be: l4.sport_be,
                    dst_port_be: l4.dport_be,
                    proto: ip.proto,
                    dir: dir::ORIGINAL,
                    _pad: [0; 2],
                }
            }

            /// The reply-direction key of a packet arriving for an egress IP.
            #[inline(always)]
            pub fn reply_key(ip: &$Ip, l4: &L4) -> $Key {
                $Key {
                    src: ip.src,
                    dst: ip.dst,
                    src_port_be: l4.sport_be,
                    dst_port_be: l4.dport_be,
                    proto: ip.proto,
                    dir: dir::REPLY,
                    _pad: [0; 2],
                }
            }

            #[inline(always)]
            fn expired(proto: u8, e: &$Entry, now: u64) -> bool {
                now.saturating_sub(e.last_seen_ns) > idle_timeout(proto, e.state)
            }

            /// The key of the other direction's entry of the flow that (`key`, `e`) belongs to.
            #[inline(always)]
            fn partner_key(key: &$Key, e: &$Entry) -> $Key {
                if key.dir == dir::ORIGINAL {
                    $Key {
                        src: key.dst,
                        dst: e.xlate_addr,
                        src_port_be: key.dst_port_be,
                        dst_port_be: e.xlate_port_be,
                        proto: key.proto,
                        dir: dir::REPLY,
                        _pad: [0; 2],
                    }
                } else {
                    $Key {
                        src: e.xlate_addr,
                        dst: key.src,
                        src_port_be: e.xlate_port_be,
                        dst_port_be: key.src_port_be,
                        proto: key.proto,
                        dir: dir::ORIGINAL,
                        _pad: [0; 2],
                    }
                }
            }

            /// Whether the flow of (`key`, `e`) has seen a packet within its timeout in either
            /// direction. Each direction refreshes only its own entry (one lookup per packet), so
            /// an entry that looks idle asks its partner before the flow counts as over: a one-way
            /// stream must keep both its translation and its claim on the reply tuple. Only paid
            /// on the expired path.
            #[inline(always)]
            fn flow_live(key: &$Key, e: &$Entry, now: u64) -> bool {
                if !expired(key.proto, e, now) {
                    return true;
                }
                let pk = partner_key(key, e);
                let Some(p) = $MAP.get_ptr(pk) else {
                    return false;
                };
                // SAFETY: valid map value pointer, read only.
                let p = unsafe { &*p };
                // The partner must still belong to this flow (its slot may have been reused).
                !expired(key.proto, p, now) && partner_key(&pk, p) == *key
            }

            /// A live entry for `key`: refreshes its last-seen time and TCP state, and returns a copy.
            /// Entries of flows idle in both directions count as absent.
            #[inline(always)]
            pub fn lookup(key: &$Key, tcp_flags: u8, now: u64) -> Option<$Entry> {
                let e = $MAP.get_ptr_mut(key)?;
                // SAFETY: valid map value pointer; concurrent updates of these fields only race on
                // timestamps and state, which are advisory.
                let e = unsafe { &mut *e };
                if !flow_live(key, e, now) {
                    return None;
                }
                e.last_seen_ns = now;
                e.state = next_state(key.proto, e.state, tcp_flags);
                Some(*e)
            }

            /// Create both entries of a new flow. Keeps the pod's port when it is free for
            /// (destination, egress IP), else tries random ports of the configured range.
            /// Returns the chosen port (network order).
            #[expect(
                clippy::too_many_arguments,
                reason = "the flow (ip, l4), its rule's decision and the clock; one caller"
            )]
            #[inline(always)]
            pub fn create(
                cfg: &Config,
                ip: &$Ip,
                l4: &L4,
                egress_ip: $Addr,
                ifindex: u32,
                rule_id: u32,
                pod_node: [u8; 4],
                now: u64,
            ) -> Result<u16, AllocError> {
                let st = if ip.proto == PROTO_TCP {
                    state::NEW
                } else {
                    state::ESTABLISHED
                };
                // For ICMP echo the "ports" are (identifier, 0) one way and (0, identifier) back.
                let mut reply = $Key {
                    src: ip.dst,
                    dst: egress_ip,
                    src_port_be: l4.dport_be,
                    dst_port_be: l4.sport_be,
                    proto: ip.proto,
                    dir: dir::REPLY,
                    _pad: [0; 2],
                };
                let reply_val = $Entry {
                    xlate_addr: ip.src,
                    xlate_port_be: l4.sport_be,
                    state: st,
                    _pad0: 0,
                    pod_node,
                    ifindex,
                    rule_id,
                    $($pad: 0,)?
                    last_seen_ns: now,
                };
                let lo = u32::from(cfg.port_min);
                let span = u32::from(cfg.port_max).saturating_sub(lo) + 1;
                let mut claimed = false;
                for i in 0..PORT_ALLOC_TRIES {
                    if i > 0 {
                        let r = unsafe { bpf_get_prandom_u32() };
                        reply.dst_port_be = ((lo + r % span) as u16).to_be();
                    }
                    if $MAP
                        .insert(reply, reply_val, u64::from(BPF_NOEXIST))
                        .is_ok()
                    {
                        claimed = true;
                        break;
                    }
                    // Taken: reuse the slot if the flow that held it has gone idle both ways.
                    if let Some(old) = $MAP.get_ptr(reply) {
                        // SAFETY: valid map value pointer, read only.
                        let old = unsafe { &*old };
                        if !flow_live(&reply, old, now)
                            && $MAP.insert(reply, reply_val, u64::from(BPF_ANY)).is_ok()
                        {
                            claimed = true;
                            break;
                        }
                    }
                }
                if !claimed {
                    return Err(AllocError::PortsExhausted);
                }
                let orig = original_key(ip, l4);
                let orig_val = $Entry {
                    xlate_addr: egress_ip,
                    xlate_port_be: reply.dst_port_be,
                    ..reply_val
                };
                if $MAP.insert(orig, orig_val, u64::from(BPF_ANY)).is_err() {
                    let _ = $MAP.remove(reply);
                    return Err(AllocError::InsertFailed);
                }
                Ok(reply.dst_port_be)
            }
        }
    };
}

family!(
    /// IPv4 flows (`CT_V4`).
    v4,
    crate::parse::Ipv4,
    [u8; 4],
    CtKeyV4,
    CtEntryV4,
    CT_V4,
    _pad1
);
family!(
    /// IPv6 flows (`CT_V6`, NAT66).
    v6,
    crate::parse6::Ipv6,
    [u8; 16],
    CtKeyV6,
    CtEntryV6,
    CT_V6
);
