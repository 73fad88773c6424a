//! GComp's field coding (FORMAT.md section 5.4; Li et al., SoCC'24): the encoder's per-element
//! work, each in one pass over the gradient's f32 bit patterns.
//!
//! * [`exponent_counts`]: the histogram of the biased exponents, from which the caller picks the
//!   Huffman codebook (FORMAT.md section 6.4);
//! * [`block_levels`]: per block, the largest mantissa level the quantization metric δ of the
//!   paper's Table 2 allows, δ computed in f64 operation for operation as gradwire's torch code
//!   (`python/gradwire/codecs/gcomp.py`, `quantization_metric` and `block_levels`) computes it, so
//!   both give the same levels bit for bit;
//! * [`encode`]: the `exp`, `level`, `sign` and `mant` sections and the values a receiver decodes.
//!
//! Inputs are f32 bit patterns (`u32`): an element with biased exponent 0 (zero or denormal) is
//! pruned; exponent 255 (infinity, NaN) cannot be sent. Format 1 (bf16) codes the top 7 mantissa
//! bits of each f32 (the bf16's own mantissa).

use crate::bitio::Sink;
use crate::error::{Result, WireError};
use crate::huffman::HuffmanBook;

/// Mantissa levels per block (2 bits each).
pub const LEVELS: usize = 4;

/// Which mantissa a record codes (the record's `format` parameter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldFormat {
    /// Format 0: the f32's 23 mantissa bits; levels drop 0, 6, 12 or 18.
    F32,
    /// Format 1: the bf16's 7 mantissa bits (the f32's top 7); levels drop 0, 2, 4 or 6.
    Bf16,
}

impl FieldFormat {
    /// The format of a record's `format` code (0 or 1).
    pub fn from_code(code: u8) -> Result<Self> {
        match code {
            0 => Ok(FieldFormat::F32),
            1 => Ok(FieldFormat::Bf16),
            _ => Err(WireError::InvalidFieldFormat { format: code }),
        }
    }

    /// Mantissa bits `W` of an element.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            FieldFormat::F32 => 23,
            FieldFormat::Bf16 => 7,
        }
    }

    /// Low mantissa bits each level drops.
    pub const fn drops(self) -> [u32; LEVELS] {
        match self {
            FieldFormat::F32 => [0, 6, 12, 18],
            FieldFormat::Bf16 => [0, 2, 4, 6],
        }
    }
}

/// The biased exponent of an f32 bit pattern (0 for zeros and denormals).
#[inline(always)]
fn exponent(bits: u32) -> usize {
    ((bits >> 23) & 0xFF) as usize
}

/// Blocks of `block` elements over `count` elements (the last one may be shorter).
pub fn num_blocks(count: usize, block: usize) -> Result<usize> {
    if block == 0 {
        return Err(WireError::InvalidBlockSize { block });
    }
    Ok(count.div_ceil(block))
}

/// How many elements have each biased exponent (index 0: zeros and denormals; 255: infinities
/// and NaNs, which [`encode`] refuses).
pub fn exponent_counts(bits: &[u32]) -> [u64; 256] {
    // Four interleaved tables break the store-to-load dependency of runs of one exponent.
    let mut c = [[0u64; 256]; 4];
    let chunks = bits.chunks_exact(4);
    let tail = chunks.remainder();
    for q in chunks {
        c[0][exponent(q[0])] += 1;
        c[1][exponent(q[1])] += 1;
        c[2][exponent(q[2])] += 1;
        c[3][exponent(q[3])] += 1;
    }
    for &b in tail {
        c[0][exponent(b)] += 1;
    }
    let mut out = [0u64; 256];
    for (e, slot) in out.iter_mut().enumerate() {
        *slot = c[0][e] + c[1][e] + c[2][e] + c[3][e];
    }
    out
}

// ------------------------------------------------------------------------------------ levels

/// The optimizer whose update δ (paper, Table 2) measures, with the scalars its formula uses
/// (torch.optim names). Step-dependent scalars come computed: `bias_correction1` is
/// `1 − β1^t` and Adagrad's `lr` is the decayed `lr / (1 + (t − 1)·lr_decay)`, so that every
/// power is taken once, by the caller, the same way for both implementations.
///
/// State per element: `first` is `momentum_buffer` (Momentum, Nesterov), `sum` (Adagrad),
/// `square_avg` (RMSProp) or `exp_avg` (Adam, AdamW); `second` is `exp_avg_sq` (Adam, AdamW).
/// Missing state is zeros, as before a first step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Metric {
    Sgd {
        lr: f64,
        weight_decay: f64,
    },
    Momentum {
        lr: f64,
        weight_decay: f64,
        momentum: f64,
        dampening: f64,
    },
    Nesterov {
        lr: f64,
        weight_decay: f64,
        momentum: f64,
    },
    Adagrad {
        lr: f64,
        weight_decay: f64,
        eps: f64,
    },
    Rmsprop {
        lr: f64,
        weight_decay: f64,
        alpha: f64,
        eps: f64,
    },
    Adam {
        lr: f64,
        weight_decay: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        bias_correction1: f64,
    },
    Adamw {
        lr: f64,
        weight_decay: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        bias_correction1: f64,
    },
}

