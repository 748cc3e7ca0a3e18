//! The legacy tc path (issue 27), for kernels without TCX links: a clsact qdisc and
//! direct-action bpf filters. On any kernel (forced with `Hook::Tc` / `--attach tc`):
//!
//! * a filter outlives the agent that attached it, the next agent swaps its program in
//!   place (a new program id under the same priority and handle, one filter), and a
//!   filter no longer wanted goes while another loader's filters stay;
//! * a foreign filter at our priority and handle is refused by name, untouched;
//! * changing hook (TCX to tc and back) moves every attachment, new one first;
//! * `cleanup` removes our filters (recorded or not) and the clsact qdiscs we added,
//!   never another loader's filter or qdisc;
//! * in the lab with every agent on `--attach tc`: the lab's traffic is right, and an
//!   agent upgrade (SIGTERM, a new process) on the worker and on the holder keeps a TCP
//!   stream through them unbroken.

use std::{
    collections::BTreeSet,
    net::IpAddr,
    os::fd::{AsRawFd as _, OwnedFd},
    path::PathBuf,
    process::Command,
    time::Duration,
};

use egress_agent::{
    datapath::{AttachMode, Attachment, Datapath, Hook, cleanup, hook, tc},
    ebpf::{FROM_POD, FROM_SECONDARY},
};
use egress_tests::{
    cluster::{self, holder, seen, up_with_agent_args, wait_until},
    hooks::{self, Ingress},
    lab::{Lab, Proto, addr},
    netns::DirGuard,
    testrun::{ifindex, in_netns, ip},
};

const TC: Hook = Hook::Tc { priority: 1 };

fn pin_dir(test: &str) -> PathBuf {
    PathBuf::from(format!(
        "/sys/fs/bpf/egress-test-tc-{test}-{}",
        std::process::id()
    ))
}

fn open(dir: &std::path::Path, hook: Hook) -> Datapath {
    let mut dp = Datapath::open(dir).expect("the agent opens its datapath");
    dp.set_hook(hook);
    dp
}

fn want(program: &'static str, dev: &str) -> BTreeSet<Attachment> {
    BTreeSet::from([Attachment {
        program,
        ifname: dev.to_owned(),
        ifindex: ifindex(dev),
    }])
}

/// A classifier of another loader (a CNI's, say): passes everything on.
fn foreign_program() -> OwnedFd {
    hook::load_trivial(hook::SCHED_CLS, -1).expect("a trivial classifier loads")
}

fn ours(on: &[Ingress], program: &str) -> usize {
    on.iter().filter(|i| i.is(program)).count()
}

fn prog_id(dev: &str, name: &str) -> Option<u32> {
    hooks::tc_prog_ids(dev)
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, id)| id)
}

