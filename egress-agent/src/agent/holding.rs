//! Holding egress IPs on this node, ordered so that no kernel ever sees a packet to an
//! egress IP that the datapath does not claim (the kernel would answer it with a RST):
//!
//! * **acquire**: maps first (the rule, and the egress IP in `EGRESS_IPS_*`, so that
//!   `from_secondary` drops replies without conntrack instead of handing them to the
//!   stack), then `from_secondary` attached, then the address, then announcements;
//! * **release**: the address first, then the maps, after a linger: for [`LINGER`] the
//!   released IP's rules and `EGRESS_IPS` entry stay, so packets still reaching this node
//!   (source nodes that have not moved yet, neighbours with a stale cache) are translated
//!   with the flow's conntrack entry or dropped, never answered by the host;
//! * **handover**: an address another live node still claims (a planned move, where the
//!   old holder releases on its own) is added only once that claim is gone, or after the
//!   detection time at most, so two nodes do not answer ARP for it at once.
//!
//! Decisions here are pure functions over plain data; `agent::Reconciler` acts on them.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use crate::{
    desired::{Desired, GatewayRule, HeldIp, Part, V4, V6},
    liveness::{Claim, PeerView},
};

/// How long a released egress IP keeps serving what still reaches this node.
pub const LINGER: Duration = Duration::from_secs(10);

/// When a new holder announces an address (gratuitous ARP, unsolicited neighbour
/// advertisement), after adding it: at once, then again for neighbours that missed it or
/// keep long ARP timers.
pub const ANNOUNCE_AT: [Duration; 5] = [
    Duration::ZERO,
    Duration::from_millis(100),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
];

/// An egress IP this node holds: on which interface, its epoch, since when and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    pub interface: String,
    pub epoch: u64,
    /// RFC 3339.
    pub since: String,
    pub reason: String,
}

/// What a dedicated egress IP needs in the gateway-side maps of this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GatewayPart {
    pub held: Option<HeldIp>,
    /// The rules leaving with this address: rule id -> interface.
    pub rules: BTreeMap<u32, String>,
}

/// A released egress IP still served from the maps until `until`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lingering {
    pub until: Instant,
    pub part: GatewayPart,
}

/// The gateway-side map contents of every dedicated egress IP in `desired`, by address.
pub fn gateway_parts(desired: &Desired) -> BTreeMap<IpAddr, GatewayPart> {
    let mut out: BTreeMap<IpAddr, GatewayPart> = BTreeMap::new();
    add_parts::<V4>(desired, &mut out);
    add_parts::<V6>(desired, &mut out);
    out
}

/// [`gateway_parts`] of family `F`.
fn add_parts<F: Part>(desired: &Desired, out: &mut BTreeMap<IpAddr, GatewayPart>) {
    let d = F::of(desired);
    for (ip, h) in d.egress_ips.iter().filter(|(_, h)| !h.shared) {
        out.entry((*ip).into()).or_default().held = Some(h.clone());
    }
    for (id, r) in &d.rules {
        if let Some(p) = out.get_mut(&r.egress_ip.into()) {
            p.rules.insert(*id, r.interface.clone());
        }
    }
}

/// `desired` with the lingering IPs' entries added where nothing current takes their
/// place (an address or rule id in use now wins).
pub fn with_lingering(desired: &Desired, lingering: &BTreeMap<IpAddr, Lingering>) -> Desired {
    let mut out = desired.clone();
    for (ip, l) in lingering {
        let Some(held) = &l.part.held else { continue };
        let added = match ip {
            IpAddr::V4(a) => linger::<V4>(&mut out, *a, held, &l.part.rules),
            IpAddr::V6(a) => linger::<V6>(&mut out, *a, held, &l.part.rules),
        };
        if added {
            out.egress_interfaces.insert(held.interface.clone());
        }
    }
    out
}

/// Add the lingering `ip` and its `rules` to `out` unless `ip` is in use now; rule ids
/// in use now keep their entries. Whether it was added.
fn linger<F: Part>(
    out: &mut Desired,
    ip: F::Addr,
    held: &HeldIp,
    rules: &BTreeMap<u32, String>,
) -> bool {
    let part = F::of_mut(out);
    if part.egress_ips.contains_key(&ip) {
        return false;
    }
    part.egress_ips.insert(ip, held.clone());
    for (id, interface) in rules {
        part.rules.entry(*id).or_insert_with(|| GatewayRule {
            egress_ip: ip,
            interface: interface.clone(),
        });
    }
    true
}

