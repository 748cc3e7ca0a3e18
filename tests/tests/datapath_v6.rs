//! The IPv6 datapath (IPv6 pods, over an IPv4 and over an IPv6 underlay), program by program, as tables of
//! `BPF_PROG_TEST_RUN` cases against the real object, in the style of `datapath_v4.rs`:
//! maps set up, frames in, verdict, frames out (built from scratch by `packet6`, with
//! checksums over the IPv6 pseudo-header computed by the test) and counters by reason.
//!
//! Every case runs on a thread of its own, in a fresh network namespace:
//!
//! ```text
//!   pod0  veth 02:00:00:00:bb:01 -- pod fd00:244:1::5 (02:00:00:00:aa:01), route /128
//!   tun0  veth: stands in for the collect-metadata VXLAN device
//!   ul0   veth: 192.168.0.10/24 or fd00:ff::10/64, the underlay: this node
//!   sec0  veth 02:00:00:00:0a:02, fd00:100::2/64: egress IP fd00:100::50 (rule 1); its
//!         own address serves an `interface:` rule (rule 4)
//!         neighbours fd00:100::7 (destination), fd00:100::1 (router to fd00:172:16::/48)
//!   sec1  veth 02:00:00:00:0b:02, fd00:200::2/64: egress IP fd00:200::50 (rule 2)
//!         neighbour fd00:200::9
//! ```
//!
//! Addresses carry `nodad` (usable at once) and IPv6 forwarding is on (the FIB helper
//! refuses to forward otherwise).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use aya::maps::{HashMap, MapData};
use egress_agent::ebpf::{FROM_POD, FROM_SECONDARY, FROM_TUNNEL, FROM_UNDERLAY};
use egress_common::{
    config::{Config, flags},
    conntrack::{self, CtEntryV6, CtKeyV6, NextHop, dir, state},
    counters::reason::*,
    maps,
    policy::{
        EgressIpValue, PodOwnerValue, PolicyValueV6, RETURN_VNI, RuleValueV6, action,
        egress_ip_flags,
    },
    underlay,
};
use egress_tests::{
    packet::{
        HOST_MAC, L4, POD_MAC, PROTO_GRE, PROTO_TCP, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, arp_frame,
        checksum, quote, vxlan,
    },
    packet6::{
        ICMPV6_DEST_UNREACH, ICMPV6_NEIGHBOUR_ADVERT, ICMPV6_NEIGHBOUR_SOLICIT, ICMPV6_PKT_TOO_BIG,
        ICMPV6_ROUTER_SOLICIT, ICMPV6_TIME_EXCEEDED, Ipv6Packet, NEXTHDR_DEST, NEXTHDR_HOP, icmp6,
        icmp6_error, l4_offset, ndp, pseudo_header6, solicited_node,
    },
    table::{self, Bed, Case, Dev, Out, Step, case, frame_diff, no_setup, step},
    testrun::{
        Datapath, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC, ifindex, in_netns, ip, ktime_ns,
        sysctl,
    },
};

// ---- the cluster, as seen from this node ----

const fn a(a: u8, b: u8, c: u8, d: u8) -> Ipv4Addr {
    Ipv4Addr::new(a, b, c, d)
}

const fn v6(a: u16, b: u16, c: u16, h: u16) -> Ipv6Addr {
    Ipv6Addr::new(a, b, c, 0, 0, 0, 0, h)
}

/// The underlay as this node sees it. Every table runs twice: over an IPv4 underlay and
/// over an IPv6 one.
#[derive(Clone, Copy, Debug)]
struct UnderlayNet {
    /// This node (source node and gateway).
    node: IpAddr,
    /// Another known node.
    peer: IpAddr,
    /// Not a node.
    stranger: IpAddr,
    /// `ul0`'s address.
    cidr: &'static str,
}

const UL4: UnderlayNet = UnderlayNet {
    node: IpAddr::V4(a(192, 168, 0, 10)),
    peer: IpAddr::V4(a(192, 168, 0, 20)),
    stranger: IpAddr::V4(a(192, 168, 0, 99)),
    cidr: "192.168.0.10/24",
};

const UL6: UnderlayNet = UnderlayNet {
    node: IpAddr::V6(v6(0xfd00, 0xff, 0, 0x10)),
    peer: IpAddr::V6(v6(0xfd00, 0xff, 0, 0x20)),
    stranger: IpAddr::V6(v6(0xfd00, 0xff, 0, 0x99)),
    cidr: "fd00:ff::10/64 nodad",
};

const LOCAL_POD: Ipv6Addr = v6(0xfd00, 0x244, 1, 5);
const UNSELECTED_POD: Ipv6Addr = v6(0xfd00, 0x244, 1, 9);
const REMOTE_POD: Ipv6Addr = v6(0xfd00, 0x244, 2, 5);
const REMOTE_POD2: Ipv6Addr = v6(0xfd00, 0x244, 2, 6);
const REMOTE_POD3: Ipv6Addr = v6(0xfd00, 0x244, 2, 7);
/// A pod of the peer that no policy selects: in `POD_OWNER_V6`, not in `ADMITTED_V6`.
const REMOTE_UNSELECTED: Ipv6Addr = v6(0xfd00, 0x244, 2, 9);

/// Network A (sec0): fd00:100::/64.
const NET_A: Ipv6Addr = v6(0xfd00, 0x100, 0, 0);
const DEST_A: Ipv6Addr = v6(0xfd00, 0x100, 0, 7);
const DEST_A_NO_NEIGH: Ipv6Addr = v6(0xfd00, 0x100, 0, 8);
const ROUTER_A: Ipv6Addr = v6(0xfd00, 0x100, 0, 1);
const DEST_FAR: Ipv6Addr = v6(0xfd00, 0x172, 0x16, 5);
const DEST_B: Ipv6Addr = v6(0xfd00, 0x200, 0, 9);
const INTERNET: Ipv6Addr = v6(0x2001, 0xdb8, 0, 8);

const EGRESS_A: Ipv6Addr = v6(0xfd00, 0x100, 0, 0x50);
const EGRESS_B: Ipv6Addr = v6(0xfd00, 0x200, 0, 0x50);
/// sec0's own address, used by an `interface:` rule (shared with the host).
const SHARED_A: Ipv6Addr = v6(0xfd00, 0x100, 0, 2);

const RULE_A: u32 = 1;
const RULE_B: u32 = 2;
/// A rule id the gateway serves for IPv4 only.
const RULE_V4_ONLY: u32 = 3;
/// An `interface:` rule: out of sec0 with sec0's own address.
const RULE_SHARED: u32 = 4;

const POD0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xbb, 0x01];
const SEC0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0x02];
const SEC1_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0b, 0x02];
const DEST_A_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0x07];
const ROUTER_A_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0x01];
const DEST_B_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0b, 0x09];

const PORT_MIN: u16 = 20_000;
const PORT_MAX: u16 = 29_999;
const TUNNEL_MTU: u16 = 1450;

