// Gated activations: y[r, j] = act(x[r, j]) * x[r, d + j] for x of shape
// [rows, 2d] (SwiGLU with silu, GeGLU with gelu), and their backward
// dx = [dy * b * act'(a) | dy * act(a)].
//
// Element-wise: a grid-stride loop over rows * d outputs (walked as row and
// column, RowCol: no division per step), 16 bytes of each
// half per step when d is a multiple of 16 bytes and the pointers are aligned.
// f32 math with the precise expf/erff/tanhf.
// Kernel symbols: {silu,gelu,gelu_tanh}_and_mul_{fwd,bwd}_{f32,f16,bf16}.
#include "common.cuh"

using namespace keel;

struct Silu {
  static __device__ __forceinline__ float f(float x) { return x / (1.f + expf(-x)); }
  static __device__ __forceinline__ float2 f_df(float x) {
    const float s = 1.f / (1.f + expf(-x));
    return make_float2(x * s, s * (1.f + x * (1.f - s)));
  }
};

struct Gelu {
  static __device__ __forceinline__ float f(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
  static __device__ __forceinline__ float2 f_df(float x) {
    const float cdf = 0.5f * (1.f + erff(x * 0.70710678118654752f));
    const float pdf = expf(-0.5f * x * x) * 0.39894228040143268f;
    return make_float2(x * cdf, cdf + x * pdf);
  }
};

struct GeluTanh {
  static constexpr float K = 0.79788456080286536f, C = 0.044715f;
  static __device__ __forceinline__ float f(float x) { return 0.5f * x * (1.f + tanhf(K * (x + C * x * x * x))); }
  static __device__ __forceinline__ float2 f_df(float x) {
    const float t = tanhf(K * (x + C * x * x * x));
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
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (d % N == 0 && aligned16(x) && aligned16(y)) {
    for (RowCol p(first, stride, d / N); p.row < rows; p.next()) {
      const int64_t row = p.row;
      const int c = p.col * N;
      Pack<T> a = load_pack(x + row * 2 * d + c), g = load_pack(x + row * 2 * d + d + c), o;
#pragma unroll
      for (int k = 0; k < N; ++k) o.v[k] = from_f32<T>(Act::f(to_f32(a.v[k])) * to_f32(g.v[k]));
      store_pack(y + row * d + c, o);
    }
  } else {
    for (RowCol p(first, stride, d); p.row < rows; p.next()) {
      const int64_t row = p.row;
      const int c = p.col;
      y[row * d + c] = from_f32<T>(Act::f(to_f32(x[row * 2 * d + c])) * to_f32(x[row * 2 * d + d + c]));
    }
  }
}

template <typename Act, typename T>
__device__ __forceinline__ void act_and_mul_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                                                T* __restrict__ dx, int64_t rows, int d) {
  constexpr int N = Pack<T>::N;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (d % N == 0 && aligned16(x) && aligned16(dy) && aligned16(dx)) {
    for (RowCol p(first, stride, d / N); p.row < rows; p.next()) {
      const int64_t row = p.row;
      const int c = p.col * N;
      const int64_t at = row * 2 * d + c;
      Pack<T> a = load_pack(x + at), g = load_pack(x + at + d), pg = load_pack(dy + row * d + c), da, dg;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float2 e = Act::f_df(to_f32(a.v[k]));
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
      const float2 e = Act::f_df(to_f32(x[at]));
      const float gy = to_f32(dy[row * d + c]);
      dx[at] = from_f32<T>(gy * to_f32(x[at + d]) * e.y);
      dx[at + d] = from_f32<T>(gy * e.x);
    }
  }
}

#define KEEL_GATED(NAME, ACT, SUFFIX, T)                                                              \
  extern "C" __global__ void NAME##_and_mul_fwd_##SUFFIX(const T* x, T* y, int64_t rows, int d) {     \
    act_and_mul_fwd<ACT, T>(x, y, rows, d);                                                           \
  }                                                                                                   \
  extern "C" __global__ void NAME##_and_mul_bwd_##SUFFIX(const T* dy, const T* x, T* dx, int64_t rows, \
                                                         int d) {                                     \
    act_and_mul_bwd<ACT, T>(dy, x, dx, rows, d);                                                      \
  }
#define KEEL_GATED_ALL(NAME, ACT)           \
  KEEL_GATED(NAME, ACT, f32, float)         \
  KEEL_GATED(NAME, ACT, f16, __half)        \
  KEEL_GATED(NAME, ACT, bf16, __nv_bfloat16)

KEEL_GATED_ALL(silu, Silu)
KEEL_GATED_ALL(gelu, Gelu)
KEEL_GATED_ALL(gelu_tanh, GeluTanh)
