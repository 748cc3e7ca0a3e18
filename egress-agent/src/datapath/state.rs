//! The desired contents of every map in ABI form, derived from `Desired` (pure).

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;

use egress_common::{
    config::Config,
    policy::{
        AdmittedKeyV4, AdmittedKeyV6, AdmittedValue, CoveredValue, DestValue, DestValueV6,
        EgressIpValue, KnownPodValue, NodeValue, PodOwnerValue, PolicyKeyV4, PolicyKeyV6,
        PolicyValue, PolicyValueV6, RuleValueV4, RuleValueV6, SelectedValue, SelectedValueV6,
        action, coverage, egress_ip_flags,
    },
    underlay::{self, Underlay},
};

use crate::desired::{Desired, HeldIpV4, PolicyAction};

/// What every map should hold. Keys and values are the ABI types of `egress-common`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapState {
    pub policy_v4: BTreeMap<PolicyKeyV4, PolicyValue>,
    /// `DESTS_V4`: (prefix length, network) -> lengths of the prefixes containing it.
    pub dests_v4: BTreeMap<(u32, [u8; 4]), DestValue>,
    pub selected_v4: BTreeMap<[u8; 4], SelectedValue>,
    pub rules_v4: BTreeMap<u32, RuleValueV4>,
    pub nodes: BTreeMap<Underlay, NodeValue>,
    pub pod_owner_v4: BTreeMap<[u8; 4], PodOwnerValue>,
    pub egress_ips_v4: BTreeMap<[u8; 4], EgressIpValue>,
    pub policy_v6: BTreeMap<PolicyKeyV6, PolicyValueV6>,
    pub dests_v6: BTreeMap<(u32, [u8; 16]), DestValueV6>,
    pub selected_v6: BTreeMap<[u8; 16], SelectedValueV6>,
    pub rules_v6: BTreeMap<u32, RuleValueV6>,
    pub pod_owner_v6: BTreeMap<[u8; 16], PodOwnerValue>,
    pub egress_ips_v6: BTreeMap<[u8; 16], EgressIpValue>,
    pub admitted_v4: BTreeMap<AdmittedKeyV4, AdmittedValue>,
    pub admitted_v6: BTreeMap<AdmittedKeyV6, AdmittedValue>,
    pub known_pods_v4: BTreeMap<[u8; 4], KnownPodValue>,
    pub known_pods_v6: BTreeMap<[u8; 16], KnownPodValue>,
    pub covered_v4: BTreeMap<(u32, [u8; 4]), CoveredValue>,
    pub covered_v6: BTreeMap<(u32, [u8; 16]), CoveredValue>,
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

/// The `DESTS_V4` entries for the policy entries `keys` (of every pod).
pub fn dests_v4<'a>(
    keys: impl Iterator<Item = &'a PolicyKeyV4>,
) -> BTreeMap<(u32, [u8; 4]), DestValue> {
    let prefixes = keys.map(|k| (u128::from(u32::from_be_bytes(k.dst)) << 96, k.dst_len));
    chains(prefixes)
        .into_iter()
        .map(|((net, len), lengths)| {
            let net = ((net >> 96) as u32).to_be_bytes();
            ((len, net), DestValue::new(len, lengths[0]))
        })
        .collect()
}

