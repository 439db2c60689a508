//! The soft provider's TCP wire: RC connections between fabrics in different processes.
//!
//! Each connection is one TCP stream with a reader thread (which applies what arrives to its
//! fabric under the fabric lock) and a writer thread (fed by a channel, so nothing blocks on
//! the network while holding the lock). Frames are length-prefixed: `[u32 len][u8 kind]
//! [payload]`. SEND, RDMA WRITE and RDMA READ complete at the requester when the responder's
//! answer arrives, with the responder's verdict (access error, RNR waits), as on a real wire.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use super::{Fabric, Pending, State};
use crate::types::*;

/// Largest frame accepted from a peer (a frame is at most one message).
const MAX_FRAME: usize = 16 << 20;

/// How long an accepted connection has to send its (whole) connect request. Each waits in a
/// thread of its own, so one that sends nothing, or a byte now and then, holds up no other.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepted connections that may wait for their connect request at once; past it, a new one
/// is closed at once.
const HANDSHAKES_MAX: usize = 256;

/// The longest connect request taken (a CM's REQ carries at most 56 bytes of private data).
const CONNECT_FRAME_MAX: usize = 4096;

/// Frames a link may have queued for its peer. A peer that stops reading its socket while
/// sending (every frame of its is answered) would otherwise make them pile up without end;
/// past it the link is closed. What a queue pair sends of its own accord is bounded by its
/// send queue, far below this.
const LINK_QUEUE_FRAMES: usize = 1 << 16;

/// How long a write to a peer may make no progress before the link is closed (a peer that
/// reads nothing; one that reads slowly makes progress).
const LINK_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Messages (and their bytes) that may wait at a QP for a receive. On a NIC a SEND that finds
/// no receive is NAKed and kept by its sender; here it is already read off the socket, so it
/// is kept, up to these. Past them the sender's RNR retries count as run out: the SEND fails
/// at the sender and the QP it was for goes to the error state, as no message after it may be
/// taken in its place.
const INBOUND_MAX: usize = 4096;
const INBOUND_MAX_BYTES: usize = 64 << 20;

/// What crosses the wire.
#[derive(Debug)]
pub(crate) enum Frame {
    Connect {
        private_data: Vec<u8>,
    },
    Accept {
        private_data: Vec<u8>,
    },
    Reject {
        private_data: Vec<u8>,
    },
    Disconnect,
    /// The connecting side's RTU: the accepting side is established.
    Rtu,
    Send {
        seq: u64,
        invalidate: Option<u32>,
        data: Vec<u8>,
    },
    Write {
        seq: u64,
        addr: u64,
        rkey: u32,
        data: Vec<u8>,
    },
    Read {
        seq: u64,
        addr: u64,
        rkey: u32,
        len: u32,
    },
    Ack {
        seq: u64,
        status: u8,
    },
    ReadResp {
        seq: u64,
        status: u8,
        data: Vec<u8>,
    },
}

pub(crate) fn status_code(s: WcStatus) -> u8 {
    match s {
        WcStatus::Success => 0,
        WcStatus::RemAccessErr => 1,
        WcStatus::RemInvReqErr => 2,
        WcStatus::RetryExcErr => 3,
        _ => 4,
    }
}

pub(crate) fn code_status(c: u8) -> WcStatus {
    match c {
        0 => WcStatus::Success,
        1 => WcStatus::RemAccessErr,
        2 => WcStatus::RemInvReqErr,
        3 => WcStatus::RetryExcErr,
        _ => WcStatus::RemOpErr,
    }
}

