//! `cargo xtask vm`: run a command as root under a stock Debian kernel in QEMU, on the
//! host's own filesystem, and exit with its status. It runs the project's test binaries
//! (built on the host) on kernels the host does not have, such as 6.1, which lacks TCX.
//!
//! The guest's root is an overlay: the host's `/` over 9p, read-only, under a tmpfs, so
//! the guest may write anywhere and its writes are discarded, except in the workspace,
//! which is a second, writable 9p share mounted at the same path (target/ and test
//! outputs come back to the host). The kernel comes from Debian's archive, unpacked (never
//! installed) under target/vm/.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    fmt::Write as _,
    io::{BufRead as _, BufReader, Read, Write as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, bail};

use crate::bootstrap::{self, sh};

/// Debian packages the host needs to boot a guest.
const APT_PACKAGES: &[(&str, &str)] = &[
    (
        "qemu-system-x86",
        "qemu-system-x86_64, under TCG (a KVM guest hangs on this host)",
    ),
    ("busybox-static", "the initramfs's shell, mount and insmod"),
    (
        "kmod",
        "depmod for the unpacked kernel; the guest's modprobe (module autoload)",
    ),
    (
        "xz-utils",
        "unpacks vmlinux from the bzImage: decompressing it under TCG takes 5 s a boot",
    ),
    (
        "openvswitch-switch",
        "ovsdb-server, ovs-vswitchd and ovs-vsctl for the lab's `--cni ovs` wiring in the \
         guest (the guest's root is the host's; nothing starts them on the host)",
    ),
    (
        "ovn-central",
        "ovn-northd and the NB and SB schemas for the lab's `--cni ovn` wiring in the guest \
         (bootstrap installs it without starting a service)",
    ),
    (
        "ovn-host",
        "ovn-controller for the lab's `--cni ovn` wiring in the guest",
    ),
];

/// Modules the initramfs loads to reach the root (with their dependencies from
/// modules.dep; those built in are skipped).
const ROOT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];

/// Modules loaded at boot in the final root, so a test never waits on autoload or fails
/// on a module that autoload does not reach (openvswitch). One the kernel has neither
/// built in nor as a module fails the run before the boot; one that does not load fails
/// it in the guest before the command runs (exit status [`MODULE_MISSING`]): a test that
/// needs it (the OVS lab) must not be able to pass without it.
const BOOT_MODULES: &[&str] = &[
    "veth",
    "vxlan",
    "bridge",
    "sch_ingress",
    "cls_bpf",
    "8021q",
    "openvswitch",
    // OVN's tunnels between the nodes (`--cni ovn`): ovs-vswitchd creates genev_sys_6081.
    "geneve",
    // `--cni ovn`'s nodes hold their two links in a bond (`bond0` in br-ex).
    "bonding",
];

/// The command's exit status when a boot module did not load: the command did not run.
const MODULE_MISSING: i32 = 125;

/// Lines of console output an error shows.
const TAIL_LINES: usize = 40;

/// 9p message size: the 6.1 default (8 KiB) makes every file read a round trip per page.
const MSIZE: u32 = 262_144;

/// Host environment passed to the command, besides EGRESS_* and CARGO_*.
const ENV_PASSED: &[&str] = &["PATH", "TERM", "CI", "RUST_BACKTRACE", "RUST_LOG"];

/// Variables cargo sets for xtask's own build: they describe xtask, not the command.
const ENV_XTASK_ONLY: &[&str] = &[
    "CARGO_MANIFEST_DIR",
    "CARGO_MANIFEST_PATH",
    "CARGO_CRATE_NAME",
    "CARGO_BIN_NAME",
    "CARGO_PRIMARY_PACKAGE",
];

/// PID 1 of the initramfs. It enters the final root with `exec switch_root`, i.e. as PID 1
/// itself: PID 1 shares its fs_struct with the kernel threads, so the kernel's
/// request_module finds /sbin/modprobe (the host's kmod) there. A forked chroot would
/// leave autoload looking in the initramfs.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() {
    echo "vm init: $*" >&2
    echo o >/proc/sysrq-trigger
    sleep 60
}
for arg in $(cat /proc/cmdline); do
    case "$arg" in
    xtask.workspace=*) workspace="${arg#*=}" ;;
    xtask.modules=*) modules="${arg#*=}" ;;
    xtask.run=*) run="${arg#*=}" ;;
    xtask.msize=*) msize="${arg#*=}" ;;
    esac
done
while read -r m; do
    insmod "$m" || fail "failed to load $m"
