//! The IPv4 datapath, program by program, as tables of `BPF_PROG_TEST_RUN` cases against
//! the real object: maps set up, frames in, verdict, frames out (built from scratch, with
//! checksums computed by the test) and counters by reason, summed over CPUs.
//!
//! Every case runs on a thread of its own, in a fresh network namespace holding the
//! devices, routes and neighbours its FIB lookups need, with a freshly loaded object.
//!
//! The namespace (one node that is both a source node and a gateway):
//!
//! ```text
//!   pod0 (02:00:00:00:bb:01) -- veth -- pod 10.244.1.5 (02:00:00:00:aa:01), route /32
//!   tun0  veth: stands in for the collect-metadata VXLAN device
//!   ul0   veth: 192.168.0.10/24, the underlay (this node)
//!   (veths everywhere: the test kernel may lack the dummy driver)
//!   sec0  veth 02:00:00:00:0a:02, 10.100.0.2/24: egress IP 10.100.0.50 (rule 1); its
//!         own address serves an `interface:` rule (rule 3)
//!         neighbours 10.100.0.7 (destination) and 10.100.0.1 (router to 172.16/16)
//!   sec1  veth 02:00:00:00:0b:02, 10.200.0.2/24: egress IP 10.200.0.50 (rule 2)
//!         neighbour 10.200.0.9
//! ```

use std::net::Ipv4Addr;

