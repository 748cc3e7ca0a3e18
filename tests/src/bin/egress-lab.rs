//! `cargo xtask lab`: bring up the lab, run one agent per node, show per-destination
//! egress as a table, then the route step (a route to network E added on the gateways and
//! removed again, with no policy edit: `destinationsFrom: Routes` follows), show a
//! gateway's maps, tear down. Exits non-zero if a row or the route step fails.
//! `--ipv6`: IPv6-only pods (the table's IPv6 rows) over an IPv6 underlay; `--dual-stack`:
//! both families' rows, over an IPv4 underlay; `--underlay ipv4|ipv6` overrides the
//! underlay's family. `--cni routed|bridge|ovs|ovn|ovn-local`: how pods and the underlay are wired
//! (`egress_tests::lab::Cni`; `ovs` needs Open vSwitch and 802.1Q, `ovn` and `ovn-local` also OVN, as in the Linux 6.1
//! guest of `cargo xtask vm`).
//!
//! `--failover [--rounds N]`: instead of the table, break the holder of egress IP A in
//! every way `egress_tests::failover` knows while a pod streams through it, one row per
//! case; exits non-zero if a TCP stream did not survive or two gateways held the IP for
//! more than a second.
//!
//! `--upgrade --old BIN [--old-label L] [--old-keyed]`: the lab's agents start as `BIN`
//! (an older build), then a rolling upgrade to this directory's `egress-agent` (signing
//! its hellos with the lab's key) and a rollback, one row per node replaced
//! (`egress_tests::failover::upgrade`); exits non-zero if egress IP A moved, two gateways
//! held it, or a TCP stream broke. `cargo xtask upgrade-test --from <rev>` builds `BIN`.