done </modules.order
p9="trans=virtio,version=9p2000.L,msize=$msize"
mkdir -p /lower /rw /newroot
mount -t 9p -o "$p9,ro" hostroot /lower || fail "failed to mount the host's root over 9p"
mount -t tmpfs -o mode=755 tmpfs /rw
mkdir /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot ||
    fail "failed to mount the overlay root"
# The tmpfs first: a workspace under /tmp (a CI clone, say) is mounted on top of it.
mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp
mount -t tmpfs -o mode=755 tmpfs /newroot/run
mkdir -p "/newroot$workspace"
mount -t 9p -o "$p9" workspace "/newroot$workspace" ||
    fail "failed to mount the workspace $workspace over 9p"
# modprobe reads /lib/modules/$(uname -r): the unpacked package's, in the workspace.
mkdir -p /newroot/usr/lib/modules
ln -sfn "$modules" "/newroot/usr/lib/modules/${modules##*/}"
mount --move /dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o ptmxmode=666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount -t bpf bpf /newroot/sys/fs/bpf
mount -t cgroup2 cgroup2 /newroot/sys/fs/cgroup
mount -t debugfs debugfs /newroot/sys/kernel/debug
mount -t tracefs tracefs /newroot/sys/kernel/tracing 2>/dev/null
ip link set lo up
hostname vm
exec switch_root /newroot /bin/sh "$run"
"#;

/// PID 1 in the final root, after [`INIT`]: boot modules (one missing: the command does
/// not run, [`MODULE_MISSING`] is its status), the command (its own script, with the
/// host's PATH), its status to a file and the console, power off.
const GUEST: &str = r#"export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# One modprobe for all: each start of kmod reads its libraries over 9p.
[ -z '@MODULES@' ] || modprobe -qa @MODULES@
@CHECK_MODULES@
echo '@MARKER@ start'
if check_modules @MODULES@; then
    /bin/sh '@DIR@/command.sh' </dev/null
    status=$?
else
    status=@MODULE_MISSING@
fi
echo "$status" >'@DIR@/status'
sync
echo "@MARKER@ exit $status"
# stty sets with TCSADRAIN: the console's output reaches the host before the power-off.
stty onlcr
echo o >/proc/sysrq-trigger
sleep 60
"#;

/// A shell function: succeeds if every module named in its arguments is loaded, else
/// names those that are not on stderr and fails. The boot modules are loadable ones (none
/// built in: a built-in module without parameters has no /sys/module entry).
const CHECK_MODULES: &str = r#"check_modules() {
    missing=
    for m in "$@"; do
        [ -d "/sys/module/$m" ] || missing="$missing $m"
    done
    [ -z "$missing" ] && return 0
    echo "vm: failed to load module(s)$missing in the guest: the command needs them and did not run" >&2
    return 1
}"#;

/// How to boot the guest. `cargo xtask vm` takes these as flags.
#[derive(clap::Args, Clone, Debug)]
pub struct Options {
    /// The kernel: debian-<major>.<minor> (Debian's newest linux-image of that series,
    /// e.g. debian-6.1 or debian-6.12).
    #[arg(long, default_value = "debian-6.1")]
    pub kernel: String,
    /// Virtual CPUs (default: the host's cores).
    #[arg(long, value_name = "N")]
    pub cpus: Option<usize>,
    /// Guest memory, in QEMU's syntax; the guest's tmpfs writes live in it.
    #[arg(long, default_value = "4G")]
    pub memory: String,
    /// Kill the guest after this long (e.g. 90s, 30m, 2h).
    #[arg(long, default_value = "30m", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Show the kernel's messages (default: errors only).
    #[arg(long)]
    pub verbose: bool,
    /// Also set NAME=VALUE in the command's environment (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    /// Extra kernel command line arguments.
    #[arg(long, value_name = "ARGS")]
    pub append: Option<String>,
}

impl Default for Options {
    /// The flags' defaults, for callers other than the command line (`cargo xtask test`).
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Defaults {
            #[command(flatten)]
            options: Options,
        }
        <Defaults as clap::Parser>::parse_from(["vm"]).options
    }
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    options: Options,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    cmd: Vec<String>,
}

/// `cargo xtask vm`: exits with the guest command's status.
pub fn main(args: Args) -> Result<()> {
    let status = run(&args.options, &args.cmd)?;
    std::process::exit(status);
}

