//! How the agent keeps a pinned map in memory, by the map's kind: a hash map as its
//! entries by key, an LPM trie as its entries by (prefix length, network). One `read` and
//! one `write` per kind; the sync itself (`Datapath::sync_table`) is written once.

use std::{collections::BTreeMap, fmt::Debug, marker::PhantomData};

use aya::maps::{HashMap, LpmTrie, MapData, MapError, lpm_trie::Key};
use egress_common::maps::Map;

use crate::family::Synced;

/// A map of kind `Self` holding map `Self::Map`'s entries, kept in memory by `Self::At`.
pub trait Table {
    type Map: Synced;
    /// Where an entry is: the key of a hash map, (prefix length, network) of a trie.
    type At: Ord + Copy + Debug;
    /// The typed handle.
    type Handle<'a>;
    fn open(map: &mut aya::maps::Map) -> Result<Self::Handle<'_>, MapError>;
    fn read(h: &Self::Handle<'_>) -> BTreeMap<Self::At, Value<Self>>;
    /// Insert (`Some`) or remove (`None`) the entry at `at`.
    fn write(
        h: &mut Self::Handle<'_>,
        at: &Self::At,
        v: Option<&Value<Self>>,
    ) -> Result<(), MapError>;
}

/// The value type of a table's map.
pub type Value<T> = <<T as Table>::Map as Map>::Value;

/// A table's entries, where each is.
pub type Rows<T> = BTreeMap<<T as Table>::At, Value<T>>;

/// Something that reads whole tables: the agent's open datapath, or the pins another
/// process left (`egress-agent maps`), so that both read the maps into one
/// [`MapState`](super::MapState) by one code path.
pub trait Reader {
    type Error;
    /// Every entry of table `T`.
    fn read<T: Table>(&mut self) -> Result<Rows<T>, Self::Error>;
}

/// Hash map `M` (also LRU).
pub struct Hash<M>(PhantomData<M>);

/// LPM trie `M`.
pub struct Lpm<M>(PhantomData<M>);

impl<M: Synced> Table for Hash<M> {
    type Map = M;
    type At = M::Key;
    type Handle<'a> = HashMap<&'a mut MapData, M::Key, M::Value>;

    fn open(map: &mut aya::maps::Map) -> Result<Self::Handle<'_>, MapError> {
        HashMap::try_from(map)
    }

    fn read(h: &Self::Handle<'_>) -> BTreeMap<M::Key, M::Value> {
        h.iter().flatten().collect()
    }

    fn write(h: &mut Self::Handle<'_>, at: &M::Key, v: Option<&M::Value>) -> Result<(), MapError> {
        match v {
            Some(v) => h.insert(at, v, 0),
            None => h.remove(at),
        }
    }
}

impl<M: Synced> Table for Lpm<M> {
    type Map = M;
    type At = (u32, M::Key);
    type Handle<'a> = LpmTrie<&'a mut MapData, M::Key, M::Value>;

    fn open(map: &mut aya::maps::Map) -> Result<Self::Handle<'_>, MapError> {
        LpmTrie::try_from(map)
    }

    fn read(h: &Self::Handle<'_>) -> BTreeMap<(u32, M::Key), M::Value> {
        h.iter()
            .flatten()
            .map(|(k, v)| ((k.prefix_len(), k.data()), v))
            .collect()
    }

    fn write(
        h: &mut Self::Handle<'_>,
        (len, data): &(u32, M::Key),
        v: Option<&M::Value>,
    ) -> Result<(), MapError> {
        let key = Key::new(*len, *data);
        match v {
            Some(v) => h.insert(&key, v, 0),
            None => h.remove(&key),
        }
    }
}
