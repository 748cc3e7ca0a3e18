//! NetworkPolicy for the traffic the datapath redirects. `from_pod` takes a selected pod's
//! packets at its device before any place a CNI enforces NetworkPolicy (netfilter, OVS),
//! so this node's policy entries carry what the pod's egress NetworkPolicies allow:
//!
//! * a pod that no NetworkPolicy selects for `Egress` is not restricted;
//! * otherwise what its policies' egress rules allow, unioned, is all it may send: an
//!   `ipBlock` (`cidr` minus its `except`s), or every destination for a rule without `to`;
//!   on the rule's `ports` (`protocol`, `port`, `endPort`), or every port and protocol
//!   for a rule without. Pod and namespace selectors match only pods, never the
//!   destinations we redirect (the compiler never steers cluster addresses): a peer of
//!   that kind allows nothing here. A named port cannot name a port of a host outside the
//!   cluster: it allows nothing here either, and a problem says so.
//!
//! Each forwarded entry of a restricted pod is split where an `ipBlock` or `except`
//! boundary falls inside it: parts the policies deny get [`PolicyAction::Deny`], parts
//! they allow on some ports only a port filter (`Desired::port_filters`), the rest stay as
//! they were. Excepts, fallthroughs and drops are the host's or nobody's traffic: the CNI
//! judges what reaches the host, so they stay.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;

use super::{
    compiled::{Object, Problem},
    hash::fnv1a64,
    pods::Pods,
};
use crate::{
    desired::{Desired, Family, PolicyAction, PolicyEntry, PortSet, V4, V6},
    netpol::{Allow, EgressPolicy, merge, parse},
    selector::Selector,
};

/// Problem reasons about NetworkPolicies.
pub mod reason {
    /// The NetworkPolicy could not be read: its pods are isolated for egress and it
    /// allows nothing toward redirected destinations (fail closed).
    pub const INVALID_NETWORK_POLICY: &str = "InvalidNetworkPolicy";
    /// A named port: it cannot match a host outside the cluster.
    pub const NAMED_PORT_NOT_APPLIED: &str = "NamedPortNotApplied";
    /// More port ranges toward one destination than a filter holds: denied there.
    pub const TOO_MANY_PORT_RANGES: &str = "TooManyPortRanges";
}

/// What a restricted pod may send toward one destination region.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Verdict {
    All,
    Nothing,
    Ports(PortSet),
}

/// The union of `rules` for the region of prefix `p` (every address whose longest match
/// among the boundaries is `p`: membership of each block is that of `p`).
fn verdict(rules: &[&Allow], p: &IpNet) -> Verdict {
    let mut ports = Vec::new();
    for r in rules {
        let hit = match &r.to {
            None => true,
            Some(blocks) => blocks.iter().any(|b| b.holds(p)),
        };
        if !hit {
            continue;
        }
        match &r.ports {
            None => return Verdict::All,
            Some(set) => ports.extend(set.iter().copied()),
        }
    }
    if ports.is_empty() {
        Verdict::Nothing
    } else {
        Verdict::Ports(merge(ports))
    }
}

/// Every NetworkPolicy of the view, parsed; the ones that do not parse still isolate the
/// pods their selector picks (they allow nothing), and are problems.
fn policies(view: &crate::source::ClusterView, problems: &mut Vec<Problem>) -> Vec<EgressPolicy> {
    let mut out = Vec::new();
    for np in &view.network_policies {
        let ns = np.metadata.namespace.as_deref().unwrap_or("default");
        let name = np.metadata.name.as_deref().unwrap_or_default();
        let object = Object::NetworkPolicy(format!("{ns}/{name}"));
        match parse(np) {
            Ok(p) => {
                for note in &p.notes {
                    problems.push(Problem {
                        object: object.clone(),
                        reason: reason::NAMED_PORT_NOT_APPLIED.to_owned(),
                        message: note.clone(),
                    });
                }
                out.push(p);
            }
            Err(errors) => {
                let spec = np.spec.clone().unwrap_or_default();
                let selector = Selector::new(
                    &spec.pod_selector.clone().unwrap_or_default(),
                    "spec.podSelector",
                );
                let isolates = selector.is_ok();
                for e in errors {
                    problems.push(Problem {
                        object: object.clone(),
                        reason: reason::INVALID_NETWORK_POLICY.to_owned(),
                        message: format!(
                            "{e}{}",
                            if isolates {
                                " (its pods' redirected traffic is allowed nothing by it until \
                                 fixed)"
                            } else {
                                ""
                            }
                        ),
                    });
                }
                if let Ok(pods) = selector {
                    out.push(EgressPolicy {
                        namespace: ns.to_owned(),
                        name: name.to_owned(),
                        pods,
                        egress: true,
                        rules: Vec::new(),
                        notes: Vec::new(),
                    });
                }
            }
        }
    }
    out.sort_by_key(EgressPolicy::label);
    out
}