/// Runs `$body` with `$delta` bound to δ of `$metric` as a closure `(g, θ, first, second) -> δ`
/// over f64, one monomorphised copy of `$body` per optimizer, so the per-element loop holds no
/// dispatch. The scalar factors are computed once, in the order the torch code computes them
/// (Python evaluates `eta * mu * b` as `(eta * mu) * b`: a scalar product, then the tensor one);
/// each comment is the torch expression.
macro_rules! with_delta {
    ($metric:expr, $delta:ident => $body:expr) => {
        match *$metric {
            Metric::Sgd { lr, weight_decay } => {
                // th / (eta * g) - lam * th / g
                let $delta = move |g: f64, th: f64, _: f64, _: f64| th / (lr * g) - weight_decay * th / g;
                $body
            }
            Metric::Momentum { lr, weight_decay, momentum, dampening } => {
                // (th - eta * mu * b) / (eta * (1 - dampening) * g) - lam * th / g
                let (c1, c2) = (lr * momentum, lr * (1.0 - dampening));
                let $delta = move |g: f64, th: f64, a: f64, _: f64| (th - c1 * a) / (c2 * g) - weight_decay * th / g;
                $body
            }
            Metric::Nesterov { lr, weight_decay, momentum } => {
                // ((1 - eta * lam * (1 + mu)) * th - eta * mu * mu * b) / (eta * (1 + mu) * g)
                let c0 = 1.0 - lr * weight_decay * (1.0 + momentum);
                let (c1, c2) = (lr * momentum * momentum, lr * (1.0 + momentum));
                let $delta = move |g: f64, th: f64, a: f64, _: f64| (c0 * th - c1 * a) / (c2 * g);
                $body
            }
            Metric::Adagrad { lr, weight_decay, eps } => {
                // r = sum + (g + lam * th) ** 2; th * (r.sqrt() + eps) / (eta_t * g) - lam * th / g
                let $delta = move |g: f64, th: f64, a: f64, _: f64| {
                    let u = g + weight_decay * th;
                    let r = a + u * u;
                    th * (r.sqrt() + eps) / (lr * g) - weight_decay * th / g
                };
                $body
            }
            Metric::Rmsprop { lr, weight_decay, alpha, eps } => {
                // v = alpha * sq + (1 - alpha) * (g + lam * th) ** 2;
                // th * (v.sqrt() + eps) / (eta * g) - lam * th / g
                let c1 = 1.0 - alpha;
                let $delta = move |g: f64, th: f64, a: f64, _: f64| {
                    let u = g + weight_decay * th;
                    let v = alpha * a + c1 * (u * u);
                    th * (v.sqrt() + eps) / (lr * g) - weight_decay * th / g
                };
                $body
            }
            Metric::Adam { lr, weight_decay, beta1, beta2, eps, bias_correction1 } => {
                // v = b2 * sq + (1 - b2) * (g + lam * th) ** 2;
                // (th * (v.sqrt() + eps) * (1 - b1**t) - eta * b1 * m) / (eta * (1 - b1) * g) - lam * th / g
                let (c0, c1, c2) = (1.0 - beta2, lr * beta1, lr * (1.0 - beta1));
                let $delta = move |g: f64, th: f64, a: f64, b: f64| {
                    let u = g + weight_decay * th;
                    let v = beta2 * b + c0 * (u * u);
                    (th * (v.sqrt() + eps) * bias_correction1 - c1 * a) / (c2 * g) - weight_decay * th / g
                };
                $body
            }
            Metric::Adamw { lr, weight_decay, beta1, beta2, eps, bias_correction1 } => {
                // v = b2 * sq + (1 - b2) * g ** 2;
                // (th * (v.sqrt() + eps) * (1 - b1**t) * (1 - eta * lam) - eta * b1 * m) / (eta * (1 - b1) * g)
                let (c0, c1, c2) = (1.0 - beta2, lr * beta1, lr * (1.0 - beta1));
                let c3 = 1.0 - lr * weight_decay;
                let $delta = move |g: f64, th: f64, a: f64, b: f64| {
                    let v = beta2 * b + c0 * (g * g);
                    (th * (v.sqrt() + eps) * bias_correction1 * c3 - c1 * a) / (c2 * g)
                };
                $body
            }
        }
    };
}

/// The operands of a per-element metric kernel, checked against the gradient's length; a
/// missing state operand reads as zeros (allocated only then: before an optimizer's first step).
struct Operands<'a> {
    param: &'a [f32],
    first: std::borrow::Cow<'a, [f32]>,
    second: std::borrow::Cow<'a, [f32]>,
}