use egress_agent::ebpf::{FROM_POD, FROM_SECONDARY, FROM_TUNNEL, FROM_UNDERLAY};
use egress_common::{
    config::{Config, flags},
    conntrack::{self, CtEntryV4, CtKeyV4, NextHop, dir, state},
    counters::reason::*,
    maps,
    policy::{AdmittedKeyV4, AdmittedValue, PolicyValueV4, RETURN_VNI, action, egress_ip_flags},
    underlay,
};
use egress_tests::{
    packet::{
        HOST_MAC, ICMP_DEST_UNREACH, ICMP_TIME_EXCEEDED, IP_DF, IP_MF, Ipv4Packet, L4, POD_MAC,
        PROTO_GRE, PROTO_TCP, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, arp_frame, checksum, icmp_error,
        quote, vxlan,
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

/// This node (source node and gateway).
const NODE: Ipv4Addr = a(192, 168, 0, 10);
/// Another known node, and a gateway for some rules.
const PEER: Ipv4Addr = a(192, 168, 0, 20);
/// Not a node.
const STRANGER: Ipv4Addr = a(192, 168, 0, 99);

const LOCAL_POD: Ipv4Addr = a(10, 244, 1, 5);
const UNSELECTED_POD: Ipv4Addr = a(10, 244, 1, 9);
const REMOTE_POD: Ipv4Addr = a(10, 244, 2, 5);
const REMOTE_POD2: Ipv4Addr = a(10, 244, 2, 6);
const REMOTE_POD3: Ipv4Addr = a(10, 244, 2, 7);
/// A pod of the peer that no policy selects: in `POD_OWNER_V4`, not in `ADMITTED_V4`.
const REMOTE_UNSELECTED: Ipv4Addr = a(10, 244, 2, 9);

/// On network A (sec0), directly connected.
const DEST_A: Ipv4Addr = a(10, 100, 0, 7);
/// On network A, no neighbour entry.
const DEST_A_NO_NEIGH: Ipv4Addr = a(10, 100, 0, 8);
/// Behind the router 10.100.0.1 on network A.
const DEST_FAR: Ipv4Addr = a(172, 16, 5, 5);
/// On network B (sec1).
const DEST_B: Ipv4Addr = a(10, 200, 0, 9);
/// Outside every rule.
const INTERNET: Ipv4Addr = a(8, 8, 8, 8);

const EGRESS_A: Ipv4Addr = a(10, 100, 0, 50);
const EGRESS_B: Ipv4Addr = a(10, 200, 0, 50);
/// sec0's own address, used by an `interface:` rule (shared with the host).
const SHARED_A: Ipv4Addr = a(10, 100, 0, 2);

const RULE_A: u32 = 1;
const RULE_B: u32 = 2;
/// An `interface:` rule: out of sec0 with sec0's own address.
const RULE_SHARED: u32 = 3;

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

/// Ifindexes of the devices of [`topology`].
struct Net {
    pod0: u32,
    tun0: u32,
    sec0: u32,
    sec1: u32,
}

fn topology() -> Net {
    for (dev, m, addr) in [
        ("ul0", [0x02, 0, 0, 0, 0xcc, 0x01], Some("192.168.0.10/24")),
        ("tun0", [0x02, 0, 0, 0, 0xdd, 0x01], None),
        ("pod0", POD0_MAC, None),
        ("sec0", SEC0_MAC, Some("10.100.0.2/24")),
        ("sec1", SEC1_MAC, Some("10.200.0.2/24")),
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
    ip(&format!("route add {LOCAL_POD}/32 dev pod0"));
    ip("route add 172.16.0.0/16 via 10.100.0.1 dev sec0");
    for (addr, m, dev) in [
        (LOCAL_POD, POD_MAC, "pod0"),
        (DEST_A, DEST_A_MAC, "sec0"),
        (a(10, 100, 0, 1), ROUTER_A_MAC, "sec0"),
        (DEST_B, DEST_B_MAC, "sec1"),
    ] {
        ip(&format!(
            "neigh replace {addr} lladdr {} dev {dev} nud permanent",
            mac(m)
        ));
    }
    sysctl("net/ipv4/conf/all/forwarding", "1");
    Net {
        pod0: ifindex("pod0"),
        tun0: ifindex("tun0"),
        sec0: ifindex("sec0"),
        sec1: ifindex("sec1"),
    }
}

fn config(net: &Net) -> Config {
    Config {
        node_ip: underlay::from_v4(NODE.octets()),
        tunnel_ifindex: net.tun0,
        port_min: PORT_MIN,
        port_max: PORT_MAX,
        tunnel_mtu: TUNNEL_MTU,
        flags: flags::READY,
        max_flows_per_pod: 0,
    }
}

/// What every case starts from: configuration, nodes, pod owners, the (pod, rule) pairs
/// admitted, the gateway's rules and egress IPs. Policy entries (source side) are per case.
fn base(dp: &mut Datapath, net: &Net) {
    dp.config(config(net));
    dp.node(NODE, 1);
    dp.node(PEER, 2);
    dp.pod_owner(LOCAL_POD, NODE);
    dp.pod_owner(UNSELECTED_POD, NODE);
    for pod in [REMOTE_POD, REMOTE_POD2, REMOTE_POD3, REMOTE_UNSELECTED] {
        dp.pod_owner(pod, PEER);
    }
    // Every pod but the unselected ones may use every rule.
    for pod in [LOCAL_POD, REMOTE_POD, REMOTE_POD2, REMOTE_POD3] {
        for rule in [RULE_A, RULE_B, RULE_SHARED] {
            dp.admit(pod, rule);
        }
    }
    dp.rule(RULE_A, EGRESS_A, net.sec0);
    dp.rule(RULE_B, EGRESS_B, net.sec1);
    dp.rule(RULE_SHARED, SHARED_A, net.sec0);
    dp.egress_ip(EGRESS_A, net.sec0, 0);
    dp.egress_ip(EGRESS_B, net.sec1, 0);
    dp.egress_ip(SHARED_A, net.sec0, egress_ip_flags::SHARED);
}

fn forward(gateway: Ipv4Addr, rule_id: u32) -> PolicyValueV4 {
    PolicyValueV4 {
        gateway: underlay::from_v4(gateway.octets()),
        egress_ip: EGRESS_A.octets(),
        rule_id,
        action: action::FORWARD,
        _pad: 0,
        filter: 0,
    }
}

fn sentinel(act: u8) -> PolicyValueV4 {
    PolicyValueV4 {
        gateway: [0; 16],
        egress_ip: [0; 4],
        rule_id: 0,
        action: act,
        _pad: 0,
        filter: 0,
    }
}

/// `LOCAL_POD` selected, network A (10.100.0.0/24) through rule A at `gateway`.
fn local_pod_to_a(dp: &mut Datapath, gateway: Ipv4Addr) {
    dp.selected(LOCAL_POD);
    dp.policy(LOCAL_POD, a(10, 100, 0, 0), 24, forward(gateway, RULE_A));
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

fn from_pod(p: &Ipv4Packet) -> Step {
    step(FROM_POD, Dev::Pod, None, p)
}

fn from_tunnel(sender: Ipv4Addr, vni: u32, p: &Ipv4Packet) -> Step {
    step(FROM_TUNNEL, Dev::Tunnel, Some((sender.into(), vni)), p)
}

fn from_secondary(p: &Ipv4Packet) -> Step {
    step(FROM_SECONDARY, Dev::Secondary, None, p)
}

/// Run every case (each in its own namespace, in parallel) from the topology and the
/// base maps, and report all failures.
fn run_table(cases: Vec<Case<Net>>) {
    table::run_table("the IPv4 table", cases, || {
        let net = topology();
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        (net, dp)
    });
}

// ---- packets ----

fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Ipv4Packet {
    Ipv4Packet::new(src, dst, L4::tcp(sport, dport, flags))
}

fn syn(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, mss: u16) -> Ipv4Packet {
    Ipv4Packet::new(src, dst, L4::syn(sport, dport, mss))
}

fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Ipv4Packet {
    Ipv4Packet::new(src, dst, L4::udp(sport, dport, b"hello, gateway!"))
}

/// A UDP packet with a 1400-byte payload (what fits a 1450-byte tunnel MTU).
fn big_udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Ipv4Packet {
    let payload: Vec<u8> = (0..1400u32).map(|i| (i * 7 + 3) as u8).collect();
    Ipv4Packet::new(src, dst, L4::udp(sport, dport, &payload))
}

/// `p` after SNAT to `src:sport` on the gateway, leaving by an interface with MAC `smac`
/// towards `dmac`.
fn snatted(p: &Ipv4Packet, src: Ipv4Addr, sport: u16, smac: [u8; 6], dmac: [u8; 6]) -> Ipv4Packet {
    p.clone()
        .src(src)
        .l4(p.l4.clone().with_sport(sport))
        .ttl(p.ttl - 1)
        .macs(dmac, smac)
}

/// `p` (a reply) after reverse NAT to `dst:dport`, MACs untouched (tunnel).
fn unnatted(p: &Ipv4Packet, dst: Ipv4Addr, dport: u16) -> Ipv4Packet {
    p.clone()
        .dst(dst)
        .l4(p.l4.clone().with_dport(dport))
        .ttl(p.ttl - 1)
}

/// Source port (or ICMP identifier) of an output frame without IP options.
fn sport_of(f: &[u8]) -> u16 {
    let off = if f[23] == 1 { 38 } else { 34 };
    u16::from_be_bytes([f[off], f[off + 1]])
}

/// `p` SNATed to `EGRESS_A` on a port of the configured range other than `not`.
fn snatted_in_range(p: &Ipv4Packet, not: u16) -> impl Fn(&[u8]) -> Result<(), String> + use<> {
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

#[test]
fn from_pod_table() {
    let to_a = tcp(LOCAL_POD, 40_000, DEST_A, 80, TCP_ACK);
    let with_opts = |p: &Ipv4Packet| p.clone().options(&[1, 1, 148, 4, 0, 0]);
    let local_gw_out = snatted(&to_a, EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC);
    let syn_1460 = syn(LOCAL_POD, 40_000, DEST_A, 80, 1460);
    let syn_clamped = syn(LOCAL_POD, 40_000, DEST_A, 80, TUNNEL_MTU - 40);
    let mut truncated_tcp = to_a.build();
    // IP total length says 20 + 8: a TCP header cut short, consistently.
    truncated_tcp.truncate(14 + 20 + 8);
    truncated_tcp[16..18].copy_from_slice(&28u16.to_be_bytes());
    fix_ip_csum(&mut truncated_tcp);
    let mut short_frame = to_a.build();
    short_frame.truncate(14 + 20 + 10);

    run_table(vec![
        case(
            "unselected pod passes untouched, uncounted",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![from_pod(&to_a.clone().src(UNSELECTED_POD)).passes()],
            &[],
        ),
        case(
            "local gateway: a pod with a policy entry but not admitted for its rule dropped",
            |dp, _| {
                dp.selected(UNSELECTED_POD);
                dp.policy(UNSELECTED_POD, a(10, 100, 0, 0), 24, forward(NODE, RULE_A));
            },
            vec![from_pod(&to_a.clone().src(UNSELECTED_POD)).dropped()],
            &[(LOCAL_GATEWAY, 1), (DROP_NOT_ADMITTED, 1)],
        ),
        case(
            "non-IPv4 frame of a selected pod passes",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![from_pod(&to_a).raw(arp_frame()).passes()],
            &[],
        ),
        case(
            "selected pod, destination outside every rule, passes uncounted",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![from_pod(&to_a.clone().dst(INTERNET)).passes()],
            &[],
        ),
        case(
            "remote gateway: tunneled untouched",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![from_pod(&to_a).tunneled()],
            &[(TUNNELED, 1)],
        ),
        case(
            "longest prefix wins: /32 inside the /24 goes to its own (local) gateway",
            |dp, _| {
                local_pod_to_a(dp, PEER);
                dp.policy(LOCAL_POD, DEST_A, 32, forward(NODE, RULE_A));
            },
            vec![
                from_pod(&to_a).redirected(&local_gw_out),
                from_pod(&to_a.clone().dst(a(10, 100, 0, 6))).tunneled(),
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
            |dp, _| {
                local_pod_to_a(dp, PEER);
                dp.policy(LOCAL_POD, a(10, 100, 0, 0), 29, sentinel(action::EXCLUDE));
            },
            vec![
                from_pod(&to_a).passes(),
                from_pod(&to_a.clone().dst(a(10, 100, 0, 9))).tunneled(),
            ],
            &[(EXCLUDED, 1), (TUNNELED, 1)],
        ),
        case(
            "nested prefixes of two pods: each pod's longest prefix wins, except holes pass",
            |dp, _| {
                // LOCAL_POD: /8 drops, /16 falls through, /24 tunnels, /28 is a hole.
                dp.selected(LOCAL_POD);
                let drop = sentinel(action::NO_GATEWAY_DROP);
                dp.policy(LOCAL_POD, a(10, 0, 0, 0), 8, drop);
                let pass = sentinel(action::NO_GATEWAY_PASS);
                dp.policy(LOCAL_POD, a(10, 100, 0, 0), 16, pass);
                dp.policy(LOCAL_POD, a(10, 100, 0, 0), 24, forward(PEER, RULE_A));
                let hole = sentinel(action::EXCLUDE);
                dp.policy(LOCAL_POD, a(10, 100, 0, 16), 28, hole);
                // Another pod's prefixes in between: lengths LOCAL_POD does not use.
                dp.selected(UNSELECTED_POD);
                dp.policy(UNSELECTED_POD, a(10, 100, 0, 0), 20, drop);
                dp.policy(UNSELECTED_POD, a(10, 100, 0, 128), 25, hole);
                // ... and one of a length LOCAL_POD uses, on another network.
                dp.policy(UNSELECTED_POD, a(10, 100, 5, 0), 24, drop);
            },
            vec![
                // The /28 hole, inside the /24.
                from_pod(&to_a.clone().dst(a(10, 100, 0, 20))).passes(),
                // The /24, also inside the other pod's /20 and /25.
                from_pod(&to_a).tunneled(),
                from_pod(&to_a.clone().dst(a(10, 100, 0, 200))).tunneled(),
                // The /16, inside the other pod's /20.
                from_pod(&to_a.clone().dst(a(10, 100, 9, 9))).passes(),
                // The /16, inside the other pod's /20 and /24 (LOCAL_POD has /24s too).
                from_pod(&to_a.clone().dst(a(10, 100, 5, 5))).passes(),
                // The /8.
                from_pod(&to_a.clone().dst(a(10, 7, 7, 7))).dropped(),
                // Outside the /8.
                from_pod(&to_a.clone().dst(a(11, 0, 0, 1))).passes(),
                // The other pod: its /20 and its /25 hole, never LOCAL_POD's prefixes.
                from_pod(&to_a.clone().src(UNSELECTED_POD)).dropped(),
                from_pod(&to_a.clone().src(UNSELECTED_POD).dst(a(10, 100, 0, 200))).passes(),
                from_pod(&to_a.clone().src(UNSELECTED_POD).dst(a(10, 100, 99, 1))).passes(),
            ],
            &[
                (EXCLUDED, 2),
                (TUNNELED, 2),
                (FALLTHROUGH, 2),
                (DROP_NO_GATEWAY, 2),
            ],
        ),
        case(
            "a /0 and a /32 of one pod: both ends of the prefix lengths",
            |dp, _| {
                dp.selected(LOCAL_POD);
                dp.policy(LOCAL_POD, a(0, 0, 0, 0), 0, forward(PEER, RULE_A));
                dp.policy(LOCAL_POD, DEST_A, 32, sentinel(action::EXCLUDE));
            },
            vec![
                from_pod(&to_a).passes(),
                from_pod(&to_a.clone().dst(INTERNET)).tunneled(),
            ],
            &[(EXCLUDED, 1), (TUNNELED, 1)],
        ),
        case(
            "no gateway, failurePolicy Drop: dropped",
            |dp, _| {
                dp.selected(LOCAL_POD);
                dp.policy(
                    LOCAL_POD,
                    a(10, 100, 0, 0),
                    24,
                    sentinel(action::NO_GATEWAY_DROP),
                );
            },
            vec![from_pod(&to_a).dropped()],
            &[(DROP_NO_GATEWAY, 1)],
        ),
        case(
            "no gateway, failurePolicy Fallthrough: passes",
            |dp, _| {
                dp.selected(LOCAL_POD);
                dp.policy(
                    LOCAL_POD,
                    a(10, 100, 0, 0),
                    24,
                    sentinel(action::NO_GATEWAY_PASS),
                );
            },
            vec![from_pod(&to_a).passes()],
            &[(FALLTHROUGH, 1)],
        ),
        case(
            "unknown action value fails closed",
            |dp, _| {
                dp.selected(LOCAL_POD);
                dp.policy(LOCAL_POD, a(10, 100, 0, 0), 24, sentinel(99));
            },
            vec![from_pod(&to_a).dropped()],
            &[(DROP_NO_GATEWAY, 1)],
        ),
        case(
            "SYN MSS 1460 clamped to tunnel_mtu - 40, checksum valid",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![from_pod(&syn_1460).expect(TC_ACT_REDIRECT, Out::Frame(syn_clamped.build()))],
            &[(MSS_CLAMPED, 1), (TUNNELED, 1)],
        ),
        case(
            "SYN MSS already small enough: untouched",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![from_pod(&syn(LOCAL_POD, 40_000, DEST_A, 80, 1200)).tunneled()],
            &[(TUNNELED, 1)],
        ),
        case(
            "SYN with IP options: MSS clamped at the right offset",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![
                from_pod(&with_opts(&syn_1460))
                    .expect(TC_ACT_REDIRECT, Out::Frame(with_opts(&syn_clamped).build())),
            ],
            &[(MSS_CLAMPED, 1), (TUNNELED, 1)],
        ),
        case(
            "local gateway: SNAT to the egress IP, TTL decremented, out of sec0",
            |dp, _| local_pod_to_a(dp, NODE),
            vec![from_pod(&to_a).redirected(&local_gw_out)],
            &[(LOCAL_GATEWAY, 1), (SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "local gateway with IP options: SNAT checksums correct",
            |dp, _| local_pod_to_a(dp, NODE),
            vec![from_pod(&with_opts(&to_a)).redirected(&with_opts(&local_gw_out))],
            &[(LOCAL_GATEWAY, 1), (SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "local gateway, UDP: SNAT",
            |dp, _| local_pod_to_a(dp, NODE),
            vec![
                from_pod(&udp(LOCAL_POD, 5353, DEST_A, 53)).redirected(&snatted(
                    &udp(LOCAL_POD, 5353, DEST_A, 53),
                    EGRESS_A,
                    5353,
                    SEC0_MAC,
                    DEST_A_MAC,
                )),
            ],
            &[(LOCAL_GATEWAY, 1), (SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "fragment (more fragments) of a selected flow dropped",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![from_pod(&to_a.clone().frag(IP_MF)).dropped()],
            &[(DROP_FRAGMENT, 1)],
        ),
        case(
            "non-first fragment of a selected flow dropped",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![from_pod(&to_a.clone().frag(185)).dropped()],
            &[(DROP_FRAGMENT, 1)],
        ),
        case(
            "GRE in a selected flow dropped",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![
                from_pod(
                    &to_a
                        .clone()
                        .l4(L4::raw(PROTO_GRE, &[0, 0, 8, 0, 1, 2, 3, 4])),
                )
                .dropped(),
            ],
            &[(DROP_UNSUPPORTED_PROTO, 1)],
        ),
        case(
            "truncated TCP header (consistent IP length) dropped",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![from_pod(&to_a).raw(truncated_tcp).dropped()],
            &[(DROP_MALFORMED, 1)],
        ),
        case(
            "frame shorter than its IP total length passes, counted",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![from_pod(&to_a).raw(short_frame).passes()],
            &[(MALFORMED_PASSED, 1)],
        ),
        case(
            "agent not ready: selected packet dropped",
            |dp, net| {
                local_pod_to_a(dp, PEER);
                dp.config(Config {
                    flags: 0,
                    ..config(net)
                });
            },
            vec![from_pod(&to_a).dropped()],
            &[(DROP_NOT_READY, 1)],
        ),
    ]);
}

/// `--unknown-pods drop`: network A (10.100.0.0/24) covered, with an except hole at
/// 10.100.0.128/28, `LOCAL_POD` selected and `UNSELECTED_POD` known.
fn unknown_pods_drop(dp: &mut Datapath, net: &Net) {
    dp.config(Config {
        flags: flags::READY | flags::UNKNOWN_PODS_DROP,
        ..config(net)
    });
    local_pod_to_a(dp, PEER);
    dp.known_pod(LOCAL_POD);
    dp.known_pod(UNSELECTED_POD);
    dp.covered(a(10, 100, 0, 0), 24, true);
    dp.covered(a(10, 100, 0, 128), 28, false);
}

/// A selected pod whose entries did not fit the policy map (the agent wrote none and
/// marked it incomplete), with 10.100.0.0/24 covered by some rule and 10.100.0.128/28 an
/// except hole.
fn incomplete_pod(dp: &mut Datapath, net: &Net) {
    dp.config(config(net));
    dp.selected_incomplete(LOCAL_POD);
    dp.covered(a(10, 100, 0, 0), 24, true);
    dp.covered(a(10, 100, 0, 128), 28, false);
}

#[test]
fn policy_map_full_table() {
    let to_a = udp(LOCAL_POD, 40_000, DEST_A, 53);
    run_table(vec![
        case(
            "pod left out of a full policy map, to a covered destination: dropped, counted",
            incomplete_pod,
            vec![from_pod(&to_a).dropped()],
            &[(DROP_POLICY_MAP_FULL, 1)],
        ),
        case(
            "the same pod, TCP SYN: dropped",
            incomplete_pod,
            vec![from_pod(&syn(LOCAL_POD, 40_000, DEST_A, 80, 1460)).dropped()],
            &[(DROP_POLICY_MAP_FULL, 1)],
        ),
        case(
            "the same pod to an except hole: passes",
            incomplete_pod,
            vec![from_pod(&to_a.clone().dst(a(10, 100, 0, 130))).passes()],
            &[],
        ),
        case(
            "the same pod to a destination no rule covers: passes",
            incomplete_pod,
            vec![from_pod(&to_a.clone().dst(INTERNET)).passes()],
            &[],
        ),
        case(
            "a complete pod with no entry for a covered destination: passes (outside its rules)",
            |dp, net| {
                incomplete_pod(dp, net);
                dp.selected(LOCAL_POD);
            },
            vec![from_pod(&to_a).passes()],
            &[],
        ),
    ]);
}

/// A pod address of this node that no Pod object has announced yet.
const UNKNOWN_POD: Ipv4Addr = a(10, 244, 1, 77);

#[test]
fn unknown_pods_table() {
    let to_a = udp(UNKNOWN_POD, 40_000, DEST_A, 53);
    let to_hole = to_a.clone().dst(a(10, 100, 0, 130));
    let mut garbage = to_a.build();
    garbage[14] = 0x00; // version 0, IHL 0: not an IPv4 header, destination still covered
    run_table(vec![
        case(
            "unknown pod to a covered destination: dropped, counted",
            unknown_pods_drop,
            vec![from_pod(&to_a).dropped()],
            &[(DROP_UNKNOWN_POD, 1)],
        ),
        case(
            "unknown pod, TCP SYN: dropped, counted",
            unknown_pods_drop,
            vec![from_pod(&syn(UNKNOWN_POD, 40_000, DEST_A, 80, 1460)).dropped()],
            &[(DROP_UNKNOWN_POD, 1)],
        ),
        case(
            "unknown pod, garbage IP header to a covered destination: dropped",
            unknown_pods_drop,
            vec![from_pod(&to_a).raw(garbage).dropped()],
            &[(DROP_UNKNOWN_POD, 1)],
        ),
        case(
            "unknown pod to an except hole: passes",
            unknown_pods_drop,
            vec![from_pod(&to_hole).passes()],
            &[],
        ),
        case(
            "unknown pod to an uncovered destination: passes",
            unknown_pods_drop,
            vec![from_pod(&to_a.clone().dst(INTERNET)).passes()],
            &[],
        ),
        case(
            "unknown pod, broadcast and multicast: pass",
            |dp, net| {
                unknown_pods_drop(dp, net);
                dp.covered(a(0, 0, 0, 0), 0, true);
            },
            vec![
                from_pod(&to_a.clone().dst(a(255, 255, 255, 255))).passes(),
                from_pod(&to_a.clone().dst(a(224, 0, 0, 251))).passes(),
            ],
            &[],
        ),
        case(
            "unknown pod, ARP: passes",
            unknown_pods_drop,
            vec![from_pod(&to_a).raw(arp_frame()).passes()],
            &[],
        ),
        case(
            "known, unselected pod to a covered destination: passes",
            unknown_pods_drop,
            vec![from_pod(&to_a.clone().src(UNSELECTED_POD)).passes()],
            &[],
        ),
        case(
            "selected pod: tunneled as ever",
            unknown_pods_drop,
            vec![from_pod(&to_a.clone().src(LOCAL_POD)).tunneled()],
            &[(TUNNELED, 1)],
        ),
        case(
            "--unknown-pods pass (flag off): unknown pod passes, maps filled or not",
            |dp, net| {
                unknown_pods_drop(dp, net);
                dp.config(config(net));
            },
            vec![from_pod(&to_a).passes()],
            &[],
        ),
        case(
            "agent not ready: unknown pod passes (nothing is decided before the agent)",
            |dp, net| {
                unknown_pods_drop(dp, net);
                dp.config(Config {
                    flags: flags::UNKNOWN_PODS_DROP,
                    ..config(net)
                });
            },
            vec![from_pod(&to_a).passes()],
            &[],
        ),
    ]);
}

/// `from_underlay`: our VXLAN packets (to this node's address, UDP port
/// `DEFAULT_TUNNEL_PORT`) are decapsulated and take exactly the tunnel device's paths:
/// the same verdict, output frame and counters as `from_tunnel` given the same sender
/// and VNI by the device. Anything else goes on untouched and uncounted
/// (`TC_ACT_UNSPEC`: the next program on the interface, or the stack and the device).
#[test]
fn from_underlay_decapsulates_our_vxlan_as_the_device_would_and_leaves_the_rest() {
    use egress_common::config::DEFAULT_TUNNEL_PORT as PORT;
    in_netns(|| {
        let net = topology();
        let ul0 = ifindex("ul0");
        let same_as_device = [
            (
                "a remote pod's SYN, rule A",
                PEER,
                RULE_A,
                syn(REMOTE_POD, 40_000, DEST_A, 443, 1400),
            ),
            (
                "a remote pod's UDP, rule B",
                PEER,
                RULE_B,
                udp(REMOTE_POD, 5_000, DEST_B, 53),
            ),
            (
                "a reply for a local pod",
                PEER,
                RETURN_VNI,
                tcp(DEST_A, 443, LOCAL_POD, 40_000, TCP_ACK),
            ),
            (
                "an unknown sender",
                STRANGER,
                RULE_A,
                syn(REMOTE_POD, 40_000, DEST_A, 443, 1400),
            ),
            (
                "a spoofed inner source",
                PEER,
                RULE_A,
                syn(LOCAL_POD, 40_000, DEST_A, 443, 1400),
            ),
        ];
        for (what, sender, vni, p) in same_as_device {
            let inner = p.build();
            let mut device = Datapath::load();
            base(&mut device, &net);
            let want = device.run(FROM_TUNNEL, &inner, net.tun0, Some((sender.into(), vni)));
            let mut dp = Datapath::load();
            base(&mut dp, &net);
            let frame = vxlan(sender, NODE, PORT, vni, &inner);
            let got = dp.run(FROM_UNDERLAY, &frame, ul0, None);
            if !kernel_decapsulates() {
                // bpf_skb_adjust_room refuses the decapsulation flags: every frame goes
                // on to the device untouched and uncounted, which decapsulates it.
                assert_eq!(
                    got.verdict, TC_ACT_UNSPEC,
                    "{what}: passed on (Linux < 6.3)"
                );
                assert_eq!(got.frame, frame, "{what}: untouched (Linux < 6.3)");
                assert!(dp.counters().values().all(|&n| n == 0), "{what}: uncounted");
                continue;
            }
            assert_eq!(got.verdict, want.verdict, "{what}: verdict");
            // A dropped frame keeps the Ethernet header it came with: the device's
            // inner one, or ours outer one.
            if want.verdict != TC_ACT_SHOT {
                assert_eq!(got.frame, want.frame, "{what}: output frame");
            }
            assert_eq!(dp.counters(), device.counters(), "{what}: counters");
        }

        let inner = syn(REMOTE_POD, 40_000, DEST_A, 443, 1400).build();
        let ours = vxlan(PEER, NODE, PORT, RULE_A, &inner);
        let changed = |f: fn(&mut Vec<u8>)| {
            let mut v = ours.clone();
            f(&mut v);
            fix_ip_csum(&mut v);
            v
        };
        let not_ours = [
            (
                "the kernel's VXLAN port",
                vxlan(PEER, NODE, 4789, RULE_A, &inner),
            ),
            (
                "another address of the node",
                vxlan(PEER, a(192, 168, 0, 11), PORT, RULE_A, &inner),
            ),
            ("a VXLAN flag besides the VNI's", changed(|f| f[42] = 0x0c)),
            (
                "an inner ARP frame",
                changed(|f| f[62..64].copy_from_slice(&[8, 6])),
            ),
            ("a first fragment", changed(|f| f[20] = 0x20)),
            (
                "IP options",
                changed(|f| {
                    f[14] = 0x46;
                    f.splice(34..34, [1, 1, 1, 0]);
                    let len = u16::from_be_bytes([f[16], f[17]]) + 4;
                    f[16..18].copy_from_slice(&len.to_be_bytes());
                }),
            ),
            (
                "cut short of the inner Ethernet header",
                ours[..60].to_vec(),
            ),
        ];
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        for (what, f) in not_ours {
            let o = dp.run(FROM_UNDERLAY, &f, ul0, None);
            assert_eq!(o.verdict, TC_ACT_UNSPEC, "{what}: verdict");
            assert_eq!(o.frame, f, "{what}: frame untouched");
        }
        assert!(
            dp.counters().values().all(|&n| n == 0),
            "nothing counted: {:?}",
            dp.counters()
        );
    });
}

/// `from_underlay` against the device on mutated VXLAN frames: every frame it does not
/// pass on untouched (`TC_ACT_UNSPEC`) must get exactly what `from_tunnel` gives the
/// frame's inner packet with the frame's outer source and VNI: the same verdict and, but
/// for drops, the same output. Two datapaths see the same frames in the same order, so
/// their conntrack stays alike. A few thousand frames from a fixed seed: bytes changed
/// in the headers, cut short, garbage appended.
#[test]
fn from_underlay_never_does_what_the_device_would_not() {
    use egress_common::config::DEFAULT_TUNNEL_PORT as PORT;
    use egress_tests::fuzz::cases::min_len;
    in_netns(|| {
        let net = topology();
        let ul0 = ifindex("ul0");
        let (mut dp, mut device) = (Datapath::load(), Datapath::load());
        base(&mut dp, &net);
        base(&mut device, &net);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let inners = [
            syn(REMOTE_POD, 40_000, DEST_A, 443, 1400).build(),
            udp(REMOTE_POD2, 5_000, DEST_B, 53).build(),
            tcp(DEST_A, 443, LOCAL_POD, 40_000, TCP_ACK).build(),
        ];
        let (mut decapsulated, mut passed) = (0, 0);
        for i in 0..3_000u64 {
            let inner = &inners[(i % 3) as usize];
            let vni = [RULE_A, RULE_B, RETURN_VNI, 77][(next() % 4) as usize];
            let sender = [PEER, STRANGER][(next() % 2) as usize];
            let mut f = vxlan(sender, NODE, PORT, vni, inner);
            for _ in 0..1 + next() % 3 {
                match next() % 4 {
                    // A header byte (outer or inner) changed.
                    0 | 1 => {
                        let at = (next() % 90.min(f.len() as u64)) as usize;
                        f[at] = next() as u8;
                    }
                    // Cut short (as far as test_run takes it).
                    2 => {
                        let min = min_len(&f);
                        if f.len() > min {
                            f.truncate(min + (next() % (f.len() - min) as u64) as usize);
                        }
                    }
                    _ => f.extend((0..next() % 16).map(|_| next() as u8)),
                }
            }
            let ihl = f.get(14).map_or(0, |b| usize::from(b & 0xf) * 4);
            if next() % 2 == 0 && ihl >= 20 && f.len() >= 14 + ihl {
                fix_ip_csum(&mut f);
            }
            let got = dp.run(FROM_UNDERLAY, &f, ul0, None);
            if got.verdict == TC_ACT_UNSPEC {
                assert_eq!(got.frame, f, "case {i}: passed on, but changed");
                passed += 1;
                continue;
            }
            decapsulated += 1;
            if f.len() - 50 < min_len(&f[50..]) {
                // An inner packet shorter than its IP header: test_run refuses it as
                // such, and from_tunnel drops it as malformed.
                assert_eq!(got.verdict, TC_ACT_SHOT, "case {i}: a short inner packet");
                continue;
            }
            let outer_src = Ipv4Addr::new(f[26], f[27], f[28], f[29]);
            let vni = u32::from_be_bytes([f[46], f[47], f[48], f[49]]) >> 8;
            let want = device.run(
                FROM_TUNNEL,
                &f[50..],
                net.tun0,
                Some((outer_src.into(), vni)),
            );
            assert_eq!(got.verdict, want.verdict, "case {i}: verdict, frame {f:?}");
            if want.verdict != TC_ACT_SHOT {
                assert_eq!(got.frame, want.frame, "case {i}: output, frame {f:?}");
            }
        }
        if kernel_decapsulates() {
            assert!(
                decapsulated > 300 && passed > 300,
                "both ways taken: {decapsulated} decapsulated, {passed} passed on"
            );
        } else {
            assert_eq!(
                decapsulated, 0,
                "Linux < 6.3: every frame is passed on to the device ({passed} were)"
            );
        }
    });
}

/// Whether `bpf_skb_adjust_room` takes `BPF_F_ADJ_ROOM_DECAP_L3_IPV4/6` (Linux 6.3), which
/// `from_underlay` decapsulates with; before, it passes every frame on to the tunnel
/// device. A test's expectation, read off the version: the agent never chooses by it.
fn kernel_decapsulates() -> bool {
    aya::util::KernelVersion::current().is_ok_and(|v| v >= aya::util::KernelVersion::new(6, 3, 0))
}

fn fix_ip_csum(f: &mut [u8]) {
    let ihl = usize::from(f[14] & 0xf) * 4;
    f[24..26].copy_from_slice(&[0, 0]);
    let c = egress_tests::packet::checksum(&[&f[14..14 + ihl]]);
    f[24..26].copy_from_slice(&c.to_be_bytes());
}

/// Both conntrack entries of the UDP flow `REMOTE_POD:5000 -> DEST_A:53`, translated to
/// `EGRESS_A:5000`, last seen `orig_age_s` and `reply_age_s` seconds ago.
fn udp_flow_entries(dp: &mut Datapath, net: &Net, orig_age_s: u64, reply_age_s: u64) {
    let now = ktime_ns();
    let entry = |xlate: Ipv4Addr, age_s: u64| CtEntryV4 {
        xlate_addr: xlate.octets(),
        xlate_port_be: 5000u16.to_be(),
        state: state::ESTABLISHED,
        _pad0: 0,
        pod_node: underlay::from_v4(PEER.octets()),
        ifindex: net.sec0,
        rule_id: RULE_A,
        last_seen_ns: now.saturating_sub(age_s * 1_000_000_000),
        next_hop: Default::default(),
    };
    dp.ct_insert(
        CtKeyV4 {
            src: REMOTE_POD.octets(),
            dst: DEST_A.octets(),
            src_port_be: 5000u16.to_be(),
            dst_port_be: 53u16.to_be(),
            proto: 17,
            dir: dir::ORIGINAL,
            _pad: [0; 2],
        },
        entry(EGRESS_A, orig_age_s),
    );
    dp.ct_insert(
        CtKeyV4 {
            src: DEST_A.octets(),
            dst: EGRESS_A.octets(),
            src_port_be: 53u16.to_be(),
            dst_port_be: 5000u16.to_be(),
            proto: 17,
            dir: dir::REPLY,
            _pad: [0; 2],
        },
        entry(REMOTE_POD, reply_age_s),
    );
}

/// Take `pod`'s admission for `rule` back (the policy no longer selects it).
fn unadmit(dp: &mut Datapath, pod: Ipv4Addr, rule_id: u32) {
    let mut m: aya::maps::HashMap<&mut aya::maps::MapData, AdmittedKeyV4, AdmittedValue> =
        aya::maps::HashMap::try_from(dp.map(maps::ADMITTED_V4)).unwrap();
    let key = AdmittedKeyV4 {
        pod: pod.octets(),
        rule_id,
    };
    m.remove(&key).unwrap();
}

// ---- from_tunnel ----

#[test]
fn from_tunnel_table() {
    let syn_a = tcp(REMOTE_POD, 40_000, DEST_A, 443, 0x02);
    let ack_a = tcp(REMOTE_POD, 40_000, DEST_A, 443, TCP_ACK);
    let out = |p: &Ipv4Packet, port| snatted(p, EGRESS_A, port, SEC0_MAC, DEST_A_MAC);
    let echo = Ipv4Packet::new(REMOTE_POD, DEST_A, L4::echo_request(7, 1));
    let echo2 = echo.clone().src(REMOTE_POD2);
    let udp0 = Ipv4Packet::new(REMOTE_POD, DEST_A, L4::udp_no_checksum(5000, 53, b"q"));
    let reply_in = tcp(DEST_A, 443, LOCAL_POD, 40_000, TCP_ACK).ttl(63);
    let with_opts = syn_a.clone().options(&[1, 1, 148, 4, 0, 0]);

    run_table(vec![
        case(
            "unknown sender dropped",
            no_setup,
            vec![from_tunnel(STRANGER, RULE_A, &syn_a).dropped()],
            &[(DROP_UNKNOWN_SENDER, 1)],
        ),
        case(
            "inner source not a pod of the sender dropped",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &syn_a.clone().src(LOCAL_POD)).dropped(),
                from_tunnel(PEER, RULE_A, &syn_a.clone().src(a(10, 244, 9, 9))).dropped(),
            ],
            &[(DROP_SPOOFED_SOURCE, 2)],
        ),
        case(
            "unknown rule dropped",
            no_setup,
            vec![from_tunnel(PEER, 77, &syn_a).dropped()],
            &[(DROP_UNKNOWN_RULE, 1)],
        ),
        case(
            "a pod of the sender that no policy selects, claiming a served rule, dropped",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &syn_a.clone().src(REMOTE_UNSELECTED)).dropped(),
                from_tunnel(PEER, RULE_SHARED, &syn_a.clone().src(REMOTE_UNSELECTED)).dropped(),
            ],
            &[(DROP_NOT_ADMITTED, 2)],
        ),
        case(
            "a pod admitted for rule A only: rule B dropped, rule A translated",
            |dp, _| dp.admit(REMOTE_UNSELECTED, RULE_A),
            vec![
                from_tunnel(
                    PEER,
                    RULE_B,
                    &syn_a.clone().src(REMOTE_UNSELECTED).dst(DEST_B),
                )
                .dropped(),
                from_tunnel(PEER, RULE_A, &syn_a.clone().src(REMOTE_UNSELECTED))
                    .redirected(&out(&syn_a.clone().src(REMOTE_UNSELECTED), 40_000)),
            ],
            &[(DROP_NOT_ADMITTED, 1), (SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "established flow of a pod no longer admitted: conntrack hit, not checked again",
            |dp, net| {
                udp_flow_entries(dp, net, 1, 1);
                unadmit(dp, REMOTE_POD, RULE_A);
            },
            vec![
                from_tunnel(PEER, RULE_A, &udp(REMOTE_POD, 5000, DEST_A, 53))
                    .redirected(&out(&udp(REMOTE_POD, 5000, DEST_A, 53), 5000)),
                from_tunnel(PEER, RULE_A, &udp(REMOTE_POD, 5001, DEST_A, 53)).dropped(),
            ],
            &[(SNAT_HIT, 1), (FORWARDED, 1), (DROP_NOT_ADMITTED, 1)],
        ),
        case(
            "non-IPv4 passes",
            no_setup,
            vec![from_tunnel(PEER, RULE_A, &syn_a).raw(arp_frame()).passes()],
            &[],
        ),
        case(
            "new flow: SNAT keeps the free pod port, TTL decremented; then conntrack hit",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &syn_a).redirected(&out(&syn_a, 40_000)),
                from_tunnel(PEER, RULE_A, &ack_a).redirected(&out(&ack_a, 40_000)),
            ],
            &[(SNAT_NEW, 1), (SNAT_HIT, 1), (FORWARDED, 2)],
        ),
        case(
            "rule B leaves by sec1 with its own egress IP",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_B, &syn_a.clone().dst(DEST_B)).redirected(&snatted(
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
                from_tunnel(PEER, RULE_A, &syn_a.clone().dst(DEST_FAR)).redirected(&snatted(
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
            "no neighbour yet: redirect_neigh (SNATed, MACs left to the kernel)",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &syn_a.clone().dst(DEST_A_NO_NEIGH)).redirected(
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
            vec![from_tunnel(PEER, RULE_A, &syn_a.clone().dst(DEST_B)).dropped()],
            &[(SNAT_NEW, 1), (DROP_FIB, 1)],
        ),
        case(
            "two pods, same source port, same destination: distinct translations",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &syn_a).redirected(&out(&syn_a, 40_000)),
                from_tunnel(PEER, RULE_A, &syn_a.clone().src(REMOTE_POD2))
                    .redirected_if(snatted_in_range(&syn_a.clone().src(REMOTE_POD2), 40_000)),
            ],
            &[(SNAT_NEW, 2), (FORWARDED, 2)],
        ),
        case(
            "ICMP echo: identifier kept when free, translated when taken",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &echo).redirected(&out(&echo, 7)),
                from_tunnel(PEER, RULE_A, &echo2).redirected_if(snatted_in_range(&echo2, 7)),
            ],
            &[(SNAT_NEW, 2), (FORWARDED, 2)],
        ),
        case(
            "UDP without checksum: stays zero through SNAT",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &udp0).redirected(&out(&udp0, 5000)),
                from_tunnel(PEER, RULE_A, &udp0.clone().src(REMOTE_POD2))
                    .redirected_if(snatted_in_range(&udp0.clone().src(REMOTE_POD2), 5000)),
            ],
            &[(SNAT_NEW, 2), (FORWARDED, 2)],
        ),
        case(
            "IP options: SNAT checksums correct",
            no_setup,
            vec![from_tunnel(PEER, RULE_A, &with_opts).redirected(&out(&with_opts, 40_000))],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "TTL 1 dropped",
            no_setup,
            vec![from_tunnel(PEER, RULE_A, &syn_a.clone().ttl(1)).dropped()],
            &[(DROP_TTL_EXCEEDED, 1)],
        ),
        case(
            "fragment dropped",
            no_setup,
            vec![from_tunnel(PEER, RULE_A, &syn_a.clone().frag(IP_MF | IP_DF)).dropped()],
            &[(DROP_FRAGMENT, 1)],
        ),
        case(
            "GRE dropped",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &syn_a.clone().l4(L4::raw(PROTO_GRE, &[0; 8]))).dropped(),
            ],
            &[(DROP_UNSUPPORTED_PROTO, 1)],
        ),
        case(
            "port exhaustion (range of two ports) counted",
            |dp, net| {
                dp.config(Config {
                    port_min: 30_000,
                    port_max: 30_001,
                    ..config(net)
                });
            },
            vec![
                from_tunnel(PEER, RULE_A, &syn_a.clone().l4(L4::tcp(30_000, 443, 0x02)))
                    .redirected(&out(&syn_a.clone().l4(L4::tcp(30_000, 443, 0x02)), 30_000)),
                from_tunnel(
                    PEER,
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
                    PEER,
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
            "one-way flow (replies idle past the timeout) keeps its port from a new flow",
            |dp, net| udp_flow_entries(dp, net, 1, 200),
            vec![
                from_tunnel(PEER, RULE_A, &udp(REMOTE_POD2, 5000, DEST_A, 53))
                    .redirected_if(snatted_in_range(&udp(REMOTE_POD2, 5000, DEST_A, 53), 5000)),
                from_tunnel(PEER, RULE_A, &udp(REMOTE_POD, 5000, DEST_A, 53))
                    .redirected(&out(&udp(REMOTE_POD, 5000, DEST_A, 53), 5000)),
            ],
            &[(SNAT_NEW, 1), (SNAT_HIT, 1), (FORWARDED, 2)],
        ),
        case(
            "flow idle in both directions: its port is reused by a new flow",
            |dp, net| udp_flow_entries(dp, net, 200, 200),
            vec![
                from_tunnel(PEER, RULE_A, &udp(REMOTE_POD2, 5000, DEST_A, 53))
                    .redirected(&out(&udp(REMOTE_POD2, 5000, DEST_A, 53), 5000)),
            ],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "pod silent, destination streaming: the pod's next packet keeps the translation",
            |dp, net| udp_flow_entries(dp, net, 200, 1),
            vec![
                from_tunnel(PEER, RULE_A, &udp(REMOTE_POD, 5000, DEST_A, 53))
                    .redirected(&out(&udp(REMOTE_POD, 5000, DEST_A, 53), 5000)),
            ],
            &[(SNAT_HIT, 1), (FORWARDED, 1)],
        ),
        case(
            "1400-byte UDP payload: SNAT checksum over the whole payload",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &big_udp(REMOTE_POD, 5000, DEST_A, 53))
                    .redirected(&out(&big_udp(REMOTE_POD, 5000, DEST_A, 53), 5000)),
            ],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "agent not ready: tunneled packet dropped",
            |dp, net| {
                dp.config(Config {
                    flags: 0,
                    ..config(net)
                })
            },
            vec![from_tunnel(PEER, RULE_A, &syn_a).dropped()],
            &[(DROP_NOT_READY, 1)],
        ),
        case(
            "RETURN_VNI for a local pod: delivered to its device",
            no_setup,
            vec![
                from_tunnel(PEER, RETURN_VNI, &reply_in)
                    .redirected(&reply_in.clone().macs(POD_MAC, POD0_MAC)),
            ],
            &[(RETURN_DELIVERED, 1)],
        ),
        case(
            "RETURN_VNI for a pod of another node dropped",
            no_setup,
            vec![from_tunnel(PEER, RETURN_VNI, &reply_in.clone().dst(REMOTE_POD)).dropped()],
            &[(DROP_NOT_LOCAL_POD, 1)],
        ),
        case(
            "RETURN_VNI from an unknown sender dropped",
            no_setup,
            vec![from_tunnel(STRANGER, RETURN_VNI, &reply_in).dropped()],
            &[(DROP_UNKNOWN_SENDER, 1)],
        ),
    ]);
}

/// The next hop an established flow's packets take comes from its conntrack entry, not
/// from a FIB lookup per packet, until the agent bumps `NH_GEN` (a route or neighbour
/// change) or the cache is older than a second. The flow goes through router A
/// (172.16.0.0/16 via 10.100.0.1 on sec0); the router's MAC changes under it.
#[test]
fn an_established_flow_uses_its_cached_next_hop_until_the_generation_changes() {
    in_netns(|| {
        const FAR: Ipv4Addr = a(172, 16, 0, 9);
        const NEW_ROUTER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0xee];
        const POISON: [u8; 6] = [0x02, 0, 0, 0, 0xba, 0xd0];
        let net = topology();
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        dp.nh_gen(7);
        let send = |dp: &mut Datapath, flags: u8| {
            let o = dp.run(
                FROM_TUNNEL,
                &tcp(REMOTE_POD, 40_000, FAR, 443, flags).build(),
                net.tun0,
                Some((PEER.into(), RULE_A)),
            );
            assert_eq!(o.verdict, TC_ACT_REDIRECT);
            // The frame's destination and source MAC.
            (
                <[u8; 6]>::try_from(&o.frame[0..6]).unwrap(),
                <[u8; 6]>::try_from(&o.frame[6..12]).unwrap(),
            )
        };
        let original = |dp: &mut Datapath| {
            dp.ct()
                .into_iter()
                .find(|(k, _)| k.dir == dir::ORIGINAL)
                .expect("the flow's original entry")
        };
        // The first packet looks the route up and leaves the answer in the entry.
        assert_eq!(send(&mut dp, 0x02), (ROUTER_A_MAC, SEC0_MAC));
        let (key, e) = original(&mut dp);
        assert_eq!(e.next_hop.dmac, ROUTER_A_MAC);
        assert_eq!(e.next_hop.smac, SEC0_MAC);
        assert_eq!(e.next_hop.ifindex, net.sec0);
        assert_eq!(e.next_hop.generation, 7);
        // The router's MAC changes, and nobody says so: the flow keeps the cached one
        // (proof that no FIB lookup ran).
        ip(&format!(
            "neigh replace 10.100.0.1 lladdr {} dev sec0 nud permanent",
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
            dp.ct_insert(key, stale);
            assert_eq!(send(&mut dp, 0x10), (NEW_ROUTER_MAC, SEC0_MAC), "{case}");
        }
        // And a valid one is: the poisoned MAC goes out (the cache, not the FIB, decided).
        let mut cached = e;
        cached.next_hop.dmac = POISON;
        cached.next_hop.filled = conntrack::stamp(ktime_ns());
        dp.ct_insert(key, cached);
        assert_eq!(send(&mut dp, 0x10), (POISON, SEC0_MAC));
    });
}

/// The entries a first packet REMOTE_POD:40000 -> DEST_A:443 (TCP, rule A) leaves behind.
#[test]
fn from_tunnel_conntrack_entries() {
    in_netns(|| {
        let net = topology();
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        let syn_a = tcp(REMOTE_POD, 40_000, DEST_A, 443, 0x02);
        let o = dp.run(
            FROM_TUNNEL,
            &syn_a.build(),
            net.tun0,
            Some((PEER.into(), RULE_A)),
        );
        assert_eq!(o.verdict, TC_ACT_REDIRECT);
        let mut ct = dp.ct();
        ct.sort_by_key(|(k, _)| k.dir);
        let strip = |mut e: CtEntryV4| {
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
        let common = CtEntryV4 {
            xlate_addr: EGRESS_A.octets(),
            xlate_port_be: 40_000u16.to_be(),
            state: state::NEW,
            _pad0: 0,
            pod_node: underlay::from_v4(PEER.octets()),
            ifindex: net.sec0,
            rule_id: RULE_A,
            last_seen_ns: 0,
            next_hop: Default::default(),
        };
        assert_eq!(
            got,
            vec![
                (
                    CtKeyV4 {
                        src: REMOTE_POD.octets(),
                        dst: DEST_A.octets(),
                        src_port_be: 40_000u16.to_be(),
                        dst_port_be: 443u16.to_be(),
                        proto: 6,
                        dir: dir::ORIGINAL,
                        _pad: [0; 2],
                    },
                    CtEntryV4 {
                        next_hop: learned,
                        ..common
                    }
                ),
                (
                    CtKeyV4 {
                        src: DEST_A.octets(),
                        dst: EGRESS_A.octets(),
                        src_port_be: 443u16.to_be(),
                        dst_port_be: 40_000u16.to_be(),
                        proto: 6,
                        dir: dir::REPLY,
                        _pad: [0; 2],
                    },
                    CtEntryV4 {
                        xlate_addr: REMOTE_POD.octets(),
                        ..common
                    }
                ),
            ]
        );
    });
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
/// no ACK), window 0, no options or data; the IP header as it was (options, ID, TTL) but
/// for the addresses and the length. Checksums computed here.
fn rst_for(p: &Ipv4Packet) -> Vec<u8> {
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
    let c = checksum(&[
        &p.dst.octets(),
        &p.src.octets(),
        &[0, PROTO_TCP, 0, 20],
        &f[tcp..],
    ]);
    f[tcp + 16..tcp + 18].copy_from_slice(&c.to_be_bytes());
    f
}

fn rst(step: Step, p: &Ipv4Packet) -> Step {
    step.expect(TC_ACT_REDIRECT, Out::Frame(rst_for(p)))
}

/// An `interface:` rule SNATs to the gateway's own address, which a new gateway cannot
/// keep: a mid-stream TCP segment without a flow here (the flow began at another gateway)
/// is answered with a RST to the pod, so that it fails at once. Dedicated egress IPs take
/// such flows over, and SYNs, RSTs and other protocols are translated as before.
#[test]
fn interface_rule_table() {
    let seg = Ipv4Packet::new(REMOTE_POD, DEST_A, segment(40_000, 443, TCP_ACK | TCP_PSH));
    let seg_opts = seg.clone().options(&[1, 1, 148, 4, 0, 0]);
    let fin = seg.clone().l4(segment(40_000, 443, TCP_FIN));
    let local = seg.clone().src(LOCAL_POD);
    let syn_a = tcp(REMOTE_POD, 40_000, DEST_A, 443, TCP_SYN);
    let rst_a = tcp(REMOTE_POD, 40_000, DEST_A, 443, TCP_RST | TCP_ACK);
    let udp_a = udp(REMOTE_POD, 5000, DEST_A, 53);
    let shared = |p: &Ipv4Packet, port| snatted(p, SHARED_A, port, SEC0_MAC, DEST_A_MAC);

    run_table(vec![
        case(
            "mid-stream segment, no flow here: RST back through the tunnel, and no entry made",
            no_setup,
            vec![
                rst(from_tunnel(PEER, RULE_SHARED, &seg), &seg),
                rst(from_tunnel(PEER, RULE_SHARED, &seg), &seg),
            ],
            &[(RESET_MIDSTREAM, 2)],
        ),
        case(
            "mid-stream segment with IP options: options kept, TCP options and data cut",
            no_setup,
            vec![rst(from_tunnel(PEER, RULE_SHARED, &seg_opts), &seg_opts)],
            &[(RESET_MIDSTREAM, 1)],
        ),
        case(
            "segment without ACK (a bare FIN): RST+ACK acknowledging its data and FIN",
            no_setup,
            vec![rst(from_tunnel(PEER, RULE_SHARED, &fin), &fin)],
            &[(RESET_MIDSTREAM, 1)],
        ),
        case(
            "pod on this gateway: RST delivered to its device",
            |dp, _| {
                dp.selected(LOCAL_POD);
                dp.policy(LOCAL_POD, a(10, 100, 0, 0), 24, forward(NODE, RULE_SHARED));
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
                from_tunnel(PEER, RULE_SHARED, &syn_a).redirected(&shared(&syn_a, 40_000)),
                from_tunnel(PEER, RULE_SHARED, &seg).redirected(&shared(&seg, 40_000)),
            ],
            &[(SNAT_NEW, 1), (SNAT_HIT, 1), (FORWARDED, 2)],
        ),
        case(
            "RST without a flow: translated and sent on, never answered",
            no_setup,
            vec![from_tunnel(PEER, RULE_SHARED, &rst_a).redirected(&shared(&rst_a, 40_000))],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "UDP without a flow: translated as before",
            no_setup,
            vec![from_tunnel(PEER, RULE_SHARED, &udp_a).redirected(&shared(&udp_a, 5000))],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "dedicated egress IP: the segment takes the flow over (new entry, same port)",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &seg)
                    .redirected(&snatted(&seg, EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC)),
            ],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
    ]);
}

/// The RST leaves no conntrack entry behind, and verifies on its own: the IP header and
/// the TCP segment (with its pseudo-header) sum to zero.
#[test]
fn interface_rule_reset_makes_no_entry() {
    in_netns(|| {
        let net = topology();
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        let seg = Ipv4Packet::new(REMOTE_POD, DEST_A, segment(40_000, 443, TCP_ACK | TCP_PSH));
        let o = dp.run(
            FROM_TUNNEL,
            &seg.build(),
            net.tun0,
            Some((PEER.into(), RULE_SHARED)),
        );
        assert_eq!(o.verdict, TC_ACT_REDIRECT);
        assert_eq!(dp.ct(), Vec::new(), "conntrack entries");
        let f = &o.frame;
        assert_eq!(f.len(), 14 + 20 + 20, "frame {f:02x?}");
        assert_eq!(checksum(&[&f[14..34]]), 0, "IP header checksum");
        assert_eq!(
            checksum(&[&f[26..34], &[0, PROTO_TCP, 0, 20], &f[34..]]),
            0,
            "TCP checksum"
        );
        assert_eq!(
            (&f[26..30], &f[30..34]),
            (&DEST_A.octets()[..], &REMOTE_POD.octets()[..])
        );
        assert_eq!(
            u32::from_be_bytes(f[38..42].try_into().unwrap()),
            0x3333_4444
        );
        assert_eq!(f[47], TCP_RST);
        assert_eq!(dp.counters().get(&RESET_MIDSTREAM), Some(&1));
    });
}

/// `--max-flows-per-pod 2`: a pod's third new flow is refused before it takes a port
/// (counted, and against the pod), its established flows go on, another pod is not
/// affected; the datapath counts each pod's flows up.
#[test]
fn a_pod_over_its_flow_limit_gets_no_new_flow_and_others_are_unaffected() {
    in_netns(|| {
        let net = topology();
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        dp.config(Config {
            max_flows_per_pod: 2,
            ..config(&net)
        });
        let run = |dp: &mut Datapath, pod, sport| {
            let p = udp(pod, sport, DEST_A, 53);
            dp.run(
                FROM_TUNNEL,
                &p.build(),
                net.tun0,
                Some((PEER.into(), RULE_A)),
            )
            .verdict
        };
        assert_eq!(run(&mut dp, REMOTE_POD, 5000), TC_ACT_REDIRECT);
        assert_eq!(run(&mut dp, REMOTE_POD, 5001), TC_ACT_REDIRECT);
        assert_eq!(
            run(&mut dp, REMOTE_POD, 5002),
            TC_ACT_SHOT,
            "third new flow"
        );
        assert_eq!(
            run(&mut dp, REMOTE_POD, 5000),
            TC_ACT_REDIRECT,
            "established"
        );
        assert_eq!(
            run(&mut dp, REMOTE_POD2, 5000),
            TC_ACT_REDIRECT,
            "another pod"
        );
        assert_eq!((dp.flows(REMOTE_POD), dp.flows(REMOTE_POD2)), (2, 1));
        let c = dp.counters();
        assert_eq!(c.get(&DROP_POD_FLOW_LIMIT), Some(&1));
        assert_eq!(c.get(&SNAT_NEW), Some(&3));
        assert_eq!(c.get(&SNAT_HIT), Some(&1));
        // Unlimited (0): the same pod opens more.
        dp.config(config(&net));
        assert_eq!(run(&mut dp, REMOTE_POD, 5002), TC_ACT_REDIRECT);
        assert_eq!(dp.flows(REMOTE_POD), 3);
    });
}

// ---- from_secondary ----

#[test]
fn from_secondary_table() {
    let fwd = tcp(REMOTE_POD, 40_000, DEST_A, 443, 0x02);
    let synack = syn(DEST_A, 443, EGRESS_A, 40_000, 1460).l4(L4::Tcp {
        sport: 443,
        dport: 40_000,
        flags: 0x12,
        seq: 9,
        ack: 0x0102_0305,
        options: vec![2, 4, 0x05, 0xb4],
        payload: Vec::new(),
    });
    let synack_clamped = synack.clone().l4(L4::Tcp {
        sport: 443,
        dport: 40_000,
        flags: 0x12,
        seq: 9,
        ack: 0x0102_0305,
        options: vec![2, 4, 0x05, 0x82],
        payload: Vec::new(),
    });
    let reply = tcp(DEST_A, 443, EGRESS_A, 40_000, TCP_ACK);
    let local_fwd = tcp(LOCAL_POD, 40_000, DEST_A, 443, 0x02);
    let echo = Ipv4Packet::new(REMOTE_POD, DEST_A, L4::echo_request(7, 1));
    let echo_reply = Ipv4Packet::new(DEST_A, EGRESS_A, L4::echo_reply(7, 1));
    let udp0 = Ipv4Packet::new(REMOTE_POD, DEST_A, L4::udp_no_checksum(5000, 53, b"q"));
    let udp0_reply = Ipv4Packet::new(DEST_A, EGRESS_A, L4::udp_no_checksum(53, 5000, b"a"));
    let udp_reply = udp(DEST_A, 53, EGRESS_A, 5000);
    let to_second = |prev: &[u8]| tcp(DEST_A, 443, EGRESS_A, sport_of(prev), TCP_ACK).build();

    run_table(vec![
        case(
            "reply with an entry: reverse NAT, tunneled back to the pod's node",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &fwd).expect(TC_ACT_REDIRECT, Out::Any),
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
            "SYN-ACK into the tunnel: MSS clamped",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &fwd).expect(TC_ACT_REDIRECT, Out::Any),
                from_secondary(&synack).redirected(&unnatted(&synack_clamped, REMOTE_POD, 40_000)),
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
                from_tunnel(PEER, RULE_A, &fwd).expect(TC_ACT_REDIRECT, Out::Any),
                from_tunnel(PEER, RULE_A, &fwd.clone().src(REMOTE_POD2))
                    .expect(TC_ACT_REDIRECT, Out::Any),
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
            |dp, _| local_pod_to_a(dp, NODE),
            vec![
                from_pod(&local_fwd).expect(TC_ACT_REDIRECT, Out::Any),
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
            "ICMP echo reply: identifier restored",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &echo).expect(TC_ACT_REDIRECT, Out::Any),
                from_secondary(&echo_reply).redirected(&unnatted(&echo_reply, REMOTE_POD, 7)),
            ],
            &[
                (SNAT_NEW, 1),
                (FORWARDED, 1),
                (REVERSE_NAT, 1),
                (RETURN_TUNNELED, 1),
            ],
        ),
        case(
            "UDP reply without checksum stays zero; with checksum, fixed",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &udp0).expect(TC_ACT_REDIRECT, Out::Any),
                from_secondary(&udp0_reply).redirected(&unnatted(&udp0_reply, REMOTE_POD, 5000)),
                from_secondary(&udp_reply).redirected(&unnatted(&udp_reply, REMOTE_POD, 5000)),
            ],
            &[
                (SNAT_NEW, 1),
                (FORWARDED, 1),
                (REVERSE_NAT, 2),
                (RETURN_TUNNELED, 2),
            ],
        ),
        case(
            "dedicated egress IP, no entry: dropped",
            no_setup,
            vec![from_secondary(&reply).dropped()],
            &[(DROP_NO_CONNTRACK, 1)],
        ),
        case(
            "dedicated egress IP, GRE: dropped",
            no_setup,
            vec![from_secondary(&reply.clone().l4(L4::raw(PROTO_GRE, &[0; 8]))).dropped()],
            &[(DROP_UNSUPPORTED_PROTO, 1)],
        ),
        case(
            "dedicated egress IP, entry idle past its timeout: dropped",
            |dp: &mut Datapath, net: &Net| {
                let old = ktime_ns().saturating_sub(121 * 1_000_000_000);
                dp.ct_insert(
                    CtKeyV4 {
                        src: DEST_A.octets(),
                        dst: EGRESS_A.octets(),
                        src_port_be: 53u16.to_be(),
                        dst_port_be: 5000u16.to_be(),
                        proto: 17,
                        dir: dir::REPLY,
                        _pad: [0; 2],
                    },
                    CtEntryV4 {
                        xlate_addr: REMOTE_POD.octets(),
                        xlate_port_be: 5000u16.to_be(),
                        state: state::ESTABLISHED,
                        _pad0: 0,
                        pod_node: underlay::from_v4(PEER.octets()),
                        ifindex: net.sec0,
                        rule_id: RULE_A,
                        last_seen_ns: old,
                        next_hop: Default::default(),
                    },
                );
            },
            vec![from_secondary(&udp_reply).dropped()],
            &[(DROP_NO_CONNTRACK, 1)],
        ),
        case(
            "late reply to a one-way flow (reply entry idle, original live): reverse-NATed",
            |dp, net| udp_flow_entries(dp, net, 1, 200),
            vec![from_secondary(&udp_reply).redirected(&unnatted(&udp_reply, REMOTE_POD, 5000))],
            &[(REVERSE_NAT, 1), (RETURN_TUNNELED, 1)],
        ),
        case(
            "1400-byte UDP reply: reverse NAT checksum over the whole payload",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &big_udp(REMOTE_POD, 5000, DEST_A, 53))
                    .expect(TC_ACT_REDIRECT, Out::Any),
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
            "agent not ready: dedicated egress IP dropped, shared address passes",
            |dp, net| {
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
            "reply with TTL 1 dropped",
            no_setup,
            vec![
                from_tunnel(PEER, RULE_A, &fwd).expect(TC_ACT_REDIRECT, Out::Any),
                from_secondary(&reply.clone().ttl(1)).dropped(),
            ],
            &[(SNAT_NEW, 1), (FORWARDED, 1), (DROP_TTL_EXCEEDED, 1)],
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
                from_secondary(&reply.clone().dst(a(10, 100, 0, 99))).passes(),
                from_secondary(&reply).raw(arp_frame()).passes(),
            ],
            &[],
        ),
    ]);
}

