// attention.cu: causal scaled dot-product attention as flash attention (FlashAttention-2's
// algorithm), forward and a deterministic backward.
//
// Layout (backend/mod.rs: AttentionShape, RowView). B = batch sequences of S = seq tokens, Hq
// query heads, Hkv key/value heads (query head h reads kv head h / (Hq / Hkv)), head dim D.
// Q, K, V are strided row views: element d of head h of token s of sequence b is
//   q[(b*S + s) * q_stride + q_off + h*D + d]            (k, v likewise with their own stride/off)
// O and dO are [B*S, Hq*D] contiguous. dQ, dK, dV are written through the views of Q, K, V (the
// same strides and offsets, their own base pointers). lse and di are f32 [B][Hq][S].
// T is float, bf16_t or f16_t (suffix _f32, _bf16, _f16); all arithmetic is f32.
//
// Kernels. DP is the head dim padded to a tile width, DP in {32, 64, 96, 128} (infix _dDP);
// a kernel takes any head_dim <= DP (the host picks the smallest DP >= head_dim):
//
//   attention_forward_dDP_T(const T* q, const T* k, const T* v, T* out, float* lse,
//       long long q_stride, long long q_off, long long k_stride, long long k_off,
//       long long v_stride, long long v_off, int batch, int seq, int q_heads, int kv_heads,
//       int head_dim, float scale, unsigned long long seed, unsigned long long offset, float p)
//     out = dropout(softmax(scale * Q K^T + causal mask)) V and lse[b][h][s] =
//     log(sum_{s' <= s} exp(scale * q_s . k_s')) (natural log, before dropout), both
//     overwritten. Dropout (p > 0; p = 0 is none): probability (b, h, i, j) is kept, scaled
//     by 1 / (1 - p), when uniform_f32(seed, offset + ((b*Hq + h)*S + i)*S + j) >= p (64-bit
//     wrapping: offset is the engine's global index of sequence 0 times Hq*S*S, so a sequence's
//     mask does not depend on the batch it sits in), backend/rng.rs's generator in the same
//     integer arithmetic, so the CPU backend drops the same elements. The backward kernels
//     take the same seed, offset and p and regenerate the mask.
//   attention_bwd_dot_T(const T* out, const T* dout, float* di, int batch, int seq,
//       int q_heads, int head_dim)
//     di[b][h][s] = sum_d dout * out over the head's row (FlashAttention-2's D_i), overwritten.
//     Launch: a warp per (row, head): 256 threads, any grid (a grid stride covers the rest).
//   attention_bwd_dkdv_dDP_T(const T* q, const T* k, const T* v, const T* dout,
//       const float* lse, const float* di, T* dk, T* dv, long long q_stride, long long q_off,
//       long long k_stride, long long k_off, long long v_stride, long long v_off, int batch,
//       int seq, int q_heads, int kv_heads, int head_dim, float scale,
//       unsigned long long seed, unsigned long long offset, float p)
//     dK and dV of every kv head, overwritten: a block owns a tile of keys of one kv head and
//     accumulates over the group's query heads in order, and for each over the query tiles in
//     order (no atomics, no partial buffers).
//   attention_bwd_dq_dDP_T(const T* q, const T* k, const T* v, const T* dout,
//       const float* lse, const float* di, T* dq, long long q_stride, long long q_off,
//       long long k_stride, long long k_off, long long v_stride, long long v_off, int batch,
//       int seq, int q_heads, int kv_heads, int head_dim, float scale,
//       unsigned long long seed, unsigned long long offset, float p)
//     dQ, overwritten: a block owns a tile of query rows and loops over the key tiles in order.
//   Backward runs dot, then dkdv and dq (in either order: both read di and lse, neither writes
//   what the other reads).
//
// Memory: tiles move global -> shared as 16-byte cp.async copies when head_dim and every view's
// stride and offset are multiples of 16 bytes' worth of elements and all base pointers are
// 16-byte aligned (GPT-2's fused qkv and Llama's buffers at head dims 32..128); otherwise
// element by element (e.g. head_dim 5), with the same tiles and results.
//
// Launch shapes: 1-D grids; blockIdx.x = tile * (batch * heads) + (b * heads + h), heads being
// Hq for forward and dq, Hkv for dkdv. Forward and dq number their query tiles from the last
// (the longest causal rows start first). Tiles, threads and dynamic shared memory per kernel
// (mirrored by backend/cuda/attention.rs; a kernel traps when launched with other values):
//   bf16/f16, tensor cores (mma.sync m16n8k16, ldmatrix, cp.async double buffering); LD = DP + 8:
//     forward: FW warps, 16 query rows per warp (BM = 16 FW), key tiles of FN;
//              smem (BM + 4 FN) * LD * 2 bytes
//     dkdv:    KW warps, 16 keys per warp (BN = 16 KW), query tiles of KM;
//              smem (2 BN + 4 KM) * LD * 2 + 16 KM bytes
//     dq:      QW warps, 16 query rows per warp (BM = 16 QW), key tiles of QN;
//              smem (2 BM + 4 QN) * LD * 2 bytes
//     DP   FW FN   KW KM   QW QN   (blocks per SM the registers are bounded for: FB KB QB)
//     32    4 64    4 64    4 64    4 2 3
//     64    4 64    4 32    4 64    3 2 2
//     96    4 64    4 32    4 32    2 2 2
//     128   4 64    4 32    4 32    2 2 2
//   f32 (SIMT, exact f32 products and sums): 128 threads, 32 rows by 32 columns per tile, four
//   threads per row; LD = DP + 4; smem forward (5*32) * LD * 4 + 32*33*4, dkdv
//   (6*32) * LD * 4 + 4*32*4 + 2*32*33*4, dq (6*32) * LD * 4 + 32*33*4 bytes.
//
// Numerics: p = 2^(s * scale * log2 e - row max * scale * log2 e) as one fused multiply-add and
// one ex2.approx (fz_exp2_approx); the forward keeps a running maximum of the raw scores and a
// running sum per row (online softmax), backward recomputes P from lse; the probabilities P and
// dS = P (dP - di) are rounded to T for the tensor-core products, which accumulate in f32.
// Padding (rows past seq, head-dim columns past head_dim) is zero-filled in shared memory and
// never stored. Determinism: every sum runs in an order fixed by the shape and the launch
// shape, never by timing.

namespace attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The views and sizes of one call.
struct Geom {
  long long q_stride, q_off, k_stride, k_off, v_stride, v_off;
  int batch, seq, hq, hkv, d;
  float scale;
  unsigned long long mixed_seed;   // rng_mix(seed): the dropout stream
  unsigned long long drop_offset;  // the counter of probability (0, 0, 0, 0)
  float p, keep_scale;             // drop probability (0: none) and 1 / (1 - p)
};

// backend/rng.rs's mix64, in the same 64-bit integer arithmetic.
__device__ __forceinline__ unsigned long long rng_mix(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// What dropout multiplies probability (b, h, row, col) by: 0 where dropped, 1 / (1 - p) where
// kept. The draw is the CPU's (AttnDropout::keep), bit for bit, whatever the tile.
__device__ __forceinline__ float keep_factor(const Geom& g, int b, int h, int row, int col) {
  const unsigned long long t = static_cast<unsigned long long>(g.seq);
  const unsigned long long idx =
      g.drop_offset + ((static_cast<unsigned long long>(b) * g.hq + h) * t + row) * t + col;
  const unsigned long long bits = rng_mix(g.mixed_seed ^ (idx * 0xD1B54A32D192ED03ull));
  const float u = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
  return u >= g.p ? g.keep_scale : 0.0f;
}

template <class T>
__device__ __forceinline__ T zero() {
  return from_f32<T>(0.0f);
}

// Whether every row of every view starts on a 16-byte boundary and holds whole 16-byte chunks,
// so tiles move as 16-byte vectors (cp.async); else element by element.
template <class T>
__device__ __forceinline__ bool views_vectorizable(const Geom& g) {
  constexpr long long C = 16 / sizeof(T);
  return g.d % C == 0 && g.q_stride % C == 0 && g.q_off % C == 0 && g.k_stride % C == 0 &&
         g.k_off % C == 0 && g.v_stride % C == 0 && g.v_off % C == 0;
}

__device__ __forceinline__ bool aligned(const void* a, const void* b, const void* c,
                                        const void* d, const void* e, const void* f) {
  return fz_aligned16(a) && fz_aligned16(b) && fz_aligned16(c) && fz_aligned16(d) &&
         fz_aligned16(e) && fz_aligned16(f);
}

// A launch whose block size or dynamic shared memory differs from the kernel's tiles is a host
// bug: stop instead of computing garbage.
__device__ __forceinline__ void check_launch(int threads, unsigned smem) {
  if (static_cast<int>(blockDim.x * blockDim.y * blockDim.z) != threads ||
      fz_dynamic_smem_bytes() < smem)
    __trap();
}

// ---- tiles between global and shared memory --------------------------------------------------
// Rows [0, ROWS) of a block of head rows (row r at src + r * stride, `valid` rows exist, `d`
// elements each) into tile[ROWS][LD], zeros past `valid` rows and past column d up to DP. With
// `vec`, 16-byte cp.async copies (the caller commits and waits); else plain loads and stores,
// complete on return.
template <int ROWS, int DP, int LD, int THREADS, class T>
__device__ __forceinline__ void load_tile(T* tile, const T* src, long long stride, int valid,
                                          int d, bool vec) {
  if (vec) {
    constexpr int C = 16 / sizeof(T), CPR = DP / C, N = ROWS * CPR;
    const fz_smem_t sb = fz_smem(tile);
#pragma unroll
    for (int k = 0; k < (N + THREADS - 1) / THREADS; ++k) {
      const int i = static_cast<int>(threadIdx.x) + k * THREADS;
      if (N % THREADS == 0 || i < N) {
        const int r = i / CPR, c = (i % CPR) * C;
        const bool fill = r < valid && c < d;
        fz_cp_async16(sb + static_cast<unsigned>((r * LD + c) * sizeof(T)),
                      fill ? src + r * stride + c : src, fill);
      }
    }
  } else {
    for (int i = threadIdx.x; i < ROWS * DP; i += THREADS) {
      const int r = i / DP, c = i % DP;
      tile[r * LD + c] = r < valid && c < d ? src[r * stride + c] : zero<T>();
    }
  }
}

// tile[ROWS][LD] (rows < valid, columns < d) to global rows at dst + r * stride.
template <int ROWS, int DP, int LD, int THREADS, class T>
__device__ __forceinline__ void store_tile(const T* tile, T* dst, long long stride, int valid,
                                           int d, bool vec) {
  if (vec) {
    constexpr int C = 16 / sizeof(T), CPR = DP / C;
    for (int i = threadIdx.x; i < ROWS * CPR; i += THREADS) {
      const int r = i / CPR, c = (i % CPR) * C;
      if (r < valid && c < d)
        *reinterpret_cast<uint4*>(dst + r * stride + c) =
            *reinterpret_cast<const uint4*>(tile + r * LD + c);
    }
  } else {
    for (int i = threadIdx.x; i < ROWS * DP; i += THREADS) {
      const int r = i / DP, c = i % DP;
      if (r < valid && c < d) dst[r * stride + c] = tile[r * LD + c];
    }
  }
}

// ---- tensor-core helpers (bf16_t, f16_t) ------------------------------------------------------
template <class T>
struct Mma;
template <>
struct Mma<bf16_t> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4],
                                             unsigned b0, unsigned b1) {
    const unsigned b[2] = {b0, b1};
    fz_mma_m16n8k16_bf16(d, a, b, d);
  }
};
template <>
struct Mma<f16_t> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4],
                                             unsigned b0, unsigned b1) {
    const unsigned b[2] = {b0, b1};
    fz_mma_m16n8k16_f16(d, a, b, d);
  }
};

