//! The admin socket: a Unix stream socket (mode 0660), one JSON request per line, one JSON
//! answer per line, served on the control thread's `mio` loop.
//!
//! The socket faces local users, not remote hosts, but a buggy or hostile client must still not
//! hurt the daemon: lines are bounded, answers a client does not read are bounded, idle clients
//! are dropped, and so are clients above the connection limit (after an error answer).

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mio::net::{UnixListener, UnixStream};
use mio::{Interest, Registry, Token};
use serde::{Deserialize, Serialize};
use slog::{debug, warn, Logger};

use crate::stats::AdminStats;
use nvmfd_config::Edit;

/// Longest request line, newline included.
pub const MAX_LINE_BYTES: usize = 4096;
/// Most answer bytes buffered for a client that does not read them: one that sends another
/// request while its earlier answers still wait past this is dropped. (One answer alone may
/// be larger: a client reading it gets it whole.)
pub const MAX_PENDING_OUTPUT_BYTES: usize = 1 << 20;
/// Most clients connected at once; one more gets an error answer and is disconnected.
pub const MAX_CLIENTS: usize = 64;
/// Of [`MAX_CLIENTS`], those kept for clients that may change things (root, the daemon's
/// user): clients that may only look (a monitoring group) cannot take every connection and
/// lock out a reload or a change.
pub const CHANGING_CLIENTS_KEPT: usize = 8;
/// Most requests of one client answered in one turn of the control loop: the rest of what it
/// sent waits for the next turn ([`AdminServer::serve_pending`]), so that a client sending
/// requests as fast as it reads the answers does not hold the control thread.
pub const MAX_REQUESTS_PER_TURN: usize = 32;

