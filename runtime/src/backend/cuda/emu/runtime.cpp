// runtime.cpp: the emulator's scheduler and its one exported entry point, fz_emu_launch.
//
// A launch runs its blocks one after another on the calling OS thread. A block's threads are
// fibers with their own stacks; a fiber runs until it waits at a collective or returns, and the
// scheduler resumes the fibers a completed collective released, round after round, until all
// have returned (or none can run: a deadlock, reported as an error). Everything here is
// per-OS-thread, so launches on different threads (cargo's parallel tests) are independent.
//
// Context switches: a dozen instructions of x86-64 assembly (callee-saved registers, MXCSR and
// the x87 control word); other architectures use ucontext. Each fiber stack has a guard page,
// and a SIGSEGV/SIGBUS inside a kernel becomes an error naming the block and thread (the
// handler chains to the previous one, e.g. Rust's stack-overflow handler, for any other fault).
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// Last: its qualifier macros (__noinline__, ...) would clash with the standard headers.
#include "emu.h"

namespace fz_emu {

__thread Builtins tl_builtins;

namespace {

// ---- the kernel registry --------------------------------------------------------------------
struct Kernel {
  const char* name;
  const char* file;
  Thunk thunk;
  void* fn;
  int arity;
};

std::vector<Kernel>& registry() {
  static std::vector<Kernel> r;
  return r;
}

const Kernel* find_kernel(const char* name) {
  static std::once_flag once;
  static std::unordered_map<std::string, size_t>* index;
  std::call_once(once, [] {
    index = new std::unordered_map<std::string, size_t>();
    for (size_t i = 0; i < registry().size(); ++i) index->emplace(registry()[i].name, i);
  });
  auto it = index->find(name);
  return it == index->end() ? nullptr : &registry()[it->second];
}

// ---- limits (H100, sm_90) -------------------------------------------------------------------
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockDim[3] = {1024, 1024, 64};
constexpr unsigned kMaxGridDim[3] = {2147483647u, 65535, 65535};
// The most dynamic shared memory a block can opt in to on sm_90 (cudaFuncSetAttribute);
// sm_80 allows 163 KiB.
constexpr unsigned long long kMaxDynamicSmem = 227 * 1024;
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 4096;

// ---- fibers ---------------------------------------------------------------------------------
enum State { kReady, kAtBarrier, kAtWarp, kExited };

// A queued cp.async: `bytes` bytes to `dst`, the first `src_bytes` from `src`, zeros after.
struct AsyncCopy {
  void* dst;
  const void* src;
  unsigned bytes, src_bytes;
};

struct Fiber {
#if defined(__x86_64__)
  void* sp;
#else
  ucontext_t uc;
#endif
  unsigned char* stack;  // lowest usable byte
  unsigned index, lane, warp;
  uint3 tid;
  State state;
  // What it waits at (for matching and for error messages).
  const char* file;
  int line;
  unsigned mask;
  WarpComplete complete;
  const char* what;
  const void* in;
  void* out;
  int pred;
  int bar_result;
  // cp.async: the thread's queued copies, oldest first, and the sizes of its committed groups
  // (oldest first; the copies after them belong to the open group).
  std::deque<AsyncCopy> copies;
  std::deque<size_t> groups;
};

struct Sched {
  std::vector<Fiber> fibers;
  std::vector<std::pair<void*, size_t>> regions;  // stack mappings
#if defined(__x86_64__)
  void* sched_sp = nullptr;
  unsigned csr[2] = {0x1f80, 0x037f};  // MXCSR, x87 control word of the launching thread
#else
  ucontext_t sched_uc;
#endif
  // The launch.
  const Kernel* kernel = nullptr;
  void** params = nullptr;
  unsigned nthreads = 0;
  unsigned live = 0;
  unsigned current = 0;
  // Block barrier.
  unsigned bar_count = 0;
  const char* bar_file = nullptr;
  int bar_line = 0;
  int bar_op = 0;
  uint3 bar_first{};
  // Scheduling.
  std::vector<unsigned> cur, next;
  // Errors.
  bool aborted = false;
  std::string error;
  // Dynamic shared memory.
  std::vector<unsigned char> smem_store;
  unsigned char* smem = nullptr;
  unsigned long long smem_bytes = 0;
  // Faults.
  sigjmp_buf jb;
  volatile sig_atomic_t in_kernel = 0;
  int fault_sig = 0;
  void* fault_addr = nullptr;
  void* altstack = nullptr;

