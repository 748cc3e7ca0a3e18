//! What the soak measures of the nodes themselves: map entry counts (from the pinned maps),
//! the agents' resident memory, and what a torn-down lab left behind.

use std::{collections::BTreeMap, path::PathBuf};

use anyhow::{Context as _, Result};
use aya::maps::{HashMap, Map, MapData};
use egress_agent::datapath::{
    dump, lock,
    sweep::{self, CtKey as _, Fate},
};
use egress_common::{
    conntrack::{CtEntryV4, CtKeyV4, state},
    maps as names,
};

use crate::{lab::Lab, netns, stream::unix_ms};

/// A conntrack entry unused this long no longer belongs to a running flow of the soak
/// (every flow sends at least every 100 ms).
const IDLE_NS: u64 = 60_000_000_000;
const TCP: u8 = 6;

/// Entries per map, summed over the nodes (an egress IP that moved counts once either way),
/// and conntrack by node and by fate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapCounts {
    pub per_map: BTreeMap<String, usize>,
    /// Conntrack entries (IPv4), by node.
    pub ct_by_node: BTreeMap<String, usize>,
    /// Conntrack entries used within the last minute.
    pub ct_recent: usize,
    /// Idle for over a minute and within their timeout (UDP: 120 s; closing TCP: 30 s):
    /// the sweeper removes them once it passes.
    pub ct_draining: usize,
    /// Idle for over a minute, kept for hours by design: established TCP entries (6 h of
    /// idle timeout) and halves of flows whose other half is one (the sweeper removes a
    /// flow only once both halves are past their timeouts). What is left of connections
    /// whose end this gateway never saw: a stream that moved to another gateway, a
    /// connection reset around the datapath.
    pub ct_lingering: usize,
    /// Past their timeout both ways (or orphans past theirs): the sweeper's to remove.
    pub ct_expired: usize,
    /// Pods with an original-direction conntrack entry, summed over the nodes: what
    /// `FLOWS_V4` (live flows per pod) must hold.
    pub ct_pods: usize,
}

impl MapCounts {
    /// Read every node's pinned maps.
    pub fn read(lab: &Lab) -> Result<Self> {
        let mut out = Self::default();
        let now = sweep::now_ns();
        for node in lab.nodes().iter().map(|n| n.name) {
            let pin = lab.bpffs_dir(node);
            let sizes =
                dump::sizes(&pin).with_context(|| format!("failed to read the maps of {node}"))?;
            for (name, n) in sizes {
                *out.per_map.entry(name.to_owned()).or_default() += n;
            }
            let ct = ct_entries(&pin)?;
            out.ct_by_node.insert(node.to_owned(), ct.len());
            let by_key: std::collections::HashMap<CtKeyV4, CtEntryV4> =
                ct.iter().copied().collect();
            let pods: std::collections::BTreeSet<[u8; 4]> = ct
                .iter()
                .filter(|(k, _)| k.dir == egress_common::conntrack::dir::ORIGINAL)
                .map(|(k, _)| k.src)
                .collect();
            out.ct_pods += pods.len();
            for (k, e) in &ct {
                let partner = by_key.get(&k.partner(e));
                let established = |e: &CtEntryV4| k.proto == TCP && e.state == state::ESTABLISHED;
                if now.saturating_sub(e.last_seen_ns) <= IDLE_NS {
                    out.ct_recent += 1;
                } else if sweep::fate(k, e, partner, now) != Fate::Keep {
                    out.ct_expired += 1;
                } else if established(e) || partner.is_some_and(established) {
                    out.ct_lingering += 1;
                } else {
                    out.ct_draining += 1;
                }
            }
        }
        Ok(out)
    }

    /// Back to the steady state of `start`: every map but conntrack, the flows per pod and
    /// the remaps heard from peers has the same count; conntrack holds no entry in use or
    /// still to be swept, only the lingering ones; and the flows per pod count exactly the
    /// pods those belong to. (Remaps are a cache for a takeover, kept 5 minutes after they
    /// were last heard: `egress_agent::liveness::remaps::KEEP`.)
    pub fn back_to(&self, start: &MapCounts) -> bool {
        // Conntrack, and the live flows per pod that follow it, hold what is lingering
        // now, not what the start had in use.
        let same = |m: &MapCounts| -> BTreeMap<String, usize> {
            m.per_map
                .iter()
                .filter(|(k, _)| {
                    !k.starts_with("CT_")
                        && !k.starts_with("REMAP_")
                        && k.as_str() != names::FLOWS_V4
                })
                .map(|(k, v)| (k.clone(), *v))
                .collect()
        };
        let flows = self.per_map.get(names::FLOWS_V4).copied().unwrap_or(0);
        same(self) == same(start)
            && self.ct_recent + self.ct_draining + self.ct_expired == 0
            && flows == self.ct_pods
    }
}

