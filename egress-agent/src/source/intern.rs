//! One copy of each namespace name, node name and label set among the pods.
//!
//! A gateway holds every pod of the cluster, and every compile walks them all: it compares
//! each pod's namespace and node and matches each pod's labels. The pods of a cluster share
//! a few namespaces, a node per hundred pods and, replicas of one template, their labels;
//! kept once, these stay in the cache where 100,000 copies of them did not (the compile at
//! 100,000 pods spent a third of its time loading them, docs/benchmarks.md), and they are
//! kept once in memory too.
//!
//! The pool is the process's: every source that summarizes pods shares it. It forgets what
//! no pod holds any more when it has doubled since it last looked, so a label set a rollout
//! left behind (a `pod-template-hash` of the old ReplicaSet) does not stay.

use std::{
    collections::{BTreeMap, HashSet},
    hash::Hash,
    sync::{Arc, Mutex, PoisonError},
};

/// Interned labels: one map shared by every pod that has the very same.
pub type Labels = Arc<BTreeMap<String, String>>;

/// A table of shared values that forgets those only it holds, now and then.
struct Table<T: ?Sized> {
    set: HashSet<Arc<T>>,
    /// Forget the unheld when the table grows past this.
    purge_at: usize,
}

impl<T: ?Sized + Hash + Eq> Table<T> {
    fn new() -> Self {
        Self {
            set: HashSet::new(),
            purge_at: 1024,
        }
    }

    /// The shared copy equal to `value`, if there is one.
    fn get(&self, value: &T) -> Option<Arc<T>> {
        self.set.get(value).cloned()
    }

    /// Share `value` from now on (after forgetting what only the table holds, when it
    /// has grown past the bound).
    fn insert(&mut self, value: Arc<T>) -> Arc<T> {
        if self.set.len() >= self.purge_at {
            self.set.retain(|v| Arc::strong_count(v) > 1);
            self.purge_at = (self.set.len() * 2).max(1024);
        }
        self.set.insert(Arc::clone(&value));
        value
    }
}

struct Pool {
    strs: Table<str>,
    labels: Table<BTreeMap<String, String>>,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

fn with_pool<R>(f: impl FnOnce(&mut Pool) -> R) -> R {
    let mut guard = POOL.lock().unwrap_or_else(PoisonError::into_inner);
    let pool = guard.get_or_insert_with(|| Pool {
        strs: Table::new(),
        labels: Table::new(),
    });
    f(pool)
}

/// The shared copy of the name `s` (a namespace's, a node's).
pub fn name(s: &str) -> Arc<str> {
    with_pool(|p| p.strs.get(s).unwrap_or_else(|| p.strs.insert(Arc::from(s))))
}

/// The shared copy of the label set `labels`.
pub fn labels(labels: BTreeMap<String, String>) -> Labels {
    with_pool(|p| {
        p.labels
            .get(&labels)
            .unwrap_or_else(|| p.labels.insert(Arc::new(labels)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_names_and_label_sets_are_one_copy() {
        let a = name("team-a");
        let b = name(&String::from("team-a"));
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &name("team-b")));
        let set = || BTreeMap::from([("app".to_owned(), "api".to_owned())]);
        assert!(Arc::ptr_eq(&labels(set()), &labels(set())));
        assert_eq!(*labels(set()), set());
    }

    #[test]
    fn what_no_pod_holds_is_forgotten_when_the_table_doubles() {
        let mut t: Table<str> = Table::new();
        let kept = t.insert(Arc::from("kept"));
        for i in 0..5000 {
            drop(t.insert(Arc::from(format!("gone-{i}").as_str())));
        }
        // Each purge left only `kept` and what came after it: never more than the bound.
        assert!(t.set.len() <= 1025, "{}", t.set.len());
        assert!(t.set.contains("kept"));
        assert!(Arc::ptr_eq(&kept, &t.get("kept").expect("kept")));
    }
}
