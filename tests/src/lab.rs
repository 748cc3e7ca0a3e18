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

/// Every address of the lab, by name.
pub mod addr {
    use std::net::Ipv4Addr;

    pub const UNDERLAY: &str = "10.200.0.0/24";
    pub const ROUTER: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 1);
    pub const W1: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 11);
    pub const W2: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 12);
    pub const GW1: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 21);
    pub const GW2: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 22);

    pub const NET_A: &str = "192.168.101.0/24";
    pub const NET_B: &str = "192.168.102.0/24";
    pub const NET_C: &str = "192.168.103.0/24";
    /// Behind rtr-b: D is routed by the gateways from the start, E by nobody.
    pub const NET_D: &str = "192.168.104.0/24";
    pub const NET_E: &str = "192.168.105.0/24";
    pub const GW1_SEC_A: Ipv4Addr = Ipv4Addr::new(192, 168, 101, 11);
    pub const GW2_SEC_A: Ipv4Addr = Ipv4Addr::new(192, 168, 101, 12);
    pub const GW1_SEC_B: Ipv4Addr = Ipv4Addr::new(192, 168, 102, 11);
    pub const GW2_SEC_B: Ipv4Addr = Ipv4Addr::new(192, 168, 102, 12);
    pub const ROUTER_NET_C: Ipv4Addr = Ipv4Addr::new(192, 168, 103, 1);
    /// rtr-b, the router on network B in front of D and E, and its legs on D and E.
    pub const RTR_B: Ipv4Addr = Ipv4Addr::new(192, 168, 102, 1);
    pub const RTR_B_NET_D: Ipv4Addr = Ipv4Addr::new(192, 168, 104, 1);
    pub const RTR_B_NET_E: Ipv4Addr = Ipv4Addr::new(192, 168, 105, 1);
    pub const HOST_A: Ipv4Addr = Ipv4Addr::new(192, 168, 101, 100);
    pub const HOST_B: Ipv4Addr = Ipv4Addr::new(192, 168, 102, 100);
    pub const HOST_C: Ipv4Addr = Ipv4Addr::new(192, 168, 103, 100);
    pub const HOST_D: Ipv4Addr = Ipv4Addr::new(192, 168, 104, 100);
    pub const HOST_E: Ipv4Addr = Ipv4Addr::new(192, 168, 105, 100);
    /// The address of an OVN-Kubernetes EgressIP on the primary network
    /// ([`super::Lab::add_ovn_egress_ip`]).
    pub const OVN_EGRESS_IP: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 100);
    /// Egress IPs of the sample policy.
    pub const EGRESS_IP_A: Ipv4Addr = Ipv4Addr::new(192, 168, 101, 50);
    pub const EGRESS_IP_B: Ipv4Addr = Ipv4Addr::new(192, 168, 102, 50);

    /// The pods' default gateway (answered by proxy ARP on the node's veth).
    pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
    /// `egress-echo serve` listens here, TCP and UDP, on every host.
    pub const ECHO_PORT: u16 = 7777;

    pub const W1_P1: Ipv4Addr = Ipv4Addr::new(10, 244, 11, 11);
    pub const W1_P2: Ipv4Addr = Ipv4Addr::new(10, 244, 11, 12);
    pub const W2_P1: Ipv4Addr = Ipv4Addr::new(10, 244, 12, 11);
    pub const W2_P2: Ipv4Addr = Ipv4Addr::new(10, 244, 12, 12);
    pub const GW1_P1: Ipv4Addr = Ipv4Addr::new(10, 244, 21, 11);
}

/// The IPv6 addresses of the lab (family `V6` or `Dual`), by name.
pub mod addr6 {
    use std::net::Ipv6Addr;

    const fn a(s: [u16; 8]) -> Ipv6Addr {
        Ipv6Addr::new(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7])
    }

    pub const UNDERLAY: &str = "fd00:200::/64";
    pub const ROUTER: Ipv6Addr = a([0xfd00, 0x200, 0, 0, 0, 0, 0, 0x1]);
    pub const NET_A: &str = "fd00:101::/64";
    pub const NET_B: &str = "fd00:102::/64";
    pub const NET_C: &str = "fd00:103::/64";
    pub const NET_D: &str = "fd00:104::/64";
    pub const NET_E: &str = "fd00:105::/64";
    pub const GW1_SEC_A: Ipv6Addr = a([0xfd00, 0x101, 0, 0, 0, 0, 0, 0x11]);
    pub const GW2_SEC_A: Ipv6Addr = a([0xfd00, 0x101, 0, 0, 0, 0, 0, 0x12]);
    pub const GW1_SEC_B: Ipv6Addr = a([0xfd00, 0x102, 0, 0, 0, 0, 0, 0x11]);
    pub const GW2_SEC_B: Ipv6Addr = a([0xfd00, 0x102, 0, 0, 0, 0, 0, 0x12]);
    pub const ROUTER_NET_C: Ipv6Addr = a([0xfd00, 0x103, 0, 0, 0, 0, 0, 0x1]);
    pub const RTR_B: Ipv6Addr = a([0xfd00, 0x102, 0, 0, 0, 0, 0, 0x1]);
    pub const RTR_B_NET_D: Ipv6Addr = a([0xfd00, 0x104, 0, 0, 0, 0, 0, 0x1]);
    pub const RTR_B_NET_E: Ipv6Addr = a([0xfd00, 0x105, 0, 0, 0, 0, 0, 0x1]);
    pub const HOST_A: Ipv6Addr = a([0xfd00, 0x101, 0, 0, 0, 0, 0, 0x100]);
    pub const HOST_B: Ipv6Addr = a([0xfd00, 0x102, 0, 0, 0, 0, 0, 0x100]);
    pub const HOST_C: Ipv6Addr = a([0xfd00, 0x103, 0, 0, 0, 0, 0, 0x100]);
    pub const HOST_D: Ipv6Addr = a([0xfd00, 0x104, 0, 0, 0, 0, 0, 0x100]);
    pub const HOST_E: Ipv6Addr = a([0xfd00, 0x105, 0, 0, 0, 0, 0, 0x100]);
    /// The sample policy's IPv6 egress IPs.
    pub const EGRESS_IP_A: Ipv6Addr = a([0xfd00, 0x101, 0, 0, 0, 0, 0, 0x50]);
    pub const EGRESS_IP_B: Ipv6Addr = a([0xfd00, 0x102, 0, 0, 0, 0, 0, 0x50]);
    /// Pods' default gateway: a link-local address of every node-side pod veth.
    pub const POD_GATEWAY: Ipv6Addr = a([0xfe80, 0, 0, 0, 0, 0, 0, 0x1]);
}

/// Address families of the lab's pods (the infrastructure is dual stack unless `V4`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Family {
    /// IPv4 only: the lab as it always was.
    #[default]
    V4,
    /// IPv6-only pods (the tunnel stays on the IPv4 underlay).
    V6,
    /// Dual-stack pods: one address of each family.
    Dual,
}

impl Family {
    pub fn has_v4(self) -> bool {
        self != Self::V6
    }

    pub fn has_v6(self) -> bool {
        self != Self::V4
    }
}

/// Name of the policy file in the state directory.
pub const POLICY_FILE: &str = "policy.yaml";
/// Name of the Namespaces/Nodes/Pods file in the state directory.
pub const CLUSTER_FILE: &str = "cluster.yaml";
/// Kubernetes namespace of the selected pods.
pub const PAYMENTS: &str = "payments";
/// Label that marks gateway nodes, matched by the sample policy's `gatewaySelector`.
pub const GATEWAY_LABEL: &str = "egress.dev/gateway";
/// Node annotation (`"true"`) of a drained node: no longer eligible to hold egress IPs.
pub const DRAIN_ANNOTATION: &str = "egress.dev/drain";
/// Where OVN-Kubernetes keeps a Node's subnets ([`Cni::Ovs`]).
pub const OVN_NODE_SUBNETS: &str = "k8s.ovn.org/node-subnets";
/// nftables table (bridge family, in the underlay namespace) of [`Lab::partition_underlay`].
const PARTITION_TABLE: &str = "lab_partition";

/// A node of the lab.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub name: &'static str,
    /// Underlay (InternalIP) address.
    pub ip: Ipv4Addr,
    pub gateway: bool,
}

impl Node {
    /// `10.244.<last octet of the underlay address>.0/24`.
    pub fn pod_cidr(&self) -> String {
        format!("10.244.{}.0/24", self.ip.octets()[3])
    }

    /// `fd00:244:<last octet of the underlay address>::/64`.
    pub fn pod_cidr_v6(&self) -> String {
        format!("fd00:244:{}::/64", self.ip.octets()[3])
    }

    /// Underlay IPv6 address (families `V6`, `Dual`): `fd00:200::<last octet>`.
    pub fn ip6(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, hex_like(self.ip.octets()[3]))
    }

    /// `ip` commands that configure the node's underlay once its NIC `eth0` exists (and,
    /// for [`Cni::Bridge`] and [`Cni::Ovs`], the bridge that holds the address): addresses,
    /// up, default route, other nodes' pod ranges. Idempotent (`replace`), so they also
    /// restore what the kernel drops when the link goes down (its static routes, its IPv6
    /// addresses).
    fn underlay_config(&self, v6: bool, cni: Cni) -> Vec<String> {
        let dev = cni.underlay_device();
        let mut cmds = match cni {
            Cni::Routed => vec![],
            Cni::Bridge => vec!["link set eth0 master br-ul".to_owned()],
            Cni::Ovs => vec![],
        };
        cmds.push("link set eth0 up".to_owned());
        if cni != Cni::Routed {
            cmds.push(format!("link set {dev} up"));
        }
        cmds.extend([
            format!("addr replace {}/24 dev {dev}", self.ip),
            format!("route replace default via {}", addr::ROUTER),
        ]);
        for other in NODES.iter().filter(|o| o.name != self.name) {
            cmds.push(format!(
                "route replace {} via {}",
                other.pod_cidr(),
                other.ip
            ));
        }
        if v6 {
            cmds.push(format!("addr replace {}/64 dev {dev} nodad", self.ip6()));
            cmds.push(format!("route replace ::/0 via {}", addr6::ROUTER));
            for other in NODES.iter().filter(|o| o.name != self.name) {
                cmds.push(format!(
                    "route replace {} via {}",
                    other.pod_cidr_v6(),
                    other.ip6()
                ));
            }
        }
        cmds
    }

    /// The pod subnet's gateway: `10.244.<octet>.1` ([`Cni::Bridge`], [`Cni::Ovs`]).
    pub fn pod_gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 244, self.ip.octets()[3], 1)
    }

    /// The IPv6 pod subnet's gateway: `fd00:244:<octet>::1`.
    pub fn pod_gateway_v6(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x244, hex_like(self.ip.octets()[3]), 0, 0, 0, 0, 1)
    }
}

