//! Election: the holder of each dedicated egress IP among the eligible gateways that can
//! host it (sticky to the newest claim, else the rendezvous winner), agreed between the
//! policies that name it, and spread over a rule's `egressIPs`.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use super::{Context, Gateways, RuleAt};
use crate::compiler::{
    hash, move_reason,
    nodes::NodeInfo,
    plans::{Dedicated, GatewayAddr, IpBytes},
    reason,
    status::PolicyReport,
};

/// Egress IP -> (holder, deciding policy).
pub(super) type Placed = BTreeMap<IpAddr, (GatewayAddr, String)>;

/// The holders of a rule's dedicated egress IPs (`addresses`: each with its wire id), in
/// the order written. Each address goes to a host holding the fewest earlier addresses of
/// the rule: one gateway each where enough can host them; several share a gateway only
/// when fewer can (as evenly as they can), and the status says so.
pub(super) fn place_egress_ips(
    at: &RuleAt<'_>,
    addresses: &[(IpAddr, u32)],
    gateways: &Gateways<'_, '_>,
    cx: &Context<'_, '_>,
    placed: &mut Placed,
    report: &mut PolicyReport,
) -> Vec<Dedicated> {
    let mut taken: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    let mut out = Vec::new();
    for (k, (ip, id)) in addresses.iter().enumerate() {
        let load: BTreeMap<&str, usize> =
            taken.iter().map(|(n, a)| (n.as_str(), a.len())).collect();
        let field = at.address_field(k);
        let holder = place_egress_ip(at, &field, *ip, (gateways, &load), cx, placed, report);
        if let Some(h) = &holder {
            taken.entry(h.node.clone()).or_default().push(*ip);
        }
        out.push(Dedicated {
            ip: *ip,
            name: ip.to_string(),
            id: *id,
            holder,
        });
    }
    let shared: Vec<String> = taken
        .iter()
        .filter(|(_, ips)| ips.len() > 1)
        .map(|(node, ips)| {
            let ips: Vec<String> = ips.iter().map(IpAddr::to_string).collect();
            format!("{} on {node}", ips.join(" and "))
        })
        .collect();
    if !shared.is_empty() {
        report.shared_gateways(format!(
            "rules[{}].egressIPs: fewer eligible gateways host them ({}) than the rule \
             has addresses ({}): {}",
            at.index,
            taken.len(),
            addresses.len(),
            shared.join("; ")
        ));
    }
    out
}

/// The holder of a rule's dedicated egress IP `ip` (named by `field`), if it has one,
/// among the hosts with the least `load` (addresses of the rule placed before it).
fn place_egress_ip(
    at: &RuleAt<'_>,
    field: &str,
    ip: IpAddr,
    (gateways, load): (&Gateways<'_, '_>, &BTreeMap<&str, usize>),
    cx: &Context<'_, '_>,
    placed: &mut Placed,
    report: &mut PolicyReport,
) -> Option<GatewayAddr> {
    if refused(at.policy, field, ip, cx, report) {
        return None;
    }
    if gateways.eligible.is_empty() {
        // Said once for the policy (spec.gatewaySelector).
        return None;
    }
    let hosts: Vec<GatewayAddr> = gateways
        .eligible
        .iter()
        .filter_map(|n| {
            let (iface, prefix_len) = n.egress.as_ref()?.hosting_interface(ip)?;
            Some(GatewayAddr::new(n, n.underlay?, iface, ip, prefix_len))
        })
        .collect();
    if let Some((placed_at, decider)) = placed.get(&ip) {
        let agreed = hosts
            .iter()
            .any(|h| h.node == placed_at.node)
            .then(|| placed_at.clone());
        if agreed.is_none() {
            report.unready(
                reason::EGRESS_IP_IN_USE,
                format!(
                    "{field}: {ip} is held by {} for policy {decider}, which \
                     is not an eligible gateway here",
                    placed_at.node
                ),
            );
        }
        return agreed;
    }
    if hosts.is_empty() {
        report.unready(
            reason::EGRESS_IP_NOT_HOSTABLE,
            format!(
                "{field}: {ip} is in no subnet of an up interface of any \
                 eligible gateway ({})",
                gateways.names()
            ),
        );
        return None;
    }
    let chosen = choose_holder(
        ip,
        &hosts,
        cx.nodes,
        (&gateways.selected, load),
        cx.peers.last_claims.get(&ip),
    );
    if let Some(h) = &chosen {
        placed.insert(ip, (h.clone(), at.policy.to_owned()));
    }
    chosen
}

/// Whether `policy` may not have egress IP `ip` (named by `field`) held for it, and why
/// (reported): another implementation claims it, an older policy owns it, or it is a
/// node's own address. Other policies naming it too are reported as well.
fn refused(
    policy: &str,
    field: &str,
    ip: IpAddr,
    cx: &Context<'_, '_>,
    report: &mut PolicyReport,
) -> bool {
    if let Some(owner) = cx.foreign.get(&ip) {
        report.claimed_elsewhere(format!(
            "{field}: {ip} is also claimed by {owner}; this policy leaves it \
             to them (remove it from one of the two)"
        ));
        return true;
    }
    if let Some((owner, others)) = cx.owners.get(&ip) {
        if owner != policy {
            let message = format!(
                "{field}: {ip} belongs to policy {owner} (the older policy \
                 naming it; ties by name): this rule gets no gateway and follows the failure \
                 policy; give it its own egress IP"
            );
            report.egress_ip_conflict(message);
            report.unready(
                reason::EGRESS_IP_IN_USE,
                format!("{field}: {ip} is policy {owner}'s: no gateway"),
            );
            return true;
        }
        if !others.is_empty() {
            report.egress_ip_conflict(format!(
                "{field}: {ip} is also named by policy {}: it stays this \
                 policy's (the older one naming it); theirs get no gateway",
                others.join(", ")
            ));
        }
    }
    let Some((node, how)) = cx.nodes.iter().find_map(|n| {
        n.own_addresses
            .iter()
            .find(|(a, _)| *a == ip)
            .map(|(_, how)| (n.name, how))
    }) else {
        return false;
    };
    report.unready(
        reason::EGRESS_IP_IS_NODE_ADDRESS,
        format!(
            "{field}: {ip} is an address of node {node} ({how}); use a \
             free address of that subnet, or `interface:` to SNAT to the gateways' own \
             addresses"
        ),
    );
    true
}

