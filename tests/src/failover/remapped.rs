//! Flows whose source port a gateway remapped, through a holder change (issue 44, item 4).
//! Pods `w1-p1` and `w2-p1` stream TCP to host A from the same source port, so the holder
//! of egress IP A gives the second another port; host A knows that flow by it. The holder
//! dies silently, is drained or goes NotReady; the other gateway takes A over and sees
//! each flow's next segment first: unless it gives the second flow the same port, host A
//! answers that flow with a RST.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};

use super::{Kind, Target, Timing, inject, recover, wait_steady};
use crate::{
    cluster,
    lab::{Lab, addr},
    netns::NsChild,
    stream::{Summary, unix_ms},
};

/// The source port both pods stream from in a lab's first run; each later run takes the
/// next (a closed flow's port stays in TIME_WAIT in the pod that closed it).
pub const SPORT: u16 = 45_000;
const PODS: [&str; 2] = ["w1-p1", "w2-p1"];
/// From the remapped flow's first reply until the holder fails, at most.
pub const SHARED_WITHIN: Duration = Duration::from_secs(1);

/// What the run showed.
#[derive(Clone, Debug)]
pub struct RemappedReport {
    /// Each pod's stream as it ended.
    pub streams: Vec<(String, Summary)>,
    /// The source each pod's flow had at host A before the failure (`ip:port`).
    pub before: Vec<(String, String)>,
    /// Remaps the other gateway held when the holder failed ([`SHARED_WITHIN`] after the
    /// remapped flow's first reply; its `REMAP_V4`).
    pub shared: usize,
    /// The holder that failed and the one that took over.
    pub old: String,
    pub new: Option<String>,
    /// When the holder failed (unix ms).
    pub t_unix_ms: u64,
}

impl RemappedReport {
    /// Replies each pod got after the failure.
    pub fn replies_after(&self) -> Vec<(String, usize)> {
        self.streams
            .iter()
            .map(|(pod, s)| {
                let n = s
                    .replies_unix_ms
                    .iter()
                    .filter(|t| **t > self.t_unix_ms)
                    .count();
                (pod.clone(), n)
            })
            .collect()
    }
}

struct Stream {
    pod: &'static str,
    child: NsChild,
    log: PathBuf,
    events: PathBuf,
}

/// The last source host A reported to a stream, from its events file.
fn last_source(events: &Path) -> Option<String> {
    let text = std::fs::read_to_string(events).ok()?;
    text.lines().rev().find_map(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        (w.get(1) == Some(&"reply")).then(|| w.get(3).map(|s| (*s).to_owned()))?
    })
}

/// Whether a stream's events file shows a reply after `t` (unix ms).
fn replied_after(events: &Path, t: u64) -> bool {
    std::fs::read_to_string(events).is_ok_and(|text| {
        text.lines().any(|l| {
            let mut w = l.split_whitespace();
            matches!(
                (w.next().and_then(|x| x.parse::<u64>().ok()), w.next()),
                (Some(at), Some("reply")) if at > t
            )
        })
    })
}

/// `gw`'s `REMAP_V4` entries for flows from source port `sport` (bpftool; a key is a
/// `CtKeyV4`, its source port big-endian at bytes 8 and 9): a lab's earlier runs leave
/// theirs, kept for minutes.
fn remaps_on(lab: &Lab, gw: &str, sport: u16) -> usize {
    let pin = lab.bpffs_dir(gw).join(egress_common::maps::REMAP_V4);
    let out = std::process::Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(&pin)
        .output();
    let byte = |v: &serde_json::Value| {
        v.as_str()
            .and_then(|s| u8::from_str_radix(s.trim_start_matches("0x"), 16).ok())
    };
    let port_of = |entry: &serde_json::Value| {
        let key = entry.get("key")?.as_array()?;
        Some(u16::from_be_bytes([byte(key.get(8)?)?, byte(key.get(9)?)?]))
    };
    out.ok()
        .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
        .and_then(|v| {
            v.as_array()
                .map(|entries| entries.iter().filter(|e| port_of(e) == Some(sport)).count())
        })
        .unwrap_or(0)
}

