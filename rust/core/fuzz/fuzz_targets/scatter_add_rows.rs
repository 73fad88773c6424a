//! scatter_add_rows (the transform-domain sum of DCT records: each sender's sparse rows added into
//! the dense sum) never panics on any positions, values, row sizes or weight, writes nothing when it
//! refuses, and where it accepts equals `out[r · row_len + p] += values[j] · weight` done plainly.
#![no_main]

use gradwire_core::scatter_add_rows;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let [k, n, w, o, data @ ..] = input else {
        return;
    };
    let (k, row_len) = (usize::from(*k % 9), usize::from(*n % 17));
    let weight = f32::from(*w as i8) / 16.0;
    let (pos, vals) = data.split_at(data.len() / 2);
    let positions: Vec<i64> = pos.iter().map(|&b| i64::from(b) - 8).collect();
    // one value too few now and then: the length check
    let values: Vec<f32> = vals
        .iter()
        .take(positions.len().saturating_sub(usize::from(*o >= 250)))
        .map(|&b| f32::from(b as i8) * 0.375)
        .collect();
    let rows = if k == 0 { 0 } else { positions.len() / k };
    let len = (rows * row_len).saturating_add_signed(isize::from(*o % 3) - 1);
    let before: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
    let mut out = before.clone();
    if scatter_add_rows(&positions, &values, k, row_len, weight, &mut out).is_err() {
        assert_eq!(out, before, "a refused scatter wrote");
        return;
    }
    let mut want = before;
    if k > 0 {
        for (j, (&p, &v)) in positions.iter().zip(&values).enumerate() {
            let at = j / k * row_len + p as usize;
            want[at] += v * weight;
        }
    }
    assert_eq!(
        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
});
