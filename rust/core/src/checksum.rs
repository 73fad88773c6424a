//! CRC-32C (Castagnoli, reflected, init and xorout 0xFFFFFFFF), the frame checksum.

/// Continues a running CRC-32C: `crc32c(b, crc32c(a, 0)) == crc32c(a ++ b, 0)`.
/// Start with `init = 0`.
#[inline]
pub fn crc32c(data: &[u8], init: u32) -> u32 {
    crc32c::crc32c_append(init, data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn check_value() {
        assert_eq!(crc32c(b"123456789", 0), 0xE306_9283);
        assert_eq!(crc32c(b"", 0), 0);
    }

    #[test]
    fn append_equals_whole() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let whole = crc32c(&data, 0);
        for split in [0, 1, 7, 8, 63, 64, 4097, 9_999, 10_000] {
            let (a, b) = data.split_at(split);
            assert_eq!(crc32c(b, crc32c(a, 0)), whole, "split at {split}");
        }
    }

    proptest! {
        #[test]
        fn prop_append(a in proptest::collection::vec(any::<u8>(), 0..200),
                       b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let whole: Vec<u8> = a.iter().chain(&b).copied().collect();
            prop_assert_eq!(crc32c(&b, crc32c(&a, 0)), crc32c(&whole, 0));
        }
    }
}
