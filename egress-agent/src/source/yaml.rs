//! A directory of multi-document YAML files as the source of cluster state: Nodes,
//! Namespaces, Pods, EgressGatewayPolicies and EgressNodes, exactly as Kubernetes serves
//! them (`apiVersion`, `kind`, `metadata`, `spec`, `status`).
//!
//! Reading never stops at a bad document: each one is reported ([`DocumentError`], naming
//! file, document, object and field) and left out, and every good one is kept; the
//! watcher ([`watch`]) serves the last good version of an object whose file or document
//! broke. Files, documents and nesting are bounded ([`MAX_FILE_BYTES`],
//! [`MAX_DOCUMENT_BYTES`], [`MAX_DEPTH`]) before the YAML parser sees them. The agent
//! writes only its own `egressnode-<node>.yaml` there ([`write_egress_node`]), never
//! through a link planted in the directory.

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
use k8s_openapi::api::{
    core::v1::{Namespace, Node, Pod},
    networking::v1::NetworkPolicy,
};
use serde::de::DeserializeOwned;
use tokio::sync::watch as tokio_watch;

use super::{ClusterView, PodSummary, admin, ovn};
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
    #[error("{0}")]
    Kept(#[from] Kept),
}

/// Objects served from their last good version because what now stands for them could not
/// be read (only the watcher remembers: [`load_dir`] never keeps anything).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept {
    /// File name, relative to the directory.
    pub file: String,
    /// The document that stands for the one object kept; `None` when the whole file is
    /// kept (empty, unreadable, or with a document whose object cannot be told).
    pub doc: Option<usize>,
    /// What is wrong, after "file F" (`is empty`, `could not be read`, ...).
    pub reason: String,
    /// `Kind namespace/name` or `Kind name` of each object kept, in file order.
    pub objects: Vec<String>,
}

/// How many kept objects an error names before it counts the rest.
const KEPT_NAMED: usize = 5;

impl fmt::Display for Kept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "file {} ", self.file)?;
        if let Some(doc) = self.doc {
            write!(f, "doc {doc} ")?;
        }
        write!(f, "{}: keeping the last good version of ", self.reason)?;
        let named = self.objects.iter().take(KEPT_NAMED);
        for (i, object) in named.enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(object)?;
        }
        if let Some(more) = self
            .objects
            .len()
            .checked_sub(KEPT_NAMED)
            .filter(|&n| n > 0)
        {
            write!(f, " and {more} more")?;
        }
        match self.doc {
            Some(_) => {
                f.write_str(" until the document is fixed (deleting the document removes it)")
            }
            None => f.write_str(" until the file is fixed (deleting the file removes them)"),
        }
    }
}

impl std::error::Error for Kept {}

/// Largest state file read, in bytes (64 MiB), checked before reading and while reading.
/// The largest legitimate file is a dump of a big cluster: 100 000 pods written compactly
/// (name, namespace, a few labels, node, phase, two IPs: about 350 bytes each) take about
/// 35 MB. A full `kubectl get -o yaml` dump (5 to 15 kB a pod) of such a cluster fits no
/// sane limit: trim it, or split it into several files.
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// Largest document parsed, in bytes (2 MiB): no Kubernetes object is bigger (etcd takes
/// 1.5 MiB per request by default). The parser's memory grows several times faster than
/// the document, so a bigger one is refused before the parser sees it.
pub const MAX_DOCUMENT_BYTES: usize = 2 << 20;

/// Deepest nesting of a document, flow brackets (`[`, `{`) and indentation levels
/// together, checked by a linear scan before the YAML parser sees the text (which slows
/// down badly on deep nesting). Kubernetes objects nest about 10 deep.
pub const MAX_DEPTH: usize = 64;

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
    /// `view` (though the last good version of its object may be: [`LoadError::Kept`]).
    pub errors: Vec<LoadError>,
}

/// Does the reader consider this file name? `*.yaml` and `*.yml`, not hidden.
fn is_state_file(name: &str) -> bool {
    !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml"))
}

/// The state files of `dir`, sorted by name, and the names of symbolic links among them
/// that lead out of it (refused).
fn list_files(dir: &Path) -> Result<Listing, LoadError> {
    let read_dir_error = |e: std::io::Error| LoadError::ReadDir {
        dir: dir.to_owned(),
        detail: e.to_string(),
    };
    let mut files = Vec::new();
    let mut refused = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_dir_error)? {
        let entry = entry.map_err(read_dir_error)?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if !is_state_file(&name) {
            continue;
        }
        // Follow symlinks that stay inside the directory: a file linked in counts as the
        // file. One that leads out of it (the agent reads as root) is refused.
        let path = entry.path();
        if path.is_symlink() {
            let inside = std::fs::canonicalize(dir)
                .ok()
                .zip(std::fs::canonicalize(&path).ok())
                .is_some_and(|(d, target)| target.parent() == Some(d.as_path()));
            if !inside {
                refused.push(name);
                continue;
            }
        }
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if meta.is_file() {
            files.push((name, meta));
        }
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    refused.sort();
    Ok(Listing { files, refused })
}

/// What [`list_files`] found.
struct Listing {
    files: Vec<(String, std::fs::Metadata)>,
    refused: Vec<String>,
}

/// Why a symbolic link among the state files is not followed.
const LEADS_OUT: &str = "a symbolic link that leads out of the state directory (the agent \
                         reads as root): not followed; copy the file in, or link to a file \
                         in the directory";

/// "the file is N bytes, over the limit ..."
fn too_large(bytes: impl fmt::Display) -> String {
    format!(
        "the file is {bytes} bytes, over the limit of {} MiB per state file; split it into \
         several files",
        MAX_FILE_BYTES >> 20
    )
}

/// Read one state file as text: a regular file (opened without blocking, so a FIFO swapped
/// in is refused, not waited on) of at most [`MAX_FILE_BYTES`], judged from its metadata
/// before reading and enforced while reading (it may grow meanwhile).
fn read_state_file(path: &Path) -> Result<String, String> {
    use std::{io::Read as _, os::unix::fs::OpenOptionsExt as _};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".to_owned());
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(too_large(meta.len()));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or_default());
    (&file)
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large(format!("over {MAX_FILE_BYTES}")));
    }
    let after = file.metadata().map_err(|e| e.to_string())?;
    if (after.len(), after.modified().ok()) != (meta.len(), meta.modified().ok())
        || bytes.len() as u64 != after.len()
    {
        return Err(CHANGED_WHILE_READ.to_owned());
    }
    String::from_utf8(bytes).map_err(|e| format!("not UTF-8: {}", e.utf8_error()))
}

/// What [`read_state_file`] says of a file written to while it read it.
const CHANGED_WHILE_READ: &str = "the file changed while it was read";

/// How often a file that changes while it is read is read again before it counts as
/// unreadable (its last good version kept) until the next change.
const READ_ATTEMPTS: u32 = 5;

/// [`read_state_file`], again while the file changes under the read (a writer appending
/// in place), [`READ_ATTEMPTS`] times at most.
fn read_stable_file(path: &Path) -> Result<String, String> {
    let mut attempt = 1;
    loop {
        match read_state_file(path) {
            Err(e) if e == CHANGED_WHILE_READ && attempt < READ_ATTEMPTS => {
                attempt += 1;
                std::thread::sleep(QUIET);
            }
            other => return other,
        }
    }
}

/// Read every state file of `dir`. Pure: nothing is remembered from earlier reads, so an
/// unreadable file or document is simply left out (the watcher keeps last good versions
/// instead: [`watch`]).
pub fn load_dir(dir: &Path) -> Snapshot {
    read_dir_remembering(dir, &LastGood::default()).0
}

/// Parse one file's text as if it were file `name` of a directory (for tests and tools).
pub fn load_str(name: &str, text: &str) -> Snapshot {
    let mut loader = Loader::default();
    loader.add_file(name, text, &LastGood::default());
    loader.finish().0
}

/// Read every state file of `dir`, keeping from `last` the last good version of each object
/// whose file or document can no longer be read. Returns where each object of the view came
/// from, for the next read's [`LastGood`].
fn read_dir_remembering(dir: &Path, last: &LastGood) -> (Snapshot, Origins) {
    let mut loader = Loader::default();
    match list_files(dir) {
        Err(e) => {
            loader.errors.push(e);
            for file in last.files.keys() {
                loader.keep_file(file, "is in a directory that could not be listed", last);
            }
        }
        Ok(Listing { files, refused }) => {
            for name in refused {
                loader.errors.push(LoadError::ReadFile {
                    file: name.clone(),
                    detail: LEADS_OUT.to_owned(),
                });
                loader.keep_file(&name, "could not be read", last);
            }
            for (name, _) in files {
                match read_stable_file(&dir.join(&name)) {
                    Ok(text) => loader.add_file(&name, &text, last),
                    Err(detail) => {
                        loader.errors.push(LoadError::ReadFile {
                            file: name.clone(),
                            detail,
                        });
                        loader.keep_file(&name, "could not be read", last);
                    }
                }
            }
        }
    }
    loader.finish()
}

