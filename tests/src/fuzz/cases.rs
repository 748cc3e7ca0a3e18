//! The packets: per program, frames a node really meets (from the pods, peers and hosts of
//! [`node`]'s plans, to the destinations its rules cover and to those they do not, replies
//! to its established flows, ICMP errors quoting them), then the same broken: mutated a few
//! bytes at a time (header fields, truncation, garbage appended), and plain garbage. Every
//! case is a function of (seed, program, index) alone ([`Rng::for_case`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use egress_agent::ebpf::{FROM_POD, FROM_SECONDARY, FROM_TUNNEL, FROM_UNDERLAY};
use egress_common::{config::DEFAULT_TUNNEL_PORT, policy::RETURN_VNI};

use super::{
    mutate,
    node::{self, Dev, PEER, PEER6, Plan, STRANGER},
    rng::Rng,
};
use crate::{
    packet::{self, Ipv4Packet, L4, icmp_error, quote},
    packet6::{self, Ipv6Packet, icmp6_error},
};

/// The programs, in the order a run takes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prog {
    FromPod,
    FromTunnel,
    FromSecondary,
    FromUnderlay,
}

impl Prog {
    pub const ALL: [Prog; 4] = [
        Prog::FromPod,
        Prog::FromTunnel,
        Prog::FromSecondary,
        Prog::FromUnderlay,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Prog::FromPod => FROM_POD,
            Prog::FromTunnel => FROM_TUNNEL,
            Prog::FromSecondary => FROM_SECONDARY,
            Prog::FromUnderlay => FROM_UNDERLAY,
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn by_name(name: &str) -> Option<Prog> {
        Prog::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// How a case's frame was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Well-formed (checksums right), though perhaps of a kind the datapath refuses.
    Valid,
    /// Well-formed, then a few bytes changed, cut or added.
    Mutated,
    /// Random bytes (an Ethernet header's worth at least).
    Garbage,
}

/// One case: a frame, the device it arrives on, for `from_tunnel` the tunnel's metadata
/// (sender, VNI), and whether the skb is a GSO packet (segment size, segments), as a GRO
/// aggregate or a TSO train is.
#[derive(Clone, Debug)]
pub struct Input {
    pub frame: Vec<u8>,
    pub dev: Dev,
    pub tunnel: Option<(IpAddr, u32)>,
    pub kind: Kind,
    pub gso: Option<(u32, u32)>,
}

/// Case `index` of `prog` in the run of `seed`.
pub fn case(seed: u64, prog: Prog, index: u64) -> Input {
    generate(prog, &mut Rng::for_case(seed, prog.index(), index))
}

pub fn generate(prog: Prog, rng: &mut Rng) -> Input {
    let plan: &Plan = if rng.chance(55) { &node::V4 } else { &node::V6 };
    let (packet, dev, tunnel) = match prog {
        Prog::FromUnderlay => return from_underlay(rng),
        Prog::FromPod => (from_pod(rng, plan), Dev::Pod, None),
        Prog::FromTunnel => {
            let (p, meta) = from_tunnel(rng, plan);
            (p, Dev::Tunnel, Some(meta))
        }
        Prog::FromSecondary => {
            let p = from_secondary(rng, plan);
            let dev = secondary_dev(rng, plan, p.dst);
            (p, dev, None)
        }
    };
    let r = rng.below(100);
    let (frame, kind) = if r < 8 {
        (garbage(rng), Kind::Garbage)
    } else if r < 55 {
        let mut f = packet.build(rng);
        mutate::mutate(rng, &mut f);
        (f, Kind::Mutated)
    } else {
        (packet.build(rng), Kind::Valid)
    };
    let mut frame = frame;
    runnable(&mut frame);
    // One in eight a GSO packet: segments that fit the 1,500-byte interfaces, that do
    // not, and any size.
    let gso = rng.chance(12).then(|| {
        let size = pick!(
            rng,
            [536, 1200, 1448, 1460, 1480, 8948, u32::from(rng.u16())]
        );
        (size, rng.range(2, 45) as u32)
    });
    // One in ten of `from_pod`'s on another pod's device (a pod sending as another).
    let dev = if prog == Prog::FromPod && rng.chance(10) {
        Dev::Pod1
    } else {
        dev
    };
    Input {
        frame,
        dev,
        tunnel,
        kind,
        gso,
    }
}

/// `from_underlay`'s: one of `from_tunnel`'s cases (broken as often) as a peer's tunnel
/// device sends it, in VXLAN over IPv4 to this node's tunnel port; one in five to another
/// address or port, one in five with its outer headers broken (a byte set, a length or
/// the UDP checksum changed, with the IPv4 checksum made right again half the time). A
/// sender the underlay cannot carry (an IPv6 node) becomes the IPv4 peer.
fn from_underlay(rng: &mut Rng) -> Input {
    let inner = generate(Prog::FromTunnel, rng);
    let (sender, vni) = inner
        .tunnel
        .expect("from_tunnel cases carry tunnel metadata");
    let v4 = |a: IpAddr| match a {
        IpAddr::V4(a) => a,
        IpAddr::V6(_) => node::PEER_V4,
    };
    let (mut dst, mut port) = (v4(node::NODE), DEFAULT_TUNNEL_PORT);
    if rng.chance(20) {
        match rng.below(3) {
            0 => dst = Ipv4Addr::from(rng.u32()),
            1 => port = 4789,
            _ => port = rng.u16(),
        }
    }
    let mut frame = packet::vxlan(v4(sender), dst, port, vni, &inner.frame);
    let mut kind = inner.kind;
    if rng.chance(20) {
        match rng.below(4) {
            0 => {
                let at = rng.below(50);
                frame[at] = rng.u8();
            }
            1 => frame[16..18].copy_from_slice(&rng.u16().to_be_bytes()),
            2 => frame[38..40].copy_from_slice(&rng.u16().to_be_bytes()),
            _ => frame[40..42].copy_from_slice(&rng.u16().to_be_bytes()),
        }
        if rng.chance(50) && frame[14] == 0x45 {
            frame[24..26].fill(0);
            let c = packet::checksum(&[&frame[14..34]]);
            frame[24..26].copy_from_slice(&c.to_be_bytes());
        }
        kind = Kind::Mutated;
    }
    Input {
        frame,
        dev: Dev::Underlay,
        tunnel: None,
        kind,
        gso: inner.gso,
    }
}

/// The shortest frame `BPF_PROG_TEST_RUN` takes: an Ethernet header, and behind an IPv4
/// or IPv6 ethertype a whole fixed IP header (the kernel refuses less with EINVAL).
pub fn min_len(f: &[u8]) -> usize {
    match f.get(12..14) {
        Some([0x08, 0x00]) => 14 + 20,
        Some([0x86, 0xdd]) => 14 + 40,
        _ => 14,
    }
}

/// Zeros behind a frame cut shorter than [`min_len`] (its headers' lengths still claim
/// what was there).
fn runnable(f: &mut Vec<u8>) {
    let min = min_len(f);
    if f.len() < min {
        f.resize(min, 0);
    }
}

/// A packet before its bytes: addresses and transport.
struct Packet {
    src: IpAddr,
    dst: IpAddr,
    l4: L4,
}

impl Packet {
    /// The frame, with header variations: IPv4 options, fragments and TTLs; IPv6
    /// extension-header chains and hop limits.
    fn build(&self, rng: &mut Rng) -> Vec<u8> {
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => ipv4(rng, s, d, self.l4.clone()).build(),
            (IpAddr::V6(s), IpAddr::V6(d)) => ipv6(rng, s, d, self.l4.clone()).build(),
            _ => unreachable!("one family per packet"),
        }
    }
}

fn ipv4(rng: &mut Rng, src: Ipv4Addr, dst: Ipv4Addr, l4: L4) -> Ipv4Packet {
    let mut p = Ipv4Packet::new(src, dst, l4);
    if rng.chance(10) {
        p = p.options(&ip_options(rng));
    }
    if rng.chance(10) {
        // More fragments, a later fragment, both, or no flags at all.
        p = p.frag(pick!(rng, [0x2000, 0x00b9, 0x20b9, 0, rng.u16()]));
    }
    if rng.chance(5) {
        p = p.ttl(pick!(rng, [0, 1, 2, 255]));
    }
    p
}

/// IPv4 options: well-formed ones (NOP, record route, timestamp) or bytes.
fn ip_options(rng: &mut Rng) -> Vec<u8> {
    match rng.below(4) {
        0 => vec![1, 1, 1, 1],
        1 => vec![7, 7, 4, 0, 0, 0, 0, 0],
        2 => vec![68, 12, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        _ => {
            let n = rng.range(1, 40);
            rng.bytes(n)
        }
    }
}

fn ipv6(rng: &mut Rng, src: Ipv6Addr, dst: Ipv6Addr, l4: L4) -> Ipv6Packet {
    let mut p = Ipv6Packet::new(src, dst, l4);
    p.flow_label = rng.u32();
    if rng.chance(20) {
        for _ in 0..rng.range(1, 6) {
            p = ext_header(rng, p);
        }
    }
    if rng.chance(5) {
        p = p.hop_limit(pick!(rng, [0, 1, 2, 255]));
    }
    p
}

/// One extension header: options, routing (with or without segments left), fragment,
/// headers the datapath does not walk (AH, ESP, no next header), or any number.
fn ext_header(rng: &mut Rng, p: Ipv6Packet) -> Ipv6Packet {
    let body_len = pick!(rng, [6, 6, 14, 22, 0, 30]);
    let body = rng.bytes(body_len);
    match rng.below(8) {
        0 => p.pad_options(packet6::NEXTHDR_HOP),
        1 => p.pad_options(packet6::NEXTHDR_DEST),
        2 => p.ext(packet6::NEXTHDR_DEST, &body),
        3 => {
            let segments_left = pick!(rng, [0, 0, 1, rng.u8()]);
            p.routing(segments_left)
        }
        4 => p.fragment(rng.u16() & 0x1fff, rng.chance(50)),
        5 => p.ext(pick!(rng, [51, 50, 59, 135, 139, 140]), &body),
        6 => p.ext(packet6::NEXTHDR_HOP, &body),
        _ => p.ext(rng.u8(), &body),
    }
}

/// Random bytes, mostly short, often behind an IPv4 or IPv6 ethertype and version.
fn garbage(rng: &mut Rng) -> Vec<u8> {
    let len = if rng.chance(80) {
        rng.range(14, 120)
    } else {
        rng.range(14, 1500)
    };
    let mut f = rng.bytes(len);
    let (ethertype, version) = pick!(
        rng,
        [
            (0x0800u16, 0x45u8),
            (0x86dd, 0x60),
            (0x0800, 0x40 | (rng.u8() & 0xf)),
            (rng.u16(), 0),
        ]
    );
    f[12..14].copy_from_slice(&ethertype.to_be_bytes());
    if len > 14 && version != 0 {
        f[14] = version;
    }
    f
}

// ---- addresses and ports ----

/// An address in `net` (the host part random, the first `keep` bits of `net` kept).
fn inside(rng: &mut Rng, net: IpAddr, keep: u32) -> IpAddr {
    match net {
        IpAddr::V4(n) => {
            let mask = u32::MAX.checked_shr(keep).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from_bits(
                (n.to_bits() & !mask) | (rng.u32() & mask),
            ))
        }
        IpAddr::V6(n) => {
            let mask = u128::MAX.checked_shr(keep).unwrap_or(0);
            let r = (u128::from(rng.u64()) << 64) | u128::from(rng.u64());
            IpAddr::V6(Ipv6Addr::from_bits((n.to_bits() & !mask) | (r & mask)))
        }
    }
}

/// Any address of the plan's family.
fn anywhere(rng: &mut Rng, plan: &Plan) -> IpAddr {
    inside(rng, plan.local_pod, 0)
}

/// A host of a destination network: of the plan's rules, outside them, link-scoped.
fn destination(rng: &mut Rng, plan: &Plan) -> IpAddr {
    let r = rng.below(100);
    let p = &plan.policy;
    let near = |rng: &mut Rng, a: IpAddr| inside(rng, a, if a.is_ipv4() { 24 } else { 120 });
    match r {
        0..15 => plan.dest_a,
        15..30 => near(rng, plan.dest_a),
        30..40 => plan.dest_b,
        40..45 => near(rng, plan.dest_b),
        45..55 => plan.dest_far,
        55..60 => near(rng, plan.dest_far),
        60..75 => {
            let e = rng.pick(p);
            inside(rng, e.net, u32::from(e.len))
        }
        75..80 => pick!(
            rng,
            [
                plan.local_pod,
                plan.remote_pod,
                plan.egress_a,
                plan.shared_a
            ]
        ),
        80..85 if plan.local_pod.is_ipv6() => pick!(
            rng,
            [
                IpAddr::V6(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1)),
                IpAddr::V6(Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1)),
                IpAddr::V6(packet6::solicited_node(Ipv6Addr::new(
                    0xfd00, 0x100, 0, 0, 0, 0, 0, 7
                ))),
            ]
        ),
        _ => anywhere(rng, plan),
    }
}