/// Boot the guest, run `cmd` as root in the current directory, return its exit status.
pub fn run(opts: &Options, cmd: &[String]) -> Result<i32> {
    let start = Instant::now();
    ensure_packages()?;
    let workspace = workspace_root()?;
    let kernel = Kernel::fetch(&opts.kernel, &workspace)?;
    let initramfs = kernel.initramfs()?;
    let image = kernel.boot_image();
    let boot_modules = kernel.loadable(BOOT_MODULES)?;
    let run = RunDir::create(&workspace, opts, cmd, &boot_modules)?;
    let cpus = opts.cpus.unwrap_or_else(|| {
        thread::available_parallelism()
            .map(usize::from)
            .unwrap_or(1)
    });
    let append = kernel_cmdline(opts, &workspace, &kernel, &run)?;
    let mut qemu = qemu_command(opts, cpus, &image, &initramfs, &append, &workspace);
    let child = qemu
        .spawn()
        .context("failed to start qemu-system-x86_64: is qemu-system-x86 installed?")?;
    let console = forward(child, &run.marker, opts.verbose, opts.timeout)?;
    let status = run.status().or(console.status);
    run.remove();
    let image_name = image.file_name().unwrap_or_default().to_string_lossy();
    let what = format!("{} ({image_name}, TCG, {cpus} CPUs)", opts.kernel);
    let tail = || {
        if console.tail.is_empty() {
            "(none)".to_owned()
        } else {
            Vec::from(console.tail.clone()).join("\n")
        }
    };
    if console.timed_out {
        bail!(
            "failed to run `{}` in {what}: timed out after {:?}; last console lines:\n{}",
            cmd.join(" "),
            opts.timeout,
            tail()
        );
    }
    let Some(status) = status else {
        bail!(
            "failed to boot {what}: the guest never ran the command (qemu: {}); last console \
             lines:\n{}",
            console.qemu,
            tail()
        );
    };
    let total = start.elapsed().as_secs_f64();
    match console.started {
        Some(boot) => eprintln!(
            "vm: {what}: booted in {:.1}s, ran in {:.1}s, exit status {status}",
            boot.duration_since(start).as_secs_f64(),
            total - boot.duration_since(start).as_secs_f64()
        ),
        None => eprintln!("vm: {what}: {total:.1}s in all, exit status {status}"),
    }
    Ok(status)
}

/// QEMU under TCG with the host's root and the workspace as 9p shares, the serial
/// console on stdio.
fn qemu_command(
    opts: &Options,
    cpus: usize,
    image: &Path,
    initramfs: &Path,
    append: &str,
    workspace: &Path,
) -> Command {
    let workspace_share = format!(
        "local,id=workspace,path={},security_model=none,multidevs=remap",
        workspace.display()
    );
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args(["-accel", "tcg", "-cpu", "max", "-smp", &cpus.to_string()])
        .args(["-m", &opts.memory])
        // No NIC, no display, no monitor: the tests make their own links, and the serial
        // console on stdio is all the output there is.
        .args(["-nodefaults", "-display", "none", "-serial", "stdio"])
        .arg("-no-reboot")
        .arg("-kernel")
        .arg(image)
        .arg("-initrd")
        .arg(initramfs)
        .args(["-append", append])
        .args([
            "-fsdev",
            "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
            "-device",
            "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
        ])
        .args(["-fsdev", &workspace_share])
        .args([
            "-device",
            "virtio-9p-pci,fsdev=workspace,mount_tag=workspace",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    qemu
}

fn ensure_packages() -> Result<()> {
    bootstrap::apt_install("vm", APT_PACKAGES)
}

pub(crate) fn workspace_root() -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    dir.canonicalize()
        .with_context(|| format!("failed to resolve the workspace root {}", dir.display()))
}

/// A path the guest's init can read from the kernel command line (split on spaces) and
/// QEMU from its options (split on commas).
fn plain_path(path: &Path) -> Result<&str> {
    let s = path
        .to_str()
        .filter(|s| {
            s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"/._+-".contains(&b))
        })
        .with_context(|| {
            format!(
                "failed to use {} in the guest: the kernel command line carries it, so only \
                 letters, digits and /._+- may appear in it",
                path.display()
            )
        })?;
    Ok(s)
}

/// A Debian kernel package, unpacked under target/vm/<name>/<version>/.
struct Kernel {
    /// e.g. 6.1.0-57-amd64: `uname -r` in the guest.
    version: String,
    /// The unpacked package, with modules.dep made by depmod.
    root: PathBuf,
    vmlinuz: PathBuf,
}

impl Kernel {
    /// The newest package of the series, downloaded and unpacked on first use.
    fn fetch(name: &str, workspace: &Path) -> Result<Self> {
        let series = name
            .strip_prefix("debian-")
            .filter(|s| {
                let mut parts = s.split('.');
                parts.clone().count() == 2
                    && parts.all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            })
            .with_context(|| {
                format!(
                    "failed to parse --kernel {name}: expected debian-<major>.<minor>, e.g. \
                     debian-6.1"
                )
            })?;
        let cache = workspace.join("target/vm").join(name);
        let version = newest_package(series, &cache)
            .with_context(|| format!("failed to find a kernel for {name}"))?;
        let dir = cache.join(&version);
        let root = dir.join("pkg");
        let kernel = Kernel {
            vmlinuz: root.join(format!("boot/vmlinuz-{version}")),
            root,
            version,
        };
        if !kernel.modules().join("modules.dep").is_file() {
            kernel
                .download(&dir)
                .with_context(|| format!("failed to fetch linux-image-{}", kernel.version))?;
            remove_other_versions(&cache, &kernel.version);
        }
        Ok(kernel)
    }

