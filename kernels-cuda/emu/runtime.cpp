// The fiber scheduler behind emu.h: one block at a time, its threads as
// ucontext fibers that switch only at barriers, one warp at a time.
#include "emu.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <ucontext.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

namespace keel_emu {
namespace {

enum class At { Running, Shuffle, Barrier, Exited };

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  At at = At::Running;
  unsigned mask = 0;
  int lane_mask = 0, width = 32;
  uint64_t in = 0, out = 0;
};

constexpr size_t kStack = 256 * 1024;

struct Grid {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  unsigned current = 0;
  const char* name = nullptr;
  Invoker f = nullptr;
  void** params = nullptr;
  std::string error;
};

Grid* g = nullptr;

void entry() {
  g->f(g->params);
  g->fibers[g->current].at = At::Exited;  // then returns to uc_link, the scheduler
}

void yield() { swapcontext(&g->fibers[g->current].ctx, &g->scheduler); }

// Hands out the shuffle results of warp `w`, whose lanes all wait at a
// shuffle; false (with g->error) when only some of them do.
bool resolve_warp(unsigned w) {
  auto& fs = g->fibers;
  const unsigned lo = w * 32, hi = lo + 32 < fs.size() ? lo + 32 : (unsigned)fs.size();
  unsigned shuffling = 0;
  for (unsigned i = lo; i < hi; ++i) shuffling += fs[i].at == At::Shuffle;
  char msg[200];
  if (hi - lo != 32) {
    snprintf(msg, sizeof msg, "warp %u has %u lanes: a shuffle needs all 32", w, hi - lo);
    g->error = msg;
    return false;
  }
  if (shuffling != 32) {
    snprintf(msg, sizeof msg,
             "shuffle in warp %u reached by %u of 32 lanes (the others exited or wait at __syncthreads)", w,
             shuffling);
    g->error = msg;
    return false;
  }
  for (unsigned i = lo; i < hi; ++i) {
    const Fiber& f = fs[i];
    if (f.mask != 0xffffffffu) {
      snprintf(msg, sizeof msg, "lane %u shuffles with mask %#x; only full warps are modelled", i - lo, f.mask);
      g->error = msg;
      return false;
    }
    const unsigned lane = i - lo, src = lane ^ (unsigned)f.lane_mask;
    const bool same_segment = src < 32 && src / f.width == lane / f.width;
    fs[i].out = same_segment ? fs[lo + src].in : f.in;
  }
  for (unsigned i = lo; i < hi; ++i) fs[i].at = At::Running;
  return true;
}

// Runs warp `w` until each of its lanes waits at __syncthreads or has exited,
// doing its shuffles on the way. One warp runs this far before the next one
// starts (the most skew between warps that the barriers allow), so that a
// read of shared memory that lacks a barrier sees another warp's later write
// in one of the two orders.
bool run_warp(unsigned w, int reverse) {
  auto& fs = g->fibers;
  const unsigned lo = w * 32, hi = lo + 32 < fs.size() ? lo + 32 : (unsigned)fs.size();
  for (;;) {
    bool shuffle = false;
    for (unsigned k = lo; k < hi; ++k) {
      const unsigned i = reverse ? hi - 1 - (k - lo) : k;
      if (fs[i].at == At::Running) {
        g->current = i;
        threadIdx = {i, 0, 0};
        swapcontext(&g->scheduler, &fs[i].ctx);
      }
      shuffle |= fs[i].at == At::Shuffle;
    }
    if (!shuffle) return true;
    if (!resolve_warp(w)) return false;
  }
}

// Runs the current block to its end; false with g->error on a bad barrier.
bool run_block(unsigned block, int reverse) {
  auto& fs = g->fibers;
  const unsigned n = (unsigned)fs.size(), warps = (n + 31) / 32;
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = fs[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &g->scheduler;
    makecontext(&f.ctx, entry, 0);
    f.at = At::Running;
  }
  blockIdx = {block, 0, 0};
  for (;;) {
    for (unsigned k = 0; k < warps; ++k)
      if (!run_warp(reverse ? warps - 1 - k : k, reverse)) return false;
    unsigned exited = 0, waiting = 0;
    for (const Fiber& f : fs) {
      exited += f.at == At::Exited;
      waiting += f.at == At::Barrier;
    }
    if (exited == n) return true;
    if (waiting != n) {
      char msg[200];
      snprintf(msg, sizeof msg, "__syncthreads in block %u reached by %u of %u threads (%u exited)", block, waiting, n,
               exited);
      g->error = msg;
      return false;
    }
    for (Fiber& f : fs) f.at = At::Running;
  }
}

// A kernel's out-of-bounds access lands in a guard page of the test's
// buffers: say where, then end the process (its stack is a fiber's).
void on_fault(int, siginfo_t* info, void*) {
  char msg[256];
  const int n = snprintf(msg, sizeof msg, "cuda-emu: memory fault at %p in kernel %s, block %u, thread %u\n",
                         info->si_addr, g ? g->name : "?", blockIdx.x, threadIdx.x);
  if (write(2, msg, n > 0 ? (size_t)n : 0) < 0) {}
  _exit(134);
}

// A launch that runs longer than this is taken to loop forever (a kernel
// that never reaches a barrier cannot be interrupted any other way).
constexpr unsigned kLaunchSeconds = 120;

void on_timeout(int) {
  char msg[256];
  const int n = snprintf(msg, sizeof msg,
                         "cuda-emu: kernel %s still running after %u s (block %u, thread %u): an endless loop?\n",
                         g ? g->name : "?", kLaunchSeconds, blockIdx.x, threadIdx.x);
  if (write(2, msg, n > 0 ? (size_t)n : 0) < 0) {}
  _exit(134);
}

}  // namespace

