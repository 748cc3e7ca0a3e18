//! `explain`'s flags and its run, shared by `egress-agent explain` and `kubectl egress
//! explain`: load the view (a state directory, or the Kubernetes API), explain, add the
//! counters of the maps pinned here.

use std::{path::PathBuf, time::Duration};

use ipnet::IpNet;

use super::{Destination, Error, PodRef, Result, counters, explain, render};
use crate::{
    ebpf,
    source::{self, Snapshot, yaml},
};

/// `explain`'s flags.
#[derive(clap::Args, Debug, Clone)]
pub struct ExplainArgs {
    /// The pod, as NAMESPACE/NAME.
    #[arg(long, value_name = "NS/NAME")]
    pub pod: String,
    /// The destination: an address, with a port and protocol if they matter (for
    /// NetworkPolicy): 192.0.2.7, 192.0.2.7:443 (TCP), 192.0.2.7:53/udp,
    /// [2001:db8::7]:443/tcp.
    #[arg(long, value_name = "ADDR[:PORT][/PROTO]")]
    pub to: String,
    /// Read the cluster from this state directory (as `run --state-dir` and `check`);
    /// default: the Kubernetes API.
    #[arg(long, conflicts_with = "kubeconfig")]
    pub state_dir: Option<PathBuf>,
    /// Kubeconfig for the Kubernetes API (default: $KUBECONFIG, ~/.kube/config, or the
    /// in-cluster service account).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// A pod or service CIDR of the cluster, as the agents are given it (`--cluster-cidr`):
    /// it is never steered. Repeat the flag, or separate CIDRs with commas.
    #[arg(long = "cluster-cidr", value_name = "CIDR", value_delimiter = ',')]
    pub cluster_cidrs: Vec<IpNet>,
    /// The agent's pinned maps on this node, for the counters of the path.
    #[arg(long, default_value = ebpf::DEFAULT_BPFFS_DIR)]
    pub bpffs_dir: PathBuf,
    /// Seconds to wait for the Kubernetes API to list the cluster.
    #[arg(long, default_value_t = 30)]
    pub timeout_secs: u64,
}

/// Where the view comes from.
#[derive(Clone, Debug)]
pub enum Source {
    Dir(PathBuf),
    Kube {
        kubeconfig: Option<PathBuf>,
        timeout: Duration,
    },
}

impl ExplainArgs {
    pub fn source(&self) -> Source {
        match &self.state_dir {
            Some(dir) => Source::Dir(dir.clone()),
            None => Source::Kube {
                kubeconfig: self.kubeconfig.clone(),
                timeout: Duration::from_secs(self.timeout_secs.max(1)),
            },
        }
    }
}

/// The cluster view of `source`, and what could not be read of it (left out).
pub async fn load(source: &Source, cluster_cidrs: &[IpNet]) -> Result<Snapshot> {
    let mut snapshot = match source {
        Source::Dir(dir) => {
            if !dir.is_dir() {
                return Err(Error::StateDir { dir: dir.clone() });
            }
            yaml::load_dir(dir)
        }
        Source::Kube {
            kubeconfig,
            timeout,
        } => {
            let client = source::kube::client(kubeconfig.clone()).await?;
            tokio::time::timeout(*timeout, source::kube::list(client, cluster_cidrs.to_vec()))
                .await
                .map_err(|_| Error::ListTimeout {
                    secs: timeout.as_secs(),
                })??
        }
    };
    for cidr in cluster_cidrs {
        if !snapshot.view.cluster_cidrs.contains(cidr) {
            snapshot.view.cluster_cidrs.push(cidr.trunc());
        }
    }
    Ok(snapshot)
}

/// The whole answer of `explain`: the explanation, the counters of the maps pinned here,
/// and a line per object left out of the view.
pub async fn run(args: &ExplainArgs) -> Result<String> {
    let pod: PodRef = args.pod.parse()?;
    let to: Destination = args.to.parse()?;
    let snapshot = load(&args.source(), &args.cluster_cidrs).await?;
    let explanation = explain(&snapshot.view, &pod, to)?;
    let mut text = render::text(&explanation);
    text.push_str(&counters::text(&explanation, &args.bpffs_dir));
    if !snapshot.errors.is_empty() {
        text.push_str(&format!(
            "{:<16}{} object(s) could not be read and are left out of the view:\n",
            "note:",
            snapshot.errors.len()
        ));
        for e in &snapshot.errors {
            text.push_str(&format!("{:<16}{e}\n", ""));
        }
    }
    Ok(text)
}
