//! The probe service: one UDP socket on the underlay, a sender that greets every target
//! each interval (and at once when this node's report changes), a receiver that feeds the
//! [`Tracker`], both on a thread of their own ("hellos") and not the runtime's:
//!
//! * A datagram arriving wakes nothing: the thread takes every waiting hello
//!   [`DRAINS_PER_INTERVAL`] times an interval. A gateway hears every node each interval:
//!   waking the runtime for each of them was most of an idle agent's CPU at 100 nodes.
//! * The hellos go out on time while the agent's passes take the CPU: the agent's other
//!   threads give way to this one ([`crate::priority`]). A node whose passes delayed
//!   its hellos past the detection time was declared dead by its peers, whose passes over
//!   that delayed theirs: at 100 agents on 2 cores, a loop that never settled
//!   (docs/benchmarks.md).
//!
//! The reconcile loop reads the [`PeerView`] from a watch channel and tells the service
//! who the peers are and what this node holds through a [`Handle`].

use std::{
    collections::{BTreeMap, BTreeSet},
    io::ErrorKind,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    sync::{
        Arc, Mutex, MutexGuard, Weak,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use tokio::{
    net::UdpSocket,
    sync::{mpsc, watch},
};

/// The probe socket once started: out of the runtime, non-blocking.
type Socket = std::net::UdpSocket;

/// How often an interval the receiver takes the hellos waiting (at the default 100 ms,
/// every 12.5 ms: a hello is taken at most that late, against a detection time of three
/// intervals).
pub const DRAINS_PER_INTERVAL: u32 = 8;

/// The probe socket's receive buffer: the hellos of a drain wait there. 700 nodes' hellos
/// of 1.5 KiB (each charged about 2 KiB with its buffer) are 1.4 MiB.
const RECEIVE_BUFFER: usize = 4 << 20;
use tracing::{debug, warn};

use super::{
    hello::{self, Claim, Hello, HelloRef},
    keys::{self, Keyring},
    remaps::Exchange,
    tracker::{Membership, Outbox, PeerStatus, PeerView, Settings, Tracker, Transition},
};

/// The reconcile loop's side of the service.
#[derive(Clone)]
pub struct Handle {
    tracker: Arc<Mutex<Tracker>>,
    kick: Kick,
    refused: Refusals,
    keys: Arc<Mutex<Keyring>>,
    socket: Arc<Socket>,
    v6_socket: bool,
    port: u16,
    /// Set by the first [`Handle::update`]: no hello goes out before this node knows
    /// what it holds (a restarted holder must not say "nothing" to its peers).
    reporting: Arc<AtomicBool>,
    remaps: Exchange,
    /// Due sends of hellos that went out an interval or more late ([`Lateness`]).
    late: Arc<AtomicU64>,
}

/// What the service gives the reconcile loop.
pub struct Started {
    pub handle: Handle,
    /// Shared, so that the reconcile loop's read holds the channel's lock for no more
    /// than a reference count: the hellos thread's next publish waits on it.
    pub views: watch::Receiver<Arc<PeerView>>,
    pub transitions: mpsc::UnboundedReceiver<Transition>,
    pub port: u16,
}

/// Asks the hellos thread to greet every target at once.
#[derive(Clone)]
struct Kick {
    wanted: Arc<AtomicBool>,
    thread: std::thread::Thread,
}

impl Kick {
    fn kick(&self) {
        self.wanted.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// Hellos refused so far, by reason (`hello::Error::reason`, `Refused::reason`, `stale`).
type Refusals = Arc<Mutex<BTreeMap<&'static str, u64>>>;

/// Where the keys come from: none (unauthenticated), or a key file read at start and
/// again every [`keys::RELOAD`].
#[derive(Clone, Debug, Default)]
pub struct Keys {
    pub path: Option<PathBuf>,
    pub ring: Keyring,
}

impl Keys {
    /// The keys of `path` (none without one); an unreadable or bad file is an error.
    pub fn load(path: Option<PathBuf>) -> Result<Self, keys::Error> {
        let ring = match &path {
            Some(p) => Keyring::load(p)?,
            None => Keyring::default(),
        };
        Ok(Self { path, ring })
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Handle {
    /// Set who the peers are and what this node reports; greets everyone at once if the
    /// report changed, so peers learn of a release or an interface going down without
    /// waiting for the next interval.
    pub fn update(
        &self,
        members: Membership,
        down: BTreeSet<String>,
        claims: BTreeMap<IpAddr, Claim>,
    ) {
        let mut t = lock(&self.tracker);
        let changed = t.local().down != down || t.local().claims != claims;
        t.set_members_at(members, Instant::now());
        t.set_local(down, claims);
        drop(t);
        let first = !self.reporting.swap(true, Ordering::Relaxed);
        if changed || first {
            self.kick.kick();
        }
    }

    /// The remapped translations this node shares and hears (see [`super::remaps`]).
    pub fn remaps(&self) -> &Exchange {
        &self.remaps
    }

    pub fn status(&self) -> Vec<PeerStatus> {
        lock(&self.tracker).status(Instant::now())
    }

    /// When this agent's warm-up ends (see [`Tracker::warm_at`]).
    pub fn warm_at(&self) -> Instant {
        lock(&self.tracker).warm_at()
    }

    pub fn settings(&self) -> Settings {
        lock(&self.tracker).settings()
    }

    /// Tell every peer this agent stops for a restart (its datapath stays), so that they
    /// do not fail its egress IPs over while it is away (see `tracker::RESTART_GRACE`).
    pub async fn farewell(&self) {
        let now = Instant::now();
        let keys = lock(&self.keys).clone();
        let hellos: Vec<(SocketAddr, Vec<u8>)> = {
            let mut t = lock(&self.tracker);
            t.targets()
                .to_vec()
                .into_iter()
                .filter_map(|(name, ip)| {
                    let version = t.version_for(&name);
                    let mut h = t.farewell_for(&name, now);
                    h.sent_unix_ms = unix_ms();
                    let bytes = h.encode(version, &keys).ok()?;
                    Some((
                        SocketAddr::new(mapped(ip, self.v6_socket), self.port),
                        bytes.to_vec(),
                    ))
                })
                .collect()
        };
        for (to, b) in hellos {
            if let Err(e) = self.socket.send_to(&b, to) {
                debug!("failed to send a farewell to {to}: {e}");
            }
        }
    }

    /// Hellos refused so far, by reason: `malformed`, `unauthenticated`, `stale` (a
    /// signed hello whose clock is off by more than `hello::MAX_SKEW`), `replayed`,
    /// `unknown_node`, `wrong_address`, `from_myself`.
    pub fn refused(&self) -> BTreeMap<String, u64> {
        lock(&self.refused)
            .iter()
            .map(|(r, n)| ((*r).to_owned(), *n))
            .collect()
    }

    /// Due sends of hellos that went out an interval or more after their time so far:
    /// each left the peers an interval closer to declaring this node dead.
    pub fn late_sends(&self) -> u64 {
        self.late.load(Ordering::Relaxed)
    }

    /// Whether hellos are signed and only signed ones taken.
    pub fn authenticated(&self) -> bool {
        !lock(&self.keys).is_empty()
    }
}

/// Bind the probe port (IPv6 with IPv4 mapped, else IPv4 only) and start the hellos thread.
pub async fn start(me: &str, settings: Settings, port: u16) -> std::io::Result<Started> {
    start_on(bind(port).await?, me, settings, Keys::default())
}

/// Bind the probe port (IPv6 with IPv4 mapped, else IPv4 only), so that a port in use
/// fails the start before anything on the host changes; [`start_on`] starts the probes.
pub async fn bind(port: u16) -> std::io::Result<UdpSocket> {
    match UdpSocket::bind((Ipv6Addr::UNSPECIFIED, port)).await {
        Ok(s) => Ok(s),
        Err(e) => {
            debug!("failed to bind the probe port over IPv6 ({e}); trying IPv4");
            UdpSocket::bind(("0.0.0.0", port)).await
        }
    }
}

/// Start the probes on a socket from [`bind`]: their warm-up and detection clocks run
/// from here.
pub fn start_on(
    socket: UdpSocket,
    me: &str,
    settings: Settings,
    keys: Keys,
) -> std::io::Result<Started> {
    // Peers listen on the same port as this node.
    let port = socket.local_addr()?.port();
    let v6_socket = socket.local_addr()?.is_ipv6();
    // Non-blocking, as the runtime left it.
    let socket = Arc::new(socket.into_std()?);
    grow_receive_buffer(&socket);
    let incarnation = rand_u32();
    let tracker = Arc::new(Mutex::new(Tracker::new(
        me,
        settings,
        incarnation,
        Instant::now(),
    )));
    let refused: Refusals = Arc::default();
    let ring = Arc::new(Mutex::new(keys.ring.clone()));
    if let Some(path) = keys.path {
        spawn_reloader(path, ring.clone());
    }
    let reporting = Arc::new(AtomicBool::new(false));
    let (view_tx, views) = watch::channel(Arc::new(PeerView::default()));
    let view_tx = Arc::new(view_tx);
    let (tx, transitions) = mpsc::unbounded_channel();
    let remaps = Exchange::default();

    let wanted = Arc::new(AtomicBool::new(false));
    let late = Arc::new(AtomicU64::new(0));
    let thread = spawn_hellos(
        Peers {
            tracker: tracker.clone(),
            view_tx,
            tx,
            remaps: remaps.clone(),
            late: late.clone(),
        },
        Arc::downgrade(&socket),
        (refused.clone(), ring.clone()),
        (wanted.clone(), reporting.clone()),
        (port, v6_socket),
        settings,
    )?;
    let kick = Kick { wanted, thread };
    Ok(Started {
        handle: Handle {
            tracker,
            kick,
            refused,
            keys: ring,
            socket,
            v6_socket,
            port,
            reporting,
            remaps,
            late,
        },
        views,
        transitions,
        port,
    })
}

/// What the receiver and the sender share: the tracker, and where its views and
/// transitions go.
struct Peers {
    tracker: Arc<Mutex<Tracker>>,
    view_tx: Arc<watch::Sender<Arc<PeerView>>>,
    tx: mpsc::UnboundedSender<Transition>,
    remaps: Exchange,
    /// Counts the due sends that went out late ([`Handle::late_sends`]).
    late: Arc<AtomicU64>,
}

/// Read the key file again every [`keys::RELOAD`]; a file that turns bad keeps the last
/// good keys, with a warning (once per distinct problem).
fn spawn_reloader(path: PathBuf, ring: Arc<Mutex<Keyring>>) {
    tokio::spawn(async move {
        let mut last_error = None;
        loop {
            tokio::time::sleep(keys::RELOAD).await;
            match Keyring::load(&path) {
                Ok(new) => {
                    let mut cur = lock(&ring);
                    if *cur != new {
                        tracing::info!(
                            keys = ?new.ids(),
                            "liveness keys changed: signing with key {}",
                            new.ids().first().map_or("", String::as_str)
                        );
                        *cur = new;
                    }
                    last_error = None;
                }
                Err(e) => {
                    let msg = e.to_string();
                    if last_error.as_ref() != Some(&msg) {
                        warn!("{msg}; keeping the keys read before");
                        last_error = Some(msg);
                    }
                }
            }
        }
    });
}

/// The hellos thread: [`DRAINS_PER_INTERVAL`] times an interval it takes every hello
/// waiting (each decoded one goes to the tracker, which publishes a new view when it
/// changes something; refused ones are counted by reason); every interval, and at once
/// when kicked, it greets every target, once the agent reports (`reporting`). `to` is the
/// peers' port and whether the socket is IPv6 (IPv4 peers then at mapped addresses). The
/// thread ends once the service is gone (its socket closed).
fn spawn_hellos(
    peers: Peers,
    socket: Weak<Socket>,
    (refused, ring): (Refusals, Arc<Mutex<Keyring>>),
    (kicked, reporting): (Arc<AtomicBool>, Arc<AtomicBool>),
    to: (u16, bool),
    settings: Settings,
) -> std::io::Result<std::thread::Thread> {
    let drain_every = settings.interval / DRAINS_PER_INTERVAL;
    let handle = std::thread::Builder::new()
        .name("hellos".to_owned())
        .spawn(move || {
            let mut buf = vec![0u8; super::hello::MAX_LEN + 1];
            let mut out = Outbox::default();
            let mut next_send = Instant::now();
            let mut wake = next_send;
            let mut late = Lateness::default();
            // Held only while working: the service's end closes the socket.
            while let Some(socket) = socket.upgrade() {
                let woke = Instant::now();
                if let Err(e) = drain(&socket, &mut buf, &peers, &refused, &ring) {
                    warn!("failed to receive a hello: {e}");
                    std::thread::park_timeout(settings.interval);
                }
                let now = Instant::now();
                let due = now >= next_send;
                let scheduled = next_send;
                if due {
                    // A late tick is not made up for: the next is an interval on.
                    next_send = (next_send + settings.interval).max(now);
                }
                if (kicked.swap(false, Ordering::AcqRel) || due)
                    && reporting.load(Ordering::Relaxed)
                {
                    send_hellos(&socket, &peers, &ring, &mut out, to);
                    if due && late.note(scheduled, wake, woke, settings.interval) {
                        peers.late.fetch_add(1, Ordering::Relaxed);
                    }
                }
                drop(socket);
                let now = Instant::now();
                wake = (now + drain_every).min(next_send);
                std::thread::park_timeout(wake.saturating_duration_since(now));
            }
        })?;
    Ok(handle.thread().clone())
}

/// Hellos that went out an interval or more after their time, said at most every
/// [`Lateness::EVERY`]: how late the thread woke (the CPU was busy) and how long its drain
/// and send then took (locks it waited for, and the CPU again). Peers declare a node dead
/// after the detection time without its hellos, and a node whose hellos are late fences
/// itself first: a late hello is where a flapping quorum starts.
#[derive(Default)]
struct Lateness {
    count: u64,
    worst: Duration,
    woke_late: Duration,
    working: Duration,
    said: Option<Instant>,
}

impl Lateness {
    const EVERY: Duration = Duration::from_secs(5);

    /// A due send done now: it was `scheduled`, the thread meant to wake at `wake` and
    /// woke at `woke`. Whether it was an interval or more late.
    fn note(
        &mut self,
        scheduled: Instant,
        wake: Instant,
        woke: Instant,
        interval: Duration,
    ) -> bool {
        let now = Instant::now();
        let late = now.saturating_duration_since(scheduled);
        if late < interval {
            return false;
        }
        self.count += 1;
        if late > self.worst {
            self.worst = late;
            self.woke_late = woke.saturating_duration_since(wake);
            self.working = now.saturating_duration_since(woke);
        }
        if self
            .said
            .is_some_and(|t| now.duration_since(t) < Self::EVERY)
        {
            return true;
        }
        warn!(
            late = self.count,
            worst_ms = self.worst.as_millis(),
            woke_late_ms = self.woke_late.as_millis(),
            drain_and_send_ms = self.working.as_millis(),
            "hellos went out an interval or more late (the worst: the thread woke late by \
             woke_late_ms, then drained and sent in drain_and_send_ms)"
        );
        *self = Self {
            said: Some(now),
            ..Self::default()
        };
        true
    }
}

/// Take every hello waiting on the (non-blocking) socket, then publish the view once if
/// any of them may have changed it. Judged hello by hello, a drain after a stall (this
/// thread's or the queue's) saw the peers not yet taken as unheard: at 100 nodes under
/// load a gateway cut itself off and back several times within one drain.
fn drain(
    socket: &Socket,
    buf: &mut [u8],
    peers: &Peers,
    refused: &Refusals,
    ring: &Mutex<Keyring>,
) -> std::io::Result<()> {
    let mut changed = false;
    let result = loop {
        match socket.recv_from(buf) {
            Ok((n, from)) => changed |= receive(&buf[..n], from, peers, refused, ring),
            Err(e) if e.kind() == ErrorKind::WouldBlock => break Ok(()),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    if changed {
        publish(
            &mut lock(&peers.tracker),
            Instant::now(),
            &peers.view_tx,
            &peers.tx,
        );
    }
    result
}

/// Take one received hello, counting a refusal by its reason: whether it may have
/// changed the view.
fn receive(
    b: &[u8],
    from: SocketAddr,
    peers: &Peers,
    refused: &Refusals,
    ring: &Mutex<Keyring>,
) -> bool {
    let result = take(b, from.ip(), peers, ring);
    if result.as_ref().is_err_and(|(r, _)| *r == "unauthenticated") {
        // An older agent's unsigned hello: echoed, nothing more.
        if let Ok(r) = Hello::decode(b, &Keyring::default())
            && r.version == 1
        {
            lock(&peers.tracker).echo_only(&r.hello, from.ip(), Instant::now());
        }
    }
    match result {
        Ok(changed) => changed,
        Err((reason, e)) => {
            *lock(refused).entry(reason).or_default() += 1;
            debug!(reason, "refused a hello from {from}: {e}");
            false
        }
    }
}

/// Make the socket's receive buffer [`RECEIVE_BUFFER`]: past the system's limit
/// (`net.core.rmem_max`) where the agent may (CAP_NET_ADMIN), else up to it.
fn grow_receive_buffer(socket: &Socket) {
    use std::os::fd::AsRawFd as _;
    let size = RECEIVE_BUFFER as libc::c_int;
    let set = |opt| {
        // SAFETY: setsockopt on a socket this service owns, with an int of its size.
        unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                std::ptr::from_ref(&size).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        }
    };
    if set(libc::SO_RCVBUFFORCE) != 0 && set(libc::SO_RCVBUF) != 0 {
        debug!(
            "failed to size the probe socket's receive buffer: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Take one hello from `from` (read in place: one that repeats its sender's last state
/// allocates nothing): whether it may have changed the view; a refusal is its reason and
/// why.
fn take(
    b: &[u8],
    from: IpAddr,
    peers: &Peers,
    ring: &Mutex<Keyring>,
) -> Result<bool, (&'static str, String)> {
    let r = HelloRef::parse(b, &lock(ring)).map_err(|e| (e.reason(), e.to_string()))?;
    if r.key.is_some() && !hello::fresh(r.fixed.sent_unix_ms, unix_ms()) {
        return Err((
            "stale",
            format!(
                "stale hello from {}: its clock is {} ms from ours (at most {} ms)",
                r.name,
                r.fixed.sent_unix_ms.abs_diff(unix_ms()),
                hello::MAX_SKEW.as_millis()
            ),
        ));
    }
    // Decoded before the hello is taken: one whose remaps do not decode is refused whole.
    let remaps = r.remaps().map_err(|e| (e.reason(), e.to_string()))?;
    let now = Instant::now();
    let changed = lock(&peers.tracker)
        .on_received(&r, from, now)
        .map_err(|e| (e.reason(), e.to_string()))?;
    // Only from a peer whose hello was taken (a member, fresh, signed where keys are
    // set).
    if !remaps.is_empty() {
        peers.remaps.heard(remaps, now);
    }
    Ok(changed)
}

/// Greet every target: the hellos are written into `out`, kept from interval to interval
/// (no allocation per hello); `(port, v6_socket)` as [`spawn_hellos`] says.
fn send_hellos(
    socket: &Socket,
    peers: &Peers,
    ring: &Mutex<Keyring>,
    out: &mut Outbox,
    (port, v6_socket): (u16, bool),
) {
    let now = Instant::now();
    let window = peers.remaps.window(MAX_REMAPS_PER_HELLO);
    let sent_remaps = {
        let keys = lock(ring);
        let mut t = lock(&peers.tracker);
        publish(&mut t, now, &peers.view_tx, &peers.tx);
        t.write_hellos(now, unix_ms(), (&keys, &window), out)
    };
    if sent_remaps > 0 {
        peers.remaps.advance(sent_remaps);
    }
    for e in &out.failed {
        warn!("{e}");
    }
    for (ip, range) in &out.hellos {
        let to = SocketAddr::new(mapped(*ip, v6_socket), port);
        // Non-blocking: a full send buffer loses this hello, as the network may.
        if let Err(e) = socket.send_to(&out.bytes[range.clone()], to) {
            debug!("failed to send a hello to {to}: {e}");
        }
    }
}

/// At most this many remaps ride one hello (fewer when the room is short).
const MAX_REMAPS_PER_HELLO: usize = 32;

/// Note transitions and publish the view if it changed.
fn publish(
    t: &mut Tracker,
    now: Instant,
    view_tx: &watch::Sender<Arc<PeerView>>,
    tx: &mpsc::UnboundedSender<Transition>,
) {
    let Some((view, transitions)) = t.observe_changed(now) else {
        return;
    };
    for tr in transitions {
        let _ = tx.send(tr);
    }
    view_tx.send_if_modified(|v| {
        if **v == view {
            false
        } else {
            *v = Arc::new(view);
            true
        }
    });
}

/// IPv4 destinations through an IPv6 socket are IPv4-mapped.
fn mapped(ip: IpAddr, v6_socket: bool) -> IpAddr {
    match ip {
        IpAddr::V4(a) if v6_socket => IpAddr::V6(a.to_ipv6_mapped()),
        other => other,
    }
}

/// The wall clock in ms since the Unix epoch (signed hellos' freshness).
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == 4 {
        u32::from_ne_bytes(b)
    } else {
        // Good enough to tell two starts apart.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.subsec_nanos() ^ d.as_secs() as u32)
    }
}

#[cfg(test)]
mod tests {
    //! Agents' probe services on loopback addresses (one per node, all on one port),
    //! hellos crossing the kernel's UDP, and a forger on a gateway's address.

    use std::{
        net::{Ipv4Addr, SocketAddrV4, UdpSocket as StdSocket},
        time::Duration,
    };

    use tokio::runtime::Runtime;

    use super::*;
    use crate::liveness::keys::Key;

    const K1: [u8; 32] = [1; 32];
    const K2: [u8; 32] = [2; 32];

    fn ring(keys: &[[u8; 32]]) -> Keyring {
        Keyring::new(keys.iter().map(|k| Key::new(k.to_vec())).collect())
    }

    fn ip(last: u8) -> Ipv4Addr {
        Ipv4Addr::new(127, 0, 0, last)
    }

    fn settings() -> Settings {
        Settings {
            interval: Duration::from_millis(100),
            misses: 3,
            restart_grace: Duration::ZERO,
        }
    }

    /// gw1 at 127.0.0.1, w1 at .2, and w2 at .3 (the recorder: it hears gw1's hellos).
    fn members() -> Membership {
        let names = ["gw1", "w1", "w2"];
        Membership {
            nodes: names
                .iter()
                .zip(1..)
                .map(|(n, i)| ((*n).to_owned(), IpAddr::V4(ip(i))))
                .collect(),
            aliases: BTreeMap::new(),
            gateways: ["gw1".to_owned()].into(),
            expected: ["gw1".to_owned(), "w1".to_owned()].into(),
            speakers: names.iter().map(|n| (*n).to_owned()).collect(),
        }
    }

    /// A node's probe service on its own runtime (drop the runtime: the agent dies).
    struct Node {
        rt: Runtime,
        started: Started,
    }

    fn node(name: &str, at: Ipv4Addr, port: u16, keys: Keys) -> Node {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let started = rt.block_on(async {
            let socket = UdpSocket::bind(SocketAddrV4::new(at, port))
                .await
                .expect("bind");
            let s = start_on(socket, name, settings(), keys).expect("start");
            s.handle.update(members(), BTreeSet::new(), BTreeMap::new());
            s
        });
        Node { rt, started }
    }

    fn keys(ring: Keyring) -> Keys {
        Keys { path: None, ring }
    }

    fn gw1_dead(w1: &Node) -> bool {
        w1.started.views.borrow().dead.contains("gw1")
    }

    /// Wait up to `limit` for `cond`.
    fn within(limit: Duration, cond: impl Fn() -> bool) -> bool {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        cond()
    }

    fn free_port() -> u16 {
        StdSocket::bind((ip(2), 0))
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port()
    }

    /// After gw1 dies, a forger on gw1's address sends hellos in its name every 100 ms
    /// for `for_`: unsigned, in version 1, signed with another key, and gw1's own signed
    /// hellos recorded on their way to w2, replayed to w1 (each in turn).
    fn forge(port: u16, recorded: &[Vec<u8>], for_: Duration) {
        let s = StdSocket::bind((ip(1), 0)).expect("bind the forger");
        let to = (ip(2), port);
        let end = Instant::now() + for_;
        let mut seq = 1_000_000;
        let mut i = 0;
        while Instant::now() < end {
            seq += 1;
            let h = Hello {
                seq,
                incarnation: 7,
                sent_unix_ms: unix_ms(),
                name: "gw1".into(),
                to: "w1".into(),
                ..Hello::default()
            };
            let forged = [
                h.encode(2, &Keyring::default()).expect("unsigned"),
                h.encode(1, &Keyring::default()).expect("v1"),
                h.encode(2, &ring(&[[9; 32]])).expect("other key"),
            ];
            for b in &forged {
                s.send_to(b, to).expect("send");
            }
            if !recorded.is_empty() {
                s.send_to(&recorded[i % recorded.len()], to).expect("send");
                i += 1;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Start gw1 and w1 (with `gw_keys`, `w_keys`), let them hear each other, record
    /// gw1's hellos to w2, kill gw1, forge for 2 s; returns w1, whether w1 had gw1 alive
    /// before, and whether it counts gw1 dead at the end.
    fn kill_and_forge(gw_keys: Keyring, w_keys: Keyring) -> (Node, bool, bool) {
        let port = free_port();
        let recorder = StdSocket::bind((ip(3), port)).expect("bind the recorder");
        recorder
            .set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let w1 = node("w1", ip(2), port, keys(w_keys));
        let gw1 = node("gw1", ip(1), port, keys(gw_keys));
        std::thread::sleep(Duration::from_millis(1_200));
        let alive_before = !gw1_dead(&w1);
        let mut recorded = Vec::new();
        let mut buf = [0u8; 1500];
        while let Ok((n, _)) = recorder.recv_from(&mut buf) {
            recorded.push(buf[..n].to_vec());
            if recorded.len() >= 5 {
                break;
            }
        }
        assert!(!recorded.is_empty(), "gw1 sends hellos to w2");
        drop(gw1);
        forge(port, &recorded, Duration::from_secs(2));
        let dead = gw1_dead(&w1);
        (w1, alive_before, dead)
    }

    #[test]
    fn under_a_key_forged_and_replayed_hellos_do_not_keep_a_dead_gateway_alive() {
        let (w1, alive_before, dead) = kill_and_forge(ring(&[K1]), ring(&[K1]));
        assert!(alive_before, "w1 heard gw1 while it ran");
        assert!(dead, "w1 counts gw1 dead despite the forger");
        let refused = w1.started.handle.refused();
        assert!(
            refused.get("unauthenticated").copied().unwrap_or(0) >= 30,
            "{refused:?}"
        );
        assert!(
            refused.get("replayed").copied().unwrap_or(0) >= 5,
            "{refused:?}"
        );
        assert!(w1.started.handle.authenticated());
        drop(w1.rt);
    }

    #[test]
    fn without_a_key_a_forger_keeps_a_dead_gateway_alive() {
        // What the key is for: the same forgery, unauthenticated, is believed.
        let (w1, alive_before, dead) = kill_and_forge(Keyring::default(), Keyring::default());
        assert!(alive_before);
        assert!(!dead, "an unsigned forgery is taken without a key");
        assert!(!w1.started.handle.authenticated());
    }

    #[test]
    fn a_key_rotation_keeps_every_peer_alive_and_a_reloaded_file_takes_effect() {
        let port = free_port();
        // Step 2 of a rotation: gw1 signs with the new key, w1 still signs with the old.
        let file = std::env::temp_dir().join(format!("egress-liveness-key-{port}"));
        let hex = |k: &[u8; 32]| k.iter().map(|x| format!("{x:02x}")).collect::<String>();
        std::fs::write(&file, format!("{}\n", hex(&K1))).expect("write the key file");
        let w1 = node(
            "w1",
            ip(2),
            port,
            Keys::load(Some(file.clone())).expect("keys"),
        );
        let gw1 = node("gw1", ip(1), port, keys(ring(&[K2, K1])));
        // w1 does not accept K2 yet: gw1 is dead to it.
        assert!(
            within(Duration::from_secs(3), || gw1_dead(&w1)),
            "K2 is not accepted"
        );
        // Step 1 reaches w1: both keys accepted, read again within RELOAD.
        std::fs::write(&file, format!("{}\n{}\n", hex(&K1), hex(&K2))).expect("write");
        assert!(
            within(keys::RELOAD + Duration::from_secs(3), || !gw1_dead(&w1)),
            "the reloaded key file accepts K2"
        );
        // And gw1 hears w1, which signs with K1 (still accepted by gw1).
        assert!(
            within(Duration::from_secs(2), || gw1
                .started
                .handle
                .status()
                .iter()
                .any(|p| p.name == "w1" && p.direct)),
            "gw1 hears w1"
        );
        let _ = std::fs::remove_file(&file);
    }

    /// A drain judges once, after it has taken every waiting hello. gw2 last heard its
    /// peers 500 ms ago, and their fresh hellos (echoing gw2's latest) wait on its socket,
    /// as after a stall. Judged after each hello, the first (w1's) left gw2 with half the
    /// cluster and not the smallest name: it cut itself off, and back at the next one.
    #[test]
    fn a_drain_judges_once_after_taking_every_waiting_hello() {
        let names = [("gw1", 21), ("gw2", 22), ("w1", 23), ("w2", 24)];
        let all = || names.iter().map(|(n, _)| (*n).to_owned()).collect();
        let members = Membership {
            nodes: names
                .iter()
                .map(|(n, i)| ((*n).to_owned(), IpAddr::V4(ip(*i))))
                .collect(),
            aliases: BTreeMap::new(),
            gateways: ["gw1".to_owned(), "gw2".to_owned()].into(),
            expected: all(),
            speakers: all(),
        };
        let now = Instant::now();
        let mut trackers: BTreeMap<&'static str, Tracker> = names
            .iter()
            .zip(1..)
            .map(|((n, _), i)| {
                let mut t = Tracker::new(n, settings(), i, now - Duration::from_secs(2));
                t.set_members(members.clone());
                (*n, t)
            })
            .collect();
        let from = |n: &str| IpAddr::V4(ip(names.iter().find(|(m, _)| *m == n).unwrap().1));
        let to = |a: &IpAddr| {
            names
                .iter()
                .find(|(_, i)| IpAddr::V4(ip(*i)) == *a)
                .unwrap()
                .0
        };
        // The nodes `who` greet their peers at `at`; with `queue`, their hellos to gw2 wait
        // on its socket (the others are taken at once).
        let socket = StdSocket::bind((ip(22), 0)).expect("bind gw2");
        socket.set_nonblocking(true).expect("non-blocking");
        let senders: BTreeMap<&str, StdSocket> = names
            .iter()
            .map(|(n, i)| (*n, StdSocket::bind((ip(*i), 0)).expect("bind a peer")))
            .collect();
        let greet = |trackers: &mut BTreeMap<&'static str, Tracker>,
                     at: Instant,
                     who: &[&'static str],
                     queue: bool| {
            for name in who {
                let mut out = Outbox::default();
                let t = trackers.get_mut(name).unwrap();
                t.write_hellos(at, unix_ms(), (&Keyring::default(), &[]), &mut out);
                for (ip, range) in &out.hellos {
                    let b = &out.bytes[range.clone()];
                    let target = to(ip);
                    if queue && target == "gw2" {
                        senders[name]
                            .send_to(b, socket.local_addr().unwrap())
                            .expect("sent");
                    } else {
                        let h = HelloRef::parse(b, &Keyring::default()).expect("parsed");
                        let t = trackers.get_mut(target).unwrap();
                        t.on_received(&h, from(name), at).expect("taken");
                    }
                }
            }
        };
        let before = now - Duration::from_millis(500);
        greet(&mut trackers, before, &["gw1", "gw2", "w1", "w2"], false);
        greet(&mut trackers, now, &["gw2"], false);
        greet(&mut trackers, now, &["w1", "w2", "gw1"], true);

        let gw2 = trackers.remove("gw2").unwrap();
        let (view_tx, views) = watch::channel(Arc::new(PeerView::default()));
        let (tx, mut transitions) = mpsc::unbounded_channel();
        let peers = Peers {
            tracker: Arc::new(Mutex::new(gw2)),
            view_tx: Arc::new(view_tx),
            tx,
            remaps: Exchange::default(),
            late: Arc::default(),
        };
        let mut buf = vec![0u8; hello::MAX_LEN + 1];
        let ring = Mutex::new(Keyring::default());
        drain(&socket, &mut buf, &peers, &Refusals::default(), &ring).expect("drained");

        let mut seen = Vec::new();
        while let Ok(t) = transitions.try_recv() {
            seen.push(t);
        }
        assert!(seen.is_empty(), "{seen:?}");
        assert!(views.borrow().dead.is_empty(), "{:?}", views.borrow().dead);
        assert_eq!(lock(&peers.tracker).quorum(Instant::now()).counted, 4);
    }

    /// The hellos thread held back past a send's time (here by the tracker's lock, which
    /// its send takes) counts the late send, which the agent serves as
    /// `egress_hellos_late_total`.
    #[test]
    fn a_send_held_back_an_interval_is_counted_late() {
        let port = free_port();
        let w1 = node("w1", ip(2), port, keys(Keyring::default()));
        let handle = &w1.started.handle;
        std::thread::sleep(Duration::from_millis(300));
        // A loaded machine may hold the thread back too: counted from here.
        let before = handle.late_sends();
        {
            let _held = lock(&handle.tracker);
            std::thread::sleep(Duration::from_millis(350));
        }
        assert!(
            within(Duration::from_secs(1), || handle.late_sends() > before),
            "held back 3.5 intervals: {} late, {before} before",
            handle.late_sends()
        );
    }

    /// A send an interval or more after its time is counted, with the worst one's wake-up
    /// and work; at most one line every `Lateness::EVERY` (then the counts start again).
    #[test]
    fn late_hellos_are_counted_and_said_at_most_every_five_seconds() {
        let interval = Duration::from_millis(100);
        let ms = Duration::from_millis;
        let mut late = Lateness::default();
        let now = Instant::now();
        // On time (50 ms late): nothing.
        assert!(!late.note(now - ms(50), now - ms(50), now - ms(50), interval));
        assert_eq!(late.count, 0);
        assert!(late.said.is_none());
        // 300 ms late, woken on time, 300 ms in the drain and send: said at once.
        assert!(late.note(now - ms(300), now - ms(300), now - ms(300), interval));
        let said = late.said.expect("said");
        assert_eq!(late.count, 0, "the counts start again once said");
        // Two more within 5 s: counted, the worst kept, not said.
        assert!(late.note(now - ms(150), now - ms(150), now - ms(150), interval));
        assert!(late.note(now - ms(400), now - ms(250), now, interval));
        assert_eq!(late.count, 2);
        assert!(late.worst >= ms(400), "{:?}", late.worst);
        assert!(late.woke_late >= ms(250), "{:?}", late.woke_late);
        assert!(late.working < ms(50), "{:?}", late.working);
        assert_eq!(late.said, Some(said));
    }
}
