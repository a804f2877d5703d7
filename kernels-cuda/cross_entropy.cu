// Fused cross-entropy over logits [rows, cols] and int64 targets [rows], with
// label smoothing ls, ignore_index and class weights w ([cols] of T, or null);
// no log-softmax is stored.
//
// Forward, two launches:
//   cross_entropy_rows_*: one block per row, loss[row] (f32) =
//     lse - (1 - ls) x[t] - ls * mean(x); 0 for an ignored row, NaN for a bad
//     target (outside [0, cols) and not ignore_index). One read of the row:
//     max, sum of exp and sum together (online softmax). When lse is not
//     null, lse[row] = the row's log-sum-exp (0 for ignored and bad rows;
//     -inf for a row of -inf only, as torch.logsumexp: row_lse).
//     With weights: (1 - ls) w[t] (lse - x[t]) + ls / cols (W lse - sum(w x)),
//     W = sum(w), sum(w x) and W from the same read of the row (w beside it).
//     The sums over the row are of x - c, c = x[0] (0 where that is not
//     finite), and lse - c = (max - c) + log(sum of exp): each term of the
//     loss is then of the size of the logits' spread, not of their offset,
//     whose rounding cancelled (f32 logits near 1000 lost 1e-5 of the loss;
//     kernels-cpu/src/cross_entropy.rs shifts by the max, which it has before
//     these sums: this one pass has it only at the end).
//   cross_entropy_reduce_*: one block; counts the rows (status[0] = bad
//     targets, status[1] = the float bits of what "mean" divides by: the rows
//     not ignored, or with weights the sum of their targets' weights) and
//     writes the output: the row losses cast to T (reduction 0 = "none"), or
//     their mean (1) or sum (2) over the rows not ignored (NaN when a target
//     is bad, and for a mean over no weight, as torch's).
// Backward: cross_entropy_count (one block, the same status), then
//   cross_entropy_bwd_*: one block per row, taking the row's lse from the
//   forward, or recomputing it when lse is null or |lse| >= 64 (one read, as
//   above), then
//   the gradient (one more read, and the write):
//   dx = g (softmax(x) - ls / cols) - g (1 - ls) [j == t], g = the row's loss
//   gradient (grad[row], or grad[0], over status[1] for "mean", NaN where
//   that is 0, as torch's); 0 for
//   ignored rows, NaN for bad ones. With weights, g (A softmax(x) - ls / cols
//   w[j]) - g (1 - ls) w[t] [j == t], A = (1 - ls) w[t] + ls W / cols (W
//   summed once per block).
// The caller reads status[0] back and raises an error when it is not 0; where
// it cannot (during CUDA graph capture) the NaNs are the only sign.
// exp is __expf for f16 and bf16 logits (common.cuh's FastMath; the lse then
// within about 2e-6 of the precise one), expf for f32; log is logf.
#include "common.cuh"

using namespace keel;

__device__ __forceinline__ bool bad_target(int64_t t, int cols) { return t < 0 || t >= cols; }

// The log-sum-exp from the row's max m and log(sum of exp(x - m)): -inf for a
// row of -inf only (as torch.logsumexp), whose sum is NaN (exp(-inf - -inf));
// its loss stays NaN, as torch's.
__device__ __forceinline__ float row_lse(float m, float ln_s) { return m == -INFINITY ? m : m + ln_s; }

// The weight of a row's class t (in range): w[t], or 1 without weights.
template <typename T>
__device__ __forceinline__ float class_weight(const T* __restrict__ w, int64_t t) {
  return w ? to_f32(w[t]) : 1.f;
}

// status[0] = bad targets, status[1] = the float bits of the rows not ignored
// (bad ones excluded), or with weights of the sum of their targets' weights.
template <typename T>
__device__ __forceinline__ void count_targets(const int64_t* __restrict__ target, const T* __restrict__ w,
                                              int* __restrict__ status, int64_t rows, int cols, int64_t ignore,
                                              float* scratch) {
  float bad = 0.f, valid = 0.f;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) {
    const int64_t t = target[i];
    if (t == ignore) continue;
    if (bad_target(t, cols)) bad += 1.f; else valid += class_weight(w, t);
  }
  bad = block_sum(bad, scratch);
  valid = block_sum(valid, scratch);
  if (threadIdx.x == 0) {
    status[0] = (int)bad;
    status[1] = __float_as_int(valid);
  }
}

