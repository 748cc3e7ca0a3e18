//! Toolchain bootstrap. On a Debian-family machine: installs what is missing and says
//! so; elsewhere: prints what to install and stops. A second run only checks.

use std::{path::Path, process::Command, time::Instant};

use anyhow::{Context as _, Result, bail};

/// Debian packages the build and the tests need.
const APT_PACKAGES: &[(&str, &str)] = &[
    (
        "rustc-web",
        "rustc 1.96 with LLVM 22: builds the eBPF crate",
    ),
    ("cargo-web", "its cargo"),
    ("rust-web-src", "core's source, for -Z build-std=core"),
    ("rust-web-clippy", "clippy for the eBPF crate"),
    ("llvm-22-dev", "LLVM for bpf-linker"),
    ("libpolly-22-dev", "LLVM component bpf-linker links"),
    ("libzstd-dev", "LLVM dependency"),
    ("zlib1g-dev", "LLVM dependency"),
    ("bpftool", "map and program inspection"),
    ("iproute2", "namespaces, links, tc"),
    ("iperf3", "throughput benchmarks"),
    ("tcpdump", "debugging the lab"),
    ("iputils-ping", "ICMP tests"),
    ("netcat-openbsd", "ad-hoc traffic in the lab"),
    (
        "nftables",
        "the baseline (OVN-Kubernetes-style SNAT) in benchmarks",
    ),
    (
        "openvswitch-switch",
        "ovsdb-server for the OVSDB client's test, and Open vSwitch for the lab's --cni ovs \
         wiring in the guest (whose root is this machine's); nothing starts it here",
    ),
    (
        "ovn-central",
        "ovn-northd and the NB and SB database schemas, for the lab's --cni ovn wiring in \
         the guest (whose root is this machine's); nothing starts it here",
    ),
    (
        "ovn-host",
        "ovn-controller, for the lab's --cni ovn wiring in the guest; nothing starts it here",
    ),
    ("umoci", "builds the agent's OCI image (cargo xtask image)"),
    ("podman", "runs the image in a test"),
    (
        "runc",
        "podman's runtime in that test (crun refuses hybrid cgroup hierarchies)",
    ),
];

/// Debian packages installed only when their command is missing: Debian 12 calls its
/// kubectl `kubernetes-client`, and another package's kubectl may own /usr/bin/kubectl.
const APT_COMMANDS: &[(&str, &str, &str)] = &[
    (
        "kubectl",
        "kubernetes-client",
        "`kubectl kustomize deploy/` in a test",
    ),
    (
        "promtool",
        "prometheus",
        "`promtool check rules` and `promtool test rules` on deploy/monitoring in a test",
    ),
];

/// Name under which Debian's compiler is linked into rustup.
pub const TOOLCHAIN: &str = "debian";

