//! The agent's HTTP endpoints, on hyper: `/metrics`, `/status`, `/healthz` and `/readyz`.
//!
//! `GET` and `HEAD` only (anything else: 405 with `Allow`); at most [`MAX_CONNECTIONS`]
//! connections at once (more wait to be accepted), the request head within
//! [`HEAD_TIMEOUT`] and [`MAX_HEAD_BYTES`]; one request per connection. `/metrics` is
//! OpenMetrics text for a client that accepts it (Prometheus asks for it), else the
//! Prometheus text format 0.0.4 ([`metrics::text_004`]). With [`TlsFiles`], HTTPS, and
//! client certificates for `/metrics` and `/status` ([`tls`]).

pub mod tls;

use std::{
    convert::Infallible,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    Method, Request, Response, StatusCode,
    header::{ACCEPT, ALLOW, CONTENT_TYPE, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    net::{TcpListener, UnixListener},
    sync::Semaphore,
};
use tokio_rustls::TlsAcceptor;

pub use self::tls::TlsFiles;
use crate::metrics::{self, Cached, MAP_STATS_INTERVAL, MapStats, Stats};

/// Connections served at once; further ones wait in the listen queue.
pub const MAX_CONNECTIONS: usize = 64;
/// The request line and headers must arrive within this.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// The most bytes of request head read (hyper's minimum buffer); a larger head gets 431.
pub const MAX_HEAD_BYTES: usize = 8192;

/// The OpenMetrics text content type.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The Prometheus text format's content type.
pub const TEXT_004: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What the handlers read.
struct Context {
    pin_dir: PathBuf,
    stats: Arc<Mutex<Stats>>,
    maps: Cached<MapStats>,
}

impl Context {
    fn shared(pin_dir: PathBuf, stats: Arc<Mutex<Stats>>) -> Arc<Self> {
        Arc::new(Context {
            pin_dir,
            stats,
            maps: Cached::new(MAP_STATS_INTERVAL),
        })
    }
}

/// What a connection may read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    All,
    /// A TLS client without a certificate where one is required: `/healthz` and
    /// `/readyz` only.
    ProbesOnly,
}

/// Serve the endpoints on `addr` in the background, over TLS when `tls` names the files;
/// returns the bound address (the real port when `addr` asks for port 0), which it logs.
pub async fn serve(
    addr: SocketAddr,
    pin_dir: PathBuf,
    stats: Arc<Mutex<Stats>>,
    tls: Option<TlsFiles>,
) -> anyhow::Result<SocketAddr> {
    let tls = tls
        .map(|files| tls::Reloading::start(files, tls::RELOAD))
        .transpose()?;
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let scheme = match &tls {
        None => "http",
        Some(t) if t.needs_client_certificate() => "https, client certificates for /metrics",
        Some(_) => "https",
    };
    tracing::info!(addr = %bound, scheme, "serving /metrics, /status, /healthz and /readyz");
    let cx = Context::shared(pin_dir, stats);
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return;
            };
            let Ok((sock, _)) = listener.accept().await else {
                continue;
            };
            let (cx, tls) = (cx.clone(), tls.clone());
            tokio::spawn(async move {
                let _permit = permit;
                let Some(tls) = tls else {
                    return connection(TokioIo::new(sock), cx, Access::All).await;
                };
                let accepted = tokio::time::timeout(
                    HEAD_TIMEOUT,
                    TlsAcceptor::from(tls.current()).accept(sock),
                )
                .await;
                let stream = match accepted {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => return tracing::debug!("a TLS handshake failed: {e}"),
                    Err(_) => return tracing::debug!("a TLS handshake timed out"),
                };
                let certified = stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .is_some_and(|c| !c.is_empty());
                let access = if certified || !tls.needs_client_certificate() {
                    Access::All
                } else {
                    Access::ProbesOnly
                };
                connection(TokioIo::new(stream), cx, access).await;
            });
        }
    });
    Ok(bound)
}

