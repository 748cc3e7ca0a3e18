//! The agent's interface layer: the tunnel device, the interface and address inventory,
//! egress addresses, route lookups and change notifications over rtnetlink; gratuitous ARP
//! and unsolicited neighbour advertisements over a packet socket; sysctl writes.
//!
//! Every socket acts in the network namespace of the thread that opens it:
//! [`Netlink::new`] and [`Netlink::subscribe_changes`] bind to the namespace of their caller,
//! [`announce`] to that of the thread that first polls it. The agent runs in one namespace,
//! so this only matters to tests, which give each case a private namespace.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fs::OpenOptions,
    io::{self, Write as _},
    mem,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
    time::Duration,
};

use futures::{StreamExt as _, TryStreamExt as _};
use ipnet::IpNet;
use rtnetlink::{
    Handle, LinkMessageBuilder, LinkUnspec, LinkVxlan, MulticastGroup, RouteMessageBuilder,
    packet_route::{
        AddressFamily,
        address::{AddressAttribute, AddressHeaderFlags, AddressMessage},
        link::{
            InfoData, InfoKind, InfoVxlan, LinkAttribute, LinkFlags, LinkInfo, LinkMessage, State,
        },
        route::{
            RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteNextHopFlags, RouteType,
        },
    },
};
use tokio::sync::mpsc;

/// Errors of the interface layer. Each names the object (interface, address, sysctl) and
/// carries the kernel's or the caller's detail in its message.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kernel refused a request, or a system call failed.
    #[error("failed to {verb} {object}: {error}")]
    Os {
        verb: &'static str,
        object: String,
        error: io::Error,
    },
    /// A netlink exchange failed without an errno (connection closed, unparsable reply).
    #[error("failed to {verb} {object}: {error}")]
    Netlink {
        verb: &'static str,
        object: String,
        error: rtnetlink::Error,
    },
    /// What the kernel holds is not what was asked for, and this layer does not overwrite
    /// state it did not create.
    #[error("failed to {verb} {object}: {detail}")]
    Conflict {
        verb: &'static str,
        object: String,
        detail: String,
    },
    /// The request itself cannot be valid.
    #[error("failed to {verb} {object}: {detail}")]
    Invalid {
        verb: &'static str,
        object: String,
        detail: String,
    },
}

impl Error {
    /// The errno behind an [`Error::Os`], if any.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Self::Os { error, .. } => error.raw_os_error(),
            _ => None,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Map an rtnetlink error to ours, turning kernel NACKs into plain errno errors.
fn netlink_error(verb: &'static str, object: String, error: rtnetlink::Error) -> Error {
    match error {
        rtnetlink::Error::NetlinkError(message) => Error::Os {
            verb,
            object,
            error: message.to_io(),
        },
        error => Error::Netlink {
            verb,
            object,
            error,
        },
    }
}

/// The errno of a kernel NACK.
fn errno(error: &rtnetlink::Error) -> Option<i32> {
    match error {
        rtnetlink::Error::NetlinkError(message) => Some(message.raw_code().abs()),
        _ => None,
    }
}

/// One network interface as [`Netlink::interfaces`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub ifindex: u32,
    /// Administratively up (`IFF_UP`) and not operationally down (oper state neither
    /// `down`, `lowerlayerdown` nor `notpresent`; `unknown`, as dummy, vxlan and loopback
    /// devices report, counts as up).
    pub up: bool,
    pub mtu: u32,
    /// The hardware address, when it is an Ethernet one (six bytes).
    pub mac: Option<[u8; 6]>,
    /// IPv4 and IPv6 addresses with their prefix lengths, as [`Netlink::add_address`] and
    /// [`Netlink::del_address`] take them.
    pub addresses: Vec<(IpAddr, u8)>,
}

/// An rtnetlink connection on the network namespace of the thread that created it.
#[derive(Debug, Clone)]
pub struct Netlink {
    handle: Handle,
}

