//! What the admin socket's requests get: reads for whoever may connect, changes, reloads,
//! disconnects and test hooks for root or the daemon's user.

use super::*;
use crate::admin::may_change;

impl Daemon {
    pub(super) fn answer(
        &mut self,
        registry: &Registry,
        req: Request,
        uid: Option<u32>,
        admin: &AdminStats,
    ) -> Response {
        let json = |v: Result<serde_json::Value, serde_json::Error>| match v {
            Ok(v) => Response::data(v),
            Err(e) => Response::error(format!("internal error: {e}")),
        };
        // Only root (or the daemon's own user) changes anything: a change opens files and
        // devices as the daemon, exports them to hosts and ends connections. Whoever else may
        // connect (a group the socket is opened to, for monitoring) reads.
        let reads = matches!(
            req,
            Request::Status {} | Request::Stats {} | Request::Config {} | Request::Controllers {}
        );
        if !reads && !may_change(uid) {
            warn!(self.log, "admin request refused: changes need root"; "uid" => uid);
            return Response::error(format!(
                "changes need root or the daemon's user (the request came from uid {}): status, \
                 stats, config and controllers are open to whoever may connect to the socket",
                uid.map_or_else(|| "unknown".into(), |u| u.to_string())
            ));
        }
        // A change plans against the devices there are: removals seen while an earlier
        // change of this turn waited are handled first.
        self.handle_deferred_removals(registry);
        match req {
            Request::Status {} => json(serde_json::to_value(self.status())),
            Request::Stats {} => json(serde_json::to_value(self.stats(admin))),
            Request::Config {} => json(serde_json::to_value(&self.cfg)),
            Request::Controllers {} => json(serde_json::to_value(self.controllers())),
            Request::Disconnect { cntlid, host } => match self.disconnect(cntlid, host, uid) {
                Ok(v) => Response::data(v),
                Err(e) => Response::error(e),
            },
            Request::Reload {} => {
                info!(self.log, "reload requested"; "by_uid" => uid);
                Self::changed(self.reload(registry))
            }
            Request::DebugStallReactor { reactor, ms } => {
                if !self.test_hooks {
                    return Response::error(format!("debug requests need {TEST_HOOKS_ENV}=1"));
                }
                match self.reactors.get(reactor) {
                    Some(r) => {
                        r.shared.stall_for(ms);
                        Response::data(serde_json::json!({ "stalled_reactor": reactor, "ms": ms }))
                    }
                    None => Response::error(format!("no reactor {reactor}")),
                }
            }
            Request::DebugFailResize {
                subsystem,
                nsid,
                at_cut,
            } => {
                if !self.test_hooks {
                    return Response::error(format!("debug requests need {TEST_HOOKS_ENV}=1"));
                }
                if at_cut {
                    return match self.devices.get(&(subsystem, nsid)) {
                        Some(d) => {
                            d.fail_next_cut();
                            Response::data(serde_json::json!({ "fail_cut": nsid }))
                        }
                        None => Response::error(format!("no namespace {nsid} open")),
                    };
                }
                self.fail_resize = Some((subsystem, nsid));
                Response::data(serde_json::json!({ "fail_resize": nsid }))
            }
            Request::DebugFailSync { subsystem, nsid } => {
                if !self.test_hooks {
                    return Response::error(format!("debug requests need {TEST_HOOKS_ENV}=1"));
                }
                match self.devices.get(&(subsystem, nsid)) {
                    Some(d) => {
                        d.fail_next_sync();
                        Response::data(serde_json::json!({ "fail_sync": nsid }))
                    }
                    None => Response::error(format!("no namespace {nsid} open")),
                }
            }
            Request::DebugOffThread { ms } => {
                if !self.test_hooks {
                    return Response::error(format!("debug requests need {TEST_HOOKS_ENV}=1"));
                }
                let _ = self.off_thread_until(
                    move || std::thread::sleep(Duration::from_millis(ms)),
                    Some(Instant::now()),
                );
                Response::data(serde_json::json!({ "off_thread_ms": ms }))
            }
            Request::DebugFault { fault, listener } => {
                if !self.test_hooks {
                    return Response::error(format!("debug requests need {TEST_HOOKS_ENV}=1"));
                }
                match self.inject_fault(fault, listener) {
                    Ok(v) => Response::data(v),
                    Err(e) => Response::error(e),
                }
            }
            change => match change.edits() {
                Some((edits, resize)) => Self::changed(self.change(registry, &edits, resize, uid)),
                None => Response::error("not a change"),
            },
        }
    }

    /// The answer to a change: what it did, or why it was refused.
    fn changed(r: Result<Vec<String>, String>) -> Response {
        match r {
            Ok(what) => Response::data(serde_json::json!({ "changes": what })),
            Err(e) => Response::error(e),
        }
    }

    /// Ends controller `cntlid`, or every controller of `host`.
    fn disconnect(
        &mut self,
        cntlid: Option<u16>,
        host: Option<String>,
        uid: Option<u32>,
    ) -> Result<serde_json::Value, String> {
        let t = self.target.clone().ok_or("the daemon is not serving yet")?;
        let ended: Vec<u16> = match (cntlid, host) {
            (Some(id), None) => t
                .disconnect_controller(id)
                .map(|c| vec![c.cntlid])
                .ok_or_else(|| format!("no controller {id}"))?,
            (None, Some(h)) => {
                let v: Vec<u16> = t.disconnect_host(&h).iter().map(|c| c.cntlid).collect();
                if v.is_empty() {
                    return Err(format!("host {h} has no controller"));
                }
                v
            }
            _ => return Err("give either a controller ID or a host NQN".into()),
        };
        info!(self.log, "controllers disconnected by request"; "by_uid" => uid, "cntlids" => ?ended);
        self.tell_reactors(|| ReactorCmd::PollEvents);
        Ok(serde_json::json!({ "disconnected": ended }))
    }
}

#[cfg(test)]
mod tests {
    /// Changes through the admin socket: root and the daemon's own user only; a peer whose
    /// user ID could not be read, or any other user, may only look.
    #[test]
    fn only_root_and_the_daemons_user_may_change_anything() {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        assert!(crate::admin::may_change(Some(0)));
        assert!(crate::admin::may_change(Some(me)));
        assert!(!crate::admin::may_change(None));
        let other = if me == 65534 { 65533 } else { 65534 };
        assert!(!crate::admin::may_change(Some(other)));
    }
}
