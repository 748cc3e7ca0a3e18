//! `cargo xtask test`, `lab` and `bench`: thin drivers over cargo and the tests crate.

use std::time::Instant;

use anyhow::{Context as _, Result};

use crate::bootstrap::{self, TOOLCHAIN, sh};

#[derive(clap::Args)]
pub struct Args {
    /// Skip the format and clippy checks.
    #[arg(long)]
    no_lint: bool,
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
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// A shorter run (a few minutes).
    #[arg(long)]
    quick: bool,
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
    // tests/tests/image.rs loads the image into podman and unpacks it.
    let mut image = String::new();
    step("image (cargo xtask image)", || {
        image = crate::image::build()?.to_string_lossy().into_owned();
        Ok(())
    })?;
    step("tests (unit, packet, namespace, lab)", || {
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
        // The lab tests' agents (debug builds, two labs at a time on two cores) declare a
        // gateway dead after 6 missed probes (600 ms) instead of 3: a loaded CI machine
        // can starve a process for longer than 300 ms, and a needless failover would move
        // egress IPs under tests that do not expect it. The failover tests assert outcomes
        // (streams survive, one holder), not detection times; `cargo xtask lab
        // --failover` shows the default settings' times.
        sh(
            "cargo",
            &a,
            &[
                ("EGRESS_PROBE_MISSES", "6"),
                ("EGRESS_IMAGE_ARCHIVE", &image),
            ],
        )
    })?;
    eprintln!(
        "xtask test: all steps passed in {:.0}s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

pub fn lab(args: LabArgs) -> Result<()> {
    bootstrap::run()?;
    let mut a = vec![
        "run",
        "--release",
        "--package",
        "egress-tests",
        "--bin",
        "egress-lab",
        "--",
    ];
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
    build_bins()?;
    sh("cargo", &a, &[])
}

pub fn bench(args: BenchArgs) -> Result<()> {
    bootstrap::run()?;
    build_bins()?;
    let mut a = vec![
        "run",
        "--release",
        "--package",
        "egress-tests",
        "--bin",
        "egress-bench",
        "--",
    ];
    if args.quick {
        a.push("--quick");
    }
    sh("cargo", &a, &[])
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
