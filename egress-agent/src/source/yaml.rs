//! A directory of multi-document YAML files as the source of cluster state: Nodes,
//! Namespaces, Pods, EgressGatewayPolicies and EgressNodes, exactly as Kubernetes serves
//! them (`apiVersion`, `kind`, `metadata`, `spec`, `status`).
//!
//! Reading never stops at a bad document: each one is reported ([`DocumentError`], naming
//! file, document, object and field) and left out, and every good one is kept. The agent
//! writes only its own `egressnode-<node>.yaml` there ([`write_egress_node`]).

use std::{
    collections::BTreeMap,
    fmt,
    io::Write as _,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, SystemTime},
};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use serde::de::DeserializeOwned;
use tokio::sync::watch as tokio_watch;

use super::{ClusterView, PodSummary};
use crate::api::{API_VERSION, EgressGatewayPolicy, EgressNode};

/// One document that could not be used, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DocumentError {
    /// File name, relative to the directory.
    pub file: String,
    /// 1-based position of the document in the file.
    pub doc: usize,
    /// `Kind namespace/name` or `Kind name`, when the document got that far.
    pub object: Option<String>,
    /// Path of the offending field (`status.podIPs[0].ip`), when known.
    pub field: Option<String>,
    pub message: String,
}

impl fmt::Display for DocumentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "file {} doc {}", self.file, self.doc)?;
        if let Some(object) = &self.object {
            write!(f, " ({object})")?;
        }
        f.write_str(": ")?;
        if let Some(field) = &self.field {
            write!(f, "{field}: ")?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for DocumentError {}

/// Why (part of) the directory could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("failed to read directory {dir}: {detail}")]
    ReadDir { dir: PathBuf, detail: String },
    #[error("failed to read file {file}: {detail}")]
    ReadFile { file: String, detail: String },
    #[error("{0}")]
    Document(#[from] DocumentError),
}

/// Why the agent's EgressNode could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("failed to write EgressNode: metadata.name {0:?} is not a valid node name")]
    Name(String),
    #[error("failed to serialize EgressNode {name}: {source}")]
    Serialize {
        name: String,
        #[source]
        source: serde_yaml_ng::Error,
    },
    #[error("failed to write EgressNode {name} to {path}: {source}")]
    Io {
        name: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What one read of the directory found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub view: ClusterView,
    /// Every problem met, in file and document order. A document listed here is not in
    /// `view`.
    pub errors: Vec<LoadError>,
}

/// Does the reader consider this file name? `*.yaml` and `*.yml`, not hidden.
fn is_state_file(name: &str) -> bool {
    !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml"))
}

/// The state files of `dir`, sorted by name.
fn list_files(dir: &Path) -> Result<Vec<(String, std::fs::Metadata)>, LoadError> {
    let read_dir_error = |e: std::io::Error| LoadError::ReadDir {
        dir: dir.to_owned(),
        detail: e.to_string(),
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_dir_error)? {
        let entry = entry.map_err(read_dir_error)?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if !is_state_file(&name) {
            continue;
        }
        // Follow symlinks: a file linked in counts as the file.
        let Ok(meta) = std::fs::metadata(entry.path()) else {
            continue;
        };
        if meta.is_file() {
            files.push((name, meta));
        }
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(files)
}

/// Read every state file of `dir`.
pub fn load_dir(dir: &Path) -> Snapshot {
    let mut loader = Loader::default();
    match list_files(dir) {
        Err(e) => loader.errors.push(e),
        Ok(files) => {
            for (name, _) in files {
                match std::fs::read_to_string(dir.join(&name)) {
                    Ok(text) => loader.add_file(&name, &text),
                    Err(e) => loader.errors.push(LoadError::ReadFile {
                        file: name,
                        detail: e.to_string(),
                    }),
                }
            }
        }
    }
    loader.finish()
}

/// Parse one file's text as if it were file `name` of a directory (for tests and tools).
pub fn load_str(name: &str, text: &str) -> Snapshot {
    let mut loader = Loader::default();
    loader.add_file(name, text);
    loader.finish()
}

/// Split a YAML stream into its documents: (1-based number, text). A leading `---` does
/// not open an empty first document.
fn split_documents(text: &str) -> Vec<(usize, String)> {
    let mut docs: Vec<String> = vec![String::new()];
    let mut leading = true;
    for line in text.split_inclusive('\n') {
        let bare = line.trim_end_matches(['\n', '\r']);
        let marker = bare == "---" || bare.starts_with("--- ") || bare.starts_with("---\t");
        if marker {
            if !(leading && docs.len() == 1) {
                docs.push(String::new());
            }
            leading = false;
            if let Some(rest) = bare.get(3..).filter(|r| !r.trim().is_empty())
                && let Some(last) = docs.last_mut()
            {
                last.push_str(rest);
                last.push('\n');
            }
            continue;
        }
        if !bare.trim().is_empty() && !bare.trim_start().starts_with('#') {
            leading = false;
        }
        if let Some(last) = docs.last_mut() {
            last.push_str(line);
        }
    }
    docs.into_iter()
        .enumerate()
        .map(|(i, d)| (i + 1, d))
        .collect()
}

/// Key of an object for duplicate detection: (kind, namespace, name).
type ObjectKey = (String, String, String);

#[derive(Default)]
struct Loader {
    view: ClusterView,
    errors: Vec<LoadError>,
    /// Where each object was first seen: (file, doc).
    seen: BTreeMap<ObjectKey, (String, usize)>,
}

/// A field-level problem found after a document deserialized.
struct FieldError {
    /// `None` for the document as a whole.
    field: Option<String>,
    message: String,
}

fn field_error(field: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        field: Some(field.into()),
        message: message.into(),
    }
}

impl Loader {
    fn finish(self) -> Snapshot {
        Snapshot {
            view: self.view,
            errors: self.errors,
        }
    }

    fn add_file(&mut self, file: &str, text: &str) {
        for (doc, body) in split_documents(text) {
            self.add_document(file, doc, &body);
        }
    }

    fn add_document(&mut self, file: &str, doc: usize, body: &str) {
        let error = |object: Option<String>, field: Option<String>, message: String| {
            LoadError::Document(DocumentError {
                file: file.to_owned(),
                doc,
                object,
                field,
                message,
            })
        };
        let value: serde_json::Value = match serde_yaml_ng::from_str(body) {
            Ok(v) => v,
            Err(e) => {
                self.errors
                    .push(error(None, None, format!("failed to parse YAML: {e}")));
                return;
            }
        };
        if value.is_null() {
            return; // an empty document (comments only)
        }
        let Some(map) = value.as_object() else {
            self.errors.push(error(
                None,
                None,
                "failed to read object: the document is not a mapping".to_owned(),
            ));
            return;
        };
        let text_field = |key: &str| map.get(key).and_then(serde_json::Value::as_str);
        let Some(api_version) = text_field("apiVersion").map(str::to_owned) else {
            self.errors.push(error(
                None,
                Some("apiVersion".to_owned()),
                "missing or not a string".to_owned(),
            ));
            return;
        };
        let Some(kind) = text_field("kind").map(str::to_owned) else {
            self.errors.push(error(
                None,
                Some("kind".to_owned()),
                "missing or not a string".to_owned(),
            ));
            return;
        };
        let mut value = value;
        // The agent's own EgressNodes always have a spec; hand-written ones may omit it.
        if kind == "EgressNode"
            && let Some(map) = value.as_object_mut()
        {
            map.entry("spec")
                .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
        }
        let Some(map) = value.as_object() else {
            return;
        };
        let metadata = map.get("metadata");
        let meta_text = |key: &str| {
            metadata
                .and_then(|m| m.get(key))
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
        };
        let name = meta_text("name");
        let namespaced = kind == "Pod";
        let namespace = if namespaced {
            Some(meta_text("namespace").unwrap_or_else(|| "default".to_owned()))
        } else {
            None
        };
        let object = match (&namespace, &name) {
            (Some(ns), Some(n)) => Some(format!("{kind} {ns}/{n}")),
            (None, Some(n)) => Some(format!("{kind} {n}")),
            (_, None) => Some(kind.clone()),
        };
        let Some(name) = name.filter(|n| !n.is_empty()) else {
            self.errors.push(error(
                object,
                Some("metadata.name".to_owned()),
                "missing or empty".to_owned(),
            ));
            return;
        };

        let result = match (api_version.as_str(), kind.as_str()) {
            ("v1", "Pod") => {
                typed::<Pod>(value, check_pod).map(|p| Added::Pod(PodSummary::from(&p)))
            }
            ("v1", "Node") => typed::<Node>(value, check_node).map(|n| Added::Node(Box::new(n))),
            ("v1", "Namespace") => {
                typed::<Namespace>(value, |_| Vec::new()).map(|n| Added::Namespace(Box::new(n)))
            }
            (API_VERSION, "EgressGatewayPolicy") => {
                // Rule contents are the compiler's to judge (as conditions), like the API
                // server would let a CEL-less cluster store them.
                typed::<EgressGatewayPolicy>(value, |_| Vec::new())
                    .map(|p| Added::Policy(Box::new(p)))
            }
            (API_VERSION, "EgressNode") => typed::<EgressNode>(value, check_egress_node)
                .map(|n| Added::EgressNode(Box::new(n))),
            _ => Err(vec![field_error(
                "kind",
                format!(
                    "unsupported apiVersion/kind {api_version}/{kind} (expected v1 Pod, Node or \
                     Namespace, or {API_VERSION} EgressGatewayPolicy or EgressNode)"
                ),
            )]),
        };
        let added = match result {
            Ok(added) => added,
            Err(field_errors) => {
                for fe in field_errors {
                    self.errors
                        .push(error(object.clone(), fe.field, fe.message));
                }
                return;
            }
        };

        let key = (kind.clone(), namespace.unwrap_or_default(), name);
        if let Some((first_file, first_doc)) = self.seen.get(&key) {
            self.errors.push(error(
                object,
                Some("metadata.name".to_owned()),
                format!("duplicate object: already defined in file {first_file} doc {first_doc}"),
            ));
            return;
        }
        self.seen.insert(key, (file.to_owned(), doc));
        match added {
            Added::Pod(p) => self.view.pods.push(p),
            Added::Node(n) => self.view.nodes.push(*n),
            Added::Namespace(n) => self.view.namespaces.push(*n),
            Added::Policy(p) => self.view.policies.push(*p),
            Added::EgressNode(n) => self.view.egress_nodes.push(*n),
        }
    }
}

enum Added {
    /// Only what the compiler reads: the whole `Pod` is dropped at once.
    Pod(PodSummary),
    Node(Box<Node>),
    Namespace(Box<Namespace>),
    Policy(Box<EgressGatewayPolicy>),
    EgressNode(Box<EgressNode>),
}

/// Deserialize `value` as `T`, naming the field on failure, then run `check` on it.
fn typed<T: DeserializeOwned>(
    value: serde_json::Value,
    check: impl FnOnce(&T) -> Vec<FieldError>,
) -> Result<T, Vec<FieldError>> {
    let object: T = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let field = (path != ".").then_some(path);
        let message = e.into_inner().to_string();
        vec![FieldError { field, message }]
    })?;
    let errors = check(&object);
    if errors.is_empty() {
        Ok(object)
    } else {
        Err(errors)
    }
}

