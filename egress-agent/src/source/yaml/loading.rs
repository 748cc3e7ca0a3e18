//! Reading a directory of state files into a [`Snapshot`], keeping the last good version
//! of each object whose file or document broke (for the watcher).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    path::Path,
    sync::Arc,
    time::Duration,
};

use super::documents::{Added, ObjectKey, Parsed, object_label, parse_document, split_documents};
use crate::source::{ClusterView, DocumentError, Kept, LoadError, Snapshot};

/// Largest state file read, in bytes (64 MiB), checked before reading and while reading.
/// The largest legitimate file is a dump of a big cluster: 100 000 pods written compactly
/// (name, namespace, a few labels, node, phase, two IPs: about 350 bytes each) take about
/// 35 MB. A full `kubectl get -o yaml` dump (5 to 15 kB a pod) of such a cluster fits no
/// sane limit: trim it, or split it into several files.
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// Does the reader consider this file name? `*.yaml` and `*.yml`, not hidden.
pub(super) fn is_state_file(name: &str) -> bool {
    !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml"))
}

/// The state files of `dir`, sorted by name, and the names of symbolic links among them
/// that lead out of it (refused).
pub(super) fn list_files(dir: &Path) -> Result<Listing, LoadError> {
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
pub(super) struct Listing {
    pub(super) files: Vec<(String, std::fs::Metadata)>,
    pub(super) refused: Vec<String>,
}

/// Why a symbolic link among the state files is not followed.
pub(super) const LEADS_OUT: &str = "a symbolic link that leads out of the state directory (the agent \
                         reads as root): not followed; copy the file in, or link to a file \
                         in the directory";

/// "the file is N bytes, over the limit ..."
pub(super) fn too_large(bytes: impl fmt::Display) -> String {
    format!(
        "the file is {bytes} bytes, over the limit of {} MiB per state file; split it into \
         several files",
        MAX_FILE_BYTES >> 20
    )
}

/// Read one state file as text: a regular file (opened without blocking, so a FIFO swapped
/// in is refused, not waited on) of at most [`MAX_FILE_BYTES`], judged from its metadata
/// before reading and enforced while reading (it may grow meanwhile).
pub(super) fn read_state_file(path: &Path) -> Result<String, String> {
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
pub(super) const CHANGED_WHILE_READ: &str = "the file changed while it was read";

/// How long the directory must stay quiet after a change notification before it is read:
/// an editor's write-rename sequence, or a file written in several chunks, gives one read.
/// Also the wait between two reads of a file that changed under the first.
pub const QUIET: Duration = Duration::from_millis(15);

/// How often a file that changes while it is read is read again before it counts as
/// unreadable (its last good version kept) until the next change.
pub(super) const READ_ATTEMPTS: u32 = 5;

/// [`read_state_file`], again while the file changes under the read (a writer appending
/// in place), [`READ_ATTEMPTS`] times at most.
pub(super) fn read_stable_file(path: &Path) -> Result<String, String> {
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
    read_dir_remembering(dir, &LastGood::default(), &mut Parses::default()).0
}

/// Parse one file's text as if it were file `name` of a directory (for tests and tools).
pub fn load_str(name: &str, text: &str) -> Snapshot {
    let mut loader = Loader::default();
    loader.add_file(name, &parse_file(name, text), &LastGood::default());
    loader.finish().0
}

/// A state file's identity and version as listed (device, inode, modification and change
/// times, length): a file whose stamp has not changed since it was parsed has not been
/// replaced or written, save within the filesystem's timestamp granularity, which the
/// watcher covers by naming the files inotify saw written ([`Parses::written`]).
type Stamp = (u64, u64, i64, i64, i64, i64, u64);

fn stamp(meta: &std::fs::Metadata) -> Stamp {
    use std::os::unix::fs::MetadataExt as _;
    (
        meta.dev(),
        meta.ino(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.ctime(),
        meta.ctime_nsec(),
        meta.len(),
    )
}

/// A file's documents, numbered and parsed (shared: a read takes them from the last).
type Docs = Arc<[(usize, Parsed)]>;

/// Each state file's documents as last parsed and the stamp they were read at, kept by
/// the watcher from one read to the next: a read parses only the files that changed (a
/// policy edited in its own file does not read the cluster's pods again), and assembles
/// the view from every file's documents as a read of the whole directory would.
#[derive(Clone, Default)]
pub(super) struct Parses {
    files: BTreeMap<String, (Stamp, Docs)>,
    /// Files inotify saw written since the last read: parsed again whatever their stamp.
    pub(super) written: BTreeSet<String>,
    /// Files the last read parsed (the rest were taken as parsed before).
    pub(super) parsed: usize,
}

/// A directory read again and again as the watcher reads it, without the watching: the
/// last good version of each object kept, and each file's parse (for benchmarks and
/// tests).
#[derive(Default)]
pub struct Rereads {
    last: LastGood,
    parses: Parses,
}

impl Rereads {
    /// Read `dir` again, parsing only the files that changed since the last read (all of
    /// them with `whole`, as the watcher did before it kept parses). Returns the
    /// snapshot and how many files were parsed.
    pub fn read(&mut self, dir: &Path, whole: bool) -> (Arc<Snapshot>, usize) {
        if whole {
            self.parses = Parses::default();
        }
        let (snapshot, files) = read_dir_remembering(dir, &self.last, &mut self.parses);
        let snapshot = Arc::new(snapshot);
        self.last = LastGood {
            snapshot: Arc::clone(&snapshot),
            files,
        };
        (snapshot, self.parses.parsed)
    }

    /// Parse `file` again at the next read whatever its stamp (as inotify names a file
    /// written).
    pub fn written(&mut self, file: &str) {
        self.parses.written.insert(file.to_owned());
    }
}

/// Read every state file of `dir`, keeping from `last` the last good version of each object
/// whose file or document can no longer be read, and parsing only the files whose stamp
/// changed since `parses` saw them (kept up to date). Returns where each object of the
/// view came from, for the next read's [`LastGood`].
pub(super) fn read_dir_remembering(
    dir: &Path,
    last: &LastGood,
    parses: &mut Parses,
) -> (Snapshot, Origins) {
    let written = std::mem::take(&mut parses.written);
    parses.parsed = 0;
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
            parses
                .files
                .retain(|name, _| files.iter().any(|(listed, _)| listed == name));
            for (name, meta) in files {
                let stamp = stamp(&meta);
                if let Some((at, docs)) = parses.files.get(&name)
                    && *at == stamp
                    && !written.contains(&name)
                {
                    loader.add_file(&name, docs, last);
                    continue;
                }
                parses.files.remove(&name);
                match read_stable_file(&dir.join(&name)) {
                    Ok(text) => {
                        parses.parsed += 1;
                        let docs: Docs = parse_file(&name, &text).into();
                        loader.add_file(&name, &docs, last);
                        parses.files.insert(name, (stamp, docs));
                    }
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

/// Where an object sits in a [`ClusterView`]: its list and index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Slot {
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
pub(super) type Origins = BTreeMap<String, BTreeMap<ObjectKey, (usize, Slot)>>;

/// What the watcher remembers between reads: the last snapshot it published and where each
/// of its objects came from. Shares the published snapshot rather than copying objects, so
/// a big directory is not held twice.
#[derive(Clone, Debug, Default)]
pub(super) struct LastGood {
    pub(super) snapshot: Arc<Snapshot>,
    pub(super) files: Origins,
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

/// One file's documents, numbered and parsed.
fn parse_file(file: &str, text: &str) -> Vec<(usize, Parsed)> {
    split_documents(text)
        .iter()
        .map(|doc| (doc.number, parse_document(file, doc)))
        .collect()
}

#[derive(Default)]
pub(super) struct Loader {
    view: ClusterView,
    errors: Vec<LoadError>,
    /// Where each object was first seen: (file, doc).
    seen: BTreeMap<ObjectKey, (String, usize)>,
    origins: Origins,
}

impl Loader {
    /// The view, its pods in namespace and name order as the Kubernetes source hands
    /// them over (the compile then need not sort them, and a later view that differs in
    /// pods no policy selects patches its result: `compiler::delta`), and where each
    /// object came from.
    fn finish(mut self) -> (Snapshot, Origins) {
        let pods = &mut self.view.pods;
        let mut order: Vec<usize> = (0..pods.len()).collect();
        order.sort_by(|&a, &b| {
            (&pods[a].namespace, &pods[a].name).cmp(&(&pods[b].namespace, &pods[b].name))
        });
        if order.iter().enumerate().any(|(to, from)| to != *from) {
            let mut place = vec![0; order.len()];
            for (to, from) in order.iter().enumerate() {
                place[*from] = to;
            }
            *pods = order.iter().map(|from| Arc::clone(&pods[*from])).collect();
            for (_, slot) in self.origins.values_mut().flat_map(BTreeMap::values_mut) {
                if let Slot::Pod(i) = slot {
                    *i = place[*i];
                }
            }
        }
        let snapshot = Snapshot {
            view: self.view,
            errors: self.errors,
        };
        (snapshot, self.origins)
    }

    /// Take one file's documents (numbered, parsed). An invalid document whose object is
    /// known keeps that object's last good version; a file that is empty or has a
    /// document whose object cannot be told keeps every object last read from it that no
    /// valid document replaced.
    fn add_file(&mut self, file: &str, docs: &[(usize, Parsed)], last: &LastGood) {
        let mut empty = true;
        let mut unknown = Vec::new();
        for (number, parsed) in docs {
            let number = *number;
            match parsed.clone() {
                Parsed::Empty => continue,
                Parsed::Object(key, added) => self.insert(file, number, key, added),
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
                            doc: Some(number),
                            reason: "is invalid".to_owned(),
                            objects: vec![object_label(&key)],
                        }));
                        self.insert(file, number, key, added);
                    }
                }
                Parsed::Invalid { key: None, errors } => {
                    self.errors.extend(errors);
                    unknown.push(number.to_string());
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
            Added::EgressNode(n) => Slot::EgressNode(push(
                &mut view.egress_nodes,
                crate::source::view_egress_node(&n),
            )),
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

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::super::fixtures::*;
    use super::*;

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

    /// Reads a directory again and again, remembering like the watcher does: its last
    /// good objects, and its files' parses (a written file named as inotify names it).
    /// Every read is checked against a read that parses every file again.
    struct Rereader {
        dir: tempfile::TempDir,
        reads: Rereads,
    }

    impl Rereader {
        fn new() -> Self {
            Self {
                dir: tempfile::tempdir().expect("tempdir"),
                reads: Rereads::default(),
            }
        }

        fn write(&mut self, file: &str, text: &str) -> &mut Self {
            std::fs::write(self.dir.path().join(file), text).expect("write");
            self.reads.written(file);
            self
        }

        fn read(&mut self) -> Snapshot {
            let last = &self.reads.last;
            let whole = read_dir_remembering(self.dir.path(), last, &mut Parses::default());
            let snapshot = self.reads.read(self.dir.path(), false).0;
            assert_eq!(
                (&*snapshot, &self.reads.last.files),
                (&whole.0, &whole.1),
                "kept parses against a whole read"
            );
            Snapshot::clone(&snapshot)
        }
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

    /// A Pod document of `namespace/name` with address `ip`.
    fn pod_doc(namespace: &str, name: &str, ip: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}}}\n\
             spec: {{nodeName: w1}}\nstatus: {{phase: Running, podIP: {ip}}}\n"
        )
    }

    /// Each pod of `snap` as `namespace/name ip`, in the view's order.
    fn pods(snap: &Snapshot) -> Vec<String> {
        snap.view
            .pods
            .iter()
            .map(|p| format!("{}/{} {}", p.namespace, p.name, p.ips[0]))
            .collect()
    }

    #[test]
    fn pods_come_in_namespace_and_name_order_and_a_broken_file_keeps_its_own() {
        let mut r = Rereader::new();
        let a = [
            pod_doc("z", "p2", "10.0.0.2"),
            pod_doc("a", "p9", "10.0.0.9"),
            pod_doc("a", "p1", "10.0.0.1"),
        ];
        r.write("a.yaml", &a.join("---\n"))
            .write("b.yaml", &pod_doc("m", "p3", "10.0.0.3"));
        let sorted = [
            "a/p1 10.0.0.1",
            "a/p9 10.0.0.9",
            "m/p3 10.0.0.3",
            "z/p2 10.0.0.2",
        ];
        assert_eq!(pods(&r.read()), sorted);
        // Kept from the last read by where each pod sat in its view: still each its own.
        r.write("a.yaml", "this: [is, not: valid\n")
            .write("b.yaml", &pod_doc("m", "p3", "10.0.0.33"));
        let snap = r.read();
        assert_eq!(
            pods(&snap),
            [
                "a/p1 10.0.0.1",
                "a/p9 10.0.0.9",
                "m/p3 10.0.0.33",
                "z/p2 10.0.0.2"
            ]
        );
        assert_eq!(pods(&r.read()), pods(&snap), "and again");
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
    fn a_read_parses_only_the_files_that_changed() {
        let mut r = Rereader::new();
        r.write("a.yaml", &ns("a", "x"))
            .write("b.yaml", &ns("b", "x"));
        r.read();
        assert_eq!(r.reads.parses.parsed, 2);
        r.read();
        assert_eq!(r.reads.parses.parsed, 0, "nothing changed");
        r.write("b.yaml", &ns("b", "yy"));
        let snap = r.read();
        assert_eq!(r.reads.parses.parsed, 1);
        assert_eq!(teams(&snap), ["a:x", "b:yy"]);
        // Replaced by a rename, unnamed (polling): the stamp tells.
        let tmp = r.dir.path().join(".a.tmp");
        std::fs::write(&tmp, ns("a", "z")).expect("write");
        std::fs::rename(&tmp, r.dir.path().join("a.yaml")).expect("rename");
        let snap = r.read();
        assert_eq!(r.reads.parses.parsed, 1);
        assert_eq!(teams(&snap), ["a:z", "b:yy"]);
        std::fs::remove_file(r.dir.path().join("b.yaml")).expect("remove");
        let snap = r.read();
        assert_eq!(
            (r.reads.parses.parsed, teams(&snap)),
            (0, vec!["a:z".to_owned()])
        );
    }

    proptest::proptest! {
        /// Over any sequence of edits (good, broken and empty files, objects moving
        /// between files, removals), a read that parses only the changed files gives what
        /// a read of every file gives (`Rereader::read` checks each one).
        #[test]
        fn reading_only_changed_files_equals_reading_them_all(
            edits in proptest::collection::vec((0usize..3, 0usize..6), 1..25),
        ) {
            let mut r = Rereader::new();
            for (file, what) in edits {
                let name = ["a.yaml", "b.yaml", "c.yml"][file];
                let text = match what {
                    0 => ns("shop", "x"),
                    1 => format!("{}---\n{}", ns("shop", "y"), ns(&format!("n{file}"), "z")),
                    2 => "kind: [broken".to_owned(),
                    3 => String::new(),
                    4 => format!("{}---\nkind: Namespace\nmetadata: {{name: 7}}\n", ns("other", "x")),
                    _ => {
                        let _ = std::fs::remove_file(r.dir.path().join(name));
                        r.read();
                        continue;
                    }
                };
                r.write(name, &text);
                r.read();
            }
        }
    }
}
