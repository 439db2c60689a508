//! The RDMA data path end to end on the soft provider: nvmfd's host library connects over RDMA
//! to a reactor's data path, and admin commands, discovery and I/O of every size go through
//! RDMA READ, RDMA WRITE and SEND.

// Sizes in this file are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvmf_host::{QueueOptions, RdmaQueue};
use nvmfd::datapath::{ConnectFailure, DataPath, DataPathConfig};
use nvmfd::srq::{Registrar, SrqConfig};
use nvmfd_blockdev::{Device, DeviceSpec, Kind};
use nvmfd_nvme::host::{AdminQueue, HostId, IoQueue};
use nvmfd_nvme::rdma_cm::{check_request, reject_private_data};
use nvmfd_nvme::{Limits, Namespace, Port, Subsystem, Target, DISCOVERY_NQN};
use nvmfd_rdma::any;
use nvmfd_rdma::soft::Fabric;
use nvmfd_rdma::CmEvent;

const SUB: &str = "nqn.2024-01.io.nvmfd.test:rdma";

fn host() -> HostId {
    HostId {
        nqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000aa".into(),
        id: [0xaa; 16],
    }
}

/// Counts the heap allocations of each thread, so that a test can see what the reactor
/// thread allocates while it serves.
struct CountingAlloc;

thread_local! {
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn count_allocation() {
    if nvmfd_rdma::soft::in_provider() {
        return;
    }
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

// SAFETY: every call is passed to the system allocator with its own arguments; counting
// touches only a const-initialized thread-local cell (no allocation, no destructor).
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        count_allocation();
        // SAFETY: the caller's contract for `alloc` is the system allocator's.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        count_allocation();
        // SAFETY: as for `alloc`.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        count_allocation();
        // SAFETY: `ptr` came from this allocator, which is the system's.
        unsafe { std::alloc::System.realloc(ptr, layout, new) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: as for `realloc`.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAlloc = CountingAlloc;

type DataPathJob = Box<dyn FnOnce(&mut DataPath) + Send>;

struct Served {
    /// The serving thread's allocations so far and its loop turns, published every turn.
    allocations: Arc<std::sync::atomic::AtomicU64>,
    turns: Arc<std::sync::atomic::AtomicU64>,
    stop: Arc<AtomicBool>,
    /// While set, the loop takes CM and async events but does not poll the data path: the
    /// reactor is "busy", and capsules pile up in the SRQ.
    paused: Arc<AtomicBool>,
    /// While set, async events are read but held back (delivered once it clears).
    hold_events: Arc<AtomicBool>,
    /// While set, CM events are left in the channel (taken once it clears).
    hold_cm: Arc<AtomicBool>,
    /// While set, the data path leaves block completions in its engine (a stalled disk).
    hold_block: Arc<AtomicBool>,
    /// Namespaces (bit `nsid`) whose block completions the data path holds back (their disk
    /// alone stalled).
    hold_namespaces: Arc<std::sync::atomic::AtomicU64>,
    /// Work for the serving thread to do on its data path between two polls (what the
    /// reactor does on a command from the control thread).
    run: std::sync::mpsc::Sender<DataPathJob>,
    /// The data path's SRQ.
    srq_id: u32,
    /// Whether its data buffers are on huge pages.
    huge_pools: bool,
    /// Its small and large data buffers, as the data path counts them (0 where unknown).
    pool_counts: (usize, usize),
    thread: Option<std::thread::JoinHandle<()>>,
    fabric: Fabric,
    addr: SocketAddr,
    /// Served by a real reactor thread and its control stand-in (`serve_on_reactor`).
    inproc: Option<nvmfd::inproc::InProcTarget>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.inproc.take();
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A target serving a 512-byte and a 4096-byte RAM namespace on a soft fabric, its reactor and
/// control loop on one thread.
fn serve(port: u16) -> Served {
    serve_with(port, None)
}

/// `serve`, with the data path's sizes overridden.
fn serve_with(port: u16, sizes: Option<(u32, u32)>) -> Served {
    serve_counted(port, sizes, Default::default())
}

/// `serve_with`, counting into `counters`.
fn serve_counted(
    port: u16,
    sizes: Option<(u32, u32)>,
    counters: Arc<nvmfd::stats::DataPathCounters>,
) -> Served {
    serve_full(port, sizes, None, counters)
}

/// What else a served data path may be given.
struct Opts {
    connect_timeout: Duration,
    response_timeout: Duration,
    huge_pages: bool,
    max_qps: u32,
    /// Attaches of namespace 2's device to an engine that fail (out of files).
    attach_failures: u32,
    /// The file namespace (3): its first attach fails, and its next sync.
    file_faults: bool,
}

impl Default for Opts {
    fn default() -> Opts {
        Opts {
            connect_timeout: Duration::from_secs(60),
            response_timeout: nvmfd::datapath::RESPONSE_TIMEOUT,
            huge_pages: false,
            max_qps: nvmfd::datapath::MAX_QPS,
            attach_failures: 0,
            file_faults: false,
        }
    }
}

/// The fixed SRQ the other tests use (64 receives, no growth).
const FIXED_SRQ: SrqConfig = SrqConfig {
    initial: 64,
    max: 64,
    low_watermark: 16,
    chunk: 16,
    shrink_delay: Duration::from_secs(60),
    cover_queues: false,
};

/// `serve_counted`, with an SRQ of `srq` (default `FIXED_SRQ`).
fn serve_full(
    port: u16,
    sizes: Option<(u32, u32)>,
    srq: Option<SrqConfig>,
    counters: Arc<nvmfd::stats::DataPathCounters>,
) -> Served {
    serve_files(port, sizes, srq, counters, None)
}

/// `serve_full`, with a third namespace (NSID 3, 4 KiB blocks) on the file at `file`.
fn serve_files(
    port: u16,
    sizes: Option<(u32, u32)>,
    srq: Option<SrqConfig>,
    counters: Arc<nvmfd::stats::DataPathCounters>,
    file: Option<std::path::PathBuf>,
) -> Served {
    serve_opts(port, sizes, srq, counters, file, Opts::default())
}

/// `serve_files`, ending connections whose host sends no Fabrics Connect within
/// `connect_timeout`.
fn serve_opts(
    port: u16,
    sizes: Option<(u32, u32)>,
    srq: Option<SrqConfig>,
    counters: Arc<nvmfd::stats::DataPathCounters>,
    file: Option<std::path::PathBuf>,
    opts: Opts,
) -> Served {
    let Opts {
        connect_timeout,
        response_timeout,
        huge_pages,
        max_qps,
        attach_failures,
        file_faults,
    } = opts;
    let fabric = Fabric::new();
    fabric.add_device("10.0.0.1".parse().unwrap()).unwrap();
    let addr: SocketAddr = format!("10.0.0.1:{port}").parse().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let paused = Arc::new(AtomicBool::new(false));
    let hold_events = Arc::new(AtomicBool::new(false));
    let hold_cm = Arc::new(AtomicBool::new(false));
    let hcm = Arc::clone(&hold_cm);
    let hold_block = Arc::new(AtomicBool::new(false));
    let hb = Arc::clone(&hold_block);
    let hold_namespaces = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let hn = Arc::clone(&hold_namespaces);
    let allocations = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let turns = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (f, s, p, he) = (
        fabric.clone(),
        Arc::clone(&stop),
        Arc::clone(&paused),
        Arc::clone(&hold_events),
    );
    let (al, tu) = (Arc::clone(&allocations), Arc::clone(&turns));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (run, jobs) = std::sync::mpsc::channel::<DataPathJob>();
    let thread = std::thread::spawn(move || {
        let mk = |bs: u32| {
            let mut spec = DeviceSpec::new(Kind::Malloc);
            spec.size = 16 << 20;
            spec.block_size = bs;
            Device::open(&spec).unwrap()
        };
        let (d1, d2) = (mk(512), mk(4096));
        d2.fail_next_attaches(attach_failures);
        let d3 = file.map(|path| {
            let mut spec = DeviceSpec::new(Kind::File);
            spec.path = Some(path);
            spec.block_size = 4096;
            let d = Device::open(&spec).unwrap();
            if file_faults {
                d.fail_next_attaches(1);
                d.fail_next_sync();
            }
            d
        });
        let ns = |nsid, d: &Arc<Device>| Namespace {
            nsid,
            info: nvmfd::serve::namespace_info(d.info()),
            uuid: None,
            nguid: None,
        };
        let mut namespaces = vec![ns(1, &d1), ns(2, &d2)];
        // The target gives its first subsystem ID 1.
        let mut devices = vec![(1, 1, d1), (1, 2, d2)];
        if let Some(d3) = d3 {
            namespaces.push(ns(3, &d3));
            devices.push((1, 3, d3));
        }
        let limits = Limits::default();
        let target = Target::new(
            vec![Subsystem {
                id: 0,
                nqn: SUB.into(),
                serial: "RDMA1".into(),
                model: "nvmfd".into(),
                allow_any_host: true,
                hosts: vec![],
                cntlids: nvmfd_nvme::ALL_CNTLIDS,
                namespaces,
            }],
            vec![Port {
                id: 0,
                addr: addr.ip(),
                port: addr.port(),
            }],
            limits,
        );
        let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&f).unwrap());
        let listener = ch.listen(addr, 16).unwrap();
        let mut cfg = DataPathConfig {
            srq: srq.unwrap_or(FIXED_SRQ),
            in_capsule: limits.in_capsule_data_size,
            buffers: 16,
            small_buffers: 32,
            max_io: limits.max_io_size,
            requests: 32,
            connect_timeout,
            response_timeout,
            huge_pages,
            max_qps,
        };
        if let Some((buffers, requests)) = sizes {
            cfg.buffers = buffers;
            cfg.small_buffers = requests;
            cfg.requests = requests;
        }
        let dev = listener.device().unwrap();
        let mut dp = DataPath::new(
            &dev,
            target,
            &devices,
            cfg,
            Registrar::spawn().unwrap(),
            counters,
        )
        .unwrap();
        ready_tx.send((dp.srq_id(), dp.buffers())).unwrap();
        let mut held = Vec::new();
        while !s.load(Ordering::Relaxed) {
            // What the control thread and the reactor do with the listener's CM events.
            let event = if hcm.load(Ordering::Relaxed) {
                None
            } else {
                ch.next_event()
            };
            match event {
                Some(CmEvent::ConnectRequest {
                    id,
                    private_data,
                    initiator_depth,
                    ..
                }) => match check_request(&private_data, &limits)
                    .and_then(|r| r.with_read_depth(initiator_depth))
                {
                    Ok(req) => {
                        // A connection that cannot be accepted is rejected and counted.
                        let _ = dp.adopt(id, req);
                    }
                    Err(st) => id.reject(&reject_private_data(st)).unwrap(),
                },
                Some(CmEvent::Disconnected { id }) => dp.disconnected(id),
                Some(CmEvent::Rejected { id, .. }) => {
                    dp.connect_failed(id, ConnectFailure::Rejected)
                }
                Some(CmEvent::Unreachable { id }) => {
                    dp.connect_failed(id, ConnectFailure::Unreachable)
                }
                Some(CmEvent::ConnectError { id }) => {
                    dp.connect_failed(id, ConnectFailure::ConnectError)
                }
                _ => {}
            }
            // What the control thread does: async events go to the data path.
            held.extend(std::iter::from_fn(|| dev.next_numbered_event()));
            if !he.load(Ordering::Relaxed) {
                for (n, ev) in held.drain(..) {
                    dp.on_event(&ev, n, Instant::now());
                }
            }
            dp.hold_block_completions(hb.load(Ordering::Relaxed));
            dp.hold_block_completions_of(hn.load(Ordering::Relaxed));
            for job in jobs.try_iter() {
                job(&mut dp);
            }
            if p.load(Ordering::Relaxed) || !dp.poll(Instant::now()) {
                std::thread::yield_now();
            }
            al.store(ALLOCATIONS.with(std::cell::Cell::get), Ordering::Relaxed);
            tu.fetch_add(1, Ordering::Relaxed);
        }
        drop(listener);
    });
    let (srq_id, bufs) = ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let (huge_pools, pool_counts) = (bufs.4, (bufs.0, bufs.2));
    Served {
        huge_pools,
        pool_counts,
        stop,
        paused,
        hold_events,
        hold_cm,
        hold_block,
        hold_namespaces,
        run,
        allocations,
        turns,
        srq_id,
        thread: Some(thread),
        fabric,
        addr,
        inproc: None,
    }
}

/// A target as the daemon runs it (`nvmfd::inproc`): a real reactor thread serving the data
/// path of `serve`'s namespaces, and a thread standing in for the control thread, handing it
/// connections and events and waking it.
fn serve_on_reactor(
    port: u16,
    cfg: nvmfd::reactor::LoopConfig,
    counters: Arc<nvmfd::stats::DataPathCounters>,
) -> Served {
    serve_on_reactor_with(port, cfg, counters, FIXED_SRQ, Duration::from_secs(60))
}

/// `serve_on_reactor`, with an SRQ of `srq`, ending connections whose host sends no Fabrics
/// Connect within `connect_timeout`.
fn serve_on_reactor_with(
    port: u16,
    cfg: nvmfd::reactor::LoopConfig,
    counters: Arc<nvmfd::stats::DataPathCounters>,
    srq: SrqConfig,
    connect_timeout: Duration,
) -> Served {
    let mk = |bs: u32| {
        let mut spec = DeviceSpec::new(Kind::Malloc);
        spec.size = 16 << 20;
        spec.block_size = bs;
        Device::open(&spec).unwrap()
    };
    let namespaces = vec![(1, mk(512)), (2, mk(4096))];
    serve_namespaces(port, cfg, counters, srq, connect_timeout, namespaces)
}

/// `serve_on_reactor_with`, serving `namespaces`.
fn serve_namespaces(
    port: u16,
    cfg: nvmfd::reactor::LoopConfig,
    counters: Arc<nvmfd::stats::DataPathCounters>,
    srq: SrqConfig,
    connect_timeout: Duration,
    namespaces: Vec<(u32, Arc<Device>)>,
) -> Served {
    let t = nvmfd::inproc::InProcTarget::start(nvmfd::inproc::InProcOptions {
        nqn: SUB.into(),
        namespaces,
        port,
        srq,
        buffers: 16,
        small_buffers: 32,
        requests: 32,
        connect_timeout,
        loop_cfg: cfg,
        counters,
        core: 0,
    })
    .unwrap();
    Served {
        stop: Arc::new(AtomicBool::new(false)),
        paused: Arc::new(AtomicBool::new(false)),
        hold_events: Arc::new(AtomicBool::new(false)),
        hold_cm: Arc::clone(&t.hold_cm),
        hold_block: Arc::new(AtomicBool::new(false)),
        hold_namespaces: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        // Not served on this thread: jobs sent are dropped.
        run: std::sync::mpsc::channel().0,
        allocations: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        turns: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        srq_id: 0,
        huge_pools: false,
        pool_counts: (0, 0),
        thread: None,
        fabric: t.fabric.clone(),
        addr: t.addr,
        inproc: Some(t),
    }
}

/// The reactor of a target `serve_on_reactor` started.
fn reactor(s: &Served) -> &nvmfd::reactor::ReactorHandle {
    s.inproc
        .as_ref()
        .and_then(|t| t.reactor.as_ref())
        .expect("served on a reactor thread")
}

fn queue(s: &Served, qid: u16, sqsize: u16) -> RdmaQueue {
    let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
    RdmaQueue::connect(ch, s.addr, qid, sqsize, 4096, 128 * 1024).unwrap()
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut v);
    v
}

#[test]
fn a_host_connects_over_rdma_and_reads_back_what_it_wrote() {
    let s = serve(4420);
    let h = host();
    let mut admin = AdminQueue::connect(queue(&s, 0, 31), &h, SUB, 31, 5000).unwrap();
    admin.enable().unwrap();
    let id = admin.identify_controller().unwrap();
    assert_eq!(nvmfd_nvme::wire::get_str(&id.subnqn), Some(SUB));
    assert_eq!(admin.active_namespaces(0).unwrap(), [1, 2]);
    assert_eq!(admin.set_queue_count(2).unwrap(), 2);
    let mut ios: Vec<IoQueue<RdmaQueue>> = (1..=2)
        .map(|q| IoQueue::connect(queue(&s, q, 127), &h, SUB, admin.cntlid, q, 127).unwrap())
        .collect();
    let mut seed = 0;
    for (nsid, bs) in [(1u32, 512usize), (2, 4096)] {
        let mut len = bs;
        while len <= 128 * 1024 {
            seed += 1;
            let io = &mut ios[seed as usize % 2];
            let data = pattern(seed, len);
            let slba = seed * 5;
            io.write(nsid, slba, (len / bs) as u32, &data, seed % 3 == 0)
                .unwrap();
            let mut back = vec![0u8; len];
            io.read(nsid, slba, (len / bs) as u32, &mut back).unwrap();
            assert!(back == data, "ns {nsid}, {len} bytes: data differs");
            len *= 2;
        }
    }
    ios[0].flush(1).unwrap();
    ios[0].write_zeroes(1, 0, 8).unwrap();
    ios[0].deallocate(1, &[(100, 8)]).unwrap();
    let mut z = vec![1u8; 4096];
    ios[0].read(1, 0, 8, &mut z).unwrap();
    assert!(z.iter().all(|&b| b == 0));
    let mut big = vec![0u8; 256 * 1024];
    assert!(ios[1].read(1, 0, 512, &mut big).is_err(), "above MDTS");
    admin.shutdown().unwrap();
}

#[test]
fn dataset_management_takes_a_4096_byte_range_buffer_in_the_capsule_and_by_rdma() {
    // What Linux sends: NR + 1 ranges in a 4096-byte buffer, in the capsule when it fits
    // IOCCSZ, else by RDMA READ. The rest of the buffer lists ranges past the namespace's end,
    // which fail the command if the target reads them.
    let s = serve(4440);
    let h = host();
    let mut admin = AdminQueue::connect(queue(&s, 0, 31), &h, SUB, 31, 5000).unwrap();
    admin.enable().unwrap();
    assert_eq!(admin.set_queue_count(2).unwrap(), 2);
    let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
    let keyed_only = RdmaQueue::connect(ch, s.addr, 2, 127, 0, 128 * 1024).unwrap();
    let mut ios = [
        IoQueue::connect(queue(&s, 1, 127), &h, SUB, admin.cntlid, 1, 127).unwrap(),
        IoQueue::connect(keyed_only, &h, SUB, admin.cntlid, 2, 127).unwrap(),
    ];
    for (q, io) in ios.iter_mut().enumerate() {
        let base = 1000 * q as u64;
        let data = pattern(40 + q as u64, 64 * 512);
        io.write(1, base, 64, &data, false).unwrap();
        let mut buf = Vec::with_capacity(4096);
        for (slba, nlb) in [(base + 8, 8u32), (base + 20, 4)] {
            buf.extend_from_slice(&0u32.to_le_bytes());
            buf.extend_from_slice(&nlb.to_le_bytes());
            buf.extend_from_slice(&slba.to_le_bytes());
        }
        while buf.len() < 4096 {
            buf.extend_from_slice(&0u32.to_le_bytes());
            buf.extend_from_slice(&8u32.to_le_bytes());
            buf.extend_from_slice(&(u64::MAX - 4).to_le_bytes());
        }
        let mut sqe: nvmfd_nvme::wire::Sqe = nvmfd_nvme::wire::zeroed();
        sqe.opcode = nvmfd_nvme::wire::io_opcode::DATASET_MANAGEMENT;
        sqe.flags = 0x40;
        sqe.nsid = zerocopy::little_endian::U32::new(1);
        sqe.cdw10 = zerocopy::little_endian::U32::new(1); // 2 ranges
        sqe.cdw11 = zerocopy::little_endian::U32::new(1 << 2); // deallocate
        io.raw(sqe, nvmfd_nvme::host::DataDir::ToTarget(&buf))
            .unwrap_or_else(|e| panic!("queue {}: {e:?}", q + 1));
        let mut back = vec![0u8; 64 * 512];
        io.read(1, base, 64, &mut back).unwrap();
        let mut want = data.clone();
        want[8 * 512..16 * 512].fill(0);
        want[20 * 512..24 * 512].fill(0);
        assert!(
            back == want,
            "queue {}: exactly the two ranges read as zeroes",
            q + 1
        );
    }
}

#[test]
fn a_log_page_longer_than_mdts_is_an_invalid_field_and_the_queue_goes_on() {
    let s = serve(4441);
    let max = Limits::default().max_io_size;
    // The host's buffers take twice the target's MDTS, so its keyed SGL describes all it asks.
    let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
    let big = RdmaQueue::connect(ch, s.addr, 0, 31, 4096, 2 * max).unwrap();
    let mut admin = AdminQueue::connect(big, &host(), SUB, 31, 5000).unwrap();
    admin.enable().unwrap();
    match admin.get_log_page(nvmfd_nvme::wire::log_page::SMART, 0, 2 * max) {
        Err(nvmfd_nvme::host::HostError::Status { status, .. }) => assert!(
            status.same_code(nvmfd_nvme::wire::status::INVALID_FIELD),
            "{status:?}"
        ),
        Ok(page) => panic!("a {}-byte log page was sent", page.len()),
        Err(e) => panic!("{e:?}"),
    }
    admin.ping().unwrap();
    assert_eq!(
        admin
            .get_log_page(nvmfd_nvme::wire::log_page::SMART, 0, 512)
            .unwrap()
            .len(),
        512
    );
}

#[test]
fn discovery_works_over_rdma_and_bad_requests_are_rejected() {
    let s = serve(4421);
    let mut d = AdminQueue::connect(queue(&s, 0, 31), &host(), DISCOVERY_NQN, 31, 0).unwrap();
    d.enable().unwrap();
    let entries = d.discover().unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(nvmfd_nvme::host::discovery_entry_text(&entries[0]).0, SUB);
    // The host deletes a discovery controller with a shutdown (as Linux's `nvme discover`
    // does): it has no namespace to make durable, and completes.
    d.shutdown().unwrap();
    // An HSQSIZE above the limit is refused in the CM exchange.
    let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
    let e = RdmaQueue::connect(ch, s.addr, 1, 4096, 4096, 128 * 1024).unwrap_err();
    assert!(e.to_string().contains("status 0x4"), "{e}");
}

#[test]
fn commands_wait_for_buffers_instead_of_failing() {
    // Two buffers and two request slots for six queues writing and reading at once.
    let counters = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4422, Some((2, 2)), Arc::clone(&counters));
    let h = host();
    let mut admin = AdminQueue::connect(queue(&s, 0, 31), &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    assert_eq!(admin.set_queue_count(6).unwrap(), 6);
    let cntlid = admin.cntlid;
    std::thread::scope(|sc| {
        for q in 1..=6u16 {
            let s = &s;
            let h = h.clone();
            sc.spawn(move || {
                let mut io = IoQueue::connect(queue(s, q, 31), &h, SUB, cntlid, q, 31).unwrap();
                for j in 0..10u64 {
                    let lba = u64::from(q) * 4096 + j * 128;
                    let data = pattern(u64::from(q) * 100 + j, 64 * 1024);
                    io.write(1, lba, 128, &data, false).unwrap();
                    let mut back = vec![0u8; 64 * 1024];
                    io.read(1, lba, 128, &mut back).unwrap();
                    assert!(back == data, "queue {q}, round {j}");
                }
            });
        }
    });
    let queued = counters
        .commands_queued
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(queued > 0, "six queues on two buffers never waited");
    assert_eq!(
        counters
            .command_errors
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

/// Waits (bounded) until `cond` holds.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn the_srq_grows_under_a_burst_and_shrinks_back_when_the_load_stays_low() {
    use std::sync::atomic::Ordering::Relaxed;
    const QUEUES: u16 = 24;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let srq = SrqConfig {
        initial: 16,
        max: 96,
        low_watermark: 4,
        chunk: 16,
        shrink_delay: Duration::from_millis(100),
        cover_queues: false,
    };
    let s = serve_full(4423, Some((64, 64)), Some(srq), Arc::clone(&c));
    let (_admin, mut ios) = controller(&s, QUEUES);
    assert_eq!(c.srq_receives_registered.load(Relaxed), 16);
    assert_eq!(c.srq_limit_events.load(Relaxed), 0);
    // The reactor stops polling and the limit event is held back; each of the 24 queues
    // sends an in-capsule write, so the 16 posted receives run out and 8 SENDs wait (RNR).
    s.set_switch(&s.paused, true);
    s.set_switch(&s.hold_events, true);
    let written: Vec<Vec<u8>> = std::thread::scope(|sc| {
        let handles: Vec<_> = ios
            .iter_mut()
            .enumerate()
            .map(|(q, io)| {
                sc.spawn(move || {
                    let mut all = Vec::new();
                    for round in 0..8u64 {
                        let data = pattern(q as u64 * 1000 + round, 4096);
                        io.write(1, (q as u64 * 8 + round) * 8, 8, &data, false)
                            .unwrap();
                        all.extend_from_slice(&data);
                    }
                    all
                })
            })
            .collect();
        wait_until("16 receives are consumed and 8 SENDs wait", || {
            s.fabric.srq_backlog(s.srq_id) == Some((0, usize::from(QUEUES) - 16))
        });
        // The event reaches the data path, which grows the SRQ: the waiting SENDs land.
        s.hold_events.store(false, Relaxed);
        wait_until("the SRQ grew and the waiting SENDs landed", || {
            c.srq_grows.load(Relaxed) >= 1 && s.fabric.srq_backlog(s.srq_id).unwrap().1 == 0
        });
        assert_eq!(c.srq_limit_events.load(Relaxed), 1, "once per arming");
        s.paused.store(false, Relaxed);
        handles.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert!(c.srq_grows.load(Relaxed) >= 1, "the SRQ never grew");
    let grown = c.srq_receives_registered.load(Relaxed);
    assert!(grown > 16, "registered {grown}");
    assert_eq!(c.command_errors.load(Relaxed), 0, "a command failed");
    // Nothing was lost: every queue reads back what it wrote.
    for (q, io) in ios.iter_mut().enumerate() {
        let mut back = vec![0u8; 8 * 4096];
        io.read(1, q as u64 * 64, 64, &mut back).unwrap();
        assert!(back == written[q], "queue {q}: data differs");
    }
    // Light load: one command at a time never comes near the watermark, so after
    // `shrink_delay` the grown chunks drain and go back.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut n = 0u64;
    while c.srq_receives_registered.load(Relaxed) > 16 {
        assert!(
            Instant::now() < deadline,
            "the SRQ never shrank back: {grown} registered"
        );
        let mut b = vec![0u8; 512];
        ios[(n % 24) as usize].read(1, n % 64, 1, &mut b).unwrap();
        n += 1;
    }
    assert!(c.srq_shrinks.load(Relaxed) >= 1);
    assert_eq!(
        c.receives_posted.load(Relaxed),
        16,
        "every receive went back"
    );
    assert_eq!(c.command_errors.load(Relaxed), 0);
    eprintln!(
        "srq: limit events {}, grows {}, shrinks {}, registered {} -> {} -> {}, empty {}, {} light commands",
        c.srq_limit_events.load(Relaxed),
        c.srq_grows.load(Relaxed),
        c.srq_shrinks.load(Relaxed),
        16,
        grown,
        c.srq_receives_registered.load(Relaxed),
        c.srq_empty.load(Relaxed),
        n
    );
}

#[test]
fn covering_the_queues_grows_the_srq_at_connect_so_no_send_meets_an_empty_srq() {
    use std::sync::atomic::Ordering::Relaxed;
    const QUEUES: u16 = 24;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let srq = SrqConfig {
        initial: 16,
        max: 512,
        low_watermark: 4,
        chunk: 16,
        shrink_delay: Duration::from_millis(50),
        cover_queues: true,
    };
    let s = serve_full(4427, Some((64, 64)), Some(srq), Arc::clone(&c));
    let (_admin, mut ios) = controller_with(&s, QUEUES, 7);
    // Admin queue 32 deep, 24 queues 8 deep: 224 receives, registered before each accept.
    let covered = 32 + u64::from(QUEUES) * 8;
    assert!(
        c.srq_receives_registered.load(Relaxed) >= covered,
        "registered {}",
        c.srq_receives_registered.load(Relaxed)
    );
    // The reactor stops polling; 24 in-capsule writes arrive at once, more than the 16
    // initial receives (the same burst makes 8 SENDs wait in the load-only test above).
    s.set_switch(&s.paused, true);
    std::thread::scope(|sc| {
        let handles: Vec<_> = ios
            .iter_mut()
            .enumerate()
            .map(|(q, io)| {
                sc.spawn(move || {
                    let data = pattern(q as u64, 4096);
                    io.write(1, q as u64 * 8, 8, &data, false).unwrap();
                })
            })
            .collect();
        wait_until("the 24 SENDs landed without waiting", || {
            s.fabric
                .srq_backlog(s.srq_id)
                .is_some_and(|(posted, waiting)| {
                    waiting == 0 && posted as u64 == c.srq_receives_registered.load(Relaxed) - 24
                })
        });
        s.paused.store(false, Relaxed);
        for t in handles {
            t.join().unwrap();
        }
    });
    assert_eq!(c.srq_limit_events.load(Relaxed), 0);
    assert_eq!(c.command_errors.load(Relaxed), 0);
    // Light load for many shrink delays: the SRQ never gives back what the queues need.
    let until = Instant::now() + Duration::from_millis(400);
    let mut n = 0u64;
    while Instant::now() < until {
        let mut b = vec![0u8; 512];
        ios[(n % 24) as usize].read(1, n % 64, 1, &mut b).unwrap();
        n += 1;
    }
    assert!(c.srq_receives_registered.load(Relaxed) >= covered);
    assert!(c.receives_posted.load(Relaxed) >= covered);
}

/// Waits until every pool of the data path is back to its full count: no command in flight,
/// every request slot and buffer free, no block operation or send outstanding, no QP still
/// draining, and (unless the SRQ is broken) every registered receive posted again.
fn wait_pools_full(c: &nvmfd::stats::DataPathCounters, receives: bool) {
    use std::sync::atomic::Ordering::Relaxed;
    wait_until("every pool is back to its full count", || {
        c.requests_active.load(Relaxed) == 0
            && c.requests_waiting.load(Relaxed) == 0
            && c.request_slots_free.load(Relaxed) == c.request_slots.load(Relaxed)
            && c.request_slots.load(Relaxed) > 0
            && c.buffers_free.load(Relaxed) == c.buffers.load(Relaxed)
            && c.block_ops_in_flight.load(Relaxed) == 0
            && c.sends_in_flight.load(Relaxed) == 0
            && c.qps_draining.load(Relaxed) == 0
            && (!receives
                || c.receives_posted.load(Relaxed) == c.srq_receives_registered.load(Relaxed))
    });
}

/// An admin queue and `n` I/O queues of one controller, all 32 deep.
fn controller(s: &Served, n: u16) -> (AdminQueue<RdmaQueue>, Vec<IoQueue<RdmaQueue>>) {
    controller_with(s, n, 31)
}

/// An admin queue (32 deep) and `n` I/O queues of `sqsize + 1` entries, of one controller.
fn controller_with(
    s: &Served,
    n: u16,
    sqsize: u16,
) -> (AdminQueue<RdmaQueue>, Vec<IoQueue<RdmaQueue>>) {
    let h = host();
    let mut admin = AdminQueue::connect(queue(s, 0, 31), &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    assert_eq!(admin.set_queue_count(n).unwrap(), n);
    let cntlid = admin.cntlid;
    let ios = (1..=n)
        .map(|q| IoQueue::connect(queue(s, q, sqsize), &h, SUB, cntlid, q, sqsize).unwrap())
        .collect();
    (admin, ios)
}

/// An enabled controller of `host()` with one I/O queue of `depth` entries that submits
/// without waiting (`nvmf_host::PipelinedQueue`), for data of up to `max_io` bytes.
fn pipelined_controller(
    s: &Served,
    depth: u16,
    max_io: u32,
) -> (AdminQueue<RdmaQueue>, IoQueue<nvmf_host::PipelinedQueue>) {
    let h = host();
    let mut admin = AdminQueue::connect(queue(s, 0, 31), &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    assert_eq!(admin.set_queue_count(1).unwrap(), 1);
    let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
    let q = nvmf_host::PipelinedQueue::connect(ch, s.addr, 1, depth, 4096, max_io).unwrap();
    let io = IoQueue::connect(q, &h, SUB, admin.cntlid, 1, depth - 1).unwrap();
    (admin, io)
}

/// Writes a 4 KiB pattern at block `lba` of namespace 2 and reads it back.
fn write_verified(io: &mut IoQueue<RdmaQueue>, seed: u64, lba: u64) -> Vec<u8> {
    let data = pattern(seed, 4096);
    io.write(2, lba, 1, &data, false).unwrap();
    let mut back = vec![0u8; 4096];
    io.read(2, lba, 1, &mut back).unwrap();
    assert!(back == data, "lba {lba}: read back differs");
    data
}

#[test]
fn a_fatal_qp_with_commands_in_flight_is_torn_down_and_the_other_queue_keeps_serving() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4428, None, Arc::clone(&c));
    let (_admin, mut ios) = controller(&s, 2);
    let before = write_verified(&mut ios[0], 1, 10);
    let qpns = s.fabric.srq_qps(s.srq_id);
    assert_eq!(qpns.len(), 3, "admin and two I/O queues");
    let victim = qpns[2];
    let (mut ok, mut doomed) = {
        let mut it = ios.into_iter();
        (it.next().unwrap(), it.next().unwrap())
    };
    // The reactor stops; the doomed queue's in-capsule write and a read wait in the SRQ.
    s.set_switch(&s.paused, true);
    let doomed_io = std::thread::spawn(move || {
        let w = doomed.write(2, 20, 1, &pattern(2, 4096), false);
        let mut b = vec![0u8; 4096];
        let r = doomed.read(2, 20, 1, &mut b);
        (w.is_err() || r.is_err(), doomed)
    });
    wait_until("the doomed write reached the SRQ", || {
        s.fabric
            .srq_backlog(s.srq_id)
            .is_some_and(|(posted, _)| posted < 64)
    });
    s.fabric.inject_qp_fatal(victim);
    s.paused.store(false, Relaxed);
    // The other queue is served throughout.
    for lba in 30..60 {
        write_verified(&mut ok, lba, lba);
    }
    let (failed, _doomed) = doomed_io.join().unwrap();
    assert!(failed, "the doomed queue's host saw its QP fail");
    wait_until("the QP is torn down for its error", || {
        c.teardowns_qp_error.load(Relaxed) >= 1 && c.connections.load(Relaxed) == 2
    });
    wait_pools_full(&c, true);
    assert!(c.qp_events.load(Relaxed) >= 1);
    assert_eq!(
        c.drain_timeouts.load(Relaxed),
        0,
        "LAST_WQE and the marker both came"
    );
    // Data acknowledged before the fault reads back intact.
    let mut back = vec![0u8; 4096];
    ok.read(2, 10, 1, &mut back).unwrap();
    assert!(back == before);
}

#[test]
fn a_connection_whose_rtu_was_lost_is_established_by_its_first_command() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4511, None, Arc::clone(&c));
    // The host's RTUs (and their resends) never reach the target: its CM waits for one while
    // the QP, in RTS, takes the host's commands.
    s.fabric.lose_rtus(2);
    let (_admin, mut ios) = controller(&s, 1);
    wait_until("both QPs' first commands raised COMM_EST", || {
        c.comm_est_events.load(Relaxed) == 2
    });
    // The REP retries run out: had nvmfd not told the CM (rdma_notify), both connections
    // would end UNREACHABLE here.
    assert_eq!(
        s.fabric.expire_rep_timeouts(),
        0,
        "an accepting ID still waited for its RTU"
    );
    write_verified(&mut ios[0], 7, 3);
    assert_eq!(c.connections.load(Relaxed), 2);
    assert_eq!(c.connects_failed_unreachable.load(Relaxed), 0);
}

#[test]
fn without_last_wqe_a_drain_ends_at_its_bound_and_releases_everything() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4429, None, Arc::clone(&c));
    let (_admin, mut ios) = controller(&s, 2);
    write_verified(&mut ios[1], 3, 5);
    // The device was seen to send LAST_WQE at start; now it stops (as a broken one would).
    s.fabric.set_faults(nvmfd_rdma::soft::Faults {
        suppress_last_wqe: true,
        ..Default::default()
    });
    let victim = s.fabric.srq_qps(s.srq_id)[2];
    let start = Instant::now();
    s.fabric.inject_qp_fatal(victim);
    wait_until("the drain timed out", || {
        c.drain_timeouts.load(Relaxed) == 1
    });
    let waited = start.elapsed();
    assert!(
        waited >= nvmfd::datapath::DRAIN_TIMEOUT,
        "destroyed after {waited:?}, before LAST_WQE or the bound"
    );
    assert_eq!(c.last_wqe_events.load(Relaxed), 0);
    wait_pools_full(&c, true);
    write_verified(&mut ios[0], 4, 6);
}

