//! The Kubernetes source and writers against a fake API server: a small HTTP/1.1 server on
//! 127.0.0.1 that serves LIST (with a resourceVersion) and WATCH (chunked, newline-delimited
//! JSON events) for the five watched kinds, GET and PATCH of single objects, and POST of
//! Events, and that the tests script: send events, end a watch, answer `410 Gone`, drop the
//! connection mid-chunk. No real cluster is needed.
//!
//! Every wait is bounded: a test fails, it does not hang.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use egress_agent::{
    api::{ConditionStatus, EgressIpStatus, PolicyCondition, PolicyStatus},
    source::{
        kube::{self as kube_source, EventType},
        yaml::Snapshot,
    },
};
use serde_json::{Value, json};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader},
    net::{TcpListener, TcpStream},
    sync::{Notify, mpsc, watch},
    time::timeout,
};

const PODS: &str = "/api/v1/pods";
const NAMESPACES: &str = "/api/v1/namespaces";
const NODES: &str = "/api/v1/nodes";
const POLICIES: &str = "/apis/egress.dev/v1alpha1/egressgatewaypolicies";
const EGRESS_NODES: &str = "/apis/egress.dev/v1alpha1/egressnodes";
const EVENTS: &str = "/api/v1/namespaces/default/events";
const NETWORK_POLICIES: &str = "/apis/networking.k8s.io/v1/networkpolicies";

/// How long any one expectation may take. Re-lists wait for the watcher's backoff
/// (0.8 s to 1.6 s for a first error), so this leaves ample room.
const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// The fake API server

/// What the server does to the open watches of a collection.
enum WatchCommand {
    /// Send one event line.
    Event(String),
    /// End the response properly (last chunk): a watch that ends, as at its timeout.
    End,
    /// Write half a chunk, then close the socket.
    Drop,
}

struct Collection {
    kind: &'static str,
    api_version: &'static str,
    /// By `namespace/name` (or `name`).
    items: BTreeMap<String, Value>,
    watches: Vec<mpsc::UnboundedSender<WatchCommand>>,
    /// Watch requests answered so far.
    watches_started: usize,
    lists: usize,
    /// Lists still to answer with `500` (an API server in trouble, a CRD not yet served).
    failing_lists: usize,
}

/// One request the server received (other than LIST and WATCH).
#[derive(Clone, Debug)]
struct Recorded {
    method: String,
    path: String,
    query: String,
    content_type: String,
    body: Value,
}

struct State {
    resource_version: u64,
    collections: BTreeMap<&'static str, Collection>,
    recorded: Vec<Recorded>,
}

struct Fake {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    /// Notified whenever a watch or list is served.
    served: Arc<Notify>,
}

fn key_of(object: &Value) -> String {
    let meta = &object["metadata"];
    match meta["namespace"].as_str() {
        Some(ns) => format!("{ns}/{}", meta["name"].as_str().unwrap_or_default()),
        None => meta["name"].as_str().unwrap_or_default().to_owned(),
    }
}

impl State {
    fn bump(&mut self) -> String {
        self.resource_version += 1;
        self.resource_version.to_string()
    }

    fn collection(&mut self, path: &str) -> &mut Collection {
        self.collections
            .get_mut(path)
            .unwrap_or_else(|| panic!("no collection {path}"))
    }

