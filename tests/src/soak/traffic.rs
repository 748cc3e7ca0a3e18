//! The soak's traffic: long-lived `egress-echo stream` flows (restarted, and counted,
//! when one breaks) and a steady rate of new short flows (`egress-echo query`, one after
//! another from a few pods, each from a new ephemeral port).

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    process::Command,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result};

use crate::{
    lab::{Lab, Proto, Seen, addr},
    netns::NsChild,
    stream::{Summary, unix_ms},
};

/// A long-lived flow: `pod` streams to `host`, which must see `expect` (or nothing).
#[derive(Clone, Debug)]
pub struct FlowSpec {
    pub name: &'static str,
    pub pod: &'static str,
    pub proto: Proto,
    pub host: IpAddr,
    pub expect: IpAddr,
    pub interval_ms: u64,
}

/// A stream that ended before the soak did (a TCP connection reset or closed).
#[derive(Clone, Debug)]
pub struct Break {
    pub at_ms: u64,
    pub flow: &'static str,
    pub why: String,
    /// The churn event(s) in progress.
    pub during: String,
}

/// What one long-lived flow did over the soak (all its incarnations).
#[derive(Clone, Debug)]
pub struct FlowReport {
    pub spec: FlowSpec,
    /// Streams started: 1 + restarts after breaks.
    pub incarnations: u32,
    pub sent: u64,
    pub received: u64,
    pub longest_gap_ms: u64,
    /// When the longest gap began (unix milliseconds), and the churn event(s) then.
    pub longest_gap_at_ms: u64,
    pub longest_gap_during: String,
    /// Sources the echo server reported other than the expected one.
    pub wrong_sources: Vec<String>,
    pub breaks: Vec<Break>,
}

struct Running {
    spec: FlowSpec,
    child: NsChild,
    log: PathBuf,
    events: PathBuf,
}

/// The long-lived flows.
pub(super) struct Streams {
    running: Vec<Running>,
    reports: Vec<FlowReport>,
    /// A cap on each stream's duration: the soak stops them.
    cap_ms: u64,
}

impl Streams {
    pub(super) fn start(lab: &Lab, specs: &[FlowSpec], cap: Duration) -> Result<Self> {
        let cap_ms = cap.as_millis() as u64;
        let mut out = Self {
            running: Vec::new(),
            reports: specs
                .iter()
                .map(|spec| FlowReport {
                    spec: spec.clone(),
                    incarnations: 0,
                    sent: 0,
                    received: 0,
                    longest_gap_ms: 0,
                    longest_gap_at_ms: 0,
                    longest_gap_during: String::new(),
                    wrong_sources: Vec::new(),
                    breaks: Vec::new(),
                })
                .collect(),
            cap_ms,
        };
        for spec in specs {
            let r = out.spawn(lab, spec)?;
            out.running.push(r);
        }
        Ok(out)
    }

    fn spawn(&mut self, lab: &Lab, spec: &FlowSpec) -> Result<Running> {
        let report = self
            .reports
            .iter_mut()
            .find(|r| r.spec.name == spec.name)
            .context("unknown flow")?;
        report.incarnations += 1;
        let n = report.incarnations;
        let log = lab.dir().join(format!("soak-{}-{n}.log", spec.name));
        let events = lab.dir().join(format!("soak-{}-{n}.events", spec.name));
        let target = SocketAddr::new(spec.host, addr::ECHO_PORT).to_string();
        let child = lab.ns(spec.pod)?.spawn(
            &lab.spec().echo_bin,
            &[
                "stream",
                &spec.proto.to_string(),
                &target,
                "--interval-ms",
                &spec.interval_ms.to_string(),
                "--duration-ms",
                &self.cap_ms.to_string(),
                "--events",
                &events.to_string_lossy(),
            ],
            &log,
        )?;
        Ok(Running {
            spec: spec.clone(),
            child,
            log,
            events,
        })
    }

    /// Restart the streams that ended; each one that did is a [`Break`].
    pub(super) fn poll(&mut self, lab: &Lab, during: impl Fn(u64) -> String) -> Vec<Break> {
        let mut breaks = Vec::new();
        for i in 0..self.running.len() {
            if !matches!(self.running[i].child.try_wait(), Ok(Some(_))) {
                continue;
            }
            let spec = self.running[i].spec.clone();
            let at_ms = broke_at(&self.running[i].events).unwrap_or_else(unix_ms);
            let summary = self.collect(i);
            let why = summary
                .as_ref()
                .ok()
                .and_then(|s| s.error.clone())
                .unwrap_or_else(|| "the stream ended".to_owned());
            let b = Break {
                at_ms,
                flow: spec.name,
                why,
                during: during(at_ms),
            };
            if let Some(r) = self.report_mut(spec.name) {
                r.breaks.push(b.clone());
            }
            breaks.push(b);
            match self.spawn(lab, &spec) {
                Ok(r) => self.running[i] = r,
                Err(e) => eprintln!("soak: failed to restart flow {}: {e:#}", spec.name),
            }
        }
        breaks
    }

    /// Fold an ended stream's summary into its report.
    fn collect(&mut self, i: usize) -> Result<Summary> {
        let (name, expect, log) = {
            let r = &self.running[i];
            (r.spec.name, r.spec.expect, r.log.clone())
        };
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let s = Summary::find_in(&text).with_context(|| format!("flow {name}: no summary"))?;
        if let Some(r) = self.report_mut(name) {
            r.sent += s.sent;
            r.received += s.received;
            if s.longest_gap_ms > r.longest_gap_ms {
                r.longest_gap_ms = s.longest_gap_ms;
                r.longest_gap_at_ms = s.gap_start_unix_ms;
            }
            let prefix = format!("{expect}:");
            for src in &s.sources {
                if !src.starts_with(&prefix) && !r.wrong_sources.contains(src) {
                    r.wrong_sources.push(src.clone());
                }
            }
        }
        Ok(s)
    }

