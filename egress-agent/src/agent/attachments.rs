//! Which program goes on which device: a pure decision over the desired state, this
//! pass's interfaces and routes (the acting part is `Datapath::sync_attachments`).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use egress_common::policy::{PodDeviceValue, pod_device_flags};
use ipnet::IpNet;

use super::UnknownPods;
use crate::{datapath::Attachment, desired::Desired, ebpf, iface};

/// What the decision needs of a route dump.
pub trait PodRoutes {
    /// The output interface the main table sends `ip` to.
    fn oif(&self, ip: IpAddr) -> Option<u32>;
    /// The destinations routed out of each interface (by ifindex).
    fn prefixes_by_oif(&self) -> &BTreeMap<u32, BTreeSet<IpNet>>;
}

impl PodRoutes for iface::Routes {
    fn oif(&self, ip: IpAddr) -> Option<u32> {
        iface::Routes::oif(self, ip)
    }

    fn prefixes_by_oif(&self) -> &BTreeMap<u32, BTreeSet<IpNet>> {
        iface::Routes::prefixes_by_oif(self)
    }
}

/// The tunnel device, by name and ifindex.
pub struct Tunnel<'a> {
    pub name: &'a str,
    pub ifindex: u32,
}

/// `--pod-devices`: how the agent finds the host side of each local pod's interface.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum PodDevices {
    /// The pod's host route where the CNI installs one, else the veth whose peer holds
    /// the pod's address, else Open vSwitch's port for the pod (when OVSDB's socket
    /// exists): right on Calico, Cilium, Flannel, the bridge plugin and OVN-Kubernetes.
    #[default]
    Auto,
    /// The device the main table's host route (/32, /128) to the pod leaves by (Calico).
    Routes,
    /// The veth whose peer, in another namespace, holds the pod's address.
    Veth,
    /// The OVS interface whose `external_ids:iface-id` is `<namespace>_<pod>`
    /// (OVN-Kubernetes).
    Ovs,
}

impl PodDevices {
    /// Whether the route dump finds pods' devices in this mode.
    pub fn by_routes(self) -> bool {
        matches!(self, Self::Auto | Self::Routes)
    }

    /// Whether the veths' peers are read in this mode.
    pub fn by_veth(self) -> bool {
        matches!(self, Self::Auto | Self::Veth)
    }

    /// Whether OVSDB is asked in this mode (`Auto`: when its socket exists).
    pub fn by_ovs(self) -> bool {
        matches!(self, Self::Auto | Self::Ovs)
    }
}

/// Pod devices found without routes, by one way ([`PodDevices::Veth`] or
/// [`PodDevices::Ovs`]): each local pod address and the host-side ifindexes it was found
/// behind (more than one is a problem the pass reports; each gets `from_pod`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Found {
    pub by_pod: BTreeMap<IpAddr, BTreeSet<u32>>,
}

impl Found {
    /// Pod devices from the veths' peers: each global address a peer holds, on that veth.
    pub fn from_veths(peers: &[iface::VethPeer]) -> Self {
        let mut found = Self::default();
        for p in peers {
            for ip in &p.addresses {
                found.by_pod.entry(*ip).or_default().insert(p.ifindex);
            }
        }
        found
    }

    /// Pod devices from Open vSwitch's ports: the port whose `iface-id` is
    /// `<namespace>_<name>` of a pod, for each of `pods` (namespace, name, addresses);
    /// `ifaces` gives the ports' ifindexes.
    pub fn from_ovs_ports(
        ports: &[iface::ovsdb::PodPort],
        pods: &[(&str, &str, &[IpAddr])],
        ifaces: &[iface::Interface],
    ) -> Self {
        let ids: BTreeMap<String, &[IpAddr]> = pods
            .iter()
            .map(|(ns, name, ips)| (format!("{ns}_{name}"), *ips))
            .collect();
        let mut found = Self::default();
        for port in ports {
            let (Some(ips), Some(i)) = (
                ids.get(&port.iface_id),
                ifaces.iter().find(|i| i.name == port.name),
            ) else {
                continue;
            };
            for ip in *ips {
                found.by_pod.entry(*ip).or_default().insert(i.ifindex);
            }
        }
        found
    }

    /// The devices of pods in `pod_cidrs` (any pod of a family without one): every pod
    /// device that `--unknown-pods drop` takes.
    fn devices(&self, pod_cidrs: &[IpNet]) -> BTreeSet<u32> {
        self.by_pod
            .iter()
            .filter(|(ip, _)| in_pod_cidrs(**ip, pod_cidrs))
            .flat_map(|(_, d)| d.iter().copied())
            .collect()
    }
}

