//! The properties every packet must keep, whatever its bytes. Read from the programs:
//!
//! * **Verdicts**: `TC_ACT_OK`, `TC_ACT_SHOT` or `TC_ACT_REDIRECT`, nothing else.
//! * **Counters add up**: a packet counts each reason at most once, with its length
//!   (before or after its rewrite) as bytes; and it ends in exactly one way. Reasons fall
//!   in four sets: *drops* (`DROP_*`, numbers from 32), *sent* ([`SENT`]: the one counter
//!   of a redirect), *passed* ([`PASSED`]: a pass that is counted) and *on the way*
//!   ([`ON_THE_WAY`]: steps counted before the end). A dropped packet counts exactly one
//!   drop and nothing sent or passed; a redirected one exactly one sent and no drop; a
//!   passed one no drop, nothing sent, nothing on the way and at most one passed reason
//!   (a miss passes uncounted: that costs nothing on a node's fast path).
//! * **A pass is never rewritten**: a passed packet leaves byte for byte as it came.
//! * **Untouched where nothing is ours**: from an unselected pod (or a frame with no IP
//!   source), to a destination outside the pod's rules, and on a secondary interface to
//!   an address that is no egress IP, a packet passes unchanged and uncounted.
//! * **Redirects go where a rule allows**: `BPF_PROG_TEST_RUN` does not say which ifindex
//!   a redirect chose, so it is read from what the program left: the counted reason
//!   (`TUNNELED`, `RETURN_TUNNELED` and RSTs to remote pods redirect only to the
//!   configured tunnel device) and the frame (a FIB redirect writes the chosen device's
//!   MAC as the source: it must be the MAC of the rule's interface, or of the pod device
//!   for a reply delivered here; a redirect waiting for a neighbour keeps the MACs, and
//!   then the node's routes must take the destination out of the rule's interface).
//!   A tunneled packet needs a policy entry that forwards to a remote gateway; a packet
//!   forwarded by the gateway path leaves from an egress IP of a rule served here (of its
//!   own rule for a new flow, which its pod must be admitted to); only known nodes get
//!   anything redirected from the tunnel, only for pods of theirs, and replies only reach
//!   pods of this node; RSTs answer only `interface:` rules' mid-stream segments, and a
//!   packet too big for its interface or at its last hop is answered only to its sender,
//!   from an egress IP of this node, quoting it, its ICMP checksum right.
//! * **Around the CNI only for replies of ours**: a packet goes into a pod through its
//!   device (`TO_POD_DEVICE`, past what the node's routing would hand it to: the CNI's
//!   switch and its ACLs) only when it is a reply to the pod bound with
//!   `REPLY_TO_PEER`: from the tunnel, to that pod, from the gateway its policy sends the
//!   reply's source through; on a secondary interface, translated back by conntrack. And
//!   every such reply does go that way.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use egress_common::{
    counters::{self, reason::*},
    policy::{RETURN_VNI, action},
};

use super::{
    cases::{Input, Prog, min_len},
    mutate::{transport, transport_offset},
    node::{self, Dev, NODE, Plan},
};
use crate::testrun::{TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC};

/// Counted when a packet was redirected: exactly one per redirect.
pub const SENT: &[u32] = &[
    TUNNELED,
    RETURN_TUNNELED,
    RETURN_DELIVERED,
    FORWARDED,
    RESET_MIDSTREAM,
    FRAG_NEEDED_SENT,
    TIME_EXCEEDED_SENT,
];
/// Counted when a packet passed: at most one per pass.
pub const PASSED: &[u32] = &[EXCLUDED, FALLTHROUGH, MALFORMED_PASSED];
/// Counted on the way to a redirect or a drop.
pub const ON_THE_WAY: &[u32] = &[
    LOCAL_GATEWAY,
    SNAT_NEW,
    SNAT_HIT,
    REVERSE_NAT,
    MSS_CLAMPED,
    ICMP_ERROR_XLATED,
    TO_POD_DEVICE,
];

/// What a program did with one packet.
pub struct Seen<'a> {
    pub verdict: u32,
    pub out: &'a [u8],
    /// (reason, packets, bytes) of every reason that moved.
    pub delta: &'a [(u32, u64, u64)],
}

impl Seen<'_> {
    fn hit(&self, reason: u32) -> bool {
        self.delta.iter().any(|d| d.0 == reason)
    }

    fn sent(&self) -> Option<u32> {
        self.delta.iter().map(|d| d.0).find(|r| SENT.contains(r))
    }
}

type Check = Result<(), String>;

fn must(ok: bool, problem: impl FnOnce() -> String) -> Check {
    if ok { Ok(()) } else { Err(problem()) }
}

pub fn reason_name(r: u32) -> String {
    counters::name(r).map_or_else(|| format!("#{r}"), str::to_owned)
}

pub fn verdict_name(v: u32) -> &'static str {
    match v {
        TC_ACT_OK => "pass",
        TC_ACT_SHOT => "drop",
        TC_ACT_REDIRECT => "redirect",
        _ => "unknown",
    }
}

