//! The desired contents of every map in ABI form, derived from `Desired` (pure): each
//! family's maps converted by one generic code path ([`FamilyMaps`]).

use std::{collections::BTreeMap, net::IpAddr};

use egress_common::{
    config::Config,
    maps::{Map, def},
    policy::{
        AdmittedValue, CoveredValue, EgressIpValue, KnownPodValue, NodeValue, PORT_FILTER_RANGES,
        PodDeviceValue, PodOwnerValue, PortFilter, PortRange, action, coverage, egress_ip_flags,
        selected_flags,
    },
    underlay::{self, Underlay},
};

use super::table::{self, Reader, Rows};
use crate::{
    desired::{Desired, FamilyDesired, HeldIp, PolicyAction, PortSet},
    family::{Entries, Family, V4, V6, family_maps},
};

/// [`FamilyMaps`], its `Default` and its sizes, from [`family_maps!`].
macro_rules! family_maps_struct {
    ($(
        $(#[$doc:meta])*
        $Map:ident $field:ident $kind:ident [$v4:ident $v6:ident] [$($bound:tt)*],
    )*) => {
        /// What one family's maps should hold, one field per map of [`family_maps!`]. Keys
        /// and values are the ABI types of `egress-common`, by way of each map's [`Map`]
        /// declaration, kept as [`table`](super::table) keeps that kind of map.
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct FamilyMaps<F: Family> {
            $( $(#[$doc])* pub $field: Rows<table::$kind<F::$Map>>, )*
        }

        impl<F: Family> Default for FamilyMaps<F> {
            fn default() -> Self {
                Self { $( $field: Default::default(), )* }
            }
        }

        impl<F: Family> FamilyMaps<F> {
            /// Number of entries per map, by map name.
            pub fn sizes(&self) -> Vec<(&'static str, usize)> {
                vec![ $( (F::$Map::SPEC.name, self.$field.len()), )* ]
            }

            /// Every entry as (map name, `{key:?} {value:?}`): what the renderer's test
            /// holds each field name of against the rendered line.
            #[cfg(test)]
            pub(crate) fn debug_entries(&self) -> Vec<(&'static str, String)> {
                let mut out = Vec::new();
                $( out.extend(self.$field.iter().map(|(k, v)| {
                    (F::$Map::SPEC.name, format!("{k:?} {v:?}"))
                })); )*
                out
            }

            /// Every map of the family, as `reader` reads it.
            pub fn read<R: Reader>(reader: &mut R) -> Result<Self, R::Error> {
                Ok(Self { $( $field: reader.read::<table::$kind<F::$Map>>()?, )* })
            }

            /// Entries an apply from `self` to `want` writes: removed, added or changed.
            pub fn changes(&self, want: &Self) -> usize {
                0 $( + changes(&self.$field, &want.$field) )*
            }
        }
    };
}
family_maps!(family_maps_struct);

/// Keys of `held` not in `want`, and entries of `want` that `held` lacks or holds otherwise.
fn changes<K: Ord, V: PartialEq>(held: &BTreeMap<K, V>, want: &BTreeMap<K, V>) -> usize {
    let (stale, write) = differences(held, want);
    stale.len() + write.len()
}

/// The keys of `held` that `want` lacks, and the entries of `want` that `held` lacks or
/// holds otherwise, each in key order: both maps walked once, side by side (no lookup
/// per entry: a gateway's maps hold an entry per pod of the cluster).
pub(crate) fn differences<'a, K: Ord, V: PartialEq>(
    held: &'a BTreeMap<K, V>,
    want: &'a BTreeMap<K, V>,
) -> (Vec<&'a K>, Vec<(&'a K, &'a V)>) {
    let (mut stale, mut write) = (Vec::new(), Vec::new());
    let mut held = held.iter().peekable();
    for (k, v) in want {
        while let Some((gone, _)) = held.next_if(|(h, _)| *h < k) {
            stale.push(gone);
        }
        match held.next_if(|(h, _)| *h == k) {
            Some((_, was)) if was == v => {}
            _ => write.push((k, v)),
        }
    }
    stale.extend(held.map(|(k, _)| k));
    (stale, write)
}

/// What every map should hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapState {
    pub v4: FamilyMaps<V4>,
    pub v6: FamilyMaps<V6>,
    /// `NODES`, shared by both families (an underlay address is of either).
    pub nodes: Entries<def::Nodes>,
    /// `PORT_FILTERS`, shared by both families' policy entries.
    pub port_filters: Entries<def::PortFilters>,
}

/// Something in the desired state that cannot be put in the maps yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unresolved {
    /// A rule or egress IP names an interface this node does not have.
    MissingInterface { what: String, interface: String },
}