/// Run it on a steady IPv4 lab with agents, the holder failing as `kind` says and both
/// pods streaming from `sport`; the lab is recovered afterwards.
pub fn run(lab: &mut Lab, label: &str, kind: Kind, sport: u16) -> Result<RemappedReport> {
    // One holder of each egress IP, each serving: a gateway back from a silent death still
    // carries the address it had until its agent lets it go.
    let target = Target::of(lab.family());
    wait_steady(lab, &target, &Timing::default()).context("before the streams")?;
    let old = cluster::holder(lab, addr::EGRESS_IP_A).context("no gateway holds egress IP A")?;
    let other = lab
        .gateways()
        .into_iter()
        .find(|g| *g != old.0)
        .context("no second gateway")?
        .to_owned();
    let echo = SocketAddr::new(addr::HOST_A.into(), addr::ECHO_PORT).to_string();
    let sport_arg = sport.to_string();
    let mut streams = Vec::new();
    for pod in PODS {
        let log = lab.dir().join(format!("{label}-{pod}.log"));
        let events = lab.dir().join(format!("{label}-{pod}.events"));
        let args = [
            "stream",
            "tcp",
            &echo,
            "--sport",
            &sport_arg,
            "--interval-ms",
            "100",
            "--duration-ms",
            "120000",
            "--events",
            &events.to_string_lossy(),
        ];
        let child = lab.ns(pod)?.spawn(&lab.spec().echo_bin, &args, &log)?;
        // One after the other: the first keeps its port, the second is remapped.
        let deadline = Instant::now() + Duration::from_secs(10);
        while last_source(&events).is_none() {
            ensure!(
                Instant::now() < deadline,
                "{pod}'s stream got no reply: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            thread::sleep(Duration::from_millis(100));
        }
        streams.push(Stream {
            pod,
            child,
            log,
            events,
        });
    }
    let before: Vec<(String, String)> = streams
        .iter()
        .map(|s| (s.pod.to_owned(), last_source(&s.events).unwrap_or_default()))
        .collect();
    let kept = format!("{}:{sport}", addr::EGRESS_IP_A);
    let remapped = before.iter().filter(|(_, src)| *src != kept).count();
    if remapped != 1 {
        bail!("expected one flow at {kept} and one remapped, host A saw {before:?}");
    }
    // The holder shares a remap in its next hellos (not at its conntrack sweep, up to 2 s
    // later): the other gateway has it within a second of the flow's first reply, and the
    // holder fails right then, as it may a moment after any flow opened. The report says
    // how many the other gateway had.
    let deadline = Instant::now() + SHARED_WITHIN;
    while remaps_on(lab, &other, sport) == 0 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    let shared = remaps_on(lab, &other, sport);
    let t = unix_ms();
    let injected = inject(lab, kind, &old);
    // Both streams answered again (or 20 s went by).
    let deadline = Instant::now() + Duration::from_secs(20);
    while injected.is_ok()
        && Instant::now() < deadline
        && !streams.iter().all(|s| replied_after(&s.events, t + 500))
    {
        thread::sleep(Duration::from_millis(200));
    }
    thread::sleep(Duration::from_secs(2));
    let new = cluster::holder(lab, addr::EGRESS_IP_A).map(|(g, _)| g);
    for s in &mut streams {
        s.child.signal_term();
    }
    let mut summaries = Vec::new();
    for s in &mut streams {
        if s.child.wait_for(Duration::from_secs(3))?.is_none() {
            s.child.terminate(Duration::ZERO);
        }
        let text = std::fs::read_to_string(&s.log).unwrap_or_default();
        let summary = Summary::find_in(&text).with_context(|| format!("{}'s stream", s.pod))?;
        summaries.push((s.pod.to_owned(), summary));
    }
    recover(lab, kind, &old).with_context(|| format!("failed to recover from {}", kind.name()))?;
    injected.with_context(|| format!("failed to inject {} on {}", kind.name(), old.0))?;
    wait_steady(lab, &target, &Timing::default())
        .with_context(|| format!("after recovering from {}", kind.name()))?;
    Ok(RemappedReport {
        streams: summaries,
        before,
        shared,
        old: old.0,
        new,
        t_unix_ms: t,
    })
}
