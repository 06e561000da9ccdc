// embed.cu: token and position embeddings, forward and deterministic backward.
//
// Tables and outputs are T (_f32, _bf16, _f16) except the gradients of tables, which are f32.
// Token ids are `int`. Rows are `dim` wide; 16-byte vectors are used when dim is a multiple of
// 16 / sizeof(T) and the buffers are aligned.
//
//   embedding_forward_T(const int* tokens, const T* table, T* out, long long rows, int dim,
//                       long long vocab, int accumulate, int* bad)
//       out[r] = table[tokens[r]] (accumulate = 0) or out[r] += table[tokens[r]] (1). A token
//       outside [0, vocab) never reads the table: its row is zeroed (or left alone when
//       accumulating) and *bad is set to 1 (the host zeroes it first and reads it when it likes).
//   position_forward_T(const T* wpe, T* out, long long rows, int seq, int dim)
//       out[r] += wpe[r % seq] (rows = batch * seq).
//     Launch (both): a warp per row, block 32 * W threads, any grid (rows are strided over),
//     e.g. ceil(rows / W) blocks.
//
//   embedding_backward_T(const T* dout, const int* uniq, const int* offsets,
//                        const int* positions, float* dtable, int n_uniq, int dim,
//                        long long vocab, int* bad)
//       dtable[uniq[u]] += dout[p] for p in positions[offsets[u] .. offsets[u+1]], in that order
//       (accumulated). The host builds this CSR from the batch's tokens (which it has): the
//       distinct ids, and for each the positions where it occurs, in increasing order; then the
//       sum order per table row is the CPU backend's serial scatter in position order, so f32
//       results are bit-identical to it. An id outside [0, vocab) is skipped and sets *bad.
//     Launch: a block per distinct token (grid n_uniq, or fewer: blocks stride over tokens),
//     block e.g. 128 threads (a thread per 16-byte pack of the row).
//   position_backward_T(const T* dout, float* dwpe, long long batch, int seq, int dim)
//       dwpe[t] += dout[b, t] for b = 0, 1, ... in order (accumulated), the CPU's order.
//     Launch: any 1-D grid, a thread per (position, pack of columns), e.g. 256 threads and
//     ceil(seq * ceil(dim / (16 / sizeof(T))) / 256) blocks.

template <class T>
__device__ __forceinline__ void embedding_forward(const int* tokens, const T* table, T* out,
                                                  long long rows, int dim, long long vocab,
                                                  int accumulate, int* bad) {
  constexpr int V = fz_vec<T>::n;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const bool vec = dim % V == 0 && fz_aligned16(table) && fz_aligned16(out);
  const int packs = (dim + V - 1) / V;
  for (long long row = static_cast<long long>(blockIdx.x) * warps + (threadIdx.x >> 5); row < rows;
       row += static_cast<long long>(gridDim.x) * warps) {
    const int tok = tokens[row];
    T* o = out + row * dim;
    const bool valid = tok >= 0 && tok < vocab;
    if (!valid && lane == 0) atomicOr(bad, 1);
    if (!valid && accumulate) continue;
    const T* src = table + static_cast<long long>(valid ? tok : 0) * dim;
    for (int p = lane; p < packs; p += 32) {
      float v[V];
      if (valid) {
        fz_load_row<V>(src, p * V, dim, vec, v);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = 0.0f;
      }
      if (accumulate) {
        float a[V];
        fz_load_row<V>(o, p * V, dim, vec, a);
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = a[k] + v[k];
      }
      fz_store_row<V>(o, p * V, dim, vec, v);
    }
  }
}

template <class T>
__device__ __forceinline__ void position_forward(const T* wpe, T* out, long long rows, int seq,
                                                 int dim) {
  constexpr int V = fz_vec<T>::n;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const bool vec = dim % V == 0 && fz_aligned16(wpe) && fz_aligned16(out);
  const int packs = (dim + V - 1) / V;
  for (long long row = static_cast<long long>(blockIdx.x) * warps + (threadIdx.x >> 5); row < rows;
       row += static_cast<long long>(gridDim.x) * warps) {
    const T* src = wpe + (row % seq) * dim;
    T* o = out + row * dim;
    for (int p = lane; p < packs; p += 32) {
      float a[V], b[V];
      fz_load_row<V>(o, p * V, dim, vec, a);
      fz_load_row<V>(src, p * V, dim, vec, b);
#pragma unroll
      for (int k = 0; k < V; ++k) a[k] += b[k];
      fz_store_row<V>(o, p * V, dim, vec, a);
    }
  }
}

