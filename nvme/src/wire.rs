//! Byte-exact NVMe and NVMe over Fabrics structures.
//!
//! Every type is `repr(C)` with little-endian, unaligned fields (`zerocopy`), so its layout is
//! the specification's and parsing untrusted bytes is a bounds-checked copy that cannot panic.
//! `tests/layout.rs` checks every field's offset and size against the specification's tables.

use zerocopy::little_endian::{U128, U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Derives shared by every wire type.
macro_rules! wire {
    ($(#[$m:meta])* $v:vis struct $name:ident { $($body:tt)* }) => {
        $(#[$m])*
        #[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(C)]
        $v struct $name { $($body)* }
    };
}

/// Reads a `T` from the start of `bytes`; `None` when there are too few bytes.
pub fn read<T: FromBytes>(bytes: &[u8]) -> Option<T> {
    T::read_from_prefix(bytes).ok().map(|(t, _)| t)
}

/// A zeroed `T`.
pub fn zeroed<T: FromBytes>() -> T {
    T::new_zeroed()
}

wire! {
    /// SGL descriptor (NVMe Base, "SGL Descriptor"): 16 bytes, the type in byte 15.
    pub struct SglDesc {
        /// Address (keyed data block, data block) or offset (data block, offset subtype).
        pub addr: U64,
        /// Type-specific: length (3 bytes) and key (4 bytes) for keyed data blocks; length
        /// (4 bytes) and 3 reserved bytes for data blocks.
        pub body: [u8; 7],
        /// Descriptor type (high nibble) and subtype (low nibble).
        pub id: u8,
    }
}

/// SGL descriptor types (high nibble of the identifier).
pub mod sgl {
    /// Data Block.
    pub const TYPE_DATA_BLOCK: u8 = 0x0;
    /// Last Segment: a list of descriptors (for NVMe-oF RDMA, in the capsule at an offset).
    pub const TYPE_LAST_SEGMENT: u8 = 0x3;
    /// Keyed Data Block (RDMA).
    pub const TYPE_KEYED_DATA_BLOCK: u8 = 0x4;
    /// Subtype: address.
    pub const SUBTYPE_ADDRESS: u8 = 0x0;
    /// Subtype: offset (in-capsule data).
    pub const SUBTYPE_OFFSET: u8 = 0x1;
    /// Subtype: invalidate the key after the transfer (keyed data block).
    pub const SUBTYPE_INVALIDATE_KEY: u8 = 0xF;
}

/// Where a command's data is, as its SGL says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sgl {
    /// Keyed data block: host memory reached by RDMA at `addr` with `key`.
    Keyed {
        /// Host address.
        addr: u64,
        /// Length in bytes (24 bits).
        len: u32,
        /// Remote key.
        key: u32,
        /// The host asks for the key to be invalidated (SEND_WITH_INVALIDATE).
        invalidate: bool,
    },
    /// Data block with the offset subtype: data inside the capsule, at `offset` after the SQE.
    InCapsule {
        /// Offset from the start of the in-capsule data.
        offset: u64,
        /// Length in bytes.
        len: u32,
    },
    /// Last segment with the offset subtype: a list of `len / 16` descriptors inside the
    /// capsule, at `offset` after the SQE.
    LastSegment {
        /// Offset from the start of the in-capsule data.
        offset: u64,
        /// Length of the descriptor list in bytes.
        len: u32,
    },
    /// Anything else (a type or subtype this target does not take).
    Unsupported {
        /// The identifier byte.
        id: u8,
    },
}

impl SglDesc {
    /// Decodes the descriptor.
    pub fn decode(&self) -> Sgl {
        let b = self.body;
        match (self.id >> 4, self.id & 0xF) {
            (
                sgl::TYPE_KEYED_DATA_BLOCK,
                st @ (sgl::SUBTYPE_ADDRESS | sgl::SUBTYPE_INVALIDATE_KEY),
            ) => Sgl::Keyed {
                addr: self.addr.get(),
                len: u32::from_le_bytes([b[0], b[1], b[2], 0]),
                key: u32::from_le_bytes([b[3], b[4], b[5], b[6]]),
                invalidate: st == sgl::SUBTYPE_INVALIDATE_KEY,
            },
            (sgl::TYPE_DATA_BLOCK, sgl::SUBTYPE_OFFSET) => Sgl::InCapsule {
                offset: self.addr.get(),
                len: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            },
            (sgl::TYPE_LAST_SEGMENT, sgl::SUBTYPE_OFFSET) => Sgl::LastSegment {
                offset: self.addr.get(),
                len: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            },
            _ => Sgl::Unsupported { id: self.id },
        }
    }

    /// A keyed data block descriptor (`len` is truncated to 24 bits).
    pub fn keyed(addr: u64, len: u32, key: u32, invalidate: bool) -> SglDesc {
        let l = len.to_le_bytes();
        let k = key.to_le_bytes();
        let st = if invalidate {
            sgl::SUBTYPE_INVALIDATE_KEY
        } else {
            sgl::SUBTYPE_ADDRESS
        };
        SglDesc {
            addr: U64::new(addr),
            body: [l[0], l[1], l[2], k[0], k[1], k[2], k[3]],
            id: (sgl::TYPE_KEYED_DATA_BLOCK << 4) | st,
        }
    }

    /// A last segment descriptor: `count` descriptors in the capsule at `offset`.
    pub fn last_segment(offset: u64, count: u32) -> SglDesc {
        let l = (count * 16).to_le_bytes();
        SglDesc {
            addr: U64::new(offset),
            body: [l[0], l[1], l[2], l[3], 0, 0, 0],
            id: (sgl::TYPE_LAST_SEGMENT << 4) | sgl::SUBTYPE_OFFSET,
        }
    }

    /// An in-capsule data block descriptor.
    pub fn in_capsule(offset: u64, len: u32) -> SglDesc {
        let l = len.to_le_bytes();
        SglDesc {
            addr: U64::new(offset),
            body: [l[0], l[1], l[2], l[3], 0, 0, 0],
            id: (sgl::TYPE_DATA_BLOCK << 4) | sgl::SUBTYPE_OFFSET,
        }
    }
}

wire! {
    /// Submission queue entry: 64 bytes.
    pub struct Sqe {
        /// Opcode.
        pub opcode: u8,
        /// FUSE (bits 1:0) and PSDT (bits 7:6; 01b or 10b = SGL).
        pub flags: u8,
        /// Command identifier.
        pub cid: U16,
        /// Namespace identifier.
        pub nsid: U32,
        /// Command dword 2.
        pub cdw2: U32,
        /// Command dword 3.
        pub cdw3: U32,
        /// Metadata pointer.
        pub mptr: U64,
        /// Data pointer: SGL descriptor 1.
        pub dptr: SglDesc,
        /// Command dword 10.
        pub cdw10: U32,
        /// Command dword 11.
        pub cdw11: U32,
        /// Command dword 12.
        pub cdw12: U32,
        /// Command dword 13.
        pub cdw13: U32,
        /// Command dword 14.
        pub cdw14: U32,
        /// Command dword 15.
        pub cdw15: U32,
    }
}

impl Sqe {
    /// PSDT: 0 = PRP, 1 = SGL (contiguous metadata buffer), 2 = SGL (metadata SGL).
    pub fn psdt(&self) -> u8 {
        self.flags >> 6
    }
    /// FUSE bits.
    pub fn fuse(&self) -> u8 {
        self.flags & 0x3
    }
}

wire! {
    /// Completion queue entry: 16 bytes.
    pub struct Cqe {
        /// Command specific dword 0.
        pub dw0: U32,
        /// Command specific dword 1.
        pub dw1: U32,
        /// SQ head pointer.
        pub sqhd: U16,
        /// SQ identifier.
        pub sqid: U16,
        /// Command identifier.
        pub cid: U16,
        /// Phase tag (bit 0) and status field (bits 15:1).
        pub status: U16,
    }
}

impl Cqe {
    /// The status without the phase bit.
    pub fn status(&self) -> Status {
        Status(self.status.get() >> 1)
    }
}

/// Status field (15 bits, without the phase tag): SC bits 7:0, SCT bits 10:8, CRD 12:11,
/// More bit 13, DNR bit 14.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Status(pub u16);

impl std::fmt::Debug for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Status(sct {:#x}, sc {:#04x}{})",
            self.sct(),
            self.sc(),
            if self.dnr() { ", dnr" } else { "" }
        )
    }
}

impl Status {
    /// Success.
    pub const SUCCESS: Status = Status(0);
    /// A status with Do Not Retry set.
    pub const fn new(sct: u8, sc: u8) -> Status {
        Status(((sct as u16 & 0x7) << 8) | sc as u16 | (1 << 14))
    }
    /// A status the host may retry (DNR clear).
    pub const fn retryable(sct: u8, sc: u8) -> Status {
        Status(((sct as u16 & 0x7) << 8) | sc as u16)
    }
    /// Status code type.
    pub fn sct(self) -> u8 {
        ((self.0 >> 8) & 0x7) as u8
    }
    /// Status code.
    pub fn sc(self) -> u8 {
        (self.0 & 0xff) as u8
    }
    /// Do Not Retry.
    pub fn dnr(self) -> bool {
        self.0 & (1 << 14) != 0
    }
    /// Whether this is success.
    pub fn is_success(self) -> bool {
        self.sct() == 0 && self.sc() == 0
    }
    /// Command Retry Delay: which of the controller's CRDT1-3 the host waits before it
    /// retries (1 to 3; 0: none).
    pub fn crd(self) -> u8 {
        ((self.0 >> 11) & 0x3) as u8
    }
    /// This status with Command Retry Delay `crd` (1 to 3: CRDT1-3).
    #[must_use]
    pub const fn with_crd(self, crd: u8) -> Status {
        Status((self.0 & !(0x3 << 11)) | ((crd as u16 & 0x3) << 11))
    }
    /// Same code, ignoring DNR/More/CRD.
    pub fn same_code(self, other: Status) -> bool {
        self.sct() == other.sct() && self.sc() == other.sc()
    }
}

/// Status codes used by nvmfd (NVMe Base and NVMe over Fabrics).
pub mod status {
    use super::Status;
    /// Generic: Invalid Command Opcode.
    pub const INVALID_OPCODE: Status = Status::new(0, 0x01);
    /// Generic: Invalid Field in Command.
    pub const INVALID_FIELD: Status = Status::new(0, 0x02);
    /// Generic: Data Transfer Error.
    pub const DATA_TRANSFER_ERROR: Status = Status::new(0, 0x04);
    /// Generic: Internal Error.
    pub const INTERNAL_ERROR: Status = Status::new(0, 0x06);
    /// Generic: Namespace Not Ready, without Do Not Retry (the host retries later).
    pub const NAMESPACE_NOT_READY: Status = Status::retryable(0, 0x82);
    /// Generic: Command Abort Requested.
    pub const ABORT_REQUESTED: Status = Status::new(0, 0x07);
    /// Generic: Command Aborted due to SQ Deletion.
    pub const ABORTED_SQ_DELETION: Status = Status::new(0, 0x08);
    /// Generic: Keep Alive Timeout Invalid.
    pub const KEEP_ALIVE_TIMEOUT_INVALID: Status = Status::new(0, 0x1A);
    /// Generic: Invalid Namespace or Format.
    pub const INVALID_NAMESPACE: Status = Status::new(0, 0x0B);
    /// Generic: Command Sequence Error.
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::new(0, 0x0C);
    /// Generic: Invalid Number of SGL Descriptors.
    pub const SGL_DESCRIPTOR_COUNT_INVALID: Status = Status::new(0, 0x0E);
    /// Generic: Data SGL Length Invalid.
    pub const DATA_SGL_LENGTH_INVALID: Status = Status::new(0, 0x0F);
    /// Generic: SGL Descriptor Type Invalid.
    pub const SGL_DESCRIPTOR_TYPE_INVALID: Status = Status::new(0, 0x11);
    /// Generic: SGL Offset Invalid.
    pub const SGL_OFFSET_INVALID: Status = Status::new(0, 0x16);
    /// Generic: Namespace is Write Protected.
    pub const NAMESPACE_WRITE_PROTECTED: Status = Status::new(0, 0x20);
    /// Generic: LBA Out of Range.
    pub const LBA_OUT_OF_RANGE: Status = Status::new(0, 0x80);
    /// Generic: Capacity Exceeded.
    pub const CAPACITY_EXCEEDED: Status = Status::new(0, 0x81);
    /// Command specific: Invalid Queue Identifier.
    pub const INVALID_QUEUE_IDENTIFIER: Status = Status::new(1, 0x01);
    /// Command specific: Invalid Queue Size.
    pub const INVALID_QUEUE_SIZE: Status = Status::new(1, 0x02);
    /// Command specific: Asynchronous Event Request Limit Exceeded.
    pub const AER_LIMIT_EXCEEDED: Status = Status::new(1, 0x05);
    /// Command specific: Invalid Log Page.
    pub const INVALID_LOG_PAGE: Status = Status::new(1, 0x09);
    /// Command specific: Feature Identifier Not Saveable.
    pub const FEATURE_NOT_SAVEABLE: Status = Status::new(1, 0x0D);
    /// Command specific: Feature Not Changeable.
    pub const FEATURE_NOT_CHANGEABLE: Status = Status::new(1, 0x0E);
    /// Fabrics Connect: Incompatible Format.
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status::new(1, 0x80);
    /// Fabrics Connect: Controller Busy.
    pub const CONNECT_CONTROLLER_BUSY: Status = Status::new(1, 0x81);
    /// Fabrics Connect: Controller Busy, to be retried (DNR clear): a host's earlier
    /// association still has commands at a backend.
    pub const CONNECT_CONTROLLER_BUSY_RETRY: Status = Status::retryable(1, 0x81);
    /// Fabrics Connect: Invalid Parameters.
    pub const CONNECT_INVALID_PARAMETERS: Status = Status::new(1, 0x82);
    /// Fabrics Connect: Invalid Host.
    pub const CONNECT_INVALID_HOST: Status = Status::new(1, 0x84);
    /// Media: Write Fault.
    pub const WRITE_FAULT: Status = Status::new(2, 0x80);
    /// Media: Unrecovered Read Error.
    pub const UNRECOVERED_READ_ERROR: Status = Status::new(2, 0x81);
}

/// Admin command opcodes.
pub mod admin_opcode {
    /// Get Log Page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0A;
    /// Asynchronous Event Request.
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0C;
    /// Keep Alive.
    pub const KEEP_ALIVE: u8 = 0x18;
    /// Fabrics commands (on every queue).
    pub const FABRICS: u8 = 0x7F;
}

/// NVM command set I/O opcodes.
pub mod io_opcode {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DATASET_MANAGEMENT: u8 = 0x09;
}

/// Fabrics command types (byte 4 of a Fabrics command).
pub mod fctype {
    /// Property Set.
    pub const PROPERTY_SET: u8 = 0x00;
    /// Connect.
    pub const CONNECT: u8 = 0x01;
    /// Property Get.
    pub const PROPERTY_GET: u8 = 0x04;
    /// Authentication Send.
    pub const AUTH_SEND: u8 = 0x05;
    /// Authentication Receive.
    pub const AUTH_RECEIVE: u8 = 0x06;
    /// Disconnect.
    pub const DISCONNECT: u8 = 0x08;
}

/// Feature identifiers.
pub mod feature {
    /// Arbitration.
    pub const ARBITRATION: u8 = 0x01;
    /// Volatile Write Cache.
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    /// Number of Queues.
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    /// Interrupt Coalescing (not for fabrics).
    pub const INTERRUPT_COALESCING: u8 = 0x08;
    /// Asynchronous Event Configuration.
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0B;
    /// Keep Alive Timer.
    pub const KEEP_ALIVE_TIMER: u8 = 0x0F;
    /// Host Behavior Support (a 512-byte structure; byte 0 bit 0: ACRE).
    pub const HOST_BEHAVIOR_SUPPORT: u8 = 0x16;
}

/// Log page identifiers.
pub mod log_page {
    /// Error Information.
    pub const ERROR: u8 = 0x01;
    /// SMART / Health Information.
    pub const SMART: u8 = 0x02;
    /// Firmware Slot Information.
    pub const FIRMWARE_SLOT: u8 = 0x03;
    /// Changed Namespace List.
    pub const CHANGED_NAMESPACES: u8 = 0x04;
    /// Commands Supported and Effects.
    pub const COMMAND_EFFECTS: u8 = 0x05;
    /// Discovery.
    pub const DISCOVERY: u8 = 0x70;
}

wire! {
    /// Fabrics command (the Fabrics view of an SQE, opcode 0x7F).
    pub struct FabricsCmd {
        /// 0x7F.
        pub opcode: u8,
        /// Flags (PSDT).
        pub flags: u8,
        /// Command identifier.
        pub cid: U16,
        /// Fabrics command type.
        pub fctype: u8,
        /// Reserved.
        pub rsvd5: [u8; 19],
        /// SGL descriptor 1.
        pub dptr: SglDesc,
        /// Fabrics command specific (bytes 40 to 63).
        pub specific: [u8; 24],
    }
}

wire! {
    /// Connect command: 64 bytes.
    pub struct ConnectCmd {
        /// 0x7F.
        pub opcode: u8,
        /// Flags.
        pub flags: u8,
        /// Command identifier.
        pub cid: U16,
        /// 0x01.
        pub fctype: u8,
        /// Reserved.
        pub rsvd5: [u8; 19],
        /// SGL descriptor 1 (the 1024-byte Connect data).
        pub dptr: SglDesc,
        /// Record format, 0.
        pub recfmt: U16,
        /// Queue ID: 0 admin, else I/O.
        pub qid: U16,
        /// Submission queue size, 0's based.
        pub sqsize: U16,
        /// Connect attributes (bit 2: disable SQ flow control).
        pub cattr: u8,
        /// Reserved.
        pub rsvd47: u8,
        /// Keep alive timeout in ms (admin queue).
        pub kato: U32,
        /// Reserved.
        pub rsvd52: [u8; 12],
    }
}

wire! {
    /// Connect data: 1024 bytes.
    pub struct ConnectData {
        /// Host identifier.
        pub hostid: [u8; 16],
        /// Controller ID: 0xFFFF (dynamic) for the admin queue; the controller's for I/O.
        pub cntlid: U16,
        /// Reserved.
        pub rsvd18: [u8; 238],
        /// Subsystem NQN, NUL-padded.
        pub subnqn: [u8; 256],
        /// Host NQN, NUL-padded.
        pub hostnqn: [u8; 256],
        /// Reserved.
        pub rsvd768: [u8; 256],
    }
}

wire! {
    /// Property Set command.
    pub struct PropertySetCmd {
        /// 0x7F.
        pub opcode: u8,
        /// Flags.
        pub flags: u8,
        /// Command identifier.
        pub cid: U16,
        /// 0x00.
        pub fctype: u8,
        /// Reserved.
        pub rsvd5: [u8; 35],
        /// Attributes: bits 2:0 size, 0 = 4 bytes, 1 = 8 bytes.
        pub attrib: u8,
        /// Reserved.
        pub rsvd41: [u8; 3],
        /// Property offset.
        pub offset: U32,
        /// Value.
        pub value: U64,
        /// Reserved.
        pub rsvd56: [u8; 8],
    }
}

wire! {
    /// Property Get command.
    pub struct PropertyGetCmd {
        /// 0x7F.
        pub opcode: u8,
        /// Flags.
        pub flags: u8,
        /// Command identifier.
        pub cid: U16,
        /// 0x04.
        pub fctype: u8,
        /// Reserved.
        pub rsvd5: [u8; 35],
        /// Attributes: bits 2:0 size, 0 = 4 bytes, 1 = 8 bytes.
        pub attrib: u8,
        /// Reserved.
        pub rsvd41: [u8; 3],
        /// Property offset.
        pub offset: U32,
        /// Reserved.
        pub rsvd48: [u8; 16],
    }
}

wire! {
    /// Dataset Management range: 16 bytes, up to 256 of them in the command's data.
    pub struct DsmRange {
        /// Context attributes.
        pub cattr: U32,
        /// Length in logical blocks.
        pub nlb: U32,
        /// Starting LBA.
        pub slba: U64,
    }
}

/// Controller properties (register offsets).
pub mod property {
    /// Controller Capabilities (8 bytes).
    pub const CAP: u32 = 0x00;
    /// Version (4 bytes).
    pub const VS: u32 = 0x08;
    /// Controller Configuration (4 bytes).
    pub const CC: u32 = 0x14;
    /// Controller Status (4 bytes).
    pub const CSTS: u32 = 0x1C;
    /// NVM Subsystem Reset (4 bytes).
    pub const NSSR: u32 = 0x20;
}

wire! {
    /// NVMe/RDMA CM private data of a connect request: 32 bytes.
    pub struct RdmaCmRequest {
        /// Record format, 0.
        pub recfmt: U16,
        /// Queue ID.
        pub qid: U16,
        /// Host receive queue size (entries).
        pub hrqsize: U16,
        /// Host send queue size (0's based: the SQ size).
        pub hsqsize: U16,
        /// Controller ID (I/O queues).
        pub cntlid: U16,
        /// Reserved.
        pub rsvd: [u8; 22],
    }
}

wire! {
    /// NVMe/RDMA CM private data of an accept: 32 bytes.
    pub struct RdmaCmAccept {
        /// Record format, 0.
        pub recfmt: U16,
        /// Controller receive queue size.
        pub crqsize: U16,
        /// Reserved.
        pub rsvd: [u8; 28],
    }
}

wire! {
    /// NVMe/RDMA CM private data of a reject: 4 bytes.
    pub struct RdmaCmReject {
        /// Record format, 0.
        pub recfmt: U16,
        /// Status (see [`rdma_cm_status`]).
        pub sts: U16,
    }
}

/// NVMe/RDMA CM reject status codes.
pub mod rdma_cm_status {
    /// Invalid private data length.
    pub const INVALID_PRIVATE_DATA_LENGTH: u16 = 0x01;
    /// Invalid RECFMT.
    pub const INVALID_RECFMT: u16 = 0x02;
    /// Invalid QID.
    pub const INVALID_QID: u16 = 0x03;
    /// Invalid HSQSIZE.
    pub const INVALID_HSQSIZE: u16 = 0x04;
    /// Invalid HRQSIZE.
    pub const INVALID_HRQSIZE: u16 = 0x05;
    /// No resources.
    pub const NO_RESOURCES: u16 = 0x06;
    /// Invalid IRD.
    pub const INVALID_IRD: u16 = 0x07;
    /// Invalid ORD.
    pub const INVALID_ORD: u16 = 0x08;
    /// Invalid CNTLID.
    pub const INVALID_CNTLID: u16 = 0x09;
}

mod identify;
pub use identify::*;

mod log;
pub use log::*;

/// Copies `s` into a fixed field, padded with `pad` (NUL for NQNs, space for ASCII strings),
/// truncated to fit.
pub fn put_str(field: &mut [u8], s: &str, pad: u8) {
    field.fill(pad);
    let n = s.len().min(field.len());
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// A NUL- or space-padded string field as text; `None` when it is not UTF-8.
pub fn get_str(field: &[u8]) -> Option<&str> {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    std::str::from_utf8(&field[..end])
        .ok()
        .map(|s| s.trim_end_matches(' '))
}

/// An NQN field as text: NUL-terminated within the field (a field filled to its end holds no
/// NQN, as SPDK checks) and UTF-8.
pub fn get_nqn(field: &[u8]) -> Option<&str> {
    if !field.contains(&0) {
        return None;
    }
    get_str(field)
}

/// The low dword of a 64-bit value (the first of the two dwords it is carried in).
pub fn lo32(v: u64) -> u32 {
    u32::try_from(v & 0xFFFF_FFFF).unwrap_or(0)
}

/// The high dword of a 64-bit value.
pub fn hi32(v: u64) -> u32 {
    u32::try_from(v >> 32).unwrap_or(0)
}

/// `v` as a narrower integer, saturating at its maximum (fields whose value is bounded by
/// construction; a value beyond the field would be a bug, and saturation keeps it visible).
pub fn sat<T: TryFrom<U> + Bounded, U>(v: U) -> T {
    T::try_from(v).unwrap_or(T::MAX)
}

/// Integer types with a maximum, for [`sat`].
pub trait Bounded {
    /// The largest value.
    const MAX: Self;
}

impl Bounded for u8 {
    const MAX: u8 = u8::MAX;
}
impl Bounded for u16 {
    const MAX: u16 = u16::MAX;
}
impl Bounded for u32 {
    const MAX: u32 = u32::MAX;
}
