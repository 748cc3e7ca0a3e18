//! The chained CNI plugin (`egress-cni`, CNI spec 1.0) and the agent's side of it.
//!
//! On `ADD` the plugin asks the node's agent, over a unix socket, to put `from_pod` on the
//! host side of the new pod's interface, and waits for the answer (bounded): the runtime
//! does not finish the pod's sandbox before the program is there, so with `--unknown-pods
//! drop` the pod's first packet is already judged. `prevResult` passes through unchanged.
//! `DEL` has nothing to undo (the agent detaches when the device goes); `CHECK` asks the
//! agent whether the program is on the device; `VERSION` lists the versions spoken.
//!
//! The wire between plugin and agent is one JSON line each way ([`Request`], [`Reply`]).
//! It carries no version number: fields are only ever added, optional, and unknown ones
//! are ignored, so an older plugin and a newer agent (or the reverse, during a rolling
//! update) still understand each other.
//!
//! The plugin, which the container runtime runs on the host with the runtime's
//! privileges, finds the host side of the pod's interface itself ([`find_host_device`])
//! and names it in [`Request::host_device`]: the agent then needs no namespace of the pod
//! (entering one takes CAP_SYS_ADMIN, which the DaemonSet does not grant, and the path is
//! a host path the container does not mount). A request without it, from a plugin older
//! than the field, makes the agent look it up in the pod's namespace as before, which only
//! a privileged agent can.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    os::{fd::AsRawFd as _, unix::net::UnixStream},
    path::{Path, PathBuf},
    process::ExitCode,
    time::Duration,
};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Where the agent listens by default (`run --cni-socket`).
pub const DEFAULT_SOCKET: &str = "/run/egress-agent/cni.sock";
/// How long the plugin waits for the agent by default (`timeoutMs` in its config).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// The CNI versions the plugin speaks.
pub const VERSIONS: &[&str] = &["0.4.0", "1.0.0", "1.1.0"];

/// What the plugin asks the agent.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Request {
    /// The pod's network namespace (`CNI_NETNS`).
    pub netns: PathBuf,
    /// The pod's interface in it (`CNI_IFNAME`).
    pub ifname: String,
    /// `CNI_CONTAINERID`, for the agent's log.
    pub container_id: String,
    /// `CHECK`: only say whether the program is there.
    #[serde(default)]
    pub check: bool,
    /// The host side of the pod's interface, as the plugin found it in the host's
    /// namespace (absent from plugins older than the field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_device: Option<HostDevice>,
}

/// A device in the host's network namespace: its name and ifindex, both, so that the agent
/// can tell a device renamed or replaced since the plugin looked.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct HostDevice {
    pub name: String,
    pub ifindex: u32,
}

/// What the agent answers.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Reply {
    /// The host-side device, when found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// What went wrong; none: the program is on the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The ifindex, in the caller's own namespace, of the peer of `ifname` in the network
/// namespace at `netns`: the host side of a pod's veth. Looked up on a thread of its own
/// that enters the pod's namespace (never a runtime thread).
pub fn host_side(netns: &Path, ifname: &str) -> Result<u32, String> {
    let file = std::fs::File::open(netns)
        .map_err(|e| format!("failed to open network namespace {}: {e}", netns.display()))?;
    let ifname = ifname.to_owned();
    let shown = netns.display().to_string();
    std::thread::spawn(move || {
        // SAFETY: setns(2) on this thread only, with a descriptor it keeps open.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(format!(
                "failed to enter network namespace {shown}: {}",
                std::io::Error::last_os_error()
            ));
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("failed to start a runtime: {e}"))?;
        rt.block_on(async {
            let nl = crate::iface::Netlink::new().map_err(|e| e.to_string())?;
            nl.veth_peer(&ifname)
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| {
                    format!(
                        "{ifname} in {shown} is not a veth with a peer: not a pod interface we know"
                    )
                })
        })
    })
    .join()
    .map_err(|_| "the namespace lookup panicked".to_owned())?
}

