//! The soak's summary table.

use std::fmt::Write as _;

use egress_common::maps as names;

use super::{RSS_GROWTH_LIMIT_PCT, Report, STEADY_AGENTS};

fn yes(ok: bool) -> &'static str {
    if ok { "ok" } else { "MISSED" }
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

impl Report {
    /// The summary, one section per target.
    pub fn table(&self) -> String {
        let mut s = String::new();
        self.write_header_and_events(&mut s);
        self.write_long_lived_flows(&mut s);
        self.write_short_flows(&mut s);
        self.write_aborts(&mut s);
        self.write_far_hosts(&mut s);
        self.write_wrong_sources(&mut s);
        self.write_stream_breaks(&mut s);
        self.write_map_entries(&mut s);
        self.write_agent_rss(&mut s);
        self.write_verdict(&mut s);
        s
    }

    /// The title line, then the churn events by kind and the churn steps that failed.
    fn write_header_and_events(&self, w: &mut String) {
        let _ = writeln!(
            w,
            "== churn soak, lab {}: {:.1} min of churn ({} cycles), {:.1} min in all ==",
            self.prefix,
            self.churn_secs / 60.0,
            self.cycles,
            self.total_secs / 60.0
        );
        let total: u32 = self.events_by_kind.values().sum();
        let _ = writeln!(w, "\nevents ({total}):");
        for (kind, n) in &self.events_by_kind {
            let _ = writeln!(w, "  {kind:<28} {n:>6}");
        }
        for e in &self.churn_errors {
            let _ = writeln!(w, "  FAILED: {e}");
        }
    }

    /// The long-lived flows, and when the longest gap of each slow one began.
    fn write_long_lived_flows(&self, w: &mut String) {
        let _ = writeln!(
            w,
            "\nlong-lived flows:\n  {:<12} {:<7} {:<5} {:<16} {:<16} {:>8} {:>8} {:>8} {:>6} wrong",
            "flow",
            "pod",
            "proto",
            "destination",
            "expected source",
            "sent",
            "replies",
            "gap_ms",
            "breaks"
        );
        for f in &self.flows {
            let _ = writeln!(
                w,
                "  {:<12} {:<7} {:<5} {:<16} {:<16} {:>8} {:>8} {:>8} {:>6} {}",
                f.spec.name,
                f.spec.pod,
                f.spec.proto.to_string(),
                f.spec.host.to_string(),
                f.spec.expect.to_string(),
                f.sent,
                f.received,
                f.longest_gap_ms,
                f.breaks.len(),
                if f.wrong_sources.is_empty() {
                    "0".to_owned()
                } else {
                    f.wrong_sources.join(",")
                }
            );
        }
        for f in self.flows.iter().filter(|f| f.longest_gap_ms >= 1000) {
            let _ = writeln!(
                w,
                "  {}: its longest gap ({} ms) began during {}",
                f.spec.name, f.longest_gap_ms, f.longest_gap_during
            );
        }
    }

    /// The new short flows, by pod, protocol and destination.
    fn write_short_flows(&self, w: &mut String) {
        let _ = writeln!(
            w,
            "\nnew short flows (egress-echo query, 1 s timeout):\n  {:<7} {:<5} {:<16} {:>8} {:>8} {:>6}",
            "pod", "proto", "destination", "sent", "answered", "wrong"
        );
        let mut queries = self.queries.clone();
        queries.sort_by_key(|((pod, proto, host), _)| (*pod, proto.to_string(), *host));
        for ((pod, proto, host), c) in &queries {
            let _ = writeln!(
                w,
                "  {:<7} {:<5} {:<16} {:>8} {:>8} {:>6}",
                pod,
                proto.to_string(),
                host.to_string(),
                c.sent,
                c.answered,
                c.wrong
            );
        }
    }

