// loss.cu: softmax cross-entropy over a chunk of logits rows, the loss sum, and argmax.
//
// The head's matmul produces logits a chunk of rows at a time, so full-vocabulary logits never
// exist for the whole batch. In training the fused kernel turns a chunk's logits into its
// gradients at once (the loss gradient g is known before forward); otherwise forward saves one
// f32 log-sum-exp per row and backward recomputes the softmax from the chunk's logits and it.
// Logits are T (_f32, _bf16, _f16) with a leading dimension ld >= vocab (the head pads it so
// that every row starts 16-byte aligned for cuBLASLt); columns [vocab, ld) are never read or
// written. Targets are `int`, -100 ignores a row (the CPU backend's IGNORE_INDEX).
//
//   cross_entropy_forward_T(const T* logits, const int* targets, float* lse, float* loss,
//                           long long rows, int vocab, int ld, int* bad)
//       lse[r] = log(sum_j exp(logits[r, j])) and loss[r] = lse[r] - logits[r, target]
//       (0 for an ignored row), both overwritten. One pass over the row (online max and sum).
//       A target outside [0, vocab) other than -100 is never read: its loss is 0 and *bad = 1.
//   cross_entropy_backward_T(const T* logits, const int* targets, const float* lse,
//                            T* dlogits, long long rows, int vocab, int ld, float g)
//       dlogits[r, j] = g * softmax(logits[r])_j - (j == target ? g : 0), overwritten; rows with
//       an ignored (or out-of-range) target become zero. dlogits may be logits itself.
//   cross_entropy_fused_T(T* logits, const int* targets, float* loss, long long rows,
//                         int vocab, int ld, float g, int* bad)
//       forward's loss[r] and, in place of the logits, backward's dlogits, in one kernel: the
//       same arithmetic as forward then backward (the same bits), without the lse round trip.
//     Launch (all three): a block per row (grid rows, or fewer: blocks stride over rows), block
//     a multiple of 32 threads, e.g. 1024 for a 50k vocabulary, 256 for a small one.
//
//   cross_entropy_loss_sum(const float* loss, long long rows, float* out, double* acc)
//       *out = sum of loss[0 .. rows) (overwritten), summed in f64 and rounded once; when acc is
//       not null, *acc += the f64 sum (a device-side accumulator over chunks and micro-steps,
//       like the CPU engine's f64 loss sum). Launch: exactly one block; the summation order
//       depends on its size, so the host always uses the same (1024 threads).
//
//   argmax_T(const T* x, int* out, long long rows, int cols)
//       out[r] = the first index of the row's maximum (the CPU's argmax_rows: NaN never wins,
//       a NaN in column 0 gives 0). Launch: as cross-entropy, a block per row.
//
// Determinism: a row's partition over threads depends on the row's length and its address
// modulo 16 (unaligned heads go element by element); combining uses fixed butterflies.

#define FZ_IGNORE_INDEX (-100)

// Online softmax state: running maximum m and sum s of exp(x - m).
struct SoftmaxState {
  float m, s;
};

__device__ __forceinline__ SoftmaxState softmax_combine(SoftmaxState a, SoftmaxState b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -fz_inf()) return a;  // both empty
  // Separate roundings keep the combination symmetric, so all lanes of a butterfly agree.
  const float s = __fadd_rn(__fmul_rn(a.s, expf(a.m - m)), __fmul_rn(b.s, expf(b.m - m)));
  return {m, s};
}

template <int W>
__device__ __forceinline__ void softmax_add(SoftmaxState& st, const float (&v)[W]) {
  float pm = v[0];
#pragma unroll
  for (int k = 1; k < W; ++k) pm = fmaxf(pm, v[k]);
  if (pm > st.m) {  // rescale once per pack, not per element
    st.s *= expf(st.m - pm);
    st.m = pm;
  }
  if (st.m == -fz_inf()) return;  // everything so far is -inf: contributes nothing
#pragma unroll
  for (int k = 0; k < W; ++k) st.s += expf(v[k] - st.m);
}

__device__ __forceinline__ SoftmaxState softmax_warp(SoftmaxState st) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    SoftmaxState other = {__shfl_xor_sync(0xffffffffu, st.m, o),
                          __shfl_xor_sync(0xffffffffu, st.s, o)};
    st = softmax_combine(st, other);
  }
  return st;
}

// One row's pass for forward: operator()(i, fz_int<W>) folds elements i .. i+W-1 into st.
template <class T>
struct SoftmaxPass {
  const T* xr;
  SoftmaxState st;
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) {
    float v[W];
    fz_load<W>(xr + i, v);
    softmax_add<W>(st, v);
  }
};

// One row's backward: dlogits = g * exp(x - lse) - (j == t ? g : 0), or zero.
template <class T>
struct SoftmaxGrad {
  const T* xr;
  T* dr;
  int t;
  bool zero;
  float lse;
  float g;
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) const {
    float v[W];
    fz_load<W>(xr + i, v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float p = expf(v[k] - lse) * g;
      v[k] = zero ? 0.0f : (i + k == t ? p - g : p);
    }
    fz_store<W>(dr + i, v);
  }
};

