#line 1 "prelude.cuh"
// prelude.cuh: prepended to every ferrozero kernel source, for NVRTC and for the CPU emulator
// (which includes its emu.h first and defines FZ_EMU). No CUDA header is included: NVRTC
// provides the built-ins, and the 16-bit float types below are plain storage with conversions
// written in integer arithmetic, so NVRTC and g++ produce the same bits.
//
// Conventions shared by every kernel file:
// - Element counts and offsets are `long long`; elementwise kernels are grid-stride loops.
// - Activations and parameters come in a storage type T (float, bf16_t, f16_t); compute is f32;
//   every kernel is written once as a template and instantiated by thin `extern "C"` wrappers
//   with the suffixes _f32, _bf16, _f16.
// - Deterministic: no float atomics, and every reduction's order depends on shapes only.

// ---- 16-bit storage types ---------------------------------------------------------------------
// bfloat16 and IEEE binary16 as raw bits. Conversions round to nearest even, bit-identical to
// Rust's `half` crate (`bf16::from_f32`, `f16::from_f32`, `to_f32`): NaN stays NaN with its
// payload's top bits and the quiet bit set, overflow goes to infinity, f16 keeps subnormals.
// (PTX's cvt.rn would canonicalise NaNs, which `half` does not.)
struct __align__(2) bf16_t {
  unsigned short bits;
};
struct __align__(2) f16_t {
  unsigned short bits;
};

__device__ __forceinline__ float to_f32(float x) { return x; }

__device__ __forceinline__ float to_f32(bf16_t x) {
  unsigned b = x.bits;
  if ((b & 0x7fffu) > 0x7f80u) b |= 0x40u;  // quiet a signalling NaN, as `half` does
  return __uint_as_float(b << 16);
}

__device__ __forceinline__ float to_f32(f16_t x) {
  const unsigned h = x.bits;
  const unsigned sign = (h & 0x8000u) << 16;
  const unsigned exp = (h >> 10) & 0x1fu;
  unsigned man = h & 0x3ffu;
  if (exp == 0x1fu) {  // infinity, or NaN made quiet
    return __uint_as_float(sign | 0x7f800000u | (man != 0 ? 0x400000u : 0u) | (man << 13));
  }
  if (exp == 0) {
    if (man == 0) return __uint_as_float(sign);
    // Subnormal (man * 2^-24): shift the leading one up to bit 10; each shift halves the
    // exponent, which starts from 2^-14 (biased 113).
    const int k = __clz(static_cast<int>(man)) - 21;
    man <<= k;
    return __uint_as_float(sign | (static_cast<unsigned>(113 - k) << 23) | ((man & 0x3ffu) << 13));
  }
  return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

template <class T>
__device__ __forceinline__ T from_f32(float x);

template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}

template <>
__device__ __forceinline__ bf16_t from_f32<bf16_t>(float x) {
  const unsigned b = __float_as_uint(x);
  bf16_t r;
  if ((b & 0x7fffffffu) > 0x7f800000u) {
    r.bits = static_cast<unsigned short>((b >> 16) | 0x40u);
  } else {
    // Adding 0x7fff plus the kept LSB carries into bit 16 exactly when RNE rounds up.
    r.bits = static_cast<unsigned short>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
  }
  return r;
}

template <>
__device__ __forceinline__ f16_t from_f32<f16_t>(float x) {
  const unsigned b = __float_as_uint(x);
  const unsigned sign = (b >> 16) & 0x8000u;
  const unsigned exp = b & 0x7f800000u;
  const unsigned man = b & 0x7fffffu;
  f16_t r;
  if (exp == 0x7f800000u) {
    r.bits = static_cast<unsigned short>(sign | 0x7c00u | (man != 0 ? 0x200u : 0u) | (man >> 13));
    return r;
  }
  const int e = static_cast<int>(exp >> 23) - 127 + 15;
  if (e >= 31) {
    r.bits = static_cast<unsigned short>(sign | 0x7c00u);
    return r;
  }
  if (e <= 0) {
    if (14 - e > 24) {
      r.bits = static_cast<unsigned short>(sign);
      return r;
    }
    const unsigned m = man | 0x800000u;
    unsigned hm = m >> (14 - e);
    const unsigned round = 1u << (13 - e);
    // Round bit set and (sticky bits or the kept LSB) set: round half to even.
    if ((m & round) != 0 && (m & (3u * round - 1u)) != 0) ++hm;
    r.bits = static_cast<unsigned short>(sign | hm);
    return r;
  }
  unsigned h = sign | (static_cast<unsigned>(e) << 10) | (man >> 13);
  if ((man & 0x1000u) != 0 && (man & 0x2fffu) != 0) ++h;  // a carry may reach infinity: correct
  r.bits = static_cast<unsigned short>(h);
  return r;
}