  ~Sched() {
    for (auto& r : regions) munmap(r.first, r.second);
    if (altstack) {
      stack_t ss{};
      ss.ss_flags = SS_DISABLE;
      sigaltstack(&ss, nullptr);
      free(altstack);
    }
  }
};

__thread Sched* tl_sched = nullptr;
thread_local std::unique_ptr<Sched> tl_sched_owner;

Sched& sched() {
  if (!tl_sched) {
    tl_sched_owner.reset(new Sched());
    tl_sched = tl_sched_owner.get();
  }
  return *tl_sched;
}

std::string format(const char* fmt, va_list ap) {
  char buf[1024];
  vsnprintf(buf, sizeof buf, fmt, ap);
  return buf;
}

std::string where(const Sched& S, unsigned index) {
  const Fiber& f = S.fibers[index];
  char buf[160];
  snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", tl_builtins.block_idx.x,
           tl_builtins.block_idx.y, tl_builtins.block_idx.z, f.tid.x, f.tid.y, f.tid.z);
  return buf;
}

// ---- context switching ----------------------------------------------------------------------
void fiber_main(Fiber* f);

#if defined(__x86_64__)
extern "C" void fz_emu_ctx_switch(void** save_sp, void* load_sp);
extern "C" void fz_emu_ctx_start();
asm(R"(
  .text
  .globl fz_emu_ctx_switch
  .hidden fz_emu_ctx_switch
  .type fz_emu_ctx_switch, @function
fz_emu_ctx_switch:
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
  .size fz_emu_ctx_switch, .-fz_emu_ctx_switch

  .globl fz_emu_ctx_start
  .hidden fz_emu_ctx_start
  .type fz_emu_ctx_start, @function
fz_emu_ctx_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size fz_emu_ctx_start, .-fz_emu_ctx_start
)");

void init_context(Sched& S, Fiber& f) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + kStackBytes) & ~uintptr_t{15};
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 80);
  // The frame fz_emu_ctx_switch pops: control words, r15, r14, r13, r12, rbx, rbp, return
  // address. fz_emu_ctx_start then calls r13(r12) with a 16-byte aligned stack.
  memcpy(&sp[0], S.csr, 8);
  sp[1] = 0;
  sp[2] = 0;
  sp[3] = reinterpret_cast<uint64_t>(&fiber_main);
  sp[4] = reinterpret_cast<uint64_t>(&f);
  sp[5] = 0;
  sp[6] = 0;
  sp[7] = reinterpret_cast<uint64_t>(&fz_emu_ctx_start);
  f.sp = sp;
}
inline void switch_to_fiber(Sched& S, Fiber& f) { fz_emu_ctx_switch(&S.sched_sp, f.sp); }
inline void switch_to_sched(Sched& S, Fiber& f) { fz_emu_ctx_switch(&f.sp, S.sched_sp); }
void save_control_words(Sched& S) {
  asm volatile("stmxcsr %0" : "=m"(S.csr[0]));
  unsigned short cw;
  asm volatile("fnstcw %0" : "=m"(cw));
  S.csr[1] = cw;
}
#else
void fiber_entry_uc(unsigned hi, unsigned lo) {
  uintptr_t p = (static_cast<uintptr_t>(hi) << 32) | lo;
  fiber_main(reinterpret_cast<Fiber*>(p));
}
void init_context(Sched& S, Fiber& f) {
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack;
  f.uc.uc_stack.ss_size = kStackBytes;
  f.uc.uc_link = nullptr;
  uintptr_t p = reinterpret_cast<uintptr_t>(&f);
  makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiber_entry_uc), 2,
              static_cast<unsigned>(p >> 32), static_cast<unsigned>(p));
}
inline void switch_to_fiber(Sched& S, Fiber& f) { swapcontext(&S.sched_uc, &f.uc); }
inline void switch_to_sched(Sched& S, Fiber& f) { swapcontext(&f.uc, &S.sched_uc); }
void save_control_words(Sched&) {}
#endif