// Lane addresses for ldmatrix.x4 (g = lane >> 2, t = lane & 3 below):
// - a_row/a_col: the A fragment (16 rows x 16 columns at row0, col0) of a row-major tile.
// - b_row/b_col: B fragments of two n-tiles (rows n0..n0+15 of the tile are the n index, columns
//   k0..k0+15 the k index), non-transposed: r[0], r[1] = b0, b1 of n-tile n0, r[2], r[3] of
//   n0 + 8. (B[k][n] = tile[n][k]: keys as B of Q K^T.)
// - t_row/t_col: B fragments with the tile's rows as the k index (rows k0..k0+15, columns n0..
//   n0+15), transposed: r[0], r[1] = b0, b1 of n-tile n0, r[2], r[3] of n0 + 8. (B[k][n] =
//   tile[k][n]: values as B of P V.)
__device__ __forceinline__ int a_row(int lane) { return lane & 15; }
__device__ __forceinline__ int a_col(int lane) { return (lane >> 4) << 3; }
__device__ __forceinline__ int b_row(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
__device__ __forceinline__ int b_col(int lane) { return ((lane >> 3) & 1) << 3; }
__device__ __forceinline__ int t_row(int lane) { return (lane & 7) + (((lane >> 3) & 1) << 3); }
__device__ __forceinline__ int t_col(int lane) { return (lane >> 4) << 3; }

// The shared address of element (row, col) of a row-major tile with LD elements per row.
template <int LD, class T>
__device__ __forceinline__ fz_smem_t at(fz_smem_t tile, int row, int col) {
  return tile + static_cast<unsigned>((row * LD + col) * static_cast<int>(sizeof(T)));
}

// acc[NT][4] += A (16 x 16*KT, fragments a[KT]) times tile^T: n-tiles of 8 rows of a
// row-major [NT*8][LD] tile (the rows are the n index, the columns the k index).
template <class T, int NT, int KT, int LD>
__device__ __forceinline__ void mma_abt(float (&acc)[NT][4], const unsigned (&a)[KT][4],
                                        const T* tile, int lane) {
  const fz_smem_t base = at<LD, T>(fz_smem(tile), b_row(lane), b_col(lane));
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
    for (int nn = 0; nn < NT / 2; ++nn) {
      unsigned b[4];
      fz_ldmatrix_x4(b, at<LD, T>(base, nn * 16, kk * 16));
      Mma<T>::run(acc[2 * nn], a[kk], b[0], b[1]);
      Mma<T>::run(acc[2 * nn + 1], a[kk], b[2], b[3]);
    }
  }
}

// The same with A read from a row-major [16][LD] tile in shared memory at `arows`.
template <class T, int NT, int KT, int LD>
__device__ __forceinline__ void mma_abt_smem(float (&acc)[NT][4], const T* arows, const T* tile,
                                             int lane) {
  const fz_smem_t abase = at<LD, T>(fz_smem(arows), a_row(lane), a_col(lane));
  const fz_smem_t base = at<LD, T>(fz_smem(tile), b_row(lane), b_col(lane));
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    unsigned a[4];
    fz_ldmatrix_x4(a, at<LD, T>(abase, 0, kk * 16));
#pragma unroll
    for (int nn = 0; nn < NT / 2; ++nn) {
      unsigned b[4];
      fz_ldmatrix_x4(b, at<LD, T>(base, nn * 16, kk * 16));
      Mma<T>::run(acc[2 * nn], a, b[0], b[1]);
      Mma<T>::run(acc[2 * nn + 1], a, b[2], b[3]);
    }
  }
}

// acc[DT][4] += P tile (16 x 8*PT, as accumulator fragments p[PT][4], rounded to T) times a
// row-major [8*PT][LD] tile (rows are the k index, columns the n index).
template <class T, int PT, int DT, int LD>
__device__ __forceinline__ void mma_pv(float (&acc)[DT][4], const float (&p)[PT][4],
                                       const T* tile, int lane) {
  const fz_smem_t base = at<LD, T>(fz_smem(tile), t_row(lane), t_col(lane));
#pragma unroll
  for (int kb = 0; kb < PT / 2; ++kb) {
    // The accumulator layout of two adjacent n-tiles is the A layout of one k-block of 16.
    const unsigned a[4] = {fz_pack2<T>(p[2 * kb][0], p[2 * kb][1]),
                           fz_pack2<T>(p[2 * kb][2], p[2 * kb][3]),
                           fz_pack2<T>(p[2 * kb + 1][0], p[2 * kb + 1][1]),
                           fz_pack2<T>(p[2 * kb + 1][2], p[2 * kb + 1][3])};
#pragma unroll
    for (int dn = 0; dn < DT / 2; ++dn) {
      unsigned b[4];
      fz_ldmatrix_x4_trans(b, at<LD, T>(base, kb * 16, dn * 16));
      Mma<T>::run(acc[2 * dn], a, b[0], b[1]);
      Mma<T>::run(acc[2 * dn + 1], a, b[2], b[3]);
    }
  }
}

// A fragments of the warp's 16 rows (row0 ..) of a row-major tile, KT k-blocks.
template <int KT, int LD, class T>
__device__ __forceinline__ void load_a(unsigned (&a)[KT][4], const T* tile, int row0, int lane) {
  const fz_smem_t base = at<LD, T>(fz_smem(tile), row0 + a_row(lane), a_col(lane));
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) fz_ldmatrix_x4(a[kk], at<LD, T>(base, 0, kk * 16));
}

// Accumulator fragments (16 rows x 8*DT columns, times `scale`) into rows row0.. of a
// row-major tile of T.
template <int DT, int LD, class T>
__device__ __forceinline__ void stage_acc(T* tile, const float (&acc)[DT][4], int row0,
                                          float s0, float s1, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    *reinterpret_cast<unsigned*>(tile + (row0 + g) * LD + dt * 8 + 2 * t) =
        fz_pack2<T>(acc[dt][0] * s0, acc[dt][1] * s0);
    *reinterpret_cast<unsigned*>(tile + (row0 + g + 8) * LD + dt * 8 + 2 * t) =
        fz_pack2<T>(acc[dt][2] * s1, acc[dt][3] * s1);
  }
}

// ---- block decoding -----------------------------------------------------------------------------
struct Tile {
  int tile, b, h;
};
// blockIdx.x = i * (batch * heads) + b * heads + h; `reverse` numbers tiles from the last.
__device__ __forceinline__ Tile decode(int batch, int heads, int tiles, bool reverse) {
  const int bh = batch * heads;
  const int i = static_cast<int>(blockIdx.x) / bh, r = static_cast<int>(blockIdx.x) % bh;
  return Tile{reverse ? tiles - 1 - i : i, r / heads, r % heads};
}

