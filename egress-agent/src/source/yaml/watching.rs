//! Watching the state directory: inotify, with polling as the safety net, and a read once
//! the directory is quiet.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, SystemTime},
};

use tokio::sync::watch as tokio_watch;

use super::loading::{
    LastGood, Origins, Parses, QUIET, is_state_file, list_files, read_dir_remembering,
};
use crate::source::{LoadError, Snapshot};

/// What identifies the directory's contents cheaply: (name, mtime, length) of each state
/// file, or the error listing it.
pub(super) type Fingerprint = Result<Vec<(String, Option<SystemTime>, u64)>, String>;

pub(super) fn fingerprint(dir: &Path) -> Fingerprint {
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

/// The longest a read waits for the directory to become quiet (a file written for longer
/// is read as it is, and again once written).
pub const MAX_DELAY: Duration = Duration::from_millis(250);

/// What the inotify thread tells the watcher task.
#[derive(Default)]
pub(super) struct Pending {
    /// Something in the directory changed.
    wake: tokio::sync::Notify,
    /// A state file itself was named (written, created, renamed, removed): read even if
    /// its (name, mtime, length) looks unchanged (a same-length rewrite within the
    /// filesystem's timestamp granularity).
    state_file: AtomicBool,
    /// The state files written (so named), parsed again by the next read whatever their
    /// stamp.
    written: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Events were lost: the next read parses every file again.
    rescan: AtomicBool,
    /// State files written in place (not renamed into the directory), by name: whether
    /// the writer has closed the file since its last write. Read only once closed and
    /// [`SETTLE`] old: a file written in several parts is read whole.
    in_place: std::sync::Mutex<BTreeMap<String, bool>>,
    /// inotify events read, of any kind.
    events: std::sync::atomic::AtomicU64,
}

/// How long a state file written in place must stay unmodified (after its writer closed
/// it) before it is read: a file written in two parts 50 ms apart is read once, whole.
/// Files renamed into the directory (what writers should do) are read at once.
pub const SETTLE: Duration = Duration::from_millis(100);
/// The longest a read waits for files written in place to settle; then they are read as
/// they are, and again once written.
pub const MAX_SETTLE: Duration = Duration::from_secs(2);

/// An inotify watch on the directory itself, not recursive, read by a task that ends
/// with it.
///
/// Only changes are asked for: created, written, closed after writing, renamed, removed,
/// attributes, and the directory itself removed or moved. Never opens or reads: every
/// agent that reads the directory (a listing, a file parsed) would wake every other agent
/// watching it, and agents sharing one directory (the lab's 100 nodes) woke one another
/// 800-1,300 times a second on start (measured on the `notify` crate, which always asks
/// for opens).
pub(super) struct DirWatch {
    reader: tokio::task::JoinHandle<()>,
    /// (device, inode) of the directory watched: a directory replaced under the watch
    /// (removed and created again) has a new one.
    identity: (u64, u64),
}

impl Drop for DirWatch {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// What one inotify event says of a state file, or of the directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Change {
    /// Created or written (in place: read once closed and settled).
    Written,
    /// Closed after writing.
    Closed,
    /// Renamed into the directory, or removed: whole, nothing to wait for.
    Arrived,
    /// Renamed away, or its attributes changed.
    Touched,
    /// Events were lost (the queue overflowed): read everything.
    Lost,
}

impl Change {
    /// What `mask` says, if anything this watcher asked for.
    fn of(mask: inotify::EventMask) -> Option<Self> {
        use inotify::EventMask as M;
        if mask.contains(M::Q_OVERFLOW) {
            Some(Self::Lost)
        } else if mask.intersects(M::MOVED_TO | M::DELETE) {
            Some(Self::Arrived)
        } else if mask.contains(M::CLOSE_WRITE) {
            Some(Self::Closed)
        } else if mask.intersects(M::CREATE | M::MODIFY) {
            Some(Self::Written)
        } else if mask.intersects(M::MOVED_FROM | M::ATTRIB | M::DELETE_SELF | M::MOVE_SELF) {
            Some(Self::Touched)
        } else {
            None
        }
    }
}

/// Take one change of the file `name` (`None`: the directory itself): track state files
/// written in place (a write opens or keeps open one, a close after writing ends it, a
/// rename into the directory or a removal forgets it), and wake the watcher.
pub(super) fn note_change(pending: &Pending, change: Change, name: Option<&str>) {
    if change == Change::Lost {
        pending.rescan.store(true, Ordering::Relaxed);
        pending.state_file.store(true, Ordering::Relaxed);
    }
    if let Some(name) = name.filter(|n| is_state_file(n)) {
        pending.state_file.store(true, Ordering::Relaxed);
        let mut in_place = pending
            .in_place
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        pending
            .written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(name.to_owned());
        match change {
            Change::Arrived => {
                in_place.remove(name);
            }
            Change::Written => {
                in_place.insert(name.to_owned(), false);
            }
            Change::Closed => {
                if let Some(closed) = in_place.get_mut(name) {
                    *closed = true;
                }
            }
            Change::Touched | Change::Lost => {}
        }
    }
    pending.wake.notify_one();
}

/// Wait (at most [`MAX_SETTLE`]) until every state file written in place is closed and
/// [`SETTLE`] old, forgetting those that are.
pub(super) async fn settle(dir: &Path, pending: &Pending) {
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
pub(super) fn dir_identity(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(dir)
        .ok()
        .filter(std::fs::Metadata::is_dir)
        .map(|m| (m.dev(), m.ino()))
}

impl DirWatch {
    /// Watch `dir`, waking `pending` on every change. Fails when the directory cannot be
    /// watched (no inotify on this filesystem, the per-user inotify limits reached, the
    /// directory missing): then polling alone notices changes. Must be called inside a
    /// Tokio runtime.
    fn new(dir: &Path, pending: &Arc<Pending>) -> Result<Self, String> {
        use futures::StreamExt as _;
        use inotify::{Inotify, WatchMask as W};
        let identity = dir_identity(dir).ok_or("not a directory")?;
        let inotify = Inotify::init().map_err(|e| format!("inotify: {e}"))?;
        let mask = W::CREATE
            | W::MODIFY
            | W::CLOSE_WRITE
            | W::MOVED_FROM
            | W::MOVED_TO
            | W::DELETE
            | W::ATTRIB
            | W::DELETE_SELF
            | W::MOVE_SELF
            | W::ONLYDIR;
        inotify
            .watches()
            .add(dir, mask)
            .map_err(|e| format!("watching {}: {e}", dir.display()))?;
        let mut events = inotify
            .into_event_stream(vec![0u8; 64 * 1024])
            .map_err(|e| format!("inotify: {e}"))?;
        let sink = Arc::clone(pending);
        let reader = tokio::spawn(async move {
            while let Some(event) = events.next().await {
                sink.events.fetch_add(1, Ordering::Relaxed);
                match event {
                    Ok(e) => {
                        if let Some(change) = Change::of(e.mask) {
                            note_change(&sink, change, e.name.as_deref().and_then(|n| n.to_str()));
                        }
                    }
                    // Unreadable: events may be lost; read everything.
                    Err(_) => note_change(&sink, Change::Lost, None),
                }
            }
        });
        Ok(Self { reader, identity })
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
pub(super) enum Notifications {
    Inotify,
    /// Polling only (tests of the safety net).
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "tests of the polling safety net")
    )]
    None,
}

pub(super) async fn watch_with(
    dir: PathBuf,
    poll: Duration,
    notifications: Notifications,
    cluster_cidrs: Vec<ipnet::IpNet>,
) -> tokio_watch::Receiver<Arc<Snapshot>> {
    let pending = Arc::new(Pending::default());
    // Watch first, then read: a change racing the first read is noticed.
    let mut inotify = match notifications {
        Notifications::None => None,
        Notifications::Inotify => first_watch(&dir, &pending, poll),
    };
    let (mut last, first, origins, mut parses) = read_with_fingerprint(
        dir.clone(),
        &cluster_cidrs,
        Arc::default(),
        Parses::default(),
    )
    .await;
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
            if pending.rescan.swap(false, Ordering::Relaxed) {
                parses = Parses::default();
            }
            parses.written.extend(std::mem::take(
                &mut *pending
                    .written
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            ));
            let (seen, snapshot, origins, now_parsed) =
                read_with_fingerprint(dir.clone(), &cluster_cidrs, Arc::clone(&last_good), parses)
                    .await;
            parses = now_parsed;
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

/// The directory's first inotify watch; when it cannot be had, edits are noticed by
/// polling every `poll` until a later tick sets one up.
fn first_watch(dir: &Path, pending: &Arc<Pending>, poll: Duration) -> Option<DirWatch> {
    DirWatch::new(dir, pending)
        .inspect_err(|e| {
            tracing::warn!(
                "failed to watch state directory {} with inotify: {e}; edits are noticed by \
                 polling every {poll:?} only",
                dir.display()
            );
        })
        .ok()
}

/// Wait until no change was notified for [`QUIET`], or [`MAX_DELAY`] at most.
pub(super) async fn debounce(pending: &Pending) {
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
/// keep their version in `last`. Only files changed since `parses` saw them are parsed
/// (it comes back up to date; empty if the read failed). The view carries
/// `cluster_cidrs`.
pub(super) async fn read_with_fingerprint(
    dir: PathBuf,
    cluster_cidrs: &[ipnet::IpNet],
    last: Arc<LastGood>,
    mut parses: Parses,
) -> (Fingerprint, Snapshot, Origins, Parses) {
    let fallback_dir = dir.clone();
    let fallback = Arc::clone(&last);
    let cluster_cidrs = cluster_cidrs.to_vec();
    tokio::task::spawn_blocking(move || {
        let seen = fingerprint(&dir);
        let (mut snapshot, origins) = read_dir_remembering(&dir, &last, &mut parses);
        snapshot.view.cluster_cidrs = cluster_cidrs;
        (seen, snapshot, origins, parses)
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
        (
            Err(error.to_string()),
            snapshot,
            fallback.files.clone(),
            Parses::default(),
        )
    })
}

#[cfg(test)]
mod tests {
    use std::{io::Write as _, time::Instant};

    use super::super::fixtures::*;
    use super::*;

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

    /// Waits for the next snapshot, 1 s at most.
    async fn next_change(rx: &mut tokio_watch::Receiver<Arc<Snapshot>>) {
        tokio::time::timeout(Duration::from_secs(1), rx.changed())
            .await
            .expect("no change within 1 s")
            .expect("watcher alive");
    }

    const HOUR: Duration = Duration::from_secs(3600);

    /// Other agents listing and reading a shared directory do not wake this one (a
    /// watch asking for opens woke every agent for every other agent's read); a write
    /// does, naming the file.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reading_the_directory_wakes_no_watcher_and_a_write_does() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("ns.yaml");
        std::fs::write(&file, namespace_doc("a")).expect("write");
        let pending = Arc::new(Pending::default());
        let _watch = DirWatch::new(dir.path(), &pending).expect("watch");
        let woken = || tokio::time::timeout(Duration::from_millis(300), pending.wake.notified());

        for _ in 0..20 {
            let listed = std::fs::read_dir(dir.path()).expect("list").count();
            assert_eq!(listed, 1);
            std::fs::read_to_string(&file).expect("read");
            std::fs::metadata(&file).expect("stat");
        }
        assert!(woken().await.is_err(), "woken by reads");
        assert_eq!(
            pending.events.load(Ordering::Relaxed),
            0,
            "events for reads"
        );
        assert!(!pending.state_file.load(Ordering::Relaxed));

        std::fs::write(&file, namespace_doc("b")).expect("write");
        woken().await.expect("not woken by a write");
        assert!(pending.state_file.load(Ordering::Relaxed));
        let written = pending.written.lock().expect("lock").clone();
        assert_eq!(written.into_iter().collect::<Vec<_>>(), ["ns.yaml"]);
    }

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
        // The probe: a file written in place in two parts 50 ms apart had its
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
