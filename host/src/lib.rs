//! The NVMe-oF host over RDMA: one connected queue ([`RdmaQueue`]) that carries the commands
//! of `nvmfd_nvme::host` (admin and I/O queues, discovery) over either verbs provider.
//!
//! [`RdmaQueue`] sends commands one at a time; [`PipelinedQueue`] keeps up to its depth of
//! them outstanding and hands back completions as they come. Data up to the in-capsule size
//! travels in the capsule, larger writes and every read go through a registered buffer the
//! target reaches with RDMA READ and WRITE (keyed SGL).

pub mod bench;
mod pipeline;
pub mod verify;
pub use pipeline::{Done, Payload, PipelinedQueue};

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nvmfd_nvme::host::{DataDir, HostError, HostTransport};
use nvmfd_nvme::wire::{self, Cqe, RdmaCmRequest, SglDesc, Sqe};
use nvmfd_rdma::any::cm::{CmChannel, CmEvent, CmId};
use nvmfd_rdma::any::{Cq, Mr, Pd, Srq};
use nvmfd_rdma::*;
use zerocopy::little_endian::U16;
use zerocopy::IntoBytes;

/// How long one command may take before the queue gives up.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Receives posted for responses.
const RESPONSE_SLOTS: u32 = 8;

/// One NVMe-oF queue over an RDMA connection.
#[derive(Debug)]
pub struct RdmaQueue {
    ch: CmChannel,
    id: CmId,
    cq: Cq,
    srq: Srq,
    cmd: Mr,
    resp: Mr,
    data: Mr,
    in_capsule: u32,
    /// Keyed transfers go as a list of this many descriptors (1: one keyed descriptor).
    pieces: u32,
    /// Completions of commands other than the one waited for (those sent with
    /// [`RdmaQueue::post`], such as Asynchronous Event Requests), in arrival order.
    others: Vec<Cqe>,
    /// A command timed out or the transport failed ([`HostTransport::broken`]).
    broken: bool,
    _pd: Pd,
}

/// How a queue connects and moves data, beyond the defaults of [`RdmaQueue::connect`].
#[derive(Clone, Copy, Debug)]
pub struct QueueOptions {
    /// RDMA READs the host takes at once from the target (rdma_cm's responder resources: the
    /// target's READ depth). Honoured by the soft provider; ibverbs connects with 16.
    pub responder_resources: u8,
    /// Keyed transfers go as a list of this many descriptors in the capsule (a last
    /// segment), each over its own piece of the buffer, placed in reverse order; 1 sends one
    /// keyed descriptor. At most 16.
    pub pieces: u32,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions {
            responder_resources: 16,
            pieces: 1,
        }
    }
}

fn transport(e: impl std::fmt::Display) -> HostError {
    HostError::Transport(e.to_string())
}

impl RdmaQueue {
    /// Connects queue `qid` (`sqsize` 0's based) to the target at `addr`, on the channel
    /// `ch`. Writes up to `in_capsule` bytes go in the capsule; transfers up to `max_io`.
    pub fn connect(
        ch: CmChannel,
        addr: SocketAddr,
        qid: u16,
        sqsize: u16,
        in_capsule: u32,
        max_io: u32,
    ) -> Result<RdmaQueue, HostError> {
        Self::connect_with(
            ch,
            addr,
            qid,
            sqsize,
            in_capsule,
            max_io,
            QueueOptions::default(),
        )
    }

