//! The fabric's objects of one kind (QPs, CQs, SRQs, memory regions), found by ID with no
//! hashing: an ID names its slot, as a NIC's QP numbers and memory keys index its tables.
//!
//! An ID is `(slot + 1) << 8 | variant`: the slot's index (never 0, so no ID is 0), and in the
//! low byte a variant taken from a fabric-wide counter when the ID is made, as mlx5 makes a
//! memory key's. An ID names its object only while the object lives: a lookup compares the
//! whole ID, so a destroyed object's ID, or a key with any bit changed, finds nothing even
//! once the slot is used again (with another variant). Free slots are used again oldest
//! first, so a destroyed QP's number does not come back at once.

use std::collections::VecDeque;

struct Slot<T> {
    id: u32,
    val: Option<T>,
}

pub(crate) struct Table<T> {
    slots: Vec<Slot<T>>,
    free: VecDeque<u32>,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Table {
            slots: Vec::new(),
            free: VecDeque::new(),
        }
    }
}

/// Slots in a table: an ID is 32 bits, of which the low 8 are its variant.
const MAX_SLOTS: u32 = (1 << 24) - 1;

/// The slot an ID names (`usize::MAX`, which is no slot, for IDs below 0x100).
fn slot_of(id: u32) -> usize {
    ((id >> 8) as usize).wrapping_sub(1)
}

impl<T> Table<T> {
    /// Adds `val` under a new ID, whose low byte is `variant`; `None` when all 2^24 - 1
    /// slots are taken.
    pub(crate) fn insert_new(&mut self, variant: u8, val: T) -> Option<u32> {
        let slot = match self.free.pop_front() {
            Some(s) => s,
            None => {
                let s = u32::try_from(self.slots.len())
                    .ok()
                    .filter(|&s| s < MAX_SLOTS)?;
                self.slots.push(Slot { id: 0, val: None });
                s
            }
        };
        let id = ((slot + 1) << 8) | u32::from(variant);
        let e = &mut self.slots[slot as usize];
        e.id = id;
        e.val = Some(val);
        Some(id)
    }

    /// Adds `val` under the given ID, if its slot is free (a slot never used yet counts as
    /// free, as do those before it); gives `val` back, and adds nothing, when it is not.
    pub(crate) fn insert_at(&mut self, id: u32, val: T) -> Result<(), T> {
        let slot = slot_of(id);
        if slot >= MAX_SLOTS as usize {
            return Err(val);
        }
        while self.slots.len() <= slot {
            let s = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
            self.slots.push(Slot { id: 0, val: None });
            if self.slots.len() <= slot {
                self.free.push_back(s);
            }
        }
        if self.slots[slot].val.is_some() {
            return Err(val);
        }
        self.free.retain(|&s| s as usize != slot);
        self.slots[slot] = Slot { id, val: Some(val) };
        Ok(())
    }

    #[inline]
    pub(crate) fn get(&self, id: &u32) -> Option<&T> {
        match self.slots.get(slot_of(*id)) {
            Some(Slot {
                id: i,
                val: Some(v),
            }) if *i == *id => Some(v),
            _ => None,
        }
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, id: &u32) -> Option<&mut T> {
        match self.slots.get_mut(slot_of(*id)) {
            Some(Slot {
                id: i,
                val: Some(v),
            }) if *i == *id => Some(v),
            _ => None,
        }
    }

    pub(crate) fn remove(&mut self, id: &u32) -> Option<T> {
        let slot = slot_of(*id);
        let e = self.slots.get_mut(slot).filter(|e| e.id == *id)?;
        let v = e.val.take()?;
        self.free.push_back(u32::try_from(slot).unwrap_or(u32::MAX));
        Some(v)
    }

    /// The live objects with their IDs, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&u32, &T)> {
        self.slots
            .iter()
            .filter_map(|e| e.val.as_ref().map(|v| (&e.id, v)))
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().filter_map(|e| e.val.as_ref())
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &u32> {
        self.iter().map(|(k, _)| k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_finds_its_object_only_while_it_lives_and_never_with_a_bit_changed() {
        let mut t = Table::default();
        let a = t.insert_new(0x11, "a").unwrap();
        let b = t.insert_new(0x12, "b").unwrap();
        assert_ne!(a, 0);
        assert_eq!(t.get(&a), Some(&"a"));
        assert_eq!(t.get(&b), Some(&"b"));
        for bit in 0..32 {
            assert_eq!(t.get(&(a ^ (1 << bit))), None, "bit {bit}");
        }
        assert_eq!(t.get(&0), None);
        assert_eq!(t.get(&u32::MAX), None);
        assert_eq!(t.remove(&a), Some("a"));
        assert_eq!(t.get(&a), None);
        assert_eq!(t.remove(&a), None);
        assert_eq!(t.iter().count(), 1);
        // The freed slot comes back with another variant: the old ID still finds nothing.
        let c = t.insert_new(0x13, "c").unwrap();
        assert_eq!(c >> 8, a >> 8);
        assert_eq!(t.get(&a), None);
        assert_eq!(t.get(&c), Some(&"c"));
        assert_eq!(
            t.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
            [(c, "c"), (b, "b")]
        );
    }

    #[test]
    fn freed_slots_come_back_oldest_first_and_a_given_id_takes_its_slot_only_if_free() {
        let mut t = Table::default();
        let ids: Vec<u32> = (0..4).map(|i| t.insert_new(i, i).unwrap()).collect();
        t.remove(&ids[2]);
        t.remove(&ids[0]);
        assert_eq!(t.insert_new(9, 9).unwrap() >> 8, ids[2] >> 8);
        // ids[0]'s slot is free: its number can be given again; a taken slot refuses.
        assert!(t.insert_at(ids[0], 0).is_ok());
        assert_eq!(t.get(&ids[0]), Some(&0));
        assert_eq!(t.insert_at(ids[1] ^ 1, 7), Err(7));
        assert_eq!(t.get(&ids[1]), Some(&1));
        // A slot past the end: those before it are free for later IDs.
        assert!(t.insert_at((10 << 8) | 5, 10).is_ok());
        assert_eq!(t.insert_new(1, 4).unwrap() >> 8, 5);
        assert_eq!(t.iter().count(), 6);
        assert_eq!(
            t.insert_at(0x5f, 1),
            Err(1),
            "an ID below 0x100 names no slot"
        );
    }
}
