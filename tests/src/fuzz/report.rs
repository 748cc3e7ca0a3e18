//! A run's figures and failures as people read them.

use std::fmt::Write as _;

use super::{
    Failure, ProgramReport, Report,
    check::{reason_name, verdict_name},
    hex,
};
use crate::bench::report::thousands as n;

pub fn summary(r: &Report) -> String {
    let mut s = format!("fuzz: seed {:#018x}\n", r.seed);
    for p in &r.programs {
        program(&mut s, p);
    }
    let _ = writeln!(s, "fuzz: {} failures", n(r.failed()));
    s
}

fn program(s: &mut String, p: &ProgramReport) {
    let _ = writeln!(
        s,
        "{}: {} packets in {:.1} s ({} packets/s); failures {}",
        p.prog.name(),
        n(p.packets),
        p.elapsed.as_secs_f64(),
        n(p.packets_per_second() as u64),
        n(p.failed)
    );
    let [ok, shot, redirect] = p.verdicts;
    let _ = writeln!(
        s,
        "  verdicts: pass {}, drop {}, redirect {}",
        n(ok),
        n(shot),
        n(redirect)
    );
    let [valid, mutated, garbage] = p.kinds;
    let _ = writeln!(
        s,
        "  packets: well-formed {}, mutated {}, garbage {}",
        n(valid),
        n(mutated),
        n(garbage)
    );
    let _ = writeln!(s, "  reasons hit ({}):", p.reasons.len());
    for (r, count) in &p.reasons {
        let _ = writeln!(s, "    {:<24} {:>12}", reason_name(*r), n(*count));
    }
    if p.swept.0 > 0 {
        let _ = writeln!(
            s,
            "  sweeper: {} walks removed {} entries",
            n(p.swept.0),
            n(p.swept.1 as u64)
        );
    }
    for problem in &p.sweep_problems {
        let _ = writeln!(s, "FAILED {}, sweeper: {problem}", p.prog.name());
    }
    for f in &p.failures {
        s.push_str(&failure(f));
    }
}

/// A failure with its seed, case and packet, and how to keep it as a table test.
pub fn failure(f: &Failure) -> String {
    let mut s = String::new();
    let name = f.prog.name();
    let _ = writeln!(
        s,
        "FAILED {name}, seed {:#018x}, case {}: {}",
        f.seed, f.index, f.problem
    );
    let _ = writeln!(
        s,
        "  in  ({:?}, tunnel {:?}): {}",
        f.input.dev,
        f.input.tunnel,
        hex(&f.input.frame)
    );
    let verdict = f.verdict.map_or("test_run error", verdict_name);
    let counted: Vec<String> = f.delta.iter().map(|d| reason_name(d.0)).collect();
    let _ = writeln!(s, "  out ({verdict}, counted {counted:?}): {}", hex(&f.out));
    let _ = writeln!(
        s,
        "  again: cargo xtask fuzz --seed {:#x} --packets {} (or egress_tests::fuzz::case({:#x}, Prog::{:?}, {}) for the packet alone)",
        f.seed,
        f.index + 1,
        f.seed,
        f.prog,
        f.index
    );
    let _ = writeln!(
        s,
        "  as a table test (tests/tests/datapath_v4.rs or _v6.rs): a case whose step is\n    step({name:?}, Dev::..., {:?}, &any_packet).raw(egress_tests::fuzz::unhex(\"{}\")) with the verdict, frame and counters it must give",
        f.input.tunnel,
        hex(&f.input.frame)
    );
    s
}
