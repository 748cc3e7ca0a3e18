//! The container's view of the filesystem: a fresh root holding only what its container
//! would see, built in the runner's private mount namespace and entered with
//! `pivot_root` before the program starts.
//!
//! [`plan`] decides what goes into it (a list of [`Step`]s, a pure function of the
//! container, the program and the caller's stand-ins); [`script`] renders the steps as the
//! shell lines that mount them.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use super::{AgentContainer, Volume, VolumeSource};

/// Directories that hold what the program and the runner's tools (`setpriv`, `umount`)
/// load: bound read-only where they are directories, recreated where they are symbolic
/// links (a merged /usr's `/bin -> usr/bin`).
const SYSTEM: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];

/// The files a container runtime writes into every container.
const RUNTIME_FILES: &[&str] = &["/etc/hosts", "/etc/resolv.conf", "/etc/hostname"];

/// The devices a container runtime gives an unprivileged container.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// Where the new root is mounted before `pivot_root`: the first of these that exists and
/// holds nothing the view needs (hidden in the private namespace only).
const ROOT_CANDIDATES: &[&str] = &["/srv", "/media", "/mnt", "/opt", "/home"];

/// One step of building the view, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// An empty tmpfs at `target`, read-only when `ro`.
    Tmpfs { target: PathBuf, ro: bool },
    /// A fresh procfs; /proc/sys bound read-only over itself when `sys_ro`.
    Proc { sys_ro: bool },
    /// A fresh sysfs, of the program's network namespace.
    Sysfs { ro: bool },
    /// The host's `source` at `target`, recursively (a directory, or a file onto a file);
    /// created on the host first when `create`, refused when absent otherwise.
    Bind {
        source: PathBuf,
        target: PathBuf,
        ro: bool,
        create: bool,
    },
    /// A symbolic link at `link` to `to`.
    Symlink { link: PathBuf, to: PathBuf },
}

/// What `container` sees, `program` run in it, with `stand_ins` (host paths the caller
/// puts in place of what a cluster would provide: the lab's state directory, sockets and
/// key file) at their own paths.
pub fn plan(container: &AgentContainer, program: &Path, stand_ins: &[&Path]) -> Vec<Step> {
    let mut steps = Vec::new();
    let bind_ro = |source: &Path| Step::Bind {
        source: source.to_owned(),
        target: source.to_owned(),
        ro: true,
        create: false,
    };
    // The image: what the program and the runner's tools load (the program itself after
    // the empty /tmp below, which would hide one built under /tmp: a clean clone there).
    for dir in SYSTEM {
        let path = Path::new(dir);
        match std::fs::read_link(path) {
            Ok(to) => steps.push(Step::Symlink {
                link: path.to_owned(),
                to,
            }),
            Err(_) if path.is_dir() => steps.push(bind_ro(path)),
            Err(_) => {}
        }
    }
    // What the runtime adds to every container.
    steps.extend(
        RUNTIME_FILES
            .iter()
            .map(Path::new)
            .filter(|p| p.exists())
            .map(bind_ro),
    );
    let privileged = container.privileged;
    steps.push(Step::Proc {
        sys_ro: !privileged,
    });
    steps.push(Step::Sysfs { ro: !privileged });
    if privileged {
        steps.push(Step::Bind {
            source: "/dev".into(),
            target: "/dev".into(),
            ro: false,
            create: false,
        });
    } else {
        steps.push(Step::Tmpfs {
            target: "/dev".into(),
            ro: false,
        });
        for d in DEVICES {
            let dev = Path::new("/dev").join(d);
            steps.push(Step::Bind {
                source: dev.clone(),
                target: dev,
                ro: false,
                create: false,
            });
        }
        steps.push(Step::Tmpfs {
            target: "/dev/shm".into(),
            ro: false,
        });
    }
    steps.push(Step::Tmpfs {
        target: "/tmp".into(),
        ro: false,
    });
    steps.push(bind_ro(program));
    // The declared volumes at their mountPaths, shallowest first (a mount inside another
    // lands on it, not under it).
    let mut volumes: Vec<&Volume> = container.volumes.iter().collect();
    volumes.sort_by_key(|v| v.target.components().count());
    for v in volumes {
        steps.push(match &v.source {
            VolumeSource::HostPath { path, create } => Step::Bind {
                source: path.clone(),
                target: v.target.clone(),
                ro: v.read_only,
                create: *create,
            },
            VolumeSource::Empty => Step::Tmpfs {
                target: v.target.clone(),
                ro: v.read_only,
            },
        });
    }
    for s in stand_ins {
        steps.push(Step::Bind {
            source: s.to_path_buf(),
            target: s.to_path_buf(),
            ro: false,
            create: false,
        });
    }
    steps
}

