//! Every wire structure's size and every field's offset, against the specifications' tables
//! (NVMe Base 2.0, NVMe over Fabrics 1.1, NVMe/RDMA transport binding).

// Sizes and counters in this file are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::mem::{offset_of, size_of};

use nvmfd_nvme::wire::*;

macro_rules! layout {
    ($t:ty, size $size:expr; $($field:ident @ $off:expr, $len:expr;)*) => {{
        assert_eq!(size_of::<$t>(), $size, "size of {}", stringify!($t));
        $(
            assert_eq!(offset_of!($t, $field), $off, "{}.{} offset", stringify!($t), stringify!($field));
            let v: $t = zeroed();
            assert_eq!(std::mem::size_of_val(&v.$field), $len, "{}.{} size", stringify!($t), stringify!($field));
        )*
    }};
}

#[test]
fn submission_and_completion_entries() {
    layout!(Sqe, size 64;
        opcode @ 0, 1; flags @ 1, 1; cid @ 2, 2; nsid @ 4, 4; cdw2 @ 8, 4; cdw3 @ 12, 4;
        mptr @ 16, 8; dptr @ 24, 16; cdw10 @ 40, 4; cdw11 @ 44, 4; cdw12 @ 48, 4;
        cdw13 @ 52, 4; cdw14 @ 56, 4; cdw15 @ 60, 4;);
    layout!(Cqe, size 16; dw0 @ 0, 4; dw1 @ 4, 4; sqhd @ 8, 2; sqid @ 10, 2; cid @ 12, 2; status @ 14, 2;);
    layout!(SglDesc, size 16; addr @ 0, 8; body @ 8, 7; id @ 15, 1;);
}

#[test]
fn sgl_descriptors_encode_as_the_transport_binding_says() {
    let k = SglDesc::keyed(0x1122_3344_5566_7788, 0x00ab_cdef, 0xdead_beef, true);
    let b = zerocopy::IntoBytes::as_bytes(&k).to_vec();
    assert_eq!(&b[0..8], &0x1122_3344_5566_7788u64.to_le_bytes());
    assert_eq!(&b[8..11], &[0xef, 0xcd, 0xab], "24-bit length");
    assert_eq!(&b[11..15], &0xdead_beefu32.to_le_bytes(), "key");
    assert_eq!(b[15], 0x4F, "keyed data block, invalidate key");
    assert_eq!(
        k.decode(),
        Sgl::Keyed {
            addr: 0x1122_3344_5566_7788,
            len: 0xabcdef,
            key: 0xdead_beef,
            invalidate: true
        }
    );
    let ic = SglDesc::in_capsule(16, 4096);
    let b = zerocopy::IntoBytes::as_bytes(&ic).to_vec();
    assert_eq!(&b[8..12], &4096u32.to_le_bytes());
    assert_eq!(b[15], 0x01, "data block, offset subtype");
    assert_eq!(
        ic.decode(),
        Sgl::InCapsule {
            offset: 16,
            len: 4096
        }
    );
    let mut other = ic;
    other.id = 0x50; // last segment descriptor
    assert_eq!(other.decode(), Sgl::Unsupported { id: 0x50 });
}

#[test]
fn fabrics_commands_and_connect_data() {
    layout!(FabricsCmd, size 64; opcode @ 0, 1; cid @ 2, 2; fctype @ 4, 1; dptr @ 24, 16; specific @ 40, 24;);
    layout!(ConnectCmd, size 64;
        fctype @ 4, 1; dptr @ 24, 16; recfmt @ 40, 2; qid @ 42, 2; sqsize @ 44, 2; cattr @ 46, 1; kato @ 48, 4;);
    layout!(ConnectData, size 1024; hostid @ 0, 16; cntlid @ 16, 2; subnqn @ 256, 256; hostnqn @ 512, 256;);
    layout!(PropertySetCmd, size 64; fctype @ 4, 1; attrib @ 40, 1; offset @ 44, 4; value @ 48, 8;);
    layout!(PropertyGetCmd, size 64; fctype @ 4, 1; attrib @ 40, 1; offset @ 44, 4;);
    layout!(DsmRange, size 16; cattr @ 0, 4; nlb @ 4, 4; slba @ 8, 8;);
}