// The shift of a row's sums (ce_rows): its first logit, or 0 where that is
// not finite (a masked -inf would make every x - c infinite).
template <typename T>
__device__ __forceinline__ float row_shift(const T* __restrict__ xr) {
  const float c = to_f32(xr[0]);
  return isfinite(c) ? c : 0.f;
}

template <typename T>
__device__ __forceinline__ void ce_rows(const T* __restrict__ x, const int64_t* __restrict__ target,
                                        const T* __restrict__ w, float* __restrict__ loss, float* __restrict__ lse,
                                        int64_t rows, int cols, int64_t ignore, float ls) {
  __shared__ float scratch[128];
  constexpr bool Fast = FastMath<T>::value;
  const bool vec = cols % Pack<T>::N == 0 && aligned16(x) && (!w || aligned16(w));
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t t = target[row];
    if (t == ignore || bad_target(t, cols)) {
      if (threadIdx.x == 0) {
        loss[row] = t == ignore ? 0.f : NAN;
        if (lse) lse[row] = 0.f;
      }
      continue;
    }
    const T* xr = x + row * cols;
    const float c = row_shift(xr);
    if (w && ls > 0.f) {
      // sum(w (x - c)) and W with the max and sum of exp, as ce_probs_rows.
      float m = -INFINITY, s = 0.f, dot = 0.f, ws = 0.f;
      row_each2(xr, w, cols, vec, [&](int, float v, float q) {
        online_add<Fast>(v, m, s);
        dot += q * (v - c);
        ws += q;
      });
      const float bm = block_max(m, scratch);
      const float4 sums = block_sum4(make_float4(s * exp_<Fast>(m - bm), dot, ws, 0.f), scratch);
      if (threadIdx.x == 0) {
        const float ln_s = logf(sums.x);
        const float hit = (bm - to_f32(xr[t])) + ln_s;  // lse - x[t]
        loss[row] = (1.f - ls) * to_f32(w[t]) * hit + ls / cols * (sums.z * ((bm - c) + ln_s) - sums.y);
        if (lse) lse[row] = row_lse(bm, ln_s);
      }
      continue;
    }
    float sx = 0.f;
    const float2 ms = row_max_sumexp(xr, cols, vec, 1.f, scratch, ls > 0.f ? &sx : nullptr, c);
    if (threadIdx.x == 0) {
      const float ln_s = logf(ms.y);
      // (1 - ls) (lse - x[t]) + ls (lse - mean(x)); without label smoothing,
      // a weight scales the whole row's loss.
      const float hit = (ms.x - to_f32(xr[t])) + ln_s;
      const float spread = ls > 0.f ? (ms.x - c) + ln_s - sx / cols : 0.f;
      loss[row] = class_weight(w, t) * ((1.f - ls) * hit + ls * spread);
      if (lse) lse[row] = row_lse(ms.x, ln_s);
    }
  }
}

template <typename T>
__device__ __forceinline__ void ce_reduce(const float* __restrict__ loss, const int64_t* __restrict__ target,
                                          const T* __restrict__ w, int* __restrict__ status, T* __restrict__ out,
                                          int64_t rows, int cols, int64_t ignore, int reduction) {
  __shared__ float scratch[32];
  count_targets(target, w, status, rows, cols, ignore, scratch);
  if (reduction == 0) {
    for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) out[i] = from_f32<T>(loss[i]);
    return;
  }
  float s = 0.f, valid = 0.f;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) {
    const int64_t t = target[i];
    if (t != ignore) {  // a bad target's NaN loss makes the result NaN
      s += loss[i];
      valid += bad_target(t, cols) ? 1.f : class_weight(w, t);
    }
  }
  s = block_sum(s, scratch);
  valid = block_sum(valid, scratch);
  // "mean" over no weight (every row ignored, or every target's weight 0) is
  // NaN, as torch's, even where label smoothing leaves s above 0.
  if (threadIdx.x == 0) out[0] = from_f32<T>(reduction == 1 ? (valid == 0.f ? NAN : s / valid) : s);
}