pub(super) fn ct_entries(pin: &std::path::Path) -> Result<Vec<(CtKeyV4, CtEntryV4)>> {
    let path = pin.join(names::CT_V4);
    let data =
        MapData::from_pin(&path).with_context(|| format!("failed to open {}", path.display()))?;
    let map: HashMap<MapData, CtKeyV4, CtEntryV4> = HashMap::try_from(Map::HashMap(data))
        .with_context(|| format!("{} is not a hash map of conntrack entries", path.display()))?;
    Ok(map.iter().filter_map(Result::ok).collect())
}

/// One sample of an agent's resident memory.
#[derive(Clone, Copy, Debug)]
pub struct RssSample {
    pub at_ms: u64,
    pub pid: u32,
    pub kib: u64,
}

/// Samples of every node's agent.
#[derive(Clone, Debug, Default)]
pub struct Rss {
    pub samples: BTreeMap<String, Vec<RssSample>>,
}

impl Rss {
    pub fn sample(&mut self, lab: &Lab) {
        let at_ms = unix_ms();
        for node in lab.nodes().iter().map(|n| n.name) {
            let Some(pid) = lab.agent_pid(node) else {
                continue;
            };
            if let Some(kib) = vm_rss_kib(pid) {
                self.samples
                    .entry(node.to_owned())
                    .or_default()
                    .push(RssSample { at_ms, pid, kib });
            }
        }
    }

    /// Per node, from the first sample at or after `warm_ms`: (first, last, max, whether
    /// the agent was restarted in between).
    pub fn summary(&self, warm_ms: u64) -> BTreeMap<String, RssSummary> {
        let mut out = BTreeMap::new();
        for (node, s) in &self.samples {
            let after: Vec<&RssSample> = s.iter().filter(|x| x.at_ms >= warm_ms).collect();
            let (Some(first), Some(last)) = (after.first(), after.last()) else {
                continue;
            };
            out.insert(
                node.clone(),
                RssSummary {
                    first_kib: first.kib,
                    last_kib: last.kib,
                    max_kib: after.iter().map(|x| x.kib).max().unwrap_or(0),
                    samples: after.len(),
                    restarted: after.iter().any(|x| x.pid != first.pid),
                },
            );
        }
        out
    }
}

#[derive(Clone, Copy, Debug)]
pub struct RssSummary {
    pub first_kib: u64,
    pub last_kib: u64,
    pub max_kib: u64,
    pub samples: usize,
    /// The agent was restarted after the first sample: its growth says nothing.
    pub restarted: bool,
}

impl RssSummary {
    /// Growth from the first sample to the last, in percent.
    pub fn growth_pct(&self) -> f64 {
        (self.last_kib as f64 - self.first_kib as f64) * 100.0 / self.first_kib.max(1) as f64
    }
}

/// `VmRSS` of `/proc/<pid>/status`, in KiB.
fn vm_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// What a lab leaves that its teardown must remove: its namespaces, its pin directories
/// and the agents' lock files of those directories.
#[derive(Clone, Debug)]
pub struct Remains {
    prefix: String,
    locks: Vec<PathBuf>,
}

impl Remains {
    /// Note the paths while the lab is up.
    pub fn of(lab: &Lab) -> Self {
        Self {
            prefix: lab.prefix().to_owned(),
            locks: lab
                .nodes()
                .iter()
                .map(|n| {
                    lock::lock_path(std::path::Path::new(lock::LOCK_DIR), &lab.bpffs_dir(n.name))
                })
                .collect(),
        }
    }

    /// What is still there.
    pub fn left(&self) -> Vec<String> {
        let mut out: Vec<String> = netns::netns_with_prefix(&self.prefix)
            .unwrap_or_default()
            .into_iter()
            .map(|n| format!("namespace {n}"))
            .collect();
        let head = format!("{}-", self.prefix);
        if let Ok(dir) = std::fs::read_dir("/sys/fs/bpf") {
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with(&head) {
                    out.push(format!("pin directory /sys/fs/bpf/{name}"));
                }
            }
        }
        for l in &self.locks {
            if l.exists() {
                out.push(format!("lock file {}", l.display()));
            }
        }
        out
    }
}