impl std::fmt::Display for Unresolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::MissingInterface { what, interface } => {
                write!(
                    f,
                    "{what}: interface {interface:?} does not exist on this node"
                )
            }
        }
    }
}

/// The bindings of `bound` of family `F`, as `POD_DEVICES_*` holds them.
pub(crate) fn pod_devices<F: Family>(
    bound: &BTreeMap<IpAddr, PodDeviceValue>,
) -> Entries<F::PodDevices> {
    bound
        .iter()
        .filter_map(|(pod, device)| Some((F::octets(F::addr(*pod)?), *device)))
        .collect()
}

/// The pods of family `F`'s `POD_DEVICES_*` entries, with their devices.
fn bound_pods<F: Family>(
    entries: &Entries<F::PodDevices>,
) -> impl Iterator<Item = (IpAddr, PodDeviceValue)> + '_ {
    entries
        .iter()
        .map(|(pod, v)| (F::Addr::from(*pod).into(), *v))
}

/// An optional underlay address as the maps hold it (zero for none).
fn underlay_of(ip: Option<IpAddr>) -> Underlay {
    ip.map_or([0; 16], underlay::from_ip)
}

fn action_code(a: PolicyAction) -> u8 {
    match a {
        PolicyAction::Forward => action::FORWARD,
        PolicyAction::Exclude => action::EXCLUDE,
        PolicyAction::NoGatewayDrop => action::NO_GATEWAY_DROP,
        PolicyAction::NoGatewayPass => action::NO_GATEWAY_PASS,
        PolicyAction::Deny => action::DENY,
    }
}

/// A port set as its `PORT_FILTERS` value (the compiler keeps sets within
/// [`PORT_FILTER_RANGES`]; any past it are left out, which allows less, never more).
fn port_filter(set: &PortSet) -> PortFilter {
    let mut f = PortFilter::default();
    for (slot, (proto, first, last)) in f.ranges.iter_mut().zip(set) {
        *slot = PortRange {
            proto: *proto,
            _pad: 0,
            first: *first,
            last: *last,
        };
    }
    f.count = set.len().min(PORT_FILTER_RANGES) as u32;
    f
}

fn egress_ip_value(held: &HeldIp, ifindex: u32) -> EgressIpValue {
    let flags = if held.shared {
        egress_ip_flags::SHARED
    } else {
        0
    };
    EgressIpValue { ifindex, flags }
}

impl<F: Family> FamilyMaps<F> {
    /// Convert one family's part of `desired`, resolving interface names with `ifindex`.
    /// Entries whose interface is missing are left out and added to `unresolved`.
    fn from_desired(
        d: &FamilyDesired<F>,
        desired: &Desired,
        ifindex: &impl Fn(&str) -> Option<u32>,
        unresolved: &mut Vec<Unresolved>,
    ) -> Self {
        let mut s = Self::default();
        s.add_source_side(d);
        s.add_gateway_side(d, ifindex, unresolved);
        s.add_admitted(desired);
        s.add_unknown_pods(desired);
        s
    }

    /// The policy entries, the selected pods with the prefix lengths each pod's lookups
    /// probe, and the destination chains.
    fn add_source_side(&mut self, d: &FamilyDesired<F>) {
        for ((pod, dst), e) in &d.policy {
            let value = F::policy_value(
                underlay_of(e.gateway),
                e.egress_ip.map(F::octets).unwrap_or_default(),
                e.rule_id,
                action_code(e.action),
                e.filter,
            );
            self.policy.insert(F::policy_key(*pod, *dst), value);
        }
        for (pod, n) in &d.selected {
            self.selected.insert(F::octets(*pod), F::selected(*n));
        }
        for key in self.policy.keys() {
            let (pod, len) = F::policy_key_parts(key);
            if let Some(v) = self.selected.get_mut(&pod) {
                F::add_length(v, len);
            }
        }
        self.dests = F::dests(self.policy.keys());
    }

