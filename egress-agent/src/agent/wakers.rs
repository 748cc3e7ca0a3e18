//! What wakes the agent: the state source (held back while passes are expensive,
//! [`StateBatch`]), link and address changes, the resync tick, the liveness service,
//! timers the pass asked for, signals; and what is handled at once between passes (new
//! pod devices, the CNI plugin's requests, peers' transitions). [`Wakers::next`] says
//! what woke it ([`Wake`]); `run` acts on it.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use tracing::{info, warn};

use super::{RunConfig, UnknownPods, batch::StateBatch, early::Early};
use crate::{
    iface,
    liveness::tracker::{PeerView, Transition},
    source::Snapshot,
};

/// What woke the agent.
#[derive(Debug)]
pub(super) enum Wake {
    /// A pass is due.
    Pass(Due),
    /// A link appeared (`--unknown-pods drop`): its attachment must not wait for a pass.
    NewLink(iface::NewLink),
    /// The CNI plugin asks (`--cni-socket`); the reply goes back on the call's channel.
    Cni(CniCall),
    /// A peer's liveness changed (noted as it comes, for the failover table).
    Transition(Transition),
    /// SIGINT or SIGTERM.
    Stop,
}

/// Why a pass is due (its name is the metrics' `trigger`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Trigger {
    /// The state source changed (after its batch's rest, [`StateBatch`]).
    State,
    /// The liveness service's view of the peers changed.
    Probe,
    /// A link or an address of this node changed.
    Netlink,
    /// The periodic resync (`--resync`).
    Resync,
    /// A time the last pass asked for (a handover, the warm-up or a linger ending).
    Timer,
}

impl Trigger {
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::State => "state",
            Self::Probe => "probe",
            Self::Netlink => "netlink",
            Self::Resync => "resync",
            Self::Timer => "timer",
        }
    }
}

/// A pass that is due: why, the cluster and the peers as it is to see them, and what
/// arrived with the event that woke it (handled before the pass).
#[derive(Debug)]
pub(super) struct Due {
    pub trigger: Trigger,
    /// The state source's latest snapshot (shared with the source, not copied: a copy of
    /// 10k Pods is tens of MiB).
    pub snapshot: Arc<Snapshot>,
    pub peers: PeerView,
    /// New links read just after the change that woke this pass: attached before it.
    pub new_links: Vec<iface::NewLink>,
    /// Transitions that came meanwhile.
    pub transitions: Vec<Transition>,
    /// How long the state change this pass takes waited for it (`None`: none waited).
    pub state_waited: Option<Duration>,
}

/// A CNI plugin request and where its reply goes.
pub(super) type CniCall = (
    crate::cni::Request,
    tokio::sync::oneshot::Sender<crate::cni::Reply>,
);

/// A state change seen at `seen`, waiting for its pass at `at` (the batch's start).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    seen: Instant,
    at: Instant,
}

