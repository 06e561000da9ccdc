// reduce.cu: dtype casts, unscaling with an overflow flag, sum of squares (the
// gradient norm) and column sums (bias gradients).
//
// Elementwise kernels are grid-stride loops (any 1-D grid, e.g. 256 threads and
// min(ceil(n / 2048), 8 * SMs) blocks) with 16-byte vectors when the buffers are aligned.
//
//   cast_<S>_to_<D>(const S* src, D* dst, long long n)       S != D in {f32, bf16, f16}
//       dst = src rounded to nearest even, bit-identical to Rust's `half` (bf16 <-> f16 goes
//       through f32 exactly, as `half` does).
//   unscale_T(T* x, long long n, float s, int* nonfinite)
//       x *= s in place; *nonfinite = 1 if any result is Inf or NaN (never cleared: the host
//       zeroes it). s == 1 only checks and writes nothing (the overflow check alone).
//
//   sum_squares_T(const T* x, long long n, double* partials)
//       partials[b] = sum of x^2 over block b's contiguous segment, in f64 (overwritten).
//       Launch: grid G blocks (G partials), block a multiple of 32 threads. The order depends on
//       G and the block size, so the host derives both from n alone (e.g. 256 threads,
//       G = min(ceil(n / 4096), 1024)); every square is exact in f64.
//   sum_squares_f32_as_bf16(const float* x, long long n, double* partials), _as_f16: the same
//       partials for f32 values as an accumulator of that dtype holds them (rounded), in that
//       accumulator's order (its packs, and its alignment test on an f32 base twice as wide):
//       bit-identical to sum_squares_bf16 (_f16) over the accumulator. Launch as sum_squares_T.
//   sum_squares_finalize(const double* partials, long long nparts, double* out, float* out_f32)
//       *out = the partials summed in order (overwritten); out_f32, when not null, gets it
//       rounded to f32 (what the engine all-reduces). Launch: one block of 32 threads (any
//       block size of at most 1024 works).
//
//   max_assign_f32(float* dst, const float* src, long long n)
//       dst = src > dst || src is NaN ? src : dst: a maximum that keeps a NaN from either side
//       (the local communicator's Max, comm/local/kernels.rs `max_nan`).
//   div_f32(float* x, long long n, float d)
//       x = x / d, an IEEE division (the local communicator's Avg divides the rank-order sum
//       by the world size; multiplying by 1/d would round differently).
//
//   colsum_partial_T(const T* m, float* partial, long long rows, int cols, int rows_per_chunk)
//       partial[c][j] = sum over the rows of chunk c of m[i, j], in row order (overwritten).
//       Scratch: ceil(rows / rows_per_chunk) * cols floats. Launch: any 1-D grid, a thread per
//       (chunk, 16-byte pack of columns).
//   colsum_finalize(const float* partial, float* acc, long long nchunks, int cols)
//       acc[j] += the chunks' partial sums, in chunk order (accumulated). Launch: any 1-D grid
//       covering cols.
//     Column sums are deterministic for a given rows_per_chunk, which the host derives from the
//     shape; they are not bitwise the CPU's (which adds rows straight into the accumulator).

// Elementwise kernels are functors over packs: operator()(i, fz_int<W>) handles elements
// i .. i+W-1 (W elements per 16-byte vector, or 1).

template <class S, class D>
struct Cast {
  const S* src;
  D* dst;
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) const {
    float v[W];
    fz_load<W>(src + i, v);
    fz_store<W>(dst + i, v);
  }
};

struct MaxAssign {
  float* dst;
  const float* src;
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) const {
    float a[W], b[W];
    fz_load<W>(dst + i, a);
    fz_load<W>(src + i, b);
#pragma unroll
    for (int k = 0; k < W; ++k) a[k] = (b[k] > a[k] || b[k] != b[k]) ? b[k] : a[k];
    fz_store<W>(dst + i, a);
  }
};

struct DivBy {
  float* x;
  float d;
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) const {
    float v[W];
    fz_load<W>(x + i, v);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = v[k] / d;
    fz_store<W>(x + i, v);
  }
};

