//! The host drives the target end to end over the in-memory transport: discovery, connect,
//! identify, I/O verified from 512 B to the largest transfer, errors, keep-alive, shutdown.

// Sizes and counters in this file are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvmfd_blockdev::{Device, DeviceSpec, Kind};
use nvmfd_nvme::host::{AdminQueue, DataDir, HostError, HostId, HostTransport, IoQueue};
#[path = "support/loopback.rs"]
mod loopback;
use loopback::{namespace_info, Backend, Loopback};
use nvmfd_nvme::wire::{self, status, SglDesc, Sqe, Status};
use nvmfd_nvme::*;
use zerocopy::little_endian::{U16, U32};
use zerocopy::IntoBytes;

const SUB: &str = "nqn.2024-01.io.nvmfd.test:ram";
const RESTRICTED: &str = "nqn.2024-01.io.nvmfd.test:restricted";
const SIZE: u64 = 16 << 20;

fn host(n: u8) -> HostId {
    HostId {
        nqn: format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000{n:02}"),
        id: [n; 16],
    }
}

struct World {
    target: Target,
    backend: Rc<RefCell<Backend>>,
    /// Namespace 1 of `SUB`.
    d1: Arc<Device>,
}

fn malloc(size: u64, bs: u32, read_only: bool) -> Arc<Device> {
    let mut s = DeviceSpec::new(Kind::Malloc);
    s.size = size;
    s.block_size = bs;
    s.read_only = read_only;
    Device::open(&s).unwrap()
}

fn world() -> World {
    let d1 = malloc(SIZE, 512, false);
    let d2 = malloc(SIZE, 4096, false);
    let d3 = malloc(SIZE, 512, true);
    let d4 = malloc(SIZE, 512, false);
    let ns = |nsid: u32, d: &Arc<Device>, id: Option<u8>| Namespace {
        nsid,
        info: namespace_info(d.info()),
        uuid: id.map(|b| [b; 16]),
        nguid: id.map(|b| [b ^ 0xff; 16]),
    };
    let subsystems = vec![
        Subsystem {
            id: 0,
            nqn: SUB.into(),
            serial: "SN-TEST-0001".into(),
            model: "nvmfd test".into(),
            allow_any_host: true,
            hosts: vec![],
            cntlids: nvmfd_nvme::ALL_CNTLIDS,
            namespaces: vec![ns(1, &d1, None), ns(2, &d2, Some(7)), ns(3, &d3, None)],
        },
        Subsystem {
            id: 0,
            nqn: RESTRICTED.into(),
            serial: "SN-TEST-0002".into(),
            model: "nvmfd test".into(),
            allow_any_host: false,
            hosts: vec![host(1).nqn],
            cntlids: nvmfd_nvme::ALL_CNTLIDS,
            namespaces: vec![ns(1, &d4, None)],
        },
    ];
    let ports = vec![Port {
        id: 0,
        addr: "192.0.2.7".parse().unwrap(),
        port: 4420,
    }];
    let target = Target::new(subsystems, ports, Limits::default());
    let backend = Backend::new(
        &[
            (SUB.into(), 1, Arc::clone(&d1)),
            (SUB.into(), 2, d2),
            (SUB.into(), 3, d3),
            (RESTRICTED.into(), 1, d4),
        ],
        Limits::default().max_io_size,
    )
    .unwrap();
    World {
        target,
        backend,
        d1,
    }
}

impl World {
    fn link(&self, qid: u16, hsqsize: u16) -> Loopback {
        Loopback::new(&self.target, &self.backend, qid, hsqsize)
    }
    fn admin(&self, h: &HostId, subnqn: &str) -> Result<AdminQueue<Loopback>, HostError> {
        AdminQueue::connect(self.link(0, 31), h, subnqn, 31, 5000)
    }
    /// An admin Connect of `h` to `subnqn` with `change` made to the target, once, while
    /// the Connect is served (after its checks, before its controller is made).
    fn admin_during(
        &self,
        h: &HostId,
        subnqn: &str,
        change: impl FnOnce(&Target) + Send + 'static,
    ) -> Result<AdminQueue<Loopback>, HostError> {
        let target = self.target.clone();
        let change = std::sync::Mutex::new(Some(change));
        self.target.set_connect_hook(Some(Box::new(move || {
            if let Some(f) = change.lock().unwrap_or_else(|e| e.into_inner()).take() {
                f(&target);
            }
        })));
        let r = self.admin(h, subnqn);
        self.target.set_connect_hook(None);
        r
    }
    /// Controllers of `subnqn` that have not ended.
    fn live_controllers(&self, subnqn: &str) -> usize {
        self.target
            .controllers()
            .iter()
            .filter(|c| c.subnqn == subnqn && c.end_reason().is_none())
            .count()
    }
    /// An enabled controller with `n` I/O queues connected.
    fn controller(&self, n: u16) -> (AdminQueue<Loopback>, Vec<IoQueue<Loopback>>) {
        let h = host(1);
        let mut a = self.admin(&h, SUB).unwrap();
        a.enable().unwrap();
        assert_eq!(a.set_queue_count(n).unwrap(), n);
        let ios = (1..=n)
            .map(|q| IoQueue::connect(self.link(q, 127), &h, SUB, a.cntlid, q, 127).unwrap())
            .collect();
        (a, ios)
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut v);
    v
}

fn status_of<T: std::fmt::Debug>(r: Result<T, HostError>) -> Status {
    match r {
        Err(HostError::Status { status, .. }) => status,
        other => panic!("expected an NVMe error status, got {other:?}"),
    }
}

fn dw0_of<T: std::fmt::Debug>(r: Result<T, HostError>) -> u32 {
    match r {
        Err(HostError::Status { dw0, .. }) => dw0,
        other => panic!("expected an NVMe error status, got {other:?}"),
    }
}

#[test]
fn discovery_lists_what_the_host_may_reach() {
    let w = world();
    for (h, expect) in [(host(1), vec![SUB, RESTRICTED]), (host(2), vec![SUB])] {
        let mut d = w.admin(&h, DISCOVERY_NQN).unwrap();
        d.enable().unwrap();
        let id = d.identify_controller().unwrap();
        assert_eq!(id.cntrltype, 2, "a discovery controller");
        let entries = d.discover().unwrap();
        let got: Vec<_> = entries.iter().map(host_text).collect();
        let want: Vec<_> = expect
            .iter()
            .map(|s| (s.to_string(), "192.0.2.7".to_string(), "4420".to_string()))
            .collect();
        assert_eq!(got, want);
        for e in &entries {
            assert_eq!(
                (e.trtype, e.adrfam, e.subtype, e.rdma_qptype, e.rdma_cms),
                (1, 1, 2, 1, 1)
            );
            assert_eq!(e.cntlid.get(), 0xFFFF);
        }
        // Reads at an offset return the same bytes as the whole page.
        let whole = d
            .get_log_page(
                wire::log_page::DISCOVERY,
                0,
                1024 + 1024 * expect.len() as u32,
            )
            .unwrap();
        let tail = d
            .get_log_page(wire::log_page::DISCOVERY, 1024 + 256, 256)
            .unwrap();
        assert_eq!(tail, whole[1024 + 256..1024 + 512]);
        // A discovery controller has no namespaces and no I/O log pages.
        assert!(status_of(d.identify_namespace(1)).same_code(status::INVALID_FIELD));
        assert!(status_of(d.get_log_page(wire::log_page::SMART, 0, 512))
            .same_code(status::INVALID_FIELD));
    }
}

/// A subsystem's controllers take IDs from its range alone (`cntlid_min`, `cntlid_max`: two
/// gateways serving one NQN give each its own, so a host's two paths never meet one ID), as
/// many as the range holds, then Controller Busy; an ID freed is taken again. Before, every
/// controller took the next ID of the whole range, the same on every gateway.
#[test]
fn controllers_take_ids_from_their_subsystems_range() {
    let mut sub = empty_subsystem(SUB, "SN-RANGE");
    sub.cntlids = (300, 301);
    let target = Target::new(vec![sub], vec![], Limits::default());
    let backend = Backend::new(&[], Limits::default().max_io_size).unwrap();
    let connect = |h: u8| {
        AdminQueue::connect(
            Loopback::new(&target, &backend, 0, 31),
            &host(h),
            SUB,
            31,
            5000,
        )
    };
    let a = connect(1).unwrap();
    let b = connect(2).unwrap();
    let mut ids = [a.cntlid, b.cntlid];
    ids.sort_unstable();
    assert_eq!(ids, [300, 301]);
    assert!(status_of(connect(3)).same_code(status::CONNECT_CONTROLLER_BUSY));
    // A discovery controller is not held to a subsystem's range.
    let d = AdminQueue::connect(
        Loopback::new(&target, &backend, 0, 31),
        &host(4),
        DISCOVERY_NQN,
        31,
        5000,
    )
    .unwrap();
    assert!(!(300..=301).contains(&d.cntlid));
    let freed = a.cntlid;
    drop(a);
    assert_eq!(connect(5).unwrap().cntlid, freed);
}

/// A subsystem any host may connect to, with no namespace.
fn empty_subsystem(nqn: &str, serial: &str) -> Subsystem {
    Subsystem {
        id: 0,
        nqn: nqn.into(),
        serial: serial.into(),
        model: "nvmfd test".into(),
        allow_any_host: true,
        hosts: vec![],
        cntlids: nvmfd_nvme::ALL_CNTLIDS,
        namespaces: vec![],
    }
}

/// A subsystem added while a discovery log is built: the log's generation is taken before
/// its entries, so the host, reading the header again, sees the change, reads the log again
/// and lists the new subsystem (with the generation taken last, it accepted the stale log).
#[test]
fn a_subsystem_added_while_the_discovery_log_is_built_is_listed() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    const LATE: &str = "nqn.2024-01.io.nvmfd.test:late";
    let w = world();
    let mut d = w.admin(&host(2), DISCOVERY_NQN).unwrap();
    d.enable().unwrap();
    let (t, fired) = (w.target.clone(), Arc::new(AtomicBool::new(false)));
    let f = Arc::clone(&fired);
    w.target.set_discovery_hook(Some(Box::new(move || {
        if !f.swap(true, SeqCst) {
            t.add_subsystem(empty_subsystem(LATE, "SN-TEST-0003"))
                .unwrap();
        }
    })));
    let entries = d.discover().unwrap();
    w.target.set_discovery_hook(None);
    assert!(fired.load(SeqCst));
    let got: Vec<String> = entries.iter().map(|e| host_text(e).0).collect();
    assert_eq!(got, vec![SUB.to_string(), LATE.to_string()]);
}

/// An Asynchronous Event Request of command ID `cid`.
fn aer(cid: u16) -> Sqe {
    let mut s: Sqe = nvmfd_nvme::host::command(0);
    s.opcode = wire::admin_opcode::ASYNC_EVENT_REQUEST;
    s.cid = U16::new(cid);
    s
}

/// Adds a port (`id`, address 10.0.0.`id`:4420) to `w`'s target: a Discovery log change.
fn add_port(w: &World, id: u16) {
    let mut ports = w.target.ports();
    ports.push(Port {
        addr: format!("10.0.0.{id}").parse().unwrap(),
        port: 4420,
        id,
    });
    w.target.set_ports(ports);
}

/// A discovery controller that enabled Discovery Log Page Change notices (what persistent
/// discovery and SPDK hosts ask for) gets one when a subsystem is added or removed, the
/// ports change or a subsystem's hosts do; one at a time until the host reads the log. The
/// setting was taken and nothing was ever raised: a host waiting on its AER never learned
/// of a new subsystem.
#[test]
fn a_discovery_controller_is_told_when_the_discovery_log_changes() {
    const NEW: &str = "nqn.2024-01.io.nvmfd.test:new";
    let w = world();
    let mut d = w.admin(&host(2), DISCOVERY_NQN).unwrap();
    d.enable().unwrap();
    assert_eq!(d.identify_controller().unwrap().oaes.get(), 1 << 31);
    d.set_feature(wire::feature::ASYNC_EVENT_CONFIG, 1 << 31)
        .unwrap();
    let l = d.transport();
    for cid in [100, 101] {
        assert!(l.send_capsule(aer(cid).as_bytes()).unwrap().is_none());
    }
    w.target
        .add_subsystem(empty_subsystem(NEW, "SN-TEST-0009"))
        .unwrap();
    let ev = l.poll_events();
    assert_eq!(ev.len(), 1);
    assert_eq!((ev[0].cid.get(), ev[0].dw0.get()), (100, 0x0070_F002));
    // Not again until the host has read the log.
    w.target.remove_subsystem(NEW).unwrap();
    assert!(
        l.poll_events().is_empty(),
        "raised again before the log was read"
    );
    // A read past the log's end fails and reads nothing: the next change raises nothing
    // yet. (Before, it took the event.)
    let past = d.get_log_page(wire::log_page::DISCOVERY, 1 << 20, 4);
    assert!(status_of(past).same_code(status::INVALID_FIELD));
    add_port(&w, 8);
    assert!(
        d.transport().poll_events().is_empty(),
        "raised again after a read past the log's end"
    );
    let got: Vec<String> = d
        .discover()
        .unwrap()
        .iter()
        .map(|e| host_text(e).0)
        .collect();
    // One entry per port.
    assert_eq!(got, vec![SUB.to_string(); 2]);
    // Read: the next change raises it; a change of the ports too.
    add_port(&w, 9);
    let ev = d.transport().poll_events();
    assert_eq!((ev[0].cid.get(), ev[0].dw0.get()), (101, 0x0070_F002));
    // An I/O controller hears nothing of it.
    let (mut a, _ios) = w.controller(1);
    assert!(
        status_of(a.set_feature(wire::feature::ASYNC_EVENT_CONFIG, 1 << 31))
            .same_code(status::INVALID_FIELD)
    );
}

/// A subsystem added while a discovery log read that takes the change event (RAE clear) is
/// built, with the event masked by one the host has not read yet: the host gets it in the
/// log it reads, or an event. Before, the page was built before the event was taken, so
/// neither: the change raised nothing (masked), and the page was built without it.
#[test]
fn a_change_during_a_discovery_log_read_is_in_the_log_or_raises_an_event() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    const MASKING: &str = "nqn.2024-01.io.nvmfd.test:masking";
    const LATE: &str = "nqn.2024-01.io.nvmfd.test:late";
    let w = world();
    let mut d = w.admin(&host(2), DISCOVERY_NQN).unwrap();
    d.enable().unwrap();
    d.set_feature(wire::feature::ASYNC_EVENT_CONFIG, 1 << 31)
        .unwrap();
    for cid in [100, 101] {
        assert!(d
            .transport()
            .send_capsule(aer(cid).as_bytes())
            .unwrap()
            .is_none());
    }
    // A first change: its event comes, and masks the next until the log is read.
    w.target
        .add_subsystem(empty_subsystem(MASKING, "SN-TEST-0010"))
        .unwrap();
    assert_eq!(d.transport().poll_events().len(), 1);
    let (t, fired) = (w.target.clone(), Arc::new(AtomicBool::new(false)));
    let f = Arc::clone(&fired);
    w.target.set_discovery_hook(Some(Box::new(move || {
        if !f.swap(true, SeqCst) {
            t.add_subsystem(empty_subsystem(LATE, "SN-TEST-0011"))
                .unwrap();
        }
    })));
    let page = d
        .get_log_page(wire::log_page::DISCOVERY, 0, 8 * 1024)
        .unwrap();
    w.target.set_discovery_hook(None);
    assert!(fired.load(SeqCst));
    let listed: Vec<String> = page[1024..]
        .chunks_exact(1024)
        .filter_map(wire::read::<wire::DiscoveryLogEntry>)
        .map(|e| host_text(&e).0)
        .collect();
    let events = d.transport().poll_events();
    assert!(
        listed.iter().any(|n| n == LATE) || !events.is_empty(),
        "neither in the log ({listed:?}) nor an event"
    );
}

