//! The lab: a small cluster made of network namespaces, shared by `cargo xtask lab`, the
//! integration tests and the benchmarks.
//!
//! ```text
//!                        underlay 10.200.0.0/24 (bridge in <p>-ul)
//!   w1 .11      w2 .12      gw1 .21             gw2 .22            rtr .1
//!   |  pods     |  pods     |  pods  sec-a sec-b |  sec-a sec-b      |  net-c 192.168.103.1
//!   10.244.11/24 10.244.12/24 10.244.21/24 |  |  |  |    |           |
//!                                A 192.168.101.0/24 (.11 gw1, .12 gw2, host-a .100)
//!                                B 192.168.102.0/24 (.11 gw1, .12 gw2, host-b .100, rtr-b .1)
//!                                                   C 192.168.103.0/24 (host-c .100)
//!                                                               |
//!                                                              rtr-b
//!                                              D 192.168.104.0/24 (rtr-b .1, host-d .100)
//!                                              E 192.168.105.0/24 (rtr-b .1, host-e .100)
//! ```
//!
//! * Every node, pod, host and network is a namespace named `<prefix>-<member>`; links live
//!   only inside those namespaces, so the host's own namespace is never touched.
//! * [`LabSpec::cni`] says how pods and the underlay are wired ([`Cni`]): by default
//!   ([`Cni::Routed`]) pods are routed the way Calico does it: `10.244.<node octet>.<n>/32` on `eth0`, default
//!   route via 169.254.1.1, proxy ARP on the node's `cali-<pod>` veth, a /32 route per pod on
//!   the node, and every other node and the router reach `10.244.<octet>.0/24` via that
//!   node's underlay address. [`Cni::Bridge`] puts pods on a bridge `cni0` without host
//!   routes and the node's address on a bridge over its NIC; [`Cni::Ovs`] wires nodes as
//!   OVN-Kubernetes does (`br-int`, `br-ex`, `ovn-k8s-mp0`, VLAN secondary networks).
//! * Networks A and B are reached only by the gateways (`sec-a`, `sec-b`); their hosts know
//!   only their own subnet. Network C hangs off the router, the nodes' default gateway, and is
//!   reachable from everywhere without us.
//! * Networks D and E sit behind `rtr-b`, a router on network B that only the gateways
//!   reach; their hosts' default route is rtr-b. The gateways route D via rtr-b on `sec-b`
//!   from the start ([`gateway_static_routes`]); nobody routes E until a test or the demo
//!   adds a route ([`Lab::add_gateway_route`]): what `destinationsFrom: Routes` learns.
//! * `egress-echo serve` runs on every host at [`addr::ECHO_PORT`] (TCP and UDP).
//! * The YAML state directory holds Namespaces, Nodes, Pods (`cluster.yaml`) and a sample
//!   EgressGatewayPolicy (`policy.yaml`, rewritable with [`Lab::write_policy`]).
//! * [`LabSpec::family`] `V6` or `Dual` adds IPv6 everywhere: underlay `fd00:200::/64`
//!   (router `::1`, nodes `::<octet>`), networks
//!   `fd00:10{1,2,3,4,5}::/64` (gateways `::11`/`::12`, hosts `::100`, router `fd00:103::1`,
//!   rtr-b `fd00:10{2,4,5}::1`),
//!   pods `fd00:244:<node octet>::<n>/128` with a default route via `fe80::1` (an address of
//!   the node's `cali-<pod>` veth), other nodes' `fd00:244:<octet>::/64` via the underlay.
//!   Pods of `V6` have no IPv4 address; those of `Dual` have both, and `status.podIPs` lists
//!   what they have. IPv6 addresses go without DAD (`accept_dad=0`, `nodad`).
//! * [`LabSpec::underlay`] says which of a node's addresses its Node lists first as
//!   InternalIP, and so which family the tunnel between nodes runs on (IPv6 needs `V6` or
//!   `Dual`; [`LabSpec::with_family`] picks IPv6 for `V6`, IPv4 otherwise).
//!
//! The code is split by job: `plan` (what the lab is made of: nodes, networks, routes,
//! pods, the spec), `build` (bringing it up), `names` (names and addresses), `probe`
//! (queries through the lab), `state` (the YAML state directory), `faults` (links,
//! partitions, the gateways' routes), `agents`, `teardown` and `yaml` (the emitter).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    process::Output,
    str::FromStr,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use crate::netns::{self, DirGuard, KILL_GRACE, Netns, NsChild};

