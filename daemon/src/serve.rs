//! From the configuration to what is served: namespaces opened on their block devices, the
//! NVMe target, and the listeners.

use std::sync::Arc;

use nvmfd_blockdev::{BlockError, Device as BlockDevice, DeviceInfo, DeviceSpec, Kind, RbdSpec};
use nvmfd_config::{Backend, Config};
use nvmfd_nvme::{BlockFailure, Limits, Namespace, NamespaceInfo, Port, Subsystem, Target};
use serde::{Deserialize, Serialize};

/// A namespace's device, by subsystem ID ([`Subsystem::id`]) and NSID.
pub type NamespaceDevices = Vec<(u64, u32, Arc<BlockDevice>)>;

/// The target's limits, from `[transport]`.
pub fn limits(cfg: &Config) -> Limits {
    let t = &cfg.transport;
    Limits {
        max_queue_depth: u16::try_from(t.max_queue_depth).unwrap_or(1024),
        max_io_queues: u16::try_from(t.max_io_queues).unwrap_or(1024),
        max_nsid: t.max_nsid,
        in_capsule_data_size: u32::try_from(t.in_capsule_data_size.0).unwrap_or(16384),
        max_io_size: u32::try_from(t.max_io_size.0).unwrap_or(1 << 23),
        kato_min: t.keep_alive_timeout_min.0,
        kato_max: t.keep_alive_timeout_max.0,
    }
}

/// What the NVMe core is told of a namespace's device.
pub fn namespace_info(d: &DeviceInfo) -> NamespaceInfo {
    NamespaceInfo {
        size: d.size,
        logical_block_size: d.logical_block_size,
        physical_block_size: d.physical_block_size,
        read_only: d.read_only,
        write_zeroes: d.write_zeroes,
        deallocate: d.deallocate,
        deallocate_max_blocks: d.deallocate_max_blocks,
        volatile_cache: d.volatile_cache,
    }
}

/// What the NVMe core is told of a failed block operation (its command's status follows).
pub fn block_failure(e: &BlockError) -> BlockFailure {
    match e {
        BlockError::Misaligned { .. } => BlockFailure::Misaligned,
        BlockError::OutOfRange { .. } => BlockFailure::OutOfRange,
        BlockError::ReadOnly => BlockFailure::ReadOnly,
        BlockError::Unsupported(_) => BlockFailure::Unsupported,
        BlockError::NoSpace => BlockFailure::NoSpace,
        BlockError::QueueFull => BlockFailure::QueueFull,
        BlockError::UnknownDevice => BlockFailure::UnknownDevice,
        BlockError::Io(errno) if unavailable(*errno) => BlockFailure::Unavailable,
        BlockError::ShortTransfer { .. } | BlockError::Io(_) => BlockFailure::Io,
    }
}

/// Errors of a store that cannot be reached for now (an RBD image whose OSDs or monitors do
/// not answer in `rados_osd_op_timeout`), or of an operation a device turned away for now (a
/// block device under io_uring answering EAGAIN, an interrupted call), which a later retry
/// may get past: the host is told to retry (Namespace Not Ready, with the retry delay of a
/// host that enabled it), not that its data is lost. Not ESHUTDOWN: librados's
/// "blocklisted", which lasts as long as the client's connection does, so a host told to
/// retry would retry for ever; it is an I/O error.
fn unavailable(errno: i32) -> bool {
    [
        libc::ETIMEDOUT,
        libc::ENOTCONN,
        libc::ECONNREFUSED,
        libc::EHOSTUNREACH,
        libc::EAGAIN,
        libc::EINTR,
        // io_uring's worker pool could not take the operation (no worker thread could be
        // made, RLIMIT_NPROC or memory): nothing was done, a retry may pass.
        libc::ECANCELED,
        libc::ENOMEM,
    ]
    .contains(&errno)
}

fn nguid(hex: &str) -> Option<[u8; 16]> {
    let h: String = hex.chars().filter(|c| *c != '-').collect();
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(h.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(out)
}

/// One namespace in `status`: served, or why not.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NamespaceStatus {
    /// Its subsystem's NQN.
    pub subsystem: String,
    /// NSID.
    pub nsid: u32,
    /// `file`, `bdev`, `rbd`, `malloc` or `null`.
    pub backend: String,
    /// Capacity in bytes (0 when not served).
    pub size: u64,
    /// Whether hosts see it.
    pub serving: bool,
    /// Why not, when it is not served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What to know of how it is served (buffered I/O where O_DIRECT was asked for, an RBD
    /// image's exclusive-lock), also logged as a warning when it opens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
    /// The backend's own size where it can change behind nvmfd (an RBD image): below `size`,
    /// the image was shrunk elsewhere and I/O past its end fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_size: Option<u64>,
    /// A sync of its device failed (writeback lost data hosts were told was written): every
    /// Flush of it fails until it is opened again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sync_failed: bool,
}

