//! The lab's topology on its own, with no agent running: the routing a CNI would give us is
//! right, the secondary networks are reachable only from the gateways, and nothing is left
//! behind. Needs root (network namespaces).

use std::{net::IpAddr, path::Path, time::Duration};

use egress_tests::{
    lab::{Family, GatewayRoute, Lab, LabSpec, NODES, Node, Proto, Query, addr, addr6},
    netns,
};

fn spec() -> LabSpec {
    LabSpec::new(env!("CARGO_BIN_EXE_egress-echo"))
}

fn assert_gone(prefix: &str) {
    let left = netns::netns_with_prefix(prefix).unwrap();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    let pins: Vec<_> = std::fs::read_dir("/sys/fs/bpf")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&format!("{prefix}-")))
                .collect()
        })
        .unwrap_or_default();
    assert!(pins.is_empty(), "pin dirs left behind: {pins:?}");
}

#[test]
fn pods_reach_network_c_with_their_own_address() {
    let lab = Lab::up(spec()).unwrap();
    for pod in lab.pods() {
        for proto in [Proto::Tcp, Proto::Udp] {
            let seen = lab
                .query(&pod.name, proto, addr::HOST_C, addr::ECHO_PORT, 0)
                .unwrap_or_else(|e| panic!("{} {proto} to host-c: {e:#}", pod.name));
            assert_eq!(seen.ip, IpAddr::V4(pod.ip), "{} {proto}", pod.name);
            assert_ne!(seen.port, 0);
        }
    }
}

#[test]
fn payloads_of_1400_bytes_both_ways() {
    let lab = Lab::up(spec()).unwrap();
    for proto in [Proto::Tcp, Proto::Udp] {
        let seen = lab
            .query("w1-p1", proto, addr::HOST_C, addr::ECHO_PORT, 1400)
            .unwrap();
        assert_eq!(seen.ip, IpAddr::V4(addr::W1_P1), "{proto}");
    }
    // And many segments each way over TCP.
    let seen = lab
        .query("w2-p1", Proto::Tcp, addr::HOST_C, addr::ECHO_PORT, 100_000)
        .unwrap();
    assert_eq!(seen.ip, IpAddr::V4(addr::W2_P1));
}

#[test]
fn fixed_source_port_is_kept_without_nat() {
    // Below the ephemeral range, so no earlier connection of the lab can hold it.
    const SPORT: u16 = 20_123;
    let lab = Lab::up(spec()).unwrap();
    for proto in [Proto::Tcp, Proto::Udp] {
        let q = Query::new(proto, addr::HOST_C, addr::ECHO_PORT).sport(SPORT);
        let seen = lab.query_with("w1-p2", &q).unwrap();
        assert_eq!(seen.port, SPORT, "{proto}");
    }
}

#[test]
fn gateways_reach_the_secondary_networks_directly() {
    let lab = Lab::up(spec()).unwrap();
    for (gw, a, b) in [
        ("gw1", addr::GW1_SEC_A, addr::GW1_SEC_B),
        ("gw2", addr::GW2_SEC_A, addr::GW2_SEC_B),
    ] {
        for proto in [Proto::Tcp, Proto::Udp] {
            let seen = lab
                .query(gw, proto, addr::HOST_A, addr::ECHO_PORT, 0)
                .unwrap();
            assert_eq!(seen.ip, IpAddr::V4(a), "{gw} {proto} to host-a");
            let seen = lab
                .query(gw, proto, addr::HOST_B, addr::ECHO_PORT, 0)
                .unwrap();
            assert_eq!(seen.ip, IpAddr::V4(b), "{gw} {proto} to host-b");
        }
    }
}

