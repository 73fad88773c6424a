//! Elias-γ/ω and the sparse level stream never panic nor over-allocate; what they accept
//! re-encodes to the same bytes.
#![no_main]

use gradwire_core::{
    elias_decode, elias_encode, sparse_levels_decode, sparse_levels_encode, EliasKind,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let [k, c0, c1, m, u0, u1, data @ ..] = input else {
        return;
    };
    let kind = if k & 1 == 0 {
        EliasKind::Gamma
    } else {
        EliasKind::Omega
    };
    let count = usize::from(u16::from_le_bytes([*c0, *c1]));
    if let Ok(values) = elias_decode(data, count, kind) {
        assert_eq!(elias_encode(&values, kind).ok().as_deref(), Some(data));
    }
    let universe = u64::from(u16::from_le_bytes([*u0, *u1]));
    let max_level = u32::from(*m);
    if let Ok((positions, levels)) = sparse_levels_decode(data, count, universe, max_level, kind) {
        assert!(positions.iter().all(|&p| p < universe));
        assert!(levels
            .iter()
            .all(|&l| l != 0 && l.unsigned_abs() <= max_level));
        assert_eq!(
            sparse_levels_encode(&positions, &levels, kind)
                .ok()
                .as_deref(),
            Some(data)
        );
    }
});