// +infinity without <math.h>'s INFINITY (NVRTC has no standard headers).
__device__ __forceinline__ float fz_inf() { return __int_as_float(0x7f800000); }

// 2^x by the special-function unit: ex2.approx.ftz.f32 (relative error about 2^-22, subnormal
// inputs and results flushed to zero, 2^-inf = 0) in one instruction, where exp2f spends three
// more on subnormal results. The emulator computes exp2f and flushes subnormal results to zero
// likewise (so its values may differ from the GPU's in the last bits: compare with a tolerance).
#ifdef FZ_EMU
__device__ __forceinline__ float fz_exp2_approx(float x) {
  const float r = exp2f(x);
  return r < 1.17549435e-38f ? 0.0f : r;
}
#else
__device__ __forceinline__ float fz_exp2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
#endif

// ---- gradients read as their accumulator's dtype -------------------------------------------------
// An element stored as S that stands for an accumulator of dtype D never written (at one micro-step
// per step the micro-step gradient is the step's): read as D(x) + 0.0f, what adding it into zeros
// of D held (rounded to nearest even, f16 overflow to infinity, -0.0 turned +0.0). Plain storage,
// so fz_load reads it with the same vectors as S.
template <class S, class D>
struct fz_as {
  S x;
};

template <class S, class D>
__device__ __forceinline__ float to_f32(fz_as<S, D> v) {
  return __fadd_rn(to_f32(from_f32<D>(to_f32(v.x))), 0.0f);
}

// ---- vector memory access -----------------------------------------------------------------------
// `N` consecutive elements of T as f32. When N * sizeof(T) is a multiple of 16 the access is whole
// 16-byte vectors and the caller guarantees 16-byte alignment (fz_aligned16); otherwise (N = 1 in
// the scalar fallbacks) it is element by element.
__device__ __forceinline__ bool fz_aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