#[test]
fn an_srq_error_tears_down_all_sixteen_qps_on_it_and_the_rebuilt_srq_serves_again() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4430, None, Arc::clone(&c));
    let (_admin, mut ios) = controller(&s, 15);
    for (q, io) in ios.iter_mut().enumerate() {
        write_verified(io, q as u64, q as u64);
    }
    assert_eq!(s.fabric.srq_qps(s.srq_id).len(), 16);
    s.fabric.inject_srq_error(s.srq_id);
    wait_until("all 16 QPs are torn down", || {
        c.teardowns_device.load(Relaxed) == 16 && c.connections.load(Relaxed) == 0
    });
    wait_pools_full(&c, false);
    assert!(c.device_events.load(Relaxed) >= 1);
    assert_eq!(c.drain_timeouts.load(Relaxed), 0);
    // Once every QP on it is gone the SRQ is rebuilt, and hosts are served again.
    wait_until("the SRQ is rebuilt", || c.srq_rebuilds.load(Relaxed) == 1);
    drop(ios);
    let (_admin, mut ios) = controller(&s, 2);
    for (q, io) in ios.iter_mut().enumerate() {
        write_verified(io, 100 + q as u64, 200 + q as u64);
    }
    wait_pools_full(&c, true);
    assert_eq!(c.srq_rebuilds.load(Relaxed), 1);
}

/// Holds the disk, and writes one block from the capsule on `io` (pattern `seed`) on a thread
/// of its own; returns once the write is at the disk, written from its receive. The thread
/// gives back the queue and the write's result.
fn in_capsule_write_at_a_stalled_disk(
    s: &Served,
    c: &nvmfd::stats::DataPathCounters,
    mut io: IoQueue<RdmaQueue>,
    seed: u64,
) -> std::thread::JoinHandle<(IoQueue<RdmaQueue>, Result<(), nvmfd_nvme::host::HostError>)> {
    use std::sync::atomic::Ordering::Relaxed;
    let from_receive = c.writes_from_receive.load(Relaxed);
    s.set_switch(&s.hold_block, true);
    let writer = std::thread::spawn(move || {
        let r = io.write(2, 9, 1, &pattern(seed, 4096), false);
        (io, r)
    });
    wait_until("the write is at the disk, from its receive", || {
        c.writes_from_receive.load(Relaxed) == from_receive + 1
            && c.block_ops_in_flight.load(Relaxed) == 1
    });
    writer
}

/// A target whose SRQ covers the connected queues (16 receives to start, up to 512), and a
/// controller of `host()` with one I/O queue that has written a block.
fn covered_controller(
    port: u16,
) -> (
    Arc<nvmfd::stats::DataPathCounters>,
    Served,
    AdminQueue<RdmaQueue>,
    Vec<IoQueue<RdmaQueue>>,
) {
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let srq = SrqConfig {
        initial: 16,
        max: 512,
        low_watermark: 4,
        chunk: 16,
        shrink_delay: Duration::from_secs(60),
        cover_queues: true,
    };
    let s = serve_full(port, None, Some(srq), Arc::clone(&c));
    let (admin, mut ios) = controller(&s, 1);
    write_verified(&mut ios[0], 1, 1);
    (c, s, admin, ios)
}

/// A controller of another host (host ID `byte` repeated) with one I/O queue of 32 entries.
fn other_host_controller(s: &Served, byte: u8) -> (AdminQueue<RdmaQueue>, IoQueue<RdmaQueue>) {
    let other = HostId {
        nqn: format!(
            "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000{byte:02x}"
        ),
        id: [byte; 16],
    };
    let mut admin = AdminQueue::connect(queue(s, 0, 31), &other, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    admin.set_queue_count(1).unwrap();
    let io = IoQueue::connect(queue(s, 1, 31), &other, SUB, admin.cntlid, 1, 31).unwrap();
    (admin, io)
}

/// A QP whose drain timed out with an in-capsule write at a stalled disk keeps its receives
/// reserved until the write is done: the receive the write holds is not there for the
/// queues connected meanwhile. The reservation went back when the QP was destroyed, and the
/// SRQ covered the new queues short by what the lingering writes held.
#[test]
fn a_drain_that_times_out_keeps_its_receives_reserved_until_its_writes_are_done() {
    use std::sync::atomic::Ordering::Relaxed;
    let (c, s, _admin, mut ios) = covered_controller(4512);
    // The admin queue and the I/O queue, 32 each.
    assert_eq!(c.srq_receives_reserved.load(Relaxed), 64);
    let victim = s.fabric.srq_qps(s.srq_id)[1];
    let writer = in_capsule_write_at_a_stalled_disk(&s, &c, ios.pop().unwrap(), 97);
    s.fabric.inject_qp_fatal(victim);
    wait_until("the drain timed out on the write at the disk", || {
        c.drain_timeouts.load(Relaxed) == 1 && c.qps_draining.load(Relaxed) == 0
    });
    assert_eq!(
        c.srq_receives_reserved.load(Relaxed),
        64,
        "the lingering write's queue gave its receives back"
    );
    s.hold_block.store(false, Relaxed);
    let (_io, r) = writer.join().unwrap();
    assert!(r.is_err(), "the write's QP was torn down");
    wait_until("the lingering queue's reservation goes back", || {
        c.srq_receives_reserved.load(Relaxed) == 32 && c.block_ops_in_flight.load(Relaxed) == 0
    });
}

/// The same across an SRQ rebuild: the lingering queue's reservation was in the replaced
/// SRQ, and its end leaves the new SRQ's (its new connections') as they are.
#[test]
fn a_lingering_queue_of_a_replaced_srq_gives_back_nothing_of_the_new_ones_reservations() {
    use std::sync::atomic::Ordering::Relaxed;
    let (c, s, _admin, mut ios) = covered_controller(4513);
    let writer = in_capsule_write_at_a_stalled_disk(&s, &c, ios.pop().unwrap(), 98);
    s.fabric.inject_srq_error(s.srq_id);
    wait_until("the SRQ is rebuilt", || c.srq_rebuilds.load(Relaxed) == 1);
    drop(_admin);
    // Another host on the new SRQ: its admin and I/O queues, 32 each.
    let (_other_admin, mut io2) = other_host_controller(&s, 0xcc);
    wait_until("the new host's queues reserved", || {
        c.srq_receives_reserved.load(Relaxed) == 64
    });
    s.hold_block.store(false, Relaxed);
    let _ = writer.join().unwrap();
    wait_until("the stalled write is done", || {
        c.block_ops_in_flight.load(Relaxed) == 0
    });
    write_verified(&mut io2, 5, 5);
    assert_eq!(
        c.srq_receives_reserved.load(Relaxed),
        64,
        "the lingering queue gave back the new host's reservation"
    );
}

/// An SRQ error while an in-capsule write is at a stalled disk, written from its receive: the
/// SRQ is rebuilt as soon as its QPs are gone, and hosts are served again, without waiting
/// for the disk (connections were refused for as long as it took); the old SRQ's memory
/// stays until the write is done.
#[test]
fn an_srq_error_with_an_in_capsule_write_at_a_stalled_disk_is_rebuilt_without_waiting_for_it() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4495, None, Arc::clone(&c));
    let (_admin, mut ios) = controller(&s, 1);
    write_verified(&mut ios[0], 1, 1);
    let writer = in_capsule_write_at_a_stalled_disk(&s, &c, ios.pop().unwrap(), 95);
    s.fabric.inject_srq_error(s.srq_id);
    // Its QP is torn down (the drain gives up on the write at the disk), then the SRQ is
    // rebuilt while the disk still holds the write.
    wait_until("the SRQ is rebuilt", || c.srq_rebuilds.load(Relaxed) == 1);
    assert_eq!(
        c.block_ops_in_flight.load(Relaxed),
        1,
        "the disk gave the write back"
    );
    // Another host (this one's next association waits for its write: Controller Busy).
    let (mut admin, mut io2) = other_host_controller(&s, 0xbb);
    admin.identify_controller().unwrap();
    assert_eq!(
        c.block_ops_in_flight.load(Relaxed),
        1,
        "the disk gave the write back"
    );
    s.hold_block.store(false, Relaxed);
    write_verified(&mut io2, 2, 2);
    let (io, r) = writer.join().unwrap();
    assert!(r.is_err(), "answered on a QP torn down");
    drop((io, io2, admin));
    wait_pools_full(&c, true);
}

/// A receive held by an in-capsule write at a stalled disk across 16 SRQ rebuilds is still
/// told from the current SRQ's: with a 4-bit generation the 16th SRQ had the held receive's,
/// and giving it back re-posted a receive the current SRQ already had posted (posted twice)
/// and kept every replaced SRQ's memory for good.
#[test]
fn a_receive_held_across_sixteen_srq_rebuilds_is_still_the_replaced_srqs() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4496, None, Arc::clone(&c));
    let (_admin, mut ios) = controller(&s, 1);
    write_verified(&mut ios[0], 1, 1);
    let writer = in_capsule_write_at_a_stalled_disk(&s, &c, ios.pop().unwrap(), 96);
    // The data path's SRQ, then each one it builds (the newest SRQ of the fabric).
    let mut srq = s.srq_id;
    let mut replaced = Vec::new();
    for n in 1..=16 {
        s.fabric.inject_srq_error(srq);
        replaced.push(srq);
        wait_until("the SRQ is rebuilt", || c.srq_rebuilds.load(Relaxed) == n);
        srq = *s.fabric.srq_ids().last().unwrap();
    }
    assert_eq!(
        c.block_ops_in_flight.load(Relaxed),
        1,
        "the disk gave the write back"
    );
    s.hold_block.store(false, Relaxed);
    let (io, r) = writer.join().unwrap();
    assert!(r.is_err(), "answered on a QP torn down");
    drop(io);
    wait_pools_full(&c, true);
    // The replaced SRQs go with the held receive; the current SRQ has each of its receives
    // posted once.
    wait_until("the replaced SRQs are let go", || {
        s.fabric.srq_ids().iter().all(|id| !replaced.contains(id))
    });
    let (posted, _) = s.fabric.srq_backlog(srq).unwrap();
    assert_eq!(posted as u64, c.srq_receives_registered.load(Relaxed));
    let (_admin, mut ios) = controller(&s, 1);
    write_verified(&mut ios[0], 3, 3);
}