#[test]
fn gateways_reach_network_d_through_rtr_b_and_network_e_only_once_routed() {
    let lab = Lab::up(spec().with_family(Family::Dual)).unwrap();
    let short = |host: IpAddr| {
        Query::new(Proto::Udp, host, addr::ECHO_PORT)
            .timeout(Duration::from_millis(300))
            .attempts(2)
    };
    for (gw, own, own6) in [
        ("gw1", addr::GW1_SEC_B, addr6::GW1_SEC_B),
        ("gw2", addr::GW2_SEC_B, addr6::GW2_SEC_B),
    ] {
        // D: the static route of the lab's setup, through rtr-b, which does not NAT.
        for (host, src) in [
            (IpAddr::V4(addr::HOST_D), IpAddr::V4(own)),
            (IpAddr::V6(addr6::HOST_D), IpAddr::V6(own6)),
        ] {
            let seen = lab
                .query(gw, Proto::Tcp, host, addr::ECHO_PORT, 0)
                .unwrap_or_else(|e| panic!("{gw} to {host}: {e:#}"));
            assert_eq!(seen.ip, src, "{gw} to {host}");
        }
        assert!(pings(&lab, gw, addr::HOST_D));
        // E: no route anywhere until one is added.
        for host in [IpAddr::V4(addr::HOST_E), IpAddr::V6(addr6::HOST_E)] {
            assert!(lab.query_with(gw, &short(host)).is_err(), "{gw} to {host}");
        }
    }
    for (v6, host) in [
        (false, IpAddr::V4(addr::HOST_E)),
        (true, IpAddr::V6(addr6::HOST_E)),
    ] {
        let route = GatewayRoute::net_e(v6);
        lab.add_gateway_route("gw1", &route).unwrap();
        assert!(lab.query_with("gw1", &short(host)).is_ok(), "gw1 to {host}");
        assert!(
            lab.query_with("gw2", &short(host)).is_err(),
            "gw2 to {host}"
        );
        lab.del_gateway_route("gw1", &route).unwrap();
        assert!(
            lab.query_with("gw1", &short(host)).is_err(),
            "gw1 to {host}"
        );
    }
    // Nobody else reaches D or E: not the workers, not the pods, not the router.
    for from in ["w1", "w1-p1", "rtr", "host-b"] {
        for host in [addr::HOST_D, addr::HOST_E] {
            assert!(
                lab.query_with(from, &short(host.into())).is_err(),
                "{from} reached {host}"
            );
        }
    }
    // A secondary link cut and restored comes back with its static route to D.
    lab.set_secondary_link("gw2", "sec-b", false).unwrap();
    lab.set_secondary_link("gw2", "sec-b", true).unwrap();
    assert!(pings(&lab, "gw2", addr::HOST_D));
    assert!(pings(&lab, "gw2", addr6::HOST_D));
}

#[test]
fn workers_and_pods_cannot_reach_the_secondary_networks_without_us() {
    let lab = Lab::up(spec()).unwrap();
    let short = Duration::from_millis(300);
    for from in ["w1", "w2", "w1-p1", "w2-p1"] {
        for host in [addr::HOST_A, addr::HOST_B] {
            for proto in [Proto::Tcp, Proto::Udp] {
                let q = Query::new(proto, host, addr::ECHO_PORT).timeout(short);
                let r = lab.query_with(from, &q);
                assert!(r.is_err(), "{from} reached {host} over {proto}: {r:?}");
            }
        }
    }
    // The router, the nodes' default gateway, has no route to A or B.
    let out = lab
        .exec("rtr", "ip", &["route", "get", "192.168.101.100"])
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    assert!(out.is_err() || out.as_deref().is_ok_and(|s| s.contains("unreachable")));
}

#[test]
fn state_dir_holds_the_cluster_and_the_sample_policy() {
    let lab = Lab::up(spec()).unwrap();
    let state = lab.state_dir();
    let cluster = std::fs::read_to_string(state.join("cluster.yaml")).unwrap();
    let policy = std::fs::read_to_string(state.join("policy.yaml")).unwrap();
    assert_eq!(cluster.matches("kind: Node\n").count(), NODES.len());
    assert_eq!(cluster.matches("kind: Pod\n").count(), lab.pods().len());
    assert!(cluster.contains("egress.dev/gateway: \"true\""));
    assert!(cluster.contains("address: 10.200.0.21\n"));
    assert!(cluster.contains("podIP: 10.244.11.11\n"));
    assert!(policy.contains("kind: EgressGatewayPolicy\n"));
    assert!(policy.contains("egressIP: 192.168.101.50\n"));
    assert!(policy.contains("- destinationsFrom: Routes\n      egressIP: 192.168.102.50\n"));

    let mut lab = lab;
    lab.set_node_ready("gw1", false).unwrap();
    let cluster = std::fs::read_to_string(state.join("cluster.yaml")).unwrap();
    assert_eq!(cluster.matches("status: \"False\"").count(), 1);

    // A drained node carries the annotation, until it is undrained.
    lab.set_node_drain("gw2", true).unwrap();
    let cluster = std::fs::read_to_string(state.join("cluster.yaml")).unwrap();
    assert!(
        cluster.contains("  annotations:\n    egress.dev/drain: \"true\"\n  labels:\n"),
        "{cluster}"
    );
    let gw2 = cluster
        .split("---\n")
        .find(|d| d.contains("name: gw2\n"))
        .unwrap();
    assert!(gw2.contains("egress.dev/drain"), "{gw2}");
    lab.set_node_drain("gw2", false).unwrap();
    let cluster = std::fs::read_to_string(state.join("cluster.yaml")).unwrap();
    assert!(!cluster.contains("egress.dev/drain"));
}