impl Netlink {
    /// Open the connection and spawn its task on the current tokio runtime.
    pub fn new() -> Result<Self> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| Error::Os {
            verb: "start",
            object: "the rtnetlink connection".into(),
            error: io::Error::other(e),
        })?;
        let (connection, handle, _) = rtnetlink::new_connection().map_err(|error| Error::Os {
            verb: "open",
            object: "an rtnetlink socket".into(),
            error,
        })?;
        runtime.spawn(connection);
        Ok(Self { handle })
    }

    /// Create (or adopt, if it exists with the right kind) the collect-metadata ("external")
    /// VXLAN device `name` with UDP destination port `port`, learning off, MTU `mtu`, and set
    /// it up. Returns its ifindex.
    ///
    /// A device of that name that is not an external vxlan device on `port` with learning
    /// off is an error naming it: this never deletes or reconfigures a foreign device.
    pub async fn ensure_vxlan(&self, name: &str, port: u16, mtu: u32) -> Result<u32> {
        let object = || format!("vxlan device {name}");
        check_ifname(name).map_err(|detail| Error::Invalid {
            verb: "create",
            object: object(),
            detail,
        })?;
        // Look up, create when absent, look up again: a device created concurrently by
        // someone else (EEXIST on create) is judged like any existing one.
        for _ in 0..3 {
            if let Some(link) = self.link_by_name(name).await? {
                if let Some(detail) = vxlan_mismatch(&link, port) {
                    return Err(Error::Conflict {
                        verb: "adopt",
                        object: object(),
                        detail,
                    });
                }
                let index = link.header.index;
                let change = LinkUnspec::new_with_index(index).mtu(mtu).up().build();
                self.handle
                    .link()
                    .change(change)
                    .execute()
                    .await
                    .map_err(|e| netlink_error("configure", object(), e))?;
                return Ok(index);
            }
            let create = LinkMessageBuilder::<LinkVxlan>::new(name)
                .collect_metadata(true)
                .port(port)
                .learning(false)
                .mtu(mtu)
                .up()
                .build();
            match self.handle.link().add(create).execute().await {
                Ok(()) => {}
                Err(e) if errno(&e) == Some(libc::EEXIST) => {}
                Err(e) => return Err(netlink_error("create", object(), e)),
            }
        }
        // EEXIST while no device has the name: the kernel allows one external vxlan device
        // per UDP port (and address family), and another one holds this port.
        Err(Error::Conflict {
            verb: "create",
            object: object(),
            detail: format!(
                "the kernel reports that it exists, but no device has that name: another \
                 external vxlan device probably holds UDP port {port}"
            ),
        })
    }

    /// All interfaces with their state and addresses.
    pub async fn interfaces(&self) -> Result<Vec<Interface>> {
        let links = self.links().await?;
        let addresses: Vec<AddressMessage> = self
            .handle
            .address()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(|e| netlink_error("list", "addresses".into(), e))?;
        let mut interfaces: Vec<Interface> = links.iter().map(interface_of).collect();
        let position: HashMap<u32, usize> = interfaces
            .iter()
            .enumerate()
            .map(|(i, iface)| (iface.ifindex, i))
            .collect();
        for address in &addresses {
            if let (Some(&i), Some(net)) =
                (position.get(&address.header.index), address_of(address))
                && let Some(iface) = interfaces.get_mut(i)
            {
                iface.addresses.push(net);
            }
        }
        Ok(interfaces)
    }

    /// The ifindex of the interface called `name`, None if there is none.
    pub async fn ifindex(&self, name: &str) -> Result<Option<u32>> {
        check_ifname(name).map_err(|detail| Error::Invalid {
            verb: "look up",
            object: format!("interface {name}"),
            detail,
        })?;
        Ok(self.link_by_name(name).await?.map(|link| link.header.index))
    }

    /// Delete the vxlan device `name` (the agent's tunnel, for `egress-agent cleanup`);
    /// Ok(false) when there is none. A device of that name of another kind is an error
    /// naming it, and is left alone.
    pub async fn delete_vxlan(&self, name: &str) -> Result<bool> {
        let object = || format!("vxlan device {name}");
        check_ifname(name).map_err(|detail| Error::Invalid {
            verb: "remove",
            object: object(),
            detail,
        })?;
        let Some(link) = self.link_by_name(name).await? else {
            return Ok(false);
        };
        let vxlan = link.attributes.iter().any(|a| {
            matches!(a, LinkAttribute::LinkInfo(infos)
                if infos.iter().any(|i| matches!(i, LinkInfo::Kind(InfoKind::Vxlan))))
        });
        if !vxlan {
            return Err(Error::Conflict {
                verb: "remove",
                object: object(),
                detail: "a device of that name exists but is not a vxlan device; left alone".into(),
            });
        }
        match self.handle.link().del(link.header.index).execute().await {
            Ok(()) => Ok(true),
            Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(false),
            Err(e) => Err(netlink_error("remove", object(), e)),
        }
    }

    /// Every vxlan device with its UDP port: which one holds a port (`egress-agent doctor`).
    pub async fn vxlan_ports(&self) -> Result<Vec<(String, u16)>> {
        let links = self.links().await?;
        let infos = |link: &LinkMessage| -> Vec<LinkInfo> {
            link.attributes
                .iter()
                .find_map(|a| match a {
                    LinkAttribute::LinkInfo(infos) => Some(infos.clone()),
                    _ => None,
                })
                .unwrap_or_default()
        };
        Ok(links
            .iter()
            .filter_map(|link| {
                let port = infos(link).into_iter().find_map(|i| match i {
                    LinkInfo::Data(InfoData::Vxlan(data)) => data.iter().find_map(|d| match d {
                        InfoVxlan::Port(p) => Some(*p),
                        _ => None,
                    }),
                    _ => None,
                })?;
                Some((interface_of(link).name, port))
            })
            .collect())
    }

    async fn links(&self) -> Result<Vec<LinkMessage>> {
        self.handle
            .link()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(|e| netlink_error("list", "interfaces".into(), e))
    }

    async fn link_by_name(&self, name: &str) -> Result<Option<LinkMessage>> {
        let found: Result<Vec<LinkMessage>, _> = self
            .handle
            .link()
            .get()
            .match_name(name)
            .execute()
            .try_collect()
            .await;
        match found {
            Ok(links) => Ok(links.into_iter().next()),
            Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(netlink_error("look up", format!("interface {name}"), e)),
        }
    }

    /// Add `ip/prefix_len` to `ifindex`; Ok if it is already there with that prefix length.
    ///
    /// IPv6 addresses are added without duplicate address detection: egress IPs move between
    /// gateways on failover, and DAD would keep the moved address tentative (no use as a
    /// source, nothing to announce) for a second or more, or dead for good if the previous
    /// holder still answered. The agents decide ownership; DAD has nothing to add.
    pub async fn add_address(&self, ifindex: u32, ip: IpAddr, prefix_len: u8) -> Result<()> {
        let object = || format!("address {ip}/{prefix_len} to ifindex {ifindex}");
        IpNet::new(ip, prefix_len).map_err(|e| Error::Invalid {
            verb: "add",
            object: object(),
            detail: e.to_string(),
        })?;
        let mut request = self.handle.address().add(ifindex, ip, prefix_len);
        if ip.is_ipv6() {
            request.message_mut().header.flags |= AddressHeaderFlags::Nodad;
        }
        match request.execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(libc::EEXIST) => {
                // IPv6 also answers EEXIST for the same address with another prefix length:
                // say so rather than report success.
                let present = self.addresses_on(ifindex).await?;
                if present.contains(&(ip, prefix_len)) {
                    Ok(())
                } else if let Some((_, other)) = present.iter().find(|(a, _)| *a == ip) {
                    Err(Error::Conflict {
                        verb: "add",
                        object: object(),
                        detail: format!("the interface already holds it as {ip}/{other}"),
                    })
                } else {
                    Err(netlink_error("add", object(), e))
                }
            }
            Err(e) => Err(netlink_error("add", object(), e)),
        }
    }

    /// Remove `ip/prefix_len` from `ifindex`; Ok if it is not there. An unknown ifindex is
    /// an error (it points at a stale inventory).
    pub async fn del_address(&self, ifindex: u32, ip: IpAddr, prefix_len: u8) -> Result<()> {
        let object = || format!("address {ip}/{prefix_len} from ifindex {ifindex}");
        IpNet::new(ip, prefix_len).map_err(|e| Error::Invalid {
            verb: "remove",
            object: object(),
            detail: e.to_string(),
        })?;
        let message = match ip {
            IpAddr::V4(v4) => rtnetlink::AddressMessageBuilder::<Ipv4Addr>::new()
                .index(ifindex)
                .address(v4, prefix_len)
                .build(),
            IpAddr::V6(v6) => rtnetlink::AddressMessageBuilder::<Ipv6Addr>::new()
                .index(ifindex)
                .address(v6, prefix_len)
                .build(),
        };
        match self.handle.address().del(message).execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(libc::EADDRNOTAVAIL) => Ok(()),
            Err(e) => Err(netlink_error("remove", object(), e)),
        }
    }

    async fn addresses_on(&self, ifindex: u32) -> Result<Vec<(IpAddr, u8)>> {
        let messages: Vec<AddressMessage> = self
            .handle
            .address()
            .get()
            .set_link_index_filter(ifindex)
            .execute()
            .try_collect()
            .await
            .map_err(|e| netlink_error("list", format!("addresses of ifindex {ifindex}"), e))?;
        Ok(messages.iter().filter_map(address_of).collect())
    }

    /// The output interface that the main routing table sends `ip` to: longest-prefix match
    /// over a dump of that family's routes, ties broken by the lowest metric. None when no
    /// route matches or the best match does not forward (blackhole, unreachable, ...).
    ///
    /// Policy routing rules and other tables are deliberately ignored: this answers "which
    /// interface do the gateway's own (installer or NMState) routes pick", not how a given
    /// packet would be routed.
    pub async fn route_oif(&self, ip: IpAddr) -> Result<Option<u32>> {
        Ok(self.routes(&[]).await?.oif(ip))
    }

    /// One dump of the routes of both families, for [`Routes::oif`] on many addresses
    /// (the agent resolves every local selected pod on each pass: a dump per pod made a
    /// pass at 10k pods cost 10k dumps of 10k routes) and for
    /// [`Routes::prefixes_by_oif`], which reads the main table and `extra_tables`.
    pub async fn routes(&self, extra_tables: &[u32]) -> Result<Routes> {
        let mut dump: Vec<RouteMessage> = Vec::new();
        for query in [
            RouteMessageBuilder::<Ipv4Addr>::new().build(),
            RouteMessageBuilder::<Ipv6Addr>::new().build(),
        ] {
            let part: Vec<RouteMessage> = self
                .handle
                .route()
                .get(query)
                .execute()
                .try_collect()
                .await
                .map_err(|e| netlink_error("list", "routes".to_owned(), e))?;
            dump.extend(part);
        }
        Ok(Routes::from_dump(&dump, extra_tables))
    }

    /// Subscribe to link, IPv4/IPv6 address and IPv4/IPv6 route changes on a second
    /// rtnetlink connection. The receiver ticks (coalesced: at most one pending tick) after
    /// any change, and after a socket overrun (notifications were lost); the agent then
    /// resyncs. It yields None if the subscription dies; dropping it ends the subscription.
    pub async fn subscribe_changes() -> Result<mpsc::Receiver<()>> {
        let groups = [
            MulticastGroup::Link,
            MulticastGroup::Ipv4Ifaddr,
            MulticastGroup::Ipv4Route,
            MulticastGroup::Ipv6Ifaddr,
            MulticastGroup::Ipv6Route,
        ];
        let (connection, _handle, mut messages) = rtnetlink::new_multicast_connection(&groups)
            .map_err(|error| Error::Os {
                verb: "subscribe to",
                object: "link, address and route notifications".into(),
                error,
            })?;
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            let forward = async {
                loop {
                    tokio::select! {
                        message = messages.next() => match message {
                            // Full means a tick is already pending: this change is covered.
                            Some(_) => {
                                let _ = tx.try_send(());
                            }
                            None => break,
                        },
                        () = tx.closed() => break,
                    }
                }
            };
            tokio::select! {
                () = connection => {}
                () = forward => {}
            }
        });
        Ok(rx)
    }
}

