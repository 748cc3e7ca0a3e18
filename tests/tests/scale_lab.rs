//! The lab at 20 nodes (16 workers, 4 gateways), as `cargo xtask lab --nodes 20 --gateways
//! 4` runs it: every pod's source right at every far host, one holder per egress IP,
//! every worker's TCP stream kept across a silent death and a drain of the holder, and
//! a policy edit and a gateway route shown on every node. The bounds are on outcomes and,
//! loosely, on time (about ten times what this lab takes on an idle machine with debug
//! agents: a loaded CI machine must not fail them, an agent that stalls for seconds
//! must); the times are printed (docs/benchmarks.md has the 100-node run's).

use std::time::Duration;

use egress_tests::{cluster, lab::locate_echo_bin, scale_lab};

#[test]
fn twenty_nodes_every_source_right_one_holder_and_streams_kept() {
    let mut opts = scale_lab::Options::new(
        16,
        4,
        cluster::agent_bin().unwrap(),
        locate_echo_bin().unwrap(),
    );
    // As every lab test under `cargo xtask test`: 6 missed probes (600 ms), so that a
    // debug agent starved on a loaded 2-core machine is not failed over needlessly.
    opts.probe_misses = std::env::var("EGRESS_PROBE_MISSES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    opts.idle_window = Duration::from_secs(5);
    opts.converge_timeout = Duration::from_secs(300);
    opts.event_timeout = Duration::from_secs(60);
    let report = scale_lab::run(&opts).unwrap_or_else(|e| panic!("{e:#}"));
    let summary = scale_lab::print(&report);
    eprintln!("{summary}");
    let failures = report.failures();
    assert!(failures.is_empty(), "{}\n{summary}", failures.join("\n"));
    // The summary's own claims, checked on the numbers behind them.
    for c in report.first_check.iter().chain(&report.last_check) {
        assert_eq!(
            c.checked, 32,
            "every pod checked for {}\n{summary}",
            c.destination
        );
        assert_eq!(c.right, c.checked, "{}\n{summary}", c.destination);
    }
    assert_eq!(report.failovers.len(), 2, "{summary}");
    for f in &report.failovers {
        assert_eq!(f.streams, 16, "a stream per worker\n{summary}");
        assert!(f.broken.is_empty(), "{summary}");
    }
    assert_eq!(report.propagations.len(), 2, "{summary}");
    // Loose bounds on time.
    assert!(
        report.converged < Duration::from_secs(180),
        "agents converged in {:?}, over 180 s\n{summary}",
        report.converged
    );
    let within = |what: &str, times: &scale_lab::NodeTimes, ms: u64| {
        let (_, _, max, _) = times.spread();
        assert!(
            max <= ms,
            "{what}: the slowest node ({:?}) took {max} ms, over {ms} ms\n{summary}",
            times.slowest()
        );
    };
    for f in &report.failovers {
        within(&format!("{}: every worker back", f.how), &f.back, 15_000);
    }
    for p in &report.propagations {
        within(
            &format!("{}: shown on every node", p.what),
            &p.shown,
            15_000,
        );
    }
}
