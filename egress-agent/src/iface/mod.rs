//! The agent's interface layer: the tunnel device, the interface and address inventory,
//! egress addresses and change notifications over rtnetlink (here), route dumps and
//! lookups ([`routes`]), pods' veths by their peers' namespaces ([`VethPeer`]), Open
//! vSwitch's pod ports ([`ovsdb`]), gratuitous ARP and unsolicited neighbour advertisements over a
//! packet socket ([`announce`](mod@announce)), sysctl writes.
//!
//! Every socket acts in the network namespace of the thread that opens it:
//! [`Netlink::new`] and [`Netlink::subscribe_changes`] bind to the namespace of their caller,
//! [`announce`] to that of the thread that first polls it. The agent runs in one namespace,
//! so this only matters to tests, which give each case a private namespace.

mod announce;
pub mod ovsdb;
mod peers;
mod routes;

pub use announce::*;
pub use peers::{VethPeer, is_link_local};
pub use routes::Routes;

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

/// VXLAN over IPv4: outer IPv4 (20) + UDP (8) + VXLAN (8) + inner Ethernet (14).
pub(crate) const VXLAN_OVERHEAD: u32 = 50;
/// VXLAN over IPv6: the outer header is 40 bytes instead of 20.
pub(crate) const VXLAN_OVERHEAD_V6: u32 = 70;

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
    /// A veth whose peer is in another network namespace (a pod's, as a CNI makes it):
    /// a reply may be redirected into that peer (`pod_device_flags::REPLY_TO_PEER`).
    pub pod_like: bool,
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

    /// The ifindex of the peer of the veth called `name` (in the peer's own namespace),
    /// None if there is no such device or it has no peer.
    pub async fn veth_peer(&self, name: &str) -> Result<Option<u32>> {
        check_ifname(name).map_err(|detail| Error::Invalid {
            verb: "look up",
            object: format!("interface {name}"),
            detail,
        })?;
        Ok(self.link_by_name(name).await?.and_then(|link| {
            link.attributes.iter().find_map(|a| match a {
                LinkAttribute::Link(peer) if *peer != 0 => Some(*peer),
                _ => None,
            })
        }))
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
        valid_prefix("add", object, ip, prefix_len)?;
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
        valid_prefix("remove", object, ip, prefix_len)?;
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

/// A link that appeared (`RTM_NEWLINK` of an ifindex not seen on this subscription
/// before), as [`Netlink::subscribe_new_links`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewLink {
    pub ifindex: u32,
    pub name: String,
    /// A veth whose peer is in another network namespace: what a CNI gives a pod.
    pub pod_like: bool,
    /// A veth whose peer is not linked yet (not reported: the next notification is).
    pending: bool,
    /// When the notification was read.
    pub seen: std::time::Instant,
}

impl NewLink {
    /// A new link as a test writes it.
    #[cfg(test)]
    pub fn for_test(ifindex: u32, name: &str, pod_like: bool) -> Self {
        Self {
            ifindex,
            name: name.to_owned(),
            pod_like,
            pending: false,
            seen: std::time::Instant::now(),
        }
    }

    fn from_message(m: &LinkMessage) -> Option<Self> {
        let name = m.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        })?;
        let veth = m.attributes.iter().any(|a| {
            matches!(a, LinkAttribute::LinkInfo(infos)
                if infos.iter().any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth))))
        });
        let peer_elsewhere = m
            .attributes
            .iter()
            .any(|a| matches!(a, LinkAttribute::LinkNetNsId(_)));
        let peer_unlinked = m
            .attributes
            .iter()
            .any(|a| matches!(a, LinkAttribute::Link(0)))
            || !m
                .attributes
                .iter()
                .any(|a| matches!(a, LinkAttribute::Link(_)));
        Some(Self {
            ifindex: m.header.index,
            name,
            pod_like: veth && peer_elsewhere,
            pending: veth && !peer_elsewhere && peer_unlinked,
            seen: std::time::Instant::now(),
        })
    }
}

impl Netlink {
    /// Subscribe to new links on a connection of their own: each `RTM_NEWLINK` of an
    /// ifindex that did not exist when this subscribed and was not reported yet, as it
    /// is read (a CNI's new pod device, within microseconds of its creation). Removed
    /// links are forgotten, so an ifindex reused later is new again. Yields None when the
    /// subscription dies.
    pub async fn subscribe_new_links(&self) -> Result<mpsc::Receiver<NewLink>> {
        use rtnetlink::packet_core::NetlinkPayload;
        use rtnetlink::packet_route::RouteNetlinkMessage;
        let (connection, _handle, mut messages) =
            rtnetlink::new_multicast_connection(&[MulticastGroup::Link]).map_err(|error| {
                Error::Os {
                    verb: "subscribe to",
                    object: "link notifications".into(),
                    error,
                }
            })?;
        // Subscribed first, then listed: a link created in between is in both, and the
        // list wins (it is not new to the caller, whose own listing comes later).
        let mut known: BTreeSet<u32> = self.interfaces().await?.iter().map(|i| i.ifindex).collect();
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(async move {
            let forward = async {
                while let Some((message, _)) = messages.next().await {
                    match message.payload {
                        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(m)) => {
                            if known.contains(&m.header.index) {
                                continue;
                            }
                            let Some(link) = NewLink::from_message(&m) else {
                                continue;
                            };
                            // A veth's first notification may come before its peer is
                            // linked (no peer namespace yet): it is judged again at the
                            // next one (the device goes up before it carries a packet).
                            if link.pending {
                                continue;
                            }
                            known.insert(link.ifindex);
                            if tx.send(link).await.is_err() {
                                break;
                            }
                        }
                        NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(m)) => {
                            known.remove(&m.header.index);
                        }
                        _ => {}
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
        pod_like: false,
    };
    let mut oper = State::Unknown;
    let (mut veth, mut peer_elsewhere) = (false, false);
    for attribute in &link.attributes {
        match attribute {
            LinkAttribute::IfName(name) => iface.name.clone_from(name),
            LinkAttribute::Mtu(mtu) => iface.mtu = *mtu,
            LinkAttribute::Address(mac) => iface.mac = <[u8; 6]>::try_from(mac.as_slice()).ok(),
            LinkAttribute::OperState(state) => oper = *state,
            LinkAttribute::LinkInfo(infos) => {
                veth = infos
                    .iter()
                    .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth)));
            }
            LinkAttribute::LinkNetNsId(_) => peer_elsewhere = true,
            _ => {}
        }
    }
    iface.pod_like = veth && peer_elsewhere;
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

/// `Error::Invalid` naming `object` unless `prefix_len` fits `ip`'s family.
fn valid_prefix(
    verb: &'static str,
    object: impl Fn() -> String,
    ip: IpAddr,
    prefix_len: u8,
) -> Result<()> {
    IpNet::new(ip, prefix_len).map_err(|e| Error::Invalid {
        verb,
        object: object(),
        detail: e.to_string(),
    })?;
    Ok(())
}

#[cfg(test)]
mod tests;
