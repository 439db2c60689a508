//! An in-memory transport: a host and the target core in one process, for the core's tests and
//! its fuzz target (which include this file).
//!
//! It does what an RDMA transport does, with plain copies: the host "registers" buffers under
//! keys, the target fetches and pushes data by key with bounds checked on every access (a bad
//! key or range is a remote access error, which closes the connection as on hardware), and
//! block operations run on real `nvmfd-blockdev` devices.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use nvmfd_blockdev::{BlockError, BufPool, DevId, Device, DeviceInfo, Engine};
use zerocopy::IntoBytes;

use nvmfd_nvme::host::{DataDir, HostError, HostTransport};
use nvmfd_nvme::wire::{Cqe, SglDesc, Sqe};
use nvmfd_nvme::Target;
use nvmfd_nvme::{
    Action, BlockFailure, CmParams, DataRef, IoOp, IoRequest, NamespaceInfo, Queue, SQE_SIZE,
};

/// The block devices behind the target's namespaces, and one engine to reach them (shared by
/// every loopback connection of a test, as a reactor's is).
pub struct Backend {
    engine: Engine,
    pool: BufPool,
    devs: HashMap<(String, u32), DevId>,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("devices", &self.devs.len())
            .finish()
    }
}

impl Backend {
    /// Attaches `devices` (subsystem NQN, NSID, device), with buffers of `max_io_size`.
    pub fn new(
        devices: &[(String, u32, Arc<Device>)],
        max_io_size: u32,
    ) -> std::io::Result<Rc<RefCell<Backend>>> {
        let pool = BufPool::new(8, max_io_size as usize, false)?;
        let mut engine = Engine::new(
            16,
            nvmfd_nvme::wire::sat(devices.len().max(1)),
            std::slice::from_ref(&pool),
        )?;
        let mut devs = HashMap::new();
        for (nqn, nsid, d) in devices {
            devs.insert((nqn.clone(), *nsid), engine.attach(d)?);
        }
        Ok(Rc::new(RefCell::new(Backend { engine, pool, devs })))
    }

    fn run(
        &mut self,
        subnqn: &str,
        nsid: u32,
        op: &IoOp,
        data: Option<&[u8]>,
    ) -> (Result<u32, BlockError>, Option<Vec<u8>>) {
        let Some(&dev) = self.devs.get(&(subnqn.to_owned(), nsid)) else {
            return (Err(BlockError::UnknownDevice), None);
        };
        let mut out = None;
        let mut result = Ok(0);
        let mut done = |c: nvmfd_blockdev::Completion| {
            if let Err(e) = c.result {
                result = Err(e);
            }
            if let Some(b) = c.buf {
                out = Some(b.as_slice().to_vec());
            }
        };
        let queued = match op {
            IoOp::Read { offset, len } => {
                let mut b = self.pool.take().expect("a free buffer");
                b.set_len(*len as usize);
                self.engine.read(dev, *offset, b, 0)
            }
            IoOp::Write { offset, len, fua } => {
                let mut b = self.pool.take().expect("a free buffer");
                b.set_len(*len as usize);
                b.as_mut_slice()
                    .copy_from_slice(&data.unwrap_or(&[])[..*len as usize]);
                self.engine.write(dev, *offset, b, *fua, 0)
            }
            IoOp::Flush | IoOp::FlushAll { .. } => self.engine.flush(dev, 0),
            IoOp::WriteZeroes { offset, len, fua } => {
                self.engine.write_zeroes(dev, *offset, *len, *fua, 0)
            }
            IoOp::Deallocate { ranges } => {
                for &(o, l) in ranges {
                    if let Err(r) = self.engine.deallocate(dev, o, l, 0) {
                        return (Err(r.error), None);
                    }
                    if let Err(e) = self.engine.drain(&mut done) {
                        return (
                            Err(BlockError::Io(e.raw_os_error().unwrap_or(libc_eio()))),
                            None,
                        );
                    }
                }
                return (result, None);
            }
        };
        if let Err(r) = queued {
            return (Err(r.error), None);
        }
        if let Err(e) = self.engine.drain(&mut done) {
            return (
                Err(BlockError::Io(e.raw_os_error().unwrap_or(libc_eio()))),
                None,
            );
        }
        let is_read = matches!(op, IoOp::Read { .. });
        (result, if is_read { out } else { None })
    }
}

