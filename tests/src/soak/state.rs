//! What the soak measures of the nodes themselves: map entry counts (from the pinned maps),
//! the agents' resident memory, and what a torn-down lab left behind.

use std::{collections::BTreeMap, path::PathBuf};

use anyhow::{Context as _, Result};
use aya::maps::{HashMap, Map, MapData};
use egress_agent::datapath::{dump, lock};
use egress_common::{
    conntrack::{CtEntryV4, CtKeyV4, idle_timeout, state},
    maps as names,
};

use crate::{lab::Lab, netns, stream::unix_ms};

/// Conntrack entries of established TCP flows idle this long are the remains of streams
/// that moved to another gateway (or closed through another one): their idle timeout is
/// hours, by design, so they are reported, not waited for.
const STALE_ESTABLISHED_NS: u64 = 60_000_000_000;

/// Entries per map, summed over the nodes (an egress IP that moved counts once either way),
/// and conntrack by node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapCounts {
    pub per_map: BTreeMap<String, usize>,
    /// Conntrack entries (IPv4), by node.
    pub ct_by_node: BTreeMap<String, usize>,
    /// Of those, established TCP entries idle for over a minute (see
    /// [`STALE_ESTABLISHED_NS`]); none is past its idle timeout (the sweeper's job).
    pub ct_stale_established: usize,
    /// Entries past their idle timeout that the sweeper has not removed yet.
    pub ct_expired: usize,
}

impl MapCounts {
    /// Read every node's pinned maps.
    pub fn read(lab: &Lab) -> Result<Self> {
        let mut out = Self::default();
        let now = monotonic_ns();
        for node in lab.nodes().iter().map(|n| n.name) {
            let pin = lab.bpffs_dir(node);
            let sizes =
                dump::sizes(&pin).with_context(|| format!("failed to read the maps of {node}"))?;
            for (name, n) in sizes {
                *out.per_map.entry(name.to_owned()).or_default() += n;
            }
            let ct = ct_entries(&pin)?;
            out.ct_by_node.insert(node.to_owned(), ct.len());
            for (k, e) in ct {
                let idle = now.saturating_sub(e.last_seen_ns);
                if idle > idle_timeout(k.proto, e.state) {
                    out.ct_expired += 1;
                } else if k.proto == 6
                    && e.state == state::ESTABLISHED
                    && idle > STALE_ESTABLISHED_NS
                {
                    out.ct_stale_established += 1;
                }
            }
        }
        Ok(out)
    }

    /// Conntrack entries of flows that may still be live: all but the stale established.
    pub fn ct_live(&self) -> usize {
        self.per_map
            .get(names::CT_V4)
            .copied()
            .unwrap_or(0)
            .saturating_sub(self.ct_stale_established)
    }

    /// Back to `start`: every map but conntrack has the same count; live conntrack entries
    /// are no more than at the start, and none is past its timeout.
    pub fn back_to(&self, start: &MapCounts) -> bool {
        let same = |m: &MapCounts| -> BTreeMap<String, usize> {
            m.per_map
                .iter()
                .filter(|(k, _)| !k.starts_with("CT_"))
                .map(|(k, v)| (k.clone(), *v))
                .collect()
        };
        same(self) == same(start) && self.ct_live() <= start.ct_live() && self.ct_expired == 0
    }
}

fn ct_entries(pin: &std::path::Path) -> Result<Vec<(CtKeyV4, CtEntryV4)>> {
    let path = pin.join(names::CT_V4);
    let data =
        MapData::from_pin(&path).with_context(|| format!("failed to open {}", path.display()))?;
    let map: HashMap<MapData, CtKeyV4, CtEntryV4> = HashMap::try_from(Map::HashMap(data))
        .with_context(|| format!("{} is not a hash map of conntrack entries", path.display()))?;
    Ok(map.iter().filter_map(Result::ok).collect())
}

/// `CLOCK_MONOTONIC`, the clock of `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
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
