//! The probe service: one UDP socket on the underlay, a sender that greets every target
//! each interval (and at once when this node's report changes), a receiver that feeds the
//! [`Tracker`]. The reconcile loop reads the [`PeerView`] from a watch channel and tells
//! the service who the peers are and what this node holds through a [`Handle`].

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv6Addr, SocketAddr},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

use tokio::{
    net::UdpSocket,
    sync::{Notify, mpsc, watch},
};
use tracing::{debug, warn};

use super::{
    hello::{Claim, Hello},
    tracker::{Membership, PeerStatus, PeerView, Settings, Tracker, Transition},
};

/// The reconcile loop's side of the service.
#[derive(Clone)]
pub struct Handle {
    tracker: Arc<Mutex<Tracker>>,
    kick: Arc<Notify>,
    refused: Arc<Mutex<u64>>,
    socket: Arc<UdpSocket>,
    v6_socket: bool,
    port: u16,
    /// Set by the first [`Handle::update`]: no hello goes out before this node knows
    /// what it holds (a restarted holder must not say "nothing" to its peers).
    reporting: Arc<AtomicBool>,
}

/// What the service gives the reconcile loop.
pub struct Started {
    pub handle: Handle,
    pub views: watch::Receiver<PeerView>,
    pub transitions: mpsc::UnboundedReceiver<Transition>,
    pub port: u16,
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
        t.set_members(members);
        t.set_local(down, claims);
        drop(t);
        let first = !self.reporting.swap(true, Ordering::Relaxed);
        if changed || first {
            self.kick.notify_one();
        }
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
        let hellos: Vec<(SocketAddr, Vec<u8>)> = {
            let mut t = lock(&self.tracker);
            t.targets()
                .into_iter()
                .filter_map(|(name, ip)| {
                    let bytes = t.farewell_for(&name, now).encode().ok()?;
                    Some((
                        SocketAddr::new(mapped(ip, self.v6_socket), self.port),
                        bytes.to_vec(),
                    ))
                })
                .collect()
        };
        for (to, b) in hellos {
            if let Err(e) = self.socket.send_to(&b, to).await {
                debug!("failed to send a farewell to {to}: {e}");
            }
        }
    }

    /// Hellos refused so far (unknown sender, wrong address, stale, malformed).
    pub fn refused(&self) -> u64 {
        *lock(&self.refused)
    }
}

/// Bind the probe port (IPv6 with IPv4 mapped, else IPv4 only) and start the tasks.
pub async fn start(me: &str, settings: Settings, port: u16) -> std::io::Result<Started> {
    start_on(bind(port).await?, me, settings)
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
pub fn start_on(socket: UdpSocket, me: &str, settings: Settings) -> std::io::Result<Started> {
    // Peers listen on the same port as this node.
    let port = socket.local_addr()?.port();
    let v6_socket = socket.local_addr()?.is_ipv6();
    let socket = Arc::new(socket);
    let incarnation = rand_u32();
    let tracker = Arc::new(Mutex::new(Tracker::new(
        me,
        settings,
        incarnation,
        Instant::now(),
    )));
    let kick = Arc::new(Notify::new());
    let refused = Arc::new(Mutex::new(0));
    let reporting = Arc::new(AtomicBool::new(false));
    let (view_tx, views) = watch::channel(PeerView::default());
    let view_tx = Arc::new(view_tx);
    let (tx, transitions) = mpsc::unbounded_channel();

    spawn_receiver(
        Peers {
            tracker: tracker.clone(),
            view_tx: view_tx.clone(),
            tx: tx.clone(),
        },
        socket.clone(),
        refused.clone(),
        settings,
    );
    spawn_sender(
        Peers {
            tracker: tracker.clone(),
            view_tx,
            tx,
        },
        socket.clone(),
        (kick.clone(), reporting.clone()),
        (port, v6_socket),
        settings,
    );
    Ok(Started {
        handle: Handle {
            tracker,
            kick,
            refused,
            socket,
            v6_socket,
            port,
            reporting,
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
    view_tx: Arc<watch::Sender<PeerView>>,
    tx: mpsc::UnboundedSender<Transition>,
}

/// Receive hellos: each decoded one goes to the tracker (a new view is published when it
/// changes something); refused ones are counted.
fn spawn_receiver(
    peers: Peers,
    socket: Arc<UdpSocket>,
    refused: Arc<Mutex<u64>>,
    settings: Settings,
) {
    tokio::spawn(async move {
        let mut buf = vec![0u8; super::hello::MAX_LEN + 1];
        loop {
            let (n, from) = match socket.recv_from(&mut buf).await {
                Ok(r) => r,
                Err(e) => {
                    warn!("failed to receive a hello: {e}");
                    tokio::time::sleep(settings.interval).await;
                    continue;
                }
            };
            let result = Hello::decode(&buf[..n])
                .map_err(|e| e.to_string())
                .and_then(|h| {
                    let now = Instant::now();
                    let mut t = lock(&peers.tracker);
                    if t.on_hello(h, from.ip(), now).map_err(|e| e.to_string())? {
                        publish(&mut t, now, &peers.view_tx, &peers.tx);
                    }
                    Ok(())
                });
            if let Err(e) = result {
                *lock(&refused) += 1;
                debug!("refused a hello from {from}: {e}");
            }
        }
    });
}

/// Send this node's hellos to every target, every interval and at once when kicked,
/// once the agent reports (`reporting`); `to` is the peers' port and whether the socket
/// is IPv6 (IPv4 peers then at mapped addresses).
fn spawn_sender(
    peers: Peers,
    socket: Arc<UdpSocket>,
    (kick, reporting): (Arc<Notify>, Arc<AtomicBool>),
    (port, v6_socket): (u16, bool),
    settings: Settings,
) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(settings.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = kick.notified() => {}
            }
            if !reporting.load(Ordering::Relaxed) {
                continue;
            }
            let now = Instant::now();
            let hellos: Vec<(SocketAddr, Result<_, _>)> = {
                let mut t = lock(&peers.tracker);
                publish(&mut t, now, &peers.view_tx, &peers.tx);
                t.targets()
                    .into_iter()
                    .map(|(name, ip)| {
                        let to = SocketAddr::new(mapped(ip, v6_socket), port);
                        (to, t.hello_for(&name, now).encode())
                    })
                    .collect()
            };
            for (to, bytes) in hellos {
                match bytes {
                    Ok(b) => {
                        if let Err(e) = socket.send_to(&b, to).await {
                            debug!("failed to send a hello to {to}: {e}");
                        }
                    }
                    Err(e) => warn!("{e}"),
                }
            }
        }
    });
}

/// Note transitions and publish the view if it changed.
fn publish(
    t: &mut Tracker,
    now: Instant,
    view_tx: &watch::Sender<PeerView>,
    tx: &mpsc::UnboundedSender<Transition>,
) {
    let (view, transitions) = t.observe(now);
    for tr in transitions {
        let _ = tx.send(tr);
    }
    view_tx.send_if_modified(|v| {
        if *v == view {
            false
        } else {
            *v = view;
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
