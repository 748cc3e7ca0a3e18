//! The remapped translations gateways share over the hellos (issue 44): what this node
//! sends (its sweeper's [`Outbox`], a slice per hello, round the list), and what it heard
//! from the others, kept for [`KEEP`] after it was last heard and written through an
//! installer (the agent's: `datapath::remap::write` on the pinned maps).
//!
//! A holder that dies stops sharing, and its remaps must outlive it: a flow's next packet
//! reaches the new holder within seconds, and is then in the new holder's own conntrack.
//! Five minutes is ample for that and bounds what a flow that ended leaves behind.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use crate::family::conntrack::{Outbox, Remap};

/// How long a heard remap is kept after it was last heard.
pub const KEEP: Duration = Duration::from_secs(300);
/// How often heard remaps are checked for age.
const EXPIRE_EVERY: Duration = Duration::from_secs(5);

/// Writes remaps (`add`) and takes them back (`remove`) where the datapath reads them.
pub type Installer = Box<dyn FnMut(&[Remap], &[Remap]) -> anyhow::Result<()> + Send>;

/// Takes out the remaps this node's datapath made since the last call (the agent's:
/// `datapath::remap::Fresh` on the pinned maps).
pub type FreshSource = Box<dyn FnMut() -> anyhow::Result<Vec<Remap>> + Send>;

/// How many intervals' hellos carry a fresh remap before it is left to the rotation (a
/// hello may be lost).
const FRESH_SENDS: u8 = 2;
/// Fresh remaps waiting to be sent at most: beyond, they wait for the sweep's rotation.
pub const FRESH_MAX: usize = 1_024;

/// What the sender and the receiver share; cheap to clone.
#[derive(Clone, Default)]
pub struct Exchange(Arc<Mutex<State>>);

#[derive(Default)]
struct State {
    outbox: Outbox,
    /// Where the next hello's slice of the outbox starts.
    next: usize,
    /// Remaps the datapath made since the sweep's last walk, sent before the outbox's
    /// slice, each with the intervals it has gone out in.
    fresh: Vec<(Remap, u8)>,
    fresh_source: Option<FreshSource>,
    heard: HashMap<(u8, SocketAddr, SocketAddr), (Remap, Instant)>,
    installer: Option<Installer>,
    last_expiry: Option<Instant>,
    stats: Stats,
}

/// Counts for the metrics and the logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Remaps sent (each time a hello carried one).
    pub sent: u64,
    /// Remaps heard that were new or changed, and so written.
    pub installed: u64,
    /// Heard remaps dropped after [`KEEP`] unheard.
    pub expired: u64,
    /// Writes that failed (the remaps are tried again when next heard), and fresh remaps
    /// that could not be taken from the datapath (the sweep finds them).
    pub failed: u64,
    /// Remaps the datapath made, taken out as they came (sent before the sweep found them).
    pub fresh: u64,
}

