//! The kernel baseline on the lab's topology: how OVN-Kubernetes implements EgressIP on
//! secondary host networks, rebuilt with `ip rule` and nftables.
//!
//! * w1 steers the pod's traffic to network A to gw1 over the underlay (policy routing:
//!   `ip rule from <pod> lookup 100`, table 100 `192.168.101.0/24 via <gw1>`). No tunnel:
//!   the real OVN-K carries it in Geneve between the nodes' OVS bridges; here it is plain
//!   routing, which costs less than any tunnel.
//! * gw1 holds the egress IP on `sec-a`, has one `ip rule from <pod IP> lookup 200
//!   pref 6000` per served pod (table 200: network A via `sec-a`), and SNATs in nftables
//!   postrouting through a map keyed by `ip saddr . oifname`. Replies are un-SNATed by
//!   conntrack and routed back to w1 over the underlay (main table).
//! * All rules share one priority, so the kernel keeps them in creation order; the
//!   measured pod's rule is created last, after the other served pods' rules, and every
//!   packet of the measured flow walks all of them (replies too: they match none).

use std::{net::Ipv4Addr, path::Path};

use anyhow::{Context as _, Result, bail};

use crate::lab::{Lab, addr};

/// Routing table of the steering rule on the worker.
const STEER_TABLE: u32 = 100;
/// Routing table of the per-pod rules on the gateway.
const GW_TABLE: u32 = 200;
/// Priority of every per-pod rule on the gateway (OVN-K uses one fixed priority).
const GW_PREF: u32 = 6000;
const NFT_TABLE: &str = "bench_egress";

/// The decoy served pods (`10.245.x.y`, the same addresses as the 10k-pod state file).
pub fn decoy_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(10, 245, (i / 250) as u8, (i % 250 + 1) as u8)
}

fn rule_for(pod: Ipv4Addr) -> String {
    format!("rule add from {pod} lookup {GW_TABLE} pref {GW_PREF}")
}

/// Build the baseline for the measured pod w1-p1 (1 served pod). Expects our datapath
/// gone (agents stopped, pins removed).
pub fn up(lab: &Lab) -> Result<()> {
    let pod = addr::W1_P1;
    // The agents may have left the egress IPs on either gateway: one holder only, gw1.
    for gw in ["gw1", "gw2"] {
        for (ip, dev) in [(addr::EGRESS_IP_A, "sec-a"), (addr::EGRESS_IP_B, "sec-b")] {
            let _ = lab
                .ns(gw)?
                .exec_unchecked("ip", &["addr", "del", &format!("{ip}/24"), "dev", dev]);
        }
    }
    lab.ns("w1")?.ip_batch(&[
        format!("rule add from {pod} lookup {STEER_TABLE} pref 1000"),
        format!(
            "route add {} via {} table {STEER_TABLE}",
            addr::NET_A,
            addr::GW1
        ),
    ])?;
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
    nft_file(lab, "baseline-1.nft", &nft)?;
    // host-a may still map the egress IP to the other gateway's MAC.
    lab.ns("host-a")?.exec("ip", &["neigh", "flush", "all"])?;
    Ok(())
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
