//! `egress-agent doctor`: a preflight of one node, also run by the agent at start. One
//! line per check, `ok` / `warn` / `fail`, each naming what it found and what to do:
//!
//! * the kernel ([`kernel`]): BTF, TCX links or legacy tc, the map types, the programs
//!   (loaded: the verifier's word on each helper), the BPF JIT;
//! * the host ([`host`]): bpffs at the pin directory, capabilities, the tunnel port,
//!   rp_filter on the secondary interfaces, MTU headroom for the tunnel;
//! * Open vSwitch's hardware offload ([`offload`]), which lets offloaded flows skip the
//!   TC hooks;
//! * the egress IPs this node may hold (policies whose gatewaySelector matches it, or
//!   `--egress-ip`): each one's subnet on an up interface, and nobody else answering for
//!   it ([`dad`], which the agent also runs before it claims an address).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
};

use ipnet::IpNet;

pub use crate::api::{PreflightCheck as Check, PreflightResult as Level};
use crate::{
    compiler::{self, Selector},
    iface::{self, Interface},
    source::ClusterView,
};

pub mod dad;
pub mod host;
pub mod kernel;
pub mod offload;

/// What `doctor` checks against.
#[derive(Clone, Debug)]
pub struct Settings {
    pub bpffs_dir: PathBuf,
    pub tunnel_device: String,
    pub tunnel_port: u16,
    pub tunnel_mtu: Option<u32>,
    /// This node's name in the cluster state; inferred from the node addresses when None.
    pub node_name: Option<String>,
    /// Egress IPs to check besides those of the policies that select this node.
    pub egress_ips: Vec<IpAddr>,
    /// Whether to probe the network for each egress IP not held here ([`dad`]).
    pub dad: Dad,
    /// Whether to load the agent's programs to check them (`doctor`; the agent's own
    /// preflight skips it: it loads them itself right after).
    pub load_programs: bool,
    /// OVSDB's socket, asked whether Open vSwitch offloads flows to the NIC ([`offload`]).
    pub ovsdb: PathBuf,
}

/// When duplicate address detection runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dad {
    /// Now, for each egress IP held nowhere (`doctor`).
    Now,
    /// Not at all (`--no-dad`).
    Off,
    /// When the agent claims an address (the agent's own preflight: no line).
    WhenClaimed,
}

pub(crate) fn check(level: Level, name: &str, message: String) -> Check {
    Check {
        check: name.to_owned(),
        result: level,
        message,
    }
}

pub(crate) fn ok(name: &str, message: String) -> Check {
    check(Level::Ok, name, message)
}

pub(crate) fn warn(name: &str, message: String) -> Check {
    check(Level::Warn, name, message)
}

pub(crate) fn fail(name: &str, message: String) -> Check {
    check(Level::Fail, name, message)
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Fail => "fail",
        })
    }
}

/// `ok    check    message`, as `doctor` prints it.
pub fn line(c: &Check) -> String {
    format!("{:<5} {:<32} {}", c.result.to_string(), c.check, c.message)
}

/// An egress IP this node may hold, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Candidate {
    ip: IpAddr,
    /// `policy payments rules[0]`, or `--egress-ip`.
    from: String,
    /// The interface the rule names, if any.
    interface: Option<String>,
}

