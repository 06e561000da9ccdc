// optim.cu: multi-tensor fused optimizer steps (AdamW/Adam, SGD, Lion), bit-identical to the
// CPU optimizers (offload/src/optim/reference.rs).
//
// One launch updates many tensors. The host passes a device array of descriptors:
//
//   struct OptTensor {            // 64 bytes, 8-byte aligned (Rust: #[repr(C)])
//     float* params;              //  0: f32 master parameters, updated in place (bf16_t* for
//                                 //     the _bf16_state kernels, as m and v are)
//     const void* grads;          //  8: gradients (still scaled: see grad_scale), in the
//                                 //     dtype grad_dtype names
//     float* m;                   // 16: first moment (Adam, Lion) or momentum (SGD; may be null
//                                 //     when momentum == 0)
//     float* v;                   // 24: second moment (Adam; unused otherwise)
//     void* lp;                   // 32: low-precision copy written in the same pass (bf16_t* for
//                                 //     _bf16 kernels, f16_t* for _f16; null for none; ignored by
//                                 //     _f32 kernels)
//     long long n;                // 40: elements
//     long long first_chunk;      // 48: index of this tensor's first chunk: the sum of
//                                 //     ceil(n / chunk) over the tensors before it
//     long long grad_dtype;       // 56: 0 f32, 1 bf16, 2 f16: half-precision gradients are
//                                 //     widened in registers (exactly), no pass of their own;
//                                 //     3, 4, 5: f32 read as an f32, bf16, f16 accumulator
//                                 //     (fz_as: rounded, + 0.0f); 6, 7: bf16, f16 + 0.0f
//   };
//
// and `total_chunks` (the sum over all tensors). Chunk c of the launch is a `chunk`-element
// slice of one tensor (apex's multi-tensor apply); blocks stride over chunks, so any grid works
// (e.g. min(total_chunks, 8 * SMs) blocks of 256 threads). `chunk` should be a multiple of 8
// (then every chunk of an aligned tensor is vectorised; otherwise the kernel goes element by
// element).
//
// `grad_scale` (loss-scale removal times the clip coefficient) is read from device memory, so a
// scale computed on the device (clip_grad_scale) needs no round trip through the host. A NaN
// scale skips the step: the kernel writes nothing (an overflow's verdict, decided on the device).
//
//   adam_multi_<lp>(const OptTensor* t, int ntensors, long long total_chunks, int chunk,
//                   float lr, float beta1, float beta2, float eps, float weight_decay,
//                   int decoupled, float step_size, float bc2_sqrt, const float* grad_scale)
//       step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t) are computed by the host
//       exactly as `adam_terms` does (lr and 1 without bias correction); decoupled = 1 is AdamW.
//   sgd_multi_<lp>(..., float lr, float momentum, float dampening, float weight_decay,
//                  int nesterov, int first_step, const float* grad_scale)
//       first_step = (step <= 1): the momentum buffer starts as the first gradient.
//   lion_multi_<lp>(..., float lr, float beta1, float beta2, float weight_decay,
//                   const float* grad_scale)
//
//   clip_grad_scale(const double* sums, int n, const double* rule, float* grad_scale)
//       The engine's host arithmetic (backend/status.rs `ClipRule`), operation for operation,
//       in f64 like the host: s = -0.0 + sums[0] + ... + sums[n-1] in order; if s is not
//       finite *grad_scale = NaN (overflow: the step is skipped); else, with rule = {loss_scale,
//       clipping}, norm = sqrt((double)(float)s) / loss_scale, coef = clipping / (norm + 1e-6)
//       when clipping > 0 and norm > clipping (else 1), *grad_scale = (float)(coef / loss_scale).
//       Launch: one thread.
//
//   <lp> is f32 (no copy), bf16 or f16.
//
//   adam_bf16_state, sgd_bf16_state, lion_bf16_state: the same parameters, over bf16 parameters
//       and moments (`bf16_master_weights_and_grads` with `bf16_optimizer_states`; no copy: the
//       parameters are the master weights). Each value is widened, stepped in f32 as above, and
//       stored rounded to nearest even, as the CPU's host step (backend/cpu/optim_wide.rs) does.
//
//   Every element is computed with the reference's
//   operations in the reference's order, each rounded separately (__fmul_rn & co. are never
//   fused into FMAs), so results equal the CPU's bit for bit, whatever the chunking.

