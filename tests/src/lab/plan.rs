//! What the lab is made of: its families, nodes, networks, routes, pods and spec.

use super::*;

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
/// Where OVN-Kubernetes keeps a Node's subnets ([`Cni::Ovs`], [`Cni::Ovn`]).
pub const OVN_NODE_SUBNETS: &str = "k8s.ovn.org/node-subnets";
/// nftables table (bridge family, in the underlay namespace) of [`Lab::partition_underlay`].
pub(super) const PARTITION_TABLE: &str = "lab_partition";

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

    /// The node's links to the underlay switch and the switch's port (in `ul`) facing
    /// each: `eth0` faces a port named after the node and, under [`Cni::Ovn`], the bond's
    /// second port `eth1` faces `<node>-b`.
    pub fn underlay_ports(&self, cni: Cni) -> Vec<(&'static str, String)> {
        cni.underlay_links()
            .iter()
            .map(|&link| match link {
                "eth0" => (link, self.name.to_owned()),
                _ => (link, format!("{}-b", self.name)),
            })
            .collect()
    }

    /// `ip` commands that configure the node's underlay once its links exist
    /// ([`Cni::underlay_links`]; for [`Cni::Bridge`], [`Cni::Ovs`] and [`Cni::Ovn`], also
    /// the bridge that holds the address): addresses, up, default route, other nodes' pod
    /// ranges. Idempotent (`replace`), so they also restore what the kernel drops when the
    /// link goes down (its static routes, its IPv6 addresses).
    pub(super) fn underlay_config(&self, nodes: &[Node], v6: bool, cni: Cni) -> Vec<String> {
        let dev = cni.underlay_device();
        let mut cmds = match cni {
            Cni::Routed => vec![],
            Cni::Bridge => vec!["link set eth0 master br-ul".to_owned()],
            Cni::Ovs | Cni::Ovn(_) => vec![],
        };
        cmds.extend(
            cni.underlay_links()
                .iter()
                .map(|link| format!("link set {link} up")),
        );
        if cni != Cni::Routed {
            cmds.push(format!("link set {dev} up"));
        }
        cmds.extend([
            format!("addr replace {}/24 dev {dev}", self.ip),
            format!("route replace default via {}", addr::ROUTER),
        ]);
        // Under OVN the other nodes' pods are reached through OVN (the management port's
        // route to the cluster subnet, `super::ovn`), not through their nodes.
        let pod_routes = cni.ovn().is_none();
        for other in nodes.iter().filter(|o| pod_routes && o.name != self.name) {
            cmds.push(format!(
                "route replace {} via {}",
                other.pod_cidr(),
                other.ip
            ));
        }
        if v6 {
            cmds.push(format!("addr replace {}/64 dev {dev} nodad", self.ip6()));
            cmds.push(format!("route replace ::/0 via {}", addr6::ROUTER));
            for other in nodes.iter().filter(|o| o.name != self.name) {
                cmds.push(format!(
                    "route replace {} via {}",
                    other.pod_cidr_v6(),
                    other.ip6()
                ));
            }
        }
        cmds
    }

    /// The pod subnet's gateway: `10.244.<octet>.1` ([`Cni::Bridge`], [`Cni::Ovs`]; under
    /// [`Cni::Ovn`] `ovn_cluster_router`'s port on the node's switch).
    pub fn pod_gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 244, self.ip.octets()[3], 1)
    }

    /// The management port's address under [`Cni::Ovn`]: `10.244.<octet>.2`, as
    /// OVN-Kubernetes gives `ovn-k8s-mp0` the subnet's second address.
    pub fn ovn_management_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 244, self.ip.octets()[3], 2)
    }

    /// The IPv6 pod subnet's gateway: `fd00:244:<octet>::1`.
    pub fn pod_gateway_v6(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x244, hex_like(self.ip.octets()[3]), 0, 0, 0, 0, 1)
    }
}

impl Node {
    /// Worker `i` (1-based) of a lab of any size: `w<i>`, underlay `10.200.0.11` and `.12`
    /// for the first two (the four-node lab's), `10.200.0.<100 + i>` from the third on.
    pub fn worker(i: u32) -> Result<Node> {
        let octet = match i {
            1 | 2 => 10 + i,
            3..=MAX_WORKERS => 100 + i,
            _ => bail!("a lab has workers 1 to {MAX_WORKERS}, not {i}"),
        };
        Ok(Node {
            name: interned(format!("w{i}")),
            ip: Ipv4Addr::new(10, 200, 0, octet as u8),
            gateway: false,
        })
    }

