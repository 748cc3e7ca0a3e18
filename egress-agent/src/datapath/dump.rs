//! `egress-agent maps`: the pinned maps of an agent, read into the [`MapState`] the agent
//! keeps and shown by the renderer the golden tests use ([`super::render`]), with the
//! conntrack entries, counters and refused flows beside them.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
};

use aya::maps::{Array, HashMap, LpmTrie, Map, MapData, PerCpuArray, PerCpuHashMap};
use egress_common::{
    config::Config,
    counters::{self, Counter},
    maps::{self as names, MapKind},
    policy::egress_ip_flags,
    underlay::{self, Underlay},
};

use super::{
    Error, MapState, Result,
    sweep::{CtKey, Flow},
    table::{Reader, Rows, Table},
};
use crate::family::{Family, V4, V6};

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

fn write_remaps(s: &mut String, rows: &[crate::family::conntrack::Remap]) {
    let _ = writeln!(
        s,
        "\nremapped translations other gateways shared (REMAP_V4/V6: the port a flow keeps \
         if this node takes its egress IP over): {}",
        rows.len()
    );
    for r in rows {
        let _ = writeln!(
            s,
            "  proto {:<3} {} -> {} as {}",
            r.proto, r.pod, r.dst, r.egress
        );
    }
}

/// Entries per map (for metrics): every pinned hash map and trie of the registry.
pub fn sizes(pin_dir: &Path) -> Result<Vec<(&'static str, usize)>> {
    struct Count<'a> {
        pin_dir: &'a Path,
        out: Result<Vec<(&'static str, usize)>>,
    }
    impl names::Visit for Count<'_> {
        fn map<M: names::Map>(&mut self) {
            let Ok(out) = &mut self.out else { return };
            let name = M::SPEC.name;
            if !pinned(self.pin_dir, name) {
                return;
            }
            let n = match M::SPEC.kind {
                MapKind::Hash | MapKind::LruHash => {
                    hash::<M>(self.pin_dir).map(|m| m.keys().count())
                }
                MapKind::LruPerCpuHash => open(self.pin_dir, name).and_then(|m| {
                    PerCpuHashMap::<_, M::Key, M::Value>::try_from(m)
                        .map(|m| m.keys().count())
                        .map_err(|source| Error::Map { name, source })
                }),
                MapKind::LpmTrie => open(self.pin_dir, name).and_then(|m| {
                    LpmTrie::<_, M::Key, M::Value>::try_from(m)
                        .map(|m| m.keys().count())
                        .map_err(|source| Error::Map { name, source })
                }),
                // Arrays: every index is an entry.
                MapKind::Array | MapKind::PerCpuArray => return,
            };
            match n {
                Ok(n) => out.push((name, n)),
                Err(e) => self.out = Err(e),
            }
        }
    }
    let mut count = Count {
        pin_dir,
        out: Ok(Vec::new()),
    };
    names::visit(&mut count);
    count.out
}

/// The capacity (`max_entries`) of every pinned hash map and trie of the registry, as the
/// kernel has it (sized by flags at load: conntrack, pod owners, ...), for metrics.
pub fn capacities(pin_dir: &Path) -> Vec<(&'static str, u32)> {
    names::REGISTRY
        .iter()
        .filter(|spec| !matches!(spec.kind, MapKind::Array | MapKind::PerCpuArray))
        .filter_map(|spec| {
            let info = aya::maps::MapInfo::from_pin(pin_dir.join(spec.name)).ok()?;
            Some((spec.name, info.max_entries()))
        })
        .collect()
}

/// The pinned hash map `M`, typed by its declaration.
fn hash<M: names::Map>(pin_dir: &Path) -> Result<HashMap<MapData, M::Key, M::Value>> {
    let name = M::SPEC.name;
    HashMap::try_from(open(pin_dir, name)?).map_err(|source| Error::Map { name, source })
}

/// The entries of the pinned hash map `M` (none when an older object lacks it).
fn entries<M: names::Map>(pin_dir: &Path) -> Result<Vec<(M::Key, M::Value)>> {
    if !pinned(pin_dir, M::SPEC.name) {
        return Ok(Vec::new());
    }
    Ok(hash::<M>(pin_dir)?.iter().flatten().collect())
}

