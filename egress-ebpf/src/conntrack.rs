//! Conntrack for the SNAT on the gateway: lookups with idle timeouts, TCP state, and
//! port allocation that claims the reply tuple atomically. One body of code, stamped out
//! per address family ([`v4`] on `CT_V4`, [`v6`] on `CT_V6`): the two differ only in
//! their types.

use aya_ebpf::helpers::generated::bpf_ktime_get_coarse_ns;
use egress_common::conntrack::state;

use crate::parse::{PROTO_TCP, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

/// The datapath's clock: `CLOCK_MONOTONIC_COARSE` (Linux 5.11), the monotonic clock as
/// of the last tick (at most a jiffy, 1-10 ms, behind `CLOCK_MONOTONIC`); the agent's
/// sweeper reads the same clock. Ample for idle timeouts of seconds and the next-hop
/// cache's age bound of a second, without the clocksource read of `bpf_ktime_get_ns`
/// on every packet. A stamp written from `CLOCK_MONOTONIC` may lie up to a jiffy ahead
/// of it: age checks saturate at zero.
#[inline(always)]
pub fn now() -> u64 {
    unsafe { bpf_ktime_get_coarse_ns() }
}

/// The state of an entry in state `cur` after a packet with `tcp_flags`: a RST resets
/// (the caller marks the other direction's entry too), a FIN closes this direction, a
/// SYN on a closing or reset entry reopens it (a reused tuple: it would otherwise die
/// at the closing timeout), and the first ACK establishes.
#[inline(always)]
pub fn next_state(proto: u8, cur: u8, tcp_flags: u8) -> u8 {
    if proto != PROTO_TCP {
        return state::ESTABLISHED;
    }
    if tcp_flags & TCP_RST != 0 {
        state::RESET
    } else if tcp_flags & TCP_FIN != 0 {
        state::CLOSING
    } else if tcp_flags & TCP_SYN != 0 && (cur == state::CLOSING || cur == state::RESET) {
        state::NEW
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
    ($(#[$doc:meta])* $name:ident, $Ip:ty, $Addr:ty, $Key:ident, $Entry:ident, $Remap:ident, $MAP:ident, $REMAP:ident, $FRESH:ident $(, $pad:ident)?) => {
        $(#[$doc])*
        pub mod $name {
            use aya_ebpf::{
                bindings::{BPF_ANY, BPF_NOEXIST},
                helpers::generated::{bpf_get_prandom_u32, bpf_loop},
            };
            use egress_common::{
                config::Config,
                conntrack::{
                    $Entry, $Key, $Remap, NextHop, PORT_ALLOC_TRIES, PORT_SCAN_LEN, dir, state,
                    timeout,
                },
            };

            use super::{AllocError, next_state};
            use crate::{
                maps::{$FRESH, $MAP, $REMAP},
                parse::{L4, PROTO_TCP, TCP_RST, TCP_SYN},
            };

            /// The key (`src`, `dst`, ports, `proto`, `dir`), its tail written as two words:
            /// a struct literal stores the ports, protocol and direction in 2- and 1-byte
            /// pieces, and the kernel's hash and compare then read those bytes by words,
            /// each word waiting for the pieces stored before it.
            #[inline(always)]
            fn make_key(
                src: $Addr,
                dst: $Addr,
                src_port_be: u16,
                dst_port_be: u16,
                proto: u8,
                dir: u8,
            ) -> $Key {
                let mut k = core::mem::MaybeUninit::<$Key>::uninit();
                // SAFETY: `write_key` writes every field.
                unsafe {
                    write_key(k.as_mut_ptr(), src, dst, src_port_be, dst_port_be, proto, dir);
                    k.assume_init()
                }
            }

            /// [`make_key`] written in place at `p` (a key built on the stack and copied
            /// there would take a frame the deepest paths have no room for).
            ///
            /// # Safety
            /// `p` is valid for writes of a whole key.
            #[inline(always)]
            unsafe fn write_key(
                p: *mut $Key,
                src: $Addr,
                dst: $Addr,
                src_port_be: u16,
                dst_port_be: u16,
                proto: u8,
                dir: u8,
            ) {
                const { assert!(core::mem::offset_of!($Key, src_port_be) % 4 == 0) };
                const { assert!(core::mem::offset_of!($Key, proto) % 4 == 0) };
                const { assert!(core::mem::align_of::<$Key>() >= 4) };
                let (s, d) = (src_port_be.to_ne_bytes(), dst_port_be.to_ne_bytes());
                // SAFETY: every field is written (the ports and `proto`, `dir`, `_pad` as
                // two words at 4-aligned offsets of a 4-aligned key, asserted above, with
                // the fields' bytes in their order); `p` is valid (the caller's word).
                unsafe {
                    (&raw mut (*p).src).write(src);
                    (&raw mut (*p).dst).write(dst);
                    (&raw mut (*p).src_port_be)
                        .cast::<u32>()
                        .write(u32::from_ne_bytes([s[0], s[1], d[0], d[1]]));
                    (&raw mut (*p).proto)
                        .cast::<u32>()
                        .write(u32::from_ne_bytes([proto, dir, 0, 0]));
                }
            }

            /// The original-direction key of a packet from a pod.
            #[inline(always)]
            pub fn original_key(ip: &$Ip, l4: &L4) -> $Key {
                make_key(ip.src, ip.dst, l4.sport_be, l4.dport_be, ip.proto, dir::ORIGINAL)
            }

            /// The reply-direction key of a packet arriving for an egress IP.
            #[inline(always)]
            pub fn reply_key(ip: &$Ip, l4: &L4) -> $Key {
                make_key(ip.src, ip.dst, l4.sport_be, l4.dport_be, ip.proto, dir::REPLY)
            }

            #[inline(always)]
            fn expired(proto: u8, e: &$Entry, now: u64) -> bool {
                egress_common::conntrack::expired(proto, e.state, e.last_seen_ns, now)
            }

            /// The temporaries of [`create_in`] (and, for IPv6, [`lookup_in`]): in the
            /// per-CPU scratch map (BPF calls nest their frames into one 512-byte budget).
            #[repr(C)]
            pub struct Slots {
                /// The reply key of a new flow.
                pub key: $Key,
                /// The partner key of an entry that looks idle; the original key of a new flow.
                pub peer: $Key,
                /// The entries of a new flow.
                pub entry: $Entry,
                /// A new flow's translation, when its port is not the pod's (`$FRESH`).
                pub fresh: $Remap,
                /// The scan of [`claim_scanned`]: the range (`lo`, `span` ports), where it
                /// started, and whether a step found a free port (left in `key`).
                pub lo: u32,
                pub span: u32,
                pub start: u32,
                pub found: u32,
            }

            /// The key of the other direction's entry of the flow that (`key`, `e`) belongs to.
            #[inline(always)]
            fn partner_key(key: &$Key, e: &$Entry, out: &mut $Key) {
                // SAFETY: `out` is a valid key to overwrite.
                unsafe {
                    if key.dir == dir::ORIGINAL {
                        write_key(
                            out,
                            key.dst,
                            e.xlate_addr,
                            key.dst_port_be,
                            e.xlate_port_be,
                            key.proto,
                            dir::REPLY,
                        );
                    } else {
                        write_key(
                            out,
                            e.xlate_addr,
                            key.src,
                            e.xlate_port_be,
                            key.src_port_be,
                            key.proto,
                            dir::ORIGINAL,
                        );
                    }
                }
            }

            /// Whether `p` (the entry at `pk`) is the partner of (`key`, `e`): the
            /// partner's own partner key is `key`, compared field by field.
            #[inline(always)]
            fn partners(key: &$Key, pk: &$Key, p: &$Entry) -> bool {
                if pk.dir == dir::ORIGINAL {
                    key.src == pk.dst
                        && key.dst == p.xlate_addr
                        && key.src_port_be == pk.dst_port_be
                        && key.dst_port_be == p.xlate_port_be
                        && key.proto == pk.proto
                        && key.dir == dir::REPLY
                } else {
                    key.src == p.xlate_addr
                        && key.dst == pk.src
                        && key.src_port_be == p.xlate_port_be
                        && key.dst_port_be == pk.src_port_be
                        && key.proto == pk.proto
                        && key.dir == dir::ORIGINAL
                }
            }

            /// Whether the flow of (`key`, `e`) has seen a packet within its timeout in either
            /// direction. Each direction refreshes only its own entry (one lookup per packet), so
            /// an entry that looks idle asks its partner (its key built in `pk`) before the flow
            /// counts as over: a one-way stream must keep both its translation and its claim on
            /// the reply tuple. Only paid on the expired path.
            /// A reset entry idle past its (short) timeout ends the flow without asking.
            #[inline(always)]
            fn flow_live(key: &$Key, e: &$Entry, now: u64, pk: &mut $Key) -> bool {
                if !expired(key.proto, e, now) {
                    return true;
                }
                if e.state == state::RESET {
                    return false;
                }
                partner_key(key, e, pk);
                let Some(p) = $MAP.get_ptr(&*pk) else {
                    return false;
                };
                // SAFETY: valid map value pointer, read only.
                let p = unsafe { &*p };
                // The partner must still belong to this flow (its slot may have been reused).
                !expired(key.proto, p, now) && partners(key, pk, p)
            }

            /// A live entry for `key`: refreshes its last-seen time and TCP state, and returns it
            /// (in the map: a copy of the 64-byte entry would be a `memmove` call).
            /// Entries of flows idle in both directions count as absent.
            #[allow(dead_code, reason = "IPv4 only")]
            #[inline(always)]
            pub fn lookup(key: &$Key, tcp_flags: u8, now: u64) -> Option<&'static $Entry> {
                lookup_mut(key, tcp_flags, now).map(|e| &*e)
            }

            /// [`lookup`] returning the entry in the map, whose next-hop cache the
            /// caller may fill.
            #[allow(dead_code, reason = "IPv4 only")]
            #[inline(always)]
            pub fn lookup_mut(key: &$Key, tcp_flags: u8, now: u64) -> Option<&'static mut $Entry> {
                // SAFETY: all-zero is a valid key.
                let mut slot = core::mem::MaybeUninit::<$Key>::uninit();
                let pk = unsafe { crate::mem::zeroed_in(&mut slot) };
                lookup_in(key, tcp_flags, now, pk)
            }

            /// [`lookup`] with the partner key's room given by the caller; returns the entry
            /// in the map.
            #[inline(always)]
            pub fn lookup_in(
                key: &$Key,
                tcp_flags: u8,
                now: u64,
                pk: &mut $Key,
            ) -> Option<&'static mut $Entry> {
                let e = $MAP.get_ptr_mut(key)?;
                // SAFETY: valid map value pointer; concurrent updates of these fields only race on
                // timestamps and state, which are advisory.
                let e = unsafe { &mut *e };
                if !flow_live(key, e, now, pk) {
                    return None;
                }
                e.last_seen_ns = now;
                e.state = next_state(key.proto, e.state, tcp_flags);
                if e.state == state::RESET {
                    reset_partner(key, e, pk);
                }
                Some(e)
            }

            /// A RST crossed (`key`, `e`): its partner entry (the other direction, key
            /// built in `pk`) is reset too, its last-seen time left as it is, so that the
            /// whole flow ends [`timeout::TCP_RESET`](egress_common::conntrack::timeout)
            /// after its last packet. A partner whose slot another flow took is left alone.
            #[inline(always)]
            fn reset_partner(key: &$Key, e: &$Entry, pk: &mut $Key) {
                partner_key(key, e, pk);
                let Some(p) = $MAP.get_ptr_mut(&*pk) else {
                    return;
                };
                // SAFETY: valid map value pointer; the state is advisory (see `lookup_in`).
                let p = unsafe { &mut *p };
                if partners(key, pk, p) {
                    p.state = state::RESET;
                }
            }

            /// A live entry for `key`, left as it is: neither its last-seen time nor its
            /// state changes (an ICMP error about a flow is no sign of its life).
            #[allow(dead_code, reason = "IPv4 only")]
            #[inline(always)]
            pub fn peek(key: &$Key, now: u64) -> Option<&'static $Entry> {
                // SAFETY: all-zero is a valid key.
                let mut slot = core::mem::MaybeUninit::<$Key>::uninit();
                let pk = unsafe { crate::mem::zeroed_in(&mut slot) };
                peek_in(key, now, pk)
            }

            /// [`peek`] with the partner key's room given by the caller; returns the entry
            /// in the map.
            #[inline(always)]
            pub fn peek_in(key: &$Key, now: u64, pk: &mut $Key) -> Option<&'static $Entry> {
                let e = $MAP.get_ptr(key)?;
                // SAFETY: valid map value pointer, read only.
                let e = unsafe { &*e };
                if !flow_live(key, e, now, pk) {
                    return None;
                }
                Some(e)
            }

            /// Free the reply tuple `s.key` (a new flow's, with its pod's port) of a flow
            /// silent both ways for [`timeout::TAKEOVER_IDLE`], however long its state's
            /// timeout: both its entries go, as the sweeper's would (a partner whose slot
            /// another flow took is left alone). Out of line, its temporaries in the slot:
            /// the gateway paths' frames had no room left under the verifier's 512 bytes.
            #[inline(never)]
            fn reclaim(s: &mut Slots, now: u64) {
                let Some(e) = $MAP.get_ptr(&s.key) else {
                    return;
                };
                // SAFETY: valid map value pointer, read only.
                let e = unsafe { &*e };
                if now.saturating_sub(e.last_seen_ns) < timeout::TAKEOVER_IDLE {
                    return;
                }
                partner_key(&s.key, e, &mut s.peer);
                if let Some(p) = $MAP.get_ptr(&s.peer) {
                    // SAFETY: valid map value pointer, read only.
                    let p = unsafe { &*p };
                    if partners(&s.key, &s.peer, p) {
                        if now.saturating_sub(p.last_seen_ns) < timeout::TAKEOVER_IDLE {
                            return;
                        }
                        let _ = $MAP.remove(&s.peer);
                    }
                }
                let _ = $MAP.remove(&s.key);
            }

            /// `bpf_loop`'s context for [`scan_step`]: the slots (in the scratch map), by
            /// pointer. The kernel takes the context on the stack only, and Linux 6.1 counts
            /// the callback's frame into the call chain's 512 bytes: the scan's numbers
            /// live in the slots, so this is all the stack it costs.
            struct Scan {
                slots: *mut Slots,
            }

            /// One step of [`claim_scanned`], called by `bpf_loop`: 1 (stop) once the
            /// `i`-th port from the start is free.
            #[inline(never)]
            extern "C" fn scan_step(i: u64, ctx: *mut core::ffi::c_void) -> i64 {
                // SAFETY: `ctx` is the `Scan` on `claim_scanned`'s stack, alive for the loop,
                // and its slots are not otherwise borrowed for the loop.
                let s = unsafe { &mut *(*ctx.cast::<Scan>()).slots };
                if s.span == 0 {
                    return 1;
                }
                s.key.dst_port_be = ((s.lo + (s.start + i as u32) % s.span) as u16).to_be();
                if $MAP.get_ptr(&s.key).is_none() {
                    s.found = 1;
                    return 1;
                }
                0
            }

            /// Look up [`PORT_SCAN_LEN`] consecutive ports of the range (`lo`, `span` ports)
            /// from a random start, wrapping, for `s.key`; claim the first one free. A port
            /// taken since the lookup (another CPU) is not retried: the flow is refused.
            /// `bpf_loop` (Linux 5.17) so that the verifier walks one step, not every one.
            #[inline(always)]
            fn claim_scanned(s: &mut Slots, lo: u32, span: u32) -> bool {
                s.lo = lo;
                s.span = span;
                s.start = unsafe { bpf_get_prandom_u32() } % span;
                s.found = 0;
                let mut c = Scan { slots: s };
                // SAFETY: `scan_step` is a BPF function taking (index, ctx); `c` outlives
                // the call.
                unsafe {
                    bpf_loop(
                        PORT_SCAN_LEN,
                        scan_step as *mut core::ffi::c_void,
                        (&raw mut c).cast(),
                        0,
                    );
                }
                s.found != 0
                    && $MAP
                        .insert(&s.key, &s.entry, u64::from(BPF_NOEXIST))
                        .is_ok()
            }

            /// Create both entries of a new flow. A flow whose translation the egress IP's
            /// previous holder shared (`REMAP_*`) tries that port first. Else keeps the
            /// pod's port when it is free for
            /// (destination, egress IP) and, unless `any_port`, inside the configured range
            /// (an address shared with the gateway's own sockets gets ports of the range
            /// only), else tries random ports of the range, then looks for a free one
            /// among [`PORT_SCAN_LEN`] consecutive ports from a random start. Its keys and
            /// entries are built in `s` (the per-CPU scratch slot). Returns the chosen port
            /// (network order).
            #[expect(
                clippy::too_many_arguments,
                reason = "the flow (ip, l4), its rule's decision, the clock and the room"
            )]
            #[inline(always)]
            pub fn create_in(
                cfg: &Config,
                ip: &$Ip,
                l4: &L4,
                egress_ip: &$Addr,
                ifindex: u32,
                rule_id: u32,
                pod_node: egress_common::underlay::Underlay,
                now: u64,
                next_hop: Option<&NextHop>,
                any_port: bool,
                s: &mut Slots,
            ) -> Result<u16, AllocError> {
                let st = if ip.proto == PROTO_TCP {
                    state::NEW
                } else {
                    state::ESTABLISHED
                };
                // For ICMP echo the "ports" are (identifier, 0) one way and (0, identifier) back.
                s.key = make_key(
                    ip.dst,
                    *egress_ip,
                    l4.dport_be,
                    l4.sport_be,
                    ip.proto,
                    dir::REPLY,
                );
                // Field by field: a struct literal would zero the next hop with a
                // `memset` call. `s` may be the per-CPU scratch slot, so every field
                // is written, the cache zeroed (the reply entry caches nothing).
                s.entry.xlate_addr = ip.src;
                s.entry.xlate_port_be = l4.sport_be;
                s.entry.state = st;
                s.entry._pad0 = 0;
                s.entry.pod_node = pod_node;
                s.entry.ifindex = ifindex;
                s.entry.rule_id = rule_id;
                $(s.entry.$pad = 0;)?
                s.entry.last_seen_ns = now;
                // SAFETY: all-zero is a valid NextHop.
                unsafe { crate::mem::zero(&mut s.entry.next_hop) };
                let lo = u32::from(cfg.port_min);
                let span = u32::from(cfg.port_max).saturating_sub(lo) + 1;
                let own = u32::from(u16::from_be(l4.sport_be));
                let keep_own = any_port || own.wrapping_sub(lo) < span;
                // A flow that the egress IP's previous holder gave another port (the pod's
                // was taken there) and shared: that port first, so that the far end keeps
                // seeing the flow it knows.
                s.peer = original_key(ip, l4);
                let shared = match $REMAP.get_ptr(&s.peer) {
                    // SAFETY: valid map value pointer, read only.
                    Some(r) => unsafe {
                        if (*r).xlate_addr == *egress_ip {
                            (*r).xlate_port_be
                        } else {
                            0
                        }
                    },
                    None => 0,
                };
                // A segment in the middle of a stream that started elsewhere (the egress
                // IP's previous holder), no other port shared: the far end knows it by the
                // pod's port, which a flow silent here for long may still hold.
                if shared == 0
                    && keep_own
                    && ip.proto == PROTO_TCP
                    && l4.tcp_flags & (TCP_SYN | TCP_RST) == 0
                {
                    reclaim(s, now);
                }
                let mut claimed = false;
                if shared != 0 {
                    s.key.dst_port_be = shared;
                    claimed = $MAP
                        .insert(&s.key, &s.entry, u64::from(BPF_NOEXIST))
                        .is_ok();
                    if !claimed {
                        s.key.dst_port_be = l4.sport_be;
                    }
                }
                for i in 0..PORT_ALLOC_TRIES {
                    if claimed {
                        break;
                    }
                    if i > 0 || !keep_own {
                        let r = unsafe { bpf_get_prandom_u32() };
                        s.key.dst_port_be = ((lo + r % span) as u16).to_be();
                    }
                    if $MAP
                        .insert(&s.key, &s.entry, u64::from(BPF_NOEXIST))
                        .is_ok()
                    {
                        claimed = true;
                        break;
                    }
                    // Taken: reuse the slot if the flow that held it has gone idle both ways.
                    if let Some(old) = $MAP.get_ptr(&s.key) {
                        // SAFETY: valid map value pointer, read only.
                        let old = unsafe { &*old };
                        if !flow_live(&s.key, old, now, &mut s.peer)
                            && $MAP.insert(&s.key, &s.entry, u64::from(BPF_ANY)).is_ok()
                        {
                            claimed = true;
                            break;
                        }
                    }
                }
                if !claimed && !claim_scanned(s, lo, span) {
                    return Err(AllocError::PortsExhausted);
                }
                s.peer = original_key(ip, l4);
                // The original entry carries the next hop that the first packet's FIB
                // lookup found (one lookup for both; none on the reply side, which
                // tunnels).
                if let Some(nh) = next_hop {
                    // SAFETY: a caller's value and the slot: distinct, valid.
                    unsafe { core::ptr::copy_nonoverlapping(nh, &mut s.entry.next_hop, 1) };
                }
                s.entry.xlate_addr = *egress_ip;
                s.entry.xlate_port_be = s.key.dst_port_be;
                if $MAP.insert(&s.peer, &s.entry, u64::from(BPF_ANY)).is_err() {
                    let _ = $MAP.remove(&s.key);
                    return Err(AllocError::InsertFailed);
                }
                // Not the pod's port: the far end knows the flow by this one. Handed to the
                // agent at once, which shares it with the other gateways within a hello
                // interval (its conntrack sweep would take up to 2 s). A full map drops its
                // oldest: the sweep still finds those.
                if s.key.dst_port_be != l4.sport_be {
                    s.fresh.xlate_addr = *egress_ip;
                    s.fresh.xlate_port_be = s.key.dst_port_be;
                    s.fresh._pad = [0; 2];
                    let _ = $FRESH.insert(&s.peer, &s.fresh, u64::from(BPF_ANY));
                }
                Ok(s.key.dst_port_be)
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
    RemapValueV4,
    CT_V4,
    REMAP_V4,
    FRESH_REMAPS_V4
);
family!(
    /// IPv6 flows (`CT_V6`, NAT66).
    v6,
    crate::parse6::Ipv6,
    [u8; 16],
    CtKeyV6,
    CtEntryV6,
    RemapValueV6,
    CT_V6,
    REMAP_V6,
    FRESH_REMAPS_V6,
    _pad1
);