fn pod_port(rng: &mut Rng) -> u16 {
    pick!(
        rng,
        [40_000, 41_000, 5353, 7, 33_000 + rng.u16() % 8, rng.u16()]
    )
}

fn remote_port(rng: &mut Rng) -> u16 {
    pick!(rng, [80, 443, 53, 7777, 0, rng.u16()])
}

/// A port a gateway may have translated to: the flows', the pods' own, the range's ends.
fn translated_port(rng: &mut Rng) -> u16 {
    pick!(
        rng,
        [
            20_001,
            20_002,
            20_003,
            20_004,
            40_000,
            5353,
            node::PORT_MIN,
            node::PORT_MAX,
            rng.u16(),
        ]
    )
}

// ---- transport ----

/// A TCP segment with any of the 256 flag combinations, options now and then.
fn tcp(sport: u16, dport: u16, rng: &mut Rng) -> L4 {
    let flags = rng.u8();
    let options = match rng.below(10) {
        0..3 => {
            let [hi, lo] = (pick!(rng, [1460u16, 1440, 9000, 536, 0, rng.u16()])).to_be_bytes();
            vec![1, 1, 4, 2, 2, 4, hi, lo, 3, 3, 7, 0]
        }
        3 => {
            let n = rng.range(1, 40);
            rng.bytes(n)
        }
        _ => Vec::new(),
    };
    let payload_len = pick!(rng, [0, 0, 1, 20, rng.range(0, 1400)]);
    L4::Tcp {
        sport,
        dport,
        flags,
        seq: rng.u32(),
        ack: rng.u32(),
        options,
        payload: rng.bytes(payload_len),
    }
}

