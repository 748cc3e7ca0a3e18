//! The cases whose logic is the same over IPv4 and IPv6 pods, written once: each table
//! runs them beside its family's own. `u` is the underlay the table runs over.

use egress_agent::ebpf::FROM_TUNNEL;
use egress_common::{
    config::{Config, flags},
    conntrack::{self, NextHop, dir, state},
    counters::reason::*,
    policy::{RETURN_VNI, action, pod_device_flags::REPLY_TO_PEER},
};

use super::{
    CtLike, DEST_A_MAC, DEST_B_MAC, Ip, Net, POD0_MAC, PORT_MAX, PORT_MIN, Packet, ROUTER_A_MAC,
    RULE_A, RULE_B, SEC0_MAC, SEC1_MAC, TCP_PSH, TUNNEL_MTU, UnderlayNet, bed, big_udp, config,
    echo, echo_reply, error_back, error_to, from_other_pod, from_pod, from_secondary, from_tunnel,
    local_pod_to_a, mac, rst, segment, snatted, snatted_in_range, syn, tcp, udp, unnatted,
    valid_error,
};
use crate::{
    packet::{HOST_MAC, L4, POD_MAC, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, arp_frame, quote},
    table::{Case, Out, case, no_setup},
    testrun::{Datapath, TC_ACT_REDIRECT, in_netns, ip, ktime_ago_ns, ktime_ns},
};

/// A SYN with the MSS of a 1500-byte MTU, and as clamped to the tunnel's.
fn syns<A: Ip>(src: A, dst: A) -> (A::Packet, A::Packet) {
    (
        syn(src, 40_000, dst, 80, 1500 - A::MSS_OVERHEAD),
        syn(src, 40_000, dst, 80, TUNNEL_MTU - A::MSS_OVERHEAD),
    )
}

