//! What the agent tells the cluster: its EgressNode (inventory, held IPs, peers), built
//! here; where it goes (and the policy statuses and Events) is the source's
//! [`StatusWriter`](crate::source::StatusWriter).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use tracing::{info, warn};

use super::holding::Holding;
use crate::{
    api::{
        EgressNode, EgressNodeSpec, EgressNodeStatus, HeldEgressIp, MAX_ROUTES, NodeInterface,
        PeerLiveness, PreflightCheck,
    },
    iface,
    liveness::PeerStatus,
};

/// This node's interfaces as it publishes them: every one with an address but the
/// loopback and the tunnel, in `ifaces` order, with its addresses (without the egress IPs
/// this node holds) and the destinations `routes` (by ifindex) sends out of it, capped as
/// [`capped_routes`] says.
pub fn node_interfaces(
    ifaces: &[iface::Interface],
    tunnel: &str,
    holdings: &BTreeMap<IpAddr, Holding>,
    routes: &BTreeMap<u32, BTreeSet<IpNet>>,
) -> Vec<NodeInterface> {
    let listed: Vec<&iface::Interface> = ifaces
        .iter()
        .filter(|i| i.name != "lo" && i.name != tunnel && !i.addresses.is_empty())
        .collect();
    let lists = capped_routes(
        listed
            .iter()
            .map(|i| {
                let all = routes.get(&i.ifindex).into_iter().flatten().copied();
                (i.name.as_str(), all.collect())
            })
            .collect(),
        MAX_ROUTES,
    );
    listed
        .into_iter()
        .zip(lists)
        .map(|(i, (routes, routes_omitted))| NodeInterface {
            name: i.name.clone(),
            up: i.up,
            addresses: i
                .addresses
                .iter()
                // Our own egress IPs are not part of the inventory.
                .filter(|(a, _)| !holdings.contains_key(a))
                .map(|(a, l)| format!("{a}/{l}"))
                .collect(),
            routes,
            routes_omitted,
        })
        .collect()
}

/// Each interface's routes as published, in the order given: sorted (IPv4 first, then
/// shorter prefixes first, then by address), within a node-wide `budget` spent in
/// interface name order; with the number left out past the budget.
fn capped_routes(interfaces: Vec<(&str, Vec<IpNet>)>, budget: usize) -> Vec<(Vec<String>, u32)> {
    let mut by_name: Vec<usize> = (0..interfaces.len()).collect();
    by_name.sort_by_key(|&i| interfaces[i].0);
    let mut out = vec![(Vec::new(), 0); interfaces.len()];
    let mut left = budget;
    for i in by_name {
        let mut all = interfaces[i].1.clone();
        all.sort_unstable_by_key(|n| (n.addr().is_ipv6(), n.prefix_len(), n.addr()));
        let kept = all.len().min(left);
        left -= kept;
        let omitted = u32::try_from(all.len() - kept).unwrap_or(u32::MAX);
        out[i] = (
            all[..kept].iter().map(ToString::to_string).collect(),
            omitted,
        );
    }
    out
}

/// Warn once for each interface whose routes no longer all fit in the EgressNode (it was
/// not in `capped`, the interfaces capped as of the last pass), and say when one fits
/// again. Returns the interfaces capped now.
pub fn warn_capped(capped: &BTreeSet<String>, interfaces: &[NodeInterface]) -> BTreeSet<String> {
    let now: BTreeSet<String> = interfaces
        .iter()
        .filter(|i| i.routes_omitted > 0)
        .map(|i| i.name.clone())
        .collect();
    for i in interfaces.iter().filter(|i| i.routes_omitted > 0) {
        if !capped.contains(&i.name) {
            warn!(
                interface = %i.name,
                published = i.routes.len(),
                omitted = i.routes_omitted,
                "failed to publish every route out of interface {}: a node publishes at most \
                 {MAX_ROUTES} routes over all its interfaces, so {} of its routes (the longest \
                 prefixes) are left out and rules with destinationsFrom: Routes do not reach \
                 them through this node; remove routes or summarize them into fewer, shorter \
                 prefixes",
                i.name,
                i.routes_omitted,
            );
        }
    }
    for name in capped.difference(&now) {
        info!(interface = %name, "every route out of the interface is published again");
    }
    now
}

