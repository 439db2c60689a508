//! Checks beyond parsing: everything that types alone cannot say.

use std::collections::HashMap;

use crate::error::KeyPath;
use crate::schema::{Backend, Config, Namespace, Subsystem};
use crate::units::ByteSize;

/// Facts about the machine that validation needs; tests supply their own.
#[derive(Clone, Debug)]
pub struct SystemFacts {
    /// Cores a thread of this process may be pinned to (online and in its cpuset, which
    /// may be more than its affinity mask: `isolcpus` cores), ascending.
    pub allowed_cores: Vec<usize>,
}

/// The discovery subsystem's well-known NQN; no configured subsystem may take it.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// Longest NQN, in bytes (NVMe Base Specification, NVMe Qualified Names).
pub const NQN_MAX_BYTES: usize = 223;
/// Largest in-capsule data size accepted: four 4 KiB receive SGEs per command.
pub const IN_CAPSULE_MAX: ByteSize = ByteSize::kib(16);
/// Largest I/O size accepted (MDTS).
pub const MAX_IO_SIZE_MAX: ByteSize = ByteSize::mib(8);
/// Smallest I/O size accepted: one memory page (CAP.MPSMIN).
/// Smallest `max_io_size`: MDTS counts powers of two of 4 KiB pages and 0 means "no limit",
/// so 8 KiB (MDTS 1) is the least a controller can advertise.
pub const MAX_IO_SIZE_MIN: ByteSize = ByteSize::kib(8);
/// Queue depth bounds. The least is 32: hosts open their admin queue with 32 entries (Linux's
/// `NVME_AQ_DEPTH`, the discovery log's ASQSZ), and a smaller limit would refuse every
/// connection.
pub const QUEUE_DEPTH_RANGE: std::ops::RangeInclusive<u32> = 32..=1024;
/// Namespaces served in all, over every subsystem: each is a device every reactor's engine
/// serves (a registered file table of this many).
pub const MAX_NAMESPACES: u32 = 1024;
/// I/O queue count bounds.
pub const IO_QUEUES_RANGE: std::ops::RangeInclusive<u32> = 1..=1024;
/// Largest SRQ size accepted (hardware commonly allows 2^15 to 2^20 work requests).
pub const SRQ_MAX_LIMIT: u32 = 1 << 20;

/// A problem found by validation: the key it concerns and what is wrong.
#[derive(Debug)]
pub(crate) struct Problem {
    pub path: KeyPath,
    pub message: String,
}

struct Checker<'a> {
    facts: &'a SystemFacts,
    problems: Vec<Problem>,
}

impl Checker<'_> {
    fn fail(&mut self, path: KeyPath, message: impl Into<String>) {
        self.problems.push(Problem {
            path,
            message: message.into(),
        });
    }
}

/// Checks what an NVMe Qualified Name must be for nvmfd to use it: not empty, at most
/// [`NQN_MAX_BYTES`] bytes, no spaces or control characters. Its form is [`nqn_form`]'s
/// concern: one outside the specification's is only warned about.
pub fn check_nqn(nqn: &str) -> Result<(), String> {
    if nqn.is_empty() {
        return Err("an NQN may not be empty".into());
    }
    if nqn.len() > NQN_MAX_BYTES {
        return Err(format!(
            "an NQN is at most {NQN_MAX_BYTES} bytes; this one has {}",
            nqn.len()
        ));
    }
    if nqn.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err("an NQN may not contain spaces or control characters".into());
    }
    Ok(())
}

