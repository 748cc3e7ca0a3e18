//! The floor of an aborting pod's live flows (issue 45, item 3): once its aborts stop, the
//! flows its gateways count for it (`FLOWS_V4`, what `--max-flows-per-pod` holds against
//! it, and a SNAT port each) must come back to what its long-lived flows and the churn
//! account for, within the reset timeout and the sweeper's walk. A RST closes both
//! directions of a flow, which is over [`timeout::TCP_RESET`] after its last packet;
//! before that fix the other direction stayed established for 6 hours and the flow with it.
//!
//! What the churn accounts for: a connection open while a gateway failed or recovered may
//! leave its entries on a gateway that never sees its end (the RST takes another path, or
//! is lost); they stay established, for hours, by design. Such a flow is *stranded*:
//! neither of its entries saw a RST or a FIN, and it was last seen before the lab was
//! steady after the churn. An aborting pod has one connection open at a time, for a few
//! milliseconds, so the churn strands at most one per event.

use std::{
    collections::{BTreeMap, HashMap as StdHashMap},
    net::Ipv4Addr,
    time::Duration,
};

use anyhow::{Context as _, Result};
use aya::maps::{HashMap, Map, MapData};
use egress_agent::datapath::sweep::{self, CtKey as _, Fate};
use egress_common::{
    conntrack::{CtEntryV4, CtKeyV4, FlowCount, dir, state, timeout},
    maps as names,
};

use super::state::ct_entries;
use crate::lab::Lab;

/// How long after its aborts stop a pod's count must be at its floor: the reset timeout
/// (its flows are over 10 s after their last packet), the sweeper's next tick (which
/// removes them and writes the counts, a walk of these small maps being one tick), a tick
/// more for a busy machine, and a second for this check's own polling.
pub const WITHIN: Duration = Duration::from_nanos(timeout::TCP_RESET)
    .saturating_add(sweep::TICK.saturating_mul(2))
    .saturating_add(Duration::from_secs(1));

/// A pod's live flows as its conntrack entries explain them, over the nodes: those whose
/// original-direction entry the sweeper keeps (`sweep::fate`), which are the flows it
/// counts in `FLOWS_V4`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodFlows {
    /// A RST or a FIN crossed one of the flow's entries: this gateway saw it end.
    pub ended: u32,
    /// Neither entry saw an end, and the flow was last seen before the lab was steady:
    /// stranded by the churn.
    pub stranded: u32,
    /// Neither entry saw an end, last seen since: open.
    pub open: u32,
}

/// What a pod's live flows must come back to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Floor {
    /// Its long-lived flows through a gateway (`soak::flows`), running at the look.
    pub long_lived: u32,
    /// Flows the churn stranded ([`PodFlows::stranded`]).
    pub stranded: u32,
}

impl Floor {
    pub fn total(&self) -> u32 {
        self.long_lived + self.stranded
    }

    /// The gateways count exactly the long-lived and the stranded flows: every flow whose
    /// end was seen is gone (its port free, its place under the limit given back), and
    /// none that was counted is lost.
    pub fn holds(&self, counted: u32) -> bool {
        counted == self.total()
    }
}

/// How one flow's entries explain it: `None` when the sweeper does not keep it (it is not
/// counted), else whether its end was seen and when it was last seen. `e` is the
/// original-direction entry at `k`, `partner` the entry at its partner key.
fn explain(
    k: &CtKeyV4,
    e: &CtEntryV4,
    partner: Option<&CtEntryV4>,
    now: u64,
    steady_ns: u64,
) -> Option<Class> {
    if sweep::fate(k, e, partner, now) != Fate::Keep {
        return None;
    }
    let ended = |x: &CtEntryV4| x.state == state::RESET || x.state == state::CLOSING;
    if k.proto == TCP && (ended(e) || partner.is_some_and(ended)) {
        return Some(Class::Ended);
    }
    let last = partner.map_or(e.last_seen_ns, |p| p.last_seen_ns.max(e.last_seen_ns));
    Some(if last < steady_ns {
        Class::Stranded
    } else {
        Class::Open
    })
}

const TCP: u8 = 6;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Ended,
    Stranded,
    Open,
}

impl PodFlows {
    fn add(&mut self, c: Class) {
        match c {
            Class::Ended => self.ended += 1,
            Class::Stranded => self.stranded += 1,
            Class::Open => self.open += 1,
        }
    }
}