    fn modules(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.version)
    }

    /// `apt-get download`, `dpkg-deb -x` and `depmod` (the package leaves modules.dep to
    /// its postinst), in a scratch directory renamed into place when complete.
    fn download(&self, dir: &Path) -> Result<()> {
        let package = format!("linux-image-{}", self.version);
        eprintln!(
            "vm: downloading {package} (once; cached in {})",
            dir.display()
        );
        let scratch = dir.join("download");
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch)
            .with_context(|| format!("failed to create {}", scratch.display()))?;
        let status = Command::new("apt-get")
            // apt's _apt user cannot write into the workspace; it would say so and fall
            // back to root anyway.
            .args(["-qq", "-o", "APT::Sandbox::User=root", "download", &package])
            .current_dir(&scratch)
            .status()
            .context("failed to run apt-get")?;
        if !status.success() {
            bail!("failed to run `apt-get download {package}`: {status}");
        }
        let deb = std::fs::read_dir(&scratch)
            .with_context(|| format!("failed to read {}", scratch.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|e| e == "deb"))
            .with_context(|| format!("failed to find the .deb in {}", scratch.display()))?;
        let unpacked = scratch.join("pkg");
        sh(
            "dpkg-deb",
            &["-x", &deb.to_string_lossy(), &unpacked.to_string_lossy()],
            &[],
        )?;
        sh(
            "depmod",
            &["-b", &unpacked.to_string_lossy(), &self.version],
            &[],
        )?;
        let _ = std::fs::remove_dir_all(&self.root);
        std::fs::rename(&unpacked, &self.root)
            .with_context(|| format!("failed to move the package to {}", self.root.display()))?;
        let _ = std::fs::remove_dir_all(&scratch);
        Ok(())
    }

    /// What QEMU boots: the uncompressed vmlinux, entered through its PVH note (the
    /// Debian kernels have CONFIG_PVH), else the bzImage, which decompresses itself.
    fn boot_image(&self) -> PathBuf {
        let vmlinux = self.root.join(format!("boot/vmlinux-{}", self.version));
        if vmlinux.is_file() {
            return vmlinux;
        }
        match extract_vmlinux(&self.vmlinuz, &vmlinux) {
            Ok(()) => vmlinux,
            Err(e) => {
                eprintln!("vm: warning: booting the bzImage (slower under TCG): {e:#}");
                self.vmlinuz.clone()
            }
        }
    }

    /// The initramfs (busybox, /init, the root's modules), rebuilt when an input changes.
    fn initramfs(&self) -> Result<PathBuf> {
        let modules = self.load_order(ROOT_MODULES)?;
        let busybox = Path::new("/bin/busybox");
        let meta = std::fs::metadata(busybox)
            .with_context(|| format!("failed to read {}", busybox.display()))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        let mut inputs = format!("busybox {} {mtime}\n", meta.len());
        for m in &modules {
            let _ = writeln!(inputs, "{}", m.display());
        }
        inputs.push_str(INIT);
        let dir = self.root.parent().unwrap_or(&self.root);
        let path = dir.join("initramfs.cpio");
        let stamp = dir.join("initramfs.inputs");
        if path.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == inputs) {
            return Ok(path);
        }
        let mut cpio = Cpio::default();
        for d in ["bin", "dev", "proc", "sys", "lib", "lib/modules"] {
            cpio.dir(d);
        }
        // The kernel opens /dev/console for init's stdio before devtmpfs is up.
        cpio.char_device("dev/console", 5, 1);
        let bytes = std::fs::read(busybox)
            .with_context(|| format!("failed to read {}", busybox.display()))?;
        cpio.file("bin/busybox", 0o755, &bytes);
        cpio.file("init", 0o755, INIT.as_bytes());
        let mut order = String::new();
        for m in &modules {
            let name = format!("lib/modules/{}.ko", module_name(m));
            cpio.file(&name, 0o644, &read_module(&self.modules().join(m))?);
            let _ = writeln!(order, "/{name}");
        }
        cpio.file("modules.order", 0o644, order.as_bytes());
        std::fs::write(&path, cpio.finish())
            .with_context(|| format!("failed to write {}", path.display()))?;
        std::fs::write(&stamp, inputs)
            .with_context(|| format!("failed to write {}", stamp.display()))?;
        Ok(path)
    }

    /// The modules (paths relative to lib/modules/<version>) to insmod, dependencies
    /// first, built-in ones left out.
    fn load_order(&self, wanted: &[&str]) -> Result<Vec<PathBuf>> {
        let index = self.module_index()?;
        let mut order = Vec::new();
        let mut seen = HashSet::new();
        for w in wanted {
            let Some((path, list)) = index.lookup(w)? else {
                continue;
            };
            // modules.dep lists the full closure, each module after those needing it.
            for p in list.iter().rev().chain([path]) {
                if seen.insert(p.clone()) {
                    order.push(p.clone());
                }
            }
        }
        Ok(order)
    }

    /// The names of the `wanted` modules this kernel has as modules (built-in ones left
    /// out): those the guest must find in /sys/module once modprobe ran.
    fn loadable(&self, wanted: &[&str]) -> Result<Vec<String>> {
        let index = self.module_index()?;
        let mut names = Vec::new();
        for w in wanted {
            if index.lookup(w)?.is_some() {
                names.push(w.replace('-', "_"));
            }
        }
        Ok(names)
    }

    fn module_index(&self) -> Result<ModuleIndex> {
        let dir = self.modules();
        let read = |f: &str| {
            let p = dir.join(f);
            std::fs::read_to_string(&p).with_context(|| format!("failed to read {}", p.display()))
        };
        let builtin = read("modules.builtin")?
            .lines()
            .map(|l| module_name(Path::new(l)))
            .collect();
        let deps = read("modules.dep")?
            .lines()
            .filter_map(|l| l.split_once(':'))
            .map(|(m, d)| {
                let m = PathBuf::from(m);
                (
                    module_name(&m),
                    (m, d.split_whitespace().map(PathBuf::from).collect()),
                )
            })
            .collect();
        Ok(ModuleIndex { dir, builtin, deps })
    }
}