// ---- ICMP errors about translated flows ----

/// The router on network A.
const ROUTER_A: Ipv4Addr = a(10, 100, 0, 1);
/// The 4 bytes after the checksum of "fragmentation needed": unused, next-hop MTU 1300.
const MTU_1300: [u8; 4] = [0, 0, 0x05, 0x14];

/// An ICMP error from the router on network A to `to`, quoting `q`.
fn error_to(to: Ipv4Addr, kind: u8, code: u8, rest: [u8; 4], q: &[u8]) -> Ipv4Packet {
    Ipv4Packet::new(ROUTER_A, to, icmp_error(kind, code, rest, q)).macs(SEC0_MAC, ROUTER_A_MAC)
}

/// `q` (a quote of a packet the gateway sent from the egress IP) as its pod sent it:
/// source `src`, source port (or echo identifier, `port_at` into the transport header)
/// `port`, its header checksum recomputed; its transport checksum stays that of the
/// translated packet (see `icmp_error` in the datapath).
fn requoted(q: &[u8], src: Ipv4Addr, port: u16, port_at: usize) -> Vec<u8> {
    let mut q = q.to_vec();
    q[12..16].copy_from_slice(&src.octets());
    q[20 + port_at..22 + port_at].copy_from_slice(&port.to_be_bytes());
    q[10..12].copy_from_slice(&[0, 0]);
    let c = checksum(&[&q[..20]]);
    q[10..12].copy_from_slice(&c.to_be_bytes());
    q
}

