//! Owns the pinned maps and the attachments; applies diffs of the desired state.
