//! Egress NetworkPolicy over the traffic the datapath redirects (issue 29): a pod's
//! packets are taken at its device's TC ingress, before the CNI's own enforcement, so the
//! agent must apply the pod's egress NetworkPolicies itself. Dual-stack lab, the sample
//! policy (network A by egress IP A, network B learned from routes by egress IP B), and
//! NetworkPolicy documents in the state directory; asserted on what host-a and host-b
//! saw, and on `DROP_NETWORK_POLICY` in w1's counters.

use std::{net::IpAddr, time::Duration, time::Instant};

use egress_common::counters::reason::DROP_NETWORK_POLICY;
use egress_tests::{
    cluster::{counted, seen, spec_for, start_stream, stop_stream, up_with_agents, wait_until},
    lab::{Family, Lab, Proto, Query, addr, addr6},
    stream::unix_ms,
};

/// The NetworkPolicy file of these tests.
const FILE: &str = "netpol.yaml";
/// A second echo port on host-a, for the port-limited rule.
const OTHER_PORT: u16 = 7778;

/// A NetworkPolicy in the pods' namespace selecting app=api for egress, its `egress`
/// rules as YAML.
fn netpol(name: &str, egress: &str) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
         metadata: {{name: {name}, namespace: payments}}\n\
         spec:\n  podSelector: {{matchLabels: {{app: api}}}}\n  policyTypes: [Egress]\n\
         {egress}"
    )
}

/// Whether `from` reaches `host:port` over `proto`, and from which address.
fn reach(lab: &Lab, from: &str, proto: Proto, host: IpAddr, port: u16) -> Option<IpAddr> {
    let q = Query::new(proto, host, port)
        .timeout(Duration::from_millis(700))
        .attempts(2);
    lab.query_with(from, &q).ok().map(|s| s.ip)
}

/// Write `doc` and wait until `denied` holds: the time it took (the edit latency).
fn apply(lab: &Lab, doc: &str, mut holds: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    lab.write_state_file(FILE, doc).unwrap();
    wait_until(Duration::from_secs(15), &mut holds)
        .unwrap_or_else(|_| panic!("not applied:\n{doc}\n{}", lab.agent_log("w1")));
    t.elapsed()
}

