//! The agent's conntrack sweeper against the real object's `CT_V4` and `COUNTERS`: a
//! table of 10,000 UDP flows (20,000 entries), some idle past the timeout both ways,
//! some one-way streams, some fresh, swept in bounded ticks until the walk wraps. What
//! is left is exactly the live flows, and `CT_EXPIRED` counts what went.

use std::net::Ipv4Addr;

use aya::maps::{HashMap, MapData, PerCpuArray};
use egress_agent::datapath::sweep::{self, TickStats};
use egress_common::{
    conntrack::{CtEntryV4, CtKeyV4, dir, state, timeout},
    counters::{Counter, reason},
    maps, underlay,
};
use egress_tests::testrun::{Datapath, in_netns, ktime_ns};

const SEC: u64 = 1_000_000_000;
const DEST: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 7);
const EGRESS: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 50);

/// How a flow's two entries were last seen, in seconds ago (original, reply).
#[derive(Clone, Copy)]
enum Kind {
    /// Idle past the UDP timeout both ways: both entries go.
    Idle,
    /// Pod streaming, replies idle: both stay.
    OneWay,
    /// Both fresh.
    Fresh,
}

fn ages(kind: Kind) -> (u64, u64) {
    let past = timeout::UDP / SEC + 5;
    match kind {
        Kind::Idle => (past, past + 10),
        Kind::OneWay => (1, past),
        Kind::Fresh => (0, 0),
    }
}

/// Flow `i`: pod 10.244.(i / 250).(i % 250 + 1):5000 -> DEST:53 as EGRESS:(10000 + i).
fn insert_flow(dp: &mut Datapath, i: u32, kind: Kind, now: u64) {
    let pod = [10, 244, (i / 250) as u8, (i % 250 + 1) as u8];
    let port = 10_000 + i as u16;
    let (orig_age, reply_age) = ages(kind);
    let entry = |xlate: [u8; 4], xport: u16, age: u64| CtEntryV4 {
        xlate_addr: xlate,
        xlate_port_be: xport.to_be(),
        state: state::ESTABLISHED,
        _pad0: 0,
        pod_node: underlay::from_v4([192, 168, 0, 20]),
        ifindex: 1,
        rule_id: 1,
        last_seen_ns: now - age * SEC,
        next_hop: Default::default(),
    };
    let key = |src, dst, sport: u16, dport: u16, d| CtKeyV4 {
        src,
        dst,
        src_port_be: sport.to_be(),
        dst_port_be: dport.to_be(),
        proto: 17,
        dir: d,
        _pad: [0; 2],
    };
    dp.ct_insert(
        key(pod, DEST.octets(), 5000, 53, dir::ORIGINAL),
        entry(EGRESS.octets(), port, orig_age),
    );
    dp.ct_insert(
        key(DEST.octets(), EGRESS.octets(), 53, port, dir::REPLY),
        entry(pod, 5000, reply_age),
    );
}

fn kind_of(i: u32) -> Kind {
    match i % 4 {
        0 | 1 => Kind::Idle,
        2 => Kind::OneWay,
        _ => Kind::Fresh,
    }
}

