// elementwise.cu: pointwise activations, residual adds, dropout, fill.
//
// Every kernel has _f32, _bf16 and _f16 variants (T = float, bf16_t, f16_t) and computes in f32,
// rounding once per output element. All are grid-stride loops: launch any 1-D grid, e.g.
// block 256 and grid min(ceil(n / (256 * 16 / sizeof(T))), 8 * SMs); 16-byte vectors are used when
// every pointer is 16-byte aligned, the tail and unaligned buffers go element by element.
// Outputs are overwritten unless the name says otherwise; an output may be the same buffer as
// an input of the same element (each element is read before it is written).
//
//   gelu_forward_T(const T* x, T* y, long long n)
//       y = gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
//   gelu_backward_T(const T* x, const T* dy, T* dx, long long n)
//       dx = dy * gelu_tanh'(x)
//   swiglu_forward_T(const T* gate, const T* up, T* y, long long n)
//       y = silu(gate) * up, silu(g) = g * sigmoid(g)
//   swiglu_backward_T(const T* gate, const T* up, const T* dy, T* dgate, T* dup, long long n)
//       dup = dy * silu(gate); dgate = dy * up * s * (1 + gate * (1 - s)), s = sigmoid(gate)
//   add_assign_T(T* dst, const T* src, long long n)
//       dst = round_T(dst + src), added in f32 and rounded once (also FlatBuf::accumulate's)
//   dropout_T(T* x, long long n, unsigned long long seed, unsigned long long offset, float p)
//       in place: x = keep ? x / (1 - p) : 0 with keep = uniform(seed, offset + i) >= p, i the
//       element's index in the buffer and the sum wrapping in 64 bits (offset places the buffer
//       inside a larger one's counters: the engine's global sample index times the elements a
//       sample holds); the mask equals the CPU backend's bit for bit (backend/rng.rs), so
//       backward is the same call on the gradient. p <= 0 leaves x untouched.
//   fill_T(T* x, long long n, float value)
//       x = value (rounded to T)
//   add_bias_rows_T(T* y, const T* bias, long long rows, long long cols)
//       y[r, c] = round_T(y[r, c] + bias[c]) over a row-major [rows, cols] y: the bias a matmul
//       adds when cuBLASLt has no algorithm for its bias epilogue (a rare path, so one element a
//       thread, no vectors)
//
// The constants are the CPU backend's (backend/cpu/elementwise.rs). tanhf and expf are CUDA's
// accurate functions; the CPU uses its own polynomial approximations, so the two agree to a few
// ulp, not bit for bit.

#define FZ_SQRT_2_OVER_PI 0.7978846f
#define FZ_GELU_C 0.044715f

__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(FZ_SQRT_2_OVER_PI * (x + FZ_GELU_C * x * x * x)));
}

__device__ __forceinline__ float gelu_grad(float x) {
  const float u = FZ_SQRT_2_OVER_PI * (x + FZ_GELU_C * x * x * x);
  const float t = tanhf(u);
  const float du = FZ_SQRT_2_OVER_PI * (1.0f + 3.0f * FZ_GELU_C * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The counter-based generator of backend/rng.rs, in the same 64-bit integer arithmetic.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// uniform_f32(seed, index) given mix64(seed): 24 random bits scaled by 2^-24 (exact in f32).
__device__ __forceinline__ float uniform_f32(unsigned long long mixed_seed,
                                             unsigned long long index) {
  const unsigned long long b = mix64(mixed_seed ^ (index * 0xD1B54A32D192ED03ull));
  return static_cast<float>(b >> 40) * (1.0f / 16777216.0f);
}

// Each kernel is a functor over packs: operator()(i, fz_int<W>) handles elements i .. i+W-1
// (W = 16 / sizeof(T) with vectors, 1 for tails and unaligned buffers).

template <class T>
struct GeluForward {
  const T* x;
  T* y;
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) const {
    float v[W];
    fz_load<W>(x + i, v);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = gelu(v[k]);
    fz_store<W>(y + i, v);
  }
};

template <class T>
struct GeluBackward {
  const T* x;
  const T* dy;
  T* dx;
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) const {
    float xv[W], g[W];
    fz_load<W>(x + i, xv);
    fz_load<W>(dy + i, g);
#pragma unroll
    for (int k = 0; k < W; ++k) g[k] = g[k] * gelu_grad(xv[k]);
    fz_store<W>(dx + i, g);
  }
};