fn mac(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

struct Net {
    ul: UnderlayNet,
    pod0: u32,
    tun0: u32,
    sec0: u32,
    sec1: u32,
}

fn topology(ul: UnderlayNet) -> Net {
    for (dev, m, addr) in [
        ("ul0", [0x02, 0, 0, 0, 0xcc, 0x01], Some(ul.cidr)),
        ("tun0", [0x02, 0, 0, 0, 0xdd, 0x01], None),
        ("pod0", POD0_MAC, None),
        ("sec0", SEC0_MAC, Some("fd00:100::2/64 nodad")),
        ("sec1", SEC1_MAC, Some("fd00:200::2/64 nodad")),
    ] {
        ip(&format!(
            "link add {dev} address {} type veth peer name {dev}p",
            mac(m)
        ));
        if let Some(addr) = addr {
            ip(&format!("addr add {addr} dev {dev}"));
        }
        ip(&format!("link set {dev} up"));
        ip(&format!("link set {dev}p up"));
    }
    ip(&format!("-6 route add {LOCAL_POD}/128 dev pod0"));
    ip(&format!(
        "-6 route add fd00:172:16::/48 via {ROUTER_A} dev sec0"
    ));
    for (addr, m, dev) in [
        (LOCAL_POD, POD_MAC, "pod0"),
        (DEST_A, DEST_A_MAC, "sec0"),
        (ROUTER_A, ROUTER_A_MAC, "sec0"),
        (DEST_B, DEST_B_MAC, "sec1"),
    ] {
        ip(&format!(
            "-6 neigh replace {addr} lladdr {} dev {dev} nud permanent",
            mac(m)
        ));
    }
    sysctl("net/ipv4/conf/all/forwarding", "1");
    sysctl("net/ipv6/conf/all/forwarding", "1");
    Net {
        ul,
        pod0: ifindex("pod0"),
        tun0: ifindex("tun0"),
        sec0: ifindex("sec0"),
        sec1: ifindex("sec1"),
    }
}

fn config(net: &Net) -> Config {
    Config {
        node_ip: underlay::from_ip(net.ul.node),
        tunnel_ifindex: net.tun0,
        port_min: PORT_MIN,
        port_max: PORT_MAX,
        tunnel_mtu: TUNNEL_MTU,
        flags: flags::READY,
        max_flows_per_pod: 0,
    }
}

// ---- IPv6 map setters ----

fn policy6(dp: &mut Datapath, pod: Ipv6Addr, dst: Ipv6Addr, len: u32, value: PolicyValueV6) {
    dp.policy_v6(pod, dst, len, value);
}

fn selected6(dp: &mut Datapath, pod: Ipv6Addr) {
    dp.selected_v6(pod);
}

fn rule6(dp: &mut Datapath, id: u32, egress_ip: Ipv6Addr, ifindex: u32) {
    let mut m: HashMap<&mut MapData, u32, RuleValueV6> =
        HashMap::try_from(dp.map(maps::RULES_V6)).unwrap();
    m.insert(
        id,
        RuleValueV6 {
            egress_ip: egress_ip.octets(),
            ifindex,
        },
        0,
    )
    .unwrap();
}

fn pod_owner6(dp: &mut Datapath, pod: Ipv6Addr, node: IpAddr) {
    let mut m: HashMap<&mut MapData, [u8; 16], PodOwnerValue> =
        HashMap::try_from(dp.map(maps::POD_OWNER_V6)).unwrap();
    m.insert(
        pod.octets(),
        PodOwnerValue {
            node: underlay::from_ip(node),
        },
        0,
    )
    .unwrap();
}

fn egress_ip6(dp: &mut Datapath, addr: Ipv6Addr, ifindex: u32, flags: u32) {
    let mut m: HashMap<&mut MapData, [u8; 16], EgressIpValue> =
        HashMap::try_from(dp.map(maps::EGRESS_IPS_V6)).unwrap();
    m.insert(addr.octets(), EgressIpValue { ifindex, flags }, 0)
        .unwrap();
}

fn ct6(dp: &mut Datapath) -> Vec<(CtKeyV6, CtEntryV6)> {
    let m: HashMap<&mut MapData, CtKeyV6, CtEntryV6> =
        HashMap::try_from(dp.map(maps::CT_V6)).unwrap();
    m.iter().map(|r| r.unwrap()).collect()
}

/// What every case starts from: configuration, nodes, pod owners, the gateway's rules
/// (IPv6, and one IPv4-only rule id) and egress IPs.
fn base(dp: &mut Datapath, net: &Net) {
    dp.config(config(net));
    let ul = net.ul;
    dp.node(ul.node, 1);
    dp.node(ul.peer, 2);
    pod_owner6(dp, LOCAL_POD, ul.node);
    pod_owner6(dp, UNSELECTED_POD, ul.node);
    for pod in [REMOTE_POD, REMOTE_POD2, REMOTE_POD3, REMOTE_UNSELECTED] {
        pod_owner6(dp, pod, ul.peer);
    }
    // Every pod but the unselected ones may use every IPv6 rule.
    for pod in [LOCAL_POD, REMOTE_POD, REMOTE_POD2, REMOTE_POD3] {
        for rule in [RULE_A, RULE_B, RULE_SHARED] {
            dp.admit(pod, rule);
        }
    }
    rule6(dp, RULE_A, EGRESS_A, net.sec0);
    rule6(dp, RULE_B, EGRESS_B, net.sec1);
    dp.rule(RULE_V4_ONLY, a(10, 100, 0, 50), net.sec0);
    rule6(dp, RULE_SHARED, SHARED_A, net.sec0);
    egress_ip6(dp, EGRESS_A, net.sec0, 0);
    egress_ip6(dp, EGRESS_B, net.sec1, 0);
    egress_ip6(dp, SHARED_A, net.sec0, egress_ip_flags::SHARED);
}

fn forward(gateway: IpAddr, rule_id: u32) -> PolicyValueV6 {
    PolicyValueV6 {
        gateway: underlay::from_ip(gateway),
        rule_id,
        action: action::FORWARD,
        _pad: 0,
        filter: 0,
        egress_ip: EGRESS_A.octets(),
    }
}

fn sentinel(act: u8) -> PolicyValueV6 {
    PolicyValueV6 {
        gateway: [0; 16],
        rule_id: 0,
        action: act,
        _pad: 0,
        filter: 0,
        egress_ip: [0; 16],
    }
}

/// `LOCAL_POD` selected, network A (fd00:100::/64) through rule A at `gateway`.
fn local_pod_to_a(dp: &mut Datapath, gateway: IpAddr) {
    selected6(dp, LOCAL_POD);
    policy6(dp, LOCAL_POD, NET_A, 64, forward(gateway, RULE_A));
}

// ---- the table machinery (`egress_tests::table`) ----

impl Bed for Net {
    fn ifindex(&self, dev: Dev) -> u32 {
        match dev {
            Dev::Pod => self.pod0,
            Dev::Tunnel => self.tun0,
            Dev::Secondary => self.sec0,
        }
    }
}

fn from_pod(p: &Ipv6Packet) -> Step {
    step(FROM_POD, Dev::Pod, None, p)
}

fn from_tunnel(sender: IpAddr, vni: u32, p: &Ipv6Packet) -> Step {
    step(FROM_TUNNEL, Dev::Tunnel, Some((sender, vni)), p)
}

fn from_secondary(p: &Ipv6Packet) -> Step {
    step(FROM_SECONDARY, Dev::Secondary, None, p)
}

/// Run every case (each in its own namespace, in parallel) from the topology over `ul`
/// and the base maps, and report all failures.
fn run_table(ul: UnderlayNet, cases: Vec<Case<Net>>) {
    let what = format!("the IPv6 table over the {ul:?}");
    table::run_table(&what, cases, move || {
        let net = topology(ul);
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        (net, dp)
    });
}

// ---- packets ----

fn tcp(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, flags: u8) -> Ipv6Packet {
    Ipv6Packet::new(src, dst, L4::tcp(sport, dport, flags))
}

fn syn(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, mss: u16) -> Ipv6Packet {
    Ipv6Packet::new(src, dst, L4::syn(sport, dport, mss))
}

fn udp(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16) -> Ipv6Packet {
    Ipv6Packet::new(src, dst, L4::udp(sport, dport, b"hello, gateway!"))
}

fn big_udp(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16) -> Ipv6Packet {
    let payload: Vec<u8> = (0..1380u32).map(|i| (i * 7 + 3) as u8).collect();
    Ipv6Packet::new(src, dst, L4::udp(sport, dport, &payload))
}

fn echo(src: Ipv6Addr, dst: Ipv6Addr, id: u16) -> Ipv6Packet {
    Ipv6Packet::new(src, dst, L4::echo_request(id, 1))
}

fn echo_reply(src: Ipv6Addr, dst: Ipv6Addr, id: u16) -> Ipv6Packet {
    Ipv6Packet::new(src, dst, L4::echo_reply(id, 1))
}

/// Five destination options headers: one more than the datapath walks.
fn too_many_ext(p: &Ipv6Packet) -> Ipv6Packet {
    (0..5).fold(p.clone(), |p, _| p.pad_options(NEXTHDR_DEST))
}

/// `p` after NAT66 to `src:sport` on the gateway, out of an interface with MAC `smac`
/// towards `dmac`.
fn snatted(p: &Ipv6Packet, src: Ipv6Addr, sport: u16, smac: [u8; 6], dmac: [u8; 6]) -> Ipv6Packet {
    p.clone()
        .src(src)
        .l4(p.l4.clone().with_sport(sport))
        .hop_limit(p.hop_limit - 1)
        .macs(dmac, smac)
}

/// `p` (a reply) after reverse NAT66 to `dst:dport`, MACs untouched (tunnel).
fn unnatted(p: &Ipv6Packet, dst: Ipv6Addr, dport: u16) -> Ipv6Packet {
    p.clone()
        .dst(dst)
        .l4(p.l4.clone().with_dport(dport))
        .hop_limit(p.hop_limit - 1)
}

/// Source port (or ICMPv6 echo identifier) of an output frame.
fn sport_of(f: &[u8]) -> u16 {
    let off = l4_offset(f);
    let off = if f[20] == 58 { off + 4 } else { off };
    u16::from_be_bytes([f[off], f[off + 1]])
}

/// `p` NAT66ed to `EGRESS_A` on a port of the configured range other than `not`.
fn snatted_in_range(p: &Ipv6Packet, not: u16) -> impl Fn(&[u8]) -> Result<(), String> + use<> {
    let p = p.clone();
    move |out: &[u8]| {
        let port = sport_of(out);
        if port == not || !(PORT_MIN..=PORT_MAX).contains(&port) {
            return Err(format!(
                "translated port {port}: not a fresh port of the range"
            ));
        }
        frame_diff(
            out,
            &snatted(&p, EGRESS_A, port, SEC0_MAC, DEST_A_MAC).build(),
        )
    }
}

// ---- from_pod ----

fn from_pod_table(u: UnderlayNet) {
    let to_a = tcp(LOCAL_POD, 40_000, DEST_A, 80, TCP_ACK);
    let local_gw_out = snatted(&to_a, EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC);
    let with_ext = |p: &Ipv6Packet| p.clone().pad_options(NEXTHDR_HOP).pad_options(NEXTHDR_DEST);
    let syn_1440 = syn(LOCAL_POD, 40_000, DEST_A, 80, 1440);
    let syn_clamped = syn(LOCAL_POD, 40_000, DEST_A, 80, TUNNEL_MTU - 60);
    let udp_a = udp(LOCAL_POD, 5353, DEST_A, 53);
    let echo_a = echo(LOCAL_POD, DEST_A, 7);
    let mut short_frame = to_a.build();
    short_frame.truncate(14 + 40 + 10);
    // Everything the pod sends goes through rule A at u.peer.
    let everything = move |dp: &mut Datapath, _: &Net| {
        selected6(dp, LOCAL_POD);
        policy6(
            dp,
            LOCAL_POD,
            Ipv6Addr::UNSPECIFIED,
            0,
            forward(u.peer, RULE_A),
        );
    };

    run_table(
        u,
        vec![
            case(
                "unselected pod passes untouched, uncounted",
                move |dp, _| local_pod_to_a(dp, u.peer),
                vec![from_pod(&to_a.clone().src(UNSELECTED_POD)).passes()],
                &[],
            ),
            case(
                "local gateway: a pod with a policy entry but not admitted for its rule dropped",
                move |dp, _| {
                    selected6(dp, UNSELECTED_POD);
                    policy6(dp, UNSELECTED_POD, NET_A, 64, forward(u.node, RULE_A));
                },
                vec![from_pod(&to_a.clone().src(UNSELECTED_POD)).dropped()],
                &[(LOCAL_GATEWAY, 1), (DROP_NOT_ADMITTED, 1)],
            ),
            case(
                "ARP of a pod passes",
                move |dp, _| local_pod_to_a(dp, u.peer),
                vec![from_pod(&to_a).raw(arp_frame()).passes()],
                &[],
            ),
            case(
                "selected pod, destination outside every rule, passes uncounted",
                move |dp, _| local_pod_to_a(dp, u.peer),
                vec![from_pod(&to_a.clone().dst(INTERNET)).passes()],
                &[],
            ),
            case(
                "remote gateway: tunneled untouched",
                move |dp, _| local_pod_to_a(dp, u.peer),
                vec![from_pod(&to_a).tunneled()],
                &[(TUNNELED, 1)],
            ),
            case(
                "neighbour discovery passes untouched under a ::/0 rule",
                everything,
                vec![
                    from_pod(&Ipv6Packet::new(
                        LOCAL_POD,
                        solicited_node(DEST_A),
                        ndp(ICMPV6_NEIGHBOUR_SOLICIT, DEST_A),
                    ))
                    .passes(),
                    // Unicast solicitation (reachability confirmation) to a rule's destination.
                    from_pod(&Ipv6Packet::new(
                        LOCAL_POD,
                        DEST_A,
                        ndp(ICMPV6_NEIGHBOUR_SOLICIT, DEST_A),
                    ))
                    .passes(),
                    from_pod(&Ipv6Packet::new(
                        LOCAL_POD,
                        DEST_A,
                        ndp(ICMPV6_NEIGHBOUR_ADVERT, LOCAL_POD),
                    ))
                    .passes(),
                    from_pod(&Ipv6Packet::new(
                        LOCAL_POD,
                        "ff02::2".parse().unwrap(),
                        icmp6(ICMPV6_ROUTER_SOLICIT, &[0; 4]),
                    ))
                    .passes(),
                    from_pod(&to_a).tunneled(),
                ],
                &[(TUNNELED, 1)],
            ),
            case(
                "link-local and multicast destinations pass under a ::/0 rule",
                everything,
                vec![
                    from_pod(&to_a.clone().dst("fe80::1".parse().unwrap())).passes(),
                    from_pod(&udp_a.clone().dst("ff02::fb".parse().unwrap())).passes(),
                ],
                &[],
            ),
            case(
                "longest prefix wins: /128 inside the /64 goes to its own (local) gateway",
                move |dp, _| {
                    local_pod_to_a(dp, u.peer);
                    policy6(dp, LOCAL_POD, DEST_A, 128, forward(u.node, RULE_A));
                },
                vec![
                    from_pod(&to_a).redirected(&local_gw_out),
                    from_pod(&to_a.clone().dst(v6(0xfd00, 0x100, 0, 6))).tunneled(),
                ],
                &[
                    (LOCAL_GATEWAY, 1),
                    (SNAT_NEW, 1),
                    (FORWARDED, 1),
                    (TUNNELED, 1),
                ],
            ),
            case(
                "except prefix passes untouched, counted EXCLUDED",
                move |dp, _| {
                    local_pod_to_a(dp, u.peer);
                    policy6(dp, LOCAL_POD, NET_A, 125, sentinel(action::EXCLUDE));
                },
                vec![
                    from_pod(&to_a).passes(),
                    from_pod(&to_a.clone().dst(v6(0xfd00, 0x100, 0, 9))).tunneled(),
                ],
                &[(EXCLUDED, 1), (TUNNELED, 1)],
            ),
            case(
                "nested prefixes of two pods: each pod's longest prefix wins, except holes pass",
                move |dp, _| {
                    // LOCAL_POD: /16 drops, /48 falls through, /64 tunnels, /124 is a hole.
                    selected6(dp, LOCAL_POD);
                    let drop = sentinel(action::NO_GATEWAY_DROP);
                    policy6(dp, LOCAL_POD, v6(0xfd00, 0, 0, 0), 16, drop);
                    let pass = sentinel(action::NO_GATEWAY_PASS);
                    policy6(dp, LOCAL_POD, NET_A, 48, pass);
                    policy6(dp, LOCAL_POD, NET_A, 64, forward(u.peer, RULE_A));
                    let hole = sentinel(action::EXCLUDE);
                    policy6(dp, LOCAL_POD, v6(0xfd00, 0x100, 0, 0x10), 124, hole);
                    // Another pod's prefixes in between: lengths LOCAL_POD does not use.
                    selected6(dp, UNSELECTED_POD);
                    policy6(dp, UNSELECTED_POD, NET_A, 56, drop);
                    policy6(dp, UNSELECTED_POD, v6(0xfd00, 0x100, 0, 0x80), 121, hole);
                    policy6(dp, UNSELECTED_POD, v6(0xfd00, 0x100, 0, 0x99), 128, hole);
                    // ... and one of a length LOCAL_POD uses, on another network.
                    let net: Ipv6Addr = "fd00:100:0:5::".parse().unwrap();
                    policy6(dp, UNSELECTED_POD, net, 64, drop);
                },
                vec![
                    // The /124 hole, inside the /64.
                    from_pod(&to_a.clone().dst(v6(0xfd00, 0x100, 0, 0x14))).passes(),
                    // The /64, also inside the other pod's /56, /121 and /128.
                    from_pod(&to_a).tunneled(),
                    from_pod(&to_a.clone().dst(v6(0xfd00, 0x100, 0, 0x99))).tunneled(),
                    // The /48, inside the other pod's /56 (fd00:100:0:9::1).
                    from_pod(&to_a.clone().dst("fd00:100:0:9::1".parse().unwrap())).passes(),
                    // The /48, inside the other pod's /56 and /64 (LOCAL_POD has /64s too).
                    from_pod(&to_a.clone().dst("fd00:100:0:5::1".parse().unwrap())).passes(),
                    // The /16.
                    from_pod(&to_a.clone().dst(v6(0xfd00, 0x7, 0, 7))).dropped(),
                    // Outside the /16.
                    from_pod(&to_a.clone().dst(INTERNET)).passes(),
                    // The other pod: its /56, its /121 hole and its /128 hole.
                    from_pod(&to_a.clone().src(UNSELECTED_POD)).dropped(),
                    from_pod(
                        &to_a
                            .clone()
                            .src(UNSELECTED_POD)
                            .dst(v6(0xfd00, 0x100, 0, 0x81)),
                    )
                    .passes(),
                    from_pod(
                        &to_a
                            .clone()
                            .src(UNSELECTED_POD)
                            .dst(v6(0xfd00, 0x100, 0, 0x99)),
                    )
                    .passes(),
                ],
                &[
                    (EXCLUDED, 3),
                    (TUNNELED, 2),
                    (FALLTHROUGH, 2),
                    (DROP_NO_GATEWAY, 2),
                ],
            ),
            case(
                "a ::/0 and a /128 of one pod: both ends of the prefix lengths",
                move |dp, _| {
                    selected6(dp, LOCAL_POD);
                    policy6(dp, LOCAL_POD, v6(0, 0, 0, 0), 0, forward(u.peer, RULE_A));
                    policy6(dp, LOCAL_POD, DEST_A, 128, sentinel(action::EXCLUDE));
                },
                vec![
                    from_pod(&to_a).passes(),
                    from_pod(&to_a.clone().dst(DEST_FAR)).tunneled(),
                ],
                &[(EXCLUDED, 1), (TUNNELED, 1)],
            ),
            case(
                "no gateway, failurePolicy Drop: dropped",
                move |dp, _| {
                    selected6(dp, LOCAL_POD);
                    policy6(dp, LOCAL_POD, NET_A, 64, sentinel(action::NO_GATEWAY_DROP));
                },
                vec![from_pod(&to_a).dropped()],
                &[(DROP_NO_GATEWAY, 1)],
            ),
            case(
                "no gateway, failurePolicy Fallthrough: passes",
                move |dp, _| {
                    selected6(dp, LOCAL_POD);
                    policy6(dp, LOCAL_POD, NET_A, 64, sentinel(action::NO_GATEWAY_PASS));
                },
                vec![from_pod(&to_a).passes()],
                &[(FALLTHROUGH, 1)],
            ),
            case(
                "SYN MSS 1440 clamped to tunnel_mtu - 60, checksum valid",
                move |dp, _| local_pod_to_a(dp, u.peer),
                vec![from_pod(&syn_1440).expect(TC_ACT_REDIRECT, Out::Frame(syn_clamped.build()))],
                &[(MSS_CLAMPED, 1), (TUNNELED, 1)],
            ),
            case(
                "SYN behind extension headers: MSS clamped at the right offset",
                move |dp, _| local_pod_to_a(dp, u.peer),
                vec![
                    from_pod(&with_ext(&syn_1440))
                        .expect(TC_ACT_REDIRECT, Out::Frame(with_ext(&syn_clamped).build())),
                ],
                &[(MSS_CLAMPED, 1), (TUNNELED, 1)],
            ),
            case(
                "local gateway: NAT66 to the egress IP, hop limit decremented, out of sec0",
                move |dp, _| local_pod_to_a(dp, u.node),
                vec![from_pod(&to_a).redirected(&local_gw_out)],
                &[(LOCAL_GATEWAY, 1), (SNAT_NEW, 1), (FORWARDED, 1)],
            ),
            case(
                "local gateway behind hop-by-hop and destination options: NAT66 checksums correct",
                move |dp, _| local_pod_to_a(dp, u.node),
                vec![from_pod(&with_ext(&to_a)).redirected(&with_ext(&local_gw_out))],
                &[(LOCAL_GATEWAY, 1), (SNAT_NEW, 1), (FORWARDED, 1)],
            ),
            case(
                "routing header with no segments left: walked",
                move |dp, _| local_pod_to_a(dp, u.node),
                vec![
                    from_pod(&to_a.clone().routing(0)).redirected(&local_gw_out.clone().routing(0)),
                ],
                &[(LOCAL_GATEWAY, 1), (SNAT_NEW, 1), (FORWARDED, 1)],
            ),
            case(
                "local gateway, UDP and ICMPv6 echo: NAT66",
                move |dp, _| local_pod_to_a(dp, u.node),
                vec![
                    from_pod(&udp_a)
                        .redirected(&snatted(&udp_a, EGRESS_A, 5353, SEC0_MAC, DEST_A_MAC)),
                    from_pod(&echo_a)
                        .redirected(&snatted(&echo_a, EGRESS_A, 7, SEC0_MAC, DEST_A_MAC)),
                ],
                &[(LOCAL_GATEWAY, 2), (SNAT_NEW, 2), (FORWARDED, 2)],
            ),
            case(
                "local gateway, hop limit 1 dropped",
                move |dp, _| local_pod_to_a(dp, u.node),
                vec![from_pod(&to_a.clone().hop_limit(1)).dropped()],
                &[(LOCAL_GATEWAY, 1), (DROP_TTL_EXCEEDED, 1)],
            ),
            case(
                "five extension headers (more than walked) dropped",
                move |dp, _| local_pod_to_a(dp, u.peer),
                vec![from_pod(&too_many_ext(&to_a)).dropped()],
                &[(DROP_IPV6_EXT_HDR, 1)],
            ),
            case(
                "routing header with segments left dropped",
                move |dp, _| local_pod_to_a(dp, u.peer),
                vec![from_pod(&to_a.clone().routing(1)).dropped()],
                &[(DROP_IPV6_EXT_HDR, 1)],
            ),
            case(
                "fragments (first, and later) of a selected flow dropped",
                move |dp, _| local_pod_to_a(dp, u.peer),
                vec![
                    from_pod(&to_a.clone().fragment(0, true)).dropped(),
                    from_pod(&with_ext(&to_a).fragment(185, false)).dropped(),
                ],
                &[(DROP_FRAGMENT, 2)],
            ),
            case(
                "zero UDP checksum (forbidden in IPv6) dropped",
                move |dp, _| local_pod_to_a(dp, u.peer),
                vec![from_pod(&udp_a.clone().l4(L4::udp_no_checksum(5353, 53, b"q"))).dropped()],
                &[(DROP_MALFORMED, 1)],
            ),
            case(
                "GRE and ICMPv6 errors in a selected flow dropped",
                move |dp, _| local_pod_to_a(dp, u.peer),
                vec![
                    from_pod(&to_a.clone().l4(L4::raw(PROTO_GRE, &[0; 8]))).dropped(),
                    from_pod(&to_a.clone().l4(icmp6(1, &[0; 12]))).dropped(),
                ],
                &[(DROP_UNSUPPORTED_PROTO, 2)],
            ),
            case(
                "frame shorter than its payload length passes, counted",
                move |dp, _| local_pod_to_a(dp, u.peer),
                vec![from_pod(&to_a).raw(short_frame).passes()],
                &[(MALFORMED_PASSED, 1)],
            ),
            case(
                "agent not ready: selected packet dropped",
                move |dp, net| {
                    local_pod_to_a(dp, u.peer);
                    dp.config(Config {
                        flags: 0,
                        ..config(net)
                    });
                },
                vec![from_pod(&to_a).dropped()],
                &[(DROP_NOT_READY, 1)],
            ),
        ],
    );
}

// ---- from_tunnel ----

/// The IPv4 side of a dual-stack pod (`REMOTE_POD` has `REMOTE_POD_V4` too): rule
/// `RULE_V4_ONLY` leaves sec0 with `EGRESS_V4`.
const REMOTE_POD_V4: Ipv4Addr = a(10, 244, 2, 5);
const DEST_V4: Ipv4Addr = a(10, 100, 0, 7);
const EGRESS_V4: Ipv4Addr = a(10, 100, 0, 50);

fn syn4(src: Ipv4Addr, dst: Ipv4Addr) -> egress_tests::packet::Ipv4Packet {
    egress_tests::packet::Ipv4Packet::new(src, dst, L4::tcp(40_000, 443, 0x02))
}

/// sec0 gets its IPv4 subnet and destination, the peer owns the pod's IPv4 address.
fn dual_stack_setup(dp: &mut Datapath, net: &Net) {
    ip("addr add 10.100.0.2/24 dev sec0");
    ip(&format!(
        "neigh replace {DEST_V4} lladdr {} dev sec0 nud permanent",
        mac(DEST_A_MAC)
    ));
    dp.pod_owner(REMOTE_POD_V4, net.ul.peer);
    dp.admit(REMOTE_POD_V4, RULE_V4_ONLY);
}

fn from_tunnel_table(u: UnderlayNet) {
    let syn_a = tcp(REMOTE_POD, 40_000, DEST_A, 443, 0x02);
    let ack_a = tcp(REMOTE_POD, 40_000, DEST_A, 443, TCP_ACK);
    let out = |p: &Ipv6Packet, port| snatted(p, EGRESS_A, port, SEC0_MAC, DEST_A_MAC);
    let echo1 = echo(REMOTE_POD, DEST_A, 7);
    let echo2 = echo1.clone().src(REMOTE_POD2);
    let udp_a = udp(REMOTE_POD, 5000, DEST_A, 53);
    let reply_in = tcp(DEST_A, 443, LOCAL_POD, 40_000, TCP_ACK).hop_limit(63);
    let with_ext = syn_a
        .clone()
        .pad_options(NEXTHDR_HOP)
        .pad_options(NEXTHDR_DEST);

    run_table(
        u,
        vec![
            case(
                "unknown sender dropped",
                no_setup,
                vec![from_tunnel(u.stranger, RULE_A, &syn_a).dropped()],
                &[(DROP_UNKNOWN_SENDER, 1)],
            ),
            case(
                "inner source not a pod of the sender dropped",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &syn_a.clone().src(LOCAL_POD)).dropped(),
                    from_tunnel(u.peer, RULE_A, &syn_a.clone().src(v6(0xfd00, 0x244, 9, 9)))
                        .dropped(),
                ],
                &[(DROP_SPOOFED_SOURCE, 2)],
            ),
            case(
                "dual-stack pod: each family through its own rule, to its own egress IP",
                dual_stack_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &syn_a).redirected(&out(&syn_a, 40_000)),
                    from_tunnel(u.peer, RULE_V4_ONLY, &syn_a)
                        .raw(syn4(REMOTE_POD_V4, DEST_V4).build())
                        .expect(
                            TC_ACT_REDIRECT,
                            Out::Frame(
                                syn4(EGRESS_V4, DEST_V4)
                                    .ttl(63)
                                    .macs(DEST_A_MAC, SEC0_MAC)
                                    .build(),
                            ),
                        ),
                ],
                &[(SNAT_NEW, 2), (FORWARDED, 2)],
            ),
            case(
                "unknown rule, and a rule id served for IPv4 only, dropped",
                no_setup,
                vec![
                    from_tunnel(u.peer, 77, &syn_a).dropped(),
                    from_tunnel(u.peer, RULE_V4_ONLY, &syn_a).dropped(),
                ],
                &[(DROP_UNKNOWN_RULE, 2)],
            ),
            case(
                "a pod of the sender that no policy selects, claiming a served rule, dropped",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &syn_a.clone().src(REMOTE_UNSELECTED)).dropped(),
                    from_tunnel(u.peer, RULE_SHARED, &syn_a.clone().src(REMOTE_UNSELECTED))
                        .dropped(),
                ],
                &[(DROP_NOT_ADMITTED, 2)],
            ),
            case(
                "a pod admitted for rule A only: rule B dropped, rule A translated",
                |dp, _| dp.admit(REMOTE_UNSELECTED, RULE_A),
                vec![
                    from_tunnel(
                        u.peer,
                        RULE_B,
                        &syn_a.clone().src(REMOTE_UNSELECTED).dst(DEST_B),
                    )
                    .dropped(),
                    from_tunnel(u.peer, RULE_A, &syn_a.clone().src(REMOTE_UNSELECTED))
                        .redirected(&out(&syn_a.clone().src(REMOTE_UNSELECTED), 40_000)),
                ],
                &[(DROP_NOT_ADMITTED, 1), (SNAT_NEW, 1), (FORWARDED, 1)],
            ),
            case(
                "new flow: NAT66 keeps the free pod port, hop limit decremented; then conntrack hit",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &syn_a).redirected(&out(&syn_a, 40_000)),
                    from_tunnel(u.peer, RULE_A, &ack_a).redirected(&out(&ack_a, 40_000)),
                ],
                &[(SNAT_NEW, 1), (SNAT_HIT, 1), (FORWARDED, 2)],
            ),
            case(
                "rule B leaves by sec1 with its own egress IP",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_B, &syn_a.clone().dst(DEST_B)).redirected(&snatted(
                        &syn_a.clone().dst(DEST_B),
                        EGRESS_B,
                        40_000,
                        SEC1_MAC,
                        DEST_B_MAC,
                    )),
                ],
                &[(SNAT_NEW, 1), (FORWARDED, 1)],
            ),
            case(
                "destination behind a router: next hop's MAC",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &syn_a.clone().dst(DEST_FAR)).redirected(&snatted(
                        &syn_a.clone().dst(DEST_FAR),
                        EGRESS_A,
                        40_000,
                        SEC0_MAC,
                        ROUTER_A_MAC,
                    )),
                ],
                &[(SNAT_NEW, 1), (FORWARDED, 1)],
            ),
            case(
                "no neighbour yet: redirect_neigh (NAT66ed, MACs left to the kernel)",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &syn_a.clone().dst(DEST_A_NO_NEIGH)).redirected(
                        &snatted(
                            &syn_a.clone().dst(DEST_A_NO_NEIGH),
                            EGRESS_A,
                            40_000,
                            SEC0_MAC,
                            DEST_A_MAC,
                        )
                        .macs(HOST_MAC, POD_MAC),
                    ),
                ],
                &[(SNAT_NEW, 1), (FORWARDED, 1)],
            ),
            case(
                "destination not reachable through the rule's interface: dropped",
                no_setup,
                vec![from_tunnel(u.peer, RULE_A, &syn_a.clone().dst(DEST_B)).dropped()],
                &[(SNAT_NEW, 1), (DROP_FIB, 1)],
            ),
            case(
                "two pods, same source port, same destination: distinct translations",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &syn_a).redirected(&out(&syn_a, 40_000)),
                    from_tunnel(u.peer, RULE_A, &syn_a.clone().src(REMOTE_POD2))
                        .redirected_if(snatted_in_range(&syn_a.clone().src(REMOTE_POD2), 40_000)),
                ],
                &[(SNAT_NEW, 2), (FORWARDED, 2)],
            ),
            case(
                "ICMPv6 echo: identifier kept when free, translated when taken",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &echo1).redirected(&out(&echo1, 7)),
                    from_tunnel(u.peer, RULE_A, &echo2).redirected_if(snatted_in_range(&echo2, 7)),
                ],
                &[(SNAT_NEW, 2), (FORWARDED, 2)],
            ),
            case(
                "UDP: NAT66, port translated on collision",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &udp_a).redirected(&out(&udp_a, 5000)),
                    from_tunnel(u.peer, RULE_A, &udp_a.clone().src(REMOTE_POD2))
                        .redirected_if(snatted_in_range(&udp_a.clone().src(REMOTE_POD2), 5000)),
                ],
                &[(SNAT_NEW, 2), (FORWARDED, 2)],
            ),
            case(
                "zero UDP checksum dropped as malformed",
                no_setup,
                vec![
                    from_tunnel(
                        u.peer,
                        RULE_A,
                        &udp_a.clone().l4(L4::udp_no_checksum(5000, 53, b"q")),
                    )
                    .dropped(),
                ],
                &[(DROP_MALFORMED, 1)],
            ),
            case(
                "extension headers walked: NAT66 checksums correct",
                no_setup,
                vec![from_tunnel(u.peer, RULE_A, &with_ext).redirected(&out(&with_ext, 40_000))],
                &[(SNAT_NEW, 1), (FORWARDED, 1)],
            ),
            case(
                "1380-byte UDP payload: NAT66 checksum over the whole payload",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &big_udp(REMOTE_POD, 5000, DEST_A, 53))
                        .redirected(&out(&big_udp(REMOTE_POD, 5000, DEST_A, 53), 5000)),
                ],
                &[(SNAT_NEW, 1), (FORWARDED, 1)],
            ),
            case(
                "hop limit 1 dropped",
                no_setup,
                vec![from_tunnel(u.peer, RULE_A, &syn_a.clone().hop_limit(1)).dropped()],
                &[(DROP_TTL_EXCEEDED, 1)],
            ),
            case(
                "fragment, too many extension headers, GRE: dropped by reason",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &syn_a.clone().fragment(0, true)).dropped(),
                    from_tunnel(u.peer, RULE_A, &too_many_ext(&syn_a)).dropped(),
                    from_tunnel(
                        u.peer,
                        RULE_A,
                        &syn_a.clone().l4(L4::raw(PROTO_GRE, &[0; 8])),
                    )
                    .dropped(),
                ],
                &[
                    (DROP_FRAGMENT, 1),
                    (DROP_IPV6_EXT_HDR, 1),
                    (DROP_UNSUPPORTED_PROTO, 1),
                ],
            ),
            case(
                "port exhaustion (range of two ports) counted",
                move |dp, net| {
                    dp.config(Config {
                        port_min: 30_000,
                        port_max: 30_001,
                        ..config(net)
                    });
                },
                vec![
                    from_tunnel(
                        u.peer,
                        RULE_A,
                        &syn_a.clone().l4(L4::tcp(30_000, 443, 0x02)),
                    )
                    .redirected(&out(&syn_a.clone().l4(L4::tcp(30_000, 443, 0x02)), 30_000)),
                    from_tunnel(
                        u.peer,
                        RULE_A,
                        &syn_a
                            .clone()
                            .src(REMOTE_POD2)
                            .l4(L4::tcp(30_001, 443, 0x02)),
                    )
                    .redirected(&out(
                        &syn_a
                            .clone()
                            .src(REMOTE_POD2)
                            .l4(L4::tcp(30_001, 443, 0x02)),
                        30_001,
                    )),
                    from_tunnel(
                        u.peer,
                        RULE_A,
                        &syn_a
                            .clone()
                            .src(REMOTE_POD3)
                            .l4(L4::tcp(30_000, 443, 0x02)),
                    )
                    .dropped(),
                ],
                &[(SNAT_NEW, 2), (FORWARDED, 2), (DROP_PORT_EXHAUSTED, 1)],
            ),
            case(
                "agent not ready: tunneled packet dropped",
                move |dp, net| {
                    dp.config(Config {
                        flags: 0,
                        ..config(net)
                    })
                },
                vec![from_tunnel(u.peer, RULE_A, &syn_a).dropped()],
                &[(DROP_NOT_READY, 1)],
            ),
            case(
                "RETURN_VNI for a local pod: delivered to its device",
                no_setup,
                vec![
                    from_tunnel(u.peer, RETURN_VNI, &reply_in)
                        .redirected(&reply_in.clone().macs(POD_MAC, POD0_MAC)),
                ],
                &[(RETURN_DELIVERED, 1)],
            ),
            case(
                "RETURN_VNI for a pod of another node, or from an unknown sender, dropped",
                no_setup,
                vec![
                    from_tunnel(u.peer, RETURN_VNI, &reply_in.clone().dst(REMOTE_POD)).dropped(),
                    from_tunnel(u.stranger, RETURN_VNI, &reply_in).dropped(),
                ],
                &[(DROP_NOT_LOCAL_POD, 1), (DROP_UNKNOWN_SENDER, 1)],
            ),
        ],
    );
}

