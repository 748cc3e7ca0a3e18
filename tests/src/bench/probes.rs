//! What the agents' liveness probes cost at a given cluster shape: hellos per second per
//! node and in the cluster, their size on the wire (real hellos, encoded), and the CPU a
//! gateway and a worker spend on one probe interval (measured in this process, on the
//! agent's own tracker and codec). Hellos are version 2, signed under a cluster key
//! (HMAC-SHA256), as `--liveness-key-file` has them.

use std::{
    collections::{BTreeMap, BTreeSet},
    hint::black_box,
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use egress_agent::liveness::{
    Claim, Membership, Settings,
    hello::{Hello, HelloRef, VERSION},
    keys::{Key, Keyring},
    tracker::{Outbox, Tracker},
};

use super::report::{Table, thousands};
use crate::alloc;

/// The cluster key the hellos are signed with.
fn keys() -> Keyring {
    Keyring::new(vec![Key::new(vec![7; 32])])
}

/// Ethernet + IPv4 + UDP headers around a hello.
const WIRE_OVERHEAD: usize = 14 + 20 + 8;

struct Shape {
    nodes: usize,
    gateways: usize,
    /// Egress IPs held per gateway (70 addresses per network over 10 gateways).
    held: usize,
}

fn name(i: usize, gateways: usize) -> String {
    if i < gateways {
        format!("gateway-{i:02}")
    } else {
        format!("worker-{i:03}")
    }
}

fn addr(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, (i / 250) as u8, (i % 250 + 1) as u8))
}

fn members(shape: &Shape) -> Membership {
    let all: Vec<String> = (0..shape.nodes).map(|i| name(i, shape.gateways)).collect();
    Membership {
        nodes: all
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), addr(i)))
            .collect(),
        aliases: BTreeMap::new(),
        gateways: all[..shape.gateways].iter().cloned().collect(),
        expected: all.iter().cloned().collect(),
        speakers: all.iter().cloned().collect(),
    }
}

fn claims(gw: usize, held: usize) -> BTreeMap<IpAddr, Claim> {
    (0..held)
        .map(|k| {
            (
                IpAddr::V4(Ipv4Addr::new(198, 51, gw as u8, k as u8 + 10)),
                Claim {
                    interface: "ens224".to_owned(),
                    epoch: 3,
                },
            )
        })
        .collect()
}

/// Which code takes and sends the hellos of the node measured.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    /// As the agent does since e870be5: written into one buffer kept from
    /// interval to interval (`Tracker::write_hellos`), read in place, the lists of a
    /// hello that repeats its sender's last ones neither decoded nor allocated
    /// (`HelloRef::parse`, `Tracker::on_received`).
    Now,
    /// As the agent did up to d8df172: each hello built whole (`Tracker::hello_for`) and
    /// encoded into a buffer of its own; each received one decoded whole
    /// (`Hello::decode`) and taken (`Tracker::on_hello_version`); and as it did up to
    /// 0a25b34, the view re-assessed whole every interval (`Tracker::view`) where now it
    /// is only when something it reads changed (`Tracker::observe_changed`).
    Before,
}

/// One interval of the measured node: the time it spent sending, receiving and
/// re-assessing, and the allocations it made per hello (`None`: not counted).
#[derive(Default)]
struct Interval {
    time: Duration,
    sent: usize,
    received: usize,
    sent_allocs: Option<u64>,
    received_allocs: Option<u64>,
}

/// Every node's tracker and outbox; each interval every node sends its hellos and takes
/// those it receives (so that the `seen` lists stay full, as in a live cluster).
struct Cluster {
    ts: Vec<Tracker>,
    outs: Vec<Outbox>,
    by_addr: BTreeMap<IpAddr, usize>,
    keys: Keyring,
}