/// Why `link` is not an external vxlan device on `port` with learning off; None if it is.
fn vxlan_mismatch(link: &LinkMessage, port: u16) -> Option<String> {
    let infos = link
        .attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::LinkInfo(infos) => Some(infos.as_slice()),
            _ => None,
        })
        .unwrap_or_default();
    match infos.iter().find_map(|i| match i {
        LinkInfo::Kind(kind) => Some(kind),
        _ => None,
    }) {
        Some(InfoKind::Vxlan) => {}
        Some(kind) => {
            return Some(format!(
                "a {kind} device of that name exists; remove it or choose another name"
            ));
        }
        None => {
            return Some(
                "a device of that name (without a link kind) exists; remove it or choose \
                 another name"
                    .into(),
            );
        }
    }
    let data = infos
        .iter()
        .find_map(|i| match i {
            LinkInfo::Data(InfoData::Vxlan(data)) => Some(data.as_slice()),
            _ => None,
        })
        .unwrap_or_default();
    let mut problems = Vec::new();
    if !data
        .iter()
        .any(|d| matches!(d, InfoVxlan::CollectMetadata(true)))
    {
        problems.push("is not in external (collect-metadata) mode".to_owned());
    }
    match data.iter().find_map(|d| match d {
        InfoVxlan::Port(p) => Some(*p),
        _ => None,
    }) {
        Some(p) if p == port => {}
        Some(p) => problems.push(format!("uses UDP port {p}, not {port}")),
        None => problems.push(format!("reports no UDP port (want {port})")),
    }
    if data.iter().any(|d| matches!(d, InfoVxlan::Learning(true))) {
        problems.push("has learning on".to_owned());
    }
    (!problems.is_empty()).then(|| {
        format!(
            "a vxlan device of that name exists but {}; remove it or choose another name",
            problems.join(" and ")
        )
    })
}

fn interface_of(link: &LinkMessage) -> Interface {
    let mut iface = Interface {
        name: String::new(),
        ifindex: link.header.index,
        up: false,
        mtu: 0,
        mac: None,
        addresses: Vec::new(),
    };
    let mut oper = State::Unknown;
    for attribute in &link.attributes {
        match attribute {
            LinkAttribute::IfName(name) => iface.name.clone_from(name),
            LinkAttribute::Mtu(mtu) => iface.mtu = *mtu,
            LinkAttribute::Address(mac) => iface.mac = <[u8; 6]>::try_from(mac.as_slice()).ok(),
            LinkAttribute::OperState(state) => oper = *state,
            _ => {}
        }
    }
    iface.up = link.header.flags.contains(LinkFlags::Up)
        && !matches!(
            oper,
            State::Down | State::LowerLayerDown | State::NotPresent
        );
    iface
}

/// The address of an address message: IFA_LOCAL (the interface's own address; IFA_ADDRESS
/// is the peer on point-to-point links), else IFA_ADDRESS.
fn address_of(message: &AddressMessage) -> Option<(IpAddr, u8)> {
    let mut local = None;
    let mut address = None;
    for attribute in &message.attributes {
        match attribute {
            AddressAttribute::Local(ip) => local = Some(*ip),
            AddressAttribute::Address(ip) => address = Some(*ip),
            _ => {}
        }
    }
    Some((local.or(address)?, message.header.prefix_len))
}

/// What one route dump says: the main routing table's decision for each prefix, for
/// [`Routes::oif`] (longest-prefix match by probing each prefix length present, ties to
/// the lowest metric, then to the first dumped; the output interface of the winner if it
/// forwards), and the prefixes each interface forwards to, for
/// [`Routes::prefixes_by_oif`].
#[derive(Clone, Debug, Default)]
pub struct Routes {
    /// Prefix -> (metric, output interface; `None` when that route does not forward).
    best: HashMap<IpNet, (u32, Option<u32>)>,
    /// Prefix lengths present, longest first, per family.
    lens_v4: Vec<u8>,
    lens_v6: Vec<u8>,
    /// Output ifindex -> the destinations routed out of it.
    by_oif: BTreeMap<u32, BTreeSet<IpNet>>,
}

impl Routes {
    fn from_dump(routes: &[RouteMessage], extra_tables: &[u32]) -> Self {
        let main = u32::from(RouteHeader::RT_TABLE_MAIN);
        let mut out = Self::default();
        // TOS-specific routes only serve packets with that TOS.
        let any_tos = routes.iter().filter(|r| r.header.tos == 0);
        for r in any_tos.clone().filter(|r| route_table(r) == main) {
            let Some(net) = route_destination(r) else {
                continue;
            };
            let metric = route_metric(r);
            match out.best.get(&net) {
                Some(&(m, _)) if m <= metric => {}
                _ => {
                    out.best.insert(net, (metric, route_oif_of(r)));
                }
            }
        }
        for net in out.best.keys() {
            match net {
                IpNet::V4(n) => out.lens_v4.push(n.prefix_len()),
                IpNet::V6(n) => out.lens_v6.push(n.prefix_len()),
            }
        }
        for lens in [&mut out.lens_v4, &mut out.lens_v6] {
            lens.sort_unstable_by(|a, b| b.cmp(a));
            lens.dedup();
        }
        let published = any_tos.filter(|r| {
            let table = route_table(r);
            table == main || extra_tables.contains(&table)
        });
        for r in published {
            let Some(net) = route_destination(r).filter(|n| publishable(*n)) else {
                continue;
            };
            for oif in route_oifs(r) {
                out.by_oif.entry(oif).or_default().insert(net);
            }
        }
        out
    }

