//! A golden case's `script.txt`: commands, one a line, then the YAML files they apply,
//! each after a `-- name --` line (the txtar layout):
//!
//! ```text
//! # gw-2 holds 198.51.100.10; it goes NotReady.
//! render
//! node-notready gw-2
//! render
//! apply broken.yaml
//! render
//!
//! -- broken.yaml --
//! apiVersion: egress.dev/v1alpha1
//! kind: EgressGatewayPolicy
//! ...
//! ```
//!
//! Blank lines and lines starting with `#` are skipped. The commands:
//!
//! | command | what changes |
//! |---|---|
//! | `render` | nothing: appends the rendering of the latest reconcile to the output |
//! | `apply FILE` | the objects of section `FILE` replace those of the same kind and name, or are added |
//! | `delete KIND [NAMESPACE/]NAME` | that object goes (`Pod` and `NetworkPolicy` take a namespace) |
//! | `node-ready NODE`, `node-notready NODE` | the Node's `Ready` condition |
//! | `peer-dead NODE`, `peer-alive NODE` | whether the agents' probes hear NODE |
//! | `routes NODE IFACE [PREFIX...]` | the routes NODE's EgressNode publishes out of IFACE |
//! | `cluster-cidr [PREFIX...]` | the agents' `--cluster-cidr` |
//! | `wait SECONDS` | the script's clock moves on (handovers end, lingers run out) |
//! | `answer IP`, `no-answer IP` | whether another host answers the agents' probes for IP |

use std::collections::BTreeMap;

use ipnet::IpNet;

/// One edit of the cluster, or `Render`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    Render,
    /// The name of a file section, and its text.
    Apply {
        file: String,
        text: String,
    },
    Delete {
        kind: String,
        name: String,
    },
    NodeReady {
        node: String,
        ready: bool,
    },
    Peer {
        node: String,
        alive: bool,
    },
    Routes {
        node: String,
        interface: String,
        prefixes: Vec<IpNet>,
    },
    ClusterCidr(Vec<IpNet>),
    /// The clock moves on.
    Wait(std::time::Duration),
    /// Whether another host answers for the address.
    Answer {
        ip: std::net::IpAddr,
        answered: bool,
    },
}

/// A command and where it was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// 1-based line in `script.txt`.
    pub line: usize,
    /// The line as written.
    pub text: String,
    pub command: Command,
}

/// Parse `text`; errors name the line.
pub fn parse(text: &str) -> Result<Vec<Step>, String> {
    let (commands, files) = split_files(text)?;
    commands
        .into_iter()
        .map(|(line, text)| {
            let command = command(&text, &files).map_err(|e| format!("line {line}: {e}"))?;
            Ok(Step {
                line,
                text,
                command,
            })
        })
        .collect()
}

/// The command lines (numbered, without blanks and comments), and the file sections by
/// name.
type Split = (Vec<(usize, String)>, BTreeMap<String, String>);

fn split_files(text: &str) -> Result<Split, String> {
    let mut commands = Vec::new();
    let mut files: BTreeMap<String, String> = BTreeMap::new();
    let mut current: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        let header = line
            .strip_prefix("-- ")
            .and_then(|l| l.strip_suffix(" --"))
            .map(str::trim);
        if let Some(name) = header {
            if files.insert(name.to_owned(), String::new()).is_some() {
                return Err(format!("line {}: file {name} is written twice", i + 1));
            }
            current = Some(name.to_owned());
            continue;
        }
        match &current {
            Some(name) => {
                let file = files.entry(name.clone()).or_default();
                file.push_str(line);
                file.push('\n');
            }
            None if line.trim().is_empty() || line.trim_start().starts_with('#') => {}
            None => commands.push((i + 1, line.trim().to_owned())),
        }
    }
    Ok((commands, files))
}

fn prefixes(words: &[&str]) -> Result<Vec<IpNet>, String> {
    words
        .iter()
        .map(|w| w.parse().map_err(|e| format!("prefix {w:?}: {e}")))
        .collect()
}

fn command(text: &str, files: &BTreeMap<String, String>) -> Result<Command, String> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let one = |what: &str| match words.as_slice() {
        [_, x] => Ok((*x).to_owned()),
        _ => Err(format!("{} takes one {what}", words[0])),
    };
    Ok(match words[0] {
        "render" if words.len() == 1 => Command::Render,
        "apply" => {
            let file = one("file")?;
            let text = files
                .get(&file)
                .ok_or_else(|| format!("no section -- {file} -- in the script"))?
                .clone();
            Command::Apply { file, text }
        }
        "delete" => match words.as_slice() {
            [_, kind, name] => Command::Delete {
                kind: (*kind).to_owned(),
                name: (*name).to_owned(),
            },
            _ => return Err("delete takes a kind and a name".to_owned()),
        },
        "node-ready" | "node-notready" => Command::NodeReady {
            node: one("node")?,
            ready: words[0] == "node-ready",
        },
        "peer-dead" | "peer-alive" => Command::Peer {
            node: one("node")?,
            alive: words[0] == "peer-alive",
        },
        "routes" if words.len() >= 3 => Command::Routes {
            node: words[1].to_owned(),
            interface: words[2].to_owned(),
            prefixes: prefixes(&words[3..])?,
        },
        "cluster-cidr" => Command::ClusterCidr(prefixes(&words[1..])?),
        "wait" => {
            let secs = one("number of seconds")?;
            let secs: u64 = secs.parse().map_err(|e| format!("wait {secs:?}: {e}"))?;
            Command::Wait(std::time::Duration::from_secs(secs))
        }
        "answer" | "no-answer" => {
            let ip = one("address")?;
            Command::Answer {
                ip: ip.parse().map_err(|e| format!("address {ip:?}: {e}"))?,
                answered: words[0] == "answer",
            }
        }
        _ => return Err(format!("unknown command {text:?}")),
    })
}

#[test]
fn a_script_reads_as_commands_and_the_files_they_apply() {
    let text = "# comment\nrender\n\napply p.yaml\nroutes gw-1 ens224 10.1.0.0/16\n\
                -- p.yaml --\nkind: X\n";
    let steps = parse(text).unwrap();
    let commands: Vec<&Command> = steps.iter().map(|s| &s.command).collect();
    assert_eq!(
        commands,
        [
            &Command::Render,
            &Command::Apply {
                file: "p.yaml".to_owned(),
                text: "kind: X\n".to_owned()
            },
            &Command::Routes {
                node: "gw-1".to_owned(),
                interface: "ens224".to_owned(),
                prefixes: vec!["10.1.0.0/16".parse().unwrap()],
            },
        ]
    );
    assert_eq!(steps[2].line, 5);
    assert_eq!(
        parse("apply q.yaml\n").unwrap_err(),
        "line 1: no section -- q.yaml -- in the script"
    );
    assert_eq!(
        parse("\nrender all\n").unwrap_err(),
        "line 2: unknown command \"render all\""
    );
    let timed: Vec<Command> = parse("wait 2\nno-answer 192.0.2.9\n")
        .unwrap()
        .into_iter()
        .map(|s| s.command)
        .collect();
    assert_eq!(
        timed,
        [
            Command::Wait(std::time::Duration::from_secs(2)),
            Command::Answer {
                ip: "192.0.2.9".parse().unwrap(),
                answered: false
            },
        ]
    );
}