bool ensure_stacks(Sched& S, unsigned n, std::string& err) {
  size_t have = S.fibers.size();
  if (have >= n) return true;
  size_t add = n - have;
  size_t per = kStackBytes + kGuardBytes;
  void* region = mmap(nullptr, add * per, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (region == MAP_FAILED) {
    err = "cannot map fiber stacks";
    return false;
  }
  S.regions.emplace_back(region, add * per);
  S.fibers.resize(n);
  for (size_t i = 0; i < add; ++i) {
    unsigned char* base = static_cast<unsigned char*>(region) + i * per;
    mprotect(base, kGuardBytes, PROT_NONE);  // stacks grow down into the guard page
    S.fibers[have + i].stack = base + kGuardBytes;
  }
  return true;
}

// ---- faults ---------------------------------------------------------------------------------
struct sigaction g_old_segv, g_old_bus;
// Threads running a kernel right now. The handler reads its thread-local state only when this
// is nonzero: a first touch of this library's thread-local storage may allocate, which must not
// happen for an unrelated fault (e.g. inside malloc) on a thread that never launched.
std::atomic<int> g_threads_in_kernels{0};

void fault_handler(int sig, siginfo_t* info, void* uc) {
  Sched* S = g_threads_in_kernels.load(std::memory_order_relaxed) > 0 ? tl_sched : nullptr;
  if (S && S->in_kernel) {
    S->in_kernel = 0;
    S->fault_sig = sig;
    S->fault_addr = info->si_addr;
    siglongjmp(S->jb, 1);
  }
  struct sigaction* old = sig == SIGSEGV ? &g_old_segv : &g_old_bus;
  if (old->sa_flags & SA_SIGINFO) {
    if (old->sa_sigaction) old->sa_sigaction(sig, info, uc);
    return;
  }
  if (old->sa_handler == SIG_IGN) return;
  if (old->sa_handler == SIG_DFL) {
    signal(sig, SIG_DFL);  // the faulting instruction runs again and takes the default action
    return;
  }
  old->sa_handler(sig);
}

void install_fault_handler(Sched& S) {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa{};
    sa.sa_sigaction = &fault_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sigaction(SIGBUS, &sa, &g_old_bus);
  });
  // A fault on a fiber's guard page needs another stack to run the handler on.
  stack_t cur{};
  if (!S.altstack && sigaltstack(nullptr, &cur) == 0 && (cur.ss_flags & SS_DISABLE)) {
    size_t bytes = 64 * 1024;
    S.altstack = malloc(bytes);
    stack_t ss{};
    ss.ss_sp = S.altstack;
    ss.ss_size = bytes;
    sigaltstack(&ss, nullptr);
  }
}

// ---- collectives ----------------------------------------------------------------------------
inline Fiber& current(Sched& S) { return S.fibers[S.current]; }

void park(Sched& S) {
  Fiber& f = current(S);
  switch_to_sched(S, f);
}

void release_barrier(Sched& S) {
  int count = 0, all = 1, any = 0;
  for (unsigned i = 0; i < S.nthreads; ++i) {
    const Fiber& g = S.fibers[i];
    if (g.state != kAtBarrier) continue;
    count += g.pred != 0;
    all &= g.pred != 0;
    any |= g.pred != 0;
  }
  int result = S.bar_op == 1 ? count : S.bar_op == 2 ? all : S.bar_op == 3 ? any : 0;
  for (unsigned i = 0; i < S.nthreads; ++i) {
    Fiber& g = S.fibers[i];
    if (g.state != kAtBarrier) continue;
    g.state = kReady;
    g.bar_result = result;
    S.next.push_back(i);
  }
  S.bar_count = 0;
}

// Completes the collective of `mask`/`complete` in `warp` if every live lane of the mask waits
// at it.
bool try_complete_warp(Sched& S, unsigned warp, unsigned mask, WarpComplete complete) {
  unsigned participants = 0;
  const void* ins[32] = {};
  void* outs[32] = {};
  for (unsigned lane = 0; lane < 32; ++lane) {
    if (!(mask >> lane & 1)) continue;
    unsigned idx = warp * 32 + lane;
    if (idx >= S.nthreads) continue;  // lanes of a partial last warp do not exist
    const Fiber& g = S.fibers[idx];
    if (g.state == kExited) continue;
    if (g.state != kAtWarp || g.mask != mask || g.complete != complete) return false;
    participants |= 1u << lane;
    ins[lane] = g.in;
    outs[lane] = g.out;
  }
  complete(ins, outs, participants);
  for (unsigned lane = 0; lane < 32; ++lane) {
    if (!(participants >> lane & 1)) continue;
    unsigned idx = warp * 32 + lane;
    S.fibers[idx].state = kReady;
    S.next.push_back(idx);
  }
  return true;
}

