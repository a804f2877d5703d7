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
// Kernel symbols: rms_norm_{fwd,fwd_warp_rows,bwd,bwd2,bwd2h,bwd2s,bwd_dw}_{f32,f16,bf16},
// rms_norm_bwd4h_f32.
#include "common.cuh"

using namespace keel;

// Where row `row` of a strided x starts (see above).
// Its two divisions are 32-bit where the row count allows (a 64-bit one is a
// long subroutine; n1 and n2 divide the row count, so they fit too).
__device__ __forceinline__ int64_t row_offset(int64_t row, int64_t rows, int64_t n1, int64_t n2, int64_t s0,
                                              int64_t s1, int64_t s2) {
  if (rows <= 0xffffffffll) {
    const uint32_t r = (uint32_t)row, m1 = (uint32_t)n1, m2 = (uint32_t)n2;
    const uint32_t t = r / m2, i2 = r - t * m2, i0 = t / m1, i1 = t - i0 * m1;
    return (int64_t)i0 * s0 + (int64_t)i1 * s1 + (int64_t)i2 * s2;
  }
  const int64_t t = row / n2, i2 = row - t * n2, i0 = t / n1, i1 = t - i0 * n1;
  return i0 * s0 + i1 * s1 + i2 * s2;
}

// ss += the squares of a vector's elements, in order.
template <typename T> __device__ __forceinline__ void sum_sq_pack(const Pack<T>& p, float& ss) {
#pragma unroll
  for (int k = 0; k < Pack<T>::N; ++k) {
    const float f = to_f32(p.v[k]);
    ss = fmaf(f, f, ss);
  }
}

// One output element: x r (rms_normed) times w's element where w is given.
template <bool ROUND, typename T> __device__ __forceinline__ T rms_out(T x, float r, const T* w, int i) {
  return w ? from_f32<T>(rms_normed<ROUND, T>(to_f32(x), r) * to_f32(w[i])) : from_f32<T>(to_f32(x) * r);
}

// Vector i of output row yr: p's elements times r (times w's).
template <bool ROUND, typename T>
__device__ __forceinline__ void rms_write_pack(T* __restrict__ yr, const T* __restrict__ w, int i, const Pack<T>& p,
                                               float r) {
  constexpr int N = Pack<T>::N;
  Pack<T> o, pw;
  if (w) pw = load_pack(w + i * N);
#pragma unroll
  for (int k = 0; k < N; ++k)
    o.v[k] = w ? from_f32<T>(rms_normed<ROUND, T>(to_f32(p.v[k]), r) * to_f32(pw.v[k])) : from_f32<T>(to_f32(p.v[k]) * r);
  store_pack(yr + i * N, o);
}

// Each row is read by the whole block. A row of up to ROW_PACKS vectors a
// thread is held in registers between its two passes (every load in flight
// at once, one read of x), as the softmax forward holds its rows. Each thread
// takes the same vectors in the same order as the plain loop: the same bits.
// ROUND: x r rounded to T before the weight (rms_normed).
template <bool ROUND, typename T>
__device__ __forceinline__ void rms_norm_fwd(const T* __restrict__ x, const T* __restrict__ w,
                                             T* __restrict__ y, int64_t rows, int cols, float eps, int64_t n1,
                                             int64_t n2, int64_t s0, int64_t s1, int64_t s2) {
  __shared__ float scratch[32];
  constexpr int N = Pack<T>::N;
  const bool vec = cols % N == 0 && s0 % N == 0 && s1 % N == 0 && s2 % N == 0 && aligned16(x) && aligned16(y) &&
                   (w == nullptr || aligned16(w));
  const int packs = cols / N;
  const bool regs = vec && packs <= ROW_PACKS * (int)blockDim.x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row_offset(row, rows, n1, n2, s0, s1, s2);
    T* yr = y + row * cols;
    float ss = 0.f;
    Pack<T> held[ROW_PACKS];
    if (regs) {
      each_pack(packs, true, [&](int i, int p) { held[p] = load_pack(xr + i * N); });
      each_pack(packs, true, [&](int, int p) { sum_sq_pack(held[p], ss); });
    } else if (vec) {
      for (int i = threadIdx.x; i < packs; i += blockDim.x) sum_sq_pack(load_pack(xr + i * N), ss);
    } else {
      scalar_cols<T>(cols, [&](int i) {
        const float f = to_f32(xr[i]);
        ss = fmaf(f, f, ss);
      });
    }
    const float r = rsqrtf(block_sum(ss, scratch) / cols + eps);
    if (regs) {
      each_pack(packs, true, [&](int i, int p) { rms_write_pack<ROUND>(yr, w, i, held[p], r); });
    } else if (vec) {
      for (int i = threadIdx.x; i < packs; i += blockDim.x) rms_write_pack<ROUND>(yr, w, i, load_pack(xr + i * N), r);
    } else {
      scalar_cols<T>(cols, [&](int i) { yr[i] = rms_out<ROUND>(xr[i], r, w, i); });
    }
  }
}