/// Every property of one packet; `Err` names the one broken.
pub fn check(prog: Prog, input: &Input, seen: &Seen) -> Check {
    let per_program: fn(&Input, &Seen) -> Check = match prog {
        Prog::FromPod => from_pod,
        Prog::FromTunnel => from_tunnel,
        Prog::FromSecondary => from_secondary,
        // Its own verdicts (it passes on what is not its own), then `from_tunnel`'s.
        Prog::FromUnderlay => return from_underlay(input, seen),
    };
    must(
        matches!(seen.verdict, TC_ACT_OK | TC_ACT_SHOT | TC_ACT_REDIRECT),
        || {
            format!(
                "verdict {}: not pass, drop or redirect",
                seen.verdict as i32
            )
        },
    )?;
    counted_once(input, seen)?;
    ends_one_way(seen)?;
    if seen.verdict == TC_ACT_OK {
        must(seen.out == input.frame.as_slice(), || {
            "passed, but rewritten".to_owned()
        })?;
    }
    if seen.verdict == TC_ACT_REDIRECT && checksums_right(&input.frame) == Some(true) {
        must(checksums_right(seen.out) == Some(true), || {
            "redirected with a wrong checksum a packet whose checksums were right".to_owned()
        })?;
    }
    if seen.hit(TO_POD_DEVICE) {
        must(
            matches!(prog, Prog::FromTunnel | Prog::FromSecondary)
                && matches!(seen.sent(), Some(RETURN_DELIVERED | FORWARDED)),
            || {
                format!(
                    "into a pod's device from {}, sent as {}",
                    prog.name(),
                    reason_name(seen.sent().unwrap_or(0))
                )
            },
        )?;
    }
    per_program(input, seen)
}

fn counted_once(input: &Input, seen: &Seen) -> Check {
    for &(r, packets, bytes) in seen.delta {
        must(counters::name(r).is_some() && r != CT_EXPIRED, || {
            format!("counted {}, which no program may count", reason_name(r))
        })?;
        must(packets == 1, || {
            format!("counted {} {packets} times", reason_name(r))
        })?;
        let lens = [input.frame.len() as u64, seen.out.len() as u64];
        must(lens.contains(&bytes), || {
            format!(
                "counted {} with {bytes} bytes, not the packet's {} (in) or {} (out)",
                reason_name(r),
                lens[0],
                lens[1]
            )
        })?;
    }
    Ok(())
}

fn ends_one_way(seen: &Seen) -> Check {
    let n = |set: &dyn Fn(u32) -> bool| seen.delta.iter().filter(|d| set(d.0)).count();
    let drops = n(&|r| counters::is_drop(r));
    let sent = n(&|r| SENT.contains(&r));
    let passed = n(&|r| PASSED.contains(&r));
    let on_the_way = n(&|r| ON_THE_WAY.contains(&r));
    if let Some(&(r, ..)) = seen.delta.iter().find(|d| {
        !counters::is_drop(d.0)
            && !SENT.contains(&d.0)
            && !PASSED.contains(&d.0)
            && !ON_THE_WAY.contains(&d.0)
    }) {
        return Err(format!(
            "counted {}, which fuzz::check does not classify: add it to SENT, PASSED or ON_THE_WAY",
            reason_name(r)
        ));
    }
    let ok = match seen.verdict {
        TC_ACT_SHOT => drops == 1 && sent == 0 && passed == 0,
        TC_ACT_REDIRECT => sent == 1 && drops == 0 && passed == 0,
        _ => drops == 0 && sent == 0 && passed <= 1 && on_the_way == 0,
    };
    must(ok, || {
        format!(
            "a {} counted {drops} drop, {sent} sent, {passed} passed and {on_the_way} on-the-way reasons",
            verdict_name(seen.verdict)
        )
    })
}

// ---- addresses of a frame ----

fn ip_at(f: &[u8], off: usize, v4: bool) -> Option<IpAddr> {
    if v4 {
        let b: [u8; 4] = f.get(off..off + 4)?.try_into().ok()?;
        Some(IpAddr::V4(Ipv4Addr::from(b)))
    } else {
        let b: [u8; 16] = f.get(off..off + 16)?.try_into().ok()?;
        Some(IpAddr::V6(Ipv6Addr::from(b)))
    }
}

/// Whether the frame says IPv4 (`Some(true)`), IPv6 (`Some(false)`) or neither.
fn family(f: &[u8]) -> Option<bool> {
    match f.get(12..14)? {
        [0x08, 0x00] => Some(true),
        [0x86, 0xdd] => Some(false),
        _ => None,
    }
}

/// The source address, where the programs read it (without parsing the rest).
fn src_of(f: &[u8]) -> Option<IpAddr> {
    let v4 = family(f)?;
    ip_at(f, if v4 { 26 } else { 22 }, v4)
}

/// Source and destination, when the frame holds a whole IP header's worth of them.
fn addrs(f: &[u8]) -> Option<(IpAddr, IpAddr)> {
    let v4 = family(f)?;
    let (s, d) = if v4 { (26, 30) } else { (22, 38) };
    Some((ip_at(f, s, v4)?, ip_at(f, d, v4)?))
}

fn quiet(seen: &Seen, why: &str) -> Check {
    must(seen.verdict == TC_ACT_OK && seen.delta.is_empty(), || {
        format!("{why}: must pass untouched and uncounted")
    })
}

// ---- per program ----

