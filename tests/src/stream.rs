//! Streams for failover measurements: the client of `egress-echo stream` (one long-lived TCP
//! or UDP flow, a numbered line every interval) and the [`Summary`] it prints, which the
//! failover runner reads back; `ping -D` output is read into the same shape.
//!
//! The client never reconnects: a TCP connection that is reset or closed ends the stream,
//! which is what a failover that keeps TCP alive must avoid. Every wait is bounded; SIGTERM
//! or SIGINT stop the stream early (the summary is still printed).

use std::{
    fs::File,
    io::{self, LineWriter, Read as _, Write as _},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    path::PathBuf,
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

/// How long a stream waits for replies still in flight after it stops sending.
const DRAIN: Duration = Duration::from_millis(250);
/// Longest single wait of the reader and the writer (so a stop is noticed quickly).
const POLL: Duration = Duration::from_millis(50);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Set by SIGTERM/SIGINT.
static STOP: AtomicBool = AtomicBool::new(false);

/// Wall-clock milliseconds since the Unix epoch (what `ping -D` and agent logs use).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `egress-echo stream tcp|udp HOST:PORT [--interval-ms I] [--duration-ms D] [--events FILE]
/// [--new-flows] [--sport P]`.
#[derive(Clone, Debug)]
pub struct Args {
    pub udp: bool,
    pub target: SocketAddr,
    pub interval: Duration,
    pub duration: Duration,
    pub events: Option<PathBuf>,
    /// UDP: every datagram from a new socket (a new source port), so each is a new flow
    /// to the datapath, as a new connection would be; its reply is awaited for at most the
    /// interval.
    pub new_flows: bool,
    /// TCP: connect from this source port (two pods' flows to the same host and port from
    /// the same port make a gateway remap one).
    pub sport: Option<u16>,
}

impl Args {
    pub fn parse(args: &[String]) -> Result<Self> {
        let mut it = args.iter();
        let udp = match it.next().map(String::as_str) {
            Some("tcp") => false,
            Some("udp") => true,
            _ => bail!("stream needs tcp or udp"),
        };
        let target = it
            .next()
            .context("stream needs HOST:PORT")?
            .parse()
            .context("bad HOST:PORT (an IP address and a port)")?;
        let mut out = Self {
            udp,
            target,
            interval: Duration::from_millis(20),
            duration: Duration::from_secs(10),
            events: None,
            new_flows: false,
            sport: None,
        };
        while let Some(a) = it.next() {
            if a == "--new-flows" {
                out.new_flows = true;
                continue;
            }
            let v = it.next().with_context(|| format!("{a} needs a value"))?;
            match a.as_str() {
                "--interval-ms" => {
                    out.interval = Duration::from_millis(v.parse().context("bad --interval-ms")?)
                }
                "--duration-ms" => {
                    out.duration = Duration::from_millis(v.parse().context("bad --duration-ms")?)
                }
                "--events" => out.events = Some(PathBuf::from(v)),
                "--sport" => out.sport = Some(v.parse().context("bad --sport")?),
                other => bail!("unknown argument {other:?}"),
            }
        }
        if out.interval.is_zero() || out.duration.is_zero() {
            bail!("--interval-ms and --duration-ms must be positive");
        }
        Ok(out)
    }
}

/// What a stream saw, printed as one JSON line. Times are unix milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// `tcp`, `udp` or `icmp` (read from ping).
    pub proto: String,
    /// When the stream started (its first send): the epoch of its clock.
    pub epoch_unix_ms: u64,
    /// When it stopped sending.
    pub end_unix_ms: u64,
    pub sent: u64,
    pub received: u64,
    /// The longest time without a reply, from the start to the end (both count as edges).
    pub longest_gap_ms: u64,
    pub gap_start_unix_ms: u64,
    /// TCP: the connection was reset or closed (ECONNRESET, EPIPE, EOF).
    pub reset: bool,
    /// Why the stream broke or could not start.
    pub error: Option<String>,
    /// The sources the server saw (`ip:port`), in order of first appearance.
    pub sources: Vec<String>,
    /// Every reply: when it arrived, its sequence number, when that line was sent.
    pub replies_unix_ms: Vec<u64>,
    pub reply_seqs: Vec<u64>,
    pub reply_sent_unix_ms: Vec<u64>,
}

