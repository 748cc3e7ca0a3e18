//! `from_pod` on a new pod device at its `RTM_NEWLINK`, off the agent's main thread
//! (`--unknown-pods drop`): a pass in progress (tens to hundreds of milliseconds on a
//! loaded node) never delays it, so a pod that sends as soon as its device exists is
//! dropped, not leaked. The attachment is recorded in the pin directory as the datapath
//! records its own; the main thread adopts it ([`Held::take`]) under the lock it syncs
//! the attachments with, so a pass never removes an attachment it has not seen.

use std::{
    collections::BTreeSet,
    os::fd::{AsFd as _, OwnedFd},
    path::PathBuf,
    sync::{Mutex, MutexGuard},
    time::Instant,
};

use tracing::{info, warn};

use super::attachments;
use crate::{
    datapath::{self, Attachment, Hook},
    iface,
};

/// What the new-link task and the main thread share.
pub(super) struct Early(Mutex<Inner>);

pub(super) struct Inner {
    /// `from_pod`'s descriptor and the hook in use, once a pass has loaded the program
    /// (until then the main thread attaches new devices, as before).
    prog: Option<(OwnedFd, Hook)>,
    pin_dir: PathBuf,
    tunnel: String,
    /// The egress interfaces of the last pass (never a pod device).
    egress: BTreeSet<String>,
    /// Attached here and not yet taken by the main thread: each with when its
    /// notification was read.
    attached: Vec<(Attachment, Instant)>,
}

impl Early {
    /// Nothing attached yet; `pin_dir` is the datapath's, `tunnel` the tunnel device's name.
    pub(super) fn new(pin_dir: PathBuf, tunnel: &str) -> Self {
        Self(Mutex::new(Inner {
            prog: None,
            pin_dir,
            tunnel: tunnel.to_owned(),
            egress: BTreeSet::new(),
            attached: Vec::new(),
        }))
    }

    /// The shared state, held while the main thread syncs attachments.
    pub(super) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `link` appeared: `from_pod` on it now when it is a pod-like link that is neither
    /// the tunnel nor an egress interface and the program is loaded. Whatever happens
    /// here, the main thread sees the link afterwards and attaches what is still missing.
    pub(super) fn on_new_link(&self, link: &iface::NewLink) {
        let mut inner = self.lock();
        if !inner.wants(link) {
            return;
        }
        let Some((prog, hook)) = &inner.prog else {
            return;
        };
        let a = attachment(link);
        let queued = link.seen.elapsed();
        match datapath::attach_elsewhere(*hook, &inner.pin_dir, prog.as_fd(), &a) {
            Ok(true) => {
                log_attached(link, queued);
                inner.attached.push((a, link.seen));
            }
            // The main thread attached it first.
            Ok(false) => {}
            Err(e) => warn!(
                device = %link.name,
                "failed to attach to a new device at its RTM_NEWLINK: {e} (the main \
                 thread tries again)"
            ),
        }
    }
}

/// `from_pod` on `link`.
pub(super) fn attachment(link: &iface::NewLink) -> Attachment {
    Attachment {
        program: crate::ebpf::FROM_POD,
        ifname: link.name.clone(),
        ifindex: link.ifindex,
    }
}

/// Say that `from_pod` went on `link`, its notification `queued` that long before.
pub(super) fn log_attached(link: &iface::NewLink, queued: std::time::Duration) {
    info!(
        device = %link.name,
        after_us = link.seen.elapsed().as_micros(),
        queued_us = queued.as_micros(),
        "from_pod attached to a new pod device at its RTM_NEWLINK (--unknown-pods drop): \
         its traffic to covered destinations is dropped until the agent knows its pod"
    );
}

impl Inner {
    /// Whether `link` gets `from_pod` at once ([`attachments::NewDevices::wants`]).
    pub(super) fn wants(&self, link: &iface::NewLink) -> bool {
        attachments::NewDevices::wants(link, &self.tunnel, &self.egress)
    }

    /// What was attached here since the last call, each with when its link was seen.
    pub(super) fn take(&mut self) -> Vec<(Attachment, Instant)> {
        std::mem::take(&mut self.attached)
    }

    /// After a pass: the egress interfaces it found, and `from_pod`'s descriptor (None
    /// while not loaded) with the hook it is attached by.
    pub(super) fn update(&mut self, egress: &BTreeSet<String>, prog: Option<(OwnedFd, Hook)>) {
        self.egress.clone_from(egress);
        self.prog = prog;
    }

    /// The egress interfaces of the last pass.
    #[cfg(test)]
    pub(super) fn egress_mut(&mut self) -> &mut BTreeSet<String> {
        &mut self.egress
    }
}
