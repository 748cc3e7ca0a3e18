//! The version main builds never claims a release it is not (docs/operations.md,
//! "Releasing"): with changes under CHANGELOG.md's "Unreleased" it is the next release's
//! pre-release (`X.Y.Z-dev`), above every release the changelog lists, and a minor (from
//! 1.0 a major) release above the last one once "Unreleased" says how to upgrade; a plain
//! release has its own heading and nothing unreleased. The image the manifests name is
//! tagged with that version. No kubectl, no root: files only.

use std::path::Path;

fn workspace() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn read(file: &str) -> String {
    let p = workspace().join(file);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The workspace's version (`[workspace.package] version`, which this crate inherits).
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// `X.Y.Z` and its pre-release (`dev` of `0.3.0-dev`), if any.
#[derive(Debug, PartialEq)]
struct Version {
    release: (u64, u64, u64),
    pre: Option<String>,
}

fn version(text: &str) -> Result<Version, String> {
    let (release, pre) = match text.split_once('-') {
        Some((r, pre)) => (r, Some(pre.to_owned())),
        None => (text, None),
    };
    let numbers: Vec<u64> = release
        .split('.')
        .map(|n| {
            n.parse()
                .map_err(|_| format!("{text:?} is not X.Y.Z[-pre]"))
        })
        .collect::<Result<_, _>>()?;
    match numbers[..] {
        [x, y, z] => Ok(Version {
            release: (x, y, z),
            pre,
        }),
        _ => Err(format!("{text:?} is not X.Y.Z[-pre]")),
    }
}

/// What CHANGELOG.md says: the entries under "Unreleased", whether they include an
/// "Upgrading from" section (changes an operator must act on), and the releases listed.
#[derive(Debug, Default)]
struct Changelog {
    unreleased: Vec<String>,
    upgrade_notes: bool,
    releases: Vec<(u64, u64, u64)>,
}

fn changelog(text: &str) -> Result<Changelog, String> {
    let mut out = Changelog::default();
    let mut in_unreleased = false;
    for line in text.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            in_unreleased = heading == "Unreleased";
            if !in_unreleased {
                out.releases.push(version(heading)?.release);
            }
        } else if in_unreleased {
            if line.starts_with("### Upgrading from") {
                out.upgrade_notes = true;
            } else if !line.trim().is_empty() && !line.starts_with('#') {
                out.unreleased.push(line.to_owned());
            }
        }
    }
    Ok(out)
}

fn dotted((x, y, z): (u64, u64, u64)) -> String {
    format!("{x}.{y}.{z}")
}

/// Whether `version` is one main may build, given its changelog.
fn judge(version_text: &str, changelog_text: &str) -> Result<(), String> {
    let v = version(version_text)?;
    let log = changelog(changelog_text)?;
    let released = log.releases.contains(&v.release);
    let latest = log.releases.iter().max().copied();
    let Some(pre) = &v.pre else {
        if let Some(first) = log.unreleased.first() {
            return Err(format!(
                "{version_text} is a release, but CHANGELOG.md lists changes under \
                 \"Unreleased\" ({first:?}, ...): a release has them under its own heading, \
                 main between releases builds the next version with -dev"
            ));
        }
        if !released {
            return Err(format!(
                "{version_text} is a release without a heading `## {version_text}` in \
                 CHANGELOG.md"
            ));
        }
        return Ok(());
    };
    if pre.is_empty() {
        return Err(format!("{version_text:?}: an empty pre-release"));
    }
    if released {
        return Err(format!(
            "{version_text}: {} is released already (CHANGELOG.md has its heading): main \
             builds the next version with -dev",
            dotted(v.release)
        ));
    }
    let Some(latest) = latest else {
        return Ok(());
    };
    if v.release <= latest {
        return Err(format!(
            "{version_text} is not above the latest release, {}",
            dotted(latest)
        ));
    }
    let breaking_floor = match latest {
        (0, y, _) => (0, y + 1, 0),
        (x, _, _) => (x + 1, 0, 0),
    };
    if log.upgrade_notes && v.release < breaking_floor {
        return Err(format!(
            "{version_text}: \"Unreleased\" has an \"Upgrading from\" section (changes an \
             operator must act on), so the next release is at least {}, not a patch of {}",
            dotted(breaking_floor),
            dotted(latest)
        ));
    }
    Ok(())
}

