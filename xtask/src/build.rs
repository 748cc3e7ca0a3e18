//! Finding the eBPF object that `egress-agent/build.rs` produced.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

/// Run the agent's build script (through `cargo check`) and return the object's path.
pub fn ebpf_object() -> Result<PathBuf> {
    let out = Command::new(env!("CARGO"))
        .args([
            "check",
            "--package",
            "egress-agent",
            "--message-format=json",
        ])
        .stderr(Stdio::inherit())
        .output()
        .context("failed to run cargo check -p egress-agent")?;
    if !out.status.success() {
        bail!("failed to build the eBPF object: cargo check -p egress-agent failed");
    }
    // The build-script-executed message of egress-agent names its OUT_DIR.
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if line.contains("\"reason\":\"build-script-executed\"")
            && line.contains("egress-agent")
            && let Some(dir) = json_str(line, "out_dir")
        {
            let obj = PathBuf::from(dir).join("egress");
            if obj.exists() {
                return Ok(obj);
            }
        }
    }
    bail!("failed to find the eBPF object: no build-script output of egress-agent")
}

/// The string value of `"key":"..."` in one line of cargo's JSON (no escapes in paths).
pub(crate) fn json_str<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let pat = format!("\"{key}\":\"");
    let start = line.find(&pat)? + pat.len();
    let len = line[start..].find('"')?;
    Some(&line[start..start + len])
}