/// A kernel's modules.builtin and modules.dep, by module name.
struct ModuleIndex {
    dir: PathBuf,
    builtin: HashSet<String>,
    /// Each module's path and its dependencies' (the full closure).
    deps: HashMap<String, (PathBuf, Vec<PathBuf>)>,
}

impl ModuleIndex {
    /// A module's path and dependencies; None if it is built in; an error if the kernel
    /// has it neither way.
    fn lookup(&self, name: &str) -> Result<Option<&(PathBuf, Vec<PathBuf>)>> {
        let name = name.replace('-', "_");
        if self.builtin.contains(&name) {
            return Ok(None);
        }
        self.deps.get(&name).map(Some).with_context(|| {
            format!(
                "failed to find module {name} in {}: neither built in nor in modules.dep",
                self.dir.display()
            )
        })
    }
}

/// The newest linux-image-<version> of a series that apt knows, e.g. 6.1.0-57-amd64 for
/// 6.1 (Debian 12's own kernel) or 6.12.111+deb12-amd64 for 6.12 (its backports).
fn newest_package(series: &str, cache: &Path) -> Result<String> {
    let s = series.replace('.', "\\.");
    let pattern = format!("^linux-image-({s}\\.0-[0-9]+|{s}\\.[0-9]+\\+deb[0-9]+)-amd64$");
    let search = || -> Result<Vec<String>> {
        let out = Command::new("apt-cache")
            .args(["search", "--names-only", &pattern])
            .output()
            .context("failed to run apt-cache")?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter_map(|p| p.strip_prefix("linux-image-"))
            .map(str::to_owned)
            .collect())
    };
    let mut found = search()?;
    if found.is_empty() {
        // Without lists (a fresh container) a kernel fetched before still serves.
        if let Some(cached) = cached_versions(cache)
            .into_iter()
            .max_by(|a, b| natural_cmp(a, b))
        {
            return Ok(cached);
        }
        eprintln!("vm: no kernel package of {series} in apt's lists: apt-get update");
        sh("apt-get", &["update", "-qq"], &[])?;
        found = search()?;
    }
    found.into_iter().max_by(|a, b| natural_cmp(a, b)).with_context(|| {
        format!(
            "apt-cache lists no package matching {pattern} (Debian's amd64 kernels of {series}) \
             even after apt-get update"
        )
    })
}

fn cached_versions(cache: &Path) -> Vec<String> {
    std::fs::read_dir(cache)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| e.path().join("pkg/boot").is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}

/// A newer package superseded these: each unpacked kernel is about 400 MB.
fn remove_other_versions(cache: &Path, keep: &str) {
    for v in cached_versions(cache).into_iter().filter(|v| v != keep) {
        let _ = std::fs::remove_dir_all(cache.join(v));
    }
}

