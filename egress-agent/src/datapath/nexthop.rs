//! The next-hop generation (`NH_GEN`): a conntrack entry's cached next hop is used while
//! its generation is the map's (`egress_common::conntrack::NextHop`). The agent bumps it
//! on route and neighbour changes (`agent::nexthop` listens); this is the write.

use std::path::Path;

use aya::maps::{Array, Map, MapData};
use egress_common::maps::{self as names, def::NhGen};

use super::Error;

/// The pinned `NH_GEN` map, opened for bumps from a task of its own.
pub struct Generation(Array<MapData, <NhGen as names::Map>::Value>);

impl Generation {
    /// Open `NH_GEN` as pinned under `pin_dir`.
    pub fn open(pin_dir: &Path) -> Result<Self, Error> {
        let name = names::NH_GEN;
        let data =
            MapData::from_pin(pin_dir.join(name)).map_err(|source| Error::Map { name, source })?;
        let array =
            Array::try_from(Map::Array(data)).map_err(|source| Error::Map { name, source })?;
        Ok(Self(array))
    }

    /// Add one (wrapping): the next packet of every flow looks its route up again.
    pub fn bump(&mut self) -> Result<(), Error> {
        let next = self.0.get(&0, 0).unwrap_or(0).wrapping_add(1);
        self.0.set(0, next, 0).map_err(|source| Error::Map {
            name: names::NH_GEN,
            source,
        })
    }
}