/// One document of a file.
#[derive(Debug, PartialEq, Eq)]
struct Document<'a> {
    /// 1-based position in the file.
    number: usize,
    /// 1-based line of the file its text starts on.
    line: usize,
    text: &'a str,
}

/// Split a YAML stream into its documents, borrowing the text. A leading `---` does not
/// open an empty first document.
fn split_documents(text: &str) -> Vec<Document<'_>> {
    let mut docs = Vec::new();
    let mut number = 1;
    let (mut start, mut start_line) = (0, 1);
    // Only blank and comment lines so far.
    let mut leading = true;
    let mut offset = 0;
    for (i, line) in text.split_inclusive('\n').enumerate() {
        let bare = line.trim_end_matches(['\n', '\r']);
        let marker = bare == "---" || bare.starts_with("--- ") || bare.starts_with("---\t");
        if marker {
            if !leading {
                docs.push(Document {
                    number,
                    line: start_line,
                    text: &text[start..offset],
                });
                number += 1;
            }
            leading = false;
            // What follows the marker on its line (`--- {a: 1}`) belongs to the document.
            if bare[3..].trim().is_empty() {
                (start, start_line) = (offset + line.len(), i + 2);
            } else {
                (start, start_line) = (offset + 3, i + 1);
            }
        } else if !bare.trim().is_empty() && !bare.trim_start().starts_with('#') {
            leading = false;
        }
        offset += line.len();
    }
    docs.push(Document {
        number,
        line: start_line,
        text: &text[start..],
    });
    docs
}

/// The first line of `text` (1-based) where nesting goes deeper than `max`, counting flow
/// collections (`[`, `{`) and block indentation levels (each `- ` of a compact sequence
/// too) together. Linear, and cautious: quoted scalars, comments and block scalars (`|`,
/// `>`) are skipped; a bracket inside a plain scalar is not counted.
fn too_deep(text: &str, max: usize) -> Option<usize> {
    let mut depth = Depth {
        max,
        ..Depth::default()
    };
    text.lines()
        .position(|line| depth.too_deep(line))
        .map(|i| i + 1)
}

/// [`too_deep`]'s state between lines.
#[derive(Default)]
struct Depth {
    max: usize,
    /// Columns of the open block levels.
    levels: Vec<usize>,
    /// Open flow collections.
    flow: usize,
    /// An open quoted scalar (its quote), which may span lines.
    quote: Option<u8>,
    /// Inside a block scalar: the column its content must be deeper than.
    block_scalar: Option<usize>,
}

impl Depth {
    /// Read the next line: whether nesting goes deeper than `max` on it.
    fn too_deep(&mut self, line: &str) -> bool {
        let bytes = line.as_bytes();
        let indent = bytes.iter().take_while(|&&b| b == b' ').count();
        let blank = bytes[indent..].iter().all(u8::is_ascii_whitespace);
        if let Some(parent) = self.block_scalar {
            if blank || indent > parent {
                return false;
            }
            self.block_scalar = None;
        }
        if blank && self.quote.is_none() {
            return false;
        }
        let mut pos = indent;
        if self.quote.is_none() && self.flow == 0 {
            if bytes[indent] == b'#' {
                return false;
            }
            pos = self.open_block_levels(bytes, indent);
            if self.levels.len() > self.max {
                return true;
            }
        }
        self.scan(line, pos)
    }

    /// Close the block levels deeper than `indent` and open this line's (its own, and
    /// one at each entry's content for `- - x` and `- key: v`). Returns where the
    /// content starts.
    fn open_block_levels(&mut self, bytes: &[u8], indent: usize) -> usize {
        while self.levels.last().is_some_and(|&top| top > indent) {
            self.levels.pop();
        }
        if self.levels.last() != Some(&indent) {
            self.levels.push(indent);
        }
        let mut pos = indent;
        while bytes.get(pos) == Some(&b'-') && matches!(bytes.get(pos + 1), None | Some(b' ')) {
            pos += 1;
            while bytes.get(pos) == Some(&b' ') {
                pos += 1;
            }
            if pos < bytes.len() {
                self.levels.push(pos);
            }
        }
        pos
    }

    /// Scan `line` from `pos` for quotes, flow collections and block scalar headers:
    /// whether flow nesting goes deeper than `max`.
    fn scan(&mut self, line: &str, mut pos: usize) -> bool {
        let bytes = line.as_bytes();
        // Could a flow collection, quoted or block scalar start here?
        let mut token_start = self.quote.is_none();
        let mut after_space = true;
        while pos < bytes.len() {
            let b = bytes[pos];
            pos += 1;
            if let Some(q) = self.quote {
                match (q, b) {
                    (b'"', b'\\') => pos += 1,
                    (b'\'', b'\'') if bytes.get(pos) == Some(&b'\'') => pos += 1,
                    _ if b == q => self.quote = None,
                    _ => {}
                }
                after_space = false;
                continue;
            }
            match b {
                b'#' if after_space => break,
                b'"' | b'\'' if token_start => self.quote = Some(b),
                b'[' | b'{' if token_start || self.flow > 0 => {
                    self.flow += 1;
                    if self.levels.len() + self.flow > self.max {
                        return true;
                    }
                }
                b']' | b'}' if self.flow > 0 => self.flow -= 1,
                b'|' | b'>' if token_start && self.flow == 0 => {
                    let header = bytes[pos..]
                        .iter()
                        .take_while(|b| matches!(b, b'-' | b'+' | b'0'..=b'9'))
                        .count();
                    let rest = line[pos + header..].trim_start();
                    if rest.is_empty() || rest.starts_with('#') {
                        self.block_scalar = Some(self.levels.last().copied().unwrap_or(0));
                        break;
                    }
                }
                _ => {}
            }
            let space = b == b' ' || b == b'\t';
            token_start = match b {
                _ if space => token_start,
                b'[' | b'{' | b',' => self.flow > 0 || token_start,
                b':' => matches!(bytes.get(pos), None | Some(b' ' | b'\t')),
                _ => false,
            };
            after_space = space;
        }
        false
    }
}

/// Key of an object for duplicate detection: (kind, namespace, name).
type ObjectKey = (String, String, String);

/// `Kind namespace/name` or `Kind name`.
fn object_label((kind, namespace, name): &ObjectKey) -> String {
    if namespace.is_empty() {
        format!("{kind} {name}")
    } else {
        format!("{kind} {namespace}/{name}")
    }
}

/// Where an object sits in a [`ClusterView`]: its list and index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Pod(usize),
    Node(usize),
    Namespace(usize),
    Policy(usize),
    EgressNode(usize),
    OvnEgressIp(usize),
    NetworkPolicy(usize),
    Unapplied(usize),
}

/// Where each object of a view came from: file → object → (document, slot).
type Origins = BTreeMap<String, BTreeMap<ObjectKey, (usize, Slot)>>;

/// What the watcher remembers between reads: the last snapshot it published and where each
/// of its objects came from. Shares the published snapshot rather than copying objects, so
/// a big directory is not held twice.
#[derive(Clone, Debug, Default)]
struct LastGood {
    snapshot: Arc<Snapshot>,
    files: Origins,
}

impl LastGood {
    /// The object `key` last read from `file`, and its document.
    fn object(&self, file: &str, key: &ObjectKey) -> Option<(usize, Added)> {
        let &(doc, slot) = self.files.get(file)?.get(key)?;
        Some((doc, self.take(slot)?))
    }

    /// Every object last read from `file`, in document order.
    fn objects(&self, file: &str) -> Vec<(ObjectKey, usize, Added)> {
        let mut objects: Vec<_> = self
            .files
            .get(file)
            .into_iter()
            .flatten()
            .filter_map(|(key, &(doc, slot))| Some((key.clone(), doc, self.take(slot)?)))
            .collect();
        objects.sort_by_key(|(_, doc, _)| *doc);
        objects
    }

