//! The cluster's liveness keys: hellos carry an HMAC-SHA256 under one of them, so that
//! nothing without the key (a host-network pod, a machine on the underlay's VLAN) can
//! speak for a node.
//!
//! The key file (`--liveness-key-file`, a Secret in the DaemonSet) holds one key per line
//! in hex, at least 32 bytes (64 hex digits); blank lines and `#` comments are skipped.
//! The first key signs; every key listed is accepted. Rotation without an outage:
//!
//! 1. add the new key as the second line everywhere (it is accepted, not yet used);
//! 2. once every agent has it, swap the lines (the new key signs, the old is accepted);
//! 3. once every agent signs with the new key, remove the old line.
//!
//! The agent reads the file again every [`RELOAD`], so a Secret update reaches it without
//! a restart. A key is named on the wire by its id: the first 4 bytes of its SHA-256, so
//! that agents whose files list the keys in another order still agree.

use std::{
    fmt,
    path::{Path, PathBuf},
    time::Duration,
};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// How often the key file is read again.
pub const RELOAD: Duration = Duration::from_secs(10);
/// Shortest key accepted, in bytes.
pub const MIN_KEY_LEN: usize = 32;
/// Length of a MAC on the wire.
pub const MAC_LEN: usize = 32;
/// Length of a key id on the wire.
pub const ID_LEN: usize = 4;

type HmacSha256 = Hmac<Sha256>;

/// One key, with its id.
#[derive(Clone, PartialEq, Eq)]
pub struct Key {
    pub id: [u8; ID_LEN],
    secret: Vec<u8>,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the secret.
        write!(f, "Key({})", hex(&self.id))
    }
}

impl Key {
    pub fn new(secret: Vec<u8>) -> Self {
        let digest = Sha256::digest(&secret);
        let mut id = [0; ID_LEN];
        id.copy_from_slice(&digest[..ID_LEN]);
        Self { id, secret }
    }

    /// The MAC of `data` under this key.
    pub fn mac(&self, data: &[u8]) -> [u8; MAC_LEN] {
        let mut m = HmacSha256::new_from_slice(&self.secret).expect("HMAC takes any key length");
        m.update(data);
        m.finalize().into_bytes().into()
    }

    /// Whether `mac` is `data`'s MAC under this key (in constant time).
    pub fn verify(&self, data: &[u8], mac: &[u8]) -> bool {
        let mut m = HmacSha256::new_from_slice(&self.secret).expect("HMAC takes any key length");
        m.update(data);
        m.verify_slice(mac).is_ok()
    }
}

/// The keys an agent signs and verifies with. Empty: liveness is unauthenticated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Keyring {
    keys: Vec<Key>,
}

/// A key file that cannot be used, naming the file and what to fix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("failed to read the liveness key file {path}: {error}")]
    Read { path: PathBuf, error: String },
    #[error(
        "failed to read the liveness key file {path}: no such file. In the DaemonSet it is the entry `{entry}` of the Secret egress-liveness-key: `kubectl -n egress-system create secret generic egress-liveness-key --from-literal={entry}=$(openssl rand -hex 32)` (docs/operations.md, \"Liveness keys\"); elsewhere write one hex key of at least {MIN_KEY_LEN} bytes per line there, or leave --liveness-key-file out to run unauthenticated"
    )]
    Missing { path: PathBuf, entry: String },
    #[error("liveness key file {path}, line {line}: {problem}")]
    Line {
        path: PathBuf,
        line: usize,
        problem: String,
    },
    #[error(
        "liveness key file {path} holds no key: write one hex key of at least {MIN_KEY_LEN} bytes per line (for example `openssl rand -hex 32`)"
    )]
    Empty { path: PathBuf },
}

impl Keyring {
    pub fn new(keys: Vec<Key>) -> Self {
        Self { keys }
    }