/// A discovery log longer than one transfer (MDTS, 128 KiB here) is read whole, in pieces.
#[test]
fn a_discovery_log_longer_than_one_transfer_is_read_whole() {
    let w = world();
    let nqns: Vec<String> = (0..140)
        .map(|k| format!("nqn.2024-01.io.nvmfd.test:many{k:03}"))
        .collect();
    for (k, nqn) in nqns.iter().enumerate() {
        w.target
            .add_subsystem(empty_subsystem(nqn, &format!("SN-MANY-{k:03}")))
            .unwrap();
    }
    let mut d = w.admin(&host(2), DISCOVERY_NQN).unwrap();
    d.enable().unwrap();
    let got: Vec<String> = d
        .discover()
        .unwrap()
        .iter()
        .map(|e| host_text(e).0)
        .collect();
    let mut want = vec![SUB.to_string()];
    want.extend(nqns);
    assert_eq!(got, want);
}

fn host_text(e: &wire::DiscoveryLogEntry) -> (String, String, String) {
    nvmfd_nvme::host::discovery_entry_text(e)
}

#[test]
fn connect_checks_host_subsystem_and_parameters() {
    let w = world();
    assert!(w.admin(&host(1), RESTRICTED).is_ok());
    let refused = w.admin(&host(2), RESTRICTED);
    assert!(status_of(refused).same_code(status::CONNECT_INVALID_HOST));
    assert_eq!(
        dw0_of(w.admin(&host(2), RESTRICTED)),
        1 << 16 | 512,
        "IATTR and IPO: the host NQN, as the kernel target points"
    );
    // Invalid Parameters says where: IATTR (bit 16) = in the data, IPO = byte offset.
    let unknown = w.admin(&host(1), "nqn.2024-01.io.nvmfd.test:nope");
    assert_eq!(dw0_of(unknown), 1 << 16 | 256);
    let zero_sqsize = AdminQueue::connect(w.link(0, 0), &host(1), SUB, 0, 0);
    assert_eq!(dw0_of(zero_sqsize), 44);
    let too_deep = AdminQueue::connect(w.link(0, 4096), &host(1), SUB, 4096, 0);
    assert_eq!(dw0_of(too_deep), 44);
    // An admin queue has 32 entries at most (the discovery log's ASQSZ), as the kernel
    // target has it: 33 is refused, though an I/O queue may have it.
    let admin_33 = AdminQueue::connect(w.link(0, 32), &host(1), SUB, 32, 0);
    assert_eq!(dw0_of(admin_33), 44);
    // A keep-alive timeout longer than the maximum: refused, not cut down, pointing at KATO.
    let max = u32::try_from(Limits::default().kato_max.as_millis()).unwrap();
    let long_kato = AdminQueue::connect(w.link(0, 31), &host(1), SUB, 31, max + 1);
    assert_eq!(dw0_of(long_kato), 48);
    assert!(AdminQueue::connect(w.link(0, 31), &host(1), SUB, 31, max).is_ok());
    let cm_mismatch = AdminQueue::connect(w.link(0, 15), &host(1), SUB, 31, 0);
    assert_eq!(
        dw0_of(cm_mismatch),
        44,
        "CM HSQSIZE differs from Connect SQSIZE"
    );
    // An I/O queue needs an enabled controller of the same host, and a granted queue ID.
    let (a, _ios) = w.controller(2);
    // Another host naming this controller (its queue otherwise right, so that only the host
    // check can refuse it): Invalid Parameters pointing at CNTLID, as for a controller of
    // another host or none.
    let other_host = IoQueue::connect(w.link(1, 127), &host(2), SUB, a.cntlid, 1, 127);
    assert_eq!(
        dw0_of(other_host),
        1 << 16 | 16,
        "another host's controller"
    );
    // The host's NQN with another Host Identifier is another host too (the kernel target
    // does not look): Invalid Parameters pointing at HOSTID. Before, it took queue 1.
    let mut impostor = host(1);
    impostor.id[15] ^= 0xFF;
    let other_id = IoQueue::connect(w.link(1, 127), &impostor, SUB, a.cntlid, 1, 127);
    assert_eq!(dw0_of(other_id), 1 << 16, "another Host Identifier");
    let beyond = IoQueue::connect(w.link(3, 127), &host(1), SUB, a.cntlid, 3, 127);
    assert_eq!(dw0_of(beyond), 42, "qid 3 of 2 granted");
    // A queue ID the controller has: Command Sequence Error (the specification; the kernel
    // target answers so), not Invalid Parameters.
    let twice = IoQueue::connect(w.link(1, 127), &host(1), SUB, a.cntlid, 1, 127);
    let st = status_of(twice);
    assert!(
        st.same_code(status::COMMAND_SEQUENCE_ERROR),
        "qid 1 is taken: {st:?}"
    );
    let wrong_ctrl = IoQueue::connect(w.link(1, 127), &host(1), SUB, 0x7777, 1, 127);
    assert_eq!(dw0_of(wrong_ctrl), 1 << 16 | 16);
}

#[test]
fn connect_refuses_an_incompatible_format_and_a_static_cntlid() {
    let w = world();
    let mut l = w.link(0, 31);
    let mut cmd: wire::ConnectCmd = wire::zeroed();
    cmd.opcode = 0x7F;
    cmd.flags = 0x40;
    cmd.fctype = wire::fctype::CONNECT;
    cmd.sqsize = U16::new(31);
    cmd.recfmt = U16::new(1);
    let mut data: wire::ConnectData = wire::zeroed();
    data.cntlid = U16::new(0xFFFF);
    wire::put_str(&mut data.subnqn, SUB, 0);
    wire::put_str(&mut data.hostnqn, &host(1).nqn, 0);
    let sqe = wire::read::<Sqe>(cmd.as_bytes()).unwrap();
    let c =
        nvmfd_nvme::host::HostTransport::execute(&mut l, sqe, DataDir::ToTarget(data.as_bytes()))
            .unwrap();
    assert!(c.status().same_code(status::CONNECT_INCOMPATIBLE_FORMAT));
    cmd.recfmt = U16::new(0);
    data.cntlid = U16::new(5);
    let sqe = wire::read::<Sqe>(cmd.as_bytes()).unwrap();
    let c =
        nvmfd_nvme::host::HostTransport::execute(&mut l, sqe, DataDir::ToTarget(data.as_bytes()))
            .unwrap();
    assert_eq!(c.dw0.get(), 1 << 16 | 16);
}

/// An NQN is NUL-terminated within its 256-byte field: one that fills the field (here a
/// known NQN padded with spaces, which was taken for it) is Connect Invalid Parameters
/// pointing at the field, as SPDK answers.
#[test]
fn connect_refuses_an_nqn_without_its_terminating_nul() {
    let w = world();
    let connect = |subnqn: &str, sub_fill: u8, hostnqn: &str, host_fill: u8| {
        let mut l = w.link(0, 31);
        let mut cmd: wire::ConnectCmd = wire::zeroed();
        cmd.opcode = 0x7F;
        cmd.flags = 0x40;
        cmd.fctype = wire::fctype::CONNECT;
        cmd.sqsize = U16::new(31);
        let mut data: wire::ConnectData = wire::zeroed();
        data.cntlid = U16::new(0xFFFF);
        data.subnqn.fill(sub_fill);
        data.hostnqn.fill(host_fill);
        data.subnqn[..subnqn.len()].copy_from_slice(subnqn.as_bytes());
        data.hostnqn[..hostnqn.len()].copy_from_slice(hostnqn.as_bytes());
        let sqe = wire::read::<Sqe>(cmd.as_bytes()).unwrap();
        nvmfd_nvme::host::HostTransport::execute(&mut l, sqe, DataDir::ToTarget(data.as_bytes()))
            .unwrap()
    };
    let nqn = host(1).nqn;
    assert!(connect(SUB, 0, &nqn, 0).status().is_success());
    let c = connect(SUB, b' ', &nqn, 0);
    assert!(c.status().same_code(status::CONNECT_INVALID_PARAMETERS));
    assert_eq!(c.dw0.get(), 1 << 16 | 256);
    let c = connect(SUB, 0, &nqn, b' ');
    assert!(c.status().same_code(status::CONNECT_INVALID_PARAMETERS));
    assert_eq!(c.dw0.get(), 1 << 16 | 512);
}

/// A subsystem with a namespace that caches writes reports a volatile write cache, and that
/// a Flush to every namespace (NSID FFFFFFFFh) is not supported (Flush Behavior 10b), which
/// it answers with Invalid Namespace.
#[test]
fn a_volatile_cache_is_reported_with_its_flush_behavior() {
    let w = world();
    let mut s = w.target.subsystem(SUB).unwrap().as_ref().clone();
    s.namespaces[0].info.volatile_cache = true;
    w.target.replace_subsystem(s).unwrap();
    let (mut a, mut ios) = w.controller(1);
    let id = a.identify_controller().unwrap();
    assert_eq!(id.vwc, 0b101, "present; no flush of NSID FFFFFFFFh");
    let io = &mut ios[0];
    io.flush(1).unwrap();
    let e = io.flush(u32::MAX).unwrap_err();
    assert!(status_of::<()>(Err(e)).same_code(status::INVALID_NAMESPACE));
}

/// A host reads VWC once per association: a subsystem of RAM alone reports a volatile write
/// cache too, so that a host connected before a file namespace (which caches writes) is
/// added still flushes it. A Flush of a namespace without a cache succeeds.
#[test]
fn a_subsystem_without_a_caching_namespace_still_reports_a_write_cache_a_host_may_flush() {
    let w = world();
    let s = w.target.subsystem(SUB).unwrap();
    assert!(s.namespaces.iter().all(|n| !n.info.volatile_cache));
    let (mut a, mut ios) = w.controller(1);
    let id = a.identify_controller().unwrap();
    assert_eq!(id.vwc & 1, 1, "no write cache reported: {:#b}", id.vwc);
    ios[0].flush(1).unwrap();
    // A namespace that caches writes comes while the host is connected: the host's view of
    // the controller, read at connect, already says to flush.
    let mut s = s.as_ref().clone();
    s.namespaces[0].info.volatile_cache = true;
    w.target.replace_subsystem(s).unwrap();
    assert_eq!(
        a.identify_controller().unwrap().vwc,
        id.vwc,
        "VWC changed under a host"
    );
    ios[0].flush(1).unwrap();
}

/// A shrink stores the device's new size, then waits for the writes past it before it is
/// published (and may be refused and undone). A command the core let through meanwhile, past
/// the new end, is answered Namespace Not Ready, which a host retries, not LBA Out of Range,
/// which it does not (and the blocks are still there if the shrink is undone).
#[test]
fn io_past_a_shrink_not_yet_published_is_retryable_and_served_once_it_is_undone() {
    let w = world();
    let (_a, mut ios) = w.controller(1);
    let io = &mut ios[0];
    let half = SIZE / 2;
    let past = half / 512 + 8;
    let data = vec![0x6bu8; 4096];
    io.write(1, past, 8, &data, false).unwrap();
    let mut back = vec![0u8; 4096];
    let refused = w.d1.resize_fenced(Some(half), || {
        let st = status_of(io.read(1, past, 8, &mut back));
        assert!(
            st.same_code(Status::retryable(0, 0x82)) && !st.dnr(),
            "a command past a shrink in progress: {st:?}"
        );
        Err(std::io::Error::other("the shrink is refused"))
    });
    assert!(refused.is_err());
    assert_eq!(w.d1.size(), SIZE, "undone");
    io.read(1, past, 8, &mut back).unwrap();
    assert_eq!(
        back, data,
        "the blocks past the refused shrink are all still there"
    );
}

#[test]
fn identify_reports_what_the_linux_host_checks() {
    let w = world();
    let (mut a, _) = w.controller(1);
    let id = a.identify_controller().unwrap();
    assert_eq!(id.cntlid.get(), a.cntlid);
    assert_eq!(wire::get_str(&id.subnqn), Some(SUB));
    assert_eq!(wire::get_str(&id.sn), Some("SN-TEST-0001"));
    assert_eq!(wire::get_str(&id.mn), Some("nvmfd test"));
    assert_eq!(wire::get_str(&id.fr), Some(env!("CARGO_PKG_VERSION")));
    assert_eq!(id.ver.get(), NVME_VERSION);
    assert_eq!(id.cntrltype, 1);
    let sgls = id.sgls.get();
    assert!(
        sgls & 0x3 == 1 && sgls & (1 << 2) != 0 && sgls & (1 << 20) != 0,
        "SGLs, keyed, offset: {sgls:#x}"
    );
    assert_eq!(
        sgls & (1 << 18),
        0,
        "no SGL longer than its data promised: commands without data refuse one: {sgls:#x}"
    );
    assert_eq!(
        id.vwc, 0b101,
        "a volatile write cache, present for every subsystem"
    );
    assert_eq!(id.icdoff.get(), 0);
    assert_eq!(id.ioccsz.get(), (64 + 4096) / 16);
    assert_eq!(id.iorcsz.get(), 1);
    assert_eq!(id.mdts, 5, "128 KiB in 4 KiB pages");
    assert_eq!((id.sqes, id.cqes), (0x66, 0x44));
    assert_eq!(id.maxcmd.get(), 128);
    assert_eq!(
        id.ctratt.get() & 0x41,
        0x41,
        "128-bit Host Identifier and TBKAS"
    );
    // NN is the configured largest NSID, not the largest in use: namespaces can come later.
    assert_eq!(id.nn.get(), Limits::default().max_nsid);
    assert_eq!(id.mnan.get(), id.nn.get());
    assert_eq!(id.oncs.get() & 0b1100, 0b1100, "DSM and Write Zeroes");
    assert_eq!(
        u32::from(id.msdbd),
        MAX_SGL_DESCRIPTORS,
        "keyed descriptor lists"
    );
    let ns = a.identify_namespace(2).unwrap();
    assert_eq!(
        ns.nmic & 1,
        1,
        "shared: a host's second path to it is the same namespace"
    );
    assert_eq!(ns.nsze.get(), SIZE / 4096);
    assert_eq!(ns.lbaf[0].lbads, 12);
    assert_eq!(ns.dlfeat & 0x7, 1, "deallocated blocks read as zeroes");
    assert_eq!(ns.nguid, [7 ^ 0xff; 16]);
    assert_eq!(a.identify_namespace(3).unwrap().nsattr, 1, "read-only");
    assert_eq!(a.active_namespaces(0).unwrap(), [1, 2, 3]);
    assert_eq!(a.active_namespaces(1).unwrap(), [2, 3]);
    let ids = a.namespace_ids(2).unwrap();
    assert_eq!(
        ids,
        vec![(2, vec![7 ^ 0xff; 16]), (3, vec![7; 16]), (4, vec![0])]
    );
    // An inactive NSID within NN: a zeroed structure; past NN (and 0): Invalid Namespace.
    let inactive = a.identify_namespace(9).unwrap();
    assert!(inactive.as_bytes().iter().all(|&b| b == 0));
    let nn = Limits::default().max_nsid;
    assert!(a
        .identify_namespace(nn)
        .unwrap()
        .as_bytes()
        .iter()
        .all(|&b| b == 0));
    assert!(status_of(a.identify_namespace(nn + 1)).same_code(status::INVALID_NAMESPACE));
    assert!(status_of(a.identify_namespace(0)).same_code(status::INVALID_NAMESPACE));
    // I/O to an inactive NSID is still refused.
    assert!(status_of(a.namespace_ids(9)).same_code(status::INVALID_NAMESPACE));
    let mut s: Sqe = nvmfd_nvme::host::command(0);
    s.opcode = wire::admin_opcode::IDENTIFY;
    s.cdw10 = U32::new(0x55);
    let mut buf = vec![0u8; 4096];
    assert!(status_of(a.raw(s, DataDir::FromTarget(&mut buf))).same_code(status::INVALID_FIELD));
}

#[test]
fn writes_and_reads_round_trip_from_512_bytes_to_the_largest_transfer() {
    let w = world();
    let (_a, mut ios) = w.controller(2);
    let max = Limits::default().max_io_size as usize;
    let mut seed = 0;
    for (nsid, bs) in [(1u32, 512usize), (2, 4096)] {
        for (q, keyed_only) in [(0usize, false), (1, true)] {
            let io = &mut ios[q];
            io.transport().in_capsule = if keyed_only { 0 } else { 4096 };
            let mut len = bs;
            while len <= max {
                seed += 1;
                let nlb = (len / bs) as u32;
                let slba = seed * 3;
                let data = pattern(seed, len);
                io.write(nsid, slba, nlb, &data, seed % 3 == 0).unwrap();
                let mut back = vec![0u8; len];
                io.read(nsid, slba, nlb, &mut back).unwrap();
                assert!(back == data, "ns {nsid} len {len} keyed_only {keyed_only}");
                len = if len < 8192 { len * 2 } else { len * 4 };
            }
        }
    }
}

