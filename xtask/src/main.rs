//! Developer commands: `cargo xtask <command>`.

mod bootstrap;
mod build;
mod fuzz;
mod image;
mod pool;
mod soak;
mod test;
mod upgrade;
mod vm;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Developer commands for the egress gateway datapath")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install what building and testing need (Debian's rustc-web and rust-web-src,
    /// LLVM 22, bpf-linker, bpftool, iproute2, traffic tools). Idempotent.
    Bootstrap,
    /// Build the eBPF object (through the agent's build script) and print its path.
    BuildEbpf,
    /// Build the agent's OCI image from scratch (release binary and its libraries, no base
    /// image) as target/image/egress-agent.oci.tar; print its digest and size.
    Image {
        /// Pack the debug build of the agent instead (as `cargo xtask test` does for the
        /// image test), into target/image/egress-agent-dev.oci.tar.
        #[arg(long)]
        dev: bool,
    },
    /// The project's test command: format, clippy (host and eBPF), unit, packet and
    /// namespace tests.
    Test(test::Args),
    /// Bring up the multi-node lab, show per-destination egress, tear it down.
    Lab(test::LabArgs),
    /// Benchmarks, side by side with the kernel baseline; with no section chosen (nothing
    /// after `--`), also what each agent receives from the API server at 100k pods
    /// (egress-agent/tests/fan_out.rs's ignored test, in release).
    Bench(test::BenchArgs),
    /// Packet fuzzing: N random and mutated packets per program through test_run, each
    /// held to the datapath's properties; prints verdicts, reasons hit and failures.
    Fuzz(fuzz::Args),
    /// The churn soak: N minutes of traffic through the lab while policies are edited,
    /// pods removed and re-added, agents restarted and gateways failed; checks sources at
    /// the far hosts every second, then maps, agent memory and leftovers; exits non-zero
    /// if a target is missed.
    Soak(soak::Args),
    /// Boot a stock Debian kernel under QEMU (TCG) and run CMD as root in the guest, in
    /// the current directory, on the host's filesystem (the workspace writable, the rest
    /// writable but discarded); exit with CMD's status. E.g. `cargo xtask vm --kernel
    /// debian-6.1 -- uname -r`.
    Vm(vm::Args),
    /// A rolling upgrade in the lab from an earlier build (`--from <rev>`, built in a
    /// worktree) to this tree's, and the rollback, under TCP, UDP and ping through egress
    /// IP A; one row per node replaced (holders, two-holder time, TCP, UDP gap).
    UpgradeTest(upgrade::Args),
}

/// A failed command says why in one line of context chain (`failed to ...: ...`) and exits
/// with status 1. Not `main() -> Result`: that prints the error's `Debug`, which with
/// `RUST_BACKTRACE` set is a stack backtrace of xtask, when the failure is almost always in
/// what it ran (a lab's rows, a test), whose own output says what failed.
fn main() -> ExitCode {
    match run(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cargo xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Bootstrap => bootstrap::run(),
        Command::BuildEbpf => {
            bootstrap::run()?;
            let obj = build::ebpf_object()?;
            println!("{}", obj.display());
            Ok(())
        }
        Command::Image { dev } => image::run(if dev {
            image::Profile::Dev
        } else {
            image::Profile::Release
        }),
        Command::Test(args) => test::run(args),
        Command::Lab(args) => test::lab(args),
        Command::Bench(args) => test::bench(args),
        Command::Fuzz(args) => fuzz::run(args),
        Command::Soak(args) => soak::run(args),
        Command::Vm(args) => vm::main(args),
        Command::UpgradeTest(args) => upgrade::run(args),
    }
}