// One row's softmax statistics by the whole block; every thread gets the same bits (each warp
// combines the warps' partial states in the same butterfly). `s_warp` is 32 shared states.
template <class T>
__device__ __forceinline__ SoftmaxState row_softmax(const T* xr, int vocab, SoftmaxState* s_warp) {
  constexpr int V = fz_vec<T>::n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  SoftmaxPass<T> pass{xr, {-fz_inf(), 0.0f}};
  fz_row_packs<V>(xr, vocab, true, threadIdx.x, blockDim.x, pass);
  const SoftmaxState st = softmax_warp(pass.st);
  if (lane == 0) s_warp[warp] = st;
  __syncthreads();
  SoftmaxState w = lane < warps ? s_warp[lane] : SoftmaxState{-fz_inf(), 0.0f};
  w = softmax_warp(w);
  __syncthreads();  // s_warp is rewritten for the next row
  return w;
}

// A row's loss from its statistics: the CPU's form, ln(sum) - (x_t - max), subtracted in f64;
// 0 for an ignored row, and for an out-of-range target (flagged in *bad).
template <class T>
__device__ __forceinline__ float row_loss(const T* xr, int t, int vocab, SoftmaxState w,
                                          float log_s, int* bad) {
  if (t == FZ_IGNORE_INDEX) return 0.0f;
  if (t < 0 || t >= vocab) {
    atomicOr(bad, 1);
    return 0.0f;
  }
  const float zt = to_f32(xr[t]) - w.m;
  return static_cast<float>(static_cast<double>(log_s) - static_cast<double>(zt));
}

template <class T>
__device__ __forceinline__ void cross_entropy_forward(const T* logits, const int* targets,
                                                      float* lse, float* loss, long long rows,
                                                      int vocab, int ld, int* bad) {
  __shared__ SoftmaxState s_warp[32];
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = logits + row * ld;
    const SoftmaxState w = row_softmax(xr, vocab, s_warp);
    if (threadIdx.x == 0) {
      const float log_s = logf(w.s);
      lse[row] = w.m + log_s;
      loss[row] = row_loss(xr, targets[row], vocab, w, log_s, bad);
    }
  }
}

template <class T>
__device__ __forceinline__ void cross_entropy_backward(const T* logits, const int* targets,
                                                       const float* lse, T* dlogits,
                                                       long long rows, int vocab, int ld,
                                                       float g) {
  constexpr int V = fz_vec<T>::n;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = logits + row * ld;
    T* dr = dlogits + row * ld;
    const int t = targets[row];
    const bool zero = t < 0 || t >= vocab;  // ignored, or out of range (flagged by forward)
    const float l = lse[row];
    // Vectors only when both rows share their alignment.
    const bool vec = ((reinterpret_cast<unsigned long long>(xr) ^
                       reinterpret_cast<unsigned long long>(dr)) & 15) == 0;
    SoftmaxGrad<T> op{xr, dr, t, zero, l, g};
    fz_row_packs<V>(xr, vocab, vec, threadIdx.x, blockDim.x, op);
  }
}

template <class T>
__device__ __forceinline__ void cross_entropy_fused(T* logits, const int* targets, float* loss,
                                                    long long rows, int vocab, int ld, float g,
                                                    int* bad) {
  __shared__ SoftmaxState s_warp[32];
  constexpr int V = fz_vec<T>::n;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    T* xr = logits + row * ld;
    const SoftmaxState w = row_softmax(xr, vocab, s_warp);
    const float log_s = logf(w.s);
    const int t = targets[row];
    if (threadIdx.x == 0) loss[row] = row_loss(xr, t, vocab, w, log_s, bad);
    __syncthreads();  // the target's logit is read before the row is overwritten
    SoftmaxGrad<T> op{xr, xr, t, t < 0 || t >= vocab, w.m + log_s, g};
    fz_row_packs<V>(xr, vocab, true, threadIdx.x, blockDim.x, op);
  }
}

// Candidate (value, index) of an argmax: larger value wins, equal values the smaller index;
// index -1 is "none yet" and NaN values never become candidates.
__device__ __forceinline__ void argmax_take(float& bv, int& bi, float v, int i) {
  if (i < 0 || v != v) return;
  if (bi < 0 || v > bv || (v == bv && i < bi)) {
    bv = v;
    bi = i;
  }
}

// One row's argmax pass over this thread's elements.
template <class T>
struct ArgmaxPass {
  const T* xr;
  float bv;
  int bi;
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) {
    float v[W];
    fz_load<W>(xr + i, v);
#pragma unroll
    for (int k = 0; k < W; ++k) argmax_take(bv, bi, v[k], static_cast<int>(i + k));
  }
};

