//! The run's summary, as `cargo xtask lab --nodes N --gateways G` prints it.

use std::fmt::Write as _;

use super::{Cost, NodeTimes, Report, SourceCheck, Timeline};

/// The whole summary.
pub fn print(r: &Report) -> String {
    let mut s = String::new();
    let pods = r.workers * 2;
    let _ = writeln!(
        s,
        "Scale lab: {} nodes ({} workers, {} gateways), {pods} pods ({} selected), probes every \
         {} ms, a peer dead after {} missed",
        r.workers + r.gateways,
        r.workers,
        r.gateways,
        r.workers,
        r.probe_interval_ms,
        r.probe_misses
    );
    let _ = writeln!(s, "  worker agents:  {}", r.worker_args.join(" "));
    let _ = writeln!(s, "  gateway agents: {}", r.gateway_args.join(" "));
    let _ = writeln!(
        s,
        "Up: lab {:.1} s; agents started {:.1} s and converged {:.1} s after their start \
         (every selected pod leaves by egress IPs A and B)",
        r.lab_up.as_secs_f64(),
        r.started.as_secs_f64(),
        r.converged.as_secs_f64()
    );
    s.push_str("\nSources at the far hosts, every pod (selected: by the egress IP; unselected: no way to A, B, D; C untouched):\n");
    sources(&mut s, &r.first_check);
    holders(&mut s, &r.holders);
    s.push_str(
        "\nFailover: a TCP stream from every worker's selected pod through egress IP A, a \
         line every 100 ms;\nback = from the failure to the reply that ended the node's \
         worst gap (0: none over 300 ms)\n",
    );
    let _ = writeln!(
        s,
        "  {:<13} {:<7} {:<10} {:>7} {:>6}  {:>7} {:>7} {:>7} {:>7}  slowest",
        "event",
        "failed",
        "new holder",
        "streams",
        "broken",
        "p50 ms",
        "p99 ms",
        "max ms",
        "min ms"
    );
    for f in &r.failovers {
        let (p50, p99, max, min) = f.back.spread();
        let _ = writeln!(
            s,
            "  {:<13} {:<7} {:<10} {:>7} {:>6}  {p50:>7} {p99:>7} {max:>7} {min:>7}  {}",
            f.how,
            f.from,
            f.to.join(","),
            f.streams,
            f.broken.len(),
            slowest(&f.back)
        );
    }
    s.push_str(
        "\nPropagation: a UDP stream from every worker's selected pod, a datagram every 100 \
         ms, each a new flow\n(an established flow keeps its gateway and translation); time \
         from the change until the far host sees the new source from that node\n",
    );
    let _ = writeln!(
        s,
        "  {:<14} {:>5} {:>7} {:>7} {:>7}  slowest",
        "change", "nodes", "p50 ms", "p99 ms", "max ms"
    );
    for p in &r.propagations {
        let (p50, p99, max, _) = p.shown.spread();
        let _ = writeln!(
            s,
            "  {:<14} {:>5} {p50:>7} {p99:>7} {max:>7}  {}",
            p.what,
            p.shown.0.len(),
            slowest(&p.shown)
        );
    }
    timelines(&mut s, r);
    s.push_str("\nCost per agent (CPU in cores; memory in MiB: resident, peak resident, the maps' bytes_memlock):\n");
    let _ = writeln!(
        s,
        "  {:<22} {:<8} {:>6} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9}",
        "window",
        "role",
        "agents",
        "CPU mean",
        "CPU max",
        "RSS mean",
        "RSS max",
        "peak RSS",
        "maps mean",
        "maps max"
    );
    cost(
        &mut s,
        &format!("idle {:.0} s", r.idle.window.as_secs_f64()),
        &r.idle,
    );
    cost(
        &mut s,
        &format!("events {:.0} s", r.busy.window.as_secs_f64()),
        &r.busy,
    );
    let _ = writeln!(
        s,
        "  underlay while idle: {:.0} packets/s, {:.1} KiB/s sent by the nodes (hellos and \
         their answers, ARP: no traffic runs)",
        r.idle.underlay.packets_per_sec,
        r.idle.underlay.bytes_per_sec / 1024.0
    );
    let _ = writeln!(
        s,
        "  state directory: {:.1} KiB",
        r.state_dir_bytes as f64 / 1024.0
    );
    s.push_str(
        "\nAfter the events (rule A by the edited egress IP, network E routed by the gateways):\n",
    );
    sources(&mut s, &r.last_check);
    holders(&mut s, &r.holders_after);
    let failures = r.failures();
    if failures.is_empty() {
        s.push_str("\nResult: every source right, one holder per egress IP, no stream broken\n");
    } else {
        let _ = writeln!(s, "\nResult: {} failures", failures.len());
        for f in failures {
            let _ = writeln!(s, "  {f}");
        }
    }
    s
}