impl Cluster {
    fn new(shape: &Shape, settings: Settings, t0: Instant) -> Self {
        let m = members(shape);
        let ts = (0..shape.nodes)
            .map(|i| {
                let mut t = Tracker::new(&name(i, shape.gateways), settings, i as u32 + 1, t0);
                t.set_members(m.clone());
                if i < shape.gateways {
                    t.set_local(BTreeSet::new(), claims(i, shape.held));
                }
                t
            })
            .collect();
        Self {
            ts,
            outs: (0..shape.nodes).map(|_| Outbox::default()).collect(),
            by_addr: (0..shape.nodes).map(|i| (addr(i), i)).collect(),
            keys: keys(),
        }
    }

    /// One interval at `now`, node `measured` on `path` (timed, its allocations counted).
    fn interval(&mut self, now: Instant, measured: usize, path: Path) -> Interval {
        let mut m = Interval::default();
        let mut sent: Vec<(usize, usize, Vec<u8>)> = Vec::new();
        for i in 0..self.ts.len() {
            if i == measured && path == Path::Before {
                let start = Instant::now();
                let (hellos, allocs) = alloc::during(|| {
                    let t = &mut self.ts[i];
                    let targets = t.targets().to_vec();
                    let hellos: Vec<_> = targets
                        .into_iter()
                        .filter_map(|(to, ip)| {
                            let version = t.version_for(&to);
                            let b = t.hello_for(&to, now).encode(version, &self.keys).ok()?;
                            Some((ip, black_box(b)))
                        })
                        .collect();
                    hellos
                });
                m.time += start.elapsed();
                m.sent = hellos.len();
                m.sent_allocs = allocs;
                sent.extend(
                    hellos
                        .into_iter()
                        .map(|(ip, b)| (i, self.by_addr[&ip], b.to_vec())),
                );
                continue;
            }
            let start = Instant::now();
            let ((), allocs) = alloc::during(|| {
                black_box(self.ts[i].write_hellos(now, 0, (&self.keys, &[]), &mut self.outs[i]));
            });
            if i == measured {
                m.time += start.elapsed();
                m.sent = self.outs[i].hellos.len();
                m.sent_allocs = allocs;
            }
            let out = &self.outs[i];
            sent.extend(
                out.hellos
                    .iter()
                    .map(|(ip, r)| (i, self.by_addr[ip], out.bytes[r.clone()].to_vec())),
            );
        }
        let mut received_allocs = Some(0);
        for (from, to, b) in sent {
            let t = &mut self.ts[to];
            let start = Instant::now();
            let ((), allocs) = alloc::during(|| {
                if to == measured && path == Path::Before {
                    if let Ok(r) = Hello::decode(&b, &self.keys) {
                        let _ = black_box(t.on_hello_version(r.hello, r.version, addr(from), now));
                    }
                } else if let Ok(h) = HelloRef::parse(&b, &self.keys) {
                    let _ = black_box(t.on_received(&h, addr(from), now));
                }
            });
            if to == measured {
                m.time += start.elapsed();
                m.received += 1;
                received_allocs = received_allocs.zip(allocs).map(|(a, b)| a + b);
            }
        }
        m.received_allocs = received_allocs;
        for (i, t) in self.ts.iter_mut().enumerate() {
            let start = Instant::now();
            if i == measured && path == Path::Before {
                // Re-assessed whole, as every interval did up to 0a25b34.
                black_box(t.view(now));
            } else {
                black_box(t.observe_changed(now));
            }
            if i == measured {
                m.time += start.elapsed();
            }
        }
        m
    }
}

/// Node `measured`'s mean interval on `path` over `rounds` intervals, after two
/// untimed ones (its first hellos and the buffers' growth), the first at `t0` + one interval.
fn measure(
    c: &mut Cluster,
    t0: Instant,
    interval: Duration,
    (measured, path): (usize, Path),
    rounds: u32,
) -> Interval {
    let mut total = Interval {
        sent_allocs: Some(0),
        received_allocs: Some(0),
        ..Interval::default()
    };
    for r in 0..rounds + 2 {
        let i = c.interval(t0 + interval * (r + 1), measured, path);
        if r < 2 {
            continue;
        }
        total.time += i.time;
        total.sent += i.sent;
        total.received += i.received;
        total.sent_allocs = total.sent_allocs.zip(i.sent_allocs).map(|(a, b)| a + b);
        total.received_allocs = total
            .received_allocs
            .zip(i.received_allocs)
            .map(|(a, b)| a + b);
    }
    total.time /= rounds;
    total
}

