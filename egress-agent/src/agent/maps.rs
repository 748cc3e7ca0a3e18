//! This node's maps in a pass: its configuration (the tunnel MTU and the config map) and
//! the map contents of what it serves, fitted to the maps' capacities, through
//! [`Datapath`].

use anyhow::Result;
use tracing::{info, warn};

use super::{Reconciler, UnknownPods, start::tunnel_mtu_for};
use crate::{
    api::{PreflightCheck, PreflightResult},
    datapath::{self, Datapath, MapState},
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

    /// Replace the EgressNode's preflight line of `check`'s name (or add it): the line
    /// says what is true now, not at start.
    pub(super) fn set_preflight(&mut self, check: PreflightCheck) {
        match self.preflight.iter_mut().find(|c| c.check == check.check) {
            Some(c) => *c = check,
            None => self.preflight.push(check),
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

    pub(super) fn sync_maps(
        &mut self,
        dp: &mut Datapath,
        desired: &Desired,
        ifaces: &[iface::Interface],
        problems: &mut Vec<String>,
    ) -> Result<usize> {
        let ifindex = |n: &str| ifaces.iter().find(|i| i.name == n).map(|i| i.ifindex);
        let (mut want, unresolved) = MapState::from_desired(desired, ifindex);
        let left_out = want.fit_policy(self.cfg.capacities.policy);
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
        self.set_preflight(check);
        problems.extend(left_out);
        if self.cfg.unknown_pods == UnknownPods::Pass {
            want.forget_unknown_pods();
        }
        problems.extend(unresolved.iter().map(ToString::to_string));
        let st = dp.apply(&want)?;
        problems.extend(st.problems());
        Ok(st.changed())
    }
}
