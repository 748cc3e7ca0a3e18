//! The IPv6 datapath (IPv6 pods, over an IPv4 and over an IPv6 underlay), program by program, as tables of
//! `BPF_PROG_TEST_RUN` cases against the real object, in the style of `datapath_v4.rs`:
//! maps set up, frames in, verdict, frames out (built from scratch by `packet6`, with
//! checksums over the IPv6 pseudo-header computed by the test) and counters by reason.
//!
//! Every case runs on a thread of its own, in a fresh network namespace: the bed of
//! `egress_tests::bed` over IPv6 addresses (`bed::v6`). The cases the IPv4 table shares
//! come from `bed::cases`; this file holds the IPv6 ones.
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

use egress_agent::ebpf::{FROM_TUNNEL, FROM_UNDERLAY};
use egress_common::{
    counters::reason::*,
    policy::{PolicyValueV6, RETURN_VNI, action},
};
use egress_tests::{
    bed::{
        self, Cluster, DEST_A_MAC, Ip, ROUTER_A_MAC, RULE_A, RULE_V4_ONLY, SEC0_MAC, TCP_PSH, UL4,
        UL6, UnderlayNet, a, base, cases,
        cases::{MTU_1300, unknown_pods_drop},
        echo, error_to, from_pod, from_secondary, from_tunnel, mac, segment, snatted,
        snatted_in_range, syn, tcp, udp, unnatted, v6,
        v6::*,
    },
    packet::{L4, PROTO_GRE, PROTO_TCP, TCP_ACK, TCP_RST, checksum, quote, vxlan},
    packet6::{
        ICMPV6_NEIGHBOUR_ADVERT, ICMPV6_NEIGHBOUR_SOLICIT, ICMPV6_PKT_TOO_BIG,
        ICMPV6_ROUTER_SOLICIT, Ipv6Packet, NEXTHDR_DEST, NEXTHDR_HOP, icmp6, ndp, pseudo_header6,
        solicited_node,
    },
    table::{Case, Out, case, no_setup},
    testrun::{Datapath, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC, ifindex, in_netns, ip},
};

type Net = bed::Net<Ipv6Addr>;

/// An `interface:` rule: out of sec0 with sec0's own address.
const RULE_SHARED: u32 = <Ipv6Addr as Cluster>::RULE_SHARED;

fn topology(ul: UnderlayNet) -> Net {
    Net::build(ul)
}

fn policy6(dp: &mut Datapath, pod: Ipv6Addr, dst: Ipv6Addr, len: u32, value: PolicyValueV6) {
    dp.policy_v6(pod, dst, len, value);
}

fn selected6(dp: &mut Datapath, pod: Ipv6Addr) {
    dp.selected_v6(pod);
}

fn forward(gateway: IpAddr, rule_id: u32) -> PolicyValueV6 {
    Ipv6Addr::forward(gateway, rule_id)
}

fn sentinel(act: u8) -> PolicyValueV6 {
    Ipv6Addr::sentinel(act)
}

/// `LOCAL_POD` selected, network A (fd00:100::/64) through rule A at `gateway`.
fn local_pod_to_a(dp: &mut Datapath, gateway: IpAddr) {
    bed::local_pod_to_a::<Ipv6Addr>(dp, gateway);
}

/// Run the cases both families share and this family's own (each in its own namespace,
/// in parallel) over `ul`.
fn run_table(ul: UnderlayNet, shared: Vec<Case<Net>>, own: Vec<Case<Net>>) {
    bed::run_table(ul, shared.into_iter().chain(own).collect());
}

/// Five destination options headers: one more than the datapath walks.
fn too_many_ext(p: &Ipv6Packet) -> Ipv6Packet {
    (0..5).fold(p.clone(), |p, _| p.pad_options(NEXTHDR_DEST))
}

// ---- from_pod ----

