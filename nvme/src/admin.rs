//! Admin commands and controller properties.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use zerocopy::little_endian::{U128, U16, U32, U64};
use zerocopy::IntoBytes;

use crate::queue::{refresh_ready, Action, Command, DataRef, IoOp, IoRequest, Queue};
use crate::target::{Controller, NVME_VERSION};
use crate::wire::{self, admin_opcode as op, feature, log_page, property, status, Status};

mod features;
pub(crate) use features::data_arrived;
use features::{get_features, set_features};

/// Largest number of Asynchronous Event Requests held at once (AERL is this minus one).
pub const AER_LIMIT: usize = 4;

pub(crate) fn handle(
    q: &mut Queue,
    ctrl: &Controller,
    cmd: Command,
    icd: &[u8],
    now: Instant,
) -> Action {
    let sqe = cmd.sqe;
    if matches!(
        sqe.opcode,
        op::KEEP_ALIVE | op::ASYNC_EVENT_REQUEST | op::ABORT
    ) {
        if let Err(st) = q.no_data(&sqe) {
            return q.respond(&cmd, st, 0);
        }
    }
    match sqe.opcode {
        op::KEEP_ALIVE => {
            let mut st = ctrl.lock();
            // With no keep-alive timer (KATO 0) there is nothing to keep alive: the kernel
            // target answers the same.
            if st.kato.is_zero() {
                drop(st);
                return q.respond(&cmd, status::KEEP_ALIVE_TIMEOUT_INVALID, 0);
            }
            st.last_keep_alive = now;
            drop(st);
            q.respond(&cmd, Status::SUCCESS, 0)
        }
        op::IDENTIFY => identify(q, ctrl, cmd, icd),
        op::GET_LOG_PAGE => get_log_page(q, ctrl, cmd, icd),
        op::SET_FEATURES => set_features(q, ctrl, cmd, icd, now),
        op::GET_FEATURES => get_features(q, ctrl, cmd, icd),
        op::ASYNC_EVENT_REQUEST => {
            let mut st = ctrl.lock();
            if st.held_aers.len() >= AER_LIMIT {
                return q.respond(&cmd, status::AER_LIMIT_EXCEEDED, 0);
            }
            st.held_aers.push(cmd.cid());
            Action::Hold
        }
        // Abort: "the command was not aborted" (dw0 bit 0 set) is always a valid answer.
        op::ABORT => q.respond(&cmd, Status::SUCCESS, 1),
        _ => q.respond(&cmd, status::INVALID_OPCODE, 0),
    }
}

/// Controller capabilities.
pub(crate) fn cap(q: &Queue) -> u64 {
    let mqes = u64::from(q.target().limits().max_queue_depth.saturating_sub(1));
    let cqr = 1 << 16;
    let to = 15u64 << 24; // ready within 7.5 s (500 ms units); nvmfd is ready at once
    let css_nvm = 1u64 << 37;
    mqes | cqr | to | css_nvm // MPSMIN = MPSMAX = 0: 4 KiB pages
}