void misaligned(const void* p, size_t align) {
  fprintf(stderr, "cuda-emu: misaligned load of %zu-byte aligned data at %p in kernel %s, block %u, thread %u\n", align,
          p, g ? g->name : "?", blockIdx.x, threadIdx.x);
  _exit(134);
}

void sync_block() {
  g->fibers[g->current].at = At::Barrier;
  yield();
}

uint64_t shfl_xor(unsigned mask, uint64_t bits, int lane_mask, int width) {
  Fiber& f = g->fibers[g->current];
  f.at = At::Shuffle;
  f.mask = mask;
  f.lane_mask = lane_mask;
  f.width = width;
  f.in = bits;
  yield();
  return g->fibers[g->current].out;
}

int run_grid(const char* name, Invoker f, unsigned grid, unsigned block, void** params, int reverse, char* err,
             size_t err_len) {
  if (grid == 0 || block == 0 || block > 1024) {
    snprintf(err, err_len, "bad launch: %u blocks of %u threads", grid, block);
    return 1;
  }
  Grid state;
  state.name = name;
  state.f = f;
  state.params = params;
  state.fibers.resize(block);
  for (Fiber& fb : state.fibers) fb.stack.reset(new char[kStack]);
  g = &state;
  struct sigaction fault = {}, old_segv, old_bus;
  fault.sa_sigaction = on_fault;
  fault.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &fault, &old_segv);
  sigaction(SIGBUS, &fault, &old_bus);
  struct sigaction timeout = {}, old_alarm;
  timeout.sa_handler = on_timeout;
  sigaction(SIGALRM, &timeout, &old_alarm);
  alarm(kLaunchSeconds);
  gridDim = {grid, 1, 1};
  blockDim = {block, 1, 1};
  int status = 0;
  for (unsigned b = 0; b < grid && status == 0; ++b)
    if (!run_block(b, reverse)) status = 1;
  if (status) snprintf(err, err_len, "%s", state.error.c_str());
  alarm(0);
  sigaction(SIGALRM, &old_alarm, nullptr);
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  g = nullptr;
  return status;
}

}  // namespace keel_emu