template <class T>
__device__ __forceinline__ void embedding_backward(const T* dout, const int* uniq,
                                                   const int* offsets, const int* positions,
                                                   float* dtable, int n_uniq, int dim,
                                                   long long vocab, int* bad) {
  constexpr int V = fz_vec<T>::n;
  const bool vec = dim % V == 0 && fz_aligned16(dout) && fz_aligned16(dtable);
  const int packs = (dim + V - 1) / V;
  for (int u = blockIdx.x; u < n_uniq; u += gridDim.x) {
    const int tok = uniq[u];
    if (tok < 0 || tok >= vocab) {
      if (threadIdx.x == 0) atomicOr(bad, 1);
      continue;
    }
    float* drow = dtable + static_cast<long long>(tok) * dim;
    const int begin = offsets[u], end = offsets[u + 1];
    for (int p = threadIdx.x; p < packs; p += blockDim.x) {
      float acc[V];
      fz_load_row<V>(drow, p * V, dim, vec, acc);
      for (int i = begin; i < end; ++i) {
        float g[V];
        fz_load_row<V>(dout + static_cast<long long>(positions[i]) * dim, p * V, dim, vec, g);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += g[k];
      }
      fz_store_row<V>(drow, p * V, dim, vec, acc);
    }
  }
}

template <class T>
__device__ __forceinline__ void position_backward(const T* dout, float* dwpe, long long batch,
                                                  int seq, int dim) {
  constexpr int V = fz_vec<T>::n;
  const bool vec = dim % V == 0 && fz_aligned16(dout) && fz_aligned16(dwpe);
  const int packs = (dim + V - 1) / V;
  const long long total = static_cast<long long>(seq) * packs;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(i / packs), p = static_cast<int>(i % packs);
    float acc[V];
    fz_load_row<V>(dwpe + static_cast<long long>(t) * dim, p * V, dim, vec, acc);
    for (long long b = 0; b < batch; ++b) {
      float g[V];
      fz_load_row<V>(dout + (b * seq + t) * dim, p * V, dim, vec, g);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += g[k];
    }
    fz_store_row<V>(dwpe + static_cast<long long>(t) * dim, p * V, dim, vec, acc);
  }
}

// ---- instantiations ----------------------------------------------------------------------------

extern "C" __global__ void embedding_forward_f32(const int* tokens, const float* table,
                                                 float* out, long long rows, int dim,
                                                 long long vocab, int accumulate, int* bad) {
  embedding_forward(tokens, table, out, rows, dim, vocab, accumulate, bad);
}
extern "C" __global__ void embedding_forward_bf16(const int* tokens, const bf16_t* table,
                                                  bf16_t* out, long long rows, int dim,
                                                  long long vocab, int accumulate, int* bad) {
  embedding_forward(tokens, table, out, rows, dim, vocab, accumulate, bad);
}
extern "C" __global__ void embedding_forward_f16(const int* tokens, const f16_t* table,
                                                 f16_t* out, long long rows, int dim,
                                                 long long vocab, int accumulate, int* bad) {
  embedding_forward(tokens, table, out, rows, dim, vocab, accumulate, bad);
}

extern "C" __global__ void position_forward_f32(const float* wpe, float* out, long long rows,
                                                int seq, int dim) {
  position_forward(wpe, out, rows, seq, dim);
}
extern "C" __global__ void position_forward_bf16(const bf16_t* wpe, bf16_t* out, long long rows,
                                                 int seq, int dim) {
  position_forward(wpe, out, rows, seq, dim);
}
extern "C" __global__ void position_forward_f16(const f16_t* wpe, f16_t* out, long long rows,
                                                int seq, int dim) {
  position_forward(wpe, out, rows, seq, dim);
}

extern "C" __global__ void embedding_backward_f32(const float* dout, const int* uniq,
                                                  const int* offsets, const int* positions,
                                                  float* dtable, int n_uniq, int dim,
                                                  long long vocab, int* bad) {
  embedding_backward(dout, uniq, offsets, positions, dtable, n_uniq, dim, vocab, bad);
}
extern "C" __global__ void embedding_backward_bf16(const bf16_t* dout, const int* uniq,
                                                   const int* offsets, const int* positions,
                                                   float* dtable, int n_uniq, int dim,
                                                   long long vocab, int* bad) {
  embedding_backward(dout, uniq, offsets, positions, dtable, n_uniq, dim, vocab, bad);
}
extern "C" __global__ void embedding_backward_f16(const f16_t* dout, const int* uniq,
                                                  const int* offsets, const int* positions,
                                                  float* dtable, int n_uniq, int dim,
                                                  long long vocab, int* bad) {
  embedding_backward(dout, uniq, offsets, positions, dtable, n_uniq, dim, vocab, bad);
}

extern "C" __global__ void position_backward_f32(const float* dout, float* dwpe, long long batch,
                                                 int seq, int dim) {
  position_backward(dout, dwpe, batch, seq, dim);
}
extern "C" __global__ void position_backward_bf16(const bf16_t* dout, float* dwpe,
                                                  long long batch, int seq, int dim) {
  position_backward(dout, dwpe, batch, seq, dim);
}
extern "C" __global__ void position_backward_f16(const f16_t* dout, float* dwpe, long long batch,
                                                 int seq, int dim) {
  position_backward(dout, dwpe, batch, seq, dim);
}
