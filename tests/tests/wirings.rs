//! The lab wired as CNIs other than Calico wire nodes (`egress_tests::lab::Cni`): pods on a
//! bridge with no host route each ([`Cni::Bridge`], like Flannel and the bridge plugin),
//! the node's underlay address on a bridge over its NIC; and, in the Linux 6.1 guest,
//! Open vSwitch wired as OVN-Kubernetes leaves a node ([`Cni::Ovs`]: `br-int`, `br-ex`, a
//! management port, VLAN secondary networks). The agents find the pods' devices without
//! routes (`--pod-devices auto` here; `ovs` in the OVS lab), `from_underlay` sits on the
//! bridge, and what the far hosts see is what the routed lab shows.

use std::{net::IpAddr, path::Path, process::Command};

use egress_tests::{
    cluster::{self, seen, up_with_agents, wait_until},
    failover::{self, CaseReport, Kind, TcpVerdict, Timing},
    lab::{Cni, Family, GatewayRoute, Lab, LabSpec, OvnGateway, Proto, addr, addr6},
};

fn spec(cni: Cni, family: Family) -> LabSpec {
    let mut spec = cluster::spec_for(family).unwrap();
    spec.cni = cni;
    spec
}

/// The table's core for both families: each network's egress IP for selected pods (a
/// worker's, a gateway's own), untouched traffic outside every rule and of unselected pods;
/// `w1_p1_at_c` is the source host C sees from `w1-p1` over IPv4 (its own address, or an
/// OVN EgressIP's).
fn assert_table(lab: &Lab, w1_p1_at_c: std::net::Ipv4Addr) {
    let v4 = |a: std::net::Ipv4Addr| Some(IpAddr::V4(a));
    let v6 = |a: std::net::Ipv6Addr| Some(IpAddr::V6(a));
    let mut table = Vec::new();
    if lab.family().has_v4() {
        table.extend([
            (
                "w1-p1",
                Proto::Tcp,
                IpAddr::V4(addr::HOST_A),
                v4(addr::EGRESS_IP_A),
            ),
            (
                "w1-p1",
                Proto::Udp,
                IpAddr::V4(addr::HOST_B),
                v4(addr::EGRESS_IP_B),
            ),
            (
                "w1-p1",
                Proto::Tcp,
                IpAddr::V4(addr::HOST_D),
                v4(addr::EGRESS_IP_B),
            ),
            (
                "w2-p1",
                Proto::Udp,
                IpAddr::V4(addr::HOST_A),
                v4(addr::EGRESS_IP_A),
            ),
            (
                "gw1-p1",
                Proto::Tcp,
                IpAddr::V4(addr::HOST_B),
                v4(addr::EGRESS_IP_B),
            ),
            (
                "w1-p1",
                Proto::Tcp,
                IpAddr::V4(addr::HOST_C),
                v4(w1_p1_at_c),
            ),
            (
                "w1-p2",
                Proto::Tcp,
                IpAddr::V4(addr::HOST_C),
                // Its own address, or under OVN its node's (OVN-Kubernetes' SNAT).
                lab.untouched_source("w1-p2").ok(),
            ),
            ("w1-p2", Proto::Tcp, IpAddr::V4(addr::HOST_A), None),
        ]);
    }
    if lab.family().has_v6() {
        let pod6 = |name: &str| lab.pod(name).unwrap().ipv6.map(IpAddr::V6);
        table.extend([
            (
                "w1-p1",
                Proto::Tcp,
                IpAddr::V6(addr6::HOST_A),
                v6(addr6::EGRESS_IP_A),
            ),
            (
                "w2-p1",
                Proto::Udp,
                IpAddr::V6(addr6::HOST_B),
                v6(addr6::EGRESS_IP_B),
            ),
            (
                "gw1-p1",
                Proto::Tcp,
                IpAddr::V6(addr6::HOST_A),
                v6(addr6::EGRESS_IP_A),
            ),
            (
                "w1-p2",
                Proto::Tcp,
                IpAddr::V6(addr6::HOST_C),
                pod6("w1-p2"),
            ),
        ]);
    }
    for (pod, proto, host, want) in table {
        assert_eq!(
            seen(lab, pod, proto, host),
            want,
            "{} lab: {pod} {proto} -> {host}",
            lab.spec().cni
        );
    }
}

