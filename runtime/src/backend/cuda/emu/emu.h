// emu.h: the CUDA C++ device API, emulated on the CPU, so that ferrozero's kernel sources
// (runtime/src/backend/cuda/kernels/*.cu) compile unchanged with g++ and run with CUDA's
// semantics inside `cargo test`.
//
// How a launch runs (runtime.cpp has the scheduler):
// - Every CUDA thread of a block is a fiber (its own stack, a small context switch) on the
//   calling OS thread; blocks run one after another, so everything a block shares lives in
//   per-OS-thread storage: `__shared__` is `static thread_local`.
// - A fiber runs until it reaches a collective (`__syncthreads`, `__syncwarp`, a `_sync` warp
//   intrinsic) or returns. When every live thread a collective waits for has arrived, the
//   collective completes (a warp shuffle computes all its lanes' results at once) and those
//   threads run again, in ascending thread order after even-numbered rounds and descending
//   after odd ones, so a missing barrier shows up as a wrong result in either direction.
// - Misuse that CUDA leaves undefined or that would hang is an error of the launch, with the
//   file and line of each party: a deadlock (threads waiting at collectives that can never
//   complete), threads at different `__syncthreads()` calls, lanes of one mask at different
//   warp intrinsics, a mask without the calling lane, a bad shuffle width, `__trap()`, and a
//   memory fault (SIGSEGV/SIGBUS inside a kernel, e.g. a fiber's stack overflow).
// - Threads that have returned count as arrived at block barriers and are left out of warp
//   collectives (as on sm_70+ hardware). Reading a shuffle value from a lane that does not take
//   part returns poison (all bits set: NaN for floats, -1 for integers).
//
// Extending: warp-collective operations (e.g. `mma.sync` for the attention kernels) are built
// on `fz_emu::warp_collective`: every lane passes pointers to its own input and output (they
// stay valid while it waits), and one call of the completion function computes the outputs of
// all participating lanes. See `shfl_complete` below for the pattern.
//
// Limits: no `extern __shared__` (use the prelude's FZ_DYNAMIC_SMEM), no float atomics (our
// kernels are deterministic), no `__constant__` memory set from the host, no cooperative
// groups, no clock(); an infinite loop without a collective hangs the launch.
#pragma once

#define FZ_EMU 1

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <limits>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------------------------------------
// Qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __shared__ static thread_local
#define __constant__ static const
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// `__restrict__` is understood by g++ itself.

// ---------------------------------------------------------------------------------------------
// Vector types (aggregates with CUDA's sizes and alignments) and their make_ functions.
struct __align__(8) float2 { float x, y; };
struct float3 { float x, y, z; };
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(16) double2 { double x, y; };
struct __align__(8) int2 { int x, y; };
struct int3 { int x, y, z; };
struct __align__(16) int4 { int x, y, z, w; };
struct __align__(8) uint2 { unsigned x, y; };
struct uint3 { unsigned x, y, z; };
struct __align__(16) uint4 { unsigned x, y, z, w; };
struct __align__(4) ushort2 { unsigned short x, y; };
struct __align__(8) ushort4 { unsigned short x, y, z, w; };
struct __align__(4) uchar4 { unsigned char x, y, z, w; };
struct __align__(16) longlong2 { long long x, y; };
struct __align__(16) ulonglong2 { unsigned long long x, y; };
struct dim3 { unsigned x, y, z; };

static __forceinline__ float2 make_float2(float x, float y) { return {x, y}; }
static __forceinline__ float3 make_float3(float x, float y, float z) { return {x, y, z}; }
static __forceinline__ float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static __forceinline__ double2 make_double2(double x, double y) { return {x, y}; }
static __forceinline__ int2 make_int2(int x, int y) { return {x, y}; }
static __forceinline__ int3 make_int3(int x, int y, int z) { return {x, y, z}; }
static __forceinline__ int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
static __forceinline__ uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
static __forceinline__ uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return {x, y, z}; }
static __forceinline__ uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  return {x, y, z, w};
}
static __forceinline__ ushort2 make_ushort2(unsigned short x, unsigned short y) { return {x, y}; }
static __forceinline__ ushort4 make_ushort4(unsigned short x, unsigned short y, unsigned short z,
                                            unsigned short w) {
  return {x, y, z, w};
}
static __forceinline__ longlong2 make_longlong2(long long x, long long y) { return {x, y}; }

static constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// The scheduler's interface (defined in runtime.cpp).
namespace fz_emu {

// The current thread's built-in variables; the scheduler rewrites them at every switch.
struct Builtins {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
extern __thread Builtins tl_builtins;

// Aborts the launch with a message (printf-style); never returns to the kernel.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Block barrier: waits until every live thread of the block arrives at the same call site;
// `op` 0 plain, 1 count, 2 and, 3 or of `pred` (for __syncthreads_count/and/or).
int block_barrier(int op, int pred, const char* file, int line);

// Completes one warp collective. `in[l]`/`out[l]` are lane l's pointers, null for lanes that do
// not take part (`participants` has a bit per taking part lane).
typedef void (*WarpComplete)(const void* const* in, void* const* out, unsigned participants);

// Waits until every live lane named in `mask` has arrived at a collective with the same mask and
// the same `complete`, then calls `complete` once for all of them. `what` names the intrinsic in
// error messages.
void warp_collective(unsigned mask, WarpComplete complete, const char* what, const void* in,
                     void* out, const char* file, int line);

// The launch's dynamic shared memory (poisoned with 0xFF bytes before every block).
unsigned char* dynamic_smem();
unsigned long long dynamic_smem_bytes();

// ---- shuffles -------------------------------------------------------------------------------
// One lane's shuffle operands: the value's bits, its lane/delta/mask argument and its width.
struct ShflIn {
  unsigned long long bits;
  unsigned arg;
  int width;
};

// PTX's shfl.sync source-lane rule (ISA, "shfl.sync"): CUDA passes c = ((32 - width) << 8),
// or'ed with 0x1f except for shfl_up. A source outside the segment gives the lane its own value.
enum ShflMode { kIdx, kUp, kDown, kXor };
template <int Mode>
inline void shfl_complete(const void* const* in, void* const* out, unsigned participants) {
  for (int lane = 0; lane < 32; ++lane) {
    if (!(participants >> lane & 1)) continue;
    const ShflIn& me = *static_cast<const ShflIn*>(in[lane]);
    const int segmask = ~(me.width - 1) & 31;  // c[12:8]
    const int clamp = Mode == kUp ? 0 : 31;    // c[4:0]
    const int b = static_cast<int>(me.arg & 31);
    const int min_lane = lane & segmask;
    const int max_lane = min_lane | (clamp & ~segmask);
    int j;
    bool pval;
    switch (Mode) {
      case kUp: j = lane - b; pval = j >= max_lane; break;
      case kDown: j = lane + b; pval = j <= max_lane; break;
      case kXor: j = lane ^ b; pval = j <= max_lane; break;
      default: j = min_lane | (b & ~segmask); pval = j <= max_lane; break;
    }
    if (!pval) j = lane;
    unsigned long long v = ~0ull;  // poison: the source lane does not take part
    if (participants >> j & 1) v = static_cast<const ShflIn*>(in[j])->bits;
    *static_cast<unsigned long long*>(out[lane]) = v;
  }
}

template <class T>
inline unsigned long long to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                "shuffles move values of at most 8 bytes");
  unsigned long long b = 0;
  memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
inline T from_bits(unsigned long long b) {
  T v;
  memcpy(&v, &b, sizeof(T));
  return v;
}

template <int Mode, class T>
inline T shfl(unsigned mask, T var, unsigned arg, int width, const char* what, const char* file,
              int line) {
  if (width < 1 || width > 32 || (width & (width - 1)) != 0)
    fail("%s:%d: %s with width %d (must be a power of two in [1, 32])", file, line, what, width);
  ShflIn in{to_bits(var), arg, width};
  unsigned long long out = 0;
  warp_collective(mask, &shfl_complete<Mode>, what, &in, &out, file, line);
  return from_bits<T>(out);
}

// ---- votes ----------------------------------------------------------------------------------
enum VoteMode { kBallot, kAny, kAll };
template <int Mode>
inline void vote_complete(const void* const* in, void* const* out, unsigned participants) {
  unsigned ballot = 0;
  for (int lane = 0; lane < 32; ++lane)
    if ((participants >> lane & 1) && *static_cast<const int*>(in[lane]) != 0) ballot |= 1u << lane;
  unsigned r = Mode == kBallot ? ballot
               : Mode == kAny  ? (ballot != 0)
                               : (ballot == participants);
  for (int lane = 0; lane < 32; ++lane)
    if (participants >> lane & 1) *static_cast<unsigned*>(out[lane]) = r;
}

inline void nothing_complete(const void* const*, void* const*, unsigned) {}

// ---- tensor cores -----------------------------------------------------------------------------
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 as a warp collective: every lane hands in
// its fragments, the last to arrive computes D = A * B + C for the warp. Fragment layouts are
// PTX's ("Matrix Fragments for mma.m16n8k16 with floating point type"; the same as CuTe's
// SM80_16x8x16 traits): g = lane >> 2, t = lane & 3, two bf16 per register with the lower
// index in the low half:
//   a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   c[0..1] = C[g][2t, 2t+1]   c[2..3] = C[g+8][2t, 2t+1]   (d likewise)
// Products of bf16 values are exact in f32; the sum over k runs in order from C (the hardware's
// accumulation order is unspecified, so compare with a tolerance unless values are small
// integers).
struct MmaIn {
  unsigned a[4];
  unsigned b[2];
  float c[4];
};

inline float bf16_lo(unsigned r) { return __builtin_bit_cast(float, (r & 0xffffu) << 16); }
inline float bf16_hi(unsigned r) { return __builtin_bit_cast(float, r & 0xffff0000u); }

// IEEE binary16 bits to f32 (exact; NaN stays NaN).
inline float f16_to_f32(unsigned h) {
  const unsigned sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu;
  unsigned man = h & 0x3ffu;
  if (exp == 0x1fu) return __builtin_bit_cast(float, sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return __builtin_bit_cast(float, sign);
    int e = 113;  // subnormal: normalise the mantissa
    while (!(man & 0x400u)) {
      man <<= 1;
      --e;
    }
    return __builtin_bit_cast(float,
                              sign | (static_cast<unsigned>(e) << 23) | ((man & 0x3ffu) << 13));
  }
  return __builtin_bit_cast(float, sign | ((exp + 112u) << 23) | (man << 13));
}
inline float f16_lo(unsigned r) { return f16_to_f32(r & 0xffffu); }
inline float f16_hi(unsigned r) { return f16_to_f32(r >> 16); }

template <float (*Lo)(unsigned), float (*Hi)(unsigned)>
inline void mma_m16n8k16_complete(const void* const* in, void* const* out, unsigned participants) {
  if (participants != 0xffffffffu)
    fail("mma.sync needs all 32 lanes of the warp (participants 0x%08x)", participants);
  float A[16][16], B[16][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const MmaIn& m = *static_cast<const MmaIn*>(in[lane]);
    const int g = lane >> 2, t = lane & 3;
    A[g][2 * t] = Lo(m.a[0]);
    A[g][2 * t + 1] = Hi(m.a[0]);
    A[g + 8][2 * t] = Lo(m.a[1]);
    A[g + 8][2 * t + 1] = Hi(m.a[1]);
    A[g][2 * t + 8] = Lo(m.a[2]);
    A[g][2 * t + 9] = Hi(m.a[2]);
    A[g + 8][2 * t + 8] = Lo(m.a[3]);
    A[g + 8][2 * t + 9] = Hi(m.a[3]);
    B[2 * t][g] = Lo(m.b[0]);
    B[2 * t + 1][g] = Hi(m.b[0]);
    B[2 * t + 8][g] = Lo(m.b[1]);
    B[2 * t + 9][g] = Hi(m.b[1]);
    C[g][2 * t] = m.c[0];
    C[g][2 * t + 1] = m.c[1];
    C[g + 8][2 * t] = m.c[2];
    C[g + 8][2 * t + 1] = m.c[3];
  }
  for (int lane = 0; lane < 32; ++lane) {
    float* d = static_cast<float*>(out[lane]);
    const int g = lane >> 2, t = lane & 3;
    for (int v = 0; v < 4; ++v) {
      const int row = g + (v >= 2 ? 8 : 0), col = 2 * t + (v & 1);
      float acc = C[row][col];
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
      d[v] = acc;
    }
  }
}

inline void mma_m16n8k16_bf16_complete(const void* const* in, void* const* out,
                                       unsigned participants) {
  mma_m16n8k16_complete<bf16_lo, bf16_hi>(in, out, participants);
}

// The same with IEEE binary16 inputs (mma.sync...f32.f16.f16.f32): products of two halves are
// exact in f32 too.
inline void mma_m16n8k16_f16_complete(const void* const* in, void* const* out,
                                      unsigned participants) {
  mma_m16n8k16_complete<f16_lo, f16_hi>(in, out, participants);
}

inline void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                              const float (&c)[4], const char* file, int line) {
  MmaIn in{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}, {c[0], c[1], c[2], c[3]}};
  float out[4];
  warp_collective(0xffffffffu, &mma_m16n8k16_bf16_complete, "mma.sync.m16n8k16", &in, out, file,
                  line);
  for (int v = 0; v < 4; ++v) d[v] = out[v];
}

