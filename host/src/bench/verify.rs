//! `--verify`: what a written block holds, and the check of a block read.
//!
//! A block is a header (a tag, its LBA, the stamp of its write) and bytes drawn from a
//! generator seeded by LBA and stamp, so a read finds any block that is torn, stale from
//! another place (wrong LBA) or altered; and, given the stamps it may find, one left from a
//! write older than an acknowledged one (a lost write) or zeroes where a write landed.

const TAG: &[u8; 8] = b"nvmfdvfy";

fn fill(block: &mut [u8], lba: u64, stamp: u64) {
    block[..8].copy_from_slice(TAG);
    block[8..16].copy_from_slice(&lba.to_le_bytes());
    block[16..24].copy_from_slice(&stamp.to_le_bytes());
    let mut rng = fastrand::Rng::with_seed(lba ^ stamp.rotate_left(17));
    rng.fill(&mut block[24..]);
}

/// Fills `buf` (whole blocks of `block_size` from `lba`) for a write stamped `stamp`.
pub fn stamp(buf: &mut [u8], lba: u64, block_size: u32, stamp: u64) {
    for (i, block) in buf.chunks_mut(block_size as usize).enumerate() {
        fill(block, lba + i as u64, stamp);
    }
}

/// Checks the blocks of `buf`, read from `lba`: the blocks found written and intact, or
/// what is wrong with the first that is not. With `allowed`, every block must hold the
/// write of one of those stamps; without, any intact block or zeroes pass.
pub fn check(
    buf: &[u8],
    lba: u64,
    block_size: u32,
    allowed: Option<&[u64]>,
) -> Result<u64, String> {
    let mut expect = vec![0u8; block_size as usize];
    let mut written = 0;
    for (i, block) in buf.chunks(block_size as usize).enumerate() {
        let at = lba + i as u64;
        if block.iter().all(|&b| b == 0) {
            if allowed.is_some() {
                return Err(format!(
                    "block {at} reads as zeroes after a write to it was acknowledged: \
                     a write was lost"
                ));
            }
            continue;
        }
        if &block[..8] != TAG {
            return Err(format!(
                "block {at} holds neither a written pattern nor zeroes"
            ));
        }
        let found = u64::from_le_bytes(block[8..16].try_into().unwrap_or_default());
        if found != at {
            return Err(format!(
                "block {at} holds the data written to block {found}"
            ));
        }
        let stamp = u64::from_le_bytes(block[16..24].try_into().unwrap_or_default());
        fill(&mut expect[..block.len()], at, stamp);
        if block != &expect[..block.len()] {
            return Err(format!("block {at} is torn or altered after its header"));
        }
        if let Some(allowed) = allowed.filter(|a| !a.contains(&stamp)) {
            return Err(format!(
                "block {at} holds an older write (stamp {stamp:#x}) than the one \
                 acknowledged (stamps it may hold: {allowed:x?}): a write was lost"
            ));
        }
        written += 1;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_block_checks_and_every_damage_is_named() {
        let mut buf = vec![0u8; 4 * 512];
        assert_eq!(check(&buf, 100, 512, None), Ok(0), "zeroes: never written");
        assert!(check(&buf, 100, 512, Some(&[7]))
            .unwrap_err()
            .contains("block 100 reads as zeroes after a write"));
        stamp(&mut buf, 100, 512, 7);
        assert_eq!(check(&buf, 100, 512, None), Ok(4));
        assert_eq!(check(&buf, 100, 512, Some(&[6, 7])), Ok(4));
        assert!(check(&buf, 100, 512, Some(&[8]))
            .unwrap_err()
            .contains("block 100 holds an older write (stamp 0x7)"));
        assert!(check(&buf, 101, 512, None)
            .unwrap_err()
            .contains("written to block 100"));
        let mut torn = buf.clone();
        torn[512 + 300] ^= 1;
        assert!(check(&torn, 100, 512, None)
            .unwrap_err()
            .contains("block 101 is torn"));
        let mut junk = buf.clone();
        junk[1024] = 0xff;
        assert!(check(&junk, 100, 512, None)
            .unwrap_err()
            .contains("block 102 holds neither"));
    }
}
