//! nvmfd serving NVMe-oF over the soft provider's TCP wire, and a host in this (other)
//! process using it: discovery, connect, identify, I/O verified from 512 B to the largest
//! transfer on two queues, shutdown, and connecting again.

// Sizes here are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation)]

use std::net::SocketAddr;

use nvmf_host::RdmaQueue;
use nvmfd_nvme::host::{AdminQueue, HostError, HostId, IoQueue};
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
    let mut v = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut v);
    v
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

/// A host on 127.0.0.6 with a keep-alive timeout of 1 s and `queues` I/O queues, which
/// then says nothing: its fabric and queues, kept open by the caller.
fn silent_host(
    addr: SocketAddr,
    queues: u16,
) -> (Fabric, AdminQueue<RdmaQueue>, Vec<IoQueue<RdmaQueue>>) {
    let f = Fabric::networked();
    f.add_device("127.0.0.6".parse().unwrap()).unwrap();
    let h = host();
    let mut admin = AdminQueue::connect(queue(&f, addr, 0, 31), &h, SUB, 31, 1000).unwrap();
    admin.enable().unwrap();
    admin.set_queue_count(queues).unwrap();
    let ios = (1..=queues)
        .map(|q| IoQueue::connect(queue(&f, addr, q, 31), &h, SUB, admin.cntlid, q, 31).unwrap())
        .collect();
    // The timeout runs from here: the callers see all the queues before it ends, however
    // long the connects took on a loaded machine.
    admin.keep_alive().unwrap();
    (f, admin, ios)
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
    // Keep-alive timeout 1 s; the host then says nothing.
    let _host = silent_host(addr, 2);
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

/// A reactor that sleeps long between turns (`stall_timeout` 40 s: up to 10 s) closes the
/// queues of a controller that expired at once: the control thread wakes it.
#[test]
fn the_queues_of_an_expired_controller_close_at_once_on_a_sleeping_reactor() {
    let d = Daemon::start(Options {
        replace: vec![
            (
                "[[subsystem]]".into(),
                "[transport]\nkeep_alive_timeout_min = \"1s\"\n\n[[subsystem]]".into(),
            ),
            (
                "stall_timeout = \"300ms\"".into(),
                "stall_timeout = \"40s\"".into(),
            ),
        ],
        ..Options::default()
    });
    let addr = listener(&d);
    let dp = |d: &Daemon| d.data("stats")["datapath"][0].clone();
    let _host = silent_host(addr, 1);
    assert_eq!(dp(&d)["qps"], 2);
    nvmfd_tests::wait_for("the controller to expire", || {
        d.log().contains("keep-alive timeout").then_some(())
    });
    let expired = std::time::Instant::now();
    while dp(&d)["qps"] != 0 {
        assert!(
            expired.elapsed() < std::time::Duration::from_secs(5),
            "the expired controller's queues were still open 5 s later: {}",
            dp(&d)
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// I/O commands are traffic (NVMe base spec, Keep Alive: any command resets the timer when
/// TBKAS is off). Host A sends only I/O, never a Keep Alive, for four keep-alive timeouts
/// after its last admin command; host B, connected beside it with the same timeout, says
/// nothing and loses its controller within that window, so the timeout is enforced there.
#[test]
fn io_alone_keeps_a_controller_alive_past_its_keep_alive_timeout() {
    use std::time::{Duration, Instant};
    let d = Daemon::start(Options::default());
    let addr = listener(&d);
    let expired = |d: &Daemon| d.data("stats")["datapath"][0]["teardowns_controller_total"] != 0;
    let f = Fabric::networked();
    f.add_device("127.0.0.9".parse().unwrap()).unwrap();
    let h = host();
    let kato = Duration::from_millis(1000);
    let ms = u32::try_from(kato.as_millis()).unwrap();
    let mut silent = AdminQueue::connect(queue(&f, addr, 0, 31), &h, SUB, 31, ms).unwrap();
    silent.enable().unwrap();
    let mut admin = AdminQueue::connect(queue(&f, addr, 0, 31), &h, SUB, 31, ms).unwrap();
    admin.enable().unwrap();
    admin.set_queue_count(1).unwrap();
    let mut io = IoQueue::connect(queue(&f, addr, 1, 31), &h, SUB, admin.cntlid, 1, 31).unwrap();
    // The last admin command: a Connect on an I/O queue is not one of the controller's.
    admin.keep_alive().unwrap();
    let last_admin = Instant::now();
    let data = pattern(77, 4096);
    io.write(1, 64, 8, &data, false).unwrap();
    let mut back = vec![0u8; 4096];
    let mut reads = 0u64;
    let mut silent_expired_after = None;
    while last_admin.elapsed() < 4 * kato || silent_expired_after.is_none() {
        assert!(
            last_admin.elapsed() < 20 * kato,
            "the silent host's controller never expired"
        );
        io.read(1, 64, 8, &mut back).unwrap_or_else(|e| {
            panic!(
                "I/O failed {:?} after the host's last admin command: {e}\n{}",
                last_admin.elapsed(),
                d.log()
            )
        });
        assert!(back == data, "read back differs");
        reads += 1;
        if silent_expired_after.is_none() && expired(&d) {
            silent_expired_after = Some(last_admin.elapsed());
        }
    }
    println!(
        "{reads} reads over {:?} without a keep-alive; the silent host expired after {:?}",
        last_admin.elapsed(),
        silent_expired_after.unwrap_or_default()
    );
    // Host A's controller is still there: its admin queue answers, and only host B's one
    // queue was torn down by a controller's end.
    admin.keep_alive().unwrap();
    let s = d.data("stats");
    assert_eq!(s["datapath"][0]["teardowns_controller_total"], 1, "{s}");
    assert!(d.log().contains("keep-alive timeout"), "{}", d.log());
    assert!(matches!(silent.keep_alive(), Err(HostError::Transport(_))));
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

/// A host's connection made by hand: its CM ID and channel, and what its QP uses.
type BareConnection = (
    nvmfd_rdma::soft::cm::CmId,
    nvmfd_rdma::soft::cm::CmChannel,
    (
        nvmfd_rdma::soft::Srq,
        nvmfd_rdma::soft::Cq,
        nvmfd_rdma::soft::Pd,
    ),
);

/// A host at the CM level only (its own fabric on `ip`): its QP made and its connect request
/// for an admin queue sent to `addr`, nothing more.
fn bare_connect(f: &Fabric, addr: SocketAddr) -> BareConnection {
    let ch = nvmfd_rdma::soft::cm::CmChannel::new(f).unwrap();
    let mut id = ch.resolve(addr, std::time::Duration::from_secs(3)).unwrap();
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
    (id, ch, (srq, cq, pd))
}

/// `bare_connect`, once the connection is established (no Fabrics Connect follows).
fn established_bare(f: &Fabric, addr: SocketAddr) -> BareConnection {
    let (id, ch, qp_on) = bare_connect(f, addr);
    nvmfd_tests::wait_for("ESTABLISHED", || match ch.next_event() {
        Some(nvmfd_rdma::soft::cm::CmEvent::Established { .. }) => Some(()),
        Some(other) => panic!("{other:?}"),
        None => None,
    });
    (id, ch, qp_on)
}

/// A long `stall_timeout` (an idle reactor slept a quarter of it) does not delay the
/// reactor's own timers: a connection that never sends a Fabrics Connect is still ended after
/// `transport.connect_timeout` (after minutes before).
#[test]
fn a_long_stall_timeout_does_not_delay_the_connect_timeout() {
    let d = Daemon::start(Options {
        replace: vec![
            (
                "[[subsystem]]".into(),
                "[transport]\nconnect_timeout = \"300ms\"\n\n[[subsystem]]".into(),
            ),
            (
                "stall_timeout = \"300ms\"".into(),
                "stall_timeout = \"10min\"".into(),
            ),
        ],
        ..Options::default()
    });
    let addr = listener(&d);
    let f = Fabric::networked();
    f.add_device("127.0.0.11".parse().unwrap()).unwrap();
    let (id, ch, qp_on) = established_bare(&f, addr);
    nvmfd_tests::wait_for(
        "the connection without a Fabrics Connect to be ended",
        || {
            (nvmfd_tests::dp_sum(&d.data("stats"), "connects_failed_no_connect_total") == 1)
                .then_some(())
        },
    );
    drop((id, ch, qp_on));
}

/// Through the daemon's control thread and reactor: a host process that goes away after its
/// connection was accepted, before its RTU (REJECTED at the daemon), and one that is
/// established but never sends a Fabrics Connect (ended after `transport.connect_timeout`).
/// Both release everything and are counted by cause, as `nvmfctl stats --prometheus` shows.
#[test]
fn connects_that_fail_before_the_fabrics_connect_are_released_and_counted() {
    let d = Daemon::start(Options {
        replace: vec![(
            "[[subsystem]]".into(),
            "[transport]\nconnect_timeout = \"300ms\"\n\n[[subsystem]]".into(),
        )],
        ..Options::default()
    });
    let addr = listener(&d);
    let f = Fabric::networked();
    f.add_device("127.0.0.9".parse().unwrap()).unwrap();
    let released = |what: &str, counter: &str| {
        nvmfd_tests::wait_for(what, || {
            let s = d.data("stats");
            (nvmfd_tests::dp_sum(&s, counter) == 1
                && nvmfd_tests::dp_sum(&s, "qps") == 0
                && nvmfd_tests::dp_sum(&s, "qps_draining") == 0
                && nvmfd_tests::dp_sum(&s, "srq_receives_reserved") == 0)
                .then_some(s)
        })
    };
    // Accepted, then the host goes away before it takes its ESTABLISHED: its REJ.
    let (id, ch, qp_on) = bare_connect(&f, addr);
    nvmfd_tests::wait_for("the daemon to accept", || {
        (nvmfd_tests::dp_sum(&d.data("stats"), "qps_accepted_total") == 1).then_some(())
    });
    drop((id, ch, qp_on));
    released(
        "the rejected connection to be released",
        "connects_failed_rejected_total",
    );
    // Established, and no Fabrics Connect follows.
    let (id, ch, qp_on) = established_bare(&f, addr);
    let s = released(
        "the connection without a Fabrics Connect to be ended",
        "connects_failed_no_connect_total",
    );
    assert!(pools_full(&s), "{s}");
    nvmfd_tests::wait_for("the host to hear of it", || match ch.next_event() {
        Some(nvmfd_rdma::soft::cm::CmEvent::Disconnected { .. }) => Some(()),
        _ => None,
    });
    drop((id, ch, qp_on));
    assert!(
        d.log().contains("no Fabrics Connect from the host in time"),
        "{}",
        d.log()
    );
    let out = std::process::Command::new(nvmfd_tests::bin("nvmfctl"))
        .arg("--socket")
        .arg(&d.socket)
        .args(["stats", "--prometheus"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for line in [
        "nvmfd_datapath_connects_failed_rejected_total{reactor=\"0\"} 1",
        "nvmfd_datapath_connects_failed_no_connect_total{reactor=\"0\"} 1",
        "nvmfd_datapath_connects_failed_unreachable_total{reactor=\"0\"} 0",
        "nvmfd_datapath_srq_receives_reserved{reactor=\"0\"} 0",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
    }
    // The daemon serves the next host as before.
    a_new_host_is_served(addr, "127.0.0.10", 300, 13);
}

/// Sum of a `stats` data path field over the reactors.
/// Whether every pool of every reactor is back to its full count: no command active or
/// waiting, every request slot and buffer free, no block operation or signaled send in
/// flight, no QP draining, every registered receive posted.
fn pools_full(s: &serde_json::Value) -> bool {
    nvmfd_tests::dp_sum(s, "requests_active") == 0
        && nvmfd_tests::dp_sum(s, "requests_waiting") == 0
        && nvmfd_tests::dp_sum(s, "request_slots_free") == nvmfd_tests::dp_sum(s, "request_slots")
        && nvmfd_tests::dp_sum(s, "buffers_free") == nvmfd_tests::dp_sum(s, "buffers")
        && nvmfd_tests::dp_sum(s, "block_ops_in_flight") == 0
        && nvmfd_tests::dp_sum(s, "sends_in_flight") == 0
        && nvmfd_tests::dp_sum(s, "qps_draining") == 0
        && nvmfd_tests::dp_sum(s, "srq_receives_posted")
            == nvmfd_tests::dp_sum(s, "srq_receives_registered")
}

/// A host with its own fabric (device `ip`): an admin queue and one I/O queue on `addr`.
fn connect_host(
    ip: &str,
    addr: SocketAddr,
    h: &HostId,
) -> (Fabric, AdminQueue<RdmaQueue>, IoQueue<RdmaQueue>) {
    let f = Fabric::networked();
    f.add_device(ip.parse().unwrap()).unwrap();
    let mut admin = AdminQueue::connect(queue(&f, addr, 0, 31), h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    admin.set_queue_count(1).unwrap();
    let io = IoQueue::connect(queue(&f, addr, 1, 31), h, SUB, admin.cntlid, 1, 31).unwrap();
    (f, admin, io)
}

/// Once nothing nvmfd made on listener 0's removed soft device is left (the device, as rxe,
/// could not come back otherwise), the device returns and the listener serves again.
fn device_back_once_released(d: &Daemon) {
    nvmfd_tests::wait_for("the removed device to be released", || {
        d.log()
            .contains("removed device released: nothing nvmfd made on it is left")
            .then_some(())
    });
    let v = d.request(r#"{"request":"debug_fault","fault":"restore_device","listener":0}"#);
    assert_eq!(v["ok"], true, "{v}");
    nvmfd_tests::wait_for("listener 0 to serve again", || {
        (d.data("status")["listeners"][0]["serving"] == true).then_some(())
    });
}

/// Writes `len` bytes of pattern `seed` at `lba` and reads them back.
fn write_verified(io: &mut IoQueue<RdmaQueue>, lba: u64, seed: u64, len: usize) -> Vec<u8> {
    let data = pattern(seed, len);
    io.write(1, lba, (len / 512) as u32, &data, false).unwrap();
    let mut back = vec![0u8; len];
    io.read(1, lba, (len / 512) as u32, &mut back).unwrap();
    assert!(back == data, "{len} bytes at LBA {lba}: read back differs");
    data
}

/// A bond's failover moves a listener's address to another port: rdma_cm reports
/// RDMA_CM_EVENT_ADDR_CHANGE on its listening ID and on its connections. The connections end
/// (as the kernel target ends its queues), and the listener listens again at once, bound
/// where the address is now (as the kernel target repairs its port); a host connects anew and
/// reads what it wrote. The event was dropped: the listening ID stayed bound to the old port,
/// and after a real failover no host could connect until the daemon restarted.
#[test]
fn a_listener_whose_address_moved_listens_again_and_its_connections_end() {
    let d = Daemon::start(Options {
        test_hooks: true,
        ..Options::default()
    });
    let a0 = listener(&d);
    let h = host();
    // A removal and a return first: the move after it is not another return.
    let v = d.request(r#"{"request":"debug_fault","fault":"remove_device","listener":0}"#);
    assert_eq!(v["ok"], true, "{v}");
    device_back_once_released(&d);
    let (_f, mut admin, mut io) = connect_host("127.0.0.57", a0, &h);
    let data = write_verified(&mut io, 100, 7, 8192);
    let v = d.request(r#"{"request":"debug_fault","fault":"addr_change","listener":0}"#);
    assert_eq!(v["ok"], true, "{v}");
    nvmfd_tests::wait_for("the old connections to end", || {
        admin.ping().is_err().then_some(())
    });
    let stats = nvmfd_tests::wait_for("listener 0 to listen again", || {
        let s = d.data("stats");
        (s["listeners"][0]["serving"] == true && s["listeners"][0]["address_changes_total"] == 1)
            .then_some(s)
    });
    assert_eq!(stats["listeners"][0]["device_removals_total"], 1, "{stats}");
    assert_eq!(
        stats["listeners"][0]["returns_total"], 1,
        "the move counted as a return: {stats}"
    );
    let (_f2, _admin2, mut io2) = connect_host("127.0.0.58", a0, &h);
    let mut back = vec![0u8; data.len()];
    io2.read(1, 100, (data.len() / 512) as u32, &mut back)
        .unwrap();
    assert!(
        back == data,
        "data written before the address moved differs"
    );
    write_verified(&mut io2, 200, 8, 4096);
    let log = d.log();
    assert!(
        log.contains("listener's address moved to another port"),
        "{log}"
    );
}

#[test]
fn a_removed_device_takes_its_listener_down_and_back_while_the_other_listener_serves() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    // Two reactors where there are two cores: each has a data path on both devices.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get().min(2));
    let list: Vec<String> = (0..cores).map(|c| c.to_string()).collect();
    let port1 = nvmfd_tests::test_port();
    let d = Daemon::start(Options {
        test_hooks: true,
        replace: vec![
            (
                "reactor_cores = [0]".into(),
                format!("reactor_cores = [{}]", list.join(", ")),
            ),
            (
                "[[subsystem]]".into(),
                format!(
                    "[[listener]]\naddress = \"127.0.0.2\"\nport = {port1}\nprovider = \"soft\"\n\n\
                     [[subsystem]]"
                ),
            ),
        ],
        ..Options::default()
    });
    let a0 = listener(&d);
    let a1 = SocketAddr::new("127.0.0.2".parse().unwrap(), port1);
    let status = d.data("status");
    assert_eq!(status["listeners"][0]["serving"], true, "{status}");
    assert_eq!(status["listeners"][1]["serving"], true, "{status}");
    let host_a = host();
    let host_b = HostId {
        nqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000b2".into(),
        id: [0xb2; 16],
    };

    // Host A, on listener 0, writes data and verifies it.
    let (_fa, mut admin_a, mut io_a) = connect_host("127.0.0.11", a0, &host_a);
    let before: Vec<(u64, Vec<u8>)> = (0..8u64)
        .map(|k| {
            let lba = 1000 + k * 256;
            (
                lba,
                write_verified(&mut io_a, lba, 100 + k, 4096 << (k % 5)),
            )
        })
        .collect();

    // Host B, on listener 1, does verified I/O from now on, until told to stop.
    let run_b = Arc::new(AtomicBool::new(true));
    let done_b = Arc::new(AtomicU64::new(0));
    let b = {
        let (run, done) = (Arc::clone(&run_b), Arc::clone(&done_b));
        let h = host_b.clone();
        std::thread::spawn(move || {
            let (f, admin, mut io) = connect_host("127.0.0.12", a1, &h);
            let mut n = 0u64;
            while run.load(Ordering::Relaxed) {
                write_verified(&mut io, 50_000 + (n % 32) * 16, 7000 + n, 8192);
                n += 1;
                done.store(n, Ordering::Relaxed);
            }
            (f, admin, io)
        })
    };
    // Host A keeps I/O in flight on other blocks until its queue fails.
    let a_busy = Arc::new(AtomicU64::new(0));
    let a_thread = {
        let busy = Arc::clone(&a_busy);
        std::thread::spawn(move || {
            for n in 0u64.. {
                let data = pattern(9000 + n, 65536);
                if let Err(e) = io_a.write(1, 20_000 + (n % 16) * 128, 128, &data, false) {
                    return e;
                }
                let mut back = vec![0u8; 65536];
                if let Err(e) = io_a.read(1, 20_000 + (n % 16) * 128, 128, &mut back) {
                    return e;
                }
                busy.store(n + 1, Ordering::Relaxed);
            }
            unreachable!()
        })
    };
    nvmfd_tests::wait_for("both hosts' I/O to flow", || {
        (done_b.load(Ordering::Relaxed) > 20 && a_busy.load(Ordering::Relaxed) > 20).then_some(())
    });

    // Listener 0's device goes.
    let v = d.request(r#"{"request":"debug_fault","fault":"remove_device","listener":0}"#);
    assert_eq!(v["ok"], true, "{v}");
    // Host A's queues end: its host library sees the target go.
    let e = a_thread.join().unwrap();
    assert!(matches!(e, HostError::Transport(_)), "{e}");
    let e = admin_a.ping().unwrap_err();
    assert!(matches!(e, HostError::Transport(_)), "{e}");
    let status = nvmfd_tests::wait_for("listener 0 to stop serving", || {
        let s = d.data("status");
        (s["listeners"][0]["serving"] == false).then_some(s)
    });
    assert_eq!(
        status["listeners"][0]["reason"], "device removed, waiting for it to return",
        "{status}"
    );
    assert_eq!(status["listeners"][1]["serving"], true, "{status}");
    // Nobody reaches listener 0 while its device is away.
    let f = Fabric::networked();
    f.add_device("127.0.0.13".parse().unwrap()).unwrap();
    let ch = CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&f).unwrap());
    assert!(RdmaQueue::connect(ch, a0, 0, 31, 4096, 128 * 1024).is_err());
    // Host B's I/O goes on.
    let at_removal = done_b.load(Ordering::Relaxed);
    nvmfd_tests::wait_for("host B's I/O to go on after the removal", || {
        (done_b.load(Ordering::Relaxed) >= at_removal + 50).then_some(())
    });
    // Every reactor released its data path on the removed device with nothing outstanding.
    let released =
        "data path of the removed device released: every request, buffer and send came back";
    nvmfd_tests::wait_for("every reactor to release the removed device", || {
        (d.log().matches(released).count() == cores).then_some(())
    });
    assert!(
        !d.log().contains("released with work outstanding"),
        "{}",
        d.log()
    );
    run_b.store(false, Ordering::Relaxed);
    let (_fb, mut admin_b, mut io_b) = b.join().unwrap();
    // Host B stays connected; every pool is full again.
    let stats = nvmfd_tests::wait_for("every pool back to its full count", || {
        let s = d.data("stats");
        pools_full(&s).then_some(s)
    });
    assert_eq!(
        nvmfd_tests::dp_sum(&stats, "qps"),
        2,
        "host B's queues: {stats}"
    );
    assert_eq!(
        nvmfd_tests::dp_sum(&stats, "drain_timeouts_total"),
        0,
        "{stats}"
    );
    let torn: u64 = [
        "teardowns_device_total",
        "teardowns_qp_error_total",
        "teardowns_disconnect_total",
        "teardowns_controller_total",
    ]
    .iter()
    .map(|k| nvmfd_tests::dp_sum(&stats, k))
    .sum();
    assert_eq!(torn, 2, "host A's two queues, and only them: {stats}");
    assert_eq!(stats["listeners"][0]["device_removals_total"], 1, "{stats}");
    assert_eq!(stats["listeners"][0]["serving"], false, "{stats}");

    // Nothing nvmfd made on the removed device is left (the soft device, as rxe, could not
    // come back otherwise).
    // The device returns: the listener serves again.
    device_back_once_released(&d);
    // Host A connects anew: what it wrote before the fault reads back, and it writes more.
    let (_fa2, mut admin_a, mut io_a) = connect_host("127.0.0.14", a0, &host_a);
    for (lba, data) in &before {
        let mut back = vec![0u8; data.len()];
        io_a.read(1, *lba, (data.len() / 512) as u32, &mut back)
            .unwrap();
        assert!(
            back == *data,
            "LBA {lba}: data written before the removal differs"
        );
    }
    for k in 0..8u64 {
        write_verified(&mut io_a, 30_000 + k * 256, 500 + k, 4096 << (k % 5));
    }
    write_verified(&mut io_b, 60_000, 42, 16384);
    let stats = d.data("stats");
    assert_eq!(stats["listeners"][0]["device_removals_total"], 1, "{stats}");
    assert_eq!(stats["listeners"][0]["returns_total"], 1, "{stats}");
    assert_eq!(stats["listeners"][1]["device_removals_total"], 0, "{stats}");
    assert_eq!(stats["listeners"][1]["returns_total"], 0, "{stats}");
    let log = d.log();
    assert_eq!(
        log.matches("device removed: the listener stops serving")
            .count(),
        1,
        "logged once, however many events told of it:\n{log}"
    );
    assert!(
        log.contains("device returned: the listener serves again"),
        "{log}"
    );
    admin_a.shutdown().unwrap();
    admin_b.shutdown().unwrap();
}

/// A reset on the admin queue's reactor ends the controller's idle I/O queue on another
/// reactor at once: that reactor, asleep (for up to `max_sleep`, 15 s here), is woken by the
/// change, and CSTS.RDY reads 0 long before it would have woken by itself.
#[test]
fn a_reset_ends_the_io_queue_on_a_sleeping_reactor_at_once() {
    use std::time::{Duration, Instant};
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        nvmfd_tests::skip("needs two cores");
        return;
    }
    let d = Daemon::start(Options {
        replace: vec![
            (
                "reactor_cores = [0]".into(),
                "reactor_cores = [0, 1]".into(),
            ),
            // max_sleep is a quarter of it.
            (
                "stall_timeout = \"300ms\"".into(),
                "stall_timeout = \"60s\"".into(),
            ),
        ],
        ..Options::default()
    });
    let addr = listener(&d);
    let (_f, mut admin, mut io) = connect_host("127.0.0.41", addr, &host());
    write_verified(&mut io, 0, 41, 4096);
    // One queue on each reactor.
    let stats = d.data("stats");
    let mut on: Vec<u64> = stats["datapath"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["qps"] == 1)
        .map(|p| p["reactor"].as_u64().unwrap())
        .collect();
    on.sort_unstable();
    assert_eq!(
        on,
        [0, 1],
        "the admin and I/O queues on the two reactors: {stats}"
    );
    // Both reactors have just gone to sleep: the I/O queue's sleeps for 15 s unless woken
    // (the admin queue's wakes for the reset).
    let sleeps = |d: &Daemon| {
        let s = d.data("stats");
        [0, 1].map(|r| s["reactors"][r]["sleeps_total"].as_u64().unwrap())
    };
    let before = sleeps(&d);
    // Each woken by a command of its queue, then asleep again.
    let mut back = vec![0u8; 4096];
    io.read(1, 0, 8, &mut back).unwrap();
    admin.ping().unwrap();
    nvmfd_tests::wait_for("both reactors to go to sleep", || {
        let now = sleeps(&d);
        (now[0] > before[0] && now[1] > before[1]).then_some(())
    });
    let t = Instant::now();
    admin
        .property_set(nvmfd_nvme::wire::property::CC, 0)
        .unwrap();
    let end = t + Duration::from_secs(30);
    while admin
        .property_get(nvmfd_nvme::wire::property::CSTS, false)
        .unwrap()
        & 1
        == 1
    {
        assert!(Instant::now() < end, "RDY still 1 after 30 s");
    }
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "RDY read 0 after {took:?}: the sleeping reactor let its queue go only when it woke"
    );
    drop(io);
}
