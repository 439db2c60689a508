//! A controller's registers in memory, as a [`HostTransport`] for tests of the host side:
//! Connect, Property Get and Property Set, with CSTS.RDY and CSTS.SHST following CC after a
//! delay.

use std::time::{Duration, Instant};

use crate::host::{DataDir, HostError, HostTransport};
use crate::wire::{self, fctype, property, Cqe, Sqe};

/// The fake controller.
#[derive(Debug)]
pub struct FakeController {
    /// CAP as read (CAP.TO in bits 31:24).
    pub cap: u64,
    /// How long after CC.EN (or CC.SHN) is set CSTS.RDY (or SHST complete) shows.
    pub delay: Duration,
    /// Every Property Set: (offset, value); shared, to be read once the queue is gone.
    pub sets: std::sync::Arc<std::sync::Mutex<Vec<(u32, u32)>>>,
    /// Commands carried so far (shared).
    pub executed: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// From now on every command times out (the transport is then broken).
    pub hang: bool,
    /// A shutdown fails: CSTS.CFS, SHST left at "occurring".
    pub shutdown_fails: bool,
    cc: u32,
    changed: Option<Instant>,
}

impl FakeController {
    /// A controller with CAP.TO `to` (500 ms units) whose state follows CC after `delay`.
    pub fn new(to: u8, delay: Duration) -> FakeController {
        FakeController {
            cap: u64::from(to) << 24 | 31,
            delay,
            sets: std::sync::Arc::default(),
            executed: std::sync::Arc::default(),
            hang: false,
            shutdown_fails: false,
            cc: 0,
            changed: None,
        }
    }

    fn csts(&self) -> u32 {
        let settled = self.changed.is_some_and(|t| t.elapsed() >= self.delay);
        let (en, shn) = (self.cc & 1, (self.cc >> 14) & 3);
        match (settled, en, shn) {
            (true, 1, s) if s != 0 && self.shutdown_fails => 1 | 2 | 1 << 2,
            (true, 1, 0) => 1,
            (true, 1, _) => 1 | 2 << 2,
            (false, 1, s) if s != 0 => 1 | 1 << 2,
            _ => 0,
        }
    }
}

impl HostTransport for FakeController {
    fn broken(&self) -> bool {
        self.hang
    }

    fn execute(&mut self, sqe: Sqe, _data: DataDir<'_>) -> Result<Cqe, HostError> {
        use zerocopy::IntoBytes;
        self.executed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.hang {
            return Err(HostError::Timeout("the command's completion"));
        }
        let mut c: Cqe = wire::zeroed();
        c.cid = sqe.cid;
        let b = sqe.as_bytes();
        let offset = u32::from_le_bytes([b[44], b[45], b[46], b[47]]);
        match (sqe.opcode, b[4]) {
            (0x7f, fctype::PROPERTY_GET) => {
                let v = match offset {
                    property::CAP => self.cap,
                    property::CC => u64::from(self.cc),
                    property::CSTS => u64::from(self.csts()),
                    _ => 0,
                };
                c.dw0 = zerocopy::little_endian::U32::new(wire::lo32(v));
                c.dw1 = zerocopy::little_endian::U32::new(wire::lo32(v >> 32));
            }
            (0x7f, fctype::PROPERTY_SET) => {
                let value = u32::from_le_bytes([b[48], b[49], b[50], b[51]]);
                self.sets
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push((offset, value));
                if offset == property::CC {
                    self.cc = value;
                    self.changed = Some(Instant::now());
                }
            }
            _ => {}
        }
        Ok(c)
    }
}