/// The error `e` (quoting `q`) translated back to `pod` (quoted port `port` at
/// `port_at`): destination, TTL, the quote; every checksum computed from scratch.
fn error_back(e: &Ipv4Packet, q: &[u8], pod: Ipv4Addr, port: u16, port_at: usize) -> Ipv4Packet {
    let L4::Raw { payload, .. } = &e.l4 else {
        panic!("not an ICMP error: {e:?}")
    };
    let rest = [payload[4], payload[5], payload[6], payload[7]];
    e.clone().dst(pod).ttl(e.ttl - 1).l4(icmp_error(
        payload[0],
        payload[1],
        rest,
        &requoted(q, pod, port, port_at),
    ))
}

/// Checks `f` is `want` byte for byte, and, on its own, that the outer IPv4 header, the
/// ICMP message and the quoted IPv4 header all sum to zero (checksums valid).
fn error_with_valid_checksums(want: &Ipv4Packet) -> impl Fn(&[u8]) -> Result<(), String> + use<> {
    let want = want.build();
    move |f: &[u8]| {
        frame_diff(f, &want)?;
        let ihl = usize::from(f[14] & 0xf) * 4;
        let icmp = &f[14 + ihl..];
        for (what, bytes) in [
            ("outer IPv4 header", &f[14..14 + ihl]),
            ("ICMP message", icmp),
            ("quoted IPv4 header", &icmp[8..28]),
        ] {
            if checksum(&[bytes]) != 0 {
                return Err(format!("{what}: checksum does not verify"));
            }
        }
        Ok(())
    }
}

