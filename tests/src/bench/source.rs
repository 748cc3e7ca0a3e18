//! The Kubernetes source's own work for one pod event at cluster scale (issue 49), side by
//! side in one run: before, what it did until 12e6bd1 for each snapshot (its reflector
//! store copied, sorted by namespace and name, every Pod checked and summarized, the new
//! pods compared with the last and the last dropped); now, its [`PodIndex`] (the event's
//! pod summarized into a sorted table, the view's pods copied as pointers, compared and
//! the last dropped). Without the API server: the Pods are made here, as a Deployment's
//! pods read once decoded (two labels, a node, one address, running).

use std::{collections::BTreeMap, net::IpAddr, sync::Arc, time::Instant};

use anyhow::{Result, ensure};
use egress_agent::source::{PodSummary, kube::PodIndex, objects};
use k8s_openapi::{
    api::core::v1::{Pod, PodIP, PodSpec, PodStatus},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::runtime::{reflector, watcher};

use super::{Spread, report::Table, scale::SHAPE};

/// Rounds of each way, alternated.
const ROUNDS: usize = 5;

/// The `i`th pod, its `version`th state (the version changes a label the agent reads).
fn pod(i: u32, version: u32) -> Pod {
    let ip = format!("10.{}.{}.{}", 64 + (i >> 16), (i >> 8) & 255, i & 255);
    Pod {
        metadata: ObjectMeta {
            namespace: Some(format!("ns-{:03}", i % 100)),
            name: Some(format!("pod-{i:06}")),
            uid: Some(format!("uid-{i}")),
            labels: Some(BTreeMap::from([
                ("app".to_owned(), format!("app-{}", i % 50)),
                ("version".to_owned(), version.to_string()),
            ])),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(format!("node-{:03}", i % 100)),
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".to_owned()),
            pod_ip: Some(ip.clone()),
            pod_ips: Some(vec![PodIP { ip }]),
            ..Default::default()
        }),
    }
}

/// Milliseconds of each way's work for one pod event, each round.
pub struct SourceRun {
    pub pods: u32,
    pub before_ms: Vec<f64>,
    pub now_ms: Vec<f64>,
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Both ways at [`SHAPE`]'s pods, one pod changed per round.
pub fn run() -> Result<SourceRun> {
    let pods = SHAPE.pods;
    let (store, mut writer) = reflector::store::<Pod>();
    let index = PodIndex::new();
    writer.apply_watcher_event(&watcher::Event::Init);
    index.apply(watcher::Event::Init);
    for i in 0..pods {
        writer.apply_watcher_event(&watcher::Event::InitApply(pod(i, 0)));
        index.apply(watcher::Event::InitApply(pod(i, 0)));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    index.apply(watcher::Event::InitDone);
    let mut last_before = before(&store);
    let mut last_now = index.view(&mut Vec::new());
    ensure!(
        last_before.len() == pods as usize && last_now.len() == pods as usize,
        "{} and {} pods served of {pods}",
        last_before.len(),
        last_now.len()
    );
    let (mut before_ms, mut now_ms) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS as u32 {
        let changed = pod((round * 7919) % pods, round + 1);
        writer.apply_watcher_event(&watcher::Event::Apply(changed.clone()));
        let t = Instant::now();
        let view = before(&store);
        let differs = view != last_before;
        drop(std::mem::replace(&mut last_before, view));
        before_ms.push(ms_since(t));
        let t = Instant::now();
        index.apply(watcher::Event::Apply(changed));
        let view = index.view(&mut Vec::new());
        let differs_now = view != last_now;
        drop(std::mem::replace(&mut last_now, view));
        now_ms.push(ms_since(t));
        ensure!(
            differs && differs_now,
            "round {round}: the change was not seen"
        );
        ensure!(
            last_before.iter().zip(&last_now).all(|(b, n)| b == &**n),
            "round {round}: the two ways serve different pods"
        );
    }
    Ok(SourceRun {
        pods,
        before_ms,
        now_ms,
    })
}

/// The pods of a snapshot as the source made them before 12e6bd1 (`collect_checked` of
/// the reflector store, without the decode wrapper).
fn before(store: &reflector::Store<Pod>) -> Vec<PodSummary> {
    let mut entries = store.state();
    entries.sort_by(|a, b| {
        (&a.metadata.namespace, &a.metadata.name).cmp(&(&b.metadata.namespace, &b.metadata.name))
    });
    entries
        .iter()
        .filter(|p| objects::check_pod(p).is_empty())
        .map(|p| PodSummary::from(&**p))
        .collect()
}

/// A pod as the source summarized it from 12e6bd1 until 408ef87: each its own copy of its
/// namespace, node and labels (kept here to measure against).
#[derive(Debug)]
struct Unshared {
    namespace: String,
    name: String,
    labels: BTreeMap<String, String>,
    node_name: Option<String>,
    ips: Vec<IpAddr>,
}

impl From<&Pod> for Unshared {
    fn from(pod: &Pod) -> Self {
        let now = PodSummary::from(pod);
        Self {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            node_name: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            ips: now.ips,
        }
    }
}

/// Bytes held for [`SHAPE`]'s pods, each way (`None`: the allocator does not count).
pub struct Held {
    pub pods: u32,
    /// Whole Pods, as kube-rs's reflector store kept them until 12e6bd1.
    pub full: Option<i64>,
    /// Summaries, each with its own strings and labels (12e6bd1 until 408ef87).
    pub unshared: Option<i64>,
    /// Summaries as the sources make them now (names and labels shared).
    pub shared: Option<i64>,
}

/// What a gateway (or the status writer) holds for every pod of the cluster, each way,
/// measured by the bytes each way's list keeps allocated (this thread's, counted by
/// [`egress_tests::alloc::Counting`](crate::alloc::Counting)).
pub fn held() -> Result<Held> {
    let pods: Vec<Pod> = (0..SHAPE.pods).map(|i| pod(i, 0)).collect();
    let (full, full_bytes) =
        crate::alloc::retained(|| pods.iter().cloned().map(Arc::new).collect::<Vec<_>>());
    let (unshared, unshared_bytes) = crate::alloc::retained(|| {
        pods.iter()
            .map(|p| Arc::new(Unshared::from(p)))
            .collect::<Vec<_>>()
    });
    let (shared, shared_bytes) = crate::alloc::retained(|| {
        pods.iter()
            .map(|p| Arc::new(PodSummary::from(p)))
            .collect::<Vec<_>>()
    });
    ensure!(
        full.len() == shared.len()
            && unshared.iter().zip(&shared).all(|(u, s)| {
                *u.namespace == *s.namespace
                    && u.name == s.name
                    && u.labels == *s.labels
                    && u.node_name.as_deref() == s.node_name.as_deref()
                    && u.ips == s.ips
            }),
        "the two summaries differ"
    );
    Ok(Held {
        pods: SHAPE.pods,
        full: full_bytes,
        unshared: unshared_bytes,
        shared: shared_bytes,
    })
}

/// [`held`] as a table.
pub fn held_table(held: &Result<Held>) -> Table {
    let title = "What a gateway holds per pod".to_owned();
    let header = ["way", "bytes per pod", "at the cluster's pods"]
        .map(str::to_owned)
        .to_vec();
    let h = match held {
        Ok(h) => h,
        Err(e) => {
            return Table::failed(title, header, "memory section", e);
        }
    };
    let pods = f64::from(h.pods);
    let cells = |bytes: Option<i64>| match bytes {
        None => vec![super::report::NOT_MEASURED.to_owned(); 2],
        Some(b) => vec![
            format!("**{:.0}**", b as f64 / pods),
            format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0)),
        ],
    };
    let row = |way: &str, bytes| [vec![way.to_owned()], cells(bytes)].concat();
    Table {
        title,
        intro: vec![format!(
            "The list of {} pods a gateway and the status writer keep (they watch every \
             pod), in this process (`tests/src/bench/source.rs`, `egress-bench --churn`): \
             the bytes each way's list keeps allocated, for the pods of the section above \
             (100 namespaces, 100 nodes, 50 label sets; no containers, so a real Pod is \
             larger than these).",
            super::report::thousands(u64::from(h.pods))
        )],
        header,
        rows: vec![
            row(
                "whole Pods, as kube-rs's reflector kept them (until 12e6bd1)",
                h.full,
            ),
            row(
                "summaries with their own names and labels (12e6bd1 until 408ef87)",
                h.unshared,
            ),
            row(
                "summaries sharing namespaces, nodes and label sets (`source::intern`)",
                h.shared,
            ),
        ],
        notes: vec![],
    }
}

