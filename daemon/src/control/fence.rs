//! What a shrink waits on before it cuts a device: every reactor, for its writes past the new
//! end.

use std::sync::mpsc;

use nvmfd_blockdev::Device as BlockDevice;

use super::change::ATTACH_TIMEOUT;
use super::*;

impl Daemon {
    /// What a shrink waits on before it cuts a device: every reactor, for its writes past
    /// the new end (`WriteFence::wait`).
    pub(super) fn write_fence(&self) -> WriteFence {
        WriteFence {
            reactors: self
                .inboxes
                .iter()
                .zip(&self.reactors)
                .map(|(tx, h)| (tx.clone(), Arc::clone(&h.shared)))
                .collect(),
        }
    }
}

/// The reactors a shrink waits on before it cuts its device (`Device::resize_fenced`).
pub(super) struct WriteFence {
    reactors: Vec<(mpsc::Sender<ReactorCmd>, Arc<crate::reactor::ReactorShared>)>,
}

impl WriteFence {
    /// Asks every reactor whether a write past `end` bytes of `dev` is left at its engines
    /// and waits, up to `ATTACH_TIMEOUT`, until none is.
    pub(super) fn wait(&self, dev: &Arc<BlockDevice>, end: u64) -> std::io::Result<()> {
        let (tx, rx) = mpsc::channel();
        let mut asked = 0;
        for (inbox, shared) in &self.reactors {
            let cmd = ReactorCmd::FenceWrites {
                dev: Arc::clone(dev),
                end,
                done: tx.clone(),
            };
            if inbox.send(cmd).is_ok() {
                shared.wake();
                asked += 1;
            }
        }
        drop(tx);
        let deadline = Instant::now() + ATTACH_TIMEOUT;
        for _ in 0..asked {
            if rx
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .is_err()
            {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "writes past the new end were still in flight after {ATTACH_TIMEOUT:?}; \
                         nothing was cut"
                    ),
                ));
            }
        }
        Ok(())
    }
}