impl Summary {
    /// The stream held: no reset, no error.
    pub fn unbroken(&self) -> bool {
        !self.reset && self.error.is_none()
    }

    pub fn to_json(&self) -> String {
        json!({
            "proto": self.proto,
            "epoch_unix_ms": self.epoch_unix_ms,
            "end_unix_ms": self.end_unix_ms,
            "sent": self.sent,
            "received": self.received,
            "longest_gap_ms": self.longest_gap_ms,
            "gap_start_unix_ms": self.gap_start_unix_ms,
            "reset": self.reset,
            "error": self.error,
            "sources": self.sources,
            "replies_unix_ms": self.replies_unix_ms,
            "reply_seqs": self.reply_seqs,
            "reply_sent_unix_ms": self.reply_sent_unix_ms,
        })
        .to_string()
    }

    pub fn from_json(line: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(line.trim())
            .with_context(|| format!("failed to parse stream summary {line:?}"))?;
        let u = |k: &str| {
            v[k].as_u64()
                .with_context(|| format!("stream summary: {k} is not a number"))
        };
        let list = |k: &str| -> Result<Vec<u64>> {
            v[k].as_array()
                .with_context(|| format!("stream summary: {k} is not a list"))?
                .iter()
                .map(|x| x.as_u64().context("stream summary: not a number"))
                .collect()
        };
        Ok(Self {
            proto: v["proto"].as_str().unwrap_or_default().to_owned(),
            epoch_unix_ms: u("epoch_unix_ms")?,
            end_unix_ms: u("end_unix_ms")?,
            sent: u("sent")?,
            received: u("received")?,
            longest_gap_ms: u("longest_gap_ms")?,
            gap_start_unix_ms: u("gap_start_unix_ms")?,
            reset: v["reset"].as_bool().unwrap_or(false),
            error: v["error"].as_str().map(str::to_owned),
            sources: v["sources"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default(),
            replies_unix_ms: list("replies_unix_ms")?,
            reply_seqs: list("reply_seqs")?,
            reply_sent_unix_ms: list("reply_sent_unix_ms")?,
        })
    }

    /// The first summary line (`{...}`) in a stream's output.
    pub fn find_in(output: &str) -> Result<Self> {
        let line = output
            .lines()
            .find(|l| l.starts_with('{'))
            .with_context(|| format!("no stream summary in {output:?}"))?;
        Self::from_json(line)
    }

    /// Milliseconds from `t` to the first reply to a line sent at or after `t`: how long
    /// after an event the flow got through again. `None`: no such reply.
    pub fn first_reply_after(&self, t: u64) -> Option<u64> {
        self.replies_unix_ms
            .iter()
            .zip(&self.reply_sent_unix_ms)
            .filter(|(_, sent)| **sent >= t)
            .map(|(at, _)| at.saturating_sub(t))
            .min()
    }

    /// How the flow came back from its worst interruption (a gap between replies longer
    /// than `min_gap` ms) that ended after `t`. No reply for the last `still_out` ms before
    /// the stream stopped wins: the flow was not back. (A shorter gap at the end is no
    /// verdict either way: a busy machine stalls flows for a fraction of a second.)
    pub fn recovery_after(&self, t: u64, min_gap: u64, still_out: u64) -> Recovery {
        let mut replies = self.replies_unix_ms.clone();
        replies.sort_unstable();
        let last = replies.last().copied().unwrap_or(self.epoch_unix_ms);
        if self.end_unix_ms.saturating_sub(last) > still_out {
            return Recovery::Never;
        }
        let mut prev = self.epoch_unix_ms;
        let mut worst: Option<(u64, u64)> = None;
        for at in replies {
            let gap = at.saturating_sub(prev);
            if at > t && gap > min_gap && worst.is_none_or(|(g, _)| gap > g) {
                worst = Some((gap, at));
            }
            prev = prev.max(at);
        }
        worst.map_or(Recovery::Unbroken, |(_, at)| {
            Recovery::After(at.saturating_sub(t))
        })
    }

    /// When the last reply arrived.
    pub fn last_reply(&self) -> Option<u64> {
        self.replies_unix_ms.iter().copied().max()
    }

    /// Fill `received`, `longest_gap_ms` and `gap_start_unix_ms` from the replies.
    fn finish(&mut self) {
        self.received = self.replies_unix_ms.len() as u64;
        let (start, len) = longest_gap(self.epoch_unix_ms, &self.replies_unix_ms, self.end_unix_ms);
        self.gap_start_unix_ms = start;
        self.longest_gap_ms = len;
    }

    /// `ping -D -n` output (stopped with SIGINT, so its statistics are there): replies are
    /// the `bytes from` lines, a reply's send time is its arrival minus its round trip.
    pub fn from_ping(output: &str, start_unix_ms: u64, end_unix_ms: u64) -> Self {
        let mut s = Self {
            proto: "icmp".to_owned(),
            epoch_unix_ms: start_unix_ms,
            end_unix_ms,
            ..Self::default()
        };
        let mut max_seq = 0;
        for line in output.lines() {
            if let Some(n) = line
                .split_once(" packets transmitted")
                .and_then(|(n, _)| n.trim().parse().ok())
            {
                s.sent = n;
            }
            let Some((ts, rest)) = line.strip_prefix('[').and_then(|l| l.split_once("] ")) else {
                continue;
            };
            if !rest.contains(" bytes from ") {
                continue;
            }
            let field = |k: &str| {
                rest.split_whitespace()
                    .find_map(|w| w.strip_prefix(k))
                    .and_then(|v| v.parse::<f64>().ok())
            };
            let (Ok(ts), Some(seq), Some(rtt)) =
                (ts.parse::<f64>(), field("icmp_seq="), field("time="))
            else {
                continue;
            };
            let at = (ts * 1000.0) as u64;
            let seq = seq as u64;
            if s.reply_seqs.contains(&seq) {
                continue; // a duplicate (DUP!)
            }
            max_seq = max_seq.max(seq);
            s.replies_unix_ms.push(at);
            s.reply_seqs.push(seq);
            s.reply_sent_unix_ms.push(at.saturating_sub(rtt as u64));
            if let Some(from) = rest
                .split_once(" bytes from ")
                .and_then(|(_, r)| r.split(':').next())
                && !s.sources.iter().any(|x| x == from)
            {
                s.sources.push(from.to_owned());
            }
        }
        if s.sent == 0 {
            s.sent = max_seq;
        }
        s.finish();
        s
    }
}

/// How a flow came back after an event: [`Summary::recovery_after`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// No gap longer than the threshold after the event.
    Unbroken,
    /// Milliseconds from the event to the reply that ended the worst gap.
    After(u64),
    /// Not back when the stream stopped.
    Never,
}