// ---- forward, tensor cores -----------------------------------------------------------------------
template <class T, int DP, int WARPS, int BN>
__device__ __forceinline__ void forward_mma(const T* q, const T* k, const T* v, T* out,
                                            float* lse, const Geom& g) {
  constexpr int BM = 16 * WARPS, THREADS = 32 * WARPS, LD = DP + 8;
  constexpr int KT = DP / 16, NT = BN / 8, DT = DP / 8;
  constexpr unsigned SMEM = (BM + 4 * BN) * LD * sizeof(T);
  check_launch(THREADS, SMEM);
  FZ_DYNAMIC_SMEM(T, smem);
  T* sQ = smem;
  T* sK = sQ + BM * LD;
  T* sV = sK + 2 * BN * LD;

  const Tile tl = decode(g.batch, g.hq, (g.seq + BM - 1) / BM, true);
  const int kvh = tl.h / (g.hq / g.hkv);
  const int q0 = tl.tile * BM, q_valid = min(BM, g.seq - q0);
  const long long row0 = static_cast<long long>(tl.b) * g.seq;
  const long long o_stride = static_cast<long long>(g.hq) * g.d;
  const T* qb = q + (row0 + q0) * g.q_stride + g.q_off + static_cast<long long>(tl.h) * g.d;
  const T* kb = k + row0 * g.k_stride + g.k_off + static_cast<long long>(kvh) * g.d;
  const T* vb = v + row0 * g.v_stride + g.v_off + static_cast<long long>(kvh) * g.d;
  T* ob = out + (row0 + q0) * o_stride + static_cast<long long>(tl.h) * g.d;
  const bool vec = views_vectorizable<T>(g) && aligned(q, k, v, out, out, out);
  const int n_tiles = (min(q0 + BM, g.seq) - 1) / BN + 1;

  load_tile<BM, DP, LD, THREADS>(sQ, qb, g.q_stride, q_valid, g.d, vec);
  fz_cp_async_commit();
  load_tile<BN, DP, LD, THREADS>(sK, kb, g.k_stride, min(BN, g.seq), g.d, vec);
  load_tile<BN, DP, LD, THREADS>(sV, vb, g.v_stride, min(BN, g.seq), g.d, vec);
  fz_cp_async_commit();
  fz_cp_async_wait<1>();
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  unsigned qf[KT][4];
  load_a<KT, LD>(qf, sQ, warp * 16, lane);

  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {-fz_inf(), -fz_inf()}, l[2] = {0.0f, 0.0f};
  const int wq0 = q0 + warp * 16;
  const float sl2 = g.scale * kLog2e;

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      const int nb = (j + 1) & 1, kv1 = (j + 1) * BN;
      load_tile<BN, DP, LD, THREADS>(sK + nb * BN * LD, kb + kv1 * g.k_stride, g.k_stride,
                                     min(BN, g.seq - kv1), g.d, vec);
      load_tile<BN, DP, LD, THREADS>(sV + nb * BN * LD, vb + kv1 * g.v_stride, g.v_stride,
                                     min(BN, g.seq - kv1), g.d, vec);
      fz_cp_async_commit();
      fz_cp_async_wait<1>();
    } else {
      fz_cp_async_wait<0>();
    }
    __syncthreads();
    const int kv0 = j * BN;
    // Warp-uniform: skip a tile whose keys all lie after the warp's rows (or rows past seq).
    if (kv0 <= wq0 + 15 && wq0 < g.seq) {
      const T* tK = sK + (j & 1) * BN * LD;
      const T* tV = sV + (j & 1) * BN * LD;
      float s[NT][4];
#pragma unroll
      for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
      mma_abt<T, NT, KT, LD>(s, qf, tK, lane);
      const bool masked = kv0 + BN - 1 > wq0 || kv0 + BN > g.seq;
      // Row maxima of the raw scores (scale > 0 commutes with max); p = 2^(s*sl2 - max*sl2).
      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (masked) {
            const int row = wq0 + gq + (e >> 1) * 8, col = kv0 + nt * 8 + 2 * tq + (e & 1);
            if (col > row || col >= g.seq) s[nt][e] = -fz_inf();
          }
          mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
        }
      }
      float base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        base[r] = mx[r] == -fz_inf() ? 0.0f : mx[r] * sl2;
        const float alpha = fz_exp2_approx(fmaf(m[r], sl2, -base[r]));
        m[r] = mx[r];
        l[r] *= alpha;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[dt][2 * r] *= alpha;
          o[dt][2 * r + 1] *= alpha;
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nt][e] = fz_exp2_approx(fmaf(s[nt][e], sl2, -base[e >> 1]));
          l[e >> 1] += s[nt][e];
        }
      }
      if (g.p > 0.0f) {  // after the row sums: lse is the undropped softmax's
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = wq0 + gq + (e >> 1) * 8, col = kv0 + nt * 8 + 2 * tq + (e & 1);
            s[nt][e] *= keep_factor(g, tl.b, tl.h, row, col);
          }
        }
      }
      mma_pv<T, NT, DT, LD>(o, s, tV, lane);
    }
    __syncthreads();
  }

  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const int row = wq0 + gq + 8 * r;
    if (tq == 0 && row < g.seq)
      lse[(static_cast<long long>(tl.b) * g.hq + tl.h) * g.seq + row] =
          (m[r] * sl2 + log2f(l[r])) * kLn2;
  }
  stage_acc<DT, LD>(sQ, o, warp * 16, inv[0], inv[1], lane);
  __syncthreads();
  store_tile<BM, DP, LD, THREADS>(sQ, ob, o_stride, q_valid, g.d, vec);
}

// ---- backward dK, dV, tensor cores ---------------------------------------------------------------
template <class T, int DP, int WARPS, int BM, bool KV_REGS>
__device__ __forceinline__ void dkdv_mma(const T* q, const T* k, const T* v, const T* dout,
                                         const float* lse, const float* di, T* dk, T* dv,
                                         const Geom& g) {
  constexpr int BN = 16 * WARPS, THREADS = 32 * WARPS, LD = DP + 8;
  constexpr int KT = DP / 16, MT = BM / 8, DT = DP / 8;
  constexpr unsigned SMEM = (2 * BN + 4 * BM) * LD * sizeof(T) + 4 * BM * sizeof(float);
  static_assert(BM <= THREADS, "one thread per query row loads lse and di");
  check_launch(THREADS, SMEM);
  FZ_DYNAMIC_SMEM(T, smem);
  T* sK = smem;
  T* sV = sK + BN * LD;
  T* sQ = sV + BN * LD;        // [2][BM][LD]
  T* sO = sQ + 2 * BM * LD;    // dO, [2][BM][LD]
  float* sL = reinterpret_cast<float*>(sO + 2 * BM * LD);  // [2][BM]: lse * log2 e
  float* sD = sL + 2 * BM;                                  // [2][BM]: di

  const Tile tl = decode(g.batch, g.hkv, (g.seq + BN - 1) / BN, false);
  const int group = g.hq / g.hkv;
  const int kv0 = tl.tile * BN, kv_valid = min(BN, g.seq - kv0);
  const long long row0 = static_cast<long long>(tl.b) * g.seq;
  const long long o_stride = static_cast<long long>(g.hq) * g.d;
  const long long koff = row0 * g.k_stride + g.k_off + static_cast<long long>(tl.h) * g.d;
  const long long voff = row0 * g.v_stride + g.v_off + static_cast<long long>(tl.h) * g.d;
  const bool vec = views_vectorizable<T>(g) && aligned(q, k, v, dout, dk, dv);
  const int i_start = kv0 / BM, m_tiles = (g.seq + BM - 1) / BM;
  const int per_head = m_tiles - i_start, total = group * per_head;

  // Pair `it` is query head tl.h * group + it / per_head, query tile i_start + it % per_head:
  // its Q and dO tiles go to buffer it & 1 asynchronously, its lse and di directly.
  load_tile<BN, DP, LD, THREADS>(sK, k + koff + static_cast<long long>(kv0) * g.k_stride,
                                 g.k_stride, kv_valid, g.d, vec);
  load_tile<BN, DP, LD, THREADS>(sV, v + voff + static_cast<long long>(kv0) * g.v_stride,
                                 g.v_stride, kv_valid, g.d, vec);
  fz_cp_async_commit();
  {
    const int h = tl.h * group, qi0 = i_start * BM;
    load_tile<BM, DP, LD, THREADS>(
        sQ, q + (row0 + qi0) * g.q_stride + g.q_off + static_cast<long long>(h) * g.d,
        g.q_stride, min(BM, g.seq - qi0), g.d, vec);
    load_tile<BM, DP, LD, THREADS>(sO, dout + (row0 + qi0) * o_stride + static_cast<long long>(h) * g.d,
                                   o_stride, min(BM, g.seq - qi0), g.d, vec);
    if (static_cast<int>(threadIdx.x) < BM) {
      const int qq = qi0 + threadIdx.x;
      const long long at = (static_cast<long long>(tl.b) * g.hq + h) * g.seq + qq;
      sL[threadIdx.x] = qq < g.seq ? lse[at] * kLog2e : fz_inf();
      sD[threadIdx.x] = qq < g.seq ? di[at] : 0.0f;
    }
    fz_cp_async_commit();
  }
  fz_cp_async_wait<0>();
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  unsigned kf[KV_REGS ? KT : 1][4], vf[KV_REGS ? KT : 1][4];
  if constexpr (KV_REGS) {
    load_a<KT, LD>(kf, sK, warp * 16, lane);
    load_a<KT, LD>(vf, sV, warp * 16, lane);
  }
  float dka[DT][4], dva[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) {
    dka[i][0] = dka[i][1] = dka[i][2] = dka[i][3] = 0.0f;
    dva[i][0] = dva[i][1] = dva[i][2] = dva[i][3] = 0.0f;
  }
  const int wk0 = kv0 + warp * 16;
  const float sl2 = g.scale * kLog2e;

  for (int it = 0; it < total; ++it) {
    const int buf = it & 1;
    // lse and di of the next tile's row threadIdx.x: loaded now, stored to shared memory after
    // this tile's products, which hide the loads' latency.
    float next_l = 0.0f, next_d = 0.0f;
    if (it + 1 < total) {
      const int nb = buf ^ 1, h = tl.h * group + (it + 1) / per_head;
      const int qi0 = (i_start + (it + 1) % per_head) * BM;
      load_tile<BM, DP, LD, THREADS>(
          sQ + nb * BM * LD,
          q + (row0 + qi0) * g.q_stride + g.q_off + static_cast<long long>(h) * g.d, g.q_stride,
          min(BM, g.seq - qi0), g.d, vec);
      load_tile<BM, DP, LD, THREADS>(
          sO + nb * BM * LD, dout + (row0 + qi0) * o_stride + static_cast<long long>(h) * g.d,
          o_stride, min(BM, g.seq - qi0), g.d, vec);
      if (static_cast<int>(threadIdx.x) < BM) {
        const int qq = qi0 + threadIdx.x;
        const long long at = (static_cast<long long>(tl.b) * g.hq + h) * g.seq + qq;
        next_l = qq < g.seq ? lse[at] * kLog2e : fz_inf();
        next_d = qq < g.seq ? di[at] : 0.0f;
      }
      fz_cp_async_commit();
      fz_cp_async_wait<1>();
    } else {
      fz_cp_async_wait<0>();
    }
    __syncthreads();
    const int qi0 = (i_start + it % per_head) * BM, qh = tl.h * group + it / per_head;
    // Warp-uniform: skip a query tile that lies wholly before the warp's keys.
    if (qi0 + BM - 1 >= wk0 && wk0 < g.seq) {
      const T* tQ = sQ + buf * BM * LD;
      const T* tO = sO + buf * BM * LD;
      const float* tL = sL + buf * BM;
      const float* tD = sD + buf * BM;
      // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys against the tile's queries.
      float st[MT][4], dpt[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        st[i][0] = st[i][1] = st[i][2] = st[i][3] = 0.0f;
        dpt[i][0] = dpt[i][1] = dpt[i][2] = dpt[i][3] = 0.0f;
      }
      if constexpr (KV_REGS) {
        mma_abt<T, MT, KT, LD>(st, kf, tQ, lane);
        mma_abt<T, MT, KT, LD>(dpt, vf, tO, lane);
      } else {
        mma_abt_smem<T, MT, KT, LD>(st, sK + warp * 16 * LD, tQ, lane);
        mma_abt_smem<T, MT, KT, LD>(dpt, sV + warp * 16 * LD, tO, lane);
      }
      const bool masked = qi0 < wk0 + 15;
#pragma unroll
      for (int nt = 0; nt < MT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qc = nt * 8 + 2 * tq + (e & 1);
          float p = fz_exp2_approx(fmaf(st[nt][e], sl2, -tL[qc]));
          if (masked && wk0 + gq + (e >> 1) * 8 > qi0 + qc) p = 0.0f;
          // dV takes the dropped P; dS = P (dP M / (1 - p) - di).
          const int key = wk0 + gq + (e >> 1) * 8;
          const float f = g.p > 0.0f ? keep_factor(g, tl.b, qh, qi0 + qc, key) : 1.0f;
          st[nt][e] = p * f;
          dpt[nt][e] = p * (dpt[nt][e] * f - tD[qc]);
        }
      }
      mma_pv<T, MT, DT, LD>(dva, st, tO, lane);   // dV += P^T dO
      mma_pv<T, MT, DT, LD>(dka, dpt, tQ, lane);  // dK += dS^T Q
    }
    if (it + 1 < total && static_cast<int>(threadIdx.x) < BM) {
      sL[(buf ^ 1) * BM + threadIdx.x] = next_l;
      sD[(buf ^ 1) * BM + threadIdx.x] = next_d;
    }
    __syncthreads();
  }

  stage_acc<DT, LD>(sK, dka, warp * 16, g.scale, g.scale, lane);
  stage_acc<DT, LD>(sV, dva, warp * 16, 1.0f, 1.0f, lane);
  __syncthreads();
  store_tile<BN, DP, LD, THREADS>(sK, dk + koff + static_cast<long long>(kv0) * g.k_stride,
                                  g.k_stride, kv_valid, g.d, vec);
  store_tile<BN, DP, LD, THREADS>(sV, dv + voff + static_cast<long long>(kv0) * g.v_stride,
                                  g.v_stride, kv_valid, g.d, vec);
}

