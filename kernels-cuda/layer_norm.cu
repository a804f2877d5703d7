// layer_norm forward and backward over the last dimension.
//
// One block per row (grid-stride over rows), 128-bit vector loads when the
// row length is a multiple of 16 bytes and every pointer is aligned, f32
// accumulation. The forward takes the moments (shifted sums: moments_of)
// from one read of the row (row_moments), the output from a second, or, as
// for every row a block holds in registers, from the same read. The backward
// takes the moments and its two gradient sums from one read and one block
// reduction (see layer_norm_bwd), dx from a second, and sums dw/db per block into
// f32 scratch rows, summed by layer_norm_bwd_sum (deterministic).
// Kernel symbols: layer_norm_{fwd,bwd,bwd2,bwd2h,bwd2s,bwd_sum}_{f32,f16,bf16},
// layer_norm_bwd4h_f32.
#include "common.cuh"

using namespace keel;

// 1 / sqrt(var + eps); NaN, not 0, where the variance overflowed f32 (zeros
// would be a silent wrong answer), as the CPU kernels do.
__device__ __forceinline__ float ln_rstd(float var, float eps) { return isinf(var) ? nanf("") : rsqrtf(var + eps); }

// A row's moments, forward and backward, kept as the CPU kernels keep them
// (kernels-cpu/src/layer_norm.rs): mean = k + m1 with k a shift near the
// row's values, rstd = 1 / sqrt(var + eps), and xh = ((x - k) - m1) rstd,
// which stays accurate where the mean is large against the spread.
struct LnMoments {
  float k, m1, rstd;
};

// The shift k: the mean of the row's first 16 elements (the CPU kernels'
// `shift`), each lane of every warp reading one and the warp summing them in
// the same order: the same value in every thread.
template <typename T> __device__ __forceinline__ float row_shift(const T* __restrict__ xr, int cols) {
  const int h = cols < 16 ? cols : 16, lane = threadIdx.x & 31;
  return warp_sum(lane < h ? to_f32(xr[lane]) : 0.f) / h;
}

// Whether the shifted sums give the variance to about a bit: m1^2 <= m2 / 2
// (the CPU's test); m1m1 = m1^2.
__device__ __forceinline__ bool shift_good(float m1m1, float m2) { return m1m1 <= 0.5f * m2; }

// (x - mean) rstd, each rounding spelled out.
__device__ __forceinline__ float ln_xh(float x, LnMoments m) { return mul_rn((x - m.k) - m.m1, m.rstd); }

// A row's moments from the block's shifted sums s1 = sum(x - m.k) and s2 =
// sum((x - m.k)^2) of pass `pass` (forward and backward): true with m.m1 and
// m.rstd filled in; false where the shift was poor on the first pass, m.k
// then moved by the shifted mean for a second pass.
__device__ __forceinline__ bool ln_moments(float s1, float s2, int pass, int cols, float eps, LnMoments& m) {
  const float m1 = s1 / cols, m2 = s2 / cols, m1m1 = mul_rn(m1, m1);
  if (pass == 0 && !shift_good(m1m1, m2)) {
    m.k = add_rn(m.k, m1);
    return false;
  }
  m.m1 = m1;
  m.rstd = ln_rstd(add_rn(m2, -m1m1), eps);
  return true;
}

// A row's moments for the forward, returned to every thread: the backward's
// (LnMoments, the shift k = row_shift), from the block's sums [sum(x - k),
// sum((x - k)^2)] of one read (ln_moments); where the shift was poor, the
// same again with k + m1, the mean now known to a few bits, as the shift.
// The output is then ((x - k) - m1) rstd: x - k is exact, so a row whose mean
// is large against its spread keeps the precision of its normalised values.
// (The forward took x - mean with the mean rounded to f32 before, which
// erred by half an ulp of the mean times rstd: 3e-3 for rows near 1000
// spread by 0.01, where a test allowed 8e-6.)
//
// `each(f)` calls f(i, x[i]) for this thread's elements in row_each's order,
// from memory (row_moments) or from a row held in registers; `k` is
// row_shift's.
template <typename Each>
__device__ __forceinline__ LnMoments moments_of(Each each, float k, int cols, float eps, float* scratch) {
  LnMoments m{k, 0.f, 0.f};
  for (int pass = 0;; ++pass) {
    float s1 = 0.f, s2 = 0.f;
    each([&](int, float v) {
      const float d = v - m.k;
      s1 = add_rn(s1, d);
      s2 = fmaf(d, d, s2);
    });
    const float2 s = block_sum2(make_float2(s1, s2), scratch);
    if (ln_moments(s.x, s.y, pass, cols, eps, m)) return m;
  }
}

