//! Placement: each policy checked and resolved into a plan ([`super::plans`]): its
//! selectors, its eligible gateways, each rule's destinations (listed, or learned from
//! routes: [`learning`]) and target (the holders of its egress IPs, elected in
//! [`election`], or the gateways serving its interface).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};

use super::{
    hash,
    nodes::{DRAIN_ANNOTATION, NodeInfo},
    plans::{Destinations, GatewayAddr, PolicyPlan, RulePlan, Target},
    reason,
    routes::{Prefixes, Reserved},
    rules::{self, CheckedRule},
    status::PolicyReport,
};
use crate::{
    api::{EgressGatewayPolicy, EgressGatewayPolicySpec, FullPolicyMap, PodScope},
    liveness::PeerView,
    selector::Selector,
};

mod election;
mod learning;

use election::{Placed, place_egress_ips};
use learning::{Learn, LearnOn, hosting};

/// Plan every policy (sorted by name). The first policy (in name order) that can place an
/// egress IP decides where it lives; later users must agree.
///
/// A policy whose spec is not accepted but that was accepted before (`last_accepted`, by
/// name) is planned from that last accepted spec: its traffic keeps the translation it
/// had, and its status says what to fix.
pub(super) fn plan<'a>(
    policies: &[&'a EgressGatewayPolicy],
    last_accepted: &'a BTreeMap<String, EgressGatewayPolicy>,
    nodes: &[NodeInfo<'_>],
    peers: &PeerView,
    reserved: &Reserved<'_>,
    foreign: &BTreeMap<IpAddr, String>,
    full_maps: &[(&str, &FullPolicyMap)],
) -> Vec<PolicyPlan<'a>> {
    let chosen: Vec<(
        &EgressGatewayPolicy,
        Option<(&EgressGatewayPolicy, PolicyReport)>,
    )> = policies
        .iter()
        .map(|policy| {
            let name = policy.metadata.name.as_deref().unwrap_or_default();
            let fresh = validate(&policy.spec);
            match last_accepted.get(name) {
                Some(last) if !fresh.accepted() && last.spec != policy.spec => {
                    (*policy, Some((last, fresh)))
                }
                _ => (*policy, None),
            }
        })
        .collect();
    let spec_of = |(policy, last): &(
        &'a EgressGatewayPolicy,
        Option<(&'a EgressGatewayPolicy, PolicyReport)>,
    )| { last.as_ref().map_or(&policy.spec, |(l, _)| &l.spec) };
    let ids = hash::wire_ids(chosen.iter().flat_map(|c| {
        let name = c.0.metadata.name.as_deref().unwrap_or_default();
        spec_of(c)
            .rules
            .iter()
            .enumerate()
            .flat_map(move |(i, rule)| {
                let listed = rule.egress_ip.is_none() && !rule.egress_ips.is_empty();
                // The first address takes the rule's own id (as `egressIP` has it): a
                // rule that goes from `egressIP: A` to `egressIPs: [A, ...]` keeps A's.
                let addresses = rule.dedicated_ips().skip(1).filter(move |_| listed);
                std::iter::once((name.to_owned(), i, None))
                    .chain(addresses.map(move |ip| (name.to_owned(), i, Some(ip))))
            })
    }));
    let mut placed = Placed::new();
    let owners = egress_ip_owners(chosen.iter().map(|c| (c.0, spec_of(c))));
    let context = Context {
        nodes,
        peers,
        reserved,
        foreign,
        owners: &owners,
        full_maps,
    };
    chosen
        .into_iter()
        .map(|(policy, last)| {
            let spec = last.as_ref().map_or(&policy.spec, |(l, _)| &l.spec);
            let mut plan = plan_policy(policy, spec, &ids, &context, &mut placed);
            if let Some((last, fresh)) = last {
                plan.report
                    .serve_last_accepted(fresh, last.metadata.generation);
                plan.accepted = Some(last);
            }
            plan
        })
        .collect()
}

/// The static problems of a spec: what makes a policy `Accepted=False`.
fn validate(spec: &EgressGatewayPolicySpec) -> PolicyReport {
    let mut report = PolicyReport::default();
    let selectors = [
        (spec.namespace_selector.as_ref(), "spec.namespaceSelector"),
        (spec.pod_selector.as_ref(), "spec.podSelector"),
    ];
    let checked = selectors
        .into_iter()
        .filter_map(|(sel, field)| Some(Selector::new(sel?, field)))
        .chain([Selector::gateways(&spec.gateway_selector)]);
    for message in checked.filter_map(Result::err) {
        report.invalid(reason::INVALID_SELECTOR, message);
    }
    if spec.rules.is_empty() {
        report.invalid(reason::NO_RULES, NO_RULES_MESSAGE.to_owned());
    }
    for (index, rule) in spec.rules.iter().enumerate() {
        rules::check_rule(index, rule, &mut report);
    }
    rules::check_addresses_across_rules(&spec.rules, &mut report);
    report
}

const NO_RULES_MESSAGE: &str = "spec.rules: at least one rule is required";

/// Dedicated egress IP -> the policy it belongs to, and the other policies that name it.
type Owners = BTreeMap<IpAddr, (String, Vec<String>)>;

/// Who owns each dedicated egress IP that `policies` (with the specs they are planned
/// from) name: the oldest policy that names it (by `metadata.creationTimestamp`; a policy
/// without one, as a YAML directory may have, after those with one; ties by name). An
/// egress IP belongs to one policy: another policy's pods never leave with it, whatever
/// the names, and both say so (`Conflict=True`).
fn egress_ip_owners<'a>(
    policies: impl Iterator<Item = (&'a EgressGatewayPolicy, &'a EgressGatewayPolicySpec)>,
) -> Owners {
    // Sorted oldest first: (no timestamp, timestamp, name).
    type Age<'a> = (bool, Option<&'a Time>, &'a str);
    let mut naming: BTreeMap<IpAddr, BTreeSet<Age<'a>>> = BTreeMap::new();
    for (policy, spec) in policies {
        let name = policy.metadata.name.as_deref().unwrap_or_default();
        let created = policy.metadata.creation_timestamp.as_ref();
        for rule in &spec.rules {
            for ip in rule.dedicated_ips() {
                naming
                    .entry(ip)
                    .or_default()
                    .insert((created.is_none(), created, name));
            }
        }
    }
    naming
        .into_iter()
        .map(|(ip, names)| {
            let mut names = names.into_iter().map(|(_, _, n)| n.to_owned());
            let owner = names.next().unwrap_or_default();
            let mut others: Vec<String> = names.filter(|n| *n != owner).collect();
            others.sort();
            others.dedup();
            (ip, (owner, others))
        })
        .collect()
}

