//! A route on the gateways that takes the underlay off the underlay interface (issue 28's
//! first probe): `10.200.0.0/25 via rtr-b dev sec-b` on both gateways covers every node's
//! underlay address, so the gateways' hellos (and tunneled replies) leave by network B
//! while everyone's hellos still reach them. One-way hellos used to count toward a
//! gateway's majority, and both gateways held both egress IPs. Now no sample of the 10 s
//! with the route has both gateways holding one egress IP (beyond a transition's 1 s), each
//! gateway's agent names the route's effect, and once the route is gone the lab serves
//! again with one holder per egress IP.

use std::{
    net::IpAddr,
    thread,
    time::{Duration, Instant},
};

use egress_tests::{
    cluster::{default_spec, holders, seen, start_stream, stop_stream, up_with_agents, wait_until},
    lab::{Proto, addr},
};

const GATEWAYS: [&str; 2] = ["gw1", "gw2"];
const ROUTE: &str = "10.200.0.0/25";

#[test]
fn a_route_that_takes_the_underlay_off_its_interface_never_makes_two_holders() {
    let lab = up_with_agents(default_spec().unwrap()).unwrap();
    let ips = [IpAddr::V4(addr::EGRESS_IP_A), IpAddr::V4(addr::EGRESS_IP_B)];
    wait_until(Duration::from_secs(30), || {
        ips.iter().all(|ip| holders(&lab, *ip).len() == 1)
    })
    .expect("one holder of each egress IP before the route");
    let host_a = IpAddr::V4(addr::HOST_A);
    let (stream, log) = start_stream(&lab, "w1-p1", "udp", host_a, "dangerous-udp").unwrap();

    let via = addr::RTR_B.to_string();
    for gw in GATEWAYS {
        lab.exec(
            gw,
            "ip",
            &["route", "add", ROUTE, "via", &via, "dev", "sec-b"],
        )
        .unwrap();
    }
    // Sample who holds each egress IP every 50 ms for 10 s.
    let sample = Duration::from_millis(50);
    let mut both = [Duration::ZERO; 2];
    let mut longest = [Duration::ZERO; 2];
    let mut run = [Duration::ZERO; 2];
    let mut held_by = [0usize; 2];
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        for (i, ip) in ips.iter().enumerate() {
            let n = holders(&lab, *ip).len();
            held_by[i] = held_by[i].max(n);
            if n > 1 {
                both[i] += sample;
                run[i] += sample;
                longest[i] = longest[i].max(run[i]);
            } else {
                run[i] = Duration::ZERO;
            }
        }
        thread::sleep(sample);
    }
    eprintln!(
        "with {ROUTE} via rtr-b on both gateways: two holders of A for {:?} (longest {:?}), \
         of B for {:?} (longest {:?})",
        both[0], longest[0], both[1], longest[1]
    );
    for (i, ip) in ips.iter().enumerate() {
        assert!(
            longest[i] <= Duration::from_secs(1),
            "{ip} held by two gateways for {:?} at a stretch (gw1 log:\n{})",
            longest[i],
            lab.agent_log("gw1")
        );
    }
    for gw in GATEWAYS {
        let log = lab.agent_log(gw);
        assert!(
            log.contains("is routed out of sec-b, not the underlay interface"),
            "{gw} names the route's effect:\n{log}"
        );
    }

    for gw in GATEWAYS {
        lab.exec(
            gw,
            "ip",
            &["route", "del", ROUTE, "via", &via, "dev", "sec-b"],
        )
        .unwrap();
    }
    wait_until(Duration::from_secs(30), || {
        ips.iter().all(|ip| holders(&lab, *ip).len() == 1)
            && seen(&lab, "w1-p1", Proto::Tcp, host_a) == Some(IpAddr::V4(addr::EGRESS_IP_A))
    })
    .expect("one holder of each egress IP, and egress through A, once the route is gone");
    let summary = stop_stream(stream, &log).unwrap();
    eprintln!("UDP stream through it all: {summary:?}");
}
