// norm.cu: LayerNorm and RMSNorm over the last dimension of [rows, dim] data.
//
// x, y, dy, dx, gamma, beta are T (_f32, _bf16, _f16); mean, rstd and parameter gradients f32.
// Semantics are the CPU backend's (backend/cpu/norm.rs): biased variance, rstd = 1/sqrt(var+eps).
//
//   layernorm_forward_T(const T* x, const T* gamma, const T* beta, T* y, float* mean,
//                       float* rstd, long long rows, int dim, float eps)
//       y = (x - mean) * rstd * gamma + beta; mean, rstd per row. All overwritten.
//   rmsnorm_forward_T(const T* x, const T* gamma, T* y, float* rstd, long long rows, int dim,
//                     float eps)
//       y = x * rstd * gamma, rstd = 1/sqrt(mean(x^2) + eps). All overwritten.
//     Launch: a warp per row; block = 32 * W threads (W warps, e.g. 256 threads), any grid
//     (rows beyond grid * W are strided over), e.g. ceil(rows / W) blocks.
//
//   layernorm_backward_T(const T* x, const T* gamma, const float* mean, const float* rstd,
//                        const T* dy, T* dx, float* partial, long long rows, int dim,
//                        int rows_per_chunk)
//       dx overwritten; partial[c][0][j] = sum over the rows of chunk c of dy * xhat and
//       partial[c][1][j] = sum of dy (the chunk's dgamma and dbeta), in row order.
//       Scratch: partial holds 2 * nchunks * dim floats, nchunks = ceil(rows / rows_per_chunk).
//   rmsnorm_backward_T(const T* x, const T* gamma, const float* rstd, const T* dy, T* dx,
//                      float* partial, long long rows, int dim, int rows_per_chunk)
//       dx overwritten; partial[c][j] = the chunk's dgamma, sum of dy * x * rstd in row order.
//       Scratch: nchunks * dim floats.
//     Launch: a block per chunk of rows, block a multiple of 32 threads (e.g. 256), grid
//     nchunks (a smaller grid strides over chunks; the result does not depend on it).
//   residual_layernorm_forward_T(const T* x, const T* residual, const T* gamma, const T* beta,
//                                T* sum, T* y, float* mean, float* rstd, long long rows,
//                                int dim, float eps)
//   residual_rmsnorm_forward_T(const T* x, const T* residual, const T* gamma, T* sum, T* y,
//                              float* rstd, long long rows, int dim, float eps)
//       A residual connection and the norm after it in one pass (llm.c's fused residual
//       forward): sum = round_T(x + residual) (residual null: sum = x, a copy), added in f32
//       and rounded once as add_assign_T does, then the norm of sum as above. All overwritten.
//     Launch: as the forward norms.
//   layernorm_backward_residual_T(const T* x, const T* gamma, const float* mean,
//                                 const float* rstd, const T* dy, const T* dresidual, T* dx,
//                                 float* partial, long long rows, int dim, int rows_per_chunk)
//   rmsnorm_backward_residual_T(const T* x, const T* gamma, const float* rstd, const T* dy,
//                               const T* dresidual, T* dx, float* partial, long long rows,
//                               int dim, int rows_per_chunk)
//       As the backward norms, with dx = round_T(round_T(norm's dx) + dresidual): the gradient
//       of the residual stream the norm reads, exactly the norm then add_assign_T.
//     Launch: as the backward norms.
//   norm_dparams_finalize(const float* partial, long long nchunks, int dim, float* dgamma,
//                         float* dbeta)
//       dgamma[j] += partial sums in chunk order (accumulated), likewise dbeta for LayerNorm;
//       dbeta null reads the RMSNorm layout. A thread per output element (dgamma's, then
//       dbeta's): 2 * dim threads for LayerNorm, dim for RMSNorm. Launch: any 1-D grid; small
//       blocks (e.g. 64 threads) spread the 2 * dim serial sums over many multiprocessors.
//
// Determinism: row statistics use a fixed warp butterfly; parameter gradients are summed per
// chunk in row order, then across chunks in chunk order, whatever the grid. With
// rows_per_chunk = 32 the order (and, in f32, every bit of dgamma and dbeta) is the CPU
// backend's, whose ROW_BLOCK is 32: per-chunk sums start from zero and are added to the
// accumulator chunk by chunk, without fused multiply-adds.

