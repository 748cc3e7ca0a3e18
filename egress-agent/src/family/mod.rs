//! The agent's one per-family abstraction: what differs between IPv4 and IPv6 (the
//! address and prefix types, and each family's pinned maps with their ABI types). Code
//! that handles both families is written once over `F: Family` and run for [`V4`] and
//! [`V6`]: the desired state (`desired::FamilyDesired`), its conversion to map contents
//! (`datapath::state::FamilyMaps`) and the map sync.
//!
//! The eBPF side keeps a copy per family where the verifier's stack budget needs it.

pub mod conntrack;

use std::{
    collections::BTreeMap,
    fmt::{Debug, Display},
    hash::Hash,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use egress_common::{
    conntrack::{CtKeyV4, CtKeyV6, FlowCount},
    maps::{Map, def},
    policy::{
        AdmittedKeyV4, AdmittedKeyV6, DestValueV4, DestValueV6, PolicyKeyV4, PolicyKeyV6,
        PolicyValueV4, PolicyValueV6, RuleValueV4, RuleValueV6, SelectedValueV4, SelectedValueV6,
    },
    underlay::Underlay,
};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use self::conntrack::CtKey;

/// A pinned map the agent keeps in line with a [`BTreeMap`] of its entries: ordered keys,
/// comparable values, both plain old data.
pub trait Synced: Map<Key: Ord + Hash, Value: Eq> {}
impl<M: Map<Key: Ord + Hash, Value: Eq>> Synced for M {}

/// A hash map's entries.
pub type Entries<M> = BTreeMap<<M as Map>::Key, <M as Map>::Value>;
/// An LPM trie's entries, by (prefix length, network).
pub type Prefixes<M> = BTreeMap<(u32, <M as Map>::Key), <M as Map>::Value>;

/// Each family's maps, declared once: for each, its variant in the apply order, its field
/// in `datapath::FamilyMaps`, its kind (`Hash` or `Lpm`, as `datapath::table` keeps it),
/// its IPv4 and IPv6 maps, and what the generic code may assume of its key and value.
/// `$m` is called with the whole list: the [`Maps`] types here, and in the datapath the
/// `FamilyMaps` fields, their reads, syncs and sizes, and the apply order's map names are
/// all derived from it, so a new map is named once.
macro_rules! family_maps {
    ($m:ident) => {
        $m! {
            /// `POLICY_*`: (pod, destination prefix) -> what `from_pod` does.
            Policy policy Hash [PolicyV4 PolicyV6] [],
            /// `DESTS_*`: destination prefix -> the lengths of the policy prefixes containing it.
            Dests dests Lpm [DestsV4 DestsV6] [Key = Self::Octets],
            /// `SELECTED_*`: local pod -> its number of entries and prefix lengths.
            Selected selected Hash [SelectedV4 SelectedV6] [Key = Self::Octets],
            /// `RULES_*`: rule id -> egress address and interface.
            Rules rules Hash [RulesV4 RulesV6] [Key = u32],
            /// `POD_OWNER_*`: pod -> underlay address of its node.
            PodOwner pod_owner Hash [PodOwnerV4 PodOwnerV6]
                [Key = Self::Octets, Value = egress_common::policy::PodOwnerValue],
            /// `EGRESS_IPS_*`: egress address -> interface and flags.
            EgressIps egress_ips Hash [EgressIpsV4 EgressIpsV6]
                [Key = Self::Octets, Value = egress_common::policy::EgressIpValue],
            /// `ADMITTED_*`: the (pod, rule) pairs this gateway admits.
            Admitted admitted Hash [AdmittedV4 AdmittedV6]
                [Value = egress_common::policy::AdmittedValue],
            /// `KNOWN_PODS_*`: local pods the agent has seen.
            KnownPods known_pods Hash [KnownPodsV4 KnownPodsV6]
                [Key = Self::Octets, Value = egress_common::policy::KnownPodValue],
            /// `COVERED_*`: what any rule covers, by destination.
            Covered covered Lpm [CoveredV4 CoveredV6]
                [Key = Self::Octets, Value = egress_common::policy::CoveredValue],
            /// `POD_DEVICES_*`: local pod -> the host-side device it was found behind.
            PodDevices pod_devices Hash [PodDevicesV4 PodDevicesV6]
                [Key = Self::Octets, Value = egress_common::policy::PodDeviceValue],
        }
    };
}
pub(crate) use family_maps;

/// [`Maps`] and its two impls, from [`family_maps!`].
macro_rules! map_types {
    ($(
        $(#[$doc:meta])*
        $Map:ident $field:ident $kind:ident [$v4:ident $v6:ident] [$($bound:tt)*],
    )*) => {
        /// Each family's pinned maps with their ABI types (see [`family_maps!`]).
        pub trait Maps: 'static {
            /// An address as the maps hold it (network order).
            type Octets: Copy + Ord + Hash + Debug + Default + aya::Pod;
            $( $(#[$doc])* type $Map: Synced<$($bound)*>; )*
            /// `CT_*`'s key (the datapath writes the conntrack maps; the agent sweeps and
            /// reads them).
            type CtKey: CtKey<Pod = Self::Octets>;
            /// `CT_*`: the conntrack map.
            type Ct: Map<Key = Self::CtKey, Value = <Self::CtKey as CtKey>::Entry>;
            /// `FLOWS_*`: live flows per pod.
            type Flows: Map<Key = Self::Octets, Value = FlowCount>;
        }
        impl Maps for V4 {
            type Octets = [u8; 4];
            $( type $Map = def::$v4; )*
            type CtKey = CtKeyV4;
            type Ct = def::CtV4;
            type Flows = def::FlowsV4;
        }
        impl Maps for V6 {
            type Octets = [u8; 16];
            $( type $Map = def::$v6; )*
            type CtKey = CtKeyV6;
            type Ct = def::CtV6;
            type Flows = def::FlowsV6;
        }
    };
}
family_maps!(map_types);

/// Something with one part per family (as `Desired` has `v4` and `v6`), so that code
/// written once over `F: Family` reaches its family's part with [`Family::part`].
pub trait ByFamily {
    type Part<F: Family>;
    fn v4(&self) -> &Self::Part<V4>;
    fn v4_mut(&mut self) -> &mut Self::Part<V4>;
    fn v6(&self) -> &Self::Part<V6>;
    fn v6_mut(&mut self) -> &mut Self::Part<V6>;
}

/// Runs `$body` once, with `$F` the family of the address `$ip` and `$a` its address in
/// that family: the one dispatch from an [`IpAddr`] to code written over `F: Family`.
///
/// ```
/// use std::net::IpAddr;
///
/// use egress_agent::{by_family, family::Family};
///
/// fn name<F: Family>(_: F::Addr) -> &'static str {
///     F::NAME
/// }
/// let ip: IpAddr = "2001:db8::1".parse().unwrap();
/// assert_eq!(by_family!(ip, |a: F| name::<F>(a)), "IPv6");
/// ```
#[macro_export]
macro_rules! by_family {
    ($ip:expr, |$a:ident: $F:ident| $body:expr) => {
        match $ip {
            ::std::net::IpAddr::V4($a) => {
                #[allow(dead_code, reason = "the body may not name the family")]
                type $F = $crate::family::V4;
                $body
            }
            ::std::net::IpAddr::V6($a) => {
                #[allow(dead_code, reason = "the body may not name the family")]
                type $F = $crate::family::V6;
                $body
            }
        }
    };
}

/// IPv4 or IPv6.
pub trait Family: Maps + Copy + Default + Debug + Eq + Ord + Hash {
    /// "IPv4" or "IPv6", for messages.
    const NAME: &'static str;
    type Addr: Copy + Ord + Hash + Debug + Display + Into<IpAddr> + From<Self::Octets>;
    type Net: Copy + Ord + Hash + Debug + Display + Into<IpNet>;
    fn octets(a: Self::Addr) -> Self::Octets;
    /// `a` if it is of this family.
    fn addr(a: IpAddr) -> Option<Self::Addr>;
    /// `n` if it is of this family.
    fn net(n: IpNet) -> Option<Self::Net>;
    /// A prefix's network address and length.
    fn split(n: Self::Net) -> (Self::Octets, u8);
    /// This family's part of `b`.
    fn part<B: ByFamily>(b: &B) -> &B::Part<Self>;
    fn part_mut<B: ByFamily>(b: &mut B) -> &mut B::Part<Self>;

    fn policy_key(pod: Self::Addr, dst: Self::Net) -> <Self::Policy as Map>::Key;
    /// The pod and the destination prefix's length of a policy key.
    fn policy_key_parts(k: &<Self::Policy as Map>::Key) -> (Self::Octets, u32);
    fn policy_value(
        gateway: Underlay,
        egress_ip: Self::Octets,
        rule_id: u32,
        action: u8,
        filter: u16,
    ) -> <Self::Policy as Map>::Value;
    /// The `SELECTED_*` value of a pod with `entries` entries, before its lengths.
    fn selected(entries: u32) -> <Self::Selected as Map>::Value;
    fn add_length(v: &mut <Self::Selected as Map>::Value, len: u32);
    /// Mark a pod whose policy entries were left out (they did not fit): no entries, no
    /// lengths, `selected_flags::INCOMPLETE`.
    fn set_incomplete(v: &mut <Self::Selected as Map>::Value);
    /// Whether a pod is marked incomplete ([`Family::set_incomplete`]).
    fn incomplete(v: &<Self::Selected as Map>::Value) -> bool;
    /// The `DESTS_*` entries for the policy entries `keys` (of every pod).
    fn dests<'a>(
        keys: impl Iterator<Item = &'a <Self::Policy as Map>::Key>,
    ) -> Prefixes<Self::Dests>;
    fn rule(egress_ip: Self::Octets, ifindex: u32) -> <Self::Rules as Map>::Value;
    fn admitted_key(pod: Self::Octets, rule_id: u32) -> <Self::Admitted as Map>::Key;

    /// A policy map entry read back.
    fn policy_row(
        k: &<Self::Policy as Map>::Key,
        v: &<Self::Policy as Map>::Value,
    ) -> PolicyRow<Self>;
    /// A rule read back: egress address and ifindex.
    fn rule_row(v: &<Self::Rules as Map>::Value) -> (Self::Addr, u32);
    /// The rule of an admitted pair.
    fn admitted_rule(k: &<Self::Admitted as Map>::Key) -> u32;
}

/// A policy map entry in plain types (for printing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyRow<F: Family> {
    pub pod: F::Addr,
    /// Network and prefix length.
    pub dst: (F::Addr, u32),
    /// One of `egress_common::policy::action`.
    pub action: u8,
    pub gateway: Underlay,
    pub egress_ip: F::Addr,
    pub rule_id: u32,
}

/// Both impls of [`Family`]: the same code over each family's types (`dests` differs and
/// is passed in).
macro_rules! family {
    (
        $F:ident, $name:literal, $Ip:ident, $part:ident $part_mut:ident, $Addr:ty, $Net:ty,
        [u8; $n:literal],
        $PolicyKey:ident, $PolicyValue:ident, $SelectedValue:ident, $RuleValue:ident,
        $AdmittedKey:ident, $dests:ident $(,)?
    ) => {
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $F;

        impl Family for $F {
            const NAME: &'static str = $name;
            type Addr = $Addr;
            type Net = $Net;

            fn octets(a: $Addr) -> [u8; $n] {
                a.octets()
            }
            fn addr(a: IpAddr) -> Option<$Addr> {
                match a {
                    IpAddr::$Ip(a) => Some(a),
                    _ => None,
                }
            }
            fn net(n: IpNet) -> Option<$Net> {
                match n {
                    IpNet::$Ip(n) => Some(n),
                    _ => None,
                }
            }
            fn split(n: $Net) -> ([u8; $n], u8) {
                (n.network().octets(), n.prefix_len())
            }
            fn part<B: ByFamily>(b: &B) -> &B::Part<Self> {
                b.$part()
            }
            fn part_mut<B: ByFamily>(b: &mut B) -> &mut B::Part<Self> {
                b.$part_mut()
            }
            fn policy_key(pod: $Addr, dst: $Net) -> $PolicyKey {
                let (net, len) = Self::split(dst);
                $PolicyKey::new(pod.octets(), net, u32::from(len))
            }
            fn policy_key_parts(k: &$PolicyKey) -> ([u8; $n], u32) {
                (k.pod, k.dst_len)
            }
            fn policy_value(
                gateway: Underlay,
                egress_ip: [u8; $n],
                rule_id: u32,
                action: u8,
                filter: u16,
            ) -> $PolicyValue {
                $PolicyValue {
                    gateway,
                    egress_ip,
                    rule_id,
                    action,
                    _pad: 0,
                    filter,
                }
            }
            fn selected(entries: u32) -> $SelectedValue {
                $SelectedValue {
                    entries,
                    ..$SelectedValue::default()
                }
            }
            fn add_length(v: &mut $SelectedValue, len: u32) {
                v.add_length(len);
            }
            fn incomplete(v: &$SelectedValue) -> bool {
                v.flags & egress_common::policy::selected_flags::INCOMPLETE != 0
            }
            fn set_incomplete(v: &mut $SelectedValue) {
                *v = $SelectedValue {
                    flags: v.flags | egress_common::policy::selected_flags::INCOMPLETE,
                    ..$SelectedValue::default()
                };
            }
            fn dests<'a>(
                keys: impl Iterator<Item = &'a $PolicyKey>,
            ) -> Prefixes<<Self as Maps>::Dests> {
                $dests(keys)
            }
            fn rule(egress_ip: [u8; $n], ifindex: u32) -> $RuleValue {
                $RuleValue { egress_ip, ifindex }
            }
            fn admitted_key(pod: [u8; $n], rule_id: u32) -> $AdmittedKey {
                $AdmittedKey { pod, rule_id }
            }
            fn policy_row(k: &$PolicyKey, v: &$PolicyValue) -> PolicyRow<Self> {
                PolicyRow {
                    pod: k.pod.into(),
                    dst: (k.dst.into(), k.dst_len),
                    action: v.action,
                    gateway: v.gateway,
                    egress_ip: v.egress_ip.into(),
                    rule_id: v.rule_id,
                }
            }
            fn rule_row(v: &$RuleValue) -> ($Addr, u32) {
                (v.egress_ip.into(), v.ifindex)
            }
            fn admitted_rule(k: &$AdmittedKey) -> u32 {
                k.rule_id
            }
        }
    };
}

