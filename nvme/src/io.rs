//! NVM command set I/O commands: validation, and their translation into block operations.

use zerocopy::FromBytes;

use crate::block::BlockFailure;

use crate::queue::{Action, Command, IoOp, IoRequest, Queue};
use crate::target::Subsystem;
use crate::wire::{self, io_opcode as op, status, Sqe, Status};

/// Bytes of the ranges a Dataset Management command lists (NR + 1 ranges of 16 bytes).
fn ranges_len(sqe: &Sqe) -> u32 {
    ((sqe.cdw10.get() & 0xFF) + 1) * 16
}

/// Largest number of Dataset Management ranges (NR is 0's based, 8 bits).
pub const DSM_MAX_RANGES: u32 = 256;

/// The Dataset Management processing limits a controller reports (Identify CNS 06h, NVM
/// command set: DMRL, DMRSL, DMSL; NVM Command Set 1.0, 3.2.3.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DsmLimits {
    /// DMRL: ranges processed per command.
    pub ranges: u8,
    /// DMRSL: logical blocks processed per range.
    pub range_blocks: u32,
    /// DMSL: logical blocks processed per command.
    pub blocks: u64,
}

impl DsmLimits {
    /// The limits for a subsystem's namespaces, or `None` when Dataset Management is not
    /// offered (ONCS bit 2 clear: some namespace cannot deallocate), and then all three fields
    /// stay 0.
    ///
    /// The specification has all three limits non-zero or all 0, and a limit not imposed at
    /// its field's largest value. So: DMRL is 255, the largest a one-byte, 1's based field
    /// holds (256 ranges, what NR allows, cannot be written); DMSL is not imposed. DMRSL is the
    /// smallest `deallocate_max_blocks` over the namespaces, each in its own logical blocks
    /// (the Linux host converts DMRSL with each namespace's block size), so that a range a host
    /// sends within it is one backend operation on every namespace; with no backend limit it
    /// is the field's largest value, and such a range (at most 2^32 - 1 blocks) still fits the
    /// data path's byte ranges. A longer range is not refused: the data path splits it.
    pub fn of(s: &Subsystem) -> Option<DsmLimits> {
        if s.namespaces.is_empty() || !s.namespaces.iter().all(|n| n.info.deallocate) {
            return None;
        }
        let range_blocks = s
            .namespaces
            .iter()
            .map(|n| n.info.deallocate_max_blocks)
            .filter(|&b| b > 0)
            .min()
            .unwrap_or(u32::MAX);
        Some(DsmLimits {
            ranges: u8::MAX,
            range_blocks,
            blocks: u64::MAX,
        })
    }
}

