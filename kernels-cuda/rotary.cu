// Rotary position embedding for x[batch, seq, heads, head_dim] with cos and
// sin [seq, rotary_dim / 2]: each pair (a, b) becomes
// (a cos - b sin, b cos + a sin); dims from rotary_dim on are copied.
// Pairs are (i, i + rotary_dim/2) (GPT-NeoX) or (2i, 2i + 1) (GPT-J,
// interleaved). sign = -1 rotates by the opposite angle (the backward).
//
// A row is one head of one token (head_dim elements, contiguous); x's rows
// are at b * sb + s * ss + h * sh (element strides of its batch, seq and heads
// dims: q or k sliced from a fused qkv, or a [batch, heads, seq, head_dim]
// tensor transposed, read in place), y's are contiguous. `lanes` threads (a
// power of two up to 32) share a row, so a block of blockDim threads works
// on blockDim / lanes rows at a time, grid-stride over rows; the row's
// position is worked out once per row, not per element (64-bit division is
// a long instruction sequence on the GPU). 16-byte loads and stores when the
// rows, strides, halves and pointers allow (NeoX: half a multiple of the pack;
// GPT-J: rotary_dim a multiple of it, each pack holding pack/2 pairs), scalar
// otherwise. f32 math, one rounding.
//
// In place (rotary_inplace_*, vLLM's form), y is x, rows at x's strides:
// each thread reads the elements it then writes (a pair, or a pack of
// pairs), so no other thread reads a written element; ordinary loads for x
// (the read-only path must not see memory the kernel writes), no
// __restrict__ on it, and the dims past rotary_dim stay where they are.
// Kernel symbols: rotary_{f32,f16,bf16}, rotary_inplace_{f32,f16,bf16}.
#include "common.cuh"

using namespace keel;

// One pair; each rounding spelled out (mul_rn), so the vector and element-wise
// loops give the same bits whatever the compiler would fuse.
template <typename T>
__device__ __forceinline__ void rotate(float a, float b, float c, float s, T& ya, T& yb) {
  ya = from_f32<T>(fmaf(a, c, -mul_rn(b, s)));
  yb = from_f32<T>(fmaf(b, c, mul_rn(a, s)));
}

// The rows; the callers own the aliasing promises (see the entry points).
template <bool InPlace, typename T>
__device__ __forceinline__ void rotary_rows(const T* x, const T* __restrict__ cos_, const T* __restrict__ sin_, T* y,
                                            int64_t rows, int seq, int heads, int head_dim, int half, int interleaved,
                                            float sign, int lanes, int64_t sb, int64_t ss, int64_t sh) {
  constexpr int N = Pack<T>::N;
  const int lane = threadIdx.x % lanes, groups = blockDim.x / lanes;
  if ((int)threadIdx.x >= groups * lanes) return;  // no barriers here: leaving early is safe
  const int rot = 2 * half, rest = head_dim - rot;
  const bool vec = head_dim % N == 0 && rot % N == 0 && (interleaved || half % N == 0) && sb % N == 0 &&
                   ss % N == 0 && sh % N == 0 && aligned16(x) && aligned16(y) && aligned16(cos_) && aligned16(sin_);
  for (int64_t row = (int64_t)blockIdx.x * groups + threadIdx.x / lanes; row < rows;
       row += (int64_t)gridDim.x * groups) {
    const int64_t token = row / heads, b = token / seq;
    const int64_t head = row - token * heads, pos = token - b * seq;
    const T* xr = x + b * sb + pos * ss + head * sh;
    T* yr = InPlace ? y + b * sb + pos * ss + head * sh : y + row * head_dim;
    const T* cr = cos_ + pos * half;
    const T* sr = sin_ + pos * half;
    if (vec && !interleaved) {
      for (int j = lane * N; j < half; j += lanes * N) {
        const Pack<T> a = load_in<InPlace>(xr + j), b = load_in<InPlace>(xr + half + j), c = load_pack(cr + j),
                      s = load_pack(sr + j);
        Pack<T> oa, ob;
#pragma unroll
        for (int k = 0; k < N; ++k)
          rotate(to_f32(a.v[k]), to_f32(b.v[k]), to_f32(c.v[k]), sign * to_f32(s.v[k]), oa.v[k], ob.v[k]);
        store_pack(yr + j, oa);
        store_pack(yr + half + j, ob);
      }
    } else if (vec) {
      for (int j = lane * N; j < rot; j += lanes * N) {
        const Pack<T> p = load_in<InPlace>(xr + j);
        Pack<T> o;
#pragma unroll
        for (int k = 0; k < N / 2; ++k) {
          const int q = j / 2 + k;
          rotate(to_f32(p.v[2 * k]), to_f32(p.v[2 * k + 1]), to_f32(cr[q]), sign * to_f32(sr[q]), o.v[2 * k],
                 o.v[2 * k + 1]);
        }
        store_pack(yr + j, o);
      }
    } else {
      for (int k = lane; k < half; k += lanes) {
        const int ia = interleaved ? 2 * k : k, ib = interleaved ? 2 * k + 1 : k + half;
        rotate(to_f32(xr[ia]), to_f32(xr[ib]), to_f32(cr[k]), sign * to_f32(sr[k]), yr[ia], yr[ib]);
      }
    }
    if (InPlace) {
      // The dims past rotary_dim are already in place.
    } else if (vec && rest % N == 0) {
      for (int j = rot + lane * N; j < head_dim; j += lanes * N) store_pack(yr + j, load_pack(xr + j));
    } else {
      for (int j = rot + lane; j < head_dim; j += lanes) yr[j] = xr[j];
    }
  }
}

// Out of place: y is contiguous and overlaps nothing.
template <typename T>
__device__ __forceinline__ void rotary(const T* __restrict__ x, const T* __restrict__ cos_, const T* __restrict__ sin_,
                                       T* __restrict__ y, int64_t rows, int seq, int heads, int head_dim, int half,
                                       int interleaved, float sign, int lanes, int64_t sb, int64_t ss, int64_t sh) {
  rotary_rows<false>(x, cos_, sin_, y, rows, seq, heads, head_dim, half, interleaved, sign, lanes, sb, ss, sh);
}

#define KEEL_ROTARY(SUFFIX, T)                                                                                     \
  extern "C" __global__ void rotary_##SUFFIX(const T* x, const T* cos_, const T* sin_, T* y, int64_t rows,         \
                                             int seq, int heads, int head_dim, int half, int interleaved,          \
                                             float sign, int lanes, int64_t sb, int64_t ss, int64_t sh) {          \
    rotary<T>(x, cos_, sin_, y, rows, seq, heads, head_dim, half, interleaved, sign, lanes, sb, ss, sh);            \
  }                                                                                                                \
  /* In place: x's heads do not overlap (checked by the caller). */                                                \
  extern "C" __global__ void rotary_inplace_##SUFFIX(T* x, const T* cos_, const T* sin_, int64_t rows, int seq,    \
                                                     int heads, int head_dim, int half, int interleaved,           \
                                                     float sign, int lanes, int64_t sb, int64_t ss, int64_t sh) {  \
    rotary_rows<true>(x, cos_, sin_, x, rows, seq, heads, head_dim, half, interleaved, sign, lanes, sb, ss, sh);    \
  }

KEEL_ROTARY(f32, float)
KEEL_ROTARY(f16, __half)
KEEL_ROTARY(bf16, __nv_bfloat16)
