//! The node the fuzzer runs on: one dual-stack namespace and one loaded object whose maps
//! look like those of a busy node that is both a source node and a gateway. The same
//! tables set up the maps and answer the checker's questions (is this pod selected, which
//! rule covers this destination, which interface may a rule's packets leave by), so the
//! model and the maps cannot drift apart.
//!
//! ```text
//!   pod0  veth 02:00:00:00:bb:01 -- the local pods (10.244.1.5, fd00:244:1::5): route /32, /128
//!   tun0  veth: stands in for the collect-metadata VXLAN device
//!   ul0   veth: 192.168.0.10/24, this node's underlay address
//!   sec0  veth 02:00:00:00:0a:02, network A (10.100.0.2/24, fd00:100::2/64): egress IP
//!         10.100.0.50 / fd00:100::50 (rule 1); its own address serves rule 3 (`interface:`)
//!         router .1 / ::1 to 172.16.0.0/16 / fd00:172:16::/48
//!   sec1  veth 02:00:00:00:0b:02, network B (10.200.0.2/24, fd00:200::2/64): egress IP
//!         10.200.0.50 / fd00:200::50 (rule 2)
//! ```
//!
//! Peers: `PEER` (IPv4 underlay) and `PEER6` (IPv6 underlay) are known nodes; `STRANGER`
//! is not. Per family: a selected local pod with rules to every kind of destination (local
//! gateway, remote gateway over either underlay, an except prefix, no gateway with Drop
//! and with Fallthrough, an `interface:` rule), an unselected local pod, admitted pods of
//! both peers, an unadmitted pod of a peer, and established flows of every protocol in
//! conntrack (rewritten every few thousand packets, so that neither the LRU nor the idle
//! timeouts take them during a long run).

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::LazyLock,
};

use aya::maps::{HashMap, MapData};
use egress_common::{
    conntrack::{CtEntryV4, CtEntryV6, CtKeyV4, CtKeyV6, dir, state},
    maps,
    policy::{
        EgressIpValue, PodOwnerValue, PolicyValueV4, PolicyValueV6, PortFilter, PortRange,
        RuleValueV6, action, egress_ip_flags, pod_device_flags::REPLY_TO_PEER,
    },
    underlay,
};

use crate::testrun::{Datapath, ifindex, ip, ktime_ns, ready_config, sysctl};

pub const NODE: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 168, 0, 10));
/// The IPv4 peer's address (the underlay a VXLAN frame can carry).
pub const PEER_V4: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 20);
pub const PEER: IpAddr = IpAddr::V4(PEER_V4);
pub const PEER6: IpAddr = IpAddr::V6(Ipv6Addr::new(0xfd00, 0xff, 0, 0, 0, 0, 0, 0x20));
pub const STRANGER: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 168, 0, 99));
/// Every known node (`NODES`).
pub const NODES: [IpAddr; 3] = [NODE, PEER, PEER6];

pub const RULE_A: u32 = 1;
pub const RULE_B: u32 = 2;
/// An `interface:` rule: out of sec0 with sec0's own address (shared with the host).
pub const RULE_SHARED: u32 = 3;
/// Served here for IPv4 only, and admitted for nobody.
pub const RULE_V4_ONLY: u32 = 4;

pub use crate::testrun::{PORT_MAX, PORT_MIN, TUNNEL_MTU};

/// The devices of the namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dev {
    Pod,
    /// Another pod's device, with no pod behind it: where a pod sending as the selected
    /// pod (bound to `Pod`) would come from.
    Pod1,
    Tunnel,
    Sec0,
    Sec1,
    /// The underlay interface, where a peer's VXLAN arrives (`from_underlay`).
    Underlay,
}

pub const POD0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xbb, 0x01];
const POD1_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xbb, 0x02];
pub const SEC0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0x02];
pub const SEC1_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0b, 0x02];
const TUN0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xdd, 0x01];
const UL0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xcc, 0x01];
const POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xaa, 0x01];
const DEST_A_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0x07];
const ROUTER_A_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0x01];
const DEST_B_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0b, 0x09];

