//! End to end: the agents leave alone what they did not create (issue 14). Before any
//! agent starts, a gateway and a worker get state of their own, as the primary network's
//! CNI or EgressIP implementation would have: an extra address in an egress IP's subnet,
//! static and policy routes, an IP rule, an nftables table. That state must survive the
//! agents' start, a reconcile after a policy edit, a restart, and `egress-agent cleanup`.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use egress_tests::{
    cluster::{agent_bin, default_spec, seen, wait_until},
    lab::{Lab, Proto, addr, sample_policy},
};

/// (member, command run there to show it, what must be in the output), and how to make it.
struct Item {
    member: &'static str,
    make: &'static [&'static str],
    show: &'static [&'static str],
    expect: &'static str,
}

const ITEMS: &[Item] = &[
    Item {
        member: "gw1",
        make: &["ip", "addr", "add", "192.168.101.77/24", "dev", "sec-a"],
        show: &["ip", "-o", "addr", "show", "dev", "sec-a"],
        expect: "192.168.101.77/24",
    },
    Item {
        member: "gw1",
        make: &[
            "ip",
            "route",
            "add",
            "198.18.0.0/24",
            "via",
            "192.168.101.100",
            "dev",
            "sec-a",
        ],
        show: &["ip", "route", "show"],
        expect: "198.18.0.0/24 via 192.168.101.100 dev sec-a",
    },
    Item {
        member: "gw1",
        make: &[
            "ip",
            "route",
            "add",
            "198.18.1.0/24",
            "via",
            "192.168.102.100",
            "dev",
            "sec-b",
            "table",
            "100",
        ],
        show: &["ip", "route", "show", "table", "100"],
        expect: "198.18.1.0/24 via 192.168.102.100 dev sec-b",
    },
    Item {
        member: "gw1",
        make: &[
            "ip",
            "rule",
            "add",
            "from",
            "192.168.101.77",
            "lookup",
            "100",
            "priority",
            "1000",
        ],
        show: &["ip", "rule", "show"],
        expect: "from 192.168.101.77 lookup 100",
    },
    Item {
        member: "gw1",
        make: &["nft", "add", "table", "inet", "primary_egressip"],
        show: &["nft", "list", "tables"],
        expect: "table inet primary_egressip",
    },
    Item {
        member: "w1",
        make: &["ip", "addr", "add", "10.200.0.211/32", "dev", "eth0"],
        show: &["ip", "-o", "addr", "show", "dev", "eth0"],
        expect: "10.200.0.211/32",
    },
    Item {
        member: "w1",
        make: &[
            "ip",
            "route",
            "add",
            "198.19.0.0/16",
            "via",
            "10.200.0.1",
            "dev",
            "eth0",
        ],
        show: &["ip", "route", "show"],
        expect: "198.19.0.0/16 via 10.200.0.1 dev eth0",
    },
];

fn run(lab: &Lab, member: &str, argv: &[&str]) -> Result<String> {
    let out = lab.exec(member, argv[0], &argv[1..])?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Every item is still there; names the phase and what is missing.
fn all_there(lab: &Lab, phase: &str) -> Result<()> {
    for it in ITEMS {
        let shown = run(lab, it.member, it.show)?;
        ensure!(
            shown.contains(it.expect),
            "after {phase}: {} on {} is gone:\n{shown}",
            it.expect,
            it.member
        );
    }
    Ok(())
}

fn egress_a_works(lab: &Lab) -> bool {
    seen(lab, "w1-p1", Proto::Tcp, addr::HOST_A) == Some(addr::EGRESS_IP_A.into())
}

#[test]
fn state_the_agents_did_not_create_survives_start_reconcile_restart_and_cleanup() -> Result<()> {
    let mut lab = Lab::up(default_spec()?)?;
    for it in ITEMS {
        lab.exec(it.member, it.make[0], &it.make[1..])
            .with_context(|| format!("{:?} on {}", it.make, it.member))?;
    }
    all_there(&lab, "setup")?;
    let bin = agent_bin()?;
    lab.start_agents(&bin)?;
    wait_until(Duration::from_secs(30), || egress_a_works(&lab))
        .with_context(|| format!("agents did not converge:\n{}", lab.agent_log("gw1")))?;
    all_there(&lab, "start")?;

    // A policy edit: every agent reconciles.
    let edited = sample_policy().replace("192.168.101.0/24", "192.168.101.0/25");
    ensure!(edited != sample_policy(), "the edit changes nothing");
    lab.write_policy(&edited)?;
    std::thread::sleep(Duration::from_secs(2));
    lab.write_policy(&sample_policy())?;
    wait_until(Duration::from_secs(20), || egress_a_works(&lab))?;
    all_there(&lab, "a reconcile")?;

    for node in ["gw1", "w1"] {
        lab.stop_agent(node)?;
        lab.start_agent(node, &bin, &[])?;
    }
    wait_until(Duration::from_secs(30), || egress_a_works(&lab))?;
    all_there(&lab, "a restart")?;

    lab.stop_agents();
    for node in ["gw1", "gw2", "w1", "w2"] {
        let pins = lab.bpffs_dir(node).to_string_lossy().into_owned();
        let out = lab
            .ns(node)?
            .exec_unchecked(&bin.to_string_lossy(), &["cleanup", "--bpffs-dir", &pins])?;
        ensure!(
            out.status.success(),
            "cleanup on {node}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    all_there(&lab, "cleanup")?;
    Ok(())
}