// Rows of a chunk handled together: one shared-memory slot per row for its statistics.
#define FZ_NORM_GROUP 32

template <class T>
__device__ __forceinline__ bool rows_vectorizable(int dim, const void* a, const void* b,
                                                  const void* c, const void* d) {
  return dim % fz_vec<T>::n == 0 && fz_aligned16(a) && fz_aligned16(b) && fz_aligned16(c) &&
         fz_aligned16(d);
}

// A value as T would store it.
template <class T>
__device__ __forceinline__ float fz_round_to(float v) {
  return to_f32(from_f32<T>(v));
}

// Whether the optional residual pointers keep a row vectorisable (null ones do).
template <class T>
__device__ __forceinline__ bool optional_aligned(const void* a, const void* b) {
  return (!a || fz_aligned16(a)) && (!b || fz_aligned16(b));
}

// Pack p of a row for a forward norm: x's, or with `sr` (the residual stream's row) x + the
// residual's rounded to T and stored in sr, which the norm's later passes read (the lane that
// wrote a pack reads it back, so no barrier is needed).
template <int V, class T>
__device__ __forceinline__ void residual_pack(const T* xr, const T* rr, T* sr, int p, int dim,
                                              bool vec, float (&v)[V]) {
  fz_load_row<V>(xr, p * V, dim, vec, v);
  if (!sr) return;
  if (rr) {
    float r[V];
    fz_load_row<V>(rr, p * V, dim, vec, r);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = fz_round_to<T>(v[k] + r[k]);
  }
  fz_store_row<V>(sr, p * V, dim, vec, v);
}

template <class T>
__device__ __forceinline__ void layernorm_forward(const T* x, const T* res, T* sum,
                                                  const T* gamma, const T* beta, T* y,
                                                  float* mean, float* rstd, long long rows,
                                                  int dim, float eps) {
  constexpr int V = fz_vec<T>::n;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const bool vec = rows_vectorizable<T>(dim, x, y, gamma, beta) && optional_aligned<T>(res, sum);
  const int packs = (dim + V - 1) / V;
  for (long long row = static_cast<long long>(blockIdx.x) * warps + (threadIdx.x >> 5); row < rows;
       row += static_cast<long long>(gridDim.x) * warps) {
    T* sr = sum ? sum + row * dim : nullptr;
    const T* rr = res ? res + row * dim : nullptr;
    // Two passes over the row (the second from cache): the mean first, then squared deviations,
    // which is exact where a one-pass E[x^2] - E[x]^2 would cancel.
    float s = 0.0f;
    for (int p = lane; p < packs; p += 32) {
      float v[V];
      residual_pack<V>(x + row * dim, rr, sr, p, dim, vec, v);
#pragma unroll
      for (int k = 0; k < V; ++k) s += v[k];  // zeros past the row's end add nothing
    }
    const T* xr = sr ? sr : x + row * dim;
    const float mu = fz_warp_sum(s) / static_cast<float>(dim);
    float q = 0.0f;
    for (int p = lane; p < packs; p += 32) {
      float v[V];
      fz_load_row<V>(xr, p * V, dim, vec, v);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float d = v[k] - mu;
        if (p * V + k < dim) q += d * d;
      }
    }
    const float var = fz_warp_sum(q) / static_cast<float>(dim);
    const float rs = 1.0f / sqrtf(var + eps);
    T* yr = y + row * dim;
    for (int p = lane; p < packs; p += 32) {
      float v[V], g[V], b[V];
      fz_load_row<V>(xr, p * V, dim, vec, v);
      fz_load_row<V>(gamma, p * V, dim, vec, g);
      fz_load_row<V>(beta, p * V, dim, vec, b);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = (v[k] - mu) * rs * g[k] + b[k];
      fz_store_row<V>(yr, p * V, dim, vec, v);
    }
    if (lane == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
  }
}