/// A gateway's own addresses on secondary network `id` (`a` or `b`): `sec-<id>` has them.
fn secondary_addrs(gw: &str, id: char) -> Result<(Ipv4Addr, Ipv6Addr)> {
    Ok(match (gw, id) {
        ("gw1", 'a') => (addr::GW1_SEC_A, addr6::GW1_SEC_A),
        ("gw1", 'b') => (addr::GW1_SEC_B, addr6::GW1_SEC_B),
        ("gw2", 'a') => (addr::GW2_SEC_A, addr6::GW2_SEC_A),
        ("gw2", 'b') => (addr::GW2_SEC_B, addr6::GW2_SEC_B),
        _ => bail!("{gw} has no link sec-{id} (gateways gw1 and gw2 have sec-a and sec-b)"),
    })
}

/// `11` -> `0x11`: IPv6 addresses that read like their IPv4 counterparts.
const fn hex_like(n: u8) -> u16 {
    let n = n as u16;
    (n / 100) * 0x100 + ((n / 10) % 10) * 0x10 + n % 10
}

/// The four nodes: two workers, two gateways.
pub const NODES: [Node; 4] = [
    Node {
        name: "w1",
        ip: addr::W1,
        gateway: false,
    },
    Node {
        name: "w2",
        ip: addr::W2,
        gateway: false,
    },
    Node {
        name: "gw1",
        ip: addr::GW1,
        gateway: true,
    },
    Node {
        name: "gw2",
        ip: addr::GW2,
        gateway: true,
    },
];

/// An external network: a bridge in its own namespace with one host running egress-echo.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Network {
    /// `a` to `e`: the namespace is `<prefix>-net-<id>`, the host `host-<id>`.
    pub id: char,
    pub cidr: &'static str,
    pub host: Ipv4Addr,
    /// IPv6 subnet and host address (families `V6`, `Dual`).
    pub cidr_v6: &'static str,
    pub host_v6: Ipv6Addr,
    /// The router the host's default route points to (C: `rtr`; D, E: `rtr-b`), or `None`
    /// for A and B, whose hosts know only their own subnet.
    pub router: Option<Router>,
}

/// A router's leg on a network: its member name and addresses there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Router {
    /// `rtr` or `rtr-b`; the leg is the router's link `net-<id>`.
    pub member: &'static str,
    pub ip: Ipv4Addr,
    pub ip6: Ipv6Addr,
}

pub const NETWORKS: [Network; 5] = [
    Network {
        id: 'a',
        cidr: addr::NET_A,
        host: addr::HOST_A,
        cidr_v6: addr6::NET_A,
        host_v6: addr6::HOST_A,
        router: None,
    },
    Network {
        id: 'b',
        cidr: addr::NET_B,
        host: addr::HOST_B,
        cidr_v6: addr6::NET_B,
        host_v6: addr6::HOST_B,
        router: None,
    },
    Network {
        id: 'c',
        cidr: addr::NET_C,
        host: addr::HOST_C,
        cidr_v6: addr6::NET_C,
        host_v6: addr6::HOST_C,
        router: Some(Router {
            member: "rtr",
            ip: addr::ROUTER_NET_C,
            ip6: addr6::ROUTER_NET_C,
        }),
    },
    Network {
        id: 'd',
        cidr: addr::NET_D,
        host: addr::HOST_D,
        cidr_v6: addr6::NET_D,
        host_v6: addr6::HOST_D,
        router: Some(Router {
            member: "rtr-b",
            ip: addr::RTR_B_NET_D,
            ip6: addr6::RTR_B_NET_D,
        }),
    },
    Network {
        id: 'e',
        cidr: addr::NET_E,
        host: addr::HOST_E,
        cidr_v6: addr6::NET_E,
        host_v6: addr6::HOST_E,
        router: Some(Router {
            member: "rtr-b",
            ip: addr::RTR_B_NET_E,
            ip6: addr6::RTR_B_NET_E,
        }),
    },
];

/// A static route on a gateway: `<prefix> via <via> dev <dev>`, of one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatewayRoute {
    pub prefix: &'static str,
    pub via: IpAddr,
    pub dev: &'static str,
}

impl GatewayRoute {
    /// Network D via rtr-b on `sec-b` (IPv6: `fd00:104::/64` via `fd00:102::1`).
    pub fn net_d(v6: bool) -> Self {
        Self::behind_rtr_b(v6, addr::NET_D, addr6::NET_D)
    }

    /// Network E via rtr-b on `sec-b` (IPv6: `fd00:105::/64` via `fd00:102::1`): the route
    /// no gateway has until a test adds it.
    pub fn net_e(v6: bool) -> Self {
        Self::behind_rtr_b(v6, addr::NET_E, addr6::NET_E)
    }

    fn behind_rtr_b(v6: bool, prefix: &'static str, prefix6: &'static str) -> Self {
        let (prefix, via) = if v6 {
            (prefix6, IpAddr::V6(addr6::RTR_B))
        } else {
            (prefix, IpAddr::V4(addr::RTR_B))
        };
        Self {
            prefix,
            via,
            dev: "sec-b",
        }
    }
}

impl fmt::Display for GatewayRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} via {} dev {}", self.prefix, self.via, self.dev)
    }
}

/// The static routes a gateway gets at lab setup: network D via rtr-b on `sec-b`, in each
/// family the lab has. Restored with the link by [`Lab::set_secondary_link`].
pub fn gateway_static_routes(v6: bool) -> Vec<GatewayRoute> {
    let mut out = vec![GatewayRoute::net_d(false)];
    if v6 {
        out.push(GatewayRoute::net_d(true));
    }
    out
}

/// A pod to create: a namespace with a veth into its node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodSpec {
    /// Pod name, also the lab member name; at most 10 characters (the node-side veth is
    /// `cali-<name>`, and interface names have at most 15).
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    pub node: String,
    pub labels: BTreeMap<String, String>,
    /// `None`: the next free `10.244.<node octet>.<11..>`.
    pub ip: Option<Ipv4Addr>,
    /// Its namespace exists from the start, but its veth and routes only once the test
    /// calls [`Lab::wire_pod`] (a pod the CNI sets up after the agents started).
    pub wired_later: bool,
}

impl PodSpec {
    pub fn new(name: &str, namespace: &str, node: &str, labels: &[(&str, &str)]) -> Self {
        Self {
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            node: node.to_owned(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ip: None,
            wired_later: false,
        }
    }
}

/// A created pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pod {
    pub name: String,
    pub namespace: String,
    pub node: String,
    pub labels: BTreeMap<String, String>,
    pub ip: Ipv4Addr,
    /// Name of the node-side veth.
    pub veth: String,
    /// `fd00:244:<node octet>::<last octet of ip>` (families `V6`, `Dual`, else `None`).
    /// With `V6`, `ip` is only the pod's number: the pod has no IPv4 address.
    pub ipv6: Option<Ipv6Addr>,
}

impl Pod {
    /// The addresses the pod has, IPv4 first (its `status.podIPs`).
    pub fn addresses(&self, family: Family) -> Vec<IpAddr> {
        let mut out = Vec::new();
        if family.has_v4() {
            out.push(IpAddr::V4(self.ip));
        }
        out.extend(self.ipv6.map(IpAddr::V6));
        out
    }
}

/// What to build.
#[derive(Clone, Debug)]
pub struct LabSpec {
    /// The `egress-echo` binary (tests: `env!("CARGO_BIN_EXE_egress-echo")`).
    pub echo_bin: PathBuf,
    /// Pods; [`LabSpec::default_pods`] by default.
    pub pods: Vec<PodSpec>,
    /// Kubernetes namespaces and their labels; `payments` (team=payments) and `other`.
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    /// Fixed prefix instead of `eg<pid%1000><n>` (fails if namespaces with it exist).
    pub prefix: Option<String>,
    /// Write the sample policy to `policy.yaml` (else no policy file).
    pub sample_policy: bool,
    /// `RUST_LOG` for the agents.
    pub agent_log: String,
    /// Pod address families (IPv4 by default).
    pub family: Family,
    /// Family of the underlay, the tunnel between nodes (IPv4 by default).
    pub underlay: Underlay,
    /// How pods and the underlay are wired ([`Cni::Routed`] by default).
    pub cni: Cni,
}

/// Family of the lab's underlay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Underlay {
    #[default]
    V4,
    V6,
}

impl fmt::Display for Underlay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        })
    }
}

/// How the lab wires pods and the nodes' underlay (`cargo xtask lab --cni`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Cni {
    /// Like Calico: a /32 (/128) host route per pod on its `cali-<pod>` veth, proxy ARP,
    /// the underlay address on the node's NIC `eth0`.
    #[default]
    Routed,
    /// Like Flannel or the bridge plugin: pods' `veth-<pod>` enslaved to the node's
    /// bridge `cni0`, which holds the pod subnet's gateway (`10.244.<octet>.1/24`), no
    /// per-pod routes; the underlay address on a bridge `br-ul` over the NIC.
    Bridge,
    /// Like OVN-Kubernetes (Open vSwitch, inside the VM guest): pods' veths are ports of
    /// `br-int` with `external_ids:iface-id=<namespace>_<pod>`, the pod subnet's gateway
    /// on the management port `ovn-k8s-mp0`, the node's address on `br-ex` (the NIC its
    /// port), the secondary networks as 802.1Q VLANs off the NIC (`sec-a` VLAN 101,
    /// `sec-b` VLAN 102). One `ovsdb-server` and `ovs-vswitchd` per node namespace. The
    /// agents of w1 and gw1 run `--pod-devices ovs`, those of w2 and gw2 `auto`.
    Ovs,
}

impl Cni {
    /// The device that holds the node's underlay address.
    pub fn underlay_device(self) -> &'static str {
        match self {
            Self::Routed => "eth0",
            Self::Bridge => "br-ul",
            Self::Ovs => "br-ex",
        }
    }

    /// The host side of a pod's veth.
    fn veth(self, pod: &str) -> String {
        match self {
            Self::Routed => format!("cali-{pod}"),
            Self::Bridge | Self::Ovs => format!("veth-{pod}"),
        }
    }
}

impl fmt::Display for Cni {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Routed => "routed",
            Self::Bridge => "bridge",
            Self::Ovs => "ovs",
        })
    }
}

impl FromStr for Cni {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "routed" => Ok(Self::Routed),
            "bridge" => Ok(Self::Bridge),
            "ovs" => Ok(Self::Ovs),
            other => bail!("--cni {other:?}: expected routed, bridge or ovs"),
        }
    }
}