/// Whether `ip` is in one of `pod_cidrs`, or `pod_cidrs` has none of its family.
fn in_pod_cidrs(ip: IpAddr, pod_cidrs: &[IpNet]) -> bool {
    let mut of_family = pod_cidrs.iter().filter(|c| same_family(c, ip)).peekable();
    of_family.peek().is_none() || of_family.any(|c| c.contains(&ip))
}

/// Whether `net` and `ip` are of one address family.
fn same_family(net: &IpNet, ip: IpAddr) -> bool {
    matches!(
        (net, ip),
        (IpNet::V4(_), IpAddr::V4(_)) | (IpNet::V6(_), IpAddr::V6(_))
    )
}

/// What this pass found pods' devices with: the route dump, the veths' peers, OVS's
/// ports, each `None` when not used (the mode) or failed this pass.
#[derive(Clone, Copy, Default)]
pub struct Finders<'a> {
    pub routes: Option<&'a dyn PodRoutes>,
    pub veth: Option<&'a Found>,
    pub ovs: Option<&'a Found>,
}

impl Finders<'_> {
    fn any(&self) -> bool {
        self.routes.is_some() || self.veth.is_some() || self.ovs.is_some()
    }
}

/// Whether the route dump alone finds every local selected pod's device: `--pod-devices
/// auto` then reads no veth peers and asks no OVSDB (a routed CNI, such as Calico).
pub fn routes_find_all(routes: &dyn PodRoutes, desired: &Desired, tunnel_ifindex: u32) -> bool {
    let devices = pod_devices(routes, &desired.pod_cidrs, tunnel_ifindex);
    desired.local_selected_pods().all(|pod| {
        routes.oif(pod).is_some_and(|oif| {
            is_routed_pod_device(pod, oif, routes, desired, &devices, tunnel_ifindex)
        })
    })
}

/// Whether `oif`, where the main table sends `pod`, is a pod device: not the tunnel,
/// and one of `devices` (those with pods' host routes) when the Node has a pod CIDR of
/// the pod's family; without one, when the route that takes `pod` there is its own host
/// route (/32, /128). A subnet's route (a bridge's, OVN-Kubernetes' management port's)
/// never makes a pod device.
fn is_routed_pod_device(
    pod: IpAddr,
    oif: u32,
    routes: &dyn PodRoutes,
    desired: &Desired,
    devices: &BTreeSet<u32>,
    tunnel_ifindex: u32,
) -> bool {
    let known = desired.pod_cidrs.iter().any(|c| same_family(c, pod));
    let host_route = || {
        routes
            .prefixes_by_oif()
            .get(&oif)
            .is_some_and(|p| p.contains(&IpNet::from(pod)))
    };
    oif != tunnel_ifindex
        && if known {
            devices.contains(&oif)
        } else {
            host_route()
        }
}

/// `from_tunnel` on the tunnel, `from_underlay` on the interface holding the node's IPv4
/// underlay address ([`underlay_interface`]), `from_secondary` on each egress interface present,
/// `from_pod` on each selected local pod's device, found by `finders` in turn: the device
/// its host route leaves by, when that is a pod device ([`pod_devices`]; never the
/// underlay a default route leaves by), else the veth whose peer holds it, else its OVS
/// port (and, with `--unknown-pods drop`, on every pod device any of them knows). Never
/// the tunnel, nor an egress interface. Returns the attachments and the problems found (a
/// selected pod without a device, a pod found behind two). Without any finder (each
/// failed this pass) no pod device is decided.
pub fn wanted(
    tunnel: &Tunnel<'_>,
    desired: &Desired,
    ifaces: &[iface::Interface],
    finders: Finders<'_>,
    unknown_pods: UnknownPods,
) -> (BTreeSet<Attachment>, Vec<String>) {
    let mut attach = BTreeSet::new();
    let mut problems = Vec::new();
    attach.insert(Attachment {
        program: ebpf::FROM_TUNNEL,
        ifname: tunnel.name.to_owned(),
        ifindex: tunnel.ifindex,
    });
    if let Some(i) = underlay_interface(desired, ifaces, tunnel) {
        attach.insert(Attachment {
            program: ebpf::FROM_UNDERLAY,
            ifname: i.name.clone(),
            ifindex: i.ifindex,
        });
    }
    for name in &desired.egress_interfaces {
        if let Some(i) = ifaces.iter().find(|i| &i.name == name) {
            attach.insert(Attachment {
                program: ebpf::FROM_SECONDARY,
                ifname: name.clone(),
                ifindex: i.ifindex,
            });
        }
    }
    if !finders.any() {
        return (attach, problems);
    }
    let pods = PodDeviceFinder::new(tunnel, desired, ifaces, finders);
    let mut pod_device = |oif: u32| {
        pods.usable.get(&oif).is_some_and(|i| {
            attach.insert(Attachment {
                program: ebpf::FROM_POD,
                ifname: i.name.clone(),
                ifindex: oif,
            });
            true
        })
    };
    for pod in desired.local_selected_pods() {
        let devices = pods.devices_of(pod);
        if devices.is_empty() {
            problems.push(no_device(pod, &finders));
            continue;
        }
        if devices.len() > 1 {
            problems.push(format!(
                "pod {pod}: its address is behind {} devices of this node; \
                 from_pod is on each",
                devices.len()
            ));
        }
        for d in devices {
            pod_device(d);
        }
    }
    if unknown_pods == UnknownPods::Drop {
        let found = [finders.veth, finders.ovs].into_iter().flatten();
        for oif in pods
            .routed
            .iter()
            .copied()
            .chain(found.flat_map(|f| f.devices(&desired.pod_cidrs)))
        {
            pod_device(oif);
        }
    }
    (attach, problems)
}

