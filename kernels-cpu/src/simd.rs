//! Runtime SIMD dispatch.
//!
//! [`pulp::Arch::dispatch`] runs a closure inside a function compiled for the
//! best instruction set this CPU has (AVX-512, AVX2+FMA, ...). The kernels' row
//! loops are written with several independent accumulators and branch-free
//! conversions, so that inside that function the compiler turns them into
//! full-width vector code; the same binary still runs on any x86-64 or arm64.
#[cfg(target_arch = "x86_64")]
use crate::capability::{cap, Capability};
use crate::element::{Acc, Element};
use std::sync::OnceLock;

/// The best SIMD level of this machine, detected once, at most what
/// [`cap`] allows: `avx2` holds pulp to x86-64-v3, `default` to no
/// explicit SIMD.
pub(crate) fn arch() -> pulp::Arch {
    static ARCH: OnceLock<pulp::Arch> = OnceLock::new();
    *ARCH.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        match cap() {
            Capability::Avx512 => {}
            Capability::Avx2 => return pulp::x86::V3::try_new().map_or(pulp::Arch::Scalar, pulp::Arch::V3),
            Capability::Default => return pulp::Arch::Scalar,
        }
        pulp::Arch::new()
    })
}

/// Runs `f` compiled for the best SIMD level of this machine.
///
/// Mark the closure `#[inline(always)]`: only code inlined into pulp's
/// target-feature function is compiled for that SIMD level. Without it the
/// closure stayed an out-of-line SSE2 function (measured: f32 rms_norm 2.2x,
/// bf16 2.6x, f16 3.2x slower).
///
/// On x86-64 CPUs with AVX-512 and AVX512-BF16 (Zen 4, Sapphire Rapids and
/// later) the closure runs in a function compiled for those features too, so
/// that [`crate::narrow`] can inline the bf16 conversion instruction.
#[inline(always)]
pub(crate) fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if has_v4_bf16() {
        // SAFETY: the CPU has every feature `v4_bf16` is compiled for.
        return unsafe { v4_bf16(f) };
    }
    arch().dispatch(f)
}

/// Whether this CPU has pulp's AVX-512 level (x86-64-v4) plus AVX512-BF16
/// and F16C, and [`cap`] allows `avx512`; detected once.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn has_v4_bf16() -> bool {
    // A relaxed atomic rather than a `OnceLock` like `arch()`: this is read
    // for every 128 values written, and with `OnceLock<bool>` rms_norm bf16
    // forward measured 40 GiB/s instead of 60 to 77.
    static HAS: Flag = Flag::new();
    HAS.get(|| {
        cap() == Capability::Avx512
            && pulp::x86::V4::try_new().is_some()
            && is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("f16c")
    })
}

/// A flag detected once and then read in hot loops ([`has_v4_bf16`],
/// [`writes_ahead`], [`intel`]): one relaxed load and a compare once known. Two threads
/// that find it unknown both detect it, and store the same value.
#[cfg(target_arch = "x86_64")]
struct Flag(std::sync::atomic::AtomicU8);

#[cfg(target_arch = "x86_64")]
impl Flag {
    /// Unknown until first read.
    const fn new() -> Flag {
        Flag(std::sync::atomic::AtomicU8::new(2))
    }

    /// The flag, detecting it with `detect` where it is not known yet.
    #[inline(always)]
    fn get(&self, detect: impl FnOnce() -> bool) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        match self.0.load(Relaxed) {
            2 => {
                let v = detect();
                self.0.store(v as u8, Relaxed);
                v
            }
            v => v == 1,
        }
    }
}

/// [`has_v4_bf16`] off x86-64: no CPU there has those features.
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub(crate) fn has_v4_bf16() -> bool {
    false
}

/// Runs `f` compiled for x86-64-v4 plus AVX512-BF16 and F16C.
///
/// # Safety
/// The CPU must have those features ([`has_v4_bf16`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(
    enable = "avx512f,avx512bw,avx512cd,avx512dq,avx512vl,avx512bf16,avx2,fma,bmi1,bmi2,lzcnt,popcnt,f16c"
)]
unsafe fn v4_bf16<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Hints the CPU to load the cache lines of `ahead[i * n..(i + 1) * n]`
/// (nothing once `i * n` is past the end of `ahead`): called by a
/// compute-bound pass over one row for the next row, so that its first read
/// does not wait on memory.
///
/// One bounds check and then one prefetch per 64 bytes (`n` is a constant at
/// every call, so the loop unrolls). The last part may reach past the end of
/// `ahead`: a prefetch reads nothing and cannot fault, so that costs at most
/// a line fetched for nothing. The clamped version before it spent ~25
/// instructions per part on `min`s and its loop, a third of softmax's inner
/// loop.
#[inline(always)]
pub(crate) fn prefetch_part<T, const WRITE: bool>(ahead: &[T], i: usize, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_ET0, _MM_HINT_T0};
        if WRITE {
            prefetch_hinted::<T, _MM_HINT_ET0>(ahead, i, n)
        } else {
            prefetch_hinted::<T, _MM_HINT_T0>(ahead, i, n)
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ahead, i, n);
}

