//! The model of a namespace: for each block, the contents a read may return. An acknowledged
//! write leaves exactly one; a write that failed or was cut off adds its own to those there
//! were (it may have landed or not) and marks the block tainted, and nothing writes a tainted
//! block again until a quiet point has read back which one it is.
//!
//! Contents are versions: version 0 is zeroes, version `v` of block `lba` of namespace
//! `nsid` is a pattern that starts with `v`, `lba` and `nsid` and goes on with numbers drawn
//! from them, so a block read back names the write it came from and shows whether it is
//! whole.

/// What a block may hold.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Cand {
    One(u32),
    Many(Vec<u32>),
}

impl Cand {
    fn contains(&self, v: u32) -> bool {
        match self {
            Cand::One(x) => *x == v,
            Cand::Many(xs) => xs.contains(&v),
        }
    }

    fn add(&mut self, v: u32) {
        match self {
            Cand::One(x) if *x == v => {}
            Cand::One(x) => *self = Cand::Many(vec![*x, v]),
            Cand::Many(xs) if xs.contains(&v) => {}
            Cand::Many(xs) => xs.push(v),
        }
    }

    fn list(&self) -> Vec<u32> {
        match self {
            Cand::One(x) => vec![*x],
            Cand::Many(xs) => xs.clone(),
        }
    }
}

/// One namespace of the target as the model knows it.
#[derive(Debug)]
pub struct NsModel {
    /// Its NSID.
    pub nsid: u32,
    /// Its block size.
    pub block_size: usize,
    /// Its blocks.
    pub blocks: u64,
    /// Whether a deallocated block reads zeroes (DLFEAT); else it reads what it held or
    /// zeroes.
    pub dealloc_reads_zeroes: bool,
    cand: Vec<Cand>,
    busy: Vec<u16>,
    tainted: Vec<bool>,
    tainted_count: usize,
}

/// Why a block read back is not what the model allows.
#[derive(Debug)]
pub struct Mismatch(pub String);

