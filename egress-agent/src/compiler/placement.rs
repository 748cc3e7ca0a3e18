//! Placement: each policy checked and resolved into a plan (its selectors, its eligible
//! gateways, each rule's target: the holder of its egress IP, or the gateways serving its
//! interface).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};

use super::{
    DRAIN_ANNOTATION, Selector, hash, move_reason,
    nodes::NodeInfo,
    reason,
    routes::{self, Prefixes, Reserved},
    rules::{self, CheckedRule},
    status::{PolicyReport, Reported},
};
use crate::{
    api::{EgressGatewayPolicy, EgressGatewayPolicySpec, FailurePolicy, PodScope},
    liveness::PeerView,
};

/// A policy checked and resolved.
pub(super) struct PolicyPlan<'a> {
    pub(super) name: String,
    pub(super) policy: &'a EgressGatewayPolicy,
    /// (namespace, pod) selectors, when both are valid.
    pub(super) selectors: Option<(Selector, Selector)>,
    pub(super) failure_policy: FailurePolicy,
    pub(super) rules: Vec<RulePlan>,
    /// Its conditions, as far as they are known.
    pub(super) report: PolicyReport,
    /// The accepted version it is planned from: itself, or its last accepted version;
    /// `None` when it is not accepted and was never accepted before.
    pub(super) accepted: Option<&'a EgressGatewayPolicy>,
}

impl PolicyPlan<'_> {
    /// What its status is made of.
    pub(super) fn reported(&self) -> Reported<'_> {
        Reported {
            name: &self.name,
            generation: self.policy.metadata.generation,
            rules: self.rules.len(),
            report: &self.report,
        }
    }
}

/// A rule checked and resolved (for one family, when its destinations are learned from
/// an interface's routes: such a rule serves both, as two plans with one index and id).
pub(super) struct RulePlan {
    pub(super) index: usize,
    pub(super) rule_id: u32,
    pub(super) destinations: Destinations,
    pub(super) target: Target,
}

/// A rule's prefixes; each applies to the pod addresses of its family.
pub(super) enum Destinations {
    /// Listed destination and except prefixes that parsed (one family unless the rule is
    /// invalid).
    Listed(Prefixes),
    /// Learned from the routes of each gateway that may serve the rule (by node name);
    /// `fallback` when none serves it.
    Learned {
        by_node: BTreeMap<String, Prefixes>,
        fallback: Prefixes,
    },
}

pub(super) enum Target {
    /// Dedicated egress IPs (`egressIP`, or each of `egressIPs`) and their holders.
    Dedicated { addresses: Vec<Dedicated> },
    /// An interface rule and the gateways serving it, by node name.
    Interface {
        gateways: BTreeMap<String, GatewayAddr>,
    },
    /// No gateway at all (invalid, unhostable, ...): the failure policy applies.
    None,
}

/// One dedicated egress IP of a rule.
pub(super) struct Dedicated {
    pub(super) ip: IpAddr,
    /// Its wire id: the rule's for `egressIP` and the first address of `egressIPs`, its
    /// own for each other address.
    pub(super) id: u32,
    pub(super) holder: Option<GatewayAddr>,
}

/// How a pod address leaves under a rule: the wire id, the gateway (none: the failure
/// policy applies) and the egress address.
pub(super) struct Route<'a> {
    pub(super) id: u32,
    pub(super) gateway: Option<&'a GatewayAddr>,
    pub(super) egress_ip: Option<IpAddr>,
}

/// One gateway address serving a rule, with its wire id (`shared`: an interface's own
/// address, not a dedicated egress IP).
pub(super) struct Served<'a> {
    pub(super) gateway: &'a GatewayAddr,
    pub(super) shared: bool,
    pub(super) id: u32,
}

/// One gateway's address serving a rule.
#[derive(Clone, Debug)]
pub(super) struct GatewayAddr {
    pub(super) node: String,
    pub(super) underlay: IpAddr,
    pub(super) interface: String,
    pub(super) ip: IpAddr,
    pub(super) prefix_len: u8,
    /// The holding (dedicated addresses): its epoch, why, and since when (as published).
    pub(super) epoch: u64,
    pub(super) reason: &'static str,
    pub(super) since: Option<String>,
}

impl GatewayAddr {
    fn new(node: &NodeInfo<'_>, underlay: IpAddr, interface: &str, ip: IpAddr, len: u8) -> Self {
        Self {
            node: node.name.to_owned(),
            underlay,
            interface: interface.to_owned(),
            ip,
            prefix_len: len,
            epoch: 0,
            reason: move_reason::ASSIGNED,
            since: None,
        }
    }
}