fn check_ip(field: String, text: &str, out: &mut Vec<FieldError>) {
    if text.parse::<IpAddr>().is_err() {
        out.push(field_error(field, format!("invalid IP address {text:?}")));
    }
}

fn check_pod(pod: &Pod) -> Vec<FieldError> {
    let mut out = Vec::new();
    if let Some(status) = &pod.status {
        if let Some(ip) = &status.pod_ip {
            check_ip("status.podIP".to_owned(), ip, &mut out);
        }
        for (i, ip) in status.pod_ips.iter().flatten().enumerate() {
            check_ip(format!("status.podIPs[{i}].ip"), &ip.ip, &mut out);
        }
    }
    out
}

fn check_node(node: &Node) -> Vec<FieldError> {
    let mut out = Vec::new();
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    for (i, address) in addresses.into_iter().flatten().enumerate() {
        if address.type_ == "InternalIP" || address.type_ == "ExternalIP" {
            check_ip(
                format!("status.addresses[{i}].address"),
                &address.address,
                &mut out,
            );
        }
    }
    out
}

fn check_egress_node(node: &EgressNode) -> Vec<FieldError> {
    let mut out = Vec::new();
    if let Some(ip) = &node.spec.underlay_ip {
        check_ip("spec.underlayIP".to_owned(), ip, &mut out);
    }
    if let Some(status) = &node.status {
        for (i, interface) in status.interfaces.iter().enumerate() {
            for (j, address) in interface.addresses.iter().enumerate() {
                if address.parse::<IpNet>().is_err() {
                    out.push(field_error(
                        format!("status.interfaces[{i}].addresses[{j}]"),
                        format!(
                            "invalid address with prefix length {address:?} (expected e.g. \
                             10.1.0.5/24)"
                        ),
                    ));
                }
            }
        }
        for (i, held) in status.egress_ips.iter().enumerate() {
            check_ip(format!("status.egressIPs[{i}].ip"), &held.ip, &mut out);
        }
    }
    out
}

