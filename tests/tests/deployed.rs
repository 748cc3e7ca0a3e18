//! The capabilities the manifests grant the agent's container (base and OpenShift
//! overlay, as rendered) are those the agent uses (`doctor::host::CAPABILITIES`, which its
//! preflight checks) and CAP_SYS_RESOURCE (memlock, before Linux 5.11): no more, no fewer.
//! `cni_plugin.rs` runs the agent under them and checks what it can do; the lab test here
//! checks what it sees of the filesystem.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use egress_agent::doctor::host::CAPABILITIES;
use egress_tests::{
    cluster::{agent_bin, default_spec, wait_until},
    deployed::{self, AgentContainer, Volume, VolumeSource},
    lab::Lab,
};

/// Granted although the agent's preflight does not require it: raising RLIMIT_MEMLOCK on
/// kernels that charge maps to it (docs/operations.md, "What the DaemonSet grants").
const FOR_OLD_KERNELS: &[&str] = &["SYS_RESOURCE"];

#[test]
fn the_manifests_grant_exactly_the_capabilities_the_agent_uses() {
    let mut used: Vec<String> = CAPABILITIES
        .iter()
        .map(|(_, name, _)| name.trim_start_matches("CAP_").to_owned())
        .chain(FOR_OLD_KERNELS.iter().map(|s| (*s).to_owned()))
        .collect();
    used.sort();
    for dir in ["deploy", "deploy/openshift"] {
        let container = AgentContainer::from_kustomization(dir).unwrap();
        assert!(!container.privileged, "{dir}: the agent is not privileged");
        let mut granted = container.capabilities.clone();
        granted.sort();
        let unused: Vec<_> = granted.iter().filter(|c| !used.contains(c)).collect();
        let lacking: Vec<_> = used.iter().filter(|c| !granted.contains(c)).collect();
        assert!(
            unused.is_empty() && lacking.is_empty(),
            "{dir}: the agent's container asks for {unused:?}, which the agent never uses, \
             and lacks {lacking:?}, which it needs"
        );
    }
}

/// The runner refuses manifests that do not drop every capability first, reads the
/// container's literal environment, leaving out files under a Secret's mount, and its
/// volumes (a Secret empty, hostPaths with their type and readOnly; a type it does not
/// model refused).
#[test]
fn the_runner_reads_the_container_as_declared() {
    let yaml = r#"
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: egress-agent}
spec:
  template:
    spec:
      containers:
      - name: agent
        env:
        - {name: A, value: "1"}
        - {name: KEY, value: /etc/key/k}
        - name: NODE_NAME
          valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
        securityContext:
          capabilities: {drop: [ALL], add: [BPF, NET_ADMIN]}
        volumeMounts:
        - {name: key, mountPath: /etc/key}
        - {name: run, mountPath: /run/x}
        - {name: ovs, mountPath: /var/run/openvswitch, readOnly: true}
      volumes:
      - {name: key, secret: {secretName: k}}
      - {name: run, hostPath: {path: /run/x, type: DirectoryOrCreate}}
      - {name: ovs, hostPath: {path: /var/run/openvswitch, type: Directory}}
"#;
    let c = AgentContainer::parse(yaml).unwrap();
    assert_eq!(c.capabilities, ["BPF", "NET_ADMIN"]);
    assert_eq!(c.env, [("A".to_owned(), "1".to_owned())]);
    let host = |path: &str, create| VolumeSource::HostPath {
        path: path.into(),
        create,
    };
    let volume = |target: &str, read_only, source| Volume {
        target: target.into(),
        read_only,
        source,
    };
    assert_eq!(
        c.volumes,
        [
            volume("/etc/key", false, VolumeSource::Empty),
            volume("/run/x", false, host("/run/x", true)),
            volume(
                "/var/run/openvswitch",
                true,
                host("/var/run/openvswitch", false)
            ),
        ]
    );
    let e =
        AgentContainer::parse(&yaml.replace("type: Directory}", "type: BlockDevice}")).unwrap_err();
    assert!(e.to_string().contains("BlockDevice"), "{e}");
    let e = AgentContainer::parse(&yaml.replace("drop: [ALL], ", "")).unwrap_err();
    assert!(e.to_string().contains("capabilities.drop"), "{e}");
}

