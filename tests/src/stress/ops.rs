//! The host side of the stress: controllers and their queues, the random operations, and
//! what each completion tells the model.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nvmf_host::{Done, Payload, PipelinedQueue, RdmaQueue};
use nvmfd_nvme::host::{rw_sqe, AdminQueue, HostError, HostId, IoQueue};
use nvmfd_nvme::wire::{self, io_opcode, Sqe};
use nvmfd_rdma::any::cm::CmChannel;
use nvmfd_rdma::soft::Fabric;
use zerocopy::little_endian::U32;

use super::model::{fill_block, NsModel};
use super::{namespaces, Config, Report, SUBSYSTEM};

/// Largest transfer of one command, and the in-capsule data the host sends.
const MAX_IO: u32 = 128 * 1024;
const IN_CAPSULE: u32 = 4096;
/// How long a controller may take to connect again before the target is taken as stuck.
const RECONNECT_LIMIT: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    WriteFua,
    Flush,
    WriteZeroes,
    Deallocate,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Read => "read",
            Kind::Write => "write",
            Kind::WriteFua => "write_fua",
            Kind::Flush => "flush",
            Kind::WriteZeroes => "write_zeroes",
            Kind::Deallocate => "deallocate",
        }
    }
}

/// A command in flight.
#[derive(Debug)]
struct Inflight {
    kind: Kind,
    ns: usize,
    ranges: Vec<(u64, u32)>,
    version: u32,
}

/// A command ready to go: what it covers and carries.
struct Built {
    sqe: Sqe,
    ranges: Vec<(u64, u32)>,
    version: u32,
    data: Vec<u8>,
    read_len: Option<usize>,
}

/// A connected controller.
struct Ctrl {
    admin: AdminQueue<RdmaQueue>,
    ios: Vec<IoQueue<PipelinedQueue>>,
    /// Commands each I/O queue keeps outstanding (its depth, or less).
    depth: Vec<usize>,
    keep_alive: Instant,
}

/// The host: its fabric, controllers, model and random stream.
pub(super) struct Host {
    pub(super) fabric: Fabric,
    addr: SocketAddr,
    id: HostId,
    rng: fastrand::Rng,
    ctrls: Vec<Option<Ctrl>>,
    ns: Vec<NsModel>,
    inflight: Vec<Option<Inflight>>,
    free_tags: Vec<usize>,
    next_version: u32,
    done: Vec<Done>,
    buf: Vec<u8>,
}

impl Host {
    pub(super) fn new(cfg: &Config, addr: SocketAddr) -> Host {
        let fabric = Fabric::networked();
        let _ = fabric.add_device([127, 0, 0, 1].into());
        Host {
            fabric,
            addr,
            id: HostId {
                nqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000057e".into(),
                id: [0x57; 16],
            },
            rng: fastrand::Rng::with_seed(cfg.seed),
            ctrls: (0..cfg.controllers).map(|_| None).collect(),
            ns: Vec::new(),
            inflight: Vec::new(),
            free_tags: Vec::new(),
            next_version: 1,
            done: Vec::new(),
            buf: vec![0u8; MAX_IO as usize],
        }
    }