/// An SRQ error read before the SRQ it names was made is of a destroyed object whose handle
/// the device gave again (kernel handles are reused, lowest first, across kinds): it is
/// dropped. It tore every connection of a healthy data path down before. (A CQ's events are
/// told apart the same way; the data path's CQ is made before any event is read here.)
#[test]
fn an_async_event_read_before_its_srq_or_cq_was_made_is_dropped() {
    use nvmfd_rdma::AsyncEvent;
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4498, None, Arc::clone(&c));
    let (_admin, mut ios) = controller(&s, 1);
    write_verified(&mut ios[0], 1, 1);
    // A rebuilt SRQ, made after an event was read (its own error's).
    s.fabric.inject_srq_error(s.srq_id);
    wait_until("the SRQ is rebuilt", || c.srq_rebuilds.load(Relaxed) == 1);
    let srq = s.on_data_path(|dp| dp.srq_id());
    assert_ne!(srq, s.srq_id);
    let (_admin, mut ios) = controller(&s, 1);
    write_verified(&mut ios[0], 2, 2);
    let devents = c.device_events.load(Relaxed);
    // Numbered 0: read before the rebuilt SRQ was made.
    s.on_data_path(move |dp| dp.on_event(&AsyncEvent::SrqErr(srq), 0, Instant::now()));
    write_verified(&mut ios[0], 3, 3);
    assert_eq!(
        c.device_events.load(Relaxed),
        devents,
        "a stale event was acted on"
    );
    assert_eq!(c.srq_rebuilds.load(Relaxed), 1);
    // Read after it was made, the same event is the SRQ's own.
    let n = s.on_data_path(move |dp| {
        let n = dp.events_read();
        dp.on_event(&AsyncEvent::SrqErr(srq), n, Instant::now());
        n
    });
    assert!(n > 0);
    assert_eq!(
        c.device_events.load(Relaxed),
        devents + 1,
        "the SRQ's own event was dropped"
    );
}

/// A broken SRQ whose rebuild fails (no memory can be registered) is tried again after a
/// wait that doubles from 50 ms, not on every turn: the data path once retried, and logged a
/// warning, each turn, thousands of times a second while other work kept it busy. Once
/// registrations work again, the SRQ is rebuilt and hosts are served.
#[test]
fn a_failed_srq_rebuild_is_tried_again_after_a_growing_wait_and_then_serves() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4483, None, Arc::clone(&c));
    let (_admin, mut ios) = controller(&s, 1);
    write_verified(&mut ios[0], 1, 1);
    let errors = c.srq_errors.load(Relaxed);
    s.fabric.fail_registrations(u32::MAX);
    s.fabric.inject_srq_error(s.srq_id);
    // The SRQ's error event counts one, the first failed rebuild another.
    wait_until("a rebuild failed", || {
        c.srq_errors.load(Relaxed) >= errors + 2
    });
    let first = c.srq_errors.load(Relaxed);
    // The time itself is what is measured: in 400 ms, tries at about 50, 150 and 350 ms
    // after the first (a retry on every turn made thousands).
    std::thread::sleep(Duration::from_millis(400));
    let tries = c.srq_errors.load(Relaxed) - first;
    assert!(tries <= 4, "{tries} tries to rebuild the SRQ in 400 ms");
    assert_eq!(c.srq_rebuilds.load(Relaxed), 0);
    s.fabric.fail_registrations(0);
    wait_until("the SRQ is rebuilt", || c.srq_rebuilds.load(Relaxed) == 1);
    drop(ios);
    let (_admin, mut ios) = controller(&s, 1);
    write_verified(&mut ios[0], 2, 2);
    wait_pools_full(&c, true);
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn a_thousand_connect_disconnect_cycles_leak_no_memory_no_fds_and_no_pool_entries() {
    use std::sync::atomic::Ordering::Relaxed;
    // File descriptors and RSS are the process's: measured in a process of this test alone.
    if std::env::var_os("NVMFD_TEST_ALONE").is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_thousand_connect_disconnect_cycles_leak_no_memory_no_fds_and_no_pool_entries",
                "--nocapture",
            ])
            .env("NVMFD_TEST_ALONE", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr);
        eprintln!("{text}");
        assert!(out.status.success(), "the test failed in its own process");
        assert!(
            text.contains("1000 cycles:"),
            "the test did not run in its own process"
        );
        return;
    }
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4431, None, Arc::clone(&c));
    let h = host();
    let cycle = |n: u64| {
        let mut admin = AdminQueue::connect(queue(&s, 0, 31), &h, SUB, 31, 0).unwrap();
        admin.enable().unwrap();
        admin.ping().unwrap();
        admin.transport().disconnect();
        wait_until("the target tore the queue down", || {
            c.teardowns_disconnect.load(Relaxed) + c.teardowns_controller.load(Relaxed) >= n
                && c.qps_draining.load(Relaxed) == 0
                && c.connections.load(Relaxed) == 0
        });
    };
    for n in 1..=50 {
        cycle(n);
    }
    let (fds, rss) = (open_fds(), rss_kib());
    for n in 51..=1000 {
        cycle(n);
    }
    wait_pools_full(&c, true);
    let (fds_after, rss_after) = (open_fds(), rss_kib());
    eprintln!("1000 cycles: fds {fds} -> {fds_after}, RSS {rss} KiB -> {rss_after} KiB");
    assert_eq!(fds_after, fds, "file descriptors leaked");
    assert!(
        rss_after < rss + 8 * 1024,
        "RSS grew from {rss} KiB to {rss_after} KiB over 950 cycles"
    );
    assert_eq!(c.connections_accepted.load(Relaxed), 1000);
    assert_eq!(c.drain_timeouts.load(Relaxed), 0);
}

/// A host at the CM level only: its QP made and its connect request (an admin queue, 32
/// deep) sent. It goes no further unless the test takes it there.
struct BareHost {
    // Field order is drop order: the ID (with its QP) first.
    id: nvmfd_rdma::soft::cm::CmId,
    ch: nvmfd_rdma::soft::cm::CmChannel,
    _qp_on: (
        nvmfd_rdma::soft::Srq,
        nvmfd_rdma::soft::Cq,
        nvmfd_rdma::soft::Pd,
    ),
}

fn bare_connect(s: &Served) -> BareHost {
    let ch = nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap();
    let mut id = ch.resolve(s.addr, Duration::from_secs(1)).unwrap();
    let dev = id.device().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(16).unwrap();
    let srq = pd.create_srq(16, 1).unwrap();
    let caps = nvmfd_rdma::QpCaps {
        max_send_wr: 16,
        max_send_sge: 1,
        max_recv_wr: 0,
        max_inline_data: 64,
    };
    id.create_qp(&pd, &cq, &srq, caps).unwrap();
    // The NVMe/RDMA CM request: RECFMT 0, QID 0, HRQSIZE 32, HSQSIZE 31.
    let mut req = [0u8; 32];
    req[4..6].copy_from_slice(&32u16.to_le_bytes());
    req[6..8].copy_from_slice(&31u16.to_le_bytes());
    id.connect(&req).unwrap();
    BareHost {
        id,
        ch,
        _qp_on: (srq, cq, pd),
    }
}

/// Sends `n` commands of `opcode` (command IDs from 0; a keyed SGL of no data; Fabrics
/// command type Connect where the opcode is Fabrics) from bare host `h`, each sent before the
/// next; their responses are left where they land.
fn send_commands(h: &BareHost, opcode: u8, n: u16) {
    use nvmfd_rdma::{SendOp, SendWr, Wc, WcStatus};
    let cq = &h._qp_on.1;
    let mut wc = [Wc::default(); 16];
    for cid in 0..n {
        let mut sqe = [0u8; 64];
        sqe[0] = opcode;
        sqe[2..4].copy_from_slice(&cid.to_le_bytes());
        if opcode == 0x7F {
            sqe[4] = 0x01;
        }
        sqe[39] = 0x40;
        h.id.post_send(&[SendWr {
            wr_id: u64::from(cid),
            op: SendOp::Send,
            sges: &[],
            signaled: true,
            inline: Some(&sqe),
        }])
        .unwrap();
        wait_until("the command is sent", || cq.poll(&mut wc).unwrap() == 1);
        assert_eq!(wc[0].status, WcStatus::Success);
    }
}

/// [`bare_connect`], waiting for the target to accept: the connection is established.
fn bare_established(s: &Served) -> BareHost {
    let h = bare_connect(s);
    let ev = (0..1000)
        .find_map(|_| {
            let e = h.ch.next_event();
            if e.is_none() {
                std::thread::sleep(Duration::from_millis(1));
            }
            e
        })
        .expect("the target answers the connect");
    assert!(
        matches!(ev, nvmfd_rdma::soft::cm::CmEvent::Established { .. }),
        "{ev:?}"
    );
    h
}

/// Where a connect fails, and how.
#[derive(Clone, Copy, Debug)]
enum FailedConnect {
    /// The host goes away (its ID destroyed: a REJ) before the target took its request: the
    /// accept fails.
    DestroyedBeforeAccept,
    /// The host's machine vanishes (nothing sent) before the target took its request: the
    /// REP goes unanswered (UNREACHABLE).
    VanishedBeforeAccept,
    /// Accepted, and the host goes away before its RTU (REJECTED).
    DestroyedAfterAccept,
    /// Accepted, and the host vanishes before its RTU (UNREACHABLE).
    VanishedAfterAccept,
    /// Accepted, and the RTU cannot bring the target's QP to RTS (CONNECT_ERROR).
    RtuFails,
    /// Established, and the host never sends a Fabrics Connect (it stays connected).
    SilentAfterEstablished,
    /// Established, and the host vanishes without a Fabrics Connect.
    VanishedAfterEstablished,
}

/// What the data path's counters must come to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ConnectCounts {
    accepted: u64,
    failed_accept: u64,
    rejected: u64,
    unreachable: u64,
    connect_error: u64,
    no_connect: u64,
}

impl ConnectCounts {
    fn of(c: &nvmfd::stats::DataPathCounters) -> ConnectCounts {
        use std::sync::atomic::Ordering::Relaxed;
        ConnectCounts {
            accepted: c.connections_accepted.load(Relaxed),
            failed_accept: c.connects_failed_accept.load(Relaxed),
            rejected: c.connects_failed_rejected.load(Relaxed),
            unreachable: c.connects_failed_unreachable.load(Relaxed),
            connect_error: c.connects_failed_connect_error.load(Relaxed),
            no_connect: c.connects_failed_no_connect.load(Relaxed),
        }
    }
}

/// `n` connects that fail as `how` says, in rounds of at most 100 at once; `want` is what the
/// counters must come to, and every connection, drain and SRQ reservation must be gone.
fn fail_connects(
    s: &Served,
    c: &nvmfd::stats::DataPathCounters,
    want: &mut ConnectCounts,
    how: FailedConnect,
    n: u64,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut left = n;
    while left > 0 {
        let round = left.min(100);
        left -= round;
        let accepted_before = c.connections_accepted.load(Relaxed);
        let wait_accepted = || {
            wait_until("the target accepted every host of the round", || {
                c.connections_accepted.load(Relaxed) == accepted_before + round
            })
        };
        let mut kept = Vec::new();
        // Only the silent ways are ended by the connect timeout (50 ms here). For the others,
        // the data path takes no turn, so its timer cannot run, from before the connects until
        // each failure is counted: on a slow machine, a failure rdma_cm reports after the
        // timeout would otherwise be counted as a missing Fabrics Connect.
        let timed_out = matches!(
            how,
            FailedConnect::SilentAfterEstablished | FailedConnect::VanishedAfterEstablished
        );
        if !timed_out {
            s.set_switch(&s.paused, true);
        }
        match how {
            FailedConnect::DestroyedBeforeAccept | FailedConnect::VanishedBeforeAccept => {
                s.set_switch(&s.hold_cm, true);
                let hosts: Vec<BareHost> = (0..round).map(|_| bare_connect(s)).collect();
                for h in hosts {
                    if matches!(how, FailedConnect::VanishedBeforeAccept) {
                        h.id.vanish();
                    }
                }
                s.hold_cm.store(false, Relaxed);
                if matches!(how, FailedConnect::DestroyedBeforeAccept) {
                    want.failed_accept += round;
                } else {
                    want.accepted += round;
                    want.unreachable += round;
                }
            }
            FailedConnect::DestroyedAfterAccept | FailedConnect::VanishedAfterAccept => {
                let hosts: Vec<BareHost> = (0..round).map(|_| bare_connect(s)).collect();
                wait_accepted();
                for h in hosts {
                    if matches!(how, FailedConnect::VanishedAfterAccept) {
                        h.id.vanish();
                    }
                }
                want.accepted += round;
                if matches!(how, FailedConnect::DestroyedAfterAccept) {
                    want.rejected += round;
                } else {
                    want.unreachable += round;
                }
            }
            FailedConnect::RtuFails => {
                let hosts: Vec<BareHost> = (0..round).map(|_| bare_connect(s)).collect();
                wait_accepted();
                s.fabric.fail_establishments(u32::try_from(round).unwrap());
                for h in &hosts {
                    // The host takes its ESTABLISHED: its RTU goes out.
                    assert!(matches!(
                        h.ch.next_event(),
                        Some(nvmfd_rdma::soft::cm::CmEvent::Established { .. })
                    ));
                }
                kept = hosts;
                want.accepted += round;
                want.connect_error += round;
            }
            FailedConnect::SilentAfterEstablished | FailedConnect::VanishedAfterEstablished => {
                let hosts: Vec<BareHost> = (0..round).map(|_| bare_connect(s)).collect();
                wait_accepted();
                for h in &hosts {
                    assert!(matches!(
                        h.ch.next_event(),
                        Some(nvmfd_rdma::soft::cm::CmEvent::Established { .. })
                    ));
                }
                if matches!(how, FailedConnect::SilentAfterEstablished) {
                    kept = hosts;
                } else {
                    for h in hosts {
                        h.id.vanish();
                    }
                }
                want.accepted += round;
                want.no_connect += round;
            }
        }
        if !timed_out {
            wait_until("every failure of the round counted by its cause", || {
                ConnectCounts::of(c) == *want
            });
            s.paused.store(false, Relaxed);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let done = ConnectCounts::of(c) == *want
                && c.connections.load(Relaxed) == 0
                && c.qps_draining.load(Relaxed) == 0
                && c.srq_receives_reserved.load(Relaxed) == 0;
            if done {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{how:?}: counts {:?}, want {want:?}; connections {}, draining {}, SRQ \
                 receives reserved {}",
                ConnectCounts::of(c),
                c.connections.load(Relaxed),
                c.qps_draining.load(Relaxed),
                c.srq_receives_reserved.load(Relaxed)
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        // Hosts still there were disconnected by the target.
        drop(kept);
    }
}

/// Connects that fail at each step of the connection's setup (after the CONNECT_REQUEST,
/// before the accept completes; after the accept, before ESTABLISHED; after ESTABLISHED,
/// without a Fabrics Connect), 1,000 per step, each way rdma_cm reports it: every connection
/// ends, its QP, CM ID and SRQ reservation are released, no file descriptor stays open, and
/// each is counted by its cause.
#[test]
fn a_thousand_connects_failing_at_each_step_release_everything_and_are_counted_by_cause() {
    use std::sync::atomic::Ordering::Relaxed;
    const NAME: &str =
        "a_thousand_connects_failing_at_each_step_release_everything_and_are_counted_by_cause";
    // File descriptors are the process's: measured in a process of this test alone.
    if std::env::var_os("NVMFD_TEST_ALONE").is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--nocapture"])
            .env("NVMFD_TEST_ALONE", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr);
        eprintln!("{text}");
        assert!(out.status.success(), "the test failed in its own process");
        assert!(
            text.contains("failed connects:"),
            "the test did not run in its own process"
        );
        return;
    }
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let srq = SrqConfig {
        initial: 64,
        max: 4096,
        low_watermark: 16,
        chunk: 64,
        shrink_delay: Duration::from_secs(60),
        cover_queues: true,
    };
    let s = serve_opts(
        4433,
        None,
        Some(srq),
        Arc::clone(&c),
        None,
        Opts {
            connect_timeout: Duration::from_millis(50),
            ..Opts::default()
        },
    );
    use FailedConnect::*;
    let ways = [
        (DestroyedBeforeAccept, 500),
        (VanishedBeforeAccept, 500),
        (DestroyedAfterAccept, 400),
        (VanishedAfterAccept, 300),
        (RtuFails, 300),
        (SilentAfterEstablished, 500),
        (VanishedAfterEstablished, 500),
    ];
    let mut want = ConnectCounts::default();
    // One of each first, so that whatever is made once (SRQ chunks) is in place.
    for (how, _) in ways {
        fail_connects(&s, &c, &mut want, how, 1);
    }
    let fds = open_fds();
    let start = Instant::now();
    for (how, n) in ways {
        fail_connects(&s, &c, &mut want, how, n);
    }
    let fds_after = open_fds();
    eprintln!(
        "failed connects: {want:?} in {:?}; fds {fds} -> {fds_after}",
        start.elapsed()
    );
    assert_eq!(fds_after, fds, "file descriptors leaked");
    assert_eq!(c.connections.load(Relaxed), 0);
    assert_eq!(c.srq_receives_reserved.load(Relaxed), 0);
    assert_eq!(c.drain_timeouts.load(Relaxed), 0);
    // The target still serves.
    let (mut admin, mut ios) = controller(&s, 1);
    write_verified(&mut ios[0], 1, 1);
    admin.ping().unwrap();
}

/// The same failed connects through a real reactor thread, which sleeps between them, and the
/// control thread's stand-in, which routes the CM's failure events to it as the control thread
/// does (`ReactorCmd::ConnectFailed`): each way 100 times, everything released and counted.
#[test]
fn failed_connects_are_released_through_the_real_reactor_thread_while_it_sleeps() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let srq = SrqConfig {
        initial: 64,
        max: 4096,
        low_watermark: 16,
        chunk: 64,
        shrink_delay: Duration::from_secs(60),
        cover_queues: true,
    };
    let cfg = nvmfd::reactor::LoopConfig {
        idle_sleep_after: Duration::from_micros(50),
        max_sleep: Duration::from_millis(20),
    };
    // The connect timeout leaves the CM's failure events time to be routed on a loaded
    // machine (a failed RTU ended by the timeout first counts as no Connect).
    let s = serve_on_reactor_with(4438, cfg, Arc::clone(&c), srq, Duration::from_secs(1));
    use FailedConnect::*;
    let mut want = ConnectCounts::default();
    for how in [
        DestroyedBeforeAccept,
        VanishedBeforeAccept,
        DestroyedAfterAccept,
        VanishedAfterAccept,
        RtuFails,
        SilentAfterEstablished,
        VanishedAfterEstablished,
    ] {
        fail_connects(&s, &c, &mut want, how, 100);
    }
    let sleeps = reactor(&s).shared.counters.sleeps.load(Relaxed);
    assert!(sleeps > 0, "the reactor never slept");
    assert_eq!(c.drain_timeouts.load(Relaxed), 0);
    let (_admin, mut ios) = controller(&s, 1);
    write_verified(&mut ios[0], 2, 2);
}

/// `controller`, but a connection or Connect that fails (an injected loss) gives `None`.
fn try_controller(s: &Served, n: u16) -> Option<(AdminQueue<RdmaQueue>, Vec<IoQueue<RdmaQueue>>)> {
    let h = host();
    let q = |qid: u16| {
        let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
        RdmaQueue::connect(ch, s.addr, qid, 31, 4096, 128 * 1024).ok()
    };
    let mut admin = AdminQueue::connect(q(0)?, &h, SUB, 31, 0).ok()?;
    admin.enable().ok()?;
    admin.set_queue_count(n).ok()?;
    let cntlid = admin.cntlid;
    let ios = (1..=n)
        .map(|qid| IoQueue::connect(q(qid)?, &h, SUB, cntlid, qid, 31).ok())
        .collect::<Option<Vec<_>>>()?;
    Some((admin, ios))
}

#[test]
fn seeded_random_losses_on_the_wire_never_lose_an_acknowledged_write() {
    let (c, failed) = seeded_run(4432, "losses on the wire", |seed| {
        nvmfd_rdma::soft::Faults {
            seed,
            drop_per_million: 15_000,
            ..Default::default()
        }
    });
    assert!(c.teardowns_qp_error.load(Ordering::Relaxed) > 0 || failed > 0);
}

#[test]
fn seeded_random_fatal_qps_and_srq_errors_never_lose_an_acknowledged_write() {
    let (c, _) = seeded_run(4435, "QP_FATAL and SRQ_ERR", |seed| {
        nvmfd_rdma::soft::Faults {
            seed,
            qp_fatal_per_million: 6_000,
            srq_error_per_million: 8_000,
            // As mlx5: a QP destroyed before its completions were reaped takes them along,
            // and the receives among them would be lost to the SRQ forever.
            destroy_drops_completions: true,
            ..Default::default()
        }
    });
    // Both kinds of failure hit the target across the seeds, and the SRQ served again after
    // each rebuild (the final controller of `seeded_run` connected and read everything back).
    assert!(
        c.qp_events.load(Ordering::Relaxed) > 0,
        "no QP_FATAL reached the target"
    );
    assert!(
        c.srq_rebuilds.load(Ordering::Relaxed) > 0,
        "no SRQ error reached the target"
    );
}