    /// Rules, pod owners and egress addresses.
    fn add_gateway_side(
        &mut self,
        d: &FamilyDesired<F>,
        ifindex: &impl Fn(&str) -> Option<u32>,
        unresolved: &mut Vec<Unresolved>,
    ) {
        for (id, r) in &d.rules {
            match ifindex(&r.interface) {
                Some(i) => {
                    self.rules.insert(*id, F::rule(F::octets(r.egress_ip), i));
                }
                None => unresolved.push(Unresolved::MissingInterface {
                    what: format!("rule {id} (egress IP {})", r.egress_ip),
                    interface: r.interface.clone(),
                }),
            }
        }
        // Built at once from the sorted entries (a gateway has one per pod of the
        // cluster: at 100,000 pods, 10 ms one by one); `from_desired` starts empty.
        self.pod_owner = d
            .pod_owner
            .iter()
            .map(|(pod, node)| {
                let node = underlay::from_ip(*node);
                (F::octets(*pod), PodOwnerValue { node })
            })
            .collect();
        for (ip, held) in &d.egress_ips {
            match ifindex(&held.interface) {
                Some(i) => {
                    self.egress_ips
                        .insert(F::octets(*ip), egress_ip_value(held, i));
                }
                None => unresolved.push(Unresolved::MissingInterface {
                    what: format!("egress IP {ip}"),
                    interface: held.interface.clone(),
                }),
            }
        }
    }

    /// The (pod, rule) pairs of this family that this node admits from the tunnel.
    fn add_admitted(&mut self, desired: &Desired) {
        for &(pod, rule_id) in &desired.admitted {
            if let Some(pod) = F::addr(pod) {
                let key = F::admitted_key(F::octets(pod), rule_id);
                self.admitted.insert(key, AdmittedValue::default());
            }
        }
    }

    /// Known local pods and covered destinations of this family.
    fn add_unknown_pods(&mut self, desired: &Desired) {
        for pod in desired.known_pods.iter().filter_map(|p| F::addr(*p)) {
            self.known_pods
                .insert(F::octets(pod), KnownPodValue::default());
        }
        for (prefix, covered) in &desired.covered {
            let Some(prefix) = F::net(*prefix) else {
                continue;
            };
            let covered = if *covered {
                coverage::COVERED
            } else {
                coverage::EXCEPTED
            };
            let (net, len) = F::split(prefix);
            self.covered
                .insert((u32::from(len), net), CoveredValue { covered });
        }
    }

    /// Keep the policy entries within `capacity`: whole pods, in address order; a pod
    /// whose entries do not all fit keeps none and is marked incomplete, so that
    /// `from_pod` drops its traffic to covered destinations rather than let it leave with
    /// the pod's own address. Returns the pods left out, with their entry counts.
    fn fit_policy(&mut self, capacity: usize) -> Vec<(F::Addr, usize)> {
        if self.policy.len() <= capacity {
            return Vec::new();
        }
        let mut per_pod: BTreeMap<F::Octets, usize> = BTreeMap::new();
        for key in self.policy.keys() {
            *per_pod.entry(F::policy_key_parts(key).0).or_default() += 1;
        }
        let mut budget = capacity;
        let mut left_out = BTreeMap::new();
        for (pod, n) in per_pod {
            if n <= budget {
                budget -= n;
            } else {
                left_out.insert(pod, n);
            }
        }
        self.policy
            .retain(|k, _| !left_out.contains_key(&F::policy_key_parts(k).0));
        for pod in left_out.keys() {
            if let Some(v) = self.selected.get_mut(pod) {
                F::set_incomplete(v);
            }
        }
        self.dests = F::dests(self.policy.keys());
        left_out
            .into_iter()
            .map(|(pod, n)| (F::Addr::from(pod), n))
            .collect()
    }
}

/// Pods named in a problem about a full policy map; the rest are counted.
const LEFT_OUT_NAMED: usize = 3;

/// The pods whose entries did not fit one family's policy map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftOut {
    /// The map (`POLICY_V4`, `POLICY_V6`).
    pub map: &'static str,
    /// Its capacity in entries.
    pub capacity: usize,
    /// Each pod left out with its number of entries, in address order.
    pub pods: Vec<(IpAddr, usize)>,
}

