//! SparseLoCo's and DiLoCo's outer step in one pass over the weights: the same float32 operations,
//! in the same order, as `gradwire.algorithms.sparseloco.OuterStep` runs them as separate torch
//! operations, so the same bits.
//!
//! Per value, with `μ` the momentum and `η` the outer learning rate (each operation one rounded
//! float32 multiply or add; Rust never fuses them into a multiply-add):
//!
//! - the momentum buffer `b = μ·b + d` (`b = d` at the first step: `fresh`), when `μ > 0`;
//! - the step `s = b`, or with Nesterov `s = μ·b + d`, or without momentum `s = d`;
//! - `s = η·s` unless `η = 1` (multiplying by 1 is exact: the step is not rounded again);
//! - the weights `a = a − s`.
//!
//! torch runs each line as its own pass over memory (and Nesterov's step as a new tensor): six passes
//! where this makes one, the values in registers between the operations.

use crate::error::{Result, WireError};
use crate::threads::run_joined;

/// Values per thread below which a second thread costs more than it saves.
const MIN_VALUES_PER_THREAD: usize = 1 << 16;

/// How [`outer_step`] steps the weights: `momentum` μ in `[0, 1)` (0: none), `nesterov` (only with
/// μ > 0), `lr` η.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OuterStepRule {
    pub momentum: f32,
    pub nesterov: bool,
    pub lr: f32,
}

/// One outer step of `anchor` by the mean pseudo-gradient `delta`, in place, with the momentum
/// buffer `buffer` (ignored, and may be empty, when the rule has no momentum; `fresh`: the buffer
/// holds nothing yet and becomes `delta`). Up to `threads` threads share the values; each value's
/// operations do not depend on any other's, so the result does not depend on the thread count.
///
/// Errors (nothing written): `delta`, or `buffer` where the rule has momentum, is not as long as
/// `anchor` (`operand_length`).
pub fn outer_step(
    anchor: &mut [f32],
    buffer: &mut [f32],
    delta: &[f32],
    rule: OuterStepRule,
    fresh: bool,
    threads: usize,
) -> Result<()> {
    let n = anchor.len();
    if delta.len() != n {
        return Err(WireError::OperandLength {
            operand: "delta",
            expected: n,
            got: delta.len(),
        });
    }
    let with_momentum = rule.momentum != 0.0;
    if with_momentum && buffer.len() != n {
        return Err(WireError::OperandLength {
            operand: "buffer",
            expected: n,
            got: buffer.len(),
        });
    }
    let threads = threads.clamp(1, n.div_ceil(MIN_VALUES_PER_THREAD).max(1));
    let per_thread = n.div_ceil(threads).max(1);
    if !with_momentum {
        if threads == 1 {
            step_plain(anchor, delta, rule.lr);
        } else {
            run_joined(
                anchor
                    .chunks_mut(per_thread)
                    .zip(delta.chunks(per_thread))
                    .map(|(a, d)| move || step_plain(a, d, rule.lr)),
            );
        }
        return Ok(());
    }
    if threads == 1 {
        step_momentum(anchor, buffer, delta, rule, fresh);
    } else {
        run_joined(
            anchor
                .chunks_mut(per_thread)
                .zip(buffer.chunks_mut(per_thread))
                .zip(delta.chunks(per_thread))
                .map(|((a, b), d)| move || step_momentum(a, b, d, rule, fresh)),
        );
    }
    Ok(())
}

/// `a = a − η·d` (`a = a − d` at η = 1).
fn step_plain(anchor: &mut [f32], delta: &[f32], lr: f32) {
    if lr == 1.0 {
        for (a, &d) in anchor.iter_mut().zip(delta) {
            *a -= d;
        }
    } else {
        for (a, &d) in anchor.iter_mut().zip(delta) {
            *a -= d * lr;
        }
    }
}