template <class T>
__device__ __forceinline__ void rmsnorm_forward(const T* x, const T* res, T* sum, const T* gamma,
                                                T* y, float* rstd, long long rows, int dim,
                                                float eps) {
  constexpr int V = fz_vec<T>::n;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const bool vec = rows_vectorizable<T>(dim, x, y, gamma, gamma) && optional_aligned<T>(res, sum);
  const int packs = (dim + V - 1) / V;
  for (long long row = static_cast<long long>(blockIdx.x) * warps + (threadIdx.x >> 5); row < rows;
       row += static_cast<long long>(gridDim.x) * warps) {
    T* sr = sum ? sum + row * dim : nullptr;
    const T* rr = res ? res + row * dim : nullptr;
    float q = 0.0f;
    for (int p = lane; p < packs; p += 32) {
      float v[V];
      residual_pack<V>(x + row * dim, rr, sr, p, dim, vec, v);
#pragma unroll
      for (int k = 0; k < V; ++k) q += v[k] * v[k];
    }
    const T* xr = sr ? sr : x + row * dim;
    const float rs = 1.0f / sqrtf(fz_warp_sum(q) / static_cast<float>(dim) + eps);
    T* yr = y + row * dim;
    for (int p = lane; p < packs; p += 32) {
      float v[V], g[V];
      fz_load_row<V>(xr, p * V, dim, vec, v);
      fz_load_row<V>(gamma, p * V, dim, vec, g);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = v[k] * rs * g[k];
      fz_store_row<V>(yr, p * V, dim, vec, v);
    }
    if (lane == 0) rstd[row] = rs;
  }
}

// dx (pack p of a row) plus the residual stream's other gradient, when there is one: dx rounded
// to T first, as a stored dx that add_assign_T then reads.
template <int V, class T>
__device__ __forceinline__ void add_residual_grad(const T* dres, long long row, int p, int dim,
                                                  bool vec, float (&dx)[V]) {
  if (!dres) return;
  float r[V];
  fz_load_row<V>(dres + row * dim, p * V, dim, vec, r);
#pragma unroll
  for (int k = 0; k < V; ++k) dx[k] = fz_round_to<T>(dx[k]) + r[k];
}

