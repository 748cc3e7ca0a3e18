//! Starting the agent ([`start`], one call): the source of cluster state connected and
//! read once, the pin directory locked, the ports opened, `doctor`'s preflight, the node
//! set up for the datapath (netlink, the tunnel device, the programs and pinned maps, the
//! sweeper and next-hop tasks), the liveness probes started and what wakes a pass
//! subscribed to. Nothing on the host changes before the source answers.

use std::{
    net::IpAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context as _, Result};
use tracing::{info, warn};

use super::{
    Reconciler, RunConfig, Source, devices::Devices, early::Early, nexthop, wakers::Wakers,
};
use crate::{
    api::{PreflightCheck, PreflightResult},
    compiler,
    datapath::{self, Datapath, lock::PinLock},
    doctor, iface, liveness,
    metrics::Stats,
    source::{PodScope, Snapshot, StatusWriter, kube as kube_source, yaml},
};

/// A started agent: its reconciler, the datapath, what wakes it, and the lock on its
/// pin directory (held until the agent stops).
pub(super) struct Started<'a> {
    pub reconciler: Reconciler<'a>,
    pub dp: Datapath,
    pub wakers: Wakers,
    pub lock: PinLock,
}

/// Start the agent of `cfg`. Nothing on the host changes before the keys are read, the
/// source answers and the pin directory is this agent's: a failed start leaves the node
/// as it was.
pub(super) async fn start(cfg: &RunConfig) -> Result<Started<'_>> {
    let liveness_keys = liveness::service::Keys::load(cfg.liveness_key_file.clone())?;
    let (views, sink) = connect(cfg).await?;
    let lock = PinLock::acquire(&cfg.bpffs_dir)?;
    let first = Arc::clone(&views.borrow());
    let preflight = preflight(cfg, &first).await;
    let stats = Arc::new(Mutex::new(Stats::default()));
    let probe_socket = match open_ports(cfg, &stats).await {
        Ok(s) => s,
        Err(e) => {
            // Nothing changed yet: not even the lock file stays.
            lock.abandon();
            return Err(e);
        }
    };
    let remapped = crate::family::conntrack::Outbox::default();
    let (nl, tunnel, dp) = set_up_node(cfg, remapped.clone()).await?;
    // Started last: its warm-up and detection clocks run from here, and a pass must follow
    // at once (loading the programs takes a second, long enough to declare peers dead).
    let probes = start_probes(cfg, probe_socket, liveness_keys, remapped)?;
    log_started(cfg, tunnel, &dp, probes.port);
    // New links' from_pod goes on off this thread (a pass must not delay it).
    let early = Arc::new(Early::new(dp.pin_dir().to_owned(), &cfg.tunnel_device));
    let peers = (probes.views, probes.transitions);
    let wakers = Wakers::start(cfg, views, &nl, peers, Arc::clone(&early)).await?;
    // Read once the lock is ours: the file is the last agent's on this pin directory.
    let kept = super::accepted::AcceptedFile::open(lock.beside(super::accepted::FILE));
    let publisher = super::publish::Publisher::new(cfg, sink, preflight);
    let devices = Devices::new(cfg, tunnel.0, early);
    let reconciler = Reconciler::new(devices, nl, tunnel, publisher, probes.handle, stats, kept);
    Ok(Started {
        reconciler,
        dp,
        wakers,
        lock,
    })
}

/// The liveness probes on `socket`, with the cluster's `keys`; flows whose port this
/// gateway remapped (`remapped`) go to the other gateways, and theirs come here, so that
/// a takeover keeps them (issue 44).
fn start_probes(
    cfg: &RunConfig,
    socket: tokio::net::UdpSocket,
    keys: liveness::service::Keys,
    remapped: crate::family::conntrack::Outbox,
) -> Result<liveness::service::Started> {
    let probes = liveness::service::start_on(socket, &cfg.node_name, cfg.probe, keys)
        .context("failed to start the liveness probes")?;
    probes.handle.remaps().set_outbox(remapped);
    let pins = cfg.bpffs_dir.clone();
    let mut fresh = crate::datapath::remap::Fresh::new(&cfg.bpffs_dir);
    probes
        .handle
        .remaps()
        .set_installer(Box::new(move |add, remove| {
            crate::datapath::remap::write(&pins, add, remove).map_err(Into::into)
        }));
    probes.handle.remaps().set_fresh_source(Box::new(move || {
        fresh
            .take(crate::liveness::remaps::FRESH_MAX)
            .map_err(Into::into)
    }));
    if !probes.handle.authenticated() {
        warn!(
            "liveness is UNAUTHENTICATED: hellos are not signed, so anything that can send UDP \
             from a node's underlay address (a host-network pod, a machine on the underlay's \
             network) can keep a dead gateway alive or fight for its egress IPs; give every \
             agent the same key with --liveness-key-file (a Secret: see docs/operations.md)"
        );
    }
    Ok(probes)
}

