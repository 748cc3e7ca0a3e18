//! `cargo xtask fuzz --packets N [--seed S]`: N random and mutated packets per program
//! through `BPF_PROG_TEST_RUN`, every one held to the datapath's properties
//! (`egress_tests::fuzz`). Prints per program the verdicts, the reasons counted and the
//! rate; exits non-zero, with each failing case's seed, index and packet, if any property
//! broke. Needs root (BPF, a network namespace).

use anyhow::{Context as _, Result, bail};
use egress_tests::fuzz::{self, Options, report};

const USAGE: &str = "usage: egress-fuzz [--packets N] [--seed S] [--full-conntrack] [--sweeps]

  --packets N       packets per program (default 1000000)
  --seed S          the generator's seed, decimal or 0x-hex (default: from the clock, printed)
  --full-conntrack  start with both conntrack maps full of other flows (LRU eviction)
  --sweeps          the agent's sweeper walks conntrack every 1,024 packets, its clock
                    up to six hours ahead";

fn parse_u64(s: &str) -> Result<u64> {
    let s = s.replace('_', "");
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    }
    .with_context(|| format!("failed to read {s:?} as a number"))
}

fn options() -> Result<Options> {
    let mut opts = Options {
        packets: 1_000_000,
        seed: fuzz::random_seed(),
        full_conntrack: false,
        sweeps: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || {
            args.next()
                .with_context(|| format!("{a} needs a value\n{USAGE}"))
        };
        match a.as_str() {
            "--packets" => opts.packets = parse_u64(&value()?)?,
            "--seed" => opts.seed = parse_u64(&value()?)?,
            "--full-conntrack" => opts.full_conntrack = true,
            "--sweeps" => opts.sweeps = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    Ok(opts)
}

fn main() -> Result<()> {
    let opts = options()?;
    eprintln!(
        "fuzz: {} packets per program, seed {:#018x}",
        opts.packets, opts.seed
    );
    let r = fuzz::run(opts);
    print!("{}", report::summary(&r));
    if r.failed() > 0 {
        bail!(
            "{} packets broke a property (seed {:#x}): see FAILED above",
            r.failed(),
            r.seed
        );
    }
    Ok(())
}
