//! The ICMP errors the gateway answers a selected pod's packet with (issue 45, items 5
//! and 7): with sec0's MTU lowered to 1300, a packet of 1428 bytes is answered with
//! "fragmentation needed" (IPv4) or "packet too big" (IPv6); a packet whose TTL (hop
//! limit) would reach zero with "time exceeded". From the egress IP to the pod, quoting
//! the packet as the pod sent it, through the tunnel or out of a local pod's device;
//! never sent. The checks read the answer alone: its headers, both checksums, the quote,
//! and that a completion of the original transport checksum (what a device does to a
//! CHECKSUM_PARTIAL packet) would leave it as it is.

use std::net::IpAddr;

use egress_common::counters::reason::*;

use super::{
    Ip, Net, Packet, RULE_A, UnderlayNet, big_udp, from_pod, from_tunnel, local_pod_to_a, tcp, udp,
};
use crate::{
    packet::{L4, TCP_ACK, checksum},
    table::{Case, case, no_setup},
    testrun::{Datapath, ip},
};

/// sec0's MTU in these cases.
pub const MTU: u16 = 1300;

fn lower_mtu<A: Ip>(_: &mut Datapath, _: &Net<A>) {
    ip(&format!("link set sec0 mtu {MTU}"));
}

/// A TCP segment carrying the payload of [`big_udp`].
pub fn big_tcp<A: Ip>(src: A, sport: u16, dst: A, dport: u16) -> A::Packet {
    let L4::Udp { payload, .. } = big_udp(src, sport, dst, dport).transport().clone() else {
        unreachable!()
    };
    let mut l4 = L4::tcp(sport, dport, TCP_ACK);
    if let L4::Tcp { payload: p, .. } = &mut l4 {
        *p = payload;
    }
    A::Packet::new(src, dst, l4)
}

pub fn answer_cases<A: Ip>(u: UnderlayNet) -> Vec<Case<Net<A>>> {
    let (_, _, name) = A::TOO_BIG;
    let (hops, unselected) = (A::HOPS, A::REMOTE_UNSELECTED);
    let last_hop = tcp(A::REMOTE_POD, 40_000, A::DEST_A, 443, TCP_ACK).hops(1);
    let too_big = |p: &A::Packet| answer::<A>(p, Answer::TooBig);
    let big = big_udp(A::REMOTE_POD, 5000, A::DEST_A, 53);
    let big_seg = big_tcp(A::REMOTE_POD, 40_000, A::DEST_A, 443);
    let local = big_udp(A::LOCAL_POD, 5000, A::DEST_A, 53);
    let small = udp(A::REMOTE_POD, 5000, A::DEST_A, 53);
    let unresolved = big_udp(A::REMOTE_POD, 5000, A::DEST_A_NO_NEIGH, 53);
    let answered = &[(SNAT_NEW, 1), (FRAG_NEEDED_SENT, 1)];
    vec![
        case(
            format!("UDP over sec0's MTU: {name} tunneled back to the pod, never sent"),
            lower_mtu,
            vec![from_tunnel(u.peer, RULE_A, &big).redirected_if(too_big(&big))],
            answered,
        ),
        case(
            format!("TCP over sec0's MTU: {name}, the quote as the pod sent it"),
            lower_mtu,
            vec![from_tunnel(u.peer, RULE_A, &big_seg).redirected_if(too_big(&big_seg))],
            answered,
        ),
        case(
            format!("to a neighbour not resolved yet (the FIB measures nothing): {name}"),
            lower_mtu,
            vec![from_tunnel(u.peer, RULE_A, &unresolved).redirected_if(too_big(&unresolved))],
            answered,
        ),
        case(
            format!("an established flow's next hop cached, then a packet over the MTU: {name}"),
            lower_mtu,
            vec![
                from_tunnel(u.peer, RULE_A, &small).forwarded_any(),
                from_tunnel(u.peer, RULE_A, &big).redirected_if(too_big(&big)),
            ],
            &[
                (SNAT_NEW, 1),
                (SNAT_HIT, 1),
                (FORWARDED, 1),
                (FRAG_NEEDED_SENT, 1),
            ],
        ),
        case(
            format!("a pod on the gateway: {name} out of its own device"),
            move |dp, net| {
                lower_mtu(dp, net);
                local_pod_to_a::<A>(dp, u.node);
            },
            vec![from_pod(&local).redirected_if(too_big(&local))],
            &[(LOCAL_GATEWAY, 1), (SNAT_NEW, 1), (FRAG_NEEDED_SENT, 1)],
        ),
        case(
            format!("{hops} 1: time exceeded from the egress IP, no flow made"),
            no_setup,
            vec![
                from_tunnel(u.peer, RULE_A, &last_hop)
                    .redirected_if(answer::<A>(&last_hop, Answer::TimeExceeded)),
            ],
            &[(TIME_EXCEEDED_SENT, 1)],
        ),
        case(
            format!("{hops} 1 from a pod not admitted to the rule: dropped, no answer"),
            no_setup,
            vec![from_tunnel(u.peer, RULE_A, &last_hop.clone().src(unselected)).dropped()],
            &[(DROP_TTL_EXCEEDED, 1)],
        ),
        case(
            format!("a pod on the gateway, {hops} 1: time exceeded out of its own device"),
            move |dp, _| local_pod_to_a::<A>(dp, u.node),
            vec![
                from_pod(&last_hop.clone().src(A::LOCAL_POD)).redirected_if(answer::<A>(
                    &last_hop.clone().src(A::LOCAL_POD),
                    Answer::TimeExceeded,
                )),
            ],
            &[(LOCAL_GATEWAY, 1), (TIME_EXCEEDED_SENT, 1)],
        ),
    ]
}

