//! Helpers for nvmfd's end-to-end tests: start the real binaries, talk to them, wait for
//! conditions (never for fixed times), and clean up.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;

pub mod host;
pub mod stress;

/// How long any wait in these tests may take before it fails.
pub const WAIT: Duration = Duration::from_secs(20);

/// The path of a workspace binary built next to the test executable (`target/<profile>/`,
/// above the test's `deps/`) or next to this program when it is itself a binary.
///
/// Cargo builds a package's binaries only for that package's own tests, so the test command
/// builds them first (`cargo build --bins`); this fails with that advice when one is missing or
/// older than the sources it is built from.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("target/<profile>");
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir = dir.parent().expect("target/<profile>/deps");
    }
    let path = dir.join(name);
    let built = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| {
            panic!(
                "{} is missing: run `cargo build --workspace --bins` first",
                path.display()
            )
        });
    if let Some(newer) = newer_source(&path, name, built) {
        panic!(
            "{} is older than {}: run `cargo build --workspace --bins` first",
            path.display(),
            newer.display()
        );
    }
    path
}

/// A source that binary `name` (at `path`) is built from newer than `built`, if any: the
/// files cargo's dep-info beside it (`<name>.d`) lists, which are exactly those (a module
/// compiled only into tests, newer than the binary, is none of them: cargo does not relink the
/// binary for it), and the workspace's `Cargo.toml`, whose features change what is compiled
/// in. Without dep-info: its crate's and the workspace crates' sources it uses.
fn newer_source(path: &Path, name: &str, built: SystemTime) -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let manifest = root.join("Cargo.toml");
    let manifest = std::fs::metadata(&manifest)
        .and_then(|m| m.modified())
        .ok()
        .map(|t| (t, manifest));
    let modified = |p: PathBuf| {
        std::fs::metadata(&p)
            .and_then(|m| m.modified())
            .ok()
            .map(|t| (t, p))
    };
    if let Some(deps) = std::fs::read_to_string(path.with_extension("d"))
        .ok()
        .and_then(|text| dep_info_sources(&text))
    {
        return deps
            .into_iter()
            .filter_map(modified)
            .chain(manifest)
            .find(|(t, _)| *t > built)
            .map(|(_, p)| p);
    }
    // The libraries it links (their `src/bin` left out: other binaries), and its own file.
    let (libs, own): (&[&str], &str) = match name {
        "nvmfd" | "nvmfctl" => (
            &[
                "daemon/src",
                "config/src",
                "nvme/src",
                "blockdev/src",
                "rdma-transport/src",
            ],
            "daemon/src/bin",
        ),
        "nvmf" => (
            &["host/src", "nvme/src", "rdma-transport/src"],
            "host/src/bin",
        ),
        _ => (
            &["tests/src", "host/src", "nvme/src", "rdma-transport/src"],
            "tests/src/bin",
        ),
    };
    let own = root.join(own).join(format!("{name}.rs"));
    let own = std::fs::metadata(&own)
        .and_then(|m| m.modified())
        .ok()
        .map(|t| (t, own));
    libs.iter()
        .filter_map(|src| newest_file(&root.join(src)))
        .chain(own)
        .chain(manifest)
        .find(|(t, _)| *t > built)
        .map(|(_, p)| p)
}

/// The release build of workspace binary `name` (`target/release/<name>`, next to this test's
/// `target/<profile>/`), or why there is none to use: missing, or older than its sources. The
/// test command builds the release binaries before `cargo test`; a test that needs one and
/// gets an `Err` says it is skipped, and why.
pub fn release_bin(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let target = exe
        .parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .ok_or("no target directory above the test executable")?;
    let path = target.join("release").join(name);
    let built = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .map_err(|_| {
            format!(
                "{} is missing (`cargo build --release --bins` builds it; the test command does)",
                path.display()
            )
        })?;
    match newer_source(&path, name, built) {
        Some(newer) => Err(format!(
            "{} is older than {} (`cargo build --release --bins` rebuilds it)",
            path.display(),
            newer.display()
        )),
        None => Ok(path),
    }
}