/// Checks an NVMe Qualified Name's form and says how it departs from it.
///
/// Two forms are valid (NVMe Base Specification, "NVMe Qualified Names"):
/// `nqn.yyyy-mm.<reverse domain>[:<string>]` and `nqn.2014-08.org.nvmexpress:uuid:<uuid>`.
/// The Linux kernel's host and target take any other name too (blktests names its subsystems
/// `blktests-subsystem-N`), and so does nvmfd, with a warning ([`crate::Config::warnings`]).
pub fn nqn_form(nqn: &str) -> Result<(), String> {
    let shape = "expected nqn.yyyy-mm.reverse.domain[:name], e.g. nqn.2024-01.com.example:disk0";
    let Some(rest) = nqn.strip_prefix("nqn.") else {
        return Err(format!("`{nqn}` does not start with `nqn.`; {shape}"));
    };
    let date = rest.get(..7).unwrap_or("");
    let db = date.as_bytes();
    let date_ok = db.len() == 7
        && db[..4].iter().all(u8::is_ascii_digit)
        && db[4] == b'-'
        && db[5..].iter().all(u8::is_ascii_digit)
        && matches!(
            &date[5..],
            "01" | "02" | "03" | "04" | "05" | "06" | "07" | "08" | "09" | "10" | "11" | "12"
        );
    if !date_ok {
        return Err(format!(
            "`{nqn}` has no valid yyyy-mm date after `nqn.`; {shape}"
        ));
    }
    let Some(rest) = rest[7..].strip_prefix('.') else {
        return Err(format!(
            "`{nqn}` has no `.` and domain after its date; {shape}"
        ));
    };
    let (domain, name) = match rest.split_once(':') {
        Some((d, n)) => (d, Some(n)),
        None => (rest, None),
    };
    let domain_ok = !domain.is_empty()
        && !domain.starts_with(['.', '-'])
        && !domain.ends_with(['.', '-'])
        && !domain.contains("..")
        && domain
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-');
    if !domain_ok {
        return Err(format!(
            "`{nqn}`: the reverse domain name `{domain}` may hold only letters, digits, `-` and `.`; {shape}"
        ));
    }
    if name == Some("") {
        return Err(format!("`{nqn}` ends with `:` but has no name after it"));
    }
    if domain == "org.nvmexpress" {
        if let Some(n) = name {
            if let Some(u) = n.strip_prefix("uuid:") {
                // The specification's form is the hyphenated one (8-4-4-4-12 hex digits);
                // the parser takes others too (32 digits, braces, `urn:uuid:`).
                let hyphenated = uuid::Uuid::try_parse(u)
                    .is_ok_and(|x| x.hyphenated().to_string().eq_ignore_ascii_case(u));
                if !hyphenated {
                    return Err(format!(
                        "`{nqn}`: `{u}` is not a UUID in its hyphenated form (8-4-4-4-12 hex digits)"
                    ));
                }
            }
        }
    }
    Ok(())
}

fn printable_ascii(s: &str) -> bool {
    s.bytes().all(|b| (0x20..=0x7e).contains(&b))
}

/// What is accepted in `cfg` but worth a warning: NQNs outside the specification's form.
pub(crate) fn warnings(cfg: &Config) -> Vec<Problem> {
    let mut out = Vec::new();
    let accepted = "accepted, as the Linux kernel's host and target accept it, but a host that \
                    checks the form may refuse it";
    for (i, s) in cfg.subsystems.iter().enumerate() {
        let p = KeyPath::default().key("subsystem").index(i);
        if check_nqn(&s.nqn).is_ok() {
            if let Err(e) = nqn_form(&s.nqn) {
                out.push(Problem {
                    path: p.key("nqn"),
                    message: format!("{e}; {accepted}"),
                });
            }
        }
        for (k, h) in s.hosts.iter().enumerate() {
            if check_nqn(h).is_ok() {
                if let Err(e) = nqn_form(h) {
                    out.push(Problem {
                        path: p.key("hosts").index(k),
                        message: format!("{e}; {accepted}"),
                    });
                }
            }
        }
    }
    // The Linux host asks for a 5 s keep-alive timeout by default, and one above the
    // maximum is refused at Connect.
    let linux_default = std::time::Duration::from_secs(5);
    if cfg.transport.keep_alive_timeout_max.0 < linux_default {
        out.push(Problem {
            path: KeyPath::default()
                .key("transport")
                .key("keep_alive_timeout_max"),
            message: format!(
                "{} is below the Linux host's default keep-alive timeout (5s): its connections are refused unless it asks for less (nvme connect --keep-alive-tmo)",
                cfg.transport.keep_alive_timeout_max
            ),
        });
    }
    out
}

