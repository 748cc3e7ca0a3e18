//! The ICMP errors the gateway answers a pod's packet with, as a router on the way would,
//! from the flow's egress IP to the pod, quoting the first [`QUOTE`] bytes of the packet
//! (less of a shorter one) as the pod sent it:
//!
//! * a packet too big for its egress interface: "fragmentation needed" with the next-hop
//!   MTU (IPv4, RFC 1191) or "packet too big" with the MTU (ICMPv6, RFC 8201), counted
//!   `FRAG_NEEDED_SENT`. The pod's kernel lowers its path MTU to that destination and
//!   sends smaller packets (TCP at once, resending what was lost). An IPv4 packet without
//!   DF is not answered: a router would fragment it, which a TC program cannot; it is
//!   dropped as `DROP_MTU`, and so is what cannot be answered (IP options of more than 20
//!   bytes, IPv6 extension headers, a skb the kernel will not resize);
//! * a packet whose TTL (hop limit) would reach zero here: "time exceeded in transit",
//!   counted `TIME_EXCEEDED_SENT` (what `traceroute` from a pod reads as the gateway's
//!   hop); what cannot be answered stays `DROP_TTL_EXCEEDED`.
//!
//! The answer is made of the packet itself, in place, from the entry point's frame (as a
//! RST is: `reset`), and goes back the way a reply goes: through the tunnel to the pod's
//! node (`RETURN_VNI`), or out of a local pod's device.
//!
//! **Checksums whatever the skb's state.** A program cannot see the skb's checksum state.
//! A packet that arrived with CHECKSUM_PARTIAL (a GRO-merged or TSO segment train, a
//! local pod's packet, anything that crossed a veth) keeps that state through the
//! rewrite: whoever sends the answer on may "complete" the checksum, writing the
//! ones'-complement sum of the bytes from `csum_start` (where the original transport header
//! began) at `csum_start + csum_offset` (16 for TCP, 6 for UDP), in the middle of the
//! answer; or may not (a veth hands PARTIAL packets over as they are). So the answer is
//! laid out to be the same either way: the position a completion writes falls in an
//! option of its own (IPv4: experimental option 30, RFC 4727; IPv6: a destination option
//! of the experimental type 0x1e, which receivers skip), whose 16 bits there hold the
//! value a completion would write (the fixed point of "write the complement of the sum":
//! see [`fixed_point`]). The ICMP checksum, computed here over the final bytes, is then
//! right in every state, and the IP header (IPv4) covers the option as it stays.

use core::mem::size_of;

use aya_ebpf::{
    bindings::{BPF_F_RECOMPUTE_CSUM, bpf_tunnel_key},
    helpers::generated::{bpf_csum_diff, bpf_skb_change_tail, bpf_skb_load_bytes},
    programs::TcContext,
};
use egress_common::{config::Config, counters::reason};

use crate::{
    counters::{SHOT, verdict},
    handoff::{Answer4, Answer6, Icmp, Pending, QUOTE},
    mem,
    parse::{ETH_LEN, IP6_HDR_LEN, Ipv4, L4, PROTO_ICMP, PROTO_ICMPV6, PROTO_UDP},
    reset::{self, fold, sum},
    scratch::{self, Scratch},
    tunnel,
    underlay::{self, Words},
};

/// What a gateway path returns for a packet to answer with [`answer4`] / [`answer6`]: not
/// a TC verdict (nor `reset::RESET`, nor `gateway`'s `TRANSLATED`). What the answer needs
/// is in the scratch slot: the packet's headers (`segment4`, or `ip6`, `l4` and
/// `x6.origin`), which answer, the MTU and (IPv4) the egress IP (`pending`).
pub const ANSWER: i32 = i32::MIN + 2;

/// [`Pending`]'s `what`: "fragmentation needed" / "packet too big".
pub const TOO_BIG: u32 = 0;
/// [`Pending`]'s `what`: "time exceeded in transit".
pub const TIME_EXCEEDED: u32 = 1;

/// The experimental option type of both families (RFC 4727): IPv4 option 30 (not copied,
/// class 0), IPv6 destination option 0x1e (its top bits 00: a receiver that does not know
/// it skips it).
const EXPERIMENT: u8 = 0x1e;
/// The IPv4 header of the answer: 20 bytes and the 40-byte option.
const IP4_LEN: usize = 60;
/// The IPv6 destination options header of the answer: 24 bytes, the option's data 20.
const OPTS6_LEN: usize = 24;
/// Where a completion of the original transport checksum writes, past `csum_start`.
const TCP_CSUM_OFF: usize = 16;
const UDP_CSUM_OFF: usize = 6;
/// A constant in the option's last two bytes: keeps the sum a completion makes away from
/// zero, where the fixed point is ambiguous.
const FILLER: u16 = 0x0101;