/// Writes and reads on fresh controllers under `faults(seed)` for each seed (3, or the one
/// `NVMFD_FAULT_SEED` replays), reconnecting after every failure; then, with the faults off,
/// every pool must be full and every acknowledged write must read back. Returns the
/// counters and how many operations failed.
fn seeded_run(
    port: u16,
    what: &str,
    faults: impl Fn(u64) -> nvmfd_rdma::soft::Faults,
) -> (Arc<nvmfd::stats::DataPathCounters>, u32) {
    use std::sync::atomic::Ordering::Relaxed;
    let seeds: Vec<u64> = match std::env::var("NVMFD_FAULT_SEED") {
        Ok(v) => vec![v.parse().expect("NVMFD_FAULT_SEED is a number")],
        Err(_) => vec![1, 2, 3],
    };
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(port, None, Arc::clone(&c));
    // Every write goes to blocks of its own: one that failed may or may not have landed, but
    // it can never overwrite one that was acknowledged.
    let mut acked: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut next_lba = 0u64;
    let mut failed = 0u32;
    for &seed in &seeds {
        s.fabric.set_faults(faults(seed));
        for _round in 0..12 {
            let Some((_admin, mut ios)) = try_controller(&s, 2) else {
                failed += 1;
                // An SRQ error refuses connections until the SRQ is rebuilt.
                wait_until("the SRQ serves again", || c.connections.load(Relaxed) == 0);
                continue;
            };
            'round: for n in 0..40u64 {
                // 4 KiB goes in the capsule; 8 KiB is pulled with RDMA READ.
                let len = if n % 2 == 0 { 4096 } else { 8192 };
                let lba = next_lba;
                next_lba += 16;
                let data = pattern(seed * 1_000_000 + lba, len);
                let io = &mut ios[(n % 2) as usize];
                if io.write(2, lba, (len / 4096) as u32, &data, false).is_err() {
                    failed += 1;
                    break 'round;
                }
                let mut back = vec![0u8; 4096];
                if io.read(2, lba, 1, &mut back).is_err() {
                    acked.push((lba, data));
                    failed += 1;
                    break 'round;
                }
                // A read that succeeds under the faults has the data of the write before it.
                assert!(
                    back == data[..4096],
                    "seed {seed}: LBA {lba} read back differs"
                );
                acked.push((lba, data));
            }
        }
    }
    s.fabric.set_faults(nvmfd_rdma::soft::Faults::default());
    wait_pools_full(&c, true);
    let (_admin, mut ios) = loop {
        // The last fault may have been an SRQ error: connections wait for its rebuild.
        if let Some(ctrl) = try_controller(&s, 1) {
            break ctrl;
        }
        wait_until("the SRQ is rebuilt", || c.connections.load(Relaxed) == 0);
    };
    for (lba, data) in &acked {
        let mut back = vec![0u8; data.len()];
        ios[0]
            .read(2, *lba, (data.len() / 4096) as u32, &mut back)
            .unwrap();
        assert!(
            back == *data,
            "acknowledged write at LBA {lba} lost (seeds {seeds:?}; replay one with NVMFD_FAULT_SEED)"
        );
    }
    eprintln!(
        "{what}, seeds {seeds:?}: {} acknowledged writes intact, {failed} operations failed by injected faults, teardowns for QP errors {}, device teardowns {}, QP events {}, SRQ rebuilds {}, drain timeouts {}",
        acked.len(),
        c.teardowns_qp_error.load(Relaxed),
        c.teardowns_device.load(Relaxed),
        c.qp_events.load(Relaxed),
        c.srq_rebuilds.load(Relaxed),
        c.drain_timeouts.load(Relaxed)
    );
    assert!(failed > 0, "no fault was injected: the test proved nothing");
    assert!(acked.len() > 100, "too few writes were acknowledged");
    assert_eq!(c.drain_timeouts.load(Relaxed), 0);
    // No QP was destroyed with completions of it still in the CQ (IB 10.3.1), and every
    // receive of the SRQ is posted again (`wait_pools_full` above).
    let drops = s.fabric.destroy_drops();
    assert_eq!(
        (drops.receives, drops.sends),
        (0, 0),
        "completions taken along by a destroyed QP"
    );
    (c, failed)
}

/// A queue of `s` connected with `opts` (responder resources, pieces per transfer).
fn queue_with(s: &Served, qid: u16, sqsize: u16, opts: QueueOptions) -> RdmaQueue {
    let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
    RdmaQueue::connect_with(ch, s.addr, qid, sqsize, 4096, 128 * 1024, opts).unwrap()
}

/// An admin queue and one 32-deep I/O queue per entry of `opts`, of one controller.
fn controller_of(
    s: &Served,
    opts: &[QueueOptions],
) -> (AdminQueue<RdmaQueue>, Vec<IoQueue<RdmaQueue>>) {
    let h = host();
    let mut admin = AdminQueue::connect(queue(s, 0, 31), &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    let n = opts.len() as u16;
    assert_eq!(admin.set_queue_count(n).unwrap(), n);
    let cntlid = admin.cntlid;
    let ios = (1..=n)
        .zip(opts)
        .map(|(q, &o)| IoQueue::connect(queue_with(s, q, 31, o), &h, SUB, cntlid, q, 31).unwrap())
        .collect();
    (admin, ios)
}

/// A host that offers no RDMA READ depth (responder resources 0) is refused at connect with
/// Invalid IRD: it was accepted with a depth of 1, and its first keyed write had the target
/// post a READ the host never granted (on a NIC, a remote error that tears the QP down).
#[test]
fn a_host_offering_no_read_depth_is_refused_at_connect() {
    let s = serve(4497);
    let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
    let opts = QueueOptions {
        responder_resources: 0,
        pieces: 1,
    };
    let e = RdmaQueue::connect_with(ch, s.addr, 0, 31, 4096, 128 * 1024, opts)
        .expect_err("accepted with no read depth");
    assert!(e.to_string().contains("status 0x7"), "{e}");
    // One READ is enough.
    let one = QueueOptions {
        responder_resources: 1,
        pieces: 1,
    };
    let (_admin, mut ios) = controller_of(&s, &[one]);
    write_verified(&mut ios[0], 1, 1);
}

#[test]
fn a_write_in_more_pieces_than_the_read_depth_is_fetched_in_rounds_within_the_depth() {
    // The host takes 2 RDMA READs at once; its writes come in 16 pieces, so each needs 16
    // READs: the target must post them in rounds, never more than 2 in flight, and finish.
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4433, None, Arc::clone(&c));
    let narrow = QueueOptions {
        responder_resources: 2,
        pieces: 16,
    };
    // Another queue of the same controller, one piece at a time, keeps working alongside.
    let (admin, mut ios) = controller_of(&s, &[narrow, QueueOptions::default()]);
    let (mut io, mut other) = (ios.remove(0), ios.remove(0));
    let reads_before = c.rdma_reads.load(Ordering::Relaxed);
    let mut written = Vec::new();
    for (k, blocks) in [(0u64, 32u32), (1, 16), (2, 31)] {
        // 4 KiB blocks of namespace 2: 128 KiB, 64 KiB and 124 KiB in 16 pieces each.
        let data = pattern(100 + k, blocks as usize * 4096);
        let lba = k * 64;
        io.write(2, lba, blocks, &data, false).unwrap();
        written.push((lba, data));
        write_verified(&mut other, 200 + k, 1000 + k);
    }
    let reads = c.rdma_reads.load(Ordering::Relaxed) - reads_before;
    assert!(
        reads >= 3 * 16,
        "every piece was fetched by a READ of its own ({reads} READs)"
    );
    // Reads back in 16 pieces too (16 RDMA WRITEs chained with the SEND), and in one.
    for (lba, data) in &written {
        let blocks = (data.len() / 4096) as u32;
        let mut back = vec![0u8; data.len()];
        io.read(2, *lba, blocks, &mut back).unwrap();
        assert!(back == *data, "lba {lba}: read back in pieces differs");
        let mut back = vec![0u8; data.len()];
        other.read(2, *lba, blocks, &mut back).unwrap();
        assert!(back == *data, "lba {lba}: read back whole differs");
    }
    // On the target's QPs: the narrow one was granted 2 and had 2 READs out at most (so
    // it did need rounds); the others 16. No post ever went past a QP's depth.
    let mut depths: Vec<(u32, u32)> = s
        .fabric
        .srq_qps(s.srq_id)
        .into_iter()
        .filter_map(|q| s.fabric.qp_reads(q))
        .collect();
    depths.sort_unstable();
    assert_eq!(
        depths.first(),
        Some(&(2, 2)),
        "QPs (depth, most READs out): {depths:?}"
    );
    assert!(
        depths[1..].iter().all(|&(d, p)| d == 16 && p <= 16),
        "{depths:?}"
    );
    assert_eq!(s.fabric.read_depth_exceeded(), 0);
    println!(
        "READ depth: {reads} READs for 3 writes of 16 pieces; QPs (depth, most out): {depths:?}"
    );
    drop((io, other, admin));
    wait_pools_full(&c, true);
}

impl Served {
    /// Sets one of the serving thread's switches (`paused`, `hold_*`) and waits until every
    /// later turn sees it: the turn under way when it was set may have read it before, and
    /// served a command the switch was meant to hold. Two jobs run through the serving
    /// thread, one after the other: the turn that runs the second began after the first ran,
    /// which the store happened before (the channel orders them), so that turn and every
    /// later one read the switch as set. The in-process target's control thread reads
    /// `hold_cm` between events and nothing reads the other switches there: it is only set.
    /// Holds the block completions of the namespaces in `nsids` (bit `nsid`) from the
    /// serving thread's next turn on, as [`Served::set_switch`] does.
    fn hold_namespaces(&self, nsids: u64) {
        self.hold_namespaces.store(nsids, Ordering::Relaxed);
        if self.thread.is_none() {
            return;
        }
        for _ in 0..2 {
            self.on_data_path(|_| ());
        }
    }

    fn set_switch(&self, switch: &AtomicBool, on: bool) {
        switch.store(on, Ordering::Relaxed);
        if self.thread.is_none() {
            return;
        }
        for _ in 0..2 {
            self.on_data_path(|_| ());
        }
    }

    /// Runs `f` on the serving thread's data path, between two turns, and waits for its
    /// result.
    fn on_data_path<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut DataPath) -> T + Send + 'static,
    ) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        self.run
            .send(Box::new(move |dp: &mut DataPath| {
                let _ = tx.send(f(dp));
            }))
            .unwrap();
        rx.recv_timeout(Duration::from_secs(20))
            .expect("the serving thread ran a job")
    }

    /// The serving thread's allocations, read once it has finished two more turns (so the
    /// turn that answered the last command is over).
    fn allocations_settled(&self) -> u64 {
        let t = self.turns.load(Ordering::Relaxed);
        wait_until("two more turns", || {
            self.turns.load(Ordering::Relaxed) >= t + 2
        });
        self.allocations.load(Ordering::Relaxed)
    }
}

#[test]
fn serving_io_allocates_nothing_on_the_reactor() {
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4434, None, Arc::clone(&c));
    let pieces = QueueOptions {
        responder_resources: 4,
        pieces: 8,
    };
    let (mut admin, mut ios) = controller_of(&s, &[QueueOptions::default(), pieces]);
    let (mut io, mut io8) = (ios.remove(0), ios.remove(0));
    // Every kind of I/O once, so that whatever grows on first use has grown.
    let mut round = |io: &mut IoQueue<RdmaQueue>, seed: u64| {
        for (nsid, blocks, bs) in [
            (1u32, 1u32, 512usize),
            (1, 8, 512),
            (2, 1, 4096),
            (2, 32, 4096),
        ] {
            let data = pattern(seed + u64::from(blocks), blocks as usize * bs);
            io.write(nsid, 64, blocks, &data, seed.is_multiple_of(2))
                .unwrap();
            let mut back = vec![0u8; data.len()];
            io.read(nsid, 64, blocks, &mut back).unwrap();
            assert!(back == data);
        }
        io.flush(2).unwrap();
        io.write_zeroes(2, 200, 4).unwrap();
        io.deallocate(2, &[(300, 4), (310, 2)]).unwrap();
        admin.ping().unwrap();
        admin.identify_controller().unwrap();
        admin.identify_namespace(2).unwrap();
        admin.get_log_page(0x02, 0, 512).unwrap();
    };
    round(&mut io, 1);
    round(&mut io8, 2);
    let before = s.allocations_settled();
    for k in 0..20 {
        round(&mut io, 10 + k);
        round(&mut io8, 40 + k);
    }
    let from_receive = c.writes_from_receive.load(Ordering::Relaxed);
    let after = s.allocations_settled();
    println!("reactor allocations over 40 rounds of I/O (in-capsule, keyed, 8 pieces; reads, writes, FUA, flush, write zeroes, deallocate) and admin commands (keep-alive, identify controller and namespace, SMART log): {}", after - before);
    assert_eq!(after - before, 0, "the reactor allocated while serving I/O");
    // Each round writes 512 B, 4 KiB and 4 KiB in the capsule (the host puts up to 4 KiB
    // there): 3 per round on each queue, 42 rounds, every one from the receive it came in.
    assert_eq!(
        from_receive,
        42 * 3,
        "in-capsule writes went to the disk from their receive"
    );
    drop((io, io8, admin));
    wait_pools_full(&c, true);
}

/// A Dataset Management command of 256 ranges, one of them longer than one operation of the
/// engine takes (6 GiB), on a file namespace whose engine holds 4 operations: its ranges go
/// in as the engine makes room (QueueFull part-way) and in pieces, and it is answered only
/// when every one of them completed, while another queue's reads and writes take the same
/// request slots over and over. No completion may finish another command (a read answered
/// without its data, a write acknowledged before it is on disk).
#[test]
fn a_dataset_management_command_is_answered_only_when_all_its_ranges_completed() {
    use std::sync::atomic::Ordering::Relaxed;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns3");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(16 << 30)
        .unwrap();
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    // Four request slots and buffers: four block operations at most in the engine.
    let s = serve_files(4431, Some((4, 4)), None, Arc::clone(&c), Some(path));
    let (_admin, mut ios) = controller(&s, 2);
    let mut other = ios.pop().unwrap();
    let mut io = ios.pop().unwrap();
    // Skip visibly where the file system cannot punch holes (the namespace then offers no
    // deallocate).
    if let Err(e) = io.deallocate(3, &[(0, 1)]) {
        skip(&format!("file namespace without deallocate here: {e}"));
        return;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let st = Arc::clone(&stop);
    // Reads and writes on blocks no range touches, verified, taking the slots in turn.
    let rw = std::thread::spawn(move || {
        let mut n = 0u64;
        while !st.load(Relaxed) || n < 50 {
            let lba = 1_000_000 + n % 64;
            let data = pattern(n + 7, 4096);
            other.write(3, lba, 1, &data, n.is_multiple_of(5)).unwrap();
            let mut back = vec![0u8; 4096];
            other.read(3, lba, 1, &mut back).unwrap();
            assert!(back == data, "round {n}, lba {lba}: read back differs");
            n += 1;
        }
        n
    });
    for round in 0..20u64 {
        let base = round * 1024;
        // Data where the ranges go: it must read back as zeroes once the command is answered.
        for k in 0..4 {
            io.write(3, base + 2 * k, 1, &pattern(round * 10 + k, 4096), false)
                .unwrap();
        }
        let mut ranges: Vec<(u64, u32)> = (0..255).map(|k| (base + 2 * k, 1)).collect();
        ranges.push((2_000_000, 1_500_000));
        io.deallocate(3, &ranges)
            .unwrap_or_else(|e| panic!("round {round}: deallocate failed: {e}"));
        for k in 0..4 {
            let mut back = vec![1u8; 4096];
            io.read(3, base + 2 * k, 1, &mut back).unwrap();
            assert!(
                back.iter().all(|&b| b == 0),
                "round {round}: block {} not deallocated when the command was answered",
                base + 2 * k
            );
        }
    }
    stop.store(true, Relaxed);
    let rounds = rw.join().unwrap();
    println!(
        "DSM: 20 commands of 256 ranges answered whole beside {rounds} verified writes and reads; stale completions {}",
        c.stale_completions.load(Relaxed)
    );
    assert_eq!(c.stale_completions.load(Relaxed), 0);
    wait_pools_full(&c, false);
}

/// A command checked against a namespace, and still to reach the disk when that NSID is
/// removed and added again on another device, must not run on the new device: there a
/// Dataset Management command would punch holes in data the host never meant. The DSM
/// waits for room in a full engine (its first four ranges are there, their completions
/// held, a stalled disk) while NSID 3 moves from one file to another.
#[test]
fn a_command_of_a_removed_namespace_never_runs_on_the_device_that_takes_its_nsid() {
    use std::sync::atomic::Ordering::Relaxed;
    let dir = tempfile::tempdir().unwrap();
    let (old_path, new_path) = (dir.path().join("old"), dir.path().join("new"));
    std::fs::File::create(&old_path)
        .unwrap()
        .set_len(16 << 30)
        .unwrap();
    // The new device's first 4 MiB hold data.
    let data = vec![0xa5u8; 4 << 20];
    std::fs::write(&new_path, &data).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&new_path)
        .unwrap()
        .set_len(16 << 30)
        .unwrap();
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    // Four request slots and buffers: four block operations at most in the engine.
    let s = serve_files(4433, Some((4, 4)), None, Arc::clone(&c), Some(old_path));
    let (_admin, mut ios) = controller(&s, 1);
    let mut io = ios.pop().unwrap();
    if let Err(e) = io.deallocate(3, &[(0, 1)]) {
        skip(&format!("file namespace without deallocate here: {e}"));
        return;
    }
    s.set_switch(&s.hold_block, true);
    let dsm = std::thread::spawn(move || {
        let ranges: Vec<(u64, u32)> = (0..255).map(|k| (2 * k, 1)).collect();
        io.deallocate(3, &ranges)
    });
    wait_until("the engine is full and the command waits for room", || {
        c.block_ops_in_flight.load(Relaxed) == 4
    });
    // NSID 3 is removed and added again, on the new file (the target's own view does not
    // matter here: the command was checked before).
    let mut spec = DeviceSpec::new(Kind::File);
    spec.path = Some(new_path.clone());
    spec.block_size = 4096;
    let new_dev = Device::open(&spec).unwrap();
    s.on_data_path(move |dp| {
        dp.detach_namespace(1, 3);
        dp.attach_namespace(1, 3, &new_dev)
    })
    .unwrap();
    s.hold_block.store(false, Relaxed);
    let answer = dsm.join().unwrap();
    assert!(
        answer.is_err(),
        "the command's ranges went to another namespace's device and it succeeded"
    );
    let after = std::fs::read(&new_path).unwrap();
    let first = after[..data.len()].iter().position(|&b| b != 0xa5);
    assert_eq!(
        first, None,
        "the new device's data changed (first at byte {first:?}): {answer:?}"
    );
    wait_pools_full(&c, false);
}

/// A read the target answers without its data must not look as if the data came. The host
/// library's buffer held the same blocks' write, and handed it back: `nvmf verify` passed a
/// target that sends no read data. The buffer is now poisoned before each read.
#[test]
fn a_read_answered_without_its_data_does_not_return_what_the_buffer_held() {
    let s = serve(4480);
    let (_admin, mut ios) = controller(&s, 1);
    let mut io = ios.pop().unwrap();
    // 8 KiB: past the in-capsule size, so the write goes through the host's data buffer.
    let data = pattern(77, 8192);
    io.write(1, 64, 16, &data, false).unwrap();
    s.on_data_path(|dp| dp.omit_read_data(true));
    let mut back = vec![0u8; 8192];
    io.read(1, 64, 16, &mut back).unwrap();
    assert!(
        back != data,
        "a read answered without data returned the data written"
    );
}

/// `nvmf bench --verify` on namespace 2 (4 KiB blocks, the first 64) through `queues` I/O
/// queues of depth 4 of one controller, a thread each, 8 KiB I/Os: the controller's admin
/// queue (kept while the runs go), and a run of `pattern` with `read_pct` reads for `time`.
#[allow(clippy::type_complexity)]
fn verified_bench(
    s: &Served,
    queues: u16,
) -> (
    AdminQueue<RdmaQueue>,
    impl Fn(nvmf_host::bench::Pattern, u32, Duration) -> Result<nvmf_host::bench::Measured, String>,
) {
    let mut admin = AdminQueue::connect(queue(s, 0, 31), &host(), SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    assert_eq!(admin.set_queue_count(queues).unwrap(), queues);
    let (cntlid, fabric, addr) = (admin.cntlid, s.fabric.clone(), s.addr);
    let connect = move |qid: u16| {
        let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&fabric).unwrap());
        let q = nvmf_host::PipelinedQueue::connect(ch, addr, qid, 4, 4096, 8192)?;
        // The last run's queue of this ID may still have a command at the backend.
        IoQueue::connect_waiting(q, &host(), SUB, (cntlid, qid, 3), Duration::from_secs(10))
    };
    let run = move |pattern, read_pct, time| {
        let job = nvmf_host::bench::Job {
            nsid: 2,
            block_size: 4096,
            blocks: 64,
            io_size: 8192,
            depth: 4,
            pattern,
            read_pct,
            queues,
            threads: queues,
            time,
            warmup: Duration::ZERO,
            verify: true,
        };
        nvmf_host::bench::run(
            &job,
            &connect,
            &mut |_, _| {},
            &AtomicBool::new(false),
            &mut || {},
        )
    };
    (admin, run)
}

/// `nvmf bench --verify` against a target that answers reads without their data: the reads'
/// buffers, never written by a read-only run, held zeroes, which count as "never written",
/// so the run passed. They are poisoned now, and the run fails.
#[test]
fn bench_verify_fails_when_reads_come_back_without_their_data() {
    use nvmf_host::bench::Pattern;
    let s = serve(4481);
    let (_admin, run) = verified_bench(&s, 1);
    // Every block written (sequentially, then read back intact) ...
    run(Pattern::Write, 100, Duration::from_millis(300)).expect("the write pass");
    let read = || run(Pattern::Read, 100, Duration::from_millis(200));
    let m = read().expect("the read pass");
    assert!(m.figures[0].verified > 0, "nothing verified: {m:?}");
    // ... then the target stops sending read data.
    s.on_data_path(|dp| dp.omit_read_data(true));
    let e = read().expect_err("reads without data passed the check");
    assert!(e.contains("verify"), "{e}");
}

/// `nvmf bench --verify` against a target that acknowledges writes and loses them: every
/// block read back was intact and in its place, an earlier write's, so the run passed. The
/// bench now knows which writes each read may find, and the run fails.
#[test]
fn bench_verify_fails_when_acknowledged_writes_are_lost() {
    use nvmf_host::bench::Pattern;
    let s = serve(4482);
    let (_admin, run) = verified_bench(&s, 2);
    // Every block written, then a mixed run on a target that keeps its writes passes ...
    run(Pattern::Write, 50, Duration::from_millis(300)).expect("writes");
    let mixed = || run(Pattern::RandRw, 50, Duration::from_millis(500));
    let m = mixed().expect("a mixed run on a sound target");
    let verified: Vec<u64> = m.figures.iter().map(|f| f.verified).collect();
    assert!(
        verified.iter().all(|&v| v > 0),
        "blocks verified: {verified:?}"
    );
    // ... then the target acknowledges writes without making them.
    s.on_data_path(|dp| dp.discard_writes(true));
    let e = match mixed() {
        Ok(m) => panic!(
            "lost writes passed the check: {} blocks verified",
            m.figures.iter().map(|f| f.verified).sum::<u64>()
        ),
        Err(e) => e,
    };
    assert!(e.contains("a write was lost"), "{e}");
}

/// Records a skipped test (the test command lists them) and says so.
fn skip(why: &str) {
    use std::io::Write;
    eprintln!("SKIPPED: {why}");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("skipped-tests.txt");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let test = std::thread::current().name().unwrap_or("?").to_owned();
        let _ = writeln!(f, "daemon datapath {test}: {why}");
    }
}

