//! The conntrack sweeper: removes both entries of every flow idle past its timeout.
//!
//! The datapath never deletes: a lookup treats the entries of a flow idle in both
//! directions as absent, and the port allocator takes such a flow's reply tuple over
//! (`egress-ebpf/src/conntrack.rs`). Without a sweeper the maps (LRU, 262,144 entries)
//! would only ever fill, and their size (the `CT_V4` / `CT_V6` metrics) would never go
//! down. The sweeper runs on a thread of its own, off the async runtime: every [`TICK`]
//! it reads up to [`SCAN_PER_TICK`] entries of each conntrack map in kernel batches
//! (`BPF_MAP_LOOKUP_BATCH`, whose cursor is a bucket index: deleting entries does not
//! restart it), and removes the dead ones. A full 262,144-entry map takes four ticks.
//! Removed entries are counted under `CT_EXPIRED` in the datapath's `COUNTERS` (CPU 0's
//! slot, which no program writes for that reason), so that the count survives agent
//! restarts and shows in `egress-agent maps` and in the metrics.
//!
//! The decision ([`fate`]) is the datapath's, on the same clock
//! (`bpf_ktime_get_coarse_ns` is `CLOCK_MONOTONIC_COARSE`): an entry idle past its timeout goes unless its partner (the other
//! direction's entry of the same flow) is still live. A packet that refreshes an entry
//! between the sweeper's read and its delete loses the flow's translation; the next
//! packet makes a new one. The window is a few microseconds at the edge of the timeout.

use std::{
    borrow::{Borrow, BorrowMut},
    collections::BTreeMap,
    fmt::Debug,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd},
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

use aya::{
    Pod,
    maps::{HashMap, IterableMap as _, Map, MapData, MapError, PerCpuArray, PerCpuValues},
};
use egress_common::{
    conntrack::FlowCount,
    counters::{Counter, reason},
    maps as names,
};

use super::{Error, Result};
pub use crate::family::conntrack::{CtKey, Flow, Outbox, Remap};
use crate::family::{Family, V4, V6};

/// How often the sweeper wakes.
pub const TICK: Duration = Duration::from_secs(2);
/// Entries read per tick and map: bounds the work of one tick.
pub const SCAN_PER_TICK: usize = 65_536;
/// Entries per `BPF_MAP_LOOKUP_BATCH` call.
const BATCH: usize = 4_096;

/// What becomes of an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// Live, or idle while the other direction is live (a one-way stream keeps both).
    Keep,
    /// Idle, and no partner: remove this entry (its partner is gone, or its slot now
    /// belongs to another flow, which is left alone).
    Remove,
    /// The flow is idle both ways: remove this entry and its partner.
    RemoveBoth,
}

/// The fate of the entry `e` at `key`, given the entry found at `key.partner(e)` (if
/// any), at `now` (`CLOCK_MONOTONIC_COARSE` ns). The datapath's `flow_live`, as a decision:
/// an entry that a RST crossed, idle past the reset timeout, takes its partner with it
/// however live the partner looks (it may never have seen the RST).
pub fn fate<K: CtKey>(key: &K, e: &K::Entry, partner: Option<&K::Entry>, now: u64) -> Fate {
    if !key.expired(e, now) {
        return Fate::Keep;
    }
    let pk = key.partner(e);
    match partner {
        // Still this flow's: the partner's own partner is `key`.
        Some(p) if pk.partner(p) == *key => {
            if key.reset_over(e, now) || pk.expired(p, now) {
                Fate::RemoveBoth
            } else {
                Fate::Keep
            }
        }
        _ => Fate::Remove,
    }
}