/// Where local pods' devices are, as this pass's finders say: the pod devices of the
/// route dump, and the interfaces `from_pod` may go on (never the tunnel nor an egress
/// interface), by ifindex.
struct PodDeviceFinder<'a> {
    finders: Finders<'a>,
    desired: &'a Desired,
    tunnel_ifindex: u32,
    routed: BTreeSet<u32>,
    usable: BTreeMap<u32, &'a iface::Interface>,
}

impl<'a> PodDeviceFinder<'a> {
    fn new(
        tunnel: &Tunnel<'_>,
        desired: &'a Desired,
        ifaces: &'a [iface::Interface],
        finders: Finders<'a>,
    ) -> Self {
        let usable = ifaces
            .iter()
            .filter(|i| i.ifindex != tunnel.ifindex && !desired.egress_interfaces.contains(&i.name))
            .map(|i| (i.ifindex, i))
            .collect();
        let routed = finders
            .routes
            .map(|r| pod_devices(r, &desired.pod_cidrs, tunnel.ifindex))
            .unwrap_or_default();
        Self {
            finders,
            desired,
            tunnel_ifindex: tunnel.ifindex,
            routed,
            usable,
        }
    }

    /// The devices `pod` is behind: the one its host route leaves by, when that is a pod
    /// device `from_pod` may go on ([`pod_devices`]; never the underlay a default route
    /// leaves by), else those of the veth whose peer holds it, else its OVS port's. Empty:
    /// not found.
    fn devices_of(&self, pod: IpAddr) -> BTreeSet<u32> {
        if let Some(r) = self.finders.routes
            && let Some(oif) = r.oif(pod)
            && is_routed_pod_device(pod, oif, r, self.desired, &self.routed, self.tunnel_ifindex)
            && self.usable.contains_key(&oif)
        {
            return BTreeSet::from([oif]);
        }
        [self.finders.veth, self.finders.ovs]
            .into_iter()
            .flatten()
            .find_map(|f| f.by_pod.get(&pod).filter(|d| !d.is_empty()))
            .cloned()
            .unwrap_or_default()
    }
}

/// The device each local pod's address is bound to (`POD_DEVICES_*`, `from_pod`'s source
/// check): every selected pod, and with `--unknown-pods drop` every pod the agent knows,
/// found behind exactly one device `from_pod` may go on ([`wanted`]'s way of finding it).
/// A pod behind several devices, or none, is left unbound: its packets are treated as
/// before the check existed (a pod cannot be pinned to a device the agent is unsure of).
/// Without any finder (each failed this pass) nothing is decided: `None`, and the last
/// bindings stay.
pub fn bindings(
    tunnel: &Tunnel<'_>,
    desired: &Desired,
    ifaces: &[iface::Interface],
    finders: Finders<'_>,
    unknown_pods: UnknownPods,
) -> Option<BTreeMap<IpAddr, u32>> {
    if !finders.any() {
        return None;
    }
    let pods = PodDeviceFinder::new(tunnel, desired, ifaces, finders);
    let known = (unknown_pods == UnknownPods::Drop).then_some(&desired.known_pods);
    let bound = desired
        .local_selected_pods()
        .chain(known.into_iter().flatten().copied())
        .filter_map(|pod| {
            let devices = pods.devices_of(pod);
            let mut it = devices.iter().copied();
            match (it.next(), it.next()) {
                (Some(d), None) if pods.usable.contains_key(&d) => Some((pod, d)),
                _ => None,
            }
        })
        .collect();
    Some(bound)
}

/// The problem of a selected pod whose device `finders` did not find.
fn no_device(pod: IpAddr, finders: &Finders<'_>) -> String {
    let mut tried = Vec::new();
    if finders.routes.is_some() {
        tried.push("no route to its device");
    }
    if finders.veth.is_some() {
        tried.push("no veth whose peer holds its address");
    }
    if finders.ovs.is_some() {
        tried.push("no Open vSwitch port with its iface-id");
    }
    format!(
        "pod {pod}: {} on this node (--pod-devices)",
        tried.join(", ")
    )
}

