//! Several egress IPs for one rule, on the real kernel: the lab's network-A rule with
//! `egressIPs: [A, A2]`, what the host on A saw from each selected pod, where each address
//! lives, and what a gateway's silent death does to the pods of each address. Needs root.

use std::{net::IpAddr, time::Duration};

use egress_tests::{
    cluster::{self, up_with_agents},
    lab::Family,
    spread,
};

#[test]
fn two_addresses_on_two_gateways_and_each_pod_seen_with_its_own() {
    let lab = up_with_agents(cluster::spec_for(Family::Dual).unwrap()).unwrap();
    for v6 in [false, true] {
        let holders = spread::apply(&lab, v6).unwrap();
        assert_ne!(holders[0], holders[1], "both addresses on one gateway");
        let rows = spread::rows(&lab, v6).unwrap();
        // The lab's three selected pods: each seen by host A with the address its node
        // gives it (asked twice, on new connections: the same each time), and both
        // addresses in use.
        assert_eq!(rows.len(), 3, "{rows:?}");
        for r in &rows {
            assert!(r.ok(), "{r:?}");
        }
        let again = spread::rows(&lab, v6).unwrap();
        for (a, b) in rows.iter().zip(&again) {
            assert_eq!(a.observed, b.observed, "{} changed address", a.pod);
        }
        assert_eq!(spread::used(&rows).len(), 2, "{rows:?}");
        // Each address is on the gateway the rows name, and only there.
        for (ip, holder) in spread::addresses(v6).iter().zip(&holders) {
            let on: Vec<String> = cluster::holders(&lab, *ip)
                .into_iter()
                .map(|(gw, _)| gw)
                .collect();
            assert_eq!(on, std::slice::from_ref(holder), "{ip}");
        }
    }
}

#[test]
fn a_silent_death_moves_one_address_and_no_pod_changes_address_or_loses_its_stream() {
    let mut lab = up_with_agents(cluster::default_spec().unwrap()).unwrap();
    let report = spread::failover(&mut lab, false, Duration::from_millis(20)).unwrap();
    assert!(report.ok(), "{report:#?}");
    let (on_failed, others): (Vec<_>, Vec<_>) = report.streams.iter().partition(|s| s.on_failed);
    assert!(!on_failed.is_empty() && !others.is_empty(), "{report:#?}");
    // The pods of the address that stayed did not move: no stall beyond a loaded
    // machine's (the moved ones wait for detection and TCP's retransmission).
    for s in &others {
        assert!(s.tcp.longest_gap_ms < 1500, "{s:#?}");
    }
    let a: IpAddr = spread::addresses(false)[0];
    assert_eq!(report.failed.1, a);
}