family!(
    V4,
    "IPv4",
    V4,
    v4 v4_mut,
    Ipv4Addr,
    Ipv4Net,
    [u8; 4],
    PolicyKeyV4,
    PolicyValueV4,
    SelectedValueV4,
    RuleValueV4,
    AdmittedKeyV4,
    dests_v4,
);
family!(
    V6,
    "IPv6",
    V6,
    v6 v6_mut,
    Ipv6Addr,
    Ipv6Net,
    [u8; 16],
    PolicyKeyV6,
    PolicyValueV6,
    SelectedValueV6,
    RuleValueV6,
    AdmittedKeyV6,
    dests_v6,
);

/// The `DESTS_V4` entries for the policy entries `keys` (of every pod).
fn dests_v4<'a>(keys: impl Iterator<Item = &'a PolicyKeyV4>) -> Prefixes<def::DestsV4> {
    let prefixes = keys.map(|k| (u128::from(u32::from_be_bytes(k.dst)) << 96, k.dst_len));
    chains(prefixes)
        .into_iter()
        .map(|((net, len), lengths)| {
            let net = ((net >> 96) as u32).to_be_bytes();
            ((len, net), DestValueV4::new(len, lengths[0]))
        })
        .collect()
}

/// The `DESTS_V6` entries for the policy entries `keys` (of every pod).
fn dests_v6<'a>(keys: impl Iterator<Item = &'a PolicyKeyV6>) -> Prefixes<def::DestsV6> {
    let prefixes = keys.map(|k| (u128::from_be_bytes(k.dst), k.dst_len));
    chains(prefixes)
        .into_iter()
        .map(|((net, len), lengths)| {
            let v = DestValueV6 {
                lengths,
                len,
                _pad: 0,
            };
            ((len, net.to_be_bytes()), v)
        })
        .collect()
}