pub(crate) fn validate(cfg: &Config, facts: &SystemFacts) -> Vec<Problem> {
    let mut c = Checker {
        facts,
        problems: Vec::new(),
    };
    daemon(&mut c, cfg);
    listeners(&mut c, cfg);
    transport(&mut c, cfg);
    subsystems(&mut c, cfg);
    c.problems
}

fn daemon(c: &mut Checker<'_>, cfg: &Config) {
    let p = KeyPath::default().key("daemon");
    let d = &cfg.daemon;
    if d.reactor_cores.is_empty() {
        c.fail(
            p.key("reactor_cores"),
            "at least one reactor core is needed",
        );
    }
    let mut seen = HashMap::new();
    for (i, core) in d.reactor_cores.iter().enumerate() {
        if let Some(first) = seen.insert(*core, i) {
            c.fail(
                p.key("reactor_cores").index(i),
                format!(
                    "core {core} is listed twice (also at index {first}): one reactor per core"
                ),
            );
        } else if !c.facts.allowed_cores.contains(core) {
            let allowed = c
                .facts
                .allowed_cores
                .iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ");
            c.fail(
                p.key("reactor_cores").index(i),
                format!("core {core} does not exist, is offline or is outside this process's cpuset (cores a reactor can be pinned to: {allowed})"),
            );
        }
    }
    if !d.admin_socket.is_absolute() {
        c.fail(
            p.key("admin_socket"),
            format!("`{}` is not an absolute path", d.admin_socket.display()),
        );
    } else if d.admin_socket.as_os_str().len() >= 108 {
        c.fail(
            p.key("admin_socket"),
            "a Unix socket path must be shorter than 108 bytes",
        );
    }
    if d.stall_timeout.0.is_zero() {
        c.fail(p.key("stall_timeout"), "must be longer than zero");
    }
    if d.admin_client_timeout.0.is_zero() {
        c.fail(p.key("admin_client_timeout"), "must be longer than zero");
    }
}

fn listeners(c: &mut Checker<'_>, cfg: &Config) {
    if cfg.listeners.is_empty() {
        c.fail(
            KeyPath::default(),
            "no [[listener]]: add at least one, e.g. [[listener]] address = \"127.0.0.1\" provider = \"soft\"",
        );
    }
    let mut seen = HashMap::new();
    for (i, l) in cfg.listeners.iter().enumerate() {
        let p = KeyPath::default().key("listener").index(i);
        if l.port == 0 {
            c.fail(p.key("port"), "port 0 is not a port to listen on");
        }
        // A listening CM ID on a wildcard address is bound to no RDMA device (nvmfd builds a
        // listener's data path on its device), and hosts would be told to connect there.
        if l.address.is_unspecified() {
            c.fail(
                p.key("address"),
                format!(
                    "{} listens on no interface in particular: give the address of the interface of the RDMA device to serve on",
                    l.address
                ),
            );
        }
        // An IPv4-mapped IPv6 address is the IPv4 address.
        if let Some(first) = seen.insert((l.address.to_canonical(), l.port, l.provider), i) {
            c.fail(
                p,
                format!(
                    "duplicate listener {}:{} ({}): the same as listener[{first}]",
                    l.address, l.port, l.provider
                ),
            );
        }
    }
}

