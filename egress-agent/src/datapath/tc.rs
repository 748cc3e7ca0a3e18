//! Legacy TC attachment, for kernels without TCX links (before Linux 6.6): a `clsact`
//! qdisc and a direct-action `bpf` filter on the device's ingress, over netlink (what
//! `tc qdisc add dev X clsact` and `tc filter replace dev X ingress prio P handle H bpf da`
//! do). A filter belongs to the device, not to a process: it stays attached when the agent
//! exits, and a new agent replaces its program in place (one netlink request, which
//! cls_bpf applies with an RCU swap: no packet sees the device without a program).
//!
//! Each of our programs has a handle of its own ([`handle_of`]) at one priority (`run
//! --tc-priority`); a filter is ours when it sits at that priority and handle and its
//! name is the one we give ([`filter_name`]). Nothing else on a device is touched.

use std::io;

use rtnetlink::{
    packet_core::{
        NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST,
        NetlinkMessage, NetlinkPayload,
    },
    packet_route::{
        RouteNetlinkMessage,
        tc::{TcAttribute, TcBpfFlags, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
    },
    sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE},
};

use crate::ebpf;

/// The priority our filters take by default: the first, so that we run before the
/// filters a CNI adds without a priority (the kernel gives those 49152 and below).
pub const DEFAULT_PRIORITY: u16 = 1;

/// `ETH_P_ALL`, as `tc filter ... protocol all` sends it (network order in `tcm_info`).
const ETH_P_ALL: u16 = 0x0003;

/// The filter handle of each of our programs: distinct, so that two of them could share
/// a device during a change of role, and unlikely to be chosen by hand (`tc` users pick
/// small numbers).
pub fn handle_of(program: &str) -> Option<u32> {
    let n = match program {
        ebpf::FROM_POD => 1,
        ebpf::FROM_TUNNEL => 2,
        ebpf::FROM_UNDERLAY => 3,
        ebpf::FROM_SECONDARY => 4,
        _ => return None,
    };
    Some(0x0e9e_0000 | n)
}

/// The name our filters carry (`tc filter show` prints it): `egress/<program>`.
pub fn filter_name(program: &str) -> String {
    format!("egress/{program}")
}

/// The program of a filter name of ours, if it is one.
pub fn program_of(name: &str) -> Option<&'static str> {
    let p = name.strip_prefix("egress/")?;
    ebpf::PROGRAMS.iter().copied().find(|q| *q == p)
}

/// One ingress filter found on a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    pub priority: u16,
    pub handle: u32,
    /// The classifier (`bpf`, `u32`, `flower`, ...).
    pub kind: String,
    /// A `bpf` filter's name, as its loader gave it.
    pub name: Option<String>,
    /// A `bpf` filter's program id.
    pub prog_id: Option<u32>,
}

impl Filter {
    /// Whether this is our filter for `program` at `priority`.
    pub fn is_ours(&self, program: &str, priority: u16) -> bool {
        self.priority == priority
            && Some(self.handle) == handle_of(program)
            && self.kind == "bpf"
            && self.name.as_deref() == Some(filter_name(program).as_str())
    }

    /// Our program, when this is one of our filters at `priority`.
    pub fn our_program(&self, priority: u16) -> Option<&'static str> {
        let p = program_of(self.name.as_deref()?)?;
        self.is_ours(p, priority).then_some(p)
    }
}