impl RulePlan {
    /// The prefixes of this rule for traffic through `gateway` (`None`: no gateway).
    pub(super) fn prefixes(&self, gateway: Option<&GatewayAddr>) -> &Prefixes {
        match &self.destinations {
            Destinations::Listed(prefixes) => prefixes,
            Destinations::Learned { by_node, fallback } => gateway
                .and_then(|g| by_node.get(&g.node))
                .unwrap_or(fallback),
        }
    }

    pub(super) fn learned(&self) -> bool {
        matches!(self.destinations, Destinations::Learned { .. })
    }

    /// How pod address `ip` leaves under this rule. A dedicated rule's pod takes the
    /// rendezvous winner among its addresses that have a holder (per pod address and
    /// rule, so pods spread over the addresses, each keeps its address while that address
    /// is held anywhere, and only the pods of an address that loses every holder move);
    /// with none held, the winner among all, without a gateway. An interface rule's pod
    /// takes the rendezvous winner among the gateways of its interface.
    pub(super) fn route_for(&self, ip: IpAddr) -> Route<'_> {
        let rule_id = self.rule_id.to_be_bytes();
        let octets = ip_bytes(ip);
        let key: [&[u8]; 2] = [&octets, &rule_id];
        match &self.target {
            // One address is the pool whether it is held or not.
            Target::Dedicated { addresses } if addresses.len() == 1 => {
                let chosen = &addresses[0];
                Route {
                    id: chosen.id,
                    gateway: chosen.holder.as_ref(),
                    egress_ip: Some(chosen.ip),
                }
            }
            Target::Dedicated { addresses } => {
                let held: Vec<&Dedicated> =
                    addresses.iter().filter(|a| a.holder.is_some()).collect();
                let pool = if held.is_empty() {
                    addresses.iter().collect()
                } else {
                    held
                };
                let Some(chosen) = pick_address(&key, &pool) else {
                    return self.no_route();
                };
                Route {
                    id: chosen.id,
                    gateway: chosen.holder.as_ref(),
                    egress_ip: Some(chosen.ip),
                }
            }
            Target::Interface { gateways } => {
                let gateway = hash::rendezvous(&key, gateways.keys().map(String::as_str))
                    .and_then(|node| gateways.get(node));
                Route {
                    id: self.rule_id,
                    gateway,
                    egress_ip: gateway.map(|g| g.ip),
                }
            }
            Target::None => self.no_route(),
        }
    }

    fn no_route(&self) -> Route<'_> {
        Route {
            id: self.rule_id,
            gateway: None,
            egress_ip: None,
        }
    }

    /// Every gateway address serving this rule.
    pub(super) fn served(&self) -> Vec<Served<'_>> {
        match &self.target {
            Target::Dedicated { addresses } => addresses
                .iter()
                .filter_map(|a| {
                    Some(Served {
                        gateway: a.holder.as_ref()?,
                        shared: false,
                        id: a.id,
                    })
                })
                .collect(),
            Target::Interface { gateways } => gateways
                .values()
                .map(|g| Served {
                    gateway: g,
                    shared: true,
                    id: self.rule_id,
                })
                .collect(),
            Target::None => Vec::new(),
        }
    }
}

/// The rendezvous winner for `key` among `addresses` (one address needs no hashing).
fn pick_address<'d>(key: &[&[u8]], addresses: &[&'d Dedicated]) -> Option<&'d Dedicated> {
    if let [only] = addresses {
        return Some(only);
    }
    let names: Vec<String> = addresses.iter().map(|a| a.ip.to_string()).collect();
    let winner = hash::rendezvous(key, names.iter().map(String::as_str))?;
    let i = names.iter().position(|n| n == winner)?;
    addresses.get(i).copied()
}

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

/// Egress IP -> (holder, deciding policy).
type Placed = BTreeMap<IpAddr, (GatewayAddr, String)>;

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
}

/// Plan `policy` with `spec` (its own, or its last accepted one).
fn plan_policy<'a>(
    policy: &'a EgressGatewayPolicy,
    spec: &EgressGatewayPolicySpec,
    ids: &BTreeMap<hash::WireKey, u32>,
    cx: &Context<'_, '_>,
    placed: &mut Placed,
) -> PolicyPlan<'a> {
    let nodes = cx.nodes;
    let name = policy.metadata.name.clone().unwrap_or_default();
    let mut report = PolicyReport::default();
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
    if spec.rules.is_empty() {
        report.invalid(reason::NO_RULES, NO_RULES_MESSAGE.to_owned());
    }
    let gateways = gw_sel
        .map(|sel| Gateways::select(&sel, nodes, &mut report))
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
    let accepted = report.accepted().then_some(policy);
    PolicyPlan {
        name,
        policy,
        selectors: ns_sel.zip(pod_sel),
        failure_policy: spec.failure_policy,
        rules,
        report,
        accepted,
    }
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