/// `CLOCK_MONOTONIC_COARSE` in nanoseconds: the datapath's clock
/// (`bpf_ktime_get_coarse_ns`).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out pointer; CLOCK_MONOTONIC_COARSE exists since Linux 2.6.32.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// Read up to `keys.len()` entries of a hash map or an array (`BPF_MAP_LOOKUP_BATCH`) from
/// `cursor` (a bucket or an index) on. `values` holds `keys.len()` values, or for a
/// per-CPU map as many times the possible CPUs (each CPU's slot padded to 8 bytes: `V`
/// is then the padded slot). Returns how many were read and the next cursor (`None`:
/// the walk reached the end).
pub fn lookup_batch<K: Pod, V: Pod>(
    fd: BorrowedFd<'_>,
    cursor: Option<u32>,
    keys: &mut [K],
    values: &mut [V],
) -> std::io::Result<(usize, Option<u32>)> {
    assert!(
        !keys.is_empty() && values.len().is_multiple_of(keys.len()),
        "a value (or one per CPU) for every key"
    );
    let in_batch = cursor.unwrap_or(0);
    let mut out_batch = 0u32;
    let mut attr = BatchAttr {
        in_batch: if cursor.is_some() {
            std::ptr::from_ref(&in_batch) as u64
        } else {
            0
        },
        out_batch: std::ptr::from_mut(&mut out_batch) as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count: keys.len() as u32,
        map_fd: fd.as_raw_fd() as u32,
        ..BatchAttr::default()
    };
    // SAFETY: `attr` describes buffers of `count` keys and values of the map's sizes
    // (the caller's types are the map's: checked by aya when it typed the map), and
    // 4-byte batch cursors (a hash map's bucket index).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_LOOKUP_BATCH,
            std::ptr::from_mut(&mut attr),
            size_of::<BatchAttr>() as u32,
        )
    };
    let n = attr.count as usize;
    if rc == 0 {
        return Ok((n, Some(out_batch)));
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENOENT) {
        // The end of the map; the last entries (if any) are in the buffers.
        return Ok((n, None));
    }
    Err(err)
}

/// What one tick did to one map.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TickStats {
    pub scanned: usize,
    pub removed: usize,
    /// The walk reached the end of the map (the next tick starts over).
    pub wrapped: bool,
}

/// Read up to `budget` entries of `map` from `cursor` on and remove the dead ones;
/// `cursor` is left where the next tick goes on. The live flows seen are added to
/// `flows`, by the pod that started them, and those whose port was remapped to `remaps`.
pub fn tick<T, K>(
    map: &mut HashMap<T, K, K::Entry>,
    cursor: &mut Option<u32>,
    budget: usize,
    now: u64,
    (flows, remaps): (&mut BTreeMap<K::Pod, u32>, &mut Vec<Remap>),
) -> Result<TickStats, MapError>
where
    T: BorrowMut<MapData> + Borrow<MapData>,
    K: CtKey,
{
    let mut stats = TickStats::default();
    // SAFETY: `Pod` types are valid all-zero.
    let mut keys: Vec<K> = vec![unsafe { std::mem::zeroed() }; BATCH];
    let mut values: Vec<K::Entry> = vec![unsafe { std::mem::zeroed() }; BATCH];
    while stats.scanned < budget {
        let (n, next) = lookup_batch(map.map().fd().as_fd(), *cursor, &mut keys, &mut values)
            .map_err(|io_error| {
                MapError::SyscallError(aya::sys::SyscallError {
                    call: "BPF_MAP_LOOKUP_BATCH",
                    io_error,
                })
            })?;
        stats.scanned += n;
        for (k, e) in keys[..n].iter().zip(&values[..n]) {
            // Cheap filter on the batch's copy; the decision reads the entries afresh.
            let (removed, live) = if k.expired(e, now) {
                sweep_one(map, k, now)
            } else {
                (0, true)
            };
            stats.removed += removed;
            if let (true, Some(pod)) = (live, k.original_pod()) {
                *flows.entry(pod).or_default() += 1;
                if let Some(r) = k.flow(e).and_then(|f| f.remap()) {
                    remaps.push(r);
                }
            }
        }
        *cursor = next;
        if next.is_none() {
            stats.wrapped = true;
            break;
        }
    }
    Ok(stats)
}

/// Decide on the entry at `key` and apply the decision; returns the entries removed and
/// whether the entry stays (a flow kept alive by its other direction).
fn sweep_one<T, K>(map: &mut HashMap<T, K, K::Entry>, key: &K, now: u64) -> (usize, bool)
where
    T: BorrowMut<MapData> + Borrow<MapData>,
    K: CtKey,
{
    let Ok(e) = map.get(key, 0) else {
        // Gone already (with its partner, earlier in this walk).
        return (0, false);
    };
    let pk = key.partner(&e);
    let p = map.get(&pk, 0).ok();
    match fate(key, &e, p.as_ref(), now) {
        Fate::Keep => (0, true),
        Fate::Remove => (usize::from(map.remove(key).is_ok()), false),
        Fate::RemoveBoth => (
            usize::from(map.remove(key).is_ok()) + usize::from(map.remove(&pk).is_ok()),
            false,
        ),
    }
}