/// What placing a policy reads.
struct Context<'c, 'a> {
    nodes: &'c [NodeInfo<'a>],
    peers: &'c PeerView,
    reserved: &'c Reserved<'a>,
    /// Who owns each dedicated egress IP ([`egress_ip_owners`]).
    owners: &'c Owners,
    /// Egress addresses other implementations claim (OVN-Kubernetes `EgressIP`s), with
    /// whose they are.
    foreign: &'c BTreeMap<IpAddr, String>,
    /// The policy maps agents could not fit ([`super::nodes::full_policy_maps`]).
    full_maps: &'c [(&'c str, &'c FullPolicyMap)],
}

/// Plan `policy` with `spec` (its own, or its last accepted one).
fn plan_policy<'a>(
    policy: &'a EgressGatewayPolicy,
    spec: &EgressGatewayPolicySpec,
    ids: &BTreeMap<hash::WireKey, u32>,
    cx: &Context<'_, '_>,
    placed: &mut Placed,
) -> PolicyPlan<'a> {
    let name = policy.metadata.name.clone().unwrap_or_default();
    let mut report = PolicyReport::default();
    let (selectors, gw_sel) = selectors(spec, &mut report);
    if spec.rules.is_empty() {
        report.invalid(reason::NO_RULES, NO_RULES_MESSAGE.to_owned());
    }
    let gateways = gw_sel
        .map(|sel| Gateways::select(&sel, cx.nodes, &mut report))
        .unwrap_or_default();
    let mut rules = Vec::new();
    let sharing = rules::check_addresses_across_rules(&spec.rules, &mut report);
    for (index, rule) in spec.rules.iter().enumerate() {
        let id_of = |ip| ids.get(&(name.clone(), index, ip)).copied().unwrap_or(0);
        let rule_id = id_of(None);
        let Some(mut checked) = rules::check_rule(index, rule, &mut report) else {
            rules.push(RulePlan {
                index,
                rule_id,
                destinations: Destinations::Listed(Prefixes::default()),
                target: Target::None,
            });
            continue;
        };
        // Said by check_addresses_across_rules: no gateway, the failure policy.
        checked.valid &= !sharing.contains(&index);
        let listed = rule.egress_ip.is_none() && !rule.egress_ips.is_empty();
        // The first address takes the rule's own id (see `plan`).
        let addresses: Vec<(IpAddr, u32)> = checked
            .egress_ips
            .iter()
            .enumerate()
            .map(|(k, ip)| {
                (
                    *ip,
                    if listed && k > 0 {
                        id_of(Some(*ip))
                    } else {
                        rule_id
                    },
                )
            })
            .collect();
        let at = RuleAt {
            policy: &name,
            index,
            checked: &checked,
            listed,
        };
        let ids = (rule_id, addresses.as_slice());
        rules.extend(plan_rule(&at, ids, &gateways, cx, placed, &mut report));
    }
    report_full_maps(&name, cx.full_maps, &mut report);
    let accepted = report.accepted().then_some(policy);
    PolicyPlan {
        name,
        policy,
        selectors,
        failure_policy: spec.failure_policy,
        rules,
        report,
        accepted,
    }
}