template <class T>
__device__ __forceinline__ void argmax(const T* x, int* out, long long rows, int cols) {
  __shared__ float s_v[32];
  __shared__ int s_i[32];
  constexpr int V = fz_vec<T>::n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (cols <= 0) {  // empty rows: index 0, and nothing to read
    for (long long row = blockIdx.x; row < rows; row += gridDim.x)
      if (threadIdx.x == 0) out[row] = 0;
    return;
  }
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    ArgmaxPass<T> pass{xr, 0.0f, -1};
    fz_row_packs<V>(xr, cols, true, threadIdx.x, blockDim.x, pass);
    float bv = pass.bv;
    int bi = pass.bi;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      argmax_take(bv, bi, ov, oi);
    }
    if (lane == 0) {
      s_v[warp] = bv;
      s_i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
      bv = lane < warps ? s_v[lane] : 0.0f;
      bi = lane < warps ? s_i[lane] : -1;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        argmax_take(bv, bi, ov, oi);
      }
      if (lane == 0) {
        // Sequentially, a NaN first element is never beaten (nothing compares greater).
        const float first = to_f32(xr[0]);
        out[row] = (first != first || bi < 0) ? 0 : bi;
      }
    }
    __syncthreads();  // s_v/s_i are rewritten for the next row
  }
}

// ---- instantiations ----------------------------------------------------------------------------

extern "C" __global__ void cross_entropy_forward_f32(const float* logits, const int* targets,
                                                     float* lse, float* loss, long long rows,
                                                     int vocab, int ld, int* bad) {
  cross_entropy_forward(logits, targets, lse, loss, rows, vocab, ld, bad);
}
extern "C" __global__ void cross_entropy_forward_bf16(const bf16_t* logits, const int* targets,
                                                      float* lse, float* loss, long long rows,
                                                      int vocab, int ld, int* bad) {
  cross_entropy_forward(logits, targets, lse, loss, rows, vocab, ld, bad);
}
extern "C" __global__ void cross_entropy_forward_f16(const f16_t* logits, const int* targets,
                                                     float* lse, float* loss, long long rows,
                                                     int vocab, int ld, int* bad) {
  cross_entropy_forward(logits, targets, lse, loss, rows, vocab, ld, bad);
}

extern "C" __global__ void cross_entropy_backward_f32(const float* logits, const int* targets,
                                                      const float* lse, float* dlogits,
                                                      long long rows, int vocab, int ld, float g) {
  cross_entropy_backward(logits, targets, lse, dlogits, rows, vocab, ld, g);
}
extern "C" __global__ void cross_entropy_backward_bf16(const bf16_t* logits, const int* targets,
                                                       const float* lse, bf16_t* dlogits,
                                                       long long rows, int vocab, int ld, float g) {
  cross_entropy_backward(logits, targets, lse, dlogits, rows, vocab, ld, g);
}
extern "C" __global__ void cross_entropy_backward_f16(const f16_t* logits, const int* targets,
                                                      const float* lse, f16_t* dlogits,
                                                      long long rows, int vocab, int ld, float g) {
  cross_entropy_backward(logits, targets, lse, dlogits, rows, vocab, ld, g);
}

extern "C" __global__ void cross_entropy_fused_f32(float* logits, const int* targets, float* loss,
                                                   long long rows, int vocab, int ld, float g,
                                                   int* bad) {
  cross_entropy_fused(logits, targets, loss, rows, vocab, ld, g, bad);
}
extern "C" __global__ void cross_entropy_fused_bf16(bf16_t* logits, const int* targets, float* loss,
                                                   long long rows, int vocab, int ld, float g,
                                                   int* bad) {
  cross_entropy_fused(logits, targets, loss, rows, vocab, ld, g, bad);
}
extern "C" __global__ void cross_entropy_fused_f16(f16_t* logits, const int* targets, float* loss,
                                                   long long rows, int vocab, int ld, float g,
                                                   int* bad) {
  cross_entropy_fused(logits, targets, loss, rows, vocab, ld, g, bad);
}

extern "C" __global__ void cross_entropy_loss_sum(const float* loss, long long rows, float* out,
                                                  double* acc) {
  __shared__ double scratch[32];
  if (blockIdx.x != 0) return;  // one block sums everything; extra blocks must not add again
  double s = 0.0;
  for (long long i = threadIdx.x; i < rows; i += blockDim.x) s += static_cast<double>(loss[i]);
  s = fz_block_sum(s, scratch);
  if (threadIdx.x == 0) {
    *out = static_cast<float>(s);
    if (acc) *acc += s;
  }
}

extern "C" __global__ void argmax_f32(const float* x, int* out, long long rows, int cols) {
  argmax(x, out, rows, cols);
}
extern "C" __global__ void argmax_bf16(const bf16_t* x, int* out, long long rows, int cols) {
  argmax(x, out, rows, cols);
}
extern "C" __global__ void argmax_f16(const f16_t* x, int* out, long long rows, int cols) {
  argmax(x, out, rows, cols);
}