/// Are an agent's maps pinned under `pin_dir`? (Its configuration map is pinned first.)
pub fn has_maps(pin_dir: &Path) -> bool {
    pinned(pin_dir, names::CONFIG)
}

/// The dedicated egress IPs in the pinned maps, with the ifindex they serve: addresses
/// an agent added to this node's interfaces (shared ones are the interface's own address).
pub fn dedicated_egress_ips(pin_dir: &Path) -> Result<Vec<(IpAddr, u32)>> {
    fn read<F: Family>(pin_dir: &Path) -> Result<Vec<(IpAddr, u32)>> {
        Ok(entries::<F::EgressIps>(pin_dir)?
            .into_iter()
            .filter(|(_, v)| v.flags & egress_ip_flags::SHARED == 0)
            .map(|(k, v)| (F::Addr::from(k).into(), v.ifindex))
            .collect())
    }
    let mut out = read::<V4>(pin_dir)?;
    out.extend(read::<V6>(pin_dir)?);
    out.sort();
    Ok(out)
}

/// The pins under a directory, read as the agent reads its maps (a map an older object
/// lacks reads as empty).
struct Pins<'a>(&'a Path);

impl Reader for Pins<'_> {
    type Error = Error;

    fn read<T: Table>(&mut self) -> Result<Rows<T>> {
        let name = <T::Map as names::Map>::SPEC.name;
        if !pinned(self.0, name) {
            return Ok(Rows::<T>::new());
        }
        let mut map = open(self.0, name)?;
        let h = T::open(&mut map).map_err(|source| Error::Map { name, source })?;
        Ok(T::read(&h))
    }
}

/// What the maps pinned under `pin_dir` hold, in the form the agent keeps (and the
/// golden tests render).
pub fn state(pin_dir: &Path) -> Result<MapState> {
    MapState::read(&mut Pins(pin_dir))
}

/// The whole state of one agent's maps as text: its `CONFIG` entry and every entry of
/// its maps as [`render`](super::render) shows them, then what the agent does not write
/// (the flows refused, the remaps shared, the conntrack entries, the counters).
pub fn render(pin_dir: &Path) -> Result<String> {
    if !has_maps(pin_dir) {
        return Err(Error::NoAgent {
            dir: pin_dir.to_owned(),
        });
    }
    let mut s = super::render::config(&config(pin_dir)?);
    let state = state(pin_dir)?;
    let sizes: Vec<String> = state
        .sizes()
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("{name} {n}"))
        .collect();
    let _ = writeln!(s, "\n\nentries (map key -> value): {}", sizes.join(", "));
    s += &super::render::maps(&state);
    write_exhausted(&mut s, &exhausted(pin_dir)?);
    write_remaps(&mut s, &super::remap::read(pin_dir)?);
    write_conntrack::<V4>(pin_dir, &mut s)?;
    write_conntrack::<V6>(pin_dir, &mut s)?;
    render_counters(pin_dir, &mut s)?;
    Ok(s)
}

/// The `CONFIG` entry of the agent whose maps are pinned under `pin_dir`.
fn config(pin_dir: &Path) -> Result<Config> {
    let name = names::CONFIG;
    let cfg: Array<MapData, Config> =
        Array::try_from(open(pin_dir, name)?).map_err(|source| Error::Map { name, source })?;
    cfg.get(&0, 0).map_err(|source| Error::Map { name, source })
}

/// The underlay address of the node whose agent pinned the maps under `pin_dir` (its
/// `CONFIG` entry).
pub fn node_address(pin_dir: &Path) -> Result<IpAddr> {
    Ok(node(config(pin_dir)?.node_ip))
}

/// One family's conntrack entries (the first 50).
fn write_conntrack<F: Family>(pin_dir: &Path, s: &mut String) -> Result<()> {
    let flows = entries::<F::Ct>(pin_dir)?
        .iter()
        .filter_map(|(k, v)| k.flow(v))
        .collect();
    write_flows(s, &format!("{} conntrack", F::NAME), flows);
    Ok(())
}

/// Every reason counted so far.
fn render_counters(pin_dir: &Path, s: &mut String) -> Result<()> {
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
    Ok(())
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