    /// [`RdmaQueue::connect`] with `opts`.
    pub fn connect_with(
        ch: CmChannel,
        addr: SocketAddr,
        qid: u16,
        sqsize: u16,
        in_capsule: u32,
        max_io: u32,
        opts: QueueOptions,
    ) -> Result<RdmaQueue, HostError> {
        if !(1..=16).contains(&opts.pieces) || opts.pieces * 16 > in_capsule.max(16) {
            return Err(HostError::Protocol(format!(
                "{} pieces: from 1 to 16, and their list must fit the in-capsule data",
                opts.pieces
            )));
        }
        let mut id = ch
            .resolve(addr, Duration::from_secs(3))
            .map_err(transport)?;
        let dev = id.device().map_err(transport)?;
        let pd = dev.alloc_pd().map_err(transport)?;
        let cq = dev.create_cq(64).map_err(transport)?;
        let srq = pd.create_srq(RESPONSE_SLOTS * 2, 1).map_err(transport)?;
        let cmd = pd
            .alloc_mr(64 + in_capsule.max(256) as usize, Access::LOCAL_WRITE)
            .map_err(transport)?;
        let resp = pd
            .alloc_mr(16 * RESPONSE_SLOTS as usize, Access::LOCAL_WRITE)
            .map_err(transport)?;
        let data = pd
            .alloc_mr(
                max_io.max(4096) as usize,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
            .map_err(transport)?;
        id.create_qp(
            &pd,
            &cq,
            &srq,
            QpCaps {
                max_send_wr: 16,
                max_send_sge: 1,
                max_recv_wr: 0,
                max_inline_data: 64,
            },
        )
        .map_err(transport)?;
        for slot in 0..RESPONSE_SLOTS {
            srq.post_recv(&[RecvWr {
                wr_id: u64::from(slot),
                sges: &[resp.sge(slot as usize * 16, 16)],
            }])
            .map_err(transport)?;
        }
        establish(&ch, &id, addr, qid, sqsize, opts.responder_resources)?;
        Ok(RdmaQueue {
            ch,
            id,
            cq,
            srq,
            cmd,
            resp,
            data,
            in_capsule,
            pieces: opts.pieces,
            others: Vec::new(),
            broken: false,
            _pd: pd,
        })
    }

    /// Sends a command without data and does not wait for its completion (an Asynchronous
    /// Event Request): it is found later in [`RdmaQueue::take_others`].
    pub fn post(&mut self, mut sqe: Sqe) -> Result<(), HostError> {
        sqe.dptr = SglDesc::keyed(0, 0, 0, false);
        self.send_capsule(sqe.as_bytes())
    }

    /// The queue's QP number.
    pub fn qpn(&self) -> Option<u32> {
        self.id.qpn()
    }

    /// Sends `bytes` (at most 64) as a capsule as they are, and waits only for the send to
    /// complete: for tests of what a target does with malformed capsules.
    pub fn post_raw(&mut self, bytes: &[u8]) -> Result<(), HostError> {
        self.send_capsule(&bytes[..bytes.len().min(64)])
    }

    /// Sends `capsule` (at most 64 bytes) from the command buffer and waits until it is sent,
    /// as the buffer is the next command's; responses that arrive meanwhile are kept for
    /// [`RdmaQueue::take_others`].
    fn send_capsule(&mut self, capsule: &[u8]) -> Result<(), HostError> {
        self.cmd.write(0, capsule);
        let sge = [self.cmd.sge(0, u32::try_from(capsule.len()).unwrap_or(64))];
        self.id
            .post_send(&[SendWr {
                wr_id: 1 << 32,
                op: SendOp::Send,
                sges: &sge,
                signaled: true,
                inline: None,
            }])
            .map_err(transport)?;
        let end = Instant::now() + COMMAND_TIMEOUT;
        let mut wc = [Wc::default(); 8];
        loop {
            if Instant::now() > end {
                return Err(HostError::Timeout("the command's send"));
            }
            let n = self.cq.poll(&mut wc).map_err(transport)?;
            let mut sent = false;
            for c in &wc[..n] {
                if c.status != WcStatus::Success {
                    return Err(HostError::Transport(format!(
                        "work completion {:?}",
                        c.status
                    )));
                }
                if c.opcode == WcOpcode::Recv {
                    let got = self.response(c.wr_id, c.byte_len)?;
                    self.others.push(got);
                } else {
                    sent = true;
                }
            }
            if sent {
                return Ok(());
            }
            std::thread::yield_now();
        }
    }

    /// The response in receive `wr_id` (`len` bytes arrived), which goes back to the SRQ.
    fn response(&mut self, wr_id: u64, len: u32) -> Result<Cqe, HostError> {
        // A response is a whole 16-byte completion: a shorter SEND leaves the last
        // response's bytes in the buffer, which would read as another command's.
        if len != 16 {
            return Err(HostError::Protocol(format!(
                "a response of {len} bytes (a completion is 16)"
            )));
        }
        let slot = usize::try_from(wr_id).unwrap_or(0);
        let mut b = [0u8; 16];
        self.resp.read(slot * 16, &mut b);
        let got: Cqe =
            wire::read(&b).ok_or_else(|| HostError::Protocol("short response".into()))?;
        self.srq
            .post_recv(&[RecvWr {
                wr_id,
                sges: &[self.resp.sge(slot * 16, 16)],
            }])
            .map_err(transport)?;
        Ok(got)
    }

    /// The completions that arrived for commands other than those waited for.
    pub fn take_others(&mut self) -> Vec<Cqe> {
        std::mem::take(&mut self.others)
    }

    /// Disconnects.
    pub fn disconnect(&self) {
        let _ = self.id.disconnect();
        let _ = self.ch.next_event();
    }
}

/// Connects `id` (its QP made) to the target at `addr` as queue `qid` of `sqsize` (0's based)
/// and waits until the connection is established; a rejection says the target's status.
fn establish(
    ch: &CmChannel,
    id: &CmId,
    addr: SocketAddr,
    qid: u16,
    sqsize: u16,
    responder_resources: u8,
) -> Result<(), HostError> {
    let req = RdmaCmRequest {
        recfmt: U16::new(0),
        qid: U16::new(qid),
        hrqsize: U16::new(sqsize.saturating_add(1)),
        hsqsize: U16::new(sqsize),
        cntlid: U16::new(0),
        rsvd: [0; 22],
    };
    id.set_responder_resources(responder_resources);
    id.connect(req.as_bytes()).map_err(transport)?;
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        match ch.next_event() {
            Some(CmEvent::Established { .. }) => return Ok(()),
            Some(CmEvent::Rejected { private_data, .. }) => {
                let sts = private_data
                    .get(2..4)
                    .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
                return Err(HostError::Transport(format!(
                    "the target rejected the connection (NVMe/RDMA status {sts:#x})"
                )));
            }
            Some(CmEvent::Unreachable { .. }) => {
                return Err(HostError::Transport(format!("{addr} is unreachable")))
            }
            Some(CmEvent::ConnectError { .. }) => {
                return Err(HostError::Transport(format!(
                    "the connection to {addr} could not be set up"
                )))
            }
            Some(_) => {}
            None if Instant::now() > end => return Err(HostError::Timeout("the connection")),
            None => std::thread::yield_now(),
        }
    }
}

