//! What a change of the configuration leaves for the next restart, and what it adds that
//! deserves a warning.

use super::*;

impl Daemon {
    /// Keeps in `new` what changes only with a restart (the `[daemon]` and `[transport]`
    /// sections, a kept subsystem's serial number and model); returns what was kept (for the
    /// reply and the log) and the warnings `new` gives that the configuration in force did not.
    pub(super) fn held_for_restart(&self, new: &mut Config) -> (Vec<String>, Vec<String>) {
        // `[daemon]` and `[transport]` change only with a restart: edits there stay in the
        // file for it, and the rest of the change applies (refusing the whole reload left
        // every later change refused as "edited since it was loaded").
        let mut at_restart = Vec::new();
        if new.daemon != self.cfg.daemon {
            at_restart.push("[daemon]".to_owned());
            new.daemon = self.cfg.daemon.clone();
        }
        if new.transport != self.cfg.transport {
            at_restart.push("[transport]".to_owned());
            new.transport = self.cfg.transport.clone();
        }
        // A subsystem's serial number and model are its identity to hosts, read once per
        // controller (a host's paths to it must agree): a kept subsystem keeps them until the
        // next restart, as the kernel target refuses to change them once a host has seen
        // them. (A subsystem removed and added again takes the new ones.)
        for s in &mut new.subsystems {
            let Some(old) = self.cfg.subsystems.iter().find(|o| o.nqn == s.nqn) else {
                continue;
            };
            if s.serial_number() != old.serial_number() || s.model != old.model {
                at_restart.push(format!("the serial number and model of {}", s.nqn));
                s.serial.clone_from(&old.serial);
                s.model.clone_from(&old.model);
            }
        }
        // NQNs outside the specification's form are accepted with a warning, as at start:
        // those not warned of before, by what they say (their key's index moves when a
        // subsystem is added or removed before them).
        let said = |w: &String| w.split_once(": ").map_or(w.clone(), |(_, m)| m.to_owned());
        let warned: std::collections::HashSet<String> =
            self.cfg.warnings().iter().map(said).collect();
        let warnings: Vec<String> = new
            .warnings()
            .into_iter()
            .filter(|w| !warned.contains(&said(w)))
            .collect();
        (at_restart, warnings)
    }
}
