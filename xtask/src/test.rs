//! `cargo xtask test`, `lab` and `bench`: thin drivers over cargo and the tests crate.

use std::time::Instant;

use anyhow::{Context as _, Result};

use crate::bootstrap::{self, TOOLCHAIN, sh};

#[derive(clap::Args)]
pub struct Args {
    /// Skip the format and clippy checks.
    #[arg(long)]
    no_lint: bool,
    /// Skip the runs on legacy tc (the host with `EGRESS_ATTACH=tc`, and Linux 6.1 in a
    /// VM).
    #[arg(long)]
    no_legacy: bool,
    /// Extra arguments for `cargo test` (after `--`), e.g. a test name filter.
    #[arg(last = true)]
    rest: Vec<String>,
}

#[derive(clap::Args)]
pub struct LabArgs {
    /// Leave the lab up and print how to enter it.
    #[arg(long)]
    keep: bool,
    /// Remove a lab left up with --keep (by its prefix) and exit.
    #[arg(long, value_name = "PREFIX")]
    down: Option<String>,
    /// IPv6-only pods, over an IPv6 underlay.
    #[arg(long)]
    ipv6: bool,
    /// Dual-stack pods, over an IPv4 underlay.
    #[arg(long)]
    dual_stack: bool,
    /// The underlay's family (the tunnel between nodes): ipv4 or ipv6.
    #[arg(long, value_name = "FAMILY", value_parser = ["ipv4", "ipv6"])]
    underlay: Option<String>,
    /// Instead of the table: break the gateway holding egress IP A six ways (NotReady,
    /// silent death, underlay cut, secondary cut, gateway partition, drain) while a pod
    /// streams TCP, UDP and ping through it; one row per case. Exits non-zero if a TCP
    /// stream did not survive or two gateways held the IP for more than a second.
    #[arg(long, conflicts_with_all = ["keep", "down"])]
    failover: bool,
    /// With --failover: run every kind N times and summarize per kind.
    #[arg(long, value_name = "N", requires = "failover")]
    rounds: Option<u32>,
    /// How pods and the nodes' underlay are wired: `routed` (like Calico: a host route
    /// per pod), `bridge` (pods on a Linux bridge, no per-pod routes, the node's address
    /// on a bridge over its NIC), `ovs` (as OVN-Kubernetes wires a node: Open vSwitch's
    /// br-int and br-ex, a management port, VLAN secondary networks), `ovn` (real OVN
    /// 23.03 under OVN-Kubernetes' topology, shared gateway: a controller per node, Geneve,
    /// GR_<node> and br-ex) or `ovn-local` (the same in local gateway mode, pods leaving
    /// through the management port and the node's routing); the last three run the lab
    /// inside a Debian 12 (Linux 6.1) guest: this kernel has no Open vSwitch.
    #[arg(long, value_name = "WIRING", default_value = "routed",
          value_parser = ["routed", "bridge", "ovs", "ovn", "ovn-local"])]
    cni: String,
    /// A lab of N nodes (IPv4, routed), two pods on each worker, networks A and B on
    /// every gateway; prints a summary instead of the table: sources per destination,
    /// holders, a silent death and a drain under a TCP stream from every worker, a policy
    /// edit and a gateway route timed to the last node, and what the agents cost.
    #[arg(long, value_name = "N", conflicts_with_all = ["failover", "ipv6", "dual_stack", "underlay", "down"],
          value_parser = clap::value_parser!(u32).range(3..=193))]
    nodes: Option<u32>,
    /// With --nodes: how many of them are gateways (default: a tenth, at least 2).
    #[arg(long, value_name = "G", requires = "nodes",
          value_parser = clap::value_parser!(u32).range(1..=39))]
    gateways: Option<u32>,
    /// With --nodes: the agents' --probe-interval-ms (default 100).
    #[arg(long, value_name = "MS", requires = "nodes")]
    probe_interval_ms: Option<u64>,
    /// With --nodes: the agents' --probe-misses (default 3).
    #[arg(long, value_name = "N", requires = "nodes")]
    probe_misses: Option<u32>,
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// A shorter run (a few minutes).
    #[arg(long)]
    quick: bool,
    /// More arguments for egress-bench (after `--`), e.g. `--hooks` or `--no-write`.
    #[arg(last = true)]
    rest: Vec<String>,
}