template <int N, class T>
__device__ __forceinline__ void fz_load(const T* __restrict__ p, float (&out)[N]) {
  if constexpr ((N * sizeof(T)) % 16 == 0) {
    __align__(16) T tmp[N];
#pragma unroll
    for (int k = 0; k < static_cast<int>(N * sizeof(T) / 16); ++k)
      reinterpret_cast<uint4*>(tmp)[k] = reinterpret_cast<const uint4*>(p)[k];
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_f32(tmp[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_f32(p[k]);
  }
}

template <int N, class T>
__device__ __forceinline__ void fz_store(T* __restrict__ p, const float (&in)[N]) {
  if constexpr ((N * sizeof(T)) % 16 == 0) {
    __align__(16) T tmp[N];
#pragma unroll
    for (int k = 0; k < N; ++k) tmp[k] = from_f32<T>(in[k]);
#pragma unroll
    for (int k = 0; k < static_cast<int>(N * sizeof(T) / 16); ++k)
      reinterpret_cast<uint4*>(p)[k] = reinterpret_cast<const uint4*>(tmp)[k];
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = from_f32<T>(in[k]);
  }
}

// Pack `j0` (elements j0 .. j0+N-1) of a row of `dim` elements: vectorised when `vec` (the row
// is aligned and dim a multiple of N), else element by element, with zeros past the row's end.
template <int N, class T>
__device__ __forceinline__ void fz_load_row(const T* __restrict__ row, int j0, int dim, bool vec,
                                            float (&out)[N]) {
  if (vec) {
    fz_load<N>(row + j0, out);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = j0 + k < dim ? to_f32(row[j0 + k]) : 0.0f;
  }
}

template <int N, class T>
__device__ __forceinline__ void fz_store_row(T* __restrict__ row, int j0, int dim, bool vec,
                                             const float (&in)[N]) {
  if (vec) {
    fz_store<N>(row + j0, in);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (j0 + k < dim) row[j0 + k] = from_f32<T>(in[k]);
  }
}

// Elements of T per 16-byte vector.
template <class T>
struct fz_vec {
  static constexpr int n = static_cast<int>(16 / sizeof(T));
};

// A pack width as a type, so a functor's `template <int W> operator()(long long i, fz_int<W>)`
// is instantiated once for 16-byte vectors and once for single elements. (Functors, not lambdas:
// NVRTC treats an unannotated lambda as host code unless compiled with -default-device.)
template <int V>
struct fz_int {
  static constexpr int value = V;
};

// Grid-stride loop over n elements: body(i, fz_int<V>) for whole packs of V elements starting at
// i when `aligned` (every pointer the body touches is 16-byte aligned), then body(i, fz_int<1>)
// for the remaining elements one by one (all of them when not aligned).
template <int V, class Body>
__device__ __forceinline__ void fz_grid_packs(long long n, bool aligned, const Body& body) {
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  long long done = 0;
  if (aligned) {
    const long long packs = n / V;
    for (long long p = first; p < packs; p += stride) body(p * V, fz_int<V>());
    done = packs * V;
  }
  for (long long i = done + first; i < n; i += stride) body(i, fz_int<1>());
}

// The elements [0, n) of a row at `p`, split between `threads` threads (this one is `t`) in a
// fixed pattern: the elements before the first 16-byte boundary one by one, then whole packs of
// V elements (16-byte vectors), then the rest one by one; body(i, fz_int<W>) gets the first
// element and the width. When `vec` is false (another buffer the body touches has a different
// alignment), every element goes one by one. The pattern depends only on n, the row's address
// modulo 16 and `vec`.
template <int V, class T, class Body>
__device__ __forceinline__ void fz_row_packs(const T* p, long long n, bool vec, int t, int threads,
                                             Body& body) {
  long long head = n;
  if (vec) {
    head = static_cast<long long>((16 - (reinterpret_cast<unsigned long long>(p) & 15)) & 15) /
           static_cast<long long>(sizeof(T));
    if (head > n) head = n;
  }
  for (long long i = t; i < head; i += threads) body(i, fz_int<1>());
  const long long packs = (n - head) / V;
  for (long long q = t; q < packs; q += threads) body(head + q * V, fz_int<V>());
  for (long long i = head + packs * V + t; i < n; i += threads) body(i, fz_int<1>());
}

// ---- reductions ---------------------------------------------------------------------------------
// Butterfly sums: every lane ends with the same bits (each level adds the same pair of values,
// only in swapped order), and the order depends on nothing but the lane count.
__device__ __forceinline__ float fz_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double fz_warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float fz_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (at most 1024); every thread gets the total.
// `scratch` holds 32 values of shared memory; the function synchronises before reusing it.
template <class F>
__device__ __forceinline__ F fz_block_sum(F v, F* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = fz_warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : F(0);
  return fz_warp_sum(v);
}

// ---- tensor cores ---------------------------------------------------------------------------------
// D = A * B + C for one warp on tensor cores: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
// (sm_80+), every lane of the warp taking part. Fragments (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"), g = lane >> 2, t = lane & 3, two bf16 per register
// with the lower index in the low 16 bits:
//   a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   c[0..1], d[0..1] = C[g][2t, 2t+1]   c[2..3], d[2..3] = C[g+8][2t, 2t+1]
// The emulator computes the same warp-wide product (its f32 sum order is fixed; the hardware's is
// unspecified).
#ifdef FZ_EMU
__device__ __forceinline__ void fz_mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4],
                                                     const unsigned (&b)[2], const float (&c)[4],
                                                     const char* file = __builtin_FILE(),
                                                     int line = __builtin_LINE()) {
  ::fz_emu::mma_m16n8k16_bf16(d, a, b, c, file, line);
}
#else
__device__ __forceinline__ void fz_mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4],
                                                     const unsigned (&b)[2], const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}
#endif

// D = A * B + C with f16 inputs: mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, the same
// fragments as above with IEEE binary16 halves.
#ifdef FZ_EMU
__device__ __forceinline__ void fz_mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4],
                                                    const unsigned (&b)[2], const float (&c)[4],
                                                    const char* file = __builtin_FILE(),
                                                    int line = __builtin_LINE()) {
  ::fz_emu::mma_m16n8k16_f16(d, a, b, c, file, line);
}
#else
__device__ __forceinline__ void fz_mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4],
                                                    const unsigned (&b)[2], const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}
#endif

// Two f32 values as one register of two 16-bit floats (the first in the low half), rounded to
// nearest even: one cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32 on the GPU (sm_80+), the conversions
// above in the emulator (the same bits for every value but NaN payloads).
template <class T>
__device__ __forceinline__ unsigned fz_pack2(float lo, float hi);
#ifdef FZ_EMU
template <>
__device__ __forceinline__ unsigned fz_pack2<bf16_t>(float lo, float hi) {
  return static_cast<unsigned>(from_f32<bf16_t>(lo).bits) |
         static_cast<unsigned>(from_f32<bf16_t>(hi).bits) << 16;
}
template <>
__device__ __forceinline__ unsigned fz_pack2<f16_t>(float lo, float hi) {
  return static_cast<unsigned>(from_f32<f16_t>(lo).bits) |
         static_cast<unsigned>(from_f32<f16_t>(hi).bits) << 16;
}
#else
template <>
__device__ __forceinline__ unsigned fz_pack2<bf16_t>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <>
__device__ __forceinline__ unsigned fz_pack2<f16_t>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif

// ---- shared-memory addresses ---------------------------------------------------------------------
// fz_smem_t: an address in shared memory as fz_ldmatrix_* and fz_cp_async16 take it; byte offsets
// are added to it as integers. On the GPU it is the 32-bit shared-window address
// (__cvta_generic_to_shared), so constant offsets fold into the instructions' immediates instead
// of costing 64-bit arithmetic and a register each; in the emulator it is the host address.
#ifdef FZ_EMU
typedef unsigned long long fz_smem_t;
__device__ __forceinline__ fz_smem_t fz_smem(const void* p) {
  return reinterpret_cast<unsigned long long>(p);
}
#else
typedef unsigned fz_smem_t;
__device__ __forceinline__ fz_smem_t fz_smem(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
#endif

// ---- shared-memory matrix loads (ldmatrix, sm_75+) ------------------------------------------------
// ldmatrix.sync.aligned.m8n8.x4.shared.b16: four 8x8 matrices of 16-bit elements, every lane of the
// warp taking part. Lanes 8i .. 8i+7 each pass the address of one row of matrix i (8 elements, 16
// bytes, 16-byte aligned, in shared memory); with g = lane >> 2, t = lane & 3, lane receives
//   r[i] = M_i[g][2t, 2t+1]                 (fz_ldmatrix_x4)
//   r[i] = M_i[2t][g], M_i[2t+1][g]         (fz_ldmatrix_x4_trans)
// with the first element in the low 16 bits: exactly an mma A/B fragment register.
#ifdef FZ_EMU
__device__ __forceinline__ void fz_ldmatrix_x4(unsigned (&r)[4], fz_smem_t row,
                                               const char* file = __builtin_FILE(),
                                               int line = __builtin_LINE()) {
  ::fz_emu::ldmatrix_x4(r, reinterpret_cast<const void*>(row), false, file, line);
}
__device__ __forceinline__ void fz_ldmatrix_x4_trans(unsigned (&r)[4], fz_smem_t row,
                                                     const char* file = __builtin_FILE(),
                                                     int line = __builtin_LINE()) {
  ::fz_emu::ldmatrix_x4(r, reinterpret_cast<const void*>(row), true, file, line);
}
#else
__device__ __forceinline__ void fz_ldmatrix_x4(unsigned (&r)[4], fz_smem_t row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row));
}
__device__ __forceinline__ void fz_ldmatrix_x4_trans(unsigned (&r)[4], fz_smem_t row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row));
}
#endif

// ---- asynchronous copies global -> shared (cp.async, sm_80+) -----------------------------------
// fz_cp_async16(dst, src, fill): copies 16 bytes from global `src` to shared `dst` (both 16-byte
// aligned) when `fill`, else writes 16 zero bytes there (src is not read). The copy lands only
// after fz_cp_async_wait<N>() returns with it in a committed group older than the N most recent
// ones, and other threads see it after a barrier that follows that wait. The emulator performs a
// thread's copies when that thread waits for them, so a read before the wait sees stale data.
#ifdef FZ_EMU
__device__ __forceinline__ void fz_cp_async16(fz_smem_t dst, const void* src, bool fill,
                                              const char* file = __builtin_FILE(),
                                              int line = __builtin_LINE()) {
  ::fz_emu::cp_async(reinterpret_cast<void*>(dst), src, 16, fill ? 16 : 0, file, line);
}
__device__ __forceinline__ void fz_cp_async_commit() { ::fz_emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void fz_cp_async_wait() {
  ::fz_emu::cp_async_wait(N);
}
#else
__device__ __forceinline__ void fz_cp_async16(fz_smem_t dst, const void* src, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(fill ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void fz_cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void fz_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif

// ---- dynamic shared memory ----------------------------------------------------------------------
// `FZ_DYNAMIC_SMEM(float, smem);` declares `float* smem` over the launch's dynamic shared memory
// (16-byte aligned).
#ifdef FZ_EMU
#define FZ_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(::fz_emu::dynamic_smem())
#else
#define FZ_DYNAMIC_SMEM(T, name)                            \
  extern __shared__ __align__(16) unsigned char fz_dyn_smem_[]; \
  T* name = reinterpret_cast<T*>(fz_dyn_smem_)
#endif

// Bytes of dynamic shared memory this launch has (kernels that depend on a size the host computed
// check it).
#ifdef FZ_EMU
__device__ __forceinline__ unsigned fz_dynamic_smem_bytes() {
  return static_cast<unsigned>(::fz_emu::dynamic_smem_bytes());
}
#else
__device__ __forceinline__ unsigned fz_dynamic_smem_bytes() {
  unsigned r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}
#endif
