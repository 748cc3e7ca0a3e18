//! End to end: a pod that starts sending before its Pod object reaches the agents
//! (issue 13). `w1-late`, a pod of the sample policy on w1 (selected for network A through
//! egress IP A), has its network from the start, as after the CNI ran, but no Pod object
//! in `cluster.yaml` until the test announces it. The primary network's router (`rtr`,
//! every node's default gateway) is given a leg on network A, so that a packet that leaves
//! w1 untranslated reaches host-a with the pod's own address: a leak a far host can see.
//!
//! host-a captures every UDP datagram to its echo port while the pod streams to it (one
//! datagram each 10 ms), before and after its Pod object is announced: with
//! `--unknown-pods drop` no source but egress IP A may ever arrive; with the default
//! `pass`, the pod's address does (the leak the flag closes).

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use egress_common::counters::reason::{DROP_NOT_ADMITTED, DROP_UNKNOWN_POD};
use egress_tests::{
    cluster::{agent_bin, counted, default_spec, seen, wait_until},
    lab::{Lab, PodSpec, Proto, addr},
    stream::{Summary, unix_ms},
};

const LATE: &str = "w1-late";
/// A pod no policy selects (`app: web`) on w1, announced late too.
const WEB: &str = "w1-web";
/// Streaming before the Pod object is announced, then after.
const BEFORE: Duration = Duration::from_secs(2);
const AFTER: Duration = Duration::from_secs(3);
/// How soon after its device a pod first sends, without the plugin (the case).
const NEWLINK_WINDOW: Duration = Duration::from_millis(50);

struct Figures {
    /// Datagrams host-a saw from any source but egress IP A.
    leaked: usize,
    /// Datagrams host-a saw from egress IP A.
    translated: usize,
    /// Datagrams w1 dropped as DROP_UNKNOWN_POD.
    dropped: u64,
    /// Datagrams the gateways dropped as DROP_NOT_ADMITTED (the source node selected the
    /// pod before its gateway admitted it).
    not_admitted: u64,
    /// From the Pod object's announcement to the first reply through egress IP A.
    to_egress_ms: Option<u64>,
    sent: u64,
}

fn lab_with_late_pod(mode: &str) -> Result<Lab> {
    lab_with(mode, false)
}

/// The lab with [`LATE`] unannounced, wired from the start or only later
/// (`wired_later`: its devices appear once the agents run), agents on `mode`.
fn lab_with(mode: &str, wired_later: bool) -> Result<Lab> {
    let mut spec = default_spec()?;
    let mut late = PodSpec::new(LATE, "payments", "w1", &[("app", "api")]);
    late.wired_later = wired_later;
    spec.pods.push(late);
    spec.pods
        .push(PodSpec::new(WEB, "payments", "w1", &[("app", "web")]));
    let mut lab = Lab::up(spec)?;
    lab.set_pod_announced(LATE, false)?;
    lab.set_pod_announced(WEB, false)?;
    lab.connect_router_to('a')?;
    for node in ["w1", "w2", "gw1", "gw2"] {
        lab.start_agent(node, &agent_bin()?, &["--unknown-pods", mode])?;
    }
    wait_until(Duration::from_secs(30), || {
        seen(&lab, "w1-p1", Proto::Udp, addr::HOST_A) == Some(IpAddr::V4(addr::EGRESS_IP_A))
    })
    .with_context(|| format!("agents did not converge:\n{}", lab.agent_log("w1")))?;
    Ok(lab)
}

/// Stream from the unannounced pod, announce it after [`BEFORE`], and count what host-a
/// captured by source.
fn late_pod_stream(lab: &mut Lab) -> Result<Figures> {
    late_pod_stream_wiring(lab, Wiring::Before)
}

/// When and how [`LATE`]'s network is set up.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wiring {
    /// With the lab, before the agents started.
    Before,
    /// Right before it streams, as a CNI would, the agent learning of it from netlink.
    Late,
    /// The same, then `egress-cni` chained after it (ADD returns once from_pod is on).
    LateWithPlugin,
}

/// [`late_pod_stream`]; with `wire`, the pod's network is set up (as a CNI's ADD would)
/// right before it starts streaming: its first datagram leaves within a few ms of its
/// device's creation.
fn late_pod_stream_wiring(lab: &mut Lab, wiring: Wiring) -> Result<Figures> {
    pod_stream(lab, LATE, wiring)
}

