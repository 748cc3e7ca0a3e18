//! `cargo xtask upgrade-test --from <rev>`: `<rev>` built in a worktree of this repository
//! (`target/upgrade/<commit>`, its own target directory), this tree's agent and lab built,
//! then `egress-lab --upgrade`: the lab's agents start as `<rev>`'s, are replaced one node
//! at a time by this tree's while a pod streams TCP, UDP and ping through egress IP A, and
//! rolled back the same way. One row per node replaced: holders of A, time with two
//! holders, TCP, the longest UDP gap. Exits non-zero if A moved, two gateways held it, or
//! TCP broke.

use std::process::Command;

use anyhow::{Context as _, Result, bail};

use crate::bootstrap::{self, sh};

#[derive(clap::Args)]
pub struct Args {
    /// The earlier build: a tag (`v0.1.0`), branch or commit of this repository.
    #[arg(long, value_name = "REV")]
    from: String,
    /// The earlier build is started with the lab's liveness key (only for a `<rev>`
    /// that has `--liveness-key-file`).
    #[arg(long)]
    from_keyed: bool,
}

fn git(args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(crate::vm::workspace_root()?)
        .output()
        .context("failed to run git")?;
    if !out.status.success() {
        bail!(
            "`git {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

pub fn run(args: Args) -> Result<()> {
    bootstrap::run()?;
    let commit = git(&[
        "rev-parse",
        "--verify",
        &format!("{}^{{commit}}", args.from),
    ])
    .with_context(|| format!("--from {}: no such revision here", args.from))?;
    let short = &commit[..12];
    let base = crate::vm::workspace_root()?.join("target/upgrade");
    let tree = base.join(short);
    if !tree.join("Cargo.toml").exists() {
        std::fs::create_dir_all(&base)?;
        let _ = git(&["worktree", "prune"]);
        git(&[
            "worktree",
            "add",
            "--detach",
            "--force",
            &tree.to_string_lossy(),
            &commit,
        ])?;
    }
    eprintln!(
        "xtask: building {} ({short}) in {}",
        args.from,
        tree.display()
    );
    let target = base.join("target");
    let status = Command::new("cargo")
        .args([
            "build",
            "--package",
            "egress-agent",
            "--bin",
            "egress-agent",
        ])
        .current_dir(&tree)
        .env("CARGO_TARGET_DIR", &target)
        .env("EGRESS_COMMIT", short)
        .status()
        .context("failed to run cargo")?;
    if !status.success() {
        bail!("failed to build {} in {}", args.from, tree.display());
    }
    let old = target.join("debug/egress-agent");
    sh(
        "cargo",
        &[
            "build",
            "--package",
            "egress-agent",
            "--package",
            "egress-tests",
            "--bins",
        ],
        &[],
    )?;
    let lab = crate::vm::workspace_root()?.join("target/debug/egress-lab");
    let label = args.from.clone();
    let old_s = old.to_string_lossy();
    let mut lab_args = vec!["--upgrade", "--old", &old_s, "--old-label", &label];
    if args.from_keyed {
        lab_args.push("--old-keyed");
    }
    let status = Command::new(&lab)
        .args(&lab_args)
        .status()
        .with_context(|| format!("failed to run {}", lab.display()))?;
    if !status.success() {
        bail!("the rolling upgrade from {} failed: {status}", args.from);
    }
    Ok(())
}
