//! This node's maps in a pass: its configuration (the tunnel MTU and the config map) and
//! the map contents of what it serves, fitted to the maps' capacities, through
//! [`Datapath`].

use std::{collections::BTreeSet, net::IpAddr};

use anyhow::Result;
use tracing::{info, warn};

use super::{Reconciler, UnknownPods, start::tunnel_mtu_for};
use crate::{
    api::{FullPolicyMap, PreflightCheck, PreflightResult},
    compiler::PodRoute,
    datapath::{self, Datapath, MapState, state::LeftOut},
    desired::Desired,
    iface,
};

impl Reconciler<'_> {
    /// Pins that vanished behind this agent's back, restored; the failure to, as a
    /// problem.
    pub(super) fn restore_pins(&self, dp: &mut Datapath) -> Vec<String> {
        match dp.restore_pins() {
            Ok(restored) if !restored.is_empty() => {
                warn!(
                    "pins vanished from {} behind this agent (removed by hand, or a \
                     cleanup): restored {}",
                    self.cfg.bpffs_dir.display(),
                    restored.join("; ")
                );
                Vec::new()
            }
            Ok(_) => Vec::new(),
            Err(e) => vec![e.to_string()],
        }
    }

    /// This node's configuration: tunnel MTU and the config map.
    pub(super) async fn configure(
        &mut self,
        dp: &mut Datapath,
        desired: &Desired,
        problems: &mut Vec<String>,
    ) -> Result<usize> {
        let Some(node_ip) = desired.node_ip else {
            problems.push(format!(
                "node {}: no Node object with an InternalIP address: not configured",
                self.cfg.node_name
            ));
            return Ok(0);
        };
        let mtu =
            (self.cfg.tunnel_mtu).unwrap_or_else(|| tunnel_mtu_for(self.underlay_mtu, node_ip));
        if mtu != self.tunnel_mtu {
            self.nl
                .ensure_vxlan(&self.cfg.tunnel_device, self.cfg.tunnel_port, mtu)
                .await?;
            info!(tunnel_mtu = mtu, underlay = %node_ip, "tunnel MTU set for the underlay");
            self.tunnel_mtu = mtu;
        }
        let want = datapath::state::config(
            node_ip,
            self.tunnel_ifindex,
            self.cfg.port_min,
            self.cfg.port_max,
            u16::try_from(self.tunnel_mtu).unwrap_or(u16::MAX),
            self.cfg.unknown_pods == UnknownPods::Drop,
            self.cfg.max_flows_per_pod,
        );
        if dp.config().ok() == Some(want) {
            return Ok(0);
        }
        dp.set_config(&want)?;
        Ok(1)
    }

    /// The maps of what this node serves (`desired`), fitted to their capacities: what
    /// did not fit is a problem, and (naming the policies of `pod_routes` that select the
    /// pods left out) goes into the EgressNode for the policies' statuses.
    pub(super) fn sync_maps(
        &mut self,
        dp: &mut Datapath,
        desired: &Desired,
        pod_routes: &[PodRoute],
        ifaces: &[iface::Interface],
        problems: &mut Vec<String>,
    ) -> Result<usize> {
        let ifindex = |n: &str| ifaces.iter().find(|i| i.name == n).map(|i| i.ifindex);
        let (mut want, unresolved) = MapState::from_desired(desired, ifindex);
        let left_out = want.fit_policy(self.cfg.capacities.policy);
        self.publisher.set_full_policy_maps(
            left_out
                .iter()
                .map(|l| full_policy_map(l, pod_routes))
                .collect(),
        );
        let left_out: Vec<String> = left_out.iter().map(ToString::to_string).collect();
        // The EgressNode says so too, for as long as it lasts (statuses are the same on
        // every node; this is one node's map).
        let check = match left_out.first() {
            Some(first) => PreflightCheck {
                check: "policy-map".to_owned(),
                result: PreflightResult::Fail,
                message: first.chars().take(1000).collect(),
            },
            None => PreflightCheck {
                check: "policy-map".to_owned(),
                result: PreflightResult::Ok,
                // Counts would rewrite the EgressNode on every edit: the capacity only.
                message: format!(
                    "every selected pod's entries fit the policy maps ({} per family, \
                     --policy-map-entries)",
                    self.cfg.capacities.policy
                ),
            },
        };
        self.publisher.set_preflight(check);
        problems.extend(left_out);
        if self.cfg.unknown_pods == UnknownPods::Pass {
            want.forget_unknown_pods();
        }
        // The devices step binds pods to their devices after this apply; until then each
        // keeps the binding the maps hold (also those a restarted agent finds pinned),
        // while it is still a local pod that is bound at all.
        let mut bound = dp.held().pod_devices();
        bound.retain(|pod, _| bindable(desired, self.cfg.unknown_pods, *pod));
        want.set_pod_devices(&bound);
        problems.extend(unresolved.iter().map(ToString::to_string));
        let st = dp.apply(&want)?;
        problems.extend(st.problems());
        Ok(st.changed())
    }
}

/// Whether `pod` may keep a binding to its device (`attachments::bindings`): a local
/// selected pod, or with `--unknown-pods drop` a local pod the agent knows.
fn bindable(desired: &Desired, unknown_pods: UnknownPods, pod: IpAddr) -> bool {
    desired.local_selected_pods().any(|p| p == pod)
        || (unknown_pods == UnknownPods::Drop && desired.known_pods.contains(&pod))
}

/// What the EgressNode says of a policy map that `left_out` did not fit: the policies
/// (of this node's `pod_routes`) that select a pod left out.
fn full_policy_map(left_out: &LeftOut, pod_routes: &[PodRoute]) -> FullPolicyMap {
    let pods: BTreeSet<IpAddr> = left_out.pods.iter().map(|(p, _)| *p).collect();
    let policies: BTreeSet<&str> = pod_routes
        .iter()
        .filter(|r| pods.contains(&r.pod_ip))
        .map(|r| r.policy.as_str())
        .collect();
    FullPolicyMap {
        map: left_out.map.to_owned(),
        capacity: u32::try_from(left_out.capacity).unwrap_or(u32::MAX),
        pods_left_out: u32::try_from(left_out.pods.len()).unwrap_or(u32::MAX),
        policies: policies.into_iter().map(str::to_owned).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(pod_ip: &str, policy: &str) -> PodRoute {
        PodRoute {
            pod: format!("default/{pod_ip}"),
            pod_ip: pod_ip.parse().expect("address literal"),
            policy: policy.to_owned(),
            rule: 0,
            egress_ip: None,
            gateway: None,
            rule_id: 0,
            wire_id: 0,
        }
    }

    #[test]
    fn a_full_policy_map_names_the_policies_of_the_pods_left_out() {
        let left_out = LeftOut {
            map: "POLICY_V4",
            capacity: 4,
            pods: vec![("10.244.1.2".parse().expect("address literal"), 3)],
        };
        let routes = [
            route("10.244.1.1", "fits"),
            route("10.244.1.2", "payments"),
            route("10.244.1.2", "audit"),
            route("10.244.1.2", "payments"),
        ];
        assert_eq!(
            full_policy_map(&left_out, &routes),
            FullPolicyMap {
                map: "POLICY_V4".to_owned(),
                capacity: 4,
                pods_left_out: 1,
                policies: vec!["audit".to_owned(), "payments".to_owned()],
            }
        );
    }
}