inline void mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                             const float (&c)[4], const char* file, int line) {
  MmaIn in{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}, {c[0], c[1], c[2], c[3]}};
  float out[4];
  warp_collective(0xffffffffu, &mma_m16n8k16_f16_complete, "mma.sync.m16n8k16.f16", &in, out,
                  file, line);
  for (int v = 0; v < 4; ++v) d[v] = out[v];
}

// ---- ldmatrix ---------------------------------------------------------------------------------
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 as a warp collective: lanes 8i .. 8i+7 hand in
// the addresses of rows 0..7 of matrix i (16 bytes each, 16-byte aligned); lane l (g = l >> 2,
// t = l & 3) receives r[i] = M_i[g][2t, 2t+1], or with .trans M_i[2t][g], M_i[2t+1][g], the first
// element in the low half.
struct LdmIn {
  const unsigned char* row;
};

template <bool Trans>
inline void ldmatrix_x4_complete(const void* const* in, void* const* out, unsigned participants) {
  if (participants != 0xffffffffu)
    fail("ldmatrix needs all 32 lanes of the warp (participants 0x%08x)", participants);
  const unsigned char* rows[32];
  for (int lane = 0; lane < 32; ++lane) {
    rows[lane] = static_cast<const LdmIn*>(in[lane])->row;
    if (reinterpret_cast<uintptr_t>(rows[lane]) & 15)
      fail("ldmatrix: lane %d's row address %p is not 16-byte aligned", lane,
           static_cast<const void*>(rows[lane]));
  }
  for (int lane = 0; lane < 32; ++lane) {
    unsigned* r = static_cast<unsigned*>(out[lane]);
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
      const unsigned char* const* m = rows + 8 * i;
      if (!Trans) {
        memcpy(&r[i], m[g] + 4 * t, 4);
      } else {
        unsigned short lo, hi;
        memcpy(&lo, m[2 * t] + 2 * g, 2);
        memcpy(&hi, m[2 * t + 1] + 2 * g, 2);
        r[i] = static_cast<unsigned>(lo) | static_cast<unsigned>(hi) << 16;
      }
    }
  }
}