pub fn run(args: Args) -> Result<()> {
    let start = Instant::now();
    bootstrap::run()?;
    if !args.no_lint {
        step("cargo fmt --check", || {
            sh("cargo", &["fmt", "--all", "--", "--check"], &[])
        })?;
        step("clippy (host crates)", || {
            sh(
                "cargo",
                &[
                    "clippy",
                    "--workspace",
                    // The eBPF crate only builds for the BPF target: linted below.
                    "--exclude",
                    "egress-ebpf",
                    "--all-targets",
                    "--",
                    "-D",
                    "warnings",
                ],
                &[],
            )
        })?;
        step("clippy (eBPF crate, bpfel-unknown-none)", || {
            let tc = format!("+{TOOLCHAIN}");
            sh(
                "cargo",
                &[
                    &tc,
                    "clippy",
                    "--package",
                    "egress-ebpf",
                    "--release",
                    "-Z",
                    "build-std=core",
                    "--target",
                    "bpfel-unknown-none",
                    "--",
                    "-D",
                    "warnings",
                ],
                &[("RUSTC_BOOTSTRAP", "1")],
            )
        })?;
    }
    // The lab tests start the agent and the echo server as processes: build them first.
    step("build binaries", || {
        sh(
            "cargo",
            &["build", "--workspace", "--exclude", "egress-ebpf", "--bins"],
            &[],
        )
    })?;
    // tests/tests/image.rs loads the image into podman and unpacks it: the image packed
    // as `cargo xtask image` packs it, around the debug agent just built (a release build
    // of every dependency would add about 9 minutes; `cargo xtask image` makes that one).
    let mut image = String::new();
    step("image (as cargo xtask image, of the debug agent)", || {
        image = crate::image::build(crate::image::Profile::Dev)?
            .to_string_lossy()
            .into_owned();
        Ok(())
    })?;
    step("tests (unit, packet, namespace, lab)", || {
        // The lab tests' agents (debug builds, two labs at a time on two cores) declare a
        // gateway dead after 6 missed probes (600 ms) instead of 3: a loaded CI machine
        // can starve a process for longer than 300 ms, and a needless failover would move
        // egress IPs under tests that do not expect it. The failover tests assert outcomes
        // (streams survive, one holder), not detection times; `cargo xtask lab
        // --failover` shows the default settings' times.
        let env = [
            ("EGRESS_PROBE_MISSES", "6"),
            ("EGRESS_IMAGE_ARCHIVE", image.as_str()),
        ];
        if args.rest.is_empty() {
            return crate::pool::run(&env);
        }
        // With a filter or other arguments for the test binaries: cargo's own run.
        let mut a = vec![
            "test",
            "--workspace",
            "--exclude",
            "egress-ebpf",
            "--no-fail-fast",
        ];
        // Each lab test runs a dozen namespaces and four agents: on a 2-core machine more
        // than two at a time only makes their timeouts flaky.
        a.extend(["--", "--test-threads=2"]);
        a.extend(args.rest.iter().map(String::as_str));
        sh("cargo", &a, &env)
    })?;
    if !args.no_legacy {
        // The same tests with the legacy tc path forced: every agent of the labs attaches
        // with a clsact qdisc and bpf filters on this kernel, which has TCX.
        step("tests with --attach tc forced (EGRESS_ATTACH=tc)", || {
            crate::pool::run_only(
                TC_TESTS,
                &[("EGRESS_PROBE_MISSES", "6"), ("EGRESS_ATTACH", "tc")],
            )
        })?;
        step("tests on Linux 6.1 (debian-6.1 in a VM, TCG)", guest_tests)?;
    }
    eprintln!(
        "xtask test: all steps passed in {:.0}s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Run again with `EGRESS_ATTACH=tc` on the host: the IPv4 end to end tests, cleanup,
/// the uninstall DaemonSet's, and `--unknown-pods drop`'s (a new pod device's filter goes
/// on off the agent's main thread, by the tc path's own code: `attach_elsewhere`).
/// `legacy_tc` covers an upgrade under a TCP stream on tc in the first run.
const TC_TESTS: &[&str] = &["e2e_v4", "cleanup", "uninstall", "unknown_pods"];

/// Run on Linux 6.1, which has no TCX, with `--attach auto` choosing legacy tc. Under
/// emulation (TCG: KVM does not work on these machines) the verifier and the agents are
/// many times slower, so this is a subset, by test name filters: the IPv4 packet tables
/// of `from_pod` and `from_tunnel` and `from_underlay`'s (each table verifies a program
/// once per worker: `egress_tests::table`), the attach tests, the legacy tc tests
/// (adoption in place among them; the lab on tc, an upgrade under a TCP stream, cleanup
/// beside a foreign filter), the lab wired with Open vSwitch like OVN-Kubernetes, and
/// the lab on real OVN in both gateway modes (shared, OpenShift's default, and local,
/// `routingViaHost`). The IPv4 lab's table
/// on the routed wiring is not run again here: `legacy_tc`'s lab is that table on tc, and
/// the wirings' labs run `--attach auto`, which finds no TCX. docs/operations.md lists
/// what was run there by hand.
const GUEST_TESTS: &[GuestRun] = &[
    GuestRun {
        test: "datapath_v4",
        threads: 2,
        include_ignored: false,
        filters: &[
            "from_pod_table",
            "from_tunnel_table",
            "from_underlay_decapsulates",
            "loads_and_attaches",
            "icmp_answer_table",
            "gso_segments_are_measured",
            "big_tcp_with_length_zero",
        ],
    },
    // One lab at a time: two labs of four agents each on two emulated CPUs starve.
    GuestRun {
        test: "legacy_tc",
        threads: 1,
        include_ignored: false,
        filters: &[],
    },
    // Open vSwitch wired as OVN-Kubernetes leaves a node, VLAN secondary networks: this
    // host's kernel has neither, so the OVS tests are `#[ignore]`d on the host (the same
    // file's bridge wiring runs there) and run here with --include-ignored, where they
    // fail without OVS: the wiring's table beside OVN's EgressIP, and a NotReady holder
    // handing over under a TCP stream. Then real OVN (northd, an ovn-controller per node,
    // Geneve), shared gateway then local gateway: the table, then payments isolated by
    // OVN's ACLs as OVN-Kubernetes renders a NetworkPolicy, and what gets past them.
    GuestRun {
        test: "wirings",
        threads: 1,
        include_ignored: true,
        filters: &["like_ovn_kubernetes_", "on_ovn_"],
    },
];

/// One boot of the guest: a test binary of `egress-tests`, its test threads, its filters
/// (none: all of it).
struct GuestRun {
    test: &'static str,
    threads: u32,
    /// Also run its `#[ignore]`d tests: those ignored on the host for needing what only
    /// the guest has (Open vSwitch).
    include_ignored: bool,
    filters: &'static [&'static str],
}

impl GuestRun {
    /// The test binary's arguments in the guest.
    fn args(&self) -> Vec<String> {
        let mut a = vec![format!("--test-threads={}", self.threads)];
        if self.include_ignored {
            a.push("--include-ignored".to_owned());
        }
        a.extend(self.filters.iter().map(|f| (*f).to_owned()));
        a
    }
}

/// Build the guest's test binaries on the host (the guest runs no cargo), then boot the
/// kernel once per binary and run it there. Under emulation the agents are several times
/// slower ([`guest_options`]: a debug agent there takes about 30 s from SIGTERM to
/// adopting what it held); the outcomes asserted are the same.
fn guest_tests() -> Result<()> {
    let names: Vec<&str> = GUEST_TESTS.iter().map(|r| r.test).collect();
    let binaries = test_binaries(&names)?;
    let opts = guest_options(20 * 60);
    let mut failed = Vec::new();
    for run in GUEST_TESTS {
        let name = run.test;
        let bin = binaries
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.clone())
            .with_context(|| format!("cargo built no test binary {name}"))?;
        check_filters(&bin, run)?;
        let mut cmd = vec![bin];
        cmd.extend(run.args());
        let t = Instant::now();
        let status = crate::vm::run(&opts, &cmd)?;
        eprintln!(
            "xtask: {name} on debian-6.1: exit status {status} ({:.0}s)",
            t.elapsed().as_secs_f64()
        );
        if status != 0 {
            failed.push(name);
        }
    }
    anyhow::ensure!(
        failed.is_empty(),
        "failed on debian-6.1: {}",
        failed.join(", ")
    );
    Ok(())
}

