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