void on_exit(Sched& S, Fiber& f) {
  f.state = kExited;
  --S.live;
  if (S.bar_count > 0 && S.bar_count == S.live) release_barrier(S);
  // Collectives of this warp that waited for this lane may now be complete.
  for (unsigned lane = 0; lane < 32; ++lane) {
    unsigned idx = f.warp * 32 + lane;
    if (idx >= S.nthreads) break;
    const Fiber& g = S.fibers[idx];
    if (g.state == kAtWarp && (g.mask >> f.lane & 1))
      try_complete_warp(S, f.warp, g.mask, g.complete);
  }
}

void fiber_main(Fiber* f) {
  Sched& S = *tl_sched;
  S.kernel->thunk(S.kernel->fn, S.params);
  on_exit(S, *f);
  switch_to_sched(S, *f);
  abort();  // an exited fiber is never resumed
}

std::string describe_wait(const Fiber& g) {
  char buf[256];
  if (g.state == kAtBarrier)
    snprintf(buf, sizeof buf, "__syncthreads() at %s:%d", g.file, g.line);
  else
    snprintf(buf, sizeof buf, "%s(mask 0x%08x) at %s:%d", g.what, g.mask, g.file, g.line);
  return buf;
}

std::string describe_deadlock(Sched& S) {
  // Group waiting threads by what they wait at, in thread order.
  std::vector<std::pair<std::string, std::vector<unsigned>>> groups;
  for (unsigned i = 0; i < S.nthreads; ++i) {
    const Fiber& g = S.fibers[i];
    if (g.state == kExited) continue;
    std::string w = describe_wait(g);
    bool found = false;
    for (auto& gr : groups)
      if (gr.first == w) {
        gr.second.push_back(i);
        found = true;
        break;
      }
    if (!found) groups.push_back({w, {i}});
  }
  std::string msg = "deadlock: no thread can go on;";
  for (auto& gr : groups) {
    const Fiber& first = S.fibers[gr.second.front()];
    char buf[160];
    snprintf(buf, sizeof buf, " %zu thread(s) from (%u,%u,%u) wait at ", gr.second.size(),
             first.tid.x, first.tid.y, first.tid.z);
    msg += buf + gr.first + ";";
  }
  msg += " exited threads do not take part in warp collectives";
  return msg;
}

// Runs one block; false when the launch failed (S.error says why).
bool run_block(Sched& S) {
  const unsigned bx = tl_builtins.block_dim.x, by = tl_builtins.block_dim.y;
  for (unsigned i = 0; i < S.nthreads; ++i) {
    Fiber& f = S.fibers[i];
    f.index = i;
    f.lane = i % 32;
    f.warp = i / 32;
    f.tid = {i % bx, (i / bx) % by, i / (bx * by)};
    f.state = kReady;
    f.copies.clear();
    f.groups.clear();
    init_context(S, f);
  }
  S.live = S.nthreads;
  S.bar_count = 0;
  if (S.smem_bytes) memset(S.smem, 0xff, S.smem_bytes);
  S.cur.clear();
  for (unsigned i = 0; i < S.nthreads; ++i) S.cur.push_back(i);
  for (unsigned round = 0; !S.cur.empty(); ++round) {
    S.next.clear();
    const size_t n = S.cur.size();
    for (size_t k = 0; k < n; ++k) {
      unsigned i = (round & 1) ? S.cur[n - 1 - k] : S.cur[k];
      Fiber& f = S.fibers[i];
      S.current = i;
      tl_builtins.thread_idx = f.tid;
      S.in_kernel = 1;
      switch_to_fiber(S, f);
      S.in_kernel = 0;
      if (S.aborted) return false;
    }
    S.cur.swap(S.next);
  }
  if (S.live > 0) {
    S.error = "block (" + std::to_string(tl_builtins.block_idx.x) + "," +
              std::to_string(tl_builtins.block_idx.y) + "," +
              std::to_string(tl_builtins.block_idx.z) + "): " + describe_deadlock(S);
    return false;
  }
  return true;
}

void set_error(char* err, unsigned long long err_len, const std::string& msg) {
  if (!err || err_len == 0) return;
  size_t n = msg.size() < err_len - 1 ? msg.size() : static_cast<size_t>(err_len - 1);
  memcpy(err, msg.data(), n);
  err[n] = 0;
}

}  // namespace

// ---- the interface of emu.h -----------------------------------------------------------------
void register_kernel(const char* name, const char* file, Thunk thunk, void* fn, int arity) {
  registry().push_back({name, file, thunk, fn, arity});
}

