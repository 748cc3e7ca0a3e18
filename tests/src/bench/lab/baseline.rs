//! The kernel baselines on the lab's topology: how OVN-Kubernetes implements EgressIP on
//! secondary host networks, rebuilt with `ip rule` and nftables, in two variants
//! ([`Steering`]) that differ only in how w1 carries the pod's packets to gw1.
//!
//! * [`Steering::Underlay`] (the routed baseline): w1 steers the pod's traffic to network
//!   A to gw1 over the underlay (policy routing: `ip rule from <pod> lookup 100`, table
//!   100 `192.168.101.0/24 via <gw1>`). No tunnel, which costs less than any tunnel.
//! * [`Steering::Vxlan`] (the tunneled baseline): the same rule on w1 points table 100 into
//!   a plain kernel VXLAN device between w1 and gw1 ([`VXLAN_DEV`], its own UDP port, MTU
//!   underlay - 50 like ours), and gw1 routes the replies to the pod back into it: the
//!   real OVN-K carries this traffic in Geneve, which this kernel lacks.
//! * [`Steering::VxlanMetadata`] (the tunneled baseline over collect-metadata devices):
//!   the same, with a collect-metadata VXLAN device on each side (`external`, the mode of
//!   ours and of OVN-K's Geneve device: one device for every peer) and the tunnel in the
//!   routes (`encap ip id <vni> dst <peer>`), the tunnel's next hops as static
//!   neighbours. Such a device allocates a metadata dst for every packet it receives and
//!   looks up the outer route of every packet it sends, uncached.
//! * Either way gw1 holds the egress IP on `sec-a`, has one `ip rule from <pod IP> lookup
//!   200 pref 6000` per served pod (table 200: network A via `sec-a`), and SNATs in
//!   nftables postrouting through a map keyed by `ip saddr . oifname`. Replies are
//!   un-SNATed by conntrack and routed back to w1 (main table: over the underlay, or the
//!   tunnel's /32 route to the pod).
//! * All rules share one priority, so the kernel keeps them in creation order; the
//!   measured pod's rule is created last, after the other served pods' rules, and every
//!   packet of the measured flow walks all of them (replies too: they match none).

use std::{net::Ipv4Addr, path::Path};

use anyhow::{Context as _, Result, bail};

use crate::lab::{Lab, addr};

/// Routing table and priority of the steering rule on the worker.
const STEER_TABLE: u32 = 100;
const STEER_PREF: u32 = 1000;
/// Routing table of the per-pod rules on the gateway.
const GW_TABLE: u32 = 200;
/// Priority of every per-pod rule on the gateway (OVN-K uses one fixed priority).
const GW_PREF: u32 = 6000;
const NFT_TABLE: &str = "bench_egress";

/// The pod CIDR that w2's Node lists for the decoy pods in the 10k-pod state (the lab's
/// /24 per node holds 254).
pub const DECOY_CIDR: &str = "10.245.0.0/16";

/// The decoy served pods (`10.245.x.y` in [`DECOY_CIDR`], the same addresses as the
/// 10k-pod state file).
pub fn decoy_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(10, 245, (i / 250) as u8, (i % 250 + 1) as u8)
}

fn rule_for(pod: Ipv4Addr) -> String {
    format!("rule add from {pod} lookup {GW_TABLE} pref {GW_PREF}")
}

/// How w1 carries the measured pod's packets to gw1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Steering {
    /// Routed over the underlay, no tunnel.
    Underlay,
    /// In a kernel VXLAN device between w1 and gw1, both directions.
    Vxlan,
    /// In a collect-metadata kernel VXLAN device on w1 and gw1, the tunnel's key in the
    /// routes.
    VxlanMetadata,
}

/// The tunneled baseline's VXLAN device on w1 and gw1.
pub const VXLAN_DEV: &str = "bvx0";
const VXLAN_VNI: u32 = 4242;
/// Neither the agents' tunnel port (4789) nor their probes' (4790): the agents' devices
/// stay, idle, and hold theirs.
const VXLAN_PORT: u16 = 8472;
/// The tunnel's own addresses (a /30 inside the tunnel: the next hops of the routes).
const W1_TUN: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 1);
const GW1_TUN: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 2);

