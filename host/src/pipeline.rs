//! A queue that keeps several commands outstanding: each of its `depth` slots has a capsule
//! buffer and a data buffer of its own, the command identifier is the slot, and completions
//! are handed back as the responses come, in whatever order the target answers.
//!
//! A slot is free again only when both its response and its send completion are in (the
//! target may answer before the send is acknowledged), so no buffer is rewritten while the
//! target may still read it. A failed work completion, a disconnect or a command that takes
//! longer than the queue's timeout breaks the queue: every outstanding command completes
//! with the error and later submissions fail at once; the caller connects a new queue.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nvmfd_nvme::host::{DataDir, HostError, HostTransport};
use nvmfd_nvme::wire::{self, Cqe, SglDesc, Sqe};
use nvmfd_rdma::any::cm::{CmChannel, CmEvent, CmId};
use nvmfd_rdma::any::{Cq, Mr, Pd, Srq};
use nvmfd_rdma::*;
use zerocopy::little_endian::U16;
use zerocopy::IntoBytes;

use crate::{establish, transport, COMMAND_TIMEOUT};

/// How often deadlines are checked while completions come in.
const DEADLINE_CHECK_EVERY: Duration = Duration::from_millis(10);

/// Data a submitted command moves.
#[derive(Clone, Copy, Debug)]
pub enum Payload<'a> {
    /// None.
    None,
    /// To the target (in the capsule up to the in-capsule size, else by RDMA READ).
    Out(&'a [u8]),
    /// From the target, this many bytes, into the slot's buffer ([`PipelinedQueue::data`]).
    In(usize),
}

/// A completed command.
#[derive(Debug)]
pub struct Done {
    /// The caller's tag given at submission.
    pub tag: u64,
    /// The slot it used: a read's data is in [`PipelinedQueue::data`] until the next
    /// submission.
    pub slot: u16,
    /// The completion (whatever its status), or why there is none.
    pub result: Result<Cqe, HostError>,
}

