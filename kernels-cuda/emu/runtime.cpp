// The fiber scheduler behind emu.h: one block at a time, its threads as
// fibers that switch only at barriers, one warp at a time.
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

void entry();

// A fiber's saved context and the switch between two. On x86-64, a few
// instructions that save what the SysV ABI has callees keep (rbx, rbp,
// r12-r15, the stack pointer, MXCSR and the x87 control word): glibc's
// swapcontext also saves and restores the signal mask, a system call at
// every switch: with it the keel lib tests (nearly all emulation) took 220 s
// here, 79 of them in the kernel; with this switch, 59 s. Elsewhere, ucontext.
#if defined(__x86_64__)
struct Ctx {
  void* sp = nullptr;
};

extern "C" void keel_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .hidden keel_emu_switch
  .type keel_emu_switch, @function
keel_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size keel_emu_switch, .-keel_emu_switch
)");

void switch_to(Ctx& save, Ctx& load) { keel_emu_switch(&save.sp, load.sp); }

void start();

// `c` starts `start` on the `size` bytes at `stack` at its next switch_to:
// the frame keel_emu_switch pops, MXCSR and the x87 control word as they are
// now, `start` as the return address, entered as if called (its stack
// pointer 8 past a 16-byte boundary).
void prepare(Ctx& c, char* stack, size_t size, Ctx&) {
  auto* sp = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t{15});
  *--sp = 0;  // where `start`'s return address would be; it never returns
  *--sp = reinterpret_cast<uint64_t>(&start);
  for (int r = 0; r < 6; ++r) *--sp = 0;  // rbp, rbx, r12-r15
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  *--sp = mxcsr | uint64_t{fpucw} << 32;
  c.sp = sp;
}
#else
struct Ctx {
  ucontext_t uc;
};

void switch_to(Ctx& save, Ctx& load) { swapcontext(&save.uc, &load.uc); }

// `c` starts `entry` on the `size` bytes at `stack` at its next switch_to,
// and returns to `link` when `entry` does.
void prepare(Ctx& c, char* stack, size_t size, Ctx& link) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = &link.uc;
  makecontext(&c.uc, entry, 0);
}
#endif

struct Fiber {
  Ctx ctx;
  std::unique_ptr<char[]> stack;
  At at = At::Running;
  unsigned mask = 0;
  int lane_mask = 0, width = 32;
  uint64_t in = 0, out = 0;
};

constexpr size_t kStack = 256 * 1024;

struct Grid {
  std::vector<Fiber> fibers;
  Ctx scheduler;
  unsigned current = 0;
  const char* name = nullptr;
  Invoker f = nullptr;
  void** params = nullptr;
  std::string error;
};

Grid* g = nullptr;

void entry() {
  g->f(g->params);
  g->fibers[g->current].at = At::Exited;  // ucontext: then returns to uc_link, the scheduler
}

#if defined(__x86_64__)
// A fiber's first frame: runs the thread, then hands back to the scheduler,
// which never resumes an exited fiber.
void start() {
  entry();
  switch_to(g->fibers[g->current].ctx, g->scheduler);
  __builtin_trap();
}
#endif

void yield() { switch_to(g->fibers[g->current].ctx, g->scheduler); }

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
        switch_to(g->scheduler, fs[i].ctx);
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
    prepare(f.ctx, f.stack.get(), kStack, g->scheduler);
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
