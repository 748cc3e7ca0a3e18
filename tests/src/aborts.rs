//! Aborted connections, for the soak: the client of `egress-echo abort` (TCP connections
//! one after another, each ended by a RST, from a new source port or always from the same
//! one) and the [`Summary`] it prints, which the soak reads back; [`reset`] is the abortive
//! close both ends use.
//!
//! A round connects, sends one request and reads the `seen` line (the source the host saw),
//! then the connection is reset: in even rounds by the pod (`STREAM` and one line, then an
//! abortive close), in odd rounds by the host (`RESET`: the server answers, then closes
//! abortively). Every wait is bounded; a round that fails is counted and the next one
//! starts on time. SIGTERM or SIGINT end the run after the round in progress (the summary
//! is still printed).

use std::{
    io::{self, BufRead as _, BufReader, Write as _},
    net::{IpAddr, SocketAddr, TcpStream},
    os::fd::AsRawFd as _,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};

use crate::stream::{self, connect_from, install_stop_handler, stopped};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a round waits for the host's line, and for its RST.
const REPLY_TIMEOUT: Duration = Duration::from_secs(1);
/// Distinct error messages kept for the summary.
const ERRORS_KEPT: usize = 5;

/// Close `stream` with a RST instead of a FIN (`SO_LINGER` on, 0 s): unsent data is
/// dropped, and neither end keeps the connection in TIME_WAIT, so its tuple is free again
/// at once. Every other handle of the same socket (`try_clone`) must be gone first.
pub fn reset(stream: TcpStream) -> io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket, and a `linger` of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    drop(stream);
    Ok(())
}

/// `egress-echo abort tcp HOST:PORT [--interval-ms I] [--duration-ms D] [--sport P]`: the
/// stream's arguments (`--sport`: every connection from that port, the same tuple reused
/// as soon as the last connection on it was reset), TCP only, without events.
pub fn parse(args: &[String]) -> Result<stream::Args> {
    let a = stream::Args::parse(args)?;
    if a.udp || a.new_flows || a.events.is_some() {
        bail!("abort takes tcp, --interval-ms, --duration-ms and --sport");
    }
    Ok(a)
}

/// What a run did, printed as one JSON line.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// Rounds started.
    pub rounds: u64,
    /// Connections established (each then reset, by one end or the other).
    pub connections: u64,
    /// Reset by this end after the host's line.
    pub reset_by_pod: u64,
    /// Reset by the host after its line, and the RST seen here.
    pub reset_by_host: u64,
    /// Rounds that did not go as planned (no connection, no line, no RST from the host).
    pub failed: u64,
    /// The addresses the host saw, in order of first appearance.
    pub sources: Vec<IpAddr>,
    /// How many source ports the host saw (1 with `--sport`, if every gateway kept it).
    pub ports: usize,
    /// The first few distinct errors.
    pub errors: Vec<String>,
}

impl Summary {
    /// The summary line (`{...}`) in the client's output.
    pub fn find_in(output: &str) -> Result<Self> {
        let line = output
            .lines()
            .find(|l| l.starts_with('{'))
            .with_context(|| format!("no abort summary in {output:?}"))?;
        serde_json::from_str(line).with_context(|| format!("failed to parse {line:?}"))
    }

    fn failed(&mut self, e: &anyhow::Error) {
        self.failed += 1;
        let e = format!("{e:#}");
        if self.errors.len() < ERRORS_KEPT && !self.errors.contains(&e) {
            self.errors.push(e);
        }
    }
}

/// Which end resets a round's connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum By {
    Pod,
    Host,
}

