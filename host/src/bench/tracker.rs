//! `--verify`'s record of what each place of a thread's part may hold.

use std::collections::HashMap;

/// With `verify`, what each I/O-sized place of a thread's part may hold. Every I/O covers one
/// whole place, and only this thread writes its part.
#[derive(Default)]
pub(super) struct Tracker {
    /// What each place written in this run holds once no write to it is in flight: one of
    /// these stamps (one, unless writes to it were in flight together). A place not here was
    /// not written in this run (zeroes, or an earlier run's data).
    settled: HashMap<u64, Vec<u64>>,
    /// The places with writes or checked reads in flight; an entry goes once both end.
    active: HashMap<u64, Active>,
    /// Reads in flight, by (lane, slot).
    reads: HashMap<(usize, u16), ReadCheck>,
    /// The next write's stamp (a random start, so that a run's stamps are not an earlier's).
    next_stamp: u64,
    /// Counts sends and acknowledgements, to order them.
    clock: u64,
}

/// A place's writes since it was last quiet, and its checked reads, in flight.
#[derive(Default)]
struct Active {
    /// Each write's stamp, when it was sent, and when it was acknowledged (`None`: in flight).
    /// A write acknowledged before another was sent is overwritten once that one is
    /// acknowledged, and leaves the list then.
    writes: Vec<(u64, u64, Option<u64>)>,
    /// Checked reads of the place in flight, by (lane, slot).
    readers: Vec<(usize, u16)>,
}

/// A read in flight, and what it may find.
pub(super) struct ReadCheck {
    pub(super) place: u64,
    /// A write to the place had been acknowledged when the read was sent: the read must
    /// find one of `allowed`, never zeroes or an older write.
    pub(super) known: bool,
    /// The writes it may find: what was settled or under way when it was sent, and every
    /// write sent to the place before it was answered.
    pub(super) allowed: Vec<u64>,
}

impl Tracker {
    /// A tracker whose writes are stamped from after `start` on.
    pub(super) fn stamping_from(start: u64) -> Tracker {
        Tracker {
            next_stamp: start,
            ..Tracker::default()
        }
    }

    /// A write to `place` is sent: its stamp.
    pub(super) fn write_sent(&mut self, place: u64) -> u64 {
        self.next_stamp = self.next_stamp.wrapping_add(1);
        self.clock += 1;
        let stamp = self.next_stamp;
        let a = self.active.entry(place).or_default();
        a.writes.push((stamp, self.clock, None));
        for key in &a.readers {
            if let Some(r) = self.reads.get_mut(key) {
                r.allowed.push(stamp);
            }
        }
        stamp
    }

    /// The write stamped `stamp` to `place` is acknowledged.
    pub(super) fn write_done(&mut self, place: u64, stamp: u64) {
        self.clock += 1;
        let Some(a) = self.active.get_mut(&place) else {
            return;
        };
        let Some(sent) = a.writes.iter().find(|w| w.0 == stamp).map(|w| w.1) else {
            return;
        };
        // Every write in flight was sent after the settled ones were all acknowledged: an
        // acknowledged one is over them on the device, so a read may no longer find them.
        self.settled.remove(&place);
        // Writes acknowledged before this one was sent are behind it on the device.
        a.writes.retain(|w| w.2.is_none_or(|done| done > sent));
        if let Some(w) = a.writes.iter_mut().find(|w| w.0 == stamp) {
            w.2 = Some(self.clock);
        }
        if a.writes.iter().all(|w| w.2.is_some()) {
            self.settled
                .insert(place, a.writes.drain(..).map(|w| w.0).collect());
            if a.readers.is_empty() {
                self.active.remove(&place);
            }
        }
    }

