//! `egress-echo`: the lab's hosts report the source address and port they saw.
//!
//! ```text
//! egress-echo serve [--bind IP] --tcp PORT --udp PORT
//! egress-echo query tcp|udp HOST:PORT [--size N] [--timeout-ms T] [--sport P] [--attempts K]
//! egress-echo stream tcp|udp HOST:PORT [--interval-ms I] [--duration-ms D] [--events FILE]
//!                  [--sport P]
//! egress-echo abort tcp HOST:PORT [--interval-ms I] [--duration-ms D] [--sport P]
//! ```
//!
//! Protocol (TCP stream or one UDP datagram each way):
//!
//! ```text
//! request:  "SIZE <n>\n" followed by n payload bytes
//! reply:    "seen <src-ip>:<src-port>\n" followed by n payload bytes
//! ```
//!
//! Payload byte `i` is `i % 251` (a prime, so shifted or truncated data shows). A TCP request
//! line without `SIZE` (e.g. an empty line) means n = 0. `query` prints the seen line and
//! exits 0 only if the reply's payload is exactly the n bytes expected; every wait is bounded.
//!
//! Streams, for failover measurements (one long-lived flow, a line every interval):
//!
//! ```text
//! TCP:  "STREAM\n" first, then per line "<line>\n"  ->  "seen <src-ip>:<src-port> <line>\n"
//! UDP:  datagram "STREAM <rest>"                    ->  "seen <src-ip>:<src-port> <rest>"
//! ```
//!
//! `stream` sends the numbers 0, 1, 2, ... one per interval and never reconnects: a TCP
//! connection that is reset or closed ends the stream (`"reset": true`). It stops after the
//! duration or on SIGTERM/SIGINT and prints one JSON line: counts, the longest gap between
//! replies, the sources the server saw, and every reply's time (unix milliseconds, so a
//! runner can line them up with what it did). `--events FILE` also writes each send and
//! reply as it happens: `<unix_ms> send <seq>`, `<unix_ms> reply <seq> <ip:port>`,
//! `<unix_ms> reset|error <message>`. It exits 0 unless the stream broke.
//!
//! Aborted connections, for the soak: a TCP request line `RESET` is answered with the seen
//! line, then the server closes with a RST (`SO_LINGER` 0). `abort` opens one connection
//! per interval (from `--sport` each time if given: one tuple, reused) and ends each with a
//! RST, by turns its own (after the reply to `STREAM` and a line) and the server's (after
//! `RESET`); after the duration or on SIGTERM/SIGINT it prints one JSON line of counts.
//!
//! std only, except for binding the TCP source port of `--sport`, which std cannot do: that
//! one path goes through tokio's `TcpSocket` (already a dependency of this crate). The
//! `stream` and `abort` clients are `egress_tests::stream` and `egress_tests::aborts`, next
//! to the summary types their readers share.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    process::ExitCode,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// Largest payload a query may ask for: a UDP reply must fit one datagram.
const MAX_UDP_PAYLOAD: usize = 65_000;
const MAX_TCP_PAYLOAD: usize = 64 << 20;
/// A server never waits longer than this for a client's request.
const SERVER_IO_TIMEOUT: Duration = Duration::from_secs(10);

/// A stream connection may stay idle this long (its path may be failing over).
const STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(120);