/// Each filter of `run` names a test that runs, by the binary's own list (run on the
/// host): a test renamed or `#[ignore]`d would leave a filter that matches nothing, and
/// the guest would pass having run none of it.
fn check_filters(bin: &str, run: &GuestRun) -> Result<()> {
    let list = |only_ignored: bool| -> Result<String> {
        let mut cmd = std::process::Command::new(bin);
        cmd.args(["--list", "--format=terse"]);
        if only_ignored {
            cmd.arg("--ignored");
        }
        let out = cmd
            .output()
            .with_context(|| format!("failed to run {bin} --list"))?;
        anyhow::ensure!(out.status.success(), "{bin} --list: {}", out.status);
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let all = list(false)?;
    let skipped = if run.include_ignored {
        String::new()
    } else {
        list(true)?
    };
    let unmatched = unmatched_filters(run.filters, &all, &skipped);
    anyhow::ensure!(
        unmatched.is_empty(),
        "failed to find a test of {} matching {unmatched:?} that runs (ignored tests run only \
         with include_ignored): fix GUEST_TESTS",
        run.test
    );
    Ok(())
}

/// The `filters` that match no test of `listing` (libtest's `--list --format=terse`)
/// outside `skipped` (a listing of those that do not run).
fn unmatched_filters<'a>(filters: &[&'a str], listing: &str, skipped: &str) -> Vec<&'a str> {
    fn tests(listing: &str) -> impl Iterator<Item = &str> {
        listing
            .lines()
            .filter_map(|line| line.strip_suffix(": test"))
    }
    let skipped: Vec<&str> = tests(skipped).collect();
    let running: Vec<&str> = tests(listing).filter(|t| !skipped.contains(t)).collect();
    filters
        .iter()
        .copied()
        .filter(|f| !running.iter().any(|t| t.contains(f)))
        .collect()
}