/// [`prefetch_part`] for reading into L2, not L1 (`prefetcht1`): for a pass
/// whose own lines fill L1's sets, reading rows a multiple of 4 KiB apart,
/// so that lines fetched for the next rows do not evict them. Intel's cores
/// and AMD's from Zen 4 on fill only L2 (and L3) on this hint; earlier AMD
/// cores treat it as `prefetcht0`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
pub(crate) fn prefetch_part_l2<T>(ahead: &[T], i: usize, n: usize) {
    #[cfg(target_arch = "x86_64")]
    prefetch_hinted::<T, { std::arch::x86_64::_MM_HINT_T1 }>(ahead, i, n);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ahead, i, n);
}

/// One prefetch with hint `HINT` per 64 bytes of `ahead[i * n..(i + 1) * n]`
/// (see [`prefetch_part`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_hinted<T, const HINT: i32>(ahead: &[T], i: usize, n: usize) {
    let size = std::mem::size_of::<T>();
    if i * n >= ahead.len() {
        return;
    }
    prefetch_lines::<HINT>(ahead.as_ptr().cast::<i8>().wrapping_add(i * n * size), n * size);
}

/// A prefetch with hint `HINT` per 64 bytes of the `bytes` from `base`,
/// which may lie anywhere (see [`prefetch_line`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_lines<const HINT: i32>(base: *const i8, bytes: usize) {
    let mut at = 0;
    while at < bytes {
        prefetch_line::<HINT>(base.wrapping_add(at));
        at += 64;
    }
}

/// A prefetch with hint `HINT` of the line at `p`, which may lie anywhere
/// (past a slice's end too): callers compute it with `wrapping_add`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_line<const HINT: i32>(p: *const i8) {
    // SAFETY: a prefetch reads nothing, writes nothing and cannot fault,
    // whatever the address; `p` is never dereferenced.
    unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(p) };
}

/// How far past a store a pass into a large output asks for the output's
/// line for writing ([`prefetch_write_ahead`]): 1 KiB.
///
/// Measured on a 2-core AVX-512 Xeon (BENCHMARKS.md, sessions 61 and 62),
/// interleaved in one process: the stores then find their lines owned,
/// where each waited on the line's read for ownership; 512 B to 4 KiB
/// ahead all measured alike.
pub(crate) const WRITE_AHEAD_BYTES: usize = 1024;

/// `prefetchw` of the line [`WRITE_AHEAD_BYTES`] past `p`, where a pass
/// storing at `p` will store soon: that line in this core's cache, owned,
/// ready to be written. `p` may lie anywhere (past a slice's end too): the
/// prefetch cannot fault. Callers take it only where [`writes_ahead`]:
/// Intel's AVX-512 cores, where it pays (AVX2 passes are as they were).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
pub(crate) fn prefetch_write_ahead<T>(p: *const T) {
    prefetch_write(p.cast::<i8>().wrapping_add(WRITE_AHEAD_BYTES), 1);
}

/// [`prefetch_write_ahead`] for a pass that stores downwards: the line
/// [`WRITE_AHEAD_BYTES`] below `p`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
pub(crate) fn prefetch_write_below<T>(p: *const T) {
    prefetch_write(p.cast::<i8>().wrapping_sub(WRITE_AHEAD_BYTES), 1);
}

/// [`prefetch_write_ahead`] for each line of `row`, a row about to be
/// written: the lines [`WRITE_AHEAD_BYTES`] past its own.
#[inline(always)]
pub(crate) fn prefetch_row_write_ahead<T>(row: &[T]) {
    prefetch_write(row.as_ptr().cast::<i8>().wrapping_add(WRITE_AHEAD_BYTES), std::mem::size_of_val(row));
}

/// `prefetchw` per 64 bytes of the `bytes` from `p` (one for `1..=64`),
/// which may lie anywhere: what every write prefetch above issues; nothing
/// off x86-64.
#[inline(always)]
fn prefetch_write(p: *const i8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_ET0 }>(p, bytes);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}

