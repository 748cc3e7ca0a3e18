//! Each policy's last accepted version, kept beside the pin lock
//! (`/run/egress-agent/<pin dir>.accepted.json`: a tmpfs, which a reboot clears as it
//! clears the pinned maps). A policy whose spec turns invalid keeps being served from its
//! last accepted version; an agent restarted meanwhile (an upgrade, a crash) reads it here
//! and serves the policy as its predecessor did, where it would otherwise know no
//! version of it and leave the policy's pods to the node's routing (their own addresses).

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use tracing::warn;

use crate::api::EgressGatewayPolicy;

/// The file's extension beside the lock ([`crate::datapath::lock::PinLock::beside`]).
pub const FILE: &str = "accepted.json";

/// The accepted versions by policy name.
pub type Accepted = BTreeMap<String, EgressGatewayPolicy>;

/// The file, and what this agent last wrote to it.
pub struct AcceptedFile {
    path: PathBuf,
    written: Accepted,
}

impl AcceptedFile {
    /// The file at `path`, holding ([`AcceptedFile::kept`]) nothing when it is missing;
    /// when it cannot be read or parsed, a warning naming it and nothing (policies that are
    /// accepted now are served as they are; only a broken one's old version is missed).
    pub fn open(path: PathBuf) -> Self {
        let accepted = match read(&path) {
            Ok(a) => a,
            Err(e) => {
                warn!(
                    file = %path.display(),
                    "the policies' last accepted versions are lost (a policy that is broken \
                     now is not served until fixed): {e:#}"
                );
                Accepted::new()
            }
        };
        Self {
            path,
            written: accepted,
        }
    }

    /// What the file held when opened, or this agent last wrote to it.
    pub fn kept(&self) -> &Accepted {
        &self.written
    }

    /// Write `accepted` if it differs from what was last written (a new file renamed over
    /// the old one: a crash never leaves half of it). A failure is a warning: the agent
    /// serves on, and tries again on the next pass.
    pub fn save(&mut self, accepted: &Accepted) {
        if *accepted == self.written {
            return;
        }
        match write(&self.path, accepted) {
            Ok(()) => self.written.clone_from(accepted),
            Err(e) => warn!(
                file = %self.path.display(),
                "failed to keep the policies' last accepted versions (an agent restarted \
                 while a policy is broken would not serve it): {e:#}"
            ),
        }
    }
}

fn read(path: &Path) -> Result<Accepted> {
    let text = match fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Accepted::new()),
        Err(e) => return Err(e).context("failed to read it"),
    };
    serde_json::from_slice(&text).context("failed to parse it")
}

fn write(path: &Path, accepted: &Accepted) -> Result<()> {
    let text = serde_json::to_vec(accepted).context("failed to encode them")?;
    let tmp = path.with_extension("json.tmp");
    fs::write(&tmp, text).with_context(|| format!("failed to write {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("failed to rename {}", tmp.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(name: &str, generation: i64) -> EgressGatewayPolicy {
        let mut p = EgressGatewayPolicy::new(name, Default::default());
        p.metadata.generation = Some(generation);
        p
    }

    #[test]
    fn what_one_agent_kept_the_next_reads_and_a_missing_file_is_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sys-fs-bpf-egress.accepted.json");
        let mut file = AcceptedFile::open(path.clone());
        assert!(file.kept().is_empty());
        assert!(
            !path.exists(),
            "nothing is written before anything is accepted"
        );

        let kept: Accepted = [("payments".to_owned(), policy("payments", 3))].into();
        file.save(&kept);
        assert_eq!(AcceptedFile::open(path.clone()).kept(), &kept);
        assert!(!path.with_extension("json.tmp").exists());

        // An unchanged set is not written again; a changed one is.
        fs::remove_file(&path).unwrap();
        file.save(&kept);
        assert!(!path.exists());
        file.save(&Accepted::new());
        assert_eq!(AcceptedFile::open(path).kept(), &Accepted::new());
    }

    #[test]
    fn a_file_it_cannot_parse_is_nothing_and_is_written_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.accepted.json");
        fs::write(&path, "{not json").unwrap();
        let mut file = AcceptedFile::open(path.clone());
        assert!(file.kept().is_empty());
        let kept: Accepted = [("a".to_owned(), policy("a", 1))].into();
        file.save(&kept);
        assert_eq!(AcceptedFile::open(path).kept(), &kept);
    }
}