impl<'a> Operands<'a> {
    fn new(
        count: usize,
        param: &'a [f32],
        first: Option<&'a [f32]>,
        second: Option<&'a [f32]>,
    ) -> Result<Self> {
        for (operand, len) in [
            ("param", Some(param.len())),
            ("first", first.map(<[f32]>::len)),
            ("second", second.map(<[f32]>::len)),
        ] {
            if let Some(got) = len {
                if got != count {
                    return Err(WireError::OperandLength {
                        operand,
                        expected: count,
                        got,
                    });
                }
            }
        }
        let or_zeros = |s: Option<&'a [f32]>| s.map_or_else(|| vec![0.0; count].into(), Into::into);
        Ok(Operands {
            param,
            first: or_zeros(first),
            second: or_zeros(second),
        })
    }
}

/// δ of every element (f64; ±inf or NaN where the gradient is zero), in `out`.
///
/// `grad` holds f32 bit patterns; `param`, `first` and `second` (those the metric uses; `None`
/// is zeros) have one value per element.
pub fn metric_into(
    metric: &Metric,
    grad: &[u32],
    param: &[f32],
    first: Option<&[f32]>,
    second: Option<&[f32]>,
    out: &mut [f64],
) -> Result<()> {
    let ops = Operands::new(grad.len(), param, first, second)?;
    if out.len() != grad.len() {
        return Err(WireError::OutputSizeMismatch {
            needed: grad.len(),
            got: out.len(),
        });
    }
    with_delta!(metric, delta => {
        let rows = grad.iter().zip(ops.param).zip(ops.first.iter()).zip(ops.second.iter());
        for (slot, (((&g, &th), &a), &b)) in out.iter_mut().zip(rows) {
            *slot = delta(f64::from(f32::from_bits(g)), f64::from(th), f64::from(a), f64::from(b));
        }
    });
    Ok(())
}

/// Per block of `block` elements, the largest level `l` (1..=3) with `worst ≥ thresholds[l − 1]`,
/// else 0, where `worst` is the smallest `|δ|` over the block's elements with a nonzero exponent
/// (NaN counts as 0, +inf as `f64::MAX`, as torch's `nan_to_num` makes them; a block without
/// such an element has `worst = +inf`).
///
/// The caller's thresholds are `2^(d_l − W + p − tolerance)` (FORMAT.md section 5.4, the
/// parameter's precision `p`).
pub fn block_levels(
    metric: &Metric,
    grad: &[u32],
    param: &[f32],
    first: Option<&[f32]>,
    second: Option<&[f32]>,
    block: usize,
    thresholds: &[f64; LEVELS - 1],
) -> Result<Vec<u8>> {
    let nb = num_blocks(grad.len(), block)?;
    let ops = Operands::new(grad.len(), param, first, second)?;
    let mut levels = Vec::with_capacity(nb);
    // Below the lowest threshold a block is at level 0 whatever its other elements are (the
    // minimum only falls): its remaining spans need no δ.
    let floor = thresholds.iter().copied().fold(f64::INFINITY, f64::min);
    with_delta!(metric, delta => {
        let blocks = grad
            .chunks(block)
            .zip(ops.param.chunks(block))
            .zip(ops.first.chunks(block))
            .zip(ops.second.chunks(block));
        for (((g, th), a), b) in blocks {
            let worst = smallest_magnitude(delta, g, th, a, b, floor);
            let mut level = 0u8;
            for (l, &t) in (1u8..).zip(thresholds) {
                if worst >= t {
                    level = l;
                }
            }
            levels.push(level);
        }
    });
    Ok(levels)
}

/// The smallest `|δ|` over the elements with a nonzero exponent (+inf without one), NaN as 0
/// and +inf as `f64::MAX`; or, once a span of elements brings it below `floor`, that span's
/// minimum (any value below `floor` gives the block the same level: the rest is skipped).
#[inline(always)]
fn smallest_magnitude(
    delta: impl Fn(f64, f64, f64, f64) -> f64,
    g: &[u32],
    th: &[f32],
    a: &[f32],
    b: &[f32],
    floor: f64,
) -> f64 {
    // Spans of magnitudes into a buffer, then their minimum: the first loop is plain arithmetic
    // on lanes of f64, which the compiler vectorises. Short spans, because most blocks of a real
    // gradient fall below the floor within their first elements (AdamW on a 3.6 M char
    // transformer: 90 % of blocks at level 0; spans of 4 took a third of the time of spans of 16).
    const SPAN: usize = 4;
    let magnitude = |x: u32, th: f32, a: f32, b: f32| {
        let d = delta(
            f64::from(f32::from_bits(x)),
            f64::from(th),
            f64::from(a),
            f64::from(b),
        )
        .abs();
        let d = if d.is_nan() {
            0.0
        } else if d > f64::MAX {
            f64::MAX
        } else {
            d
        };
        if exponent(x) == 0 {
            f64::INFINITY
        } else {
            d
        }
    };
    let mut worst = f64::INFINITY;
    let spans = g
        .chunks(SPAN)
        .zip(th.chunks(SPAN))
        .zip(a.chunks(SPAN))
        .zip(b.chunks(SPAN));
    for (((g, th), a), b) in spans {
        let mut span = [f64::INFINITY; SPAN];
        for ((((d, &x), &th), &a), &b) in span.iter_mut().zip(g).zip(th).zip(a).zip(b) {
            *d = magnitude(x, th, a, b);
        }
        for d in span {
            worst = if d < worst { d } else { worst };
        }
        if worst < floor {
            break;
        }
    }
    worst
}

