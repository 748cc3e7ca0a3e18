//! Builds `egress-ebpf` for the BPF target with aya-build and leaves the object in
//! `OUT_DIR`, where `src/ebpf.rs` embeds it.
//!
//! The toolchain is Debian's `rustc-web` (linked into rustup as `debian`, with its
//! `rust-src`), because rustup's toolchains here have no `rust-src` for `-Z build-std`.
//! `cargo xtask bootstrap` installs and links it; `EGRESS_EBPF_TOOLCHAIN` overrides.

use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
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
