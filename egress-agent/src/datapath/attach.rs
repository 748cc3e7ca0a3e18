//! Attaching the programs: exactly the wanted set, with the hook in use ([`Hook`]), each
//! attachment remembered in the pin directory so that the next agent adopts it. New
//! attachments go on before stale ones come off, so that a device changing hook (or an
//! agent changing `--attach`) is never without a program.

use std::{
    collections::BTreeSet,
    fs, io,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, OwnedFd},
    path::Path,
};

use aya::programs::{
    LinkOrder, ProgramError, SchedClassifier, TcAttachType,
    links::{FdLink, PinnedLink},
    tc::{SchedClassifierLink, TcAttachOptions},
};

use super::{
    Attachment, Datapath, Error, Result,
    hook::{Hook, RecordName, TcRecord},
    tc,
};

impl Datapath {
    /// The hook this datapath attaches with.
    pub fn hook(&self) -> Hook {
        self.hook
    }

    /// Attach with `hook` from now on (the next [`Datapath::sync_attachments`] moves every
    /// attachment of the other hook over, new one first).
    pub fn set_hook(&mut self, hook: Hook) {
        if hook != self.hook {
            self.hook = hook;
            self.attached.clear();
        }
    }

    /// The name of `a`'s record in the pin directory with the hook in use.
    pub(super) fn record_name(&self, a: &Attachment) -> String {
        self.hook.record_name(a.program, &a.ifname, a.ifindex)
    }

    /// Attach exactly the `want` set: new ones as pinned TCX links or recorded tc filters
    /// (or by swapping this process's program into what an earlier agent left), then the
    /// stale ones (either hook's) detached. Errors per attachment are returned, the
    /// others still apply.
    pub fn sync_attachments(&mut self, want: &BTreeSet<Attachment>) -> Vec<Error> {
        let mut errors = Vec::new();
        let recorded = records(&self.pin_dir);
        for a in want {
            if self.attached.contains(a) {
                continue;
            }
            match self.attach(a, &recorded) {
                Ok(()) => {
                    self.attached.insert(a.clone());
                }
                Err(e) => errors.push(e),
            }
        }
        let wanted: BTreeSet<String> = want.iter().map(|a| self.record_name(a)).collect();
        for name in recorded.iter().filter(|n| !wanted.contains(*n)) {
            if let Err(e) = remove_record(&self.pin_dir, name) {
                errors.push(e);
            }
        }
        self.attached
            .retain(|a| wanted.contains(&self.hook.record_name(a.program, &a.ifname, a.ifindex)));
        errors
    }

    /// Whether this datapath has `a` attached.
    pub fn is_attached(&self, a: &Attachment) -> bool {
        self.attached.contains(a)
    }

    /// Attach `a` now and leave every other attachment as it is: a new pod device under
    /// `--unknown-pods drop`, before the next pass decides the whole set (which detaches
    /// it again unless wanted). Returns whether it was attached now (false: it was).
    pub fn attach_one(&mut self, a: &Attachment) -> Result<bool> {
        if self.attached.contains(a) {
            return Ok(false);
        }
        self.attach(a, &records(&self.pin_dir))?;
        self.attached.insert(a.clone());
        Ok(true)
    }

    /// Attach `a` with the hook in use (`recorded`: the pin directory's records).
    fn attach(&mut self, a: &Attachment, recorded: &BTreeSet<String>) -> Result<()> {
        match self.hook {
            Hook::Tcx => self.attach_tcx(a, recorded.contains(&self.record_name(a))),
            Hook::Tc { priority } => self.attach_tc(a, priority),
        }
    }