// ------------------------------------------------------------------------------------ encode

/// The four payload sections of a GComp record (FORMAT.md section 5.4); the codebook is the
/// caller's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sections {
    /// The exponents, Huffman-coded with the book.
    pub exp: Vec<u8>,
    /// Each block's level at 2 bits.
    pub level: Vec<u8>,
    /// One bit per nonzero element (1 = negative).
    pub sign: Vec<u8>,
    /// The kept mantissa bits of the nonzero elements, one byte-aligned part per level.
    pub mant: Vec<u8>,
}

/// Runs of consecutive blocks of one level: `(level, first element, end element)`.
fn level_runs<'a>(
    levels: &'a [u8],
    block: usize,
    count: usize,
) -> impl Iterator<Item = (u8, usize, usize)> + 'a {
    let mut start = 0;
    std::iter::from_fn(move || {
        let &l = levels.get(start)?;
        let run = levels[start..].iter().take_while(|&&m| m == l).count();
        let span = (l, start * block, count.min((start + run) * block));
        start += run;
        Some(span)
    })
}

/// Codes f32 bit patterns `bits` with one `levels` entry (0..=3) per block of `block` elements
/// and the exponent code `book`, and writes into `recon` (one per element) the f32 bit pattern
/// each element decodes to: +0 for a pruned one, else its sign, exponent and kept mantissa bits
/// with the dropped ones back as the middle of their range.
///
/// Every input is checked before the sections are allocated, at their exact lengths; each is
/// then written in one pass.
pub fn encode(
    bits: &[u32],
    format: FieldFormat,
    block: usize,
    levels: &[u8],
    book: &HuffmanBook,
    recon: &mut [u32],
) -> Result<Sections> {
    let nb = num_blocks(bits.len(), block)?;
    if levels.len() != nb {
        return Err(WireError::BlockCount {
            expected: nb,
            got: levels.len(),
        });
    }
    if let Some(index) = levels.iter().position(|&l| usize::from(l) >= LEVELS) {
        return Err(WireError::InvalidBlockLevel {
            index,
            level: levels[index],
        });
    }
    if recon.len() != bits.len() {
        return Err(WireError::OutputSizeMismatch {
            needed: bits.len(),
            got: recon.len(),
        });
    }
    // The lengths: the exponent code's from the histogram (which also finds what cannot be
    // coded), the others from the nonzero elements of each level; both in one pass.
    let (counts, nonzero) = counts_and_nonzero(bits, levels, block);
    let mut exp_bits = 0u64;
    for (e, &c) in counts.iter().enumerate() {
        match book.cost(e as u8) {
            Some(cost) if e != 255 => exp_bits += c * u64::from(cost),
            _ if c == 0 => {}
            _ => return Err(refusal(bits, book)),
        }
    }
    let (width, drops) = (format.mantissa_bits(), format.drops());
    let bytes = |bits: u64| usize::try_from(bits.div_ceil(8)).unwrap_or(usize::MAX);
    let part_len: [usize; LEVELS] =
        std::array::from_fn(|l| bytes(nonzero[l] as u64 * u64::from(width - drops[l])));
    let mut exp = vec![0u8; bytes(exp_bits)];
    let mut sign = vec![0u8; bytes(nonzero.iter().sum::<usize>() as u64)];
    let mut mant = vec![0u8; part_len.iter().sum()];

    // The exponent code, two codes per put (each at most cap + 8 = 23 bits).
    let table = book.encode_table();
    let mut sink = Sink::new(&mut exp);
    let pairs = bits.chunks_exact(2);
    let tail = pairs.remainder();
    for pair in pairs {
        let ((f0, w0), (f1, w1)) = (table[exponent(pair[0])], table[exponent(pair[1])]);
        sink.put(u64::from(f0) | u64::from(f1) << w0, w0 + w1);
    }
    for &x in tail {
        let (field, field_width) = table[exponent(x)];
        sink.put(u64::from(field), field_width);
    }

    // Signs, mantissas and the reconstruction, a run of blocks of one level at a time, each
    // level's part of `mant` written by its own sink.
    let mut signs = Sink::new(&mut sign);
    let (p0, rest) = mant.split_at_mut(part_len[0]);
    let (p1, rest) = rest.split_at_mut(part_len[1]);
    let (p2, p3) = rest.split_at_mut(part_len[2]);
    let mut parts = [Sink::new(p0), Sink::new(p1), Sink::new(p2), Sink::new(p3)];
    for (l, first, end) in level_runs(levels, block, bits.len()) {
        let (x, r, part) = (
            &bits[first..end],
            &mut recon[first..end],
            &mut parts[usize::from(l)],
        );
        let s = &mut signs;
        match (format, l) {
            (FieldFormat::F32, 0) => fields::<0, 23, 0>(x, r, s, part),
            (FieldFormat::F32, 1) => fields::<0, 23, 6>(x, r, s, part),
            (FieldFormat::F32, 2) => fields::<0, 23, 12>(x, r, s, part),
            (FieldFormat::F32, _) => fields::<0, 23, 18>(x, r, s, part),
            (FieldFormat::Bf16, 0) => fields::<16, 7, 0>(x, r, s, part),
            (FieldFormat::Bf16, 1) => fields::<16, 7, 2>(x, r, s, part),
            (FieldFormat::Bf16, 2) => fields::<16, 7, 4>(x, r, s, part),
            (FieldFormat::Bf16, _) => fields::<16, 7, 6>(x, r, s, part),
        }
    }
    let mut level = vec![0u8; nb.div_ceil(4)];
    for (b, &l) in levels.iter().enumerate() {
        level[b / 4] |= l << (2 * (b % 4));
    }
    Ok(Sections {
        exp,
        level,
        sign,
        mant,
    })
}

