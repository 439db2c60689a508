//! `nvmf verify`: writes of one block doubling up to the largest transfer, each read back at
//! once and all read back again at the end, with a pattern of the run.

use nvmfd_nvme::host::{HostTransport, IoQueue};

/// What a verify run checked.
#[derive(Debug, PartialEq, Eq)]
pub struct Verified {
    /// Writes made and read back (twice).
    pub writes: u32,
    /// The largest of them, in bytes.
    pub largest: usize,
}

/// Writes regions of 1, 2, 4, ... blocks of `bs` bytes one after the other from LBA 0 of
/// namespace `nsid` (`nsze` blocks), up to `largest` bytes or as many as fit, each with
/// [`crate::verify_pattern`] of `seed`; reads each back at once and, once all are written,
/// every one again. The second pass finds a target that puts data at the wrong LBA the
/// same way for reads and writes (one that ignores SLBA, or counts it in other units): each
/// region read back at once matches, but a later write landed on it.
pub fn verify<T: HostTransport>(
    io: &mut IoQueue<T>,
    nsid: u32,
    (bs, nsze): (usize, u64),
    largest: usize,
    seed: u64,
) -> Result<Verified, String> {
    let mut regions = Vec::new();
    let (mut len, mut lba) = (bs, 0u64);
    while len <= largest {
        let nlb = u32::try_from(len / bs).map_err(|e| e.to_string())?;
        if lba + u64::from(nlb) > nsze {
            break;
        }
        let data = crate::verify_pattern(seed, lba, bs, len);
        io.write(nsid, lba, nlb, &data, false)
            .map_err(|e| format!("write {len} bytes at LBA {lba}: {e}"))?;
        check(io, nsid, (lba, nlb), &data, "")?;
        regions.push((lba, nlb, len));
        lba += u64::from(nlb);
        len *= 2;
    }
    let Some(&(_, _, biggest)) = regions.last() else {
        return Err(format!(
            "namespace {nsid} holds {nsze} blocks: no write of one block fits"
        ));
    };
    io.flush(nsid).map_err(|e| e.to_string())?;
    for &(lba, nlb, len) in &regions {
        let data = crate::verify_pattern(seed, lba, bs, len);
        check(
            io,
            nsid,
            (lba, nlb),
            &data,
            " once every region was written",
        )?;
    }
    Ok(Verified {
        writes: u32::try_from(regions.len()).unwrap_or(u32::MAX),
        largest: biggest,
    })
}

/// Reads `nlb` blocks at `lba` and compares them with `data`.
fn check<T: HostTransport>(
    io: &mut IoQueue<T>,
    nsid: u32,
    (lba, nlb): (u64, u32),
    data: &[u8],
    when: &str,
) -> Result<(), String> {
    let mut back = vec![0u8; data.len()];
    io.read(nsid, lba, nlb, &mut back)
        .map_err(|e| format!("read {} bytes at LBA {lba}: {e}", data.len()))?;
    if back != data {
        return Err(format!(
            "data differs: {} bytes at LBA {lba}{when}",
            data.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use nvmfd_nvme::host::{DataDir, HostError, HostId, HostTransport, IoQueue};
    use nvmfd_nvme::wire::{self, Cqe, Sqe};

    /// A target in memory whose namespace of `nsze` blocks of `bs` bytes stores a command's
    /// blocks where `place` maps its SLBA.
    struct Fake {
        bs: usize,
        nsze: u64,
        data: Vec<u8>,
        place: fn(u64) -> u64,
    }

    impl HostTransport for Fake {
        fn execute(&mut self, sqe: Sqe, data: DataDir<'_>) -> Result<Cqe, HostError> {
            let mut c: Cqe = wire::zeroed();
            c.cid = sqe.cid;
            let slba = u64::from(sqe.cdw10.get()) | u64::from(sqe.cdw11.get()) << 32;
            let nlb = u64::from(sqe.cdw12.get() & 0xffff) + 1;
            let at = (self.place)(slba);
            let range = || {
                let start = usize::try_from(at).unwrap() * self.bs;
                start..start + usize::try_from(nlb).unwrap() * self.bs
            };
            let status: u16 = match (sqe.opcode, data) {
                (0x7f | 0x00, _) => 0,
                _ if slba + nlb > self.nsze || at + nlb > self.nsze => 0x80, // LBA Out of Range
                (0x01, DataDir::ToTarget(d)) => {
                    let r = range();
                    self.data[r].copy_from_slice(d);
                    0
                }
                (0x02, DataDir::FromTarget(d)) => {
                    let r = range();
                    d.copy_from_slice(&self.data[r]);
                    0
                }
                _ => 0x01,
            };
            c.status = zerocopy::little_endian::U16::new(status << 1);
            Ok(c)
        }
    }

    fn queue(bs: usize, nsze: u64, place: fn(u64) -> u64) -> IoQueue<Fake> {
        let fake = Fake {
            bs,
            nsze,
            data: vec![0; usize::try_from(nsze).unwrap() * bs],
            place,
        };
        let host = HostId {
            nqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000001".into(),
            id: [1; 16],
        };
        IoQueue::connect(fake, &host, "nqn.2024-01.io.nvmfd.test:v", 1, 1, 31).unwrap()
    }

    #[test]
    fn a_target_that_stores_where_it_is_told_passes() {
        let mut io = queue(512, 4096, |lba| lba);
        let v = super::verify(&mut io, 1, (512, 4096), 128 * 1024, 7).unwrap();
        assert_eq!(v.writes, 9, "512 B to 128 KiB");
        assert_eq!(v.largest, 128 * 1024);
    }

    #[test]
    fn a_target_that_misplaces_blocks_alike_for_reads_and_writes_fails() {
        // It ignores SLBA; it counts SLBA in 4 KiB units on a 512-byte namespace (reading
        // 512-byte LBAs as eighths). Each region read back at once matched before.
        for place in [(|_| 0) as fn(u64) -> u64, |lba| lba / 8] {
            let mut io = queue(512, 4096, place);
            let e = super::verify(&mut io, 1, (512, 4096), 128 * 1024, 7).unwrap_err();
            assert!(e.contains("once every region was written"), "{e}");
        }
    }

    #[test]
    fn a_namespace_smaller_than_the_writes_is_verified_as_far_as_it_goes() {
        // 64 KiB: regions of 1 to 64 blocks (32 KiB) fit from LBA 0 (127 blocks in all).
        let mut io = queue(512, 128, |lba| lba);
        let v = super::verify(&mut io, 1, (512, 128), 128 * 1024, 7).unwrap();
        assert_eq!((v.writes, v.largest), (7, 32 * 1024));
        // Not one block: said so.
        let mut io = queue(512, 0, |lba| lba);
        let e = super::verify(&mut io, 1, (512, 0), 128 * 1024, 7).unwrap_err();
        assert!(e.contains("no write of one block fits"), "{e}");
    }
}