/// `from_underlay` with IPv6 pods over the IPv4 underlay: the inner IPv6 packet,
/// decapsulated, gets the tunnel device's verdict, output frame and counters. Over an
/// IPv6 underlay it takes nothing (the device decapsulates).
#[test]
fn from_underlay_decapsulates_ipv6_pods_over_the_ipv4_underlay() {
    use egress_common::config::DEFAULT_TUNNEL_PORT as PORT;
    in_netns(|| {
        let net = topology(UL4);
        let ul0 = ifindex("ul0");
        let (IpAddr::V4(node), IpAddr::V4(peer)) = (UL4.node, UL4.peer) else {
            unreachable!("UL4 is IPv4")
        };
        for (what, vni, p) in [
            (
                "a remote pod's SYN, rule A",
                RULE_A,
                syn(REMOTE_POD, 40_000, DEST_A, 443, 1400),
            ),
            (
                "a reply for a local pod",
                RETURN_VNI,
                tcp(DEST_A, 443, LOCAL_POD, 40_000, TCP_ACK),
            ),
        ] {
            let inner = p.build();
            let mut device = Datapath::load();
            base(&mut device, &net);
            let want = device.run(FROM_TUNNEL, &inner, net.tun0, Some((UL4.peer, vni)));
            let mut dp = Datapath::load();
            base(&mut dp, &net);
            let got = dp.run(
                FROM_UNDERLAY,
                &vxlan(peer, node, PORT, vni, &inner),
                ul0,
                None,
            );
            assert_ne!(
                want.verdict, TC_ACT_SHOT,
                "{what}: the device's path delivers it"
            );
            assert_eq!(got.verdict, want.verdict, "{what}: verdict");
            assert_eq!(got.frame, want.frame, "{what}: output frame");
            assert_eq!(dp.counters(), device.counters(), "{what}: counters");
        }
    });
    in_netns(|| {
        let net = topology(UL6);
        let (IpAddr::V6(node), IpAddr::V6(peer)) = (UL6.node, UL6.peer) else {
            unreachable!("UL6 is IPv6")
        };
        let mut payload = vec![0x08, 0, 0, 0];
        payload.extend_from_slice(&(RULE_A << 8).to_be_bytes());
        payload.extend_from_slice(&syn(REMOTE_POD, 40_000, DEST_A, 443, 1400).build());
        let f = Ipv6Packet::new(peer, node, L4::udp(54_321, PORT, &payload)).build();
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        let o = dp.run(FROM_UNDERLAY, &f, ifindex("ul0"), None);
        assert_eq!(
            o.verdict, TC_ACT_UNSPEC,
            "over IPv6 the device decapsulates"
        );
        assert_eq!(o.frame, f, "untouched");
    });
}

