//! Devices let go of while their subsystem is served (a namespace removed, or its device
//! replaced): counted until synced, so that a shutdown of the subsystem's controllers
//! completes only then, and fails if a sync failed.

use super::*;

/// Devices let go of while their subsystem is served: a shutdown of a controller made
/// while they were published completes once they are synced.
impl Target {
    /// A device of subsystem `sub` is let go of (a namespace removed, or its device
    /// replaced): a shutdown of the subsystem's controllers made before now completes only
    /// once it is synced ([`Target::release_ends`], given the number returned here). Call it
    /// before the subsystem is published without the namespace and before any reactor is
    /// told to let the device go.
    pub fn release_begins(&self, sub: u64) -> u64 {
        let mut r = self
            .inner
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let e = r.entry(sub).or_default();
        let n = e.begun;
        e.begun += 1;
        e.in_flight.push(n);
        n
    }

    /// Subsystem `sub` is published without the namespaces of its releases begun so far
    /// (call it once the target has its new subsystems): a controller made from now on never
    /// saw them and is not concerned by their syncs. One made before, even while they were
    /// being let go of, is.
    pub fn releases_unpublished(&self, sub: u64) {
        let mut r = self
            .inner
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(e) = r.get_mut(&sub) {
            e.unpublished = e.begun;
        }
    }

    /// The sync of release `n` of subsystem `sub` ended; `durable` when it succeeded (or
    /// there was nothing to sync). A failure fails the shutdown of every controller of the
    /// subsystem made before its namespace was published no more
    /// ([`Target::releases_unpublished`]: their hosts may have written there); one made
    /// after never saw the namespace.
    pub fn release_ends(&self, sub: u64, n: u64, durable: bool) {
        // Read before the lock: the releases' lock takes no other while held.
        let gone = self.subsystem_by_id(sub).is_none();
        let mut r = self
            .inner
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let Some(e) = r.get_mut(&sub) else {
            return;
        };
        let Some(i) = e.in_flight.iter().position(|&x| x == n) else {
            return;
        };
        e.in_flight.swap_remove(i);
        if !durable {
            e.failures += 1;
            e.last_failed = e.last_failed.max(Some(n));
        }
        // A subsystem gone has no controller left to ask.
        if e.in_flight.is_empty() && gone {
            r.remove(&sub);
        }
    }

    /// Releases of subsystem `sub` whose namespaces are published no more: a controller made
    /// now is concerned by those numbered from this on.
    pub(crate) fn releases_unpublished_so_far(&self, sub: u64) -> u64 {
        let r = self
            .inner
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        r.get(&sub).map_or(0, |e| e.unpublished)
    }

    /// For a controller of subsystem `sub` made when `from` releases had begun: whether a
    /// release begun since failed its sync, and whether one is still being synced.
    pub(crate) fn releases_since(&self, sub: u64, from: u64) -> (bool, bool) {
        let r = self
            .inner
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        r.get(&sub).map_or((false, false), |e| {
            (
                e.last_failed.is_some_and(|n| n >= from),
                e.in_flight.iter().any(|&n| n >= from),
            )
        })
    }

    /// Subsystem `sub`'s devices let go of and not synced yet, and its failed syncs.
    pub fn releases(&self, sub: u64) -> Releases {
        let r = self
            .inner
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        r.get(&sub).map_or_else(Releases::default, |e| Releases {
            in_flight: u32::try_from(e.in_flight.len()).unwrap_or(u32::MAX),
            failures: e.failures,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target::new(
            vec![Subsystem {
                id: 0,
                nqn: "nqn.2024-01.io.nvmfd.test:a".into(),
                serial: "A".into(),
                model: "m".into(),
                allow_any_host: true,
                hosts: vec![],
                cntlids: crate::ALL_CNTLIDS,
                namespaces: vec![],
            }],
            vec![],
            Limits::default(),
        )
    }

    /// Releases are numbered in the order they began; a controller is concerned by those
    /// still published when it was made, and a removed subsystem's log goes once its last
    /// sync ends.
    #[test]
    fn releases_concern_controllers_made_before_their_namespace_was_unpublished() {
        let t = target();
        let sub = t.subsystem("nqn.2024-01.io.nvmfd.test:a").unwrap().id;
        let made_before = t.releases_unpublished_so_far(sub);
        let n = t.release_begins(sub);
        let made_meanwhile = t.releases_unpublished_so_far(sub);
        t.releases_unpublished(sub);
        let made_after = t.releases_unpublished_so_far(sub);
        assert_eq!(t.releases_since(sub, made_before), (false, true));
        assert_eq!(t.releases_since(sub, made_meanwhile), (false, true));
        assert_eq!(t.releases_since(sub, made_after), (false, false));
        t.release_ends(sub, n, false);
        assert_eq!(t.releases_since(sub, made_before), (true, false));
        assert_eq!(t.releases_since(sub, made_after), (false, false));
        assert_eq!(t.releases(sub).failures, 1);
        // A removed subsystem: its log goes with its last sync.
        let m = t.release_begins(sub);
        t.remove_subsystem("nqn.2024-01.io.nvmfd.test:a").unwrap();
        assert!(t.inner.releases.lock().unwrap().contains_key(&sub));
        t.release_ends(sub, m, true);
        assert!(!t.inner.releases.lock().unwrap().contains_key(&sub));
    }
}