/// The data path in the real reactor thread: the reactor sleeps once idle (armed, polled
/// once more, then asleep on the completion channel), and a command sent to it then is
/// served at once, every time; a lost wake-up would wait for `max_sleep` (10 s here). Prints
/// the latency of a 4 KiB read sent to a sleeping reactor over 1,000 wakes, and of one sent
/// to a busy-polling reactor.
#[test]
fn through_the_reactor_thread_every_command_sent_to_a_sleeping_reactor_wakes_it_at_once() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let cfg = nvmfd::reactor::LoopConfig {
        idle_sleep_after: Duration::from_micros(200),
        max_sleep: Duration::from_secs(10),
    };
    let s = serve_on_reactor(4433, cfg, Arc::clone(&c));
    let (mut admin, mut ios) = controller(&s, 1);
    let io = &mut ios[0];
    let data = pattern(3, 4096);
    io.write(2, 9, 1, &data, false).unwrap();
    let reactor = &reactor(&s).shared.counters;
    let mut back = vec![0u8; 4096];
    let mut from_sleep = Vec::with_capacity(1000);
    // Sleeps before the last command was sent: the reactor woke from the last of them for
    // it, so once there is one more, it is asleep again (or about to be, armed).
    let mut sleeps = reactor.sleeps.load(Relaxed);
    for _ in 0..1000 {
        wait_until("the reactor sleeps", || {
            reactor.sleeps.load(Relaxed) > sleeps
        });
        sleeps = reactor.sleeps.load(Relaxed);
        let t = Instant::now();
        io.read(2, 9, 1, &mut back).unwrap();
        from_sleep.push(t.elapsed());
        assert!(back == data);
    }
    let mut busy = Vec::with_capacity(1000);
    for _ in 0..1000 {
        let t = Instant::now();
        io.read(2, 9, 1, &mut back).unwrap();
        busy.push(t.elapsed());
    }
    from_sleep.sort();
    busy.sort();
    let pct = |v: &[Duration], p: usize| v[(v.len() * p / 100).min(v.len() - 1)];
    println!(
        "4 KiB read latency, reactor asleep (1000 wakes): p50 {:?}, p99 {:?}, max {:?}; reactor polling: p50 {:?}, p99 {:?}; sleeps {}, caught before sleeping {}",
        pct(&from_sleep, 50),
        pct(&from_sleep, 99),
        from_sleep[from_sleep.len() - 1],
        pct(&busy, 50),
        pct(&busy, 99),
        reactor.sleeps.load(Relaxed),
        reactor.caught_before_sleep.load(Relaxed),
    );
    // Not a speed figure: a wake-up that was lost shows as the 10 s sleep bound.
    assert!(
        from_sleep[from_sleep.len() - 1] < Duration::from_secs(5),
        "a command waited for the sleep bound"
    );
    admin.shutdown().unwrap();
    drop(ios);
    wait_until("the reactor folds the data path's gauges", || {
        c.requests_active.load(Relaxed) == 0 && c.request_slots.load(Relaxed) > 0
    });
}

/// A reset (CC.EN 1 to 0) reports CSTS.RDY = 0 only once every I/O queue of the controller is
/// torn down, drained and destroyed with its block operations completed; a write on the old
/// queue then cannot land after the host writes the same block on the new association.
/// LAST_WQE_REACHED held back (as a slow device would deliver it) keeps the I/O QP draining
/// for as long as the test wants.
#[test]
fn a_reset_is_reported_done_only_after_its_io_queues_drained() {
    use nvmfd_nvme::wire::property;
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4434, None, Arc::clone(&c));
    let (mut admin, mut ios) = controller(&s, 1);
    let old = pattern(41, 4096);
    ios[0].write(2, 12, 1, &old, false).unwrap();
    s.set_switch(&s.hold_events, true);
    let cc = admin.property_get(property::CC, false).unwrap() as u32;
    admin.property_set(property::CC, cc & !1).unwrap();
    wait_until("the I/O QP is torn down and draining", || {
        c.qps_draining.load(Relaxed) == 1
    });
    for _ in 0..20 {
        assert_eq!(
            admin.property_get(property::CSTS, false).unwrap() & 1,
            1,
            "CSTS.RDY read 0 while an I/O queue of the controller was still draining"
        );
    }
    s.hold_events.store(false, Relaxed);
    wait_until("CSTS.RDY reads 0", || {
        admin.property_get(property::CSTS, false).unwrap() & 1 == 0
    });
    assert_eq!(c.qps_draining.load(Relaxed), 0);
    assert_eq!(c.block_ops_in_flight.load(Relaxed), 0);
    drop(ios);
    // The new association writes the same block: what it wrote is what reads back.
    admin.enable().unwrap();
    assert_eq!(admin.set_queue_count(1).unwrap(), 1);
    let h = host();
    let mut io = IoQueue::connect(queue(&s, 1, 31), &h, SUB, admin.cntlid, 1, 31).unwrap();
    let new = pattern(42, 4096);
    io.write(2, 12, 1, &new, false).unwrap();
    let mut back = vec![0u8; 4096];
    io.read(2, 12, 1, &mut back).unwrap();
    assert!(back == new);
    wait_pools_full(&c, false);
}

/// A chain the provider refuses part-way (the 5th of 8 READs of a write in 8 pieces, and the
/// 5th of 8 WRITEs of a read's response): the WRs before it were posted and complete (flushed,
/// as the QP goes down), the others never do. Only what was not posted is counted out, no
/// completion is counted twice (the counts fail loudly in debug builds), a buffer is given
/// back only once nothing posted can touch it, and everything comes back.
#[test]
fn a_chain_refused_part_way_ends_only_what_was_not_posted() {
    use std::sync::atomic::Ordering::Relaxed;
    for (case, port) in [("write", 4435u16), ("read", 4436)] {
        let c = Arc::new(nvmfd::stats::DataPathCounters::default());
        let s = serve_counted(port, None, Arc::clone(&c));
        let pieces = QueueOptions {
            responder_resources: 16,
            pieces: 8,
        };
        let (_admin, mut ios) = controller_of(&s, &[QueueOptions::default(), pieces]);
        let (mut ok, mut io8) = (ios.remove(0), ios.remove(0));
        let kept = write_verified(&mut ok, 1, 3);
        let data = pattern(5, 32 * 1024);
        io8.write(2, 64, 8, &data, false).unwrap();
        let qpns = s.fabric.srq_qps(s.srq_id);
        let victim = qpns[2];
        s.fabric.inject_post_failure(victim, 4);
        let failed = if case == "write" {
            io8.write(2, 64, 8, &pattern(6, 32 * 1024), false).is_err()
        } else {
            let mut back = vec![0u8; 32 * 1024];
            io8.read(2, 64, 8, &mut back).is_err()
        };
        assert!(failed, "{case}: the command on the refused chain must fail");
        wait_until("the QP is torn down for its refused post", || {
            c.post_errors.load(Relaxed) == 1 && c.connections.load(Relaxed) == 2
        });
        wait_pools_full(&c, true);
        assert_eq!(c.drain_timeouts.load(Relaxed), 0, "{case}");
        assert_eq!(c.stale_completions.load(Relaxed), 0, "{case}");
        // The other queue still serves, and what it wrote is there.
        let mut back = vec![0u8; 4096];
        ok.read(2, 3, 1, &mut back).unwrap();
        assert!(back == kept, "{case}");
        write_verified(&mut ok, 2, 4);
    }
}

/// Companion of the tests that drive `DataPath` from their own loop: the same I/O of every
/// size, a QP that fails fatally with the other queue serving on, and everything coming back,
/// through a real reactor thread that arms, sleeps between commands and folds its data
/// path's counters into the reactor's (which are what this test reads).
#[test]
fn through_the_reactor_thread_io_of_every_size_and_a_fatal_qp_leave_every_pool_full() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let cfg = nvmfd::reactor::LoopConfig {
        idle_sleep_after: Duration::from_micros(50),
        max_sleep: Duration::from_secs(10),
    };
    let s = serve_on_reactor(4437, cfg, Arc::clone(&c));
    let (_admin, mut ios) = controller(&s, 2);
    let mut seed = 0;
    let mut len = 4096;
    while len <= 128 * 1024 {
        seed += 1;
        let data = pattern(seed, len);
        let io = &mut ios[seed as usize % 2];
        io.write(2, seed * 40, (len / 4096) as u32, &data, seed % 3 == 0)
            .unwrap();
        let mut back = vec![0u8; len];
        io.read(2, seed * 40, (len / 4096) as u32, &mut back)
            .unwrap();
        assert!(back == data, "{len} bytes: data differs");
        len *= 2;
    }
    let kept = write_verified(&mut ios[0], 100, 7);
    // The second I/O queue's QP fails; the reactor hears of it through its inbox.
    // The reactor's SRQ is the one its three QPs share (each host queue has an SRQ of its own).
    let victim = *s
        .fabric
        .srq_ids()
        .into_iter()
        .map(|id| s.fabric.srq_qps(id))
        .find(|qps| qps.len() == 3)
        .expect("the reactor's SRQ has the admin and two I/O QPs")
        .last()
        .unwrap();
    s.fabric.inject_qp_fatal(victim);
    let mut b = vec![0u8; 4096];
    assert!(
        ios[1].read(2, 7, 1, &mut b).is_err(),
        "the failed QP's host sees it"
    );
    wait_until("the QP is torn down for its error", || {
        c.teardowns_qp_error.load(Relaxed) == 1 && c.connections.load(Relaxed) == 2
    });
    ios[0].read(2, 7, 1, &mut b).unwrap();
    assert!(b == kept);
    wait_pools_full(&c, true);
    assert_eq!(c.drain_timeouts.load(Relaxed), 0);
    assert_eq!(c.stale_completions.load(Relaxed), 0);
    assert!(
        reactor(&s).shared.counters.sleeps.load(Relaxed) > 0,
        "the reactor slept between commands"
    );
}

/// Commands that move 8 KiB or less take small buffers. With two large buffers, 24 reads of
/// 4 KiB arriving at once are all admitted (none waits in its receive), where admission by
/// the large buffers let two in; 24 reads of 64 KiB still wait for the two large buffers.
/// Every read returns what was written.
#[test]
fn small_commands_are_admitted_by_the_small_pool_not_the_large_buffers() {
    use nvmf_host::{Payload, PipelinedQueue};
    use nvmfd_nvme::host::rw_sqe;
    use nvmfd_nvme::wire::io_opcode;
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    // Two large buffers, 32 request slots (and 32 small buffers).
    let s = serve_counted(4442, Some((2, 32)), Arc::clone(&c));
    let (_admin, mut io) = pipelined_controller(&s, 32, 64 * 1024);
    let data = pattern(77, 24 * 64 * 1024);
    let q = io.transport();
    let mut done = Vec::new();
    let mut run = |q: &mut PipelinedQueue, reads: bool, size: usize| -> Vec<Vec<u8>> {
        let blocks = (size / 512) as u32;
        s.set_switch(&s.paused, true);
        for k in 0..24usize {
            let lba = (k * 64 * 1024 / 512) as u64;
            let (op, p) = if reads {
                (io_opcode::READ, Payload::In(size))
            } else {
                let at = k * 64 * 1024;
                (io_opcode::WRITE, Payload::Out(&data[at..at + size]))
            };
            q.submit(k as u64, rw_sqe(op, 1, lba, blocks, false), p)
                .unwrap();
        }
        // All 24 are in the SRQ's receives before the reactor looks at any.
        s.paused.store(false, Relaxed);
        let mut out = vec![Vec::new(); 24];
        let mut left = 24;
        let deadline = Instant::now() + Duration::from_secs(20);
        while left > 0 {
            assert!(Instant::now() < deadline, "{left} commands never completed");
            q.poll(&mut done);
            for d in done.drain(..) {
                d.ok().unwrap();
                let mut b = vec![0u8; size];
                q.data(d.slot, &mut b);
                out[d.tag as usize] = b;
                left -= 1;
            }
        }
        out
    };
    run(q, false, 64 * 1024);
    let queued_before = c.commands_queued.load(Relaxed);
    let small = run(q, true, 4096);
    assert_eq!(
        c.commands_queued.load(Relaxed),
        queued_before,
        "4 KiB reads waited for a buffer: admission counted them against the large buffers"
    );
    let large = run(q, true, 64 * 1024);
    assert!(
        c.commands_queued.load(Relaxed) >= queued_before + 22,
        "24 reads of 64 KiB on two large buffers: {} waited",
        c.commands_queued.load(Relaxed) - queued_before
    );
    for k in 0..24 {
        let at = k * 64 * 1024;
        assert!(small[k] == data[at..at + 4096], "4 KiB read {k}");
        assert!(large[k] == data[at..at + 64 * 1024], "64 KiB read {k}");
    }
    assert_eq!(c.command_errors.load(Relaxed), 0);
    wait_pools_full(&c, false);
}

/// A line of /proc/meminfo, as a number.
fn meminfo(key: &str) -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':')?.trim().parse().ok())
}

/// With `transport.huge_pages`, both pools of data buffers are on 2 MiB huge pages when
/// enough are reserved, and reads and writes of every size go through them intact. The test
/// reserves the pages it needs (root) and gives them back; where it cannot, it says so and
/// skips.
#[test]
fn data_buffers_on_huge_pages_carry_io_of_every_size() {
    const PAGES: u64 = 4; // 32 small buffers of 8 KiB and 16 large of 128 KiB: 1 + 1 pages
    let knob = "/proc/sys/vm/nr_hugepages";
    let Some(before) = std::fs::read_to_string(knob)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
    else {
        skip(&format!(
            "huge-page data buffers: no {knob}, this kernel has no huge pages"
        ));
        return;
    };
    let free = meminfo("HugePages_Free").unwrap_or(0);
    let raised = free < PAGES && std::fs::write(knob, (before + PAGES - free).to_string()).is_ok();
    struct Restore(Option<(String, u64)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some((knob, n)) = self.0.take() {
                let _ = std::fs::write(knob, n.to_string());
            }
        }
    }
    let _restore = Restore(raised.then(|| (knob.to_owned(), before)));
    if meminfo("HugePages_Free").unwrap_or(0) < PAGES {
        skip(&format!(
            "huge-page data buffers: {PAGES} free huge pages are needed and cannot be \
             reserved here (not root, or the kernel refused)"
        ));
        return;
    }
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_opts(
        4443,
        None,
        None,
        Arc::clone(&c),
        None,
        Opts {
            huge_pages: true,
            ..Opts::default()
        },
    );
    assert!(
        s.huge_pools,
        "huge pages were free, yet the pools are on normal pages"
    );
    // A region is whole huge pages; the pools hold what was asked for, not what fits in it
    // (admission trusts these counts).
    assert_eq!(s.pool_counts, (32, 16), "(small, large) buffers");
    let (_admin, mut ios) = controller(&s, 1);
    for (k, blocks) in [1u32, 8, 16, 128, 256].into_iter().enumerate() {
        let lba = k as u64 * 512;
        let data = pattern(900 + k as u64, blocks as usize * 512);
        ios[0].write(1, lba, blocks, &data, false).unwrap();
        let mut back = vec![0u8; data.len()];
        ios[0].read(1, lba, blocks, &mut back).unwrap();
        assert!(back == data, "{} bytes through huge pages", data.len());
    }
    assert_eq!(
        c.command_errors.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    drop(ios);
    drop(s);
}

/// A capsule shorter than a command (32 bytes) is a protocol error: its queue pair is torn
/// down (counted as a controller teardown, logged), nothing is answered, and the other queue
/// of the same controller serves on. The capsule is read where it landed: a short one must
/// not be read past what arrived.
#[test]
fn a_capsule_shorter_than_a_command_ends_its_queue_only() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4444, None, Arc::clone(&c));
    let (_admin, mut ios) = controller(&s, 2);
    let data = pattern(44, 4096);
    ios[0].write(1, 0, 8, &data, false).unwrap();
    let before = c.teardowns_controller.load(Relaxed);
    ios[1].transport().post_raw(&[0x01; 32]).unwrap();
    wait_until("the queue of the short capsule is torn down", || {
        c.teardowns_controller.load(Relaxed) == before + 1
    });
    let mut back = vec![0u8; 4096];
    assert!(
        ios[1].read(1, 0, 8, &mut back).is_err(),
        "the queue served on"
    );
    ios[0].read(1, 0, 8, &mut back).unwrap();
    assert!(back == data);
    assert_eq!(c.command_errors.load(Relaxed), 0);
    wait_pools_full(&c, false);
}

/// `nvmf bench` starts an I/O's clock before its post: a provider that does the transport's
/// work inside `post_send` (rxe does) would otherwise hide that time, and a reply that came in
/// during the post would be measured as nearly instant.
#[test]
fn bench_latency_includes_the_time_spent_in_the_post() {
    let cfg = nvmfd::reactor::LoopConfig {
        idle_sleep_after: Duration::from_millis(1),
        max_sleep: Duration::from_millis(100),
    };
    let s = serve_on_reactor(4470, cfg, Arc::default());
    let h = host();
    let mut admin = AdminQueue::connect(queue(&s, 0, 31), &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    assert_eq!(admin.set_queue_count(1).unwrap(), 1);
    let delay = Duration::from_millis(3);
    s.fabric.set_faults(nvmfd_rdma::soft::Faults {
        post_send_delay: delay,
        ..Default::default()
    });
    let job = nvmf_host::bench::Job {
        nsid: 2,
        block_size: 4096,
        blocks: (16 << 20) / 4096,
        io_size: 4096,
        depth: 1,
        pattern: nvmf_host::bench::Pattern::RandRead,
        read_pct: 100,
        queues: 1,
        threads: 1,
        time: Duration::from_millis(300),
        warmup: Duration::ZERO,
        verify: false,
    };
    let (cntlid, fabric, addr) = (admin.cntlid, s.fabric.clone(), s.addr);
    let connect = move |qid: u16| {
        let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&fabric).unwrap());
        let q = nvmf_host::PipelinedQueue::connect(ch, addr, qid, 2, 4096, 4096)?;
        IoQueue::connect(q, &host(), SUB, cntlid, qid, 1)
    };
    let m = nvmf_host::bench::run(
        &job,
        &connect,
        &mut |_, _| {},
        &AtomicBool::new(false),
        &mut || {},
    )
    .expect("bench runs");
    let lat = &m.figures[0].latency;
    assert!(m.figures[0].ios > 0, "no I/O in {:?}", job.time);
    // Each read waits for the host's post and then the target's reply.
    assert!(
        lat.min() >= u64::try_from(delay.as_nanos()).unwrap(),
        "the fastest read took {} ns, less than the {delay:?} its post took",
        lat.min()
    );
    s.fabric.set_faults(nvmfd_rdma::soft::Faults::default());
}

/// The target's data buffers are the source of its RDMA WRITEs and the sink of its RDMA
/// READs; no host may reach them. A host that guesses every key and address the fabric has
/// (here it is told them) gets a remote access error from each, and the target serves on.
#[test]
fn a_host_guessing_keys_cannot_read_or_write_the_targets_memory() {
    use nvmfd_rdma::{SendOp, SendWr, Sge, Wc, WcStatus};
    let s = serve(4471);
    // A controller whose I/O leaves data in the target's buffers.
    let (_admin, mut ios) = controller(&s, 1);
    let secret = write_verified(&mut ios[0], 7, 0);
    let regions = s.fabric.memory_regions();
    assert!(!regions.is_empty());
    let mut refused = 0;
    for &(rkey, addr, len) in &regions {
        for write in [true, false] {
            let h = bare_established(&s);
            let pd = &h._qp_on.2;
            let mr = pd
                .alloc_mr(64, nvmfd_rdma::Access::LOCAL_WRITE)
                .expect("attacker's MR");
            let n = len.min(64) as u32;
            let op = if write {
                SendOp::RdmaWrite {
                    remote_addr: addr,
                    rkey,
                }
            } else {
                SendOp::RdmaRead {
                    remote_addr: addr,
                    rkey,
                }
            };
            let sge = [Sge {
                addr: mr.addr(),
                length: n,
                lkey: mr.lkey(),
            }];
            h.id.post_send(&[SendWr {
                wr_id: 1,
                op,
                sges: &sge,
                signaled: true,
                inline: None,
            }])
            .expect("post");
            let cq = &h._qp_on.1;
            let mut wc = [Wc::default(); 4];
            let got = (0..2000)
                .find_map(|_| {
                    let n = cq.poll(&mut wc).unwrap();
                    if n == 0 {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    (n > 0).then(|| wc[0])
                })
                .expect("the RDMA operation completes");
            // Refused by the key and domain check itself (a failure of any other kind, a peer
            // not ready say, would not show that the check holds).
            assert_eq!(
                got.status,
                WcStatus::RemAccessErr,
                "a stranger's RDMA {} at {addr:#x} (rkey {rkey:#x}, {len} bytes)",
                if write { "WRITE" } else { "READ" }
            );
            refused += 1;
        }
    }
    assert_eq!(refused, regions.len() * 2);
    // The target serves on, and what was written is intact.
    let mut back = vec![0u8; 4096];
    ios[0].read(2, 0, 1, &mut back).unwrap();
    assert_eq!(back, secret);
}

/// Reads of a null namespace are sent from the target's zero region: zeroes reach the host
/// over whatever was in its buffer, at every size and in every piece of a keyed list; a read
/// past the end is refused, and a write is taken and discarded.
#[test]
fn null_namespace_reads_send_zeroes_of_every_size_and_piece() {
    let mut spec = DeviceSpec::new(Kind::Null);
    spec.size = 1 << 20;
    spec.block_size = 512;
    let null = Device::open(&spec).unwrap();
    let cfg = nvmfd::reactor::LoopConfig {
        idle_sleep_after: Duration::from_millis(1),
        max_sleep: Duration::from_millis(100),
    };
    let s = serve_namespaces(
        4472,
        cfg,
        Arc::default(),
        FIXED_SRQ,
        Duration::from_secs(60),
        vec![(1, null)],
    );
    let one = QueueOptions::default();
    let four = QueueOptions {
        pieces: 4,
        ..QueueOptions::default()
    };
    let (_admin, mut ios) = controller_of(&s, &[one, four]);
    for io in &mut ios {
        for blocks in [1u32, 8, 16, 17, 64, 256] {
            let len = blocks as usize * 512;
            // The host's buffer holds a pattern first: only the target's zeroes clear it.
            let data = pattern(u64::from(blocks), len);
            io.write(1, 3, blocks, &data, false).unwrap();
            let mut back = vec![0xa5u8; len];
            io.read(1, 3, blocks, &mut back).unwrap();
            assert!(
                back.iter().all(|&b| b == 0),
                "{blocks} blocks: a null namespace's read is not all zeroes"
            );
        }
        let mut back = vec![0u8; 1024];
        match io.read(1, 2047, 2, &mut back) {
            Err(nvmfd_nvme::host::HostError::Status { status, .. }) => {
                assert_eq!(status.sc(), 0x80, "{status:?}: not LBA Out of Range");
            }
            other => panic!("a read past the end: {other:?}"),
        }
    }
}

/// A controller of two I/O queues with queue 1 connected: its admin queue, queue 1, and
/// queue 1's QP numbers on the target and on the host.
fn controller_with_queue_1(s: &Served) -> (AdminQueue<RdmaQueue>, IoQueue<RdmaQueue>, u32, u32) {
    let h = host();
    let mut admin = AdminQueue::connect(queue(s, 0, 31), &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    assert_eq!(admin.set_queue_count(2).unwrap(), 2);
    let before = s.fabric.srq_qps(s.srq_id);
    let mut io = IoQueue::connect(queue(s, 1, 31), &h, SUB, admin.cntlid, 1, 31).unwrap();
    let target_qpn = *s
        .fabric
        .srq_qps(s.srq_id)
        .iter()
        .find(|q| !before.contains(q))
        .expect("the target's QP of the queue");
    let host_qpn = io.transport().qpn().expect("host QP");
    (admin, io, target_qpn, host_qpn)
}

/// A QP destroyed when its drain timed out (a read stuck behind a stalled disk) leaves its
/// request behind. The device gives its QP number to the next QP, whose connection takes the
/// same index in the data path. When the stuck read completes at last, its response must not
/// go to the new connection: the new host's command of the same ID would be answered by it.
#[test]
fn a_late_completion_of_a_destroyed_qp_never_answers_a_new_qp_of_the_same_number() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4473, None, Arc::clone(&c));
    let h = host();
    let (admin, mut old, old_target_qpn, old_host_qpn) = controller_with_queue_1(&s);
    let cntlid = admin.cntlid;
    // A write to read back later, then a read whose completion the stalled disk holds.
    let data = pattern(73, 4096);
    old.write(2, 5, 1, &data, false).unwrap();
    s.set_switch(&s.hold_block, true);
    let zeroes = |lba| {
        let mut sqe =
            nvmfd_nvme::host::rw_sqe(nvmfd_nvme::wire::io_opcode::WRITE_ZEROES, 2, lba, 1, false);
        sqe.cid = 0x77u16.into();
        sqe
    };
    old.transport().post(zeroes(9)).unwrap();
    wait_until("the command is in the engine", || {
        c.requests_active.load(Relaxed) == 1
    });
    // The host goes; the drain waits for the read, then gives up and destroys the QP.
    drop(old);
    wait_until("the drain times out", || {
        c.drain_timeouts.load(Relaxed) == 1
    });
    // The same host connects queue 2 of its controller: its QP and the target's take the
    // numbers of the destroyed ones.
    s.fabric.reuse_qp_numbers(&[old_host_qpn, old_target_qpn]);
    let mut new = IoQueue::connect(queue(&s, 2, 31), &h, SUB, cntlid, 2, 31).unwrap();
    assert_eq!(new.transport().qpn(), Some(old_host_qpn));
    assert!(s.fabric.srq_qps(s.srq_id).contains(&old_target_qpn));
    // A command of the new queue with the stuck read's ID is outstanding when the disk
    // comes back.
    let qp_errors = c.teardowns_qp_error.load(Relaxed);
    new.transport().post(zeroes(11)).unwrap();
    wait_until("both commands are in the engine", || {
        c.requests_active.load(Relaxed) == 2
    });
    s.hold_block.store(false, Relaxed);
    wait_until("both commands are done", || {
        c.requests_active.load(Relaxed) == 0
    });
    // The queue serves on, with what was written before intact; meanwhile the completions
    // of what was posted on it arrive.
    let mut back = vec![0u8; 4096];
    new.read(2, 5, 1, &mut back).unwrap();
    assert!(back == data);
    let got = new.transport().take_others();
    assert_eq!(
        got.len(),
        1,
        "the new queue's one posted command got {} completions: {got:?}",
        got.len()
    );
    assert_eq!(c.teardowns_qp_error.load(Relaxed), qp_errors);
    drop(new);
    drop(admin);
}

