// softmax over the last dimension of x * scale, and its backward from the
// output: dx = scale * y * (dy - sum(dy * y)).
//
// One block per row (grid-stride over rows). A row of up to four 16-byte
// vectors a thread is held in registers (max, then one exp per element and
// its sum, then the store; 16-bit rows as loaded, their exp computed again
// for the store); a longer one takes the max and the sum of exp in one pass
// (online softmax, common.cuh), then the store, the row re-read from L1/L2.
// 16-byte loads when the row length is a multiple of 16 bytes and the
// pointers are aligned. f32 math; exp is expf for f32 and __expf for f16 and
// bf16 (common.cuh's FastMath: the forward of a bf16 row was bound by
// instructions on an H200).
// Kernel symbols: softmax_{fwd,bwd}_{f32,f16,bf16}.
#include "common.cuh"

using namespace keel;

// Rows of up to ROW_PACKS (common.cuh) 16-byte vectors a thread (every row of
// up to 4096 vectors: rows_config gives each thread about four) are held in
// registers: their max, then exp(x - max) once per element and its sum, then
// the store. 16-bit rows are held as loaded, and each exp is computed again
// for the store: half the registers of their f32 values (16 against 32), and
// 1.09-1.10x for a bf16 4096x4096 forward on an H100 (docs/GPU.md, 13). Longer
// rows take the online pass and re-read the row for the store, with a second
// exp per element.
template <typename T>
__device__ __forceinline__ void softmax_fwd(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int cols,
                                            float scale) {
  __shared__ float scratch[32];
  constexpr int N = Pack<T>::N;
  const bool vec = cols % N == 0 && aligned16(x) && aligned16(y);
  const int packs = cols / N;
  const bool regs = vec && packs <= ROW_PACKS * (int)blockDim.x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    T* yr = y + row * cols;
    if (regs && sizeof(T) == 4) {
      // As the online pass: the max ignores NaN (fmaxf); a NaN, a +inf, or a
      // row of -inf makes the sum NaN, and so every output of the row.
      float e[ROW_PACKS][N];
      float m = -INFINITY;
      each_pack(packs, true, [&](int i, int p) {
        const Pack<T> q = load_pack(xr + i * N);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          e[p][k] = to_f32(q.v[k]) * scale;
          m = fmaxf(m, e[p][k]);
        }
      });
      m = block_max(m, scratch);
      float sum = 0.f;
      each_pack(packs, true, [&](int, int p) {
#pragma unroll
        for (int k = 0; k < N; ++k) {
          e[p][k] = exp_<FastMath<T>::value>(e[p][k] - m);
          sum += e[p][k];
        }
      });
      const float inv = 1.f / block_sum(sum, scratch);
      each_pack(packs, true, [&](int i, int p) {
        Pack<T> o;
#pragma unroll
        for (int k = 0; k < N; ++k) o.v[k] = from_f32<T>(e[p][k] * inv);
        store_pack(yr + i * N, o);
      });
    } else if (regs) {
      // 16-bit rows: the packs held as loaded, each value's exp computed
      // again for the store; x * scale rounded on its own (mul_rn), so that
      // no FMA contraction makes the two exps of a value differ.
      Pack<T> held[ROW_PACKS];
      each_pack(packs, true, [&](int i, int p) { held[p] = load_pack(xr + i * N); });
      float m = -INFINITY;
      // Value k of pack p times scale, and its exp(x - m): one expression for
      // the sum and the store, so that the two agree.
      auto scaled = [&](int p, int k) { return mul_rn(to_f32(held[p].v[k]), scale); };
      auto ex = [&](int p, int k) { return exp_<FastMath<T>::value>(scaled(p, k) - m); };
      each_pack(packs, true, [&](int, int p) {
#pragma unroll
        for (int k = 0; k < N; ++k) m = fmaxf(m, scaled(p, k));
      });
      m = block_max(m, scratch);
      float sum = 0.f;
      each_pack(packs, true, [&](int, int p) {
#pragma unroll
        for (int k = 0; k < N; ++k) sum += ex(p, k);
      });
      const float inv = 1.f / block_sum(sum, scratch);
      each_pack(packs, true, [&](int i, int p) {
        Pack<T> o;
#pragma unroll
        for (int k = 0; k < N; ++k) o.v[k] = from_f32<T>(ex(p, k) * inv);
        store_pack(yr + i * N, o);
      });
    } else {
      const float2 ms = row_max_sumexp(xr, cols, vec, scale, scratch);
      const float m = ms.x, inv = 1.f / ms.y;
      row_map(xr, yr, cols, vec, [&](int, float v) { return exp_<FastMath<T>::value>(v * scale - m) * inv; });
    }
  }
}

template <typename T>
__device__ __forceinline__ void softmax_bwd(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                                            int64_t rows, int cols, float scale) {
  __shared__ float scratch[32];
  constexpr int N = Pack<T>::N;
  const bool vec = cols % N == 0 && aligned16(dy) && aligned16(y) && aligned16(dx);
  const int packs = cols / N;
  const bool regs = vec && packs <= ROW_PACKS * (int)blockDim.x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T *gr = dy + row * cols, *yr = y + row * cols;
    T* xr = dx + row * cols;
    float dot = 0.f;
    if (regs) {
      // The row's dy and y held as loaded, so that the store reads neither
      // again; the dot in row_each2's order (the same bits).
      Pack<T> hg[ROW_PACKS], hy[ROW_PACKS];
      each_pack(packs, true, [&](int i, int p) {
        hg[p] = load_pack(gr + i * N);
        hy[p] = load_pack(yr + i * N);
      });
      each_pack(packs, true, [&](int, int p) {
#pragma unroll
        for (int k = 0; k < N; ++k) dot += to_f32(hg[p].v[k]) * to_f32(hy[p].v[k]);
      });
      dot = block_sum(dot, scratch);
      each_pack(packs, true, [&](int i, int p) {
        Pack<T> o;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const float g = to_f32(hg[p].v[k]), v = to_f32(hy[p].v[k]);
          o.v[k] = from_f32<T>(scale * v * (g - dot));
        }
        store_pack(xr + i * N, o);
      });
    } else {
      row_each2(gr, yr, cols, vec, [&](int, float g, float v) { dot += g * v; });
      dot = block_sum(dot, scratch);
      row_map2(gr, yr, xr, cols, vec, [&](int, float g, float v) { return scale * v * (g - dot); });
    }
  }
}

// Both are launched with blocks of up to 1024 threads (rows_config). The
// backward took 63-64 registers unbounded on sm_80, the most such a block fits:
// the driver compiles this PTX again for the GPU at hand, with its own ptxas,
// and one register more there would fail the launch for rows past 16384 f32
// or 32768 f16/bf16 values.
// Bounded, ptxas gives 58-62 (sm_80) and 56-57 (sm_90), and any JIT must fit.
#define KEEL_SOFTMAX(SUFFIX, T)                                                                                 \
  extern "C" __global__ void __launch_bounds__(1024)                                                            \
      softmax_fwd_##SUFFIX(const T* x, T* y, int64_t rows, int cols, float scale) {                             \
    softmax_fwd<T>(x, y, rows, cols, scale);                                                                    \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(1024)                                                            \
      softmax_bwd_##SUFFIX(const T* dy, const T* y, T* dx, int64_t rows, int cols, float scale) {               \
    softmax_bwd<T>(dy, y, dx, rows, cols, scale);                                                               \
  }

KEEL_SOFTMAX(f32, float)
KEEL_SOFTMAX(f16, __half)
KEEL_SOFTMAX(bf16, __nv_bfloat16)