fn lcg(x: &mut u64) -> u64 {
    // splitmix64: every word of a block's pattern from its version, LBA and NSID.
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `out` (one block) with version `v` of block `lba` of namespace `nsid`.
pub fn fill_block(out: &mut [u8], nsid: u32, lba: u64, v: u32) {
    if v == 0 {
        out.fill(0);
        return;
    }
    let mut seed = (u64::from(v) << 32) ^ lba.rotate_left(17) ^ u64::from(nsid);
    for (i, w) in out.chunks_exact_mut(8).enumerate() {
        let word = match i {
            0 => u64::from(v),
            1 => lba,
            2 => u64::from(nsid),
            _ => lcg(&mut seed),
        };
        w.copy_from_slice(&word.to_le_bytes());
    }
}

/// The version a block read back holds, if it is a whole one of this block.
fn version_of(block: &[u8], nsid: u32, lba: u64, scratch: &mut [u8]) -> Result<u32, String> {
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&block[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    };
    if block.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let v = u32::try_from(word(0)).map_err(|_| format!("word 0 is {:#x}", word(0)))?;
    if v == 0 || word(1) != lba || word(2) != u64::from(nsid) {
        return Err(format!(
            "holds (version {}, LBA {}, NSID {}): not a block of this place",
            word(0),
            word(1),
            word(2)
        ));
    }
    fill_block(scratch, nsid, lba, v);
    if scratch != block {
        let at = scratch.iter().zip(block).position(|(a, b)| a != b);
        return Err(format!("version {v} torn at byte {at:?}"));
    }
    Ok(v)
}

impl NsModel {
    /// A namespace whose blocks all hold zeroes.
    pub fn new(nsid: u32, block_size: usize, blocks: u64, dealloc_reads_zeroes: bool) -> Self {
        let n = usize::try_from(blocks).unwrap_or(usize::MAX);
        NsModel {
            nsid,
            block_size,
            blocks,
            dealloc_reads_zeroes,
            cand: vec![Cand::One(0); n],
            busy: vec![0; n],
            tainted: vec![false; n],
            tainted_count: 0,
        }
    }

    fn range(lba: u64, nlb: u32) -> std::ops::Range<usize> {
        let a = usize::try_from(lba).unwrap_or(usize::MAX);
        a..a + nlb as usize
    }

    /// Whether blocks `lba..lba+nlb` are free of commands in flight (and, for `write`, not
    /// tainted).
    pub fn free(&self, lba: u64, nlb: u32, write: bool) -> bool {
        let r = Self::range(lba, nlb);
        self.busy[r.clone()].iter().all(|&b| b == 0)
            && (!write || self.tainted[r].iter().all(|&t| !t))
    }

    /// A command is in flight on the blocks.
    pub fn hold(&mut self, lba: u64, nlb: u32) {
        for b in &mut self.busy[Self::range(lba, nlb)] {
            *b += 1;
        }
    }

    /// The command in flight on the blocks is over.
    pub fn unhold(&mut self, lba: u64, nlb: u32) {
        for b in &mut self.busy[Self::range(lba, nlb)] {
            *b -= 1;
        }
    }

    /// Blocks now hold version `v` (acknowledged) or may hold it (`acked` false: tainted).
    pub fn wrote(&mut self, lba: u64, nlb: u32, v: u32, acked: bool) {
        for i in Self::range(lba, nlb) {
            if acked {
                self.cand[i] = Cand::One(v);
            } else {
                self.cand[i].add(v);
                self.taint(i);
            }
        }
    }

    /// Blocks were deallocated (`acked`) or may have been.
    pub fn deallocated(&mut self, lba: u64, nlb: u32, acked: bool) {
        if acked && self.dealloc_reads_zeroes {
            return self.wrote(lba, nlb, 0, true);
        }
        for i in Self::range(lba, nlb) {
            self.cand[i].add(0);
            if !acked {
                self.taint(i);
            }
        }
    }

    fn taint(&mut self, i: usize) {
        if !self.tainted[i] {
            self.tainted[i] = true;
            self.tainted_count += 1;
        }
    }

    /// Blocks that may hold more than one thing.
    pub fn tainted(&self) -> usize {
        self.tainted_count
    }

    /// The first run of tainted blocks from `from` on, at most `max` long: (LBA, count).
    pub fn next_tainted(&self, from: u64, max: u32) -> Option<(u64, u32)> {
        let start = usize::try_from(from).ok()?;
        let first = start + self.tainted.get(start..)?.iter().position(|&t| t)?;
        let n = self.tainted[first..]
            .iter()
            .take(max as usize)
            .take_while(|&&t| t)
            .count();
        Some((first as u64, n as u32))
    }

    /// Checks `data`, read from blocks `lba..`: every block must hold one of the versions the
    /// model allows. With `settle`, each block is then known to hold what it was read to
    /// hold (at a quiet point, when nothing can land on it any more).
    pub fn check_read(&mut self, lba: u64, data: &[u8], settle: bool) -> Vec<Mismatch> {
        let mut out = Vec::new();
        let mut scratch = vec![0u8; self.block_size];
        for (k, block) in data.chunks_exact(self.block_size).enumerate() {
            let at = lba + k as u64;
            let i = usize::try_from(at).unwrap_or(usize::MAX);
            match version_of(block, self.nsid, at, &mut scratch) {
                Ok(v) if self.cand[i].contains(v) => {
                    if settle {
                        self.cand[i] = Cand::One(v);
                        if self.tainted[i] {
                            self.tainted[i] = false;
                            self.tainted_count -= 1;
                        }
                    }
                }
                Ok(v) => out.push(Mismatch(format!(
                    "NSID {} LBA {at}: read version {v}, the model allows {:?}",
                    self.nsid,
                    self.cand[i].list()
                ))),
                Err(why) => out.push(Mismatch(format!(
                    "NSID {} LBA {at}: {why}; the model allows {:?}",
                    self.nsid,
                    self.cand[i].list()
                ))),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_names_its_version_and_place_and_a_torn_or_misplaced_one_is_caught() {
        let mut m = NsModel::new(2, 512, 64, true);
        let mut b = vec![0u8; 1024];
        fill_block(&mut b[..512], 2, 10, 7);
        fill_block(&mut b[512..], 2, 11, 7);
        m.wrote(10, 2, 7, true);
        assert!(m.check_read(10, &b, false).is_empty());
        // Read at the wrong place, from another namespace, torn, or an older version.
        assert_eq!(m.check_read(11, &b[..512], false).len(), 1);
        let mut other = NsModel::new(1, 512, 64, true);
        other.wrote(10, 1, 7, true);
        assert_eq!(other.check_read(10, &b[..512], false).len(), 1);
        b[300] ^= 1;
        assert_eq!(m.check_read(10, &b[..512], false).len(), 1);
        m.wrote(10, 1, 8, true);
        fill_block(&mut b[..512], 2, 10, 7);
        assert_eq!(m.check_read(10, &b[..512], false).len(), 1);
    }

    #[test]
    fn a_failed_write_allows_both_until_a_quiet_read_settles_the_block() {
        let mut m = NsModel::new(1, 512, 16, false);
        let mut b = vec![0u8; 512];
        m.wrote(3, 1, 5, true);
        m.wrote(3, 1, 6, false);
        assert_eq!(m.tainted(), 1);
        assert!(!m.free(3, 1, true), "a tainted block is not written again");
        assert!(m.free(3, 1, false), "but it is read");
        fill_block(&mut b, 1, 3, 5);
        assert!(m.check_read(3, &b, false).is_empty());
        fill_block(&mut b, 1, 3, 6);
        assert!(m.check_read(3, &b, true).is_empty());
        assert_eq!(m.tainted(), 0);
        fill_block(&mut b, 1, 3, 5);
        assert_eq!(m.check_read(3, &b, false).len(), 1, "settled on version 6");
        // A deallocation without DLFEAT's zeroes allows zeroes and what was there.
        m.deallocated(3, 1, true);
        assert!(m.check_read(3, &[0u8; 512], false).is_empty());
        fill_block(&mut b, 1, 3, 6);
        assert!(m.check_read(3, &b, false).is_empty());
    }
}