// moments_of a row read from memory.
template <typename T>
__device__ __forceinline__ LnMoments row_moments(const T* __restrict__ xr, int cols, bool vec, float eps,
                                                 float* scratch) {
  return moments_of([&](auto f) { row_each(xr, cols, vec, f); }, row_shift(xr, cols), cols, eps, scratch);
}

// One output: xh w + b, each rounding spelled out (mul_rn), so the vector
// and element-wise loops give the same bits.
__device__ __forceinline__ float ln_y(float x, LnMoments m, float w, float b) {
  return add_rn(mul_rn(ln_xh(x, m), w), b);
}

// One gradient: rstd (g w - mean(g w) - xh mean(g w xh)), likewise.
__device__ __forceinline__ float ln_dx(float rstd, float g, float w, float mg, float xh, float mgx) {
  return mul_rn(rstd, add_rn(add_rn(mul_rn(g, w), -mg), -mul_rn(xh, mgx)));
}

template <typename T>
__device__ __forceinline__ void layer_norm_fwd(const T* __restrict__ x, const T* __restrict__ w,
                                               const T* __restrict__ b, T* __restrict__ y, int64_t rows,
                                               int cols, float eps) {
  __shared__ float scratch[64];
  constexpr int N = Pack<T>::N;
  const bool vec = cols % N == 0 && aligned16(x) && aligned16(y) && (w == nullptr || aligned16(w)) &&
                   (b == nullptr || aligned16(b));
  const int packs = cols / N;
  // A row of up to ROW_PACKS vectors a thread (every row rows_config gives
  // a block) is held in registers: one read of x, every load in flight at
  // once, the same elements in the same order as the loops below.
  const bool regs = vec && packs <= ROW_PACKS * (int)blockDim.x;
  // Vector i of the output, from p = x's vector i.
  auto write = [&](T* yr, int i, const Pack<T>& p, LnMoments m) {
    Pack<T> pw, pb, o;
    if (w) pw = load_pack(w + i * N);
    if (b) pb = load_pack(b + i * N);
#pragma unroll
    for (int k = 0; k < N; ++k)
      o.v[k] = from_f32<T>(ln_y(to_f32(p.v[k]), m, w ? to_f32(pw.v[k]) : 1.f, b ? to_f32(pb.v[k]) : 0.f));
    store_pack(yr + i * N, o);
  };
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    T* yr = y + row * cols;
    if (regs) {
      Pack<T> held[ROW_PACKS];
      each_pack(packs, true, [&](int i, int p) { held[p] = load_pack(xr + i * N); });
      auto each = [&](auto f) {
        each_pack(packs, true, [&](int i, int p) {
#pragma unroll
          for (int k = 0; k < N; ++k) f(i * N + k, to_f32(held[p].v[k]));
        });
      };
      const LnMoments m = moments_of(each, row_shift(xr, cols), cols, eps, scratch);
      each_pack(packs, true, [&](int i, int p) { write(yr, i, held[p], m); });
      continue;
    }
    const LnMoments m = row_moments(xr, cols, vec, eps, scratch);
    if (vec) {
      for (int i = threadIdx.x; i < packs; i += blockDim.x) write(yr, i, load_pack(xr + i * N), m);
    } else {
      scalar_cols<T>(cols, [&](int i) {
        yr[i] = from_f32<T>(ln_y(to_f32(xr[i]), m, w ? to_f32(w[i]) : 1.f, b ? to_f32(b[i]) : 0.f));
      });
    }
  }
}

// A backward row's moments and gradient means from the block's sums s =
// [sum(x - k), sum((x - k)^2), sum(g), sum(g (x - k))] of pass `pass`: as
// ln_moments, with mg = mean(g) and mgx = mean(g xh) filled in too.
__device__ __forceinline__ bool ln_sums(float4 s, int pass, int cols, float eps, LnMoments& m, float& mg,
                                        float& mgx) {
  if (!ln_moments(s.x, s.y, pass, cols, eps, m)) return false;
  mg = s.z / cols;
  mgx = mul_rn(m.rstd, add_rn(s.w, -mul_rn(m.m1, s.z))) / cols;
  return true;
}