// LayerNorm backward for one block's chunks. Rows go in groups of FZ_NORM_GROUP: first a warp
// per row reduces mean(dy*gamma) and mean(dy*gamma*xhat) into shared memory, then a thread per
// pack of columns walks the group's rows in order, writing dx and adding to the chunk's
// parameter-gradient partials (kept in the partial buffer between groups; a column always
// belongs to the same thread, so there is no race).
template <class T>
__device__ __forceinline__ void layernorm_backward(const T* x, const T* gamma, const float* mean,
                                                   const float* rstd, const T* dy, const T* dres,
                                                   T* dx, float* partial, long long rows, int dim,
                                                   int rows_per_chunk) {
  __shared__ float s_m1[FZ_NORM_GROUP], s_m2[FZ_NORM_GROUP];
  constexpr int V = fz_vec<T>::n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const bool vec = rows_vectorizable<T>(dim, x, gamma, dy, dx) && fz_aligned16(partial) &&
                   optional_aligned<T>(dres, nullptr);
  const int packs = (dim + V - 1) / V;
  const float fdim = static_cast<float>(dim);
  const long long nchunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  for (long long c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const long long r0 = c * rows_per_chunk;
    const long long r1 = min(r0 + rows_per_chunk, rows);
    float* pg = partial + c * 2 * dim;
    float* pb = pg + dim;
    for (long long g0 = r0; g0 < r1; g0 += FZ_NORM_GROUP) {
      const int gn = static_cast<int>(min(static_cast<long long>(FZ_NORM_GROUP), r1 - g0));
      for (int r = warp; r < gn; r += warps) {
        const long long row = g0 + r;
        const float mu = mean[row], rs = rstd[row];
        float s1 = 0.0f, s2 = 0.0f;
        for (int p = lane; p < packs; p += 32) {
          float xv[V], d[V], g[V];
          fz_load_row<V>(x + row * dim, p * V, dim, vec, xv);
          fz_load_row<V>(dy + row * dim, p * V, dim, vec, d);
          fz_load_row<V>(gamma, p * V, dim, vec, g);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const float xh = (xv[k] - mu) * rs;
            const float dg = d[k] * g[k];  // zero past the row's end
            s1 += dg;
            s2 += dg * xh;
          }
        }
        s1 = fz_warp_sum(s1);
        s2 = fz_warp_sum(s2);
        if (lane == 0) {
          s_m1[r] = s1 / fdim;
          s_m2[r] = s2 / fdim;
        }
      }
      __syncthreads();
      for (int p = threadIdx.x; p < packs; p += blockDim.x) {
        float acc_g[V], acc_b[V], g[V];
        if (g0 == r0) {
#pragma unroll
          for (int k = 0; k < V; ++k) acc_g[k] = acc_b[k] = 0.0f;
        } else {
          fz_load_row<V>(pg, p * V, dim, vec, acc_g);
          fz_load_row<V>(pb, p * V, dim, vec, acc_b);
        }
        fz_load_row<V>(gamma, p * V, dim, vec, g);
        for (int r = 0; r < gn; ++r) {
          const long long row = g0 + r;
          const float mu = mean[row], rs = rstd[row], m1 = s_m1[r], m2 = s_m2[r];
          float xv[V], d[V];
          fz_load_row<V>(x + row * dim, p * V, dim, vec, xv);
          fz_load_row<V>(dy + row * dim, p * V, dim, vec, d);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const float xh = __fmul_rn(__fsub_rn(xv[k], mu), rs);
            acc_g[k] = __fadd_rn(acc_g[k], __fmul_rn(d[k], xh));
            acc_b[k] = __fadd_rn(acc_b[k], d[k]);
            xv[k] = rs * (d[k] * g[k] - m1 - xh * m2);
          }
          add_residual_grad<V>(dres, row, p, dim, vec, xv);
          fz_store_row<V>(dx + row * dim, p * V, dim, vec, xv);
        }
        fz_store_row<V>(pg, p * V, dim, vec, acc_g);
        fz_store_row<V>(pb, p * V, dim, vec, acc_b);
      }
      __syncthreads();  // the next group rewrites s_m1/s_m2
    }
  }
}