/// Addresses and routes of a namespace, both families, as `ip` prints them (sorted: the
/// order of routes of equal prefix may change).
fn addresses_and_routes(lab: &Lab, member: &str) -> Vec<String> {
    let mut out = Vec::new();
    for args in [
        &["-o", "addr", "show"][..],
        &["-4", "route", "show"],
        &["-6", "route", "show"],
    ] {
        let o = lab.exec(member, "ip", args).unwrap();
        out.extend(
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(str::to_owned),
        );
    }
    out.sort();
    out
}

/// Reachable: a reply within ten seconds, to one ping after another, each a new `ping`
/// given a second to answer. One `ping -w 10` that started while the peer's address did
/// not resolve yet was seen to get no reply for all ten seconds after a link came back
/// (1 run in 15; its neighbor entry FAILED after six probes), while a new `ping` right
/// after it got a reply within 15 ms: what a user does (ping again) is what this asserts.
fn pings(lab: &Lab, from: &str, to: impl Into<IpAddr>) -> bool {
    let to = to.into();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if ping(lab, from, to, &["-c", "1", "-W", "1"]) {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
    }
}

fn ping(lab: &Lab, from: &str, to: impl Into<IpAddr>, opts: &[&str]) -> bool {
    let to = to.into().to_string();
    let mut args = opts.to_vec();
    args.push(&to);
    lab.ns(from)
        .unwrap()
        .exec_unchecked("ping", &args)
        .unwrap()
        .status
        .success()
}

/// Unreachable: no answer within a second (a working path answers in microseconds).
fn cut_off(lab: &Lab, from: &str, to: impl Into<IpAddr>) -> bool {
    !ping(lab, from, to, &["-c", "1", "-W", "1"])
}

#[test]
fn links_cut_and_restored_come_back_as_they_were() {
    // Dual stack: a link that goes down loses its IPv6 addresses and its static routes.
    let lab = Lab::up(spec().with_family(Family::Dual)).unwrap();
    let before = addresses_and_routes(&lab, "gw1");
    lab.set_underlay_link("gw1", false).unwrap();
    lab.set_secondary_link("gw1", "sec-a", false).unwrap();
    assert!(cut_off(&lab, "w1", addr::GW1));
    assert!(cut_off(&lab, "host-a", addr::GW1_SEC_A));
    assert!(pings(&lab, "host-b", addr::GW1_SEC_B));
    lab.set_underlay_link("gw1", true).unwrap();
    lab.set_secondary_link("gw1", "sec-a", true).unwrap();
    assert_eq!(addresses_and_routes(&lab, "gw1"), before);
    assert!(pings(&lab, "w1", addr::GW1));
    assert!(pings(&lab, "host-a", addr::GW1_SEC_A));
    assert!(pings(&lab, "gw1-p1", addr::HOST_C));
    assert!(pings(&lab, "gw1-p1", addr6::HOST_C));
}

#[test]
fn a_partition_separates_only_the_two_nodes() {
    let lab = Lab::up(spec().with_family(Family::Dual)).unwrap();
    lab.partition_underlay("gw1", "gw2").unwrap();
    assert!(cut_off(&lab, "gw1", addr::GW2));
    assert!(cut_off(&lab, "gw2", NODES[2].ip6()));
    // UDP too (what the tunnel and the agents' probes use), to a server on gw2.
    let log = lab.dir().join("gw2-echo.log");
    let _server = lab
        .ns("gw2")
        .unwrap()
        .spawn(&lab.spec().echo_bin, &["serve", "--udp", "7000"], &log)
        .unwrap();
    let udp = Query::new(Proto::Udp, addr::GW2, 7000)
        .timeout(Duration::from_millis(600))
        .attempts(3);
    assert!(lab.query_with("gw1", &udp).is_err());
    assert!(lab.query_with("w1", &udp).is_ok());
    for gw in [addr::GW1, addr::GW2] {
        assert!(pings(&lab, "w1", gw));
    }
    lab.heal_underlay().unwrap();
    lab.heal_underlay().unwrap();
    assert!(pings(&lab, "gw1", addr::GW2));
    assert!(pings(&lab, "gw2", NODES[2].ip6()));
    assert!(lab.query_with("gw1", &udp).is_ok());
}

