// rms_norm forward and backward over the last dimension.
//
// One block per row (grid-stride over rows), 128-bit vector loads when the
// row length is a multiple of 16 bytes and the pointers are aligned (scalar
// loads otherwise, of the same columns per thread: the same bits either way),
// f32 accumulation, block sums by warp shuffle.
// Both read x's rows where a strided view puts them: row r, as the index
// (i0, i1, i2) of leading dims of sizes (-, n1, n2), starts at
// i0 s0 + i1 s1 + i2 s2 (a contiguous x: n1 = 1, n2 = rows, s2 = cols); the
// other tensors are contiguous.
// Kernel symbols: rms_norm_{fwd,bwd,bwd_dw}_{f32,f16,bf16}.
#include "common.cuh"

using namespace keel;

// Where row `row` of a strided x starts (see above).
__device__ __forceinline__ int64_t row_offset(int64_t row, int64_t n1, int64_t n2, int64_t s0, int64_t s1,
                                              int64_t s2) {
  const int64_t t = row / n2, i2 = row - t * n2, i0 = t / n1, i1 = t - i0 * n1;
  return i0 * s0 + i1 * s1 + i2 * s2;
}

template <typename T>
__device__ __forceinline__ void rms_norm_fwd(const T* __restrict__ x, const T* __restrict__ w,
                                             T* __restrict__ y, int64_t rows, int cols, float eps, int64_t n1,
                                             int64_t n2, int64_t s0, int64_t s1, int64_t s2) {
  __shared__ float scratch[32];
  constexpr int N = Pack<T>::N;
  const bool vec = cols % N == 0 && s0 % N == 0 && s1 % N == 0 && s2 % N == 0 && aligned16(x) && aligned16(y) &&
                   (w == nullptr || aligned16(w));
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row_offset(row, n1, n2, s0, s1, s2);
    T* yr = y + row * cols;
    float ss = 0.f;
    if (vec) {
      for (int i = threadIdx.x; i < cols / N; i += blockDim.x) {
        Pack<T> p = load_pack(xr + i * N);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          float f = to_f32(p.v[k]);
          ss += f * f;
        }
      }
    } else {
      scalar_cols<T>(cols, [&](int i) {
        const float f = to_f32(xr[i]);
        ss += f * f;
      });
    }
    const float r = rsqrtf(block_sum(ss, scratch) / cols + eps);
    if (vec) {
      for (int i = threadIdx.x; i < cols / N; i += blockDim.x) {
        Pack<T> p = load_pack(xr + i * N), o;
        Pack<T> pw;
        if (w) pw = load_pack(w + i * N);
#pragma unroll
        for (int k = 0; k < N; ++k) o.v[k] = from_f32<T>(to_f32(p.v[k]) * r * (w ? to_f32(pw.v[k]) : 1.f));
        store_pack(yr + i * N, o);
      }
    } else {
      scalar_cols<T>(cols, [&](int i) { yr[i] = from_f32<T>(to_f32(xr[i]) * r * (w ? to_f32(w[i]) : 1.f)); });
    }
  }
}

