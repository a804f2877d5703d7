// Gated activations: y[r, j] = act(x[r, j]) * x[r, d + j] for x of shape
// [rows, 2d] (SwiGLU with silu, GeGLU with gelu), and their backward
// dx = [dy * b * act'(a) | dy * act(a)].
//
// Element-wise: a grid-stride loop over rows * d outputs (walked as row and
// column, RowCol: no division per step), 16 bytes of each
// half per step when d is a multiple of 16 bytes and the pointers are aligned.
// f32 math. For f32 data, the precise expf/erff/tanhf and divisions. For f16
// and bf16 (`Fast`), whose outputs keep 11 and 8 bits, exp and the divisions
// are the hardware's approximations (__expf, __fdividef: relative errors near
// 1e-6 for |x| < 10, against 5e-4 and 4e-3 for one rounding of the output),
// and tanh comes from them: a 16-byte vector holds eight such elements, twice
// f32's four, and on an H200 these rows ran at 66-78% of the bandwidth where
// f32 reached 85-91% (instructions, not memory). erf is erff for f32 and, for
// f16 and bf16, the CPU kernels' rational function (erf_fast below).
// Kernel symbols: {silu,gelu,gelu_tanh}_and_mul_{fwd,bwd}_{f32,f16,bf16}.
#include "common.cuh"

using namespace keel;

// a / b, precise or fast (see above; exp_ is in common.cuh). __fdividef(a, b)
// is 0 for 2^126 < |b| < 2^128 (a / b is below 2^-126 |a| there) and, as
// a / b, +-0 for b = inf.
template <bool Fast> __device__ __forceinline__ float div_(float a, float b) {
  return Fast ? __fdividef(a, b) : a / b;
}
// tanh(u): tanhf, or where Fast 1 - 2 / (1 + exp(2u)) from the fast exp and
// division: +-1 where exp over- or underflows; an absolute error near 1e-7,
// which is what 1 + tanh (all the uses below) sees.
template <bool Fast> __device__ __forceinline__ float tanh_(float u) {
  return Fast ? 1.f - div_<true>(2.f, 1.f + exp_<true>(2.f * u)) : tanhf(u);
}

struct Silu {
  template <bool Fast> static __device__ __forceinline__ float f(float x) {
    return div_<Fast>(x, 1.f + exp_<Fast>(-x));
  }
  template <bool Fast> static __device__ __forceinline__ float2 f_df(float x) {
    const float s = div_<Fast>(1.f, 1.f + exp_<Fast>(-x));
    return make_float2(x * s, s * (1.f + x * (1.f - s)));
  }
};

// erf(x) where Fast: the rational function of Keel's CPU kernels
// (kernels-cpu math.rs erf_f32, whose test checks these literals; Eigen's
// and XLA's: within a few f32 ulp of erf), with the fast division (q is at
// most -0.0142 on [-4, 4]: far from where __fdividef gives 0); exactly +-1
// from |x| = 3.92 on, where erf rounds to +-1 in f32. erff branches on |x|
// and took the bf16 forward's time to 1.14 times silu's (H200, after the
// launch bounds below); this one 1.10 times.
__device__ __forceinline__ float erf_fast(float x) {
  const float xc = fminf(fmaxf(x, -4.f), 4.f), x2 = xc * xc;
  float p = -2.7261423e-10f;
  p = fmaf(p, x2, 2.7706814e-8f);
  p = fmaf(p, x2, -2.101024e-6f);
  p = fmaf(p, x2, -5.6925064e-5f);
  p = fmaf(p, x2, -7.349906e-4f);
  p = fmaf(p, x2, -2.9546002e-3f);
  p = fmaf(p, x2, -1.6096033e-2f);
  float q = -1.4566072e-5f;
  q = fmaf(q, x2, -2.1337406e-4f);
  q = fmaf(q, x2, -1.682827e-3f);
  q = fmaf(q, x2, -7.373329e-3f);
  q = fmaf(q, x2, -1.426474e-2f);
  return fabsf(x) >= 3.92f ? copysignf(1.f, x) : __fdividef(xc * p, q);
}
template <bool Fast> __device__ __forceinline__ float erf_(float x) { return Fast ? erf_fast(x) : erff(x); }

struct Gelu {
  template <bool Fast> static __device__ __forceinline__ float f(float x) {
    return 0.5f * x * (1.f + erf_<Fast>(x * 0.70710678118654752f));
  }
  template <bool Fast> static __device__ __forceinline__ float2 f_df(float x) {
    const float cdf = 0.5f * (1.f + erf_<Fast>(x * 0.70710678118654752f));
    const float pdf = exp_<Fast>(-0.5f * x * x) * 0.39894228040143268f;
    return make_float2(x * cdf, cdf + x * pdf);
  }
};

