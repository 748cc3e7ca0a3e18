//! `cargo xtask bench [--quick]`: per-packet `BPF_PROG_TEST_RUN` timings of the datapath
//! next to an empty-program floor, and the lab sections; prints a markdown report and
//! writes it to `docs/benchmarks.md`. Needs root (BPF, network namespaces).

use std::path::PathBuf;

use anyhow::{Context as _, Result, bail};
use egress_tests::bench::{
    Plan, churn, failover, lab, per_packet, probes,
    report::{Machine, Report, Table, datapath_source, per_packet_table},
    scale, source, yaml,
};

const USAGE: &str =
    "usage: egress-bench [--quick] [--no-lab | --lab-only] [--out PATH | --no-write]

  --quick      3 rounds x 200k runs instead of 5 x 1M, shorter lab runs (a few minutes)
  --no-lab     per-packet timings only (no lab: throughput, new flows, control plane)
  --lab-only   the lab sections only (no per-packet timings)
  --out PATH   where to write the report (default: docs/benchmarks.md of the workspace)
  --no-write   print the report only
  --nodes N    the lab at N nodes (a tenth of them gateways), default probes: a silent
               death, a drain, a policy edit and a gateway route, each against the
               4-node bounds (1 s at p99), with the workers' passes and CPU; printed
  --probes     the liveness probes' cost only, printed (not written)
  --yaml       the YAML source's re-read after one file changed only (100k pods), printed
  --failover   the failover section only (3 rounds; 1 with --quick first), printed
  --spread     two gateways against one only (egressIPs: aggregate TCP of the selected
               pods, one egress IP then two, alternating), printed
  --like-for-like
               ours (also with 100k conntrack flows preloaded on the gateway, and from
               the gateway's own pod, tunnel-free), the tunneled baseline (point-to-point
               and collect-metadata VXLAN devices), the routed one and the kernel from the
               gateway's own pod, at one served pod only, printed
  --scale      the cluster-scale rows only (compiler, apply and map memory at 100 nodes
               and 100k pods; the gateway's per-packet rows with conntrack full), printed
  --at-scale   the lab's four agents against a state of 100 nodes and 100k pods: their
               memory (RSS, maps) and idle CPU, printed
  --churn      one pod change at 100k pods only (the pass of a source node and a gateway,
               and with nothing changed; CPU, passes and latency under 10 pod events/s,
               state passes unbatched and batched; the Kubernetes source's snapshot per pod
               event, before 12e6bd1 and now), in this process without root, printed
  --routes     the learned-route rows of the control plane only (destinationsFrom: Routes;
               fewer changes with --quick first), printed
  --hooks      legacy tc against TCX only (the agents restarted with each hook in
               alternate rounds; the tunnel and miss paths), printed";

struct Args {
    plan: Plan,
    out: Option<PathBuf>,
    lab: bool,
    per_packet: bool,
}

/// The lab at `nodes` nodes, as `cargo xtask lab --nodes` runs it, against the bounds.
fn at_nodes(nodes: u32) -> Result<Table> {
    let exe = std::env::current_exe().context("failed to find this binary")?;
    let dir = exe.parent().context("this binary has no directory")?;
    let opts = egress_tests::scale_lab::Options::for_nodes(nodes, None, dir)?;
    let report = egress_tests::scale_lab::run(&opts)?;
    eprint!("{}", egress_tests::scale_lab::print(&report));
    Ok(egress_tests::scale_lab::bench_table(&report))
}

/// The workspace this binary was built from.
fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Print one section with the machine header, and exit.
fn print_alone(plan: Plan, table: Table) -> Result<()> {
    print_tables(plan, vec![table])
}

/// Print sections with the machine header, and exit.
fn print_tables(plan: Plan, tables: Vec<Table>) -> Result<()> {
    let report = Report {
        machine: Machine::probe()?,
        source: datapath_source(&workspace()),
        plan,
        tables,
    };
    println!("{}", report.markdown());
    std::process::exit(0);
}

/// The cluster-scale sections: the gateway's rows with conntrack full (per packet), the
/// compiler and the maps at 100 nodes and 100k pods.
fn scale_tables(plan: Plan) -> Result<Vec<Table>> {
    let timings = per_packet::run_ct_full(plan).context("failed to run the full-conntrack rows")?;
    let run = scale::run(&plan);
    Ok(vec![
        per_packet_table(&timings, &plan),
        scale::table(&run),
        scale::memory_table(&run),
    ])
}

fn args() -> Result<Args> {
    let mut plan = Plan::FULL;
    let mut out = Some(workspace().join("docs").join("benchmarks.md"));
    let (mut lab, mut per_packet) = (true, true);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => plan = Plan::QUICK,
            "--no-lab" => lab = false,
            "--lab-only" => per_packet = false,
            "--out" => out = Some(it.next().context("--out needs a path")?.into()),
            "--no-write" => out = None,
            "--failover" => {
                egress_tests::netns::install_signal_teardown()?;
                let rounds = if plan.quick { 1 } else { 3 };
                print_alone(
                    plan,
                    failover::table(egress_tests::cluster::default_spec()?, rounds)?,
                )?;
            }
            "--spread" => {
                egress_tests::netns::install_signal_teardown()?;
                let spec = egress_tests::cluster::default_spec()?;
                print_alone(plan, egress_tests::bench::spread::table(spec, &plan)?)?;
            }
            "--scale" => print_tables(plan, scale_tables(plan)?)?,
            "--at-scale" => {
                egress_tests::netns::install_signal_teardown()?;
                let run = lab::at_scale::run()?;
                print_alone(plan, lab::at_scale::table(&run))?;
            }
            "--churn" => {
                // First: its shared names are not yet in the pool.
                let held = source::held();
                let run = churn::run(&plan);
                let source = source::run();
                print_tables(
                    plan,
                    vec![
                        churn::table(&run),
                        churn::churn_table(&run),
                        source::table(&source),
                        source::held_table(&held),
                    ],
                )?;
            }
            "--nodes" => {
                egress_tests::netns::install_signal_teardown()?;
                let nodes: u32 = it
                    .next()
                    .context("--nodes needs a number of nodes")?
                    .parse()
                    .context("--nodes needs a number of nodes")?;
                print_alone(plan, at_nodes(nodes)?)?;
            }
            "--probes" => print_alone(plan, probes::table(plan.quick))?,
            "--yaml" => print_alone(plan, yaml::table(&plan))?,
            "--like-for-like" => {
                egress_tests::netns::install_signal_teardown()?;
                let run = lab::run_like_for_like(&plan)?;
                let mut t = lab::like_for_like(Some(&run));
                t.notes
                    .extend(run.errors.iter().map(|e| format!("Failed step: {e}")));
                print_tables(
                    plan,
                    vec![
                        t,
                        lab::tunnel_free::table(Some(&run)),
                        lab::preloaded(Some(&run)),
                    ],
                )?;
            }
            "--hooks" => {
                egress_tests::netns::install_signal_teardown()?;
                let run = lab::hooks::run_alone(&plan)?;
                let mut t = lab::hooks::table(Some(&run));
                t.notes
                    .extend(run.errors.iter().map(|e| format!("Failed step: {e}")));
                print_alone(plan, t)?;
            }
            "--routes" => {
                egress_tests::netns::install_signal_teardown()?;
                let run = lab::run_routes(&plan)?;
                print_alone(plan, lab::routes_table(Some(&run)))?;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if !lab && !per_packet {
        bail!("--no-lab and --lab-only exclude each other\n{USAGE}");
    }
    Ok(Args {
        plan,
        out,
        lab,
        per_packet,
    })
}

/// Counted, for the probes' allocations per hello.
#[global_allocator]
static ALLOCATOR: egress_tests::alloc::Counting = egress_tests::alloc::Counting;

fn main() -> Result<()> {
    let args = args()?;
    let plan = args.plan;
    let machine = Machine::probe()?;
    eprintln!(
        "egress-bench: {} mode on {} CPUs ({}), kernel {}",
        if plan.quick { "quick" } else { "full" },
        machine.nproc,
        machine.cpu,
        machine.kernel
    );
    let mut tables = Vec::new();
    if args.per_packet {
        let timings = per_packet::run(plan).context("failed to run the per-packet benchmarks")?;
        tables.push(per_packet_table(&timings, &plan));
        let run = scale::run(&plan);
        tables.extend([scale::table(&run), scale::memory_table(&run)]);
    }
    // A lab that cannot start costs its three sections, not the per-packet report.
    let (run, lab_error) = if args.lab {
        egress_tests::netns::install_signal_teardown()?;
        match lab::run(&plan) {
            Ok(r) => (Some(r), None),
            Err(e) => {
                eprintln!("egress-bench: the lab failed: {e:#}");
                (None, Some(format!("The lab failed: {e:#}")))
            }
        }
    } else {
        (None, None)
    };
    for mut t in [
        lab::throughput(run.as_ref(), &plan)?,
        lab::like_for_like(run.as_ref()),
        lab::tunnel_free::table(run.as_ref()),
        lab::hooks::table(run.as_ref()),
        lab::preloaded(run.as_ref()),
        lab::new_flows(run.as_ref(), &plan)?,
        lab::control_plane(run.as_ref(), &plan)?,
    ] {
        t.intro.extend(lab_error.clone());
        tables.push(t);
    }
    if args.lab {
        let rounds = if plan.quick { 1 } else { 3 };
        let t = egress_tests::cluster::default_spec()
            .and_then(|spec| failover::table(spec, rounds))
            .unwrap_or_else(|e| egress_tests::bench::report::Table {
                title: "Failover".to_owned(),
                intro: vec![format!("The failover lab failed: {e:#}")],
                ..Default::default()
            });
        tables.push(t);
        let t = egress_tests::cluster::default_spec()
            .and_then(|spec| egress_tests::bench::spread::table(spec, &plan))
            .unwrap_or_else(|e| egress_tests::bench::report::Table {
                title: "Two gateways against one (egressIPs)".to_owned(),
                intro: vec![format!("The lab failed: {e:#}")],
                ..Default::default()
            });
        tables.push(t);
    }
    tables.push(probes::table(plan.quick));
    tables.push(yaml::table(&plan));
    let report = Report {
        machine,
        source: datapath_source(&workspace()),
        plan,
        tables,
    };
    let md = report.markdown();
    println!("{md}");
    if let Some(path) = args.out {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("failed to create {}", dir.display()))?;
        }
        // Hand-written sections (notes on what changed, naming their commits) stay.
        let previous = std::fs::read_to_string(&path).unwrap_or_default();
        let md = egress_tests::bench::report::keep_hand_written(&previous, &md);
        std::fs::write(&path, &md)
            .with_context(|| format!("failed to write {}", path.display()))?;
        eprintln!("egress-bench: wrote {}", path.display());
    }
    Ok(())
}