/// The agent as deployed sees the filesystem as its container would (issue 48): a root of
/// its own holding the binary (alone in its directory), the system's libraries, the
/// runtime's files, fresh /proc and sysfs (read-only /proc/sys and sysfs), a few devices,
/// an empty /tmp, the DaemonSet's volumes at their mountPaths (the host's /run only as
/// /run/egress-agent, an empty Secret at /etc/egress/liveness) and the lab's directory,
/// which stands in for the API, the Secret and the node's sockets. The host's other paths
/// (its /run with the lab's network namespaces, /opt, /var, /home) are not there; the
/// agent starts and pins its maps.
#[test]
fn the_agent_sees_only_what_its_container_would() -> Result<()> {
    ensure!(
        AgentContainer::enabled(),
        "{} is 0: this test is about the agent as deployed",
        deployed::ENV_SWITCH
    );
    ensure!(
        Path::new("/run/netns").is_dir(),
        "the host's /run holds the lab's namespaces"
    );
    let mut lab = Lab::up(default_spec()?)?;
    let bin = agent_bin()?;
    let t0 = Instant::now();
    lab.start_agent("gw1", &bin, &[])?;
    let pid = lab.agent_pid("gw1").context("no agent pid")?;
    deployed::wait_for_exec(pid, &bin)?;
    eprintln!(
        "the view built and the agent started in it {:?} after the spawn",
        t0.elapsed()
    );
    // The declared environment, but for what this process sets itself (the tests' tuning,
    // as a patch of the DaemonSet's env would): the guest's probe settings must arrive.
    let environ = std::fs::read(format!("/proc/{pid}/environ"))?;
    let environ: BTreeSet<String> = environ
        .split(|b| *b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    let container = AgentContainer::for_tests()?.context("the runner is on")?;
    for (k, declared) in &container.env {
        let want = std::env::var(k).unwrap_or_else(|_| declared.clone());
        assert!(
            environ.contains(&format!("{k}={want}")),
            "the agent's {k} is not {want:?} (declared {declared:?}): {environ:?}"
        );
    }
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let seen = |p: &Path| root.join(p.strip_prefix("/").unwrap_or(p));
    let pins = seen(&lab.bpffs_dir("gw1"));
    wait_until(Duration::from_secs(60), || pins.join("CONFIG").exists())
        .with_context(|| format!("gw1 pinned nothing in its view:\n{}", lab.agent_log("gw1")))?;
    let list = |p: &str| -> BTreeSet<String> {
        std::fs::read_dir(seen(Path::new(p)))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let set =
        |names: &[&str]| -> BTreeSet<String> { names.iter().map(|s| (*s).to_owned()).collect() };

    let program_top = bin
        .components()
        .nth(1)
        .context("the binary's path")?
        .as_os_str()
        .to_string_lossy()
        .into_owned();
    let mut top = set(&[
        "etc",
        "proc",
        "sys",
        "dev",
        "tmp",
        "run",
        "usr",
        &program_top,
    ]);
    for system in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"] {
        if Path::new("/").join(system).exists() {
            top.insert(system.to_owned());
        }
    }
    assert_eq!(list("/"), top, "the root of the agent's view");
    assert_eq!(
        list("/run"),
        set(&["egress-agent"]),
        "the host's /run is hidden"
    );
    let runtime: Vec<&str> = ["hosts", "resolv.conf", "hostname"]
        .into_iter()
        .filter(|f| Path::new("/etc").join(f).exists())
        .chain(["egress"])
        .collect();
    assert_eq!(list("/etc"), set(&runtime));
    assert!(
        seen(Path::new("/etc/egress/liveness")).is_dir() && list("/etc/egress/liveness").is_empty(),
        "the Secret's mount, empty: the lab passes its own key"
    );
    let lab_top = lab
        .dir()
        .file_name()
        .context("the lab's directory")?
        .to_string_lossy()
        .into_owned();
    // And the binary's own path, when it was built under /tmp (a clone there).
    let mut in_tmp = set(&[&lab_top]);
    if let Ok(rest) = bin.strip_prefix("/tmp")
        && let Some(first) = rest.components().next()
    {
        in_tmp.insert(first.as_os_str().to_string_lossy().into_owned());
    }
    assert_eq!(
        list("/tmp"),
        in_tmp,
        "an empty /tmp but the lab's directory (and the binary's path)"
    );
    assert_eq!(
        list(
            &bin.parent()
                .context("the binary's directory")?
                .to_string_lossy()
        ),
        set(&["egress-agent"]),
        "the binary alone, not its neighbours"
    );
    assert_eq!(
        list("/dev"),
        set(&["null", "zero", "full", "random", "urandom", "tty", "shm"])
    );
    for hidden in [
        "/opt/cni/bin",
        "/var/run/openvswitch",
        "/run/netns",
        "/home",
    ] {
        assert!(!seen(Path::new(hidden)).exists(), "{hidden} is visible");
    }
    // Read-only /proc/sys and sysfs; the declared bpffs writable (the agent pinned).
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))?;
    let options = |at: &str| -> Option<String> {
        mounts
            .lines()
            .map(|l| l.split(' ').collect::<Vec<_>>())
            .rfind(|f| f.get(4) == Some(&at))
            .and_then(|f| f.get(5).map(|o| (*o).to_owned()))
    };
    for (at, ro) in [("/proc/sys", true), ("/sys", true), ("/sys/fs/bpf", false)] {
        let o = options(at).with_context(|| format!("no mount at {at}:\n{mounts}"))?;
        assert_eq!(o.split(',').any(|f| f == "ro"), ro, "{at}: {o}");
    }
    Ok(())
}
