//! Devices, protection domains and memory regions.

use super::*;

pub(super) struct DevInner {
    pub(super) fabric: Fabric,
    pub(super) id: u32,
    pub(super) async_fd: Arc<EventFd>,
}

/// A device: the parent of PDs and CQs, with an async event queue. Clones share it.
#[derive(Clone)]
pub struct Device {
    pub(super) inner: Arc<DevInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("soft::Device")
            .field("id", &self.inner.id)
            .finish()
    }
}

impl Device {
    pub(super) fn fabric(&self) -> &Fabric {
        &self.inner.fabric
    }

    /// Whether objects made on the device are still open (PDs, MRs, CQs, SRQs, QPs).
    pub fn in_use(&self) -> bool {
        self.fabric().objects_on(self) > 0
    }

    /// Limits.
    pub fn attr(&self) -> Result<DeviceAttr, VerbsError> {
        Ok(SOFT_ATTR)
    }

    /// Whether an RDMA READ's sink must be registered for remote write: no, unless the
    /// fabric's faults make the devices as an iWARP NIC.
    pub fn rdma_read_sink_needs_remote_write(&self) -> bool {
        self.fabric().lock().faults.read_sink_needs_remote_write
    }

    /// Whether the device sends `QpLastWqeReached`: yes, unless the fabric's faults suppress
    /// it (as rxe and iWARP devices never send it).
    pub fn sends_last_wqe(&self) -> bool {
        !self.fabric().lock().faults.suppress_last_wqe
    }

    /// Whether the device can post SEND_WITH_INVALIDATE: yes, unless the fabric's faults say
    /// no ([`Faults::no_send_with_invalidate`]).
    pub fn supports_send_with_invalidate(&self) -> bool {
        !self.fabric().lock().faults.no_send_with_invalidate
    }

    /// Port `port`'s attributes (one active RoCE port, MTU 1024 as on rxe).
    pub fn port_attr(&self, port: u8) -> Result<PortAttr, VerbsError> {
        if port != 1 {
            return Err(VerbsError::os("query_port", libc::EINVAL));
        }
        Ok(PortAttr {
            active: true,
            active_mtu: 1024,
            gid_tbl_len: 2,
            link_layer: 2,
        })
    }

    /// GID `index` of port 1: index 1 is the IPv4-mapped address, as RoCE v2 on rxe has it.
    pub fn gid(&self, port: u8, index: u32) -> Result<[u8; 16], VerbsError> {
        let s = self.fabric().lock();
        let d = s
            .devs
            .get(&self.inner.id)
            .ok_or(VerbsError::os("query_gid", libc::ENODEV))?;
        match (port, index, d.addr) {
            (1, 1, std::net::IpAddr::V4(a)) => Ok(a.to_ipv6_mapped().octets()),
            (1, 1, std::net::IpAddr::V6(a)) => Ok(a.octets()),
            (1, 0, _) => Ok([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]),
            _ => Err(VerbsError::os("query_gid", libc::EINVAL)),
        }
    }

    /// The pollable fd that turns readable when an async event is queued.
    pub fn async_fd(&self) -> RawFd {
        self.inner.async_fd.as_raw_fd()
    }

    /// The next async event, without blocking.
    pub fn next_event(&self) -> Option<AsyncEvent> {
        self.next_numbered_event().map(|(_, e)| e)
    }

    /// The next async event and its number: the events read from every device of the
    /// fabric are numbered in the order they are read (see [`Device::events_read`]).
    pub fn next_numbered_event(&self) -> Option<(u64, AsyncEvent)> {
        let mut s = self.fabric().lock();
        let n = s.events_read;
        let d = s.devs.get_mut(&self.inner.id)?;
        let e = d.events.pop_front();
        if d.events.is_empty() {
            d.async_fd.clear();
        }
        let e = e?;
        s.events_read = n + 1;
        Some((n, e))
    }

    /// How many async events have been read from the fabric's devices so far: any event read
    /// from now on is numbered at least this. Taken before a QP is created, it tells that
    /// QP's events from those of a destroyed QP whose number the device gave it (destroying a
    /// QP drops its events not yet read, as uverbs does).
    pub fn events_read(&self) -> u64 {
        self.fabric().lock().events_read
    }

