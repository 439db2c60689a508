//! From the configuration to what is served: namespaces opened on their block devices, the
//! NVMe target, and the listeners.

use std::sync::Arc;

use nvmfd_blockdev::{BlockError, Device as BlockDevice, DeviceInfo, DeviceSpec, Kind};
use nvmfd_config::{Backend, Config};
use nvmfd_nvme::{BlockFailure, Limits, Namespace, NamespaceInfo, Port, Subsystem, Target};

/// A namespace's device, by subsystem NQN and NSID.
pub type NamespaceDevices = Vec<(String, u32, Arc<BlockDevice>)>;

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
        BlockError::ShortTransfer { .. } | BlockError::Io(_) => BlockFailure::Io,
    }
}

fn nguid(hex: &str) -> Option<[u8; 16]> {
    let h: String = hex.chars().filter(|c| *c != '-').collect();
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(h.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Opens every namespace's device and builds the target. An error names the namespace.
pub fn build_target(cfg: &Config) -> Result<(Target, NamespaceDevices), String> {
    let mut devices = Vec::new();
    let mut subsystems = Vec::new();
    for (si, s) in cfg.subsystems.iter().enumerate() {
        let mut namespaces = Vec::new();
        for (ni, ns) in s.namespaces.iter().enumerate() {
            let kind = match ns.backend {
                Backend::File => Kind::File,
                Backend::Bdev => Kind::Bdev,
                Backend::Malloc => Kind::Malloc,
                Backend::Null => Kind::Null,
            };
            let mut spec = DeviceSpec::new(kind);
            spec.path = ns.path.clone();
            spec.size = ns.size.map_or(0, |b| b.0);
            spec.block_size = u32::try_from(ns.block_size.0).unwrap_or(512);
            spec.read_only = ns.read_only;
            let dev = BlockDevice::open(&spec)
                .map_err(|e| format!("subsystem[{si}].namespace[{ni}] (nsid {}): {e}", ns.nsid))?;
            namespaces.push(Namespace {
                nsid: ns.nsid,
                info: namespace_info(dev.info()),
                uuid: ns.uuid.map(|u| *u.as_bytes()),
                nguid: ns.nguid.as_deref().and_then(nguid),
            });
            devices.push((s.nqn.clone(), ns.nsid, dev));
        }
        subsystems.push(Subsystem {
            nqn: s.nqn.clone(),
            serial: s.serial_number(),
            model: s.model.clone(),
            allow_any_host: s.allow_any_host,
            hosts: s.hosts.clone(),
            namespaces,
        });
    }
    let ports = cfg
        .listeners
        .iter()
        .map(|l| Port {
            addr: l.address,
            port: l.port,
        })
        .collect();
    Ok((Target::new(subsystems, ports, limits(cfg)), devices))
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
        ];
        for (e, want) in cases {
            assert_eq!(block_failure(&e), want, "{e:?}");
        }
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
