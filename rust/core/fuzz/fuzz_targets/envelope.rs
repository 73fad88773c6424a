//! A valid frame envelope around fuzzed bytes, shared by the frame targets (`#[path]`-included): arbitrary
//! bytes almost never pass the CRC, so a target wraps half its inputs in magic, version, `total_len` and a
//! CRC-32C fixed up around them.

use gradwire_core::crc32c;

/// `GWIR`, version 1, then the input's first 26 bytes as the rest of the header (flags, `total_len`,
/// round, sender, entry count; `total_len` overwritten, the flags' low byte passed through `flags`, the
/// high byte cleared), the rest of the input as the records, and the CRC.
pub fn with_envelope(input: &[u8], flags: impl Fn(u8) -> u8) -> Vec<u8> {
    let mut f = Vec::with_capacity(input.len() + 36);
    f.extend_from_slice(b"GWIR");
    f.extend_from_slice(&1u16.to_le_bytes());
    let (head, records) = input.split_at(input.len().min(26));
    f.extend_from_slice(head);
    f.resize(32, 0);
    f[6] = flags(f[6]);
    f[7] = 0;
    f.extend_from_slice(records);
    f.extend_from_slice(&[0; 4]);
    let n = f.len();
    f[8..16].copy_from_slice(&(n as u64).to_le_bytes());
    let crc = crc32c(&f[..n - 4], 0);
    f[n - 4..].copy_from_slice(&crc.to_le_bytes());
    f
}