fn transport(c: &mut Checker<'_>, cfg: &Config) {
    let p = KeyPath::default().key("transport");
    let t = &cfg.transport;
    if !QUEUE_DEPTH_RANGE.contains(&t.max_queue_depth) {
        c.fail(
            p.key("max_queue_depth"),
            format!("{} is outside {QUEUE_DEPTH_RANGE:?}", t.max_queue_depth),
        );
    }
    if !IO_QUEUES_RANGE.contains(&t.max_io_queues) {
        c.fail(
            p.key("max_io_queues"),
            format!("{} is outside {IO_QUEUES_RANGE:?}", t.max_io_queues),
        );
    }
    if t.max_nsid == 0 || t.max_nsid == u32::MAX {
        c.fail(
            p.key("max_nsid"),
            format!("{} is outside 1..=4294967294", t.max_nsid),
        );
    }
    let io = t.max_io_size;
    if !io.0.is_power_of_two() || io < MAX_IO_SIZE_MIN || io > MAX_IO_SIZE_MAX {
        c.fail(
            p.key("max_io_size"),
            format!("{io} is not a power of two from {MAX_IO_SIZE_MIN} to {MAX_IO_SIZE_MAX}"),
        );
    }
    let icd = t.in_capsule_data_size;
    if !icd.0.is_multiple_of(16) {
        c.fail(
            p.key("in_capsule_data_size"),
            format!("{icd} is not a multiple of 16 bytes (IOCCSZ counts 16-byte units)"),
        );
    } else if icd > IN_CAPSULE_MAX {
        c.fail(
            p.key("in_capsule_data_size"),
            format!("{icd} is above the limit of {IN_CAPSULE_MAX}"),
        );
    } else if icd > io {
        c.fail(
            p.key("in_capsule_data_size"),
            format!("{icd} is larger than max_io_size ({io})"),
        );
    }
    if t.srq_max == 0 || t.srq_max > SRQ_MAX_LIMIT {
        c.fail(
            p.key("srq_max"),
            format!("{} is outside 1..={SRQ_MAX_LIMIT}", t.srq_max),
        );
    }
    if t.srq_initial == 0 {
        c.fail(p.key("srq_initial"), "at least one receive must be posted");
    } else if t.srq_initial > t.srq_max {
        c.fail(
            p.key("srq_initial"),
            format!("{} is above srq_max ({})", t.srq_initial, t.srq_max),
        );
    }
    if t.srq_initial > 0 && t.srq_low_watermark >= t.srq_initial {
        c.fail(
            p.key("srq_low_watermark"),
            format!(
                "{} must be below srq_initial ({}), or the limit event fires at once",
                t.srq_low_watermark, t.srq_initial
            ),
        );
    }
    // Receives for every queue's commands (`srq_cover_queues`) need room for one whole queue.
    if t.srq_cover_queues && t.srq_max > 0 && t.srq_max < t.max_queue_depth {
        c.fail(
            p.key("srq_max"),
            format!(
                "{} is below max_queue_depth ({}): with srq_cover_queues one queue's commands could find the SRQ empty",
                t.srq_max, t.max_queue_depth
            ),
        );
    }
    if t.srq_grow_chunk == 0 || t.srq_grow_chunk > t.srq_max {
        c.fail(
            p.key("srq_grow_chunk"),
            format!(
                "{} is outside 1..=srq_max ({})",
                t.srq_grow_chunk, t.srq_max
            ),
        );
    }
    let d = t.srq_shrink_delay.0;
    if d < std::time::Duration::from_millis(10) || d > std::time::Duration::from_secs(3600) {
        c.fail(
            p.key("srq_shrink_delay"),
            format!("{} is outside 10ms..=1h", t.srq_shrink_delay),
        );
    }
    let d = t.connect_timeout.0;
    if d < std::time::Duration::from_millis(10) || d > std::time::Duration::from_secs(3600) {
        c.fail(
            p.key("connect_timeout"),
            format!("{} is outside 10ms..=1h", t.connect_timeout),
        );
    }
    if t.keep_alive_timeout_min.0.is_zero() {
        c.fail(p.key("keep_alive_timeout_min"), "must be longer than zero");
    }
    if t.keep_alive_timeout_min > t.keep_alive_timeout_max {
        c.fail(
            p.key("keep_alive_timeout_max"),
            format!(
                "{} is shorter than keep_alive_timeout_min ({})",
                t.keep_alive_timeout_max, t.keep_alive_timeout_min
            ),
        );
    }
}