// dx = r * dy * w - x * r^3 * sum(dy * w * x) / n (+ add, when given: the
// gradient arriving at fused_add_rms_norm's sum output). When dw_partial is given,
// block b adds dy * x * r into dw_partial[b * cols + j] (its own row: no atomics);
// rms_norm_bwd_dw then sums the gridDim.x rows.
template <typename T>
__device__ __forceinline__ void rms_norm_bwd(const T* __restrict__ dy, const T* __restrict__ add,
                                             const T* __restrict__ x, const T* __restrict__ w,
                                             T* __restrict__ dx, float* __restrict__ dw_partial, int64_t rows,
                                             int cols, float eps, int64_t n1, int64_t n2, int64_t s0, int64_t s1,
                                             int64_t s2) {
  __shared__ float scratch[32];
  constexpr int N = Pack<T>::N;
  const bool vec = cols % N == 0 && s0 % N == 0 && s1 % N == 0 && s2 % N == 0 && aligned16(x) && aligned16(dy) &&
                   aligned16(dx) && (w == nullptr || aligned16(w)) && (add == nullptr || aligned16(add));
  float* part = dw_partial ? dw_partial + (int64_t)blockIdx.x * cols : nullptr;
  if (part) {
    for (int j = threadIdx.x; j < cols; j += blockDim.x) part[j] = 0.f;
    __syncthreads();  // the vector loop below maps columns to threads differently
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row_offset(row, n1, n2, s0, s1, s2);
    const T* gr = dy + row * cols;
    const T* ar = add ? add + row * cols : nullptr;
    T* dxr = dx + row * cols;
    float ss = 0.f, gx = 0.f;
    if (vec) {
      for (int i = threadIdx.x; i < cols / N; i += blockDim.x) {
        Pack<T> px = load_pack(xr + i * N), pg = load_pack(gr + i * N), pw;
        if (w) pw = load_pack(w + i * N);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          float fx = to_f32(px.v[k]);
          ss += fx * fx;
          gx += to_f32(pg.v[k]) * (w ? to_f32(pw.v[k]) : 1.f) * fx;
        }
      }
    } else {
      scalar_cols<T>(cols, [&](int i) {
        const float fx = to_f32(xr[i]);
        ss += fx * fx;
        gx += to_f32(gr[i]) * (w ? to_f32(w[i]) : 1.f) * fx;
      });
    }
    ss = block_sum(ss, scratch);
    gx = block_sum(gx, scratch);
    const float r = rsqrtf(ss / cols + eps);
    const float c = r * r * r * gx / cols;
    if (vec) {
      for (int i = threadIdx.x; i < cols / N; i += blockDim.x) {
        Pack<T> px = load_pack(xr + i * N), pg = load_pack(gr + i * N), pw, pa, o;
        if (w) pw = load_pack(w + i * N);
        if (ar) pa = load_pack(ar + i * N);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          float fx = to_f32(px.v[k]), fg = to_f32(pg.v[k]);
          o.v[k] = from_f32<T>(r * fg * (w ? to_f32(pw.v[k]) : 1.f) - fx * c + (ar ? to_f32(pa.v[k]) : 0.f));
          if (part) part[i * N + k] += fg * fx * r;
        }
        store_pack(dxr + i * N, o);
      }
    } else {
      scalar_cols<T>(cols, [&](int i) {
        const float fx = to_f32(xr[i]), fg = to_f32(gr[i]);
        dxr[i] = from_f32<T>(r * fg * (w ? to_f32(w[i]) : 1.f) - fx * c + (ar ? to_f32(ar[i]) : 0.f));
        if (part) part[i] += fg * fx * r;
      });
    }
  }
}

#define KEEL_RMS_NORM(SUFFIX, T)                                                                  \
  extern "C" __global__ void rms_norm_fwd_##SUFFIX(const T* x, const T* w, T* y, int64_t rows,    \
                                                   int cols, float eps, int64_t n1, int64_t n2,  \
                                                   int64_t s0, int64_t s1, int64_t s2) {         \
    rms_norm_fwd<T>(x, w, y, rows, cols, eps, n1, n2, s0, s1, s2);                                \
  }                                                                                               \
  extern "C" __global__ void rms_norm_bwd_##SUFFIX(const T* dy, const T* add, const T* x,       \
                                                   const T* w, T* dx, float* dw_partial,          \
                                                   int64_t rows, int cols, float eps, int64_t n1, \
                                                   int64_t n2, int64_t s0, int64_t s1,            \
                                                   int64_t s2) {                                  \
    rms_norm_bwd<T>(dy, add, x, w, dx, dw_partial, rows, cols, eps, n1, n2, s0, s1, s2);          \
  }                                                                                               \
  extern "C" __global__ void rms_norm_bwd_dw_##SUFFIX(const float* partial, T* dw, int parts,     \
                                                      int cols) {                                \
    sum_parts<T>(partial, dw, parts, cols);                                                       \
  }

KEEL_RMS_NORM(f32, float)
KEEL_RMS_NORM(f16, __half)
KEEL_RMS_NORM(bf16, __nv_bfloat16)