/// Whether this CPU's passes ask for their output lines ahead
/// ([`prefetch_write_ahead`]): where [`dispatch`] runs AVX-512 (with
/// AVX512-BF16) on an Intel core. Code generic over the width asks
/// `Lanes::writes_ahead`, which adds that the width is AVX-512's.
///
/// On the 2-core Xeon VM (sessions 61-62) the prefetch gained up to 28%
/// (rms_norm f32 into reused outputs 4.97 -> 3.86 ms). On the 2-core Zen 4
/// VM (session 69; 4096x4096, two threads, the prefetch switched at run
/// time, interleaved, medians of 41) it gained nothing anywhere and cost up
/// to a tenth: without it, rms_norm backward bf16 0.90-0.92 of the time
/// into reused outputs and 0.94 into fresh huge pages, layer_norm forward
/// bf16 0.93-0.94 and rms_norm's 0.95-0.97 into fresh huge pages, rotary
/// f32 0.95-0.96 there, silu_and_mul f32 0.97 either way; every other row
/// 0.98-1.02. So AMD's cores, and any other vendor's, go without.
///
/// Detected once, and read as [`has_v4_bf16`] is: the loops that ask read
/// this per vector.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn writes_ahead() -> bool {
    static AHEAD: Flag = Flag::new();
    AHEAD.get(|| has_v4_bf16() && intel())
}

/// Whether this CPU is Intel's (`cpuid` leaf 0 says "GenuineIntel"),
/// detected once: where a prefetch measured faster on the Xeon VM and
/// slower on the Zen 4 one ([`writes_ahead`], layer_norm's backward).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn intel() -> bool {
    static INTEL: Flag = Flag::new();
    INTEL.get(|| {
        // Every x86-64 CPU has `cpuid`, and leaf 0 on all.
        let r = std::arch::x86_64::__cpuid(0);
        vendor_is_intel(r.ebx, r.edx, r.ecx)
    })
}

/// [`intel`] off x86-64 (which only x86-64 code asks, and the tests).
#[cfg(not(target_arch = "x86_64"))]
#[allow(dead_code)]
pub(crate) fn intel() -> bool {
    false
}

/// [`writes_ahead`] off x86-64: there is no `prefetchw` to ask with.
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub(crate) fn writes_ahead() -> bool {
    false
}

/// Whether `cpuid` leaf 0's vendor registers, in the order the string
/// takes them (`ebx`, `edx`, `ecx`), spell "GenuineIntel".
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn vendor_is_intel(ebx: u32, edx: u32, ecx: u32) -> bool {
    let mut v = [0u8; 12];
    for (k, r) in [ebx, edx, ecx].into_iter().enumerate() {
        v[4 * k..4 * k + 4].copy_from_slice(&r.to_le_bytes());
    }
    &v == b"GenuineIntel"
}

/// Runs `f(k, part)` over `out` in parts of [`PREFETCH_PART`] elements
/// (`part` is `out[k..k + PREFETCH_PART]`, shorter at the end), first
/// prefetching for reading the same range of each slice of `ahead` (as far
/// as it reaches): a write pass over one row that loads the next row while
/// it works.
#[inline(always)]
pub(crate) fn prefetching<T, U>(out: &mut [T], ahead: &[&[U]], mut f: impl FnMut(usize, &mut [T])) {
    for (i, part) in out.chunks_mut(PREFETCH_PART).enumerate() {
        prefetch_each(ahead, i, PREFETCH_PART);
        f(i * PREFETCH_PART, part);
    }
}

/// [`prefetch_part`] (for reading) of part `i` of each slice of `ahead`:
/// the next row's inputs, where a row has several.
#[inline(always)]
pub(crate) fn prefetch_each<T>(ahead: &[&[T]], i: usize, n: usize) {
    for a in ahead {
        prefetch_part::<T, false>(a, i, n);
    }
}

/// Elements per part of [`prefetching`].
pub(crate) const PREFETCH_PART: usize = 256;

/// Number of independent accumulators in reductions: enough lanes for two
/// AVX-512 registers of f32, so the loop is not bound by add latency.
pub(crate) const LANES: usize = 32;

/// Sum of `f(a_i, b_i)` with `LANES` independent accumulators, so the loop
/// vectorises and is not bound by the latency of one add chain.
#[inline(always)]
pub(crate) fn sum_pairs<T: Element>(a: &[T], b: &[T], f: impl Fn(T::Acc, T::Acc) -> T::Acc) -> T::Acc {
    let mut acc = [T::Acc::ZERO; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (ca, cb) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] = acc[i] + f(ca[i].to_acc(), cb[i].to_acc());
        }
    }
    let mut tail = T::Acc::ZERO;
    for (a, b) in ra.iter().zip(rb) {
        tail = tail + f(a.to_acc(), b.to_acc());
    }
    reduce_lanes(acc) + tail
}

