//! `egress-agent run`: the reconcile loop. Cluster view in, desired state out (pure
//! compiler), then maps, addresses and attachments brought in line. Every step logs
//! and counts its own failures; one bad object or interface never stops the rest.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use tracing::{debug, info, warn};

use crate::{
    api::{EgressNode, EgressNodeSpec, EgressNodeStatus, HeldEgressIp, NodeInterface},
    compiler,
    datapath::{self, Attachment, Datapath, MapState},
    ebpf, iface,
    metrics::{self, Stats},
    source::{ClusterView, kube as kube_source, yaml},
};

/// Where cluster state comes from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A directory of Kubernetes-shaped YAML documents; our EgressNode is written there.
    Yaml(PathBuf),
    /// The Kubernetes API (in cluster, or this kubeconfig).
    Kube { kubeconfig: Option<PathBuf> },
}

/// Where this node's EgressNode, policy statuses and events go.
enum Sink {
    Yaml(PathBuf),
    Kube(::kube::Client),
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
}

/// VXLAN over IPv4: outer IPv4 (20) + UDP (8) + VXLAN (8) + inner Ethernet (14).
const VXLAN_OVERHEAD: u32 = 50;
/// VXLAN over IPv6: the outer header is 40 bytes instead of 20.
const VXLAN_OVERHEAD_V6: u32 = 70;

/// MTU inside the tunnel for an underlay of `node_ip`'s family.
fn tunnel_mtu_for(underlay_mtu: u32, node_ip: IpAddr) -> u32 {
    let overhead = match node_ip {
        IpAddr::V4(_) => VXLAN_OVERHEAD,
        IpAddr::V6(_) => VXLAN_OVERHEAD_V6,
    };
    underlay_mtu.saturating_sub(overhead)
}

pub async fn run(cfg: RunConfig) -> Result<()> {
    // Containers often see /proc/sys read-only: then the node must already forward
    // (every CNI that routes pods enables it).
    if let Err(e) = iface::sysctl("net/ipv4/conf/all/forwarding", "1") {
        warn!("failed to enable IPv4 forwarding (the node must have it on): {e}");
    }
    // IPv6 pods: best effort, as hosts without IPv6 have no such sysctl.
    if let Err(e) = iface::sysctl("net/ipv6/conf/all/forwarding", "1") {
        debug!("failed to enable IPv6 forwarding (IPv6 pods need it on): {e}");
    }
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
    let tunnel_mtu = cfg.tunnel_mtu.unwrap_or(underlay_mtu - VXLAN_OVERHEAD);
    let tunnel_ifindex = nl
        .ensure_vxlan(&cfg.tunnel_device, cfg.tunnel_port, tunnel_mtu)
        .await
        .with_context(|| format!("failed to set up the tunnel device {}", cfg.tunnel_device))?;
    let mut dp = Datapath::open(&cfg.bpffs_dir)
        .with_context(|| format!("failed to open the datapath at {}", cfg.bpffs_dir.display()))?;
    info!(
        node = %cfg.node_name,
        tunnel = %cfg.tunnel_device,
        tunnel_ifindex,
        tunnel_mtu,
        pins = %cfg.bpffs_dir.display(),
        adopted = dp.held().policy_v4.len() + dp.held().pod_owner_v4.len(),
        "agent started"
    );
    let stats = Arc::new(Mutex::new(Stats::default()));
    if let Some(addr) = cfg.metrics_addr {
        metrics::serve(addr, cfg.bpffs_dir.clone(), stats.clone()).await?;
    }
    let (mut views, sink) = match &cfg.source {
        Source::Yaml(dir) => (
            // inotify tells of edits at once; the poll is a safety net.
            yaml::watch(dir.clone(), Duration::from_secs(1)).await,
            Sink::Yaml(dir.clone()),
        ),
        Source::Kube { kubeconfig } => {
            let client = kube_source::client(kubeconfig.clone()).await?;
            (
                kube_source::watch(client.clone()).await?,
                Sink::Kube(client),
            )
        }
    };
    let mut changes = iface::Netlink::subscribe_changes().await?;
    let mut tick = tokio::time::interval(cfg.resync);
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut r = Reconciler {
        cfg: &cfg,
        nl,
        tunnel_ifindex,
        tunnel_mtu,
        underlay_mtu,
        sink,
        last_node_doc: None,
        last_holders: BTreeMap::new(),
        announced: BTreeSet::new(),
        added: BTreeSet::new(),
    };
    loop {
        let trigger = tokio::select! {
            res = views.changed() => {
                if res.is_err() {
                    anyhow::bail!("the state source stopped");
                }
                "state"
            }
            _ = changes.recv() => "netlink",
            _ = tick.tick() => "resync",
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
        };
        // Coalesce bursts of netlink events (our own address changes cause some).
        while changes.try_recv().is_ok() {}
        // Shared with the source, not copied (a copy of 10k Pods is tens of MiB).
        let snap = Arc::clone(&views.borrow_and_update());
        let source_errors: Vec<String> = snap.errors.iter().map(ToString::to_string).collect();
        let t0 = Instant::now();
        let outcome = r.reconcile(&mut dp, &snap.view).await;
        let took = t0.elapsed();
        let mut s = stats.lock().unwrap_or_else(|e| e.into_inner());
        s.reconciles += 1;
        s.last_reconcile = took;
        s.source_errors = source_errors.len();
        for e in &source_errors {
            debug!("state: {e}");
        }
        match outcome {
            Ok(o) => {
                s.ready = true;
                s.holders = o.holders;
                s.problems = o.problems.len();
                if o.changed > 0 || trigger == "state" {
                    info!(
                        trigger,
                        changed = o.changed,
                        took_ms = took.as_secs_f64() * 1e3,
                        "reconciled"
                    );
                }
            }
            Err(e) => {
                s.errors += 1;
                warn!("failed to reconcile: {e:#}");
            }
        }
    }
    info!("agent stopping; maps and links stay pinned for the next agent");
    Ok(())
}