#[test]
fn flush_write_zeroes_and_deallocate() {
    let w = world();
    let (_a, mut ios) = w.controller(1);
    let io = &mut ios[0];
    let data = pattern(9, 64 * 512);
    io.write(1, 100, 64, &data, false).unwrap();
    io.flush(1).unwrap();
    io.write_zeroes(1, 108, 8).unwrap();
    io.deallocate(1, &[(120, 4), (130, 2)]).unwrap();
    let mut back = vec![0u8; 64 * 512];
    io.read(1, 100, 64, &mut back).unwrap();
    let mut want = data.clone();
    for (s, n) in [(8, 8), (20, 4), (30, 2)] {
        want[s * 512..(s + n) * 512].fill(0);
    }
    assert!(back == want);
}

/// Write Zeroes with FUA set asks the backend for durable zeroes; without it, plain ones. The
/// bit was once dropped: a FUA Write Zeroes completed with its zeroes in a volatile cache.
#[test]
fn write_zeroes_passes_its_fua_bit_to_the_backend() {
    let w = world();
    let (_a, mut ios) = w.controller(1);
    let io = &mut ios[0];
    for fua in [true, false] {
        let sqe = nvmfd_nvme::host::rw_sqe(wire::io_opcode::WRITE_ZEROES, 1, 40, 8, fua);
        let c = io.transport().execute(sqe, DataDir::None).unwrap();
        assert!(c.status().is_success(), "{:?}", c.status());
        assert_eq!(
            io.transport().ops.last(),
            Some(&IoOp::WriteZeroes {
                offset: 40 * 512,
                len: 8 * 512,
                fua
            })
        );
    }
}

#[test]
fn out_of_range_and_malformed_commands_get_the_precise_status() {
    let w = world();
    let (_a, mut ios) = w.controller(1);
    let io = &mut ios[0];
    let blocks = SIZE / 512;
    let mut buf = vec![0u8; 1024];
    assert!(status_of(io.read(1, blocks - 1, 2, &mut buf)).same_code(status::LBA_OUT_OF_RANGE));
    assert!(
        status_of(io.read(1, u64::MAX, 2, &mut buf)).same_code(status::LBA_OUT_OF_RANGE),
        "overflow"
    );
    assert!(status_of(io.write_zeroes(1, blocks, 1)).same_code(status::LBA_OUT_OF_RANGE));
    assert!(status_of(io.deallocate(1, &[(blocks - 1, 2)])).same_code(status::LBA_OUT_OF_RANGE));
    let mut big = vec![0u8; 256 * 1024];
    assert!(
        status_of(io.read(1, 0, 512, &mut big)).same_code(status::INVALID_FIELD),
        "above MDTS"
    );
    assert!(status_of(io.read(9, 0, 2, &mut buf)).same_code(status::INVALID_NAMESPACE));
    assert!(status_of(io.write(3, 0, 2, &buf, false)).same_code(status::NAMESPACE_WRITE_PROTECTED));
    assert!(status_of(io.write_zeroes(3, 0, 2)).same_code(status::NAMESPACE_WRITE_PROTECTED));
    // Hand-made commands: wrong SGL kinds and lengths, PRPs, unknown opcodes.
    let rw = |opcode: u8, dptr: SglDesc, flags: u8| {
        let mut s: Sqe = nvmfd_nvme::host::command(0);
        s.opcode = opcode;
        s.flags = flags;
        s.nsid = U32::new(1);
        s.cdw12 = U32::new(1); // 2 blocks
        s.dptr = dptr;
        s
    };
    let l = io.transport();
    let send = |l: &mut Loopback, s: Sqe, icd: &[u8]| {
        let mut c = s.as_bytes().to_vec();
        c.extend_from_slice(icd);
        l.send_capsule(&c).unwrap().unwrap().status()
    };
    let (addr, key) = l.register_host_memory(vec![0u8; 1024]);
    assert!(
        send(l, rw(2, SglDesc::in_capsule(0, 1024), 0x40), &[0u8; 1024])
            .same_code(status::INVALID_FIELD),
        "a read into the capsule: Invalid Field, as the kernel target answers"
    );
    let (addr, key) = {
        let _ = (addr, key);
        l.register_host_memory(vec![0u8; 1024])
    };
    assert!(
        send(l, rw(2, SglDesc::keyed(addr, 512, key, false), 0x40), &[])
            .same_code(status::DATA_SGL_LENGTH_INVALID)
    );
    assert!(
        send(l, rw(2, SglDesc::keyed(addr, 1024, key, false), 0x00), &[])
            .same_code(status::INVALID_FIELD),
        "PRP"
    );
    assert!(
        send(l, rw(1, SglDesc::in_capsule(0, 1024), 0x40), &[0u8; 512])
            .same_code(status::DATA_SGL_LENGTH_INVALID),
        "short capsule"
    );
    assert!(send(
        l,
        rw(1, SglDesc::in_capsule(4096, 1024), 0x40),
        &[0u8; 1024]
    )
    .same_code(status::SGL_OFFSET_INVALID));
    let mut bad_type = SglDesc::keyed(addr, 1024, key, false);
    bad_type.id = 0x30; // last segment
    assert!(send(l, rw(2, bad_type, 0x40), &[]).same_code(status::SGL_DESCRIPTOR_TYPE_INVALID));
    assert!(send(l, rw(0x7E, SglDesc::keyed(0, 0, 0, false), 0x40), &[])
        .same_code(status::INVALID_OPCODE));
    // An opcode the I/O command set lacks is an invalid opcode whatever its NSID (here an
    // admin opcode, Keep Alive, with NSID 0).
    let mut keep_alive = rw(0x18, SglDesc::keyed(0, 0, 0, false), 0x40);
    keep_alive.nsid = U32::new(0);
    assert!(send(l, keep_alive, &[]).same_code(status::INVALID_OPCODE));
    let mut fused = rw(2, SglDesc::keyed(addr, 1024, key, false), 0x41);
    fused.flags = 0x41;
    assert!(
        send(l, fused, &[]).same_code(status::INVALID_FIELD),
        "fused"
    );
    assert!(
        send(
            l,
            rw(1, SglDesc::in_capsule(0, 8192), 0x40),
            &vec![0u8; 8192]
        )
        .same_code(status::DATA_SGL_LENGTH_INVALID),
        "more in-capsule data than offered"
    );
    // An SGL longer than the data (Identify reports no SGLS bit 18): refused, in the capsule
    // or keyed, and nothing written.
    let before = {
        let mut b = vec![0u8; 1024];
        io.read(1, 0, 2, &mut b).unwrap();
        b
    };
    let l = io.transport();
    assert!(
        send(
            l,
            rw(1, SglDesc::in_capsule(0, 2048), 0x40),
            &[0x5au8; 2048]
        )
        .same_code(status::DATA_SGL_LENGTH_INVALID),
        "an in-capsule SGL longer than the data"
    );
    let (addr, key) = l.register_host_memory(vec![0x5au8; 2048]);
    assert!(
        send(l, rw(1, SglDesc::keyed(addr, 2048, key, false), 0x40), &[])
            .same_code(status::DATA_SGL_LENGTH_INVALID),
        "a keyed SGL longer than the data"
    );
    let mut after = vec![0u8; 1024];
    io.read(1, 0, 2, &mut after).unwrap();
    assert!(after == before, "a refused write wrote");
    let l = io.transport();
    // Over fabrics every command's PSDT is 01b: PRPs (00b), a metadata SGL (10b) and the
    // reserved 11b are Invalid Field, for commands with data and without (as the kernel
    // target answers).
    for flags in [0x00, 0x80, 0xC0] {
        let (addr, key) = l.register_host_memory(vec![0u8; 1024]);
        let st = send(l, rw(2, SglDesc::keyed(addr, 1024, key, false), flags), &[]);
        assert!(
            st.same_code(status::INVALID_FIELD),
            "read, flags {flags:#x}: {st:?}"
        );
        let st = send(l, rw(0, SglDesc::keyed(0, 0, 0, false), flags), &[]);
        assert!(
            st.same_code(status::INVALID_FIELD),
            "flush, flags {flags:#x}: {st:?}"
        );
    }
    // A command without data whose SGL describes some: Data SGL Length Invalid.
    let (addr, key) = l.register_host_memory(vec![0u8; 1024]);
    for (what, opcode) in [("flush", 0x00), ("write zeroes", 0x08)] {
        let st = send(
            l,
            rw(opcode, SglDesc::keyed(addr, 1024, key, false), 0x40),
            &[],
        );
        assert!(
            st.same_code(status::DATA_SGL_LENGTH_INVALID),
            "{what}: {st:?}"
        );
        let st = send(
            l,
            rw(opcode, SglDesc::in_capsule(0, 512), 0x40),
            &[0u8; 512],
        );
        assert!(
            st.same_code(status::DATA_SGL_LENGTH_INVALID),
            "{what}, in capsule: {st:?}"
        );
        assert!(send(l, rw(opcode, SglDesc::keyed(0, 0, 0, false), 0x40), &[]).is_success());
    }
    // A connect on a connected queue is a sequence error; the queue still works.
    let mut again: Sqe = nvmfd_nvme::host::command(0);
    again.opcode = 0x7F;
    again.flags = 0x40;
    again.nsid = U32::new(u32::from(wire::fctype::CONNECT));
    assert!(send(l, again, &[]).same_code(status::COMMAND_SEQUENCE_ERROR));
    let mut back = vec![0u8; 512];
    io.read(1, 0, 1, &mut back).unwrap();
}

/// An admin command whose host buffer is shorter than what it returns (Identify's 4096
/// bytes, a log page's NUMD, Host Behavior Support's 512) is refused with Data SGL Length
/// Invalid, as the kernel target refuses it, rather than answered in part with success; a
/// short Changed Namespace List read clears nothing. Admin commands without data refuse an
/// SGL that describes some.
#[test]
fn admin_commands_refuse_a_host_buffer_shorter_than_their_data() {
    let w = world();
    let (mut a, _ios) = w.controller(1);
    let send = |l: &mut Loopback, s: Sqe| l.send_capsule(s.as_bytes()).unwrap().unwrap().status();
    let with = |opcode: u8, cdw10: u32, dptr: SglDesc| {
        let mut s = nvmfd_nvme::host::command(opcode);
        s.cid = U16::new(0x33);
        s.cdw10 = U32::new(cdw10);
        s.dptr = dptr;
        s
    };
    let l = a.transport();
    for len in [0u32, 8, 4095] {
        let (addr, key) = l.register_host_memory(vec![0xEEu8; 4096]);
        let st = send(
            l,
            with(
                wire::admin_opcode::IDENTIFY,
                1,
                SglDesc::keyed(addr, len, key, false),
            ),
        );
        assert!(
            st.same_code(status::DATA_SGL_LENGTH_INVALID),
            "Identify into {len} bytes: {st:?}"
        );
    }
    // Nor longer (Identify reports no SGLS bit 18): a buffer as long as the structure is
    // served.
    let (addr, key) = l.register_host_memory(vec![0u8; 8192]);
    for (len, served) in [(4097, false), (8192, false), (4096, true)] {
        let st = send(
            l,
            with(
                wire::admin_opcode::IDENTIFY,
                1,
                SglDesc::keyed(addr, len, key, false),
            ),
        );
        if served {
            assert!(st.is_success(), "Identify into {len} bytes: {st:?}");
        } else {
            assert!(
                st.same_code(status::DATA_SGL_LENGTH_INVALID),
                "Identify into {len} bytes: {st:?}"
            );
        }
    }
    let (addr, key) = l.register_host_memory(vec![0u8; 512]);
    let st = send(
        l,
        with(
            wire::admin_opcode::GET_FEATURES,
            u32::from(wire::feature::HOST_BEHAVIOR_SUPPORT),
            SglDesc::keyed(addr, 256, key, false),
        ),
    );
    assert!(
        st.same_code(status::DATA_SGL_LENGTH_INVALID),
        "Host Behavior Support into 256 bytes: {st:?}"
    );
    // Keep Alive and an Asynchronous Event Request with data described: refused.
    for opcode in [
        wire::admin_opcode::KEEP_ALIVE,
        wire::admin_opcode::ASYNC_EVENT_REQUEST,
    ] {
        let (addr, key) = l.register_host_memory(vec![0u8; 512]);
        let st = send(l, with(opcode, 0, SglDesc::keyed(addr, 512, key, false)));
        assert!(
            st.same_code(status::DATA_SGL_LENGTH_INVALID),
            "opcode {opcode:#x}: {st:?}"
        );
    }
    // The Changed Namespace List (4096 bytes, NUMD 1023) read into 4 bytes: refused, and the
    // list is still there for a read that fits.
    w.target.namespace_changed(SUB, 2);
    let log = |numd: u32| u32::from(wire::log_page::CHANGED_NAMESPACES) | numd << 16;
    let (addr, key) = l.register_host_memory(vec![0u8; 4]);
    let st = send(
        l,
        with(
            wire::admin_opcode::GET_LOG_PAGE,
            log(1023),
            SglDesc::keyed(addr, 4, key, false),
        ),
    );
    assert!(st.same_code(status::DATA_SGL_LENGTH_INVALID), "{st:?}");
    // Read in two pieces: the first leaves the list for the second; reading it to its end
    // clears it.
    w.target.namespace_changed(SUB, 3);
    let first = a
        .get_log_page(wire::log_page::CHANGED_NAMESPACES, 0, 4)
        .unwrap();
    assert_eq!(first, 2u32.to_le_bytes());
    let rest = a
        .get_log_page(wire::log_page::CHANGED_NAMESPACES, 4, 4092)
        .unwrap();
    assert_eq!(&rest[..8], &[3, 0, 0, 0, 0, 0, 0, 0]);
    let after = a
        .get_log_page(wire::log_page::CHANGED_NAMESPACES, 0, 4096)
        .unwrap();
    assert!(
        after.iter().all(|&b| b == 0),
        "read to its end, the list starts over"
    );
}

#[test]
fn a_list_of_keyed_descriptors_in_the_capsule_moves_data_in_pieces_and_bad_lists_are_refused() {
    let w = world();
    let (_a, mut ios) = w.controller(1);
    let io = &mut ios[0];
    let rw = |opcode: u8, dptr: SglDesc, blocks: u32| {
        let mut s: Sqe = nvmfd_nvme::host::command(0);
        s.opcode = opcode;
        s.flags = 0x40;
        s.nsid = U32::new(1);
        s.cdw10 = U32::new(8);
        s.cdw12 = U32::new(blocks - 1);
        s.dptr = dptr;
        s
    };
    let l = io.transport();
    let send = |l: &mut Loopback, s: Sqe, icd: &[u8]| {
        let mut c = s.as_bytes().to_vec();
        c.extend_from_slice(icd);
        l.send_capsule(&c).unwrap().unwrap().status()
    };
    // 4 blocks in three pieces of host memory, listed out of address order.
    let data = pattern(7, 2048);
    let mut pieces = Vec::new();
    let mut list = Vec::new();
    for (from, len) in [(0usize, 512usize), (512, 1024), (1536, 512)] {
        let (addr, key) = l.register_host_memory(data[from..from + len].to_vec());
        pieces.push((addr, key, len));
        list.extend_from_slice(SglDesc::keyed(addr, len as u32, key, false).as_bytes());
    }
    let seg = SglDesc::last_segment(0, 3);
    assert!(
        send(l, rw(1, seg, 4), &list).is_success(),
        "write from three pieces"
    );
    let mut back = vec![0u8; 2048];
    io.read(1, 8, 4, &mut back).unwrap();
    assert_eq!(back, data, "the pieces were written in list order");
    // Read into three fresh pieces, then compare each.
    let l = io.transport();
    let mut list = Vec::new();
    let mut dests = Vec::new();
    for len in [1024usize, 512, 512] {
        let (addr, key) = l.register_host_memory(vec![0u8; len]);
        dests.push(key);
        list.extend_from_slice(SglDesc::keyed(addr, len as u32, key, false).as_bytes());
    }
    assert!(
        send(l, rw(2, seg, 4), &list).is_success(),
        "read into three pieces"
    );
    let mut got = Vec::new();
    for key in dests {
        got.extend_from_slice(l.host_memory(key).unwrap());
    }
    assert_eq!(got, data);
    // Bad lists: each gets its status, none moves data.
    let (addr, key) = l.register_host_memory(vec![0u8; 2048]);
    let one = SglDesc::keyed(addr, 2048, key, false);
    let cases: Vec<(&str, SglDesc, Vec<u8>, Status)> = vec![
        (
            "list past the capsule",
            SglDesc::last_segment(0, 2),
            one.as_bytes().to_vec(),
            status::DATA_SGL_LENGTH_INVALID,
        ),
        (
            "unaligned offset",
            SglDesc::last_segment(8, 1),
            vec![0u8; 32],
            status::SGL_OFFSET_INVALID,
        ),
        (
            "offset past the capsule",
            SglDesc::last_segment(64, 1),
            vec![0u8; 32],
            status::SGL_OFFSET_INVALID,
        ),
        (
            "17 descriptors",
            SglDesc::last_segment(0, 17),
            one.as_bytes().repeat(17),
            status::SGL_DESCRIPTOR_COUNT_INVALID,
        ),
        (
            "an in-capsule descriptor in the list",
            SglDesc::last_segment(0, 1),
            SglDesc::in_capsule(0, 2048).as_bytes().to_vec(),
            status::SGL_DESCRIPTOR_TYPE_INVALID,
        ),
        (
            "invalidation in a list",
            SglDesc::last_segment(0, 1),
            SglDesc::keyed(addr, 2048, key, true).as_bytes().to_vec(),
            status::SGL_DESCRIPTOR_TYPE_INVALID,
        ),
        (
            "pieces shorter than the data",
            SglDesc::last_segment(0, 1),
            SglDesc::keyed(addr, 1024, key, false).as_bytes().to_vec(),
            status::DATA_SGL_LENGTH_INVALID,
        ),
    ];
    for (what, seg, icd, want) in cases {
        assert!(send(l, rw(1, seg, 4), &icd).same_code(want), "{what}");
    }
    let mut back2 = vec![0u8; 2048];
    io.read(1, 8, 4, &mut back2).unwrap();
    assert_eq!(back2, data, "no bad list wrote anything");
}