/// The devices the datapath looks routes up from, with its role on each: the tunnel device
/// (decapsulated packets), the IPv4 underlay (`from_underlay`'s decapsulation) and each
/// egress interface present (a gateway's lookups out of it and of replies arriving on it).
/// bpf_fib_lookup answers BPF_FIB_LKUP_RET_FWD_DISABLED when the lookup's device does not
/// forward (net/core/filter.c): forwarding is needed on these, and only these.
pub(super) fn forwarding_devices<'a>(
    tunnel: &Tunnel<'a>,
    desired: &'a Desired,
    ifaces: &'a [iface::Interface],
) -> Vec<(&'a str, &'static str)> {
    let mut out = vec![(tunnel.name, "tunnel device")];
    if let Some(i) = underlay_interface(desired, ifaces, tunnel) {
        out.push((i.name.as_str(), "underlay"));
    }
    for name in &desired.egress_interfaces {
        if ifaces.iter().any(|i| &i.name == name) {
            out.push((name.as_str(), "egress interface"));
        }
    }
    out
}

/// The interface that holds this node's IPv4 underlay address, where `from_underlay`
/// decapsulates our tunnel's packets before the tunnel device would (an IPv6 underlay
/// has none: the device decapsulates). Never the tunnel device itself, nor an egress
/// interface (whose ingress is `from_secondary`'s).
fn underlay_interface<'a>(
    desired: &Desired,
    ifaces: &'a [iface::Interface],
    tunnel: &Tunnel<'_>,
) -> Option<&'a iface::Interface> {
    let node @ IpAddr::V4(_) = desired.node_ip? else {
        return None;
    };
    ifaces.iter().find(|i| {
        i.ifindex != tunnel.ifindex
            && !desired.egress_interfaces.contains(&i.name)
            && i.addresses.iter().any(|(a, _)| *a == node)
    })
}

/// `bound` (pod -> its device's ifindex) as `POD_DEVICES_*` holds it: a device that
/// `ifaces` lists as a veth whose peer is in another namespace takes the pod's replies
/// into the pod ([`pod_device_flags::REPLY_TO_PEER`]); any other (an Open vSwitch
/// internal port, a device gone since) leaves them to the node's routing.
pub fn devices_of(
    bound: &BTreeMap<IpAddr, u32>,
    ifaces: &[iface::Interface],
) -> BTreeMap<IpAddr, PodDeviceValue> {
    let peers: BTreeSet<u32> = ifaces
        .iter()
        .filter(|i| i.pod_like)
        .map(|i| i.ifindex)
        .collect();
    bound
        .iter()
        .map(|(pod, &ifindex)| {
            let flags = if peers.contains(&ifindex) {
                pod_device_flags::REPLY_TO_PEER
            } else {
                0
            };
            (*pod, PodDeviceValue { ifindex, flags })
        })
        .collect()
}

/// The devices that pods of this node send from, as the CNI routes them: every device a
/// host route (/32, /128) inside one of the node's pod CIDRs leaves by, save the tunnel.
/// Pods the agent has not seen yet are routed there too (`--unknown-pods drop`).
pub fn pod_devices(
    routes: &dyn PodRoutes,
    pod_cidrs: &[IpNet],
    tunnel_ifindex: u32,
) -> BTreeSet<u32> {
    routes
        .prefixes_by_oif()
        .iter()
        .filter(|(oif, _)| **oif != tunnel_ifindex)
        .filter(|(_, prefixes)| {
            prefixes.iter().any(|p| {
                p.prefix_len() == p.max_prefix_len() && pod_cidrs.iter().any(|c| c.contains(p))
            })
        })
        .map(|(oif, _)| *oif)
        .collect()
}

/// How long a device `from_pod` went on at its `RTM_NEWLINK` stays attached without the
/// routes showing it as a pod device: the CNI adds the pod's host route right after the
/// device, and a device that never gets one is detached after this.
pub const NEW_DEVICE_GRACE: Duration = Duration::from_secs(60);

/// Devices `from_pod` went on at their `RTM_NEWLINK` (`--unknown-pods drop`), by ifindex:
/// name and when.
#[derive(Clone, Default)]
pub struct NewDevices(BTreeMap<u32, (String, Instant)>);

impl NewDevices {
    /// Whether `link` gets `from_pod` at once: a veth whose peer is in another namespace
    /// (a pod's, as a CNI makes it), neither the tunnel nor an egress interface.
    pub fn wants(link: &iface::NewLink, tunnel: &str, egress: &BTreeSet<String>) -> bool {
        link.pod_like && link.name != tunnel && !egress.contains(&link.name)
    }

