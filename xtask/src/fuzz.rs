//! `cargo xtask fuzz`: packet fuzzing of the three programs through `BPF_PROG_TEST_RUN`
//! (the `egress-fuzz` binary of the tests crate, release build: `egress_tests::fuzz`).

use anyhow::Result;

use crate::bootstrap::{self, sh};

#[derive(clap::Args)]
pub struct Args {
    /// Packets per program.
    #[arg(long, default_value_t = 1_000_000)]
    packets: u64,
    /// The generator's seed (decimal or 0x-hex); a new one, printed, when not given. A
    /// failing case prints the seed that makes it again.
    #[arg(long)]
    seed: Option<String>,
}

pub fn run(args: Args) -> Result<()> {
    bootstrap::run()?;
    let packets = args.packets.to_string();
    let mut a = vec![
        "run",
        "--release",
        "--package",
        "egress-tests",
        "--bin",
        "egress-fuzz",
        "--",
        "--packets",
        &packets,
    ];
    if let Some(s) = &args.seed {
        a.extend(["--seed", s]);
    }
    sh("cargo", &a, &[])
}
