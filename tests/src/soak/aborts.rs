//! The soak's aborted connections: `egress-echo abort` from pods of their own, one TCP
//! connection after another, each ended by a RST (by turns the pod's and the far host's),
//! from a new source port each time or always from the same one (a reused tuple).

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use anyhow::{Context as _, Result};

use super::floor::{Floor, PodFlows};
use crate::{aborts::Summary, lab::Lab, lab::addr, netns::NsChild};

/// An aborting pod: `pod` connects to `host`, which must see `expect`, every interval.
#[derive(Clone, Debug)]
pub struct AbortSpec {
    pub name: &'static str,
    pub pod: &'static str,
    pub host: IpAddr,
    pub expect: IpAddr,
    /// Every connection from this port (`egress-echo abort --sport`).
    pub sport: Option<u16>,
    pub interval_ms: u64,
}

/// What one aborting pod did, and what its flows came back to.
#[derive(Clone, Debug)]
pub struct AbortReport {
    pub spec: AbortSpec,
    /// `None`: the client printed no summary (it died, or was never started).
    pub summary: Option<Summary>,
    /// The pod's live flows (`FLOWS_V4`, summed over the nodes) at their highest, sampled
    /// every second while it aborted.
    pub peak: u32,
    /// The same count at the last look after the aborts stopped.
    pub end: u32,
    /// What that count must come back to.
    pub floor: Floor,
    /// Its flows in conntrack at that look.
    pub flows: PodFlows,
    /// From the aborts' stop until the count was at the floor (`None`: not within
    /// [`super::floor::WITHIN`]).
    pub at_floor_after: Option<Duration>,
}

impl AbortReport {
    /// Sources the host saw other than the expected one.
    pub fn wrong_sources(&self) -> Vec<IpAddr> {
        self.summary
            .iter()
            .flat_map(|s| &s.sources)
            .filter(|ip| **ip != self.spec.expect)
            .copied()
            .collect()
    }
}

/// The running clients.
pub(super) struct Aborters {
    running: Vec<(AbortSpec, NsChild, PathBuf)>,
}

impl Aborters {
    /// Start one client per spec, each stopping by itself after `cap`.
    pub(super) fn start(lab: &Lab, specs: &[AbortSpec], cap: Duration) -> Result<Self> {
        let mut running = Vec::new();
        for spec in specs {
            let log = lab.dir().join(format!("soak-{}.log", spec.name));
            let target = SocketAddr::new(spec.host, addr::ECHO_PORT).to_string();
            let mut args = vec![
                "abort".to_owned(),
                "tcp".to_owned(),
                target,
                "--interval-ms".to_owned(),
                spec.interval_ms.to_string(),
                "--duration-ms".to_owned(),
                cap.as_millis().to_string(),
            ];
            if let Some(p) = spec.sport {
                args.extend(["--sport".to_owned(), p.to_string()]);
            }
            let child = lab.ns(spec.pod)?.spawn(&lab.spec().echo_bin, &args, &log)?;
            running.push((spec.clone(), child, log));
        }
        Ok(Self { running })
    }

    /// Stop every client (each ends its round in progress) and read its summary; one
    /// that had ended by itself (it stopped aborting) is an error.
    pub(super) fn stop(mut self) -> Vec<(AbortSpec, Result<Summary>)> {
        let ended: Vec<bool> = self
            .running
            .iter_mut()
            .map(|(_, c, _)| matches!(c.try_wait(), Ok(Some(_))))
            .collect();
        for (_, c, _) in &mut self.running {
            c.signal_term();
        }
        self.running
            .into_iter()
            .zip(ended)
            .map(|((spec, mut c, log), ended)| {
                let _ = c.wait_for(Duration::from_secs(5));
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let s = if ended {
                    Err(anyhow::anyhow!(
                        "aborts {}: the client ended before the soak did: {}",
                        spec.name,
                        text.lines().last().unwrap_or("no output")
                    ))
                } else {
                    Summary::find_in(&text)
                        .with_context(|| format!("aborts {}: {}", spec.name, log.display()))
                };
                (spec, s)
            })
            .collect()
    }
}
