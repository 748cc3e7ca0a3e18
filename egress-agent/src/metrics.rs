//! Prometheus metrics (`/metrics`) and health endpoints (`/healthz`, `/readyz`).
//!
//! What the pinned maps say (counters, entries per map, conntrack included) is read on a
//! blocking thread, never on the runtime that runs the reconcile loop, and at most once
//! per [`MAP_STATS_INTERVAL`]: concurrent scrapes share one read ([`Cached`]). A scrape
//! walking a large conntrack table then costs one thread for a moment, whatever the
//! number of scrapers.

use std::{
    fmt::Write as _,
    sync::Arc,
    time::{Duration, Instant},
};

use std::{collections::BTreeMap, sync::atomic::AtomicU64};

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::{datapath::dump, liveness::PeerStatus};

/// What the reconcile loop reports.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub ready: bool,
    pub reconciles: u64,
    pub errors: u64,
    pub problems: usize,
    pub source_errors: usize,
    pub last_reconcile: Duration,
    /// Every egress address in use, cluster-wide, as this node computes it.
    pub holders: Vec<HolderStat>,
    pub liveness: LivenessStats,
    /// Interface -> routes out of it listed in this node's EgressNode.
    pub routes_published: BTreeMap<String, usize>,
    /// The address each of this node's selected pods leaves with, per rule.
    pub pod_routes: Vec<PodRouteStat>,
}

/// One of this node's pods and how it leaves under one rule.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodRouteStat {
    /// `namespace/name`.
    pub pod: String,
    pub pod_ip: String,
    /// `policy rules[i]`.
    pub rule: String,
    /// The egress address (`-`: none).
    pub egress_ip: String,
    /// The gateway (`-`: none, the failure policy applies).
    pub gateway: String,
}

/// One egress address and where it lives.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HolderStat {
    pub ip: String,
    pub node: String,
    pub interface: String,
    /// Why it is there (`compiler::move_reason`).
    pub reason: String,
    pub policy: String,
    /// The policy's selected pods that leave by it, cluster-wide.
    pub pods: u32,
    /// Those of them on this node.
    pub local_pods: u32,
}

/// An egress IP this node holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeldStat {
    pub ip: String,
    pub interface: String,
    pub epoch: u64,
    pub since: String,
    pub reason: String,
}