    /// A read of `place` is sent from `key` (lane, slot).
    pub(super) fn read_sent(&mut self, key: (usize, u16), place: u64) {
        let settled = self.settled.get(&place);
        let active = self.active.get(&place);
        // Once a write to it was acknowledged, the place holds this run's data.
        let known =
            settled.is_some() || active.is_some_and(|a| a.writes.iter().any(|w| w.2.is_some()));
        let mut allowed = Vec::new();
        if known {
            allowed.extend(settled.into_iter().flatten().copied());
            allowed.extend(
                active
                    .into_iter()
                    .flat_map(|a| a.writes.iter().map(|w| w.0)),
            );
            self.active.entry(place).or_default().readers.push(key);
        }
        self.reads.insert(
            key,
            ReadCheck {
                place,
                known,
                allowed,
            },
        );
    }

    /// The read sent from `key` is answered: what it may have found.
    pub(super) fn read_done(&mut self, key: (usize, u16)) -> Option<ReadCheck> {
        let r = self.reads.remove(&key)?;
        if let Some(a) = self.active.get_mut(&r.place) {
            a.readers.retain(|&k| k != key);
            if a.readers.is_empty() && a.writes.is_empty() {
                self.active.remove(&r.place);
            }
        }
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::Tracker;

    fn allowed(t: &mut Tracker, place: u64) -> Option<Vec<u64>> {
        t.read_sent((0, 99), place);
        let r = t.read_done((0, 99)).unwrap();
        r.known.then_some(r.allowed)
    }

    #[test]
    fn a_write_acknowledged_while_another_is_in_flight_supersedes_the_settled_data() {
        let mut t = Tracker::default();
        let a = t.write_sent(7);
        t.write_done(7, a);
        let (b, c) = (t.write_sent(7), t.write_sent(7));
        t.write_done(7, b);
        let mut found = allowed(&mut t, 7).unwrap();
        found.sort_unstable();
        assert_eq!(found, vec![b, c], "A was overwritten by B, acknowledged");
        t.write_done(7, c);
        let mut found = allowed(&mut t, 7).unwrap();
        found.sort_unstable();
        assert_eq!(found, vec![b, c], "B and C were in flight together");
    }

    #[test]
    fn a_read_may_find_only_what_was_acknowledged_or_in_flight() {
        let mut t = Tracker::default();
        assert_eq!(allowed(&mut t, 7), None, "not written in the run");
        let a = t.write_sent(7);
        assert_eq!(allowed(&mut t, 7), None, "in flight only: anything before");
        t.write_done(7, a);
        assert_eq!(allowed(&mut t, 7), Some(vec![a]));
        // B sent after A was acknowledged: A, or B, until B is acknowledged; then B alone.
        let b = t.write_sent(7);
        let mut both = allowed(&mut t, 7).unwrap();
        both.sort_unstable();
        assert_eq!(both, vec![a, b]);
        t.write_done(7, b);
        assert_eq!(allowed(&mut t, 7), Some(vec![b]));
        // C and D in flight together: either, whatever order they are acknowledged in.
        let (c, d) = (t.write_sent(7), t.write_sent(7));
        t.write_done(7, d);
        t.write_done(7, c);
        let mut either = allowed(&mut t, 7).unwrap();
        either.sort_unstable();
        assert_eq!(either, vec![c, d]);
        // A write sent while a read is out may be what it finds.
        t.read_sent((1, 1), 7);
        let e = t.write_sent(7);
        assert!(t.read_done((1, 1)).unwrap().allowed.contains(&e));
        t.write_done(7, e);
        assert_eq!(allowed(&mut t, 7), Some(vec![e]));
        assert!(t.active.is_empty(), "nothing left in flight");
    }

    #[test]
    fn a_place_always_written_keeps_only_the_writes_that_may_still_be_there() {
        let mut t = Tracker::default();
        // Two writes always in flight: each acknowledged one is overwritten by the next.
        let mut out = vec![t.write_sent(3), t.write_sent(3)];
        for _ in 0..1000 {
            let done = out.remove(0);
            t.write_done(3, done);
            out.push(t.write_sent(3));
        }
        let n = t.active[&3].writes.len();
        assert!(n <= 4, "{n} writes kept for one place");
    }
}