impl RdmaQueue {
    /// The pieces a `len`-byte transfer goes in: (offset in the buffer, offset in the data,
    /// length), in data order; the pieces lie in the buffer in reverse order.
    fn pieces_of(&self, len: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let n = (self.pieces as usize).clamp(1, len.max(1));
        let each = len / n;
        let size = move |k: usize| {
            if k + 1 == n {
                len - each * (n - 1)
            } else {
                each
            }
        };
        (0..n).map(move |k| {
            // Piece k sits after the pieces that follow it in the data.
            let at = (k + 1..n).map(size).sum();
            (at, each * k, size(k))
        })
    }

    /// Describes a keyed transfer of `len` bytes (`data` to send first, for a write): one
    /// keyed descriptor, or a list of them in the capsule. Returns the in-capsule bytes.
    fn keyed(&mut self, sqe: &mut Sqe, len: usize, data: Option<&[u8]>) -> usize {
        if self.pieces <= 1 {
            if let Some(d) = data {
                self.data.write(0, d);
            }
            sqe.dptr = SglDesc::keyed(self.data.addr(), wire::sat(len), self.data.rkey(), false);
            return 0;
        }
        let mut list = 0;
        for (k, (at, off, n)) in self.pieces_of(len).enumerate() {
            if let Some(d) = data {
                self.data.write(at, &d[off..off + n]);
            }
            let desc = SglDesc::keyed(
                self.data.addr() + at as u64,
                wire::sat(n),
                self.data.rkey(),
                false,
            );
            self.cmd.write(64 + k * 16, desc.as_bytes());
            list = k + 1;
        }
        sqe.dptr = SglDesc::last_segment(0, wire::sat(list));
        list * 16
    }
}

impl HostTransport for RdmaQueue {
    fn execute(&mut self, sqe: Sqe, data: DataDir<'_>) -> Result<Cqe, HostError> {
        if self.broken {
            return Err(HostError::Transport(
                "the queue failed earlier (a command timed out or its transport failed)".into(),
            ));
        }
        let r = self.execute_once(sqe, data);
        if matches!(r, Err(HostError::Timeout(_) | HostError::Transport(_))) {
            self.broken = true;
        }
        r
    }

    fn broken(&self) -> bool {
        self.broken
    }
}

