//! `egress-agent run`: the reconcile loop. Cluster view and peer liveness in, desired
//! state out (pure compiler), then maps, attachments and egress addresses brought in
//! line, in the order [`holding`] explains. Every step logs and counts its own failures;
//! one bad object or interface never stops the rest.
//!
//! * [`start`]: connecting to the source, the ports, the preflight, the node's set-up.
//! * [`wakers`]: what wakes a pass, and what is handled between passes; [`batch`]: how
//!   long a state change waits for its pass while passes are expensive.
//! * [`maps`]: the node's configuration and map contents, through the datapath.
//! * [`devices`]: pod devices found and attached ([`attachments`] decides).
//! * [`holding`]: which egress IPs this node holds, and the order of acquire and release.
//! * [`publish`]: the EgressNode, policy statuses and Events.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Result;
use ipnet::IpNet;
use tracing::{debug, info, warn};

use crate::{
    api::HeldEgressIp,
    compiler::{self, Compiled, move_reason},
    datapath::{self, Datapath},
    iface,
    liveness::{self, PeerView, Transition, service::Handle},
    metrics::{self, Stats},
    source::{Snapshot, kube as kube_source},
};

pub mod accepted;
pub mod attachments;
pub mod batch;
mod devices;
mod early;
pub mod holding;
mod maps;
mod nexthop;
pub mod problems;
pub mod publish;
mod start;
mod wakers;

use devices::Devices;
use holding::{NodeAddresses, Ownership};
use publish::Publisher;
use wakers::{Due, Trigger, Wake};

/// Where cluster state comes from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A directory of Kubernetes-shaped YAML documents; our EgressNode is written there.
    Yaml(PathBuf),
    /// The Kubernetes API (in cluster, or this kubeconfig).
    Kube { kubeconfig: Option<PathBuf> },
}

/// Settings of `egress-agent run`.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub node_name: String,
    pub source: Source,
    pub bpffs_dir: PathBuf,
    pub tunnel_device: String,
    pub tunnel_port: u16,
    pub tunnel_mtu: Option<u32>,
    pub port_min: u16,
    pub port_max: u16,
    pub metrics_addr: Option<SocketAddr>,
    /// Serve the endpoints over TLS with these files (`--metrics-tls-cert-file`, ...).
    pub metrics_tls: Option<crate::endpoints::TlsFiles>,
    /// Serve `/status` and `/metrics` on this Unix socket too (`--status-socket`).
    pub status_socket: Option<PathBuf>,
    pub resync: Duration,
    /// The longest rest after a pass before a state change's pass
    /// (`--state-batch-max-ms`; zero: none, see [`batch`]).
    pub state_batch_max: Duration,
    /// Liveness probes between agents.
    pub probe: liveness::Settings,
    pub probe_port: u16,
    /// The cluster's liveness keys (`--liveness-key-file`); none: hellos unsigned.
    pub liveness_key_file: Option<PathBuf>,
    /// Routing tables besides main whose routes this node publishes (policy routing).
    pub route_tables: Vec<u32>,
    /// The cluster's pod and service CIDRs, set on every view before it is compiled.
    pub cluster_cidrs: Vec<IpNet>,
    /// Map capacities the operator sets.
    pub capacities: datapath::Capacities,
    /// Packets of pods the agent has not seen yet (`--unknown-pods`).
    pub unknown_pods: UnknownPods,
    /// Where the CNI plugin asks for attachments (`--cni-socket`); none: not served.
    pub cni_socket: Option<std::path::PathBuf>,
    /// Live translated flows per pod on this gateway; 0: no limit.
    pub max_flows_per_pod: u32,
    /// Probe the network before claiming an egress IP nobody of ours held (`--no-dad`
    /// turns it off).
    pub dad: bool,
    /// TCX links, legacy tc filters, or whichever the kernel has (`--attach`).
    pub attach: datapath::AttachMode,
    /// The ingress priority of the legacy tc filters (`--tc-priority`).
    pub tc_priority: u16,
    /// How pods' devices are found (`--pod-devices`).
    pub pod_devices: attachments::PodDevices,
    /// OVSDB's socket, for `--pod-devices ovs` or `auto` (`--ovsdb`).
    pub ovsdb: PathBuf,
}

/// `--unknown-pods`: fail open (the default, what every CNI's egress gateway does) or
/// closed for pods whose Pod object has not reached the agent yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum UnknownPods {
    #[default]
    Pass,
    Drop,
}