/// The MAC of a device: what a FIB redirect writes as the source of its frames.
pub fn mac(dev: Dev) -> [u8; 6] {
    match dev {
        Dev::Pod => POD0_MAC,
        Dev::Pod1 => POD1_MAC,
        Dev::Tunnel => TUN0_MAC,
        Dev::Sec0 => SEC0_MAC,
        Dev::Sec1 => SEC1_MAC,
        Dev::Underlay => UL0_MAC,
    }
}

/// An entry of the selected pod's policy trie.
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    pub net: IpAddr,
    pub len: u8,
    pub action: u8,
    pub gateway: IpAddr,
    pub rule: u32,
    /// A `PORT_FILTERS` id ([`PORT_FILTER`]), 0 for none.
    pub filter: u16,
}

/// The port filter of network B's entry (egress NetworkPolicy): TCP 1 to 1023 and UDP 53.
pub const PORT_FILTER: u16 = 7;
pub const PORT_FILTER_RANGES: [(u8, u16, u16); 2] = [(TCP, 1, 1023), (UDP, 53, 53)];

/// A rule this gateway serves: its egress address and interface.
#[derive(Clone, Copy, Debug)]
pub struct Rule {
    pub id: u32,
    pub egress: IpAddr,
    pub dev: Dev,
}

/// An established flow in conntrack (both entries).
#[derive(Clone, Copy, Debug)]
pub struct Flow {
    pub pod: IpAddr,
    pub pod_port: u16,
    pub remote: IpAddr,
    pub remote_port: u16,
    pub proto: u8,
    pub egress: IpAddr,
    pub egress_port: u16,
    pub pod_node: IpAddr,
    pub rule: u32,
}

/// One family's addresses, maps and routes.
#[derive(Debug)]
pub struct Plan {
    /// Selected, on this node.
    pub local_pod: IpAddr,
    /// On this node, selected by nothing.
    pub unselected_pod: IpAddr,
    /// Of `PEER`, admitted for rules A, B and shared.
    pub remote_pod: IpAddr,
    /// Of `PEER`, admitted for nothing.
    pub remote_unselected: IpAddr,
    /// Of `PEER6` (the IPv6 underlay), admitted for rules A, B and shared.
    pub remote6_pod: IpAddr,
    pub dest_a: IpAddr,
    pub dest_b: IpAddr,
    pub dest_far: IpAddr,
    pub egress_a: IpAddr,
    pub egress_b: IpAddr,
    pub shared_a: IpAddr,
    /// Destinations of the selected pod's policy (the trie).
    pub policy: Vec<Policy>,
    pub rules: Vec<Rule>,
    /// (pod, rule) pairs admitted.
    pub admitted: Vec<(IpAddr, u32)>,
    /// Pod -> its node.
    pub owners: Vec<(IpAddr, IpAddr)>,
    pub flows: Vec<Flow>,
    /// The namespace's routes: (network, prefix length, device).
    pub routes: Vec<(IpAddr, u8, Dev)>,
    /// `ip` commands of this family's addresses, routes and neighbours.
    commands: Vec<String>,
}

const TCP: u8 = 6;
const UDP: u8 = 17;

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

fn v6(a: u16, b: u16, c: u16, h: u16) -> IpAddr {
    IpAddr::V6(Ipv6Addr::new(a, b, c, 0, 0, 0, 0, h))
}