/// Where to mount the new root: a candidate that exists and holds no host path the steps
/// bind (mounting over it would hide that path before it is bound). A bound ancestor (the
/// host's `/` of `oc debug`) shows the new root there instead of the host's directory.
pub fn root_for(steps: &[Step]) -> Result<PathBuf> {
    let sources: Vec<&Path> = steps
        .iter()
        .filter_map(|s| match s {
            Step::Bind { source, .. } => Some(source.as_path()),
            _ => None,
        })
        .collect();
    for c in ROOT_CANDIDATES {
        let c = Path::new(c);
        if c.is_dir() && !sources.iter().any(|s| s.starts_with(c)) {
            return Ok(c.to_owned());
        }
    }
    bail!(
        "failed to find a directory to build the container's root on: none of \
         {ROOT_CANDIDATES:?} exists outside the paths it binds"
    )
}

/// `s` quoted for sh.
fn quote(s: &Path) -> String {
    format!("'{}'", s.to_string_lossy().replace('\'', r"'\''"))
}

/// The shell lines that build the view of `steps` on a tmpfs at `root`, enter it with
/// `pivot_root` and leave the old root. A failed step exits 97 naming what it did.
pub fn script(root: &Path, steps: &[Step]) -> String {
    let r = |p: &Path| quote(&root.join(p.strip_prefix("/").unwrap_or(p)));
    let mut s = String::from(
        "set -e\n\
         step() { what=$1; shift; \"$@\" || { echo \"deployed runner: failed to $what\" >&2; exit 97; }; }\n",
    );
    // A directory, or an empty file when `source` (a host path) is a file, at `target`.
    s.push_str(
        "mountpoint_for() { if [ -d \"$1\" ]; then [ -d \"$2\" ] || mkdir -p \"$2\"; \
         else mkdir -p \"$(dirname \"$2\")\"; [ -e \"$2\" ] || : > \"$2\"; fi; }\n",
    );
    s.push_str(&format!(
        "step 'mount the root tmpfs' mount -n -t tmpfs -o mode=755,size=4m egress-root {}\n",
        quote(root)
    ));
    for step in steps {
        match step {
            Step::Tmpfs { target, ro } => {
                let t = r(target);
                let opts = match (*ro, target == Path::new("/tmp")) {
                    (true, _) => "ro,mode=755",
                    (false, true) => "mode=1777",
                    (false, false) => "mode=755",
                };
                s.push_str(&format!(
                    "mkdir -p {t}\nstep 'mount a tmpfs at {p}' mount -n -t tmpfs -o {opts},size=64m tmpfs {t}\n",
                    p = target.display()
                ));
            }
            Step::Proc { sys_ro } => {
                let t = r(Path::new("/proc"));
                s.push_str(&format!(
                    "mkdir -p {t}\nstep 'mount /proc' mount -n -t proc proc {t}\n"
                ));
                if *sys_ro {
                    let sys = r(Path::new("/proc/sys"));
                    s.push_str(&format!(
                        "step 'bind /proc/sys' mount -n --bind {sys} {sys}\n\
                         step 'make /proc/sys read-only' mount -n -o remount,bind,ro {sys}\n"
                    ));
                }
            }
            Step::Sysfs { ro } => {
                let t = r(Path::new("/sys"));
                let opts = if *ro { "ro" } else { "rw" };
                s.push_str(&format!(
                    "mkdir -p {t}\nstep 'mount /sys' mount -n -t sysfs -o {opts},nosuid,nodev,noexec sysfs {t}\n"
                ));
            }
            Step::Bind {
                source,
                target,
                ro,
                create,
            } => {
                let (src, t) = (quote(source), r(target));
                let p = source.display();
                if *create {
                    s.push_str(&format!("step 'create host path {p}' mkdir -p {src}\n"));
                } else {
                    s.push_str(&format!(
                        "[ -e {src} ] || {{ echo 'deployed runner: host path {p} does not exist \
                         (a hostPath of that type keeps the pod from starting)' >&2; exit 97; }}\n"
                    ));
                }
                s.push_str(&format!(
                    "mountpoint_for {src} {t}\nstep 'bind {p} at {}' mount -n --rbind {src} {t}\n",
                    target.display()
                ));
                if *ro {
                    s.push_str(&format!(
                        "step 'make {} read-only' mount -n -o remount,bind,ro {t}\n",
                        target.display()
                    ));
                }
            }
            Step::Symlink { link, to } => {
                s.push_str(&format!("ln -s {} {}\n", quote(to), r(link)));
            }
        }
    }
    s.push_str(&format!(
        "cd {}\nmkdir .oldroot\nstep 'pivot_root' pivot_root . .oldroot\ncd /\n\
         step 'leave the old root' umount -n -l /.oldroot\nrmdir /.oldroot\n",
        quote(root)
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(privileged: bool, volumes: Vec<Volume>) -> AgentContainer {
        AgentContainer {
            capabilities: Vec::new(),
            privileged,
            env: Vec::new(),
            args: Vec::new(),
            volumes,
        }
    }

    /// An unprivileged container: read-only /proc/sys and sysfs, a few devices, its
    /// volumes shallowest first (a Secret as an empty read-only tmpfs), then the stand-ins;
    /// a privileged one: the host's /dev, writable /proc/sys and sysfs.
    #[test]
    fn the_plan_holds_the_image_the_runtime_the_volumes_and_the_stand_ins() {
        let volumes = vec![
            Volume {
                target: "/run/egress-agent".into(),
                read_only: false,
                source: VolumeSource::HostPath {
                    path: "/run/egress-agent".into(),
                    create: true,
                },
            },
            Volume {
                target: "/etc/egress/liveness".into(),
                read_only: true,
                source: VolumeSource::Empty,
            },
            Volume {
                target: "/sys/fs/bpf".into(),
                read_only: false,
                source: VolumeSource::HostPath {
                    path: "/sys/fs/bpf".into(),
                    create: false,
                },
            },
        ];
        // Built in a clone under /tmp, as CI's may be: bound after the empty /tmp.
        let program = Path::new("/tmp/clone/target/debug/egress-agent");
        let lab = Path::new("/tmp/egress-lab-x");
        let steps = plan(&container(false, volumes), program, &[lab]);
        let at = |want: &Step| {
            steps
                .iter()
                .position(|s| s == want)
                .unwrap_or_else(|| panic!("no {want:?} in {steps:#?}"))
        };
        let bind = |source: &str, target: &str, ro: bool, create: bool| Step::Bind {
            source: source.into(),
            target: target.into(),
            ro,
            create,
        };
        let tmp = at(&Step::Tmpfs {
            target: "/tmp".into(),
            ro: false,
        });
        let binary = "/tmp/clone/target/debug/egress-agent";
        let image = at(&bind(binary, binary, true, false));
        assert!(tmp < image, "the program after the empty /tmp: {steps:#?}");
        at(&Step::Proc { sys_ro: true });
        at(&Step::Sysfs { ro: true });
        at(&bind("/dev/urandom", "/dev/urandom", false, false));
        let bpf = at(&bind("/sys/fs/bpf", "/sys/fs/bpf", false, false));
        let run = at(&bind("/run/egress-agent", "/run/egress-agent", false, true));
        let secret = at(&Step::Tmpfs {
            target: "/etc/egress/liveness".into(),
            ro: true,
        });
        assert!(run < bpf && run < secret, "shallowest first: {steps:#?}");
        assert_eq!(
            steps.last(),
            Some(&bind(
                "/tmp/egress-lab-x",
                "/tmp/egress-lab-x",
                false,
                false
            ))
        );

        let steps = plan(&container(true, Vec::new()), program, &[]);
        assert!(steps.contains(&Step::Proc { sys_ro: false }));
        assert!(steps.contains(&Step::Sysfs { ro: false }));
        assert!(steps.contains(&bind("/dev", "/dev", false, false)));
    }

    /// The root goes where no bound host path lies; the script mounts it, builds the view
    /// under it and pivots into it.
    #[test]
    fn the_root_avoids_bound_paths_and_the_script_pivots_into_it() {
        let bind = |p: &str| Step::Bind {
            source: p.into(),
            target: p.into(),
            ro: false,
            create: false,
        };
        let root = root_for(&[bind("/usr")]).unwrap();
        let free = ROOT_CANDIDATES
            .iter()
            .map(Path::new)
            .find(|c| c.is_dir())
            .unwrap();
        assert_eq!(root, free);
        let taken = root_for(&[bind(&format!("{}/x", free.display()))]);
        assert!(taken.is_err() || taken.is_ok_and(|t| t != free));

        let s = script(
            Path::new("/srv"),
            &[
                bind("/tmp/lab"),
                Step::Tmpfs {
                    target: "/etc/egress/liveness".into(),
                    ro: true,
                },
            ],
        );
        assert!(s.starts_with("set -e\n"), "{s}");
        assert!(
            s.contains("mount -n -t tmpfs -o mode=755,size=4m egress-root '/srv'"),
            "{s}"
        );
        assert!(
            s.contains("mount -n --rbind '/tmp/lab' '/srv/tmp/lab'"),
            "{s}"
        );
        assert!(
            s.contains(
                "mount -n -t tmpfs -o ro,mode=755,size=64m tmpfs '/srv/etc/egress/liveness'"
            ),
            "{s}"
        );
        assert!(
            s.ends_with("umount -n -l /.oldroot\nrmdir /.oldroot\n"),
            "{s}"
        );
    }
}