/// Compare with digit runs as numbers, so 6.1.0-57 sorts after 6.1.0-9.
fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    fn runs(s: &str) -> Vec<(bool, &str)> {
        let mut out = Vec::new();
        let mut start = 0;
        let b = s.as_bytes();
        for i in 1..=b.len() {
            if i == b.len() || b[i].is_ascii_digit() != b[start].is_ascii_digit() {
                out.push((b[start].is_ascii_digit(), &s[start..i]));
                start = i;
            }
        }
        out
    }
    let key = |(digits, r): (bool, &str)| {
        if digits {
            (r.trim_start_matches('0').len(), r.to_owned())
        } else {
            (0, r.to_owned())
        }
    };
    runs(a)
        .into_iter()
        .map(key)
        .cmp(runs(b).into_iter().map(key))
}

/// The ELF kernel inside a bzImage (what scripts/extract-vmlinux does), written to `out`
/// through a temporary file. Only with a PVH note can QEMU boot it.
fn extract_vmlinux(bzimage: &Path, out: &Path) -> Result<()> {
    let image =
        std::fs::read(bzimage).with_context(|| format!("failed to read {}", bzimage.display()))?;
    let payload = bzimage_payload(&image)
        .with_context(|| format!("failed to find the payload of {}", bzimage.display()))?;
    // The kernel's build appends the uncompressed size to xz and zstd payloads.
    let (stream, size) = payload.split_at(payload.len().saturating_sub(4));
    let tool = if stream.starts_with(b"\xfd7zXZ\0") {
        "xz"
    } else if stream.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        "zstd"
    } else {
        bail!("failed to decompress {}: not xz or zstd", bzimage.display());
    };
    let size = u32::from_le_bytes(size.try_into().unwrap_or_default());
    let mut child = Command::new(tool)
        .arg("-dc")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("failed to run {tool}"))?;
    let mut stdin = child.stdin.take().context("failed to open a pipe")?;
    let stream = stream.to_vec();
    let feed = thread::spawn(move || stdin.write_all(&stream));
    let done = child
        .wait_with_output()
        .with_context(|| format!("failed to run {tool}"))?;
    let _ = feed.join();
    let elf = done.stdout;
    if !done.status.success() || elf.len() != size as usize || !elf.starts_with(b"\x7fELF") {
        bail!(
            "failed to decompress {} with {tool} ({}, {} of {size} bytes): {}",
            bzimage.display(),
            done.status,
            elf.len(),
            String::from_utf8_lossy(&done.stderr).trim()
        );
    }
    if !has_pvh_note(&elf) {
        bail!("failed to find a PVH entry in {}", bzimage.display());
    }
    let tmp = out.with_file_name(".vmlinux.tmp");
    std::fs::write(&tmp, &elf)
        .and_then(|()| std::fs::rename(&tmp, out))
        .with_context(|| format!("failed to write {}", out.display()))
}

/// The compressed kernel in a bzImage, from its setup header (the x86 boot protocol):
/// setup_sects at 0x1f1, payload_offset and payload_length at 0x248 and 0x24c.
fn bzimage_payload(image: &[u8]) -> Option<&[u8]> {
    let u32_at = |at: usize| Some(u32::from_le_bytes(image.get(at..at + 4)?.try_into().ok()?));
    if image.get(0x202..0x206)? != b"HdrS" {
        return None;
    }
    let setup_sects = match *image.get(0x1f1)? {
        0 => 4,
        n => usize::from(n),
    };
    let start = (setup_sects + 1) * 512 + u32_at(0x248)? as usize;
    image.get(start..start + u32_at(0x24c)? as usize)
}

/// Whether an ELF image carries Xen's PHYS32_ENTRY note (type 18), QEMU's PVH entry.
fn has_pvh_note(elf: &[u8]) -> bool {
    // A note header (namesz 4, descsz, type 18) then the name "Xen\0": scanning for it
    // avoids an ELF parser.
    elf.windows(16).any(|w| {
        w[..4] == 4u32.to_le_bytes() && w[8..12] == 18u32.to_le_bytes() && &w[12..] == b"Xen\0"
    })
}

/// A module's name as the kernel knows it: file name up to .ko, dashes as underscores.
fn module_name(path: &Path) -> String {
    let file = path.file_name().unwrap_or_default().to_string_lossy();
    file.split(".ko").next().unwrap_or(&file).replace('-', "_")
}