fn libc_eio() -> i32 {
    5
}

/// Host memory registered under a key.
struct Region {
    addr: u64,
    bytes: Vec<u8>,
}

/// One loopback connection: a host end and a target [`Queue`].
pub struct Loopback {
    queue: Queue,
    backend: Rc<RefCell<Backend>>,
    /// Largest in-capsule data the host puts in a capsule (0: always keyed).
    pub in_capsule: u32,
    regions: HashMap<u32, Region>,
    next_key: u32,
    closed: Option<String>,
    /// Completions that arrived without a command (AERs).
    pub events: Vec<Cqe>,
    /// Commands answered with `Action::Hold`, by command ID.
    pub held: Vec<u16>,
    /// The time the queue sees (tests move it to expire keep-alives).
    pub now: Instant,
    /// The block operations the target asked for, in order.
    pub ops: Vec<IoOp>,
    /// Runs while a shutdown's flush of every namespace is under way, before it flushes.
    pub flush_all_hook: Option<Box<dyn FnMut()>>,
}

impl std::fmt::Debug for Loopback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loopback")
            .field("queue", &self.queue)
            .field("closed", &self.closed)
            .finish()
    }
}

impl Loopback {
    /// A new connection to `target`, as if the RDMA CM request carried `qid` and `hsqsize`.
    pub fn new(
        target: &Target,
        backend: &Rc<RefCell<Backend>>,
        qid: u16,
        hsqsize: u16,
    ) -> Loopback {
        Loopback {
            queue: Queue::new(target, Some(CmParams { qid, hsqsize })),
            backend: Rc::clone(backend),
            in_capsule: target.limits().in_capsule_data_size,
            regions: HashMap::new(),
            next_key: 0x100,
            closed: None,
            events: Vec::new(),
            held: Vec::new(),
            now: Instant::now(),
            ops: Vec::new(),
            flush_all_hook: None,
        }
    }

    /// The target's queue.
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    /// The target's queue, to drive by hand (commands completed out of order).
    pub fn queue_mut(&mut self) -> &mut Queue {
        &mut self.queue
    }

    /// Why the connection closed, if it did.
    pub fn closed(&self) -> Option<&str> {
        self.closed.as_deref()
    }

    fn register(&mut self, bytes: Vec<u8>) -> (u64, u32) {
        self.next_key = self.next_key.wrapping_add(1);
        let key = self.next_key;
        let addr = u64::from(key) << 32;
        self.regions.insert(key, Region { addr, bytes });
        (addr, key)
    }

    /// The host memory a keyed access touches, or why it is refused.
    fn region(&mut self, addr: u64, len: u32, key: u32) -> Result<&mut [u8], String> {
        let r = self
            .regions
            .get_mut(&key)
            .ok_or_else(|| format!("remote access error: unknown key {key:#x}"))?;
        let start = addr
            .checked_sub(r.addr)
            .and_then(|s| usize::try_from(s).ok());
        let end = start.and_then(|s| s.checked_add(len as usize));
        match (start, end) {
            (Some(s), Some(e)) if e <= r.bytes.len() => Ok(&mut r.bytes[s..e]),
            _ => Err(format!(
                "remote access error: {addr:#x}+{len} outside key {key:#x}"
            )),
        }
    }

    fn fetch(&mut self, capsule: &[u8], from: DataRef) -> Result<Vec<u8>, String> {
        match from {
            DataRef::InCapsule { offset, len } => {
                let s = SQE_SIZE + offset as usize;
                capsule
                    .get(s..s + len as usize)
                    .map(<[u8]>::to_vec)
                    .ok_or_else(|| "in-capsule data out of the capsule".to_owned())
            }
            DataRef::Keyed { addr, len, key, .. } => {
                self.region(addr, len, key).map(|r| r.to_vec())
            }
            DataRef::KeyedList { offset, count, len } => {
                let mut out = Vec::with_capacity(len as usize);
                let icd = capsule.get(SQE_SIZE..).unwrap_or(&[]);
                for (addr, l, key) in nvmfd_nvme::keyed_segments(icd, offset, count) {
                    let n =
                        l.min(len.saturating_sub(nvmfd_nvme::wire::sat::<u32, usize>(out.len())));
                    out.extend_from_slice(self.region(addr, n, key)?);
                }
                Ok(out)
            }
        }
    }