/// Another live node that still claims `ip` in its hellos (it is on its way out: the
/// compiler chose this node), if any.
pub fn other_claimant<'a>(ip: IpAddr, me: &str, peers: &'a PeerView) -> Option<&'a str> {
    peers
        .reports
        .iter()
        .filter(|(n, r)| n.as_str() != me && !r.cut_off && !peers.dead.contains(n.as_str()))
        .find(|(_, r)| r.claims.contains_key(&ip))
        .map(|(n, _)| n.as_str())
}

/// Addresses this node's EgressNode says it holds (`published`: ip, interface, epoch,
/// since, reason) that are on that interface now (`present`) but not in `holdings`: what
/// an agent that restarted (or replaced one) still holds. Adopted with their epochs, so a
/// restart moves nothing.
pub fn adopt(
    holdings: &mut BTreeMap<IpAddr, Holding>,
    published: &[crate::api::HeldEgressIp],
    present: impl Fn(&str, IpAddr) -> bool,
) -> Vec<IpAddr> {
    let mut adopted = Vec::new();
    for h in published {
        let Ok(ip) = h.ip.parse::<IpAddr>() else {
            continue;
        };
        if holdings.contains_key(&ip) || !present(&h.interface, ip) {
            continue;
        }
        holdings.insert(
            ip,
            Holding {
                interface: h.interface.clone(),
                epoch: h.epoch,
                since: h.since.clone().unwrap_or_default(),
                reason: h.reason.clone().unwrap_or_default(),
            },
        );
        adopted.push(ip);
    }
    adopted
}

/// An address to remove from an interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Release {
    pub ifindex: u32,
    pub interface: String,
    pub ip: IpAddr,
    pub prefix_len: u8,
}

/// The egress addresses to remove now: every address on an interface that this agent may
/// remove (`removable`: egress IPs that a policy names, that this node holds or published
/// as held) and that `desired` does not hold, dedicated, on that very interface. Other
/// addresses (the node's own, shared egress IPs, anything an operator added) stay.
pub fn to_release(
    ifaces: &[crate::iface::Interface],
    desired: &Desired,
    removable: &BTreeSet<IpAddr>,
) -> Vec<Release> {
    let mut out = Vec::new();
    for i in ifaces {
        for (a, len) in &i.addresses {
            let ours = match a {
                IpAddr::V4(a) => desired.v4.egress_ips.get(a),
                IpAddr::V6(a) => desired.v6.egress_ips.get(a),
            }
            .is_some_and(|h| !h.shared && h.interface == i.name);
            if removable.contains(a) && !ours {
                out.push(Release {
                    ifindex: i.ifindex,
                    interface: i.name.clone(),
                    ip: *a,
                    prefix_len: *len,
                });
            }
        }
    }
    out
}

/// What to do now about an egress IP the compiler gives this node and that is not on its
/// interface yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Take {
    /// Not before this agent has heard its peers (agents that start together would each
    /// elect from a different partial view).
    AfterWarmUp,
    /// `holder`, a live node, still claims it (a planned move): wait until it lets go,
    /// for one detection time at most, counted from `since`.
    AfterHandover { holder: String, since: Instant },
    /// Add it now. `probe`: a first claim, to be checked for another host answering for
    /// it (moves between our gateways are not probed: failover must not wait);
    /// `overdue`: the previous holder that still claims it after the detection time.
    Now {
        probe: bool,
        overdue: Option<String>,
    },
}

/// When to add `ip` (assigned for `reason`): `warm_at` is when this agent has heard its
/// peers, `waiting_since` when it started waiting for another claimant to let go, if it
/// did, and `detection` the longest such a wait may last.
#[allow(clippy::too_many_arguments)]
pub fn take(
    ip: IpAddr,
    reason: &str,
    me: &str,
    peers: &PeerView,
    now: Instant,
    warm_at: Instant,
    waiting_since: Option<Instant>,
    detection: Duration,
) -> Take {
    if now < warm_at {
        return Take::AfterWarmUp;
    }
    let claimant = other_claimant(ip, me, peers).map(str::to_owned);
    if let Some(holder) = &claimant {
        let since = waiting_since.unwrap_or(now);
        if now.duration_since(since) < detection {
            return Take::AfterHandover {
                holder: holder.clone(),
                since,
            };
        }
    }
    Take::Now {
        probe: reason == crate::compiler::move_reason::ASSIGNED && claimant.is_none(),
        overdue: claimant,
    }
}