/// What [`build_target`] built.
#[derive(Debug)]
pub struct Built {
    /// The NVMe target, with the namespaces that opened.
    pub target: Target,
    /// Their devices.
    pub devices: NamespaceDevices,
    /// Every configured namespace, served or not, in configuration order.
    pub status: Vec<NamespaceStatus>,
}

/// The device spec of a configured namespace.
pub fn device_spec(ns: &nvmfd_config::Namespace) -> DeviceSpec {
    let kind = match ns.backend {
        Backend::File => Kind::File,
        Backend::Bdev => Kind::Bdev,
        Backend::Rbd => Kind::Rbd,
        Backend::Malloc => Kind::Malloc,
        Backend::Null => Kind::Null,
    };
    let mut spec = DeviceSpec::new(kind);
    spec.path = ns.path.clone();
    spec.size = ns.size.map_or(0, |b| b.0);
    spec.block_size = u32::try_from(ns.block_size.0).unwrap_or(512);
    spec.read_only = ns.read_only;
    // A RAM namespace's memory stays on normal pages with `transport.huge_pages`: opened
    // before the data paths, it would take the huge pages reserved for their buffers, which
    // RDMA and io_uring register (a namespace's memory is only copied to and from them).
    if ns.backend == Backend::Rbd {
        spec.rbd = Some(RbdSpec {
            pool: ns.pool.clone().unwrap_or_default(),
            image: ns.image.clone().unwrap_or_default(),
            namespace: ns.namespace.clone(),
            ceph_conf: ns.ceph_conf(),
            client_id: ns.client_id(),
            create: ns.create,
        });
    }
    spec
}

/// Opens every namespace's device, each on its own thread, by subsystem. For an RBD image, a
/// handle is opened ahead for each data path the reactors may build at start (one per reactor
/// and listener's device at most): a reactor never opens one itself.
fn open_all(cfg: &Config) -> Vec<Vec<std::io::Result<Arc<BlockDevice>>>> {
    let engines = cfg.daemon.reactor_cores.len() * cfg.listeners.len().max(1);
    let specs: Vec<Vec<DeviceSpec>> = cfg
        .subsystems
        .iter()
        .map(|s| s.namespaces.iter().map(device_spec).collect())
        .collect();
    std::thread::scope(|scope| {
        let handles: Vec<Vec<_>> = specs
            .iter()
            .map(|sub| {
                sub.iter()
                    .map(|spec| {
                        scope.spawn(move || {
                            let dev = BlockDevice::open(spec)?;
                            // One after the other on this image's thread (not a thread
                            // each). Not all need open: a data path that finds none waits
                            // for one opened off its reactor.
                            for _ in 0..engines {
                                if dev.open_spare_handle().is_err() {
                                    break;
                                }
                            }
                            Ok(dev)
                        })
                    })
                    .collect()
            })
            .collect();
        handles
            .into_iter()
            .map(|sub| {
                sub.into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(std::io::Error::other("opening the device panicked"))
                        })
                    })
                    .collect()
            })
            .collect()
    })
}

/// The error for two namespaces whose paths name one file or block device.
pub fn one_store(a: (&String, u32), b: (&String, u32)) -> String {
    format!(
        "subsystem {} namespace {} and subsystem {} namespace {} are one file, block device or \
         RBD image (by other paths: a link, another name of the device, another Ceph \
         configuration file or user of the cluster): they would overwrite each other's data",
        a.0, a.1, b.0, b.1
    )
}

