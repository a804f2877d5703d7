// Rotary position embedding for x[batch, seq, heads, head_dim] with cos and
// sin [seq, rotary_dim / 2]: each pair (a, b) becomes
// (a cos - b sin, b cos + a sin); dims from rotary_dim on are copied.
// Pairs are (i, i + rotary_dim/2) (GPT-NeoX) or (2i, 2i + 1) (GPT-J,
// interleaved). sign = -1 rotates by the opposite angle (the backward).
//
// Element-wise: a grid-stride loop over rows * rotary_dim/2 pairs, then one
// over the pass-through dims. f32 math, one rounding.
// Kernel symbols: rotary_{f32,f16,bf16}.
#include "common.cuh"

using namespace keel;

template <typename T>
__device__ __forceinline__ void rotary(const T* __restrict__ x, const T* __restrict__ cos_, const T* __restrict__ sin_,
                                       T* __restrict__ y, int64_t rows, int seq, int heads, int head_dim, int half,
                                       int interleaved, float sign) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < rows * half; i += stride) {
    const int64_t row = i / half;
    const int k = (int)(i - row * half);
    const int64_t pos = (row / heads) % seq;
    const float c = to_f32(cos_[pos * half + k]), s = sign * to_f32(sin_[pos * half + k]);
    const int64_t ia = row * head_dim + (interleaved ? 2 * k : k);
    const int64_t ib = ia + (interleaved ? 1 : half);
    const float a = to_f32(x[ia]), b = to_f32(x[ib]);
    y[ia] = from_f32<T>(a * c - b * s);
    y[ib] = from_f32<T>(b * c + a * s);
  }
  const int rest = head_dim - 2 * half;
  for (int64_t i = first; i < rows * rest; i += stride) {
    const int64_t row = i / rest;
    const int64_t at = row * head_dim + 2 * half + (i - row * rest);
    y[at] = x[at];
  }
}

#define KEEL_ROTARY(SUFFIX, T)                                                                                  \
  extern "C" __global__ void rotary_##SUFFIX(const T* x, const T* cos_, const T* sin_, T* y, int64_t rows,      \
                                             int seq, int heads, int head_dim, int half, int interleaved,       \
                                             float sign) {                                                      \
    rotary<T>(x, cos_, sin_, y, rows, seq, heads, head_dim, half, interleaved, sign);                           \
  }

KEEL_ROTARY(f32, float)
KEEL_ROTARY(f16, __half)
KEEL_ROTARY(bf16, __nv_bfloat16)
