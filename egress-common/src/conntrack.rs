//! Conntrack and NAT on the gateway. One entry per direction:
//!
//! * original: key (pod, destination, pod port, destination port) -> egress IP and port;
//! * reply: key (destination, egress IP, destination port, egress port) -> pod address and
//!   port, and the pod's node for the return tunnel.
//!
//! For ICMP echo the identifier stands in for both ports.

/// Aligned to 4 (no padding: the size is a multiple of 4) so that the datapath's
/// `make_key` may write the ports and protocol/direction as words: the kernel's hash
/// reads a key by words, and a word read across two 2-byte stores waits for them. (The
/// alignment alone does not make LLVM merge the field stores.)
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtKeyV4 {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub src_port_be: u16,
    pub dst_port_be: u16,
    /// IP protocol number (6, 17, 1).
    pub proto: u8,
    /// [`dir::ORIGINAL`] or [`dir::REPLY`].
    pub dir: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<CtKeyV4>() == 16);

pub mod dir {
    pub const ORIGINAL: u8 = 0;
    pub const REPLY: u8 = 1;
}

/// TCP state as far as timeouts care.
pub mod state {
    pub const NEW: u8 = 0;
    pub const ESTABLISHED: u8 = 1;
    /// A FIN crossed this direction (the other may still send: a half-close).
    pub const CLOSING: u8 = 2;
    /// A RST crossed the flow: the datapath marks both directions' entries, and a flow
    /// with either entry reset and idle past [`super::timeout::TCP_RESET`] is over
    /// whatever the other says (its SNAT port is free, and it no longer counts against
    /// `--max-flows-per-pod`). A SYN reopens it as [`NEW`] (a reused tuple).
    pub const RESET: u8 = 3;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtEntryV4 {
    /// Original: egress IP. Reply: pod IP.
    pub xlate_addr: [u8; 4],
    /// Original: egress port. Reply: pod port.
    pub xlate_port_be: u16,
    /// One of [`state`].
    pub state: u8,
    pub _pad0: u8,
    /// Underlay address of the pod's node; equal to this node's when the pod is local.
    pub pod_node: crate::underlay::Underlay,
    /// Egress interface.
    pub ifindex: u32,
    pub rule_id: u32,
    /// The datapath's clock (`bpf_ktime_get_coarse_ns`) at this direction's last packet.
    pub last_seen_ns: u64,
    /// Where this direction's packets went last (see [`NextHop`]).
    pub next_hop: NextHop,
}
const _: () = assert!(core::mem::size_of::<CtEntryV4>() == 64);

/// The next hop a flow's packets took, cached in its conntrack entry by the first packet
/// whose FIB lookup succeeded (next hop resolved), so that later packets skip the lookup
/// and write the MAC addresses themselves. Valid while `ifindex` is non-zero, `generation`
/// equals the value in `NH_GEN` (bumped by the agent on every route or neighbour change)
/// and the entry was filled less than [`NEXT_HOP_MAX_AGE_NS`] ago (a missed event heals
/// by itself). All-zero: nothing cached.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NextHop {
    /// Destination and source MAC of the output frame.
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    /// The output device's MTU (`bpf_fib_lookup`'s `mtu_result`): a larger packet that is
    /// not GSO is looked up again, so that the FIB's MTU check refuses it as before.
    pub mtu: u16,
    /// The low 16 bits of `NH_GEN` when it was filled ([`generation`]).
    pub generation: u16,
    /// Output interface; 0 when nothing is cached.
    pub ifindex: u32,
    /// The datapath's clock when it was filled, in [`stamp`] units.
    pub filled: u32,
}
const _: () = assert!(core::mem::size_of::<NextHop>() == 24);

/// A cached next hop older than this is looked up again: the bound on how long a route
/// or neighbour change that the agent missed (or made while it was down) can keep a flow
/// on the old next hop. One FIB lookup per flow and second costs nothing measurable.
pub const NEXT_HOP_MAX_AGE_NS: u64 = 1_000_000_000;

/// [`NextHop::filled`]'s unit: 2^20 ns (about 1.05 ms), so that a stamp fits 32 bits
/// (wrapping after 52 days) and the entry stays 64 bytes.
pub const STAMP_SHIFT: u32 = 20;