/// What wakes the agent for a pass, and what it handles between passes.
pub(super) struct Wakers {
    /// The state source's snapshots.
    views: tokio::sync::watch::Receiver<Arc<Snapshot>>,
    /// When a pass for a state change may start (told of every pass).
    batch: StateBatch,
    /// A state change seen and waiting for its batch's start.
    held: Option<Held>,
    /// Link and address changes on this node.
    changes: tokio::sync::mpsc::Receiver<()>,
    /// The periodic resync (`--resync`).
    tick: tokio::time::Interval,
    sigterm: tokio::signal::unix::Signal,
    /// The liveness service's view of the peers.
    peer_views: tokio::sync::watch::Receiver<Arc<PeerView>>,
    /// Peers' transitions.
    transitions: tokio::sync::mpsc::UnboundedReceiver<Transition>,
    /// New links, with `--unknown-pods drop`.
    new_links: Option<tokio::sync::mpsc::Receiver<iface::NewLink>>,
    /// The CNI plugin's requests (`--cni-socket`), each with its reply's channel.
    cni: Option<tokio::sync::mpsc::Receiver<CniCall>>,
}

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
    /// Subscribe to what wakes the agent: `views` (the source), `peer_views` and
    /// `transitions` (the liveness service), netlink's changes, the resync tick,
    /// SIGTERM; new links with `--unknown-pods drop`, and the CNI plugin's socket with
    /// `--cni-socket` (served from here on).
    pub(super) async fn start(
        cfg: &RunConfig,
        views: tokio::sync::watch::Receiver<Arc<Snapshot>>,
        nl: &iface::Netlink,
        (peer_views, transitions): (
            tokio::sync::watch::Receiver<Arc<PeerView>>,
            tokio::sync::mpsc::UnboundedReceiver<Transition>,
        ),
        early: Arc<Early>,
    ) -> Result<Self> {
        let mut wakers = Self {
            views,
            batch: StateBatch::new(cfg.state_batch_max),
            held: None,
            changes: iface::Netlink::subscribe_changes().await?,
            tick: tokio::time::interval(cfg.resync),
            sigterm: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?,
            peer_views,
            transitions,
            new_links: None,
            cni: None,
        };
        if let Some(path) = &cfg.cni_socket {
            let (tx, rx) = tokio::sync::mpsc::channel(64);
            let path = path.clone();
            info!(socket = %path.display(), "serving the CNI plugin");
            tokio::spawn(async move {
                if let Err(e) = crate::cni::serve(path, tx).await {
                    warn!("the CNI plugin socket failed: {e:#}; pods wait for the next pass");
                }
            });
            wakers.cni = Some(rx);
        }
        if cfg.unknown_pods == UnknownPods::Drop {
            let mut links = nl
                .subscribe_new_links()
                .await
                .context("failed to subscribe to new links")?;
            // Each new link gets from_pod here, on the runtime's threads, whether or not a
            // pass runs on the main thread; the main thread hears of it afterwards.
            let (tx, rx) = tokio::sync::mpsc::channel(256);
            tokio::spawn(async move {
                while let Some(link) = links.recv().await {
                    early.on_new_link(&link);
                    if tx.send(link).await.is_err() {
                        break;
                    }
                }
            });
            wakers.new_links = Some(rx);
        }
        Ok(wakers)
    }

    /// Wait for what wakes the agent next: a new pod device first, a CNI request, a
    /// pass due (`wake_at`: the time the last pass asked for), a transition, a signal.
    pub(super) async fn next(&mut self, wake_at: Option<Instant>) -> Result<Wake> {
        loop {
            let trigger = tokio::select! {
                // A new pod device first: its attachment must not wait behind a pass.
                biased;
                link = next_link(&mut self.new_links) => return Ok(Wake::NewLink(link)),
                call = next_cni(&mut self.cni) => return Ok(Wake::Cni(call)),
                res = self.views.changed(), if self.held.is_none() => {
                    if res.is_err() {
                        anyhow::bail!("the state source stopped");
                    }
                    let now = Instant::now();
                    self.held = hold(now, self.batch.start_at(now));
                    if self.held.is_some() {
                        continue;
                    }
                    Trigger::State
                }
                () = sleep_until(self.held.map(|h| h.at)) => Trigger::State,
                res = self.peer_views.changed() => {
                    if res.is_err() {
                        anyhow::bail!("the probe service stopped");
                    }
                    Trigger::Probe
                }
                Some(t) = self.transitions.recv() => return Ok(Wake::Transition(t)),
                _ = self.changes.recv() => Trigger::Netlink,
                _ = self.tick.tick() => Trigger::Resync,
                () = sleep_until(wake_at) => Trigger::Timer,
                _ = tokio::signal::ctrl_c() => return Ok(Wake::Stop),
                _ = self.sigterm.recv() => return Ok(Wake::Stop),
            };
            return Ok(Wake::Pass(self.due(trigger).await));
        }
    }

    /// The pass `trigger` asks for, with what waits to be handled before it.
    async fn due(&mut self, trigger: Trigger) -> Due {
        // A new pod device's notification may be read just after the change that woke
        // this pass: it is attached before the pass, not after.
        tokio::task::yield_now().await;
        let mut new_links = Vec::new();
        while let Some(link) = self.new_links.as_mut().and_then(|r| r.try_recv().ok()) {
            new_links.push(link);
        }
        // Coalesce bursts of netlink events (our own address changes cause some).
        while self.changes.try_recv().is_ok() {}
        let mut transitions = Vec::new();
        while let Ok(t) = self.transitions.try_recv() {
            transitions.push(t);
        }
        // Whatever woke this pass, it takes the change that was waiting.
        let state_waited = state_waited(self.held.take(), trigger);
        // Cloned after the channel's lock is let go (the end of this statement): the
        // hellos thread's next publish waits on that lock.
        let peers = Arc::clone(&self.peer_views.borrow_and_update());
        Due {
            trigger,
            snapshot: Arc::clone(&self.views.borrow_and_update()),
            peers: PeerView::clone(&peers),
            new_links,
            transitions,
            state_waited,
        }
    }

    /// A pass began at `began` and took `took`: a state change waits for its rest.
    pub(super) fn ran(&mut self, began: Instant, took: Duration) {
        self.batch.ran(began, took);
    }
}