// One row of layer_norm_bwd held in registers (HELD, HELD_SMEM): x and dy
// held as loaded (every load issued before the shift's), so that neither the
// moments' second pass nor the write of dx reads them again; wp(i, p) gives
// w's vector i (where `has_w`), held by the caller for all its rows or
// loaded again; sums(i, p, j, g, xh)
// adds value j of vector i (the thread's p-th) to the parameter gradients'
// sums. The same terms in the same order as layer_norm_bwd's loops: the same
// bits.
template <int P, typename T, typename W, typename Sums>
__device__ __forceinline__ void layer_norm_bwd_held_row(const T* __restrict__ xr, const T* __restrict__ gr,
                                                        T* __restrict__ dxr, W wp, bool has_w, Sums sums, int packs,
                                                        int cols, float eps, float* scratch) {
  constexpr int N = Pack<T>::N;
  Pack<T> hx[P], hg[P];
  each_pack<P>(packs, true, [&](int i, int p) {
    hx[p] = load_pack(xr + i * N);
    hg[p] = load_pack(gr + i * N);
  });
  LnMoments m{row_shift(xr, cols), 0.f, 0.f};
  float mg, mgx;
  for (int pass = 0;; ++pass) {
    float s1 = 0.f, s2 = 0.f, sg = 0.f, sgk = 0.f;
    each_pack<P>(packs, true, [&](int i, int p) {
      Pack<T> pw;
      if (has_w) pw = wp(i, p);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float d = to_f32(hx[p].v[j]) - m.k, g = mul_rn(to_f32(hg[p].v[j]), has_w ? to_f32(pw.v[j]) : 1.f);
        s1 = add_rn(s1, d);
        s2 = fmaf(d, d, s2);
        sg = add_rn(sg, g);
        sgk = fmaf(g, d, sgk);
      }
    });
    if (ln_sums(block_sum4(make_float4(s1, s2, sg, sgk), scratch), pass, cols, eps, m, mg, mgx)) break;
  }
  each_pack<P>(packs, true, [&](int i, int p) {
    Pack<T> o, pw;
    if (has_w) pw = wp(i, p);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float xh = ln_xh(to_f32(hx[p].v[j]), m), fg = to_f32(hg[p].v[j]);
      o.v[j] = from_f32<T>(ln_dx(m.rstd, fg, has_w ? to_f32(pw.v[j]) : 1.f, mg, xh, mgx));
      sums(i, p, j, fg, xh);
    }
    store_pack(dxr + i * N, o);
  });
}