template <typename T>
__device__ __forceinline__ void ce_bwd(const T* __restrict__ grad, const T* __restrict__ x,
                                       const int64_t* __restrict__ target, const T* __restrict__ w,
                                       const float* __restrict__ lse, const int* __restrict__ status,
                                       T* __restrict__ dx, int64_t rows, int cols, int64_t ignore, float ls,
                                       int reduction) {
  __shared__ float scratch[32];
  const bool vec = cols % Pack<T>::N == 0 && aligned16(x) && aligned16(dx);
  // With weights and label smoothing: W = sum(w), once per block (the same
  // condition for every thread).
  const bool smooth_w = w && ls > 0.f;
  float total = 0.f;
  if (smooth_w) {
    for (int j = threadIdx.x; j < cols; j += blockDim.x) total += to_f32(w[j]);
    total = block_sum(total, scratch);
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t t = target[row];
    const T* xr = x + row * cols;
    T* dr = dx + row * cols;
    if (t == ignore || bad_target(t, cols)) {
      const float fill = t == ignore ? 0.f : NAN;
      row_map(xr, dr, cols, vec, [&](int, float) { return fill; });
      continue;
    }
    float g = to_f32(grad[reduction == 0 ? row : 0]);
    if (reduction == 1) {  // NaN over no weight, as the forward's mean
      const float over = __int_as_float(status[1]);
      g = over == 0.f ? NAN : g / over;
    }
    // exp(x - m) / s: m = lse and s = 1 when the forward left the lse and
    // |lse| < 64 (LSE_TRUSTED_BELOW in kernels-cpu/src/cross_entropy.rs: lse's
    // rounding is a relative error of every probability, 2^-24 |lse|); the
    // same for every thread of the block, so all of them take one branch.
    const bool trusted = lse && fabsf(lse[row]) < 64.f;
    const float2 ms = trusted ? make_float2(lse[row], 1.f) : row_max_sumexp(xr, cols, vec, 1.f, scratch);
    const float wt = class_weight(w, t);
    if (smooth_w) {
      const float a = (1.f - ls) * wt + ls * total / cols;
      const float gs = g * a / ms.y, off = g * ls / cols, hot = g * (1.f - ls) * wt;
      row_map(xr, dr, cols, vec, [&](int j, float v) {
        return exp_<FastMath<T>::value>(v - ms.x) * gs - off * to_f32(w[j]) - (j == t ? hot : 0.f);
      });
      continue;
    }
    // Without label smoothing a weight scales the row's gradient (1 without weights).
    g *= wt;
    const float gs = g / ms.y, off = g * ls / cols, hot = g * (1.f - ls);
    row_map(xr, dr, cols, vec,
            [&](int j, float v) { return exp_<FastMath<T>::value>(v - ms.x) * gs - off - (j == t ? hot : 0.f); });
  }
}

#define KEEL_CROSS_ENTROPY(SUFFIX, T)                                                                          \
  extern "C" __global__ void cross_entropy_rows_##SUFFIX(const T* x, const int64_t* target, const T* w,       \
                                                         float* loss, float* lse, int64_t rows, int cols,     \
                                                         int64_t ignore, float ls) {                          \
    ce_rows<T>(x, target, w, loss, lse, rows, cols, ignore, ls);                                               \
  }                                                                                                            \
  extern "C" __global__ void cross_entropy_reduce_##SUFFIX(const float* loss, const int64_t* target,          \
                                                           const T* w, int* status, T* out, int64_t rows,     \
                                                           int cols, int64_t ignore, int reduction) {         \
    ce_reduce<T>(loss, target, w, status, out, rows, cols, ignore, reduction);                                 \
  }                                                                                                            \
  extern "C" __global__ void cross_entropy_count_##SUFFIX(const int64_t* target, const T* w, int* status,     \
                                                          int64_t rows, int cols, int64_t ignore) {           \
    __shared__ float scratch[32];                                                                              \
    count_targets<T>(target, w, status, rows, cols, ignore, scratch);                                          \
  }                                                                                                            \
  extern "C" __global__ void cross_entropy_bwd_##SUFFIX(const T* grad, const T* x, const int64_t* target,     \
                                                        const T* w, const float* lse, const int* status,      \
                                                        T* dx, int64_t rows, int cols, int64_t ignore,        \
                                                        float ls, int reduction) {                            \
    ce_bwd<T>(grad, x, target, w, lse, status, dx, rows, cols, ignore, ls, reduction);                         \
  }

KEEL_CROSS_ENTROPY(f32, float)
KEEL_CROSS_ENTROPY(f16, __half)
KEEL_CROSS_ENTROPY(bf16, __nv_bfloat16)