#[test]
fn agents_run_in_their_node_namespace_and_leave_nothing() {
    let mut lab = Lab::up(spec()).unwrap();
    let prefix = lab.prefix().to_owned();
    // A stand-in agent: prints its arguments and the node's underlay address, then waits.
    let fake = lab.dir().join("fake-agent");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho \"args: $*\"\nip -4 -o addr show dev eth0\nmkdir -p \"$7\"\nexec sleep 60\n",
    )
    .unwrap();
    std::process::Command::new("chmod")
        .args(["+x"])
        .arg(&fake)
        .status()
        .unwrap();
    lab.start_agents(&fake).unwrap();
    // Each stand-in has printed and made its pin directory (a loaded machine can take
    // longer than the 300 ms this once slept).
    let printed = |n: &Node| {
        lab.agent_log(n.name).contains(&format!("{}/24", n.ip)) && lab.bpffs_dir(n.name).is_dir()
    };
    let _ =
        egress_tests::cluster::wait_until(Duration::from_secs(10), || NODES.iter().all(printed));
    for node in &NODES {
        let log = lab.agent_log(node.name);
        assert!(
            log.contains(&format!("--node-name {}", node.name)),
            "{}: {log}",
            node.name
        );
        assert!(
            log.contains(&format!("{}/24", node.ip)),
            "{}: {log}",
            node.name
        );
        assert!(lab.bpffs_dir(node.name).is_dir(), "{}", node.name);
    }
    assert!(lab.exited_agents().is_empty());
    lab.stop_agent("gw1").unwrap();
    assert!(lab.bpffs_dir("gw1").is_dir(), "pins survive an agent stop");
    lab.start_agent("gw1", &fake, &[]).unwrap();
    drop(lab);
    assert_gone(&prefix);
}

#[test]
fn two_labs_side_by_side_then_nothing_left() {
    let a = Lab::up(spec()).unwrap();
    let b = Lab::up(spec()).unwrap();
    assert_ne!(a.prefix(), b.prefix());
    for lab in [&a, &b] {
        let seen = lab
            .query("w1-p1", Proto::Tcp, addr::HOST_C, addr::ECHO_PORT, 0)
            .unwrap();
        assert_eq!(seen.ip, IpAddr::V4(addr::W1_P1));
    }
    let (pa, pb) = (a.prefix().to_owned(), b.prefix().to_owned());
    drop(a);
    assert_gone(&pa);
    assert!(!netns::netns_with_prefix(&pb).unwrap().is_empty());
    b.down().unwrap();
    assert_gone(&pb);
}

#[test]
fn a_panicking_test_still_cleans_up() {
    let (tx, rx) = std::sync::mpsc::channel();
    let r = std::thread::spawn(move || {
        let lab = Lab::up(spec()).unwrap();
        tx.send(lab.prefix().to_owned()).unwrap();
        panic!("on purpose, with the lab up");
    })
    .join();
    assert!(r.is_err());
    let prefix = rx.recv().unwrap();
    assert_gone(&prefix);
    // Logs are kept on panic, for the post-mortem; clean them here.
    let dir = std::env::temp_dir().join(format!("egress-lab-{prefix}"));
    assert!(dir.join("host-a.log").is_file());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_kept_lab_is_removed_by_prefix() {
    let lab = Lab::up(spec()).unwrap();
    let prefix = lab.leak();
    assert!(!netns::netns_with_prefix(&prefix).unwrap().is_empty());
    Lab::teardown_by_prefix(&prefix).unwrap();
    assert_gone(&prefix);
    assert!(
        !std::env::temp_dir()
            .join(format!("egress-lab-{prefix}"))
            .exists()
    );
    assert!(!Path::new(&format!("/run/netns/{prefix}-ul")).exists());
}