    /// The aborting pods: what their clients did, and their live flows' peak and floor.
    fn write_aborts(&self, w: &mut String) {
        let _ = writeln!(
            w,
            "\naborted connections (egress-echo abort: a RST each, by turns the pod's and the host's):\n  {:<11} {:<9} {:<16} {:<16} {:>6} {:>7} {:>7} {:>7} {:>7} {:>6} wrong",
            "name",
            "pod",
            "destination",
            "expected source",
            "sport",
            "conns",
            "by pod",
            "by host",
            "failed",
            "ports"
        );
        for a in &self.aborts {
            let s = a.summary.clone().unwrap_or_default();
            let wrong = a.wrong_sources();
            let _ = writeln!(
                w,
                "  {:<11} {:<9} {:<16} {:<16} {:>6} {:>7} {:>7} {:>7} {:>7} {:>6} {}",
                a.spec.name,
                a.spec.pod,
                a.spec.host.to_string(),
                a.spec.expect.to_string(),
                a.spec.sport.map_or("new".to_owned(), |p| p.to_string()),
                s.connections,
                s.reset_by_pod,
                s.reset_by_host,
                s.failed,
                s.ports,
                if wrong.is_empty() {
                    "0".to_owned()
                } else {
                    format!("{wrong:?}")
                }
            );
            for e in &s.errors {
                let _ = writeln!(w, "    {}: {e}", a.spec.name);
            }
        }
        let _ = writeln!(
            w,
            "live flows of the aborting pods (FLOWS_V4 over the nodes) after the aborts stopped   \
             at the floor: {}",
            yes(self.aborts_ok())
        );
        let _ = writeln!(
            w,
            "  {:<9} {:>5} {:>5} {:>6} {:>10} {:>9} {:>15}",
            "pod", "peak", "end", "floor", "long-lived", "stranded", "at floor after"
        );
        for a in &self.aborts {
            let _ = writeln!(
                w,
                "  {:<9} {:>5} {:>5} {:>6} {:>10} {:>9} {:>15}   conntrack: {} ended, {} open",
                a.spec.pod,
                a.peak,
                a.end,
                a.floor.total(),
                a.floor.long_lived,
                a.floor.stranded,
                a.at_floor_after
                    .map_or("MISSED".to_owned(), |d| format!("{:.1} s", d.as_secs_f64())),
                a.flows.ended,
                a.flows.open,
            );
        }
        let _ = writeln!(
            w,
            "  target: each pod's count at its floor (its long-lived flows, and those the churn \
             stranded: no RST or FIN seen, last seen before the lab was steady; at most one per \
             churn event, {}) within {:.0} s of the aborts' stop (the reset timeout, two sweeper \
             ticks, a second); every pod's live flows (the queries' too: a UDP one lives \
             120 s): peak {}, {} at the last look",
            self.events.len(),
            super::floor::WITHIN.as_secs_f64(),
            self.flows_peak,
            self.flows_at_floor
        );
    }

    /// The packets each far host captured, and the spare pod's drops while unknown.
    fn write_far_hosts(&self, w: &mut String) {
        let _ = writeln!(w, "\nfar hosts (IP packets captured, dropped by tcpdump):");
        for (host, n, dropped) in &self.packets {
            let _ = writeln!(w, "  {host:<8} {n:>10} {dropped:>6}");
        }
        let _ = writeln!(
            w,
            "  {SPARE}: {} packets dropped as DROP_UNKNOWN_POD on w2 while it was unknown",
            self.unknown_pod_drops,
            SPARE = super::SPARE
        );
    }

    /// Wrong sources, where they were seen, and the first of them.
    fn write_wrong_sources(&self, w: &mut String) {
        let wrong = self.wrong_sources();
        let _ = writeln!(
            w,
            "\nwrong sources: {wrong} ({} at far hosts, {} in query answers, {} in stream echoes, {} in aborted connections)   target 0: {}",
            self.violations.len(),
            self.wrong_answers.len(),
            self.flows
                .iter()
                .map(|f| f.wrong_sources.len())
                .sum::<usize>(),
            self.aborts
                .iter()
                .map(|a| a.wrong_sources().len())
                .sum::<usize>(),
            yes(wrong == 0)
        );
        for v in self.violations.iter().take(20) {
            let _ = writeln!(
                w,
                "  {} {} from {} during {}: {}",
                v.at_ms, v.host, v.source, v.during, v.line
            );
        }
    }