/// Add `n` to the `CT_EXPIRED` counter (CPU 0's slot: no program counts this reason).
pub fn count_expired<T: BorrowMut<MapData> + Borrow<MapData>>(
    counters: &mut PerCpuArray<T, Counter>,
    n: usize,
) -> Result<(), MapError> {
    let mut v: Vec<Counter> = counters.get(&reason::CT_EXPIRED, 0)?.to_vec();
    if let Some(c) = v.first_mut() {
        c.packets += n as u64;
    }
    counters.set(reason::CT_EXPIRED, PerCpuValues::try_from(v)?, 0)
}

fn open(pin_dir: &Path, name: &'static str) -> Result<Map> {
    let data =
        MapData::from_pin(pin_dir.join(name)).map_err(|source| Error::Map { name, source })?;
    Map::from_map_data(data).map_err(|source| Error::Map { name, source })
}

/// One family's per-pod flow count over a walk of its conntrack map.
struct Recount<P> {
    /// Live flows seen so far in this walk, by pod.
    seen: BTreeMap<P, u32>,
    /// `FLOWS_*` as the walk began (`None`: no walk under way).
    at_start: Option<BTreeMap<P, u32>>,
    /// Remapped flows seen so far in this walk.
    remaps: Vec<Remap>,
    /// Those of the last whole walk.
    walked: Vec<Remap>,
}

impl<P> Default for Recount<P> {
    fn default() -> Self {
        Self {
            seen: BTreeMap::new(),
            at_start: None,
            remaps: Vec::new(),
            walked: Vec::new(),
        }
    }
}

/// The pod counts to write after a walk: what the walk saw, plus what the datapath added
/// since the walk began (flows opened meanwhile in buckets already walked). A flow opened
/// in a bucket not walked yet is counted twice until the next walk: the limit errs on the
/// strict side by at most one walk's new flows. `None`: remove the pod's entry.
pub fn recount<P: Ord + Copy>(
    seen: &BTreeMap<P, u32>,
    at_start: &BTreeMap<P, u32>,
    now: &BTreeMap<P, u32>,
) -> Vec<(P, Option<u32>)> {
    let mut out = Vec::new();
    for (pod, cur) in now {
        let added = cur.saturating_sub(at_start.get(pod).copied().unwrap_or(0));
        let n = seen.get(pod).copied().unwrap_or(0).saturating_add(added);
        if n != *cur {
            out.push((*pod, (n > 0).then_some(n)));
        }
    }
    for (pod, n) in seen {
        if !now.contains_key(pod) {
            out.push((*pod, Some(*n)));
        }
    }
    out
}

fn read_flows<P: Pod + Ord>(m: &HashMap<MapData, P, FlowCount>) -> BTreeMap<P, u32> {
    m.iter().flatten().map(|(k, v)| (k, v.flows)).collect()
}

/// One tick of one family: sweep, count, and write the counts at the end of a walk.
fn tick_family<F: Family>(
    pin_dir: &Path,
    cursor: &mut Option<u32>,
    recount_state: &mut Recount<F::Octets>,
    now: u64,
) -> Result<usize> {
    let ct_name = <F::Ct as names::Map>::SPEC.name;
    let flows_name = <F::Flows as names::Map>::SPEC.name;
    let mut ct: HashMap<MapData, F::CtKey, <F::CtKey as CtKey>::Entry> =
        HashMap::try_from(open(pin_dir, ct_name)?).map_err(|source| Error::Map {
            name: ct_name,
            source,
        })?;
    // An object without the flow maps (older pins): sweep only.
    let mut flows: Option<HashMap<MapData, F::Octets, FlowCount>> =
        if pin_dir.join(flows_name).exists() {
            Some(
                HashMap::try_from(open(pin_dir, flows_name)?).map_err(|source| Error::Map {
                    name: flows_name,
                    source,
                })?,
            )
        } else {
            None
        };
    if recount_state.at_start.is_none() {
        recount_state.at_start = Some(flows.as_ref().map(read_flows).unwrap_or_default());
        recount_state.seen.clear();
        recount_state.remaps.clear();
    }
    let stats = tick(
        &mut ct,
        cursor,
        SCAN_PER_TICK,
        now,
        (&mut recount_state.seen, &mut recount_state.remaps),
    )
    .map_err(|source| Error::Map {
        name: ct_name,
        source,
    })?;
    if stats.wrapped {
        let at_start = recount_state.at_start.take().unwrap_or_default();
        if let Some(flows) = flows.as_mut() {
            let now_counts = read_flows(flows);
            for (pod, n) in recount(&recount_state.seen, &at_start, &now_counts) {
                // A failed write is corrected by the next walk.
                let _ = match n {
                    Some(n) => flows.insert(pod, FlowCount { flows: n }, 0),
                    None => flows.remove(&pod),
                };
            }
        }
        recount_state.seen.clear();
        recount_state.walked = std::mem::take(&mut recount_state.remaps);
    }
    Ok(stats.removed)
}

