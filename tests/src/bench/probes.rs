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
    hello::{Hello, VERSION},
    keys::{Key, Keyring},
    tracker::Tracker,
};

use super::report::{Table, thousands};

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

/// A tracker per node, warmed up with one round of hellos, so that hellos carry a full
/// `seen` list.
fn trackers(shape: &Shape, settings: Settings, t0: Instant) -> Vec<Tracker> {
    let m = members(shape);
    let mut ts: Vec<Tracker> = (0..shape.nodes)
        .map(|i| {
            let mut t = Tracker::new(&name(i, shape.gateways), settings, i as u32 + 1, t0);
            t.set_members(m.clone());
            if i < shape.gateways {
                t.set_local(BTreeSet::new(), claims(i, shape.held));
            }
            t
        })
        .collect();
    let index: BTreeMap<String, usize> = (0..shape.nodes)
        .map(|i| (name(i, shape.gateways), i))
        .collect();
    let mut sent = Vec::new();
    for (i, t) in ts.iter_mut().enumerate() {
        for (to, _) in t.targets() {
            sent.push((i, index[&to], t.hello_for(&to, t0)));
        }
    }
    for (from, to, h) in sent {
        let _ = ts[to].on_hello(h, addr(from), t0);
    }
    ts
}

/// One interval of node `i`: its hellos built and encoded, and every hello it receives
/// decoded and taken (`incoming`, as bytes). Returns the time taken.
fn one_interval(t: &mut Tracker, incoming: &[(Vec<u8>, IpAddr)], now: Instant) -> Duration {
    let keys = keys();
    let start = Instant::now();
    for (to, _) in t.targets() {
        let h = t.hello_for(&to, now);
        black_box(h.encode(VERSION, &keys).map(|b| b.len()).unwrap_or(0));
    }
    for (bytes, from) in incoming {
        if let Ok(r) = Hello::decode(bytes, &keys) {
            let _ = black_box(t.on_hello(r.hello, *from, now));
        }
    }
    black_box(t.observe(now));
    start.elapsed()
}

/// The probe cost table for 100 nodes and 10 gateways at the default settings.
pub fn table(quick: bool) -> Table {
    let shape = Shape {
        nodes: 100,
        gateways: 10,
        held: 7,
    };
    let settings = Settings::default();
    let per_s = 1.0 / settings.interval.as_secs_f64();
    let t0 = Instant::now();
    let mut ts = trackers(&shape, settings, t0);
    let (g, w) = (0usize, shape.gateways);
    let targets = |i: usize| -> Vec<usize> {
        let me = name(i, shape.gateways);
        ts[i]
            .targets()
            .iter()
            .filter(|(n, _)| *n != me)
            .map(|(n, _)| {
                (0..shape.nodes)
                    .find(|k| name(*k, shape.gateways) == *n)
                    .unwrap_or(0)
            })
            .collect()
    };
    let (gw_targets, wk_targets) = (targets(g), targets(w));
    // Sizes of real hellos: a gateway's (with its claims and seen list) and a worker's.
    let size = |from: usize, to: usize, ts: &mut Vec<Tracker>| {
        let to_name = name(to, shape.gateways);
        ts[from]
            .hello_for(&to_name, t0)
            .encode(VERSION, &keys())
            .map(|b| b.len())
            .unwrap_or(0)
    };
    let gw_hello = size(g, w, &mut ts);
    let wk_hello = size(w, g, &mut ts);
    // Incoming hellos of one interval: to the gateway from every other node; to the
    // worker from every gateway.
    let incoming = |to: usize, ts: &mut Vec<Tracker>, now: Instant| -> Vec<(Vec<u8>, IpAddr)> {
        let to_name = name(to, shape.gateways);
        (0..shape.nodes)
            .filter(|i| *i != to && (to < shape.gateways || *i < shape.gateways))
            .map(|i| {
                let b = ts[i]
                    .hello_for(&to_name, now)
                    .encode(VERSION, &keys())
                    .map(|b| b.to_vec())
                    .unwrap_or_default();
                (b, addr(i))
            })
            .collect()
    };
    let rounds = if quick { 50 } else { 200 };
    let measure = |node: usize, ts: &mut Vec<Tracker>| -> Duration {
        let mut total = Duration::ZERO;
        for r in 0..rounds {
            let now = t0 + settings.interval * (r + 2);
            let inc = incoming(node, ts, now);
            total += one_interval(&mut ts[node], &inc, now);
        }
        total / rounds
    };
    let gw_cpu = measure(g, &mut ts);
    let wk_cpu = measure(w, &mut ts);
    let gw_out = gw_targets.len() as f64 * per_s;
    let gw_in = (shape.nodes - 1) as f64 * per_s;
    let wk_out = wk_targets.len() as f64 * per_s;
    let wk_in = shape.gateways as f64 * per_s;
    let cluster = shape.gateways as f64 * gw_out + (shape.nodes - shape.gateways) as f64 * wk_out;
    let mbit = |pps: f64, bytes: usize| pps * (bytes + WIRE_OVERHEAD) as f64 * 8.0 / 1e6;
    let cpu = |d: Duration| d.as_secs_f64() / settings.interval.as_secs_f64() * 100.0;
    let row = |what: &str, value: String, notes: &str| {
        vec![what.to_owned(), format!("**{value}**"), notes.to_owned()]
    };
    Table {
        title: "Liveness probes".to_owned(),
        intro: vec![format!(
            "The cost of the agents' hellos (docs/failover.md) for {} nodes of which {} are \
             gateways holding {} egress IPs each, at the default settings: one hello every {} \
             ms to each peer, {} misses (detection {} ms, {} ms with the relayed view). A \
             gateway greets every node; a worker greets every gateway. Sizes are of real \
             hellos encoded by the agent's codec; CPU is one probe interval of one node \
             (build and encode its hellos, decode and take every hello it receives, \
             re-assess), timed in this process, averaged over {rounds} intervals.",
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
                format!("{} us", gw_cpu.as_micros()),
                &format!("{:.2}% of one core", cpu(gw_cpu)),
            ),
            row(
                "CPU per interval, worker",
                format!("{} us", wk_cpu.as_micros()),
                &format!("{:.3}% of one core", cpu(wk_cpu)),
            ),
        ],
        notes: vec![
            "The cost grows with nodes x gateways: doubling the interval halves it and doubles \
             the detection time. The sockets' system-call cost is not in the CPU figure."
                .to_owned(),
        ],
    }
}