/// Run `egress-echo abort`; prints the summary.
pub fn run(args: &[String]) -> Result<()> {
    let args = parse(args)?;
    install_stop_handler();
    let mut s = Summary::default();
    let mut ports = std::collections::BTreeSet::new();
    let start = Instant::now();
    let end = start + args.duration;
    while !stopped() && Instant::now() < end {
        let by = if s.rounds % 2 == 0 { By::Pod } else { By::Host };
        s.rounds += 1;
        match round(&args, by, &mut s.connections) {
            Ok(seen) => {
                match by {
                    By::Pod => s.reset_by_pod += 1,
                    By::Host => s.reset_by_host += 1,
                }
                if !s.sources.contains(&seen.ip()) {
                    s.sources.push(seen.ip());
                }
                ports.insert(seen.port());
            }
            Err(e) => s.failed(&e),
        }
        let next = start + args.interval * u32::try_from(s.rounds).unwrap_or(u32::MAX);
        while !stopped() && Instant::now() < next.min(end) {
            thread::sleep(
                next.min(end)
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(50)),
            );
        }
    }
    s.ports = ports.len();
    println!("{}", serde_json::to_string(&s)?);
    io::stdout().flush().ok();
    Ok(())
}

/// One connection, reset by `by`; the source the host saw. Counts the connection in
/// `connections` once it is established. Whatever happens, the socket ends with a RST.
fn round(args: &stream::Args, by: By, connections: &mut u64) -> Result<SocketAddr> {
    let stream = match args.sport {
        Some(sport) => connect_from(args.target, sport, CONNECT_TIMEOUT)?,
        None => TcpStream::connect_timeout(&args.target, CONNECT_TIMEOUT)
            .with_context(|| format!("failed to connect to {}", args.target))?,
    };
    *connections += 1;
    let outcome = exchange(&stream, by);
    reset(stream).context("failed to reset the connection")?;
    outcome
}

/// The request and the host's line; for [`By::Host`], then the host's RST.
fn exchange(stream: &TcpStream, by: By) -> Result<SocketAddr> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(REPLY_TIMEOUT))?;
    stream.set_write_timeout(Some(REPLY_TIMEOUT))?;
    let request: &[u8] = match by {
        By::Pod => b"STREAM\n0\n",
        By::Host => b"RESET\n",
    };
    let mut w = stream;
    w.write_all(request).context("failed to send the request")?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader
        .read_line(&mut line)
        .context("failed to read the host's line")?;
    let seen = line
        .split_whitespace()
        .nth(1)
        .filter(|_| line.starts_with("seen "))
        .and_then(|a| a.parse().ok())
        .with_context(|| format!("unexpected line {line:?}"))?;
    if by == By::Host {
        let mut rest = String::new();
        match reader.read_line(&mut rest) {
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
            Ok(0) => bail!("the host closed the connection instead of resetting it"),
            Ok(_) => bail!("unexpected line {rest:?} instead of a RST"),
            Err(e) => return Err(e).context("no RST from the host"),
        }
    }
    Ok(seen)
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn args_parse() {
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let a = parse(&args(&[
            "tcp",
            "192.0.2.1:7",
            "--interval-ms",
            "250",
            "--sport",
            "41000",
        ]))
        .unwrap();
        assert_eq!(a.interval, Duration::from_millis(250));
        assert_eq!(a.sport, Some(41_000));
        assert!(parse(&args(&["udp", "192.0.2.1:7"])).is_err());
        assert!(parse(&args(&["tcp", "192.0.2.1:7", "--events", "x"])).is_err());
    }

    #[test]
    fn summary_round_trips() {
        let s = Summary {
            rounds: 3,
            connections: 2,
            reset_by_pod: 1,
            reset_by_host: 1,
            failed: 1,
            sources: vec!["192.0.2.50".parse().unwrap()],
            ports: 1,
            errors: vec!["no".to_owned()],
        };
        let out = format!("abort\n{}\n", serde_json::to_string(&s).unwrap());
        assert_eq!(Summary::find_in(&out).unwrap(), s);
    }

    /// The peer of a reset socket reads ECONNRESET, not EOF: the close was abortive.
    #[test]
    fn reset_sends_a_rst() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        reset(s).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0; 8];
        let e = io::Read::read(&mut &c, &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
    }
}
