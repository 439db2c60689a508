//! Starting an operation: an SQE for a file or block device (and the rest of a partial
//! transfer, a FUA zeroing's sync, a refused deallocate's zeroing); RAM and null devices
//! complete at once.

use super::*;

impl Engine {
    /// Builds and queues the SQE for (the rest of) slot `slot`'s operation.
    pub(super) fn push_sqe(&mut self, slot: u32) {
        let s = self.slots[slot as usize].as_mut().expect("queued slot");
        let a = self.devices[s.dev as usize]
            .as_mut()
            .expect("an attached device");
        let file = types::Fixed(a.file.expect("file device"));
        let syncs = match s.op {
            OpKind::Flush | OpKind::WriteFua => true,
            OpKind::WriteZeroesFua => s.done > 0,
            _ => false,
        };
        if syncs && s.sync.is_none() {
            s.sync = Some(a.dev.sync_begin());
            if s.op == OpKind::Flush {
                a.dev.flush_race_begins();
            }
        }
        let offset = s.offset + u64::from(s.done);
        let remaining = s.len - s.done;
        let entry: squeue::Entry = match s.op {
            OpKind::Read | OpKind::Write | OpKind::WriteFua => {
                let (base, fixed) = match (s.buf.as_mut(), s.from) {
                    (Some(buf), _) => (
                        buf.as_mut_ptr(),
                        self.pools
                            .iter()
                            .position(|p| buf.is_from(p))
                            .and_then(|i| u16::try_from(i).ok()),
                    ),
                    (None, Some(from)) => (from.as_ptr(), None),
                    (None, None) => unreachable!("data operations carry a buffer"),
                };
                // SAFETY: done < len <= the buffer's (or `write_from`'s) length, so the
                // pointer stays inside the data.
                let ptr = unsafe { base.add(s.done as usize) };
                let flags = if s.op == OpKind::WriteFua {
                    libc::RWF_DSYNC
                } else {
                    0
                };
                match (s.op, fixed) {
                    (OpKind::Read, Some(i)) => opcode::ReadFixed::new(file, ptr, remaining, i)
                        .offset(offset)
                        .build(),
                    (OpKind::Read, None) => opcode::Read::new(file, ptr, remaining)
                        .offset(offset)
                        .build(),
                    (_, Some(i)) => opcode::WriteFixed::new(file, ptr, remaining, i)
                        .offset(offset)
                        .rw_flags(flags)
                        .build(),
                    (_, None) => opcode::Write::new(file, ptr, remaining)
                        .offset(offset)
                        .rw_flags(flags)
                        .build(),
                }
            }
            OpKind::Flush => opcode::Fsync::new(file)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            // A FUA zeroing's second step, once the range is zeroed.
            OpKind::WriteZeroesFua if s.done > 0 => opcode::Fsync::new(file)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            OpKind::WriteZeroes | OpKind::WriteZeroesFua => {
                opcode::Fallocate::new(file, u64::from(s.len))
                    .offset(s.offset)
                    .mode(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE)
                    .build()
            }
            // A deallocate the device refused (in `reap`): the range is zeroed instead, as
            // deallocated blocks read zeroes (DLFEAT).
            OpKind::Deallocate if s.done == DEALLOCATE_AS_ZEROES => {
                opcode::Fallocate::new(file, u64::from(s.len))
                    .offset(s.offset)
                    .mode(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE)
                    .build()
            }
            // Test hook: refused, the range untouched, as by a driver without write-zeroes.
            OpKind::Deallocate if a.dev.take_injected_deallocate_failure() => {
                s.done = DEALLOCATE_REFUSED;
                opcode::Nop::new().build()
            }
            OpKind::Deallocate => opcode::Fallocate::new(file, u64::from(s.len))
                .offset(s.offset)
                .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
        };
        let entry = entry.user_data(u64::from(slot));
        // SAFETY: the SQE points into `s.buf`, which this slot owns until the completion is
        // reaped (the caller gave it up), or into `write_from`'s memory, which its caller keeps
        // valid until then; the registered file and buffer tables hold the fd and
        // the region for as long as the ring lives, and `Drop` waits for every operation.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        // Slots never outnumber SQ entries and each has at most one SQE queued, so the SQ
        // cannot be full; should it be, submit and retry once.
        if pushed.is_err() {
            let _ = self.ring.submit();
            self.unsubmitted = 0;
            // SAFETY: as above.
            let again = unsafe { self.ring.submission().push(&entry) };
            if again.is_err() {
                self.finish(slot, Err(BlockError::QueueFull));
                return;
            }
        }
        self.unsubmitted += 1;
    }

    /// RAM and null devices: the operation completes now; the completion is reaped later.
    pub(super) fn complete_in_memory(&mut self, slot: u32) {
        let s = self.slots[slot as usize].as_mut().expect("queued slot");
        let dev = Arc::clone(&self.devices[s.dev as usize].as_ref().expect("attached").dev);
        let len = s.len as usize;
        let off = usize::try_from(s.offset).unwrap_or(usize::MAX);
        match (&dev.backing, s.op) {
            (_, OpKind::Flush) => {}
            (Backing::Null, OpKind::Read) => s.buf.as_mut().expect("buffer").as_mut_slice().fill(0),
            (Backing::Null, _) => {}
            (Backing::Malloc(ram), op) => {
                // `queue` checked off + len <= size <= ram.len().
                debug_assert!(off + len <= ram.len());
                let buf = match (s.buf.as_mut(), s.from) {
                    (Some(b), _) => b.as_mut_ptr(),
                    // `write_from`'s contract: `len` readable bytes.
                    (None, Some(p)) => p.as_ptr(),
                    (None, None) => std::ptr::null_mut(),
                };
                debug_assert!(
                    !buf.is_null()
                        || !matches!(op, OpKind::Read | OpKind::Write | OpKind::WriteFua)
                );
                // SAFETY: off..off+len is inside the mapping (checked by `check_range`). For a
                // transfer the buffer holds at least `len` bytes and is this slot's (a read's
                // is its own; a write's only read); `done + n <= len`. The copies are raw, each
                // under its chunk's lock, so no reference to the shared mapping is formed and
                // no other reactor copies the same bytes meanwhile (see `Device`'s Sync).
                unsafe {
                    ram.each_chunk(off, len, |at, done, n| match op {
                        OpKind::Read => std::ptr::copy_nonoverlapping(at, buf.add(done), n),
                        OpKind::Write | OpKind::WriteFua => {
                            std::ptr::copy_nonoverlapping(buf.add(done).cast_const(), at, n);
                        }
                        _ => std::ptr::write_bytes(at, 0, n),
                    });
                }
            }
            (Backing::File(_), _) => unreachable!("files go through the ring"),
            #[cfg(feature = "rbd")]
            (Backing::Rbd(_), _) => unreachable!("images go through librbd"),
        }
        let done = if matches!(s.op, OpKind::Read | OpKind::Write | OpKind::WriteFua) {
            s.len
        } else {
            0
        };
        self.finish(slot, Ok(done));
    }
}
