//! The NVMe-oF host over RDMA: one connected queue ([`RdmaQueue`]) that carries the commands
//! of `nvmfd_nvme::host` (admin and I/O queues, discovery) over either verbs provider.
//!
//! Commands are sent one at a time: data up to the in-capsule size travels in the capsule,
//! larger writes and every read go through a registered buffer the target reaches with RDMA
//! READ and WRITE (keyed SGL). The `nvmf` command line tool is not written yet.

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
    _pd: Pd,
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
        let mut id = ch
            .resolve(addr, Duration::from_secs(3))
            .map_err(transport)?;
        let dev = id.device().map_err(transport)?;
        let pd = dev.alloc_pd().map_err(transport)?;
        let cq = dev.create_cq(64).map_err(transport)?;
        let srq = pd.create_srq(RESPONSE_SLOTS * 2, 1).map_err(transport)?;
        let cmd = pd
            .alloc_mr(64 + in_capsule as usize, Access::LOCAL_WRITE)
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
        let req = RdmaCmRequest {
            recfmt: U16::new(0),
            qid: U16::new(qid),
            hrqsize: U16::new(sqsize.saturating_add(1)),
            hsqsize: U16::new(sqsize),
            cntlid: U16::new(0),
            rsvd: [0; 22],
        };
        id.connect(req.as_bytes()).map_err(transport)?;
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            match ch.next_event() {
                Some(CmEvent::Established { .. }) => break,
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
                Some(_) => {}
                None if Instant::now() > end => return Err(HostError::Timeout("the connection")),
                None => std::thread::yield_now(),
            }
        }
        Ok(RdmaQueue {
            ch,
            id,
            cq,
            srq,
            cmd,
            resp,
            data,
            in_capsule,
            _pd: pd,
        })
    }

    /// Disconnects.
    pub fn disconnect(&self) {
        let _ = self.id.disconnect();
        let _ = self.ch.next_event();
    }
}

impl HostTransport for RdmaQueue {
    fn execute(&mut self, mut sqe: Sqe, data: DataDir<'_>) -> Result<Cqe, HostError> {
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
                self.data.write(0, d);
                sqe.dptr = SglDesc::keyed(
                    self.data.addr(),
                    wire::sat(d.len()),
                    self.data.rkey(),
                    false,
                );
            }
            DataDir::FromTarget(b) => {
                if b.len() > self.data.len() {
                    return Err(HostError::Protocol(
                        "transfer larger than the queue's buffer".into(),
                    ));
                }
                sqe.dptr = SglDesc::keyed(
                    self.data.addr(),
                    wire::sat(b.len()),
                    self.data.rkey(),
                    false,
                );
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
                inline: false,
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
                    let slot = usize::try_from(c.wr_id).unwrap_or(0);
                    let mut b = [0u8; 16];
                    self.resp.read(slot * 16, &mut b);
                    let got: Cqe = wire::read(&b)
                        .ok_or_else(|| HostError::Protocol("short response".into()))?;
                    self.srq
                        .post_recv(&[RecvWr {
                            wr_id: c.wr_id,
                            sges: &[self.resp.sge(slot * 16, 16)],
                        }])
                        .map_err(transport)?;
                    if got.cid.get() == cid {
                        cqe = Some(got);
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
            self.data.read(0, b);
        }
        cqe.ok_or(HostError::Timeout("the command's completion"))
    }
}
