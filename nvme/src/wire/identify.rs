//! The Identify structures: controller (with its power states), namespace (with its LBA
//! formats), the NVM command set's controller structure, the namespace identification
//! descriptors, and the CNS, CSI and NIDT values that name them.

use super::*;

wire! {
    /// Power state descriptor: 32 bytes.
    pub struct PowerState {
        /// Maximum power (centiwatts).
        pub mp: U16,
        /// Reserved.
        pub rsvd2: u8,
        /// Flags.
        pub flags: u8,
        /// Entry latency.
        pub enlat: U32,
        /// Exit latency.
        pub exlat: U32,
        /// Relative read throughput, latency, write throughput, latency.
        pub rrt_rrl_rwt_rwl: [u8; 4],
        /// Idle and active power.
        pub rest: [u8; 16],
    }
}

wire! {
    /// Identify Controller data structure (CNS 01h): 4096 bytes.
    pub struct IdentifyController {
        /// PCI Vendor ID.
        pub vid: U16,
        /// PCI Subsystem Vendor ID.
        pub ssvid: U16,
        /// Serial number, ASCII, space-padded.
        pub sn: [u8; 20],
        /// Model number, ASCII, space-padded.
        pub mn: [u8; 40],
        /// Firmware revision, ASCII, space-padded.
        pub fr: [u8; 8],
        /// Recommended arbitration burst.
        pub rab: u8,
        /// IEEE OUI.
        pub ieee: [u8; 3],
        /// Controller multi-path I/O and namespace sharing capabilities.
        pub cmic: u8,
        /// Maximum data transfer size, a power of two in units of CAP.MPSMIN.
        pub mdts: u8,
        /// Controller ID.
        pub cntlid: U16,
        /// Version.
        pub ver: U32,
        /// RTD3 resume latency.
        pub rtd3r: U32,
        /// RTD3 entry latency.
        pub rtd3e: U32,
        /// Optional asynchronous events supported.
        pub oaes: U32,
        /// Controller attributes.
        pub ctratt: U32,
        /// Read recovery levels supported.
        pub rrls: U16,
        /// Reserved.
        pub rsvd102: [u8; 9],
        /// Controller type: 1 I/O, 2 discovery, 3 administrative.
        pub cntrltype: u8,
        /// FRU globally unique identifier.
        pub fguid: [u8; 16],
        /// Command retry delay times.
        pub crdt: [U16; 3],
        /// Reserved.
        pub rsvd134: [u8; 122],
        /// Optional admin command support.
        pub oacs: U16,
        /// Abort command limit, 0's based.
        pub acl: u8,
        /// Asynchronous event request limit, 0's based.
        pub aerl: u8,
        /// Firmware updates.
        pub frmw: u8,
        /// Log page attributes.
        pub lpa: u8,
        /// Error log page entries, 0's based.
        pub elpe: u8,
        /// Number of power states support, 0's based.
        pub npss: u8,
        /// Admin vendor specific command configuration.
        pub avscc: u8,
        /// Autonomous power state transition attributes.
        pub apsta: u8,
        /// Warning composite temperature threshold.
        pub wctemp: U16,
        /// Critical composite temperature threshold.
        pub cctemp: U16,
        /// Reserved and fields nvmfd does not fill (bytes 270 to 319).
        pub rsvd270: [u8; 50],
        /// Keep alive support, in 100 ms units.
        pub kas: U16,
        /// Reserved (bytes 322 to 511).
        pub rsvd322: [u8; 190],
        /// Submission queue entry size: required (3:0) and maximum (7:4), log2.
        pub sqes: u8,
        /// Completion queue entry size: required and maximum, log2.
        pub cqes: u8,
        /// Maximum outstanding commands.
        pub maxcmd: U16,
        /// Number of namespaces (largest valid NSID).
        pub nn: U32,
        /// Optional NVM command support.
        pub oncs: U16,
        /// Fused operation support.
        pub fuses: U16,
        /// Format NVM attributes.
        pub fna: u8,
        /// Volatile write cache.
        pub vwc: u8,
        /// Atomic write unit normal.
        pub awun: U16,
        /// Atomic write unit power fail.
        pub awupf: U16,
        /// I/O command set vendor specific command configuration.
        pub icsvscc: u8,
        /// Namespace write protection capabilities.
        pub nwpc: u8,
        /// Atomic compare and write unit.
        pub acwu: U16,
        /// Copy descriptor formats supported.
        pub cdfs: U16,
        /// SGL support.
        pub sgls: U32,
        /// Maximum number of allowed namespaces.
        pub mnan: U32,
        /// Reserved (bytes 544 to 767).
        pub rsvd544: [u8; 224],
        /// NVM subsystem NQN, NUL-padded.
        pub subnqn: [u8; 256],
        /// Reserved (bytes 1024 to 1791).
        pub rsvd1024: [u8; 768],
        /// I/O queue command capsule supported size, in 16-byte units.
        pub ioccsz: U32,
        /// I/O queue response capsule supported size, in 16-byte units.
        pub iorcsz: U32,
        /// In-capsule data offset, in 16-byte units.
        pub icdoff: U16,
        /// Fabrics controller attributes.
        pub fcatt: u8,
        /// Maximum SGL data block descriptors.
        pub msdbd: u8,
        /// Optional fabrics commands supported.
        pub ofcs: U16,
        /// Reserved (bytes 1806 to 2047).
        pub rsvd1806: [u8; 242],
        /// Power state descriptors.
        pub psd: [PowerState; 32],
        /// Vendor specific.
        pub vs: [u8; 1024],
    }
}