/// Whether a state change seen at `now` waits for its batch's `start` (a later one), or
/// passes at once (`None`).
fn hold(now: Instant, start: Instant) -> Option<Held> {
    (start > now).then_some(Held {
        seen: now,
        at: start,
    })
}

/// How long the state change a pass woken by `trigger` takes waited for it: the held
/// one's wait, zero for a change that passed at once, `None` for a pass without one.
fn state_waited(held: Option<Held>, trigger: Trigger) -> Option<Duration> {
    match held {
        Some(h) => Some(h.seen.elapsed()),
        None => (trigger == Trigger::State).then_some(Duration::ZERO),
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::{mpsc, watch};

    use super::*;

    /// The other ends of a test's wakers: what the source, the liveness service, netlink
    /// and the kernel's new links would send.
    struct Ends {
        state: watch::Sender<Arc<Snapshot>>,
        peers: watch::Sender<Arc<PeerView>>,
        changes: mpsc::Sender<()>,
        transitions: mpsc::UnboundedSender<Transition>,
        links: mpsc::Sender<iface::NewLink>,
    }

    /// Wakers whose resync is an hour away, with `--state-batch-max-ms` at `max_rest`.
    fn wakers(max_rest: Duration) -> (Wakers, Ends) {
        let (state, views) = watch::channel(Arc::new(Snapshot::default()));
        let (peers, peer_views) = watch::channel(Arc::new(PeerView::default()));
        let (changes_tx, changes) = mpsc::channel(8);
        let (transitions_tx, transitions) = mpsc::unbounded_channel();
        let (links, new_links) = mpsc::channel(8);
        let hour = Duration::from_secs(3600);
        let w = Wakers {
            views,
            batch: StateBatch::new(max_rest),
            held: None,
            changes,
            tick: tokio::time::interval_at(tokio::time::Instant::now() + hour, hour),
            sigterm: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("SIGTERM handler"),
            peer_views,
            transitions,
            new_links: Some(new_links),
            cni: None,
        };
        let ends = Ends {
            state,
            peers,
            changes: changes_tx,
            transitions: transitions_tx,
            links,
        };
        (w, ends)
    }

    fn changed_state(ends: &Ends) {
        ends.state.send_modify(|s| Arc::make_mut(s).errors.clear());
    }

    fn pass(wake: Wake) -> Due {
        match wake {
            Wake::Pass(due) => due,
            other => panic!("expected a pass, woke for {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_new_link_is_handled_before_the_pass_a_state_change_asks_for() {
        let (mut w, ends) = wakers(Duration::ZERO);
        changed_state(&ends);
        ends.links
            .send(iface::NewLink::for_test(7, "veth7", true))
            .await
            .unwrap();
        let Wake::NewLink(link) = w.next(None).await.unwrap() else {
            panic!("the new link comes first");
        };
        assert_eq!(link.name, "veth7");
        let due = pass(w.next(None).await.unwrap());
        assert_eq!(due.trigger, Trigger::State);
        assert_eq!(due.state_waited, Some(Duration::ZERO), "it passed at once");
        assert!(due.new_links.is_empty() && due.transitions.is_empty());
    }

    #[tokio::test]
    async fn a_state_change_after_an_expensive_pass_waits_for_its_rest_and_is_not_lost() {
        let (mut w, ends) = wakers(Duration::from_secs(1));
        let t0 = Instant::now();
        // A pass of 30 ms: a state change waits 90 ms more.
        w.ran(t0, Duration::from_millis(30));
        changed_state(&ends);
        ends.transitions
            .send(Transition::CutOff(Default::default()))
            .unwrap();
        let Wake::Transition(t) = w.next(None).await.unwrap() else {
            panic!("the transition comes while the change waits");
        };
        assert!(matches!(t, Transition::CutOff(_)));
        assert!(w.held.is_some(), "the change still waits");
        let due = pass(w.next(None).await.unwrap());
        assert_eq!(due.trigger, Trigger::State);
        assert!(
            t0.elapsed() >= Duration::from_millis(120),
            "{:?}",
            t0.elapsed()
        );
        assert!(due.state_waited.is_some_and(|d| d > Duration::ZERO));
        assert!(w.held.is_none());
    }

    #[tokio::test]
    async fn a_pass_takes_the_change_that_waited_whatever_woke_it() {
        let (mut w, ends) = wakers(Duration::from_secs(1));
        w.ran(Instant::now(), Duration::from_millis(300));
        changed_state(&ends);
        let mut view = PeerView::default();
        view.dead.insert("gw-2".to_owned());
        let peers = view.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            ends.peers.send(Arc::new(peers)).unwrap();
            // The other ends stay open until the test ends.
            std::future::pending::<()>().await;
        });
        let due = pass(w.next(None).await.unwrap());
        assert_eq!(due.trigger, Trigger::Probe);
        assert_eq!(due.peers, view);
        assert!(due.state_waited.is_some(), "it took the waiting change");
        assert!(w.held.is_none());
    }

    #[tokio::test]
    async fn what_waits_is_handed_to_the_pass_and_netlink_bursts_coalesce() {
        let (mut w, ends) = wakers(Duration::ZERO);
        for _ in 0..3 {
            ends.changes.send(()).await.unwrap();
        }
        ends.links
            .send(iface::NewLink::for_test(8, "veth8", true))
            .await
            .unwrap();
        ends.transitions.send(Transition::Reconnected).unwrap();
        let due = w.due(Trigger::Netlink).await;
        assert_eq!(due.trigger, Trigger::Netlink);
        assert_eq!(due.new_links.len(), 1);
        assert_eq!(due.transitions, [Transition::Reconnected]);
        assert_eq!(due.state_waited, None, "no state change waited");
        assert!(w.changes.try_recv().is_err(), "the burst is one pass");
    }

    #[tokio::test]
    async fn the_time_a_pass_asked_for_wakes_a_timer_pass() {
        let (mut w, _ends) = wakers(Duration::ZERO);
        let at = Instant::now() + Duration::from_millis(10);
        let due = pass(w.next(Some(at)).await.unwrap());
        assert_eq!(due.trigger, Trigger::Timer);
        assert!(Instant::now() >= at);
    }

    #[tokio::test]
    async fn a_source_that_stops_stops_the_agent() {
        let (mut w, ends) = wakers(Duration::ZERO);
        drop(ends.state);
        let e = w.next(None).await.unwrap_err();
        assert_eq!(e.to_string(), "the state source stopped");
    }

    #[test]
    fn a_state_change_waits_only_for_a_later_start_and_counts_its_wait() {
        let now = Instant::now();
        assert_eq!(hold(now, now), None);
        let later = now + Duration::from_millis(50);
        let held = hold(now, later).expect("held");
        assert_eq!((held.seen, held.at), (now, later));
        assert!(state_waited(Some(held), Trigger::Netlink).is_some());
        assert_eq!(state_waited(None, Trigger::State), Some(Duration::ZERO));
        assert_eq!(state_waited(None, Trigger::Resync), None);
    }
}