/// `tc qdisc add dev <ifindex> clsact`; `Ok(true)` when this call created it, `Ok(false)`
/// when the device had one already.
pub fn add_clsact(ifindex: u32) -> io::Result<bool> {
    let mut m = TcMessage::with_index(index(ifindex)?);
    m.header.parent = TcHandle::CLSACT;
    m.header.handle = TcHandle {
        major: 0xffff,
        minor: 0,
    };
    m.attributes.push(TcAttribute::Kind("clsact".to_owned()));
    match request(
        RouteNetlinkMessage::NewQueueDiscipline(m),
        NLM_F_CREATE | NLM_F_EXCL,
    ) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `tc qdisc del dev <ifindex> clsact`.
pub fn del_clsact(ifindex: u32) -> io::Result<()> {
    let mut m = TcMessage::with_index(index(ifindex)?);
    m.header.parent = TcHandle::CLSACT;
    m.header.handle = TcHandle {
        major: 0xffff,
        minor: 0,
    };
    request(RouteNetlinkMessage::DelQueueDiscipline(m), 0).map(drop)
}

/// `tc filter replace dev <ifindex> ingress prio <priority> handle <handle_of(program)>
/// bpf da fd <prog_fd> name egress/<program>`: creates the filter, or swaps the program
/// of the one at that priority and handle in place.
pub fn replace_filter(
    ifindex: u32,
    priority: u16,
    program: &'static str,
    prog_fd: i32,
) -> io::Result<()> {
    let handle = handle_of(program)
        .ok_or_else(|| io::Error::other(format!("{program} is not a program of ours")))?;
    replace_bpf_filter(ifindex, priority, handle, &filter_name(program), prog_fd)
}

/// `tc filter replace dev <ifindex> ingress prio <priority> handle <handle> bpf da fd
/// <prog_fd> name <name>`, for any loader's filter (tests play a CNI's with it).
pub fn replace_bpf_filter(
    ifindex: u32,
    priority: u16,
    handle: u32,
    name: &str,
    prog_fd: i32,
) -> io::Result<()> {
    let mut m = filter_message(ifindex, priority, handle)?;
    m.attributes.push(TcAttribute::Kind("bpf".to_owned()));
    m.attributes.push(TcAttribute::Options(vec![
        TcOption::Bpf(TcFilterBpfOption::ProgFd(prog_fd as u32)),
        TcOption::Bpf(TcFilterBpfOption::ProgName(name.to_owned())),
        TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
    ]));
    request(
        RouteNetlinkMessage::NewTrafficFilter(m),
        NLM_F_CREATE | NLM_F_REPLACE,
    )
    .map(drop)
}

/// `tc filter del dev <ifindex> ingress prio <priority> handle <handle> bpf`.
pub fn del_filter(ifindex: u32, priority: u16, handle: u32) -> io::Result<()> {
    let mut m = filter_message(ifindex, priority, handle)?;
    m.attributes.push(TcAttribute::Kind("bpf".to_owned()));
    request(RouteNetlinkMessage::DelTrafficFilter(m), 0).map(drop)
}

/// The filters on the ingress (`egress == false`) or egress hook of a device's clsact
/// qdisc; none when it has no clsact qdisc.
pub fn filters(ifindex: u32, egress: bool) -> io::Result<Vec<Filter>> {
    let mut m = TcMessage::with_index(index(ifindex)?);
    m.header.parent = TcHandle {
        major: 0xffff,
        minor: if egress {
            TcHandle::MIN_EGRESS
        } else {
            TcHandle::MIN_INGRESS
        },
    };
    let replies = match request(RouteNetlinkMessage::GetTrafficFilter(m), NLM_F_DUMP) {
        Ok(r) => r,
        // No qdisc, or no device: no filters.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENODEV)) => {
            return Ok(Vec::new());
        }
        Err(e) => return Err(e),
    };
    Ok(replies
        .into_iter()
        .filter_map(|r| match r {
            RouteNetlinkMessage::NewTrafficFilter(m) => parse_filter(m),
            _ => None,
        })
        .collect())
}