impl LeftOut {
    fn new<A: Into<IpAddr>>(
        map: &'static str,
        capacity: usize,
        pods: Vec<(A, usize)>,
    ) -> Option<Self> {
        (!pods.is_empty()).then(|| Self {
            map,
            capacity,
            pods: pods.into_iter().map(|(p, n)| (p.into(), n)).collect(),
        })
    }
}

/// The problem: the map, the first pods left out, what happens to them and what to do.
impl std::fmt::Display for LeftOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let entries: usize = self.pods.iter().map(|(_, n)| n).sum();
        let mut named: Vec<String> = self
            .pods
            .iter()
            .take(LEFT_OUT_NAMED)
            .map(|(pod, n)| format!("{pod} ({n})"))
            .collect();
        if self.pods.len() > LEFT_OUT_NAMED {
            named.push(format!("and {} more", self.pods.len() - LEFT_OUT_NAMED));
        }
        write!(
            f,
            "map {}: the entries of {} pods ({entries}) do not fit its {}: their packets to \
             every destination a rule covers are dropped (DROP_POLICY_MAP_FULL), never sent \
             with the pod's own address; raise --policy-map-entries, or select fewer pods or \
             prefixes; pods left out (entries): {}",
            self.map,
            self.pods.len(),
            self.capacity,
            named.join(", ")
        )
    }
}

impl MapState {
    /// Every map, as `reader` reads it.
    pub fn read<R: Reader>(reader: &mut R) -> Result<Self, R::Error> {
        Ok(Self {
            v4: FamilyMaps::read(reader)?,
            v6: FamilyMaps::read(reader)?,
            nodes: reader.read::<table::Hash<def::Nodes>>()?,
            port_filters: reader.read::<table::Hash<def::PortFilters>>()?,
        })
    }

    /// Convert `desired`, resolving interface names with `ifindex`. Entries whose
    /// interface is missing are left out and reported.
    pub fn from_desired(
        desired: &Desired,
        ifindex: impl Fn(&str) -> Option<u32>,
    ) -> (Self, Vec<Unresolved>) {
        let mut unresolved = Vec::new();
        let v4 = FamilyMaps::from_desired(&desired.v4, desired, &ifindex, &mut unresolved);
        let v6 = FamilyMaps::from_desired(&desired.v6, desired, &ifindex, &mut unresolved);
        let nodes = desired
            .nodes
            .iter()
            .map(|(ip, id)| (underlay::from_ip(*ip), NodeValue { node_id: *id }))
            .collect();
        let port_filters = desired
            .port_filters
            .iter()
            .map(|(id, set)| (u32::from(*id), port_filter(set)))
            .collect();
        (
            Self {
                v4,
                v6,
                nodes,
                port_filters,
            },
            unresolved,
        )
    }

    /// Bind each pod of `bound` to its host-side device (`POD_DEVICES_*`), replacing
    /// the bindings `self` had.
    pub fn set_pod_devices(&mut self, bound: &BTreeMap<IpAddr, PodDeviceValue>) {
        self.v4.pod_devices = pod_devices::<V4>(bound);
        self.v6.pod_devices = pod_devices::<V6>(bound);
    }

    /// The pods bound to their devices (`POD_DEVICES_*`), both families: what
    /// [`MapState::set_pod_devices`] was given.
    pub fn pod_devices(&self) -> BTreeMap<IpAddr, PodDeviceValue> {
        bound_pods::<V4>(&self.v4.pod_devices)
            .chain(bound_pods::<V6>(&self.v6.pod_devices))
            .collect()
    }

    /// Leave the maps of `--unknown-pods drop` empty (the mode is off); the covered
    /// destinations stay while a pod is incomplete ([`MapState::fit_policy`]), whose
    /// traffic to them `from_pod` drops.
    pub fn forget_unknown_pods(&mut self) {
        self.v4.known_pods.clear();
        self.v6.known_pods.clear();
        let v4 = self
            .v4
            .selected
            .values()
            .any(|v| v.flags & selected_flags::INCOMPLETE != 0);
        let v6 = self
            .v6
            .selected
            .values()
            .any(|v| v.flags & selected_flags::INCOMPLETE != 0);
        if !v4 {
            self.v4.covered.clear();
        }
        if !v6 {
            self.v6.covered.clear();
        }
    }

