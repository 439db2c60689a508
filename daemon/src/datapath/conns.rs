//! The live connections' table: a slab indexed by connection, with a map by QP number.

use super::conn::Conn;
use super::*;

/// The live connections: a slab, so that a request finds its connection by index
/// ([`Conns::at`], one bounds check and a QP number compare), and a map from QP number to
/// index for what names a QP (receive completions, CM and async events).
#[derive(Default)]
pub(super) struct Conns {
    slots: Vec<Option<Conn>>,
    free: Vec<u32>,
    by_qpn: HashMap<u32, u32>,
}

/// No connection: the index of a request that has none (an AER's, or one whose QP is gone).
pub(super) const NO_CONN: u32 = u32::MAX;
/// Connection indexes from here up name no connection. The requests a QP destroyed with its
/// drain timed out leaves at the backend carry its lingering queue's tag (`ORPHANS` up to
/// `NO_CONN`): two destroyed QPs of one number (the device reused it) are told apart, and one
/// request stuck at a backend holds its own queue alone.
pub(super) const ORPHANS: u32 = u32::MAX - (1 << 16);

/// Whether connection index `c` names a connection (not none, not a lingering queue's tag).
pub(super) fn has_conn(c: u32) -> bool {
    c < ORPHANS
}

impl Conns {
    /// Adds `c` under its QP number; returns its index.
    pub(super) fn insert(&mut self, c: Conn) -> u32 {
        let qpn = c.qpn;
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(c);
                i
            }
            None => {
                self.slots.push(Some(c));
                u32::try_from(self.slots.len() - 1).unwrap_or(NO_CONN)
            }
        };
        if let Some(old) = self.by_qpn.insert(qpn, i) {
            // A QP number still mapped is a bug; the old entry goes with it.
            self.slots[old as usize] = None;
            self.free.push(old);
        }
        i
    }

    /// Removes the connection of QP `qpn`.
    pub(super) fn remove(&mut self, qpn: &u32) -> Option<Conn> {
        let i = self.by_qpn.remove(qpn)?;
        let c = self.slots.get_mut(i as usize)?.take();
        self.free.push(i);
        c
    }

    /// The connection of QP `qpn`, by its map.
    pub(super) fn get_mut(&mut self, qpn: &u32) -> Option<&mut Conn> {
        let i = *self.by_qpn.get(qpn)?;
        self.slots.get_mut(i as usize)?.as_mut()
    }

    /// The connection of QP `qpn`, by its map.
    pub(super) fn get(&self, qpn: &u32) -> Option<&Conn> {
        let i = *self.by_qpn.get(qpn)?;
        self.slots.get(i as usize)?.as_ref()
    }

    /// The connection of QP `qpn` and its index, by its map.
    pub(super) fn get_mut_at(&mut self, qpn: &u32) -> Option<(u32, &mut Conn)> {
        let i = *self.by_qpn.get(qpn)?;
        Some((i, self.slots.get_mut(i as usize)?.as_mut()?))
    }

    /// The index of QP `qpn`'s connection, or [`NO_CONN`].
    pub(super) fn index_of(&self, qpn: u32) -> u32 {
        self.by_qpn.get(&qpn).copied().unwrap_or(NO_CONN)
    }

    /// The connection at index `i`, if it is still QP `qpn`'s (an index is reused once its
    /// connection is gone).
    pub(super) fn at(&mut self, i: u32, qpn: u32) -> Option<&mut Conn> {
        self.slots
            .get_mut(i as usize)?
            .as_mut()
            .filter(|c| c.qpn == qpn)
    }

    /// [`Conns::at`], shared.
    pub(super) fn get_at(&self, i: u32, qpn: u32) -> Option<&Conn> {
        self.slots
            .get(i as usize)?
            .as_ref()
            .filter(|c| c.qpn == qpn)
    }

    pub(super) fn contains_key(&self, qpn: &u32) -> bool {
        self.by_qpn.contains_key(qpn)
    }

    pub(super) fn len(&self) -> usize {
        self.by_qpn.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_qpn.is_empty()
    }

    /// Every connection, with its QP number.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&u32, &Conn)> {
        self.slots.iter().flatten().map(|c| (&c.qpn, c))
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Conn> {
        self.slots.iter().flatten()
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut Conn> {
        self.slots.iter_mut().flatten()
    }

    /// Takes the connection at index `i` out of its slot (its index and QP number stay
    /// reserved) for work that needs it and the data path at once; [`Conns::put_back`]
    /// returns it.
    pub(super) fn take_at(&mut self, i: u32) -> Option<Conn> {
        self.slots.get_mut(i as usize)?.take()
    }

    /// Returns a connection taken with [`Conns::take_at`] to its slot.
    pub(super) fn put_back(&mut self, i: u32, c: Conn) {
        if let Some(s) = self.slots.get_mut(i as usize) {
            *s = Some(c);
        }
    }
}
