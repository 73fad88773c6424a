//! Throughput of the entropy coders on 64 MiB, each next to a memcpy of the same 64 MiB.
//!
//! Throughput is counted in bytes of the *uncompressed* side, as in `kernels.rs`: the u32
//! indices a Rice stream codes (DCT positions: sets of k of C = 4096), the u8
//! exponents a Huffman stream codes, the u64 values an Elias stream codes. The target
//! for the index stream is at least 0.25× memcpy. Run with
//! `cargo bench -p gradwire-core --bench entropy` (add `-- --quick` for a short run).

use std::hint::black_box;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use gradwire_core::*;

const MIB: usize = 1 << 20;
const SIZE: usize = 64 * MIB;
const CHUNK: u64 = 4096;

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

/// Sets of `k` distinct sorted positions of `CHUNK`, filling 64 MiB of u32.
fn index_sets(k: usize, rng: &mut Rng) -> Vec<u32> {
    let n = SIZE / 4 / k * k;
    let mut out = Vec::with_capacity(n);
    let mut seen = vec![0u32; CHUNK as usize];
    let mut stamp = 0u32;
    while out.len() < n {
        stamp += 1;
        let start = out.len();
        while out.len() - start < k {
            let v = (rng.next() % CHUNK) as usize;
            if seen[v] != stamp {
                seen[v] = stamp;
                out.push(v as u32);
            }
        }
        out[start..].sort_unstable();
    }
    out
}

fn indices(c: &mut Criterion) {
    run(c, indices_impl)
}

fn indices_impl(c: &mut Criterion) -> Result<()> {
    let mut g = group(c, "index_sets_64MiB_of_u32_C4096");
    memcpy(&mut g);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for k in [4usize, 32, 256] {
        let idx = index_sets(k, &mut rng);
        let (param, _) = rice_param(&idx, k, CHUNK)?;
        let enc = rice_encode(&idx, k, CHUNK, param)?;
        let mut buf = Vec::new();
        g.bench_function(format!("rice_encode_k{k}"), |b| {
            b.iter(|| rice_encode_into(black_box(&idx), k, CHUNK, param, &mut buf).is_ok())
        });
        let mut out = vec![0u32; idx.len()];
        rice_decode_into(&enc, k, CHUNK, param, &mut out)?;
        assert!(out == idx, "rice_decode does not invert rice_encode");
        g.bench_function(format!("rice_decode_k{k}"), |b| {
            b.iter(|| rice_decode_into(black_box(&enc), k, CHUNK, param, &mut out).is_ok())
        });
    }
    g.finish();
    Ok(())
}

fn exponents(c: &mut Criterion) {
    run(c, exponents_impl)
}

fn exponents_impl(c: &mut Criterion) -> Result<()> {
    let mut g = group(c, "huffman_64MiB_of_exponents");
    memcpy(&mut g);
    // Exponents of roughly normal gradients: a peak near 2^-10 spread over a few octaves.
    let mut rng = Rng(0x1234_5678);
    let symbols: Vec<u8> = (0..SIZE)
        .map(|_| {
            let r = rng.next();
            let spread = (r & 0xF).count_ones() + ((r >> 4) & 0xF).count_ones();
            (110 + spread) as u8
        })
        .collect();
    let book = HuffmanBook::from_counts(&byte_counts(&symbols), 12)?;
    let enc = book.encode(&symbols)?;
    g.bench_function("count_and_build_book", |b| {
        b.iter(|| HuffmanBook::from_counts(&byte_counts(black_box(&symbols)), 12).is_ok())
    });
    g.bench_function("huffman_encode", |b| {
        b.iter(|| book.encode(black_box(&symbols)).map(|v| v.len()))
    });
    g.bench_function("huffman_decode", |b| {
        b.iter(|| book.decode(black_box(&enc), SIZE).map(|v| v.len()))
    });
    g.finish();
    Ok(())
}

fn elias(c: &mut Criterion) {
    run(c, elias_impl)
}

fn elias_impl(c: &mut Criterion) -> Result<()> {
    let mut g = group(c, "elias_64MiB_of_u64");
    memcpy(&mut g);
    let mut rng = Rng(0xABCD_EF01);
    // Small values, as QSGD's gaps and levels: geometric-ish up to a few thousand.
    let values: Vec<u64> = (0..SIZE / 8)
        .map(|_| 1 + ((rng.next() % 4096) >> (rng.next() % 12)))
        .collect();
    for kind in [EliasKind::Gamma, EliasKind::Omega] {
        let enc = elias_encode(&values, kind)?;
        g.bench_function(format!("{kind:?}_encode"), |b| {
            b.iter(|| elias_encode(black_box(&values), kind).map(|v| v.len()))
        });
        g.bench_function(format!("{kind:?}_decode"), |b| {
            b.iter(|| elias_decode(black_box(&enc), values.len(), kind).map(|v| v.len()))
        });
    }
    g.finish();
    Ok(())
}

criterion_group!(benches, indices, exponents, elias);
criterion_main!(benches);
