//! `egress-cni` as a container runtime calls it, without an agent: `VERSION`, an `ADD`
//! that is not chained, an `ADD` whose agent does not answer (fail closed, naming the
//! socket), and `DEL`. `unknown_pods.rs` runs an `ADD` against a lab's agent.

use std::{
    io::Write as _,
    process::{Command, Output, Stdio},
};

use egress_tests::cluster::agent_bin;

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
