//! A block operation that does not end: a file namespace on a frozen file system (`fsfreeze`,
//! as a snapshot tool does), whose writes wait in the kernel until it is thawed. Needs root
//! and loop devices; skips visibly without them.

// Sizes here are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use nvmf_host::RdmaQueue;
use nvmfd_nvme::host::{AdminQueue, HostId, IoQueue};
use nvmfd_rdma::any::cm::CmChannel;
use nvmfd_rdma::soft::Fabric;
use nvmfd_tests::{Daemon, Options};

const SUB: &str = "nqn.2024-01.io.nvmfd.test:ram0";

/// An ext4 file system on a loop device, mounted; unmounted when dropped.
struct LoopFs {
    _dir: tempfile::TempDir,
    mnt: PathBuf,
}

/// `LoopFs` frozen until dropped. Dropped before the daemon that has writes waiting on it,
/// which could not exit before the thaw.
struct Frozen(PathBuf);

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = run("fsfreeze", &["-u", self.0.to_str().unwrap()]);
    }
}

fn run(cmd: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl LoopFs {
    /// A 64 MiB file system, or why there cannot be one here.
    fn new() -> Result<LoopFs, String> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Err("needs root to mount a file system".into());
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let img = dir.path().join("fs.img");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).map_err(|e| e.to_string())?;
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(64 << 20))
            .map_err(|e| e.to_string())?;
        let p = |p: &Path| p.to_str().expect("a UTF-8 temporary path").to_owned();
        run("mkfs.ext4", &["-q", "-F", &p(&img)])?;
        run("mount", &["-o", "loop", &p(&img), &p(&mnt)])?;
        Ok(LoopFs { _dir: dir, mnt })
    }

    fn freeze(&self) -> Frozen {
        run("fsfreeze", &["-f", self.mnt.to_str().unwrap()]).unwrap();
        Frozen(self.mnt.clone())
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = run("umount", &[self.mnt.to_str().unwrap()]);
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut v);
    v
}

/// A host with its own fabric (device `ip`): an admin queue and one I/O queue on `addr`.
fn connect_host(
    ip: &str,
    addr: SocketAddr,
    h: &HostId,
) -> (Fabric, AdminQueue<RdmaQueue>, IoQueue<RdmaQueue>) {
    let f = Fabric::networked();
    f.add_device(ip.parse().unwrap()).unwrap();
    let queue = |qid: u16| {
        let ch = CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&f).unwrap());
        RdmaQueue::connect(ch, addr, qid, 31, 4096, 128 * 1024)
            .unwrap_or_else(|e| panic!("connect queue {qid}: {e}"))
    };
    let mut admin = AdminQueue::connect(queue(0), h, SUB, 31, 0).unwrap();
    admin.enable().unwrap();
    admin.set_queue_count(1).unwrap();
    let io = IoQueue::connect(queue(1), h, SUB, admin.cntlid, 1, 31).unwrap();
    (f, admin, io)
}