/// `tc qdisc show dev <dev>` in the calling thread's namespace.
fn qdiscs(dev: &str) -> String {
    let out = Command::new("tc")
        .args(["qdisc", "show", "dev", dev])
        .output()
        .expect("failed to run tc");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_tc_filter_outlives_its_agent_is_replaced_in_place_and_only_ours_goes() {
    in_netns(|| {
        ip("link add att0 type veth peer name att0p");
        ip("link set att0 up");
        let dir = pin_dir("adopt");
        let _guard = DirGuard::create(&dir).unwrap();
        let idx = ifindex("att0");
        // A CNI's filter where `tc filter add` without a priority puts it.
        let cni = foreign_program();
        assert!(tc::add_clsact(idx).unwrap(), "the CNI adds the qdisc");
        tc::replace_bpf_filter(idx, 49152, 1, "cni/from-container", cni.as_raw_fd()).unwrap();
        let cni_filter = Ingress::Tc {
            priority: 49152,
            handle: 1,
            name: "cni/from-container".to_owned(),
        };
        let want = want(FROM_POD, "att0");
        let ours_at_1 = Ingress::Tc {
            priority: 1,
            handle: tc::handle_of(FROM_POD).unwrap(),
            name: "egress/from_pod".to_owned(),
        };

        let mut first = open(&dir, TC);
        let errors = first.sync_attachments(&want);
        assert!(errors.is_empty(), "{errors:?}");
        let on = hooks::ingress("att0");
        assert_eq!(
            on,
            [ours_at_1.clone(), cni_filter.clone()],
            "ours at priority 1, before the CNI's; no TCX program"
        );
        let record = dir.join(format!("tc-from_pod@att0@{idx}"));
        assert_eq!(
            hook::TcRecord::read(&record),
            Some(hook::TcRecord {
                priority: 1,
                created_clsact: false
            }),
            "recorded at priority 1, on a qdisc the CNI added"
        );
        let id1 = prog_id("att0", "egress/from_pod").unwrap();
        drop(first);
        assert_eq!(
            prog_id("att0", "egress/from_pod"),
            Some(id1),
            "the filter outlives its agent"
        );

        let mut second = open(&dir, TC);
        let errors = second.sync_attachments(&want);
        assert!(errors.is_empty(), "adopting: {errors:?}");
        let id2 = prog_id("att0", "egress/from_pod").unwrap();
        assert_ne!(id1, id2, "the new agent's program replaced the old one");
        assert_eq!(
            hooks::ingress("att0"),
            [ours_at_1.clone(), cni_filter.clone()],
            "in place: still one filter of ours, same priority and handle"
        );

        // No longer wanted: ours goes; the CNI's filter and its qdisc stay.
        assert!(second.sync_attachments(&BTreeSet::new()).is_empty());
        assert_eq!(hooks::ingress("att0"), std::slice::from_ref(&cni_filter));
        assert!(qdiscs("att0").contains("clsact"), "{}", qdiscs("att0"));
        assert!(!record.exists(), "the record goes with the filter");

        // Another loader's filter at our priority and handle: refused by name, untouched.
        tc::replace_bpf_filter(
            idx,
            1,
            tc::handle_of(FROM_POD).unwrap(),
            "other/classifier",
            cni.as_raw_fd(),
        )
        .unwrap();
        let errors: Vec<String> = second
            .sync_attachments(&want)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(errors.len(), 1, "{errors:?}");
        for part in ["att0", "priority 1", "other/classifier", "--tc-priority"] {
            assert!(errors[0].contains(part), "{part}: {}", errors[0]);
        }
        let on = hooks::ingress("att0");
        assert_eq!(ours(&on, FROM_POD), 0, "{on:?}");
        assert!(
            on.iter().any(|i| i.name() == "other/classifier"),
            "the foreign filter stays: {on:?}"
        );
    });
}

#[test]
fn changing_hook_moves_every_attachment_and_the_device_keeps_one_program() {
    if !hook::tcx_supported().unwrap() {
        // Linux before 6.6: TCX cannot be had, and forcing it says so at start.
        let e = Hook::resolve(AttachMode::Tcx, 1).unwrap_err();
        assert!(
            e.contains("--attach tcx") && e.contains("no TCX links"),
            "{e}"
        );
        let (hook, why) = Hook::resolve(AttachMode::Auto, 1).unwrap();
        assert_eq!(hook, TC, "{why}");
        return;
    }
    in_netns(|| {
        ip("link add att0 type veth peer name att0p");
        ip("link set att0 up");
        let dir = pin_dir("switch");
        let _guard = DirGuard::create(&dir).unwrap();
        let want = want(FROM_SECONDARY, "att0");
        let mut dp = open(&dir, Hook::Tcx);
        assert!(dp.sync_attachments(&want).is_empty());
        assert_eq!(
            hooks::ingress("att0"),
            [Ingress::Tcx(FROM_SECONDARY.to_owned())]
        );
        dp.set_hook(TC);
        let errors = dp.sync_attachments(&want);
        assert!(errors.is_empty(), "{errors:?}");
        // The kernel drops the unpinned link from a work queue: shortly, not at once.
        wait_until(Duration::from_secs(5), || {
            hooks::ingress("att0")
                .iter()
                .all(|i| matches!(i, Ingress::Tc { .. }))
        })
        .expect("the TCX link goes once the filter is on");
        let on = hooks::ingress("att0");
        assert_eq!(ours(&on, FROM_SECONDARY), 1, "{on:?}");
        dp.set_hook(Hook::Tcx);
        assert!(dp.sync_attachments(&want).is_empty());
        let on = hooks::ingress("att0");
        assert_eq!(on, [Ingress::Tcx(FROM_SECONDARY.to_owned())], "{on:?}");
    });
}

#[test]
fn cleanup_removes_our_filters_recorded_or_not_and_leaves_another_loaders() {
    in_netns(|| {
        ip("link add att0 type veth peer name att0p");
        ip("link add att1 type veth peer name att1p");
        ip("link set att0 up");
        ip("link set att1 up");
        let dir = pin_dir("cleanup");
        let _guard = DirGuard::create(&dir).unwrap();
        let i0 = ifindex("att0");
        let cni = foreign_program();
        tc::add_clsact(i0).unwrap();
        tc::replace_bpf_filter(i0, 49152, 1, "cni/from-container", cni.as_raw_fd()).unwrap();
        let mut all = want(FROM_POD, "att0");
        all.extend(want(FROM_SECONDARY, "att1"));
        let mut dp = open(&dir, TC);
        assert!(dp.sync_attachments(&all).is_empty());
        drop(dp);
        // att0's record lost (its directory entry removed by hand): cleanup still finds
        // the filter by its name and handle.
        std::fs::remove_dir_all(dir.join(format!("tc-from_pod@att0@{i0}"))).unwrap();
        let mut said = Vec::new();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(cleanup::uninstall(&dir, "egress-none0", |l| said.push(l)))
            .expect("cleanup runs");
        let said = said.join("\n");
        assert!(
            said.contains("from_secondary from att1 (tc filter record")
                && said.contains("from_pod from att0 (tc filter, priority 1, no record)"),
            "{said}"
        );
        assert_eq!(
            hooks::ingress("att0"),
            [Ingress::Tc {
                priority: 49152,
                handle: 1,
                name: "cni/from-container".to_owned()
            }],
            "the CNI's filter stays"
        );
        assert!(qdiscs("att0").contains("clsact"), "the CNI's qdisc stays");
        assert!(hooks::ingress("att1").is_empty());
        assert!(
            !qdiscs("att1").contains("clsact"),
            "the qdisc we added goes once empty: {}",
            qdiscs("att1")
        );
        assert!(!dir.exists(), "the pin directory goes");
    });
}

/// Our tc filters in `node`'s namespace, as `device: name (program id)`, sorted.
fn tc_filters(lab: &Lab, node: &str) -> Vec<String> {
    let names = cluster::interface_names(lab, node).unwrap();
    lab.ns(node)
        .unwrap()
        .run_in(move || {
            let mut out = Vec::new();
            for n in names {
                for i in hooks::ingress(&n) {
                    assert!(
                        !matches!(i, Ingress::Tcx(_)),
                        "{n}: a TCX program under --attach tc"
                    );
                }
                for (name, id) in hooks::tc_prog_ids(&n) {
                    if name.starts_with("egress/") {
                        out.push(format!("{n}: {name} ({id})"));
                    }
                }
            }
            out.sort();
            Ok(out)
        })
        .unwrap()
}

#[test]
fn with_legacy_tc_the_lab_is_right_and_an_agent_upgrade_keeps_a_tcp_stream() {
    let mut lab =
        up_with_agent_args(cluster::default_spec().unwrap(), &["--attach", "tc"]).unwrap();
    let a = IpAddr::V4(addr::EGRESS_IP_A);
    let (gw, _) = holder(&lab, addr::EGRESS_IP_A).unwrap();
    for node in ["w1", gw.as_str()] {
        let log = lab.agent_log(node);
        assert!(log.contains("legacy tc (--attach tc)"), "{node}:\n{log}");
    }
    assert_eq!(
        seen(&lab, "w1-p1", Proto::Udp, addr::HOST_B),
        Some(IpAddr::V4(addr::EGRESS_IP_B))
    );
    let before_w1 = tc_filters(&lab, "w1");
    let before_gw = tc_filters(&lab, &gw);
    assert!(
        before_w1.iter().any(|f| f.contains("egress/from_pod")),
        "{before_w1:?}"
    );
    assert!(
        before_gw
            .iter()
            .any(|f| f.contains("egress/from_secondary"))
            && before_gw.iter().any(|f| f.contains("egress/from_tunnel")),
        "{before_gw:?}"
    );

    let (tcp, log) =
        cluster::start_stream(&lab, "w1-p1", "tcp", IpAddr::V4(addr::HOST_A), "tc-upgrade")
            .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let bin = cluster::agent_bin().unwrap();
    // A DaemonSet rolling the agent: SIGTERM, then the new process, node by node.
    for node in ["w1", gw.as_str()] {
        lab.stop_agent(node).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        lab.start_agent(node, &bin, &["--attach", "tc"]).unwrap();
        wait_until(Duration::from_secs(20), || {
            lab.agent_log(node).matches("agent started").count() >= 2
        })
        .unwrap_or_else(|e| panic!("{node} restarted: {e:#}\n{}", lab.agent_log(node)));
        std::thread::sleep(Duration::from_secs(1));
    }
    let tcp = cluster::stop_stream(tcp, &log).unwrap();
    eprintln!(
        "tcp through the upgrade: {} sent, {} replies, longest gap {} ms, reset {}",
        tcp.sent, tcp.received, tcp.longest_gap_ms, tcp.reset
    );
    assert!(tcp.unbroken(), "the TCP stream was never reset: {tcp:?}");
    assert!(
        tcp.sources.iter().all(|s| s.starts_with(&format!("{a}:"))),
        "host-a saw only {a}: {:?}",
        tcp.sources
    );
    assert_eq!(
        holder(&lab, addr::EGRESS_IP_A).map(|(g, _)| g),
        Some(gw.clone()),
        "the holder kept its egress IP through its agent's upgrade"
    );
    // Replaced in place: the same filters, each with the new agent's program (once the
    // new agent's passes have run: under emulation they take a while).
    let strip = |v: &[String]| -> Vec<String> {
        v.iter()
            .map(|f| f.split(" (").next().unwrap_or(f).to_owned())
            .collect()
    };
    for (node, before) in [("w1", before_w1), (gw.as_str(), before_gw)] {
        let replaced = |after: &[String]| {
            strip(after) == strip(&before) && after.iter().all(|f| !before.contains(f))
        };
        let waited = wait_until(Duration::from_secs(20), || {
            replaced(&tc_filters(&lab, node))
        });
        let after = tc_filters(&lab, node);
        assert!(
            waited.is_ok(),
            "{node}: the same filters, each with a new program: before {before:?}, after \
             {after:?}"
        );
    }
}