/// Opens every namespace's device, each on its own thread (an unreachable Ceph cluster takes
/// its mount timeout once, not once per namespace), and builds the target. A file, block
/// device or RAM namespace that does not open is an error naming it; an RBD namespace that
/// does not open (cluster unreachable, image missing) is left out, with the reason in the
/// returned status, so the others are served.
pub fn build_target(cfg: &Config) -> Result<Built, String> {
    let opened = open_all(cfg);
    let mut devices = Vec::new();
    let mut subsystems = Vec::new();
    let mut status = Vec::new();
    for ((si, s), opened) in cfg.subsystems.iter().enumerate().zip(opened) {
        let mut namespaces = Vec::new();
        for ((ni, ns), dev) in s.namespaces.iter().enumerate().zip(opened) {
            let backend = format!("{:?}", ns.backend).to_ascii_lowercase();
            let dev = match dev {
                Ok(dev) => dev,
                Err(e) if ns.backend == Backend::Rbd => {
                    status.push(NamespaceStatus {
                        subsystem: s.nqn.clone(),
                        nsid: ns.nsid,
                        backend,
                        size: 0,
                        serving: false,
                        reason: Some(e.to_string()),
                        warning: None,
                        backend_size: None,
                        sync_failed: false,
                    });
                    continue;
                }
                Err(e) => {
                    return Err(format!(
                        "subsystem[{si}].namespace[{ni}] (nsid {}): {e}",
                        ns.nsid
                    ))
                }
            };
            namespaces.push(namespace(&s.nqn, ns, &dev));
            status.push(NamespaceStatus {
                subsystem: s.nqn.clone(),
                nsid: ns.nsid,
                backend,
                size: dev.size(),
                serving: true,
                reason: None,
                warning: dev.warning().map(str::to_owned),
                backend_size: None,
                sync_failed: false,
            });
            devices.push((s.nqn.clone(), ns.nsid, dev));
        }
        subsystems.push(subsystem(s, namespaces));
    }
    let mut stores = std::collections::HashMap::new();
    for (nqn, nsid, dev) in &devices {
        if let Some(other) = dev
            .identity()
            .and_then(|id| stores.insert(id, (nqn, *nsid)))
        {
            return Err(one_store(other, (nqn, *nsid)));
        }
    }
    let ports = cfg
        .listeners
        .iter()
        .enumerate()
        .map(|(i, l)| port(l, i))
        .collect();
    let target = Target::new(subsystems, ports, limits(cfg));
    let devices = devices
        .into_iter()
        .filter_map(|(nqn, nsid, dev)| Some((target.subsystem(&nqn)?.id, nsid, dev)))
        .collect();
    Ok(Built {
        target,
        devices,
        status,
    })
}

/// What the NVMe core is told of namespace `ns` of subsystem `nqn`, whose device is `dev`.
pub fn namespace(nqn: &str, ns: &nvmfd_config::Namespace, dev: &BlockDevice) -> Namespace {
    let nguid = ns.nguid.as_deref().and_then(nguid);
    let uuid = match (ns.uuid, nguid) {
        (Some(u), _) => Some(*u.as_bytes()),
        (None, Some(_)) => None,
        (None, None) => Some(derived_uuid(nqn, ns, dev)),
    };
    Namespace {
        nsid: ns.nsid,
        info: namespace_info(&dev.current_info()),
        uuid,
        nguid,
    }
}

/// The UUID reported for a namespace configured with neither `uuid` nor `nguid`. A host
/// needs an identifier to tell one namespace from another behind the same NSID: Linux
/// compares them at every rescan and lets go of a namespace whose identifiers changed, and
/// with none, another file or image put behind the NSID looks the same. Version 5 (a SHA-1
/// name), from the subsystem's NQN, the NSID and what stores the data: a file's or block
/// device's path, an RBD image's pool, RADOS namespace and name. So it stays across restarts
/// and is the same on every gateway of one image. A RAM or null namespace's data lasts as
/// long as its device: its UUID comes from the number the device drew when it was opened.
pub fn derived_uuid(nqn: &str, ns: &nvmfd_config::Namespace, dev: &BlockDevice) -> [u8; 16] {
    /// The UUID namespace of these names: the version 5 UUID of
    /// `https://nvmfd/namespace-uuid` in the URL namespace.
    const NVMFD: uuid::Uuid = uuid::uuid!("26555d9a-711d-508c-a527-7c73d333a7e9");
    let store = match ns.backend {
        Backend::File | Backend::Bdev => format!(
            "{:?}\0{}",
            ns.backend,
            ns.path
                .as_deref()
                .unwrap_or(std::path::Path::new(""))
                .display()
        ),
        Backend::Rbd => format!(
            "rbd\0{}\0{}\0{}",
            ns.pool.as_deref().unwrap_or(""),
            ns.namespace.as_deref().unwrap_or(""),
            ns.image.as_deref().unwrap_or("")
        ),
        Backend::Malloc | Backend::Null => format!("{:?}\0{:016x}", ns.backend, dev.instance()),
    };
    let name = format!("{nqn}\0{}\0{store}", ns.nsid);
    *uuid::Uuid::new_v5(&NVMFD, name.as_bytes()).as_bytes()
}