/// Leave an IPv4 packet (`ip`, from a pod of `pod_node`) for [`answer4`], to be answered
/// with `what` ([`TOO_BIG`]: it would leave with `from` through a device of `mtu` bytes;
/// [`TIME_EXCEEDED`]). Returns [`ANSWER`], or drops a packet too big without DF.
#[inline(always)]
pub fn defer4(
    ctx: &TcContext,
    ip: &Ipv4,
    l4: &L4,
    pod_node: &egress_common::underlay::Underlay,
    from: [u8; 4],
    what: (u32, u16),
) -> i32 {
    let (what, mtu) = what;
    if what == TOO_BIG && !ip.df {
        return verdict(ctx, reason::DROP_MTU, SHOT);
    }
    let Some(s) = scratch::keep4(ip, l4, pod_node) else {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    };
    s.pending = Pending {
        what,
        mtu: u32::from(mtu),
        from4: from,
    };
    ANSWER
}

/// Leave the IPv6 packet the gateway path has in the scratch slot `s` (`ip6`, `l4`,
/// `x6.origin`, `x6.egress_ip`) for [`answer6`], to be answered with `what` (and `mtu`
/// for [`TOO_BIG`]). Returns [`ANSWER`].
#[inline(always)]
pub fn defer6(s: &mut Scratch, what: u32, mtu: u32) -> i32 {
    s.pending.what = what;
    s.pending.mtu = mtu;
    ANSWER
}

/// The verdict of a path that may reach the gateway path and returned `v`: `v` itself,
/// or for [`ANSWER`] that of the answer, made and sent from the caller's frame.
#[inline(always)]
pub fn deferred4(ctx: &TcContext, v: i32) -> i32 {
    if v == ANSWER { answer4(ctx) } else { v }
}

/// [`deferred4`] for IPv6.
#[inline(always)]
pub fn deferred6(ctx: &TcContext, v: i32) -> i32 {
    if v == ANSWER { answer6(ctx) } else { v }
}

/// The ICMP header of an answer: type, code and the 4 bytes after the checksum.
#[inline(always)]
fn icmp_header(v4: bool, p: &Pending) -> [u8; 8] {
    let mtu = p.mtu.to_be_bytes();
    match (v4, p.what) {
        (true, TOO_BIG) => [3, 4, 0, 0, 0, 0, mtu[2], mtu[3]],
        (true, _) => [11, 0, 0, 0, 0, 0, 0, 0],
        (false, TOO_BIG) => [2, 0, 0, 0, mtu[0], mtu[1], mtu[2], mtu[3]],
        (false, _) => [3, 0, 0, 0, 0, 0, 0, 0],
    }
}

/// What an answer is counted as.
#[inline(always)]
fn sent_as(p: &Pending) -> u32 {
    if p.what == TOO_BIG {
        reason::FRAG_NEEDED_SENT
    } else {
        reason::TIME_EXCEEDED_SENT
    }
}

/// Answer the IPv4 packet [`defer4`] left in the scratch slot.
#[inline(never)]
pub fn answer4(ctx: &TcContext) -> i32 {
    let (cfg, s) = match reset::slots(ctx) {
        Ok(x) => x,
        Err(v) => return v,
    };
    // A completion's position, from the answer's IP header: the original transport header
    // (`csum_start`) lies at 20..=40 of it for IP options up to 20 bytes.
    let start = s.segment4.ip.l4 - ETH_LEN;
    if start > 40 {
        return verdict(ctx, reason::DROP_MTU, SHOT);
    }
    let a = &mut s.answer4;
    if quote(ctx, &mut a.icmp).is_err() {
        return verdict(ctx, reason::DROP_MTU, SHOT);
    }
    let seg = &s.segment4;
    a.icmp.hdr = icmp_header(true, &s.pending);
    let c = !csum(&a.icmp, 0);
    a.icmp.hdr[2..4].copy_from_slice(&c.to_ne_bytes());
    let tot = ((IP4_LEN + size_of::<Icmp>()) as u16).to_be_bytes();
    // SAFETY: bytes.
    unsafe { mem::zero(&mut a.ip) };
    a.ip[0] = 0x40 | (IP4_LEN / 4) as u8;
    // Precedence "internetwork control", as Linux's own ICMP errors.
    a.ip[1] = 0xc0;
    a.ip[2] = tot[0];
    a.ip[3] = tot[1];
    a.ip[8] = 64;
    a.ip[9] = PROTO_ICMP;
    a.ip[12..16].copy_from_slice(&s.pending.from4);
    a.ip[16..20].copy_from_slice(&seg.ip.src);
    a.ip[20] = EXPERIMENT;
    a.ip[21] = (IP4_LEN - 20) as u8;
    a.ip[IP4_LEN - 2..].copy_from_slice(&FILLER.to_ne_bytes());
    // The sum a completion makes, its own position left out: the option's words from
    // `start` on (its type and length only when it starts there) and the ICMP message
    // (whose checksum makes it zero).
    let mut rest = u32::from(FILLER) + u32::from(csum(&a.icmp, 0));
    if start == 20 {
        rest += u32::from(u16::from_ne_bytes([a.ip[20], a.ip[21]]));
    }
    let at = start + csum_off(seg.ip.proto);
    let v = fixed_point(rest).to_ne_bytes();
    let Some(w) = a.ip.get_mut(at..at + 2) else {
        return verdict(ctx, reason::DROP_MTU, SHOT);
    };
    w.copy_from_slice(&v);
    let h = !fold(sum(&a.ip));
    a.ip[10..12].copy_from_slice(&h.to_ne_bytes());
    if write(ctx, a).is_err() {
        return verdict(ctx, reason::DROP_MTU, SHOT);
    }
    let node = Words::of(&seg.pod_node);
    let sent = sent_as(&s.pending);
    send(
        ctx,
        cfg,
        PROTO_ICMP,
        ETH_LEN + IP4_LEN,
        &mut s.tunnel,
        (node, sent),
    )
}