/// The datapath's clock `now_ns` in [`NextHop::filled`]'s units.
#[inline(always)]
pub const fn stamp(now_ns: u64) -> u32 {
    (now_ns >> STAMP_SHIFT) as u32
}

/// Whether a next hop stamped `filled` is younger than [`NEXT_HOP_MAX_AGE_NS`] at
/// `now_ns`, to a unit. A stamp up to [`AHEAD_UNITS`] ahead of `now_ns` counts as fresh
/// (one written from `CLOCK_MONOTONIC`, which leads the datapath's coarse clock by up to
/// a jiffy); any other is an age, wrapping.
#[inline(always)]
pub const fn fresh(filled: u32, now_ns: u64) -> bool {
    let age = stamp(now_ns).wrapping_sub(filled);
    age < (NEXT_HOP_MAX_AGE_NS >> STAMP_SHIFT) as u32 || age.wrapping_neg() <= AHEAD_UNITS
}

/// How far ahead of the datapath's clock a stamp may lie and count as fresh (about
/// 16 ms: more than a jiffy at any `HZ`).
pub const AHEAD_UNITS: u32 = 16;

/// `NH_GEN`'s value as a [`NextHop::generation`]: its low 16 bits. A cache whose
/// generation 65,536 bumps ago collides is still bounded by its age.
#[inline(always)]
pub const fn generation(nh_gen: u32) -> u16 {
    nh_gen as u16
}

/// `REMAP_V4`, keyed by a flow's original-direction key: the egress IP and port another
/// gateway gave that flow when the pod's own port was taken. A new flow of that key
/// through that egress IP tries this port first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RemapValueV4 {
    pub xlate_addr: [u8; 4],
    pub xlate_port_be: u16,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<RemapValueV4>() == 8);

/// `REMAP_V6`: [`RemapValueV4`] for IPv6.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RemapValueV6 {
    pub xlate_addr: [u8; 16],
    pub xlate_port_be: u16,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<RemapValueV6>() == 20);

/// `FLOWS_V4` / `FLOWS_V6`: a pod's live translated flows on this gateway (the flows it
/// started here: original-direction conntrack entries whose source it is).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowCount {
    pub flows: u32,
}
const _: () = assert!(core::mem::size_of::<FlowCount>() == 4);

/// Idle timeouts in nanoseconds.
pub mod timeout {
    const SEC: u64 = 1_000_000_000;
    pub const TCP_NEW: u64 = 60 * SEC;
    pub const TCP_ESTABLISHED: u64 = 6 * 3600 * SEC;
    pub const TCP_CLOSING: u64 = 30 * SEC;
    /// Linux conntrack's `nf_conntrack_tcp_timeout_close`: long enough for the RST's
    /// retransmissions and stray segments to be translated, short enough that aborted
    /// connections do not pile up.
    pub const TCP_RESET: u64 = 10 * SEC;
    pub const UDP: u64 = 120 * SEC;
    pub const ICMP: u64 = 30 * SEC;
    /// A TCP segment in the middle of a stream (neither SYN nor RST) that makes a flow
    /// here (the egress IP was taken over, or came back) may take its pod's port from a
    /// flow silent both ways this long: the far end knows the stream by that port, and a
    /// flow whose entries outlived it here (a gateway back from a silent death never saw
    /// its flows end) must not push the stream onto another port, which the far end
    /// would reset. Long enough that a live stream (ACKs both ways) is never taken.
    pub const TAKEOVER_IDLE: u64 = 10 * SEC;
}

/// The idle timeout of an entry of protocol `proto` in TCP state `st` (any state but
/// [`state::ESTABLISHED`], [`state::CLOSING`] and [`state::RESET`] counts as
/// [`state::NEW`]).
#[inline(always)]
pub const fn idle_timeout(proto: u8, st: u8) -> u64 {
    const TCP: u8 = 6;
    const UDP: u8 = 17;
    match (proto, st) {
        (TCP, state::ESTABLISHED) => timeout::TCP_ESTABLISHED,
        (TCP, state::CLOSING) => timeout::TCP_CLOSING,
        (TCP, state::RESET) => timeout::TCP_RESET,
        (TCP, _) => timeout::TCP_NEW,
        (UDP, _) => timeout::UDP,
        _ => timeout::ICMP,
    }
}