/// Two QPs of one number (the device reused it) destroyed with their drains timed out, each
/// with a write at a stalled disk: their lingering queues were kept by QP number, so the
/// second's queue stayed while the first's write was stuck, though its own had completed,
/// and its controller's reset never ended (RDY read 1) for another association's disk.
/// Each lingering queue goes with its own requests now.
#[test]
fn a_lingering_queue_goes_with_its_own_requests_not_with_another_of_its_qp_number() {
    use nvmfd_nvme::wire::property;
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4479, None, Arc::clone(&c));
    let h = host();
    let zeroes = |nsid, lba| {
        nvmfd_nvme::host::rw_sqe(
            nvmfd_nvme::wire::io_opcode::WRITE_ZEROES,
            nsid,
            lba,
            1,
            false,
        )
    };
    // Controller 2 (another association), made first: its admin queue's QPs would take the
    // slots the destroyed QPs free.
    let mut admin2 = AdminQueue::connect(queue(&s, 0, 31), &h, SUB, 31, 0).unwrap();
    admin2.enable().unwrap();
    assert_eq!(admin2.set_queue_count(1).unwrap(), 1);
    // Controller 1: a write to namespace 2, whose disk stalls; its queue goes.
    let (admin1, mut old, old_target_qpn, old_host_qpn) = controller_with_queue_1(&s);
    s.hold_namespaces(1 << 2);
    old.transport().post(zeroes(2, 9)).unwrap();
    wait_until("the first write is at the disk", || {
        c.requests_active.load(Relaxed) == 1
    });
    drop(old);
    wait_until("the first drain times out", || {
        c.drain_timeouts.load(Relaxed) == 1
    });
    // Controller 2's queue takes the destroyed QP's numbers, a write to namespace 1 stalls
    // too, and its queue goes.
    s.fabric.reuse_qp_numbers(&[old_host_qpn, old_target_qpn]);
    let mut new = IoQueue::connect(queue(&s, 1, 31), &h, SUB, admin2.cntlid, 1, 31).unwrap();
    assert!(s.fabric.srq_qps(s.srq_id).contains(&old_target_qpn));
    s.hold_namespaces(1 << 2 | 1 << 1);
    new.transport().post(zeroes(1, 9)).unwrap();
    wait_until("both writes are at their disks", || {
        c.requests_active.load(Relaxed) == 2
    });
    drop(new);
    wait_until("the second drain times out", || {
        c.drain_timeouts.load(Relaxed) == 2
    });
    // Namespace 1's disk comes back; namespace 2's stays stalled.
    s.hold_namespaces(1 << 2);
    wait_until("the second write is done", || {
        c.requests_active.load(Relaxed) == 1
    });
    // Controller 2 has no queue left: its reset ends.
    admin2.property_set(property::CC, 0).unwrap();
    wait_until("controller 2's reset ends (RDY reads 0)", || {
        admin2.property_get(property::CSTS, false).unwrap() & 1 == 0
    });
    s.hold_namespaces(0);
    wait_until("the first write is done", || {
        c.requests_active.load(Relaxed) == 0
    });
    drop(admin2);
    drop(admin1);
}

/// Send completions of a QP destroyed when its drain timed out can still come (rxe leaves a
/// destroyed QP's completions in its CQ), after the device gave its number to a new QP. The
/// response SEND of the old queue's last read and its drain marker, held back by the soft
/// device until the new queue is connected, must be dropped as stale: not counted out of
/// the new connection's sends, and not taken, flushed, for a failure of the new QP. Before,
/// the SEND's completion was counted out of the new connection ("released 1 of 0": the
/// reactor stopped in a debug build) and the flushed marker tore the new queue down.
#[test]
fn late_send_completions_of_a_destroyed_qp_leave_a_new_qp_of_the_same_number_alone() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4474, None, Arc::clone(&c));
    let h = host();
    let (admin, mut old, old_target_qpn, old_host_qpn) = controller_with_queue_1(&s);
    let cntlid = admin.cntlid;
    let data = pattern(74, 4096);
    old.write(2, 5, 1, &data, false).unwrap();
    // The device writes the target QP's send completions late: the host has its data and
    // response, the target has not seen the SEND complete.
    s.fabric.hold_send_completions(old_target_qpn);
    let mut back = vec![0u8; 4096];
    old.read(2, 5, 1, &mut back).unwrap();
    assert!(back == data);
    drop(old);
    wait_until("the drain times out", || {
        c.drain_timeouts.load(Relaxed) == 1
    });
    s.fabric.reuse_qp_numbers(&[old_host_qpn, old_target_qpn]);
    let mut new = IoQueue::connect(queue(&s, 2, 31), &h, SUB, cntlid, 2, 31).unwrap();
    assert_eq!(new.transport().qpn(), Some(old_host_qpn));
    assert!(s.fabric.srq_qps(s.srq_id).contains(&old_target_qpn));
    let (qp_errors, stale) = (
        c.teardowns_qp_error.load(Relaxed),
        c.stale_completions.load(Relaxed),
    );
    // The SEND's completion and the drain marker's flush, naming the new QP's number.
    assert_eq!(s.fabric.release_held_completions(), 2);
    wait_until("both are dropped as stale", || {
        c.stale_completions.load(Relaxed) == stale + 2
    });
    // The new queue serves on.
    for lba in [5u64, 6] {
        let data = pattern(lba, 4096);
        new.write(2, lba, 1, &data, false).unwrap();
        let mut back = vec![0u8; 4096];
        new.read(2, lba, 1, &mut back).unwrap();
        assert!(back == data, "LBA {lba} read back differs");
    }
    assert_eq!(c.teardowns_qp_error.load(Relaxed), qp_errors);
    assert_eq!(
        c.connections.load(Relaxed),
        2,
        "the admin and the new I/O queue"
    );
    drop(new);
    drop(admin);
}

/// A late drain marker of a destroyed QP must not end the drain of a new QP given its number:
/// the new QP's own marker, held back by the device, has not come, so its drain goes on. (A
/// drain ended early ends the requests still waiting on its network while the NIC may still
/// touch their buffers.) Before markers were numbered, the old marker ended it.
#[test]
fn a_late_drain_marker_of_a_destroyed_qp_leaves_the_drain_of_a_new_qp_of_its_number_alone() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4477, None, Arc::clone(&c));
    let h = host();
    let (admin, old, target_qpn, host_qpn) = controller_with_queue_1(&s);
    let cntlid = admin.cntlid;
    // The old QP's marker is held back: its drain times out and it is destroyed.
    s.fabric.hold_send_completions(target_qpn);
    drop(old);
    wait_until("the drain times out", || {
        c.drain_timeouts.load(Relaxed) == 1
    });
    s.fabric.reuse_qp_numbers(&[host_qpn, target_qpn]);
    let new = IoQueue::connect(queue(&s, 2, 31), &h, SUB, cntlid, 2, 31).unwrap();
    assert!(s.fabric.srq_qps(s.srq_id).contains(&target_qpn));
    // The new QP goes too, its marker held back as well.
    s.fabric.hold_send_completions(target_qpn);
    drop(new);
    wait_until("the new QP drains", || c.qps_draining.load(Relaxed) == 1);
    let stale = c.stale_completions.load(Relaxed);
    assert_eq!(
        s.fabric.release_first_held_completions(1),
        1,
        "the old marker"
    );
    wait_until("the old marker is dropped as stale", || {
        c.stale_completions.load(Relaxed) == stale + 1
    });
    // Turns of the serving loop: a drain with everything it waits for ends within two.
    for _ in 0..4 {
        s.on_data_path(|_| ());
    }
    assert_eq!(
        c.qps_draining.load(Relaxed),
        1,
        "the new QP's drain waits for its own marker"
    );
    assert_eq!(s.fabric.release_held_completions(), 1, "the new marker");
    wait_until("the new QP's drain ends", || {
        c.qps_draining.load(Relaxed) == 0
    });
    assert_eq!(c.drain_timeouts.load(Relaxed), 1);
    drop(admin);
}

/// An async event read before its QP was destroyed can reach the data path after the device
/// gave the QP's number to a new QP (the control thread reads events and hands them on). A
/// torn-down QP whose LAST_WQE_REACHED is held up that long is destroyed when its drain times
/// out; a new queue's QP takes its number; then the old event comes. Events are numbered as
/// they are read, and one read before the QP of its number was created is not that QP's:
/// the new queue serves on. Before, the event tore it down.
#[test]
fn a_late_event_of_a_destroyed_qp_leaves_a_new_qp_of_the_same_number_alone() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4475, None, Arc::clone(&c));
    let h = host();
    let (admin, old, old_target_qpn, old_host_qpn) = controller_with_queue_1(&s);
    let cntlid = admin.cntlid;
    // The host goes; the QP's LAST_WQE_REACHED is read and held up, so its drain times out.
    s.set_switch(&s.hold_events, true);
    drop(old);
    wait_until("the drain times out", || {
        c.drain_timeouts.load(Relaxed) == 1
    });
    s.fabric.reuse_qp_numbers(&[old_host_qpn, old_target_qpn]);
    let mut new = IoQueue::connect(queue(&s, 2, 31), &h, SUB, cntlid, 2, 31).unwrap();
    assert!(s.fabric.srq_qps(s.srq_id).contains(&old_target_qpn));
    let (qp_errors, last_wqes) = (
        c.teardowns_qp_error.load(Relaxed),
        c.last_wqe_events.load(Relaxed),
    );
    // The old event, naming the new QP's number, is delivered.
    s.set_switch(&s.hold_events, false);
    for lba in [7u64, 8] {
        let data = pattern(lba, 4096);
        new.write(2, lba, 1, &data, false).unwrap();
        let mut back = vec![0u8; 4096];
        new.read(2, lba, 1, &mut back).unwrap();
        assert!(back == data, "LBA {lba} read back differs");
    }
    assert_eq!(c.teardowns_qp_error.load(Relaxed), qp_errors);
    assert_eq!(c.last_wqe_events.load(Relaxed), last_wqes);
    assert_eq!(
        c.connections.load(Relaxed),
        2,
        "the admin and the new I/O queue"
    );
    drop(new);
    drop(admin);
}

/// The CQ is sized for the SRQ the device allows, not for a larger `srq_max`: on the soft
/// provider (SRQs of 16,384 receives at most, CQs of 32,767 entries) an `srq_max` of 32,768
/// took the CQ's room for drain markers, and the data path served 64 QPs instead of 4,096.
#[test]
fn an_srq_max_past_the_devices_takes_no_qps_from_the_cq() {
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let srq = SrqConfig {
        max: 32768,
        ..FIXED_SRQ
    };
    let s = serve_full(4519, None, Some(srq), c);
    assert_eq!(s.on_data_path(|dp| dp.max_qps()), nvmfd::datapath::MAX_QPS);
}

/// A data path serves at most `max_qps` QPs at once, live and draining (its CQ has room for
/// a drain marker of each, all torn down at once): one more connection is refused with No
/// Resources, and a torn-down QP counts until its drain ends.
#[test]
fn connections_beyond_the_qp_limit_are_refused_until_one_has_drained() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_opts(
        4476,
        None,
        None,
        Arc::clone(&c),
        None,
        Opts {
            max_qps: 3,
            ..Opts::default()
        },
    );
    let h = host();
    let mut admin = AdminQueue::connect(queue(&s, 0, 31), &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    assert_eq!(admin.set_queue_count(3).unwrap(), 3);
    let cntlid = admin.cntlid;
    let _one = IoQueue::connect(queue(&s, 1, 31), &h, SUB, cntlid, 1, 31).unwrap();
    let two = IoQueue::connect(queue(&s, 2, 31), &h, SUB, cntlid, 2, 31).unwrap();
    let refused = || {
        let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
        let e = RdmaQueue::connect(ch, s.addr, 3, 31, 4096, 128 * 1024).unwrap_err();
        assert!(
            e.to_string().contains("status 0x6"),
            "not No Resources: {e}"
        );
    };
    refused();
    assert_eq!(c.connects_failed_accept.load(Relaxed), 1);
    // A torn-down QP whose LAST_WQE_REACHED is held up stays draining, and counts.
    s.set_switch(&s.hold_events, true);
    drop(two);
    wait_until("the QP drains", || c.qps_draining.load(Relaxed) == 1);
    refused();
    assert_eq!(c.connects_failed_accept.load(Relaxed), 2);
    s.set_switch(&s.hold_events, false);
    wait_until("its drain ends", || c.qps_draining.load(Relaxed) == 0);
    let mut three = IoQueue::connect(queue(&s, 3, 31), &h, SUB, cntlid, 3, 31).unwrap();
    let data = pattern(76, 4096);
    three.write(2, 1, 1, &data, false).unwrap();
    let mut back = vec![0u8; 4096];
    three.read(2, 1, 1, &mut back).unwrap();
    assert!(back == data);
}