/// `from_underlay`: what it does not decapsulate goes on as it came, uncounted (to the
/// stack and the tunnel device, which decapsulate it as before), and what it does
/// decapsulate was ours and whole ([`vxlan_ours`]): then the inner packet is held to
/// `from_tunnel`'s properties, with the sender and VNI of the headers removed. A frame
/// that is ours is decapsulated, unless the kernel cannot (before Linux 6.3) or it is a
/// GSO packet (whose tunnel GSO state only the device clears).
fn from_underlay(input: &Input, seen: &Seen) -> Check {
    let f = &input.frame;
    let ours = vxlan_ours(f) && input.gso.is_none() && kernel_decapsulates();
    if seen.verdict == TC_ACT_UNSPEC {
        must(seen.out == f.as_slice(), || {
            "passed on, but rewritten".to_owned()
        })?;
        must(seen.delta.is_empty(), || {
            "passed on, but counted".to_owned()
        })?;
        return must(!ours, || {
            "passed on a whole VXLAN frame of ours to the device".to_owned()
        });
    }
    must(ours, || {
        format!(
            "{} a frame that is not a whole VXLAN frame of ours (GSO {:?})",
            verdict_name(seen.verdict),
            input.gso
        )
    })?;
    let sender = Ipv4Addr::new(f[26], f[27], f[28], f[29]);
    let vni = u32::from_be_bytes([f[46], f[47], f[48], f[49]]) >> 8;
    // What `from_tunnel`'s paths are given: the outer Ethernet addresses (the headers
    // removed are those after them) with the inner ethertype, then the inner packet.
    let mut frame = f[..12].to_vec();
    frame.extend_from_slice(&f[62..]);
    let inner = Input {
        frame,
        dev: Dev::Tunnel,
        tunnel: Some((sender.into(), vni)),
        kind: input.kind,
        gso: None,
    };
    if inner.frame.len() < min_len(&inner.frame) {
        // Shorter than its IP header: `from_tunnel` drops it as malformed.
        must(seen.verdict == TC_ACT_SHOT, || {
            "an inner packet shorter than its IP header, not dropped".to_owned()
        })?;
        counted_once(&inner, seen)?;
        return ends_one_way(seen);
    }
    check(Prog::FromTunnel, &inner, seen)
}

/// Whether `f` is VXLAN to this node's tunnel port as the stack would take it: IPv4
/// without options or fragmentation, to this node's address, its header checksum right
/// and its lengths the frame's, VXLAN flags the VNI's alone, and an inner IPv4 or IPv6
/// frame (the UDP checksum, which the datapath leaves unverified, may be anything).
fn vxlan_ours(f: &[u8]) -> bool {
    use egress_common::config::DEFAULT_TUNNEL_PORT;
    let be16 = |i: usize| usize::from(u16::from_be_bytes([f[i], f[i + 1]]));
    let IpAddr::V4(node) = NODE else {
        return false;
    };
    f.len() >= 64
        && be16(12) == 0x0800
        && f[14] == 0x45
        && be16(20) & 0x3fff == 0
        && f[23] == 17
        && f[30..34] == node.octets()
        && crate::packet::checksum(&[&f[14..34]]) == 0
        && be16(16) + 14 == f.len()
        && be16(38) + 20 == be16(16)
        && be16(36) == usize::from(DEFAULT_TUNNEL_PORT)
        && f[42] == 0x08
        && f[43..46] == [0, 0, 0]
        && f[49] == 0
        && matches!(be16(62), 0x0800 | 0x86dd)
}

/// Whether `bpf_skb_adjust_room` takes the decapsulation flags (Linux 6.3) that
/// `from_underlay` uses; before, it passes every frame on.
fn kernel_decapsulates() -> bool {
    use aya::util::KernelVersion;
    KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 3, 0))
}

fn from_pod(input: &Input, seen: &Seen) -> Check {
    let f = &input.frame;
    let Some(src) = src_of(f) else {
        return quiet(seen, "a frame without an IP source");
    };
    let plan = node::plan(src);
    if !plan.selected(src) {
        return quiet(seen, "from an unselected pod");
    }
    if input.dev == Dev::Pod1 {
        // The selected pod is bound to `Pod`: whatever the packet, it is dropped here.
        return must(
            seen.verdict == TC_ACT_SHOT && seen.hit(DROP_SOURCE_DEVICE),
            || {
                "a selected pod's address sent from another pod's device: not dropped as DROP_SOURCE_DEVICE".to_owned()
            },
        );
    }
    let policy = addrs(f).and_then(|(_, dst)| plan.policy(src, dst));
    let Some(p) = policy.filter(|p| p.action != action::EXCLUDE) else {
        return must(seen.verdict == TC_ACT_OK, || {
            "outside the pod's rules (or excluded): must pass".to_owned()
        });
    };
    if p.action == action::NO_GATEWAY_PASS {
        return must(seen.verdict == TC_ACT_OK, || {
            "Fallthrough: must pass".to_owned()
        });
    }
    if p.action == action::DENY {
        // Never sent on; dropped as DROP_NETWORK_POLICY, unless it is not the datapath's
        // to judge (malformed, or IPv6 link-scoped): then the host's, like any pass.
        must(seen.verdict != TC_ACT_REDIRECT, || {
            "denied by NetworkPolicy, but redirected".to_owned()
        })?;
        return must(
            seen.hit(DROP_NETWORK_POLICY)
                || seen.hit(MALFORMED_PASSED)
                || (seen.verdict == TC_ACT_OK && seen.delta.is_empty()),
            || {
                "denied by NetworkPolicy: must drop as DROP_NETWORK_POLICY (or pass as \
                 malformed)"
                    .to_owned()
            },
        );
    }
    if seen.hit(SNAT_NEW) {
        must(plan.admitted(src, p.rule), || {
            format!(
                "a new flow of {src}, which is not admitted for rule {}",
                p.rule
            )
        })?;
    }
    if seen.verdict == TC_ACT_OK {
        return covered_pass(f, seen);
    }
    if seen.verdict != TC_ACT_REDIRECT {
        return Ok(());
    }
    must(p.action == action::FORWARD, || {
        format!("redirected under a policy entry with action {}", p.action)
    })?;
    if p.filter != 0 {
        allowed_by_filter(f)?;
    }
    let local = p.gateway == NODE;
    match seen.sent() {
        Some(TUNNELED) => {
            must(!local, || {
                "tunneled, but this node is the rule's gateway".to_owned()
            })?;
            tunneled_as_sent(input, seen)
        }
        Some(FORWARDED) if local => {
            let new_rule = seen.hit(SNAT_NEW).then_some(p.rule);
            out_of_the_rules_interface(input, seen, plan, new_rule)
        }
        Some(RESET_MIDSTREAM) if local => reset_for_shared_rule(input, seen, plan, p.rule),
        Some(r @ (FRAG_NEEDED_SENT | TIME_EXCEEDED_SENT)) if local => {
            icmp_answer(input, seen, plan, r)
        }
        other => Err(format!(
            "redirected as {} under a rule whose gateway is {}",
            reason_name(other.unwrap_or(0)),
            p.gateway
        )),
    }
}