/// A node's policy map that its agent could not fit, naming `policy` among those that
/// select the pods left out ([`super::nodes::full_policy_maps`]), makes it `Ready=False`.
fn report_full_maps(policy: &str, full: &[(&str, &FullPolicyMap)], report: &mut PolicyReport) {
    for (node, map) in full
        .iter()
        .filter(|(_, m)| m.policies.iter().any(|p| p == policy))
    {
        report.unready(
            reason::POLICY_MAP_FULL,
            format!(
                "node {node}: map {} is full at {} entries: the entries of {} selected \
                 pods there (some selected by this policy) are left out and their traffic \
                 to the destinations a rule covers is dropped (DROP_POLICY_MAP_FULL); \
                 raise --policy-map-entries on the agents, or select fewer pods or \
                 prefixes",
                map.map, map.capacity, map.pods_left_out
            ),
        );
    }
}

/// A spec's (namespace, pod) selectors, when both are valid (a missing one selects
/// everything), and its gatewaySelector, when valid; the invalid ones are reported.
fn selectors(
    spec: &EgressGatewayPolicySpec,
    report: &mut PolicyReport,
) -> (Option<(Selector, Selector)>, Option<Selector>) {
    let mut selector = |sel: Option<&LabelSelector>, field: &str| match sel {
        None => Some(Selector::everything()),
        Some(sel) => match Selector::new(sel, field) {
            Ok(s) => Some(s),
            Err(message) => {
                report.invalid(reason::INVALID_SELECTOR, message);
                None
            }
        },
    };
    let ns_sel = selector(spec.namespace_selector.as_ref(), "spec.namespaceSelector");
    let pod_sel = selector(spec.pod_selector.as_ref(), "spec.podSelector");
    let gw_sel = match Selector::gateways(&spec.gateway_selector) {
        Ok(s) => Some(s),
        Err(message) => {
            report.invalid(reason::INVALID_SELECTOR, message);
            None
        }
    };
    (ns_sel.zip(pod_sel), gw_sel)
}

/// The nodes a policy's gatewaySelector matches, and those of them that are eligible.
#[derive(Default)]
struct Gateways<'n, 'a> {
    eligible: Vec<&'n NodeInfo<'a>>,
    selected: BTreeSet<&'a str>,
    selected_nodes: Vec<&'n NodeInfo<'a>>,
}