wire! {
    /// LBA format descriptor: 4 bytes.
    pub struct LbaFormat {
        /// Metadata size.
        pub ms: U16,
        /// LBA data size, log2.
        pub lbads: u8,
        /// Relative performance.
        pub rp: u8,
    }
}

wire! {
    /// Identify Namespace data structure (CNS 00h): 4096 bytes.
    pub struct IdentifyNamespace {
        /// Namespace size, in logical blocks.
        pub nsze: U64,
        /// Namespace capacity.
        pub ncap: U64,
        /// Namespace utilization.
        pub nuse: U64,
        /// Namespace features.
        pub nsfeat: u8,
        /// Number of LBA formats, 0's based.
        pub nlbaf: u8,
        /// Formatted LBA size.
        pub flbas: u8,
        /// Metadata capabilities.
        pub mc: u8,
        /// End-to-end data protection capabilities.
        pub dpc: u8,
        /// End-to-end data protection type settings.
        pub dps: u8,
        /// Namespace multi-path I/O and sharing capabilities.
        pub nmic: u8,
        /// Reservation capabilities.
        pub rescap: u8,
        /// Format progress indicator.
        pub fpi: u8,
        /// Deallocate logical block features.
        pub dlfeat: u8,
        /// Namespace atomic write unit normal.
        pub nawun: U16,
        /// Namespace atomic write unit power fail.
        pub nawupf: U16,
        /// Namespace atomic compare and write unit.
        pub nacwu: U16,
        /// Namespace atomic boundary size normal.
        pub nabsn: U16,
        /// Namespace atomic boundary offset.
        pub nabo: U16,
        /// Namespace atomic boundary size power fail.
        pub nabspf: U16,
        /// Namespace optimal I/O boundary.
        pub noiob: U16,
        /// NVM capacity, bytes.
        pub nvmcap: [u8; 16],
        /// Namespace preferred write granularity, 0's based.
        pub npwg: U16,
        /// Namespace preferred write alignment, 0's based.
        pub npwa: U16,
        /// Namespace preferred deallocate granularity, 0's based.
        pub npdg: U16,
        /// Namespace preferred deallocate alignment, 0's based.
        pub npda: U16,
        /// Namespace optimal write size, 0's based.
        pub nows: U16,
        /// Reserved and fields nvmfd does not fill (bytes 74 to 91).
        pub rsvd74: [u8; 18],
        /// ANA group identifier.
        pub anagrpid: U32,
        /// Reserved.
        pub rsvd96: [u8; 3],
        /// Namespace attributes (bit 0: write protected).
        pub nsattr: u8,
        /// NVM set identifier.
        pub nvmsetid: U16,
        /// Endurance group identifier.
        pub endgid: U16,
        /// Namespace globally unique identifier.
        pub nguid: [u8; 16],
        /// IEEE extended unique identifier.
        pub eui64: [u8; 8],
        /// LBA formats.
        pub lbaf: [LbaFormat; 64],
        /// Vendor specific.
        pub vs: [u8; 3712],
    }
}

wire! {
    /// I/O Command Set specific Identify Controller data structure for the NVM command set
    /// (CNS 06h, CSI 00h; NVM Command Set 1.0, "I/O Command Set Specific Identify Controller
    /// Data Structure"): 4096 bytes. Linux reads it as `struct nvme_id_ctrl_nvm`.
    pub struct IdentifyControllerNvm {
        /// Verify size limit (a power of two in units of CAP.MPSMIN; 0: none reported).
        pub vsl: u8,
        /// Write zeroes size limit (same units).
        pub wzsl: u8,
        /// Write uncorrectable size limit (same units).
        pub wusl: u8,
        /// Dataset Management ranges limit: ranges processed per command (1's based).
        pub dmrl: u8,
        /// Dataset Management range size limit: logical blocks processed per range.
        pub dmrsl: U32,
        /// Dataset Management size limit: logical blocks processed per command.
        pub dmsl: U64,
        /// Reserved (bytes 16 to 4095).
        pub rsvd16: [u8; 4080],
    }
}

/// Identify CNS values.
pub mod cns {
    /// Identify Namespace.
    pub const NAMESPACE: u8 = 0x00;
    /// Identify Controller.
    pub const CONTROLLER: u8 = 0x01;
    /// Active namespace ID list.
    pub const ACTIVE_NAMESPACES: u8 = 0x02;
    /// Namespace identification descriptor list.
    pub const NS_DESCRIPTORS: u8 = 0x03;
    /// I/O Command Set specific Identify Controller (the command set in CDW11.CSI).
    pub const IO_COMMAND_SET_CONTROLLER: u8 = 0x06;
}

/// Command set identifiers (Identify CDW11 bits 31:24, namespace descriptors).
pub mod csi {
    /// NVM command set.
    pub const NVM: u8 = 0x00;
}

/// Namespace identification descriptor types (Identify CNS 03h).
pub mod nidt {
    /// IEEE EUI-64, 8 bytes.
    pub const EUI64: u8 = 1;
    /// NGUID, 16 bytes.
    pub const NGUID: u8 = 2;
    /// UUID, 16 bytes.
    pub const UUID: u8 = 3;
    /// Command set identifier, 1 byte.
    pub const CSI: u8 = 4;
}

wire! {
    /// Namespace identification descriptor header: 4 bytes, followed by NIDL bytes.
    pub struct NsIdDescHeader {
        /// Type.
        pub nidt: u8,
        /// Length of the identifier.
        pub nidl: u8,
        /// Reserved.
        pub rsvd: [u8; 2],
    }
}
