//! The log pages' structures: the error log entry, SMART / health information, and the
//! discovery log's header and entries.

use super::*;

wire! {
    /// Error information log entry: 64 bytes.
    pub struct ErrorLogEntry {
        /// Error count.
        pub error_count: U64,
        /// Submission queue ID.
        pub sqid: U16,
        /// Command ID.
        pub cid: U16,
        /// Status field.
        pub status: U16,
        /// Parameter error location.
        pub param_error_location: U16,
        /// LBA.
        pub lba: U64,
        /// Namespace.
        pub nsid: U32,
        /// Vendor specific information available.
        pub vs: u8,
        /// Transport type.
        pub trtype: u8,
        /// Reserved.
        pub rsvd30: [u8; 2],
        /// Command specific information.
        pub csi: U64,
        /// Transport type specific information.
        pub trtype_specific: U16,
        /// Reserved.
        pub rsvd42: [u8; 22],
    }
}

wire! {
    /// SMART / Health information log: 512 bytes.
    pub struct SmartLog {
        /// Critical warning.
        pub critical_warning: u8,
        /// Composite temperature, kelvin.
        pub temperature: U16,
        /// Available spare, percent.
        pub avail_spare: u8,
        /// Available spare threshold, percent.
        pub spare_thresh: u8,
        /// Percentage used.
        pub percent_used: u8,
        /// Endurance group critical warning summary.
        pub endu_grp_crit_warn_sumry: u8,
        /// Reserved.
        pub rsvd7: [u8; 25],
        /// Data units read (thousands of 512-byte units).
        pub data_units_read: U128,
        /// Data units written.
        pub data_units_written: U128,
        /// Host read commands.
        pub host_reads: U128,
        /// Host write commands.
        pub host_writes: U128,
        /// Controller busy time, minutes.
        pub ctrl_busy_time: [u8; 16],
        /// Power cycles.
        pub power_cycles: [u8; 16],
        /// Power on hours.
        pub power_on_hours: [u8; 16],
        /// Unsafe shutdowns.
        pub unsafe_shutdowns: [u8; 16],
        /// Media and data integrity errors.
        pub media_errors: [u8; 16],
        /// Number of error information log entries.
        pub num_err_log_entries: [u8; 16],
        /// The rest (bytes 192 to 511).
        pub rest: [u8; 320],
    }
}

wire! {
    /// Discovery log page header: 1024 bytes, followed by the entries.
    pub struct DiscoveryLogHeader {
        /// Generation counter: changes whenever the log changes.
        pub genctr: U64,
        /// Number of records.
        pub numrec: U64,
        /// Record format, 0.
        pub recfmt: U16,
        /// Reserved.
        pub rsvd18: [u8; 1006],
    }
}

wire! {
    /// Discovery log page entry: 1024 bytes.
    pub struct DiscoveryLogEntry {
        /// Transport type (1 = RDMA).
        pub trtype: u8,
        /// Address family (1 = IPv4, 2 = IPv6).
        pub adrfam: u8,
        /// Subsystem type (1 = referral/discovery, 2 = NVM, 3 = current discovery).
        pub subtype: u8,
        /// Transport requirements.
        pub treq: u8,
        /// Port ID.
        pub portid: U16,
        /// Controller ID (0xFFFF: dynamic).
        pub cntlid: U16,
        /// Admin max SQ size.
        pub asqsz: U16,
        /// Entry flags.
        pub eflags: U16,
        /// Reserved.
        pub rsvd12: [u8; 20],
        /// Transport service identifier (port), ASCII, space-padded.
        pub trsvcid: [u8; 32],
        /// Reserved.
        pub rsvd64: [u8; 192],
        /// Subsystem NQN, NUL-padded.
        pub subnqn: [u8; 256],
        /// Transport address, ASCII, space-padded.
        pub traddr: [u8; 256],
        /// RDMA: QP service type (1 = reliable connected).
        pub rdma_qptype: u8,
        /// RDMA: provider type (1 = none, 2 = InfiniBand, 3 = RoCE, 4 = RoCEv2, 5 = iWARP).
        pub rdma_prtype: u8,
        /// RDMA: connection management service (1 = rdma_cm).
        pub rdma_cms: u8,
        /// Reserved.
        pub rsvd771: [u8; 5],
        /// RDMA: partition key.
        pub rdma_pkey: U16,
        /// Reserved.
        pub rsvd778: [u8; 246],
    }
}
