// fused_add_rms_norm forward: s = x + r (rounded to T, stored), y = rms_norm(s) * w
// (s / rms rounded to T before the weight where ROUND: rms_normed).
//
// One block per row (grid-stride over rows), 128-bit vector access when the
// row length is a multiple of 16 bytes and every pointer is aligned. Each
// thread re-reads only the elements of s it stored itself, so no barrier is
// needed between the two passes. The backward is rms_norm_bwd with `add`.
//
// In place (vLLM's form), s is r and y is x: every element is read, then
// written, by one thread, so the passes stay correct; the in-place kernels
// read with ordinary loads (the read-only path must not see memory the kernel
// writes) and their pointers are not __restrict__.
// Kernel symbols: fused_add_rms_norm_fwd_{f32,f16,bf16},
// fused_add_rms_norm_inplace_{f32,f16,bf16}.
#include "common.cuh"

using namespace keel;

// The rows; the callers own the aliasing promises (see the entry points).
template <bool InPlace, bool ROUND, typename T>
__device__ __forceinline__ void fused_add_rms_norm_rows(const T* x, const T* r, const T* w, T* y, T* s, int64_t rows,
                                                        int cols, float eps) {
  __shared__ float scratch[32];
  constexpr int N = Pack<T>::N;
  const bool vec = cols % N == 0 && aligned16(x) && aligned16(r) && aligned16(y) && aligned16(s) &&
                   (w == nullptr || aligned16(w));
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    const T* rr = r + row * cols;
    T* yr = y + row * cols;
    T* sr = s + row * cols;
    float ss = 0.f;
    if (vec) {
      for (int i = threadIdx.x; i < cols / N; i += blockDim.x) {
        Pack<T> px = load_in<InPlace>(xr + i * N), pr = load_in<InPlace>(rr + i * N), o;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          o.v[k] = from_f32<T>(to_f32(px.v[k]) + to_f32(pr.v[k]));
          const float f = to_f32(o.v[k]);
          ss = fmaf(f, f, ss);
        }
        store_pack(sr + i * N, o);
      }
    } else {
      scalar_cols<T>(cols, [&](int i) {
        const T v = from_f32<T>(to_f32(xr[i]) + to_f32(rr[i]));
        sr[i] = v;
        ss = fmaf(to_f32(v), to_f32(v), ss);
      });
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / cols + eps);
    if (vec) {
      for (int i = threadIdx.x; i < cols / N; i += blockDim.x) {
        // Written by this thread above: an ordinary (not __ldg) load.
        Pack<T> p = *reinterpret_cast<const Pack<T>*>(sr + i * N), pw, o;
        if (w) pw = load_pack(w + i * N);
#pragma unroll
        for (int k = 0; k < N; ++k)
          o.v[k] = from_f32<T>(w ? rms_normed<ROUND, T>(to_f32(p.v[k]), inv) * to_f32(pw.v[k]) : to_f32(p.v[k]) * inv);
        store_pack(yr + i * N, o);
      }
    } else {
      scalar_cols<T>(cols, [&](int i) {
        yr[i] = from_f32<T>(w ? rms_normed<ROUND, T>(to_f32(sr[i]), inv) * to_f32(w[i]) : to_f32(sr[i]) * inv);
      });
    }
  }
}

// Out of place: y and s overlap nothing.
template <bool ROUND, typename T>
__device__ __forceinline__ void fused_add_rms_norm_fwd(const T* __restrict__ x, const T* __restrict__ r,
                                                       const T* __restrict__ w, T* __restrict__ y,
                                                       T* __restrict__ s, int64_t rows, int cols, float eps) {
  fused_add_rms_norm_rows<false, ROUND>(x, r, w, y, s, rows, cols, eps);
}

// In place: r becomes the sum, x the output; x and r do not overlap.
template <bool ROUND, typename T>
__device__ __forceinline__ void fused_add_rms_norm_inplace(T* x, T* r, const T* __restrict__ w, int64_t rows,
                                                           int cols, float eps) {
  fused_add_rms_norm_rows<true, ROUND>(x, r, w, x, r, rows, cols, eps);
}

// `round` (0 or 1) picks ROUND.
#define KEEL_FUSED_ADD_RMS_NORM(SUFFIX, T)                                                                      \
  extern "C" __global__ void fused_add_rms_norm_fwd_##SUFFIX(const T* x, const T* r, const T* w, T* y,           \
                                                             T* s, int64_t rows, int cols, float eps,             \
                                                             int round) {                                         \
    if (round)                                                                                                    \
      fused_add_rms_norm_fwd<true, T>(x, r, w, y, s, rows, cols, eps);                                            \
    else                                                                                                          \
      fused_add_rms_norm_fwd<false, T>(x, r, w, y, s, rows, cols, eps);                                           \
  }                                                                                                               \
  extern "C" __global__ void fused_add_rms_norm_inplace_##SUFFIX(T* x, T* r, const T* w, int64_t rows, int cols, \
                                                                 float eps, int round) {                          \
    if (round)                                                                                                    \
      fused_add_rms_norm_inplace<true, T>(x, r, w, rows, cols, eps);                                              \
    else                                                                                                          \
      fused_add_rms_norm_inplace<false, T>(x, r, w, rows, cols, eps);                                             \
  }

KEEL_FUSED_ADD_RMS_NORM(f32, float)
KEEL_FUSED_ADD_RMS_NORM(f16, __half)
KEEL_FUSED_ADD_RMS_NORM(bf16, __nv_bfloat16)