/// The default `--status-socket`: in the DaemonSet's `/run/egress-agent` (the pin lock's
/// directory), where `kubectl exec ... egress-agent status` finds it.
pub const DEFAULT_STATUS_SOCKET: &str = "/run/egress-agent/status.sock";

/// Serve the same endpoints on a Unix socket at `path` in the background, for
/// `egress-agent status` on the node: plain HTTP whatever `--metrics-addr` speaks, with
/// no client certificate (the socket is its owner's only, mode 0600). A file left there
/// by an agent that is gone is replaced; a socket that still answers is not taken.
pub async fn serve_unix(
    path: &Path,
    pin_dir: PathBuf,
    stats: Arc<Mutex<Stats>>,
) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        anyhow::bail!(
            "{} is served by another process (another agent?): give this one its own \
             --status-socket",
            path.display()
        );
    }
    match std::fs::remove_file(path) {
        Ok(()) => tracing::debug!(path = %path.display(), "replaced a stale status socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => anyhow::bail!("failed to remove the stale {}: {e}", path.display()),
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("failed to create {}: {e}", dir.display()))?;
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| anyhow::anyhow!("failed to bind {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| anyhow::anyhow!("failed to make {} its owner's only: {e}", path.display()))?;
    tracing::info!(path = %path.display(), "serving /status and /metrics on a Unix socket");
    let cx = Context::shared(pin_dir, stats);
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return;
            };
            let Ok((sock, _)) = listener.accept().await else {
                continue;
            };
            let cx = cx.clone();
            tokio::spawn(async move {
                let _permit = permit;
                connection(TokioIo::new(sock), cx, Access::All).await;
            });
        }
    });
    Ok(())
}

/// Serve one connection: one request, its head bounded in size and time.
async fn connection<I>(io: I, cx: Arc<Context>, access: Access)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let service = service_fn(move |req| handle(req, cx.clone(), access));
    let served = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES)
        .keep_alive(false)
        .serve_connection(io, service)
        .await;
    if let Err(e) = served {
        tracing::debug!("an endpoint connection failed: {e}");
    }
}

/// One request.
async fn handle<B>(
    req: Request<B>,
    cx: Arc<Context>,
    access: Access,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET or HEAD only\n",
        );
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Ok(r);
    }
    if access == Access::ProbesOnly && matches!(req.uri().path(), "/metrics" | "/status") {
        return Ok(reply(
            StatusCode::UNAUTHORIZED,
            "text/plain; charset=utf-8",
            "a client certificate signed by a CA of --metrics-client-ca-file is required\n",
        ));
    }
    let snapshot = cx.stats.lock().map(|s| s.clone()).unwrap_or_default();
    let plain = "text/plain; charset=utf-8";
    let r = match req.uri().path() {
        "/metrics" => {
            let pin_dir = cx.pin_dir.clone();
            let read = cx.maps.get(move || MapStats::read(&pin_dir)).await;
            let body = metrics::render(&read.unwrap_or_default(), &snapshot);
            if accepts_openmetrics(req.headers().get(ACCEPT)) {
                reply(StatusCode::OK, OPENMETRICS, body)
            } else {
                reply(StatusCode::OK, TEXT_004, metrics::text_004(&body))
            }
        }
        "/status" => reply(StatusCode::OK, plain, metrics::status_text(&snapshot)),
        "/healthz" => reply(StatusCode::OK, plain, "ok\n"),
        "/readyz" if snapshot.ready => reply(StatusCode::OK, plain, "ready\n"),
        "/readyz" => reply(StatusCode::SERVICE_UNAVAILABLE, plain, "not ready\n"),
        _ => reply(StatusCode::NOT_FOUND, plain, "not found\n"),
    };
    Ok(r)
}