// ---- backward dQ, tensor cores ------------------------------------------------------------------
template <class T, int DP, int WARPS, int BN>
__device__ __forceinline__ void dq_mma(const T* q, const T* k, const T* v, const T* dout,
                                       const float* lse, const float* di, T* dq, const Geom& g) {
  constexpr int BM = 16 * WARPS, THREADS = 32 * WARPS, LD = DP + 8;
  constexpr int KT = DP / 16, NT = BN / 8, DT = DP / 8;
  constexpr unsigned SMEM = (2 * BM + 4 * BN) * LD * sizeof(T);
  check_launch(THREADS, SMEM);
  FZ_DYNAMIC_SMEM(T, smem);
  T* sQ = smem;
  T* sO = sQ + BM * LD;
  T* sK = sO + BM * LD;       // [2][BN][LD]
  T* sV = sK + 2 * BN * LD;   // [2][BN][LD]

  const Tile tl = decode(g.batch, g.hq, (g.seq + BM - 1) / BM, true);
  const int kvh = tl.h / (g.hq / g.hkv);
  const int q0 = tl.tile * BM, q_valid = min(BM, g.seq - q0);
  const long long row0 = static_cast<long long>(tl.b) * g.seq;
  const long long o_stride = static_cast<long long>(g.hq) * g.d;
  const long long qoff = (row0 + q0) * g.q_stride + g.q_off + static_cast<long long>(tl.h) * g.d;
  const T* kb = k + row0 * g.k_stride + g.k_off + static_cast<long long>(kvh) * g.d;
  const T* vb = v + row0 * g.v_stride + g.v_off + static_cast<long long>(kvh) * g.d;
  const bool vec = views_vectorizable<T>(g) && aligned(q, k, v, dout, dq, dq);
  const int n_tiles = (min(q0 + BM, g.seq) - 1) / BN + 1;

  load_tile<BM, DP, LD, THREADS>(sQ, q + qoff, g.q_stride, q_valid, g.d, vec);
  load_tile<BM, DP, LD, THREADS>(sO, dout + (row0 + q0) * o_stride + static_cast<long long>(tl.h) * g.d,
                                 o_stride, q_valid, g.d, vec);
  fz_cp_async_commit();
  load_tile<BN, DP, LD, THREADS>(sK, kb, g.k_stride, min(BN, g.seq), g.d, vec);
  load_tile<BN, DP, LD, THREADS>(sV, vb, g.v_stride, min(BN, g.seq), g.d, vec);
  fz_cp_async_commit();
  fz_cp_async_wait<1>();
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  unsigned qf[KT][4], of[KT][4];
  load_a<KT, LD>(qf, sQ, warp * 16, lane);
  load_a<KT, LD>(of, sO, warp * 16, lane);
  const int wq0 = q0 + warp * 16;
  float l2[2], dr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wq0 + gq + 8 * r;
    const long long at = (static_cast<long long>(tl.b) * g.hq + tl.h) * g.seq + row;
    l2[r] = row < g.seq ? lse[at] * kLog2e : fz_inf();
    dr[r] = row < g.seq ? di[at] : 0.0f;
  }
  float dqa[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) dqa[i][0] = dqa[i][1] = dqa[i][2] = dqa[i][3] = 0.0f;
  const float sl2 = g.scale * kLog2e;

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      const int nb = (j + 1) & 1, kv1 = (j + 1) * BN;
      load_tile<BN, DP, LD, THREADS>(sK + nb * BN * LD, kb + kv1 * g.k_stride, g.k_stride,
                                     min(BN, g.seq - kv1), g.d, vec);
      load_tile<BN, DP, LD, THREADS>(sV + nb * BN * LD, vb + kv1 * g.v_stride, g.v_stride,
                                     min(BN, g.seq - kv1), g.d, vec);
      fz_cp_async_commit();
      fz_cp_async_wait<1>();
    } else {
      fz_cp_async_wait<0>();
    }
    __syncthreads();
    const int kv0 = j * BN;
    if (kv0 <= wq0 + 15 && wq0 < g.seq) {
      const T* tK = sK + (j & 1) * BN * LD;
      const T* tV = sV + (j & 1) * BN * LD;
      float s[NT][4], dp[NT][4];
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
        dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.0f;
      }
      mma_abt<T, NT, KT, LD>(s, qf, tK, lane);   // S = Q K^T
      mma_abt<T, NT, KT, LD>(dp, of, tV, lane);  // dP = dO V^T
      const bool masked = kv0 + BN - 1 > wq0 || kv0 + BN > g.seq;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          float p = fz_exp2_approx(fmaf(s[nt][e], sl2, -l2[r]));
          if (masked) {
            const int row = wq0 + gq + 8 * r, col = kv0 + nt * 8 + 2 * tq + (e & 1);
            if (col > row || col >= g.seq) p = 0.0f;
          }
          if (g.p > 0.0f) {
            const int row = wq0 + gq + 8 * r, col = kv0 + nt * 8 + 2 * tq + (e & 1);
            dp[nt][e] *= keep_factor(g, tl.b, tl.h, row, col);
          }
          dp[nt][e] = p * (dp[nt][e] - dr[r]);
        }
      }
      mma_pv<T, NT, DT, LD>(dqa, dp, tK, lane);  // dQ += dS K
    }
    __syncthreads();
  }

  stage_acc<DT, LD>(sQ, dqa, warp * 16, g.scale, g.scale, lane);
  __syncthreads();
  store_tile<BM, DP, LD, THREADS>(sQ, dq + qoff, g.q_stride, q_valid, g.d, vec);
}

// ---- f32: SIMT ------------------------------------------------------------------------------------
// 128 threads; thread (r = tid / 4, c = tid % 4) owns row r of a 32-row tile and the columns
// c, c + 4, ... of its 32-column score block and of its head-dim accumulators. Dot products run
// over the padded head dim in order.
constexpr int kSimtRows = 32, kSimtThreads = 128, kSimtLP = 33;