#[test]
fn rdma_cm_private_data() {
    layout!(RdmaCmRequest, size 32; recfmt @ 0, 2; qid @ 2, 2; hrqsize @ 4, 2; hsqsize @ 6, 2; cntlid @ 8, 2;);
    layout!(RdmaCmAccept, size 32; recfmt @ 0, 2; crqsize @ 2, 2;);
    layout!(RdmaCmReject, size 4; recfmt @ 0, 2; sts @ 2, 2;);
}

#[test]
fn identify_controller() {
    layout!(IdentifyController, size 4096;
        vid @ 0, 2; ssvid @ 2, 2; sn @ 4, 20; mn @ 24, 40; fr @ 64, 8; rab @ 72, 1; ieee @ 73, 3;
        cmic @ 76, 1; mdts @ 77, 1; cntlid @ 78, 2; ver @ 80, 4; rtd3r @ 84, 4; rtd3e @ 88, 4;
        oaes @ 92, 4; ctratt @ 96, 4; rrls @ 100, 2; cntrltype @ 111, 1; fguid @ 112, 16; crdt @ 128, 6;
        oacs @ 256, 2; acl @ 258, 1; aerl @ 259, 1; frmw @ 260, 1; lpa @ 261, 1; elpe @ 262, 1;
        npss @ 263, 1; avscc @ 264, 1; apsta @ 265, 1; wctemp @ 266, 2; cctemp @ 268, 2; kas @ 320, 2;
        sqes @ 512, 1; cqes @ 513, 1; maxcmd @ 514, 2; nn @ 516, 4; oncs @ 520, 2; fuses @ 522, 2;
        fna @ 524, 1; vwc @ 525, 1; awun @ 526, 2; awupf @ 528, 2; icsvscc @ 530, 1; nwpc @ 531, 1;
        acwu @ 532, 2; cdfs @ 534, 2; sgls @ 536, 4; mnan @ 540, 4; subnqn @ 768, 256;
        ioccsz @ 1792, 4; iorcsz @ 1796, 4; icdoff @ 1800, 2; fcatt @ 1802, 1; msdbd @ 1803, 1;
        ofcs @ 1804, 2; psd @ 2048, 1024; vs @ 3072, 1024;);
    layout!(PowerState, size 32; mp @ 0, 2; flags @ 3, 1; enlat @ 4, 4; exlat @ 8, 4;);
}

#[test]
fn identify_controller_nvm_command_set() {
    // NVM Command Set 1.0: VSL 0, WZSL 1, WUSL 2, DMRL 3, DMRSL 7:04, DMSL 15:08; as Linux's
    // struct nvme_id_ctrl_nvm.
    layout!(IdentifyControllerNvm, size 4096;
        vsl @ 0, 1; wzsl @ 1, 1; wusl @ 2, 1; dmrl @ 3, 1; dmrsl @ 4, 4; dmsl @ 8, 8;
        rsvd16 @ 16, 4080;);
}

