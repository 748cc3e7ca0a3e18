//! `egress-agent doctor` in the lab (issue 14): all ok on a well-configured gateway (one
//! expected warn: the lab's pods have the underlay's MTU, 1500, above the tunnel's 1450),
//! and the problem named on each of: bpffs unmounted at the pin directory, rp_filter strict
//! on a secondary interface, an egress IP another host answers for (its MAC named), the
//! tunnel port taken (the process named), forwarding off on a device the datapath looks
//! routes up from (`all` off, the device and setting named). Then the agent itself refuses to claim an egress
//! IP another host answers for, says so in its log and EgressNode, and claims it once the
//! host lets go.

use std::{
    net::UdpSocket,
    path::Path,
    process::Output,
    time::{Duration, Instant},
};

use egress_tests::{
    cluster::{self, holder, wait_until},
    deployed::AgentContainer,
    lab::{Lab, NODES, addr::*},
    netns,
};

fn agent_bin() -> String {
    cluster::agent_bin().unwrap().to_string_lossy().into_owned()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `egress-agent doctor` on gw1 against the lab's state (pins where gw1's agent keeps
/// them, unless `extra` says), with `extra` flags: its output,
/// whether it succeeded, and how long it took.
fn doctor(lab: &Lab, extra: &[&str]) -> (String, bool, Duration) {
    let state = lab.state_dir().to_string_lossy().into_owned();
    let pins = lab.bpffs_dir("gw1").to_string_lossy().into_owned();
    let mut args = vec!["doctor", "--node-name", "gw1", "--state-dir", &state];
    if !extra.contains(&"--bpffs-dir") {
        args.extend(["--bpffs-dir", &pins]);
    }
    args.extend_from_slice(extra);
    let t0 = Instant::now();
    let out = lab
        .ns("gw1")
        .unwrap()
        .exec_unchecked(&agent_bin(), &args)
        .unwrap();
    let took = t0.elapsed();
    let said = text(&out);
    // Every assertion prints what doctor said: printing it here too buried the failure
    // under a hundred lines in CI's excerpt.
    eprintln!("doctor {extra:?} took {took:?}");
    (said, out.status.success(), took)
}

/// `egress-agent doctor` on gw1 against the lab's state, started in `container` (through
/// the deployed runner), with gw1's pin directory under `host` (where the container sees
/// the host's root: `/` for the agent's, whose bpffs is mounted at its place, `/host` for
/// `oc debug`): its output and whether it succeeded.
fn doctor_in(lab: &Lab, container: &AgentContainer, host: &str) -> (String, bool) {
    let state = lab.state_dir().to_string_lossy().into_owned();
    let pins = Path::new(host)
        .join(lab.bpffs_dir("gw1").strip_prefix("/").unwrap())
        .to_string_lossy()
        .into_owned();
    let bin = cluster::agent_bin().unwrap();
    let mut cmd = container
        .command(lab.ns("gw1").unwrap(), &bin, &[lab.dir()])
        .unwrap();
    cmd.args([
        "doctor",
        "--node-name",
        "gw1",
        "--state-dir",
        &state,
        "--bpffs-dir",
        &pins,
    ]);
    let out = cmd.output().unwrap();
    (text(&out), out.status.success())
}

/// `verdict check` of every line (the verdict is the first word, the check the next one
/// or two: `rp-filter sec-a`).
fn verdicts(said: &str) -> Vec<String> {
    said.lines()
        .filter(|l| l.len() > 6)
        .map(|l| {
            let (verdict, rest) = l.split_at(6);
            let check = rest.get(..33).unwrap_or(rest).trim_end();
            format!("{} {check}", verdict.trim_end())
        })
        .collect()
}

/// Where operators run doctor (issue 48): `oc exec` into the agent's pod runs it with the
/// DaemonSet's capabilities and a read-only /proc/sys, `oc debug node/...` privileged. In
/// the pod it cannot try legacy tc (a private network namespace takes CAP_SYS_ADMIN) and
/// says so plainly, in an ok line; otherwise it reaches the privileged run's verdict on
/// every check. The privileged run tries legacy tc.
#[test]
fn doctor_in_the_agents_pod_says_what_it_did_not_try_and_privileged_tries_it() {
    let pod = AgentContainer::from_manifests().unwrap();
    assert!(
        !pod.privileged && !pod.capabilities.iter().any(|c| c == "SYS_ADMIN"),
        "the test is about a pod without CAP_SYS_ADMIN: {pod:?}"
    );
    netns::ensure_bpffs().unwrap();
    let lab = Lab::up(cluster::default_spec().unwrap()).unwrap();
    let (in_pod, _) = doctor_in(&lab, &pod, "/");
    // As docs/operations.md says to run it: the host's bpffs under /host.
    let (debug, _) = doctor_in(&lab, &AgentContainer::oc_debug(), "/host");
    eprintln!("in the agent's pod:\n{in_pod}\nprivileged:\n{debug}");
    let attach = line(&in_pod, "attach");
    assert!(
        attach.starts_with("ok ")
            && attach.contains("legacy tc not tried: needs CAP_SYS_ADMIN")
            && attach.contains("Running doctor"),
        "{attach}"
    );
    assert!(
        line(&debug, "attach").contains("legacy tc works too"),
        "{debug}"
    );
    assert_eq!(verdicts(&in_pod), verdicts(&debug));
}

/// The line of `check` (its first word after the verdict is the check's name).
fn line<'a>(said: &'a str, check: &str) -> &'a str {
    said.lines()
        .find(|l| l.get(6..).is_some_and(|rest| rest.starts_with(check)))
        .unwrap_or_else(|| panic!("no line for {check}:\n{said}"))
}