#[test]
fn a_bad_key_or_a_short_capsule_closes_the_connection() {
    let w = world();
    let (_a, mut ios) = w.controller(2);
    let l = ios[0].transport();
    let (addr, key) = l.register_host_memory(vec![0u8; 1024]);
    let mut s: Sqe = nvmfd_nvme::host::command(0);
    s.opcode = 2;
    s.flags = 0x40;
    s.nsid = U32::new(1);
    s.cdw12 = U32::new(1);
    s.dptr = SglDesc::keyed(addr, 1024, key ^ 1, false);
    let r = l.send_capsule(s.as_bytes());
    assert!(
        matches!(r, Err(HostError::Transport(ref e)) if e.contains("remote access error")),
        "{r:?}"
    );
    assert!(l.closed().is_some());
    s.dptr = SglDesc::keyed(addr + 512, 1024, key, false);
    let l2 = ios[1].transport();
    let (addr2, key2) = l2.register_host_memory(vec![0u8; 1024]);
    s.dptr = SglDesc::keyed(addr2 + 512, 1024, key2, false);
    assert!(
        l2.send_capsule(s.as_bytes()).is_err(),
        "past the end of the host buffer"
    );
    let mut l3 = w.link(0, 31);
    assert!(matches!(
        l3.send_capsule(&[0u8; 40]),
        Err(HostError::Transport(_))
    ));
}

#[test]
fn commands_before_connect_or_enable_are_sequence_errors() {
    let w = world();
    let mut l = w.link(0, 31);
    let mut s: Sqe = nvmfd_nvme::host::command(0);
    s.opcode = wire::admin_opcode::KEEP_ALIVE;
    let c = l.send_capsule(s.as_bytes()).unwrap().unwrap();
    assert!(c.status().same_code(status::COMMAND_SEQUENCE_ERROR));
    let mut a = w.admin(&host(1), SUB).unwrap();
    assert!(
        status_of(a.keep_alive()).same_code(status::COMMAND_SEQUENCE_ERROR),
        "not enabled yet"
    );
    let io = IoQueue::connect(w.link(1, 127), &host(1), SUB, a.cntlid, 1, 127);
    assert!(status_of(io).same_code(status::COMMAND_SEQUENCE_ERROR));
    a.enable().unwrap();
    a.keep_alive().unwrap();
}

#[test]
fn properties_say_what_the_controller_is() {
    let w = world();
    let mut a = w.admin(&host(1), SUB).unwrap();
    let cap = a.property_get(wire::property::CAP, true).unwrap();
    assert_eq!(cap & 0xFFFF, 127, "MQES");
    assert_eq!(cap >> 37 & 1, 1, "NVM command set");
    assert_eq!((cap >> 48) & 0xF, 0, "MPSMIN 4 KiB");
    assert_eq!(
        a.property_get(wire::property::VS, false).unwrap(),
        u64::from(NVME_VERSION)
    );
    assert_eq!(a.property_get(wire::property::CSTS, false).unwrap(), 0);
    assert!(status_of(a.property_get(0x40, false)).same_code(status::INVALID_FIELD));
    assert!(
        status_of(a.property_get(wire::property::CAP, false)).same_code(status::INVALID_FIELD),
        "CAP is 8 bytes"
    );
    assert!(
        status_of(a.property_set(wire::property::CSTS, 1)).same_code(status::INVALID_FIELD),
        "CSTS is read-only"
    );
    // Enabling with a wrong entry size reports a fatal status.
    a.property_set(wire::property::CC, 1 | (7 << 16) | (4 << 20))
        .unwrap();
    assert_eq!(
        a.property_get(wire::property::CSTS, false).unwrap() & 0x3,
        0x2,
        "CFS"
    );
    // An arbitration mechanism CAP.AMS does not offer (weighted round robin): fatal too,
    // as the kernel target answers (it was enabled).
    let mut a = w.admin(&host(2), SUB).unwrap();
    a.property_set(wire::property::CC, 1 | (6 << 16) | (4 << 20) | (1 << 11))
        .unwrap();
    assert_eq!(
        a.property_get(wire::property::CSTS, false).unwrap() & 0x3,
        0x2,
        "CFS for AMS 001b"
    );
}

/// Set Features takes only what the controller offers: Async Event Configuration bits
/// beyond the critical warnings and what OAES names are an Invalid Field (they were stored
/// and read back as enabled), and
/// arbitration, fixed, is Feature Not Changeable (it was an Invalid Field, against what
/// Get Features SEL 011b says). Identify's FRMW says one read-only slot, as the Firmware
/// Slot log reports.
#[test]
fn set_features_refuses_what_the_controller_does_not_offer() {
    let w = world();
    let (mut a, _ios) = w.controller(1);
    assert!(
        status_of(a.set_feature(wire::feature::ASYNC_EVENT_CONFIG, 1 << 8 | 1 << 9))
            .same_code(status::INVALID_FIELD)
    );
    assert_eq!(a.get_feature(wire::feature::ASYNC_EVENT_CONFIG).unwrap(), 0);
    // What an SPDK host asks for: the critical warnings and Namespace Attribute Notices.
    a.set_feature(wire::feature::ASYNC_EVENT_CONFIG, 0x11F)
        .unwrap();
    assert!(status_of(a.set_feature(wire::feature::ARBITRATION, 0))
        .same_code(status::FEATURE_NOT_CHANGEABLE));
    assert_eq!(a.identify_controller().unwrap().frmw, 0x3);
    let mut d = w.admin(&host(3), DISCOVERY_NQN).unwrap();
    d.enable().unwrap();
    assert!(
        status_of(d.set_feature(wire::feature::ASYNC_EVENT_CONFIG, 1 << 8))
            .same_code(status::INVALID_FIELD),
        "no Namespace Attribute Notices on discovery"
    );
    d.set_feature(wire::feature::ASYNC_EVENT_CONFIG, 1 << 31)
        .unwrap();
}

#[test]
fn features_negotiate_queues_keep_alive_and_events() {
    let w = world();
    let mut a = w.admin(&host(1), SUB).unwrap();
    a.enable().unwrap();
    assert_eq!(
        a.set_queue_count(1000).unwrap(),
        64,
        "capped at max_io_queues"
    );
    assert_eq!(
        a.get_feature(wire::feature::NUMBER_OF_QUEUES).unwrap(),
        63 | 63 << 16
    );
    assert_eq!(
        a.get_feature(wire::feature::KEEP_ALIVE_TIMER).unwrap(),
        5000,
        "from Connect"
    );
    a.set_feature(wire::feature::KEEP_ALIVE_TIMER, 10).unwrap();
    assert_eq!(
        a.get_feature(wire::feature::KEEP_ALIVE_TIMER).unwrap(),
        1000,
        "raised to the minimum"
    );
    // Longer than the maximum: refused, the timer as it was (a shorter one than asked for
    // would end a host that keeps to its own).
    let max = u32::try_from(Limits::default().kato_max.as_millis()).unwrap();
    assert!(
        status_of(a.set_feature(wire::feature::KEEP_ALIVE_TIMER, max + 1))
            .same_code(status::KEEP_ALIVE_TIMEOUT_INVALID)
    );
    assert_eq!(
        a.get_feature(wire::feature::KEEP_ALIVE_TIMER).unwrap(),
        1000
    );
    a.set_feature(wire::feature::KEEP_ALIVE_TIMER, max).unwrap();
    assert_eq!(a.get_feature(wire::feature::KEEP_ALIVE_TIMER).unwrap(), max);
    a.keep_alive().unwrap();
    // No timer (KATO 0): a Keep Alive has nothing to keep alive and is refused, as the kernel
    // target refuses it; a controller connected without one refuses it from the start.
    a.set_feature(wire::feature::KEEP_ALIVE_TIMER, 0).unwrap();
    assert!(status_of(a.keep_alive()).same_code(status::KEEP_ALIVE_TIMEOUT_INVALID));
    a.set_feature(wire::feature::KEEP_ALIVE_TIMER, max).unwrap();
    a.keep_alive().unwrap();
    let mut no_timer = AdminQueue::connect(w.link(0, 31), &host(2), SUB, 31, 0).unwrap();
    no_timer.enable().unwrap();
    assert!(status_of(no_timer.keep_alive()).same_code(status::KEEP_ALIVE_TIMEOUT_INVALID));
    a.set_feature(wire::feature::ASYNC_EVENT_CONFIG, 1 << 8)
        .unwrap();
    assert_eq!(
        a.get_feature(wire::feature::ASYNC_EVENT_CONFIG).unwrap(),
        1 << 8
    );
    assert!(status_of(a.get_feature(0x80)).same_code(status::INVALID_FIELD));
    // Supported capabilities (SEL 011b): changeable as Set Features takes it; a feature the
    // controller lacks is an Invalid Field there too.
    for (fid, changeable) in [
        (wire::feature::NUMBER_OF_QUEUES, true),
        (wire::feature::KEEP_ALIVE_TIMER, true),
        (wire::feature::ASYNC_EVENT_CONFIG, true),
        (wire::feature::VOLATILE_WRITE_CACHE, false),
        (wire::feature::ARBITRATION, false),
    ] {
        assert_eq!(
            a.feature_capabilities(fid).unwrap(),
            u32::from(changeable) << 2,
            "feature {fid:#x}"
        );
    }
    assert!(status_of(a.feature_capabilities(0x80)).same_code(status::INVALID_FIELD));
    // Select 100b to 111b are reserved: Invalid Field (they were answered as the current
    // value); default and saved (nothing is saveable) report the current value.
    for sel in 4..8 {
        let got = a.get_feature_as(wire::feature::ASYNC_EVENT_CONFIG, sel);
        assert!(status_of(got).same_code(status::INVALID_FIELD), "SEL {sel}");
    }
    for sel in 1..3 {
        let got = a.get_feature_as(wire::feature::ASYNC_EVENT_CONFIG, sel);
        assert_eq!(got.unwrap(), 1 << 8, "SEL {sel}");
    }
    assert!(
        status_of(a.set_feature(wire::feature::NUMBER_OF_QUEUES, 0xFFFF))
            .same_code(status::INVALID_FIELD)
    );
    let mut s: Sqe = nvmfd_nvme::host::command(0);
    s.opcode = wire::admin_opcode::SET_FEATURES;
    s.cdw10 = U32::new(u32::from(wire::feature::ASYNC_EVENT_CONFIG) | 1 << 31);
    assert!(status_of(a.raw(s, DataDir::None)).same_code(status::FEATURE_NOT_SAVEABLE));
    s.opcode = wire::admin_opcode::ABORT;
    assert_eq!(
        a.raw(s, DataDir::None).unwrap().dw0.get() & 1,
        1,
        "not aborted"
    );
    s.opcode = 0x80; // Format NVM: not supported
    assert!(status_of(a.raw(s, DataDir::None)).same_code(status::INVALID_OPCODE));
}

#[test]
fn async_events_are_held_until_a_namespace_changes() {
    let w = world();
    let (mut a, _ios) = w.controller(1);
    a.set_feature(wire::feature::ASYNC_EVENT_CONFIG, 1 << 8)
        .unwrap();
    let l = a.transport();
    for cid in 100..100 + AER_LIMIT as u16 {
        assert!(
            l.send_capsule(aer(cid).as_bytes()).unwrap().is_none(),
            "held"
        );
    }
    let over = l.send_capsule(aer(200).as_bytes()).unwrap().unwrap();
    assert!(over.status().same_code(status::AER_LIMIT_EXCEEDED));
    assert!(l.poll_events().is_empty());
    w.target.namespace_changed(SUB, 2);
    let ev = l.poll_events();
    assert_eq!(ev.len(), 1);
    assert_eq!((ev[0].cid.get(), ev[0].dw0.get()), (100, 0x0004_0002));
    let log = a
        .get_log_page(wire::log_page::CHANGED_NAMESPACES, 0, 4096)
        .unwrap();
    assert_eq!(&log[..8], &[2, 0, 0, 0, 0, 0, 0, 0]);
    let log = a
        .get_log_page(wire::log_page::CHANGED_NAMESPACES, 0, 4096)
        .unwrap();
    assert_eq!(&log[..4], &[0, 0, 0, 0], "reading the log clears it");
}