    fn take(&self, slot: Slot) -> Option<Added> {
        let view = &self.snapshot.view;
        Some(match slot {
            Slot::Pod(i) => Added::Pod(view.pods.get(i)?.clone()),
            Slot::Node(i) => Added::Node(Box::new(view.nodes.get(i)?.clone())),
            Slot::Namespace(i) => Added::Namespace(Box::new(view.namespaces.get(i)?.clone())),
            Slot::Policy(i) => Added::Policy(Box::new(view.policies.get(i)?.clone())),
            Slot::EgressNode(i) => Added::EgressNode(Box::new(view.egress_nodes.get(i)?.clone())),
            Slot::OvnEgressIp(i) => {
                Added::OvnEgressIp(Box::new(view.ovn_egress_ips.get(i)?.clone()))
            }
            Slot::NetworkPolicy(i) => {
                Added::NetworkPolicy(Box::new(view.network_policies.get(i)?.clone()))
            }
            Slot::Unapplied(i) => Added::Unapplied(view.unapplied.get(i)?.clone()),
        })
    }
}

#[derive(Default)]
struct Loader {
    view: ClusterView,
    errors: Vec<LoadError>,
    /// Where each object was first seen: (file, doc).
    seen: BTreeMap<ObjectKey, (String, usize)>,
    origins: Origins,
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

/// What one document holds.
enum Parsed {
    /// Nothing (comments only).
    Empty,
    Object(ObjectKey, Added),
    /// Unusable; `key` says which object it stands for, when that much could be read.
    Invalid {
        key: Option<ObjectKey>,
        errors: Vec<LoadError>,
    },
}

impl Loader {
    fn finish(self) -> (Snapshot, Origins) {
        let snapshot = Snapshot {
            view: self.view,
            errors: self.errors,
        };
        (snapshot, self.origins)
    }

    /// Read one file's documents. An invalid document whose object is known keeps that
    /// object's last good version; a file that is empty or has a document whose object
    /// cannot be told keeps every object last read from it that no valid document
    /// replaced.
    fn add_file(&mut self, file: &str, text: &str, last: &LastGood) {
        let mut empty = true;
        let mut unknown = Vec::new();
        for doc in split_documents(text) {
            match parse_document(file, &doc) {
                Parsed::Empty => continue,
                Parsed::Object(key, added) => self.insert(file, doc.number, key, added),
                Parsed::Invalid {
                    key: Some(key),
                    errors,
                } => {
                    self.errors.extend(errors);
                    if !self.seen.contains_key(&key)
                        && let Some((_, added)) = last.object(file, &key)
                    {
                        self.errors.push(LoadError::Kept(Kept {
                            file: file.to_owned(),
                            doc: Some(doc.number),
                            reason: "is invalid".to_owned(),
                            objects: vec![object_label(&key)],
                        }));
                        self.insert(file, doc.number, key, added);
                    }
                }
                Parsed::Invalid { key: None, errors } => {
                    self.errors.extend(errors);
                    unknown.push(doc.number.to_string());
                }
            }
            empty = false;
        }
        if empty {
            self.keep_file(file, "is empty", last);
        } else if !unknown.is_empty() {
            let reason = format!(
                "has documents whose object cannot be told (doc {})",
                unknown.join(", ")
            );
            self.keep_file(file, &reason, last);
        }
    }

    /// Keep every object last read from `file` that this read has not seen yet (a valid
    /// current version anywhere wins), and say so.
    fn keep_file(&mut self, file: &str, reason: &str, last: &LastGood) {
        let mut kept = Vec::new();
        for (key, doc, added) in last.objects(file) {
            if !self.seen.contains_key(&key) {
                kept.push(object_label(&key));
                self.insert(file, doc, key, added);
            }
        }
        if !kept.is_empty() {
            self.errors.push(LoadError::Kept(Kept {
                file: file.to_owned(),
                doc: None,
                reason: reason.to_owned(),
                objects: kept,
            }));
        }
    }

    /// Add an object to the view, unless another document already defined it.
    fn insert(&mut self, file: &str, doc: usize, key: ObjectKey, added: Added) {
        if let Some((first_file, first_doc)) = self.seen.get(&key) {
            self.errors.push(LoadError::Document(DocumentError {
                file: file.to_owned(),
                doc,
                object: Some(object_label(&key)),
                field: Some("metadata.name".to_owned()),
                message: format!(
                    "duplicate object: already defined in file {first_file} doc {first_doc}"
                ),
            }));
            return;
        }
        /// Push, and say where.
        fn push<T>(list: &mut Vec<T>, item: T) -> usize {
            list.push(item);
            list.len() - 1
        }
        let view = &mut self.view;
        let slot = match added {
            Added::Pod(p) => Slot::Pod(push(&mut view.pods, p)),
            Added::Node(n) => Slot::Node(push(&mut view.nodes, *n)),
            Added::Namespace(n) => Slot::Namespace(push(&mut view.namespaces, *n)),
            Added::Policy(p) => Slot::Policy(push(&mut view.policies, *p)),
            Added::EgressNode(n) => Slot::EgressNode(push(&mut view.egress_nodes, *n)),
            Added::OvnEgressIp(e) => Slot::OvnEgressIp(push(&mut view.ovn_egress_ips, *e)),
            Added::NetworkPolicy(n) => Slot::NetworkPolicy(push(&mut view.network_policies, *n)),
            Added::Unapplied(u) => Slot::Unapplied(push(&mut view.unapplied, u)),
        };
        self.seen.insert(key.clone(), (file.to_owned(), doc));
        self.origins
            .entry(file.to_owned())
            .or_default()
            .insert(key, (doc, slot));
    }
}

/// Parse and check one document: bounded in size and depth before the YAML parser sees it.
fn parse_document(file: &str, doc: &Document<'_>) -> Parsed {
    let error = |object: Option<String>, field: Option<String>, message: String| {
        LoadError::Document(DocumentError {
            file: file.to_owned(),
            doc: doc.number,
            object,
            field,
            message,
        })
    };
    let value = match read_value(doc) {
        Ok(Some(v)) => v,
        Ok(None) => return Parsed::Empty,
        Err(message) => {
            return Parsed::Invalid {
                key: None,
                errors: vec![error(None, None, message)],
            };
        }
    };
    let (api_version, key, value) = match identify(value) {
        Ok(identified) => identified,
        Err((kind, field, message)) => {
            return Parsed::Invalid {
                key: None,
                errors: vec![error(kind, Some(field.to_owned()), message)],
            };
        }
    };
    let object = Some(object_label(&key));
    match decode(&api_version, &key.0, value) {
        Ok(added) => Parsed::Object(key, added),
        Err(field_errors) => Parsed::Invalid {
            key: Some(key),
            errors: field_errors
                .into_iter()
                .map(|fe| error(object.clone(), fe.field, fe.message))
                .collect(),
        },
    }
}

/// The document as a JSON value within the size and depth limits; `None` for an empty
/// document; the message when it is not a YAML mapping.
fn read_value(doc: &Document<'_>) -> Result<Option<serde_json::Value>, String> {
    if doc.text.len() > MAX_DOCUMENT_BYTES {
        return Err(format!(
            "failed to parse YAML: the document is {} bytes, over the limit of {} MiB per \
             object",
            doc.text.len(),
            MAX_DOCUMENT_BYTES >> 20
        ));
    }
    if let Some(line) = too_deep(doc.text, MAX_DEPTH) {
        return Err(format!(
            "failed to parse YAML: nested deeper than {MAX_DEPTH} levels (brackets and \
             indentation together) at line {}",
            doc.line + line - 1
        ));
    }
    // Through YAML's own value first: its mappings refuse a key given twice (a second
    // `destinations:` in a rule, a label repeated), where a JSON object would keep the
    // last silently.
    let yaml: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(doc.text).map_err(|e| format!("failed to parse YAML: {e}"))?;
    let value = serde_json::to_value(&yaml).map_err(|e| format!("failed to read YAML: {e}"))?;
    if value.is_null() {
        return Ok(None);
    }
    if !value.is_object() {
        return Err("failed to read object: the document is not a mapping".to_owned());
    }
    Ok(Some(value))
}

/// An object's apiVersion and key (kind, namespace, name), with the value (an EgressNode
/// given an empty spec if it had none); else (the kind if known, the field, what is
/// wrong with it).
#[allow(clippy::type_complexity)]
fn identify(
    mut value: serde_json::Value,
) -> Result<(String, ObjectKey, serde_json::Value), (Option<String>, &'static str, String)> {
    let text_field = |value: &serde_json::Value, key: &str| {
        value
            .get(key)
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
    };
    let missing = || "missing or not a string".to_owned();
    let api_version = text_field(&value, "apiVersion").ok_or((None, "apiVersion", missing()))?;
    let kind = text_field(&value, "kind").ok_or((None, "kind", missing()))?;
    // The agent's own EgressNodes always have a spec; hand-written ones may omit it.
    if kind == "EgressNode"
        && let Some(map) = value.as_object_mut()
    {
        map.entry("spec")
            .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
    }
    let meta_text = |key: &str| {
        value
            .get("metadata")
            .and_then(|m| m.get(key))
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
    };
    let namespace = if kind == "Pod" {
        meta_text("namespace").unwrap_or_else(|| "default".to_owned())
    } else {
        String::new()
    };
    if let Err(message) = dns_name(&namespace, true) {
        return Err((Some(kind), "metadata.namespace", message));
    }
    let Some(name) = meta_text("name").filter(|n| !n.is_empty()) else {
        return Err((Some(kind), "metadata.name", "missing or empty".to_owned()));
    };
    // A Namespace's name is a DNS label, the others' a DNS subdomain, as the API server
    // requires: a 1 MB name would otherwise be in every line that names the object.
    if let Err(message) = dns_name(&name, kind == "Namespace") {
        return Err((Some(kind), "metadata.name", message));
    }
    Ok((api_version, (kind, namespace, name), value))
}

/// Longest DNS label (a Namespace's name, a label's name part), as Kubernetes allows.
const MAX_LABEL: usize = 63;
/// Longest DNS subdomain (most objects' names, a label key's prefix).
const MAX_SUBDOMAIN: usize = 253;

/// At most `limit` characters of `text`, for messages.
fn shown(text: &str) -> String {
    const SHOWN: usize = 64;
    if text.chars().count() <= SHOWN {
        format!("{text:?}")
    } else {
        let head: String = text.chars().take(SHOWN).collect();
        format!("{head:?}... ({} bytes)", text.len())
    }
}

/// Whether `name` is a DNS label (`label`) or subdomain, as Kubernetes names are (empty:
/// none given, fine); the message if not.
fn dns_name(name: &str, label: bool) -> Result<(), String> {
    if name.is_empty() {
        return Ok(());
    }
    let (limit, what) = if label {
        (MAX_LABEL, "a DNS label")
    } else {
        (MAX_SUBDOMAIN, "a DNS subdomain")
    };
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !p.starts_with('-')
            && !p.ends_with('-')
    };
    let ok = name.len() <= limit
        && if label {
            part_ok(name)
        } else {
            name.split('.').all(|p| p.len() <= MAX_LABEL && part_ok(p))
        };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{} is not {what} (at most {limit} characters: lowercase letters, digits and \
             '-'{}, starting and ending with a letter or digit)",
            shown(name),
            if label {
                ""
            } else {
                ", in parts joined by '.'"
            }
        ))
    }
}