inline void ldmatrix_x4(unsigned (&r)[4], const void* row, bool trans, const char* file,
                        int line) {
  LdmIn in{static_cast<const unsigned char*>(row)};
  unsigned out[4];
  if (trans)
    warp_collective(0xffffffffu, &ldmatrix_x4_complete<true>, "ldmatrix.x4.trans", &in, out, file,
                    line);
  else
    warp_collective(0xffffffffu, &ldmatrix_x4_complete<false>, "ldmatrix.x4", &in, out, file,
                    line);
  for (int i = 0; i < 4; ++i) r[i] = out[i];
}

// ---- cp.async -----------------------------------------------------------------------------------
// Asynchronous global -> shared copies (runtime.cpp keeps them per thread): `cp_async` queues a
// copy of `bytes` bytes of which the first `src_bytes` come from `src` and the rest are zeros;
// `cp_async_commit` closes the thread's open group; `cp_async_wait(n)` performs the copies of all
// but the `n` most recently committed groups. So data read before its wait is stale (or the
// poison of fresh shared memory), as it may be on the GPU.
void cp_async(void* dst, const void* src, unsigned bytes, unsigned src_bytes, const char* file,
              int line);
void cp_async_commit();
void cp_async_wait(int n);

}  // namespace fz_emu

#define threadIdx (static_cast<const uint3&>(::fz_emu::tl_builtins.thread_idx))
#define blockIdx (static_cast<const uint3&>(::fz_emu::tl_builtins.block_idx))
#define blockDim (static_cast<const dim3&>(::fz_emu::tl_builtins.block_dim))
#define gridDim (static_cast<const dim3&>(::fz_emu::tl_builtins.grid_dim))