struct OptTensor {
  float* params;
  const void* grads;
  float* m;
  float* v;
  void* lp;
  long long n;
  long long first_chunk;
  long long grad_dtype;
};

// The tensor holding chunk c: the last one whose first_chunk <= c (binary search).
__device__ __forceinline__ int find_tensor(const OptTensor* t, int ntensors, long long c) {
  int lo = 0, hi = ntensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t[mid].first_chunk <= c)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// W elements at i: load (S widened to f32), update each with `up` (f32 in place), store (rounded
// to S), and write the low-precision copy of the new parameters.
template <int W, class S, class G, class LP, class Update>
__device__ __forceinline__ void update_pack(const Update& up, S* p, const G* g, S* m, S* v, LP* lp,
                                            long long i) {
  float pv[W], gv[W], mv[W] = {}, vv[W] = {};
  fz_load<W>(p + i, pv);
  fz_load<W>(g + i, gv);
  if (m) fz_load<W>(m + i, mv);
  if (v) fz_load<W>(v + i, vv);
#pragma unroll
  for (int k = 0; k < W; ++k) up(pv[k], gv[k], mv[k], vv[k]);
  fz_store<W>(p + i, pv);
  if (m) fz_store<W>(m + i, mv);
  if (v) fz_store<W>(v + i, vv);
  if constexpr (sizeof(LP) == 2) {
    if (lp) fz_store<W>(lp + i, pv);
  }
}

// One chunk of `len` elements: 8 at a time with 16-byte vectors when its slices are aligned,
// then one by one.
template <class S, class G, class LP, class Update>
__device__ __forceinline__ void update_chunk(const Update& up, int chunk, S* p, const G* g, S* m,
                                             S* v, LP* lp, long long len) {
  constexpr int V = 8;
  const bool vec = chunk % V == 0 && fz_aligned16(p) && fz_aligned16(g) &&
                   (!m || fz_aligned16(m)) && (!v || fz_aligned16(v)) && (!lp || fz_aligned16(lp));
  long long done = 0;
  if (vec) {
    const long long packs = len / V;
    for (long long q = threadIdx.x; q < packs; q += blockDim.x)
      update_pack<V>(up, p, g, m, v, lp, q * V);
    done = packs * V;
  }
  for (long long i = done + threadIdx.x; i < len; i += blockDim.x)
    update_pack<1>(up, p, g, m, v, lp, i);
}

// Tensor t's gradients from element lo, read as G.
template <class G>
__device__ __forceinline__ const G* grads_at(const OptTensor& t, long long lo) {
  return static_cast<const G*>(t.grads) + lo;
}

// Runs `up` over every chunk of the launch, reading each tensor's gradients in their dtype and
// its parameters and moments as S.
template <class LP, class S, class Update>
__device__ __forceinline__ void for_each_chunk(const OptTensor* tensors, int ntensors,
                                               long long total_chunks, int chunk, bool needs_v,
                                               const Update& up) {
  for (long long c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    const OptTensor t = tensors[find_tensor(tensors, ntensors, c)];
    const long long lo = (c - t.first_chunk) * chunk;
    if (lo >= t.n) continue;  // only with an inconsistent first_chunk; never read past n
    const long long len = min(static_cast<long long>(chunk), t.n - lo);
    S* p = reinterpret_cast<S*>(t.params) + lo;
    S* m = t.m ? reinterpret_cast<S*>(t.m) + lo : nullptr;
    S* v = needs_v ? reinterpret_cast<S*>(t.v) + lo : nullptr;
    LP* lp = sizeof(LP) == 2 ? static_cast<LP*>(t.lp) : nullptr;  // _f32: no copy
    if (lp) lp += lo;
    switch (t.grad_dtype) {
      case 1: update_chunk(up, chunk, p, grads_at<bf16_t>(t, lo), m, v, lp, len); break;
      case 2: update_chunk(up, chunk, p, grads_at<f16_t>(t, lo), m, v, lp, len); break;
      case 3: update_chunk(up, chunk, p, grads_at<fz_as<float, float>>(t, lo), m, v, lp, len); break;
      case 4: update_chunk(up, chunk, p, grads_at<fz_as<float, bf16_t>>(t, lo), m, v, lp, len); break;
      case 5: update_chunk(up, chunk, p, grads_at<fz_as<float, f16_t>>(t, lo), m, v, lp, len); break;
      case 6: update_chunk(up, chunk, p, grads_at<fz_as<bf16_t, bf16_t>>(t, lo), m, v, lp, len); break;
      case 7: update_chunk(up, chunk, p, grads_at<fz_as<f16_t, f16_t>>(t, lo), m, v, lp, len); break;
      default: update_chunk(up, chunk, p, grads_at<float>(t, lo), m, v, lp, len);
    }
  }
}

