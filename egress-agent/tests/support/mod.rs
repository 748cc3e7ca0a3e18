//! A fake Kubernetes API server for the tests: a small HTTP/1.1 server on 127.0.0.1 that
//! serves LIST (with a resourceVersion) and WATCH (chunked, newline-delimited JSON events)
//! for the watched kinds and OVN-Kubernetes' `EgressIP`, with a `fieldSelector` of one
//! `path=value` (as `spec.nodeName=<node>`), GET and PATCH of single objects, and POST of
//! events.k8s.io/v1 Events, and that the tests script: send events, end a watch, answer `410 Gone` or
//! `403 Forbidden`, drop the connection mid-chunk, stop serving a collection (a CRD not
//! installed: `404 page not found`, as a real API server answers a path it does not
//! serve). It counts what it sends of each collection ([`Sent`]). Shared by the test
//! crates that talk to an API server (`kube_source`, `explain`, `fan_out`,
//! `import_egressip`), each of which uses part of it.

#![allow(
    dead_code,
    reason = "each test crate that includes this module uses a part of it"
)]

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Output,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use serde_json::{Value, json};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader},
    net::{TcpListener, TcpStream},
    sync::{Notify, mpsc},
    time::timeout,
};

pub const PODS: &str = "/api/v1/pods";
pub const NAMESPACES: &str = "/api/v1/namespaces";
pub const NODES: &str = "/api/v1/nodes";
pub const POLICIES: &str = "/apis/egress.dev/v1alpha1/egressgatewaypolicies";
pub const EGRESS_NODES: &str = "/apis/egress.dev/v1alpha1/egressnodes";
pub const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/default/events";
pub const NETWORK_POLICIES: &str = "/apis/networking.k8s.io/v1/networkpolicies";
/// OVN-Kubernetes' `EgressIP` (cluster-scoped).
pub const EGRESS_IPS: &str = "/apis/k8s.ovn.org/v1/egressips";

/// How long any one expectation may take. Re-lists wait for the watcher's backoff
/// (0.8 s to 1.6 s for a first error), so this leaves ample room.
pub const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// The fake API server

/// What the server does to the open watches of a collection.
pub enum WatchCommand {
    /// Send one event line.
    Event(String),
    /// End the response properly (last chunk): a watch that ends, as at its timeout.
    End,
    /// Write half a chunk, then close the socket.
    Drop,
}

/// An open watch: what it selects, and where its events go.
pub struct Watch {
    pub selector: Option<FieldSelector>,
    pub tx: mpsc::UnboundedSender<WatchCommand>,
}

/// A `fieldSelector` of one `path=value` (`spec.nodeName=node-1`): objects whose field at
/// that dotted path is the string `value`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldSelector {
    pub path: Vec<String>,
    pub value: String,
}

impl FieldSelector {
    /// The selector of a request's query, if it has one; `Err` for one this server does
    /// not serve.
    pub fn of_query(query: &str) -> Result<Option<Self>, String> {
        let Some(raw) = query
            .split('&')
            .find_map(|p| p.strip_prefix("fieldSelector="))
        else {
            return Ok(None);
        };
        let text = percent_decoded(raw);
        if text.is_empty() {
            return Ok(None);
        }
        let (path, value) = text
            .split_once("==")
            .or_else(|| text.split_once('='))
            .filter(|(p, _)| !p.ends_with('!') && !text.contains(','))
            .ok_or_else(|| format!("unsupported fieldSelector {text:?}"))?;
        Ok(Some(Self {
            path: path.split('.').map(str::to_owned).collect(),
            value: value.to_owned(),
        }))
    }

    pub fn matches(&self, object: &Value) -> bool {
        let field = self.path.iter().fold(object, |v, key| &v[key.as_str()]);
        field.as_str() == Some(self.value.as_str())
    }
}

/// `text` with its `%XX` escapes (and `+` for space) decoded.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What the server sent of one collection: its lists' and its watches' JSON (bodies and
/// event lines, without HTTP framing), and the objects in them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    pub lists: usize,
    pub list_bytes: usize,
    pub list_objects: usize,
    pub watch_bytes: usize,
    pub watch_events: usize,
}

impl Sent {
    pub fn bytes(&self) -> usize {
        self.list_bytes + self.watch_bytes
    }

    pub fn objects(&self) -> usize {
        self.list_objects + self.watch_events
    }
}

impl std::ops::AddAssign for Sent {
    fn add_assign(&mut self, o: Self) {
        self.lists += o.lists;
        self.list_bytes += o.list_bytes;
        self.list_objects += o.list_objects;
        self.watch_bytes += o.watch_bytes;
        self.watch_events += o.watch_events;
    }
}