/// The entries a first packet REMOTE_POD:40000 -> DEST_A:443 (TCP, rule A) leaves behind.
fn from_tunnel_conntrack_entries(u: UnderlayNet) {
    in_netns(move || {
        let net = topology(u);
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        let syn_a = tcp(REMOTE_POD, 40_000, DEST_A, 443, 0x02);
        let o = dp.run(
            FROM_TUNNEL,
            &syn_a.build(),
            net.tun0,
            Some((u.peer, RULE_A)),
        );
        assert_eq!(o.verdict, TC_ACT_REDIRECT);
        let mut ct = ct6(&mut dp);
        ct.sort_by_key(|(k, _)| k.dir);
        let strip = |mut e: CtEntryV6| {
            assert_ne!(e.last_seen_ns, 0);
            e.last_seen_ns = 0;
            if e.next_hop.ifindex != 0 {
                assert_ne!(e.next_hop.filled, 0);
                e.next_hop.filled = 0;
            }
            e
        };
        let got: Vec<_> = ct.into_iter().map(|(k, e)| (k, strip(e))).collect();
        // The original entry caches the next hop the first packet's FIB lookup found
        // (DEST_A's neighbour on sec0); the reply entry, which tunnels, caches nothing.
        let learned = NextHop {
            dmac: DEST_A_MAC,
            smac: SEC0_MAC,
            mtu: 1500,
            ifindex: net.sec0,
            ..NextHop::default()
        };
        let common = CtEntryV6 {
            xlate_addr: EGRESS_A.octets(),
            xlate_port_be: 40_000u16.to_be(),
            state: state::NEW,
            _pad0: 0,
            pod_node: underlay::from_ip(u.peer),
            ifindex: net.sec0,
            rule_id: RULE_A,
            _pad1: 0,
            last_seen_ns: 0,
            next_hop: Default::default(),
        };
        assert_eq!(
            got,
            vec![
                (
                    CtKeyV6 {
                        src: REMOTE_POD.octets(),
                        dst: DEST_A.octets(),
                        src_port_be: 40_000u16.to_be(),
                        dst_port_be: 443u16.to_be(),
                        proto: 6,
                        dir: dir::ORIGINAL,
                        _pad: [0; 2],
                    },
                    CtEntryV6 {
                        next_hop: learned,
                        ..common
                    }
                ),
                (
                    CtKeyV6 {
                        src: DEST_A.octets(),
                        dst: EGRESS_A.octets(),
                        src_port_be: 443u16.to_be(),
                        dst_port_be: 40_000u16.to_be(),
                        proto: 6,
                        dir: dir::REPLY,
                        _pad: [0; 2],
                    },
                    CtEntryV6 {
                        xlate_addr: REMOTE_POD.octets(),
                        ..common
                    }
                ),
            ]
        );
    });
}