pub(crate) fn property(
    q: &mut Queue,
    ctrl: &Controller,
    cmd: Command,
    set: bool,
    _now: Instant,
) -> Action {
    // Property Get and Set share the place of the attributes and the offset; Set's value
    // follows them.
    let Some(prop) = wire::read::<wire::PropertySetCmd>(cmd.sqe.as_bytes()) else {
        return q.respond(&cmd, status::INVALID_FIELD, 0);
    };
    let attrib = prop.attrib & 0x7;
    let offset = prop.offset.get();
    let size8 = match attrib {
        0 => false,
        1 => true,
        _ => return q.respond(&cmd, status::INVALID_FIELD, 0),
    };
    if !set {
        let value: u64 = match (offset, size8) {
            (property::CAP, true) => cap(q),
            (property::VS, false) => u64::from(NVME_VERSION),
            (property::CC, false) => u64::from(ctrl.lock().cc),
            (property::CSTS, false) => {
                let mut st = ctrl.lock();
                let alive = ctrl.io_queues_alive.load(Ordering::Acquire);
                if st.shutdown_pending && alive == 0 {
                    // The last I/O queue is gone: the shutdown's flush runs now, and this
                    // read answers once it has (SHST complete).
                    st.shutdown_pending = false;
                    drop(st);
                    return flush_all(q, ctrl, cmd);
                }
                if st.resetting && alive == 0 {
                    st.resetting = false;
                }
                if st.shutdown_awaits_releases {
                    shutdown_flushed(q, ctrl, &mut st);
                }
                // A reset is not over while a queue of before it may still write.
                let rdy = u32::from(st.resetting);
                u64::from(st.csts | rdy)
            }
            _ => return q.respond(&cmd, status::INVALID_FIELD, 0),
        };
        let mut c = crate::queue::cqe(&cmd, q.qid_or_zero(), Status::SUCCESS, wire::lo32(value));
        c.dw1 = U32::new(wire::hi32(value));
        return Action::Respond { cqe: c, data: None };
    }
    if offset != property::CC || size8 {
        return q.respond(&cmd, status::INVALID_FIELD, 0);
    }
    let value = wire::lo32(prop.value.get());
    let mut st = ctrl.lock();
    let was_enabled = st.cc & 1 == 1;
    let enable = value & 1 == 1;
    let shn = (value >> 14) & 0x3;
    st.cc = value;
    if enable && !was_enabled && st.resetting {
        // Enabled again before the reset ended (RDY still reads 1: I/O queues of before it
        // may still write): the host broke the reset's handshake. Its new queues could take
        // the IDs of old ones still writing; the controller fails (CFS) instead, and the
        // host's next reset waits for them as it should.
        if ctrl.io_queues_alive.load(Ordering::Acquire) == 0 {
            st.resetting = false;
        } else {
            st.csts = 1 << 1;
            refresh_ready(ctrl, &st);
            return q.respond(&cmd, Status::SUCCESS, 0);
        }
    }
    if enable && !was_enabled {
        // IOSQES 64 bytes, IOCQES 16 bytes, 4 KiB pages, NVM command set.
        let iosqes = (value >> 16) & 0xF;
        let iocqes = (value >> 20) & 0xF;
        let mps = (value >> 7) & 0xF;
        let css = (value >> 4) & 0x7;
        // Round robin only (CAP.AMS offers nothing else).
        let ams = (value >> 11) & 0x7;
        let discovery = ctrl.subsystem.is_none();
        let ok = mps == 0 && css == 0 && ams == 0 && (discovery || (iosqes == 6 && iocqes == 4));
        // RDY, or CFS.
        st.csts = if ok { 1 } else { 1 << 1 };
        // A new epoch: a shutdown asked while disabled, its flush still running, must not
        // report SHST (or CFS) on the controller enabled now when it ends. No I/O queue is
        // bound (none connects while disabled, and a reset's are gone before an enable), so
        // no reactor has anything to look at: the epoch moves without waking them.
        ctrl.epoch.fetch_add(1, Ordering::AcqRel);
    } else if !enable && was_enabled {
        // Reset: the I/O queues must go (they see the new epoch and disconnect); the admin
        // queue stays, with the controller disabled and its negotiated state cleared.
        st.csts = 0;
        // (The queues allocated stay: they do not change between resets.)
        st.io_queues.clear();
        st.io_queues_lost.clear();
        // A shutdown waiting for the old I/O queues is over: its flush would otherwise run
        // once they are gone and report SHST complete on the controller enabled again.
        st.shutdown_pending = false;
        st.shutdown_awaits_releases = false;
        // Held AERs end with the reset, without a completion: the base specification has
        // AERs outstanding at a reset aborted, so the host takes their command IDs as free
        // (and reuses them). Completed at a later event, one would answer whatever command
        // of the host has its ID by then, and the host's new AERs were refused (the limit
        // still counted the old). The transport counts them answered
        // (`Queue::take_ended_aers`): they no longer hold its queue's flow control.
        q.aers_ended += u32::try_from(st.held_aers.len()).unwrap_or(u32::MAX);
        st.held_aers.clear();
        st.resetting = true;
        // The epoch first: a command of an I/O queue on another reactor between the two
        // then finds its queue ended (and disconnects), not a controller merely not ready
        // (Command Sequence Error, Do Not Retry).
        ctrl.new_epoch();
        refresh_ready(ctrl, &st);
        // Disabled and shut down in one write: the shutdown follows the reset (as the
        // kernel target handles both), rather than being dropped.
        if shn == 0 {
            return q.respond(&cmd, Status::SUCCESS, 0);
        }
    }
    refresh_ready(ctrl, &st);
    if shn != 0 && (st.csts >> 2) & 0x3 == 0 {
        // Shutdown: once no I/O queue of the controller is left (each is dropped only when
        // its connection is torn down and its block operations have completed), make every
        // namespace durable, then report SHST complete (in io_done). With queues left, SHST
        // reads "processing" and the first CSTS read after the last is gone runs the flush.
        st.csts = (st.csts & !0xC) | (1 << 2);
        // Its I/O queues end now, as on a reset (the host should have deleted them first),
        // and so does one whose Connect took its queue ID and has not bound yet (it is in
        // no count): it finds the new epoch and disconnects. Until a reset, no I/O queue
        // connects (`connect.rs`).
        st.io_queues.clear();
        st.io_queues_lost.clear();
        ctrl.new_epoch();
        if ctrl.io_queues_alive.load(Ordering::Acquire) > 0 {
            st.shutdown_pending = true;
            return q.respond(&cmd, Status::SUCCESS, 0);
        }
        drop(st);
        return flush_all(q, ctrl, cmd);
    }
    q.respond(&cmd, Status::SUCCESS, 0)
}

