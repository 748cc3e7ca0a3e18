//! Conntrack carried over an upgrade. The conntrack entries grew a cached next hop at
//! their end (`CtEntryV4`: 40 -> 72 bytes, `CtEntryV6`: 56 -> 88), so a pinned conntrack
//! map of the earlier layout has another value size and is replaced at start. Replacing
//! it empty would cost every flow through this gateway its translation: the next packet
//! of an established TCP connection would get a new source port, which the far host
//! answers with a RST. So the earlier entries are read before the old map goes and
//! written into the new one: the earlier layout is the new one's prefix, and an all-zero
//! next hop means "nothing cached" (the next packet looks it up).

use std::path::Path;

use aya::{
    Pod,
    maps::{HashMap, Map, MapData},
};
use egress_common::maps::{self as names, def};

use super::{Error, Result};

/// `BPF_NOEXIST`: insert only a key that is not there.
const BPF_NOEXIST: u64 = 1;

/// Value bytes of the earlier layouts.
const V4_BEFORE: u32 = 40;
const V6_BEFORE: u32 = 56;

/// Conntrack entries read from maps of the earlier layout, as (key, value) bytes padded
/// with zeros to this build's value size.
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

    /// Read the conntrack maps pinned under `pin_dir` that have the earlier layout (before
    /// they are replaced); none of another layout or of this one.
    pub fn read(pin_dir: &Path) -> Result<Self> {
        Ok(Self {
            v4: read::<def::CtV4, [u8; V4_BEFORE as usize]>(pin_dir)?,
            v6: read::<def::CtV6, [u8; V6_BEFORE as usize]>(pin_dir)?,
        })
    }

    /// Write the carried entries into this build's maps (pinned under `pin_dir` by now),
    /// leaving alone any key the new datapath has made meanwhile. Returns how many went in.
    pub fn write(self, pin_dir: &Path) -> Result<usize> {
        Ok(write::<def::CtV4>(pin_dir, self.v4)? + write::<def::CtV6>(pin_dir, self.v6)?)
    }
}

/// The entries of conntrack map `M` if its pinned map has the earlier value size `B`'s.
fn read<M: names::Map, B: Pod>(pin_dir: &Path) -> Result<Vec<(M::Key, M::Value)>> {
    let name = M::SPEC.name;
    let path = pin_dir.join(name);
    let Ok(info) = aya::maps::MapInfo::from_pin(&path) else {
        return Ok(Vec::new());
    };
    let before = size_of::<B>() as u32;
    if info.key_size() != M::SPEC.key_size || info.value_size() != before {
        return Ok(Vec::new());
    }
    let data = MapData::from_pin(&path).map_err(|source| Error::Map { name, source })?;
    let map: HashMap<MapData, M::Key, B> =
        HashMap::try_from(Map::LruHashMap(data)).map_err(|source| Error::Map { name, source })?;
    Ok(map
        .iter()
        .flatten()
        .map(|(k, old)| (k, widen::<B, M::Value>(&old)))
        .collect())
}

/// `old`'s bytes followed by zeros, as a `V` (`V` is larger; any bytes are a valid `V`).
fn widen<B: Pod, V: Pod>(old: &B) -> V {
    let mut bytes = vec![0u8; size_of::<V>()];
    // SAFETY: `B` is plain old data of `size_of::<B>()` bytes, no more than `V`'s.
    let old =
        unsafe { std::slice::from_raw_parts(std::ptr::from_ref(old).cast::<u8>(), size_of::<B>()) };
    bytes[..old.len()].copy_from_slice(old);
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
    use egress_common::conntrack::{CtEntryV4, NextHop};

    use super::*;

    #[test]
    fn an_earlier_entry_is_the_prefix_of_the_new_one_with_no_next_hop() {
        let mut old = [0u8; V4_BEFORE as usize];
        for (i, b) in old.iter_mut().enumerate() {
            *b = i as u8 + 1;
        }
        let new: CtEntryV4 = widen(&old);
        // SAFETY: CtEntryV4 is plain old data.
        let bytes: [u8; size_of::<CtEntryV4>()] = unsafe { std::mem::transmute(new) };
        assert_eq!(&bytes[..old.len()], &old);
        assert_eq!(new.next_hop, NextHop::default());
        assert_eq!(
            std::mem::offset_of!(CtEntryV4, next_hop),
            V4_BEFORE as usize,
            "the next hop is what the layout added, at its end"
        );
        assert_eq!(
            std::mem::offset_of!(egress_common::conntrack::CtEntryV6, next_hop),
            V6_BEFORE as usize
        );
    }
}