#[test]
fn icmp_error_table() {
    let tcp_fwd = tcp(REMOTE_POD, 40_000, DEST_A, 443, TCP_ACK);
    let tcp_out = snatted(&tcp_fwd, EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC).build();
    let udp_fwd = udp(REMOTE_POD, 5000, DEST_A, 53);
    let udp_out = snatted(&udp_fwd, EGRESS_A, 5000, SEC0_MAC, DEST_A_MAC).build();
    let echo_fwd = Ipv4Packet::new(REMOTE_POD, DEST_A, L4::echo_request(7, 1));
    let echo_out = snatted(&echo_fwd, EGRESS_A, 7, SEC0_MAC, DEST_A_MAC).build();
    let local_fwd = tcp(LOCAL_POD, 40_000, DEST_A, 443, TCP_ACK);
    let local_out = snatted(&local_fwd, EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC).build();

    let frag_needed = quote(&tcp_out, 28);
    let frag_needed_err = error_to(EGRESS_A, ICMP_DEST_UNREACH, 4, MTU_1300, &frag_needed);
    let host_unreach = quote(&tcp_out, 40);
    let host_unreach_err = error_to(EGRESS_A, ICMP_DEST_UNREACH, 1, [0; 4], &host_unreach);
    let port_unreach = quote(&udp_out, udp_out.len() - 14);
    let port_unreach_err = error_to(EGRESS_A, ICMP_DEST_UNREACH, 3, [0; 4], &port_unreach);
    let ttl = quote(&echo_out, 28);
    let ttl_err = error_to(EGRESS_A, ICMP_TIME_EXCEEDED, 0, [0; 4], &ttl);
    let local = quote(&local_out, 28);
    let local_err = error_to(EGRESS_A, ICMP_DEST_UNREACH, 4, MTU_1300, &local);
    let truncated_err = error_to(
        EGRESS_A,
        ICMP_DEST_UNREACH,
        4,
        MTU_1300,
        &quote(&tcp_out, 24),
    );
    // The quote of what the pod sent (not from the egress IP): nothing the gateway sent.
    let foreign = quote(&tcp_fwd.build(), 28);
    let foreign_err = error_to(EGRESS_A, ICMP_DEST_UNREACH, 4, MTU_1300, &foreign);
    let host_flow = quote(&tcp(SHARED_A, 50_000, DEST_A, 443, TCP_ACK).build(), 28);
    let host_flow_err = error_to(SHARED_A, ICMP_DEST_UNREACH, 4, MTU_1300, &host_flow);
    let reply = tcp(DEST_A, 443, EGRESS_A, 40_000, TCP_ACK);
    // On the pod's node: the error as the gateway tunneled it back.
    let returned = error_back(&frag_needed_err, &frag_needed, LOCAL_POD, 40_000, 0);
    let flow = |p: &Ipv4Packet| from_tunnel(PEER, RULE_A, p).forwarded_any();
    let xlated = &[
        (SNAT_NEW, 1),
        (FORWARDED, 1),
        (ICMP_ERROR_XLATED, 1),
        (RETURN_TUNNELED, 1),
    ];

    run_table(vec![
        case(
            "fragmentation needed, 8 bytes of TCP quoted: tunneled back to the pod's node",
            no_setup,
            vec![
                flow(&tcp_fwd),
                from_secondary(&frag_needed_err).redirected_if(error_with_valid_checksums(
                    &error_back(&frag_needed_err, &frag_needed, REMOTE_POD, 40_000, 0),
                )),
            ],
            xlated,
        ),
        case(
            "host unreachable quoting the whole TCP header",
            no_setup,
            vec![
                flow(&tcp_fwd),
                from_secondary(&host_unreach_err).redirected_if(error_with_valid_checksums(
                    &error_back(&host_unreach_err, &host_unreach, REMOTE_POD, 40_000, 0),
                )),
            ],
            xlated,
        ),
        case(
            "port unreachable about a UDP flow",
            no_setup,
            vec![
                flow(&udp_fwd),
                from_secondary(&port_unreach_err).redirected_if(error_with_valid_checksums(
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
                from_secondary(&ttl_err).redirected_if(error_with_valid_checksums(&error_back(
                    &ttl_err, &ttl, REMOTE_POD, 7, 4,
                ))),
            ],
            xlated,
        ),
        case(
            "for a pod on this gateway: delivered to its device",
            |dp, _| local_pod_to_a(dp, NODE),
            vec![
                from_pod(&local_fwd).forwarded_any(),
                from_secondary(&local_err).redirected_if(error_with_valid_checksums(
                    &error_back(&local_err, &local, LOCAL_POD, 40_000, 0).macs(POD_MAC, POD0_MAC),
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
                from_secondary(&frag_needed_err).dropped(),
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
            "quote of a packet not from the egress IP: dropped",
            no_setup,
            vec![flow(&tcp_fwd), from_secondary(&foreign_err).dropped()],
            &[(SNAT_NEW, 1), (FORWARDED, 1), (DROP_ICMP_QUOTE, 1)],
        ),
        case(
            "shared address, error about the host's own flow: passes to the host",
            no_setup,
            vec![from_secondary(&host_flow_err).passes()],
            &[],
        ),
        case(
            "on the pod's node: RETURN_VNI error delivered to the pod's device",
            no_setup,
            vec![
                from_tunnel(PEER, RETURN_VNI, &returned)
                    .redirected(&returned.clone().macs(POD_MAC, POD0_MAC)),
            ],
            &[(RETURN_DELIVERED, 1)],
        ),
    ]);
}

// ---- attach ----

fn attach(prog: &'static str) {
    in_netns(move || {
        ip("link add att0 type veth peer name att0p");
        ip("link set att0 up");
        let mut dp = Datapath::load();
        // aya attaches by TCX from Linux 6.6 on, else by a tc filter, which needs the qdisc.
        match aya::programs::tc::qdisc_add_clsact("att0") {
            Ok(()) => {}
            Err(e) => eprintln!("clsact on att0: {e}"),
        }
        dp.program(prog)
            .attach("att0", aya::programs::TcAttachType::Ingress)
            .unwrap_or_else(|e| panic!("failed to attach {prog} to att0: {e:?}"));
    });
}

#[test]
fn from_pod_loads_and_attaches() {
    attach(FROM_POD);
}

#[test]
fn from_tunnel_loads_and_attaches() {
    attach(FROM_TUNNEL);
}

#[test]
fn from_underlay_loads_and_attaches() {
    attach(FROM_UNDERLAY);
}

#[test]
fn from_secondary_loads_and_attaches() {
    attach(FROM_SECONDARY);
}

/// The number of ingress programs on `dev`, TCX links and tc filters alike (the datapath
/// takes whichever the kernel has), in the calling thread's namespace.
fn ingress_programs(dev: &str) -> usize {
    egress_tests::hooks::ingress(dev).len()
}

/// The number of ingress programs on `dev` once it is `want`, or at `within`.
fn programs_within(dev: &str, want: usize, within: std::time::Duration) -> usize {
    let until = std::time::Instant::now() + within;
    loop {
        let n = ingress_programs(dev);
        if n == want || std::time::Instant::now() >= until {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A link pinned by an earlier agent is adopted by swapping the new agent's program
/// into it; the pin alone must then hold it. The 30-minute soak found an adopted
/// `from_secondary` link that was unpinned when no longer wanted but stayed attached
/// through the agent's own reference, could not be attached again when wanted back
/// (`bpf_mprog_attach` failed), and went away when that agent exited: the gateway's
/// kernel answered its egress IPs' replies with RSTs until the next agent attached.
#[test]
fn an_adopted_link_detaches_when_unwanted_and_when_wanted_again_outlives_its_agent() {
    use egress_agent::datapath::{Attachment, Datapath};
    in_netns(|| {
        ip("link add att0 type veth peer name att0p");
        ip("link set att0 up");
        let dir = std::path::PathBuf::from(format!(
            "/sys/fs/bpf/egress-test-adopt-{}",
            std::process::id()
        ));
        let _guard = egress_tests::netns::DirGuard::create(&dir).unwrap();
        let want = std::collections::BTreeSet::from([Attachment {
            program: FROM_SECONDARY,
            ifname: "att0".to_owned(),
            ifindex: ifindex("att0"),
        }]);
        let none = std::collections::BTreeSet::new();

        let mut first = Datapath::open(&dir).expect("the first agent opens its datapath");
        assert!(first.sync_attachments(&want).is_empty());
        drop(first);
        assert_eq!(
            ingress_programs("att0"),
            1,
            "the pinned link outlives its agent"
        );

        let mut second = Datapath::open(&dir).expect("the second agent opens its datapath");
        let errors = second.sync_attachments(&want);
        assert!(errors.is_empty(), "adopting the pinned link: {errors:?}");
        assert_eq!(ingress_programs("att0"), 1, "adopted, not attached twice");
        assert!(second.sync_attachments(&none).is_empty());
        // The kernel drops the pin's reference from a work queue: the detach follows
        // shortly, not always before unpinning returns.
        assert_eq!(
            programs_within("att0", 0, std::time::Duration::from_secs(5)),
            0,
            "a link no longer wanted is detached, not only unpinned"
        );
        let errors = second.sync_attachments(&want);
        assert!(errors.is_empty(), "attaching it again: {errors:?}");
        assert_eq!(ingress_programs("att0"), 1);
        drop(second);
        assert_eq!(
            ingress_programs("att0"),
            1,
            "the link attached again outlives the agent that attached it"
        );
    });
}

/// An agent of another version left pinned maps of another layout: the agent replaces
/// them (rather than feed the programs entries they would misread), and every map it
/// pins has the layout `egress_common::maps::LAYOUT` gives, which is the object's.
#[test]
fn pinned_maps_of_another_layout_are_replaced() {
    let dir = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/egress-test-layout-{}",
        std::process::id()
    ));
    let _guard = egress_tests::netns::DirGuard::create(&dir).unwrap();
    // The layouts of the first release: 4-byte underlay addresses, a 16-byte Config; and
    // the policy map as the LPM trie it was, of the same key and value sizes as the hash.
    for (name, kind, key, value, flags) in [
        (maps::CONFIG, "array", 4, 16, "0"),
        (maps::NODES, "hash", 4, 4, "0"),
        (maps::POLICY_V4, "lpm_trie", 12, 28, "1"),
    ] {
        let path = dir.join(name);
        let o = std::process::Command::new("bpftool")
            .args(["map", "create"])
            .arg(&path)
            .args(["type", kind, "key", &key.to_string(), "value"])
            .args([&value.to_string(), "entries", "16", "name", name])
            .args(["flags", flags])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let dp = egress_agent::datapath::Datapath::open(&dir).expect("the agent opens its datapath");
    for spec in maps::REGISTRY {
        let info = aya::maps::MapInfo::from_pin(dir.join(spec.name))
            .unwrap_or_else(|e| panic!("map {}: {e}", spec.name));
        assert_eq!(
            (info.key_size(), info.value_size(), info.max_entries()),
            (spec.key_size, spec.value_size, spec.max_entries),
            "map {}: the object's key, value and capacity are the registry's",
            spec.name
        );
        use aya::maps::MapType;
        let kind = match spec.kind {
            maps::MapKind::Hash => MapType::Hash,
            maps::MapKind::Array => MapType::Array,
            maps::MapKind::PerCpuArray => MapType::PerCpuArray,
            maps::MapKind::LruHash => MapType::LruHash,
            maps::MapKind::LruPerCpuHash => MapType::LruPerCpuHash,
            maps::MapKind::LpmTrie => MapType::LpmTrie,
        };
        assert_eq!(
            info.map_type().unwrap(),
            kind,
            "map {}: the object's type is the registry's",
            spec.name
        );
    }
    drop(dp);
}

/// A pin directory of its own for a test that opens the datapath (removed with the
/// guard).
fn pin_dir(tag: &str) -> (std::path::PathBuf, egress_tests::netns::DirGuard) {
    let dir = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/egress-test-{tag}-{}",
        std::process::id()
    ));
    let guard = egress_tests::netns::DirGuard::create(&dir).unwrap();
    (dir, guard)
}

/// The capacity of the map pinned as `name` under `dir`.
fn capacity(dir: &std::path::Path, name: &str) -> u32 {
    aya::maps::MapInfo::from_pin(dir.join(name))
        .unwrap()
        .max_entries()
}

/// `--policy-map-entries` sizes both policy maps (and their destination tries); a pinned
/// map of another size is replaced at start (and refilled by the first pass), one of the
/// same size adopted.
#[test]
fn the_policy_map_capacity_is_the_operators() {
    use egress_agent::datapath::{Capacities, Datapath};
    let (dir, _guard) = pin_dir("capacity");
    let capacity = |name: &str| capacity(&dir, name);
    let small = Capacities {
        policy: 2_048,
        ..Capacities::default()
    };
    drop(Datapath::open_with(&dir, &small).expect("opens with 2,048 entries"));
    assert_eq!(capacity(maps::POLICY_V4), 2_048);
    assert_eq!(capacity(maps::POLICY_V6), 2_048);
    assert_eq!(capacity(maps::DESTS_V4), 2_048);
    assert_eq!(capacity(maps::DESTS_V6), 2_048);
    drop(Datapath::open(&dir).expect("reopens with the default"));
    assert_eq!(capacity(maps::POLICY_V4), maps::POLICY_MAX_ENTRIES);
    assert_eq!(capacity(maps::POLICY_V6), maps::POLICY_MAX_ENTRIES);
    assert_eq!(
        capacity(maps::CT_V4),
        maps::CT_MAX_ENTRIES,
        "the others keep the object's"
    );
}

/// `--conntrack-entries` sizes both conntrack maps and the per-pod flow counts. A
/// kernel map cannot be resized, so another capacity replaces the pinned maps at start:
/// their flows are carried into the new ones (flow fields kept, the cached next hop
/// dropped), and a restart at the same capacity adopts the maps as they are.
#[test]
fn the_conntrack_capacity_is_the_operators_and_a_change_keeps_the_flows() {
    use aya::maps::{HashMap, Map, MapData};
    use egress_agent::datapath::{Capacities, Datapath};
    use egress_common::conntrack::{CtEntryV4, CtEntryV6, CtKeyV4, CtKeyV6, NextHop};
    let (dir, _guard) = pin_dir("ct-capacity");
    let capacity = |name: &str| capacity(&dir, name);
    let ct = |name: &str| MapData::from_pin(dir.join(name)).unwrap();
    let small = Capacities {
        conntrack: 4_096,
        ..Capacities::default()
    };
    let dp = Datapath::open_with(&dir, &small).expect("opens with 4,096 conntrack entries");
    for name in [maps::CT_V4, maps::CT_V6, maps::FLOWS_V4, maps::FLOWS_V6] {
        assert_eq!(capacity(name), 4_096, "{name}");
    }
    assert_eq!(
        capacity(maps::POLICY_V4),
        maps::POLICY_MAX_ENTRIES,
        "the others keep theirs"
    );

    // One flow's entry per family, with a next hop cached.
    let (k4, k6) = flow_keys();
    let nh = NextHop {
        dmac: [2, 0, 0, 0, 0, 1],
        smac: [2, 0, 0, 0, 0, 2],
        mtu: 1500,
        generation: 1,
        ifindex: 7,
        filled: 5,
    };
    let pod_node = underlay::from_v4([192, 168, 0, 2]);
    let e4 = CtEntryV4 {
        xlate_addr: [192, 0, 2, 1],
        xlate_port_be: 40_000u16.to_be(),
        state: 2,
        _pad0: 0,
        pod_node,
        ifindex: 7,
        rule_id: 3,
        last_seen_ns: 123,
        next_hop: nh,
    };
    let e6 = CtEntryV6 {
        xlate_addr: "2001:db8::1"
            .parse::<std::net::Ipv6Addr>()
            .unwrap()
            .octets(),
        xlate_port_be: e4.xlate_port_be,
        state: e4.state,
        _pad0: 0,
        pod_node,
        ifindex: e4.ifindex,
        rule_id: e4.rule_id,
        _pad1: 0,
        last_seen_ns: e4.last_seen_ns,
        next_hop: nh,
    };
    HashMap::<_, CtKeyV4, CtEntryV4>::try_from(Map::LruHashMap(ct(maps::CT_V4)))
        .unwrap()
        .insert(k4, e4, 0)
        .unwrap();
    HashMap::<_, CtKeyV6, CtEntryV6>::try_from(Map::LruHashMap(ct(maps::CT_V6)))
        .unwrap()
        .insert(k6, e6, 0)
        .unwrap();
    drop(dp);

    let read = || {
        let v4 = HashMap::<_, CtKeyV4, CtEntryV4>::try_from(Map::LruHashMap(ct(maps::CT_V4)))
            .unwrap()
            .get(&k4, 0)
            .expect("the IPv4 flow was carried over");
        let v6 = HashMap::<_, CtKeyV6, CtEntryV6>::try_from(Map::LruHashMap(ct(maps::CT_V6)))
            .unwrap()
            .get(&k6, 0)
            .expect("the IPv6 flow was carried over");
        (v4, v6)
    };
    let dp = Datapath::open(&dir).expect("reopens with the default capacity");
    for name in [maps::CT_V4, maps::CT_V6, maps::FLOWS_V4, maps::FLOWS_V6] {
        assert_eq!(capacity(name), maps::CT_MAX_ENTRIES, "{name} replaced");
    }
    let (v4, v6) = read();
    let without_cache = |mut e: CtEntryV4| {
        e.next_hop = NextHop::default();
        e
    };
    assert_eq!(v4, without_cache(e4), "flow fields kept, next hop dropped");
    assert_eq!(v6.next_hop, NextHop::default());
    assert_eq!(
        (v6.xlate_addr, v6.xlate_port_be, v6.rule_id, v6.last_seen_ns),
        (e6.xlate_addr, e6.xlate_port_be, e6.rule_id, e6.last_seen_ns)
    );
    drop(dp);

    // The same capacity again: adopted, nothing replaced (the map keeps its id).
    let id = aya::maps::MapInfo::from_pin(dir.join(maps::CT_V4))
        .unwrap()
        .id();
    drop(Datapath::open(&dir).expect("reopens at the same capacity"));
    assert_eq!(
        aya::maps::MapInfo::from_pin(dir.join(maps::CT_V4))
            .unwrap()
            .id(),
        id
    );
    assert_eq!(read().0, without_cache(e4));
}

/// LLVM lowers some zeroing and copying to calls of compiler-builtins' `memset`,
/// `memcpy`, `memmove` or `bcmp`, which on BPF are byte-at-a-time loops (the 64-byte FIB
/// parameters alone cost more than a map lookup). The hot paths avoid them
/// (`egress-ebpf/src/mem.rs`, non-overlapping copies); this keeps it so.
#[test]
fn the_object_calls_no_byte_loop_mem_function() {
    use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget};
    let file = object::File::parse(egress_agent::ebpf::OBJECT).unwrap();
    let mut calls = Vec::new();
    for section in file.sections() {
        for (offset, rel) in section.relocations() {
            if let RelocationTarget::Symbol(i) = rel.target()
                && let Ok(sym) = file.symbol_by_index(i)
                && let Ok(name) = sym.name()
                && ["memset", "memcpy", "memmove", "memcmp", "bcmp"].contains(&name)
            {
                calls.push(format!(
                    "{} +{offset:#x}: {name}",
                    section.name().unwrap_or("?")
                ));
            }
        }
    }
    assert!(
        calls.is_empty(),
        "byte-loop calls in the object: {calls:#?}"
    );
}

/// New flows refused as `DROP_PORT_EXHAUSTED`, by pod, summed over CPUs.
fn exhausted(dp: &mut Datapath) -> Vec<(Ipv4Addr, u64)> {
    let m: aya::maps::PerCpuHashMap<&mut aya::maps::MapData, [u8; 4], u64> =
        aya::maps::PerCpuHashMap::try_from(dp.map(maps::EXHAUSTED_V4)).unwrap();
    let mut out: Vec<_> = m
        .iter()
        .map(|r| r.unwrap())
        .map(|(k, v)| (Ipv4Addr::from(k), v.iter().sum()))
        .collect();
    out.sort();
    out
}

/// A SYN from a remote `pod`'s `sport` to `DEST_A`:443 (rule A) through the tunnel: the
/// verdict and the source port it leaves with.
fn syn_to_a(dp: &mut Datapath, net: &Net, pod: Ipv4Addr, sport: u16) -> (u32, u16) {
    let p = tcp(pod, sport, DEST_A, 443, 0x02);
    let o = dp.run(
        FROM_TUNNEL,
        &p.build(),
        net.tun0,
        Some((PEER.into(), RULE_A)),
    );
    (o.verdict, sport_of(&o.frame))
}

/// A range of two ports, both taken: a third pod's new flows are refused and counted
/// against that pod (`EXHAUSTED_V4`), not against the pods that hold the ports. Once one
/// holder's flow has idled past its timeout both ways, the refused pod's next SYN gets its
/// port at once (no sweeper ran).
#[test]
fn port_exhaustion_is_counted_per_pod_and_an_idle_flows_port_is_reclaimed() {
    in_netns(|| {
        let net = topology();
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        dp.config(Config {
            port_min: 30_000,
            port_max: 30_001,
            ..config(&net)
        });
        let send = |dp: &mut Datapath, pod: Ipv4Addr, sport: u16| syn_to_a(dp, &net, pod, sport);
        assert_eq!(send(&mut dp, REMOTE_POD, 30_000), (TC_ACT_REDIRECT, 30_000));
        assert_eq!(
            send(&mut dp, REMOTE_POD2, 30_001),
            (TC_ACT_REDIRECT, 30_001)
        );
        assert_eq!(send(&mut dp, REMOTE_POD3, 30_000).0, 2, "TC_ACT_SHOT");
        assert_eq!(send(&mut dp, REMOTE_POD3, 30_001).0, 2, "TC_ACT_SHOT");
        assert_eq!(exhausted(&mut dp), vec![(REMOTE_POD3, 2)]);

        // REMOTE_POD's SYN was never answered: idle past the 60 s of a new TCP flow.
        let old = ktime_ns().saturating_sub(61 * 1_000_000_000);
        for (k, mut e) in dp.ct() {
            if k.src == REMOTE_POD.octets() || k.dst_port_be == 30_000u16.to_be() {
                e.last_seen_ns = old;
                dp.ct_insert(k, e);
            }
        }
        assert_eq!(
            send(&mut dp, REMOTE_POD3, 30_000),
            (TC_ACT_REDIRECT, 30_000)
        );
        assert_eq!(exhausted(&mut dp), vec![(REMOTE_POD3, 2)]);
        let c = dp.counters();
        assert_eq!(c.get(&DROP_PORT_EXHAUSTED), Some(&2));
        assert_eq!(c.get(&SNAT_NEW), Some(&3));
    });
}

/// A range of 64 ports, 63 of them held by live flows to (`DEST_A`:443, `EGRESS_A`, TCP):
/// a new flow whose own port is taken still gets the one free port (the random tries alone
/// would mostly miss it; the scan of consecutive ports finds it). With all 64 taken the
/// next new flow is refused and counted against its pod.
#[test]
fn a_new_flow_finds_the_last_free_port_of_the_range() {
    const LO: u16 = 40_000;
    const FREE: u16 = LO + 37;
    in_netns(|| {
        let net = topology();
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        dp.config(Config {
            port_min: LO,
            port_max: LO + 63,
            ..config(&net)
        });
        let now = ktime_ns();
        for port in (LO..=LO + 63).filter(|&p| p != FREE) {
            dp.ct_insert(
                CtKeyV4 {
                    src: DEST_A.octets(),
                    dst: EGRESS_A.octets(),
                    src_port_be: 443u16.to_be(),
                    dst_port_be: port.to_be(),
                    proto: PROTO_TCP,
                    dir: dir::REPLY,
                    _pad: [0; 2],
                },
                CtEntryV4 {
                    xlate_addr: LOCAL_POD.octets(),
                    xlate_port_be: port.to_be(),
                    state: state::ESTABLISHED,
                    _pad0: 0,
                    pod_node: underlay::from_v4(NODE.octets()),
                    ifindex: net.sec0,
                    rule_id: RULE_A,
                    last_seen_ns: now,
                    next_hop: Default::default(),
                },
            );
        }
        let send = |dp: &mut Datapath, pod: Ipv4Addr, sport: u16| syn_to_a(dp, &net, pod, sport);
        assert_eq!(send(&mut dp, REMOTE_POD, LO), (TC_ACT_REDIRECT, FREE));
        assert_eq!(send(&mut dp, REMOTE_POD2, LO + 1).0, 2, "TC_ACT_SHOT");
        assert_eq!(exhausted(&mut dp), vec![(REMOTE_POD2, 1)]);
        let c = dp.counters();
        assert_eq!(c.get(&DROP_PORT_EXHAUSTED), Some(&1));
        assert_eq!(c.get(&SNAT_NEW), Some(&1));
    });
}

/// The agent's map sync, for both families through one code path: a desired state goes
/// into pinned maps, a new agent reads back exactly what the first wrote, and the dump
/// (`egress-agent maps`) and the entry counts (metrics) show it.
#[test]
fn both_families_maps_are_applied_read_back_by_the_next_agent_and_dumped() {
    use egress_agent::{
        datapath::{Datapath, MapState, dump},
        desired::{Desired, GatewayRule, HeldIp, PolicyAction, PolicyEntry},
    };
    let dir = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/egress-test-families-{}",
        std::process::id()
    ));
    let _guard = egress_tests::netns::DirGuard::create(&dir).unwrap();
    let gw: std::net::IpAddr = "10.200.0.21".parse().unwrap();
    let mut d = Desired::default();
    d.nodes.insert(gw, 3);
    let pod4: std::net::Ipv4Addr = "10.244.1.5".parse().unwrap();
    let egress4: std::net::Ipv4Addr = "192.0.2.50".parse().unwrap();
    d.v4.policy.insert(
        (pod4, "198.51.100.0/24".parse().unwrap()),
        PolicyEntry {
            action: PolicyAction::Forward,
            gateway: Some(gw),
            egress_ip: Some(egress4),
            rule_id: 7,
            filter: 0,
        },
    );
    d.v4.selected.insert(pod4, 1);
    d.v4.rules.insert(
        7,
        GatewayRule {
            egress_ip: egress4,
            interface: "lo".into(),
        },
    );
    d.v4.egress_ips.insert(
        egress4,
        HeldIp {
            interface: "lo".into(),
            prefix_len: 24,
            shared: false,
        },
    );
    let pod6: std::net::Ipv6Addr = "fd00:244:1::5".parse().unwrap();
    let egress6: std::net::Ipv6Addr = "fd00:101::50".parse().unwrap();
    d.v6.policy.insert(
        (pod6, "2001:db8::/64".parse().unwrap()),
        PolicyEntry {
            action: PolicyAction::Forward,
            gateway: Some(gw),
            egress_ip: Some(egress6),
            rule_id: 9,
            filter: 0,
        },
    );
    d.v6.selected.insert(pod6, 1);
    d.v6.rules.insert(
        9,
        GatewayRule {
            egress_ip: egress6,
            interface: "lo".into(),
        },
    );
    d.v6.pod_owner.insert(pod6, gw);
    d.admitted.insert((pod6.into(), 9));
    let (want, unresolved) = MapState::from_desired(&d, |n| (n == "lo").then_some(1));
    assert!(unresolved.is_empty());

    let mut first = Datapath::open(&dir).expect("the first agent opens its datapath");
    let stats = first.apply(&want).expect("applies");
    assert!(stats.problems().is_empty(), "{:?}", stats.problems());
    // Policy, dests, selected, rules, egress IPs (IPv4); policy, dests, selected, rules,
    // pod owner, admitted (IPv6); the node.
    assert_eq!(stats.inserted, 12);
    drop(first);

    let second = Datapath::open(&dir).expect("the next agent opens the pinned maps");
    assert_eq!(
        second.held(),
        &want,
        "the next agent reads back what was written"
    );
    let sizes = dump::sizes(&dir).expect("counts the entries");
    for (name, n) in [
        (maps::POLICY_V4, 1),
        (maps::DESTS_V4, 1),
        (maps::EGRESS_IPS_V4, 1),
        (maps::POLICY_V6, 1),
        (maps::POD_OWNER_V6, 1),
        (maps::ADMITTED_V6, 1),
        (maps::NODES, 1),
        (maps::CT_V4, 0),
    ] {
        assert!(sizes.contains(&(name, n)), "{name}: {n} in {sizes:?}");
    }
    let text = dump::render(&dir).expect("renders");
    for line in [
        "IPv4 policy (pod, destination -> action, gateway, egress IP, rule): 1",
        "IPv6 policy (pod, destination -> action, gateway, egress IP, rule): 1",
        "rule 9        -> fd00:101::50             ifindex 1",
        "192.0.2.50      ifindex 1    dedicated",
        "known IPv6 pods: 1",
        "known nodes: 1",
        "rule 9        ->       0 IPv4       1 IPv6",
    ] {
        assert!(text.contains(line), "{line:?} in:\n{text}");
    }
    assert!(
        text.lines().any(|l| l.contains("fd00:244:1::5")
            && l.contains("2001:db8::/64")
            && l.contains("forward")
            && l.contains("gw 10.200.0.21")),
        "the IPv6 policy row in:\n{text}"
    );
    drop(second);

    // The policy maps shrink to nothing: both pods keep no entries and are marked
    // incomplete (the mark goes in before their entries go), and the next agent reads
    // back exactly that.
    let mut shrunk = want.clone();
    assert_eq!(shrunk.fit_policy(0).len(), 2, "a problem per family");
    let mut third = Datapath::open(&dir).expect("opens again");
    let stats = third.apply(&shrunk).expect("applies");
    assert!(stats.problems().is_empty(), "{:?}", stats.problems());
    drop(third);
    let fourth = Datapath::open(&dir).expect("opens again");
    assert_eq!(fourth.held(), &shrunk, "incomplete pods, no policy entries");
    assert!(fourth.held().v4.policy.is_empty() && fourth.held().v6.policy.is_empty());
    drop(fourth);
}

/// An upgrade from an agent of an earlier conntrack layout: entries without a next-hop
/// cache (40-byte values, 56 for IPv6), and entries with the 32-byte one (72, 88). The
/// map is replaced by one of this layout, and its entries are carried over, so that the
/// flows through the gateway keep their translation (a new source port would have the
/// far host reset every established connection); the cached next hop is not carried.
#[test]
fn conntrack_of_an_earlier_layout_is_carried_into_the_new_map() {
    use egress_common::conntrack::{CtEntryV4, CtEntryV6, NextHop};
    let (v4, v6) = flow_keys();
    for old_size in [40, 72] {
        let e: CtEntryV4 = carried(maps::CT_V4, v4, old_size, 40);
        assert_eq!(e.next_hop, NextHop::default(), "no next hop cached yet");
    }
    for old_size in [56, 88] {
        let e: CtEntryV6 = carried(maps::CT_V6, v6, old_size, 56);
        assert_eq!(e.next_hop, NextHop::default(), "no next hop cached yet");
    }
}

/// The conntrack keys of one TCP flow per family (original direction), for the tests of
/// conntrack carried into new maps.
fn flow_keys() -> (
    egress_common::conntrack::CtKeyV4,
    egress_common::conntrack::CtKeyV6,
) {
    use egress_common::conntrack::{CtKeyV4, CtKeyV6};
    let v6 = |a: &str| a.parse::<std::net::Ipv6Addr>().unwrap().octets();
    let k4 = CtKeyV4 {
        src: [10, 244, 1, 5],
        dst: [192, 0, 2, 10],
        src_port_be: 40_000u16.to_be(),
        dst_port_be: 443u16.to_be(),
        proto: 6,
        dir: 0,
        _pad: [0; 2],
    };
    let k6 = CtKeyV6 {
        src: v6("fd00:244:1::5"),
        dst: v6("2001:db8::10"),
        src_port_be: k4.src_port_be,
        dst_port_be: k4.dst_port_be,
        proto: k4.proto,
        dir: k4.dir,
        _pad: [0; 2],
    };
    (k4, k6)
}

/// Pin conntrack map `name` of `old_size`-byte values holding `key` (value bytes 1, 2,
/// ...), open the datapath on it, and return the entry the new map holds for `key`,
/// checked: the map has this build's layout and the first `flow` bytes are the old ones.
fn carried<K: aya::Pod, V: aya::Pod>(name: &str, key: K, old_size: u8, flow: usize) -> V {
    let dir = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/egress-test-carry-{}-{name}-{old_size}",
        std::process::id()
    ));
    let _guard = egress_tests::netns::DirGuard::create(&dir).unwrap();
    let path = dir.join(name);
    let bpftool = |args: &[&str]| {
        let o = std::process::Command::new("bpftool")
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let path_s = path.to_string_lossy().into_owned();
    let (key_size, value_size) = (size_of::<K>().to_string(), old_size.to_string());
    bpftool(&[
        "map",
        "create",
        &path_s,
        "type",
        "lru_hash",
        "key",
        &key_size,
        "value",
        &value_size,
        "entries",
        "262144",
        "name",
        name,
    ]);
    // SAFETY: `K` is plain old data of `size_of::<K>()` bytes.
    let key_bytes = unsafe {
        std::slice::from_raw_parts(std::ptr::from_ref(&key).cast::<u8>(), size_of::<K>())
    };
    let old_value: Vec<u8> = (1..=old_size).collect();
    let hex = |b: &[u8]| b.iter().map(|x| format!("0x{x:02x}")).collect::<Vec<_>>();
    let mut args: Vec<String> = vec!["map".into(), "update".into(), "pinned".into(), path_s];
    args.push("key".into());
    args.extend(hex(key_bytes));
    args.push("value".into());
    args.extend(hex(&old_value));
    bpftool(&args.iter().map(String::as_str).collect::<Vec<_>>());

    let dp = egress_agent::datapath::Datapath::open(&dir).expect("the agent opens its datapath");
    let info = aya::maps::MapInfo::from_pin(&path).unwrap();
    assert_eq!(
        info.value_size() as usize,
        size_of::<V>(),
        "{name}: the {old_size}-byte map replaced by the new layout"
    );
    let data = aya::maps::MapData::from_pin(&path).unwrap();
    let ct: aya::maps::HashMap<_, K, V> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(data)).unwrap();
    let entry = ct.get(&key, 0).unwrap_or_else(|e| {
        panic!("{name}: the flow's {old_size}-byte entry was not carried: {e}")
    });
    // SAFETY: `V` is plain old data.
    let bytes = unsafe {
        std::slice::from_raw_parts(std::ptr::from_ref(&entry).cast::<u8>(), size_of::<V>())
    };
    assert_eq!(
        &bytes[..flow],
        &old_value[..flow],
        "{name}: every flow field of the {old_size}-byte entry kept"
    );
    drop(dp);
    entry
}