/// A request: `{"request": "status"}`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "request", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// What the daemon serves and how it is doing.
    Status {},
    /// Counters: reactors, and the tree the data path extends.
    Stats {},
    /// The configuration in force, with every default filled in.
    Config {},
    /// Live controllers: subsystem, host, queues and their depths, keep-alive, commands.
    Controllers {},
    /// Ends controller `cntlid`, or every controller of `host` (one of the two).
    Disconnect {
        /// Controller ID.
        #[serde(default)]
        cntlid: Option<u16>,
        /// Host NQN.
        #[serde(default)]
        host: Option<String>,
    },
    /// Reads the configuration file again and applies the difference (as SIGHUP does).
    Reload {},
    /// Adds a subsystem (`[[subsystem]]`'s keys, namespaces included).
    AddSubsystem {
        /// The subsystem.
        subsystem: nvmfd_config::Subsystem,
    },
    /// Removes a subsystem: its controllers end.
    RemoveSubsystem {
        /// Its NQN.
        nqn: String,
    },
    /// Adds a namespace (`[[subsystem.namespace]]`'s keys) to subsystem `subsystem`.
    AddNamespace {
        /// The subsystem's NQN.
        subsystem: String,
        /// The namespace.
        namespace: nvmfd_config::Namespace,
    },
    /// Removes namespace `nsid` of `subsystem`; its I/O in flight completes.
    RemoveNamespace {
        /// The subsystem's NQN.
        subsystem: String,
        /// NSID.
        nsid: u32,
    },
    /// Resizes namespace `nsid` of `subsystem` to `size`, or, without one, to what its
    /// backend reports now.
    ResizeNamespace {
        /// The subsystem's NQN.
        subsystem: String,
        /// NSID.
        nsid: u32,
        /// The new size.
        #[serde(default)]
        size: Option<nvmfd_config::ByteSize>,
    },
    /// Allows host `host` on `subsystem`.
    AddHost {
        /// The subsystem's NQN.
        subsystem: String,
        /// The host's NQN.
        host: String,
    },
    /// Takes host `host` off `subsystem`'s hosts: its controllers there end.
    RemoveHost {
        /// The subsystem's NQN.
        subsystem: String,
        /// The host's NQN.
        host: String,
    },
    /// Sets `allow_any_host` of `subsystem`.
    AllowAnyHost {
        /// The subsystem's NQN.
        subsystem: String,
        /// Any host may connect.
        allow: bool,
    },
    /// Adds a listener (`[[listener]]`'s keys).
    AddListener {
        /// The listener.
        listener: nvmfd_config::Listener,
    },
    /// Removes the listener at `address` and `port`: its connections end.
    RemoveListener {
        /// Its address.
        address: std::net::IpAddr,
        /// Its port.
        #[serde(default = "default_port")]
        port: u16,
        /// Its provider: needed only when two listeners (one per provider) share the
        /// address and port.
        #[serde(default)]
        provider: Option<nvmfd_config::Provider>,
    },
    /// Test hook (only with `NVMFD_TEST_HOOKS=1`): block reactor `reactor` for `ms`; `ms = 0`
    /// ends a stall in progress.
    DebugStallReactor {
        /// Reactor index.
        reactor: usize,
        /// How long, in milliseconds.
        ms: u64,
    },
    /// Test hook (only with `NVMFD_TEST_HOOKS=1`): the next change that resizes namespace
    /// `nsid` of `subsystem` fails when it makes that resize (after every check passed), as
    /// a store that fails just then would; with `at_cut`, the next shrink of it fails when
    /// it cuts the backend, after the fence (`Device::fail_next_cut`: an RBD image is left
    /// as librbd's failed resize leaves it).
    DebugFailResize {
        /// The subsystem's NQN.
        subsystem: String,
        /// The namespace.
        nsid: u32,
        /// Fail at the backend's cut instead.
        #[serde(default)]
        at_cut: bool,
    },
    /// Test hook (only with `NVMFD_TEST_HOOKS=1`): the next sync of that namespace's file or
    /// block device (a host's Flush) fails with EIO, as a writeback error does
    /// (`Device::fail_next_sync`).
    DebugFailSync {
        /// The subsystem's NQN.
        subsystem: String,
        /// The namespace.
        nsid: u32,
    },
    /// Test hook (only with `NVMFD_TEST_HOOKS=1`): starts an operation off the control
    /// thread that lasts `ms` milliseconds, and does not wait for it, as the control thread
    /// does not wait past its deadline for RBD handles opened ahead.
    DebugOffThread {
        /// How long the operation lasts.
        ms: u64,
    },
    /// Test hook (only with `NVMFD_TEST_HOOKS=1`): injects `fault` on listener `listener`'s
    /// device; soft provider only.
    DebugFault {
        /// What to do.
        fault: Fault,
        /// Listener index, in configuration order.
        listener: usize,
    },
}

/// Whether a directory's entries are the daemon's to make and remove alone: owned by root or
/// the daemon's user, and writable by nobody else (or sticky, as /tmp: others cannot remove
/// or rename what they do not own).
fn directory_is_safe(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let owner_ok = meta.uid() == 0 || meta.uid() == me;
    let others_write = meta.mode() & 0o022 != 0;
    let sticky = meta.mode() & 0o1000 != 0;
    owner_ok && (!others_write || sticky)
}

/// Whether a peer of the admin socket with user ID `uid` may change things: root, or the
/// user the daemon runs as.
pub(crate) fn may_change(uid: Option<u32>) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    uid.is_some_and(|u| u == 0 || u == unsafe { libc::geteuid() })
}

/// The user ID of the process at the other end of `stream` (SO_PEERCRED).
fn peer_uid(stream: &UnixStream) -> Option<u32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::ucred>()).ok()?;
    // SAFETY: `cred` and `len` are live locals of the sizes given; the kernel writes at most
    // `len` bytes into `cred`.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::addr_of_mut!(cred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred.uid)
}

fn default_port() -> u16 {
    4420
}