pub(crate) fn handle(q: &mut Queue, cmd: Command, icd: &[u8]) -> Action {
    let sqe = cmd.sqe;
    // An opcode the command set lacks is refused as such, before its NSID is looked at.
    if !matches!(
        sqe.opcode,
        op::READ | op::WRITE | op::FLUSH | op::WRITE_ZEROES | op::DATASET_MANAGEMENT
    ) {
        return q.respond(&cmd, status::INVALID_OPCODE, 0);
    }
    let nsid = sqe.nsid.get();
    let Some(ns) = q.subsystem().and_then(|s| s.namespace(nsid)) else {
        return q.respond(&cmd, status::INVALID_NAMESPACE, 0);
    };
    let info = &ns.info;
    let lbs = u64::from(info.logical_block_size);
    let slba = u64::from(sqe.cdw10.get()) | u64::from(sqe.cdw11.get()) << 32;
    let nlb = u64::from(sqe.cdw12.get() & 0xFFFF) + 1;
    // LBA range: slba + nlb must not overflow nor pass the end.
    let in_range = slba
        .checked_add(nlb)
        .is_some_and(|end| end <= info.blocks());
    let writes = matches!(
        sqe.opcode,
        op::WRITE | op::WRITE_ZEROES | op::DATASET_MANAGEMENT
    );
    if writes && info.read_only {
        return q.respond(&cmd, status::NAMESPACE_WRITE_PROTECTED, 0);
    }
    let max_io = q.target().limits().max_io_size;
    match sqe.opcode {
        op::READ | op::WRITE => {
            if !in_range {
                return q.respond(&cmd, status::LBA_OUT_OF_RANGE, 0);
            }
            let bytes = nlb * lbs;
            if bytes > u64::from(max_io) {
                return q.respond(&cmd, status::INVALID_FIELD, 0);
            }
            let len: u32 = wire::sat(bytes);
            let offset = slba * lbs;
            let write = sqe.opcode == op::WRITE;
            let data = match q.data_ref(&sqe, len, write, icd) {
                Ok(d) => d,
                Err(st) => return q.respond(&cmd, st, 0),
            };
            let fua = sqe.cdw12.get() & (1 << 30) != 0;
            let op = if write {
                IoOp::Write { offset, len, fua }
            } else {
                IoOp::Read { offset, len }
            };
            Action::Io(IoRequest {
                cmd,
                nsid,
                op,
                data: Some(data),
            })
        }
        op::FLUSH => match q.no_data(&sqe) {
            Ok(()) => Action::Io(IoRequest {
                cmd,
                nsid,
                op: IoOp::Flush,
                data: None,
            }),
            Err(st) => q.respond(&cmd, st, 0),
        },
        op::WRITE_ZEROES => {
            if !info.write_zeroes {
                return q.respond(&cmd, status::INVALID_OPCODE, 0);
            }
            if let Err(st) = q.no_data(&sqe) {
                return q.respond(&cmd, st, 0);
            }
            if !in_range {
                return q.respond(&cmd, status::LBA_OUT_OF_RANGE, 0);
            }
            Action::Io(IoRequest {
                cmd,
                nsid,
                op: IoOp::WriteZeroes {
                    offset: slba * lbs,
                    len: nlb * lbs,
                    fua: sqe.cdw12.get() & (1 << 30) != 0,
                },
                data: None,
            })
        }
        op::DATASET_MANAGEMENT => {
            if !info.deallocate {
                return q.respond(&cmd, status::INVALID_OPCODE, 0);
            }
            // The host may describe more data than its ranges fill: Linux always sends a
            // 4096-byte range buffer (room for 256 ranges, whatever NR says). As the kernel
            // target does (nvmet_check_data_len_lte), any transfer at least as long as the
            // ranges is taken, a shorter one is Data SGL Length Invalid, and only the bytes
            // of the NR + 1 ranges are fetched.
            match q.data_ref_at_least(&sqe, ranges_len(&sqe), true, icd) {
                Ok(from) => Action::Fetch { cmd, from },
                Err(st) => q.respond(&cmd, st, 0),
            }
        }
        _ => q.respond(&cmd, status::INVALID_OPCODE, 0),
    }
}

/// Dataset Management ranges arrived: deallocate them when AD is set (other attributes are
/// hints, which a target may ignore).
pub(crate) fn data_arrived(q: &mut Queue, cmd: Command, data: &[u8]) -> Action {
    let sqe = cmd.sqe;
    if sqe.opcode != op::DATASET_MANAGEMENT {
        return q.respond(&cmd, status::INTERNAL_ERROR, 0);
    }
    let nsid = sqe.nsid.get();
    let Some((lbs, blocks)) = q
        .subsystem()
        .and_then(|s| s.namespace(nsid))
        .map(|n| (u64::from(n.info.logical_block_size), n.info.blocks()))
    else {
        return q.respond(&cmd, status::INVALID_NAMESPACE, 0);
    };
    let need = ranges_len(&sqe) as usize;
    if data.len() < need {
        return q.respond(&cmd, status::DATA_SGL_LENGTH_INVALID, 0);
    }
    let deallocate = sqe.cdw11.get() & (1 << 2) != 0;
    if !deallocate {
        return q.respond(&cmd, Status::SUCCESS, 0);
    }
    let mut ranges = q.take_ranges();
    // Ranges longer than the reported DMRSL are processed whole (the data path splits what a
    // backend takes in one operation): the specification forbids refusing them while ONCS
    // offers Dataset Management.
    let Ok(list) = <[wire::DsmRange]>::ref_from_bytes(&data[..need]) else {
        return q.respond(&cmd, status::INVALID_FIELD, 0);
    };
    for r in list {
        let (nlb, slba) = (u64::from(r.nlb.get()), r.slba.get());
        if nlb == 0 {
            continue;
        }
        if slba.checked_add(nlb).is_none_or(|end| end > blocks) {
            return q.respond(&cmd, status::LBA_OUT_OF_RANGE, 0);
        }
        ranges.push((slba * lbs, nlb * lbs));
    }
    if ranges.is_empty() {
        return q.respond(&cmd, Status::SUCCESS, 0);
    }
    Action::Io(IoRequest {
        cmd,
        nsid,
        op: IoOp::Deallocate { ranges },
        data: None,
    })
}