/// The addresses of one family, from which [`plan_of`] derives the rest.
struct Addrs {
    pods: [IpAddr; 5],
    net_a: IpAddr,
    net_b: IpAddr,
    far: IpAddr,
    /// Behind `PEER6`, through rule B.
    net_b6: IpAddr,
    /// An except prefix inside A (not holding A's hosts).
    except: IpAddr,
    drop_net: IpAddr,
    pass_net: IpAddr,
    /// Prefix lengths: networks, far network, the except prefix inside A, `net_b6`.
    lens: [u8; 4],
    hosts: [IpAddr; 4],
    egress: [IpAddr; 3],
    echo: u8,
    nets: [&'static str; 4],
}

fn plan_of(a: Addrs) -> Plan {
    let [
        local_pod,
        unselected_pod,
        remote_pod,
        remote_unselected,
        remote6_pod,
    ] = a.pods;
    let [dest_a, dest_b, dest_far, router_a] = a.hosts;
    let [egress_a, egress_b, shared_a] = a.egress;
    let [net_len, far_len, except_len, b6_len] = a.lens;
    let fwd = |net, len, gateway, rule| Policy {
        net,
        len,
        action: action::FORWARD,
        gateway,
        rule,
        filter: 0,
    };
    let sentinel = |net, len, action| Policy {
        net,
        len,
        action,
        gateway: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        rule: 0,
        filter: 0,
    };
    let flow =
        |pod, pod_port, remote, remote_port, proto, egress, egress_port, pod_node, rule| Flow {
            pod,
            pod_port,
            remote,
            remote_port,
            proto,
            egress,
            egress_port,
            pod_node,
            rule,
        };
    let full = if local_pod.is_ipv4() { 32 } else { 128 };
    let [cidr_a, cidr_b, mut_far, fam] = a.nets;
    let commands = vec![
        format!("{fam} addr add {cidr_a} dev sec0"),
        format!("{fam} addr add {cidr_b} dev sec1"),
        format!("{fam} route add {local_pod}/{full} dev pod0"),
        format!("{fam} route add {mut_far} via {router_a} dev sec0"),
        format!(
            "{fam} neigh replace {local_pod} lladdr {} dev pod0 nud permanent",
            hex_mac(POD_MAC)
        ),
        format!(
            "{fam} neigh replace {dest_a} lladdr {} dev sec0 nud permanent",
            hex_mac(DEST_A_MAC)
        ),
        format!(
            "{fam} neigh replace {router_a} lladdr {} dev sec0 nud permanent",
            hex_mac(ROUTER_A_MAC)
        ),
        format!(
            "{fam} neigh replace {dest_b} lladdr {} dev sec1 nud permanent",
            hex_mac(DEST_B_MAC)
        ),
    ];
    let mut rules = vec![
        Rule {
            id: RULE_A,
            egress: egress_a,
            dev: Dev::Sec0,
        },
        Rule {
            id: RULE_B,
            egress: egress_b,
            dev: Dev::Sec1,
        },
        Rule {
            id: RULE_SHARED,
            egress: shared_a,
            dev: Dev::Sec0,
        },
    ];
    if local_pod.is_ipv4() {
        rules.push(Rule {
            id: RULE_V4_ONLY,
            egress: egress_b,
            dev: Dev::Sec1,
        });
    }
    let mut admitted = vec![(local_pod, RULE_A), (local_pod, RULE_SHARED)];
    for pod in [remote_pod, remote6_pod] {
        admitted.extend([RULE_A, RULE_B, RULE_SHARED].map(|r| (pod, r)));
    }
    Plan {
        local_pod,
        unselected_pod,
        remote_pod,
        remote_unselected,
        remote6_pod,
        dest_a,
        dest_b,
        dest_far,
        egress_a,
        egress_b,
        shared_a,
        policy: vec![
            fwd(a.net_a, net_len, NODE, RULE_A),
            sentinel(a.except, except_len, action::EXCLUDE),
            Policy {
                filter: PORT_FILTER,
                ..fwd(a.net_b, net_len, PEER, RULE_B)
            },
            fwd(a.far, far_len, NODE, RULE_SHARED),
            fwd(a.net_b6, b6_len, PEER6, RULE_B),
            sentinel(a.drop_net, net_len, action::NO_GATEWAY_DROP),
            // The lower half of it: what an egress NetworkPolicy denies.
            sentinel(a.drop_net, net_len + 1, action::DENY),
            sentinel(a.pass_net, net_len, action::NO_GATEWAY_PASS),
        ],
        rules,
        admitted,
        owners: vec![
            (local_pod, NODE),
            (unselected_pod, NODE),
            (remote_pod, PEER),
            (remote_unselected, PEER),
            (remote6_pod, PEER6),
        ],
        flows: vec![
            flow(
                remote_pod, 40_000, dest_a, 80, TCP, egress_a, 20_001, PEER, RULE_A,
            ),
            flow(
                remote6_pod,
                5353,
                dest_b,
                53,
                UDP,
                egress_b,
                20_002,
                PEER6,
                RULE_B,
            ),
            flow(
                local_pod, 7, dest_a, 0, a.echo, egress_a, 20_003, NODE, RULE_A,
            ),
            flow(
                local_pod,
                41_000,
                dest_far,
                443,
                TCP,
                shared_a,
                20_004,
                NODE,
                RULE_SHARED,
            ),
        ],
        routes: vec![
            (a.net_a, net_len, Dev::Sec0),
            (a.net_b, net_len, Dev::Sec1),
            (a.far, far_len, Dev::Sec0),
            (local_pod, full, Dev::Pod),
        ],
        commands,
    }
}

fn hex_mac(m: [u8; 6]) -> String {
    m.map(|b| format!("{b:02x}")).join(":")
}

pub static V4: LazyLock<Plan> = LazyLock::new(|| {
    plan_of(Addrs {
        pods: [
            v4(10, 244, 1, 5),
            v4(10, 244, 1, 9),
            v4(10, 244, 2, 5),
            v4(10, 244, 2, 9),
            v4(10, 244, 3, 5),
        ],
        net_a: v4(10, 100, 0, 0),
        net_b: v4(10, 200, 0, 0),
        far: v4(172, 16, 0, 0),
        net_b6: v4(10, 201, 0, 0),
        except: v4(10, 100, 0, 128),
        drop_net: v4(192, 168, 104, 0),
        pass_net: v4(192, 168, 105, 0),
        lens: [24, 16, 29, 16],
        hosts: [
            v4(10, 100, 0, 7),
            v4(10, 200, 0, 9),
            v4(172, 16, 5, 5),
            v4(10, 100, 0, 1),
        ],
        egress: [v4(10, 100, 0, 50), v4(10, 200, 0, 50), v4(10, 100, 0, 2)],
        echo: 1,
        nets: ["10.100.0.2/24", "10.200.0.2/24", "172.16.0.0/16", "-4"],
    })
});

pub static V6: LazyLock<Plan> = LazyLock::new(|| {
    plan_of(Addrs {
        pods: [
            v6(0xfd00, 0x244, 1, 5),
            v6(0xfd00, 0x244, 1, 9),
            v6(0xfd00, 0x244, 2, 5),
            v6(0xfd00, 0x244, 2, 9),
            v6(0xfd00, 0x244, 3, 5),
        ],
        net_a: v6(0xfd00, 0x100, 0, 0),
        net_b: v6(0xfd00, 0x200, 0, 0),
        far: v6(0xfd00, 0x172, 0x16, 0),
        net_b6: v6(0xfd00, 0x201, 0, 0),
        except: v6(0xfd00, 0x100, 0, 0x80),
        drop_net: v6(0xfd00, 0x104, 0, 0),
        pass_net: v6(0xfd00, 0x105, 0, 0),
        lens: [64, 48, 125, 48],
        hosts: [
            v6(0xfd00, 0x100, 0, 7),
            v6(0xfd00, 0x200, 0, 9),
            v6(0xfd00, 0x172, 0x16, 5),
            v6(0xfd00, 0x100, 0, 1),
        ],
        egress: [
            v6(0xfd00, 0x100, 0, 0x50),
            v6(0xfd00, 0x200, 0, 0x50),
            v6(0xfd00, 0x100, 0, 2),
        ],
        echo: 58,
        nets: [
            "fd00:100::2/64 nodad",
            "fd00:200::2/64 nodad",
            "fd00:172:16::/48",
            "-6",
        ],
    })
});

/// The plan of `addr`'s family.
pub fn plan(addr: IpAddr) -> &'static Plan {
    if addr.is_ipv4() { &V4 } else { &V6 }
}