/// The paths of the `egress-tests` integration test binaries `names`, built now.
fn test_binaries(names: &[&str]) -> Result<Vec<(String, String)>> {
    let mut a = vec!["-p", "egress-tests"];
    for n in names {
        a.extend(["--test", n]);
    }
    let mut found = Vec::new();
    for msg in crate::pool::test_artifacts(&a, &[])? {
        let (Some(name), Some(exe)) = (
            msg.pointer("/target/name").and_then(|v| v.as_str()),
            msg.get("executable").and_then(|v| v.as_str()),
        ) else {
            continue;
        };
        if names.contains(&name) {
            found.push((name.to_owned(), exe.to_owned()));
        }
    }
    Ok(found)
}

pub fn lab(args: LabArgs) -> Result<()> {
    bootstrap::run()?;
    // egress-lab's arguments.
    let mut a: Vec<&str> = Vec::new();
    if args.keep {
        a.push("--keep");
    }
    if args.ipv6 {
        a.push("--ipv6");
    }
    if args.dual_stack {
        a.push("--dual-stack");
    }
    if let Some(u) = &args.underlay {
        a.extend(["--underlay", u]);
    }
    if args.failover {
        a.push("--failover");
    }
    let rounds = args.rounds.map(|n| n.to_string());
    if let Some(n) = &rounds {
        a.extend(["--rounds", n]);
    }
    let down;
    if let Some(p) = &args.down {
        down = p.clone();
        a.extend(["--down", &down]);
    }
    a.extend(["--cni", &args.cni]);
    let scale: Vec<String> = [
        ("--nodes", args.nodes.map(|n| n.to_string())),
        ("--gateways", args.gateways.map(|n| n.to_string())),
        (
            "--probe-interval-ms",
            args.probe_interval_ms.map(|n| n.to_string()),
        ),
        ("--probe-misses", args.probe_misses.map(|n| n.to_string())),
    ]
    .into_iter()
    .filter_map(|(k, v)| v.map(|v| [k.to_owned(), v]))
    .flatten()
    .collect();
    a.extend(scale.iter().map(String::as_str));
    // One build of the lab and the agents it starts, then the lab's binary itself: `cargo
    // run -p egress-tests` alone resolves other features than this build of both packages
    // and built egress-tests a second time (about 2 minutes of every lab run).
    build_bins()?;
    let lab = crate::vm::workspace_root()?.join("target/release/egress-lab");
    let lab = lab.to_string_lossy().into_owned();
    if ["ovs", "ovn", "ovn-local"].contains(&args.cni.as_str()) {
        anyhow::ensure!(
            !args.keep && args.down.is_none(),
            "--cni {} runs the lab inside a guest that powers off after it: no --keep, --down",
            args.cni
        );
        let mut cmd = vec![lab];
        cmd.extend(a.iter().map(|s| (*s).to_owned()));
        let status = crate::vm::run(&guest_options(30 * 60), &cmd)?;
        anyhow::ensure!(
            status == 0,
            "the lab failed in the guest: egress-lab exited with status {status} (what failed \
             is printed above)"
        );
        return Ok(());
    }
    sh(&lab, &a, &[])
}