pub async fn run(cfg: RunConfig) -> Result<()> {
    let start::Started {
        reconciler: mut r,
        mut dp,
        mut wakers,
        lock: _lock,
    } = start::start(&cfg).await?;
    // The probes run (their thread started from this one, at its priority): from here on
    // this thread's passes give way to them.
    crate::priority::give_way();
    let mut problem_log = problems::ProblemLog::default();
    loop {
        match wakers.next(r.wake_at).await? {
            Wake::Pass(due) => {
                let trigger = due.trigger;
                let passed = r.pass(&mut dp, due).await;
                wakers.ran(passed.began, passed.took);
                record_pass(&r.stats, &mut problem_log, trigger, passed);
            }
            Wake::NewLink(link) => r.devices.on_new_link(&mut dp, &link),
            Wake::Cni((req, reply)) => {
                let answer = r.devices.on_cni(&r.nl, &mut dp, &req).await;
                let _ = reply.send(answer);
            }
            Wake::Transition(t) => note(&r.stats, &t),
            Wake::Stop => break,
        }
    }
    // The datapath stays: peers keep this node alive while its next agent starts.
    r.probes.farewell().await;
    info!(
        "agent stopping: the datapath stays (pinned maps and links, tunnel device {}, \
         egress IPs), so traffic keeps flowing until the next agent adopts it; \
         `egress-agent cleanup` uninstalls it",
        cfg.tunnel_device
    );
    Ok(())
}

/// Log and count a liveness transition.
fn note(stats: &Mutex<Stats>, t: &Transition) {
    let mut s = stats.lock().unwrap_or_else(|e| e.into_inner());
    match t {
        Transition::Died { name, silent_for } => {
            warn!(
                peer = %name,
                silent_ms = silent_for.as_millis(),
                "peer unreachable: no probe heard within the detection time"
            );
            s.liveness.detections += 1;
            s.liveness.last_detection = Some(*silent_for);
            s.liveness.detection.observe(*silent_for);
        }
        Transition::Revived { name } => info!(peer = %name, "peer reachable again"),
        Transition::CutOff(q) => {
            warn!(
                counted = q.counted,
                expected = q.expected,
                unheard = q.unheard,
                not_echoing = q.not_echoing,
                last_hello_sent_ms = q.sent_ago.map(|d| d.as_millis()),
                "this node hears fewer than a majority of its peers: giving up its egress IPs"
            );
            s.liveness.cut_offs += 1;
        }
        Transition::Reconnected => info!("this node hears a majority of its peers again"),
    }
}

/// Count a pass in the stats and log what it changed and the problems it found.
fn record_pass(
    stats: &Mutex<Stats>,
    problem_log: &mut problems::ProblemLog,
    trigger: Trigger,
    passed: Passed,
) {
    let Passed {
        source_errors,
        outcome,
        took,
        cpu,
        ..
    } = passed;
    let mut s = stats.lock().unwrap_or_else(|e| e.into_inner());
    s.reconciles += 1;
    s.last_reconcile = took;
    s.reconcile_duration.observe(took);
    s.source_errors = source_errors.len();
    match outcome {
        Ok(o) => {
            s.ready = true;
            s.compiles.count(o.made);
            s.holders = o.holders;
            s.unheld = o.unheld;
            s.pod_routes = o.pod_routes;
            s.problems = o.problems.len();
            let state = source_errors.iter().map(|e| format!("state: {e}"));
            let all: Vec<String> = state.chain(o.problems).collect();
            problem_log.log(&all);
            if o.changed > 0 || trigger == Trigger::State {
                info!(
                    trigger = trigger.name(),
                    changed = o.changed,
                    problems = all.len(),
                    took_ms = took.as_secs_f64() * 1e3,
                    cpu_ms = cpu.as_secs_f64() * 1e3,
                    "reconciled"
                );
            }
        }
        Err(e) => {
            s.errors += 1;
            warn!("failed to reconcile: {}", crate::report::chain(e.as_ref()));
        }
    }
}

/// A pass: the source's errors it saw, what it did, when it began and how long it took.
struct Passed {
    source_errors: Vec<String>,
    outcome: Result<Outcome>,
    began: Instant,
    took: Duration,
    /// The CPU this thread spent on it (passes run on the agent's main thread).
    cpu: Duration,
}