/// A selected pod's packet to a destination its rule covers (forwarded, or dropped for
/// want of a gateway) never passes with the pod's own address, but for what the datapath
/// leaves to the node by design: a frame it could not parse (counted `MALFORMED_PASSED`),
/// one whose IP version is not its ethertype's, a link-scoped destination (IPv4
/// link-local, multicast, broadcast; IPv6 link-local, multicast), IPv6 neighbour
/// discovery.
fn covered_pass(f: &[u8], seen: &Seen) -> Check {
    let v4 = family(f) == Some(true);
    let version_matches = f.get(14).is_some_and(|b| b >> 4 == if v4 { 4 } else { 6 });
    let link_scoped = match addrs(f).map(|(_, d)| d) {
        Some(IpAddr::V4(d)) => d.octets()[0] >= 224 || d.octets()[..2] == [169, 254],
        Some(IpAddr::V6(d)) => d.octets()[0] == 0xff || d.segments()[0] & 0xffc0 == 0xfe80,
        None => true,
    };
    let ndp = !v4
        && transport(f).is_some_and(|(proto, off)| {
            proto == 58 && f.get(off).is_some_and(|t| (133..=137).contains(t))
        });
    must(
        seen.hit(MALFORMED_PASSED) || !version_matches || link_scoped || ndp,
        || {
            "a selected pod's packet to a covered destination passed with its own address"
                .to_owned()
        },
    )
}

/// A redirected packet under a port-filtered entry ([`node::PORT_FILTER`]): its protocol
/// and destination port are among the filter's ranges (no packet past its pod's egress
/// NetworkPolicy leaves the node).
fn allowed_by_filter(f: &[u8]) -> Check {
    let (proto, off) = transport(f).ok_or("redirected a frame without a transport header")?;
    let dport = f
        .get(off + 2..off + 4)
        .map(|b| u16::from_be_bytes([b[0], b[1]]))
        .ok_or("no destination port")?;
    must(
        node::PORT_FILTER_RANGES
            .iter()
            .any(|(p, a, b)| *p == proto && (*a..=*b).contains(&dport)),
        || {
            format!(
                "redirected protocol {proto} port {dport} under a filter allowing only {:?}",
                node::PORT_FILTER_RANGES
            )
        },
    )
}

fn from_tunnel(input: &Input, seen: &Seen) -> Check {
    let f = &input.frame;
    if family(f).is_none() {
        return quiet(seen, "not IP");
    }
    let (sender, vni) = input
        .tunnel
        .expect("from_tunnel cases carry tunnel metadata");
    let addrs = addrs(f);
    if seen.hit(SNAT_NEW) {
        let (src, _) = addrs.ok_or("a new flow of a frame without addresses")?;
        must(node::plan(src).admitted(src, vni), || {
            format!("a new flow of {src}, which is not admitted for rule {vni}")
        })?;
    }
    if seen.verdict != TC_ACT_REDIRECT {
        return Ok(());
    }
    must(node::NODES.contains(&sender), || {
        format!("redirected a packet that {sender}, not a node, tunneled")
    })?;
    let (src, dst) = addrs.ok_or("redirected a frame without addresses")?;
    let plan = node::plan(src);
    if vni == RETURN_VNI {
        must(plan.owner(dst) == Some(NODE), || {
            format!("delivered a reply to {dst}, not a pod of this node")
        })?;
        must(seen.sent() == Some(RETURN_DELIVERED), || {
            format!(
                "a reply redirected as {}",
                reason_name(seen.sent().unwrap_or(0))
            )
        })?;
        // Around the CNI only from the gateway that the pod's policy sends the reply's
        // source through (the tunnel is not authenticated: anything else is routed).
        let from_its_gateway = plan
            .policy(dst, src)
            .is_some_and(|p| p.action == action::FORWARD && p.gateway == sender);
        into_the_pod(seen, from_its_gateway && dst == plan.local_pod, || {
            format!("a reply from {src} to {dst} that {sender} tunneled")
        })?;
        return delivered_to_pod(input, seen, plan, dst);
    }
    must(plan.owner(src) == Some(sender), || {
        format!("redirected a packet from {src} that {sender}, not its node, tunneled")
    })?;
    match seen.sent() {
        Some(FORWARDED) => {
            let new_rule = seen.hit(SNAT_NEW).then_some(vni);
            out_of_the_rules_interface(input, seen, plan, new_rule)
        }
        Some(RESET_MIDSTREAM) => reset_for_shared_rule(input, seen, plan, vni),
        Some(r @ (FRAG_NEEDED_SENT | TIME_EXCEEDED_SENT)) => icmp_answer(input, seen, plan, r),
        other => Err(format!(
            "a tunneled packet of rule {vni} redirected as {}",
            reason_name(other.unwrap_or(0))
        )),
    }
}