    /// Stream breaks, by cause, and the first of them.
    fn write_stream_breaks(&self, w: &mut String) {
        let breaks = self.breaks();
        let _ = writeln!(
            w,
            "stream breaks: {}   target 0: {}",
            breaks.len(),
            yes(breaks.is_empty())
        );
        let mut by_cause = std::collections::BTreeMap::<String, u32>::new();
        for b in &breaks {
            let cause = b.during.split(" (").next().unwrap_or("").to_owned();
            *by_cause.entry(cause).or_default() += 1;
        }
        for (cause, n) in by_cause {
            let _ = writeln!(w, "  {n} during {cause}");
        }
        for b in breaks.iter().take(20) {
            let _ = writeln!(w, "  {} {}: {} during {}", b.at_ms, b.flow, b.why, b.during);
        }
    }

    /// The map entries at the start and the end, and the conntrack at the end.
    fn write_map_entries(&self, w: &mut String) {
        let _ = writeln!(
            w,
            "\nmap entries (summed over the nodes)   back to the start: {}",
            match self.maps_back_after {
                Some(d) => format!("ok, {:.0} s after the traffic stopped", d.as_secs_f64()),
                None => "MISSED".to_owned(),
            }
        );
        let _ = writeln!(w, "  {:<14} {:>7} {:>7}", "map", "start", "end");
        for (name, start) in &self.maps_start.per_map {
            let end = self.maps_end.per_map.get(name).copied().unwrap_or(0);
            let _ = writeln!(w, "  {name:<14} {start:>7} {end:>7}");
        }
        let m = &self.maps_end;
        let _ = writeln!(
            w,
            "  conntrack at the end: {:?} by node; {} in use, {} still to be swept, {} past \
             their timeout (target: 0 of each); {} lingering (established TCP, or halves of \
             flows whose other half is: hours of idle timeout, by design); FLOWS_V4 \
             counts {} pods, the pods of those entries are {} (target: equal)",
            m.ct_by_node,
            m.ct_recent,
            m.ct_draining,
            m.ct_expired,
            m.ct_lingering,
            m.per_map.get(names::FLOWS_V4).copied().unwrap_or(0),
            m.ct_pods
        );
    }

    /// The agents' RSS from warm-up to the end.
    fn write_agent_rss(&self, w: &mut String) {
        let _ = writeln!(
            w,
            "\nagent RSS (MiB, after warm-up; target: growth <= {RSS_GROWTH_LIMIT_PCT}% on {}, \
             whose agents are never restarted): {}",
            STEADY_AGENTS.join(", "),
            yes(self.rss_ok())
        );
        let _ = writeln!(
            w,
            "  {:<5} {:>7} {:>7} {:>7} {:>8} {:>8}",
            "node", "start", "end", "max", "growth", "samples"
        );
        for (node, r) in &self.rss {
            let _ = writeln!(
                w,
                "  {node:<5} {:>7} {:>7} {:>7} {:>7.1}% {:>8}{}",
                mib(r.first_kib),
                mib(r.last_kib),
                mib(r.max_kib),
                r.growth_pct(),
                r.samples,
                if r.restarted {
                    "  (restarted by the churn)"
                } else {
                    ""
                }
            );
        }
    }

    /// Leftovers after teardown, the problems, and the verdict.
    fn write_verdict(&self, w: &mut String) {
        let _ = writeln!(
            w,
            "\nleftovers after teardown: {}",
            if self.leftovers.is_empty() {
                "none".to_owned()
            } else {
                self.leftovers.join(", ")
            }
        );
        for p in &self.problems {
            let _ = writeln!(w, "problem: {p}");
        }
        let _ = writeln!(
            w,
            "\nsoak: {}",
            if self.ok() {
                "every target met"
            } else {
                "TARGETS MISSED"
            }
        );
    }
}