/// The verifier refuses a load (`EAGAIN`) whenever the loading thread has a signal
/// pending; CI once saw the agent's five tries in a row refused so. The agent now loads
/// with the thread's signals blocked: a stream of signals aimed at that very thread (one
/// every 50 us, while the verifier needs about a millisecond per program) must not keep
/// the datapath from loading.
#[test]
fn the_datapath_loads_under_a_stream_of_signals_at_the_loading_thread() {
    use std::sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    };
    extern "C" fn on_usr1(_: libc::c_int) {}
    // SAFETY: an empty handler; SIGUSR1 has no other use in this process.
    unsafe { libc::signal(libc::SIGUSR1, on_usr1 as *const () as libc::sighandler_t) };
    let dir = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/egress-test-signals-{}",
        std::process::id()
    ));
    let _guard = egress_tests::netns::DirGuard::create(&dir).unwrap();
    // SAFETY: this thread's id, valid while it runs (it outlives the sender below).
    let me = unsafe { libc::pthread_self() };
    let stop = Arc::new(AtomicBool::new(false));
    let (flag, sent) = (stop.clone(), Arc::new(std::sync::atomic::AtomicU64::new(0)));
    let counter = sent.clone();
    let sender = std::thread::spawn(move || {
        while !flag.load(Ordering::Relaxed) {
            // SAFETY: `me` is alive: the test joins this thread before it returns.
            unsafe { libc::pthread_kill(me, libc::SIGUSR1) };
            counter.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    });
    let dp = egress_agent::datapath::Datapath::open(&dir);
    stop.store(true, Ordering::Relaxed);
    sender.join().unwrap();
    let sent = sent.load(Ordering::Relaxed);
    assert!(
        sent > 10,
        "only {sent} signals were sent while the datapath loaded"
    );
    dp.expect("the datapath loads while signals keep arriving at the loading thread");
}
