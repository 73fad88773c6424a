//! Kernel throughput on 64 MiB, each next to a memcpy of the same 64 MiB.
//!
//! Throughput is counted in bytes of the *uncompressed* side: the u32 values packed or unpacked,
//! the i8 trits encoded or decoded, the quartic bytes zero-run encoded or decoded, the bytes
//! checksummed or framed. Run with `cargo bench -p gradwire-core` (add `-- --quick` for a short run).

use std::hint::black_box;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use gradwire_core::frame::codes;
use gradwire_core::*;

const MIB: usize = 1 << 20;
const SIZE: usize = 64 * MIB;

/// Deterministic pseudo-random numbers (xorshift), so no rand dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Runs a bench body; a setup error ends the process with its message.
fn run(c: &mut Criterion, body: fn(&mut Criterion) -> Result<()>) {
    if let Err(e) = body(c) {
        eprintln!("benchmark setup failed: {e}");
        std::process::exit(1);
    }
}

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(10);
    g.throughput(Throughput::Bytes(SIZE as u64));
    g
}

fn memcpy(g: &mut BenchmarkGroup<'_, WallTime>) {
    let src = vec![0x5Au8; SIZE];
    let mut dst = vec![0u8; SIZE];
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        })
    });
}

fn bitpack(c: &mut Criterion) {
    run(c, bitpack_impl)
}

fn bitpack_impl(c: &mut Criterion) -> Result<()> {
    let mut g = group(c, "bitpack_64MiB_of_u32");
    memcpy(&mut g);
    let n = SIZE / 4;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let raw: Vec<u32> = (0..n).map(|_| rng.next() as u32).collect();
    for bits in [1u32, 4, 8, 12, 16, 20, 32] {
        let mask = if bits == 32 {
            u32::MAX
        } else {
            (1 << bits) - 1
        };
        let values: Vec<u32> = raw.iter().map(|v| v & mask).collect();
        let mut packed = pack_bits(&values, bits)?;
        g.bench_function(format!("pack_{bits}"), |b| {
            b.iter(|| pack_bits_into(black_box(&values), bits, &mut packed).is_ok())
        });
        let mut out = vec![0u32; n];
        unpack_bits_exact_into(&packed, bits, &mut out)?;
        assert!(out == values, "unpack({bits}) does not invert pack");
        g.bench_function(format!("unpack_exact_{bits}"), |b| {
            b.iter(|| unpack_bits_exact_into(black_box(&packed), bits, &mut out).is_ok())
        });
    }
    g.finish();
    Ok(())
}

fn three_lc(c: &mut Criterion) {
    run(c, three_lc_impl)
}

fn three_lc_impl(c: &mut Criterion) -> Result<()> {
    let mut g = group(c, "3lc_64MiB");
    memcpy(&mut g);
    // Sparse trits as after 3LC quantisation: ~90% zeros.
    let mut rng = Rng(12345);
    let trits: Vec<i8> = (0..SIZE)
        .map(|_| match rng.next() % 20 {
            0 => -1,
            1 => 1,
            _ => 0,
        })
        .collect();
    let mut quartic = vec![0u8; quartic_len(SIZE)];
    g.bench_function("quartic_encode", |b| {
        b.iter(|| quartic_encode_into(black_box(&trits), &mut quartic).is_ok())
    });
    quartic_encode_into(&trits, &mut quartic)?;
    let mut decoded = vec![0i8; SIZE];
    quartic_decode_into(&quartic, &mut decoded)?;
    assert!(
        decoded == trits,
        "quartic_decode does not invert quartic_encode"
    );
    g.bench_function("quartic_decode", |b| {
        b.iter(|| quartic_decode_into(black_box(&quartic), &mut decoded).is_ok())
    });

    // Zero-run on 64 MiB of quartic bytes from trits that are 99% zeros (3LC on a typical
    // gradient: 95% of bytes are 121) and 90% zeros (a dense case: 59% of bytes are 121).
    for (label, nonzero_per_mille) in [("sparse99", 10u64), ("dense90", 100u64)] {
        let mut rng = Rng(777 + nonzero_per_mille);
        let trits: Vec<i8> = (0..SIZE * 5)
            .map(|_| {
                let r = rng.next() % 2000;
                if r < nonzero_per_mille {
                    -1
                } else if r < 2 * nonzero_per_mille {
                    1
                } else {
                    0
                }
            })
            .collect();
        let qbytes = quartic_encode(&trits)?;
        drop(trits);
        assert_eq!(qbytes.len(), SIZE);
        g.bench_function(format!("zero_run_encode_{label}"), |b| {
            b.iter(|| zero_run_encode(black_box(&qbytes)).is_ok())
        });
        let enc = zero_run_encode(&qbytes)?;
        eprintln!(
            "zero-run {label}: {} -> {} bytes ({:.1}%)",
            SIZE,
            enc.len(),
            100.0 * enc.len() as f64 / SIZE as f64
        );
        let mut out = vec![0u8; SIZE];
        zero_run_decode_into(&enc, &mut out)?;
        assert!(
            out == qbytes,
            "zero_run_decode does not invert zero_run_encode"
        );
        g.bench_function(format!("zero_run_decode_{label}"), |b| {
            b.iter(|| zero_run_decode_into(black_box(&enc), &mut out).is_ok())
        });
    }
    g.finish();
    Ok(())
}

fn crc_and_frame(c: &mut Criterion) {
    run(c, crc_and_frame_impl)
}

fn crc_and_frame_impl(c: &mut Criterion) -> Result<()> {
    let mut g = group(c, "frame_64MiB");
    memcpy(&mut g);
    let mut rng = Rng(99);
    let payload: Vec<u8> = (0..SIZE).map(|_| rng.next() as u8).collect();
    g.bench_function("crc32c", |b| b.iter(|| crc32c(black_box(&payload), 0)));
    let shape = [(SIZE / 4) as u64];
    let entry = EntrySpec {
        name: "w",
        codec: 0,
        dtype: codes::F32,
        shape: &shape,
        params: &[],
        sections: vec![("data", codes::F32, &payload)],
    };
    let header = FrameHeader::new(false, 1, 2);
    let limits = Limits::default();
    let len = frame_len(&header, std::slice::from_ref(&entry), &limits)?;
    let mut frame = vec![0u8; len];
    write_frame_into(&header, std::slice::from_ref(&entry), &limits, &mut frame)?;
    g.bench_function("write_frame_into", |b| {
        b.iter(|| {
            write_frame_into(&header, std::slice::from_ref(&entry), &limits, &mut frame).is_ok()
        })
    });
    g.bench_function("parse_frame", |b| {
        b.iter(|| parse_frame(black_box(&frame), &limits).map(|v| v.entries.len()))
    });
    g.finish();
    Ok(())
}

criterion_group!(benches, bitpack, three_lc, crc_and_frame);
criterion_main!(benches);
