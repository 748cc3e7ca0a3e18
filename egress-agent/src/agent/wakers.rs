//! What wakes the agent for a pass: the state source (held back while passes are
//! expensive, [`StateBatch`]), link and address changes, the resync tick, the liveness
//! service, timers the pass asked for, signals; and what is handled at once between
//! passes (new pod devices, the CNI plugin's requests, peers' transitions).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Result;
use tracing::{info, warn};

use super::{Reconciler, batch::StateBatch};
use crate::{
    datapath::Datapath,
    iface,
    liveness::{self, Transition},
    source::Snapshot,
};

/// What wakes the agent for a pass, besides the state source.
pub(super) struct Wakers {
    /// When a pass for a state change may start (told of every pass).
    pub(super) batch: StateBatch,
    /// Link and address changes on this node.
    pub(super) changes: tokio::sync::mpsc::Receiver<()>,
    /// The periodic resync (`--resync`).
    pub(super) tick: tokio::time::Interval,
    pub(super) sigterm: tokio::signal::unix::Signal,
    /// The liveness service's view of the peers.
    pub(super) peer_views: tokio::sync::watch::Receiver<liveness::tracker::PeerView>,
    /// Peers' transitions (noted as they come, for the failover table).
    pub(super) transitions: tokio::sync::mpsc::UnboundedReceiver<liveness::tracker::Transition>,
    /// New links, with `--unknown-pods drop` (handled at once, between passes).
    pub(super) new_links: Option<tokio::sync::mpsc::Receiver<iface::NewLink>>,
    /// The CNI plugin's requests (`--cni-socket`), each with its reply's channel.
    pub(super) cni: Option<tokio::sync::mpsc::Receiver<CniCall>>,
}

/// A CNI plugin request and where its reply goes.
pub(super) type CniCall = (
    crate::cni::Request,
    tokio::sync::oneshot::Sender<crate::cni::Reply>,
);

/// The next CNI request; pending forever without a socket.
async fn next_cni(rx: &mut Option<tokio::sync::mpsc::Receiver<CniCall>>) -> CniCall {
    if let Some(r) = rx {
        if let Some(call) = r.recv().await {
            return call;
        }
        *rx = None;
    }
    std::future::pending().await
}

/// The next new link; pending forever without a subscription (or once it died).
async fn next_link(rx: &mut Option<tokio::sync::mpsc::Receiver<iface::NewLink>>) -> iface::NewLink {
    if let Some(r) = rx {
        if let Some(link) = r.recv().await {
            return link;
        }
        warn!("the new-link subscription ended: new pod devices wait for the next pass");
        *rx = None;
    }
    std::future::pending().await
}

impl Wakers {
    /// Wait for the next reason for a pass (its name, for the metrics), noting peer
    /// transitions in `r` meanwhile; `None` on SIGINT or SIGTERM.
    pub(super) async fn next(
        &mut self,
        views: &mut tokio::sync::watch::Receiver<Arc<Snapshot>>,
        r: &mut Reconciler<'_>,
        dp: &mut Datapath,
    ) -> Result<Option<&'static str>> {
        // A state change seen and waiting for the batch's start: when it was seen, and
        // when its pass starts.
        let mut held: Option<(Instant, Instant)> = None;
        loop {
            let wake = r.wake_at;
            let trigger = tokio::select! {
                // A new pod device first: its attachment must not wait behind a pass.
                biased;
                link = next_link(&mut self.new_links) => {
                    r.on_new_link(dp, &link);
                    continue;
                }
                (req, reply) = next_cni(&mut self.cni) => {
                    let answer = r.on_cni(dp, &req).await;
                    let _ = reply.send(answer);
                    continue;
                }
                res = views.changed(), if held.is_none() => {
                    if res.is_err() {
                        anyhow::bail!("the state source stopped");
                    }
                    let now = Instant::now();
                    let at = self.batch.start_at(now);
                    if at > now {
                        held = Some((now, at));
                        continue;
                    }
                    "state"
                }
                () = sleep_until(held.map(|(_, at)| at)) => "state",
                res = self.peer_views.changed() => {
                    if res.is_err() {
                        anyhow::bail!("the probe service stopped");
                    }
                    "probe"
                }
                Some(t) = self.transitions.recv() => {
                    r.note(&t);
                    continue;
                }
                _ = self.changes.recv() => "netlink",
                _ = self.tick.tick() => "resync",
                () = sleep_until(wake) => "timer",
                _ = tokio::signal::ctrl_c() => return Ok(None),
                _ = self.sigterm.recv() => return Ok(None),
            };
            // A new pod device's notification may be read just after the change that
            // woke this pass: attach it before the pass, not after.
            tokio::task::yield_now().await;
            while let Some(link) = self.new_links.as_mut().and_then(|r| r.try_recv().ok()) {
                r.on_new_link(dp, &link);
            }
            // Coalesce bursts of netlink events (our own address changes cause some).
            while self.changes.try_recv().is_ok() {}
            while let Ok(t) = self.transitions.try_recv() {
                r.note(&t);
            }
            // Whatever woke this pass, it takes the change that was waiting.
            let waited = held.map_or(Duration::ZERO, |(seen, _)| seen.elapsed());
            if held.is_some() || trigger == "state" {
                let s = r.stats.lock().unwrap_or_else(|e| e.into_inner());
                s.state_batch_delay.observe(waited);
            }
            return Ok(Some(trigger));
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

impl Reconciler<'_> {
    /// Log and count a liveness transition.
    fn note(&mut self, t: &Transition) {
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        match t {
            Transition::Died { name, silent_for } => {
                warn!(
                    peer = %name,
                    silent_ms = silent_for.as_millis(),
                    "peer unreachable: no probe heard within the detection time"
                );
                s.liveness.detections += 1;
                s.liveness.last_detection = Some(*silent_for);
                s.liveness.detection.observe(*silent_for);
            }
            Transition::Revived { name } => info!(peer = %name, "peer reachable again"),
            Transition::CutOff => warn!(
                "this node hears fewer than a majority of its peers: giving up its egress IPs"
            ),
            Transition::Reconnected => info!("this node hears a majority of its peers again"),
        }
    }
}
