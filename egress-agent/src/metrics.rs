//! Prometheus metrics (`/metrics`), in OpenMetrics: counters end in `_total`, times are
//! in seconds, the detection, failover and reconcile times are histograms. The names,
//! labels and types are those of docs/operations.md's table (a test holds them equal).
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
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

use crate::{compiler::Made, datapath::dump, liveness::PeerStatus};

/// What the reconcile loop reports.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub ready: bool,
    pub reconciles: u64,
    pub errors: u64,
    /// The passes' compiles, by how each came by its result.
    pub compiles: Compiles,
    pub problems: usize,
    pub source_errors: usize,
    pub last_reconcile: Duration,
    /// Every pass's duration.
    pub reconcile_duration: Seconds,
    /// For every pass that took a state change: how long the change waited for it
    /// (`--state-batch-max-ms`).
    pub state_batch_delay: Seconds,
    /// Every egress address in use, cluster-wide, as this node computes it.
    pub holders: Vec<HolderStat>,
    /// The dedicated egress IPs of served policies that no node holds.
    pub unheld: Vec<UnheldStat>,
    pub liveness: LivenessStats,
    /// Interface -> routes out of it listed in this node's EgressNode.
    pub routes_published: BTreeMap<String, usize>,
    /// The address each of this node's selected pods leaves with, per rule.
    pub pod_routes: Vec<PodRouteStat>,
}

/// The passes' compiles, by how each came by its result ([`Made`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Compiles {
    pub compiled: u64,
    pub again: u64,
    pub patched: u64,
}

impl Compiles {
    pub fn count(&mut self, made: Made) {
        *match made {
            Made::Compiled => &mut self.compiled,
            Made::Again => &mut self.again,
            Made::Patched => &mut self.patched,
        } += 1;
    }
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

/// A dedicated egress IP of a served policy that no node holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct UnheldStat {
    pub ip: String,
    pub policy: String,
}

/// Upper bounds of the time histograms, in seconds: a reconcile pass (milliseconds), a
/// detection and a failover (tenths of a second to seconds), a slow API (a minute).
pub const SECONDS_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0,
];

/// A histogram of durations kept across scrapes (each scrape builds its registry anew;
/// clones share the counts).
#[derive(Clone, Debug)]
pub struct Seconds(Histogram);

impl Default for Seconds {
    fn default() -> Self {
        Self(Histogram::new(SECONDS_BUCKETS))
    }
}