// ---- the model: what the maps and routes say ----

/// Whether `addr` is inside `net`/`len`.
pub fn contains(net: IpAddr, len: u8, addr: IpAddr) -> bool {
    let (n, a, bits) = match (net, addr) {
        (IpAddr::V4(n), IpAddr::V4(a)) => (u128::from(n.to_bits()), u128::from(a.to_bits()), 32),
        (IpAddr::V6(n), IpAddr::V6(a)) => (n.to_bits(), a.to_bits(), 128),
        _ => return false,
    };
    let len = u32::from(len);
    len == 0 || (n ^ a) >> (bits - len) == 0
}

impl Plan {
    /// `SELECTED_V4` / `_V6`.
    pub fn selected(&self, pod: IpAddr) -> bool {
        pod == self.local_pod
    }

    /// The policy trie's answer for (pod, dst): the longest prefix.
    pub fn policy(&self, pod: IpAddr, dst: IpAddr) -> Option<&Policy> {
        if !self.selected(pod) {
            return None;
        }
        self.policy
            .iter()
            .filter(|p| contains(p.net, p.len, dst))
            .max_by_key(|p| p.len)
    }

    pub fn rule(&self, id: u32) -> Option<&Rule> {
        self.rules.iter().find(|r| r.id == id)
    }