    fn channel(&self) -> CmChannel {
        CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&self.fabric).expect("a CM channel"))
    }

    /// Connects a controller with one to three I/O queues of random depths.
    fn try_connect(&mut self) -> Result<Ctrl, HostError> {
        let q = RdmaQueue::connect(self.channel(), self.addr, 0, 31, IN_CAPSULE, MAX_IO)?;
        let mut admin = AdminQueue::connect(q, &self.id, SUBSYSTEM, 31, 10_000)?;
        admin.enable()?;
        let n = self.rng.u16(1..=3);
        admin.set_queue_count(n)?;
        let (ios, depth) = self.connect_ios(&admin, n)?;
        Ok(Ctrl {
            admin,
            ios,
            depth,
            keep_alive: Instant::now(),
        })
    }

    /// Connects controller `c`, trying again while connects fail (faults), for at most
    /// `RECONNECT_LIMIT`.
    fn connect(&mut self, c: usize, report: &mut Report) {
        let end = Instant::now() + RECONNECT_LIMIT;
        loop {
            match self.try_connect() {
                Ok(ctrl) => {
                    report.connects += 1;
                    self.ctrls[c] = Some(ctrl);
                    return;
                }
                Err(e) if Instant::now() > end => {
                    report.mismatches.push(format!(
                        "no controller could connect for {RECONNECT_LIMIT:?}; the last error: {e}"
                    ));
                    return;
                }
                Err(_) => report.connect_failures += 1,
            }
        }
    }

    /// The first controllers, and the model of the namespaces from Identify.
    pub(super) fn setup(&mut self, report: &mut Report) {
        for c in 0..self.ctrls.len() {
            self.connect(c, report);
        }
        let Some(ctrl) = self.ctrls[0].as_mut() else {
            return;
        };
        let mut sizes = Vec::new();
        for (nsid, bs) in [(1u32, 512usize), (2, 4096)] {
            let id = ctrl
                .admin
                .identify_namespace(nsid)
                .expect("Identify Namespace with no faults");
            sizes.push((nsid, bs, id.nsze.get(), id.dlfeat & 7 == 1));
        }
        self.ns = namespaces(&sizes);
    }

    /// One turn: maybe a controller event, then every I/O queue filled to its depth, then
    /// every completion taken in.
    pub(super) fn turn(&mut self, report: &mut Report) {
        let c = self.rng.usize(0..self.ctrls.len());
        match self.rng.u32(0..10_000) {
            0..=2 => self.reset(c, report),
            3..=5 => self.reconnect(c, report),
            6..=40 => self.admin_op(c, report),
            _ => {}
        }
        self.keep_alives(report);
        for c in 0..self.ctrls.len() {
            self.fill(c, report);
        }
        self.poll_all(report);
    }

    fn poll_all(&mut self, report: &mut Report) {
        for c in 0..self.ctrls.len() {
            if self.poll_ctrl(c, report) {
                self.reconnect(c, report);
            }
        }
    }

    /// Takes in the completions of controller `c`'s I/O queues; true if one of them broke.
    fn poll_ctrl(&mut self, c: usize, report: &mut Report) -> bool {
        let n = self.ctrls[c].as_ref().map_or(0, |x| x.ios.len());
        let mut broken = false;
        for q in 0..n {
            let mut done = std::mem::take(&mut self.done);
            let io = self.ctrls[c].as_mut().expect("counted above").ios[q].transport();
            io.poll(&mut done);
            broken |= io.broken().is_some();
            for d in done.drain(..) {
                self.complete(c, q, &d, report);
            }
            self.done = done;
        }
        broken
    }

    /// Submits new commands on every I/O queue of controller `c` up to its depth.
    fn fill(&mut self, c: usize, report: &mut Report) {
        let Some(n) = self.ctrls[c].as_ref().map(|x| x.ios.len()) else {
            return self.connect(c, report);
        };
        for q in 0..n {
            loop {
                let (out, depth) = {
                    let ctrl = self.ctrls[c].as_mut().expect("checked above");
                    (ctrl.ios[q].transport().outstanding(), ctrl.depth[q])
                };
                if out >= depth || !self.submit_one(c, q, report) {
                    break;
                }
            }
        }
    }

    fn tag(&mut self, f: Inflight) -> usize {
        match self.free_tags.pop() {
            Some(t) => {
                self.inflight[t] = Some(f);
                t
            }
            None => {
                self.inflight.push(Some(f));
                self.inflight.len() - 1
            }
        }
    }

    /// A random free range of namespace `ns` of at most `max` blocks (untainted for a write).
    fn pick_range(&mut self, ns: usize, max: u32, write: bool) -> Option<(u64, u32)> {
        let m = &self.ns[ns];
        let cap = (MAX_IO as usize / m.block_size) as u32;
        for _ in 0..8 {
            let nlb = match self.rng.u32(0..10) {
                0..=4 => self.rng.u32(1..=8),
                5..=7 => self.rng.u32(1..=cap / 2),
                _ => self.rng.u32(1..=cap),
            }
            .min(max);
            let lba = self.rng.u64(0..=m.blocks - u64::from(nlb));
            if m.free(lba, nlb, write) {
                return Some((lba, nlb));
            }
        }
        None
    }

    /// Submits one random command on queue `q` of controller `c`; false when none could go.
    fn submit_one(&mut self, c: usize, q: usize, _report: &mut Report) -> bool {
        let ns = self.rng.usize(0..self.ns.len());
        let kind = match self.rng.u32(0..100) {
            0..=39 => Kind::Read,
            40..=69 => Kind::Write,
            70..=77 => Kind::WriteFua,
            78..=83 => Kind::Flush,
            84..=91 => Kind::WriteZeroes,
            _ => Kind::Deallocate,
        };
        let built = match kind {
            Kind::Flush => {
                let mut s: Sqe = wire::zeroed();
                s.opcode = io_opcode::FLUSH;
                s.nsid = U32::new(self.ns[ns].nsid);
                Some(Built {
                    sqe: s,
                    ranges: Vec::new(),
                    version: 0,
                    data: Vec::new(),
                    read_len: None,
                })
            }
            Kind::Deallocate => self.deallocation(ns),
            _ => self.transfer(ns, kind),
        };
        let Some(b) = built else { return false };
        let payload = match b.read_len {
            Some(n) => Payload::In(n),
            None if b.data.is_empty() => Payload::None,
            None => Payload::Out(&b.data),
        };
        for &(lba, nlb) in &b.ranges {
            self.ns[ns].hold(lba, nlb);
        }
        let tag = self.tag(Inflight {
            kind,
            ns,
            ranges: b.ranges,
            version: b.version,
        });
        let io = self.ctrls[c].as_mut().expect("connected").ios[q].transport();
        if io.submit(tag as u64, b.sqe, payload).is_err() {
            // The queue is broken: the command never left, so it changed nothing.
            let f = self.inflight[tag].take().expect("just tagged");
            for &(lba, nlb) in &f.ranges {
                self.ns[ns].unhold(lba, nlb);
            }
            self.free_tags.push(tag);
            return false;
        }
        true
    }

    /// A Dataset Management (deallocate) of one to eight free ranges of namespace `ns`.
    fn deallocation(&mut self, ns: usize) -> Option<Built> {
        let mut ranges: Vec<(u64, u32)> = Vec::new();
        for _ in 0..self.rng.u32(1..=8) {
            let Some(r) = self.pick_range(ns, 64, true) else {
                continue;
            };
            let apart = |&(l, k): &(u64, u32)| r.0 + u64::from(r.1) <= l || l + u64::from(k) <= r.0;
            if ranges.iter().all(apart) {
                ranges.push(r);
            }
        }
        if ranges.is_empty() {
            return None;
        }
        let mut s: Sqe = wire::zeroed();
        s.opcode = io_opcode::DATASET_MANAGEMENT;
        s.nsid = U32::new(self.ns[ns].nsid);
        s.cdw10 = U32::new(ranges.len() as u32 - 1);
        s.cdw11 = U32::new(1 << 2);
        let list: Vec<wire::DsmRange> = ranges
            .iter()
            .map(|&(lba, nlb)| wire::DsmRange {
                cattr: U32::ZERO,
                nlb: U32::new(nlb),
                slba: zerocopy::little_endian::U64::new(lba),
            })
            .collect();
        Some(Built {
            sqe: s,
            ranges,
            version: 0,
            data: zerocopy::IntoBytes::as_bytes(list.as_slice()).to_vec(),
            read_len: None,
        })
    }

    /// A read, write (FUA or not) or write zeroes of a free range of namespace `ns`; a write
    /// carries a new version of each of its blocks.
    fn transfer(&mut self, ns: usize, kind: Kind) -> Option<Built> {
        let (nsid, bs) = (self.ns[ns].nsid, self.ns[ns].block_size);
        let max = if kind == Kind::WriteZeroes {
            256
        } else {
            u32::MAX
        };
        let (lba, nlb) = self.pick_range(ns, max, kind != Kind::Read)?;
        let opcode = match kind {
            Kind::Read => io_opcode::READ,
            Kind::WriteZeroes => io_opcode::WRITE_ZEROES,
            _ => io_opcode::WRITE,
        };
        let mut b = Built {
            sqe: rw_sqe(opcode, nsid, lba, nlb, kind == Kind::WriteFua),
            ranges: vec![(lba, nlb)],
            version: 0,
            data: Vec::new(),
            read_len: (kind == Kind::Read).then_some(nlb as usize * bs),
        };
        if matches!(kind, Kind::Write | Kind::WriteFua) {
            b.version = self.next_version;
            self.next_version = self.next_version.wrapping_add(1).max(1);
            b.data.resize(nlb as usize * bs, 0);
            for (k, blk) in b.data.chunks_exact_mut(bs).enumerate() {
                fill_block(blk, nsid, lba + k as u64, b.version);
            }
        }
        Some(b)
    }

    /// What completion `d` tells the model.
    fn complete(&mut self, c: usize, q: usize, d: &Done, report: &mut Report) {
        let tag = usize::try_from(d.tag).unwrap_or(usize::MAX);
        let Some(f) = self.inflight.get_mut(tag).and_then(Option::take) else {
            report
                .mismatches
                .push(format!("a completion for tag {} that is not out", d.tag));
            return;
        };
        self.free_tags.push(tag);
        let ok = d.ok();
        for &(lba, nlb) in &f.ranges {
            self.ns[f.ns].unhold(lba, nlb);
        }
        match &ok {
            Ok(()) => *report.ops.entry(f.kind.name()).or_default() += 1,
            Err(e) => {
                *report.failed.entry(f.kind.name()).or_default() += 1;
                if let Some(st) = e.status() {
                    *report.statuses.entry(format!("{st:?}")).or_default() += 1;
                }
            }
        }
        let acked = ok.is_ok();
        match f.kind {
            Kind::Read if acked => {
                let (lba, nlb) = f.ranges[0];
                let len = nlb as usize * self.ns[f.ns].block_size;
                // The queue that answered holds the data in the slot until its next submission.
                let mut buf = std::mem::take(&mut self.buf);
                if let Some(ctrl) = self.ctrls[c].as_mut() {
                    ctrl.ios[q].transport().data(d.slot, &mut buf[..len]);
                }
                let bad = self.ns[f.ns].check_read(lba, &buf[..len], false);
                self.buf = buf;
                report.mismatches.extend(bad.into_iter().map(|m| m.0));
            }
            Kind::Read | Kind::Flush => {}
            Kind::Write | Kind::WriteFua => {
                let (lba, nlb) = f.ranges[0];
                self.ns[f.ns].wrote(lba, nlb, f.version, acked);
            }
            Kind::WriteZeroes => {
                let (lba, nlb) = f.ranges[0];
                self.ns[f.ns].wrote(lba, nlb, 0, acked);
            }
            Kind::Deallocate => {
                for &(lba, nlb) in &f.ranges {
                    self.ns[f.ns].deallocated(lba, nlb, acked);
                }
            }
        }
    }
}

mod lifecycle;