/// The shutdown's flush of the namespaces served succeeded: SHST reads complete once every
/// device of the subsystem let go of (a namespace removed or reopened, which the flush no
/// longer reaches) is synced too; until then it reads "processing", and each CSTS read looks
/// again. A device let go of since the controller was made whose sync failed fails the
/// shutdown (CFS): writes its host completed there may be lost. Devices let go of before it
/// was made are none of its business.
pub(crate) fn shutdown_flushed(q: &Queue, ctrl: &Controller, st: &mut crate::target::CtrlState) {
    let (failed, in_flight) = ctrl.subsystem.map_or((false, false), |s| {
        q.target().releases_since(s, ctrl.releases_at_start)
    });
    st.shutdown_awaits_releases = false;
    if failed {
        st.csts |= 1 << 1;
    } else if in_flight {
        st.shutdown_awaits_releases = true;
    } else {
        st.csts = (st.csts & !0xC) | (2 << 2);
    }
}

/// A flush of every namespace of the queue's subsystem, answering `cmd` when done.
fn flush_all(q: &Queue, ctrl: &Controller, cmd: Command) -> Action {
    let nsids: Vec<u32> = q
        .subsystem()
        .map(|s| s.namespaces.iter().map(|n| n.nsid).collect())
        .unwrap_or_default();
    if nsids.is_empty() {
        // Nothing to make durable (a discovery controller, a subsystem without namespaces):
        // the shutdown is complete now, answered as `Queue::io_done` answers a flush.
        let csts = {
            let mut st = ctrl.lock();
            shutdown_flushed(q, ctrl, &mut st);
            st.csts
        };
        return q.respond(&cmd, Status::SUCCESS, csts);
    }
    let epoch = ctrl.epoch.load(Ordering::Acquire);
    ctrl.lock().shutdown_flushing = Some((Instant::now(), epoch));
    Action::Io(IoRequest {
        cmd,
        nsid: 0,
        op: IoOp::FlushAll { nsids, epoch },
        data: None,
    })
}