/// Say that the agent started, and with what.
fn log_started(
    cfg: &RunConfig,
    (tunnel_ifindex, tunnel_mtu, _): (u32, u32, u32),
    dp: &Datapath,
    probe_port: u16,
) {
    info!(
        node = %cfg.node_name,
        tunnel = %cfg.tunnel_device,
        tunnel_ifindex,
        tunnel_mtu,
        pins = %cfg.bpffs_dir.display(),
        adopted = dp.held().v4.policy.len() + dp.held().v4.pod_owner.len(),
        probe_port,
        probe_interval_ms = cfg.probe.interval.as_millis(),
        probe_misses = cfg.probe.misses,
        "agent started"
    );
}

/// MTU inside the tunnel for an underlay of `node_ip`'s family.
pub(super) fn tunnel_mtu_for(underlay_mtu: u32, node_ip: IpAddr) -> u32 {
    let overhead = match node_ip {
        IpAddr::V4(_) => iface::VXLAN_OVERHEAD,
        IpAddr::V6(_) => iface::VXLAN_OVERHEAD_V6,
    };
    underlay_mtu.saturating_sub(overhead)
}

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
        ovsdb: cfg.ovsdb.clone(),
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
            // The compiles tell the source which pods the node needs (through the writer,
            // `StatusWriter::pods_needed`); until the first, the view alone decides.
            let (needed, wanted) = tokio::sync::watch::channel(PodScope::Node);
            let node = kube_source::NodePods {
                name: cfg.node_name.clone(),
                wanted,
                needs: compiler::pods_needed,
            };
            let views = kube_source::watch_node(client.clone(), cfg.cluster_cidrs.clone(), node)
                .await
                .context("failed to list the cluster (check the RBAC in deploy/base/rbac.yaml)")?;
            let writer =
                kube_source::writer::Writer::start(client, &cfg.node_name).with_pods_needed(needed);
            Ok((views, Box::new(writer)))
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
        let tls = cfg.metrics_tls.clone();
        crate::endpoints::serve(addr, cfg.bpffs_dir.clone(), stats.clone(), tls)
            .await
            .with_context(|| format!("failed to serve metrics on {addr} (--metrics-addr)"))?;
    }
    if let Some(path) = &cfg.status_socket {
        // The datapath does not need it: without it `egress-agent status` cannot ask.
        let served = crate::endpoints::serve_unix(path, cfg.bpffs_dir.clone(), stats.clone()).await;
        if let Err(e) = served {
            warn!("not serving the status socket: {e:#}; `egress-agent status` cannot ask");
        }
    }
    Ok(probe_socket)
}

/// Set this node up for the datapath: netlink, the tunnel device (its MTU from the
/// underlay's), the programs and pinned maps, the conntrack sweeper. Returns the netlink
/// handle, (tunnel ifindex, tunnel MTU, underlay MTU) and the datapath.
async fn set_up_node(
    cfg: &RunConfig,
    outbox: crate::family::conntrack::Outbox,
) -> Result<(iface::Netlink, (u32, u32, u32), Datapath)> {
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
    crate::datapath::sweep::start(&cfg.bpffs_dir, outbox)
        .context("failed to start the conntrack sweeper")?;
    // Established flows' cached next hops follow route and neighbour changes.
    nexthop::start(&cfg.bpffs_dir)?;
    Ok((nl, (tunnel_ifindex, tunnel_mtu, underlay_mtu), dp))
}

/// IPv4 forwarding on `dev`, one device the datapath looks routes up from (`role` on it):
/// turned on if off, never `net.ipv4.conf.all` (which would make every interface of the
/// node a router). The error names the device and the setting: in a container /proc/sys
/// is read-only, and the node must turn it on.
pub(super) fn ensure_forwarding(dev: &str, role: &str) -> Result<(), String> {
    let path = format!("net/ipv4/conf/{dev}/forwarding");
    let now = std::fs::read_to_string(std::path::Path::new("/proc/sys").join(&path));
    if now.as_deref().map(str::trim).is_ok_and(|v| v != "0") {
        return Ok(());
    }
    iface::sysctl(&path, "1").map_err(|e| {
        format!(
            "failed to turn on forwarding on {dev} ({role}): net.ipv4.conf.{dev}.forwarding \
             is off and {e}; the datapath's route lookups from {dev} fail until the node \
             turns it on: sysctl -w net.ipv4.conf.{dev}.forwarding=1"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::tests::config;

    #[test]
    fn the_tunnel_mtu_leaves_room_for_the_underlays_encapsulation() {
        let v4: IpAddr = "192.0.2.1".parse().unwrap();
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(tunnel_mtu_for(1500, v4), 1500 - iface::VXLAN_OVERHEAD);
        assert_eq!(tunnel_mtu_for(1500, v6), 1500 - iface::VXLAN_OVERHEAD_V6);
        assert_eq!(tunnel_mtu_for(10, v6), 0);
    }

    #[tokio::test]
    async fn a_missing_state_directory_fails_the_start_naming_it_and_the_flag() {
        let cfg = config();
        let Err(e) = start(&cfg).await else {
            panic!("started without a state directory");
        };
        let message = format!("{e:#}");
        assert!(
            message.starts_with("failed to read the state directory /nonexistent/egress-state")
                && message.contains("--state-dir"),
            "{message}"
        );
    }
}