template <int DP>
__device__ __forceinline__ float dot_rows(const float* a, const float* b) {
  float s = 0.0f;
#pragma unroll 16
  for (int i = 0; i < DP; ++i) s += a[i] * b[i];
  return s;
}

template <int DP>
__device__ __forceinline__ void forward_simt(const float* q, const float* k, const float* v,
                                             float* out, float* lse, const Geom& g) {
  constexpr int BM = kSimtRows, BN = kSimtRows, THREADS = kSimtThreads, LD = DP + 4;
  constexpr int CT = BN / 4, DT = DP / 4;
  constexpr unsigned SMEM = (BM + 4 * BN) * LD * 4 + BM * kSimtLP * 4;
  check_launch(THREADS, SMEM);
  FZ_DYNAMIC_SMEM(float, smem);
  float* sQ = smem;
  float* sK = sQ + BM * LD;
  float* sV = sK + 2 * BN * LD;
  float* sP = sV + 2 * BN * LD;  // [BM][kSimtLP]

  const Tile tl = decode(g.batch, g.hq, (g.seq + BM - 1) / BM, true);
  const int kvh = tl.h / (g.hq / g.hkv);
  const int q0 = tl.tile * BM, q_valid = min(BM, g.seq - q0);
  const long long row0 = static_cast<long long>(tl.b) * g.seq;
  const long long o_stride = static_cast<long long>(g.hq) * g.d;
  const float* qb = q + (row0 + q0) * g.q_stride + g.q_off + static_cast<long long>(tl.h) * g.d;
  const float* kb = k + row0 * g.k_stride + g.k_off + static_cast<long long>(kvh) * g.d;
  const float* vb = v + row0 * g.v_stride + g.v_off + static_cast<long long>(kvh) * g.d;
  const bool vec = views_vectorizable<float>(g) && aligned(q, k, v, q, k, v);
  const int n_tiles = (min(q0 + BM, g.seq) - 1) / BN + 1;

  load_tile<BM, DP, LD, THREADS>(sQ, qb, g.q_stride, q_valid, g.d, vec);
  load_tile<BN, DP, LD, THREADS>(sK, kb, g.k_stride, min(BN, g.seq), g.d, vec);
  load_tile<BN, DP, LD, THREADS>(sV, vb, g.v_stride, min(BN, g.seq), g.d, vec);
  fz_cp_async_commit();

  const int r = threadIdx.x >> 2, c = threadIdx.x & 3;
  const int row = q0 + r, wq0 = q0 + (threadIdx.x >> 5) * 8;
  float o[DT];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i] = 0.0f;
  float m = -fz_inf(), l = 0.0f;
  const float sl2 = g.scale * kLog2e;

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      const int nb = (j + 1) & 1, kv1 = (j + 1) * BN;
      load_tile<BN, DP, LD, THREADS>(sK + nb * BN * LD, kb + kv1 * g.k_stride, g.k_stride,
                                     min(BN, g.seq - kv1), g.d, vec);
      load_tile<BN, DP, LD, THREADS>(sV + nb * BN * LD, vb + kv1 * g.v_stride, g.v_stride,
                                     min(BN, g.seq - kv1), g.d, vec);
      fz_cp_async_commit();
      fz_cp_async_wait<1>();
    } else {
      fz_cp_async_wait<0>();
    }
    __syncthreads();
    const int kv0 = j * BN;
    if (kv0 <= wq0 + 7 && wq0 < g.seq) {  // warp-uniform
      const float* tK = sK + (j & 1) * BN * LD;
      const float* tV = sV + (j & 1) * BN * LD;
      float s[CT];
      float mx = m;
#pragma unroll
      for (int jj = 0; jj < CT; ++jj) {
        const int key = kv0 + c + 4 * jj;
        float x = dot_rows<DP>(sQ + r * LD, tK + (c + 4 * jj) * LD);
        if (key > row || key >= g.seq) x = -fz_inf();
        s[jj] = x;
        mx = fmaxf(mx, x);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == -fz_inf() ? 0.0f : mx * sl2;
      const float alpha = fz_exp2_approx(fmaf(m, sl2, -base));
      m = mx;
      l *= alpha;
#pragma unroll
      for (int i = 0; i < DT; ++i) o[i] *= alpha;
#pragma unroll
      for (int jj = 0; jj < CT; ++jj) {
        const float p = fz_exp2_approx(fmaf(s[jj], sl2, -base));
        l += p;
        sP[r * kSimtLP + c + 4 * jj] =
            g.p > 0.0f ? p * keep_factor(g, tl.b, tl.h, row, kv0 + c + 4 * jj) : p;
      }
      __syncwarp();
      for (int kl = 0; kl < BN; ++kl) {
        const float p = sP[r * kSimtLP + kl];
#pragma unroll
        for (int i = 0; i < DT; ++i) o[i] += p * tV[kl * LD + c + 4 * i];
      }
    }
    __syncthreads();
  }

  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (row < g.seq) {
    const float inv = 1.0f / l;
    float* orow = out + (row0 + row) * o_stride + static_cast<long long>(tl.h) * g.d;
#pragma unroll
    for (int i = 0; i < DT; ++i)
      if (c + 4 * i < g.d) orow[c + 4 * i] = o[i] * inv;
    if (c == 0)
      lse[(static_cast<long long>(tl.b) * g.hq + tl.h) * g.seq + row] =
          (m * sl2 + log2f(l)) * kLn2;
  }
}

template <int DP>
__device__ __forceinline__ void dkdv_simt(const float* q, const float* k, const float* v,
                                          const float* dout, const float* lse, const float* di,
                                          float* dk, float* dv, const Geom& g) {
  constexpr int BM = kSimtRows, BN = kSimtRows, THREADS = kSimtThreads, LD = DP + 4;
  constexpr int CT = BM / 4, DT = DP / 4;
  constexpr unsigned SMEM = (2 * BN + 4 * BM) * LD * 4 + 4 * BM * 4 + 2 * BN * kSimtLP * 4;
  check_launch(THREADS, SMEM);
  FZ_DYNAMIC_SMEM(float, smem);
  float* sK = smem;
  float* sV = sK + BN * LD;
  float* sQ = sV + BN * LD;       // [2][BM][LD]
  float* sO = sQ + 2 * BM * LD;   // [2][BM][LD]
  float* sL = sO + 2 * BM * LD;   // [2][BM]
  float* sD = sL + 2 * BM;        // [2][BM]
  float* sP = sD + 2 * BM;        // [BN][kSimtLP]
  float* sS = sP + BN * kSimtLP;  // [BN][kSimtLP]

  const Tile tl = decode(g.batch, g.hkv, (g.seq + BN - 1) / BN, false);
  const int group = g.hq / g.hkv;
  const int kv0 = tl.tile * BN, kv_valid = min(BN, g.seq - kv0);
  const long long row0 = static_cast<long long>(tl.b) * g.seq;
  const long long o_stride = static_cast<long long>(g.hq) * g.d;
  const long long koff = row0 * g.k_stride + g.k_off + static_cast<long long>(tl.h) * g.d;
  const long long voff = row0 * g.v_stride + g.v_off + static_cast<long long>(tl.h) * g.d;
  const bool vec = views_vectorizable<float>(g) && aligned(q, k, v, dout, dout, dout);
  const int i_start = kv0 / BM, m_tiles = (g.seq + BM - 1) / BM;
  const int per_head = m_tiles - i_start, total = group * per_head;

  load_tile<BN, DP, LD, THREADS>(sK, k + koff + static_cast<long long>(kv0) * g.k_stride,
                                 g.k_stride, kv_valid, g.d, vec);
  load_tile<BN, DP, LD, THREADS>(sV, v + voff + static_cast<long long>(kv0) * g.v_stride,
                                 g.v_stride, kv_valid, g.d, vec);
  fz_cp_async_commit();
  {
    const int h = tl.h * group, qi0 = i_start * BM;
    load_tile<BM, DP, LD, THREADS>(
        sQ, q + (row0 + qi0) * g.q_stride + g.q_off + static_cast<long long>(h) * g.d,
        g.q_stride, min(BM, g.seq - qi0), g.d, vec);
    load_tile<BM, DP, LD, THREADS>(sO, dout + (row0 + qi0) * o_stride + static_cast<long long>(h) * g.d,
                                   o_stride, min(BM, g.seq - qi0), g.d, vec);
    if (static_cast<int>(threadIdx.x) < BM) {
      const int qq = qi0 + threadIdx.x;
      const long long at = (static_cast<long long>(tl.b) * g.hq + h) * g.seq + qq;
      sL[threadIdx.x] = qq < g.seq ? lse[at] * kLog2e : fz_inf();
      sD[threadIdx.x] = qq < g.seq ? di[at] : 0.0f;
    }
    fz_cp_async_commit();
  }

  const int r = threadIdx.x >> 2, c = threadIdx.x & 3;
  const int key = kv0 + r, wk0 = kv0 + (threadIdx.x >> 5) * 8;
  float dka[DT], dva[DT];
#pragma unroll
  for (int i = 0; i < DT; ++i) dka[i] = dva[i] = 0.0f;
  const float sl2 = g.scale * kLog2e;

  for (int it = 0; it < total; ++it) {
    const int buf = it & 1;
    // lse and di of the next tile's row threadIdx.x: loaded now, stored to shared memory after
    // this tile's products, which hide the loads' latency.
    float next_l = 0.0f, next_d = 0.0f;
    if (it + 1 < total) {
      const int nb = buf ^ 1, h = tl.h * group + (it + 1) / per_head;
      const int qi0 = (i_start + (it + 1) % per_head) * BM;
      load_tile<BM, DP, LD, THREADS>(
          sQ + nb * BM * LD,
          q + (row0 + qi0) * g.q_stride + g.q_off + static_cast<long long>(h) * g.d, g.q_stride,
          min(BM, g.seq - qi0), g.d, vec);
      load_tile<BM, DP, LD, THREADS>(
          sO + nb * BM * LD, dout + (row0 + qi0) * o_stride + static_cast<long long>(h) * g.d,
          o_stride, min(BM, g.seq - qi0), g.d, vec);
      if (static_cast<int>(threadIdx.x) < BM) {
        const int qq = qi0 + threadIdx.x;
        const long long at = (static_cast<long long>(tl.b) * g.hq + h) * g.seq + qq;
        next_l = qq < g.seq ? lse[at] * kLog2e : fz_inf();
        next_d = qq < g.seq ? di[at] : 0.0f;
      }
      fz_cp_async_commit();
      fz_cp_async_wait<1>();
    } else {
      fz_cp_async_wait<0>();
    }
    __syncthreads();
    const int qi0 = (i_start + it % per_head) * BM, qh = tl.h * group + it / per_head;
    if (qi0 + BM - 1 >= wk0 && wk0 < g.seq) {  // warp-uniform
      const float* tQ = sQ + buf * BM * LD;
      const float* tO = sO + buf * BM * LD;
#pragma unroll
      for (int jj = 0; jj < CT; ++jj) {
        const int ql = c + 4 * jj;
        const float s = dot_rows<DP>(sK + r * LD, tQ + ql * LD);
        const float dp = dot_rows<DP>(sV + r * LD, tO + ql * LD);
        float p = fz_exp2_approx(fmaf(s, sl2, -sL[buf * BM + ql]));
        if (key > qi0 + ql) p = 0.0f;
        const float f = g.p > 0.0f ? keep_factor(g, tl.b, qh, qi0 + ql, key) : 1.0f;
        sP[r * kSimtLP + ql] = p * f;
        sS[r * kSimtLP + ql] = p * (dp * f - sD[buf * BM + ql]);
      }
      __syncwarp();
      for (int ql = 0; ql < BM; ++ql) {
        const float p = sP[r * kSimtLP + ql], ds = sS[r * kSimtLP + ql];
#pragma unroll
        for (int i = 0; i < DT; ++i) {
          dva[i] += p * tO[ql * LD + c + 4 * i];
          dka[i] += ds * tQ[ql * LD + c + 4 * i];
        }
      }
    }
    if (it + 1 < total && static_cast<int>(threadIdx.x) < BM) {
      sL[(buf ^ 1) * BM + threadIdx.x] = next_l;
      sD[(buf ^ 1) * BM + threadIdx.x] = next_d;
    }
    __syncthreads();
  }

  if (key < g.seq) {
    float* dkr = dk + koff + static_cast<long long>(key) * g.k_stride;
    float* dvr = dv + voff + static_cast<long long>(key) * g.v_stride;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      if (c + 4 * i < g.d) {
        dkr[c + 4 * i] = dka[i] * g.scale;
        dvr[c + 4 * i] = dva[i];
      }
    }
  }
}

