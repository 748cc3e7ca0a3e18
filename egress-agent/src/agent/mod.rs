//! `egress-agent run`: the reconcile loop. Cluster view and peer liveness in, desired
//! state out (pure compiler), then maps, attachments and egress addresses brought in
//! line, in the order [`holding`] explains. Every step logs and counts its own failures;
//! one bad object or interface never stops the rest.
//!
//! * [`holding`]: which egress IPs this node holds, and the order of acquire and release.
//! * [`publish`]: the EgressNode, policy statuses and Events.

use std::{
    borrow::Cow,
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use ipnet::IpNet;
use tracing::{debug, info, warn};

use crate::{
    api::{EgressNode, PreflightCheck, PreflightResult},
    compiler::{self, Compiled},
    datapath::{self, Datapath, MapState, lock::PinLock},
    desired::Desired,
    doctor, iface,
    liveness::{self, Membership, PeerView, Transition, service::Handle},
    metrics::{self, Stats},
    source::{
        ClusterView, Event, StatusWriter, kube as kube_source,
        yaml::{self, Snapshot},
    },
};

pub mod attachments;
pub mod holding;
mod nexthop;
pub mod problems;
pub mod publish;

use holding::{Holding, Lingering};

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
    pub resync: Duration,
    /// Liveness probes between agents.
    pub probe: liveness::Settings,
    pub probe_port: u16,
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

/// MTU inside the tunnel for an underlay of `node_ip`'s family.
fn tunnel_mtu_for(underlay_mtu: u32, node_ip: IpAddr) -> u32 {
    let overhead = match node_ip {
        IpAddr::V4(_) => iface::VXLAN_OVERHEAD,
        IpAddr::V6(_) => iface::VXLAN_OVERHEAD_V6,
    };
    underlay_mtu.saturating_sub(overhead)
}

/// How long an egress IP another host answered for is refused before it is probed again.
const REPROBE: Duration = Duration::from_secs(5);

/// `egress-agent doctor` at start, on the first view of the cluster: each check logged
/// (WARN for warn and fail) and kept for the EgressNode. Egress IPs are probed when
/// claimed, not here.
async fn preflight(cfg: &RunConfig, snap: &Snapshot) -> Vec<PreflightCheck> {
    let settings = doctor::Settings {
        bpffs_dir: cfg.bpffs_dir.clone(),
        tunnel_device: cfg.tunnel_device.clone(),
        tunnel_port: cfg.tunnel_port,
        tunnel_mtu: cfg.tunnel_mtu,
        node_name: Some(cfg.node_name.clone()),
        egress_ips: Vec::new(),
        dad: doctor::Dad::WhenClaimed,
        // The agent loads its programs itself, right after: a refusal fails the start.
        load_programs: false,
    };
    let checks = doctor::run(&settings, Some(&snap.view)).await;
    for c in &checks {
        if c.result == PreflightResult::Ok {
            info!(check = %c.check, "preflight ok: {}", c.message);
        } else {
            warn!(check = %c.check, "preflight {}: {}", c.result, c.message);
        }
    }
    checks
}

/// How long `run` waits for the Kubernetes API to answer before it gives up.
const API_TIMEOUT: Duration = Duration::from_secs(15);

/// Connect to the source of cluster state and read it once: the first thing `run` does,
/// before it changes anything on the host.
async fn connect(
    cfg: &RunConfig,
) -> Result<(
    tokio::sync::watch::Receiver<Arc<Snapshot>>,
    Box<dyn StatusWriter>,
)> {
    match &cfg.source {
        Source::Yaml(dir) => {
            std::fs::read_dir(dir).with_context(|| {
                format!(
                    "failed to read the state directory {}: create it (or mount it), or \
                     pass --state-dir",
                    dir.display()
                )
            })?;
            // inotify tells of edits at once; the poll is a safety net.
            let views = yaml::watch(
                dir.clone(),
                Duration::from_secs(1),
                cfg.cluster_cidrs.clone(),
            )
            .await;
            Ok((views, Box::new(yaml::DirWriter(dir.clone()))))
        }
        Source::Kube { kubeconfig } => {
            let hint = "in a cluster, check the pod's ServiceAccount; outside, pass \
                        --kubeconfig or set KUBECONFIG";
            let client = kube_source::client(kubeconfig.clone())
                .await
                .with_context(|| format!("failed to configure the Kubernetes client ({hint})"))?;
            match tokio::time::timeout(API_TIMEOUT, client.apiserver_version()).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    return Err(anyhow::Error::new(e)
                        .context(format!("failed to reach the Kubernetes API ({hint})")));
                }
                Err(_) => anyhow::bail!(
                    "failed to reach the Kubernetes API: no answer within {} s ({hint})",
                    API_TIMEOUT.as_secs()
                ),
            }
            let views = kube_source::watch(client.clone(), cfg.cluster_cidrs.clone())
                .await
                .context("failed to list the cluster (check the RBAC in deploy/base/rbac.yaml)")?;
            Ok((
                views,
                Box::new(kube_source::writer::Writer::start(client, &cfg.node_name)),
            ))
        }
    }
}

/// The probe port, bound, and the metrics endpoint, served (`--metrics-addr`): a port in
/// use fails the start before anything on the host changes.
async fn open_ports(cfg: &RunConfig, stats: &Arc<Mutex<Stats>>) -> Result<tokio::net::UdpSocket> {
    let probe_socket = liveness::service::bind(cfg.probe_port)
        .await
        .with_context(|| {
            format!(
                "failed to open the probe port (UDP {}; --probe-port)",
                cfg.probe_port
            )
        })?;
    if let Some(addr) = cfg.metrics_addr {
        metrics::serve(addr, cfg.bpffs_dir.clone(), stats.clone())
            .await
            .with_context(|| format!("failed to serve metrics on {addr} (--metrics-addr)"))?;
    }
    Ok(probe_socket)
}