/// What identifies the directory's contents cheaply: (name, mtime, length) of each state
/// file, or the error listing it.
type Fingerprint = Result<Vec<(String, Option<SystemTime>, u64)>, String>;

fn fingerprint(dir: &Path) -> Fingerprint {
    list_files(dir)
        .map(|files| {
            files
                .into_iter()
                .map(|(name, meta)| (name, meta.modified().ok(), meta.len()))
                .collect()
        })
        .map_err(|e| e.to_string())
}

/// How long the directory must stay quiet after a change notification before it is read:
/// an editor's write-rename sequence, or a file written in several chunks, gives one read.
pub const QUIET: Duration = Duration::from_millis(15);
/// The longest a read waits for the directory to become quiet (a file written for longer
/// is read as it is, and again once written).
pub const MAX_DELAY: Duration = Duration::from_millis(250);

/// What the inotify thread tells the watcher task.
#[derive(Default)]
struct Pending {
    /// Something in the directory changed.
    wake: tokio::sync::Notify,
    /// A state file itself was named (written, created, renamed, removed): read even if
    /// its (name, mtime, length) looks unchanged (a same-length rewrite within the
    /// filesystem's timestamp granularity).
    state_file: AtomicBool,
}

/// An inotify watch (through `notify`) on the directory itself, not recursive.
struct DirWatch {
    _watcher: notify::RecommendedWatcher,
    /// (device, inode) of the directory watched: a directory replaced under the watch
    /// (removed and created again) has a new one.
    identity: (u64, u64),
}

