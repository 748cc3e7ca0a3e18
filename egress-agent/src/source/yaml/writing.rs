//! Writing the agent's own EgressNode into the state directory, never through a link.

use std::{
    collections::BTreeMap,
    io::Write as _,
    path::{Path, PathBuf},
    sync::atomic::Ordering,
};

use crate::api::EgressNode;

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

/// The YAML source's [`StatusWriter`](crate::source::StatusWriter): this node's EgressNode as a
/// file in the state directory ([`write_egress_node`]); policy statuses and Events have
/// no file of their own (the agent logs them, `egress-agent status` shows them).
pub struct DirWriter(pub PathBuf);

impl crate::source::StatusWriter for DirWriter {
    fn egress_node(&self, doc: &EgressNode) -> anyhow::Result<()> {
        write_egress_node(&self.0, doc).map(drop).map_err(|e| {
            anyhow::anyhow!(
                "failed to publish EgressNode {}: {e}",
                doc.metadata.name.as_deref().unwrap_or_default()
            )
        })
    }

    fn policy_statuses(&self, _: &BTreeMap<String, crate::api::PolicyStatus>) {}

    fn event(&self, _: crate::source::Event) {}
}

/// The contents of `path` if it is a regular file of at most `limit` bytes, read without
/// following a link (or blocking on a FIFO).
pub(super) fn read_own_file(path: &Path, limit: usize) -> Option<Vec<u8>> {
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
pub(super) const TEMPORARY_ATTEMPTS: u32 = 64;
/// Numbers the temporary files of this process.
pub(super) static TEMPORARY_COUNTER: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// Create a new temporary file in `dir` for node `name`'s EgressNode: hidden and not
/// `.yaml` (the reader never picks up a half-written file), named after the pid and a
/// counter, created exclusively and never through a link (a name already taken, by a
/// stale file or a planted link, is skipped for the next one).
pub(super) fn create_temporary(
    dir: &Path,
    name: &str,
) -> std::io::Result<(PathBuf, std::fs::File)> {
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
    use super::*;
    use crate::{
        api::{EgressNodeSpec, EgressNodeStatus, HeldEgressIp, NodeInterface},
        source::yaml::load_dir,
    };

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
}