// One element of each optimizer, operation for operation as reference.rs (each rounded).
struct AdamUpdate {
  float gs, beta1, omb1, beta2, omb2, eps, weight_decay, lr_wd, step_size, bc2_sqrt;
  int decoupled;
  __device__ __forceinline__ void operator()(float& p, float graw, float& m, float& v) const {
    float g = __fmul_rn(graw, gs);
    if (decoupled)
      p = __fsub_rn(p, __fmul_rn(lr_wd, p));
    else
      g = __fadd_rn(g, __fmul_rn(weight_decay, p));
    m = __fadd_rn(__fmul_rn(beta1, m), __fmul_rn(omb1, g));
    v = __fadd_rn(__fmul_rn(beta2, v), __fmul_rn(__fmul_rn(omb2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), bc2_sqrt), eps);
    p = __fsub_rn(p, __fdiv_rn(__fmul_rn(step_size, m), denom));
  }
};

struct SgdUpdate {
  float gs, lr, momentum, omd, weight_decay;
  int nesterov, first_step;
  __device__ __forceinline__ void operator()(float& p, float graw, float& buf, float&) const {
    float g = __fadd_rn(__fmul_rn(graw, gs), __fmul_rn(weight_decay, p));
    if (momentum != 0.0f) {
      const float b =
          first_step ? g : __fadd_rn(__fmul_rn(momentum, buf), __fmul_rn(omd, g));
      buf = b;
      g = nesterov ? __fadd_rn(g, __fmul_rn(momentum, b)) : b;
    }
    p = __fsub_rn(p, __fmul_rn(lr, g));
  }
};

struct LionUpdate {
  float gs, lr, lr_wd, beta1, omb1, beta2, omb2;
  __device__ __forceinline__ void operator()(float& p, float graw, float& m, float&) const {
    const float g = __fmul_rn(graw, gs);
    p = __fsub_rn(p, __fmul_rn(lr_wd, p));
    const float c = __fadd_rn(__fmul_rn(beta1, m), __fmul_rn(omb1, g));
    const float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
    p = __fsub_rn(p, __fmul_rn(lr, sign));
    m = __fadd_rn(__fmul_rn(beta2, m), __fmul_rn(omb2, g));
  }
};

template <class LP, class S = float>
__device__ __forceinline__ void adam_multi(const OptTensor* t, int ntensors,
                                           long long total_chunks, int chunk, float lr,
                                           float beta1, float beta2, float eps,
                                           float weight_decay, int decoupled, float step_size,
                                           float bc2_sqrt, const float* grad_scale) {
  if (*grad_scale != *grad_scale) return;  // skipped: the gradients overflowed
  // 1 - beta and lr * wd as the host computes them (f32, one rounding each).
  const AdamUpdate up{*grad_scale,  beta1, __fsub_rn(1.0f, beta1),      beta2,
                      __fsub_rn(1.0f, beta2), eps, weight_decay, __fmul_rn(lr, weight_decay),
                      step_size,    bc2_sqrt, decoupled};
  for_each_chunk<LP, S>(t, ntensors, total_chunks, chunk, true, up);
}