    /// `link` got `from_pod`.
    pub fn note(&mut self, link: &iface::NewLink) {
        self.note_device(link.ifindex, &link.name, link.seen);
    }

    /// Device `name` (`ifindex`) got `from_pod` for a new pod at `since`.
    pub fn note_device(&mut self, ifindex: u32, name: &str, since: Instant) {
        self.0.insert(ifindex, (name.to_owned(), since));
    }

    /// The attachments to keep for new devices at `now`: each still there (same ifindex
    /// and name), without a global address, not an egress interface, within
    /// [`NEW_DEVICE_GRACE`]; the others are forgotten (the routes decide for them).
    pub fn still_wanted(
        &mut self,
        ifaces: &[iface::Interface],
        egress: &BTreeSet<String>,
        now: Instant,
    ) -> Vec<Attachment> {
        self.0.retain(|ifindex, (name, since)| {
            let present = ifaces.iter().any(|i| {
                i.ifindex == *ifindex
                    && i.name == *name
                    && !i.addresses.iter().any(|(a, _)| is_global(*a))
            });
            present && !egress.contains(name) && now.duration_since(*since) < NEW_DEVICE_GRACE
        });
        self.0
            .iter()
            .map(|(ifindex, (name, _))| Attachment {
                program: ebpf::FROM_POD,
                ifname: name.clone(),
                ifindex: *ifindex,
            })
            .collect()
    }
}