/// (device, inode) of `dir`, following symlinks.
fn dir_identity(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(dir)
        .ok()
        .filter(std::fs::Metadata::is_dir)
        .map(|m| (m.dev(), m.ino()))
}

impl DirWatch {
    /// Watch `dir`, waking `pending` on every change. Fails when the directory cannot be
    /// watched (no inotify on this filesystem, the per-user inotify limits reached, the
    /// directory missing): then polling alone notices changes.
    fn new(dir: &Path, pending: &Arc<Pending>) -> Result<Self, String> {
        use notify::{
            EventKind, Watcher as _,
            event::{AccessKind, AccessMode},
        };
        let identity = dir_identity(dir).ok_or("not a directory")?;
        let sink = Arc::clone(pending);
        let handler = move |event: notify::Result<notify::Event>| {
            let state_file = match &event {
                // Opening, reading and closing unwritten change nothing.
                Ok(e)
                    if e.kind.is_access()
                        && e.kind != EventKind::Access(AccessKind::Close(AccessMode::Write)) =>
                {
                    return;
                }
                Ok(e) => {
                    e.need_rescan()
                        || e.paths.iter().any(|p| {
                            p.file_name()
                                .and_then(|n| n.to_str())
                                .is_some_and(is_state_file)
                        })
                }
                // Events were lost (queue overflow): read.
                Err(_) => true,
            };
            if state_file {
                sink.state_file.store(true, Ordering::Relaxed);
            }
            sink.wake.notify_one();
        };
        let mut watcher = notify::recommended_watcher(handler).map_err(|e| e.to_string())?;
        watcher
            .watch(dir, notify::RecursiveMode::NonRecursive)
            .map_err(|e| e.to_string())?;
        Ok(Self {
            _watcher: watcher,
            identity,
        })
    }

    /// Is the watch still on `dir` as it is now?
    fn current(&self, dir: &Path) -> bool {
        dir_identity(dir) == Some(self.identity)
    }
}

/// Watch `dir`: the receiver holds the latest [`Snapshot`] (read once before this returns)
/// and changes whenever the directory's contents change (an unchanged view is not sent
/// again).
///
/// Changes are noticed through inotify, read once the directory has been quiet for
/// [`QUIET`] (at most [`MAX_DELAY`] after the first event). As a safety net (filesystems
/// without inotify, a directory replaced under the watch, symlinked files changed outside
/// it), the (name, mtime, length) of every state file is also compared every `poll`; the
/// inotify watch is set up again then if it was lost. The watcher ends when every
/// receiver is dropped. Must be called inside a Tokio runtime. Every view carries
/// `cluster_cidrs`.
pub async fn watch(
    dir: impl Into<PathBuf>,
    poll: Duration,
    cluster_cidrs: Vec<ipnet::IpNet>,
) -> tokio_watch::Receiver<Arc<Snapshot>> {
    watch_with(dir.into(), poll, Notifications::Inotify, cluster_cidrs).await
}

/// How the watcher learns of changes besides polling.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Notifications {
    Inotify,
    /// Polling only (tests of the safety net).
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "tests of the polling safety net")
    )]
    None,
}