/// The Changed Namespace List is in increasing NSID order; a read that fails (an offset past
/// the list) leaves it and its event as they were; a read that clears it also takes back its
/// event not yet reported, so no AER completes later for a list already read.
#[test]
fn the_changed_namespace_list_is_ordered_and_cleared_only_by_a_read() {
    let w = world();
    let (mut a, _ios) = w.controller(1);
    a.set_feature(wire::feature::ASYNC_EVENT_CONFIG, 1 << 8)
        .unwrap();
    // No AER held: the event waits.
    w.target.namespace_changed(SUB, 3);
    w.target.namespace_changed(SUB, 1);
    let past = a.get_log_page(wire::log_page::CHANGED_NAMESPACES, 8192, 4);
    assert!(status_of(past).same_code(status::INVALID_FIELD));
    let log = a
        .get_log_page(wire::log_page::CHANGED_NAMESPACES, 0, 4096)
        .unwrap();
    assert_eq!(&log[..12], &[1, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
    let mut s: Sqe = nvmfd_nvme::host::command(0);
    s.opcode = wire::admin_opcode::ASYNC_EVENT_REQUEST;
    s.cid = U16::new(300);
    let l = a.transport();
    assert!(
        l.send_capsule(s.as_bytes()).unwrap().is_none(),
        "held: the event went with the read"
    );
    assert!(l.poll_events().is_empty());
    // The next change raises it again.
    w.target.namespace_changed(SUB, 2);
    let ev = a.transport().poll_events();
    assert_eq!(ev.len(), 1);
    assert_eq!((ev[0].cid.get(), ev[0].dw0.get()), (300, 0x0004_0002));
}

/// A Get Log Page of the Changed Namespace List that fails on its data transfer (a PRP, or an
/// SGL the target cannot send to) does not clear the list: the host never got it.
#[test]
fn a_changed_namespace_list_read_that_fails_on_its_transfer_leaves_the_list() {
    let w = world();
    let (mut a, _ios) = w.controller(1);
    w.target.namespace_changed(SUB, 2);
    let mut s: Sqe = nvmfd_nvme::host::command(0);
    s.opcode = wire::admin_opcode::GET_LOG_PAGE;
    s.cid = U16::new(400);
    s.cdw10 = U32::new(u32::from(wire::log_page::CHANGED_NAMESPACES) | (1023 << 16));
    // PSDT 0: PRPs, which a fabrics controller does not take.
    let c = a.transport().send_capsule(s.as_bytes()).unwrap().unwrap();
    assert!(!c.status().is_success());
    let log = a
        .get_log_page(wire::log_page::CHANGED_NAMESPACES, 0, 4096)
        .unwrap();
    assert_eq!(
        &log[..8],
        &[2, 0, 0, 0, 0, 0, 0, 0],
        "the list went with the failed read"
    );
}

/// AERs held when the host resets the controller (CC.EN to 0, admin queue kept) end with the
/// reset, without a completion (the base specification has them aborted): the host takes
/// their command IDs as free. Before, they stayed held: the next event completed the oldest,
/// an ID the host may have given another command by then (here its Property Get of CSTS
/// while it waited for the reset), while its new AERs were refused (the limit counted the
/// old ones) and never heard of the event.
#[test]
fn aers_held_at_a_reset_end_with_it_and_the_new_ones_hear_the_next_event() {
    let w = world();
    let (mut a, ios) = w.controller(1);
    // Four AERs from `first`, all held (none refused).
    let arm_four = |a: &mut AdminQueue<Loopback>, first: u16| {
        for cid in first..first + 4 {
            let answer = a.transport().send_capsule(aer(cid).as_bytes()).unwrap();
            assert!(answer.is_none(), "AER {cid} not held: {answer:?}");
        }
    };
    a.set_feature(wire::feature::ASYNC_EVENT_CONFIG, 1 << 8)
        .unwrap();
    arm_four(&mut a, 100);
    a.property_set(wire::property::CC, 0).unwrap();
    assert_eq!(a.transport().queue_mut().take_ended_aers(), 4);
    assert_eq!(a.transport().queue_mut().take_ended_aers(), 0, "taken once");
    // An event while the controller is disabled: no command of before the reset answers it.
    w.target.namespace_changed(SUB, 2);
    assert!(
        a.transport().poll_events().is_empty(),
        "an ended AER completed"
    );
    drop(ios);
    assert_eq!(a.property_get(wire::property::CSTS, false).unwrap() & 1, 0);
    a.enable().unwrap();
    a.set_feature(wire::feature::ASYNC_EVENT_CONFIG, 1 << 8)
        .unwrap();
    arm_four(&mut a, 200);
    // The change of before is reported to the new AERs, and the next one too (masked until
    // the Changed Namespace List is read, it joins the list).
    let ev = a.transport().poll_events();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!((ev[0].cid.get(), ev[0].dw0.get()), (200, 0x0004_0002));
    w.target.namespace_changed(SUB, 2);
    assert!(a.transport().poll_events().is_empty());
}

/// A completion reports the SQ head when it is made: a Dataset Management whose ranges are
/// fetched completes after later commands did, and reported the head from when it arrived,
/// older than theirs (the head went backwards).
#[test]
fn a_completion_after_a_data_fetch_reports_the_head_of_its_time() {
    let w = world();
    let (_a, mut ios) = w.controller(1);
    let l = ios[0].transport();
    let (addr, key) = l.register_host_memory(vec![0u8; 16]);
    let mut dsm: Sqe = nvmfd_nvme::host::command(0);
    dsm.opcode = wire::io_opcode::DATASET_MANAGEMENT;
    dsm.flags = 0x40;
    dsm.cid = U16::new(0x51);
    dsm.nsid = U32::new(1);
    // One range, no attribute (nothing to deallocate: answered once the ranges are here).
    dsm.dptr = SglDesc::keyed(addr, 16, key, false);
    let now = l.now;
    let Action::Fetch { cmd, .. } = l.queue_mut().handle(dsm.as_bytes(), now) else {
        panic!("the ranges are fetched");
    };
    // A later command completes meanwhile, with a later head.
    let mut flush: Sqe = nvmfd_nvme::host::command(0);
    flush.opcode = wire::io_opcode::FLUSH;
    flush.flags = 0x40;
    flush.cid = U16::new(0x52);
    flush.nsid = U32::new(1);
    let later = l.send_capsule(flush.as_bytes()).unwrap().unwrap();
    let Action::Respond { cqe, .. } = l.queue_mut().data_arrived(cmd, &[0u8; 16], now) else {
        panic!("answered");
    };
    assert!(cqe.status().is_success());
    assert_eq!(
        cqe.sqhd.get(),
        later.sqhd.get(),
        "the DSM's completion went back to its arrival's head"
    );
}

/// A shutdown's flush still running when the host resets and enables the controller again:
/// its end must not report SHST complete (nor a failure's CFS) on the controller enabled
/// since, whose I/O queues would then be refused until another reset.
#[test]
fn a_shutdown_flush_ending_after_a_reset_leaves_the_enabled_controller_alone() {
    let w = world();
    let mut a = w.admin(&host(1), SUB).unwrap();
    a.enable().unwrap();
    a.set_queue_count(1).unwrap();
    let flush = shutdown_held(&mut a, 0x61);
    // Reset and enabled again while the flush runs; then it ends.
    a.property_set(wire::property::CC, 0).unwrap();
    a.enable().unwrap();
    a.transport().queue_mut().io_done(&flush, Ok(0));
    let csts = a.property_get(wire::property::CSTS, false).unwrap();
    assert_eq!(csts & 0xF, 1, "ready, not shut down: CSTS {csts:#x}");
    a.set_queue_count(1).unwrap();
    IoQueue::connect(w.link(1, 31), &host(1), SUB, a.cntlid, 1, 31).unwrap();
}

/// A shutdown asked of a controller not enabled (CC.EN 0, SHN set), then an enable while its
/// flush runs: the flush's end must not report SHST complete on the controller enabled
/// since. Before, it did (the enable began no new epoch), and its I/O queues were refused
/// (Command Sequence Error) until another reset.
#[test]
fn a_shutdown_flush_of_a_disabled_controller_ending_after_its_enable_leaves_it_alone() {
    let w = world();
    let mut a = w.admin(&host(1), SUB).unwrap();
    let flush = shutdown_held(&mut a, 0x65);
    a.enable().unwrap();
    a.transport().queue_mut().io_done(&flush, Ok(0));
    let csts = a.property_get(wire::property::CSTS, false).unwrap();
    assert_eq!(csts & 0xF, 1, "ready, not shut down: CSTS {csts:#x}");
    a.set_queue_count(1).unwrap();
    IoQueue::connect(w.link(1, 31), &host(1), SUB, a.cntlid, 1, 31).unwrap();
}

/// Asks `a`'s controller for a normal shutdown; returns its flush of every namespace,
/// which the test ends when it likes (`io_done`).
fn shutdown_held(a: &mut AdminQueue<Loopback>, cid: u16) -> nvmfd_nvme::IoRequest {
    let cc = a.property_get(wire::property::CC, false).unwrap() as u32;
    let mut shn: Sqe = nvmfd_nvme::host::command(0);
    shn.opcode = wire::admin_opcode::FABRICS;
    shn.cid = U16::new(cid);
    let b = shn.as_mut_bytes();
    b[4] = wire::fctype::PROPERTY_SET;
    b[44..48].copy_from_slice(&wire::property::CC.to_le_bytes());
    b[48..56].copy_from_slice(&u64::from(cc | 1 << 14).to_le_bytes());
    let now = a.transport().now;
    let Action::Io(flush) = a.transport().queue_mut().handle(shn.as_bytes(), now) else {
        panic!("the shutdown flushes its namespaces");
    };
    flush
}

/// A shutdown's flush keeps its controller alive only while that shutdown lasts: the flush
/// of a shutdown a reset ended keeps nothing alive, and its end does not take the keep-alive
/// of a later shutdown's flush. Before, the first flush's end cleared the second's, and a
/// reset during a flush left the controller kept alive by it.
#[test]
fn a_shutdown_flush_keeps_alive_only_its_own_shutdown() {
    let w = world();
    let kato = Duration::from_millis(5000);
    let expired_in_two_timeouts = |w: &World| {
        let t0 = Instant::now();
        w.target.expire_keep_alives(t0);
        w.target.expire_keep_alives(t0 + kato * 2).len()
    };
    // Reset and enabled again while the first shutdown flushes; a second shutdown flushes,
    // and the first flush ends.
    let (mut a, ios) = w.controller(1);
    drop(ios);
    let first = shutdown_held(&mut a, 0x62);
    a.property_set(wire::property::CC, 0).unwrap();
    a.enable().unwrap();
    let second = shutdown_held(&mut a, 0x63);
    a.transport().queue_mut().io_done(&first, Ok(0));
    assert_eq!(
        expired_in_two_timeouts(&w),
        0,
        "the second shutdown's flush did not keep its controller alive"
    );
    a.transport().queue_mut().io_done(&second, Ok(0));
    let csts = a.property_get(wire::property::CSTS, false).unwrap();
    assert_eq!((csts >> 2) & 3, 2, "SHST complete: CSTS {csts:#x}");
    drop(a);
    // Reset while a shutdown flushes: the timer runs again.
    let (mut b, ios) = w.controller(1);
    drop(ios);
    let flush = shutdown_held(&mut b, 0x64);
    b.property_set(wire::property::CC, 0).unwrap();
    assert_eq!(
        expired_in_two_timeouts(&w),
        1,
        "a flush of a shutdown a reset ended kept its controller alive"
    );
    b.transport().queue_mut().io_done(&flush, Ok(0));
}

/// A host that disables its controller and asks for a shutdown in one write (EN 1 to 0
/// and SHN normal): the shutdown follows the reset, flushed and reported complete, as the
/// kernel target handles both. It was dropped: SHST stayed 00b, no flush ran.
#[test]
fn a_shutdown_asked_with_the_reset_in_one_write_is_made() {
    let w = world();
    let mut a = w.admin(&host(1), SUB).unwrap();
    a.enable().unwrap();
    let cc = a.property_get(wire::property::CC, false).unwrap() as u32;
    a.property_set(wire::property::CC, (cc & !1) | 1 << 14)
        .unwrap();
    let csts = a.property_get(wire::property::CSTS, false).unwrap();
    assert_eq!(csts & 1, 0, "not ready: CSTS {csts:#x}");
    assert_eq!((csts >> 2) & 0x3, 2, "SHST complete: CSTS {csts:#x}");
    assert_eq!(csts & (1 << 1), 0, "no CFS: CSTS {csts:#x}");
    // Enabled again (SHN cleared), it serves.
    a.property_set(wire::property::CC, 0).unwrap();
    a.enable().unwrap();
    let csts = a.property_get(wire::property::CSTS, false).unwrap();
    assert_eq!(csts & 0xF, 1, "ready: CSTS {csts:#x}");
}

/// A host that enables its controller again before the reset's RDY reads 0 (an I/O queue
/// of before the reset still there): its new queues could take the IDs of old ones still
/// writing, and the reset, never seen to end, fenced the host's other controllers for the
/// association's life. The controller fails (CFS); a reset that waits for RDY 0 serves.
#[test]
fn an_enable_before_the_reset_ended_fails_the_controller() {
    let w = world();
    let (mut a, ios) = w.controller(1);
    a.property_set(wire::property::CC, 0).unwrap();
    let csts = a.property_get(wire::property::CSTS, false).unwrap();
    assert_eq!(
        csts & 1,
        1,
        "RDY reads 1 while an I/O queue of before is left: {csts:#x}"
    );
    a.enable().unwrap_err();
    let csts = a.property_get(wire::property::CSTS, false).unwrap();
    assert_eq!(csts & (1 << 1), 1 << 1, "CFS: CSTS {csts:#x}");
    drop(ios);
    a.property_set(wire::property::CC, 0).unwrap();
    let csts = a.property_get(wire::property::CSTS, false).unwrap();
    assert_eq!(csts & 0x3, 0, "reset ended: CSTS {csts:#x}");
    a.enable().unwrap();
    a.set_queue_count(1).unwrap();
    IoQueue::connect(w.link(1, 31), &host(1), SUB, a.cntlid, 1, 31).unwrap();
}

/// Set Features Number of Queues is optional: without it, the I/O queues Get Features
/// reports are allocated (they were refused, Connect Invalid Parameters at QID), and what
/// was allocated stays across a reset (it was cleared, and the queues refused again).
#[test]
fn io_queues_connect_without_set_features_and_after_a_reset() {
    let w = world();
    let mut a = w.admin(&host(1), SUB).unwrap();
    a.enable().unwrap();
    let got = a.get_feature(wire::feature::NUMBER_OF_QUEUES).unwrap();
    let allocated = (got & 0xFFFF) + 1;
    assert!(allocated >= 2, "{got:#x}");
    let last = u16::try_from(allocated).unwrap();
    let io = IoQueue::connect(w.link(last, 31), &host(1), SUB, a.cntlid, last, 31).unwrap();
    drop(io);
    a.set_queue_count(2).unwrap();
    a.property_set(wire::property::CC, 0).unwrap();
    a.enable().unwrap();
    assert_eq!(
        a.get_feature(wire::feature::NUMBER_OF_QUEUES).unwrap(),
        1 | 1 << 16
    );
    IoQueue::connect(w.link(2, 31), &host(1), SUB, a.cntlid, 2, 31).unwrap();
    let beyond = IoQueue::connect(w.link(3, 31), &host(1), SUB, a.cntlid, 3, 31);
    assert_eq!(dw0_of(beyond), 42, "qid 3 of 2 allocated");
}

/// A shutdown waiting for its I/O queues, then a reset before they are gone: the shutdown
/// is over with the reset. Its flush must not run when the old queues go, nor report SHST
/// complete on the controller enabled again, whose new I/O queues must connect.
#[test]
fn a_reset_ends_a_shutdown_still_waiting_for_its_io_queues() {
    let w = world();
    let (mut a, ios) = w.controller(1);
    let cc = a.property_get(wire::property::CC, false).unwrap() as u32;
    a.property_set(wire::property::CC, cc | 1 << 14).unwrap();
    a.property_set(wire::property::CC, 0).unwrap();
    drop(ios);
    let csts = a.property_get(wire::property::CSTS, false).unwrap();
    assert_eq!(csts & 0xF, 0, "reset ended, no shutdown: CSTS {csts:#x}");
    a.enable().unwrap();
    let csts = a.property_get(wire::property::CSTS, false).unwrap();
    assert_eq!(
        csts >> 2 & 3,
        0,
        "SHST reported on the controller enabled again"
    );
    assert_eq!(a.set_queue_count(1).unwrap(), 1);
    let mut io = IoQueue::connect(w.link(1, 127), &host(1), SUB, a.cntlid, 1, 127).unwrap();
    assert_eq!(
        io.cntlid, a.cntlid,
        "the I/O Connect answers its controller's ID"
    );
    let mut buf = vec![0u8; 512];
    io.read(1, 0, 1, &mut buf).unwrap();
}

/// Commands complete out of order; each completion reports the SQ head when it is made, so
/// a later completion never reports an older head than an earlier one (a host doing SQ flow
/// control would take a step back for a wrap).
#[test]
fn a_completion_reports_the_sq_head_when_it_is_made() {
    let w = world();
    let (_a, mut ios) = w.controller(1);
    let now = ios[0].transport().now;
    let q = ios[0].transport().queue_mut();
    let mut flush = |cid: u16| {
        let mut s = nvmfd_nvme::host::rw_sqe(wire::io_opcode::FLUSH, 1, 0, 0, false);
        s.cid = U16::new(cid);
        match q.handle(s.as_bytes(), now) {
            Action::Io(req) => req,
            other => panic!("expected a block operation, got {other:?}"),
        }
    };
    let (first, second) = (flush(1), flush(2));
    let q = ios[0].transport().queue_mut();
    let done_second = q.io_done(&second, Ok(0));
    let done_first = q.io_done(&first, Ok(0));
    assert_eq!(done_first.cid.get(), 1);
    assert_eq!(
        done_first.sqhd.get(),
        done_second.sqhd.get(),
        "the head when the first completed"
    );
}

/// A host that enables Advanced Command Retry (Host Behavior Support, data in the command)
/// gets a Command Retry Delay on a retryable status: CRDT1 for a busy queue, the longer
/// CRDT2 for Namespace Not Ready (an RBD image opening again outlasts five retries of CRDT1);
/// one that does not, gets none (the Linux host retries at once then).
#[test]
fn advanced_command_retry_gives_retryable_statuses_a_retry_delay() {
    let w = world();
    let (mut a, mut ios) = w.controller(1);
    let id = a.identify_controller().unwrap();
    assert_eq!(id.crdt[0].get(), RETRY_DELAY_100MS);
    assert!(id.crdt[0].get() > 0);
    assert_eq!(id.crdt[1].get(), NOT_READY_RETRY_DELAY_100MS);
    // Five retries outlast an RBD image's longest wait between opens (30 s).
    assert!(u32::from(id.crdt[1].get()) * 100 * 5 >= 30_000);
    let features = |a: &mut AdminQueue<Loopback>, set: Option<u8>| {
        let opcode = if set.is_some() {
            wire::admin_opcode::SET_FEATURES
        } else {
            wire::admin_opcode::GET_FEATURES
        };
        let mut s: Sqe = nvmfd_nvme::host::command(0);
        s.opcode = opcode;
        s.flags = 1 << 6; // PSDT: SGL
        s.cdw10 = U32::new(u32::from(wire::feature::HOST_BEHAVIOR_SUPPORT));
        let mut buf = vec![0u8; 512];
        let c = match set {
            Some(b) => {
                buf[0] = b;
                a.transport().execute(s, DataDir::ToTarget(&buf)).unwrap()
            }
            None => a
                .transport()
                .execute(s, DataDir::FromTarget(&mut buf))
                .unwrap(),
        };
        assert!(c.status().is_success(), "{:?}", c.status());
        buf[0]
    };
    let now = ios[0].transport().now;
    let failed = |ios: &mut Vec<IoQueue<Loopback>>, why: BlockFailure| {
        let q = ios[0].transport().queue_mut();
        let s = nvmfd_nvme::host::rw_sqe(wire::io_opcode::FLUSH, 1, 0, 0, false);
        let Action::Io(req) = q.handle(s.as_bytes(), now) else {
            panic!("expected a block operation");
        };
        q.io_done(&req, Err(why)).status()
    };
    let not_ready = |ios: &mut Vec<IoQueue<Loopback>>| {
        let st = failed(ios, BlockFailure::Unavailable);
        assert!(st.same_code(wire::status::NAMESPACE_NOT_READY), "{st:?}");
        assert!(!st.dnr(), "{st:?}");
        st.crd()
    };
    assert_eq!(features(&mut a, None), 0, "off until the host enables it");
    assert_eq!(not_ready(&mut ios), 0);
    assert_eq!(failed(&mut ios, BlockFailure::QueueFull).crd(), 0);
    assert_eq!(features(&mut a, Some(1)), 1);
    assert_eq!(features(&mut a, None), 1);
    assert_eq!(not_ready(&mut ios), 2, "CRDT2");
    assert_eq!(
        failed(&mut ios, BlockFailure::OutOfRange).crd(),
        2,
        "a shrink not yet published is Namespace Not Ready too"
    );
    let busy = failed(&mut ios, BlockFailure::QueueFull);
    assert!(!busy.dnr(), "{busy:?}");
    assert_eq!(busy.crd(), 1, "CRDT1");
    // A status that must not be retried carries no delay.
    assert_eq!(failed(&mut ios, BlockFailure::ReadOnly).crd(), 0);
    features(&mut a, Some(0));
    assert_eq!(not_ready(&mut ios), 0);
}

/// An I/O queue whose connection was lost while commands of it may be at a backend keeps
/// its queue ID until they are done: a queue the host connects with that ID meanwhile is
/// answered Controller Busy (retryable), or a write through it could be overtaken by an older
/// one of the lost queue. Once the lost queue has settled, the ID is free.
#[test]
fn a_lost_io_queues_id_is_busy_until_its_commands_are_done() {
    let w = world();
    let (a, mut ios) = w.controller(1);
    ios[0].transport().queue_mut().connection_lost();
    let again = IoQueue::connect(w.link(1, 127), &host(1), SUB, a.cntlid, 1, 127);
    let st = status_of(again);
    assert!(st.same_code(status::CONNECT_CONTROLLER_BUSY), "{st:?}");
    assert!(!st.dnr(), "the host retries: {st:?}");
    ios[0].transport().queue_mut().settled();
    let again = IoQueue::connect(w.link(1, 127), &host(1), SUB, a.cntlid, 1, 127);
    assert!(again.is_ok(), "{again:?}");
    // A queue lost with nothing at a backend frees its ID at once (the transport says so
    // right away), as before.
    let mut q2 = again.unwrap();
    q2.transport().queue_mut().connection_lost();
    q2.transport().queue_mut().settled();
    assert!(IoQueue::connect(w.link(1, 127), &host(1), SUB, a.cntlid, 1, 127).is_ok());
}

thread_local! {
    /// A host's admin queue that a target hook uses (`admin_hook`): the loopback serves it on
    /// the thread the hook runs on, the test's.
    static HOOK_ADMIN: std::cell::RefCell<Option<AdminQueue<Loopback>>> =
        const { std::cell::RefCell::new(None) };
}

/// A target hook that runs `f` on admin queue `a`, kept on this thread for it until
/// `take_hook_admin`.
fn admin_hook(
    a: AdminQueue<Loopback>,
    f: fn(&mut AdminQueue<Loopback>),
) -> Box<dyn Fn() + Send + Sync> {
    HOOK_ADMIN.with(|s| *s.borrow_mut() = Some(a));
    Box::new(move || {
        HOOK_ADMIN.with(|s| f(s.borrow_mut().as_mut().expect("the admin queue")));
    })
}

/// The admin queue `admin_hook` kept.
fn take_hook_admin() -> Option<AdminQueue<Loopback>> {
    HOOK_ADMIN.with(|s| s.borrow_mut().take())
}

/// A reset that lands while an I/O queue with commands at a backend is being lost (between
/// its look at the controller's epoch and its marking the queue ID lost) leaves that ID free
/// once the host enabled the controller again: the mark was set in the new epoch, which no
/// queue's release clears, and every Connect of that ID was Controller Busy until the next
/// reset.
#[test]
fn a_reset_while_an_io_queue_is_lost_leaves_its_id_free_after_the_reset() {
    let w = world();
    let (a, mut ios) = w.controller(1);
    let cntlid = a.cntlid;
    w.target.set_lost_hook(Some(admin_hook(a, |a| {
        a.property_set(wire::property::CC, 0).unwrap();
    })));
    ios[0].transport().queue_mut().connection_lost();
    w.target.set_lost_hook(None);
    ios[0].transport().queue_mut().settled();
    drop(ios);
    let mut a = take_hook_admin().unwrap();
    a.enable().unwrap();
    assert_eq!(a.set_queue_count(1).unwrap(), 1);
    let again = IoQueue::connect(w.link(1, 127), &host(1), SUB, cntlid, 1, 127);
    assert!(again.is_ok(), "{:?}", again.err());
}

#[test]
fn keep_alive_expiry_ends_the_controller_and_its_queues() {
    let w = world();
    let (mut a, mut ios) = w.controller(1);
    let t0 = Instant::now();
    a.keep_alive().unwrap();
    let kato = Duration::from_millis(5000);
    // The check sees the traffic since the last one and restarts the timer (TBKAS) ...
    let t1 = t0 + kato - Duration::from_millis(100);
    assert!(w.target.expire_keep_alives(t1).is_empty());
    // ... I/O alone keeps the controller alive, past a whole timeout since the last check
    // (without the read, this check would end it) ...
    let mut buf = vec![0u8; 512];
    ios[0].read(1, 0, 1, &mut buf).unwrap();
    let t2 = t1 + kato + Duration::from_secs(1);
    assert!(w.target.expire_keep_alives(t2).is_empty(), "I/O is traffic");
    // ... and a whole timeout with no command at all ends it.
    assert!(w.target.expire_keep_alives(t2 + kato / 2).is_empty());
    let ended = w
        .target
        .expire_keep_alives(t2 + kato + Duration::from_secs(1));
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].end_reason(), Some(EndReason::KeepAliveExpired));
    assert!(ios[0].transport().queue().must_disconnect());
    assert!(matches!(
        ios[0].read(1, 0, 1, &mut buf),
        Err(HostError::Transport(_))
    ));
    assert!(matches!(a.keep_alive(), Err(HostError::Transport(_))));
    // The host can connect again once the transport has let go of the ended queues (at
    // once here: nothing of them is at a backend).
    drop(ios);
    drop(a);
    let (mut a2, mut ios2) = w.controller(1);
    a2.keep_alive().unwrap();
    ios2[0].read(1, 0, 1, &mut buf).unwrap();
}