#[test]
fn a_removed_device_with_a_stuck_block_operation_does_not_stop_its_reactor() {
    let fs = match LoopFs::new() {
        Ok(fs) => fs,
        Err(why) => return nvmfd_tests::skip(&why),
    };
    let img = fs.mnt.join("ns.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(16 << 20))
        .unwrap();
    // One reactor, with a data path on each of two devices; namespace 2 is the file.
    let port1 = nvmfd_tests::test_port();
    let d = Daemon::start(Options {
        test_hooks: true,
        replace: vec![
            (
                "[[subsystem]]".into(),
                format!(
                    "[[listener]]\naddress = \"127.0.0.2\"\nport = {port1}\nprovider = \"soft\"\n\n\
                     [[subsystem]]"
                ),
            ),
            (
                "size = \"64MiB\"\n".into(),
                format!(
                    "size = \"64MiB\"\n\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"file\"\n\
                     path = \"{}\"\n",
                    img.display()
                ),
            ),
        ],
        ..Options::default()
    });
    let a0 = d.soft_addr();
    let a1 = SocketAddr::new("127.0.0.2".parse().unwrap(), port1);
    let host = |b: u8| HostId {
        nqn: format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000{b:02x}"),
        id: [b; 16],
    };

    // Host A, on listener 0, writes to the file namespace; then the file system freezes and
    // host A's next write waits in the kernel.
    let (_fa, _admin_a, mut io_a) = connect_host("127.0.0.11", a0, &host(0xa3));
    let data = pattern(1, 4096);
    io_a.write(2, 8, 8, &data, false).unwrap();
    let frozen = fs.freeze();
    let a = std::thread::spawn(move || io_a.write(2, 64, 8, &pattern(2, 4096), false));
    nvmfd_tests::wait_for("host A's write to wait at the frozen file system", || {
        (nvmfd_tests::dp_sum(&d.data("stats"), "block_ops_in_flight") == 1).then_some(())
    });

    // Listener 0's device goes, with the write still in the kernel.
    let v = d.request(r#"{"request":"debug_fault","fault":"remove_device","listener":0}"#);
    assert_eq!(v["ok"], true, "{v}");
    assert!(a.join().unwrap().is_err(), "host A's write cannot succeed");
    // The drains time out; the data path stays while its write is in the kernel (dropping
    // its engine would wait for the write, on the reactor's thread).
    nvmfd_tests::wait_for("the removed device's data path to be kept", || {
        d.log()
            .contains("data path of the removed device kept until its block operations end")
            .then_some(())
    });
    // The reactor serves meanwhile: host B, on listener 1, connects and does verified I/O on
    // the RAM namespace until told to stop.
    let run_b = Arc::new(AtomicBool::new(true));
    let done_b = Arc::new(AtomicU64::new(0));
    let b = {
        let (run, done) = (Arc::clone(&run_b), Arc::clone(&done_b));
        let h = host(0xb3);
        std::thread::spawn(move || {
            let (f, admin, mut io) = connect_host("127.0.0.12", a1, &h);
            let mut n = 0u64;
            while run.load(Ordering::Relaxed) {
                let data = pattern(7000 + n, 8192);
                let lba = 50_000 + (n % 32) * 16;
                io.write(1, lba, 16, &data, false).unwrap();
                let mut back = vec![0u8; 8192];
                io.read(1, lba, 16, &mut back).unwrap();
                assert!(back == data, "host B: LBA {lba} read back differs");
                n += 1;
                done.store(n, Ordering::Relaxed);
            }
            (f, admin, io)
        })
    };

    nvmfd_tests::wait_for("host B's I/O to go on with the write stuck", || {
        (done_b.load(Ordering::Relaxed) >= 20).then_some(())
    });
    // (Host B's own operation may be in flight too.)
    let s = d.data("stats");
    assert!(nvmfd_tests::dp_sum(&s, "block_ops_in_flight") >= 1, "{s}");

    // Thawed, the write ends; the data path is released with everything back.
    drop(frozen);
    nvmfd_tests::wait_for("the removed device's data path to be released", || {
        d.log()
            .contains(
                "data path of the removed device released: every request, buffer and send came back",
            )
            .then_some(())
    });
    run_b.store(false, Ordering::Relaxed);
    let (_fb, _admin_b, _io_b) = b.join().unwrap();
    // Host B's last response may still await its send completion at the target.
    nvmfd_tests::wait_for("every slot and buffer back", || {
        let s = d.data("stats");
        (nvmfd_tests::dp_sum(&s, "block_ops_in_flight") == 0
            && nvmfd_tests::dp_sum(&s, "requests_active") == 0
            && nvmfd_tests::dp_sum(&s, "request_slots_free")
                == nvmfd_tests::dp_sum(&s, "request_slots")
            && nvmfd_tests::dp_sum(&s, "buffers_free") == nvmfd_tests::dp_sum(&s, "buffers"))
        .then_some(())
    });
    assert!(
        !d.log().contains("released with work outstanding"),
        "{}",
        d.log()
    );
}
