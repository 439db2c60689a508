//! Commands that arrived while they could not be admitted, by lane: admin queues (and queues
//! not connected yet), I/O with a small buffer, I/O with a large one. Each lane is in arrival
//! order, and the oldest command that can be admitted goes first, so one lane that cannot be
//! admitted (every large buffer held by writes a stuck backend does not finish) holds up no
//! other: small I/O and Keep Alives of other hosts go on.

use std::collections::VecDeque;

use super::Class;

/// Which waiting line a command joins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Lane {
    /// A command of an admin queue, or of a queue not connected yet (its Fabrics Connect),
    /// with a small buffer (or none): Keep Alive, Connect, Identify.
    Admin = 0,
    /// An admin command with a large buffer (a long log page): it waits for large buffers
    /// without holding up the other admin commands.
    AdminLarge = 1,
    /// An I/O command with a small buffer (or none).
    Small = 2,
    /// An I/O command with a large buffer.
    Large = 3,
}

/// Every lane.
const LANES: [Lane; 4] = [Lane::Admin, Lane::AdminLarge, Lane::Small, Lane::Large];

impl Lane {
    /// The lane of a command of class `class` on a queue that is an admin queue (or not
    /// connected) when `admin`.
    pub(super) fn of(admin: bool, class: Class) -> Lane {
        match (admin, class) {
            (true, Class::Small) => Lane::Admin,
            (true, Class::Large) => Lane::AdminLarge,
            (false, Class::Small) => Lane::Small,
            (false, Class::Large) => Lane::Large,
        }
    }

    /// Whether the admin queues' reserve of request slots is open to it.
    pub(super) fn is_admin(self) -> bool {
        matches!(self, Lane::Admin | Lane::AdminLarge)
    }
}

/// A waiting command: its QP, receive and length, and its buffer class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Wait {
    pub(super) qpn: u32,
    pub(super) wr: u64,
    pub(super) len: u32,
    pub(super) class: Class,
    /// Arrival order across the lanes.
    seq: u64,
}

/// The lanes.
#[derive(Debug)]
pub(super) struct Waiting {
    lanes: [VecDeque<Wait>; 4],
    next_seq: u64,
    len: usize,
}

impl Waiting {
    /// Room for `cap` commands in each lane before any allocation.
    pub(super) fn with_capacity(cap: usize) -> Waiting {
        Waiting {
            lanes: [
                VecDeque::with_capacity(cap.min(256)),
                VecDeque::with_capacity(cap.min(256)),
                VecDeque::with_capacity(cap),
                VecDeque::with_capacity(cap),
            ],
            next_seq: 0,
            len: 0,
        }
    }

    /// Commands waiting, in every lane.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Whether lane `lane` has a command waiting.
    pub(super) fn has(&self, lane: Lane) -> bool {
        !self.lanes[lane as usize].is_empty()
    }

    /// Queues a command at the back of `lane`.
    pub(super) fn push(&mut self, lane: Lane, qpn: u32, wr: u64, len: u32, class: Class) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.len += 1;
        self.lanes[lane as usize].push_back(Wait {
            qpn,
            wr,
            len,
            class,
            seq,
        });
    }

    /// The lane whose first command is the oldest of those `admits` (lane, class) lets in.
    pub(super) fn next(&self, admits: impl Fn(Lane, Class) -> bool) -> Option<Lane> {
        LANES
            .into_iter()
            .filter_map(|l| {
                let w = self.lanes[l as usize].front()?;
                admits(l, w.class).then_some((w.seq, l))
            })
            .min()
            .map(|(_, l)| l)
    }

    /// Takes the first command of `lane`.
    pub(super) fn pop(&mut self, lane: Lane) -> Option<Wait> {
        let w = self.lanes[lane as usize].pop_front()?;
        self.len -= 1;
        Some(w)
    }

    /// Takes out every command of QP `qpn`, handing each to `gone`.
    pub(super) fn remove_qp(&mut self, qpn: u32, mut gone: impl FnMut(&Wait)) {
        for lane in &mut self.lanes {
            lane.retain(|w| {
                if w.qpn == qpn {
                    gone(w);
                }
                w.qpn != qpn
            });
        }
        self.len = self.lanes.iter().map(VecDeque::len).sum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_admitted_command_goes_first_and_a_blocked_lane_holds_up_no_other() {
        let mut w = Waiting::with_capacity(8);
        w.push(Lane::Large, 1, 10, 64, Class::Large);
        w.push(Lane::Small, 2, 11, 64, Class::Small);
        w.push(Lane::Admin, 3, 12, 64, Class::Small);
        w.push(Lane::Small, 2, 13, 64, Class::Small);
        assert_eq!(w.len(), 4);
        // Everything admitted: arrival order.
        assert_eq!(w.next(|_, _| true), Some(Lane::Large));
        // No large buffer: the small and admin commands go, in arrival order.
        let no_large = |_: Lane, c: Class| c == Class::Small;
        let mut order = Vec::new();
        while let Some(l) = w.next(no_large) {
            order.push(w.pop(l).unwrap().wr);
        }
        assert_eq!(order, [11, 12, 13]);
        assert_eq!(w.len(), 1);
        // Only admin commands (the I/O slots are all taken): the large one waits.
        w.push(Lane::Admin, 3, 14, 64, Class::Small);
        assert_eq!(w.next(|l, _| l == Lane::Admin), Some(Lane::Admin));
        assert_eq!(w.pop(Lane::Admin).unwrap().wr, 14);
        assert_eq!(w.next(|l, _| l == Lane::Admin), None);
        assert!(w.has(Lane::Large) && !w.has(Lane::Small));
    }

    #[test]
    fn an_admin_command_waiting_for_a_large_buffer_holds_up_no_keep_alive() {
        let mut w = Waiting::with_capacity(8);
        w.push(Lane::of(true, Class::Large), 1, 10, 64, Class::Large);
        w.push(Lane::of(true, Class::Small), 2, 11, 64, Class::Small);
        let no_large = |_: Lane, c: Class| c == Class::Small;
        assert_eq!(w.next(no_large), Some(Lane::Admin));
        assert_eq!(w.pop(Lane::Admin).unwrap().wr, 11);
        assert_eq!(w.next(no_large), None);
        assert!(Lane::AdminLarge.is_admin() && !Lane::Large.is_admin());
    }

    #[test]
    fn a_qp_torn_down_takes_its_waiting_commands_out_of_every_lane() {
        let mut w = Waiting::with_capacity(8);
        w.push(Lane::Large, 1, 10, 64, Class::Large);
        w.push(Lane::Small, 2, 11, 64, Class::Small);
        w.push(Lane::Small, 1, 12, 64, Class::Small);
        w.push(Lane::Admin, 1, 13, 64, Class::Small);
        let mut gone = Vec::new();
        w.remove_qp(1, |x| gone.push(x.wr));
        gone.sort_unstable();
        assert_eq!(gone, [10, 12, 13]);
        assert_eq!(w.len(), 1);
        assert_eq!(w.next(|_, _| true), Some(Lane::Small));
    }
}