// With xh = (x - mean) * rstd, g = dy * w:
// dx = rstd * (g - mean(g) - xh * mean(g * xh)); block b sums dy * xh and dy
// over its rows into row b of dw_partial / db_partial (when given): in
// registers until its last row where each thread owns at most ROW_PACKS
// vectors of a row, else in the partial rows themselves.
//
// A row's moments and gradient means come as the CPU's row_consts gets them
// for bf16 and f16: one read of x and dy and one block reduction of
// [sum(x - k), sum((x - k)^2), sum(g), sum(g (x - k))], with sum(g xh) =
// rstd (sum(g (x - k)) - m1 sum(g)), which loses at most about a bit where the
// shift is good (shift_good); elsewhere the same again with k + m1, the mean
// now known to a few bits, as the shift, so that m1 is tiny against the
// spread. Then a second read writes dx. Moments and sums took two reads and
// three block reductions before (the moments, then the sums about the mean).
// Rows held in registers (layer_norm_bwd_held_row) are read once: with HELD
// (layer_norm_bwd2h_*, two blocks of 256 an SM; the default since an H200
// timed it at 0.85x RELOAD's time in bf16, 0.65x as bwd4h in f32: docs/GPU.md)
// the dw/db sums stay in registers, with HELD_SMEM (layer_norm_bwd2s_*, three
// blocks; 0.95x in bf16) in shared memory.
template <int P, Keep KEEP, typename T>
__device__ __forceinline__ void layer_norm_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                                               const T* __restrict__ w, T* __restrict__ dx,
                                               float* __restrict__ dw_partial, float* __restrict__ db_partial,
                                               int64_t rows, int cols, float eps) {
  __shared__ float scratch[128];
  constexpr int N = Pack<T>::N;
  const bool vec = cols % N == 0 && aligned16(x) && aligned16(dy) && aligned16(dx) &&
                   (w == nullptr || aligned16(w));
  const int packs = cols / N;
  const bool regs = vec && packs <= P * (int)blockDim.x;
  float* pw_ = dw_partial ? dw_partial + (int64_t)blockIdx.x * cols : nullptr;
  float* pb_ = db_partial ? db_partial + (int64_t)blockIdx.x * cols : nullptr;
  float acc_w[P][N] = {}, acc_b[P][N] = {};
  // HELD_SMEM: dw's sums, then db's, in shared memory, each thread's own
  // (no barrier: no thread reads another's).
  float* const sw = KEEP == HELD_SMEM ? smem_sums<2>() : nullptr;
  float* const sb = KEEP == HELD_SMEM ? sw + SMEM_SUM_COLS : nullptr;
  if (KEEP == HELD_SMEM && regs) {
    each_pack<P>(packs, true, [&](int i, int) {
#pragma unroll
      for (int j = 0; j < N; ++j) sw[j * packs + i] = sb[j * packs + i] = 0.f;
    });
  }
  if (!regs) {
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
      if (pw_) pw_[j] = 0.f;
      if (pb_) pb_[j] = 0.f;
    }
    __syncthreads();  // the vector loop below maps columns to threads differently
  }
  // HELD: w's packs, the same for every row of this thread, loaded once
  // (HELD_SMEM loads them where used, to stay within 80 registers).
  Pack<T> hw[P];
  if (KEEP == HELD && regs && w) each_pack<P>(packs, true, [&](int i, int p) { hw[p] = load_pack(w + i * N); });
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    const T* gr = dy + row * cols;
    T* dxr = dx + row * cols;
    if (KEEP != RELOAD && regs) {
      layer_norm_bwd_held_row<P>(
          xr, gr, dxr, [&](int i, int p) { return KEEP == HELD ? hw[p] : load_pack(w + i * N); }, w != nullptr,
          [&](int i, int p, int j, float fg, float xh) {
            float& aw = KEEP == HELD_SMEM ? sw[j * packs + i] : acc_w[p][j];
            float& ab = KEEP == HELD_SMEM ? sb[j * packs + i] : acc_b[p][j];
            if (pw_) aw = fmaf(fg, xh, aw);
            if (pb_) ab += fg;
          },
          packs, cols, eps, scratch);
      continue;
    }
    LnMoments m{row_shift(xr, cols), 0.f, 0.f};
    float mg, mgx;
    for (int pass = 0;; ++pass) {
      float s1 = 0.f, s2 = 0.f, sg = 0.f, sgk = 0.f;
      auto add = [&](float fx, float fg, float fw) {
        const float d = fx - m.k, g = mul_rn(fg, fw);
        s1 = add_rn(s1, d);
        s2 = fmaf(d, d, s2);
        sg = add_rn(sg, g);
        sgk = fmaf(g, d, sgk);
      };
      if (vec) {
        each_pack<P>(packs, regs, [&](int i, int) {
          Pack<T> px = load_pack(xr + i * N), pg = load_pack(gr + i * N), pw;
          if (w) pw = load_pack(w + i * N);
#pragma unroll
          for (int j = 0; j < N; ++j) add(to_f32(px.v[j]), to_f32(pg.v[j]), w ? to_f32(pw.v[j]) : 1.f);
        });
      } else {
        scalar_cols<T>(cols, [&](int i) { add(to_f32(xr[i]), to_f32(gr[i]), w ? to_f32(w[i]) : 1.f); });
      }
      if (ln_sums(block_sum4(make_float4(s1, s2, sg, sgk), scratch), pass, cols, eps, m, mg, mgx)) break;
    }
    // Pack i of the row: its dx, and its dw and db terms added to aw and ab.
    auto pack = [&](int i, float* aw, float* ab) {
      Pack<T> px = load_pack(xr + i * N), pg = load_pack(gr + i * N), pw, o;
      if (w) pw = load_pack(w + i * N);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float xh = ln_xh(to_f32(px.v[j]), m), fg = to_f32(pg.v[j]);
        o.v[j] = from_f32<T>(ln_dx(m.rstd, fg, w ? to_f32(pw.v[j]) : 1.f, mg, xh, mgx));
        if (pw_) aw[j] = fmaf(fg, xh, aw[j]);
        if (pb_) ab[j] += fg;
      }
      store_pack(dxr + i * N, o);
    };
    if (vec) {
      each_pack<P>(packs, regs, [&](int i, int p) {
        if (p >= 0) {
          pack(i, acc_w[p], acc_b[p]);
        } else {
          pack(i, pw_ ? pw_ + i * N : nullptr, pb_ ? pb_ + i * N : nullptr);
        }
      });
    } else {
      scalar_cols<T>(cols, [&](int i) {
        const float xh = ln_xh(to_f32(xr[i]), m), fg = to_f32(gr[i]);
        dxr[i] = from_f32<T>(ln_dx(m.rstd, fg, w ? to_f32(w[i]) : 1.f, mg, xh, mgx));
        if (pw_) pw_[i] = fmaf(fg, xh, pw_[i]);
        if (pb_) pb_[i] += fg;
      });
    }
  }
  if (regs) {
    each_pack<P>(packs, true, [&](int i, int p) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (pw_) pw_[i * N + k] = KEEP == HELD_SMEM ? sw[k * packs + i] : acc_w[p][k];
        if (pb_) pb_[i * N + k] = KEEP == HELD_SMEM ? sb[k * packs + i] : acc_b[p][k];
      }
    });
  }
}