    fn program(&mut self, a: &Attachment) -> Result<&mut SchedClassifier> {
        self.load_program(a.program)?;
        self.ebpf
            .program_mut(a.program)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| Error::Program {
                verb: "find program",
                what: format!("{} on {}", a.program, a.ifname),
                source: ProgramError::NotLoaded,
            })
    }

    fn attach_tcx(&mut self, a: &Attachment, pinned: bool) -> Result<()> {
        let path = self.pin_dir.join(self.record_name(a));
        let what = format!("{} on {}", a.program, a.ifname);
        let prog = self.program(a)?;
        if pinned {
            // An earlier agent's link: swap our program in, atomically.
            let swapped = PinnedLink::from_pin(&path)
                .ok()
                .map(FdLink::from)
                .and_then(|l| SchedClassifierLink::try_from(l).ok())
                .map(|l| prog.attach_to_link(l));
            match swapped {
                Some(Ok(id)) => {
                    // aya keeps the link open in the program; the pin alone must hold
                    // it. Else unpinning it later (no longer wanted) would leave it
                    // attached by this process, attaching it again would fail, and this
                    // process's exit would detach it: a gateway's kernel then answers
                    // its egress IPs' replies with RSTs until the next agent attaches.
                    if let Ok(link) = prog.take_link(id) {
                        forget_fd(link);
                    }
                    return Ok(());
                }
                _ => {
                    // Defunct (the device went away): start over.
                    let _ = fs::remove_file(&path);
                }
            }
        }
        let id = prog
            .attach_with_options(
                &a.ifname,
                TcAttachType::Ingress,
                TcAttachOptions::TcxOrder(LinkOrder::default()),
            )
            .map_err(|source| Error::Program {
                verb: "attach",
                what: what.clone(),
                source,
            })?;
        let link = prog.take_link(id).map_err(|source| Error::Program {
            verb: "take link of",
            what: what.clone(),
            source,
        })?;
        let fd: FdLink = link
            .try_into()
            .map_err(|e: aya::programs::links::LinkError| Error::Io {
                verb: "convert link",
                path: path.clone(),
                source: io::Error::other(e.to_string()),
            })?;
        fd.pin(&path).map_err(|e| Error::Io {
            verb: "pin link",
            path: path.clone(),
            source: io::Error::other(e.to_string()),
        })?;
        Ok(())
    }

    /// Our filter for `a` at `priority` ([`attach_tc`]).
    fn attach_tc(&mut self, a: &Attachment, priority: u16) -> Result<()> {
        let pin_dir = self.pin_dir.clone();
        let fd = self.program(a)?.fd().map_err(|source| Error::Program {
            verb: "get the descriptor of",
            what: a.program.to_owned(),
            source,
        })?;
        attach_tc(&pin_dir, a, priority, fd.as_fd())
    }

    /// A descriptor of `program` when it is loaded, for [`attach_elsewhere`].
    pub fn program_fd(&self, program: &str) -> Option<OwnedFd> {
        let p: &SchedClassifier = self.ebpf.program(program)?.try_into().ok()?;
        p.fd().ok()?.as_fd().try_clone_to_owned().ok()
    }

    /// `a`, attached by [`attach_elsewhere`], is this datapath's from now on (as if
    /// [`Datapath::attach_one`] had attached it).
    pub fn adopt(&mut self, a: Attachment) {
        self.attached.insert(a);
    }

    /// The pin directory (where [`attach_elsewhere`] records what it attaches).
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }
}

/// Attach `a` by `hook` with `prog` (a descriptor of its program), recorded in `pin_dir`
/// as a [`Datapath`] records it, from a thread that does not hold the datapath: a new pod
/// device's `from_pod` while a pass runs. Returns false, attaching nothing, when a
/// record of `a` is there already (the datapath attached it).
pub fn attach_elsewhere(
    hook: Hook,
    pin_dir: &Path,
    prog: BorrowedFd<'_>,
    a: &Attachment,
) -> Result<bool> {
    let path = pin_dir.join(hook.record_name(a.program, &a.ifname, a.ifindex));
    if path.exists() {
        return Ok(false);
    }
    match hook {
        Hook::Tcx => {
            let link = super::hook::tcx_link(prog, a.ifindex).map_err(|source| Error::Tc {
                verb: "attach (TCX link)",
                program: a.program.to_owned(),
                ifname: a.ifname.clone(),
                source,
            })?;
            // The pin holds the link; this descriptor closes.
            super::hook::pin(link.as_fd(), &path).map_err(|source| Error::Io {
                verb: "pin link",
                path,
                source,
            })?;
        }
        Hook::Tc { priority } => attach_tc(pin_dir, a, priority, prog)?,
    }
    Ok(true)
}

