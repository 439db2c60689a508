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
    let mut allowed_cores: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect();
    allowed_cores.sort_unstable();
    nvmfd_config::SystemFacts { allowed_cores }
}
