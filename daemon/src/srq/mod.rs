//! The elastic SRQ: one shared receive queue per reactor per device, sized to the load.
//!
//! Receives live in chunks, each one registered memory region: a 64-byte command area per
//! receive, then its in-capsule pages (page-aligned). The first chunk holds `initial`
//! receives and stays for the SRQ's life. The SRQ limit is armed at the low watermark; when
//! `IBV_EVENT_SRQ_LIMIT_REACHED` arrives (once per arming) the reactor posts the receives of a
//! spare chunk, registered in advance by the [`Registrar`] thread so that growth never
//! registers memory on the reactor, asks for the next spare and re-arms the limit.
//!
//! When the SRQ has stayed at least one chunk above the watermark for `shrink_delay`, the
//! newest grown chunk starts draining: its receives are not re-posted as they complete, and
//! once none of them is posted the chunk goes back to the registrar to be deregistered. An
//! SRQ cannot withdraw a posted receive, so a draining chunk leaves as traffic consumes it; if
//! the load climbs again first, its receives are posted again instead of a new chunk.

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use nvmfd_rdma::any::{Mr, Pd, Srq};
use nvmfd_rdma::{Access, DeviceAttr, RecvWr, Sge, VerbsError};

use crate::stats::{bump, unbump, DataPathCounters};

mod layout;
mod registrar;
pub use registrar::Registrar;

/// Bytes of one in-capsule page SGE.
pub const PAGE: usize = 4096;
const PAGE_U32: u32 = 4096;
/// Most in-capsule pages per receive (16 KiB, the largest in-capsule size).
pub const MAX_ICD_PAGES: usize = 4;
/// A receive's work request ID: chunk index above this many bits, slot below.
const SLOT_BITS: u32 = 24;
/// How long after a failed registration of a spare chunk the next one is asked for.
const REGISTER_RETRY: Duration = Duration::from_secs(1);
/// Most receives posted in one chain (the ibverbs provider's limit per call).
const CHAIN: usize = 32;
/// Above the chunk index, the SRQ's generation: a receive of an SRQ since rebuilt (held by an
/// in-capsule write, or completing late) is told apart from the new one's. A rebuild takes
/// the next generation no retired SRQ still has (`rebuild`).
const GEN_SHIFT: u32 = 40;
/// Chunk indexes fit between the slot and the generation: at most this many chunks, which
/// the growth step is made large enough for (an index past it would be read back as
/// another chunk of another generation).
const MAX_CHUNKS: u32 = 1 << (GEN_SHIFT - SLOT_BITS);
const GEN_BITS: u32 = 16;
const GEN_MASK: u64 = (1 << GEN_BITS) - 1;
/// Receive work request IDs are below this.
pub const WR_ID_END: u64 = 1 << (GEN_SHIFT + GEN_BITS);

/// Sizes of an elastic SRQ.
#[derive(Clone, Copy, Debug)]
pub struct SrqConfig {
    /// Receives posted at start (the chunk that never leaves).
    pub initial: u32,
    /// Most receives registered at once.
    pub max: u32,
    /// The SRQ limit: fewer posted receives than this and the SRQ grows.
    pub low_watermark: u32,
    /// Receives per grown chunk.
    pub chunk: u32,
    /// How long the SRQ must stay a chunk above the watermark before a chunk goes back.
    pub shrink_delay: Duration,
    /// Keep as many receives as the connected queues can have commands outstanding
    /// ([`ElasticSrq::reserve`]), so that no host meets an empty SRQ.
    pub cover_queues: bool,
}

struct Chunk {
    mr: Mr,
    /// Receives in the chunk.
    slots: u32,
    /// Of them, posted to the SRQ now.
    posted: u32,
    /// Which are posted (sized when the chunk is made, never in the loop).
    is_posted: Vec<bool>,
    /// Receives completing are not re-posted; the chunk leaves when none is posted.
    draining: bool,
}