fn udp(sport: u16, dport: u16, rng: &mut Rng) -> L4 {
    let payload_len = pick!(rng, [0, 8, 15, rng.range(0, 1400)]);
    let payload = rng.bytes(payload_len);
    if rng.chance(10) {
        L4::udp_no_checksum(sport, dport, &payload)
    } else {
        L4::udp(sport, dport, &payload)
    }
}

/// UDP to a VXLAN port carrying a VXLAN header and garbage (or a frame) inside.
fn vxlan(rng: &mut Rng, plan: &Plan) -> L4 {
    let dport = pick!(
        rng,
        [egress_common::config::DEFAULT_TUNNEL_PORT, 4789, 8472]
    );
    let vni = rng.u32() & 0x00ff_ffff;
    let mut payload = vec![0x08, 0, 0, 0];
    payload.extend_from_slice(&(vni << 8).to_be_bytes());
    let inner = if rng.chance(50) {
        garbage(rng)
    } else {
        let p = from_pod(rng, plan);
        p.build(rng)
    };
    payload.extend_from_slice(&inner);
    L4::udp(rng.u16(), dport, &payload)
}

/// Anything that is not TCP, UDP or ICMP: GRE, SCTP, ESP, AH, IPv6 headers in IPv4, any.
fn other_proto(rng: &mut Rng) -> L4 {
    let proto = pick!(rng, [47, 132, 50, 51, 0, 41, 43, 44, 59, 60, 255, rng.u8()]);
    let n = rng.range(0, 64);
    L4::raw(proto, &rng.bytes(n))
}