    fn push(&mut self, capsule: &[u8], data: &[u8], dest: DataRef) -> Result<(), String> {
        match dest {
            DataRef::KeyedList { offset, count, len } => {
                let icd = capsule.get(SQE_SIZE..).unwrap_or(&[]);
                let mut rest = &data[..(len as usize).min(data.len())];
                for (addr, l, key) in nvmfd_nvme::keyed_segments(icd, offset, count) {
                    let n = (l as usize).min(rest.len());
                    let r = self.region(addr, nvmfd_nvme::wire::sat(n), key)?;
                    r.copy_from_slice(&rest[..n]);
                    rest = &rest[n..];
                }
                Ok(())
            }
            DataRef::Keyed { addr, len, key, .. } => {
                let n = (len as usize).min(data.len());
                let r = self.region(addr, nvmfd_nvme::wire::sat(n), key)?;
                r.copy_from_slice(&data[..n]);
                Ok(())
            }
            DataRef::InCapsule { .. } => {
                Err("the target pushed data to an in-capsule descriptor".into())
            }
        }
    }

    fn io(&mut self, capsule: &[u8], req: &IoRequest) -> Result<Cqe, String> {
        self.ops.push(req.op.clone());
        let subnqn = self
            .queue
            .controller()
            .map(|c| c.subnqn.clone())
            .unwrap_or_default();
        let data = match (&req.op, req.data) {
            (IoOp::Write { .. }, Some(from)) => Some(self.fetch(capsule, from)?),
            _ => None,
        };
        let (result, read) = match &req.op {
            IoOp::FlushAll { nsids, .. } => {
                if let Some(hook) = self.flush_all_hook.as_mut() {
                    hook();
                }
                let mut r = Ok(0);
                for &n in nsids {
                    let (x, _) = self
                        .backend
                        .borrow_mut()
                        .run(&subnqn, n, &IoOp::Flush, None);
                    if x.is_err() {
                        r = x;
                    }
                }
                (r, None)
            }
            op => self
                .backend
                .borrow_mut()
                .run(&subnqn, req.nsid, op, data.as_deref()),
        };
        if let (Ok(_), Some(bytes), Some(dest)) = (&result, read, req.data) {
            self.push(capsule, &bytes, dest)?;
        }
        Ok(self.queue.io_done(req, result.map_err(|e| failure(&e))))
    }

    /// Sends a raw capsule (SQE plus in-capsule data) and runs the target until it answers,
    /// holds the command, or closes the connection. Host buffers are the ones registered.
    pub fn send_capsule(&mut self, capsule: &[u8]) -> Result<Option<Cqe>, HostError> {
        if let Some(why) = &self.closed {
            return Err(HostError::Transport(format!("connection closed: {why}")));
        }
        let mut action = self.queue.handle(capsule, self.now);
        // Every command ends in a bounded number of steps (fetch, then I/O or respond).
        for _ in 0..4 {
            let step: Result<Option<Action>, String> = match action {
                Action::Respond { cqe, data } => {
                    if let Some((bytes, dest)) = data {
                        if let Err(e) = self.push(capsule, &bytes, dest) {
                            self.closed = Some(e.clone());
                            return Err(HostError::Transport(e));
                        }
                    }
                    self.events.extend(self.queue.poll_events());
                    return Ok(Some(cqe));
                }
                Action::Fetch { cmd, from } => self
                    .fetch(capsule, from)
                    .map(|d| Some(self.queue.data_arrived(cmd, &d, self.now))),
                Action::Io(req) => self
                    .io(capsule, &req)
                    .map(|cqe| Some(Action::Respond { cqe, data: None })),
                Action::Hold => {
                    if let Some(s) = nvmfd_nvme::wire::read::<Sqe>(capsule) {
                        self.held.push(s.cid.get());
                    }
                    self.events.extend(self.queue.poll_events());
                    return Ok(None);
                }
                Action::Disconnect { cqe, reason } => {
                    self.closed = Some(reason.to_owned());
                    return match cqe {
                        Some(c) => Ok(Some(c)),
                        None => Err(HostError::Transport(format!(
                            "target disconnected: {reason}"
                        ))),
                    };
                }
            };
            match step {
                Ok(Some(a)) => action = a,
                Ok(None) => return Ok(None),
                Err(e) => {
                    // A remote access error: the QP goes to error, the connection closes.
                    self.closed = Some(e.clone());
                    return Err(HostError::Transport(e));
                }
            }
        }
        Err(HostError::Protocol(
            "the target did not finish the command".into(),
        ))
    }