    /// A protection domain.
    pub fn alloc_pd(&self) -> Result<Pd, VerbsError> {
        if self.fabric().lock().removed.contains(&self.inner.id) {
            return Err(VerbsError::os("alloc_pd", libc::ENODEV));
        }
        let mut s = self.fabric().lock();
        let id = s.alloc_id();
        s.live_pds.insert(id);
        if let Some(d) = s.devs.get_mut(&self.inner.id) {
            d.pds += 1;
        }
        drop(s);
        Ok(Pd {
            fabric: self.fabric().clone(),
            dev: self.inner.id,
            id,
            _alive: Arc::new(PdAlive {
                fabric: self.fabric().clone(),
                dev: self.inner.id,
                id,
            }),
        })
    }

    /// A completion queue of `cqe` entries, with its completion channel.
    pub fn create_cq(&self, cqe: u32) -> Result<Cq, VerbsError> {
        if cqe == 0 || cqe > SOFT_ATTR.max_cqe {
            return Err(VerbsError::os("create_cq", libc::EINVAL));
        }
        let channel = Arc::new(
            EventFd::new()
                .map_err(|e| VerbsError::os("eventfd", e.raw_os_error().unwrap_or(libc::EIO)))?,
        );
        let mut s = self.fabric().lock();
        if s.removed.contains(&self.inner.id) {
            return Err(VerbsError::os("create_cq", libc::ENODEV));
        }
        let ready = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let delayed_any = Arc::clone(&s.delayed_any);
        let variant = s.variant();
        let id = s
            .cqs
            .insert_new(
                variant,
                CqState {
                    armed: false,
                    dev: self.inner.id,
                    cap: cqe as usize,
                    entries: VecDeque::new(),
                    overflowed: false,
                    channel: Arc::clone(&channel),
                    ready: Arc::clone(&ready),
                },
            )
            .ok_or(VerbsError::os("create_cq", libc::ENOMEM))?;
        Ok(Cq {
            fabric: self.fabric().clone(),
            id,
            channel,
            ready,
            delayed_any,
        })
    }
}

/// A protection domain (clones name the same domain).
#[derive(Clone, Debug)]
pub struct Pd {
    pub(super) fabric: Fabric,
    pub(super) dev: u32,
    pub(super) id: u32,
    /// Counts the domain on its device while a clone lives.
    pub(super) _alive: Arc<PdAlive>,
}

/// One PD counted on its device (`State::objects_on`) until its last clone goes.
#[derive(Debug)]
pub(super) struct PdAlive {
    pub(super) fabric: Fabric,
    pub(super) dev: u32,
    pub(super) id: u32,
}

impl Drop for PdAlive {
    fn drop(&mut self) {
        let mut s = self.fabric.lock();
        s.live_pds.remove(&self.id);
        if let Some(d) = s.devs.get_mut(&self.dev) {
            d.pds = d.pds.saturating_sub(1);
        }
    }
}

/// A registered memory region. [`Pd::alloc_mr`] makes one that owns its memory.
#[derive(Debug)]
pub struct Mr {
    pub(super) fabric: Fabric,
    pub(super) key: u32,
    pub(super) addr: u64,
    pub(super) len: usize,
    /// Memory the region owns (its address never moves).
    pub(super) owned: Option<crate::types::OwnedMem>,
}

impl Pd {
    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    ///
    /// `addr..addr+len` must stay mapped and writable until the returned `Mr` is dropped.
    /// Peers read and write it at any time, as a NIC would by DMA: the owner must treat it as
    /// shared memory (no references held across accesses it does not order).
    pub unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Mr, VerbsError> {
        let mut s = self.fabric.lock();
        if s.fail_registrations > 0 {
            s.fail_registrations -= 1;
            return Err(VerbsError::os("reg_mr", libc::ENOMEM));
        }
        let variant = s.variant();
        let key = s
            .mrs
            .insert_new(
                variant,
                MrEntry {
                    dev: self.dev,
                    pd: self.id,
                    addr: addr as u64,
                    len: len as u64,
                    access,
                    valid: true,
                },
            )
            .ok_or(VerbsError::os("reg_mr", libc::ENOMEM))?;
        Ok(Mr {
            fabric: self.fabric.clone(),
            key,
            addr: addr as u64,
            len,
            owned: None,
        })
    }

    /// Allocates `len` zeroed bytes and registers them.
    pub fn alloc_mr(&self, len: usize, access: Access) -> Result<Mr, VerbsError> {
        // Page-aligned: a page-sized receive SGE then never straddles two pages.
        let mem = crate::types::OwnedMem::zeroed(len + 4096);
        let off = mem.as_mut_ptr().align_offset(4096);
        // SAFETY: `off` < 4096, so `off + len` is within the allocation.
        let ptr = unsafe { mem.as_mut_ptr().add(off) };
        // SAFETY: the memory is owned by the returned Mr and freed only after deregistration.
        let mut mr = unsafe { self.reg_mr(ptr, len, access)? };
        mr.owned = Some(mem);
        Ok(mr)
    }