/// The name of the device with `ifindex` in the caller's network namespace.
fn ifname_of(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` holds IF_NAMESIZE bytes, as if_indextoname(3) wants.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: on success the buffer holds a NUL-terminated name.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Some(name.to_string_lossy().into_owned())
}

/// The ifindex of the device called `name` in the caller's network namespace.
fn ifindex_of(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: a NUL-terminated string, read only.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

/// The interfaces of a CNI result (`prevResult`) outside any sandbox: the host side of a
/// veth, a bridge, ... (a bridge CNI lists both, so the list alone may not settle it).
pub fn host_candidates(prev: &Value) -> Vec<String> {
    prev["interfaces"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["sandbox"].as_str().is_none_or(str::is_empty))
        .filter_map(|i| i["name"].as_str().map(str::to_owned))
        .collect()
}

/// The host side of the pod's interface `ifname` in `netns`, found by the plugin in the
/// host's namespace (the one the runtime runs it in), with the runtime's privileges:
/// the peer of the pod's veth, asked of the kernel inside the pod's namespace (on a thread
/// of its own); else the one interface of `prev` outside any sandbox that exists here.
/// The error says what each way found.
pub fn find_host_device(netns: &Path, ifname: &str, prev: &Value) -> Result<HostDevice, String> {
    let by_peer = host_side(netns, ifname).and_then(|ifindex| {
        ifname_of(ifindex)
            .map(|name| HostDevice { name, ifindex })
            .ok_or_else(|| {
                format!(
                    "the peer of {ifname} in {} (ifindex {ifindex}) is not in this namespace",
                    netns.display()
                )
            })
    });
    let peer_error = match by_peer {
        Ok(d) => return Ok(d),
        Err(e) => e,
    };
    let candidates = host_candidates(prev);
    let present: Vec<HostDevice> = candidates
        .iter()
        .filter_map(|name| {
            ifindex_of(name).map(|ifindex| HostDevice {
                name: name.clone(),
                ifindex,
            })
        })
        .collect();
    match present.as_slice() {
        [one] => Ok(one.clone()),
        _ => Err(format!(
            "failed to find the host side of {ifname}: {peer_error}; prevResult's interfaces \
             outside a sandbox {candidates:?}, of which {} exist on the host (one was wanted)",
            present.len()
        )),
    }
}

/// Serve plugin requests on `path` (a unix socket, created afresh; its directory made if
/// missing): each request goes to `to_agent` with a channel for the reply, which is
/// written back. Runs until `to_agent` closes.
pub async fn serve(
    path: PathBuf,
    to_agent: tokio::sync::mpsc::Sender<(Request, tokio::sync::oneshot::Sender<Reply>)>,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("failed to create {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path)
        .with_context(|| format!("failed to listen on {}", path.display()))?;
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => accepted?,
            () = to_agent.closed() => return Ok(()),
        };
        let to_agent = to_agent.clone();
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut line = String::new();
            let mut reader = tokio::io::BufReader::new(read.take(64 << 10));
            let reply = match reader.read_line(&mut line).await {
                Err(e) => Reply {
                    error: Some(format!("failed to read the request: {e}")),
                    ..Reply::default()
                },
                Ok(_) => match serde_json::from_str::<Request>(&line) {
                    Err(e) => Reply {
                        error: Some(format!("invalid request: {e}")),
                        ..Reply::default()
                    },
                    Ok(req) => {
                        let (tx, rx) = tokio::sync::oneshot::channel();
                        if to_agent.send((req, tx)).await.is_err() {
                            return;
                        }
                        rx.await.unwrap_or_else(|_| Reply {
                            error: Some("the agent is stopping".to_owned()),
                            ..Reply::default()
                        })
                    }
                },
            };
            let mut text = serde_json::to_string(&reply).unwrap_or_default();
            text.push('\n');
            let _ = write.write_all(text.as_bytes()).await;
        });
    }
}

/// A CNI error result, as the spec wants it on stdout with a non-zero exit.
fn cni_error(version: &str, code: u32, msg: &str, details: &str) -> ExitCode {
    eprintln!("egress-cni: {msg}: {details}");
    let out = json!({"cniVersion": version, "code": code, "msg": msg, "details": details});
    println!("{out}");
    ExitCode::FAILURE
}

/// Ask the agent at `socket` (waiting `timeout` at most, connect included).
pub fn ask(socket: &Path, req: &Request, timeout: Duration) -> Result<Reply, String> {
    exchange(connect(socket)?, req, timeout)
}

/// Connect to the agent at `socket`; the error names the socket.
pub fn connect(socket: &Path) -> Result<UnixStream, String> {
    UnixStream::connect(socket).map_err(|e| {
        format!(
            "failed to reach the egress agent at {}: {e} (is it running on this node with \
             --cni-socket there?)",
            socket.display()
        )
    })
}

/// Send `req` on a connection to the agent and read its reply (`timeout` each way).
pub fn exchange(mut stream: UnixStream, req: &Request, timeout: Duration) -> Result<Reply, String> {
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| e.to_string())?;
    let mut line = serde_json::to_string(req).map_err(|e| e.to_string())?;
    line.push('\n');
    stream
        .write_all(line.as_bytes())
        .map_err(|e| format!("failed to send the request: {e}"))?;
    let mut answer = String::new();
    BufReader::new(stream.take(64 << 10))
        .read_line(&mut answer)
        .map_err(|e| {
            format!(
                "no answer from the egress agent within {} ms: {e}",
                timeout.as_millis()
            )
        })?;
    serde_json::from_str(&answer).map_err(|e| format!("invalid answer {answer:?}: {e}"))
}

/// The plugin: `CNI_COMMAND` from the environment, the network configuration on stdin.
pub fn plugin_main() -> ExitCode {
    let command = std::env::var("CNI_COMMAND").unwrap_or_default();
    if command == "VERSION" {
        println!(
            "{}",
            json!({"cniVersion": "1.0.0", "supportedVersions": VERSIONS})
        );
        return ExitCode::SUCCESS;
    }
    let mut input = String::new();
    if std::io::stdin().read_to_string(&mut input).is_err() {
        return cni_error("1.0.0", 4, "failed to read the network configuration", "");
    }
    let config: Value = match serde_json::from_str(&input) {
        Ok(v) => v,
        Err(e) => return cni_error("1.0.0", 6, "invalid network configuration", &e.to_string()),
    };
    let version = config["cniVersion"].as_str().unwrap_or("1.0.0").to_owned();
    match command.as_str() {
        "ADD" | "CHECK" => add_or_check(&config, &version, command == "CHECK"),
        // The device goes with the pod's namespace; the agent forgets it then.
        "DEL" | "GC" | "STATUS" => ExitCode::SUCCESS,
        other => cni_error(
            &version,
            4,
            &format!("unknown CNI_COMMAND {other:?}"),
            "expected ADD, DEL, CHECK or VERSION",
        ),
    }
}

/// ADD (or CHECK): the agent attaches `from_pod` to the pod's host device, which the
/// plugin finds itself; ADD then passes the previous result on.
fn add_or_check(config: &Value, version: &str, check: bool) -> ExitCode {
    let socket = PathBuf::from(config["agentSocket"].as_str().unwrap_or(DEFAULT_SOCKET));
    let timeout = config["timeoutMs"]
        .as_u64()
        .map_or(DEFAULT_TIMEOUT, Duration::from_millis);
    let env = |name: &str| std::env::var(name).unwrap_or_default();
    let Some(prev) = config.get("prevResult").filter(|v| !v.is_null()) else {
        return cni_error(
            version,
            7,
            "egress-cni is a chained plugin: it needs a prevResult (list it after the CNI \
             that wires the pod)",
            "",
        );
    };
    // The agent first: when it is down, that is what the runtime must say.
    let agent_failed = |e: &str| {
        cni_error(
            version,
            11,
            &format!(
                "the egress agent at {} did not attach from_pod",
                socket.display()
            ),
            e,
        )
    };
    let stream = match connect(&socket) {
        Ok(s) => s,
        Err(e) => return agent_failed(&e),
    };
    let netns = PathBuf::from(env("CNI_NETNS"));
    let device = match find_host_device(&netns, &env("CNI_IFNAME"), prev) {
        Ok(d) => d,
        Err(e) => return cni_error(version, 11, "failed to find the pod's host device", &e),
    };
    let req = Request {
        netns,
        ifname: env("CNI_IFNAME"),
        container_id: env("CNI_CONTAINERID"),
        check,
        host_device: Some(device),
    };
    match exchange(stream, &req, timeout) {
        Err(e) => agent_failed(&e),
        Ok(Reply { error: Some(e), .. }) => cni_error(version, 999, "the egress agent refused", &e),
        Ok(_) => {
            if !check {
                let mut out = prev.clone();
                if let Some(o) = out.as_object_mut() {
                    o.insert("cniVersion".to_owned(), Value::String(version.to_owned()));
                }
                println!("{out}");
            }
            ExitCode::SUCCESS
        }
    }
}

/// The plugin's directory in the image: `egress-cni`, the loader and the libraries it
/// needs (`cargo xtask image` puts them there).
pub const BUNDLE_DIR: &str = "/usr/local/lib/egress-cni";
/// Where [`install`] puts the bundle, under the CNI bin directory.
const INSTALLED_BUNDLE: &str = "egress-cni.d";

/// Install the plugin from `bundle` (the image's [`BUNDLE_DIR`]) into `cni_bin_dir` (the
/// host's `/opt/cni/bin`, mounted): the bundle as `egress-cni.d/` and, as `egress-cni`,
/// a script that runs it with the bundle's own loader and libraries, so that the host's C
/// library, whatever its version, plays no part. Both are written beside their
/// destinations and renamed over them: a runtime calling the plugin meanwhile finds the
/// old one or the new one, never half of either. Returns the script's path.
pub fn install(bundle: &Path, cni_bin_dir: &Path) -> anyhow::Result<std::path::PathBuf> {
    use anyhow::Context as _;
    use std::os::unix::fs::PermissionsExt as _;
    let loader = std::fs::read_dir(bundle)
        .with_context(|| format!("failed to read the plugin bundle {}", bundle.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("ld-linux"));
    anyhow::ensure!(
        bundle.join("egress-cni").is_file(),
        "no egress-cni in {}: the image is built by `cargo xtask image`",
        bundle.display()
    );
    let target = cni_bin_dir.join(INSTALLED_BUNDLE);
    let staging = cni_bin_dir.join(format!(".{INSTALLED_BUNDLE}.new"));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging)
        .with_context(|| format!("failed to create {}", staging.display()))?;
    for entry in std::fs::read_dir(bundle)? {
        let entry = entry?;
        let to = staging.join(entry.file_name());
        std::fs::copy(entry.path(), &to).with_context(|| {
            format!(
                "failed to copy {} to {}",
                entry.path().display(),
                to.display()
            )
        })?;
    }
    let old = cni_bin_dir.join(format!(".{INSTALLED_BUNDLE}.old"));
    let _ = std::fs::remove_dir_all(&old);
    if target.exists() {
        std::fs::rename(&target, &old)
            .with_context(|| format!("failed to move {} aside", target.display()))?;
    }
    std::fs::rename(&staging, &target).with_context(|| {
        format!(
            "failed to rename {} to {}",
            staging.display(),
            target.display()
        )
    })?;
    let _ = std::fs::remove_dir_all(&old);
    let dir = target.display();
    let exec = match loader {
        Some(l) => {
            format!("exec \"{dir}/{l}\" --library-path \"{dir}\" \"{dir}/egress-cni\" \"$@\"")
        }
        // A static plugin needs no loader.
        None => format!("exec \"{dir}/egress-cni\" \"$@\""),
    };
    let script = format!(
        "#!/bin/sh\n# Installed by egress-agent install-cni: the chained plugin of the \
         egress gateway agent.\n{exec}\n"
    );
    let path = cni_bin_dir.join("egress-cni");
    let tmp = cni_bin_dir.join(".egress-cni.new");
    std::fs::write(&tmp, script).with_context(|| format!("failed to write {}", tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&tmp, &path)
        .with_context(|| format!("failed to rename {} to {}", tmp.display(), path.display()))?;
    Ok(path)
}

/// Remove what [`install`] put into `cni_bin_dir` (the script `egress-cni`, the bundle
/// `egress-cni.d/` and any staging copy an interrupted install left), calling `say` with
/// one line for each thing removed; their number. Nothing else of the directory is touched.
pub fn uninstall(cni_bin_dir: &Path, mut say: impl FnMut(String)) -> anyhow::Result<usize> {
    use anyhow::Context as _;
    let mut removed = 0;
    for name in [
        "egress-cni".to_owned(),
        ".egress-cni.new".to_owned(),
        INSTALLED_BUNDLE.to_owned(),
        format!(".{INSTALLED_BUNDLE}.new"),
        format!(".{INSTALLED_BUNDLE}.old"),
    ] {
        let path = cni_bin_dir.join(&name);
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        }
        .with_context(|| format!("failed to remove {}", path.display()))?;
        removed += 1;
        say(format!("removed CNI plugin {}", path.display()));
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_reaches_the_agent_and_its_reply_the_plugin() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("run/cni.sock");
        let (tx, mut rx) =
            tokio::sync::mpsc::channel::<(Request, tokio::sync::oneshot::Sender<Reply>)>(4);
        tokio::spawn(serve(path.clone(), tx));
        // The agent: answers the first request with a device, the second with an error.
        tokio::spawn(async move {
            let mut n = 0;
            while let Some((req, reply)) = rx.recv().await {
                n += 1;
                let _ = reply.send(if n == 1 {
                    Reply {
                        device: Some(format!("host-of-{}", req.ifname)),
                        error: None,
                    }
                } else {
                    Reply {
                        device: None,
                        error: Some("no such pod".to_owned()),
                    }
                });
            }
        });
        for _ in 0..100 {
            if path.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let req = Request {
            netns: "/run/netns/x".into(),
            ifname: "eth0".to_owned(),
            container_id: "c1".to_owned(),
            check: false,
            host_device: Some(HostDevice {
                name: "veth1".to_owned(),
                ifindex: 7,
            }),
        };
        let (p, r) = (path.clone(), req.clone());
        let first = tokio::task::spawn_blocking(move || ask(&p, &r, Duration::from_secs(2)))
            .await
            .expect("join");
        assert_eq!(
            first.expect("reply").device.as_deref(),
            Some("host-of-eth0")
        );
        let (p, r) = (path.clone(), req);
        let second = tokio::task::spawn_blocking(move || ask(&p, &r, Duration::from_secs(2)))
            .await
            .expect("join");
        assert_eq!(second.expect("reply").error.as_deref(), Some("no such pod"));
        // No agent at all: a clear error naming the socket.
        let missing = dir.path().join("nobody.sock");
        let e = ask(
            &missing,
            &Request {
                netns: "/x".into(),
                ifname: "eth0".to_owned(),
                container_id: String::new(),
                check: false,
                host_device: None,
            },
            Duration::from_millis(200),
        )
        .expect_err("no agent");
        assert!(
            e.contains("nobody.sock") && e.contains("is it running"),
            "{e}"
        );
    }

    /// What `install` writes, `uninstall` removes (a staging copy an interrupted install
    /// left too), and nothing else of the directory; a second run finds nothing.
    #[test]
    fn uninstall_removes_what_install_wrote_and_nothing_else() {
        let bundle = tempfile::tempdir().expect("tempdir");
        std::fs::write(bundle.path().join("egress-cni"), "plugin").expect("write");
        let bin = tempfile::tempdir().expect("tempdir");
        std::fs::write(bin.path().join("calico"), "theirs").expect("write");
        install(bundle.path(), bin.path()).expect("install");
        std::fs::create_dir(bin.path().join(".egress-cni.d.new")).expect("mkdir");
        let mut said = Vec::new();
        let n = uninstall(bin.path(), |l| said.push(l)).expect("uninstall");
        assert_eq!(n, 3, "{said:?}");
        let at = |name: &str| format!("removed CNI plugin {}", bin.path().join(name).display());
        assert_eq!(
            said,
            [
                at("egress-cni"),
                at("egress-cni.d"),
                at(".egress-cni.d.new")
            ]
        );
        let left: Vec<String> = std::fs::read_dir(bin.path())
            .expect("read_dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["calico"]);
        assert_eq!(uninstall(bin.path(), |_| {}).expect("again"), 0);
    }
}