struct Outcome {
    changed: usize,
    /// How the compile came by its result.
    made: compiler::Made,
    holders: Vec<metrics::HolderStat>,
    unheld: Vec<metrics::UnheldStat>,
    pod_routes: Vec<metrics::PodRouteStat>,
    problems: Vec<String>,
}

struct Reconciler<'a> {
    cfg: &'a RunConfig,
    nl: iface::Netlink,
    tunnel_ifindex: u32,
    tunnel_mtu: u32,
    /// The largest MTU of the node's up interfaces, for the default `tunnel_mtu`.
    underlay_mtu: u32,
    probes: Handle,
    /// What this node tells the cluster, and what it last told it.
    publisher: Publisher<'a>,
    /// This node's pod devices.
    devices: Devices<'a>,
    /// The egress IPs this node holds, lingers, waits for or refused.
    own: Ownership,
    /// The announcements of [`Ownership`]'s addresses still pending.
    announcing: holding::Announcing,
    /// The next time a pass is due (a handover, the warm-up or a linger ending).
    wake_at: Option<Instant>,
    /// Each policy's last accepted version: a broken edit keeps being served from it.
    last_accepted: accepted::Accepted,
    /// Where they are kept for the next agent on this node.
    accepted_file: accepted::AcceptedFile,
    /// The last compile, taken again while nothing it reads changed.
    memo: compiler::Memo,
    stats: Arc<Mutex<Stats>>,
}

impl<'a> Reconciler<'a> {
    /// A reconciler that holds nothing yet (the first pass adopts what an earlier agent
    /// left), finding pod devices with `devices` (and configured as they are): `tunnel`
    /// is the tunnel's ifindex and MTU, and the underlay's MTU; the
    /// policies' last accepted versions are what `accepted_file` kept.
    fn new(
        devices: Devices<'a>,
        nl: iface::Netlink,
        (tunnel_ifindex, tunnel_mtu, underlay_mtu): (u32, u32, u32),
        publisher: Publisher<'a>,
        probes: Handle,
        stats: Arc<Mutex<Stats>>,
        accepted_file: accepted::AcceptedFile,
    ) -> Self {
        Self {
            cfg: devices.cfg(),
            nl,
            tunnel_ifindex,
            tunnel_mtu,
            underlay_mtu,
            probes,
            publisher,
            devices,
            own: Ownership::default(),
            announcing: holding::Announcing::default(),
            wake_at: None,
            last_accepted: accepted_file.kept().clone(),
            accepted_file,
            memo: compiler::Memo::default(),
            stats,
        }
    }
}

impl Reconciler<'_> {
    /// The pass `due` asks for: what came with it first (new links attached, transitions
    /// noted, the state change's wait counted), then [`reconcile`](Self::reconcile).
    async fn pass(&mut self, dp: &mut Datapath, due: Due) -> Passed {
        for link in &due.new_links {
            self.devices.on_new_link(dp, link);
        }
        for t in &due.transitions {
            note(&self.stats, t);
        }
        if let Some(waited) = due.state_waited {
            let s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            s.state_batch_delay.observe(waited);
        }
        let snap = due.snapshot;
        let source_errors: Vec<String> = snap.errors.iter().map(ToString::to_string).collect();
        let began = Instant::now();
        let cpu_before = crate::priority::thread_cpu();
        let outcome = self.reconcile(dp, &snap, due.peers).await;
        Passed {
            source_errors,
            outcome,
            began,
            took: began.elapsed(),
            cpu: crate::priority::thread_cpu().saturating_sub(cpu_before),
        }
    }
}