template <class T>
struct Unscale {
  T* x;
  float s;
  bool write;
  mutable bool bad;  // a non-finite result seen by this thread
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) const {
    float v[W];
    fz_load<W>(x + i, v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      v[k] = to_f32(from_f32<T>(v[k] * s));  // check what is stored: f16 overflows at 65520
      bad |= !isfinite(v[k]);
    }
    if (write) fz_store<W>(x + i, v);
  }
};

template <class S, class D>
__device__ __forceinline__ void cast(const S* src, D* dst, long long n) {
  constexpr int V = fz_vec<S>::n > fz_vec<D>::n ? fz_vec<S>::n : fz_vec<D>::n;
  fz_grid_packs<V>(n, fz_aligned16(src) && fz_aligned16(dst), Cast<S, D>{src, dst});
}

template <class T>
__device__ __forceinline__ void unscale(T* x, long long n, float s, int* nonfinite) {
  const Unscale<T> op{x, s, s != 1.0f, false};
  fz_grid_packs<fz_vec<T>::n>(n, fz_aligned16(x), op);
  if (op.bad) atomicOr(nonfinite, 1);
}

// V elements per pack and ALIGN bytes of base alignment for the packed path: those of T itself,
// or, for f32 values read as a half-precision accumulator (fz_as), those of that accumulator, so
// the order of every addition (segments, packs, threads) is the accumulator's own.
template <class T, int V = fz_vec<T>::n, unsigned long long ALIGN = 16>
__device__ __forceinline__ void sum_squares(const T* x, long long n, double* partials) {
  __shared__ double scratch[32];
  // Segments are whole packs, so every block's segment starts 16-byte aligned.
  const long long per = (n + gridDim.x - 1) / gridDim.x;
  const long long seg = (per + V - 1) / V * V;
  const long long lo = min(static_cast<long long>(blockIdx.x) * seg, n);
  const long long hi = min(lo + seg, n);
  const T* xs = x + lo;
  const long long len = hi - lo;
  double acc = 0.0;
  long long done = 0;
  if ((reinterpret_cast<unsigned long long>(x) & (ALIGN - 1)) == 0) {
    const long long packs = len / V;
    for (long long p = threadIdx.x; p < packs; p += blockDim.x) {
      float v[V];
      fz_load<V>(xs + p * V, v);
#pragma unroll
      for (int k = 0; k < V; ++k) acc += static_cast<double>(v[k]) * static_cast<double>(v[k]);
    }
    done = packs * V;
  }
  for (long long i = done + threadIdx.x; i < len; i += blockDim.x) {
    const double v = to_f32(xs[i]);
    acc += v * v;
  }
  acc = fz_block_sum(acc, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

template <class T>
__device__ __forceinline__ void colsum_partial(const T* m, float* partial, long long rows,
                                               int cols, int rows_per_chunk) {
  constexpr int V = fz_vec<T>::n;
  const bool vec = cols % V == 0 && fz_aligned16(m) && fz_aligned16(partial);
  const int packs = (cols + V - 1) / V;
  const long long nchunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  const long long items = nchunks * packs;
  for (long long it = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; it < items;
       it += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long c = it / packs;
    const int p = static_cast<int>(it % packs);
    const long long r0 = c * rows_per_chunk, r1 = min(r0 + rows_per_chunk, rows);
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.0f;
    for (long long r = r0; r < r1; ++r) {
      float v[V];
      fz_load_row<V>(m + r * cols, p * V, cols, vec, v);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += v[k];
    }
    fz_store_row<V>(partial + c * cols, p * V, cols, vec, acc);
  }
}

// ---- instantiations ----------------------------------------------------------------------------

extern "C" __global__ void cast_f32_to_bf16(const float* src, bf16_t* dst, long long n) {
  cast(src, dst, n);
}
extern "C" __global__ void cast_f32_to_f16(const float* src, f16_t* dst, long long n) {
  cast(src, dst, n);
}
extern "C" __global__ void cast_bf16_to_f32(const bf16_t* src, float* dst, long long n) {
  cast(src, dst, n);
}
extern "C" __global__ void cast_f16_to_f32(const f16_t* src, float* dst, long long n) {
  cast(src, dst, n);
}
extern "C" __global__ void cast_bf16_to_f16(const bf16_t* src, f16_t* dst, long long n) {
  cast(src, dst, n);
}
extern "C" __global__ void cast_f16_to_bf16(const f16_t* src, bf16_t* dst, long long n) {
  cast(src, dst, n);
}

extern "C" __global__ void max_assign_f32(float* dst, const float* src, long long n) {
  fz_grid_packs<fz_vec<float>::n>(n, fz_aligned16(dst) && fz_aligned16(src), MaxAssign{dst, src});
}
extern "C" __global__ void div_f32(float* x, long long n, float d) {
  fz_grid_packs<fz_vec<float>::n>(n, fz_aligned16(x), DivBy{x, d});
}

extern "C" __global__ void unscale_f32(float* x, long long n, float s, int* nonfinite) {
  unscale(x, n, s, nonfinite);
}
extern "C" __global__ void unscale_bf16(bf16_t* x, long long n, float s, int* nonfinite) {
  unscale(x, n, s, nonfinite);
}
extern "C" __global__ void unscale_f16(f16_t* x, long long n, float s, int* nonfinite) {
  unscale(x, n, s, nonfinite);
}

extern "C" __global__ void sum_squares_f32(const float* x, long long n, double* partials) {
  sum_squares(x, n, partials);
}
extern "C" __global__ void sum_squares_bf16(const bf16_t* x, long long n, double* partials) {
  sum_squares(x, n, partials);
}
extern "C" __global__ void sum_squares_f16(const f16_t* x, long long n, double* partials) {
  sum_squares(x, n, partials);
}

extern "C" __global__ void sum_squares_f32_as_bf16(const float* x, long long n,
                                                   double* partials) {
  sum_squares<fz_as<float, bf16_t>, fz_vec<bf16_t>::n, 32>(
      reinterpret_cast<const fz_as<float, bf16_t>*>(x), n, partials);
}
extern "C" __global__ void sum_squares_f32_as_f16(const float* x, long long n,
                                                  double* partials) {
  sum_squares<fz_as<float, f16_t>, fz_vec<f16_t>::n, 32>(
      reinterpret_cast<const fz_as<float, f16_t>*>(x), n, partials);
}

// The sum is serial (its order is the CPU's), but one thread loading 1024 doubles one after
// another waits on memory for each (60 us on an H200): the block stages them in shared memory
// first, then one thread adds them in order.
extern "C" __global__ void sum_squares_finalize(const double* partials, long long nparts,
                                                double* out, float* out_f32) {
  __shared__ double tile[1024];
  if (blockIdx.x != 0) return;
  double s = 0.0;
  for (long long base = 0; base < nparts; base += 1024) {
    const int n = static_cast<int>(nparts - base < 1024 ? nparts - base : 1024);
    for (int i = threadIdx.x; i < n; i += blockDim.x) tile[i] = partials[base + i];
    __syncthreads();
    if (threadIdx.x == 0)
      for (int i = 0; i < n; ++i) s += tile[i];
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  *out = s;
  if (out_f32) *out_f32 = static_cast<float>(s);
}

extern "C" __global__ void colsum_partial_f32(const float* m, float* partial, long long rows,
                                              int cols, int rows_per_chunk) {
  colsum_partial(m, partial, rows, cols, rows_per_chunk);
}
extern "C" __global__ void colsum_partial_bf16(const bf16_t* m, float* partial, long long rows,
                                               int cols, int rows_per_chunk) {
  colsum_partial(m, partial, rows, cols, rows_per_chunk);
}
extern "C" __global__ void colsum_partial_f16(const f16_t* m, float* partial, long long rows,
                                              int cols, int rows_per_chunk) {
  colsum_partial(m, partial, rows, cols, rows_per_chunk);
}

extern "C" __global__ void colsum_finalize(const float* partial, float* acc, long long nchunks,
                                           int cols) {
  for (long long j = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; j < cols;
       j += static_cast<long long>(gridDim.x) * blockDim.x) {
    float a = acc[j];
    for (long long c = 0; c < nchunks; ++c) a += partial[c * cols + j];
    acc[j] = a;
  }
}
