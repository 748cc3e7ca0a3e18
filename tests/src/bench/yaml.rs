//! What the YAML source's re-read costs when one file of its directory changes (issue 49:
//! "the YAML source re-reads only the file that changed"): a state directory with the
//! cluster's Nodes and pods in `cluster.yaml` and the policies in `policy.yaml`, one
//! policy edited, the directory read again as the watcher reads it. Before: every file
//! parsed again (as up to d8df172); now: only the files whose stamp changed. In this
//! process, without root: `egress-bench --yaml`.

use std::{fmt::Write as _, path::Path, time::Instant};

use anyhow::{Context as _, Result, ensure};
use egress_agent::source::yaml::Rereads;

use super::{
    Plan, Spread,
    report::{Table, thousands},
};

/// A directory of this process's own under the temporary directory, removed on drop.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("egress-bench-yaml-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("failed to create {}", dir.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `cluster.yaml`: `nodes` Nodes and `pods` pods spread over them, written compactly (as
/// docs/operations.md advises for a big cluster).
fn cluster_yaml(nodes: u32, pods: u32) -> String {
    let mut s = String::new();
    for n in 0..nodes {
        let _ = write!(
            s,
            "---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-{n:03}}}\nstatus:\n  \
             addresses: [{{type: InternalIP, address: 10.0.{}.{}}}]\n  conditions: [{{type: \
             Ready, status: \"True\"}}]\n",
            n / 250,
            n % 250 + 1
        );
    }
    for p in 0..pods {
        let node = p % nodes;
        let _ = write!(
            s,
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: pod-{p}, namespace: ns-{}, \
             labels: {{app: app-{}}}}}\nspec: {{nodeName: node-{node:03}, containers: [{{name: \
             c, image: x}}]}}\nstatus: {{phase: Running, podIPs: [{{ip: 10.{}.{}.{}}}]}}\n",
            p % 50,
            p % 200,
            128 + (p >> 16),
            (p >> 8) & 255,
            p & 255
        );
    }
    s
}

/// `policy.yaml`: one policy, its egress IP's last octet `v`.
fn policy_yaml(v: u8) -> String {
    format!(
        "apiVersion: egress.dev/v1alpha1\nkind: EgressGatewayPolicy\nmetadata: {{name: \
         payments}}\nspec:\n  podSelector: {{matchLabels: {{app: app-1}}}}\n  \
         gatewaySelector: {{matchLabels: {{egress.dev/gateway: \"true\"}}}}\n  rules:\n  - \
         destinations: [\"192.0.2.0/24\"]\n    egressIP: 198.51.100.{v}\n"
    )
}

/// Median milliseconds of `rounds` re-reads after a policy edit, parsing every file
/// (`whole`) or the changed one; and the files parsed by the last.
fn rereads(dir: &Path, whole: bool, rounds: usize) -> Result<(Spread, usize)> {
    let mut reads = Rereads::default();
    let (first, _) = reads.read(dir, true);
    ensure!(
        first.errors.is_empty(),
        "the state directory reads with errors: {:?}",
        first.errors
    );
    let mut samples = Vec::new();
    let mut parsed = 0;
    for r in 0..rounds {
        std::fs::write(dir.join("policy.yaml"), policy_yaml(10 + (r % 100) as u8))?;
        reads.written("policy.yaml");
        let start = Instant::now();
        let (snapshot, n) = reads.read(dir, whole);
        samples.push(start.elapsed().as_secs_f64() * 1e3);
        ensure!(snapshot.view.policies.len() == 1 && snapshot.errors.is_empty());
        parsed = n;
    }
    Ok((Spread::of(&samples).context("no samples")?, parsed))
}

pub fn table(plan: &Plan) -> Table {
    let title = "The YAML source's re-read after one file changed".to_owned();
    let (nodes, pods) = (100, if plan.quick { 20_000 } else { 100_000 });
    let rounds = if plan.quick { 3 } else { 5 };
    let measured = (|| -> Result<_> {
        let dir = Scratch::new()?;
        std::fs::write(dir.0.join("cluster.yaml"), cluster_yaml(nodes, pods))?;
        std::fs::write(dir.0.join("policy.yaml"), policy_yaml(9))?;
        let bytes = std::fs::metadata(dir.0.join("cluster.yaml"))?.len();
        // Alternated, so that both see the same machine.
        let mut now = Vec::new();
        let mut before = Vec::new();
        for _ in 0..2 {
            now.push(rereads(&dir.0, false, rounds)?);
            before.push(rereads(&dir.0, true, rounds)?);
        }
        Ok((bytes, now, before))
    })();
    let header = [
        "re-read after a policy edit",
        "median ms (min-max)",
        "files parsed",
    ]
    .map(str::to_owned)
    .to_vec();
    let (bytes, now, before) = match measured {
        Ok(m) => m,
        Err(e) => {
            return Table::failed(title, header, "YAML re-read measurement", &e);
        }
    };
    let row = |what: &str, runs: &[(Spread, usize)]| {
        let all: Vec<f64> = runs.iter().map(|(s, _)| s.median).collect();
        let s = Spread::of(&all).unwrap_or(runs[0].0);
        vec![
            what.to_owned(),
            format!("**{:.1}** ({:.1}-{:.1})", s.median, s.min, s.max),
            format!("{} of 2", runs[0].1),
        ]
    };
    Table {
        title,
        intro: vec![format!(
            "A state directory of two files: `cluster.yaml` with {nodes} Nodes and {} pods \
             ({:.1} MB, written compactly) and `policy.yaml` with one policy. The policy's \
             egress IP is edited and the directory read again as the agent's watcher reads \
             it (`source::yaml::Rereads`), {rounds} times in each of two alternated runs of \
             each way, in this process (`tests/src/bench/yaml.rs`, `egress-bench --yaml`). \
             Before: every file parsed again on every change, as up to d8df172; now: only \
             the files whose stamp (inode, times, length) changed or that inotify named, \
             and the view assembled from every file's kept documents.",
            thousands(u64::from(pods)),
            bytes as f64 / 1e6,
        )],
        header,
        rows: vec![
            row("now: the changed file only", &now),
            row("before: every file", &before),
        ],
        notes: vec![
            "Assembling the view still clones every object of the kept files into a new \
             view (what a read of the whole directory produced): the cost left is that \
             copy, not the YAML parser."
                .to_owned(),
        ],
    }
}