/// Whether an `Accept` header asks for OpenMetrics text (at a weight above zero).
fn accepts_openmetrics(accept: Option<&HeaderValue>) -> bool {
    let Some(text) = accept.and_then(|a| a.to_str().ok()) else {
        return false;
    };
    text.split(',').any(|part| {
        let mut fields = part.split(';').map(str::trim);
        let kind = fields.next().unwrap_or_default();
        let refused = fields.any(|f| {
            f.strip_prefix("q=")
                .and_then(|q| q.parse::<f32>().ok())
                .is_some_and(|q| q <= 0.0)
        });
        kind.eq_ignore_ascii_case("application/openmetrics-text") && !refused
    })
}

fn reply(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// One raw HTTP/1.1 exchange with `addr`: the response, whole.
    async fn exchange(addr: SocketAddr, request: &str) -> String {
        let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
        sock.write_all(request.as_bytes()).await.expect("write");
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), sock.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    async fn server() -> SocketAddr {
        let stats = Arc::new(Mutex::new(Stats {
            ready: true,
            ..Stats::default()
        }));
        let dir = std::env::temp_dir().join("egress-endpoints-test-none");
        serve("127.0.0.1:0".parse().expect("addr"), dir, stats, None)
            .await
            .expect("bind")
    }

    #[tokio::test]
    async fn the_status_socket_is_its_owners_replaces_a_stale_file_and_takes_no_live_one() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("egress-status-sock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("run").join("status.sock");
        let stats = || {
            Arc::new(Mutex::new(Stats {
                ready: true,
                ..Stats::default()
            }))
        };
        // A stale socket file: bound once, its listener gone.
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        serve_unix(&path, dir.clone(), stats())
            .await
            .expect("serve");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        let mut sock = tokio::net::UnixStream::connect(&path)
            .await
            .expect("connect");
        sock.write_all(b"GET /status HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), sock.read_to_end(&mut out)).await;
        let out = String::from_utf8_lossy(&out);
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        // A second agent on the same path is refused: the first one answers there.
        let e = serve_unix(&path, dir.clone(), stats())
            .await
            .expect_err("a live socket is not taken");
        assert!(e.to_string().contains("--status-socket"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn metrics_as_the_client_asks_methods_checked_heads_bounded() {
        let addr = server().await;
        assert_ne!(addr.port(), 0, "the bound port is returned for port 0");
        let om = exchange(
            addr,
            "GET /metrics HTTP/1.1\r\nhost: x\r\naccept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n\r\n",
        )
        .await;
        assert!(om.starts_with("HTTP/1.1 200 OK"), "{om}");
        assert!(
            om.to_lowercase()
                .contains(&format!("content-type: {OPENMETRICS}")),
            "{om}"
        );
        assert!(om.contains("# TYPE egress_reconciles"), "{om}");
        assert!(om.trim_end().ends_with("# EOF"), "{om}");
        let text = exchange(
            addr,
            "GET /metrics HTTP/1.1\r\nhost: x\r\naccept: */*\r\n\r\n",
        )
        .await;
        assert!(
            text.to_lowercase()
                .contains(&format!("content-type: {TEXT_004}")),
            "{text}"
        );
        assert!(!text.contains("# EOF"), "{text}");
        let post = exchange(
            addr,
            "POST /metrics HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
        )
        .await;
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        assert!(post.to_lowercase().contains("allow: get, head"), "{post}");
        let big = format!(
            "GET /healthz HTTP/1.1\r\nhost: x\r\nx-pad: {}\r\n\r\n",
            "a".repeat(MAX_HEAD_BYTES * 2)
        );
        let refused = exchange(addr, &big).await;
        assert!(refused.starts_with("HTTP/1.1 431"), "{refused:.200}");
        let ready = exchange(addr, "GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n").await;
        assert!(
            ready.starts_with("HTTP/1.1 200 OK") && ready.ends_with("ready\n"),
            "{ready}"
        );
        let missing = exchange(addr, "GET /nothing HTTP/1.1\r\nhost: x\r\n\r\n").await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
    }

    /// One HTTPS exchange with `addr`, trusting `ca`, presenting `client` (certificate and
    /// key PEM) if given: the response, or the handshake's error.
    async fn exchange_tls(
        addr: SocketAddr,
        ca: &tls::tests::Ca,
        client: Option<(String, String)>,
        request: &str,
    ) -> Result<String, std::io::Error> {
        use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject as _};
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.der()).expect("root");
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
        let config = match client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
                    .collect::<Result<Vec<_>, _>>()
                    .expect("chain");
                let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).expect("key");
                builder.with_client_auth_cert(chain, key).expect("client")
            }
        };
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = ServerName::try_from("127.0.0.1").expect("name");
        let mut sock = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await?;
        sock.write_all(request.as_bytes()).await?;
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), sock.read_to_end(&mut out)).await;
        if let Ok(Err(e)) = read
            && out.is_empty()
        {
            return Err(e);
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    /// Over TLS with a client CA: the probes answer anyone, `/metrics` and `/status` only a
    /// client with a certificate of that CA (401 without one; another CA's fails the
    /// handshake); plain HTTP gets no answer.
    #[tokio::test]
    async fn tls_with_client_certificates_for_metrics_and_open_probes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (server_ca, client_ca, stranger) = (
            tls::tests::Ca::new("server CA"),
            tls::tests::Ca::new("client CA"),
            tls::tests::Ca::new("another CA"),
        );
        let files = tls::tests::write_files(dir.path(), &server_ca, Some(&client_ca));
        let stats = Arc::new(Mutex::new(Stats {
            ready: true,
            ..Stats::default()
        }));
        let addr = serve(
            "127.0.0.1:0".parse().expect("addr"),
            dir.path().join("no-pins"),
            stats,
            Some(files),
        )
        .await
        .expect("serve");
        let get = |path: &str| format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n");
        let probe = exchange_tls(addr, &server_ca, None, &get("/readyz"))
            .await
            .expect("probe");
        assert!(probe.starts_with("HTTP/1.1 200 OK"), "{probe}");
        for path in ["/metrics", "/status"] {
            let refused = exchange_tls(addr, &server_ca, None, &get(path))
                .await
                .expect("refused");
            assert!(refused.starts_with("HTTP/1.1 401"), "{path}: {refused}");
        }
        let scraper = client_ca.issue("prometheus", true);
        let scraped = exchange_tls(addr, &server_ca, Some(scraper), &get("/metrics"))
            .await
            .expect("scrape");
        assert!(
            scraped.starts_with("HTTP/1.1 200 OK") && scraped.contains("egress_reconciles_total"),
            "{scraped:.300}"
        );
        let forged = stranger.issue("prometheus", true);
        let answer = exchange_tls(addr, &server_ca, Some(forged), &get("/metrics")).await;
        assert!(
            !answer.as_ref().is_ok_and(|a| a.contains("200 OK")),
            "another CA's client was served: {answer:?}"
        );
        let plain = exchange(addr, &get("/metrics")).await;
        assert!(!plain.contains("200 OK"), "{plain}");
    }

    #[test]
    fn openmetrics_is_asked_for_by_name_at_a_weight_above_zero() {
        let h = |s: &'static str| Some(HeaderValue::from_static(s));
        assert!(accepts_openmetrics(
            h("application/openmetrics-text; version=1.0.0").as_ref()
        ));
        assert!(accepts_openmetrics(
            h("text/plain;version=0.0.4;q=0.5,application/OpenMetrics-Text;q=0.9").as_ref()
        ));
        assert!(!accepts_openmetrics(
            h("application/openmetrics-text;q=0").as_ref()
        ));
        assert!(!accepts_openmetrics(h("*/*").as_ref()));
        assert!(!accepts_openmetrics(None));
    }
}