use std::{
    net::IpAddr,
    path::PathBuf,
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use egress_tests::{
    cluster, failover,
    lab::{self, Family, GatewayRoute, Lab, LabSpec, Proto, Query, Underlay, addr, addr6},
    netns, scale_lab, spread,
};

struct Row {
    pod: &'static str,
    proto: Proto,
    host: (&'static str, IpAddr),
    /// `None`: the destination must be unreachable for this pod.
    expect: Option<IpAddr>,
    why: &'static str,
}

/// The table for the lab's families: the IPv4 rows, and the same rows over IPv6.
fn rows(lab: &Lab) -> Vec<Row> {
    let family = lab.family();
    let mut out = Vec::new();
    if family.has_v4() {
        out.extend(rows_v4().into_iter().map(|r| as_wired(lab, r)));
    }
    if family.has_v6() {
        // Each IPv4 address of a row -> its IPv6 counterpart in the lab.
        let to_v6 = |ip: IpAddr| -> IpAddr {
            let pairs = [
                (addr::HOST_A, addr6::HOST_A),
                (addr::HOST_B, addr6::HOST_B),
                (addr::HOST_C, addr6::HOST_C),
                (addr::HOST_D, addr6::HOST_D),
                (addr::EGRESS_IP_A, addr6::EGRESS_IP_A),
                (addr::EGRESS_IP_B, addr6::EGRESS_IP_B),
            ];
            let v6 = pairs
                .iter()
                .find(|(a, _)| IpAddr::V4(*a) == ip)
                .map(|(_, b)| *b)
                .or_else(|| {
                    lab.pods()
                        .iter()
                        .find(|p| IpAddr::V4(p.ip) == ip)
                        .and_then(|p| p.ipv6)
                });
            v6.map_or(ip, IpAddr::V6)
        };
        out.extend(rows_v4().into_iter().map(|r| Row {
            host: (r.host.0, to_v6(r.host.1)),
            expect: r.expect.map(to_v6),
            ..r
        }));
    }
    out
}

/// `r` as the lab's wiring leaves untouched traffic: a row expecting its pod's own
/// address expects what the wiring makes of it ([`Lab::untouched_source`]: under OVN the
/// node's address).
fn as_wired(lab: &Lab, r: Row) -> Row {
    let own = lab.pod(r.pod).ok().map(|p| IpAddr::V4(p.ip));
    if r.expect.is_some() && r.expect == own {
        let expect = lab.untouched_source(r.pod).ok().or(r.expect);
        return Row { expect, ..r };
    }
    r
}

fn rows_v4() -> Vec<Row> {
    use addr::*;
    let a = ("host-a", IpAddr::V4(HOST_A));
    let b = ("host-b", IpAddr::V4(HOST_B));
    let c = ("host-c", IpAddr::V4(HOST_C));
    let d = ("host-d", IpAddr::V4(HOST_D));
    let ea = Some(IpAddr::V4(EGRESS_IP_A));
    let eb = Some(IpAddr::V4(EGRESS_IP_B));
    vec![
        Row {
            pod: "w1-p1",
            proto: Proto::Tcp,
            host: a,
            expect: ea,
            why: "network A: egress IP A",
        },
        Row {
            pod: "w1-p1",
            proto: Proto::Udp,
            host: a,
            expect: ea,
            why: "network A: egress IP A",
        },
        Row {
            pod: "w1-p1",
            proto: Proto::Tcp,
            host: b,
            expect: eb,
            why: "same pod, network B: egress IP B",
        },
        Row {
            pod: "w1-p1",
            proto: Proto::Udp,
            host: b,
            expect: eb,
            why: "same pod, network B: egress IP B",
        },
        Row {
            pod: "w1-p1",
            proto: Proto::Tcp,
            host: d,
            expect: eb,
            why: "behind a router on B: gateways' static route",
        },
        Row {
            pod: "w1-p1",
            proto: Proto::Udp,
            host: d,
            expect: eb,
            why: "behind a router on B: gateways' static route",
        },
        Row {
            pod: "w2-p1",
            proto: Proto::Tcp,
            host: a,
            expect: ea,
            why: "other worker",
        },
        Row {
            pod: "w2-p1",
            proto: Proto::Udp,
            host: b,
            expect: eb,
            why: "other worker",
        },
        Row {
            pod: "gw1-p1",
            proto: Proto::Tcp,
            host: a,
            expect: ea,
            why: "pod on a gateway node",
        },
        Row {
            pod: "gw1-p1",
            proto: Proto::Udp,
            host: b,
            expect: eb,
            why: "pod on a gateway node",
        },
        Row {
            pod: "w1-p1",
            proto: Proto::Tcp,
            host: c,
            expect: Some(IpAddr::V4(W1_P1)),
            why: "outside every rule: untouched",
        },
        Row {
            pod: "w1-p2",
            proto: Proto::Tcp,
            host: c,
            expect: Some(IpAddr::V4(W1_P2)),
            why: "unselected pod: untouched",
        },
        Row {
            pod: "w1-p2",
            proto: Proto::Tcp,
            host: a,
            expect: None,
            why: "unselected pod: no way to A",
        },
        Row {
            pod: "w1-p2",
            proto: Proto::Tcp,
            host: d,
            expect: None,
            why: "unselected pod: no way to D",
        },
        Row {
            pod: "w2-p2",
            proto: Proto::Udp,
            host: b,
            expect: None,
            why: "other namespace: not selected",
        },
    ]
}

fn main() -> ExitCode {
    match real_main() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("egress-lab: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// How `--cni` wired the lab, in words.
fn wiring(cni: lab::Cni) -> &'static str {
    match cni {
        lab::Cni::Routed => "like Calico (a host route per pod)",
        lab::Cni::Bridge => {
            "on bridges (pods on cni0 without host routes, the node's address on br-ul)"
        }
        lab::Cni::Ovs => {
            "like OVN-Kubernetes (pods on br-int by iface-id, the node's address on br-ex, \
             VLAN secondary networks)"
        }
        lab::Cni::Ovn(lab::OvnGateway::Shared) => {
            "on OVN as OVN-Kubernetes builds it, shared gateway (pods leave through GR_<node> \
             and br-ex, SNAT to the node's address; Geneve between nodes; VLAN secondary \
             networks)"
        }
        lab::Cni::Ovn(lab::OvnGateway::Local) => {
            "on OVN as OVN-Kubernetes builds it, local gateway (pods leave through ovn-k8s-mp0 \
             and the node's routing, masqueraded to the node's address; Geneve between \
             nodes; VLAN secondary networks)"
        }
    }
}

fn arg(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

/// The word after `name` on the command line.
fn value(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).cloned()
}

fn real_main() -> Result<bool> {
    if let Some(prefix) = value("--down") {
        Lab::teardown_by_prefix(&prefix)?;
        println!("lab {prefix} removed");
        return Ok(true);
    }
    if arg("--down") {
        bail!("--down needs the lab's prefix");
    }
    let family = family_arg()?;
    let underlay = underlay_arg()?;
    netns::install_signal_teardown()?;
    let bin_dir = std::env::current_exe()?
        .parent()
        .map(PathBuf::from)
        .context("no directory for the current executable")?;
    let agent = agent_bin(&bin_dir)?;
    if let Some(nodes) = value("--nodes") {
        return scale(&nodes, &bin_dir);
    }
    let t0 = Instant::now();
    let mut spec = lab_spec(family, underlay)?;
    if arg("--upgrade") {
        let old = failover::upgrade::Build {
            label: value("--old-label").unwrap_or_else(|| "old".to_owned()),
            bin: value("--old")
                .map(PathBuf::from)
                .context("--upgrade needs --old BIN")?,
            keyed: arg("--old-keyed"),
        };
        let new = failover::upgrade::Build {
            label: "new".to_owned(),
            bin: agent,
            keyed: true,
        };
        return upgrade_table(spec, &old, &new);
    }
    if arg("--failover") {
        let rounds = match value("--rounds") {
            Some(r) => r.parse().context("--rounds needs a positive number")?,
            None => 1,
        };
        return failover_table(spec, rounds);
    }
    // Every pod's network is set up after the agents start, through egress-cni chained
    // after the lab's wiring, as a container runtime runs a conflist.
    for pod in &mut spec.pods {
        pod.wired_later = true;
    }
    let mut lab = Lab::up(spec)?;
    print_lab_up(&lab, t0);
    lab.start_agents(&agent)?;
    lab.node_forwarding()?;
    wire_pods_through_the_plugin(&lab, &bin_dir.join("egress-cni"))?;
    wait_converged(&lab, t0);
    println!(
        "policy {}:\n{}",
        lab::POLICY_FILE,
        indent(&lab::sample_policy_for(family))
    );
    let isolated = lab.spec().cni.ovn().is_some();
    if isolated {
        let doc = lab.isolate_payments()?;
        println!(
            "payments isolated (OVN: default deny both ways, allow-related rules, as \
             OVN-Kubernetes renders it), {}:\n{}",
            lab::ISOLATION_FILE,
            indent(&doc)
        );
    }
    let holders = holders(&lab);
    let mut ok_all = print_rows(&lab, &holders);
    ok_all &= programs_step(&lab);
    if isolated {
        ok_all &= isolation_step(&lab)?;
        ok_all &= ovn_egress_ip_step(&mut lab, &agent)?;
    }
    for v6 in [false, true] {
        if (v6 && family.has_v6()) || (!v6 && family.has_v4()) {
            ok_all &= route_step(&lab, v6)?;
        }
    }
    for v6 in [false, true] {
        if (v6 && family.has_v6()) || (!v6 && family.has_v4()) {
            ok_all &= spread_step(&lab, v6)?;
        }
    }
    if let Some((_, gw, _)) = holders.first() {
        print_maps(&lab, &agent, gw)?;
    }
    if !ok_all {
        print_agent_log_tails(&lab);
    }
    println!(
        "\n{}",
        if ok_all {
            "all rows ok"
        } else {
            "SOME ROWS FAILED"
        }
    );
    finish(lab, arg("--keep"))?;
    Ok(ok_all)
}

/// `--nodes N [--gateways G]`: the lab at that scale, its summary ([`scale_lab`]).
fn scale(nodes: &str, bin_dir: &std::path::Path) -> Result<bool> {
    let nodes: u32 = nodes.parse().context("--nodes needs a number of nodes")?;
    let gateways = value("--gateways")
        .map(|g| g.parse().context("--gateways needs a number of gateways"))
        .transpose()?;
    let mut opts = scale_lab::Options::for_nodes(nodes, gateways, bin_dir)?;
    if let Some(ms) = value("--probe-interval-ms") {
        opts.probe_interval_ms = ms
            .parse()
            .context("--probe-interval-ms needs milliseconds")?;
    }
    if let Some(n) = value("--probe-misses") {
        opts.probe_misses = n.parse().context("--probe-misses needs a number")?;
    }
    opts.keep = arg("--keep");
    let report = scale_lab::run(&opts)?;
    print!("{}", scale_lab::print(&report));
    Ok(report.failures().is_empty())
}

/// `--ipv6` or `--dual-stack`; IPv4 without either.
fn family_arg() -> Result<Family> {
    Ok(match (arg("--ipv6"), arg("--dual-stack")) {
        (false, false) => Family::V4,
        (true, false) => Family::V6,
        (false, true) => Family::Dual,
        (true, true) => bail!("--ipv6 and --dual-stack exclude each other"),
    })
}

/// The agent next to this binary (cargo builds both into one directory).
fn agent_bin(bin_dir: &std::path::Path) -> Result<PathBuf> {
    let agent = bin_dir.join("egress-agent");
    if !agent.exists() {
        bail!(
            "{} is missing: run `cargo build --release -p egress-agent` (cargo xtask lab does)",
            agent.display()
        );
    }
    Ok(agent)
}

/// `--underlay ipv4|ipv6`, if given.
fn underlay_arg() -> Result<Option<Underlay>> {
    Ok(match value("--underlay").as_deref() {
        None => None,
        Some("ipv4") => Some(Underlay::V4),
        Some("ipv6") => Some(Underlay::V6),
        Some(other) => bail!("--underlay {other:?}: expected ipv4 or ipv6"),
    })
}

/// The lab of `family` over `underlay`, with `--cni` from the command line.
fn lab_spec(family: Family, underlay: Option<Underlay>) -> Result<LabSpec> {
    let echo = lab::locate_echo_bin()?;
    let mut spec = LabSpec::new(echo).with_family(family);
    if let Some(u) = underlay {
        spec.underlay = u;
    }
    if let Some(c) = value("--cni") {
        spec.cni = c.parse()?;
    }
    Ok(spec)
}

/// One line on what is up and how it is wired.
fn print_lab_up(lab: &Lab, t0: Instant) {
    println!(
        "lab {} up in {:.1}s: 2 workers, 2 gateways, networks A and B behind the gateways, D and E behind a router on B, C routed; pods {}, over the {} underlay, wired {}",
        lab.prefix(),
        t0.elapsed().as_secs_f64(),
        match lab.family() {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
            Family::Dual => "dual stack",
        },
        lab.spec().underlay,
        wiring(lab.spec().cni),
    );
}

/// Waits until every egress IP has a holder and `w1-p1` leaves through A's; says which.
fn wait_converged(lab: &Lab, t0: Instant) {
    let family = lab.family();
    let probe = if family.has_v4() {
        (IpAddr::V4(addr::HOST_A), IpAddr::V4(addr::EGRESS_IP_A))
    } else {
        (IpAddr::V6(addr6::HOST_A), IpAddr::V6(addr6::EGRESS_IP_A))
    };
    let want_holders = if family == Family::Dual { 4 } else { 2 };
    // Waits scale with EGRESS_TEST_TIME_SCALE (under emulation, in the Linux 6.1 VM).
    let converge = Duration::from_secs(30) * cluster::time_scale();
    let ready = cluster::wait_until(Duration::from_secs(30), || {
        holders(lab).len() == want_holders
            && cluster::seen(lab, "w1-p1", Proto::Tcp, probe.0) == Some(probe.1)
    });
    match ready {
        Ok(_) => println!(
            "agents converged {:.1}s after start\n",
            t0.elapsed().as_secs_f64()
        ),
        Err(_) => println!(
            "agents did not converge within {} s; showing what works\n",
            converge.as_secs()
        ),
    }
}

/// The table: each row's query, the source the far host saw, and who holds the expected
/// one. `false` if a row did not see what it expected.
fn print_rows(lab: &Lab, holders: &[(IpAddr, String, String)]) -> bool {
    println!(
        "{:<7} {:<4} {:<30} {:<16} {:<16} {:<8} {:<10} {:<3}  why",
        "pod",
        "",
        "destination",
        "expected source",
        "observed source",
        "gateway",
        "interface",
        "ok",
    );
    let mut ok_all = true;
    for r in rows(lab) {
        ok_all &= print_row(lab, holders, &r);
    }
    ok_all
}

/// One row of [`print_rows`]; `true` if it saw what it expected.
fn print_row(lab: &Lab, holders: &[(IpAddr, String, String)], r: &Row) -> bool {
    let q = Query::new(r.proto, r.host.1, addr::ECHO_PORT)
        .timeout(Duration::from_millis(1500) * cluster::time_scale());
    let seen = lab.query_with(r.pod, &q);
    let observed = match &seen {
        Ok(s) => s.ip.to_string(),
        Err(_) => "unreachable".into(),
    };
    let expected = r.expect.map_or("unreachable".into(), |e| e.to_string());
    let ok = observed == expected;
    let (gw, ifc) = r
        .expect
        .and_then(|e| holders.iter().find(|h| h.0 == e))
        .map_or(("-".to_string(), "-".to_string()), |h| {
            (h.1.clone(), h.2.clone())
        });
    println!(
        "{:<7} {:<4} {:<30} {:<16} {:<16} {:<8} {:<10} {:<3}  {}",
        r.pod,
        r.proto.to_string(),
        format!(
            "{} {}",
            r.host.0,
            std::net::SocketAddr::new(r.host.1, addr::ECHO_PORT)
        ),
        expected,
        observed,
        gw,
        ifc,
        if ok { "ok" } else { "FAIL" },
        r.why
    );
    ok
}

/// `egress-agent maps` on `gw`.
fn print_maps(lab: &Lab, agent: &std::path::Path, gw: &str) -> Result<()> {
    println!("\n== egress-agent maps on {gw} ==");
    let out = Command::new(agent)
        .args(["maps", "--bpffs-dir"])
        .arg(lab.bpffs_dir(gw))
        .output()?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// The last 15 lines of each agent's log, on stderr.
fn print_agent_log_tails(lab: &Lab) {
    for n in ["w1", "w2", "gw1", "gw2"] {
        eprintln!("--- agent log {n} (tail) ---");
        let log = lab.agent_log(n);
        for l in log
            .lines()
            .rev()
            .take(15)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
        {
            eprintln!("{l}");
        }
    }
}

/// Leaves the lab up (`--keep`) and says how to remove it, or tears it down.
fn finish(mut lab: Lab, keep: bool) -> Result<()> {
    if keep {
        println!("{}", lab.how_to());
        let p = lab.leak();
        println!("lab {p} left up; remove it with: cargo xtask lab --down {p}");
    } else {
        lab.stop_agents();
        lab.down()?;
        println!("lab torn down");
    }
    Ok(())
}

/// The programs each agent has loaded, as the kernel lists them: a gateway's agent has
/// `from_secondary` (loaded before it serves anything: a takeover must not wait for the
/// verifier), a worker's never (most nodes are not gateways, and the verifier is most of
/// an agent's start). `false` if a node has other programs.
fn programs_step(lab: &Lab) -> bool {
    use egress_agent::ebpf::{FROM_POD, FROM_SECONDARY, FROM_TUNNEL, FROM_UNDERLAY};
    println!("\nPrograms each agent loaded (the kernel's list):");
    let mut ok = true;
    for n in lab.nodes() {
        let loaded = egress_tests::hooks::loaded_with_maps_in(&lab.bpffs_dir(n.name));
        let mut want = vec![FROM_POD, FROM_TUNNEL, FROM_UNDERLAY];
        if n.gateway {
            want.push(FROM_SECONDARY);
        }
        want.sort_unstable();
        let good = loaded == want;
        println!(
            "  {:<8} {:<8} {:<54} {}",
            n.name,
            if n.gateway { "gateway" } else { "worker" },
            loaded.join(", "),
            if good { "ok" } else { "FAIL" }
        );
        if !good {
            println!("           expected {}", want.join(", "));
        }
        ok &= good;
    }
    ok
}

/// How long the route step waits for each change to show in new traffic.
const ROUTE_DEADLINE: Duration = Duration::from_secs(15);

/// Under OVN with `payments` isolated: what its ACLs let through and what they do not
/// ([`Lab::check_isolation`]), as a small table; `Ok(false)` if a check failed.
fn isolation_step(lab: &Lab) -> Result<bool> {
    println!("\nNetworkPolicy under OVN:");
    let mut ok = true;
    for c in lab.check_isolation()? {
        println!(
            "  {:<62} {:<4} ({})",
            c.what,
            if c.ok { "ok" } else { "FAIL" },
            c.seen
        );
        ok &= c.ok;
    }
    Ok(ok)
}

/// Under OVN: OVN-Kubernetes' own EgressIP on the primary network, rendered in OVN
/// ([`Lab::add_ovn_egress_ip`]) with w2 as the egress node, for w1-p1 (which our policy
/// selects) and for w1-p2 (which no policy of ours selects). Who wins for which
/// destination, with our agents running, stopped (all of them) and started again:
/// theirs for the primary network (host-c) throughout, ours for what our rules cover.
/// Prints a small table; `Ok(false)` if a row saw another source.
fn ovn_egress_ip_step(lab: &mut Lab, agent: &std::path::Path) -> Result<bool> {
    let (theirs, theirs_2) = (
        IpAddr::V4(addr::OVN_EGRESS_IP),
        IpAddr::V4(addr::OVN_EGRESS_IP_2),
    );
    lab.add_ovn_egress_ip("w2", &["w1-p1"], addr::OVN_EGRESS_IP)?;
    lab.add_ovn_egress_ip("w2", &["w1-p2"], addr::OVN_EGRESS_IP_2)?;
    let (host_a, host_c) = (IpAddr::V4(addr::HOST_A), IpAddr::V4(addr::HOST_C));
    let theirs_rows = [
        ("w1-p1", Proto::Tcp, ("host-c", host_c), theirs),
        ("w1-p1", Proto::Udp, ("host-c", host_c), theirs),
        ("w1-p2", Proto::Tcp, ("host-c", host_c), theirs_2),
        ("w1-p2", Proto::Udp, ("host-c", host_c), theirs_2),
    ];
    let ours = (
        "w1-p1",
        Proto::Tcp,
        ("host-a", host_a),
        IpAddr::V4(addr::EGRESS_IP_A),
    );
    println!(
        "\nOVN-Kubernetes' EgressIP beside ours (egress node w2; w1-p1 {theirs}, w1-p2 {theirs_2}):"
    );
    let mut ok = true;
    let mut check = |lab: &Lab, phase: &str, rows: &[(&str, Proto, (&str, IpAddr), IpAddr)]| {
        for &(pod, proto, (name, host), want) in rows {
            // A change of OVN's or of ours shows within the deadline.
            let got = cluster::wait_until(ROUTE_DEADLINE, || {
                cluster::seen(lab, pod, proto, host) == Some(want)
            })
            .map(|_| want)
            .ok()
            .or_else(|| cluster::seen(lab, pod, proto, host));
            let good = got == Some(want);
            ok &= good;
            println!(
                "  {phase:<15} {pod} {proto} -> {name:<7} expect {want:<15} {:<4} (saw {})",
                if good { "ok" } else { "FAIL" },
                got.map_or_else(|| "nothing".to_owned(), |a| a.to_string())
            );
        }
    };
    let mut running: Vec<_> = theirs_rows.to_vec();
    running.push(ours);
    check(lab, "agents running", &running);
    let nodes: Vec<&'static str> = lab.nodes().iter().map(|n| n.name).collect();
    lab.stop_agents();
    check(lab, "agents stopped", &theirs_rows);
    let t = Instant::now();
    lab.start_agents(agent)?;
    lab.node_forwarding()?;
    // Until each new agent has finished a pass (its /readyz) the pinned datapath serves
    // alone: a change, such as the route step's next, would wait for them.
    cluster::wait_until(Duration::from_secs(60), || {
        nodes.iter().all(|n| lab.agent_ready(n))
    })
    .context("the agents started again never finished a pass (/readyz)")?;
    println!("agents started again in {:.1}s", t.elapsed().as_secs_f64());
    check(lab, "agents started", &running);
    Ok(ok)
}

/// The route step, for one family: `w1-p1` to host-e (network E, which no gateway routes)
/// before, after the route to E is added on both gateways, and after it is deleted again;
/// nothing else changes (no policy edit). Prints a small table; `Ok(false)` if a step did
/// not show within [`ROUTE_DEADLINE`].
fn route_step(lab: &Lab, v6: bool) -> Result<bool> {
    const POD: &str = "w1-p1";
    const GATEWAYS: [&str; 2] = ["gw1", "gw2"];
    let route = GatewayRoute::net_e(v6);
    let (host, egress) = if v6 {
        (IpAddr::V6(addr6::HOST_E), IpAddr::V6(addr6::EGRESS_IP_B))
    } else {
        (IpAddr::V4(addr::HOST_E), IpAddr::V4(addr::EGRESS_IP_B))
    };
    // A short timeout: a lost SYN (the router rate-limits its ICMP errors) would otherwise
    // hide the change for a whole retransmission.
    let q = Query::new(Proto::Tcp, host, addr::ECHO_PORT).timeout(Duration::from_millis(250));
    let observe = || lab.query_with(POD, &q).ok().map(|s| s.ip);
    // Poll new connections until they show `want`: what the last one saw, and the time from
    // `since` to the first that showed it.
    let until = |want: Option<IpAddr>, since: Instant| {
        let mut last = None;
        let took = cluster::wait_until(ROUTE_DEADLINE, || {
            last = observe();
            last == want
        })
        .ok()
        .map(|_| since.elapsed());
        (last, took)
    };
    let mut steps = vec![("before: no gateway routes E", None, observe(), None)];
    let t = Instant::now();
    for gw in GATEWAYS {
        lab.add_gateway_route(gw, &route)?;
    }
    let (seen, took) = until(Some(egress), t);
    steps.push(("route added on gw1, gw2", Some(egress), seen, took));
    let t = Instant::now();
    for gw in GATEWAYS {
        lab.del_gateway_route(gw, &route)?;
    }
    let (seen, took) = until(None, t);
    steps.push(("route deleted on gw1, gw2", None, seen, took));

    println!("\n== a route added on the gateways, no policy edit: {route} ==");
    println!(
        "{:<28} {:<7} {:<4} {:<30} {:<16} {:<16} {:<8} ok",
        "step", "pod", "", "destination", "expected source", "observed source", "after_ms",
    );
    let show = |ip: Option<IpAddr>| ip.map_or("unreachable".to_owned(), |ip| ip.to_string());
    let mut ok_all = true;
    for (step, expect, seen, took) in steps {
        let ok = seen == expect;
        ok_all &= ok;
        println!(
            "{:<28} {:<7} {:<4} {:<30} {:<16} {:<16} {:<8} {}",
            step,
            POD,
            "tcp",
            format!(
                "host-e {}",
                std::net::SocketAddr::new(host, addr::ECHO_PORT)
            ),
            show(expect),
            show(seen),
            took.map_or("-".to_owned(), |t| t.as_millis().to_string()),
            if ok { "ok" } else { "FAIL" },
        );
    }
    Ok(ok_all)
}

/// Network A's rule edited to leave by two addresses (`egressIPs: [A, A2]`): both held, on
/// two gateways, each selected pod seen by the host on A with the address its node gives
/// it, the pods split between the two; then the sample policy back, A2 released.
fn spread_step(lab: &Lab, v6: bool) -> Result<bool> {
    let [a, a2] = spread::addresses(v6);
    println!("\n== network A's rule with egressIPs: [{a}, {a2}] ==");
    let holders = spread::apply(lab, v6)?;
    let rows = spread::rows(lab, v6)?;
    println!(
        "{:<8} {:<4} {:<30} {:<16} {:<16} {:<8} ok",
        "pod", "", "destination", "expected source", "observed source", "gateway",
    );
    let host = if v6 {
        IpAddr::V6(addr6::HOST_A)
    } else {
        IpAddr::V4(addr::HOST_A)
    };
    let mut ok_all = true;
    for r in &rows {
        ok_all &= r.ok();
        println!(
            "{:<8} {:<4} {:<30} {:<16} {:<16} {:<8} {}",
            r.pod,
            "tcp",
            format!(
                "host-a {}",
                std::net::SocketAddr::new(host, addr::ECHO_PORT)
            ),
            r.expected,
            r.observed
                .map_or("unreachable".to_owned(), |ip| ip.to_string()),
            r.gateway.as_deref().unwrap_or("-"),
            if r.ok() { "ok" } else { "FAIL" },
        );
    }
    let distinct = holders[0] != holders[1];
    let split = spread::used(&rows).len() == 2;
    println!(
        "{a} on {}, {a2} on {}: {}; pods on both addresses: {}",
        holders[0],
        holders[1],
        if distinct {
            "two gateways"
        } else {
            "ONE GATEWAY"
        },
        if split { "yes" } else { "NO" },
    );
    ok_all &= distinct && split;
    lab.write_policy(&lab::sample_policy_for(lab.family()))?;
    cluster::wait_until(spread::PLACED_WITHIN, || cluster::holder(lab, a2).is_none())
        .context("A2 was not released after the policy went back")?;
    Ok(ok_all)
}

/// `--failover`: the lab with agents, then every failure kind `rounds` times.
fn failover_table(spec: LabSpec, rounds: u32) -> Result<bool> {
    if rounds == 0 {
        bail!("--rounds needs a positive number");
    }
    let t0 = Instant::now();
    let mut lab = cluster::up_with_agents(spec)?;
    println!(
        "lab {} up with agents in {:.1}s (pods {}, {} underlay); logs in {}",
        lab.prefix(),
        t0.elapsed().as_secs_f64(),
        match lab.family() {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
            Family::Dual => "dual stack",
        },
        lab.spec().underlay,
        lab.dir().display(),
    );
    let mut ok = failover::run_table(&mut lab, rounds, &failover::Timing::default())?;
    if lab.family().has_v4() {
        let [a, a2] = spread::addresses(false);
        println!(
            "\n== network A's rule with egressIPs: [{a}, {a2}], the holder of {a} dies \
             silently (TCP every 20 ms from each worker's pod) =="
        );
        let report = spread::failover(&mut lab, false, Duration::from_millis(20))?;
        println!("{}", report.table());
        ok &= report.ok();
    }
    println!("{:.0}s in all", t0.elapsed().as_secs_f64());
    lab.stop_agents();
    lab.down()?;
    Ok(ok)
}

/// `--upgrade`: the lab with `old`'s agents, then a rolling upgrade to `new` and back.
fn upgrade_table(
    spec: LabSpec,
    old: &failover::upgrade::Build,
    new: &failover::upgrade::Build,
) -> Result<bool> {
    use failover::upgrade::{StepReport, roll};
    let t0 = Instant::now();
    let version = |b: &std::path::Path| {
        Command::new(b)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    println!(
        "rolling upgrade: {} ({}) -> {} ({}), and back",
        old.label,
        version(&old.bin),
        new.label,
        version(&new.bin)
    );
    let mut lab = Lab::up(spec)?;
    cluster::start_agents_of(&mut lab, &old.bin, &[], old.keyed)?;
    println!(
        "lab {} up with {} agents in {:.1}s; logs in {}",
        lab.prefix(),
        old.label,
        t0.elapsed().as_secs_f64(),
        lab.dir().display()
    );
    let timing = failover::Timing::default();
    let mut ok = true;
    let mut run = |lab: &mut Lab, from, to, what: &str| -> Result<()> {
        println!("\n{what}:\n{}", StepReport::header());
        for step in roll(lab, from, to, &timing, |s| println!("{}", s.row()))? {
            ok &= step.ok();
        }
        Ok(())
    };
    let result =
        run(&mut lab, old, new, "upgrade").and_then(|()| run(&mut lab, new, old, "rollback"));
    if let Err(e) = &result {
        println!("failed: {e:#}");
        for n in lab.nodes() {
            eprintln!("--- agent log {} (tail) ---", n.name);
            let log = lab.agent_log(n.name);
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            eprintln!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
        }
    }
    println!("\n{:.0}s in all", t0.elapsed().as_secs_f64());
    lab.stop_agents();
    lab.down()?;
    result?;
    Ok(ok)
}

/// Which gateway and interface hold each egress IP of the lab's families.
fn holders(lab: &Lab) -> Vec<(IpAddr, String, String)> {
    let mut ips = Vec::new();
    if lab.family().has_v4() {
        ips.extend([addr::EGRESS_IP_A, addr::EGRESS_IP_B].map(IpAddr::V4));
    }
    if lab.family().has_v6() {
        ips.extend([addr6::EGRESS_IP_A, addr6::EGRESS_IP_B].map(IpAddr::V6));
    }
    ips.into_iter()
        .filter_map(|ip| cluster::holder(lab, ip).map(|(gw, ifc)| (ip, gw, ifc)))
        .collect()
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    {l}\n")).collect()
}

/// Wire every pod as a runtime would: the lab's CNI step, then `plugin` (`egress-cni`),
/// whose ADD returns once the node's agent has put `from_pod` on the pod's device. Waits
/// for each agent's socket first (a runtime would retry the sandbox meanwhile). Prints
/// how long the ADDs took.
fn wire_pods_through_the_plugin(lab: &Lab, plugin: &std::path::Path) -> Result<()> {
    if !plugin.exists() {
        bail!(
            "{} is missing: run `cargo build --release -p egress-agent` (cargo xtask lab does)",
            plugin.display()
        );
    }
    let nodes: std::collections::BTreeSet<String> =
        lab.pods().iter().map(|p| p.node.clone()).collect();
    for node in &nodes {
        let socket = lab.cni_socket(node);
        cluster::wait_until(Duration::from_secs(30), || socket.exists())
            .with_context(|| format!("{node}'s agent never served {}", socket.display()))?;
    }
    let mut took = Vec::new();
    let names: Vec<String> = lab.pods().iter().map(|p| p.name.clone()).collect();
    for name in &names {
        let t = Instant::now();
        lab.wire_pod_with_cni(name, plugin)?;
        took.push(t.elapsed());
    }
    took.sort();
    println!(
        "pods wired through egress-cni: {} ADDs (device, addresses, routes, then the \
         plugin until from_pod was on), median {:.0} ms, slowest {:.0} ms",
        took.len(),
        took[took.len() / 2].as_secs_f64() * 1e3,
        took.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
    );
    Ok(())
}
