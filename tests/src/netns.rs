//! Named network namespaces and the processes, links and pinned directories that live in
//! them, each behind a guard that removes it on drop (also while a test panics).
//!
//! Commands run inside a namespace through `setns(2)` in the child (see [`Netns::command`]),
//! not through `ip netns exec`: the latter remounts `/sys` in a private mount namespace,
//! which hides `/sys/fs/bpf`, so an agent started that way could not pin where `bpftool` and
//! a restarted agent look.
//!
//! Nothing here touches the host's own network namespace except to create and delete named
//! namespaces (`/run/netns/<name>`).

use std::{
    collections::BTreeSet,
    fs::File,
    io::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Output, Stdio},
    sync::{
        Mutex,
        atomic::{AtomicU32, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use egress_agent::datapath::lock;

/// Where `ip netns add` puts the namespace handles.
pub const NETNS_RUN_DIR: &str = "/run/netns";

/// How long a child gets between SIGTERM and SIGKILL.
pub const KILL_GRACE: Duration = Duration::from_secs(3);

static PREFIX_COUNTER: AtomicU32 = AtomicU32::new(0);

/// Candidate prefixes for one lab instance in this process: `eg<pid % 1000><n>`, where `n`
/// counts labs in this process. Short, so that `<prefix>-<node>` stays readable and any
/// interface name derived from it can stay within 15 characters.
pub fn next_prefix() -> String {
    let n = PREFIX_COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("eg{:03}{n}", std::process::id() % 1000)
}

/// Run a command to completion and fail with its stderr when it does not exit 0.
pub fn run_checked(cmd: &mut Command) -> Result<Output> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("failed to run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "failed to run {cmd:?}: {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(out)
}

/// Names of every named network namespace on the machine (`ip netns list`).
pub fn list_netns() -> Result<Vec<String>> {
    let out = run_checked(Command::new("ip").args(["netns", "list"]))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}

/// Named namespaces that belong to the lab with this prefix (`<prefix>-...`).
pub fn netns_with_prefix(prefix: &str) -> Result<Vec<String>> {
    let head = format!("{prefix}-");
    Ok(list_netns()?
        .into_iter()
        .filter(|n| n.starts_with(&head))
        .collect())
}

/// Pids of the processes that live in a named namespace (`ip netns pids`).
pub fn netns_pids(name: &str) -> Result<Vec<i32>> {
    let out = run_checked(Command::new("ip").args(["netns", "pids", name]))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect())
}

/// SIGTERM every process in the namespace, SIGKILL what is left after [`KILL_GRACE`].
pub fn kill_netns_pids(name: &str) {
    let Ok(pids) = netns_pids(name) else { return };
    if pids.is_empty() {
        return;
    }
    for &pid in &pids {
        signal(pid, libc::SIGTERM);
    }
    let deadline = Instant::now() + KILL_GRACE;
    loop {
        let left = netns_pids(name).unwrap_or_default();
        if left.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            for pid in left {
                signal(pid, libc::SIGKILL);
            }
            return;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

fn signal(pid: i32, sig: i32) {
    if pid <= 1 || pid == std::process::id() as i32 {
        return;
    }
    // SAFETY: kill(2) has no memory-safety preconditions; a stale pid only yields ESRCH.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// Kill the processes in, and delete, one named namespace. Errors are ignored: this runs
/// from `Drop` and from cleanup of labs that may be half gone already.
pub fn delete_netns(name: &str) {
    kill_netns_pids(name);
    let _ = Command::new("ip")
        .args(["netns", "del", name])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// A named network namespace, deleted (after killing every process in it) on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    leaked: bool,
}

impl Netns {
    /// `ip netns add NAME`. Fails if the name is taken (this is what makes a lab prefix
    /// unique across processes). Loopback is brought up.
    pub fn add(name: &str) -> Result<Self> {
        run_checked(Command::new("ip").args(["netns", "add", name]))
            .with_context(|| format!("failed to create network namespace {name}"))?;
        let ns = Self {
            name: name.to_owned(),
            leaked: false,
        };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Path of the namespace handle, for `setns(2)` or `nsenter --net=`.
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_RUN_DIR).join(&self.name)
    }

    /// Keep the namespace when the guard drops.
    pub fn leak(mut self) -> String {
        self.leaked = true;
        std::mem::take(&mut self.name)
    }

    /// `ip -n NAME <args>`, checked.
    pub fn ip(&self, args: &[&str]) -> Result<Output> {
        run_checked(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// Several `ip` commands (one per line, without the leading `ip`) in one process:
    /// `ip -n NAME -batch -`. Stops at the first failing line and reports it.
    pub fn ip_batch<S: AsRef<str>>(&self, lines: &[S]) -> Result<()> {
        if lines.is_empty() {
            return Ok(());
        }
        let script: String = lines.iter().map(|l| format!("{}\n", l.as_ref())).collect();
        let mut child = Command::new("ip")
            .args(["-n", &self.name, "-batch", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("failed to spawn ip -batch")?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(script.as_bytes())
                .context("failed to write to ip -batch")?;
        }
        let out = child.wait_with_output().context("failed to wait for ip")?;
        if !out.status.success() {
            bail!(
                "failed to configure namespace {}: {}\nscript:\n{script}",
                self.name,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Write a sysctl of this namespace, e.g. `("net.ipv4.ip_forward", "1")`. Only the
    /// `net.*` tree is per namespace.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.sysctls(&[(key, value)])
    }

    /// Several sysctls from one thread that has entered the namespace (no process per key).
    pub fn sysctls(&self, kv: &[(&str, &str)]) -> Result<()> {
        let writes: Vec<(PathBuf, String)> = kv
            .iter()
            .map(|(k, v)| {
                (
                    Path::new("/proc/sys").join(k.replace('.', "/")),
                    (*v).to_owned(),
                )
            })
            .collect();
        self.run_in(move || {
            for (path, value) in &writes {
                std::fs::write(path, value)
                    .with_context(|| format!("failed to write {value} to {}", path.display()))?;
            }
            Ok(())
        })
        .with_context(|| format!("failed to set sysctls in {}", self.name))
    }

    /// Run `f` on a fresh thread that has joined this network namespace (only the network
    /// namespace: files, mounts and the rest stay the caller's).
    pub fn run_in<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T> + Send + 'static,
    {
        self.spawn_in(f)?
            .join()
            .map_err(|_| anyhow::anyhow!("thread in namespace panicked"))?
    }

    /// [`Netns::run_in`] without waiting: the thread's handle (for samplers that run
    /// alongside the caller).
    pub fn spawn_in<T, F>(&self, f: F) -> Result<thread::JoinHandle<Result<T>>>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T> + Send + 'static,
    {
        let file = self.open()?;
        Ok(thread::spawn(move || -> Result<T> {
            // SAFETY: setns(2) on a valid, open namespace fd; it only changes this thread's
            // network namespace, and the thread ends with `f`.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            if rc != 0 {
                bail!("setns: {}", std::io::Error::last_os_error());
            }
            drop(file);
            f()
        }))
    }

    /// Addresses on the interfaces of this namespace that are up: [`up_addresses`].
    pub fn up_addresses(&self) -> Result<Vec<(String, IpAddr)>> {
        self.run_in(up_addresses)
    }

    fn open(&self) -> Result<File> {
        File::open(self.path())
            .with_context(|| format!("failed to open namespace handle {}", self.path().display()))
    }

    /// A `Command` for `program` that runs inside this namespace: the child joins the
    /// namespace with `setns(2)` between fork and exec. The namespace handle is opened now
    /// and closed on exec (`O_CLOEXEC`).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Result<Command> {
        let file = self.open()?;
        let fd = file.as_raw_fd();
        let mut cmd = Command::new(program);
        cmd.stdin(Stdio::null());
        // SAFETY: the closure runs in the forked child before exec and only calls setns(2),
        // which is async-signal-safe. `file` is moved into the closure, so the fd stays open
        // until the `Command` is dropped, after the spawn.
        unsafe {
            cmd.pre_exec(move || {
                let _keep = &file;
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(cmd)
    }

    /// Run a command in the namespace to completion, checked.
    pub fn exec<S: AsRef<std::ffi::OsStr>>(&self, program: &str, args: &[S]) -> Result<Output> {
        let mut cmd = self.command(program)?;
        cmd.args(args);
        run_checked(&mut cmd).with_context(|| format!("in namespace {}", self.name))
    }

    /// Run a command in the namespace, unchecked: the caller reads the status.
    pub fn exec_unchecked<S: AsRef<std::ffi::OsStr>>(
        &self,
        program: &str,
        args: &[S],
    ) -> Result<Output> {
        let mut cmd = self.command(program)?;
        cmd.args(args);
        cmd.output()
            .with_context(|| format!("failed to run {program} in namespace {}", self.name))
    }

    /// Spawn a long-running child in the namespace, with stdout and stderr appended to
    /// `log` (created if needed). The child is killed when the guard drops.
    pub fn spawn<S: AsRef<std::ffi::OsStr>>(
        &self,
        program: impl AsRef<std::ffi::OsStr>,
        args: &[S],
        log: &Path,
    ) -> Result<NsChild> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("failed to open log {}", log.display()))?;
        let err = out.try_clone().context("failed to clone log fd")?;
        let mut cmd = self.command(&program)?;
        cmd.args(args).stdout(out).stderr(err);
        NsChild::spawn(cmd, &self.name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if !self.leaked {
            delete_netns(&self.name);
        }
    }
}

/// A child process, terminated (SIGTERM, then SIGKILL after [`KILL_GRACE`]) on drop.
#[derive(Debug)]
pub struct NsChild {
    child: Option<Child>,
    label: String,
}

impl NsChild {
    /// Spawn `cmd` (already set up, e.g. by [`Netns::command`]); `label` names it in errors.
    pub fn spawn(mut cmd: Command, label: &str) -> Result<Self> {
        let child = cmd
            .spawn()
            .with_context(|| format!("failed to spawn {cmd:?} in {label}"))?;
        Ok(Self {
            child: Some(child),
            label: format!("{label}: {:?}", cmd.get_program()),
        })
    }

    pub fn id(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The child itself, e.g. to take its stdout.
    pub fn child_mut(&mut self) -> Option<&mut Child> {
        self.child.as_mut()
    }

    /// `Some(status)` if the child has exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(c) => c
                .try_wait()
                .with_context(|| format!("failed to poll {}", self.label)),
            None => Ok(None),
        }
    }

    /// Send SIGTERM without waiting (to stop several children in parallel, then
    /// [`NsChild::terminate`] each).
    pub fn signal_term(&mut self) {
        self.send_signal(libc::SIGTERM);
    }

    /// Send a signal (e.g. SIGINT, after which `ping` prints its statistics), unless the
    /// child has exited: once reaped (by [`NsChild::try_wait`]), its pid may be another
    /// process's.
    pub fn send_signal(&mut self, sig: i32) {
        if let Some(c) = &mut self.child
            && matches!(c.try_wait(), Ok(None))
        {
            signal(c.id() as i32, sig);
        }
    }

    /// Wait up to `timeout` for the child to exit on its own: `Some(status)` if it did.
    pub fn wait_for(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL at once (no SIGTERM first) and reap. Returns the exit status.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let _ = child.kill();
        child.wait().ok()
    }

    /// SIGTERM, wait up to `grace`, then SIGKILL. Returns the exit status.
    pub fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        signal(child.id() as i32, libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        child.wait().ok()
    }

    /// Leave the child running when the guard drops.
    pub fn leak(mut self) -> Option<u32> {
        self.child.take().map(|c| c.id())
    }
}

impl Drop for NsChild {
    fn drop(&mut self) {
        self.terminate(KILL_GRACE);
    }
}

/// A link inside a namespace, deleted on drop (`ip -n NS link del NAME`). Links in lab
/// namespaces also disappear with their namespace; this guard is for links whose namespace
/// outlives them.
#[derive(Debug)]
pub struct NsLink {
    netns: String,
    name: String,
}

impl NsLink {
    /// Take ownership of an existing link.
    pub fn adopt(netns: &str, name: &str) -> Self {
        Self {
            netns: netns.to_owned(),
            name: name.to_owned(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for NsLink {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["-n", &self.netns, "link", "del", &self.name])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// A directory (e.g. a bpffs pin directory) removed recursively on drop.
#[derive(Debug)]
pub struct DirGuard {
    path: PathBuf,
    leaked: bool,
}

impl DirGuard {
    /// Create the directory (and parents) and own it.
    pub fn create(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        std::fs::create_dir_all(&path)
            .with_context(|| format!("failed to create {}", path.display()))?;
        Ok(Self {
            path,
            leaked: false,
        })
    }

    /// Own a path that may or may not exist yet.
    pub fn adopt(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            leaked: false,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn leak(mut self) -> PathBuf {
        self.leaked = true;
        std::mem::take(&mut self.path)
    }
}

impl Drop for DirGuard {
    fn drop(&mut self) {
        if !self.leaked && !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// `(interface, address)` for every IPv4 and IPv6 address on an interface that is up
/// (`IFF_UP`, what `ip addr show up` lists) in the calling thread's network namespace.
/// One `getifaddrs(3)`: cheap enough to sample every few milliseconds.
pub fn up_addresses() -> Result<Vec<(String, IpAddr)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list that is freed below, once.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        bail!("getifaddrs: {}", std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not freed yet; its name
        // is a NUL-terminated string and its address, if any, a sockaddr of `sa_family`.
        unsafe {
            let ifa = &*cur;
            cur = ifa.ifa_next;
            if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as u32 == 0 {
                continue;
            }
            let ip = match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*ifa.ifa_addr.cast::<libc::sockaddr_in>();
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let sin6 = &*ifa.ifa_addr.cast::<libc::sockaddr_in6>();
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
                }
                _ => continue,
            };
            let name = std::ffi::CStr::from_ptr(ifa.ifa_name);
            out.push((name.to_string_lossy().into_owned(), ip));
        }
    }
    // SAFETY: the list from getifaddrs above, freed once; nothing points into it any more.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// Mount bpffs at `/sys/fs/bpf` unless something (bpffs) is mounted there already.
pub fn ensure_bpffs() -> Result<()> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").context("failed to read mounts")?;
    let mounted = mounts.lines().any(|l| {
        let mut f = l.split_whitespace();
        let (_, target, fstype) = (f.next(), f.next(), f.next());
        target == Some("/sys/fs/bpf") && fstype == Some("bpf")
    });
    if !mounted {
        run_checked(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]))
            .context("failed to mount bpffs at /sys/fs/bpf")?;
    }
    Ok(())
}

/// Remove everything a lab with this prefix may have left: processes in its namespaces, the
/// namespaces, its bpffs pin directories (`/sys/fs/bpf/<prefix>-*`) with their agents' lock
/// files (`/run/egress-agent/`, free once the agents are killed) and its temp directory.
pub fn teardown_prefix(prefix: &str) -> Result<()> {
    if prefix.is_empty() || prefix.contains('/') {
        bail!("failed to tear down lab: bad prefix {prefix:?}");
    }
    let head = format!("{prefix}-");
    let namespaces = netns_with_prefix(prefix)?;
    // Kill first, everywhere, so no process is left holding a deleted namespace.
    for ns in &namespaces {
        kill_netns_pids(ns);
    }
    for ns in &namespaces {
        delete_netns(ns);
    }
    let bpffs = Path::new("/sys/fs/bpf");
    for dir in [bpffs.to_path_buf(), std::env::temp_dir()] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let lab_dir = format!("egress-lab-{prefix}");
            if name.starts_with(&head) || name == lab_dir {
                let _ = std::fs::remove_dir_all(entry.path());
            }
            if dir == bpffs && name.starts_with(&head) {
                // A pin directory's agent lock (the agents were killed with the namespaces).
                let lock_file = lock::lock_path(Path::new(lock::LOCK_DIR), &entry.path());
                let _ = std::fs::remove_file(lock_file);
            }
        }
    }
    let left = netns_with_prefix(prefix)?;
    if !left.is_empty() {
        bail!("failed to tear down lab {prefix}: namespaces left: {left:?}");
    }
    Ok(())
}

static LIVE_PREFIXES: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Remember a live lab, for the signal handler.
pub fn register_live(prefix: &str) {
    if let Ok(mut live) = LIVE_PREFIXES.lock() {
        live.insert(prefix.to_owned());
    }
}

/// Forget a lab (torn down or deliberately kept).
pub fn unregister_live(prefix: &str) {
    if let Ok(mut live) = LIVE_PREFIXES.lock() {
        live.remove(prefix);
    }
}

/// Install a SIGINT/SIGTERM handler (once per process) that tears down every live lab of
/// this process and exits with 130 (SIGINT) or 143 (SIGTERM). For the demo: a test binary
/// relies on `Drop` instead.
pub fn install_signal_teardown() -> Result<()> {
    static INSTALLED: Mutex<bool> = Mutex::new(false);
    let mut installed = INSTALLED
        .lock()
        .map_err(|_| anyhow::anyhow!("signal handler lock poisoned"))?;
    if *installed {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("failed to build the signal runtime")?;
    // Register before returning, so a signal right after this call is caught.
    let (mut int, mut term) = rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        Ok::<_, std::io::Error>((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        ))
    })?;
    thread::Builder::new()
        .name("lab-signals".into())
        .spawn(move || {
            let code = rt.block_on(async {
                tokio::select! {
                    _ = int.recv() => 130,
                    _ = term.recv() => 143,
                }
            });
            let live: Vec<String> = LIVE_PREFIXES
                .lock()
                .map(|l| l.iter().cloned().collect())
                .unwrap_or_default();
            for prefix in live {
                eprintln!("lab: signal received, tearing down {prefix}");
                if let Err(e) = teardown_prefix(&prefix) {
                    eprintln!("lab: {e:#}");
                }
            }
            std::process::exit(code);
        })
        .context("failed to spawn the signal thread")?;
    *installed = true;
    Ok(())
}