/// The momentum buffer, then the step, then the weights, value by value.
fn step_momentum(
    anchor: &mut [f32],
    buffer: &mut [f32],
    delta: &[f32],
    rule: OuterStepRule,
    fresh: bool,
) {
    let OuterStepRule {
        momentum: mu,
        nesterov,
        lr,
    } = rule;
    for ((a, b), &d) in anchor.iter_mut().zip(buffer.iter_mut()).zip(delta) {
        *b = if fresh { d } else { *b * mu + d };
        let mut s = if nesterov { *b * mu + d } else { *b };
        if lr != 1.0 {
            s *= lr;
        }
        *a -= s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The operations one at a time over whole arrays, as torch runs them.
    fn passes(a: &mut [f32], b: &mut Vec<f32>, d: &[f32], rule: OuterStepRule, fresh: bool) {
        let steps: Vec<f32> = if rule.momentum == 0.0 {
            d.to_vec()
        } else {
            if fresh {
                *b = d.to_vec();
            } else {
                b.iter_mut().for_each(|x| *x *= rule.momentum);
                b.iter_mut().zip(d).for_each(|(x, &y)| *x += y);
            }
            if rule.nesterov {
                let mut s: Vec<f32> = b.iter().map(|x| x * rule.momentum).collect();
                s.iter_mut().zip(d).for_each(|(x, &y)| *x += y);
                s
            } else {
                b.clone()
            }
        };
        let steps: Vec<f32> = if rule.lr == 1.0 {
            steps
        } else {
            steps.iter().map(|x| x * rule.lr).collect()
        };
        a.iter_mut().zip(&steps).for_each(|(x, &s)| *x -= s);
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    proptest! {
        #[test]
        fn one_pass_gives_the_bits_of_the_separate_passes(
            values in proptest::collection::vec((-1e3f32..1e3, -1e3f32..1e3, -1e3f32..1e3), 0..300),
            mu in prop_oneof![Just(0.0f32), 0.01f32..0.99],
            nesterov: bool,
            lr in prop_oneof![Just(1.0f32), 0.01f32..3.0],
            fresh: bool,
            threads in 1usize..5,
        ) {
            let nesterov = nesterov && mu > 0.0;
            let rule = OuterStepRule { momentum: mu, nesterov, lr };
            let mut a: Vec<f32> = values.iter().map(|v| v.0).collect();
            let mut b: Vec<f32> = values.iter().map(|v| v.1).collect();
            let d: Vec<f32> = values.iter().map(|v| v.2).collect();
            let (mut a2, mut b2) = (a.clone(), b.clone());
            outer_step(&mut a, &mut b, &d, rule, fresh, threads).unwrap();
            passes(&mut a2, &mut b2, &d, rule, fresh);
            prop_assert_eq!(bits(&a), bits(&a2));
            if mu > 0.0 {
                prop_assert_eq!(bits(&b), bits(&b2));
            }
        }
    }

    #[test]
    fn signed_zeros_and_threads_are_kept_exactly() {
        // A fresh buffer takes delta as it is: −0.0 stays −0.0 (a zero buffer plus delta would not).
        let n = 3 * MIN_VALUES_PER_THREAD + 7;
        let d: Vec<f32> = (0..n)
            .map(|i| if i % 3 == 0 { -0.0 } else { (i as f32).sin() })
            .collect();
        let rule = OuterStepRule {
            momentum: 0.9,
            nesterov: true,
            lr: 0.7,
        };
        let mut results = Vec::new();
        for threads in [1, 2, 4] {
            let mut a: Vec<f32> = (0..n).map(|i| (i as f32).cos()).collect();
            let mut b = vec![1.0f32; n];
            outer_step(&mut a, &mut b, &d, rule, true, threads).unwrap();
            assert_eq!(b[0].to_bits(), (-0.0f32).to_bits());
            results.push((bits(&a), bits(&b)));
        }
        assert!(results.windows(2).all(|w| w[0] == w[1]));
    }

    #[test]
    fn operands_of_another_length_write_nothing() {
        let rule = OuterStepRule {
            momentum: 0.5,
            nesterov: false,
            lr: 1.0,
        };
        let (mut a, mut b) = (vec![1.0f32; 4], vec![2.0f32; 3]);
        let err = outer_step(&mut a, &mut b, &[1.0; 4], rule, false, 1).unwrap_err();
        assert_eq!(err.kind(), "operand_length");
        assert!(err.to_string().contains("buffer"), "{err}");
        let err = outer_step(&mut a, &mut b, &[1.0; 5], rule, false, 1).unwrap_err();
        assert!(err.to_string().contains("delta"), "{err}");
        assert_eq!((a, b), (vec![1.0f32; 4], vec![2.0f32; 3]));
        // Without momentum the buffer is not read: an empty one will do.
        let mut a = vec![1.0f32; 2];
        let plain = OuterStepRule {
            momentum: 0.0,
            nesterov: false,
            lr: 0.5,
        };
        outer_step(&mut a, &mut [], &[2.0, 4.0], plain, false, 1).unwrap();
        assert_eq!(a, vec![0.0, -1.0]);
    }
}