    /// Gateway `i` (1-based): `gw<i>`, underlay `10.200.0.<20 + i>`, with `sec-a` and
    /// `sec-b` on networks A and B at `.<10 + i>` ([`Node::secondary_addrs`]).
    pub fn gateway(i: u32) -> Result<Node> {
        if !(1..=MAX_GATEWAYS).contains(&i) {
            bail!("a lab has gateways 1 to {MAX_GATEWAYS}, not {i}");
        }
        Ok(Node {
            name: interned(format!("gw{i}")),
            ip: Ipv4Addr::new(10, 200, 0, (20 + i) as u8),
            gateway: true,
        })
    }

    /// A gateway's own addresses on secondary network `id` (`a` or `b`), which `sec-<id>`
    /// has: `192.168.10<1|2>.<10 + i>` and `fd00:10<1|2>::<10 + i>` for gateway `i`.
    pub fn secondary_addrs(&self, id: char) -> Result<(Ipv4Addr, Ipv6Addr)> {
        let host = self.ip.octets()[3].wrapping_sub(10);
        let net = match id {
            'a' => 101,
            'b' => 102,
            _ => bail!(
                "{} has no link sec-{id} (gateways have sec-a and sec-b)",
                self.name
            ),
        };
        if !self.gateway {
            bail!("{} is no gateway: it has no link sec-{id}", self.name);
        }
        Ok((
            Ipv4Addr::new(192, 168, net, host),
            Ipv6Addr::new(
                0xfd00,
                0x100 + u16::from(net - 100),
                0,
                0,
                0,
                0,
                0,
                hex_like(host),
            ),
        ))
    }
}

/// Most workers a lab can have (their underlay addresses end at `.254`).
pub const MAX_WORKERS: u32 = 154;
/// Most gateways a lab can have (their addresses on A and B stay below the egress IPs'
/// `.50`).
pub const MAX_GATEWAYS: u32 = 39;

/// The nodes of a lab of `workers` workers and `gateways` gateways (`cargo xtask lab
/// --nodes N --gateways G`): `w1`.. then `gw1`..
pub fn scaled_nodes(workers: u32, gateways: u32) -> Result<Vec<Node>> {
    if workers == 0 || gateways == 0 {
        bail!("a lab needs at least one worker and one gateway ({workers} and {gateways} asked)");
    }
    let mut out = (1..=workers)
        .map(Node::worker)
        .collect::<Result<Vec<_>>>()?;
    out.extend(
        (1..=gateways)
            .map(Node::gateway)
            .collect::<Result<Vec<_>>>()?,
    );
    Ok(out)
}

/// A generated node's name, kept for the process's life ([`Node::name`] is `&'static`, as
/// the four constant nodes' are): each distinct name is leaked once, however many labs.
fn interned(name: String) -> &'static str {
    static NAMES: std::sync::Mutex<BTreeSet<&'static str>> = std::sync::Mutex::new(BTreeSet::new());
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = names.get(name.as_str()) {
        return n;
    }
    let n: &'static str = Box::leak(name.into_boxed_str());
    names.insert(n);
    n
}

/// `11` -> `0x11`: IPv6 addresses that read like their IPv4 counterparts.
pub(super) const fn hex_like(n: u8) -> u16 {
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
    /// Agents sign their hellos with a lab key (`--liveness-key-file`), as the DaemonSet
    /// has them (on by default).
    pub liveness_key: bool,
    /// The nodes: [`NODES`] (two workers, two gateways) by default; [`scaled_nodes`] for
    /// a lab at a cluster's scale ([`LabSpec::scaled`]).
    pub nodes: Vec<Node>,
    /// Flags every agent on a worker gets (before a test's own), e.g. small maps.
    pub worker_agent_args: Vec<String>,
    /// Flags every agent on a gateway gets (before a test's own).
    pub gateway_agent_args: Vec<String>,
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
    /// Real OVN under OVN-Kubernetes' topology (inside the VM guest): [`Cni::Ovs`]'s
    /// nodes with their two links in a bond ([`Cni::uplink`]: `br-ex` holds `bond0`, the
    /// secondary VLANs hang off it), each with an `ovn-controller` against its own Open
    /// vSwitch, one NB and SB database and `ovn-northd` for the lab, Geneve between the
    /// nodes, and the logical network OVN-Kubernetes builds (`super::ovn`): a switch per
    /// node with the pods' ports and the management port `k8s-<node>` (`ovn-k8s-mp0`,
    /// `10.244.<octet>.2`), `ovn_cluster_router` (`10.244.<octet>.1`, the pods'
    /// gateway), the `join` switch,
    /// `GR_<node>` with `ext_<node>` on `br-ex`. Pods leave the cluster as the gateway
    /// mode says.
    Ovn(OvnGateway),
}