template <class LP, class S = float>
__device__ __forceinline__ void sgd_multi(const OptTensor* t, int ntensors,
                                          long long total_chunks, int chunk, float lr,
                                          float momentum, float dampening, float weight_decay,
                                          int nesterov, int first_step, const float* grad_scale) {
  if (*grad_scale != *grad_scale) return;
  const SgdUpdate up{*grad_scale, lr, momentum, __fsub_rn(1.0f, dampening), weight_decay,
                     nesterov, first_step};
  for_each_chunk<LP, S>(t, ntensors, total_chunks, chunk, false, up);
}

template <class LP, class S = float>
__device__ __forceinline__ void lion_multi(const OptTensor* t, int ntensors,
                                           long long total_chunks, int chunk, float lr,
                                           float beta1, float beta2, float weight_decay,
                                           const float* grad_scale) {
  if (*grad_scale != *grad_scale) return;
  const LionUpdate up{*grad_scale, lr, __fmul_rn(lr, weight_decay), beta1,
                      __fsub_rn(1.0f, beta1), beta2, __fsub_rn(1.0f, beta2)};
  for_each_chunk<LP, S>(t, ntensors, total_chunks, chunk, false, up);
}

// ---- LAMB (offload/src/optim/lamb.rs) ----------------------------------------------------------
//
//   lamb_moments(const OptTensor* t, int ntensors, long long total_chunks, int chunk,
//                float beta1, float beta2, float eps, int eps_inside, float weight_decay,
//                const float* grad_scale, double* sums)
//       Pass 1: m and v updated from g * grad_scale; chunk c's sums of squares of the weights
//       and of the update direction u = m / d + wd * w written to sums[2c], sums[2c + 1] (f64).
//       `chunk` must be the CPU's SUM_BLOCK (65536) and each tensor a run: then chunk c is the
//       CPU's block, and its sums follow the CPU's order: element i adds to lane i % 8 in
//       element order (eight threads, one lane each), the lanes added as
//       ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)); the host adds the blocks in order.
//   lamb_apply_<lp>(const OptTensor* t, int ntensors, long long total_chunks, int chunk,
//                   float eps, int eps_inside, float weight_decay, float scale)
//       Pass 2: u recomputed from m, v and w; w -= scale * u (scale = step_size * the tensor's
//       trust ratio, computed by the host as the CPU does); grads must point at the params.

struct LambDir {
  float eps, weight_decay;
  int eps_inside;
  __device__ __forceinline__ float operator()(float w, float m, float v) const {
    const float d = eps_inside ? __fsqrt_rn(__fadd_rn(v, eps)) : __fadd_rn(__fsqrt_rn(v), eps);
    return __fadd_rn(__fdiv_rn(m, d), __fmul_rn(weight_decay, w));
  }
};

struct LambMoments {
  float gs, beta1, omb1, beta2, omb2;
  __device__ __forceinline__ void operator()(float&, float graw, float& m, float& v) const {
    const float g = __fmul_rn(graw, gs);
    m = __fadd_rn(__fmul_rn(beta1, m), __fmul_rn(omb1, g));
    v = __fadd_rn(__fmul_rn(beta2, v), __fmul_rn(__fmul_rn(omb2, g), g));
  }
};

struct LambApply {
  LambDir dir;
  float scale;
  __device__ __forceinline__ void operator()(float& p, float, float& m, float& v) const {
    p = __fsub_rn(p, __fmul_rn(scale, dir(p, m, v)));
  }
};

