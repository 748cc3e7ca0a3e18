//! Failover in the bench: the lab's failover runner (`egress_tests::failover`, the same as
//! `cargo xtask lab --failover`) over a few rounds, reported against issue 10's targets:
//! a silent death's first packet through the new holder and UDP gap within 1 s, a
//! NotReady or planned move's gap within 300 ms, no broken TCP stream, no time with two
//! holders.

use anyhow::Result;

use super::report::Table;
use crate::{
    cluster,
    failover::{self, CaseReport, Kind, TcpVerdict, Timing},
    lab::LabSpec,
    stream::Recovery,
};

/// The gap target of each kind, in ms (`None`: no move expected, no target).
fn gap_target(kind: Kind) -> Option<u64> {
    match kind {
        Kind::NotReady | Kind::Drain => Some(300),
        Kind::GatewayPartition => None,
        _ => Some(1000),
    }
}

/// Run every kind `rounds` times on a fresh lab and tabulate the worst of each.
pub fn table(spec: LabSpec, rounds: u32) -> Result<Table> {
    let mut lab = cluster::up_with_agents(spec)?;
    let timing = Timing::default();
    let mut reports: Vec<CaseReport> = Vec::new();
    for round in 1..=rounds {
        for kind in Kind::ALL {
            reports.push(failover::run_case(
                &mut lab,
                kind,
                &timing,
                &format!("bench-{round}-{kind}"),
            )?);
        }
    }
    let mut rows = Vec::new();
    for kind in Kind::ALL {
        let rs: Vec<&CaseReport> = reports.iter().filter(|r| r.kind == kind).collect();
        let survived = rs
            .iter()
            .filter(|r| r.tcp_verdict() == TcpVerdict::Survived)
            .count();
        let worst = |f: &dyn Fn(&CaseReport) -> Option<u64>| rs.iter().filter_map(|r| f(r)).max();
        let first_packet = worst(&|r| match r.udp_back() {
            Recovery::Unbroken => Some(0),
            Recovery::After(ms) => Some(ms),
            Recovery::Never => Some(u64::MAX),
        });
        let udp_gap = worst(&|r| Some(r.udp.longest_gap_ms));
        let detection = worst(&|r| r.detection_ms);
        let two = worst(&|r| Some(r.two_holders_ms)).unwrap_or(0);
        let fmt = |v: Option<u64>| match v {
            None => "-".to_owned(),
            Some(u64::MAX) => "never".to_owned(),
            Some(v) => v.to_string(),
        };
        let verdict = match gap_target(kind) {
            Some(t) if udp_gap.is_some_and(|g| g <= t) && survived == rs.len() && two == 0 => {
                format!("<= {t} ms: met")
            }
            Some(t) => format!("<= {t} ms: missed"),
            None if survived == rs.len() && two == 0 => "no move, one holder: met".to_owned(),
            None => "no move, one holder: missed".to_owned(),
        };
        rows.push(vec![
            kind.name().to_owned(),
            fmt(detection),
            fmt(first_packet),
            fmt(udp_gap),
            format!("{survived}/{}", rs.len()),
            format!("{:.2}", two as f64 / 1000.0),
            verdict,
        ]);
    }
    Ok(Table {
        title: "Failover".to_owned(),
        intro: vec![format!(
            "The lab's failover runner (`cargo xtask lab --failover`, tests/src/failover): pod \
             w1-p1 streams TCP and UDP (a line every 20 ms, never reconnecting) and pings \
             through the holder of egress IP A, which fails in each way; {rounds} round(s), \
             the worst of each kind. Default probe settings (100 ms, 3 misses). *detection*: \
             the failure to the new holder's `holding egress IP` log line; *UDP back*: the \
             failure to the reply that ended the worst UDP gap (0: no gap); *two holders*: \
             time with the address on two gateways' up interfaces (sampled every 20 ms)."
        )],
        header: [
            "kind",
            "detection ms",
            "UDP back ms",
            "UDP gap ms",
            "TCP survived",
            "two holders s",
            "target (gap, streams, holders)",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect(),
        rows,
        notes: vec![
            "Silent death: agent SIGKILLed and links down, Node still Ready; underlay cut: the \
             holder's underlay link down, its agent running; secondary cut: the link that \
             carries the IP; gateway partition: the gateways cannot reach each other (no move \
             expected); drain: `egress.dev/drain: \"true\"`."
                .to_owned(),
        ],
    })
}