fn subsystems(c: &mut Checker<'_>, cfg: &Config) {
    let mut nqns = HashMap::new();
    let mut uuids = HashMap::new();
    let mut nguids = HashMap::new();
    let mut paths = HashMap::new();
    let mut images = HashMap::new();
    let mut identities = HashMap::new();
    let mut total: u32 = 0;
    for (i, s) in cfg.subsystems.iter().enumerate() {
        let p = KeyPath::default().key("subsystem").index(i);
        let own_nqn = !nqns.contains_key(&s.nqn);
        if let Err(e) = check_nqn(&s.nqn) {
            c.fail(p.key("nqn"), e);
        } else if s.nqn == DISCOVERY_NQN {
            c.fail(
                p.key("nqn"),
                "this is the discovery subsystem's NQN, which nvmfd serves itself",
            );
        } else if let Some(first) = nqns.insert(s.nqn.clone(), i) {
            c.fail(
                p.key("nqn"),
                format!("`{}` is already subsystem[{first}]'s NQN", s.nqn),
            );
        }
        subsystem_strings(c, &p, s);
        // A host names a subsystem's disks by model and serial number (Linux's
        // /dev/disk/by-id/nvme-MODEL_SERIAL): two subsystems alike would share the names.
        // (Not for an NQN given twice, whose default serial numbers are alike too.)
        let identity = (s.model.clone(), s.serial_number());
        if let Some(first) = identities.insert(identity, i).filter(|_| own_nqn) {
            c.fail(
                p.key("serial"),
                format!("subsystem[{first}] has the same serial number and model: hosts name disks by them (/dev/disk/by-id), so two subsystems alike share those names"),
            );
        }
        hosts(c, &p, s);
        let mut nsids = HashMap::new();
        for (j, ns) in s.namespaces.iter().enumerate() {
            let np = p.key("namespace").index(j);
            total += 1;
            if total == MAX_NAMESPACES + 1 {
                c.fail(
                    np.clone(),
                    format!("one namespace too many: nvmfd serves at most {MAX_NAMESPACES} in all subsystems"),
                );
            }
            if ns.nsid == 0 || ns.nsid == u32::MAX {
                c.fail(
                    np.key("nsid"),
                    format!("{} is not a valid namespace ID (1 to 4294967294)", ns.nsid),
                );
            } else if ns.nsid > cfg.transport.max_nsid {
                c.fail(
                    np.key("nsid"),
                    format!(
                        "{} is above transport.max_nsid ({}), the largest NSID hosts are told of",
                        ns.nsid, cfg.transport.max_nsid
                    ),
                );
            } else if let Some(first) = nsids.insert(ns.nsid, j) {
                c.fail(
                    np.key("nsid"),
                    format!(
                        "nsid {} is already namespace[{first}] of this subsystem",
                        ns.nsid
                    ),
                );
            }
            namespace(c, &np, ns);
            if let Some(u) = ns.uuid {
                if u.is_nil() {
                    c.fail(np.key("uuid"), "the nil UUID is not an identifier");
                } else if let Some(first) = uuids.insert(u, np.clone()) {
                    c.fail(np.key("uuid"), format!("UUID {u} is already {first}'s"));
                }
            }
            if let Some(g) = &ns.nguid {
                let hex: String = g.chars().filter(|&ch| ch != '-').collect();
                if hex.len() != 32 || !hex.chars().all(|ch| ch.is_ascii_hexdigit()) {
                    c.fail(np.key("nguid"), format!("`{g}` is not 32 hex digits"));
                } else if hex.chars().all(|ch| ch == '0') {
                    c.fail(np.key("nguid"), "an all-zero NGUID is not an identifier");
                } else if let Some(first) = nguids.insert(hex.to_ascii_lowercase(), np.clone()) {
                    c.fail(np.key("nguid"), format!("NGUID `{g}` is already {first}'s"));
                }
            }
            if let (true, Some(path)) = (ns.backend.has_path(), &ns.path) {
                if let Some(first) = paths.insert(path.clone(), np.clone()) {
                    c.fail(
                        np.key("path"),
                        format!("`{}` already backs {first}: two namespaces on one file corrupt each other", path.display()),
                    );
                }
            }
            if let (Backend::Rbd, Some(pool), Some(image)) = (ns.backend, &ns.pool, &ns.image) {
                let key = (
                    ns.ceph_conf(),
                    pool.clone(),
                    ns.namespace.clone(),
                    image.clone(),
                );
                if let Some(first) = images.insert(key, np.clone()) {
                    c.fail(
                        np.key("image"),
                        format!("image `{image}` of pool `{pool}` already backs {first}: two namespaces on one image corrupt each other"),
                    );
                }
            }
        }
    }
}