/// [`late_pod_stream_wiring`] of `pod`.
fn pod_stream(lab: &mut Lab, pod: &str, wiring: Wiring) -> Result<Figures> {
    let capture = lab.dir().join(format!("host-a-{pod}.pcap.txt"));
    let mut dump = lab.ns("host-a")?.spawn(
        "tcpdump",
        &["-n", "-l", "-i", "eth0", "udp dst port 7777"],
        &capture,
    )?;
    std::thread::sleep(Duration::from_millis(500));
    let log = lab.dir().join(format!("{pod}-stream.log"));
    let total = BEFORE + AFTER;
    let target = SocketAddr::new(addr::HOST_A.into(), addr::ECHO_PORT).to_string();
    let t = std::time::Instant::now();
    match wiring {
        Wiring::Before => {}
        Wiring::Late => lab.wire_pod(pod)?,
        Wiring::LateWithPlugin => {
            let plugin = agent_bin()?.with_file_name("egress-cni");
            let out = lab.wire_pod_with_cni(pod, &plugin)?;
            ensure!(
                out.contains("\"interfaces\""),
                "prevResult passed through: {out}"
            );
        }
    }
    match wiring {
        Wiring::Before => {}
        // The case: the pod sends about 50 ms after its device appears (a real
        // pod's first packet waits for its sandbox and containers: longer). Without the
        // plugin, that is the agent's window to read the RTM_NEWLINK and attach.
        Wiring::Late => {
            std::thread::sleep(NEWLINK_WINDOW.saturating_sub(t.elapsed()));
            println!("{pod} wired; streaming {:?} after its device", t.elapsed());
        }
        Wiring::LateWithPlugin => {
            println!(
                "{pod} wired through egress-cni in {:?}; streaming at once",
                t.elapsed()
            )
        }
    }
    let mut stream = lab.ns(pod)?.spawn(
        &lab.spec().echo_bin,
        &[
            "stream",
            "udp",
            &target,
            "--interval-ms",
            "10",
            "--duration-ms",
            &total.as_millis().to_string(),
        ],
        &log,
    )?;
    std::thread::sleep(BEFORE);
    let announced = unix_ms();
    lab.set_pod_announced(pod, true)?;
    stream.wait_for(total + Duration::from_secs(5))?;
    std::thread::sleep(Duration::from_millis(300));
    let _ = dump.terminate(Duration::from_secs(1));
    let summary = Summary::find_in(&std::fs::read_to_string(&log)?)?;
    let lines = std::fs::read_to_string(&capture)?;
    let egress = format!(" {}.", addr::EGRESS_IP_A);
    let datagrams: Vec<&str> = lines.lines().filter(|l| l.contains(" > ")).collect();
    let translated = datagrams.iter().filter(|l| l.contains(&egress)).count();
    Ok(Figures {
        leaked: datagrams.len() - translated,
        translated,
        dropped: counted(lab, "w1", DROP_UNKNOWN_POD),
        not_admitted: counted(lab, "gw1", DROP_NOT_ADMITTED)
            + counted(lab, "gw2", DROP_NOT_ADMITTED),
        to_egress_ms: summary.first_reply_after(announced),
        sent: summary.sent,
    })
}

#[test]
fn a_pod_unknown_to_the_agent_never_leaks_under_unknown_pods_drop() -> Result<()> {
    let mut lab = lab_with_late_pod("drop")?;
    let f = late_pod_stream(&mut lab)?;
    println!(
        "--unknown-pods drop: {} datagrams sent, {} leaked, {} dropped as DROP_UNKNOWN_POD, \
         {} at the gateway as DROP_NOT_ADMITTED, {} through egress IP A; first reply {} ms \
         after the Pod object was announced",
        f.sent,
        f.leaked,
        f.dropped,
        f.not_admitted,
        f.translated,
        f.to_egress_ms.map_or("never".to_owned(), |t| t.to_string())
    );
    ensure!(
        f.leaked == 0,
        "{} datagrams reached host-a with another source",
        f.leaked
    );
    ensure!(
        f.dropped > 0,
        "nothing was dropped before the Pod object arrived"
    );
    ensure!(
        f.translated > 0,
        "nothing went through egress IP A once the pod was known"
    );
    let t = f.to_egress_ms.context("no reply after the announcement")?;
    ensure!(t < AFTER.as_millis() as u64, "egress took {t} ms");

    // A pod no policy selects: unknown, dropped where the rules reach; known, it leaves
    // with its own address. Its Pod object changes nothing but its own entries, so w1's
    // agent patches its last compile in (`compiler::delta`) rather than compiling anew.
    let (dropped, patched) = (f.dropped, compiles(&lab, "w1", "patched")?);
    let g = pod_stream(&mut lab, WEB, Wiring::Before)?;
    let patched = compiles(&lab, "w1", "patched")? - patched;
    println!(
        "{WEB} (no policy selects it): {} datagrams sent, {} dropped as DROP_UNKNOWN_POD, \
         {} at host-a by its own address, {} through egress IP A; w1 patched {patched} \
         compiles",
        g.sent,
        g.dropped - dropped,
        g.leaked,
        g.translated
    );
    ensure!(
        g.dropped > dropped,
        "nothing was dropped while {WEB} was unknown"
    );
    ensure!(
        g.leaked > 0,
        "nothing reached host-a from {WEB} once it was known"
    );
    ensure!(g.translated == 0, "{WEB} went through egress IP A");
    ensure!(
        g.leaked < g.sent as usize,
        "every datagram of {WEB} reached host-a: it was never dropped"
    );
    ensure!(patched > 0, "w1 compiled anew for {WEB}'s Pod object");
    Ok(())
}