impl Request {
    /// A change of the configuration: its edits of the file, and a namespace to resize beyond
    /// what the file says (`None` for any other request).
    #[allow(clippy::type_complexity)]
    pub fn edits(&self) -> Option<(Vec<Edit>, Option<(String, u32, Option<u64>)>)> {
        let one = |e: Edit| Some((vec![e], None));
        match self {
            Request::AddSubsystem { subsystem } => one(Edit::AddSubsystem(subsystem.clone())),
            Request::RemoveSubsystem { nqn } => one(Edit::RemoveSubsystem(nqn.clone())),
            Request::AddNamespace {
                subsystem,
                namespace,
            } => one(Edit::AddNamespace(subsystem.clone(), namespace.clone())),
            Request::RemoveNamespace { subsystem, nsid } => {
                one(Edit::RemoveNamespace(subsystem.clone(), *nsid))
            }
            // The size goes into the file where the backend has one there (RAM, null, an RBD
            // image nvmfd creates); the device is resized either way.
            Request::ResizeNamespace {
                subsystem,
                nsid,
                size,
            } => Some((
                size.map(|s| Edit::SetNamespaceSize(subsystem.clone(), *nsid, s))
                    .into_iter()
                    .collect(),
                Some((subsystem.clone(), *nsid, size.map(|s| s.0))),
            )),
            Request::AddHost { subsystem, host } => {
                one(Edit::AddHost(subsystem.clone(), host.clone()))
            }
            Request::RemoveHost { subsystem, host } => {
                one(Edit::RemoveHost(subsystem.clone(), host.clone()))
            }
            Request::AllowAnyHost { subsystem, allow } => {
                one(Edit::AllowAnyHost(subsystem.clone(), *allow))
            }
            Request::AddListener { listener } => one(Edit::AddListener(listener.clone())),
            Request::RemoveListener {
                address,
                port,
                provider,
            } => one(Edit::RemoveListener(*address, *port, *provider)),
            _ => None,
        }
    }
}

/// A fault `debug_fault` injects.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// The device goes, as in a hot-unplug: `DEVICE_FATAL`, its QPs fail, its CM IDs see
    /// `DEVICE_REMOVAL`, nothing can be created or listened on it.
    RemoveDevice,
    /// The device comes back (`PORT_ACTIVE`).
    RestoreDevice,
    /// The device's address moves to another port, as a bond's failover moves it: its CM
    /// IDs (connections and listening IDs) see `ADDR_CHANGE`; the device stays.
    AddrChange,
    /// Seeded random faults on the listener's fabric from now on, replacing those in force
    /// (all rates 0: none). The answer, as for every fault, counts those injected so far.
    Seeded(SeededFaults),
    /// Nothing changes: the answer counts the seeded faults injected so far.
    Count,
    /// The next N memory registrations anywhere on the soft fabric fail (`ENOMEM`, as at
    /// the locked-memory limit); 0 ends it.
    FailRegistrations(u32),
}

/// Seeded random faults of the soft provider, as chances per million of a send work request
/// (see `nvmfd_rdma::soft::Faults`): the same seed and the same operations give the same
/// faults.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct SeededFaults {
    /// Seed of the fault stream.
    pub seed: u64,
    /// Lost beyond retries: the QP goes to ERR.
    pub drop_per_million: u32,
    /// Held up on the wire until the fabric's next operation.
    pub delay_per_million: u32,
    /// The QP fails fatally (`QP_FATAL`).
    pub qp_fatal_per_million: u32,
    /// The SRQ of the QP a SEND is for fails (`SRQ_ERR`).
    pub srq_error_per_million: u32,
    /// A `post_send` chain is refused part-way.
    pub post_failure_per_million: u32,
}

/// An answer: `{"ok": true, "data": ...}` or `{"ok": false, "error": "..."}`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Response {
    /// Whether the request succeeded.
    pub ok: bool,
    /// The answer, when it succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
    /// What went wrong, when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Response {
    /// A successful answer.
    pub fn data(data: serde_json::Value) -> Self {
        Self {
            ok: true,
            data: Some(data),
            error: None,
        }
    }
    /// An error answer.
    pub fn error(msg: impl Into<String>) -> Self {
        Self {
            ok: false,
            data: None,
            error: Some(msg.into()),
        }
    }
    fn line(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self)
            .unwrap_or_else(|_| br#"{"ok":false,"error":"unserializable answer"}"#.to_vec());
        v.push(b'\n');
        v
    }
}

