//! Destinations learned from routes: what a rule learns from the routes of each gateway
//! that may serve it, and the conditions when they are left out or disagree.

use std::{collections::BTreeMap, net::IpAddr};

use super::{Context, Gateways, MAX_ROUTES_NAMED, RuleAt, interface_gateways, interface_not_found};
use crate::compiler::{
    nodes::NodeInfo,
    plans::{Destinations, Target},
    reason,
    routes::{self, Prefixes},
    status::PolicyReport,
};

/// An interface rule whose destinations are learned from the routes out of `interface`.
pub(super) struct LearnOn<'a, 'r> {
    pub(super) at: &'a RuleAt<'r>,
    pub(super) interface: &'a str,
    pub(super) include_default: bool,
}

impl LearnOn<'_, '_> {
    /// The destinations and target of each family (IPv4, IPv6): an interface routes both.
    pub(super) fn per_family(
        &self,
        gateways: &Gateways<'_, '_>,
        cx: &Context<'_, '_>,
        report: &mut PolicyReport,
    ) -> [(Destinations, Target); 2] {
        let (at, interface) = (self.at, self.interface);
        let families = [false, true].map(|v6| (v6, interface_gateways(interface, v6, gateways)));
        let none_served = families.iter().all(|(_, served)| served.is_none());
        if none_served {
            interface_not_found(at.index, interface, None, gateways, report);
        }
        let selected: Vec<_> = gateways
            .selected_nodes
            .iter()
            .map(|n| (n.name, interface.to_owned()))
            .collect();
        families.map(|(v6, served)| {
            let serving: Vec<_> = served
                .iter()
                .flat_map(|g| g.keys())
                .map(|name| (name.as_str(), interface.to_owned()))
                .collect();
            let learn = Learn {
                v6,
                include_default: self.include_default,
            };
            let destinations = learn.destinations(at, &serving, &selected, cx, report);
            // Routed out of the interface, but no gateway has an address of the family
            // there to SNAT to: those follow the failure policy.
            let stranded = match &destinations {
                Destinations::Learned { fallback, .. } => fallback.forwards().next().is_some(),
                Destinations::Listed(_) => false,
            };
            if served.is_none() && !none_served && stranded {
                interface_not_found(at.index, interface, Some(v6), gateways, report);
            }
            let target = served.map_or(Target::None, |gateways| Target::Interface { gateways });
            (destinations, target)
        })
    }
}

/// The nodes among `nodes` with an up interface whose subnet hosts one of `ips` (the
/// first that one hosts), and that interface.
pub(super) fn hosting<'a>(nodes: &[&NodeInfo<'a>], ips: &[IpAddr]) -> Vec<(&'a str, String)> {
    nodes
        .iter()
        .filter_map(|n| {
            let egress = n.egress.as_ref()?;
            let (iface, _) = ips.iter().find_map(|ip| egress.hosting_interface(*ip))?;
            Some((n.name, iface.to_owned()))
        })
        .collect()
}

/// How a rule learns its destinations from routes, for one family.
pub(super) struct Learn {
    pub(super) v6: bool,
    pub(super) include_default: bool,
}

impl Learn {
    /// What the rule learns from each gateway that may serve it (`serving`: node and
    /// interface), and from every selected one for when none serves it (`selected`),
    /// with the conditions: routes left out, gateways that disagree, nothing learned.
    pub(super) fn destinations(
        &self,
        at: &RuleAt<'_>,
        serving: &[(&str, String)],
        selected: &[(&str, String)],
        cx: &Context<'_, '_>,
        report: &mut PolicyReport,
    ) -> Destinations {
        let index = at.index;
        let learn = |name: &str, iface: &str| {
            let node = cx.nodes.iter().find(|n| n.name == name)?;
            Some(routes::learn(
                node,
                iface,
                self.v6,
                self.include_default,
                &at.checked.except,
                cx.reserved,
            ))
        };
        let mut by_node = BTreeMap::new();
        for (name, iface) in serving {
            let Some(learned) = learn(name, iface) else {
                continue;
            };
            report_left_out(index, name, iface, &learned, report);
            by_node.insert((*name).to_owned(), learned.prefixes);
        }
        if let Some((_, iface)) = serving.first() {
            for d in routes::disagreements(&by_node) {
                report.routes(
                    reason::ROUTES_DISAGREE,
                    format!("rules[{index}].destinationsFrom: out of {iface}, {d}"),
                );
            }
        }
        let others: Vec<Prefixes> = selected
            .iter()
            .filter(|(name, _)| !by_node.contains_key(*name))
            .filter_map(|(name, iface)| learn(name, iface))
            .map(|l| l.prefixes)
            .collect();
        let fallback = routes::union(by_node.values().chain(&others));
        let learned_any = by_node.values().any(|p| p.forwards().next().is_some());
        if !by_node.is_empty() && !learned_any {
            report.unready(
                reason::NO_ROUTES,
                format!(
                    "rules[{index}].destinationsFrom: no gateway that may serve it routes an \
                     {} prefix out of its interface",
                    if self.v6 { "IPv6" } else { "IPv4" }
                ),
            );
        }
        Destinations::Learned { by_node, fallback }
    }
}

/// What a gateway's routes leave out of a rule's learned destinations (`rules[index]`,
/// out of `iface` of node `name`): routes that overlap the cluster, and routes over the
/// cap.
fn report_left_out(
    index: usize,
    name: &str,
    iface: &str,
    learned: &routes::Learned,
    report: &mut PolicyReport,
) {
    if !learned.overlapping.is_empty() {
        let count = learned.overlapping.len();
        let mut named: Vec<String> = learned
            .overlapping
            .iter()
            .take(MAX_ROUTES_NAMED)
            .map(|(route, what)| format!("{route} ({what})"))
            .collect();
        if count > MAX_ROUTES_NAMED {
            named.push(format!("and {} more", count - MAX_ROUTES_NAMED));
        }
        report.routes(
            reason::ROUTES_OVERLAP_CLUSTER,
            format!(
                "rules[{index}].destinationsFrom: {name} routes {} out of {iface}, \
                 which overlap the cluster: ignored",
                named.join(", ")
            ),
        );
    }
    if learned.omitted > 0 {
        report.routes(
            reason::ROUTES_TRUNCATED,
            format!(
                "rules[{index}].destinationsFrom: {name} has more routes than it \
                 publishes ({} left out, over the cap of {}): traffic to those is \
                 not steered; summarize the routes",
                learned.omitted,
                crate::api::MAX_ROUTES
            ),
        );
    }
}