    /// Keep each family's policy entries within `capacity` (`--policy-map-entries`), as
    /// [`FamilyMaps::fit_policy`] does; what was left out, per family that did not fit.
    pub fn fit_policy(&mut self, capacity: u32) -> Vec<LeftOut> {
        let capacity = usize::try_from(capacity).unwrap_or(usize::MAX);
        let v4 = self.v4.fit_policy(capacity);
        let v6 = self.v6.fit_policy(capacity);
        [
            LeftOut::new(def::PolicyV4::SPEC.name, capacity, v4),
            LeftOut::new(def::PolicyV6::SPEC.name, capacity, v6),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// Entries an apply from `self` (what the maps hold) to `want` writes, as
    /// [`crate::datapath::Datapath::apply`] finds them, without the maps.
    pub fn changes(&self, want: &Self) -> usize {
        self.v4.changes(&want.v4)
            + self.v6.changes(&want.v6)
            + changes(&self.nodes, &want.nodes)
            + changes(&self.port_filters, &want.port_filters)
    }

    /// Number of entries per map, by map name.
    pub fn sizes(&self) -> impl Iterator<Item = (&'static str, usize)> {
        let nodes = (def::Nodes::SPEC.name, self.nodes.len());
        let filters = (def::PortFilters::SPEC.name, self.port_filters.len());
        self.v4
            .sizes()
            .into_iter()
            .chain(self.v6.sizes())
            .chain([nodes, filters])
    }
}

/// The `CONFIG` entry for this node.
pub fn config(
    node_ip: IpAddr,
    tunnel_ifindex: u32,
    port_min: u16,
    port_max: u16,
    tunnel_mtu: u16,
    unknown_pods_drop: bool,
    max_flows_per_pod: u32,
) -> Config {
    use egress_common::config::flags;
    let mut flags = flags::READY;
    if unknown_pods_drop {
        flags |= flags::UNKNOWN_PODS_DROP;
    }
    Config {
        node_ip: underlay::from_ip(node_ip),
        tunnel_ifindex,
        port_min,
        port_max,
        tunnel_mtu,
        flags,
        max_flows_per_pod,
    }
}

#[cfg(test)]
mod tests {
    use std::{
        collections::BTreeSet,
        net::{Ipv4Addr, Ipv6Addr},
    };

    use egress_common::policy::{AdmittedKeyV4, AdmittedKeyV6};

    use super::*;
    use crate::desired::{GatewayRule, PolicyEntry};

    proptest::proptest! {
        #[test]
        fn differences_are_what_lookups_find(
            held in proptest::collection::btree_map(0u16..64, 0u8..3, 0..40),
            want in proptest::collection::btree_map(0u16..64, 0u8..3, 0..40),
        ) {
            let stale: Vec<&u16> = held.keys().filter(|k| !want.contains_key(k)).collect();
            let write: Vec<(&u16, &u8)> =
                want.iter().filter(|(k, v)| held.get(k) != Some(v)).collect();
            proptest::prop_assert_eq!(differences(&held, &want), (stale, write));
        }
    }

    /// A Forward entry of rule `rule_id` by the gateway at 10.200.0.21 as `egress_ip`.
    fn forward<F: Family>(egress_ip: F::Addr, rule_id: u32) -> PolicyEntry<F> {
        PolicyEntry {
            action: PolicyAction::Forward,
            gateway: Some("10.200.0.21".parse().unwrap()),
            egress_ip: Some(egress_ip),
            rule_id,
            filter: 0,
        }
    }

    fn rule<F: Family>(egress_ip: F::Addr, interface: &str) -> GatewayRule<F> {
        GatewayRule {
            egress_ip,
            interface: interface.into(),
        }
    }

    /// An egress address held on interface sec-a.
    fn held_on_sec_a(prefix_len: u8, shared: bool) -> HeldIp {
        HeldIp {
            interface: "sec-a".into(),
            prefix_len,
            shared,
        }
    }

    #[test]
    fn changes_count_what_an_apply_removes_adds_and_rewrites() {
        let owner = |d: &mut Desired, pod: &str, node: &str| {
            d.v4.pod_owner
                .insert(pod.parse().unwrap(), node.parse().unwrap());
        };
        let mut held = Desired::default();
        owner(&mut held, "10.244.0.1", "10.200.0.1");
        owner(&mut held, "10.244.0.2", "10.200.0.1");
        let mut want = held.clone();
        let state = |d: &Desired| MapState::from_desired(d, |_| Some(2)).0;
        assert_eq!(state(&held).changes(&state(&want)), 0);
        want.v4.pod_owner.remove(&"10.244.0.1".parse().unwrap());
        owner(&mut want, "10.244.0.2", "10.200.0.2");
        owner(&mut want, "10.244.0.3", "10.200.0.1");
        assert_eq!(
            state(&held).changes(&state(&want)),
            3,
            "one removed, one rewritten, one added"
        );
    }

    #[test]
    fn converts_entries_and_reports_missing_interfaces() {
        let mut d = Desired::default();
        let pod: Ipv4Addr = "10.244.1.5".parse().unwrap();
        d.v4.policy.insert(
            (pod, "192.0.2.0/24".parse().unwrap()),
            forward("192.0.2.50".parse().unwrap(), 7),
        );
        d.v4.selected.insert(pod, 1);
        d.v4.rules
            .insert(7, rule("192.0.2.50".parse().unwrap(), "sec-a"));
        d.v4.rules
            .insert(8, rule("198.51.100.9".parse().unwrap(), "nope"));
        d.v4.egress_ips
            .insert("192.0.2.50".parse().unwrap(), held_on_sec_a(24, false));
        let (s, unresolved) = MapState::from_desired(&d, |n| (n == "sec-a").then_some(4));
        let (key, v) = s.v4.policy.iter().next().unwrap();
        assert_eq!(key.dst_len, 24);
        assert_eq!(key.pod, [10, 244, 1, 5]);
        assert_eq!(key.dst, [192, 0, 2, 0]);
        assert_eq!(s.v4.selected[&key.pod].lengths, 1 << 24);
        assert_eq!(v.gateway, underlay::from_v4([10, 200, 0, 21]));
        assert_eq!(v.action, action::FORWARD);
        assert_eq!(s.v4.rules[&7].ifindex, 4);
        assert!(!s.v4.rules.contains_key(&8));
        assert_eq!(s.v4.egress_ips[&[192, 0, 2, 50]].flags, 0);
        assert_eq!(unresolved.len(), 1);
        assert!(unresolved[0].to_string().contains("\"nope\""));
        assert!(s.v6.policy.is_empty() && s.v6.egress_ips.is_empty());
    }

    #[test]
    fn pods_whose_entries_do_not_fit_keep_none_and_are_marked_incomplete() {
        // Three pods of 2, 3 and 1 entries into a map of 4: the first and the third fit
        // whole, the second keeps none.
        let mut d = Desired::default();
        let pods: [Ipv4Addr; 3] =
            ["10.244.1.1", "10.244.1.2", "10.244.1.3"].map(|p| p.parse().unwrap());
        for (pod, n) in pods.iter().zip([2u8, 3, 1]) {
            for i in 0..n {
                d.v4.policy.insert(
                    (*pod, format!("192.0.{i}.0/24").parse().unwrap()),
                    forward("192.0.2.50".parse().unwrap(), 7),
                );
            }
            d.v4.selected.insert(*pod, u32::from(n));
        }
        d.covered.insert("192.0.0.0/16".parse().unwrap(), true);
        let (mut s, _) = MapState::from_desired(&d, |_| Some(4));
        let left_out = s.fit_policy(4);
        let problems: Vec<String> = left_out.iter().map(ToString::to_string).collect();
        assert_eq!(
            left_out[0].pods,
            [(std::net::IpAddr::V4(pods[1]), 3)],
            "{left_out:?}"
        );
        assert_eq!(s.v4.policy.len(), 3);
        let kept: BTreeSet<[u8; 4]> = s.v4.policy.keys().map(|k| k.pod).collect();
        assert_eq!(kept, [pods[0].octets(), pods[2].octets()].into());
        let second = s.v4.selected[&pods[1].octets()];
        assert_eq!(
            (second.entries, second.lengths, second.flags),
            (0, 0, selected_flags::INCOMPLETE)
        );
        assert_eq!(s.v4.selected[&pods[0].octets()].flags, 0);
        assert!(s.v4.dests.values().count() > 0);
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].starts_with("map POLICY_V4: the entries of 1 pods (3) do not fit its 4")
                && problems[0].contains("DROP_POLICY_MAP_FULL")
                && problems[0].contains("--policy-map-entries")
                && problems[0].contains("10.244.1.2 (3)"),
            "{problems:?}"
        );
        // Without --unknown-pods drop, the covered destinations stay for the incomplete pod.
        s.forget_unknown_pods();
        assert_eq!(s.v4.covered.len(), 1);
        // Everything fits: nothing changes.
        let (mut all, _) = MapState::from_desired(&d, |_| Some(4));
        assert!(all.fit_policy(6).is_empty());
        assert_eq!(all.v4.policy.len(), 6);
        all.forget_unknown_pods();
        assert!(all.v4.covered.is_empty());
    }