/// Responds with `data` pushed to the host buffer that the command's SGL describes. A
/// buffer of another length than `data` is refused with Data SGL Length Invalid, as the
/// kernel target refuses a transfer length other than the structure's
/// (`nvmet_check_transfer_len`): a host must not take a truncated structure for the whole,
/// and without SGLS bit 18 an SGL describes exactly the data.
fn respond_data(q: &Queue, cmd: &Command, data: Vec<u8>, icd: &[u8]) -> Action {
    let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
    match q.data_ref(&cmd.sqe, len, false, icd) {
        Ok(dest @ (DataRef::Keyed { .. } | DataRef::KeyedList { .. })) => Action::Respond {
            cqe: crate::queue::cqe(cmd, q.qid_or_zero(), Status::SUCCESS, 0),
            data: Some((data, dest)),
        },
        Ok(_) => q.respond(cmd, status::INVALID_FIELD, 0),
        Err(st) => q.respond(cmd, st, 0),
    }
}

fn identify(q: &mut Queue, ctrl: &Controller, cmd: Command, icd: &[u8]) -> Action {
    let cns = cmd.sqe.cdw10.get() & 0xFF;
    let nsid = cmd.sqe.nsid.get();
    let mut data = q.take_bytes(0);
    match cns {
        0x01 => data.extend_from_slice(identify_controller(q, ctrl).as_bytes()),
        0x06 => {
            // Only an I/O controller has an I/O command set, and nvmfd's is the NVM one.
            let csi = cmd.sqe.cdw11.get() >> 24; // CDW11 bits 31:24
            let Some(s) = q.subsystem().filter(|_| csi == u32::from(wire::csi::NVM)) else {
                return q.respond(&cmd, status::INVALID_FIELD, 0);
            };
            data.extend_from_slice(identify_controller_nvm(s).as_bytes());
        }
        0x00 | 0x02 | 0x03 if ctrl.subsystem.is_none() => {
            return q.respond(&cmd, status::INVALID_FIELD, 0)
        }
        0x00 => match q.subsystem().and_then(|s| s.namespace(nsid)) {
            Some(ns) => data.extend_from_slice(
                identify_namespace(ns, q.target().limits().max_io_size).as_bytes(),
            ),
            // An inactive NSID within NN: a zeroed structure, as the specification says.
            None if nsid != 0 && nsid <= max_nsid(q) => {
                data.extend_from_slice(wire::zeroed::<wire::IdentifyNamespace>().as_bytes());
            }
            None => return q.respond(&cmd, status::INVALID_NAMESPACE, 0),
        },
        0x02 => {
            if nsid >= 0xFFFF_FFFE {
                return q.respond(&cmd, status::INVALID_NAMESPACE, 0);
            }
            let mut list = [U32::ZERO; 1024];
            let ids = q
                .subsystem()
                .into_iter()
                .flat_map(|s| s.namespaces.iter().map(|n| n.nsid))
                .filter(|&i| i > nsid);
            for (slot, id) in list.iter_mut().zip(ids) {
                *slot = U32::new(id);
            }
            data.clear();
            data.extend_from_slice(list.as_bytes());
        }
        0x03 => {
            let Some(ns) = q.subsystem().and_then(|s| s.namespace(nsid)) else {
                return q.respond(&cmd, status::INVALID_NAMESPACE, 0);
            };
            ns_descriptors(ns, &mut data);
        }
        _ => return q.respond(&cmd, status::INVALID_FIELD, 0),
    };
    respond_data(q, &cmd, data, icd)
}

/// The largest valid NSID of the queue's subsystem (NN).
fn max_nsid(q: &Queue) -> u32 {
    let highest = q
        .subsystem()
        .and_then(|s| s.namespaces.iter().map(|n| n.nsid).max())
        .unwrap_or(0);
    q.target().limits().max_nsid.max(highest)
}

fn ns_descriptors(ns: &crate::target::Namespace, out: &mut Vec<u8>) {
    out.clear();
    out.resize(4096, 0);
    let mut at = 0;
    let mut put = |nidt: u8, id: &[u8]| {
        let h = wire::NsIdDescHeader {
            nidt,
            nidl: wire::sat(id.len()),
            rsvd: [0; 2],
        };
        out[at..at + 4].copy_from_slice(h.as_bytes());
        out[at + 4..at + 4 + id.len()].copy_from_slice(id);
        at += 4 + id.len();
    };
    if let Some(g) = ns.nguid {
        put(wire::nidt::NGUID, &g);
    }
    if let Some(u) = ns.uuid {
        put(wire::nidt::UUID, &u);
    }
    put(wire::nidt::CSI, &[0]); // NVM command set
}