const USAGE: &str = "usage:
  egress-echo serve [--bind IP] [--tcp PORT] [--udp PORT]
  egress-echo query tcp|udp HOST:PORT [--size N] [--timeout-ms T] [--sport P] [--attempts K]
  egress-echo stream tcp|udp HOST:PORT [--interval-ms I] [--duration-ms D] [--events FILE]
                     [--sport P]
  egress-echo abort tcp HOST:PORT [--interval-ms I] [--duration-ms D] [--sport P]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("serve") => serve(&args[1..]),
        Some("query") => query(&args[1..]),
        Some("stream") => stream(&args[1..]),
        Some("abort") => egress_tests::aborts::run(&args[1..]).map_err(|e| e.context(USAGE)),
        Some("flood") => flood(&args[1..]),
        Some("-h" | "--help") => {
            println!("{USAGE}");
            Ok(())
        }
        _ => Err(anyhow::anyhow!("{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("egress-echo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn payload(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

fn parse_size_line(line: &str) -> Result<usize> {
    let line = line.trim();
    if line.is_empty() {
        return Ok(0);
    }
    match line.strip_prefix("SIZE ") {
        Some(n) => n
            .trim()
            .parse()
            .with_context(|| format!("bad SIZE in request {line:?}")),
        None => Ok(0),
    }
}

/// Take the value after a flag.
fn value<'a>(it: &mut impl Iterator<Item = &'a String>, flag: &str) -> Result<&'a str> {
    it.next()
        .map(String::as_str)
        .with_context(|| format!("{flag} needs a value\n{USAGE}"))
}

// ---------------------------------------------------------------------------------------
// serve

fn serve(args: &[String]) -> Result<()> {
    let mut bind = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
    let (mut tcp, mut udp) = (None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--bind" => bind = value(&mut it, a)?.parse().context("bad --bind")?,
            "--tcp" => tcp = Some(value(&mut it, a)?.parse::<u16>().context("bad --tcp")?),
            "--udp" => udp = Some(value(&mut it, a)?.parse::<u16>().context("bad --udp")?),
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if tcp.is_none() && udp.is_none() {
        bail!("serve needs --tcp and/or --udp\n{USAGE}");
    }
    let mut threads = Vec::new();
    let mut ready = Vec::new();
    if let Some(port) = tcp {
        let listener = TcpListener::bind((bind, port))
            .with_context(|| format!("failed to bind TCP {bind}:{port}"))?;
        ready.push(format!("tcp {}", listener.local_addr()?));
        threads.push(thread::spawn(move || serve_tcp(listener)));
    }
    if let Some(port) = udp {
        let socket = UdpSocket::bind((bind, port))
            .with_context(|| format!("failed to bind UDP {bind}:{port}"))?;
        ready.push(format!("udp {}", socket.local_addr()?));
        threads.push(thread::spawn(move || serve_udp(socket)));
    }
    // The one line on stdout: the lab waits for it before sending traffic.
    println!("ready {}", ready.join(" "));
    std::io::stdout().flush().ok();
    for t in threads {
        t.join()
            .map_err(|_| anyhow::anyhow!("server thread panicked"))??;
    }
    Ok(())
}

fn serve_tcp(listener: TcpListener) -> Result<()> {
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                thread::spawn(move || {
                    let peer = stream.peer_addr().ok();
                    if let Err(e) = handle_tcp(stream) {
                        eprintln!("tcp {peer:?}: {e:#}");
                    }
                });
            }
            Err(e) => eprintln!("tcp accept: {e}"),
        }
    }
    Ok(())
}

fn handle_tcp(stream: TcpStream) -> Result<()> {
    let peer = stream.peer_addr()?;
    stream.set_read_timeout(Some(SERVER_IO_TIMEOUT))?;
    stream.set_write_timeout(Some(SERVER_IO_TIMEOUT))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line).context("read request line")?;
    match line.trim_end() {
        "STREAM" => return stream_tcp(reader, stream, peer),
        "RESET" => return reset_tcp(reader, stream, peer),
        _ => {}
    }
    let n = parse_size_line(&line)?;
    if n > MAX_TCP_PAYLOAD {
        bail!("SIZE {n} too large");
    }
    let mut got = vec![0; n];
    reader
        .read_exact(&mut got)
        .context("read request payload")?;
    if got != payload(n) {
        bail!("request payload of {n} bytes is corrupt");
    }
    let mut reply = format!("seen {peer}\n").into_bytes();
    reply.extend_from_slice(&payload(n));
    let mut stream = stream;
    stream.write_all(&reply)?;
    stream.flush()?;
    eprintln!("tcp seen {peer} size {n}");
    Ok(())
}

/// The seen line, then a RST instead of a FIN.
fn reset_tcp(reader: BufReader<TcpStream>, mut stream: TcpStream, peer: SocketAddr) -> Result<()> {
    stream.write_all(format!("seen {peer}\n").as_bytes())?;
    // The reader's handle too: the socket closes with the last one.
    drop(reader);
    egress_tests::aborts::reset(stream).context("failed to reset")?;
    eprintln!("tcp reset {peer}");
    Ok(())
}

/// Line echo until the client closes (or resets): each line comes back as
/// `seen <peer> <line>`.
fn stream_tcp(
    mut reader: BufReader<TcpStream>,
    mut stream: TcpStream,
    peer: SocketAddr,
) -> Result<()> {
    stream.set_read_timeout(Some(STREAM_IDLE_TIMEOUT))?;
    eprintln!("tcp stream from {peer}");
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) => {
                eprintln!("tcp stream from {peer} closed");
                return Ok(());
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                eprintln!("tcp stream from {peer} reset");
                return Ok(());
            }
            r => {
                r.context("read stream line")?;
            }
        }
        stream.write_all(format!("seen {peer} {}\n", line.trim_end()).as_bytes())?;
    }
}