impl<'n, 'a> Gateways<'n, 'a> {
    /// Eligible: Ready, heard by the probes, not drained, with an EgressNode whose agent
    /// holds every pod (`podScope` not `Node`) and an underlay address. Says why none
    /// is, when none is.
    fn select(sel: &Selector, nodes: &'n [NodeInfo<'a>], report: &mut PolicyReport) -> Self {
        let candidates: Vec<&NodeInfo<'_>> =
            nodes.iter().filter(|n| sel.matches(&n.labels)).collect();
        let mut out = Self {
            eligible: Vec::new(),
            selected: candidates.iter().map(|n| n.name).collect(),
            selected_nodes: candidates.clone(),
        };
        let mut why_not = Vec::new();
        for node in candidates {
            if !node.ready {
                why_not.push(format!("{} is not Ready", node.name));
            } else if node.dead {
                why_not.push(format!(
                    "{} is unreachable (no probe heard within the detection time)",
                    node.name
                ));
            } else if node.drained {
                why_not.push(format!(
                    "{} is drained ({DRAIN_ANNOTATION} or cordoned)",
                    node.name
                ));
            } else if node.egress.is_none() {
                why_not.push(format!(
                    "{} has no EgressNode (is its agent running?)",
                    node.name
                ));
            } else if node
                .egress
                .as_ref()
                .is_some_and(|e| e.pod_scope == PodScope::Node)
            {
                why_not.push(format!(
                    "{} is still listing the cluster's pods (its EgressNode says podScope: \
                     Node: its agent watched only its own node's pods when it last wrote its \
                     maps)",
                    node.name
                ));
            } else if node.underlay.is_none() {
                why_not.push(format!("{} has no InternalIP address", node.name));
            } else {
                out.eligible.push(node);
            }
        }
        if out.selected.is_empty() {
            report.unready(
                reason::NO_MATCHING_GATEWAY,
                "spec.gatewaySelector: matches no node".to_owned(),
            );
        } else if out.eligible.is_empty() {
            report.unready(
                reason::NO_ELIGIBLE_GATEWAY,
                format!(
                    "spec.gatewaySelector: no selected node is eligible: {}",
                    why_not.join(", ")
                ),
            );
        }
        out
    }

    fn names(&self) -> String {
        self.eligible
            .iter()
            .map(|n| n.name)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Which rule is being placed.
struct RuleAt<'r> {
    policy: &'r str,
    index: usize,
    checked: &'r CheckedRule,
    /// Its addresses are an `egressIPs` list.
    listed: bool,
}

impl RuleAt<'_> {
    /// The field naming the rule's `k`th dedicated address.
    fn address_field(&self, k: usize) -> String {
        if self.listed {
            format!("rules[{}].egressIPs[{k}]", self.index)
        } else {
            format!("rules[{}].egressIP", self.index)
        }
    }
}