/// Run every check (in the network namespace of the calling thread): the kernel, the
/// host, then each egress IP of `view` (the cluster state) this node may hold.
pub async fn run(s: &Settings, view: Option<&ClusterView>) -> Vec<Check> {
    let mut out = kernel_checks(s);
    let (nl, ifaces) = match interfaces().await {
        Ok(found) => found,
        Err(e) => {
            out.push(fail("interfaces", e));
            return out;
        }
    };
    out.push(tunnel_port(&nl, s).await);
    out.push(offload::verdict(&s.ovsdb, &offload::probe(&s.ovsdb).await));

    let me = s
        .node_name
        .clone()
        .or_else(|| view.and_then(|v| infer_node(v, &ifaces)));
    let node_ip = view.zip(me.as_deref()).and_then(|(v, me)| {
        v.nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(me))
            .and_then(|n| compiler::node_underlay(n, &held_in(v)))
    });
    let routes = nl.routes(&[]).await.ok();
    let underlay = underlay_interface(&ifaces, node_ip, routes.as_ref());
    out.push(mtu(
        s,
        &ifaces,
        underlay,
        node_ip,
        view,
        me.as_deref(),
        routes.as_ref(),
    ));
    if let (Some(ul), Some(v), Some(routes)) = (underlay, view, routes.as_ref()) {
        out.push(underlay_routes(ul, v, me.as_deref(), routes, &ifaces));
    }
    let (candidates, gateway) = candidates(s, view, me.as_deref());
    let placed: Vec<(Candidate, Option<&Interface>)> = candidates
        .into_iter()
        .map(|c| {
            let i = subnet_interface(&ifaces, &c);
            (c, i)
        })
        .collect();
    let egress: Option<BTreeSet<&str>> = (view.is_some() || !s.egress_ips.is_empty()).then(|| {
        placed
            .iter()
            .filter_map(|(c, i)| c.interface.as_deref().or(i.map(|i| i.name.as_str())))
            .collect()
    });
    out.extend(rp_filters(
        &ifaces,
        underlay,
        &s.tunnel_device,
        egress.as_ref(),
    ));
    out.extend(forwardings(underlay, &s.tunnel_device, egress.as_ref()));
    out.extend(egress_ip_checks(s, view, me.as_deref(), gateway, &placed, &ifaces).await);
    out
}

/// The kernel's and the host's checks, before any interface is read.
fn kernel_checks(s: &Settings) -> Vec<Check> {
    let mut out = vec![
        kernel::btf(),
        kernel::attach(),
        kernel::lpm_trie(),
        kernel::map_types(),
    ];
    if s.load_programs {
        out.push(kernel::programs());
    }
    out.extend([
        kernel::jit(),
        host::bpffs(&s.bpffs_dir),
        host::capabilities(&std::fs::read_to_string("/proc/self/status").unwrap_or_default()),
    ]);
    out
}

/// Whether every peer's address is routed out of the underlay interface `ul`.
fn underlay_routes(
    ul: &Interface,
    view: &ClusterView,
    me: Option<&str>,
    routes: &iface::Routes,
    ifaces: &[Interface],
) -> Check {
    let peers = peer_addresses(view, me);
    let astray = host::underlay_astray(&ul.name, &peers, |ip| {
        let oif = routes.oif(ip)?;
        ifaces
            .iter()
            .find(|i| i.ifindex == oif)
            .map(|i| i.name.clone())
    });
    host::underlay_routes_verdict(&ul.name, peers.len(), &astray)
}

/// IPv4 forwarding on each device the datapath looks routes up from: the tunnel device
/// (packets decapsulated there), the underlay (`from_underlay`'s fast path) and the egress
/// interfaces (a gateway's lookups out of them and of replies arriving on them). The
/// tunnel device is left out while it does not exist (the agent creates it).
fn forwardings(
    underlay: Option<&Interface>,
    tunnel: &str,
    egress: Option<&BTreeSet<&str>>,
) -> Vec<Check> {
    let mut devices: Vec<(&str, &str)> = Vec::new();
    if std::path::Path::new("/proc/sys/net/ipv4/conf")
        .join(tunnel)
        .exists()
    {
        devices.push((tunnel, "tunnel device"));
    }
    if let Some(u) = underlay {
        devices.push((&u.name, "underlay"));
    }
    for e in egress.into_iter().flatten() {
        if !devices.iter().any(|(d, _)| d == e) {
            devices.push((e, "egress interface"));
        }
    }
    devices
        .into_iter()
        .map(|(name, role)| host::forwarding_verdict(name, role, host::read_forwarding(name)))
        .collect()
}

/// The netlink handle and this host's interfaces.
async fn interfaces() -> Result<(iface::Netlink, Vec<Interface>), String> {
    let nl = iface::Netlink::new().map_err(|e| e.to_string())?;
    let ifaces = nl.interfaces().await.map_err(|e| e.to_string())?;
    Ok((nl, ifaces))
}