/// Not link-local (a pod device's only addresses, if any, are link-local).
fn is_global(a: IpAddr) -> bool {
    !iface::is_link_local(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Routes as a CNI like Calico leaves them on a node with pod CIDR 10.244.1.0/24:
    /// a /32 per pod on its veth (ifindex 10 + n), the other nodes' pod CIDRs and the
    /// default out of the underlay (2), the tunnel (3).
    struct Table {
        by_oif: BTreeMap<u32, BTreeSet<IpNet>>,
    }

    impl PodRoutes for Table {
        fn oif(&self, ip: IpAddr) -> Option<u32> {
            self.by_oif
                .iter()
                .filter_map(|(oif, ps)| {
                    ps.iter()
                        .filter(|p| p.contains(&ip))
                        .map(|p| (p.prefix_len(), *oif))
                        .max()
                })
                .max()
                .map(|(_, oif)| oif)
        }

        fn prefixes_by_oif(&self) -> &BTreeMap<u32, BTreeSet<IpNet>> {
            &self.by_oif
        }
    }

    fn table() -> Table {
        let nets = |v: &[&str]| v.iter().map(|s| s.parse().unwrap()).collect();
        Table {
            by_oif: BTreeMap::from([
                (2, nets(&["0.0.0.0/0", "10.244.2.0/24", "10.0.0.0/24"])),
                (11, nets(&["10.244.1.11/32"])),
                (12, nets(&["10.244.1.12/32"])),
                (13, nets(&["10.244.1.13/32"])),
            ]),
        }
    }

    fn iface(name: &str, ifindex: u32) -> iface::Interface {
        iface::Interface::up_for_test(name, ifindex, &[])
    }

    fn ifaces() -> Vec<iface::Interface> {
        vec![
            iface("eth0", 2),
            iface("egress0", 3),
            iface("ens224", 4),
            iface("cali11", 11),
            iface("cali12", 12),
            iface("cali13", 13),
        ]
    }

    fn desired() -> Desired {
        let mut d = Desired::default();
        d.v4.selected.insert("10.244.1.11".parse().unwrap(), 1);
        d.egress_interfaces.insert("ens224".to_owned());
        d.egress_interfaces.insert("ens999".to_owned());
        d.pod_cidrs = vec!["10.244.1.0/24".parse().unwrap()];
        d
    }

    fn routes(t: &Table) -> Finders<'_> {
        Finders {
            routes: Some(t),
            ..Finders::default()
        }
    }

    const TUNNEL: Tunnel<'static> = Tunnel {
        name: "egress0",
        ifindex: 3,
    };

    fn names(a: &BTreeSet<Attachment>) -> Vec<String> {
        a.iter()
            .map(|a| format!("{}@{}", a.program, a.ifname))
            .collect()
    }

    /// What `wanted` gives for the tunnel, `desired()`, `ifaces()` and `table()`.
    fn wanted_here(unknown_pods: UnknownPods) -> (BTreeSet<Attachment>, Vec<String>) {
        wanted(
            &TUNNEL,
            &desired(),
            &ifaces(),
            routes(&table()),
            unknown_pods,
        )
    }

    #[test]
    fn the_tunnel_the_egress_interfaces_present_and_the_selected_pods_devices() {
        let (a, problems) = wanted_here(UnknownPods::Pass);
        let mut got = names(&a);
        got.sort();
        assert_eq!(
            got,
            [
                "from_pod@cali11",
                "from_secondary@ens224",
                "from_tunnel@egress0"
            ]
        );
        assert!(problems.is_empty(), "{problems:?}");
    }

    #[test]
    fn the_interface_with_the_nodes_ipv4_underlay_address_takes_from_underlay() {
        let mut i = ifaces();
        i[0] = iface::Interface::up_for_test("eth0", 2, &[("10.0.0.5", 24)]);
        let mut d = desired();
        d.node_ip = Some("10.0.0.5".parse().unwrap());
        let (a, _) = wanted(&TUNNEL, &d, &i, routes(&table()), UnknownPods::Pass);
        assert!(
            names(&a).contains(&"from_underlay@eth0".to_owned()),
            "{a:?}"
        );
        // No address known, an address nowhere, an IPv6 underlay (the device
        // decapsulates), or the address on an egress interface: none.
        let underlay = |d: &Desired, i: &[iface::Interface]| {
            let (a, _) = wanted(&TUNNEL, d, i, routes(&table()), UnknownPods::Pass);
            names(&a)
                .into_iter()
                .filter(|n| n.starts_with("from_underlay"))
                .collect::<Vec<_>>()
        };
        assert!(underlay(&desired(), &i).is_empty());
        d.node_ip = Some("10.0.0.6".parse().unwrap());
        assert!(underlay(&d, &i).is_empty());
        let mut v6 = ifaces();
        v6[0] = iface::Interface::up_for_test("eth0", 2, &[("fd00::5", 64)]);
        d.node_ip = Some("fd00::5".parse().unwrap());
        assert!(underlay(&d, &v6).is_empty());
        let mut sec = ifaces();
        sec[2] = iface::Interface::up_for_test("ens224", 4, &[("10.0.0.5", 24)]);
        d.node_ip = Some("10.0.0.5".parse().unwrap());
        assert!(underlay(&d, &sec).is_empty());
    }

    #[test]
    fn unknown_pods_drop_also_takes_every_pod_device_and_nothing_else() {
        let (a, _) = wanted_here(UnknownPods::Drop);
        let pods: Vec<String> = names(&a)
            .into_iter()
            .filter(|n| n.starts_with("from_pod"))
            .collect();
        assert_eq!(
            pods,
            ["from_pod@cali11", "from_pod@cali12", "from_pod@cali13"]
        );
    }

    /// Each selected pod is bound to the one device it was found behind, and under
    /// `--unknown-pods drop` each known pod too; a pod behind two devices, or none, is
    /// left unbound, and without any finder nothing is decided.
    #[test]
    fn pods_are_bound_to_the_one_device_they_are_found_behind() {
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let mut d = desired();
        d.known_pods = ["10.244.1.11", "10.244.1.12", "10.244.1.13", "10.244.1.77"]
            .map(ip)
            .into();
        let t = table();
        let bound = |d: &Desired, f: Finders<'_>, u| bindings(&TUNNEL, d, &ifaces(), f, u);
        assert_eq!(
            bound(&d, routes(&t), UnknownPods::Pass),
            Some(BTreeMap::from([(ip("10.244.1.11"), 11)])),
            "selected pods only"
        );
        assert_eq!(
            bound(&d, routes(&t), UnknownPods::Drop),
            Some(BTreeMap::from([
                (ip("10.244.1.11"), 11),
                (ip("10.244.1.12"), 12),
                (ip("10.244.1.13"), 13),
            ])),
            "and every known pod found (10.244.1.77 has no device: unbound)"
        );
        // Found by its veth behind two devices (from_pod is on both, the binding on
        // neither), or only behind an egress interface (never bound there): unbound.
        for devices in [BTreeSet::from([11, 12]), BTreeSet::from([4])] {
            let found = Found {
                by_pod: BTreeMap::from([(ip("10.244.1.11"), devices)]),
            };
            let veth_only = Finders {
                veth: Some(&found),
                ..Finders::default()
            };
            assert_eq!(
                bound(&d, veth_only, UnknownPods::Pass),
                Some(BTreeMap::new())
            );
        }
        assert_eq!(bound(&d, Finders::default(), UnknownPods::Drop), None);
    }

    #[test]
    fn a_pod_of_a_family_without_a_pod_cidr_takes_its_own_host_route() {
        let mut t = table();
        t.by_oif
            .entry(14)
            .or_default()
            .insert("fd00:244:1::14/128".parse().unwrap());
        let mut d = desired();
        d.v6.selected.insert("fd00:244:1::14".parse().unwrap(), 1);
        let mut i = ifaces();
        i.push(iface("cali14", 14));
        let (a, problems) = wanted(&TUNNEL, &d, &i, routes(&t), UnknownPods::Pass);
        assert!(names(&a).contains(&"from_pod@cali14".to_owned()), "{a:?}");
        assert!(problems.is_empty(), "{problems:?}");
    }

    #[test]
    fn a_selected_pod_without_a_route_is_a_problem_and_no_dump_decides_no_pod_device() {
        let mut d = desired();
        d.v4.selected.insert("10.244.1.99".parse().unwrap(), 1);
        let (_, problems) = wanted(&TUNNEL, &d, &ifaces(), routes(&table()), UnknownPods::Pass);
        assert_eq!(
            problems,
            ["pod 10.244.1.99: no route to its device on this node (--pod-devices)"],
            "routed by the default route out of eth0: not a pod device"
        );
        let (a, problems) = wanted(
            &TUNNEL,
            &d,
            &ifaces(),
            Finders::default(),
            UnknownPods::Drop,
        );
        assert_eq!(names(&a).len(), 2, "tunnel and ens224 only: {a:?}");
        assert!(problems.is_empty());
    }

    /// A node wired like OVN-Kubernetes or the bridge plugin: no host route per pod, the
    /// pod CIDR on the bridge (ifindex 5). The veths' peers hold the pods' addresses.
    fn bridged() -> (Table, Vec<iface::Interface>, Vec<iface::VethPeer>) {
        let nets = |v: &[&str]| v.iter().map(|s| s.parse().unwrap()).collect();
        let table = Table {
            by_oif: BTreeMap::from([
                (2, nets(&["0.0.0.0/0", "10.0.0.0/24"])),
                (5, nets(&["10.244.1.0/24"])),
            ]),
        };
        let mut i = ifaces();
        i.push(iface("cni0", 5));
        i.push(iface("vethb1", 21));
        i.push(iface("vethb2", 22));
        i.push(iface("vethx", 23));
        let peer = |ifindex, name: &str, ips: &[&str]| iface::VethPeer {
            ifindex,
            name: name.to_owned(),
            addresses: ips.iter().map(|s| s.parse().unwrap()).collect(),
        };
        let peers = vec![
            peer(21, "vethb1", &["10.244.1.11", "fd00:244:1::11"]),
            peer(22, "vethb2", &["10.244.1.12"]),
            // Some other namespace's veth (not a pod of this node's CIDR).
            peer(23, "vethx", &["192.168.50.2"]),
            peer(3, "egress0", &["10.244.1.13"]),
        ];
        (table, i, peers)
    }

    #[test]
    fn without_host_routes_the_veth_whose_peer_holds_the_pod_is_its_device() {
        let (t, i, peers) = bridged();
        let found = Found::from_veths(&peers);
        let both = Finders {
            routes: Some(&t),
            veth: Some(&found),
            ovs: None,
        };
        let (a, problems) = wanted(&TUNNEL, &desired(), &i, both, UnknownPods::Pass);
        let pods: Vec<String> = names(&a)
            .into_iter()
            .filter(|n| n.starts_with("from_pod"))
            .collect();
        assert_eq!(
            pods,
            ["from_pod@vethb1"],
            "never cni0, where its route goes"
        );
        assert!(problems.is_empty(), "{problems:?}");
        assert!(!routes_find_all(&t, &desired(), TUNNEL.ifindex));
        // Routes alone: the pod's route is the bridge's subnet route, not a pod device.
        let (_, problems) = wanted(&TUNNEL, &desired(), &i, routes(&t), UnknownPods::Pass);
        assert_eq!(
            problems,
            ["pod 10.244.1.11: no route to its device on this node (--pod-devices)"]
        );
        // Without a pod CIDR on the Node, the bridge's subnet route is still no pod
        // device (the veth is).
        let mut bare = desired();
        bare.pod_cidrs.clear();
        let (a, _) = wanted(&TUNNEL, &bare, &i, both, UnknownPods::Pass);
        assert!(!names(&a).contains(&"from_pod@cni0".to_owned()), "{a:?}");
        assert!(names(&a).contains(&"from_pod@vethb1".to_owned()), "{a:?}");
        // --unknown-pods drop: every veth whose peer holds an address of the pod CIDR,
        // never another namespace's veth nor the tunnel.
        let (a, _) = wanted(&TUNNEL, &desired(), &i, both, UnknownPods::Drop);
        let pods: Vec<String> = names(&a)
            .into_iter()
            .filter(|n| n.starts_with("from_pod"))
            .collect();
        assert_eq!(pods, ["from_pod@vethb1", "from_pod@vethb2"]);
    }

    #[test]
    fn an_ovs_port_is_the_device_of_the_pod_its_iface_id_names() {
        let (_, mut i, _) = bridged();
        i.push(iface("a1b2c3d4e5f6a7b", 30));
        i.push(iface("9f8e7d6c5b4a392", 31));
        let ports = [
            iface::ovsdb::PodPort {
                name: "a1b2c3d4e5f6a7b".into(),
                iface_id: "shop_web".into(),
            },
            iface::ovsdb::PodPort {
                name: "9f8e7d6c5b4a392".into(),
                iface_id: "shop_gone".into(),
            },
            iface::ovsdb::PodPort {
                name: "not-here".into(),
                iface_id: "shop_db".into(),
            },
        ];
        let web: Vec<IpAddr> = vec!["10.244.1.11".parse().unwrap()];
        let db: Vec<IpAddr> = vec!["10.244.1.12".parse().unwrap()];
        let found =
            Found::from_ovs_ports(&ports, &[("shop", "web", &web), ("shop", "db", &db)], &i);
        assert_eq!(
            found.by_pod,
            BTreeMap::from([(web[0], BTreeSet::from([30]))]),
            "a port without a pod, a pod without a present port: nothing"
        );
        let ovs = Finders {
            ovs: Some(&found),
            ..Finders::default()
        };
        let (a, problems) = wanted(&TUNNEL, &desired(), &i, ovs, UnknownPods::Pass);
        assert!(names(&a).contains(&"from_pod@a1b2c3d4e5f6a7b".to_owned()));
        assert!(problems.is_empty(), "{problems:?}");
        let mut d = desired();
        d.v4.selected.insert("10.244.1.12".parse().unwrap(), 1);
        let (_, problems) = wanted(&TUNNEL, &d, &i, ovs, UnknownPods::Pass);
        assert_eq!(
            problems,
            [
                "pod 10.244.1.12: no Open vSwitch port with its iface-id on this node \
              (--pod-devices)"
            ]
        );
    }

    #[test]
    fn a_pod_address_behind_two_devices_is_a_problem_and_both_get_from_pod() {
        let (_, i, mut peers) = bridged();
        peers[1].addresses.push("10.244.1.11".parse().unwrap());
        let found = Found::from_veths(&peers);
        let veth = Finders {
            veth: Some(&found),
            ..Finders::default()
        };
        let (a, problems) = wanted(&TUNNEL, &desired(), &i, veth, UnknownPods::Pass);
        assert!(names(&a).contains(&"from_pod@vethb2".to_owned()));
        assert!(names(&a).contains(&"from_pod@vethb1".to_owned()));
        assert_eq!(problems.len(), 1, "{problems:?}");
    }

    /// Replies go into a pod only through a veth whose peer is elsewhere: an Open vSwitch
    /// internal port, or a device no longer listed, leaves them to the node's routing.
    #[test]
    fn only_a_pod_like_device_takes_replies_into_its_pod() {
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let veth = iface::Interface {
            pod_like: true,
            ..iface("veth1", 11)
        };
        let bound = BTreeMap::from([
            (ip("10.244.1.11"), 11),
            (ip("10.244.1.12"), 12),
            (ip("10.244.1.13"), 13),
        ]);
        let devices = devices_of(&bound, &[veth, iface("ovn-port", 12)]);
        let flags: Vec<(u32, u32)> = devices.values().map(|d| (d.ifindex, d.flags)).collect();
        assert_eq!(
            flags,
            [(11, pod_device_flags::REPLY_TO_PEER), (12, 0), (13, 0)]
        );
    }

    #[test]
    fn a_new_pod_like_device_is_kept_until_it_goes_or_the_grace_ends() {
        let egress: BTreeSet<String> = ["sec-a".to_owned()].into();
        let pod = iface::NewLink::for_test(20, "cali-new", true);
        assert!(NewDevices::wants(&pod, "egress0", &egress));
        assert!(!NewDevices::wants(
            &iface::NewLink::for_test(21, "dummy0", false),
            "egress0",
            &egress
        ));
        assert!(!NewDevices::wants(
            &iface::NewLink::for_test(3, "sec-a", true),
            "egress0",
            &egress
        ));
        assert!(!NewDevices::wants(
            &iface::NewLink::for_test(4, "egress0", true),
            "egress0",
            &egress
        ));
        let mut d = NewDevices::default();
        d.note(&pod);
        let now = Instant::now();
        let there = [iface("cali-new", 20)];
        assert_eq!(d.still_wanted(&there, &egress, now).len(), 1);
        // Past the grace: forgotten.
        assert!(
            d.clone()
                .still_wanted(&there, &egress, now + NEW_DEVICE_GRACE)
                .is_empty()
        );
        // Gone, or another device at its ifindex: forgotten.
        assert!(
            d.still_wanted(&[iface("other", 20)], &egress, now)
                .is_empty()
        );
    }
}
