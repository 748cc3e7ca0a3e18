//! Routes: one dump of both families' routing tables, the output interface the main
//! table picks for an address, and the prefixes each interface forwards to.

use super::*;

impl Netlink {
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
        let published: Vec<&RouteMessage> = any_tos
            .filter(|r| {
                let table = route_table(r);
                table == main || extra_tables.contains(&table)
            })
            .collect();
        // Of the routes to one prefix in one table, the kernel uses those of the lowest
        // metric: a backup route (`default via R dev sec-b metric 100` beside the active
        // one) forwards nothing while the active one is there, and must not be learned.
        let mut lowest: BTreeMap<(u32, IpNet), u32> = BTreeMap::new();
        for r in &published {
            if let Some(net) = route_destination(r) {
                let m = lowest.entry((route_table(r), net)).or_insert(u32::MAX);
                *m = (*m).min(route_metric(r));
            }
        }
        for r in published {
            let Some(net) = route_destination(r).filter(|n| publishable(*n)) else {
                continue;
            };
            if lowest.get(&(route_table(r), net)) != Some(&route_metric(r)) {
                continue;
            }
            for oif in route_oifs(r) {
                out.by_oif.entry(oif).or_default().insert(net);
            }
        }
        out
    }

    /// The destinations each interface (by ifindex) forwards to: unicast routes in the
    /// main table and the extra tables of the dump, of the lowest metric among the
    /// routes to their prefix in their table (the ones in use), without TOS, a multipath
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

/// The route's table: its attribute (any id), else the header's (ids below 256).
fn route_table(route: &RouteMessage) -> u32 {
    let table = route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Table(table) => Some(*table),
        _ => None,
    });
    table.unwrap_or(u32::from(route.header.table))
}

/// The route's metric (0 when it has none).
fn route_metric(route: &RouteMessage) -> u32 {
    let metric = route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Priority(metric) => Some(*metric),
        _ => None,
    });
    metric.unwrap_or(0)
}