// ---------------------------------------------------------------------------------------------
// Synchronisation. The file/line defaults record the call site for error messages.
static inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::fz_emu::block_barrier(0, 0, file, line);
}
static inline int __syncthreads_count(int pred, const char* file = __builtin_FILE(),
                                      int line = __builtin_LINE()) {
  return ::fz_emu::block_barrier(1, pred, file, line);
}
static inline int __syncthreads_and(int pred, const char* file = __builtin_FILE(),
                                    int line = __builtin_LINE()) {
  return ::fz_emu::block_barrier(2, pred, file, line);
}
static inline int __syncthreads_or(int pred, const char* file = __builtin_FILE(),
                                   int line = __builtin_LINE()) {
  return ::fz_emu::block_barrier(3, pred, file, line);
}
static inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  ::fz_emu::warp_collective(mask, &::fz_emu::nothing_complete, "__syncwarp", nullptr, nullptr, file,
                            line);
}
// Fibers of one OS thread never run concurrently: ordering is already total.
static inline void __threadfence() {}
static inline void __threadfence_block() {}
static inline void __threadfence_system() {}
[[noreturn]] static inline void __trap(const char* file = __builtin_FILE(),
                                       int line = __builtin_LINE()) {
  ::fz_emu::fail("%s:%d: __trap()", file, line);
}

template <class T>
static inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32,
                            const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::fz_emu::shfl<::fz_emu::kIdx>(mask, var, static_cast<unsigned>(src_lane), width,
                                        "__shfl_sync", file, line);
}
template <class T>
static inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32,
                               const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::fz_emu::shfl<::fz_emu::kUp>(mask, var, delta, width, "__shfl_up_sync", file, line);
}
template <class T>
static inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32,
                                 const char* file = __builtin_FILE(),
                                 int line = __builtin_LINE()) {
  return ::fz_emu::shfl<::fz_emu::kDown>(mask, var, delta, width, "__shfl_down_sync", file, line);
}
template <class T>
static inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                                const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::fz_emu::shfl<::fz_emu::kXor>(mask, var, static_cast<unsigned>(lane_mask), width,
                                        "__shfl_xor_sync", file, line);
}
static inline unsigned __ballot_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                                     int line = __builtin_LINE()) {
  unsigned out = 0;
  ::fz_emu::warp_collective(mask, &::fz_emu::vote_complete<::fz_emu::kBallot>, "__ballot_sync",
                            &pred, &out, file, line);
  return out;
}
static inline int __any_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                             int line = __builtin_LINE()) {
  unsigned out = 0;
  ::fz_emu::warp_collective(mask, &::fz_emu::vote_complete<::fz_emu::kAny>, "__any_sync", &pred,
                            &out, file, line);
  return static_cast<int>(out);
}
static inline int __all_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                             int line = __builtin_LINE()) {
  unsigned out = 0;
  ::fz_emu::warp_collective(mask, &::fz_emu::vote_complete<::fz_emu::kAll>, "__all_sync", &pred,
                            &out, file, line);
  return static_cast<int>(out);
}

// ---------------------------------------------------------------------------------------------
// Atomics. Blocks run serially and fibers switch only at collectives, so plain read-modify-write
// is atomic here. Float atomics are deliberately absent: ferrozero's kernels are deterministic.
#define FZ_EMU_ATOMIC(name, T, expr)              \
  static inline T name(T* address, T val) {       \
    T old = *address;                             \
    *address = (expr);                            \
    return old;                                   \
  }