/// Build a baseline for the measured pod w1-p1 (1 served pod), steered by `steering`.
/// Expects our datapath gone (agents stopped, pins removed) and no other baseline up.
pub fn up(lab: &Lab, steering: Steering) -> Result<()> {
    release_egress_ips(lab)?;
    match steering {
        Steering::Underlay => steer(lab, &format!("via {}", addr::GW1))?,
        Steering::Vxlan => {
            tunnel_up(lab)?;
            steer(lab, &format!("via {GW1_TUN} dev {VXLAN_DEV}"))?;
        }
        Steering::VxlanMetadata => {
            tunnel_metadata_up(lab)?;
            steer(
                lab,
                &format!(
                    "via {GW1_TUN} dev {VXLAN_DEV} onlink encap ip id {VXLAN_VNI} dst {}",
                    addr::GW1
                ),
            )?;
        }
    }
    gateway_up(lab)?;
    // host-a may still map the egress IP to the other gateway's MAC.
    lab.ns("host-a")?.exec("ip", &["neigh", "flush", "all"])?;
    Ok(())
}

/// Remove what [`up`] built (at 1 served pod), so that the other baseline can follow.
pub fn down(lab: &Lab, steering: Steering) -> Result<()> {
    lab.exec("gw1", "nft", &["delete", "table", "ip", NFT_TABLE])
        .context("failed to delete the baseline's nftables table on gw1")?;
    let mut gw = vec![
        format!("rule del pref {GW_PREF}"),
        format!("route flush table {GW_TABLE}"),
        format!("addr del {}/24 dev sec-a", addr::EGRESS_IP_A),
    ];
    let mut w1 = vec![
        format!("rule del pref {STEER_PREF}"),
        format!("route flush table {STEER_TABLE}"),
    ];
    if steering != Steering::Underlay {
        // The routes through the devices go with them.
        gw.push(format!("link del {VXLAN_DEV}"));
        w1.push(format!("link del {VXLAN_DEV}"));
    }
    lab.ns("gw1")?.ip_batch(&gw)?;
    lab.ns("w1")?.ip_batch(&w1)
}

/// The agents may have left the egress IPs on either gateway: one holder only, gw1.
fn release_egress_ips(lab: &Lab) -> Result<()> {
    for gw in ["gw1", "gw2"] {
        for (ip, dev) in [(addr::EGRESS_IP_A, "sec-a"), (addr::EGRESS_IP_B, "sec-b")] {
            let _ = lab
                .ns(gw)?
                .exec_unchecked("ip", &["addr", "del", &format!("{ip}/24"), "dev", dev]);
        }
    }
    Ok(())
}

/// w1: the pod's packets to network A go by table [`STEER_TABLE`], `route_tail` after
/// the prefix (`via <gw1>`, or into the tunnel).
fn steer(lab: &Lab, route_tail: &str) -> Result<()> {
    lab.ns("w1")?.ip_batch(&[
        format!(
            "rule add from {} lookup {STEER_TABLE} pref {STEER_PREF}",
            addr::W1_P1
        ),
        format!("route add {} {route_tail} table {STEER_TABLE}", addr::NET_A),
    ])
}

/// The VXLAN device on w1 and gw1 (point to point over the underlay), and gw1's route
/// back to the pod through it.
fn tunnel_up(lab: &Lab) -> Result<()> {
    for (node, local, remote, tun) in [
        ("w1", addr::W1, addr::GW1, W1_TUN),
        ("gw1", addr::GW1, addr::W1, GW1_TUN),
    ] {
        lab.ns(node)?.ip_batch(&[
            format!(
                "link add {VXLAN_DEV} type vxlan id {VXLAN_VNI} local {local} remote {remote} \
                 dstport {VXLAN_PORT} dev eth0"
            ),
            format!("addr add {tun}/30 dev {VXLAN_DEV}"),
            format!("link set {VXLAN_DEV} up"),
        ])?;
    }
    lab.ns("gw1")?.ip_batch(&[format!(
        "route add {}/32 via {W1_TUN} dev {VXLAN_DEV}",
        addr::W1_P1
    )])
}