/// An established IPv6 flow's packets take the next hop cached in its conntrack entry,
/// not a FIB lookup per packet, until the agent bumps `NH_GEN` or the cache is older
/// than a second (as for IPv4). The flow goes through router A (fd00:172:16::/48 via
/// fd00:100::1 on sec0); the router's MAC changes under it.
fn an_established_flow_uses_its_cached_next_hop(u: UnderlayNet) {
    in_netns(move || {
        const NEW_ROUTER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0xee];
        const POISON: [u8; 6] = [0x02, 0, 0, 0, 0xba, 0xd0];
        let net = topology(u);
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        dp.nh_gen(7);
        let send = |dp: &mut Datapath, flags: u8| {
            let p = tcp(REMOTE_POD, 40_000, DEST_FAR, 443, flags);
            let o = dp.run(FROM_TUNNEL, &p.build(), net.tun0, Some((u.peer, RULE_A)));
            assert_eq!(o.verdict, TC_ACT_REDIRECT);
            // The frame's destination and source MAC.
            (
                <[u8; 6]>::try_from(&o.frame[0..6]).unwrap(),
                <[u8; 6]>::try_from(&o.frame[6..12]).unwrap(),
            )
        };
        let original = |dp: &mut Datapath| {
            ct6(dp)
                .into_iter()
                .find(|(k, _)| k.dir == dir::ORIGINAL)
                .expect("the flow's original entry")
        };
        // The first packet looks the route up and leaves the answer in the entry.
        assert_eq!(send(&mut dp, 0x02), (ROUTER_A_MAC, SEC0_MAC));
        let (key, e) = original(&mut dp);
        assert_eq!(
            (e.next_hop.dmac, e.next_hop.smac, e.next_hop.ifindex),
            (ROUTER_A_MAC, SEC0_MAC, net.sec0)
        );
        assert_eq!((e.next_hop.mtu, e.next_hop.generation), (1500, 7));
        // The router's MAC changes, and nobody says so: the flow keeps the cached one
        // (proof that no FIB lookup ran).
        ip(&format!(
            "-6 neigh replace {ROUTER_A} lladdr {} dev sec0 nud permanent",
            mac(NEW_ROUTER_MAC)
        ));
        assert_eq!(send(&mut dp, 0x10), (ROUTER_A_MAC, SEC0_MAC));
        // The agent bumps the generation: the next packet looks again, and caches that.
        dp.nh_gen(8);
        assert_eq!(send(&mut dp, 0x10), (NEW_ROUTER_MAC, SEC0_MAC));
        let (_, e) = original(&mut dp);
        assert_eq!(
            (e.next_hop.dmac, e.next_hop.generation),
            (NEW_ROUTER_MAC, 8)
        );
        assert_eq!(send(&mut dp, 0x10), (NEW_ROUTER_MAC, SEC0_MAC));
        // A cache of another generation, one older than a second, or one stamped ahead
        // of the clock by more than a jiffy (garbage), is never used.
        let insert = |dp: &mut Datapath, e: CtEntryV6| {
            let mut m: HashMap<&mut MapData, CtKeyV6, CtEntryV6> =
                HashMap::try_from(dp.map(maps::CT_V6)).unwrap();
            m.insert(key, e, 0).unwrap();
        };
        let now = ktime_ns();
        for (generation, filled_ns, case) in [
            (7, now, "older generation"),
            (8, now - 2_000_000_000, "filled 2 s ago"),
            (8, now + 2_000_000_000, "stamped 2 s ahead"),
        ] {
            let mut stale = e;
            stale.next_hop.dmac = POISON;
            stale.next_hop.generation = generation;
            stale.next_hop.filled = conntrack::stamp(filled_ns);
            insert(&mut dp, stale);
            assert_eq!(send(&mut dp, 0x10), (NEW_ROUTER_MAC, SEC0_MAC), "{case}");
        }
        // And a valid one is: the poisoned MAC goes out (the cache, not the FIB, decided).
        let mut cached = e;
        cached.next_hop.dmac = POISON;
        cached.next_hop.filled = conntrack::stamp(ktime_ns());
        insert(&mut dp, cached);
        assert_eq!(send(&mut dp, 0x10), (POISON, SEC0_MAC));
    });
}