pub mod addr;
pub mod addr6;
mod agents;
mod build;
mod check;
mod faults;
mod isolation;
mod names;
mod ovn;
mod plan;
mod probe;
mod state;
mod teardown;
mod yaml;

pub use self::{isolation::*, plan::*, probe::*, state::*};
use self::{ovn::ovn_mac, yaml::to_yaml_doc};

/// A running lab. Dropping it tears everything down (also while panicking); [`Lab::leak`]
/// keeps it up.
#[derive(Debug)]
pub struct Lab {
    prefix: String,
    dir: PathBuf,
    spec: LabSpec,
    pods: Vec<Pod>,
    /// Member name (`ul`, `rtr`, `net-a`, `host-a`, `w1`, `w1-p1`, ...) -> namespace.
    netns: BTreeMap<String, Netns>,
    servers: Vec<NsChild>,
    agents: BTreeMap<String, NsChild>,
    pin_dirs: BTreeMap<String, DirGuard>,
    ready: BTreeMap<String, bool>,
    /// Nodes annotated [`DRAIN_ANNOTATION`].
    drained: std::collections::BTreeSet<String>,
    /// Pods whose Pod object is left out of `cluster.yaml` ([`Lab::set_pod_announced`]).
    unannounced: std::collections::BTreeSet<String>,
    /// Pod CIDRs a Node lists after its own ([`Lab::add_pod_cidr`]).
    extra_pod_cidrs: BTreeMap<String, Vec<String>>,
    /// Addresses a cloud provider read off a node's NICs, listed first in its Node's
    /// `status.addresses` ([`Lab::cloud_reports_nic_addresses`]).
    cloud_addresses: BTreeMap<String, Vec<IpAddr>>,
    leaked: bool,
}

#[cfg(test)]
mod tests {
    use super::{build::assign_pod_ips, yaml::plain_ok, *};

    #[test]
    fn yaml_of_nested_values() {
        let y = to_yaml_doc(&json!({
            "a": {"egress.dev/gateway": "true", "num": 3},
            "list": [{"type": "Ready", "status": "True"}, "x"],
            "empty": [],
        }));
        assert_eq!(
            y,
            "---\na:\n  egress.dev/gateway: \"true\"\n  num: 3\nempty: []\nlist:\n  - status: \"True\"\n    type: Ready\n  - x\n"
        );
    }

    #[test]
    fn plain_scalars_only_where_yaml_keeps_them_strings() {
        for s in [
            "v1",
            "Pod",
            "10.200.0.11",
            "192.168.101.0/24",
            "egress.dev/v1alpha1",
            "w1-p1",
        ] {
            assert!(plain_ok(s), "{s}");
        }
        for s in [
            "True",
            "true",
            "yes",
            "On",
            "1",
            "1.5",
            "1_000",
            "0x1f",
            "1e3",
            "2024-01-02",
            "",
            "a b",
            "-x",
            "~",
        ] {
            assert!(!plain_ok(s), "{s}");
        }
    }

    #[test]
    fn seen_parses() {
        let s: Seen = "seen 10.244.11.11:40000\n".parse().unwrap();
        assert_eq!(s.ip, IpAddr::V4(addr::W1_P1));
        assert_eq!(s.port, 40000);
    }

    #[test]
    fn default_pod_ips_are_fixed_and_free_ones_assigned() {
        let mut specs = LabSpec::default_pods();
        specs.push(PodSpec::new("w1-p3", PAYMENTS, "w1", &[]));
        let mut spec = LabSpec::new("egress-echo");
        spec.pods = specs;
        let pods = assign_pod_ips(&spec).unwrap();
        assert_eq!(pods[0].ip, addr::W1_P1);
        assert_eq!(pods[5].ip, Ipv4Addr::new(10, 244, 11, 13));
        assert_eq!(pods[5].veth, "cali-w1-p3");
    }
}