// RMSNorm backward: as LayerNorm's, with one row statistic c = rstd^3 * mean(dy*gamma*x):
// dx = dy * gamma * rstd - x * c.
template <class T>
__device__ __forceinline__ void rmsnorm_backward(const T* x, const T* gamma, const float* rstd,
                                                 const T* dy, const T* dres, T* dx,
                                                 float* partial, long long rows, int dim,
                                                 int rows_per_chunk) {
  __shared__ float s_c[FZ_NORM_GROUP];
  constexpr int V = fz_vec<T>::n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const bool vec = rows_vectorizable<T>(dim, x, gamma, dy, dx) && fz_aligned16(partial) &&
                   optional_aligned<T>(dres, nullptr);
  const int packs = (dim + V - 1) / V;
  const float fdim = static_cast<float>(dim);
  const long long nchunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  for (long long c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const long long r0 = c * rows_per_chunk;
    const long long r1 = min(r0 + rows_per_chunk, rows);
    float* pg = partial + c * dim;
    for (long long g0 = r0; g0 < r1; g0 += FZ_NORM_GROUP) {
      const int gn = static_cast<int>(min(static_cast<long long>(FZ_NORM_GROUP), r1 - g0));
      for (int r = warp; r < gn; r += warps) {
        const long long row = g0 + r;
        float s = 0.0f;
        for (int p = lane; p < packs; p += 32) {
          float xv[V], d[V], g[V];
          fz_load_row<V>(x + row * dim, p * V, dim, vec, xv);
          fz_load_row<V>(dy + row * dim, p * V, dim, vec, d);
          fz_load_row<V>(gamma, p * V, dim, vec, g);
#pragma unroll
          for (int k = 0; k < V; ++k) s += d[k] * g[k] * xv[k];
        }
        s = fz_warp_sum(s);
        const float rs = rstd[row];
        if (lane == 0) s_c[r] = s * rs * rs * rs / fdim;
      }
      __syncthreads();
      for (int p = threadIdx.x; p < packs; p += blockDim.x) {
        float acc_g[V], g[V];
        if (g0 == r0) {
#pragma unroll
          for (int k = 0; k < V; ++k) acc_g[k] = 0.0f;
        } else {
          fz_load_row<V>(pg, p * V, dim, vec, acc_g);
        }
        fz_load_row<V>(gamma, p * V, dim, vec, g);
        for (int r = 0; r < gn; ++r) {
          const long long row = g0 + r;
          const float rs = rstd[row], cr = s_c[r];
          float xv[V], d[V];
          fz_load_row<V>(x + row * dim, p * V, dim, vec, xv);
          fz_load_row<V>(dy + row * dim, p * V, dim, vec, d);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            acc_g[k] = __fadd_rn(acc_g[k], __fmul_rn(__fmul_rn(d[k], xv[k]), rs));
            xv[k] = d[k] * g[k] * rs - xv[k] * cr;
          }
          add_residual_grad<V>(dres, row, p, dim, vec, xv);
          fz_store_row<V>(dx + row * dim, p * V, dim, vec, xv);
        }
        fz_store_row<V>(pg, p * V, dim, vec, acc_g);
      }
      __syncthreads();  // the next group rewrites s_c
    }
  }
}

// ---- instantiations ----------------------------------------------------------------------------

extern "C" __global__ void layernorm_forward_f32(const float* x, const float* gamma,
                                                 const float* beta, float* y, float* mean,
                                                 float* rstd, long long rows, int dim, float eps) {
  layernorm_forward<float>(x, nullptr, nullptr, gamma, beta, y, mean, rstd, rows, dim, eps);
}
extern "C" __global__ void layernorm_forward_bf16(const bf16_t* x, const bf16_t* gamma,
                                                  const bf16_t* beta, bf16_t* y, float* mean,
                                                  float* rstd, long long rows, int dim,
                                                  float eps) {
  layernorm_forward<bf16_t>(x, nullptr, nullptr, gamma, beta, y, mean, rstd, rows, dim, eps);
}
extern "C" __global__ void layernorm_forward_f16(const f16_t* x, const f16_t* gamma,
                                                 const f16_t* beta, f16_t* y, float* mean,
                                                 float* rstd, long long rows, int dim, float eps) {
  layernorm_forward<f16_t>(x, nullptr, nullptr, gamma, beta, y, mean, rstd, rows, dim, eps);
}

extern "C" __global__ void layernorm_backward_f32(const float* x, const float* gamma,
                                                  const float* mean, const float* rstd,
                                                  const float* dy, float* dx, float* partial,
                                                  long long rows, int dim, int rows_per_chunk) {
  layernorm_backward<float>(x, gamma, mean, rstd, dy, nullptr, dx, partial, rows, dim,
                           rows_per_chunk);
}
extern "C" __global__ void layernorm_backward_bf16(const bf16_t* x, const bf16_t* gamma,
                                                   const float* mean, const float* rstd,
                                                   const bf16_t* dy, bf16_t* dx, float* partial,
                                                   long long rows, int dim, int rows_per_chunk) {
  layernorm_backward<bf16_t>(x, gamma, mean, rstd, dy, nullptr, dx, partial, rows, dim,
                            rows_per_chunk);
}
extern "C" __global__ void layernorm_backward_f16(const f16_t* x, const f16_t* gamma,
                                                  const float* mean, const float* rstd,
                                                  const f16_t* dy, f16_t* dx, float* partial,
                                                  long long rows, int dim, int rows_per_chunk) {
  layernorm_backward<f16_t>(x, gamma, mean, rstd, dy, nullptr, dx, partial, rows, dim,
                           rows_per_chunk);
}