fn from_pod_table(u: UnderlayNet) {
    let to_a = tcp(LOCAL_POD, 40_000, DEST_A, 80, TCP_ACK);
    let local_gw_out = snatted(&to_a, EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC);
    let with_ext = |p: &Ipv6Packet| p.clone().pad_options(NEXTHDR_HOP).pad_options(NEXTHDR_DEST);
    let udp_a = udp(LOCAL_POD, 5353, DEST_A, 53);
    let echo_a = echo(LOCAL_POD, DEST_A, 7);
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
        cases::from_pod_cases(u),
        vec![
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
    let out = |p: &Ipv6Packet, port| snatted(p, EGRESS_A, port, SEC0_MAC, DEST_A_MAC);
    let udp_a = udp(REMOTE_POD, 5000, DEST_A, 53);
    let reply_in = tcp(DEST_A, 443, LOCAL_POD, 40_000, TCP_ACK).hop_limit(63);

    run_table(
        u,
        cases::from_tunnel_cases(u),
        vec![
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
        // One object each, emptied per packet: a load verifies the programs again.
        let (mut device, mut dp) = (Datapath::load(), Datapath::load());
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
            device.reset();
            base(&mut device, &net);
            let want = device.run(FROM_TUNNEL, &inner, net.tun0, Some((UL4.peer, vni)));
            dp.reset();
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

// ---- from_secondary ----

fn from_secondary_table(u: UnderlayNet) {
    let reply = tcp(DEST_A, 443, EGRESS_A, 40_000, TCP_ACK);
    let udp_out = udp(REMOTE_POD, 5000, DEST_A, 53);
    let udp_back = udp(DEST_A, 53, EGRESS_A, 5000);
    let ns_for = |target: Ipv6Addr| {
        Ipv6Packet::new(ROUTER_A, target, ndp(ICMPV6_NEIGHBOUR_SOLICIT, target))
            .hop_limit(255)
            .macs(SEC0_MAC, ROUTER_A_MAC)
    };

    run_table(
        u,
        cases::from_secondary_cases(u),
        vec![
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
        ],
    );
}

// ---- interface rules: a TCP flow from another gateway ----

/// The IPv6 side of `datapath_v4`'s `interface_rule_table` (`bed::cases`).
fn interface_rule_table(u: UnderlayNet) {
    run_table(u, cases::interface_rule_cases(u), Vec::new());
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
        assert_eq!(dp.ct_v6(), Vec::new(), "conntrack entries");
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

// ---- GSO trains and BIG TCP ----

#[test]
fn gso_segments_are_measured_against_the_egress_mtu() {
    bed::gso::segments_measured::<Ipv6Addr>(UL4);
    bed::gso::segments_measured::<Ipv6Addr>(UL6);
}

#[test]
fn big_tcp_with_length_zero_is_translated() {
    bed::gso::big_tcp_translated::<Ipv6Addr>(UL4);
    bed::gso::big_tcp_translated::<Ipv6Addr>(UL6);
}

// ---- ICMPv6 errors the gateway answers with ----

/// `bed::answers::answer_cases` ("packet too big": IPv6 routers never fragment).
fn icmp_answer_table(u: UnderlayNet) {
    run_table(u, bed::answers::answer_cases(u), Vec::new());
}

#[test]
fn icmp_answer_table_ipv4_underlay() {
    icmp_answer_table(UL4);
}

#[test]
fn icmp_answer_table_ipv6_underlay() {
    icmp_answer_table(UL6);
}

// ---- ICMPv6 errors about translated flows ----

/// `bed::cases::icmp_error_cases`, and a quote only IPv6 has: one behind an extension
/// header.
fn icmp_error_table(u: UnderlayNet) {
    let tcp_fwd = tcp(REMOTE_POD, 40_000, DEST_A, 443, TCP_ACK);
    let tcp_out = snatted(&tcp_fwd, EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC);
    let with_ext = quote(&tcp_out.clone().pad_options(NEXTHDR_HOP).build(), 56);
    let with_ext_err = error_to(EGRESS_A, ICMPV6_PKT_TOO_BIG, 0, MTU_1300, &with_ext);
    let flow = move |p: &Ipv6Packet| from_tunnel(u.peer, RULE_A, p).forwarded_any();

    run_table(
        u,
        cases::icmp_error_cases(u),
        vec![case(
            "quote with an extension header (not walked): dropped",
            no_setup,
            vec![flow(&tcp_fwd), from_secondary(&with_ext_err).dropped()],
            &[(SNAT_NEW, 1), (FORWARDED, 1), (DROP_ICMP_QUOTE, 1)],
        )],
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

/// `bed::cases::a_stream_taken_over_takes_its_port_from_a_silent_flow_only`.
#[test]
fn a_stream_taken_over_takes_its_port_from_a_silent_flow_only() {
    cases::a_stream_taken_over_takes_its_port_from_a_silent_flow_only::<Ipv6Addr>(UL6);
}

#[test]
fn from_tunnel_conntrack_entries_ipv4_underlay() {
    cases::from_tunnel_conntrack_entries::<Ipv6Addr>(UL4);
}

#[test]
fn from_tunnel_conntrack_entries_ipv6_underlay() {
    cases::from_tunnel_conntrack_entries::<Ipv6Addr>(UL6);
}

#[test]
fn an_established_flow_uses_its_cached_next_hop_ipv4_underlay() {
    cases::an_established_flow_uses_its_cached_next_hop::<Ipv6Addr>(UL4);
}

#[test]
fn an_established_flow_uses_its_cached_next_hop_ipv6_underlay() {
    cases::an_established_flow_uses_its_cached_next_hop::<Ipv6Addr>(UL6);
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

#[test]
fn unknown_pods_table() {
    let unknown = UNKNOWN_POD;
    run_table(
        UL4,
        cases::unknown_pods_cases(),
        vec![
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
        ],
    );
}

#[test]
fn a_pod_cannot_send_as_another_pod_of_its_node() {
    run_table(UL4, cases::source_device_cases(), vec![]);
}

#[test]
fn a_reset_from_the_destination_closes_both_entries() {
    cases::a_reset_closes_both_entries::<Ipv6Addr>(UL6, true);
}

#[test]
fn a_reset_from_the_pod_closes_both_entries() {
    cases::a_reset_closes_both_entries::<Ipv6Addr>(UL4, false);
}
