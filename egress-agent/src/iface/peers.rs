//! The host side of each pod's veth, found by what the kernel knows rather than by routes:
//! a veth of this namespace whose peer sits in another one, and the addresses on that
//! peer, read over rtnetlink with the peer's namespace id (`IFA_TARGET_NETNSID`). No
//! namespace is entered, so CAP_NET_ADMIN is enough (no CAP_SYS_ADMIN for `setns`, no
//! hostPID, no mount of the runtime's netns directory). Where a CNI gives pods no host
//! route (OVN-Kubernetes, Flannel, the bridge plugin), this is how a pod's device is found.

use super::*;

/// A veth of this namespace whose peer is in another namespace (a pod's, as a CNI makes
/// it), with the addresses its peer holds there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VethPeer {
    /// The host side's ifindex and name.
    pub ifindex: u32,
    pub name: String,
    /// The peer's addresses (link-local ones left out), in its own namespace.
    pub addresses: Vec<IpAddr>,
}

impl Netlink {
    /// Every veth of this namespace whose peer is in another namespace, with the peer's
    /// addresses. A namespace that cannot be read (it went away during the dump) leaves
    /// its veths without addresses; the next pass reads it again.
    pub async fn veth_peers(&self) -> Result<Vec<VethPeer>> {
        let links = self.links().await?;
        // (host ifindex, name, peer's namespace id, peer's ifindex in it)
        let veths: Vec<(u32, String, i32, u32)> = links.iter().filter_map(veth_of).collect();
        if veths.is_empty() {
            return Ok(Vec::new());
        }
        // The kernel reads IFA_TARGET_NETNSID on a dump only with strict checking, which
        // this connection alone turns on (the agent's own requests stay as they are).
        let (connection, handle, _) =
            rtnetlink::new_connection_with_strict_check().map_err(|error| Error::Os {
                verb: "open",
                object: "an rtnetlink socket with strict checking".into(),
                error,
            })?;
        let task = tokio::spawn(connection);
        let nsids: BTreeSet<i32> = veths.iter().map(|v| v.2).collect();
        let mut by_ns: HashMap<(i32, u32), Vec<IpAddr>> = HashMap::new();
        for nsid in nsids {
            let mut request = handle.address().get();
            request
                .message_mut()
                .attributes
                .push(AddressAttribute::TargetNetNsId(nsid));
            let Ok(messages) = request.execute().try_collect::<Vec<AddressMessage>>().await else {
                continue;
            };
            for m in &messages {
                if let Some((ip, _)) = address_of(m)
                    && !is_link_local(ip)
                {
                    by_ns.entry((nsid, m.header.index)).or_default().push(ip);
                }
            }
        }
        task.abort();
        Ok(veths
            .into_iter()
            .map(|(ifindex, name, nsid, peer)| VethPeer {
                ifindex,
                name,
                addresses: by_ns.remove(&(nsid, peer)).unwrap_or_default(),
            })
            .collect())
    }
}

/// A veth link whose peer is in another namespace: (ifindex, name, the peer namespace's
/// id, the peer's ifindex there).
fn veth_of(m: &LinkMessage) -> Option<(u32, String, i32, u32)> {
    let mut name = None;
    let mut nsid = None;
    let mut peer = None;
    let mut veth = false;
    for a in &m.attributes {
        match a {
            LinkAttribute::IfName(n) => name = Some(n.clone()),
            LinkAttribute::LinkNetNsId(id) => nsid = Some(*id),
            LinkAttribute::Link(p) if *p != 0 => peer = Some(*p),
            LinkAttribute::LinkInfo(infos) => {
                veth |= infos
                    .iter()
                    .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth)));
            }
            _ => {}
        }
    }
    veth.then_some(())?;
    Some((m.header.index, name?, nsid?, peer?))
}

/// Link-local (IPv4 169.254/16, IPv6 fe80::/10): an address no pod is known by.
pub fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => a.is_link_local(),
        IpAddr::V6(a) => a.is_unicast_link_local(),
    }
}