// Short rows (forward_config: at most 128 vectors, as QK-norm's 128-wide
// heads), each read by a team of lanes of one warp (row_team: 16 for a head
// of 128 bf16, 32 for f32), a warp reading two groups of 32 / team rows at
// once; sums by shuffles within the team, no block barriers; a row of up to
// 32 vectors held in registers between the two passes. The same bits as a
// team of 32 (the kernel before): the lanes past a row's vectors hold zeros,
// and the shuffles a 32-lane sum adds first add only those zeros. ROUND as
// rms_norm_fwd.
template <bool ROUND, typename T>
__device__ __forceinline__ void rms_norm_fwd_teams(const T* __restrict__ x, const T* __restrict__ w,
                                                   T* __restrict__ y, int64_t rows, int cols, float eps, int64_t n1,
                                                   int64_t n2, int64_t s0, int64_t s1, int64_t s2) {
  constexpr int N = Pack<T>::N;
  const bool vec = cols % N == 0 && s0 % N == 0 && s1 % N == 0 && s2 % N == 0 && aligned16(x) && aligned16(y) &&
                   (w == nullptr || aligned16(w));
  const int packs = (cols + N - 1) / N;  // vectors, or the element groups scalar_cols gives a lane
  const int team = row_team(packs), lane = threadIdx.x & (team - 1);
  const int per_warp = 32 / team;
  const bool one = vec && packs <= team;  // one vector a lane, held in registers between the passes
  const int64_t warps = blockDim.x / 32, warp = (int64_t)blockIdx.x * warps + threadIdx.x / 32;
  // A warp takes G groups of per_warp rows a pass, every load of them issued
  // before any sum. Every lane of a warp runs each pass (the shuffles need the
  // whole warp); a team whose row is past the end reads and writes nothing.
  constexpr int G = 2;
  for (int64_t base = warp * per_warp * G; base < rows; base += (int64_t)gridDim.x * warps * per_warp * G) {
    const T* xr[G];
    T* yr[G];
    bool live[G];
    float ss[G], r[G];
    Pack<T> held[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int64_t row = base + g * per_warp + (threadIdx.x & 31) / team;
      live[g] = row < rows;
      xr[g] = x + (live[g] ? row_offset(row, rows, n1, n2, s0, s1, s2) : 0);
      yr[g] = y + row * cols;
      ss[g] = 0.f;
      if (one && live[g] && lane < packs) held[g] = load_pack(xr[g] + lane * N);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (!live[g]) continue;
      if (one) {
        if (lane < packs) sum_sq_pack(held[g], ss[g]);
      } else if (vec) {
        for (int i = lane; i < packs; i += team) sum_sq_pack(load_pack(xr[g] + i * N), ss[g]);
      } else {
        scalar_cols<T>(cols, lane, team, [&](int i) {
          const float f = to_f32(xr[g][i]);
          ss[g] = fmaf(f, f, ss[g]);
        });
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) r[g] = rsqrtf(team_sum(ss[g], team) / cols + eps);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (!live[g]) continue;
      if (one) {
        if (lane < packs) rms_write_pack<ROUND>(yr[g], w, lane, held[g], r[g]);
      } else if (vec) {
        for (int i = lane; i < packs; i += team) rms_write_pack<ROUND>(yr[g], w, i, load_pack(xr[g] + i * N), r[g]);
      } else {
        scalar_cols<T>(cols, lane, team, [&](int i) { yr[g][i] = rms_out<ROUND>(xr[g][i], r[g], w, i); });
      }
    }
  }
}