/// Identify Controller for this queue's controller.
pub(crate) fn identify_controller(q: &Queue, ctrl: &Controller) -> wire::IdentifyController {
    let limits = q.target().limits();
    let mut id: wire::IdentifyController = wire::zeroed();
    let firmware = crate::target::FIRMWARE_REVISION;
    match q.subsystem() {
        Some(s) => {
            wire::put_str(&mut id.sn, &s.serial, b' ');
            wire::put_str(&mut id.mn, &s.model, b' ');
            wire::put_str(&mut id.subnqn, &s.nqn, 0);
            id.cntrltype = 1;
            let all = |f: fn(&crate::NamespaceInfo) -> bool| {
                !s.namespaces.is_empty() && s.namespaces.iter().all(|n| f(&n.info))
            };
            let mut oncs = 0u16;
            if crate::io::DsmLimits::of(s).is_some() {
                oncs |= 1 << 2; // Dataset Management, with its limits in CNS 06h
            }
            if all(|i| i.write_zeroes) {
                oncs |= 1 << 3; // Write Zeroes
            }
            id.oncs = U16::new(oncs);
            // Present for every subsystem, whatever its namespaces now: a host reads it once
            // per association, and a namespace that caches writes (a file) may be added
            // while it is connected, after a subsystem of RAM alone said none; the host would
            // then never flush it. A Flush of a namespace without a cache costs nothing. Flush
            // Behavior 10b: a Flush to every namespace (NSID FFFFFFFFh) is not supported (it
            // answers Invalid Namespace), so a host flushes each namespace.
            id.vwc = 1 | (0b10 << 1);
            // Every NSID up to the limit is valid (the inactive ones have a zeroed Identify
            // Namespace), so that a namespace added later has a valid NSID.
            id.nn = U32::new(max_nsid(q));
            id.mnan = id.nn;
            // Namespace Attribute Notices.
            id.oaes = U32::new(1 << 8);
            // A host that enables Advanced Command Retry waits this long before retrying a
            // retryable status (CRD 1), and Namespace Not Ready (CRD 2).
            id.crdt[0] = U16::new(RETRY_DELAY_100MS);
            id.crdt[1] = U16::new(NOT_READY_RETRY_DELAY_100MS);
        }
        None => {
            wire::put_str(&mut id.sn, "nvmfd-discovery", b' ');
            wire::put_str(&mut id.mn, "nvmfd discovery", b' ');
            wire::put_str(&mut id.subnqn, crate::target::DISCOVERY_NQN, 0);
            id.cntrltype = 2;
            // Discovery Log Page Change Notices.
            id.oaes = U32::new(1 << 31);
        }
    }
    wire::put_str(&mut id.fr, firmware, b' ');
    id.cmic = 1 << 1; // the subsystem may have several controllers
    id.mdts = wire::sat((limits.max_io_size / 4096).max(1).trailing_zeros());
    id.cntlid = U16::new(ctrl.cntlid);
    id.ver = U32::new(NVME_VERSION);
    id.acl = 3;
    id.aerl = wire::sat(AER_LIMIT - 1);
    id.lpa = 1 << 2; // extended Get Log Page (offsets, NUMDU)
                     // One firmware slot, read-only (the Firmware Slot log reports slot 1 active).
    id.frmw = 0x3;
    id.elpe = 0;
    // Keep-alive granularity: 100 ms.
    id.kas = U16::new(1);
    // 128-bit Host Identifier (a Connect carries one), and TBKAS: any command restarts the
    // keep-alive timer.
    id.ctratt = U32::new(1 | 1 << 6);
    id.sqes = 0x66;
    id.cqes = 0x44;
    id.maxcmd = U16::new(limits.max_queue_depth);
    // SGLs without alignment, keyed SGL data blocks and the offset subtype (in-capsule data).
    // Not bit 18 (an SGL longer than the data): an SGL describes exactly the data it moves
    // (Dataset Management's may describe more), and a command that moves no data refuses
    // one that describes some, as the kernel target checks both.
    id.sgls = U32::new(1 | (1 << 2) | (1 << 20));
    id.ioccsz = U32::new((64 + limits.in_capsule_data_size) / 16);
    id.iorcsz = U32::new(1);
    id.icdoff = U16::new(0);
    id.fcatt = 0; // dynamic controller model
    id.msdbd = wire::sat(crate::queue::MAX_SGL_DESCRIPTORS);
    id
}