fn serve_udp(socket: UdpSocket) -> Result<()> {
    let mut buf = vec![0; 65_536];
    loop {
        let (len, peer) = match socket.recv_from(&mut buf) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("udp recv: {e}");
                continue;
            }
        };
        let data = &buf[..len];
        if let Some(rest) = data.strip_prefix(b"STREAM ") {
            let mut reply = format!("seen {peer} ").into_bytes();
            reply.extend_from_slice(rest);
            if let Err(e) = socket.send_to(&reply, peer) {
                eprintln!("udp send to {peer}: {e}");
            }
            continue;
        }
        let (head, body) = match data.iter().position(|&b| b == b'\n') {
            Some(i) => (&data[..i], &data[i + 1..]),
            None => (data, &data[len..]),
        };
        let n = match parse_size_line(&String::from_utf8_lossy(head)) {
            Ok(n) if n == body.len() && body == payload(n).as_slice() => n,
            Ok(n) => {
                eprintln!("udp {peer}: SIZE {n} but {} payload bytes", body.len());
                continue;
            }
            Err(e) => {
                eprintln!("udp {peer}: {e:#}");
                continue;
            }
        };
        let mut reply = format!("seen {peer}\n").into_bytes();
        reply.extend_from_slice(&payload(n));
        if let Err(e) = socket.send_to(&reply, peer) {
            eprintln!("udp send to {peer}: {e}");
        } else {
            eprintln!("udp seen {peer} size {n}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// query

struct Query {
    udp: bool,
    target: SocketAddr,
    size: usize,
    timeout: Duration,
    sport: Option<u16>,
    attempts: u32,
}

fn parse_query(args: &[String]) -> Result<Query> {
    let mut it = args.iter();
    let udp = match it.next().map(String::as_str) {
        Some("tcp") => false,
        Some("udp") => true,
        _ => bail!("query needs tcp or udp\n{USAGE}"),
    };
    let target: SocketAddr = value(&mut it, "query")?
        .parse()
        .context("bad HOST:PORT (an IP address and a port)")?;
    let mut q = Query {
        udp,
        target,
        size: 0,
        timeout: Duration::from_millis(2000),
        sport: None,
        attempts: 1,
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "--size" => q.size = value(&mut it, a)?.parse().context("bad --size")?,
            "--timeout-ms" => {
                q.timeout =
                    Duration::from_millis(value(&mut it, a)?.parse().context("bad --timeout-ms")?)
            }
            "--sport" => q.sport = Some(value(&mut it, a)?.parse().context("bad --sport")?),
            "--attempts" => q.attempts = value(&mut it, a)?.parse().context("bad --attempts")?,
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if q.timeout.is_zero() || q.attempts == 0 {
        bail!("--timeout-ms and --attempts must be positive");
    }
    let max = if udp {
        MAX_UDP_PAYLOAD
    } else {
        MAX_TCP_PAYLOAD
    };
    if q.size > max {
        bail!("--size {} is larger than {max}", q.size);
    }
    Ok(q)
}

fn query(args: &[String]) -> Result<()> {
    let q = parse_query(args)?;
    let reply = if q.udp {
        query_udp(&q)?
    } else {
        query_tcp(&q)?
    };
    let (line, body) = match reply.iter().position(|&b| b == b'\n') {
        Some(i) => (&reply[..i], &reply[i + 1..]),
        None => bail!(
            "reply without a seen line: {:?}",
            String::from_utf8_lossy(&reply)
        ),
    };
    let line = String::from_utf8_lossy(line);
    if !line.starts_with("seen ") {
        bail!("unexpected reply line {line:?}");
    }
    if body.len() != q.size {
        bail!(
            "{line}: reply payload is {} bytes, expected {}",
            body.len(),
            q.size
        );
    }
    if body != payload(q.size).as_slice() {
        bail!("{line}: reply payload of {} bytes is corrupt", q.size);
    }
    println!("{line}");
    Ok(())
}

fn request(size: usize) -> Vec<u8> {
    let mut req = format!("SIZE {size}\n").into_bytes();
    req.extend_from_slice(&payload(size));
    req
}

fn query_tcp(q: &Query) -> Result<Vec<u8>> {
    let deadline = Instant::now() + q.timeout;
    let mut stream = match q.sport {
        None => TcpStream::connect_timeout(&q.target, q.timeout)
            .with_context(|| format!("failed to connect to {}", q.target))?,
        Some(sport) => egress_tests::stream::connect_from(q.target, sport, q.timeout)?,
    };
    let left = |what: &str| {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .with_context(|| format!("timed out {what} {}", q.target))
    };
    stream.set_write_timeout(Some(left("sending to")?))?;
    stream
        .write_all(&request(q.size))
        .with_context(|| format!("failed to send to {}", q.target))?;
    let mut reply = Vec::new();
    let mut buf = vec![0; 64 * 1024];
    loop {
        stream.set_read_timeout(Some(left("waiting for")?))?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => reply.extend_from_slice(&buf[..n]),
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "failed to read reply from {} ({} bytes so far)",
                        q.target,
                        reply.len()
                    )
                });
            }
        }
        // Stop as soon as the whole reply is in; the server closes right after anyway.
        if let Some(i) = reply.iter().position(|&b| b == b'\n')
            && reply.len() - i > q.size
        {
            break;
        }
    }
    Ok(reply)
}

