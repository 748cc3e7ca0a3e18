//! Golden tests of the compiler, as scripts of edits: each directory under
//! `tests/golden/cases/` holds a YAML state directory (`state/`, read as `--state-dir`
//! is), a script of edits (`script.txt`, see `golden/script.rs`) and what the agents make
//! of the cluster at each `render` of the script (`expected.txt`): the interfaces'
//! numbering, holders, policy statuses and problems (the same on every node), then each
//! node's desired state, what its agent holds, waits for and refused, and the map
//! entries it serves (`MapState::from_desired` of the desired state with what lingers).
//! The first render shows everything; each later one shows the lines that changed since
//! the previous render (`-` gone, `+` new), section by section. `golden/cluster.rs` says
//! how the agents are played (their passes through a fake address layer, what they
//! publish between compiles, interface indexes).
//!
//! `EGRESS_UPDATE_GOLDEN=1 cargo test -p egress-agent --test golden` rewrites the files;
//! review the diff before committing it.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use egress_agent::source::yaml;

#[path = "golden/cluster.rs"]
mod cluster;
#[path = "golden/script.rs"]
mod script;

use cluster::{Cluster, Section};

fn cases() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/cases");
    let mut dirs: Vec<PathBuf> = fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("failed to read {}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// The output of one case: its state directory, then its script run step by step.
fn run_case(dir: &Path) -> Result<String, String> {
    let state = dir.join("state");
    let snapshot = yaml::load_dir(&state);
    if let Some(e) = snapshot.errors.first() {
        return Err(format!("failed to load {}: {e}", state.display()));
    }
    let path = dir.join("script.txt");
    let text =
        fs::read_to_string(&path).map_err(|e| format!("failed to read {}: {e}", path.display()))?;
    let steps = script::parse(&text).map_err(|e| format!("script.txt {e}"))?;
    let mut cluster = Cluster::new(snapshot.view);
    let mut out = String::new();
    let mut previous: Option<Vec<Section>> = None;
    let mut since: Vec<&str> = Vec::new();
    let mut renders = 0;
    for step in &steps {
        if step.command != script::Command::Render {
            cluster
                .run(&step.command)
                .map_err(|e| format!("script.txt line {}: {e}", step.line))?;
            since.push(&step.text);
            continue;
        }
        renders += 1;
        let now = cluster.render();
        out += &header(renders, step.line, &since);
        out += &match &previous {
            None => full(&now),
            Some(before) => changes(before, &now),
        };
        previous = Some(now);
        since.clear();
    }
    Ok(out)
}

/// The line that opens render `n`, written at `line` of the script, after the edits
/// `since` the previous one.
fn header(n: usize, line: usize, since: &[&str]) -> String {
    let after = if since.is_empty() {
        String::new()
    } else {
        format!(", after: {}", since.join("; "))
    };
    let blank = if n > 1 { "\n" } else { "" };
    format!("{blank}== render {n} (script line {line}){after}\n")
}

fn full(sections: &[Section]) -> String {
    let mut s = String::new();
    for sec in sections {
        s += &format!("# {}\n", sec.title);
        for l in &sec.lines {
            s += &format!("{l}\n");
        }
    }
    s
}

/// The lines of each section that went (`-`) or came (`+`) from `before` to `now`, in
/// the order each rendering lists them; unchanged sections are left out.
fn changes(before: &[Section], now: &[Section]) -> String {
    let old: BTreeMap<&str, &[String]> = before
        .iter()
        .map(|s| (s.title.as_str(), s.lines.as_slice()))
        .collect();
    let new: BTreeMap<&str, &[String]> = now
        .iter()
        .map(|s| (s.title.as_str(), s.lines.as_slice()))
        .collect();
    let gone_sections = before
        .iter()
        .filter(|s| !new.contains_key(s.title.as_str()));
    let mut s = String::new();
    for sec in now.iter().chain(gone_sections) {
        let a = old.get(sec.title.as_str()).copied().unwrap_or_default();
        let b = new.get(sec.title.as_str()).copied().unwrap_or_default();
        let removed: Vec<&String> = a.iter().filter(|l| !b.contains(l)).collect();
        let added: Vec<&String> = b.iter().filter(|l| !a.contains(l)).collect();
        if removed.is_empty() && added.is_empty() {
            continue;
        }
        s += &format!("# {}\n", sec.title);
        for l in removed {
            s += &format!("- {l}\n");
        }
        for l in added {
            s += &format!("+ {l}\n");
        }
    }
    if s.is_empty() {
        s += "(no change)\n";
    }
    s
}

/// Why `got` is not `want` (the output of case `case`): the render and line where they
/// first differ, both lines; `None` if they are the same.
fn difference(case: &str, got: &str, want: &str) -> Option<String> {
    if got == want {
        return None;
    }
    let (g, w): (Vec<&str>, Vec<&str>) = (got.lines().collect(), want.lines().collect());
    let first = (0..g.len().max(w.len()))
        .find(|&i| g.get(i) != w.get(i))
        .unwrap_or(g.len());
    let render = g[..first.min(g.len())]
        .iter()
        .rev()
        .find(|l| l.starts_with("== render "))
        .map_or("before the first render", |l| l.trim_start_matches("== "));
    Some(format!(
        "case {case}: {render}: expected.txt line {} differs:\n  got:      {}\n  expected: {}",
        first + 1,
        g.get(first).unwrap_or(&"(end of output)"),
        w.get(first).unwrap_or(&"(end of file)"),
    ))
}

#[test]
fn every_golden_script_renders_as_expected() {
    let update = std::env::var_os("EGRESS_UPDATE_GOLDEN").is_some();
    let mut failed = Vec::new();
    let all = cases();
    assert!(!all.is_empty(), "no golden cases found");
    for dir in all {
        let case = dir.file_name().unwrap().to_string_lossy().into_owned();
        let got = match run_case(&dir) {
            Ok(got) => got,
            Err(e) => {
                failed.push(format!("case {case}: {e}"));
                continue;
            }
        };
        let path = dir.join("expected.txt");
        if update {
            fs::write(&path, &got).unwrap();
            continue;
        }
        match fs::read_to_string(&path) {
            Err(e) => failed.push(format!("case {case}: failed to read expected.txt: {e}")),
            Ok(want) => failed.extend(difference(&case, &got, &want)),
        }
    }
    assert!(
        failed.is_empty(),
        "{}\n(if the change is intended: EGRESS_UPDATE_GOLDEN=1 cargo test -p egress-agent \
         --test golden, then review the diff)",
        failed.join("\n")
    );
}

#[test]
fn a_changed_expected_file_fails_naming_the_case_render_and_line() {
    let got = "== render 1 (script line 1)\n# cluster\nholder a\n\n\
               == render 2 (script line 3), after: peer-dead gw-2\n# cluster\n- holder a\n";
    assert_eq!(difference("c", got, got), None);
    let want = got.replace("- holder a", "- holder b");
    assert_eq!(
        difference("c", got, &want).unwrap(),
        "case c: render 2 (script line 3), after: peer-dead gw-2: expected.txt line 7 \
         differs:\n  got:      - holder a\n  expected: - holder b"
    );
    let shorter = got.replace("- holder a\n", "");
    assert!(
        difference("c", got, &shorter)
            .unwrap()
            .ends_with("line 7 differs:\n  got:      - holder a\n  expected: (end of file)")
    );
}

#[test]
fn a_later_render_shows_only_what_changed() {
    let sec = |title: &str, lines: &[&str]| Section {
        title: title.to_owned(),
        lines: lines.iter().map(|l| (*l).to_owned()).collect(),
    };
    let before = [sec("cluster", &["a", "b"]), sec("node x", &["n"])];
    let now = [sec("cluster", &["a", "c"]), sec("node x", &["n"])];
    assert_eq!(changes(&before, &now), "# cluster\n- b\n+ c\n");
    assert_eq!(changes(&now, &now), "(no change)\n");
    assert_eq!(changes(&now, &now[..1]), "# node x\n- n\n");
}
