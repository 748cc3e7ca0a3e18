//! This node's pod devices as a pass and the events between passes find them: `from_pod`
//! at a new link's RTM_NEWLINK or the CNI plugin's ADD, and each pass's route dump, veth
//! peers and OVS ports, turned into attachments by [`super::attachments`].

use std::{net::IpAddr, sync::Arc, time::Instant};

use tracing::{info, warn};

use super::{Reconciler, RunConfig, UnknownPods, attachments, early, early::Early};
use crate::{
    api::PreflightCheck,
    datapath::{self, Datapath},
    desired::Desired,
    iface,
    source::ClusterView,
};

/// This node's pod devices: what a pass finds and attaches, and what `from_pod` went on
/// between passes (a new link, the CNI plugin's ADD).
pub(super) struct Devices<'a> {
    cfg: &'a RunConfig,
    tunnel_ifindex: u32,
    /// Devices `from_pod` went on at their RTM_NEWLINK or the CNI plugin's ADD, kept
    /// until their routes make them pod devices.
    new_devices: attachments::NewDevices,
    /// New links' `from_pod` attached off this thread, and the egress interfaces of the
    /// last pass (never a pod device).
    early: Arc<Early>,
}

impl Reconciler<'_> {
    /// This pass's route dump (kept for the EgressNode; the underlay's routes checked
    /// against the peers' addresses), then the pod devices found and attached for what
    /// `serving` needs ([`Devices::sync`]).
    pub(super) async fn sync_devices(
        &mut self,
        dp: &mut Datapath,
        view: &ClusterView,
        serving: &Desired,
        ifaces: &[iface::Interface],
        problems: &mut Vec<String>,
    ) {
        let routes = match self.nl.routes(&self.cfg.route_tables).await {
            Ok(routes) => {
                self.publisher.routes_dumped(routes.prefixes_by_oif());
                Some(routes)
            }
            Err(e) => {
                problems.push(format!("routes: {e}"));
                None
            }
        };
        if let Some(routes) = &routes
            && let Some((astray, check)) =
                underlay_astray(view, &self.cfg.node_name, serving.node_ip, ifaces, routes)
        {
            problems.extend(astray);
            // The EgressNode's preflight line says what is true now, not at start.
            self.publisher.set_preflight(check);
        }
        let found = (view, serving, ifaces, routes.as_ref());
        self.devices.sync(&self.nl, dp, found, problems).await;
    }
}

/// What a pass finds pod devices from: the cluster, what it serves, the interfaces and
/// its route dump (none when the dump failed).
type Sources<'s> = (
    &'s ClusterView,
    &'s Desired,
    &'s [iface::Interface],
    Option<&'s iface::Routes>,
);

impl<'a> Devices<'a> {
    /// No device attached between passes yet; `tunnel_ifindex`: the tunnel's; `early`
    /// shared with the task that attaches new links as they appear.
    pub(super) fn new(cfg: &'a RunConfig, tunnel_ifindex: u32, early: Arc<Early>) -> Self {
        Self {
            cfg,
            tunnel_ifindex,
            new_devices: attachments::NewDevices::default(),
            early,
        }
    }

