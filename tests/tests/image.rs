//! The agent's OCI image, as `cargo xtask image` leaves it (`cargo xtask test` builds it
//! before the tests): podman loads it and runs `egress-agent --version` in it, and its file
//! tree is the binary and the libraries it loads, nothing else, enough to run the binary
//! chrooted into it. Needs root (podman's storage, chroot), podman, runc and umoci
//! (`cargo xtask bootstrap`).

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
};

/// What `cargo xtask image` names the image (xtask/src/image.rs).
fn reference() -> String {
    format!("localhost/egress-agent:{}", env!("CARGO_PKG_VERSION"))
}

const ENTRYPOINT: &str = "/usr/local/bin/egress-agent";

/// `$EGRESS_IMAGE_ARCHIVE`, else `<target>/image/egress-agent.oci.tar` (a test binary
/// lives in `<target>/<profile>/deps`).
fn archive() -> PathBuf {
    if let Some(p) = std::env::var_os("EGRESS_IMAGE_ARCHIVE") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current executable");
    let target = exe.ancestors().nth(3).expect("a target directory");
    let archive = target.join("image/egress-agent.oci.tar");
    assert!(
        archive.is_file(),
        "{} is missing: run `cargo xtask image` (`cargo xtask test` does) or set \
         EGRESS_IMAGE_ARCHIVE",
        archive.display()
    );
    archive
}

/// Run a command; its stdout, or a panic naming it with its stderr.
fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("failed to run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Removes the loaded image from podman's storage.
struct Loaded(String);

impl Drop for Loaded {
    fn drop(&mut self) {
        let _ = Command::new("podman")
            .args(["rmi", "--force", &self.0])
            .output();
    }
}

#[test]
fn podman_loads_the_image_and_runs_the_agent() {
    let archive = archive();
    let loaded = run(Command::new("podman")
        .arg("load")
        .arg("--input")
        .arg(&archive));
    let _image = Loaded(reference());
    assert!(
        loaded.contains(&format!("Loaded image: {}", reference())),
        "podman load named it otherwise: {loaded}"
    );
    // runc, not Debian's default crun: crun refuses a hybrid cgroup hierarchy (v1
    // controllers beside an empty v2 mount), which these machines have. The rlimits: podman
    // raises RLIMIT_NOFILE and RLIMIT_NPROC to its defaults, which takes CAP_SYS_RESOURCE
    // that root lacks in this sandbox; lowering them takes nothing.
    let version = run(Command::new("podman").args([
        "--runtime",
        "runc",
        "run",
        "--rm",
        "--network=none",
        "--ulimit",
        "nofile=1024:4096",
        "--ulimit",
        "nproc=1024:2048",
        &reference(),
        "--version",
    ]));
    assert!(
        version.trim().starts_with(&format!(
            "egress-agent {} (commit ",
            env!("CARGO_PKG_VERSION")
        )),
        "{version}"
    );
}

#[test]
fn the_file_tree_is_the_binary_and_its_libraries() {
    let archive = archive();
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("oci");
    std::fs::create_dir(&layout).unwrap();
    run(Command::new("tar")
        .arg("-xf")
        .arg(&archive)
        .arg("-C")
        .arg(&layout));
    let bundle = dir.path().join("bundle");
    run(Command::new("umoci")
        .arg("unpack")
        .arg("--image")
        .arg(format!("{}:{}", layout.display(), reference()))
        .arg(&bundle));
    let rootfs = bundle.join("rootfs");

    // The runtime config umoci derives from the image's: the binary is the entrypoint.
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(bundle.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["process"]["args"][0], ENTRYPOINT, "{config:#}");

    // Regular files only: the binary and what the loader maps for it, and the CNI
    // plugin's bundle (the plugin beside its own libraries and loader).
    let binary = rootfs.join(ENTRYPOINT.trim_start_matches('/'));
    let mut expected: BTreeSet<PathBuf> = BTreeSet::from([PathBuf::from(ENTRYPOINT)]);
    expected.extend(loaded_libraries(&binary));
    let cni = Path::new(CNI_BUNDLE);
    let plugin = rootfs
        .join(CNI_BUNDLE.trim_start_matches('/'))
        .join("egress-cni");
    expected.insert(cni.join("egress-cni"));
    for lib in loaded_libraries(&plugin) {
        expected.insert(cni.join(lib.file_name().unwrap()));
    }
    let mut found = BTreeSet::new();
    walk(&rootfs, &rootfs, &mut found);
    assert_eq!(found, expected, "the image's files");

    // Nothing from the host: the binary runs inside its own tree.
    let version = run(Command::new("chroot")
        .arg(&rootfs)
        .args([ENTRYPOINT, "--version"]));
    assert!(
        version.trim().starts_with(&format!(
            "egress-agent {} (commit ",
            env!("CARGO_PKG_VERSION")
        )),
        "{version}"
    );

    // The init container's job, into a directory of the image's tree; the installed
    // plugin answers VERSION with the bundle's loader.
    std::fs::create_dir_all(rootfs.join("host/opt/cni/bin")).unwrap();
    run(Command::new("chroot").arg(&rootfs).args([
        ENTRYPOINT,
        "install-cni",
        "--dir",
        "/host/opt/cni/bin",
    ]));
    let script = rootfs.join("host/opt/cni/bin/egress-cni");
    let text = std::fs::read_to_string(&script).unwrap();
    assert!(
        text.contains("/host/opt/cni/bin/egress-cni.d/ld-linux"),
        "{text}"
    );
}

/// The CNI plugin's bundle in the image.
const CNI_BUNDLE: &str = "/usr/local/lib/egress-cni";

/// Paths `ldd` lists for `binary` (the loader included, the vDSO not).
fn loaded_libraries(binary: &Path) -> Vec<PathBuf> {
    run(Command::new("ldd").arg(binary))
        .lines()
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with('/')))
        .map(PathBuf::from)
        .collect()
}

/// Every file under `dir` as an absolute path inside `root`; anything but regular files
/// and directories (a symlink, a device) fails the test.
fn walk(root: &Path, dir: &Path, found: &mut BTreeSet<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let kind = entry.file_type().unwrap();
        let path = entry.path();
        if kind.is_dir() {
            walk(root, &path, found);
        } else {
            assert!(kind.is_file(), "{} is not a regular file", path.display());
            found.insert(Path::new("/").join(path.strip_prefix(root).unwrap()));
        }
    }
}