fn sources(s: &mut String, checks: &[SourceCheck]) {
    let _ = writeln!(
        s,
        "  {:<12} {:>7} {:>6} {:>6}",
        "destination", "checked", "right", "wrong"
    );
    for c in checks {
        let _ = writeln!(
            s,
            "  {:<12} {:>7} {:>6} {:>6}{}",
            c.destination,
            c.checked,
            c.right,
            c.wrong.len(),
            c.wrong
                .first()
                .map_or(String::new(), |w| format!("  (first: {w})"))
        );
    }
}

fn holders(s: &mut String, holders: &[(std::net::IpAddr, Vec<(String, String)>)]) {
    let list: Vec<String> = holders
        .iter()
        .map(|(ip, h)| {
            let by: Vec<String> = h.iter().map(|(g, i)| format!("{g} ({i})")).collect();
            format!(
                "{ip} on {}",
                if by.is_empty() {
                    "no gateway".to_owned()
                } else {
                    by.join(" and ")
                }
            )
        })
        .collect();
    let _ = writeln!(s, "  held: {}", list.join("; "));
}

fn slowest(t: &NodeTimes) -> String {
    let missing = t.missing();
    let mut out = t
        .slowest()
        .map_or("-".to_owned(), |(n, ms)| format!("{n} ({ms} ms)"));
    if !missing.is_empty() {
        let _ = write!(out, "; never: {}", missing.join(", "));
    }
    out
}

fn cost(s: &mut String, window: &str, c: &Cost) {
    let mib = |kib: u64| kib as f64 / 1024.0;
    for r in &c.roles {
        let _ = writeln!(
            s,
            "  {:<22} {:<8} {:>6} {:>8.3} {:>8.3} {:>8.1} {:>8.1} {:>8.1} {:>9.1} {:>9.1}",
            window,
            r.role,
            r.agents,
            r.cpu_mean,
            r.cpu_max,
            mib(r.rss_mean_kib),
            mib(r.rss_max_kib),
            mib(r.hwm_max_kib),
            r.maps_mean_bytes as f64 / 1048576.0,
            r.maps_max_bytes as f64 / 1048576.0,
        );
    }
}

/// Where each event's time went, per role: the first pass that acted on it (began: the
/// event heard; ended: the maps written), the passes over the event, their time, and the
/// CPU (from the event until its traffic was back, or 2 s after for a failover).
fn timelines(s: &mut String, r: &Report) {
    s.push_str(
        "\nWhere the time went (ms from the event; began/ended: the first pass that changed \
         something; passes, pass ms, CPU ms: over the event, mean/max per agent):\n",
    );
    let _ = writeln!(
        s,
        "  {:<14} {:<8} {:>6} {:>16} {:>16} {:>9} {:>13} {:>11}  woken by",
        "event",
        "role",
        "agents",
        "began p50/p99/max",
        "ended p50/p99/max",
        "passes",
        "pass ms",
        "CPU ms"
    );
    let events = r
        .failovers
        .iter()
        .map(|f| (f.how.as_str(), &f.timeline))
        .chain(
            r.propagations
                .iter()
                .map(|p| (p.what.as_str(), &p.timeline)),
        );
    for (event, t) in events {
        timeline(s, event, t);
    }
}

fn timeline(s: &mut String, event: &str, t: &Timeline) {
    for role in t.roles() {
        let three = |(a, b, c): (u64, u64, u64)| format!("{a}/{b}/{c}");
        let mut woken: Vec<String> = role
            .triggers
            .iter()
            .map(|(t, n)| format!("{t} {n}"))
            .collect();
        if role.quiet > 0 {
            woken.push(format!("no pass {}", role.quiet));
        }
        let _ = writeln!(
            s,
            "  {:<14} {:<8} {:>6} {:>16} {:>16} {:>9} {:>13} {:>11}  {}",
            event,
            role.role,
            role.agents,
            three(role.began),
            three(role.ended),
            format!("{:.1}/{}", role.passes.0, role.passes.1),
            format!("{:.0}/{:.0}", role.pass_ms.0, role.pass_ms.1),
            format!("{:.0}/{}", role.cpu_ms.0, role.cpu_ms.1),
            woken.join(", ")
        );
    }
}