/// The histogram of the biased exponents (as [`exponent_counts`]) and the number of nonzero
/// elements in the blocks of each level.
fn counts_and_nonzero(bits: &[u32], levels: &[u8], block: usize) -> ([u64; 256], [usize; LEVELS]) {
    // Four interleaved tables, as in exponent_counts.
    let mut c = [[0u64; 256]; 4];
    let mut nonzero = [0usize; LEVELS];
    for (l, first, end) in level_runs(levels, block, bits.len()) {
        let run = &bits[first..end];
        let mut zeros = 0usize;
        let quads = run.chunks_exact(4);
        let tail = quads.remainder();
        for q in quads {
            let e = [
                exponent(q[0]),
                exponent(q[1]),
                exponent(q[2]),
                exponent(q[3]),
            ];
            c[0][e[0]] += 1;
            c[1][e[1]] += 1;
            c[2][e[2]] += 1;
            c[3][e[3]] += 1;
            zeros += e.iter().map(|&e| usize::from(e == 0)).sum::<usize>();
        }
        for &x in tail {
            let e = exponent(x);
            c[0][e] += 1;
            zeros += usize::from(e == 0);
        }
        nonzero[usize::from(l)] += run.len() - zeros;
    }
    let mut counts = [0u64; 256];
    for (e, slot) in counts.iter_mut().enumerate() {
        *slot = c[0][e] + c[1][e] + c[2][e] + c[3][e];
    }
    (counts, nonzero)
}

/// The sign bits, kept mantissa bits and reconstruction of elements whose `WIDTH` mantissa bits
/// sit at bit `SHIFT` of the f32 and lose their low `DROP` bits: one copy per format and level,
/// every shift a constant. Pruned elements put zero bits instead of branching: zeros come mixed
/// with nonzeros in real gradients.
fn fields<const SHIFT: u32, const WIDTH: u32, const DROP: u32>(
    bits: &[u32],
    recon: &mut [u32],
    signs: &mut Sink<'_>,
    part: &mut Sink<'_>,
) {
    let half = if DROP > 0 {
        1u32 << (DROP.saturating_sub(1))
    } else {
        0
    };
    // (sign, kept bits, their width, reconstruction, nonzero), all zero when pruned.
    let field = |x: u32| {
        let nonzero = u32::from(exponent(x) != 0);
        let kept = ((x >> SHIFT) & ((1 << WIDTH) - 1)) >> DROP;
        let value = (x & 0xFF80_0000) | (((kept << DROP) | half) << SHIFT);
        (
            u64::from((x >> 31) & nonzero),
            u64::from(kept * nonzero),
            (WIDTH - DROP) * nonzero,
            if nonzero != 0 { value } else { 0 },
            nonzero,
        )
    };
    // The sinks' state in locals for the loop (registers, not memory).
    let (mut s, mut k) = (signs.take(), part.take());
    // Two elements per put (a kept field is at most 23 bits).
    let mixed = |x: &[u32], r: &mut [u32], s: &mut Sink<'_>, k: &mut Sink<'_>| {
        for (x, r) in x.chunks_exact(2).zip(r.chunks_exact_mut(2)) {
            let (s0, k0, w0, r0, n0) = field(x[0]);
            let (s1, k1, w1, r1, n1) = field(x[1]);
            s.put(s0 | s1 << n0, n0 + n1);
            k.put(k0 | k1 << w0, w0 + w1);
            (r[0], r[1]) = (r0, r1);
        }
    };
    // Most spans of a real gradient hold no pruned element: there every width is a constant, the
    // span's signs go in one put, and the reconstruction is a separate loop the compiler
    // vectorises; spans with a pruned element take the general loop. Same bits either way.
    const SPAN: usize = 16;
    let kept_width = WIDTH - DROP;
    let spans = bits.chunks_exact(SPAN).zip(recon.chunks_exact_mut(SPAN));
    for (x, r) in spans {
        let all_nonzero = x.iter().fold(true, |all, &v| all & (exponent(v) != 0));
        if !all_nonzero {
            mixed(x, r, &mut s, &mut k);
            continue;
        }
        let mut sign = 0u64;
        for (i, &v) in x.iter().enumerate() {
            sign |= u64::from(v >> 31) << i;
        }
        s.put(sign, SPAN as u32);
        for pair in x.chunks_exact(2) {
            let kept = |v: u32| u64::from(((v >> SHIFT) & ((1 << WIDTH) - 1)) >> DROP);
            k.put(kept(pair[0]) | kept(pair[1]) << kept_width, 2 * kept_width);
        }
        for (r, &v) in r.iter_mut().zip(x) {
            let kept = ((v >> SHIFT) & ((1 << WIDTH) - 1)) >> DROP;
            *r = (v & 0xFF80_0000) | (((kept << DROP) | half) << SHIFT);
        }
    }
    let done = bits.len() - bits.len() % SPAN;
    let (x, r) = (&bits[done..], &mut recon[done..]);
    mixed(x, r, &mut s, &mut k);
    if let (Some(&x), Some(r), 1) = (x.last(), r.last_mut(), x.len() % 2) {
        let (s0, k0, w0, r0, n0) = field(x);
        s.put(s0, n0);
        k.put(k0, w0);
        *r = r0;
    }
    (*signs, *part) = (s, k);
}