/// Sum of `f(a_i)` over one slice, as [`sum_pairs`] does for two.
///
/// LLVM's vectorisation of these lane loops depends on the exact closure and
/// on the build: rms_norm's sum of squares compiled to full-width code in one
/// build and to scalar or two-lane code in another, which is why it now has
/// explicit AVX-512 code (`sum_squares.rs`; this loop is its fallback). Check
/// the disassembly (`perf annotate`) of a kernel after changing one of these.
#[inline(always)]
pub(crate) fn sum_map<T: Element>(a: &[T], f: impl Fn(T::Acc) -> T::Acc) -> T::Acc {
    let mut acc = [T::Acc::ZERO; LANES];
    let ca = a.chunks_exact(LANES);
    let ra = ca.remainder();
    for ca in ca {
        for i in 0..LANES {
            acc[i] = acc[i] + f(ca[i].to_acc());
        }
    }
    let mut tail = T::Acc::ZERO;
    for a in ra {
        tail = tail + f(a.to_acc());
    }
    reduce_lanes(acc) + tail
}

/// The two sums of `f(a_i, b_i, c_i)` (a pair) over three slices of equal
/// length, with `LANES` independent accumulators for each. The slices may
/// hold different element types of one accumulation type (a bf16 row and an
/// f32 one).
///
/// Written over `chunks_exact` with one named accumulator array per sum: the
/// same sums written with indices `base + i` stayed scalar, with the lanes on
/// the stack (rms_norm bf16 backward spent 60% of its time there), and an
/// array of accumulator arrays was kept on the stack too.
#[inline(always)]
pub(crate) fn sums3<T: Element, B: Element<Acc = T::Acc>, C: Element<Acc = T::Acc>>(
    a: &[T],
    b: &[B],
    c: &[C],
    f: impl Fn(T::Acc, T::Acc, T::Acc) -> (T::Acc, T::Acc),
) -> (T::Acc, T::Acc) {
    let (mut s, mut t) = ([T::Acc::ZERO; LANES], [T::Acc::ZERO; LANES]);
    let (ca, cb, cc) = (a.chunks_exact(LANES), b.chunks_exact(LANES), c.chunks_exact(LANES));
    let (ra, rb, rc) = (ca.remainder(), cb.remainder(), cc.remainder());
    for ((ca, cb), cc) in ca.zip(cb).zip(cc) {
        for i in 0..LANES {
            let (u, v) = f(ca[i].to_acc(), cb[i].to_acc(), cc[i].to_acc());
            s[i] = s[i] + u;
            t[i] = t[i] + v;
        }
    }
    let (mut su, mut sv) = (T::Acc::ZERO, T::Acc::ZERO);
    for ((a, b), c) in ra.iter().zip(rb).zip(rc) {
        let (u, v) = f(a.to_acc(), b.to_acc(), c.to_acc());
        su = su + u;
        sv = sv + v;
    }
    (reduce_lanes(s) + su, reduce_lanes(t) + sv)
}

/// The sum of the lanes of two 16-lane accumulators (as [`reduce_lanes`]).
#[inline(always)]
pub(crate) fn reduce2<A: Acc>(a0: [A; 16], a1: [A; 16]) -> A {
    let mut acc = [A::ZERO; LANES];
    acc[..16].copy_from_slice(&a0);
    acc[16..].copy_from_slice(&a1);
    reduce_lanes(acc)
}

/// Sum of `LANES` accumulators by a pairwise tree (vector adds, not a serial chain).
#[inline(always)]
pub(crate) fn reduce_lanes<A: Acc>(mut acc: [A; LANES]) -> A {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] = acc[i] + acc[i + width];
        }
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vendor_string_is_read_from_ebx_edx_ecx() {
        // "Genu" "ineI" "ntel" and "Auth" "enti" "cAMD", little-endian.
        assert!(vendor_is_intel(0x756e_6547, 0x4965_6e69, 0x6c65_746e));
        assert!(!vendor_is_intel(0x6874_7541, 0x6974_6e65, 0x444d_4163));
        // The same words in cpuid's register order (ebx, ecx, edx) are not it.
        assert!(!vendor_is_intel(0x756e_6547, 0x6c65_746e, 0x4965_6e69));
    }

    #[test]
    fn only_intels_avx512_with_bf16_writes_ahead() {
        assert_eq!(writes_ahead(), has_v4_bf16() && intel());
        #[cfg(target_arch = "x86_64")]
        {
            let r = std::arch::x86_64::__cpuid(0);
            assert_eq!(intel(), vendor_is_intel(r.ebx, r.edx, r.ecx));
        }
    }
}