/// The NetworkPolicies (`namespace/name`, sorted) that select a pod of `namespace` with
/// `labels` for `Egress`, those that do not parse included (they isolate it too): what
/// `explain` names as the source of a verdict. None: the pod is not restricted.
pub fn isolating(
    view: &crate::source::ClusterView,
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> Vec<String> {
    policies(view, &mut Vec::new())
        .iter()
        .filter(|p| p.egress && p.namespace == namespace && p.pods.matches(labels))
        .map(EgressPolicy::label)
        .collect()
}

/// Restrict this node's policy entries (`desired`) by the egress NetworkPolicies of the
/// view; fills `desired.port_filters`.
pub(super) fn restrict(
    view: &crate::source::ClusterView,
    pods: &Pods<'_>,
    node_name: &str,
    desired: &mut Desired,
    problems: &mut Vec<Problem>,
) {
    let policies = policies(view, problems);
    if !policies.iter().any(|p| p.egress) {
        return;
    }
    // This node's pods by address, with the egress rules that apply to each.
    let mut rules_of: BTreeMap<IpAddr, (String, Vec<&Allow>)> = BTreeMap::new();
    for pod in pods.pods.iter().filter(|p| p.node == node_name) {
        let mut rules = Vec::new();
        let mut isolated = false;
        for p in &policies {
            if p.egress && p.namespace == pod.namespace && p.pods.matches(pod.labels) {
                isolated = true;
                rules.extend(p.rules.iter());
            }
        }
        if isolated {
            for ip in pod.ips.iter() {
                let label = format!("{}/{}", pod.namespace, pod.name);
                rules_of.insert(*ip, (label, rules.clone()));
            }
        }
    }
    if rules_of.is_empty() {
        return;
    }
    let mut sets = Filters::default();
    let v4 = refine::<V4>(desired, &rules_of, &mut sets, problems);
    let v6 = refine::<V6>(desired, &rules_of, &mut sets, problems);
    let ids = sets.ids();
    write::<V4>(desired, v4, &ids);
    write::<V6>(desired, v6, &ids);
    desired.port_filters = ids.into_iter().map(|(set, id)| (id, set)).collect();
}

/// The port sets in use.
#[derive(Default)]
struct Filters(BTreeSet<PortSet>);

impl Filters {
    /// An id for each set, from its contents (1..=65535; the next free one on a
    /// collision, in set order): an unrelated change keeps every other id.
    fn ids(self) -> BTreeMap<PortSet, u16> {
        let mut taken = BTreeSet::new();
        let mut out = BTreeMap::new();
        for set in self.0 {
            let bytes: Vec<u8> = set
                .iter()
                .flat_map(|(p, a, b)| [*p, (a >> 8) as u8, *a as u8, (b >> 8) as u8, *b as u8])
                .collect();
            let mut id = (fnv1a64(&bytes) % 65_535) as u16 + 1;
            while !taken.insert(id) {
                id = if id == u16::MAX { 1 } else { id + 1 };
            }
            out.insert(set, id);
        }
        out
    }
}

/// A refined entry before its filter has an id.
type Refined<F> = (
    <F as crate::family::Family>::Addr,
    <F as crate::family::Family>::Net,
    PolicyEntry<F>,
    Option<PortSet>,
);

/// One of a pod's entries: its prefix and what it does.
type PodEntry<F> = (<F as crate::family::Family>::Net, PolicyEntry<F>);

/// Most port ranges one filter holds.
const MAX_RANGES: usize = egress_common::policy::PORT_FILTER_RANGES;

/// The refined entries of family `F`'s restricted pods (taken out of `desired`).
fn refine<F: Family>(
    desired: &mut Desired,
    rules_of: &BTreeMap<IpAddr, (String, Vec<&Allow>)>,
    sets: &mut Filters,
    problems: &mut Vec<Problem>,
) -> Vec<Refined<F>> {
    let mut out = Vec::new();
    for (pod, entries) in take_restricted::<F>(desired, rules_of) {
        let (label, rules) = &rules_of[&pod.into()];
        let restricted = Restricted {
            label,
            rules,
            entries: &entries,
        };
        for (net, entry, set) in restricted.refine(sets, problems) {
            out.push((pod, net, entry, set));
        }
    }
    out
}

/// The entries of family `F`'s restricted pods (those `rules_of` names), taken out of
/// `desired`, by pod.
fn take_restricted<F: Family>(
    desired: &mut Desired,
    rules_of: &BTreeMap<IpAddr, (String, Vec<&Allow>)>,
) -> BTreeMap<F::Addr, Vec<PodEntry<F>>> {
    let part = F::part_mut(desired);
    let mut by_pod: BTreeMap<F::Addr, Vec<PodEntry<F>>> = BTreeMap::new();
    let restricted: Vec<(F::Addr, F::Net)> = part
        .policy
        .keys()
        .filter(|(pod, _)| rules_of.contains_key(&(*pod).into()))
        .copied()
        .collect();
    for key in restricted {
        if let Some(e) = part.policy.remove(&key) {
            by_pod.entry(key.0).or_default().push((key.1, e));
        }
    }
    by_pod
}

/// One restricted pod: its label (`namespace/name`), the egress rules that apply to it,
/// and its entries of one family.
struct Restricted<'r, F: Family> {
    label: &'r str,
    rules: &'r [&'r Allow],
    entries: &'r [PodEntry<F>],
}

