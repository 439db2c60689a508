//! What a change does: the difference between the configuration in force and a new one.

use nvmfd_config::{Listener, Namespace as CfgNamespace, Subsystem as CfgSubsystem};

use super::change::Resize;
use super::*;

/// What a change does, worked out from the configurations before and after.
#[derive(Debug, Default)]
pub(super) struct Plan {
    pub(super) listeners_added: Vec<Listener>,
    pub(super) listeners_removed: Vec<usize>,
    pub(super) subsystems_added: Vec<CfgSubsystem>,
    pub(super) subsystems_removed: Vec<String>,
    /// Subsystems in both, as they are after.
    pub(super) subsystems_kept: Vec<CfgSubsystem>,
    /// Namespaces to open: (subsystem NQN, namespace).
    pub(super) namespaces_added: Vec<(String, CfgNamespace)>,
    pub(super) namespaces_removed: Vec<(String, u32)>,
    pub(super) resizes: Vec<Resize>,
}

pub(super) fn same_listener(a: &Listener, b: &Listener) -> bool {
    a.address == b.address && a.port == b.port && a.provider == b.provider
}

impl Daemon {
    /// The difference between the configuration in force and `new`.
    pub(super) fn plan(&self, new: &Config, resizes: Vec<Resize>) -> Result<Plan, String> {
        let old = &self.cfg;
        let mut p = Plan {
            resizes,
            ..Plan::default()
        };
        for (i, l) in self.listener_slots.iter().enumerate() {
            if let Some(l) = l {
                if !new.listeners.iter().any(|n| same_listener(n, l)) {
                    p.listeners_removed.push(i);
                }
            }
        }
        for l in &new.listeners {
            if !self
                .listener_slots
                .iter()
                .flatten()
                .any(|o| same_listener(o, l))
            {
                p.listeners_added.push(l.clone());
            }
        }
        for s in &old.subsystems {
            if !new.subsystems.iter().any(|n| n.nqn == s.nqn) {
                p.subsystems_removed.push(s.nqn.clone());
            }
        }
        for s in &new.subsystems {
            let Some(o) = old.subsystems.iter().find(|o| o.nqn == s.nqn) else {
                p.subsystems_added.push(s.clone());
                for ns in &s.namespaces {
                    p.namespaces_added.push((s.nqn.clone(), ns.clone()));
                }
                continue;
            };
            for ons in &o.namespaces {
                match s.namespaces.iter().find(|n| n.nsid == ons.nsid) {
                    None => p.namespaces_removed.push((s.nqn.clone(), ons.nsid)),
                    Some(n) if n == ons => {}
                    // Not served (it could not open, and is tried again): nothing to change
                    // but the configuration, whose new keys the next tries take (its size,
                    // a pool or path put right).
                    Some(_) if !self.devices.contains_key(&(s.nqn.clone(), ons.nsid)) => {}
                    Some(n)
                        if (CfgNamespace {
                            size: ons.size,
                            ..n.clone()
                        }) == *ons =>
                    {
                        let size = n.size.map(|b| b.0);
                        if !p.resizes.iter().any(|r| (&r.0, r.1) == (&s.nqn, n.nsid)) {
                            p.resizes.push((s.nqn.clone(), n.nsid, size));
                        }
                    }
                    Some(_) => {
                        return Err(format!(
                        "namespace {} of {} changed more than its size: remove it and add it again",
                        ons.nsid, s.nqn
                    ))
                    }
                }
            }
            for n in &s.namespaces {
                if !o.namespaces.iter().any(|x| x.nsid == n.nsid) {
                    p.namespaces_added.push((s.nqn.clone(), n.clone()));
                }
            }
            p.subsystems_kept.push(s.clone());
        }
        for (nqn, nsid, _) in &p.resizes {
            if !self.devices.contains_key(&(nqn.clone(), *nsid)) {
                return Err(format!("subsystem {nqn} serves no namespace {nsid}"));
            }
        }
        Ok(p)
    }
}
