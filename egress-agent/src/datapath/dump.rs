//! `egress-agent maps`: the pinned maps of an agent, in human terms.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
};

use aya::maps::{Array, HashMap, LpmTrie, Map, MapData, PerCpuArray, PerCpuHashMap};
use egress_common::{
    config::Config,
    conntrack::{CtEntryV4, CtEntryV6, CtKeyV4, CtKeyV6, dir},
    counters::{self, Counter},
    maps as names,
    policy::{
        AdmittedKeyV4, AdmittedKeyV6, AdmittedValue, DestValue, DestValueV6, EgressIpValue,
        NodeValue, PodOwnerValue, PolicyKeyV4, PolicyKeyV6, PolicyValue, PolicyValueV6,
        RuleValueV4, RuleValueV6, SelectedValue, SelectedValueV6, action, egress_ip_flags,
    },
    underlay::{self, Underlay},
};

use super::{Error, Result};

fn open(pin_dir: &Path, name: &'static str) -> Result<Map> {
    let data =
        MapData::from_pin(pin_dir.join(name)).map_err(|source| Error::Map { name, source })?;
    Map::from_map_data(data).map_err(|source| Error::Map { name, source })
}

fn ip(a: [u8; 4]) -> Ipv4Addr {
    Ipv4Addr::from(a)
}

/// An underlay address as written (IPv4-mapped ones as IPv4).
fn node(a: Underlay) -> IpAddr {
    underlay::to_ip(&a)
}

fn ip6(a: [u8; 16]) -> Ipv6Addr {
    Ipv6Addr::from(a)
}

/// Is the (optional) map pinned? The IPv6 maps exist only with an object that has them.
fn pinned(pin_dir: &Path, name: &str) -> bool {
    pin_dir.join(name).exists()
}

fn action_name(a: u8) -> &'static str {
    match a {
        action::FORWARD => "forward",
        action::EXCLUDE => "except: pass",
        action::NO_GATEWAY_DROP => "no gateway: drop",
        action::NO_GATEWAY_PASS => "no gateway: pass",
        _ => "unknown: drop",
    }
}

/// Counters summed over CPUs, by reason number; reasons never hit are left out.
pub fn counters(pin_dir: &Path) -> Result<Vec<(u32, Counter)>> {
    let name = names::COUNTERS;
    let map: PerCpuArray<MapData, Counter> = PerCpuArray::try_from(open(pin_dir, name)?)
        .map_err(|source| Error::Map { name, source })?;
    let mut out = Vec::new();
    for &(reason, _, _) in counters::ALL {
        let per_cpu = map
            .get(&reason, 0)
            .map_err(|source| Error::Map { name, source })?;
        let sum = per_cpu.iter().fold(Counter::default(), |a, c| Counter {
            packets: a.packets + c.packets,
            bytes: a.bytes + c.bytes,
        });
        if sum.packets > 0 {
            out.push((reason, sum));
        }
    }
    Ok(out)
}

/// New flows refused as `DROP_PORT_EXHAUSTED` or `DROP_POD_FLOW_LIMIT`, by pod (summed
/// over CPUs), most first.
pub fn exhausted(pin_dir: &Path) -> Result<Vec<(IpAddr, u64)>> {
    fn read<K: aya::Pod>(
        pin_dir: &Path,
        name: &'static str,
        addr: fn(K) -> IpAddr,
        out: &mut Vec<(IpAddr, u64)>,
    ) -> Result<()> {
        // An object older than the map has none pinned.
        if !pinned(pin_dir, name) {
            return Ok(());
        }
        let m: PerCpuHashMap<MapData, K, u64> = PerCpuHashMap::try_from(open(pin_dir, name)?)
            .map_err(|source| Error::Map { name, source })?;
        for (k, per_cpu) in m.iter().flatten() {
            out.push((addr(k), per_cpu.iter().sum()));
        }
        Ok(())
    }
    let mut out = Vec::new();
    read::<[u8; 4]>(pin_dir, names::EXHAUSTED_V4, |a| ip(a).into(), &mut out)?;
    read::<[u8; 16]>(pin_dir, names::EXHAUSTED_V6, |a| ip6(a).into(), &mut out)?;
    out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    Ok(out)
}

fn write_exhausted(s: &mut String, rows: &[(IpAddr, u64)]) {
    let _ = writeln!(
        s,
        "\nnew flows refused, by pod (no SNAT port free: DROP_PORT_EXHAUSTED; over \
         --max-flows-per-pod: DROP_POD_FLOW_LIMIT): {}",
        rows.len()
    );
    for (pod, n) in rows {
        let _ = writeln!(s, "  {:<40} {n:>10}", pod.to_string());
    }
}