/// The collect-metadata VXLAN device on w1 and gw1, each side's tunnel next hop as a
/// static neighbour (ARP does not cross such a device: a reply carries no tunnel key),
/// and gw1's route back to the pod, the tunnel's key in it.
fn tunnel_metadata_up(lab: &Lab) -> Result<()> {
    for (node, tun) in [("w1", W1_TUN), ("gw1", GW1_TUN)] {
        lab.ns(node)?.ip_batch(&[
            format!("link add {VXLAN_DEV} type vxlan external dstport {VXLAN_PORT} dev eth0"),
            format!("addr add {tun}/32 dev {VXLAN_DEV}"),
            format!("link set {VXLAN_DEV} up"),
        ])?;
    }
    let mac = |node: &str| -> Result<String> {
        let out = lab.exec(node, "ip", &["-j", "link", "show", "dev", VXLAN_DEV])?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("failed to parse `ip -j link show {VXLAN_DEV}` on {node}"))?;
        v.pointer("/0/address")
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
            .with_context(|| format!("no address for {VXLAN_DEV} on {node}"))
    };
    let (w1_mac, gw1_mac) = (mac("w1")?, mac("gw1")?);
    lab.ns("w1")?.ip_batch(&[format!(
        "neigh replace {GW1_TUN} lladdr {gw1_mac} dev {VXLAN_DEV}"
    )])?;
    lab.ns("gw1")?.ip_batch(&[
        format!("neigh replace {W1_TUN} lladdr {w1_mac} dev {VXLAN_DEV}"),
        format!(
            "route add {}/32 via {W1_TUN} dev {VXLAN_DEV} onlink encap ip id {VXLAN_VNI} dst {}",
            addr::W1_P1,
            addr::W1
        ),
    ])
}

/// gw1: the egress IP on `sec-a`, the measured pod's rule, and the SNAT map.
fn gateway_up(lab: &Lab) -> Result<()> {
    let pod = addr::W1_P1;
    lab.ns("gw1")?.ip_batch(&[
        format!("addr add {}/24 dev sec-a", addr::EGRESS_IP_A),
        format!("route add {} dev sec-a table {GW_TABLE}", addr::NET_A),
        rule_for(pod),
    ])?;
    let nft = format!(
        "table ip {NFT_TABLE} {{
  map snat_ips {{
    type ipv4_addr . ifname : ipv4_addr
    elements = {{ {pod} . \"sec-a\" : {egress} }}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    snat ip to ip saddr . oifname map @snat_ips
  }}
}}
",
        egress = addr::EGRESS_IP_A
    );
    nft_file(lab, "baseline-1.nft", &nft)
}

/// Packets (received, sent) on `member`'s [`VXLAN_DEV`].
pub fn tunnel_packets(lab: &Lab, member: &str) -> Result<(u64, u64)> {
    link_packets(lab, member, VXLAN_DEV)
}

/// Packets (received, sent) on `member`'s device `dev`.
pub fn link_packets(lab: &Lab, member: &str, dev: &str) -> Result<(u64, u64)> {
    let out = lab.exec(member, "ip", &["-s", "-j", "link", "show", "dev", dev])?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("failed to parse `ip -s -j link show {dev}` on {member}"))?;
    let count = |dir: &str| {
        v.pointer(&format!("/0/stats64/{dir}/packets"))
            .and_then(serde_json::Value::as_u64)
            .with_context(|| format!("no {dir} packet count for {dev} on {member}"))
    };
    Ok((count("rx")?, count("tx")?))
}

/// The routed baseline (up) extended to `pod`, a pod on gw1 itself: its own `ip rule`
/// (created after the others, at the same priority) and SNAT map element, as OVN-K
/// would serve it. No steering: the pod's packets reach gw1 over its veth.
pub fn gateway_pod_up(lab: &Lab, pod: Ipv4Addr) -> Result<()> {
    lab.ns("gw1")?.ip_batch(&[rule_for(pod)])?;
    nft_file(
        lab,
        "baseline-gateway-pod.nft",
        &format!(
            "add element ip {NFT_TABLE} snat_ips {{ {pod} . \"sec-a\" : {} }}\n",
            addr::EGRESS_IP_A
        ),
    )
}

/// Remove what [`gateway_pod_up`] added, so that the routed baseline has its measured
/// pod's rule alone again.
pub fn gateway_pod_down(lab: &Lab, pod: Ipv4Addr) -> Result<()> {
    lab.ns("gw1")?.ip_batch(&[format!(
        "rule del from {pod} lookup {GW_TABLE} pref {GW_PREF}"
    )])?;
    nft_file(
        lab,
        "baseline-gateway-pod-down.nft",
        &format!("delete element ip {NFT_TABLE} snat_ips {{ {pod} . \"sec-a\" }}\n"),
    )
}