impl Frame {
    fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; 4];
        let mut put = |x: &[u8]| b.extend_from_slice(x);
        match self {
            Frame::Connect { private_data } => {
                put(&[1]);
                put(private_data);
            }
            Frame::Accept { private_data } => {
                put(&[2]);
                put(private_data);
            }
            Frame::Reject { private_data } => {
                put(&[3]);
                put(private_data);
            }
            Frame::Disconnect => put(&[4]),
            Frame::Rtu => put(&[10]),
            Frame::Send {
                seq,
                invalidate,
                data,
            } => {
                put(&[5]);
                put(&seq.to_le_bytes());
                put(&[u8::from(invalidate.is_some())]);
                put(&invalidate.unwrap_or(0).to_le_bytes());
                put(data);
            }
            Frame::Write {
                seq,
                addr,
                rkey,
                data,
            } => {
                put(&[6]);
                put(&seq.to_le_bytes());
                put(&addr.to_le_bytes());
                put(&rkey.to_le_bytes());
                put(data);
            }
            Frame::Read {
                seq,
                addr,
                rkey,
                len,
            } => {
                put(&[7]);
                put(&seq.to_le_bytes());
                put(&addr.to_le_bytes());
                put(&rkey.to_le_bytes());
                put(&len.to_le_bytes());
            }
            Frame::Ack { seq, status } => {
                put(&[8]);
                put(&seq.to_le_bytes());
                put(&[*status]);
            }
            Frame::ReadResp { seq, status, data } => {
                put(&[9]);
                put(&seq.to_le_bytes());
                put(&[*status]);
                put(data);
            }
        }
        let len = u32::try_from(b.len() - 4).unwrap_or(u32::MAX);
        b[..4].copy_from_slice(&len.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Frame> {
        let (&kind, p) = b.split_first()?;
        let u64_at = |o: usize| {
            p.get(o..o + 8)
                .map(|x| u64::from_le_bytes(x.try_into().unwrap_or([0; 8])))
        };
        let u32_at = |o: usize| {
            p.get(o..o + 4)
                .map(|x| u32::from_le_bytes(x.try_into().unwrap_or([0; 4])))
        };
        Some(match kind {
            1 => Frame::Connect {
                private_data: p.to_vec(),
            },
            2 => Frame::Accept {
                private_data: p.to_vec(),
            },
            3 => Frame::Reject {
                private_data: p.to_vec(),
            },
            4 => Frame::Disconnect,
            10 => Frame::Rtu,
            5 => Frame::Send {
                seq: u64_at(0)?,
                invalidate: (*p.get(8)? == 1).then_some(u32_at(9)?),
                data: p.get(13..)?.to_vec(),
            },
            6 => Frame::Write {
                seq: u64_at(0)?,
                addr: u64_at(8)?,
                rkey: u32_at(16)?,
                data: p.get(20..)?.to_vec(),
            },
            7 => Frame::Read {
                seq: u64_at(0)?,
                addr: u64_at(8)?,
                rkey: u32_at(16)?,
                len: u32_at(20)?,
            },
            8 => Frame::Ack {
                seq: u64_at(0)?,
                status: *p.get(8)?,
            },
            9 => Frame::ReadResp {
                seq: u64_at(0)?,
                status: *p.get(8)?,
                data: p.get(9..)?.to_vec(),
            },
            _ => return None,
        })
    }
}

fn read_frame(s: &mut TcpStream) -> io::Result<Frame> {
    read_frame_until(s, MAX_FRAME, None)
}

/// A frame of at most `max` bytes, read whole by `deadline` if there is one (a read timeout
/// bounds each read only: a peer sending a byte now and then would hold the reader).
fn read_frame_until(
    s: &mut TcpStream,
    max: usize,
    deadline: Option<std::time::Instant>,
) -> io::Result<Frame> {
    let read_all = |s: &mut TcpStream, b: &mut [u8]| -> io::Result<()> {
        let Some(deadline) = deadline else {
            return s.read_exact(b);
        };
        let mut at = 0;
        while at < b.len() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            s.set_read_timeout(Some(left))?;
            match s.read(&mut b[at..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    };
    let mut len = [0u8; 4];
    read_all(s, &mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "bad frame length",
        ));
    }
    let mut b = vec![0u8; len];
    read_all(s, &mut b)?;
    Frame::decode(&b).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad frame"))
}

/// A connection's sending side, kept in the fabric state.
pub(crate) struct LinkState {
    pub tx: mpsc::Sender<Frame>,
    /// The local CM ID the connection belongs to.
    pub cm_id: Option<u32>,
    /// The local QP bound to it, once connected.
    pub qp: Option<u32>,
    /// The stream, to close it from any thread (`shutdown` wakes its reader and writer).
    sock: TcpStream,
    /// Frames queued for the writer and not yet written.
    queued: Arc<AtomicUsize>,
    /// A last frame (Disconnect, Reject) is queued: what the peer sends from now on is
    /// dropped, and its reader ends at the next frame or when the writer closes the stream.
    closing: std::cell::Cell<bool>,
}

impl LinkState {
    /// A link over a loopback stream of its own, for tests that make one by hand.
    #[cfg(test)]
    pub(crate) fn for_test(tx: mpsc::Sender<Frame>) -> LinkState {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let sock = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        LinkState {
            tx,
            cm_id: None,
            qp: None,
            sock,
            queued: Arc::new(AtomicUsize::new(0)),
            closing: std::cell::Cell::new(false),
        }
    }

