//! One agent per pin directory: `run` holds an exclusive `flock(2)` on a lock file derived
//! from its pin directory (bpffs holds no regular files, so the lock lives under
//! [`LOCK_DIR`]), with its pid in it. `cleanup` takes the same lock, so it refuses while an
//! agent runs there, and no agent starts while it uninstalls.

use std::{
    fs::{self, File, OpenOptions},
    io::{Read as _, Seek as _, Write as _},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
};

/// Where the lock files live (a tmpfs: a reboot, which also empties bpffs, clears them).
pub const LOCK_DIR: &str = "/run/egress-agent";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Another process holds the lock of this pin directory.
    #[error(
        "an agent (pid {pid}) runs on {}: stop it with SIGTERM first (it leaves the datapath \
         in place), then try again",
        pin_dir.display()
    )]
    Held { pid: String, pin_dir: PathBuf },
    #[error("failed to {verb} the lock file {}: {source}", path.display())]
    Io {
        verb: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The lock of one pin directory, held until dropped.
#[derive(Debug)]
pub struct PinLock {
    _file: File,
    path: PathBuf,
}

/// The lock file of `pin_dir` under `lock_dir`: the pin directory's path with `/` as `-`
/// (`/sys/fs/bpf/egress` -> `sys-fs-bpf-egress.lock`).
pub fn lock_path(lock_dir: &Path, pin_dir: &Path) -> PathBuf {
    let flat: Vec<String> = pin_dir
        .components()
        .filter_map(|c| match c {
            std::path::Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            _ => None,
        })
        .collect();
    lock_dir.join(format!("{}.lock", flat.join("-")))
}

impl PinLock {
    /// Take the lock of `pin_dir` under [`LOCK_DIR`] and write this process's pid in it.
    pub fn acquire(pin_dir: &Path) -> Result<Self, Error> {
        Self::acquire_in(Path::new(LOCK_DIR), pin_dir)
    }

    /// [`PinLock::acquire`] with another lock directory.
    pub fn acquire_in(lock_dir: &Path, pin_dir: &Path) -> Result<Self, Error> {
        let path = lock_path(lock_dir, pin_dir);
        let io = |verb| {
            let path = path.clone();
            move |source| Error::Io { verb, path, source }
        };
        fs::create_dir_all(lock_dir).map_err(io("create the directory of"))?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io("open"))?;
        // SAFETY: flock(2) on a file descriptor this function owns.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                let pid = pid.trim();
                return Err(Error::Held {
                    pid: if pid.is_empty() { "unknown" } else { pid }.to_owned(),
                    pin_dir: pin_dir.to_owned(),
                });
            }
            return Err(io("lock")(e));
        }
        file.set_len(0).map_err(io("write"))?;
        file.rewind().map_err(io("write"))?;
        writeln!(file, "{}", std::process::id()).map_err(io("write"))?;
        Ok(Self { _file: file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A file of this pin directory's beside its lock: `<flat pin dir>.<what>` under the
    /// lock directory (cleared by a reboot, as the pins are).
    pub fn beside(&self, what: &str) -> PathBuf {
        self.path.with_extension(what)
    }

    /// Let go of the lock and remove its file: for a start that fails before it touched
    /// anything, so that it leaves nothing behind (the file is this lock's own: nobody
    /// else can hold it meanwhile).
    pub fn abandon(self) {
        let _ = fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_file_is_named_after_the_pin_directory() {
        assert_eq!(
            lock_path(
                Path::new("/run/egress-agent"),
                Path::new("/sys/fs/bpf/egress")
            ),
            Path::new("/run/egress-agent/sys-fs-bpf-egress.lock")
        );
    }

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid() {
        let dir = tempfile::tempdir().unwrap();
        let pins = Path::new("/sys/fs/bpf/egress-test");
        let first = PinLock::acquire_in(dir.path(), pins).unwrap();
        let e = PinLock::acquire_in(dir.path(), pins).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "an agent (pid {}) runs on /sys/fs/bpf/egress-test: stop it with SIGTERM \
                 first (it leaves the datapath in place), then try again",
                std::process::id()
            )
        );
        // Another pin directory is another lock.
        PinLock::acquire_in(dir.path(), Path::new("/sys/fs/bpf/other")).unwrap();
        drop(first);
        PinLock::acquire_in(dir.path(), pins).unwrap();
    }
}