/// The NVMe status for a failed block operation.
pub fn block_error_status(e: &BlockFailure, op: &IoOp) -> Status {
    let read = matches!(op, IoOp::Read { .. });
    match e {
        BlockFailure::Misaligned => status::INVALID_FIELD,
        // The core checked the range against the namespace's size before the command went
        // to the backend: the backend refusing it means a shrink has stored the device's new
        // size and is not yet published (it waits for writes past the new end, and may yet
        // be refused and undone). Namespace Not Ready, retryable: once the shrink is
        // published the core answers LBA Out of Range itself; if it is undone, the retry
        // is served. (LBA Out of Range has Do Not Retry: a filesystem could give up a disk
        // whose blocks are all still there.)
        BlockFailure::OutOfRange => status::NAMESPACE_NOT_READY,
        BlockFailure::ReadOnly => status::NAMESPACE_WRITE_PROTECTED,
        BlockFailure::Unsupported => status::INVALID_OPCODE,
        BlockFailure::NoSpace => status::CAPACITY_EXCEEDED,
        // Back-pressure is the transport's to absorb; should it escape, the host may retry.
        BlockFailure::QueueFull => Status::retryable(0, 0x06),
        BlockFailure::UnknownDevice => status::INVALID_NAMESPACE,
        // Namespace Not Ready without Do Not Retry: the host retries later.
        BlockFailure::Unavailable => status::NAMESPACE_NOT_READY,
        BlockFailure::Io => {
            if read {
                status::UNRECOVERED_READ_ERROR
            } else if matches!(op, IoOp::Write { .. } | IoOp::WriteZeroes { .. }) {
                status::WRITE_FAULT
            } else {
                status::INTERNAL_ERROR
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_block_failure_has_its_status_and_io_errors_depend_on_the_operation() {
        let read = IoOp::Read {
            offset: 0,
            len: 512,
        };
        let write = IoOp::Write {
            offset: 0,
            len: 512,
            fua: true,
        };
        let zeroes = IoOp::WriteZeroes {
            offset: 0,
            len: 512,
            fua: false,
        };
        let dealloc = IoOp::Deallocate {
            ranges: vec![(0, 512)],
        };
        for (failure, want) in [
            (BlockFailure::Misaligned, status::INVALID_FIELD),
            (BlockFailure::OutOfRange, status::NAMESPACE_NOT_READY),
            (BlockFailure::ReadOnly, status::NAMESPACE_WRITE_PROTECTED),
            (BlockFailure::Unsupported, status::INVALID_OPCODE),
            (BlockFailure::NoSpace, status::CAPACITY_EXCEEDED),
            (BlockFailure::QueueFull, Status::retryable(0, 0x06)),
            (BlockFailure::UnknownDevice, status::INVALID_NAMESPACE),
            (BlockFailure::Unavailable, status::NAMESPACE_NOT_READY),
        ] {
            for op in [&read, &write, &zeroes, &dealloc, &IoOp::Flush] {
                assert_eq!(block_error_status(&failure, op), want, "{failure:?} {op:?}");
            }
        }
        let io = BlockFailure::Io;
        assert_eq!(
            block_error_status(&io, &read),
            status::UNRECOVERED_READ_ERROR
        );
        assert_eq!(block_error_status(&io, &write), status::WRITE_FAULT);
        assert_eq!(block_error_status(&io, &zeroes), status::WRITE_FAULT);
        assert_eq!(block_error_status(&io, &dealloc), status::INTERNAL_ERROR);
        assert_eq!(
            block_error_status(&io, &IoOp::Flush),
            status::INTERNAL_ERROR
        );
    }
}