template <int DP>
__device__ __forceinline__ void dq_simt(const float* q, const float* k, const float* v,
                                        const float* dout, const float* lse, const float* di,
                                        float* dq, const Geom& g) {
  constexpr int BM = kSimtRows, BN = kSimtRows, THREADS = kSimtThreads, LD = DP + 4;
  constexpr int CT = BN / 4, DT = DP / 4;
  constexpr unsigned SMEM = (2 * BM + 4 * BN) * LD * 4 + BM * kSimtLP * 4;
  check_launch(THREADS, SMEM);
  FZ_DYNAMIC_SMEM(float, smem);
  float* sQ = smem;
  float* sO = sQ + BM * LD;
  float* sK = sO + BM * LD;      // [2][BN][LD]
  float* sV = sK + 2 * BN * LD;  // [2][BN][LD]
  float* sS = sV + 2 * BN * LD;  // [BM][kSimtLP]

  const Tile tl = decode(g.batch, g.hq, (g.seq + BM - 1) / BM, true);
  const int kvh = tl.h / (g.hq / g.hkv);
  const int q0 = tl.tile * BM, q_valid = min(BM, g.seq - q0);
  const long long row0 = static_cast<long long>(tl.b) * g.seq;
  const long long o_stride = static_cast<long long>(g.hq) * g.d;
  const long long qoff = row0 * g.q_stride + g.q_off + static_cast<long long>(tl.h) * g.d;
  const float* kb = k + row0 * g.k_stride + g.k_off + static_cast<long long>(kvh) * g.d;
  const float* vb = v + row0 * g.v_stride + g.v_off + static_cast<long long>(kvh) * g.d;
  const bool vec = views_vectorizable<float>(g) && aligned(q, k, v, dout, dout, dout);
  const int n_tiles = (min(q0 + BM, g.seq) - 1) / BN + 1;

  load_tile<BM, DP, LD, THREADS>(sQ, q + qoff + static_cast<long long>(q0) * g.q_stride,
                                 g.q_stride, q_valid, g.d, vec);
  load_tile<BM, DP, LD, THREADS>(sO, dout + (row0 + q0) * o_stride + static_cast<long long>(tl.h) * g.d,
                                 o_stride, q_valid, g.d, vec);
  load_tile<BN, DP, LD, THREADS>(sK, kb, g.k_stride, min(BN, g.seq), g.d, vec);
  load_tile<BN, DP, LD, THREADS>(sV, vb, g.v_stride, min(BN, g.seq), g.d, vec);
  fz_cp_async_commit();

  const int r = threadIdx.x >> 2, c = threadIdx.x & 3;
  const int row = q0 + r, wq0 = q0 + (threadIdx.x >> 5) * 8;
  const long long at = (static_cast<long long>(tl.b) * g.hq + tl.h) * g.seq + row;
  const float l2 = row < g.seq ? lse[at] * kLog2e : fz_inf();
  const float dr = row < g.seq ? di[at] : 0.0f;
  float dqa[DT];
#pragma unroll
  for (int i = 0; i < DT; ++i) dqa[i] = 0.0f;
  const float sl2 = g.scale * kLog2e;

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      const int nb = (j + 1) & 1, kv1 = (j + 1) * BN;
      load_tile<BN, DP, LD, THREADS>(sK + nb * BN * LD, kb + kv1 * g.k_stride, g.k_stride,
                                     min(BN, g.seq - kv1), g.d, vec);
      load_tile<BN, DP, LD, THREADS>(sV + nb * BN * LD, vb + kv1 * g.v_stride, g.v_stride,
                                     min(BN, g.seq - kv1), g.d, vec);
      fz_cp_async_commit();
      fz_cp_async_wait<1>();
    } else {
      fz_cp_async_wait<0>();
    }
    __syncthreads();
    const int kv0 = j * BN;
    if (kv0 <= wq0 + 7 && wq0 < g.seq) {  // warp-uniform
      const float* tK = sK + (j & 1) * BN * LD;
      const float* tV = sV + (j & 1) * BN * LD;
#pragma unroll
      for (int jj = 0; jj < CT; ++jj) {
        const int kl = c + 4 * jj, key = kv0 + kl;
        const float s = dot_rows<DP>(sQ + r * LD, tK + kl * LD);
        const float dp = dot_rows<DP>(sO + r * LD, tV + kl * LD);
        float p = fz_exp2_approx(fmaf(s, sl2, -l2));
        if (key > row || key >= g.seq) p = 0.0f;
        const float f = g.p > 0.0f ? keep_factor(g, tl.b, tl.h, row, key) : 1.0f;
        sS[r * kSimtLP + kl] = p * (dp * f - dr);
      }
      __syncwarp();
      for (int kl = 0; kl < BN; ++kl) {
        const float ds = sS[r * kSimtLP + kl];
#pragma unroll
        for (int i = 0; i < DT; ++i) dqa[i] += ds * tK[kl * LD + c + 4 * i];
      }
    }
    __syncthreads();
  }

  if (row < g.seq) {
    float* dqr = dq + qoff + static_cast<long long>(row) * g.q_stride;
#pragma unroll
    for (int i = 0; i < DT; ++i)
      if (c + 4 * i < g.d) dqr[c + 4 * i] = dqa[i] * g.scale;
  }
}

// ---- backward preprocessing: di = rowsum(dO * O) ---------------------------------------------------
template <class T>
__device__ __forceinline__ void bwd_dot(const T* out, const T* dout, float* di, int batch, int seq,
                                        int hq, int d) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const long long n = static_cast<long long>(batch) * seq * hq;
  for (long long w = static_cast<long long>(blockIdx.x) * warps + (threadIdx.x >> 5); w < n;
       w += static_cast<long long>(gridDim.x) * warps) {
    const long long bt = w / hq;  // token row b * seq + s
    const int h = static_cast<int>(w % hq);
    const T* o = out + bt * hq * d + static_cast<long long>(h) * d;
    const T* dO = dout + bt * hq * d + static_cast<long long>(h) * d;
    float s = 0.0f;
    for (int i = lane; i < d; i += 32) s += to_f32(o[i]) * to_f32(dO[i]);
    s = fz_warp_sum(s);
    if (lane == 0) {
      const long long b = bt / seq, t = bt % seq;
      di[(b * hq + h) * seq + t] = s;
    }
  }
}