/// What the SRQ did, for the caller's log.
#[derive(Debug, PartialEq, Eq)]
pub enum Change {
    /// Nothing.
    None,
    /// Grew to this many receives.
    Grew(u32),
    /// Shrank to this many receives.
    Shrank(u32),
    /// At `max`, or its spare chunk could not be registered: the limit event did not grow it.
    CannotGrow,
}

/// Where a completed receive's capsule lies: its 64-byte command, and its in-capsule data with
/// the bytes of it that arrived (none: `None`).
pub type CapsuleAt = (
    std::ptr::NonNull<u8>,
    Option<(std::ptr::NonNull<u8>, usize)>,
);

/// One reactor's SRQ on one device, with its receive chunks.
pub struct ElasticSrq {
    srq: Srq,
    pd: Pd,
    cfg: SrqConfig,
    icd_pages: usize,
    chunks: Vec<Option<Chunk>>,
    /// Receives posted now (by this side's count: posted minus completions seen).
    posted: u32,
    /// Receives registered, draining chunks included.
    registered: u32,
    /// Receives the connected queues can consume at once (their depths), when covering them.
    committed: u32,
    /// Rebuilds so far, modulo 2^16: part of every receive's work request ID.
    generation: u64,
    registrar: Registrar,
    spare_tx: mpsc::Sender<Result<Mr, VerbsError>>,
    spare_rx: mpsc::Receiver<Result<Mr, VerbsError>>,
    spare: Option<Mr>,
    spare_requested: bool,
    /// A limit event came while no spare was ready: grow when one arrives.
    want_grow: bool,
    /// A spare's registration failed: the next is asked for, and the limit armed again (a
    /// limit event then grows if the SRQ still needs it), from this moment on.
    retry_at: Option<Instant>,
    /// An arming of the limit failed: when to try again.
    rearm_at: Option<Instant>,
    /// The last post of pending receives failed: the next failures are the same one (an SRQ
    /// broken until its rebuild), counted once.
    post_failing: bool,
    /// Receives given back since the last `flush` (chunk, slot), posted there in chains.
    pending: Vec<(usize, u32)>,
    /// The scatter lists of one chain, kept for every flush (no zeroing per receive).
    chain_sges: Vec<[Sge; 1 + MAX_ICD_PAGES]>,
    /// The receives of the chain being posted (chunk, slot).
    chain_ids: Vec<(usize, u32)>,
    /// The lowest `posted` since `window_start`.
    window_min: u32,
    /// Receives whose completions were polled (`consumed`) and that are not back yet
    /// (`completed`): commands waiting for admission, in-capsule writes at the disk. Still
    /// counted in `posted`, they are not on the SRQ.
    outstanding: u32,
    window_start: Instant,
    counters: Arc<DataPathCounters>,
}

impl std::fmt::Debug for ElasticSrq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElasticSrq")
            .field("posted", &self.posted)
            .field("registered", &self.registered)
            .finish()
    }
}

fn chunk_len(slots: u32, icd_pages: usize) -> usize {
    let slots = slots as usize;
    (slots * 64).next_multiple_of(PAGE) + slots * icd_pages * PAGE
}

/// The smallest growth step for an SRQ of at most `max` receives: its chunks (the initial
/// one and steps up to `max`) then number at most [`MAX_CHUNKS`].
fn min_chunk(max: u32) -> u32 {
    max.div_ceil(MAX_CHUNKS - 1).max(1)
}