/// VLAN ids of the secondary networks A and B under [`Cni::Ovs`].
pub fn secondary_vlan(id: char) -> u16 {
    100 + u16::from(id as u8 - b'a' + 1)
}

impl LabSpec {
    pub fn new(echo_bin: impl Into<PathBuf>) -> Self {
        Self {
            echo_bin: echo_bin.into(),
            pods: Self::default_pods(),
            namespaces: [
                (PAYMENTS, vec![("team", "payments")]),
                ("other", vec![("team", "other")]),
            ]
            .into_iter()
            .map(|(ns, labels)| {
                (
                    ns.to_owned(),
                    labels
                        .into_iter()
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .collect(),
                )
            })
            .collect(),
            prefix: None,
            sample_policy: true,
            agent_log: "info".to_owned(),
            family: Family::V4,
            underlay: Underlay::V4,
            cni: Cni::Routed,
        }
    }

    /// Pods of `family`, on the underlay such a cluster has: IPv6 for IPv6-only pods,
    /// IPv4 for IPv4 and dual-stack ones (their primary family).
    pub fn with_family(mut self, family: Family) -> Self {
        self.family = family;
        self.underlay = if family == Family::V6 {
            Underlay::V6
        } else {
            Underlay::V4
        };
        self
    }

    /// `w1-p1` app=api (payments), `w1-p2` app=web (payments, unselected), `w2-p1` app=api
    /// (payments), `w2-p2` app=api in namespace `other` (unselected: wrong namespace),
    /// `gw1-p1` app=api (payments) on a gateway.
    pub fn default_pods() -> Vec<PodSpec> {
        let mut pods = vec![
            PodSpec::new("w1-p1", PAYMENTS, "w1", &[("app", "api")]),
            PodSpec::new("w1-p2", PAYMENTS, "w1", &[("app", "web")]),
            PodSpec::new("w2-p1", PAYMENTS, "w2", &[("app", "api")]),
            PodSpec::new("w2-p2", "other", "w2", &[("app", "api")]),
            PodSpec::new("gw1-p1", PAYMENTS, "gw1", &[("app", "api")]),
        ];
        for (pod, ip) in pods.iter_mut().zip([
            addr::W1_P1,
            addr::W1_P2,
            addr::W2_P1,
            addr::W2_P2,
            addr::GW1_P1,
        ]) {
            pod.ip = Some(ip);
        }
        pods
    }
}

/// Find `egress-echo` when nobody says where it is: `$EGRESS_ECHO_BIN`, else next to the
/// running executable or one directory up (a test binary lives in `target/<profile>/deps`).
pub fn locate_echo_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("EGRESS_ECHO_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("failed to find the current executable")?;
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let candidate = d.join("egress-echo");
        if candidate.is_file() {
            return Ok(candidate);
        }
        dir = d.parent();
    }
    bail!(
        "failed to find egress-echo next to {}: build it (cargo build -p egress-tests --bins) \
         or set EGRESS_ECHO_BIN",
        exe.display()
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        })
    }
}

/// What a host reported: the source address and port it saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Seen {
    pub ip: IpAddr,
    pub port: u16,
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.ip, self.port)
    }
}

impl FromStr for Seen {
    type Err = anyhow::Error;

    /// Parses `seen 10.244.11.11:40000` (or without `seen `).
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        let s = s.strip_prefix("seen ").unwrap_or(s);
        let sa: std::net::SocketAddr = s
            .parse()
            .with_context(|| format!("failed to parse seen line {s:?}"))?;
        Ok(Self {
            ip: sa.ip(),
            port: sa.port(),
        })
    }
}

/// One `egress-echo query` with all its knobs.
#[derive(Clone, Debug)]
pub struct Query {
    pub proto: Proto,
    pub host: IpAddr,
    pub port: u16,
    /// Payload bytes each way.
    pub size: usize,
    pub timeout: Duration,
    pub sport: Option<u16>,
    /// UDP only: send up to this many times within `timeout`.
    pub attempts: u32,
}

impl Query {
    pub fn new(proto: Proto, host: impl Into<IpAddr>, port: u16) -> Self {
        Self {
            proto,
            host: host.into(),
            port,
            size: 0,
            timeout: Duration::from_millis(2000),
            sport: None,
            attempts: 1,
        }
    }

    pub fn size(mut self, size: usize) -> Self {
        self.size = size;
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn sport(mut self, sport: u16) -> Self {
        self.sport = Some(sport);
        self
    }

    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts;
        self
    }

    fn args(&self) -> Vec<String> {
        let mut args = vec![
            "query".to_owned(),
            self.proto.to_string(),
            std::net::SocketAddr::new(self.host, self.port).to_string(),
            "--size".to_owned(),
            self.size.to_string(),
            "--timeout-ms".to_owned(),
            self.timeout.as_millis().to_string(),
            "--attempts".to_owned(),
            self.attempts.to_string(),
        ];
        if let Some(p) = self.sport {
            args.extend(["--sport".to_owned(), p.to_string()]);
        }
        args
    }
}

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
    leaked: bool,
}

impl Lab {
    /// Build the whole lab: namespaces, links, routes, sysctls, echo servers, state dir.
    /// Everything built so far is removed if a step fails.
    pub fn up(spec: LabSpec) -> Result<Lab> {
        validate(&spec)?;
        if !spec.echo_bin.is_file() {
            bail!(
                "failed to start the lab: egress-echo not found at {}",
                spec.echo_bin.display()
            );
        }
        let (prefix, underlay) = reserve_prefix(spec.prefix.as_deref())?;
        netns::register_live(&prefix);
        let dir = std::env::temp_dir().join(format!("egress-lab-{prefix}"));
        let mut lab = Lab {
            prefix,
            dir,
            pods: Vec::new(),
            netns: BTreeMap::from([("ul".to_owned(), underlay)]),
            servers: Vec::new(),
            agents: BTreeMap::new(),
            pin_dirs: BTreeMap::new(),
            ready: NODES.iter().map(|n| (n.name.to_owned(), true)).collect(),
            drained: std::collections::BTreeSet::new(),
            unannounced: std::collections::BTreeSet::new(),
            extra_pod_cidrs: BTreeMap::new(),
            leaked: false,
            spec,
        };
        lab.build()
            .with_context(|| format!("failed to bring up lab {}", lab.prefix))?;
        Ok(lab)
    }