/// The NVM command set's Identify Controller (CNS 06h): the Dataset Management limits, which
/// the Linux host turns into its discard limits (DMRL: max_discard_segments; DMRSL, in each
/// namespace's logical blocks: max_discard_sectors).
pub(crate) fn identify_controller_nvm(s: &crate::target::Subsystem) -> wire::IdentifyControllerNvm {
    let mut id: wire::IdentifyControllerNvm = wire::zeroed();
    if let Some(l) = crate::io::DsmLimits::of(s) {
        id.dmrl = l.ranges;
        id.dmrsl = U32::new(l.range_blocks);
        id.dmsl = U64::new(l.blocks);
    }
    id
}

/// Identify Namespace.
pub(crate) fn identify_namespace(
    ns: &crate::target::Namespace,
    max_io_size: u32,
) -> wire::IdentifyNamespace {
    let info = &ns.info;
    let mut id: wire::IdentifyNamespace = wire::zeroed();
    // Shared: every controller of the subsystem serves it (a host's second path to it, for
    // multipath, is the same namespace).
    id.nmic = 1;
    let blocks = info.blocks();
    id.nsze = U64::new(blocks);
    id.ncap = U64::new(blocks);
    id.nuse = U64::new(blocks);
    id.nlbaf = 0;
    id.flbas = 0;
    id.lbaf[0].lbads = wire::sat(info.logical_block_size.trailing_zeros());
    let per_phys = (info.physical_block_size / info.logical_block_size).max(1);
    if per_phys > 1 {
        id.nsfeat |= 1 << 4; // NPWG, NPWA, NPDG, NPDA and NOWS are valid
        id.npwg = U16::new(wire::sat(per_phys - 1));
        id.npwa = U16::new(wire::sat(per_phys - 1));
        id.npdg = U16::new(wire::sat(per_phys - 1));
        id.npda = U16::new(wire::sat(per_phys - 1));
        id.nows = U16::new(wire::sat(
            (max_io_size / info.logical_block_size).max(1) - 1,
        ));
    }
    if info.deallocate {
        // Deallocated blocks read as zeroes; Write Zeroes may deallocate (where there is a
        // Write Zeroes). NSFEAT bit 2 (DAE, errors for deallocated blocks) stays clear.
        id.dlfeat = 0x1 | u8::from(info.write_zeroes) << 3;
    }
    if info.read_only {
        id.nsattr = 1;
    }
    if let Some(g) = ns.nguid {
        id.nguid = g;
    }
    id
}