/// An ICMP (or ICMPv6) error from `from` quoting a packet that `quoted_src` sent to
/// `from`-ish: usually one of the plan's translated flows, as a gateway sent it.
fn icmp_err(rng: &mut Rng, plan: &Plan, quoted_src: IpAddr, quoted_dst: IpAddr) -> L4 {
    let l4 = match rng.below(4) {
        0 => L4::tcp(translated_port(rng), remote_port(rng), rng.u8()),
        1 => L4::udp(translated_port(rng), remote_port(rng), b"quoted"),
        2 => L4::echo_request(translated_port(rng), 1),
        _ => other_proto(rng),
    };
    let inner = match (quoted_src, quoted_dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => ipv4(rng, s, d, l4).build(),
        (IpAddr::V6(s), IpAddr::V6(d)) => ipv6(rng, s, d, l4).build(),
        _ => unreachable!("one family per packet"),
    };
    let ip_len = inner.len() - 14;
    let n = pick!(
        rng,
        [ip_len, ip_len.min(28), ip_len.min(48), rng.range(0, ip_len)]
    );
    let mut quoted = quote(&inner, n);
    if rng.chance(10) && !quoted.is_empty() {
        let i = rng.below(quoted.len());
        quoted[i] = rng.u8();
    }
    let rest = pick!(rng, [[0; 4], [0, 0, 5, 0xdc], rng.u32().to_be_bytes()]);
    if plan.local_pod.is_ipv4() {
        let kind = pick!(rng, [3, 3, 11, 12, 5, rng.u8()]);
        icmp_error(kind, rng.u8() % 16, rest, &quoted)
    } else {
        let kind = pick!(rng, [1, 2, 3, 4, 128, rng.u8()]);
        icmp6_error(kind, rng.u8() % 8, rest, &quoted)
    }
}