/// The checks of each egress IP this node may hold (`placed`: with the interface whose
/// subnet contains it), or why there are none.
async fn egress_ip_checks(
    s: &Settings,
    view: Option<&ClusterView>,
    me: Option<&str>,
    gateway: bool,
    placed: &[(Candidate, Option<&Interface>)],
    ifaces: &[Interface],
) -> Vec<Check> {
    let mut out = Vec::new();
    match (view.is_some() || !s.egress_ips.is_empty(), gateway) {
        (false, _) => out.push(warn(
            "egress-ips",
            "not checked: pass --state-dir (and --node-name) or --egress-ip".to_owned(),
        )),
        (true, false) if placed.is_empty() => out.push(ok(
            "egress-ips",
            format!(
                "node {} is no gateway (no policy's gatewaySelector matches it): no egress IP \
                 to hold",
                me.unwrap_or("?")
            ),
        )),
        _ => {}
    }
    let held_elsewhere = held_by_others(view, me);
    for (c, i) in placed {
        out.push(subnet_check(c, *i));
        if let Some(i) = i
            && s.dad != Dad::WhenClaimed
        {
            out.push(duplicate_check(s, c.ip, i, ifaces, &held_elsewhere).await);
        }
    }
    out
}

/// The underlay address of every Node but `me`, by name.
pub(crate) fn peer_addresses(view: &ClusterView, me: Option<&str>) -> Vec<(String, IpAddr)> {
    let held = held_in(view);
    view.nodes
        .iter()
        .filter(|n| n.metadata.name.as_deref() != me)
        .filter_map(|n| Some((n.metadata.name.clone()?, compiler::node_underlay(n, &held)?)))
        .collect()
}

/// The egress IPs the view's EgressNodes say are held (the doctor hears no hellos).
fn held_in(view: &ClusterView) -> BTreeSet<IpAddr> {
    compiler::held_egress_ips(view, &crate::liveness::PeerView::default())
}

/// The Node whose addresses include one of this host's.
fn infer_node(view: &ClusterView, ifaces: &[Interface]) -> Option<String> {
    let local: BTreeSet<IpAddr> = ifaces
        .iter()
        .flat_map(|i| i.addresses.iter().map(|(a, _)| *a))
        .collect();
    let held = held_in(view);
    view.nodes
        .iter()
        .find(|n| compiler::node_underlay(n, &held).is_some_and(|ip| local.contains(&ip)))
        .and_then(|n| n.metadata.name.clone())
}

/// The interface with the node's underlay address, else the one of the default route,
/// else the up interface with the largest MTU (what the agent sizes the tunnel from).
fn underlay_interface<'a>(
    ifaces: &'a [Interface],
    node_ip: Option<IpAddr>,
    routes: Option<&iface::Routes>,
) -> Option<&'a Interface> {
    let by_ip = node_ip.and_then(|ip| {
        ifaces
            .iter()
            .find(|i| i.addresses.iter().any(|(a, _)| *a == ip))
    });
    let by_route = || {
        let r = routes?;
        let oif = r
            .oif(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
            .or_else(|| r.oif(IpAddr::V6(Ipv6Addr::UNSPECIFIED)))?;
        ifaces.iter().find(|i| i.ifindex == oif)
    };
    by_ip.or_else(by_route).or_else(|| {
        ifaces
            .iter()
            .filter(|i| i.up && i.name != "lo")
            .max_by_key(|i| i.mtu)
    })
}

async fn tunnel_port(nl: &iface::Netlink, s: &Settings) -> Check {
    let state = match host::bind_test(s.tunnel_port) {
        Ok(()) => host::PortState::Free,
        Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => {
            let devices = nl.vxlan_ports().await.unwrap_or_default();
            host::PortState::Taken {
                device: devices
                    .into_iter()
                    .find(|(_, p)| *p == s.tunnel_port)
                    .map(|(d, _)| d),
                process: host::udp_port_owner(s.tunnel_port),
            }
        }
        Err(e) => host::PortState::Unknown(e.to_string()),
    };
    host::tunnel_port_verdict(s.tunnel_port, &s.tunnel_device, &state)
}

