//! Deterministic hashing: rule ids and rendezvous (highest random weight) choices. Every
//! agent must compute the same values on every platform, so nothing here uses `std`'s
//! randomly seeded hashers.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use egress_common::policy::MAX_RULE_ID;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a, 64 bits.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV_OFFSET, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(FNV_PRIME)
    })
}

/// FNV-1a over several parts, each followed by a 0xff separator (which no UTF-8 text
/// contains), then a final avalanche so that close inputs score far apart. What
/// [`rendezvous`] computes for the key's parts and a name, without hashing the key again.
#[cfg(test)]
fn score(parts: &[&[u8]]) -> u64 {
    finish(parts.iter().fold(FNV_OFFSET, |h, part| absorb(h, part)))
}

/// FNV-1a state `h` after one more part and its separator.
fn absorb(h: u64, part: &[u8]) -> u64 {
    part.iter()
        .chain(&[0xff])
        .fold(h, |h, b| (h ^ u64::from(*b)).wrapping_mul(FNV_PRIME))
}

/// The splitmix64 finalizer.
fn finish(mut h: u64) -> u64 {
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// Rendezvous hashing: the candidate with the highest score for `key` (ties, which are
/// astronomically unlikely, go to the smaller name). Adding or removing a candidate only
/// moves the keys that candidate wins or held.
pub fn rendezvous<'a>(
    key: &[&[u8]],
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    // The key's parts are hashed once; each candidate's name continues from there.
    let keyed = key.iter().fold(FNV_OFFSET, |h, part| absorb(h, part));
    candidates
        .into_iter()
        .map(|name| (finish(absorb(keyed, name.as_bytes())), name))
        .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(a.1)))
        .map(|(_, name)| name)
}

/// What a wire id is for: a rule (`None`; also its first dedicated address), or another
/// address of a rule's `egressIPs` list (the gateway reads the address from the id the
/// tunnel carries).
pub type WireKey = (String, usize, Option<IpAddr>);

/// Cluster-wide rule ids for `(policy, rule index)` pairs: FNV-1a 64 of
/// `"<policy>/<index>"` mod `MAX_RULE_ID`, plus one; collisions are resolved by linear
/// probing in sorted (policy, index) order, so every agent that sees the same policies
/// assigns the same ids.
pub fn rule_ids<'a>(
    rules: impl IntoIterator<Item = (&'a str, usize)>,
) -> BTreeMap<(String, usize), u32> {
    wire_ids(rules.into_iter().map(|(p, i)| (p.to_owned(), i, None)))
        .into_iter()
        .map(|((p, i, _), id)| ((p, i), id))
        .collect()
}

/// [`rule_ids`] for rules and the addresses of `egressIPs` lists: an address hashes
/// `"<policy>/<index>/<address>"`, so an address keeps its id when others join or leave
/// the list. Keys sort rules before their addresses, so a rule's id is the one
/// [`rule_ids`] gives it unless an address's hash collides with it.
pub fn wire_ids(keys: impl IntoIterator<Item = WireKey>) -> BTreeMap<WireKey, u32> {
    let sorted: BTreeSet<WireKey> = keys.into_iter().collect();
    let mut used = BTreeSet::new();
    let mut ids = BTreeMap::new();
    for key in sorted {
        let text = match key.2 {
            None => format!("{}/{}", key.0, key.1),
            Some(ip) => format!("{}/{}/{ip}", key.0, key.1),
        };
        let h = fnv1a64(text.as_bytes()) % u64::from(MAX_RULE_ID);
        // `h < MAX_RULE_ID`, so it fits.
        let mut id = u32::try_from(h).unwrap_or(0) + 1;
        while !used.insert(id) {
            id = id % MAX_RULE_ID + 1;
        }
        ids.insert(key, id);
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_matches_reference_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn rule_ids_are_in_range_unique_and_stable() {
        let ids = rule_ids([("payments", 0), ("payments", 1), ("billing", 0)]);
        let again = rule_ids([("billing", 0), ("payments", 1), ("payments", 0)]);
        assert_eq!(ids, again);
        let set: BTreeSet<_> = ids.values().collect();
        assert_eq!(set.len(), 3);
        for id in ids.values() {
            assert!((1..=MAX_RULE_ID).contains(id));
        }
        let expected =
            u32::try_from(fnv1a64(b"payments/0") % u64::from(MAX_RULE_ID)).expect("fits") + 1;
        assert_eq!(ids[&("payments".to_owned(), 0)], expected);
    }

    #[test]
    fn rendezvous_scores_each_name_after_the_whole_key() {
        // FNV-1a of "key" 0xff "gw-1" 0xff, then splitmix64's finalizer (computed apart).
        assert_eq!(score(&[b"key", b"gw-1"]), 0x07847f897a6574a2);
        let names = ["gw-1", "gw-2", "gateway-10", "192.168.101.50", ""];
        for i in 0..500u32 {
            let (a, b) = (i.to_be_bytes(), (i * 7919).to_le_bytes());
            let key: [&[u8]; 2] = [&a, &b];
            let by_score = names
                .iter()
                .map(|n| (score(&[&a, &b, n.as_bytes()]), *n))
                .max_by(|x, y| x.0.cmp(&y.0).then_with(|| y.1.cmp(x.1)))
                .map(|(_, n)| n);
            assert_eq!(rendezvous(&key, names), by_score, "key {i}");
        }
    }

    #[test]
    fn rendezvous_is_stable_when_an_unrelated_candidate_joins() {
        let before = ["gw-1", "gw-2", "gw-3"];
        let mut moved = 0;
        for i in 0..200u32 {
            let key = i.to_be_bytes();
            let a = rendezvous(&[&key], before).expect("some");
            let b = rendezvous(&[&key], ["gw-1", "gw-2", "gw-3", "gw-4"]).expect("some");
            if a != b {
                assert_eq!(b, "gw-4", "a key may only move to the newcomer");
                moved += 1;
            }
        }
        // Roughly a quarter of the keys go to the newcomer.
        assert!((20..=80).contains(&moved), "moved {moved}");
        assert_eq!(rendezvous(&[b"k"], []), None);
    }
}
