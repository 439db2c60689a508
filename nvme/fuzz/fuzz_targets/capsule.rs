//! Arbitrary capsules (SQE plus in-capsule data) against a live controller: an admin queue
//! and an I/O queue of a connected, enabled controller, with host memory registered so that
//! keyed SGLs sometimes land. Nothing may panic, hang or read out of bounds; a connection the
//! target closes is opened again.
//!
//! Input: a sequence of records `[queue selector][len lo][len hi][capsule bytes...]`.

#![no_main]

use std::cell::RefCell;
use std::rc::Rc;

use libfuzzer_sys::fuzz_target;
use nvmfd_blockdev::{Device, DeviceSpec, Kind};
use nvmfd_nvme::host::{AdminQueue, HostId, IoQueue};
#[path = "../../tests/support/loopback.rs"]
#[allow(dead_code)] // The fuzz target uses part of the tests' transport.
mod loopback;
use loopback::{namespace_info, Backend, Loopback};
use nvmfd_nvme::{Limits, Namespace, Port, Subsystem, Target};

const SUB: &str = "nqn.2024-01.io.nvmfd.fuzz:ram";

struct World {
    target: Target,
    backend: Rc<RefCell<Backend>>,
    admin: AdminQueue<Loopback>,
    io: IoQueue<Loopback>,
}

fn host() -> HostId {
    HostId { nqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000f022".into(), id: [7; 16] }
}

fn connect(target: &Target, backend: &Rc<RefCell<Backend>>) -> (AdminQueue<Loopback>, IoQueue<Loopback>) {
    let h = host();
    let mut admin = AdminQueue::connect(Loopback::new(target, backend, 0, 31), &h, SUB, 31, 0).expect("admin connect");
    admin.enable().expect("enable");
    admin.set_queue_count(1).expect("queues");
    let io = IoQueue::connect(Loopback::new(target, backend, 1, 63), &h, SUB, admin.cntlid, 1, 63).expect("io connect");
    (admin, io)
}

fn world() -> World {
    let mut spec = DeviceSpec::new(Kind::Malloc);
    spec.size = 1 << 20;
    let dev = Device::open(&spec).expect("malloc");
    let mut null = DeviceSpec::new(Kind::Null);
    null.size = 1 << 30;
    null.block_size = 4096;
    let null = Device::open(&null).expect("null");
    let subsystems = vec![Subsystem {
        id: 0,
        nqn: SUB.into(),
        serial: "FUZZ".into(),
        model: "fuzz".into(),
        allow_any_host: true,
        hosts: vec![],
        cntlids: nvmfd_nvme::ALL_CNTLIDS,
        namespaces: vec![
            Namespace { nsid: 1, info: namespace_info(dev.info()), uuid: Some([1; 16]), nguid: None },
            Namespace { nsid: 2, info: namespace_info(null.info()), uuid: None, nguid: Some([2; 16]) },
        ],
    }];
    let limits = Limits { max_io_size: 16384, ..Limits::default() };
    let target = Target::new(subsystems, vec![Port { addr: "127.0.0.1".parse().unwrap(), port: 4420, id: 0 }], limits);
    let backend = Backend::new(&[(SUB.into(), 1, dev), (SUB.into(), 2, null)], limits.max_io_size).expect("backend");
    let (admin, io) = connect(&target, &backend);
    World { target, backend, admin, io }
}

thread_local! {
    static WORLD: RefCell<Option<World>> = const { RefCell::new(None) };
}

fuzz_target!(|data: &[u8]| {
    WORLD.with(|w| {
        let mut w = w.borrow_mut();
        let w = w.get_or_insert_with(world);
        let mut rest = data;
        while rest.len() >= 3 {
            let sel = rest[0];
            let len = usize::from(u16::from_le_bytes([rest[1], rest[2]])) % 8300;
            rest = &rest[3..];
            let n = len.min(rest.len());
            let capsule = &rest[..n];
            rest = &rest[n..];
            let link = if sel & 1 == 0 { w.admin.transport() } else { w.io.transport() };
            // Host memory the SGLs of this capsule may point at (key and address as the
            // loopback hands them out).
            link.register_host_memory(vec![0xA5; 16384]);
            let _ = link.send_capsule(capsule);
            let _ = link.poll_events();
            if sel & 0x80 != 0 {
                w.target.namespace_changed(SUB, 1);
            }
        }
        if w.admin.transport().closed().is_some() || w.io.transport().closed().is_some() || w.io.transport().queue().must_disconnect() {
            let (a, i) = connect(&w.target, &w.backend);
            w.admin = a;
            w.io = i;
        }
    });
});