    /// Closes the stream both ways: the reader ends (and the link with it), the writer too.
    fn close(&self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

/// Starts the reader and writer threads of a TCP connection and registers it; returns the
/// link's ID.
pub(crate) fn start_link(
    fabric: &Fabric,
    stream: TcpStream,
    cm_id: Option<u32>,
) -> io::Result<u32> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(Some(LINK_WRITE_TIMEOUT))?;
    let mut reader = stream.try_clone()?;
    let sock = stream.try_clone()?;
    let mut writer = stream;
    let (tx, rx) = mpsc::channel::<Frame>();
    let queued = Arc::new(AtomicUsize::new(0));
    let link = {
        let mut s = fabric.lock();
        let id = s.alloc_id();
        s.links.insert(
            id,
            LinkState {
                tx,
                cm_id,
                qp: None,
                sock,
                queued: Arc::clone(&queued),
                closing: std::cell::Cell::new(false),
            },
        );
        id
    };
    let spawned = std::thread::Builder::new()
        .name(format!("soft-tx-{link:x}"))
        .spawn(move || {
            while let Ok(f) = rx.recv() {
                let last = matches!(f, Frame::Disconnect | Frame::Reject { .. });
                let written = writer.write_all(&f.encode()).is_ok();
                queued.fetch_sub(1, Ordering::Relaxed);
                if !written || last {
                    break;
                }
            }
            // Both ways: a reader blocked on a peer that keeps the stream open wakes and
            // ends, and the link with it.
            let _ = writer.shutdown(std::net::Shutdown::Both);
        })
        .and_then(|_| {
            let f = fabric.clone();
            std::thread::Builder::new()
                .name(format!("soft-rx-{link:x}"))
                .spawn(move || {
                    while let Ok(frame) = read_frame(&mut reader) {
                        let mut s = f.lock();
                        if s.links.get(&link).is_none_or(|l| l.closing.get()) {
                            break;
                        }
                        s.on_frame(&f, link, frame);
                    }
                    f.lock().link_lost(link);
                })
        });
    if let Err(e) = spawned {
        // The writer (if it started) ends when its channel goes.
        let mut s = fabric.lock();
        if let Some(l) = s.links.remove(&link) {
            l.close();
        }
        return Err(e);
    }
    Ok(link)
}

/// Accepts TCP connections for a listening address until the listener is closed.
pub(crate) fn start_acceptor(
    fabric: &Fabric,
    addr: SocketAddr,
    listener_id: u32,
) -> io::Result<SocketAddr> {
    let l = TcpListener::bind(addr)?;
    let local = l.local_addr()?;
    let handle = l.try_clone()?;
    let f = fabric.clone();
    let handshakes = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name(format!("soft-accept-{}", local.port()))
        .spawn(move || {
            for conn in l.incoming() {
                // A listener shut down by `stop_acceptor` fails every accept from then on.
                if !f.lock().cm.listening(listener_id) {
                    break;
                }
                let conn = match conn {
                    Ok(c) => c,
                    // Out of file descriptors or memory: every accept fails at once until
                    // some are freed; a pause keeps this thread from spinning meanwhile.
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                        ) =>
                    {
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                    Err(_) => continue,
                };
                if handshakes.fetch_add(1, Ordering::AcqRel) >= HANDSHAKES_MAX {
                    handshakes.fetch_sub(1, Ordering::AcqRel);
                    continue;
                }
                let (f2, count) = (f.clone(), Arc::clone(&handshakes));
                let spawned = std::thread::Builder::new()
                    .name(format!("soft-hs-{}", local.port()))
                    .spawn(move || {
                        handshake(&f2, conn, listener_id);
                        count.fetch_sub(1, Ordering::AcqRel);
                    });
                if spawned.is_err() {
                    handshakes.fetch_sub(1, Ordering::AcqRel);
                }
            }
        })?;
    let mut s = fabric.lock();
    if s.cm.listening(listener_id) {
        s.cm.acceptors.insert(listener_id, handle);
    } else {
        // The ID went while the acceptor started: nothing else will stop it.
        drop(s);
        stop_acceptor(handle);
    }
    Ok(local)
}

/// An accepted connection's first frame, its connect request, read within
/// `HANDSHAKE_TIMEOUT`, makes it a link and a connect request on the listener.
fn handshake(f: &Fabric, mut conn: TcpStream, listener_id: u32) {
    let deadline = std::time::Instant::now() + HANDSHAKE_TIMEOUT;
    let Ok(Frame::Connect { private_data }) =
        read_frame_until(&mut conn, CONNECT_FRAME_MAX, Some(deadline))
    else {
        return;
    };
    let from = conn.peer_addr().ok();
    let Ok(link) = start_link(f, conn, None) else {
        return;
    };
    let mut s = f.lock();
    let id = s.cm.remote_request(link, listener_id, private_data, from);
    match (id, s.links.get_mut(&link)) {
        (Some(id), Some(l)) => l.cm_id = Some(id),
        // No longer listening: the link has no ID to belong to.
        (None, Some(l)) => l.close(),
        (_, None) => {}
    }
}

/// Stops the acceptor thread of a listener whose ID is gone: shutting the listening socket
/// down wakes its blocked `accept` with an error (Linux), the thread sees that the ID no
/// longer listens and ends, closing the socket. The address can be bound again at once (the
/// socket no longer listens; std binds with SO_REUSEADDR).
pub(crate) fn stop_acceptor(l: TcpListener) {
    // `shutdown` is a socket call, not a stream one: through a stream handle of the same fd.
    let _ = TcpStream::from(std::os::fd::OwnedFd::from(l)).shutdown(std::net::Shutdown::Read);
}

impl State {
    pub(crate) fn send_frame(&self, link: u32, f: Frame) {
        let Some(l) = self.links.get(&link) else {
            return;
        };
        if l.closing.get() {
            return;
        }
        if l.queued.fetch_add(1, Ordering::Relaxed) >= LINK_QUEUE_FRAMES {
            // The peer does not read what it is sent.
            l.queued.fetch_sub(1, Ordering::Relaxed);
            return l.close();
        }
        l.closing
            .set(matches!(f, Frame::Disconnect | Frame::Reject { .. }));
        if l.tx.send(f).is_err() {
            l.queued.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn link_qp(&self, link: u32) -> Option<u32> {
        self.links.get(&link).and_then(|l| l.qp)
    }

    /// Applies a frame from the peer.
    pub(crate) fn on_frame(&mut self, _fabric: &Fabric, link: u32, frame: Frame) {
        match frame {
            Frame::Connect { .. } => {}
            Frame::Accept { private_data } => self.cm_remote_accepted(link, private_data),
            Frame::Reject { private_data } => self.cm_remote_rejected(link, private_data),
            Frame::Disconnect => self.cm_remote_disconnected(link),
            Frame::Rtu => self.cm_remote_rtu(link),
            Frame::Send {
                seq,
                invalidate,
                data,
            } => self.on_send(link, seq, invalidate, data),
            Frame::Write {
                seq,
                addr,
                rkey,
                data,
            } => self.on_write(link, seq, (addr, rkey), &data),
            Frame::Read {
                seq,
                addr,
                rkey,
                len,
            } => self.on_read(link, seq, (addr, rkey), len),
            Frame::Ack { seq, status } => self.remote_done(link, seq, code_status(status), None),
            Frame::ReadResp { seq, status, data } => {
                self.remote_done(link, seq, code_status(status), Some(data))
            }
        }
    }

    /// A SEND from the peer: into a receive of the linked QP's SRQ, or waiting for one.
    fn on_send(&mut self, link: u32, seq: u64, invalidate: Option<u32>, data: Vec<u8>) {
        let Some(dst) = self.link_qp(link) else {
            return self.send_frame(
                link,
                Frame::Ack {
                    seq,
                    status: status_code(WcStatus::RetryExcErr),
                },
            );
        };
        // The SRQ of the QP it is for fails (`Faults::srq_error_per_million`): drawn here,
        // by the fabric that holds the SRQ, as the in-process wire draws it at the sender.
        if self.faults.srq_error_per_million > 0
            && self.draw() < u64::from(self.faults.srq_error_per_million)
        {
            if let Some(srq) = self.qps.get(&dst).and_then(|q| q.srq) {
                self.injected.srq_errors += 1;
                self.srq_error(srq);
            }
        }
        let m = Pending {
            from_qpn: 0,
            wr_id: 0,
            signaled: false,
            data,
            invalidate,
            remote: Some((link, seq)),
        };
        let waiting = self.qps.get(&dst).is_some_and(|q| !q.inbound.is_empty());
        match if waiting { None } else { self.deliver(dst, &m) } {
            Some(Ok(())) => self.send_frame(link, Frame::Ack { seq, status: 0 }),
            Some(Err(())) => self.send_frame(
                link,
                Frame::Ack {
                    seq,
                    status: status_code(WcStatus::RemInvReqErr),
                },
            ),
            None => {
                // Receiver not ready: the message waits (rnr_retry 7 at the sender), up to
                // `INBOUND_MAX` of them.
                let Some(q) = self.qps.get_mut(&dst) else {
                    return;
                };
                let bytes: usize = q.inbound.iter().map(|p| p.data.len()).sum();
                if q.inbound.len() < INBOUND_MAX && bytes + m.data.len() <= INBOUND_MAX_BYTES {
                    q.inbound.push_back(m);
                    self.inbound_any = true;
                    return;
                }
                self.send_frame(
                    link,
                    Frame::Ack {
                        seq,
                        status: status_code(WcStatus::RetryExcErr),
                    },
                );
                self.qp_error(dst);
            }
        }
    }

    /// An RDMA WRITE from the peer into memory registered on the linked QP's device.
    fn on_write(&mut self, link: u32, seq: u64, (addr, rkey): (u64, u32), data: &[u8]) {
        let ok = self
            .link_qp(link)
            .and_then(|q| self.qps.get(&q).map(|q| (q.dev, q.pd)))
            .is_some_and(|(dev, pd)| {
                self.check_remote(dev, pd, addr, data.len() as u64, rkey, Access::REMOTE_WRITE)
            });
        if ok {
            super::scatter(
                &[Sge {
                    addr,
                    length: u32::try_from(data.len()).unwrap_or(u32::MAX),
                    lkey: 0,
                }],
                data,
            );
        }
        let status = if ok {
            0
        } else {
            status_code(WcStatus::RemAccessErr)
        };
        self.send_frame(link, Frame::Ack { seq, status });
    }

    /// An RDMA READ from the peer of memory registered on the linked QP's device.
    fn on_read(&mut self, link: u32, seq: u64, (addr, rkey): (u64, u32), len: u32) {
        let ok = self
            .link_qp(link)
            .and_then(|q| self.qps.get(&q).map(|q| (q.dev, q.pd)))
            .is_some_and(|(dev, pd)| {
                self.check_remote(dev, pd, addr, u64::from(len), rkey, Access::REMOTE_READ)
            });
        let resp = if ok {
            let mut data = super::gather(&[Sge {
                addr,
                length: len,
                lkey: 0,
            }]);
            match self.faults.read_answer {
                super::ReadAnswer::Data => {}
                super::ReadAnswer::AckOnly => {
                    return self.send_frame(link, Frame::Ack { seq, status: 0 });
                }
                super::ReadAnswer::Short => {
                    data.pop();
                }
            }
            Frame::ReadResp {
                seq,
                status: 0,
                data,
            }
        } else {
            Frame::ReadResp {
                seq,
                status: status_code(WcStatus::RemAccessErr),
                data: Vec::new(),
            }
        };
        self.send_frame(link, resp);
    }

    /// The responder answered a request of ours.
    fn remote_done(&mut self, link: u32, seq: u64, status: WcStatus, read: Option<Vec<u8>>) {
        let Some(qpn) = self.link_qp(link) else {
            return;
        };
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Some(wr) = q.remote_pending.remove(&seq) else {
            return;
        };
        q.deferred = q.deferred.saturating_sub(1);
        // An RDMA READ is answered with exactly its data, anything else with an
        // acknowledgement: a peer that does otherwise fails the work request (its data is not
        // there) and the QP, as a malformed response does on a NIC.
        let status = match (status, wr.opcode, &read) {
            (WcStatus::Success, WcOpcode::RdmaRead, Some(data))
                if data.len() as u64
                    == wr
                        .read_sges
                        .iter()
                        .map(|s| u64::from(s.length))
                        .sum::<u64>() =>
            {
                WcStatus::Success
            }
            (WcStatus::Success, WcOpcode::RdmaRead, _) => WcStatus::RemOpErr,
            (WcStatus::Success, _, Some(_)) => WcStatus::RemOpErr,
            (status, _, _) => status,
        };
        if let (WcStatus::Success, Some(data)) = (status, read) {
            super::scatter(&wr.read_sges, &data);
        }
        self.complete_send(qpn, wr.wr_id, wr.signaled, status, wr.opcode);
        if status != WcStatus::Success {
            self.qp_error(qpn);
        }
    }

    /// The TCP connection broke: its QP fails, its CM ID hears `Disconnected` (`Rejected`
    /// while its CM exchange was under way: the other process is gone).
    pub(crate) fn link_lost(&mut self, link: u32) {
        if let Some(q) = self.link_qp(link) {
            self.qp_error(q);
        }
        self.cm_remote_disconnected(link);
        self.links.remove(&link);
    }
}