pub struct Collection {
    pub kind: &'static str,
    pub api_version: &'static str,
    /// By `namespace/name` (or `name`).
    pub items: BTreeMap<String, Value>,
    pub watches: Vec<Watch>,
    /// Watch requests answered so far.
    pub watches_started: usize,
    pub lists: usize,
    /// Lists still to answer with `500` (an API server in trouble, a CRD not yet served).
    pub failing_lists: usize,
    /// Every LIST and WATCH answered `403 Forbidden` (RBAC grants the client nothing).
    pub forbidden: bool,
    pub sent: Sent,
}

/// One request the server received (other than LIST and WATCH).
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub query: String,
    pub content_type: String,
    pub body: Value,
}

pub struct State {
    pub resource_version: u64,
    pub collections: BTreeMap<&'static str, Collection>,
    pub recorded: Vec<Recorded>,
}

pub struct Fake {
    pub addr: SocketAddr,
    pub state: Arc<Mutex<State>>,
    /// Notified whenever a watch or list is served.
    pub served: Arc<Notify>,
}

pub fn key_of(object: &Value) -> String {
    let meta = &object["metadata"];
    match meta["namespace"].as_str() {
        Some(ns) => format!("{ns}/{}", meta["name"].as_str().unwrap_or_default()),
        None => meta["name"].as_str().unwrap_or_default().to_owned(),
    }
}

impl State {
    pub fn bump(&mut self) -> String {
        self.resource_version += 1;
        self.resource_version.to_string()
    }

    pub fn collection(&mut self, path: &str) -> &mut Collection {
        self.collections
            .get_mut(path)
            .unwrap_or_else(|| panic!("no collection {path}"))
    }

    /// Stamp `object` with kind, apiVersion and a new resourceVersion.
    pub fn stamp(&mut self, path: &str, mut object: Value) -> Value {
        let rv = self.bump();
        let c = self.collection(path);
        object["kind"] = json!(c.kind);
        object["apiVersion"] = json!(c.api_version);
        object["metadata"]["resourceVersion"] = json!(rv);
        if !object["metadata"]["uid"].is_string() {
            object["metadata"]["uid"] = json!(format!("uid-{}", key_of(&object)));
        }
        object
    }

    pub fn send(&mut self, path: &str, command: impl Fn() -> WatchCommand) {
        self.collection(path)
            .watches
            .retain(|w| w.tx.send(command()).is_ok());
    }

    /// Tell each open watch of `path` that `object` changed from `before` (`None`: it
    /// is new) or was deleted (`deleted`), as that watch's selector sees it: an object
    /// that comes to match is ADDED, one that stops matching DELETED.
    pub fn send_change(
        &mut self,
        path: &str,
        before: Option<&Value>,
        object: &Value,
        deleted: bool,
    ) {
        self.collection(path).watches.retain(|w| {
            let selects = |o: &Value| w.selector.as_ref().is_none_or(|s| s.matches(o));
            let was = before.is_some_and(selects);
            let is = !deleted && selects(object);
            let type_ = match (was, is) {
                (false, false) => return true,
                (false, true) => "ADDED",
                (true, true) => "MODIFIED",
                (true, false) => "DELETED",
            };
            let line = json!({"type": type_, "object": object}).to_string();
            w.tx.send(WatchCommand::Event(line)).is_ok()
        });
    }
}