impl RdmaQueue {
    fn execute_once(&mut self, mut sqe: Sqe, data: DataDir<'_>) -> Result<Cqe, HostError> {
        let mut icd = 0usize;
        match &data {
            DataDir::None => sqe.dptr = SglDesc::keyed(0, 0, 0, false),
            DataDir::ToTarget(d) if d.len() <= self.in_capsule as usize => {
                sqe.dptr = SglDesc::in_capsule(0, wire::sat(d.len()));
                self.cmd.write(64, d);
                icd = d.len();
            }
            DataDir::ToTarget(d) => {
                if d.len() > self.data.len() {
                    return Err(HostError::Protocol(
                        "transfer larger than the queue's buffer".into(),
                    ));
                }
                icd = self.keyed(&mut sqe, d.len(), Some(d));
            }
            DataDir::FromTarget(b) => {
                if b.len() > self.data.len() {
                    return Err(HostError::Protocol(
                        "transfer larger than the queue's buffer".into(),
                    ));
                }
                // The buffer still holds the last transfer's data (a write of the same
                // blocks, say): poisoned, a read the target answers without its data
                // cannot hand that back as if it had come.
                const POISON: [u8; 4096] = [0xDB; 4096];
                let mut at = 0;
                while at < b.len() {
                    let n = (b.len() - at).min(POISON.len());
                    self.data.write(at, &POISON[..n]);
                    at += n;
                }
                icd = self.keyed(&mut sqe, b.len(), None);
            }
        }
        let cid = sqe.cid.get();
        self.cmd.write(0, sqe.as_bytes());
        let capsule = [self.cmd.sge(0, wire::sat(64 + icd))];
        self.id
            .post_send(&[SendWr {
                wr_id: 1 << 32,
                op: SendOp::Send,
                sges: &capsule,
                signaled: true,
                inline: None,
            }])
            .map_err(transport)?;
        let end = Instant::now() + COMMAND_TIMEOUT;
        let (mut sent, mut cqe) = (false, None);
        let mut wc = [Wc::default(); 8];
        while !(sent && cqe.is_some()) {
            if Instant::now() > end {
                return Err(HostError::Timeout("the command's completion"));
            }
            let n = self.cq.poll(&mut wc).map_err(transport)?;
            for c in &wc[..n] {
                if c.status != WcStatus::Success {
                    return Err(HostError::Transport(format!(
                        "work completion {:?}",
                        c.status
                    )));
                }
                if c.opcode == WcOpcode::Recv {
                    let got = self.response(c.wr_id, c.byte_len)?;
                    if got.cid.get() == cid {
                        cqe = Some(got);
                    } else {
                        self.others.push(got);
                    }
                } else {
                    sent = true;
                }
            }
            if n == 0 {
                // The target ending the connection ends the wait (a real host starts its
                // error recovery here rather than waiting for the command timeout).
                if let Some(CmEvent::Disconnected { .. } | CmEvent::DeviceRemoval { .. }) =
                    self.ch.next_event()
                {
                    return Err(HostError::Transport("the target disconnected".into()));
                }
                std::thread::yield_now();
            }
        }
        if let DataDir::FromTarget(b) = data {
            for (at, off, n) in self.pieces_of(b.len()) {
                self.data.read(at, &mut b[off..off + n]);
            }
        }
        cqe.ok_or(HostError::Timeout("the command's completion"))
    }
}

/// An admin queue whose controller is shut down (CC.SHN, waiting for SHST complete) when it
/// is dropped, whichever way a command ends: a host that leaves without it is one the target
/// must take for lost. Drop the I/O queues before it (the specification has them deleted
/// first). [`ShutdownOnDrop::finish`] shuts it down at the end of a command that went well,
/// saying how the shutdown went: a drop can only ignore that.
pub struct ShutdownOnDrop<T: HostTransport> {
    queue: nvmfd_nvme::host::AdminQueue<T>,
    done: bool,
}

impl<T: HostTransport> ShutdownOnDrop<T> {
    /// `queue`, shut down when it goes.
    pub fn new(queue: nvmfd_nvme::host::AdminQueue<T>) -> Self {
        ShutdownOnDrop { queue, done: false }
    }

    /// Shuts the controller down now. A shutdown that fails is an error: CSTS.CFS (nvmfd's
    /// when the shutdown's flush failed: what was written may not be durable), no SHST
    /// complete in time, or an admin queue that failed before it.
    pub fn finish(mut self) -> Result<(), HostError> {
        self.done = true;
        if self.queue.transport().broken() {
            return Err(HostError::Protocol(
                "the admin queue failed before the controller could be shut down".into(),
            ));
        }
        self.queue.shutdown()
    }
}

impl<T: HostTransport> std::fmt::Debug for ShutdownOnDrop<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShutdownOnDrop")
            .field("cntlid", &self.queue.cntlid)
            .finish_non_exhaustive()
    }
}