template <class T>
struct SwigluForward {
  const T* gate;
  const T* up;
  T* y;
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) const {
    float g[W], u[W];
    fz_load<W>(gate + i, g);
    fz_load<W>(up + i, u);
#pragma unroll
    for (int k = 0; k < W; ++k) u[k] = g[k] * sigmoid(g[k]) * u[k];
    fz_store<W>(y + i, u);
  }
};

template <class T>
struct SwigluBackward {
  const T* gate;
  const T* up;
  const T* dy;
  T* dgate;
  T* dup;
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) const {
    float g[W], u[W], d[W];
    fz_load<W>(gate + i, g);
    fz_load<W>(up + i, u);
    fz_load<W>(dy + i, d);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float s = sigmoid(g[k]);
      const float silu = g[k] * s;
      const float dgk = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
      u[k] = d[k] * silu;  // dup
      g[k] = dgk;          // dgate
    }
    fz_store<W>(dup + i, u);
    fz_store<W>(dgate + i, g);
  }
};

template <class T>
struct AddAssign {
  T* dst;
  const T* src;
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) const {
    float a[W], b[W];
    fz_load<W>(dst + i, a);
    fz_load<W>(src + i, b);
#pragma unroll
    for (int k = 0; k < W; ++k) a[k] += b[k];
    fz_store<W>(dst + i, a);
  }
};

template <class T>
struct Dropout {
  T* x;
  unsigned long long mixed_seed;  // mix64(seed), the same for every element
  unsigned long long offset;      // the counter of element 0
  float p;
  float scale;  // 1 / (1 - p), rounded as the CPU rounds it
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) const {
    float v[W];
    fz_load<W>(x + i, v);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = uniform_f32(mixed_seed, offset + static_cast<unsigned long long>(i + k)) >= p ? v[k] * scale : 0.0f;
    fz_store<W>(x + i, v);
  }
};

template <class T>
struct Fill {
  T* x;
  float value;
  template <int W>
  __device__ __forceinline__ void operator()(long long i, fz_int<W>) const {
    float v[W];
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = value;
    fz_store<W>(x + i, v);
  }
};

template <class T>
__device__ __forceinline__ void gelu_forward(const T* x, T* y, long long n) {
  fz_grid_packs<fz_vec<T>::n>(n, fz_aligned16(x) && fz_aligned16(y), GeluForward<T>{x, y});
}

template <class T>
__device__ __forceinline__ void gelu_backward(const T* x, const T* dy, T* dx, long long n) {
  const bool aligned = fz_aligned16(x) && fz_aligned16(dy) && fz_aligned16(dx);
  fz_grid_packs<fz_vec<T>::n>(n, aligned, GeluBackward<T>{x, dy, dx});
}

template <class T>
__device__ __forceinline__ void swiglu_forward(const T* gate, const T* up, T* y, long long n) {
  const bool aligned = fz_aligned16(gate) && fz_aligned16(up) && fz_aligned16(y);
  fz_grid_packs<fz_vec<T>::n>(n, aligned, SwigluForward<T>{gate, up, y});
}

template <class T>
__device__ __forceinline__ void swiglu_backward(const T* gate, const T* up, const T* dy, T* dgate,
                                                T* dup, long long n) {
  const bool aligned = fz_aligned16(gate) && fz_aligned16(up) && fz_aligned16(dy) &&
                       fz_aligned16(dgate) && fz_aligned16(dup);
  fz_grid_packs<fz_vec<T>::n>(n, aligned, SwigluBackward<T>{gate, up, dy, dgate, dup});
}

template <class T>
__device__ __forceinline__ void add_assign(T* dst, const T* src, long long n) {
  fz_grid_packs<fz_vec<T>::n>(n, fz_aligned16(dst) && fz_aligned16(src), AddAssign<T>{dst, src});
}

template <class T>
__device__ __forceinline__ void dropout(T* x, long long n, unsigned long long seed,
                                        unsigned long long offset, float p) {
  if (p <= 0.0f) return;
  const Dropout<T> op{x, mix64(seed), offset, p, 1.0f / (1.0f - p)};
  fz_grid_packs<fz_vec<T>::n>(n, fz_aligned16(x), op);
}

template <class T>
__device__ __forceinline__ void fill(T* x, long long n, float value) {
  fz_grid_packs<fz_vec<T>::n>(n, fz_aligned16(x), Fill<T>{x, value});
}