// One chunk's grads read in their dtype, `up` applied to every element.
template <class Update>
__device__ __forceinline__ void lamb_chunk(const Update& up, const OptTensor& t, int chunk,
                                           long long lo, long long len) {
  float* p = t.params + lo;
  float* m = t.m + lo;
  float* v = t.v + lo;
  float* lp = nullptr;
  switch (t.grad_dtype) {
    case 1: update_chunk(up, chunk, p, grads_at<bf16_t>(t, lo), m, v, lp, len); break;
    case 2: update_chunk(up, chunk, p, grads_at<f16_t>(t, lo), m, v, lp, len); break;
    case 3: update_chunk(up, chunk, p, grads_at<fz_as<float, float>>(t, lo), m, v, lp, len); break;
    case 4: update_chunk(up, chunk, p, grads_at<fz_as<float, bf16_t>>(t, lo), m, v, lp, len); break;
    case 5: update_chunk(up, chunk, p, grads_at<fz_as<float, f16_t>>(t, lo), m, v, lp, len); break;
    case 6: update_chunk(up, chunk, p, grads_at<fz_as<bf16_t, bf16_t>>(t, lo), m, v, lp, len); break;
    case 7: update_chunk(up, chunk, p, grads_at<fz_as<f16_t, f16_t>>(t, lo), m, v, lp, len); break;
    default: update_chunk(up, chunk, p, grads_at<float>(t, lo), m, v, lp, len);
  }
}

extern "C" __global__ void lamb_moments(const OptTensor* t, int ntensors, long long total_chunks,
                                        int chunk, float beta1, float beta2, float eps,
                                        int eps_inside, float weight_decay,
                                        const float* grad_scale, double* sums) {
  __shared__ double lanes[16];
  const LambMoments up{*grad_scale, beta1, __fsub_rn(1.0f, beta1), beta2, __fsub_rn(1.0f, beta2)};
  const LambDir dir{eps, weight_decay, eps_inside};
  for (long long c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    const OptTensor tc = t[find_tensor(t, ntensors, c)];
    const long long lo = (c - tc.first_chunk) * chunk;
    if (lo >= tc.n) continue;
    const long long len = min(static_cast<long long>(chunk), tc.n - lo);
    lamb_chunk(up, tc, chunk, lo, len);
    __syncthreads();  // the chunk's moments, written by every thread, read by eight
    if (threadIdx.x < 8) {
      const float* p = tc.params + lo;
      const float* m = tc.m + lo;
      const float* v = tc.v + lo;
      double lw = 0.0, lu = 0.0;
      for (long long i = threadIdx.x; i < len; i += 8) {
        const double w = static_cast<double>(p[i]);
        const double u = static_cast<double>(dir(p[i], m[i], v[i]));
        lw = __dadd_rn(lw, __dmul_rn(w, w));
        lu = __dadd_rn(lu, __dmul_rn(u, u));
      }
      lanes[threadIdx.x] = lw;
      lanes[8 + threadIdx.x] = lu;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int k = 0; k < 2; ++k) {
        const double* l = lanes + 8 * k;
        sums[2 * c + k] = __dadd_rn(__dadd_rn(__dadd_rn(l[0], l[1]), __dadd_rn(l[2], l[3])),
                                    __dadd_rn(__dadd_rn(l[4], l[5]), __dadd_rn(l[6], l[7])));
      }
    }
    __syncthreads();  // the lanes are free for the next chunk
  }
}

template <class LP>
__device__ __forceinline__ void lamb_apply(const OptTensor* t, int ntensors,
                                           long long total_chunks, int chunk, float eps,
                                           int eps_inside, float weight_decay, float scale) {
  const LambApply up{{eps, weight_decay, eps_inside}, scale};
  for_each_chunk<LP, float>(t, ntensors, total_chunks, chunk, true, up);
}

// ---- instantiations ----------------------------------------------------------------------------

#define FZ_ADAM_PARAMS                                                                       \
  const OptTensor *t, int ntensors, long long total_chunks, int chunk, float lr, float beta1, \
      float beta2, float eps, float weight_decay, int decoupled, float step_size,            \
      float bc2_sqrt, const float *grad_scale
#define FZ_ADAM_ARGS                                                                       \
  t, ntensors, total_chunks, chunk, lr, beta1, beta2, eps, weight_decay, decoupled, step_size, \
      bc2_sqrt, grad_scale
#define FZ_SGD_PARAMS                                                                          \
  const OptTensor *t, int ntensors, long long total_chunks, int chunk, float lr, float momentum, \
      float dampening, float weight_decay, int nesterov, int first_step,                        \
      const float *grad_scale
