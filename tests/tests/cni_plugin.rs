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