impl<T: HostTransport> std::ops::Deref for ShutdownOnDrop<T> {
    type Target = nvmfd_nvme::host::AdminQueue<T>;
    fn deref(&self) -> &nvmfd_nvme::host::AdminQueue<T> {
        &self.queue
    }
}

impl<T: HostTransport> std::ops::DerefMut for ShutdownOnDrop<T> {
    fn deref_mut(&mut self) -> &mut nvmfd_nvme::host::AdminQueue<T> {
        &mut self.queue
    }
}

impl<T: HostTransport> Drop for ShutdownOnDrop<T> {
    fn drop(&mut self) {
        // A queue whose command timed out, or whose transport failed, carries nothing more:
        // a shutdown through it would only wait out another timeout.
        if self.done || self.queue.transport().broken() {
            return;
        }
        // A target that cannot be reached any more has nothing to be told.
        let _ = self.queue.shutdown();
    }
}

#[cfg(test)]
mod shutdown_tests {
    #[test]
    fn a_controller_is_shut_down_when_its_queue_goes_whatever_the_way_out() {
        use nvmfd_nvme::host::{AdminQueue, HostId};
        use nvmfd_nvme::host_fake::FakeController;
        let fake = FakeController::new(1, std::time::Duration::ZERO);
        let sets = std::sync::Arc::clone(&fake.sets);
        let host = HostId {
            nqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000001".into(),
            id: [1; 16],
        };
        let run = || -> Result<(), String> {
            let mut a = super::ShutdownOnDrop::new(
                AdminQueue::connect(fake, &host, "nqn.2024-01.io.nvmfd.test:f", 31, 0)
                    .map_err(|e| e.to_string())?,
            );
            a.enable().map_err(|e| e.to_string())?;
            Err("namespace 9 is not active".into())
        };
        assert!(run().is_err());
        let sets = sets.lock().unwrap().clone();
        // A queue whose command timed out is not used again to shut down (that would wait
        // out another timeout for each command).
        let fake = FakeController::new(1, std::time::Duration::ZERO);
        let executed = std::sync::Arc::clone(&fake.executed);
        let mut a = super::ShutdownOnDrop::new(
            AdminQueue::connect(fake, &host, "nqn.2024-01.io.nvmfd.test:f", 31, 0).unwrap(),
        );
        a.enable().unwrap();
        a.transport().hang = true;
        assert!(a.identify_controller().is_err());
        let before = executed.load(std::sync::atomic::Ordering::Relaxed);
        drop(a);
        assert_eq!(executed.load(std::sync::atomic::Ordering::Relaxed), before);
        let cc = nvmfd_nvme::wire::property::CC;
        assert_eq!(
            sets.last().map(|&(o, v)| (o, (v >> 14) & 3)),
            Some((cc, 1)),
            "CC.SHN normal last: {sets:?}"
        );
    }
}

/// What `nvmf verify` writes at `lba` (blocks of `bs` bytes, `len` bytes in all) in the run
/// of `seed`: every byte depends on the run, its block's LBA and its place in the block, so a
/// block read back from another place (swapped, repeated or shifted within a command, or from
/// another command), or left from an earlier run (a write the target lost), differs.
pub fn verify_pattern(seed: u64, lba: u64, bs: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let block = lba.wrapping_add((i / bs.max(1)) as u64);
            let off = (i % bs.max(1)) as u64;
            // splitmix64 of (run, block, offset).
            let mut z = (block ^ seed.rotate_left(29))
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(off);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)).to_le_bytes()[0]
        })
        .collect()
}

#[cfg(test)]
mod verify_pattern_tests {
    /// Every block of a command, and every 256-byte stretch of a block, differs from the
    /// others, and the same block at another LBA differs: a misplaced block cannot pass.
    #[test]
    fn no_two_blocks_or_stretches_alike() {
        let bs = 512;
        let p = super::verify_pattern(7, 1000, bs, 128 * 1024);
        let blocks: Vec<&[u8]> = p.chunks(bs).collect();
        for (a, x) in blocks.iter().enumerate() {
            assert_ne!(x[..256], x[256..], "block {a}: its two halves are alike");
            for (b, y) in blocks.iter().enumerate().skip(a + 1) {
                assert_ne!(x, y, "blocks {a} and {b} are alike");
            }
        }
        assert_ne!(
            p[..bs],
            super::verify_pattern(7, 1001, bs, bs)[..],
            "LBA not in the pattern"
        );
        assert_ne!(
            p[..bs],
            super::verify_pattern(8, 1000, bs, bs)[..],
            "the run not in the pattern: an earlier run's block would pass for a lost write"
        );
    }
}