/// An interface rule whose destinations are learned from the routes out of `interface`.
struct LearnOn<'a, 'r> {
    at: &'a RuleAt<'r>,
    interface: &'a str,
    include_default: bool,
}

impl LearnOn<'_, '_> {
    /// The destinations and target of each family (IPv4, IPv6): an interface routes both.
    fn per_family(
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
fn hosting<'a>(nodes: &[&NodeInfo<'a>], ips: &[IpAddr]) -> Vec<(&'a str, String)> {
    nodes
        .iter()
        .filter_map(|n| {
            let egress = n.egress.as_ref()?;
            let (iface, _) = ips.iter().find_map(|ip| egress.hosting_interface(*ip))?;
            Some((n.name, iface.to_owned()))
        })
        .collect()
}

/// Most routes named per gateway in a condition about overlapping routes.
const MAX_ROUTES_NAMED: usize = 3;

/// How a rule learns its destinations from routes, for one family.
struct Learn {
    v6: bool,
    include_default: bool,
}

impl Learn {
    /// What the rule learns from each gateway that may serve it (`serving`: node and
    /// interface), and from every selected one for when none serves it (`selected`),
    /// with the conditions: routes left out, gateways that disagree, nothing learned.
    fn destinations(
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

/// The holders of a rule's dedicated egress IPs (`addresses`: each with its wire id), in
/// the order written. Each address goes to a host holding the fewest earlier addresses of
/// the rule: one gateway each where enough can host them; several share a gateway only
/// when fewer can (as evenly as they can), and the status says so.
fn place_egress_ips(
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
    let nodes = cx.nodes;
    if let Some(owner) = cx.foreign.get(&ip) {
        report.claimed_elsewhere(format!(
            "{field}: {ip} is also claimed by {owner}; this policy leaves it \
             to them (remove it from one of the two)"
        ));
        return None;
    }
    if let Some((owner, others)) = cx.owners.get(&ip) {
        if owner != at.policy {
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
            return None;
        }
        if !others.is_empty() {
            report.egress_ip_conflict(format!(
                "{field}: {ip} is also named by policy {}: it stays this \
                 policy's (the older one naming it); theirs get no gateway",
                others.join(", ")
            ));
        }
    }
    if let Some((node, how)) = nodes.iter().find_map(|n| {
        n.own_addresses
            .iter()
            .find(|(a, _)| *a == ip)
            .map(|(_, how)| (n.name, how))
    }) {
        report.unready(
            reason::EGRESS_IP_IS_NODE_ADDRESS,
            format!(
                "{field}: {ip} is an address of node {node} ({how}); use a \
                 free address of that subnet, or `interface:` to SNAT to the gateways' own \
                 addresses"
            ),
        );
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
        nodes,
        (&gateways.selected, load),
        cx.peers.last_claims.get(&ip),
    );
    if let Some(h) = &chosen {
        placed.insert(ip, (h.clone(), at.policy.to_owned()));
    }
    chosen
}

/// Address bytes as hashed by rendezvous (4 for IPv4, 16 for IPv6).
fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(ip) => ip.octets().to_vec(),
        IpAddr::V6(ip) => ip.octets().to_vec(),
    }
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
    let octets = ip_bytes(ip);
    let node_info = |name: &str| nodes.iter().find(|n| n.name == name);
    let claim =
        |name: &str| node_info(name).and_then(|n| n.egress.as_ref()?.held.get(&ip).copied());
    // The last claimant, wherever it is: the newest claim published, or heard.
    let published = nodes
        .iter()
        .filter_map(|n| Some((n.egress.as_ref()?.held.get(&ip).copied()?, n)))
        .max_by(|(a, na), (b, nb)| a.cmp(b).then(nb.name.cmp(na.name)));
    let heard = heard.and_then(|(name, e)| Some((*e, node_info(name)?)));
    let last = match (published, heard) {
        (Some(p), Some(h)) if h.0 > p.0 => Some(h),
        (p @ Some(_), _) => p,
        (None, h) => h,
    };
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
    let node = hash::rendezvous(&[&octets], pool.iter().map(|h| h.node.as_str()))?;
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
        Some((_, n)) if n.dead => move_reason::HOLDER_UNREACHABLE,
        Some((_, n)) if !n.ready => move_reason::HOLDER_NOT_READY,
        Some((_, n)) if n.drained => move_reason::HOLDER_DRAINED,
        Some((_, n)) if !selected.contains(n.name) => move_reason::HOLDER_NOT_SELECTED,
        Some((_, n))
            if n.egress
                .as_ref()
                .is_none_or(|e| e.hosting_interface(ip).is_none()) =>
        {
            move_reason::HOLDER_INTERFACE_DOWN
        }
        Some((_, n)) if load_of(n.name) > least => move_reason::REBALANCED,
        Some(_) => move_reason::REASSIGNED,
    };
    Some(g)
}