#[test]
fn identify_namespace() {
    layout!(IdentifyNamespace, size 4096;
        nsze @ 0, 8; ncap @ 8, 8; nuse @ 16, 8; nsfeat @ 24, 1; nlbaf @ 25, 1; flbas @ 26, 1; mc @ 27, 1;
        dpc @ 28, 1; dps @ 29, 1; nmic @ 30, 1; rescap @ 31, 1; fpi @ 32, 1; dlfeat @ 33, 1;
        nawun @ 34, 2; nawupf @ 36, 2; nacwu @ 38, 2; nabsn @ 40, 2; nabo @ 42, 2; nabspf @ 44, 2;
        noiob @ 46, 2; nvmcap @ 48, 16; npwg @ 64, 2; npwa @ 66, 2; npdg @ 68, 2; npda @ 70, 2;
        nows @ 72, 2; anagrpid @ 92, 4; nsattr @ 99, 1; nvmsetid @ 100, 2; endgid @ 102, 2;
        nguid @ 104, 16; eui64 @ 120, 8; lbaf @ 128, 256; vs @ 384, 3712;);
    layout!(LbaFormat, size 4; ms @ 0, 2; lbads @ 2, 1; rp @ 3, 1;);
    layout!(NsIdDescHeader, size 4; nidt @ 0, 1; nidl @ 1, 1;);
}

#[test]
fn log_pages() {
    layout!(ErrorLogEntry, size 64;
        error_count @ 0, 8; sqid @ 8, 2; cid @ 10, 2; status @ 12, 2; param_error_location @ 14, 2;
        lba @ 16, 8; nsid @ 24, 4; vs @ 28, 1; trtype @ 29, 1; csi @ 32, 8; trtype_specific @ 40, 2;);
    layout!(SmartLog, size 512;
        critical_warning @ 0, 1; temperature @ 1, 2; avail_spare @ 3, 1; spare_thresh @ 4, 1;
        percent_used @ 5, 1; data_units_read @ 32, 16; data_units_written @ 48, 16;
        host_reads @ 64, 16; host_writes @ 80, 16; ctrl_busy_time @ 96, 16; power_cycles @ 112, 16;
        power_on_hours @ 128, 16; unsafe_shutdowns @ 144, 16; media_errors @ 160, 16;
        num_err_log_entries @ 176, 16;);
    layout!(DiscoveryLogHeader, size 1024; genctr @ 0, 8; numrec @ 8, 8; recfmt @ 16, 2;);
    layout!(DiscoveryLogEntry, size 1024;
        trtype @ 0, 1; adrfam @ 1, 1; subtype @ 2, 1; treq @ 3, 1; portid @ 4, 2; cntlid @ 6, 2;
        asqsz @ 8, 2; eflags @ 10, 2; trsvcid @ 32, 32; subnqn @ 256, 256; traddr @ 512, 256;
        rdma_qptype @ 768, 1; rdma_prtype @ 769, 1; rdma_cms @ 770, 1; rdma_pkey @ 776, 2;);
}

#[test]
fn status_fields_pack_as_the_completion_says() {
    let s = status::LBA_OUT_OF_RANGE;
    assert_eq!((s.sct(), s.sc(), s.dnr()), (0, 0x80, true));
    let s = status::CONNECT_INVALID_HOST;
    assert_eq!((s.sct(), s.sc()), (1, 0x84));
    assert_eq!(status::UNRECOVERED_READ_ERROR.sct(), 2);
    let c = Cqe {
        status: zerocopy::little_endian::U16::new(status::INVALID_FIELD.0 << 1 | 1),
        ..zeroed()
    };
    assert!(
        c.status().same_code(status::INVALID_FIELD),
        "the phase bit is not part of the status"
    );
}

#[test]
fn parsing_short_input_fails_instead_of_reading_past_it() {
    assert!(read::<Sqe>(&[0u8; 63]).is_none());
    assert!(read::<ConnectData>(&[0u8; 1023]).is_none());
    assert!(read::<IdentifyController>(&[]).is_none());
    assert!(read::<Sqe>(&[0u8; 64]).is_some());
    assert_eq!(get_str(b"abc\0\0\0"), Some("abc"));
    assert_eq!(get_str(b"abc   "), Some("abc"));
    assert_eq!(get_str(&[0xff, 0xfe]), None);
    let mut f = [0u8; 4];
    put_str(&mut f, "toolong", b' ');
    assert_eq!(&f, b"tool");
}