#define FZ_EMU_ATOMIC_INTS(name, expr)                      \
  FZ_EMU_ATOMIC(name, int, expr)                            \
  FZ_EMU_ATOMIC(name, unsigned, expr)                       \
  FZ_EMU_ATOMIC(name, unsigned long long, expr)
FZ_EMU_ATOMIC_INTS(atomicAdd, old + val)
FZ_EMU_ATOMIC_INTS(atomicExch, val)
FZ_EMU_ATOMIC_INTS(atomicOr, old | val)
FZ_EMU_ATOMIC_INTS(atomicAnd, old & val)
FZ_EMU_ATOMIC_INTS(atomicXor, old ^ val)
FZ_EMU_ATOMIC_INTS(atomicMax, old > val ? old : val)
FZ_EMU_ATOMIC_INTS(atomicMin, old < val ? old : val)
FZ_EMU_ATOMIC(atomicSub, int, old - val)
FZ_EMU_ATOMIC(atomicSub, unsigned, old - val)
FZ_EMU_ATOMIC(atomicMax, long long, old > val ? old : val)
FZ_EMU_ATOMIC(atomicMin, long long, old < val ? old : val)
#undef FZ_EMU_ATOMIC_INTS
#undef FZ_EMU_ATOMIC
static inline unsigned atomicInc(unsigned* address, unsigned val) {
  unsigned old = *address;
  *address = old >= val ? 0 : old + 1;
  return old;
}
static inline unsigned atomicDec(unsigned* address, unsigned val) {
  unsigned old = *address;
  *address = (old == 0 || old > val) ? val : old - 1;
  return old;
}
template <class T>
static inline T atomicCAS(T* address, T compare, T val) {
  static_assert(std::is_integral<T>::value, "atomicCAS on integers");
  T old = *address;
  if (old == compare) *address = val;
  return old;
}
// Deterministic kernels only: a float atomic's order depends on timing on the GPU.
float atomicAdd(float* address, float val) = delete;
double atomicAdd(double* address, double val) = delete;

// ---------------------------------------------------------------------------------------------
// Loads and stores with cache hints: plain accesses here.
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
template <class T> static inline T __ldca(const T* p) { return *p; }
template <class T> static inline T __ldcs(const T* p) { return *p; }
template <class T> static inline T __ldlu(const T* p) { return *p; }
template <class T> static inline void __stcg(T* p, T v) { *p = v; }
template <class T> static inline void __stcs(T* p, T v) { *p = v; }
template <class T> static inline void __stwb(T* p, T v) { *p = v; }
template <class T> static inline void __stwt(T* p, T v) { *p = v; }

// ---------------------------------------------------------------------------------------------
// Math. The library is compiled with -ffp-contract=off, so `a * b + c` rounds twice exactly as
// the _rn intrinsics demand; the approximate intrinsics (__expf, ...) are the accurate functions.
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
// glibc declares __expf & co. as its own names for the same functions: macros avoid the clash.
#define __expf(x) expf(x)
#define __exp10f(x) exp10f(x)
#define __logf(x) logf(x)
#define __log2f(x) log2f(x)
#define __log10f(x) log10f(x)
#define __sinf(x) sinf(x)
#define __cosf(x) cosf(x)
#define __tanf(x) tanf(x)
#define __sincosf(x, s, c) sincosf(x, s, c)
#define __powf(x, y) powf(x, y)
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __frsqrt_rn(float a) { return 1.0f / sqrtf(a); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __drcp_rn(double a) { return 1.0 / a; }
static inline double __dsqrt_rn(double a) { return sqrt(a); }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }

static inline int __float_as_int(float x) { int r; memcpy(&r, &x, 4); return r; }
static inline unsigned __float_as_uint(float x) { unsigned r; memcpy(&r, &x, 4); return r; }
static inline float __int_as_float(int x) { float r; memcpy(&r, &x, 4); return r; }
static inline float __uint_as_float(unsigned x) { float r; memcpy(&r, &x, 4); return r; }
static inline long long __double_as_longlong(double x) { long long r; memcpy(&r, &x, 8); return r; }
static inline double __longlong_as_double(long long x) { double r; memcpy(&r, &x, 8); return r; }
static inline int __double2hiint(double x) { return static_cast<int>(__double_as_longlong(x) >> 32); }
static inline int __double2loint(double x) { return static_cast<int>(__double_as_longlong(x)); }