fn subsystem_strings(c: &mut Checker<'_>, p: &KeyPath, s: &Subsystem) {
    if let Some(serial) = &s.serial {
        if serial.is_empty() || serial.len() > 20 || !printable_ascii(serial) {
            c.fail(
                p.key("serial"),
                "a serial number is 1 to 20 printable ASCII characters",
            );
        }
    }
    if s.model.is_empty() || s.model.len() > 40 || !printable_ascii(&s.model) {
        c.fail(
            p.key("model"),
            "a model number is 1 to 40 printable ASCII characters",
        );
    }
    if s.cntlid_min == 0 || s.cntlid_min > 0xFFEF {
        c.fail(p.key("cntlid_min"), "a controller ID is 1 to 65519 (FFEFh)");
    } else if s.cntlid_max > 0xFFEF {
        c.fail(p.key("cntlid_max"), "a controller ID is 1 to 65519 (FFEFh)");
    } else if s.cntlid_max < s.cntlid_min {
        c.fail(
            p.key("cntlid_max"),
            format!(
                "below cntlid_min ({}): the range holds no controller ID",
                s.cntlid_min
            ),
        );
    }
}

fn hosts(c: &mut Checker<'_>, p: &KeyPath, s: &Subsystem) {
    if s.allow_any_host && !s.hosts.is_empty() {
        c.fail(
            p.key("hosts"),
            "allow_any_host = true admits every host: remove `hosts` or set allow_any_host = false",
        );
    } else if !s.allow_any_host && s.hosts.is_empty() {
        c.fail(
            p.clone(),
            "no host may connect: list host NQNs in `hosts` or set allow_any_host = true",
        );
    }
    let mut seen = HashMap::new();
    for (k, h) in s.hosts.iter().enumerate() {
        if let Err(e) = check_nqn(h) {
            c.fail(p.key("hosts").index(k), e);
        } else if let Some(first) = seen.insert(h.as_str(), k) {
            c.fail(
                p.key("hosts").index(k),
                format!("host `{h}` is listed twice (also at index {first})"),
            );
        }
    }
}

fn namespace(c: &mut Checker<'_>, np: &KeyPath, ns: &Namespace) {
    let b = format!("{:?}", ns.backend).to_ascii_lowercase();
    if ns.backend.has_path() {
        match &ns.path {
            None => c.fail(np.clone(), format!("backend `{b}` needs a `path`")),
            Some(path) if !path.is_absolute() => c.fail(
                np.key("path"),
                format!("`{}` is not an absolute path", path.display()),
            ),
            Some(_) => {}
        }
        if ns.size.is_some() {
            c.fail(
                np.key("size"),
                format!("backend `{b}` takes its size from the file or device: remove `size`"),
            );
        }
    } else if ns.path.is_some() {
        let why = if ns.backend == Backend::Rbd {
            "names its image with `pool` and `image`"
        } else {
            "has no `path`; it needs a `size`"
        };
        c.fail(np.key("path"), format!("backend `{b}` {why}"));
    }
    if ns.backend == Backend::Rbd {
        rbd(c, np, ns);
    } else {
        not_rbd(c, np, ns, &b);
    }
    if !ns.backend.has_path() {
        size(c, np, ns, &b);
    }
    if ns.block_size != ByteSize(512) && ns.block_size != ByteSize(4096) {
        c.fail(
            np.key("block_size"),
            format!("{} is not 512 or 4096 bytes", ns.block_size.0),
        );
    } else if ns.backend == Backend::Bdev && ns.block_size != ByteSize(512) {
        c.fail(
            np.key("block_size"),
            "a block device reports its own logical block size: remove `block_size`",
        );
    }
}