/// Answer the IPv6 packet [`defer6`] left in the scratch slot (already translated for a
/// packet too big: the quote is given back the pod's address and port).
#[inline(never)]
pub fn answer6(ctx: &TcContext) -> i32 {
    let (cfg, s) = match reset::slots(ctx) {
        Ok(x) => x,
        Err(v) => return v,
    };
    // Extension headers would move `csum_start` past the option.
    if s.ip6.l4 != ETH_LEN + IP6_HDR_LEN {
        return verdict(ctx, reason::DROP_MTU, SHOT);
    }
    let a = &mut s.answer6;
    if quote(ctx, &mut a.icmp).is_err() {
        return verdict(ctx, reason::DROP_MTU, SHOT);
    }
    // The quote as the pod sent it: its source address and port (echo: identifier).
    a.icmp.quote[8..24].copy_from_slice(&s.ip6.src);
    let port_at = IP6_HDR_LEN + if s.ip6.proto == PROTO_ICMPV6 { 4 } else { 0 };
    a.icmp.quote[port_at..port_at + 2].copy_from_slice(&s.l4.sport_be.to_ne_bytes());
    a.icmp.hdr = icmp_header(false, &s.pending);
    // The pseudo-header: addresses, the ICMPv6 length and next header (RFC 8200, 8.1).
    let len = (size_of::<Icmp>() as u32).to_be_bytes();
    let pseudo = sum(&s.x6.egress_ip)
        + sum(&s.ip6.src)
        + u32::from(u16::from_ne_bytes([len[2], len[3]]))
        + u32::from(u16::from_ne_bytes([0, PROTO_ICMPV6]));
    let c = !csum(&a.icmp, pseudo);
    a.icmp.hdr[2..4].copy_from_slice(&c.to_ne_bytes());
    let payload = ((OPTS6_LEN + size_of::<Icmp>()) as u16).to_be_bytes();
    // SAFETY: bytes.
    unsafe { mem::zero(&mut a.ip) };
    a.ip[0] = 0x60;
    a.ip[4] = payload[0];
    a.ip[5] = payload[1];
    a.ip[6] = DEST_OPTS;
    a.ip[7] = 64;
    a.ip[8..24].copy_from_slice(&s.x6.egress_ip);
    a.ip[24..40].copy_from_slice(&s.ip6.src);
    // SAFETY: bytes.
    unsafe { mem::zero(&mut a.opts) };
    a.opts[0] = PROTO_ICMPV6;
    a.opts[1] = (OPTS6_LEN / 8 - 1) as u8;
    a.opts[2] = EXPERIMENT;
    a.opts[3] = (OPTS6_LEN - 4) as u8;
    // As for IPv4, from `csum_start` (the options header): its words but the position,
    // and the ICMPv6 message, whose words sum to the pseudo-header's complement (so the
    // sum may fold to zero: then the filler doubles).
    let mut rest = u32::from(u16::from_ne_bytes([a.opts[0], a.opts[1]]))
        + u32::from(u16::from_ne_bytes([a.opts[2], a.opts[3]]))
        + u32::from(FILLER)
        + u32::from(csum(&a.icmp, 0));
    let mut filler = FILLER;
    if fold(rest) == 0xffff {
        rest += u32::from(FILLER);
        filler = 2 * FILLER;
    }
    a.opts[OPTS6_LEN - 2..].copy_from_slice(&filler.to_ne_bytes());
    let at = csum_off(s.ip6.proto);
    let v = fixed_point(rest).to_ne_bytes();
    a.opts[at..at + 2].copy_from_slice(&v);
    if write(ctx, a).is_err() {
        return verdict(ctx, reason::DROP_MTU, SHOT);
    }
    let node = underlay::origin(&s.x6.origin);
    let l4_off = ETH_LEN + IP6_HDR_LEN + OPTS6_LEN;
    let sent = sent_as(&s.pending);
    send(ctx, cfg, PROTO_ICMPV6, l4_off, &mut s.tunnel, (node, sent))
}