/// The two ways side by side.
pub fn table(run: &Result<SourceRun>) -> Table {
    let title = "The Kubernetes source's snapshot per pod event".to_owned();
    let header = ["way", "ms per event", "notes"].map(str::to_owned).to_vec();
    let r = match run {
        Ok(r) => r,
        Err(e) => {
            return Table::failed(title, header, "source section", e);
        }
    };
    let cell = |v: &[f64]| match Spread::of(v) {
        None => "-".to_owned(),
        Some(s) => format!("**{:.1}** ({:.1}-{:.1})", s.median, s.min, s.max),
    };
    let pods = super::report::thousands(u64::from(r.pods));
    Table {
        title,
        intro: vec![format!(
            "One pod changed among {pods} (a label the agent reads), in this process \
             (`tests/src/bench/source.rs`, `egress-bench --churn`): the source's work \
             between the event and the view it publishes, {ROUNDS} rounds of each way, \
             alternated. A gateway and the status writer watch every pod."
        )],
        header,
        rows: vec![
            vec![
                "before (until 12e6bd1): the store copied, sorted, every Pod checked and \
                 summarized, compared, the last dropped"
                    .to_owned(),
                cell(&r.before_ms),
                "the work grows with the pods".to_owned(),
            ],
            vec![
                "now: `PodIndex` (the event's pod summarized into a sorted table; the \
                 view's pods copied as pointers, compared, the last dropped)"
                    .to_owned(),
                cell(&r.now_ms),
                "pointers only for the pods that did not change".to_owned(),
            ],
        ],
        notes: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ways_serve_the_same_pods_in_the_same_order() {
        let (store, mut writer) = reflector::store::<Pod>();
        let index = PodIndex::new();
        writer.apply_watcher_event(&watcher::Event::Init);
        index.apply(watcher::Event::Init);
        for i in [5, 1, 300, 2] {
            writer.apply_watcher_event(&watcher::Event::InitApply(pod(i, 0)));
            index.apply(watcher::Event::InitApply(pod(i, 0)));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        index.apply(watcher::Event::InitDone);
        let now: Vec<PodSummary> = index
            .view(&mut Vec::new())
            .iter()
            .map(|p| PodSummary::clone(p))
            .collect();
        assert_eq!(before(&store), now);
        assert_eq!(now.len(), 4);
    }
}
