//! Which program goes on which device: a pure decision over the desired state, this
//! pass's interfaces and routes (the acting part is `Datapath::sync_attachments`).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

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

/// `from_tunnel` on the tunnel, `from_underlay` on the interface holding the node's IPv4
/// underlay address ([`underlay_interface`]), `from_secondary` on each egress interface present,
/// `from_pod` on the device each selected local pod is routed to, when that device is a
/// pod device ([`pod_devices`]; never the underlay a default route leaves by) (and, with
/// `--unknown-pods drop`, on every pod device: [`pod_devices`]). Returns the attachments
/// and the problems found (a selected pod without a route to its device). Without a route
/// dump (`routes` is `None`: it failed this pass) no pod device is decided.
pub fn wanted(
    tunnel: &Tunnel<'_>,
    desired: &Desired,
    ifaces: &[iface::Interface],
    routes: Option<&dyn PodRoutes>,
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
    let Some(routes) = routes else {
        return (attach, problems);
    };
    let by_index: BTreeMap<u32, &iface::Interface> =
        ifaces.iter().map(|i| (i.ifindex, i)).collect();
    let mut pod_device = |oif: u32| {
        if let Some(i) = by_index.get(&oif) {
            attach.insert(Attachment {
                program: ebpf::FROM_POD,
                ifname: i.name.clone(),
                ifindex: oif,
            });
        }
    };
    let devices = pod_devices(routes, &desired.pod_cidrs, tunnel.ifindex);
    // Without a pod CIDR of the pod's family on its Node, any device but the tunnel is
    // taken at its word.
    let is_pod_device = |pod: IpAddr, oif: u32| {
        let known = desired.pod_cidrs.iter().any(|c| {
            matches!(
                (c, pod),
                (IpNet::V4(_), IpAddr::V4(_)) | (IpNet::V6(_), IpAddr::V6(_))
            )
        });
        oif != tunnel.ifindex && (!known || devices.contains(&oif))
    };
    for pod in desired.local_selected_pods() {
        match routes.oif(pod) {
            Some(oif) if is_pod_device(pod, oif) => pod_device(oif),
            _ => problems.push(format!("pod {pod}: no route to its device on this node")),
        }
    }
    if unknown_pods == UnknownPods::Drop {
        for oif in devices {
            pod_device(oif);
        }
    }
    (attach, problems)
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
    match a {
        IpAddr::V4(a) => !a.is_link_local(),
        IpAddr::V6(a) => !a.is_unicast_link_local(),
    }
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
        wanted(&TUNNEL, &desired(), &ifaces(), Some(&table()), unknown_pods)
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
        let (a, _) = wanted(&TUNNEL, &d, &i, Some(&table()), UnknownPods::Pass);
        assert!(
            names(&a).contains(&"from_underlay@eth0".to_owned()),
            "{a:?}"
        );
        // No address known, an address nowhere, an IPv6 underlay (the device
        // decapsulates), or the address on an egress interface: none.
        let underlay = |d: &Desired, i: &[iface::Interface]| {
            let (a, _) = wanted(&TUNNEL, d, i, Some(&table()), UnknownPods::Pass);
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

    #[test]
    fn a_pod_of_a_family_without_a_pod_cidr_takes_its_route_at_its_word() {
        let mut t = table();
        t.by_oif
            .entry(14)
            .or_default()
            .insert("fd00:244:1::14/128".parse().unwrap());
        let mut d = desired();
        d.v6.selected.insert("fd00:244:1::14".parse().unwrap(), 1);
        let mut i = ifaces();
        i.push(iface("cali14", 14));
        let (a, problems) = wanted(&TUNNEL, &d, &i, Some(&t), UnknownPods::Pass);
        assert!(names(&a).contains(&"from_pod@cali14".to_owned()), "{a:?}");
        assert!(problems.is_empty(), "{problems:?}");
    }

    #[test]
    fn a_selected_pod_without_a_route_is_a_problem_and_no_dump_decides_no_pod_device() {
        let mut d = desired();
        d.v4.selected.insert("10.244.1.99".parse().unwrap(), 1);
        let (_, problems) = wanted(&TUNNEL, &d, &ifaces(), Some(&table()), UnknownPods::Pass);
        assert_eq!(
            problems,
            ["pod 10.244.1.99: no route to its device on this node"],
            "routed by the default route out of eth0: not a pod device"
        );
        let (a, problems) = wanted(&TUNNEL, &d, &ifaces(), None, UnknownPods::Drop);
        assert_eq!(names(&a).len(), 2, "tunnel and ens224 only: {a:?}");
        assert!(problems.is_empty());
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