template <class T>
__device__ __forceinline__ void add_bias_rows(T* y, const T* bias, long long rows, long long cols) {
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = first; i < rows * cols; i += stride)
    y[i] = from_f32<T>(to_f32(y[i]) + to_f32(bias[i % cols]));
}

// ---- instantiations ----------------------------------------------------------------------------

extern "C" __global__ void gelu_forward_f32(const float* x, float* y, long long n) {
  gelu_forward(x, y, n);
}
extern "C" __global__ void gelu_forward_bf16(const bf16_t* x, bf16_t* y, long long n) {
  gelu_forward(x, y, n);
}
extern "C" __global__ void gelu_forward_f16(const f16_t* x, f16_t* y, long long n) {
  gelu_forward(x, y, n);
}

extern "C" __global__ void gelu_backward_f32(const float* x, const float* dy, float* dx,
                                             long long n) {
  gelu_backward(x, dy, dx, n);
}
extern "C" __global__ void gelu_backward_bf16(const bf16_t* x, const bf16_t* dy, bf16_t* dx,
                                              long long n) {
  gelu_backward(x, dy, dx, n);
}
extern "C" __global__ void gelu_backward_f16(const f16_t* x, const f16_t* dy, f16_t* dx,
                                             long long n) {
  gelu_backward(x, dy, dx, n);
}

extern "C" __global__ void swiglu_forward_f32(const float* gate, const float* up, float* y,
                                              long long n) {
  swiglu_forward(gate, up, y, n);
}
extern "C" __global__ void swiglu_forward_bf16(const bf16_t* gate, const bf16_t* up, bf16_t* y,
                                               long long n) {
  swiglu_forward(gate, up, y, n);
}
extern "C" __global__ void swiglu_forward_f16(const f16_t* gate, const f16_t* up, f16_t* y,
                                              long long n) {
  swiglu_forward(gate, up, y, n);
}

extern "C" __global__ void swiglu_backward_f32(const float* gate, const float* up,
                                               const float* dy, float* dgate, float* dup,
                                               long long n) {
  swiglu_backward(gate, up, dy, dgate, dup, n);
}
extern "C" __global__ void swiglu_backward_bf16(const bf16_t* gate, const bf16_t* up,
                                                const bf16_t* dy, bf16_t* dgate, bf16_t* dup,
                                                long long n) {
  swiglu_backward(gate, up, dy, dgate, dup, n);
}
extern "C" __global__ void swiglu_backward_f16(const f16_t* gate, const f16_t* up,
                                               const f16_t* dy, f16_t* dgate, f16_t* dup,
                                               long long n) {
  swiglu_backward(gate, up, dy, dgate, dup, n);
}

extern "C" __global__ void add_assign_f32(float* dst, const float* src, long long n) {
  add_assign(dst, src, n);
}
extern "C" __global__ void add_assign_bf16(bf16_t* dst, const bf16_t* src, long long n) {
  add_assign(dst, src, n);
}
extern "C" __global__ void add_assign_f16(f16_t* dst, const f16_t* src, long long n) {
  add_assign(dst, src, n);
}

extern "C" __global__ void dropout_f32(float* x, long long n, unsigned long long seed,
                                       unsigned long long offset, float p) {
  dropout(x, n, seed, offset, p);
}
extern "C" __global__ void dropout_bf16(bf16_t* x, long long n, unsigned long long seed,
                                        unsigned long long offset, float p) {
  dropout(x, n, seed, offset, p);
}
extern "C" __global__ void dropout_f16(f16_t* x, long long n, unsigned long long seed,
                                       unsigned long long offset, float p) {
  dropout(x, n, seed, offset, p);
}


extern "C" __global__ void fill_f32(float* x, long long n, float value) { fill(x, n, value); }
extern "C" __global__ void fill_bf16(bf16_t* x, long long n, float value) { fill(x, n, value); }
extern "C" __global__ void fill_f16(f16_t* x, long long n, float value) { fill(x, n, value); }

extern "C" __global__ void add_bias_rows_f32(float* y, const float* bias, long long rows,
                                             long long cols) {
  add_bias_rows(y, bias, rows, cols);
}
extern "C" __global__ void add_bias_rows_bf16(bf16_t* y, const bf16_t* bias, long long rows,
                                              long long cols) {
  add_bias_rows(y, bias, rows, cols);
}
extern "C" __global__ void add_bias_rows_f16(f16_t* y, const f16_t* bias, long long rows,
                                             long long cols) {
  add_bias_rows(y, bias, rows, cols);
}