    /// The rules whose egress address is `addr`.
    pub fn rules_by_egress(&self, addr: IpAddr) -> impl Iterator<Item = &Rule> {
        self.rules.iter().filter(move |r| r.egress == addr)
    }

    /// `EGRESS_IPS_*`: whether the address is held here, and whether it is shared.
    pub fn egress_ip(&self, addr: IpAddr) -> Option<bool> {
        [
            (self.egress_a, false),
            (self.egress_b, false),
            (self.shared_a, true),
        ]
        .into_iter()
        .find(|(a, _)| *a == addr)
        .map(|(_, shared)| shared)
    }

    pub fn admitted(&self, pod: IpAddr, rule: u32) -> bool {
        self.admitted.contains(&(pod, rule))
    }

    /// `POD_OWNER_*`: the pod's node.
    pub fn owner(&self, pod: IpAddr) -> Option<IpAddr> {
        self.owners.iter().find(|(p, _)| *p == pod).map(|(_, n)| *n)
    }

    /// Whether a route of the namespace leads to `dst` through `dev`.
    pub fn routes_via(&self, dst: IpAddr, dev: Dev) -> bool {
        self.routes
            .iter()
            .any(|(net, len, d)| *d == dev && contains(*net, *len, dst))
    }
}

// ---- the namespace and the maps ----

/// Ifindexes of the namespace's devices.
#[derive(Clone, Copy, Debug)]
pub struct Net {
    pub pod0: u32,
    pub pod1: u32,
    pub tun0: u32,
    pub sec0: u32,
    pub sec1: u32,
    pub ul0: u32,
}

impl Net {
    pub fn ifindex(&self, dev: Dev) -> u32 {
        match dev {
            Dev::Pod => self.pod0,
            Dev::Pod1 => self.pod1,
            Dev::Tunnel => self.tun0,
            Dev::Sec0 => self.sec0,
            Dev::Sec1 => self.sec1,
            Dev::Underlay => self.ul0,
        }
    }
}

/// Make the devices, addresses, routes and neighbours of the calling thread's (new)
/// namespace.
pub fn topology() -> Net {
    for (dev, m) in [
        ("ul0", UL0_MAC),
        ("tun0", TUN0_MAC),
        ("pod0", POD0_MAC),
        ("pod1", POD1_MAC),
        ("sec0", SEC0_MAC),
        ("sec1", SEC1_MAC),
    ] {
        ip(&format!(
            "link add {dev} address {} type veth peer name {dev}p",
            hex_mac(m)
        ));
        ip(&format!("link set {dev} up"));
        ip(&format!("link set {dev}p up"));
    }
    ip(&format!("addr add {NODE}/24 dev ul0"));
    for cmd in V4.commands.iter().chain(&V6.commands) {
        ip(cmd);
    }
    sysctl("net/ipv4/conf/all/forwarding", "1");
    sysctl("net/ipv6/conf/all/forwarding", "1");
    Net {
        pod0: ifindex("pod0"),
        pod1: ifindex("pod1"),
        tun0: ifindex("tun0"),
        sec0: ifindex("sec0"),
        sec1: ifindex("sec1"),
        ul0: ifindex("ul0"),
    }
}