// ---- from_secondary ----

fn from_secondary_table(u: UnderlayNet) {
    let fwd = tcp(REMOTE_POD, 40_000, DEST_A, 443, 0x02);
    let synack_l4 = |mss: u16| {
        let [hi, lo] = mss.to_be_bytes();
        L4::Tcp {
            sport: 443,
            dport: 40_000,
            flags: 0x12,
            seq: 9,
            ack: 0x0102_0305,
            options: vec![2, 4, hi, lo],
            payload: Vec::new(),
        }
    };
    let synack = Ipv6Packet::new(DEST_A, EGRESS_A, synack_l4(1440));
    let synack_clamped = synack.clone().l4(synack_l4(TUNNEL_MTU - 60));
    let reply = tcp(DEST_A, 443, EGRESS_A, 40_000, TCP_ACK);
    let local_fwd = tcp(LOCAL_POD, 40_000, DEST_A, 443, 0x02);
    let echo_out = echo(REMOTE_POD, DEST_A, 7);
    let echo_back = echo_reply(DEST_A, EGRESS_A, 7);
    let udp_out = udp(REMOTE_POD, 5000, DEST_A, 53);
    let udp_back = udp(DEST_A, 53, EGRESS_A, 5000);
    let to_second = |prev: &[u8]| tcp(DEST_A, 443, EGRESS_A, sport_of(prev), TCP_ACK).build();
    let ns_for = |target: Ipv6Addr| {
        Ipv6Packet::new(ROUTER_A, target, ndp(ICMPV6_NEIGHBOUR_SOLICIT, target))
            .hop_limit(255)
            .macs(SEC0_MAC, ROUTER_A_MAC)
    };

    run_table(
        u,
        vec![
            case(
                "reply with an entry: reverse NAT66, tunneled back to the pod's node",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &fwd).forwarded_any(),
                    from_secondary(&reply).redirected(&unnatted(&reply, REMOTE_POD, 40_000)),
                ],
                &[
                    (SNAT_NEW, 1),
                    (FORWARDED, 1),
                    (REVERSE_NAT, 1),
                    (RETURN_TUNNELED, 1),
                ],
            ),
            case(
                "SYN-ACK into the tunnel: MSS clamped to tunnel_mtu - 60",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &fwd).forwarded_any(),
                    from_secondary(&synack).redirected(&unnatted(
                        &synack_clamped,
                        REMOTE_POD,
                        40_000,
                    )),
                ],
                &[
                    (SNAT_NEW, 1),
                    (FORWARDED, 1),
                    (REVERSE_NAT, 1),
                    (MSS_CLAMPED, 1),
                    (RETURN_TUNNELED, 1),
                ],
            ),
            case(
                "reply to the second of two colliding flows restores its pod and port",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &fwd).forwarded_any(),
                    from_tunnel(u.peer, RULE_A, &fwd.clone().src(REMOTE_POD2)).forwarded_any(),
                    from_secondary(&reply)
                        .derive(to_second)
                        .redirected(&unnatted(&reply, REMOTE_POD2, 40_000)),
                ],
                &[
                    (SNAT_NEW, 2),
                    (FORWARDED, 2),
                    (REVERSE_NAT, 1),
                    (RETURN_TUNNELED, 1),
                ],
            ),
            case(
                "reply for a pod on this gateway: delivered to its device",
                move |dp, _| local_pod_to_a(dp, u.node),
                vec![
                    from_pod(&local_fwd).forwarded_any(),
                    from_secondary(&reply)
                        .redirected(&unnatted(&reply, LOCAL_POD, 40_000).macs(POD_MAC, POD0_MAC)),
                ],
                &[
                    (LOCAL_GATEWAY, 1),
                    (SNAT_NEW, 1),
                    (FORWARDED, 2),
                    (REVERSE_NAT, 1),
                ],
            ),
            case(
                "ICMPv6 echo reply: identifier restored, checksum over the pseudo-header",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &echo_out).forwarded_any(),
                    from_secondary(&echo_back).redirected(&unnatted(&echo_back, REMOTE_POD, 7)),
                ],
                &[
                    (SNAT_NEW, 1),
                    (FORWARDED, 1),
                    (REVERSE_NAT, 1),
                    (RETURN_TUNNELED, 1),
                ],
            ),
            case(
                "UDP reply: reverse NAT66; with a zero checksum: dropped as malformed",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &udp_out).forwarded_any(),
                    from_secondary(&udp_back).redirected(&unnatted(&udp_back, REMOTE_POD, 5000)),
                    from_secondary(&udp_back.clone().l4(L4::udp_no_checksum(53, 5000, b"a")))
                        .dropped(),
                ],
                &[
                    (SNAT_NEW, 1),
                    (FORWARDED, 1),
                    (REVERSE_NAT, 1),
                    (RETURN_TUNNELED, 1),
                    (DROP_MALFORMED, 1),
                ],
            ),
            case(
                "1380-byte UDP reply: reverse NAT66 checksum over the whole payload",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &big_udp(REMOTE_POD, 5000, DEST_A, 53))
                        .forwarded_any(),
                    from_secondary(&big_udp(DEST_A, 53, EGRESS_A, 5000)).redirected(&unnatted(
                        &big_udp(DEST_A, 53, EGRESS_A, 5000),
                        REMOTE_POD,
                        5000,
                    )),
                ],
                &[
                    (SNAT_NEW, 1),
                    (FORWARDED, 1),
                    (REVERSE_NAT, 1),
                    (RETURN_TUNNELED, 1),
                ],
            ),
            case(
                "dedicated egress IP, no entry: TCP, UDP, echo request dropped",
                no_setup,
                vec![
                    from_secondary(&reply).dropped(),
                    from_secondary(&udp_back).dropped(),
                    from_secondary(&echo(DEST_A, EGRESS_A, 9)).dropped(),
                ],
                &[(DROP_NO_CONNTRACK, 3)],
            ),
            case(
                "dedicated egress IP, GRE or a fragment: dropped by reason",
                no_setup,
                vec![
                    from_secondary(&reply.clone().l4(L4::raw(PROTO_GRE, &[0; 8]))).dropped(),
                    from_secondary(&reply.clone().fragment(0, true)).dropped(),
                ],
                &[(DROP_UNSUPPORTED_PROTO, 1), (DROP_FRAGMENT, 1)],
            ),
            case(
                "neighbour discovery for an egress IP passes to the kernel",
                no_setup,
                vec![
                    // Unicast solicitation (reachability) straight to the dedicated egress IP.
                    from_secondary(&ns_for(EGRESS_A)).passes(),
                    from_secondary(&ns_for(SHARED_A)).passes(),
                    // Multicast solicitation: not an egress IP at all.
                    from_secondary(&ns_for(EGRESS_A).dst(solicited_node(EGRESS_A))).passes(),
                    from_secondary(
                        &Ipv6Packet::new(DEST_A, EGRESS_A, ndp(ICMPV6_NEIGHBOUR_ADVERT, DEST_A))
                            .hop_limit(255),
                    )
                    .passes(),
                ],
                &[],
            ),
            case(
                "reply with hop limit 1 dropped",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &fwd).forwarded_any(),
                    from_secondary(&reply.clone().hop_limit(1)).dropped(),
                ],
                &[(SNAT_NEW, 1), (FORWARDED, 1), (DROP_TTL_EXCEEDED, 1)],
            ),
            case(
                "agent not ready: dedicated egress IP dropped, shared address passes",
                move |dp, net| {
                    dp.config(Config {
                        flags: 0,
                        ..config(net)
                    })
                },
                vec![
                    from_secondary(&reply).dropped(),
                    from_secondary(&reply.clone().dst(SHARED_A)).passes(),
                ],
                &[(DROP_NOT_READY, 1)],
            ),
            case(
                "shared address (the interface's own), no entry: passes to the host",
                no_setup,
                vec![from_secondary(&reply.clone().dst(SHARED_A)).passes()],
                &[],
            ),
            case(
                "unrelated traffic passes untouched",
                no_setup,
                vec![
                    from_secondary(&reply.clone().dst(v6(0xfd00, 0x100, 0, 0x99))).passes(),
                    from_secondary(&reply).raw(arp_frame()).passes(),
                ],
                &[],
            ),
        ],
    );
}