async fn watch_with(
    dir: PathBuf,
    poll: Duration,
    notifications: Notifications,
    cluster_cidrs: Vec<ipnet::IpNet>,
) -> tokio_watch::Receiver<Arc<Snapshot>> {
    let pending = Arc::new(Pending::default());
    // Watch first, then read: a change racing the first read is noticed.
    let mut inotify = match notifications {
        Notifications::None => None,
        Notifications::Inotify => DirWatch::new(&dir, &pending)
            .inspect_err(|e| {
                tracing::warn!(
                    "failed to watch state directory {} with inotify: {e}; edits are \
                     noticed by polling every {poll:?} only",
                    dir.display()
                );
            })
            .ok(),
    };
    let first = read_with_fingerprint(dir.clone(), &cluster_cidrs).await;
    let (tx, rx) = tokio_watch::channel(Arc::new(first.1));
    let mut last = first.0;
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(poll);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.reset(); // no tick now: the directory was just read
        loop {
            let notified = tokio::select! {
                () = tx.closed() => break,
                () = pending.wake.notified() => true,
                _ = ticker.tick() => false,
            };
            if notified {
                debounce(&pending).await;
            } else if notifications == Notifications::Inotify
                && !inotify.as_ref().is_some_and(|w| w.current(&dir))
            {
                // Never set up, or the directory was replaced: watch it (again).
                inotify = DirWatch::new(&dir, &pending)
                    .inspect_err(|e| tracing::debug!("state directory not watched: {e}"))
                    .ok();
                if inotify.is_some() {
                    tracing::info!("watching state directory {} with inotify", dir.display());
                }
            }
            let forced = pending.state_file.swap(false, Ordering::Relaxed);
            if !forced {
                let d = dir.clone();
                let Ok(now) = tokio::task::spawn_blocking(move || fingerprint(&d)).await else {
                    continue;
                };
                if now == last {
                    continue;
                }
            }
            let (seen, snapshot) = read_with_fingerprint(dir.clone(), &cluster_cidrs).await;
            last = seen;
            tx.send_if_modified(|current| {
                if **current == snapshot {
                    false
                } else {
                    *current = Arc::new(snapshot);
                    true
                }
            });
        }
    });
    rx
}

/// Wait until no change was notified for [`QUIET`], or [`MAX_DELAY`] at most.
async fn debounce(pending: &Pending) {
    let deadline = tokio::time::Instant::now() + MAX_DELAY;
    loop {
        let quiet = (tokio::time::Instant::now() + QUIET).min(deadline);
        tokio::select! {
            () = pending.wake.notified() => {}
            () = tokio::time::sleep_until(quiet) => return,
        }
        if tokio::time::Instant::now() >= deadline {
            return;
        }
    }
}

/// Fingerprint, then read: a change racing the read shows up as a new fingerprint on the
/// next tick, so it is never missed. The view carries `cluster_cidrs`.
async fn read_with_fingerprint(
    dir: PathBuf,
    cluster_cidrs: &[ipnet::IpNet],
) -> (Fingerprint, Snapshot) {
    let fallback_dir = dir.clone();
    let cluster_cidrs = cluster_cidrs.to_vec();
    tokio::task::spawn_blocking(move || {
        let seen = fingerprint(&dir);
        let mut snapshot = load_dir(&dir);
        snapshot.view.cluster_cidrs = cluster_cidrs;
        (seen, snapshot)
    })
    .await
    .unwrap_or_else(|e| {
        let error = LoadError::ReadDir {
            dir: fallback_dir,
            detail: format!("reader task failed: {e}"),
        };
        (
            Err(error.to_string()),
            Snapshot {
                view: ClusterView::default(),
                errors: vec![error],
            },
        )
    })
}

/// File name of a node's EgressNode document in the state directory.
pub fn egress_node_file_name(node: &str) -> String {
    format!("egressnode-{node}.yaml")
}

/// Write `node` as `egressnode-<name>.yaml` in `dir`, atomically (temporary file, then
/// rename). Returns whether the file changed: an identical file is left alone, so that
/// watchers do not wake up for nothing.
pub fn write_egress_node(dir: &Path, node: &EgressNode) -> Result<bool, WriteError> {
    let name = node.metadata.name.clone().unwrap_or_default();
    if name.is_empty()
        || name.contains(['/', '\\', '\0'])
        || name.starts_with('.')
        || name.len() > 253
    {
        return Err(WriteError::Name(name));
    }
    let text = serde_yaml_ng::to_string(node).map_err(|source| WriteError::Serialize {
        name: name.clone(),
        source,
    })?;
    let path = dir.join(egress_node_file_name(&name));
    if std::fs::read_to_string(&path).is_ok_and(|old| old == text) {
        return Ok(false);
    }
    let io_error = |path: &Path, source| WriteError::Io {
        name: name.clone(),
        path: path.to_owned(),
        source,
    };
    // Hidden and not `.yaml`: the reader never picks up a half-written file.
    let tmp = dir.join(format!(
        ".egressnode-{name}.yaml.{}.tmp",
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_error(&tmp, e));
    }
    std::fs::rename(&tmp, &path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_error(&path, e)
    })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::api::{EgressNodeSpec, EgressNodeStatus, HeldEgressIp, NodeInterface};

    const GOOD: &str = r#"