fn get_log_page(q: &mut Queue, ctrl: &Controller, cmd: Command, icd: &[u8]) -> Action {
    let cdw10 = cmd.sqe.cdw10.get();
    let lid = (cdw10 & 0xFF) as u8;
    let rae = cdw10 & (1 << 15) != 0;
    let numd = (u64::from(cmd.sqe.cdw11.get() & 0xFFFF) << 16 | u64::from(cdw10 >> 16)) + 1;
    let len = numd * 4;
    let offset = u64::from(cmd.sqe.cdw12.get()) | u64::from(cmd.sqe.cdw13.get()) << 32;
    if offset % 4 != 0 {
        return q.respond(&cmd, status::INVALID_FIELD, 0);
    }
    // A transfer longer than MDTS is refused, not cut short nor left to the transport (whose
    // buffers hold MDTS): Invalid Field in Command, as SPDK's target answers a log page longer
    // than the transfer it can take.
    if len > u64::from(q.target().limits().max_io_size) {
        return q.respond(&cmd, status::INVALID_FIELD, 0);
    }
    // The transfer is checked before the page is read: reading the Changed Namespace List
    // clears it, and a read the host never gets must not.
    match q.data_ref(&cmd.sqe, u32::try_from(len).unwrap_or(u32::MAX), false, icd) {
        Ok(DataRef::Keyed { .. } | DataRef::KeyedList { .. }) => {}
        Ok(_) => return q.respond(&cmd, status::INVALID_FIELD, 0),
        Err(st) => return q.respond(&cmd, st, 0),
    }
    let mut page = q.take_bytes(0);
    match (lid, ctrl.subsystem.is_some()) {
        (log_page::DISCOVERY, false) => {
            page = discovery_log(q, ctrl);
            // A read past the page fails (below), and must not take the event.
            if !rae && offset <= page.len() as u64 {
                // Read and not retained: the next change raises an event again, and one for
                // this log not yet reported is not reported.
                {
                    let mut st = ctrl.lock();
                    st.disc_event_masked = false;
                    st.pending_events
                        .retain(|&e| e != crate::target::DISCOVERY_CHANGED_EVENT);
                }
                // Built again: a change since the first build raised no event (still masked
                // then), so the host must get it in the page.
                page = discovery_log(q, ctrl);
            }
        }
        (log_page::ERROR, _) => page.resize(64, 0),
        // Controller-wide only (LPA bit 0 clear): an NSID other than 0 or FFFFFFFFh asks for
        // one namespace's figures, which nvmfd does not keep: Invalid Field, as the
        // specification says, rather than the controller's figures as the namespace's.
        (log_page::SMART, true) if !matches!(cmd.sqe.nsid.get(), 0 | u32::MAX) => {
            return q.respond(&cmd, status::INVALID_FIELD, 0)
        }
        (log_page::SMART, true) => page.extend_from_slice(smart_log(ctrl).as_bytes()),
        (log_page::FIRMWARE_SLOT, true) => {
            page.resize(512, 0);
            page[0] = 1; // active slot 1
            wire::put_str(&mut page[8..16], crate::target::FIRMWARE_REVISION, b' ');
        }
        (log_page::CHANGED_NAMESPACES, true) => {
            let mut list = [U32::ZERO; 1024];
            // An offset past the list fails before the read, which would clear it.
            if offset > list.as_bytes().len() as u64 {
                return q.respond(&cmd, status::INVALID_FIELD, 0);
            }
            let mut st = ctrl.lock();
            if st.changed_nsids.len() > crate::target::CHANGED_LIST_LEN {
                list[0] = U32::new(u32::MAX);
            } else {
                for (slot, &id) in list.iter_mut().zip(st.changed_nsids.iter()) {
                    *slot = U32::new(id);
                }
            }
            page.clear();
            page.extend_from_slice(list.as_bytes());
            if !rae {
                // Read and not retained: the next change raises an event again, and an
                // event for this list not yet reported is not reported. The list starts
                // over once read to its end: a host reading it in pieces gets every piece.
                if offset.saturating_add(len) >= list.as_bytes().len() as u64 {
                    st.changed_nsids.clear();
                }
                st.ns_event_masked = false;
                st.pending_events
                    .retain(|&e| e != crate::target::NS_ATTR_CHANGED_EVENT);
            }
        }
        // A log page this controller does not support (the specification and the kernel
        // target answer Invalid Field; Invalid Log Page is for a page that is refused as
        // asked).
        _ => return q.respond(&cmd, status::INVALID_FIELD, 0),
    };
    let Ok(start) = usize::try_from(offset) else {
        return q.respond(&cmd, status::INVALID_FIELD, 0);
    };
    if start > page.len() {
        return q.respond(&cmd, status::INVALID_FIELD, 0);
    }
    let end = usize::try_from(offset.saturating_add(len))
        .unwrap_or(usize::MAX)
        .min(page.len());
    // The requested part, in place.
    page.truncate(end);
    page.drain(..start);
    let mut data = page;
    // Reads past the end of the page return zeroes up to the requested length.
    let want = usize::try_from(len).unwrap_or(usize::MAX);
    if data.len() < want {
        data.resize(want, 0);
    }
    respond_data(q, &cmd, data, icd)
}