    /// Breaks so far.
    pub(super) fn breaks(&self) -> usize {
        self.reports.iter().map(|r| r.breaks.len()).sum()
    }

    fn report_mut(&mut self, name: &str) -> Option<&mut FlowReport> {
        self.reports.iter_mut().find(|r| r.spec.name == name)
    }

    /// Stop the streams `which` selects; their summaries go into their reports, and the
    /// others run on.
    pub(super) fn stop_where(&mut self, which: impl Fn(&FlowSpec) -> bool) {
        for r in self.running.iter_mut().filter(|r| which(&r.spec)) {
            r.child.signal_term();
        }
        let mut i = 0;
        while i < self.running.len() {
            if !which(&self.running[i].spec) {
                i += 1;
                continue;
            }
            let _ = self.running[i].child.wait_for(Duration::from_secs(5));
            if let Err(e) = self.collect(i) {
                eprintln!("soak: {e:#}");
            }
            self.running.remove(i);
        }
    }

    /// Stop every stream and report.
    pub(super) fn stop(mut self, during: impl Fn(u64) -> String) -> Vec<FlowReport> {
        self.stop_where(|_| true);
        for r in &mut self.reports {
            r.longest_gap_during = during(r.longest_gap_at_ms);
        }
        self.reports
    }
}

/// When the events file says the stream broke (`<unix ms> reset|error ...`).
fn broke_at(events: &std::path::Path) -> Option<u64> {
    let text = std::fs::read_to_string(events).ok()?;
    text.lines().rev().find_map(|l| {
        let mut w = l.split_whitespace();
        let at = w.next()?.parse().ok()?;
        matches!(w.next()?, "reset" | "error").then_some(at)
    })
}

/// New short flows from one pod, in turn to each of `targets`: (protocol, host, the source
/// the host must report).
#[derive(Clone, Debug)]
pub struct QuerySpec {
    pub pod: &'static str,
    pub targets: Vec<(Proto, IpAddr, IpAddr)>,
}

/// Counts of one (pod, protocol, host).
#[derive(Clone, Debug, Default)]
pub struct QueryCounts {
    pub sent: u64,
    pub answered: u64,
    /// Answered, with another source than expected.
    pub wrong: u64,
}

/// A short flow answered with the wrong source.
#[derive(Clone, Debug)]
pub struct WrongAnswer {
    pub at_ms: u64,
    pub pod: &'static str,
    pub target: String,
    pub seen: String,
}

type QueryStats = Vec<((&'static str, Proto, IpAddr), QueryCounts)>;

/// The query loops, one thread per pod.
pub(super) struct Queries {
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
    stats: Arc<Mutex<QueryStats>>,
    wrong: Arc<Mutex<Vec<WrongAnswer>>>,
}

impl Queries {
    /// One query after another (each waits up to 1 s), `pause` between two.
    pub(super) fn start(lab: &Lab, specs: &[QuerySpec], pause: Duration) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Mutex::new(QueryStats::new()));
        let wrong = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        for spec in specs {
            let ns = lab.ns_name(spec.pod);
            let echo = lab.spec().echo_bin.clone();
            let (spec, stop, stats, wrong) =
                (spec.clone(), stop.clone(), stats.clone(), wrong.clone());
            threads.push(thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let (proto, host, expect) = spec.targets[i % spec.targets.len()];
                    i += 1;
                    let seen = query(&ns, &echo, proto, host);
                    let key = (spec.pod, proto, host);
                    {
                        let mut st = stats.lock().unwrap_or_else(|e| e.into_inner());
                        let c = match st.iter().position(|(k, _)| *k == key) {
                            Some(p) => &mut st[p].1,
                            None => {
                                st.push((key, QueryCounts::default()));
                                &mut st.last_mut().expect("just pushed").1
                            }
                        };
                        c.sent += 1;
                        if let Some(s) = seen {
                            c.answered += 1;
                            if s.ip != expect {
                                c.wrong += 1;
                                wrong
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .push(WrongAnswer {
                                        at_ms: unix_ms(),
                                        pod: spec.pod,
                                        target: format!("{proto} {host}"),
                                        seen: s.to_string(),
                                    });
                            }
                        }
                    }
                    thread::sleep(pause);
                }
            }));
        }
        Ok(Self {
            stop,
            threads,
            stats,
            wrong,
        })
    }

    /// Wrong answers since the last call.
    pub(super) fn take_wrong(&self) -> Vec<WrongAnswer> {
        std::mem::take(&mut *self.wrong.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub(super) fn stop(self) -> QueryStats {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        let st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        st.clone()
    }
}

/// `egress-echo query` in namespace `ns`: what the host reported, if it answered.
fn query(ns: &str, echo: &std::path::Path, proto: Proto, host: IpAddr) -> Option<Seen> {
    let target = SocketAddr::new(host, addr::ECHO_PORT).to_string();
    let out = Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(echo)
        .args(["query", &proto.to_string(), &target, "--timeout-ms", "1000"])
        .output()
        .ok()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .find(|l| l.starts_with("seen "))
        .and_then(|l| l.parse().ok())
}
