// quant.cu: ZeRO++'s block quantizer (qwZ's weights, qgZ's gradients), DeepSpeed's symmetric
// formula (csrc/includes/quantization_utils.h). `tensor/quant.rs` is its CPU twin, bit for
// bit: the block's largest magnitude is a maximum (exact in any order), and every other value
// is one IEEE operation the host performs alike.
//
//   quantize_T(const T* x, long long n, int block, int bits, unsigned char* out)
//       Packs n elements in blocks of `block`: out[0 .. 4 nb) the nb = ceil(n / block) blocks'
//       inverse scales as f32, then the codes (bits 8: one signed byte each; bits 4: two per
//       byte, the first in the low nibble; `block` even), then zero bytes up to a multiple of
//       4 (overwritten). Per block: amax = max |x| (NaN skipped, as fmaxf does),
//       scale = 2^bits / (2 amax) (1 when amax is 0), q = clamp(rn(x * scale),
//       -2^(bits-1), 2^(bits-1) - 1), stored inverse 1 / scale.
//       Launch: grid nb (one CUDA block per quantization block), 256 threads.
//   dequantize_T(const unsigned char* src, long long n, int block, int bits, T* y)
//       y[i] = code_i * inv_(i / block), rounded once to T (overwritten).
//       Launch: any 1-D grid (grid-stride).

#define QUANT_THREADS 256

__device__ __forceinline__ int quant_code(float v, float scale, int bits) {
  const int lo = -(1 << (bits - 1));
  const int hi = (1 << (bits - 1)) - 1;
  const int q = __float2int_rn(v * scale);
  return q < lo ? lo : (q > hi ? hi : q);
}

template <class T>
__device__ void quantize_block(const T* x, long long n, int block, int bits, unsigned char* out) {
  __shared__ float s_max[QUANT_THREADS];
  const long long nb = (n + block - 1) / block;
  const long long start = static_cast<long long>(blockIdx.x) * block;
  const long long end = start + block < n ? start + block : n;
  float m = 0.0f;
  for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
    m = fmaxf(m, fabsf(to_f32(x[i])));
  }
  s_max[threadIdx.x] = m;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) {
      s_max[threadIdx.x] = fmaxf(s_max[threadIdx.x], s_max[threadIdx.x + s]);
    }
    __syncthreads();
  }
  const float amax = s_max[0];
  const float scale = amax == 0.0f ? 1.0f : static_cast<float>(1 << bits) / (2.0f * amax);
  unsigned char* codes = out + 4 * nb;
  if (threadIdx.x == 0) {
    const float inv = 1.0f / scale;
    const unsigned bitsv = __float_as_uint(inv);
    for (int k = 0; k < 4; ++k) out[4 * blockIdx.x + k] = static_cast<unsigned char>(bitsv >> (8 * k));
  }
  if (bits == 8) {
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
      codes[i] = static_cast<unsigned char>(quant_code(to_f32(x[i]), scale, 8) & 0xff);
    }
  } else {
    // One thread per byte: elements 2j and 2j + 1 (the block is even, so both are its own).
    for (long long i = start + 2 * threadIdx.x; i < end; i += 2 * blockDim.x) {
      const int a = quant_code(to_f32(x[i]), scale, 4) & 0xf;
      const int b = i + 1 < end ? quant_code(to_f32(x[i + 1]), scale, 4) & 0xf : 0;
      codes[i / 2] = static_cast<unsigned char>(a | (b << 4));
    }
  }
  if (blockIdx.x == nb - 1 && threadIdx.x == 0) {
    const long long code_bytes = (n * bits + 7) / 8;
    const long long used = 4 * nb + code_bytes;
    const long long total = (used + 3) / 4 * 4;
    for (long long k = used; k < total; ++k) out[k] = 0;
  }
}

template <class T>
__device__ void dequantize_all(const unsigned char* src, long long n, int block, int bits, T* y) {
  const long long nb = (n + block - 1) / block;
  const unsigned char* codes = src + 4 * nb;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const long long b = i / block;
    const unsigned bitsv = static_cast<unsigned>(src[4 * b]) | (static_cast<unsigned>(src[4 * b + 1]) << 8) |
                           (static_cast<unsigned>(src[4 * b + 2]) << 16) |
                           (static_cast<unsigned>(src[4 * b + 3]) << 24);
    const float inv = __uint_as_float(bitsv);
    int q;
    if (bits == 8) {
      q = static_cast<int>(static_cast<signed char>(codes[i]));
    } else {
      const int byte = codes[i / 2];
      const int nib = (i % 2 == 0) ? (byte & 0xf) : (byte >> 4);
      q = nib >= 8 ? nib - 16 : nib;
    }
    y[i] = from_f32<T>(static_cast<float>(q) * inv);
  }
}

extern "C" __global__ void quantize_f32(const float* x, long long n, int block, int bits,
                                     unsigned char* out) {
  quantize_block(x, n, block, bits, out);
}

extern "C" __global__ void quantize_bf16(const bf16_t* x, long long n, int block, int bits,
                                     unsigned char* out) {
  quantize_block(x, n, block, bits, out);
}

extern "C" __global__ void quantize_f16(const f16_t* x, long long n, int block, int bits,
                                     unsigned char* out) {
  quantize_block(x, n, block, bits, out);
}

extern "C" __global__ void dequantize_f32(const unsigned char* src, long long n, int block,
                                       int bits, float* y) {
  dequantize_all(src, n, block, bits, y);
}

extern "C" __global__ void dequantize_bf16(const unsigned char* src, long long n, int block,
                                       int bits, bf16_t* y) {
  dequantize_all(src, n, block, bits, y);
}

extern "C" __global__ void dequantize_f16(const unsigned char* src, long long n, int block,
                                       int bits, f16_t* y) {
  dequantize_all(src, n, block, bits, y);
}