#[test]
fn egress_networkpolicy_holds_for_redirected_traffic_in_both_families() {
    let lab = up_with_agents(spec_for(Family::Dual).unwrap()).unwrap();
    let (a4, b4) = (IpAddr::V4(addr::HOST_A), IpAddr::V4(addr::HOST_B));
    let (a6, b6) = (IpAddr::V6(addr6::HOST_A), IpAddr::V6(addr6::HOST_B));
    let egress = |h: IpAddr| -> IpAddr {
        match h {
            IpAddr::V4(_) if h == a4 => addr::EGRESS_IP_A.into(),
            IpAddr::V4(_) => addr::EGRESS_IP_B.into(),
            _ if h == a6 => addr6::EGRESS_IP_A.into(),
            _ => addr6::EGRESS_IP_B.into(),
        }
    };
    let hosts = [a4, b4, a6, b6];
    wait_until(Duration::from_secs(40), || {
        hosts
            .iter()
            .all(|h| seen(&lab, "w1-p1", Proto::Tcp, *h) == Some(egress(*h)))
    })
    .expect("the sample policy serves both networks in both families first");
    // A second port on host-a, each family's server on its own socket.
    let port = OTHER_PORT.to_string();
    let bind6 = addr6::HOST_A.to_string();
    let _other: Vec<_> = [
        vec!["serve", "--tcp", &port, "--udp", &port],
        vec!["serve", "--bind", &bind6, "--tcp", &port, "--udp", &port],
    ]
    .iter()
    .enumerate()
    .map(|(i, args)| {
        let log = lab.dir().join(format!("host-a-other-{i}.log"));
        lab.ns("host-a")
            .unwrap()
            .spawn(&lab.spec().echo_bin, args, &log)
            .unwrap()
    })
    .collect();
    wait_until(Duration::from_secs(5), || {
        [a4, a6]
            .iter()
            .all(|h| reach(&lab, "w1-p1", Proto::Tcp, *h, OTHER_PORT) == Some(egress(*h)))
    })
    .expect("host-a's second port answers");

    // 1. Egress allowed only to network B: network A is denied over TCP and UDP, both
    // families; B still leaves by egress IP B.
    let dropped0 = counted(&lab, "w1", DROP_NETWORK_POLICY);
    let only_b = netpol(
        "only-b",
        &format!(
            "  egress:\n  - to: [{{ipBlock: {{cidr: {}}}}}, {{ipBlock: {{cidr: \"{}\"}}}}]\n",
            addr::NET_B,
            addr6::NET_B
        ),
    );
    let took = apply(&lab, &only_b, || {
        seen(&lab, "w1-p1", Proto::Tcp, a4).is_none()
            && seen(&lab, "w1-p1", Proto::Tcp, a6).is_none()
    });
    println!("only network B allowed: applied within {took:?}");
    for h in [a4, a6] {
        for proto in [Proto::Tcp, Proto::Udp] {
            assert_eq!(seen(&lab, "w1-p1", proto, h), None, "{h} {proto:?} denied");
        }
    }
    for h in [b4, b6] {
        assert_eq!(seen(&lab, "w1-p1", Proto::Udp, h), Some(egress(h)), "{h}");
    }
    let dropped = counted(&lab, "w1", DROP_NETWORK_POLICY) - dropped0;
    assert!(dropped > 0, "w1 counted no DROP_NETWORK_POLICY");
    println!("w1 counted {dropped} DROP_NETWORK_POLICY");

    // 2. Port-limited: network A on TCP OTHER_PORT only.
    let tcp_other = netpol(
        "a-on-one-port",
        &format!(
            "  egress:\n  - to: [{{ipBlock: {{cidr: {}}}}}, {{ipBlock: {{cidr: \"{}\"}}}}]\n    \
             ports: [{{protocol: TCP, port: {OTHER_PORT}}}]\n",
            addr::NET_A,
            addr6::NET_A
        ),
    );
    let took = apply(&lab, &tcp_other, || {
        reach(&lab, "w1-p1", Proto::Tcp, a4, OTHER_PORT) == Some(egress(a4))
    });
    println!("network A on TCP {OTHER_PORT} only: applied within {took:?}");
    for h in [a4, a6] {
        assert_eq!(
            reach(&lab, "w1-p1", Proto::Tcp, h, OTHER_PORT),
            Some(egress(h)),
            "{h} TCP {OTHER_PORT} allowed, through egress IP A"
        );
        assert_eq!(
            reach(&lab, "w1-p1", Proto::Udp, h, OTHER_PORT),
            None,
            "{h} UDP denied"
        );
        assert_eq!(
            reach(&lab, "w1-p1", Proto::Tcp, h, addr::ECHO_PORT),
            None,
            "{h} TCP {} denied",
            addr::ECHO_PORT
        );
    }
    for h in [b4, b6] {
        assert_eq!(
            seen(&lab, "w1-p1", Proto::Tcp, h),
            None,
            "{h}: nothing allows B now"
        );
    }

    // 3. Except: everywhere but host-a.
    let but_host_a = netpol(
        "all-but-host-a",
        &format!(
            "  egress:\n  - to:\n    - ipBlock: {{cidr: 0.0.0.0/0, except: [{}/32]}}\n    \
             - ipBlock: {{cidr: \"::/0\", except: [\"{}/128\"]}}\n",
            addr::HOST_A,
            addr6::HOST_A
        ),
    );
    let took = apply(&lab, &but_host_a, || {
        seen(&lab, "w1-p1", Proto::Tcp, b4) == Some(egress(b4))
    });
    println!("all but host-a: applied within {took:?}");
    for h in [a4, a6] {
        assert_eq!(
            seen(&lab, "w1-p1", Proto::Tcp, h),
            None,
            "{h} is the except"
        );
    }
    for h in [b4, b6] {
        assert_eq!(seen(&lab, "w1-p1", Proto::Tcp, h), Some(egress(h)), "{h}");
    }

    // 4. An established flow that a new policy forbids: its packets are dropped from the
    // next one on (the gateway's conntrack entry stays); it comes back when the policy
    // goes, the TCP connection retransmitting, still through egress IP A.
    lab.remove_state_file(FILE).unwrap();
    wait_until(Duration::from_secs(15), || {
        seen(&lab, "w1-p1", Proto::Tcp, a4) == Some(egress(a4))
    })
    .expect("no NetworkPolicy: host-a reachable again");
    let (stream, stream_log) = start_stream(&lab, "w1-p1", "tcp", a4, "np-stream").unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let forbidden_at = unix_ms();
    let took = apply(&lab, &only_b, || {
        seen(&lab, "w1-p1", Proto::Tcp, a4).is_none()
    });
    std::thread::sleep(Duration::from_secs(2));
    let deleted_at = unix_ms();
    let t = Instant::now();
    lab.remove_state_file(FILE).unwrap();
    wait_until(Duration::from_secs(15), || {
        seen(&lab, "w1-p1", Proto::Tcp, a4) == Some(egress(a4))
    })
    .expect("the deleted policy no longer denies");
    let delete_took = t.elapsed();
    std::thread::sleep(Duration::from_secs(6));
    let s = stop_stream(stream, &stream_log).unwrap();
    let replies_between = s
        .replies_unix_ms
        .iter()
        .filter(|t| **t > forbidden_at + took.as_millis() as u64 + 200 && **t < deleted_at)
        .count();
    let after = s.first_reply_after(deleted_at);
    println!(
        "established TCP stream: {} sent, {} replies; forbidden within {took:?}: {} replies \
         while forbidden; policy deleted (applied within {delete_took:?}): first reply {} ms \
         after; longest gap {} ms; reset {}; sources {:?}",
        s.sent,
        s.received,
        replies_between,
        after.map_or("never".to_owned(), |t| t.to_string()),
        s.longest_gap_ms,
        s.reset,
        s.sources
    );
    assert_eq!(replies_between, 0, "the forbidden flow was cut");
    assert!(
        after.is_some(),
        "the flow came back once the policy was deleted"
    );
    assert!(
        s.sources
            .iter()
            .all(|src| src.starts_with(&format!("{}:", addr::EGRESS_IP_A))),
        "the flow only ever left through egress IP A: {:?}",
        s.sources
    );
}