#define FZ_SGD_ARGS                                                                      \
  t, ntensors, total_chunks, chunk, lr, momentum, dampening, weight_decay, nesterov, \
      first_step, grad_scale
#define FZ_LION_PARAMS                                                                      \
  const OptTensor *t, int ntensors, long long total_chunks, int chunk, float lr, float beta1, \
      float beta2, float weight_decay, const float *grad_scale
#define FZ_LION_ARGS \
  t, ntensors, total_chunks, chunk, lr, beta1, beta2, weight_decay, grad_scale

extern "C" __global__ void adam_multi_f32(FZ_ADAM_PARAMS) { adam_multi<float>(FZ_ADAM_ARGS); }
extern "C" __global__ void adam_multi_bf16(FZ_ADAM_PARAMS) { adam_multi<bf16_t>(FZ_ADAM_ARGS); }
extern "C" __global__ void adam_multi_f16(FZ_ADAM_PARAMS) { adam_multi<f16_t>(FZ_ADAM_ARGS); }

extern "C" __global__ void sgd_multi_f32(FZ_SGD_PARAMS) { sgd_multi<float>(FZ_SGD_ARGS); }
extern "C" __global__ void sgd_multi_bf16(FZ_SGD_PARAMS) { sgd_multi<bf16_t>(FZ_SGD_ARGS); }
extern "C" __global__ void sgd_multi_f16(FZ_SGD_PARAMS) { sgd_multi<f16_t>(FZ_SGD_ARGS); }

extern "C" __global__ void lion_multi_f32(FZ_LION_PARAMS) { lion_multi<float>(FZ_LION_ARGS); }
extern "C" __global__ void lion_multi_bf16(FZ_LION_PARAMS) { lion_multi<bf16_t>(FZ_LION_ARGS); }
extern "C" __global__ void lion_multi_f16(FZ_LION_PARAMS) { lion_multi<f16_t>(FZ_LION_ARGS); }

// bf16 parameters and moments: no low-precision copy (`float` as LP writes none).
extern "C" __global__ void adam_bf16_state(FZ_ADAM_PARAMS) { adam_multi<float, bf16_t>(FZ_ADAM_ARGS); }
extern "C" __global__ void sgd_bf16_state(FZ_SGD_PARAMS) { sgd_multi<float, bf16_t>(FZ_SGD_ARGS); }
extern "C" __global__ void lion_bf16_state(FZ_LION_PARAMS) { lion_multi<float, bf16_t>(FZ_LION_ARGS); }

#define FZ_LAMB_APPLY_PARAMS                                                                   \
  const OptTensor *t, int ntensors, long long total_chunks, int chunk, float eps, int eps_inside, \
      float weight_decay, float scale
#define FZ_LAMB_APPLY_ARGS t, ntensors, total_chunks, chunk, eps, eps_inside, weight_decay, scale
extern "C" __global__ void lamb_apply_f32(FZ_LAMB_APPLY_PARAMS) { lamb_apply<float>(FZ_LAMB_APPLY_ARGS); }
extern "C" __global__ void lamb_apply_bf16(FZ_LAMB_APPLY_PARAMS) { lamb_apply<bf16_t>(FZ_LAMB_APPLY_ARGS); }
extern "C" __global__ void lamb_apply_f16(FZ_LAMB_APPLY_PARAMS) { lamb_apply<f16_t>(FZ_LAMB_APPLY_ARGS); }

extern "C" __global__ void clip_grad_scale(const double* sums, int n, const double* rule,
                                           float* grad_scale) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double s = -0.0;
  for (int i = 0; i < n; ++i) s += sums[i];
  if (!isfinite(s)) {
    *grad_scale = __int_as_float(0x7fc00000);  // NaN: skip
    return;
  }
  const double loss_scale = rule[0], clipping = rule[1];
  const double norm = sqrt(static_cast<double>(static_cast<float>(s))) / loss_scale;
  const double coef = clipping > 0.0 && norm > clipping ? clipping / (norm + 1e-6) : 1.0;
  *grad_scale = static_cast<float>(coef / loss_scale);
}