    /// Stamp `object` with kind, apiVersion and a new resourceVersion.
    fn stamp(&mut self, path: &str, mut object: Value) -> Value {
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

    fn send(&mut self, path: &str, command: impl Fn() -> WatchCommand) {
        self.collection(path)
            .watches
            .retain(|w| w.send(command()).is_ok());
    }
}

impl Fake {
    async fn start() -> Self {
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

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn client(&self) -> kube::Client {
        let url = format!("http://{}", self.addr).parse().expect("url");
        kube::Client::try_from(kube::Config::new(url)).expect("client")
    }

    /// Store `object` without telling the watches (what a re-list will see).
    fn put_silently(&self, path: &str, object: Value) {
        let mut s = self.state();
        let object = s.stamp(path, object);
        s.collection(path).items.insert(key_of(&object), object);
    }

    fn remove_silently(&self, path: &str, key: &str) {
        self.state().collection(path).items.remove(key);
    }

    /// Store `object` and send ADDED or MODIFIED to the open watches.
    fn apply(&self, path: &str, object: Value) {
        let mut s = self.state();
        let object = s.stamp(path, object);
        let key = key_of(&object);
        let type_ = if s.collection(path).items.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        s.collection(path).items.insert(key, object.clone());
        let line = json!({"type": type_, "object": object}).to_string();
        s.send(path, || WatchCommand::Event(line.clone()));
    }

    /// Remove an object and send DELETED.
    fn delete(&self, path: &str, key: &str) {
        let mut s = self.state();
        let Some(mut object) = s.collection(path).items.remove(key) else {
            panic!("no {key} in {path}");
        };
        object["metadata"]["resourceVersion"] = json!(s.bump());
        let line = json!({"type": "DELETED", "object": object}).to_string();
        s.send(path, || WatchCommand::Event(line.clone()));
    }

    /// Answer the open watches with `ERROR 410 Gone`, as when their resourceVersion is
    /// too old.
    fn gone(&self, path: &str) {
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

    fn end_watches(&self, path: &str) {
        let mut s = self.state();
        s.send(path, || WatchCommand::End);
        s.collection(path).watches.clear();
    }

    fn drop_watches(&self, path: &str) {
        let mut s = self.state();
        s.send(path, || WatchCommand::Drop);
        s.collection(path).watches.clear();
    }

    fn fail_lists(&self, path: &str, n: usize) {
        self.state().collection(path).failing_lists = n;
    }

    fn watches_started(&self, path: &str) -> usize {
        self.state().collection(path).watches_started
    }

    fn lists(&self, path: &str) -> usize {
        self.state().collection(path).lists
    }

    /// Wait until at least `n` watches of `path` have been started.
    async fn wait_watches(&self, path: &str, n: usize) {
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

    fn recorded(&self) -> Vec<Recorded> {
        self.state().recorded.clone()
    }
}

async fn write_response(socket: &mut TcpStream, code: u16, body: &Value) -> std::io::Result<()> {
    let body = body.to_string();
    let head = format!(
        "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    socket.write_all(head.as_bytes()).await?;
    socket.write_all(body.as_bytes()).await?;
    socket.shutdown().await
}

fn not_found(what: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": format!("{what} not found"), "reason": "NotFound", "code": 404})
}

/// Serve one connection: one request, then close.
async fn serve(socket: TcpStream, state: Arc<Mutex<State>>, served: Arc<Notify>) {
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
        if query
            .split('&')
            .any(|p| p == "watch=true" || p == "watch=1")
        {
            let (tx, mut rx) = mpsc::unbounded_channel();
            {
                let mut s = lock();
                let c = s.collection(&path);
                c.watches.push(tx);
                c.watches_started += 1;
            }
            served.notify_waiters();
            let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\
                        Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
            if socket.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            while let Some(command) = rx.recv().await {
                let result = match command {
                    WatchCommand::Event(line) => {
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
            return;
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
                (500, error)
            } else {
                let list = json!({
                    "kind": format!("{}List", c.kind),
                    "apiVersion": c.api_version,
                    "metadata": {"resourceVersion": rv},
                    "items": c.items.values().cloned().collect::<Vec<_>>(),
                });
                (200, list)
            }
        };
        served.notify_waiters();
        let _ = write_response(&mut socket, code, &list).await;
        return;
    }

    // A single object: GET, or PATCH of it or of its status.
    let Some((collection, rest)) = lock().collections.keys().find_map(|c| {
        path.strip_prefix(c)
            .and_then(|r| r.strip_prefix('/'))
            .map(|r| (*c, r.to_owned()))
    }) else {
        let _ = write_response(&mut socket, 404, &not_found(&path)).await;
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
fn object_request(
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

// ---------------------------------------------------------------------------------------
// Objects

fn pod(ns: &str, name: &str, ip: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "api"}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
    })
}

fn namespace(name: &str) -> Value {
    json!({"metadata": {"name": name, "labels": {"team": "payments"}}})
}

fn node(name: &str, ip: &str) -> Value {
    json!({
        "metadata": {"name": name, "labels": {"egress.dev/gateway": "true"}},
        "status": {
            "addresses": [{"type": "InternalIP", "address": ip}],
            "conditions": [{"type": "Ready", "status": "True"}]
        }
    })
}

fn policy(name: &str) -> Value {
    json!({
        "metadata": {"name": name, "generation": 3},
        "spec": {
            "gatewaySelector": {"matchLabels": {"egress.dev/gateway": "true"}},
            "rules": [{"destinations": ["192.0.2.0/24"], "egressIP": "198.51.100.10"}]
        }
    })
}

fn egress_node(name: &str, underlay: &str) -> Value {
    json!({
        "metadata": {"name": name},
        "spec": {"underlayIP": underlay},
        "status": {"interfaces": [{"name": "ens224", "up": true,
                                   "addresses": ["198.51.100.2/24"]}]}
    })
}

/// A NetworkPolicy of namespace payments isolating every pod for egress, allowing TCP 443
/// to `cidr`.
fn network_policy(name: &str, cidr: &str) -> Value {
    json!({
        "metadata": {"namespace": "payments", "name": name},
        "spec": {"podSelector": {}, "policyTypes": ["Egress"],
                 "egress": [{"to": [{"ipBlock": {"cidr": cidr}}],
                             "ports": [{"protocol": "TCP", "port": 443}]}]}
    })
}

/// A server holding a small cluster: namespace payments, pods a and b, one node, one
/// policy, one EgressNode, one NetworkPolicy.
async fn cluster() -> Fake {
    let fake = Fake::start().await;
    fake.put_silently(NAMESPACES, namespace("payments"));
    fake.put_silently(PODS, pod("payments", "a", "10.0.0.1"));
    fake.put_silently(PODS, pod("payments", "b", "10.0.0.2"));
    fake.put_silently(NODES, node("node-1", "172.16.0.1"));
    fake.put_silently(POLICIES, policy("payments"));
    fake.put_silently(EGRESS_NODES, egress_node("node-1", "172.16.0.1"));
    fake.put_silently(
        NETWORK_POLICIES,
        network_policy("https-only", "192.0.2.0/24"),
    );
    fake
}

async fn start_watch(fake: &Fake) -> watch::Receiver<Arc<Snapshot>> {
    timeout(WAIT, kube_source::watch(fake.client(), Vec::new()))
        .await
        .expect("initial lists within the time limit")
        .expect("watch")
}

fn pod_names(snapshot: &Snapshot) -> Vec<String> {
    let mut names: Vec<String> = snapshot.view.pods.iter().map(|p| p.name.clone()).collect();
    names.sort();
    names
}

/// Wait until the published snapshot satisfies `done`.
async fn wait_for(
    rx: &mut watch::Receiver<Arc<Snapshot>>,
    what: &str,
    done: impl Fn(&Snapshot) -> bool,
) -> Arc<Snapshot> {
    let result = timeout(WAIT, async {
        loop {
            let snapshot = rx.borrow_and_update().clone();
            if done(&snapshot) {
                return snapshot;
            }
            if rx.changed().await.is_err() {
                panic!("the source stopped while waiting for {what}");
            }
        }
    })
    .await;
    match result {
        Ok(snapshot) => snapshot,
        Err(_) => panic!(
            "{what}: not seen within {WAIT:?}; last pods: {:?}",
            pod_names(&rx.borrow())
        ),
    }
}

/// Records whether any snapshot published after the first lost every pod: the view must
/// keep the last good state while watches recover.
fn watch_for_empty_views(mut rx: watch::Receiver<Arc<Snapshot>>) -> Arc<Mutex<bool>> {
    let emptied = Arc::new(Mutex::new(false));
    let flag = emptied.clone();
    tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            if rx.borrow_and_update().view.pods.is_empty() {
                *flag.lock().unwrap_or_else(|e| e.into_inner()) = true;
            }
        }
    });
    emptied
}

fn assert_never_emptied(emptied: &Mutex<bool>) {
    assert!(
        !*emptied.lock().unwrap_or_else(|e| e.into_inner()),
        "a snapshot without pods was published while the watch recovered"
    );
}

/// A watched `cluster()` whose pods' first watch is open, with a guard that no view
/// published from then on loses every pod.
struct Recovering {
    fake: Fake,
    rx: watch::Receiver<Arc<Snapshot>>,
    emptied: Arc<Mutex<bool>>,
}

async fn recovering() -> Recovering {
    let fake = cluster().await;
    let rx = start_watch(&fake).await;
    let emptied = watch_for_empty_views(rx.clone());
    fake.wait_watches(PODS, 1).await;
    Recovering { fake, rx, emptied }
}

impl Recovering {
    /// Once the pods' second watch is open, pod `name` is added: the view must come to
    /// hold the pods `want` (`what` names the wait), and never have been empty.
    async fn a_pod_added_arrives(&mut self, what: &str, name: &str, ip: &str, want: &[&str]) {
        self.fake.wait_watches(PODS, 2).await;
        self.fake.apply(PODS, pod("payments", name, ip));
        wait_for(&mut self.rx, what, |s| pod_names(s) == want).await;
        assert_never_emptied(&self.emptied);
    }
}

// ---------------------------------------------------------------------------------------
// Reading

#[tokio::test]
async fn initial_list_produces_the_view() {
    let fake = cluster().await;
    // An object the agent cannot decode is reported, naming kind, name and field, and the
    // rest of its kind still arrives.
    fake.put_silently(
        PODS,
        json!({"metadata": {"name": "bad", "namespace": "payments"},
               "spec": {"containers": []}, "status": {"podIPs": "10.0.0.9"}}),
    );
    let rx = start_watch(&fake).await;
    let snapshot = rx.borrow().clone();
    let view = &snapshot.view;
    assert_eq!(pod_names(&snapshot), ["a", "b"]);
    assert_eq!(
        view.pods[0].ips,
        ["10.0.0.1".parse::<IpAddr>().expect("ip")]
    );
    assert_eq!(view.pods[0].node_name.as_deref(), Some("node-1"));
    assert_eq!(view.namespaces.len(), 1);
    assert_eq!(view.nodes.len(), 1);
    assert_eq!(view.policies.len(), 1);
    assert_eq!(view.policies[0].metadata.name.as_deref(), Some("payments"));
    assert_eq!(
        view.policies[0].spec.rules[0].egress_ip.as_deref(),
        Some("198.51.100.10")
    );
    assert_eq!(view.network_policies.len(), 1);
    assert_eq!(
        view.network_policies[0].metadata.name.as_deref(),
        Some("https-only")
    );
    assert_eq!(view.egress_nodes.len(), 1);
    assert_eq!(
        view.egress_nodes[0].spec.underlay_ip.as_deref(),
        Some("172.16.0.1")
    );
    let errors: Vec<String> = snapshot.errors.iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("(Pod payments/bad): status.podIPs:"),
        "{}",
        errors[0]
    );
}

#[tokio::test]
async fn objects_that_fail_their_checks_are_reported_and_the_rest_served() {
    let fake = cluster().await;
    // Decodes, but its address is no address: reported as the YAML source reports it.
    fake.put_silently(PODS, pod("payments", "bad-ip", "10.0.0"));
    fake.put_silently(EGRESS_NODES, egress_node("node-2", "172.16.0.300"));
    let rx = start_watch(&fake).await;
    let snapshot = rx.borrow().clone();
    assert_eq!(pod_names(&snapshot), ["a", "b"]);
    assert_eq!(snapshot.view.egress_nodes.len(), 1);
    let errors: Vec<String> = snapshot.errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        errors,
        [
            "file /api/v1/namespaces/payments/pods/bad-ip doc 1 (Pod payments/bad-ip): \
             status.podIP: invalid IP address \"10.0.0\"",
            "file /api/v1/namespaces/payments/pods/bad-ip doc 1 (Pod payments/bad-ip): \
             status.podIPs[0].ip: invalid IP address \"10.0.0\"",
            "file /apis/egress.dev/v1alpha1/egressnodes/node-2 doc 1 (EgressNode node-2): \
             spec.underlayIP: invalid IP address \"172.16.0.300\"",
        ]
    );
}

#[tokio::test]
async fn failing_first_lists_are_retried_before_the_first_view() {
    let fake = cluster().await;
    fake.fail_lists(EGRESS_NODES, 1);
    let rx = start_watch(&fake).await;
    // The first view is complete: never published before every kind was listed.
    let snapshot = rx.borrow().clone();
    assert_eq!(snapshot.view.egress_nodes.len(), 1);
    assert_eq!(pod_names(&snapshot), ["a", "b"]);
    assert_eq!(fake.lists(EGRESS_NODES), 2);
}

#[tokio::test]
async fn watch_events_update_the_view() {
    let fake = cluster().await;
    let mut rx = start_watch(&fake).await;
    fake.wait_watches(PODS, 1).await;

    fake.apply(PODS, pod("payments", "c", "10.0.0.3"));
    wait_for(&mut rx, "ADDED pod c", |s| pod_names(s) == ["a", "b", "c"]).await;

    let mut moved = pod("payments", "c", "10.0.0.3");
    moved["metadata"]["labels"]["app"] = json!("web");
    fake.apply(PODS, moved);
    wait_for(&mut rx, "MODIFIED pod c", |s| {
        s.view
            .pods
            .iter()
            .any(|p| p.name == "c" && p.labels.get("app").map(String::as_str) == Some("web"))
    })
    .await;

    fake.delete(PODS, "payments/a");
    wait_for(&mut rx, "DELETED pod a", |s| pod_names(s) == ["b", "c"]).await;

    // Other kinds too.
    fake.wait_watches(POLICIES, 1).await;
    fake.apply(POLICIES, policy("second"));
    wait_for(&mut rx, "ADDED policy", |s| s.view.policies.len() == 2).await;
}

#[tokio::test]
async fn a_watch_that_ends_is_reestablished() {
    let mut r = recovering().await;
    let lists = r.fake.lists(PODS);

    r.fake.end_watches(PODS);
    r.a_pod_added_arrives(
        "pod c after the watch ended",
        "c",
        "10.0.0.3",
        &["a", "b", "c"],
    )
    .await;
    // Resumed from the last resourceVersion, without a new list.
    assert_eq!(r.fake.lists(PODS), lists);
}

#[tokio::test]
async fn gone_410_relists_and_the_view_converges() {
    let mut r = recovering().await;
    let lists = r.fake.lists(PODS);

    // What happened while the watch was away: a went, c came.
    r.fake.remove_silently(PODS, "payments/a");
    r.fake.put_silently(PODS, pod("payments", "c", "10.0.0.3"));
    r.fake.gone(PODS);
    // The last good view is kept meanwhile.
    assert_eq!(pod_names(&r.rx.borrow()), ["a", "b"]);
    wait_for(&mut r.rx, "the re-listed pods", |s| {
        pod_names(s) == ["b", "c"]
    })
    .await;
    assert!(r.fake.lists(PODS) > lists, "410 Gone must cause a new list");

    // And the new watch delivers later events.
    r.a_pod_added_arrives("pod d after the re-list", "d", "10.0.0.4", &["b", "c", "d"])
        .await;
}

#[tokio::test]
async fn a_dropped_connection_is_survived() {
    let mut r = recovering().await;

    r.fake.drop_watches(PODS);
    assert_eq!(pod_names(&r.rx.borrow()), ["a", "b"]);
    r.a_pod_added_arrives(
        "pod c after the connection dropped",
        "c",
        "10.0.0.3",
        &["a", "b", "c"],
    )
    .await;
}

#[tokio::test]
async fn every_kind_survives_dropped_connections() {
    let fake = cluster().await;
    let mut rx = start_watch(&fake).await;
    for path in [NAMESPACES, NODES, POLICIES, EGRESS_NODES, NETWORK_POLICIES] {
        fake.wait_watches(path, 1).await;
        fake.drop_watches(path);
    }
    for path in [NAMESPACES, NODES, POLICIES, EGRESS_NODES, NETWORK_POLICIES] {
        fake.wait_watches(path, 2).await;
    }
    fake.apply(NAMESPACES, namespace("shop"));
    fake.apply(NODES, node("node-2", "172.16.0.2"));
    fake.apply(POLICIES, policy("second"));
    fake.apply(EGRESS_NODES, egress_node("node-2", "172.16.0.2"));
    fake.apply(
        NETWORK_POLICIES,
        network_policy("second", "198.51.100.0/24"),
    );
    wait_for(&mut rx, "one more object of every kind", |s| {
        s.view.namespaces.len() == 2
            && s.view.nodes.len() == 2
            && s.view.policies.len() == 2
            && s.view.egress_nodes.len() == 2
            && s.view.network_policies.len() == 2
            && s.view.pods.len() == 2
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Writing

fn status(ready: &str) -> PolicyStatus {
    PolicyStatus {
        observed_generation: Some(3),
        conditions: vec![
            PolicyCondition {
                type_: "Accepted".to_owned(),
                status: ConditionStatus::True,
                observed_generation: Some(3),
                last_transition_time: None,
                reason: "Accepted".to_owned(),
                message: "policy accepted".to_owned(),
            },
            PolicyCondition {
                type_: "Ready".to_owned(),
                status: (ready == "True").into(),
                observed_generation: Some(3),
                last_transition_time: None,
                reason: "Held".to_owned(),
                message: "every egress IP is held".to_owned(),
            },
        ],
        egress_ips: vec![EgressIpStatus {
            ip: "198.51.100.10".to_owned(),
            node: "gw-1".to_owned(),
            interface: "ens224".to_owned(),
            ..Default::default()
        }],
    }
}

fn patches(fake: &Fake) -> Vec<Recorded> {
    fake.recorded()
        .into_iter()
        .filter(|r| r.method == "PATCH")
        .collect()
}

fn is_rfc3339_utc(text: &str) -> bool {
    text.len() == 20 && text.ends_with('Z') && text.as_bytes().get(10) == Some(&b'T')
}

#[tokio::test]
async fn publish_policy_status_patches_the_status_subresource_when_changed() {
    let fake = cluster().await;
    let client = fake.client();
    let run = |s: PolicyStatus| {
        let client = client.clone();
        async move {
            timeout(
                WAIT,
                kube_source::publish_policy_status(&client, "payments", &s),
            )
            .await
            .expect("within the time limit")
            .expect("publish")
        }
    };

    assert!(run(status("True")).await, "a new status is sent");
    let sent = patches(&fake);
    assert_eq!(sent.len(), 1);
    let patch = &sent[0];
    assert_eq!(
        patch.path,
        "/apis/egress.dev/v1alpha1/egressgatewaypolicies/payments/status"
    );
    assert_eq!(patch.content_type, "application/merge-patch+json");
    assert!(
        patch.query.contains("fieldManager=egress-agent"),
        "{}",
        patch.query
    );
    let mut body = patch.body.clone();
    for condition in body["status"]["conditions"]
        .as_array_mut()
        .expect("conditions")
    {
        let time = condition
            .as_object_mut()
            .and_then(|c| c.remove("lastTransitionTime"))
            .expect("lastTransitionTime set by the writer");
        assert!(is_rfc3339_utc(time.as_str().unwrap_or_default()), "{time}");
    }
    assert_eq!(
        body,
        json!({"status": {
            "observedGeneration": 3,
            "conditions": [
                {"type": "Accepted", "status": "True", "observedGeneration": 3,
                 "reason": "Accepted", "message": "policy accepted"},
                {"type": "Ready", "status": "True", "observedGeneration": 3,
                 "reason": "Held", "message": "every egress IP is held"}
            ],
            "egressIPs": [{"ip": "198.51.100.10", "node": "gw-1", "interface": "ens224"}]
        }})
    );

    // The same status again: nothing is sent.
    assert!(
        !run(status("True")).await,
        "an unchanged status is not sent"
    );
    assert_eq!(patches(&fake).len(), 1);

    // Ready flips: sent, and Accepted keeps its transition time.
    assert!(run(status("False")).await);
    let sent = patches(&fake);
    assert_eq!(sent.len(), 2);
    let times = |r: &Recorded| -> Vec<String> {
        r.body["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                c["lastTransitionTime"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect()
    };
    assert_eq!(times(&sent[1])[0], times(&sent[0])[0]);
    assert_eq!(sent[1].body["status"]["conditions"][1]["status"], "False");

    // A policy that is gone is not an error.
    let gone = timeout(
        WAIT,
        kube_source::publish_policy_status(&client, "nope", &status("True")),
    )
    .await
    .expect("within the time limit")
    .expect("publish");
    assert!(!gone);
}

#[tokio::test]
async fn publish_egress_node_applies_spec_and_status() {
    let fake = Fake::start().await;
    let client = fake.client();
    let doc: egress_agent::api::EgressNode =
        serde_json::from_value(egress_node("gw-1", "172.16.0.9")).expect("EgressNode");
    timeout(WAIT, kube_source::publish_egress_node(&client, &doc))
        .await
        .expect("within the time limit")
        .expect("publish");
    let sent = patches(&fake);
    assert_eq!(sent.len(), 2, "{sent:?}");
    for (r, path) in sent.iter().zip([
        "/apis/egress.dev/v1alpha1/egressnodes/gw-1",
        "/apis/egress.dev/v1alpha1/egressnodes/gw-1/status",
    ]) {
        assert_eq!(r.path, path);
        assert_eq!(r.content_type, "application/apply-patch+yaml");
        assert!(r.query.contains("fieldManager=egress-agent"), "{}", r.query);
        assert!(r.query.contains("force=true"), "{}", r.query);
        assert_eq!(r.body["apiVersion"], "egress.dev/v1alpha1");
        assert_eq!(r.body["kind"], "EgressNode");
        assert_eq!(r.body["metadata"], json!({"name": "gw-1"}));
    }
    assert_eq!(sent[0].body["spec"], json!({"underlayIP": "172.16.0.9"}));
    assert_eq!(sent[0].body.get("status"), None);
    assert_eq!(
        sent[1].body["status"]["interfaces"][0]["name"],
        json!("ens224")
    );

    let mut nameless = doc.clone();
    nameless.metadata.name = None;
    assert!(
        kube_source::publish_egress_node(&client, &nameless)
            .await
            .is_err()
    );
}

#[tokio::test]
async fn record_event_creates_a_core_event_on_the_policy() {
    let fake = cluster().await;
    let client = fake.client();
    timeout(
        WAIT,
        kube_source::record_event(
            &client,
            "payments",
            "gw-2",
            EventType::Normal,
            "EgressIPMoved",
            "egress IP 198.51.100.10 moved from gw-1 to gw-2",
        ),
    )
    .await
    .expect("within the time limit")
    .expect("record");
    let posted: Vec<Recorded> = fake
        .recorded()
        .into_iter()
        .filter(|r| r.method == "POST")
        .collect();
    assert_eq!(posted.len(), 1);
    let event = &posted[0].body;
    assert_eq!(posted[0].path, EVENTS);
    assert_eq!(
        event["involvedObject"],
        json!({"apiVersion": "egress.dev/v1alpha1", "kind": "EgressGatewayPolicy",
               "name": "payments", "uid": "uid-payments",
               "resourceVersion": event["involvedObject"]["resourceVersion"]})
    );
    assert_eq!(event["type"], "Normal");
    assert_eq!(event["reason"], "EgressIPMoved");
    assert_eq!(
        event["message"],
        "egress IP 198.51.100.10 moved from gw-1 to gw-2"
    );
    assert_eq!(event["source"]["component"], "egress-agent");
    assert_eq!(event["reportingInstance"], "gw-2");
    assert_eq!(event["metadata"]["namespace"], "default");
}
