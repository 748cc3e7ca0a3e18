//! `egress-cni` as a container runtime calls it, without an agent: `VERSION`, an `ADD`
//! that is not chained, an `ADD` whose agent does not answer (fail closed, naming the
//! socket), and `DEL`; then against a lab's agent run as the DaemonSet runs it (its
//! capabilities, a read-only /proc/sys: `egress_tests::deployed`): `ADD`, `CHECK`, `DEL`,
//! the agent down and back. `unknown_pods.rs` runs an `ADD` in its leak test.

use std::{
    io::Write as _,
    process::{Command, Output, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use egress_tests::{
    cluster::{agent_bin, default_spec, wait_until},
    deployed::{self, AgentContainer},
    hooks,
    lab::{Lab, PodSpec},
};

fn plugin(command: &str, stdin: &str) -> Output {
    let bin = agent_bin().unwrap().with_file_name("egress-cni");
    let mut child = Command::new(&bin)
        .env("CNI_COMMAND", command)
        .env("CNI_NETNS", "/run/netns/none")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_CONTAINERID", "test")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("failed to run {}: {e}", bin.display()));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn version_add_and_del_answer_as_the_cni_spec_says() {
    let v = plugin("VERSION", "");
    assert!(v.status.success());
    let versions = json(&v)["supportedVersions"].clone();
    assert!(
        versions.as_array().unwrap().iter().any(|x| x == "1.0.0"),
        "{versions}"
    );

    let unchained = plugin(
        "ADD",
        r#"{"cniVersion": "1.0.0", "name": "net", "type": "egress-cni"}"#,
    );
    assert!(!unchained.status.success());
    let e = json(&unchained);
    assert_eq!(e["code"], 7);
    assert!(e["msg"].as_str().unwrap().contains("chained"), "{e}");

    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("cni.sock");
    let config = serde_json::json!({
        "cniVersion": "1.0.0", "name": "net", "type": "egress-cni",
        "agentSocket": socket, "timeoutMs": 300,
        "prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "cali1"}]},
    })
    .to_string();
    let no_agent = plugin("ADD", &config);
    assert!(!no_agent.status.success(), "fails closed without an agent");
    let e = json(&no_agent);
    assert_eq!(e["code"], 11);
    assert!(
        e["details"]
            .as_str()
            .unwrap()
            .contains(&socket.display().to_string()),
        "{e}"
    );
    assert!(plugin("DEL", &config).status.success());
}

/// `egress-agent install-cni` as the DaemonSet's init container runs it: a bundle laid
/// out as the image holds it (the plugin, its libraries and loader, from `ldd`), installed
/// into an empty CNI bin directory, then installed again over itself; the installed
/// script answers `VERSION` with the bundle's own loader.
#[test]
fn install_cni_puts_a_plugin_that_runs_with_its_own_libraries() {
    let plugin_bin = agent_bin().unwrap().with_file_name("egress-cni");
    let bundle = tempfile::tempdir().unwrap();
    std::fs::copy(&plugin_bin, bundle.path().join("egress-cni")).unwrap();
    let ldd = Command::new("ldd").arg(&plugin_bin).output().unwrap();
    for lib in String::from_utf8_lossy(&ldd.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
    {
        let name = std::path::Path::new(lib).file_name().unwrap();
        std::fs::copy(lib, bundle.path().join(name)).unwrap();
    }
    let bin_dir = tempfile::tempdir().unwrap();
    for round in 0..2 {
        let out = Command::new(agent_bin().unwrap())
            .arg("install-cni")
            .arg("--dir")
            .arg(bin_dir.path())
            .arg("--bundle")
            .arg(bundle.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "round {round}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let script = bin_dir.path().join("egress-cni");
    let text = std::fs::read_to_string(&script).unwrap();
    assert!(
        text.contains("ld-linux") && text.contains("--library-path"),
        "{text}"
    );
    let names: Vec<String> = std::fs::read_dir(bin_dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "only the script and the bundle: {names:?}");
    let v = Command::new(&script)
        .env("CNI_COMMAND", "VERSION")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stderr));
    assert!(json(&v)["supportedVersions"].to_string().contains("1.0.0"));
}

/// Whether `from_pod` is on the ingress of `dev` in `node`'s namespace, as the kernel says.
fn from_pod_on(lab: &Lab, node: &str, dev: &str) -> Result<bool> {
    let dev = dev.to_owned();
    lab.ns(node)?
        .run_in(move || Ok(hooks::ingress(&dev).iter().any(|p| p.is("from_pod"))))
}

/// Until `node`'s agent accepts connections on its CNI socket.
fn wait_for_socket(lab: &Lab, node: &str) -> Result<()> {
    let socket = lab.cni_socket(node);
    wait_until(Duration::from_secs(30), || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    })
    .with_context(|| format!("no agent on {}:\n{}", socket.display(), lab.agent_log(node)))?;
    Ok(())
}

/// The issue-48 case: the agent runs with exactly the DaemonSet's capabilities (less
/// CAP_SYS_RESOURCE where the sandbox lacks it: said on stderr) and a read-only /proc/sys,
/// and sees the filesystem its container would, so it can neither open nor enter a pod's
/// network namespace; the plugin, run with the runtime's
/// privileges, finds the host device and names it. ADD puts from_pod on the device (the
/// kernel says), CHECK says so, DEL succeeds; a request without the device (a plugin
/// older than the field) is refused with the reason; with the agent down an ADD fails
/// closed naming the socket, and succeeds once it is back.
#[test]
fn add_check_and_del_work_with_the_agent_under_the_daemonsets_capabilities() -> Result<()> {
    let container = AgentContainer::from_manifests()?;
    ensure!(
        !container.privileged && !container.capabilities.iter().any(|c| c == "SYS_ADMIN"),
        "the test is about an agent without CAP_SYS_ADMIN: {container:?}"
    );
    ensure!(
        AgentContainer::enabled(),
        "{} is 0: this test needs the agent as deployed",
        deployed::ENV_SWITCH
    );
    let mut spec = default_spec()?;
    for name in ["w1-cni1", "w1-cni2"] {
        let mut pod = PodSpec::new(name, "payments", "w1", &[("app", "api")]);
        pod.wired_later = true;
        spec.pods.push(pod);
    }
    let mut lab = Lab::up(spec)?;
    let agent = agent_bin()?;
    let plugin = agent.with_file_name("egress-cni");
    lab.start_agent("w1", &agent, &[])?;
    wait_for_socket(&lab, "w1")?;
    let pid = lab.agent_pid("w1").context("no agent pid")?;
    deployed::wait_for_exec(pid, &agent)?;
    let mut have = deployed::effective_caps(pid)?;
    let mut want = container.granted();
    have.sort();
    want.sort();
    assert_eq!(have, want, "the agent's effective capabilities");
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))?;
    assert!(
        mounts
            .lines()
            .any(|l| l.split(' ').nth(4) == Some("/proc/sys")
                && l.split(' ')
                    .nth(5)
                    .is_some_and(|o| o.split(',').any(|f| f == "ro"))),
        "/proc/sys read-only for the agent:\n{mounts}"
    );

    // ADD: the program is on the pod's host device before the plugin returns.
    let veth1 = lab.pod("w1-cni1")?.veth.clone();
    let out = lab.wire_pod_with_cni("w1-cni1", &plugin)?;
    assert!(
        out.contains("\"interfaces\""),
        "prevResult passed through: {out}"
    );
    assert!(
        from_pod_on(&lab, "w1", &veth1)?,
        "from_pod on {veth1} after ADD"
    );

    // CHECK: the agent says the program is there.
    let check = lab.cni_call("w1-cni1", &plugin, "CHECK")?;
    assert!(
        check.status.success(),
        "CHECK: {} {}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );

    // A plugin older than host_device: the agent would have to open the pod's namespace
    // (a host path its container does not mount) and enter it (which these capabilities
    // do not allow); it says why and what to do.
    let old = egress_agent::cni::ask(
        &lab.cni_socket("w1"),
        &egress_agent::cni::Request {
            netns: lab.ns("w1-cni1")?.path().to_path_buf(),
            ifname: "eth0".to_owned(),
            container_id: "old-plugin".to_owned(),
            check: false,
            host_device: None,
        },
        Duration::from_secs(5),
    )
    .map_err(anyhow::Error::msg)?;
    let e = old.error.unwrap_or_default();
    assert!(
        e.contains("failed to open network namespace") && e.contains("install-cni"),
        "{e}"
    );

    // DEL: nothing to undo; success.
    let del = lab.cni_call("w1-cni1", &plugin, "DEL")?;
    assert!(del.status.success(), "DEL: {del:?}");

    // The agent down: the ADD fails closed, naming the agent's socket.
    lab.stop_agent("w1")?;
    lab.wire_pod("w1-cni2")?;
    let veth2 = lab.pod("w1-cni2")?.veth.clone();
    let down = lab.cni_call("w1-cni2", &plugin, "ADD")?;
    assert!(!down.status.success(), "ADD without an agent must fail");
    let e = json(&down);
    assert_eq!(e["code"], 11, "{e}");
    let socket = lab.cni_socket("w1").display().to_string();
    assert!(
        e["msg"].as_str().unwrap_or_default().contains(&socket),
        "{e}"
    );
    assert!(
        !from_pod_on(&lab, "w1", &veth2)?,
        "nothing attached {veth2}"
    );

    // Back: the runtime's retry succeeds and the program is there.
    lab.start_agent("w1", &agent, &[])?;
    wait_for_socket(&lab, "w1")?;
    let back = lab.cni_call("w1-cni2", &plugin, "ADD")?;
    assert!(
        back.status.success(),
        "ADD with the agent back: {}",
        String::from_utf8_lossy(&back.stdout)
    );
    assert!(
        from_pod_on(&lab, "w1", &veth2)?,
        "from_pod on {veth2} after ADD"
    );
    Ok(())
}