/// While a data path has fewer than a quarter of its QPs free, connections whose host sends
/// no Fabrics Connect keep at most a quarter of them once they have waited 5 s (the grace;
/// shortened here): a new connection ends the oldest beyond that, so a peer opening
/// connections and sending nothing cannot hold every QP until `connect_timeout` (60 s) and
/// lock out the hosts that connect meanwhile. Before, the host here was refused (No
/// Resources) until they timed out.
#[test]
fn connections_without_a_fabrics_connect_cannot_lock_out_a_host() {
    use std::sync::atomic::Ordering::Relaxed;
    let (c, s) = serve_eight_qps(4514);
    let refused = || refused_for_no_resources(&s);
    // Within the grace (an hour here), connections without a Connect are all kept: as many
    // as the data path serves QPs, one at a time (an ended QP counts until its drain ends).
    let silent = eight_silent_connections(&s, &c);
    refused();
    assert_eq!(c.connects_failed_accept.load(Relaxed), 1);
    assert_eq!(c.connects_failed_crowded_out.load(Relaxed), 0);
    // Past it, the next connection ends all but the newest (a quarter of 8 is two, with the
    // new one); it is refused itself while they drain.
    s.on_data_path(|dp| dp.unconnected_grace(Duration::ZERO));
    refused();
    assert_eq!(c.connects_failed_crowded_out.load(Relaxed), 7);
    wait_until("the ended connections drained", || {
        c.qps_draining.load(Relaxed) == 0
    });
    assert_eq!(c.connections.load(Relaxed), 1);
    for (i, ended) in ended(&silent).into_iter().enumerate() {
        assert_eq!(ended, i < 7, "silent connection {i}: ended {ended}");
    }
    // A host connects and is served.
    let h = host();
    let mut admin = AdminQueue::connect(queue(&s, 0, 31), &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    assert_eq!(admin.set_queue_count(1).unwrap(), 1);
    let mut io = IoQueue::connect(queue(&s, 1, 31), &h, SUB, admin.cntlid, 1, 31).unwrap();
    let data = pattern(77, 4096);
    io.write(2, 3, 1, &data, false).unwrap();
    let mut back = vec![0u8; 4096];
    io.read(2, 3, 1, &mut back).unwrap();
    assert!(back == data);
    assert_eq!(c.connects_failed_crowded_out.load(Relaxed), 7);
    // With QPs to spare (a quarter free), nothing is ended: three more are all kept.
    let mut more = Vec::new();
    for n in 11..=13u64 {
        more.push(bare_connect(&s));
        wait_until("the target took it", || {
            c.connections_accepted.load(Relaxed) == n
        });
    }
    assert_eq!(c.connects_failed_crowded_out.load(Relaxed), 7);
    assert_eq!(c.connections.load(Relaxed), 6);
    // Short of them again, the next ends the oldest beyond the quarter, and connected queues
    // never: the first silent one and two of the three, and it is taken.
    more.push(bare_connect(&s));
    wait_until("the target took it", || {
        c.connections_accepted.load(Relaxed) == 14 && c.qps_draining.load(Relaxed) == 0
    });
    assert_eq!(c.connects_failed_crowded_out.load(Relaxed), 10);
    assert_eq!(c.connections.load(Relaxed), 4);
    admin.ping().unwrap();
    io.read(2, 3, 1, &mut back).unwrap();
    assert!(back == data);
    drop(more);
}

/// A connection without a Fabrics Connect whose command is under way (here its response,
/// which its host posts no receive for, is still in flight) is never crowded out, however
/// long it has waited: only `connect_timeout` ends it. The others beyond the quarter are.
#[test]
fn a_connection_with_a_command_under_way_is_not_crowded_out() {
    use std::sync::atomic::Ordering::Relaxed;
    let (c, s) = serve_eight_qps(4517);
    let silent = eight_silent_connections(&s, &c);
    // The oldest sends a command before any Connect: refused, and its response waits for a
    // receive its host never posts.
    let before = c.commands.load(Relaxed);
    send_commands(&silent[0], 0x06, 1);
    wait_until("the command is in", || {
        c.commands.load(Relaxed) == before + 1
    });
    s.on_data_path(|dp| dp.unconnected_grace(Duration::ZERO));
    refused_for_no_resources(&s);
    assert_eq!(c.connects_failed_crowded_out.load(Relaxed), 7);
    wait_until("the ended connections drained", || {
        c.qps_draining.load(Relaxed) == 0
    });
    assert_eq!(c.connections.load(Relaxed), 1);
    for (i, ended) in ended(&silent).into_iter().enumerate() {
        assert_eq!(ended, i > 0, "silent connection {i}: ended {ended}");
    }
}

/// A data path of 8 QPs, and its counters.
fn serve_eight_qps(port: u16) -> (Arc<nvmfd::stats::DataPathCounters>, Served) {
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_opts(
        port,
        None,
        None,
        Arc::clone(&c),
        None,
        Opts {
            max_qps: 8,
            ..Opts::default()
        },
    );
    (c, s)
}

/// With the crowd-out grace an hour, eight connections whose hosts send no Fabrics Connect,
/// each accepted and established in turn (the data path's first).
fn eight_silent_connections(s: &Served, c: &nvmfd::stats::DataPathCounters) -> Vec<BareHost> {
    use nvmfd_rdma::soft::cm::CmEvent;
    use std::sync::atomic::Ordering::Relaxed;
    s.on_data_path(|dp| dp.unconnected_grace(Duration::from_secs(3600)));
    let mut silent = Vec::new();
    for n in 1..=8u64 {
        let h = bare_connect(s);
        wait_until("the target accepted the connection", || {
            c.connections_accepted.load(Relaxed) == n
        });
        assert!(matches!(
            h.ch.next_event(),
            Some(CmEvent::Established { .. })
        ));
        silent.push(h);
    }
    silent
}

/// A host's connect is refused with No Resources.
fn refused_for_no_resources(s: &Served) {
    let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
    let e = RdmaQueue::connect(ch, s.addr, 0, 31, 4096, 128 * 1024).unwrap_err();
    assert!(
        e.to_string().contains("status 0x6"),
        "not No Resources: {e}"
    );
}

/// Whether each of `hosts` had its connection ended (its next CM event DISCONNECTED).
fn ended(hosts: &[BareHost]) -> Vec<bool> {
    use nvmfd_rdma::soft::cm::CmEvent;
    hosts
        .iter()
        .map(|h| matches!(h.ch.next_event(), Some(CmEvent::Disconnected { .. })))
        .collect()
}

/// Many queues gone at once (a host with a thousand queues disconnecting, a link down): their
/// drained QPs are destroyed a few a turn, not all in the turn their drains end. A destroy is
/// a call into the device's driver (a firmware command on most NICs, with the CM ID's
/// teardown): all in one turn stalled every other queue of the reactor for all of them.
#[test]
fn a_mass_teardown_destroys_a_few_qps_a_turn() {
    use nvmfd::datapath::DESTROYS_PER_TURN;
    use std::sync::atomic::Ordering::Relaxed;
    const GONE: usize = 5 * DESTROYS_PER_TURN + 3;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_opts(
        4515,
        None,
        None,
        Arc::clone(&c),
        None,
        Opts {
            max_qps: 64,
            ..Opts::default()
        },
    );
    let mut hosts = Vec::new();
    for n in 1..=GONE as u64 {
        hosts.push(bare_connect(&s));
        wait_until("the target accepted the connection", || {
            c.connections_accepted.load(Relaxed) == n
        });
    }
    // The reactor stops polling (it still takes CM and async events): every connection is
    // torn down while none of it is reaped.
    s.set_switch(&s.paused, true);
    drop(hosts);
    wait_until("every connection is torn down", || {
        s.on_data_path(|dp| dp.draining()) == GONE
    });
    // One turn at a time: how many QPs are left draining after each.
    let left = s.on_data_path(|dp| {
        let mut left = vec![dp.draining()];
        while left.len() < 1000 && *left.last().unwrap() > 0 {
            dp.poll(Instant::now());
            left.push(dp.draining());
        }
        left
    });
    assert_eq!(left.first(), Some(&GONE));
    assert_eq!(left.last(), Some(&0), "the drains never ended: {left:?}");
    let most = left.windows(2).map(|w| w[0] - w[1]).max().unwrap();
    assert_eq!(
        most, DESTROYS_PER_TURN,
        "QPs destroyed in one turn: {left:?}"
    );
    s.paused.store(false, Relaxed);
    wait_until("their counts are back", || {
        c.qps_draining.load(Relaxed) == 0 && c.connections.load(Relaxed) == 0
    });
}

/// Large writes that fill every large buffer of a backend that does not finish them (held
/// block completions) leave their next large write waiting for a buffer; another host's
/// admin commands and small I/O do not wait behind it. Before, every command that arrived
/// after it waited in one line: the other host's Keep Alives too, until its controller
/// expired.
#[test]
fn commands_of_other_hosts_do_not_wait_behind_a_large_write_waiting_for_a_buffer() {
    use nvmf_host::Payload;
    use nvmfd_nvme::host::rw_sqe;
    use nvmfd_nvme::wire::io_opcode;
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    // Two large buffers, 32 request slots.
    let s = serve_counted(4484, Some((2, 32)), Arc::clone(&c));
    // Host A: an I/O queue that can have three 64 KiB writes out.
    let (_admin_a, mut io_a) = pipelined_controller(&s, 8, 64 * 1024);
    // Host B (another controller): its admin queue, and an I/O queue for a small write.
    let (mut admin_b, mut io_b) = pipelined_controller(&s, 8, 64 * 1024);

    s.set_switch(&s.hold_block, true);
    let data = pattern(84, 3 * 64 * 1024);
    let qa = io_a.transport();
    for k in 0..3usize {
        let lba = (k * 128) as u64;
        let at = k * 64 * 1024;
        qa.submit(
            k as u64,
            rw_sqe(io_opcode::WRITE, 1, lba, 128, false),
            Payload::Out(&data[at..at + 64 * 1024]),
        )
        .unwrap();
    }
    wait_until(
        "two writes hold both large buffers and the third waits",
        || c.block_ops_in_flight.load(Relaxed) == 2 && c.requests_waiting.load(Relaxed) == 1,
    );
    // B's admin commands are answered while A's write waits (on a thread: before, they
    // waited for the hold to end).
    let (tx, rx) = std::sync::mpsc::channel();
    let b = std::thread::spawn(move || {
        let r = admin_b
            .ping()
            .and_then(|()| admin_b.identify_controller().map(|_| ()));
        let _ = tx.send(r.is_ok());
        admin_b
    });
    let answered = rx.recv_timeout(Duration::from_secs(10));
    if answered.is_err() {
        s.hold_block.store(false, Relaxed);
    }
    assert_eq!(
        answered,
        Ok(true),
        "another host's Keep Alive waited behind a large write waiting for a buffer"
    );
    let _admin_b = b.join().unwrap();
    // B's small write reaches the backend past A's waiting one.
    let small = pattern(85, 4096);
    let qb = io_b.transport();
    qb.submit(
        9,
        rw_sqe(io_opcode::WRITE, 1, 4096, 8, false),
        Payload::Out(&small),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.block_ops_in_flight.load(Relaxed) < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    let passed = c.block_ops_in_flight.load(Relaxed) == 3;
    s.set_switch(&s.hold_block, false);
    assert!(
        passed,
        "another host's 4 KiB write waited behind a large write"
    );
    // Everything completes once the backend answers.
    let mut done = Vec::new();
    let mut left = 3;
    let deadline = Instant::now() + Duration::from_secs(20);
    while left > 0 {
        assert!(
            Instant::now() < deadline,
            "{left} of A's writes never completed"
        );
        qa.poll(&mut done);
        for d in done.drain(..) {
            d.ok().unwrap();
            left -= 1;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while done.is_empty() {
        assert!(Instant::now() < deadline, "B's write never completed");
        qb.poll(&mut done);
    }
    for d in done.drain(..) {
        d.ok().unwrap();
    }
    for k in 0..3usize {
        let mut back = vec![0u8; 64 * 1024];
        io_a.read(1, (k * 128) as u64, 128, &mut back).unwrap();
        assert!(
            back == data[k * 64 * 1024..(k + 1) * 64 * 1024],
            "A's write {k} reads back otherwise"
        );
    }
    assert_eq!(c.command_errors.load(Relaxed), 0);
    wait_pools_full(&c, false);
}

/// Small writes of one host that a backend does not finish take every request slot but the
/// admin queues' reserve: the next one waits, and another host's Keep Alive still runs.
#[test]
fn io_filling_every_request_slot_leaves_admin_commands_room() {
    use nvmf_host::Payload;
    use nvmfd_nvme::host::rw_sqe;
    use nvmfd_nvme::wire::io_opcode;
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    // 32 request slots: 2 kept for admin queues.
    let s = serve_counted(4485, Some((2, 32)), Arc::clone(&c));
    let (_admin_a, mut io_a) = pipelined_controller(&s, 64, 8192);
    let (admin_b, _io_b) = pipelined_controller(&s, 64, 8192);
    s.set_switch(&s.hold_block, true);
    let data = pattern(86, 4096);
    let qa = io_a.transport();
    for k in 0..40u64 {
        qa.submit(
            k,
            rw_sqe(io_opcode::WRITE, 1, k * 8, 8, false),
            Payload::Out(&data),
        )
        .unwrap();
    }
    wait_until("the 40 writes are at the backend or waiting", || {
        c.block_ops_in_flight.load(Relaxed) + c.requests_waiting.load(Relaxed) == 40
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let mut admin_b = admin_b;
    let b = std::thread::spawn(move || {
        let _ = tx.send(admin_b.ping().is_ok());
        admin_b
    });
    let answered = rx.recv_timeout(Duration::from_secs(10));
    let held = c.block_ops_in_flight.load(Relaxed);
    s.set_switch(&s.hold_block, false);
    assert_eq!(
        answered,
        Ok(true),
        "a Keep Alive found no request slot while I/O held them all"
    );
    assert_eq!(held, 30, "I/O took the admin queues' slots");
    b.join().unwrap();
    let mut done = Vec::new();
    let mut left = 40;
    let deadline = Instant::now() + Duration::from_secs(20);
    while left > 0 {
        assert!(Instant::now() < deadline, "{left} writes never completed");
        qa.poll(&mut done);
        for d in done.drain(..) {
            d.ok().unwrap();
            left -= 1;
        }
    }
    assert_eq!(c.command_errors.load(Relaxed), 0);
    wait_pools_full(&c, false);
}

/// Holds block completions and sends a 4 KiB write of pattern `seed` at LBA `lba` of
/// namespace 1 through `io`; returns once it is at the backend.
fn write_held_at_the_backend(
    s: &Served,
    c: &nvmfd::stats::DataPathCounters,
    io: &mut IoQueue<nvmf_host::PipelinedQueue>,
    lba: u64,
    seed: u64,
) {
    use nvmf_host::Payload;
    use nvmfd_nvme::host::rw_sqe;
    use nvmfd_nvme::wire::io_opcode;
    s.set_switch(&s.hold_block, true);
    let old = pattern(seed, 4096);
    io.transport()
        .submit(
            1,
            rw_sqe(io_opcode::WRITE, 1, lba, 8, false),
            Payload::Out(&old),
        )
        .unwrap();
    wait_until("the write is at the backend", || {
        c.block_ops_in_flight.load(Ordering::Relaxed) == 1
    });
}

/// A new association of `h` while the write of `write_held_at_the_backend` is there is
/// answered Controller Busy, retryable (`when` says what was going on); then the write is
/// let go, and this returns once it completed.
fn busy_until_the_held_write_completes(
    s: &Served,
    c: &nvmfd::stats::DataPathCounters,
    h: &HostId,
    when: &str,
) {
    use nvmfd_nvme::wire::status;
    let busy = AdminQueue::connect(queue(s, 0, 31), h, SUB, 31, 0);
    let refused = matches!(&busy, Err(nvmfd_nvme::host::HostError::Status { status: st, .. })
        if st.same_code(status::CONNECT_CONTROLLER_BUSY) && !st.dnr());
    s.set_switch(&s.hold_block, false);
    let got = busy.as_ref().map(|a| a.cntlid).map_err(ToString::to_string);
    assert!(refused, "a new association while {when}: {got:?}");
    drop(busy);
    wait_until("the old write completed", || {
        c.block_ops_in_flight.load(Ordering::Relaxed) == 0
    });
}

/// A host that loses its association while a write of it is still at the backend (held) and
/// connects again: its Connect is answered Controller Busy until the write has completed and
/// the old queue is gone, so the old write cannot land over one of the new association.
#[test]
fn a_host_reconnecting_while_its_old_write_is_at_the_backend_waits_for_it() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4486, None, Arc::clone(&c));
    let h = host();
    let (admin, mut io) = pipelined_controller(&s, 8, 8192);
    write_held_at_the_backend(&s, &c, &mut io, 64, 87);
    // The host goes: both queues disconnect.
    drop(io);
    drop(admin);
    wait_until("both queues are torn down", || {
        c.connections.load(Relaxed) == 0
    });
    busy_until_the_held_write_completes(&s, &c, &h, "the old write was at the backend");
    let (_admin, mut ios) = controller(&s, 1);
    let new = pattern(88, 4096);
    ios[0].write(1, 64, 8, &new, false).unwrap();
    let mut back = vec![0u8; 4096];
    ios[0].read(1, 64, 8, &mut back).unwrap();
    assert!(back == new);
    wait_pools_full(&c, false);
}

/// A host that closes its queues with nothing at the backend connects again at once, every
/// time: the fence against a new association waits only for commands at a backend.
#[test]
fn a_host_that_left_nothing_at_the_backend_reconnects_at_once() {
    let s = serve(4487);
    for round in 0..20u64 {
        let (admin, mut ios) = try_controller(&s, 1)
            .unwrap_or_else(|| panic!("round {round}: the Connect was refused"));
        let data = pattern(round, 4096);
        ios[0].write(1, round * 8, 8, &data, false).unwrap();
        drop(ios);
        drop(admin);
    }
}

/// An I/O queue torn down while a write of it is still at the backend keeps its queue ID
/// until the write is done: a queue the host connects with that ID meanwhile is answered
/// Controller Busy (retryable), or a write through the new queue could be overtaken by the
/// old one's. Once the write is done, the ID is free at once, without waiting for the old
/// queue's drain; and a queue torn down with nothing at the backend frees its ID at once.
#[test]
fn a_queue_id_is_free_again_once_its_queue_is_torn_down_with_nothing_at_the_backend() {
    use nvmf_host::Payload;
    use nvmfd_nvme::host::rw_sqe;
    use nvmfd_nvme::wire::io_opcode;
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4488, None, Arc::clone(&c));
    let (admin, mut io) = pipelined_controller(&s, 8, 8192);
    s.set_switch(&s.hold_block, true);
    let data = pattern(89, 4096);
    io.transport()
        .submit(
            1,
            rw_sqe(io_opcode::WRITE, 1, 8, 8, false),
            Payload::Out(&data),
        )
        .unwrap();
    wait_until("the write is at the backend", || {
        c.block_ops_in_flight.load(Relaxed) == 1
    });
    drop(io);
    wait_until("the I/O queue is torn down", || {
        c.connections.load(Relaxed) == 1
    });
    let busy = IoQueue::connect(queue(&s, 1, 31), &host(), SUB, admin.cntlid, 1, 31);
    match busy {
        Err(nvmfd_nvme::host::HostError::Status { status, .. }) => assert!(
            status.same_code(nvmfd_nvme::wire::status::CONNECT_CONTROLLER_BUSY) && !status.dnr(),
            "{status:?}"
        ),
        other => {
            panic!("queue 1 connected while a write of the old one was at the backend: {other:?}")
        }
    }
    s.set_switch(&s.hold_block, false);
    let mut again = IoQueue::connect_waiting(
        queue(&s, 1, 31),
        &host(),
        SUB,
        (admin.cntlid, 1, 31),
        Duration::from_secs(10),
    )
    .expect("queue 1 connected again once the write was done");
    let mut back = vec![0u8; 4096];
    again.read(1, 8, 8, &mut back).unwrap();
    assert!(back == data, "the held write landed");
    // Torn down with nothing at the backend: the ID is free at once.
    drop(again);
    wait_until("the I/O queue is torn down", || {
        c.connections.load(Relaxed) == 1
    });
    IoQueue::connect(queue(&s, 1, 31), &host(), SUB, admin.cntlid, 1, 31)
        .expect("queue 1 connected again at once");
    wait_pools_full(&c, false);
}

/// A CQ that fails (as an overrun fails it) loses its completions. The reactor replaces its
/// data path by a new one on the same device: the old controller's queues end, and a new host
/// connects and is served. Connections were adopted onto the failed CQ before, and every
/// host's Connect went unanswered until the daemon restarted.
#[test]
fn a_failed_cq_is_replaced_by_a_new_data_path_that_serves() {
    let (_s, _admin, mut ios) = cq_lost_and_replaced(4446, |f, qp| f.inject_cq_error(qp));
    write_verified(&mut ios[0], 4, 6);
}

/// A CQ whose poll fails without an error event (a provider that cannot parse a CQE: mlx5's
/// CQ_POLL_ERR) is lost as a CQ error's is: the data path is replaced and a new host is
/// served. The failed poll read as an empty CQ: nothing completed again, every host hung.
#[test]
fn a_cq_whose_poll_fails_is_replaced_by_a_new_data_path() {
    cq_lost_and_replaced(4439, |f, qp| f.fail_cq_polls(qp));
}

/// A host's I/O queue whose CQ at the target `lose` makes fail: the old queue's next command
/// fails (its QP was torn down), a new host is served and reads back what it wrote, and the
/// old data path's drains end by their timeout (their markers were lost with the CQ). The
/// new host's controller (admin and I/O queues), and the reactor serving it, are returned.
fn cq_lost_and_replaced(
    port: u16,
    lose: impl Fn(&Fabric, u32) -> bool,
) -> (Served, AdminQueue<RdmaQueue>, Vec<IoQueue<RdmaQueue>>) {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = fault_reactor(port, &c);
    let (_old_admin, mut old) = controller(&s, 1);
    write_verified(&mut old[0], 2, 2);
    let target_qp = target_qp_of(&s, &mut old[0]);
    assert!(lose(&s.fabric, target_qp));
    let mut back = vec![0u8; 4096];
    assert!(old[0].read(2, 2, 1, &mut back).is_err());
    let (admin, mut ios) = served_within(&s, Duration::from_secs(30));
    let data = write_verified(&mut ios[0], 3, 5);
    ios[0].read(2, 5, 1, &mut back).unwrap();
    assert!(back == data, "read back differs");
    wait_until("the old data path's drains ended", || {
        c.qps_draining.load(Relaxed) == 0 && c.drain_timeouts.load(Relaxed) >= 1
    });
    (s, admin, ios)
}

/// A reactor thread serving on port `port` into counters `c`, with an SRQ that starts small
/// and a short sleep, for the tests that fail what a data path is built on.
fn fault_reactor(port: u16, c: &Arc<nvmfd::stats::DataPathCounters>) -> Served {
    let srq = SrqConfig {
        initial: 64,
        max: 4096,
        low_watermark: 16,
        chunk: 64,
        shrink_delay: Duration::from_secs(60),
        cover_queues: true,
    };
    let cfg = nvmfd::reactor::LoopConfig {
        idle_sleep_after: Duration::from_micros(50),
        max_sleep: Duration::from_millis(20),
    };
    serve_on_reactor_with(port, cfg, Arc::clone(c), srq, Duration::from_secs(2))
}

/// The target's QP of host queue `io`.
fn target_qp_of(s: &Served, io: &mut IoQueue<RdmaQueue>) -> u32 {
    io.transport()
        .qpn()
        .and_then(|q| s.fabric.peer_of(q))
        .expect("the target's QP of the I/O queue")
}

/// A namespace whose device cannot be attached when the data path is built (the process out
/// of files): the path serves the others, answers Namespace Not Ready for it (the host
/// retries), and attaches it again after a wait. The whole data path was refused: its
/// listener served nothing.
#[test]
fn a_namespace_that_cannot_be_attached_at_build_waits_and_the_others_are_served() {
    let s = serve_opts(
        4499,
        None,
        None,
        Default::default(),
        None,
        Opts {
            attach_failures: 1,
            ..Opts::default()
        },
    );
    let (_admin, mut ios) = controller(&s, 1);
    // Namespace 1 (512-byte blocks) is served.
    let data = pattern(1, 4096);
    ios[0].write(1, 8, 8, &data, false).unwrap();
    let mut back = vec![0u8; 4096];
    ios[0].read(1, 8, 8, &mut back).unwrap();
    assert!(back == data, "namespace 1 read back other data");
    let mut buf = vec![0u8; 4096];
    match ios[0].read(2, 0, 1, &mut buf) {
        Err(nvmfd_nvme::host::HostError::Status { status, .. }) => assert!(
            status.same_code(nvmfd_nvme::wire::status::NAMESPACE_NOT_READY) && !status.dnr(),
            "{status:?}"
        ),
        other => panic!("namespace 2 before its attach: {other:?}"),
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while ios[0].read(2, 0, 1, &mut buf).is_err() {
        assert!(
            Instant::now() < deadline,
            "namespace 2 was never attached again"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    write_verified(&mut ios[0], 2, 3);
}

/// A shutdown reaches a file namespace whose attach failed when the data path was built (it
/// waits to be attached again): other data paths may have written into its page cache, so it
/// is synced off the reactor and the shutdown completes only once it is; a sync that fails
/// fails the shutdown (CFS). Its flush was skipped, as an RBD image's (no cache) is: SHST
/// read complete with nothing made durable.
#[test]
fn a_shutdown_syncs_a_file_namespace_that_waits_to_be_attached() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns3");
    std::fs::write(&path, vec![0u8; 4 << 20]).unwrap();
    let s = serve_opts(
        4438,
        None,
        None,
        Default::default(),
        Some(path),
        Opts {
            file_faults: true,
            ..Opts::default()
        },
    );
    let (mut admin, ios) = controller(&s, 1);
    let cc = admin.property_get(0x14, false).unwrap() as u32;
    admin
        .property_set(0x14, (cc & !(0x3 << 14)) | (1 << 14))
        .unwrap();
    let mut csts = 0;
    wait_until("the shutdown to end", || {
        csts = admin.property_get(0x1C, false).unwrap() as u32;
        csts & 0x2 != 0 || (csts >> 2) & 0x3 == 2
    });
    assert!(
        csts & 0x2 != 0 && (csts >> 2) & 0x3 != 2,
        "CSTS {csts:#x}: the shutdown completed though namespace 3 was not synced"
    );
    drop(ios);
}

/// A controller of a new host, trying again (every 10 ms) until one is served or `within`
/// has passed.
fn served_within(s: &Served, within: Duration) -> (AdminQueue<RdmaQueue>, Vec<IoQueue<RdmaQueue>>) {
    let deadline = Instant::now() + within;
    loop {
        if let Some(q) = try_controller(s, 1) {
            return q;
        }
        assert!(
            Instant::now() < deadline,
            "no host was served within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The replacement of a data path whose CQ failed is refused by the device (every memory
/// registration fails, as at the locked-memory limit, while the old path still holds its
/// own): the listener is reported not serving, and the replacement is tried again until it
/// is built. It was tried once: the listener refused every host until the daemon restarted.
#[test]
fn a_replacement_data_path_the_device_refuses_is_tried_again_until_it_serves() {
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = fault_reactor(4448, &c);
    let (_old_admin, mut old) = controller(&s, 1);
    write_verified(&mut old[0], 2, 2);
    let target_qp = target_qp_of(&s, &mut old[0]);
    s.fabric.fail_registrations(u32::MAX);
    assert!(s.fabric.inject_cq_error(target_qp));
    let unserved = |s: &Served| {
        s.inproc
            .as_ref()
            .map(|t| t.unserved.lock().unwrap_or_else(|e| e.into_inner()).len())
            .unwrap_or_default()
    };
    wait_until("the listener is reported not serving", || unserved(&s) == 1);
    s.fabric.fail_registrations(0);
    let (_admin, mut ios) = served_within(&s, Duration::from_secs(30));
    write_verified(&mut ios[0], 3, 5);
    assert_eq!(unserved(&s), 0);
}

/// A drain marker that the provider queues and then reports failed (rxe's doorbell error,
/// with every request already in its queue) completes like any other posted one: the drain
/// counts it and ends when it comes back. It was taken for refused: its completion was then
/// counted out of nothing (a debug assertion stopped the reactor) and the drain could end
/// before it.
#[test]
fn a_drain_marker_posted_and_then_failed_is_counted_and_its_completion_ends_the_drain() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = fault_reactor(4447, &c);
    let (_admin, mut ios) = controller(&s, 1);
    write_verified(&mut ios[0], 4, 7);
    let target_qp = target_qp_of(&s, &mut ios[0]);
    // The idle queue's next post is its drain marker.
    s.fabric.inject_doorbell_failure(target_qp);
    drop(ios);
    wait_until("the I/O queue's QP torn down", || {
        c.teardowns_disconnect.load(Relaxed) >= 1
    });
    // Served meanwhile; the levels read next are of turns after the teardown.
    let (_admin2, mut ios2) = controller(&s, 1);
    write_verified(&mut ios2[0], 5, 8);
    wait_until("the torn-down QP drained", || {
        c.qps_draining.load(Relaxed) == 0
    });
    // Its marker's completion ended the drain, not the timeout.
    assert_eq!(c.drain_timeouts.load(Relaxed), 0);
}

/// A host that sends more commands than its queue holds, and posts no receive for their
/// responses, would take every request slot (responses waiting for send-queue room, each
/// holding one) and then, its commands waiting in their receives, empty the SRQ that every
/// host of the reactor shares. Its queue ends once it has a command more without a response
/// than its queue size (32 here), counted and logged: its responses posted (up to its send
/// queue's room) count as answered, so it takes that many and its queue size before it ends;
/// the target serves other hosts on, and everything it held comes back.
#[test]
fn a_host_past_its_queue_size_is_torn_down_and_others_are_served() {
    use nvmfd_rdma::{SendOp, SendWr, Wc, WcStatus};
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4489, None, Arc::clone(&c));
    let h = bare_established(&s);
    // Keep Alives without a Connect: each is answered (Command Sequence Error), and no
    // answer can land.
    let cq = &h._qp_on.1;
    let mut wc = [Wc::default(); 16];
    let mut sent = 0u32;
    for cid in 0..2000u16 {
        if c.commands_over_queue_size.load(Relaxed) > 0 {
            break;
        }
        let mut sqe = [0u8; 64];
        sqe[0] = 0x18;
        sqe[2..4].copy_from_slice(&cid.to_le_bytes());
        if h.id
            .post_send(&[SendWr {
                wr_id: u64::from(cid),
                op: SendOp::Send,
                sges: &[],
                signaled: true,
                inline: Some(&sqe),
            }])
            .is_err()
        {
            break;
        }
        let done = (0..2000).find_map(|_| {
            let n = cq.poll(&mut wc).unwrap();
            if n == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            (n > 0).then(|| wc[0].status)
        });
        if done != Some(WcStatus::Success) {
            break;
        }
        sent += 1;
    }
    wait_until("the queue past its size to be torn down", || {
        c.commands_over_queue_size.load(Relaxed) == 1 && c.teardowns_controller.load(Relaxed) == 1
    });
    assert!(
        sent < 1000,
        "{sent} commands taken from one queue of 32 entries"
    );
    // Other hosts are served, and everything the queue held comes back.
    let (_admin, mut ios) = controller(&s, 1);
    let data = pattern(89, 4096);
    ios[0].write(1, 0, 8, &data, false).unwrap();
    let mut back = vec![0u8; 4096];
    ios[0].read(1, 0, 8, &mut back).unwrap();
    assert!(back == data);
    drop(h);
    wait_pools_full(&c, false);
}

/// A command the target never answers breaks a pipelined queue after its timeout even while
/// the queue's other commands keep completing: every poll here finds a completion (the queue
/// checked its deadlines only on a poll that found none, so a bench ran on one slot short and
/// reported the lost command only after its run).
#[test]
fn a_command_left_unanswered_among_answered_ones_breaks_a_pipelined_queue() {
    use nvmf_host::Payload;
    use nvmfd_nvme::host::rw_sqe;
    use nvmfd_nvme::wire::io_opcode;
    let s = serve(4490);
    let (_admin, mut io) = pipelined_controller(&s, 4, 4096);
    let q = io.transport();
    q.set_timeout(Duration::from_millis(300));
    let qpn = q.qpn().unwrap();
    s.fabric.hold_send_completions(qpn);
    let read = |lba| rw_sqe(io_opcode::READ, 1, lba, 1, false);
    q.submit(0, read(0), Payload::In(512)).unwrap();
    let start = Instant::now();
    let mut done = Vec::new();
    let mut answered = 0u64;
    while q.broken().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "not broken after {answered} other commands completed"
        );
        q.submit(1, read(8), Payload::In(512)).unwrap();
        // Its send completion is held behind the first command's, which stays held.
        assert_eq!(s.fabric.release_held_completions_but_first(1), 1);
        wait_until("its response and send completion are in", || {
            s.fabric.completions_waiting(qpn) >= 2
        });
        q.poll(&mut done);
        answered += done
            .drain(..)
            .filter(|d| d.tag == 1 && d.ok().is_ok())
            .count() as u64;
    }
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert!(answered > 0);
    assert!(
        q.broken().unwrap().contains("took longer than"),
        "{:?}",
        q.broken()
    );
}

/// A host that posts no receive for its responses keeps their SENDs waiting at its QP
/// forever (RNR retry 7), and their requests with them: with a few queues it would hold
/// every request slot of the reactor while its admin queue keeps its controller alive. A
/// connection whose posted work has no completion within the response timeout is ended,
/// counted and logged; other hosts are served on, and everything it held comes back.
#[test]
fn a_host_that_takes_none_of_its_responses_is_torn_down_after_the_response_timeout() {
    host_taking_no_responses_is_torn_down(4491, false);
}

/// The same under a load that leaves completions in the CQ at every poll: the response
/// timeout is not put off for as long as the CQ never reads empty.
#[test]
fn a_host_that_takes_none_of_its_responses_is_torn_down_while_the_cq_never_reads_empty() {
    host_taking_no_responses_is_torn_down(4590, true);
}

fn host_taking_no_responses_is_torn_down(port: u16, cq_never_empty: bool) {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_opts(
        port,
        None,
        None,
        Arc::clone(&c),
        None,
        Opts {
            response_timeout: Duration::from_millis(300),
            ..Opts::default()
        },
    );
    s.on_data_path(move |dp| dp.cq_never_empty(cq_never_empty));
    let h = bare_established(&s);
    // Four Keep Alives (well within the queue's size), each answered, and no receive for
    // any answer.
    send_commands(&h, 0x18, 4);
    wait_until("the four responses are posted", || {
        c.sends_in_flight.load(Relaxed) == 4
    });
    let start = Instant::now();
    wait_until("the queue that takes no response to be torn down", || {
        c.responses_not_taken.load(Relaxed) == 1 && c.teardowns_controller.load(Relaxed) == 1
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    let (_admin, mut ios) = controller(&s, 1);
    let data = pattern(91, 4096);
    ios[0].write(1, 0, 8, &data, false).unwrap();
    let mut back = vec![0u8; 4096];
    ios[0].read(1, 0, 8, &mut back).unwrap();
    assert!(back == data);
    assert_eq!(
        c.responses_not_taken.load(Relaxed),
        1,
        "a host that takes its responses"
    );
    drop(h);
    wait_pools_full(&c, false);
}

/// A host that posts a receive for one response now and then, more often than the response
/// timeout, lets one SEND complete at a time and would hold the rest of its answered
/// commands (and their request slots) for ever: the work seen out at a look must all
/// complete within the timeout, not merely move.
#[test]
fn a_host_taking_one_response_now_and_then_is_torn_down_after_the_response_timeout() {
    use nvmfd_rdma::{Access, RecvWr, Wc};
    use std::sync::atomic::Ordering::Relaxed;
    let timeout = Duration::from_millis(400);
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_opts(
        4591,
        None,
        None,
        Arc::clone(&c),
        None,
        Opts {
            response_timeout: timeout,
            ..Opts::default()
        },
    );
    let h = bare_established(&s);
    let (srq, cq, pd) = &h._qp_on;
    let mr = pd.alloc_mr(32 * 64, Access::LOCAL_WRITE).unwrap();
    // 24 Keep Alives, each answered, and no receive for their answers yet.
    send_commands(&h, 0x18, 24);
    let mut wc = [Wc::default(); 16];
    wait_until("the 24 responses are posted", || {
        c.sends_in_flight.load(Relaxed) == 24
    });
    // One receive every 0.4 timeouts: a response goes at each, and the host is let go
    // well before the 24 have (within about two timeouts; 20 receives are eight).
    let start = Instant::now();
    let mut posted = 0u64;
    while c.responses_not_taken.load(Relaxed) == 0 {
        assert!(
            posted < 20,
            "not torn down after {posted} receives in {:?}",
            start.elapsed()
        );
        // The host's CQ is read: its receives' completions do not pile up there.
        while cq.poll(&mut wc).unwrap() > 0 {}
        srq.post_recv(&[RecvWr {
            wr_id: posted,
            sges: &[mr.sge(64 * posted as usize, 64)],
        }])
        .unwrap();
        posted += 1;
        let next = Instant::now() + timeout * 2 / 5;
        while Instant::now() < next && c.responses_not_taken.load(Relaxed) == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    wait_until("the queue is torn down", || {
        c.teardowns_controller.load(Relaxed) == 1
    });
    drop(h);
    wait_pools_full(&c, false);
}

/// A queue not yet connected that takes none of its responses cannot hold the request slots
/// kept for admin queues: its commands other than Connect are I/O commands' equals, and its
/// Connects (like an admin queue's commands) use the reserve only while it holds few slots.
/// Another host's Keep Alive is answered at once while it holds every other slot.
#[test]
fn a_queue_taking_no_responses_leaves_the_admin_reserve_to_other_hosts_keep_alives() {
    hostile_queue_leaves_the_admin_reserve(4592, 0x18);
}

/// The same with Connect commands (without their data: each refused, the queue stays
/// unconnected).
#[test]
fn a_queue_sending_connects_without_taking_responses_leaves_the_admin_reserve() {
    hostile_queue_leaves_the_admin_reserve(4593, 0x7F);
}

/// A host that arms every Asynchronous Event Request the controller takes (four, as SPDK's
/// host does) keeps the admin reserve for its other admin commands: held AERs hold no slot.
#[test]
fn an_admin_queue_with_every_aer_armed_keeps_the_admin_reserve() {
    use nvmf_host::Payload;
    use std::sync::atomic::Ordering::Relaxed;
    let (c, s) = serve_with_an_admin_reserve_of_4(4595);
    let h = host();
    let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
    let mut q = nvmf_host::PipelinedQueue::connect(ch, s.addr, 0, 32, 4096, 4096).unwrap();
    q.set_timeout(Duration::from_secs(5));
    let mut admin = AdminQueue::connect(q, &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    let before = c.commands.load(Relaxed);
    for tag in 0..4 {
        admin
            .transport()
            .submit(tag, nvmfd_nvme::host::command(0x0C), Payload::None)
            .unwrap();
    }
    wait_until("the four AERs are in", || {
        c.commands.load(Relaxed) == before + 4
    });
    let hostile = flood_with_a_queue_taking_no_responses(&s, &c, 0x18);
    let start = Instant::now();
    admin.identify_controller().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "the admin command waited {:?}",
        start.elapsed()
    );
    drop(hostile);
}

/// AERs a controller reset ended (the host takes them as aborted; no completion comes) are
/// no longer counted as commands of the admin queue without a response: with four new ones
/// armed after the reset, the host's other admin commands still use the admin reserve.
/// Counted still (the core ending them, the data path not counting them answered), an
/// Identify waited behind another host's flood. (Before the core ended them, the new AERs
/// were refused at the limit instead: the core's test shows that.)
#[test]
fn aers_a_reset_ended_hold_none_of_the_admin_reserve() {
    use nvmf_host::Payload;
    use std::sync::atomic::Ordering::Relaxed;
    let (c, s) = serve_with_an_admin_reserve_of_4(4596);
    let h = host();
    let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
    let mut q = nvmf_host::PipelinedQueue::connect(ch, s.addr, 0, 32, 4096, 4096).unwrap();
    q.set_timeout(Duration::from_secs(5));
    let mut admin = AdminQueue::connect(q, &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    let arm_four = |admin: &mut AdminQueue<nvmf_host::PipelinedQueue>, from: u64| {
        let before = c.commands.load(Relaxed);
        for tag in from..from + 4 {
            admin
                .transport()
                .submit(tag, nvmfd_nvme::host::command(0x0C), Payload::None)
                .unwrap();
        }
        wait_until("the four AERs are in", || {
            c.commands.load(Relaxed) == before + 4
        });
    };
    arm_four(&mut admin, 0);
    admin
        .property_set(nvmfd_nvme::wire::property::CC, 0)
        .unwrap();
    wait_until("the reset is over", || {
        admin
            .property_get(nvmfd_nvme::wire::property::CSTS, false)
            .unwrap()
            & 1
            == 0
    });
    admin.enable().unwrap();
    arm_four(&mut admin, 4);
    let hostile = flood_with_a_queue_taking_no_responses(&s, &c, 0x18);
    let start = Instant::now();
    admin.identify_controller().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "the admin command waited {:?}",
        start.elapsed()
    );
    drop(hostile);
}

/// A target of 64 request slots, 4 of them kept for admin queues, whose hosts that take no
/// responses are never let go for it during a test (a response timeout of 120 s).
fn serve_with_an_admin_reserve_of_4(port: u16) -> (Arc<nvmfd::stats::DataPathCounters>, Served) {
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_opts(
        port,
        Some((16, 64)),
        None,
        Arc::clone(&c),
        None,
        Opts {
            response_timeout: Duration::from_secs(120),
            ..Opts::default()
        },
    );
    (c, s)
}

/// A queue not yet connected sends 64 commands of `opcode` and takes none of their
/// responses: every slot it can take, it holds.
fn flood_with_a_queue_taking_no_responses(
    s: &Served,
    c: &nvmfd::stats::DataPathCounters,
    opcode: u8,
) -> BareHost {
    use std::sync::atomic::Ordering::Relaxed;
    let before = c.commands.load(Relaxed);
    let h = bare_established(s);
    send_commands(&h, opcode, 64);
    wait_until("the hostile queue's commands are in", || {
        c.commands.load(Relaxed) == before + 64
    });
    h
}

fn hostile_queue_leaves_the_admin_reserve(port: u16, opcode: u8) {
    use std::sync::atomic::Ordering::Relaxed;
    let (c, s) = serve_with_an_admin_reserve_of_4(port);
    let (mut admin, _ios) = controller(&s, 1);
    let h = flood_with_a_queue_taking_no_responses(&s, &c, opcode);
    // An admin command (Identify: this controller has no keep-alive timeout, so its Keep
    // Alive would be refused) is answered at once.
    let start = Instant::now();
    admin.identify_controller().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "the admin command waited {:?}",
        start.elapsed()
    );
    assert_eq!(c.responses_not_taken.load(Relaxed), 0);
    drop(h);
}

/// A command waiting for a request slot (every one taken) is traffic of its controller, as
/// one processed is: the controller's keep-alive timer restarts, and it does not expire
/// while its host's commands wait behind others.
#[test]
fn a_command_waiting_for_a_slot_keeps_its_controller_alive() {
    use nvmf_host::Payload;
    use nvmfd_nvme::host::rw_sqe;
    use nvmfd_nvme::wire::io_opcode;
    use std::sync::atomic::Ordering::Relaxed;
    let (c, s) = serve_with_an_admin_reserve_of_4(4594);
    let h = host();
    let kato = Duration::from_secs(1);
    let mut admin = AdminQueue::connect(queue(&s, 0, 31), &h, SUB, 31, 1000).unwrap();
    admin.enable().unwrap();
    assert_eq!(admin.set_queue_count(1).unwrap(), 1);
    let ch = any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&s.fabric).unwrap());
    let q = nvmf_host::PipelinedQueue::connect(ch, s.addr, 1, 8, 4096, 4096).unwrap();
    let mut io = IoQueue::connect(q, &h, SUB, admin.cntlid, 1, 7).unwrap();
    // A queue not yet connected takes every slot but the admin queues' reserve.
    let bare = flood_with_a_queue_taking_no_responses(&s, &c, 0x18);
    // The keep-alive check has seen all traffic so far.
    let t0 = Instant::now();
    assert!(s.on_data_path(move |dp| dp.target().expire_keep_alives(t0).is_empty()));
    let queued = c.commands_queued.load(Relaxed);
    io.transport()
        .submit(0, rw_sqe(io_opcode::READ, 1, 0, 1, false), Payload::In(512))
        .unwrap();
    wait_until("the read waits for a slot", || {
        c.commands_queued.load(Relaxed) == queued + 1
    });
    let later = t0 + kato * 3 / 2;
    assert!(
        s.on_data_path(move |dp| dp.target().expire_keep_alives(later).is_empty()),
        "the controller expired while its read waited for a slot"
    );
    // The host that takes no responses goes; the read is answered.
    drop(bare);
    let mut done = Vec::new();
    wait_until("the read is answered", || {
        io.transport().poll(&mut done);
        !done.is_empty()
    });
    assert!(done[0].ok().is_ok());
}

/// The response timeout counts only time the data path looked: after it was held up for
/// longer than the timeout (its reactor blocked, the machine paused), with completions of
/// one connection behind another's more than a CQ batch, that connection is not ended for
/// work that moved meanwhile.
#[test]
fn a_data_path_held_up_past_the_response_timeout_ends_no_connection() {
    use nvmf_host::Payload;
    use nvmfd_nvme::host::rw_sqe;
    use nvmfd_nvme::wire::io_opcode;
    use std::sync::atomic::Ordering::Relaxed;
    let timeout = Duration::from_millis(400);
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_opts(
        4492,
        Some((64, 64)),
        None,
        Arc::clone(&c),
        None,
        Opts {
            response_timeout: timeout,
            ..Opts::default()
        },
    );
    let (_ax, mut x) = pipelined_controller(&s, 48, 4096);
    let (_ay, mut y) = pipelined_controller(&s, 4, 4096);
    let target_qp = |io: &mut IoQueue<nvmf_host::PipelinedQueue>| {
        s.fabric.peer_of(io.transport().qpn().unwrap()).unwrap()
    };
    let (tx, ty) = (target_qp(&mut x), target_qp(&mut y));
    s.fabric.hold_send_completions(tx);
    s.fabric.hold_send_completions(ty);
    let read = |lba| rw_sqe(io_opcode::READ, 1, lba, 1, false);
    for i in 0..40 {
        x.transport().submit(i, read(i), Payload::In(512)).unwrap();
    }
    wait_until("X's 40 responses are posted", || {
        c.sends_in_flight.load(Relaxed) == 40
    });
    y.transport().submit(0, read(0), Payload::In(512)).unwrap();
    wait_until("Y's response is posted", || {
        c.sends_in_flight.load(Relaxed) == 41
    });
    // A look at the connections sees their work out (every quarter of the timeout).
    let posted = Instant::now();
    wait_until("a look at the stalled work", || {
        posted.elapsed() > timeout / 2
    });
    s.set_switch(&s.paused, true);
    let paused = Instant::now();
    wait_until("longer than the timeout", || paused.elapsed() > timeout * 2);
    // X's 40 completions, then Y's: more than a CQ batch before Y's.
    assert_eq!(s.fabric.release_held_completions(), 41);
    s.paused.store(false, Relaxed);
    let mut done = Vec::new();
    wait_until("both hosts have their answers", || {
        x.transport().poll(&mut done);
        y.transport().poll(&mut done);
        done.len() == 41
    });
    assert!(done.iter().all(|d| d.ok().is_ok()));
    wait_until("the target saw every send complete", || {
        c.sends_in_flight.load(Relaxed) == 0
    });
    assert_eq!(c.responses_not_taken.load(Relaxed), 0);
    assert_eq!(c.teardowns_controller.load(Relaxed), 0);
}

/// A pipelined queue whose host was held up past its command timeout, with every answer
/// already in its CQ (more than one poll's batch), breaks on none of them: deadlines are
/// looked at only once the CQ was read to its end.
#[test]
fn a_pipelined_queue_held_up_past_its_timeout_takes_the_answers_waiting_for_it() {
    use nvmf_host::Payload;
    use nvmfd_nvme::host::rw_sqe;
    use nvmfd_nvme::wire::io_opcode;
    let timeout = Duration::from_millis(200);
    let s = serve_counted(4493, Some((64, 64)), Arc::default());
    let (_admin, mut io) = pipelined_controller(&s, 48, 4096);
    let q = io.transport();
    q.set_timeout(timeout);
    let qpn = q.qpn().unwrap();
    for i in 0..40 {
        q.submit(i, rw_sqe(io_opcode::READ, 1, i, 1, false), Payload::In(512))
            .unwrap();
    }
    wait_until(
        "every answer and send completion is in the host's CQ",
        || s.fabric.completions_waiting(qpn) == 80,
    );
    let submitted = Instant::now();
    wait_until("past the timeout", || submitted.elapsed() > timeout * 2);
    let mut done = Vec::new();
    for _ in 0..3 {
        q.poll(&mut done);
        assert!(q.broken().is_none(), "{:?}", q.broken());
    }
    assert_eq!(done.len(), 40);
    assert!(done.iter().all(|d| d.ok().is_ok()));
}

/// A host that resets its controller (CC.EN = 0) while a write of it is at the backend and,
/// tired of waiting for the reset to finish, comes back with a new association before its old
/// controller is seen to end, is answered Controller Busy until the write is done: the old
/// write could otherwise land over a new one the host was told is done.
#[test]
fn a_new_association_while_a_reset_waits_for_a_write_at_the_backend_is_busy() {
    use nvmfd_nvme::wire::property;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4494, None, Arc::clone(&c));
    let h = host();
    let (mut admin, mut io) = pipelined_controller(&s, 8, 8192);
    write_held_at_the_backend(&s, &c, &mut io, 96, 93);
    // The reset: the I/O queue is cut off, the write stays at the backend, and the old
    // controller lives on (its admin queue is still connected).
    admin.property_set(property::CC, 0).unwrap();
    busy_until_the_held_write_completes(&s, &c, &h, "the reset waited for the write");
    drop(io);
    drop(admin);
    let (_admin, mut ios) = controller(&s, 1);
    let new = pattern(94, 4096);
    ios[0].write(1, 96, 8, &new, false).unwrap();
    let mut back = vec![0u8; 4096];
    ios[0].read(1, 96, 8, &mut back).unwrap();
    assert!(back == new);
}

/// While an SRQ is broken (an SRQ error; its rebuild waits for its QPs' drains, one held by a
/// write at a stalled disk), a receive given back to it cannot be posted: every flush (two a
/// turn) failed and was counted as an SRQ error, thousands in one rebuild. The failure is
/// counted once until a post succeeds.
#[test]
fn a_broken_srq_counts_its_failing_posts_once() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Arc::new(nvmfd::stats::DataPathCounters::default());
    let s = serve_counted(4449, None, Arc::clone(&c));
    let (_admin, mut ios) = controller(&s, 2);
    s.hold_namespaces(1 << 2 | 1 << 1);
    let from_receive = c.writes_from_receive.load(Relaxed);
    // In-capsule writes to both namespaces, each on its own queue, held at their disks.
    let writers: Vec<_> = [(2u32, 1u32), (1, 8)]
        .into_iter()
        .map(|(nsid, nlb)| {
            let mut io = ios.pop().unwrap();
            std::thread::spawn(move || {
                let r = io.write(nsid, 9, nlb, &pattern(u64::from(nsid), 4096), false);
                (io, r)
            })
        })
        .collect();
    wait_until(
        "both writes are at their disks, from their receives",
        || c.writes_from_receive.load(Relaxed) == from_receive + 2,
    );
    s.fabric.inject_srq_error(s.srq_id);
    wait_until("the SRQ error tears every QP down", || {
        c.teardowns_device.load(Relaxed) == 3
    });
    let errors = c.srq_errors.load(Relaxed);
    // Namespace 1's write ends: its receive goes back to the broken SRQ, whose rebuild still
    // waits for the drain of the queue whose write namespace 2 holds.
    s.hold_namespaces(1 << 2);
    wait_until("namespace 1's write is done", || {
        c.requests_active.load(Relaxed) == 1
    });
    let turns = s.turns.load(Relaxed);
    wait_until("a thousand turns", || s.turns.load(Relaxed) >= turns + 1000);
    assert_eq!(c.srq_rebuilds.load(Relaxed), 0, "rebuilt meanwhile");
    let counted = c.srq_errors.load(Relaxed) - errors;
    assert!(counted <= 1, "{counted} SRQ errors counted for one");
    s.hold_namespaces(0);
    for w in writers {
        let (_io, r) = w.join().unwrap();
        assert!(r.is_err(), "answered on a QP torn down");
    }
}

/// On a hardware iWARP device an RDMA READ's sink must be registered for remote write: the
/// data pools (registered for local access only, as they must be: a remotely writable pool
/// would let every host write into every other's buffers) would fail every write whose data
/// is fetched by READ, and the host would reconnect to fail again. The data path is refused
/// on such a device, saying why.
#[test]
fn a_device_whose_read_sinks_must_be_remotely_writable_is_refused() {
    let fabric = Fabric::new();
    fabric.set_faults(nvmfd_rdma::soft::Faults {
        read_sink_needs_remote_write: true,
        ..nvmfd_rdma::soft::Faults::default()
    });
    let dev = any::Device::Soft(fabric.add_device("10.9.0.1".parse().unwrap()).unwrap());
    let limits = Limits::default();
    let cfg = DataPathConfig {
        srq: FIXED_SRQ,
        in_capsule: limits.in_capsule_data_size,
        buffers: 4,
        small_buffers: 8,
        max_io: limits.max_io_size,
        requests: 8,
        connect_timeout: Duration::from_secs(60),
        response_timeout: nvmfd::datapath::RESPONSE_TIMEOUT,
        huge_pages: false,
        max_qps: 8,
    };
    let made = DataPath::new(
        &dev,
        Target::new(vec![], vec![], limits),
        &[],
        cfg,
        Registrar::spawn().unwrap(),
        Arc::default(),
    );
    let Err(e) = made else {
        panic!("a data path on a device whose READ sinks need remote write");
    };
    assert!(e.to_string().contains("iWARP"), "{e}");
}