    /// Read the key file at `path` (see the module's documentation for its format).
    pub fn load(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::Missing {
                path: path.to_owned(),
                // A Secret's entry is a file of its mount, named by the entry's key.
                entry: path
                    .file_name()
                    .map_or_else(|| "key".to_owned(), |n| n.to_string_lossy().into_owned()),
            },
            _ => Error::Read {
                path: path.to_owned(),
                error: e.to_string(),
            },
        })?;
        Self::parse(&text, path)
    }

    /// The keys of a key file's text; `path` only names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, Error> {
        let mut keys: Vec<Key> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let problem = |problem: String| Error::Line {
                path: path.to_owned(),
                line: i + 1,
                problem,
            };
            let secret = unhex(line).ok_or_else(|| {
                problem("not a hex key (only 0-9 and a-f, an even number of them)".into())
            })?;
            if secret.len() < MIN_KEY_LEN {
                return Err(problem(format!(
                    "a key of {} bytes; at least {MIN_KEY_LEN} are needed",
                    secret.len()
                )));
            }
            let key = Key::new(secret);
            if keys.iter().any(|k| k.id == key.id) {
                return Err(problem("the same key twice".into()));
            }
            keys.push(key);
        }
        if keys.is_empty() {
            return Err(Error::Empty {
                path: path.to_owned(),
            });
        }
        Ok(Self { keys })
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The key that signs (the first).
    pub fn signing(&self) -> Option<&Key> {
        self.keys.first()
    }

    /// The key named `id`, if accepted.
    pub fn get(&self, id: &[u8]) -> Option<&Key> {
        self.keys.iter().find(|k| k.id[..] == *id)
    }

    /// The ids of the keys, signing key first (for logs and status: never the secrets).
    pub fn ids(&self) -> Vec<String> {
        self.keys.iter().map(|k| hex(&k.id)).collect()
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    const B: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

    fn parse(text: &str) -> Result<Keyring, Error> {
        Keyring::parse(text, Path::new("/etc/egress/liveness/key"))
    }

    #[test]
    fn the_first_key_signs_and_every_key_is_accepted() {
        let ring = parse(&format!("# rotation in progress\n{B}\n\n  {A}  \n")).expect("keys");
        let a = Key::new(unhex(A).expect("hex"));
        let b = Key::new(unhex(B).expect("hex"));
        assert_eq!(ring.signing(), Some(&b));
        assert_eq!(ring.get(&a.id), Some(&a));
        assert_eq!(ring.get(&b.id), Some(&b));
        assert_eq!(ring.get(&[0; 4]), None);
        assert_eq!(ring.ids().len(), 2);
    }

    #[test]
    fn a_mac_verifies_under_its_key_only() {
        let a = Key::new(unhex(A).expect("hex"));
        let b = Key::new(unhex(B).expect("hex"));
        let mac = a.mac(b"hello");
        assert!(a.verify(b"hello", &mac));
        assert!(!a.verify(b"hellp", &mac));
        assert!(!b.verify(b"hello", &mac));
        assert!(!a.verify(b"hello", &mac[..31]));
    }

    #[test]
    fn bad_key_files_name_the_file_the_line_and_the_fix() {
        let e = parse("# nothing\n").expect_err("empty");
        assert!(
            e.to_string()
                .contains("/etc/egress/liveness/key holds no key"),
            "{e}"
        );
        let e = parse(&format!("{A}\nzz{}\n", &A[2..])).expect_err("not hex");
        assert!(e.to_string().contains("line 2: not a hex key"), "{e}");
        let e = parse("00112233").expect_err("short");
        assert!(
            e.to_string()
                .contains("line 1: a key of 4 bytes; at least 32"),
            "{e}"
        );
        let e = parse(&format!("{A}\n{A}\n")).expect_err("twice");
        assert!(e.to_string().contains("line 2: the same key twice"), "{e}");
        let e = Keyring::load(Path::new("/nonexistent/key")).expect_err("missing");
        assert!(
            e.to_string()
                .starts_with("failed to read the liveness key file /nonexistent/key: no such file"),
            "{e}"
        );
        // A missing file says how to create the Secret the DaemonSet mounts it from, with
        // the entry named as the file is.
        assert!(
            e.to_string().contains(
                "kubectl -n egress-system create secret generic egress-liveness-key \
                 --from-literal=key=$(openssl rand -hex 32)"
            ),
            "{e}"
        );
        let e = Keyring::load(Path::new("/nonexistent/hellos")).expect_err("missing");
        assert!(e.to_string().contains("--from-literal=hellos="), "{e}");
        // Another failure says what the system said.
        let dir = std::env::temp_dir();
        let e = Keyring::load(&dir).expect_err("a directory");
        assert!(
            matches!(e, Error::Read { .. }) && !e.to_string().contains("create secret"),
            "{e}"
        );
    }

    #[test]
    fn debug_output_never_shows_a_secret() {
        let ring = parse(A).expect("keys");
        assert!(!format!("{ring:?}").contains(&A[..16]));
    }
}