fn from_secondary(input: &Input, seen: &Seen) -> Check {
    let Some((src, dst)) = addrs(&input.frame) else {
        return quiet(seen, "a frame without IP addresses");
    };
    let plan = node::plan(dst);
    if plan.egress_ip(dst).is_none() {
        return quiet(seen, "not to an egress IP");
    }
    if seen.verdict != TC_ACT_REDIRECT {
        return Ok(());
    }
    let (osrc, pod) = addrs(seen.out).ok_or("redirected a frame without addresses")?;
    must(osrc == src, || {
        format!("a reply's source changed: {src} -> {osrc}")
    })?;
    let owner = plan.owner(pod);
    match seen.sent() {
        Some(FORWARDED) => {
            must(owner == Some(NODE), || {
                format!("delivered here to {pod}, not a pod of this node")
            })?;
            into_the_pod(seen, pod == plan.local_pod, || {
                format!("a reply from {src} translated back to {pod}")
            })?;
            delivered_to_pod(input, seen, plan, pod)
        }
        Some(RETURN_TUNNELED) => must(owner.is_some_and(|n| n != NODE), || {
            format!("tunneled back to {pod}, not a pod of another node")
        }),
        other => Err(format!(
            "a reply redirected as {}",
            reason_name(other.unwrap_or(0))
        )),
    }
}

// ---- where redirects go ----

/// Into the tunnel as it came, but for a SYN's MSS (in the TCP header).
fn tunneled_as_sent(input: &Input, seen: &Seen) -> Check {
    let (a, b) = (&input.frame, seen.out);
    if !seen.hit(MSS_CLAMPED) {
        return must(a == b, || "tunneled, but rewritten".to_owned());
    }
    let l4 = transport_offset(a).unwrap_or(0);
    let outside_tcp =
        (0..a.len().max(b.len())).any(|i| (i < l4 || i >= l4 + 60) && a.get(i) != b.get(i));
    must(!outside_tcp, || {
        "MSS clamped, but bytes outside the TCP header changed".to_owned()
    })
}

/// The source MAC a FIB redirect wrote, if it wrote one.
fn fib_source_mac<'a>(input: &Input, seen: &'a Seen) -> Option<&'a [u8]> {
    let out = seen.out.get(6..12)?;
    (Some(out) != input.frame.get(6..12)).then_some(out)
}

/// Left by the gateway path: from an egress IP of a rule served here (of `new_rule`, for
/// a new flow), to the same destination, out of that rule's interface.
fn out_of_the_rules_interface(
    input: &Input,
    seen: &Seen,
    plan: &Plan,
    new_rule: Option<u32>,
) -> Check {
    let (_, dst) = addrs(&input.frame).ok_or("forwarded a frame without addresses")?;
    let (egress, odst) = addrs(seen.out).ok_or("forwarded as a frame without addresses")?;
    must(mtu_fit(input) != Some(false), || {
        format!(
            "forwarded a packet of {} bytes (GSO {:?}) that the 1,500-byte interface does not carry",
            input.frame.len(),
            input.gso
        )
    })?;
    must(odst == dst, || {
        format!("forwarded to {odst}, sent to {dst}")
    })?;
    if let Some(r) = new_rule {
        must(plan.rule(r).map(|r| r.egress) == Some(egress), || {
            format!("a new flow of rule {r} left from {egress}, not the rule's egress IP")
        })?;
    }
    let devs: Vec<Dev> = plan
        .rules_by_egress(egress)
        .map(|r| r.dev)
        .filter(|d| plan.routes_via(dst, *d))
        .collect();
    must(!devs.is_empty(), || {
        format!("forwarded from {egress} to {dst}: no rule with that egress IP routes there")
    })?;
    if let Some(m) = fib_source_mac(input, seen) {
        must(devs.iter().any(|d| node::mac(*d) == m), || {
            format!(
                "forwarded from {egress} out of the interface with MAC {m:02x?}, not its rule's"
            )
        })?;
    }
    Ok(())
}