struct GeluTanh {
  static constexpr float K = 0.79788456080286536f, C = 0.044715f;
  template <bool Fast> static __device__ __forceinline__ float f(float x) {
    return 0.5f * x * (1.f + tanh_<Fast>(K * (x + C * x * x * x)));
  }
  template <bool Fast> static __device__ __forceinline__ float2 f_df(float x) {
    const float t = tanh_<Fast>(K * (x + C * x * x * x));
    // x clamped where t is exactly +-1 (|x| > 1e9), so that x * x cannot
    // overflow and make 0 * inf = NaN where the derivative is 1 or 0.
    const float xc = fminf(fmaxf(x, -1e9f), 1e9f);
    const float dt = (1.f - t * t) * K * (1.f + 3.f * C * xc * xc);
    return make_float2(0.5f * x * (1.f + t), 0.5f * (1.f + t) + 0.5f * x * dt);
  }
};

template <typename Act, typename T>
__device__ __forceinline__ void act_and_mul_fwd(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int d) {
  constexpr int N = Pack<T>::N;
  constexpr bool Fast = FastMath<T>::value;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (d % N == 0 && aligned16(x) && aligned16(y)) {
    for (RowCol p(first, stride, d / N); p.row < rows; p.next()) {
      const int64_t row = p.row;
      const int c = p.col * N;
      Pack<T> a = load_pack(x + row * 2 * d + c), g = load_pack(x + row * 2 * d + d + c), o;
#pragma unroll
      for (int k = 0; k < N; ++k) o.v[k] = from_f32<T>(Act::template f<Fast>(to_f32(a.v[k])) * to_f32(g.v[k]));
      store_pack(y + row * d + c, o);
    }
  } else {
    for (RowCol p(first, stride, d); p.row < rows; p.next()) {
      const int64_t row = p.row;
      const int c = p.col;
      y[row * d + c] = from_f32<T>(Act::template f<Fast>(to_f32(x[row * 2 * d + c])) * to_f32(x[row * 2 * d + d + c]));
    }
  }
}

template <typename Act, typename T>
__device__ __forceinline__ void act_and_mul_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                                                T* __restrict__ dx, int64_t rows, int d) {
  constexpr int N = Pack<T>::N;
  constexpr bool Fast = FastMath<T>::value;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (d % N == 0 && aligned16(x) && aligned16(dy) && aligned16(dx)) {
    for (RowCol p(first, stride, d / N); p.row < rows; p.next()) {
      const int64_t row = p.row;
      const int c = p.col * N;
      const int64_t at = row * 2 * d + c;
      Pack<T> a = load_pack(x + at), g = load_pack(x + at + d), pg = load_pack(dy + row * d + c), da, dg;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float2 e = Act::template f_df<Fast>(to_f32(a.v[k]));
        const float gy = to_f32(pg.v[k]);
        da.v[k] = from_f32<T>(gy * to_f32(g.v[k]) * e.y);
        dg.v[k] = from_f32<T>(gy * e.x);
      }
      store_pack(dx + at, da);
      store_pack(dx + at + d, dg);
    }
  } else {
    for (RowCol p(first, stride, d); p.row < rows; p.next()) {
      const int64_t row = p.row;
      const int c = p.col;
      const int64_t at = row * 2 * d + c;
      const float2 e = Act::template f_df<Fast>(to_f32(x[at]));
      const float gy = to_f32(dy[row * d + c]);
      dx[at] = from_f32<T>(gy * to_f32(x[at + d]) * e.y);
      dx[at + d] = from_f32<T>(gy * e.x);
    }
  }
}

// The forward's launch bounds are the grid gated.rs launches (THREADS = 256
// a block, BLOCKS_PER_SM = 8): they hold it to 32 registers, so that all 8
// blocks fit on an SM at once. Without them gelu's erff took 39 (f32) and 43 (bf16),
// 5 or 6 blocks fitted, and the other blocks of the grid-stride grid ran
// after them, with only the in-flight loads of those few; silu and gelu_tanh
// needed 32 already. The backward keeps the compiler's count: held to 32,
// gelu's spills 16 bytes.
#define KEEL_GATED(NAME, ACT, SUFFIX, T)                                                               \
  extern "C" __global__ void __launch_bounds__(256, 8)                                                 \
      NAME##_and_mul_fwd_##SUFFIX(const T* x, T* y, int64_t rows, int d) {                             \
    act_and_mul_fwd<ACT, T>(x, y, rows, d);                                                            \
  }                                                                                                    \
  extern "C" __global__ void NAME##_and_mul_bwd_##SUFFIX(const T* dy, const T* x, T* dx, int64_t rows, \
                                                         int d) {                                      \
    act_and_mul_bwd<ACT, T>(dy, x, dx, rows, d);                                                       \
  }
#define KEEL_GATED_ALL(NAME, ACT)           \
  KEEL_GATED(NAME, ACT, f32, float)         \
  KEEL_GATED(NAME, ACT, f16, __half)        \
  KEEL_GATED(NAME, ACT, bf16, __nv_bfloat16)

KEEL_GATED_ALL(silu, Silu)
KEEL_GATED_ALL(gelu, Gelu)
KEEL_GATED_ALL(gelu_tanh, GeluTanh)