/// A controller that expired leaves the map while its admin queue is still open; once the
/// controller IDs wrap, a new controller may get its ID. Closing the old admin queue then ends
/// only the old controller, never the new one that has its ID.
#[test]
fn closing_the_admin_queue_of_an_expired_controller_leaves_the_one_that_reuses_its_id() {
    let w = world();
    let a = w.admin(&host(1), SUB).unwrap();
    let old = a.cntlid;
    let ended = w
        .target
        .expire_keep_alives(Instant::now() + Duration::from_secs(60));
    assert_eq!(ended.len(), 1);
    w.target.set_next_cntlid(old);
    let mut b = w.admin(&host(2), SUB).unwrap();
    assert_eq!(b.cntlid, old, "the ID was not handed out again");
    drop(a);
    let live: Vec<u16> = w
        .target
        .controllers()
        .iter()
        .filter(|c| c.end_reason().is_none())
        .map(|c| c.cntlid)
        .collect();
    assert_eq!(
        live,
        [old],
        "the new controller left the map with the old admin queue"
    );
    b.enable().unwrap();
    b.keep_alive().unwrap();
}

/// A host whose old controller ended (its admin queue closed, or its keep-alive expired)
/// while an I/O queue of it still exists (a transport drops one only once its block
/// operations completed) cannot start a new association on the subsystem: its Connect is
/// answered Controller Busy until the old queue is gone, so no write of the old association
/// lands after the new one's. Other hosts connect meanwhile.
#[test]
fn a_host_reconnects_only_once_its_old_controllers_io_queues_are_gone() {
    let w = world();
    for expire in [false, true] {
        let (a, ios) = w.controller(1);
        if expire {
            // The first check takes in the traffic of the setup; the second ends it.
            let now = Instant::now();
            assert!(w.target.expire_keep_alives(now).is_empty());
            let ended = w.target.expire_keep_alives(now + Duration::from_secs(60));
            assert_eq!(ended.len(), 1);
        } else {
            drop(a);
        }
        let (before, _) = w.target.fenced_connects();
        let r = w.admin(&host(1), SUB);
        assert!(
            status_of(r).same_code(status::CONNECT_CONTROLLER_BUSY),
            "a new controller while the old one's I/O queue lives (expired: {expire})"
        );
        // Counted, with whom, for the log.
        let (after, last) = w.target.fenced_connects();
        assert_eq!(after, before + 1);
        assert_eq!(last, Some((host(1).nqn, SUB.to_owned())));
        let mut other = w.admin(&host(2), SUB).unwrap();
        other.enable().unwrap();
        drop(ios);
        let mut again = w.admin(&host(1), SUB).unwrap();
        again.enable().unwrap();
        again.keep_alive().unwrap();
    }
}

/// A controller that ended otherwise (an operator's disconnect), still in the map until its
/// admin queue goes, is not reported again as a keep-alive timeout.
#[test]
fn a_controller_ended_otherwise_is_not_expired_again() {
    let w = world();
    let (a, _ios) = w.controller(1);
    assert!(w.target.disconnect_controller(a.cntlid).is_some());
    let now = Instant::now();
    assert!(w.target.expire_keep_alives(now).is_empty());
    let again = w.target.expire_keep_alives(now + Duration::from_secs(60));
    assert!(
        again.is_empty(),
        "an ended controller was reported as a keep-alive timeout"
    );
}

/// With TBKAS every command restarts the keep-alive timer, Fabrics commands included: a
/// Linux host counts any completion as traffic and skips its Keep Alive, so a host that only
/// reads CSTS (waiting out a reset, say) must keep its controller.
#[test]
fn property_gets_alone_keep_a_controller_alive() {
    let w = world();
    let (mut a, _ios) = w.controller(1);
    let t0 = Instant::now();
    let kato = Duration::from_millis(5000);
    for k in 1..=6u32 {
        a.property_get(wire::property::CSTS, false).unwrap();
        let ended = w.target.expire_keep_alives(t0 + kato * k);
        assert!(
            ended.is_empty(),
            "ended after {k} timeouts of Property Gets only"
        );
    }
    // With no command at all for a whole timeout, it ends.
    assert!(w.target.expire_keep_alives(t0 + kato * 7).is_empty());
    assert_eq!(w.target.expire_keep_alives(t0 + kato * 9).len(), 1);
}

#[test]
fn losing_the_admin_queue_ends_the_controller() {
    let w = world();
    let (a, mut ios) = w.controller(1);
    let cntlid = a.cntlid;
    drop(a);
    assert!(w.target.controllers().iter().all(|c| c.cntlid != cntlid));
    assert!(ios[0].transport().queue().must_disconnect());
    let mut buf = vec![0u8; 512];
    assert!(ios[0].read(1, 0, 1, &mut buf).is_err());
}

#[test]
fn shutdown_flushes_and_reports_complete() {
    let w = world();
    let (mut a, ios) = w.controller(1);
    drop(ios);
    a.shutdown().unwrap();
    assert_eq!(
        a.property_get(wire::property::CSTS, false).unwrap() >> 2 & 3,
        2
    );
}

/// A host waits for the command that started its shutdown's flush and sends nothing else
/// (Linux has stopped its keep-alives): a flush longer than the keep-alive timeout does not
/// end the controller under it. It did, and the command was never answered.
#[test]
fn a_long_shutdown_flush_does_not_expire_the_keep_alive_timer() {
    let w = world();
    let (mut a, ios) = w.controller(1);
    drop(ios);
    let kato = Duration::from_millis(5000);
    let target = w.target.clone();
    let ended = std::rc::Rc::new(std::cell::Cell::new(usize::MAX));
    let seen = std::rc::Rc::clone(&ended);
    a.transport().flush_all_hook = Some(Box::new(move || {
        // The Property Set counts as traffic once; then two timeouts pass in the flush.
        let t0 = Instant::now();
        let first = target.expire_keep_alives(t0).len();
        let later = target.expire_keep_alives(t0 + kato * 2).len();
        seen.set(first + later);
    }));
    a.shutdown().unwrap();
    assert_eq!(
        ended.get(),
        0,
        "the controller expired while its shutdown flushed"
    );
    assert_eq!(
        a.property_get(wire::property::CSTS, false).unwrap() >> 2 & 3,
        2
    );
    // Once flushed, the timer runs again.
    let t1 = Instant::now();
    w.target.expire_keep_alives(t1);
    assert_eq!(w.target.expire_keep_alives(t1 + kato * 2).len(), 1);
    // A flush that never ends keeps it for a while only: a host gone meanwhile goes too.
    let (mut b, ios) = w.controller(1);
    drop(ios);
    let target = w.target.clone();
    let late = std::rc::Rc::new(std::cell::Cell::new(0));
    let seen = std::rc::Rc::clone(&late);
    b.transport().flush_all_hook = Some(Box::new(move || {
        let t0 = Instant::now();
        target.expire_keep_alives(t0);
        let within = target
            .expire_keep_alives(t0 + SHUTDOWN_FLUSH_KEEPS_ALIVE / 2)
            .len();
        let past = target
            .expire_keep_alives(t0 + SHUTDOWN_FLUSH_KEEPS_ALIVE + kato * 2)
            .len();
        seen.set(within * 10 + past);
    }));
    let _ = b.shutdown();
    assert_eq!(late.get(), 1, "kept alive within the bound, ended past it");
}

