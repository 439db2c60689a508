//! nvmfd serving NVMe-oF over the soft provider's TCP wire, and a host in this (other)
//! process using it: discovery, connect, identify, I/O verified from 512 B to the largest
//! transfer on two queues, shutdown, and connecting again.

// Sizes here are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation)]

use std::net::SocketAddr;

use nvmf_host::RdmaQueue;
use nvmfd_nvme::host::{AdminQueue, HostId, IoQueue};
use nvmfd_nvme::DISCOVERY_NQN;
use nvmfd_rdma::any::cm::CmChannel;
use nvmfd_rdma::soft::Fabric;
use nvmfd_tests::{Daemon, Options};

const SUB: &str = "nqn.2024-01.io.nvmfd.test:ram0";

fn listener(d: &Daemon) -> SocketAddr {
    let cfg = std::fs::read_to_string(d.dir.path().join("nvmfd.toml")).unwrap();
    let port: u16 = cfg
        .lines()
        .find_map(|l| l.strip_prefix("port = "))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    SocketAddr::new("127.0.0.1".parse().unwrap(), port)
}

fn host() -> HostId {
    HostId {
        nqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000e2".into(),
        id: [0xe2; 16],
    }
}

/// The host side: its own soft fabric, reaching the daemon over TCP.
fn queue(f: &Fabric, addr: SocketAddr, qid: u16, sqsize: u16) -> RdmaQueue {
    let ch = CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(f).unwrap());
    RdmaQueue::connect(ch, addr, qid, sqsize, 4096, 128 * 1024)
        .unwrap_or_else(|e| panic!("connect queue {qid}: {e}"))
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A new host (its own fabric on `ip`) connects, writes 4 KiB at `lba` and reads it back.
fn a_new_host_is_served(addr: SocketAddr, ip: &str, lba: u64, seed: u64) {
    let f = Fabric::networked();
    f.add_device(ip.parse().unwrap()).unwrap();
    let h = host();
    let mut admin = AdminQueue::connect(queue(&f, addr, 0, 31), &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    admin.set_queue_count(1).unwrap();
    let mut io = IoQueue::connect(queue(&f, addr, 1, 31), &h, SUB, admin.cntlid, 1, 31).unwrap();
    let data = pattern(seed, 4096);
    io.write(1, lba, 8, &data, false).unwrap();
    let mut back = vec![0u8; 4096];
    io.read(1, lba, 8, &mut back).unwrap();
    assert!(back == data, "read back differs");
}

#[test]
fn a_host_process_writes_and_reads_nvmfd_over_soft_rdma() {
    let d = Daemon::start(Options::default());
    let addr = listener(&d);
    let status = d.data("status");
    assert_eq!(status["listeners"][0]["serving"], true, "{status}");
    let f = Fabric::networked();
    f.add_device("127.0.0.2".parse().unwrap()).unwrap();
    let h = host();

    let mut disc = AdminQueue::connect(queue(&f, addr, 0, 31), &h, DISCOVERY_NQN, 31, 0).unwrap();
    disc.enable().unwrap();
    let entries = disc.discover().unwrap();
    let (nqn, traddr, port) = nvmfd_nvme::host::discovery_entry_text(&entries[0]);
    assert_eq!(
        (nqn.as_str(), traddr.as_str(), port.parse::<u16>().unwrap()),
        (SUB, "127.0.0.1", addr.port())
    );
    disc.transport().disconnect();

    for round in 0..2 {
        let mut admin = AdminQueue::connect(queue(&f, addr, 0, 31), &h, SUB, 31, 10_000).unwrap();
        admin.enable().unwrap();
        let id = admin.identify_controller().unwrap();
        assert_eq!(nvmfd_nvme::wire::get_str(&id.subnqn), Some(SUB));
        let ns = admin.identify_namespace(1).unwrap();
        assert_eq!(ns.nsze.get(), (64 << 20) / 512);
        assert_eq!(admin.set_queue_count(2).unwrap(), 2);
        let mut ios: Vec<IoQueue<RdmaQueue>> = (1..=2)
            .map(|q| {
                IoQueue::connect(queue(&f, addr, q, 63), &h, SUB, admin.cntlid, q, 63).unwrap()
            })
            .collect();
        let mut len = 512;
        let mut seed = round * 100;
        while len <= 128 * 1024 {
            seed += 1;
            let data = pattern(seed, len);
            let io = &mut ios[seed as usize % 2];
            io.write(1, seed * 300, (len / 512) as u32, &data, false)
                .unwrap();
            let mut back = vec![0u8; len];
            io.read(1, seed * 300, (len / 512) as u32, &mut back)
                .unwrap();
            assert!(back == data, "round {round}, {len} bytes: data differs");
            len *= 2;
        }
        ios[0].flush(1).unwrap();
        admin.keep_alive().unwrap();
        admin.shutdown().unwrap();
        for mut io in ios {
            io.transport().disconnect();
        }
        admin.transport().disconnect();
    }
    // The admin socket counts what went through the data path.
    let stats = d.data("stats");
    let dp = &stats["datapath"][0];
    let written: u64 = (0..9).map(|i| 512u64 << i).sum::<u64>() * 2;
    assert_eq!(dp["write_bytes_total"], written, "{stats}");
    assert_eq!(dp["read_bytes_total"], written, "{stats}");
    assert!(dp["commands_total"].as_u64().unwrap() > 40, "{stats}");
    assert!(
        dp["rdma_reads_total"].as_u64().unwrap() > 0,
        "keyed writes were pulled with RDMA READ: {stats}"
    );
    assert_eq!(
        dp["qps_accepted_total"], 7,
        "discovery, then two rounds of admin + 2 I/O queues: {stats}"
    );
    assert_eq!(
        dp["srq_receives_posted"], 256,
        "every receive went back: {stats}"
    );
}

#[test]
fn a_refused_connect_request_gets_its_reject_status_over_tcp() {
    let d = Daemon::start(Options::default());
    let addr = listener(&d);
    let f = Fabric::networked();
    f.add_device("127.0.0.2".parse().unwrap()).unwrap();
    let ch = CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&f).unwrap());
    let e = RdmaQueue::connect(ch, addr, 0, 4000, 4096, 128 * 1024).unwrap_err();
    assert!(
        e.to_string().contains("status 0x4"),
        "HSQSIZE above the limit: {e}"
    );
}