/// Each distinct prefix among `prefixes` ((network, length), the network left-aligned in
/// 128 bits: an IPv4 network shifted up by 96) with the lengths of every prefix among
/// them that contains it, itself included (bit n % 64 of word n / 64: length n): the
/// values of `DESTS_V4` / `_V6`.
fn chains(prefixes: impl Iterator<Item = (u128, u32)>) -> Vec<((u128, u32), [u64; 3])> {
    let mut sorted: Vec<(u128, u32)> = prefixes.collect();
    // By network, then length: a prefix comes after every prefix containing it, and the
    // prefixes a prefix contains follow it without a gap.
    sorted.sort_unstable();
    sorted.dedup();
    let contains = |(net, len): (u128, u32), (other, _): (u128, u32)| {
        let mask = if len == 0 {
            0
        } else {
            u128::MAX << (128 - len.min(128))
        };
        other & mask == net
    };
    let mut out = Vec::with_capacity(sorted.len());
    // The chain of prefixes containing the current one, with their lengths.
    let mut stack: Vec<((u128, u32), [u64; 3])> = Vec::new();
    for p in sorted {
        while stack.last().is_some_and(|(q, _)| !contains(*q, p)) {
            stack.pop();
        }
        let mut lengths = stack.last().map_or([0; 3], |(_, l)| *l);
        let len = p.1.min(128);
        lengths[(len / 64) as usize] |= 1 << (len % 64);
        stack.push((p, lengths));
        out.push((p, lengths));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dests_hold_the_lengths_of_every_prefix_containing_theirs() {
        let key = |pod: u8, net: [u8; 4], len| PolicyKeyV4::new([10, 244, 1, pod], net, len);
        let keys = [
            key(5, [10, 0, 0, 0], 8),
            key(5, [10, 100, 0, 0], 16),
            key(5, [10, 100, 0, 0], 24),
            key(5, [10, 100, 0, 16], 28),
            // Another pod: a prefix in between, one beside, and one of the first pod's again.
            key(9, [10, 100, 0, 0], 20),
            key(9, [10, 100, 1, 0], 24),
            key(9, [10, 100, 0, 0], 16),
            key(9, [192, 0, 2, 0], 24),
            key(9, [0, 0, 0, 0], 0),
        ];
        let d = V4::dests(keys.iter());
        let bits = |lens: &[u32]| lens.iter().fold(0u64, |m, l| m | 1 << l);
        let want: BTreeMap<(u32, [u8; 4]), u64> = [
            ((0, [0, 0, 0, 0]), bits(&[0])),
            ((8, [10, 0, 0, 0]), bits(&[0, 8])),
            ((16, [10, 100, 0, 0]), bits(&[0, 8, 16])),
            ((20, [10, 100, 0, 0]), bits(&[0, 8, 16, 20])),
            ((24, [10, 100, 0, 0]), bits(&[0, 8, 16, 20, 24])),
            ((28, [10, 100, 0, 16]), bits(&[0, 8, 16, 20, 24, 28])),
            ((24, [10, 100, 1, 0]), bits(&[0, 8, 16, 20, 24])),
            ((24, [192, 0, 2, 0]), bits(&[0, 24])),
        ]
        .into_iter()
        .collect();
        assert!(d.iter().all(|((len, _), v)| v.len == *len));
        let got: BTreeMap<_, _> = d.into_iter().map(|(k, v)| (k, v.lengths())).collect();
        assert_eq!(got, want);

        let key6 = |net: &str, len| {
            let net: Ipv6Addr = net.parse().unwrap();
            PolicyKeyV6::new([0; 16], net.octets(), len)
        };
        let keys = [
            key6("fd00::", 16),
            key6("fd00:100::", 64),
            key6("fd00:100::10", 124),
            key6("fd00:100::10", 128),
            key6("fd00:200::", 64),
        ];
        let d = V6::dests(keys.iter());
        let net = |a: &str| a.parse::<Ipv6Addr>().unwrap().octets();
        assert_eq!(d[&(16, net("fd00::"))].lengths, [1 << 16, 0, 0]);
        assert_eq!(d[&(64, net("fd00:100::"))].lengths, [1 << 16, 1, 0]);
        assert_eq!(
            d[&(128, net("fd00:100::10"))].lengths,
            [1 << 16, 1 | 1 << 60, 1]
        );
        assert_eq!(d[&(64, net("fd00:200::"))].lengths, [1 << 16, 1, 0]);
        assert_eq!(d.len(), 5);
    }
}
