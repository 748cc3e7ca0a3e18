//! A short packet fuzzing run in `cargo xtask test`: 20k random and mutated packets per
//! program (`from_underlay`'s are `from_tunnel`'s in VXLAN) through `BPF_PROG_TEST_RUN` under a fixed seed, and as many under a new seed
//! each run (printed, so that a failure can be run again with `cargo xtask fuzz --seed`).
//! The properties are `egress_tests::fuzz::check`'s; `cargo xtask fuzz --packets 1000000`
//! is the long run (docs/reliability.md).

use egress_tests::fuzz::{self, Options, Prog, report};

const PACKETS: u64 = 20_000;
const FIXED_SEED: u64 = 0x5ee_d0fe_9e55;

fn fuzz_with(seed: u64) -> fuzz::Report {
    fuzz_options(Options {
        packets: PACKETS,
        seed,
        full_conntrack: false,
        sweeps: false,
    })
}

fn fuzz_options(opts: Options) -> fuzz::Report {
    let r = fuzz::run(opts);
    let summary = report::summary(&r);
    eprint!("{summary}");
    assert_eq!(r.failed(), 0, "packets broke a property:\n{summary}");
    for p in &r.programs {
        assert_eq!(p.packets, opts.packets, "{}", p.prog.name());
    }
    r
}

/// Under the fixed seed, also: each program reaches its paths beyond the parsers (reasons
/// only a packet that parsed and matched the node's maps can count).
#[test]
fn fixed_seed_keeps_every_property_past_the_parsers() {
    use egress_common::counters::reason::*;
    let r = fuzz_with(FIXED_SEED);
    let want: &[(Prog, &[u32])] = &[
        (
            Prog::FromPod,
            &[
                TUNNELED,
                LOCAL_GATEWAY,
                SNAT_NEW,
                FORWARDED,
                EXCLUDED,
                DROP_NO_GATEWAY,
            ],
        ),
        (
            Prog::FromTunnel,
            &[
                SNAT_NEW,
                SNAT_HIT,
                FORWARDED,
                RETURN_DELIVERED,
                TO_POD_DEVICE,
                DROP_SPOOFED_SOURCE,
            ],
        ),
        (
            Prog::FromSecondary,
            &[
                REVERSE_NAT,
                TO_POD_DEVICE,
                RETURN_TUNNELED,
                ICMP_ERROR_XLATED,
                DROP_NO_CONNTRACK,
            ],
        ),
        (
            Prog::FromUnderlay,
            &[
                SNAT_NEW,
                FORWARDED,
                RETURN_DELIVERED,
                TO_POD_DEVICE,
                DROP_SPOOFED_SOURCE,
            ],
        ),
    ];
    for (prog, reasons) in want {
        counted(&r, *prog, reasons, "the generator no longer reaches it");
    }
}

/// `prog`'s report in `r`.
fn program(r: &fuzz::Report, prog: Prog) -> &fuzz::ProgramReport {
    r.programs
        .iter()
        .find(|p| p.prog == prog)
        .expect("program ran")
}

/// Asserts that `prog` counted each of `reasons` in `r` (else: `why`).
fn counted(r: &fuzz::Report, prog: Prog, reasons: &[u32], why: &str) {
    let p = program(r, prog);
    for reason in reasons {
        assert!(
            p.reasons.contains_key(reason),
            "{} never counted {}: {why}\n{}",
            prog.name(),
            fuzz::check::reason_name(*reason),
            report::summary(r)
        );
    }
}

#[test]
fn new_seed_keeps_every_property() {
    let seed = fuzz::random_seed();
    eprintln!("fuzz: new seed {seed:#018x} (cargo xtask fuzz --seed {seed:#x} runs it again)");
    fuzz_with(seed);
}

/// With both conntrack maps full of other flows from the start, so that every new flow
/// evicts one (now and then a half of the node's own): every property still holds, and
/// replies still find their flows (the node's flows are written again every 4,096
/// packets) or are dropped for want of one, never misrouted.
#[test]
fn a_full_conntrack_map_keeps_every_property() {
    use egress_common::counters::reason::*;
    let r = fuzz_options(Options {
        packets: PACKETS,
        seed: FIXED_SEED ^ 0xf011,
        full_conntrack: true,
        sweeps: false,
    });
    counted(
        &r,
        Prog::FromSecondary,
        &[REVERSE_NAT, DROP_NO_CONNTRACK],
        "with the maps full",
    );
}

/// With the agent's sweeper walking conntrack every 1,024 packets, its clock from none to
/// six hours ahead by turns: the packets after a walk meet flows whose entries it judged
/// (a reply to a removed flow is dropped, never misrouted), every property holds, and no
/// walk leaves what the sweeper itself would remove.
#[test]
fn the_sweeper_between_packets_keeps_every_property() {
    use egress_common::counters::reason::*;
    let r = fuzz_options(Options {
        packets: PACKETS,
        seed: FIXED_SEED ^ 0x5eef,
        full_conntrack: false,
        sweeps: true,
    });
    let swept = program(&r, Prog::FromSecondary).swept;
    assert!(
        swept.0 >= 19 && swept.1 > 0,
        "the sweeper walked: {swept:?}"
    );
    counted(
        &r,
        Prog::FromSecondary,
        &[REVERSE_NAT, DROP_NO_CONNTRACK],
        "between the sweeps",
    );
}