impl Seconds {
    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }
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
    /// Times this node found itself cut off (hearing fewer than a majority).
    pub cut_offs: u64,
    /// Due sends of this node's hellos that went out an interval or more late.
    pub late_hellos: u64,
    /// Peers declared dead so far, and the silence before the last one.
    pub detections: u64,
    pub last_detection: Option<Duration>,
    /// The silence before each peer was declared dead.
    pub detection: Seconds,
    /// Egress IPs this node took, by reason.
    pub acquired: BTreeMap<String, u64>,
    /// Held egress IPs announced again (a peer let one go, or a peer came back).
    pub reannounced: u64,
    /// Remapped translations shared with and heard from the other gateways.
    pub remaps: crate::liveness::remaps::Stats,
    /// Heard remaps kept now (`REMAP_V4` / `_V6`).
    pub remaps_kept: usize,
    /// For each egress IP taken from an unreachable holder, that holder's silence when
    /// this node added it.
    pub failover: Seconds,
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
struct CompileLabels {
    made: &'static str,
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
struct UnheldLabels {
    ip: String,
    policy: String,
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
    /// `max_entries` of each pinned hash map and trie.
    pub capacities: Vec<(&'static str, u32)>,
}

impl MapStats {
    /// Read the counters and walk every map (blocking: conntrack may hold 100k+ entries).
    pub fn read(pin_dir: &std::path::Path) -> Self {
        Self {
            counters: dump::counters(pin_dir).unwrap_or_default(),
            sizes: dump::sizes(pin_dir).unwrap_or_default(),
            capacities: dump::capacities(pin_dir),
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
    let capacity = Family::<MapLabels, Gauge>::default();
    for &(map, n) in &maps.capacities {
        capacity
            .get_or_create(&MapLabels { map: map.into() })
            .set(i64::from(n));
    }
    reg.register(
        "map_capacity",
        "Capacity (max_entries) of each BPF map, as sized at load",
        capacity,
    );
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
        "ip_holder",
        "Which node and interface hold each egress IP",
        holders,
    );
    let unheld = Family::<UnheldLabels, Gauge>::default();
    for u in &stats.unheld {
        unheld
            .get_or_create(&UnheldLabels {
                ip: u.ip.clone(),
                policy: u.policy.clone(),
            })
            .set(1);
    }
    reg.register(
        "ip_unheld",
        "1 for each egress IP of a served policy that no node holds",
        unheld,
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

/// The reconcile passes: how many, failed, their problems and durations.
fn register_passes(reg: &mut Registry, stats: &Stats) {
    for (name, help, v) in [
        ("reconciles", "Reconcile passes", stats.reconciles),
        ("reconcile_errors", "Failed reconcile passes", stats.errors),
    ] {
        let c = Counter::<u64>::default();
        c.inc_by(v);
        reg.register(name, help, c);
    }
    let compiles = Family::<CompileLabels, Counter>::default();
    let c = &stats.compiles;
    for (made, v) in [
        ("compiled", c.compiled),
        ("again", c.again),
        ("patched", c.patched),
    ] {
        compiles.get_or_create(&CompileLabels { made }).inc_by(v);
    }
    reg.register(
        "compiles",
        "The passes' compiles: compiled anew, the last result taken again (nothing it reads \
         changed), or patched (only pods no policy selects changed)",
        compiles,
    );
    for (name, help, v) in [
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
    ] {
        reg.register(name, help, gauge(v));
    }
    reg.register(
        "reconcile_duration_seconds",
        "Duration of each reconcile pass",
        stats.reconcile_duration.0.clone(),
    );
    reg.register(
        "state_batch_delay_seconds",
        "How long each state change waited for its pass while passes were expensive",
        stats.state_batch_delay.0.clone(),
    );
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
    register_peers(reg, l);
    register_hellos(reg, l);
    register_moves(reg, l);
    register_remaps(reg, l);
}

/// A counter at `n`.
fn counter(n: u64) -> Counter<u64> {
    let c = Counter::<u64>::default();
    c.inc_by(n);
    c
}

/// Counters by reason, one per entry of `counts`.
fn by_reason<'a>(
    counts: impl IntoIterator<Item = (&'a String, &'a u64)>,
) -> Family<MoveLabels, Counter> {
    let f = Family::<MoveLabels, Counter>::default();
    for (reason, n) in counts {
        f.get_or_create(&MoveLabels {
            reason: reason.clone(),
        })
        .inc_by(*n);
    }
    f
}

/// What this node hears of its peers.
fn register_peers(reg: &mut Registry, l: &LivenessStats) {
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
    let heard = l.peers.iter().filter(|p| p.alive).count();
    reg.register("peers_alive", "Peers heard", gauge(heard as u64));
    reg.register(
        "cut_off",
        "1 if this node hears fewer than a majority of its peers (it holds nothing)",
        gauge(u64::from(l.cut_off)),
    );
    reg.register(
        "cut_offs",
        "Times this node heard fewer than a majority of its peers and gave up its egress IPs",
        counter(l.cut_offs),
    );
    reg.register(
        "hellos_late",
        "Times this node's hellos went out an interval or more after their time (its hellos \
         thread held back by the CPU): peers declare a node dead after the detection time \
         without its hellos, so each late round is where a cut-off starts",
        counter(l.late_hellos),
    );
    reg.register(
        "peer_deaths",
        "Peers declared unreachable",
        counter(l.detections),
    );
    reg.register(
        "peer_detection_seconds",
        "Silence before each peer was declared unreachable",
        l.detection.0.clone(),
    );
}

/// The hellos refused, and whether they are signed.
fn register_hellos(reg: &mut Registry, l: &LivenessStats) {
    reg.register(
        "probes_refused",
        "Hellos refused, by reason (malformed, unauthenticated, stale, replayed, unknown_node, \
         wrong_address, from_myself)",
        by_reason(&l.refused),
    );
    reg.register(
        "liveness_authenticated",
        "1 if hellos are signed and only signed ones taken (--liveness-key-file), else 0",
        gauge(u64::from(l.authenticated)),
    );
}

/// The egress IPs this node took, and announced again.
fn register_moves(reg: &mut Registry, l: &LivenessStats) {
    reg.register(
        "failovers",
        "Egress IPs this node took, by reason (Assigned: first holder)",
        by_reason(&l.acquired),
    );
    reg.register(
        "reannouncements",
        "Held egress IPs announced again (gratuitous ARP, unsolicited NA) because a peer \
         let one go or a peer became reachable again",
        counter(l.reannounced),
    );
    reg.register(
        "failover_seconds",
        "For each egress IP taken from an unreachable holder: that holder's silence when \
         this node added the address",
        l.failover.0.clone(),
    );
}

/// The remapped translations shared between gateways.
fn register_remaps(reg: &mut Registry, l: &LivenessStats) {
    let shared = Family::<EventLabels, Counter>::default();
    for (event, n) in [
        ("sent", l.remaps.sent),
        ("installed", l.remaps.installed),
        ("expired", l.remaps.expired),
        ("failed", l.remaps.failed),
        ("fresh", l.remaps.fresh),
    ] {
        shared
            .get_or_create(&EventLabels {
                event: event.to_owned(),
            })
            .inc_by(n);
    }
    reg.register(
        "remaps",
        "Remapped translations (flows whose pod port was taken) shared between gateways: sent \
         in hellos, installed when heard new or changed, expired unheard, failed to write or to \
         take, fresh: taken from the datapath as it made them",
        shared,
    );
    reg.register(
        "remaps_kept",
        "Remapped translations heard from other gateways and kept for a takeover",
        gauge(u64::try_from(l.remaps_kept).unwrap_or(u64::MAX)),
    );
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: String,
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
    use std::{collections::BTreeSet, path::Path, sync::atomic::AtomicUsize};

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
            capacities: vec![("CT_V4", 65536)],
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

    /// Every family rendered, with one sample each.
    fn every_family() -> (MapStats, Stats) {
        let stats = Stats {
            routes_published: BTreeMap::from([("eth1".to_owned(), 3)]),
            holders: vec![HolderStat::default()],
            unheld: vec![UnheldStat::default()],
            liveness: LivenessStats {
                peers: vec![crate::liveness::PeerStatus {
                    name: "gw-1".to_owned(),
                    alive: true,
                    direct: true,
                    last_heard: None,
                    rtt: Some(Duration::from_millis(1)),
                }],
                refused: BTreeMap::from([("stale".to_owned(), 1)]),
                last_detection: Some(Duration::from_millis(300)),
                acquired: BTreeMap::from([("Assigned".to_owned(), 1)]),
                ..LivenessStats::default()
            },
            ..Stats::default()
        };
        stats.liveness.detection.observe(Duration::from_millis(300));
        let maps = MapStats {
            counters: vec![(1, egress_common::counters::Counter::default())],
            sizes: vec![("CT_V4", 0)],
            capacities: vec![("CT_V4", 65536)],
        };
        (maps, stats)
    }

    /// The families of a scrape in the text format 0.0.4 (the names Prometheus stores):
    /// name -> (type, label names; `le` of histogram buckets left out).
    fn families(text: &str) -> BTreeMap<String, (String, BTreeSet<String>)> {
        let mut out: BTreeMap<String, (String, BTreeSet<String>)> = BTreeMap::new();
        for line in text.lines() {
            if let Some(t) = line.strip_prefix("# TYPE ") {
                let (name, kind) = t.split_once(' ').expect("name and type");
                out.insert(name.to_owned(), (kind.to_owned(), BTreeSet::new()));
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let series = line.split([' ', '{']).next().unwrap_or_default();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    let base = series.strip_suffix(s)?;
                    out.get(base)
                        .is_some_and(|(k, _)| k == "histogram")
                        .then_some(base)
                })
                .unwrap_or(series);
            let labels = line
                .split_once('{')
                .and_then(|(_, rest)| rest.split_once('}'))
                .map(|(l, _)| l)
                .unwrap_or_default();
            let entry = out
                .get_mut(family)
                .unwrap_or_else(|| panic!("sample {line:?} before its TYPE"));
            for pair in labels.split(',').filter(|p| !p.is_empty()) {
                let (k, _) = pair.split_once('=').expect("label=value");
                if k != "le" {
                    entry.1.insert(k.to_owned());
                }
            }
        }
        out
    }

    /// The metrics table of docs/operations.md: name -> (type, label names).
    fn documented(guide: &str) -> BTreeMap<String, (String, BTreeSet<String>)> {
        let section = guide
            .split("\n## Metrics\n")
            .nth(1)
            .expect("a Metrics section");
        section
            .lines()
            .filter(|l| l.starts_with("| `egress_"))
            .map(|row| {
                let cells: Vec<&str> = row.split('|').map(str::trim).collect();
                let name = cells[1].trim_matches('`').to_owned();
                let labels = cells[3]
                    .split(',')
                    .map(|l| l.trim().trim_matches('`'))
                    .filter(|l| !l.is_empty())
                    .map(str::to_owned)
                    .collect();
                (name, (cells[2].to_owned(), labels))
            })
            .collect()
    }

    fn read_doc(path: &str) -> String {
        std::fs::read_to_string(format!("{}/../{path}", env!("CARGO_MANIFEST_DIR")))
            .unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// docs/operations.md's metrics table and the endpoint agree on every name, type and
    /// label, both ways; every datapath counter reason is in its counter table.
    #[test]
    fn the_operations_guide_and_the_endpoint_agree() {
        let guide = read_doc("docs/operations.md");
        let (maps, stats) = every_family();
        let served = families(&text_004(&render(&maps, &stats)));
        assert!(served.len() > 20, "{served:?}");
        let docs = documented(&guide);
        for (name, want) in &served {
            assert_eq!(
                docs.get(name),
                Some(want),
                "{name}: served as {want:?}, docs/operations.md says {:?}",
                docs.get(name)
            );
        }
        let stale: Vec<&String> = docs.keys().filter(|n| !served.contains_key(*n)).collect();
        assert!(
            stale.is_empty(),
            "docs/operations.md lists metrics not served: {stale:?}"
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

    /// Every metric name written anywhere in the docs, the README or deploy/ (alert rules,
    /// the dashboard) is one the endpoint serves (a series of it: `_bucket`, `_sum` and
    /// `_count` of a histogram count).
    #[test]
    fn every_metric_named_in_the_docs_and_deploy_is_served() {
        let (maps, stats) = every_family();
        let served = families(&text_004(&render(&maps, &stats)));
        let series = |name: &str| {
            served.contains_key(name)
                || ["_bucket", "_sum", "_count"].iter().any(|s| {
                    name.strip_suffix(s)
                        .is_some_and(|b| served.get(b).is_some_and(|(k, _)| k == "histogram"))
                })
        };
        // Identifiers of the code that look like metric names.
        let not_metrics = [
            "egress_agent",
            "egress_common",
            "egress_ebpf",
            "egress_tests",
            "egress_ip",
            "egress_ips",
        ];
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = vec![root.join("README.md")];
        for dir in ["docs", "deploy"] {
            let mut stack = vec![root.join(dir)];
            while let Some(d) = stack.pop() {
                for e in std::fs::read_dir(&d).unwrap().flatten() {
                    let p = e.path();
                    if p.is_dir() {
                        stack.push(p);
                    } else if p
                        .extension()
                        .is_some_and(|x| ["md", "yaml", "yml", "json"].iter().any(|y| x == *y))
                    {
                        files.push(p);
                    }
                }
            }
        }
        let mut unknown = BTreeSet::new();
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            let mut rest = text.as_str();
            while let Some(i) = rest.find("egress_") {
                let before = rest[..i].chars().next_back();
                let tail = &rest[i..];
                let end = tail
                    .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                    .unwrap_or(tail.len());
                let name = tail[..end].trim_end_matches('_');
                if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                    && !not_metrics.contains(&name)
                    && !series(name)
                {
                    unknown.insert(format!("{}: {name}", f.display()));
                }
                rest = &tail[end.max(1)..];
            }
        }
        assert!(unknown.is_empty(), "not served: {unknown:#?}");
    }
}
