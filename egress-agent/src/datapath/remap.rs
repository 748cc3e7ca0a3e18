//! `REMAP_V4` / `REMAP_V6`: the remapped translations other gateways shared (issue 44).
//!
//! A gateway gives a pod's flow the pod's own source port unless another flow to the same
//! destination holds it there; then the flow gets another port, and the far end knows it
//! by that port. A gateway that takes the egress IP over and sees the flow's next packet
//! would give it the pod's port again, and the far end would answer with a RST. So the
//! holder shares such translations ([`Remap`], through the hellos), each gateway writes
//! what it hears here, and the datapath tries the shared port first when it creates the
//! flow (`conntrack::create_in`). The maps only ever steer a new flow's first choice of port:
//! a port that is taken is not stolen.

use std::path::Path;

use aya::maps::{HashMap, Map, MapData};
use egress_common::{
    conntrack::{CtKeyV4, CtKeyV6, RemapValueV4, RemapValueV6, dir},
    maps as names,
};

use super::{Error, Result};
use crate::family::conntrack::Remap;

/// One family's key and value for `r` (`None` for addresses of mixed families).
trait Family: Sized {
    type Key: aya::Pod;
    type Value: aya::Pod;
    const NAME: &'static str;
    fn entry(r: &Remap) -> Option<(Self::Key, Self::Value)>;
    fn remap(k: &Self::Key, v: &Self::Value) -> Remap;
}

struct V4;
struct V6;

impl Family for V4 {
    type Key = CtKeyV4;
    type Value = RemapValueV4;
    const NAME: &'static str = names::REMAP_V4;
    fn entry(r: &Remap) -> Option<(CtKeyV4, RemapValueV4)> {
        use std::net::IpAddr::V4 as A;
        let (A(pod), A(dst), A(egress)) = (r.pod.ip(), r.dst.ip(), r.egress.ip()) else {
            return None;
        };
        Some((
            CtKeyV4 {
                src: pod.octets(),
                dst: dst.octets(),
                src_port_be: r.pod.port().to_be(),
                dst_port_be: r.dst.port().to_be(),
                proto: r.proto,
                dir: dir::ORIGINAL,
                _pad: [0; 2],
            },
            RemapValueV4 {
                xlate_addr: egress.octets(),
                xlate_port_be: r.egress.port().to_be(),
                _pad: [0; 2],
            },
        ))
    }
    fn remap(k: &CtKeyV4, v: &RemapValueV4) -> Remap {
        Remap {
            proto: k.proto,
            pod: (k.src, u16::from_be(k.src_port_be)).into(),
            dst: (k.dst, u16::from_be(k.dst_port_be)).into(),
            egress: (v.xlate_addr, u16::from_be(v.xlate_port_be)).into(),
        }
    }
}

impl Family for V6 {
    type Key = CtKeyV6;
    type Value = RemapValueV6;
    const NAME: &'static str = names::REMAP_V6;
    fn entry(r: &Remap) -> Option<(CtKeyV6, RemapValueV6)> {
        use std::net::IpAddr::V6 as A;
        let (A(pod), A(dst), A(egress)) = (r.pod.ip(), r.dst.ip(), r.egress.ip()) else {
            return None;
        };
        Some((
            CtKeyV6 {
                src: pod.octets(),
                dst: dst.octets(),
                src_port_be: r.pod.port().to_be(),
                dst_port_be: r.dst.port().to_be(),
                proto: r.proto,
                dir: dir::ORIGINAL,
                _pad: [0; 2],
            },
            RemapValueV6 {
                xlate_addr: egress.octets(),
                xlate_port_be: r.egress.port().to_be(),
                _pad: [0; 2],
            },
        ))
    }
    fn remap(k: &CtKeyV6, v: &RemapValueV6) -> Remap {
        Remap {
            proto: k.proto,
            pod: (k.src, u16::from_be(k.src_port_be)).into(),
            dst: (k.dst, u16::from_be(k.dst_port_be)).into(),
            egress: (v.xlate_addr, u16::from_be(v.xlate_port_be)).into(),
        }
    }
}

/// Every remap pinned under `pin_dir` (both families), in order.
pub fn read(pin_dir: &Path) -> Result<Vec<Remap>> {
    let mut out = read_family::<V4>(pin_dir)?;
    out.extend(read_family::<V6>(pin_dir)?);
    out.sort();
    Ok(out)
}

fn read_family<F: Family>(pin_dir: &Path) -> Result<Vec<Remap>> {
    let pin = pin_dir.join(F::NAME);
    if !pin.exists() {
        return Ok(Vec::new());
    }
    let map_err = |source| Error::Map {
        name: F::NAME,
        source,
    };
    let data = MapData::from_pin(&pin).map_err(map_err)?;
    let map: HashMap<MapData, F::Key, F::Value> =
        HashMap::try_from(Map::from_map_data(data).map_err(map_err)?).map_err(map_err)?;
    Ok(map
        .iter()
        .flatten()
        .map(|(k, v)| F::remap(&k, &v))
        .collect())
}

/// Write `add` into the remap maps pinned under `pin_dir` and remove `remove` from them.
/// A map that is not pinned (an object before these maps) is skipped: nothing to steer.
pub fn write(pin_dir: &Path, add: &[Remap], remove: &[Remap]) -> Result<()> {
    write_family::<V4>(pin_dir, add, remove)?;
    write_family::<V6>(pin_dir, add, remove)
}