// ---- interface rules: a TCP flow from another gateway ----

const TCP_PSH: u8 = 0x08;

/// A segment of an established TCP flow: timestamps and 37 bytes of data.
fn segment(sport: u16, dport: u16, flags: u8) -> L4 {
    L4::Tcp {
        sport,
        dport,
        flags,
        seq: 0x1111_2222,
        ack: 0x3333_4444,
        // NOP, NOP, timestamps.
        options: vec![1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2],
        payload: b"GET /index.html HTTP/1.1\r\nHost: a\r\n\r\n".to_vec(),
    }
}

/// The RST that answers the segment `p` (MACs as in `p`): from its destination to its
/// source, with seq = its ack number (RST+ACK, seq 0 and ack = its seq + length if it has
/// no ACK), window 0, no options or data; the IPv6 header as it was (extension headers,
/// hop limit, flow label) but for the addresses and the length. Checksum computed here.
fn rst_for(p: &Ipv6Packet) -> Vec<u8> {
    let L4::Tcp {
        sport,
        dport,
        flags,
        seq,
        ack,
        payload,
        ..
    } = &p.l4
    else {
        panic!("not TCP: {p:?}");
    };
    let (seq, ack, flags) = if flags & TCP_ACK != 0 {
        (*ack, 0, TCP_RST)
    } else {
        let len = payload.len() as u32 + u32::from(flags & TCP_FIN != 0);
        (0, seq + len, TCP_RST | TCP_ACK)
    };
    let mut f = p
        .clone()
        .src(p.dst)
        .dst(p.src)
        .l4(L4::Tcp {
            sport: *dport,
            dport: *sport,
            flags,
            seq,
            ack,
            options: Vec::new(),
            payload: Vec::new(),
        })
        .build();
    let tcp = f.len() - 20;
    // Window 0 (the builder's is fixed), then the checksum again.
    f[tcp + 14..tcp + 18].fill(0);
    let c = checksum(&[&pseudo_header6(p.dst, p.src, PROTO_TCP, 20), &f[tcp..]]);
    f[tcp + 16..tcp + 18].copy_from_slice(&c.to_be_bytes());
    f
}

fn rst(step: Step, p: &Ipv6Packet) -> Step {
    step.expect(TC_ACT_REDIRECT, Out::Frame(rst_for(p)))
}

/// The IPv6 side of `datapath_v4`'s `interface_rule_table`: a mid-stream TCP segment of an
/// `interface:` rule without a flow here is answered with a RST to the pod; dedicated
/// egress IPs take such flows over, and SYNs, RSTs and UDP are translated as before.
fn interface_rule_table(u: UnderlayNet) {
    let seg = Ipv6Packet::new(REMOTE_POD, DEST_A, segment(40_000, 443, TCP_ACK | TCP_PSH));
    let seg_ext = seg
        .clone()
        .pad_options(NEXTHDR_HOP)
        .pad_options(NEXTHDR_DEST);
    let fin = seg.clone().l4(segment(40_000, 443, TCP_FIN));
    let local = seg.clone().src(LOCAL_POD);
    let syn_a = tcp(REMOTE_POD, 40_000, DEST_A, 443, TCP_SYN);
    let rst_a = tcp(REMOTE_POD, 40_000, DEST_A, 443, TCP_RST | TCP_ACK);
    let udp_a = udp(REMOTE_POD, 5000, DEST_A, 53);
    let shared = |p: &Ipv6Packet, port| snatted(p, SHARED_A, port, SEC0_MAC, DEST_A_MAC);

    run_table(
        u,
        vec![
            case(
                "mid-stream segment, no flow here: RST back through the tunnel, and no entry made",
                no_setup,
                vec![
                    rst(from_tunnel(u.peer, RULE_SHARED, &seg), &seg),
                    rst(from_tunnel(u.peer, RULE_SHARED, &seg), &seg),
                ],
                &[(RESET_MIDSTREAM, 2)],
            ),
            case(
                "behind extension headers: headers kept, TCP options and data cut",
                no_setup,
                vec![rst(from_tunnel(u.peer, RULE_SHARED, &seg_ext), &seg_ext)],
                &[(RESET_MIDSTREAM, 1)],
            ),
            case(
                "segment without ACK (a bare FIN): RST+ACK acknowledging its data and FIN",
                no_setup,
                vec![rst(from_tunnel(u.peer, RULE_SHARED, &fin), &fin)],
                &[(RESET_MIDSTREAM, 1)],
            ),
            case(
                "pod on this gateway: RST delivered to its device",
                move |dp, _| {
                    selected6(dp, LOCAL_POD);
                    policy6(dp, LOCAL_POD, NET_A, 64, forward(u.node, RULE_SHARED));
                },
                vec![rst(
                    from_pod(&local),
                    &local.clone().macs(POD_MAC, POD0_MAC),
                )],
                &[(LOCAL_GATEWAY, 1), (RESET_MIDSTREAM, 1)],
            ),
            case(
                "SYN: translated to the interface's address as before; the flow's segments too",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_SHARED, &syn_a).redirected(&shared(&syn_a, 40_000)),
                    from_tunnel(u.peer, RULE_SHARED, &seg).redirected(&shared(&seg, 40_000)),
                ],
                &[(SNAT_NEW, 1), (SNAT_HIT, 1), (FORWARDED, 2)],
            ),
            case(
                "RST without a flow: translated and sent on, never answered",
                no_setup,
                vec![from_tunnel(u.peer, RULE_SHARED, &rst_a).redirected(&shared(&rst_a, 40_000))],
                &[(SNAT_NEW, 1), (FORWARDED, 1)],
            ),
            case(
                "UDP without a flow: translated as before",
                no_setup,
                vec![from_tunnel(u.peer, RULE_SHARED, &udp_a).redirected(&shared(&udp_a, 5000))],
                &[(SNAT_NEW, 1), (FORWARDED, 1)],
            ),
            case(
                "dedicated egress IP: the segment takes the flow over (new entry, same port)",
                no_setup,
                vec![
                    from_tunnel(u.peer, RULE_A, &seg)
                        .redirected(&snatted(&seg, EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC)),
                ],
                &[(SNAT_NEW, 1), (FORWARDED, 1)],
            ),
        ],
    );
}

/// The RST leaves no conntrack entry behind, and verifies on its own: the TCP segment
/// with its pseudo-header sums to zero.
fn interface_rule_reset_makes_no_entry(u: UnderlayNet) {
    in_netns(move || {
        let net = topology(u);
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        let seg = Ipv6Packet::new(REMOTE_POD, DEST_A, segment(40_000, 443, TCP_ACK | TCP_PSH));
        let o = dp.run(
            FROM_TUNNEL,
            &seg.build(),
            net.tun0,
            Some((u.peer, RULE_SHARED)),
        );
        assert_eq!(o.verdict, TC_ACT_REDIRECT);
        assert_eq!(ct6(&mut dp), Vec::new(), "conntrack entries");
        let f = &o.frame;
        assert_eq!(f.len(), 14 + 40 + 20, "frame {f:02x?}");
        assert_eq!(u16::from_be_bytes([f[18], f[19]]), 20, "payload length");
        assert_eq!(
            checksum(&[&pseudo_header6(DEST_A, REMOTE_POD, PROTO_TCP, 20), &f[54..]]),
            0,
            "TCP checksum"
        );
        assert_eq!(
            (&f[22..38], &f[38..54]),
            (&DEST_A.octets()[..], &REMOTE_POD.octets()[..])
        );
        assert_eq!(
            u32::from_be_bytes(f[58..62].try_into().unwrap()),
            0x3333_4444
        );
        assert_eq!(f[67], TCP_RST);
        assert_eq!(dp.counters().get(&RESET_MIDSTREAM), Some(&1));
    });
}

// ---- every table over both underlay families ----

// ---- ICMPv6 errors about translated flows ----

/// The 4 bytes after the checksum of "packet too big": MTU 1300.
const MTU_1300: [u8; 4] = [0, 0, 0x05, 0x14];

/// An ICMPv6 error from the router on network A to `to`, quoting `q`.
fn error_to(to: Ipv6Addr, kind: u8, code: u8, rest: [u8; 4], q: &[u8]) -> Ipv6Packet {
    Ipv6Packet::new(ROUTER_A, to, icmp6_error(kind, code, rest, q)).macs(SEC0_MAC, ROUTER_A_MAC)
}

/// The error `e` (quoting `q`, a packet the gateway sent) translated back to `pod`: the
/// destination, the hop limit, the quoted source and source port (or echo identifier,
/// `port_at` into the quoted transport header); the quoted transport checksum stays
/// that of the translated packet; the ICMPv6 checksum is computed from scratch.
fn error_back(e: &Ipv6Packet, q: &[u8], pod: Ipv6Addr, port: u16, port_at: usize) -> Ipv6Packet {
    let L4::Raw { payload, .. } = &e.l4 else {
        panic!("not an ICMPv6 error: {e:?}")
    };
    let mut q = q.to_vec();
    q[8..24].copy_from_slice(&pod.octets());
    q[40 + port_at..42 + port_at].copy_from_slice(&port.to_be_bytes());
    let rest = [payload[4], payload[5], payload[6], payload[7]];
    e.clone()
        .dst(pod)
        .hop_limit(e.hop_limit - 1)
        .l4(icmp6_error(payload[0], payload[1], rest, &q))
}

/// Checks `f` is `want` byte for byte and, on its own, that its ICMPv6 checksum verifies
/// over the pseudo-header.
fn error_with_valid_checksum(want: &Ipv6Packet) -> impl Fn(&[u8]) -> Result<(), String> + use<> {
    let (src, dst) = (want.src, want.dst);
    let want = want.build();
    move |f: &[u8]| {
        frame_diff(f, &want)?;
        let icmp = &f[14 + 40..];
        if checksum(&[&pseudo_header6(src, dst, 58, icmp.len()), icmp]) != 0 {
            return Err("ICMPv6 checksum does not verify".into());
        }
        Ok(())
    }
}