/// Whether an entry last seen at `last_seen_ns` is idle past its timeout at `now`
/// (`bpf_ktime_get_coarse_ns`, that is `CLOCK_MONOTONIC_COARSE`). A flow is over only when both of its
/// entries are (each direction refreshes its own).
#[inline(always)]
pub const fn expired(proto: u8, st: u8, last_seen_ns: u64, now: u64) -> bool {
    now.saturating_sub(last_seen_ns) > idle_timeout(proto, st)
}

/// Whether an entry (of protocol `proto`, in state `st`, last seen at `last_seen_ns`)
/// ends its flow by itself at `now`: reset and idle past its timeout, so that the other
/// direction's entry does not keep the flow alive (it may never have seen the RST).
#[inline(always)]
pub const fn reset_over(proto: u8, st: u8, last_seen_ns: u64, now: u64) -> bool {
    st == state::RESET && expired(proto, st, last_seen_ns, now)
}

/// How many ports a new flow tries to claim (the pod's own, then random ones of the
/// range), each also reclaimed if its flow has gone idle both ways, before the scan.
pub const PORT_ALLOC_TRIES: u32 = 16;

/// How many consecutive ports of the range (from a random start, wrapping) a new flow
/// looks up for a free one when [`PORT_ALLOC_TRIES`] found none, before it counts
/// `DROP_PORT_EXHAUSTED`. The scan runs under `bpf_loop`, so the verifier's work does not
/// grow with it; a refused flow costs up to this many hash lookups. With 1% of the range
/// free, 32 random tries missed 73% of the time (0.99^31); these miss 1 in 200
/// (0.99^(15 + 512)), and a range of up to this many ports is searched whole.
pub const PORT_SCAN_LEN: u32 = 512;

/// Aligned to 4 (no padding: the size is a multiple of 4) so that the datapath's
/// `make_key` may write the ports and protocol/direction as words: the kernel's hash
/// reads a key by words, and a word read across two 2-byte stores waits for them. (The
/// alignment alone does not make LLVM merge the field stores.)
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtKeyV6 {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub src_port_be: u16,
    pub dst_port_be: u16,
    /// IP protocol number (6, 17, 58).
    pub proto: u8,
    /// [`dir::ORIGINAL`] or [`dir::REPLY`].
    pub dir: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<CtKeyV6>() == 40);

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtEntryV6 {
    /// Original: egress IP. Reply: pod IP.
    pub xlate_addr: [u8; 16],
    pub xlate_port_be: u16,
    pub state: u8,
    pub _pad0: u8,
    /// Underlay address of the pod's node.
    pub pod_node: crate::underlay::Underlay,
    pub ifindex: u32,
    pub rule_id: u32,
    pub _pad1: u32,
    pub last_seen_ns: u64,
    /// See [`NextHop`].
    pub next_hop: NextHop,
}
const _: () = assert!(core::mem::size_of::<CtEntryV6>() == 80);

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn a_next_hop_is_fresh_for_a_second_and_a_jiffy_ahead() {
        let now = 3_600_000 * MS;
        let at = |t: u64| fresh(stamp(t), now);
        assert!(at(now));
        assert!(at(now - 990 * MS));
        assert!(!at(now - 1_010 * MS), "a second old");
        assert!(!at(now - 3_000_000 * MS), "an hour old");
        assert!(at(now + 10 * MS), "a jiffy ahead (CLOCK_MONOTONIC)");
        assert!(!at(now + 2_000 * MS), "garbage ahead");
        // Across the stamp's wrap (2^52 ns): the age still counts.
        let wrap = 1u64 << (32 + STAMP_SHIFT);
        assert!(fresh(stamp(wrap - 10 * MS), wrap + 100 * MS));
        assert!(!fresh(stamp(wrap - 1_500 * MS), wrap + 100 * MS));
    }

    #[test]
    fn a_generation_keeps_the_low_bits() {
        assert_eq!(generation(7), 7);
        assert_eq!(generation(0x1_0007), 7);
    }
}