    /// The destinations each interface (by ifindex) forwards to: unicast routes of any
    /// metric in the main table and the extra tables of the dump, without TOS, a multipath
    /// route under each of its next hops' interfaces. Default routes are in; IPv6
    /// link-local and multicast destinations (and IPv4 multicast ones) are not.
    pub fn prefixes_by_oif(&self) -> &BTreeMap<u32, BTreeSet<IpNet>> {
        &self.by_oif
    }

    /// The output interface the main table sends `ip` to; `None` when no route matches or
    /// the best match does not forward (blackhole, unreachable, ...).
    pub fn oif(&self, ip: IpAddr) -> Option<u32> {
        let lens = match ip {
            IpAddr::V4(_) => &self.lens_v4,
            IpAddr::V6(_) => &self.lens_v6,
        };
        lens.iter().find_map(|len| {
            let net = IpNet::new(ip, *len).ok()?.trunc();
            self.best.get(&net).map(|&(_, oif)| oif)
        })?
    }
}

/// The output interface of a route if it forwards (unicast).
fn route_oif_of(r: &RouteMessage) -> Option<u32> {
    if r.header.kind != RouteType::Unicast {
        return None;
    }
    r.attributes.iter().find_map(|a| match a {
        RouteAttribute::Oif(index) => Some(*index),
        // Multipath: the first live next hop stands for the route.
        RouteAttribute::MultiPath(hops) => hops
            .iter()
            .find(|h| {
                !h.flags
                    .intersects(RouteNextHopFlags::Dead | RouteNextHopFlags::Linkdown)
            })
            .or(hops.first())
            .map(|h| h.interface_index),
        _ => None,
    })
}

/// Every interface a unicast route sends to: its output interface, or each next hop's.
fn route_oifs(r: &RouteMessage) -> Vec<u32> {
    if r.header.kind != RouteType::Unicast {
        return Vec::new();
    }
    let mut oifs: Vec<u32> = r
        .attributes
        .iter()
        .flat_map(|a| match a {
            RouteAttribute::Oif(index) => vec![*index],
            RouteAttribute::MultiPath(hops) => hops.iter().map(|h| h.interface_index).collect(),
            _ => Vec::new(),
        })
        .collect();
    oifs.sort_unstable();
    oifs.dedup();
    oifs
}

/// The destination prefix of a route, without host bits (no destination attribute: the
/// family's default route).
fn route_destination(r: &RouteMessage) -> Option<IpNet> {
    let destination = r.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(RouteAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
        RouteAttribute::Destination(RouteAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
        _ => None,
    });
    let destination = match (destination, r.header.address_family) {
        (Some(d), _) => d,
        (None, AddressFamily::Inet6) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        (None, _) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    IpNet::new(destination, r.header.destination_prefix_length)
        .ok()
        .map(|n| n.trunc())
}

/// Whether a destination can be one that pods reach through a gateway: not IPv6
/// link-local (every interface has fe80::/64), not multicast.
fn publishable(net: IpNet) -> bool {
    const LINK_LOCAL_V6: IpNet = IpNet::V6(ipnet::Ipv6Net::new_assert(
        Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0),
        10,
    ));
    const MULTICAST_V6: IpNet = IpNet::V6(ipnet::Ipv6Net::new_assert(
        Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0),
        8,
    ));
    const MULTICAST_V4: IpNet =
        IpNet::V4(ipnet::Ipv4Net::new_assert(Ipv4Addr::new(224, 0, 0, 0), 4));
    ![LINK_LOCAL_V6, MULTICAST_V6, MULTICAST_V4]
        .iter()
        .any(|outside| outside.contains(&net))
}

fn route_table(route: &RouteMessage) -> u32 {
    route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(table) => Some(*table),
            _ => None,
        })
        .unwrap_or(u32::from(route.header.table))
}

fn route_metric(route: &RouteMessage) -> u32 {
    route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Priority(metric) => Some(*metric),
            _ => None,
        })
        .unwrap_or(0)
}

/// The kernel's `dev_valid_name`.
fn check_ifname(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 15 {
        return Err("interface names are 1 to 15 bytes long".into());
    }
    if name == "."
        || name == ".."
        || name.contains(|c: char| c == '/' || c == ':' || c.is_whitespace())
    {
        return Err("interface names cannot be . or .. nor contain /, : or whitespace".into());
    }
    Ok(())
}

pub(crate) const ETH_P_ARP: u16 = 0x0806;
pub(crate) const ETH_P_IPV6: u16 = 0x86dd;
pub(crate) const BROADCAST_MAC: [u8; 6] = [0xff; 6];
/// ff02::1 (all nodes) mapped to Ethernet.
const ALL_NODES_MAC: [u8; 6] = [0x33, 0x33, 0, 0, 0, 1];
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
pub(crate) const IPPROTO_ICMPV6: u8 = 58;
pub(crate) const ND_NEIGHBOR_ADVERT: u8 = 136;
/// The override flag in the first byte of the flags word of a neighbour advertisement.
const ND_NA_FLAG_OVERRIDE: u8 = 0x20;
/// The target link-layer address option.
pub(crate) const ND_OPT_TARGET_LINKADDR: u8 = 2;

/// Announce `ip`, held on `ifindex` whose MAC is `mac`, once at each offset of `at`:
/// IPv4 with a gratuitous ARP request (sender = target = `ip`, broadcast), IPv6 with an
/// unsolicited neighbour advertisement to ff02::1 (override flag, target link-layer
/// address option), both sent raw through an AF_PACKET socket.
pub async fn announce(ifindex: u32, mac: [u8; 6], ip: IpAddr, at: &[Duration]) -> Result<()> {
    let (what, destination, ethertype, frame) = match ip {
        IpAddr::V4(v4) => (
            "gratuitous ARP",
            BROADCAST_MAC,
            ETH_P_ARP,
            gratuitous_arp(mac, v4),
        ),
        IpAddr::V6(v6) => (
            "unsolicited neighbour advertisement",
            ALL_NODES_MAC,
            ETH_P_IPV6,
            unsolicited_na(mac, v6),
        ),
    };
    let object = || format!("{what} for {ip} on ifindex {ifindex}");
    let socket = PacketSocket::open().map_err(|error| Error::Os {
        verb: "open a packet socket to send",
        object: object(),
        error,
    })?;
    let start = tokio::time::Instant::now();
    for offset in at {
        tokio::time::sleep_until(start + *offset).await;
        socket
            .send(ifindex, destination, ethertype, &frame)
            .map_err(|error| Error::Os {
                verb: "send",
                object: object(),
                error,
            })?;
    }
    Ok(())
}

/// An ARP request announcing `ip` at `mac` (RFC 5227 section 3: sender and target
/// protocol address both `ip`, target hardware address zero).
fn gratuitous_arp(mac: [u8; 6], ip: Ipv4Addr) -> Vec<u8> {
    arp_request(mac, ip, ip)
}

/// A broadcast ARP request from `mac` with sender protocol address `sender` for `target`
/// (target hardware address zero).
pub(crate) fn arp_request(mac: [u8; 6], sender: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
    let mut frame = Vec::with_capacity(42);
    frame.extend_from_slice(&BROADCAST_MAC);
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&ETH_P_ARP.to_be_bytes());
    frame.extend_from_slice(&1u16.to_be_bytes()); // hardware type: Ethernet
    frame.extend_from_slice(&0x0800u16.to_be_bytes()); // protocol type: IPv4
    frame.extend_from_slice(&[6, 4]); // address lengths
    frame.extend_from_slice(&1u16.to_be_bytes()); // opcode: request
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&sender.octets());
    frame.extend_from_slice(&[0; 6]);
    frame.extend_from_slice(&target.octets());
    frame
}