    fn build(&mut self) -> Result<()> {
        let _ = std::fs::remove_dir_all(&self.dir);
        std::fs::create_dir_all(self.state_dir())
            .with_context(|| format!("failed to create {}", self.state_dir().display()))?;
        self.pods = assign_pod_ips(&self.spec.pods, self.spec.family, self.spec.cni)?;
        let v6 = self.spec.family.has_v6();

        // Namespaces first, with rp_filter off before any interface exists (new namespaces
        // may inherit the host's rp_filter).
        let mut members = vec!["rtr".to_owned(), "rtr-b".to_owned()];
        members.extend(NODES.iter().map(|n| n.name.to_owned()));
        for net in NETWORKS {
            members.push(format!("net-{}", net.id));
            members.push(format!("host-{}", net.id));
        }
        members.extend(self.pods.iter().map(|p| p.name.clone()));
        for m in &members {
            let ns = Netns::add(&self.ns_name(m))?;
            self.netns.insert(m.clone(), ns);
        }
        for (m, ns) in &self.netns {
            let mut kv = vec![
                ("net.ipv4.conf.all.rp_filter", "0"),
                ("net.ipv4.conf.default.rp_filter", "0"),
            ];
            let router = m == "rtr" || m == "rtr-b" || NODES.iter().any(|n| n.name == m);
            if router {
                kv.push(("net.ipv4.ip_forward", "1"));
            }
            if v6 {
                kv.extend([
                    ("net.ipv6.conf.all.disable_ipv6", "0"),
                    ("net.ipv6.conf.default.disable_ipv6", "0"),
                    ("net.ipv6.conf.all.accept_dad", "0"),
                    ("net.ipv6.conf.default.accept_dad", "0"),
                ]);
                if router {
                    kv.push(("net.ipv6.conf.all.forwarding", "1"));
                }
            }
            ns.sysctls(&kv)?;
        }

        // Bridges: the underlay and one per external network.
        self.ns("ul")?
            .ip_batch(&["link add br0 type bridge", "link set br0 up"])?;
        for net in NETWORKS {
            self.ns(&format!("net-{}", net.id))?
                .ip_batch(&["link add br0 type bridge", "link set br0 up"])?;
        }

        // Underlay: every node and the router.
        let ul = self.ns_name("ul");
        let mut ul_ports = Vec::new();
        let cni = self.spec.cni;
        for node in &NODES {
            let mut cmds = vec![format!(
                "link add eth0 type veth peer name {} netns {ul}",
                node.name
            )];
            if cni == Cni::Bridge {
                cmds.extend([
                    "link add br-ul type bridge".to_owned(),
                    "link add cni0 type bridge".to_owned(),
                    format!("addr add {}/24 dev cni0", node.pod_gateway()),
                    "link set cni0 up".to_owned(),
                ]);
                if v6 {
                    cmds.push(format!(
                        "addr add {}/64 dev cni0 nodad",
                        node.pod_gateway_v6()
                    ));
                }
            }
            self.ns(node.name)?.ip_batch(&cmds)?;
            if cni == Cni::Ovs {
                self.start_ovs(node)?;
            }
            self.ns(node.name)?
                .ip_batch(&node.underlay_config(v6, cni))?;
            ul_ports.push(node.name.to_owned());
        }
        let mut rtr = vec![
            format!("link add eth0 type veth peer name rtr netns {ul}"),
            format!("addr add {}/24 dev eth0", addr::ROUTER),
            "link set eth0 up".to_owned(),
        ];
        for node in &NODES {
            rtr.push(format!("route add {} via {}", node.pod_cidr(), node.ip));
        }
        if v6 {
            rtr.push(format!("addr add {}/64 dev eth0 nodad", addr6::ROUTER));
            for node in &NODES {
                rtr.push(format!(
                    "route add {} via {}",
                    node.pod_cidr_v6(),
                    node.ip6()
                ));
            }
        }
        self.ns("rtr")?.ip_batch(&rtr)?;
        ul_ports.push("rtr".to_owned());
        let ul_cmds: Vec<String> = ul_ports
            .iter()
            .map(|p| format!("link set {p} master br0 up"))
            .collect();
        self.ns("ul")?.ip_batch(&ul_cmds)?;

        // rtr-b: a leg on network B (`eth0`), nothing on the underlay.
        let net_b = self.ns_name("net-b");
        let mut rtr_b = vec![
            format!("link add eth0 type veth peer name rtr-b netns {net_b}"),
            format!("addr add {}/24 dev eth0", addr::RTR_B),
            "link set eth0 up".to_owned(),
        ];
        if v6 {
            rtr_b.push(format!("addr add {}/64 dev eth0 nodad", addr6::RTR_B));
        }
        self.ns("rtr-b")?.ip_batch(&rtr_b)?;
        self.ns("net-b")?
            .ip_batch(&["link set rtr-b master br0 up"])?;

        // The routers' legs on the networks behind them: `net-<id>` (C on rtr; D, E on rtr-b).
        for net in NETWORKS {
            let Some(r) = net.router else { continue };
            let (id, member) = (net.id, r.member);
            let bridge_ns = self.ns_name(&format!("net-{id}"));
            let mut cmds = vec![
                format!("link add net-{id} type veth peer name {member} netns {bridge_ns}"),
                format!("addr add {}/24 dev net-{id}", r.ip),
                format!("link set net-{id} up"),
            ];
            if v6 {
                cmds.push(format!("addr add {}/64 dev net-{id} nodad", r.ip6));
            }
            self.ns(member)?.ip_batch(&cmds)?;
            self.ns(&format!("net-{id}"))?
                .ip_batch(&[format!("link set {member} master br0 up")])?;
        }

        // Secondary networks: only the gateways have a leg on them, and a route to D via rtr-b.
        // Under Cni::Ovs they are 802.1Q VLANs off the gateways' NIC, carried by the
        // underlay switch to a trunk port of each network's bridge.
        if cni == Cni::Ovs {
            for id in ['a', 'b'] {
                let vid = secondary_vlan(id);
                self.ns(&format!("net-{id}"))?.ip_batch(&[
                    format!("link add trunk type veth peer name trunk-{id} netns {ul}"),
                    "link set trunk up".to_owned(),
                    format!("link add link trunk name trunk.{vid} type vlan id {vid}"),
                    format!("link set trunk.{vid} master br0 up"),
                ])?;
                self.ns("ul")?
                    .ip_batch(&[format!("link set trunk-{id} master br0 up")])?;
            }
        }
        for gw in ["gw1", "gw2"] {
            let mut cmds = Vec::new();
            for id in ['a', 'b'] {
                let (ip, ip6) = secondary_addrs(gw, id)?;
                let bridge_ns = self.ns_name(&format!("net-{id}"));
                cmds.push(if cni == Cni::Ovs {
                    let vid = secondary_vlan(id);
                    format!("link add link eth0 name sec-{id} type vlan id {vid}")
                } else {
                    format!("link add sec-{id} type veth peer name {gw} netns {bridge_ns}")
                });
                cmds.extend([
                    format!("addr add {ip}/24 dev sec-{id}"),
                    format!("link set sec-{id} up"),
                ]);
                if v6 {
                    cmds.push(format!("addr add {ip6}/64 dev sec-{id} nodad"));
                }
            }
            self.ns(gw)?.ip_batch(&cmds)?;
            if cni != Cni::Ovs {
                for id in ['a', 'b'] {
                    self.ns(&format!("net-{id}"))?
                        .ip_batch(&[format!("link set {gw} master br0 up")])?;
                }
            }
            let routes: Vec<String> = gateway_static_routes(v6)
                .into_iter()
                .map(|r| format!("route add {r}"))
                .collect();
            self.ns(gw)?.ip_batch(&routes)?;
        }

        // Hosts: only their own subnet, except those behind a router (C, D, E), which answer
        // through it.
        for net in NETWORKS {
            let host = format!("host-{}", net.id);
            let bridge_ns = self.ns_name(&format!("net-{}", net.id));
            let mut cmds = vec![
                format!("link add eth0 type veth peer name {host} netns {bridge_ns}"),
                format!("addr add {}/24 dev eth0", net.host),
                "link set eth0 up".to_owned(),
            ];
            if let Some(r) = net.router {
                cmds.push(format!("route add default via {}", r.ip));
            }
            if v6 {
                cmds.push(format!("addr add {}/64 dev eth0 nodad", net.host_v6));
                if let Some(r) = net.router {
                    cmds.push(format!("route add ::/0 via {}", r.ip6));
                }
            }
            self.ns(&host)?.ip_batch(&cmds)?;
            self.ns(&format!("net-{}", net.id))?
                .ip_batch(&[format!("link set {host} master br0 up")])?;
        }

        // Pods, as `cni` wires them.
        let later: BTreeSet<String> = self
            .spec
            .pods
            .iter()
            .filter(|p| p.wired_later)
            .map(|p| p.name.clone())
            .collect();
        for pod in self.pods.clone() {
            if !later.contains(&pod.name) {
                self.wire(&pod)?;
            }
        }

        self.write_cluster()?;
        if self.spec.sample_policy {
            self.write_policy(&sample_policy_for(self.spec.family))?;
        }
        self.start_servers()
    }

    /// Where `node`'s agent serves the CNI plugin (`--cni-socket`).
    pub fn cni_socket(&self, node: &str) -> PathBuf {
        self.dir.join(format!("{node}-cni.sock"))
    }

