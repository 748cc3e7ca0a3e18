//! The counters of an explained path, from the pinned maps of the node `explain` runs on
//! (`--bpffs-dir`, as `egress-agent maps` reads them). The datapath counts per reason and
//! node, not per pod or rule: these are the reasons the path's packets are counted under,
//! with every other packet of the node that took them.

use std::{collections::BTreeMap, fmt::Write as _, net::IpAddr, path::Path};

use egress_common::counters::{self, Counter, reason};

use super::{Explanation, Match, Outcome};
use crate::{datapath::dump, desired::PolicyAction};

/// The reasons the source node counts a matched path's packets under.
fn source_reasons(m: &Match) -> Vec<u32> {
    let local = m.gateway.as_ref().is_some_and(|g| g.local);
    match m.action {
        PolicyAction::Forward => {
            let mut r = vec![if local {
                reason::LOCAL_GATEWAY
            } else {
                reason::TUNNELED
            }];
            if !local {
                r.extend([reason::MSS_CLAMPED, reason::DROP_TUNNEL_KEY]);
            }
            r.extend([reason::DROP_NETWORK_POLICY, reason::DROP_POLICY_MAP_FULL]);
            r
        }
        PolicyAction::Exclude => vec![reason::EXCLUDED],
        PolicyAction::NoGatewayDrop => vec![reason::DROP_NO_GATEWAY],
        PolicyAction::NoGatewayPass => vec![reason::FALLTHROUGH],
        PolicyAction::Deny => vec![reason::DROP_NETWORK_POLICY],
    }
}

/// The reasons a gateway counts a forwarded path's packets under.
const GATEWAY_REASONS: [u32; 12] = [
    reason::SNAT_NEW,
    reason::SNAT_HIT,
    reason::FORWARDED,
    reason::REVERSE_NAT,
    reason::RETURN_TUNNELED,
    reason::DROP_FIB,
    reason::FRAG_NEEDED_SENT,
    reason::DROP_MTU,
    reason::DROP_PORT_EXHAUSTED,
    reason::DROP_POD_FLOW_LIMIT,
    reason::DROP_NOT_ADMITTED,
    reason::DROP_UNKNOWN_RULE,
];

/// Which reasons of the path the node at `here` counts, and as what (none: it is neither
/// the pod's node nor the gateway).
fn reasons_here(e: &Explanation, m: &Match, here: IpAddr) -> Option<(&'static str, Vec<u32>)> {
    let source = e.node_ip == Some(here);
    let gateway = m.action == PolicyAction::Forward
        && m.gateway
            .as_ref()
            .is_some_and(|g| g.underlay == Some(here) || (g.local && source));
    match (source, gateway) {
        (true, true) => {
            let mut r = source_reasons(m);
            r.extend(GATEWAY_REASONS);
            Some(("the pod's node and its gateway", r))
        }
        (true, false) => Some(("the pod's node", source_reasons(m))),
        (false, true) => Some(("the path's gateway", GATEWAY_REASONS.to_vec())),
        (false, false) => None,
    }
}

