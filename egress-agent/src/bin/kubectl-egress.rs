//! `kubectl-egress`: the kubectl plugin (`kubectl egress ...`), reading the cluster through
//! kubeconfig: `explain` (as `egress-agent explain`) and `status` (every policy's
//! conditions and egress IPs with their holders and pods, and every EgressNode); and
//! `import-egressip` (as `egress-agent import-egressip`).

use std::{path::PathBuf, process::ExitCode, time::Duration};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use egress_agent::{explain, import, overview, source::kube as kube_source};

#[derive(Parser)]
#[command(
    name = "kubectl egress",
    bin_name = "kubectl egress",
    version = egress_agent::VERSION,
    about = "Per-destination egress gateways: explain a pod's egress, show the cluster's state"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Say why a pod's traffic to a destination leaves the way it does (policy, rule,
    /// prefix, gateway, interface, egress IP, NetworkPolicy verdict, failure policy), or
    /// why no policy takes it.
    Explain(Box<explain::cli::ExplainArgs>),
    /// Every policy's conditions and egress IPs with their holders and pod counts, and
    /// what every EgressNode holds, from the API (no agent's metrics endpoint needed).
    Status {
        /// Kubeconfig (default: $KUBECONFIG, ~/.kube/config, or the in-cluster service
        /// account).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// Seconds to wait for each list.
        #[arg(long, default_value_t = 30)]
        timeout_secs: u64,
    },
    /// Translate OVN-Kubernetes EgressIP objects (the cluster's with --from-cluster, or
    /// YAML files or stdin: `kubectl get egressips -o yaml | kubectl egress
    /// import-egressip`) into EgressGatewayPolicies.
    ImportEgressip(import::cli::ImportArgs),
}

fn main() -> ExitCode {
    match real_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "kubectl egress: {}",
                egress_agent::report::chain(e.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    // Logs only when asked for (RUST_LOG): the output is the answer.
    if std::env::var_os("RUST_LOG").is_some() {
        egress_agent::logs::init(egress_agent::logs::LogFormat::default());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("failed to start the runtime")?;
    let text = match cli.command {
        Command::Explain(args) => runtime.block_on(explain::cli::run(&args))?,
        Command::ImportEgressip(args) => {
            let (yaml, refused) = runtime.block_on(import::cli::run(&args))?;
            print!("{yaml}");
            for r in &refused {
                eprintln!("kubectl egress import-egressip: {r}");
            }
            if !refused.is_empty() {
                anyhow::bail!(
                    "{} refusal(s) above: those objects were not translated",
                    refused.len()
                );
            }
            return Ok(());
        }
        Command::Status {
            kubeconfig,
            timeout_secs,
        } => runtime.block_on(async {
            let client = kube_source::client(kubeconfig).await?;
            let timeout = Duration::from_secs(timeout_secs.max(1));
            let (policies, nodes) = overview::list(&client, timeout).await?;
            anyhow::Ok(overview::text(&policies, &nodes))
        })?,
    };
    print!("{text}");
    Ok(())
}
