// rope.cu: rotary position embedding in place, Hugging Face's rotate-half convention.
//
//   rope_T(T* x, const float* cos_sin, long long rows, int seq, int heads, int head_dim,
//          int inverse)
//       x is [rows, heads * head_dim] (T = float, bf16_t, f16_t), rows = batch * seq, the
//       position of row r is r % seq. In every head, element i pairs with i + head_dim / 2:
//         lo' = lo * cos - hi * sin,  hi' = hi * cos + lo * sin
//       rotating by +theta * pos, or by -theta * pos when `inverse` (the backward of forward).
//       cos_sin is [seq][head_dim / 2][2] f32 (cos, sin) for +theta, built once by the host in
//       f64 and rounded, exactly as backend/cpu/rope.rs builds its table: the kernel computes
//       with the same f32 values and without fused multiply-adds, so f32 results are
//       bit-identical to the CPU backend's.
//   rope_qk_T(T* q, T* k, const float* cos_sin, long long rows, int seq, int q_heads,
//             int k_heads, int head_dim, int inverse)
//       rope_T on queries [rows, q_heads * head_dim] and keys [rows, k_heads * head_dim] of the
//       same rows in one launch (a row's items are q's heads, then k's), the same arithmetic.
//     Launch: a 2-D block, threadIdx.x over a row's packs of pairs (heads * head_dim / 2 /
//     (16 / sizeof(T)) of them when vectorised), threadIdx.y over rows, e.g. block
//     (32, 8) for 64-wide heads; grid ceil(rows / blockDim.y), or fewer (blocks stride over
//     rows).

// Rotates pairs i .. i+W-1 of one head (W pairs per 16-byte vector, or 1).
template <int W, class T>
__device__ __forceinline__ void rotate(T* head, int half, const float* cs, int i, int inverse) {
  float lo[W], hi[W], t[2 * W];
  fz_load<W>(head + i, lo);
  fz_load<W>(head + half + i, hi);
  fz_load<2 * W>(cs + 2 * i, t);
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const float c = t[2 * k], s = inverse ? -t[2 * k + 1] : t[2 * k + 1];
    const float a = lo[k], b = hi[k];
    lo[k] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    hi[k] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
  fz_store<W>(head + i, lo);
  fz_store<W>(head + half + i, hi);
}

// Rotates q's q_heads and k's k_heads heads of every row (k null with k_heads 0: q alone).
template <class T>
__device__ __forceinline__ void rope(T* q, int q_heads, T* k, int k_heads, const float* cos_sin,
                                     long long rows, int seq, int head_dim, int inverse) {
  constexpr int V = fz_vec<T>::n;
  const int half = head_dim / 2;
  const bool vec =
      half % V == 0 && fz_aligned16(q) && (!k || fz_aligned16(k)) && fz_aligned16(cos_sin);
  const int units = vec ? half / V : half;  // per head: packs of V pairs, or single pairs
  const int items = (q_heads + k_heads) * units;
  for (long long row = static_cast<long long>(blockIdx.x) * blockDim.y + threadIdx.y; row < rows;
       row += static_cast<long long>(gridDim.x) * blockDim.y) {
    T* qr = q + row * q_heads * head_dim;
    T* kr = k ? k + row * k_heads * head_dim : nullptr;
    const float* cs = cos_sin + (row % seq) * half * 2;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
      const int h = it / units, u = it % units;
      T* head = h < q_heads ? qr + h * head_dim : kr + (h - q_heads) * head_dim;
      if (vec)
        rotate<V>(head, half, cs, u * V, inverse);
      else
        rotate<1>(head, half, cs, u, inverse);
    }
  }
}

extern "C" __global__ void rope_f32(float* x, const float* cos_sin, long long rows, int seq,
                                    int heads, int head_dim, int inverse) {
  rope<float>(x, heads, nullptr, 0, cos_sin, rows, seq, head_dim, inverse);
}
extern "C" __global__ void rope_bf16(bf16_t* x, const float* cos_sin, long long rows, int seq,
                                     int heads, int head_dim, int inverse) {
  rope<bf16_t>(x, heads, nullptr, 0, cos_sin, rows, seq, head_dim, inverse);
}
extern "C" __global__ void rope_f16(f16_t* x, const float* cos_sin, long long rows, int seq,
                                    int heads, int head_dim, int inverse) {
  rope<f16_t>(x, heads, nullptr, 0, cos_sin, rows, seq, head_dim, inverse);
}
extern "C" __global__ void rope_qk_f32(float* q, float* k, const float* cos_sin, long long rows,
                                       int seq, int q_heads, int k_heads, int head_dim,
                                       int inverse) {
  rope(q, q_heads, k, k_heads, cos_sin, rows, seq, head_dim, inverse);
}
extern "C" __global__ void rope_qk_bf16(bf16_t* q, bf16_t* k, const float* cos_sin, long long rows,
                                       int seq, int q_heads, int k_heads, int head_dim,
                                       int inverse) {
  rope(q, q_heads, k, k_heads, cos_sin, rows, seq, head_dim, inverse);
}
extern "C" __global__ void rope_qk_f16(f16_t* q, f16_t* k, const float* cos_sin, long long rows,
                                       int seq, int q_heads, int k_heads, int head_dim,
                                       int inverse) {
  rope(q, q_heads, k, k_heads, cos_sin, rows, seq, head_dim, inverse);
}