#[test]
fn main_claims_no_release_it_is_not() {
    judge(VERSION, &read("CHANGELOG.md")).unwrap();
}

/// The rule on made-up changelogs: each way of lying is refused.
#[test]
fn each_way_a_version_can_lie_is_refused() {
    let released = "# Changelog\n\n## 0.2.0\n\n* b\n\n## 0.1.0\n\n* a\n";
    let unreleased = "# Changelog\n\n## Unreleased\n\n### Added\n\n* c\n\n## 0.2.0\n\n* b\n";
    let breaking = "# Changelog\n\n## Unreleased\n\n### Upgrading from 0.2.0\n\n* d\n\n\
                    ## 0.2.0\n\n* b\n";
    let empty_unreleased = "# Changelog\n\n## Unreleased\n\n## 0.2.0\n\n* b\n";
    for (version, log, refusal) in [
        ("0.2.0", released, None),
        ("0.2.0", empty_unreleased, None),
        ("0.2.1-dev", unreleased, None),
        ("0.3.0-dev", breaking, None),
        ("1.0.0-rc.1", breaking, None),
        (
            "0.2.0",
            unreleased,
            Some("lists changes under \"Unreleased\""),
        ),
        (
            "0.3.0",
            unreleased,
            Some("lists changes under \"Unreleased\""),
        ),
        ("0.3.0", released, Some("without a heading `## 0.3.0`")),
        ("0.2.0-dev", unreleased, Some("0.2.0 is released already")),
        (
            "0.1.5-dev",
            unreleased,
            Some("not above the latest release, 0.2.0"),
        ),
        (
            "0.2.1-dev",
            breaking,
            Some("at least 0.3.0, not a patch of 0.2.0"),
        ),
        ("0.3-dev", unreleased, Some("is not X.Y.Z[-pre]")),
    ] {
        let got = judge(version, log);
        match (refusal, got) {
            (None, Ok(())) => {}
            (Some(want), Err(e)) => assert!(e.contains(want), "{version}: {e}"),
            (want, got) => panic!("{version}: expected {want:?}, got {got:?}"),
        }
    }
    assert!(judge("2.0.0-dev", &breaking.replace("0.2.0", "1.4.0")).is_ok());
    let e = judge("1.5.0-dev", &breaking.replace("0.2.0", "1.4.0")).unwrap_err();
    assert!(e.contains("at least 2.0.0"), "{e}");
}

/// The manifests name the image `cargo xtask image` builds from this tree: tagged with the
/// version (an OCI tag: no `+`), in `deploy/image/kustomization.yaml` and every
/// `egress-agent:<version>` the docs and kustomizations show.
#[test]
fn the_image_tags_are_the_version() {
    let tag_ok = |t: &str| {
        !t.is_empty()
            && t.len() <= 128
            && !t.starts_with(['.', '-'])
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
    };
    assert!(tag_ok(VERSION), "{VERSION} is not an OCI image tag");
    let kustomization: serde_json::Value =
        serde_yaml_ng::from_str(&read("deploy/image/kustomization.yaml")).unwrap();
    let image = kustomization["images"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "egress-agent")
        .expect("the kustomization names the image egress-agent");
    assert_eq!(image["newTag"], VERSION);
    for file in [
        "README.md",
        "docs/openshift.md",
        "docs/operations.md",
        "deploy/image/kustomization.yaml",
        "deploy/base/kustomization.yaml",
        "deploy/openshift/kustomization.yaml",
        "deploy/uninstall/kustomization.yaml",
    ] {
        let text = read(file);
        for (i, _) in text.match_indices("egress-agent:") {
            let tag: String = text[i + "egress-agent:".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || "_.-".contains(*c))
                .collect();
            if tag.starts_with(|c: char| c.is_ascii_digit()) {
                assert_eq!(tag, VERSION, "{file}: egress-agent:{tag}");
            }
        }
    }
}
