//! The sweeper between packets: every [`EVERY`] packets the agent's conntrack sweeper
//! (`sweep::tick`) walks both maps as if the clock stood some time ahead (one of
//! [`AHEAD`], by turns: none, past UDP's timeout, past a reset's and a closing flow's,
//! past an established TCP flow's six hours), removing what it would remove then. The
//! programs go on with what is left, so their replies meet flows whose halves the
//! sweeper judged, and the per-packet properties hold across it. After each walk nothing
//! is left that the sweeper itself would remove at that clock (`sweep::fate`), which a
//! walk that stopped early or removed one half of an idle pair would break.

use std::{collections::BTreeMap, time::Duration};

use aya::maps::{HashMap, MapData};
use egress_agent::datapath::sweep::{self, CtKey, Fate};
use egress_common::maps;

use crate::testrun::Datapath;

/// Packets between two walks.
pub const EVERY: u64 = 1_024;
/// How far ahead of the clock each walk stands, by turns.
const AHEAD: [Duration; 5] = [
    Duration::ZERO,
    Duration::from_secs(11),
    Duration::from_secs(35),
    Duration::from_secs(125),
    Duration::from_secs(6 * 3600 + 1),
];

/// Walk `n` (counting from 0): the entries it removed, or what it left that it should
/// not have.
pub fn walk(dp: &mut Datapath, n: u64) -> Result<usize, String> {
    let ahead = AHEAD[(n % AHEAD.len() as u64) as usize];
    let now = sweep::now_ns() + ahead.as_nanos() as u64;
    let v4 = one::<egress_common::conntrack::CtKeyV4>(dp, maps::CT_V4, now)?;
    let v6 = one::<egress_common::conntrack::CtKeyV6>(dp, maps::CT_V6, now)?;
    Ok(v4 + v6)
}

fn one<K: CtKey>(dp: &mut Datapath, name: &str, now: u64) -> Result<usize, String> {
    let mut map: HashMap<&mut MapData, K, K::Entry> =
        HashMap::try_from(dp.map(name)).map_err(|e| format!("{name}: {e}"))?;
    let (mut flows, mut remaps) = (BTreeMap::new(), Vec::new());
    let mut cursor = None;
    let mut removed = 0;
    loop {
        let t = sweep::tick(
            &mut map,
            &mut cursor,
            usize::MAX,
            now,
            (&mut flows, &mut remaps),
        )
        .map_err(|e| format!("{name}: the sweeper failed: {e}"))?;
        removed += t.removed;
        if t.wrapped {
            break;
        }
    }
    let left: Vec<(K, K::Entry)> = map.iter().filter_map(Result::ok).collect();
    for (k, e) in &left {
        let partner = map.get(&k.partner(e), 0).ok();
        let fate = sweep::fate(k, e, partner.as_ref(), now);
        if fate != Fate::Keep {
            return Err(format!(
                "{name}: after a walk {:?} ahead the sweeper would still {fate:?} {k:?} \
                 ({e:?}, partner {partner:?})",
                Duration::from_nanos(now.saturating_sub(sweep::now_ns()))
            ));
        }
    }
    Ok(removed)
}