/// The sources a dep-info file (`target: source source ...`, spaces in a path escaped with
/// `\`) names for its first target.
fn dep_info_sources(text: &str) -> Option<Vec<PathBuf>> {
    let (_, deps) = text.lines().next()?.split_once(": ")?;
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = deps.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => cur.extend(chars.next()),
            ' ' => {
                if !cur.is_empty() {
                    out.push(PathBuf::from(std::mem::take(&mut cur)));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(PathBuf::from(cur));
    }
    Some(out)
}

#[cfg(test)]
mod dep_info_tests {
    #[test]
    fn a_dep_info_line_names_every_source_with_its_escaped_spaces() {
        let text = "/t/nvmfd: /w/a.rs /w/my\\ dir/b.rs  /w/c.rs\n\n/w/a.rs:\n";
        let got = super::dep_info_sources(text).unwrap();
        let want: Vec<std::path::PathBuf> = ["/w/a.rs", "/w/my dir/b.rs", "/w/c.rs"]
            .iter()
            .map(Into::into)
            .collect();
        assert_eq!(got, want);
    }
}

fn newest_file(dir: &Path) -> Option<(SystemTime, PathBuf)> {
    let mut best: Option<(SystemTime, PathBuf)> = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        let cand = if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "bin") {
                continue;
            }
            newest_file(&p)
        } else {
            e.metadata().ok()?.modified().ok().map(|t| (t, p))
        };
        if let Some(c) = cand {
            if best.as_ref().is_none_or(|b| c.0 > b.0) {
                best = Some(c);
            }
        }
    }
    best
}

/// Polls `f` until it returns `Some`, or panics after `WAIT` with `what`.
pub fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A TCP port for a test daemon's soft listener, different for every call in this process
/// (and, by the process ID, from other test processes). Below Linux's ephemeral range
/// (32768 and up), so that no test's outgoing connection can hold it before the daemon binds.
pub fn test_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 10000 + u16::try_from(std::process::id() % 200).unwrap_or(0) * 100;
    base + NEXT.fetch_add(1, Ordering::Relaxed) % 100
}

/// A configuration for tests: one reactor on core 0, the admin socket in `dir`, a soft
/// listener on 127.0.0.1 (a port of its own) and a RAM subsystem; `extra_daemon` adds lines to
/// `[daemon]`.
pub fn test_config(dir: &Path, extra_daemon: &str) -> String {
    let port = test_port();
    format!(
        r#"[daemon]
reactor_cores = [0]
admin_socket = "{}"
stall_timeout = "300ms"
{extra_daemon}

[[listener]]
address = "127.0.0.1"
port = {port}
provider = "soft"

[[subsystem]]
nqn = "nqn.2024-01.io.nvmfd.test:ram0"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "malloc"
size = "64MiB"
"#,
        dir.join("admin.sock").display()
    )
}

/// Options for starting a daemon.
#[derive(Debug, Default)]
pub struct Options {
    /// Lines added to `[daemon]` (ignored when `config` is set).
    pub extra_daemon: String,
    /// The whole configuration, instead of `test_config` (`@DIR@` in it: the daemon's
    /// directory, where its admin socket must be).
    pub config: Option<String>,
    /// Text replacements applied to `test_config`'s output.
    pub replace: Vec<(String, String)>,
    /// Give the daemon a `NOTIFY_SOCKET` that the test reads.
    pub notify: bool,
    /// Set `WATCHDOG_USEC`.
    pub watchdog_usec: Option<u64>,
    /// Set `NVMFD_TEST_HOOKS=1`.
    pub test_hooks: bool,
    /// Further environment variables.
    pub env: Vec<(String, String)>,
    /// The `nvmfd` binary to start, instead of the one `bin` finds.
    pub binary: Option<PathBuf>,
    /// Its standard error a pipe nobody reads (closed before it starts): every log line
    /// fails with EPIPE. `Daemon::log` is then empty.
    pub stderr_broken: bool,
    /// Its configuration path (`nvmfd.toml`) a symlink to `v1.toml` beside it.
    pub config_symlink: bool,
    /// The one core it starts on (its affinity mask), as a service on a machine with
    /// `isolcpus` starts outside the isolated cores.
    pub start_on_core: Option<usize>,
}

