//! Uninstall without a binary on the node (issue 48): the uninstall DaemonSet's containers
//! (`deploy/uninstall`, as `kubectl kustomize` renders them) run through the deployed
//! runner in each node of a lab, with their capabilities, the lab's pin directory and a CNI
//! bin directory per node in place of the host's. While the agents run, cleanup refuses and
//! removes nothing; once they are stopped (SIGTERM: the datapath stays), a container
//! without NET_ADMIN refuses before removing anything, and the declared one leaves no pin,
//! no TCX link or tc filter of ours, no tunnel device, no egress IP and no CNI plugin (a
//! CNI's own file stays), as the kernel and the filesystem say; the pod's other container
//! runs with no capability and ends on SIGTERM.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    path::{Path, PathBuf},
    process::Output,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use egress_tests::{
    cluster::{self, agent_bin, holder, up_with_agents},
    deployed::{self, AgentContainer},
    hooks,
    lab::{Lab, addr::*},
};

const KUSTOMIZATION: &str = "deploy/uninstall";
const DAEMONSET: &str = "egress-uninstall";

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Every program of ours on the ingress of `node`'s devices, TCX or tc, as the kernel
/// lists them: `device: program` lines.
fn ours_attached(lab: &Lab, node: &str) -> Result<Vec<String>> {
    let names = cluster::interface_names(lab, node)?;
    lab.ns(node)?.run_in(move || {
        Ok(names
            .iter()
            .flat_map(|n| {
                hooks::ingress(n).into_iter().filter_map(move |p| {
                    ["from_pod", "from_tunnel", "from_underlay", "from_secondary"]
                        .iter()
                        .find(|prog| p.is(prog))
                        .map(|prog| format!("{n}: {prog}"))
                })
            })
            .collect())
    })
}

/// The host's CNI bin directory of `node`, as install-cni leaves it: the plugin and its
/// bundle (from the build's `egress-cni`), beside a CNI's own plugin.
fn cni_bin_dir(lab: &Lab, node: &str) -> Result<PathBuf> {
    let dir = lab.dir().join(format!("{node}-opt-cni-bin"));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("calico"), "a CNI's own plugin")?;
    let bundle = lab.dir().join("egress-cni-bundle");
    std::fs::create_dir_all(&bundle)?;
    std::fs::copy(
        agent_bin()?.with_file_name("egress-cni"),
        bundle.join("egress-cni"),
    )?;
    let out = std::process::Command::new(agent_bin()?)
        .arg("install-cni")
        .arg("--dir")
        .arg(&dir)
        .arg("--bundle")
        .arg(&bundle)
        .output()?;
    ensure!(out.status.success(), "install-cni: {}", text(&out));
    Ok(dir)
}

/// The uninstall's init container `cleanup`, run in `node`'s namespace as the runtime
/// would run it, with the lab's paths for the node's.
/// The files of `node`'s pin directory in the agents' `/run/egress-agent` (its lock, its
/// policies' last accepted versions).
fn run_files(lab: &Lab, node: &str) -> Result<Vec<String>> {
    let flat: Vec<String> = lab
        .bpffs_dir(node)
        .components()
        .skip(1)
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let prefix = format!("{}.", flat.join("-"));
    let mut files: Vec<String> = std::fs::read_dir("/run/egress-agent")?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .filter(|n| n.as_ref().map_or(true, |n: &String| n.starts_with(&prefix)))
        .collect::<Result<_>>()?;
    files.sort();
    Ok(files)
}

fn run_cleanup(lab: &Lab, node: &str, container: &AgentContainer, cni: &Path) -> Result<Output> {
    let pins = lab.bpffs_dir(node);
    let args = container.args_with(&[
        ("--bpffs-dir", &pins.to_string_lossy()),
        ("--cni-bin-dir", &cni.to_string_lossy()),
    ])?;
    let mut cmd = container.command(lab.ns(node)?, &agent_bin()?, &[lab.dir()])?;
    cmd.args(&args);
    Ok(cmd.output()?)
}