// ---- per head dim: tiles and dispatch ------------------------------------------------------------
// Tensor-core tiles (the table in the header): FW/FN forward warps and key tile, KW/KM dkdv warps
// and query tile (KV_REGS: the warp's K and V fragments stay in registers), QW/QN dq warps and key
// tile; FB/KB/QB the blocks per multiprocessor each kernel's registers are bounded for
// (__launch_bounds__ below).
template <int DP>
struct Cfg;
template <>
struct Cfg<32> {
  static constexpr int FW = 4, FN = 64, FB = 4, KW = 4, KM = 64, KB = 2, QW = 4, QN = 64, QB = 3;
  static constexpr bool KV_REGS = true;
};
template <>
struct Cfg<64> {
  static constexpr int FW = 4, FN = 64, FB = 3, KW = 4, KM = 32, KB = 2, QW = 4, QN = 64, QB = 2;
  static constexpr bool KV_REGS = true;
};
template <>
struct Cfg<96> {
  static constexpr int FW = 4, FN = 64, FB = 2, KW = 4, KM = 32, KB = 2, QW = 4, QN = 32, QB = 2;
  static constexpr bool KV_REGS = false;
};
template <>
struct Cfg<128> {
  static constexpr int FW = 4, FN = 64, FB = 2, KW = 4, KM = 32, KB = 2, QW = 4, QN = 32, QB = 2;
  static constexpr bool KV_REGS = false;
};

// Launch bounds of the entry points: threads per block and blocks per multiprocessor.
#define FZ_ATTN_BOUNDS(DP)                                                      \
  constexpr int kFwdThreads##DP = 32 * Cfg<DP>::FW, kFwdBlocks##DP = Cfg<DP>::FB; \
  constexpr int kKvThreads##DP = 32 * Cfg<DP>::KW, kKvBlocks##DP = Cfg<DP>::KB;   \
  constexpr int kQThreads##DP = 32 * Cfg<DP>::QW, kQBlocks##DP = Cfg<DP>::QB;
FZ_ATTN_BOUNDS(32)
FZ_ATTN_BOUNDS(64)
FZ_ATTN_BOUNDS(96)
FZ_ATTN_BOUNDS(128)
#undef FZ_ATTN_BOUNDS

template <class T>
struct IsF32 {
  static constexpr bool value = false;
};
template <>
struct IsF32<float> {
  static constexpr bool value = true;
};

template <class T, int DP>
__device__ __forceinline__ void forward(const T* q, const T* k, const T* v, T* out, float* lse,
                                        const Geom& g) {
  if constexpr (IsF32<T>::value)
    forward_simt<DP>(q, k, v, out, lse, g);
  else
    forward_mma<T, DP, Cfg<DP>::FW, Cfg<DP>::FN>(q, k, v, out, lse, g);
}

template <class T, int DP>
__device__ __forceinline__ void dkdv(const T* q, const T* k, const T* v, const T* dout,
                                     const float* lse, const float* di, T* dk, T* dv,
                                     const Geom& g) {
  if constexpr (IsF32<T>::value)
    dkdv_simt<DP>(q, k, v, dout, lse, di, dk, dv, g);
  else
    dkdv_mma<T, DP, Cfg<DP>::KW, Cfg<DP>::KM, Cfg<DP>::KV_REGS>(q, k, v, dout, lse, di, dk, dv,
                                                                g);
}

template <class T, int DP>
__device__ __forceinline__ void dq(const T* q, const T* k, const T* v, const T* dout,
                                   const float* lse, const float* di, T* dq_, const Geom& g) {
  if constexpr (IsF32<T>::value)
    dq_simt<DP>(q, k, v, dout, lse, di, dq_, g);
  else
    dq_mma<T, DP, Cfg<DP>::QW, Cfg<DP>::QN>(q, k, v, dout, lse, di, dq_, g);
}

}  // namespace attn

// ---- entry points ---------------------------------------------------------------------------------
#define FZ_ATTN_GEOM                                                                            \
  const attn::Geom g {                                                                          \
    q_stride, q_off, k_stride, k_off, v_stride, v_off, batch, seq, q_heads, kv_heads, head_dim, \
        scale, attn::rng_mix(seed), offset, p, p > 0.0f ? 1.0f / (1.0f - p) : 1.0f              \
  }

// Forward.
extern "C" __global__ __launch_bounds__(128, 2)
void attention_forward_d32_f32(const float* q, const float* k, const float* v,
    float* out, float* lse, long long q_stride, long long q_off, long long k_stride,
    long long k_off, long long v_stride, long long v_off, int batch, int seq, int q_heads,
    int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::forward<float, 32>(q, k, v, out, lse, g);
}
extern "C" __global__ __launch_bounds__(attn::kFwdThreads32, attn::kFwdBlocks32)
void attention_forward_d32_bf16(const bf16_t* q, const bf16_t* k,
    const bf16_t* v, bf16_t* out, float* lse, long long q_stride, long long q_off,
    long long k_stride, long long k_off, long long v_stride, long long v_off, int batch, int seq,
    int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::forward<bf16_t, 32>(q, k, v, out, lse, g);
}
extern "C" __global__ __launch_bounds__(attn::kFwdThreads32, attn::kFwdBlocks32)
void attention_forward_d32_f16(const f16_t* q, const f16_t* k, const f16_t* v,
    f16_t* out, float* lse, long long q_stride, long long q_off, long long k_stride,
    long long k_off, long long v_stride, long long v_off, int batch, int seq, int q_heads,
    int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::forward<f16_t, 32>(q, k, v, out, lse, g);
}
extern "C" __global__ __launch_bounds__(128, 2)
void attention_forward_d64_f32(const float* q, const float* k, const float* v,
    float* out, float* lse, long long q_stride, long long q_off, long long k_stride,
    long long k_off, long long v_stride, long long v_off, int batch, int seq, int q_heads,
    int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::forward<float, 64>(q, k, v, out, lse, g);
}
extern "C" __global__ __launch_bounds__(attn::kFwdThreads64, attn::kFwdBlocks64)
void attention_forward_d64_bf16(const bf16_t* q, const bf16_t* k,
    const bf16_t* v, bf16_t* out, float* lse, long long q_stride, long long q_off,
    long long k_stride, long long k_off, long long v_stride, long long v_off, int batch, int seq,
    int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::forward<bf16_t, 64>(q, k, v, out, lse, g);
}
extern "C" __global__ __launch_bounds__(attn::kFwdThreads64, attn::kFwdBlocks64)
void attention_forward_d64_f16(const f16_t* q, const f16_t* k, const f16_t* v,
    f16_t* out, float* lse, long long q_stride, long long q_off, long long k_stride,
    long long k_off, long long v_stride, long long v_off, int batch, int seq, int q_heads,
    int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::forward<f16_t, 64>(q, k, v, out, lse, g);
}
extern "C" __global__ __launch_bounds__(128, 2)
void attention_forward_d96_f32(const float* q, const float* k, const float* v,
    float* out, float* lse, long long q_stride, long long q_off, long long k_stride,
    long long k_off, long long v_stride, long long v_off, int batch, int seq, int q_heads,
    int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::forward<float, 96>(q, k, v, out, lse, g);
}
extern "C" __global__ __launch_bounds__(attn::kFwdThreads96, attn::kFwdBlocks96)
void attention_forward_d96_bf16(const bf16_t* q, const bf16_t* k,
    const bf16_t* v, bf16_t* out, float* lse, long long q_stride, long long q_off,
    long long k_stride, long long k_off, long long v_stride, long long v_off, int batch, int seq,
    int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::forward<bf16_t, 96>(q, k, v, out, lse, g);
}
extern "C" __global__ __launch_bounds__(attn::kFwdThreads96, attn::kFwdBlocks96)
void attention_forward_d96_f16(const f16_t* q, const f16_t* k, const f16_t* v,
    f16_t* out, float* lse, long long q_stride, long long q_off, long long k_stride,
    long long k_off, long long v_stride, long long v_off, int batch, int seq, int q_heads,
    int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::forward<f16_t, 96>(q, k, v, out, lse, g);
}
extern "C" __global__ __launch_bounds__(128, 2)
void attention_forward_d128_f32(const float* q, const float* k,
    const float* v, float* out, float* lse, long long q_stride, long long q_off, long long k_stride,
    long long k_off, long long v_stride, long long v_off, int batch, int seq, int q_heads,
    int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::forward<float, 128>(q, k, v, out, lse, g);
}
extern "C" __global__ __launch_bounds__(attn::kFwdThreads128, attn::kFwdBlocks128)
void attention_forward_d128_bf16(const bf16_t* q, const bf16_t* k,
    const bf16_t* v, bf16_t* out, float* lse, long long q_stride, long long q_off,
    long long k_stride, long long k_off, long long v_stride, long long v_off, int batch, int seq,
    int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::forward<bf16_t, 128>(q, k, v, out, lse, g);
}
extern "C" __global__ __launch_bounds__(attn::kFwdThreads128, attn::kFwdBlocks128)
void attention_forward_d128_f16(const f16_t* q, const f16_t* k,
    const f16_t* v, f16_t* out, float* lse, long long q_stride, long long q_off, long long k_stride,
    long long k_off, long long v_stride, long long v_off, int batch, int seq, int q_heads,
    int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::forward<f16_t, 128>(q, k, v, out, lse, g);
}

// Backward: di = rowsum(dO * O).
extern "C" __global__ void attention_bwd_dot_f32(const float* out, const float* dout, float* di,
    int batch, int seq, int q_heads, int head_dim) {
  attn::bwd_dot(out, dout, di, batch, seq, q_heads, head_dim);
}
extern "C" __global__ void attention_bwd_dot_bf16(const bf16_t* out, const bf16_t* dout, float* di,
    int batch, int seq, int q_heads, int head_dim) {
  attn::bwd_dot(out, dout, di, batch, seq, q_heads, head_dim);
}
extern "C" __global__ void attention_bwd_dot_f16(const f16_t* out, const f16_t* dout, float* di,
    int batch, int seq, int q_heads, int head_dim) {
  attn::bwd_dot(out, dout, di, batch, seq, q_heads, head_dim);
}