/// Makes `cmd`'s process start with `core` alone in its affinity mask.
pub fn start_on_core(cmd: &mut Command, core: usize) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure calls sched_setaffinity alone (async-signal-safe) on plain data.
    unsafe {
        cmd.pre_exec(move || {
            // SAFETY: plain data.
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(core, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A running `nvmfd` process, killed if still running when dropped.
#[derive(Debug)]
pub struct Daemon {
    /// The process.
    pub child: Child,
    /// Its temporary directory (config, socket, log).
    pub dir: tempfile::TempDir,
    /// Its admin socket.
    pub socket: PathBuf,
    /// The notification socket, when `Options::notify`.
    pub notify: Option<UnixDatagram>,
    log_path: PathBuf,
    exit: Option<ExitStatus>,
}

impl Daemon {
    /// The address of its (first) soft listener, from its configuration file.
    pub fn soft_addr(&self) -> std::net::SocketAddr {
        let cfg = std::fs::read_to_string(self.dir.path().join("nvmfd.toml"))
            .expect("the daemon's configuration");
        let port: u16 = cfg
            .lines()
            .find_map(|l| l.strip_prefix("port = "))
            .and_then(|p| p.trim().parse().ok())
            .expect("a listener port");
        std::net::SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// Starts `nvmfd` and waits until its admin socket answers.
    pub fn start(opts: Options) -> Daemon {
        let d = Self::spawn(opts);
        wait_for("the admin socket to answer", || {
            d.try_request(r#"{"request":"status"}"#).ok()
        });
        d
    }

    /// Starts `nvmfd` without waiting for anything.
    pub fn spawn(opts: Options) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("nvmfd-e2e")
            .tempdir()
            .expect("tempdir");
        // `@DIR@` in a given configuration names the daemon's directory (its socket's).
        let given = opts
            .config
            .as_ref()
            .map(|c| c.replace("@DIR@", &dir.path().display().to_string()));
        let config = given.unwrap_or_else(|| {
            let mut c = test_config(dir.path(), &opts.extra_daemon);
            for (from, to) in &opts.replace {
                assert!(
                    c.contains(from.as_str()),
                    "`{from}` is not in the test config"
                );
                c = c.replace(from.as_str(), to);
            }
            c
        });
        let config_path = dir.path().join("nvmfd.toml");
        if opts.config_symlink {
            std::fs::write(dir.path().join("v1.toml"), config).expect("write config");
            std::os::unix::fs::symlink("v1.toml", &config_path).expect("config symlink");
        } else {
            std::fs::write(&config_path, config).expect("write config");
        }
        let log_path = dir.path().join("nvmfd.log");
        let log = std::fs::File::create(&log_path).expect("log file");
        let stderr = if opts.stderr_broken {
            let (reader, writer) = std::io::pipe().expect("pipe");
            drop(reader);
            Stdio::from(writer)
        } else {
            Stdio::from(log)
        };
        let mut cmd = Command::new(opts.binary.clone().unwrap_or_else(|| bin("nvmfd")));
        cmd.arg("--config")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        cmd.env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID");
        cmd.env_remove("NVMFD_LOG").env_remove("NVMFD_TEST_HOOKS");
        let notify = opts.notify.then(|| {
            let path = dir.path().join("notify.sock");
            let sock = UnixDatagram::bind(&path).expect("bind notify socket");
            cmd.env("NOTIFY_SOCKET", &path);
            sock
        });
        if let Some(us) = opts.watchdog_usec {
            cmd.env("WATCHDOG_USEC", us.to_string());
        }
        if opts.test_hooks {
            cmd.env("NVMFD_TEST_HOOKS", "1");
        }
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        if let Some(core) = opts.start_on_core {
            start_on_core(&mut cmd, core);
        }
        let child = cmd.spawn().expect("spawn nvmfd");
        Daemon {
            child,
            socket: dir.path().join("admin.sock"),
            dir,
            notify,
            log_path,
            exit: None,
        }
    }

    /// Everything the daemon logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Sends one request line on a new connection and returns the parsed answer.
    pub fn try_request(&self, line: &str) -> std::io::Result<Value> {
        let mut s = UnixStream::connect(&self.socket)?;
        s.set_read_timeout(Some(WAIT))?;
        s.write_all(line.as_bytes())?;
        s.write_all(b"\n")?;
        let mut answer = String::new();
        BufReader::new(s).read_line(&mut answer)?;
        serde_json::from_str(&answer)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    /// Sends one request line and returns the answer; panics if there is none.
    pub fn request(&self, line: &str) -> Value {
        self.try_request(line)
            .unwrap_or_else(|e| panic!("request {line}: {e}\nlog:\n{}", self.log()))
    }

    /// The `data` of a successful request.
    pub fn data(&self, request: &str) -> Value {
        let v = self.request(&format!(r#"{{"request":"{request}"}}"#));
        assert_eq!(v["ok"], true, "{request}: {v}");
        v["data"].clone()
    }

    /// Asserts that the `i`th namespace of `status` is served with a warning holding every
    /// one of `words`, also in the log; returns the status.
    pub fn assert_served_with_warning(&self, i: usize, words: &[&str]) -> Value {
        let status = self.data("status");
        let ns = &status["namespaces"][i];
        assert_eq!(ns["serving"], true, "{status}");
        let warning = ns["warning"].as_str().unwrap_or_default();
        assert!(words.iter().all(|w| warning.contains(w)), "{status}");
        let log = self.log();
        assert!(log.contains("namespace served with a warning"), "{log}");
        status
    }

    /// Sends a signal to the daemon.
    pub fn signal(&self, sig: i32) {
        let pid = i32::try_from(self.child.id()).expect("pid");
        // SAFETY: kill(2) with a valid signal number has no memory-safety preconditions.
        let rc = unsafe { libc::kill(pid, sig) };
        assert_eq!(rc, 0, "kill({pid}, {sig}) failed");
    }

    /// Waits for the daemon to exit and returns its status.
    pub fn wait_exit(&mut self) -> ExitStatus {
        if let Some(s) = self.exit {
            return s;
        }
        let s = wait_for("nvmfd to exit", || self.child.try_wait().expect("try_wait"));
        self.exit = Some(s);
        s
    }

    /// Receives notification datagrams until one has a line starting with `needle`; returns
    /// all received.
    pub fn notifications_until(&self, needle: &str) -> Vec<String> {
        self.notifications_until_match(needle, |l| l.starts_with(needle))
    }

    /// Receives notification datagrams until one contains `needle`; returns all received.
    pub fn notifications_until_contains(&self, needle: &str) -> Vec<String> {
        self.notifications_until_match(needle, |l| l.contains(needle))
    }

    fn notifications_until_match(
        &self,
        needle: &str,
        matches: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        let sock = self.notify.as_ref().expect("started with notify");
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .expect("timeout");
        let mut got = Vec::new();
        let deadline = Instant::now() + WAIT;
        let mut buf = vec![0u8; 4096];
        loop {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {needle}; got {got:?}"
            );
            if let Ok(n) = sock.recv(&mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                let done = msg.lines().any(&matches);
                got.push(msg);
                if done {
                    return got;
                }
            }
        }
    }

    /// Receives notification datagrams for `d`, returning all of them.
    pub fn notifications_for(&self, d: Duration) -> Vec<String> {
        let sock = self.notify.as_ref().expect("started with notify");
        sock.set_read_timeout(Some(Duration::from_millis(20)))
            .expect("timeout");
        let mut got = Vec::new();
        let end = Instant::now() + d;
        let mut buf = vec![0u8; 4096];
        while Instant::now() < end {
            if let Ok(n) = sock.recv(&mut buf) {
                got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
        got
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.exit.is_none() && matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Says that the running test is skipped, and why: on standard error, and in
/// `target/tmp/skipped-tests.txt`, which the test command lists at its end.
pub fn skip(why: &str) {
    use std::io::Write;
    let test = std::thread::current().name().unwrap_or("a test").to_owned();
    let line = format!("SKIPPED {test}: {why}\n");
    eprint!("{line}");
    // target/<profile>/deps/<test> -> target/tmp
    let Some(tmp) = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.parent()?.join("tmp")))
    else {
        return;
    };
    let _ = std::fs::create_dir_all(&tmp);
    let path = tmp.join("skipped-tests.txt");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        // One write per line: tests run in parallel and append to the same file.
        let _ = f.write_all(line.as_bytes());
    }
}

/// The test Ceph cluster of `scripts/ceph-dev-cluster.sh`.
pub mod ceph {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// Runs `scripts/ceph-dev-cluster.sh ARGS`: its standard output, or why it failed.
    pub fn run(args: &[&str]) -> Result<String, String> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/ceph-dev-cluster.sh");
        // A restarted OSD is refilled while the tests' daemons use the cluster, on two cores:
        // give it three times the script's default before calling it failed.
        let out = Command::new(script)
            .args(args)
            .env("NVMFD_CEPH_TIMEOUT", "180")
            .output()
            .map_err(|e| format!("cannot run scripts/ceph-dev-cluster.sh: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "ceph-dev-cluster.sh {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Held by a test that stops the monitor or kills OSDs: starts them all again when it is
    /// dropped, whatever the test's outcome, for the tests after it.
    #[derive(Debug)]
    pub struct Restart;

    impl Drop for Restart {
        fn drop(&mut self) {
            for args in [&["mon-start"][..], &["osd-start", "1"], &["osd-start", "2"]] {
                if let Err(e) = run(args) {
                    eprintln!("restarting the test cluster: {e}");
                }
            }
        }
    }

    /// The ceph.conf of the test cluster, started once per test process, or why there is
    /// none.
    pub fn cluster() -> Result<PathBuf, String> {
        static CONF: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
        CONF.get_or_init(|| {
            let out =
                run(&["start"]).map_err(|e| format!("the test cluster did not start: {e}"))?;
            Ok(PathBuf::from(out.lines().last().unwrap_or("").trim()))
        })
        .clone()
    }

    /// An RBD image name no other test (or run) uses.
    pub fn image_name() -> String {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!(
            "e2e-{}-{nanos}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        )
    }
}

/// Gauge or counter `k` of a `stats` answer, summed over the reactors' data paths.
pub fn dp_sum(s: &Value, k: &str) -> u64 {
    s["datapath"]
        .as_array()
        .expect("stats has datapath")
        .iter()
        .map(|r| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}")))
        .sum()
}
