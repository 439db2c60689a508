//! Buffer classes: the data buffer a command may need, told from its SGL before admission.

/// The data buffer a command may need, told from its SGL before it is admitted: each
/// admitted command has one of its class kept for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Class {
    Small = 0,
    Large = 1,
}

impl Class {
    /// The class of a command whose SGL descriptor (SQE bytes 24..40) is `sgl`, with small
    /// buffers of `small` bytes: by the length a data block or keyed data block gives;
    /// large for a segment (the data's length is in the list) or anything else.
    pub(super) fn of(sgl: &[u8; 16], small: u32) -> Class {
        let len = match sgl[15] >> 4 {
            nvmfd_nvme::wire::sgl::TYPE_DATA_BLOCK => {
                u32::from_le_bytes([sgl[8], sgl[9], sgl[10], sgl[11]])
            }
            nvmfd_nvme::wire::sgl::TYPE_KEYED_DATA_BLOCK => {
                u32::from_le_bytes([sgl[8], sgl[9], sgl[10], 0])
            }
            _ => return Class::Large,
        };
        if len <= small {
            Class::Small
        } else {
            Class::Large
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Class;

    fn keyed(len: u32, key: u32) -> [u8; 16] {
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&0x1000u64.to_le_bytes());
        d[8..11].copy_from_slice(&len.to_le_bytes()[..3]);
        d[11..15].copy_from_slice(&key.to_le_bytes());
        d[15] = 0x4F;
        d
    }

    #[test]
    fn a_command_is_small_by_its_sgl_length_and_large_when_the_length_is_in_a_list() {
        // The key's bytes follow the 3-byte length: they must not be read as length.
        assert_eq!(Class::of(&keyed(4096, 0xFFFF_FFFF), 8192), Class::Small);
        assert_eq!(Class::of(&keyed(8192, 7), 8192), Class::Small);
        assert_eq!(Class::of(&keyed(8193, 7), 8192), Class::Large);
        assert_eq!(Class::of(&keyed(128 * 1024, 0), 8192), Class::Large);
        assert_eq!(Class::of(&keyed(0, 0), 8192), Class::Small);
        let mut icd = [0u8; 16];
        icd[8..12].copy_from_slice(&4096u32.to_le_bytes());
        icd[15] = 0x01;
        assert_eq!(Class::of(&icd, 8192), Class::Small);
        icd[8..12].copy_from_slice(&16384u32.to_le_bytes());
        assert_eq!(Class::of(&icd, 8192), Class::Large);
        let mut list = keyed(64, 0);
        list[15] = 0x31;
        assert_eq!(
            Class::of(&list, 8192),
            Class::Large,
            "a last segment's data may be large"
        );
        let mut odd = keyed(16, 0);
        odd[15] = 0x20;
        assert_eq!(Class::of(&odd, 8192), Class::Large);
    }
}
