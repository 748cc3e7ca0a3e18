//! `cargo xtask image`: the agent as an OCI image, built from scratch with umoci: no base
//! image, no registry, no container daemon. The image holds the release `egress-agent`
//! (the eBPF object is embedded in it) and the shared libraries the dynamic loader maps
//! for it, as `ldd` lists them; the agent execs nothing and reads no file of its own, and
//! in a cluster its API server's CA comes from the service account, so nothing else.
//!
//! Layer and config times are `SOURCE_DATE_EPOCH` (default: the HEAD commit's time), so
//! the same binary gives the same digest.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

use crate::{bootstrap::sh, build::json_str};

/// Repository of the image, as `podman load` names it and `deploy/image/kustomization.yaml`
/// refers to it; the tag is the agent's version.
pub const REPOSITORY: &str = "localhost/egress-agent";
/// Where the binary lives in the image (its entrypoint).
const BINARY: &str = "usr/local/bin/egress-agent";

/// Which build of the agent goes into the image.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// `cargo build --release`: what `cargo xtask image` ships.
    Release,
    /// The debug build `cargo xtask test` has already made: the same packaging, for the
    /// image test, without a second build of every dependency (about 9 minutes on two
    /// cores). Archived beside the release image, never instead of it.
    Dev,
}

/// `cargo xtask image [--dev]`.
pub fn run(profile: Profile) -> Result<()> {
    crate::bootstrap::run()?;
    build(profile).map(|_| ())
}

/// Build the agent (`profile`) and its image; print where it is, its digest and sizes.
/// Returns the archive's path.
pub fn build(profile: Profile) -> Result<PathBuf> {
    let start = Instant::now();
    let agent = build_agent(profile)?;
    let target = agent
        .parent()
        .and_then(Path::parent)
        .with_context(|| format!("failed to find the target directory of {}", agent.display()))?;
    let version = agent_version(&agent)?;
    let reference = format!("{REPOSITORY}:{version}");
    let dir = target.join("image");
    let work = dir.join("work");
    if work.exists() {
        fs::remove_dir_all(&work)
            .with_context(|| format!("failed to remove {}", work.display()))?;
    }
    let rootfs = work.join("rootfs");
    let libraries = stage_rootfs(&agent, &rootfs)?;
    stage_cni_bundle(&agent, &rootfs)?;
    let epoch = source_date_epoch()?;
    let layout = work.join("oci");
    pack(&rootfs, &layout, &reference, &epoch)?;
    let archive = dir.join(match profile {
        Profile::Release => "egress-agent.oci.tar",
        Profile::Dev => "egress-agent-dev.oci.tar",
    });
    archive_layout(&layout, &archive, &epoch)?;
    let index = fs::read_to_string(layout.join("index.json"))
        .context("failed to read the image's index.json")?;
    let digest = json_str(&index, "digest")
        .context("failed to read the manifest digest from index.json")?
        .to_owned();
    let size = |p: &Path| fs::metadata(p).map(|m| m.len()).unwrap_or_default();
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    let binary = size(&rootfs.join(BINARY));
    let libs: u64 = libraries
        .iter()
        .map(|l| size(&rootfs.join(l.strip_prefix("/").unwrap_or(l))))
        .sum();
    fs::remove_dir_all(&work).with_context(|| format!("failed to remove {}", work.display()))?;
    println!("image:   {} ({reference})", archive.display());
    println!("digest:  {digest}");
    println!(
        "size:    {:.1} MiB archive; contents {:.1} MiB: /{BINARY} {:.1} MiB (stripped), {} \
         libraries {:.1} MiB ({})",
        mib(size(&archive)),
        mib(binary + libs),
        mib(binary),
        libraries.len(),
        mib(libs),
        libraries
            .iter()
            .map(|l| l.display().to_string())
            .collect::<Vec<_>>()
            .join(" "),
    );
    println!("built in {:.0}s", start.elapsed().as_secs_f64());
    Ok(archive)
}