    #[test]
    fn converts_ipv6_entries_with_the_ipv4_underlay_gateway() {
        use crate::desired::PolicyEntryV6;
        let mut d = Desired::default();
        let pod: Ipv6Addr = "fd00:244:1::5".parse().unwrap();
        let egress: Ipv6Addr = "fd00:101::50".parse().unwrap();
        d.v6.policy
            .insert((pod, "fd00:101::/64".parse().unwrap()), forward(egress, 9));
        d.v6.policy.insert(
            (pod, "fd00:101::/120".parse().unwrap()),
            PolicyEntryV6 {
                action: PolicyAction::Exclude,
                gateway: None,
                egress_ip: None,
                rule_id: 9,
                filter: 0,
            },
        );
        d.v6.selected.insert(pod, 2);
        d.v6.rules.insert(9, rule(egress, "sec-a"));
        d.v6.pod_owner.insert(pod, "10.200.0.1".parse().unwrap());
        d.v6.egress_ips.insert(egress, held_on_sec_a(64, true));
        let (s, unresolved) = MapState::from_desired(&d, |n| (n == "sec-a").then_some(4));
        assert!(unresolved.is_empty());
        let forward = s.v6.policy.iter().find(|(k, _)| k.dst_len == 64).unwrap();
        assert_eq!(forward.0.pod, pod.octets());
        assert_eq!(forward.1.gateway, underlay::from_v4([10, 200, 0, 21]));
        assert_eq!(forward.1.egress_ip, egress.octets());
        assert_eq!(forward.1.action, action::FORWARD);
        let except = s.v6.policy.iter().find(|(k, _)| k.dst_len == 120).unwrap();
        assert_eq!(except.1.action, action::EXCLUDE);
        assert_eq!(except.1.egress_ip, [0; 16]);
        assert_eq!(s.v6.selected[&pod.octets()].entries, 2);
        assert_eq!(
            s.v6.selected[&pod.octets()].lengths,
            [0, 1 | 1 << (120 - 64), 0]
        );
        assert_eq!(s.v6.rules[&9].ifindex, 4);
        assert_eq!(s.v6.rules[&9].egress_ip, egress.octets());
        assert_eq!(
            s.v6.pod_owner[&pod.octets()].node,
            underlay::from_v4([10, 200, 0, 1])
        );
        assert_eq!(
            s.v6.egress_ips[&egress.octets()].flags,
            egress_ip_flags::SHARED
        );
        assert!(s.v4.policy.is_empty());
    }

    #[test]
    fn admitted_pairs_go_to_the_map_of_their_family() {
        let mut d = Desired::default();
        let v4: Ipv4Addr = "10.244.1.5".parse().unwrap();
        let v6: Ipv6Addr = "fd00:244:1::5".parse().unwrap();
        d.admitted.insert((v4.into(), 7));
        d.admitted.insert((v4.into(), 8));
        d.admitted.insert((v6.into(), 9));
        let (s, _) = MapState::from_desired(&d, |_| None);
        let v4_keys: Vec<_> = s.v4.admitted.keys().copied().collect();
        assert_eq!(
            v4_keys,
            [7, 8].map(|rule_id| AdmittedKeyV4 {
                pod: v4.octets(),
                rule_id
            })
        );
        let v6_keys: Vec<_> = s.v6.admitted.keys().copied().collect();
        assert_eq!(
            v6_keys,
            [AdmittedKeyV6 {
                pod: v6.octets(),
                rule_id: 9
            }]
        );
        assert!(s.v4.admitted.values().all(|v| v.flags == 0));
    }
}