impl Exchange {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The outbox the conntrack sweeper keeps (this node's remapped flows).
    pub fn outbox(&self) -> Outbox {
        self.lock().outbox.clone()
    }

    /// Send from `outbox` (the conntrack sweeper's) from now on.
    pub fn set_outbox(&self, outbox: Outbox) {
        let mut s = self.lock();
        s.outbox = outbox;
        s.next = 0;
    }

    /// Write what is heard from now on with `installer` (the agent's pinned maps); what
    /// was heard before is written at once.
    pub fn set_installer(&self, mut installer: Installer) {
        let mut s = self.lock();
        let all: Vec<Remap> = s.heard.values().map(|(r, _)| *r).collect();
        if let Some(Err(e)) = (!all.is_empty()).then(|| installer(&all, &[])) {
            tracing::warn!(
                "failed to write the remapped translations other gateways shared: {e:#}"
            );
            s.stats.failed += 1;
        }
        s.installer = Some(installer);
    }

    /// Take the remaps the datapath made from now on with `source`, each interval.
    pub fn set_fresh_source(&self, source: FreshSource) {
        self.lock().fresh_source = Some(source);
    }

    /// The next remaps to send, in order, at most `max`: those the datapath made since the
    /// last interval first (taken from the fresh source now), then the outbox's from
    /// where the last hello's slice ended; [`Exchange::advance`] says how many went.
    pub fn window(&self, max: usize) -> Vec<Remap> {
        let mut guard = self.lock();
        let s = &mut *guard;
        if let Some(source) = s.fresh_source.as_mut() {
            match source() {
                Ok(new) => {
                    s.stats.fresh += new.len() as u64;
                    for r in new {
                        if s.fresh.len() >= FRESH_MAX {
                            break;
                        }
                        match s.fresh.iter_mut().find(|(f, _)| f.flow() == r.flow()) {
                            Some(f) => *f = (r, 0),
                            None => s.fresh.push((r, 0)),
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!("failed to take the datapath's fresh remaps: {e:#}");
                    s.stats.failed += 1;
                }
            }
        }
        let mut window: Vec<Remap> = s.fresh.iter().take(max).map(|(r, _)| *r).collect();
        let out = s.outbox.lock().unwrap_or_else(PoisonError::into_inner);
        if out.is_empty() || window.len() >= max {
            return window;
        }
        let start = s.next % out.len();
        let room = (max - window.len()).min(out.len());
        window.extend(out.iter().cycle().skip(start).take(room).copied());
        window
    }

    /// `n` remaps of the window went out: the fresh ones among them count a send (gone
    /// after [`FRESH_SENDS`]), and the outbox's next slice starts after the others.
    pub fn advance(&self, n: usize) {
        let mut s = self.lock();
        let fresh = n.min(s.fresh.len());
        for (_, sends) in &mut s.fresh[..fresh] {
            *sends += 1;
        }
        s.fresh.retain(|(_, sends)| *sends < FRESH_SENDS);
        s.next = s.next.wrapping_add(n - fresh);
        s.stats.sent += n as u64;
    }

    /// Remaps a peer sent at `now`: new or changed ones are written, all are kept for
    /// [`KEEP`] from now; those unheard for longer go.
    pub fn heard(&self, remaps: Vec<Remap>, now: Instant) {
        let mut s = self.lock();
        let mut add = Vec::new();
        for r in remaps {
            match s.heard.insert(r.flow(), (r, now)) {
                Some((old, _)) if old == r => {}
                _ => add.push(r),
            }
        }
        let due = s
            .last_expiry
            .is_none_or(|t| now.saturating_duration_since(t) >= EXPIRE_EVERY);
        let mut remove = Vec::new();
        if due {
            s.last_expiry = Some(now);
            s.heard.retain(|_, (r, at)| {
                let keep = now.saturating_duration_since(*at) <= KEEP;
                if !keep {
                    remove.push(*r);
                }
                keep
            });
            s.stats.expired += remove.len() as u64;
        }
        if add.is_empty() && remove.is_empty() {
            return;
        }
        let written = match s.installer.as_mut() {
            Some(install) => install(&add, &remove),
            None => Ok(()),
        };
        match written {
            Ok(()) => s.stats.installed += add.len() as u64,
            Err(e) => {
                tracing::debug!("failed to write shared remaps: {e:#}");
                s.stats.failed += 1;
                // Heard again, they are tried again.
                for r in &add {
                    s.heard.remove(&r.flow());
                }
            }
        }
    }

    pub fn stats(&self) -> Stats {
        self.lock().stats
    }

    /// Heard remaps kept now.
    pub fn kept(&self) -> usize {
        self.lock().heard.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remap(i: u16, port: u16) -> Remap {
        Remap {
            proto: 6,
            pod: SocketAddr::from(([10, 244, 1, 5], 40000 + i)),
            dst: SocketAddr::from(([192, 168, 101, 10], 443)),
            egress: SocketAddr::from(([192, 168, 101, 50], port)),
        }
    }

    /// A window's egress ports, less 50000.
    fn ports(w: Vec<Remap>) -> Vec<u16> {
        w.iter().map(|r| r.egress.port() - 50000).collect()
    }

    type Writes = Arc<Mutex<Vec<(Vec<Remap>, Vec<Remap>)>>>;

    fn recording(x: &Exchange) -> Writes {
        let writes: Writes = Arc::default();
        let w = writes.clone();
        x.set_installer(Box::new(move |add, remove| {
            if !add.is_empty() || !remove.is_empty() {
                w.lock().unwrap().push((add.to_vec(), remove.to_vec()));
            }
            Ok(())
        }));
        writes
    }

    #[test]
    fn the_window_goes_round_the_outbox() {
        let x = Exchange::default();
        assert!(x.window(10).is_empty());
        *x.outbox().lock().unwrap() = (0..5).map(|i| remap(i, 50000 + i)).collect();
        assert_eq!(ports(x.window(3)), [0, 1, 2]);
        x.advance(3);
        assert_eq!(ports(x.window(3)), [3, 4, 0]);
        x.advance(2);
        assert_eq!(ports(x.window(10)), [0, 1, 2, 3, 4]);
        // The sweeper replaced the list with a shorter one: the window still starts in it.
        *x.outbox().lock().unwrap() = vec![remap(9, 50009)];
        assert_eq!(ports(x.window(3)), [9]);
        assert_eq!(x.stats().sent, 5);
    }

    #[test]
    fn fresh_remaps_go_first_in_the_next_intervals_then_only_in_the_rotation() {
        let x = Exchange::default();
        *x.outbox().lock().unwrap() = (0..4).map(|i| remap(i, 50000 + i)).collect();
        let made: Arc<Mutex<Vec<Remap>>> = Arc::default();
        let m = made.clone();
        x.set_fresh_source(Box::new(move || {
            Ok(std::mem::take(&mut *m.lock().unwrap()))
        }));
        assert_eq!(ports(x.window(3)), [0, 1, 2]);
        x.advance(3);
        // The datapath remapped two flows since: they lead the next two intervals' window
        // (a hello may be lost), the rotation going on behind them.
        *made.lock().unwrap() = vec![remap(7, 50007), remap(8, 50008)];
        assert_eq!(ports(x.window(3)), [7, 8, 3]);
        x.advance(3);
        // The same flow remapped again before it went twice: its new port, sent twice more.
        *made.lock().unwrap() = vec![remap(8, 50009)];
        assert_eq!(ports(x.window(3)), [7, 9, 0]);
        x.advance(3);
        assert_eq!(ports(x.window(3)), [9, 1, 2]);
        x.advance(3);
        assert_eq!(ports(x.window(3)), [3, 0, 1]);
        // A window the hello's room cut short: only what went counts.
        *made.lock().unwrap() = vec![remap(5, 50005)];
        assert_eq!(ports(x.window(3)), [5, 3, 0]);
        x.advance(1);
        assert_eq!(ports(x.window(3)), [5, 3, 0]);
        x.advance(3);
        assert_eq!(ports(x.window(3)), [1, 2, 3]);
        assert_eq!(x.stats().fresh, 4);
        // A source that fails is counted; the rotation goes on.
        x.set_fresh_source(Box::new(|| anyhow::bail!("map gone")));
        assert_eq!(ports(x.window(2)), [1, 2]);
        assert_eq!(x.stats().failed, 1);
    }

    #[test]
    fn heard_remaps_are_written_once_changed_again_and_taken_back_after_keep() {
        let x = Exchange::default();
        let t0 = Instant::now();
        // Heard before the datapath was there: written when the installer comes.
        x.heard(vec![remap(0, 50000)], t0);
        let writes = recording(&x);
        assert_eq!(
            writes.lock().unwrap().clone(),
            vec![(vec![remap(0, 50000)], vec![])]
        );
        x.heard(
            vec![remap(0, 50000), remap(1, 50001)],
            t0 + Duration::from_secs(1),
        );
        x.heard(vec![remap(0, 50000)], t0 + Duration::from_secs(2));
        // The holder moved flow 0 to another port: written again.
        x.heard(vec![remap(0, 50100)], t0 + Duration::from_secs(3));
        let w = writes.lock().unwrap().clone();
        assert_eq!(
            w,
            vec![
                (vec![remap(0, 50000)], vec![]),
                (vec![remap(1, 50001)], vec![]),
                (vec![remap(0, 50100)], vec![])
            ]
        );
        // Flow 1 unheard past KEEP goes; flow 0, heard again, stays.
        x.heard(vec![remap(0, 50100)], t0 + KEEP);
        x.heard(vec![], t0 + KEEP + Duration::from_secs(10));
        let w = writes.lock().unwrap().clone();
        assert_eq!(w.last(), Some(&(vec![], vec![remap(1, 50001)])));
        assert_eq!(x.kept(), 1);
        assert_eq!(x.stats().expired, 1);
    }

    #[test]
    fn a_failed_write_is_tried_again_when_heard_again() {
        let x = Exchange::default();
        let fail = Arc::new(Mutex::new(true));
        let f = fail.clone();
        let written: Writes = Arc::default();
        let w = written.clone();
        x.set_installer(Box::new(move |add, remove| {
            if *f.lock().unwrap() {
                anyhow::bail!("map gone");
            }
            w.lock().unwrap().push((add.to_vec(), remove.to_vec()));
            Ok(())
        }));
        let t0 = Instant::now();
        x.heard(vec![remap(0, 50000)], t0);
        *fail.lock().unwrap() = false;
        x.heard(vec![remap(0, 50000)], t0 + Duration::from_secs(1));
        assert_eq!(
            written.lock().unwrap().clone(),
            vec![(vec![remap(0, 50000)], vec![])]
        );
        assert_eq!(x.stats().failed, 1);
    }
}