/// Which program `node`'s agent put on which device, `<program>@<device>`, from its pins
/// (`link-<program>@<device>@<ifindex>` for a TCX link, `tc-...` for a legacy tc filter).
fn links(lab: &Lab, node: &str) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(lab.bpffs_dir(node))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| {
            let rest = n.strip_prefix("link-").or_else(|| n.strip_prefix("tc-"))?;
            Some(rest.rsplit_once('@').map_or(rest, |(h, _)| h).to_owned())
        })
        .collect();
    out.sort();
    out
}

/// How many times `program@device` of `node` ran (`kernel.bpf_stats_enabled` must be on),
/// from bpftool and the TCX link's pin.
fn run_count(lab: &Lab, node: &str, attached: &str) -> u64 {
    let head = format!("link-{attached}@");
    let pin = std::fs::read_dir(lab.bpffs_dir(node))
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| e.file_name().to_string_lossy().starts_with(&head))
        .map(|e| e.path())
        .unwrap_or_else(|| panic!("{node} has no TCX link {head}*"));
    let json = |args: &[&str]| -> serde_json::Value {
        let out = Command::new("bpftool").args(args).output().unwrap();
        assert!(out.status.success(), "bpftool {args:?}: {out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let pin = pin.to_string_lossy();
    let link = json(&["-j", "link", "show", "pinned", &pin]);
    let id = link["prog_id"]
        .as_u64()
        .expect("a link's prog_id")
        .to_string();
    json(&["-j", "prog", "show", "id", &id])["run_cnt"]
        .as_u64()
        .unwrap_or(0)
}

/// `ip route` of both families in `member`'s namespace.
fn routes(lab: &Lab, member: &str) -> String {
    let mut text = String::new();
    for fam in ["-4", "-6"] {
        let out = lab.exec(member, "ip", &[fam, "route", "show"]).unwrap();
        text.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    text
}

fn bpf_stats_on() {
    let path = Path::new("/proc/sys/kernel/bpf_stats_enabled");
    std::fs::write(path, "1").expect("enable kernel.bpf_stats_enabled");
}

#[test]
fn on_bridges_without_host_routes_each_network_gets_its_egress_ip_and_routes_are_followed() {
    bpf_stats_on();
    let lab = up_with_agents(spec(Cni::Bridge, Family::Dual)).unwrap();
    // The kernel's side of the wiring: no route per pod, the pods' veths on cni0, the
    // node's address on br-ul with the NIC enslaved.
    let w1 = lab.pod("w1-p1").unwrap().clone();
    let table = routes(&lab, "w1");
    assert!(
        !table.contains(&w1.ip.to_string()),
        "no host route to the pod: {table}"
    );
    let link = lab
        .exec("w1", "ip", &["-o", "link", "show", &w1.veth])
        .unwrap();
    assert!(
        String::from_utf8_lossy(&link.stdout).contains("master cni0"),
        "{link:?}"
    );
    assert_table(&lab, addr::W1_P1);
    // Each agent found its selected pods' veths by their peers, and put from_underlay on
    // the bridge that holds the node's address, where the tunnel's packets ran it.
    assert_eq!(
        links(&lab, "w1"),
        [
            "from_pod@veth-w1-p1",
            "from_tunnel@egress0",
            "from_underlay@br-ul"
        ]
    );
    assert!(
        links(&lab, "gw1").contains(&"from_underlay@br-ul".to_owned()),
        "{:?}",
        links(&lab, "gw1")
    );
    assert!(run_count(&lab, "gw1", "from_underlay@br-ul") > 0);
    assert!(run_count(&lab, "w1", "from_pod@veth-w1-p1") > 0);

    // The route step: E routed by the gateways, then not, with no policy edit.
    let host_e = IpAddr::V4(addr::HOST_E);
    let e = GatewayRoute::net_e(false);
    assert_eq!(seen(&lab, "w1-p1", Proto::Tcp, host_e), None);
    for gw in ["gw1", "gw2"] {
        lab.add_gateway_route(gw, &e).unwrap();
    }
    wait_until(std::time::Duration::from_secs(20), || {
        seen(&lab, "w1-p1", Proto::Tcp, host_e) == Some(IpAddr::V4(addr::EGRESS_IP_B))
    })
    .expect("E reached with egress IP B once the gateways route it");
    for gw in ["gw1", "gw2"] {
        lab.del_gateway_route(gw, &e).unwrap();
    }
    wait_until(std::time::Duration::from_secs(20), || {
        seen(&lab, "w1-p1", Proto::Tcp, host_e).is_none()
    })
    .expect("E unreachable again once no gateway routes it");
}

/// One failover case in a lab wired with `cni`: the stream survives, one holder.
fn failover_case(cni: Cni, kind: Kind) {
    let mut lab = passing_lab(cni);
    cluster::start_agents_and_wait(&mut lab, &[]).unwrap();
    let r = failover::run_case(&mut lab, kind, &Timing::default(), &format!("{cni}-{kind}"))
        .unwrap_or_else(|e| panic!("{cni} {kind}: {e:#}"));
    let report = format!("{}\n{}", CaseReport::header(), r.row());
    eprintln!("{report}");
    assert_eq!(r.tcp_verdict(), TcpVerdict::Survived, "{report}");
    assert_eq!(r.end_holders.len(), 1, "{report}");
    assert!(r.two_holders_ms <= 2000, "{report}");
    assert_eq!(r.moved(), kind.expects_move(), "{report}");
}

/// An IPv4 lab wired with `cni` that, before any agent runs, passes a pod's traffic to C
/// with its own address (`Lab::up` has checked every node's own traffic to C). Fails saying
/// what the pod saw and how its node is wired: no lab is rebuilt. Under emulation the OVS
/// wiring used to pass nothing on w1 when a fresh guest's first lab started w1's
/// `ovs-vswitchd` within 10 s of the boot (Open vSwitch 3.1.0 then starts no upcall
/// handler; `Lab::up` now waits for that and checks it).
fn passing_lab(cni: Cni) -> Lab {
    let host_c = IpAddr::V4(addr::HOST_C);
    let lab = Lab::up(spec(cni, Family::V4)).unwrap_or_else(|e| panic!("{cni} lab: {e:#}"));
    let reached = wait_until(std::time::Duration::from_secs(5), || {
        seen(&lab, "w1-p1", Proto::Tcp, host_c) == Some(IpAddr::V4(addr::W1_P1))
    });
    if reached.is_err() {
        panic!(
            "{cni} lab: w1-p1 does not reach host-c {host_c} with its own address {} before \
             any agent runs (it saw {:?}){}",
            addr::W1_P1,
            seen(&lab, "w1-p1", Proto::Tcp, host_c),
            lab.wiring_report("w1")
        );
    }
    lab
}

/// OVN-Kubernetes' EgressIP on the primary network for `w1-p1`, which our policy also
/// selects: its SNAT is what a far host on the primary network (C, behind the nodes'
/// router) sees before our agents start and after, while the destinations our rules cover
/// leave by our gateways with our egress IPs; another pod is untouched by either. Returns
/// the lab, agents running.
fn next_to_ovn_egress_ip(cni: Cni) -> Lab {
    let host_c = IpAddr::V4(addr::HOST_C);
    let ovn = Some(IpAddr::V4(addr::OVN_EGRESS_IP));
    let mut lab = passing_lab(cni);
    lab.add_ovn_egress_ip("w1", &["w1-p1"], addr::OVN_EGRESS_IP)
        .unwrap();
    let before = [
        seen(&lab, "w1-p1", Proto::Tcp, host_c),
        seen(&lab, "w1-p1", Proto::Udp, host_c),
    ];
    assert_eq!(before, [ovn, ovn], "OVN's EgressIP alone");
    cluster::start_agents_and_wait(&mut lab, &[]).unwrap();
    // Ours for what our rules cover, theirs for the rest of the primary network.
    let table = [
        ("w1-p1", Proto::Tcp, host_c, ovn),
        ("w1-p1", Proto::Udp, host_c, ovn),
        (
            "w1-p1",
            Proto::Tcp,
            IpAddr::V4(addr::HOST_A),
            Some(IpAddr::V4(addr::EGRESS_IP_A)),
        ),
        (
            "w1-p1",
            Proto::Udp,
            IpAddr::V4(addr::HOST_B),
            Some(IpAddr::V4(addr::EGRESS_IP_B)),
        ),
        ("w1-p2", Proto::Tcp, host_c, Some(IpAddr::V4(addr::W1_P2))),
    ];
    for (pod, proto, host, want) in table {
        assert_eq!(
            seen(&lab, pod, proto, host),
            want,
            "{cni}: {pod} {proto} -> {host}"
        );
    }
    // The agents read the EgressIP and claim nothing of it: no conflict is reported.
    let log = lab.agent_log("gw1");
    assert!(!log.contains("EgressIPClaimedElsewhere"), "{log}");
    lab
}

#[test]
fn on_bridges_next_to_ovn_kubernetes_egress_ip_each_keeps_its_destinations() {
    next_to_ovn_egress_ip(Cni::Bridge);
}

#[test]
fn on_bridges_a_holder_cut_from_the_underlay_is_replaced_and_tcp_survives() {
    failover_case(Cni::Bridge, Kind::UnderlayCut);
}

/// The OVS tests are ignored where `cargo test` runs by default: this host's kernel has no
/// openvswitch module, and libtest counts them as ignored with the reason. `cargo xtask
/// test` runs them in the Linux 6.1 guest with `--include-ignored`: wherever they run, they
/// need Open vSwitch's kernel module, 802.1Q and OVS's userspace (its schema), and fail
/// naming what is missing, so that they cannot pass without OVS.
fn need_ovs() {
    let missing: Vec<&str> = [
        "/sys/module/openvswitch",
        "/sys/module/8021q",
        "/usr/share/openvswitch/vswitch.ovsschema",
    ]
    .into_iter()
    .filter(|p| !Path::new(p).exists())
    .collect();
    assert!(
        missing.is_empty(),
        "no {missing:?} here: the OVS tests need them (`cargo xtask bootstrap` installs \
         openvswitch-switch; `cargo xtask vm` loads the modules, and `cargo xtask test` runs \
         these tests there)"
    );
}

/// One lab (its bring-up is a minute under emulation): OVN's EgressIP next to ours, then
/// the OVS wiring's own facts.
#[test]
#[ignore = "needs Open vSwitch and 802.1Q: cargo xtask test runs it in the Linux 6.1 guest"]
fn like_ovn_kubernetes_pods_by_iface_id_over_vlans_next_to_its_egress_ip() {
    need_ovs();
    let lab = next_to_ovn_egress_ip(Cni::Ovs);
    let ports = lab
        .ovs_vsctl("w1", &["--columns=name,external_ids", "list", "interface"])
        .unwrap();
    let ports = String::from_utf8_lossy(&ports.stdout).into_owned();
    assert!(ports.contains("iface-id=payments_w1-p1"), "{ports}");
    assert_table(&lab, addr::OVN_EGRESS_IP);
    assert_eq!(
        links(&lab, "w1"),
        [
            "from_pod@veth-w1-p1",
            "from_tunnel@egress0",
            "from_underlay@br-ex"
        ]
    );
    // w2 runs --pod-devices auto: the veth's peer finds its pod as OVS's iface-id does w1's.
    assert!(
        links(&lab, "w2").contains(&"from_pod@veth-w2-p1".to_owned()),
        "{:?}",
        links(&lab, "w2")
    );
    // The holder of egress IP A (either gateway) serves it on the VLAN sec-a.
    let (holder, _) = cluster::holder(&lab, addr::EGRESS_IP_A).expect("a holder of A");
    let on = links(&lab, &holder);
    for want in ["from_secondary@sec-a", "from_underlay@br-ex"] {
        assert!(on.contains(&want.to_owned()), "{holder}: {on:?}");
    }
    for node in ["w1", "w2"] {
        let agent = lab.agent_log(node);
        assert!(
            !agent.contains("OVSDB at"),
            "no OVSDB error on {node}: {agent}"
        );
    }
}

#[test]
#[ignore = "needs Open vSwitch and 802.1Q: cargo xtask test runs it in the Linux 6.1 guest"]
fn like_ovn_kubernetes_a_notready_holder_hands_over_and_tcp_survives() {
    need_ovs();
    failover_case(Cni::Ovs, Kind::NotReady);
}

/// The agent's OVSDB client against a real `ovsdb-server` (userspace only: no kernel
/// module, no `ovs-vswitchd`): the ports `ovs-vsctl` gave an `iface-id`, nothing else; a
/// socket nobody listens on is an error naming it and the flag.
#[test]
fn the_ovsdb_client_reads_the_ports_ovs_vsctl_named() {
    let schema = "/usr/share/openvswitch/vswitch.ovsschema";
    assert!(
        Path::new(schema).is_file(),
        "{schema} missing: cargo xtask bootstrap installs openvswitch-switch"
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let db = d.join("conf.db");
    let sock = d.join("db.sock");
    let run = |program: &str, args: &[&str]| {
        let out = Command::new(program)
            .args(args)
            .env("OVS_RUNDIR", d)
            .env("OVS_LOGDIR", d)
            .env("OVS_DBDIR", d)
            .output()
            .unwrap();
        assert!(out.status.success(), "{program} {args:?}: {out:?}");
    };
    run("ovsdb-tool", &["create", &db.to_string_lossy(), schema]);
    let remote = format!("--remote=punix:{}", sock.display());
    run(
        "ovsdb-server",
        &[
            &db.to_string_lossy(),
            &remote,
            "--pidfile",
            "--detach",
            "--no-chdir",
        ],
    );
    let stop = || {
        let pid = std::fs::read_to_string(d.join("ovsdb-server.pid")).unwrap_or_default();
        let _ = Command::new("kill").arg(pid.trim()).status();
    };
    let vsctl = |args: &[&str]| {
        run(
            "ovs-vsctl",
            &[
                &[&format!("--db=unix:{}", sock.display()), "--no-wait"],
                args,
            ]
            .concat(),
        );
    };
    vsctl(&["init"]);
    vsctl(&[
        "add-br",
        "br-int",
        "--",
        "add-port",
        "br-int",
        "a1b2c3d4e5f6a7b",
        "--",
        "set",
        "interface",
        "a1b2c3d4e5f6a7b",
        "external_ids:iface-id=shop_web",
        "external_ids:ip_addresses=10.128.2.5/23",
        "--",
        "add-port",
        "br-int",
        "plain",
    ]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ports = rt.block_on(egress_agent::iface::ovsdb::pod_ports(&sock));
    stop();
    assert_eq!(
        ports.unwrap(),
        [egress_agent::iface::ovsdb::PodPort {
            name: "a1b2c3d4e5f6a7b".into(),
            iface_id: "shop_web".into(),
        }]
    );
    let err = rt
        .block_on(egress_agent::iface::ovsdb::pod_ports(
            &d.join("nobody.sock"),
        ))
        .unwrap_err();
    assert!(err.contains("nobody.sock (--ovsdb)"), "{err}");
}

/// The OVN tests need, besides [`need_ovs`]'s, OVN's schemas and the geneve module
/// (`cargo xtask vm` loads it).
fn need_ovn() {
    need_ovs();
    let missing: Vec<&str> = [
        "/usr/share/ovn/ovn-nb.ovsschema",
        "/usr/bin/ovn-controller",
        "/sys/module/geneve",
    ]
    .into_iter()
    .filter(|p| !Path::new(p).exists())
    .collect();
    assert!(
        missing.is_empty(),
        "no {missing:?} here: the OVN tests need them (`cargo xtask bootstrap` installs \
         ovn-central and ovn-host; `cargo xtask vm` loads geneve)"
    );
}

/// Real OVN as OVN-Kubernetes builds it ([`Cni::Ovn`]), in `mode`: before any agent, a
/// pod reaches a pod of another node over OVN's Geneve with its own address, and host C
/// with its node's (the cluster subnet's SNAT); with the agents, the table, also while
/// bonds run on their backup ports ([`bonds_fail_over`]) and with payments isolated.
fn on_ovn(mode: OvnGateway) {
    need_ovn();
    let cni = Cni::Ovn(mode);
    let mut lab = Lab::up(spec(cni, Family::V4)).unwrap_or_else(|e| panic!("{cni} lab: {e:#}"));
    let w2_p1 = lab.pod("w2-p1").unwrap().ip;
    let log = lab.dir().join("w2-p1-echo.log");
    let port = addr::ECHO_PORT.to_string();
    let _server = lab
        .ns("w2-p1")
        .unwrap()
        .spawn(
            &lab.spec().echo_bin,
            &["serve", "--tcp", &port, "--udp", &port],
            &log,
        )
        .unwrap();
    let host_c = IpAddr::V4(addr::HOST_C);
    let reached = wait_until(std::time::Duration::from_secs(10), || {
        seen(&lab, "w1-p1", Proto::Tcp, w2_p1) == Some(IpAddr::V4(addr::W1_P1))
            && seen(&lab, "w1-p1", Proto::Udp, w2_p1) == Some(IpAddr::V4(addr::W1_P1))
            && seen(&lab, "w1-p1", Proto::Tcp, host_c) == Some(IpAddr::V4(addr::W1))
    });
    if reached.is_err() {
        panic!(
            "{cni} lab before any agent: w1-p1 saw by w2-p1 {:?} (tcp), {:?} (udp), by host-c \
             {:?}{}",
            seen(&lab, "w1-p1", Proto::Tcp, w2_p1),
            seen(&lab, "w1-p1", Proto::Udp, w2_p1),
            seen(&lab, "w1-p1", Proto::Tcp, host_c),
            lab.wiring_report("w1")
        );
    }
    cluster::start_agents_and_wait(&mut lab, &[]).unwrap();
    assert_table(&lab, addr::W1);
    // Pod to pod stays OVN's, across nodes, with the agents running.
    assert_eq!(
        seen(&lab, "w1-p1", Proto::Tcp, w2_p1),
        Some(IpAddr::V4(addr::W1_P1))
    );
    bonds_fail_over(&lab);
    // payments isolated as OVN-Kubernetes renders its NetworkPolicy: the table still
    // holds (replies go into the pods, around OVN's ACLs), and nothing else gets in.
    lab.isolate_payments().unwrap();
    assert_table(&lab, addr::W1);
    let failed: Vec<_> = lab
        .check_isolation()
        .unwrap()
        .into_iter()
        .filter(|c| !c.ok)
        .collect();
    assert!(failed.is_empty(), "{cni}, payments isolated: {failed:#?}");
}

/// The bonds fail over under the table: the underlay switch's ports facing the primary
/// `eth0` of w1 and of the holder of egress IP A go down, as failing switch ports do; each
/// bond moves to `eth1` and the table holds (w1's tunnel to the gateways, the gateway's
/// underlay and its VLAN off the bond to network A, OVN's Geneve and SNAT all on the
/// backup ports). Back up, each bond returns to its primary.
fn bonds_fail_over(lab: &Lab) {
    let (holder, _) = cluster::holder(lab, addr::EGRESS_IP_A).expect("a holder of A");
    let nodes = ["w1", holder.as_str()];
    let report = || -> String {
        nodes
            .iter()
            .map(|n| format!("{n}: {:?}; ", lab.bond_active_port(n)))
            .collect()
    };
    // Within 5 s (scaled): miimon looks every 100 ms.
    let wait_on = |link: &str, why: &str| {
        wait_until(std::time::Duration::from_secs(5), || {
            nodes
                .iter()
                .all(|n| lab.bond_active_port(n).unwrap().as_deref() == Some(link))
        })
        .unwrap_or_else(|e| panic!("bonds not on {link} {why}: {e}; {}", report()))
    };
    wait_on("eth0", "(their primary) to begin with");
    let start = std::time::Instant::now();
    for node in nodes {
        lab.set_underlay_switch_port(node, "eth0", false).unwrap();
    }
    let moved = wait_on("eth1", "once eth0 lost its carrier");
    assert_table(lab, addr::W1);
    for node in nodes {
        lab.set_underlay_switch_port(node, "eth0", true).unwrap();
    }
    let back = wait_on("eth0", "once its carrier returned");
    eprintln!(
        "bonds of {nodes:?}: on eth1 {} ms after the switch ports facing eth0 were down, \
         back on eth0 {} ms after they were up; the step took {:.1} s",
        moved.as_millis(),
        back.as_millis(),
        start.elapsed().as_secs_f64()
    );
}

#[test]
#[ignore = "needs Open vSwitch, OVN and geneve: run it in the Linux 6.1 guest (cargo xtask vm)"]
fn on_ovn_shared_gateway_pods_cross_nodes_over_geneve_and_each_network_gets_its_egress_ip() {
    on_ovn(OvnGateway::Shared);
}

#[test]
#[ignore = "needs Open vSwitch, OVN and geneve: run it in the Linux 6.1 guest (cargo xtask vm)"]
fn on_ovn_local_gateway_pods_cross_nodes_over_geneve_and_each_network_gets_its_egress_ip() {
    on_ovn(OvnGateway::Local);
}