// Backward: dK and dV.
extern "C" __global__ __launch_bounds__(128, 2)
void attention_bwd_dkdv_d32_f32(const float* q, const float* k,
    const float* v, const float* dout, const float* lse, const float* di, float* dk, float* dv,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dkdv<float, 32>(q, k, v, dout, lse, di, dk, dv, g);
}
extern "C" __global__ __launch_bounds__(attn::kKvThreads32, attn::kKvBlocks32)
void attention_bwd_dkdv_d32_bf16(const bf16_t* q, const bf16_t* k,
    const bf16_t* v, const bf16_t* dout, const float* lse, const float* di, bf16_t* dk, bf16_t* dv,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dkdv<bf16_t, 32>(q, k, v, dout, lse, di, dk, dv, g);
}
extern "C" __global__ __launch_bounds__(attn::kKvThreads32, attn::kKvBlocks32)
void attention_bwd_dkdv_d32_f16(const f16_t* q, const f16_t* k,
    const f16_t* v, const f16_t* dout, const float* lse, const float* di, f16_t* dk, f16_t* dv,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dkdv<f16_t, 32>(q, k, v, dout, lse, di, dk, dv, g);
}
extern "C" __global__ __launch_bounds__(128, 2)
void attention_bwd_dkdv_d64_f32(const float* q, const float* k,
    const float* v, const float* dout, const float* lse, const float* di, float* dk, float* dv,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dkdv<float, 64>(q, k, v, dout, lse, di, dk, dv, g);
}
extern "C" __global__ __launch_bounds__(attn::kKvThreads64, attn::kKvBlocks64)
void attention_bwd_dkdv_d64_bf16(const bf16_t* q, const bf16_t* k,
    const bf16_t* v, const bf16_t* dout, const float* lse, const float* di, bf16_t* dk, bf16_t* dv,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dkdv<bf16_t, 64>(q, k, v, dout, lse, di, dk, dv, g);
}
extern "C" __global__ __launch_bounds__(attn::kKvThreads64, attn::kKvBlocks64)
void attention_bwd_dkdv_d64_f16(const f16_t* q, const f16_t* k,
    const f16_t* v, const f16_t* dout, const float* lse, const float* di, f16_t* dk, f16_t* dv,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dkdv<f16_t, 64>(q, k, v, dout, lse, di, dk, dv, g);
}
extern "C" __global__ __launch_bounds__(128, 2)
void attention_bwd_dkdv_d96_f32(const float* q, const float* k,
    const float* v, const float* dout, const float* lse, const float* di, float* dk, float* dv,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dkdv<float, 96>(q, k, v, dout, lse, di, dk, dv, g);
}
extern "C" __global__ __launch_bounds__(attn::kKvThreads96, attn::kKvBlocks96)
void attention_bwd_dkdv_d96_bf16(const bf16_t* q, const bf16_t* k,
    const bf16_t* v, const bf16_t* dout, const float* lse, const float* di, bf16_t* dk, bf16_t* dv,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dkdv<bf16_t, 96>(q, k, v, dout, lse, di, dk, dv, g);
}
extern "C" __global__ __launch_bounds__(attn::kKvThreads96, attn::kKvBlocks96)
void attention_bwd_dkdv_d96_f16(const f16_t* q, const f16_t* k,
    const f16_t* v, const f16_t* dout, const float* lse, const float* di, f16_t* dk, f16_t* dv,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dkdv<f16_t, 96>(q, k, v, dout, lse, di, dk, dv, g);
}
extern "C" __global__ __launch_bounds__(128, 2)
void attention_bwd_dkdv_d128_f32(const float* q, const float* k,
    const float* v, const float* dout, const float* lse, const float* di, float* dk, float* dv,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dkdv<float, 128>(q, k, v, dout, lse, di, dk, dv, g);
}
extern "C" __global__ __launch_bounds__(attn::kKvThreads128, attn::kKvBlocks128)
void attention_bwd_dkdv_d128_bf16(const bf16_t* q, const bf16_t* k,
    const bf16_t* v, const bf16_t* dout, const float* lse, const float* di, bf16_t* dk, bf16_t* dv,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dkdv<bf16_t, 128>(q, k, v, dout, lse, di, dk, dv, g);
}
extern "C" __global__ __launch_bounds__(attn::kKvThreads128, attn::kKvBlocks128)
void attention_bwd_dkdv_d128_f16(const f16_t* q, const f16_t* k,
    const f16_t* v, const f16_t* dout, const float* lse, const float* di, f16_t* dk, f16_t* dv,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dkdv<f16_t, 128>(q, k, v, dout, lse, di, dk, dv, g);
}

// Backward: dQ.
extern "C" __global__ __launch_bounds__(128, 2)
void attention_bwd_dq_d32_f32(const float* q, const float* k, const float* v,
    const float* dout, const float* lse, const float* di, float* dq, long long q_stride,
    long long q_off, long long k_stride, long long k_off, long long v_stride, long long v_off,
    int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dq<float, 32>(q, k, v, dout, lse, di, dq, g);
}
extern "C" __global__ __launch_bounds__(attn::kQThreads32, attn::kQBlocks32)
void attention_bwd_dq_d32_bf16(const bf16_t* q, const bf16_t* k,
    const bf16_t* v, const bf16_t* dout, const float* lse, const float* di, bf16_t* dq,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dq<bf16_t, 32>(q, k, v, dout, lse, di, dq, g);
}
extern "C" __global__ __launch_bounds__(attn::kQThreads32, attn::kQBlocks32)
void attention_bwd_dq_d32_f16(const f16_t* q, const f16_t* k, const f16_t* v,
    const f16_t* dout, const float* lse, const float* di, f16_t* dq, long long q_stride,
    long long q_off, long long k_stride, long long k_off, long long v_stride, long long v_off,
    int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dq<f16_t, 32>(q, k, v, dout, lse, di, dq, g);
}
extern "C" __global__ __launch_bounds__(128, 2)
void attention_bwd_dq_d64_f32(const float* q, const float* k, const float* v,
    const float* dout, const float* lse, const float* di, float* dq, long long q_stride,
    long long q_off, long long k_stride, long long k_off, long long v_stride, long long v_off,
    int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dq<float, 64>(q, k, v, dout, lse, di, dq, g);
}
extern "C" __global__ __launch_bounds__(attn::kQThreads64, attn::kQBlocks64)
void attention_bwd_dq_d64_bf16(const bf16_t* q, const bf16_t* k,
    const bf16_t* v, const bf16_t* dout, const float* lse, const float* di, bf16_t* dq,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dq<bf16_t, 64>(q, k, v, dout, lse, di, dq, g);
}
extern "C" __global__ __launch_bounds__(attn::kQThreads64, attn::kQBlocks64)
void attention_bwd_dq_d64_f16(const f16_t* q, const f16_t* k, const f16_t* v,
    const f16_t* dout, const float* lse, const float* di, f16_t* dq, long long q_stride,
    long long q_off, long long k_stride, long long k_off, long long v_stride, long long v_off,
    int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dq<f16_t, 64>(q, k, v, dout, lse, di, dq, g);
}
extern "C" __global__ __launch_bounds__(128, 2)
void attention_bwd_dq_d96_f32(const float* q, const float* k, const float* v,
    const float* dout, const float* lse, const float* di, float* dq, long long q_stride,
    long long q_off, long long k_stride, long long k_off, long long v_stride, long long v_off,
    int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dq<float, 96>(q, k, v, dout, lse, di, dq, g);
}
extern "C" __global__ __launch_bounds__(attn::kQThreads96, attn::kQBlocks96)
void attention_bwd_dq_d96_bf16(const bf16_t* q, const bf16_t* k,
    const bf16_t* v, const bf16_t* dout, const float* lse, const float* di, bf16_t* dq,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dq<bf16_t, 96>(q, k, v, dout, lse, di, dq, g);
}
extern "C" __global__ __launch_bounds__(attn::kQThreads96, attn::kQBlocks96)
void attention_bwd_dq_d96_f16(const f16_t* q, const f16_t* k, const f16_t* v,
    const f16_t* dout, const float* lse, const float* di, f16_t* dq, long long q_stride,
    long long q_off, long long k_stride, long long k_off, long long v_stride, long long v_off,
    int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dq<f16_t, 96>(q, k, v, dout, lse, di, dq, g);
}
extern "C" __global__ __launch_bounds__(128, 2)
void attention_bwd_dq_d128_f32(const float* q, const float* k, const float* v,
    const float* dout, const float* lse, const float* di, float* dq, long long q_stride,
    long long q_off, long long k_stride, long long k_off, long long v_stride, long long v_off,
    int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dq<float, 128>(q, k, v, dout, lse, di, dq, g);
}
extern "C" __global__ __launch_bounds__(attn::kQThreads128, attn::kQBlocks128)
void attention_bwd_dq_d128_bf16(const bf16_t* q, const bf16_t* k,
    const bf16_t* v, const bf16_t* dout, const float* lse, const float* di, bf16_t* dq,
    long long q_stride, long long q_off, long long k_stride, long long k_off, long long v_stride,
    long long v_off, int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dq<bf16_t, 128>(q, k, v, dout, lse, di, dq, g);
}
extern "C" __global__ __launch_bounds__(attn::kQThreads128, attn::kQBlocks128)
void attention_bwd_dq_d128_f16(const f16_t* q, const f16_t* k, const f16_t* v,
    const f16_t* dout, const float* lse, const float* di, f16_t* dq, long long q_stride,
    long long q_off, long long k_stride, long long k_off, long long v_stride, long long v_off,
    int batch, int seq, int q_heads, int kv_heads, int head_dim, float scale,
    unsigned long long seed, unsigned long long offset, float p) {
  FZ_ATTN_GEOM;
  attn::dq<f16_t, 128>(q, k, v, dout, lse, di, dq, g);
}
