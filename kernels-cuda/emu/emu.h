// A CPU emulation of the parts of CUDA that kernels-cuda/ uses, so that the
// kernels' own code runs (compiled by a host C++ compiler) where there is no
// GPU. Used only by tests (src/cuda/emu.rs), never by the library.
//
// What it models:
// - Blocks run one after another; the threads of a block run as fibers
//   (runtime.cpp) on one OS thread, switching only at __syncthreads and warp
//   shuffles. `__shared__` is therefore a plain `static`. Each warp runs up
//   to the next __syncthreads before the next warp starts.
// - __syncthreads waits for every thread of the block; a barrier that some
//   threads never reach (they exited, or wait at a shuffle) is reported as an
//   error, as are shuffles whose warp is not complete or not all present.
// - The order of warps, and of lanes within a warp, can be reversed, so that
//   a test can run a kernel both ways and catch a missing barrier.
// - A launch still running after 120 s ends the process, naming the kernel.
// What it does not model: the memory model across blocks, atomics, timing,
// the PTX that nvcc makes (it runs the C++ source, compiled by g++).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <type_traits>
#include <utility>

// The CUDA headers, compiled for the host, define these as attributes a host
// compiler warns about; here they mean nothing (or static, for shared memory).
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#define __global__
#define __launch_bounds__(...)
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

namespace keel_emu {
// Waits at the block barrier (see runtime.cpp).
void sync_block();
// Reports a load from `p` that a GPU would fault on (it needs `align`),
// with the kernel, block and thread, and ends the process. Misaligned stores
// are caught by -fsanitize=alignment, which the tests compile with.
[[noreturn]] void misaligned(const void* p, size_t align);
// Exchanges `bits` with lane `lane ^ lane_mask` of this warp.
uint64_t shfl_xor(unsigned mask, uint64_t bits, int lane_mask, int width);

// A kernel called with CUDA's kernelParams convention: params[i] points to
// the i-th argument.
using Invoker = void (*)(void** params);

// One letter per parameter type, as the Rust side names its arguments:
// p (pointer), l (int64_t), i (int), f (float).
template <typename A> constexpr char code() {
  if constexpr (std::is_pointer_v<A>) return 'p';
  else if constexpr (std::is_same_v<A, int64_t>) return 'l';
  else if constexpr (std::is_same_v<A, int>) return 'i';
  else if constexpr (std::is_same_v<A, float>) return 'f';
  else return '?';
}

template <auto F> struct Call;
template <typename... A, void (*F)(A...)> struct Call<F> {
  static constexpr char signature[] = {code<std::remove_cv_t<A>>()..., '\0'};
  template <size_t... I> static void call(void** p, std::index_sequence<I...>) {
    F(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(p[I])...);
  }
  static void run(void** p) { call(p, std::index_sequence_for<A...>{}); }
};

// Runs `f` (named `name`) over `grid` blocks of `block` threads; returns 0,
// or 1 with a message in `err`. A memory fault in the kernel ends the
// process after printing the kernel, block and thread.
int run_grid(const char* name, Invoker f, unsigned grid, unsigned block, void** params, int reverse, char* err,
             size_t err_len);
}  // namespace keel_emu

inline void __syncthreads() { keel_emu::sync_block(); }

template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move at most 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  bits = keel_emu::shfl_xor(mask, bits, lane_mask, width);
  T out;
  memcpy(&out, &bits, sizeof(T));
  return out;
}

template <typename T> inline T __ldg(const T* p) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0) keel_emu::misaligned(p, alignof(T));
  return *p;
}
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
// The bits of a float as an int and back (cross_entropy's status word).
inline int __float_as_int(float x) {
  int i;
  memcpy(&i, &x, sizeof i);
  return i;
}
inline float __int_as_float(int i) {
  float x;
  memcpy(&x, &i, sizeof x);
  return x;
}
// Never fused on the GPU; the emulation is built without FMA contraction.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
// The GPU's approximations (gated.cu's f16 and bf16 paths), emulated by the
// precise operations, whose results are within the approximations' error;
// __fdividef's special case kept: 0 times a for 2^126 < |b| < 2^128.
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) {
  const float m = fabsf(b);
  return m > 0x1p126f && m < INFINITY ? a * 0.f : a / b;
}