/// The plans of one checked rule: one, or one per family for an interface rule whose
/// destinations are learned (an interface routes both).
fn plan_rule(
    at: &RuleAt<'_>,
    (rule_id, addresses): (u32, &[(IpAddr, u32)]),
    gateways: &Gateways<'_, '_>,
    cx: &Context<'_, '_>,
    placed: &mut Placed,
    report: &mut PolicyReport,
) -> Vec<RulePlan> {
    let checked = at.checked;
    // Listed destinations never take the cluster's own traffic: carved out, and said.
    let (carved, covering) =
        Prefixes::listed_carved(&checked.destinations, &checked.except, cx.reserved);
    for (i, destination, what) in covering {
        let count = what.len();
        let mut named: Vec<String> = what.into_iter().take(MAX_ROUTES_NAMED).collect();
        if count > MAX_ROUTES_NAMED {
            named.push(format!("and {} more", count - MAX_ROUTES_NAMED));
        }
        report.cluster(format!(
            "rules[{}].destinations[{i}]: {destination} covers the cluster's own addresses \
             ({}): traffic to them is never steered to a gateway",
            at.index,
            named.join(", ")
        ));
    }
    let plan = |(destinations, target)| RulePlan {
        index: at.index,
        rule_id,
        destinations: match destinations {
            Destinations::Listed(_) => Destinations::Listed(carved.clone()),
            learned => learned,
        },
        target,
    };
    if !checked.valid {
        return vec![plan((listed(at), Target::None))];
    }
    match (addresses.first(), checked.interface.as_deref()) {
        (Some((first, _)), None) => {
            let placed = place_egress_ips(at, addresses, gateways, cx, placed, report);
            let destinations = match checked.from_routes {
                None => listed(at),
                Some(include_default) => {
                    let ips: Vec<IpAddr> = addresses.iter().map(|(ip, _)| *ip).collect();
                    let serving = hosting(&gateways.eligible, &ips);
                    let selected = hosting(&gateways.selected_nodes, &ips);
                    let learn = Learn {
                        v6: first.is_ipv6(),
                        include_default,
                    };
                    learn.destinations(at, &serving, &selected, cx, report)
                }
            };
            vec![plan((
                destinations,
                Target::Dedicated { addresses: placed },
            ))]
        }
        (None, Some(interface)) => match checked.from_routes {
            None => vec![plan(listed_on_interface(at, interface, gateways, report))],
            Some(include_default) => {
                let learn = LearnOn {
                    at,
                    interface,
                    include_default,
                };
                learn
                    .per_family(gateways, cx, report)
                    .into_iter()
                    .map(plan)
                    .collect()
            }
        },
        _ => vec![plan((listed(at), Target::None))],
    }
}

/// A rule's listed destinations (and except prefixes).
fn listed(at: &RuleAt<'_>) -> Destinations {
    Destinations::Listed(Prefixes::listed(
        &at.checked.destinations,
        &at.checked.except,
    ))
}

/// An interface rule's listed destinations, through the gateways with an address of the
/// rule's family on `interface` (none found: reported).
fn listed_on_interface(
    at: &RuleAt<'_>,
    interface: &str,
    gateways: &Gateways<'_, '_>,
    report: &mut PolicyReport,
) -> (Destinations, Target) {
    let v6 = at.checked.v6;
    let served = interface_gateways(interface, v6, gateways);
    if served.is_none() {
        interface_not_found(at.index, interface, Some(v6), gateways, report);
    }
    let target = served.map_or(Target::None, |gateways| Target::Interface { gateways });
    (listed(at), target)
}

/// Most routes named per gateway in a condition about overlapping routes.
const MAX_ROUTES_NAMED: usize = 3;

/// The eligible gateways with an up `interface` that has an address of the family
/// (`v6`), by node name; `None` when there is none.
fn interface_gateways(
    interface: &str,
    v6: bool,
    gateways: &Gateways<'_, '_>,
) -> Option<BTreeMap<String, GatewayAddr>> {
    let serving: BTreeMap<String, GatewayAddr> = gateways
        .eligible
        .iter()
        .filter_map(|n| {
            let (ip, prefix_len) = n.egress.as_ref()?.own_address(interface, v6)?;
            Some((
                n.name.to_owned(),
                GatewayAddr::new(n, n.underlay?, interface, ip, prefix_len),
            ))
        })
        .collect();
    (!serving.is_empty()).then_some(serving)
}

/// No eligible gateway has `interface` with an address of the family (`v6`; `None`:
/// of either family). Said once for the policy when no gateway is eligible at all.
fn interface_not_found(
    index: usize,
    interface: &str,
    v6: Option<bool>,
    gateways: &Gateways<'_, '_>,
    report: &mut PolicyReport,
) {
    if gateways.eligible.is_empty() {
        return;
    }
    report.unready(
        reason::INTERFACE_NOT_FOUND,
        format!(
            "rules[{index}].interface: no eligible gateway ({}) has an up interface \
             {interface} with {} address",
            gateways.names(),
            match v6 {
                Some(true) => "a global IPv6",
                Some(false) => "an IPv4",
                None => "an",
            }
        ),
    );
}