impl std::fmt::Display for Recovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recovery::Unbroken => f.write_str("no gap"),
            Recovery::After(ms) => write!(f, "{ms}"),
            Recovery::Never => f.write_str("never"),
        }
    }
}

/// The longest interval between consecutive points of `start`, the sorted `replies` and
/// `end` (at least the last reply): `(where it starts, how long)`.
pub fn longest_gap(start: u64, replies: &[u64], end: u64) -> (u64, u64) {
    let mut points: Vec<u64> = replies.to_vec();
    points.sort_unstable();
    let end = end.max(points.last().copied().unwrap_or(0));
    let mut prev = start;
    let mut best = (start, 0);
    for t in points.into_iter().chain([end]) {
        let t = t.max(prev);
        if t - prev > best.1 {
            best = (prev, t - prev);
        }
        prev = t;
    }
    best
}

/// Run `egress-echo stream`; prints the summary, returns whether the stream held.
pub fn run(args: &[String]) -> Result<bool> {
    let args = Args::parse(args)?;
    install_stop_handler();
    let rec = Recorder::new(&args)?;
    eprintln!(
        "stream {} {} epoch_unix_ms {}",
        if args.udp { "udp" } else { "tcp" },
        args.target,
        rec.epoch_ms
    );
    let outcome = if args.udp && args.new_flows {
        stream_udp_new_flows(&args, &rec)
    } else if args.udp {
        stream_udp(&args, &rec)
    } else {
        stream_tcp(&args, &rec)
    };
    if let Err(e) = outcome {
        rec.broke(false, &format!("{e:#}"));
    }
    let summary = rec.summary();
    println!("{}", summary.to_json());
    io::stdout().flush().ok();
    Ok(summary.unbroken())
}