fn query_udp(q: &Query) -> Result<Vec<u8>> {
    let local: SocketAddr = match q.target {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, q.sport.unwrap_or(0)).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, q.sport.unwrap_or(0)).into(),
    };
    let socket = UdpSocket::bind(local).with_context(|| format!("failed to bind {local}"))?;
    socket
        .connect(q.target)
        .with_context(|| format!("failed to connect UDP socket to {}", q.target))?;
    let req = request(q.size);
    let per_attempt = (q.timeout / q.attempts).max(Duration::from_millis(1));
    let mut buf = vec![0; 65_536];
    for _ in 0..q.attempts {
        socket
            .send(&req)
            .with_context(|| format!("failed to send to {}", q.target))?;
        socket.set_read_timeout(Some(per_attempt))?;
        match socket.recv(&mut buf) {
            Ok(n) => return Ok(buf[..n].to_vec()),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => {
                return Err(e).with_context(|| format!("failed to receive from {}", q.target));
            }
        }
    }
    bail!(
        "timed out waiting for {} ({} attempt(s) in {:?})",
        q.target,
        q.attempts,
        q.timeout
    )
}

// ---------------------------------------------------------------------------------------
// stream (failover measurements): the client lives in the library, next to the summary
// the failover runner reads back.

fn stream(args: &[String]) -> Result<()> {
    match egress_tests::stream::run(args) {
        Ok(true) => Ok(()),
        Ok(false) => bail!("the stream broke (see the summary)"),
        Err(e) => Err(e.context(USAGE)),
    }
}

// ---------------------------------------------------------------------------------------
// flood (benchmarks)

/// `egress-echo flood tcp HOST:PORT --seconds S [--parallel P]`: for S seconds, P threads
/// each open short TCP connections one after another (connect, an empty request line, read
/// the seen line until the server closes). Prints `connections N failures F elapsed_ms T`.
fn flood(args: &[String]) -> Result<()> {
    let mut it = args.iter();
    if it.next().map(String::as_str) != Some("tcp") {
        bail!("usage: egress-echo flood tcp HOST:PORT [--seconds S] [--parallel P]");
    }
    let target: SocketAddr = value(&mut it, "flood")?
        .parse()
        .context("bad HOST:PORT (an IP address and a port)")?;
    let (mut seconds, mut parallel) = (3.0_f64, 1_usize);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => seconds = value(&mut it, a)?.parse().context("bad --seconds")?,
            "--parallel" => parallel = value(&mut it, a)?.parse().context("bad --parallel")?,
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if !(seconds > 0.0 && seconds <= 600.0) || parallel == 0 {
        bail!("--seconds must be in (0, 600] and --parallel positive");
    }
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(seconds);
    let workers: Vec<_> = (0..parallel)
        .map(|_| {
            thread::spawn(move || {
                let (mut ok, mut failed) = (0_u64, 0_u64);
                while Instant::now() < end {
                    match one_flow(target) {
                        Ok(()) => ok += 1,
                        Err(_) => failed += 1,
                    }
                }
                (ok, failed)
            })
        })
        .collect();
    let (mut ok, mut failed) = (0, 0);
    for w in workers {
        let (o, f) = w
            .join()
            .map_err(|_| anyhow::anyhow!("flood thread panicked"))?;
        ok += o;
        failed += f;
    }
    println!(
        "connections {ok} failures {failed} elapsed_ms {}",
        start.elapsed().as_millis()
    );
    Ok(())
}

fn one_flow(target: SocketAddr) -> Result<()> {
    let timeout = Duration::from_secs(1);
    let mut stream = TcpStream::connect_timeout(&target, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)?;
    stream.write_all(b"\n")?;
    let mut buf = [0; 256];
    let mut got = 0;
    // Until the server closes: the server ends the flow, so TIME_WAIT stays on its side.
    loop {
        match stream.read(&mut buf)? {
            0 => break,
            n => got += n,
        }
    }
    if got == 0 {
        bail!("empty reply");
    }
    Ok(())
}