/// Fill the maps of `dp` from both plans.
pub fn fill(dp: &mut Datapath, net: &Net) {
    dp.config(ready_config(NODE, net.tun0));
    for (i, n) in NODES.into_iter().enumerate() {
        dp.node(n, i as u32 + 1);
    }
    let mut filter = PortFilter {
        count: PORT_FILTER_RANGES.len() as u32,
        ..PortFilter::default()
    };
    for (slot, (proto, first, last)) in filter.ranges.iter_mut().zip(PORT_FILTER_RANGES) {
        *slot = PortRange {
            proto,
            _pad: 0,
            first,
            last,
        };
    }
    insert(
        dp,
        maps::PORT_FILTERS,
        u32::from(PORT_FILTER).to_ne_bytes().to_vec(),
        filter,
    );
    for plan in [&*V4, &*V6] {
        fill_plan(dp, net, plan);
    }
    refresh_flows(dp, net);
}

fn fill_plan(dp: &mut Datapath, net: &Net, plan: &Plan) {
    // The selected pod is bound to its device (`from_pod`'s source check), a veth whose
    // peer is the pod's: replies of its flows go straight into it (`REPLY_TO_PEER`).
    dp.pod_device_with(plan.local_pod, net.pod0, REPLY_TO_PEER);
    for &(pod, rule) in &plan.admitted {
        dp.admit(pod, rule);
    }
    for &(pod, node) in &plan.owners {
        insert(
            dp,
            owner_map(pod),
            octets(pod),
            PodOwnerValue {
                node: underlay::from_ip(node),
            },
        );
    }
    for p in &plan.policy {
        policy_entry(dp, plan.local_pod, p);
    }
    // Selected after its entries, with their prefix lengths.
    match plan.local_pod {
        IpAddr::V4(pod) => dp.selected(pod),
        IpAddr::V6(pod) => dp.selected_v6(pod),
    }
    for r in &plan.rules {
        rule_entry(dp, net, r);
    }
    for addr in [plan.egress_a, plan.egress_b, plan.shared_a] {
        let dev = plan
            .rules_by_egress(addr)
            .next()
            .expect("a rule per egress IP")
            .dev;
        let shared = plan.egress_ip(addr) == Some(true);
        let flags = if shared { egress_ip_flags::SHARED } else { 0 };
        let map = if addr.is_ipv4() {
            maps::EGRESS_IPS_V4
        } else {
            maps::EGRESS_IPS_V6
        };
        insert(
            dp,
            map,
            octets(addr),
            EgressIpValue {
                ifindex: net.ifindex(dev),
                flags,
            },
        );
    }
}

fn owner_map(pod: IpAddr) -> &'static str {
    if pod.is_ipv4() {
        maps::POD_OWNER_V4
    } else {
        maps::POD_OWNER_V6
    }
}