/// `node`'s agent's compiles that `egress_compiles_total` counts as `made`.
fn compiles(lab: &Lab, node: &str, made: &str) -> Result<u64> {
    let text = lab.agent_metrics(node)?;
    let series = format!("egress_compiles_total{{made=\"{made}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .with_context(|| format!("{node} serves no {series}"))?
        .trim()
        .parse()
        .with_context(|| format!("{node}'s {series}"))
}

#[test]
fn the_default_pass_leaks_an_unknown_pods_address() -> Result<()> {
    let mut lab = lab_with_late_pod("pass")?;
    let f = late_pod_stream(&mut lab)?;
    println!(
        "--unknown-pods pass: {} datagrams sent, {} leaked (the pod's own address at host-a), \
         {} through egress IP A; first reply {} ms after the Pod object was announced",
        f.sent,
        f.leaked,
        f.translated,
        f.to_egress_ms.map_or("never".to_owned(), |t| t.to_string())
    );
    ensure!(
        f.leaked > 0,
        "the leak path does not work: the test proves nothing"
    );
    ensure!(f.dropped == 0);
    Ok(())
}

#[test]
fn a_pod_device_created_after_the_agents_started_never_leaks_under_unknown_pods_drop() -> Result<()>
{
    // Issue 29: a device that appears while the agents run used to get no program until
    // a pass that saw its host route: a pod sending within 50 ms of its device leaked.
    // Then a pass in progress delayed the attachment (CI: 15 of 500 leaked, attached by
    // the pass about 150 ms after the device): it now goes on off the main thread.
    // Sending at once is the plugin's case (below): nothing else can order the first
    // packet after the attachment.
    let mut lab = lab_with("drop", true)?;
    let f = late_pod_stream_wiring(&mut lab, Wiring::Late)?;
    let attached = lab
        .agent_log("w1")
        .lines()
        .find(|l| l.contains("attached to a new pod device at its RTM_NEWLINK"))
        .map(str::to_owned);
    println!(
        "device created after the agents: {} datagrams sent, {} leaked, {} dropped as \
         DROP_UNKNOWN_POD, {} through egress IP A; w1: {}",
        f.sent,
        f.leaked,
        f.dropped,
        f.translated,
        attached
            .as_deref()
            .unwrap_or("attached by the pass the same change woke, not at the RTM_NEWLINK")
    );
    ensure!(
        f.leaked == 0,
        "{} datagrams reached host-a with another source",
        f.leaked
    );
    // The pass the same change wakes may attach first (then nothing is logged): either
    // way nothing leaked.
    ensure!(
        f.translated > 0,
        "nothing went through egress IP A once known"
    );
    Ok(())
}

#[test]
fn a_pod_added_through_the_cni_plugin_has_its_program_before_it_can_send() -> Result<()> {
    let mut lab = lab_with("drop", true)?;
    let f = late_pod_stream_wiring(&mut lab, Wiring::LateWithPlugin)?;
    let attached = lab
        .agent_log("w1")
        .lines()
        .find(|l| l.contains("for the CNI plugin's ADD"))
        .map(str::to_owned);
    println!(
        "through egress-cni: {} datagrams sent, {} leaked, {} dropped as DROP_UNKNOWN_POD, \
         {} through egress IP A; w1: {}",
        f.sent,
        f.leaked,
        f.dropped,
        f.translated,
        attached.as_deref().unwrap_or("-")
    );
    ensure!(
        f.leaked == 0,
        "{} datagrams reached host-a with another source",
        f.leaked
    );
    // The plugin returned after the agent attached (or found the program there already).
    ensure!(
        attached.is_some() || lab.agent_log("w1").contains("at its RTM_NEWLINK"),
        "w1 attached for neither the plugin nor the new link"
    );
    ensure!(
        f.translated > 0,
        "nothing went through egress IP A once known"
    );
    Ok(())
}