# a comment before the first document
---
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: payments}}
---
apiVersion: v1
kind: Node
metadata: {name: gw-1, labels: {egress.dev/gateway: "true"}}
status:
  addresses:
  - {type: Hostname, address: gw-1}
  - {type: InternalIP, address: 10.0.0.11}
  conditions:
  - {type: Ready, status: "True"}
---
apiVersion: v1
kind: Pod
metadata: {name: api-0, namespace: shop, labels: {app: api}}
spec:
  nodeName: worker-1
  containers: [{name: c, image: x}]
status:
  phase: Running
  podIPs: [{ip: 10.244.1.5}]
---
apiVersion: egress.dev/v1alpha1
kind: EgressGatewayPolicy
metadata: {name: payments, generation: 3}
spec:
  gatewaySelector: {matchLabels: {egress.dev/gateway: "true"}}
  rules:
  - destinations: ["192.0.2.0/24"]
    egressIP: 198.51.100.10
---
apiVersion: egress.dev/v1alpha1
kind: EgressNode
metadata: {name: gw-1}
spec: {underlayIP: 10.0.0.11}
status:
  interfaces:
  - {name: ens224, up: true, addresses: ["198.51.100.2/24"]}
  egressIPs: [{ip: 198.51.100.10, interface: ens224}]
