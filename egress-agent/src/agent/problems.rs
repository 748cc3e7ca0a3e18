//! Problems are logged once when they appear (WARN) and once when they go (INFO), not
//! on every pass: a full map or a broken file would otherwise repeat the same lines
//! forever. The pass's count is in the `reconciled` line and the metrics.

use std::collections::BTreeSet;

/// The problems of the last pass.
#[derive(Debug, Default)]
pub struct ProblemLog {
    last: BTreeSet<String>,
}

/// What changed since the last pass.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Change {
    pub appeared: Vec<String>,
    pub resolved: Vec<String>,
}

impl ProblemLog {
    /// Record this pass's problems; returns those that appeared and those resolved.
    pub fn update<'a>(&mut self, now: impl IntoIterator<Item = &'a String>) -> Change {
        let now: BTreeSet<String> = now.into_iter().cloned().collect();
        let change = Change {
            appeared: now.difference(&self.last).cloned().collect(),
            resolved: self.last.difference(&now).cloned().collect(),
        };
        self.last = now;
        change
    }

    /// Log what changed: one WARN per new problem, one INFO per resolved one.
    pub fn log<'a>(&mut self, now: impl IntoIterator<Item = &'a String>) {
        let change = self.update(now);
        for p in &change.appeared {
            tracing::warn!("problem: {p}");
        }
        for p in &change.resolved {
            tracing::info!("resolved: {p}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_problem_is_reported_once_when_it_appears_and_once_when_it_goes() {
        let mut log = ProblemLog::default();
        let first = strings(&["map POLICY_V4: full", "policy p: rules[0]: bad"]);
        assert_eq!(log.update(&first).appeared, first);
        for _ in 0..3 {
            assert_eq!(log.update(&first), Change::default(), "nothing new: silent");
        }
        let next = strings(&["policy p: rules[0]: bad", "node n: no underlay"]);
        assert_eq!(
            log.update(&next),
            Change {
                appeared: strings(&["node n: no underlay"]),
                resolved: strings(&["map POLICY_V4: full"]),
            }
        );
    }
}