/// Neighbour discovery and other ICMPv6 that is the kernel's.
fn ndp(rng: &mut Rng) -> L4 {
    let target = Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, 0x50);
    packet6::ndp(pick!(rng, [133, 134, 135, 136, 137]), target)
}

/// Transport for a packet from a pod (or a pod's node) to `dst`.
fn outbound_l4(rng: &mut Rng, plan: &Plan, src: IpAddr, dst: IpAddr) -> L4 {
    match rng.below(100) {
        0..45 => tcp(pod_port(rng), remote_port(rng), rng),
        45..63 => udp(pod_port(rng), remote_port(rng), rng),
        63..65 => vxlan(rng, plan),
        65..78 => {
            if rng.chance(80) {
                L4::echo_request(pod_port(rng), rng.u16())
            } else {
                L4::echo_reply(pod_port(rng), rng.u16())
            }
        }
        78..86 => icmp_err(rng, plan, dst, src),
        86..93 if plan.local_pod.is_ipv6() => ndp(rng),
        _ => other_proto(rng),
    }
}

// ---- per program ----

fn from_pod(rng: &mut Rng, plan: &Plan) -> Packet {
    let src = weighted!(
        rng,
        [
            (55, plan.local_pod),
            (15, plan.unselected_pod),
            (5, plan.remote_pod),
            (10, inside(rng, plan.local_pod, 16)),
            (5, anywhere(rng, plan)),
        ]
    );
    let dst = destination(rng, plan);
    let l4 = outbound_l4(rng, plan, src, dst);
    Packet { src, dst, l4 }
}

/// A packet from the tunnel and its metadata: 3 in 4 ask this node to egress it for a
/// rule, the rest are replies a gateway sends back to this node's pods.
fn from_tunnel(rng: &mut Rng, plan: &Plan) -> (Packet, (IpAddr, u32)) {
    if rng.chance(75) {
        let src = weighted!(
            rng,
            [
                (35, plan.remote_pod),
                (20, plan.remote6_pod),
                (10, plan.remote_unselected),
                (10, plan.local_pod),
                (5, plan.unselected_pod),
                (10, anywhere(rng, plan)),
            ]
        );
        let vni = weighted!(
            rng,
            [
                (30, node::RULE_A),
                (20, node::RULE_B),
                (20, node::RULE_SHARED),
                (5, node::RULE_V4_ONLY),
                (5, 0),
                (5, rng.u32() & 0x00ff_ffff),
            ]
        );
        let sender = match plan.owner(src) {
            Some(owner) if rng.chance(75) => owner,
            _ => sender(rng),
        };
        let dst = destination(rng, plan);
        let l4 = outbound_l4(rng, plan, src, dst);
        (Packet { src, dst, l4 }, (sender, vni))
    } else {
        let src = weighted!(
            rng,
            [
                (25, plan.dest_a),
                (20, plan.dest_b),
                (20, plan.dest_far),
                (15, destination(rng, plan)),
            ]
        );
        let dst = weighted!(
            rng,
            [
                (50, plan.local_pod),
                (15, plan.unselected_pod),
                (15, plan.remote_pod),
                (20, anywhere(rng, plan)),
            ]
        );
        let vni = if rng.chance(95) {
            RETURN_VNI
        } else {
            rng.u32()
        };
        let sender = if rng.chance(80) {
            pick!(rng, [PEER, PEER6])
        } else {
            sender(rng)
        };
        let l4 = inbound_l4(rng, plan, src, dst);
        (Packet { src, dst, l4 }, (sender, vni))
    }
}

fn sender(rng: &mut Rng) -> IpAddr {
    pick!(
        rng,
        [
            PEER,
            PEER6,
            node::NODE,
            STRANGER,
            IpAddr::V4(Ipv4Addr::from_bits(rng.u32())),
            IpAddr::V6(Ipv6Addr::from_bits(u128::from(rng.u64()) << 64)),
        ]
    )
}