/// Our filter for `a` at `priority` with program `prog`, created or its program replaced
/// in place (what an earlier agent attached is adopted so), after checking that nothing
/// else sits at that priority and handle; then recorded in `pin_dir`.
fn attach_tc(pin_dir: &Path, a: &Attachment, priority: u16, prog: BorrowedFd<'_>) -> Result<()> {
    let path = pin_dir.join(Hook::Tc { priority }.record_name(a.program, &a.ifname, a.ifindex));
    let earlier = TcRecord::read(&path);
    let tc_err = |verb: &'static str, source: io::Error| Error::Tc {
        verb,
        program: a.program.to_owned(),
        ifname: a.ifname.clone(),
        source,
    };
    let handle = tc::handle_of(a.program).ok_or_else(|| Error::Program {
        verb: "find the filter handle of",
        what: a.program.to_owned(),
        source: ProgramError::NotLoaded,
    })?;
    let present = tc::filters(a.ifindex, false).map_err(|e| tc_err("list filters for", e))?;
    if let Some(f) = present.iter().find(|f| {
        f.priority == priority
            && (f.handle == handle || f.kind != "bpf")
            && !f.is_ours(a.program, priority)
    }) {
        return Err(Error::Foreign {
            ifname: a.ifname.clone(),
            priority,
            found: format!(
                "a {} filter, handle {:#x}{}",
                f.kind,
                f.handle,
                f.name
                    .as_ref()
                    .map_or(String::new(), |n| format!(", name {n}"))
            ),
        });
    }
    let created = tc::add_clsact(a.ifindex).map_err(|e| tc_err("add a clsact qdisc for", e))?;
    tc::replace_filter(a.ifindex, priority, a.program, prog.as_raw_fd())
        .map_err(|e| tc_err("attach (tc filter replace)", e))?;
    // A filter an earlier agent left at another --tc-priority goes, after ours is on.
    if let Some(old) = earlier.filter(|r| r.priority != priority) {
        let _ = tc::del_filter(a.ifindex, old.priority, handle);
    }
    let record = TcRecord {
        priority,
        created_clsact: created || earlier.is_some_and(|r| r.created_clsact),
    };
    record.write(&path).map_err(|source| Error::Io {
        verb: "record the tc filter at",
        path,
        source,
    })
}

/// The attachment records in `pin_dir` (TCX link pins and tc filter records).
pub fn records(pin_dir: &Path) -> BTreeSet<String> {
    fs::read_dir(pin_dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| RecordName::parse(n).is_some())
                .collect()
        })
        .unwrap_or_default()
}

/// Detach what the record `name` in `pin_dir` stands for and remove the record: a TCX
/// link is unpinned (the last reference goes, the program detaches); a tc filter is
/// deleted when it is still ours, and the device's clsact qdisc with it when we added it
/// and nothing else is left on it. A device that is gone took its attachment with it.
pub fn remove_record(pin_dir: &Path, name: &str) -> Result<()> {
    let path = pin_dir.join(name);
    let Some(r) = RecordName::parse(name) else {
        return Ok(());
    };
    if !r.tc {
        return match PinnedLink::from_pin(&path) {
            Ok(link) => link.unpin().map(drop).map_err(|source| Error::Io {
                verb: "unpin link",
                path,
                source,
            }),
            Err(_) => remove_file(&path),
        };
    }
    if let Some(rec) = TcRecord::read(&path) {
        remove_tc_filter(r.ifindex, r.program, rec.priority, rec.created_clsact).map_err(
            |source| Error::Tc {
                verb: "detach",
                program: r.program.to_owned(),
                ifname: r.ifname.to_owned(),
                source,
            },
        )?;
    }
    match fs::remove_dir_all(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        // A file of that name, not ours to keep either.
        Err(_) => remove_file(&path),
    }
}

/// Delete our filter of `program` at `priority` on `ifindex` if it is there and ours;
/// then, when `created_clsact`, the clsact qdisc if no filter is left on either hook.
pub fn remove_tc_filter(
    ifindex: u32,
    program: &str,
    priority: u16,
    created_clsact: bool,
) -> io::Result<()> {
    let present = match tc::filters(ifindex, false) {
        Ok(p) => p,
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(()),
        Err(e) => return Err(e),
    };
    if let Some(f) = present.iter().find(|f| f.is_ours(program, priority)) {
        match tc::del_filter(ifindex, priority, f.handle) {
            Ok(()) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENODEV)) => {}
            Err(e) => return Err(e),
        }
    }
    if created_clsact
        && tc::filters(ifindex, false)?.is_empty()
        && tc::filters(ifindex, true)?.is_empty()
    {
        match tc::del_clsact(ifindex) {
            Ok(()) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn remove_file(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(Error::Io {
            verb: "remove",
            path: path.to_owned(),
            source,
        }),
    }
}

/// Close this process's descriptor of a pinned link without detaching it (dropping a
/// program's link wrapper detaches it; closing an `FdLink` only drops a reference).
fn forget_fd(link: SchedClassifierLink) {
    if let Ok(fd) = FdLink::try_from(link) {
        drop(fd);
    }
}