/// Into the pod through its device (`TO_POD_DEVICE`) exactly when `should`: a reply of
/// ours to the pod bound with `REPLY_TO_PEER`.
fn into_the_pod(seen: &Seen, should: bool, what: impl FnOnce() -> String) -> Check {
    let went = seen.hit(TO_POD_DEVICE);
    must(went == should, || {
        if went {
            format!("{} went into the pod around the CNI", what())
        } else {
            format!("{} was routed, not put into the pod", what())
        }
    })
}

/// Delivered to `pod`, a pod of this node, through the pod device.
fn delivered_to_pod(input: &Input, seen: &Seen, plan: &Plan, pod: IpAddr) -> Check {
    let (_, odst) = addrs(seen.out).ok_or("delivered a frame without addresses")?;
    must(odst == pod && plan.routes_via(pod, Dev::Pod), || {
        format!("delivered to {odst}, not through the pod device to {pod}")
    })?;
    if let Some(m) = fib_source_mac(input, seen) {
        must(m == node::mac(Dev::Pod), || {
            format!("delivered out of the interface with MAC {m:02x?}, not the pod device")
        })?;
    }
    Ok(())
}

/// A RST from the destination to the pod, for an `interface:` rule only.
fn reset_for_shared_rule(input: &Input, seen: &Seen, plan: &Plan, rule: u32) -> Check {
    let shared = plan.rule(rule).and_then(|r| plan.egress_ip(r.egress));
    must(shared == Some(true), || {
        format!("a RST for rule {rule}, which is not an interface: rule")
    })?;
    let (src, dst) = addrs(&input.frame).ok_or("a RST for a frame without addresses")?;
    let (osrc, odst) = addrs(seen.out).ok_or("a RST without addresses")?;
    must(osrc == dst && odst == src, || {
        format!("a RST from {osrc} to {odst} answering {src} -> {dst}")
    })?;
    let flags = transport_offset(seen.out).and_then(|o| seen.out.get(o + 13));
    must(flags.is_some_and(|f| f & 0x04 != 0), || {
        "a RST without the RST flag".to_owned()
    })
}

/// The ICMP error the gateway answers a packet with (`sent`): "fragmentation needed"
/// (ICMPv6: "packet too big") for one too big for its egress interface, "time exceeded"
/// for one whose TTL (hop limit) was 1 or less; to the packet's source from an egress IP
/// of this node, quoting the packet's destination, its ICMP checksum right.
fn icmp_answer(input: &Input, seen: &Seen, plan: &Plan, sent: u32) -> Check {
    let (src, dst) = addrs(&input.frame).ok_or("an answer to a frame without addresses")?;
    let (osrc, odst) = addrs(seen.out).ok_or("an answer without addresses")?;
    must(odst == src && plan.egress_ip(osrc).is_some(), || {
        format!("an ICMP answer from {osrc} to {odst} for {src} -> {dst}")
    })?;
    let v4 = family(seen.out) == Some(true);
    let expired = sent == TIME_EXCEEDED_SENT;
    must(expired || mtu_fit(input) != Some(true), || {
        format!(
            "answered too big for a packet of {} bytes (GSO {:?}) that fits",
            input.frame.len(),
            input.gso
        )
    })?;
    if expired {
        let hops = input.frame.get(if v4 { 22 } else { 21 });
        must(hops.is_some_and(|h| *h <= 1), || {
            format!("time exceeded for a packet of TTL {hops:?}")
        })?;
    }
    // IPv4: a 60-byte header, ICMP 3/4 or 11/0; IPv6: a 24-byte options header, ICMPv6
    // 2/0 or 3/0.
    let (icmp, kind, quoted_dst) = match (v4, expired) {
        (true, false) => (74, [3, 4], 16),
        (true, true) => (74, [11, 0], 16),
        (false, false) => (78, [2, 0], 24),
        (false, true) => (78, [3, 0], 24),
    };
    let m = seen.out.get(icmp..).ok_or("an answer cut short")?;
    must(m.get(..2) == Some(&kind[..]), || {
        format!("an answer of ICMP type and code {:?}", m.get(..2))
    })?;
    let pseudo = match (osrc, odst) {
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut p = s.octets().to_vec();
            p.extend(d.octets());
            p.extend((m.len() as u32).to_be_bytes());
            p.extend([0, 0, 0, 58]);
            p
        }
        _ => Vec::new(),
    };
    must(crate::packet::checksum(&[&pseudo, m]) == 0, || {
        "an answer whose ICMP checksum is wrong".to_owned()
    })?;
    let q = m.get(8..).ok_or("no quote")?;
    let len = if v4 { 4 } else { 16 };
    must(
        q.get(quoted_dst..quoted_dst + len) == ip_bytes(dst).get(..),
        || format!("an answer whose quote is not of the packet to {dst}"),
    )
}