/// What the probes and the holder election did on this node.
#[derive(Clone, Debug, Default)]
pub struct LivenessStats {
    pub peers: Vec<PeerStatus>,
    /// This node hears too few peers and holds nothing.
    pub cut_off: bool,
    /// Hellos refused, by reason (see `liveness::service::Handle::refused`).
    pub refused: BTreeMap<String, u64>,
    /// Hellos are signed and only signed ones taken (`--liveness-key-file`).
    pub authenticated: bool,
    /// Peers declared dead so far, and the silence before the last one.
    pub detections: u64,
    pub last_detection: Option<Duration>,
    /// Egress IPs this node took, by reason.
    pub acquired: BTreeMap<String, u64>,
    pub held: Vec<HeldStat>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
    drop: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabels {
    map: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InterfaceLabels {
    interface: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabels {
    peer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MoveLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HolderLabels {
    ip: String,
    node: String,
    interface: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AddressLabels {
    ip: String,
    node: String,
    policy: String,
}

/// How often scrapes read the maps at most.
pub const MAP_STATS_INTERVAL: Duration = Duration::from_secs(2);

/// What the pinned maps say, for metrics (a read that failed leaves its part out).
#[derive(Clone, Debug, Default)]
pub struct MapStats {
    pub counters: Vec<(u32, egress_common::counters::Counter)>,
    pub sizes: Vec<(&'static str, usize)>,
}

impl MapStats {
    /// Read the counters and walk every map (blocking: conntrack may hold 100k+ entries).
    pub fn read(pin_dir: &std::path::Path) -> Self {
        Self {
            counters: dump::counters(pin_dir).unwrap_or_default(),
            sizes: dump::sizes(pin_dir).unwrap_or_default(),
        }
    }
}

/// A value computed on a blocking thread at most once per `interval`; callers that come
/// while it is being computed wait for that computation and share it.
pub struct Cached<T> {
    interval: Duration,
    last: tokio::sync::Mutex<Option<(Instant, Arc<T>)>>,
}

impl<T: Send + Sync + 'static> Cached<T> {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: tokio::sync::Mutex::new(None),
        }
    }

    /// The value, computed by `compute` (on the blocking pool) unless the last one is
    /// younger than the interval. A computation that panics leaves the cache empty.
    pub async fn get(&self, compute: impl FnOnce() -> T + Send + 'static) -> Option<Arc<T>> {
        let mut last = self.last.lock().await;
        if let Some((at, v)) = last.as_ref()
            && at.elapsed() < self.interval
        {
            return Some(v.clone());
        }
        let v = Arc::new(tokio::task::spawn_blocking(compute).await.ok()?);
        *last = Some((Instant::now(), v.clone()));
        Some(v)
    }
}

/// The metrics text for one scrape.
pub fn render(maps: &MapStats, stats: &Stats) -> String {
    let mut reg = Registry::with_prefix("egress");
    register_datapath(&mut reg, maps);
    register_holders(&mut reg, stats);
    register_passes(&mut reg, stats);
    register_routes(&mut reg, stats);
    register_liveness(&mut reg, &stats.liveness);
    let mut out = String::new();
    if encode(&mut out, &reg).is_err() {
        let _ = writeln!(out, "# failed to encode metrics");
    }
    out
}

/// A gauge of `v` (saturated at `i64::MAX`).
fn gauge(v: u64) -> Gauge {
    let g = Gauge::<i64>::default();
    g.set(i64::try_from(v).unwrap_or(i64::MAX));
    g
}

/// Packets and bytes by datapath reason, entries by map.
fn register_datapath(reg: &mut Registry, maps: &MapStats) {
    let packets = Family::<ReasonLabels, Counter>::default();
    let bytes = Family::<ReasonLabels, Counter>::default();
    for &(reason, c) in &maps.counters {
        let name = egress_common::counters::name(reason).unwrap_or("unknown");
        let l = ReasonLabels {
            reason: name.to_ascii_lowercase(),
            drop: egress_common::counters::is_drop(reason).to_string(),
        };
        packets.get_or_create(&l).inc_by(c.packets);
        bytes.get_or_create(&l).inc_by(c.bytes);
    }
    reg.register("datapath_packets", "Packets by datapath reason", packets);
    reg.register("datapath_bytes", "Bytes by datapath reason", bytes);
    let entries = Family::<MapLabels, Gauge>::default();
    for &(map, n) in &maps.sizes {
        entries
            .get_or_create(&MapLabels { map: map.into() })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    reg.register("map_entries", "Entries per BPF map", entries);
}

/// Which node and interface hold each egress IP.
fn register_holders(reg: &mut Registry, stats: &Stats) {
    let holders = Family::<HolderLabels, Gauge>::default();
    for h in &stats.holders {
        holders
            .get_or_create(&HolderLabels {
                ip: h.ip.clone(),
                node: h.node.clone(),
                interface: h.interface.clone(),
            })
            .set(1);
    }
    reg.register(
        "egress_ip_holder",
        "Which node and interface hold each egress IP",
        holders,
    );
    let pods = Family::<AddressLabels, Gauge>::default();
    let local = Family::<AddressLabels, Gauge>::default();
    for h in &stats.holders {
        let labels = AddressLabels {
            ip: h.ip.clone(),
            node: h.node.clone(),
            policy: h.policy.clone(),
        };
        pods.get_or_create(&labels).inc_by(i64::from(h.pods));
        local.get_or_create(&labels).inc_by(i64::from(h.local_pods));
    }
    reg.register(
        "ip_pods",
        "Selected pods (cluster-wide) that leave by each egress address and gateway, per policy",
        pods,
    );
    reg.register(
        "ip_local_pods",
        "This node's selected pods that leave by each egress address and gateway, per policy",
        local,
    );
}

/// The reconcile passes: how many, failed, their problems and the last one's duration.
fn register_passes(reg: &mut Registry, stats: &Stats) {
    let last_us = u64::try_from(stats.last_reconcile.as_micros()).unwrap_or(u64::MAX);
    for (name, help, v) in [
        ("reconciles", "Reconcile passes", stats.reconciles),
        ("reconcile_errors", "Failed reconcile passes", stats.errors),
        (
            "problems",
            "Problems in the last pass (see log)",
            stats.problems as u64,
        ),
        (
            "state_errors",
            "Objects the state source could not parse",
            stats.source_errors as u64,
        ),
        (
            "last_reconcile_microseconds",
            "Duration of the last reconcile",
            last_us,
        ),
    ] {
        reg.register(name, help, gauge(v));
    }
}

/// Routes published per interface in this node's EgressNode.
fn register_routes(reg: &mut Registry, stats: &Stats) {
    let routes = Family::<InterfaceLabels, Gauge>::default();
    for (interface, n) in &stats.routes_published {
        routes
            .get_or_create(&InterfaceLabels {
                interface: interface.clone(),
            })
            .set(i64::try_from(*n).unwrap_or(i64::MAX));
    }
    reg.register(
        "routes_published",
        "Routes out of each interface listed in this node's EgressNode",
        routes,
    );
}

fn register_liveness(reg: &mut Registry, l: &LivenessStats) {
    let alive = Family::<PeerLabels, Gauge>::default();
    let rtt = Family::<PeerLabels, Gauge<f64, AtomicU64>>::default();
    for p in &l.peers {
        let labels = PeerLabels {
            peer: p.name.clone(),
        };
        alive.get_or_create(&labels).set(i64::from(p.alive));
        if let Some(r) = p.rtt {
            rtt.get_or_create(&labels).set(r.as_secs_f64());
        }
    }
    reg.register(
        "peer_alive",
        "1 if the peer is heard (directly or through others), else 0",
        alive,
    );
    reg.register(
        "probe_rtt_seconds",
        "Round trip of the last probe answered by each peer",
        rtt,
    );
    let g = Gauge::<i64>::default();
    g.set(l.peers.iter().filter(|p| p.alive).count() as i64);
    reg.register("peers_alive", "Peers heard", g);
    let g = Gauge::<i64>::default();
    g.set(i64::from(l.cut_off));
    reg.register(
        "cut_off",
        "1 if this node hears fewer than a majority of its peers (it holds nothing)",
        g,
    );
    let refused = Family::<MoveLabels, Counter>::default();
    for (reason, n) in &l.refused {
        refused
            .get_or_create(&MoveLabels {
                reason: reason.clone(),
            })
            .inc_by(*n);
    }
    reg.register(
        "probes_refused",
        "Hellos refused, by reason (malformed, unauthenticated, stale, replayed, unknown_node, \
         wrong_address, from_myself)",
        refused,
    );
    let g = Gauge::<i64>::default();
    g.set(i64::from(l.authenticated));
    reg.register(
        "liveness_authenticated",
        "1 if hellos are signed and only signed ones taken (--liveness-key-file), else 0",
        g,
    );
    let c = Counter::<u64>::default();
    c.inc_by(l.detections);
    reg.register("peer_deaths", "Peers declared unreachable", c);
    let g = Gauge::<f64, AtomicU64>::default();
    g.set(l.last_detection.map_or(0.0, |d| d.as_secs_f64()));
    reg.register(
        "detection_seconds",
        "Silence before the last peer was declared unreachable",
        g,
    );
    let moves = Family::<MoveLabels, Counter>::default();
    for (reason, n) in &l.acquired {
        moves
            .get_or_create(&MoveLabels {
                reason: reason.clone(),
            })
            .inc_by(*n);
    }
    reg.register(
        "failovers",
        "Egress IPs this node took, by reason (Assigned: first holder)",
        moves,
    );
}

/// `egress-agent status`: holders, peers and why, in human terms.
pub fn status_text(stats: &Stats) -> String {
    let mut out = String::new();
    let l = &stats.liveness;
    let _ = writeln!(
        out,
        "this node: {}",
        if l.cut_off {
            "CUT OFF (hears fewer than a majority of its peers; holds nothing)"
        } else {
            "connected"
        }
    );
    let _ = writeln!(out, "\nheld here:");
    if l.held.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for h in &l.held {
        let _ = writeln!(
            out,
            "  {:<40} {:<10} epoch {:<4} since {}  {}",
            h.ip, h.interface, h.epoch, h.since, h.reason
        );
    }
    let _ = writeln!(out, "\npeers:");
    for p in &l.peers {
        let _ = writeln!(
            out,
            "  {:<20} {:<6} {:<9} last heard {:>8}  rtt {:>8}",
            p.name,
            if p.alive { "alive" } else { "DEAD" },
            if p.direct { "direct" } else { "indirect" },
            p.last_heard
                .map_or("never".to_owned(), |d| format!("{} ms", d.as_millis())),
            p.rtt
                .map_or("-".to_owned(), |d| format!("{} us", d.as_micros())),
        );
    }
    let _ = writeln!(out, "\nholders (cluster-wide, as this node computes them):");
    for h in &stats.holders {
        let _ = writeln!(
            out,
            "  {:<40} {:<20} {:<10} {:<20} {} pods ({} here)",
            h.ip, h.node, h.interface, h.reason, h.pods, h.local_pods
        );
    }
    let _ = writeln!(out, "\npods here and the address each leaves with:");
    if stats.pod_routes.is_empty() {
        let _ = writeln!(out, "  (none selected)");
    }
    for r in &stats.pod_routes {
        let _ = writeln!(
            out,
            "  {:<40} {:<40} {:<24} {:<40} via {}",
            r.pod, r.pod_ip, r.rule, r.egress_ip, r.gateway
        );
    }
    if let Some(d) = l.last_detection {
        let _ = writeln!(
            out,
            "\npeers declared unreachable: {} (last after {} ms of silence)",
            l.detections,
            d.as_millis()
        );
    }
    out
}

/// OpenMetrics text (what [`render`] writes) as the Prometheus text format 0.0.4, for a
/// client that does not accept OpenMetrics: a counter family's `# HELP` and `# TYPE` name
/// its samples (`<name>_total`), and the `# UNIT` and `# EOF` lines go.
pub fn text_004(openmetrics: &str) -> String {
    let counters: std::collections::BTreeSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let sep = if tail.is_empty() { "" } else { " " };
                if counters.contains(name) {
                    let _ = writeln!(out, "{prefix}{name}_total{sep}{tail}");
                } else {
                    let _ = writeln!(out, "{line}");
                }
            }
            None => {
                let _ = writeln!(out, "{line}");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::{path::Path, sync::atomic::AtomicUsize};

    use super::*;

    /// Sixteen scrapes at once, as in the issue: one read of the maps, on a blocking
    /// thread, shared by all; a scrape after the interval reads again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_scrapes_share_one_map_read() {
        let cache = Arc::new(Cached::<usize>::new(Duration::from_millis(300)));
        let reads = Arc::new(AtomicUsize::new(0));
        let read = |reads: Arc<AtomicUsize>| {
            move || {
                // A slow walk (a large conntrack table), off the runtime.
                std::thread::sleep(Duration::from_millis(100));
                reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1
            }
        };
        let scrapes: Vec<_> = (0..16)
            .map(|_| {
                let (cache, reads) = (cache.clone(), reads.clone());
                tokio::spawn(async move { *cache.get(read(reads)).await.unwrap() })
            })
            .collect();
        for s in scrapes {
            assert_eq!(s.await.unwrap(), 1);
        }
        assert_eq!(reads.load(std::sync::atomic::Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert_eq!(*cache.get(read(reads.clone())).await.unwrap(), 2);
    }

    #[test]
    fn text_004_names_counter_families_by_their_samples_and_drops_eof() {
        let stats = Stats {
            reconciles: 3,
            ..Stats::default()
        };
        let maps = MapStats {
            counters: vec![(5, egress_common::counters::Counter::default())],
            sizes: vec![("CT_V4", 7)],
        };
        let om = render(&maps, &stats);
        assert!(om.trim_end().ends_with("# EOF"), "{om}");
        let text = text_004(&om);
        assert!(
            !text.contains("# EOF") && !text.contains("# UNIT "),
            "{text}"
        );
        // Every family's TYPE line names samples that follow it.
        for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let (name, kind) = line.split_once(' ').expect("name and type");
            assert!(
                text.lines()
                    .any(|l| !l.starts_with('#') && l.starts_with(name)),
                "{name} ({kind}) has no sample: {text}"
            );
            if kind == "counter" {
                assert!(name.ends_with("_total"), "{line}");
            }
        }
    }

    #[test]
    fn status_and_metrics_show_each_pods_address() {
        let stats = Stats {
            holders: vec![HolderStat {
                ip: "192.168.101.57".to_owned(),
                node: "gw-2".to_owned(),
                interface: "sec-a".to_owned(),
                reason: "Assigned".to_owned(),
                policy: "payments".to_owned(),
                pods: 7,
                local_pods: 2,
            }],
            pod_routes: vec![PodRouteStat {
                pod: "shop/api-1".to_owned(),
                pod_ip: "10.244.1.11".to_owned(),
                rule: "payments rules[0]".to_owned(),
                egress_ip: "192.168.101.57".to_owned(),
                gateway: "gw-2".to_owned(),
            }],
            ..Stats::default()
        };
        let text = status_text(&stats);
        assert!(text.contains("7 pods (2 here)"), "{text}");
        let line = text
            .lines()
            .find(|l| l.contains("shop/api-1"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(
            line.contains("192.168.101.57") && line.ends_with("via gw-2"),
            "{line}"
        );
        let m = render(&MapStats::default(), &stats);
        assert!(
            m.contains(
                "egress_ip_local_pods{ip=\"192.168.101.57\",node=\"gw-2\",policy=\"payments\"} 2"
            ),
            "{m}"
        );
    }

    #[test]
    fn routes_published_per_interface() {
        let stats = Stats {
            routes_published: BTreeMap::from([("eth1".to_owned(), 3), ("eth2".to_owned(), 0)]),
            ..Stats::default()
        };
        let text = render(
            &MapStats::read(Path::new("/nonexistent/egress-metrics")),
            &stats,
        );
        assert!(
            text.contains("egress_routes_published{interface=\"eth1\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("egress_routes_published{interface=\"eth2\"} 0"),
            "{text}"
        );
    }

    /// docs/operations.md documents every metric this build serves and every datapath
    /// counter reason: a new one without a line there fails here.
    #[test]
    fn every_metric_and_counter_reason_is_in_the_operations_guide() {
        let guide = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/operations.md"
        ))
        .unwrap();
        // One sample of every family, so that each is rendered.
        let stats = Stats {
            routes_published: BTreeMap::from([("eth1".to_owned(), 3)]),
            holders: vec![HolderStat::default()],
            liveness: LivenessStats {
                peers: vec![crate::liveness::PeerStatus {
                    name: "gw-1".to_owned(),
                    alive: true,
                    direct: true,
                    last_heard: None,
                    rtt: Some(Duration::from_millis(1)),
                }],
                last_detection: Some(Duration::from_millis(300)),
                acquired: BTreeMap::from([("Assigned".to_owned(), 1)]),
                ..LivenessStats::default()
            },
            ..Stats::default()
        };
        let maps = MapStats {
            counters: vec![(1, egress_common::counters::Counter::default())],
            sizes: vec![("CT_V4", 0)],
        };
        let text = render(&maps, &stats);
        let names: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        assert!(names.len() > 15, "{text}");
        let missing: Vec<&&str> = names
            .iter()
            .filter(|n| !guide.contains(&format!("`{n}`")))
            .collect();
        assert!(
            missing.is_empty(),
            "metrics not in docs/operations.md: {missing:?}"
        );
        let reasons: Vec<&str> = egress_common::counters::ALL
            .iter()
            .map(|(_, name, _)| *name)
            .filter(|name| !guide.contains(&format!("`{name}`")))
            .collect();
        assert!(
            reasons.is_empty(),
            "reasons not in docs/operations.md: {reasons:?}"
        );
    }
}
