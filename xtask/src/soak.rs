//! `cargo xtask soak`: the churn soak on the lab (the `egress-soak` binary of the tests
//! crate, release build: `egress_tests::soak`), with release builds of the agent and the
//! echo server.

use anyhow::Result;

use crate::bootstrap::{self, sh};

#[derive(clap::Args)]
pub struct Args {
    /// How long the churn and the traffic run.
    #[arg(long, default_value_t = 30)]
    minutes: u64,
}

pub fn run(args: Args) -> Result<()> {
    bootstrap::run()?;
    let minutes = args.minutes.to_string();
    // The soak starts agents and echo servers as processes: release builds of both, next
    // to the soak binary.
    crate::test::build_bins()?;
    sh(
        "cargo",
        &[
            "run",
            "--release",
            "--package",
            "egress-tests",
            "--bin",
            "egress-soak",
            "--",
            "--minutes",
            &minutes,
        ],
        &[],
    )
}
