//! `cargo xtask soak --minutes N`: the churn soak (`egress_tests::soak`) on the lab, its
//! summary table, exit status 1 if a target was missed. Needs root, and `egress-agent`
//! next to this binary.

use std::process::ExitCode;

use anyhow::{Context as _, Result, bail};
use egress_tests::{netns, soak};

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("egress-soak: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<bool> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut minutes = 30;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--minutes" => {
                minutes = it
                    .next()
                    .context("--minutes needs a value")?
                    .parse()
                    .context("--minutes needs a positive number")?;
            }
            other => bail!("unknown argument {other:?} (usage: egress-soak [--minutes N])"),
        }
    }
    if minutes == 0 {
        bail!("--minutes needs a positive number");
    }
    netns::install_signal_teardown()?;
    let report = soak::run(&soak::Config::minutes(minutes))?;
    println!("{}", report.table());
    Ok(report.ok())
}