/// OVN-Kubernetes' gateway mode ([`Cni::Ovn`]): how pods reach what is outside the
/// cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OvnGateway {
    /// `--gateway-mode shared`, the default: through the node's `GR_<node>`, which SNATs
    /// the cluster subnet to the node's address, and `br-ex`.
    Shared,
    /// `--gateway-mode local` (OpenShift's `routingViaHost: true`): through the
    /// management port into the node's own routing, masqueraded to the node's address.
    Local,
}

impl Cni {
    /// The device that holds the node's underlay address.
    pub fn underlay_device(self) -> &'static str {
        match self {
            Self::Routed => "eth0",
            Self::Bridge => "br-ul",
            Self::Ovs | Self::Ovn(_) => "br-ex",
        }
    }

    /// The NIC that `br-ex` holds and the secondary networks' VLANs hang off, under
    /// [`Cni::Ovs`] and [`Cni::Ovn`]: under OVN a bond of the node's two links (`bond0`,
    /// active-backup, `miimon 100`, `eth0` its primary, as NMState configures bare-metal
    /// OpenShift nodes), else the link (`eth0`).
    pub fn uplink(self) -> &'static str {
        match self {
            Self::Ovn(_) => "bond0",
            _ => "eth0",
        }
    }

    /// The node's links to the underlay switch ([`Node::underlay_ports`]): under OVN the
    /// bond's two ports, `eth0` (its primary) and `eth1`, each on its own switch port so
    /// that the bond has somewhere to fail over to; else `eth0`.
    pub fn underlay_links(self) -> &'static [&'static str] {
        match self {
            Self::Ovn(_) => &["eth0", "eth1"],
            _ => &["eth0"],
        }
    }

    /// Nodes run Open vSwitch (`br-int`, `br-ex`, `ovn-k8s-mp0`), secondary networks are
    /// VLANs off the NIC: [`Cni::Ovs`] and [`Cni::Ovn`].
    pub fn runs_ovs(self) -> bool {
        matches!(self, Self::Ovs | Self::Ovn(_))
    }

    /// OVN's gateway mode, under [`Cni::Ovn`].
    pub fn ovn(self) -> Option<OvnGateway> {
        match self {
            Self::Ovn(mode) => Some(mode),
            _ => None,
        }
    }

    /// The host side of a pod's veth.
    pub(super) fn veth(self, pod: &str) -> String {
        match self {
            Self::Routed => format!("cali-{pod}"),
            Self::Bridge | Self::Ovs | Self::Ovn(_) => format!("veth-{pod}"),
        }
    }
}

impl fmt::Display for Cni {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Routed => "routed",
            Self::Bridge => "bridge",
            Self::Ovs => "ovs",
            Self::Ovn(OvnGateway::Shared) => "ovn",
            Self::Ovn(OvnGateway::Local) => "ovn-local",
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
            "ovn" => Ok(Self::Ovn(OvnGateway::Shared)),
            "ovn-local" => Ok(Self::Ovn(OvnGateway::Local)),
            other => bail!("--cni {other:?}: expected routed, bridge, ovs, ovn or ovn-local"),
        }
    }
}

/// VLAN ids of the secondary networks A and B under [`Cni::Ovs`] and [`Cni::Ovn`].
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
            liveness_key: true,
            nodes: NODES.to_vec(),
            worker_agent_args: Vec::new(),
            gateway_agent_args: Vec::new(),
        }
    }

    /// A lab of `workers` workers and `gateways` gateways ([`scaled_nodes`]), IPv4, with
    /// two pods per worker: `w<i>-p1` app=api (selected by the sample policy) and
    /// `w<i>-p2` app=web (not selected), both in `payments`.
    pub fn scaled(echo_bin: impl Into<PathBuf>, workers: u32, gateways: u32) -> Result<Self> {
        let mut spec = Self::new(echo_bin);
        spec.nodes = scaled_nodes(workers, gateways)?;
        spec.pods = (1..=workers)
            .flat_map(|i| {
                let node = format!("w{i}");
                [
                    PodSpec::new(&format!("{node}-p1"), PAYMENTS, &node, &[("app", "api")]),
                    PodSpec::new(&format!("{node}-p2"), PAYMENTS, &node, &[("app", "web")]),
                ]
            })
            .collect();
        Ok(spec)
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