/// An unsolicited neighbour advertisement for `ip` at `mac` (RFC 4861 section 7.2.6): from
/// `ip` to all nodes, hop limit 255, override set, solicited clear.
fn unsolicited_na(mac: [u8; 6], ip: Ipv6Addr) -> Vec<u8> {
    let mut icmp = Vec::with_capacity(32);
    icmp.extend_from_slice(&[ND_NEIGHBOR_ADVERT, 0, 0, 0]); // type, code, checksum
    icmp.extend_from_slice(&[ND_NA_FLAG_OVERRIDE, 0, 0, 0]);
    icmp.extend_from_slice(&ip.octets());
    icmp.extend_from_slice(&[ND_OPT_TARGET_LINKADDR, 1]); // length in units of 8 bytes
    icmp.extend_from_slice(&mac);
    let checksum = icmpv6_checksum(ip, ALL_NODES, &icmp);
    icmp[2..4].copy_from_slice(&checksum.to_be_bytes());

    let mut frame = Vec::with_capacity(14 + 40 + icmp.len());
    frame.extend_from_slice(&ALL_NODES_MAC);
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
    frame.extend_from_slice(&[0x60, 0, 0, 0]); // version 6, traffic class 0, flow label 0
    frame.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
    frame.push(IPPROTO_ICMPV6);
    frame.push(255); // hop limit: receivers drop ND messages with any other
    frame.extend_from_slice(&ip.octets());
    frame.extend_from_slice(&ALL_NODES.octets());
    frame.extend_from_slice(&icmp);
    frame
}