pub fn run() -> Result<()> {
    let start = Instant::now();
    if !Path::new("/etc/debian_version").exists() {
        let list: Vec<_> = APT_PACKAGES.iter().map(|(p, _)| *p).collect();
        bail!(
            "failed to bootstrap: this is not a Debian-family machine. Install the equivalents \
             of: {}; then `rustup toolchain link {TOOLCHAIN} <prefix of that rustc>` and \
             `LLVM_PREFIX=<llvm 22 prefix> cargo install bpf-linker --no-default-features \
             --features llvm-22`",
            list.join(" ")
        );
    }
    let commands = APT_COMMANDS
        .iter()
        .filter(|(cmd, _, _)| !on_path(cmd))
        .map(|(_, p, why)| (*p, *why));
    let wanted: Vec<(&str, &str)> = APT_PACKAGES.iter().copied().chain(commands).collect();
    apt_install("bootstrap", &wanted)?;
    let linked = Command::new("rustup")
        .args(["toolchain", "list"])
        .output()
        .context("failed to run rustup: is rustup installed?")?;
    if !String::from_utf8_lossy(&linked.stdout)
        .lines()
        .any(|l| l.split_whitespace().next() == Some(TOOLCHAIN))
    {
        eprintln!("bootstrap: linking Debian's rustc into rustup as `{TOOLCHAIN}`");
        sh("rustup", &["toolchain", "link", TOOLCHAIN, "/usr"], &[])?;
    }
    let have_linker = Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !have_linker {
        eprintln!("bootstrap: building bpf-linker against LLVM 22 (about a minute)");
        sh(
            "cargo",
            &[
                "install",
                "--locked",
                "bpf-linker",
                "--no-default-features",
                "--features",
                "llvm-22",
            ],
            &[("LLVM_PREFIX", "/usr/lib/llvm-22")],
        )?;
    }
    ensure_bpffs()?;
    eprintln!(
        "bootstrap: toolchain ready ({:.1}s)",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Install those of `wanted` (package, why) that dpkg does not have, saying why each;
/// `who` prefixes the lines.
pub fn apt_install(who: &str, wanted: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<&str> = wanted
        .iter()
        .map(|(p, _)| *p)
        .filter(|p| !dpkg_installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    for (p, why) in wanted.iter().filter(|(p, _)| missing.contains(p)) {
        eprintln!("{who}: installing {p} ({why})");
    }
    sh("apt-get", &["update", "-qq"], &[])?;
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend(&missing);
    let services: Vec<&str> = SERVICES_LEFT_OFF
        .iter()
        .filter(|(p, _)| missing.contains(p))
        .flat_map(|(_, units)| units.iter().copied())
        .collect();
    if services.is_empty() {
        return sh("apt-get", &args, &[("DEBIAN_FRONTEND", "noninteractive")]);
    }
    // Their maintainer scripts start and enable their units under systemd
    // (deb-systemd-invoke, which asks policy-rc.d first): the lab runs these daemons by
    // hand in its own namespaces, never on this machine.
    let guard = NoServiceStarts::install()?;
    let installed = sh("apt-get", &args, &[("DEBIAN_FRONTEND", "noninteractive")]);
    drop(guard);
    installed?;
    if Path::new("/run/systemd/system").is_dir() {
        eprintln!(
            "{who}: disabling {} (the lab starts them itself)",
            services.join(" ")
        );
        let mut a = vec!["disable", "--now"];
        a.extend(&services);
        sh("systemctl", &a, &[])?;
    }
    Ok(())
}

/// Packages whose maintainer scripts start and enable systemd units, with those units:
/// installed by [`apt_install`] without starting them, and disabled where systemd runs.
/// Open vSwitch is not among them: a machine may run its own for other things, and
/// bootstrap has always left it as Debian installs it.
const SERVICES_LEFT_OFF: &[(&str, &[&str])] = &[
    (
        "ovn-central",
        &[
            "ovn-central.service",
            "ovn-northd.service",
            "ovn-ovsdb-server-nb.service",
            "ovn-ovsdb-server-sb.service",
        ],
    ),
    ("ovn-host", &["ovn-host.service", "ovn-controller.service"]),
];

/// `/usr/sbin/policy-rc.d` answering 101 ("action forbidden") while it lives, so that
/// packages installed meanwhile start no service; one already there (a container image's)
/// is left as it is.
struct NoServiceStarts(Option<&'static Path>);

impl NoServiceStarts {
    const PATH: &'static str = "/usr/sbin/policy-rc.d";

    fn install() -> Result<Self> {
        let path = Path::new(Self::PATH);
        if path.exists() {
            return Ok(Self(None));
        }
        std::fs::write(
            path,
            "#!/bin/sh\n# cargo xtask bootstrap: no service starts\nexit 101\n",
        )
        .with_context(|| format!("failed to write {}", path.display()))?;
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("failed to make {} executable", path.display()))?;
        Ok(Self(Some(path)))
    }
}

impl Drop for NoServiceStarts {
    fn drop(&mut self) {
        if let Some(path) = self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn on_path(cmd: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(cmd).is_file()))
}

fn dpkg_installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

/// Mount the BPF filesystem when nothing is mounted at /sys/fs/bpf (the agent pins there).
fn ensure_bpffs() -> Result<()> {
    let mounts = std::fs::read_to_string("/proc/mounts").context("failed to read /proc/mounts")?;
    if mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf"))
    {
        return Ok(());
    }
    if !nix_is_root() {
        eprintln!("bootstrap: /sys/fs/bpf is not mounted (needs root): privileged tests will fail");
        return Ok(());
    }
    eprintln!("bootstrap: mounting bpffs at /sys/fs/bpf");
    sh("mount", &["-t", "bpf", "bpf", "/sys/fs/bpf"], &[])
}

fn nix_is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

pub fn sh(prog: &str, args: &[&str], env: &[(&str, &str)]) -> Result<()> {
    let status = Command::new(prog)
        .args(args)
        .envs(env.iter().copied())
        .status()
        .with_context(|| format!("failed to run {prog}"))?;
    if !status.success() {
        bail!("failed to run `{prog} {}`: {status}", args.join(" "));
    }
    Ok(())
}