impl Reconciler<'_> {
    /// One pass, in the order [`holding`] explains: the node's own report, the compile,
    /// its configuration, releases, maps, devices, acquisitions; then the peers and the
    /// cluster are told.
    async fn reconcile(
        &mut self,
        dp: &mut Datapath,
        snapshot: &Arc<Snapshot>,
        mut peers: PeerView,
    ) -> Result<Outcome> {
        let view = &snapshot.view;
        let now = Instant::now();
        let mut problems = self.restore_pins(dp);
        let ifaces = self.nl.interfaces().await?;
        let published = self.publisher.held(view);
        self.adopt(&published, &ifaces);
        let down = self.report_own(&mut peers, &ifaces);
        let me = &self.cfg.node_name;
        let (compiled, made) = self.memo.compile(snapshot, &peers, &self.last_accepted, me);
        match made {
            compiler::Made::Compiled => {}
            compiler::Made::Again => debug!(
                "compile: nothing it reads changed since the last pass, its result taken again"
            ),
            compiler::Made::Patched => debug!(
                "compile: only pods no policy selects changed since the last pass, their \
                 entries patched into its result"
            ),
        }
        self.last_accepted.clone_from(&compiled.accepted);
        self.accepted_file.save(&self.last_accepted);
        problems.extend(compiled.problems.iter().map(ToString::to_string));

        let mut changed = self.configure(dp, &compiled.desired, &mut problems).await?;
        let released = self
            .release(&compiled, &published, &ifaces, now, &mut problems)
            .await;
        changed += released;
        let serving = self.own.serving(&compiled.desired);
        changed += self.sync_maps(dp, &serving, &compiled.pod_routes, &ifaces, &mut problems)?;
        self.sync_devices(dp, view, &serving, &ifaces, &mut problems)
            .await;
        changed += self
            .acquire(&compiled, &published, &peers, &ifaces, now, &mut problems)
            .await;
        self.own.remember(&compiled.desired);
        let detection = self.probes.settings().detection();
        self.wake_at = self.own.next_pass(now, detection, self.probes.warm_at());

        // Tell the peers and the cluster.
        let membership = compiled.membership.clone();
        self.probes.update(membership, down, self.own.claims());
        // An address released in this pass is in `ifaces` (read before) but no longer held:
        // published so, it would be an address of this node to every compile until the
        // next pass, and the peer taking it over would let it go again at once
        // (`EgressIPIsNodeAddress`). What is published is what the interfaces carry now.
        let ifaces = if released > 0 {
            self.nl.interfaces().await.unwrap_or_else(|e| {
                warn!("failed to read the interfaces again after a release: {e:#}");
                ifaces
            })
        } else {
            ifaces
        };
        self.publish_node(compiled.desired.node_ip, &ifaces, &peers)?;
        self.publisher.report(&compiled);
        if compiled.membership.gateways.contains(me) {
            // A gateway candidate loads `from_secondary` before it may serve: a takeover
            // must not wait for the verifier (most nodes never need the program). It
            // takes a second or more, so it comes last, once the peers and the cluster
            // have been told: a first pass that verified first held back the node's
            // first hellos and its EgressNode, and the peers elected the other gateway
            // and then this one (two holders' claims at a cold start).
            if let Err(e) = dp.load_program(crate::ebpf::FROM_SECONDARY) {
                problems.push(e.to_string());
            }
        }
        Ok(Outcome {
            changed,
            made,
            holders: holder_stats(&compiled),
            unheld: unheld_stats(&compiled),
            pod_routes: pod_route_stats(&compiled),
            problems,
        })
    }

    /// This node's own report, as fresh as this pass: its links now (the names of those
    /// down, returned for its hellos) and what it holds.
    fn report_own(&self, peers: &mut PeerView, ifaces: &[iface::Interface]) -> BTreeSet<String> {
        let down = holding::down_interfaces(
            ifaces
                .iter()
                .filter(|i| i.name != "lo" && i.name != self.cfg.tunnel_device)
                .map(|i| (i.name.as_str(), i.up)),
        );
        let own = peers.reports.entry(self.cfg.node_name.clone()).or_default();
        own.down.clone_from(&down);
        own.claims = self.own.claims();
        down
    }

    /// Take over what this node's EgressNode says it holds (`published`) and its
    /// interfaces still carry (the agent restarted), so that a restart moves nothing.
    fn adopt(&mut self, published: &[HeldEgressIp], ifaces: &[iface::Interface]) {
        for ip in self.own.adopt(published, ifaces) {
            info!(%ip, "adopted egress IP (held before this agent started)");
        }
    }

    /// Remove the egress addresses this node must no longer hold ([`Ownership::release`]).
    async fn release(
        &mut self,
        compiled: &Compiled,
        published: &[HeldEgressIp],
        ifaces: &[iface::Interface],
        now: Instant,
        problems: &mut Vec<String>,
    ) -> usize {
        let addrs = &mut NodeAddresses {
            nl: &self.nl,
            announcing: &mut self.announcing,
        };
        let done = self
            .own
            .release(addrs, compiled, published, ifaces, now)
            .await;
        problems.extend(done.problems);
        done.changed
    }

    /// Add the egress addresses this node holds now ([`Ownership::acquire`]), and count
    /// them by reason.
    async fn acquire(
        &mut self,
        compiled: &Compiled,
        published: &[HeldEgressIp],
        peers: &PeerView,
        ifaces: &[iface::Interface],
        now: Instant,
        problems: &mut Vec<String>,
    ) -> usize {
        let stamp = kube_source::now_rfc3339();
        let pass = holding::Pass {
            me: &self.cfg.node_name,
            now,
            stamp: &stamp,
            peers,
            warm_at: self.probes.warm_at(),
            detection: self.probes.settings().detection(),
            dad: self.cfg.dad,
        };
        let addrs = &mut NodeAddresses {
            nl: &self.nl,
            announcing: &mut self.announcing,
        };
        let done = self
            .own
            .acquire(addrs, compiled, ifaces, &pass, published)
            .await;
        let fresh: Vec<std::net::IpAddr> = done.acquired.iter().map(|(ip, _)| *ip).collect();
        let again = self.own.reannounce(addrs, ifaces, peers, pass.me, &fresh);
        let status = self.probes.status();
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.liveness.reannounced += again.len() as u64;
        for (ip, reason) in done.acquired {
            *s.liveness.acquired.entry(reason.to_owned()).or_default() += 1;
            if let Some(silence) = takeover_silence(ip, reason, peers, &status) {
                s.liveness.failover.observe(silence);
            }
        }
        problems.extend(done.problems);
        done.changed
    }
}

