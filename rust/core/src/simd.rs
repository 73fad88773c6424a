//! The CPU's wider vector instructions, chosen at run time.
//!
//! Wheels are built for baseline x86-64 (SSE2). A kernel that wants AVX2 and FMA is compiled a
//! second time in a `#[target_feature(enable = "avx2,fma")]` function, into which its
//! `#[inline(always)]` parts inline, and runs there only where [`has_avx2_fma`] says the CPU has
//! them. The kernels that do this compute integers held exactly in float64, so the choice changes
//! their speed, never their results.

/// Whether this CPU runs AVX2 and FMA instructions (std caches the answer).
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