/// The MAC of `member`'s eth0.
fn mac_of(lab: &Lab, member: &str) -> String {
    let out = text(
        &lab.exec(member, "ip", &["-o", "link", "show", "eth0"])
            .unwrap(),
    );
    out.split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .unwrap_or_else(|| panic!("no MAC in {out}"))
        .to_owned()
}

#[test]
fn doctor_is_ok_on_a_gateway_and_names_each_problem_and_the_agent_refuses_an_answered_ip() {
    netns::ensure_bpffs().unwrap();
    let mut lab = Lab::up(cluster::default_spec().unwrap()).unwrap();

    // 1. A well-configured gateway: every check ok but the MTU (pods at 1500, tunnel 1450).
    let (said, success, took) = doctor(&lab, &[]);
    assert!(success, "{said}");
    let not_ok: Vec<&str> = said.lines().filter(|l| !l.starts_with("ok ")).collect();
    assert_eq!(not_ok.len(), 1, "only the MTU warns:\n{said}");
    assert!(
        line(&said, "mtu").starts_with("warn")
            && line(&said, "mtu").contains("pods' MTU 1500")
            && line(&said, "mtu").contains("1450 or less"),
        "{said}"
    );
    for check in [
        "btf",
        "attach",
        "lpm-trie",
        "map-types",
        "programs",
        "jit",
        "bpffs",
        "capabilities",
        "tunnel-port",
        "rp-filter sec-a",
        "rp-filter sec-b",
    ] {
        assert!(line(&said, check).starts_with("ok "), "{check}:\n{said}");
    }
    for ip in [EGRESS_IP_A, EGRESS_IP_B] {
        let subnet = line(&said, &format!("egress-ip {ip}"));
        assert!(
            subnet.starts_with("ok ") && subnet.contains("policy "),
            "{said}"
        );
        let dad = line(&said, &format!("duplicate-address {ip}"));
        assert!(
            dad.starts_with("ok ") && dad.contains("no answer to 3 ARP probes"),
            "{said}"
        );
    }
    eprintln!("doctor on a clean gateway took {took:?} (two unanswered probes of 200 ms each)");

    // 1b. Forwarding off everywhere (all and default, which turns every device off): doctor
    // names each device the datapath looks routes up from, and the setting; on for those
    // devices only (all still off), it is content.
    let sysctl = |kv: &str| {
        lab.exec("gw1", "sysctl", &["-qw", kv]).unwrap();
    };
    sysctl("net.ipv4.conf.all.forwarding=0");
    sysctl("net.ipv4.conf.default.forwarding=0");
    let (said, success, _) = doctor(&lab, &[]);
    assert!(!success, "{said}");
    for dev in ["eth0", "sec-a", "sec-b"] {
        let l = line(&said, &format!("forwarding {dev}"));
        assert!(
            l.starts_with("fail")
                && l.contains(&format!("sysctl -w net.ipv4.conf.{dev}.forwarding=1")),
            "{said}"
        );
    }
    for dev in ["eth0", "sec-a", "sec-b"] {
        sysctl(&format!("net.ipv4.conf.{dev}.forwarding=1"));
    }
    let (said, success, _) = doctor(&lab, &[]);
    assert!(success, "{said}");
    for dev in ["eth0", "sec-a", "sec-b"] {
        assert!(
            line(&said, &format!("forwarding {dev}")).starts_with("ok "),
            "{said}"
        );
    }
    let all = lab
        .exec("gw1", "sysctl", &["-n", "net.ipv4.conf.all.forwarding"])
        .unwrap();
    assert_eq!(text(&all).trim(), "0", "all stays off");
    sysctl("net.ipv4.conf.all.forwarding=1");

    // 5. Egress IP A already answered by host-a: the doctor names host-a's MAC.
    let host_a_mac = mac_of(&lab, "host-a");
    let cidr_a = format!("{EGRESS_IP_A}/24");
    lab.exec("host-a", "ip", &["addr", "add", &cidr_a, "dev", "eth0"])
        .unwrap();
    // A fresh lab's network A takes a moment to pass frames between gw1 and host-a (~1 s
    // after Lab::up; without this wait the probes went unanswered): wait for a ping.
    let host_a = HOST_A.to_string();
    wait_until(Duration::from_secs(5), || {
        lab.exec("gw1", "ping", &["-c", "1", "-W", "1", &host_a])
            .is_ok()
    })
    .unwrap();
    let (said, success, took) = doctor(&lab, &[]);
    assert!(!success, "{said}");
    let l = line(&said, &format!("duplicate-address {EGRESS_IP_A}"));
    assert!(
        l.starts_with("fail") && l.contains(&format!("MAC {host_a_mac} answered")),
        "{l}"
    );
    assert!(
        line(&said, &format!("duplicate-address {EGRESS_IP_B}")).starts_with("ok "),
        "{said}"
    );
    eprintln!("doctor with A answered took {took:?} (one answered probe, one unanswered)");

    // 2. bpffs unmounted at the pin directory.
    let elsewhere = lab.dir().join("pins");
    let elsewhere = elsewhere.to_string_lossy().into_owned();
    let (said, success, _) = doctor(&lab, &["--bpffs-dir", &elsewhere, "--no-dad"]);
    assert!(!success, "{said}");
    let l = line(&said, "bpffs");
    assert!(
        l.starts_with("fail") && l.contains("not on bpffs") && l.contains("mount -t bpf"),
        "{l}"
    );

    // 3. rp_filter strict on a secondary interface that carries an egress IP.
    let gw1 = lab.ns("gw1").unwrap();
    gw1.sysctl("net.ipv4.conf.sec-a.rp_filter", "1").unwrap();
    let (said, success, _) = doctor(&lab, &["--no-dad"]);
    gw1.sysctl("net.ipv4.conf.sec-a.rp_filter", "0").unwrap();
    assert!(!success, "{said}");
    let l = line(&said, "rp-filter sec-a");
    assert!(
        l.starts_with("fail")
            && l.contains("strict")
            && l.contains("net.ipv4.conf.sec-a.rp_filter=2"),
        "{l}"
    );
    assert!(line(&said, "rp-filter sec-b").starts_with("ok "), "{said}");

    // 4. The tunnel port taken: this process binds UDP 4797 in gw1's namespace.
    let held = gw1.run_in(|| Ok(UdpSocket::bind("0.0.0.0:4797")?)).unwrap();
    let (said, success, _) = doctor(&lab, &["--no-dad"]);
    drop(held);
    assert!(!success, "{said}");
    let l = line(&said, "tunnel-port");
    assert!(
        l.starts_with("fail")
            && l.contains("UDP 4797 is taken by")
            && l.contains(&format!("pid {}", std::process::id()))
            && l.contains("--tunnel-port"),
        "{l}"
    );

    // 6. The agents: nobody claims A while host-a answers for it, the would-be holder
    // says so naming the MAC (log and EgressNode); B is held as usual.
    let bin = cluster::agent_bin().unwrap();
    for node in &NODES {
        lab.start_agent(node.name, &bin, &[]).unwrap();
    }
    // Four debug agents loading their programs at once take 10 s on this 2-core machine
    // and more under load (CI once timed out here, every agent still attaching): the
    // bounds below start once every agent has.
    let tail = |log: String| {
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(12)..].join("\n")
    };
    let started = wait_until(Duration::from_secs(90), || {
        NODES
            .iter()
            .all(|n| lab.agent_log(n.name).contains("agent started"))
    })
    .unwrap_or_else(|e| {
        let logs: Vec<String> = NODES
            .iter()
            .map(|n| format!("{}:\n{}", n.name, tail(lab.agent_log(n.name))))
            .collect();
        panic!("{e:#}: not every agent started\n{}", logs.join("\n"))
    });
    eprintln!("every agent started within {started:?}");
    // The gateway whose refusal of A still stands: its last word on A is a problem naming
    // host-a's MAC, not "resolved". At start the gateways' views of each other settle in
    // about a second, and A's would-be holder can change in it (CI once saw gw2 refuse A,
    // then A assigned to gw1, which claimed it once host-a let go): wait until one gateway
    // has refused A for 3 s.
    let refusing = |lab: &Lab| {
        ["gw1", "gw2"].into_iter().find(|gw| {
            let log = lab.agent_log(gw);
            let last = log.lines().rev().find(|l| {
                (l.contains("problem: ") || l.contains("resolved: "))
                    && l.contains(&format!("egress IP {EGRESS_IP_A}:"))
            });
            last.is_some_and(|l| l.contains("problem: ") && l.contains(&host_a_mac))
        })
    };
    let mut since: Option<(&str, Instant)> = None;
    wait_until(Duration::from_secs(30), || {
        let now = refusing(&lab).filter(|_| holder(&lab, EGRESS_IP_B).is_some());
        since = match (now, since) {
            (Some(g), Some((s, t))) if g == s => Some((s, t)),
            (Some(g), _) => Some((g, Instant::now())),
            (None, _) => None,
        };
        since.is_some_and(|(_, t)| t.elapsed() >= Duration::from_secs(3))
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e:#}\ngw1:\n{}\ngw2:\n{}",
            tail(lab.agent_log("gw1")),
            tail(lab.agent_log("gw2"))
        )
    });
    let gw = since.unwrap().0;
    assert_eq!(holder(&lab, EGRESS_IP_A), None, "no gateway took A");
    // The EgressNode is published after the pass that logged the refusal: wait for it
    // (CI once read the file in between).
    let doc_path = lab.state_dir().join(format!("egressnode-{gw}.yaml"));
    let says_so = |doc: &str| {
        doc.contains(&format!("check: duplicate-address {EGRESS_IP_A}"))
            && doc.contains(&host_a_mac)
            && doc.contains("check: bpffs")
    };
    let _ = wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&doc_path).is_ok_and(|d| says_so(&d))
    });
    let node_doc = std::fs::read_to_string(&doc_path).unwrap();
    assert!(says_so(&node_doc), "{node_doc}");
    let log = lab.agent_log(gw);
    assert!(log.contains("preflight ok"), "{log}");

    // 7. host-a lets go: the gateway probes again (within 5 s of the refusal, at its next
    // pass) and claims A.
    let released = Instant::now();
    lab.exec("host-a", "ip", &["addr", "del", &cidr_a, "dev", "eth0"])
        .unwrap();
    let took = wait_until(Duration::from_secs(20), || {
        holder(&lab, EGRESS_IP_A).is_some_and(|(g, _)| g == gw)
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", tail(lab.agent_log(gw))));
    eprintln!(
        "A claimed {took:?} after host-a released it ({:?})",
        released.elapsed()
    );
    let log = lab.agent_log(gw);
    let probe = log
        .lines()
        .find(|l| {
            l.contains("no answer to duplicate address probes")
                && l.contains(&EGRESS_IP_A.to_string())
        })
        .unwrap_or_else(|| panic!("{log}"));
    eprintln!("{probe}");
}