    /// The agent's configuration.
    pub(super) fn cfg(&self) -> &'a RunConfig {
        self.cfg
    }

    /// What the new-link task attached since last asked: noted as new devices (kept
    /// like those attached here) and adopted by `dp`; returned for this pass's set.
    fn adopt_early(
        &mut self,
        dp: &mut Datapath,
        early: &mut super::early::Inner,
    ) -> Vec<datapath::Attachment> {
        let taken = early.take();
        let mut adopted = Vec::with_capacity(taken.len());
        for (a, since) in taken {
            self.new_devices.note_device(a.ifindex, &a.ifname, since);
            dp.adopt(a.clone());
            adopted.push(a);
        }
        adopted
    }

    /// Find this pass's pod devices (routes, veth peers, OVS ports, as `--pod-devices`
    /// says) and attach what it serves.
    async fn sync(
        &mut self,
        nl: &iface::Netlink,
        dp: &mut Datapath,
        (view, serving, ifaces, routes): Sources<'_>,
        problems: &mut Vec<String>,
    ) {
        let (veth, ovs) = self
            .find_pod_devices(nl, view, serving, ifaces, routes, problems)
            .await;
        let finders = attachments::Finders {
            routes: routes
                .filter(|_| self.cfg.pod_devices.by_routes())
                .map(|r| r as &dyn attachments::PodRoutes),
            veth: veth.as_ref(),
            ovs: ovs.as_ref(),
        };
        self.sync_attachments(dp, serving, ifaces, finders, problems);
    }

    /// Whether a new link gets `from_pod` at once: under `--unknown-pods drop`, a
    /// pod-like one that is neither the tunnel nor an egress interface.
    fn wants(&self, link: &iface::NewLink) -> bool {
        self.cfg.unknown_pods == UnknownPods::Drop && self.early.lock().wants(link)
    }

    /// A link appeared: under `--unknown-pods drop`, a pod-like one gets `from_pod` now,
    /// before the pod can send and before the agent knows the pod (the next pass keeps it
    /// while its routes make it a pod device, [`attachments::NEW_DEVICE_GRACE`] at most
    /// without them).
    pub(super) fn on_new_link(&mut self, dp: &mut Datapath, link: &iface::NewLink) {
        let early = Arc::clone(&self.early);
        self.adopt_early(dp, &mut early.lock());
        if !self.wants(link) {
            return;
        }
        let a = early::attachment(link);
        let queued = link.seen.elapsed();
        match dp.attach_one(&a) {
            Ok(attached) => {
                self.new_devices.note(link);
                if attached {
                    early::log_attached(link, queued);
                }
            }
            Err(e) => warn!(device = %link.name, "failed to attach to a new device: {e}"),
        }
    }

    /// The CNI plugin's `ADD` (or `CHECK`) for a pod: `from_pod` on the host side of its
    /// interface now (kept like a new device's, [`attachments::NEW_DEVICE_GRACE`] at most
    /// until its routes make it a pod device), or whether it is there.
    pub(super) async fn on_cni(
        &mut self,
        nl: &iface::Netlink,
        dp: &mut Datapath,
        req: &crate::cni::Request,
    ) -> crate::cni::Reply {
        let t0 = Instant::now();
        let fail = |e: String| crate::cni::Reply {
            error: Some(e),
            ..Default::default()
        };
        let ifindex = match &req.host_device {
            Some(d) => d.ifindex,
            // A plugin older than `host_device`: look the device up in the pod's namespace,
            // as before (this takes CAP_SYS_ADMIN, which the DaemonSet does not grant).
            None => match host_side_in_pod_netns(req).await {
                Ok(i) => i,
                Err(e) => return fail(e),
            },
        };
        let ifaces = match nl.interfaces().await {
            Ok(i) => i,
            Err(e) => return fail(e.to_string()),
        };
        let device = match cni_device(req, &ifaces, ifindex) {
            Ok(d) => d,
            Err(e) => return fail(e),
        };
        let a = datapath::Attachment {
            program: crate::ebpf::FROM_POD,
            ifname: device.name.clone(),
            ifindex,
        };
        let early = Arc::clone(&self.early);
        self.adopt_early(dp, &mut early.lock());
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

    /// Pods' devices found without routes, as `--pod-devices` says: the veths' peers and
    /// OVS's ports (each `None` when not asked, or failed: the failure is a problem).
    /// `auto` asks neither when the route dump finds every selected pod and unknown pods
    /// pass (a routed CNI), and OVSDB only when its socket exists.
    async fn find_pod_devices(
        &self,
        nl: &iface::Netlink,
        view: &ClusterView,
        desired: &Desired,
        ifaces: &[iface::Interface],
        routes: Option<&iface::Routes>,
        problems: &mut Vec<String>,
    ) -> (Option<attachments::Found>, Option<attachments::Found>) {
        use attachments::Found;
        let mode = self.cfg.pod_devices;
        let routes_find_all =
            routes.map(|r| attachments::routes_find_all(r, desired, self.tunnel_ifindex));
        if !beyond_routes(mode, self.cfg.unknown_pods, routes_find_all) {
            return (None, None);
        }
        let veth = if mode.by_veth() {
            match nl.veth_peers().await {
                Ok(peers) => Some(Found::from_veths(&peers)),
                Err(e) => {
                    problems.push(format!("pod devices (--pod-devices {mode:?}): {e}"));
                    None
                }
            }
        } else {
            None
        };
        let ovs = if asks_ovsdb(mode, self.cfg.ovsdb.exists()) {
            match iface::ovsdb::pod_ports(&self.cfg.ovsdb).await {
                Ok(ports) => {
                    let me = Some(self.cfg.node_name.as_str());
                    let pods: Vec<(&str, &str, &[IpAddr])> = view
                        .pods
                        .iter()
                        .filter(|p| p.node_name.as_deref() == me && !p.host_network)
                        .map(|p| (&*p.namespace, p.name.as_str(), p.ips.as_slice()))
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
        // Held until the attachments are synced: what the new-link task attaches
        // meanwhile waits, and what it attached before is in this pass's set.
        let early = Arc::clone(&self.early);
        let mut early = early.lock();
        let (mut attach, found) =
            attachments::wanted(&tunnel, desired, ifaces, finders, self.cfg.unknown_pods);
        if let Some(bound) =
            attachments::bindings(&tunnel, desired, ifaces, finders, self.cfg.unknown_pods)
        {
            Self::bind_pods(dp, &bound, ifaces, problems);
        }
        for (dev, role) in attachments::forwarding_devices(&tunnel, desired, ifaces) {
            if let Err(e) = super::start::ensure_forwarding(dev, role) {
                problems.push(e);
            }
        }
        attach.extend(self.new_devices.still_wanted(
            ifaces,
            &desired.egress_interfaces,
            Instant::now(),
        ));
        // After the grace check: `ifaces` was listed before a device attached since.
        attach.extend(self.adopt_early(dp, &mut early));
        problems.extend(found);
        for e in dp.sync_attachments(&attach) {
            problems.push(e.to_string());
        }
        let prog = (self.cfg.unknown_pods == UnknownPods::Drop)
            .then(|| dp.program_fd(crate::ebpf::FROM_POD))
            .flatten()
            .map(|fd| (fd, dp.hook()));
        early.update(&desired.egress_interfaces, prog);
    }
}

impl Devices<'_> {
    /// Write this pass's bindings of pods to their devices (`POD_DEVICES_*`) where
    /// they changed, each marked for replies into the pod when its device is a veth
    /// whose peer is in another namespace (`Interface::pod_like`); a failed write is a
    /// problem, and the next pass tries again.
    fn bind_pods(
        dp: &mut Datapath,
        bound: &std::collections::BTreeMap<IpAddr, u32>,
        ifaces: &[iface::Interface],
        problems: &mut Vec<String>,
    ) {
        match dp.apply_pod_devices(&attachments::devices_of(bound, ifaces)) {
            Ok(st) => problems.extend(st.problems()),
            Err(e) => problems.push(format!("failed to bind pods to their devices: {e}")),
        }
    }
}

/// The host side of a CNI request's pod interface, looked up in the pod's namespace
/// (a request from a plugin that does not name it).
async fn host_side_in_pod_netns(req: &crate::cni::Request) -> Result<u32, String> {
    let (netns, ifname) = (req.netns.clone(), req.ifname.clone());
    tokio::task::spawn_blocking(move || crate::cni::host_side(&netns, &ifname))
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r)
        .map_err(|e| {
            format!(
                "{e} (the plugin did not name the host device: an egress-cni older than \
                 this agent; reinstall it with install-cni, as the DaemonSet's init \
                 container does)"
            )
        })
}

/// Whether `--pod-devices` `mode` looks for pods' devices beyond the route dump (veth
/// peers, OVS ports): `auto` does not when the dump (`routes_find_all`: whether it finds
/// every selected pod; `None`: it failed) finds every selected pod and unknown pods pass.
fn beyond_routes(
    mode: attachments::PodDevices,
    unknown_pods: UnknownPods,
    routes_find_all: Option<bool>,
) -> bool {
    use attachments::PodDevices;
    match (mode, routes_find_all) {
        (PodDevices::Routes, _) => false,
        (PodDevices::Auto, Some(all)) => unknown_pods == UnknownPods::Drop || !all,
        _ => true,
    }
}

/// Whether `--pod-devices` `mode` asks OVSDB for its ports: `ovs` always, `auto` when
/// the socket exists.
fn asks_ovsdb(mode: attachments::PodDevices, socket_exists: bool) -> bool {
    mode == attachments::PodDevices::Ovs || (mode.by_ovs() && socket_exists)
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

/// The device a CNI request names (or, from an older plugin, `ifindex` found in the pod's
/// namespace), as this agent's namespace has it: the ifindex must exist and, when the
/// plugin named it, carry the same name (else it went, or another took its number).
fn cni_device<'a>(
    req: &crate::cni::Request,
    ifaces: &'a [iface::Interface],
    ifindex: u32,
) -> Result<&'a iface::Interface, String> {
    let Some(device) = ifaces.iter().find(|i| i.ifindex == ifindex) else {
        return Err(format!(
            "failed to find the host side of {} in {} (ifindex {ifindex}): no such device in \
             this agent's network namespace (is the agent in the host's, hostNetwork?)",
            req.ifname,
            req.netns.display()
        ));
    };
    match &req.host_device {
        Some(named) if named.name != device.name => Err(format!(
            "failed to find the host side of {} in {}: the plugin found {} at ifindex \
             {ifindex}, which is {} here",
            req.ifname,
            req.netns.display(),
            named.name,
            device.name
        )),
        _ => Ok(device),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::{agent::tests::config, cni};

    #[test]
    fn only_unknown_pods_drop_attaches_a_new_pod_device_before_the_pass() {
        let mut cfg = config();
        let veth = iface::NewLink::for_test(9, "veth9", true);
        let early = || Arc::new(Early::new(PathBuf::from("/sys/fs/bpf/none"), "egress0"));
        assert!(
            !Devices::new(&cfg, 3, early()).wants(&veth),
            "--unknown-pods pass"
        );
        cfg.unknown_pods = UnknownPods::Drop;
        let devices = Devices::new(&cfg, 3, early());
        assert!(devices.wants(&veth));
        assert!(!devices.wants(&iface::NewLink::for_test(4, "eth1", false)));
        assert!(!devices.wants(&iface::NewLink::for_test(3, "egress0", true)));
        devices.early.lock().egress_mut().insert("veth9".to_owned());
        assert!(
            !devices.wants(&veth),
            "an egress interface is never a pod device"
        );
    }

    #[test]
    fn auto_looks_beyond_the_routes_only_when_they_do_not_find_every_pod() {
        use attachments::PodDevices::{Auto, Ovs, Routes, Veth};
        let (pass, drop) = (UnknownPods::Pass, UnknownPods::Drop);
        assert!(!beyond_routes(Auto, pass, Some(true)));
        assert!(beyond_routes(Auto, pass, Some(false)));
        assert!(
            beyond_routes(Auto, drop, Some(true)),
            "new pods have no route yet"
        );
        assert!(beyond_routes(Auto, pass, None), "the dump failed");
        assert!(!beyond_routes(Routes, drop, None));
        assert!(beyond_routes(Veth, pass, Some(true)));
        assert!(beyond_routes(Ovs, pass, Some(true)));
        assert!(asks_ovsdb(Ovs, false));
        assert!(asks_ovsdb(Auto, true) && !asks_ovsdb(Auto, false));
        assert!(!asks_ovsdb(Veth, true) && !asks_ovsdb(Routes, true));
    }

    fn request(host_device: Option<(&str, u32)>) -> cni::Request {
        cni::Request {
            netns: PathBuf::from("/var/run/netns/pod"),
            ifname: "eth0".to_owned(),
            container_id: "c0".to_owned(),
            check: false,
            host_device: host_device.map(|(name, ifindex)| cni::HostDevice {
                name: name.to_owned(),
                ifindex,
            }),
        }
    }

    #[test]
    fn a_cni_request_names_a_device_this_namespace_has_under_that_name() {
        let ifaces = [iface::Interface::up_for_test("veth5", 5, &[])];
        let named = request(Some(("veth5", 5)));
        assert_eq!(cni_device(&named, &ifaces, 5).unwrap().name, "veth5");
        assert_eq!(
            cni_device(&request(None), &ifaces, 5).unwrap().name,
            "veth5"
        );
        let renamed = request(Some(("veth6", 5)));
        let e = cni_device(&renamed, &ifaces, 5).unwrap_err();
        assert!(
            e.contains("the plugin found veth6 at ifindex 5, which is veth5 here"),
            "{e}"
        );
        let e = cni_device(&named, &ifaces, 6).unwrap_err();
        assert!(e.contains("(ifindex 6): no such device"), "{e}");
    }
}
