//! The registrar thread: registers and deregisters the SRQ's receive chunks off the reactor.

use std::sync::mpsc;

use nvmfd_rdma::any::{Mr, Pd};
use nvmfd_rdma::{Access, VerbsError};

enum Job {
    Register {
        pd: Pd,
        len: usize,
        reply: mpsc::Sender<Result<Mr, VerbsError>>,
    },
    Release(Mr),
}

/// Registers and deregisters receive chunks on its own thread, so that neither costs a
/// reactor a system call. The thread ends when the last handle is dropped.
#[derive(Clone)]
pub struct Registrar {
    tx: mpsc::Sender<Job>,
}

impl std::fmt::Debug for Registrar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Registrar")
    }
}

impl Registrar {
    /// Starts the registrar thread.
    pub fn spawn() -> std::io::Result<Registrar> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("nvmfd-registrar".into())
            .spawn(move || {
                for job in rx {
                    match job {
                        Job::Register { pd, len, reply } => {
                            let _ = reply.send(pd.alloc_mr(len, Access::LOCAL_WRITE));
                        }
                        Job::Release(mr) => drop(mr),
                    }
                }
            })?;
        Ok(Registrar { tx })
    }

    pub(super) fn register(
        &self,
        pd: &Pd,
        len: usize,
        reply: &mpsc::Sender<Result<Mr, VerbsError>>,
    ) {
        let _ = self.tx.send(Job::Register {
            pd: pd.clone(),
            len,
            reply: reply.clone(),
        });
    }

    pub(super) fn release(&self, mr: Mr) {
        // If the thread is gone, the region is deregistered here instead.
        if let Err(mpsc::SendError(Job::Release(mr))) = self.tx.send(Job::Release(mr)) {
            drop(mr);
        }
    }
}