/// Whether an IP frame's checksums are right: the IPv4 header's, and a TCP, UDP, ICMP or
/// ICMPv6 message's over the IP payload (with its pseudo-header; an IPv4 UDP checksum of
/// 0 is none). `None` where that cannot be said: not IP, a fragment, another protocol,
/// a length field that does not fit the frame.
pub fn checksums_right(f: &[u8]) -> Option<bool> {
    let v4 = family(f)?;
    let (proto, off) = transport(f)?;
    let end = if v4 {
        let ihl = usize::from(f.get(14)? & 0x0f) * 4;
        let frag = u16::from_be_bytes([*f.get(20)?, *f.get(21)?]);
        if frag & 0x3fff != 0 || ihl < 20 {
            return None;
        }
        if crate::packet::checksum(&[f.get(14..14 + ihl)?]) != 0 {
            return Some(false);
        }
        14 + usize::from(u16::from_be_bytes([f[16], f[17]]))
    } else {
        54 + usize::from(u16::from_be_bytes([*f.get(18)?, *f.get(19)?]))
    };
    let l4 = f.get(off..end)?;
    if l4.len() < 8 {
        return None;
    }
    let (src, dst) = addrs(f)?;
    let mut pseudo = Vec::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            if proto == 17 && l4[6..8] == [0, 0] {
                return Some(true);
            }
            if proto != 1 {
                pseudo.extend(s.octets());
                pseudo.extend(d.octets());
                pseudo.extend([0, proto]);
                pseudo.extend((l4.len() as u16).to_be_bytes());
            }
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            pseudo.extend(s.octets());
            pseudo.extend(d.octets());
            pseudo.extend((l4.len() as u32).to_be_bytes());
            pseudo.extend([0, 0, 0, proto]);
        }
        _ => return None,
    }
    match (proto, v4) {
        (6 | 17, _) | (1, true) | (58, false) => Some(crate::packet::checksum(&[&pseudo, l4]) == 0),
        _ => None,
    }
}

/// The MTU of the fuzz node's interfaces (veths).
const MTU: usize = 1500;

/// Whether the packet fits a 1,500-byte interface: its frame, or, a GSO packet, each of
/// its segments (IP and transport headers and `gso_size`, as the datapath counts).
/// `None` for a frame 1 to 4 bytes over the MTU and its Ethernet header: the kernel's
/// checks differ there (`is_skb_forwardable` leaves room for a VLAN tag, `bpf_check_mtu`
/// for a resolved and an unresolved next hop does not), and so may the datapath.
fn mtu_fit(input: &Input) -> Option<bool> {
    let f = &input.frame;
    let Some((size, _)) = input.gso else {
        return match f.len() {
            n if n <= MTU + 14 => Some(true),
            n if n <= MTU + 14 + 4 => None,
            _ => Some(false),
        };
    };
    let Some((proto, off)) = transport(f) else {
        return Some(true);
    };
    let l4 = if proto == 6 {
        f.get(off + 12).map_or(20, |b| usize::from(b >> 4) * 4)
    } else {
        8
    };
    Some(off - 14 + l4 + size as usize <= MTU)
}