impl<F: Family> Restricted<'_, F> {
    /// The pod's refined entries: at each boundary, in order of prefix length, what the
    /// rules allow there, written where it differs from the containing prefix's verdict
    /// (and always at the pod's own prefixes).
    fn refine(
        &self,
        sets: &mut Filters,
        problems: &mut Vec<Problem>,
    ) -> Vec<(F::Net, PolicyEntry<F>, Option<PortSet>)> {
        let prefixes: Vec<IpNet> = self.entries.iter().map(|(n, _)| (*n).into()).collect();
        let mut decided: Vec<(IpNet, Verdict)> = Vec::new();
        let mut out = Vec::new();
        for (_, p) in self.bounds(&prefixes) {
            let Some((_, e)) = self.entry_of(&p) else {
                continue;
            };
            let own = prefixes.contains(&p);
            let Some(net) = F::net(p) else {
                continue;
            };
            if e.action != PolicyAction::Forward {
                if own {
                    out.push((net, *e, None));
                }
                continue;
            }
            let v = self.verdict(&p, problems);
            let container = decided
                .iter()
                .filter(|(q, _)| q.contains(&p) && *q != p)
                .max_by_key(|(q, _)| q.prefix_len())
                .map(|(_, v)| v.clone());
            let same_as_container = container.as_ref() == Some(&v);
            decided.push((p, v.clone()));
            if !own && same_as_container {
                continue;
            }
            let (entry, set) = refined(e, &v, sets);
            out.push((net, entry, set));
        }
        out
    }

    /// The longest of the pod's entries that contains `p`.
    fn entry_of(&self, p: &IpNet) -> Option<&PodEntry<F>> {
        self.entries
            .iter()
            .filter(|(n, _)| Into::<IpNet>::into(*n).contains(p))
            .max_by_key(|(n, _)| Into::<IpNet>::into(*n).prefix_len())
    }

    /// Boundaries, shortest first: the entries (`prefixes`), and every block edge of the
    /// rules inside a forwarded one.
    fn bounds(&self, prefixes: &[IpNet]) -> BTreeSet<(u8, IpNet)> {
        let mut bounds: BTreeSet<(u8, IpNet)> =
            prefixes.iter().map(|p| (p.prefix_len(), *p)).collect();
        for r in self.rules {
            for b in r.to.iter().flatten() {
                for edge in std::iter::once(&b.cidr).chain(&b.except) {
                    let inside = self.entries.iter().any(|(n, e)| {
                        e.action == PolicyAction::Forward && Into::<IpNet>::into(*n).contains(edge)
                    });
                    if inside {
                        bounds.insert((edge.prefix_len(), *edge));
                    }
                }
            }
        }
        bounds
    }

    /// What the rules allow toward `p`: more port ranges than a filter holds are denied
    /// (fail closed), and said.
    fn verdict(&self, p: &IpNet, problems: &mut Vec<Problem>) -> Verdict {
        let label = self.label;
        let v = verdict(self.rules, p);
        let Verdict::Ports(set) = &v else {
            return v;
        };
        if set.len() <= MAX_RANGES {
            return v;
        }
        problems.push(Problem {
            object: Object::NetworkPolicy(label.to_owned()),
            reason: reason::TOO_MANY_PORT_RANGES.to_owned(),
            message: format!(
                "pod {label}: its egress NetworkPolicies allow {} port ranges toward \
                 {p}, more than the {MAX_RANGES} a filter holds: denied there (fail \
                 closed); merge the ports into fewer ranges (endPort)",
                set.len()
            ),
        });
        Verdict::Nothing
    }
}

/// A forwarded entry `e` as verdict `v` has it: kept, denied, or filtered by a port set
/// (recorded in `sets`).
fn refined<F: Family>(
    e: &PolicyEntry<F>,
    v: &Verdict,
    sets: &mut Filters,
) -> (PolicyEntry<F>, Option<PortSet>) {
    match v {
        Verdict::All => (*e, None),
        Verdict::Nothing => (
            PolicyEntry {
                action: PolicyAction::Deny,
                gateway: None,
                filter: 0,
                ..*e
            },
            None,
        ),
        Verdict::Ports(set) => {
            sets.0.insert(set.clone());
            (*e, Some(set.clone()))
        }
    }
}

/// Put the refined entries back into family `F`'s part, with their filters' ids, and
/// count each pod's entries again (a restricted pod's entries are all among them:
/// [`refine`] took every one out).
fn write<F: Family>(desired: &mut Desired, refined: Vec<Refined<F>>, ids: &BTreeMap<PortSet, u16>) {
    let part = F::part_mut(desired);
    let mut counts: BTreeMap<F::Addr, u32> = BTreeMap::new();
    for (pod, net, mut entry, set) in refined {
        entry.filter = set.and_then(|s| ids.get(&s).copied()).unwrap_or(0);
        part.policy.insert((pod, net), entry);
        *counts.entry(pod).or_default() += 1;
    }
    part.selected.extend(counts);
}