/// Whether `key` and `value` make a Kubernetes label (`[prefix/]name`, name and value
/// at most 63 characters of letters, digits, `-`, `_` and `.`, beginning and ending with
/// a letter or digit; the prefix a DNS subdomain); the message if not.
fn label_ok(key: &str, value: &str) -> Result<(), String> {
    let part_ok = |p: &str, empty_ok: bool| {
        (empty_ok && p.is_empty())
            || (p.len() <= MAX_LABEL
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
                && p.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
                && p.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric()))
    };
    let (prefix, name) = key
        .rsplit_once('/')
        .map_or((None, key), |(p, n)| (Some(p), n));
    if let Some(prefix) = prefix
        && (prefix.is_empty() || dns_name(prefix, false).is_err())
    {
        return Err(format!(
            "key {}: its prefix is not a DNS subdomain",
            shown(key)
        ));
    }
    if !part_ok(name, false) {
        return Err(format!(
            "key {}: the name part must be 1 to 63 letters, digits, '-', '_' or '.', \
             beginning and ending with a letter or digit",
            shown(key)
        ));
    }
    if !part_ok(value, true) {
        return Err(format!(
            "key {}: value {} must be at most 63 letters, digits, '-', '_' or '.', \
             beginning and ending with a letter or digit",
            shown(key),
            shown(value)
        ));
    }
    Ok(())
}

/// Most addresses a Pod lists in `status.podIPs`: one of each family, as the API server
/// allows.
const MAX_POD_IPS: usize = 2;

/// The label checks of `value`'s `metadata.labels`.
fn check_labels(value: &serde_json::Value) -> Vec<FieldError> {
    let labels = value
        .get("metadata")
        .and_then(|m| m.get("labels"))
        .and_then(serde_json::Value::as_object);
    labels
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| {
            let v = v.as_str().unwrap_or_default();
            label_ok(k, v)
                .err()
                .map(|m| field_error("metadata.labels", m))
        })
        .take(KEPT_NAMED)
        .collect()
}

/// The object `value` of `api_version` and `kind`, typed and checked.
fn decode(
    api_version: &str,
    kind: &str,
    value: serde_json::Value,
) -> Result<Added, Vec<FieldError>> {
    let labels = check_labels(&value);
    if !labels.is_empty() {
        return Err(labels);
    }
    match (api_version, kind) {
        ("v1", "Pod") => typed::<Pod>(value, check_pod).map(|p| Added::Pod(PodSummary::from(&p))),
        ("v1", "Node") => typed::<Node>(value, check_node).map(|n| Added::Node(Box::new(n))),
        ("v1", "Namespace") => {
            typed::<Namespace>(value, |_| Vec::new()).map(|n| Added::Namespace(Box::new(n)))
        }
        (API_VERSION, "EgressGatewayPolicy") => {
            // Rule contents are the compiler's to judge (as conditions), like the API
            // server would let a CEL-less cluster store them.
            typed::<EgressGatewayPolicy>(value, |_| Vec::new()).map(|p| Added::Policy(Box::new(p)))
        }
        (API_VERSION, "EgressNode") => {
            typed::<EgressNode>(value, check_egress_node).map(|n| Added::EgressNode(Box::new(n)))
        }
        (ovn::API_VERSION, ovn::KIND) => {
            typed::<ovn::EgressIP>(value, |_| Vec::new()).map(|e| Added::OvnEgressIp(Box::new(e)))
        }
        ("networking.k8s.io/v1", "NetworkPolicy") => {
            typed::<NetworkPolicy>(value, check_network_policy)
                .map(|n| Added::NetworkPolicy(Box::new(n)))
        }
        (admin::ANP_API_VERSION, "AdminNetworkPolicy") => {
            typed::<admin::AdminNetworkPolicy>(value, |_| Vec::new())
                .map(|o| Added::Unapplied(admin::Unapplied::of("AdminNetworkPolicy", &o.metadata)))
        }
        (admin::ANP_API_VERSION, "BaselineAdminNetworkPolicy") => {
            typed::<admin::BaselineAdminNetworkPolicy>(value, |_| Vec::new()).map(|o| {
                Added::Unapplied(admin::Unapplied::of(
                    "BaselineAdminNetworkPolicy",
                    &o.metadata,
                ))
            })
        }
        (admin::OVN_API_VERSION, "EgressFirewall") => {
            typed::<admin::EgressFirewall>(value, |_| Vec::new())
                .map(|o| Added::Unapplied(admin::Unapplied::of("EgressFirewall", &o.metadata)))
        }
        _ => Err(vec![field_error(
            "kind",
            format!(
                "unsupported apiVersion/kind {api_version}/{kind} (expected v1 Pod, Node or \
                 Namespace, {API_VERSION} EgressGatewayPolicy or EgressNode, \
                 networking.k8s.io/v1 NetworkPolicy, {} AdminNetworkPolicy or \
                 BaselineAdminNetworkPolicy, or {} {} or EgressFirewall)",
                admin::ANP_API_VERSION,
                ovn::API_VERSION,
                ovn::KIND
            ),
        )]),
    }
}

/// A NetworkPolicy's checks: what the compiler reads of it must read (each error names
/// its field), as the API server would have refused it.
fn check_network_policy(np: &NetworkPolicy) -> Vec<FieldError> {
    match crate::compiler::netpol::parse(np) {
        Ok(_) => Vec::new(),
        Err(errors) => errors
            .into_iter()
            .map(|e| match e.split_once(": ") {
                Some((field, message)) => field_error(field, message.to_owned()),
                None => FieldError {
                    field: None,
                    message: e,
                },
            })
            .collect(),
    }
}