impl Fake {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let mut collections = BTreeMap::new();
        for (path, kind, api_version) in [
            (PODS, "Pod", "v1"),
            (NAMESPACES, "Namespace", "v1"),
            (NODES, "Node", "v1"),
            (POLICIES, "EgressGatewayPolicy", "egress.dev/v1alpha1"),
            (EGRESS_NODES, "EgressNode", "egress.dev/v1alpha1"),
            (NETWORK_POLICIES, "NetworkPolicy", "networking.k8s.io/v1"),
            (EGRESS_IPS, "EgressIP", "k8s.ovn.org/v1"),
        ] {
            collections.insert(
                path,
                Collection {
                    kind,
                    api_version,
                    items: BTreeMap::new(),
                    watches: Vec::new(),
                    watches_started: 0,
                    lists: 0,
                    failing_lists: 0,
                    forbidden: false,
                    sent: Sent::default(),
                },
            );
        }
        let state = Arc::new(Mutex::new(State {
            resource_version: 100,
            collections,
            recorded: Vec::new(),
        }));
        let served = Arc::new(Notify::new());
        let (s, n) = (state.clone(), served.clone());
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(serve(socket, s.clone(), n.clone()));
            }
        });
        Self {
            addr,
            state,
            served,
        }
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn client(&self) -> kube::Client {
        let url = format!("http://{}", self.addr).parse().expect("url");
        kube::Client::try_from(kube::Config::new(url)).expect("client")
    }

    /// Store `object` without telling the watches (what a re-list will see).
    pub fn put_silently(&self, path: &str, object: Value) {
        let mut s = self.state();
        let object = s.stamp(path, object);
        s.collection(path).items.insert(key_of(&object), object);
    }

    pub fn remove_silently(&self, path: &str, key: &str) {
        self.state().collection(path).items.remove(key);
    }

    /// Store `object` and send ADDED or MODIFIED to the open watches (as their
    /// selectors see it: see [`State::send_change`]).
    pub fn apply(&self, path: &str, object: Value) {
        let mut s = self.state();
        let object = s.stamp(path, object);
        let key = key_of(&object);
        let before = s.collection(path).items.insert(key, object.clone());
        s.send_change(path, before.as_ref(), &object, false);
    }

    /// Remove an object and send DELETED (to the watches that selected it).
    pub fn delete(&self, path: &str, key: &str) {
        let mut s = self.state();
        let Some(mut object) = s.collection(path).items.remove(key) else {
            panic!("no {key} in {path}");
        };
        let before = object.clone();
        object["metadata"]["resourceVersion"] = json!(s.bump());
        s.send_change(path, Some(&before), &object, true);
    }

    /// What the server sent of collection `path` since it started (or the last
    /// [`Fake::reset_sent`]).
    pub fn sent(&self, path: &str) -> Sent {
        self.state().collection(path).sent
    }

    pub fn reset_sent(&self) {
        for c in self.state().collections.values_mut() {
            c.sent = Sent::default();
        }
    }

    /// Answer the open watches with `ERROR 410 Gone`, as when their resourceVersion is
    /// too old.
    pub fn gone(&self, path: &str) {
        let line = json!({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": "too old resource version: 101 (150)",
            "reason": "Expired", "code": 410
        }})
        .to_string();
        let mut s = self.state();
        s.send(path, || WatchCommand::Event(line.clone()));
        s.send(path, || WatchCommand::End);
        s.collection(path).watches.clear();
    }

    pub fn end_watches(&self, path: &str) {
        let mut s = self.state();
        s.send(path, || WatchCommand::End);
        s.collection(path).watches.clear();
    }

    pub fn drop_watches(&self, path: &str) {
        let mut s = self.state();
        s.send(path, || WatchCommand::Drop);
        s.collection(path).watches.clear();
    }

    pub fn fail_lists(&self, path: &str, n: usize) {
        self.state().collection(path).failing_lists = n;
    }

    /// Answer every LIST and WATCH of `path` with `403 Forbidden`, as for a user whose
    /// RBAC grants no `list` on it.
    pub fn forbid(&self, path: &str) {
        self.state().collection(path).forbidden = true;
    }

    /// Stop serving `path`, as a cluster without its CRD: every request for it is
    /// answered `404 page not found`.
    pub fn unserve(&self, path: &str) {
        self.state().collections.remove(path);
    }

    pub fn watches_started(&self, path: &str) -> usize {
        self.state().collection(path).watches_started
    }

    pub fn lists(&self, path: &str) -> usize {
        self.state().collection(path).lists
    }

    /// Wait until at least `n` watches of `path` have been started.
    pub async fn wait_watches(&self, path: &str, n: usize) {
        let waited = timeout(WAIT, async {
            loop {
                let served = self.served.notified();
                if self.watches_started(path) >= n {
                    return;
                }
                served.await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "watch {n} of {path} not started within {WAIT:?} (started: {})",
            self.watches_started(path)
        );
    }

    pub fn recorded(&self) -> Vec<Recorded> {
        self.state().recorded.clone()
    }
}

/// A kubeconfig whose current context is the fake server.
pub fn kubeconfig(fake: &Fake, dir: &Path) -> PathBuf {
    kubeconfig_at(fake.addr, dir)
}

/// A kubeconfig (`dir/kubeconfig`) whose current context is a plain-HTTP API server at
/// `addr`, with no credentials.
pub fn kubeconfig_at(addr: SocketAddr, dir: &Path) -> PathBuf {
    let path = dir.join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
         clusters:\n- name: fake\n  cluster: {{server: \"http://{}\"}}\n\
         users:\n- name: nobody\n  user: {{}}\n\
         contexts:\n- name: fake\n  context: {{cluster: fake, user: nobody}}\n",
        addr
    );
    std::fs::write(&path, text).expect("write kubeconfig");
    path
}

/// Run the binary `bin` (`env!("CARGO_BIN_EXE_...")`) with `args` and `$KUBECONFIG` at
/// `config`, without logs (`RUST_LOG` unset) or a proxy between it and the fake.
pub async fn run_bin(bin: &str, config: &Path, args: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(args)
        .env("KUBECONFIG", config)
        .env_remove("RUST_LOG")
        .kill_on_drop(true);
    for proxy in ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"] {
        cmd.env_remove(proxy);
    }
    timeout(Duration::from_secs(30), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{bin} within the time limit"))
        .unwrap_or_else(|e| panic!("{bin} runs: {e}"))
}

pub async fn write_response(
    socket: &mut TcpStream,
    code: u16,
    body: &Value,
) -> std::io::Result<()> {
    write_text(socket, code, &body.to_string()).await
}

/// Answer with the JSON `body`, already serialized.
pub async fn write_text(socket: &mut TcpStream, code: u16, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    socket.write_all(head.as_bytes()).await?;
    socket.write_all(body.as_bytes()).await?;
    socket.shutdown().await
}

/// What a real API server answers for a path it does not serve (an API group or a
/// resource it does not know, as a CRD not installed): plain text, not a `Status`.
pub async fn page_not_found(socket: &mut TcpStream) -> std::io::Result<()> {
    let body = "404 page not found\n";
    let head = format!(
        "HTTP/1.1 404 Not Found\r\nContent-Type: text/plain; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    socket.write_all(head.as_bytes()).await?;
    socket.write_all(body.as_bytes()).await?;
    socket.shutdown().await
}

/// The `403` a real API server answers a `verb` of collection `path` that RBAC does not
/// grant (the user the fake's kubeconfig names: none, so anonymous).
pub fn forbidden(path: &str, verb: &str) -> Value {
    let (group, resource) = match path.trim_start_matches('/').split('/').collect::<Vec<_>>()[..] {
        ["apis", group, _, resource] => (group, resource),
        [.., resource] => ("", resource),
        [] => ("", ""),
    };
    let qualified = if group.is_empty() {
        resource.to_owned()
    } else {
        format!("{resource}.{group}")
    };
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": format!("{qualified} is forbidden: User \"system:anonymous\" cannot \
               {verb} resource \"{resource}\" in API group \"{group}\" at the cluster scope"),
           "reason": "Forbidden",
           "details": {"group": group, "kind": resource},
           "code": 403})
}