/// `size` of a backend without a path: required (for `rbd`, with `create` only).
fn size(c: &mut Checker<'_>, np: &KeyPath, ns: &Namespace, b: &str) {
    if ns.backend == Backend::Rbd && !ns.create {
        if ns.size.is_some() {
            c.fail(
                np.key("size"),
                "an existing image has its own size: remove `size`, or set create = true to create the image of this size when it is missing",
            );
        }
        return;
    }
    match ns.size {
        None if ns.backend == Backend::Rbd => c.fail(
            np.clone(),
            "create = true needs the `size` of the image to create, e.g. size = \"10GiB\"",
        ),
        None => c.fail(
            np.clone(),
            format!("backend `{b}` needs a `size`, e.g. size = \"1GiB\""),
        ),
        Some(ByteSize(0)) => c.fail(np.key("size"), "a namespace cannot be empty"),
        Some(size) if size.0 % ns.block_size.0.max(1) != 0 => c.fail(
            np.key("size"),
            format!(
                "{size} is not a whole number of {}-byte blocks",
                ns.block_size.0
            ),
        ),
        Some(_) => {}
    }
}

/// The keys of an `rbd` namespace: which image, in which cluster, as whom.
fn rbd(c: &mut Checker<'_>, np: &KeyPath, ns: &Namespace) {
    let name = |c: &mut Checker<'_>, key: &str, v: &Option<String>, what: &str| match v {
        None => c.fail(np.clone(), format!("backend `rbd` needs `{key}` ({what})")),
        Some(v) => {
            if let Err(e) = rados_name(v, key == "image") {
                c.fail(np.key(key), e);
            }
        }
    };
    name(c, "pool", &ns.pool, "the RADOS pool of the image");
    name(c, "image", &ns.image, "the RBD image's name");
    if let Some(n) = &ns.namespace {
        if let Err(e) = rados_name(n, false) {
            c.fail(np.key("namespace"), e);
        }
    }
    if let Some(conf) = &ns.ceph_conf {
        if !conf.is_absolute() {
            c.fail(
                np.key("ceph_conf"),
                format!("`{}` is not an absolute path", conf.display()),
            );
        }
    }
    if let Some(id) = &ns.client_id {
        if let Some(bare) = id.strip_prefix("client.") {
            c.fail(
                np.key("client_id"),
                format!("the cephx user is named without `client.`: client_id = \"{bare}\""),
            );
        } else if let Err(e) = rados_name(id, false) {
            c.fail(np.key("client_id"), e);
        }
    }
}

/// A pool, RADOS namespace, image or user name: not empty, at most 255 bytes, printable
/// ASCII without spaces; an image's also without `/` and `@` (the rbd tool's separators).
fn rados_name(v: &str, image: bool) -> Result<(), String> {
    if v.is_empty() {
        return Err("an empty name".into());
    }
    if v.len() > 255 {
        return Err(format!("`{v}` is longer than 255 bytes"));
    }
    if !v.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "`{v}` holds a space or a character outside printable ASCII"
        ));
    }
    if image && v.contains(['/', '@']) {
        return Err(format!(
            "`{v}` holds `/` or `@`, which separate pool, image and snapshot"
        ));
    }
    Ok(())
}

/// The `rbd` keys on a namespace of another backend.
fn not_rbd(c: &mut Checker<'_>, np: &KeyPath, ns: &Namespace, b: &str) {
    let keys = [
        ("pool", ns.pool.is_some()),
        ("image", ns.image.is_some()),
        ("namespace", ns.namespace.is_some()),
        ("ceph_conf", ns.ceph_conf.is_some()),
        ("client_id", ns.client_id.is_some()),
        ("create", ns.create),
    ];
    for (key, set) in keys {
        if set {
            c.fail(
                np.key(key),
                format!("`{key}` is for backend `rbd`, not `{b}`"),
            );
        }
    }
}