impl Done {
    /// Success, or the error: the transport's, or the target's status.
    pub fn ok(&self) -> Result<(), HostError> {
        match &self.result {
            Ok(cqe) if cqe.status().is_success() => Ok(()),
            Ok(cqe) => Err(HostError::Status {
                status: cqe.status(),
                dw0: cqe.dw0.get(),
            }),
            Err(e) => Err(HostError::Transport(e.to_string())),
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Slot {
    busy: bool,
    sent: bool,
    cqe: Option<Cqe>,
    tag: u64,
    deadline: Option<Instant>,
}

/// One NVMe-oF queue over RDMA with up to `depth` commands outstanding.
#[derive(Debug)]
pub struct PipelinedQueue {
    ch: CmChannel,
    id: CmId,
    cq: Cq,
    srq: Srq,
    cmds: Mr,
    resp: Mr,
    data: Mr,
    in_capsule: usize,
    max_io: usize,
    slots: Vec<Slot>,
    free: Vec<u16>,
    ready: VecDeque<Done>,
    broken: Option<String>,
    timeout: Duration,
    /// When the deadlines are next checked while completions come in.
    next_deadline_check: Instant,
    /// Reads find their buffer poisoned (`poison_reads`).
    poison: bool,
    wc: Vec<Wc>,
    _pd: Pd,
}

/// Bytes of a slot's capsule buffer: the command and its in-capsule data.
fn capsule_len(in_capsule: usize) -> usize {
    64 + in_capsule
}

impl PipelinedQueue {
    /// Connects queue `qid` with `depth` slots (at most 1024) to the target at `addr` on `ch`
    /// (no Fabrics Connect yet: that is the first command, as for [`crate::RdmaQueue`]).
    /// Writes up to `in_capsule` bytes go in the capsule; transfers up to `max_io` bytes.
    pub fn connect(
        ch: CmChannel,
        addr: SocketAddr,
        qid: u16,
        depth: u16,
        in_capsule: u32,
        max_io: u32,
    ) -> Result<PipelinedQueue, HostError> {
        if !(1..=1024).contains(&depth) {
            return Err(HostError::Protocol(format!(
                "depth {depth}: from 1 to 1024"
            )));
        }
        let (n, in_capsule, max_io) = (
            usize::from(depth),
            in_capsule as usize,
            max_io.max(512) as usize,
        );
        let mut id = ch
            .resolve(addr, Duration::from_secs(3))
            .map_err(transport)?;
        let dev = id.device().map_err(transport)?;
        let pd = dev.alloc_pd().map_err(transport)?;
        let cq = dev.create_cq(u32::from(depth) * 2 + 8).map_err(transport)?;
        let srq = pd.create_srq(u32::from(depth) * 2, 1).map_err(transport)?;
        let cmds = pd
            .alloc_mr(n * capsule_len(in_capsule), Access::LOCAL_WRITE)
            .map_err(transport)?;
        let resp = pd
            .alloc_mr(16 * n, Access::LOCAL_WRITE)
            .map_err(transport)?;
        let data = pd
            .alloc_mr(
                n * max_io,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
            .map_err(transport)?;
        id.create_qp(
            &pd,
            &cq,
            &srq,
            QpCaps {
                max_send_wr: u32::from(depth) + 1,
                max_send_sge: 1,
                max_recv_wr: 0,
                max_inline_data: 64,
            },
        )
        .map_err(transport)?;
        for slot in 0..n {
            srq.post_recv(&[RecvWr {
                wr_id: slot as u64,
                sges: &[resp.sge(slot * 16, 16)],
            }])
            .map_err(transport)?;
        }
        establish(&ch, &id, addr, qid, depth - 1, 16)?;
        Ok(PipelinedQueue {
            ch,
            id,
            cq,
            srq,
            cmds,
            resp,
            data,
            in_capsule,
            max_io,
            slots: vec![Slot::default(); n],
            free: (0..depth).rev().collect(),
            ready: VecDeque::new(),
            broken: None,
            timeout: COMMAND_TIMEOUT,
            next_deadline_check: Instant::now(),
            poison: false,
            wc: vec![Wc::default(); 32],
            _pd: pd,
        })
    }

    /// How long a command may be outstanding before the queue gives up on it (and breaks).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Slots free for submissions.
    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Whether each read's buffer is filled with a poison byte before the read is sent, so
    /// that a read the target answers without its data shows (what a check of the data needs;
    /// it costs a fill per read).
    pub fn poison_reads(&mut self, on: bool) {
        self.poison = on;
    }

    /// Commands outstanding (submitted and not yet handed back by [`PipelinedQueue::poll`]).
    pub fn outstanding(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// The queue's QP number.
    pub fn qpn(&self) -> Option<u32> {
        self.id.qpn()
    }

    /// Why the queue broke, once it has.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// The first `len` bytes of slot `slot`'s data buffer, copied into `out` (a read's data,
    /// after its completion).
    pub fn data(&self, slot: u16, out: &mut [u8]) {
        let len = out.len().min(self.max_io);
        self.data
            .read(usize::from(slot) * self.max_io, &mut out[..len]);
    }

    /// Sends `sqe` (its command identifier and SGL are filled in here) with `payload`; the
    /// completion comes back from [`PipelinedQueue::poll`] with `tag`. Returns the slot.
    pub fn submit(&mut self, tag: u64, sqe: Sqe, payload: Payload<'_>) -> Result<u16, HostError> {
        self.submit_timed(tag, sqe, payload).map(|(slot, _)| slot)
    }

    /// [`PipelinedQueue::submit`], with the time the command was posted: after its data was
    /// copied into the queue's buffers (or a read's buffer poisoned), just before the post,
    /// so that a latency measured from it is the target's and the wire's, not the host's
    /// copy (a provider may do the transport's work in the post: rxe does, and the reply can
    /// be in before the post returns).
    pub fn submit_timed(
        &mut self,
        tag: u64,
        mut sqe: Sqe,
        payload: Payload<'_>,
    ) -> Result<(u16, Instant), HostError> {
        if let Some(why) = &self.broken {
            return Err(HostError::Transport(why.clone()));
        }
        let len = match payload {
            Payload::None => 0,
            Payload::Out(d) => d.len(),
            Payload::In(n) => n,
        };
        if len > self.max_io {
            return Err(HostError::Protocol(format!(
                "a transfer of {len} bytes is larger than the queue's {} byte buffers",
                self.max_io
            )));
        }
        let Some(slot) = self.free.pop() else {
            return Err(HostError::Protocol(
                "every slot of the queue is in use".into(),
            ));
        };
        let (cmd_at, data_at) = (
            usize::from(slot) * capsule_len(self.in_capsule),
            usize::from(slot) * self.max_io,
        );
        let mut icd = 0;
        sqe.flags |= 1 << 6; // PSDT: SGL
        sqe.dptr = match payload {
            Payload::None => SglDesc::keyed(0, 0, 0, false),
            Payload::Out(d) if d.len() <= self.in_capsule => {
                self.cmds.write(cmd_at + 64, d);
                icd = d.len();
                SglDesc::in_capsule(0, wire::sat(d.len()))
            }
            Payload::Out(d) => {
                self.data.write(data_at, d);
                SglDesc::keyed(
                    self.data.addr() + data_at as u64,
                    wire::sat(d.len()),
                    self.data.rkey(),
                    false,
                )
            }
            Payload::In(n) => {
                if self.poison {
                    const POISON: [u8; 4096] = [0xDB; 4096];
                    let mut at = 0;
                    while at < n {
                        let k = (n - at).min(POISON.len());
                        self.data.write(data_at + at, &POISON[..k]);
                        at += k;
                    }
                }
                SglDesc::keyed(
                    self.data.addr() + data_at as u64,
                    wire::sat(n),
                    self.data.rkey(),
                    false,
                )
            }
        };
        sqe.cid = U16::new(slot);
        self.cmds.write(cmd_at, sqe.as_bytes());
        let sge = [self.cmds.sge(cmd_at, wire::sat(64 + icd))];
        let posted_at = Instant::now();
        let posted = self.id.post_send(&[SendWr {
            wr_id: u64::from(slot),
            op: SendOp::Send,
            sges: &sge,
            signaled: true,
            inline: None,
        }]);
        if let Err(e) = posted {
            self.free.push(slot);
            let why = format!("posting a command failed: {e}");
            self.fail(why.clone());
            return Err(HostError::Transport(why));
        }
        self.slots[usize::from(slot)] = Slot {
            busy: true,
            sent: false,
            cqe: None,
            tag,
            deadline: Some(Instant::now() + self.timeout),
        };
        Ok((slot, posted_at))
    }

    /// Moves the completions that came in to `out`; returns how many it moved.
    pub fn poll(&mut self, out: &mut Vec<Done>) -> usize {
        if self.broken.is_none() {
            if let Err(why) = self.reap() {
                self.fail(why);
            }
        }
        let n = self.ready.len();
        out.extend(self.ready.drain(..));
        n
    }

    fn reap(&mut self) -> Result<(), String> {
        let n = self.cq.poll(&mut self.wc).map_err(|e| e.to_string())?;
        for k in 0..n {
            let c = self.wc[k];
            if c.status != WcStatus::Success {
                return Err(format!("work completion {:?} ({:?})", c.status, c.opcode));
            }
            let slot = usize::try_from(c.wr_id).unwrap_or(usize::MAX);
            if slot >= self.slots.len() {
                return Err(format!("a completion for slot {slot}, which is not one"));
            }
            if c.opcode == WcOpcode::Recv {
                // A response is a whole 16-byte completion: a shorter SEND leaves the last
                // response's bytes in the buffer, which would complete the wrong command.
                if c.byte_len != 16 {
                    return Err(format!(
                        "a response of {} bytes (a completion is 16)",
                        c.byte_len
                    ));
                }
                let mut b = [0u8; 16];
                self.resp.read(slot * 16, &mut b);
                self.srq
                    .post_recv(&[RecvWr {
                        wr_id: c.wr_id,
                        sges: &[self.resp.sge(slot * 16, 16)],
                    }])
                    .map_err(|e| e.to_string())?;
                let cqe: Cqe = wire::read(&b).ok_or("a short response")?;
                let cid = usize::from(cqe.cid.get());
                match self.slots.get_mut(cid) {
                    Some(s) if s.busy && s.cqe.is_none() => s.cqe = Some(cqe),
                    _ => return Err(format!("a response for command {cid}, which is not out")),
                }
                self.settle(cid);
            } else {
                self.slots[slot].sent = true;
                self.settle(slot);
            }
        }
        if n == 0 {
            // The target ending the connection ends the wait.
            if let Some(CmEvent::Disconnected { .. } | CmEvent::DeviceRemoval { .. }) =
                self.ch.next_event()
            {
                return Err("the target disconnected".into());
            }
        }
        // Every poll that found nothing, and every 10 ms while others complete: a command
        // left unanswered among answered ones breaks the queue too. Only once the CQ was
        // read to its end: after a pause (a stopped process) an answer may still be there.
        let now = Instant::now();
        if n < self.wc.len() && (n == 0 || now >= self.next_deadline_check) {
            self.next_deadline_check = now + DEADLINE_CHECK_EVERY;
            if self
                .slots
                .iter()
                .any(|s| s.busy && s.deadline.is_some_and(|d| now > d))
            {
                return Err(format!("a command took longer than {:?}", self.timeout));
            }
        }
        Ok(())
    }

    /// Slot `i` is done once its response and its send completion are both in.
    fn settle(&mut self, i: usize) {
        let s = &mut self.slots[i];
        if !(s.busy && s.sent) {
            return;
        }
        let Some(cqe) = s.cqe else { return };
        let tag = s.tag;
        *s = Slot::default();
        let slot = u16::try_from(i).unwrap_or(u16::MAX);
        self.free.push(slot);
        self.ready.push_back(Done {
            tag,
            slot,
            result: Ok(cqe),
        });
    }

    /// The caller gives the queue up: every outstanding command completes with `why` (the
    /// target may still carry some of them out), and later submissions fail.
    pub fn abandon(&mut self, why: &str) {
        if self.broken.is_none() {
            self.fail(why.to_string());
        }
    }

    /// The queue is broken: every outstanding command completes with `why`.
    fn fail(&mut self, why: String) {
        for i in 0..self.slots.len() {
            if self.slots[i].busy {
                let tag = self.slots[i].tag;
                self.slots[i] = Slot::default();
                let slot = u16::try_from(i).unwrap_or(u16::MAX);
                self.free.push(slot);
                self.ready.push_back(Done {
                    tag,
                    slot,
                    result: Err(HostError::Transport(why.clone())),
                });
            }
        }
        self.broken = Some(why);
    }

    /// Disconnects.
    pub fn disconnect(&self) {
        let _ = self.id.disconnect();
        let _ = self.ch.next_event();
    }
}

/// The tag of commands sent through [`HostTransport::execute`] (Connect, and whatever
/// `nvmfd_nvme::host`'s queues send one at a time).
const EXECUTE_TAG: u64 = u64::MAX;

impl HostTransport for PipelinedQueue {
    /// Sends one command and waits for it; completions of other commands that come in
    /// meanwhile are kept for the next [`PipelinedQueue::poll`].
    fn execute(&mut self, sqe: Sqe, data: DataDir<'_>) -> Result<Cqe, HostError> {
        let payload = match &data {
            DataDir::None => Payload::None,
            DataDir::ToTarget(d) => Payload::Out(d),
            DataDir::FromTarget(b) => Payload::In(b.len()),
        };
        let slot = self.submit(EXECUTE_TAG, sqe, payload)?;
        loop {
            if self.broken.is_none() {
                if let Err(why) = self.reap() {
                    self.fail(why);
                }
            }
            let found = self
                .ready
                .iter()
                .position(|d| d.tag == EXECUTE_TAG && d.slot == slot);
            if let Some(at) = found {
                let Some(done) = self.ready.remove(at) else {
                    continue;
                };
                // The caller checks the status, as with the other transports.
                let cqe = done.result?;
                if let DataDir::FromTarget(b) = data {
                    self.data(slot, b);
                }
                return Ok(cqe);
            }
            std::thread::yield_now();
        }
    }
}