/// A shutdown whose flush fails is never reported complete: the host that asked for it gets an
/// error, and CSTS says Controller Fatal Status with SHST not complete (what it wrote may not
/// be durable).
#[test]
fn a_shutdown_whose_flush_fails_is_not_reported_complete() {
    let w = world();
    // The backend lost namespace 3's device: flushing it fails.
    let backend = Backend::new(
        &[
            (SUB.into(), 1, malloc(SIZE, 512, false)),
            (SUB.into(), 2, malloc(SIZE, 4096, false)),
        ],
        Limits::default().max_io_size,
    )
    .unwrap();
    let w = World {
        target: w.target,
        backend,
        d1: w.d1,
    };
    let (mut a, ios) = w.controller(1);
    drop(ios);
    assert!(
        a.shutdown().is_err(),
        "a shutdown that could not flush succeeded"
    );
    let csts = a.property_get(wire::property::CSTS, false).unwrap();
    assert_eq!(
        csts >> 1 & 1,
        1,
        "CSTS {csts:#x}: no Controller Fatal Status"
    );
    assert_ne!(
        csts >> 2 & 3,
        2,
        "CSTS {csts:#x}: shutdown reported complete"
    );
}

/// A shutdown while an I/O queue of the controller is still there ends that queue, and
/// reports complete only once it is gone (the transport drops it when its connection is torn
/// down and its block operations have completed) and the namespaces are flushed.
#[test]
fn a_shutdown_completes_only_after_the_io_queues_are_gone() {
    let w = world();
    let (mut a, mut ios) = w.controller(1);
    ios[0].write(1, 0, 1, &pattern(3, 512), false).unwrap();
    let cc = a.property_get(wire::property::CC, false).unwrap() as u32;
    a.property_set(wire::property::CC, cc | 1 << 14).unwrap();
    assert!(ios[0].transport().queue().must_disconnect());
    let shst =
        |a: &mut AdminQueue<_>| a.property_get(wire::property::CSTS, false).unwrap() >> 2 & 3;
    assert_eq!(shst(&mut a), 1, "processing while an I/O queue is left");
    drop(ios);
    assert_eq!(shst(&mut a), 2, "complete once it is gone");
}

/// A reset reports CSTS.RDY = 0 only once every I/O queue of the controller is gone: until
/// then one of them may still have a write in flight, which must not land after the host
/// writes the same blocks again on a new association.
#[test]
fn a_reset_ends_the_io_queues_and_is_not_over_before_they_are_gone() {
    let w = world();
    let (mut a, mut ios) = w.controller(1);
    a.property_set(wire::property::CC, 0).unwrap();
    assert!(ios[0].transport().queue().must_disconnect());
    assert_eq!(
        a.property_get(wire::property::CSTS, false).unwrap() & 1,
        1,
        "ready while an I/O queue of before the reset is left"
    );
    let mut buf = vec![0u8; 512];
    assert!(matches!(
        ios[0].read(1, 0, 1, &mut buf),
        Err(HostError::Transport(_))
    ));
    drop(ios);
    assert_eq!(a.property_get(wire::property::CSTS, false).unwrap() & 1, 0);
    // The admin queue stays; the host enables again and connects new I/O queues.
    a.enable().unwrap();
    assert_eq!(a.set_queue_count(1).unwrap(), 1);
    let mut io = IoQueue::connect(w.link(1, 127), &host(1), SUB, a.cntlid, 1, 127).unwrap();
    io.read(1, 0, 1, &mut buf).unwrap();
}

/// Connects I/O queue 1 of a new controller of `host(1)` while the hook `install` sets
/// resets the controller (CC.EN to 0) from its admin queue (kept for `take_hook_admin`).
fn io_connect_across_a_reset(
    w: &World,
    install: fn(&Target, Option<ConnectHook>),
) -> Result<IoQueue<Loopback>, HostError> {
    let (a, _) = w.controller(1);
    let cntlid = a.cntlid;
    install(
        &w.target,
        Some(admin_hook(a, |a| {
            a.property_set(wire::property::CC, 0).unwrap();
        })),
    );
    let io = IoQueue::connect(w.link(1, 127), &host(1), SUB, cntlid, 1, 127);
    install(&w.target, None);
    io
}

/// A reset that lands while an I/O queue's Connect is between taking its queue ID and being
/// bound ends that queue too: the queue belongs to the epoch in which it took its ID.
#[test]
fn an_io_queue_connecting_across_a_reset_disconnects() {
    let w = world();
    let mut io = io_connect_across_a_reset(&w, Target::set_connect_hook).unwrap();
    assert!(
        io.transport().queue().must_disconnect(),
        "an I/O queue connected across a reset outlived it"
    );
    let mut buf = vec![0u8; 512];
    assert!(matches!(
        io.read(1, 0, 1, &mut buf),
        Err(HostError::Transport(_))
    ));
    take_hook_admin();
}

/// A reset that lands after an I/O queue's Connect found its controller ready and before it
/// took its queue ID: the Connect is refused. It took the ID in the reset's new epoch and
/// joined the disabled controller, outliving the reset (and holding RDY at 1 for as long as
/// the host kept it).
#[test]
fn an_io_queue_whose_connect_meets_a_reset_before_taking_its_id_is_refused() {
    let w = world();
    let io = io_connect_across_a_reset(&w, Target::set_io_connect_hook);
    assert!(
        status_of(io).same_code(status::COMMAND_SEQUENCE_ERROR),
        "an I/O queue joined a controller its reset had disabled"
    );
    let mut a = take_hook_admin().unwrap();
    assert_eq!(
        a.property_get(wire::property::CSTS, false).unwrap() & 1,
        0,
        "the reset is over: no I/O queue of it is left"
    );
    a.enable().unwrap();
    let mut io = IoQueue::connect(w.link(1, 127), &host(1), SUB, a.cntlid, 1, 127).unwrap();
    let mut buf = vec![0u8; 512];
    io.read(1, 0, 1, &mut buf).unwrap();
}

/// An I/O queue whose Connect took its queue ID just before a shutdown (CC.SHN) with no I/O
/// queue bound yet, and binds after the shutdown completed, disconnects: its writes would
/// come after the shutdown's flush and never be made durable. And once shut down, no I/O
/// queue connects until a reset.
#[test]
fn an_io_queue_connecting_across_a_shutdown_disconnects_and_none_connects_after_it() {
    let w = world();
    let (a, _) = w.controller(1);
    let cntlid = a.cntlid;
    w.target.set_connect_hook(Some(admin_hook(a, |a| {
        let cc = a.property_get(wire::property::CC, false).unwrap() as u32;
        a.property_set(wire::property::CC, cc | (1 << 14)).unwrap();
        let shst = (0..1000)
            .map(|_| (a.property_get(wire::property::CSTS, false).unwrap() >> 2) & 0x3)
            .find(|&s| s == 2);
        assert_eq!(shst, Some(2), "the shutdown completes");
    })));
    let io = IoQueue::connect(w.link(1, 127), &host(1), SUB, cntlid, 1, 127);
    w.target.set_connect_hook(None);
    let mut io = io.unwrap();
    assert!(
        io.transport().queue().must_disconnect(),
        "an I/O queue connected across a shutdown outlived it"
    );
    drop(io);
    let st = status_of(IoQueue::connect(
        w.link(1, 127),
        &host(1),
        SUB,
        cntlid,
        1,
        127,
    ));
    assert!(st.same_code(status::COMMAND_SEQUENCE_ERROR), "{st:?}");
    take_hook_admin();
}