/// SIGTERM and SIGINT set [`stopped`] (the stream and `aborts` clients).
pub(crate) fn install_stop_handler() {
    extern "C" fn on_signal(_: libc::c_int) {
        STOP.store(true, Ordering::Relaxed);
    }
    let handler = on_signal as extern "C" fn(libc::c_int);
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(sig, handler as libc::sighandler_t);
        }
    }
}

pub(crate) fn stopped() -> bool {
    STOP.load(Ordering::Relaxed)
}

#[derive(Default)]
struct Record {
    /// Send time of each sequence number.
    sent: Vec<u64>,
    summary: Summary,
    /// Set when the stream broke: the writer stops.
    broken: bool,
}

/// The stream's clock, its record and its events file.
struct Recorder {
    epoch: Instant,
    epoch_ms: u64,
    end_ms: Mutex<Option<u64>>,
    record: Mutex<Record>,
    events: Option<Mutex<LineWriter<File>>>,
}

impl Recorder {
    fn new(args: &Args) -> Result<Self> {
        let events = match &args.events {
            Some(p) => Some(Mutex::new(LineWriter::new(
                File::create(p).with_context(|| format!("failed to create {}", p.display()))?,
            ))),
            None => None,
        };
        let mut record = Record::default();
        record.summary.proto = if args.udp { "udp" } else { "tcp" }.to_owned();
        Ok(Self {
            epoch: Instant::now(),
            epoch_ms: unix_ms(),
            end_ms: Mutex::new(None),
            record: Mutex::new(record),
            events,
        })
    }

    /// Unix milliseconds on a monotonic clock anchored at the epoch.
    fn now_ms(&self) -> u64 {
        self.epoch_ms + self.epoch.elapsed().as_millis() as u64
    }

    fn record(&self) -> std::sync::MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn event(&self, at: u64, what: &str) {
        if let Some(ev) = &self.events {
            let mut ev = ev.lock().unwrap_or_else(|e| e.into_inner());
            let _ = writeln!(ev, "{at} {what}");
        }
    }

    fn sent(&self, seq: u64) {
        let at = self.now_ms();
        let mut r = self.record();
        r.sent.push(at);
        r.summary.sent = r.sent.len() as u64;
        drop(r);
        self.event(at, &format!("send {seq}"));
    }

    /// One reply line: `seen <ip:port> <seq>`.
    fn reply(&self, line: &str) {
        let at = self.now_ms();
        let mut words = line.split_whitespace();
        let (Some("seen"), Some(src), Some(Ok(seq))) = (
            words.next(),
            words.next(),
            words.next().map(str::parse::<u64>),
        ) else {
            self.event(at, &format!("junk {line:?}"));
            return;
        };
        let mut r = self.record();
        let sent = r.sent.get(seq as usize).copied().unwrap_or(at);
        let s = &mut r.summary;
        s.replies_unix_ms.push(at);
        s.reply_seqs.push(seq);
        s.reply_sent_unix_ms.push(sent);
        if !s.sources.iter().any(|x| x == src) {
            s.sources.push(src.to_owned());
        }
        drop(r);
        self.event(at, &format!("reply {seq} {src}"));
    }

