//! The fabric's objects of one kind (QPs, CQs, SRQs, memory regions), found by ID with no
//! hashing: an ID names its slot, as a NIC's QP numbers and memory keys index its tables.
//!
//! An ID is `(slot + 1) << 8 | variant` (never 0, and never below 0x100). A slot's first
//! variant is a byte of the fabric's ID counter (so neighbouring slots differ); each reuse of
//! the slot adds one, as mlx5 varies a memory key. A lookup compares the whole ID, so a
//! destroyed object's ID, or a key with a bit changed, finds nothing: a slot gives the same
//! ID again only after 256 reuses. Free slots are reused oldest first, so that takes long.

use std::collections::VecDeque;

struct Slot<T> {
    /// The ID of the slot's object, or of its last one while the slot is free.
    id: u32,
    val: Option<T>,
    /// When its object was made, in the table's count of objects made.
    born: u64,
}

pub(crate) struct Table<T> {
    slots: Vec<Slot<T>>,
    free: VecDeque<u32>,
    made: u64,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Table {
            slots: Vec::new(),
            free: VecDeque::new(),
            made: 0,
        }
    }
}

/// Slots in a table: an ID is 32 bits, of which the low 8 are its variant.
const MAX_SLOTS: u32 = (1 << 24) - 1;

/// How far past its last slot a table takes a given ID ([`Table::insert_at`]): a number
/// from elsewhere does not make it allocate its whole range.
const AHEAD: usize = 4096;

/// The slot an ID names (`usize::MAX`, which is no slot, for IDs below 0x100).
fn slot_of(id: u32) -> usize {
    ((id >> 8) as usize).wrapping_sub(1)
}

impl<T> Table<T> {
    /// Adds `val` under a new ID: in a free slot, with the slot's next variant, or in a new
    /// one, with `variant`. `None` when all [`MAX_SLOTS`] are taken.
    pub(crate) fn insert_new(&mut self, variant: u8, val: T) -> Option<u32> {
        let (slot, variant) = match self.free.pop_front() {
            Some(s) => (
                s,
                self.slots[s as usize].id.to_le_bytes()[0].wrapping_add(1),
            ),
            None => {
                let s = u32::try_from(self.slots.len())
                    .ok()
                    .filter(|&s| s < MAX_SLOTS)?;
                self.slots.push(Slot {
                    id: 0,
                    val: None,
                    born: 0,
                });
                (s, variant)
            }
        };
        let id = ((slot + 1) << 8) | u32::from(variant);
        self.made += 1;
        self.slots[slot as usize] = Slot {
            id,
            val: Some(val),
            born: self.made,
        };
        Some(id)
    }

    /// Adds `val` under the given ID, if its slot is free (a slot not used yet counts as
    /// free, up to [`AHEAD`] past the last one); gives `val` back, and adds nothing, when it
    /// is not.
    pub(crate) fn insert_at(&mut self, id: u32, val: T) -> Result<(), T> {
        let slot = slot_of(id);
        if slot >= MAX_SLOTS as usize || slot >= self.slots.len() + AHEAD {
            return Err(val);
        }
        while self.slots.len() <= slot {
            let s = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
            self.slots.push(Slot {
                id: 0,
                val: None,
                born: 0,
            });
            if self.slots.len() <= slot {
                self.free.push_back(s);
            }
        }
        if self.slots[slot].val.is_some() {
            return Err(val);
        }
        self.free.retain(|&s| s as usize != slot);
        self.made += 1;
        self.slots[slot] = Slot {
            id,
            val: Some(val),
            born: self.made,
        };
        Ok(())
    }

    /// When the object `id` names was made, counted in objects made by the table: IDs do
    /// not grow with age.
    pub(crate) fn born(&self, id: &u32) -> Option<u64> {
        self.get(id)?;
        Some(self.slots[slot_of(*id)].born)
    }

    #[inline]
    pub(crate) fn get(&self, id: &u32) -> Option<&T> {
        match self.slots.get(slot_of(*id)) {
            Some(Slot {
                id: i,
                val: Some(v),
                ..
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
                ..
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

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.slots.iter_mut().filter_map(|e| e.val.as_mut())
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
        // The freed slot comes back with its next variant: the old ID still finds nothing.
        let c = t.insert_new(0x11, "c").unwrap();
        assert_eq!(c, a + 1);
        assert_eq!(t.get(&a), None);
        assert_eq!(t.get(&c), Some(&"c"));
        assert_eq!(
            t.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
            [(c, "c"), (b, "b")]
        );
        // Newer objects are born later, whatever their slots.
        assert!(t.born(&c) > t.born(&b));
        assert_eq!(t.born(&a), None);
    }

    #[test]
    fn a_slot_gives_an_id_again_only_after_256_reuses() {
        let mut t = Table::default();
        let first = t.insert_new(0x5f, ()).unwrap();
        let mut seen = std::collections::HashSet::from([first]);
        let mut id = first;
        for _ in 0..255 {
            t.remove(&id);
            id = t.insert_new(0x5f, ()).unwrap();
            assert!(seen.insert(id), "{id:#x} again");
        }
        t.remove(&id);
        assert_eq!(t.insert_new(0x5f, ()), Some(first));
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
        assert_eq!(
            t.insert_at(0xffff_ff00, 1),
            Err(1),
            "far past the last slot: refused, not allocated"
        );
    }
}
