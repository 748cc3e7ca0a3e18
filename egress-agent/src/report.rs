//! Errors in words, each cause once.
//!
//! Our error types say "failed to <verb> <thing>: <detail>" and keep the cause as their
//! `source` too (so that logs of one error, `{e}`, stay whole); libraries we use do one or
//! the other. Printed as a chain, such an error would repeat its cause ("...: `BPF_OBJ_GET`
//! failed: `BPF_OBJ_GET` failed: ..."): [`chain`] prints every cause that the text so far
//! does not already say.

use std::error::Error;

/// `e` and its causes, joined with ": ", each cause once.
pub fn chain(e: &(dyn Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !text.is_empty() && !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("`BPF_OBJ_GET` failed")]
    struct Syscall(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("failed to open map CONFIG: {0}")]
    struct OpenMap(#[source] Syscall);

    #[test]
    fn each_cause_is_printed_once() {
        let e = OpenMap(Syscall(std::io::Error::from_raw_os_error(libc::ENOENT)));
        let top = anyhow::Error::new(e).context("failed to open the datapath at /sys/fs/bpf/x");
        // What `{:#}` prints: the syscall twice.
        assert_eq!(
            format!("{top:#}"),
            "failed to open the datapath at /sys/fs/bpf/x: failed to open map CONFIG: \
             `BPF_OBJ_GET` failed: `BPF_OBJ_GET` failed: No such file or directory (os error 2)"
        );
        assert_eq!(
            chain(top.as_ref()),
            "failed to open the datapath at /sys/fs/bpf/x: failed to open map CONFIG: \
             `BPF_OBJ_GET` failed: No such file or directory (os error 2)"
        );
    }

    #[test]
    fn causes_only_in_the_source_are_kept() {
        #[derive(Debug, thiserror::Error)]
        #[error("failed to read the state directory /x")]
        struct Read(#[source] std::io::Error);
        let e = Read(std::io::Error::from_raw_os_error(libc::EACCES));
        assert_eq!(
            chain(&e),
            "failed to read the state directory /x: Permission denied (os error 13)"
        );
    }
}