// dx = r * dy * w - x * r^3 * sum(dy * w * x) / n (+ add, when given: the
// gradient arriving at fused_add_rms_norm's sum output). When dw_partial is given,
// block b sums dy * x * r over its rows into dw_partial[b * cols + j] (its own
// row: no atomics); rms_norm_bwd_dw then sums the gridDim.x rows. Where each
// thread owns at most ROW_PACKS vectors of a row (every row of up to
// 4 * 1024 vectors, as rows_config sizes the block), those sums stay in
// registers until the block's last row; otherwise they accumulate in
// dw_partial itself. With HELD (rms_norm_bwd2h_*, rms_norm_bwd4h_f32: two
// blocks of 256 an SM, w's packs loaded once for all the block's rows) and
// HELD_SMEM (rms_norm_bwd2s_*: three blocks, dw's sums in shared memory),
// a row held in registers is read once: x, dy and add kept as loaded for the
// write of dx; the same bits as RELOAD. HELD is the default since an H200
// timed it (docs/GPU.md, run 20).
// r g w - x c + a for one element, each rounding spelled out (mul_rn).
__device__ __forceinline__ float rms_dx(float r, float g, float w, float x, float c, float a) {
  return add_rn(add_rn(mul_rn(mul_rn(r, g), w), -mul_rn(x, c)), a);
}