impl ElasticSrq {
    /// Creates the SRQ on `pd` (deep enough for `max`), posts the first chunk, arms the limit
    /// and asks the registrar for a spare.
    ///
    /// A device taking fewer SGEs per SRQ receive than the command and its in-capsule data
    /// need (one, and one per 4 KiB) is refused with what would fit: receives of fewer SGEs
    /// would not hold the in-capsule data Identify promises.
    pub fn new(
        pd: &Pd,
        attr: &DeviceAttr,
        cfg: SrqConfig,
        in_capsule: u32,
        registrar: Registrar,
        counters: Arc<DataPathCounters>,
        now: Instant,
    ) -> std::io::Result<ElasticSrq> {
        let icd_pages = (in_capsule as usize).div_ceil(PAGE).min(MAX_ICD_PAGES);
        let sges = 1 + u32::try_from(icd_pages).unwrap_or(u32::MAX - 1);
        if attr.max_srq_sge < sges {
            let fits = attr.max_srq_sge.saturating_sub(1) * PAGE_U32 / 1024;
            return Err(std::io::Error::other(format!(
                "the device takes {} SGEs per SRQ receive; an in-capsule data size of {in_capsule} bytes needs {sges} (one for the command, one per 4 KiB): set transport.in_capsule_data_size to at most {fits} KiB",
                attr.max_srq_sge
            )));
        }
        let max = cfg.max.min(attr.max_srq_wr).max(1);
        let cfg = SrqConfig {
            max,
            initial: cfg.initial.clamp(1, max),
            chunk: cfg.chunk.clamp(min_chunk(max), max),
            ..cfg
        };
        ElasticSrq::build(pd, cfg, icd_pages, registrar, counters, now, 0)
            .map_err(|e| std::io::Error::other(e.to_string()))
    }

    fn build(
        pd: &Pd,
        cfg: SrqConfig,
        icd_pages: usize,
        registrar: Registrar,
        counters: Arc<DataPathCounters>,
        now: Instant,
        generation: u64,
    ) -> Result<ElasticSrq, VerbsError> {
        let max = cfg.max;
        let srq = pd.create_srq(
            max,
            1 + MAX_ICD_PAGES.min(icd_pages).try_into().unwrap_or(4u32),
        )?;
        let mr = pd.alloc_mr(chunk_len(cfg.initial, icd_pages), Access::LOCAL_WRITE)?;
        let (spare_tx, spare_rx) = mpsc::channel();
        let mut s = ElasticSrq {
            srq,
            pd: pd.clone(),
            cfg,
            icd_pages,
            chunks: Vec::with_capacity((max / cfg.chunk) as usize + 2),
            posted: 0,
            registered: 0,
            committed: 0,
            registrar,
            spare_tx,
            spare_rx,
            spare: None,
            spare_requested: false,
            retry_at: None,
            rearm_at: None,
            post_failing: false,
            want_grow: false,
            pending: Vec::with_capacity(CHAIN),
            chain_sges: vec![[Sge::default(); 1 + MAX_ICD_PAGES]; CHAIN],
            chain_ids: Vec::with_capacity(CHAIN),
            window_min: 0,
            outstanding: 0,
            window_start: now,
            counters,
            generation,
        };
        s.add_chunk(mr, cfg.initial)?;
        s.window_min = s.level();
        s.arm(now);
        s.request_spare();
        Ok(s)
    }

    /// The SRQ, for QPs to take receives from.
    pub fn srq(&self) -> &Srq {
        &self.srq
    }

    /// Whether `id` names this SRQ (in an async event).
    pub fn is(&self, id: u32) -> bool {
        self.srq.id() == id
    }

    /// Receives posted now.
    pub fn posted(&self) -> u32 {
        self.posted
    }

    /// Receives registered now.
    pub fn registered(&self) -> u32 {
        self.registered
    }

    /// Receives reserved for the connected queues (`reserve` less `unreserve`; 0 unless
    /// covering the queues).
    pub fn reserved(&self) -> u32 {
        self.committed
    }

    /// True while the reactor must keep polling: a growth waits for its spare chunk.
    pub fn busy(&self) -> bool {
        self.want_grow
    }

    /// Arms the limit; one the device refuses is tried again after `REGISTER_RETRY` (`tick`):
    /// until armed, the SRQ keeps its receives but hears of no low level, so it does not
    /// grow.
    fn arm(&mut self, now: Instant) {
        if self.srq.arm_limit(self.cfg.low_watermark.max(1)).is_err() {
            // Counted once for a run of refusals (a device that keeps refusing is tried every
            // second).
            if self.rearm_at.is_none() {
                self.counters.srq_errors.fetch_add(1, Ordering::Relaxed);
            }
            self.rearm_at = Some(now + REGISTER_RETRY);
        } else {
            self.rearm_at = None;
        }
    }