/// `cargo build [--release] -p egress-agent`; the binary's path.
fn build_agent(profile: Profile) -> Result<PathBuf> {
    let release: &[&str] = match profile {
        Profile::Release => &["--release"],
        Profile::Dev => &[],
    };
    let out = Command::new(env!("CARGO"))
        .arg("build")
        .args(release)
        .args([
            "--package",
            "egress-agent",
            "--bin",
            "egress-agent",
            "--bin",
            "egress-cni",
            "--message-format=json-render-diagnostics",
        ])
        .stderr(Stdio::inherit())
        .output()
        .context("failed to run cargo build -p egress-agent")?;
    if !out.status.success() {
        bail!("failed to build the agent: cargo build -p egress-agent failed");
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\""))
        .filter_map(|l| json_str(l, "executable").map(PathBuf::from))
        .find(|p| p.file_name().is_some_and(|n| n == "egress-agent"))
        .context("failed to find the agent binary in cargo's output")
}

/// Where the CNI plugin's bundle lives in the image: the plugin, its libraries and the
/// loader, side by side (`egress-agent install-cni` copies it to the host, with a script
/// that runs it with that loader: the host's C library plays no part).
const CNI_BUNDLE: &str = "usr/local/lib/egress-cni";

/// The plugin's bundle, from the plugin built next to `agent`.
fn stage_cni_bundle(agent: &Path, rootfs: &Path) -> Result<()> {
    let plugin = agent.with_file_name("egress-cni");
    let dir = rootfs.join(CNI_BUNDLE);
    fs::create_dir_all(&dir).with_context(|| format!("failed to create {}", dir.display()))?;
    let out = dir.join("egress-cni");
    sh(
        "strip",
        &[
            "--strip-all",
            "-o",
            &out.to_string_lossy(),
            &plugin.to_string_lossy(),
        ],
        &[],
    )?;
    for lib in libraries(&plugin)? {
        let name = lib.file_name().context("a library without a name")?;
        fs::copy(&lib, dir.join(name))
            .with_context(|| format!("failed to copy {}", lib.display()))?;
    }
    Ok(())
}