fn mtu(
    s: &Settings,
    ifaces: &[Interface],
    underlay: Option<&Interface>,
    node_ip: Option<IpAddr>,
    view: Option<&ClusterView>,
    me: Option<&str>,
    routes: Option<&iface::Routes>,
) -> Check {
    let Some(ul) = underlay else {
        return warn("mtu", "no up interface to carry the tunnel".to_owned());
    };
    let v6 = match node_ip {
        Some(ip) => ip.is_ipv6(),
        None => !ul.addresses.iter().any(|(a, _)| a.is_ipv4()),
    };
    let largest = ifaces
        .iter()
        .filter(|i| i.up && i.name != "lo" && i.name != s.tunnel_device)
        .map(|i| i.mtu)
        .max()
        .unwrap_or(ul.mtu);
    let overhead = if v6 {
        iface::VXLAN_OVERHEAD_V6
    } else {
        iface::VXLAN_OVERHEAD
    };
    // Pods of this node, by the device their host route leaves from.
    let pods = view.zip(me).zip(routes).and_then(|((v, me), r)| {
        v.pods
            .iter()
            .filter(|p| p.node_name.as_deref() == Some(me) && !p.host_network)
            .flat_map(|p| p.ips.iter())
            .filter_map(|ip| r.oif(*ip))
            .filter_map(|oif| {
                ifaces
                    .iter()
                    .find(|i| i.ifindex == oif && i.ifindex != ul.ifindex)
            })
            .max_by_key(|i| i.mtu)
            .map(|i| (i.name.clone(), i.mtu))
    });
    host::mtu_verdict(&host::Mtus {
        underlay: (ul.name.clone(), ul.mtu),
        underlay_v6: v6,
        tunnel: s.tunnel_mtu.unwrap_or(largest.saturating_sub(overhead)),
        pods,
    })
}

/// The egress IPs this node may hold: every rule's egressIP of the policies whose
/// gatewaySelector matches it, then `--egress-ip`; and whether any policy selects it.
fn candidates(
    s: &Settings,
    view: Option<&ClusterView>,
    me: Option<&str>,
) -> (Vec<Candidate>, bool) {
    let mut out = Vec::new();
    let mut gateway = false;
    let labels = view.zip(me).and_then(|(v, me)| {
        v.nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(me))
            .map(|n| n.metadata.labels.clone().unwrap_or_default())
    });
    if let (Some(v), Some(labels)) = (view, labels) {
        for p in &v.policies {
            let Ok(sel) = Selector::gateways(&p.spec.gateway_selector) else {
                continue;
            };
            if !sel.matches(&labels) {
                continue;
            }
            gateway = true;
            let name = p.metadata.name.as_deref().unwrap_or("?");
            for (i, r) in p.spec.rules.iter().enumerate() {
                let ips = r.egress_ip.iter().chain(&r.egress_ips);
                for ip in ips.filter_map(|t| t.parse().ok()) {
                    out.push(Candidate {
                        ip,
                        from: format!("policy {name} rules[{i}]"),
                        interface: r.interface.clone(),
                    });
                }
            }
        }
    }
    for ip in &s.egress_ips {
        out.push(Candidate {
            ip: *ip,
            from: "--egress-ip".to_owned(),
            interface: None,
        });
    }
    let mut seen = BTreeSet::new();
    out.retain(|c| seen.insert(c.ip));
    (out, gateway)
}

/// The up interface (the rule's, if it names one) with a subnet that contains `c.ip`,
/// other than the address itself.
fn subnet_interface<'a>(ifaces: &'a [Interface], c: &Candidate) -> Option<&'a Interface> {
    ifaces
        .iter()
        .filter(|i| i.up && c.interface.as_ref().is_none_or(|n| *n == i.name))
        .find(|i| {
            i.addresses.iter().any(|(a, len)| {
                *a != c.ip && IpNet::new(*a, *len).is_ok_and(|n| n.trunc().contains(&c.ip))
            })
        })
}

fn subnet_check(c: &Candidate, i: Option<&Interface>) -> Check {
    let name = format!("egress-ip {}", c.ip);
    match i {
        Some(i) => {
            let subnet = i
                .addresses
                .iter()
                .filter_map(|(a, l)| IpNet::new(*a, *l).ok())
                .map(|n| n.trunc())
                .find(|n| n.contains(&c.ip))
                .map(|n| n.to_string())
                .unwrap_or_default();
            ok(&name, format!("{}: on {} ({subnet}, up)", c.from, i.name))
        }
        None => {
            let on = match &c.interface {
                Some(n) => format!("interface {n} (named by the rule) is missing, down, or has"),
                None => "no up interface of this node has".to_owned(),
            };
            fail(
                &name,
                format!(
                    "{}: {on} an address in its subnet, so this node cannot hold it: give the \
                     interface on that network an address in the subnet (and bring it up), \
                     or keep this node out of the policy's gatewaySelector",
                    c.from
                ),
            )
        }
    }
}

