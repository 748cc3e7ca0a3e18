//! The desired contents of every map in ABI form, derived from `Desired` (pure).

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;

use egress_common::{
    config::Config,
    policy::{
        AdmittedKeyV4, AdmittedKeyV6, AdmittedValue, CoveredValue, EgressIpValue, KnownPodValue,
        NodeValue, POD_PREFIX_BITS_V4, POD_PREFIX_BITS_V6, PodOwnerValue, PolicyKeyV4, PolicyKeyV6,
        PolicyValue, PolicyValueV6, RuleValueV4, RuleValueV6, SelectedValue, action, coverage,
        egress_ip_flags,
    },
    underlay::{self, Underlay},
};

use crate::desired::{Desired, HeldIpV4, PolicyAction};

/// An LPM key as (prefix length, data), ordered, so it can live in a `BTreeMap`.
pub type LpmKeyV4 = (u32, PolicyKeyV4);
pub type LpmKeyV6 = (u32, PolicyKeyV6);

/// What every map should hold. Keys and values are the ABI types of `egress-common`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapState {
    pub policy_v4: BTreeMap<LpmKeyV4, PolicyValue>,
    pub selected_v4: BTreeMap<[u8; 4], SelectedValue>,
    pub rules_v4: BTreeMap<u32, RuleValueV4>,
    pub nodes: BTreeMap<Underlay, NodeValue>,
    pub pod_owner_v4: BTreeMap<[u8; 4], PodOwnerValue>,
    pub egress_ips_v4: BTreeMap<[u8; 4], EgressIpValue>,
    pub policy_v6: BTreeMap<LpmKeyV6, PolicyValueV6>,
    pub selected_v6: BTreeMap<[u8; 16], SelectedValue>,
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
            let key = PolicyKeyV4 {
                pod: pod.octets(),
                dst: dst.network().octets(),
            };
            let action = action_code(e.action);
            s.policy_v4.insert(
                (POD_PREFIX_BITS_V4 + u32::from(dst.prefix_len()), key),
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
            s.selected_v4
                .insert(pod.octets(), SelectedValue { entries: *n });
        }
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
            let key = PolicyKeyV6 {
                pod: pod.octets(),
                dst: dst.network().octets(),
            };
            self.policy_v6.insert(
                (POD_PREFIX_BITS_V6 + u32::from(dst.prefix_len()), key),
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
            self.selected_v6
                .insert(pod.octets(), SelectedValue { entries: *n });
        }
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
    pub fn sizes(&self) -> [(&'static str, usize); 17] {
        use egress_common::maps::*;
        [
            (POLICY_V4, self.policy_v4.len()),
            (SELECTED_V4, self.selected_v4.len()),
            (RULES_V4, self.rules_v4.len()),
            (NODES, self.nodes.len()),
            (POD_OWNER_V4, self.pod_owner_v4.len()),
            (EGRESS_IPS_V4, self.egress_ips_v4.len()),
            (POLICY_V6, self.policy_v6.len()),
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
        assert_eq!(key.0, 32 + 24);
        assert_eq!(key.1.pod, [10, 244, 1, 5]);
        assert_eq!(key.1.dst, [192, 0, 2, 0]);
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
        let forward = s
            .policy_v6
            .iter()
            .find(|((len, _), _)| *len == 128 + 64)
            .unwrap();
        assert_eq!(forward.0.1.pod, pod.octets());
        assert_eq!(forward.1.gateway, underlay::from_v4([10, 200, 0, 21]));
        assert_eq!(forward.1.egress_ip, egress.octets());
        assert_eq!(forward.1.action, action::FORWARD);
        let except = s
            .policy_v6
            .iter()
            .find(|((len, _), _)| *len == 128 + 120)
            .unwrap();
        assert_eq!(except.1.action, action::EXCLUDE);
        assert_eq!(except.1.egress_ip, [0; 16]);
        assert_eq!(s.selected_v6[&pod.octets()].entries, 2);
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