/// The `counters:` lines of `e`, from the maps pinned under `pin_dir`; one line when they
/// are absent or unreadable, or when this node is not on the path.
pub fn text(e: &Explanation, pin_dir: &Path) -> String {
    let mut s = String::new();
    let label = "counters:";
    let Outcome::Matched(m) = &e.outcome else {
        let _ = writeln!(
            s,
            "{label:<16}none: the datapath passes packets no entry matches without counting them"
        );
        return s;
    };
    if !dump::has_maps(pin_dir) {
        let _ = writeln!(
            s,
            "{label:<16}not available: no agent's maps pinned under {} (run this on the \
             pod's node or its gateway, or pass --bpffs-dir)",
            pin_dir.display()
        );
        return s;
    }
    let read = dump::node_address(pin_dir).and_then(|here| Ok((here, dump::counters(pin_dir)?)));
    let (here, counted) = match read {
        Ok(r) => r,
        Err(err) => {
            let _ = writeln!(
                s,
                "{label:<16}not available: {}",
                crate::report::chain(&err)
            );
            return s;
        }
    };
    let Some((role, reasons)) = reasons_here(e, m, here) else {
        let _ = writeln!(
            s,
            "{label:<16}not on this path: the maps under {} are node {here}'s, neither the \
             pod's node nor its gateway",
            pin_dir.display()
        );
        return s;
    };
    let counted: BTreeMap<u32, Counter> = counted.into_iter().collect();
    let _ = writeln!(
        s,
        "{label:<16}node {here} ({role}), per reason, of every pod and rule of the node:"
    );
    for r in reasons {
        let c = counted.get(&r).copied().unwrap_or_default();
        let name = counters::name(r).unwrap_or("?");
        let _ = writeln!(
            s,
            "{:<16}{name:<22} {:>12} packets {:>14} bytes",
            "", c.packets, c.bytes
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        api::FailurePolicy,
        explain::{Destination, Hop, NetworkPolicyVerdict, Origin, PodRef, Target},
    };

    fn explanation(action: PolicyAction, local: bool) -> Explanation {
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        Explanation {
            pod: PodRef {
                namespace: "shop".to_owned(),
                name: "api-1".to_owned(),
            },
            destination: "192.0.2.7".parse::<Destination>().expect("destination"),
            node: Some("worker-1".to_owned()),
            node_ip: Some(ip("10.0.0.1")),
            pod_ip: Some(ip("10.244.1.11")),
            outcome: Outcome::Matched(Box::new(Match {
                policy: "payments".to_owned(),
                rule: 0,
                rule_id: 7,
                prefix: "192.0.2.0/24".parse().expect("prefix"),
                origin: Origin::Learned,
                entries: 1,
                action,
                target: Target::EgressIp(ip("198.51.100.10")),
                gateway: (action == PolicyAction::Forward).then(|| Hop {
                    node: "gw-1".to_owned(),
                    underlay: Some(ip(if local { "10.0.0.1" } else { "10.0.0.11" })),
                    interface: Some("ens224".to_owned()),
                    local,
                }),
                egress_ip: Some(ip("198.51.100.10")),
                failure_policy: FailurePolicy::Drop,
                network_policy: NetworkPolicyVerdict::NotRestricted,
                conditions: Vec::new(),
                status_holder: None,
            })),
        }
    }

    fn here(e: &Explanation, node: &str) -> Option<(&'static str, Vec<u32>)> {
        let Outcome::Matched(m) = &e.outcome else {
            panic!("a match");
        };
        reasons_here(e, m, node.parse().expect("ip"))
    }

    #[test]
    fn each_node_of_the_path_counts_its_side() {
        let remote = explanation(PolicyAction::Forward, false);
        let (role, reasons) = here(&remote, "10.0.0.1").expect("on the path");
        assert_eq!(role, "the pod's node");
        assert_eq!(reasons[0], reason::TUNNELED);
        assert!(!reasons.contains(&reason::SNAT_NEW));
        let (role, reasons) = here(&remote, "10.0.0.11").expect("on the path");
        assert_eq!(
            (role, reasons),
            ("the path's gateway", GATEWAY_REASONS.to_vec())
        );
        assert_eq!(here(&remote, "10.0.0.2"), None);

        let local = explanation(PolicyAction::Forward, true);
        let (role, reasons) = here(&local, "10.0.0.1").expect("on the path");
        assert_eq!(role, "the pod's node and its gateway");
        assert_eq!(reasons[0], reason::LOCAL_GATEWAY);
        assert!(reasons.contains(&reason::SNAT_NEW) && !reasons.contains(&reason::TUNNELED));

        let dropped = explanation(PolicyAction::NoGatewayDrop, false);
        assert_eq!(
            here(&dropped, "10.0.0.1"),
            Some(("the pod's node", vec![reason::DROP_NO_GATEWAY]))
        );
        assert_eq!(here(&dropped, "10.0.0.11"), None);
    }
}