// Against probabilities: target p [rows, cols] of P (the logits' dtype T, or
// another of float, half and bfloat16: the _p{P} kernels below, which read it
// as it is; the class weights have P's type, the loss and its gradient are
// float, as torch promotes them), q =
// (1 - ls) p + ls / cols, no row ignored (kernels-cpu/src/cross_entropy_probs.rs).
//   cross_entropy_probs_rows_*: one block per row, one read of x and p: the
//     online max and sum of exp, with sum(p x), sum(p) and sum(x); loss[row]
//     (f32) = (1 - ls) (sum(p) lse - sum(p x)) + ls (lse - mean(x)), and
//     lse[row] when lse is not null.
//   cross_entropy_probs_reduce_*: one block; the row losses cast to T ("none"),
//     or their mean over the rows (NaN for none) or sum.
//   cross_entropy_probs_bwd_*: one block per row: sum(p) (with the max and sum
//     of exp where the forward's lse is not given or not trusted, as
//     cross_entropy_bwd_*), then dx = g (A exp(x - m) / s - (1 - ls) p - ls /
//     cols), A = (1 - ls) sum(p) + ls, in one more read of x and p.
// Class weights w [cols] (of P; null for none) make the target a = w q: the
// sums take a for q (loss = sum(a) lse - sum(a x)), A = sum(a), and dx = g (A
// exp(x - m) / s - a), w read beside each element (a row's worth, from cache).
template <typename T, typename P>
__device__ __forceinline__ void ce_probs_rows(const T* __restrict__ x, const P* __restrict__ p,
                                              const P* __restrict__ w, float* __restrict__ loss,
                                              float* __restrict__ lse, int64_t rows, int cols, float ls) {
  __shared__ float scratch[128];
  constexpr bool Fast = FastMath<T>::value;
  const bool vec = cols % Pack<T>::N == 0 && aligned16(x) && aligned16(p);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    float m = -INFINITY, s = 0.f, dot = 0.f, ps = 0.f, sx = 0.f;
    // Sums of x - c, as ce_rows: sum(a (lse - x)) = A (lse - c) - sum(a (x - c)).
    const float c = row_shift(x + row * cols);
    if (w) {
      const float c1 = 1.f - ls, c0 = ls / cols;
      row_each2(x + row * cols, p + row * cols, cols, vec, [&](int j, float v, float q) {
        online_add<Fast>(v, m, s);
        const float a = to_f32(w[j]) * (q * c1 + c0);
        dot += a * (v - c);
        ps += a;
      });
    } else {
      row_each2(x + row * cols, p + row * cols, cols, vec, [&](int, float v, float q) {
        online_add<Fast>(v, m, s);
        dot += q * (v - c);
        ps += q;
        sx += v - c;
      });
    }
    const float bm = block_max(m, scratch);
    // As row_max_sumexp: each thread's sum moved to the block's maximum.
    const float4 sums = block_sum4(make_float4(s * exp_<Fast>(m - bm), dot, ps, sx), scratch);
    if (threadIdx.x == 0) {
      const float ln_s = logf(sums.x);
      const float lc = (bm - c) + ln_s;  // lse - c
      loss[row] = w ? sums.z * lc - sums.y : (1.f - ls) * (sums.z * lc - sums.y) + ls * (lc - sums.w / cols);
      if (lse) lse[row] = row_lse(bm, ln_s);
    }
  }
}

template <typename T>
__device__ __forceinline__ void ce_probs_reduce(const float* __restrict__ loss, T* __restrict__ out, int64_t rows,
                                                int reduction) {
  __shared__ float scratch[32];
  if (reduction == 0) {
    for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) out[i] = from_f32<T>(loss[i]);
    return;
  }
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) s += loss[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) out[0] = from_f32<T>(reduction == 1 ? s / (float)rows : s);
}