fn write_family<F: Family>(pin_dir: &Path, add: &[Remap], remove: &[Remap]) -> Result<()> {
    let entries = |rs: &[Remap]| rs.iter().filter_map(F::entry).collect::<Vec<_>>();
    let (add, remove) = (entries(add), entries(remove));
    let pin = pin_dir.join(F::NAME);
    if (add.is_empty() && remove.is_empty()) || !pin.exists() {
        return Ok(());
    }
    let map_err = |source| Error::Map {
        name: F::NAME,
        source,
    };
    let data = MapData::from_pin(&pin).map_err(map_err)?;
    let mut map: HashMap<MapData, F::Key, F::Value> =
        HashMap::try_from(Map::from_map_data(data).map_err(map_err)?).map_err(map_err)?;
    for (k, _) in &remove {
        // Gone already (the LRU map dropped it): nothing to do.
        let _ = map.remove(k);
    }
    for (k, v) in &add {
        map.insert(k, v, 0).map_err(map_err)?;
    }
    Ok(())
}

/// `FRESH_REMAPS_V4` / `_V6`: the remaps this node's datapath made since they were last
/// taken. The hellos take them every interval ([`Fresh::take`]) and share them at once:
/// the conntrack sweep finds them too, but only at its next tick (up to 2 s), and a flow
/// opened just before its holder fails would lose its port.
pub struct Fresh {
    pin_dir: std::path::PathBuf,
    v4: Option<HashMap<MapData, CtKeyV4, RemapValueV4>>,
    v6: Option<HashMap<MapData, CtKeyV6, RemapValueV6>>,
}

impl Fresh {
    /// The fresh remaps of the maps pinned under `pin_dir`, opened when first taken (an
    /// object before these maps has none: nothing is taken).
    pub fn new(pin_dir: &Path) -> Self {
        Self {
            pin_dir: pin_dir.to_owned(),
            v4: None,
            v6: None,
        }
    }

    /// Take out every fresh remap, at most `max` per family (the rest stay for the next
    /// call).
    pub fn take(&mut self, max: usize) -> Result<Vec<Remap>> {
        let mut out = take_family::<V4>(&self.pin_dir, &mut self.v4, names::FRESH_REMAPS_V4, max)?;
        out.extend(take_family::<V6>(
            &self.pin_dir,
            &mut self.v6,
            names::FRESH_REMAPS_V6,
            max,
        )?);
        Ok(out)
    }
}

fn take_family<F: Family>(
    pin_dir: &Path,
    map: &mut Option<HashMap<MapData, F::Key, F::Value>>,
    name: &'static str,
    max: usize,
) -> Result<Vec<Remap>> {
    let map_err = |source| Error::Map { name, source };
    if map.is_none() {
        let pin = pin_dir.join(name);
        if !pin.exists() {
            return Ok(Vec::new());
        }
        let data = MapData::from_pin(&pin).map_err(map_err)?;
        *map =
            Some(HashMap::try_from(Map::from_map_data(data).map_err(map_err)?).map_err(map_err)?);
    }
    let Some(m) = map.as_mut() else {
        return Ok(Vec::new());
    };
    // The keys first, then each removed: removing while iterating would restart the walk.
    let taken: Vec<(F::Key, F::Value)> = m.iter().take(max).flatten().collect();
    let mut out = Vec::with_capacity(taken.len());
    for (k, v) in &taken {
        // Gone already (the LRU map dropped it): shared all the same. A flow written
        // again between the read and the removal loses its new value here; the
        // conntrack sweep finds it.
        let _ = m.remove(k);
        out.push(F::remap(k, v));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_the_original_direction_and_families_do_not_mix() {
        let r = Remap {
            proto: 6,
            pod: "10.244.1.5:40000".parse().unwrap(),
            dst: "192.168.10.10:8080".parse().unwrap(),
            egress: "192.168.10.100:40001".parse().unwrap(),
        };
        let (k, v) = V4::entry(&r).unwrap();
        assert_eq!(
            (
                k.src,
                k.dst,
                u16::from_be(k.src_port_be),
                u16::from_be(k.dst_port_be)
            ),
            ([10, 244, 1, 5], [192, 168, 10, 10], 40000, 8080)
        );
        assert_eq!((k.proto, k.dir), (6, dir::ORIGINAL));
        assert_eq!(
            (v.xlate_addr, u16::from_be(v.xlate_port_be)),
            ([192, 168, 10, 100], 40001)
        );
        assert_eq!(V4::remap(&k, &v), r);
        assert!(V6::entry(&r).is_none());
        let mixed = Remap {
            egress: "[fd00::1]:40001".parse().unwrap(),
            ..r
        };
        assert!(V4::entry(&mixed).is_none() && V6::entry(&mixed).is_none());
        let r6 = Remap {
            proto: 17,
            pod: "[fd00:10:244:1::5]:5353".parse().unwrap(),
            dst: "[fd00:101::10]:53".parse().unwrap(),
            egress: "[fd00:101::50]:61000".parse().unwrap(),
        };
        let (k, v) = V6::entry(&r6).unwrap();
        assert_eq!(V6::remap(&k, &v), r6);
    }
}