/// The run as `egress-bench --nodes N` reports it: one row per event against issue 49's
/// bound (every node back, or showing the change, within 1 s at p99, no stream broken;
/// converged within 60 s), with where the workers' time went.
pub fn bench_table(r: &Report) -> crate::bench::report::Table {
    const BOUND_MS: u64 = 1_000;
    let met = |ok: bool| if ok { "met" } else { "**missed**" }.to_owned();
    let workers = |t: &Timeline| t.roles().into_iter().find(|x| x.role == "worker");
    let timeline_cells = |t: &Timeline| match workers(t) {
        Some(w) => vec![
            format!("{}/{}", w.ended.0, w.ended.1),
            format!("{:.1}", w.passes.0),
            format!("{:.0}", w.cpu_ms.0),
        ],
        None => vec!["-".to_owned(); 3],
    };
    let mut rows = vec![{
        let ok = r.converged.as_secs() < 60;
        let mut row = vec![
            format!("{} agents started, converged", r.workers + r.gateways),
            format!(
                "{:.1} s, {:.1} s",
                r.started.as_secs_f64(),
                r.converged.as_secs_f64()
            ),
            "-".to_owned(),
            "60 s".to_owned(),
            met(ok),
        ];
        row.extend(["-".to_owned(), "-".to_owned(), "-".to_owned()]);
        row
    }];
    for f in &r.failovers {
        let (p50, p99, max, _) = f.back.spread();
        let ok = p99 <= BOUND_MS && f.broken.is_empty() && f.back.missing().is_empty();
        let mut row = vec![
            format!("{}: every worker back", f.how),
            format!("{p50} / {p99} / {max} ms"),
            format!("{} of {}", f.broken.len(), f.streams),
            "1 s at p99, none broken".to_owned(),
            met(ok),
        ];
        row.extend(timeline_cells(&f.timeline));
        rows.push(row);
    }
    for p in &r.propagations {
        let (p50, p99, max, _) = p.shown.spread();
        let ok = p99 <= BOUND_MS && p.shown.missing().is_empty();
        let mut row = vec![
            format!("{}: shown on every node", p.what),
            format!("{p50} / {p99} / {max} ms"),
            "-".to_owned(),
            "1 s at p99".to_owned(),
            met(ok),
        ];
        row.extend(timeline_cells(&p.timeline));
        rows.push(row);
    }
    let cpu = |c: &Cost, role: &str| {
        c.roles
            .iter()
            .find(|x| x.role == role)
            .map_or("-".to_owned(), |x| format!("{:.1} %", x.cpu_mean * 100.0))
    };
    crate::bench::report::Table {
        title: format!(
            "The lab at {} nodes: events against the 4-node bounds",
            r.workers + r.gateways
        ),
        intro: vec![format!(
            "`egress-bench --nodes {}` (`cargo xtask lab --nodes {}` measured as a benchmark): \
             {} workers and {} gateways, one release agent each with the DaemonSet's \
             capabilities, probes every {} ms, a peer dead after {} missed. A TCP stream from \
             every worker's selected pod through egress IP A while its holder dies silently \
             and then while the next one is drained; a UDP stream (a new flow per datagram) \
             while rule A's egress IP is edited and a gateway route is added. Times from the \
             event, per node, p50 / p99 / max; the workers' columns are from their own logs \
             and metrics (the first pass that acted ended, p50/p99 ms; passes and CPU ms \
             per worker over the event, mean).",
            r.workers + r.gateways,
            r.workers + r.gateways,
            r.workers,
            r.gateways,
            r.probe_interval_ms,
            r.probe_misses
        )],
        header: [
            "event",
            "p50 / p99 / max",
            "broken",
            "bound",
            "",
            "workers' pass ended",
            "passes",
            "CPU ms",
        ]
        .map(str::to_owned)
        .to_vec(),
        rows,
        notes: vec![format!(
            "Idle CPU per agent: worker {}, gateway {} of a core; over the events: worker \
             {}, gateway {}. Failures: {}.",
            cpu(&r.idle, "worker"),
            cpu(&r.idle, "gateway"),
            cpu(&r.busy, "worker"),
            cpu(&r.busy, "gateway"),
            match r.failures() {
                f if f.is_empty() => "none".to_owned(),
                f => f.join("; "),
            }
        )],
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::scale_lab::{Failover, Propagation};

    #[test]
    fn the_bench_table_holds_each_event_to_the_bound() {
        let times = |ms: &[Option<u64>]| {
            NodeTimes(
                ms.iter()
                    .enumerate()
                    .map(|(i, t)| (format!("w{i}"), *t))
                    .collect(),
            )
        };
        let r = Report {
            workers: 18,
            gateways: 2,
            converged: Duration::from_secs(30),
            failovers: vec![
                Failover {
                    how: "silent death".into(),
                    back: times(&[Some(400), Some(900)]),
                    streams: 2,
                    ..Failover::default()
                },
                Failover {
                    how: "drain".into(),
                    back: times(&[Some(0), Some(0)]),
                    broken: vec!["w1".into()],
                    streams: 2,
                    ..Failover::default()
                },
            ],
            propagations: vec![Propagation {
                what: "policy edit".into(),
                shown: times(&[Some(300), None]),
                ..Propagation::default()
            }],
            ..Report::default()
        };
        let t = bench_table(&r);
        let verdicts: Vec<(&str, &str)> = t
            .rows
            .iter()
            .map(|row| (row[0].as_str(), row[4].as_str()))
            .collect();
        assert_eq!(
            verdicts,
            [
                ("20 agents started, converged", "met"),
                ("silent death: every worker back", "met"),
                ("drain: every worker back", "**missed**"),
                ("policy edit: shown on every node", "**missed**"),
            ]
        );
        assert!(t.rows.iter().all(|row| row.len() == t.header.len()));
    }
}