template <typename T, typename P, typename G>
__device__ __forceinline__ void ce_probs_bwd(const G* __restrict__ grad, const T* __restrict__ x,
                                             const P* __restrict__ p, const P* __restrict__ w,
                                             const float* __restrict__ lse, T* __restrict__ dx, int64_t rows,
                                             int cols, float ls, int reduction) {
  __shared__ float scratch[64];
  constexpr bool Fast = FastMath<T>::value;
  const bool vec = cols % Pack<T>::N == 0 && aligned16(x) && aligned16(p) && aligned16(dx);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    const P* pr = p + row * cols;
    float g = to_f32(grad[reduction == 0 ? row : 0]);
    if (reduction == 1) g /= (float)rows;
    // The same for every thread of the block: all take one branch.
    const bool trusted = lse && fabsf(lse[row]) < 64.f;
    const float c1 = 1.f - ls, c0 = ls / cols;
    // The target's sum: sum(p), or sum(a) with weights.
    const auto term = [&](int j, float q) { return w ? to_f32(w[j]) * (q * c1 + c0) : q; };
    float m, s, ps = 0.f;
    if (trusted) {
      // The target's row alone, in packs of P (16-byte aligned where P is at
      // least T's width; a narrower P's rows are where cols is a multiple of
      // its pack).
      row_each(pr, cols, vec && cols % Pack<P>::N == 0, [&](int j, float q) { ps += term(j, q); });
      ps = block_sum(ps, scratch);
      m = lse[row];
      s = 1.f;
    } else {
      float mt = -INFINITY, st = 0.f;
      row_each2(xr, pr, cols, vec, [&](int j, float v, float q) {
        online_add<Fast>(v, mt, st);
        ps += term(j, q);
      });
      m = block_max(mt, scratch);
      const float2 sums = block_sum2(make_float2(st * exp_<Fast>(mt - m), ps), scratch);
      s = sums.x;
      ps = sums.y;
    }
    const float gp = g * c1, off = g * c0;
    if (w) {
      const float ga = g * ps / s;
      row_map2(xr, pr, dx + row * cols, cols, vec,
               [&](int j, float v, float q) { return exp_<Fast>(v - m) * ga - to_f32(w[j]) * (q * gp + off); });
    } else {
      const float ga = g * (c1 * ps + ls) / s;
      row_map2(xr, pr, dx + row * cols, cols, vec,
               [&](int, float v, float q) { return exp_<Fast>(v - m) * ga - (q * gp + off); });
    }
  }
}

// The rows and backward kernels: cross_entropy_{KIND}_{rows,bwd}_{SUFFIX}, logits
// of T, the target and class weights of P, the loss's gradient of G (torch's
// promotion of T and P).
#define KEEL_CROSS_ENTROPY_PROBS_ROWS_BWD(KIND, SUFFIX, T, P, G)                                                \
  extern "C" __global__ void cross_entropy_##KIND##_rows_##SUFFIX(const T* x, const P* p, const P* w,           \
                                                               float* loss, float* lse, int64_t rows,           \
                                                               int cols, float ls) {                            \
    ce_probs_rows<T, P>(x, p, w, loss, lse, rows, cols, ls);                                                    \
  }                                                                                                             \
  extern "C" __global__ void cross_entropy_##KIND##_bwd_##SUFFIX(const G* grad, const T* x, const P* p,         \
                                                              const P* w, const float* lse, T* dx,              \
                                                              int64_t rows, int cols, float ls,                 \
                                                              int reduction) {                                  \
    ce_probs_bwd<T, P, G>(grad, x, p, w, lse, dx, rows, cols, ls, reduction);                                   \
  }

#define KEEL_CROSS_ENTROPY_PROBS(SUFFIX, T)                                                                     \
  KEEL_CROSS_ENTROPY_PROBS_ROWS_BWD(probs, SUFFIX, T, T, T)                                                     \
  extern "C" __global__ void cross_entropy_probs_reduce_##SUFFIX(const float* loss, T* out, int64_t rows,       \
                                                                 int reduction) {                               \
    ce_probs_reduce<T>(loss, out, rows, reduction);                                                             \
  }

KEEL_CROSS_ENTROPY_PROBS(f32, float)
KEEL_CROSS_ENTROPY_PROBS(f16, __half)
KEEL_CROSS_ENTROPY_PROBS(bf16, __nv_bfloat16)

// Probabilities of another dtype than the logits, read as they are (no
// widened copy): cross_entropy_probs_p{P}_{rows,bwd}_{T}. float32
// probabilities of 16-bit logits (a teacher's softmax against a student's
// logits), and 16-bit probabilities of float32 logits or of the other 16-bit
// type. The class weights have the target's type; the loss is float (torch's
// promotion of the pair), written by cross_entropy_probs_reduce_f32, and its
// gradient is read as float.
KEEL_CROSS_ENTROPY_PROBS_ROWS_BWD(probs_pf32, f16, __half, float, float)
KEEL_CROSS_ENTROPY_PROBS_ROWS_BWD(probs_pf32, bf16, __nv_bfloat16, float, float)
KEEL_CROSS_ENTROPY_PROBS_ROWS_BWD(probs_pf16, f32, float, __half, float)
KEEL_CROSS_ENTROPY_PROBS_ROWS_BWD(probs_pbf16, f32, float, __nv_bfloat16, float)
KEEL_CROSS_ENTROPY_PROBS_ROWS_BWD(probs_pbf16, f16, __half, __nv_bfloat16, float)
KEEL_CROSS_ENTROPY_PROBS_ROWS_BWD(probs_pf16, bf16, __nv_bfloat16, __half, float)