/// Allocations per hello sent and received, by a gateway and by a worker, in the steady
/// state of the 100-node cluster (the agent's code as it runs); `None` where this binary
/// does not count allocations (see [`alloc::Counting`]).
pub fn allocations_per_hello() -> Option<[f64; 4]> {
    let shape = SHAPE;
    let settings = Settings::default();
    let t0 = Instant::now();
    let mut c = Cluster::new(&shape, settings, t0);
    let per = |i: &Interval| -> Option<[f64; 2]> {
        Some([
            i.sent_allocs? as f64 / i.sent.max(1) as f64,
            i.received_allocs? as f64 / i.received.max(1) as f64,
        ])
    };
    let g = measure(&mut c, t0, settings.interval, (0, Path::Now), 5);
    let w = measure(
        &mut c,
        t0 + settings.interval * 7,
        settings.interval,
        (shape.gateways, Path::Now),
        5,
    );
    let (g, w) = (per(&g)?, per(&w)?);
    Some([g[0], g[1], w[0], w[1]])
}

/// The cluster measured: 100 nodes, 10 gateways holding 7 egress IPs each.
const SHAPE: Shape = Shape {
    nodes: 100,
    gateways: 10,
    held: 7,
};

/// The probe cost table for 100 nodes and 10 gateways at the default settings.
pub fn table(quick: bool) -> Table {
    let shape = SHAPE;
    let settings = Settings::default();
    let per_s = 1.0 / settings.interval.as_secs_f64();
    let t0 = Instant::now();
    let mut c = Cluster::new(&shape, settings, t0);
    let (g, w) = (0usize, shape.gateways);
    // Two intervals for every node's first hellos, then sizes of real hellos: a
    // gateway's (with its claims and seen list) and a worker's.
    for r in 1..=2 {
        c.interval(t0 + settings.interval * r, usize::MAX, Path::Now);
    }
    let size = |from: usize, to: usize, c: &mut Cluster| {
        let to_name = name(to, shape.gateways);
        c.ts[from]
            .hello_for(&to_name, t0)
            .encode(VERSION, &c.keys)
            .map(|b| b.len())
            .unwrap_or(0)
    };
    let gw_hello = size(g, w, &mut c);
    let wk_hello = size(w, g, &mut c);
    let rounds = if quick { 50 } else { 200 };
    // Alternate the paths in blocks, so that both see the same machine.
    let mut at = t0 + settings.interval * 3;
    let mut run = |node: usize, path: Path, c: &mut Cluster| {
        let i = measure(c, at, settings.interval, (node, path), rounds);
        at += settings.interval * (rounds + 2);
        i
    };
    let gw_now = run(g, Path::Now, &mut c);
    let gw_before = run(g, Path::Before, &mut c);
    let wk_now = run(w, Path::Now, &mut c);
    let wk_before = run(w, Path::Before, &mut c);
    let (gw_targets, wk_targets) = (gw_now.sent / rounds as usize, wk_now.sent / rounds as usize);
    let gw_out = gw_targets as f64 * per_s;
    let gw_in = (shape.nodes - 1) as f64 * per_s;
    let wk_out = wk_targets as f64 * per_s;
    let wk_in = shape.gateways as f64 * per_s;
    let cluster = shape.gateways as f64 * gw_out + (shape.nodes - shape.gateways) as f64 * wk_out;
    let mbit = |pps: f64, bytes: usize| pps * (bytes + WIRE_OVERHEAD) as f64 * 8.0 / 1e6;
    let cpu = |d: Duration| d.as_secs_f64() / settings.interval.as_secs_f64() * 100.0;
    let row = |what: &str, value: String, notes: &str| {
        vec![what.to_owned(), format!("**{value}**"), notes.to_owned()]
    };
    let allocs = |i: &Interval| match (i.sent_allocs, i.received_allocs) {
        (Some(s), Some(r)) => format!(
            "{:.1} per hello sent, {:.1} per hello received",
            s as f64 / i.sent.max(1) as f64,
            r as f64 / i.received.max(1) as f64
        ),
        _ => "not counted (the allocator is not this binary's)".to_owned(),
    };
    Table {
        title: "Liveness probes".to_owned(),
        intro: vec![format!(
            "The cost of the agents' hellos (docs/failover.md) for {} nodes of which {} are \
             gateways holding {} egress IPs each, at the default settings: one hello every {} \
             ms to each peer, {} misses (detection {} ms, {} ms with the relayed view). A \
             gateway greets every node; a worker greets every gateway. Sizes are of real \
             hellos encoded by the agent's codec; CPU is one probe interval of one node \
             (write its hellos, take every hello it receives, re-assess), timed in this \
             process on the agent's own tracker and codec, averaged over {rounds} \
             intervals, with every other node sending and taking its hellos meanwhile. \
             Now: as the agent does it (hellos written into one buffer kept from interval \
             to interval; a received hello read in place, its lists decoded only when \
             they differ from its sender's last); before: as it did up to d8df172 (each \
             hello built whole and encoded into a buffer of its own, each received one \
             decoded whole, and as up to 0a25b34 the view re-assessed whole every \
             interval), in the same run, alternated.",
            shape.nodes,
            shape.gateways,
            shape.held,
            settings.interval.as_millis(),
            settings.misses,
            settings.detection().as_millis(),
            (settings.detection() + settings.interval).as_millis(),
        )],
        header: vec!["metric".into(), "value".into(), "notes".into()],
        rows: vec![
            row(
                "hellos per gateway",
                format!(
                    "{} out, {} in /s",
                    thousands(gw_out as u64),
                    thousands(gw_in as u64)
                ),
                &format!(
                    "{} B hellos ({} B on the wire): {:.2} Mbit/s out",
                    gw_hello,
                    gw_hello + WIRE_OVERHEAD,
                    mbit(gw_out, gw_hello)
                ),
            ),
            row(
                "hellos per worker",
                format!(
                    "{} out, {} in /s",
                    thousands(wk_out as u64),
                    thousands(wk_in as u64)
                ),
                &format!(
                    "{} B hellos ({} B on the wire): {:.2} Mbit/s out",
                    wk_hello,
                    wk_hello + WIRE_OVERHEAD,
                    mbit(wk_out, wk_hello)
                ),
            ),
            row(
                "hellos in the cluster",
                format!("{} /s", thousands(cluster as u64)),
                &format!(
                    "{:.1} Mbit/s in all",
                    shape.gateways as f64 * mbit(gw_out, gw_hello)
                        + (shape.nodes - shape.gateways) as f64 * mbit(wk_out, wk_hello)
                ),
            ),
            row(
                "CPU per interval, gateway",
                format!(
                    "{} us (before: {} us)",
                    gw_now.time.as_micros(),
                    gw_before.time.as_micros()
                ),
                &format!(
                    "{:.2}% of one core (before: {:.2}%)",
                    cpu(gw_now.time),
                    cpu(gw_before.time)
                ),
            ),
            row(
                "CPU per interval, worker",
                format!(
                    "{} us (before: {} us)",
                    wk_now.time.as_micros(),
                    wk_before.time.as_micros()
                ),
                &format!(
                    "{:.3}% of one core (before: {:.3}%)",
                    cpu(wk_now.time),
                    cpu(wk_before.time)
                ),
            ),
            row(
                "allocations, gateway",
                allocs(&gw_now),
                &format!("before: {}", allocs(&gw_before)),
            ),
            row(
                "allocations, worker",
                allocs(&wk_now),
                &format!("before: {}", allocs(&wk_before)),
            ),
        ],
        notes: vec![
            "The cost grows with nodes x gateways: doubling the interval halves it and doubles \
             the detection time. The sockets' system-call cost is not in the CPU figure."
                .to_owned(),
        ],
    }
}
