//! What the far hosts receive: `tcpdump` on host-a, host-b and host-c, every IP packet
//! addressed to the host, read back every second. A packet from any source but the ones
//! expected at that host (the egress IP of its network; at host-c the unselected pods that
//! talk to it) is a violation.

use std::{
    io::{Read as _, Seek as _, SeekFrom},
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    time::Duration,
};

use anyhow::Result;

use crate::{lab::Lab, netns::NsChild};

/// A packet a far host should never have received.
#[derive(Clone, Debug)]
pub struct Violation {
    /// When tcpdump saw it (unix milliseconds).
    pub at_ms: u64,
    pub host: &'static str,
    pub source: IpAddr,
    /// tcpdump's line.
    pub line: String,
    /// The churn event(s) in progress.
    pub during: String,
}

/// One far host's capture.
pub(super) struct Capture {
    pub(super) host: &'static str,
    expected: Vec<IpAddr>,
    child: Option<NsChild>,
    path: PathBuf,
    offset: u64,
    pending: String,
    /// IP packets to the host seen so far.
    pub(super) packets: u64,
    /// What tcpdump said it dropped (read when it stops).
    pub(super) dropped_by_kernel: u64,
}

impl Capture {
    /// `tcpdump -tt` of every IP packet to `dst` on the host's `eth0`.
    pub(super) fn start(
        lab: &Lab,
        host: &'static str,
        dst: Ipv4Addr,
        expected: Vec<IpAddr>,
    ) -> Result<Self> {
        let path = lab.dir().join(format!("soak-{host}.tcpdump"));
        let filter = format!("ip and dst host {dst}");
        let child = lab.ns(host)?.spawn(
            "tcpdump",
            &["-n", "-l", "-tt", "-i", "eth0", &filter],
            &path,
        )?;
        Ok(Self {
            host,
            expected,
            child: Some(child),
            path,
            offset: 0,
            pending: String::new(),
            packets: 0,
            dropped_by_kernel: 0,
        })
    }

    /// Read what tcpdump printed since the last call: the packets from unexpected sources
    /// (`during` names the churn event at a packet's time).
    pub(super) fn poll(&mut self, during: impl Fn(u64) -> String) -> Vec<Violation> {
        let mut fresh = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.path)
            && f.seek(SeekFrom::Start(self.offset)).is_ok()
            && let Ok(n) = f.read_to_string(&mut fresh)
        {
            self.offset += n as u64;
        }
        self.pending.push_str(&fresh);
        let Some(end) = self.pending.rfind('\n') else {
            return Vec::new();
        };
        let complete: String = self.pending.drain(..=end).collect();
        let mut out = Vec::new();
        for line in complete.lines() {
            if let Some(dropped) = line.strip_suffix(" packets dropped by kernel") {
                self.dropped_by_kernel = dropped.trim().parse().unwrap_or(0);
                continue;
            }
            let Some((at_ms, source)) = parse_line(line) else {
                continue;
            };
            self.packets += 1;
            if !self.expected.contains(&source) {
                out.push(Violation {
                    at_ms,
                    host: self.host,
                    source,
                    line: line.to_owned(),
                    during: during(at_ms),
                });
            }
        }
        out
    }

    /// Stop tcpdump (it prints its statistics on SIGTERM) and read the rest.
    pub(super) fn stop(&mut self, during: impl Fn(u64) -> String) -> Vec<Violation> {
        if let Some(mut c) = self.child.take() {
            c.terminate(Duration::from_secs(2));
        }
        self.pending.push('\n');
        self.poll(during)
    }
}

/// `1700000000.123456 IP 192.168.101.50.40000 > 192.168.101.100.7777: UDP, length 8`:
/// the time in unix milliseconds and the source address (ports come after the fourth dot;
/// ICMP has none).
fn parse_line(line: &str) -> Option<(u64, IpAddr)> {
    let mut w = line.split_whitespace();
    let ts = w.next()?;
    if w.next()? != "IP" {
        return None;
    }
    let src = w.next()?;
    let (secs, frac) = ts.split_once('.')?;
    let ms = secs.parse::<u64>().ok()? * 1000 + frac.get(..3)?.parse::<u64>().ok()?;
    let ip = src.parse::<Ipv4Addr>().ok().or_else(|| {
        let (head, _port) = src.rsplit_once('.')?;
        head.parse().ok()
    })?;
    Some((ms, IpAddr::V4(ip)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcpdump_lines() {
        assert_eq!(
            parse_line(
                "1700000000.123456 IP 192.168.101.50.40000 > 192.168.101.100.7777: UDP, length 8"
            ),
            Some((1_700_000_000_123, "192.168.101.50".parse().unwrap()))
        );
        assert_eq!(
            parse_line(
                "1700000000.500000 IP 10.244.11.12 > 192.168.103.100: ICMP echo request, id 1"
            ),
            Some((1_700_000_000_500, "10.244.11.12".parse().unwrap()))
        );
        assert_eq!(
            parse_line("listening on eth0, link-type EN10MB (Ethernet)"),
            None
        );
        assert_eq!(parse_line("1700000000.500000 ARP, Request who-has"), None);
    }
}