/// Transport of a packet from a remote host back towards `dst` (an egress IP or a pod).
fn inbound_l4(rng: &mut Rng, plan: &Plan, src: IpAddr, dst: IpAddr) -> L4 {
    match rng.below(100) {
        0..40 => tcp(remote_port(rng), translated_port(rng), rng),
        40..60 => udp(remote_port(rng), translated_port(rng), rng),
        60..70 => {
            if rng.chance(80) {
                L4::echo_reply(translated_port(rng), rng.u16())
            } else {
                L4::echo_request(translated_port(rng), rng.u16())
            }
        }
        70..92 => {
            let quoted_dst = error_quoted_dst(rng, plan, src);
            icmp_err(rng, plan, dst, quoted_dst)
        }
        92..95 if plan.local_pod.is_ipv6() => ndp(rng),
        _ => other_proto(rng),
    }
}

/// Whom the quoted packet of an ICMP error was for: the error's sender (a host's own
/// unreachable) or a host behind it (a router's).
fn error_quoted_dst(rng: &mut Rng, plan: &Plan, src: IpAddr) -> IpAddr {
    pick!(rng, [src, plan.dest_a, plan.dest_far, plan.dest_b])
}

/// A packet from a host on a secondary network: to the gateway's egress IPs mostly,
/// often exactly the reply (or an ICMP error about) one of the established flows.
fn from_secondary(rng: &mut Rng, plan: &Plan) -> Packet {
    if rng.chance(30) {
        let f = *rng.pick(&plan.flows);
        return flow_reply(rng, plan, &f);
    }
    let src = weighted!(
        rng,
        [
            (25, plan.dest_a),
            (20, plan.dest_b),
            (20, plan.dest_far),
            (15, destination(rng, plan)),
            (20, anywhere(rng, plan)),
        ]
    );
    let dst = weighted!(
        rng,
        [
            (30, plan.egress_a),
            (25, plan.egress_b),
            (25, plan.shared_a),
            (10, destination(rng, plan)),
            (10, anywhere(rng, plan)),
        ]
    );
    let l4 = inbound_l4(rng, plan, src, dst);
    Packet { src, dst, l4 }
}

/// The reply of an established flow (any TCP flags), or an ICMP error about it quoting
/// the packet the gateway sent.
fn flow_reply(rng: &mut Rng, plan: &Plan, f: &node::Flow) -> Packet {
    let l4 = if rng.chance(25) {
        let sent = match f.proto {
            6 => L4::tcp(f.egress_port, f.remote_port, rng.u8()),
            17 => L4::udp(f.egress_port, f.remote_port, b"sent"),
            _ => L4::echo_request(f.egress_port, 1),
        };
        let inner = match (f.egress, f.remote) {
            (IpAddr::V4(s), IpAddr::V4(d)) => Ipv4Packet::new(s, d, sent).build(),
            (IpAddr::V6(s), IpAddr::V6(d)) => Ipv6Packet::new(s, d, sent).build(),
            _ => unreachable!("one family per flow"),
        };
        let n = (inner.len() - 14).min(pick!(rng, [28, 48, 1500]));
        let q = quote(&inner, n);
        if plan.local_pod.is_ipv4() {
            icmp_error(pick!(rng, [3, 11]), rng.u8() % 16, [0, 0, 5, 0xdc], &q)
        } else {
            icmp6_error(pick!(rng, [1, 2, 3]), 0, [0, 0, 5, 0xdc], &q)
        }
    } else {
        match f.proto {
            6 => tcp(f.remote_port, f.egress_port, rng),
            17 => udp(f.remote_port, f.egress_port, rng),
            _ => L4::echo_reply(f.egress_port, rng.u16()),
        }
    };
    Packet {
        src: f.remote,
        dst: f.egress,
        l4,
    }
}

/// The secondary interface a packet to `dst` arrives on: that of its network, mostly.
fn secondary_dev(rng: &mut Rng, plan: &Plan, dst: IpAddr) -> Dev {
    if rng.chance(10) {
        return pick!(rng, [Dev::Sec0, Dev::Sec1]);
    }
    if dst == plan.egress_b || node::contains(plan.dest_b, 24, dst) {
        Dev::Sec1
    } else {
        Dev::Sec0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_case_is_made_again_from_its_seed_and_index() {
        for prog in Prog::ALL {
            for i in 0..200 {
                let a = case(42, prog, i);
                let b = case(42, prog, i);
                assert_eq!(a.frame, b.frame);
                assert_eq!(a.tunnel, b.tunnel);
                assert!(a.frame.len() >= 14, "{prog:?} {i}: shorter than Ethernet");
            }
        }
    }
}