extern "C" __global__ void rmsnorm_forward_f32(const float* x, const float* gamma, float* y,
                                               float* rstd, long long rows, int dim, float eps) {
  rmsnorm_forward<float>(x, nullptr, nullptr, gamma, y, rstd, rows, dim, eps);
}
extern "C" __global__ void rmsnorm_forward_bf16(const bf16_t* x, const bf16_t* gamma, bf16_t* y,
                                                float* rstd, long long rows, int dim, float eps) {
  rmsnorm_forward<bf16_t>(x, nullptr, nullptr, gamma, y, rstd, rows, dim, eps);
}
extern "C" __global__ void rmsnorm_forward_f16(const f16_t* x, const f16_t* gamma, f16_t* y,
                                               float* rstd, long long rows, int dim, float eps) {
  rmsnorm_forward<f16_t>(x, nullptr, nullptr, gamma, y, rstd, rows, dim, eps);
}

extern "C" __global__ void rmsnorm_backward_f32(const float* x, const float* gamma,
                                                const float* rstd, const float* dy, float* dx,
                                                float* partial, long long rows, int dim,
                                                int rows_per_chunk) {
  rmsnorm_backward<float>(x, gamma, rstd, dy, nullptr, dx, partial, rows, dim, rows_per_chunk);
}
extern "C" __global__ void rmsnorm_backward_bf16(const bf16_t* x, const bf16_t* gamma,
                                                 const float* rstd, const bf16_t* dy, bf16_t* dx,
                                                 float* partial, long long rows, int dim,
                                                 int rows_per_chunk) {
  rmsnorm_backward<bf16_t>(x, gamma, rstd, dy, nullptr, dx, partial, rows, dim, rows_per_chunk);
}
extern "C" __global__ void rmsnorm_backward_f16(const f16_t* x, const f16_t* gamma,
                                                const float* rstd, const f16_t* dy, f16_t* dx,
                                                float* partial, long long rows, int dim,
                                                int rows_per_chunk) {
  rmsnorm_backward<f16_t>(x, gamma, rstd, dy, nullptr, dx, partial, rows, dim, rows_per_chunk);
}

extern "C" __global__ void residual_layernorm_forward_f32(
    const float* x, const float* residual, const float* gamma, const float* beta, float* sum,
    float* y,
    float* mean, float* rstd, long long rows, int dim, float eps) {
  layernorm_forward(x, residual, sum, gamma, beta, y, mean, rstd, rows, dim, eps);
}
extern "C" __global__ void residual_rmsnorm_forward_f32(const float* x, const float* residual,
                                                      const float* gamma, float* sum, float* y,
                                                      float* rstd, long long rows, int dim,
                                                      float eps) {
  rmsnorm_forward(x, residual, sum, gamma, y, rstd, rows, dim, eps);
}
extern "C" __global__ void layernorm_backward_residual_f32(
    const float* x, const float* gamma, const float* mean, const float* rstd, const float* dy,
    const float* dresidual, float* dx, float* partial, long long rows, int dim,
    int rows_per_chunk) {
  layernorm_backward(x, gamma, mean, rstd, dy, dresidual, dx, partial, rows, dim, rows_per_chunk);
}
extern "C" __global__ void rmsnorm_backward_residual_f32(
    const float* x, const float* gamma, const float* rstd, const float* dy, const float* dresidual,
    float* dx, float* partial, long long rows, int dim, int rows_per_chunk) {
  rmsnorm_backward(x, gamma, rstd, dy, dresidual, dx, partial, rows, dim, rows_per_chunk);
}