/// The first element of `bits` the exponent code refuses: not finite, or without a code in a
/// book without an escape.
#[cold]
fn refusal(bits: &[u32], book: &HuffmanBook) -> WireError {
    for (index, &x) in bits.iter().enumerate() {
        let e = exponent(x);
        if e == 255 {
            return WireError::NonFiniteValue { index, bits: x };
        }
        if book.cost(e as u8).is_none() {
            return WireError::SymbolNotInBook {
                index,
                symbol: e as u8,
            };
        }
    }
    // Not reached: the caller found one in the histogram.
    WireError::SymbolNotInBook {
        index: bits.len(),
        symbol: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn book_of(bits: &[u32], cap: u32) -> HuffmanBook {
        HuffmanBook::from_counts(&exponent_counts(bits), cap).unwrap()
    }

    /// The fields of FORMAT.md section 5.4 one element at a time: the reference the single
    /// pass is checked against.
    fn reference(
        bits: &[u32],
        format: FieldFormat,
        block: usize,
        levels: &[u8],
        book: &HuffmanBook,
    ) -> (Sections, Vec<u32>) {
        let exps: Vec<u8> = bits.iter().map(|&x| exponent(x) as u8).collect();
        let mut signs = vec![];
        let mut parts: [Vec<u32>; LEVELS] = Default::default();
        let mut recon = vec![];
        let drops = format.drops();
        let shift = if format == FieldFormat::Bf16 { 16 } else { 0 };
        for (i, &x) in bits.iter().enumerate() {
            let l = usize::from(levels[i / block]);
            if exponent(x) == 0 {
                recon.push(0);
                continue;
            }
            signs.push(x >> 31);
            let m = (x >> shift) & ((1 << format.mantissa_bits()) - 1);
            let d = drops[l];
            parts[l].push(m >> d);
            let back = ((m >> d) << d) | if d > 0 { 1 << (d - 1) } else { 0 };
            recon.push((x & 0xFF80_0000) | (back << shift));
        }
        let mut mant = vec![];
        for (l, p) in parts.iter().enumerate() {
            mant.extend(crate::pack_bits(p, format.mantissa_bits() - drops[l]).unwrap());
        }
        let lv: Vec<u32> = levels.iter().map(|&l| u32::from(l)).collect();
        let sections = Sections {
            exp: book.encode(&exps).unwrap(),
            level: crate::pack_bits(&lv, 2).unwrap(),
            sign: crate::pack_bits(&signs, 1).unwrap(),
            mant,
        };
        (sections, recon)
    }

    #[test]
    fn one_block_per_level_by_hand() {
        // 1.5 (level 0), -0.0 (pruned), 3.0 (level 1), a denormal (pruned), 1 + 2^-23 (level 3).
        let bits = [
            1.5f32.to_bits(),
            0x8000_0000,
            3.0f32.to_bits(),
            1,
            0x3F80_0001,
        ];
        let book = book_of(&bits, 12);
        let mut recon = [7u32; 5];
        let s = encode(&bits, FieldFormat::F32, 2, &[0, 1, 3], &book, &mut recon).unwrap();
        assert_eq!(s.level, vec![0b11_01_00]);
        assert_eq!(s.sign, vec![0b000]);
        // Level 0 keeps 0x400000 at 23 bits (3 bytes); level 1 keeps 0x100000 >> 6 at 17 bits
        // (3 bytes); level 3 keeps 1 >> 18 = 0 at 5 bits (1 byte).
        let mut mant = crate::pack_bits(&[0x40_0000], 23).unwrap();
        mant.extend(crate::pack_bits(&[0x40_0000 >> 6], 17).unwrap());
        mant.extend(crate::pack_bits(&[0], 5).unwrap());
        assert_eq!(s.mant, mant);
        assert_eq!(
            recon,
            [
                1.5f32.to_bits(),
                0,
                3.0f32.to_bits() | 1 << 5,
                0,
                0x3F80_0000 | 1 << 17
            ]
        );
    }

    #[test]
    fn bad_input_is_refused() {
        let bits = [1.0f32.to_bits(), f32::INFINITY.to_bits()];
        let book = book_of(&bits, 12);
        let mut recon = [0u32; 2];
        assert_eq!(
            encode(&bits, FieldFormat::F32, 1, &[0, 0], &book, &mut recon),
            Err(WireError::NonFiniteValue {
                index: 1,
                bits: 0x7F80_0000
            })
        );
        assert_eq!(
            encode(
                &bits[..1],
                FieldFormat::F32,
                0,
                &[0],
                &book,
                &mut recon[..1]
            ),
            Err(WireError::InvalidBlockSize { block: 0 })
        );
        assert_eq!(
            encode(
                &bits[..1],
                FieldFormat::F32,
                1,
                &[0, 0],
                &book,
                &mut recon[..1]
            ),
            Err(WireError::BlockCount {
                expected: 1,
                got: 2
            })
        );
        assert_eq!(
            encode(
                &bits[..1],
                FieldFormat::F32,
                1,
                &[4],
                &book,
                &mut recon[..1]
            ),
            Err(WireError::InvalidBlockLevel { index: 0, level: 4 })
        );
        assert_eq!(
            encode(&bits[..1], FieldFormat::F32, 1, &[0], &book, &mut recon),
            Err(WireError::OutputSizeMismatch { needed: 1, got: 2 })
        );
        assert_eq!(
            FieldFormat::from_code(2),
            Err(WireError::InvalidFieldFormat { format: 2 })
        );
        let m = Metric::Sgd {
            lr: 0.1,
            weight_decay: 0.0,
        };
        assert_eq!(
            block_levels(&m, &bits, &[1.0], None, None, 1, &[1.0, 2.0, 3.0]),
            Err(WireError::OperandLength {
                operand: "param",
                expected: 2,
                got: 1
            })
        );
        let mut out = [0.0; 1];
        assert_eq!(
            metric_into(&m, &bits, &[1.0, 1.0], None, Some(&[0.0; 3]), &mut out),
            Err(WireError::OperandLength {
                operand: "second",
                expected: 2,
                got: 3
            })
        );
    }

    #[test]
    fn levels_take_the_worst_nonzero_element_of_each_block() {
        // SGD without decay: δ = θ / (lr · g). With lr = 1 and g = 1, δ = θ.
        let m = Metric::Sgd {
            lr: 1.0,
            weight_decay: 0.0,
        };
        let one = 1.0f32.to_bits();
        let grad = [one, one, one, 0, one, one, 0, 0];
        let param = [
            2f32.powi(8),
            2f32.powi(14),
            2f32.powi(20),
            1.0,
            2f32.powi(30),
            f32::NAN,
            5.0,
            5.0,
        ];
        let thresholds = [2f64.powi(7), 2f64.powi(13), 2f64.powi(19)];
        // Blocks of 1: levels by δ; a zero gradient's block is all zeros: level 3; NaN δ: level 0.
        assert_eq!(
            block_levels(&m, &grad, &param, None, None, 1, &thresholds).unwrap(),
            vec![1, 2, 3, 3, 3, 0, 3, 3]
        );
        // Blocks of 3: the first block's worst element decides; zeros do not count.
        assert_eq!(
            block_levels(&m, &grad, &param, None, None, 3, &thresholds).unwrap(),
            vec![1, 0, 3]
        );
    }

    #[test]
    fn infinite_delta_counts_as_the_largest_finite() {
        // lr · g underflows to a denormal f64, and θ over it overflows.
        let m = Metric::Sgd {
            lr: 1e-300,
            weight_decay: 0.0,
        };
        let grad = [f32::from_bits(0x0080_0000).to_bits()]; // the smallest normal
        let param = [f32::MAX];
        let mut d = [0.0];
        metric_into(&m, &grad, &param, None, None, &mut d).unwrap();
        assert_eq!(d[0], f64::INFINITY);
        assert_eq!(
            block_levels(
                &m,
                &grad,
                &param,
                None,
                None,
                1,
                &[1.0, f64::MAX, f64::INFINITY]
            )
            .unwrap(),
            vec![2]
        );
    }

    fn finite_bits() -> impl Strategy<Value = u32> {
        prop_oneof![
            any::<u32>().prop_filter("finite", |b| exponent(*b) != 255),
            Just(0u32),
            Just(0x8000_0000u32),
            (0u32..0x80_0000).prop_map(|m| m | 0x8000_0000),
        ]
    }

    proptest! {
        #[test]
        fn prop_single_pass_matches_the_fields(bits in proptest::collection::vec(finite_bits(), 0..300),
                                               block in 1usize..40, seed in any::<u64>(),
                                               bf16 in any::<bool>(), cap in 1u32..=15) {
            let format = if bf16 { FieldFormat::Bf16 } else { FieldFormat::F32 };
            let nb = num_blocks(bits.len(), block).unwrap();
            let levels: Vec<u8> = (0..nb).map(|b| ((seed >> (2 * (b % 32))) & 3) as u8).collect();
            let book = book_of(&bits, cap);
            let mut recon = vec![0u32; bits.len()];
            let s = encode(&bits, format, block, &levels, &book, &mut recon).unwrap();
            let (want, want_recon) = reference(&bits, format, block, &levels, &book);
            prop_assert_eq!(s, want);
            prop_assert_eq!(recon, want_recon);
        }

        #[test]
        fn prop_spans_without_pruned_elements_match_the_fields(
            bits in proptest::collection::vec(prop_oneof![
                30 => any::<u32>().prop_filter("normal", |b| exponent(*b) != 255 && exponent(*b) != 0),
                1 => Just(0u32),
            ], 0..400),
            block in 1usize..80, seed in any::<u64>(), bf16 in any::<bool>(), cap in 1u32..=15) {
            // Mostly nonzero elements, so that most 16-element spans take the no-pruned-element loop.
            let format = if bf16 { FieldFormat::Bf16 } else { FieldFormat::F32 };
            let nb = num_blocks(bits.len(), block).unwrap();
            let levels: Vec<u8> = (0..nb).map(|b| ((seed >> (2 * (b % 32))) & 3) as u8).collect();
            let book = book_of(&bits, cap);
            let mut recon = vec![0u32; bits.len()];
            let s = encode(&bits, format, block, &levels, &book, &mut recon).unwrap();
            let (want, want_recon) = reference(&bits, format, block, &levels, &book);
            prop_assert_eq!(s, want);
            prop_assert_eq!(recon, want_recon);
        }

        #[test]
        fn prop_levels_are_those_of_the_metric(grad in proptest::collection::vec(finite_bits(), 0..200),
                                               block in 1usize..20, kind in 0usize..7,
                                               scale in -30i32..30) {
            let metric = [
                Metric::Sgd { lr: 0.01, weight_decay: 1e-4 },
                Metric::Momentum { lr: 0.01, weight_decay: 1e-4, momentum: 0.9, dampening: 0.1 },
                Metric::Nesterov { lr: 0.01, weight_decay: 1e-4, momentum: 0.9 },
                Metric::Adagrad { lr: 0.01, weight_decay: 1e-4, eps: 1e-10 },
                Metric::Rmsprop { lr: 0.01, weight_decay: 1e-4, alpha: 0.99, eps: 1e-8 },
                Metric::Adam { lr: 1e-3, weight_decay: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, bias_correction1: 0.271 },
                Metric::Adamw { lr: 1e-3, weight_decay: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, bias_correction1: 0.271 },
            ][kind];
            let param: Vec<f32> = grad.iter().map(|&g| f32::from_bits(g.rotate_left(7) & 0xBFFF_FFFF)).collect();
            let first: Vec<f32> = grad.iter().map(|&g| f32::from_bits(g) * 0.5).collect();
            let second: Vec<f32> = grad.iter().map(|&g| (f32::from_bits(g) * f32::from_bits(g)).min(1e30)).collect();
            let mut delta = vec![0.0; grad.len()];
            metric_into(&metric, &grad, &param, Some(&first), Some(&second), &mut delta).unwrap();
            let t = 2f64.powi(scale);
            let thresholds = [t, t * 64.0, t * 4096.0];
            let levels = block_levels(&metric, &grad, &param, Some(&first), Some(&second), block, &thresholds).unwrap();
            for (b, &l) in levels.iter().enumerate() {
                let worst = (b * block..grad.len().min((b + 1) * block))
                    .filter(|&i| exponent(grad[i]) != 0)
                    .map(|i| { let d = delta[i].abs(); if d.is_nan() { 0.0 } else { d.min(f64::MAX) } })
                    .fold(f64::INFINITY, f64::min);
                let want = thresholds.iter().rposition(|&th| worst >= th).map_or(0, |p| p as u8 + 1);
                prop_assert_eq!(l, want);
            }
        }

        #[test]
        fn prop_arbitrary_input_never_panics(bits in proptest::collection::vec(any::<u32>(), 0..100),
                                             levels in proptest::collection::vec(any::<u8>(), 0..20),
                                             block in 0usize..20, cap in 1u32..=15) {
            let book = book_of(&bits[..bits.len() / 2], cap);
            let mut recon = vec![0u32; bits.len()];
            let _ = encode(&bits, FieldFormat::F32, block, &levels, &book, &mut recon);
            let m = Metric::Rmsprop { lr: 0.1, weight_decay: 0.0, alpha: 0.9, eps: 1e-8 };
            let p = vec![1.0f32; bits.len()];
            let _ = block_levels(&m, &bits, &p, None, Some(&p[..p.len() / 2]), block, &[1.0, 2.0, 3.0]);
        }
    }
}