/// Which answer a check expects.
#[derive(Clone, Copy)]
pub enum Answer {
    TooBig,
    TimeExceeded,
}

/// Checks that a frame is the answer `what` to `p`: see the module's documentation.
pub fn answer<A: Ip>(
    p: &A::Packet,
    what: Answer,
) -> impl Fn(&[u8]) -> Result<(), String> + Send + use<A> {
    let sent = p.build();
    let (pod, dst) = p.ends();
    let (kind, code, mtu) = match what {
        Answer::TooBig => (A::TOO_BIG.0, A::TOO_BIG.1, MTU),
        Answer::TimeExceeded => (A::TIME_EXCEEDED.0, A::TIME_EXCEEDED.1, 0),
    };
    move |f: &[u8]| {
        let pod: IpAddr = pod.into();
        let dst: IpAddr = dst.into();
        let egress: IpAddr = A::EGRESS_A.into();
        let (icmp_at, csum_start, quote, pseudo) = match pod {
            IpAddr::V4(_) => {
                let ip = f.get(14..74).ok_or("shorter than the IPv4 answer")?;
                expect("ethertype", &f[12..14], &[0x08, 0x00])?;
                expect("version and header length", &ip[..1], &[0x4f])?;
                expect(
                    "total length",
                    &ip[2..4],
                    &((f.len() - 14) as u16).to_be_bytes(),
                )?;
                expect("protocol", &ip[9..10], &[1])?;
                expect("source", &ip[12..16], &octets(egress))?;
                expect("destination", &ip[16..20], &octets(pod))?;
                expect("option", &ip[20..22], &[0x1e, 40])?;
                if checksum(&[ip]) != 0 {
                    return Err("IP header checksum".into());
                }
                // The quote is the packet as it arrived, byte for byte (of a shorter one,
                // as much as a fixed size takes, zero-padded).
                let q = f.get(82..146).ok_or("quote cut short")?;
                let n = [64, 48, 40, 28].into_iter().find(|n| *n <= sent.len() - 14);
                let mut want = sent[14..14 + n.unwrap_or(0)].to_vec();
                want.resize(64, 0);
                expect("quote", q, &want)?;
                (74, 34, q, Vec::new())
            }
            IpAddr::V6(_) => {
                let ip = f.get(14..54).ok_or("shorter than the IPv6 answer")?;
                expect("ethertype", &f[12..14], &[0x86, 0xdd])?;
                expect(
                    "payload length",
                    &ip[4..6],
                    &((f.len() - 54) as u16).to_be_bytes(),
                )?;
                expect("next header", &ip[6..7], &[60])?;
                expect("source", &ip[8..24], &octets(egress))?;
                expect("destination", &ip[24..40], &octets(pod))?;
                expect("options header", &f[54..58], &[58, 2, 0x1e, 20])?;
                // As the pod sent it: addresses, next header, ports.
                let q = f.get(86..150).ok_or("quote cut short")?;
                expect("quoted next header", &q[6..7], &sent[20..21])?;
                expect("quoted addresses", &q[8..40], &sent[22..54])?;
                expect("quoted ports", &q[40..44], &sent[54..58])?;
                let len = (f.len() - 78) as u32;
                let mut pseudo = octets(egress);
                pseudo.extend(octets(pod));
                pseudo.extend(len.to_be_bytes());
                pseudo.extend([0, 0, 0, 58]);
                (78, 54, q, pseudo)
            }
        };
        let icmp = &f[icmp_at..];
        expect("type and code", &icmp[..2], &[kind, code])?;
        let rest = match pod {
            IpAddr::V4(_) => icmp[6..8].to_vec(),
            IpAddr::V6(_) => icmp[4..8].to_vec(),
        };
        expect(
            "MTU",
            &rest,
            &u32::from(mtu).to_be_bytes()[4 - rest.len()..],
        )?;
        if checksum(&[&pseudo, icmp]) != 0 {
            return Err("ICMP checksum".into());
        }
        expect("quoted destination", &octets_at(quote, dst), &octets(dst))?;
        // What a device completing the original checksum writes: the complement of the
        // sum from csum_start, at the original protocol's checksum offset.
        let at = csum_start + if quote_proto(quote) == 17 { 6 } else { 16 };
        let completed = checksum(&[&f[csum_start..]]);
        let stays = &f[at..at + 2];
        if completed.to_be_bytes() != stays {
            return Err(format!(
                "a checksum completion would write {completed:04x} over {stays:02x?} at {at}"
            ));
        }
        Ok(())
    }
}

fn expect(what: &str, got: &[u8], want: &[u8]) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: {got:02x?}, want {want:02x?}"))
    }
}

fn octets(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// The quoted packet's destination, of `like`'s family.
fn octets_at(q: &[u8], like: IpAddr) -> Vec<u8> {
    match like {
        IpAddr::V4(_) => q[16..20].to_vec(),
        IpAddr::V6(_) => q[24..40].to_vec(),
    }
}

fn quote_proto(q: &[u8]) -> u8 {
    if q[0] >> 4 == 4 { q[9] } else { q[6] }
}