#[derive(Clone)]
enum Added {
    /// Only what the compiler reads: the whole `Pod` is dropped at once.
    Pod(PodSummary),
    Node(Box<Node>),
    Namespace(Box<Namespace>),
    Policy(Box<EgressGatewayPolicy>),
    EgressNode(Box<EgressNode>),
    OvnEgressIp(Box<ovn::EgressIP>),
    NetworkPolicy(Box<NetworkPolicy>),
    Unapplied(admin::Unapplied),
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
        let ips = status.pod_ips.as_deref().unwrap_or_default();
        for (i, ip) in ips.iter().enumerate() {
            check_ip(format!("status.podIPs[{i}].ip"), &ip.ip, &mut out);
        }
        let parsed: Vec<IpAddr> = ips.iter().filter_map(|i| i.ip.parse().ok()).collect();
        if ips.len() > MAX_POD_IPS
            || (parsed.len() == 2 && parsed[0].is_ipv6() == parsed[1].is_ipv6())
        {
            out.push(field_error(
                "status.podIPs",
                format!(
                    "{} addresses: a Pod has at most {MAX_POD_IPS}, one of each family",
                    ips.len()
                ),
            ));
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
        .map(|listing| {
            let refused = listing.refused.into_iter().map(|name| (name, None, 0));
            listing
                .files
                .into_iter()
                .map(|(name, meta)| (name, meta.modified().ok(), meta.len()))
                .chain(refused)
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
    /// State files written in place (not renamed into the directory), by name: whether
    /// the writer has closed the file since its last write. Read only once closed and
    /// [`SETTLE`] old: a file written in several parts is read whole.
    in_place: std::sync::Mutex<BTreeMap<String, bool>>,
}

/// How long a state file written in place must stay unmodified (after its writer closed
/// it) before it is read: a file written in two parts 50 ms apart is read once, whole.
/// Files renamed into the directory (what writers should do) are read at once.
pub const SETTLE: Duration = Duration::from_millis(100);
/// The longest a read waits for files written in place to settle; then they are read as
/// they are, and again once written.
pub const MAX_SETTLE: Duration = Duration::from_secs(2);

/// An inotify watch (through `notify`) on the directory itself, not recursive.
struct DirWatch {
    _watcher: notify::RecommendedWatcher,
    /// (device, inode) of the directory watched: a directory replaced under the watch
    /// (removed and created again) has a new one.
    identity: (u64, u64),
}

/// Track state files written in place: a write opens (or keeps open) one, a close after
/// writing ends it, a rename into the directory or a removal forgets it.
fn note_write(pending: &Pending, event: &notify::Event) {
    use notify::{
        EventKind,
        event::{AccessKind, AccessMode, ModifyKind, RenameMode},
    };
    let names = event
        .paths
        .iter()
        .filter_map(|p| p.file_name().and_then(|n| n.to_str()))
        .filter(|n| is_state_file(n));
    let mut in_place = pending
        .in_place
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for name in names {
        match event.kind {
            EventKind::Modify(ModifyKind::Name(RenameMode::To | RenameMode::Both))
            | EventKind::Remove(_) => {
                in_place.remove(name);
            }
            EventKind::Modify(ModifyKind::Name(_)) => {}
            EventKind::Create(_) | EventKind::Modify(_) => {
                in_place.insert(name.to_owned(), false);
            }
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => {
                if let Some(closed) = in_place.get_mut(name) {
                    *closed = true;
                }
            }
            _ => {}
        }
    }
}

/// Wait (at most [`MAX_SETTLE`]) until every state file written in place is closed and
/// [`SETTLE`] old, forgetting those that are.
async fn settle(dir: &Path, pending: &Pending) {
    let deadline = tokio::time::Instant::now() + MAX_SETTLE;
    loop {
        let unsettled = {
            let mut in_place = pending
                .in_place
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            in_place.retain(|name, closed| {
                let age = std::fs::metadata(dir.join(name))
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok());
                // Gone or unreadable: nothing to wait for.
                let Some(age) = age else {
                    return false;
                };
                !*closed || age < SETTLE
            });
            !in_place.is_empty()
        };
        if !unsettled || tokio::time::Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep(QUIET).await;
    }
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
            if let Ok(e) = &event {
                note_write(&sink, e);
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
///
/// A broken edit never withdraws an object: the watcher remembers the last good version of
/// each object and where it came from. A file that is empty, cannot be read (too large,
/// not UTF-8, ...) or has a document whose object cannot be told (a YAML syntax error, a
/// document cut short or not a mapping) keeps every object last read from it that no
/// valid document replaced; an invalid document whose object is known keeps that object.
/// Each case is reported ([`LoadError::Kept`]). Deleting the file (or the document) removes
/// its objects.
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
    let (mut last, first, origins) =
        read_with_fingerprint(dir.clone(), &cluster_cidrs, Arc::default()).await;
    let (tx, rx) = tokio_watch::channel(Arc::new(first));
    // What the next read keeps objects from: the snapshot published (shared, not copied).
    let mut last_good = Arc::new(LastGood {
        snapshot: Arc::clone(&tx.borrow()),
        files: origins,
    });
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
                settle(&dir, &pending).await;
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
            let (seen, snapshot, origins) =
                read_with_fingerprint(dir.clone(), &cluster_cidrs, Arc::clone(&last_good)).await;
            last = seen;
            tx.send_if_modified(|current| {
                if **current == snapshot {
                    false
                } else {
                    *current = Arc::new(snapshot);
                    true
                }
            });
            // Equal snapshots list their objects in the same order: `origins` fits either.
            last_good = Arc::new(LastGood {
                snapshot: Arc::clone(&tx.borrow()),
                files: origins,
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
/// next tick, so it is never missed. Objects whose file or document can no longer be read
/// keep their version in `last`. The view carries `cluster_cidrs`.
async fn read_with_fingerprint(
    dir: PathBuf,
    cluster_cidrs: &[ipnet::IpNet],
    last: Arc<LastGood>,
) -> (Fingerprint, Snapshot, Origins) {
    let fallback_dir = dir.clone();
    let fallback = Arc::clone(&last);
    let cluster_cidrs = cluster_cidrs.to_vec();
    tokio::task::spawn_blocking(move || {
        let seen = fingerprint(&dir);
        let (mut snapshot, origins) = read_dir_remembering(&dir, &last);
        snapshot.view.cluster_cidrs = cluster_cidrs;
        (seen, snapshot, origins)
    })
    .await
    .unwrap_or_else(|e| {
        // Serve the last snapshot as it was: the same objects in the same places.
        let error = LoadError::ReadDir {
            dir: fallback_dir,
            detail: format!("reader task failed: {e}"),
        };
        let snapshot = Snapshot {
            view: fallback.snapshot.view.clone(),
            errors: vec![error.clone()],
        };
        (Err(error.to_string()), snapshot, fallback.files.clone())
    })
}

/// File name of a node's EgressNode document in the state directory.
pub fn egress_node_file_name(node: &str) -> String {
    format!("egressnode-{node}.yaml")
}

/// Write `node` as `egressnode-<name>.yaml` in `dir`, atomically (temporary file, then
/// rename). Returns whether the file changed: an identical file is left alone, so that
/// watchers do not wake up for nothing.
///
/// The agent runs as root in a directory others may write to, so nothing is written
/// through a link: the temporary file is created afresh (`O_EXCL | O_NOFOLLOW`, under a
/// new name when one is taken) and renamed over the target, which replaces a link there
/// rather than following it; the old file is compared without following a link either.
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
    if read_own_file(&path, text.len()).is_some_and(|old| old == text.as_bytes()) {
        return Ok(false);
    }
    let io_error = |path: &Path, source| WriteError::Io {
        name: name.clone(),
        path: path.to_owned(),
        source,
    };
    let (tmp, mut file) = create_temporary(dir, &name).map_err(|e| io_error(dir, e))?;
    let written = file
        .write_all(text.as_bytes())
        .and_then(|()| file.sync_all());
    drop(file);
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_error(&tmp, e));
    }
    std::fs::rename(&tmp, &path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_error(&path, e)
    })?;
    Ok(true)
}

/// The YAML source's [`StatusWriter`](super::StatusWriter): this node's EgressNode as a
/// file in the state directory ([`write_egress_node`]); policy statuses and Events have
/// no file of their own (the agent logs them, `egress-agent status` shows them).
pub struct DirWriter(pub PathBuf);

impl super::StatusWriter for DirWriter {
    fn egress_node(&self, doc: &EgressNode) -> anyhow::Result<()> {
        write_egress_node(&self.0, doc).map(drop).map_err(|e| {
            anyhow::anyhow!(
                "failed to publish EgressNode {}: {e}",
                doc.metadata.name.as_deref().unwrap_or_default()
            )
        })
    }

    fn policy_statuses(&self, _: &BTreeMap<String, crate::api::PolicyStatus>) {}

    fn event(&self, _: super::Event) {}
}

/// The contents of `path` if it is a regular file of at most `limit` bytes, read without
/// following a link (or blocking on a FIFO).
fn read_own_file(path: &Path, limit: usize) -> Option<Vec<u8>> {
    use std::{io::Read as _, os::unix::fs::OpenOptionsExt as _};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut bytes = Vec::new();
    file.take(limit as u64 + 1).read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

/// How many temporary names [`create_temporary`] tries before giving up.
const TEMPORARY_ATTEMPTS: u32 = 64;
/// Numbers the temporary files of this process.
static TEMPORARY_COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Create a new temporary file in `dir` for node `name`'s EgressNode: hidden and not
/// `.yaml` (the reader never picks up a half-written file), named after the pid and a
/// counter, created exclusively and never through a link (a name already taken, by a
/// stale file or a planted link, is skipped for the next one).
fn create_temporary(dir: &Path, name: &str) -> std::io::Result<(PathBuf, std::fs::File)> {
    use std::os::unix::fs::OpenOptionsExt as _;
    for _ in 0..TEMPORARY_ATTEMPTS {
        let n = TEMPORARY_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(
            ".egressnode-{name}.yaml.{}.{n}.tmp",
            std::process::id()
        ));
        // `create_new` is O_CREAT | O_EXCL: it never follows a link at the path either.
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
        {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AlreadyExists,
        format!("no free temporary file name after {TEMPORARY_ATTEMPTS} attempts"),
    ))
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
        let doc = |number, line, text| Document { number, line, text };
        assert_eq!(
            split_documents("a: 1\n---\nb: 2\n--- {c: 3}\n"),
            [
                doc(1, 1, "a: 1\n"),
                doc(2, 3, "b: 2\n"),
                doc(3, 4, " {c: 3}\n")
            ]
        );
        assert_eq!(
            split_documents("# header\n---\nb: 2\n"),
            [doc(1, 3, "b: 2\n")]
        );
        assert_eq!(split_documents(""), [doc(1, 1, "")]);
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
        std::fs::write(dir.path().join("b.yml"), namespace_doc("other")).expect("write");
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
        std::fs::write(&file, namespace_doc("a")).expect("write");
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
        std::fs::write(&file, namespace_doc("b")).expect("write");
        next_change(&mut rx).await;
        let snap = rx.borrow_and_update().clone();
        assert_eq!(
            snap.view.namespaces[0].metadata.name.as_deref(),
            Some("b"),
            "after {:?}",
            start.elapsed()
        );
        assert_eq!(snap.view.cluster_cidrs, cidrs);

        // A new file.
        std::fs::write(dir.path().join("more.yml"), namespace_doc("c")).expect("write");
        next_change(&mut rx).await;
        assert_eq!(rx.borrow().view.namespaces.len(), 2);

        // A file removed.
        std::fs::remove_file(&file).expect("remove");
        next_change(&mut rx).await;
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

    /// A Namespace document for `name`.
    fn namespace_doc(name: &str) -> String {
        format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}}}\n")
    }

    /// Waits for the next snapshot, 1 s at most.
    async fn next_change(rx: &mut tokio_watch::Receiver<Arc<Snapshot>>) {
        tokio::time::timeout(Duration::from_secs(1), rx.changed())
            .await
            .expect("no change within 1 s")
            .expect("watcher alive");
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
        std::fs::write(&file, namespace_doc("a")).expect("write");
        let mut rx = watch(dir.path(), HOUR, Vec::new()).await;
        assert_eq!(names(&rx.borrow_and_update()), ["a"]);

        // An editor's save: a backup, a temporary file renamed over the original.
        std::fs::write(dir.path().join("ns.yaml~"), namespace_doc("a")).expect("write backup");
        let tmp = dir.path().join(".ns.yaml.swp");
        std::fs::write(&tmp, namespace_doc("b")).expect("write temporary");
        std::fs::rename(&tmp, &file).expect("rename");
        let snap = wait_for(&mut rx, |s| names(s) != ["a"]).await;
        assert_eq!(names(&snap), ["b"]);
        assert_eq!(snap.errors, []);

        // Rewritten in place with the same length: named by inotify, so read even if the
        // mtime did not move.
        std::fs::write(&file, namespace_doc("c")).expect("write");
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
        std::fs::write(dir.path().join("a.yaml"), namespace_doc("a")).expect("write");
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

    /// Every view the watcher sends until one has `want`, by the namespaces' names.
    async fn views_until(
        rx: &mut tokio_watch::Receiver<Arc<Snapshot>>,
        want: &[&str],
    ) -> Vec<Vec<String>> {
        let mut seen = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                rx.changed().await.expect("watcher alive");
                let now: Vec<String> = names(&rx.borrow_and_update())
                    .into_iter()
                    .map(str::to_owned)
                    .collect();
                let done = now == want;
                seen.push(now);
                if done {
                    return;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("never saw {want:?}; saw {seen:?}"));
        seen
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_file_written_in_place_in_two_parts_is_applied_whole_not_half() {
        // The issue's probe: a file written in place in two parts 50 ms apart had its
        // first half applied (an egress IP released and taken again). Both ways a writer
        // may do it: one open file, or a write and then an append.
        for reopen in [false, true] {
            let dir = tempfile::tempdir().expect("tempdir");
            let file = dir.path().join("p.yaml");
            std::fs::write(&file, namespace_doc("a") + "---\n" + &namespace_doc("b"))
                .expect("write");
            let mut rx = watch(dir.path(), HOUR, Vec::new()).await;
            assert_eq!(names(&rx.borrow_and_update()), ["a", "b"]);
            let second = "---\n".to_owned() + &namespace_doc("c");
            let mut f = Some(std::fs::File::create(&file).expect("truncate"));
            if let Some(f) = &mut f {
                f.write_all(namespace_doc("a").as_bytes())
                    .expect("first part");
            }
            if reopen {
                f = None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut f = f.unwrap_or_else(|| {
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(&file)
                    .expect("reopen")
            });
            f.write_all(second.as_bytes()).expect("second part");
            drop(f);
            let seen = views_until(&mut rx, &["a", "c"]).await;
            assert_eq!(seen, [["a", "c"]], "reopen {reopen}: every view sent");
        }
    }

    #[test]
    fn network_policies_are_read_and_their_mistakes_named_by_field() {
        let good = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
                    metadata: {name: https-only, namespace: shop}\n\
                    spec:\n  podSelector: {}\n  policyTypes: [Egress]\n  egress:\n  \
                    - to: [{ipBlock: {cidr: 192.0.2.0/24, except: [192.0.2.0/28]}}]\n    \
                    ports: [{protocol: TCP, port: 8000, endPort: 8080}]\n";
        let snap = load_str("np.yaml", good);
        assert_eq!(snap.errors, []);
        assert_eq!(snap.view.network_policies.len(), 1);
        let cases = [
            (
                "cidr: 192.0.2.0/24, except: [198.51.100.0/28]",
                "spec.egress[0].to[0].ipBlock.except[0]: 198.51.100.0/28 must be strictly inside 192.0.2.0/24",
            ),
            (
                "cidr: 192.0.2.1/24",
                "spec.egress[0].to[0].ipBlock.cidr: 192.0.2.1/24 has host bits set",
            ),
            (
                "cidr: nope",
                "spec.egress[0].to[0].ipBlock.cidr: \"nope\" is not a CIDR",
            ),
        ];
        for (block, want) in cases {
            let doc = good.replace("cidr: 192.0.2.0/24, except: [192.0.2.0/28]", block);
            let snap = load_str("np.yaml", &doc);
            let text = messages(&snap).join("\n");
            assert!(text.contains(want), "{want:?} in {text}");
            assert!(snap.view.network_policies.is_empty());
        }
        let doc = good.replace("endPort: 8080", "endPort: 80");
        let text = messages(&load_str("np.yaml", &doc)).join("\n");
        assert!(
            text.contains(
                "spec.egress[0].ports[0].endPort: 80 must be a port (to 65535) at least port 8000"
            ),
            "{text}"
        );
    }

    #[test]
    fn names_labels_and_pod_addresses_are_bounded_as_the_api_server_bounds_them() {
        let long = "a".repeat(1 << 20);
        let cases = [
            (
                format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {long}}}\n"),
                "metadata.name: \"aaaa",
            ),
            (
                "apiVersion: v1\nkind: Namespace\nmetadata: {name: Shop_1}\n".to_owned(),
                "metadata.name: \"Shop_1\" is not a DNS label",
            ),
            (
                "apiVersion: v1\nkind: Node\nmetadata: {name: w1.example.com}\n".to_owned(),
                "",
            ),
            (
                format!(
                    "apiVersion: v1\nkind: Namespace\nmetadata: {{name: a, labels: {{team: {}}}}}\n",
                    "x".repeat(64)
                ),
                "metadata.labels: key \"team\": value",
            ),
            (
                "apiVersion: v1\nkind: Namespace\nmetadata: {name: a, labels: {\"-x\": y}}\n"
                    .to_owned(),
                "metadata.labels: key \"-x\": the name part",
            ),
            (
                "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: shop}\n\
                 spec: {nodeName: w1}\nstatus: {phase: Running, podIPs: [{ip: 10.0.0.1}, \
                 {ip: 10.0.0.2}]}\n"
                    .to_owned(),
                "status.podIPs: 2 addresses: a Pod has at most 2, one of each family",
            ),
        ];
        for (doc, want) in cases {
            let snap = load_str("x.yaml", &doc);
            let text = messages(&snap).join("\n");
            if want.is_empty() {
                assert_eq!(snap.errors, [], "{doc:.80}");
                continue;
            }
            assert!(text.contains(want), "{want:?} in {text:.300}");
            assert!(text.len() < 1024, "a bounded message: {} bytes", text.len());
            assert!(snap.view.namespaces.is_empty() && snap.view.pods.is_empty());
        }
    }

    #[test]
    fn a_symlink_out_of_the_directory_is_refused_and_one_inside_followed() {
        use std::os::unix::fs::symlink;
        let outside = tempfile::tempdir().expect("tempdir");
        let secret = outside.path().join("secret.yaml");
        std::fs::write(&secret, ns("secret", "x")).expect("write");
        let mut r = Rereader::new();
        // A file of the directory that is no state file itself, linked in under a state
        // file's name.
        r.write("real.txt", &ns("a", "x"));
        symlink(&secret, r.dir.path().join("out.yaml")).expect("symlink");
        symlink(r.dir.path().join("real.txt"), r.dir.path().join("in.yml")).expect("symlink");
        let snap = r.read();
        assert!(
            !teams(&snap).iter().any(|t| t.starts_with("secret")),
            "{:?}",
            teams(&snap)
        );
        assert!(teams(&snap).contains(&"a:x".to_owned()));
        let text = messages(&snap).join("\n");
        assert!(
            text.contains(
                "failed to read file out.yaml: a symbolic link that leads out of the \
                           state directory"
            ),
            "{text}"
        );
        assert!(!text.contains("in.yml"), "{text}");
    }

    /// Reads a directory again and again, remembering like the watcher does.
    struct Rereader {
        dir: tempfile::TempDir,
        last: LastGood,
    }

    impl Rereader {
        fn new() -> Self {
            Self {
                dir: tempfile::tempdir().expect("tempdir"),
                last: LastGood::default(),
            }
        }

        fn write(&self, file: &str, text: &str) -> &Self {
            std::fs::write(self.dir.path().join(file), text).expect("write");
            self
        }

        fn read(&mut self) -> Snapshot {
            let (snapshot, files) = read_dir_remembering(self.dir.path(), &self.last);
            self.last = LastGood {
                snapshot: Arc::new(snapshot.clone()),
                files,
            };
            snapshot
        }
    }

    fn ns(name: &str, team: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}, labels: {{team: {team}}}}}\n"
        )
    }

    fn teams(snap: &Snapshot) -> Vec<String> {
        snap.view
            .namespaces
            .iter()
            .map(|n| {
                let name = n.metadata.name.clone().unwrap_or_default();
                let team = n.metadata.labels.as_ref().and_then(|l| l.get("team"));
                format!("{name}:{}", team.map_or("", String::as_str))
            })
            .collect()
    }

    #[test]
    fn a_file_that_breaks_as_a_whole_keeps_its_objects_until_fixed_or_deleted() {
        let whole = format!("{}---\n{}", ns("a", "x"), ns("b", "x"));
        let breakages = [
            ("garbage", "this: [is, not: valid\n".to_owned()),
            ("empty", String::new()),
            (
                "blank and comments",
                "\n  \n# nothing yet\n---\n".to_owned(),
            ),
            ("not a mapping", "- a\n- b\n".to_owned()),
            ("cut in doc 1", whole[..20].to_owned()),
            (
                "first doc fixed, second cut",
                format!("{}---\nkind: Names", ns("a", "y")),
            ),
        ];
        for (case, broken) in breakages {
            let mut r = Rereader::new();
            r.write("other.yaml", &ns("c", "x"));
            r.write("ns.yaml", &whole);
            assert_eq!(teams(&r.read()), ["a:x", "b:x", "c:x"], "{case}");

            r.write("ns.yaml", &broken)
                .write("other.yaml", &ns("c", "y"));
            let snap = r.read();
            let expected_teams = if case == "first doc fixed, second cut" {
                ["a:y", "b:x", "c:y"]
            } else {
                ["a:x", "b:x", "c:y"]
            };
            assert_eq!(teams(&snap), expected_teams, "{case}");
            let kept = messages(&snap).pop().unwrap_or_default();
            let objects = if case == "first doc fixed, second cut" {
                "Namespace b"
            } else {
                "Namespace a, Namespace b"
            };
            assert!(kept.starts_with("file ns.yaml "), "{case}: {kept}");
            assert!(
                kept.ends_with(&format!(
                    ": keeping the last good version of {objects} until the file is fixed \
                     (deleting the file removes them)"
                )),
                "{case}: {kept}"
            );
            // Remembered across reads, not only once.
            assert_eq!(teams(&r.read()), expected_teams, "{case}");
            // Without history (`check`, tools) nothing is kept.
            let pure = load_dir(r.dir.path());
            assert!(!teams(&pure).contains(&"b:x".to_owned()), "{case}");

            r.write("ns.yaml", &format!("{}---\n{}", ns("a", "z"), ns("b", "z")));
            let snap = r.read();
            assert_eq!(teams(&snap), ["a:z", "b:z", "c:y"], "{case}");
            assert_eq!(snap.errors, [], "{case}");

            r.write("ns.yaml", &broken);
            let a = if case == "first doc fixed, second cut" {
                "a:y"
            } else {
                "a:z"
            };
            assert_eq!(teams(&r.read()), [a, "b:z", "c:y"], "{case}");
            std::fs::remove_file(r.dir.path().join("ns.yaml")).expect("remove");
            let snap = r.read();
            assert_eq!(
                teams(&snap),
                ["c:y"],
                "{case}: deleting the file removes them"
            );
            assert_eq!(snap.errors, [], "{case}");
        }
    }

    #[test]
    fn kept_objects_are_named_then_counted() {
        let mut r = Rereader::new();
        let many: Vec<String> = (0..8).map(|i| ns(&format!("n{i}"), "x")).collect();
        r.write("ns.yaml", &many.join("---\n"));
        assert_eq!(r.read().view.namespaces.len(), 8);
        r.write("ns.yaml", "");
        let snap = r.read();
        assert_eq!(snap.view.namespaces.len(), 8);
        assert_eq!(
            messages(&snap),
            [
                "file ns.yaml is empty: keeping the last good version of Namespace n0, \
                 Namespace n1, Namespace n2, Namespace n3, Namespace n4 and 3 more until the \
                 file is fixed (deleting the file removes them)"
            ]
        );
    }

    #[test]
    fn an_invalid_document_whose_object_is_known_keeps_only_that_object() {
        let pod = |ip: &str| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: p, namespace: shop}}\n\
                 status: {{podIPs: [{{ip: {ip}}}]}}\n"
            )
        };
        let mut r = Rereader::new();
        r.write(
            "f.yaml",
            &[ns("a", "x"), pod("10.0.0.1"), ns("b", "x")].join("---\n"),
        );
        let snap = r.read();
        assert_eq!(snap.errors, []);
        assert_eq!(teams(&snap), ["a:x", "b:x"]);

        // The pod turns invalid, namespace a changes, namespace b is removed.
        r.write("f.yaml", &[ns("a", "y"), pod("10.0.0")].join("---\n"));
        let snap = r.read();
        assert_eq!(teams(&snap), ["a:y"], "valid documents update as usual");
        assert_eq!(snap.view.pods.len(), 1);
        assert_eq!(
            snap.view.pods[0].ips,
            ["10.0.0.1".parse::<IpAddr>().expect("IP")]
        );
        assert_eq!(
            messages(&snap),
            [
                r#"file f.yaml doc 2 (Pod shop/p): status.podIPs[0].ip: invalid IP address "10.0.0""#,
                "file f.yaml doc 2 is invalid: keeping the last good version of Pod shop/p \
                 until the document is fixed (deleting the document removes it)",
            ]
        );
        assert!(
            load_dir(r.dir.path()).view.pods.is_empty(),
            "no history, nothing kept"
        );

        // Fixed, then deleted.
        r.write("f.yaml", &[ns("a", "y"), pod("10.0.0.2")].join("---\n"));
        let snap = r.read();
        assert_eq!(snap.errors, []);
        assert_eq!(
            snap.view.pods[0].ips,
            ["10.0.0.2".parse::<IpAddr>().expect("IP")]
        );
        r.write("f.yaml", &pod("10.0.0"));
        assert_eq!(r.read().view.pods.len(), 1);
        r.write("f.yaml", &ns("a", "y"));
        let snap = r.read();
        assert!(
            snap.view.pods.is_empty(),
            "deleting the document removes it"
        );
        assert_eq!(snap.errors, []);
    }

    #[test]
    fn a_key_given_twice_is_an_error_naming_it_not_the_last_one_winning() {
        // The issue's probes: a rule with a second `destinations` (the last, 0.0.0.0/0,
        // won), and a label given twice.
        let policy = "apiVersion: egress.dev/v1alpha1\nkind: EgressGatewayPolicy\n\
                      metadata: {name: p}\nspec:\n  rules:\n  - destinations: [192.0.2.0/24]\n\
                      \x20   egressIP: 198.51.100.10\n    destinations: [0.0.0.0/0]\n";
        let snap = load_str("p.yaml", policy);
        assert!(snap.view.policies.is_empty(), "{:?}", snap.view.policies);
        let text = messages(&snap).join("\n");
        assert!(
            text.contains("duplicate entry with key \"destinations\""),
            "{text}"
        );
        assert!(text.contains("p.yaml"), "{text}");
        let labels = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: a\n  labels:\n\
                      \x20   team: x\n    team: y\n";
        let snap = load_str("ns.yaml", labels);
        assert!(snap.view.namespaces.is_empty());
        assert!(
            messages(&snap)
                .join("\n")
                .contains("duplicate entry with key \"team\""),
            "{:?}",
            messages(&snap)
        );
    }

    #[test]
    fn a_file_over_the_size_limit_is_refused_unread_and_its_objects_kept() {
        let mut r = Rereader::new();
        r.write("big.yaml", &ns("a", "x"));
        assert_eq!(teams(&r.read()), ["a:x"]);
        // Sparse: refused from its metadata, never read.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(r.dir.path().join("big.yaml"))
            .expect("open");
        file.set_len(MAX_FILE_BYTES + 1).expect("set_len");
        let snap = r.read();
        assert_eq!(teams(&snap), ["a:x"]);
        assert_eq!(
            messages(&snap),
            [
                "failed to read file big.yaml: the file is 67108865 bytes, over the limit of \
                 64 MiB per state file; split it into several files",
                "file big.yaml could not be read: keeping the last good version of Namespace a \
                 until the file is fixed (deleting the file removes them)",
            ]
        );
    }

    #[test]
    fn a_document_over_the_size_limit_is_refused_before_parsing() {
        let big = format!(
            "{}---\n# {}\n",
            ns("a", "x"),
            "x".repeat(MAX_DOCUMENT_BYTES)
        );
        let snap = load_str("big.yaml", &big);
        assert_eq!(teams(&snap), ["a:x"]);
        assert_eq!(
            messages(&snap),
            [format!(
                "file big.yaml doc 2: failed to parse YAML: the document is {} bytes, over the \
                 limit of 2 MiB per object",
                MAX_DOCUMENT_BYTES + 3
            )]
        );
    }

    /// Deep nesting of every kind: (case, text, line of the file where it goes too deep).
    fn deep_documents() -> Vec<(&'static str, String, usize)> {
        let indented: String = (0..100)
            .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
            .collect();
        let dashes = format!("x:\n{}1\n", "- ".repeat(100));
        vec![
            ("200 kB of brackets", "[".repeat(200_000), 1),
            (
                "braces after a key",
                format!("a: 1\nb: {}", "{c: ".repeat(1000)),
                2,
            ),
            ("mixed", format!("a:\n  - {}\n", "[{".repeat(50)), 2),
            ("indentation", indented, MAX_DEPTH + 1),
            ("compact sequences", dashes, 2),
            (
                "brackets over lines",
                format!("a: [\n{}", "[\n".repeat(200)),
                MAX_DEPTH,
            ),
        ]
    }

    #[test]
    fn deep_nesting_is_refused_naming_file_and_line_before_parsing() {
        for (case, deep, line) in deep_documents() {
            let text = format!("{}---\n# comment\n{deep}", ns("a", "x"));
            let snap = load_str("deep.yaml", &text);
            assert_eq!(teams(&snap), ["a:x"], "{case}");
            assert_eq!(
                messages(&snap),
                [format!(
                    "file deep.yaml doc 2: failed to parse YAML: nested deeper than 64 levels \
                     (brackets and indentation together) at line {}",
                    line + 5
                )],
                "{case}"
            );
        }
    }

    #[test]
    fn ordinary_yaml_is_not_mistaken_for_deep_nesting() {
        let brackets = "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[";
        let texts = [
            GOOD.to_owned(),
            format!("a: \"{brackets}\"\nb: '{brackets}'\n"),
            format!("a: text{brackets}\nb: x # {brackets}\n# {brackets}\n"),
            format!("script: |\n  {brackets}\n\n  {brackets}\nnext: >-\n  {brackets}\nc: 1\n"),
            format!("- key: |\n    {brackets}\n  other: 1\n"),
            format!("a: \"multi\n  line {brackets}\n  end\"\nb: [1, \"]]]\", '[', {{c: d}}]\n"),
            format!("url: http://x/{brackets}\nd: 'it''s {brackets}'\n"),
            (0..1000).map(|i| format!("k{i}: [{{a: [1]}}]\n")).collect(),
        ];
        for text in texts {
            assert_eq!(too_deep(&text, MAX_DEPTH), None, "{text}");
        }
        // The line's own block level counts too.
        assert_eq!(too_deep(&"[".repeat(MAX_DEPTH - 1), MAX_DEPTH), None);
        assert_eq!(too_deep(&"[".repeat(MAX_DEPTH), MAX_DEPTH), Some(1));
    }

    #[test]
    fn egress_node_is_never_written_through_a_planted_link() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        let victim = outside.path().join("shadow");
        std::fs::write(&victim, "precious\n").expect("write");
        // Links at every temporary name this process could pick next, and at the target.
        let next = TEMPORARY_COUNTER.load(Ordering::Relaxed);
        for n in next..next + u64::from(TEMPORARY_ATTEMPTS) / 2 {
            let tmp = dir.path().join(format!(
                ".egressnode-gw-1.yaml.{}.{n}.tmp",
                std::process::id()
            ));
            symlink(&victim, tmp).expect("symlink");
        }
        let target = dir.path().join(egress_node_file_name("gw-1"));
        symlink(&victim, &target).expect("symlink");

        let node = egress_node("gw-1");
        let written = write_egress_node(dir.path(), &node);
        assert_eq!(
            std::fs::read_to_string(&victim).expect("read"),
            "precious\n",
            "the link's target is untouched"
        );
        assert!(written.expect("written under a free name"));
        assert!(!target.is_symlink(), "the link at the target was replaced");
        assert_eq!(load_dir(dir.path()).view.egress_nodes, [node]);
        let temporaries = std::fs::read_dir(dir.path())
            .expect("read_dir")
            .filter(|e| e.as_ref().is_ok_and(|e| !e.path().is_symlink()))
            .count();
        assert_eq!(temporaries, 1, "only the target, no temporary left behind");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_watcher_keeps_a_file_edited_to_garbage_and_takes_it_back_fixed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("ns.yaml");
        std::fs::write(&file, format!("{}---\n{}", ns("a", "x"), ns("b", "x"))).expect("write");
        let mut rx = watch(dir.path(), HOUR, Vec::new()).await;
        assert_eq!(teams(&rx.borrow_and_update()), ["a:x", "b:x"]);

        std::fs::write(&file, "apiVersion: v1\nkind: [Namespace\n").expect("write garbage");
        let snap = wait_for(&mut rx, |s| !s.errors.is_empty()).await;
        assert_eq!(teams(&snap), ["a:x", "b:x"], "the last good version stays");
        assert!(
            messages(&snap).iter().any(|m| m.starts_with(
                "file ns.yaml has documents whose object cannot be told (doc 1): keeping the \
                 last good version of Namespace a, Namespace b"
            )),
            "{:#?}",
            snap.errors
        );

        std::fs::write(&file, "").expect("write empty");
        let snap = wait_for(&mut rx, |s| {
            messages(s)
                .iter()
                .any(|m| m.starts_with("file ns.yaml is empty"))
        })
        .await;
        assert_eq!(teams(&snap), ["a:x", "b:x"]);

        std::fs::write(&file, ns("a", "y")).expect("write fixed");
        let snap = wait_for(&mut rx, |s| s.errors.is_empty()).await;
        assert_eq!(teams(&snap), ["a:y"], "back to what the file says");

        std::fs::write(&file, "{{{{").expect("write garbage");
        wait_for(&mut rx, |s| !s.errors.is_empty()).await;
        std::fs::remove_file(&file).expect("remove");
        let snap = wait_for(&mut rx, |s| s.errors.is_empty()).await;
        assert_eq!(
            teams(&snap),
            Vec::<String>::new(),
            "deleting the file removes them"
        );
    }
}