#[test]
fn the_sweeper_drains_idle_flows_in_bounded_ticks_and_counts_them() {
    in_netns(|| {
        let mut dp = Datapath::load();
        let now = ktime_ns();
        const FLOWS: u32 = 10_000;
        for i in 0..FLOWS {
            insert_flow(&mut dp, i, kind_of(i), now);
        }
        assert_eq!(dp.ct().len(), 2 * FLOWS as usize);

        let mut ct: HashMap<&mut MapData, CtKeyV4, CtEntryV4> =
            HashMap::try_from(dp.map(maps::CT_V4)).unwrap();
        let mut cursor = None;
        let mut ticks = Vec::new();
        let budget = 8_192;
        let mut flows = std::collections::BTreeMap::new();
        let mut remaps = Vec::new();
        loop {
            let t = sweep::tick(
                &mut ct,
                &mut cursor,
                budget,
                sweep::now_ns(),
                (&mut flows, &mut remaps),
            )
            .unwrap();
            // Bounded: a tick reads at most its budget plus the rest of one batch.
            assert!(
                t.scanned < budget + 4_096,
                "tick read {} entries",
                t.scanned
            );
            ticks.push(t);
            if t.wrapped {
                break;
            }
            assert!(ticks.len() < 10, "the walk never wrapped: {ticks:?}");
        }
        let removed: usize = ticks.iter().map(|t: &TickStats| t.removed).sum();
        eprintln!("ticks: {ticks:?}");
        assert!(ticks.len() >= 2, "{ticks:?}");

        let idle = (0..FLOWS)
            .filter(|&i| matches!(kind_of(i), Kind::Idle))
            .count();
        assert_eq!(removed, 2 * idle);
        // The live flows, counted by the pod that started each (one flow per pod here).
        let live: std::collections::BTreeMap<[u8; 4], u32> = (0..FLOWS)
            .filter(|&i| !matches!(kind_of(i), Kind::Idle))
            .map(|i| ([10, 244, (i / 250) as u8, (i % 250 + 1) as u8], 1))
            .collect();
        assert_eq!(flows, live, "live flows per pod");
        // Every flow here was given another port than the pod's 5000: each live one is a
        // remap to share, none of the idle ones.
        let mut shared: Vec<(std::net::SocketAddr, u16)> =
            remaps.iter().map(|r| (r.pod, r.egress.port())).collect();
        shared.sort();
        let mut want: Vec<(std::net::SocketAddr, u16)> = (0..FLOWS)
            .filter(|&i| !matches!(kind_of(i), Kind::Idle))
            .map(|i| {
                let pod = std::net::Ipv4Addr::new(10, 244, (i / 250) as u8, (i % 250 + 1) as u8);
                ((pod, 5000).into(), (10_000 + i) as u16)
            })
            .collect();
        want.sort();
        assert_eq!(shared, want, "remapped live flows");
        assert!(
            remaps
                .iter()
                .all(|r| r.dst == (DEST, 53).into() && r.egress.ip() == EGRESS && r.proto == 17),
            "{:?}",
            remaps.first()
        );
        let left = dp.ct();
        assert_eq!(left.len(), 2 * (FLOWS as usize - idle));
        // What is left is the one-way and fresh flows, both directions of each.
        for (k, _) in &left {
            let port = if k.dir == dir::ORIGINAL {
                None
            } else {
                Some(u16::from_be(k.dst_port_be))
            };
            if let Some(p) = port {
                let i = u32::from(p - 10_000);
                assert!(!matches!(kind_of(i), Kind::Idle), "flow {i} left behind");
            }
        }

        // A second pass finds nothing more to do.
        let mut ct: HashMap<&mut MapData, CtKeyV4, CtEntryV4> =
            HashMap::try_from(dp.map(maps::CT_V4)).unwrap();
        let mut cursor = None;
        let t = sweep::tick(
            &mut ct,
            &mut cursor,
            usize::MAX,
            sweep::now_ns(),
            (&mut flows, &mut Vec::new()),
        )
        .unwrap();
        assert_eq!((t.removed, t.wrapped), (0, true));

        let mut counters: PerCpuArray<&mut MapData, Counter> =
            PerCpuArray::try_from(dp.map(maps::COUNTERS)).unwrap();
        sweep::count_expired(&mut counters, removed).unwrap();
        sweep::count_expired(&mut counters, 1).unwrap();
        assert_eq!(
            dp.counters().get(&reason::CT_EXPIRED).copied(),
            Some(removed as u64 + 1)
        );
    });
}

#[test]
fn an_empty_map_wraps_at_once() {
    in_netns(|| {
        let mut dp = Datapath::load();
        let mut ct: HashMap<&mut MapData, CtKeyV4, CtEntryV4> =
            HashMap::try_from(dp.map(maps::CT_V4)).unwrap();
        let mut cursor = None;
        let mut flows = std::collections::BTreeMap::<[u8; 4], u32>::new();
        let t = sweep::tick(
            &mut ct,
            &mut cursor,
            100,
            sweep::now_ns(),
            (&mut flows, &mut Vec::new()),
        )
        .unwrap();
        assert_eq!(
            t,
            TickStats {
                scanned: 0,
                removed: 0,
                wrapped: true
            }
        );
    });
}
