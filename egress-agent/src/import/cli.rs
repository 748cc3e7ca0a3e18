//! `import-egressip`'s flags and its run, shared by `egress-agent import-egressip` and
//! `kubectl egress import-egressip`: read the files (or stdin), or list the cluster's
//! `EgressIP` objects (`--from-cluster`), print the policies, return the refusals for the
//! caller to print and fail on.

use std::{collections::BTreeMap, io::Read as _, path::PathBuf, time::Duration};

use super::{Document, Options, Refusal, cluster, documents, import};
use crate::{api::FailurePolicy, source};

/// `import-egressip`'s flags.
#[derive(clap::Args, Debug, Clone)]
pub struct ImportArgs {
    /// YAML files of `EgressIP` objects (one or more documents each, or the `List` that
    /// `kubectl get egressips -o yaml` prints); `-` or none: stdin.
    #[arg(value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// Read the `EgressIP` objects from the cluster's API instead (RBAC: list on
    /// egressips.k8s.ovn.org, cluster-wide).
    #[arg(long, conflicts_with = "files")]
    pub from_cluster: bool,
    /// With --from-cluster: only the `EgressIP` of this name (repeat the flag for
    /// several); a name the cluster does not have is refused.
    #[arg(long = "name", value_name = "NAME", requires = "from_cluster")]
    pub names: Vec<String>,
    /// With --from-cluster: the kubeconfig (default: $KUBECONFIG, ~/.kube/config, or the
    /// in-cluster service account).
    #[arg(long, requires = "from_cluster")]
    pub kubeconfig: Option<PathBuf>,
    /// With --from-cluster: seconds to wait for the list.
    #[arg(long, default_value_t = 30)]
    pub timeout_secs: u64,
    /// The policies' gateway nodes, as KEY=VALUE labels (repeat the flag, or separate
    /// them with commas); default: k8s.ovn.org/egress-assignable= (OVN-Kubernetes'
    /// egress nodes).
    #[arg(long = "gateway-selector", value_name = "KEY=VALUE", value_delimiter = ',',
          value_parser = parse_label)]
    pub gateway_selector: Vec<(String, String)>,
    /// What the selected pods' traffic does when a policy has no usable gateway: Drop
    /// (fail closed, counted) or Fallthrough (leave as if unselected).
    #[arg(long, value_name = "POLICY", default_value = "Drop", value_parser = parse_failure_policy)]
    pub failure_policy: FailurePolicy,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected KEY=VALUE (an empty VALUE is KEY=)"))?;
    if k.is_empty() {
        return Err(format!("{s:?}: the label's key is empty"));
    }
    Ok((k.to_owned(), v.to_owned()))
}

fn parse_failure_policy(s: &str) -> Result<FailurePolicy, String> {
    match s {
        "Drop" => Ok(FailurePolicy::Drop),
        "Fallthrough" => Ok(FailurePolicy::Fallthrough),
        _ => Err(format!("{s:?}: expected Drop or Fallthrough")),
    }
}

impl ImportArgs {
    pub fn options(&self) -> Options {
        let mut opts = Options {
            failure_policy: self.failure_policy,
            ..Options::default()
        };
        if !self.gateway_selector.is_empty() {
            opts.gateway_labels = self
                .gateway_selector
                .iter()
                .cloned()
                .collect::<BTreeMap<_, _>>();
        }
        opts
    }
}

/// Read every input and translate it: the policies' YAML, and every refusal (an
/// unreadable file is one too, and the other files are still read). An error is a list
/// of the cluster's objects that failed as a whole (`--from-cluster`).
pub async fn run(args: &ImportArgs) -> Result<(String, Vec<Refusal>), cluster::Error> {
    let (docs, mut refused) = if args.from_cluster {
        let client = source::kube::client(args.kubeconfig.clone()).await?;
        let timeout = Duration::from_secs(args.timeout_secs.max(1));
        cluster::documents(&client, &args.names, timeout).await?
    } else {
        read_files(&args.files)
    };
    let (yaml, r) = import(&docs, &args.options());
    refused.extend(r);
    Ok((yaml, refused))
}

/// The objects of `files` (none: stdin), and a refusal for each file not read.
fn read_files(files: &[PathBuf]) -> (Vec<Document>, Vec<Refusal>) {
    let stdin = PathBuf::from("-");
    let files = if files.is_empty() {
        std::slice::from_ref(&stdin)
    } else {
        files
    };
    let mut docs = Vec::new();
    let mut refused = Vec::new();
    for f in files {
        let (source, text) = if *f == stdin {
            let mut text = String::new();
            let read = std::io::stdin().read_to_string(&mut text).map(|_| text);
            ("stdin".to_owned(), read)
        } else {
            (f.display().to_string(), std::fs::read_to_string(f))
        };
        match text {
            Ok(text) => {
                let (d, r) = documents(&text, &source);
                docs.extend(d);
                refused.extend(r);
            }
            Err(e) => refused.push(Refusal {
                object: source,
                field: "(file)".into(),
                problem: format!("failed to read it: {e}"),
            }),
        }
    }
    (docs, refused)
}
