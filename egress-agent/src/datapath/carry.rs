//! Conntrack carried over a restart that replaces the conntrack maps: an upgrade to
//! another entry layout, or another `--conntrack-entries`.
//!
//! The conntrack entries grew a cached next hop at their end (`CtEntryV4`: 40 -> 72
//! bytes, `CtEntryV6`: 56 -> 88), which then shrank to 24 bytes (64 and 80: a `CtEntryV4`
//! element of the kernel's hash table is then exactly two cache lines), so a pinned
//! conntrack map of an earlier layout has another value size and is replaced at start;
//! so is one of this layout whose capacity the operator changed (a kernel map cannot be
//! resized). Replacing it empty would cost every flow through this gateway its
//! translation: the next packet of an established TCP connection would get a new source
//! port, which the far host answers with a RST. So the entries are read before the old
//! map goes and written into the new one: every layout starts with the same flow fields
//! (40 bytes, 56 for IPv6), which are kept; the cached next hop is not (all zero means
//! "nothing cached": the next packet looks it up). A smaller map than the flows it is
//! given keeps the ones written last (it is an LRU map), and the agent logs how many
//! went in.

use std::path::Path;

use aya::{
    Pod,
    maps::{HashMap, Map, MapData},
};
use egress_common::maps::{self as names, def};

use super::{Capacities, Error, Result};

/// `BPF_NOEXIST`: insert only a key that is not there.
const BPF_NOEXIST: u64 = 1;

/// Value bytes of the earlier layouts: without a next hop, and with the 32-byte one.
const V4_BEFORE: [usize; 2] = [40, 72];
const V6_BEFORE: [usize; 2] = [56, 88];
/// The flow fields that every layout starts with: the bytes carried over.
const V4_FLOW: usize = V4_BEFORE[0];
const V6_FLOW: usize = V6_BEFORE[0];

/// Conntrack entries read from maps of an earlier layout, as their flow fields followed
/// by zeros (no next hop) in this build's layout.
#[derive(Default)]
pub struct Carried {
    v4: Vec<(
        <def::CtV4 as names::Map>::Key,
        <def::CtV4 as names::Map>::Value,
    )>,
    v6: Vec<(
        <def::CtV6 as names::Map>::Key,
        <def::CtV6 as names::Map>::Value,
    )>,
}

impl Carried {
    pub fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Read the conntrack maps pinned under `pin_dir` that are about to be replaced
    /// (before they are): those of an earlier layout, and those of this layout whose
    /// capacity is not `capacities.conntrack`. None of another layout, nor of this one at
    /// that capacity (adopted as it is).
    pub fn read(pin_dir: &Path, capacities: &Capacities) -> Result<Self> {
        let resized = Some(capacities.conntrack);
        let mut v4 = read::<def::CtV4, [u8; V4_BEFORE[0]]>(pin_dir, V4_FLOW, None)?;
        v4.extend(read::<def::CtV4, [u8; V4_BEFORE[1]]>(
            pin_dir, V4_FLOW, None,
        )?);
        v4.extend(read::<def::CtV4, V4Now>(pin_dir, V4_FLOW, resized)?);
        let mut v6 = read::<def::CtV6, [u8; V6_BEFORE[0]]>(pin_dir, V6_FLOW, None)?;
        v6.extend(read::<def::CtV6, [u8; V6_BEFORE[1]]>(
            pin_dir, V6_FLOW, None,
        )?);
        v6.extend(read::<def::CtV6, V6Now>(pin_dir, V6_FLOW, resized)?);
        Ok(Self { v4, v6 })
    }

    /// Write the carried entries into this build's maps (pinned under `pin_dir` by now),
    /// leaving alone any key the new datapath has made meanwhile. Returns how many went in.
    pub fn write(self, pin_dir: &Path) -> Result<usize> {
        Ok(write::<def::CtV4>(pin_dir, self.v4)? + write::<def::CtV6>(pin_dir, self.v6)?)
    }
}

/// This build's entries, read as they are pinned.
type V4Now = <def::CtV4 as names::Map>::Value;
type V6Now = <def::CtV6 as names::Map>::Value;