/// For an egress IP taken from a holder declared unreachable: how long that holder had
/// been silent when this node added the address (its last hello heard here to the
/// address on this node), the failover time a far side sees, less the announcement.
fn takeover_silence(
    ip: std::net::IpAddr,
    reason: &str,
    peers: &PeerView,
    status: &[crate::liveness::PeerStatus],
) -> Option<Duration> {
    if reason != move_reason::HOLDER_UNREACHABLE {
        return None;
    }
    let (previous, _) = peers.last_claims.get(&ip)?;
    status.iter().find(|p| &p.name == previous)?.last_heard
}

/// Every holder of the compile, with the pods that leave by it, for the metrics.
fn holder_stats(compiled: &Compiled) -> Vec<metrics::HolderStat> {
    let mut local: BTreeMap<(&str, std::net::IpAddr, &str), u32> = BTreeMap::new();
    for r in &compiled.pod_routes {
        if let (Some(ip), Some(gw)) = (r.egress_ip, &r.gateway) {
            *local.entry((&r.policy, ip, gw)).or_default() += 1;
        }
    }
    compiled
        .holders
        .iter()
        .map(|h| metrics::HolderStat {
            ip: h.ip.to_string(),
            node: h.node.clone(),
            interface: h.interface.clone(),
            reason: h.reason.to_owned(),
            policy: h.policy.clone(),
            pods: h.pods,
            local_pods: local
                .get(&(h.policy.as_str(), h.ip, h.node.as_str()))
                .copied()
                .unwrap_or(0),
        })
        .collect()
}

