//! Install and uninstall (issue 12): `egress-agent cleanup` refuses while an agent runs on
//! its pin directory; pins removed behind a running agent's back come back within a
//! resync; after the agent stops, cleanup leaves no tunnel device, egress IP, pin or TC
//! program behind; a start that fails changes nothing on the host.

use std::{
    net::IpAddr,
    path::Path,
    process::Output,
    time::{Duration, Instant},
};

use egress_tests::{
    cluster::{self, holder, seen, up_with_agents, wait_until},
    hooks,
    lab::{Lab, Proto, addr::*},
    netns::{DirGuard, Netns, next_prefix},
};

/// The agent's default resync interval (`run --resync-secs`).
const RESYNC: Duration = Duration::from_secs(10);

fn agent_bin() -> String {
    cluster::agent_bin().unwrap().to_string_lossy().into_owned()
}

/// `egress-agent <args>` in `node`'s namespace.
fn agent_cmd(lab: &Lab, node: &str, args: &[&str]) -> Output {
    lab.ns(node)
        .unwrap()
        .exec_unchecked(&agent_bin(), args)
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `interface: program` for every ingress program attached in `node`'s namespace, TCX
/// links and tc filters alike (`--attach` may be either: `cargo xtask test` runs this
/// test with `EGRESS_ATTACH=tc` too).
fn attached_programs(lab: &Lab, node: &str) -> String {
    let names = cluster::interface_names(lab, node).unwrap();
    lab.ns(node)
        .unwrap()
        .run_in(move || {
            let mut out = String::new();
            for n in names {
                for p in hooks::ingress(&n) {
                    out.push_str(&format!("{n}: {}\n", p.name()));
                }
            }
            Ok(out)
        })
        .unwrap()
}

fn egress_a_through_gateway(lab: &Lab) -> bool {
    seen(lab, "w1-p1", Proto::Udp, HOST_A) == Some(IpAddr::V4(EGRESS_IP_A))
}

#[test]
fn cleanup_refuses_a_running_agent_vanished_pins_come_back_and_cleanup_removes_everything() {
    let mut lab = up_with_agents(cluster::default_spec().unwrap()).unwrap();
    let (gw, _) = holder(&lab, EGRESS_IP_A).unwrap();
    let pins = lab.bpffs_dir(&gw);
    let pin_arg = pins.to_string_lossy().into_owned();

    // 1. Refused while the agent runs: names its pid, says to stop it first; nothing goes.
    let out = agent_cmd(&lab, &gw, &["cleanup", "--bpffs-dir", &pin_arg]);
    let said = text(&out);
    assert!(!out.status.success(), "cleanup must refuse: {said}");
    assert!(
        said.contains("an agent (pid ") && said.contains("SIGTERM"),
        "{said}"
    );
    assert!(pins.join("CONFIG").exists(), "the pins stay");
    assert!(egress_a_through_gateway(&lab), "traffic keeps flowing");

    // 2. Pins removed behind the agents' backs, on the pod's node and on the holder: the
    // links detach with them. The next resync restores them.
    for node in ["w1", gw.as_str()] {
        std::fs::remove_dir_all(lab.bpffs_dir(node)).unwrap();
    }
    let gone = Instant::now();
    eprintln!(
        "right after the pins went: w1-p1 -> host-a seen as {:?}",
        seen(&lab, "w1-p1", Proto::Udp, HOST_A)
    );
    // Each agent's next resync restores them, and says so (waited for first: the
    // links' detach may not show at once, and a resync may come before it does).
    for node in ["w1", gw.as_str()] {
        wait_until(RESYNC * 3, || {
            let log = lab.agent_log(node);
            log.contains("pins vanished") && log.contains("restored")
        })
        .unwrap_or_else(|e| panic!("{node} did not restore: {e:#}\n{}", lab.agent_log(node)));
    }
    let took = wait_until(RESYNC * 3, || egress_a_through_gateway(&lab))
        .unwrap_or_else(|e| panic!("traffic not back: {e:#}\n{}", lab.agent_log(&gw)));
    eprintln!(
        "traffic back {took:?} after the check started ({:?} after the pins went)",
        gone.elapsed()
    );
    for node in ["w1", gw.as_str()] {
        let log = lab.agent_log(node);
        assert!(
            log.contains("WARN") && log.contains("pins vanished") && log.contains("restored"),
            "{node} says what it restored:\n{log}"
        );
        assert!(
            lab.bpffs_dir(node).join("CONFIG").exists(),
            "{node} re-pinned"
        );
    }
    let progs = attached_programs(&lab, &gw);
    for p in ["from_tunnel", "from_underlay"] {
        assert!(progs.contains(p), "{p} attached again on {gw}:\n{progs}");
    }

    // 3. SIGTERM keeps the datapath and says so; cleanup then uninstalls it.
    lab.stop_agent(&gw).unwrap();
    let log = lab.agent_log(&gw);
    assert!(
        log.contains("the datapath stays") && log.contains("`egress-agent cleanup` uninstalls"),
        "{log}"
    );
    assert!(pins.join("CONFIG").exists());
    let out = agent_cmd(&lab, &gw, &["cleanup", "--bpffs-dir", &pin_arg]);
    let said = text(&out);
    eprintln!("cleanup on {gw}:\n{said}");
    assert!(out.status.success(), "{said}");
    for line in [
        format!("removed egress IP {EGRESS_IP_A}/"),
        "detached from_tunnel from egress0".to_owned(),
        "detached from_underlay from eth0".to_owned(),
        "removed map pin CONFIG".to_owned(),
        format!("removed pin directory {pin_arg}"),
        "removed tunnel device egress0".to_owned(),
    ] {
        assert!(said.contains(&line), "cleanup says {line:?}:\n{said}");
    }
    assert!(!pins.exists(), "no pins left");
    let links = text(&lab.exec(&gw, "ip", &["-d", "link", "show"]).unwrap());
    assert!(
        !links.contains("egress0"),
        "no tunnel device left:\n{links}"
    );
    let addrs = text(&lab.exec(&gw, "ip", &["addr", "show"]).unwrap());
    assert!(
        !addrs.contains(&format!("{EGRESS_IP_A}/")),
        "no egress IP left:\n{addrs}"
    );
    let progs = attached_programs(&lab, &gw);
    for p in ["from_pod", "from_tunnel", "from_underlay", "from_secondary"] {
        assert!(!progs.contains(p), "no {p} attached on {gw}:\n{progs}");
    }
    // Twice is fine: nothing left to remove.
    let again = agent_cmd(&lab, &gw, &["cleanup", "--bpffs-dir", &pin_arg]);
    assert!(again.status.success(), "{}", text(&again));
    assert!(
        text(&again).contains("nothing to remove"),
        "{}",
        text(&again)
    );
}

#[test]
fn a_start_whose_source_fails_changes_nothing_on_the_host_and_says_why_once() {
    let name = format!("{}-fail", next_prefix());
    let ns = Netns::add(&name).unwrap();
    egress_tests::netns::ensure_bpffs().unwrap();
    let pins = Path::new("/sys/fs/bpf").join(&name);
    let _pins = DirGuard::adopt(&pins);
    let pin_arg = pins.to_string_lossy().into_owned();
    // A kubeconfig whose API server does not answer (nothing listens on port 1).
    let kubeconfig = std::env::temp_dir().join(format!("{name}.kubeconfig"));
    std::fs::write(&kubeconfig, UNREACHABLE_KUBECONFIG).unwrap();
    let kubeconfig_arg = kubeconfig.to_string_lossy().into_owned();
    let cases: [(&[&str], &str); 3] = [
        (
            &["--state-dir", "/nonexistent/egress-state"],
            "failed to read the state directory /nonexistent/egress-state",
        ),
        (
            &["--kube", "--kubeconfig", "/nonexistent/kubeconfig"],
            "failed to configure the Kubernetes client",
        ),
        (
            &["--kube", "--kubeconfig", &kubeconfig_arg],
            "failed to reach the Kubernetes API",
        ),
    ];
    // A probe port in use in the node's namespace (held by a socket bound there).
    let busy = ns
        .run_in(|| Ok(std::net::UdpSocket::bind("[::]:0")?))
        .unwrap();
    let busy_port = busy.local_addr().unwrap().port().to_string();
    let empty_state = tempfile::tempdir().unwrap();
    let empty_state_arg = empty_state.path().to_string_lossy().into_owned();
    let busy_case: (&[&str], &str) = (
        &["--state-dir", &empty_state_arg, "--probe-port", &busy_port],
        "failed to open the probe port",
    );
    for (source, want) in cases.into_iter().chain([busy_case]) {
        let mut args = vec!["run", "--node-name", "n1", "--bpffs-dir", &pin_arg];
        args.extend(source);
        let mut cmd = ns.command(agent_bin()).unwrap();
        cmd.args(&args).env_remove("KUBECONFIG");
        let out = cmd.output().unwrap();
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{args:?}: {said}");
        assert!(said.contains(want), "{args:?}: {said}");
        // Each cause once: no clause of the message repeats.
        let clauses: Vec<&str> = said
            .lines()
            .last()
            .unwrap_or_default()
            .split(": ")
            .collect();
        for (i, c) in clauses.iter().enumerate() {
            assert!(!clauses[i + 1..].contains(c), "{c:?} repeats in {said}");
        }
        let links = text(&ns.ip(&["-d", "link", "show"]).unwrap());
        assert!(
            !links.contains("vxlan"),
            "{args:?} created a device:\n{links}"
        );
        assert!(!pins.exists(), "{args:?} created {}", pins.display());
        let lock = Path::new("/run/egress-agent").join(format!(
            "{}.lock",
            pin_arg.trim_start_matches('/').replace('/', "-")
        ));
        assert!(!lock.exists(), "{args:?} left {}", lock.display());
    }
    let _ = std::fs::remove_file(&kubeconfig);
}

const UNREACHABLE_KUBECONFIG: &str = "\
apiVersion: v1
kind: Config
clusters:
- {name: c, cluster: {server: \"https://127.0.0.1:1\"}}
contexts:
- {name: x, context: {cluster: c, user: u}}
current-context: x
users:
- {name: u, user: {token: t}}
";

#[test]
fn maps_where_no_agent_has_run_says_what_to_do() {
    let dir = Path::new("/sys/fs/bpf").join(format!("{}-none", next_prefix()));
    let out = std::process::Command::new(agent_bin())
        .args(["maps", "--bpffs-dir", &dir.to_string_lossy()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        format!(
            "egress-agent: no agent has run here (no maps under {}): start `egress-agent \
             run`, or pass --bpffs-dir",
            dir.display()
        )
    );
}
