//! GSO packets (issue 45, items 5 and 6), run with `gso_size` and `gso_segs` in the
//! test's `__sk_buff` as the kernel keeps them for a GRO aggregate or a TSO train: the
//! FIB's own MTU check lets every GSO packet through, so the datapath measures the
//! segments; and BIG TCP, whose length field is 0 (IPv4 `tot_len`, IPv6 `payload_len`),
//! is read as the rest of the skb instead of passing a selected pod's packet with its own
//! address (or a reply to an egress IP on to the host, which resets the flow).

use std::net::IpAddr;

use egress_agent::ebpf::{FROM_POD, FROM_SECONDARY, FROM_TUNNEL};
use egress_common::counters::reason::*;

use super::{
    DEST_A_MAC, Ip, Net, Packet, RULE_A, SEC0_MAC, UnderlayNet,
    answers::{Answer, MTU, answer, big_tcp},
    bed, local_pod_to_a, snatted, tcp,
};
use crate::{
    packet::{TCP_ACK, checksum},
    testrun::{Datapath, TC_ACT_REDIRECT, TC_ACT_SHOT, in_netns, ip},
};

/// The counters that moved since `before`, by how much.
fn counted(dp: &mut Datapath, before: &std::collections::BTreeMap<u32, u64>) -> Vec<(u32, u64)> {
    dp.counters()
        .into_iter()
        .filter(|(r, n)| before.get(r) != Some(n))
        .map(|(r, n)| (r, n - before.get(&r).copied().unwrap_or(0)))
        .collect()
}

/// A TSO train of 1,400 bytes through sec0 at 1,300 bytes: segments of 1,200 bytes are
/// forwarded (the flow's next hop cached), segments of 1,280 are answered with "too big"
/// from the cache's check and then the FIB's, never sent.
pub fn segments_measured<A: Ip>(u: UnderlayNet) {
    in_netns(move || {
        let (net, mut dp): (Net<A>, Datapath) = bed(u);
        ip(&format!("link set sec0 mtu {MTU}"));
        let seg = big_tcp(A::REMOTE_POD, 40_000, A::DEST_A, 443);
        let frame = seg.build();
        let tunnel = Some((u.peer, RULE_A));
        let before = dp.counters();
        let o = dp.run_gso(FROM_TUNNEL, &frame, net.tun0, tunnel, Some((1200, 2)));
        assert_eq!(o.verdict, TC_ACT_REDIRECT, "segments of 1,200 bytes");
        let want = snatted(&seg, A::EGRESS_A, 40_000, SEC0_MAC, DEST_A_MAC).build();
        assert_eq!(
            o.frame, want,
            "segments of 1,200 bytes: forwarded as translated"
        );
        assert_eq!(
            counted(&mut dp, &before),
            vec![(SNAT_NEW, 1), (FORWARDED, 1)]
        );
        let before = dp.counters();
        let o = dp.run_gso(FROM_TUNNEL, &frame, net.tun0, tunnel, Some((1280, 2)));
        assert_eq!(o.verdict, TC_ACT_REDIRECT, "segments of 1,280 bytes");
        answer::<A>(&seg, Answer::TooBig)(&o.frame).unwrap();
        assert_eq!(
            counted(&mut dp, &before),
            vec![(SNAT_HIT, 1), (FRAG_NEEDED_SENT, 1)]
        );
    });
}

/// `p`'s frame with its IP length field 0, as BIG TCP leaves it.
fn length_zero<A: Ip>(p: &A::Packet) -> Vec<u8> {
    let mut f = p.build();
    match A::LOCAL_POD.into() {
        IpAddr::V4(_) => {
            f[16..18].copy_from_slice(&[0, 0]);
            f[24..26].copy_from_slice(&[0, 0]);
            let c = checksum(&[&f[14..34]]);
            f[24..26].copy_from_slice(&c.to_be_bytes());
        }
        IpAddr::V6(_) => f[18..20].copy_from_slice(&[0, 0]),
    }
    f
}

/// BIG TCP from a selected IPv6 pod (its length field 0, a GSO train) is tunneled to its
/// gateway; the same bytes without GSO are malformed (dropped). (IPv4 BIG TCP from a pod
/// is not read by `from_pod`: README, "Limits".) A BIG TCP reply to the egress IP is
/// translated back to the pod, both families.
pub fn big_tcp_translated<A: Ip>(u: UnderlayNet) {
    in_netns(move || {
        let (net, mut dp): (Net<A>, Datapath) = bed(u);
        local_pod_to_a::<A>(&mut dp, u.peer);
        if matches!(A::LOCAL_POD.into(), IpAddr::V6(_)) {
            let out = length_zero::<A>(&tcp(A::LOCAL_POD, 40_000, A::DEST_A, 443, TCP_ACK));
            let before = dp.counters();
            let o = dp.run_gso(FROM_POD, &out, net.pod0, None, Some((1400, 46)));
            assert_eq!(o.verdict, TC_ACT_REDIRECT, "BIG TCP from a selected pod");
            assert_eq!(o.frame, out, "tunneled as it came");
            assert_eq!(counted(&mut dp, &before), vec![(TUNNELED, 1)]);
            let before = dp.counters();
            let o = dp.run(FROM_POD, &out, net.pod0, None);
            assert_eq!(o.verdict, TC_ACT_SHOT, "length 0 without GSO");
            assert_eq!(counted(&mut dp, &before), vec![(DROP_MALFORMED, 1)]);
        }

        // A flow through this gateway, then its BIG TCP reply.
        let fwd = tcp(A::REMOTE_POD, 40_000, A::DEST_A, 443, TCP_ACK);
        let tunnel = Some((u.peer, RULE_A));
        let o = dp.run(FROM_TUNNEL, &fwd.build(), net.tun0, tunnel);
        assert_eq!(o.verdict, TC_ACT_REDIRECT, "the flow's first packet");
        let reply = tcp(A::DEST_A, 443, A::EGRESS_A, 40_000, TCP_ACK).macs(SEC0_MAC, DEST_A_MAC);
        let before = dp.counters();
        let o = dp.run_gso(
            FROM_SECONDARY,
            &length_zero::<A>(&reply),
            net.sec0,
            None,
            Some((1400, 46)),
        );
        assert_eq!(
            o.verdict, TC_ACT_REDIRECT,
            "a BIG TCP reply to the egress IP"
        );
        assert_eq!(
            counted(&mut dp, &before),
            vec![(REVERSE_NAT, 1), (RETURN_TUNNELED, 1)]
        );
    });
}