/// A module's bytes, decompressed on the host: busybox's insmod takes plain ELF only.
fn read_module(path: &Path) -> Result<Vec<u8>> {
    let tool = match path.extension().and_then(|e| e.to_str()) {
        Some("xz") => Some("xz"),
        Some("zst") => Some("zstd"),
        Some("gz") => Some("gzip"),
        _ => None,
    };
    let Some(tool) = tool else {
        return std::fs::read(path).with_context(|| format!("failed to read {}", path.display()));
    };
    let out = Command::new(tool)
        .arg("-dc")
        .arg(path)
        .output()
        .with_context(|| format!("failed to run {tool}"))?;
    if !out.status.success() {
        bail!(
            "failed to decompress {}: {tool}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}

/// A newc cpio archive, all entries owned by root with mtime 0.
#[derive(Default)]
struct Cpio {
    buf: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, (0, 0), &[]);
    }

    fn file(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | mode, (0, 0), data);
    }

    fn char_device(&mut self, name: &str, major: u32, minor: u32) {
        self.entry(name, 0o020_600, (major, minor), &[]);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        self.buf
    }

    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        self.ino += 1;
        let nlink = if mode & 0o170_000 == 0o040_000 { 2 } else { 1 };
        let fields = [
            self.ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            data.len() as u32,
            0, // devmajor
            0, // devminor
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0, // check
        ];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }
}

/// target/vm/runs/<pid>/: the guest's scripts, and the status file it writes back.
struct RunDir {
    dir: PathBuf,
    /// Starts the lines the guest prints around the command; unique per run, so command
    /// output cannot fake it.
    marker: String,
}

