//! The agent as the manifests deploy it (issue 48): its container's capabilities, its
//! filesystem (the declared volumes, read-only /proc/sys) and its declared environment,
//! read from the rendered DaemonSet
//! (`kubectl kustomize deploy`, or `deploy/base/daemonset.yaml` without kubectl), so that a
//! change to the manifests changes what every lab and test runs.
//!
//! Any container of the manifests runs the same way
//! ([`AgentContainer::from_kustomization_container`]: the uninstall's `cleanup`, say), its
//! args read as declared ([`AgentContainer::args_with`] swaps in a lab node's paths).
//!
//! [`AgentContainer::command`] wraps a program in `unshare --mount` (a private mount
//! namespace), builds there the filesystem the container would see and enters it with
//! `pivot_root` ([`view`]), then `setpriv` (the bounding, inheritable and ambient sets
//! exactly the container's `add` list; root keeps its uid, as in the image). The program
//! sees:
//!
//! * itself, alone in its directory, read-only (the image's binary; its neighbours in the
//!   target directory are not there);
//! * the host's /usr (and /bin, /lib, ... as links or read-only binds), for the C library
//!   it loads and the runner's own tools: more than the image holds, which is the binary
//!   and its four glibc files;
//! * what a runtime adds: /etc/hosts, /etc/resolv.conf, /etc/hostname (read-only), a
//!   fresh /proc and sysfs (of the node's network namespace), both with /proc/sys and
//!   /sys read-only unless the container is privileged, a /dev of null, zero, full,
//!   random, urandom, tty and a /dev/shm (the host's /dev when privileged), an empty /tmp;
//! * the container's volumes at their mountPaths: hostPaths bound from the host
//!   (`readOnly` ones read-only; a `DirectoryOrCreate` one created as the kubelet does, a
//!   missing `Directory` one refused as the kubelet refuses the pod), Secrets, ConfigMaps
//!   and emptyDirs as empty tmpfs;
//! * the caller's stand-ins at their own paths: a lab's directory, with the state
//!   directory (for the API), its key file (for the liveness Secret) and the node's
//!   sockets, which the lab passes by flag.
//!
//! Nothing else of the host: not its /run (the lab's network namespaces under
//! /run/netns, Open vSwitch's socket: only /run/egress-agent, declared), not /opt/cni/bin
//! (the agent does not mount it; install-cni and the uninstall see it at
//! /host/opt/cni/bin), not /var, /etc, /home, /opt or the rest of /tmp.
//!
//! Not modelled: the container's PID namespace (the program sees the host's processes in
//! /proc), the kubelet's ServiceAccount token, mount propagation (`HostToContainer`: the
//! namespace is private, so host mounts made later do not appear), cgroup limits and
//! /sys/fs/cgroup, seccomp, SELinux and AppArmor.
//!
//! Capabilities this process does not hold itself cannot be granted (the sandbox that runs
//! the tests lacks CAP_SYS_RESOURCE): they are left out, and [`AgentContainer::missing`]
//! names them, printed once per process.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{Once, OnceLock},
};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::Value;

use crate::netns::Netns;

mod view;

/// Unset: labs and tests start the agent as the manifests do; `0`: as root with every
/// capability and a writable /proc/sys (the old way, to tell a regression of the runner
/// from one of the agent).
pub const ENV_SWITCH: &str = "EGRESS_TEST_AS_DEPLOYED";

/// The capabilities the kernel knows by the names the manifests use, with their numbers
/// (capability.h), for those the agent's container may ask for or a test may check.
const CAPS: &[(&str, u32)] = &[
    ("CHOWN", 0),
    ("DAC_OVERRIDE", 1),
    ("DAC_READ_SEARCH", 2),
    ("FOWNER", 3),
    ("KILL", 5),
    ("SETGID", 6),
    ("SETUID", 7),
    ("NET_BIND_SERVICE", 10),
    ("NET_BROADCAST", 11),
    ("NET_ADMIN", 12),
    ("NET_RAW", 13),
    ("IPC_LOCK", 14),
    ("SYS_MODULE", 16),
    ("SYS_CHROOT", 18),
    ("SYS_PTRACE", 19),
    ("SYS_ADMIN", 21),
    ("SYS_RESOURCE", 24),
    ("SYSLOG", 34),
    ("PERFMON", 38),
    ("BPF", 39),
];

