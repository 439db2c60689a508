//! nvmfd, an NVMe over Fabrics target: the daemon's control plane (control thread, reactors,
//! admin socket, systemd integration, logging) shared by the `nvmfd` and `nvmfctl` binaries.

pub mod admin;
pub mod control;
pub mod ctl;
pub mod datapath;
pub mod inproc;
pub mod logging;
pub mod notify;
pub mod paths;
pub mod reactor;
pub mod serve;
pub mod srq;
pub mod stats;

/// Facts about this machine that configuration validation needs.
pub fn system_facts() -> nvmfd_config::SystemFacts {
    nvmfd_config::SystemFacts {
        allowed_cores: pinnable_cores(),
    }
}

/// The cores a reactor can be pinned to, ascending: each one the system takes a thread's
/// affinity to (online, in the process's cpuset), tried on a thread of its own. Not the
/// process's affinity mask: cores isolated from the scheduler (`isolcpus`, the usual home of
/// poll-mode reactors) are outside PID 1's mask and so every service's, yet a thread may be
/// pinned there.
fn pinnable_cores() -> Vec<usize> {
    // SAFETY: sysconf reads a system value.
    let configured = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    let n = usize::try_from(configured).unwrap_or(0).clamp(1, 1 << 16);
    let probe = std::thread::Builder::new()
        .name("nvmfd-cores".into())
        .spawn(move || {
            (0..n)
                .filter(|&id| core_affinity::set_for_current(core_affinity::CoreId { id }))
                .collect::<Vec<usize>>()
        });
    let mut cores = probe
        .ok()
        .and_then(|t| t.join().ok())
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| {
            core_affinity::get_core_ids()
                .unwrap_or_default()
                .into_iter()
                .map(|c| c.id)
                .collect()
        });
    cores.sort_unstable();
    cores
}