    /// [`Lab::wire_pod`], then `plugin` (`egress-cni`) chained after it as a container
    /// runtime would run it: `CNI_COMMAND=ADD`, the pod's namespace and interface, the
    /// network configuration with the main plugin's result as `prevResult` on stdin; in
    /// the node's namespace, against its agent's socket. Returns the plugin's stdout once
    /// it exits 0 (the program is on the pod's device then).
    pub fn wire_pod_with_cni(&self, name: &str, plugin: &Path) -> Result<String> {
        use std::io::Write as _;
        self.wire_pod(name)?;
        let pod = self.pod(name)?.clone();
        let netns_path = self.ns(name)?.path().to_string_lossy().into_owned();
        let config = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "k8s-pod-network",
            "type": "egress-cni",
            "agentSocket": self.cni_socket(&pod.node),
            "timeoutMs": 5000,
            "prevResult": {
                "cniVersion": "1.0.0",
                "interfaces": [
                    {"name": pod.veth},
                    {"name": "eth0", "sandbox": netns_path.clone()},
                ],
                "ips": pod
                    .addresses(self.spec.family)
                    .iter()
                    .map(|a| {
                        let len = if a.is_ipv4() { 32 } else { 128 };
                        serde_json::json!({"address": format!("{a}/{len}"), "interface": 1})
                    })
                    .collect::<Vec<_>>(),
            },
        });
        let mut child = self
            .ns(&pod.node)?
            .command(plugin)?
            .env("CNI_COMMAND", "ADD")
            .env("CNI_CONTAINERID", format!("lab-{name}"))
            .env("CNI_NETNS", &netns_path)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", plugin.parent().unwrap_or(Path::new("/")))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .with_context(|| format!("failed to run {}", plugin.display()))?;
        child
            .stdin
            .take()
            .context("plugin stdin")?
            .write_all(config.to_string().as_bytes())?;
        let out = child.wait_with_output()?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        anyhow::ensure!(
            out.status.success(),
            "{} ADD for {name}: {}: {stdout} {}",
            plugin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(stdout)
    }

    /// Set up the network of a pod made with [`PodSpec::wired_later`], as a CNI's ADD
    /// would: its veth (the node side created in the node's namespace by the pod side's
    /// `ip link add ... netns`), addresses and routes. Returns when the node side is up
    /// and routed.
    pub fn wire_pod(&self, name: &str) -> Result<()> {
        let pod = self.pod(name)?.clone();
        self.wire(&pod)
    }

    fn wire(&self, pod: &Pod) -> Result<()> {
        match self.spec.cni {
            Cni::Routed => self.wire_routed(pod),
            Cni::Bridge | Cni::Ovs => self.wire_switched(pod),
        }
    }

    /// Calico's way: /32 on the pod, the node's veth answers for 169.254.1.1.
    fn wire_routed(&self, pod: &Pod) -> Result<()> {
        let v4 = self.spec.family.has_v4();
        let node_ns = self.ns_name(&pod.node);
        let mut cmds = vec![format!(
            "link add eth0 type veth peer name {} netns {node_ns}",
            pod.veth
        )];
        if v4 {
            cmds.push(format!("addr add {}/32 dev eth0", pod.ip));
        }
        if let Some(ip6) = pod.ipv6 {
            cmds.push(format!("addr add {ip6}/128 dev eth0 nodad"));
        }
        cmds.push("link set eth0 up".to_owned());
        if v4 {
            cmds.push(format!(
                "route add {} dev eth0 scope link",
                addr::POD_GATEWAY
            ));
            cmds.push(format!(
                "route add default via {} dev eth0",
                addr::POD_GATEWAY
            ));
        }
        if pod.ipv6.is_some() {
            cmds.push(format!(
                "route add ::/0 via {} dev eth0",
                addr6::POD_GATEWAY
            ));
        }
        self.ns(&pod.name)?.ip_batch(&cmds)?;
        let node = self.ns(&pod.node)?;
        node.sysctls(&[
            (&format!("net.ipv4.conf.{}.proxy_arp", pod.veth), "1"),
            (&format!("net.ipv4.neigh.{}.proxy_delay", pod.veth), "0"),
            (&format!("net.ipv4.conf.{}.rp_filter", pod.veth), "0"),
        ])?;
        let mut cmds = vec![format!("link set {} up", pod.veth)];
        if v4 {
            cmds.push(format!("route add {}/32 dev {}", pod.ip, pod.veth));
        }
        if let Some(ip6) = pod.ipv6 {
            cmds.push(format!(
                "addr add {}/64 dev {} nodad",
                addr6::POD_GATEWAY,
                pod.veth
            ));
            cmds.push(format!("route add {ip6}/128 dev {}", pod.veth));
        }
        node.ip_batch(&cmds)?;
        Ok(())
    }

    /// The bridge plugin's and OVN-Kubernetes' way: the pod in the node's subnet (/24,
    /// /64) with its gateway at `.1`, its veth a port of `cni0` or of `br-int` (with the
    /// `iface-id` OVN-Kubernetes sets), no route per pod on the node.
    fn wire_switched(&self, pod: &Pod) -> Result<()> {
        let v4 = self.spec.family.has_v4();
        let node = self.node(&pod.node)?;
        let node_ns = self.ns_name(&pod.node);
        let mut cmds = vec![format!(
            "link add eth0 type veth peer name {} netns {node_ns}",
            pod.veth
        )];
        if v4 {
            cmds.push(format!("addr add {}/24 dev eth0", pod.ip));
        }
        if let Some(ip6) = pod.ipv6 {
            cmds.push(format!("addr add {ip6}/64 dev eth0 nodad"));
        }
        cmds.push("link set eth0 up".to_owned());
        if v4 {
            cmds.push(format!("route add default via {}", node.pod_gateway()));
        }
        if pod.ipv6.is_some() {
            cmds.push(format!("route add ::/0 via {}", node.pod_gateway_v6()));
        }
        self.ns(&pod.name)?.ip_batch(&cmds)?;
        if self.spec.cni == Cni::Ovs {
            let ips: Vec<String> = pod
                .addresses(self.spec.family)
                .iter()
                .map(|a| match a {
                    IpAddr::V4(a) => format!("{a}/24"),
                    IpAddr::V6(a) => format!("{a}/64"),
                })
                .collect();
            self.ovs_vsctl(
                &pod.node,
                &[
                    "add-port",
                    "br-int",
                    &pod.veth,
                    "--",
                    "set",
                    "interface",
                    &pod.veth,
                    &format!("external_ids:iface-id={}_{}", pod.namespace, pod.name),
                    &format!("external_ids:ip_addresses={}", ips.join(",")),
                ],
            )?;
            self.ns(&pod.node)?
                .ip_batch(&[format!("link set {} up", pod.veth)])?;
        } else {
            self.ns(&pod.node)?
                .ip_batch(&[format!("link set {} master cni0 up", pod.veth)])?;
        }
        Ok(())
    }

    /// Where `node`'s Open vSwitch keeps its database, socket, pid and log files
    /// ([`Cni::Ovs`]).
    pub fn ovs_dir(&self, node: &str) -> PathBuf {
        self.dir.join(format!("{node}-ovs"))
    }

    /// `node`'s OVSDB socket ([`Cni::Ovs`]): the agent's `--ovsdb`.
    pub fn ovsdb_socket(&self, node: &str) -> PathBuf {
        self.ovs_dir(node).join("db.sock")
    }

    /// Run an Open vSwitch command in `node`'s namespace against its own daemons.
    fn ovs_command(&self, node: &str, program: &str, args: &[&str]) -> Result<Output> {
        let dir = self.ovs_dir(node);
        let mut cmd = self.ns(node)?.command(program)?;
        cmd.args(args)
            .env("OVS_RUNDIR", &dir)
            .env("OVS_LOGDIR", &dir)
            .env("OVS_DBDIR", &dir)
            .env("OVS_SYSCONFDIR", &dir);
        netns::run_checked(&mut cmd).with_context(|| format!("{program} on {node}"))
    }

    /// `ovs-vsctl` against `node`'s OVSDB.
    pub fn ovs_vsctl(&self, node: &str, args: &[&str]) -> Result<Output> {
        self.ovs_command(node, "ovs-vsctl", &[&["--timeout=30"], args].concat())
    }

    /// Start `node`'s own `ovsdb-server` and `ovs-vswitchd` in its namespace (no systemd:
    /// Debian's packages, started by hand), then wire it as OVN-Kubernetes leaves a node:
    /// `br-int` with the management port `ovn-k8s-mp0` (the pod subnet's gateway), and
    /// `br-ex` with the NIC `eth0` as its port (the node's address goes on `br-ex`).
    fn start_ovs(&self, node: &Node) -> Result<()> {
        let dir = self.ovs_dir(node.name);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("failed to create {}", dir.display()))?;
        let db = dir.join("conf.db");
        let db = db.to_string_lossy();
        let schema = "/usr/share/openvswitch/vswitch.ovsschema";
        anyhow::ensure!(
            Path::new(schema).is_file(),
            "{schema} is missing: --cni ovs needs Debian's openvswitch-switch (cargo xtask vm \
             installs it)"
        );
        self.ovs_command(node.name, "ovsdb-tool", &["create", &db, schema])?;
        let sock = self.ovsdb_socket(node.name);
        let remote = format!("--remote=punix:{}", sock.display());
        self.ovs_command(
            node.name,
            "ovsdb-server",
            &[
                &db,
                &remote,
                "--pidfile",
                "--detach",
                "--no-chdir",
                "--log-file",
            ],
        )?;
        self.ovs_vsctl(node.name, &["--no-wait", "init"])?;
        let db_remote = format!("unix:{}", sock.display());
        self.ovs_command(
            node.name,
            "ovs-vswitchd",
            &[
                &db_remote,
                "--pidfile",
                "--detach",
                "--no-chdir",
                "--log-file",
            ],
        )?;
        let mp0_id = format!("external_ids:iface-id=k8s-{}", node.name);
        // br-ex takes the NIC's MAC, as OVN-Kubernetes sets it: left to itself, OVS moves
        // the bridge's MAC to its lowest port's when it gets to it, after neighbours may
        // have learnt the first one.
        // (`/sys/class/net` is the host's here: a namespace entered with setns keeps
        // its mount namespace.)
        let mac_of = |dev: &str| -> Result<String> {
            let out = self.exec(node.name, "ip", &["-br", "link", "show", "dev", dev])?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.split_whitespace()
                .nth(2)
                .map(str::to_owned)
                .with_context(|| format!("{}: no MAC of {dev} in {text:?}", node.name))
        };
        let eth0_mac = mac_of("eth0")?;
        let hwaddr = format!("other-config:hwaddr=\"{eth0_mac}\"");
        self.ovs_vsctl(
            node.name,
            &[
                "add-br",
                "br-int",
                "--",
                "add-br",
                "br-ex",
                "--",
                "set",
                "bridge",
                "br-ex",
                &hwaddr,
                "--",
                "add-port",
                "br-ex",
                "eth0",
                "--",
                "add-port",
                "br-int",
                "ovn-k8s-mp0",
                "--",
                "set",
                "interface",
                "ovn-k8s-mp0",
                "type=internal",
                &mp0_id,
            ],
        )?;
        // ovs-vsctl returns once ovs-vswitchd has applied it.
        let br_ex_mac = mac_of("br-ex")?;
        anyhow::ensure!(
            br_ex_mac == eth0_mac,
            "{}: br-ex has MAC {br_ex_mac}, not the NIC's {eth0_mac}",
            node.name
        );
        let mut cmds = vec![
            format!("addr add {}/24 dev ovn-k8s-mp0", node.pod_gateway()),
            "link set br-int up".to_owned(),
            "link set ovn-k8s-mp0 up".to_owned(),
        ];
        if self.spec.family.has_v6() {
            cmds.push(format!(
                "addr add {}/64 dev ovn-k8s-mp0 nodad",
                node.pod_gateway_v6()
            ));
        }
        self.ns(node.name)?.ip_batch(&cmds)
    }

    fn start_servers(&mut self) -> Result<()> {
        let port = addr::ECHO_PORT.to_string();
        // One server on 0.0.0.0 and, with IPv6, one on the host's IPv6 address (a socket on
        // [::] would also take IPv4 and report it as ::ffff:a.b.c.d).
        let mut logs = Vec::new();
        for net in NETWORKS {
            let host = format!("host-{}", net.id);
            let log = self.dir.join(format!("{host}.log"));
            let child = self.ns(&host)?.spawn(
                &self.spec.echo_bin,
                &["serve", "--tcp", &port, "--udp", &port],
                &log,
            )?;
            self.servers.push(child);
            logs.push((net.id, log));
            if self.spec.family.has_v6() {
                let log = self.dir.join(format!("{host}-v6.log"));
                let bind = net.host_v6.to_string();
                let child = self.ns(&host)?.spawn(
                    &self.spec.echo_bin,
                    &["serve", "--bind", &bind, "--tcp", &port, "--udp", &port],
                    &log,
                )?;
                self.servers.push(child);
                logs.push((net.id, log));
            }
        }
        // Each server prints one "ready" line once both sockets are bound.
        let deadline = Instant::now() + Duration::from_secs(5);
        for (i, (id, log)) in logs.iter().enumerate() {
            loop {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                if text.lines().any(|l| l.starts_with("ready ")) {
                    break;
                }
                if let Some(server) = self.servers.get_mut(i)
                    && let Some(status) = server.try_wait()?
                {
                    bail!("egress-echo on host-{id} exited ({status}): {text}");
                }
                if Instant::now() > deadline {
                    bail!("egress-echo on host-{id} not ready after 5 s: {text}");
                }
                thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------
    // names and addresses

    /// The lab's unique prefix, e.g. `eg4270`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The pods' address families.
    pub fn family(&self) -> Family {
        self.spec.family
    }

    /// What the lab was built from.
    pub fn spec(&self) -> &LabSpec {
        &self.spec
    }

    /// The namespace name of a member: `<prefix>-<member>`.
    pub fn ns_name(&self, member: &str) -> String {
        format!("{}-{member}", self.prefix)
    }

    /// The namespace of a member: a node (`w1`, `w2`, `gw1`, `gw2`), a pod (`w1-p1`, ...),
    /// a host (`host-a` to `host-e`), a network bridge (`net-a`, ...), a router (`rtr`,
    /// `rtr-b`) or the underlay bridge (`ul`).
    pub fn ns(&self, member: &str) -> Result<&Netns> {
        self.netns.get(member).with_context(|| {
            format!(
                "lab {} has no member {member:?} (members: {:?})",
                self.prefix,
                self.netns.keys().collect::<Vec<_>>()
            )
        })
    }

    /// Every member name.
    pub fn members(&self) -> impl Iterator<Item = &str> {
        self.netns.keys().map(String::as_str)
    }

    /// The lab's temp directory (logs, state dir).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The YAML state directory the agents read.
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    pub fn nodes(&self) -> &'static [Node] {
        &NODES
    }

    pub fn node(&self, name: &str) -> Result<&'static Node> {
        NODES
            .iter()
            .find(|n| n.name == name)
            .with_context(|| format!("lab has no node {name:?}"))
    }

    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }

    pub fn pod(&self, name: &str) -> Result<&Pod> {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .with_context(|| format!("lab has no pod {name:?}"))
    }

    /// The bpffs pin directory of a node's agent: `/sys/fs/bpf/<prefix>-<node>`.
    pub fn bpffs_dir(&self, node: &str) -> PathBuf {
        Path::new("/sys/fs/bpf").join(self.ns_name(node))
    }

    /// The log file of a node's agent.
    pub fn agent_log_path(&self, node: &str) -> PathBuf {
        self.dir.join(format!("agent-{node}.log"))
    }

    pub fn agent_log(&self, node: &str) -> String {
        std::fs::read_to_string(self.agent_log_path(node)).unwrap_or_default()
    }

    // -----------------------------------------------------------------------------------
    // traffic

    /// `egress-echo query` from a member's namespace (usually a pod) to `host:port`, with
    /// `size` payload bytes each way and a 2 s timeout.
    pub fn query(
        &self,
        from: &str,
        proto: Proto,
        host: impl Into<IpAddr>,
        port: u16,
        size: usize,
    ) -> Result<Seen> {
        self.query_with(from, &Query::new(proto, host, port).size(size))
    }

    pub fn query_with(&self, from: &str, q: &Query) -> Result<Seen> {
        let out = self
            .ns(from)?
            .exec_unchecked(&self.spec.echo_bin.to_string_lossy(), &q.args())?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "query {} {}:{} from {from} failed: {}",
                q.proto,
                q.host,
                q.port,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let line = stdout
            .lines()
            .find(|l| l.starts_with("seen "))
            .with_context(|| format!("query from {from}: no seen line in {stdout:?}"))?;
        line.parse()
    }

    /// Run a command in a member's namespace, checked.
    pub fn exec(&self, member: &str, program: &str, args: &[&str]) -> Result<Output> {
        self.ns(member)?.exec(program, args)
    }

    // -----------------------------------------------------------------------------------
    // state directory

    /// Replace `policy.yaml` (atomically: write, then rename).
    pub fn write_policy(&self, yaml: &str) -> Result<()> {
        self.write_state_file(POLICY_FILE, yaml)
    }

    /// Write any file of the state directory atomically.
    pub fn write_state_file(&self, name: &str, contents: &str) -> Result<()> {
        let dir = self.state_dir();
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, contents)
            .with_context(|| format!("failed to write {}", tmp.display()))?;
        std::fs::rename(&tmp, dir.join(name))
            .with_context(|| format!("failed to rename {} to {name}", tmp.display()))
    }

    pub fn remove_state_file(&self, name: &str) -> Result<()> {
        let path = self.state_dir().join(name);
        std::fs::remove_file(&path).with_context(|| format!("failed to remove {}", path.display()))
    }

    /// Set a node's Ready condition in `cluster.yaml`.
    pub fn set_node_ready(&mut self, node: &str, ready: bool) -> Result<()> {
        self.node(node)?;
        self.ready.insert(node.to_owned(), ready);
        self.write_cluster()
    }

    /// Drain a node (annotation `egress.dev/drain: "true"` on its Node in `cluster.yaml`)
    /// or undrain it (no annotation). A drained node may not hold egress IPs.
    pub fn set_node_drain(&mut self, node: &str, drain: bool) -> Result<()> {
        self.node(node)?;
        if drain {
            self.drained.insert(node.to_owned());
        } else {
            self.drained.remove(node);
        }
        self.write_cluster()
    }

    /// List `cidr` after the node's own pod CIDR in its Node's `spec.podCIDRs` in
    /// `cluster.yaml` (Kubernetes allows one per family; the agents read them all). Only
    /// the Node changes: the caller routes what it puts there.
    pub fn add_pod_cidr(&mut self, node: &str, cidr: &str) -> Result<()> {
        self.node(node)?;
        self.extra_pod_cidrs
            .entry(node.to_owned())
            .or_default()
            .push(cidr.to_owned());
        self.write_cluster()
    }

    /// Leave a pod's Pod object out of `cluster.yaml` (`false`: its network is there, as
    /// after the CNI ran, but no agent has heard of it) or put it back (`true`).
    pub fn set_pod_announced(&mut self, pod: &str, announced: bool) -> Result<()> {
        self.pod(pod)?;
        if announced {
            self.unannounced.remove(pod);
        } else {
            self.unannounced.insert(pod.to_owned());
        }
        self.write_cluster()
    }

    /// Give the primary network's router (`rtr`, every node's default gateway) a leg on
    /// network `id` (`a` or `b`) at `.1`: a path to that network that does not go through
    /// a gateway, as a user's routed primary network may have. Packets that leave a node
    /// untranslated then reach the network's host with their own source address.
    pub fn connect_router_to(&self, id: char) -> Result<()> {
        let net = NETWORKS
            .iter()
            .find(|n| n.id == id && n.router.is_none())
            .with_context(|| format!("network {id:?} is not a gateway-only network"))?;
        let o = net.host.octets();
        let ip = Ipv4Addr::new(o[0], o[1], o[2], 1);
        let bridge_ns = self.ns_name(&format!("net-{id}"));
        self.ns("rtr")?.ip_batch(&[
            format!("link add net-{id} type veth peer name rtr netns {bridge_ns}"),
            format!("addr add {ip}/24 dev net-{id}"),
            format!("link set net-{id} up"),
        ])?;
        self.ns(&format!("net-{id}"))?
            .ip_batch(&["link set rtr master br0 up"])
    }

    /// A Node's `status.addresses`: InternalIPs, the underlay's family first (the agents
    /// tunnel to the first one), then the hostname.
    fn node_addresses(&self, node: &Node) -> Value {
        let v4 = json!({"type": "InternalIP", "address": node.ip.to_string()});
        let v6 = json!({"type": "InternalIP", "address": node.ip6().to_string()});
        let mut out = match (self.spec.underlay, self.spec.family) {
            (Underlay::V4, Family::V4) => vec![v4],
            (Underlay::V4, _) => vec![v4, v6],
            (Underlay::V6, _) => vec![v6, v4],
        };
        out.push(json!({"type": "Hostname", "address": node.name}));
        Value::Array(out)
    }

    /// The Namespace, Node and Pod documents, as written to `cluster.yaml`.
    pub fn cluster_yaml(&self) -> String {
        let mut docs = Vec::new();
        for (name, labels) in &self.spec.namespaces {
            let mut labels = labels.clone();
            labels.insert("kubernetes.io/metadata.name".to_owned(), name.clone());
            docs.push(json!({
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": name, "labels": labels},
            }));
        }
        for node in &NODES {
            let mut labels = BTreeMap::from([
                ("kubernetes.io/hostname".to_owned(), node.name.to_owned()),
                ("kubernetes.io/os".to_owned(), "linux".to_owned()),
            ]);
            if node.gateway {
                labels.insert(GATEWAY_LABEL.to_owned(), "true".to_owned());
            }
            let ready = self.ready.get(node.name).copied().unwrap_or(true);
            let mut metadata = json!({"name": node.name, "labels": labels});
            let mut pod_cidrs = vec![node.pod_cidr()];
            pod_cidrs.extend(
                self.extra_pod_cidrs
                    .get(node.name)
                    .into_iter()
                    .flatten()
                    .cloned(),
            );
            let mut annotations = serde_json::Map::new();
            if self.drained.contains(node.name) {
                annotations.insert(DRAIN_ANNOTATION.to_owned(), json!("true"));
            }
            // OVN-Kubernetes leaves spec.podCIDRs empty: the node's subnets are in an
            // annotation.
            let mut spec = json!({"podCIDR": node.pod_cidr(), "podCIDRs": pod_cidrs});
            if self.spec.cni == Cni::Ovs {
                let mut subnets = pod_cidrs.clone();
                if self.spec.family.has_v6() {
                    subnets.push(node.pod_cidr_v6());
                }
                annotations.insert(
                    OVN_NODE_SUBNETS.to_owned(),
                    json!(json!({"default": subnets}).to_string()),
                );
                spec = json!({});
            }
            if !annotations.is_empty() {
                metadata["annotations"] = Value::Object(annotations);
            }
            docs.push(json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": metadata,
                "spec": spec,
                "status": {
                    "addresses": self.node_addresses(node),
                    "conditions": [{
                        "type": "Ready",
                        "status": if ready { "True" } else { "False" },
                        "reason": if ready { "KubeletReady" } else { "LabNotReady" },
                    }],
                },
            }));
        }
        for pod in self
            .pods
            .iter()
            .filter(|p| !self.unannounced.contains(&p.name))
        {
            let host_ip = NODES
                .iter()
                .find(|n| n.name == pod.node)
                .map(|n| n.ip.to_string())
                .unwrap_or_default();
            let pod_ips: Vec<String> = pod
                .addresses(self.spec.family)
                .iter()
                .map(ToString::to_string)
                .collect();
            docs.push(json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod.name, "namespace": pod.namespace, "labels": pod.labels},
                "spec": {
                    "nodeName": pod.node,
                    "containers": [{"name": "app", "image": "egress-echo"}],
                },
                "status": {
                    "phase": "Running",
                    "hostIP": host_ip,
                    "podIP": pod_ips.first().cloned().unwrap_or_default(),
                    "podIPs": pod_ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>(),
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }));
        }
        docs.iter().map(to_yaml_doc).collect()
    }

    fn write_cluster(&self) -> Result<()> {
        self.write_state_file(CLUSTER_FILE, &self.cluster_yaml())
    }

    // -----------------------------------------------------------------------------------
    // failures: links and partitions

    /// Take a node's underlay link (`eth0` in its namespace) down, or bring it back up with
    /// its addresses and routes (the kernel drops static routes, and IPv6 addresses, of a
    /// link that goes down). Down, the node reaches no other node, and nothing reaches it.
    pub fn set_underlay_link(&self, node: &str, up: bool) -> Result<()> {
        let n = self.node(node)?;
        if up {
            self.ns(node)?
                .ip_batch(&n.underlay_config(self.spec.family.has_v6(), self.spec.cni))
        } else {
            self.ns(node)?.ip_batch(&["link set eth0 down"])
        }
    }

    /// Take a gateway's link to a secondary network (`sec-a`, `sec-b`) down, or bring it
    /// back up with the gateway's own addresses on it and the lab's static routes out of it
    /// ([`gateway_static_routes`]); egress IPs are the agent's to add, and routes added with
    /// [`Lab::add_gateway_route`] are gone with the link.
    pub fn set_secondary_link(&self, gw: &str, link: &str, up: bool) -> Result<()> {
        let id = match link {
            "sec-a" => 'a',
            "sec-b" => 'b',
            other => bail!("{other:?} is not a secondary link (sec-a, sec-b)"),
        };
        let (ip, ip6) = secondary_addrs(gw, id)?;
        let mut cmds = vec![format!(
            "link set {link} {}",
            if up { "up" } else { "down" }
        )];
        if up {
            cmds.push(format!("addr replace {ip}/24 dev {link}"));
            if self.spec.family.has_v6() {
                cmds.push(format!("addr replace {ip6}/64 dev {link} nodad"));
            }
            cmds.extend(
                gateway_static_routes(self.spec.family.has_v6())
                    .into_iter()
                    .filter(|r| r.dev == link)
                    .map(|r| format!("route replace {r}")),
            );
        }
        self.ns(gw)?.ip_batch(&cmds)
    }

    // -----------------------------------------------------------------------------------
    // gateways' routes

    /// `ip route add <route>` in a gateway's namespace: a route that `destinationsFrom:
    /// Routes` learns (e.g. [`GatewayRoute::net_e`]).
    pub fn add_gateway_route(&self, node: &str, route: &GatewayRoute) -> Result<()> {
        self.gateway_route(node, "add", route)
    }

    /// `ip route del <route>` in a gateway's namespace.
    pub fn del_gateway_route(&self, node: &str, route: &GatewayRoute) -> Result<()> {
        self.gateway_route(node, "del", route)
    }

    fn gateway_route(&self, node: &str, verb: &str, route: &GatewayRoute) -> Result<()> {
        let family = if route.via.is_ipv6() { "-6" } else { "-4" };
        let args = format!("{family} route {verb} {route}");
        self.exec(node, "ip", &args.split_whitespace().collect::<Vec<_>>())
            .with_context(|| format!("failed to {verb} route {route} on {node}"))
            .map(drop)
    }

    /// Nodes `a` and `b` can no longer reach each other over the underlay: no IP packet of
    /// either family passes between them, as behind a filtering router; ARP and neighbour
    /// discovery still do (else their neighbour entries would fail and keep failing for
    /// seconds after the repair). Every other pair is untouched. The underlay bridge
    /// filters what it forwards between their ports (nftables, bridge family, in the `ul`
    /// namespace): nothing changes inside the nodes themselves.
    pub fn partition_underlay(&self, a: &str, b: &str) -> Result<()> {
        self.node(a)?;
        self.node(b)?;
        let rules: String = [(a, b), (b, a)]
            .iter()
            .map(|(from, to)| {
                let ports = format!("iifname {from} oifname {to}");
                format!(
                    "    {ports} ether type arp accept
    {ports} icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} accept
    {ports} drop
"
                )
            })
            .collect();
        let script = format!(
            "table bridge {PARTITION_TABLE} {{
  chain forward {{
    type filter hook forward priority 0; policy accept;
{rules}  }}
}}
"
        );
        let path = self.dir.join(format!("partition-{a}-{b}.nft"));
        std::fs::write(&path, script)
            .with_context(|| format!("failed to write {}", path.display()))?;
        self.exec("ul", "nft", &["-f", &path.to_string_lossy()])
            .map(drop)
    }

    /// What OVN-Kubernetes' EgressIP does on a node for `pods` leaving by the primary
    /// network, in local gateway mode (pod egress routed by the host): `ip` on the node's
    /// underlay device (where OVN's gateway router would answer for it) and SNAT of the
    /// pods' packets leaving by it to `ip` (nftables, table `ovnk_egressip`); and the
    /// `k8s.ovn.org/v1` EgressIP object in the state directory (`ovn-egressip.yaml`),
    /// which the agents read. OVN itself is not run.
    pub fn add_ovn_egress_ip(&self, node: &str, pods: &[&str], ip: Ipv4Addr) -> Result<()> {
        let dev = self.spec.cni.underlay_device();
        let sources: Vec<String> = pods
            .iter()
            .map(|p| Ok(self.pod(p)?.ip.to_string()))
            .collect::<Result<_>>()?;
        self.ns(node)?
            .ip_batch(&[format!("addr add {ip}/32 dev {dev}")])?;
        let script = format!(
            "table ip ovnk_egressip {{
  chain post {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr {{ {} }} oifname \"{dev}\" snat to {ip}
  }}
}}
",
            sources.join(", ")
        );
        let path = self.dir.join(format!("ovn-egressip-{node}.nft"));
        std::fs::write(&path, script)
            .with_context(|| format!("failed to write {}", path.display()))?;
        self.exec(node, "nft", &["-f", &path.to_string_lossy()])?;
        let selected: Vec<&Pod> = pods.iter().map(|p| self.pod(p)).collect::<Result<_>>()?;
        let object = json!({
            "apiVersion": "k8s.ovn.org/v1",
            "kind": "EgressIP",
            "metadata": {"name": "lab-ovn"},
            "spec": {
                "egressIPs": [ip.to_string()],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": selected[0].namespace}},
                "podSelector": {"matchLabels": selected[0].labels},
            },
        });
        self.write_state_file("ovn-egressip.yaml", &to_yaml_doc(&object))
    }

    /// Remove every partition of [`Lab::partition_underlay`].
    pub fn heal_underlay(&self) -> Result<()> {
        let out = self.ns("ul")?.exec_unchecked("nft", &["list", "tables"])?;
        if String::from_utf8_lossy(&out.stdout).contains(PARTITION_TABLE) {
            self.exec("ul", "nft", &["delete", "table", "bridge", PARTITION_TABLE])?;
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------
    // agents

    /// Start one `egress-agent run` per node (see [`Lab::start_agent`]).
    pub fn start_agents(&mut self, agent_bin: &Path) -> Result<()> {
        for node in &NODES {
            self.start_agent(node.name, agent_bin, &[])?;
        }
        Ok(())
    }

    /// Start `<agent_bin> run --node-name N --state-dir <dir> --bpffs-dir
    /// /sys/fs/bpf/<prefix>-N [extra...]` in node N's namespace, output to
    /// [`Lab::agent_log_path`]. Mounts bpffs at /sys/fs/bpf if needed. The pin directory
    /// survives [`Lab::stop_agent`] (a restarted agent adopts it) and goes with the lab.
    pub fn start_agent(&mut self, node: &str, agent_bin: &Path, extra: &[&str]) -> Result<()> {
        self.node(node)?;
        if self.agents.contains_key(node) {
            bail!("failed to start the agent on {node}: it is running");
        }
        netns::ensure_bpffs()?;
        let pin = self.bpffs_dir(node);
        self.pin_dirs
            .entry(node.to_owned())
            .or_insert_with(|| DirGuard::adopt(&pin));
        let state = self.state_dir();
        let mut args = vec![
            "run".to_owned(),
            "--node-name".to_owned(),
            node.to_owned(),
            "--state-dir".to_owned(),
            state.to_string_lossy().into_owned(),
            "--bpffs-dir".to_owned(),
            pin.to_string_lossy().into_owned(),
            "--cni-socket".to_owned(),
            self.cni_socket(node).to_string_lossy().into_owned(),
        ];
        if self.spec.cni == Cni::Ovs {
            // w1 and gw1 find pods by OVN-Kubernetes' naming of their ports; w2 and gw2 as
            // the DaemonSet does by default (auto: the veth's peer first).
            let mode = if matches!(node, "w1" | "gw1") {
                "ovs"
            } else {
                "auto"
            };
            args.extend([
                "--pod-devices".to_owned(),
                mode.to_owned(),
                "--ovsdb".to_owned(),
                self.ovsdb_socket(node).to_string_lossy().into_owned(),
            ]);
        }
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let log = self.agent_log_path(node);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("failed to open {}", log.display()))?;
        let err = out.try_clone()?;
        let mut cmd = self.ns(node)?.command(agent_bin)?;
        cmd.args(&args)
            .env("RUST_LOG", &self.spec.agent_log)
            .stdout(out)
            .stderr(err);
        let child = NsChild::spawn(cmd, &self.ns_name(node))?;
        self.agents.insert(node.to_owned(), child);
        Ok(())
    }

    /// SIGTERM one node's agent (SIGKILL after a grace period); its pins stay.
    pub fn stop_agent(&mut self, node: &str) -> Result<()> {
        let mut child = self
            .agents
            .remove(node)
            .with_context(|| format!("no agent running on {node}"))?;
        child.terminate(KILL_GRACE);
        Ok(())
    }

    /// SIGKILL one node's agent (a crash: no cleanup on its side, and no SIGTERM first,
    /// which would let it say goodbye to its peers).
    pub fn kill_agent(&mut self, node: &str) -> Result<()> {
        let mut child = self
            .agents
            .remove(node)
            .with_context(|| format!("no agent running on {node}"))?;
        child.kill();
        Ok(())
    }

    /// SIGTERM every agent at once, SIGKILL those still running after [`KILL_GRACE`].
    pub fn stop_agents(&mut self) {
        let mut agents = std::mem::take(&mut self.agents);
        agents.values_mut().for_each(NsChild::signal_term);
        let deadline = Instant::now() + KILL_GRACE;
        for (_, mut child) in agents {
            child.terminate(deadline.saturating_duration_since(Instant::now()));
        }
    }

    /// Whether this lab started an agent on `node` that it has not stopped or killed (it
    /// may have exited since: [`Lab::exited_agents`]).
    pub fn agent_running(&self, node: &str) -> bool {
        self.agents.contains_key(node)
    }

    /// The process id of the agent this lab started on `node` (see [`Lab::agent_running`]).
    pub fn agent_pid(&self, node: &str) -> Option<u32> {
        self.agents.get(node).and_then(NsChild::id)
    }

    /// Nodes whose agent process has exited, with the exit status.
    pub fn exited_agents(&mut self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (node, child) in &mut self.agents {
            match child.try_wait() {
                Ok(Some(status)) => out.push((node.clone(), status.to_string())),
                Ok(None) => {}
                Err(e) => out.push((node.clone(), format!("{e:#}"))),
            }
        }
        out
    }

    /// Shell commands for a human exploring a kept lab.
    pub fn how_to(&self) -> String {
        let p = &self.prefix;
        let echo = self.spec.echo_bin.display();
        format!(
            "lab {p}: namespaces {p}-<member> (nodes w1 w2 gw1 gw2, pods {pods}, hosts host-a \
             to host-e, routers rtr and rtr-b)
  shell in a pod:      ip netns exec {p}-w1-p1 bash
  shell on a node (sees /sys/fs/bpf): nsenter --net=/run/netns/{p}-gw1 bash
  traffic:             ip netns exec {p}-w1-p1 {echo} query tcp {a}:{port} --size 1400
  agent maps:          <egress-agent> maps --bpffs-dir /sys/fs/bpf/{p}-gw1
  raw maps:            bpftool map dump pinned /sys/fs/bpf/{p}-gw1/<map>
  logs and state dir:  {dir}
  tear down:           Lab::teardown_by_prefix(\"{p}\") (cargo xtask lab --down {p})
",
            pods = self
                .pods
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>()
                .join(" "),
            a = addr::HOST_A,
            port = addr::ECHO_PORT,
            dir = self.dir.display(),
        )
    }

    // -----------------------------------------------------------------------------------
    // teardown

    /// Leave the lab up (namespaces, servers, agents, pins, temp dir); returns the prefix
    /// for [`Lab::teardown_by_prefix`].
    pub fn leak(mut self) -> String {
        self.leaked = true;
        for (_, ns) in std::mem::take(&mut self.netns) {
            ns.leak();
        }
        for child in std::mem::take(&mut self.servers) {
            child.leak();
        }
        for (_, child) in std::mem::take(&mut self.agents) {
            child.leak();
        }
        for (_, dir) in std::mem::take(&mut self.pin_dirs) {
            dir.leak();
        }
        netns::unregister_live(&self.prefix);
        self.prefix.clone()
    }

    /// Remove a kept lab (or the remains of a crashed one): processes in its namespaces,
    /// the namespaces, `/sys/fs/bpf/<prefix>-*` and its temp directory.
    pub fn teardown_by_prefix(prefix: &str) -> Result<()> {
        netns::teardown_prefix(prefix)
    }

    /// Tear down now and report what could not be removed.
    pub fn down(mut self) -> Result<()> {
        self.teardown(false);
        let left = netns::netns_with_prefix(&self.prefix)?;
        if !left.is_empty() {
            bail!("failed to tear down lab {}: left {left:?}", self.prefix);
        }
        Ok(())
    }

    fn teardown(&mut self, keep_dir: bool) {
        self.stop_agents();
        for mut s in std::mem::take(&mut self.servers) {
            s.terminate(Duration::from_millis(500));
        }
        // Kill everything first, then delete: deleting the underlay also removes the
        // peers of veths in other namespaces.
        let namespaces = std::mem::take(&mut self.netns);
        for ns in namespaces.values() {
            netns::kill_netns_pids(ns.name());
        }
        drop(namespaces);
        // Sweep anything with our prefix that a guard did not own.
        if let Ok(left) = netns::netns_with_prefix(&self.prefix) {
            for ns in left {
                netns::delete_netns(&ns);
            }
        }
        // The agents' locks on their pin directories (the agents are gone).
        for pin_dir in self.pin_dirs.values() {
            let lock = egress_agent::datapath::lock::lock_path(
                Path::new(egress_agent::datapath::lock::LOCK_DIR),
                pin_dir.path(),
            );
            let _ = std::fs::remove_file(lock);
        }
        self.pin_dirs.clear();
        if !keep_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        netns::unregister_live(&self.prefix);
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.leaked {
            return;
        }
        let panicking = thread::panicking();
        self.teardown(panicking);
        if panicking {
            eprintln!(
                "lab {}: torn down; logs and state kept in {}",
                self.prefix,
                self.dir.display()
            );
        }
    }
}

/// The sample policy: pods app=api in namespaces team=payments, gateways
/// egress.dev/gateway=true; A listed, via 192.168.101.50; whatever the holder of
/// 192.168.102.50 routes out of `sec-b` (B itself, D behind rtr-b) via 192.168.102.50.
pub fn sample_policy() -> String {
    sample_policy_for(Family::V4)
}

/// The sample policy for a family: IPv4 rules (A listed, via 192.168.101.50;
/// `destinationsFrom: Routes` via 192.168.102.50), IPv6 rules (fd00:101::/64 via
/// fd00:101::50; `destinationsFrom: Routes` via fd00:102::50), or both in one policy.
pub fn sample_policy_for(family: Family) -> String {
    let mut rules = Vec::new();
    let mut family_rules = |net_a: &str, egress_a: IpAddr, egress_b: IpAddr| {
        rules.push(json!({"destinations": [net_a], "egressIP": egress_a.to_string()}));
        rules.push(json!({"destinationsFrom": "Routes", "egressIP": egress_b.to_string()}));
    };
    if family.has_v4() {
        family_rules(
            addr::NET_A,
            addr::EGRESS_IP_A.into(),
            addr::EGRESS_IP_B.into(),
        );
    }
    if family.has_v6() {
        family_rules(
            addr6::NET_A,
            addr6::EGRESS_IP_A.into(),
            addr6::EGRESS_IP_B.into(),
        );
    }
    to_yaml_doc(&json!({
        "apiVersion": "egress.dev/v1alpha1",
        "kind": "EgressGatewayPolicy",
        "metadata": {"name": "payments"},
        "spec": {
            "namespaceSelector": {"matchLabels": {"team": "payments"}},
            "podSelector": {"matchLabels": {"app": "api"}},
            "gatewaySelector": {"matchLabels": {GATEWAY_LABEL: "true"}},
            "failurePolicy": "Drop",
            "rules": rules,
        },
    }))
}

fn validate(spec: &LabSpec) -> Result<()> {
    if spec.underlay == Underlay::V6 && !spec.family.has_v6() {
        bail!("invalid lab spec: an IPv6 underlay needs IPv6 in the lab (family V6 or Dual)");
    }
    let mut seen = std::collections::BTreeSet::new();
    for pod in &spec.pods {
        if pod.name.is_empty()
            || pod.name.len() > 10
            || !pod
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-')
        {
            bail!(
                "invalid lab spec: pod name {:?} must be 1-10 characters of [a-zA-Z0-9-]",
                pod.name
            );
        }
        let reserved = ["ul", "rtr", "rtr-b"];
        if reserved.contains(&pod.name.as_str())
            || pod.name.starts_with("net-")
            || pod.name.starts_with("host-")
            || NODES.iter().any(|n| n.name == pod.name)
        {
            bail!("invalid lab spec: pod name {:?} is reserved", pod.name);
        }
        if !seen.insert(pod.name.clone()) {
            bail!("invalid lab spec: pod {:?} listed twice", pod.name);
        }
        if !NODES.iter().any(|n| n.name == pod.node) {
            bail!(
                "invalid lab spec: pod {:?} on unknown node {:?}",
                pod.name,
                pod.node
            );
        }
    }
    if let Some(p) = &spec.prefix
        && (p.is_empty() || p.len() > 12 || !p.chars().all(|c| c.is_ascii_alphanumeric()))
    {
        bail!("invalid lab spec: prefix {p:?} must be 1-12 alphanumeric characters");
    }
    Ok(())
}

fn assign_pod_ips(specs: &[PodSpec], family: Family, cni: Cni) -> Result<Vec<Pod>> {
    let mut used: std::collections::BTreeSet<Ipv4Addr> =
        specs.iter().filter_map(|p| p.ip).collect();
    let mut pods = Vec::new();
    for spec in specs {
        let node = NODES
            .iter()
            .find(|n| n.name == spec.node)
            .with_context(|| format!("pod {} on unknown node {}", spec.name, spec.node))?;
        let ip = match spec.ip {
            Some(ip) => ip,
            None => {
                let octet = node.ip.octets()[3];
                let ip = (11..=254)
                    .map(|n| Ipv4Addr::new(10, 244, octet, n))
                    .find(|ip| !used.contains(ip))
                    .with_context(|| format!("no free pod address on {}", node.name))?;
                used.insert(ip);
                ip
            }
        };
        pods.push(Pod {
            name: spec.name.clone(),
            namespace: spec.namespace.clone(),
            node: spec.node.clone(),
            labels: spec.labels.clone(),
            ip,
            veth: cni.veth(&spec.name),
            ipv6: family.has_v6().then(|| {
                let [_, _, node, n] = ip.octets();
                Ipv6Addr::new(0xfd00, 0x244, hex_like(node), 0, 0, 0, 0, hex_like(n))
            }),
        });
    }
    Ok(pods)
}

/// Claim a prefix by creating its underlay namespace (`ip netns add` fails if it exists, so
/// two processes cannot both win).
fn reserve_prefix(fixed: Option<&str>) -> Result<(String, Netns)> {
    let existing = netns::list_netns()?;
    let taken = |p: &str| {
        let head = format!("{p}-");
        existing.iter().any(|n| n.starts_with(&head))
    };
    if let Some(p) = fixed {
        if taken(p) {
            bail!("failed to start lab {p}: namespaces {p}-* exist (Lab::teardown_by_prefix)");
        }
        return Ok((p.to_owned(), Netns::add(&format!("{p}-ul"))?));
    }
    let mut last = None;
    for _ in 0..100 {
        let p = netns::next_prefix();
        if taken(&p) {
            continue;
        }
        match Netns::add(&format!("{p}-ul")) {
            Ok(ns) => return Ok((p, ns)),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("every lab prefix of this process is taken")))
        .context("failed to reserve a lab prefix")
}

/// One YAML document (`---` first) for a JSON value: block style, strings double-quoted with
/// JSON escapes (valid YAML), so `"true"` stays a string.
fn to_yaml_doc(v: &Value) -> String {
    let mut out = String::from("---\n");
    emit(v, 0, &mut out);
    out
}

/// Can `s` be written as a plain YAML scalar and still read back as the same string, also
/// under YAML 1.1 rules (where `True`, `yes`, `on`, `1_000` and `0x1f` are not strings)?
fn plain_ok(s: &str) -> bool {
    const SPECIAL: [&str; 12] = [
        "y", "n", "yes", "no", "on", "off", "true", "false", "null", "~", "nan", "inf",
    ];
    let Some(first) = s.chars().next() else {
        return false;
    };
    s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && first.is_ascii_alphanumeric()
        && !SPECIAL.contains(&s.to_ascii_lowercase().as_str())
        && s.replace('_', "").parse::<f64>().is_err()
        // Digit first: only addresses, prefixes and dotted versions (never a YAML 1.1
        // number, date or base-60 value).
        && (!first.is_ascii_digit() || s.contains('/') || s.matches('.').count() >= 2)
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) if plain_ok(s) => s.clone(),
        Value::String(s) => Value::String(s.clone()).to_string(),
        Value::Array(a) if a.is_empty() => "[]".to_owned(),
        Value::Object(o) if o.is_empty() => "{}".to_owned(),
        other => other.to_string(),
    }
}

fn is_block(v: &Value) -> bool {
    match v {
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        _ => false,
    }
}

fn emit(v: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(map) => {
            for (k, val) in map {
                let key = if plain_ok(k) {
                    k.clone()
                } else {
                    Value::String(k.clone()).to_string()
                };
                if is_block(val) {
                    out.push_str(&format!("{pad}{key}:\n"));
                    emit(val, indent + 2, out);
                } else {
                    out.push_str(&format!("{pad}{key}: {}\n", scalar(val)));
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                if is_block(item) {
                    // "- " then the first line of the block inline.
                    let mut inner = String::new();
                    emit(item, indent + 2, &mut inner);
                    let inner = inner.trim_start();
                    out.push_str(&format!("{pad}- {inner}"));
                } else {
                    out.push_str(&format!("{pad}- {}\n", scalar(item)));
                }
            }
        }
        other => out.push_str(&format!("{pad}{}\n", scalar(other))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let pods = assign_pod_ips(&specs, Family::V4, Cni::Routed).unwrap();
        assert_eq!(pods[0].ip, addr::W1_P1);
        assert_eq!(pods[5].ip, Ipv4Addr::new(10, 244, 11, 13));
        assert_eq!(pods[5].veth, "cali-w1-p3");
    }
}