fn ip_bytes(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

#[cfg(test)]
mod tests {
    //! The checker bites: outcomes a broken datapath would give, each refused.

    use super::*;
    use crate::{
        fuzz::cases::Kind,
        packet::{Ipv4Packet, L4, TCP_ACK},
    };

    fn input(p: &Ipv4Packet) -> Input {
        Input {
            frame: p.build(),
            dev: Dev::Pod,
            tunnel: None,
            kind: Kind::Valid,
            gso: None,
        }
    }

    fn to(src: IpAddr, dst: IpAddr) -> Ipv4Packet {
        let (IpAddr::V4(s), IpAddr::V4(d)) = (src, dst) else {
            unreachable!()
        };
        Ipv4Packet::new(s, d, L4::tcp(40_000, 80, TCP_ACK))
    }

    fn seen<'a>(verdict: u32, out: &'a [u8], delta: &'a [(u32, u64, u64)]) -> Seen<'a> {
        Seen {
            verdict,
            out,
            delta,
        }
    }

    /// A reply from the tunnel goes into the pod around the CNI only from the gateway the
    /// pod's policy names for its source, and then always.
    #[test]
    fn refuses_a_reply_around_the_cni_from_another_than_its_gateway() {
        let v4 = &*node::V4;
        let gateway = v4.policy(v4.local_pod, v4.dest_b).map(|p| p.gateway);
        assert_eq!(gateway, Some(node::PEER), "the plan this test reads");
        let reply = |sender| Input {
            dev: Dev::Tunnel,
            tunnel: Some((sender, RETURN_VNI)),
            ..input(&to(v4.dest_b, v4.local_pod))
        };
        let len = reply(node::PEER).frame.len() as u64;
        let into_pod = [(RETURN_DELIVERED, 1, len), (TO_POD_DEVICE, 1, len)];
        let routed = [(RETURN_DELIVERED, 1, len)];
        let run = |sender, delta: &[(u32, u64, u64)]| {
            let i = reply(sender);
            check(
                Prog::FromTunnel,
                &i,
                &seen(TC_ACT_REDIRECT, &i.frame, delta),
            )
        };
        assert_eq!(run(node::PEER, &into_pod), Ok(()));
        assert!(node::NODES.contains(&node::PEER6));
        let forged = run(node::PEER6, &into_pod).unwrap_err();
        assert!(forged.contains("around the CNI"), "{forged}");
        assert_eq!(run(node::PEER6, &routed), Ok(()));
        let missed = run(node::PEER, &routed).unwrap_err();
        assert!(missed.contains("routed"), "{missed}");
        // From a pod's own device, never.
        let out = input(&to(v4.local_pod, v4.dest_b));
        let s = seen(TC_ACT_REDIRECT, &out.frame, &into_pod);
        let from_pod = check(Prog::FromPod, &out, &s).unwrap_err();
        assert!(from_pod.contains("into a pod's device"), "{from_pod}");
    }

    #[test]
    fn refuses_what_a_broken_datapath_would_do() {
        let v4 = &*node::V4;
        let unselected = input(&to(v4.unselected_pod, v4.dest_a));
        let f = &unselected.frame;
        let len = f.len() as u64;
        let mut rewritten = f.clone();
        rewritten[30] ^= 1;
        let tunneled = [(TUNNELED, 1, len)];
        let two_drops = [(DROP_MALFORMED, 1, len), (DROP_FIB, 1, len)];
        let covered = input(&to(v4.local_pod, v4.dest_a));
        let cases: Vec<(&str, Input, Seen)> = vec![
            (
                "a selected pod's covered packet passed",
                covered.clone(),
                seen(TC_ACT_OK, &covered.frame, &[]),
            ),
            (
                "a drop without a counter",
                unselected.clone(),
                seen(TC_ACT_SHOT, f, &[]),
            ),
            ("an unknown verdict", unselected.clone(), seen(1, f, &[])),
            (
                "a pass rewritten",
                unselected.clone(),
                seen(TC_ACT_OK, &rewritten, &[]),
            ),
            (
                "an unselected pod tunneled",
                unselected.clone(),
                seen(TC_ACT_REDIRECT, f, &tunneled),
            ),
            (
                "a drop counted twice",
                unselected.clone(),
                seen(TC_ACT_SHOT, f, &two_drops),
            ),
        ];
        for (what, input, s) in cases {
            assert!(
                check(Prog::FromPod, &input, &s).is_err(),
                "{what} passed the checker"
            );
        }
    }

    /// A "fragmentation needed" as the datapath makes it: from `from` to `to`, quoting
    /// `quoted` (an IP packet).
    fn too_big(from: Ipv4Addr, to: Ipv4Addr, quoted: &[u8]) -> Vec<u8> {
        let mut ip = vec![0x4f, 0xc0, 0, 132, 0, 0, 0, 0, 64, 1, 0, 0];
        ip.extend(from.octets());
        ip.extend(to.octets());
        ip.extend([0x1e, 40]);
        ip.resize(60, 0);
        let h = crate::packet::checksum(&[&ip]);
        ip[10..12].copy_from_slice(&h.to_be_bytes());
        let mut icmp = vec![3, 4, 0, 0, 0, 0, 0x05, 0x14];
        icmp.extend(&quoted[..64]);
        let c = crate::packet::checksum(&[&icmp]);
        icmp[2..4].copy_from_slice(&c.to_be_bytes());
        let mut f = vec![0; 12];
        f.extend([0x08, 0x00]);
        f.extend(ip);
        f.extend(icmp);
        f
    }

    #[test]
    fn refuses_a_too_big_answer_to_another_than_the_sender() {
        let v4 = &*node::V4;
        let (IpAddr::V4(egress), IpAddr::V4(pod), IpAddr::V4(other)) =
            (v4.egress_a, v4.local_pod, v4.unselected_pod)
        else {
            unreachable!()
        };
        let mut big = to(v4.local_pod, v4.dest_a);
        big = big.l4(L4::udp(5000, 53, &[7; 1600]));
        let sent = input(&big);
        let len = sent.frame.len() as u64;
        let delta = [
            (LOCAL_GATEWAY, 1, len),
            (SNAT_NEW, 1, len),
            (FRAG_NEEDED_SENT, 1, len),
        ];
        let quoted = &sent.frame[14..];
        let good = too_big(egress, pod, quoted);
        assert_eq!(
            check(Prog::FromPod, &sent, &seen(TC_ACT_REDIRECT, &good, &delta)),
            Ok(())
        );
        let mut bad_sum = good.clone();
        bad_sum[100] ^= 1;
        for (what, out) in [
            ("to another pod", too_big(egress, other, quoted)),
            ("from the pod itself", too_big(pod, pod, quoted)),
            ("with a wrong checksum", bad_sum),
        ] {
            assert!(
                check(Prog::FromPod, &sent, &seen(TC_ACT_REDIRECT, &out, &delta)).is_err(),
                "an answer {what} passed the checker"
            );
        }
    }

    #[test]
    fn refuses_a_forward_out_of_another_rules_interface() {
        let v4 = &*node::V4;
        let sent = input(&to(v4.local_pod, v4.dest_a));
        let IpAddr::V4(egress) = v4.egress_a else {
            unreachable!()
        };
        let good = to(v4.local_pod, v4.dest_a)
            .src(egress)
            .ttl(63)
            .macs([2, 0, 0, 0, 0x0a, 0x07], node::SEC0_MAC)
            .build();
        let wrong_dev = to(v4.local_pod, v4.dest_a)
            .src(egress)
            .ttl(63)
            .macs([2, 0, 0, 0, 0x0b, 0x09], node::SEC1_MAC)
            .build();
        let len = sent.frame.len() as u64;
        let delta = [
            (LOCAL_GATEWAY, 1, len),
            (SNAT_NEW, 1, len),
            (FORWARDED, 1, len),
        ];
        assert_eq!(
            check(Prog::FromPod, &sent, &seen(TC_ACT_REDIRECT, &good, &delta)),
            Ok(())
        );
        assert!(
            check(
                Prog::FromPod,
                &sent,
                &seen(TC_ACT_REDIRECT, &wrong_dev, &delta)
            )
            .is_err()
        );
    }
}
