//! Who holds the egress IP during a case: per gateway, a thread in its namespace samples
//! its up interfaces every interval; the timeline of what they saw.

use std::{
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::{self, JoinHandle},
    time::Duration,
};

use anyhow::Result;

use super::gateways;
use crate::{lab::Lab, netns, stream::unix_ms};

/// Per gateway, a thread in its namespace that looks for the egress IP on its up
/// interfaces every interval and records each change: `(unix ms, interface or None)`.
pub(super) struct Sampler {
    stop: Arc<AtomicBool>,
    threads: Vec<(&'static str, JoinHandle<Result<Vec<Sample>>>)>,
}

type Sample = (u64, Option<String>);

impl Sampler {
    pub(super) fn start(lab: &Lab, ip: IpAddr, every: Duration) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for gw in gateways() {
            let stop = Arc::clone(&stop);
            let handle = lab.ns(gw)?.spawn_in(move || {
                let mut out: Vec<Sample> = Vec::new();
                loop {
                    let at = unix_ms();
                    let held = netns::up_addresses()?
                        .into_iter()
                        .find(|(_, a)| *a == ip)
                        .map(|(ifc, _)| ifc);
                    if out.last().is_none_or(|(_, last)| *last != held) {
                        out.push((at, held));
                    }
                    if stop.load(Ordering::Relaxed) {
                        return Ok(out);
                    }
                    thread::sleep(every);
                }
            })?;
            threads.push((gw, handle));
        }
        Ok(Self { stop, threads })
    }

    pub(super) fn stop(self) -> Result<Timeline> {
        self.stop.store(true, Ordering::Relaxed);
        let end = unix_ms();
        let mut per_gw = Vec::new();
        for (gw, t) in self.threads {
            let samples = t
                .join()
                .map_err(|_| anyhow::anyhow!("the sampler of {gw} panicked"))??;
            per_gw.push((gw, samples));
        }
        Ok(Timeline { end, per_gw })
    }
}

/// Who held the IP when, per gateway.
pub(super) struct Timeline {
    end: u64,
    per_gw: Vec<(&'static str, Vec<Sample>)>,
}

impl Timeline {
    /// Gateways holding the IP at `t` (by their last sample at or before `t`).
    pub(super) fn holders_at(&self, t: u64) -> Vec<&'static str> {
        self.per_gw
            .iter()
            .filter(|(_, s)| {
                s.iter()
                    .rev()
                    .find(|(at, _)| *at <= t)
                    .is_some_and(|(_, h)| h.is_some())
            })
            .map(|(gw, _)| *gw)
            .collect()
    }

    /// When every gateway has been sampled once: the timeline starts there.
    fn start(&self) -> u64 {
        self.per_gw
            .iter()
            .filter_map(|(_, s)| s.first().map(|(at, _)| *at))
            .max()
            .unwrap_or(self.end)
    }

    /// The start and every change after it.
    fn change_points(&self) -> Vec<u64> {
        let start = self.start();
        let mut pts: Vec<u64> = self
            .per_gw
            .iter()
            .flat_map(|(_, s)| s.iter().map(|(at, _)| *at))
            .filter(|at| *at > start)
            .chain([start])
            .collect();
        pts.sort_unstable();
        pts.dedup();
        pts
    }

    pub(super) fn two_holders_ms(&self) -> u64 {
        let mut pts = self.change_points();
        pts.push(self.end);
        pts.windows(2)
            .filter(|w| self.holders_at(w[0]).len() >= 2)
            .map(|w| w[1].saturating_sub(w[0]))
            .sum()
    }

    /// The holder sets in order, consecutive repeats merged (`-`: nobody), each after the
    /// first with when it began, in ms from `t`: `gw1 > -@+20 > gw2@+45`.
    pub(super) fn path(&self, t: u64) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let mut last = None;
        for at in self.change_points() {
            let h = self.holders_at(at);
            let h = if h.is_empty() {
                "-".to_owned()
            } else {
                h.join("+")
            };
            if last.as_ref() == Some(&h) {
                continue;
            }
            out.push(if last.is_none() {
                h.clone()
            } else {
                format!("{h}@{:+}", at as i64 - t as i64)
            });
            last = Some(h);
        }
        out
    }

    /// The first gateway other than `old` seen holding the IP at or after `t`.
    pub(super) fn first_other_holder(&self, old: &str, t: u64) -> Option<(String, String)> {
        self.per_gw
            .iter()
            .filter(|(gw, _)| *gw != old)
            .filter_map(|(gw, s)| {
                // Held at t already, or from a later change on.
                let at_t = s
                    .iter()
                    .rev()
                    .find(|(at, _)| *at <= t)
                    .and_then(|(_, h)| h.clone())
                    .map(|h| (t, h));
                let later = s
                    .iter()
                    .find(|(at, h)| *at > t && h.is_some())
                    .and_then(|(at, h)| h.clone().map(|h| (*at, h)));
                at_t.or(later).map(|(at, ifc)| (at, gw.to_string(), ifc))
            })
            .min()
            .map(|(_, gw, ifc)| (gw, ifc))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeline() -> Timeline {
        let s = |v: &[(u64, Option<&str>)]| -> Vec<Sample> {
            v.iter().map(|(t, h)| (*t, h.map(str::to_owned))).collect()
        };
        Timeline {
            end: 1000,
            per_gw: vec![
                // Sampled a little later than gw2: the timeline starts at 5, not with
                // nobody holding the IP at 0.
                (
                    "gw1",
                    s(&[(5, Some("sec-a")), (300, None), (700, Some("sec-a"))]),
                ),
                ("gw2", s(&[(0, None), (250, Some("sec-a")), (800, None)])),
            ],
        }
    }

    #[test]
    fn the_timeline_counts_two_holders_and_finds_the_new_one() {
        let tl = timeline();
        // 250..300 and 700..800.
        assert_eq!(tl.two_holders_ms(), 150);
        assert_eq!(tl.holders_at(260), ["gw1", "gw2"]);
        assert_eq!(tl.holders_at(900), ["gw1"]);
        assert_eq!(
            tl.path(200),
            ["gw1", "gw1+gw2@+50", "gw2@+100", "gw1+gw2@+500", "gw1@+600"]
        );
        assert_eq!(
            tl.first_other_holder("gw1", 100),
            Some(("gw2".to_owned(), "sec-a".to_owned()))
        );
        assert_eq!(tl.first_other_holder("gw1", 900), None);
    }
}