template <int P, Keep KEEP, typename T>
__device__ __forceinline__ void rms_norm_bwd(const T* __restrict__ dy, const T* __restrict__ add,
                                             const T* __restrict__ x, const T* __restrict__ w,
                                             T* __restrict__ dx, float* __restrict__ dw_partial, int64_t rows,
                                             int cols, float eps, int64_t n1, int64_t n2, int64_t s0, int64_t s1,
                                             int64_t s2) {
  __shared__ float scratch[64];
  constexpr int N = Pack<T>::N;
  const bool vec = cols % N == 0 && s0 % N == 0 && s1 % N == 0 && s2 % N == 0 && aligned16(x) && aligned16(dy) &&
                   aligned16(dx) && (w == nullptr || aligned16(w)) && (add == nullptr || aligned16(add));
  const int packs = cols / N;
  const bool regs = vec && packs <= P * (int)blockDim.x;
  float* part = dw_partial ? dw_partial + (int64_t)blockIdx.x * cols : nullptr;
  float acc[P][N] = {};
  if (part && !regs) {
    for (int j = threadIdx.x; j < cols; j += blockDim.x) part[j] = 0.f;
    __syncthreads();  // the vector loop below maps columns to threads differently
  }
  // HELD_SMEM: dw's sums in shared memory, each thread's own (no barrier:
  // no thread reads another's).
  float* const sd = KEEP == HELD_SMEM ? smem_sums<1>() : nullptr;
  if (KEEP == HELD_SMEM && regs && part) {
    each_pack<P>(packs, true, [&](int i, int) {
#pragma unroll
      for (int k = 0; k < N; ++k) sd[k * packs + i] = 0.f;
    });
  }
  // HELD: w's packs, the same for every row of this thread, loaded once
  // (HELD_SMEM loads them where used, to stay within 80 registers).
  Pack<T> hw[P];
  if (KEEP == HELD && regs && w) each_pack<P>(packs, true, [&](int i, int p) { hw[p] = load_pack(w + i * N); });
  auto wp = [&](int i, int p) { return KEEP == HELD ? hw[p] : load_pack(w + i * N); };
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row_offset(row, rows, n1, n2, s0, s1, s2);
    const T* gr = dy + row * cols;
    const T* ar = add ? add + row * cols : nullptr;
    T* dxr = dx + row * cols;
    float ss = 0.f, gx = 0.f;
    if (KEEP != RELOAD && regs) {
      // The row's x, dy (and add) held as loaded, every load issued before
      // the block's sum, so that the write of dx reads none of them again;
      // the same terms in the same order as the loops below (the same bits).
      Pack<T> hx[P], hg[P], ha[P];
      each_pack<P>(packs, true, [&](int i, int p) {
        hx[p] = load_pack(xr + i * N);
        hg[p] = load_pack(gr + i * N);
        if (ar) ha[p] = load_pack(ar + i * N);
      });
      each_pack<P>(packs, true, [&](int i, int p) {
        Pack<T> pw;
        if (w) pw = wp(i, p);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const float fx = to_f32(hx[p].v[k]);
          ss = fmaf(fx, fx, ss);
          gx = fmaf(mul_rn(to_f32(hg[p].v[k]), w ? to_f32(pw.v[k]) : 1.f), fx, gx);
        }
      });
      const float2 sums = block_sum2(make_float2(ss, gx), scratch);
      const float r = rsqrtf(sums.x / cols + eps);
      const float c = r * r * r * sums.y / cols;
      each_pack<P>(packs, true, [&](int i, int p) {
        Pack<T> o, pw;
        if (w) pw = wp(i, p);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const float fx = to_f32(hx[p].v[k]), fg = to_f32(hg[p].v[k]);
          o.v[k] = from_f32<T>(rms_dx(r, fg, w ? to_f32(pw.v[k]) : 1.f, fx, c, ar ? to_f32(ha[p].v[k]) : 0.f));
          float& a = KEEP == HELD_SMEM ? sd[k * packs + i] : acc[p][k];
          if (part) a = fmaf(mul_rn(fg, fx), r, a);
        }
        store_pack(dxr + i * N, o);
      });
      continue;
    }
    auto sum_pack = [&](int i) {
      Pack<T> px = load_pack(xr + i * N), pg = load_pack(gr + i * N), pw;
      if (w) pw = load_pack(w + i * N);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        float fx = to_f32(px.v[k]);
        ss = fmaf(fx, fx, ss);
        gx = fmaf(mul_rn(to_f32(pg.v[k]), w ? to_f32(pw.v[k]) : 1.f), fx, gx);
      }
    };
    if (vec) {
      each_pack<P>(packs, regs, [&](int i, int) { sum_pack(i); });
    } else {
      scalar_cols<T>(cols, [&](int i) {
        const float fx = to_f32(xr[i]);
        ss = fmaf(fx, fx, ss);
        gx = fmaf(mul_rn(to_f32(gr[i]), w ? to_f32(w[i]) : 1.f), fx, gx);
      });
    }
    const float2 sums = block_sum2(make_float2(ss, gx), scratch);
    const float r = rsqrtf(sums.x / cols + eps);
    const float c = r * r * r * sums.y / cols;
    // Pack i of the row: its dx, and its dw terms added to acc[0..N).
    auto pack = [&](int i, float* acc_i) {
      Pack<T> px = load_pack(xr + i * N), pg = load_pack(gr + i * N), pw, pa, o;
      if (w) pw = load_pack(w + i * N);
      if (ar) pa = load_pack(ar + i * N);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        float fx = to_f32(px.v[k]), fg = to_f32(pg.v[k]);
        o.v[k] = from_f32<T>(rms_dx(r, fg, w ? to_f32(pw.v[k]) : 1.f, fx, c, ar ? to_f32(pa.v[k]) : 0.f));
        if (part) acc_i[k] = fmaf(mul_rn(fg, fx), r, acc_i[k]);
      }
      store_pack(dxr + i * N, o);
    };
    if (vec) {
      each_pack<P>(packs, regs, [&](int i, int p) { pack(i, p >= 0 ? acc[p] : part ? part + i * N : nullptr); });
    } else {
      scalar_cols<T>(cols, [&](int i) {
        const float fx = to_f32(xr[i]), fg = to_f32(gr[i]);
        dxr[i] = from_f32<T>(rms_dx(r, fg, w ? to_f32(w[i]) : 1.f, fx, c, ar ? to_f32(ar[i]) : 0.f));
        if (part) part[i] = fmaf(mul_rn(fg, fx), r, part[i]);
      });
    }
  }
  if (part && regs) {
    each_pack<P>(packs, true, [&](int i, int p) {
#pragma unroll
      for (int k = 0; k < N; ++k) part[i * N + k] = KEEP == HELD_SMEM ? sd[k * packs + i] : acc[p][k];
    });
  }
}