/// Why the admin socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// another process answers on the socket
    #[error("{0}: another nvmfd is already serving this admin socket")]
    InUse(PathBuf),
    /// something other than a socket is at the path
    #[error("{0}: exists and is not a socket (left as it is; name another admin_socket)")]
    NotASocket(PathBuf),
    /// the socket's directory is not the daemon's alone
    #[error(
        "{0}: its directory is owned by another user or writable by others (without the sticky bit): \
         they could replace the socket or watch what is sent to it; name a directory of root's"
    )]
    UnsafeDirectory(PathBuf),
    /// creating, binding or setting up the socket failed
    #[error("{path}: {what}: {source}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The step that failed.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

struct Client {
    stream: UnixStream,
    /// The peer's user ID (SO_PEERCRED), logged with every change it makes.
    uid: Option<u32>,
    input: Vec<u8>,
    output: Vec<u8>,
    /// When it connected or sent its last request (the idle timeout counts from there).
    last_active: Instant,
    /// Close once `output` is flushed.
    closing: bool,
    /// Its turn ended with requests left (received or still in the socket): it is served
    /// again at the next turn, without a new readiness event.
    more: bool,
    /// It sent a request while its unread answers were past `MAX_PENDING_OUTPUT_BYTES`: it
    /// is dropped.
    overflowed: bool,
}

/// The admin socket server.
pub struct AdminServer {
    path: PathBuf,
    listener: UnixListener,
    listener_token: Token,
    clients: HashMap<Token, Client>,
    next_token: usize,
    first_client_token: usize,
    idle_timeout: Duration,
    stats: AdminStats,
    log: Logger,
}

impl std::fmt::Debug for AdminServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminServer")
            .field("path", &self.path)
            .field("clients", &self.clients.len())
            .finish()
    }
}