/// Entries per map (for metrics).
pub fn sizes(pin_dir: &Path) -> Result<Vec<(&'static str, usize)>> {
    let mut out = Vec::new();
    let name = names::POLICY_V4;
    let t: HashMap<MapData, PolicyKeyV4, PolicyValue> =
        HashMap::try_from(open(pin_dir, name)?).map_err(|source| Error::Map { name, source })?;
    out.push((name, t.keys().count()));
    if pinned(pin_dir, names::DESTS_V4) {
        let name = names::DESTS_V4;
        let t: LpmTrie<MapData, [u8; 4], DestValue> = LpmTrie::try_from(open(pin_dir, name)?)
            .map_err(|source| Error::Map { name, source })?;
        out.push((name, t.keys().count()));
    }
    fn count<K: aya::Pod, V: aya::Pod>(pin_dir: &Path, name: &'static str) -> Result<usize> {
        let m: HashMap<MapData, K, V> = HashMap::try_from(open(pin_dir, name)?)
            .map_err(|source| Error::Map { name, source })?;
        Ok(m.keys().count())
    }
    out.push((
        names::SELECTED_V4,
        count::<[u8; 4], SelectedValue>(pin_dir, names::SELECTED_V4)?,
    ));
    out.push((
        names::RULES_V4,
        count::<u32, RuleValueV4>(pin_dir, names::RULES_V4)?,
    ));
    out.push((
        names::NODES,
        count::<Underlay, NodeValue>(pin_dir, names::NODES)?,
    ));
    out.push((
        names::POD_OWNER_V4,
        count::<[u8; 4], PodOwnerValue>(pin_dir, names::POD_OWNER_V4)?,
    ));
    out.push((
        names::CT_V4,
        count::<CtKeyV4, CtEntryV4>(pin_dir, names::CT_V4)?,
    ));
    out.push((
        names::EGRESS_IPS_V4,
        count::<[u8; 4], EgressIpValue>(pin_dir, names::EGRESS_IPS_V4)?,
    ));
    if pinned(pin_dir, names::POLICY_V6) {
        let name = names::POLICY_V6;
        let t: HashMap<MapData, PolicyKeyV6, PolicyValueV6> =
            HashMap::try_from(open(pin_dir, name)?)
                .map_err(|source| Error::Map { name, source })?;
        out.push((name, t.keys().count()));
    }
    if pinned(pin_dir, names::DESTS_V6) {
        let name = names::DESTS_V6;
        let t: LpmTrie<MapData, [u8; 16], DestValueV6> = LpmTrie::try_from(open(pin_dir, name)?)
            .map_err(|source| Error::Map { name, source })?;
        out.push((name, t.keys().count()));
    }
    for (name, n) in [
        (
            names::SELECTED_V6,
            count::<[u8; 16], SelectedValueV6> as fn(_, _) -> _,
        ),
        (names::RULES_V6, count::<u32, RuleValueV6>),
        (names::POD_OWNER_V6, count::<[u8; 16], PodOwnerValue>),
        (names::CT_V6, count::<CtKeyV6, CtEntryV6>),
        (names::EGRESS_IPS_V6, count::<[u8; 16], EgressIpValue>),
        (names::ADMITTED_V4, count::<AdmittedKeyV4, AdmittedValue>),
        (names::ADMITTED_V6, count::<AdmittedKeyV6, AdmittedValue>),
    ] {
        if pinned(pin_dir, name) {
            out.push((name, n(pin_dir, name)?));
        }
    }
    Ok(out)
}

/// Are an agent's maps pinned under `pin_dir`? (Its configuration map is pinned first.)
pub fn has_maps(pin_dir: &Path) -> bool {
    pinned(pin_dir, names::CONFIG)
}