/// The agent's container, as the rendered DaemonSet declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentContainer {
    /// `securityContext.capabilities.add`, upper case without `CAP_` (after `drop: [ALL]`,
    /// which the manifests must say: anything else is refused).
    pub capabilities: Vec<String>,
    /// `securityContext.privileged`.
    pub privileged: bool,
    /// `env` entries with a literal `value` (those from the downward API, `valueFrom`, are
    /// the lab's flags), less those naming a file under a Secret's mount, which the lab
    /// replaces with its own (`--liveness-key-file`) or leaves out.
    pub env: Vec<(String, String)>,
    /// `args`, as written (`$(VAR)` references unexpanded).
    pub args: Vec<String>,
    /// `volumeMounts`, with their volumes.
    pub volumes: Vec<Volume>,
}

/// A volume as the container mounts it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Volume {
    /// `mountPath`.
    pub target: PathBuf,
    /// `readOnly`.
    pub read_only: bool,
    pub source: VolumeSource,
}

/// What a volume holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VolumeSource {
    /// `hostPath`: the host's `path`, created when missing (`type: DirectoryOrCreate`)
    /// or else required.
    HostPath { path: PathBuf, create: bool },
    /// A Secret, ConfigMap, projected or emptyDir volume: empty here (a lab passes its own
    /// files, such as its liveness key, in their place).
    Empty,
}

impl AgentContainer {
    /// The workspace's manifests, rendered (`kubectl kustomize deploy`, else the base's
    /// DaemonSet file as it stands).
    pub fn from_manifests() -> Result<Self> {
        Self::from_kustomization("deploy")
    }

    /// The kustomization `dir` (relative to the workspace: `deploy`, `deploy/openshift`)
    /// rendered by `kubectl kustomize`; without kubectl, the base's DaemonSet file.
    pub fn from_kustomization(dir: &str) -> Result<Self> {
        Self::from_kustomization_container(dir, "egress-agent", "agent")
    }