fn smart_log(ctrl: &Controller) -> wire::SmartLog {
    let mut s: wire::SmartLog = wire::zeroed();
    s.temperature = U16::new(273 + 25);
    s.avail_spare = 100;
    s.spare_thresh = 10;
    // Data units are thousands of 512-byte units, rounded up.
    let units = |bytes: u64| u128::from(bytes.div_ceil(512).div_ceil(1000));
    let [reads, writes, bytes_read, bytes_written] = ctrl.smart_figures();
    s.data_units_read = U128::new(units(bytes_read));
    s.data_units_written = U128::new(units(bytes_written));
    s.host_reads = U128::new(u128::from(reads));
    s.host_writes = U128::new(u128::from(writes));
    s
}

/// The discovery log page: one entry per port for every subsystem this host may reach.
pub(crate) fn discovery_log(q: &Queue, ctrl: &Controller) -> Vec<u8> {
    let t = q.target();
    // The generation first: a change that lands while the entries are built moves it on,
    // and a host that reads the header again sees that its entries may be stale. (Read
    // last, a new generation could name old entries.)
    let genctr = t.inner.genctr.load(Ordering::Acquire);
    let subsystems = t.subsystems();
    t.run_discovery_hook();
    let ports = t.ports();
    let mut entries = Vec::new();
    for s in subsystems.iter().filter(|s| s.allows(&ctrl.hostnqn)) {
        for p in &ports {
            let mut e: wire::DiscoveryLogEntry = wire::zeroed();
            e.trtype = 1; // RDMA
            e.adrfam = if p.addr.is_ipv4() { 1 } else { 2 };
            e.subtype = 2; // NVM subsystem
            e.treq = 0x2; // secure channel not required
            e.portid = U16::new(p.id);
            e.cntlid = U16::new(0xFFFF);
            e.asqsz = U16::new(crate::queue::ADMIN_QUEUE_ENTRIES);
            wire::put_str(&mut e.trsvcid, &p.port.to_string(), b' ');
            wire::put_str(&mut e.subnqn, &s.nqn, 0);
            wire::put_str(&mut e.traddr, &p.addr.to_string(), b' ');
            e.rdma_qptype = 1; // reliable connected
            e.rdma_prtype = 1; // no provider specified
            e.rdma_cms = 1; // rdma_cm
            entries.push(e);
        }
    }
    let mut h: wire::DiscoveryLogHeader = wire::zeroed();
    h.genctr = U64::new(genctr);
    h.numrec = U64::new(entries.len() as u64);
    let mut out = h.as_bytes().to_vec();
    for e in &entries {
        out.extend_from_slice(e.as_bytes());
    }
    out
}

/// The Command Retry Delay Time 1 reported (CRDT1, in 100 ms): how long a host that enabled
/// Advanced Command Retry waits before retrying a command answered with a retryable status
/// (Namespace Not Ready while an RBD namespace waits for its cluster, say). The Linux host
/// retries a command up to `nvme_core.max_retries` (5) times: some 5 s in all, instead of at
/// once.
pub const RETRY_DELAY_100MS: u16 = 10;

/// The Command Retry Delay Time 2 reported (CRDT2, in 100 ms), which a Namespace Not Ready
/// status names: a namespace waits longer than a busy queue does, for an RBD image to open
/// again (its retries back off up to 30 s) or a shrink to be published (10 s at most). Five
/// retries of 6 s give a host 30 s before it fails the I/O, where CRDT1 would give it 5.
pub const NOT_READY_RETRY_DELAY_100MS: u16 = 60;
