//! The IPv4 datapath, program by program, as tables of `BPF_PROG_TEST_RUN` cases against
//! the real object: maps set up, frames in, verdict, frames out (built from scratch, with
//! checksums computed by the test) and counters by reason, summed over CPUs.
//!
//! Every case runs on a thread of its own, in a fresh network namespace holding the
//! devices, routes and neighbours its FIB lookups need, with a freshly loaded object: the
//! bed of `egress_tests::bed`, over IPv4 addresses (`bed::v4`) and the IPv4 underlay. The
//! cases the IPv6 table shares come from `bed::cases`; this file holds the IPv4 ones.
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
    conntrack::{CtEntryV4, CtKeyV4, RemapValueV4, dir, state},
    counters::reason::*,
    maps,
    policy::{AdmittedKeyV4, AdmittedValue, PolicyValueV4, RETURN_VNI, action},
    underlay,
};
use egress_tests::{
    bed::{
        self, Cluster, DEST_A_MAC, Ip, NODE_V4 as NODE, PEER_V4 as PEER, RULE_A, RULE_B, SEC0_MAC,
        STRANGER_V4 as STRANGER, TCP_PSH, UL4, a, base, cases,
        cases::{MTU_1300, unknown_pods_drop},
        config, error_back, error_to, from_pod, from_secondary, from_tunnel, segment, snatted,
        snatted_in_range, syn, tcp, udp, unnatted,
        v4::*,
        valid_error,
    },
    packet::{
        ICMP_DEST_UNREACH, IP_DF, IP_MF, Ipv4Packet, L4, PROTO_GRE, PROTO_TCP, TCP_ACK, TCP_RST,
        arp_frame, checksum, quote, vxlan,
    },
    table::{Case, Out, case, no_setup},
    testrun::{
        Datapath, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC, ifindex, in_netns, ip, ktime_ago_ns,
        ktime_ns,
    },
};

type Net = bed::Net<Ipv4Addr>;

/// An `interface:` rule: out of sec0 with sec0's own address.
const RULE_SHARED: u32 = <Ipv4Addr as Cluster>::RULE_SHARED;

fn topology() -> Net {
    Net::build(UL4)
}

fn forward(gateway: Ipv4Addr, rule_id: u32) -> PolicyValueV4 {
    Ipv4Addr::forward(gateway, rule_id)
}

fn sentinel(act: u8) -> PolicyValueV4 {
    Ipv4Addr::sentinel(act)
}

/// `LOCAL_POD` selected, network A (10.100.0.0/24) through rule A at `gateway`.
fn local_pod_to_a(dp: &mut Datapath, gateway: Ipv4Addr) {
    bed::local_pod_to_a::<Ipv4Addr>(dp, gateway);
}

/// Run every case (each in its own namespace, in parallel) over the IPv4 underlay.
fn run_table(cases: Vec<Case<Net>>) {
    bed::run_table(UL4, cases);
}

// ---- from_pod ----

