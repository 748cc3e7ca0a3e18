//! Builds `egress-ebpf` for the BPF target with aya-build and leaves the object in
//! `OUT_DIR`, where `src/ebpf.rs` embeds it.
//!
//! The toolchain is Debian's `rustc-web` (linked into rustup as `debian`, with its
//! `rust-src`), because rustup's toolchains here have no `rust-src` for `-Z build-std`.
//! `cargo xtask bootstrap` installs and links it; `EGRESS_EBPF_TOOLCHAIN` overrides.

use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

/// The commit being built (`EGRESS_COMMIT`, in `egress-agent --version`): from the
/// environment (an image built without `.git`), else git, else "unknown"; "-dirty" when
/// the work tree has changes.
fn commit() -> String {
    if let Ok(c) = std::env::var("EGRESS_COMMIT") {
        return c;
    }
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
        println!("cargo:rerun-if-changed={dir}/refs");
        println!("cargo:rerun-if-changed={dir}/packed-refs");
    }
    let Some(rev) = git(&["rev-parse", "--short=12", "HEAD"]) else {
        return "unknown".into();
    };
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    if dirty { format!("{rev}-dirty") } else { rev }
}

/// aya-build builds the object in `OUT_DIR/aya-build/target/egress-ebpf`, and `OUT_DIR`
/// differs between `cargo clippy` and `cargo build` (clippy's wrapper is in the build
/// script's fingerprint): `cargo xtask test` built the object (core and all) once for
/// each, about a minute apiece. That directory is made a link to one per profile
/// (`target/<profile>/ebpf-target`), so the second build finds the first's. A directory
/// already there (an earlier build's) is left as it is.
fn share_ebpf_target() -> anyhow::Result<()> {
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    // OUT_DIR is target/<profile>/build/egress-agent-<hash>/out.
    let Some(profile_dir) = out.ancestors().nth(3) else {
        return Ok(());
    };
    let shared = profile_dir.join("ebpf-target");
    let link = out.join("aya-build").join("target").join("egress-ebpf");
    if link.symlink_metadata().is_ok() {
        return Ok(());
    }
    std::fs::create_dir_all(&shared)
        .with_context(|| format!("failed to create {}", shared.display()))?;
    let parent = link.parent().context("no parent")?;
    std::fs::create_dir_all(parent)
        .with_context(|| format!("failed to create {}", parent.display()))?;
    std::os::unix::fs::symlink(&shared, &link)
        .with_context(|| format!("failed to link {} to {}", link.display(), shared.display()))
}

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=EGRESS_COMMIT");
    println!("cargo:rustc-env=EGRESS_COMMIT={}", commit());
    println!("cargo:rerun-if-env-changed=EGRESS_EBPF_TOOLCHAIN");
    let toolchain = std::env::var("EGRESS_EBPF_TOOLCHAIN").unwrap_or_else(|_| "debian".into());
    // Debian's compiler is a stable release: -Z build-std needs RUSTC_BOOTSTRAP, and
    // aya-build only passes -Z build-std when it sees RUSTC_BOOTSTRAP=1. It also lets
    // egress-ebpf use `asm!` for BPF (`asm_experimental_arch`: `parse::word`).
    // SAFETY: build scripts are single-threaded.
    unsafe { std::env::set_var("RUSTC_BOOTSTRAP", "1") };
    let metadata = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or_else(|| anyhow!("egress-agent has no parent directory"))?
        .join("egress-ebpf");
    share_ebpf_target()?;
    let root_dir = metadata
        .to_str()
        .ok_or_else(|| anyhow!("non-UTF-8 path {}", metadata.display()))?;
    aya_build::build_ebpf(
        [Package {
            name: "egress-ebpf",
            root_dir,
            ..Default::default()
        }],
        Toolchain::Custom(&toolchain),
    )
    .context(
        "failed to build the eBPF object (egress-ebpf): run `cargo xtask bootstrap` to \
         install Debian's rustc-web, rust-web-src and bpf-linker",
    )
}