/// Egress IPs the cluster state says another node holds, with that node.
fn held_by_others(view: Option<&ClusterView>, me: Option<&str>) -> BTreeMap<IpAddr, String> {
    let mut out = BTreeMap::new();
    for en in view.iter().flat_map(|v| v.egress_nodes.iter()) {
        let Some(name) = en.metadata.name.as_deref() else {
            continue;
        };
        if Some(name) == me {
            continue;
        }
        for h in en.status.iter().flat_map(|s| s.egress_ips.iter()) {
            if let Ok(ip) = h.ip.parse() {
                out.insert(ip, name.to_owned());
            }
        }
    }
    out
}

async fn duplicate_check(
    s: &Settings,
    ip: IpAddr,
    i: &Interface,
    ifaces: &[Interface],
    held_elsewhere: &BTreeMap<IpAddr, String>,
) -> Check {
    let name = format!("duplicate-address {ip}");
    if let Some(h) = ifaces
        .iter()
        .find(|h| h.addresses.iter().any(|(a, _)| *a == ip))
    {
        return ok(&name, format!("held by this node on {}", h.name));
    }
    if let Some(node) = held_elsewhere.get(&ip) {
        return ok(
            &name,
            format!("held by gateway {node} (its EgressNode): not probed"),
        );
    }
    if s.dad == Dad::Off {
        return ok(&name, "not probed (--no-dad)".to_owned());
    }
    let Some(mac) = i.mac else {
        return warn(
            &name,
            format!("not probed: {} has no Ethernet address", i.name),
        );
    };
    let how = if ip.is_ipv4() {
        "ARP probes"
    } else {
        "DAD neighbour solicitations"
    };
    match dad::probe(i.ifindex, mac, ip).await {
        Ok(None) => ok(
            &name,
            format!(
                "no answer to {} {how} on {} within {} ms",
                dad::PROBES,
                i.name,
                dad::BUDGET.as_millis()
            ),
        ),
        Ok(Some(holder)) => fail(&name, in_use_message(ip, &i.name, holder)),
        Err(e) => warn(&name, format!("{e}")),
    }
}

/// What the doctor and the agent say of an egress IP another host answers for.
pub fn in_use_message(ip: IpAddr, interface: &str, holder: [u8; 6]) -> String {
    format!(
        "{ip} is in use on the network of {interface}: MAC {} answered a duplicate address \
         probe for it; the agent does not claim it while anyone answers. Remove the \
         address from that host, or give the policy another egressIP",
        dad::mac_string(holder)
    )
}

/// rp_filter of each secondary interface (up, with an address that is not link-local,
/// neither the loopback, the tunnel nor the underlay) and of each egress interface.
/// `egress`: the interfaces egress IPs use, or None when unknown (then every secondary
/// interface counts as one).
fn rp_filters(
    ifaces: &[Interface],
    underlay: Option<&Interface>,
    tunnel: &str,
    egress: Option<&BTreeSet<&str>>,
) -> Vec<Check> {
    let all = host::read_rp_filter("all").unwrap_or(0);
    let routable = |a: &IpAddr| match a {
        IpAddr::V4(v4) => !v4.is_link_local() && !v4.is_loopback(),
        IpAddr::V6(v6) => !v6.is_unicast_link_local() && !v6.is_loopback(),
    };
    ifaces
        .iter()
        .filter(|i| {
            let is_egress = egress.is_some_and(|e| e.contains(i.name.as_str()));
            let secondary = i.up
                && i.name != "lo"
                && i.name != tunnel
                && underlay.is_none_or(|u| u.ifindex != i.ifindex)
                && i.addresses.iter().any(|(a, _)| routable(a));
            is_egress || secondary
        })
        .filter_map(|i| {
            let dev = host::read_rp_filter(&i.name)?;
            let is_egress = egress.is_none_or(|e| e.contains(i.name.as_str()));
            Some(host::rp_filter_verdict(&i.name, all, dev, is_egress))
        })
        .collect()
}
