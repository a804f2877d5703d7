// Shared device helpers for Keel's kernels: element conversion, 16-byte
// vector access, and block-wide sums built on warp shuffles.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace keel {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// x r, the norms' normalised value, rounded to T first where ROUND: Hugging
// Face's LlamaRMSNorm and vLLM round it to the input dtype before the weight
// multiplies it (`weight * hidden.to(input_dtype)`); torch's F.rms_norm
// rounds once, at the end (Rust: rms_norm::Rounding).
template <bool ROUND, typename T> __device__ __forceinline__ float rms_normed(float x, float r) {
  const float v = x * r;
  return ROUND ? to_f32(from_f32<T>(v)) : v;
}

// 16 bytes of T: one 128-bit load or store.
template <typename T> struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T> __device__ __forceinline__ Pack<T> load_pack(const T* p) {
  Pack<T> out;
  *reinterpret_cast<uint4*>(&out) = __ldg(reinterpret_cast<const uint4*>(p));
  return out;
}

// One 128-bit store (STG.E.128). Written out in PTX: an assignment of the
// uint4 (plain, memcpy'd, make_uint4'd or __builtin_assume_aligned) let nvcc
// split it into four 32-bit (f32) or 16-bit-pair (f16, bf16) stores in every
// kernel but the gated ones: four times the store instructions and partial
// sector writes. __stwb and __stcg keep it whole but make it a strong store
// (STG.E.128.STRONG.SM / .GPU); this is the plain weak one. The "memory"
// clobber keeps it ordered with the loads and stores around it (the in-place
// kernels read back what they store). `p` must point to global memory (every
// caller stores an output row). Off the GPU (the CPU emulation of
// src/cuda/emu.rs) it is the assignment.
template <typename T> __device__ __forceinline__ void store_pack(T* p, const Pack<T>& v) {
  const uint4 u = *reinterpret_cast<const uint4*>(&v);
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(__cvta_generic_to_global(p)), "r"(u.x), "r"(u.y),
               "r"(u.z), "r"(u.w)
               : "memory");
#else
  *reinterpret_cast<uint4*>(p) = u;
#endif
}

// 16 bytes at p: through the read-only path, or (in place) an ordinary load.
template <bool InPlace, typename T> __device__ __forceinline__ Pack<T> load_in(const T* p) {
  if constexpr (InPlace) {
    return *reinterpret_cast<const Pack<T>*>(p);
  } else {
    return load_pack(p);
  }
}

// A product and a sum rounded on their own: nvcc never fuses __fmul_rn or
// __fadd_rn into an FMA (and fmaf is always one). Where a kernel has a
// vector loop and an element-wise one, the compiler's choice of what to
// fuse may differ between them; with every rounding spelled out both give the
// same bits.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }

// Whether kernels on T may take the hardware's approximations of exp and
// division (__expf, __fdividef: relative errors near 1e-6 for moderate
// arguments): for f16 and bf16, whose outputs keep 11 and 8 bits, not for f32.
template <typename T> struct FastMath {
  static constexpr bool value = true;
};
template <> struct FastMath<float> {
  static constexpr bool value = false;
};

// exp(x): precise, or __expf where Fast (see FastMath).
template <bool Fast> __device__ __forceinline__ float exp_(float x) { return Fast ? __expf(x) : expf(x); }

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Lanes a short row is read by (the rows of a warp-per-row kernel): the
// fewest, a power of two up to 32, that give none more than one of its
// `packs` vectors (all 32 for rows longer than that).
__device__ __forceinline__ int row_team(int packs) {
  int team = 32;
  while (team > 1 && team / 2 >= packs) team /= 2;
  return team;
}

