//! The markdown report: the machine, the plan, and one table per section.

use std::{
    fmt::Write as _,
    path::Path,
    process::Command,
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result};

use super::{
    Plan, Spread,
    per_packet::{self, FloorKind, Method, Target, Timing},
};

/// Where and when the numbers were taken.
#[derive(Clone, Debug)]
pub struct Machine {
    pub nproc: usize,
    pub cpu: String,
    pub kernel: String,
    /// UTC, `YYYY-MM-DD HH:MM:SS`.
    pub date: String,
    /// 1, 5 and 15-minute load averages when the run started (`/proc/loadavg`): how busy
    /// the machine was besides the benchmark.
    pub loadavg: String,
}

impl Machine {
    pub fn probe() -> Result<Machine> {
        let nproc = std::thread::available_parallelism()
            .context("failed to count CPUs")?
            .get();
        let cpuinfo =
            std::fs::read_to_string("/proc/cpuinfo").context("failed to read /proc/cpuinfo")?;
        let cpu = cpuinfo
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "model name").then(|| v.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown (no `model name` in /proc/cpuinfo)".to_owned());
        let loadavg = std::fs::read_to_string("/proc/loadavg")
            .context("failed to read /proc/loadavg")?
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ");
        Ok(Machine {
            nproc,
            cpu,
            kernel: kernel_release()?,
            date: utc_now()?,
            loadavg,
        })
    }
}

fn kernel_release() -> Result<String> {
    // SAFETY: all-zero is a valid utsname; uname(2) fills it.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: valid out pointer.
    if unsafe { libc::uname(&mut u) } != 0 {
        return Err(std::io::Error::last_os_error()).context("failed to call uname");
    }
    let bytes: Vec<u8> = u
        .release
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn utc_now() -> Result<String> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .context("failed to read the clock")?
        .as_secs();
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    Ok(format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    ))
}

/// One section of the report.
#[derive(Clone, Debug, Default)]
pub struct Table {
    pub title: String,
    /// Paragraphs before the table.
    pub intro: Vec<String>,
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
    /// Bullet points after the table.
    pub notes: Vec<String>,
}

impl Table {
    /// The table of a section whose measurement failed: its title and header, and why.
    pub fn failed(title: String, header: Vec<String>, what: &str, e: &anyhow::Error) -> Self {
        Self {
            title,
            intro: vec![format!("The {what} failed: {e:#}")],
            header,
            ..Default::default()
        }
    }
}

/// Cell text for a section that has no measurement yet.
pub const NOT_MEASURED: &str = "not measured in this run";

/// Which datapath was measured: the workspace's commit at run time, and whether the
/// eBPF sources (`egress-ebpf`, `egress-common`) differ from it.
pub fn datapath_source(workspace: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(workspace)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let Some(commit) = git(&["rev-parse", "--short", "HEAD"]) else {
        return "unknown (not a git checkout)".to_owned();
    };
    match git(&[
        "status",
        "--porcelain",
        "--",
        "egress-ebpf",
        "egress-common",
    ]) {
        Some(s) if !s.is_empty() => {
            format!("commit {commit}, with local changes in egress-ebpf or egress-common")
        }
        _ => format!("commit {commit}"),
    }
}

pub struct Report {
    pub machine: Machine,
    /// From [`datapath_source`].
    pub source: String,
    pub plan: Plan,
    pub tables: Vec<Table>,
}

impl Report {
    pub fn markdown(&self) -> String {
        let m = &self.machine;
        let p = &self.plan;
        let mut s = String::new();
        let _ = writeln!(s, "# Benchmarks\n");
        let _ = writeln!(
            s,
            "Written by `cargo xtask bench{}` (`tests/src/bin/egress-bench.rs`). \
             Numbers are measured, never asserted; each is the median of several rounds, \
             with the min and max of those rounds as the spread. Sections titled \
             \"{HAND_WRITTEN}\" are notes that a new run keeps as they are.\n",
            if p.quick { " --quick" } else { "" }
        );
        let _ = writeln!(s, "| | |\n|---|---|");
        let _ = writeln!(s, "| machine | {} CPUs, {} |", m.nproc, m.cpu);
        let _ = writeln!(s, "| kernel | {} |", m.kernel);
        let _ = writeln!(s, "| datapath | {} |", self.source);
        let _ = writeln!(s, "| date | {} |", m.date);
        let _ = writeln!(s, "| load average at start | {} |", m.loadavg);
        let _ = writeln!(
            s,
            "| mode | {}: {} rounds; {} runs per round (repeated rows), {} single runs per round (single-run rows) |",
            if p.quick { "quick" } else { "full" },
            p.rounds,
            thousands(u64::from(p.repeats)),
            thousands(u64::from(p.singles)),
        );
        let _ = writeln!(s);
        for t in &self.tables {
            let _ = writeln!(s, "## {}\n", t.title);
            for para in &t.intro {
                let _ = writeln!(s, "{para}\n");
            }
            if !t.header.is_empty() {
                let _ = writeln!(s, "| {} |", t.header.join(" | "));
                let _ = writeln!(
                    s,
                    "|{}|",
                    t.header.iter().map(|_| "---").collect::<Vec<_>>().join("|")
                );
                for row in &t.rows {
                    let _ = writeln!(s, "| {} |", row.join(" | "));
                }
                let _ = writeln!(s);
            }
            for n in &t.notes {
                let _ = writeln!(s, "* {n}");
            }
            if !t.notes.is_empty() {
                let _ = writeln!(s);
            }
        }
        s
    }
}

pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn ns(x: f64) -> String {
    format!("{x:.1}")
}

fn floor_of(timings: &[Timing], kind: FloorKind) -> Option<Spread> {
    let id = match kind {
        FloorKind::None => return None,
        FloorKind::Repeated => "F0",
        FloorKind::Single => "F2",
    };
    timings.iter().find(|t| t.meta.id == id)?.spread()
}

fn targets(t: &Timing, spread: Spread, ratio: Option<f64>) -> String {
    t.meta
        .targets
        .iter()
        .map(|target| {
            let (text, met) = match *target {
                Target::FloorRatio(r) => (format!("<= {r}x floor"), ratio.map(|x| x <= r)),
                Target::Ns(n) => (format!("<= {n} ns"), Some(spread.median <= n)),
            };
            match met {
                Some(true) => format!("{text}: met"),
                Some(false) => format!("{text}: **missed**"),
                None => format!("{text}: no floor"),
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The per-packet table.
pub fn per_packet_table(timings: &[Timing], plan: &Plan) -> Table {
    // Floors first, then by path; a path's table sizes stay in measured order.
    const ORDER: [&str; 13] = [
        "F0", "F1", "F2", "1", "2", "1v6", "2v6", "3", "4s", "4", "5", "4v6", "5v6",
    ];
    let mut sorted: Vec<&Timing> = timings.iter().collect();
    sorted.sort_by_key(|t| ORDER.iter().position(|id| *id == t.meta.id));
    let mut rows = Vec::new();
    for t in sorted {
        let Some(spread) = t.spread() else { continue };
        let floor = floor_of(timings, t.meta.floor);
        let ratio = floor.map(|f| spread.median / f.median);
        let method = match t.method {
            Method::Repeated { chunk } if chunk >= plan.repeats => {
                format!("repeat {}", thousands(u64::from(plan.repeats)))
            }
            Method::Repeated { chunk } => format!(
                "repeat {} in calls of {chunk}",
                thousands(u64::from(plan.repeats))
            ),
            Method::Single => format!(
                "median of {} single runs",
                thousands(u64::from(plan.singles))
            ),
        };
        rows.push(vec![
            t.meta.id.to_owned(),
            t.meta.path.to_owned(),
            if t.meta.program.starts_with('(') {
                t.meta.program.to_owned()
            } else {
                format!("`{}`", t.meta.program)
            },
            t.meta.state.clone(),
            method,
            format!("**{}**", ns(spread.median)),
            ns(spread.min),
            ns(spread.max),
            spread.n.to_string(),
            match (t.meta.floor, ratio) {
                (FloorKind::None, _) => "1.00 (floor)".to_owned(),
                (FloorKind::Single, Some(r)) => format!("{r:.2} (vs F2)"),
                (_, Some(r)) => format!("{r:.2}"),
                (_, None) => "-".to_owned(),
            },
            targets(t, spread, ratio),
        ]);
    }
    let mut notes = vec![];
    // The first table size's row where a path has several.
    let median = |id: &str| {
        timings
            .iter()
            .filter(|t| t.meta.id == id)
            .filter_map(Timing::spread)
            .map(|s| s.median)
            .next()
    };
    if let (Some(f0), Some(f1), Some(miss)) = (median("F0"), median("F1"), median("1")) {
        notes.push(format!(
            "Where the miss goes (1-entry rows): F1 - F0 = {:.1} ns (one `bpf_skb_load_bytes` \
             of the ethertype and a compare); row 1 - F1 = {:.1} ns (a second load, the \
             source address, and the SELECTED_V4 hash lookup).",
            f1 - f0,
            miss - f1
        ));
    }
    notes.extend(NOTES.iter().map(|n| (*n).to_owned()));
    notes.push(format!(
        "Rows 3-5: the gateway with {} established background flows (two entries each, \
         CT_V4 at its production size of 262,144). `test_run` re-runs one skb, so rows 4 \
         and 5 use a partner flow whose tuple is the first flow's translation and which \
         translates back (A -> B -> A): every run is an established-flow hit. Forwarding \
         decrements the TTL, so their frames start at TTL 255 and run in calls of {} \
         repeats; the row is the run-weighted mean of the calls' averages.",
        thousands(u64::from(per_packet::CT_FLOWS)),
        per_packet::TTL_CHUNK
    ));
    notes.push(IPV6_NOTE.to_owned());
    notes.push(NEW_FLOW_NOTE.to_owned());
    notes.push(
        "Rows 3-5 at *CT_V4 full* (issue 15): the same rows with the background flows \
         raised until CT_V4 holds its capacity of 262,144 entries with the measured flows \
         (the state column counts the entries after filling). CT_V4 is an LRU hash: each \
         entry a new flow creates evicts the least recently used one, and the new flows \
         removed after a round are replaced by fresh background flows, so every round \
         starts full (checked: still at least 99% full after the rounds)."
            .to_owned(),
    );
    Table {
        title: "Per packet (`BPF_PROG_TEST_RUN`)".to_owned(),
        intro: vec![
            "Each datapath program from the embedded object (`egress_agent::ebpf::OBJECT`), \
             run by the kernel on one 54-byte TCP frame (42-byte ARP for F1, 74-byte IPv6 \
             TCP for rows 1v6, 2v6, 4v6 and 5v6); ns per packet is \
             the kernel's own average per run (`duration`), which covers the program and the \
             test loop (bh disable/enable, `bpf_prog_run`), not the syscall. The floor F0 is \
             an empty TC program (`r0 = TC_ACT_OK; exit`) loaded with `BPF_PROG_LOAD` and run \
             the same way; the ratio column divides the row's median by F0's median (the \
             new-flow row by F2's, measured the same single-run way)."
                .to_owned(),
        ],
        header: [
            "#",
            "path",
            "program",
            "state",
            "method",
            "ns/packet (median)",
            "min",
            "max",
            "rounds",
            "x floor",
            "target (issue 7)",
        ]
        .map(str::to_owned)
        .to_vec(),
        rows,
        notes,
    }
}

/// Method notes of the per-packet table that do not depend on the run.
const NOTES: [&str; 5] = [
    "Every row is checked before it is timed (verdict, the exact counters it bumps, the \
     rewritten addresses), and every round checks that the counters moved by exactly \
     runs x expected reasons and nothing else: no row can be a drop path. The \
     established rows of `from_tunnel` (4, 4s, 4v6) are checked to take the flow's cached \
     next hop, not a FIB lookup, which no counter tells apart: after verification and after \
     every round, the flow's (and its partner's) conntrack entry holds a valid cache (the \
     current NH_GEN generation, under 1 s old), a packet sent with a poisoned destination \
     MAC in that cache leaves with it, and the cache is as the round found it (stamps \
     renewed before each round, outside the timed calls: a cache that expired mid-round \
     would have been filled again by a FIB lookup).",
    "Floors F0 and F1 are measured in every phase (each table size and the gateway) and \
     pooled, hence more rounds. F1 is `from_pod` on an ARP frame: the cheapest path \
     through a real program (one ethertype load).",
    "Rows 1-2: pods 10.244.0.1 upwards (row 1's unselected pod is 10.247.200.9), ten \
     destination prefixes each (/10 to /28), all tunneled to a remote gateway; \
     SELECTED_V4 holds the selected pods and their prefix lengths, DESTS_V4 the ten \
     prefixes. Row 2 sends from the pod in the middle of the table, to a destination in \
     its 4th prefix. The policy and destination maps' capacity (POLICY_V4, DESTS_V4 and \
     their IPv6 twins) is raised to 1,048,576 in this object (the agent's is 65,536: a \
     node holds only its own pods' entries) so that 100k and 1M entries fit; the maps are \
     not preallocated, so the limit does not change the lookup.",
    "Rows 1v6 and 2v6: rows 1 and 2 for IPv6 pods, measured only at 1 entry and at 100k \
     entries, in the same phases (same object, interleaved rounds) as rows 1 and 2 of those \
     sizes, on IPv6 tables of the same shape beside the IPv4 ones (which the IPv4 path \
     does not touch). POLICY_V6 holds one entry (pod fd00:244::1 -> 2001:db8:100:7::/64) \
     or 100k (pods fd00:244::1 upwards, 10k pods x 10 global unicast prefixes in \
     2001:db8::/32 of lengths /33 to /128, none inside another, so every pod's lengths \
     span the three words of its SELECTED_V6 value); DESTS_V6 holds the one or ten \
     prefixes, SELECTED_V6 the pods. Row 1v6's unselected pod is fd00:247:200::9; row 2v6 \
     sends from the pod in the middle of the table to 2001:db8:100:7::9 in its 4th prefix \
     (`from_pod` hands link-scoped destinations and neighbour discovery to the kernel \
     before any lookup). With one entry the pod has one length and the lookup skips \
     DESTS_V6; with ten it consults DESTS_V6, whose longest match (/64) is the pod's own \
     prefix: one POLICY_V6 probe either way. The targets of issue 7 are for the IPv4 \
     paths: none here.",
    "The FIB lookups run in a private network namespace with the egress device (veth), \
     its address and route, a permanent neighbour for the destination and forwarding on.",
];

const IPV6_NOTE: &str = "Rows 4v6 and 5v6: rows 4 and 5 for an IPv6 pod (NAT66, the \
     inner packet of the IPv4 underlay), measured with the gateway of rows 3-5 and the same \
     partner-flow scheme (frames start at hop limit 255, calls as for rows 4 and 5). CT_V6 holds \
     only the flow and its partner (4 entries, no background flows); the IPv6 rule, egress \
     IP, pod owners and admission are set up as the agent would, and sec0 has an IPv6 \
     address and a permanent neighbour for the destination.";

const NEW_FLOW_NOTE: &str = "Row 3: a new flow cannot be repeated on one skb, so each \
     sample is one call with `repeat = 1` and a fresh source port (TCP SYN: lookup miss, \
     rule lookup, two conntrack inserts, SNAT, FIB, redirect); the row is the median of \
     those single-run durations, and the new flows are removed again after each round. A \
     single run also pays the timer's own overhead (F2, the empty program timed the same \
     way) and starts with caches disturbed by the syscall; row 4s times the established \
     flow of row 4 the same way, so row 3 minus row 4s is the cost of creating the flow.";

/// The end of a `## ` heading that `cargo xtask bench` keeps as written: notes on what
/// changed between runs, with the commits they are about.
pub const HAND_WRITTEN: &str = "(hand-written, not regenerated)";

/// `generated` with every hand-written section of `previous` (a `## ` heading ending in
/// [`HAND_WRITTEN`], to the next `## ` heading) put back before its first section, in
/// their order, so that regenerating the report loses none of them.
pub fn keep_hand_written(previous: &str, generated: &str) -> String {
    let mut kept = String::new();
    let mut keeping = false;
    for line in previous.lines() {
        if line.starts_with("## ") {
            keeping = line.trim_end().ends_with(HAND_WRITTEN);
        }
        if keeping {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    if kept.is_empty() {
        return generated.to_owned();
    }
    if !kept.ends_with("\n\n") {
        kept.push('\n');
    }
    match generated.find("\n## ") {
        Some(i) => format!("{}{kept}{}", &generated[..=i], &generated[i + 1..]),
        None => format!("{generated}\n{kept}"),
    }
}

#[cfg(test)]
mod hand_written_tests {
    use super::*;

    #[test]
    fn hand_written_sections_survive_a_regeneration_and_generated_ones_do_not() {
        let previous = "# Benchmarks\n\nheader\n\n## What changed since abc (hand-written, not regenerated)\n\nnotes on abc\n\n| a | b |\n\n## Per packet\n\nold numbers\n\n## Later notes (hand-written, not regenerated)\n\nmore\n";
        let generated = "# Benchmarks\n\nnew header\n\n## Per packet\n\nnew numbers\n";
        let out = keep_hand_written(previous, generated);
        assert_eq!(
            out,
            "# Benchmarks\n\nnew header\n\n## What changed since abc (hand-written, not regenerated)\n\nnotes on abc\n\n| a | b |\n\n## Later notes (hand-written, not regenerated)\n\nmore\n\n## Per packet\n\nnew numbers\n"
        );
        assert!(!out.contains("old numbers"));
        // Twice is the same as once: nothing doubles.
        assert_eq!(keep_hand_written(&out, generated), out);
        assert_eq!(keep_hand_written("", generated), generated);
    }
}
