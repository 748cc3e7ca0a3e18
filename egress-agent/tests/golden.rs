//! Golden tests of the compiler: each directory under `tests/golden/` holds a YAML state
//! directory (`state/`) and what the compiler makes of it (`expected.txt`): the holders,
//! the policy statuses and problems (the same on every node), then each node's desired
//! datapath state. A change to the compiler shows as a diff of that file.
//!
//! `EGRESS_UPDATE_GOLDEN=1 cargo test -p egress-agent --test golden` rewrites the files;
//! review the diff before committing it.

use std::{
    fs,
    path::{Path, PathBuf},
};

use egress_agent::{
    compiler::{compile, render},
    source::yaml,
};

fn cases() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut dirs: Vec<PathBuf> = fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("state").is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// The whole rendering of one state directory.
fn rendering(state: &Path) -> String {
    let snapshot = yaml::load_dir(state);
    assert!(
        snapshot.errors.is_empty(),
        "{}: {:?}",
        state.display(),
        snapshot.errors
    );
    let view = snapshot.view;
    let mut nodes: Vec<String> = view
        .nodes
        .iter()
        .filter_map(|n| n.metadata.name.clone())
        .collect();
    nodes.sort();
    let mut out = String::from("# the cluster (the same on every node)\n");
    out += &render::cluster(&compile(&view, nodes.first().map_or("", String::as_str)));
    for node in &nodes {
        out += &format!("\n# node {node}\n");
        out += &render::node(&compile(&view, node));
    }
    out
}

#[test]
fn the_compiler_renders_each_state_directory_as_expected() {
    let update = std::env::var_os("EGRESS_UPDATE_GOLDEN").is_some();
    let mut failed = Vec::new();
    for dir in cases() {
        let got = rendering(&dir.join("state"));
        let path = dir.join("expected.txt");
        if update {
            fs::write(&path, &got).unwrap();
            continue;
        }
        let want = fs::read_to_string(&path).unwrap_or_default();
        if got != want {
            let first = got
                .lines()
                .zip(want.lines())
                .position(|(g, w)| g != w)
                .unwrap_or_else(|| got.lines().count().min(want.lines().count()));
            failed.push(format!(
                "{}: differs from line {}:\n  got:      {}\n  expected: {}",
                path.display(),
                first + 1,
                got.lines().nth(first).unwrap_or("(end)"),
                want.lines().nth(first).unwrap_or("(end)")
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "{}\n(if the change is intended: EGRESS_UPDATE_GOLDEN=1 cargo test -p egress-agent \
         --test golden, then review the diff)",
        failed.join("\n")
    );
}