// Sum of `v` over each aligned group of `team` lanes (a power of two up to
// 32), returned to each of them; the whole warp must call it. The last
// log2(team) steps of warp_sum: where the other lanes of a 32-lane sum hold
// zeros, the same bits.
__device__ __forceinline__ float team_sum(float v, int team) {
  for (int o = team / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of `v` over the block, returned to every thread. `scratch` holds 32
// floats of shared memory; the leading __syncthreads makes it safe to call
// again in a loop.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}

// The two sums of block_sum at once (the same bits as two calls), with one
// pair of barriers instead of two. `scratch` holds 64 floats.
__device__ __forceinline__ float2 block_sum2(float2 v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v.x = warp_sum(v.x);
  v.y = warp_sum(v.y);
  __syncthreads();
  if (lane == 0) {
    scratch[warp] = v.x;
    scratch[32 + warp] = v.y;
  }
  __syncthreads();
  v.x = lane < warps ? scratch[lane] : 0.f;
  v.y = lane < warps ? scratch[32 + lane] : 0.f;
  return make_float2(warp_sum(v.x), warp_sum(v.y));
}

// The four sums of block_sum at once (the same bits as four calls), with one
// pair of barriers. `scratch` holds 128 floats.
__device__ __forceinline__ float4 block_sum4(float4 v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = make_float4(warp_sum(v.x), warp_sum(v.y), warp_sum(v.z), warp_sum(v.w));
  __syncthreads();
  if (lane == 0) {
    scratch[warp] = v.x;
    scratch[32 + warp] = v.y;
    scratch[64 + warp] = v.z;
    scratch[96 + warp] = v.w;
  }
  __syncthreads();
  const bool in = lane < warps;
  v = make_float4(in ? scratch[lane] : 0.f, in ? scratch[32 + lane] : 0.f, in ? scratch[64 + lane] : 0.f,
                  in ? scratch[96 + lane] : 0.f);
  return make_float4(warp_sum(v.x), warp_sum(v.y), warp_sum(v.z), warp_sum(v.w));
}

// Vectors of a row a thread may hold in registers (or, in a backward, keep
// its parameter gradient's partial sums for): rows_config gives each thread
// about four.
constexpr int ROW_PACKS = 4;

// How a norm's backward keeps a row that its threads hold (two vectors a
// thread at most; four in the f32 *_bwd4h kernels): RELOAD reads it again for
// the write of dx; HELD (the default: docs/GPU.md, run 20) keeps it in
// registers as loaded, with the parameter gradient's sums in registers too;
// HELD_SMEM keeps the row in
// registers and the sums in shared memory (smem_sums), which leaves room for
// more blocks an SM than HELD: three, as RELOAD.
enum Keep : int { RELOAD, HELD, HELD_SMEM };

// Columns of the two-vector backward's rows at most: 512 vectors (256
// threads of two) of 8 16-bit or 4 f32 values.
constexpr int SMEM_SUM_COLS = 4096;

// A block's ARRAYS arrays of SMEM_SUM_COLS f32 column sums in shared memory
// (HELD_SMEM), not initialised. Value k of vector i of a row of `packs`
// vectors sits at k * packs + i: the threads of a warp, on consecutive
// vectors, touch consecutive words (no bank conflicts).
template <int ARRAYS> __device__ __forceinline__ float* smem_sums() {
  __shared__ float sums[ARRAYS * SMEM_SUM_COLS];
  return sums;
}

// Calls f(i, p) for the 16-byte vectors i = threadIdx.x + p blockDim.x of a
// row that this thread owns. With `unrolled` (at most P of them, ROW_PACKS
// unless given) the loop is unrolled: every load is in flight at once, and p
// is a constant, so f may keep sums per vector in registers indexed by p.
// Otherwise a plain loop, with p = -1.
template <int P = ROW_PACKS, typename F> __device__ __forceinline__ void each_pack(int packs, bool unrolled, F f) {
  if (unrolled) {
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int i = threadIdx.x + p * blockDim.x;
      if (i < packs) f(i, p);
    }
  } else {
    for (int i = threadIdx.x; i < packs; i += blockDim.x) f(i, -1);
  }
}

// Maximum of `v` over the block (NaN ignored, as fmaxf), returned to every thread.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -INFINITY;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Calls f(j) for the columns j of a row that thread `lane` of the `team`
// reading it owns when the row is read element by element: the same columns,
// in the same order, as the 16-byte vector loops give it (lane t: [t N,
// t N + N), then t + team ...). A row's sums then add the same terms in the
// same order, and give the same bits, whether or not its layout allows
// vectors (a view with padded rows, a misaligned start).
template <typename T, typename F>
__device__ __forceinline__ void scalar_cols(int cols, int lane, int team, F f) {
  constexpr int N = Pack<T>::N;
  for (int i = lane; i < (cols + N - 1) / N; i += team) {
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (i * N + k < cols) f(i * N + k);
  }
}

// scalar_cols for a row read by the whole block (written out, not through the
// one above: passing threadIdx.x and blockDim.x as ints cost the f32 kernels
// up to 23 more registers).
template <typename T, typename F> __device__ __forceinline__ void scalar_cols(int cols, F f) {
  constexpr int N = Pack<T>::N;
  for (int i = threadIdx.x; i < (cols + N - 1) / N; i += blockDim.x) {
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (i * N + k < cols) f(i * N + k);
  }
}

// Calls f(i, x[i]) (as f32) for the elements of a row this thread owns: 16-byte
// loads when `vec` (cols a multiple of Pack<T>::N, row 16-byte aligned).
template <typename T, typename F>
__device__ __forceinline__ void row_each(const T* __restrict__ x, int cols, bool vec, F f) {
  constexpr int N = Pack<T>::N;
  if (vec) {
    for (int i = threadIdx.x; i < cols / N; i += blockDim.x) {
      const Pack<T> p = load_pack(x + i * N);
#pragma unroll
      for (int k = 0; k < N; ++k) f(i * N + k, to_f32(p.v[k]));
    }
  } else {
    scalar_cols<T>(cols, [&](int i) { f(i, to_f32(x[i])); });
  }
}

// Half a pack of T: 8 bytes, one 64-bit load.
template <typename T> struct alignas(8) HalfPack {
  static constexpr int N = 8 / sizeof(T);
  T v[N];
};

// N values of a row of U from u as f32: one 16-byte load where a pack of U
// holds N (U the first row's type), two or more where U is wider (an f32 row
// beside a 16-bit one), one 8-byte load where U is narrower (a 16-bit row
// beside an f32 one; u then 8-byte aligned, else 16).
template <int N, typename U> __device__ __forceinline__ void load_f32(const U* u, float (&out)[N]) {
  constexpr int M = Pack<U>::N;
  if constexpr (M > N) {
    static_assert(HalfPack<U>::N == N, "the second row's type must be at least half as wide as the first's");
    HalfPack<U> q;
    *reinterpret_cast<uint2*>(&q) = __ldg(reinterpret_cast<const uint2*>(u));
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_f32(q.v[k]);
  } else {
    static_assert(N % M == 0, "the second row's type must be as wide as the first's or wider");
#pragma unroll
    for (int j = 0; j < N / M; ++j) {
      const Pack<U> q = load_pack(u + j * M);
#pragma unroll
      for (int k = 0; k < M; ++k) out[j * M + k] = to_f32(q.v[k]);
    }
  }
}

// As row_each over two rows at once: f(i, a[i], b[i]). `b` may be of another
// type than `a` (f32 beside f16 or bf16, or the reverse); `vec` is then also
// `b` 16-byte aligned, as the thread map is `a`'s.
template <typename T, typename U, typename F>
__device__ __forceinline__ void row_each2(const T* __restrict__ a, const U* __restrict__ b, int cols, bool vec, F f) {
  constexpr int N = Pack<T>::N;
  if (vec) {
    for (int i = threadIdx.x; i < cols / N; i += blockDim.x) {
      const Pack<T> p = load_pack(a + i * N);
      float q[N];
      load_f32<N>(b + i * N, q);
#pragma unroll
      for (int k = 0; k < N; ++k) f(i * N + k, to_f32(p.v[k]), q[k]);
    }
  } else {
    scalar_cols<T>(cols, [&](int i) { f(i, to_f32(a[i]), to_f32(b[i])); });
  }
}

// y[i] = f(i, x[i]) over a row, with the same thread-to-element map as row_each.
template <typename T, typename F>
__device__ __forceinline__ void row_map(const T* __restrict__ x, T* __restrict__ y, int cols, bool vec, F f) {
  constexpr int N = Pack<T>::N;
  if (vec) {
    for (int i = threadIdx.x; i < cols / N; i += blockDim.x) {
      const Pack<T> p = load_pack(x + i * N);
      Pack<T> o;
#pragma unroll
      for (int k = 0; k < N; ++k) o.v[k] = from_f32<T>(f(i * N + k, to_f32(p.v[k])));
      store_pack(y + i * N, o);
    }
  } else {
    scalar_cols<T>(cols, [&](int i) { y[i] = from_f32<T>(f(i, to_f32(x[i]))); });
  }
}

// As row_map with two input rows: y[i] = f(i, a[i], b[i]), `b` as in row_each2.
template <typename T, typename U, typename F>
__device__ __forceinline__ void row_map2(const T* __restrict__ a, const U* __restrict__ b, T* __restrict__ y,
                                         int cols, bool vec, F f) {
  constexpr int N = Pack<T>::N;
  if (vec) {
    for (int i = threadIdx.x; i < cols / N; i += blockDim.x) {
      const Pack<T> p = load_pack(a + i * N);
      float q[N];
      load_f32<N>(b + i * N, q);
      Pack<T> o;
#pragma unroll
      for (int k = 0; k < N; ++k) o.v[k] = from_f32<T>(f(i * N + k, to_f32(p.v[k]), q[k]));
      store_pack(y + i * N, o);
    }
  } else {
    scalar_cols<T>(cols, [&](int i) { y[i] = from_f32<T>(f(i, to_f32(a[i]), to_f32(b[i]))); });
  }
}

// The flat indices first, first + stride, ... of a grid-stride loop over
// rows x width items, walked as (row, col): one 64-bit division up front
// instead of one per step (the GPU has no divide instruction).
struct RowCol {
  int64_t row, step_row;
  int col, step_col, width;
  __device__ __forceinline__ RowCol(int64_t first, int64_t stride, int width) : width(width) {
    row = first / width;
    col = (int)(first - row * width);
    step_row = stride / width;
    step_col = (int)(stride - step_row * width);
  }
  __device__ __forceinline__ void next() {
    row += step_row;
    col += step_col;
    if (col >= width) {
      col -= width;
      ++row;
    }
  }
};

// Adds v to a running (max m, sum s of exp(x - m)), rescaling s when v is a
// new maximum: one pass over a row instead of a max pass and a sum pass.
// A -inf adds nothing (also while m is -inf, where exp(v - m) would be NaN);
// NaN, and +inf met twice, make s NaN, as the two-pass form does. exp is
// __expf where Fast (FastMath).
template <bool Fast> __device__ __forceinline__ void online_add(float v, float& m, float& s) {
  if (v > m) {
    s = s * exp_<Fast>(m - v) + 1.f;
    m = v;
  } else if (!(v == -INFINITY)) {
    s += exp_<Fast>(v - m);
  }
}

// (max, sum of exp(x - max)) of `x * scale` over a row, to every thread of
// the block, in one read of the row; with `sum_x`, also the sum of x - shift. exp is
// __expf for f16 and bf16 rows (FastMath): a sum of terms each within about
// 2e-6 of its value where it matters (x - max > -10), so a log-sum-exp within
// about 2e-6 of the precise one.
template <typename T>
__device__ __forceinline__ float2 row_max_sumexp(const T* __restrict__ xr, int cols, bool vec, float scale,
                                                 float* scratch, float* sum_x = nullptr, float shift = 0.f) {
  constexpr bool Fast = FastMath<T>::value;
  float m = -INFINITY, s = 0.f, sx = 0.f;
  row_each(xr, cols, vec, [&](int, float v) {
    online_add<Fast>(v * scale, m, s);
    sx += v - shift;
  });
  const float bm = block_max(m, scratch);
  // This thread's sum moved to the block's maximum (0 from a thread that saw
  // only -inf; NaN where bm is +inf, or -inf for the whole row, as torch).
  s = block_sum(s * exp_<Fast>(m - bm), scratch);
  if (sum_x) *sum_x = block_sum(sx, scratch);
  return make_float2(bm, s);
}

// out[j] = sum over the `parts` rows of `partial` (column j), rounded to T:
// the second step of a deterministic parameter gradient. Blocks of 256
// threads, each for 32 columns: its 8 warps sum every 8th row (coalesced
// 128-byte reads), then warp 0 adds their 8 sums in order.
constexpr int SUM_PARTS_COLS = 32;
template <typename T>
__device__ __forceinline__ void sum_parts(const float* __restrict__ partial, T* __restrict__ out, int parts,
                                          int cols) {
  constexpr int GROUPS = 8;  // blockDim.x == SUM_PARTS_COLS * GROUPS
  __shared__ float sums[GROUPS][SUM_PARTS_COLS];
  const int lane = threadIdx.x % SUM_PARTS_COLS, group = threadIdx.x / SUM_PARTS_COLS;
  const int j = blockIdx.x * SUM_PARTS_COLS + lane;
  float s = 0.f;
  if (j < cols) {
    for (int p = group; p < parts; p += GROUPS) s += partial[(int64_t)p * cols + j];
  }
  sums[group][lane] = s;
  __syncthreads();
  if (group == 0 && j < cols) {
    float t = 0.f;
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) t += sums[g][lane];
    out[j] = from_f32<T>(t);
  }
}

}  // namespace keel
