//! Prometheus metrics (`/metrics`) and health endpoints (`/healthz`, `/readyz`).
//! Counter values are read from the pinned maps at scrape time.

use std::{
    fmt::Write as _,
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpListener,
};

use crate::datapath::dump;

/// What the reconcile loop reports.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub ready: bool,
    pub reconciles: u64,
    pub errors: u64,
    pub problems: usize,
    pub source_errors: usize,
    pub last_reconcile: Duration,
    /// (egress IP, node, interface)
    pub holders: Vec<(String, String, String)>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
    drop: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabels {
    map: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HolderLabels {
    ip: String,
    node: String,
    interface: String,
}

/// The metrics text for one scrape.
pub fn render(pin_dir: &std::path::Path, stats: &Stats) -> String {
    let mut reg = Registry::with_prefix("egress");
    let packets = Family::<ReasonLabels, Counter>::default();
    let bytes = Family::<ReasonLabels, Counter>::default();
    if let Ok(counters) = dump::counters(pin_dir) {
        for (reason, c) in counters {
            let name = egress_common::counters::name(reason).unwrap_or("unknown");
            let l = ReasonLabels {
                reason: name.to_ascii_lowercase(),
                drop: egress_common::counters::is_drop(reason).to_string(),
            };
            packets.get_or_create(&l).inc_by(c.packets);
            bytes.get_or_create(&l).inc_by(c.bytes);
        }
    }
    reg.register("datapath_packets", "Packets by datapath reason", packets);
    reg.register("datapath_bytes", "Bytes by datapath reason", bytes);
    let entries = Family::<MapLabels, Gauge>::default();
    if let Ok(sizes) = dump::sizes(pin_dir) {
        for (map, n) in sizes {
            entries
                .get_or_create(&MapLabels { map: map.into() })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
    reg.register("map_entries", "Entries per BPF map", entries);
    let holders = Family::<HolderLabels, Gauge>::default();
    for (ip, node, interface) in &stats.holders {
        holders
            .get_or_create(&HolderLabels {
                ip: ip.clone(),
                node: node.clone(),
                interface: interface.clone(),
            })
            .set(1);
    }
    reg.register(
        "egress_ip_holder",
        "Which node and interface hold each egress IP",
        holders,
    );
    let g = |v: u64| {
        let g = Gauge::<i64>::default();
        g.set(i64::try_from(v).unwrap_or(i64::MAX));
        g
    };
    reg.register("reconciles", "Reconcile passes", g(stats.reconciles));
    reg.register(
        "reconcile_errors",
        "Failed reconcile passes",
        g(stats.errors),
    );
    reg.register(
        "problems",
        "Problems in the last pass (see log)",
        g(stats.problems as u64),
    );
    reg.register(
        "state_errors",
        "Objects the state source could not parse",
        g(stats.source_errors as u64),
    );
    reg.register(
        "last_reconcile_microseconds",
        "Duration of the last reconcile",
        g(u64::try_from(stats.last_reconcile.as_micros()).unwrap_or(u64::MAX)),
    );
    let mut out = String::new();
    if encode(&mut out, &reg).is_err() {
        let _ = writeln!(out, "# failed to encode metrics");
    }
    out
}

/// Serve metrics and health on `addr` in the background.
pub async fn serve(
    addr: SocketAddr,
    pin_dir: PathBuf,
    stats: Arc<Mutex<Stats>>,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                continue;
            };
            let pin_dir = pin_dir.clone();
            let stats = stats.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let n =
                    match tokio::time::timeout(Duration::from_secs(5), sock.read(&mut buf)).await {
                        Ok(Ok(n)) => n,
                        _ => return,
                    };
                let req = String::from_utf8_lossy(&buf[..n]);
                let path = req.split_whitespace().nth(1).unwrap_or("/");
                let snapshot = stats.lock().map(|s| s.clone()).unwrap_or_default();
                let (status, body) = match path {
                    "/metrics" => ("200 OK", render(&pin_dir, &snapshot)),
                    "/healthz" => ("200 OK", "ok\n".to_owned()),
                    "/readyz" if snapshot.ready => ("200 OK", "ready\n".to_owned()),
                    "/readyz" => ("503 Service Unavailable", "not ready\n".to_owned()),
                    _ => ("404 Not Found", "not found\n".to_owned()),
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    });
    Ok(())
}