extern "C" __global__ void residual_layernorm_forward_bf16(
    const bf16_t* x, const bf16_t* residual, const bf16_t* gamma, const bf16_t* beta, bf16_t* sum,
    bf16_t* y,
    float* mean, float* rstd, long long rows, int dim, float eps) {
  layernorm_forward(x, residual, sum, gamma, beta, y, mean, rstd, rows, dim, eps);
}
extern "C" __global__ void residual_rmsnorm_forward_bf16(const bf16_t* x, const bf16_t* residual,
                                                      const bf16_t* gamma, bf16_t* sum, bf16_t* y,
                                                      float* rstd, long long rows, int dim,
                                                      float eps) {
  rmsnorm_forward(x, residual, sum, gamma, y, rstd, rows, dim, eps);
}
extern "C" __global__ void layernorm_backward_residual_bf16(
    const bf16_t* x, const bf16_t* gamma, const float* mean, const float* rstd, const bf16_t* dy,
    const bf16_t* dresidual, bf16_t* dx, float* partial, long long rows, int dim,
    int rows_per_chunk) {
  layernorm_backward(x, gamma, mean, rstd, dy, dresidual, dx, partial, rows, dim, rows_per_chunk);
}
extern "C" __global__ void rmsnorm_backward_residual_bf16(
    const bf16_t* x, const bf16_t* gamma, const float* rstd, const bf16_t* dy,
    const bf16_t* dresidual,
    bf16_t* dx, float* partial, long long rows, int dim, int rows_per_chunk) {
  rmsnorm_backward(x, gamma, rstd, dy, dresidual, dx, partial, rows, dim, rows_per_chunk);
}

extern "C" __global__ void residual_layernorm_forward_f16(
    const f16_t* x, const f16_t* residual, const f16_t* gamma, const f16_t* beta, f16_t* sum,
    f16_t* y,
    float* mean, float* rstd, long long rows, int dim, float eps) {
  layernorm_forward(x, residual, sum, gamma, beta, y, mean, rstd, rows, dim, eps);
}
extern "C" __global__ void residual_rmsnorm_forward_f16(const f16_t* x, const f16_t* residual,
                                                      const f16_t* gamma, f16_t* sum, f16_t* y,
                                                      float* rstd, long long rows, int dim,
                                                      float eps) {
  rmsnorm_forward(x, residual, sum, gamma, y, rstd, rows, dim, eps);
}
extern "C" __global__ void layernorm_backward_residual_f16(
    const f16_t* x, const f16_t* gamma, const float* mean, const float* rstd, const f16_t* dy,
    const f16_t* dresidual, f16_t* dx, float* partial, long long rows, int dim,
    int rows_per_chunk) {
  layernorm_backward(x, gamma, mean, rstd, dy, dresidual, dx, partial, rows, dim, rows_per_chunk);
}
extern "C" __global__ void rmsnorm_backward_residual_f16(
    const f16_t* x, const f16_t* gamma, const float* rstd, const f16_t* dy, const f16_t* dresidual,
    f16_t* dx, float* partial, long long rows, int dim, int rows_per_chunk) {
  rmsnorm_backward(x, gamma, rstd, dy, dresidual, dx, partial, rows, dim, rows_per_chunk);
}

// The sum over chunks is serial per element (the CPU's order, hence its bits); eight
// independent loads at a time keep it from waiting on memory once per chunk (on an H200 a
// GPT-2 step's 25 calls take 0.74 ms; 32 at a time took twice that).
extern "C" __global__ void norm_dparams_finalize(const float* partial, long long nchunks, int dim,
                                                 float* dgamma, float* dbeta) {
  const long long stride = dbeta ? 2ll * dim : static_cast<long long>(dim);
  const long long outputs = dbeta ? 2ll * dim : static_cast<long long>(dim);
  for (long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; t < outputs;
       t += static_cast<long long>(gridDim.x) * blockDim.x) {
    // t < dim: dgamma[t] from column t of each chunk; else dbeta[t - dim] from column t.
    float* out = t < dim ? dgamma + t : dbeta + (t - dim);
    const float* p = partial + t;
    float acc = *out;
    long long c = 0;
    for (; c + 8 <= nchunks; c += 8) {
      float v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = p[(c + u) * stride];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc = __fadd_rn(acc, v[u]);
    }
    for (; c < nchunks; ++c) acc = __fadd_rn(acc, p[c * stride]);
    *out = acc;
  }
}
