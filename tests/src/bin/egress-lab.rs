//! `cargo xtask lab`: bring up the lab, run one agent per node, show per-destination
//! egress as a table, show a gateway's maps, tear down. Exits non-zero if a row fails.

use std::{
    net::IpAddr,
    path::PathBuf,
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use egress_tests::{
    cluster,
    lab::{self, Lab, LabSpec, Proto, Query, addr},
    netns,
};

struct Row {
    pod: &'static str,
    proto: Proto,
    host: (&'static str, std::net::Ipv4Addr),
    /// `None`: the destination must be unreachable for this pod.
    expect: Option<IpAddr>,
    why: &'static str,
}

fn rows() -> Vec<Row> {
    use addr::*;
    let a = ("host-a", HOST_A);
    let b = ("host-b", HOST_B);
    let c = ("host-c", HOST_C);
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

fn arg(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

fn real_main() -> Result<bool> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--down") {
        let prefix = args.get(i + 1).context("--down needs the lab's prefix")?;
        Lab::teardown_by_prefix(prefix)?;
        println!("lab {prefix} removed");
        return Ok(true);
    }
    if arg("--ipv6") || arg("--dual-stack") {
        bail!("--ipv6 and --dual-stack labs are not implemented yet (IPv4 only)");
    }
    let keep = arg("--keep");
    netns::install_signal_teardown()?;
    let bin_dir = std::env::current_exe()?
        .parent()
        .map(PathBuf::from)
        .context("no directory for the current executable")?;
    let agent = bin_dir.join("egress-agent");
    if !agent.exists() {
        bail!(
            "{} is missing: run `cargo build --release -p egress-agent` (cargo xtask lab does)",
            agent.display()
        );
    }
    let echo = lab::locate_echo_bin()?;
    let t0 = Instant::now();
    let mut lab = Lab::up(LabSpec::new(echo))?;
    println!(
        "lab {} up in {:.1}s: 2 workers, 2 gateways, networks A and B behind the gateways, C routed",
        lab.prefix(),
        t0.elapsed().as_secs_f64()
    );
    lab.start_agents(&agent)?;
    let ready = cluster::wait_until(Duration::from_secs(30), || {
        holders(&lab).len() == 2
            && cluster::seen(&lab, "w1-p1", Proto::Tcp, addr::HOST_A)
                == Some(IpAddr::V4(addr::EGRESS_IP_A))
    });
    match ready {
        Ok(_) => println!(
            "agents converged {:.1}s after start\n",
            t0.elapsed().as_secs_f64()
        ),
        Err(_) => println!("agents did not converge within 30 s; showing what works\n"),
    }
    println!(
        "policy {}:\n{}",
        lab::POLICY_FILE,
        indent(&lab::sample_policy())
    );

    let holders = holders(&lab);
    let mut ok_all = true;
    println!(
        "{:<7} {:<4} {:<22} {:<16} {:<16} {:<8} {:<10} {:<3}  why",
        "pod",
        "",
        "destination",
        "expected source",
        "observed source",
        "gateway",
        "interface",
        "ok",
    );
    for r in rows() {
        let q = Query::new(r.proto, r.host.1, addr::ECHO_PORT).timeout(Duration::from_millis(1500));
        let seen = lab.query_with(r.pod, &q);
        let observed = match &seen {
            Ok(s) => s.ip.to_string(),
            Err(_) => "unreachable".into(),
        };
        let expected = r.expect.map_or("unreachable".into(), |e| e.to_string());
        let ok = observed == expected;
        ok_all &= ok;
        let (gw, ifc) = r
            .expect
            .and_then(|e| holders.iter().find(|h| h.0 == e))
            .map_or(("-".to_string(), "-".to_string()), |h| {
                (h.1.clone(), h.2.clone())
            });
        println!(
            "{:<7} {:<4} {:<22} {:<16} {:<16} {:<8} {:<10} {:<3}  {}",
            r.pod,
            r.proto.to_string(),
            format!("{} {}:{}", r.host.0, r.host.1, addr::ECHO_PORT),
            expected,
            observed,
            gw,
            ifc,
            if ok { "ok" } else { "FAIL" },
            r.why
        );
    }
    if let Some((_, gw, _)) = holders.first() {
        println!("\n== egress-agent maps on {gw} ==");
        let out = Command::new(&agent)
            .args(["maps", "--bpffs-dir"])
            .arg(lab.bpffs_dir(gw))
            .output()?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
    }
    if !ok_all {
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
    println!(
        "\n{}",
        if ok_all {
            "all rows ok"
        } else {
            "SOME ROWS FAILED"
        }
    );
    if keep {
        println!("{}", lab.how_to());
        let p = lab.leak();
        println!("lab {p} left up; remove it with: cargo xtask lab --down {p}");
    } else {
        lab.stop_agents();
        lab.down()?;
        println!("lab torn down");
    }
    Ok(ok_all)
}

/// Which gateway and interface hold each egress IP.
fn holders(lab: &Lab) -> Vec<(IpAddr, String, String)> {
    [addr::EGRESS_IP_A, addr::EGRESS_IP_B]
        .into_iter()
        .filter_map(|ip| cluster::holder(lab, ip).map(|(gw, ifc)| (IpAddr::V4(ip), gw, ifc)))
        .collect()
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    {l}\n")).collect()
}