/// The dedicated egress IPs of every served policy that no node holds, for the metrics.
fn unheld_stats(compiled: &Compiled) -> Vec<metrics::UnheldStat> {
    let held: BTreeSet<std::net::IpAddr> = compiled.holders.iter().map(|h| h.ip).collect();
    let mut out: Vec<metrics::UnheldStat> = compiled
        .accepted
        .iter()
        .flat_map(|(name, p)| {
            p.spec
                .rules
                .iter()
                .flat_map(|r| r.dedicated_ips())
                .filter(|ip| !held.contains(ip))
                .map(move |ip| metrics::UnheldStat {
                    ip: ip.to_string(),
                    policy: name.clone(),
                })
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// This node's pods and their addresses, for `egress-agent status`.
fn pod_route_stats(compiled: &Compiled) -> Vec<metrics::PodRouteStat> {
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
    compiled
        .pod_routes
        .iter()
        .map(|r| metrics::PodRouteStat {
            pod: r.pod.clone(),
            pod_ip: r.pod_ip.to_string(),
            rule: format!("{} rules[{}]", r.policy, r.rule),
            egress_ip: dash(r.egress_ip.map(|ip| ip.to_string())),
            gateway: dash(r.gateway.clone()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `egress-agent run`'s configuration as the DaemonSet's defaults give it, for node
    /// gw-1.
    pub(in crate::agent) fn config() -> RunConfig {
        RunConfig {
            node_name: "gw-1".to_owned(),
            source: Source::Yaml(PathBuf::from("/nonexistent/egress-state")),
            bpffs_dir: PathBuf::from("/sys/fs/bpf/egress-test"),
            tunnel_device: "egress0".to_owned(),
            tunnel_port: 4789,
            tunnel_mtu: None,
            port_min: 32768,
            port_max: 60999,
            metrics_addr: None,
            metrics_tls: None,
            status_socket: None,
            resync: Duration::from_secs(30),
            state_batch_max: Duration::from_millis(batch::DEFAULT_MAX_REST_MS),
            probe: liveness::Settings::default(),
            probe_port: 4790,
            liveness_key_file: None,
            route_tables: Vec::new(),
            cluster_cidrs: Vec::new(),
            capacities: datapath::Capacities {
                policy: 1024,
                conntrack: 1024,
                pod_owner: 1024,
                admitted: 1024,
            },
            unknown_pods: UnknownPods::Pass,
            cni_socket: None,
            max_flows_per_pod: 0,
            dad: true,
            attach: datapath::AttachMode::default(),
            tc_priority: 1,
            pod_devices: attachments::PodDevices::default(),
            ovsdb: PathBuf::from("/nonexistent/db.sock"),
        }
    }

    fn passed(outcome: Result<Outcome>, source_errors: &[&str]) -> Passed {
        Passed {
            source_errors: source_errors.iter().map(|e| (*e).to_owned()).collect(),
            outcome,
            began: Instant::now(),
            took: Duration::from_millis(7),
            cpu: Duration::from_millis(5),
        }
    }

    #[test]
    fn a_pass_is_counted_with_what_it_found_and_a_failed_one_as_an_error() {
        let stats = Mutex::new(Stats::default());
        let mut log = problems::ProblemLog::default();
        let ok = Outcome {
            changed: 2,
            made: compiler::Made::Patched,
            holders: Vec::new(),
            unheld: Vec::new(),
            pod_routes: Vec::new(),
            problems: vec!["policy p: no gateway".to_owned()],
        };
        record_pass(
            &stats,
            &mut log,
            Trigger::State,
            passed(Ok(ok), &["a.yaml: bad"]),
        );
        {
            let s = stats.lock().unwrap();
            assert!(s.ready);
            assert_eq!((s.reconciles, s.errors), (1, 0));
            assert_eq!((s.problems, s.source_errors), (1, 1));
            assert_eq!(s.last_reconcile, Duration::from_millis(7));
            assert_eq!(s.compiles.patched, 1);
        }
        let failed = Err(anyhow::anyhow!("failed to read the interfaces"));
        record_pass(&stats, &mut log, Trigger::Resync, passed(failed, &[]));
        let s = stats.lock().unwrap();
        assert_eq!((s.reconciles, s.errors), (2, 1));
        assert_eq!(s.source_errors, 0);
        assert!(s.ready, "a failed pass keeps what the last good one found");
    }

    #[test]
    fn a_peers_death_is_counted_with_its_detection_time() {
        let stats = Mutex::new(Stats::default());
        let silent_for = Duration::from_millis(900);
        note(
            &stats,
            &Transition::Died {
                name: "gw-2".to_owned(),
                silent_for,
            },
        );
        note(&stats, &Transition::CutOff(Default::default()));
        let s = stats.lock().unwrap();
        assert_eq!(s.liveness.detections, 1);
        assert_eq!(s.liveness.cut_offs, 1);
        assert_eq!(s.liveness.last_detection, Some(silent_for));
    }

    #[test]
    fn a_takeover_from_an_unreachable_holder_is_timed_from_its_last_hello() {
        let ip: std::net::IpAddr = "198.51.100.10".parse().unwrap();
        let mut peers = PeerView::default();
        peers.last_claims.insert(ip, ("gw-2".to_owned(), 3));
        let status = [crate::liveness::PeerStatus {
            name: "gw-2".to_owned(),
            alive: false,
            direct: true,
            last_heard: Some(Duration::from_millis(1500)),
            rtt: None,
        }];
        let unreachable = move_reason::HOLDER_UNREACHABLE;
        assert_eq!(
            takeover_silence(ip, unreachable, &peers, &status),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(takeover_silence(ip, "Assigned", &peers, &status), None);
        let other: std::net::IpAddr = "198.51.100.11".parse().unwrap();
        assert_eq!(takeover_silence(other, unreachable, &peers, &status), None);
    }
}
