//! The host's tests, two at a time across every test binary rather than within one:
//! `cargo test` runs its binaries one after the other, so a binary holding one long test
//! (the churn soak: four minutes; the 20-node lab) left the second CPU idle while it ran.
//!
//! Cargo builds every test binary (`--no-run`); then each of `egress-tests`' integration
//! tests (the lab, namespace and packet tests, each seconds to minutes) is a job of its
//! own (`--exact`, one test thread), and every other binary (unit tests, the agent's
//! tests: many short ones) is one job with two test threads. A few binaries run alone
//! first, whole, with two test threads ([`ALONE`]); then two jobs run at once, the
//! longest known first; each job's output is printed when it ends, and every failure is
//! listed at the end, as `--no-fail-fast` would.

use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::Instant,
};

use anyhow::{Context as _, Result};

/// Jobs at once: the lab tests run a dozen namespaces and several agents each, and on two
/// cores more than two at a time only makes their timeouts flaky.
const SLOTS: usize = 2;

/// The test binaries whose tests take longest, started first (longest first), so that no
/// long test is left to run alone at the end.
const LONGEST_FIRST: &[&str] = &[
    "soak",
    "failover",
    "e2e_v4",
    "e2e_v6",
    "unknown_pods",
    "flow_limit",
    "doctor",
    "network_policy",
];

/// Test binaries that run alone, before the others, each as one job with two test threads
/// (as cargo ran every binary): those that load the machine themselves, next to which
/// another lab's agents started too slowly for its timeouts (in the fresh-clone run of
/// 4c1b74f a failover test next to the 20-node lab: a gateway's agent had not started
/// within 30 s), and the packet tables (two workers each verifying the programs). The
/// churn soak ran alone too while an agent that started during a broken policy served
/// none of it (a restarted agent next to another lab started late into the next broken
/// step); since agents keep their last accepted versions (901a129) it shares the machine,
/// started first ([`LONGEST_FIRST`]).
const ALONE: &[&str] = &["scale_lab", "datapath_v4", "datapath_v6", "fuzz"];

/// The package whose integration tests run one job per test.
const PER_TEST_PACKAGE: &str = "egress-tests";

struct Binary {
    /// The test target's name (`soak`, or the crate's for unit tests).
    name: String,
    exe: PathBuf,
    /// The package's directory: cargo runs a test binary there.
    dir: PathBuf,
    per_test: bool,
}

struct Job {
    what: String,
    exe: PathBuf,
    dir: PathBuf,
    args: Vec<String>,
}

/// Build the workspace's tests (but the eBPF crate), then run them all as described in
/// the module's comment, with `env`; the doctests run after, by cargo.
pub fn run(env: &[(&str, &str)]) -> Result<()> {
    run_binaries(env, None)
}

/// [`run`] for the test binaries named `only` (none alone, no doctests): the build is the
/// same as [`run`]'s, so nothing is compiled again.
pub fn run_only(only: &[&str], env: &[(&str, &str)]) -> Result<()> {
    run_binaries(env, Some(only))
}