// Conversions with CUDA's saturation (NaN converts to 0).
template <class I>
static inline I fz_emu_sat(double r) {
  if (r != r) return 0;
  if (r <= static_cast<double>(std::numeric_limits<I>::min())) return std::numeric_limits<I>::min();
  if (r >= static_cast<double>(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
  return static_cast<I>(r);
}
static inline int __float2int_rn(float x) { return fz_emu_sat<int>(nearbyint(static_cast<double>(x))); }
static inline int __float2int_rz(float x) { return fz_emu_sat<int>(trunc(static_cast<double>(x))); }
static inline int __float2int_rd(float x) { return fz_emu_sat<int>(floor(static_cast<double>(x))); }
static inline int __float2int_ru(float x) { return fz_emu_sat<int>(ceil(static_cast<double>(x))); }
static inline unsigned __float2uint_rn(float x) {
  return fz_emu_sat<unsigned>(nearbyint(static_cast<double>(x)));
}
static inline unsigned __float2uint_rz(float x) {
  return fz_emu_sat<unsigned>(trunc(static_cast<double>(x)));
}
static inline float __int2float_rn(int x) { return static_cast<float>(x); }
static inline float __uint2float_rn(unsigned x) { return static_cast<float>(x); }
static inline float __ll2float_rn(long long x) { return static_cast<float>(x); }
static inline float __ull2float_rn(unsigned long long x) { return static_cast<float>(x); }
static inline double __ll2double_rn(long long x) { return static_cast<double>(x); }
static inline float __double2float_rn(double x) { return static_cast<float>(x); }

static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
static inline int __clzll(long long x) {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
static inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}
static inline int __mulhi(int a, int b) {
  return static_cast<int>((static_cast<long long>(a) * b) >> 32);
}
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
static inline long long __mul64hi(long long a, long long b) {
  return static_cast<long long>((static_cast<__int128>(a) * b) >> 64);
}
static inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
  unsigned long long v = (static_cast<unsigned long long>(hi) << 32) | lo;
  return static_cast<unsigned>((v << (shift & 31)) >> 32);
}
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  unsigned long long v = (static_cast<unsigned long long>(hi) << 32) | lo;
  return static_cast<unsigned>(v >> (shift & 31));
}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  unsigned long long v = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}

// CUDA's min/max overloads (same-type only; mixed calls need a cast, as they should).
#define FZ_EMU_MINMAX(T)                                                    \
  static inline T min(T a, T b) { return a < b ? a : b; }                   \
  static inline T max(T a, T b) { return a > b ? a : b; }
FZ_EMU_MINMAX(int)
FZ_EMU_MINMAX(unsigned)
FZ_EMU_MINMAX(long)
FZ_EMU_MINMAX(unsigned long)
FZ_EMU_MINMAX(long long)
FZ_EMU_MINMAX(unsigned long long)
#undef FZ_EMU_MINMAX
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
static inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
static inline long long llmin(long long a, long long b) { return a < b ? a : b; }
static inline long long llmax(long long a, long long b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------------------------
// Registration: runtime.cpp finds kernels by name; the generated translation unit of every
// kernel source registers each `extern "C" __global__` function through this template, which
// unpacks cuLaunchKernel-style `void** params` into the function's own parameter types.
namespace fz_emu {

typedef void (*Thunk)(void* fn, void** params);

template <class... A, size_t... I>
inline void call_unpacked(void (*f)(A...), void** p, std::index_sequence<I...>) {
  f(*static_cast<typename std::remove_cv<A>::type*>(p[I])...);
}
template <class... A>
inline void thunk(void* fn, void** params) {
  call_unpacked(reinterpret_cast<void (*)(A...)>(fn), params, std::index_sequence_for<A...>{});
}

void register_kernel(const char* name, const char* file, Thunk thunk, void* fn, int arity);

struct Registrar {
  template <class... A>
  Registrar(const char* name, const char* file, void (*f)(A...)) {
    register_kernel(name, file, &thunk<A...>, reinterpret_cast<void*>(f),
                    static_cast<int>(sizeof...(A)));
  }
};

}  // namespace fz_emu