    /// A shared receive queue of `max_wr` receives of up to `max_sge` SGEs each.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Srq, VerbsError> {
        if max_wr == 0
            || max_wr > SOFT_ATTR.max_srq_wr
            || max_sge == 0
            || max_sge > SOFT_ATTR.max_srq_sge
        {
            return Err(VerbsError::os("create_srq", libc::EINVAL));
        }
        let mut s = self.fabric.lock();
        let variant = s.variant();
        let id = s
            .srqs
            .insert_new(
                variant,
                SrqState {
                    dev: self.dev,
                    pd: self.id,
                    max_wr,
                    max_sge,
                    limit: 0,
                    recvs: VecDeque::new(),
                },
            )
            .ok_or(VerbsError::os("create_srq", libc::ENOMEM))?;
        Ok(Srq {
            fabric: self.fabric.clone(),
            id,
        })
    }

    /// An RC queue pair on `send_cq`/`recv_cq`, taking its receives from `srq`. (Connections
    /// create theirs on a CM ID: `cm::CmId::create_qp`.)
    pub(crate) fn create_qp(
        &self,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: &Srq,
        caps: QpCaps,
    ) -> Result<Qp, VerbsError> {
        if self
            .fabric
            .lock()
            .srqs
            .get(&srq.id)
            .is_none_or(|q| q.pd != self.id)
        {
            return Err(VerbsError::Invalid {
                op: "create_qp",
                why: "the SRQ belongs to another protection domain",
            });
        }
        if caps.max_send_wr == 0
            || caps.max_send_wr > SOFT_ATTR.max_qp_wr
            || caps.max_send_sge > SOFT_ATTR.max_sge
            || caps.max_inline_data > SOFT_MAX_INLINE
        {
            return Err(VerbsError::os("create_qp", libc::EINVAL));
        }
        let mut s = self.fabric.lock();
        let qp = QpState_ {
            dev: self.dev,
            pd: self.id,
            state: QpState::Reset,
            send_cq: send_cq.id,
            recv_cq: recv_cq.id,
            srq: Some(srq.id),
            caps,
            peer: None,
            rnr_retry: 7,
            unsignaled_run: 0,
            unpolled: 0,
            deferred: 0,
            rnr_blocked: 0,
            inbound: VecDeque::new(),
            last_wqe_sent: false,
            comm_est_pending: false,
            remote: None,
            remote_pending: std::collections::BTreeMap::new(),
            next_seq: 0,
            delayed: VecDeque::new(),
            read_depth: 0,
            reads_out: 0,
            reads_peak: 0,
            depths: None,
        };
        // A number given to reuse takes its slot where that is free ([`Table::insert_at`]).
        let qp = match s.reuse_qpns.pop_front() {
            Some(n) => s.qps.insert_at(n, qp).map(|()| n),
            None => Err(qp),
        };
        let qpn = match qp {
            Ok(n) => n,
            Err(qp) => {
                let variant = s.variant();
                s.qps
                    .insert_new(variant, qp)
                    .ok_or(VerbsError::os("create_qp", libc::ENOMEM))?
            }
        };
        Ok(Qp {
            fabric: self.fabric.clone(),
            qpn,
        })
    }
}

impl Mr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.key
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.key
    }
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// An SGE for `len` bytes at `offset`.
    pub fn sge(&self, offset: usize, len: u32) -> Sge {
        Sge {
            addr: self.addr + offset as u64,
            length: len,
            lkey: self.key,
        }
    }
    /// Copies bytes out of the region.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.len, "read past the region");
        // SAFETY: in bounds (asserted) of memory kept mapped while registered; raw copy of
        // shared memory.
        unsafe {
            std::ptr::copy(
                (self.addr as *const u8).add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
    }
    /// Copies bytes into the region.
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len, "write past the region");
        // SAFETY: as in `read`.
        unsafe {
            std::ptr::copy(
                data.as_ptr(),
                (self.addr as *mut u8).add(offset),
                data.len(),
            )
        };
    }
    /// Whether the key is still valid (a SEND with invalidate may have invalidated it).
    pub fn is_valid(&self) -> bool {
        self.fabric
            .lock()
            .mrs
            .get(&self.key)
            .is_some_and(|m| m.valid)
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.fabric.lock().mrs.remove(&self.key);
    }
}