/// The flows of `pods` in every node's conntrack; `steady_ns` (`CLOCK_MONOTONIC_COARSE`,
/// the datapath's clock) is when the lab was steady after the churn.
pub fn pod_flows(
    lab: &Lab,
    pods: &[Ipv4Addr],
    steady_ns: u64,
) -> Result<BTreeMap<Ipv4Addr, PodFlows>> {
    let mut out: BTreeMap<Ipv4Addr, PodFlows> =
        pods.iter().map(|p| (*p, PodFlows::default())).collect();
    let now = sweep::now_ns();
    for node in lab.nodes().iter().map(|n| n.name) {
        let ct = ct_entries(&lab.bpffs_dir(node))?;
        let by_key: StdHashMap<CtKeyV4, CtEntryV4> = ct.iter().copied().collect();
        for (k, e) in ct.iter().filter(|(k, _)| k.dir == dir::ORIGINAL) {
            let Some(f) = out.get_mut(&Ipv4Addr::from(k.src)) else {
                continue;
            };
            if let Some(c) = explain(k, e, by_key.get(&k.partner(e)), now, steady_ns) {
                f.add(c);
            }
        }
    }
    Ok(out)
}

/// Live flows per pod as the gateways count them (`FLOWS_V4`), summed over the nodes.
pub fn counted(lab: &Lab) -> Result<BTreeMap<Ipv4Addr, u32>> {
    let mut out = BTreeMap::new();
    for node in lab.nodes().iter().map(|n| n.name) {
        let path = lab.bpffs_dir(node).join(names::FLOWS_V4);
        let data = MapData::from_pin(&path)
            .with_context(|| format!("failed to open {}", path.display()))?;
        let map: HashMap<MapData, [u8; 4], FlowCount> = HashMap::try_from(Map::HashMap(data))
            .with_context(|| format!("{} is not a hash map of flow counts", path.display()))?;
        for (pod, c) in map.iter().filter_map(Result::ok) {
            *out.entry(Ipv4Addr::from(pod)).or_default() += c.flows;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bed::{CtLike, Ip as _};

    const SEC: u64 = 1_000_000_000;

    /// A TCP flow's two entries, both in `st`, last seen at `seen`: (original key, its
    /// entry, reply key, its entry).
    fn flow(st: u8, seen: u64) -> (CtKeyV4, CtEntryV4, CtKeyV4, CtEntryV4) {
        let pod = Ipv4Addr::new(10, 244, 11, 20);
        let dest = Ipv4Addr::new(192, 168, 101, 100);
        let egress = Ipv4Addr::new(192, 168, 101, 50);
        let key = |src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16, d| CtKeyV4 {
            src: src.octets(),
            dst: dst.octets(),
            src_port_be: sport.to_be(),
            dst_port_be: dport.to_be(),
            proto: TCP,
            dir: d,
            _pad: [0; 2],
        };
        let like = CtLike {
            state: st,
            pod_node: Ipv4Addr::new(172, 18, 0, 2).into(),
            ifindex: 7,
            rule_id: 1,
            last_seen_ns: seen,
            next_hop: Default::default(),
        };
        (
            key(pod, dest, 40_000, 7, dir::ORIGINAL),
            Ipv4Addr::ct_entry(&like, egress, 40_000),
            key(dest, egress, 7, 40_000, dir::REPLY),
            Ipv4Addr::ct_entry(&like, pod, 40_000),
        )
    }

    #[test]
    fn a_flow_is_explained_by_what_its_entries_saw_and_when() {
        let now = 1_000 * SEC;
        let steady = now - 30 * SEC;
        let class = |st: u8, seen: u64, partner_st: Option<u8>| {
            let (k, e, pk, mut p) = flow(st, seen);
            assert_eq!(k.partner(&e), pk);
            assert_eq!(pk.partner(&p), k, "the partner's partner is the flow");
            if let Some(s) = partner_st {
                p.state = s;
            }
            explain(&k, &e, Some(&p), now, steady)
        };
        // Reset 5 s ago: still live, its end seen.
        assert_eq!(class(state::RESET, now - 5 * SEC, None), Some(Class::Ended));
        // Reset 11 s ago: over, not counted.
        assert_eq!(class(state::RESET, now - 11 * SEC, None), None);
        // Reset one way only (the other half never saw the RST), 11 s ago: over too.
        assert_eq!(
            class(state::RESET, now - 11 * SEC, Some(state::ESTABLISHED)),
            None
        );
        // Before the RST fix: the half the RST crossed closing, the other established.
        // Counted for 6 h, its end seen: never part of the floor.
        assert_eq!(
            class(state::CLOSING, now - 60 * SEC, Some(state::ESTABLISHED)),
            Some(Class::Ended)
        );
        // Established both ways, last seen during the churn: stranded.
        assert_eq!(
            class(state::ESTABLISHED, steady - SEC, None),
            Some(Class::Stranded)
        );
        // Established both ways, seen since the lab was steady: open.
        assert_eq!(
            class(state::ESTABLISHED, now - SEC, None),
            Some(Class::Open)
        );
    }

    #[test]
    fn the_floor_holds_at_exactly_its_flows() {
        let f = Floor {
            long_lived: 1,
            stranded: 2,
        };
        assert!(f.holds(3));
        assert!(!f.holds(4), "an aborted flow still counted");
        assert!(!f.holds(2), "a counted flow lost");
        assert!(WITHIN >= Duration::from_secs(10) + sweep::TICK);
    }
}