/// The ICMPv6 checksum (RFC 4443 section 2.3) of `message`, whose checksum field is zero.
pub(crate) fn icmpv6_checksum(source: Ipv6Addr, destination: Ipv6Addr, message: &[u8]) -> u16 {
    let length = u32::try_from(message.len()).unwrap_or(u32::MAX);
    let mut sum = ones_complement_sum(0, &source.octets());
    sum = ones_complement_sum(sum, &destination.octets());
    sum = ones_complement_sum(sum, &length.to_be_bytes());
    sum = ones_complement_sum(sum, &[0, 0, 0, IPPROTO_ICMPV6]);
    sum = ones_complement_sum(sum, message);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Add the big-endian 16-bit words of `bytes` (odd tail padded with zero) to `sum`,
/// folding carries so that the sum never overflows.
fn ones_complement_sum(mut sum: u32, bytes: &[u8]) -> u32 {
    for word in bytes.chunks(2) {
        let high = word.first().copied().unwrap_or(0);
        let low = word.get(1).copied().unwrap_or(0);
        sum += u32::from(u16::from_be_bytes([high, low]));
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum
}

/// A raw AF_PACKET socket that sends whole Ethernet frames and receives nothing
/// (protocol 0; [`crate::doctor::dad`] opens one that receives).
pub(crate) struct PacketSocket(pub(crate) OwnedFd);

impl PacketSocket {
    fn open() -> io::Result<Self> {
        // SAFETY: socket(2) takes no pointers; the result is checked before use.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns or closes.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub(crate) fn send(
        &self,
        ifindex: u32,
        destination: [u8; 6],
        ethertype: u16,
        frame: &[u8],
    ) -> io::Result<()> {
        let ifindex =
            i32::try_from(ifindex).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: sockaddr_ll is plain old data, for which all zeroes is a valid value.
        let mut address: libc::sockaddr_ll = unsafe { mem::zeroed() };
        address.sll_family = libc::AF_PACKET as u16;
        address.sll_protocol = ethertype.to_be();
        address.sll_ifindex = ifindex;
        address.sll_halen = 6;
        address.sll_addr[..6].copy_from_slice(&destination);
        // SAFETY: `frame` and `address` are live for the call and the lengths passed are
        // theirs; the kernel only reads them.
        let sent = unsafe {
            libc::sendto(
                self.0.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&raw const address).cast(),
                mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        match usize::try_from(sent) {
            Err(_) => Err(io::Error::last_os_error()),
            Ok(n) if n != frame.len() => Err(io::Error::other(format!(
                "sent {n} of {} bytes",
                frame.len()
            ))),
            Ok(_) => Ok(()),
        }
    }
}

/// Write `value` to the sysctl at `path` under /proc/sys, such as
/// `net/ipv4/conf/all/forwarding`. Per-network-namespace sysctls (`net/...`) act in the
/// namespace of the calling thread.
pub fn sysctl(path: &str, value: &str) -> Result<()> {
    let valid = !path.is_empty()
        && path
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..");
    if !valid {
        return Err(Error::Invalid {
            verb: "write",
            object: format!("sysctl {path}"),
            detail: "expected a relative path under /proc/sys, such as \
                     net/ipv4/conf/all/forwarding"
                .into(),
        });
    }
    let full = Path::new("/proc/sys").join(path);
    // No O_CREAT or O_TRUNC: a sysctl that does not exist is an error, not a new file.
    OpenOptions::new()
        .write(true)
        .open(&full)
        .and_then(|mut file| file.write_all(value.as_bytes()))
        .map_err(|error| Error::Os {
            verb: "write",
            object: format!("sysctl {path} = {value}"),
            error,
        })
}

#[cfg(test)]
mod tests {
    //! Each case runs on its own thread in a private, anonymous network namespace
    //! (`unshare(CLONE_NEWNET)`), with a current-thread runtime on that thread: nothing
    //! touches the host, and the namespace with everything in it vanishes with the thread.
    //! They need root (CAP_SYS_ADMIN and CAP_NET_ADMIN).

    use std::{future::Future, str::FromStr as _, time::Instant};

    use rtnetlink::{LinkVeth, packet_route::route::RouteNextHop};

    use super::*;

    fn in_netns<F, Fut>(test: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()>,
    {
        let thread = std::thread::spawn(move || {
            // SAFETY: unshare(2) takes no pointers; CLONE_NEWNET moves only this thread.
            let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
            assert_eq!(
                rc,
                0,
                "unshare(CLONE_NEWNET) failed (these tests need root): {}",
                io::Error::last_os_error()
            );
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime")
                .block_on(test());
        });
        if let Err(panic) = thread.join() {
            std::panic::resume_unwind(panic);
        }
    }

    fn ip(s: &str) -> IpAddr {
        IpAddr::from_str(s).expect("IP literal")
    }

    /// A veth pair with both ends up; returns their ifindexes.
    async fn veth(nl: &Netlink, name: &str, peer: &str) -> (u32, u32) {
        nl.handle
            .link()
            .add(LinkVeth::new(name, peer).up().build())
            .execute()
            .await
            .expect("create veth pair");
        let a = nl
            .ifindex(name)
            .await
            .expect("lookup")
            .expect("veth exists");
        let b = nl
            .ifindex(peer)
            .await
            .expect("lookup")
            .expect("peer exists");
        nl.handle
            .link()
            .change(LinkUnspec::new_with_index(b).up().build())
            .execute()
            .await
            .expect("set peer up");
        (a, b)
    }

    /// Add a main-table route to `destination` (a prefix literal) out of `oif`, or a
    /// blackhole route when `oif` is None.
    async fn add_route(nl: &Netlink, destination: &str, oif: Option<u32>, metric: u32) {
        let mut message = match IpNet::from_str(destination).expect("prefix literal") {
            IpNet::V4(net) => RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(net.addr(), net.prefix_len())
                .priority(metric)
                .build(),
            IpNet::V6(net) => RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(net.addr(), net.prefix_len())
                .priority(metric)
                .build(),
        };
        match oif {
            Some(oif) => message.attributes.push(RouteAttribute::Oif(oif)),
            None => message.header.kind = RouteType::BlackHole,
        }
        nl.handle
            .route()
            .add(message)
            .execute()
            .await
            .unwrap_or_else(|e| panic!("add route {destination} dev {oif:?} metric {metric}: {e}"));
    }

    async fn interface(nl: &Netlink, ifindex: u32) -> Interface {
        nl.interfaces()
            .await
            .expect("list interfaces")
            .into_iter()
            .find(|i| i.ifindex == ifindex)
            .expect("interface listed")
    }

    #[test]
    fn ensure_vxlan_creates_then_adopts() {
        in_netns(|| async {
            let nl = Netlink::new().expect("netlink");
            assert_eq!(nl.ifindex("egtun").await.expect("lookup"), None);

            let index = nl.ensure_vxlan("egtun", 4789, 1450).await.expect("create");
            assert_eq!(nl.ifindex("egtun").await.expect("lookup"), Some(index));
            let tun = interface(&nl, index).await;
            assert_eq!(tun.name, "egtun");
            assert_eq!(tun.mtu, 1450);
            assert!(tun.up, "{tun:?}");
            assert!(tun.mac.is_some(), "{tun:?}");

            // Adopting is idempotent and brings MTU and state back in line.
            nl.handle
                .link()
                .change(LinkUnspec::new_with_index(index).mtu(1400).down().build())
                .execute()
                .await
                .expect("disturb the device");
            assert_eq!(
                nl.ensure_vxlan("egtun", 4789, 1450).await.expect("adopt"),
                index
            );
            let tun = interface(&nl, index).await;
            assert_eq!((tun.mtu, tun.up), (1450, true), "{tun:?}");
        });
    }

    #[test]
    fn ensure_vxlan_refuses_foreign_devices() {
        in_netns(|| async {
            let nl = Netlink::new().expect("netlink");

            // Another kind of device with that name: an error naming it, device untouched.
            let (veth_index, _) = veth(&nl, "egtun", "egtun-peer").await;
            let err = nl
                .ensure_vxlan("egtun", 4789, 1450)
                .await
                .expect_err("veth");
            assert!(matches!(err, Error::Conflict { .. }), "{err:?}");
            let message = err.to_string();
            assert!(
                message.starts_with("failed to adopt vxlan device egtun: a veth device"),
                "{message}"
            );
            assert_eq!(nl.ifindex("egtun").await.expect("lookup"), Some(veth_index));

            // A vxlan device on another port, or not in external mode.
            nl.ensure_vxlan("eg4790", 4790, 1450).await.expect("create");
            let err = nl
                .ensure_vxlan("eg4790", 4789, 1450)
                .await
                .expect_err("port");
            assert!(
                err.to_string().contains("uses UDP port 4790, not 4789"),
                "{err}"
            );
            nl.handle
                .link()
                .add(LinkVxlan::new("egvni", 42).port(4791).build())
                .execute()
                .await
                .expect("create a plain vxlan device");
            let err = nl
                .ensure_vxlan("egvni", 4791, 1450)
                .await
                .expect_err("not external");
            assert!(err.to_string().contains("not in external"), "{err}");

            // A second external device on a port that one already holds.
            let err = nl
                .ensure_vxlan("egother", 4790, 1450)
                .await
                .expect_err("port taken");
            assert!(err.to_string().contains("holds UDP port 4790"), "{err}");
            assert_eq!(nl.ifindex("egother").await.expect("lookup"), None);

            let err = nl
                .ensure_vxlan("a-name-far-too-long", 4789, 1450)
                .await
                .expect_err("name");
            assert!(matches!(err, Error::Invalid { .. }), "{err:?}");
        });
    }

    #[test]
    fn addresses_are_idempotent_and_listed() {
        in_netns(|| async {
            let nl = Netlink::new().expect("netlink");
            let (index, _) = veth(&nl, "egsec", "egsec-peer").await;
            let v4 = (ip("192.0.2.10"), 24);
            let v6 = (ip("2001:db8::10"), 64);

            for (address, prefix_len) in [v4, v6] {
                nl.add_address(index, address, prefix_len)
                    .await
                    .expect("add");
                nl.add_address(index, address, prefix_len)
                    .await
                    .expect("add again");
            }
            let listed = interface(&nl, index).await.addresses;
            assert!(listed.contains(&v4) && listed.contains(&v6), "{listed:?}");

            // The same IPv6 address with another prefix length is a conflict, not a success.
            let err = nl
                .add_address(index, v6.0, 96)
                .await
                .expect_err("other prefix");
            assert!(
                err.to_string()
                    .contains("already holds it as 2001:db8::10/64"),
                "{err}"
            );

            let err = nl.add_address(index, v4.0, 33).await.expect_err("prefix");
            assert!(matches!(err, Error::Invalid { .. }), "{err:?}");

            for (address, prefix_len) in [v4, v6] {
                nl.del_address(index, address, prefix_len)
                    .await
                    .expect("remove");
                nl.del_address(index, address, prefix_len)
                    .await
                    .expect("remove again");
            }
            let listed = interface(&nl, index).await.addresses;
            assert!(!listed.contains(&v4) && !listed.contains(&v6), "{listed:?}");

            let err = nl
                .add_address(9999, v4.0, 24)
                .await
                .expect_err("no such ifindex");
            assert_eq!(err.raw_os_error(), Some(libc::ENODEV), "{err:?}");
            assert!(
                err.to_string()
                    .starts_with("failed to add address 192.0.2.10/24 to ifindex 9999: "),
                "{err}"
            );
        });
    }

    #[test]
    fn route_oif_takes_longest_prefix_then_lowest_metric() {
        in_netns(|| async {
            let nl = Netlink::new().expect("netlink");
            let (r1, _) = veth(&nl, "r1", "r1-peer").await;
            let (r2, _) = veth(&nl, "r2", "r2-peer").await;
            let (r3, _) = veth(&nl, "r3", "r3-peer").await;

            assert_eq!(nl.route_oif(ip("10.1.2.3")).await.expect("lookup"), None);

            add_route(&nl, "10.0.0.0/8", Some(r1), 0).await;
            add_route(&nl, "10.1.0.0/16", Some(r2), 0).await;
            add_route(&nl, "10.2.0.0/16", Some(r1), 100).await;
            add_route(&nl, "10.2.0.0/16", Some(r3), 50).await;
            add_route(&nl, "10.4.0.0/16", None, 0).await;

            let cases = [
                ("10.1.2.3", Some(r2)), // /16 beats /8
                ("10.3.0.1", Some(r1)), // only the /8
                ("10.2.0.1", Some(r3)), // same /16: metric 50 beats 100
                ("10.4.0.1", None),     // the best match drops
                ("192.0.2.1", None),    // no default route
            ];
            for (destination, want) in cases {
                assert_eq!(
                    nl.route_oif(ip(destination)).await.expect("lookup"),
                    want,
                    "{destination}"
                );
            }

            add_route(&nl, "0.0.0.0/0", Some(r3), 0).await;
            assert_eq!(
                nl.route_oif(ip("192.0.2.1")).await.expect("lookup"),
                Some(r3)
            );

            add_route(&nl, "2001:db8::/32", Some(r1), 0).await;
            add_route(&nl, "2001:db8:1::/48", Some(r2), 0).await;
            assert_eq!(
                nl.route_oif(ip("2001:db8:1::1")).await.expect("lookup"),
                Some(r2)
            );
            assert_eq!(
                nl.route_oif(ip("2001:db8:2::1")).await.expect("lookup"),
                Some(r1)
            );
            assert_eq!(nl.route_oif(ip("2001:db9::1")).await.expect("lookup"), None);
        });
    }

    /// One end of a veth pair, both up, with `addresses` (the kernel may lack the dummy
    /// device module); returns its ifindex.
    async fn addressed(nl: &Netlink, name: &str, addresses: &[(&str, u8)]) -> u32 {
        let (index, _) = veth(nl, name, &format!("{name}-peer")).await;
        for (address, prefix_len) in addresses {
            nl.add_address(index, ip(address), *prefix_len)
                .await
                .expect("add address");
        }
        index
    }

    /// Add the route `message`, named `what` in a failure.
    async fn add(nl: &Netlink, what: &str, message: RouteMessage) {
        nl.handle
            .route()
            .add(message)
            .execute()
            .await
            .unwrap_or_else(|e| panic!("add route {what}: {e}"));
    }

    fn v4(s: &str) -> Ipv4Addr {
        Ipv4Addr::from_str(s).expect("IPv4 literal")
    }

    fn v6(s: &str) -> Ipv6Addr {
        Ipv6Addr::from_str(s).expect("IPv6 literal")
    }

    fn nets(list: &[&str]) -> BTreeSet<IpNet> {
        list.iter()
            .map(|n| IpNet::from_str(n).expect("prefix literal"))
            .collect()
    }

    #[test]
    fn prefixes_by_oif_lists_the_unicast_routes_of_the_tables_asked_for() {
        in_netns(|| async {
            let nl = Netlink::new().expect("netlink");
            let d1 = addressed(
                &nl,
                "egd1",
                &[("192.168.104.1", 24), ("2001:db8:104::1", 64)],
            )
            .await;
            let d2 = addressed(&nl, "egd2", &[("192.168.105.1", 24)]).await;
            let via = |gateway: &str, oif: u32| {
                let mut hop = RouteNextHop::default();
                hop.interface_index = oif;
                hop.attributes = vec![RouteAttribute::Gateway(RouteAddress::Inet(v4(gateway)))];
                hop
            };

            let static_route = RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(v4("10.20.0.0"), 16)
                .gateway(v4("192.168.104.254"))
                .output_interface(d1)
                .build();
            add(&nl, "10.20.0.0/16 via a gateway", static_route).await;
            let multipath = RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(v4("10.30.0.0"), 16)
                .multipath(vec![via("192.168.104.254", d1), via("192.168.105.254", d2)])
                .build();
            add(&nl, "10.30.0.0/16 multipath", multipath).await;
            let default = RouteMessageBuilder::<Ipv4Addr>::new()
                .gateway(v4("192.168.104.254"))
                .output_interface(d1)
                .build();
            add(&nl, "default", default).await;
            let blackhole = RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(v4("10.40.0.0"), 16)
                .kind(RouteType::BlackHole)
                .build();
            add(&nl, "blackhole 10.40.0.0/16", blackhole).await;
            let table_100 = RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(v4("10.50.0.0"), 16)
                .gateway(v4("192.168.105.254"))
                .output_interface(d2)
                .table_id(100)
                .build();
            add(&nl, "10.50.0.0/16 in table 100", table_100).await;
            let tos = RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(v4("10.60.0.0"), 16)
                .output_interface(d2)
                .tos(0x10)
                .build();
            add(&nl, "10.60.0.0/16 tos 0x10", tos).await;
            let v6_route = RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(v6("2001:db8:200::"), 48)
                .output_interface(d1)
                .build();
            add(&nl, "2001:db8:200::/48", v6_route).await;
            let link_local = RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(v6("fe80:0:0:1::"), 64)
                .output_interface(d2)
                .build();
            add(&nl, "fe80:0:0:1::/64", link_local).await;

            let main_only = nl.routes(&[]).await.expect("dump");
            let want_d1 = nets(&[
                "0.0.0.0/0",
                "10.20.0.0/16",
                "10.30.0.0/16",
                "192.168.104.0/24",
                "2001:db8:104::/64",
                "2001:db8:200::/48",
            ]);
            let listed = main_only.prefixes_by_oif();
            assert_eq!(listed.get(&d1), Some(&want_d1), "{listed:?}");
            assert_eq!(
                listed.get(&d2),
                Some(&nets(&["10.30.0.0/16", "192.168.105.0/24"])),
                "{listed:?}"
            );
            let all: Vec<&IpNet> = listed.values().flatten().collect();
            assert!(
                !all.iter()
                    .any(|n| n.addr().is_ipv6() && n.addr().to_string().starts_with("fe80")),
                "link-local listed: {all:?}"
            );

            let with_100 = nl.routes(&[100]).await.expect("dump");
            let listed = with_100.prefixes_by_oif();
            assert_eq!(listed.get(&d1), Some(&want_d1), "{listed:?}");
            assert_eq!(
                listed.get(&d2),
                Some(&nets(&["10.30.0.0/16", "10.50.0.0/16", "192.168.105.0/24"])),
                "{listed:?}"
            );
            // Route lookups still read the main table only.
            assert_eq!(with_100.oif(ip("10.50.0.1")), Some(d1), "the default route");
            assert_eq!(with_100.oif(ip("10.40.0.1")), None, "the blackhole");
        });
    }

    #[test]
    fn subscribe_changes_ticks_after_an_address_add() {
        in_netns(|| async {
            let nl = Netlink::new().expect("netlink");
            // The loopback device of a fresh namespace is down and quiet: no IPv6 link-local
            // DAD or carrier events that could tick in the address's place.
            let lo = nl.ifindex("lo").await.expect("lookup").expect("lo");
            let mut changes = Netlink::subscribe_changes().await.expect("subscribe");
            let quiet = tokio::time::timeout(Duration::from_millis(300), changes.recv()).await;
            assert!(quiet.is_err(), "ticked before any change: {quiet:?}");

            nl.add_address(lo, ip("198.51.100.1"), 32)
                .await
                .expect("add");
            let tick = tokio::time::timeout(Duration::from_secs(2), changes.recv()).await;
            assert_eq!(tick, Ok(Some(())));

            // Coalesced: a burst of changes leaves at most one tick pending.
            for last in 2..=5 {
                nl.add_address(lo, ip(&format!("198.51.100.{last}")), 32)
                    .await
                    .expect("add");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert_eq!(changes.try_recv(), Ok(()));
            assert!(changes.try_recv().is_err(), "more than one tick pending");
        });
    }

    /// A packet socket on `ifindex` that receives frames of `ethertype`, with a timeout.
    struct Receiver(OwnedFd);

    impl Receiver {
        fn open(ifindex: u32, ethertype: u16) -> Self {
            // SAFETY: socket(2) takes no pointers; the result is checked.
            let fd = unsafe {
                libc::socket(
                    libc::AF_PACKET,
                    libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                    i32::from(ethertype.to_be()),
                )
            };
            assert!(fd >= 0, "packet socket: {}", io::Error::last_os_error());
            // SAFETY: a fresh descriptor owned by nothing else.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: all zeroes is a valid sockaddr_ll.
            let mut address: libc::sockaddr_ll = unsafe { mem::zeroed() };
            address.sll_family = libc::AF_PACKET as u16;
            address.sll_protocol = ethertype.to_be();
            address.sll_ifindex = i32::try_from(ifindex).expect("ifindex");
            // SAFETY: the address is live and its length is passed.
            let rc = unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    (&raw const address).cast(),
                    mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
                )
            };
            assert_eq!(rc, 0, "bind packet socket: {}", io::Error::last_os_error());
            let timeout = libc::timeval {
                tv_sec: 0,
                tv_usec: 200_000,
            };
            // SAFETY: the option value is live and its length is passed.
            let rc = unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    (&raw const timeout).cast(),
                    mem::size_of::<libc::timeval>() as libc::socklen_t,
                )
            };
            assert_eq!(rc, 0, "SO_RCVTIMEO: {}", io::Error::last_os_error());
            Self(fd)
        }

        /// The frames received within `within` that `keep` accepts.
        fn frames(&self, within: Duration, keep: impl Fn(&[u8]) -> bool) -> Vec<Vec<u8>> {
            let deadline = Instant::now() + within;
            let mut frames = Vec::new();
            while Instant::now() < deadline {
                let mut buffer = [0u8; 2048];
                // SAFETY: the buffer is live and its length is passed.
                let n = unsafe {
                    libc::recv(
                        self.0.as_raw_fd(),
                        buffer.as_mut_ptr().cast(),
                        buffer.len(),
                        0,
                    )
                };
                if let Ok(n) = usize::try_from(n)
                    && keep(&buffer[..n])
                {
                    frames.push(buffer[..n].to_vec());
                }
            }
            frames
        }
    }

    #[test]
    fn announce_sends_gratuitous_arp() {
        in_netns(|| async {
            let nl = Netlink::new().expect("netlink");
            let (index, peer) = veth(&nl, "egann", "egann-peer").await;
            let mac = interface(&nl, index).await.mac.expect("veth has a MAC");
            let receiver = Receiver::open(peer, ETH_P_ARP);

            let held = Ipv4Addr::new(192, 0, 2, 77);
            announce(
                index,
                mac,
                IpAddr::V4(held),
                &[
                    Duration::ZERO,
                    Duration::from_millis(20),
                    Duration::from_millis(40),
                ],
            )
            .await
            .expect("announce");

            let frames = receiver.frames(Duration::from_millis(600), |_| true);
            assert_eq!(frames.len(), 3, "{frames:02x?}");
            for frame in frames {
                assert!(frame.len() >= 42, "{frame:02x?}");
                assert_eq!(frame[0..6], BROADCAST_MAC, "destination");
                assert_eq!(frame[6..12], mac, "source");
                assert_eq!(frame[12..14], [0x08, 0x06], "ethertype");
                assert_eq!(
                    frame[14..22],
                    [0, 1, 0x08, 0x00, 6, 4, 0, 1],
                    "Ethernet/IPv4 request"
                );
                assert_eq!(frame[22..28], mac, "sender MAC");
                assert_eq!(frame[28..32], held.octets(), "sender IP");
                assert_eq!(frame[38..42], held.octets(), "target IP");
            }
        });
    }

    #[test]
    fn announce_sends_unsolicited_neighbour_advertisement() {
        in_netns(|| async {
            let nl = Netlink::new().expect("netlink");
            let (index, peer) = veth(&nl, "egna", "egna-peer").await;
            let mac = interface(&nl, index).await.mac.expect("veth has a MAC");
            let receiver = Receiver::open(peer, ETH_P_IPV6);

            let held = Ipv6Addr::from_str("2001:db8::77").expect("literal");
            announce(
                index,
                mac,
                IpAddr::V6(held),
                &[Duration::ZERO, Duration::from_millis(20)],
            )
            .await
            .expect("announce");

            // The veth ends send their own router solicitations and DAD probes: keep NAs.
            let frames = receiver.frames(Duration::from_millis(600), |f| {
                f.len() > 54 && f[20] == IPPROTO_ICMPV6 && f[54] == ND_NEIGHBOR_ADVERT
            });
            assert_eq!(frames.len(), 2, "{frames:02x?}");
            for frame in frames {
                assert_eq!(frame.len(), 14 + 40 + 32, "{frame:02x?}");
                assert_eq!(frame[0..6], ALL_NODES_MAC, "destination MAC");
                assert_eq!(frame[6..12], mac, "source MAC");
                assert_eq!(frame[12..14], [0x86, 0xdd], "ethertype");
                assert_eq!(frame[14] >> 4, 6, "IP version");
                assert_eq!(frame[18..20], [0, 32], "payload length");
                assert_eq!(frame[21], 255, "hop limit");
                assert_eq!(frame[22..38], held.octets(), "source IP");
                assert_eq!(frame[38..54], ALL_NODES.octets(), "destination IP");
                let icmp = &frame[54..];
                assert_eq!(icmp[1], 0, "code");
                assert_eq!(icmp[4], 0x20, "override set, router and solicited clear");
                assert_eq!(icmp[8..24], held.octets(), "target");
                assert_eq!(icmp[24..26], [2, 1], "target link-layer address option");
                assert_eq!(icmp[26..32], mac, "target link-layer address");
                // A correct checksum makes the sum over pseudo-header and message all ones.
                let mut pseudo = Vec::new();
                pseudo.extend_from_slice(&frame[22..54]);
                pseudo.extend_from_slice(&32u32.to_be_bytes());
                pseudo.extend_from_slice(&[0, 0, 0, 58]);
                pseudo.extend_from_slice(icmp);
                let mut sum: u32 = pseudo
                    .chunks(2)
                    .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
                    .sum();
                while sum > 0xffff {
                    sum = (sum & 0xffff) + (sum >> 16);
                }
                assert_eq!(sum, 0xffff, "checksum");
            }
        });
    }

    #[test]
    fn sysctl_writes_in_the_callers_namespace() {
        in_netns(|| async {
            let path = "net/ipv4/conf/all/forwarding";
            sysctl(path, "1").expect("write");
            let read = std::fs::read_to_string(Path::new("/proc/sys").join(path)).expect("read");
            assert_eq!(read.trim(), "1");
            sysctl(path, "0").expect("write");

            for bad in [
                "",
                "/net/ipv4/ip_forward",
                "net/../../etc/passwd",
                "net//ipv4",
            ] {
                let err = sysctl(bad, "1").expect_err(bad);
                assert!(matches!(err, Error::Invalid { .. }), "{bad}: {err:?}");
            }
            let err = sysctl("net/ipv4/no_such_sysctl", "1").expect_err("missing");
            assert_eq!(
                err.to_string(),
                "failed to write sysctl net/ipv4/no_such_sysctl = 1: No such file or directory (os error 2)"
            );
        });
    }
}