/// A dump's message, or `None` for the chain's head (handle 0: no filter itself).
fn parse_filter(m: TcMessage) -> Option<Filter> {
    let handle = u32::from(m.header.handle);
    if handle == 0 {
        return None;
    }
    let mut f = Filter {
        priority: (m.header.info >> 16) as u16,
        handle,
        kind: String::new(),
        name: None,
        prog_id: None,
    };
    for a in m.attributes {
        match a {
            TcAttribute::Kind(k) => f.kind = k,
            TcAttribute::Options(opts) => {
                for o in opts {
                    match o {
                        TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => f.name = Some(n),
                        TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => f.prog_id = Some(id),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(f)
}

fn filter_message(ifindex: u32, priority: u16, handle: u32) -> io::Result<TcMessage> {
    let mut m = TcMessage::with_index(index(ifindex)?);
    m.header.parent = TcHandle {
        major: 0xffff,
        minor: TcHandle::MIN_INGRESS,
    };
    m.header.handle = handle.into();
    m.header.info = (u32::from(priority) << 16) | u32::from(ETH_P_ALL.to_be());
    Ok(m)
}

fn index(ifindex: u32) -> io::Result<i32> {
    i32::try_from(ifindex).map_err(|_| io::Error::other(format!("ifindex {ifindex} out of range")))
}

/// Send one request on a fresh netlink socket (in the calling thread's network
/// namespace) and collect the replies until the kernel's acknowledgement or the end of a
/// dump; a negative acknowledgement is the error it carries.
fn request(msg: RouteNetlinkMessage, flags: u16) -> io::Result<Vec<RouteNetlinkMessage>> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let mut req = NetlinkMessage::from(msg);
    req.header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
    req.header.sequence_number = 1;
    req.finalize();
    let mut buf = vec![0u8; req.buffer_len()];
    req.serialize(&mut buf);
    socket.send(&buf, 0)?;
    let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
    let mut out = Vec::new();
    loop {
        let (data, _) = socket.recv_from_full()?;
        let mut at = 0;
        while at < data.len() {
            let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&data[at..])
                .map_err(|e| io::Error::other(format!("failed to parse a netlink reply: {e}")))?;
            let len = reply.header.length as usize;
            if len == 0 {
                return Err(io::Error::other("a netlink reply of length 0"));
            }
            at += len;
            match reply.payload {
                NetlinkPayload::Error(e) => match e.code {
                    Some(code) => return Err(io::Error::from_raw_os_error(-code.get())),
                    None if !dump => return Ok(out),
                    None => {}
                },
                NetlinkPayload::Done(_) => return Ok(out),
                NetlinkPayload::InnerMessage(m) => out.push(m),
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(priority: u16, handle: u32, kind: &str, name: Option<&str>) -> Filter {
        Filter {
            priority,
            handle,
            kind: kind.to_owned(),
            name: name.map(str::to_owned),
            prog_id: None,
        }
    }

    #[test]
    fn ours_by_priority_handle_kind_and_name() {
        let h = handle_of(ebpf::FROM_POD).unwrap();
        let ours = filter(1, h, "bpf", Some("egress/from_pod"));
        assert!(ours.is_ours(ebpf::FROM_POD, 1));
        assert_eq!(ours.our_program(1), Some(ebpf::FROM_POD));
        // At another priority (another --tc-priority), under another handle, of another
        // kind or name: not ours.
        assert_eq!(ours.our_program(2), None);
        assert_eq!(
            filter(1, h + 1, "bpf", Some("egress/from_pod")).our_program(1),
            None
        );
        assert_eq!(
            filter(1, h, "u32", Some("egress/from_pod")).our_program(1),
            None
        );
        assert_eq!(
            filter(1, h, "bpf", Some("cil_from_container")).our_program(1),
            None
        );
        assert_eq!(filter(1, h, "bpf", None).our_program(1), None);
        assert_eq!(
            filter(1, h, "bpf", Some("egress/from_tunnel")).our_program(1),
            None,
            "the name of another of our programs under from_pod's handle"
        );
    }

    #[test]
    fn every_program_has_its_own_handle() {
        let mut handles: Vec<u32> = ebpf::PROGRAMS
            .iter()
            .map(|p| handle_of(p).unwrap())
            .collect();
        handles.sort();
        handles.dedup();
        assert_eq!(handles.len(), ebpf::PROGRAMS.len());
        assert_eq!(handle_of("cil_from_container"), None);
    }
}