fn run_binaries(env: &[(&str, &str)], only: Option<&[&str]>) -> Result<()> {
    let mut binaries = build(env)?;
    if let Some(only) = only {
        binaries.retain(|b| only.contains(&b.name.as_str()));
        anyhow::ensure!(
            binaries.len() == only.len(),
            "cargo built no test binary for some of {only:?}"
        );
    }
    let mut jobs = Vec::new();
    for b in &binaries {
        jobs.extend(jobs_of(b)?);
    }
    let rank = |j: &Job| {
        LONGEST_FIRST
            .iter()
            .position(|n| j.what.starts_with(&format!("{n} ")) || j.what == *n)
            .unwrap_or(LONGEST_FIRST.len())
    };
    // Stable: within a rank, cargo's order.
    jobs.sort_by_key(rank);
    let total = jobs.len();
    let (alone, jobs): (Vec<Job>, Vec<Job>) = jobs
        .into_iter()
        .partition(|j| only.is_none() && ALONE.contains(&j.what.as_str()));
    eprintln!(
        "xtask: {total} test jobs from {} binaries: {} alone, then {SLOTS} at a time",
        binaries.len(),
        alone.len()
    );
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let mut failed_alone: Vec<String> = alone
        .into_iter()
        .filter(|job| !run_job(job, &env))
        .map(|job| job.what)
        .collect();
    let queue = Arc::new(Mutex::new(VecDeque::from(jobs)));
    let failed = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..SLOTS)
        .map(|_| {
            let (queue, failed, env) = (Arc::clone(&queue), Arc::clone(&failed), env.clone());
            std::thread::spawn(move || {
                loop {
                    let Some(job) = queue.lock().expect("job queue").pop_front() else {
                        break;
                    };
                    if !run_job(&job, &env) {
                        failed.lock().expect("failures").push(job.what);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join()
            .map_err(|_| anyhow::anyhow!("a test worker panicked"))?;
    }
    failed_alone.append(&mut failed.lock().expect("failures"));
    let failed = failed_alone;
    if only.is_some() {
        anyhow::ensure!(
            failed.is_empty(),
            "{} of {total} test jobs failed:\n  {}",
            failed.len(),
            failed.join("\n  ")
        );
        return Ok(());
    }
    // The doctests: cargo alone runs them.
    let doc = crate::bootstrap::sh(
        "cargo",
        &["test", "--workspace", "--exclude", "egress-ebpf", "--doc"],
        env_refs(&env).as_slice(),
    );
    anyhow::ensure!(
        failed.is_empty(),
        "{} of {total} test jobs failed:\n  {}",
        failed.len(),
        failed.join("\n  ")
    );
    doc
}

fn env_refs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// `cargo test --no-run`: every test binary of the workspace but the eBPF crate's.
fn build(env: &[(&str, &str)]) -> Result<Vec<Binary>> {
    let args = ["--workspace", "--exclude", "egress-ebpf"];
    let mut found = Vec::new();
    for msg in test_artifacts(&args, env)? {
        let str_at = |p: &str| msg.pointer(p).and_then(|v| v.as_str());
        let (Some(name), Some(exe), Some(manifest)) = (
            str_at("/target/name"),
            str_at("/executable"),
            str_at("/manifest_path"),
        ) else {
            continue;
        };
        // The binaries cargo built for the integration tests to run are no tests.
        if msg
            .pointer("/profile/test")
            .and_then(serde_json::Value::as_bool)
            != Some(true)
        {
            continue;
        }
        let kinds = msg.pointer("/target/kind").and_then(|v| v.as_array());
        let integration = kinds.is_some_and(|k| k.iter().any(|k| k == "test"));
        let dir = Path::new(manifest)
            .parent()
            .context("a manifest path without a directory")?
            .to_owned();
        found.push(Binary {
            name: name.to_owned(),
            exe: PathBuf::from(exe),
            per_test: integration && package_is(&msg),
            dir,
        });
    }
    anyhow::ensure!(
        !found.is_empty(),
        "cargo test --no-run built no test binary"
    );
    Ok(found)
}

/// `cargo test --no-run` with `args`: cargo's JSON message of each test binary built
/// (`executable`, `target`, `profile`, `manifest_path`, `package_id`).
pub fn test_artifacts(args: &[&str], env: &[(&str, &str)]) -> Result<Vec<serde_json::Value>> {
    let out = Command::new("cargo")
        .args([
            "test",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .args(args)
        .envs(env.iter().copied())
        .stderr(Stdio::inherit())
        .output()
        .context("failed to run cargo test --no-run")?;
    anyhow::ensure!(out.status.success(), "cargo test --no-run failed");
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|msg| msg.get("executable").is_some_and(|e| !e.is_null()))
        .collect())
}

fn package_is(msg: &serde_json::Value) -> bool {
    msg.get("package_id")
        .and_then(|v| v.as_str())
        .is_some_and(|id| id.contains(&format!("#{PER_TEST_PACKAGE}@")) || id.contains("/tests#"))
}

/// The jobs of one binary: one per test that runs by default (not `#[ignore]`d), or the
/// whole binary.
fn jobs_of(b: &Binary) -> Result<Vec<Job>> {
    if !b.per_test || ALONE.contains(&b.name.as_str()) {
        return Ok(vec![Job {
            what: b.name.clone(),
            exe: b.exe.clone(),
            dir: b.dir.clone(),
            args: vec!["--test-threads=2".to_owned()],
        }]);
    }
    let list = |ignored: bool| -> Result<Vec<String>> {
        let mut cmd = Command::new(&b.exe);
        cmd.current_dir(&b.dir).args(["--list", "--format=terse"]);
        if ignored {
            cmd.arg("--ignored");
        }
        let out = cmd
            .output()
            .with_context(|| format!("failed to list the tests of {}", b.exe.display()))?;
        anyhow::ensure!(out.status.success(), "{} --list failed", b.exe.display());
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_suffix(": test"))
            .map(str::to_owned)
            .collect())
    };
    let ignored = list(true)?;
    Ok(list(false)?
        .into_iter()
        .filter(|t| !ignored.contains(t))
        .map(|t| Job {
            what: format!("{} {t}", b.name),
            exe: b.exe.clone(),
            dir: b.dir.clone(),
            args: vec!["--exact".to_owned(), t, "--test-threads=1".to_owned()],
        })
        .collect())
}

/// Run one job, print its output and outcome; whether it passed.
fn run_job(job: &Job, env: &[(String, String)]) -> bool {
    let t = Instant::now();
    let out = Command::new(&job.exe)
        .args(&job.args)
        .current_dir(&job.dir)
        .env("CARGO_MANIFEST_DIR", &job.dir)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .output();
    let secs = t.elapsed().as_secs_f64();
    match out {
        Ok(o) => {
            let ok = o.status.success();
            // One print per job: the two workers' outputs never interleave.
            let mut text = format!(
                "xtask: test {}: {} ({secs:.1}s)\n",
                job.what,
                if ok { "ok" } else { "FAILED" }
            );
            if !ok {
                text.push_str(&String::from_utf8_lossy(&o.stdout));
                text.push_str(&String::from_utf8_lossy(&o.stderr));
            }
            eprint!("{text}");
            ok
        }
        Err(e) => {
            eprintln!("xtask: test {}: failed to start: {e}", job.what);
            false
        }
    }
}