/// What this node says it holds, for its hellos.
pub fn claims(holdings: &BTreeMap<IpAddr, Holding>) -> BTreeMap<IpAddr, Claim> {
    holdings
        .iter()
        .map(|(ip, h)| {
            (
                *ip,
                Claim {
                    interface: h.interface.clone(),
                    epoch: h.epoch,
                },
            )
        })
        .collect()
}

/// Names of the interfaces that are down, of those a node publishes.
pub fn down_interfaces<'a>(ifaces: impl IntoIterator<Item = (&'a str, bool)>) -> BTreeSet<String> {
    ifaces
        .into_iter()
        .filter(|(_, up)| !up)
        .map(|(n, _)| n.to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::liveness::Report;

    fn desired_holding(ip: Ipv4Addr, rule: u32) -> Desired {
        let mut d = Desired::default();
        d.v4.egress_ips.insert(
            ip,
            HeldIp {
                interface: "sec-a".into(),
                prefix_len: 24,
                shared: false,
            },
        );
        d.v4.rules.insert(
            rule,
            GatewayRule {
                egress_ip: ip,
                interface: "sec-a".into(),
            },
        );
        d.egress_interfaces.insert("sec-a".into());
        d
    }

    #[test]
    fn a_released_ip_keeps_its_rules_and_egress_ip_entry_while_it_lingers() {
        let a = Ipv4Addr::new(192, 168, 101, 50);
        let before = desired_holding(a, 7);
        let parts = gateway_parts(&before);
        let lingering = BTreeMap::from([(
            IpAddr::V4(a),
            Lingering {
                until: Instant::now() + LINGER,
                part: parts[&IpAddr::V4(a)].clone(),
            },
        )]);
        let after = with_lingering(&Desired::default(), &lingering);
        assert_eq!(after.v4.egress_ips, before.v4.egress_ips);
        assert_eq!(after.v4.rules, before.v4.rules);
        assert!(after.egress_interfaces.contains("sec-a"));
    }

    #[test]
    fn what_is_current_wins_over_what_lingers() {
        let a = Ipv4Addr::new(192, 168, 101, 50);
        let b = Ipv4Addr::new(192, 168, 101, 60);
        let parts = gateway_parts(&desired_holding(a, 7));
        let lingering = BTreeMap::from([(
            IpAddr::V4(a),
            Lingering {
                until: Instant::now(),
                part: parts[&IpAddr::V4(a)].clone(),
            },
        )]);
        // Rule 7 now serves another egress IP: it keeps it.
        let now = desired_holding(b, 7);
        let merged = with_lingering(&now, &lingering);
        assert_eq!(merged.v4.rules[&7].egress_ip, b);
        assert!(merged.v4.egress_ips.contains_key(&a));
    }

    #[test]
    fn a_restarted_agent_adopts_what_its_egress_node_says_and_its_interfaces_show() {
        let published = [
            crate::api::HeldEgressIp {
                ip: "192.168.101.50".into(),
                interface: "sec-a".into(),
                epoch: 4,
                since: Some("2026-11-30T12:00:00Z".into()),
                reason: Some("HolderUnreachable".into()),
            },
            // Published, but no longer on the interface (released before the restart).
            crate::api::HeldEgressIp {
                ip: "192.168.102.50".into(),
                interface: "sec-b".into(),
                epoch: 2,
                ..Default::default()
            },
        ];
        let mut holdings = BTreeMap::new();
        let present = |ifc: &str, ip: IpAddr| ifc == "sec-a" && ip.to_string() == "192.168.101.50";
        let adopted = adopt(&mut holdings, &published, present);
        assert_eq!(adopted.len(), 1);
        let h = &holdings[&"192.168.101.50".parse::<IpAddr>().expect("ip")];
        assert_eq!((h.epoch, h.reason.as_str()), (4, "HolderUnreachable"));
        assert!(adopt(&mut holdings, &published, present).is_empty(), "once");
    }

    /// A peer's report that claims `ip` on sec-a at epoch 1.
    fn claiming(ip: IpAddr) -> Report {
        Report {
            claims: BTreeMap::from([(
                ip,
                Claim {
                    interface: "sec-a".into(),
                    epoch: 1,
                },
            )]),
            ..Report::default()
        }
    }

    #[test]
    fn a_handover_waits_for_a_live_claimant_only() {
        let ip: IpAddr = "192.168.101.50".parse().expect("ip");
        let claim = claiming(ip);
        let mut peers = PeerView::default();
        peers.reports.insert("gw1".into(), claim.clone());
        assert_eq!(other_claimant(ip, "gw2", &peers), Some("gw1"));
        assert_eq!(other_claimant(ip, "gw1", &peers), None, "not myself");
        peers.dead.insert("gw1".into());
        assert_eq!(
            other_claimant(ip, "gw2", &peers),
            None,
            "the dead hold nothing"
        );
        peers.dead.clear();
        peers.reports.insert(
            "gw1".into(),
            Report {
                cut_off: true,
                ..claim
            },
        );
        assert_eq!(other_claimant(ip, "gw2", &peers), None, "nor the cut off");
    }

    fn iface(name: &str, ifindex: u32, addresses: &[(&str, u8)]) -> crate::iface::Interface {
        crate::iface::Interface::up_for_test(name, ifindex, addresses)
    }

    #[test]
    fn release_removes_only_removable_addresses_not_held_here_on_their_interface() {
        let a: Ipv4Addr = "192.168.101.50".parse().unwrap();
        let desired = desired_holding(a, 1);
        let ifaces = [
            iface(
                "sec-a",
                3,
                &[
                    ("192.168.101.12", 24),
                    ("192.168.101.50", 24),
                    ("192.168.101.51", 24),
                ],
            ),
            // A held on the wrong interface (moved there by hand): removed there.
            iface(
                "sec-b",
                4,
                &[("192.168.102.12", 24), ("192.168.101.50", 32)],
            ),
        ];
        let removable: BTreeSet<IpAddr> = ["192.168.101.50", "192.168.101.51", "192.168.102.99"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        let out = to_release(&ifaces, &desired, &removable);
        let got: Vec<(u32, String, u8)> = out
            .iter()
            .map(|r| (r.ifindex, r.ip.to_string(), r.prefix_len))
            .collect();
        assert_eq!(
            got,
            [
                (3, "192.168.101.51".to_owned(), 24),
                (4, "192.168.101.50".to_owned(), 32)
            ],
            "the held IP stays on its interface; the node's own and unnamed addresses stay"
        );

        assert!(
            to_release(&ifaces, &desired, &BTreeSet::new()).is_empty(),
            "nothing the agent may not remove"
        );
    }

    #[test]
    fn taken_after_the_warm_up_and_a_live_claimants_handover_of_one_detection_time_at_most() {
        use crate::compiler::move_reason::{ASSIGNED, REASSIGNED};
        let ip: IpAddr = "192.168.101.50".parse().unwrap();
        let t0 = Instant::now();
        let detection = Duration::from_millis(400);
        let at = |ms| t0 + Duration::from_millis(ms);
        let none = PeerView::default();
        let mut claimed = PeerView::default();
        claimed.reports.insert("gw1".into(), claiming(ip));
        let take_at = |peers: &PeerView, now, waiting, reason| {
            take(ip, reason, "gw2", peers, now, at(100), waiting, detection)
        };
        assert_eq!(take_at(&none, at(50), None, ASSIGNED), Take::AfterWarmUp);
        assert_eq!(
            take_at(&none, at(100), None, ASSIGNED),
            Take::Now {
                probe: true,
                overdue: None
            },
            "a first claim nobody else makes is probed"
        );
        assert_eq!(
            take_at(&none, at(100), None, REASSIGNED),
            Take::Now {
                probe: false,
                overdue: None
            },
            "a move between gateways is not"
        );
        assert_eq!(
            take_at(&claimed, at(200), None, ASSIGNED),
            Take::AfterHandover {
                holder: "gw1".into(),
                since: at(200)
            },
            "a live claimant: wait, from now"
        );
        assert_eq!(
            take_at(&claimed, at(500), Some(at(200)), ASSIGNED),
            Take::AfterHandover {
                holder: "gw1".into(),
                since: at(200)
            },
            "still within one detection time"
        );
        assert_eq!(
            take_at(&claimed, at(600), Some(at(200)), ASSIGNED),
            Take::Now {
                probe: false,
                overdue: Some("gw1".into())
            },
            "overdue: taken without a probe (the claimant would answer it)"
        );
    }
}