struct Outcome {
    changed: usize,
    holders: Vec<(String, String, String)>,
    problems: Vec<String>,
}

struct Reconciler<'a> {
    cfg: &'a RunConfig,
    nl: iface::Netlink,
    tunnel_ifindex: u32,
    tunnel_mtu: u32,
    /// The largest MTU of the node's up interfaces, for the default `tunnel_mtu`.
    underlay_mtu: u32,
    sink: Sink,
    last_node_doc: Option<EgressNode>,
    /// Egress IP -> (node, interface) as of the last pass, to report moves.
    last_holders: BTreeMap<IpAddr, (String, String)>,
    announced: BTreeSet<IpAddr>,
    /// Egress IPs (both families) this agent added to an interface.
    added: BTreeSet<IpAddr>,
}

impl Reconciler<'_> {
    async fn reconcile(&mut self, dp: &mut Datapath, view: &ClusterView) -> Result<Outcome> {
        let ifaces = self.nl.interfaces().await?;
        let compiled = compiler::compile(view, &self.cfg.node_name);
        let desired = &compiled.desired;
        let mut problems: Vec<String> = compiled.problems.iter().map(|p| p.to_string()).collect();
        let mut changed = 0;

        // 1. This node's configuration.
        if let Some(node_ip) = desired.node_ip {
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
            );
            if dp.config().ok() != Some(want) {
                dp.set_config(&want)?;
                changed += 1;
            }
        } else {
            problems.push(format!(
                "node {}: no Node object with an InternalIP address: not configured",
                self.cfg.node_name
            ));
        }

        // 2. Egress addresses: add what we hold, remove policy egress IPs we no longer hold.
        let by_name: BTreeMap<&str, &iface::Interface> =
            ifaces.iter().map(|i| (i.name.as_str(), i)).collect();
        // Addresses this agent may remove: egress IPs that a policy names now, that this
        // node published as held (also by an earlier agent), or that we added.
        let mut all_egress_ips = all_policy_egress_ips(view);
        all_egress_ips.extend(self.added.iter().copied());
        all_egress_ips.extend(
            view.egress_nodes
                .iter()
                .filter(|n| n.metadata.name.as_deref() == Some(self.cfg.node_name.as_str()))
                .filter_map(|n| n.status.as_ref())
                .flat_map(|s| s.egress_ips.iter())
                .filter_map(|h| h.ip.parse::<IpAddr>().ok()),
        );
        let mut held = Vec::new();
        let dedicated = desired
            .egress_ips_v4
            .iter()
            .map(|(ip, h)| (IpAddr::V4(*ip), h))
            .chain(
                desired
                    .egress_ips_v6
                    .iter()
                    .map(|(ip, h)| (IpAddr::V6(*ip), h)),
            )
            .filter(|(_, h)| !h.shared);
        for (ip, h) in dedicated {
            let Some(i) = by_name.get(h.interface.as_str()) else {
                continue;
            };
            let present = i.addresses.iter().any(|(a, _)| *a == ip);
            if !present {
                // IPv6 goes without DAD (the address moves between gateways).
                match self.nl.add_address(i.ifindex, ip, h.prefix_len).await {
                    Ok(()) => {
                        changed += 1;
                        self.added.insert(ip);
                        info!(%ip, interface = %h.interface, "holding egress IP");
                    }
                    Err(e) => {
                        problems.push(format!("egress IP {ip}: {e}"));
                        continue;
                    }
                }
            }
            // Gratuitous ARP for IPv4, unsolicited neighbour advertisement for IPv6.
            if let Some(mac) = i.mac
                && self.announced.insert(ip)
            {
                let ifindex = i.ifindex;
                tokio::spawn(async move {
                    if let Err(e) =
                        iface::announce(ifindex, mac, ip, 3, Duration::from_millis(500)).await
                    {
                        warn!("failed to announce {ip}: {e}");
                    }
                });
            }
            held.push(HeldEgressIp {
                ip: ip.to_string(),
                interface: h.interface.clone(),
            });
        }
        for i in &ifaces {
            for (a, len) in &i.addresses {
                let held_here = match a {
                    IpAddr::V4(a) => desired.egress_ips_v4.get(a),
                    IpAddr::V6(a) => desired.egress_ips_v6.get(a),
                };
                let ours = held_here.is_some_and(|h| !h.shared && h.interface == i.name);
                if all_egress_ips.contains(a) && !ours {
                    match self.nl.del_address(i.ifindex, *a, *len).await {
                        Ok(()) => {
                            changed += 1;
                            self.announced.remove(a);
                            self.added.remove(a);
                            info!(ip = %a, interface = %i.name, "released egress IP");
                        }
                        Err(e) => problems.push(format!("egress IP {a}: {e}")),
                    }
                }
            }
        }

        // 3. Publish what this node offers and holds.
        let doc = egress_node_doc(
            &self.cfg.node_name,
            desired.node_ip,
            &ifaces,
            &self.cfg.tunnel_device,
            held,
        );
        if self.last_node_doc.as_ref() != Some(&doc) {
            match &self.sink {
                Sink::Yaml(dir) => {
                    yaml::write_egress_node(dir, &doc).with_context(|| {
                        format!("failed to publish EgressNode {}", self.cfg.node_name)
                    })?;
                }
                Sink::Kube(c) => kube_source::publish_egress_node(c, &doc).await?,
            }
            self.last_node_doc = Some(doc);
        }
        self.report(view, &compiled).await;

        // 4. Maps.
        let ifindex = |n: &str| by_name.get(n).map(|i| i.ifindex);
        let (want, unresolved) = MapState::from_desired(desired, ifindex);
        problems.extend(unresolved.iter().map(ToString::to_string));
        let st = dp.apply(&want)?;
        changed += st.changed();
        if st.failed > 0 {
            problems.push(format!("{} map writes failed (see log)", st.failed));
        }

        // 5. Attachments: the tunnel, egress interfaces, and the device each selected
        //    local pod is routed to.
        let mut attach = BTreeSet::new();
        attach.insert(Attachment {
            program: ebpf::FROM_TUNNEL,
            ifname: self.cfg.tunnel_device.clone(),
            ifindex: self.tunnel_ifindex,
        });
        for name in &desired.egress_interfaces {
            if let Some(i) = by_name.get(name.as_str()) {
                attach.insert(Attachment {
                    program: ebpf::FROM_SECONDARY,
                    ifname: name.clone(),
                    ifindex: i.ifindex,
                });
            }
        }
        let by_index: BTreeMap<u32, &iface::Interface> =
            ifaces.iter().map(|i| (i.ifindex, i)).collect();
        let routes = match self.nl.routes().await {
            Ok(r) => Some(r),
            Err(e) => {
                problems.push(format!("pod devices: {e}"));
                None
            }
        };
        for pod in desired.local_selected_pods() {
            let Some(routes) = &routes else { break };
            match routes.oif(pod) {
                Some(oif) if oif != self.tunnel_ifindex => {
                    if let Some(i) = by_index.get(&oif) {
                        attach.insert(Attachment {
                            program: ebpf::FROM_POD,
                            ifname: i.name.clone(),
                            ifindex: oif,
                        });
                    }
                }
                _ => problems.push(format!("pod {pod}: no route to its device on this node")),
            }
        }
        for e in dp.sync_attachments(&attach) {
            problems.push(e.to_string());
        }
        for p in &problems {
            debug!("problem: {p}");
        }
        let holders = compiled
            .holders
            .iter()
            .map(|h| (h.ip.to_string(), h.node.clone(), h.interface.clone()))
            .collect();
        Ok(Outcome {
            changed,
            holders,
            problems,
        })
    }
}

