//! `egress-agent cleanup`: uninstall what an agent set up on this node (its TCX links or
//! tc filters, pinned maps, dedicated egress IPs and tunnel device), never while an agent
//! runs on the same pin directory. SIGTERM, by contrast, leaves all of it to the next
//! agent. Of a device's tc filters only ours go (our name, handle and kind): a CNI's
//! filters and qdiscs stay.

use std::{fs, net::IpAddr, path::Path};

use super::{
    attach::{self, records},
    dump,
    hook::RecordName,
    lock, tc,
};
use crate::iface;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("refusing to clean up: {0}")]
    Running(#[source] lock::Error),
    #[error(
        "refusing to clean up: this process lacks CAP_NET_ADMIN (detaching tc filters, \
         deleting the tunnel device and the egress IPs), so it would stop halfway: add it \
         to the container's securityContext.capabilities.add \
         (deploy/uninstall/daemonset.yaml), or run as root"
    )]
    NoNetAdmin,
    #[error(transparent)]
    Datapath(#[from] super::Error),
    #[error(transparent)]
    Iface(#[from] iface::Error),
    #[error("failed to remove {}: {source}", path.display())]
    Remove {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Remove everything the agent of `pin_dir` created, calling `say` with one line per thing
/// removed: dedicated egress IPs (read from the pinned maps first), TCX links (detached as
/// their pins go), map pins, the pin directory, the tunnel device `tunnel_device` and the
/// lock file. Runs on the current tokio runtime's network namespace.
pub async fn uninstall(
    pin_dir: &Path,
    tunnel_device: &str,
    mut say: impl FnMut(String),
) -> Result<usize, Error> {
    let held = lock::PinLock::acquire(pin_dir).map_err(Error::Running)?;
    if !holds_net_admin(&fs::read_to_string("/proc/self/status").unwrap_or_default()) {
        return Err(Error::NoNetAdmin);
    }
    let nl = iface::Netlink::new()?;
    let mut removed = 0;
    let mut note = |line: String| {
        removed += 1;
        say(line);
    };
    // What the maps say before they go: the addresses the agent added.
    let egress_ips = dump::dedicated_egress_ips(pin_dir)?;
    for name in records(pin_dir) {
        attach::remove_record(pin_dir, &name)?;
        let kind = if name.starts_with("tc-") {
            "tc filter record"
        } else {
            "link pin"
        };
        note(format!("detached {} ({kind} {name})", describe_link(&name)));
    }
    // Filters of ours that no record names (a record lost with its directory).
    for i in nl.interfaces().await? {
        for f in tc::filters(i.ifindex, false).unwrap_or_default() {
            let Some(program) = f.our_program(f.priority) else {
                continue;
            };
            attach::remove_tc_filter(i.ifindex, program, f.priority, false).map_err(|source| {
                Error::Remove {
                    path: format!("tc filter {program} on {}", i.name).into(),
                    source,
                }
            })?;
            note(format!(
                "detached {program} from {} (tc filter, priority {}, no record)",
                i.name, f.priority
            ));
        }
    }
    remove_egress_ips(&nl, &egress_ips, &mut note).await?;
    if pin_dir.is_dir() {
        let mut rest: Vec<_> = fs::read_dir(pin_dir)
            .map_err(|source| Error::Remove {
                path: pin_dir.to_owned(),
                source,
            })?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        rest.sort();
        for name in rest {
            remove(&pin_dir.join(&name))?;
            note(format!("removed map pin {name}"));
        }
        fs::remove_dir(pin_dir).map_err(|source| Error::Remove {
            path: pin_dir.to_owned(),
            source,
        })?;
        note(format!("removed pin directory {}", pin_dir.display()));
    }
    if nl.delete_vxlan(tunnel_device).await? {
        note(format!("removed tunnel device {tunnel_device}"));
    }
    // Last, while still holding it: no agent started meanwhile.
    let _ = fs::remove_file(held.beside(crate::agent::accepted::FILE));
    let _ = fs::remove_file(held.path());
    Ok(removed)
}

/// Remove each dedicated egress IP from whichever interface has it.
async fn remove_egress_ips(
    nl: &iface::Netlink,
    ips: &[(IpAddr, u32)],
    note: &mut impl FnMut(String),
) -> Result<(), Error> {
    if ips.is_empty() {
        return Ok(());
    }
    for i in nl.interfaces().await? {
        for (a, len) in &i.addresses {
            if ips.iter().any(|(ip, _)| ip == a) {
                nl.del_address(i.ifindex, *a, *len).await?;
                note(format!("removed egress IP {a}/{len} from {}", i.name));
            }
        }
    }
    Ok(())
}

/// Whether the `CapEff` of a /proc/<pid>/status text holds CAP_NET_ADMIN (an unreadable
/// status counts as holding it: the first netlink call then says what it lacks).
fn holds_net_admin(status: &str) -> bool {
    const CAP_NET_ADMIN: u32 = 12;
    crate::doctor::host::cap_eff(status).is_none_or(|eff| eff & (1 << CAP_NET_ADMIN) != 0)
}

fn remove(path: &Path) -> Result<(), Error> {
    fs::remove_file(path).map_err(|source| Error::Remove {
        path: path.to_owned(),
        source,
    })
}

/// `link-from_pod@eth0@3` (or `tc-...`) -> `from_pod from eth0`.
fn describe_link(pin: &str) -> String {
    match RecordName::parse(pin) {
        Some(r) => format!("{} from {}", r.program, r.ifname),
        None => pin.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_pins_read_as_program_and_interface() {
        assert_eq!(
            describe_link("link-from_secondary@sec-a@7"),
            "from_secondary from sec-a"
        );
        assert_eq!(describe_link("tc-from_pod@cali1@9"), "from_pod from cali1");
        assert_eq!(describe_link("link-odd"), "link-odd");
    }

    #[test]
    fn net_admin_is_read_from_cap_eff() {
        // The uninstall's init container: BPF and NET_ADMIN.
        assert!(holds_net_admin("CapEff:\t0000008000001000\n"));
        assert!(!holds_net_admin("CapEff:\t0000008000000000\n"));
        assert!(holds_net_admin("Name: x\n"));
    }
}