/// The holder of dedicated egress IP `ip` among `hosts` (all eligible; `selected`: the
/// nodes the policy's gatewaySelector matches; `heard`: the newest claim heard in a
/// hello, perhaps released since). Sticky: a host holding the newest claim keeps it (a
/// holder back from the dead has an older one). Otherwise a host that claims it anyway
/// (the largest epoch first), else the rendezvous winner, takes it with the newest epoch
/// + 1, and the reason says why the last claimant lost it.
///
/// Only the hosts with the least `load` (other addresses of the rule they hold) are
/// considered: a holder with more gives the address up to one with fewer
/// ([`move_reason::REBALANCED`]).
fn choose_holder(
    ip: IpAddr,
    hosts: &[GatewayAddr],
    nodes: &[NodeInfo<'_>],
    (selected, load): (&BTreeSet<&str>, &BTreeMap<&str, usize>),
    heard: Option<&(String, u64)>,
) -> Option<GatewayAddr> {
    let load_of = |name: &str| load.get(name).copied().unwrap_or(0);
    let least = hosts.iter().map(|h| load_of(&h.node)).min().unwrap_or(0);
    let lightest: Vec<GatewayAddr> = hosts
        .iter()
        .filter(|h| load_of(&h.node) == least)
        .cloned()
        .collect();
    let hosts = &lightest;
    let octets = IpBytes::of(ip);
    let node_info = |name: &str| nodes.iter().find(|n| n.name == name);
    let claim =
        |name: &str| node_info(name).and_then(|n| n.egress.as_ref()?.held.get(&ip).copied());
    let last = last_claimant(ip, nodes, heard);
    let newest = last.map(|(e, _)| e);
    let claimants: Vec<(&GatewayAddr, u64)> = hosts
        .iter()
        .filter_map(|h| Some((h, claim(&h.node)?)))
        .collect();
    let pool: Vec<&GatewayAddr> = match claimants.iter().map(|(_, e)| *e).max() {
        Some(top) => claimants
            .iter()
            .filter(|(_, e)| *e == top)
            .map(|(h, _)| *h)
            .collect(),
        None => hosts.iter().collect(),
    };
    let node = hash::rendezvous(&[octets.bytes()], pool.iter().map(|h| h.node.as_str()))?;
    let mut g = pool.into_iter().find(|h| h.node == node)?.clone();
    let kept = claim(node);
    if kept.is_some() && kept == newest {
        // Sticky: it holds the newest claim.
        g.epoch = kept.unwrap_or_default();
        let published =
            node_info(node).and_then(|n| n.egress.as_ref()?.held_meta.get(&ip).cloned());
        if let Some((epoch, since, why)) = published
            && Some(epoch) == kept
        {
            g.since = since;
            g.reason = why
                .as_deref()
                .and_then(move_reason::parse)
                .unwrap_or(move_reason::ASSIGNED);
        }
        return Some(g);
    }
    g.epoch = newest.map_or(1, |e| e + 1);
    g.reason = match last {
        None => move_reason::ASSIGNED,
        Some((_, n)) => lost_because(n, ip, selected, load_of(n.name) > least),
    };
    Some(g)
}

/// The last claimant of `ip`, wherever it is, with its epoch: the newest claim published
/// in an EgressNode, or `heard` in a hello when that one is newer.
fn last_claimant<'n, 'a>(
    ip: IpAddr,
    nodes: &'n [NodeInfo<'a>],
    heard: Option<&(String, u64)>,
) -> Option<(u64, &'n NodeInfo<'a>)> {
    let published = nodes
        .iter()
        .filter_map(|n| Some((n.egress.as_ref()?.held.get(&ip).copied()?, n)))
        .max_by(|(a, na), (b, nb)| a.cmp(b).then(nb.name.cmp(na.name)));
    let heard =
        heard.and_then(|(name, e)| Some((*e, nodes.iter().find(|n| n.name == name.as_str())?)));
    match (published, heard) {
        (Some(p), Some(h)) if h.0 > p.0 => Some(h),
        (p @ Some(_), _) => p,
        (None, h) => h,
    }
}

/// Why the last claimant `n` of `ip` lost it (`heavier`: it holds more of the rule's
/// addresses than the new holder).
fn lost_because(
    n: &NodeInfo<'_>,
    ip: IpAddr,
    selected: &BTreeSet<&str>,
    heavier: bool,
) -> &'static str {
    if n.dead {
        move_reason::HOLDER_UNREACHABLE
    } else if !n.ready {
        move_reason::HOLDER_NOT_READY
    } else if n.drained {
        move_reason::HOLDER_DRAINED
    } else if !selected.contains(n.name) {
        move_reason::HOLDER_NOT_SELECTED
    } else if n
        .egress
        .as_ref()
        .is_none_or(|e| e.hosting_interface(ip).is_none())
    {
        move_reason::HOLDER_INTERFACE_DOWN
    } else if heavier {
        move_reason::REBALANCED
    } else {
        move_reason::REASSIGNED
    }
}