/// How the guest runs the lab's agents: a gateway is declared dead after 20 missed probes
/// of 200 ms (4 s) instead of 3 of 100 ms, so that an agent starved under emulation does
/// not fail over; a restarting agent's peers wait 90 s for it instead of 15; every wait of
/// the lab may take 6 times as long (`EGRESS_TEST_TIME_SCALE`).
fn guest_options(timeout_secs: u64) -> crate::vm::Options {
    crate::vm::Options {
        memory: "8G".to_owned(),
        timeout: std::time::Duration::from_secs(timeout_secs),
        env: [
            ("EGRESS_PROBE_MISSES", "20"),
            ("EGRESS_PROBE_INTERVAL_MS", "200"),
            ("EGRESS_RESTART_GRACE_SECS", "90"),
            ("EGRESS_TEST_TIME_SCALE", "6"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect(),
        ..crate::vm::Options::default()
    }
}

pub fn bench(args: BenchArgs) -> Result<()> {
    bootstrap::run()?;
    build_bins()?;
    // The whole benchmark (no section chosen) includes what each agent receives from the
    // API server at 100k pods: egress-agent/tests/fan_out.rs's ignored test, which checks
    // each role's view as it measures (docs/benchmarks.md; ignored by `cargo test` as a
    // minute or more in a debug build).
    if args.rest.is_empty() {
        step("the API's fan-out at 100k pods (fan_out, release)", || {
            sh(
                "cargo",
                &[
                    "test",
                    "--release",
                    "-p",
                    "egress-agent",
                    "--test",
                    "fan_out",
                    "--",
                    "--ignored",
                    "--nocapture",
                ],
                &[],
            )
        })?;
    }
    // The bench's binary as `build_bins` built it (as `cargo xtask lab` runs its own):
    // `cargo run -p egress-tests` would build egress-tests again with other features.
    let bench = crate::vm::workspace_root()?.join("target/release/egress-bench");
    let mut a = Vec::new();
    if args.quick {
        a.push("--quick");
    }
    a.extend(args.rest.iter().map(String::as_str));
    sh(&bench.to_string_lossy(), &a, &[])
}

/// The agent and the echo server, in release mode, for the lab.
pub(crate) fn build_bins() -> Result<()> {
    sh(
        "cargo",
        &[
            "build",
            "--release",
            "--package",
            "egress-agent",
            "--package",
            "egress-tests",
            "--bins",
        ],
        &[],
    )
}

fn step(name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
    let t = Instant::now();
    eprintln!("xtask: {name}");
    f().with_context(|| format!("step failed: {name}"))?;
    eprintln!("xtask: {name}: ok ({:.0}s)", t.elapsed().as_secs_f64());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::unmatched_filters;

    const LISTING: &str = "a_table: test\nthe_ovs_lab: test\nthe_bridge_lab: test\n";

    #[test]
    fn a_filter_matching_no_test_is_reported() {
        assert_eq!(
            unmatched_filters(&["table", "renamed_test"], LISTING, ""),
            ["renamed_test"]
        );
    }

    #[test]
    fn a_filter_matching_only_ignored_tests_is_reported_unless_they_run() {
        let ignored = "the_ovs_lab: test\n";
        assert_eq!(
            unmatched_filters(&["ovs", "lab"], LISTING, ignored),
            ["ovs"]
        );
        assert!(unmatched_filters(&["ovs", "lab"], LISTING, "").is_empty());
    }
}