#[test]
fn several_hosts_at_once_and_a_refused_host_nqn() {
    let allowed: Vec<String> = (0..3)
        .map(|i| {
            format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000c0{i:02}")
        })
        .collect();
    let hosts = format!(
        "hosts = [{}]",
        allowed
            .iter()
            .map(|h| format!("\"{h}\""))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let d = Daemon::start(Options {
        replace: vec![("allow_any_host = true".into(), hosts)],
        ..Options::default()
    });
    let addr = listener(&d);

    // A host NQN not in the list is refused at Connect.
    let f = Fabric::networked();
    f.add_device("127.0.0.2".parse().unwrap()).unwrap();
    let stranger = HostId {
        nqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000ff".into(),
        id: [0xff; 16],
    };
    let refused = AdminQueue::connect(queue(&f, addr, 0, 31), &stranger, SUB, 31, 0).unwrap_err();
    assert!(
        refused
            .status()
            .is_some_and(|s| s.same_code(nvmfd_nvme::wire::status::CONNECT_INVALID_HOST)),
        "{refused}"
    );

    // Three allowed hosts, each in its own thread with its own fabric, write and read at once.
    let threads: Vec<_> = allowed
        .iter()
        .enumerate()
        .map(|(i, nqn)| {
            let nqn = nqn.clone();
            std::thread::spawn(move || {
                let f = Fabric::networked();
                f.add_device("127.0.0.3".parse().unwrap()).unwrap();
                let h = HostId {
                    nqn,
                    id: [i as u8; 16],
                };
                let mut admin =
                    AdminQueue::connect(queue(&f, addr, 0, 31), &h, SUB, 31, 10_000).unwrap();
                admin.enable().unwrap();
                admin.set_queue_count(1).unwrap();
                let mut io =
                    IoQueue::connect(queue(&f, addr, 1, 31), &h, SUB, admin.cntlid, 1, 31).unwrap();
                for j in 0..20u64 {
                    let lba = (i as u64 * 10_000) + j * 16;
                    let data = pattern(i as u64 * 1000 + j, 8192);
                    io.write(1, lba, 16, &data, false).unwrap();
                    let mut back = vec![0u8; 8192];
                    io.read(1, lba, 16, &mut back).unwrap();
                    assert!(back == data, "host {i}, write {j}");
                }
                admin.shutdown().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn a_burst_grows_the_srq_and_the_stats_show_it() {
    // A small SRQ: 8 receives, the limit at 2, growing by 8.
    let d = Daemon::start(Options {
        test_hooks: true,
        replace: vec![(
            "[[subsystem]]".into(),
            "[transport]\nsrq_initial = 8\nsrq_low_watermark = 2\nsrq_grow_chunk = 8\n\
             srq_max = 64\nsrq_shrink_delay = \"100ms\"\nsrq_cover_queues = false\n\n[[subsystem]]"
                .into(),
        )],
        ..Options::default()
    });
    let addr = listener(&d);
    let f = Fabric::networked();
    f.add_device("127.0.0.2".parse().unwrap()).unwrap();
    let h = host();
    let mut admin = AdminQueue::connect(queue(&f, addr, 0, 31), &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    const QUEUES: u16 = 16;
    assert_eq!(admin.set_queue_count(QUEUES).unwrap(), QUEUES);
    let mut ios: Vec<_> = (1..=QUEUES)
        .map(|q| IoQueue::connect(queue(&f, addr, q, 31), &h, SUB, admin.cntlid, q, 31).unwrap())
        .collect();
    let before = d.data("stats");
    assert_eq!(
        before["datapath"][0]["srq_receives_registered"], 8,
        "{before}"
    );
    // The reactor stalls; 16 queues each send an in-capsule write into the 8 receives.
    let v = d.request(r#"{"request":"debug_stall_reactor","reactor":0,"ms":60000}"#);
    assert_eq!(v["ok"], true, "{v}");
    nvmfd_tests::wait_for("the reactor to stall", || {
        d.log()
            .contains("test hook: reactor stalling")
            .then_some(())
    });
    let written: Vec<Vec<u8>> = std::thread::scope(|sc| {
        let handles: Vec<_> = ios
            .iter_mut()
            .enumerate()
            .map(|(q, io)| {
                sc.spawn(move || {
                    let mut all = Vec::new();
                    for round in 0..4u64 {
                        let data = pattern(q as u64 * 100 + round, 4096);
                        io.write(1, (q as u64 * 4 + round) * 8, 8, &data, false)
                            .unwrap_or_else(|e| panic!("queue {q}: {e}"));
                        all.extend_from_slice(&data);
                    }
                    all
                })
            })
            .collect();
        // The limit event reaches the control thread while the reactor is stalled.
        nvmfd_tests::wait_for("the SRQ limit event", || {
            d.log().contains("SRQ limit reached").then_some(())
        });
        let v = d.request(r#"{"request":"debug_stall_reactor","reactor":0,"ms":0}"#);
        assert_eq!(v["ok"], true, "{v}");
        handles.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for (q, io) in ios.iter_mut().enumerate() {
        let mut back = vec![0u8; 4 * 4096];
        io.read(1, q as u64 * 32, 32, &mut back).unwrap();
        assert!(back == written[q], "queue {q}: data differs");
    }
    let stats = d.data("stats");
    let dp = &stats["datapath"][0];
    eprintln!("{dp:#}");
    assert!(dp["srq_limit_events_total"].as_u64().unwrap() >= 1, "{dp}");
    assert!(dp["srq_grows_total"].as_u64().unwrap() >= 1, "{dp}");
    assert_eq!(dp["command_errors_total"], 0, "{dp}");
    assert_eq!(dp["srq_errors_total"], 0, "{dp}");
    assert!(d.log().contains("SRQ grew"), "{}", d.log());
    // Light load: the grown chunks go back.
    let mut n = 0u64;
    nvmfd_tests::wait_for("the SRQ to shrink back to 8", || {
        let mut b = vec![0u8; 512];
        ios[(n % 16) as usize].read(1, n % 64, 1, &mut b).unwrap();
        n += 1;
        let s = d.data("stats");
        (s["datapath"][0]["srq_receives_registered"] == 8).then_some(s)
    });
    let after = d.data("stats");
    let dp = &after["datapath"][0];
    assert!(dp["srq_shrinks_total"].as_u64().unwrap() >= 1, "{dp}");
    assert_eq!(dp["srq_receives_posted"], 8, "{dp}");
    eprintln!("after light load: {dp:#}");
    for mut io in ios {
        io.transport().disconnect();
    }
    admin.transport().disconnect();
}

/// The host process of `a_host_killed_with_io_in_flight_leaves_nothing_behind`: writes and
/// reads at the address in `NVMFD_CHILD_HOST` until it is killed.
#[test]
#[ignore = "a host process that the SIGKILL test starts and kills; not a test on its own"]
fn host_process_until_killed() {
    let Ok(addr) = std::env::var("NVMFD_CHILD_HOST") else {
        panic!("run by a_host_killed_with_io_in_flight_leaves_nothing_behind only");
    };
    let addr: SocketAddr = addr.parse().unwrap();
    let f = Fabric::networked();
    f.add_device("127.0.0.4".parse().unwrap()).unwrap();
    let h = host();
    let mut admin = AdminQueue::connect(queue(&f, addr, 0, 31), &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    admin.set_queue_count(2).unwrap();
    let mut ios: Vec<_> = (1..=2)
        .map(|q| IoQueue::connect(queue(&f, addr, q, 31), &h, SUB, admin.cntlid, q, 31).unwrap())
        .collect();
    for n in 0u64.. {
        let io = &mut ios[(n % 2) as usize];
        let data = pattern(n, 65536);
        io.write(1, (n % 64) * 128, 128, &data, false).unwrap();
        let mut back = vec![0u8; 65536];
        io.read(1, (n % 64) * 128, 128, &mut back).unwrap();
    }
}

#[test]
fn a_host_killed_with_io_in_flight_leaves_nothing_behind() {
    let d = Daemon::start(Options::default());
    let addr = listener(&d);
    let sum = |s: &serde_json::Value, k: &str| -> u64 {
        s["datapath"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r[k].as_u64().unwrap())
            .sum()
    };
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "host_process_until_killed"])
        .env("NVMFD_CHILD_HOST", addr.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    nvmfd_tests::wait_for("the host process's I/O to flow", || {
        (sum(&d.data("stats"), "commands_total") > 200).then_some(())
    });
    child.kill().unwrap();
    child.wait().unwrap();
    let stats = nvmfd_tests::wait_for("its QPs torn down and every pool full again", || {
        let s = d.data("stats");
        (sum(&s, "qps") == 0
            && sum(&s, "qps_draining") == 0
            && sum(&s, "requests_active") == 0
            && sum(&s, "buffers_free") == sum(&s, "buffers")
            && sum(&s, "request_slots_free") == sum(&s, "request_slots")
            && sum(&s, "sends_in_flight") == 0
            && sum(&s, "srq_receives_posted") == sum(&s, "srq_receives_registered"))
        .then_some(s)
    });
    assert_eq!(sum(&stats, "qps_accepted_total"), 3, "{stats}");
    // The lost link flushes the QPs (QP error, LAST_WQE) or its CM event arrives first.
    let torn: u64 = [
        "teardowns_disconnect_total",
        "teardowns_qp_error_total",
        "teardowns_controller_total",
    ]
    .iter()
    .map(|k| sum(&stats, k))
    .sum();
    assert_eq!(torn, 3, "{stats}");
    assert_eq!(sum(&stats, "drain_timeouts_total"), 0, "{stats}");
    // The daemon serves the next host as before.
    a_new_host_is_served(addr, "127.0.0.5", 9000, 7);
}

#[test]
fn a_silent_host_loses_its_controller_and_all_its_queues_and_can_connect_again_at_once() {
    let d = Daemon::start(Options {
        replace: vec![(
            "[[subsystem]]".into(),
            "[transport]\nkeep_alive_timeout_min = \"1s\"\n\n[[subsystem]]".into(),
        )],
        ..Options::default()
    });
    let addr = listener(&d);
    let dp = |d: &Daemon| d.data("stats")["datapath"][0].clone();
    let f = Fabric::networked();
    f.add_device("127.0.0.6".parse().unwrap()).unwrap();
    let h = host();
    // Keep-alive timeout 1 s; the host then says nothing.
    let mut admin = AdminQueue::connect(queue(&f, addr, 0, 31), &h, SUB, 31, 1000).unwrap();
    admin.enable().unwrap();
    admin.set_queue_count(2).unwrap();
    let _ios: Vec<_> = (1..=2)
        .map(|q| IoQueue::connect(queue(&f, addr, q, 31), &h, SUB, admin.cntlid, q, 31).unwrap())
        .collect();
    assert_eq!(dp(&d)["qps"], 3);
    let s = nvmfd_tests::wait_for("the controller and its three queues to end", || {
        let s = dp(&d);
        (s["teardowns_controller_total"] == 3 && s["qps"] == 0 && s["qps_draining"] == 0)
            .then_some(s)
    });
    assert_eq!(s["request_slots_free"], s["request_slots"], "{s}");
    assert_eq!(s["buffers_free"], s["buffers"], "{s}");
    assert!(d.log().contains("keep-alive timeout"), "{}", d.log());
    // The same host connects again at once and is served.
    a_new_host_is_served(addr, "127.0.0.8", 100, 11);
}

#[test]
fn stopping_the_daemon_tears_down_every_qp_through_the_drain() {
    let mut d = Daemon::start(Options::default());
    let addr = listener(&d);
    let f = Fabric::networked();
    f.add_device("127.0.0.7".parse().unwrap()).unwrap();
    let h = host();
    let mut admin = AdminQueue::connect(queue(&f, addr, 0, 31), &h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    admin.set_queue_count(1).unwrap();
    let mut io = IoQueue::connect(queue(&f, addr, 1, 31), &h, SUB, admin.cntlid, 1, 31).unwrap();
    io.write(1, 0, 8, &pattern(5, 4096), false).unwrap();
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success(), "log:\n{}", d.log());
    let log = d.log();
    let line = log
        .lines()
        .find(|l| l.contains("QPs torn down at shutdown"))
        .unwrap_or_else(|| panic!("no shutdown teardown in the log:\n{log}"));
    assert!(
        line.contains("\"qps\":2") && line.contains("\"not_drained\":0"),
        "{line}"
    );
}