    fn request_spare(&mut self) {
        if self.spare.is_none()
            && !self.spare_requested
            && self.retry_at.is_none()
            && self.registered < self.cfg.max
        {
            self.registrar.register(
                &self.pd,
                chunk_len(self.cfg.chunk, self.icd_pages),
                &self.spare_tx,
            );
            self.spare_requested = true;
        }
    }

    fn add_chunk(&mut self, mr: Mr, slots: u32) -> Result<(), VerbsError> {
        let idx = match self.chunks.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.chunks.push(None);
                self.chunks.len() - 1
            }
        };
        // The initial chunk and growth steps of `min_chunk` or more within `max` stay below.
        debug_assert!(idx < MAX_CHUNKS as usize, "chunk index {idx}");
        self.chunks[idx] = Some(Chunk {
            mr,
            slots,
            posted: 0,
            is_posted: vec![false; slots as usize],
            draining: false,
        });
        self.registered += slots;
        self.pending.extend((0..slots).map(|slot| (idx, slot)));
        self.post_pending()?;
        self.counters
            .srq_receives_registered
            .store(u64::from(self.registered), Ordering::Relaxed);
        Ok(())
    }

    /// Posts the receives given back since the last call (each once, in chains of up to
    /// [`CHAIN`]: one provider call per chain, not per receive), skipping those posted
    /// meanwhile and those of a chunk that left. Once per loop turn, from `tick`. The first
    /// error is returned after every chain was tried; a receive that could not be posted is
    /// tried again at the next call.
    pub fn flush(&mut self) {
        match self.post_pending() {
            Ok(()) => self.post_failing = false,
            // Counted once until a post succeeds: a broken SRQ fails every flush (two a
            // turn) until it is rebuilt.
            Err(_) if !self.post_failing => {
                self.post_failing = true;
                self.counters.srq_errors.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {}
        }
    }

    fn post_pending(&mut self) -> Result<(), VerbsError> {
        let mut first_err = None;
        let mut at = 0;
        while at < self.pending.len() {
            let end = (at + CHAIN).min(self.pending.len());
            self.chain_ids.clear();
            for &(idx, slot) in &self.pending[at..end] {
                let Some(c) = self.chunks.get_mut(idx).and_then(Option::as_mut) else {
                    continue;
                };
                let s = slot as usize;
                // Draining chunks are not re-posted (`tick` flushes before it drains one).
                if c.draining || c.is_posted.get(s).copied().unwrap_or(true) {
                    continue;
                }
                // Claimed for this chain now, so that a second entry of the receive in the
                // list (one kept after a refused post, then a chunk's undrain) is not posted
                // twice; given back below if the post refuses it.
                c.is_posted[s] = true;
                let n = self.chain_ids.len();
                let sges = &mut self.chain_sges[n];
                sges[0] = c.mr.sge(s * 64, 64);
                let data =
                    (c.slots as usize * 64).next_multiple_of(PAGE) + s * self.icd_pages * PAGE;
                for p in 0..self.icd_pages {
                    sges[1 + p] = c.mr.sge(data + p * PAGE, PAGE_U32);
                }
                self.chain_ids.push((idx, slot));
            }
            at = end;
            let n = self.chain_ids.len();
            if n == 0 {
                continue;
            }
            let gen = self.generation << GEN_SHIFT;
            // Only the chain's own entries are built (most turns re-post one or two).
            let mut wrs = [RecvWr {
                wr_id: 0,
                sges: &[],
            }; CHAIN];
            for (w, (&(idx, slot), sges)) in wrs
                .iter_mut()
                .zip(self.chain_ids.iter().zip(&self.chain_sges))
            {
                *w = RecvWr {
                    wr_id: gen | ((idx as u64) << SLOT_BITS) | u64::from(slot),
                    sges: &sges[..1 + self.icd_pages],
                };
            }
            let posted = match self.srq.post_recv(&wrs[..n]) {
                Ok(()) => n,
                Err(e) => {
                    let k = e.posted().min(n);
                    first_err.get_or_insert(e);
                    k
                }
            };
            for (k, &(idx, slot)) in self.chain_ids.iter().enumerate() {
                if let Some(c) = self.chunks[idx].as_mut() {
                    if k < posted {
                        c.posted += 1;
                    } else {
                        c.is_posted[slot as usize] = false;
                    }
                }
            }
            self.posted += u32::try_from(posted).unwrap_or(u32::MAX); // at most CHAIN
            bump(&self.counters.receives_posted, posted as u64);
        }
        if first_err.is_some() {
            // Those a post refused stay for the next turn (as do the chains tried after it
            // that did go in: now posted, they leave); a receive left out would be counted
            // registered and never be there for a command.
            let chunks = &self.chunks;
            self.pending.retain(|&(idx, slot)| {
                chunks
                    .get(idx)
                    .and_then(Option::as_ref)
                    .is_some_and(|c| !c.draining && c.is_posted.get(slot as usize) == Some(&false))
            });
        } else {
            self.pending.clear();
        }
        first_err.map_or(Ok(()), Err)
    }

    /// A new SRQ with the same sizes (the next generation none of `retired` has), after this
    /// one broke (`SRQ_ERR`): created, its first chunk posted and its limit armed, as at
    /// start. Every QP on this one must be destroyed first. This one's receives leave the
    /// counters. `retired` are the generations of replaced SRQs whose receives are still held
    /// (fewer than the generations there are: each holds registered memory).
    pub fn rebuild(&self, now: Instant, retired: &[u64]) -> Result<ElasticSrq, VerbsError> {
        let mut generation = self.generation;
        loop {
            generation = (generation + 1) & GEN_MASK;
            if !retired.contains(&generation) || generation == self.generation {
                break;
            }
        }
        let next = ElasticSrq::build(
            &self.pd,
            self.cfg,
            self.icd_pages,
            self.registrar.clone(),
            Arc::clone(&self.counters),
            now,
            generation,
        )?;
        self.counters
            .receives_posted
            .fetch_sub(u64::from(self.posted), Ordering::Relaxed);
        Ok(next)
    }

    /// Receives on the SRQ now: posted, less those consumed and not back yet.
    fn level(&self) -> u32 {
        self.posted.saturating_sub(self.outstanding)
    }

    /// A poll found `n` receive completions: before any is re-posted, that many fewer
    /// receives were posted, which is the low point the shrink decision and the empty count
    /// look at.
    pub fn consumed(&mut self, n: u32) {
        let low = self.level().saturating_sub(n);
        self.outstanding = self.outstanding.saturating_add(n);
        if low == 0 && n > 0 {
            // Hosts met an empty SRQ and RNR-retried.
            self.counters.srq_empty.fetch_add(1, Ordering::Relaxed);
        }
        self.window_min = self.window_min.min(low);
    }

    /// Receive `wr_id` completed (or was flushed): re-posts it, unless its chunk is draining,
    /// in which case the chunk leaves once none of its receives is posted.
    pub fn completed(&mut self, wr_id: u64, now: Instant) -> Change {
        self.outstanding = self.outstanding.saturating_sub(1);
        let (idx, slot) = self.split(wr_id);
        let Some(c) = self.chunks.get_mut(idx).and_then(Option::as_mut) else {
            return Change::None;
        };
        if !c.is_posted.get(slot as usize).copied().unwrap_or(false) {
            return Change::None;
        }
        c.is_posted[slot as usize] = false;
        c.posted -= 1;
        self.posted -= 1;
        unbump(&self.counters.receives_posted, 1);
        let draining = c.draining;
        let gone = draining && c.posted == 0;
        if !draining {
            // Posted with the others of this turn, in one chain (`flush`).
            self.pending.push((idx, slot));
            return Change::None;
        }
        if gone {
            if let Some(c) = self.chunks[idx].take() {
                self.registered -= c.slots;
                self.registrar.release(c.mr);
            }
            self.counters.srq_shrinks.fetch_add(1, Ordering::Relaxed);
            self.counters
                .srq_receives_registered
                .store(u64::from(self.registered), Ordering::Relaxed);
            self.window_start = now;
            self.window_min = self.level();
            self.request_spare();
            return Change::Shrank(self.registered);
        }
        Change::None
    }

    /// A queue of `depth` entries is about to be connected: with `cover_queues`, the SRQ grows
    /// now (before the connection is accepted) until its receives cover every connected
    /// queue's depth, up to `max`. This registers memory on the calling thread when no spare
    /// chunk is ready: a connection-time cost, like creating the QP. On rxe an RNR NAK stalls
    /// the host's queue pair, and on any device an empty SRQ costs the host an RNR timer.
    pub fn reserve(&mut self, depth: u32, now: Instant) -> Result<Change, VerbsError> {
        if !self.cfg.cover_queues {
            return Ok(Change::None);
        }
        self.committed = self.committed.saturating_add(depth);
        let need = self.committed.min(self.cfg.max);
        let before = self.registered;
        // Draining chunks first: their memory is still registered.
        while self.registered_live() < need {
            let Some(idx) = self
                .chunks
                .iter()
                .rposition(|c| c.as_ref().is_some_and(|c| c.draining))
            else {
                break;
            };
            self.undrain(idx)?;
        }
        while self.registered < need {
            let slots = self.cfg.chunk.min(self.cfg.max - self.registered);
            let mr = match self.spare.take() {
                Some(mr) if slots == self.cfg.chunk => mr,
                spare => {
                    self.spare = spare;
                    self.pd
                        .alloc_mr(chunk_len(slots, self.icd_pages), Access::LOCAL_WRITE)?
                }
            };
            self.add_chunk(mr, slots)?;
            self.counters.srq_grows.fetch_add(1, Ordering::Relaxed);
        }
        self.request_spare();
        if self.registered == before {
            return Ok(Change::None);
        }
        self.window_start = now;
        self.window_min = self.level();
        Ok(Change::Grew(self.registered))
    }

    /// Whether the connected queues' depths add up to more than `max`: the SRQ covers them
    /// only up to `max`, so commands a stalled backend keeps waiting can hold every receive.
    pub fn coverage_capped(&self) -> bool {
        self.cfg.cover_queues && self.committed > self.cfg.max
    }

    /// A queue of `depth` entries (given to `reserve`) is gone.
    pub fn unreserve(&mut self, depth: u32) {
        if self.cfg.cover_queues {
            self.committed = self.committed.saturating_sub(depth);
        }
    }

    /// Receives registered in chunks that are not draining.
    fn registered_live(&self) -> u32 {
        self.chunks
            .iter()
            .flatten()
            .filter(|c| !c.draining)
            .map(|c| c.slots)
            .sum()
    }

    /// Posts again the receives of draining chunk `idx`.
    fn undrain(&mut self, idx: usize) -> Result<(), VerbsError> {
        let slots = match self.chunks[idx].as_mut() {
            Some(c) => {
                c.draining = false;
                c.slots
            }
            None => 0,
        };
        // Those still posted are skipped.
        self.pending.extend((0..slots).map(|slot| (idx, slot)));
        self.post_pending()
    }

    /// `IBV_EVENT_SRQ_LIMIT_REACHED` for this SRQ.
    pub fn limit_reached(&mut self, now: Instant) -> Change {
        self.counters
            .srq_limit_events
            .fetch_add(1, Ordering::Relaxed);
        self.want_grow = true;
        self.grow(now)
    }

    fn grow(&mut self, now: Instant) -> Change {
        // A draining chunk is cheaper than a new one: post its receives again.
        let draining = self
            .chunks
            .iter()
            .rposition(|c| c.as_ref().is_some_and(|c| c.draining));
        if let Some(idx) = draining {
            if self.undrain(idx).is_err() {
                self.counters.srq_errors.fetch_add(1, Ordering::Relaxed);
            }
            return self.grown(now);
        }
        // The last step may be smaller than a chunk: up to `max` exactly (a step that did not
        // fit whole was refused, and the SRQ stayed below `max` for good).
        let room = self.cfg.max.saturating_sub(self.registered);
        if room == 0 {
            self.want_grow = false;
            self.counters.srq_at_max.fetch_add(1, Ordering::Relaxed);
            // Not re-armed: at the maximum, each arming would fire again at once. The next
            // shrink re-arms.
            return Change::CannotGrow;
        }
        let mr = match self.spare.take() {
            Some(mr) => mr,
            None => match self.spare_rx.try_recv() {
                Ok(Ok(mr)) => {
                    self.spare_requested = false;
                    mr
                }
                Ok(Err(_)) => {
                    self.registration_failed(now);
                    return Change::CannotGrow;
                }
                // `tick` grows when it arrives (asked for now if it was not); the reactor
                // keeps polling meanwhile. While a failed registration waits to be tried
                // again, the SRQ cannot grow.
                Err(_) => {
                    if self.retry_at.is_some() {
                        self.want_grow = false;
                        return Change::CannotGrow;
                    }
                    self.request_spare();
                    return Change::None;
                }
            },
        };
        // (A spare is registered whole; a last, smaller step uses the start of it.)
        if self.add_chunk(mr, self.cfg.chunk.min(room)).is_err() {
            self.counters.srq_errors.fetch_add(1, Ordering::Relaxed);
        }
        self.request_spare();
        self.grown(now)
    }

    /// A spare's registration failed: nothing is asked for, and the SRQ does not wait to grow,
    /// until `REGISTER_RETRY` has passed (`tick` then arms the limit again).
    fn registration_failed(&mut self, now: Instant) {
        self.spare_requested = false;
        self.want_grow = false;
        self.retry_at = Some(now + REGISTER_RETRY);
        self.counters.srq_errors.fetch_add(1, Ordering::Relaxed);
    }

    fn grown(&mut self, now: Instant) -> Change {
        self.want_grow = false;
        self.counters.srq_grows.fetch_add(1, Ordering::Relaxed);
        self.arm(now);
        self.window_start = now;
        self.window_min = self.level();
        Change::Grew(self.registered)
    }

    /// Once per loop turn: takes a spare that arrived, grows if a limit event waits for one,
    /// and starts draining a chunk when the load has stayed low for `shrink_delay`.
    pub fn tick(&mut self, now: Instant) -> Change {
        self.flush();
        if self.spare.is_none() && self.spare_requested {
            match self.spare_rx.try_recv() {
                Ok(Ok(mr)) => {
                    self.spare = Some(mr);
                    self.spare_requested = false;
                }
                Ok(Err(_)) => self.registration_failed(now),
                Err(_) => {}
            }
        }
        if self.retry_at.is_some_and(|t| now >= t) {
            // Tried again: the next spare is asked for, and a limit event comes at once if
            // the SRQ is still below its watermark.
            self.retry_at = None;
            self.request_spare();
            self.arm(now);
        }
        if self.rearm_at.is_some_and(|t| now >= t) {
            self.arm(now);
        }
        if self.want_grow && self.spare.is_some() {
            return self.grow(now);
        }
        if now.duration_since(self.window_start) < self.cfg.shrink_delay {
            return Change::None;
        }
        // Newest grown chunk not yet draining, if the SRQ could have done without it.
        let victim = self
            .chunks
            .iter()
            .enumerate()
            .skip(1)
            .rev()
            .find(|(_, c)| c.as_ref().is_some_and(|c| !c.draining))
            .map(|(i, c)| (i, c.as_ref().map_or(0, |c| c.slots)));
        if let Some((idx, slots)) = victim {
            // Never below what the connected queues can consume at once.
            let floor = self.committed.min(self.cfg.max);
            if self.window_min >= slots + self.cfg.low_watermark
                && self.registered_live().saturating_sub(slots) >= floor
            {
                if let Some(c) = self.chunks[idx].as_mut() {
                    c.draining = true;
                }
                // At the maximum the limit was left disarmed; there is room again.
                self.arm(now);
            }
        }
        self.window_start = now;
        self.window_min = self.level();
        Change::None
    }
}

#[cfg(test)]
mod tests;