// The forward's blocks have up to 1024 threads (rows_config), so it is
// bounded to fit them: 64 registers. Without the bound, f32 took 79 with the
// shifted moments (64 before), which no 1024-thread block fits (rows of more
// than about 3200 vectors, 12800 f32, would fail to launch), and three
// blocks of 256 an SM where it had four. ptxas fits 64 without spills;
// softmax_fwd is bounded the same way.
#define KEEL_LAYER_NORM(SUFFIX, T)                                                                 \
  extern "C" __global__ void __launch_bounds__(1024)                                               \
      layer_norm_fwd_##SUFFIX(const T* x, const T* w, const T* b, T* y, int64_t rows, int cols,    \
                              float eps) {                                                         \
    layer_norm_fwd<T>(x, w, b, y, rows, cols, eps);                                                \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(512, 1)                                             \
      layer_norm_bwd_##SUFFIX(const T* dy, const T* x, const T* w, T* dx, float* dw_partial,       \
                              float* db_partial, int64_t rows, int cols, float eps) {              \
    layer_norm_bwd<ROW_PACKS, RELOAD, T>(dy, x, w, dx, dw_partial, db_partial, rows, cols, eps);   \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(256, 3)                                             \
      layer_norm_bwd2_##SUFFIX(const T* dy, const T* x, const T* w, T* dx, float* dw_partial,      \
                               float* db_partial, int64_t rows, int cols, float eps) {             \
    layer_norm_bwd<2, RELOAD, T>(dy, x, w, dx, dw_partial, db_partial, rows, cols, eps);           \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(256, 2)                                             \
      layer_norm_bwd2h_##SUFFIX(const T* dy, const T* x, const T* w, T* dx, float* dw_partial,     \
                                float* db_partial, int64_t rows, int cols, float eps) {            \
    layer_norm_bwd<2, HELD, T>(dy, x, w, dx, dw_partial, db_partial, rows, cols, eps);             \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(256, 3)                                             \
      layer_norm_bwd2s_##SUFFIX(const T* dy, const T* x, const T* w, T* dx, float* dw_partial,     \
                                float* db_partial, int64_t rows, int cols, float eps) {            \
    layer_norm_bwd<2, HELD_SMEM, T>(dy, x, w, dx, dw_partial, db_partial, rows, cols, eps);        \
  }                                                                                                \
  extern "C" __global__ void layer_norm_bwd_sum_##SUFFIX(const float* partial, T* out, int parts,  \
                                                         int cols) {                               \
    sum_parts<T>(partial, out, parts, cols);                                                       \
  }

KEEL_LAYER_NORM(f32, float)
KEEL_LAYER_NORM(f16, __half)
KEEL_LAYER_NORM(bf16, __nv_bfloat16)

// The four-vector backward with HELD rows, for f32 alone: 127 registers
// (16-bit rows of four vectors a thread, eight values each, spill at 128).
extern "C" __global__ void __launch_bounds__(256, 2)
    layer_norm_bwd4h_f32(const float* dy, const float* x, const float* w, float* dx, float* dw_partial,
                         float* db_partial, int64_t rows, int cols, float eps) {
  layer_norm_bwd<ROW_PACKS, HELD, float>(dy, x, w, dx, dw_partial, db_partial, rows, cols, eps);
}