impl AdminServer {
    /// Binds the socket at `path` (mode 0660), creating its directory (0750) when missing and
    /// replacing a stale socket file, and registers it with `registry` under `listener_token`.
    /// Client tokens are allocated from `first_client_token` upwards.
    pub fn bind(
        path: &Path,
        registry: &Registry,
        listener_token: Token,
        first_client_token: usize,
        idle_timeout: Duration,
        log: Logger,
    ) -> Result<Self, AdminError> {
        let io = |what: &'static str| {
            let path = path.to_owned();
            move |source| AdminError::Io { path, what, source }
        };
        if let Some(dir) = path.parent() {
            if !dir.exists() {
                std::fs::create_dir_all(dir).map_err(io("cannot create its directory"))?;
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750))
                    .map_err(io("cannot set its directory's mode"))?;
            }
            // Nobody else may replace what is in it (between the bind and the chmod, say).
            let meta = std::fs::metadata(dir).map_err(io("cannot read its directory"))?;
            if !directory_is_safe(&meta) {
                return Err(AdminError::UnsafeDirectory(path.to_owned()));
            }
        }
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            // Only a socket is replaced (one nobody answers on: a stale one): any other file
            // at the path is the operator's, named by mistake, and stays.
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(AdminError::NotASocket(path.to_owned()));
            }
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(AdminError::InUse(path.to_owned()));
            }
            std::fs::remove_file(path).map_err(io("cannot remove the stale socket"))?;
        }
        let mut listener = UnixListener::bind(path).map_err(io("cannot bind"))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
            .map_err(io("cannot set mode 0660"))?;
        registry
            .register(&mut listener, listener_token, Interest::READABLE)
            .map_err(io("cannot register with the poller"))?;
        Ok(Self {
            path: path.to_owned(),
            listener,
            listener_token,
            clients: HashMap::new(),
            next_token: first_client_token,
            first_client_token,
            idle_timeout,
            stats: AdminStats::default(),
            log,
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `token` belongs to this server.
    pub fn owns(&self, token: Token) -> bool {
        token == self.listener_token || token.0 >= self.first_client_token
    }

    /// Counters.
    pub fn stats(&self) -> AdminStats {
        AdminStats {
            clients: self.clients.len() as u64,
            ..self.stats.clone()
        }
    }

    /// Handles a readiness event for `token`, answering complete request lines with `handle`.
    pub fn on_event(
        &mut self,
        registry: &Registry,
        token: Token,
        handle: &mut dyn FnMut(Request, Option<u32>, &AdminStats) -> Response,
    ) {
        if token == self.listener_token {
            self.accept(registry);
            return;
        }
        self.serve_client(registry, token, handle);
    }

    /// Whether a client's turn ended with requests left ([`MAX_REQUESTS_PER_TURN`]): the
    /// control loop then polls without waiting and calls [`AdminServer::serve_pending`].
    pub fn has_pending(&self) -> bool {
        self.clients.values().any(|c| c.more)
    }

    /// Gives each client with requests left its next turn.
    pub fn serve_pending(
        &mut self,
        registry: &Registry,
        handle: &mut dyn FnMut(Request, Option<u32>, &AdminStats) -> Response,
    ) {
        let due: Vec<Token> = self
            .clients
            .iter()
            .filter(|(_, c)| c.more)
            .map(|(t, _)| *t)
            .collect();
        for token in due {
            self.serve_client(registry, token, handle);
        }
    }

    fn serve_client(
        &mut self,
        registry: &Registry,
        token: Token,
        handle: &mut dyn FnMut(Request, Option<u32>, &AdminStats) -> Response,
    ) {
        let Some(mut client) = self.clients.remove(&token) else {
            return;
        };
        let keep = self.serve(&mut client, handle);
        if keep {
            self.clients.insert(token, client);
        } else {
            let _ = registry.deregister(&mut client.stream);
        }
    }

    /// Drops clients that have sent nothing for the idle timeout.
    pub fn sweep(&mut self, registry: &Registry, now: Instant) {
        let timeout = self.idle_timeout;
        let idle: Vec<Token> = self
            .clients
            .iter()
            .filter(|(_, c)| now.duration_since(c.last_active) > timeout)
            .map(|(t, _)| *t)
            .collect();
        for t in idle {
            if let Some(mut c) = self.clients.remove(&t) {
                debug!(self.log, "admin client idle: disconnected"; "timeout" => ?timeout);
                self.stats.dropped_total += 1;
                let _ = registry.deregister(&mut c.stream);
            }
        }
    }

    fn accept(&mut self, registry: &Registry) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, _)) => {
                    self.stats.connections_total += 1;
                    let uid = peer_uid(&stream);
                    let lookers = self.clients.values().filter(|c| !may_change(c.uid)).count();
                    let refused = if self.clients.len() >= MAX_CLIENTS {
                        Some(format!(
                            "too many admin clients (limit {MAX_CLIENTS}); try again"
                        ))
                    } else if !may_change(uid) && lookers >= MAX_CLIENTS - CHANGING_CLIENTS_KEPT {
                        Some(format!(
                            "too many admin clients that may only look (limit {}; the rest are kept for root); try again",
                            MAX_CLIENTS - CHANGING_CLIENTS_KEPT
                        ))
                    } else {
                        None
                    };
                    if let Some(why) = refused {
                        let _ = stream.write(&Response::error(why.clone()).line());
                        // Dropped; no request of it was read (not one answered in error).
                        self.stats.dropped_total += 1;
                        warn!(self.log, "admin client refused"; "why" => why, "uid" => uid);
                        continue;
                    }
                    let token = Token(self.next_token);
                    self.next_token += 1;
                    if let Err(e) = registry.register(
                        &mut stream,
                        token,
                        Interest::READABLE | Interest::WRITABLE,
                    ) {
                        warn!(self.log, "cannot register admin client"; "error" => %e);
                        continue;
                    }
                    self.clients.insert(
                        token,
                        Client {
                            uid,
                            stream,
                            input: Vec::with_capacity(256),
                            output: Vec::new(),
                            last_active: Instant::now(),
                            closing: false,
                            more: false,
                            overflowed: false,
                        },
                    );
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    warn!(self.log, "admin accept failed"; "error" => %e);
                    return;
                }
            }
        }
    }

    /// Reads, answers and flushes; false when the client is to be dropped.
    fn serve(
        &mut self,
        c: &mut Client,
        handle: &mut dyn FnMut(Request, Option<u32>, &AdminStats) -> Response,
    ) -> bool {
        let mut buf = [0u8; 4096];
        let mut eof = false;
        let mut budget = MAX_REQUESTS_PER_TURN;
        // What was left from its last turn first.
        self.answer_lines(c, handle, &mut budget);
        c.more = budget == 0;
        while !c.closing && !c.more {
            match c.stream.read(&mut buf) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    c.input.extend_from_slice(&buf[..n]);
                    self.answer_lines(c, handle, &mut budget);
                    c.more = budget == 0;
                    // Write answers as they are made; a client that asked for more while its
                    // unread answers were past the bound is dropped now, before it can make
                    // the daemon read (and buffer) any more of its requests.
                    if !self.flush(c) {
                        return false;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return false,
            }
        }
        if !self.flush(c) {
            return false;
        }
        if eof {
            // The client closed its side: answer what it sent, then drop it.
            c.closing = true;
        }
        !(c.closing && c.output.is_empty())
    }

    /// Answers the complete lines received, `budget` of them at most (counted down).
    fn answer_lines(
        &mut self,
        c: &mut Client,
        handle: &mut dyn FnMut(Request, Option<u32>, &AdminStats) -> Response,
        budget: &mut usize,
    ) {
        while let Some(nl) = c.input.iter().position(|&b| b == b'\n') {
            if nl + 1 > MAX_LINE_BYTES || *budget == 0 {
                break;
            }
            if c.output.len() > MAX_PENDING_OUTPUT_BYTES {
                // Another request while its earlier answers wait unread past the bound.
                c.overflowed = true;
                return;
            }
            let line: Vec<u8> = c.input.drain(..=nl).collect();
            let text = String::from_utf8_lossy(&line[..nl]);
            let text = text.trim();
            // A blank line counts against the turn's budget too: a client sending nothing
            // but newlines must not hold the control thread either.
            *budget -= 1;
            if text.is_empty() {
                continue;
            }
            // Only a request counts as activity: bytes trickling in (a line that never ends,
            // blank lines) do not keep a client from the idle timeout.
            c.last_active = Instant::now();
            let answer = match serde_json::from_str::<Request>(text) {
                Ok(req) => {
                    // The client asking is out of the map while it is served: it counts too.
                    let mut stats = self.stats();
                    stats.clients += 1;
                    handle(req, c.uid, &stats)
                }
                Err(e) => Response::error(format!(
                    "bad request: {e}; send one JSON object per line, e.g. {{\"request\":\"status\"}}"
                )),
            };
            self.stats.requests_total += 1;
            if !answer.ok {
                self.stats.errors_total += 1;
            }
            c.output.extend_from_slice(&answer.line());
        }
        let pending_line = c
            .input
            .iter()
            .position(|&b| b == b'\n')
            .unwrap_or(c.input.len());
        if pending_line + 1 > MAX_LINE_BYTES {
            warn!(self.log, "admin client sent an oversized line: disconnected"; "limit" => MAX_LINE_BYTES);
            self.stats.requests_total += 1;
            self.stats.errors_total += 1;
            self.stats.dropped_total += 1;
            c.output.extend_from_slice(
                &Response::error(format!("request line longer than {MAX_LINE_BYTES} bytes")).line(),
            );
            c.input.clear();
            c.closing = true;
        }
    }

    /// Writes what the client will take; false when it must be dropped.
    fn flush(&mut self, c: &mut Client) -> bool {
        while !c.output.is_empty() {
            match c.stream.write(&c.output) {
                Ok(0) => return false,
                Ok(n) => {
                    c.output.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return false,
            }
        }
        if c.overflowed {
            warn!(self.log, "admin client does not read its answers: disconnected";
                  "pending_bytes" => c.output.len());
            self.stats.dropped_total += 1;
            return false;
        }
        true
    }

    /// Closes every client and removes the socket file.
    pub fn shutdown(mut self, registry: &Registry) {
        for (_, mut c) in self.clients.drain() {
            let _ = registry.deregister(&mut c.stream);
        }
        let _ = registry.deregister(&mut self.listener);
        let _ = std::fs::remove_file(&self.path);
    }
}