/// An address's bytes as map keys hold them: 4 or 16.
pub fn octets(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// Insert into a hash map keyed by an address (4 or 16 bytes).
fn insert<V: aya::Pod>(dp: &mut Datapath, name: &str, key: Vec<u8>, value: V) {
    if let Ok(k) = <[u8; 4]>::try_from(key.as_slice()) {
        let mut m: HashMap<&mut MapData, [u8; 4], V> = HashMap::try_from(dp.map(name)).unwrap();
        m.insert(k, value, 0)
            .unwrap_or_else(|e| panic!("failed to fill {name}: {e}"));
    } else {
        let k = <[u8; 16]>::try_from(key.as_slice()).expect("a 16-byte key");
        let mut m: HashMap<&mut MapData, [u8; 16], V> = HashMap::try_from(dp.map(name)).unwrap();
        m.insert(k, value, 0)
            .unwrap_or_else(|e| panic!("failed to fill {name}: {e}"));
    }
}

fn policy_entry(dp: &mut Datapath, pod: IpAddr, p: &Policy) {
    let gateway = if p.action == action::FORWARD {
        underlay::from_ip(p.gateway)
    } else {
        [0; 16]
    };
    match (pod, p.net) {
        (IpAddr::V4(pod), IpAddr::V4(net)) => dp.policy(
            pod,
            net,
            u32::from(p.len),
            PolicyValueV4 {
                gateway,
                egress_ip: [0; 4],
                rule_id: p.rule,
                action: p.action,
                _pad: 0,
                filter: p.filter,
            },
        ),
        (IpAddr::V6(pod), IpAddr::V6(net)) => dp.policy_v6(
            pod,
            net,
            u32::from(p.len),
            PolicyValueV6 {
                gateway,
                rule_id: p.rule,
                action: p.action,
                _pad: 0,
                filter: p.filter,
                egress_ip: [0; 16],
            },
        ),
        _ => panic!("a policy entry of the other family: {p:?}"),
    }
}

fn rule_entry(dp: &mut Datapath, net: &Net, r: &Rule) {
    let ifindex = net.ifindex(r.dev);
    match r.egress {
        IpAddr::V4(e) => dp.rule(r.id, e, ifindex),
        IpAddr::V6(e) => {
            let mut m: HashMap<&mut MapData, u32, RuleValueV6> =
                HashMap::try_from(dp.map(maps::RULES_V6)).unwrap();
            m.insert(
                r.id,
                RuleValueV6 {
                    egress_ip: e.octets(),
                    ifindex,
                },
                0,
            )
            .expect("failed to fill RULES_V6");
        }
    }
}

/// (Re)write both entries of every established flow, last seen now.
/// Fill both conntrack maps to the brim ([`TEST_MAP_ENTRIES`] each) with established
/// flows of other hosts (198.18.0.0/15 and 2001:2::/48, the benchmarking ranges, which no
/// plan uses), then write the node's own flows again: the LRU takes the oldest of the
/// fillers first, and after that whatever the datapath's new flows push out.
pub fn fill_conntrack(dp: &mut Datapath) {
    let now = ktime_ns();
    let n = crate::testrun::TEST_MAP_ENTRIES;
    for i in 0..n {
        let [_, _, hi, lo] = i.to_be_bytes();
        let key = CtKeyV4 {
            src: [198, 18, hi, lo],
            dst: [198, 19, hi, lo],
            src_port_be: 40_000u16.to_be(),
            dst_port_be: 443u16.to_be(),
            proto: 6,
            dir: dir::ORIGINAL,
            _pad: [0; 2],
        };
        let entry = CtEntryV4 {
            xlate_addr: [198, 18, 255, 1],
            xlate_port_be: (20_000 + (i % 40_000) as u16).to_be(),
            state: state::ESTABLISHED,
            _pad0: 0,
            pod_node: underlay::from_ip(PEER),
            ifindex: 0,
            rule_id: RULE_A,
            last_seen_ns: now,
            next_hop: Default::default(),
        };
        dp.ct_insert(key, entry);
        let mut src6 = [0u8; 16];
        src6[..4].copy_from_slice(&[0x20, 0x01, 0, 2]);
        src6[12..].copy_from_slice(&i.to_be_bytes());
        let mut dst6 = src6;
        dst6[11] = 1;
        dp.ct_insert_v6(
            CtKeyV6 {
                src: src6,
                dst: dst6,
                src_port_be: key.src_port_be,
                dst_port_be: key.dst_port_be,
                proto: 6,
                dir: dir::ORIGINAL,
                _pad: [0; 2],
            },
            CtEntryV6 {
                xlate_addr: dst6,
                xlate_port_be: entry.xlate_port_be,
                state: state::ESTABLISHED,
                _pad0: 0,
                pod_node: entry.pod_node,
                ifindex: 0,
                rule_id: RULE_A,
                _pad1: 0,
                last_seen_ns: now,
                next_hop: Default::default(),
            },
        );
    }
    // The LRU may evict before the last slot (per-CPU free lists): nearly full is full.
    let (v4, v6) = (dp.ct().len(), dp.ct_v6().len());
    assert!(
        v4 as u64 * 10 >= u64::from(n) * 9 && v6 as u64 * 10 >= u64::from(n) * 9,
        "conntrack not filled: {v4} and {v6} entries of {n}"
    );
}

pub fn refresh_flows(dp: &mut Datapath, net: &Net) {
    let now = ktime_ns();
    for f in V4.flows.iter().chain(&V6.flows) {
        let dev = plan(f.pod).rule(f.rule).expect("the flow's rule").dev;
        flow_entries(dp, f, net.ifindex(dev), now);
    }
}

/// The ports of a flow's keys: for ICMP echo (identifier, 0) one way, (0, identifier)
/// back, as conntrack keys them.
fn flow_entries(dp: &mut Datapath, f: &Flow, ifindex: u32, now: u64) {
    let st = state::ESTABLISHED;
    let be = u16::to_be;
    let node = underlay::from_ip(f.pod_node);
    match (f.pod, f.remote, f.egress) {
        (IpAddr::V4(pod), IpAddr::V4(remote), IpAddr::V4(egress)) => {
            let key = |src: Ipv4Addr, dst: Ipv4Addr, sp: u16, dp_: u16, d| CtKeyV4 {
                src: src.octets(),
                dst: dst.octets(),
                src_port_be: be(sp),
                dst_port_be: be(dp_),
                proto: f.proto,
                dir: d,
                _pad: [0; 2],
            };
            let entry = |addr: Ipv4Addr, port: u16| CtEntryV4 {
                xlate_addr: addr.octets(),
                xlate_port_be: be(port),
                state: st,
                _pad0: 0,
                pod_node: node,
                ifindex,
                rule_id: f.rule,
                last_seen_ns: now,
                next_hop: Default::default(),
            };
            dp.ct_insert(
                key(pod, remote, f.pod_port, f.remote_port, dir::ORIGINAL),
                entry(egress, f.egress_port),
            );
            dp.ct_insert(
                key(remote, egress, f.remote_port, f.egress_port, dir::REPLY),
                entry(pod, f.pod_port),
            );
        }
        (IpAddr::V6(pod), IpAddr::V6(remote), IpAddr::V6(egress)) => {
            let key = |src: Ipv6Addr, dst: Ipv6Addr, sp: u16, dp_: u16, d| CtKeyV6 {
                src: src.octets(),
                dst: dst.octets(),
                src_port_be: be(sp),
                dst_port_be: be(dp_),
                proto: f.proto,
                dir: d,
                _pad: [0; 2],
            };
            let entry = |addr: Ipv6Addr, port: u16| CtEntryV6 {
                xlate_addr: addr.octets(),
                xlate_port_be: be(port),
                state: st,
                _pad0: 0,
                pod_node: node,
                ifindex,
                rule_id: f.rule,
                _pad1: 0,
                last_seen_ns: now,
                next_hop: Default::default(),
            };
            let mut m: HashMap<&mut MapData, CtKeyV6, CtEntryV6> =
                HashMap::try_from(dp.map(maps::CT_V6)).unwrap();
            m.insert(
                key(pod, remote, f.pod_port, f.remote_port, dir::ORIGINAL),
                entry(egress, f.egress_port),
                0,
            )
            .expect("failed to fill CT_V6");
            m.insert(
                key(remote, egress, f.remote_port, f.egress_port, dir::REPLY),
                entry(pod, f.pod_port),
                0,
            )
            .expect("failed to fill CT_V6");
        }
        _ => panic!("a flow of mixed families: {f:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_answers_like_the_trie() {
        let p = &*V4;
        let pod = p.local_pod;
        assert_eq!(p.policy(pod, p.dest_a).unwrap().rule, RULE_A);
        assert_eq!(
            p.policy(pod, v4(10, 100, 0, 130)).unwrap().action,
            action::EXCLUDE
        );
        assert_eq!(p.policy(pod, p.dest_far).unwrap().rule, RULE_SHARED);
        assert!(p.policy(pod, v4(8, 8, 8, 8)).is_none());
        assert!(p.policy(p.unselected_pod, p.dest_a).is_none());
        let q = &*V6;
        assert_eq!(
            q.policy(q.local_pod, v6(0xfd00, 0x201, 0, 7))
                .unwrap()
                .gateway,
            PEER6
        );
        assert!(q.routes_via(q.dest_far, Dev::Sec0));
        assert!(!q.routes_via(q.dest_b, Dev::Sec0));
    }
}