    /// The container (or init container) `container` of the DaemonSet `daemonset` that
    /// the kustomization `dir` renders (`deploy/uninstall`, `egress-uninstall`,
    /// `cleanup`); without kubectl, from `dir/daemonset.yaml` or the base's.
    pub fn from_kustomization_container(
        dir: &str,
        daemonset: &str,
        container: &str,
    ) -> Result<Self> {
        let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        let rendered = Command::new("kubectl")
            .arg("kustomize")
            .arg(root.join(dir))
            .output();
        if let Ok(out) = rendered
            && out.status.success()
        {
            let text = String::from_utf8(out.stdout)
                .with_context(|| format!("failed to read kubectl kustomize {dir}: not UTF-8"))?;
            return Self::parse_container(&text, daemonset, container);
        }
        let mut last = None;
        for file in [
            root.join(dir).join("daemonset.yaml"),
            root.join("deploy/base/daemonset.yaml"),
        ] {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("failed to read {}", file.display()));
            match text.and_then(|t| Self::parse_container(&t, daemonset, container)) {
                Ok(c) => return Ok(c),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("failed to read the manifests of {dir}")))
    }

    /// The container `agent` of the DaemonSet `egress-agent` in `yaml` (one or more
    /// documents).
    pub fn parse(yaml: &str) -> Result<Self> {
        Self::parse_container(yaml, "egress-agent", "agent")
    }

    /// The container or init container `name` of the DaemonSet `daemonset` in `yaml`.
    pub fn parse_container(yaml: &str, daemonset: &str, name: &str) -> Result<Self> {
        let objects: Vec<Value> = yaml_documents(yaml)?;
        let ds = objects
            .iter()
            .find(|o| o["kind"] == "DaemonSet" && o["metadata"]["name"] == daemonset)
            .with_context(|| format!("failed to find DaemonSet {daemonset} in the manifests"))?;
        let pod = &ds["spec"]["template"]["spec"];
        let container = pod["containers"]
            .as_array()
            .into_iter()
            .chain(pod["initContainers"].as_array())
            .flatten()
            .find(|c| c["name"] == name)
            .with_context(|| format!("failed to find container {name} in DaemonSet {daemonset}"))?;
        let sc = &container["securityContext"];
        let names = |v: &Value| -> Vec<String> {
            v.as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(|s| s.trim_start_matches("CAP_").to_uppercase())
                .collect()
        };
        let privileged = sc["privileged"].as_bool().unwrap_or(false);
        let drop = names(&sc["capabilities"]["drop"]);
        ensure!(
            privileged || drop == ["ALL"],
            "failed to read {name}'s securityContext.capabilities.drop: {drop:?}, \
             expected [ALL] (the runtime's default set would apply otherwise)"
        );
        let capabilities = names(&sc["capabilities"]["add"]);
        for c in &capabilities {
            ensure!(
                CAPS.iter().any(|(n, _)| n == c),
                "failed to read {name}'s securityContext.capabilities.add: unknown {c}"
            );
        }
        let secret_volumes: Vec<&str> = pod["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|v| !v["secret"].is_null())
            .filter_map(|v| v["name"].as_str())
            .collect();
        let secret_mounts: Vec<String> = container["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| {
                m["name"]
                    .as_str()
                    .is_some_and(|n| secret_volumes.contains(&n))
            })
            .filter_map(|m| m["mountPath"].as_str().map(str::to_owned))
            .collect();
        let env = container["env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| Some((e["name"].as_str()?, e["value"].as_str()?)))
            .filter(|(_, v)| !secret_mounts.iter().any(|m| v.starts_with(m.as_str())))
            .map(|(n, v)| (n.to_owned(), v.to_owned()))
            .collect();
        let args = container["args"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect();
        let volumes = container["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| volume(pod, m))
            .collect::<Result<_>>()?;
        Ok(Self {
            capabilities,
            privileged,
            env,
            args,
            volumes,
        })
    }

    /// [`AgentContainer::args`] with the value of each `--flag` in `values` replaced
    /// (`--flag=value` or `--flag value`), as a lab gives each node its own paths; a flag
    /// the container does not pass is an error, so that a manifest that stops passing it
    /// fails the test that relies on it.
    pub fn args_with(&self, values: &[(&str, &str)]) -> Result<Vec<String>> {
        let mut args = self.args.clone();
        for (flag, value) in values {
            let eq = format!("{flag}=");
            if let Some(a) = args.iter_mut().find(|a| a.starts_with(&eq)) {
                *a = format!("{eq}{value}");
            } else if let Some(i) = args.iter().position(|a| a == flag)
                && i + 1 < args.len()
            {
                args[i + 1] = (*value).to_owned();
            } else {
                bail!("failed to find {flag} in the container's args {args:?}");
            }
        }
        Ok(args)
    }

    /// What `oc debug node/<node> --image=<our image> -- egress-agent ...` runs: a
    /// privileged container (every capability, /proc/sys writable) in the host's network
    /// namespace, with the host's root at /host and no environment of ours.
    pub fn oc_debug() -> Self {
        Self {
            capabilities: Vec::new(),
            privileged: true,
            env: Vec::new(),
            args: Vec::new(),
            volumes: vec![Volume {
                target: "/host".into(),
                read_only: false,
                source: VolumeSource::HostPath {
                    path: "/".into(),
                    create: false,
                },
            }],
        }
    }

    /// Whether labs and tests run the agent this way ([`ENV_SWITCH`]).
    pub fn enabled() -> bool {
        std::env::var(ENV_SWITCH).map_or(true, |v| v != "0")
    }

    /// The manifests' container when [`AgentContainer::enabled`], else None: rendered once
    /// per process.
    pub fn for_tests() -> Result<Option<Self>> {
        static RENDERED: OnceLock<Result<Option<AgentContainer>, String>> = OnceLock::new();
        RENDERED
            .get_or_init(|| {
                if Self::enabled() {
                    Self::from_manifests()
                        .map(Some)
                        .map_err(|e| format!("{e:#}"))
                } else {
                    Ok(None)
                }
            })
            .clone()
            .map_err(anyhow::Error::msg)
    }

    /// Capabilities the container asks for that this process cannot pass on (not in its
    /// bounding set): CAP_SYS_RESOURCE in the sandbox the tests run in.
    pub fn missing(&self) -> Vec<String> {
        let bounding = own_bounding_set();
        self.capabilities
            .iter()
            .filter(|c| cap_number(c).is_none_or(|n| bounding & (1 << n) == 0))
            .cloned()
            .collect()
    }

    /// The capabilities the agent gets: the container's, less [`AgentContainer::missing`].
    pub fn granted(&self) -> Vec<String> {
        let missing = self.missing();
        self.capabilities
            .iter()
            .filter(|c| !missing.contains(c))
            .cloned()
            .collect()
    }

    /// A command that runs `program` in `ns` as this container would: arguments added to
    /// it go to `program`. It sees the filesystem as the container would (the module's
    /// doc), with `stand_ins` (what the caller puts in place of the cluster: a lab's
    /// directory with its state, sockets and key file) at their own paths. The declared
    /// environment is set, but for variables this process sets itself (they win, as a
    /// patch of the manifest's env would); the caller's own `env` calls come after and
    /// win, as flags beat environment in the agent.
    pub fn command(&self, ns: &Netns, program: &Path, stand_ins: &[&Path]) -> Result<Command> {
        let missing = self.missing();
        if !missing.is_empty() {
            static SAID: Once = Once::new();
            SAID.call_once(|| {
                eprintln!(
                    "deployed runner: the manifests grant {missing:?}, which this process \
                     does not hold (its bounding set): the agent runs without them"
                )
            });
        }
        let steps = view::plan(self, program, stand_ins);
        let mut script = view::script(&view::root_for(&steps)?, &steps);
        if !self.privileged {
            let caps: Vec<String> = self
                .granted()
                .iter()
                .map(|c| format!("+{}", c.to_lowercase()))
                .collect();
            let set = if caps.is_empty() {
                "-all".to_owned()
            } else {
                format!("-all,{}", caps.join(","))
            };
            script.push_str(&format!(
                "exec setpriv --inh-caps={set} --ambient-caps={set} --bounding-set={set} -- \"$@\"\n"
            ));
        } else {
            script.push_str("exec \"$@\"\n");
        }
        let mut cmd = ns.command("unshare")?;
        cmd.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(script)
            .arg("sh")
            .arg(program);
        for (k, v) in &self.env {
            // A variable this process has wins over the manifest's value, as an operator's
            // patch of the DaemonSet's env would: the tests' tuning (EGRESS_PROBE_MISSES,
            // EGRESS_PROBE_INTERVAL_MS in the emulated guest) reaches the agent.
            if std::env::var_os(k).is_none() {
                cmd.env(k, v);
            }
        }
        Ok(cmd)
    }
}

/// The volume of `pod` that the container's volumeMount `m` mounts.
fn volume(pod: &Value, m: &Value) -> Result<Volume> {
    let name = m["name"].as_str().unwrap_or_default();
    let target = m["mountPath"]
        .as_str()
        .with_context(|| format!("failed to read the mountPath of volumeMount {name}"))?;
    let v = pod["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == name)
        .with_context(|| format!("failed to find volume {name} of mount {target}"))?;
    let source = if let Some(path) = v["hostPath"]["path"].as_str() {
        let create = match v["hostPath"]["type"].as_str().unwrap_or("") {
            "DirectoryOrCreate" | "FileOrCreate" => true,
            "" | "Directory" | "File" | "Socket" => false,
            other => bail!("failed to read volume {name}: hostPath type {other} is not modelled"),
        };
        VolumeSource::HostPath {
            path: path.into(),
            create,
        }
    } else if ["secret", "configMap", "projected", "emptyDir"]
        .iter()
        .any(|k| !v[*k].is_null())
    {
        VolumeSource::Empty
    } else {
        bail!(
            "failed to read volume {name}: only hostPath, secret, configMap, projected and emptyDir are modelled"
        );
    };
    Ok(Volume {
        target: target.into(),
        read_only: m["readOnly"].as_bool().unwrap_or(false),
        source,
    })
}

/// Every document of `yaml` as JSON values (empty ones left out).
fn yaml_documents(yaml: &str) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
        let v: Value = serde::Deserialize::deserialize(doc)
            .context("failed to read the manifests: invalid YAML")?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

/// The number of the capability called `name` (upper case, without `CAP_`).
pub fn cap_number(name: &str) -> Option<u32> {
    CAPS.iter().find(|(n, _)| *n == name).map(|&(_, i)| i)
}

/// This process's bounding set (`CapBnd` of /proc/self/status).
fn own_bounding_set() -> u64 {
    caps_of_status(
        &std::fs::read_to_string("/proc/self/status").unwrap_or_default(),
        "CapBnd",
    )
}

/// A capability set (`CapEff`, `CapBnd`, ...) from the text of /proc/<pid>/status.
pub fn caps_of_status(status: &str, field: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0)
}

/// The effective capabilities of process `pid`, by name (those [`CAPS`] knows; others as
/// `cap<N>`).
pub fn effective_caps(pid: u32) -> Result<Vec<String>> {
    let path = PathBuf::from(format!("/proc/{pid}/status"));
    let status = std::fs::read_to_string(&path)
        .with_context(|| format!("failed to read {}", path.display()))?;
    let set = caps_of_status(&status, "CapEff");
    Ok((0..64)
        .filter(|i| set & (1u64 << i) != 0)
        .map(|i| {
            CAPS.iter()
                .find(|&&(_, n)| n == i)
                .map_or_else(|| format!("cap{i}"), |(n, _)| (*n).to_owned())
        })
        .collect())
}

/// The process that `pid` became after `unshare` and `setpriv` exec'd (the same pid: both
/// exec, never fork): waits until its command line is `program`'s.
pub fn wait_for_exec(pid: u32, program: &Path) -> Result<()> {
    let want = program.to_string_lossy().into_owned();
    for _ in 0..500 {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let argv0 = cmdline.split(|&b| b == 0).next().unwrap_or_default();
        if String::from_utf8_lossy(argv0) == want {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    bail!("failed to see process {pid} become {want}")
}