/// What the NVMe core is told of a configured subsystem, with `namespaces` (those served).
pub fn subsystem(s: &nvmfd_config::Subsystem, namespaces: Vec<Namespace>) -> Subsystem {
    Subsystem {
        id: 0,
        nqn: s.nqn.clone(),
        serial: s.serial_number(),
        model: s.model.clone(),
        allow_any_host: s.allow_any_host,
        hosts: s.hosts.clone(),
        namespaces,
        cntlids: (s.cntlid_min, s.cntlid_max),
    }
}

/// The discovery log's port for listener `l`, with PORTID `id`.
pub fn port(l: &nvmfd_config::Listener, id: usize) -> Port {
    Port {
        addr: l.address,
        port: l.port,
        id: u16::try_from(id).unwrap_or(u16::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_block_error_reaches_the_core_as_its_failure() {
        let cases = [
            (
                BlockError::Misaligned {
                    offset: 1,
                    len: 1,
                    block_size: 512,
                },
                BlockFailure::Misaligned,
            ),
            (
                BlockError::OutOfRange {
                    offset: 0,
                    len: 1,
                    size: 0,
                },
                BlockFailure::OutOfRange,
            ),
            (BlockError::ReadOnly, BlockFailure::ReadOnly),
            (BlockError::Unsupported("x"), BlockFailure::Unsupported),
            (BlockError::QueueFull, BlockFailure::QueueFull),
            (BlockError::UnknownDevice, BlockFailure::UnknownDevice),
            (BlockError::NoSpace, BlockFailure::NoSpace),
            (
                BlockError::ShortTransfer {
                    expected: 4096,
                    done: 512,
                },
                BlockFailure::Io,
            ),
            (BlockError::Io(5), BlockFailure::Io),
            (BlockError::Io(libc::ETIMEDOUT), BlockFailure::Unavailable),
            (BlockError::Io(libc::ENOTCONN), BlockFailure::Unavailable),
            // Turned away for now by the device: retried, not a lost write.
            (BlockError::Io(libc::EAGAIN), BlockFailure::Unavailable),
            (BlockError::Io(libc::EINTR), BlockFailure::Unavailable),
            // Not taken by io_uring's workers for want of a thread or memory.
            (BlockError::Io(libc::ECANCELED), BlockFailure::Unavailable),
            (BlockError::Io(libc::ENOMEM), BlockFailure::Unavailable),
            // Blocklisted by the cluster: retrying cannot help.
            (BlockError::Io(libc::ESHUTDOWN), BlockFailure::Io),
        ];
        for (e, want) in cases {
            assert_eq!(block_failure(&e), want, "{e:?}");
        }
    }

    /// `transport.huge_pages` leaves namespaces' memory on normal pages: the reserved huge
    /// pages are for the data buffers, registered for RDMA, and a RAM namespace opened first
    /// would take them.
    #[test]
    fn huge_pages_are_for_the_data_buffers_alone() {
        let ns: nvmfd_config::Namespace =
            toml::from_str("nsid = 1\nbackend = \"malloc\"\nsize = \"1MiB\"\n").unwrap();
        assert!(!device_spec(&ns).huge_pages);
    }

    #[test]
    fn the_core_sees_the_devices_size_blocks_and_capabilities() {
        let mut spec = DeviceSpec::new(Kind::Malloc);
        spec.size = 1 << 20;
        spec.block_size = 4096;
        let d = BlockDevice::open(&spec).unwrap();
        let i = namespace_info(d.info());
        assert_eq!(i.blocks(), d.info().blocks());
        assert_eq!(i.logical_block_size, 4096);
        assert_eq!(
            (i.read_only, i.write_zeroes, i.deallocate, i.volatile_cache),
            (
                d.info().read_only,
                d.info().write_zeroes,
                d.info().deallocate,
                d.info().volatile_cache
            )
        );
        assert_eq!(i.deallocate_max_blocks, d.info().deallocate_max_blocks);
    }
}