impl RunDir {
    fn create(
        workspace: &Path,
        opts: &Options,
        cmd: &[String],
        boot_modules: &[String],
    ) -> Result<Self> {
        let dir = workspace
            .join("target/vm/runs")
            .join(std::process::id().to_string());
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("failed to create {}", dir.display()))?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let run = RunDir {
            marker: format!("xtask-vm-{:x}-{nanos:08x}", std::process::id()),
            dir,
        };
        let cwd = std::env::current_dir().context("failed to read the current directory")?;
        let command = command_script(&cwd, opts, cmd);
        let guest = run.guest_script(boot_modules);
        for (name, text) in [("command.sh", command), ("guest.sh", guest)] {
            let p = run.dir.join(name);
            std::fs::write(&p, text).with_context(|| format!("failed to write {}", p.display()))?;
        }
        Ok(run)
    }

    /// The final root's PID 1 ([`GUEST`] for this run), loading `boot_modules`.
    fn guest_script(&self, boot_modules: &[String]) -> String {
        GUEST
            .replace("@CHECK_MODULES@", CHECK_MODULES)
            .replace("@MODULE_MISSING@", &MODULE_MISSING.to_string())
            .replace("@MODULES@", &boot_modules.join(" "))
            .replace("@MARKER@", &self.marker)
            .replace("@DIR@", &self.dir.to_string_lossy())
    }

    /// The status the guest wrote, if it got that far.
    fn status(&self) -> Option<i32> {
        std::fs::read_to_string(self.dir.join("status"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }

    fn remove(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `cd`, the environment and the command, each word shell-quoted.
fn command_script(cwd: &Path, opts: &Options, cmd: &[String]) -> String {
    let mut env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            ENV_PASSED.contains(&k.as_str())
                || k.starts_with("EGRESS_")
                || (k.starts_with("CARGO_")
                    && !k.starts_with("CARGO_PKG_")
                    && !ENV_XTASK_ONLY.contains(&k.as_str()))
        })
        .collect();
    env.push(("HOME".into(), "/root".into()));
    env.extend(opts.env.iter().cloned());
    let cwd = cwd.to_string_lossy();
    let mut s = format!(
        "cd {q} || {{ echo \"vm: failed to enter \"{q}\" in the guest\" >&2; exit 125; }}\n",
        q = quote(&cwd)
    );
    for (k, v) in env {
        let _ = writeln!(s, "export {k}={}", quote(&v));
    }
    // The kernel's default of 1,024 open files: a packet table loads one object (some
    // thirty maps and programs) per case, every case of two tables at once, and under
    // emulation they overlap long enough to run out (EMFILE). The host's shells raise it.
    s.push_str("ulimit -n 65536 2>/dev/null || ulimit -n 4096 2>/dev/null\n");
    let words: Vec<String> = cmd.iter().map(|w| quote(w)).collect();
    let _ = writeln!(s, "exec {}", words.join(" "));
    s
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn kernel_cmdline(
    opts: &Options,
    workspace: &Path,
    kernel: &Kernel,
    run: &RunDir,
) -> Result<String> {
    let mut a = vec![
        "console=ttyS0".to_owned(),
        // With -no-reboot, a panic ends QEMU at once.
        "panic=-1".to_owned(),
        format!("xtask.workspace={}", plain_path(workspace)?),
        format!("xtask.modules={}", plain_path(&kernel.modules())?),
        format!("xtask.run={}", plain_path(&run.dir.join("guest.sh"))?),
        format!("xtask.msize={MSIZE}"),
    ];
    if !opts.verbose {
        a.extend(["quiet".to_owned(), "loglevel=3".to_owned()]);
    }
    a.extend(opts.append.clone());
    Ok(a.join(" "))
}

/// What the console showed.
struct Console {
    /// When the guest started the command.
    started: Option<Instant>,
    /// The status the guest printed (the status file is preferred).
    status: Option<i32>,
    timed_out: bool,
    tail: VecDeque<String>,
    /// How QEMU ended.
    qemu: String,
}

enum Line {
    Console(String),
    Qemu(String),
}

/// Forward QEMU's output (console to stdout, its own messages to stderr) until it exits or
/// the timeout kills it.
fn forward(mut child: Child, marker: &str, verbose: bool, timeout: Duration) -> Result<Console> {
    let (tx, rx) = mpsc::channel();
    let stdout = child
        .stdout
        .take()
        .context("failed to read QEMU's output")?;
    let stderr = child
        .stderr
        .take()
        .context("failed to read QEMU's errors")?;
    let readers = [
        spawn_reader(stdout, tx.clone(), Line::Console),
        spawn_reader(stderr, tx, Line::Qemu),
    ];
    let deadline = Instant::now() + timeout;
    let mut console = Console {
        started: None,
        status: None,
        timed_out: false,
        tail: VecDeque::with_capacity(TAIL_LINES),
        qemu: String::new(),
    };
    let mut out = std::io::stdout();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = match rx.recv_timeout(left) {
            Ok(line) => line,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                console.timed_out = true;
                let _ = child.kill();
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let (text, to_stderr) = match line {
            Line::Console(t) => (t, false),
            Line::Qemu(t) => (t, true),
        };
        let text = match text.split_once(marker) {
            Some((before, after)) => {
                match after.trim() {
                    "start" => console.started = Some(Instant::now()),
                    a => console.status = a.strip_prefix("exit ").and_then(|s| s.parse().ok()),
                }
                before.to_owned()
            }
            None => text,
        };
        // After the command: only the kernel's shutdown, unless asked for.
        if text.is_empty() || (console.status.is_some() && !verbose) {
            continue;
        }
        if to_stderr {
            eprintln!("{text}");
        } else {
            let _ = writeln!(out, "{text}");
        }
        if console.tail.len() == TAIL_LINES {
            console.tail.pop_front();
        }
        console.tail.push_back(text);
    }
    let status = child.wait().context("failed to wait for QEMU")?;
    console.qemu = status.to_string();
    for r in readers {
        let _ = r.join();
    }
    Ok(console)
}

fn spawn_reader(
    pipe: impl Read + Send + 'static,
    tx: mpsc::Sender<Line>,
    kind: fn(String) -> Line,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let mut reader = BufReader::new(pipe);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            // The serial console ends lines with \r\n.
            let text = String::from_utf8_lossy(&buf).replace('\r', "");
            let text = text.strip_suffix('\n').unwrap_or(&text).to_owned();
            if tx.send(kind(text)).is_err() {
                return;
            }
        }
    })
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (n, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = n
        .parse()
        .map_err(|_| format!("failed to parse duration {s}: expected e.g. 90s, 30m or 2h"))?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => {
            return Err(format!(
                "failed to parse duration {s}: unit must be s, m or h"
            ));
        }
    };
    Ok(Duration::from_secs(secs))
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("failed to parse --env {s}: expected NAME=VALUE"))?;
    let valid = !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !valid {
        return Err(format!(
            "failed to parse --env {s}: {k} is not a variable name"
        ));
    }
    Ok((k.to_owned(), v.to_owned()))
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::CHECK_MODULES;

    /// `check_modules` in a host shell: `kernel` and `printk` are in every kernel's
    /// /sys/module (built in, with parameters).
    fn check(modules: &str) -> std::process::Output {
        Command::new("sh")
            .arg("-c")
            .arg(format!("{CHECK_MODULES}\ncheck_modules {modules}"))
            .output()
            .unwrap()
    }

    #[test]
    fn a_module_not_loaded_fails_the_check_and_is_named() {
        let out = check("kernel no_such_module printk");
        assert!(!out.status.success(), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("failed to load module(s) no_such_module in the guest"),
            "{err}"
        );
    }

    #[test]
    fn loaded_modules_pass_the_check() {
        let out = check("kernel printk");
        assert!(out.status.success(), "{out:?}");
        assert!(out.stderr.is_empty(), "{out:?}");
    }
}
