//! A rule wide enough to cover the cluster (issue 28's second probe): `0.0.0.0/0` via
//! egress IP A. The selected pod's traffic to another pod, to its own node and to another
//! node used to be tunneled to a gateway and dropped there (`DROP_FIB`); the cluster's own
//! addresses are now carved out of the rule, so they are reached directly, from the pod's
//! own address, while the rest of the world leaves through A; and the policy says so.

use std::{net::IpAddr, time::Duration};

use egress_tests::{
    cluster::{default_spec, seen, up_with_agents, wait_until},
    lab::{Lab, Proto, Query, addr, sample_policy},
};

/// `from` queries `to`'s echo server on `to_ip`: the source address `to` saw.
fn seen_by(lab: &Lab, from: &str, proto: Proto, to_ip: IpAddr) -> Option<IpAddr> {
    let q = Query::new(proto, to_ip, addr::ECHO_PORT)
        .timeout(Duration::from_millis(700))
        .attempts(2);
    lab.query_with(from, &q).ok().map(|s| s.ip)
}

#[test]
fn a_rule_over_the_whole_internet_leaves_the_cluster_alone() {
    let lab = up_with_agents(default_spec().unwrap()).unwrap();
    let egress_a = IpAddr::V4(addr::EGRESS_IP_A);
    wait_until(Duration::from_secs(30), || {
        seen(&lab, "w1-p1", Proto::Tcp, addr::HOST_A) == Some(egress_a)
    })
    .expect("the sample policy serves first");
    // Echo servers in another pod and on two nodes' own namespaces.
    let port = addr::ECHO_PORT.to_string();
    let mut servers = Vec::new();
    for member in ["w2-p1", "w1", "gw1"] {
        let log = lab.dir().join(format!("{member}-serve.log"));
        let child = lab
            .ns(member)
            .unwrap()
            .spawn(
                &lab.spec().echo_bin,
                &["serve", "--tcp", &port, "--udp", &port],
                &log,
            )
            .unwrap();
        servers.push(child);
    }
    let pod_ip = IpAddr::V4(addr::W1_P1);
    let targets = [
        ("pod w2-p1", "w2-p1", IpAddr::V4(addr::W2_P1)),
        ("node w1 (its own)", "w1", IpAddr::V4(addr::W1)),
        ("node gw1", "gw1", IpAddr::V4(addr::GW1)),
    ];
    wait_until(Duration::from_secs(10), || {
        targets
            .iter()
            .all(|(_, _, ip)| seen_by(&lab, "w1-p1", Proto::Tcp, *ip) == Some(pod_ip))
    })
    .expect("the cluster reached directly under the sample policy");

    let wide = sample_policy().replace(&format!("- {}", addr::NET_A), "- 0.0.0.0/0");
    assert!(wide.contains("0.0.0.0/0"), "{wide}");
    lab.write_policy(&wide).unwrap();
    // The policy is in once w1's agent reports what it carved out.
    let said = "rules[0].destinations[0]: 0.0.0.0/0 covers the cluster's own addresses";
    wait_until(Duration::from_secs(15), || {
        lab.agent_log("w1").contains(said)
    })
    .unwrap_or_else(|_| panic!("the policy says so:\n{}", lab.agent_log("w1")));
    assert_eq!(
        seen(&lab, "w1-p1", Proto::Udp, addr::HOST_A),
        Some(egress_a)
    );
    for (what, _, ip) in targets {
        for proto in [Proto::Tcp, Proto::Udp] {
            assert_eq!(
                seen_by(&lab, "w1-p1", proto, ip),
                Some(pod_ip),
                "{what} ({ip}, {proto:?}) reached directly from the pod's own address"
            );
        }
    }
    drop(servers);
}