/// The sweeper's state between ticks: where each map's walk goes on, and the flows per
/// pod counted so far in it.
#[derive(Default)]
struct Sweeper {
    cursor_v4: Option<u32>,
    cursor_v6: Option<u32>,
    flows_v4: Recount<[u8; 4]>,
    flows_v6: Recount<[u8; 16]>,
}

impl Sweeper {
    /// One tick over both families. The maps are opened from their pins each tick, so
    /// that re-pinned maps (`restore_pins`) are the ones swept.
    fn tick(&mut self, pin_dir: &Path, outbox: &Outbox) -> Result<usize> {
        let now = now_ns();
        let mut removed = tick_family::<V4>(pin_dir, &mut self.cursor_v4, &mut self.flows_v4, now)?;
        if pin_dir.join(names::CT_V6).exists() {
            removed += tick_family::<V6>(pin_dir, &mut self.cursor_v6, &mut self.flows_v6, now)?;
        }
        let (v4, v6) = (&self.flows_v4.walked, &self.flows_v6.walked);
        let mut out = outbox
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if out.len() != v4.len() + v6.len() || !out.iter().eq(v4.iter().chain(v6)) {
            *out = v4.iter().chain(v6).copied().collect();
        }
        drop(out);
        if removed > 0 {
            let name = names::COUNTERS;
            let mut c: PerCpuArray<MapData, Counter> = PerCpuArray::try_from(open(pin_dir, name)?)
                .map_err(|source| Error::Map { name, source })?;
            count_expired(&mut c, removed).map_err(|source| Error::Map { name, source })?;
        }
        Ok(removed)
    }
}