/// Run `probe` (traffic from the pod through the baseline) and check that it crossed the
/// tunnel both ways: w1 sent and gw1 received, gw1 sent and w1 received. Returns what
/// was seen.
pub fn verify_tunnel(lab: &Lab, probe: impl FnOnce() -> Result<()>) -> Result<String> {
    let (w1_before, gw1_before) = (tunnel_packets(lab, "w1")?, tunnel_packets(lab, "gw1")?);
    probe()?;
    let (w1_after, gw1_after) = (tunnel_packets(lab, "w1")?, tunnel_packets(lab, "gw1")?);
    let moved = |after: u64, before: u64| after.saturating_sub(before);
    let (w1_tx, gw1_rx) = (
        moved(w1_after.1, w1_before.1),
        moved(gw1_after.0, gw1_before.0),
    );
    let (gw1_tx, w1_rx) = (
        moved(gw1_after.1, gw1_before.1),
        moved(w1_after.0, w1_before.0),
    );
    if [w1_tx, gw1_rx, gw1_tx, w1_rx].contains(&0) {
        bail!(
            "the probe did not cross {VXLAN_DEV} both ways: w1 sent {w1_tx}, gw1 received \
             {gw1_rx}, gw1 sent {gw1_tx}, w1 received {w1_rx} packets"
        );
    }
    Ok(format!(
        "during one probe w1's {VXLAN_DEV} sent {w1_tx} and received {w1_rx} packets, gw1's \
         received {gw1_rx} and sent {gw1_tx}"
    ))
}

/// Grow the baseline to `served` pods: `served - 1` decoy rules and map elements first,
/// then the measured pod's rule again, last.
pub fn scale(lab: &Lab, served: u32) -> Result<()> {
    let pod = addr::W1_P1;
    let gw = lab.ns("gw1")?;
    gw.ip_batch(&[format!(
        "rule del from {pod} lookup {GW_TABLE} pref {GW_PREF}"
    )])?;
    let mut lines: Vec<String> = (0..served.saturating_sub(1))
        .map(|i| rule_for(decoy_ip(i)))
        .collect();
    lines.push(rule_for(pod));
    gw.ip_batch(&lines)?;
    let mut nft = String::new();
    for chunk in (0..served.saturating_sub(1))
        .collect::<Vec<_>>()
        .chunks(1000)
    {
        let elems: Vec<String> = chunk
            .iter()
            .map(|i| format!("{} . \"sec-a\" : {}", decoy_ip(*i), addr::EGRESS_IP_A))
            .collect();
        nft.push_str(&format!(
            "add element ip {NFT_TABLE} snat_ips {{ {} }}\n",
            elems.join(", ")
        ));
    }
    nft_file(lab, &format!("baseline-{served}.nft"), &nft)?;
    let rules = count_lines(lab, "gw1", &["rule", "show", "pref", &GW_PREF.to_string()])?;
    if rules != served as usize {
        bail!("gw1 has {rules} rules at pref {GW_PREF}, expected {served}");
    }
    Ok(())
}

fn count_lines(lab: &Lab, member: &str, ip_args: &[&str]) -> Result<usize> {
    let out = lab.exec(member, "ip", ip_args)?;
    Ok(String::from_utf8_lossy(&out.stdout).lines().count())
}

fn nft_file(lab: &Lab, name: &str, text: &str) -> Result<()> {
    let path = lab.dir().join(name);
    std::fs::write(&path, text).with_context(|| format!("failed to write {}", path.display()))?;
    lab.exec("gw1", "nft", &["-f", &path_str(&path)])
        .with_context(|| format!("failed to load {name} into nftables on gw1"))?;
    Ok(())
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// The number of elements in the SNAT map (for the report).
pub fn map_elements(lab: &Lab) -> Result<usize> {
    let out = lab.exec(
        "gw1",
        "nft",
        &["-j", "list", "map", "ip", NFT_TABLE, "snat_ips"],
    )?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(v.pointer("/nftables/1/map/elem")
        .and_then(serde_json::Value::as_array)
        .map_or(0, Vec::len))
}
