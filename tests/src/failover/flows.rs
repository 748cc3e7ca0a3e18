//! The pod's flows during a case, and what they saw: TCP, UDP and ping through the holder,
//! and a control flow that no gateway carries (a host stall shows there too).

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use anyhow::{Context as _, Result};

use super::{POD, STALLED_AFTER_MS, Target, Timing};
use crate::{
    lab::{Lab, addr},
    netns::NsChild,
    stream::{Summary, unix_ms},
};

/// The running flows: `egress-echo stream tcp|udp` and `ping -D` to the target host, and
/// `egress-echo stream udp` to the control host.
pub(super) struct Flows {
    tcp: Flow,
    udp: Flow,
    ping: Flow,
    control: Flow,
    /// The TCP stream's events (`<unix ms> send|reply|reset|error ...`), read while it runs.
    tcp_events: PathBuf,
    start_unix_ms: u64,
}

/// What the flows saw.
pub(super) struct Seen {
    pub(super) tcp: Summary,
    pub(super) udp: Summary,
    pub(super) ping: Summary,
    pub(super) control: Summary,
}

/// A flow's process and its output (stdout and stderr).
struct Flow {
    child: NsChild,
    log: PathBuf,
}

/// What the TCP stream's events file says so far.
pub(super) struct Progress {
    pub(super) last_reply: Option<u64>,
    broken: bool,
}

impl Progress {
    /// Not broken, but no reply lately.
    pub(super) fn stalled(&self) -> bool {
        !self.broken
            && self
                .last_reply
                .is_none_or(|l| l + STALLED_AFTER_MS / 2 < unix_ms())
    }
}

impl Flows {
    pub(super) fn start(lab: &Lab, target: &Target, timing: &Timing, label: &str) -> Result<Self> {
        let ns = lab.ns(POD)?;
        let interval = timing.interval.as_millis().to_string();
        let path = |what: &str| lab.dir().join(format!("{label}-{what}"));
        let stream = |proto: &str, host: IpAddr, name: &str| -> Result<Flow> {
            let log = path(&format!("{name}.log"));
            let events = path(&format!("{name}.events"));
            let args = [
                "stream",
                proto,
                &SocketAddr::new(host, addr::ECHO_PORT).to_string(),
                "--interval-ms",
                &interval,
                // A cap only: the runner stops the flows.
                "--duration-ms",
                "120000",
                "--events",
                &events.to_string_lossy(),
            ];
            let child = ns.spawn(&lab.spec().echo_bin, &args, &log)?;
            Ok(Flow { child, log })
        };
        let start_unix_ms = unix_ms();
        let tcp = stream("tcp", target.host, "tcp")?;
        let udp = stream("udp", target.host, "udp")?;
        let control = stream("udp", target.control_host, "control")?;
        let family = if target.host.is_ipv6() { "-6" } else { "-4" };
        let secs = format!("{:.3}", timing.interval.as_secs_f64());
        let log = path("ping.log");
        let args = [family, "-n", "-D", "-i", &secs, &target.host.to_string()];
        let ping = Flow {
            child: ns.spawn("ping", &args, &log)?,
            log,
        };
        Ok(Self {
            tcp,
            udp,
            ping,
            control,
            tcp_events: path("tcp.events"),
            start_unix_ms,
        })
    }

    pub(super) fn tcp_progress(&self) -> Progress {
        let text = std::fs::read_to_string(&self.tcp_events).unwrap_or_default();
        let mut p = Progress {
            last_reply: None,
            broken: false,
        };
        for line in text.lines() {
            let mut w = line.split_whitespace();
            match (w.next().and_then(|t| t.parse::<u64>().ok()), w.next()) {
                (Some(at), Some("reply")) => p.last_reply = Some(at),
                (Some(_), Some("reset" | "error")) => p.broken = true,
                _ => {}
            }
        }
        p
    }

    /// Stop them all at once and read what they saw.
    pub(super) fn stop(mut self) -> Result<Seen> {
        self.tcp.child.signal_term();
        self.udp.child.signal_term();
        self.control.child.signal_term();
        self.ping.child.send_signal(libc::SIGINT);
        let end = unix_ms();
        for f in [
            &mut self.tcp,
            &mut self.udp,
            &mut self.control,
            &mut self.ping,
        ] {
            // Its summary written and flushed: seconds on an idle machine, more in an
            // emulated guest (EGRESS_TEST_TIME_SCALE).
            let grace = Duration::from_secs(3) * crate::cluster::time_scale();
            if f.child.wait_for(grace)?.is_none() {
                f.child.terminate(Duration::ZERO);
            }
        }
        let read = |f: &Flow| std::fs::read_to_string(&f.log).unwrap_or_default();
        Ok(Seen {
            tcp: Summary::find_in(&read(&self.tcp)).context("the TCP stream")?,
            udp: Summary::find_in(&read(&self.udp)).context("the UDP stream")?,
            ping: Summary::from_ping(&read(&self.ping), self.start_unix_ms, end),
            control: Summary::find_in(&read(&self.control)).context("the control stream")?,
        })
    }
}
