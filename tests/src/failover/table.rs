//! `cargo xtask lab --failover`: the cases as a table, per kind over rounds, a legend.

use std::net::SocketAddr;

use anyhow::{Context as _, Result};

use super::{CaseReport, Kind, POD, Target, TcpVerdict, Timing, gateways, run_case, wait_steady};
use crate::lab::{Lab, addr};

impl CaseReport {
    pub fn header() -> String {
        columns(&[
            "kind",
            "move",
            "detect_ms",
            "udp_back_ms",
            "udp_gap_ms",
            "tcp_gap_ms",
            "tcp",
            "ping_lost",
            "2holders_s",
            "end",
            "notes",
        ])
    }

    pub fn row(&self) -> String {
        let hold = |h: &(String, String)| format!("{}/{}", h.0, h.1);
        let lost = self.ping.sent.saturating_sub(self.ping.received);
        columns(&[
            self.kind.name(),
            &format!(
                "{} -> {}",
                hold(&self.old),
                self.new.as_ref().map_or("-".to_owned(), hold)
            ),
            &ms(self.detection_ms),
            &self.udp_back().to_string(),
            &self.udp.longest_gap_ms.to_string(),
            &self.tcp.longest_gap_ms.to_string(),
            &self.tcp_verdict().to_string(),
            &format!("{lost}/{}", self.ping.sent),
            &format!("{:.2}", self.two_holders_ms as f64 / 1000.0),
            &if self.end_holders.is_empty() {
                "-".to_owned()
            } else {
                self.end_holders
                    .iter()
                    .map(hold)
                    .collect::<Vec<_>>()
                    .join(",")
            },
            &self.notes.join("; "),
        ])
    }
}

fn ms(v: Option<u64>) -> String {
    v.map_or("-".to_owned(), |v| v.to_string())
}

fn columns(cells: &[&str]) -> String {
    const WIDTHS: [usize; 10] = [17, 24, 9, 11, 10, 10, 7, 9, 10, 10];
    let mut out = String::new();
    for (i, c) in cells.iter().enumerate() {
        match WIDTHS.get(i) {
            Some(w) => out.push_str(&format!("{c:<w$} ")),
            None => out.push_str(c),
        }
    }
    out.trim_end().to_owned()
}

/// `cargo xtask lab --failover`: every kind, `rounds` times, one row per case, then per
/// kind a summary (with more than one round) and a legend. `Ok(false)` if a TCP stream
/// did not survive, two gateways held the IP for more than a second, or a case failed.
pub fn run_table(lab: &mut Lab, rounds: u32, timing: &Timing) -> Result<bool> {
    let target = Target::of(lab.family());
    wait_steady(lab, &target, timing).context("the lab is not steady before the first case")?;
    println!(
        "failover of {} (pod {POD} -> {}: TCP and UDP streams and ping every {} ms)\n",
        target.egress,
        SocketAddr::new(target.host, addr::ECHO_PORT),
        timing.interval.as_millis()
    );
    println!("{}", CaseReport::header());
    let mut reports = Vec::new();
    let mut ok = true;
    for round in 1..=rounds {
        for kind in Kind::ALL {
            let label = format!("failover-{round}-{kind}");
            match run_case(lab, kind, timing, &label) {
                Ok(r) => {
                    println!("{}", r.row());
                    ok &= r.ok();
                    reports.push(r);
                }
                Err(e) => {
                    println!("{kind:<17} ERROR: {e:#}");
                    for gw in gateways() {
                        println!("--- agent log {gw} (tail) ---");
                        let log = lab.agent_log(gw);
                        let lines: Vec<&str> = log.lines().collect();
                        for l in &lines[lines.len().saturating_sub(12)..] {
                            println!("{l}");
                        }
                    }
                    return Ok(false);
                }
            }
        }
    }
    if rounds > 1 {
        println!("\n{}", per_kind(&reports));
    }
    println!("\n{}", legend(&target));
    println!(
        "{}",
        if ok {
            "every TCP stream survived; never two holders for more than 1 s"
        } else {
            "FAILED: a TCP stream did not survive, or two gateways held the IP for more than 1 s"
        }
    );
    Ok(ok)
}

/// Per kind over the rounds: TCP survived k/N, the worst UDP gap, detection, two holders.
pub fn per_kind(reports: &[CaseReport]) -> String {
    let mut out = format!(
        "{:<17} {:<12} {:<14} {:<15} {}\n",
        "kind", "tcp_survived", "max_udp_gap_ms", "max_detect_ms", "max_2holders_s"
    );
    for kind in Kind::ALL {
        let rs: Vec<&CaseReport> = reports.iter().filter(|r| r.kind == kind).collect();
        if rs.is_empty() {
            continue;
        }
        let survived = rs
            .iter()
            .filter(|r| r.tcp_verdict() == TcpVerdict::Survived)
            .count();
        let detect: Vec<u64> = rs.iter().filter_map(|r| r.detection_ms).collect();
        let detect = match (detect.iter().max(), rs.len() - detect.len()) {
            (None, _) => "-".to_owned(),
            (Some(m), 0) => m.to_string(),
            (Some(m), missing) => format!("{m} ({missing} without)"),
        };
        out.push_str(&format!(
            "{:<17} {:<12} {:<14} {:<15} {:.2}\n",
            kind.name(),
            format!("{survived}/{}", rs.len()),
            rs.iter().map(|r| r.udp.longest_gap_ms).max().unwrap_or(0),
            detect,
            rs.iter().map(|r| r.two_holders_ms).max().unwrap_or(0) as f64 / 1000.0,
        ));
    }
    out.trim_end().to_owned()
}

fn legend(target: &Target) -> String {
    let mut out = format!(
        "legend (T: the failure; times in ms from T unless said otherwise)
  move         holder of {ip} before T -> first other gateway seen holding it after T
  detect_ms    T -> the new holder's agent logged \"holding egress IP\" (-: no new holder)
  udp_back_ms  T -> the UDP reply that ended the worst gap after T (no gap: never two
               replies missing in a row; never: no reply in the last 0.5 s)
  udp_gap_ms   longest time without a UDP reply over the whole case (~20: no gap)
  tcp_gap_ms   the same for the TCP stream (retransmission backoff stretches outages)
  tcp          yes: never reset and delivering at the end; stalled: not reset, but nothing
               delivered at the end (after up to {grace} s of grace); reset: ECONNRESET,
               EPIPE or EOF (the client never reconnects)
  ping_lost    echo requests without a reply / sent
  2holders_s   seconds with {ip} on an up interface of both gateways (sampled
               every 20 ms)
  end          holders when the flows stopped
  notes        holder changes (@ ms from T), UDP source changes, TCP errors, agents that
               exited; \"host stall\": the control flow (UDP to host C, through no gateway)
               had a gap too: the machine, not the failover, stalled the flows;
               \"neighbour\": after the recovery, a host or router on A or B (which keep
               entries for hours, as switches do) still pointed the egress IP at a MAC
               that is not its holder's: an outage until the next announcement
kinds (what happens at T to the holder; how the lab recovers after the case)
",
        ip = target.egress,
        grace = Timing::default().stall_grace.as_secs(),
    );
    for kind in Kind::ALL {
        out.push_str(&format!("  {:<17} {}\n", kind.name(), kind.what()));
    }
    out.trim_end().to_owned()
}
