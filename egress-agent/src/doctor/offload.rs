//! Open vSwitch hardware offload (`other_config:hw-offload`): with it on, Open vSwitch
//! puts the flows it has seen into the NIC (SR-IOV in switchdev mode, pods on VFs behind
//! representor ports), and their packets go between the pod's VF and the wire without
//! crossing the host's TC hooks: `from_pod` on the representor sees a flow's first packets
//! at most, and the rest leave by the CNI's path, not our gateways. The verdict is a pure
//! function of what OVSDB said; the reader is [`crate::iface::ovsdb::hw_offload`].

use std::path::Path;

use super::{Check, ok, warn};
use crate::iface::ovsdb;

const CHECK: &str = "hw-offload";

/// What this node's Open vSwitch says of hardware offload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// No OVSDB socket at the path: no Open vSwitch here (or not where `--ovsdb` says).
    NoOvsdb,
    /// `other_config:hw-offload`; `None` when unset (off).
    Setting(Option<String>),
    /// OVSDB did not answer, and why.
    Unreadable(String),
}

/// Ask the OVSDB at `socket` (nothing when there is no socket).
pub async fn probe(socket: &Path) -> Found {
    if !socket.exists() {
        return Found::NoOvsdb;
    }
    match ovsdb::hw_offload(socket).await {
        Ok(setting) => Found::Setting(setting),
        Err(e) => Found::Unreadable(e),
    }
}

/// The `hw-offload` line for what [`probe`] found at `socket`. Open vSwitch reads only
/// `"true"` as on (`smap_get_bool`); anything else is off.
pub fn verdict(socket: &Path, found: &Found) -> Check {
    let socket = socket.display();
    match found {
        Found::NoOvsdb => ok(
            CHECK,
            format!(
                "no OVSDB at {socket} (--ovsdb): no Open vSwitch here to offload flows to the \
                 NIC (a DPU that runs the switch on its own cores is not visible from the host)"
            ),
        ),
        Found::Setting(Some(v)) if v == "true" => warn(
            CHECK,
            "Open vSwitch hardware offload is on (other_config:hw-offload=\"true\"): flows it \
             offloads to the NIC go between a pod's VF and the wire without crossing the \
             host's TC hooks, so from_pod sees their first packets at most and the rest leave \
             by the CNI's path, not the egress gateways; keep pods that policies select on \
             interfaces that are not offloaded (veths), or turn offload off on this node \
             (ovs-vsctl set Open_vSwitch . other_config:hw-offload=false, then restart Open \
             vSwitch; on OpenShift, the SR-IOV operator's OVS hardware offload configuration) \
             (docs/operations.md, \"Hardware offload\")"
                .to_owned(),
        ),
        Found::Setting(v) => ok(
            CHECK,
            match v {
                None => "Open vSwitch hardware offload is off (other_config:hw-offload unset)"
                    .to_owned(),
                Some(v) => {
                    format!("Open vSwitch hardware offload is off (other_config:hw-offload={v:?})")
                }
            },
        ),
        Found::Unreadable(e) => warn(
            CHECK,
            format!(
                "failed to read Open vSwitch's other_config:hw-offload: {e}; with it on, \
                 offloaded flows skip the datapath: check by hand with ovs-vsctl get \
                 Open_vSwitch . other_config:hw-offload"
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Level;

    fn judged(found: Found) -> Check {
        verdict(Path::new("/var/run/openvswitch/db.sock"), &found)
    }

    #[test]
    fn offload_on_warns_that_the_datapath_is_skipped() {
        let c = judged(Found::Setting(Some("true".into())));
        assert_eq!((c.result, c.check.as_str()), (Level::Warn, "hw-offload"));
        for says in [
            "hardware offload is on",
            "without crossing the host's TC hooks",
            "ovs-vsctl set Open_vSwitch . other_config:hw-offload=false",
        ] {
            assert!(c.message.contains(says), "{says:?} in {}", c.message);
        }
    }

    #[test]
    fn offload_off_unset_or_not_true_is_ok() {
        for (setting, says) in [
            (None, "off (other_config:hw-offload unset)"),
            (Some("false"), "off (other_config:hw-offload=\"false\")"),
            (Some("yes"), "off (other_config:hw-offload=\"yes\")"),
        ] {
            let c = judged(Found::Setting(setting.map(str::to_owned)));
            assert_eq!(c.result, Level::Ok, "{setting:?}");
            assert!(c.message.contains(says), "{}", c.message);
        }
    }

    #[test]
    fn no_open_vswitch_is_ok_and_an_unanswered_query_warns() {
        let c = judged(Found::NoOvsdb);
        assert_eq!(c.result, Level::Ok);
        assert!(
            c.message
                .contains("no OVSDB at /var/run/openvswitch/db.sock (--ovsdb)")
        );
        let c = judged(Found::Unreadable("connection refused".into()));
        assert_eq!(c.result, Level::Warn);
        assert!(c.message.contains("connection refused"), "{}", c.message);
        assert!(
            c.message.contains("ovs-vsctl get Open_vSwitch"),
            "{}",
            c.message
        );
    }

    #[tokio::test]
    async fn a_missing_socket_is_no_open_vswitch() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        assert_eq!(probe(&dir.path().join("db.sock")).await, Found::NoOvsdb);
    }
}