/// IPv6's next header value of destination options.
const DEST_OPTS: u8 = 60;

/// Where a completion of the original transport checksum would write, past its start.
/// Any other protocol is never CHECKSUM_PARTIAL; TCP's position serves.
#[inline(always)]
fn csum_off(proto: u8) -> usize {
    if proto == PROTO_UDP {
        UDP_CSUM_OFF
    } else {
        TCP_CSUM_OFF
    }
}

/// The packet's first [`QUOTE`] bytes after the Ethernet header, into `m`; of a shorter
/// packet, as much as the largest of a few fixed sizes that fit (down to its IP header
/// and 8 bytes: RFC 792's minimum), the rest of the quote zero (the answer keeps its one
/// size: receivers read the quoted header's own lengths and ignore what follows).
/// Constant sizes: the verifier does not follow a computed one's lower bound.
#[inline(always)]
fn quote(ctx: &TcContext, m: &mut Icmp) -> Result<(), ()> {
    // SAFETY: bytes.
    unsafe { mem::zero(&mut m.quote) };
    for n in [QUOTE, 48, 40, 28] {
        // SAFETY: the destination is valid for QUOTE >= n bytes.
        let r = unsafe {
            bpf_skb_load_bytes(
                ctx.skb.skb as *const _,
                ETH_LEN as u32,
                m.quote.as_mut_ptr().cast(),
                n as u32,
            )
        };
        if r == 0 {
            return Ok(());
        }
    }
    Err(())
}

/// The 16 bits `v` for which "write the complement of the sum" leaves `v` in place, when
/// the other words summed come to `rest`: `v = !(rest + v)` in ones'-complement
/// arithmetic, so `2v = !rest`, and halving modulo 0xffff is a rotation right by one bit.
/// `rest` must not fold to zero (see [`FILLER`]).
#[inline(always)]
pub fn fixed_point(rest: u32) -> u16 {
    (!fold(rest)).rotate_right(1)
}

/// Resize the packet to the answer and write it after the Ethernet header (the skb's
/// CHECKSUM_COMPLETE sum kept right: `BPF_F_RECOMPUTE_CSUM`).
#[inline(always)]
fn write<T>(ctx: &TcContext, answer: &T) -> Result<(), ()> {
    let len = (ETH_LEN + size_of::<T>()) as u32;
    // SAFETY: the context's skb is valid for the program's run. Cutting the packet also
    // drops its GSO state (a segment train becomes one packet).
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, len, 0) } != 0 {
        return Err(());
    }
    ctx.store(ETH_LEN, answer, u64::from(BPF_F_RECOMPUTE_CSUM))
        .map_err(|_| ())
}

/// Send the answer (its ICMP message, `proto`, at `l4_off`) to the pod on the node of
/// `to`, counted as its second.
#[inline(always)]
fn send(
    ctx: &TcContext,
    cfg: &Config,
    proto: u8,
    l4_off: usize,
    key: &mut bpf_tunnel_key,
    to: (Words, u32),
) -> i32 {
    let icmp = reset::Answer {
        proto,
        tcp_flags: 0,
        l4_off,
        ip_hdr_len: tunnel::IP4_HDR_LEN,
    };
    reset::send_back(ctx, cfg, &icmp, key, to.0, to.1)
}

/// The ones'-complement sum, folded, of the ICMP message `m` and `seed`
/// (`bpf_csum_diff` over the map memory: one helper call).
#[inline(always)]
fn csum(m: &Icmp, seed: u32) -> u16 {
    // SAFETY: `m` is valid for its size, a multiple of 4 below the helper's 512 bytes.
    let r = unsafe {
        bpf_csum_diff(
            core::ptr::null_mut(),
            0,
            m as *const Icmp as *mut u32,
            size_of::<Icmp>() as u32,
            seed,
        )
    };
    // The helper fails only on sizes, which are constant and right.
    fold(r as u32)
}

const _: () = assert!(size_of::<Icmp>() == 8 + QUOTE && size_of::<Icmp>().is_multiple_of(4));
const _: () = assert!(size_of::<Answer4>() == IP4_LEN + size_of::<Icmp>());
const _: () = assert!(size_of::<Answer6>() == IP6_HDR_LEN + OPTS6_LEN + size_of::<Icmp>());