/// Two Connects on one admin queue, the second sent before the first one's data (fetched by
/// RDMA READ) arrived: the second is a sequence error, and no controller is left behind once
/// the queue goes.
#[test]
fn a_second_connect_whose_data_arrives_after_the_first_bound_the_queue_is_refused() {
    let w = world();
    let h = host(1);
    let mut q = Queue::new(
        &w.target,
        Some(CmParams {
            qid: 0,
            hsqsize: 31,
        }),
    );
    let capsule = |cid: u16| {
        let cmd = wire::ConnectCmd {
            opcode: wire::admin_opcode::FABRICS,
            flags: 1 << 6,
            cid: U16::new(cid),
            fctype: wire::fctype::CONNECT,
            dptr: SglDesc::keyed(0x1000, 1024, 0x77, false),
            sqsize: U16::new(31),
            kato: U32::new(0),
            ..wire::zeroed()
        };
        cmd.as_bytes().to_vec()
    };
    let mut data: wire::ConnectData = wire::zeroed();
    data.hostid = h.id;
    data.cntlid = U16::new(0xFFFF);
    wire::put_str(&mut data.subnqn, SUB, 0);
    wire::put_str(&mut data.hostnqn, &h.nqn, 0);
    let now = Instant::now();
    let mut fetch = |cid| match q.handle(&capsule(cid), now) {
        Action::Fetch { cmd, .. } => cmd,
        other => panic!("a keyed Connect fetches its data first: {other:?}"),
    };
    let (first, second) = (fetch(1), fetch(2));
    let status_of = |a: Action| match a {
        Action::Respond { cqe, .. } => cqe.status(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        status_of(q.data_arrived(first, data.as_bytes(), now)),
        Status::SUCCESS
    );
    assert_eq!(
        status_of(q.data_arrived(second, data.as_bytes(), now)),
        status::COMMAND_SEQUENCE_ERROR
    );
    assert_eq!(w.target.controllers().len(), 1);
    drop(q);
    assert!(
        w.target.controllers().is_empty(),
        "a controller outlived its admin queue"
    );
}

/// A host's access removed while its admin queue's Connect is being served: the Connect fails,
/// or the controller it made is ended; never a live controller of a host no longer allowed.
#[test]
fn a_host_removed_while_its_connect_is_served_gets_no_live_controller() {
    let w = world();
    let r = w.admin_during(&host(1), RESTRICTED, |target| {
        let mut s = (*target.subsystem(RESTRICTED).unwrap()).clone();
        s.hosts.clear();
        target.replace_subsystem(s).unwrap();
    });
    let live = w.live_controllers(RESTRICTED);
    assert_eq!(
        live, 0,
        "a controller of a host no longer allowed lives ({r:?})"
    );
    assert_eq!(status_of(r), status::CONNECT_INVALID_HOST);
}

/// A subsystem removed and added again under the same NQN while a host's Connect is served:
/// the controller belongs to the subsystem now in force (its ID), so a later change that no
/// longer allows the host ends it.
#[test]
fn a_connect_served_while_its_subsystem_is_replaced_joins_the_new_one() {
    let w = world();
    let r = w.admin_during(&host(1), RESTRICTED, |target| {
        let (gone, _) = target.remove_subsystem(RESTRICTED).unwrap();
        target.add_subsystem((*gone).clone()).unwrap();
    });
    assert!(r.is_ok(), "{r:?}");
    let mut s = (*w.target.subsystem(RESTRICTED).unwrap()).clone();
    s.hosts.clear();
    w.target.replace_subsystem(s).unwrap();
    let live = w.live_controllers(RESTRICTED);
    assert_eq!(
        live, 0,
        "a controller of a host no longer allowed lives on, tied to the removed subsystem"
    );
}

/// Between a removed subsystem's publication and its controllers' end (the two steps of a
/// removal, which another thread's queue sees apart), a command of one of its controllers
/// closes the queue as the end would: it was answered from no subsystem (Identify
/// Controller as the discovery controller's, subsystem NQN and all).
#[test]
fn a_command_in_a_subsystem_removals_window_closes_its_queue() {
    let w = world();
    let (mut a, mut ios) = w.controller(1);
    let (published_tx, published) = std::sync::mpsc::channel::<()>();
    let (go, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    w.target.set_removal_hook(Some(Box::new(move || {
        published_tx.send(()).unwrap();
        go_rx.lock().unwrap().recv().unwrap();
    })));
    let target = w.target.clone();
    let remover = std::thread::spawn(move || target.remove_subsystem(SUB).map(|_| ()));
    published.recv().unwrap();
    let identify = a.identify_controller();
    let read = ios[0].read(1, 0, 8, &mut vec![0u8; 4096]);
    go.send(()).unwrap();
    remover.join().unwrap().unwrap();
    w.target.set_removal_hook(None);
    assert!(
        matches!(identify, Err(HostError::Transport(_))),
        "Identify Controller answered from no subsystem: {:?}",
        identify.map(|id| wire::get_str(&id.subnqn).map(str::to_owned))
    );
    assert!(
        matches!(read, Err(HostError::Transport(_))),
        "a read answered from no subsystem: {read:?}"
    );
}

#[test]
fn smart_log_counts_io() {
    let w = world();
    let (mut a, mut ios) = w.controller(1);
    for i in 0..3 {
        ios[0].write(1, i * 8, 8, &pattern(i, 4096), false).unwrap();
    }
    let mut b = vec![0u8; 4096];
    ios[0].read(1, 0, 8, &mut b).unwrap();
    let log = a.get_log_page(wire::log_page::SMART, 0, 512).unwrap();
    let s: wire::SmartLog = wire::read(&log).unwrap();
    assert_eq!(s.host_writes.get(), 3);
    assert_eq!(s.host_reads.get(), 1);
    assert_eq!(
        s.data_units_written.get(),
        1,
        "24 units of 512 B, rounded up to one thousand"
    );
    // A log page not supported, reserved (33h) or defined (Commands Supported and Effects,
    // which LPA bit 1 does not claim): Invalid Field, as the specification and the kernel
    // target answer (it was Invalid Log Page).
    assert!(status_of(a.get_log_page(0x33, 0, 512)).same_code(status::INVALID_FIELD));
    assert!(
        status_of(a.get_log_page(wire::log_page::COMMAND_EFFECTS, 0, 512))
            .same_code(status::INVALID_FIELD)
    );
    let s: Status = status_of(a.get_log_page(wire::log_page::SMART, 2, 512));
    assert!(
        s.same_code(status::INVALID_FIELD),
        "offset not dword aligned"
    );
    // The log is controller-wide (LPA bit 0 clear): one namespace's is Invalid Field (it was
    // the controller's figures, as if the namespace's); NSID FFFFFFFFh is the controller's.
    let smart_of = |a: &mut AdminQueue<Loopback>, nsid: u32| {
        let mut s = nvmfd_nvme::host::command(wire::admin_opcode::GET_LOG_PAGE);
        s.nsid = U32::new(nsid);
        s.cdw10 = U32::new(u32::from(wire::log_page::SMART) | (512 / 4 - 1) << 16);
        let mut buf = vec![0u8; 512];
        a.raw(s, DataDir::FromTarget(&mut buf)).map(|_| buf)
    };
    let s = status_of(smart_of(&mut a, 1));
    assert!(s.same_code(status::INVALID_FIELD), "{s:?}");
    let all: wire::SmartLog = wire::read(&smart_of(&mut a, u32::MAX).unwrap()).unwrap();
    assert_eq!(all.host_writes.get(), 3);
}

#[test]
fn smart_log_sums_every_queue_and_keeps_the_counts_of_queues_gone() {
    let w = world();
    let (mut a, mut ios) = w.controller(2);
    let mut b = vec![0u8; 4096];
    ios[0].write(1, 0, 8, &pattern(1, 4096), false).unwrap();
    ios[1].write(1, 8, 8, &pattern(2, 4096), false).unwrap();
    ios[1].read(1, 0, 8, &mut b).unwrap();
    ios[1].read(1, 8, 8, &mut b).unwrap();
    let smart = |a: &mut AdminQueue<Loopback>| -> wire::SmartLog {
        wire::read(&a.get_log_page(wire::log_page::SMART, 0, 512).unwrap()).unwrap()
    };
    let s = smart(&mut a);
    assert_eq!((s.host_writes.get(), s.host_reads.get()), (2, 2));
    // Queue 2 goes: what it served still counts.
    drop(ios.pop());
    ios[0].read(1, 0, 8, &mut b).unwrap();
    let s = smart(&mut a);
    assert_eq!((s.host_writes.get(), s.host_reads.get()), (2, 3));
}

/// A Dataset Management command deallocating `ranges`, whose range buffer is `buf_len` bytes
/// (at least 16 per range): the rest of the buffer holds ranges past the end of the
/// namespace, which fail the command if the target reads them.
fn dsm(ranges: &[(u64, u32)], buf_len: usize) -> (Sqe, Vec<u8>) {
    let mut s: Sqe = nvmfd_nvme::host::command(0);
    s.opcode = wire::io_opcode::DATASET_MANAGEMENT;
    s.flags = 0x40;
    s.nsid = U32::new(1);
    s.cdw10 = U32::new(ranges.len() as u32 - 1);
    s.cdw11 = U32::new(1 << 2); // AD
    let mut buf = Vec::with_capacity(buf_len);
    for &(slba, nlb) in ranges {
        buf.extend_from_slice(&0u32.to_le_bytes());
        buf.extend_from_slice(&nlb.to_le_bytes());
        buf.extend_from_slice(&slba.to_le_bytes());
    }
    while buf.len() + 16 <= buf_len {
        buf.extend_from_slice(&0u32.to_le_bytes());
        buf.extend_from_slice(&8u32.to_le_bytes());
        buf.extend_from_slice(&(u64::MAX - 4).to_le_bytes());
    }
    buf.truncate(buf_len);
    (s, buf)
}

#[test]
fn dataset_management_takes_a_range_buffer_longer_than_its_ranges_as_linux_sends_it() {
    let w = world();
    let (_a, mut ios) = w.controller(1);
    let io = &mut ios[0];
    let data = pattern(21, 64 * 512);
    io.write(1, 100, 64, &data, false).unwrap();
    let send = |l: &mut Loopback, s: Sqe, icd: &[u8]| {
        let mut c = s.as_bytes().to_vec();
        c.extend_from_slice(icd);
        l.send_capsule(&c).unwrap().unwrap().status()
    };
    let l = io.transport();
    // Linux: two ranges in a 4096-byte buffer, in the capsule (it fits IOCCSZ).
    let (mut s, buf) = dsm(&[(108, 8), (120, 4)], 4096);
    s.dptr = SglDesc::in_capsule(0, 4096);
    let st = send(l, s, &buf);
    assert!(st.is_success(), "in-capsule 4096-byte range buffer: {st:?}");
    // The same by RDMA: one keyed descriptor, and a list of one.
    let (mut s, buf) = dsm(&[(130, 2), (140, 3)], 4096);
    let (addr, key) = l.register_host_memory(buf);
    s.dptr = SglDesc::keyed(addr, 4096, key, false);
    let st = send(l, s, &[]);
    assert!(st.is_success(), "keyed 4096-byte range buffer: {st:?}");
    let (mut s, buf) = dsm(&[(150, 1)], 4096);
    let (addr, key) = l.register_host_memory(buf);
    s.dptr = SglDesc::last_segment(0, 1);
    let st = send(l, s, SglDesc::keyed(addr, 4096, key, false).as_bytes());
    assert!(st.is_success(), "a list holding the range buffer: {st:?}");
    // Shorter than the ranges: Data SGL Length Invalid, nothing deallocated.
    let (mut s, buf) = dsm(&[(160, 1), (161, 1)], 16);
    s.dptr = SglDesc::in_capsule(0, 16);
    assert!(send(l, s, &buf).same_code(status::DATA_SGL_LENGTH_INVALID));
    let (mut s, buf) = dsm(&[(160, 1), (161, 1)], 16);
    let (addr, key) = l.register_host_memory(buf);
    s.dptr = SglDesc::keyed(addr, 16, key, false);
    assert!(send(l, s, &[]).same_code(status::DATA_SGL_LENGTH_INVALID));
    let mut back = vec![0u8; 64 * 512];
    io.read(1, 100, 64, &mut back).unwrap();
    let mut want = data.clone();
    for (s, n) in [(8, 8), (20, 4), (30, 2), (40, 3), (50, 1)] {
        want[s * 512..(s + n) * 512].fill(0);
    }
    assert!(back == want, "exactly the listed ranges read as zeroes");
}

/// A target whose subsystem SUB has namespace 1 (512-byte blocks, at most `max1` blocks per
/// deallocate) and namespace 2 (4096-byte blocks, `max2`), and whose subsystem RESTRICTED has
/// one namespace that cannot deallocate.
fn limits_world(max1: u32, max2: u32) -> World {
    let d1 = malloc(SIZE, 512, false);
    let d2 = malloc(SIZE, 4096, false);
    let d3 = malloc(SIZE, 512, false);
    let ns = |nsid: u32, d: &Arc<Device>, max: u32, deallocate: bool| {
        let mut info = namespace_info(d.info());
        info.deallocate_max_blocks = max;
        info.deallocate = deallocate;
        Namespace {
            nsid,
            info,
            uuid: None,
            nguid: None,
        }
    };
    let sub = |nqn: &str, namespaces| Subsystem {
        id: 0,
        nqn: nqn.into(),
        serial: "SN-TEST-0003".into(),
        model: "nvmfd test".into(),
        allow_any_host: true,
        hosts: vec![],
        cntlids: nvmfd_nvme::ALL_CNTLIDS,
        namespaces,
    };
    let subsystems = vec![
        sub(SUB, vec![ns(1, &d1, max1, true), ns(2, &d2, max2, true)]),
        sub(RESTRICTED, vec![ns(1, &d3, 0, false)]),
    ];
    let target = Target::new(subsystems, vec![], Limits::default());
    let backend = Backend::new(
        &[
            (SUB.into(), 1, Arc::clone(&d1)),
            (SUB.into(), 2, d2),
            (RESTRICTED.into(), 1, d3),
        ],
        Limits::default().max_io_size,
    )
    .unwrap();
    World {
        target,
        backend,
        d1,
    }
}

/// DLFEAT bit 3 (Write Zeroes may deallocate) only where there is a Write Zeroes: it was set
/// for any namespace that deallocates.
#[test]
fn dlfeat_offers_deallocating_write_zeroes_only_with_write_zeroes() {
    for write_zeroes in [true, false] {
        let d = malloc(SIZE, 512, false);
        let mut info = namespace_info(d.info());
        info.deallocate = true;
        info.write_zeroes = write_zeroes;
        let sub = Subsystem {
            id: 0,
            nqn: SUB.into(),
            serial: "SN-TEST-0004".into(),
            model: "nvmfd test".into(),
            allow_any_host: true,
            hosts: vec![],
            cntlids: nvmfd_nvme::ALL_CNTLIDS,
            namespaces: vec![Namespace {
                nsid: 1,
                info,
                uuid: None,
                nguid: None,
            }],
        };
        let target = Target::new(vec![sub], vec![], Limits::default());
        let backend = Backend::new(
            &[(SUB.into(), 1, Arc::clone(&d))],
            Limits::default().max_io_size,
        )
        .unwrap();
        let w = World {
            target,
            backend,
            d1: d,
        };
        let (mut a, _ios) = w.controller(1);
        let ns = a.identify_namespace(1).unwrap();
        assert_eq!(
            ns.dlfeat,
            1 | u8::from(write_zeroes) << 3,
            "Write Zeroes {write_zeroes}"
        );
        assert_eq!(ns.nsfeat & (1 << 2), 0, "no deallocated-block errors");
    }
}

#[test]
fn the_nvm_identify_controller_reports_the_dataset_management_limits() {
    // No backend limit: DMRL at its largest (one byte, 1's based), the others not imposed.
    let w = world();
    let (mut a, _) = w.controller(1);
    let id = a.identify_controller_nvm().unwrap();
    assert_eq!(
        (id.dmrl, id.dmrsl.get(), id.dmsl.get()),
        (255, u32::MAX, u64::MAX)
    );
    assert_eq!((id.vsl, id.wzsl, id.wusl), (0, 0, 0));
    // The smallest backend limit, in each namespace's own blocks (0 is no limit).
    for (max1, max2, dmrsl) in [(8192, 100, 100), (64, 0, 64), (0, 0, u32::MAX)] {
        let w = limits_world(max1, max2);
        let (mut a, mut ios) = w.controller(1);
        let id = a.identify_controller_nvm().unwrap();
        assert_eq!(
            (id.dmrl, id.dmrsl.get(), id.dmsl.get()),
            (255, dmrsl, u64::MAX),
            "limits {max1}, {max2}"
        );
        assert_eq!(
            a.identify_controller().unwrap().oncs.get() & (1 << 2),
            1 << 2
        );
        // A range longer than DMRSL is not refused: it is deallocated whole.
        if dmrsl < 1024 {
            let data = pattern(5, 1024 * 4096);
            for (i, chunk) in data.chunks(128 * 1024).enumerate() {
                ios[0].write(2, i as u64 * 32, 32, chunk, false).unwrap();
            }
            ios[0].deallocate(2, &[(0, 1024)]).unwrap();
            let mut back = vec![0xAAu8; 128 * 1024];
            for i in 0..32u64 {
                ios[0].read(2, i * 32, 32, &mut back).unwrap();
                assert!(back.iter().all(|&b| b == 0), "block {} read back", i * 32);
            }
        }
    }
    // No Dataset Management (a namespace cannot deallocate): no limits either.
    let w = limits_world(0, 0);
    let mut a = w.admin(&host(1), RESTRICTED).unwrap();
    a.enable().unwrap();
    assert_eq!(a.identify_controller().unwrap().oncs.get() & (1 << 2), 0);
    let id = a.identify_controller_nvm().unwrap();
    assert_eq!((id.dmrl, id.dmrsl.get(), id.dmsl.get()), (0, 0, 0));
    // Another command set, or a discovery controller: Invalid Field.
    let mut s: Sqe = nvmfd_nvme::host::command(0);
    s.opcode = wire::admin_opcode::IDENTIFY;
    s.cdw10 = U32::new(u32::from(wire::cns::IO_COMMAND_SET_CONTROLLER));
    s.cdw11 = U32::new(2 << 24); // zoned namespaces
    let mut buf = vec![0u8; 4096];
    assert!(status_of(a.raw(s, DataDir::FromTarget(&mut buf))).same_code(status::INVALID_FIELD));
    let mut d = w.admin(&host(1), DISCOVERY_NQN).unwrap();
    d.enable().unwrap();
    assert!(status_of(d.identify_controller_nvm()).same_code(status::INVALID_FIELD));
}

#[test]
fn a_log_page_longer_than_the_largest_transfer_is_an_invalid_field() {
    let w = world();
    let (mut a, _) = w.controller(1);
    let max = Limits::default().max_io_size;
    let whole = a.get_log_page(wire::log_page::SMART, 0, max).unwrap();
    assert_eq!(
        whole.len(),
        max as usize,
        "up to MDTS: the page, then zeroes"
    );
    // (Only the length of a page read by mistake is printed.)
    let st = status_of(
        a.get_log_page(wire::log_page::SMART, 0, max + 4)
            .map(|p| p.len()),
    );
    assert!(st.same_code(status::INVALID_FIELD), "{st:?}");
    let st = status_of(
        a.get_log_page(wire::log_page::ERROR, 0, 2 * max)
            .map(|p| p.len()),
    );
    assert!(st.same_code(status::INVALID_FIELD), "{st:?}");
    // The queue goes on.
    a.keep_alive().unwrap();
    let mut d = w.admin(&host(1), DISCOVERY_NQN).unwrap();
    d.enable().unwrap();
    let st = status_of(
        d.get_log_page(wire::log_page::DISCOVERY, 0, max + 1024)
            .map(|p| p.len()),
    );
    assert!(st.same_code(status::INVALID_FIELD), "{st:?}");
    assert_eq!(d.discover().unwrap().len(), 2);
}

#[test]
fn in_capsule_data_described_past_the_receive_is_an_sgl_offset_invalid() {
    let w = world();
    let icd = Limits::default().in_capsule_data_size as usize;
    let connect = |l: &mut Loopback, dptr: SglDesc, capsule_data: usize| {
        let mut cmd: wire::ConnectCmd = wire::zeroed();
        cmd.opcode = 0x7F;
        cmd.flags = 0x40;
        cmd.fctype = wire::fctype::CONNECT;
        cmd.sqsize = U16::new(31);
        cmd.dptr = dptr;
        let mut data: wire::ConnectData = wire::zeroed();
        data.cntlid = U16::new(0xFFFF);
        wire::put_str(&mut data.subnqn, SUB, 0);
        wire::put_str(&mut data.hostnqn, &host(1).nqn, 0);
        let mut c = cmd.as_bytes().to_vec();
        c.extend_from_slice(data.as_bytes());
        c.resize(64 + capsule_data, 0);
        l.send_capsule(&c).unwrap().unwrap()
    };
    // On the admin queue, data described past what a receive holds (the receives are the
    // same for every queue: in_capsule_data_size), with as much as a receive holds arriving.
    let mut l = w.link(0, 31);
    let c = connect(&mut l, SglDesc::in_capsule(0, 2 * icd as u32), icd);
    assert!(
        c.status().same_code(status::SGL_OFFSET_INVALID),
        "{:?}",
        c.status()
    );
    let c = connect(&mut l, SglDesc::in_capsule(icd as u64 - 512, 1024), icd);
    assert!(
        c.status().same_code(status::SGL_OFFSET_INVALID),
        "{:?}",
        c.status()
    );
    // A capsule carrying more than a receive holds.
    let c = connect(&mut l, SglDesc::in_capsule(0, 1024), icd + 1024);
    assert!(
        c.status().same_code(status::DATA_SGL_LENGTH_INVALID),
        "{:?}",
        c.status()
    );
    assert!(l.closed().is_none(), "a status, not a disconnect");
    // The same queue then connects.
    let c = connect(&mut l, SglDesc::in_capsule(0, 1024), 1024);
    assert!(c.status().is_success(), "{:?}", c.status());
    // On an I/O queue: a write described past the receive, as much as it holds arriving.
    let (_a, mut ios) = w.controller(1);
    let l = ios[0].transport();
    let mut s: Sqe = nvmfd_nvme::host::command(0);
    s.opcode = wire::io_opcode::WRITE;
    s.flags = 0x40;
    s.nsid = U32::new(1);
    s.cdw12 = U32::new(2 * icd as u32 / 512 - 1);
    s.dptr = SglDesc::in_capsule(0, 2 * icd as u32);
    let mut c = s.as_bytes().to_vec();
    c.resize(64 + icd, 0);
    let st = l.send_capsule(&c).unwrap().unwrap().status();
    assert!(st.same_code(status::SGL_OFFSET_INVALID), "{st:?}");
}

/// Records every completion the host receives.
struct Recording(Loopback, Vec<wire::Cqe>);

impl nvmfd_nvme::host::HostTransport for Recording {
    fn execute(&mut self, sqe: Sqe, data: DataDir<'_>) -> Result<wire::Cqe, HostError> {
        let c = nvmfd_nvme::host::HostTransport::execute(&mut self.0, sqe, data)?;
        self.1.push(c);
        Ok(c)
    }
}

#[test]
fn the_connect_response_carries_the_sq_head_after_the_connect() {
    let w = world();
    // Admin queue of 4 entries: the Connect took entry 0, so the head is 1, then it moves on
    // with each command and wraps.
    let mut a = AdminQueue::connect(Recording(w.link(0, 3), vec![]), &host(1), SUB, 3, 0).unwrap();
    for _ in 0..5 {
        a.property_get(wire::property::VS, false).unwrap();
    }
    let heads: Vec<u16> = a.transport().1.iter().map(|c| c.sqhd.get()).collect();
    assert_eq!(heads, [1, 2, 3, 0, 1, 2]);
    a.enable().unwrap();
    a.set_queue_count(1).unwrap();
    let mut io = IoQueue::connect(
        Recording(w.link(1, 127), vec![]),
        &host(1),
        SUB,
        a.cntlid,
        1,
        127,
    )
    .unwrap();
    io.flush(1).unwrap();
    let heads: Vec<u16> = io.transport().1.iter().map(|c| c.sqhd.get()).collect();
    assert_eq!(heads, [1, 2], "I/O queue: Connect, then Flush");
    // A refused Connect created no queue: its head is 0.
    let mut l = w.link(0, 31);
    let c = connect_raw(&mut l, "nqn.2024-01.io.nvmfd.test:nope");
    assert!(!c.status().is_success());
    assert_eq!(c.sqhd.get(), 0);
}

fn connect_raw(l: &mut Loopback, subnqn: &str) -> wire::Cqe {
    let mut cmd: wire::ConnectCmd = wire::zeroed();
    cmd.opcode = 0x7F;
    cmd.flags = 0x40;
    cmd.fctype = wire::fctype::CONNECT;
    cmd.sqsize = U16::new(31);
    let mut data: wire::ConnectData = wire::zeroed();
    data.cntlid = U16::new(0xFFFF);
    wire::put_str(&mut data.subnqn, subnqn, 0);
    wire::put_str(&mut data.hostnqn, &host(1).nqn, 0);
    let sqe = wire::read::<Sqe>(cmd.as_bytes()).unwrap();
    nvmfd_nvme::host::HostTransport::execute(l, sqe, DataDir::ToTarget(data.as_bytes())).unwrap()
}