// The forward's blocks have up to 1024 threads (rows_config), so it is
// bounded to fit them: 64 registers. Unbounded, the kernel holding both
// roundings took 68-72 (sm_80, sm_90): an SM fits at most 896 such threads a
// block, so rows of more than 28672 bf16 or 14336 f32 would fail to launch.
// layer_norm_fwd and softmax_fwd are bounded the same way.
#define KEEL_RMS_NORM(SUFFIX, T)                                                                  \
  extern "C" __global__ void __launch_bounds__(1024)                                              \
      rms_norm_fwd_##SUFFIX(const T* x, const T* w, T* y, int64_t rows, int cols, float eps,      \
                            int64_t n1, int64_t n2, int64_t s0, int64_t s1, int64_t s2,           \
                            int round) {                                                          \
    if (round)                                                                                    \
      rms_norm_fwd<true, T>(x, w, y, rows, cols, eps, n1, n2, s0, s1, s2);                        \
    else                                                                                          \
      rms_norm_fwd<false, T>(x, w, y, rows, cols, eps, n1, n2, s0, s1, s2);                       \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(256, 4)                                            \
      rms_norm_fwd_warp_rows_##SUFFIX(const T* x, const T* w, T* y, int64_t rows, int cols,       \
                                      float eps, int64_t n1, int64_t n2, int64_t s0, int64_t s1,  \
                                      int64_t s2, int round) {                                    \
    if (round)                                                                                    \
      rms_norm_fwd_teams<true, T>(x, w, y, rows, cols, eps, n1, n2, s0, s1, s2);                  \
    else                                                                                          \
      rms_norm_fwd_teams<false, T>(x, w, y, rows, cols, eps, n1, n2, s0, s1, s2);                 \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(512, 1)                                            \
      rms_norm_bwd_##SUFFIX(const T* dy, const T* add, const T* x, const T* w, T* dx,             \
                            float* dw_partial, int64_t rows, int cols, float eps, int64_t n1,     \
                            int64_t n2, int64_t s0, int64_t s1, int64_t s2) {                     \
    rms_norm_bwd<ROW_PACKS, RELOAD, T>(dy, add, x, w, dx, dw_partial, rows, cols, eps, n1, n2, s0, s1, \
                                       s2);                                                       \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(256, 3)                                            \
      rms_norm_bwd2_##SUFFIX(const T* dy, const T* add, const T* x, const T* w, T* dx,            \
                             float* dw_partial, int64_t rows, int cols, float eps, int64_t n1,    \
                             int64_t n2, int64_t s0, int64_t s1, int64_t s2) {                    \
    rms_norm_bwd<2, RELOAD, T>(dy, add, x, w, dx, dw_partial, rows, cols, eps, n1, n2, s0, s1, s2); \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(256, 2)                                            \
      rms_norm_bwd2h_##SUFFIX(const T* dy, const T* add, const T* x, const T* w, T* dx,           \
                              float* dw_partial, int64_t rows, int cols, float eps, int64_t n1,   \
                              int64_t n2, int64_t s0, int64_t s1, int64_t s2) {                   \
    rms_norm_bwd<2, HELD, T>(dy, add, x, w, dx, dw_partial, rows, cols, eps, n1, n2, s0, s1, s2);  \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(256, 3)                                            \
      rms_norm_bwd2s_##SUFFIX(const T* dy, const T* add, const T* x, const T* w, T* dx,           \
                              float* dw_partial, int64_t rows, int cols, float eps, int64_t n1,   \
                              int64_t n2, int64_t s0, int64_t s1, int64_t s2) {                   \
    rms_norm_bwd<2, HELD_SMEM, T>(dy, add, x, w, dx, dw_partial, rows, cols, eps, n1, n2, s0, s1, \
                                  s2);                                                            \
  }                                                                                               \
  extern "C" __global__ void rms_norm_bwd_dw_##SUFFIX(const float* partial, T* dw, int parts,     \
                                                      int cols) {                                \
    sum_parts<T>(partial, dw, parts, cols);                                                       \
  }

KEEL_RMS_NORM(f32, float)
KEEL_RMS_NORM(f16, __half)
KEEL_RMS_NORM(bf16, __nv_bfloat16)

// The four-vector backward with HELD rows, for f32 alone: 122-125 registers
// (16-bit rows of four vectors a thread, eight values each, spill at 128).
extern "C" __global__ void __launch_bounds__(256, 2)
    rms_norm_bwd4h_f32(const float* dy, const float* add, const float* x, const float* w, float* dx,
                       float* dw_partial, int64_t rows, int cols, float eps, int64_t n1, int64_t n2, int64_t s0,
                       int64_t s1, int64_t s2) {
  rms_norm_bwd<ROW_PACKS, HELD, float>(dy, add, x, w, dx, dw_partial, rows, cols, eps, n1, n2, s0, s1, s2);
}