void fail(const char* fmt, ...) {
  Sched& S = sched();
  va_list ap;
  va_start(ap, fmt);
  std::string msg = format(fmt, ap);
  va_end(ap);
  S.error = where(S, S.current) + ": " + msg;
  S.aborted = true;
  park(S);
  abort();  // an aborted launch never resumes its fibers
}

int block_barrier(int op, int pred, const char* file, int line) {
  Sched& S = sched();
  Fiber& f = current(S);
  if (S.bar_count == 0) {
    S.bar_file = file;
    S.bar_line = line;
    S.bar_op = op;
    S.bar_first = f.tid;
  } else if (line != S.bar_line || strcmp(file, S.bar_file) != 0 || op != S.bar_op) {
    fail("threads reached different __syncthreads() calls: thread (%u,%u,%u) waits at %s:%d, "
         "this one is at %s:%d (a barrier inside divergent code)",
         S.bar_first.x, S.bar_first.y, S.bar_first.z, S.bar_file, S.bar_line, file, line);
  }
  f.state = kAtBarrier;
  f.file = file;
  f.line = line;
  f.pred = pred;
  if (++S.bar_count == S.live) release_barrier(S);
  park(S);
  return f.bar_result;
}

void warp_collective(unsigned mask, WarpComplete complete, const char* what, const void* in,
                     void* out, const char* file, int line) {
  Sched& S = sched();
  Fiber& f = current(S);
  if (!(mask >> f.lane & 1))
    fail("%s:%d: %s with mask 0x%08x, which does not include the calling lane %u", file, line,
         what, mask, f.lane);
  // Lanes of one mask must meet at the same intrinsic (a shuffle and a ballot do not pair up).
  for (unsigned lane = 0; lane < 32; ++lane) {
    unsigned idx = f.warp * 32 + lane;
    if (idx >= S.nthreads) break;
    const Fiber& g = S.fibers[idx];
    if (g.state == kAtWarp && g.mask == mask && g.complete != complete)
      fail("%s:%d: %s(mask 0x%08x) while lane %u of the same mask waits at %s at %s:%d", file,
           line, what, mask, lane, g.what, g.file, g.line);
  }
  f.state = kAtWarp;
  f.mask = mask;
  f.complete = complete;
  f.what = what;
  f.in = in;
  f.out = out;
  f.file = file;
  f.line = line;
  try_complete_warp(S, f.warp, mask, complete);
  park(S);
}

void cp_async(void* dst, const void* src, unsigned bytes, unsigned src_bytes, const char* file,
              int line) {
  Sched& S = sched();
  if ((bytes != 4 && bytes != 8 && bytes != 16) || src_bytes > bytes)
    fail("%s:%d: cp.async of %u bytes with %u source bytes (sizes 4, 8, 16; source at most that)",
         file, line, bytes, src_bytes);
  if (reinterpret_cast<uintptr_t>(dst) % bytes != 0 ||
      (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % bytes != 0))
    fail("%s:%d: cp.async of %u bytes from %p to %p: both addresses must be aligned to the size",
         file, line, bytes, src, dst);
  current(S).copies.push_back({dst, src, bytes, src_bytes});
}

void cp_async_commit() {
  Fiber& f = current(sched());
  size_t committed = 0;
  for (size_t g : f.groups) committed += g;
  f.groups.push_back(f.copies.size() - committed);
}

void cp_async_wait(int n) {
  Fiber& f = current(sched());
  while (f.groups.size() > static_cast<size_t>(n < 0 ? 0 : n)) {
    for (size_t k = f.groups.front(); k > 0; --k) {
      const AsyncCopy c = f.copies.front();
      f.copies.pop_front();
      unsigned char* d = static_cast<unsigned char*>(c.dst);
      if (c.src_bytes > 0) memcpy(d, c.src, c.src_bytes);
      memset(d + c.src_bytes, 0, c.bytes - c.src_bytes);
    }
    f.groups.pop_front();
  }
}

unsigned char* dynamic_smem() {
  Sched& S = sched();
  return S.smem;
}

unsigned long long dynamic_smem_bytes() { return sched().smem_bytes; }

}  // namespace fz_emu