/// Start the sweeper on a thread of its own for the maps pinned under `pin_dir`. It runs
/// for the life of the process, and keeps `outbox` to the remapped flows it last walked.
pub fn start(pin_dir: &Path, outbox: Outbox) -> std::io::Result<thread::JoinHandle<()>> {
    let pin_dir: PathBuf = pin_dir.to_owned();
    thread::Builder::new()
        .name("ct-sweeper".into())
        .spawn(move || {
            crate::priority::give_way();
            let mut s = Sweeper::default();
            let mut last_error = None;
            loop {
                thread::sleep(TICK);
                match s.tick(&pin_dir, &outbox) {
                    Ok(n) => {
                        if n > 0 {
                            tracing::debug!(removed = n, "conntrack: removed expired entries");
                        }
                        last_error = None;
                    }
                    Err(e) => {
                        // Once per distinct error, not every tick.
                        let msg = e.to_string();
                        if last_error.as_ref() != Some(&msg) {
                            tracing::warn!("failed to sweep expired conntrack entries: {msg}");
                            last_error = Some(msg);
                        }
                    }
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use egress_common::{
        conntrack::{CtEntryV4, CtEntryV6, CtKeyV4, CtKeyV6, dir, state, timeout},
        underlay,
    };

    use super::*;

    const SEC: u64 = 1_000_000_000;
    const NOW: u64 = 10_000 * SEC;
    const POD: [u8; 4] = [10, 244, 1, 5];
    const DEST: [u8; 4] = [192, 168, 50, 10];
    const EGRESS: [u8; 4] = [192, 168, 50, 100];

    fn entry(xlate: [u8; 4], port: u16, st: u8, age: u64) -> CtEntryV4 {
        CtEntryV4 {
            xlate_addr: xlate,
            xlate_port_be: port.to_be(),
            state: st,
            _pad0: 0,
            pod_node: underlay::from_v4([172, 18, 0, 2]),
            ifindex: 7,
            rule_id: 1,
            last_seen_ns: NOW - age,
            next_hop: Default::default(),
        }
    }

    /// Both entries of a flow: original first, reply second.
    type Flow = [(CtKeyV4, CtEntryV4); 2];

    /// The UDP or TCP flow POD:5000 -> DEST:53 as EGRESS:6000: (original key, its
    /// entry, reply key, its entry), last seen `orig_age` and `reply_age` ago.
    fn flow(proto: u8, st: u8, orig_age: u64, reply_age: u64) -> Flow {
        let key = |src, dst, sport: u16, dport: u16, d| CtKeyV4 {
            src,
            dst,
            src_port_be: sport.to_be(),
            dst_port_be: dport.to_be(),
            proto,
            dir: d,
            _pad: [0; 2],
        };
        [
            (
                key(POD, DEST, 5000, 53, dir::ORIGINAL),
                entry(EGRESS, 6000, st, orig_age),
            ),
            (
                key(DEST, EGRESS, 53, 6000, dir::REPLY),
                entry(POD, 5000, st, reply_age),
            ),
        ]
    }

    fn fate_of(f: &Flow, which: usize, partner: Option<&CtEntryV4>) -> Fate {
        fate(&f[which].0, &f[which].1, partner, NOW)
    }

    #[test]
    fn the_partner_of_the_partner_is_the_key() {
        for [(ok, oe), (rk, re)] in [
            flow(17, state::ESTABLISHED, 0, 0),
            flow(6, state::NEW, 0, 0),
        ] {
            assert_eq!(ok.partner(&oe), rk);
            assert_eq!(rk.partner(&re), ok);
        }
    }

    #[test]
    fn expiry_decisions() {
        let udp = timeout::UDP;
        let cases: &[(&str, Flow, usize, bool, Fate)] = &[
            (
                "fresh UDP flow",
                flow(17, state::ESTABLISHED, SEC, SEC),
                0,
                true,
                Fate::Keep,
            ),
            (
                "UDP idle exactly its timeout: not yet",
                flow(17, state::ESTABLISHED, udp, udp),
                0,
                true,
                Fate::Keep,
            ),
            (
                "UDP idle past its timeout both ways: both go",
                flow(17, state::ESTABLISHED, udp + SEC, udp + SEC),
                0,
                true,
                Fate::RemoveBoth,
            ),
            (
                "the same, seen from the reply entry",
                flow(17, state::ESTABLISHED, udp + SEC, udp + SEC),
                1,
                true,
                Fate::RemoveBoth,
            ),
            (
                "one-way stream (replies idle): the reply entry stays",
                flow(17, state::ESTABLISHED, SEC, 200 * SEC),
                1,
                true,
                Fate::Keep,
            ),
            (
                "destination streaming, pod silent: the original entry stays",
                flow(17, state::ESTABLISHED, 200 * SEC, SEC),
                0,
                true,
                Fate::Keep,
            ),
            (
                "idle, partner gone: this entry goes",
                flow(17, state::ESTABLISHED, 200 * SEC, 200 * SEC),
                0,
                false,
                Fate::Remove,
            ),
            (
                "TCP established idle an hour: stays (6 h)",
                flow(6, state::ESTABLISHED, 3600 * SEC, 3600 * SEC),
                0,
                true,
                Fate::Keep,
            ),
            (
                "TCP closing idle 31 s: goes",
                flow(6, state::CLOSING, 31 * SEC, 31 * SEC),
                0,
                true,
                Fate::RemoveBoth,
            ),
            (
                "TCP SYN never answered, 61 s: goes",
                flow(6, state::NEW, 61 * SEC, 61 * SEC),
                1,
                true,
                Fate::RemoveBoth,
            ),
            (
                "ICMP echo 31 s: goes",
                flow(1, state::ESTABLISHED, 31 * SEC, 31 * SEC),
                0,
                true,
                Fate::RemoveBoth,
            ),
        ];
        for (name, f, which, with_partner, want) in cases {
            let partner = with_partner.then_some(&f[1 - which].1);
            assert_eq!(fate_of(f, *which, partner), *want, "{name}");
        }
    }

    /// A RST crossed the flow: 10 s after its last packet it is over, both entries go,
    /// even when the other direction's entry missed the RST (an entry of an older
    /// datapath, or a lost race) and still says established for 6 h. Before, such a flow
    /// kept its SNAT port and its place under `--max-flows-per-pod` for 6 hours.
    #[test]
    fn a_reset_flow_goes_after_ten_seconds_with_its_partner() {
        let reset_both = |age: u64| {
            let mut f = flow(6, state::RESET, age, age);
            f[1].1.state = state::RESET;
            f
        };
        let reset_one = |age: u64| {
            let mut f = flow(6, state::ESTABLISHED, age, age);
            f[1].1.state = state::RESET;
            f
        };
        assert_eq!(timeout::TCP_RESET, 10 * SEC);
        let f = reset_both(11 * SEC);
        assert_eq!(fate_of(&f, 0, Some(&f[1].1)), Fate::RemoveBoth);
        assert_eq!(fate_of(&f, 1, Some(&f[0].1)), Fate::RemoveBoth);
        let f = reset_both(9 * SEC);
        assert_eq!(fate_of(&f, 0, Some(&f[1].1)), Fate::Keep, "within 10 s");
        // The original entry never saw the RST: the reset reply entry takes it along.
        let f = reset_one(11 * SEC);
        assert_eq!(fate_of(&f, 1, Some(&f[0].1)), Fate::RemoveBoth);
        // Seen from the established entry it is not expired: kept until the reset
        // entry's turn in the walk, which removes both.
        assert_eq!(fate_of(&f, 0, Some(&f[1].1)), Fate::Keep);
        // A FIN is not a RST: a half-closed flow lives while the other direction does.
        let mut f = flow(6, state::ESTABLISHED, 60 * SEC, 60 * SEC);
        f[1].1.state = state::CLOSING;
        assert_eq!(fate_of(&f, 1, Some(&f[0].1)), Fate::Keep);
    }

    /// The allocator gave the idle flow's reply tuple to a new flow: the old original
    /// entry goes, the new flow's reply entry is not touched.
    #[test]
    fn an_orphan_whose_reply_tuple_was_reused_goes_alone() {
        let old = flow(17, state::ESTABLISHED, 200 * SEC, 200 * SEC);
        let new_reply = entry([10, 244, 2, 9], 7000, state::ESTABLISHED, 0);
        assert_eq!(fate_of(&old, 0, Some(&new_reply)), Fate::Remove);
        // Even if the new flow is idle too: it is not this flow's partner.
        let new_reply = entry([10, 244, 2, 9], 7000, state::ESTABLISHED, 200 * SEC);
        assert_eq!(fate_of(&old, 0, Some(&new_reply)), Fate::Remove);
    }

    #[test]
    fn ipv6_keys_pair_up_the_same_way() {
        let ok = CtKeyV6 {
            src: [0xfd; 16],
            dst: [0x20; 16],
            src_port_be: 5000u16.to_be(),
            dst_port_be: 53u16.to_be(),
            proto: 17,
            dir: dir::ORIGINAL,
            _pad: [0; 2],
        };
        let e = |xlate, port: u16, age| CtEntryV6 {
            xlate_addr: xlate,
            xlate_port_be: port.to_be(),
            state: state::ESTABLISHED,
            _pad0: 0,
            pod_node: underlay::from_v4([172, 18, 0, 2]),
            ifindex: 7,
            rule_id: 1,
            _pad1: 0,
            last_seen_ns: NOW - age,
            next_hop: Default::default(),
        };
        let oe = e([0x21; 16], 6000, 121 * SEC);
        let rk = ok.partner(&oe);
        let re = e([0xfd; 16], 5000, 121 * SEC);
        assert_eq!(rk.partner(&re), ok);
        assert_eq!(fate(&ok, &oe, Some(&re), NOW), Fate::RemoveBoth);
        let re = e([0xfd; 16], 5000, SEC);
        assert_eq!(fate(&ok, &oe, Some(&re), NOW), Fate::Keep);
    }

    #[test]
    fn a_walk_recounts_each_pods_flows_keeping_what_the_datapath_added_meanwhile() {
        let m = |v: &[(u8, u32)]| -> BTreeMap<u8, u32> { v.iter().copied().collect() };
        // Pod 1: 10 counted, 4 left (expired or evicted), 2 opened during the walk.
        // Pod 2: all its flows gone. Pod 3: unknown to the map (recreated): written.
        // Pod 4: exact already.
        let seen = m(&[(1, 4), (3, 7), (4, 5)]);
        let at_start = m(&[(1, 10), (2, 3), (4, 5)]);
        let now = m(&[(1, 12), (2, 3), (4, 5)]);
        assert_eq!(
            recount(&seen, &at_start, &now),
            [(1, Some(6)), (2, None), (3, Some(7))]
        );
    }
}
