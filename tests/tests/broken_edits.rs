//! A broken edit of the policy file never withdraws the policy: while a TCP stream and a
//! UDP stream run from a selected pod through the gateways, the policy file is made
//! unparsable, then empty, then given a rule with an invalid CIDR, then fixed. Every step
//! keeps the last good translation: the holders stay, new connections leave with the
//! egress IPs, the streams lose nothing and are never reset, and the far hosts see only
//! the egress IPs. An agent restarted while the policy is broken serves it as the one it
//! replaced did.

use std::{net::IpAddr, time::Duration};

use egress_tests::{
    cluster::{
        agent_bin, default_spec, holder, seen, start_stream, stop_stream, up_with_agents,
        wait_until,
    },
    lab::{Proto, addr, sample_policy},
};

const POD: &str = "w1-p1";
/// How long each broken state lasts: several resyncs and file-watch rounds.
const HOLD: Duration = Duration::from_secs(4);

/// The sample policy with an invalid CIDR in rule A.
fn invalid_cidr() -> String {
    let good = sample_policy();
    let broken = good.replacen("192.168.101.0/24", "192.168.101.0/33", 1);
    assert_ne!(broken, good, "the sample policy lists network A");
    broken
}

#[test]
fn broken_policy_edits_keep_the_last_good_translation_and_lose_nothing() {
    let lab = up_with_agents(default_spec().unwrap()).unwrap();
    let (a, b) = (addr::EGRESS_IP_A, addr::EGRESS_IP_B);
    let holders = || (holder(&lab, a), holder(&lab, b));
    let before = holders();
    assert!(before.0.is_some() && before.1.is_some(), "{before:?}");
    let (tcp, tcp_log) =
        start_stream(&lab, POD, "tcp", IpAddr::V4(addr::HOST_A), "broken-tcp").unwrap();
    let (udp, udp_log) =
        start_stream(&lab, POD, "udp", IpAddr::V4(addr::HOST_B), "broken-udp").unwrap();
    std::thread::sleep(Duration::from_millis(500));

    let good = sample_policy();
    let invalid_cidr = invalid_cidr();
    let edits: [(&str, &str); 3] = [
        (
            "unparsable",
            "apiVersion: egress.dev/v1alpha1\nkind: [EgressGatewayPolicy\n",
        ),
        ("empty", ""),
        ("an invalid CIDR in rule A", &invalid_cidr),
    ];
    for (what, text) in edits {
        lab.write_policy(text).unwrap();
        std::thread::sleep(HOLD);
        assert_eq!(holders(), before, "{what}: the egress IPs stay put");
        assert_eq!(
            seen(&lab, POD, Proto::Tcp, addr::HOST_A),
            Some(IpAddr::V4(a)),
            "{what}: a new connection to A still leaves with egress IP A"
        );
        assert_eq!(
            seen(&lab, POD, Proto::Udp, addr::HOST_B),
            Some(IpAddr::V4(b)),
            "{what}: new UDP to B still leaves with egress IP B"
        );
    }
    lab.write_policy(&good).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(holders(), before, "fixed: nothing moved");

    let tcp = stop_stream(tcp, &tcp_log).unwrap();
    let udp = stop_stream(udp, &udp_log).unwrap();
    eprintln!(
        "tcp: {} sent, {} replies, longest gap {} ms, reset {}; udp: {} sent, {} replies, \
         longest gap {} ms",
        tcp.sent,
        tcp.received,
        tcp.longest_gap_ms,
        tcp.reset,
        udp.sent,
        udp.received,
        udp.longest_gap_ms
    );
    assert!(tcp.unbroken(), "the TCP stream was never reset: {tcp:?}");
    for (name, s) in [("tcp", &tcp), ("udp", &udp)] {
        // The last datagram or line may still be in flight when the stream stops.
        assert!(
            s.sent.saturating_sub(s.received) <= 1,
            "{name}: nothing lost ({} sent, {} received)",
            s.sent,
            s.received
        );
        assert!(s.longest_gap_ms < 1_000, "{name}: no outage: {s:?}");
    }
    assert!(
        tcp.sources.iter().all(|s| s.starts_with(&format!("{a}:"))),
        "host-a saw only {a}: {:?}",
        tcp.sources
    );
    assert!(
        udp.sources.iter().all(|s| s.starts_with(&format!("{b}:"))),
        "host-b saw only {b}: {:?}",
        udp.sources
    );
    // Each problem was logged when it appeared, not on every pass.
    for node in ["w1", "gw1", "gw2"] {
        let log = lab.agent_log(node);
        let kept = log
            .lines()
            .filter(|l| l.contains("WARN") && l.contains("keeping the last good version"))
            .count();
        assert!(
            (1..=6).contains(&kept),
            "{node}: the kept-file problem is logged once per broken state, not per pass \
             ({kept} lines)"
        );
        assert!(
            log.contains("ServingLastAccepted") || log.contains("last accepted version"),
            "{node}: the invalid rule's policy is served from its last accepted version"
        );
    }
}

/// The pod's node and the holder of egress IP A restart while rule A has an invalid CIDR:
/// each reads the policy's last accepted version that the agent before it kept
/// (`/run/egress-agent/<pins>.accepted.json`), so the holders stay and the pod's new
/// connections still leave with the egress IPs. Without it, the restarted worker knew no
/// version of the policy and left the pod to its node's routing (its own address), and the
/// restarted holder let egress IP A go.
#[test]
fn an_agent_restarted_while_a_policy_is_broken_serves_its_last_accepted_version() {
    let mut lab = up_with_agents(default_spec().unwrap()).unwrap();
    let (a, b) = (addr::EGRESS_IP_A, addr::EGRESS_IP_B);
    let holders = |lab: &_| (holder(lab, a), holder(lab, b));
    let before = holders(&lab);
    let (holder_a, _) = before.0.clone().expect("egress IP A held");
    lab.write_policy(&invalid_cidr()).unwrap();
    wait_until(HOLD, || {
        ["w1", holder_a.as_str()]
            .iter()
            .all(|node| lab.agent_log(node).contains("last accepted version"))
    })
    .expect("both agents serve the policy from its last accepted version");

    let bin = agent_bin().unwrap();
    for node in ["w1", holder_a.as_str()] {
        lab.stop_agent(node).unwrap();
        lab.start_agent(node, &bin, &[]).unwrap();
    }
    wait_until(Duration::from_secs(30), || {
        lab.agent_ready("w1") && lab.agent_ready(&holder_a)
    })
    .expect("the restarted agents finish a pass");
    assert_eq!(holders(&lab), before, "the egress IPs stay put");
    assert_eq!(
        seen(&lab, POD, Proto::Tcp, addr::HOST_A),
        Some(IpAddr::V4(a)),
        "a new connection to A leaves with egress IP A"
    );
    assert_eq!(
        seen(&lab, POD, Proto::Udp, addr::HOST_B),
        Some(IpAddr::V4(b)),
        "new UDP to B leaves with egress IP B"
    );
}