pub fn from_pod_cases<A: Ip>(u: UnderlayNet) -> Vec<Case<Net<A>>> {
    let to_a = tcp(A::LOCAL_POD, 40_000, A::DEST_A, 80, TCP_ACK);
    let local_gw_out = snatted(&to_a, A::EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC);
    let (syn_big, syn_clamped) = syns(A::LOCAL_POD, A::DEST_A);
    let mut short_frame = to_a.build();
    short_frame.truncate(14 + A::L3_LEN + 10);
    let to_peer = move |dp: &mut Datapath, _: &Net<A>| local_pod_to_a::<A>(dp, u.peer);
    let to_node = move |dp: &mut Datapath, _: &Net<A>| local_pod_to_a::<A>(dp, u.node);
    let only = |act: u8| {
        move |dp: &mut Datapath, _: &Net<A>| {
            A::selected(dp, A::LOCAL_POD);
            A::policy(dp, A::LOCAL_POD, A::NET_A, A::NET_A_LEN, A::sentinel(act));
        }
    };
    let (nat, hops, options) = (A::NAT, A::HOPS, A::OPTIONS);
    vec![
        case(
            "unselected pod passes untouched, uncounted",
            to_peer,
            vec![from_pod(&to_a.clone().src(A::UNSELECTED_POD)).passes()],
            &[],
        ),
        case(
            "local gateway: a pod with a policy entry but not admitted for its rule dropped",
            move |dp, _| {
                A::selected(dp, A::UNSELECTED_POD);
                let fwd = A::forward(u.node, RULE_A);
                A::policy(dp, A::UNSELECTED_POD, A::NET_A, A::NET_A_LEN, fwd);
            },
            vec![from_pod(&to_a.clone().src(A::UNSELECTED_POD)).dropped()],
            &[(LOCAL_GATEWAY, 1), (DROP_NOT_ADMITTED, 1)],
        ),
        case(
            "ARP of a selected pod passes",
            to_peer,
            vec![from_pod(&to_a).raw(arp_frame()).passes()],
            &[],
        ),
        case(
            "selected pod, destination outside every rule, passes uncounted",
            to_peer,
            vec![from_pod(&to_a.clone().dst(A::INTERNET)).passes()],
            &[],
        ),
        case(
            "remote gateway: tunneled untouched",
            to_peer,
            vec![from_pod(&to_a).tunneled()],
            &[(TUNNELED, 1)],
        ),
        case(
            format!(
                "longest prefix wins: /{} inside the /{} goes to its own (local) gateway",
                A::HOST_LEN,
                A::NET_A_LEN
            ),
            move |dp, _| {
                local_pod_to_a::<A>(dp, u.peer);
                let fwd = A::forward(u.node, RULE_A);
                A::policy(dp, A::LOCAL_POD, A::DEST_A, A::HOST_LEN, fwd);
            },
            vec![
                from_pod(&to_a).redirected(&local_gw_out),
                from_pod(&to_a.clone().dst(A::NEAR_A)).tunneled(),
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
                local_pod_to_a::<A>(dp, u.peer);
                let except = A::sentinel(action::EXCLUDE);
                A::policy(dp, A::LOCAL_POD, A::NET_A, A::EXCEPT_LEN, except);
            },
            vec![
                from_pod(&to_a).passes(),
                from_pod(&to_a.clone().dst(A::PAST_EXCEPT_A)).tunneled(),
            ],
            &[(EXCLUDED, 1), (TUNNELED, 1)],
        ),
        case(
            "no gateway, failurePolicy Drop: dropped",
            only(action::NO_GATEWAY_DROP),
            vec![from_pod(&to_a).dropped()],
            &[(DROP_NO_GATEWAY, 1)],
        ),
        case(
            "no gateway, failurePolicy Fallthrough: passes",
            only(action::NO_GATEWAY_PASS),
            vec![from_pod(&to_a).passes()],
            &[(FALLTHROUGH, 1)],
        ),
        case(
            format!(
                "SYN MSS {} clamped to tunnel_mtu - {}, checksum valid",
                1500 - A::MSS_OVERHEAD,
                A::MSS_OVERHEAD
            ),
            to_peer,
            vec![from_pod(&syn_big).expect(TC_ACT_REDIRECT, Out::Frame(syn_clamped.build()))],
            &[(MSS_CLAMPED, 1), (TUNNELED, 1)],
        ),
        case(
            format!("SYN with {options}: MSS clamped at the right offset"),
            to_peer,
            vec![from_pod(&A::with_options(&syn_big)).expect(
                TC_ACT_REDIRECT,
                Out::Frame(A::with_options(&syn_clamped).build()),
            )],
            &[(MSS_CLAMPED, 1), (TUNNELED, 1)],
        ),
        case(
            format!("local gateway: {nat} to the egress IP, {hops} decremented, out of sec0"),
            to_node,
            vec![from_pod(&to_a).redirected(&local_gw_out)],
            &[(LOCAL_GATEWAY, 1), (SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            format!("local gateway with {options}: {nat} checksums correct"),
            to_node,
            vec![from_pod(&A::with_options(&to_a)).redirected(&A::with_options(&local_gw_out))],
            &[(LOCAL_GATEWAY, 1), (SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "frame shorter than its IP header says passes, counted",
            to_peer,
            vec![from_pod(&to_a).raw(short_frame).passes()],
            &[(MALFORMED_PASSED, 1)],
        ),
        case(
            "agent not ready: selected packet dropped",
            move |dp, net| {
                local_pod_to_a::<A>(dp, u.peer);
                dp.config(Config {
                    flags: 0,
                    ..config(net)
                });
            },
            vec![from_pod(&to_a).dropped()],
            &[(DROP_NOT_READY, 1)],
        ),
    ]
}

pub fn from_tunnel_cases<A: Ip>(u: UnderlayNet) -> Vec<Case<Net<A>>> {
    let syn_a = tcp(A::REMOTE_POD, 40_000, A::DEST_A, 443, TCP_SYN);
    let ack_a = tcp(A::REMOTE_POD, 40_000, A::DEST_A, 443, TCP_ACK);
    let out = |p: &A::Packet, port| snatted(p, A::EGRESS_A, port, SEC0_MAC, DEST_A_MAC);
    let via = |p: &A::Packet, egress, smac, dmac| snatted(p, egress, 40_000, smac, dmac);
    let echo1 = echo(A::REMOTE_POD, A::DEST_A, 7);
    let echo2 = echo1.clone().src(A::REMOTE_POD2);
    let big = big_udp(A::REMOTE_POD, 5000, A::DEST_A, 53);
    let reply_in = tcp(A::DEST_A, 443, A::LOCAL_POD, 40_000, TCP_ACK).hops(63);
    let with_opts = A::with_options(&syn_a);
    let unselected = syn_a.clone().src(A::REMOTE_UNSELECTED);
    let pod2 = syn_a.clone().src(A::REMOTE_POD2);
    let (peer, nat, hops, icmp) = (u.peer, A::NAT, A::HOPS, A::ICMP);
    let from = |port: u16, pod: A| tcp(pod, port, A::DEST_A, 443, TCP_SYN);
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
                from_tunnel(peer, RULE_A, &syn_a.clone().src(A::LOCAL_POD)).dropped(),
                from_tunnel(peer, RULE_A, &syn_a.clone().src(A::NOT_A_POD)).dropped(),
            ],
            &[(DROP_SPOOFED_SOURCE, 2)],
        ),
        case(
            "a pod of the sender that no policy selects, claiming a served rule, dropped",
            no_setup,
            vec![
                from_tunnel(peer, RULE_A, &unselected).dropped(),
                from_tunnel(peer, A::RULE_SHARED, &unselected).dropped(),
            ],
            &[(DROP_NOT_ADMITTED, 2)],
        ),
        case(
            "a pod admitted for rule A only: rule B dropped, rule A translated",
            |dp, _| dp.admit(A::REMOTE_UNSELECTED, RULE_A),
            vec![
                from_tunnel(peer, RULE_B, &unselected.clone().dst(A::DEST_B)).dropped(),
                from_tunnel(peer, RULE_A, &unselected).redirected(&out(&unselected, 40_000)),
            ],
            &[(DROP_NOT_ADMITTED, 1), (SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            format!(
                "new flow: {nat} keeps the free pod port, {hops} decremented; then conntrack hit"
            ),
            no_setup,
            vec![
                from_tunnel(peer, RULE_A, &syn_a).redirected(&out(&syn_a, 40_000)),
                from_tunnel(peer, RULE_A, &ack_a).redirected(&out(&ack_a, 40_000)),
            ],
            &[(SNAT_NEW, 1), (SNAT_HIT, 1), (FORWARDED, 2)],
        ),
        case(
            "rule B leaves by sec1 with its own egress IP",
            no_setup,
            vec![
                from_tunnel(peer, RULE_B, &syn_a.clone().dst(A::DEST_B)).redirected(&via(
                    &syn_a.clone().dst(A::DEST_B),
                    A::EGRESS_B,
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
                from_tunnel(peer, RULE_A, &syn_a.clone().dst(A::DEST_FAR)).redirected(&via(
                    &syn_a.clone().dst(A::DEST_FAR),
                    A::EGRESS_A,
                    SEC0_MAC,
                    ROUTER_A_MAC,
                )),
            ],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            format!("no neighbour yet: redirect_neigh ({nat}ed, MACs left to the kernel)"),
            no_setup,
            vec![
                from_tunnel(peer, RULE_A, &syn_a.clone().dst(A::DEST_A_NO_NEIGH)).redirected(
                    &out(&syn_a.clone().dst(A::DEST_A_NO_NEIGH), 40_000).macs(HOST_MAC, POD_MAC),
                ),
            ],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "destination not reachable through the rule's interface: dropped",
            no_setup,
            vec![from_tunnel(peer, RULE_A, &syn_a.clone().dst(A::DEST_B)).dropped()],
            &[(SNAT_NEW, 1), (DROP_FIB, 1)],
        ),
        case(
            "two pods, same source port, same destination: distinct translations",
            no_setup,
            vec![
                from_tunnel(peer, RULE_A, &syn_a).redirected(&out(&syn_a, 40_000)),
                from_tunnel(peer, RULE_A, &pod2).redirected_if(snatted_in_range(&pod2, 40_000)),
            ],
            &[(SNAT_NEW, 2), (FORWARDED, 2)],
        ),
        case(
            format!("{icmp} echo: identifier kept when free, translated when taken"),
            no_setup,
            vec![
                from_tunnel(peer, RULE_A, &echo1).redirected(&out(&echo1, 7)),
                from_tunnel(peer, RULE_A, &echo2).redirected_if(snatted_in_range(&echo2, 7)),
            ],
            &[(SNAT_NEW, 2), (FORWARDED, 2)],
        ),
        case(
            format!("{}: {nat} checksums correct", A::OPTIONS),
            no_setup,
            vec![from_tunnel(peer, RULE_A, &with_opts).redirected(&out(&with_opts, 40_000))],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            format!(
                "{}-byte UDP payload: {nat} checksum over the whole payload",
                A::BIG_PAYLOAD
            ),
            no_setup,
            vec![from_tunnel(peer, RULE_A, &big).redirected(&out(&big, 5000))],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
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
                from_tunnel(peer, RULE_A, &from(30_000, A::REMOTE_POD))
                    .redirected(&out(&from(30_000, A::REMOTE_POD), 30_000)),
                from_tunnel(peer, RULE_A, &from(30_001, A::REMOTE_POD2))
                    .redirected(&out(&from(30_001, A::REMOTE_POD2), 30_001)),
                from_tunnel(peer, RULE_A, &from(30_000, A::REMOTE_POD3)).dropped(),
            ],
            &[(SNAT_NEW, 2), (FORWARDED, 2), (DROP_PORT_EXHAUSTED, 1)],
        ),
        case(
            "agent not ready: tunneled packet dropped",
            |dp, net| {
                dp.config(Config {
                    flags: 0,
                    ..config(net)
                })
            },
            vec![from_tunnel(peer, RULE_A, &syn_a).dropped()],
            &[(DROP_NOT_READY, 1)],
        ),
        case(
            "RETURN_VNI for a local pod: delivered to its device",
            no_setup,
            vec![
                from_tunnel(peer, RETURN_VNI, &reply_in)
                    .redirected(&reply_in.clone().macs(POD_MAC, POD0_MAC)),
            ],
            &[(RETURN_DELIVERED, 1)],
        ),
        case(
            "RETURN_VNI from the pod's gateway for that source, the pod bound to a veth: into \
             the pod, not by the FIB",
            move |dp, net: &Net<A>| {
                local_pod_to_a::<A>(dp, peer);
                dp.pod_device_with(A::LOCAL_POD, net.pod0, REPLY_TO_PEER);
            },
            // The frame as it came (no MACs written): the peer is the pod's own device.
            vec![from_tunnel(peer, RETURN_VNI, &reply_in).redirected(&reply_in)],
            &[(RETURN_DELIVERED, 1), (TO_POD_DEVICE, 1)],
        ),
        case(
            "RETURN_VNI from a node that is not the pod's gateway for that source (a forgery \
             from its address): by the FIB, never into the pod",
            move |dp, net: &Net<A>| {
                local_pod_to_a::<A>(dp, u.node);
                dp.pod_device_with(A::LOCAL_POD, net.pod0, REPLY_TO_PEER);
            },
            vec![
                from_tunnel(peer, RETURN_VNI, &reply_in)
                    .redirected(&reply_in.clone().macs(POD_MAC, POD0_MAC)),
            ],
            &[(RETURN_DELIVERED, 1)],
        ),
        case(
            "RETURN_VNI from a node for a source the pod has no rule for: by the FIB",
            |dp, net: &Net<A>| dp.pod_device_with(A::LOCAL_POD, net.pod0, REPLY_TO_PEER),
            vec![
                from_tunnel(peer, RETURN_VNI, &reply_in)
                    .redirected(&reply_in.clone().macs(POD_MAC, POD0_MAC)),
            ],
            &[(RETURN_DELIVERED, 1)],
        ),
        case(
            "RETURN_VNI from the pod's gateway, the pod bound to a device that is no veth: by \
             the FIB",
            move |dp, net: &Net<A>| {
                local_pod_to_a::<A>(dp, peer);
                dp.pod_device(A::LOCAL_POD, net.pod0);
            },
            vec![
                from_tunnel(peer, RETURN_VNI, &reply_in)
                    .redirected(&reply_in.clone().macs(POD_MAC, POD0_MAC)),
            ],
            &[(RETURN_DELIVERED, 1)],
        ),
    ]
}

/// A SYN-ACK from `DEST_A`:443 to `EGRESS_A`:40000 carrying `mss`.
fn synack<A: Ip>(mss: u16) -> A::Packet {
    let [hi, lo] = mss.to_be_bytes();
    let l4 = L4::Tcp {
        sport: 443,
        dport: 40_000,
        flags: 0x12,
        seq: 9,
        ack: 0x0102_0305,
        options: vec![2, 4, hi, lo],
        payload: Vec::new(),
    };
    A::Packet::new(A::DEST_A, A::EGRESS_A, l4)
}

pub fn from_secondary_cases<A: Ip>(u: UnderlayNet) -> Vec<Case<Net<A>>> {
    let fwd = tcp(A::REMOTE_POD, 40_000, A::DEST_A, 443, TCP_SYN);
    let synack_in = synack::<A>(1500 - A::MSS_OVERHEAD);
    let synack_clamped = synack::<A>(TUNNEL_MTU - A::MSS_OVERHEAD);
    let reply = tcp(A::DEST_A, 443, A::EGRESS_A, 40_000, TCP_ACK);
    let local_fwd = tcp(A::LOCAL_POD, 40_000, A::DEST_A, 443, TCP_SYN);
    let echo_out = echo(A::REMOTE_POD, A::DEST_A, 7);
    let echo_back = echo_reply(A::DEST_A, A::EGRESS_A, 7);
    let big_out = big_udp(A::REMOTE_POD, 5000, A::DEST_A, 53);
    let big_back = big_udp(A::DEST_A, 53, A::EGRESS_A, 5000);
    let to_second = |prev: &[u8]| {
        let port = A::sport_of(prev);
        tcp(A::DEST_A, 443, A::EGRESS_A, port, TCP_ACK).build()
    };
    let peer = u.peer;
    let back = &[
        (SNAT_NEW, 1),
        (FORWARDED, 1),
        (REVERSE_NAT, 1),
        (RETURN_TUNNELED, 1),
    ];
    vec![
        case(
            "reply with an entry: reverse NAT, tunneled back to the pod's node",
            no_setup,
            vec![
                from_tunnel(peer, RULE_A, &fwd).forwarded_any(),
                from_secondary(&reply).redirected(&unnatted(&reply, A::REMOTE_POD, 40_000)),
            ],
            back,
        ),
        case(
            format!(
                "SYN-ACK into the tunnel: MSS clamped to tunnel_mtu - {}",
                A::MSS_OVERHEAD
            ),
            no_setup,
            vec![
                from_tunnel(peer, RULE_A, &fwd).forwarded_any(),
                from_secondary(&synack_in).redirected(&unnatted(
                    &synack_clamped,
                    A::REMOTE_POD,
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
                from_tunnel(peer, RULE_A, &fwd).forwarded_any(),
                from_tunnel(peer, RULE_A, &fwd.clone().src(A::REMOTE_POD2)).forwarded_any(),
                from_secondary(&reply)
                    .derive(to_second)
                    .redirected(&unnatted(&reply, A::REMOTE_POD2, 40_000)),
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
            move |dp, _| local_pod_to_a::<A>(dp, u.node),
            vec![
                from_pod(&local_fwd).forwarded_any(),
                from_secondary(&reply)
                    .redirected(&unnatted(&reply, A::LOCAL_POD, 40_000).macs(POD_MAC, POD0_MAC)),
            ],
            &[
                (LOCAL_GATEWAY, 1),
                (SNAT_NEW, 1),
                (FORWARDED, 2),
                (REVERSE_NAT, 1),
            ],
        ),
        case(
            "reply for a pod on this gateway bound to a veth: into the pod",
            move |dp, net: &Net<A>| {
                local_pod_to_a::<A>(dp, u.node);
                dp.pod_device_with(A::LOCAL_POD, net.pod0, REPLY_TO_PEER);
            },
            vec![
                from_pod(&local_fwd).forwarded_any(),
                from_secondary(&reply).redirected(&unnatted(&reply, A::LOCAL_POD, 40_000)),
            ],
            &[
                (LOCAL_GATEWAY, 1),
                (SNAT_NEW, 1),
                (FORWARDED, 2),
                (REVERSE_NAT, 1),
                (TO_POD_DEVICE, 1),
            ],
        ),
        case(
            format!(
                "{} echo reply: identifier restored, checksum fixed",
                A::ICMP
            ),
            no_setup,
            vec![
                from_tunnel(peer, RULE_A, &echo_out).forwarded_any(),
                from_secondary(&echo_back).redirected(&unnatted(&echo_back, A::REMOTE_POD, 7)),
            ],
            back,
        ),
        case(
            format!(
                "{}-byte UDP reply: reverse NAT checksum over the whole payload",
                A::BIG_PAYLOAD
            ),
            no_setup,
            vec![
                from_tunnel(peer, RULE_A, &big_out).forwarded_any(),
                from_secondary(&big_back).redirected(&unnatted(&big_back, A::REMOTE_POD, 5000)),
            ],
            back,
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
                from_secondary(&reply.clone().dst(A::SHARED_A)).passes(),
            ],
            &[(DROP_NOT_READY, 1)],
        ),
        case(
            format!("reply with {} 1 dropped", A::HOPS),
            no_setup,
            vec![
                from_tunnel(peer, RULE_A, &fwd).forwarded_any(),
                from_secondary(&reply.clone().hops(1)).dropped(),
            ],
            &[(SNAT_NEW, 1), (FORWARDED, 1), (DROP_TTL_EXCEEDED, 1)],
        ),
        case(
            "shared address (the interface's own), no entry: passes to the host",
            no_setup,
            vec![from_secondary(&reply.clone().dst(A::SHARED_A)).passes()],
            &[],
        ),
        case(
            "unrelated traffic passes untouched",
            no_setup,
            vec![
                from_secondary(&reply.clone().dst(A::UNRELATED_A)).passes(),
                from_secondary(&reply).raw(arp_frame()).passes(),
            ],
            &[],
        ),
    ]
}

/// An `interface:` rule translates to the gateway's own address, which a new gateway
/// cannot keep: a mid-stream TCP segment without a flow here (the flow began at another
/// gateway) is answered with a RST to the pod, so that it fails at once. Dedicated egress
/// IPs take such flows over, and SYNs, RSTs and other protocols are translated as before.
pub fn interface_rule_cases<A: Ip>(u: UnderlayNet) -> Vec<Case<Net<A>>> {
    let seg = A::Packet::new(
        A::REMOTE_POD,
        A::DEST_A,
        segment(40_000, 443, TCP_ACK | TCP_PSH),
    );
    let seg_opts = A::with_options(&seg);
    let fin = seg.clone().l4(segment(40_000, 443, TCP_FIN));
    let local = seg.clone().src(A::LOCAL_POD);
    // Pod ports inside the tests' --port-min/--port-max, which an interface's address
    // keeps (`PORT_MIN..=PORT_MAX`); `syn_a`'s 40,000 is outside it.
    let syn_a = tcp(A::REMOTE_POD, 40_000, A::DEST_A, 443, TCP_SYN);
    let syn_in = tcp(A::REMOTE_POD, 25_000, A::DEST_A, 443, TCP_SYN);
    let seg_in = seg.clone().l4(segment(25_000, 443, TCP_ACK | TCP_PSH));
    let rst_a = tcp(A::REMOTE_POD, 25_000, A::DEST_A, 443, TCP_RST | TCP_ACK);
    let udp_a = udp(A::REMOTE_POD, 25_053, A::DEST_A, 53);
    let shared = |p: &A::Packet, port| snatted(p, A::SHARED_A, port, SEC0_MAC, DEST_A_MAC);
    let shared_in_range = {
        let syn_a = syn_a.clone();
        move |out: &[u8]| {
            let port = A::sport_of(out);
            if !(PORT_MIN..=PORT_MAX).contains(&port) {
                return Err(format!("translated port {port}: outside the range"));
            }
            let want = snatted(&syn_a, A::SHARED_A, port, SEC0_MAC, DEST_A_MAC);
            crate::table::frame_diff(out, &want.build())
        }
    };
    let (peer, by_shared) = (u.peer, A::RULE_SHARED);
    vec![
        case(
            "mid-stream segment, no flow here: RST back through the tunnel, and no entry made",
            no_setup,
            vec![
                rst(from_tunnel(peer, by_shared, &seg), &seg),
                rst(from_tunnel(peer, by_shared, &seg), &seg),
            ],
            &[(RESET_MIDSTREAM, 2)],
        ),
        case(
            format!(
                "mid-stream segment with {}: those kept, TCP options and data cut",
                A::OPTIONS
            ),
            no_setup,
            vec![rst(from_tunnel(peer, by_shared, &seg_opts), &seg_opts)],
            &[(RESET_MIDSTREAM, 1)],
        ),
        case(
            "segment without ACK (a bare FIN): RST+ACK acknowledging its data and FIN",
            no_setup,
            vec![rst(from_tunnel(peer, by_shared, &fin), &fin)],
            &[(RESET_MIDSTREAM, 1)],
        ),
        case(
            "pod on this gateway: RST delivered to its device",
            move |dp, _| {
                A::selected(dp, A::LOCAL_POD);
                let fwd = A::forward(u.node, A::RULE_SHARED);
                A::policy(dp, A::LOCAL_POD, A::NET_A, A::NET_A_LEN, fwd);
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
                from_tunnel(peer, by_shared, &syn_in).redirected(&shared(&syn_in, 25_000)),
                from_tunnel(peer, by_shared, &seg_in).redirected(&shared(&seg_in, 25_000)),
            ],
            &[(SNAT_NEW, 1), (SNAT_HIT, 1), (FORWARDED, 2)],
        ),
        case(
            "pod port outside --port-min/--port-max: a port of the range (the interface's \
             address is the gateway's own sockets' too)",
            no_setup,
            vec![from_tunnel(peer, by_shared, &syn_a).redirected_if(shared_in_range)],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "RST without a flow: translated and sent on, never answered",
            no_setup,
            vec![from_tunnel(peer, by_shared, &rst_a).redirected(&shared(&rst_a, 25_000))],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "UDP without a flow: translated as before",
            no_setup,
            vec![from_tunnel(peer, by_shared, &udp_a).redirected(&shared(&udp_a, 25_053))],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
        case(
            "dedicated egress IP: the segment takes the flow over (new entry, same port)",
            no_setup,
            vec![from_tunnel(peer, RULE_A, &seg).redirected(&snatted(
                &seg,
                A::EGRESS_A,
                40_000,
                SEC0_MAC,
                DEST_A_MAC,
            ))],
            &[(SNAT_NEW, 1), (FORWARDED, 1)],
        ),
    ]
}

/// The entries a first packet REMOTE_POD:40000 -> DEST_A:443 (TCP, rule A) leaves behind.
pub fn from_tunnel_conntrack_entries<A: Ip>(u: UnderlayNet) {
    in_netns(move || {
        let (net, mut dp) = bed::<A>(u);
        let syn_a = tcp(A::REMOTE_POD, 40_000, A::DEST_A, 443, TCP_SYN);
        let o = dp.run(
            FROM_TUNNEL,
            &syn_a.build(),
            net.tun0,
            Some((u.peer, RULE_A)),
        );
        assert_eq!(o.verdict, TC_ACT_REDIRECT);
        let mut ct = A::ct(&mut dp);
        ct.sort_by_key(|(k, _)| A::ct_dir(k));
        let strip = |mut e: A::CtEntry| {
            assert_ne!(*A::last_seen(&mut e), 0);
            *A::last_seen(&mut e) = 0;
            let next_hop = A::next_hop(&mut e);
            if next_hop.ifindex != 0 {
                assert_ne!(next_hop.filled, 0);
                next_hop.filled = 0;
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
        let common = CtLike {
            state: state::NEW,
            pod_node: u.peer,
            ifindex: net.sec0,
            rule_id: RULE_A,
            last_seen_ns: 0,
            next_hop: NextHop::default(),
        };
        let original = CtLike {
            next_hop: learned,
            ..common
        };
        let (pod, dest, egress) = (A::REMOTE_POD, A::DEST_A, A::EGRESS_A);
        assert_eq!(
            got,
            vec![
                (
                    A::ct_key(pod, dest, (40_000, 443), 6, dir::ORIGINAL),
                    A::ct_entry(&original, egress, 40_000),
                ),
                (
                    A::ct_key(dest, egress, (443, 40_000), 6, dir::REPLY),
                    A::ct_entry(&common, pod, 40_000),
                ),
            ]
        );
    });
}

/// A gateway that takes egress IP A (back) may still hold entries of flows that ended
/// elsewhere (it was cut off while they moved, or never saw them close): established for
/// 6 h, closing for 30 s. A stream that arrives mid-way with its pod's port, which the far
/// end knows, takes that port from a flow silent both ways for 10 s (both its entries
/// go), never from one heard within that; a SYN (a new flow: no far end knows it yet)
/// takes none.
pub fn a_stream_taken_over_takes_its_port_from_a_silent_flow_only<A: Ip>(u: UnderlayNet) {
    in_netns(move || {
        let (net, mut dp) = bed::<A>(u);
        let (dest, egress) = (A::DEST_A, A::EGRESS_A);
        let like = |st, age_s| CtLike {
            state: st,
            pod_node: u.peer,
            ifindex: net.sec0,
            rule_id: RULE_A,
            last_seen_ns: if age_s == 0 { 0 } else { ktime_ago_ns(age_s) },
            next_hop: NextHop::default(),
        };
        let original = |pod, port: u16| A::ct_key(pod, dest, (port, 443), 6, dir::ORIGINAL);
        let reply = |port: u16| A::ct_key(dest, egress, (443, port), 6, dir::REPLY);
        // REMOTE_POD3's flows, left from before: silent 11 s, heard 3 s ago, closing and
        // silent 12 s.
        for (port, st, age_s) in [
            (40_000, state::ESTABLISHED, 11),
            (40_002, state::ESTABLISHED, 3),
            (40_004, state::CLOSING, 12),
        ] {
            let l = like(st, age_s);
            A::ct_insert(
                &mut dp,
                original(A::REMOTE_POD3, port),
                A::ct_entry(&l, egress, port),
            );
            A::ct_insert(&mut dp, reply(port), A::ct_entry(&l, A::REMOTE_POD3, port));
        }
        let mut send = |pod: A, sport: u16, flags: u8| {
            let p = tcp(pod, sport, dest, 443, flags);
            let o = dp.run(FROM_TUNNEL, &p.build(), net.tun0, Some((u.peer, RULE_A)));
            assert_eq!(o.verdict, TC_ACT_REDIRECT, "{pod}:{sport}");
            A::sport_of(&o.frame)
        };
        assert_eq!(send(A::REMOTE_POD, 40_000, TCP_ACK), 40_000);
        assert_ne!(
            send(A::REMOTE_POD, 40_002, TCP_ACK),
            40_002,
            "a flow heard 3 s ago lost its port"
        );
        assert_ne!(
            send(A::REMOTE_POD, 40_004, TCP_SYN),
            40_004,
            "a SYN took a port"
        );
        assert_eq!(send(A::REMOTE_POD2, 40_004, TCP_ACK), 40_004);

        // The far end's replies to each port reach the stream that holds it; the silent
        // flows' own entries are gone.
        let ct = A::ct(&mut dp);
        let reply_entry = |port| {
            let (_, mut e) = *ct
                .iter()
                .find(|(k, _)| *k == reply(port))
                .unwrap_or_else(|| panic!("no reply entry for port {port}"));
            *A::last_seen(&mut e) = 0;
            *A::state(&mut e) = state::NEW;
            e
        };
        for (port, pod) in [
            (40_000, A::REMOTE_POD),
            (40_002, A::REMOTE_POD3),
            (40_004, A::REMOTE_POD2),
        ] {
            assert_eq!(
                reply_entry(port),
                A::ct_entry(&like(state::NEW, 0), pod, port),
                "port {port}"
            );
        }
        let has = |k| ct.iter().any(|(key, _)| *key == k);
        assert!(!has(original(A::REMOTE_POD3, 40_000)));
        assert!(has(original(A::REMOTE_POD3, 40_002)));
        assert!(!has(original(A::REMOTE_POD3, 40_004)));
        assert_eq!(dp.counters().get(&SNAT_NEW), Some(&4));
    });
}

/// The next hop an established flow's packets take comes from its conntrack entry, not
/// from a FIB lookup per packet, until the agent bumps `NH_GEN` (a route or neighbour
/// change) or the cache is older than a second. The flow goes through router A (to
/// `FAR_NET` on sec0); the router's MAC changes under it.
pub fn an_established_flow_uses_its_cached_next_hop<A: Ip>(u: UnderlayNet) {
    in_netns(move || {
        const NEW_ROUTER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0xee];
        const POISON: [u8; 6] = [0x02, 0, 0, 0, 0xba, 0xd0];
        let (net, mut dp) = bed::<A>(u);
        dp.nh_gen(7);
        let send = |dp: &mut Datapath, flags: u8| {
            let p = tcp(A::REMOTE_POD, 40_000, A::DEST_FAR, 443, flags);
            let o = dp.run(FROM_TUNNEL, &p.build(), net.tun0, Some((u.peer, RULE_A)));
            assert_eq!(o.verdict, TC_ACT_REDIRECT);
            // The frame's destination and source MAC.
            (
                <[u8; 6]>::try_from(&o.frame[0..6]).unwrap(),
                <[u8; 6]>::try_from(&o.frame[6..12]).unwrap(),
            )
        };
        let original = |dp: &mut Datapath| {
            A::ct(dp)
                .into_iter()
                .find(|(k, _)| A::ct_dir(k) == dir::ORIGINAL)
                .expect("the flow's original entry")
        };
        // The first packet looks the route up and leaves the answer in the entry.
        assert_eq!(send(&mut dp, TCP_SYN), (ROUTER_A_MAC, SEC0_MAC));
        let (key, mut e) = original(&mut dp);
        let hop = *A::next_hop(&mut e);
        assert_eq!(
            (hop.dmac, hop.smac, hop.ifindex),
            (ROUTER_A_MAC, SEC0_MAC, net.sec0)
        );
        assert_eq!((hop.mtu, hop.generation), (1500, 7));
        // The router's MAC changes, and nobody says so: the flow keeps the cached one
        // (proof that no FIB lookup ran).
        ip(&format!(
            "{} neigh replace {} lladdr {} dev sec0 nud permanent",
            A::IP_FLAG,
            A::ROUTER_A,
            mac(NEW_ROUTER_MAC)
        ));
        assert_eq!(send(&mut dp, TCP_ACK), (ROUTER_A_MAC, SEC0_MAC));
        // The agent bumps the generation: the next packet looks again, and caches that.
        dp.nh_gen(8);
        assert_eq!(send(&mut dp, TCP_ACK), (NEW_ROUTER_MAC, SEC0_MAC));
        let (_, mut e) = original(&mut dp);
        let hop = *A::next_hop(&mut e);
        assert_eq!((hop.dmac, hop.generation), (NEW_ROUTER_MAC, 8));
        assert_eq!(send(&mut dp, TCP_ACK), (NEW_ROUTER_MAC, SEC0_MAC));
        // A cache of another generation, one older than a second, or one stamped ahead
        // of the clock by more than a jiffy (garbage), is never used.
        let now = ktime_ns();
        for (generation, filled_ns, case) in [
            (7, now, "older generation"),
            (8, now - 2_000_000_000, "filled 2 s ago"),
            (8, now + 2_000_000_000, "stamped 2 s ahead"),
        ] {
            let mut stale = e;
            let hop = A::next_hop(&mut stale);
            hop.dmac = POISON;
            hop.generation = generation;
            hop.filled = conntrack::stamp(filled_ns);
            A::ct_insert(&mut dp, key, stale);
            assert_eq!(send(&mut dp, TCP_ACK), (NEW_ROUTER_MAC, SEC0_MAC), "{case}");
        }
        // And a valid one is: the poisoned MAC goes out (the cache, not the FIB, decided).
        let mut cached = e;
        let hop = A::next_hop(&mut cached);
        hop.dmac = POISON;
        hop.filled = conntrack::stamp(ktime_ns());
        A::ct_insert(&mut dp, key, cached);
        assert_eq!(send(&mut dp, TCP_ACK), (POISON, SEC0_MAC));
    });
}

/// The 4 bytes after the checksum of "fragmentation needed" (unused, next-hop MTU) and of
/// "packet too big" (MTU): 1300.
pub const MTU_1300: [u8; 4] = [0, 0, 0x05, 0x14];

/// ICMP (ICMPv6) errors about translated flows, from the router on network A to the
/// egress IP: translated back to the pod, checksums valid, or dropped.
pub fn icmp_error_cases<A: Ip>(u: UnderlayNet) -> Vec<Case<Net<A>>> {
    let tcp_fwd = tcp(A::REMOTE_POD, 40_000, A::DEST_A, 443, TCP_ACK);
    let tcp_out = snatted(&tcp_fwd, A::EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC).build();
    let udp_fwd = udp(A::REMOTE_POD, 5000, A::DEST_A, 53);
    let udp_out = snatted(&udp_fwd, A::EGRESS_A, 5000, SEC0_MAC, DEST_A_MAC).build();
    let echo_fwd = echo(A::REMOTE_POD, A::DEST_A, 7);
    let echo_out = snatted(&echo_fwd, A::EGRESS_A, 7, SEC0_MAC, DEST_A_MAC).build();
    let local_fwd = tcp(A::LOCAL_POD, 40_000, A::DEST_A, 443, TCP_ACK);
    let local_out = snatted(&local_fwd, A::EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC).build();

    let (too_big_type, too_big_code, too_big_name) = A::TOO_BIG;
    let to_egress =
        |(kind, code): (u8, u8), rest, q: &[u8]| error_to(A::EGRESS_A, kind, code, rest, q);
    let too_big = quote(&tcp_out, A::L3_LEN + 8);
    let too_big_err = to_egress((too_big_type, too_big_code), MTU_1300, &too_big);
    let port_unreach = quote(&udp_out, udp_out.len() - 14);
    let port_unreach_err = to_egress(A::PORT_UNREACH, [0; 4], &port_unreach);
    let hops = quote(&echo_out, A::L3_LEN + 8);
    let hops_err = to_egress(A::TIME_EXCEEDED, [0; 4], &hops);
    let local = quote(&local_out, A::L3_LEN + 8);
    let local_err = to_egress((too_big_type, too_big_code), MTU_1300, &local);
    let truncated = quote(&tcp_out, A::L3_LEN + 4);
    let truncated_err = to_egress((too_big_type, too_big_code), MTU_1300, &truncated);
    let reply = tcp(A::DEST_A, 443, A::EGRESS_A, 40_000, TCP_ACK);
    // On the pod's node: the error as the gateway tunneled it back.
    let returned = error_back(&too_big_err, &too_big, A::LOCAL_POD, 40_000, 0);
    let flow = move |p: &A::Packet| from_tunnel(u.peer, RULE_A, p).forwarded_any();
    let xlated = &[
        (SNAT_NEW, 1),
        (FORWARDED, 1),
        (ICMP_ERROR_XLATED, 1),
        (RETURN_TUNNELED, 1),
    ];
    vec![
        case(
            format!("{too_big_name}, 8 bytes of TCP quoted: tunneled back to the pod's node"),
            no_setup,
            vec![
                flow(&tcp_fwd),
                from_secondary(&too_big_err).redirected_if(valid_error(&error_back(
                    &too_big_err,
                    &too_big,
                    A::REMOTE_POD,
                    40_000,
                    0,
                ))),
            ],
            xlated,
        ),
        case(
            "port unreachable about a UDP flow",
            no_setup,
            vec![
                flow(&udp_fwd),
                from_secondary(&port_unreach_err).redirected_if(valid_error(&error_back(
                    &port_unreach_err,
                    &port_unreach,
                    A::REMOTE_POD,
                    5000,
                    0,
                ))),
            ],
            xlated,
        ),
        case(
            "time exceeded about an echo request: identifier restored",
            no_setup,
            vec![
                flow(&echo_fwd),
                from_secondary(&hops_err).redirected_if(valid_error(&error_back(
                    &hops_err,
                    &hops,
                    A::REMOTE_POD,
                    7,
                    4,
                ))),
            ],
            xlated,
        ),
        case(
            "for a pod on this gateway: delivered to its device",
            move |dp, _| local_pod_to_a::<A>(dp, u.node),
            vec![
                from_pod(&local_fwd).forwarded_any(),
                from_secondary(&local_err).redirected_if(valid_error(
                    &error_back(&local_err, &local, A::LOCAL_POD, 40_000, 0)
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
            "on the pod's node: RETURN_VNI error delivered to the pod's device",
            no_setup,
            vec![
                from_tunnel(u.peer, RETURN_VNI, &returned)
                    .redirected(&returned.clone().macs(POD_MAC, POD0_MAC)),
            ],
            &[(RETURN_DELIVERED, 1)],
        ),
    ]
}

/// `--unknown-pods drop`: network A covered, with an except hole (`HOLE_A`), `LOCAL_POD`
/// selected and `UNSELECTED_POD` known.
pub fn unknown_pods_drop<A: Ip>(dp: &mut Datapath, net: &Net<A>) {
    dp.config(Config {
        flags: flags::READY | flags::UNKNOWN_PODS_DROP,
        ..config(net)
    });
    local_pod_to_a::<A>(dp, net.ul.peer);
    dp.known_pod(A::LOCAL_POD);
    dp.known_pod(A::UNSELECTED_POD);
    dp.covered(A::NET_A, A::NET_A_LEN, true);
    dp.covered(A::HOLE_A, A::HOLE_LEN, false);
}

/// A pod no Pod object announced, under `--unknown-pods drop` and without it.
pub fn unknown_pods_cases<A: Ip>() -> Vec<Case<Net<A>>> {
    let to_a = udp(A::UNKNOWN_POD, 40_000, A::DEST_A, 53);
    vec![
        case(
            "unknown pod to a covered destination: dropped, counted",
            unknown_pods_drop,
            vec![from_pod(&to_a).dropped()],
            &[(DROP_UNKNOWN_POD, 1)],
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
    ]
}

/// `LOCAL_POD` selected (network A through the peer) and bound to pod0, and
/// `UNSELECTED_POD` bound to pod1, as the agent binds pods to the devices it found them
/// behind (`POD_DEVICES_*`).
fn bound<A: Ip>(dp: &mut Datapath, net: &Net<A>) {
    local_pod_to_a::<A>(dp, net.ul.peer);
    dp.pod_device(A::LOCAL_POD, net.pod0);
    dp.pod_device(A::UNSELECTED_POD, net.pod1);
}

/// A pod cannot send as another pod of its node: a packet whose source address the agent
/// bound to another device is dropped (`DROP_SOURCE_DEVICE`) whatever its destination,
/// for selected pods always and for known pods under `--unknown-pods drop`; an address not
/// bound yet is treated as before the binding existed.
pub fn source_device_cases<A: Ip>() -> Vec<Case<Net<A>>> {
    let to_a = udp(A::LOCAL_POD, 40_000, A::DEST_A, 53);
    let as_unselected = to_a.clone().src(A::UNSELECTED_POD);
    let drop_mode = |dp: &mut Datapath, net: &Net<A>| {
        unknown_pods_drop(dp, net);
        bound(dp, net);
    };
    vec![
        case(
            "selected pod bound to its device: tunneled from it, dropped from another pod's",
            bound,
            vec![
                from_pod(&to_a).tunneled(),
                from_other_pod(&to_a).dropped(),
                // Whatever the destination: uncovered, or an except hole of its rule.
                from_other_pod(&to_a.clone().dst(A::INTERNET)).dropped(),
                from_other_pod(&to_a.clone().dst(A::HOLE_A)).dropped(),
            ],
            &[(TUNNELED, 1), (DROP_SOURCE_DEVICE, 3)],
        ),
        case(
            "selected pod not bound yet: tunneled from any device, as before the check",
            |dp: &mut Datapath, net: &Net<A>| local_pod_to_a::<A>(dp, net.ul.peer),
            vec![from_pod(&to_a).tunneled(), from_other_pod(&to_a).tunneled()],
            &[(TUNNELED, 2)],
        ),
        case(
            "--unknown-pods drop: a known pod bound to its device passes from it, is dropped \
             from another pod's (uncovered destination too); a selected one likewise",
            drop_mode,
            vec![
                from_other_pod(&as_unselected).passes(),
                from_pod(&as_unselected).dropped(),
                from_pod(&as_unselected.clone().dst(A::INTERNET)).dropped(),
                from_other_pod(&to_a).dropped(),
            ],
            &[(DROP_SOURCE_DEVICE, 3)],
        ),
        case(
            "--unknown-pods drop: a pod not bound yet follows the unknown-pod policy",
            unknown_pods_drop,
            vec![
                from_other_pod(&as_unselected).passes(),
                from_other_pod(&to_a.clone().src(A::UNKNOWN_POD)).dropped(),
            ],
            &[(DROP_UNKNOWN_POD, 1)],
        ),
        case(
            "--unknown-pods pass: an unselected pod is not checked (nothing redirects it)",
            bound,
            vec![from_pod(&as_unselected).passes()],
            &[],
        ),
    ]
}

/// A RST closes the whole flow on the gateway: both conntrack entries are reset, the
/// flow is over 10 s (`timeout::TCP_RESET`) after its last packet, whatever either entry
/// said before, and a new flow of the same tuple is made (`SNAT_NEW`); within those 10 s
/// a SYN of the same tuple reopens it (a reused tuple), and the handshake establishes it
/// again. Before, the RST reset only the entry it crossed, and the other kept the flow
/// (its SNAT port, its place under `--max-flows-per-pod`) for 6 hours.
pub fn a_reset_closes_both_entries<A: Ip>(u: UnderlayNet, reset_from_destination: bool) {
    in_netns(move || {
        let (net, mut dp) = bed::<A>(u);
        let peer = u.peer;
        let out = |flags: u8| tcp(A::REMOTE_POD, 40_000, A::DEST_A, 443, flags).build();
        let back = |flags: u8| tcp(A::DEST_A, 443, A::EGRESS_A, 40_000, flags).build();
        let mut send = |dp: &mut Datapath, from_pod_side: bool, f: Vec<u8>| {
            let o = if from_pod_side {
                dp.run(FROM_TUNNEL, &f, net.tun0, Some((peer, RULE_A)))
            } else {
                dp.run(egress_agent::ebpf::FROM_SECONDARY, &f, net.sec0, None)
            };
            assert_eq!(o.verdict, TC_ACT_REDIRECT, "{:?}", dp.counters());
        };
        let states = |dp: &mut Datapath| {
            let mut ct = A::ct(dp);
            assert_eq!(ct.len(), 2, "{ct:?}");
            ct.sort_by_key(|(k, _)| A::ct_dir(k));
            [*A::state(&mut ct[0].1), *A::state(&mut ct[1].1)]
        };
        let est = [state::ESTABLISHED; 2];
        let handshake = |dp: &mut Datapath, send: &mut dyn FnMut(&mut Datapath, bool, Vec<u8>)| {
            send(dp, true, out(TCP_SYN));
            send(dp, false, back(TCP_SYN | TCP_ACK));
            send(dp, true, out(TCP_ACK));
            send(dp, false, back(TCP_ACK));
        };
        handshake(&mut dp, &mut send);
        assert_eq!(states(&mut dp), est);

        // The RST, from either side: both entries reset.
        if reset_from_destination {
            send(&mut dp, false, back(TCP_RST));
        } else {
            send(&mut dp, true, out(TCP_RST | TCP_ACK));
        }
        assert_eq!(states(&mut dp), [state::RESET; 2], "after the RST");

        // The tuple reused within the timeout: the SYN and SYN-ACK reopen the entries.
        handshake(&mut dp, &mut send);
        assert_eq!(states(&mut dp), est, "a reused tuple, reopened");

        // Reset again, then 11 s of silence (the entries aged by hand): the flow is over,
        // and the next SYN of the tuple makes a new flow.
        send(&mut dp, false, back(TCP_RST));
        let old = ktime_ago_ns(11);
        for (k, mut e) in A::ct(&mut dp) {
            *A::last_seen(&mut e) = old;
            A::ct_insert(&mut dp, k, e);
        }
        send(&mut dp, true, out(TCP_SYN));
        assert_eq!(states(&mut dp), [state::NEW; 2], "a new flow");
        let c = dp.counters();
        assert_eq!(c.get(&SNAT_NEW), Some(&2), "{c:?}");
    });
}