pub async fn run(cfg: RunConfig) -> Result<()> {
    // Nothing on the host changes before the source answers and this pin directory is
    // ours: a failed start leaves the node as it was.
    let (mut views, sink) = connect(&cfg).await?;
    let lock = PinLock::acquire(&cfg.bpffs_dir)?;
    let first = Arc::clone(&views.borrow());
    let preflight = preflight(&cfg, &first).await;
    let stats = Arc::new(Mutex::new(Stats::default()));
    let probe_socket = match open_ports(&cfg, &stats).await {
        Ok(s) => s,
        Err(e) => {
            // Nothing changed yet: not even the lock file stays.
            lock.abandon();
            return Err(e);
        }
    };
    let _lock = lock;
    enable_forwarding();
    let (nl, tunnel, mut dp) = set_up_node(&cfg).await?;
    let (tunnel_ifindex, tunnel_mtu, underlay_mtu) = tunnel;
    // Started last: its warm-up and detection clocks run from here, and a pass must follow
    // at once (loading the programs takes a second, long enough to declare peers dead).
    let probes = liveness::service::start_on(probe_socket, &cfg.node_name, cfg.probe)
        .context("failed to start the liveness probes")?;
    info!(
        node = %cfg.node_name,
        tunnel = %cfg.tunnel_device,
        tunnel_ifindex,
        tunnel_mtu,
        pins = %cfg.bpffs_dir.display(),
        adopted = dp.held().v4.policy.len() + dp.held().v4.pod_owner.len(),
        probe_port = probes.port,
        probe_interval_ms = cfg.probe.interval.as_millis(),
        probe_misses = cfg.probe.misses,
        "agent started"
    );
    let mut wakers = Wakers {
        changes: iface::Netlink::subscribe_changes().await?,
        tick: tokio::time::interval(cfg.resync),
        sigterm: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?,
        peer_views: probes.views,
        transitions: probes.transitions,
        new_links: None,
        cni: None,
    };
    if let Some(path) = &cfg.cni_socket {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let path = path.clone();
        info!(socket = %path.display(), "serving the CNI plugin");
        tokio::spawn(async move {
            if let Err(e) = crate::cni::serve(path, tx).await {
                warn!("the CNI plugin socket failed: {e:#}; pods wait for the next pass");
            }
        });
        wakers.cni = Some(rx);
    }
    if cfg.unknown_pods == UnknownPods::Drop {
        wakers.new_links = Some(
            nl.subscribe_new_links()
                .await
                .context("failed to subscribe to new links")?,
        );
    }
    let mut r = Reconciler::new(
        &cfg,
        nl,
        (tunnel_ifindex, tunnel_mtu, underlay_mtu),
        sink,
        probes.handle,
        stats.clone(),
        preflight,
    );
    let mut problem_log = problems::ProblemLog::default();
    while let Some(trigger) = wakers.next(&mut views, &mut r, &mut dp).await? {
        let peers = wakers.peer_views.borrow_and_update().clone();
        // Shared with the source, not copied (a copy of 10k Pods is tens of MiB).
        let snap = Arc::clone(&views.borrow_and_update());
        let source_errors: Vec<String> = snap.errors.iter().map(ToString::to_string).collect();
        let t0 = Instant::now();
        let outcome = r.reconcile(&mut dp, &snap.view, peers).await;
        let took = t0.elapsed();
        record_pass(
            &stats,
            &mut problem_log,
            trigger,
            source_errors,
            outcome,
            took,
        );
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

/// What wakes the agent for a pass, besides the state source.
struct Wakers {
    /// Link and address changes on this node.
    changes: tokio::sync::mpsc::Receiver<()>,
    /// The periodic resync (`--resync`).
    tick: tokio::time::Interval,
    sigterm: tokio::signal::unix::Signal,
    /// The liveness service's view of the peers.
    peer_views: tokio::sync::watch::Receiver<liveness::tracker::PeerView>,
    /// Peers' transitions (noted as they come, for the failover table).
    transitions: tokio::sync::mpsc::UnboundedReceiver<liveness::tracker::Transition>,
    /// New links, with `--unknown-pods drop` (handled at once, between passes).
    new_links: Option<tokio::sync::mpsc::Receiver<iface::NewLink>>,
    /// The CNI plugin's requests (`--cni-socket`), each with its reply's channel.
    cni: Option<tokio::sync::mpsc::Receiver<CniCall>>,
}

/// A CNI plugin request and where its reply goes.
type CniCall = (
    crate::cni::Request,
    tokio::sync::oneshot::Sender<crate::cni::Reply>,
);

/// The next CNI request; pending forever without a socket.
async fn next_cni(rx: &mut Option<tokio::sync::mpsc::Receiver<CniCall>>) -> CniCall {
    if let Some(r) = rx {
        if let Some(call) = r.recv().await {
            return call;
        }
        *rx = None;
    }
    std::future::pending().await
}

/// The next new link; pending forever without a subscription (or once it died).
async fn next_link(rx: &mut Option<tokio::sync::mpsc::Receiver<iface::NewLink>>) -> iface::NewLink {
    if let Some(r) = rx {
        if let Some(link) = r.recv().await {
            return link;
        }
        warn!("the new-link subscription ended: new pod devices wait for the next pass");
        *rx = None;
    }
    std::future::pending().await
}

impl Wakers {
    /// Wait for the next reason for a pass (its name, for the metrics), noting peer
    /// transitions in `r` meanwhile; `None` on SIGINT or SIGTERM.
    async fn next(
        &mut self,
        views: &mut tokio::sync::watch::Receiver<Arc<Snapshot>>,
        r: &mut Reconciler<'_>,
        dp: &mut Datapath,
    ) -> Result<Option<&'static str>> {
        loop {
            let wake = r.wake_at;
            let trigger = tokio::select! {
                // A new pod device first: its attachment must not wait behind a pass.
                biased;
                link = next_link(&mut self.new_links) => {
                    r.on_new_link(dp, &link);
                    continue;
                }
                (req, reply) = next_cni(&mut self.cni) => {
                    let answer = r.on_cni(dp, &req).await;
                    let _ = reply.send(answer);
                    continue;
                }
                res = views.changed() => {
                    if res.is_err() {
                        anyhow::bail!("the state source stopped");
                    }
                    "state"
                }
                res = self.peer_views.changed() => {
                    if res.is_err() {
                        anyhow::bail!("the probe service stopped");
                    }
                    "probe"
                }
                Some(t) = self.transitions.recv() => {
                    r.note(&t);
                    continue;
                }
                _ = self.changes.recv() => "netlink",
                _ = self.tick.tick() => "resync",
                () = sleep_until(wake) => "timer",
                _ = tokio::signal::ctrl_c() => return Ok(None),
                _ = self.sigterm.recv() => return Ok(None),
            };
            // A new pod device's notification may be read just after the change that
            // woke this pass: attach it before the pass, not after.
            tokio::task::yield_now().await;
            while let Some(link) = self.new_links.as_mut().and_then(|r| r.try_recv().ok()) {
                r.on_new_link(dp, &link);
            }
            // Coalesce bursts of netlink events (our own address changes cause some).
            while self.changes.try_recv().is_ok() {}
            while let Ok(t) = self.transitions.try_recv() {
                r.note(&t);
            }
            return Ok(Some(trigger));
        }
    }
}

/// Set this node up for the datapath: netlink, the tunnel device (its MTU from the
/// underlay's), the programs and pinned maps, the conntrack sweeper. Returns the netlink
/// handle, (tunnel ifindex, tunnel MTU, underlay MTU) and the datapath.
async fn set_up_node(cfg: &RunConfig) -> Result<(iface::Netlink, (u32, u32, u32), Datapath)> {
    let nl = iface::Netlink::new().context("failed to open netlink")?;
    let underlay_mtu = nl
        .interfaces()
        .await?
        .iter()
        .filter(|i| i.up && i.name != "lo")
        .map(|i| i.mtu)
        .max()
        .unwrap_or(1500);
    // Until the first pass knows this node's underlay family, assume IPv4; the pass lowers
    // it for an IPv6 underlay.
    let tunnel_mtu = cfg
        .tunnel_mtu
        .unwrap_or(underlay_mtu - iface::VXLAN_OVERHEAD);
    let tunnel_ifindex = nl
        .ensure_vxlan(&cfg.tunnel_device, cfg.tunnel_port, tunnel_mtu)
        .await
        .with_context(|| format!("failed to set up the tunnel device {}", cfg.tunnel_device))?;
    let (hook, why) =
        datapath::Hook::resolve(cfg.attach, cfg.tc_priority).map_err(anyhow::Error::msg)?;
    info!(hook = %hook, "attaching the programs with {why}");
    let mut dp = Datapath::open_at(&cfg.bpffs_dir, &cfg.capacities, cfg.tunnel_port)
        .with_context(|| format!("failed to open the datapath at {}", cfg.bpffs_dir.display()))?;
    dp.set_hook(hook);
    // Expired conntrack entries go, on a thread of its own (the datapath never deletes).
    crate::datapath::sweep::start(&cfg.bpffs_dir)
        .context("failed to start the conntrack sweeper")?;
    // Established flows' cached next hops follow route and neighbour changes.
    nexthop::start(&cfg.bpffs_dir)?;
    Ok((nl, (tunnel_ifindex, tunnel_mtu, underlay_mtu), dp))
}

/// Turn on forwarding (best effort). Containers often see /proc/sys read-only: then the
/// node must already forward (every CNI that routes pods enables it).
fn enable_forwarding() {
    if let Err(e) = iface::sysctl("net/ipv4/conf/all/forwarding", "1") {
        warn!("failed to enable IPv4 forwarding (the node must have it on): {e}");
    }
    // IPv6 pods: best effort, as hosts without IPv6 have no such sysctl.
    if let Err(e) = iface::sysctl("net/ipv6/conf/all/forwarding", "1") {
        debug!("failed to enable IPv6 forwarding (IPv6 pods need it on): {e}");
    }
}

/// Count a pass in the stats and log what it changed and the problems it found.
fn record_pass(
    stats: &Mutex<Stats>,
    problem_log: &mut problems::ProblemLog,
    trigger: &str,
    source_errors: Vec<String>,
    outcome: Result<Outcome>,
    took: Duration,
) {
    let mut s = stats.lock().unwrap_or_else(|e| e.into_inner());
    s.reconciles += 1;
    s.last_reconcile = took;
    s.source_errors = source_errors.len();
    match outcome {
        Ok(o) => {
            s.ready = true;
            s.holders = o.holders;
            s.problems = o.problems.len();
            let state = source_errors.iter().map(|e| format!("state: {e}"));
            let all: Vec<String> = state.chain(o.problems).collect();
            problem_log.log(&all);
            if o.changed > 0 || trigger == "state" {
                info!(
                    trigger,
                    changed = o.changed,
                    problems = all.len(),
                    took_ms = took.as_secs_f64() * 1e3,
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

/// Why this node no longer holds egress IP `ip`, in words for the log.
fn release_reason(ip: IpAddr, compiled: &Compiled) -> String {
    if let Some(h) = compiled.holders.iter().find(|h| h.ip == ip && !h.shared) {
        return format!(
            "{} holds it now ({}, policy {})",
            h.node, h.reason, h.policy
        );
    }
    let named: Vec<&String> = compiled
        .accepted
        .iter()
        .filter(|(_, p)| {
            p.spec
                .rules
                .iter()
                .any(|r| r.egress_ip.as_deref().and_then(|t| t.parse().ok()) == Some(ip))
        })
        .map(|(name, _)| name)
        .collect();
    if named.is_empty() {
        return "no accepted policy names it".to_owned();
    }
    let why: Vec<String> = named
        .iter()
        .filter_map(|name| {
            let ready = compiled
                .statuses
                .get(*name)?
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready")?;
            Some(format!(
                "policy {name}: {}: {}",
                ready.reason, ready.message
            ))
        })
        .collect();
    format!("no eligible gateway holds it ({})", why.join("; "))
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

struct Outcome {
    changed: usize,
    holders: Vec<metrics::HolderStat>,
    problems: Vec<String>,
}

struct Reconciler<'a> {
    cfg: &'a RunConfig,
    nl: iface::Netlink,
    tunnel_ifindex: u32,
    tunnel_mtu: u32,
    /// The largest MTU of the node's up interfaces, for the default `tunnel_mtu`.
    underlay_mtu: u32,
    sink: Box<dyn StatusWriter>,
    probes: Handle,
    last_node_doc: Option<EgressNode>,
    /// The destinations routed out of each interface (by ifindex), from the last route
    /// dump that succeeded.
    route_prefixes: BTreeMap<u32, BTreeSet<IpNet>>,
    /// Interfaces whose routes did not all fit in the last EgressNode.
    routes_capped: BTreeSet<String>,
    /// Egress IP -> (node, interface) as of the last pass, to report moves.
    last_holders: BTreeMap<IpAddr, (String, String)>,
    /// Dedicated egress IPs on this node's interfaces, as this agent took them.
    holdings: BTreeMap<IpAddr, Holding>,
    /// The gateway-side map contents of every dedicated egress IP of the last pass.
    parts: BTreeMap<IpAddr, holding::GatewayPart>,
    lingering: BTreeMap<IpAddr, Lingering>,
    /// Addresses to acquire that another live node still claims, since when.
    handover_since: BTreeMap<IpAddr, Instant>,
    /// The next time a pass is due (a handover, the warm-up or a linger ending).
    wake_at: Option<Instant>,
    /// An address waits for the end of this agent's warm-up.
    warm_pending: bool,
    /// Each policy's last accepted version: a broken edit keeps being served from it.
    last_accepted: BTreeMap<String, crate::api::EgressGatewayPolicy>,
    stats: Arc<Mutex<Stats>>,
    /// What `doctor` found at start, published in the EgressNode.
    preflight: Vec<PreflightCheck>,
    /// Egress IPs another host answered for, when, and the problem that names it.
    refused: BTreeMap<IpAddr, (Instant, String)>,
    /// Devices `from_pod` went on at their RTM_NEWLINK (`--unknown-pods drop`).
    new_devices: attachments::NewDevices,
    /// The egress interfaces of the last pass (never a pod device).
    egress_interfaces: BTreeSet<String>,
}

impl<'a> Reconciler<'a> {
    /// A reconciler that holds nothing yet (the first pass adopts what an earlier agent
    /// left): `tunnel` is the tunnel's ifindex and MTU, and the underlay's MTU.
    fn new(
        cfg: &'a RunConfig,
        nl: iface::Netlink,
        (tunnel_ifindex, tunnel_mtu, underlay_mtu): (u32, u32, u32),
        sink: Box<dyn StatusWriter>,
        probes: Handle,
        stats: Arc<Mutex<Stats>>,
        preflight: Vec<PreflightCheck>,
    ) -> Self {
        Self {
            cfg,
            nl,
            tunnel_ifindex,
            tunnel_mtu,
            underlay_mtu,
            sink,
            probes,
            last_node_doc: None,
            route_prefixes: BTreeMap::new(),
            routes_capped: BTreeSet::new(),
            last_holders: BTreeMap::new(),
            holdings: BTreeMap::new(),
            parts: BTreeMap::new(),
            lingering: BTreeMap::new(),
            handover_since: BTreeMap::new(),
            wake_at: None,
            warm_pending: false,
            last_accepted: BTreeMap::new(),
            stats,
            preflight,
            refused: BTreeMap::new(),
            new_devices: attachments::NewDevices::default(),
            egress_interfaces: BTreeSet::new(),
        }
    }
}

impl Reconciler<'_> {
    /// A link appeared: under `--unknown-pods drop`, a pod-like one gets `from_pod` now,
    /// before the pod can send and before the agent knows the pod (the next pass keeps it
    /// while its routes make it a pod device, [`attachments::NEW_DEVICE_GRACE`] at most
    /// without them).
    fn on_new_link(&mut self, dp: &mut Datapath, link: &iface::NewLink) {
        if self.cfg.unknown_pods != UnknownPods::Drop
            || !attachments::NewDevices::wants(
                link,
                &self.cfg.tunnel_device,
                &self.egress_interfaces,
            )
        {
            return;
        }
        let a = datapath::Attachment {
            program: crate::ebpf::FROM_POD,
            ifname: link.name.clone(),
            ifindex: link.ifindex,
        };
        let queued = link.seen.elapsed();
        match dp.attach_one(&a) {
            Ok(attached) => {
                self.new_devices.note(link);
                if attached {
                    info!(
                        device = %link.name,
                        after_us = link.seen.elapsed().as_micros(),
                        queued_us = queued.as_micros(),
                        "from_pod attached to a new pod device at its RTM_NEWLINK \
                         (--unknown-pods drop): its traffic to covered destinations is \
                         dropped until the agent knows its pod"
                    );
                }
            }
            Err(e) => warn!(device = %link.name, "failed to attach to a new device: {e}"),
        }
    }

    /// Replace the EgressNode's preflight line of `check`'s name (or add it): the line
    /// says what is true now, not at start.
    fn set_preflight(&mut self, check: PreflightCheck) {
        match self.preflight.iter_mut().find(|c| c.check == check.check) {
            Some(c) => *c = check,
            None => self.preflight.push(check),
        }
    }

    /// The CNI plugin's `ADD` (or `CHECK`) for a pod: `from_pod` on the host side of its
    /// interface now (kept like a new device's, [`attachments::NEW_DEVICE_GRACE`] at most
    /// until its routes make it a pod device), or whether it is there.
    async fn on_cni(&mut self, dp: &mut Datapath, req: &crate::cni::Request) -> crate::cni::Reply {
        let t0 = Instant::now();
        let fail = |e: String| crate::cni::Reply {
            error: Some(e),
            ..Default::default()
        };
        let (netns, ifname) = (req.netns.clone(), req.ifname.clone());
        let peer = tokio::task::spawn_blocking(move || crate::cni::host_side(&netns, &ifname))
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r);
        let ifindex = match peer {
            Ok(i) => i,
            Err(e) => return fail(e),
        };
        let ifaces = match self.nl.interfaces().await {
            Ok(i) => i,
            Err(e) => return fail(e.to_string()),
        };
        let Some(device) = ifaces.iter().find(|i| i.ifindex == ifindex) else {
            return fail(format!(
                "the host side of {} in {} (ifindex {ifindex}) is not in this agent's                  namespace",
                req.ifname,
                req.netns.display()
            ));
        };
        let a = datapath::Attachment {
            program: crate::ebpf::FROM_POD,
            ifname: device.name.clone(),
            ifindex,
        };
        if req.check {
            return if dp.is_attached(&a) {
                crate::cni::Reply {
                    device: Some(device.name.clone()),
                    error: None,
                }
            } else {
                fail(format!("from_pod is not on {}", device.name))
            };
        }
        if let Err(e) = dp.attach_one(&a) {
            return fail(e.to_string());
        }
        self.new_devices.note_device(ifindex, &device.name, t0);
        info!(
            device = %device.name,
            container = %req.container_id,
            took_us = t0.elapsed().as_micros(),
            "from_pod on the new pod's device for the CNI plugin's ADD"
        );
        crate::cni::Reply {
            device: Some(device.name.clone()),
            error: None,
        }
    }

    /// Log and count a liveness transition.
    fn note(&mut self, t: &Transition) {
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        match t {
            Transition::Died { name, silent_for } => {
                warn!(
                    peer = %name,
                    silent_ms = silent_for.as_millis(),
                    "peer unreachable: no probe heard within the detection time"
                );
                s.liveness.detections += 1;
                s.liveness.last_detection = Some(*silent_for);
            }
            Transition::Revived { name } => info!(peer = %name, "peer reachable again"),
            Transition::CutOff => warn!(
                "this node hears fewer than a majority of its peers: giving up its egress IPs"
            ),
            Transition::Reconnected => info!("this node hears a majority of its peers again"),
        }
    }

    async fn reconcile(
        &mut self,
        dp: &mut Datapath,
        view: &ClusterView,
        mut peers: PeerView,
    ) -> Result<Outcome> {
        let now = Instant::now();
        let mut pin_problems = Vec::new();
        match dp.restore_pins() {
            Ok(restored) if !restored.is_empty() => warn!(
                "pins vanished from {} behind this agent (removed by hand, or a cleanup): \
                 restored {}",
                self.cfg.bpffs_dir.display(),
                restored.join("; ")
            ),
            Ok(_) => {}
            Err(e) => pin_problems.push(e.to_string()),
        }
        let ifaces = self.nl.interfaces().await?;
        let me = self.cfg.node_name.clone();
        self.adopt(view, &ifaces);
        // This node's own report is as fresh as this pass: its links now, what it holds.
        let down = holding::down_interfaces(
            ifaces
                .iter()
                .filter(|i| i.name != "lo" && i.name != self.cfg.tunnel_device)
                .map(|i| (i.name.as_str(), i.up)),
        );
        {
            let own = peers.reports.entry(me.clone()).or_default();
            own.down = down.clone();
            own.claims = holding::claims(&self.holdings);
        }
        let compiled = compiler::compile_remembering(view, &peers, &self.last_accepted, &me);
        self.last_accepted.clone_from(&compiled.accepted);
        let desired = &compiled.desired;
        let mut problems: Vec<String> = compiled.problems.iter().map(|p| p.to_string()).collect();
        problems.extend(pin_problems);
        let mut changed = 0;

        changed += self.configure(dp, desired, &mut problems).await?;
        changed += self
            .release(view, &compiled, &ifaces, now, &mut problems)
            .await;
        let merged = if self.lingering.is_empty() {
            Cow::Borrowed(desired)
        } else {
            Cow::Owned(holding::with_lingering(desired, &self.lingering))
        };
        changed += self.sync_maps(dp, &merged, &ifaces, &mut problems)?;
        let routes = self.dump_routes(&mut problems).await;
        if let Some(routes) = &routes
            && let Some((astray, check)) =
                underlay_astray(view, &me, desired.node_ip, &ifaces, routes)
        {
            problems.extend(astray);
            // The EgressNode's preflight line says what is true now, not at start.
            self.set_preflight(check);
        }
        let (veth, ovs) = self
            .find_pod_devices(view, &merged, &ifaces, routes.as_ref(), &mut problems)
            .await;
        let finders = attachments::Finders {
            routes: routes
                .as_ref()
                .filter(|_| self.cfg.pod_devices.by_routes())
                .map(|r| r as &dyn attachments::PodRoutes),
            veth: veth.as_ref(),
            ovs: ovs.as_ref(),
        };
        self.sync_attachments(dp, &merged, &ifaces, finders, &mut problems);
        changed += self
            .acquire(&compiled, &peers, &ifaces, now, &mut problems)
            .await;
        self.parts = holding::gateway_parts(desired);
        self.schedule(now);

        // Tell the peers and the cluster.
        self.probes
            .update(membership(view, &me), down, holding::claims(&self.holdings));
        self.publish_node(desired.node_ip, &ifaces, &peers)?;
        self.report(view, &peers, &compiled);

        let holders = compiled
            .holders
            .iter()
            .map(|h| metrics::HolderStat {
                ip: h.ip.to_string(),
                node: h.node.clone(),
                interface: h.interface.clone(),
                reason: h.reason.to_owned(),
            })
            .collect();
        Ok(Outcome {
            changed,
            holders,
            problems,
        })
    }

    /// Take over what this node's EgressNode says it holds and its interfaces still carry
    /// (the agent restarted), so that a restart moves nothing.
    fn adopt(&mut self, view: &ClusterView, ifaces: &[iface::Interface]) {
        let Some(published) = view
            .egress_nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(self.cfg.node_name.as_str()))
            .and_then(|n| n.status.as_ref())
        else {
            return;
        };
        let present = |ifc: &str, ip: IpAddr| {
            ifaces
                .iter()
                .any(|i| i.name == ifc && i.addresses.iter().any(|(a, _)| *a == ip))
        };
        for ip in holding::adopt(&mut self.holdings, &published.egress_ips, present) {
            info!(%ip, "adopted egress IP (held before this agent started)");
        }
    }

    /// This node's configuration: tunnel MTU and the config map.
    async fn configure(
        &mut self,
        dp: &mut Datapath,
        desired: &Desired,
        problems: &mut Vec<String>,
    ) -> Result<usize> {
        let Some(node_ip) = desired.node_ip else {
            problems.push(format!(
                "node {}: no Node object with an InternalIP address: not configured",
                self.cfg.node_name
            ));
            return Ok(0);
        };
        let mtu =
            (self.cfg.tunnel_mtu).unwrap_or_else(|| tunnel_mtu_for(self.underlay_mtu, node_ip));
        if mtu != self.tunnel_mtu {
            self.nl
                .ensure_vxlan(&self.cfg.tunnel_device, self.cfg.tunnel_port, mtu)
                .await?;
            info!(tunnel_mtu = mtu, underlay = %node_ip, "tunnel MTU set for the underlay");
            self.tunnel_mtu = mtu;
        }
        let want = datapath::state::config(
            node_ip,
            self.tunnel_ifindex,
            self.cfg.port_min,
            self.cfg.port_max,
            u16::try_from(self.tunnel_mtu).unwrap_or(u16::MAX),
            self.cfg.unknown_pods == UnknownPods::Drop,
            self.cfg.max_flows_per_pod,
        );
        if dp.config().ok() == Some(want) {
            return Ok(0);
        }
        dp.set_config(&want)?;
        Ok(1)
    }

    /// Remove egress addresses this node must no longer hold (before the maps change),
    /// and keep their map entries lingering.
    async fn release(
        &mut self,
        view: &ClusterView,
        compiled: &Compiled,
        ifaces: &[iface::Interface],
        now: Instant,
        problems: &mut Vec<String>,
    ) -> usize {
        let desired = &compiled.desired;
        // Addresses this agent may remove: egress IPs that a policy names now, that this
        // node published as held (also by an earlier agent), or that it holds.
        let mut removable = all_policy_egress_ips(view);
        removable.extend(self.holdings.keys().copied());
        removable.extend(
            view.egress_nodes
                .iter()
                .filter(|n| n.metadata.name.as_deref() == Some(self.cfg.node_name.as_str()))
                .filter_map(|n| n.status.as_ref())
                .flat_map(|s| s.egress_ips.iter())
                .filter_map(|h| h.ip.parse::<IpAddr>().ok()),
        );
        let mut changed = 0;
        for r in holding::to_release(ifaces, desired, &removable) {
            let a = &r.ip;
            match self.nl.del_address(r.ifindex, r.ip, r.prefix_len).await {
                Ok(()) => {
                    changed += 1;
                    let why = self.holdings.remove(a).map(|h| h.epoch);
                    if let Some(part) = self.parts.get(a) {
                        self.lingering.insert(
                            *a,
                            Lingering {
                                until: now + holding::LINGER,
                                part: part.clone(),
                            },
                        );
                    }
                    let because = release_reason(*a, compiled);
                    info!(
                        ip = %a,
                        interface = %r.interface,
                        epoch = ?why,
                        "released egress IP: {because}"
                    );
                }
                Err(e) => problems.push(format!("egress IP {a}: {e}")),
            }
        }
        // Held IPs whose address vanished (the interface went away): not held any more.
        self.holdings.retain(|ip, h| {
            ifaces
                .iter()
                .any(|i| i.name == h.interface && i.addresses.iter().any(|(a, _)| a == ip))
        });
        self.lingering.retain(|_, l| l.until > now);
        changed
    }

    fn sync_maps(
        &mut self,
        dp: &mut Datapath,
        desired: &Desired,
        ifaces: &[iface::Interface],
        problems: &mut Vec<String>,
    ) -> Result<usize> {
        let ifindex = |n: &str| ifaces.iter().find(|i| i.name == n).map(|i| i.ifindex);
        let (mut want, unresolved) = MapState::from_desired(desired, ifindex);
        let left_out = want.fit_policy(self.cfg.capacities.policy);
        // The EgressNode says so too, for as long as it lasts (statuses are the same on
        // every node; this is one node's map).
        let check = match left_out.first() {
            Some(first) => PreflightCheck {
                check: "policy-map".to_owned(),
                result: PreflightResult::Fail,
                message: first.chars().take(1000).collect(),
            },
            None => PreflightCheck {
                check: "policy-map".to_owned(),
                result: PreflightResult::Ok,
                // Counts would rewrite the EgressNode on every edit: the capacity only.
                message: format!(
                    "every selected pod's entries fit the policy maps ({} per family, \
                     --policy-map-entries)",
                    self.cfg.capacities.policy
                ),
            },
        };
        self.set_preflight(check);
        problems.extend(left_out);
        if self.cfg.unknown_pods == UnknownPods::Pass {
            want.forget_unknown_pods();
        }
        problems.extend(unresolved.iter().map(ToString::to_string));
        let st = dp.apply(&want)?;
        problems.extend(st.problems());
        Ok(st.changed())
    }

    /// This pass's route dump, for the pods' devices and the EgressNode's routes (which
    /// keep the last good dump's while dumps fail).
    async fn dump_routes(&mut self, problems: &mut Vec<String>) -> Option<iface::Routes> {
        match self.nl.routes(&self.cfg.route_tables).await {
            Ok(routes) => {
                self.route_prefixes.clone_from(routes.prefixes_by_oif());
                Some(routes)
            }
            Err(e) => {
                problems.push(format!("routes: {e}"));
                None
            }
        }
    }

    /// Pods' devices found without routes, as `--pod-devices` says: the veths' peers and
    /// OVS's ports (each `None` when not asked, or failed: the failure is a problem).
    /// `auto` asks neither when the route dump finds every selected pod and unknown pods
    /// pass (a routed CNI), and OVSDB only when its socket exists.
    async fn find_pod_devices(
        &self,
        view: &ClusterView,
        desired: &Desired,
        ifaces: &[iface::Interface],
        routes: Option<&iface::Routes>,
        problems: &mut Vec<String>,
    ) -> (Option<attachments::Found>, Option<attachments::Found>) {
        use attachments::{Found, PodDevices};
        let mode = self.cfg.pod_devices;
        let needed = match (mode, routes) {
            (PodDevices::Routes, _) => false,
            (PodDevices::Auto, Some(r)) => {
                self.cfg.unknown_pods == UnknownPods::Drop
                    || !attachments::routes_find_all(r, desired, self.tunnel_ifindex)
            }
            _ => true,
        };
        if !needed {
            return (None, None);
        }
        let veth = if mode.by_veth() {
            match self.nl.veth_peers().await {
                Ok(peers) => Some(Found::from_veths(&peers)),
                Err(e) => {
                    problems.push(format!("pod devices (--pod-devices {mode:?}): {e}"));
                    None
                }
            }
        } else {
            None
        };
        let ask_ovs = mode == PodDevices::Ovs || (mode.by_ovs() && self.cfg.ovsdb.exists());
        let ovs = if ask_ovs {
            match iface::ovsdb::pod_ports(&self.cfg.ovsdb).await {
                Ok(ports) => {
                    let me = Some(self.cfg.node_name.as_str());
                    let pods: Vec<(&str, &str, &[IpAddr])> = view
                        .pods
                        .iter()
                        .filter(|p| p.node_name.as_deref() == me && !p.host_network)
                        .map(|p| (p.namespace.as_str(), p.name.as_str(), p.ips.as_slice()))
                        .collect();
                    Some(Found::from_ovs_ports(&ports, &pods, ifaces))
                }
                Err(e) => {
                    problems.push(format!("pod devices: {e}"));
                    None
                }
            }
        } else {
            None
        };
        (veth, ovs)
    }

    /// Attach what [`attachments::wanted`] decides.
    fn sync_attachments(
        &mut self,
        dp: &mut Datapath,
        desired: &Desired,
        ifaces: &[iface::Interface],
        finders: attachments::Finders<'_>,
        problems: &mut Vec<String>,
    ) {
        let tunnel = attachments::Tunnel {
            name: &self.cfg.tunnel_device,
            ifindex: self.tunnel_ifindex,
        };
        let (mut attach, found) =
            attachments::wanted(&tunnel, desired, ifaces, finders, self.cfg.unknown_pods);
        self.egress_interfaces
            .clone_from(&desired.egress_interfaces);
        attach.extend(self.new_devices.still_wanted(
            ifaces,
            &desired.egress_interfaces,
            Instant::now(),
        ));
        problems.extend(found);
        for e in dp.sync_attachments(&attach) {
            problems.push(e.to_string());
        }
    }

    /// Add the egress addresses this node holds now (after the maps and attachments),
    /// waiting for a live previous holder to let go, and announce them.
    async fn acquire(
        &mut self,
        compiled: &Compiled,
        peers: &PeerView,
        ifaces: &[iface::Interface],
        now: Instant,
        problems: &mut Vec<String>,
    ) -> usize {
        let me = self.cfg.node_name.as_str();
        let mine = compiled
            .holders
            .iter()
            .filter(|h| h.node == me && !h.shared);
        let mut wanted = BTreeSet::new();
        let mut changed = 0;
        let detection = self.probes.settings().detection();
        let warm_at = self.probes.warm_at();
        self.warm_pending = false;
        for h in mine {
            let Some(i) = ifaces.iter().find(|i| i.name == h.interface) else {
                continue;
            };
            wanted.insert(h.ip);
            let prefix_len = match h.ip {
                IpAddr::V4(a) => compiled.desired.v4.egress_ips.get(&a),
                IpAddr::V6(a) => compiled.desired.v6.egress_ips.get(&a),
            }
            .map_or(32, |held| held.prefix_len);
            if i.addresses.iter().any(|(a, _)| *a == h.ip) {
                // Already there (held before, or by the agent before this one).
                self.keep_holding(h);
                continue;
            }
            let waiting = self.handover_since.get(&h.ip).copied();
            let probe =
                match holding::take(h.ip, h.reason, me, peers, now, warm_at, waiting, detection) {
                    holding::Take::AfterWarmUp => {
                        self.warm_pending = true;
                        continue;
                    }
                    holding::Take::AfterHandover { holder, since } => {
                        self.handover_since.insert(h.ip, since);
                        debug!(ip = %h.ip, %holder, "waiting for the previous holder to release");
                        continue;
                    }
                    holding::Take::Now { probe, overdue } => {
                        if let Some(holder) = overdue {
                            warn!(
                                ip = %h.ip,
                                %holder,
                                "the previous holder still claims the address after the \
                                 detection time; taking it"
                            );
                        }
                        probe
                    }
                };
            self.handover_since.remove(&h.ip);
            if self.cfg.dad
                && probe
                && let Some(refused) = self.answered_elsewhere(h.ip, i, now).await
            {
                problems.push(format!("egress IP {}: {refused}", h.ip));
                continue;
            }
            match self.add_held(h, i, prefix_len).await {
                Ok(()) => changed += 1,
                Err(e) => problems.push(format!("egress IP {}: {e}", h.ip)),
            }
        }
        self.handover_since.retain(|ip, _| wanted.contains(ip));
        self.refused.retain(|ip, _| wanted.contains(ip));
        changed
    }

    /// Record `h`, whose address is already on its interface, as held (keeping the
    /// `since` this node published for its epoch).
    fn keep_holding(&mut self, h: &compiler::Holder) {
        self.holdings
            .entry(h.ip)
            .or_insert_with(|| Holding {
                interface: h.interface.clone(),
                epoch: h.epoch,
                since: published_since(self.last_node_doc.as_ref(), h.ip, h.epoch)
                    .unwrap_or_else(kube_source::now_rfc3339),
                reason: h.reason.to_owned(),
            })
            .epoch = h.epoch;
    }

    /// Add `h`'s address to `i` (the kernel's own IPv6 DAD stays off: see
    /// `add_address`), record it as held, count it and announce it.
    async fn add_held(
        &mut self,
        h: &compiler::Holder,
        i: &iface::Interface,
        prefix_len: u8,
    ) -> Result<(), iface::Error> {
        self.nl.add_address(i.ifindex, h.ip, prefix_len).await?;
        self.lingering.remove(&h.ip);
        self.holdings.insert(
            h.ip,
            Holding {
                interface: h.interface.clone(),
                epoch: h.epoch,
                since: kube_source::now_rfc3339(),
                reason: h.reason.to_owned(),
            },
        );
        info!(
            ip = %h.ip,
            interface = %h.interface,
            epoch = h.epoch,
            reason = h.reason,
            "holding egress IP"
        );
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        *s.liveness.acquired.entry(h.reason.to_owned()).or_default() += 1;
        drop(s);
        if let Some(mac) = i.mac {
            announce(i.ifindex, mac, h.ip);
        }
        Ok(())
    }

    /// Duplicate address detection before this node first claims `ip` on `i`
    /// ([`doctor::dad`]): the problem to report when another host answers for it. A
    /// refused address is probed again once [`REPROBE`] has passed.
    async fn answered_elsewhere(
        &mut self,
        ip: IpAddr,
        i: &iface::Interface,
        now: Instant,
    ) -> Option<String> {
        if let Some((at, refused)) = self.refused.get(&ip)
            && now.duration_since(*at) < REPROBE
        {
            return Some(refused.clone());
        }
        let t0 = Instant::now();
        let answer = doctor::dad::probe(i.ifindex, i.mac?, ip).await;
        let took_ms = t0.elapsed().as_secs_f64() * 1e3;
        match answer {
            Ok(None) => {
                info!(%ip, interface = %i.name, took_ms, "no answer to duplicate address probes");
                self.refused.remove(&ip);
                None
            }
            Ok(Some(holder)) => {
                let refused = doctor::in_use_message(ip, &i.name, holder);
                self.refused.insert(ip, (now, refused.clone()));
                Some(refused)
            }
            Err(e) => {
                warn!("failed to probe for {ip} before claiming it (claiming it anyway): {e}");
                None
            }
        }
    }

    /// When the next pass is due without an event: a pending handover's deadline, or the
    /// end of a linger.
    fn schedule(&mut self, now: Instant) {
        let detection = self.probes.settings().detection();
        let handovers = self.handover_since.values().map(|s| *s + detection);
        let lingers = self.lingering.values().map(|l| l.until);
        let warm = self.warm_pending.then(|| self.probes.warm_at());
        let reprobes = self.refused.values().map(|(at, _)| *at + REPROBE);
        self.wake_at = handovers
            .chain(lingers)
            .chain(warm)
            .chain(reprobes)
            .filter(|t| *t > now)
            .min();
        if (self.warm_pending || !self.handover_since.is_empty()) && self.wake_at.is_none() {
            self.wake_at = Some(now);
        }
    }

    fn publish_node(
        &mut self,
        underlay: Option<IpAddr>,
        ifaces: &[iface::Interface],
        peers: &PeerView,
    ) -> Result<()> {
        let statuses = self.probes.status();
        {
            let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            s.liveness.peers.clone_from(&statuses);
            s.liveness.cut_off = peers.dead.contains(&self.cfg.node_name);
            s.liveness.refused = self.probes.refused();
            s.liveness.held = self
                .holdings
                .iter()
                .map(|(ip, h)| metrics::HeldStat {
                    ip: ip.to_string(),
                    interface: h.interface.clone(),
                    epoch: h.epoch,
                    since: h.since.clone(),
                    reason: h.reason.clone(),
                })
                .collect();
        }
        let interfaces = publish::node_interfaces(
            ifaces,
            &self.cfg.tunnel_device,
            &self.holdings,
            &self.route_prefixes,
        );
        self.routes_capped = publish::warn_capped(&self.routes_capped, &interfaces);
        self.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .routes_published = interfaces
            .iter()
            .map(|i| (i.name.clone(), i.routes.len()))
            .collect();
        let doc = publish::egress_node_doc(
            &self.cfg.node_name,
            underlay,
            interfaces,
            &self.holdings,
            &statuses,
            peers.dead.contains(&self.cfg.node_name),
            self.preflight
                .iter()
                .map(|c| refreshed(c, &self.holdings))
                .chain(
                    self.refused
                        .iter()
                        .map(|(ip, (_, message))| PreflightCheck {
                            check: format!("duplicate-address {ip}"),
                            result: PreflightResult::Fail,
                            message: message.clone(),
                        }),
                )
                .collect(),
        );
        if self.last_node_doc.as_ref() != Some(&doc) {
            self.sink.egress_node(&doc)?;
            self.last_node_doc = Some(doc);
        }
        Ok(())
    }

    /// Policy status and holder moves: logged always; written to the API (statuses,
    /// Events) by one agent only, the one on the first Ready, live node by name, so that
    /// agents whose views differ for a moment do not fight over the status.
    fn report(&mut self, view: &ClusterView, peers: &PeerView, compiled: &Compiled) {
        // A silently dead node may still look Ready: the next one writes.
        let writer = view
            .nodes
            .iter()
            .filter(|n| compiler::node_ready(n))
            .filter(|n| {
                n.metadata
                    .name
                    .as_deref()
                    .is_none_or(|name| !peers.dead.contains(name))
            })
            .filter_map(|n| n.metadata.name.as_deref())
            .min()
            == Some(self.cfg.node_name.as_str());
        let now: BTreeMap<IpAddr, (String, String)> = compiled
            .holders
            .iter()
            .filter(|h| !h.shared)
            .map(|h| (h.ip, (h.node.clone(), h.interface.clone())))
            .collect();
        let mut moves = Vec::new();
        for h in compiled.holders.iter().filter(|h| !h.shared) {
            match self.last_holders.get(&h.ip) {
                Some((old, _)) if *old != h.node => moves.push((
                    h.ip,
                    format!(
                        "egress IP {} moved from {old} to {} ({}): {}",
                        h.ip, h.node, h.interface, h.reason
                    ),
                )),
                None if !self.last_holders.is_empty() => moves.push((
                    h.ip,
                    format!(
                        "egress IP {} assigned to {} ({})",
                        h.ip, h.node, h.interface
                    ),
                )),
                _ => {}
            }
        }
        for ip in self.last_holders.keys().filter(|ip| !now.contains_key(ip)) {
            moves.push((*ip, format!("egress IP {ip} has no holder")));
        }
        self.last_holders = now;
        for (_, m) in &moves {
            info!("{m}");
        }
        if !writer {
            return;
        }
        let w = &self.sink;
        w.policy_statuses(&compiled.statuses);
        for (ip, message) in moves {
            if let Some(h) = compiled.holders.iter().find(|h| h.ip == ip) {
                w.event(Event {
                    policy: h.policy.clone(),
                    reason: "EgressIPMoved",
                    message,
                });
            }
        }
    }
}

/// Send the announcements of a newly held address on their schedule, in the background.
fn announce(ifindex: u32, mac: [u8; 6], ip: IpAddr) {
    tokio::spawn(async move {
        if let Err(e) = iface::announce(ifindex, mac, ip, &holding::ANNOUNCE_AT).await {
            warn!("failed to announce {ip}: {e}");
        }
    });
}

/// The `since` this node published for `ip` at `epoch`, if any.
fn published_since(doc: Option<&EgressNode>, ip: IpAddr, epoch: u64) -> Option<String> {
    doc?.status
        .as_ref()?
        .egress_ips
        .iter()
        .find(|h| h.ip == ip.to_string() && h.epoch == epoch)?
        .since
        .clone()
}

/// Who this node probes and counts (see [`liveness::tracker`]).
/// A start-time preflight line about an egress IP (`egress-ip X`, `duplicate-address
/// X`), as it stands now: once this node holds X, it says so rather than what was found
/// before it did.
fn refreshed(
    check: &PreflightCheck,
    holdings: &BTreeMap<IpAddr, holding::Holding>,
) -> PreflightCheck {
    let ip = check
        .check
        .strip_prefix("egress-ip ")
        .or_else(|| check.check.strip_prefix("duplicate-address "))
        .and_then(|ip| ip.parse::<IpAddr>().ok());
    match ip.and_then(|ip| holdings.get(&ip)) {
        Some(h) => PreflightCheck {
            check: check.check.clone(),
            result: PreflightResult::Ok,
            message: format!(
                "held by this node on {} since {} (at start: {}: {})",
                h.interface,
                h.since,
                check.result,
                // The line's schema allows 1,024 characters.
                check.message.chars().take(640).collect::<String>()
            ),
        },
        None => check.clone(),
    }
}

/// Peers whose underlay address this node routes out of another interface than the one
/// that holds its own underlay address (`node_ip`), as problems, and `doctor`'s
/// `underlay-routes` check: every pass says so, for as long as the route is there.
fn underlay_astray(
    view: &ClusterView,
    me: &str,
    node_ip: Option<IpAddr>,
    ifaces: &[iface::Interface],
    routes: &iface::Routes,
) -> Option<(Vec<String>, PreflightCheck)> {
    let underlay = node_ip.and_then(|ip| {
        ifaces
            .iter()
            .find(|i| i.addresses.iter().any(|(a, _)| *a == ip))
    })?;
    let peers = crate::doctor::peer_addresses(view, Some(me));
    let astray = crate::doctor::host::underlay_astray(&underlay.name, &peers, |ip| {
        let oif = routes.oif(ip)?;
        ifaces
            .iter()
            .find(|i| i.ifindex == oif)
            .map(|i| i.name.clone())
    });
    let check = crate::doctor::host::underlay_routes_verdict(&underlay.name, peers.len(), &astray);
    Some((astray, check))
}

fn membership(view: &ClusterView, me: &str) -> Membership {
    let agents: BTreeSet<&str> = view
        .egress_nodes
        .iter()
        .filter_map(|n| n.metadata.name.as_deref())
        .collect();
    Membership {
        nodes: view
            .nodes
            .iter()
            .filter_map(|n| Some((n.metadata.name.clone()?, compiler::node_underlay(n)?)))
            .collect(),
        aliases: view
            .nodes
            .iter()
            .filter_map(|n| {
                let addrs = n.status.as_ref()?.addresses.as_ref()?;
                let ips = addrs
                    .iter()
                    .filter_map(|a| a.address.parse().ok())
                    .collect();
                Some((n.metadata.name.clone()?, ips))
            })
            .collect(),
        gateways: compiler::gateway_candidates(view),
        expected: view
            .nodes
            .iter()
            .filter(|n| compiler::node_ready(n))
            .filter_map(|n| n.metadata.name.as_deref())
            .filter(|n| *n != me && agents.contains(n))
            .map(str::to_owned)
            .collect(),
    }
}

/// Every egress IP (both families) any policy names: the only addresses this agent may
/// remove.
fn all_policy_egress_ips(view: &ClusterView) -> BTreeSet<IpAddr> {
    view.policies
        .iter()
        .flat_map(|p| p.spec.rules.iter())
        .filter_map(|r| r.egress_ip.as_deref()?.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_egress_ip_preflight_line_says_so_once_the_node_holds_it() {
        let start = PreflightCheck {
            check: "egress-ip 192.168.101.50".to_owned(),
            result: PreflightResult::Fail,
            message: "in no subnet of an up interface".to_owned(),
        };
        let other = PreflightCheck {
            check: "bpffs".to_owned(),
            ..start.clone()
        };
        let mut holdings = BTreeMap::new();
        assert_eq!(refreshed(&start, &holdings), start);
        holdings.insert(
            "192.168.101.50".parse().unwrap(),
            holding::Holding {
                interface: "sec-a".to_owned(),
                epoch: 1,
                since: "2026-12-02T01:00:00Z".to_owned(),
                reason: "Assigned".to_owned(),
            },
        );
        let now = refreshed(&start, &holdings);
        assert_eq!(now.result, PreflightResult::Ok);
        assert!(
            now.message
                .starts_with("held by this node on sec-a since 2026-12-02T01:00:00Z")
                && now.message.contains("at start: fail: in no subnet"),
            "{now:?}"
        );
        assert_eq!(refreshed(&other, &holdings), other);
    }
}