/// The dedicated egress IPs in the pinned maps, with the ifindex they serve: addresses
/// an agent added to this node's interfaces (shared ones are the interface's own address).
pub fn dedicated_egress_ips(pin_dir: &Path) -> Result<Vec<(IpAddr, u32)>> {
    fn read<K: aya::Pod>(pin_dir: &Path, name: &'static str) -> Result<Vec<(IpAddr, u32)>>
    where
        IpAddr: From<K>,
    {
        if !pinned(pin_dir, name) {
            return Ok(Vec::new());
        }
        let m: HashMap<MapData, K, EgressIpValue> = HashMap::try_from(open(pin_dir, name)?)
            .map_err(|source| Error::Map { name, source })?;
        Ok(m.iter()
            .flatten()
            .filter(|(_, v)| v.flags & egress_ip_flags::SHARED == 0)
            .map(|(k, v)| (IpAddr::from(k), v.ifindex))
            .collect())
    }
    let mut out = read::<[u8; 4]>(pin_dir, names::EGRESS_IPS_V4)?;
    out.extend(read::<[u8; 16]>(pin_dir, names::EGRESS_IPS_V6)?);
    out.sort();
    Ok(out)
}

/// The whole state of one agent's maps as text.
pub fn render(pin_dir: &Path) -> Result<String> {
    if !has_maps(pin_dir) {
        return Err(Error::NoAgent {
            dir: pin_dir.to_owned(),
        });
    }
    let mut s = String::new();
    let name = names::CONFIG;
    let cfg: Array<MapData, Config> =
        Array::try_from(open(pin_dir, name)?).map_err(|source| Error::Map { name, source })?;
    let c = cfg
        .get(&0, 0)
        .map_err(|source| Error::Map { name, source })?;
    let _ = writeln!(
        s,
        "node {}  tunnel ifindex {}  SNAT ports {}-{}  tunnel MTU {}  {}",
        node(c.node_ip),
        c.tunnel_ifindex,
        c.port_min,
        c.port_max,
        c.tunnel_mtu,
        if c.flags & egress_common::config::flags::READY != 0 {
            "ready"
        } else {
            "NOT READY"
        }
    );

    let name = names::POLICY_V4;
    let t: HashMap<MapData, PolicyKeyV4, PolicyValue> =
        HashMap::try_from(open(pin_dir, name)?).map_err(|source| Error::Map { name, source })?;
    let mut rows: Vec<_> = t.iter().flatten().collect();
    rows.sort_by_key(|(k, _)| *k);
    let _ = writeln!(
        s,
        "\npolicy (pod, destination -> action, gateway, egress IP, rule): {}",
        rows.len()
    );
    for (k, v) in rows {
        let act = action_name(v.action);
        let _ = writeln!(
            s,
            "  {:<15} {:>18} -> {:<17} gw {:<15} egress {:<15} rule {}",
            ip(k.pod).to_string(),
            format!("{}/{}", ip(k.dst), k.dst_len),
            act,
            node(v.gateway).to_string(),
            ip(v.egress_ip).to_string(),
            v.rule_id
        );
    }

    let name = names::RULES_V4;
    let r: HashMap<MapData, u32, RuleValueV4> =
        HashMap::try_from(open(pin_dir, name)?).map_err(|source| Error::Map { name, source })?;
    let mut rows: Vec<_> = r.iter().flatten().collect();
    rows.sort_by_key(|(k, _)| *k);
    let _ = writeln!(
        s,
        "\nrules served here (rule -> egress IP, ifindex): {}",
        rows.len()
    );
    for (k, v) in rows {
        let _ = writeln!(
            s,
            "  rule {k:<8} -> {:<15} ifindex {}",
            ip(v.egress_ip).to_string(),
            v.ifindex
        );
    }

    render_admitted(pin_dir, &mut s)?;

    let name = names::EGRESS_IPS_V4;
    let e: HashMap<MapData, [u8; 4], EgressIpValue> =
        HashMap::try_from(open(pin_dir, name)?).map_err(|source| Error::Map { name, source })?;
    let mut rows: Vec<_> = e.iter().flatten().collect();
    rows.sort_by_key(|(k, _)| *k);
    let _ = writeln!(s, "\negress IPs on this node: {}", rows.len());
    for (k, v) in rows {
        let kind = if v.flags & egress_ip_flags::SHARED != 0 {
            "interface address (shared)"
        } else {
            "dedicated"
        };
        let _ = writeln!(
            s,
            "  {:<15} ifindex {:<4} {kind}",
            ip(k).to_string(),
            v.ifindex
        );
    }

    let name = names::NODES;
    let n: HashMap<MapData, Underlay, NodeValue> =
        HashMap::try_from(open(pin_dir, name)?).map_err(|source| Error::Map { name, source })?;
    let _ = writeln!(s, "\nknown nodes: {}", n.keys().count());
    let name = names::POD_OWNER_V4;
    let p: HashMap<MapData, [u8; 4], PodOwnerValue> =
        HashMap::try_from(open(pin_dir, name)?).map_err(|source| Error::Map { name, source })?;
    let _ = writeln!(s, "known pods: {}", p.keys().count());

    let name = names::CT_V4;
    let ct: HashMap<MapData, CtKeyV4, CtEntryV4> =
        HashMap::try_from(open(pin_dir, name)?).map_err(|source| Error::Map { name, source })?;
    let flows = ct
        .iter()
        .flatten()
        .filter(|(k, _)| k.dir == dir::ORIGINAL)
        .map(|(k, v)| Flow {
            proto: k.proto,
            src: (IpAddr::from(k.src), k.src_port_be),
            dst: (IpAddr::from(k.dst), k.dst_port_be),
            xlate: (IpAddr::from(v.xlate_addr), v.xlate_port_be),
            rule_id: v.rule_id,
            ifindex: v.ifindex,
            pod_node: v.pod_node,
        });
    write_flows(&mut s, "conntrack", flows.collect());
    write_exhausted(&mut s, &exhausted(pin_dir)?);

    if pinned(pin_dir, names::POLICY_V6) {
        render_v6(pin_dir, &mut s)?;
    }

    let _ = writeln!(s, "\ncounters (packets, bytes):");
    for (reason, c) in counters(pin_dir)? {
        let (_, n, desc) = counters::ALL
            .iter()
            .find(|r| r.0 == reason)
            .copied()
            .unwrap_or((0, "?", ""));
        let _ = writeln!(
            s,
            "  {reason:>3} {n:<24} {:>10} {:>12}  {desc}",
            c.packets, c.bytes
        );
    }
    Ok(s)
}

/// How many pods of each family this gateway admits from the tunnel, per rule.
fn render_admitted(pin_dir: &Path, s: &mut String) -> Result<()> {
    fn rule_ids<K: aya::Pod>(
        pin_dir: &Path,
        name: &'static str,
        rule_id: fn(&K) -> u32,
    ) -> Result<Vec<u32>> {
        if !pinned(pin_dir, name) {
            return Ok(Vec::new());
        }
        let m: HashMap<MapData, K, AdmittedValue> = HashMap::try_from(open(pin_dir, name)?)
            .map_err(|source| Error::Map { name, source })?;
        Ok(m.keys().flatten().map(|k| rule_id(&k)).collect())
    }
    let mut per_rule: BTreeMap<u32, (usize, usize)> = BTreeMap::new();
    for id in rule_ids::<AdmittedKeyV4>(pin_dir, names::ADMITTED_V4, |k| k.rule_id)? {
        per_rule.entry(id).or_default().0 += 1;
    }
    for id in rule_ids::<AdmittedKeyV6>(pin_dir, names::ADMITTED_V6, |k| k.rule_id)? {
        per_rule.entry(id).or_default().1 += 1;
    }
    let _ = writeln!(
        s,
        "\npods admitted from the tunnel (rule -> IPv4 pods, IPv6 pods): {} rules",
        per_rule.len()
    );
    for (id, (v4, v6)) in per_rule {
        let _ = writeln!(s, "  rule {id:<8} -> {v4:>7} IPv4 {v6:>7} IPv6");
    }
    Ok(())
}

/// The IPv6 maps (pods and egress IPs are IPv6; gateways and pod nodes are underlay
/// addresses of either family).
fn render_v6(pin_dir: &Path, s: &mut String) -> Result<()> {
    let name = names::POLICY_V6;
    let t: HashMap<MapData, PolicyKeyV6, PolicyValueV6> =
        HashMap::try_from(open(pin_dir, name)?).map_err(|source| Error::Map { name, source })?;
    let mut rows: Vec<_> = t.iter().flatten().collect();
    rows.sort_by_key(|(k, _)| *k);
    let _ = writeln!(
        s,
        "\nIPv6 policy (pod, destination -> action, gateway, egress IP, rule): {}",
        rows.len()
    );
    for (k, v) in rows {
        let _ = writeln!(
            s,
            "  {:<24} {:>30} -> {:<17} gw {:<15} egress {:<24} rule {}",
            ip6(k.pod).to_string(),
            format!("{}/{}", ip6(k.dst), k.dst_len),
            action_name(v.action),
            node(v.gateway).to_string(),
            ip6(v.egress_ip).to_string(),
            v.rule_id
        );
    }
    if pinned(pin_dir, names::RULES_V6) {
        let name = names::RULES_V6;
        let r: HashMap<MapData, u32, RuleValueV6> = HashMap::try_from(open(pin_dir, name)?)
            .map_err(|source| Error::Map { name, source })?;
        let mut rows: Vec<_> = r.iter().flatten().collect();
        rows.sort_by_key(|(k, _)| *k);
        let _ = writeln!(
            s,
            "\nIPv6 rules served here (rule -> egress IP, ifindex): {}",
            rows.len()
        );
        for (k, v) in rows {
            let _ = writeln!(
                s,
                "  rule {k:<8} -> {:<24} ifindex {}",
                ip6(v.egress_ip).to_string(),
                v.ifindex
            );
        }
    }
    if pinned(pin_dir, names::EGRESS_IPS_V6) {
        let name = names::EGRESS_IPS_V6;
        let e: HashMap<MapData, [u8; 16], EgressIpValue> = HashMap::try_from(open(pin_dir, name)?)
            .map_err(|source| Error::Map { name, source })?;
        let mut rows: Vec<_> = e.iter().flatten().collect();
        rows.sort_by_key(|(k, _)| *k);
        let _ = writeln!(s, "\nIPv6 egress IPs on this node: {}", rows.len());
        for (k, v) in rows {
            let kind = if v.flags & egress_ip_flags::SHARED != 0 {
                "interface address (shared)"
            } else {
                "dedicated"
            };
            let _ = writeln!(
                s,
                "  {:<24} ifindex {:<4} {kind}",
                ip6(k).to_string(),
                v.ifindex
            );
        }
    }
    if pinned(pin_dir, names::POD_OWNER_V6) {
        let name = names::POD_OWNER_V6;
        let p: HashMap<MapData, [u8; 16], PodOwnerValue> = HashMap::try_from(open(pin_dir, name)?)
            .map_err(|source| Error::Map { name, source })?;
        let _ = writeln!(s, "known IPv6 pods: {}", p.keys().count());
    }
    if pinned(pin_dir, names::CT_V6) {
        let name = names::CT_V6;
        let ct: HashMap<MapData, CtKeyV6, CtEntryV6> = HashMap::try_from(open(pin_dir, name)?)
            .map_err(|source| Error::Map { name, source })?;
        let flows = ct
            .iter()
            .flatten()
            .filter(|(k, _)| k.dir == dir::ORIGINAL)
            .map(|(k, v)| Flow {
                proto: k.proto,
                src: (IpAddr::from(k.src), k.src_port_be),
                dst: (IpAddr::from(k.dst), k.dst_port_be),
                xlate: (IpAddr::from(v.xlate_addr), v.xlate_port_be),
                rule_id: v.rule_id,
                ifindex: v.ifindex,
                pod_node: v.pod_node,
            });
        write_flows(s, "IPv6 conntrack", flows.collect());
    }
    Ok(())
}

/// A conntrack flow (its original-direction entry), of either family. Ports in network
/// order, as in the map.
struct Flow {
    proto: u8,
    src: (IpAddr, u16),
    dst: (IpAddr, u16),
    xlate: (IpAddr, u16),
    rule_id: u32,
    ifindex: u32,
    pod_node: Underlay,
}

/// The first 50 flows, ordered by addresses and ports, under `title`.
fn write_flows(s: &mut String, title: &str, mut flows: Vec<Flow>) {
    let addr = |(ip, port_be): (IpAddr, u16)| SocketAddr::new(ip, u16::from_be(port_be));
    flows.sort_by_key(|f| (addr(f.src), addr(f.dst)));
    let _ = writeln!(s, "\n{title} (original direction): {}", flows.len());
    for f in flows.iter().take(50) {
        let _ = writeln!(
            s,
            "  {:<6} {} -> {}  as {}  rule {} ifindex {} from node {}",
            proto(f.proto),
            addr(f.src),
            addr(f.dst),
            addr(f.xlate),
            f.rule_id,
            f.ifindex,
            node(f.pod_node)
        );
    }
    if flows.len() > 50 {
        let _ = writeln!(s, "  ... {} more", flows.len() - 50);
    }
}

fn proto(p: u8) -> &'static str {
    match p {
        6 => "tcp",
        17 => "udp",
        1 => "icmp",
        58 => "icmpv6",
        _ => "?",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_where_no_agent_has_run_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let e = render(dir.path()).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "no agent has run here (no maps under {}): start `egress-agent run`, or \
                 pass --bpffs-dir",
                dir.path().display()
            )
        );
        let missing = dir.path().join("absent");
        assert!(matches!(render(&missing), Err(Error::NoAgent { .. })));
        assert!(dedicated_egress_ips(&missing).unwrap().is_empty());
    }
}