    /// Registers `bytes` as host memory and returns (address, key), for hand-made SGLs.
    pub fn register_host_memory(&mut self, bytes: Vec<u8>) -> (u64, u32) {
        self.register(bytes)
    }

    /// Host memory registered under `key`.
    pub fn host_memory(&self, key: u32) -> Option<&[u8]> {
        self.regions.get(&key).map(|r| r.bytes.as_slice())
    }

    /// Collects AER completions the target has due.
    pub fn poll_events(&mut self) -> Vec<Cqe> {
        self.events.extend(self.queue.poll_events());
        std::mem::take(&mut self.events)
    }
}

impl HostTransport for Loopback {
    fn execute(&mut self, mut sqe: Sqe, data: DataDir<'_>) -> Result<Cqe, HostError> {
        let mut capsule = Vec::with_capacity(SQE_SIZE + self.in_capsule as usize);
        let mut readback = None;
        match &data {
            DataDir::None => sqe.dptr = SglDesc::keyed(0, 0, 0, false),
            DataDir::ToTarget(d) if d.len() <= self.in_capsule as usize => {
                sqe.dptr = SglDesc::in_capsule(0, nvmfd_nvme::wire::sat(d.len()));
            }
            DataDir::ToTarget(d) => {
                let (addr, key) = self.register(d.to_vec());
                sqe.dptr = SglDesc::keyed(addr, nvmfd_nvme::wire::sat(d.len()), key, false);
            }
            DataDir::FromTarget(b) => {
                let (addr, key) = self.register(vec![0u8; b.len()]);
                sqe.dptr = SglDesc::keyed(addr, nvmfd_nvme::wire::sat(b.len()), key, false);
                readback = Some(key);
            }
        }
        capsule.extend_from_slice(sqe.as_bytes());
        if let DataDir::ToTarget(d) = &data {
            if d.len() <= self.in_capsule as usize {
                capsule.extend_from_slice(d);
            }
        }
        let result = self.send_capsule(&capsule);
        if let (Some(key), DataDir::FromTarget(buf)) = (readback, data) {
            if let Some(r) = self.regions.get(&key) {
                buf.copy_from_slice(&r.bytes);
            }
        }
        self.regions.clear();
        match result? {
            Some(c) => Ok(c),
            None => Err(HostError::Protocol(
                "the command was held (an asynchronous event request)".into(),
            )),
        }
    }
}

/// What the core is told of a block error.
fn failure(e: &BlockError) -> BlockFailure {
    match e {
        BlockError::Misaligned { .. } => BlockFailure::Misaligned,
        BlockError::OutOfRange { .. } => BlockFailure::OutOfRange,
        BlockError::ReadOnly => BlockFailure::ReadOnly,
        BlockError::Unsupported(_) => BlockFailure::Unsupported,
        BlockError::NoSpace => BlockFailure::NoSpace,
        BlockError::QueueFull => BlockFailure::QueueFull,
        BlockError::UnknownDevice => BlockFailure::UnknownDevice,
        BlockError::ShortTransfer { .. } | BlockError::Io(_) => BlockFailure::Io,
    }
}

/// What the core is told of a device.
pub fn namespace_info(d: &DeviceInfo) -> NamespaceInfo {
    NamespaceInfo {
        size: d.size,
        logical_block_size: d.logical_block_size,
        physical_block_size: d.physical_block_size,
        read_only: d.read_only,
        write_zeroes: d.write_zeroes,
        deallocate: d.deallocate,
        deallocate_max_blocks: d.deallocate_max_blocks,
        volatile_cache: d.volatile_cache,
    }
}