#[test]
fn from_pod_table() {
    let to_a = tcp(LOCAL_POD, 40_000, DEST_A, 80, TCP_ACK);
    let mut truncated_tcp = to_a.build();
    // IP total length says 20 + 8: a TCP header cut short, consistently.
    truncated_tcp.truncate(14 + 20 + 8);
    truncated_tcp[16..18].copy_from_slice(&28u16.to_be_bytes());
    fix_ip_csum(&mut truncated_tcp);

    let mut cases = cases::from_pod_cases(UL4);
    cases.extend(vec![
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
            "unknown action value fails closed",
            |dp, _| {
                dp.selected(LOCAL_POD);
                dp.policy(LOCAL_POD, a(10, 100, 0, 0), 24, sentinel(99));
            },
            vec![from_pod(&to_a).dropped()],
            &[(DROP_NO_GATEWAY, 1)],
        ),
        case(
            "SYN MSS already small enough: untouched",
            |dp, _| local_pod_to_a(dp, PEER),
            vec![from_pod(&syn(LOCAL_POD, 40_000, DEST_A, 80, 1200)).tunneled()],
            &[(TUNNELED, 1)],
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
    ]);
    run_table(cases);
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

#[test]
fn unknown_pods_table() {
    let to_a = udp(UNKNOWN_POD, 40_000, DEST_A, 53);
    let to_hole = to_a.clone().dst(a(10, 100, 0, 130));
    let mut garbage = to_a.build();
    garbage[14] = 0x00; // version 0, IHL 0: not an IPv4 header, destination still covered
    let mut cases = cases::unknown_pods_cases();
    cases.extend(vec![
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
    run_table(cases);
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
        // One object each, emptied per packet: a load verifies the programs again.
        let (mut device, mut dp) = (Datapath::load(), Datapath::load());
        for (what, sender, vni, p) in same_as_device {
            let inner = p.build();
            device.reset();
            base(&mut device, &net);
            let want = device.run(FROM_TUNNEL, &inner, net.tun0, Some((sender.into(), vni)));
            dp.reset();
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
            // What the stack refuses or trims before the device sees it.
            ("a wrong outer IPv4 checksum", {
                let mut v = ours.clone();
                v[25] ^= 0x40;
                v
            }),
            ("bytes behind the IP total length", {
                let mut v = ours.clone();
                v.extend_from_slice(&[0; 6]);
                v
            }),
            (
                "a UDP length short of the IP payload",
                changed(|f| {
                    let l = u16::from_be_bytes([f[38], f[39]]) - 4;
                    f[38..40].copy_from_slice(&l.to_be_bytes());
                }),
            ),
        ];
        dp.reset();
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
    let entry = |xlate: Ipv4Addr, age_s: u64| CtEntryV4 {
        xlate_addr: xlate.octets(),
        xlate_port_be: 5000u16.to_be(),
        state: state::ESTABLISHED,
        _pad0: 0,
        pod_node: underlay::from_v4(PEER.octets()),
        ifindex: net.sec0,
        rule_id: RULE_A,
        last_seen_ns: ktime_ago_ns(age_s),
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
    let out = |p: &Ipv4Packet, port| snatted(p, EGRESS_A, port, SEC0_MAC, DEST_A_MAC);
    let udp0 = Ipv4Packet::new(REMOTE_POD, DEST_A, L4::udp_no_checksum(5000, 53, b"q"));
    let reply_in = tcp(DEST_A, 443, LOCAL_POD, 40_000, TCP_ACK).ttl(63);

    let mut cases = cases::from_tunnel_cases(UL4);
    cases.extend(vec![
        case(
            "unknown rule dropped",
            no_setup,
            vec![from_tunnel(PEER, 77, &syn_a).dropped()],
            &[(DROP_UNKNOWN_RULE, 1)],
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
            |dp, net| udp_flow_entries(dp, net, 121, 121),
            vec![
                from_tunnel(PEER, RULE_A, &udp(REMOTE_POD2, 5000, DEST_A, 53))
                    .redirected(&out(&udp(REMOTE_POD2, 5000, DEST_A, 53), 5000)),
            ],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "pod silent, destination streaming: the pod's next packet keeps the translation",
            |dp, net| udp_flow_entries(dp, net, 121, 1),
            vec![
                from_tunnel(PEER, RULE_A, &udp(REMOTE_POD, 5000, DEST_A, 53))
                    .redirected(&out(&udp(REMOTE_POD, 5000, DEST_A, 53), 5000)),
            ],
            &[(SNAT_HIT, 1), (FORWARDED, 1)],
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
    run_table(cases);
}

/// The next hop an established flow's packets take comes from its conntrack entry until
/// the generation changes (`bed::cases`): through router A, 172.16.0.0/16 via 10.100.0.1.
#[test]
fn an_established_flow_uses_its_cached_next_hop_until_the_generation_changes() {
    cases::an_established_flow_uses_its_cached_next_hop::<Ipv4Addr>(UL4);
}

/// The entries a first packet REMOTE_POD:40000 -> DEST_A:443 (TCP, rule A) leaves behind.
#[test]
fn from_tunnel_conntrack_entries() {
    cases::from_tunnel_conntrack_entries::<Ipv4Addr>(UL4);
}

/// `bed::cases::a_stream_taken_over_takes_its_port_from_a_silent_flow_only`.
#[test]
fn a_stream_taken_over_takes_its_port_from_a_silent_flow_only() {
    cases::a_stream_taken_over_takes_its_port_from_a_silent_flow_only::<Ipv4Addr>(UL4);
}

// ---- interface rules: a TCP flow from another gateway ----

/// `bed::cases::interface_rule_cases`: a mid-stream segment of an `interface:` rule without
/// a flow here is answered with a RST.
#[test]
fn interface_rule_table() {
    run_table(cases::interface_rule_cases(UL4));
}

/// `Datapath::reset` (which the tables use between cases) leaves the object as a fresh
/// load has it: a flow the gateway translated leaves conntrack entries and counters;
/// after the reset there are none, the configuration is gone (the node not ready), and
/// the same packet with the maps written again gets what it got the first time (the
/// same verdict, frame, counters and entries: the same port, so no remap or flow kept).
#[test]
fn a_reset_object_is_as_freshly_loaded() {
    in_netns(|| {
        let net = topology();
        let mut dp = Datapath::load();
        let seg = syn(REMOTE_POD, 40_000, DEST_A, 443, 1400).build();
        let tunnel = Some((PEER.into(), RULE_A));
        base(&mut dp, &net);
        let first = dp.run(FROM_TUNNEL, &seg, net.tun0, tunnel);
        let (counters, entries) = (dp.counters(), dp.ct().len());
        assert_eq!(first.verdict, TC_ACT_REDIRECT, "translated and sent");
        assert!(entries > 0, "conntrack entries made");
        dp.reset();
        assert_eq!(
            dp.counters(),
            Default::default(),
            "counters after the reset"
        );
        assert_eq!(dp.ct(), Vec::new(), "conntrack after the reset");
        let unready = dp.run(FROM_TUNNEL, &seg, net.tun0, tunnel);
        assert_eq!(unready.verdict, TC_ACT_SHOT, "no configuration: not ready");
        assert_eq!(dp.counters().get(&DROP_NOT_READY), Some(&1));
        dp.reset();
        base(&mut dp, &net);
        let again = dp.run(FROM_TUNNEL, &seg, net.tun0, tunnel);
        assert_eq!(again.verdict, first.verdict, "verdict");
        assert_eq!(again.frame, first.frame, "frame (the same port)");
        assert_eq!(dp.counters(), counters, "counters");
        assert_eq!(dp.ct().len(), entries, "conntrack entries");
    });
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
    let reply = tcp(DEST_A, 443, EGRESS_A, 40_000, TCP_ACK);
    let udp0 = Ipv4Packet::new(REMOTE_POD, DEST_A, L4::udp_no_checksum(5000, 53, b"q"));
    let udp0_reply = Ipv4Packet::new(DEST_A, EGRESS_A, L4::udp_no_checksum(53, 5000, b"a"));
    let udp_reply = udp(DEST_A, 53, EGRESS_A, 5000);

    let mut cases = cases::from_secondary_cases(UL4);
    cases.extend(vec![
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
                let old = ktime_ago_ns(121);
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
    ]);
    run_table(cases);
}

// ---- GSO trains and BIG TCP ----

#[test]
fn gso_segments_are_measured_against_the_egress_mtu() {
    bed::gso::segments_measured::<Ipv4Addr>(UL4);
}

#[test]
fn big_tcp_with_length_zero_is_translated() {
    bed::gso::big_tcp_translated::<Ipv4Addr>(UL4);
}

// ---- ICMP errors the gateway answers with ----

/// `bed::answers::answer_cases`, and a packet without DF, which IPv4 lets a router
/// fragment: dropped (a TC program cannot fragment), counted, never sent.
#[test]
fn icmp_answer_table() {
    let big = bed::big_udp(REMOTE_POD, 5000, DEST_A, 53);
    let mut cases = bed::answers::answer_cases(UL4);
    cases.push(case(
        "a packet over sec0's MTU without DF: dropped, no answer",
        |_, _| ip(&format!("link set sec0 mtu {}", bed::answers::MTU)),
        vec![from_tunnel(PEER, RULE_A, &big.frag(0)).dropped()],
        &[(SNAT_NEW, 1), (DROP_MTU, 1)],
    ));
    run_table(cases);
}

// ---- ICMP errors about translated flows ----

/// `bed::cases::icmp_error_cases`, and errors only IPv4 has: host unreachable, a quote of
/// a packet the gateway did not send, an error about the host's own flow.
#[test]
fn icmp_error_table() {
    let tcp_fwd = tcp(REMOTE_POD, 40_000, DEST_A, 443, TCP_ACK);
    let tcp_out = snatted(&tcp_fwd, EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC).build();
    let host_unreach = quote(&tcp_out, 40);
    let host_unreach_err = error_to(EGRESS_A, ICMP_DEST_UNREACH, 1, [0; 4], &host_unreach);
    // The quote of what the pod sent (not from the egress IP): nothing the gateway sent.
    let foreign = quote(&tcp_fwd.build(), 28);
    let foreign_err = error_to(EGRESS_A, ICMP_DEST_UNREACH, 4, MTU_1300, &foreign);
    let host_flow = quote(&tcp(SHARED_A, 50_000, DEST_A, 443, TCP_ACK).build(), 28);
    let host_flow_err = error_to(SHARED_A, ICMP_DEST_UNREACH, 4, MTU_1300, &host_flow);
    let flow = |p: &Ipv4Packet| from_tunnel(PEER, RULE_A, p).forwarded_any();
    let xlated = &[
        (SNAT_NEW, 1),
        (FORWARDED, 1),
        (ICMP_ERROR_XLATED, 1),
        (RETURN_TUNNELED, 1),
    ];

    let mut cases = cases::icmp_error_cases(UL4);
    cases.extend(vec![
        case(
            "host unreachable quoting the whole TCP header",
            no_setup,
            vec![
                flow(&tcp_fwd),
                from_secondary(&host_unreach_err).redirected_if(valid_error(&error_back(
                    &host_unreach_err,
                    &host_unreach,
                    REMOTE_POD,
                    40_000,
                    0,
                ))),
            ],
            xlated,
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
    ]);
    run_table(cases);
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

/// `--pod-owner-entries` and `--admitted-entries` size both families' pod owner and
/// admitted-pairs maps; the default again replaces them; the others keep the object's.
#[test]
fn the_pod_owner_and_admitted_capacities_are_the_operators() {
    use egress_agent::datapath::{Capacities, Datapath};
    let (dir, _guard) = pin_dir("owner-capacity");
    let capacity = |name: &str| capacity(&dir, name);
    let small = Capacities {
        pod_owner: 2_048,
        admitted: 1_024,
        ..Capacities::default()
    };
    drop(Datapath::open_with(&dir, &small).expect("opens with small owner maps"));
    assert_eq!(capacity(maps::POD_OWNER_V4), 2_048);
    assert_eq!(capacity(maps::POD_OWNER_V6), 2_048);
    assert_eq!(capacity(maps::ADMITTED_V4), 1_024);
    assert_eq!(capacity(maps::ADMITTED_V6), 1_024);
    assert_eq!(
        capacity(maps::CT_V4),
        maps::CT_MAX_ENTRIES,
        "the others keep theirs"
    );
    drop(Datapath::open(&dir).expect("reopens with the default"));
    assert_eq!(capacity(maps::POD_OWNER_V4), maps::POD_OWNER_MAX_ENTRIES);
    assert_eq!(capacity(maps::ADMITTED_V6), maps::ADMITTED_MAX_ENTRIES);
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

/// Linux 6.1's verifier adds the stack frames of a call chain, `bpf_loop` callbacks
/// included (each frame rounded up to 32 bytes, at least 32), and refuses a program whose
/// chain passes 512 bytes ("combined stack size of N calls is 544. Too large"); newer
/// kernels accepted the same object. Read from the object (each function's deepest stack
/// access, its calls and the callbacks whose address it loads) so that the host's tests
/// catch what only the 6.1 guest would.
#[test]
fn no_programs_call_chain_passes_the_512_byte_stack_of_linux_6_1() {
    use std::collections::BTreeMap;

    use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget, SectionKind};
    let file = object::File::parse(egress_agent::ebpf::OBJECT).unwrap();
    // Functions by (section index, first instruction), with their instructions.
    let mut funcs: BTreeMap<(usize, u64), (String, u64)> = BTreeMap::new();
    for sym in file.symbols() {
        if sym.kind() == object::SymbolKind::Text
            && let Some(sec) = sym.section_index()
        {
            funcs.insert(
                (sec.0, sym.address() / 8),
                (sym.name().unwrap_or("?").to_owned(), sym.size() / 8),
            );
        }
    }
    let mut depth: BTreeMap<(usize, u64), u32> = BTreeMap::new();
    let mut calls: BTreeMap<(usize, u64), Vec<(usize, u64)>> = BTreeMap::new();
    let text = file.section_by_name(".text").map(|s| s.index().0);
    for section in file.sections() {
        if section.kind() != SectionKind::Text {
            continue;
        }
        let sec = section.index().0;
        let data = section.data().unwrap();
        let relocs: BTreeMap<u64, object::Relocation> = section.relocations().collect();
        for (&(fsec, start), (_, len)) in funcs.range((sec, 0)..(sec + 1, 0)) {
            assert_eq!(fsec, sec);
            let mut d = 0u32;
            let mut out = Vec::new();
            for i in start..start + len {
                let insn = &data[(i * 8) as usize..(i * 8 + 8) as usize];
                let (op, regs) = (insn[0], insn[1]);
                let (dst, src) = (regs & 0xf, regs >> 4);
                let off = i16::from_le_bytes([insn[2], insn[3]]);
                let imm = i32::from_le_bytes([insn[4], insn[5], insn[6], insn[7]]);
                let class = op & 0x07;
                // Loads from and stores to the frame (r10 + negative offset), and the
                // frame's addresses taken (rX = r10; rX += -N shows as the store below).
                let frame_access = match class {
                    0x01 => src == 10,        // LDX
                    0x02 | 0x03 => dst == 10, // ST, STX
                    _ => false,
                };
                if frame_access && off < 0 {
                    d = d.max(u32::from(off.unsigned_abs()));
                }
                // rX += imm with a negative immediate after rX = r10: a stack object.
                if op == 0x07 && imm < 0 && i > start {
                    let prev = &data[((i - 1) * 8) as usize..(i * 8) as usize];
                    if prev[0] == 0xbf && prev[1] >> 4 == 10 && prev[1] & 0xf == dst {
                        d = d.max(imm.unsigned_abs());
                    }
                }
                let reloc = relocs.get(&(i * 8));
                let to_text = |r: &object::Relocation| match r.target() {
                    RelocationTarget::Symbol(s) => file
                        .symbol_by_index(s)
                        .ok()
                        .and_then(|s| s.section_index())
                        .map(|s| s.0),
                    RelocationTarget::Section(s) => Some(s.0),
                    _ => None,
                };
                if op == 0x85 && src == 1 {
                    // A local call: relative, or through a relocation to `.text`.
                    let target = match reloc.and_then(|r| to_text(r).map(|s| (s, r))) {
                        Some((s, _)) if Some(s) == text => (s, (imm + 1) as u64),
                        _ => (sec, (i as i64 + i64::from(imm) + 1) as u64),
                    };
                    out.push(target);
                } else if op == 0x18
                    && let Some(r) = reloc
                    && let Some(s) = to_text(r)
                    && Some(s) == text
                {
                    // The address of a function (a `bpf_loop` callback).
                    out.push((s, imm as u64 / 8));
                }
            }
            depth.insert((sec, start), d);
            calls.insert((sec, start), out);
        }
    }
    fn chain(
        f: (usize, u64),
        depth: &BTreeMap<(usize, u64), u32>,
        calls: &BTreeMap<(usize, u64), Vec<(usize, u64)>>,
        seen: &mut Vec<(usize, u64)>,
    ) -> (u32, Vec<(usize, u64)>) {
        let own = depth.get(&f).copied().unwrap_or(0).max(1).div_ceil(32) * 32;
        seen.push(f);
        let mut best = (0, Vec::new());
        for c in calls.get(&f).into_iter().flatten() {
            if depth.contains_key(c) && !seen.contains(c) {
                let r = chain(*c, depth, calls, seen);
                if r.0 > best.0 {
                    best = r;
                }
            }
        }
        seen.pop();
        best.1.insert(0, f);
        (own + best.0, best.1)
    }
    let mut checked = 0;
    for (key, (name, _)) in &funcs {
        if Some(key.0) == text {
            continue;
        }
        let (total, path) = chain(*key, &depth, &calls, &mut Vec::new());
        let names: Vec<String> = path
            .iter()
            .map(|f| format!("{} ({} B)", funcs[f].0, depth[f]))
            .collect();
        eprintln!("{name}: {total} B: {}", names.join(" > "));
        assert!(
            total <= 512,
            "{name}: a call chain of {total} bytes, over Linux 6.1's 512: {names:#?}"
        );
        checked += 1;
    }
    assert!(checked >= 4, "only {checked} programs found");
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
    segment_to_a(dp, net, pod, sport, 0x02)
}

/// A TCP segment with `flags` from a remote `pod`'s `sport` to `DEST_A`:443 (rule A)
/// through the tunnel: the verdict and the source port it leaves with. A mid-stream one
/// (`TCP_ACK`) is the first packet a gateway that took egress IP A over sees of a flow.
fn segment_to_a(dp: &mut Datapath, net: &Net, pod: Ipv4Addr, sport: u16, flags: u8) -> (u32, u16) {
    let p = tcp(pod, sport, DEST_A, 443, flags);
    let o = dp.run(
        FROM_TUNNEL,
        &p.build(),
        net.tun0,
        Some((PEER.into(), RULE_A)),
    );
    (o.verdict, Ipv4Addr::sport_of(&o.frame))
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
        let old = ktime_ago_ns(61);
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
        // Found by the scan, not its own: handed to the agent to share.
        assert_eq!(fresh_remaps(&mut dp), vec![(REMOTE_POD, LO, FREE)]);
        assert_eq!(send(&mut dp, REMOTE_POD2, LO + 1).0, 2, "TC_ACT_SHOT");
        assert_eq!(exhausted(&mut dp), vec![(REMOTE_POD2, 1)]);
        let c = dp.counters();
        assert_eq!(c.get(&DROP_PORT_EXHAUSTED), Some(&1));
        assert_eq!(c.get(&SNAT_NEW), Some(&1));
    });
}

/// Share `pod`:`sport` -> `DEST_A`:443 (TCP) as `egress`:`port` in `REMAP_V4`, as the agent
/// writes what the egress IP's holder sent (issue 44).
fn share_remap(dp: &mut Datapath, pod: Ipv4Addr, sport: u16, egress: Ipv4Addr, port: u16) {
    let mut m: aya::maps::HashMap<&mut aya::maps::MapData, CtKeyV4, RemapValueV4> =
        aya::maps::HashMap::try_from(dp.map(maps::REMAP_V4)).unwrap();
    let key = CtKeyV4 {
        src: pod.octets(),
        dst: DEST_A.octets(),
        src_port_be: sport.to_be(),
        dst_port_be: 443u16.to_be(),
        proto: PROTO_TCP,
        dir: dir::ORIGINAL,
        _pad: [0; 2],
    };
    let value = RemapValueV4 {
        xlate_addr: egress.octets(),
        xlate_port_be: port.to_be(),
        _pad: [0; 2],
    };
    m.insert(key, value, 0).unwrap();
}

/// Two pods' flows to `DEST_A`:443 from the same port 40000: the holder of egress IP A gave
/// the second another port (40001) and shared it. On this gateway, which took A over,
/// the second flow's first segment leaves with the shared port even though its own is free
/// here, then the first's with its own; a remap of another egress IP is no reason to leave
/// a pod's port; a shared port that a live flow holds here is not taken from it. The flows
/// that did not keep their pod's port are handed to the agent (`FRESH_REMAPS_V4`).
#[test]
fn a_shared_remap_gives_a_taken_over_flow_the_port_the_far_end_knows() {
    in_netns(|| {
        let net = topology();
        let mut dp = Datapath::load();
        base(&mut dp, &net);
        share_remap(&mut dp, REMOTE_POD2, 40_000, EGRESS_A, 40_001);
        share_remap(
            &mut dp,
            REMOTE_POD3,
            40_002,
            Ipv4Addr::new(192, 0, 2, 1),
            40_003,
        );
        share_remap(&mut dp, REMOTE_POD3, 40_004, EGRESS_A, 40_000);
        let send = |dp: &mut Datapath, pod: Ipv4Addr, sport: u16| {
            segment_to_a(dp, &net, pod, sport, TCP_ACK)
        };
        assert_eq!(
            send(&mut dp, REMOTE_POD2, 40_000),
            (TC_ACT_REDIRECT, 40_001)
        );
        assert_eq!(send(&mut dp, REMOTE_POD, 40_000), (TC_ACT_REDIRECT, 40_000));
        // The flow keeps its port on its next segments.
        assert_eq!(
            send(&mut dp, REMOTE_POD2, 40_000),
            (TC_ACT_REDIRECT, 40_001)
        );
        assert_eq!(
            send(&mut dp, REMOTE_POD3, 40_002),
            (TC_ACT_REDIRECT, 40_002)
        );
        let (verdict, port) = send(&mut dp, REMOTE_POD3, 40_004);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert!(
            ![40_000, 40_001, 40_002].contains(&port),
            "a taken port was handed out again: {port}"
        );
        assert_eq!(dp.counters().get(&SNAT_NEW), Some(&4));
        // The flow that left by another port than its pod's, and only that one, waits in
        // FRESH_REMAPS_V4 for the agent to share it at once (this node may fail next).
        assert_eq!(fresh_remaps(&mut dp), vec![(REMOTE_POD2, 40_000, 40_001)]);
    });
}

/// `FRESH_REMAPS_V4` as (pod, pod port, translated port), ordered; every entry's egress
/// IP must be `EGRESS_A` and its destination `DEST_A`:443.
fn fresh_remaps(dp: &mut Datapath) -> Vec<(Ipv4Addr, u16, u16)> {
    let m: aya::maps::HashMap<&mut aya::maps::MapData, CtKeyV4, RemapValueV4> =
        aya::maps::HashMap::try_from(dp.map(maps::FRESH_REMAPS_V4)).unwrap();
    let mut out: Vec<_> = m
        .iter()
        .map(|e| {
            let (k, v) = e.unwrap();
            assert_eq!(
                (k.dst, u16::from_be(k.dst_port_be), k.dir, v.xlate_addr),
                (DEST_A.octets(), 443, dir::ORIGINAL, EGRESS_A.octets())
            );
            (
                Ipv4Addr::from(k.src),
                u16::from_be(k.src_port_be),
                u16::from_be(v.xlate_port_be),
            )
        })
        .collect();
    out.sort();
    out
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
    // `egress-agent maps` reads the pins into the state the agent wrote, and shows it as
    // the golden tests render it.
    assert_eq!(dump::state(&dir).expect("reads the pins"), want);
    let text = dump::render(&dir).expect("renders");
    for line in [
        "CONFIG node_ip=",
        "POLICY_V4 pod=10.244.1.5 dst=198.51.100.0/24 -> gateway=10.200.0.21 \
         egress_ip=192.0.2.50 rule_id=7 action=forward filter=0",
        "POLICY_V6 pod=fd00:244:1::5 dst=2001:db8::/64 -> gateway=10.200.0.21 \
         egress_ip=fd00:101::50 rule_id=9 action=forward filter=0",
        "RULES_V6 9 -> egress_ip=fd00:101::50 ifindex=1",
        "EGRESS_IPS_V4 192.0.2.50 -> ifindex=1 flags=0",
        "POD_OWNER_V6 fd00:244:1::5 -> node=10.200.0.21",
        "NODES 10.200.0.21 -> node_id=3",
        "ADMITTED_V6 pod=fd00:244:1::5 rule_id=9",
        "IPv4 conntrack (original direction): 0",
    ] {
        assert!(text.contains(line), "{line:?} in:\n{text}");
    }
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

#[test]
fn a_pod_cannot_send_as_another_pod_of_its_node() {
    run_table(cases::source_device_cases());
}

#[test]
fn a_reset_from_the_destination_closes_both_entries() {
    cases::a_reset_closes_both_entries::<Ipv4Addr>(UL4, true);
}

#[test]
fn a_reset_from_the_pod_closes_both_entries() {
    cases::a_reset_closes_both_entries::<Ipv4Addr>(UL4, false);
}

/// A `0.0.0.0/0` rule leaves the node's own destinations alone: link-local (NodeLocal
/// DNSCache at 169.254.20.10, the cloud's metadata at 169.254.169.254), multicast and the
/// limited broadcast pass untouched and uncounted, from selected and unknown pods alike;
/// the rest of the world is tunneled (or, unknown, dropped).
#[test]
fn a_default_rule_leaves_link_local_multicast_and_broadcast_to_the_node() {
    let dns = udp(LOCAL_POD, 40_000, a(169, 254, 20, 10), 53);
    let node_own = [
        dns.clone(),
        dns.clone().l4(L4::syn(40_001, 53, 1460)),
        dns.clone().dst(a(169, 254, 169, 254)),
        dns.clone().dst(a(224, 0, 0, 251)),
        dns.clone().dst(a(255, 255, 255, 255)),
    ];
    let selected = node_own.iter().map(|p| from_pod(p).passes());
    let unknown = node_own
        .iter()
        .map(|p| from_pod(&p.clone().src(UNKNOWN_POD)).passes());
    let to_world = dns.clone().dst(INTERNET);
    run_table(vec![
        case(
            "selected pod under a 0.0.0.0/0 rule",
            |dp, _| {
                dp.selected(LOCAL_POD);
                dp.policy(LOCAL_POD, a(0, 0, 0, 0), 0, forward(PEER, RULE_A));
            },
            selected.chain([from_pod(&to_world).tunneled()]).collect(),
            &[(TUNNELED, 1)],
        ),
        case(
            "unknown pod, --unknown-pods drop, 0.0.0.0/0 covered",
            |dp, net| {
                unknown_pods_drop(dp, net);
                dp.covered(a(0, 0, 0, 0), 0, true);
            },
            unknown
                .chain([from_pod(&to_world.clone().src(UNKNOWN_POD)).dropped()])
                .collect(),
            &[(DROP_UNKNOWN_POD, 1)],
        ),
    ]);
}

/// The devices step's bindings reach the pinned maps of both families, only what
/// changed is written, a full apply of the maps step keeps them (its state carries
/// them), and a restarted agent reads them back and keeps them until its devices step.
#[test]
fn pod_bindings_are_written_read_back_and_kept_by_the_maps_step() {
    use std::{collections::BTreeMap, net::IpAddr};

    use egress_agent::datapath::Datapath;
    use egress_common::policy::{PodDeviceValue, pod_device_flags::REPLY_TO_PEER};
    let (dir, _guard) = pin_dir("pod-devices");
    let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
    let dev = |ifindex, flags| PodDeviceValue { ifindex, flags };
    let bound = BTreeMap::from([
        (ip("10.244.1.5"), dev(11, REPLY_TO_PEER)),
        (ip("fd00:244:1::5"), dev(12, 0)),
    ]);
    let mut dp = Datapath::open(&dir).unwrap();
    let st = dp.apply_pod_devices(&bound).unwrap();
    assert_eq!((st.inserted, st.removed), (2, 0));
    assert_eq!(dp.apply_pod_devices(&bound).unwrap().changed(), 0);
    let mut want = dp.held().clone();
    want.set_pod_devices(&bound);
    assert_eq!(dp.apply(&want).unwrap().changed(), 0);
    drop(dp);
    let mut dp = Datapath::open(&dir).unwrap();
    let held = dp.held();
    let v4: Vec<_> = held
        .v4
        .pod_devices
        .iter()
        .map(|(k, v)| (*k, (v.ifindex, v.flags)))
        .collect();
    assert_eq!(v4, [([10, 244, 1, 5], (11, REPLY_TO_PEER))]);
    // What the maps step of the restarted agent starts from.
    assert_eq!(held.pod_devices(), bound);
    // The pod moved to another device: one entry rewritten; the IPv6 pod gone: removed.
    let moved = BTreeMap::from([(ip("10.244.1.5"), dev(13, REPLY_TO_PEER))]);
    let st = dp.apply_pod_devices(&moved).unwrap();
    assert_eq!((st.inserted, st.removed), (1, 1));
}

/// The verifier's work is most of an agent's start, and most nodes are never gateways: an
/// opened datapath has `from_pod`, `from_tunnel` and `from_underlay` loaded in the kernel,
/// not `from_secondary`, which is loaded when asked for (a gateway) or first attached,
/// once; or at open where an earlier agent attached it (a restarted gateway).
#[test]
fn from_secondary_is_loaded_when_first_needed_not_at_open() {
    let dir = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/egress-test-lazy-{}",
        std::process::id()
    ));
    let _guard = egress_tests::netns::DirGuard::create(&dir).unwrap();
    let mut dp =
        egress_agent::datapath::Datapath::open(&dir).expect("the agent opens its datapath");
    assert_eq!(
        egress_tests::hooks::loaded_with_maps_in(&dir),
        [FROM_POD, FROM_TUNNEL, FROM_UNDERLAY],
        "at open"
    );
    assert!(!dp.is_loaded(FROM_SECONDARY));
    dp.load_program(FROM_SECONDARY)
        .expect("from_secondary loads when asked for");
    dp.load_program(FROM_SECONDARY)
        .expect("asked again: already loaded");
    assert_eq!(
        egress_tests::hooks::loaded_with_maps_in(&dir),
        [FROM_POD, FROM_SECONDARY, FROM_TUNNEL, FROM_UNDERLAY],
        "loaded once when asked for"
    );
    drop(dp);

    // Attached before anything asked for it (a gateway's first pass): loaded then.
    let dir2 = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/egress-test-lazy-attach-{}",
        std::process::id()
    ));
    let _guard2 = egress_tests::netns::DirGuard::create(&dir2).unwrap();
    let d2 = dir2.clone();
    in_netns(move || {
        ip("link add sec0 type veth peer name sec0p");
        ip("link set sec0 up");
        let mut dp = egress_agent::datapath::Datapath::open(&d2).expect("opens");
        let want = std::collections::BTreeSet::from([egress_agent::datapath::Attachment {
            program: FROM_SECONDARY,
            ifname: "sec0".to_owned(),
            ifindex: ifindex("sec0"),
        }]);
        let errors = dp.sync_attachments(&want);
        assert!(errors.is_empty(), "attaching from_secondary: {errors:?}");
        assert!(dp.is_loaded(FROM_SECONDARY));
        assert_eq!(ingress_programs("sec0"), 1, "attached");
        drop(dp);
        // The next agent (a restart, an upgrade) finds the attachment recorded: it loads
        // from_secondary at open, before its probes start, not in its first pass.
        let mut dp = egress_agent::datapath::Datapath::open(&d2).expect("opens again");
        assert!(dp.is_loaded(FROM_SECONDARY));
        assert_eq!(
            egress_tests::hooks::loaded_with_maps_in(&d2),
            [
                FROM_POD,
                FROM_SECONDARY,
                FROM_SECONDARY,
                FROM_TUNNEL,
                FROM_UNDERLAY
            ],
            "opened where an earlier agent attached from_secondary: the earlier agent's \
             (still attached) and this one's"
        );
        assert!(
            dp.sync_attachments(&std::collections::BTreeSet::new())
                .is_empty()
        );
    });
}