...
"#;

    #[test]
    fn good_documents_are_all_read() {
        let snap = load_str("cluster.yaml", GOOD);
        assert_eq!(snap.errors, []);
        assert_eq!(snap.view.namespaces.len(), 1);
        assert_eq!(snap.view.nodes.len(), 1);
        assert_eq!(snap.view.pods.len(), 1);
        assert_eq!(snap.view.policies.len(), 1);
        assert_eq!(snap.view.egress_nodes.len(), 1);
        let pod = &snap.view.pods[0];
        assert_eq!(pod.node_name.as_deref(), Some("worker-1"));
        assert_eq!(snap.view.policies[0].metadata.generation, Some(3));
        let en = &snap.view.egress_nodes[0];
        assert_eq!(en.spec.underlay_ip.as_deref(), Some("10.0.0.11"));
    }

    fn messages(snap: &Snapshot) -> Vec<String> {
        snap.errors.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn bad_documents_are_reported_and_never_hide_good_ones() {
        let text = r#"
apiVersion: v1
kind: Namespace
metadata: {name: one}
---
apiVersion: v1
kind: Pod
metadata: {name: x, namespace: default}
status:
  podIPs: [{ip: 1.2.3}]
---
apiVersion: v1
kind: Pod
metadata: {name: y}
spec: {nodeName: [not, a, string]}
---
this: [is, not: valid
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: d}
---
kind: Node
metadata: {name: n}
---
apiVersion: v1
kind: Node
metadata: {labels: {a: b}}
---
apiVersion: v1
kind: Namespace
metadata: {name: one}
---
apiVersion: egress.dev/v1alpha1
kind: EgressNode
metadata: {name: gw-9}
status:
  interfaces: [{name: ens224, up: true, addresses: ["198.51.100.2"]}]
---
apiVersion: v1
kind: Namespace
metadata: {name: two}
"#;
        let snap = load_str("pods.yaml", text);
        let got = messages(&snap);
        let expected = [
            r#"file pods.yaml doc 2 (Pod default/x): status.podIPs[0].ip: invalid IP address "1.2.3""#,
            "file pods.yaml doc 3 (Pod default/y): spec.nodeName: invalid type: sequence, expected a string",
            "file pods.yaml doc 4: failed to parse YAML:",
            "file pods.yaml doc 5 (Deployment d): kind: unsupported apiVersion/kind apps/v1/Deployment",
            "file pods.yaml doc 6: apiVersion: missing or not a string",
            "file pods.yaml doc 7 (Node): metadata.name: missing or empty",
            "file pods.yaml doc 8 (Namespace one): metadata.name: duplicate object: already defined in file pods.yaml doc 1",
            "file pods.yaml doc 9 (EgressNode gw-9): status.interfaces[0].addresses[0]: invalid address with prefix length \"198.51.100.2\"",
        ];
        assert_eq!(got.len(), expected.len(), "{got:#?}");
        for (g, e) in got.iter().zip(expected) {
            assert!(
                g.starts_with(e),
                "got {g:?}, expected it to start with {e:?}"
            );
        }
        let names: Vec<_> = snap
            .view
            .namespaces
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        assert_eq!(names, ["one", "two"]);
        assert!(snap.view.pods.is_empty());
    }

    #[test]
    fn documents_are_numbered_as_written() {
        let docs = split_documents("a: 1\n---\nb: 2\n--- {c: 3}\n");
        assert_eq!(
            docs,
            [
                (1, "a: 1\n".to_owned()),
                (2, "b: 2\n".to_owned()),
                (3, " {c: 3}\n".to_owned())
            ]
        );
        let docs = split_documents("# header\n---\nb: 2\n");
        assert_eq!(docs.len(), 1);
        assert_eq!(docs[0].0, 1);
    }

    fn egress_node(name: &str) -> EgressNode {
        let mut node = EgressNode::new(
            name,
            EgressNodeSpec {
                underlay_ip: Some("10.0.0.11".to_owned()),
            },
        );
        node.status = Some(EgressNodeStatus {
            interfaces: vec![NodeInterface {
                name: "ens224".to_owned(),
                up: true,
                addresses: vec!["198.51.100.2/24".to_owned()],
                ..Default::default()
            }],
            egress_ips: vec![HeldEgressIp {
                ip: "198.51.100.10".to_owned(),
                interface: "ens224".to_owned(),
                ..Default::default()
            }],
            ..Default::default()
        });
        node
    }

    #[test]
    fn directory_reads_yaml_and_yml_files_and_skips_others() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("a.yaml"), GOOD).expect("write");
        std::fs::write(
            dir.path().join("b.yml"),
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: other}\n",
        )
        .expect("write");
        std::fs::write(dir.path().join("notes.txt"), "not yaml: [").expect("write");
        std::fs::write(dir.path().join(".hidden.yaml"), "not yaml: [").expect("write");
        let snap = load_dir(dir.path());
        assert_eq!(snap.errors, []);
        assert_eq!(snap.view.namespaces.len(), 2);
    }

    #[test]
    fn missing_directory_is_an_error_not_a_panic() {
        let snap = load_dir(Path::new("/nonexistent/egress-state"));
        assert_eq!(snap.errors.len(), 1);
        assert!(
            snap.errors[0]
                .to_string()
                .starts_with("failed to read directory /nonexistent/egress-state")
        );
    }

    #[test]
    fn egress_node_round_trips_through_its_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = egress_node("gw-1");
        assert!(write_egress_node(dir.path(), &node).expect("write"));
        assert!(!write_egress_node(dir.path(), &node).expect("rewrite"));
        let files: Vec<_> = std::fs::read_dir(dir.path())
            .expect("read_dir")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        assert_eq!(files, ["egressnode-gw-1.yaml"]);
        let snap = load_dir(dir.path());
        assert_eq!(snap.errors, []);
        assert_eq!(snap.view.egress_nodes, [node]);
        let mut bad = egress_node("../etc");
        bad.metadata.name = Some("../etc".to_owned());
        assert!(matches!(
            write_egress_node(dir.path(), &bad),
            Err(WriteError::Name(_))
        ));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn polling_alone_notices_an_edit_within_a_second() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("ns.yaml");
        std::fs::write(
            &file,
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n",
        )
        .expect("write");
        let cidrs = vec!["10.244.0.0/16".parse().expect("CIDR")];
        let mut rx = watch_with(
            dir.path().to_owned(),
            Duration::from_millis(200),
            Notifications::None,
            cidrs.clone(),
        )
        .await;
        assert_eq!(rx.borrow().view.cluster_cidrs, cidrs);
        assert_eq!(rx.borrow_and_update().view.namespaces.len(), 1);

        // Same length, different content: only the mtime tells (past coarse timestamp
        // granularity).
        tokio::time::sleep(Duration::from_millis(50)).await;
        let start = Instant::now();
        std::fs::write(
            &file,
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: b}\n",
        )
        .expect("write");
        tokio::time::timeout(Duration::from_secs(1), rx.changed())
            .await
            .expect("no change within 1 s")
            .expect("watcher alive");
        let snap = rx.borrow_and_update().clone();
        assert_eq!(
            snap.view.namespaces[0].metadata.name.as_deref(),
            Some("b"),
            "after {:?}",
            start.elapsed()
        );
        assert_eq!(snap.view.cluster_cidrs, cidrs);

        // A new file.
        std::fs::write(
            dir.path().join("more.yml"),
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: c}\n",
        )
        .expect("write");
        tokio::time::timeout(Duration::from_secs(1), rx.changed())
            .await
            .expect("no change within 1 s")
            .expect("watcher alive");
        assert_eq!(rx.borrow().view.namespaces.len(), 2);

        // A file removed.
        std::fs::remove_file(&file).expect("remove");
        tokio::time::timeout(Duration::from_secs(1), rx.changed())
            .await
            .expect("no change within 1 s")
            .expect("watcher alive");
        assert_eq!(rx.borrow().view.namespaces.len(), 1);
    }

    /// The receiver's first snapshot (the current one included) for which `until` holds.
    /// Waits 10 s at most: the tests that use it poll once an hour, so whatever comes
    /// sooner came through inotify. (Not a timing assertion: a loaded machine takes
    /// milliseconds.)
    async fn wait_for(
        rx: &mut tokio_watch::Receiver<Arc<Snapshot>>,
        until: impl Fn(&Snapshot) -> bool,
    ) -> Arc<Snapshot> {
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let snap = rx.borrow_and_update().clone();
                if until(&snap) {
                    return snap;
                }
                rx.changed().await.expect("watcher alive");
            }
        })
        .await
        .expect("no matching snapshot within 10 s (inotify)")
    }

    fn names(snap: &Snapshot) -> Vec<&str> {
        snap.view
            .namespaces
            .iter()
            .filter_map(|n| n.metadata.name.as_deref())
            .collect()
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn inotify_notices_an_editors_write_and_rename() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("ns.yaml");
        let ns =
            |name: &str| format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}}}\n");
        std::fs::write(&file, ns("a")).expect("write");
        let mut rx = watch(dir.path(), HOUR, Vec::new()).await;
        assert_eq!(names(&rx.borrow_and_update()), ["a"]);

        // An editor's save: a backup, a temporary file renamed over the original.
        std::fs::write(dir.path().join("ns.yaml~"), ns("a")).expect("write backup");
        let tmp = dir.path().join(".ns.yaml.swp");
        std::fs::write(&tmp, ns("b")).expect("write temporary");
        std::fs::rename(&tmp, &file).expect("rename");
        let snap = wait_for(&mut rx, |s| names(s) != ["a"]).await;
        assert_eq!(names(&snap), ["b"]);
        assert_eq!(snap.errors, []);

        // Rewritten in place with the same length: named by inotify, so read even if the
        // mtime did not move.
        std::fs::write(&file, ns("c")).expect("write");
        let snap = wait_for(&mut rx, |s| names(s) != ["b"]).await;
        assert_eq!(names(&snap), ["c"]);

        // Removed.
        std::fs::remove_file(&file).expect("remove");
        let snap = wait_for(&mut rx, |s| names(s).is_empty()).await;
        assert_eq!(snap.errors, []);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_half_written_file_is_reported_and_read_again_once_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("a.yaml"),
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n",
        )
        .expect("write");
        let mut rx = watch(dir.path(), HOUR, Vec::new()).await;
        assert_eq!(names(&rx.borrow_and_update()), ["a"]);

        // Written in place, cut in the middle of its second document.
        let whole = "apiVersion: v1\nkind: Namespace\nmetadata: {name: b}\n---\n\
                     apiVersion: v1\nkind: Namespace\nmetadata: {name: c, labels: {x: y}}\n";
        let half = &whole[..whole.len() - 12];
        let file = dir.path().join("b.yaml");
        std::fs::write(&file, half).expect("write half");
        let snap = wait_for(&mut rx, |s| !s.errors.is_empty()).await;
        assert_eq!(names(&snap), ["a", "b"], "good documents are kept");
        assert_eq!(snap.errors.len(), 1);
        assert!(
            snap.errors[0]
                .to_string()
                .starts_with("file b.yaml doc 2: failed to parse YAML"),
            "{}",
            snap.errors[0]
        );

        // The rest of the file.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&file)
            .and_then(|mut f| f.write_all(&whole.as_bytes()[half.len()..]))
            .expect("append");
        let snap = wait_for(&mut rx, |s| s.errors.is_empty()).await;
        assert_eq!(names(&snap), ["a", "b", "c"]);
    }
}