    fn broke(&self, reset: bool, why: &str) {
        let at = self.now_ms();
        let mut r = self.record();
        if r.broken {
            return;
        }
        r.broken = true;
        r.summary.reset |= reset;
        r.summary.error = Some(why.to_owned());
        drop(r);
        self.event(
            at,
            &format!("{} {why}", if reset { "reset" } else { "error" }),
        );
    }

    fn broken(&self) -> bool {
        self.record().broken
    }

    fn stop_sending(&self) {
        let now = self.now_ms();
        self.end_ms
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(now);
    }

    fn summary(&self) -> Summary {
        self.stop_sending();
        let end = *self.end_ms.lock().unwrap_or_else(|e| e.into_inner());
        let mut s = self.record().summary.clone();
        s.epoch_unix_ms = self.epoch_ms;
        s.end_unix_ms = end.unwrap_or(self.epoch_ms);
        s.finish();
        s
    }
}

fn is_reset(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
    )
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// Send one numbered line per interval until the duration ends, a stop signal comes or
/// the stream breaks; then wait [`DRAIN`] for replies in flight. `reader` runs alongside.
fn drive(
    args: &Args,
    rec: &Recorder,
    mut send: impl FnMut(u64) -> io::Result<()>,
    reader: impl FnOnce(&AtomicBool) + Send,
) {
    let done = AtomicBool::new(false);
    let done_ref = &done;
    thread::scope(|s| {
        s.spawn(move || reader(done_ref));
        let start = Instant::now();
        let end = start + args.duration;
        let mut seq = 0_u64;
        while !stopped() && !rec.broken() && Instant::now() < end {
            rec.sent(seq);
            if let Err(e) = send(seq) {
                rec.broke(is_reset(&e), &format!("failed to send line {seq}: {e}"));
                break;
            }
            seq += 1;
            let next = start + args.interval * u32::try_from(seq).unwrap_or(u32::MAX);
            while !stopped() && Instant::now() < next.min(end) {
                thread::sleep(
                    next.min(end)
                        .saturating_duration_since(Instant::now())
                        .min(POLL),
                );
            }
        }
        rec.stop_sending();
        let drain_end = Instant::now() + DRAIN;
        while !rec.broken() && Instant::now() < drain_end {
            thread::sleep(Duration::from_millis(10));
        }
        done.store(true, Ordering::Relaxed);
    });
}

/// Read until `done`, splitting what arrives into lines (a UDP datagram is one line).
fn read_lines(
    rec: &Recorder,
    done: &AtomicBool,
    datagrams: bool,
    mut recv: impl FnMut(&mut [u8]) -> io::Result<usize>,
) {
    let mut pending = Vec::new();
    let mut buf = [0_u8; 2048];
    while !done.load(Ordering::Relaxed) {
        match recv(&mut buf) {
            Ok(0) if !datagrams => {
                rec.broke(true, "connection closed by the server (EOF)");
                return;
            }
            Ok(n) => {
                pending.extend_from_slice(&buf[..n]);
                if datagrams {
                    pending.push(b'\n');
                }
                while let Some(i) = pending.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=i).collect();
                    rec.reply(String::from_utf8_lossy(&line[..i]).trim());
                }
            }
            Err(e) if is_timeout(&e) => {}
            // ICMP errors on a connected UDP socket: the flow goes on.
            Err(e) if datagrams => rec.event(rec.now_ms(), &format!("icmp {e}")),
            Err(e) => {
                rec.broke(is_reset(&e), &format!("failed to read: {e}"));
                return;
            }
        }
    }
}

