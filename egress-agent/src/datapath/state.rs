//! The desired contents of every map in ABI form, derived from `Desired` (pure).

use std::{collections::BTreeMap, net::Ipv4Addr};

use egress_common::{
    config::Config,
    policy::{
        EgressIpValue, NodeValue, POD_PREFIX_BITS_V4, PodOwnerValue, PolicyKeyV4, PolicyValue,
        RuleValueV4, SelectedValue, action, egress_ip_flags,
    },
};

use crate::desired::{Desired, PolicyAction};

/// An LPM key as (prefix length, data), ordered, so it can live in a `BTreeMap`.
pub type LpmKeyV4 = (u32, PolicyKeyV4);

/// What every map should hold. Keys and values are the ABI types of `egress-common`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapState {
    pub policy_v4: BTreeMap<LpmKeyV4, PolicyValue>,
    pub selected_v4: BTreeMap<[u8; 4], SelectedValue>,
    pub rules_v4: BTreeMap<u32, RuleValueV4>,
    pub nodes: BTreeMap<[u8; 4], NodeValue>,
    pub pod_owner_v4: BTreeMap<[u8; 4], PodOwnerValue>,
    pub egress_ips_v4: BTreeMap<[u8; 4], EgressIpValue>,
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

fn octets(ip: Option<Ipv4Addr>) -> [u8; 4] {
    ip.map_or([0; 4], |ip| ip.octets())
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
            let action = match e.action {
                PolicyAction::Forward => action::FORWARD,
                PolicyAction::Exclude => action::EXCLUDE,
                PolicyAction::NoGatewayDrop => action::NO_GATEWAY_DROP,
                PolicyAction::NoGatewayPass => action::NO_GATEWAY_PASS,
            };
            s.policy_v4.insert(
                (POD_PREFIX_BITS_V4 + u32::from(dst.prefix_len()), key),
                PolicyValue {
                    gateway: octets(e.gateway),
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
            s.nodes.insert(ip.octets(), NodeValue { node_id: *id });
        }
        for (pod, node) in &desired.pod_owner_v4 {
            s.pod_owner_v4.insert(
                pod.octets(),
                PodOwnerValue {
                    node: node.octets(),
                },
            );
        }
        for (ip, held) in &desired.egress_ips_v4 {
            match ifindex(&held.interface) {
                Some(ifindex) => {
                    let flags = if held.shared {
                        egress_ip_flags::SHARED
                    } else {
                        0
                    };
                    s.egress_ips_v4
                        .insert(ip.octets(), EgressIpValue { ifindex, flags });
                }
                None => unresolved.push(Unresolved::MissingInterface {
                    what: format!("egress IP {ip}"),
                    interface: held.interface.clone(),
                }),
            }
        }
        (s, unresolved)
    }

    /// Number of entries per map, by map name.
    pub fn sizes(&self) -> [(&'static str, usize); 6] {
        use egress_common::maps::*;
        [
            (POLICY_V4, self.policy_v4.len()),
            (SELECTED_V4, self.selected_v4.len()),
            (RULES_V4, self.rules_v4.len()),
            (NODES, self.nodes.len()),
            (POD_OWNER_V4, self.pod_owner_v4.len()),
            (EGRESS_IPS_V4, self.egress_ips_v4.len()),
        ]
    }
}

/// The `CONFIG` entry for this node.
pub fn config(
    node_ip: Ipv4Addr,
    tunnel_ifindex: u32,
    port_min: u16,
    port_max: u16,
    tunnel_mtu: u16,
) -> Config {
    Config {
        node_ip: node_ip.octets(),
        tunnel_ifindex,
        port_min,
        port_max,
        tunnel_mtu,
        flags: egress_common::config::flags::READY,
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
        assert_eq!(v.gateway, [10, 200, 0, 21]);
        assert_eq!(v.action, action::FORWARD);
        assert_eq!(s.rules_v4[&7].ifindex, 4);
        assert!(!s.rules_v4.contains_key(&8));
        assert_eq!(s.egress_ips_v4[&[192, 0, 2, 50]].flags, 0);
        assert_eq!(unresolved.len(), 1);
        assert!(unresolved[0].to_string().contains("\"nope\""));
    }
}