impl Reconciler<'_> {
    /// Policy status and holder moves: logged always; written to the API (statuses,
    /// Events) by one agent only, the one on the first Ready node by name, so that
    /// agents whose views differ for a moment do not fight over the status.
    async fn report(&mut self, view: &ClusterView, compiled: &compiler::Compiled) {
        let writer = view
            .nodes
            .iter()
            .filter(|n| compiler::node_ready(n))
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
        for (ip, (node, ifc)) in &now {
            match self.last_holders.get(ip) {
                Some((old, _)) if old != node => moves.push((
                    *ip,
                    format!("egress IP {ip} moved from {old} to {node} ({ifc})"),
                )),
                None if !self.last_holders.is_empty() => {
                    moves.push((*ip, format!("egress IP {ip} assigned to {node} ({ifc})")))
                }
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
        let Sink::Kube(client) = &self.sink else {
            return;
        };
        if !writer {
            return;
        }
        for (name, status) in &compiled.statuses {
            if let Err(e) = kube_source::publish_policy_status(client, name, status).await {
                warn!("{e}");
            }
        }
        for (ip, msg) in moves {
            let policy = compiled
                .holders
                .iter()
                .find(|h| h.ip == ip)
                .map(|h| h.policy.clone());
            if let Some(policy) = policy
                && let Err(e) = kube_source::record_event(
                    client,
                    &policy,
                    &self.cfg.node_name,
                    kube_source::EventType::Normal,
                    "EgressIPMoved",
                    &msg,
                )
                .await
            {
                warn!("{e}");
            }
        }
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

fn egress_node_doc(
    name: &str,
    underlay: Option<IpAddr>,
    ifaces: &[iface::Interface],
    tunnel: &str,
    held: Vec<HeldEgressIp>,
) -> EgressNode {
    let interfaces = ifaces
        .iter()
        .filter(|i| i.name != "lo" && i.name != tunnel && !i.addresses.is_empty())
        .map(|i| NodeInterface {
            name: i.name.clone(),
            up: i.up,
            addresses: i
                .addresses
                .iter()
                // Our own egress IPs are not part of the inventory.
                .filter(|(a, _)| !held.iter().any(|h| h.ip == a.to_string()))
                .map(|(a, l)| format!("{a}/{l}"))
                .collect(),
        })
        .collect();
    let mut doc = EgressNode::new(
        name,
        EgressNodeSpec {
            underlay_ip: underlay.map(|u| u.to_string()),
        },
    );
    doc.status = Some(EgressNodeStatus {
        interfaces,
        egress_ips: held,
    });
    doc
}