pub fn not_found(what: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": format!("{what} not found"), "reason": "NotFound", "code": 404})
}

/// Serve one connection: one request, then close.
pub async fn serve(socket: TcpStream, state: Arc<Mutex<State>>, served: Arc<Notify>) {
    let mut reader = BufReader::new(socket);
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).await.is_err() {
        return;
    }
    let mut parts = request_line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_owned();
    let target = parts.next().unwrap_or_default().to_owned();
    let (mut length, mut content_type) = (0usize, String::new());
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            match name.to_ascii_lowercase().as_str() {
                "content-length" => length = value.trim().parse().unwrap_or(0),
                "content-type" => content_type = value.trim().to_owned(),
                _ => {}
            }
        }
    }
    let mut body = vec![0; length];
    if reader.read_exact(&mut body).await.is_err() {
        return;
    }
    let mut socket = reader.into_inner();
    let (path, query) = target
        .split_once('?')
        .map_or((target.clone(), String::new()), |(p, q)| {
            (p.to_owned(), q.to_owned())
        });
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let lock = || state.lock().unwrap_or_else(|e| e.into_inner());

    // Events.
    if method == "POST" && path == EVENTS {
        lock().recorded.push(Recorded {
            method,
            path,
            query,
            content_type,
            body: body.clone(),
        });
        let _ = write_response(&mut socket, 201, &body).await;
        return;
    }

    // A collection: LIST or WATCH.
    if method == "GET" && lock().collections.contains_key(path.as_str()) {
        let selector = match FieldSelector::of_query(&query) {
            Ok(selector) => selector,
            Err(message) => {
                let error = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure", "message": message, "reason": "BadRequest",
                    "code": 400});
                let _ = write_response(&mut socket, 400, &error).await;
                return;
            }
        };
        let watch = query
            .split('&')
            .any(|p| p == "watch=true" || p == "watch=1");
        if lock().collection(&path).forbidden {
            let verb = if watch { "watch" } else { "list" };
            let _ = write_response(&mut socket, 403, &forbidden(&path, verb)).await;
            return;
        }
        if watch {
            let (tx, mut rx) = mpsc::unbounded_channel();
            {
                let mut s = lock();
                let c = s.collection(&path);
                c.watches.push(Watch { selector, tx });
                c.watches_started += 1;
            }
            served.notify_waiters();
            let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\
                        Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
            if socket.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            let (mut from_client, mut socket) = socket.split();
            loop {
                // A client that closes its end (a watch it dropped) ends the watch at
                // once: no later event is counted as sent to it.
                let mut byte = [0u8; 1];
                let command = tokio::select! {
                    command = rx.recv() => command,
                    _ = from_client.read(&mut byte) => None,
                };
                let Some(command) = command else {
                    return;
                };
                let result = match command {
                    WatchCommand::Event(line) => {
                        {
                            let mut s = lock();
                            let sent = &mut s.collection(&path).sent;
                            sent.watch_bytes += line.len();
                            sent.watch_events += 1;
                        }
                        let line = format!("{line}\n");
                        let chunk = format!("{:x}\r\n{line}\r\n", line.len());
                        socket.write_all(chunk.as_bytes()).await
                    }
                    WatchCommand::End => {
                        let _ = socket.write_all(b"0\r\n\r\n").await;
                        let _ = socket.shutdown().await;
                        return;
                    }
                    WatchCommand::Drop => {
                        // A chunk announced as 0x100 bytes, cut short: the connection dies
                        // in the middle of an event.
                        let _ = socket.write_all(b"100\r\n{\"type\":\"ADDED\",\"obj").await;
                        let _ = socket.flush().await;
                        return; // dropping the socket closes it
                    }
                };
                if result.is_err() {
                    return;
                }
            }
        }
        let (code, list) = {
            let mut s = lock();
            let rv = s.resource_version.to_string();
            let c = s.collection(&path);
            c.lists += 1;
            if c.failing_lists > 0 {
                c.failing_lists -= 1;
                let error = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure", "message": "etcd is sad", "reason": "InternalError",
                    "code": 500});
                (500, error.to_string())
            } else {
                // Written item by item: a list of 100k pods is not copied into a Value.
                let mut list = json!({
                    "kind": format!("{}List", c.kind),
                    "apiVersion": c.api_version,
                    "metadata": {"resourceVersion": rv},
                })
                .to_string();
                list.pop();
                list.push_str(",\"items\":[");
                let mut objects = 0;
                let selected = c
                    .items
                    .values()
                    .filter(|o| selector.as_ref().is_none_or(|s| s.matches(o)));
                for item in selected {
                    if objects > 0 {
                        list.push(',');
                    }
                    list.push_str(&item.to_string());
                    objects += 1;
                }
                list.push_str("]}");
                c.sent.lists += 1;
                c.sent.list_bytes += list.len();
                c.sent.list_objects += objects;
                (200, list)
            }
        };
        served.notify_waiters();
        let _ = write_text(&mut socket, code, &list).await;
        return;
    }

    // A single object: GET, or PATCH of it or of its status.
    let Some((collection, rest)) = lock().collections.keys().find_map(|c| {
        path.strip_prefix(c)
            .and_then(|r| r.strip_prefix('/'))
            .map(|r| (*c, r.to_owned()))
    }) else {
        let _ = page_not_found(&mut socket).await;
        return;
    };
    let (name, status) = match rest.strip_suffix("/status") {
        Some(name) => (name.to_owned(), true),
        None => (rest.clone(), false),
    };
    let (code, response) = object_request(
        &mut lock(),
        collection,
        &name,
        status,
        Recorded {
            method,
            path,
            query,
            content_type,
            body,
        },
    );
    let _ = write_response(&mut socket, code, &response).await;
}

/// GET of an object, or PATCH of it (its spec) or of its status.
pub fn object_request(
    s: &mut State,
    collection: &str,
    name: &str,
    status: bool,
    request: Recorded,
) -> (u16, Value) {
    let existing = s.collection(collection).items.get(name).cloned();
    match request.method.as_str() {
        "GET" => match existing {
            Some(object) => (200, object),
            None => (404, not_found(&request.path)),
        },
        "PATCH" => {
            let mut object = existing.unwrap_or_else(|| json!({"metadata": {"name": name}}));
            if status {
                object["status"] = request.body["status"].clone();
            } else {
                object["spec"] = request.body["spec"].clone();
            }
            s.recorded.push(request);
            let object = s.stamp(collection, object);
            s.collection(collection)
                .items
                .insert(name.to_owned(), object.clone());
            (200, object)
        }
        _ => (404, not_found(&request.path)),
    }
}