#[test]
fn the_uninstall_daemonset_removes_the_datapath_and_plugin_from_each_node() -> Result<()> {
    ensure!(
        AgentContainer::enabled(),
        "{} is 0: this test runs the uninstall as deployed",
        deployed::ENV_SWITCH
    );
    let cleanup =
        AgentContainer::from_kustomization_container(KUSTOMIZATION, DAEMONSET, "cleanup")?;
    let done = AgentContainer::from_kustomization_container(KUSTOMIZATION, DAEMONSET, "done")?;
    ensure!(
        cleanup.args.first().map(String::as_str) == Some("cleanup"),
        "{cleanup:?}"
    );
    let mut lab = up_with_agents(cluster::default_spec()?)?;
    let (gw, _) = holder(&lab, EGRESS_IP_A).context("no holder of A")?;
    let nodes: Vec<String> = lab.nodes().iter().map(|n| n.name.to_owned()).collect();
    let mut cni_dirs = BTreeMap::new();
    for node in &nodes {
        cni_dirs.insert(node.clone(), cni_bin_dir(&lab, node)?);
    }
    for node in &nodes {
        ensure!(
            !ours_attached(&lab, node)?.is_empty(),
            "{node}: nothing attached before the uninstall"
        );
    }

    // 1. Applied while an agent runs: refused, naming it; nothing goes.
    let out = run_cleanup(&lab, &gw, &cleanup, &cni_dirs[&gw])?;
    let said = text(&out);
    ensure!(!out.status.success(), "cleanup must refuse: {said}");
    ensure!(said.contains("an agent (pid "), "{said}");
    ensure!(lab.bpffs_dir(&gw).join("CONFIG").exists(), "the pins stay");
    ensure!(
        cni_dirs[&gw].join("egress-cni").exists(),
        "the plugin stays"
    );

    // 2. The agents' DaemonSet deleted: each stops with SIGTERM, the datapath stays.
    lab.stop_agents();
    let before = ours_attached(&lab, &gw)?;
    let kept = run_files(&lab, &gw)?;
    ensure!(
        kept.iter().any(|f| f.ends_with(".accepted.json")),
        "{gw}: the policies' last accepted versions are kept: {kept:?}"
    );

    // 3. A container without NET_ADMIN would stop halfway: it refuses before anything.
    let mut lacking = cleanup.clone();
    lacking.capabilities.retain(|c| c != "NET_ADMIN");
    let out = run_cleanup(&lab, &gw, &lacking, &cni_dirs[&gw])?;
    let said = text(&out);
    ensure!(
        !out.status.success() && said.contains("lacks CAP_NET_ADMIN"),
        "{said}"
    );
    ensure!(
        ours_attached(&lab, &gw)? == before,
        "{gw}: something was detached"
    );
    ensure!(lab.bpffs_dir(&gw).join("CONFIG").exists(), "the pins stay");

    // 4. The uninstall as declared, on every node.
    for (node, cni) in &cni_dirs {
        let t0 = Instant::now();
        let out = run_cleanup(&lab, node, &cleanup, cni)?;
        let took = t0.elapsed();
        let said = text(&out);
        eprintln!("cleanup on {node} ({took:?}):\n{said}");
        ensure!(out.status.success(), "{node}: {said}");
        ensure!(
            said.contains("removed tunnel device egress0")
                && said.contains("removed CNI plugin")
                && said.contains(&format!(
                    "removed pin directory {}",
                    lab.bpffs_dir(node).display()
                )),
            "{node}: {said}"
        );
        // What the kernel and the filesystem say.
        ensure!(!lab.bpffs_dir(node).exists(), "{node}: pins left");
        let left = run_files(&lab, node)?;
        ensure!(left.is_empty(), "{node}: /run/egress-agent holds {left:?}");
        let attached = ours_attached(&lab, node)?;
        ensure!(attached.is_empty(), "{node}: still attached: {attached:?}");
        let links = text(&lab.exec(node, "ip", &["-d", "link", "show"])?);
        ensure!(
            !links.contains("egress0"),
            "{node}: the tunnel device is left:\n{links}"
        );
        let addrs = text(&lab.exec(node, "ip", &["addr", "show"])?);
        for ip in [IpAddr::V4(EGRESS_IP_A), IpAddr::V4(EGRESS_IP_B)] {
            ensure!(
                !addrs.contains(&format!(" {ip}/")),
                "{node}: egress IP {ip} left:\n{addrs}"
            );
        }
        let mut left: Vec<String> = std::fs::read_dir(cni)?
            .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_>>()?;
        left.sort();
        ensure!(
            left == ["calico"],
            "{node}: the CNI bin directory holds {left:?}"
        );
    }
    let holder_said = text(&run_cleanup(&lab, &gw, &cleanup, &cni_dirs[&gw])?);
    ensure!(holder_said.contains("nothing to remove"), "{holder_said}");

    // 5. The container that stays: no capability at all, and it ends on SIGTERM.
    let mut cmd = done.command(lab.ns(&nodes[0])?, &agent_bin()?, &[])?;
    cmd.args(&done.args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = cmd.spawn()?;
    let pid = child.id();
    deployed::wait_for_exec(pid, &agent_bin()?)?;
    // The capabilities are set at exec; the first line says it waits.
    std::thread::sleep(Duration::from_millis(200));
    let caps = deployed::effective_caps(pid)?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    eprintln!(
        "pause: {}",
        status
            .lines()
            .find(|l| l.starts_with("VmRSS"))
            .unwrap_or("")
    );
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let out = child.wait_with_output()?;
    ensure!(caps.is_empty(), "the pause container holds {caps:?}");
    ensure!(out.status.success(), "pause on SIGTERM: {}", text(&out));
    Ok(())
}