/// This node's EgressNode: its interfaces (see [`node_interfaces`]), what it holds, the
/// peers it probes, and its preflight (`egress-agent doctor` at start, refused addresses).
pub fn egress_node_doc(
    name: &str,
    underlay: Option<IpAddr>,
    interfaces: Vec<NodeInterface>,
    holdings: &BTreeMap<IpAddr, Holding>,
    peers: &[PeerStatus],
    cut_off: bool,
    preflight: Vec<PreflightCheck>,
) -> EgressNode {
    let mut doc = EgressNode::new(
        name,
        EgressNodeSpec {
            underlay_ip: underlay.map(|u| u.to_string()),
        },
    );
    doc.status = Some(EgressNodeStatus {
        interfaces,
        egress_ips: holdings
            .iter()
            .map(|(ip, h)| HeldEgressIp {
                ip: ip.to_string(),
                interface: h.interface.clone(),
                epoch: h.epoch,
                since: Some(h.since.clone()),
                reason: Some(h.reason.clone()),
            })
            .collect(),
        peers: peers
            .iter()
            .map(|p| PeerLiveness {
                name: p.name.clone(),
                alive: p.alive,
            })
            .collect(),
        cut_off,
        preflight,
    });
    doc
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn interface(name: &str, ifindex: u32) -> iface::Interface {
        iface::Interface::up_for_test(name, ifindex, &[("192.0.2.1", 24)])
    }

    fn nets(list: &[&str]) -> BTreeSet<IpNet> {
        list.iter()
            .map(|n| n.parse().expect("prefix literal"))
            .collect()
    }

    #[test]
    fn routes_are_listed_ipv4_first_then_shortest_prefix_first() {
        let ifaces = [
            interface("lo", 1),
            interface("eth1", 2),
            interface("egress0", 3),
        ];
        let routes = BTreeMap::from([
            (1, nets(&["127.0.0.0/8"])),
            (
                2,
                nets(&[
                    "2001:db8::/32",
                    "10.2.0.0/16",
                    "::/0",
                    "10.1.0.0/16",
                    "0.0.0.0/0",
                    "192.168.104.0/24",
                ]),
            ),
            (3, nets(&["10.0.0.0/8"])),
        ]);
        let listed = node_interfaces(&ifaces, "egress0", &BTreeMap::new(), &routes);
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!(
            listed[0].routes,
            [
                "0.0.0.0/0",
                "10.1.0.0/16",
                "10.2.0.0/16",
                "192.168.104.0/24",
                "::/0",
                "2001:db8::/32"
            ]
        );
        assert_eq!(listed[0].routes_omitted, 0);
    }

    #[test]
    fn routes_past_the_node_budget_are_counted_not_listed() {
        // 4,000 /20s and 16,000 /28s out of eth1; eth2 comes after it by name.
        let mut many = BTreeSet::new();
        for i in 0..4_000u32 {
            many.insert(
                IpNet::new(Ipv4Addr::from(0x0a00_0000 + (i << 12)).into(), 20).expect("/20"),
            );
        }
        for i in 0..16_000u32 {
            many.insert(
                IpNet::new(Ipv4Addr::from(0x6400_0000 + (i << 4)).into(), 28).expect("/28"),
            );
        }
        assert_eq!(many.len(), 20_000);
        let ifaces = [interface("eth2", 3), interface("eth1", 2)];
        let routes = BTreeMap::from([(2, many), (3, nets(&["0.0.0.0/0", "10.0.0.0/8"]))]);
        let listed = node_interfaces(&ifaces, "egress0", &BTreeMap::new(), &routes);

        let (eth2, eth1) = (&listed[0], &listed[1]);
        assert_eq!((eth1.name.as_str(), eth2.name.as_str()), ("eth1", "eth2"));
        assert_eq!((eth1.routes.len(), eth1.routes_omitted), (16_384, 3_616));
        assert_eq!((eth2.routes.len(), eth2.routes_omitted), (0, 2));
        // The shortest prefixes are kept: every /20, then the lowest /28s.
        assert!(eth1.routes[..4_000].iter().all(|r| r.ends_with("/20")));
        assert_eq!(eth1.routes[4_000], "100.0.0.0/28");
        assert_eq!(eth1.routes[16_383], "100.3.5.240/28");

        // One warning when the cap starts to bite, none while it stays, a note when it ends.
        let capped = warn_capped(&BTreeSet::new(), &listed);
        assert_eq!(
            capped,
            BTreeSet::from(["eth1".to_owned(), "eth2".to_owned()])
        );
        assert_eq!(warn_capped(&capped, &listed), capped);
        assert!(warn_capped(&capped, &[]).is_empty());
    }
}