/// The entries of conntrack map `M` if its pinned map has the value size of `B` (and,
/// with `resized` set, a capacity other than it), each with its first `flow` bytes kept.
fn read<M: names::Map, B: Pod>(
    pin_dir: &Path,
    flow: usize,
    resized: Option<u32>,
) -> Result<Vec<(M::Key, M::Value)>> {
    let name = M::SPEC.name;
    let path = pin_dir.join(name);
    let Ok(info) = aya::maps::MapInfo::from_pin(&path) else {
        return Ok(Vec::new());
    };
    let before = size_of::<B>() as u32;
    if info.key_size() != M::SPEC.key_size || info.value_size() != before {
        return Ok(Vec::new());
    }
    if resized.is_some_and(|want| info.max_entries() == want) {
        return Ok(Vec::new());
    }
    let data = MapData::from_pin(&path).map_err(|source| Error::Map { name, source })?;
    let map: HashMap<MapData, M::Key, B> =
        HashMap::try_from(Map::LruHashMap(data)).map_err(|source| Error::Map { name, source })?;
    Ok(map
        .iter()
        .flatten()
        .map(|(k, old)| (k, flow_fields::<B, M::Value>(&old, flow)))
        .collect())
}

/// The first `flow` bytes of `old` followed by zeros, as a `V` (any bytes are a valid
/// `V`; `flow` is no more than either size).
fn flow_fields<B: Pod, V: Pod>(old: &B, flow: usize) -> V {
    assert!(flow <= size_of::<B>() && flow <= size_of::<V>());
    let mut bytes = vec![0u8; size_of::<V>()];
    // SAFETY: `B` is plain old data of `size_of::<B>()` bytes, at least `flow`.
    let old = unsafe { std::slice::from_raw_parts(std::ptr::from_ref(old).cast::<u8>(), flow) };
    bytes[..flow].copy_from_slice(old);
    // SAFETY: `bytes` holds `size_of::<V>()` bytes and `V` is plain old data.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<V>()) }
}

/// Insert `entries` into conntrack map `M` unless their key is there already.
fn write<M: names::Map>(pin_dir: &Path, entries: Vec<(M::Key, M::Value)>) -> Result<usize> {
    if entries.is_empty() {
        return Ok(0);
    }
    let name = M::SPEC.name;
    let data =
        MapData::from_pin(pin_dir.join(name)).map_err(|source| Error::Map { name, source })?;
    let mut map: HashMap<MapData, M::Key, M::Value> =
        HashMap::try_from(Map::LruHashMap(data)).map_err(|source| Error::Map { name, source })?;
    let mut written = 0;
    for (k, v) in entries {
        // BPF_NOEXIST: a flow the new programs made meanwhile keeps its entry.
        if map.insert(k, v, BPF_NOEXIST).is_ok() {
            written += 1;
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use egress_common::conntrack::{CtEntryV4, CtEntryV6, NextHop};

    use super::*;

    /// The flow fields of an earlier entry of `N` bytes, numbered 1, 2, ..., carried into
    /// this layout.
    fn carried<V: Pod, const N: usize>(flow: usize) -> V {
        let mut old = [0u8; N];
        for (i, b) in old.iter_mut().enumerate() {
            *b = i as u8 + 1;
        }
        flow_fields::<[u8; N], V>(&old, flow)
    }

    #[test]
    fn an_earlier_entry_keeps_its_flow_fields_and_no_next_hop() {
        for new in [
            carried::<CtEntryV4, { V4_BEFORE[0] }>(V4_FLOW),
            carried::<CtEntryV4, { V4_BEFORE[1] }>(V4_FLOW),
        ] {
            // SAFETY: CtEntryV4 is plain old data.
            let bytes: [u8; size_of::<CtEntryV4>()] = unsafe { std::mem::transmute(new) };
            let numbered: Vec<u8> = (1..=V4_FLOW as u8).collect();
            assert_eq!(&bytes[..V4_FLOW], numbered.as_slice());
            assert_eq!(new.next_hop, NextHop::default());
        }
        for new in [
            carried::<CtEntryV6, { V6_BEFORE[0] }>(V6_FLOW),
            carried::<CtEntryV6, { V6_BEFORE[1] }>(V6_FLOW),
        ] {
            assert_eq!(new.next_hop, NextHop::default());
        }
        assert_eq!(
            std::mem::offset_of!(CtEntryV4, next_hop),
            V4_FLOW,
            "the flow fields come first, then the next hop"
        );
        assert_eq!(std::mem::offset_of!(CtEntryV6, next_hop), V6_FLOW);
        assert!(
            !V4_BEFORE.contains(&size_of::<CtEntryV4>())
                && !V6_BEFORE.contains(&size_of::<CtEntryV6>()),
            "this layout is none of the earlier ones"
        );
    }
}