fn stream_tcp(args: &Args, rec: &Recorder) -> Result<()> {
    let stream = match args.sport {
        Some(sport) => connect_from(args.target, sport, CONNECT_TIMEOUT)?,
        None => TcpStream::connect_timeout(&args.target, CONNECT_TIMEOUT)
            .with_context(|| format!("failed to connect to {}", args.target))?,
    };
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(POLL))?;
    // Lines are a few bytes: a write only blocks if the send buffer is full after
    // minutes of outage.
    stream.set_write_timeout(Some(Duration::from_secs(1)))?;
    let mut writer = stream.try_clone()?;
    writer.write_all(b"STREAM\n")?;
    let mut reader = stream;
    drive(
        args,
        rec,
        |seq| writer.write_all(format!("{seq}\n").as_bytes()),
        |done| read_lines(rec, done, false, |b| reader.read(b)),
    );
    Ok(())
}

fn stream_udp(args: &Args, rec: &Recorder) -> Result<()> {
    let local: SocketAddr = match args.target {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(local).with_context(|| format!("failed to bind {local}"))?;
    socket
        .connect(args.target)
        .with_context(|| format!("failed to connect UDP socket to {}", args.target))?;
    socket.set_read_timeout(Some(POLL))?;
    let reader = socket.try_clone()?;
    drive(
        args,
        rec,
        |seq| match socket.send(format!("STREAM {seq}").as_bytes()) {
            // A refused or unreachable datagram is a lost one, not a broken stream.
            Err(e) if !is_timeout(&e) => {
                rec.event(rec.now_ms(), &format!("send-error {seq} {e}"));
                Ok(())
            }
            other => other.map(drop),
        },
        |done| read_lines(rec, done, true, |b| reader.recv(b)),
    );
    Ok(())
}

/// UDP, a new socket per datagram ([`Args::new_flows`]); its reply is read on the same
/// socket, for at most the interval.
fn stream_udp_new_flows(args: &Args, rec: &Recorder) -> Result<()> {
    let local: SocketAddr = match args.target {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let wait = args.interval.max(Duration::from_millis(1));
    drive(
        args,
        rec,
        |seq| {
            let socket = UdpSocket::bind(local)?;
            socket.connect(args.target)?;
            socket.set_read_timeout(Some(wait))?;
            if let Err(e) = socket.send(format!("STREAM {seq}").as_bytes()) {
                rec.event(rec.now_ms(), &format!("send-error {seq} {e}"));
                return Ok(());
            }
            let mut buf = [0_u8; 2048];
            match socket.recv(&mut buf) {
                Ok(n) => rec.reply(String::from_utf8_lossy(&buf[..n]).trim()),
                Err(e) if is_timeout(&e) => {}
                Err(e) => rec.event(rec.now_ms(), &format!("icmp {e}")),
            }
            Ok(())
        },
        |done| {
            while !done.load(Ordering::Relaxed) {
                thread::sleep(POLL);
            }
        },
    );
    Ok(())
}

/// Connect from a fixed source port (SO_REUSEADDR, so a port in TIME_WAIT can be reused),
/// bounded by `timeout`. std cannot bind a client socket: tokio's `TcpSocket` does.
pub fn connect_from(target: SocketAddr, sport: u16, timeout: Duration) -> Result<TcpStream> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("failed to build a runtime")?;
    let stream = rt.block_on(async {
        let socket = match target {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        }?;
        socket.set_reuseaddr(true)?;
        let local: SocketAddr = match target {
            SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, sport).into(),
            SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, sport).into(),
        };
        socket
            .bind(local)
            .with_context(|| format!("failed to bind source port {sport}"))?;
        tokio::time::timeout(timeout, socket.connect(target))
            .await
            .with_context(|| format!("timed out connecting to {target} from :{sport}"))?
            .with_context(|| format!("failed to connect to {target} from :{sport}"))
    })?;
    let stream = stream.into_std().context("failed to convert the stream")?;
    stream.set_nonblocking(false)?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_gap_counts_the_edges() {
        assert_eq!(longest_gap(100, &[], 500), (100, 400));
        assert_eq!(longest_gap(100, &[120, 140, 900, 920], 1000), (140, 760));
        // The tail: replies stopped long before the end.
        assert_eq!(longest_gap(0, &[10, 20], 1000), (20, 980));
        // Unsorted, and a reply after the end.
        assert_eq!(longest_gap(0, &[30, 10, 1100], 1000), (30, 1070));
    }

    #[test]
    fn summary_round_trips_through_json() {
        let mut s = Summary {
            proto: "tcp".into(),
            epoch_unix_ms: 1000,
            end_unix_ms: 2000,
            sent: 3,
            reset: true,
            error: Some("failed to read: \"x\"".into()),
            sources: vec!["192.168.101.50:40000".into()],
            replies_unix_ms: vec![1001, 1021],
            reply_seqs: vec![0, 1],
            reply_sent_unix_ms: vec![1000, 1020],
            ..Summary::default()
        };
        s.finish();
        assert_eq!(s.received, 2);
        assert_eq!((s.gap_start_unix_ms, s.longest_gap_ms), (1021, 979));
        let back = Summary::find_in(&format!("noise\n{}\n", s.to_json())).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.first_reply_after(1010), Some(11));
        assert_eq!(back.first_reply_after(1500), None);
    }

    #[test]
    fn recovery_is_the_end_of_the_worst_gap_after_the_event() {
        let s = |replies: &[u64]| Summary {
            epoch_unix_ms: 0,
            end_unix_ms: 1000,
            replies_unix_ms: replies.to_vec(),
            ..Summary::default()
        };
        let steady: Vec<u64> = (1..50).map(|i| i * 20).collect();
        assert_eq!(s(&steady).recovery_after(500, 60, 200), Recovery::Unbroken);
        // Out from 500 to 800 (a shorter gap later does not count).
        let mut gap: Vec<u64> = steady
            .iter()
            .copied()
            .filter(|t| *t <= 500 || *t >= 800)
            .collect();
        gap.retain(|t| *t != 900);
        assert_eq!(s(&gap).recovery_after(490, 60, 200), Recovery::After(310));
        // A gap that ended before the event is not this event's.
        assert_eq!(s(&gap).recovery_after(850, 60, 200), Recovery::Unbroken);
        // Still out at the end.
        let dead: Vec<u64> = steady.iter().copied().filter(|t| *t <= 500).collect();
        assert_eq!(s(&dead).recovery_after(490, 60, 200), Recovery::Never);
        // A short silence at the end is no verdict.
        let late: Vec<u64> = steady.iter().copied().filter(|t| *t <= 900).collect();
        assert_eq!(s(&late).recovery_after(490, 60, 200), Recovery::Unbroken);
    }

    #[test]
    fn ping_output_reads_as_a_summary() {
        let out = "PING 192.168.101.100 (192.168.101.100) 56(84) bytes of data.
[1700000000.010000] 64 bytes from 192.168.101.100: icmp_seq=1 ttl=62 time=0.500 ms
[1700000000.030000] 64 bytes from 192.168.101.100: icmp_seq=2 ttl=62 time=0.400 ms
[1700000000.900000] From 10.244.11.11 icmp_seq=3 Destination Host Unreachable
[1700000001.500000] 64 bytes from 192.168.101.100: icmp_seq=40 ttl=62 time=2.000 ms

--- 192.168.101.100 ping statistics ---
41 packets transmitted, 3 received, 92.6829% packet loss, time 820ms
";
        let s = Summary::from_ping(out, 1_700_000_000_000, 1_700_000_001_520);
        assert_eq!((s.sent, s.received), (41, 3));
        assert_eq!(s.reply_seqs, [1, 2, 40]);
        assert_eq!(s.reply_sent_unix_ms[2], 1_700_000_001_498);
        assert_eq!(s.longest_gap_ms, 1470);
        assert_eq!(s.sources, ["192.168.101.100"]);
        assert_eq!(s.first_reply_after(1_700_000_000_100), Some(1400));
    }
}
