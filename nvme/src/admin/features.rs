//! Set Features and Get Features (Number of Queues, Async Event Configuration, Keep Alive
//! Timer, Volatile Write Cache, Arbitration, Host Behavior Support).

use super::*;

/// Size of the Host Behavior Support structure.
const HOST_BEHAVIOR_LEN: u32 = 512;

/// The data of a Set Features command arrived: Host Behavior Support, the one feature with
/// data nvmfd takes.
pub(crate) fn data_arrived(q: &mut Queue, ctrl: &Controller, cmd: Command, data: &[u8]) -> Action {
    let fid = (cmd.sqe.cdw10.get() & 0xFF) as u8;
    match (cmd.sqe.opcode, fid, data.first()) {
        (op::SET_FEATURES, feature::HOST_BEHAVIOR_SUPPORT, Some(&b0)) => {
            ctrl.lock().acre = b0 & 1 != 0;
            q.respond(&cmd, Status::SUCCESS, 0)
        }
        _ => q.respond(&cmd, status::INTERNAL_ERROR, 0),
    }
}

pub(super) fn set_features(
    q: &mut Queue,
    ctrl: &Controller,
    cmd: Command,
    icd: &[u8],
    now: Instant,
) -> Action {
    let cdw10 = cmd.sqe.cdw10.get();
    let fid = (cdw10 & 0xFF) as u8;
    if cdw10 & (1 << 31) != 0 {
        return q.respond(&cmd, status::FEATURE_NOT_SAVEABLE, 0);
    }
    let cdw11 = cmd.sqe.cdw11.get();
    let limits = *q.target().limits();
    if fid == feature::HOST_BEHAVIOR_SUPPORT && ctrl.subsystem.is_some() {
        return match q.data_ref(&cmd.sqe, HOST_BEHAVIOR_LEN, true, icd) {
            Ok(from) => Action::Fetch { cmd, from },
            Err(st) => q.respond(&cmd, st, 0),
        };
    }
    // The other features nvmfd takes have no data.
    if let Err(st) = q.no_data(&cmd.sqe) {
        return q.respond(&cmd, st, 0);
    }
    let mut st = ctrl.lock();
    match fid {
        feature::NUMBER_OF_QUEUES if ctrl.subsystem.is_some() => {
            let nsqr = cdw11 & 0xFFFF;
            let ncqr = cdw11 >> 16;
            if nsqr == 0xFFFF || ncqr == 0xFFFF {
                return q.respond(&cmd, status::INVALID_FIELD, 0);
            }
            if st.io_queues.iter().any(|&b| b) {
                return q.respond(&cmd, status::COMMAND_SEQUENCE_ERROR, 0);
            }
            let granted: u16 = wire::sat(
                nsqr.min(ncqr)
                    .min(u32::from(limits.max_io_queues).saturating_sub(1)),
            );
            st.queues_granted = Some(granted);
            let dw0 = u32::from(granted) | u32::from(granted) << 16;
            q.respond(&cmd, Status::SUCCESS, dw0)
        }
        feature::ASYNC_EVENT_CONFIG => {
            // The SMART / Health critical warnings (bits 7:0, never raised) and the notices
            // OAES offers: Namespace Attribute Notices on an I/O controller; on a discovery
            // controller, Discovery Log Page Change notices.
            let offered = if ctrl.subsystem.is_some() {
                0xFF | 1 << 8
            } else {
                1 << 31
            };
            if cdw11 & !offered != 0 {
                drop(st);
                return q.respond(&cmd, status::INVALID_FIELD, 0);
            }
            st.aec = cdw11;
            q.respond(&cmd, Status::SUCCESS, 0)
        }
        feature::KEEP_ALIVE_TIMER => {
            let ms = Duration::from_millis(u64::from(cdw11));
            // Longer than allowed: refused, not cut down (the host would keep to its own).
            if ms > limits.kato_max {
                drop(st);
                return q.respond(&cmd, status::KEEP_ALIVE_TIMEOUT_INVALID, 0);
            }
            st.kato = if ms.is_zero() {
                ms
            } else {
                ms.max(limits.kato_min)
            };
            st.last_keep_alive = now;
            q.respond(&cmd, Status::SUCCESS, 0)
        }
        // Reported present for every subsystem (Identify Controller's VWC).
        feature::VOLATILE_WRITE_CACHE if ctrl.subsystem.is_some() => {
            if cdw11 & 1 == 1 {
                q.respond(&cmd, Status::SUCCESS, 0)
            } else {
                // Turning the cache off would need FUA on every write: not offered.
                q.respond(&cmd, status::FEATURE_NOT_CHANGEABLE, 0)
            }
        }
        // Round robin, fixed (Get Features SEL 011b says so).
        feature::ARBITRATION => q.respond(&cmd, status::FEATURE_NOT_CHANGEABLE, 0),
        _ => q.respond(&cmd, status::INVALID_FIELD, 0),
    }
}

pub(super) fn get_features(q: &mut Queue, ctrl: &Controller, cmd: Command, icd: &[u8]) -> Action {
    let cdw10 = cmd.sqe.cdw10.get();
    let fid = (cdw10 & 0xFF) as u8;
    let sel = (cdw10 >> 8) & 0x7;
    // Current, default, saved (nothing is saveable: the current value is reported for each)
    // and supported capabilities; the rest are reserved.
    if sel > 3 {
        return q.respond(&cmd, status::INVALID_FIELD, 0);
    }
    // Only Host Behavior Support's current value has data.
    let with_data = fid == feature::HOST_BEHAVIOR_SUPPORT && ctrl.subsystem.is_some() && sel != 3;
    if !with_data {
        if let Err(st) = q.no_data(&cmd.sqe) {
            return q.respond(&cmd, st, 0);
        }
    }
    if sel == 3 {
        // Supported capabilities: nothing is saveable or namespace specific; changeable (bit
        // 2) as Set Features takes it: not the write cache (turning it off is refused) nor
        // arbitration (not settable).
        let io = ctrl.subsystem.is_some();
        let changeable = match fid {
            feature::NUMBER_OF_QUEUES | feature::HOST_BEHAVIOR_SUPPORT if io => true,
            feature::ASYNC_EVENT_CONFIG | feature::KEEP_ALIVE_TIMER => true,
            feature::VOLATILE_WRITE_CACHE if io => false,
            feature::ARBITRATION => false,
            _ => return q.respond(&cmd, status::INVALID_FIELD, 0),
        };
        return q.respond(&cmd, Status::SUCCESS, u32::from(changeable) << 2);
    }
    if fid == feature::HOST_BEHAVIOR_SUPPORT && ctrl.subsystem.is_some() {
        let mut data = vec![0u8; HOST_BEHAVIOR_LEN as usize];
        data[0] = u8::from(ctrl.lock().acre);
        return respond_data(q, &cmd, data, icd);
    }
    let st = ctrl.lock();
    let dw0 = match fid {
        feature::NUMBER_OF_QUEUES if ctrl.subsystem.is_some() => {
            let g = u32::from(
                st.queues_granted
                    .unwrap_or(q.target().limits().max_io_queues.saturating_sub(1)),
            );
            g | g << 16
        }
        feature::ASYNC_EVENT_CONFIG => st.aec,
        feature::KEEP_ALIVE_TIMER => u32::try_from(st.kato.as_millis()).unwrap_or(u32::MAX),
        feature::VOLATILE_WRITE_CACHE if ctrl.subsystem.is_some() => 1,
        feature::ARBITRATION => 0,
        _ => return q.respond(&cmd, status::INVALID_FIELD, 0),
    };
    q.respond(&cmd, Status::SUCCESS, dw0)
}