// ---- the C entry point ----------------------------------------------------------------------
// params: an array of pointers to the argument values, exactly like cuLaunchKernel's
// kernelParams. Returns 0, or nonzero with a message in err: 1 invalid launch configuration,
// 2 unknown kernel, 3 the kernel failed (deadlock, misuse of a collective, __trap, fault).
extern "C" __attribute__((visibility("default"))) int fz_emu_launch(
    const char* kernel, const unsigned grid[3], const unsigned block[3],
    unsigned long long dyn_smem_bytes, void** params, char* err, unsigned long long err_len) {
  using namespace fz_emu;
  char buf[512];
  if (!kernel || !grid || !block) {
    set_error(err, err_len, "fz_emu_launch: null kernel name, grid or block");
    return 1;
  }
  const Kernel* k = find_kernel(kernel);
  if (!k) {
    snprintf(buf, sizeof buf, "unknown kernel `%s` (%zu kernels in this emulator library)", kernel,
             registry().size());
    set_error(err, err_len, buf);
    return 2;
  }
  unsigned long long threads = 1;
  for (int d = 0; d < 3; ++d) {
    if (grid[d] == 0 || grid[d] > kMaxGridDim[d] || block[d] == 0 || block[d] > kMaxBlockDim[d]) {
      snprintf(buf, sizeof buf,
               "kernel `%s`: invalid launch configuration grid (%u,%u,%u) block (%u,%u,%u) "
               "(limits: grid (%u,%u,%u), block (%u,%u,%u), none zero)",
               kernel, grid[0], grid[1], grid[2], block[0], block[1], block[2], kMaxGridDim[0],
               kMaxGridDim[1], kMaxGridDim[2], kMaxBlockDim[0], kMaxBlockDim[1], kMaxBlockDim[2]);
      set_error(err, err_len, buf);
      return 1;
    }
    threads *= block[d];
  }
  if (threads > kMaxThreadsPerBlock) {
    snprintf(buf, sizeof buf, "kernel `%s`: block of %llu threads (at most %u)", kernel, threads,
             kMaxThreadsPerBlock);
    set_error(err, err_len, buf);
    return 1;
  }
  if (dyn_smem_bytes > kMaxDynamicSmem) {
    snprintf(buf, sizeof buf,
             "kernel `%s`: %llu bytes of dynamic shared memory (at most %llu on sm_90, after "
             "opting in above 48 KiB)",
             kernel, dyn_smem_bytes, kMaxDynamicSmem);
    set_error(err, err_len, buf);
    return 1;
  }
  if (k->arity > 0 && !params) {
    snprintf(buf, sizeof buf, "kernel `%s` takes %d parameters but params is null", kernel,
             k->arity);
    set_error(err, err_len, buf);
    return 1;
  }

  Sched& S = sched();
  std::string serr;
  if (!ensure_stacks(S, static_cast<unsigned>(threads), serr)) {
    set_error(err, err_len, serr);
    return 3;
  }
  install_fault_handler(S);
  save_control_words(S);
  S.kernel = k;
  S.params = params;
  S.nthreads = static_cast<unsigned>(threads);
  S.aborted = false;
  S.error.clear();
  if (S.smem_store.size() < dyn_smem_bytes + 128) S.smem_store.resize(dyn_smem_bytes + 128);
  uintptr_t base = reinterpret_cast<uintptr_t>(S.smem_store.data());
  S.smem = reinterpret_cast<unsigned char*>((base + 127) & ~uintptr_t{127});
  S.smem_bytes = dyn_smem_bytes;
  tl_builtins.block_dim = {block[0], block[1], block[2]};
  tl_builtins.grid_dim = {grid[0], grid[1], grid[2]};

  // Counted for the fault handler; a scope guard, so every return path uncounts.
  struct InKernels {
    InKernels() { g_threads_in_kernels.fetch_add(1); }
    ~InKernels() { g_threads_in_kernels.fetch_sub(1); }
  } in_kernels;
  if (sigsetjmp(S.jb, 1)) {
    // A memory fault inside the kernel: its fibers are abandoned, the next launch starts afresh.
    S.in_kernel = 0;
    snprintf(buf, sizeof buf, "%s at address %p (out-of-bounds access, or a fiber stack overflow)",
             S.fault_sig == SIGBUS ? "SIGBUS" : "SIGSEGV", S.fault_addr);
    std::string msg = std::string("kernel `") + kernel + "` " + where(S, S.current) + ": " + buf;
    set_error(err, err_len, msg);
    return 3;
  }
  for (unsigned z = 0; z < grid[2]; ++z)
    for (unsigned y = 0; y < grid[1]; ++y)
      for (unsigned x = 0; x < grid[0]; ++x) {
        tl_builtins.block_idx = {x, y, z};
        if (!run_block(S)) {
          set_error(err, err_len, std::string("kernel `") + kernel + "` " + S.error);
          return 3;
        }
      }
  return 0;
}
