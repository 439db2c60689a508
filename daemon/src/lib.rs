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

/// The cores a reactor can be pinned to, ascending: those the system takes a thread's
/// affinity to (online, in the process's cpuset), asked for on a thread of its own (every
/// core at once: the kernel keeps those it allows; the thread is never moved onto each).
/// Not the process's affinity mask: cores isolated from the scheduler (`isolcpus`, the
/// usual home of poll-mode reactors) are outside PID 1's mask and so every service's, yet a
/// thread may be pinned there.
fn pinnable_cores() -> Vec<usize> {
    let probe = std::thread::Builder::new()
        .name("nvmfd-cores".into())
        .spawn(|| {
            // SAFETY: plain data.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            for cpu in 0..libc::CPU_SETSIZE as usize {
                // SAFETY: `cpu` is within the set's size.
                unsafe { libc::CPU_SET(cpu, &mut set) };
            }
            let size = std::mem::size_of::<libc::cpu_set_t>();
            // SAFETY: this thread's affinity (0); `set` is a valid set of `size` bytes.
            if unsafe { libc::sched_setaffinity(0, size, &set) } != 0 {
                return Vec::new();
            }
            // SAFETY: as above; the kernel writes the set it kept.
            if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
                return Vec::new();
            }
            (0..libc::CPU_SETSIZE as usize)
                // SAFETY: `cpu` is within the set's size.
                .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
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