/// `0.2.0` from `egress-agent 0.2.0 (commit 0123456789ab)`.
fn agent_version(agent: &Path) -> Result<String> {
    let out = Command::new(agent)
        .arg("--version")
        .output()
        .with_context(|| format!("failed to run {} --version", agent.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    match text.trim().split_once(' ') {
        Some(("egress-agent", v)) if out.status.success() && !v.is_empty() => {
            Ok(v.split_whitespace().next().unwrap_or(v).to_owned())
        }
        _ => bail!("failed to read the agent's version: `--version` printed {text:?}"),
    }
}

/// The image's file tree: the stripped binary and, at the paths the loader looks for
/// them, the libraries it needs (regular files, symlinks resolved). Returns their paths.
fn stage_rootfs(agent: &Path, rootfs: &Path) -> Result<Vec<PathBuf>> {
    let binary = rootfs.join(BINARY);
    create_parent(&binary)?;
    let bin = binary.to_string_lossy();
    sh(
        "strip",
        &["--strip-all", "-o", &bin, &agent.to_string_lossy()],
        &[],
    )?;
    let libraries = libraries(agent)?;
    for lib in &libraries {
        let dest = rootfs.join(lib.strip_prefix("/").unwrap_or(lib));
        create_parent(&dest)?;
        fs::copy(lib, &dest).with_context(|| format!("failed to copy {}", lib.display()))?;
    }
    Ok(libraries)
}

fn create_parent(path: &Path) -> Result<()> {
    let parent = path.parent().context("a path without a parent")?;
    fs::create_dir_all(parent).with_context(|| format!("failed to create {}", parent.display()))
}

/// What `ldd` says the binary loads (the loader included, the vDSO not). Empty for a
/// static binary.
fn libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("failed to run ldd (Debian's libc-bin)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        if String::from_utf8_lossy(&out.stderr).contains("not a dynamic executable")
            || text.contains("statically linked")
        {
            return Ok(Vec::new());
        }
        bail!("failed to run ldd {}: {}", binary.display(), out.status);
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        if line.contains("not found") {
            bail!(
                "failed to package the agent: ldd cannot find {}",
                line.trim()
            );
        }
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` or
        // `/lib64/ld-linux-x86-64.so.2 (0x...)`; `linux-vdso.so.1 (0x...)` has no path.
        if let Some(path) = line.split_whitespace().find(|w| w.starts_with('/')) {
            libs.push(PathBuf::from(path));
        }
    }
    libs.sort();
    libs.dedup();
    Ok(libs)
}

/// Seconds since the epoch for every time in the image: `SOURCE_DATE_EPOCH`, else the
/// HEAD commit's time, else 0.
fn source_date_epoch() -> Result<String> {
    if let Ok(s) = std::env::var("SOURCE_DATE_EPOCH") {
        s.parse::<u64>()
            .with_context(|| format!("failed to read SOURCE_DATE_EPOCH {s:?}: not a number"))?;
        return Ok(s);
    }
    let out = Command::new("git")
        .args(["log", "-1", "--format=%ct"])
        .stderr(Stdio::null())
        .output();
    Ok(out
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|s| s.parse::<u64>().is_ok())
        .unwrap_or_else(|| "0".to_owned()))
}

/// An OCI image layout at `layout`: an empty image, its config (entrypoint, platform,
/// labels), then the whole root filesystem as one layer.
fn pack(rootfs: &Path, layout: &Path, reference: &str, epoch: &str) -> Result<()> {
    let rootfs = rootfs.to_string_lossy();
    let at = format!("@{epoch}");
    sh(
        "find",
        &[&rootfs, "-exec", "touch", "-h", "-d", &at, "{}", "+"],
        &[],
    )?;
    let created = rfc3339(epoch)?;
    let layout_dir = layout.to_string_lossy();
    let image = format!("{layout_dir}:{reference}");
    let version = reference.rsplit(':').next().unwrap_or_default();
    let version_label = format!("org.opencontainers.image.version={version}");
    let entrypoint = format!("/{BINARY}");
    sh("umoci", &["init", "--layout", &layout_dir], &[])?;
    sh("umoci", &["new", "--image", &image], &[])?;
    sh(
        "umoci",
        &[
            "config",
            "--image",
            &image,
            "--no-history",
            "--created",
            &created,
            "--os",
            "linux",
            "--architecture",
            "amd64",
            "--config.entrypoint",
            &entrypoint,
            "--config.cmd",
            "--help",
            "--config.label",
            "org.opencontainers.image.title=egress-agent",
            "--config.label",
            &version_label,
        ],
        &[],
    )?;
    sh(
        "umoci",
        &[
            "insert",
            "--image",
            &image,
            "--history.created",
            &created,
            "--history.created_by",
            "cargo xtask image",
            &rootfs,
            "/",
        ],
        &[],
    )?;
    sh("umoci", &["gc", "--layout", &layout_dir], &[])
}

/// The layout as one tar (what `podman load` and skopeo's `oci-archive:` read), in a
/// fixed order with fixed owners and times.
fn archive_layout(layout: &Path, archive: &Path, epoch: &str) -> Result<()> {
    let mtime = format!("--mtime=@{epoch}");
    sh(
        "tar",
        &[
            "--sort=name",
            &mtime,
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "-C",
            &layout.to_string_lossy(),
            "-cf",
            &archive.to_string_lossy(),
            ".",
        ],
        &[],
    )
}

/// `2024-05-01T12:00:00Z` for seconds since the epoch (`date`, to stay dependency-free).
fn rfc3339(epoch: &str) -> Result<String> {
    let out = Command::new("date")
        .args(["-u", "-d", &format!("@{epoch}"), "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .context("failed to run date")?;
    if !out.status.success() {
        bail!("failed to format time {epoch} with date");
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
