//! Lab sections of the report: throughput, new flows per second and control-plane
//! numbers, ours next to the kernel baseline (issue 7). Each section is a function of a
//! running [`Lab`] (`None`: no lab in this run); until the measurements are written,
//! every row says [`NOT_MEASURED`].
//!
//! The baseline (what OVN-Kubernetes does for EgressIP on secondary host networks):
//! traffic steered to the gateway node, one `ip rule from <pod IP> lookup <table>` per
//! served pod on the gateway, SNAT by an nftables map keyed by (source, output interface).

use anyhow::Result;

use super::{
    Plan,
    report::{NOT_MEASURED, Table, thousands},
};
use crate::lab::Lab;

/// Served-pod counts the throughput and new-flow sections compare.
pub const SERVED_PODS: [u32; 2] = [1, 10_000];

fn header(cols: &[&str]) -> Vec<String> {
    cols.iter().map(|c| (*c).to_owned()).collect()
}

fn not_measured_row(metric: String, cols: usize) -> Vec<String> {
    let mut row = vec![metric];
    row.extend((1..cols).map(|_| NOT_MEASURED.to_owned()));
    row
}

fn why(lab: Option<&Lab>) -> String {
    match lab {
        None => "No lab was started in this run.".to_owned(),
        Some(_) => "The lab measurement is not implemented yet.".to_owned(),
    }
}

/// TCP (iperf3, Gbit/s) and 64-byte UDP (packets/s) from a pod on a worker to a host
/// behind a gateway, ours and the baseline, at 1 and 10k served pods.
pub fn throughput(lab: Option<&Lab>, _plan: &Plan) -> Result<Table> {
    let cols = header(&[
        "traffic",
        "served pods",
        "ours",
        "baseline (ip rule + nftables)",
        "ours / baseline",
        "target (issue 7)",
    ]);
    let mut rows = Vec::new();
    for (traffic, unit) in [("TCP, iperf3", "Gbit/s"), ("UDP, 64-byte", "packets/s")] {
        for pods in SERVED_PODS {
            let mut row = not_measured_row(format!("{traffic} ({unit})"), cols.len());
            row[1] = thousands(u64::from(pods));
            row[5] = if pods == 1 {
                ">= 1.0x baseline".to_owned()
            } else {
                ">= 8x baseline, within 10% of our 1-pod figure".to_owned()
            };
            rows.push(row);
        }
    }
    Ok(Table {
        title: "Throughput in the lab".to_owned(),
        intro: vec![why(lab)],
        header: cols,
        rows,
        notes: vec![],
    })
}

/// New flows per second through the gateway, ours and the baseline.
pub fn new_flows(lab: Option<&Lab>, _plan: &Plan) -> Result<Table> {
    let cols = header(&[
        "metric",
        "served pods",
        "ours",
        "baseline",
        "ours / baseline",
    ]);
    let rows = SERVED_PODS
        .iter()
        .map(|pods| {
            let mut row = not_measured_row("new flows/s through the gateway".into(), cols.len());
            row[1] = thousands(u64::from(*pods));
            row
        })
        .collect();
    Ok(Table {
        title: "New flows per second".to_owned(),
        intro: vec![why(lab)],
        header: cols,
        rows,
        notes: vec![],
    })
}

/// Change-to-map latency (p50, p99), full compile and apply at 10k pods x 10 prefixes,
/// agent peak RSS.
pub fn control_plane(lab: Option<&Lab>, _plan: &Plan) -> Result<Table> {
    let cols = header(&["metric", "value"]);
    let rows = [
        "change-to-map latency, p50",
        "change-to-map latency, p99",
        "full compile + apply, 10k pods x 10 prefixes",
        "agent peak RSS",
    ]
    .iter()
    .map(|m| not_measured_row((*m).to_owned(), cols.len()))
    .collect();
    Ok(Table {
        title: "Control plane".to_owned(),
        intro: vec![why(lab)],
        header: cols,
        rows,
        notes: vec![],
    })
}