/// The `DESTS_V6` entries for the policy entries `keys` (of every pod).
pub fn dests_v6<'a>(
    keys: impl Iterator<Item = &'a PolicyKeyV6>,
) -> BTreeMap<(u32, [u8; 16]), DestValueV6> {
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

/// An optional underlay address as the maps hold it (zero for none).
fn underlay_of(ip: Option<IpAddr>) -> Underlay {
    ip.map_or([0; 16], underlay::from_ip)
}

fn octets(ip: Option<Ipv4Addr>) -> [u8; 4] {
    ip.map_or([0; 4], |ip| ip.octets())
}

fn octets_v6(ip: Option<Ipv6Addr>) -> [u8; 16] {
    ip.map_or([0; 16], |ip| ip.octets())
}

fn action_code(a: PolicyAction) -> u8 {
    match a {
        PolicyAction::Forward => action::FORWARD,
        PolicyAction::Exclude => action::EXCLUDE,
        PolicyAction::NoGatewayDrop => action::NO_GATEWAY_DROP,
        PolicyAction::NoGatewayPass => action::NO_GATEWAY_PASS,
    }
}

fn egress_ip_value(held: &HeldIpV4, ifindex: u32) -> EgressIpValue {
    let flags = if held.shared {
        egress_ip_flags::SHARED
    } else {
        0
    };
    EgressIpValue { ifindex, flags }
}

impl MapState {
    /// Convert `desired`, resolving interface names with `ifindex`. Entries whose
    /// interface is missing are left out and reported.
    pub fn from_desired(
        desired: &Desired,
        ifindex: impl Fn(&str) -> Option<u32>,
    ) -> (Self, Vec<Unresolved>) {
        let mut s = Self::default();
        let mut unresolved = Vec::new();
        for ((pod, dst), e) in &desired.policy_v4 {
            let key = PolicyKeyV4::new(
                pod.octets(),
                dst.network().octets(),
                u32::from(dst.prefix_len()),
            );
            let action = action_code(e.action);
            s.policy_v4.insert(
                key,
                PolicyValue {
                    gateway: underlay_of(e.gateway),
                    egress_ip: octets(e.egress_ip),
                    rule_id: e.rule_id,
                    action,
                    _pad: [0; 3],
                },
            );
        }
        for (pod, n) in &desired.selected_v4 {
            let v = SelectedValue {
                entries: *n,
                ..SelectedValue::default()
            };
            s.selected_v4.insert(pod.octets(), v);
        }
        // The prefix lengths each pod's lookups probe.
        for key in s.policy_v4.keys() {
            if let Some(v) = s.selected_v4.get_mut(&key.pod) {
                v.add_length(key.dst_len);
            }
        }
        s.dests_v4 = dests_v4(s.policy_v4.keys());
        for (id, r) in &desired.rules_v4 {
            match ifindex(&r.interface) {
                Some(ifindex) => {
                    s.rules_v4.insert(
                        *id,
                        RuleValueV4 {
                            egress_ip: r.egress_ip.octets(),
                            ifindex,
                        },
                    );
                }
                None => unresolved.push(Unresolved::MissingInterface {
                    what: format!("rule {id} (egress IP {})", r.egress_ip),
                    interface: r.interface.clone(),
                }),
            }
        }
        for (ip, id) in &desired.nodes {
            s.nodes
                .insert(underlay::from_ip(*ip), NodeValue { node_id: *id });
        }
        for (pod, node) in &desired.pod_owner_v4 {
            s.pod_owner_v4.insert(
                pod.octets(),
                PodOwnerValue {
                    node: underlay::from_ip(*node),
                },
            );
        }
        for (ip, held) in &desired.egress_ips_v4 {
            match ifindex(&held.interface) {
                Some(ifindex) => {
                    s.egress_ips_v4
                        .insert(ip.octets(), egress_ip_value(held, ifindex));
                }
                None => unresolved.push(Unresolved::MissingInterface {
                    what: format!("egress IP {ip}"),
                    interface: held.interface.clone(),
                }),
            }
        }
        s.add_v6(desired, &ifindex, &mut unresolved);
        s.add_admitted(desired);
        s.add_unknown_pods(desired);
        (s, unresolved)
    }

    /// Known local pods and covered destinations, each in its family's map.
    fn add_unknown_pods(&mut self, desired: &Desired) {
        for pod in &desired.known_pods {
            match pod {
                IpAddr::V4(a) => self
                    .known_pods_v4
                    .insert(a.octets(), KnownPodValue::default()),
                IpAddr::V6(a) => self
                    .known_pods_v6
                    .insert(a.octets(), KnownPodValue::default()),
            };
        }
        for (prefix, covered) in &desired.covered {
            let value = CoveredValue {
                covered: if *covered {
                    coverage::COVERED
                } else {
                    coverage::EXCEPTED
                },
            };
            let len = u32::from(prefix.prefix_len());
            match prefix {
                IpNet::V4(p) => self.covered_v4.insert((len, p.network().octets()), value),
                IpNet::V6(p) => self.covered_v6.insert((len, p.network().octets()), value),
            };
        }
    }

    /// The (pod, rule) pairs this node admits from the tunnel, each in its family's map.
    fn add_admitted(&mut self, desired: &Desired) {
        for &(pod, rule_id) in &desired.admitted {
            match pod {
                IpAddr::V4(pod) => {
                    let key = AdmittedKeyV4 {
                        pod: pod.octets(),
                        rule_id,
                    };
                    self.admitted_v4.insert(key, AdmittedValue::default());
                }
                IpAddr::V6(pod) => {
                    let key = AdmittedKeyV6 {
                        pod: pod.octets(),
                        rule_id,
                    };
                    self.admitted_v6.insert(key, AdmittedValue::default());
                }
            }
        }
    }

    /// The IPv6 maps: pods and egress IPs of IPv6 (node addresses, of either family, are
    /// in the shared `NODES` and owner values).
    fn add_v6(
        &mut self,
        desired: &Desired,
        ifindex: &impl Fn(&str) -> Option<u32>,
        unresolved: &mut Vec<Unresolved>,
    ) {
        for ((pod, dst), e) in &desired.policy_v6 {
            let key = PolicyKeyV6::new(
                pod.octets(),
                dst.network().octets(),
                u32::from(dst.prefix_len()),
            );
            self.policy_v6.insert(
                key,
                PolicyValueV6 {
                    gateway: underlay_of(e.gateway),
                    rule_id: e.rule_id,
                    action: action_code(e.action),
                    _pad: [0; 3],
                    egress_ip: octets_v6(e.egress_ip),
                },
            );
        }
        for (pod, n) in &desired.selected_v6 {
            let v = SelectedValueV6 {
                entries: *n,
                ..SelectedValueV6::default()
            };
            self.selected_v6.insert(pod.octets(), v);
        }
        for key in self.policy_v6.keys() {
            if let Some(v) = self.selected_v6.get_mut(&key.pod) {
                v.add_length(key.dst_len);
            }
        }
        self.dests_v6 = dests_v6(self.policy_v6.keys());
        for (id, r) in &desired.rules_v6 {
            match ifindex(&r.interface) {
                Some(ifindex) => {
                    self.rules_v6.insert(
                        *id,
                        RuleValueV6 {
                            egress_ip: r.egress_ip.octets(),
                            ifindex,
                        },
                    );
                }
                None => unresolved.push(Unresolved::MissingInterface {
                    what: format!("rule {id} (egress IP {})", r.egress_ip),
                    interface: r.interface.clone(),
                }),
            }
        }
        for (pod, node) in &desired.pod_owner_v6 {
            self.pod_owner_v6.insert(
                pod.octets(),
                PodOwnerValue {
                    node: underlay::from_ip(*node),
                },
            );
        }
        for (ip, held) in &desired.egress_ips_v6 {
            match ifindex(&held.interface) {
                Some(ifindex) => {
                    self.egress_ips_v6
                        .insert(ip.octets(), egress_ip_value(held, ifindex));
                }
                None => unresolved.push(Unresolved::MissingInterface {
                    what: format!("egress IP {ip}"),
                    interface: held.interface.clone(),
                }),
            }
        }
    }

    /// Leave the maps of `--unknown-pods drop` empty (the mode is off).
    pub fn forget_unknown_pods(&mut self) {
        self.known_pods_v4.clear();
        self.known_pods_v6.clear();
        self.covered_v4.clear();
        self.covered_v6.clear();
    }

    /// Number of entries per map, by map name.
    pub fn sizes(&self) -> [(&'static str, usize); 19] {
        use egress_common::maps::*;
        [
            (POLICY_V4, self.policy_v4.len()),
            (DESTS_V4, self.dests_v4.len()),
            (SELECTED_V4, self.selected_v4.len()),
            (RULES_V4, self.rules_v4.len()),
            (NODES, self.nodes.len()),
            (POD_OWNER_V4, self.pod_owner_v4.len()),
            (EGRESS_IPS_V4, self.egress_ips_v4.len()),
            (POLICY_V6, self.policy_v6.len()),
            (DESTS_V6, self.dests_v6.len()),
            (SELECTED_V6, self.selected_v6.len()),
            (RULES_V6, self.rules_v6.len()),
            (POD_OWNER_V6, self.pod_owner_v6.len()),
            (EGRESS_IPS_V6, self.egress_ips_v6.len()),
            (ADMITTED_V4, self.admitted_v4.len()),
            (ADMITTED_V6, self.admitted_v6.len()),
            (KNOWN_PODS_V4, self.known_pods_v4.len()),
            (KNOWN_PODS_V6, self.known_pods_v6.len()),
            (COVERED_V4, self.covered_v4.len()),
            (COVERED_V6, self.covered_v6.len()),
        ]
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
    use super::*;
    use crate::desired::{GatewayRuleV4, HeldIpV4, PolicyEntryV4};

    #[test]
    fn converts_entries_and_reports_missing_interfaces() {
        let mut d = Desired::default();
        let pod: Ipv4Addr = "10.244.1.5".parse().unwrap();
        d.policy_v4.insert(
            (pod, "192.0.2.0/24".parse().unwrap()),
            PolicyEntryV4 {
                action: PolicyAction::Forward,
                gateway: Some("10.200.0.21".parse().unwrap()),
                egress_ip: Some("192.0.2.50".parse().unwrap()),
                rule_id: 7,
            },
        );
        d.selected_v4.insert(pod, 1);
        d.rules_v4.insert(
            7,
            GatewayRuleV4 {
                egress_ip: "192.0.2.50".parse().unwrap(),
                interface: "sec-a".into(),
            },
        );
        d.rules_v4.insert(
            8,
            GatewayRuleV4 {
                egress_ip: "198.51.100.9".parse().unwrap(),
                interface: "nope".into(),
            },
        );
        d.egress_ips_v4.insert(
            "192.0.2.50".parse().unwrap(),
            HeldIpV4 {
                interface: "sec-a".into(),
                prefix_len: 24,
                shared: false,
            },
        );
        let (s, unresolved) = MapState::from_desired(&d, |n| (n == "sec-a").then_some(4));
        let (key, v) = s.policy_v4.iter().next().unwrap();
        assert_eq!(key.dst_len, 24);
        assert_eq!(key.pod, [10, 244, 1, 5]);
        assert_eq!(key.dst, [192, 0, 2, 0]);
        assert_eq!(s.selected_v4[&key.pod].lengths, 1 << 24);
        assert_eq!(v.gateway, underlay::from_v4([10, 200, 0, 21]));
        assert_eq!(v.action, action::FORWARD);
        assert_eq!(s.rules_v4[&7].ifindex, 4);
        assert!(!s.rules_v4.contains_key(&8));
        assert_eq!(s.egress_ips_v4[&[192, 0, 2, 50]].flags, 0);
        assert_eq!(unresolved.len(), 1);
        assert!(unresolved[0].to_string().contains("\"nope\""));
        assert!(s.policy_v6.is_empty() && s.egress_ips_v6.is_empty());
    }

    #[test]
    fn converts_ipv6_entries_with_the_ipv4_underlay_gateway() {
        use crate::desired::{GatewayRuleV6, PolicyEntryV6};
        let mut d = Desired::default();
        let pod: Ipv6Addr = "fd00:244:1::5".parse().unwrap();
        let egress: Ipv6Addr = "fd00:101::50".parse().unwrap();
        d.policy_v6.insert(
            (pod, "fd00:101::/64".parse().unwrap()),
            PolicyEntryV6 {
                action: PolicyAction::Forward,
                gateway: Some("10.200.0.21".parse().unwrap()),
                egress_ip: Some(egress),
                rule_id: 9,
            },
        );
        d.policy_v6.insert(
            (pod, "fd00:101::/120".parse().unwrap()),
            PolicyEntryV6 {
                action: PolicyAction::Exclude,
                gateway: None,
                egress_ip: None,
                rule_id: 9,
            },
        );
        d.selected_v6.insert(pod, 2);
        d.rules_v6.insert(
            9,
            GatewayRuleV6 {
                egress_ip: egress,
                interface: "sec-a".into(),
            },
        );
        d.pod_owner_v6.insert(pod, "10.200.0.1".parse().unwrap());
        d.egress_ips_v6.insert(
            egress,
            HeldIpV4 {
                interface: "sec-a".into(),
                prefix_len: 64,
                shared: true,
            },
        );
        let (s, unresolved) = MapState::from_desired(&d, |n| (n == "sec-a").then_some(4));
        assert!(unresolved.is_empty());
        let forward = s.policy_v6.iter().find(|(k, _)| k.dst_len == 64).unwrap();
        assert_eq!(forward.0.pod, pod.octets());
        assert_eq!(forward.1.gateway, underlay::from_v4([10, 200, 0, 21]));
        assert_eq!(forward.1.egress_ip, egress.octets());
        assert_eq!(forward.1.action, action::FORWARD);
        let except = s.policy_v6.iter().find(|(k, _)| k.dst_len == 120).unwrap();
        assert_eq!(except.1.action, action::EXCLUDE);
        assert_eq!(except.1.egress_ip, [0; 16]);
        assert_eq!(s.selected_v6[&pod.octets()].entries, 2);
        assert_eq!(
            s.selected_v6[&pod.octets()].lengths,
            [0, 1 | 1 << (120 - 64), 0]
        );
        assert_eq!(s.rules_v6[&9].ifindex, 4);
        assert_eq!(s.rules_v6[&9].egress_ip, egress.octets());
        assert_eq!(
            s.pod_owner_v6[&pod.octets()].node,
            underlay::from_v4([10, 200, 0, 1])
        );
        assert_eq!(
            s.egress_ips_v6[&egress.octets()].flags,
            egress_ip_flags::SHARED
        );
        assert!(s.policy_v4.is_empty());
    }

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
        let d = dests_v4(keys.iter());
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
        let d = dests_v6(keys.iter());
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

    #[test]
    fn admitted_pairs_go_to_the_map_of_their_family() {
        let mut d = Desired::default();
        let v4: Ipv4Addr = "10.244.1.5".parse().unwrap();
        let v6: Ipv6Addr = "fd00:244:1::5".parse().unwrap();
        d.admitted.insert((v4.into(), 7));
        d.admitted.insert((v4.into(), 8));
        d.admitted.insert((v6.into(), 9));
        let (s, _) = MapState::from_desired(&d, |_| None);
        let v4_keys: Vec<_> = s.admitted_v4.keys().copied().collect();
        assert_eq!(
            v4_keys,
            [7, 8].map(|rule_id| AdmittedKeyV4 {
                pod: v4.octets(),
                rule_id
            })
        );
        let v6_keys: Vec<_> = s.admitted_v6.keys().copied().collect();
        assert_eq!(
            v6_keys,
            [AdmittedKeyV6 {
                pod: v6.octets(),
                rule_id: 9
            }]
        );
        assert!(s.admitted_v4.values().all(|v| v.flags == 0));
    }
}