fn icmp_error_table(u: UnderlayNet) {
    let tcp_fwd = tcp(REMOTE_POD, 40_000, DEST_A, 443, TCP_ACK);
    let tcp_out = snatted(&tcp_fwd, EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC);
    let udp_fwd = udp(REMOTE_POD, 5000, DEST_A, 53);
    let udp_out = snatted(&udp_fwd, EGRESS_A, 5000, SEC0_MAC, DEST_A_MAC).build();
    let echo_fwd = echo(REMOTE_POD, DEST_A, 7);
    let echo_out = snatted(&echo_fwd, EGRESS_A, 7, SEC0_MAC, DEST_A_MAC).build();
    let local_fwd = tcp(LOCAL_POD, 40_000, DEST_A, 443, TCP_ACK);
    let local_out = snatted(&local_fwd, EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC).build();

    let too_big = quote(&tcp_out.build(), 48);
    let too_big_err = error_to(EGRESS_A, ICMPV6_PKT_TOO_BIG, 0, MTU_1300, &too_big);
    let port_unreach = quote(&udp_out, udp_out.len() - 14);
    let port_unreach_err = error_to(EGRESS_A, ICMPV6_DEST_UNREACH, 4, [0; 4], &port_unreach);
    let hops = quote(&echo_out, 48);
    let hops_err = error_to(EGRESS_A, ICMPV6_TIME_EXCEEDED, 0, [0; 4], &hops);
    let local = quote(&local_out, 48);
    let local_err = error_to(EGRESS_A, ICMPV6_PKT_TOO_BIG, 0, MTU_1300, &local);
    let truncated_err = error_to(
        EGRESS_A,
        ICMPV6_PKT_TOO_BIG,
        0,
        MTU_1300,
        &quote(&tcp_out.build(), 44),
    );
    let with_ext = quote(&tcp_out.clone().pad_options(NEXTHDR_HOP).build(), 56);
    let with_ext_err = error_to(EGRESS_A, ICMPV6_PKT_TOO_BIG, 0, MTU_1300, &with_ext);
    let reply = tcp(DEST_A, 443, EGRESS_A, 40_000, TCP_ACK);
    let returned = error_back(&too_big_err, &too_big, LOCAL_POD, 40_000, 0);
    let flow = move |p: &Ipv6Packet| from_tunnel(u.peer, RULE_A, p).forwarded_any();
    let xlated = &[
        (SNAT_NEW, 1),
        (FORWARDED, 1),
        (ICMP_ERROR_XLATED, 1),
        (RETURN_TUNNELED, 1),
    ];

    run_table(
        u,
        vec![
            case(
                "packet too big about a TCP flow: tunneled back to the pod's node",
                no_setup,
                vec![
                    flow(&tcp_fwd),
                    from_secondary(&too_big_err).redirected_if(error_with_valid_checksum(
                        &error_back(&too_big_err, &too_big, REMOTE_POD, 40_000, 0),
                    )),
                ],
                xlated,
            ),
            case(
                "port unreachable about a UDP flow",
                no_setup,
                vec![
                    flow(&udp_fwd),
                    from_secondary(&port_unreach_err).redirected_if(error_with_valid_checksum(
                        &error_back(&port_unreach_err, &port_unreach, REMOTE_POD, 5000, 0),
                    )),
                ],
                xlated,
            ),
            case(
                "time exceeded about an echo request: identifier restored",
                no_setup,
                vec![
                    flow(&echo_fwd),
                    from_secondary(&hops_err).redirected_if(error_with_valid_checksum(
                        &error_back(&hops_err, &hops, REMOTE_POD, 7, 4),
                    )),
                ],
                xlated,
            ),
            case(
                "for a pod on this gateway: delivered to its device",
                move |dp, _| local_pod_to_a(dp, u.node),
                vec![
                    from_pod(&local_fwd).forwarded_any(),
                    from_secondary(&local_err).redirected_if(error_with_valid_checksum(
                        &error_back(&local_err, &local, LOCAL_POD, 40_000, 0)
                            .macs(POD_MAC, POD0_MAC),
                    )),
                ],
                &[
                    (LOCAL_GATEWAY, 1),
                    (SNAT_NEW, 1),
                    (FORWARDED, 2),
                    (ICMP_ERROR_XLATED, 1),
                ],
            ),
            case(
                "quoting a flow without an entry: dropped, and no entry made",
                no_setup,
                vec![
                    from_secondary(&too_big_err).dropped(),
                    from_secondary(&reply).dropped(),
                ],
                &[(DROP_ICMP_UNKNOWN_FLOW, 1), (DROP_NO_CONNTRACK, 1)],
            ),
            case(
                "truncated quote (4 bytes of TCP): dropped",
                no_setup,
                vec![flow(&tcp_fwd), from_secondary(&truncated_err).dropped()],
                &[(SNAT_NEW, 1), (FORWARDED, 1), (DROP_ICMP_QUOTE, 1)],
            ),
            case(
                "quote with an extension header (not walked): dropped",
                no_setup,
                vec![flow(&tcp_fwd), from_secondary(&with_ext_err).dropped()],
                &[(SNAT_NEW, 1), (FORWARDED, 1), (DROP_ICMP_QUOTE, 1)],
            ),
            case(
                "on the pod's node: RETURN_VNI error delivered to the pod's device",
                no_setup,
                vec![
                    from_tunnel(u.peer, RETURN_VNI, &returned)
                        .redirected(&returned.clone().macs(POD_MAC, POD0_MAC)),
                ],
                &[(RETURN_DELIVERED, 1)],
            ),
        ],
    );
}

#[test]
fn icmp_error_table_ipv4_underlay() {
    icmp_error_table(UL4);
}

#[test]
fn icmp_error_table_ipv6_underlay() {
    icmp_error_table(UL6);
}

#[test]
fn from_pod_table_ipv4_underlay() {
    from_pod_table(UL4);
}

#[test]
fn from_pod_table_ipv6_underlay() {
    from_pod_table(UL6);
}

#[test]
fn from_tunnel_table_ipv4_underlay() {
    from_tunnel_table(UL4);
}

#[test]
fn from_tunnel_table_ipv6_underlay() {
    from_tunnel_table(UL6);
}

#[test]
fn from_tunnel_conntrack_entries_ipv4_underlay() {
    from_tunnel_conntrack_entries(UL4);
}

#[test]
fn from_tunnel_conntrack_entries_ipv6_underlay() {
    from_tunnel_conntrack_entries(UL6);
}

#[test]
fn an_established_flow_uses_its_cached_next_hop_ipv4_underlay() {
    an_established_flow_uses_its_cached_next_hop(UL4);
}

#[test]
fn an_established_flow_uses_its_cached_next_hop_ipv6_underlay() {
    an_established_flow_uses_its_cached_next_hop(UL6);
}

#[test]
fn from_secondary_table_ipv4_underlay() {
    from_secondary_table(UL4);
}

#[test]
fn from_secondary_table_ipv6_underlay() {
    from_secondary_table(UL6);
}

#[test]
fn interface_rule_table_ipv4_underlay() {
    interface_rule_table(UL4);
}

#[test]
fn interface_rule_table_ipv6_underlay() {
    interface_rule_table(UL6);
}

#[test]
fn interface_rule_reset_makes_no_entry_ipv4_underlay() {
    interface_rule_reset_makes_no_entry(UL4);
}

#[test]
fn interface_rule_reset_makes_no_entry_ipv6_underlay() {
    interface_rule_reset_makes_no_entry(UL6);
}

/// `--unknown-pods drop`: network A (fd00:100::/64) covered with an except hole at
/// fd00:100::80/124, `LOCAL_POD` selected and `UNSELECTED_POD` known.
fn unknown_pods_drop(dp: &mut Datapath, net: &Net) {
    dp.config(Config {
        flags: flags::READY | flags::UNKNOWN_PODS_DROP,
        ..config(net)
    });
    local_pod_to_a(dp, net.ul.peer);
    dp.known_pod(LOCAL_POD);
    dp.known_pod(UNSELECTED_POD);
    dp.covered(NET_A, 64, true);
    dp.covered(v6(0xfd00, 0x100, 0, 0x80), 124, false);
}

#[test]
fn unknown_pods_table() {
    let unknown = v6(0xfd00, 0x244, 1, 0x77);
    let to_a = udp(unknown, 40_000, DEST_A, 53);
    run_table(
        UL4,
        vec![
            case(
                "unknown pod to a covered destination: dropped, counted",
                unknown_pods_drop,
                vec![from_pod(&to_a).dropped()],
                &[(DROP_UNKNOWN_POD, 1)],
            ),
            case(
                "unknown pod to an except hole, or uncovered: passes",
                unknown_pods_drop,
                vec![
                    from_pod(&udp(unknown, 40_000, v6(0xfd00, 0x100, 0, 0x82), 53)).passes(),
                    from_pod(&udp(unknown, 40_000, INTERNET, 53)).passes(),
                ],
                &[],
            ),
            case(
                "unknown pod, neighbour discovery to a covered address and link-scoped \
                 destinations: pass",
                |dp, net| {
                    unknown_pods_drop(dp, net);
                    dp.covered(Ipv6Addr::UNSPECIFIED, 0, true);
                },
                vec![
                    from_pod(&Ipv6Packet::new(
                        unknown,
                        DEST_A,
                        ndp(ICMPV6_NEIGHBOUR_SOLICIT, DEST_A),
                    ))
                    .passes(),
                    from_pod(&Ipv6Packet::new(
                        unknown,
                        solicited_node(DEST_A),
                        ndp(ICMPV6_NEIGHBOUR_SOLICIT, DEST_A),
                    ))
                    .passes(),
                    from_pod(&udp(unknown, 40_000, v6(0xfe80, 0, 0, 1), 53)).passes(),
                ],
                &[],
            ),
            case(
                "known, unselected pod: passes; selected pod: tunneled",
                unknown_pods_drop,
                vec![
                    from_pod(&udp(UNSELECTED_POD, 40_000, DEST_A, 53)).passes(),
                    from_pod(&udp(LOCAL_POD, 40_000, DEST_A, 53)).tunneled(),
                ],
                &[(TUNNELED, 1)],
            ),
            case(
                "--unknown-pods pass: unknown pod passes",
                |dp, net| {
                    unknown_pods_drop(dp, net);
                    dp.config(config(net));
                },
                vec![from_pod(&to_a).passes()],
                &[],
            ),
        ],
    );
}
