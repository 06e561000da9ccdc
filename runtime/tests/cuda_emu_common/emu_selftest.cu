// emu_selftest.cu: kernels that exercise the emulator's CUDA semantics (not ferrozero kernels).
// Valid CUDA: the same text compiles with NVRTC.

// out[t] = the shuffle of (1000 + t) with this lane's argument args[t] and `width`;
// mode 0 idx, 1 up, 2 down, 3 xor. Block (any size); full mask.
extern "C" __global__ void t_shfl(const int* args, unsigned* out, int mode, int width) {
  const unsigned t = threadIdx.x;
  const unsigned v = 1000 + t;
  const int a = args[t];
  unsigned r;
  if (mode == 0)
    r = __shfl_sync(0xffffffffu, v, a, width);
  else if (mode == 1)
    r = __shfl_up_sync(0xffffffffu, v, static_cast<unsigned>(a), width);
  else if (mode == 2)
    r = __shfl_down_sync(0xffffffffu, v, static_cast<unsigned>(a), width);
  else
    r = __shfl_xor_sync(0xffffffffu, v, a, width);
  out[t] = r;
}

// 64-bit and float shuffles: out[t] = value of lane (t ^ 1), as double and as long long.
extern "C" __global__ void t_shfl_wide(double* outd, long long* outl) {
  const unsigned t = threadIdx.x;
  outd[t] = __shfl_xor_sync(0xffffffffu, 0.5 + t, 1);
  outl[t] = __shfl_xor_sync(0xffffffffu, (1ll << 40) + t, 1);
}

// Lanes in `mask` vote on pred[t]: out[3t] = ballot, out[3t+1] = any, out[3t+2] = all.
extern "C" __global__ void t_vote(const int* pred, unsigned* out, unsigned mask) {
  const unsigned t = threadIdx.x;
  if (!((mask >> (t & 31)) & 1)) return;
  out[3 * t] = __ballot_sync(mask, pred[t]);
  out[3 * t + 1] = __any_sync(mask, pred[t]);
  out[3 * t + 2] = __all_sync(mask, pred[t]);
}

// out[3t .. 3t+2] = __syncthreads_count / _and / _or of pred.
extern "C" __global__ void t_sync_votes(const int* pred, int* out) {
  const unsigned t = threadIdx.x;
  const int c = __syncthreads_count(pred[t]);
  const int a = __syncthreads_and(pred[t]);
  const int o = __syncthreads_or(pred[t]);
  out[3 * t] = c;
  out[3 * t + 1] = a;
  out[3 * t + 2] = o;
}

// A 3-D block reverses `in` through static shared memory; also records its indices.
extern "C" __global__ void t_reverse_3d(const float* in, float* out, unsigned* idx) {
  __shared__ float s[1024];
  const unsigned n = blockDim.x * blockDim.y * blockDim.z;
  const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  s[t] = in[b * n + t];
  __syncthreads();
  out[b * n + t] = s[n - 1 - t];
  idx[4 * (b * n + t)] = threadIdx.x;
  idx[4 * (b * n + t) + 1] = threadIdx.y;
  idx[4 * (b * n + t) + 2] = threadIdx.z;
  idx[4 * (b * n + t) + 3] = b;
}

// Dynamic shared memory (the prelude's FZ_DYNAMIC_SMEM): first[b] = the first word before
// anyone wrote it (poison in the emulator, before every block), then a reversal through it.
extern "C" __global__ void t_dyn_smem(unsigned* first, float* out) {
  FZ_DYNAMIC_SMEM(float, s);
  const unsigned t = threadIdx.x, n = blockDim.x;
  if (t == 0) first[blockIdx.x] = __float_as_uint(s[0]);
  __syncthreads();
  s[t] = static_cast<float>(t + 1000 * blockIdx.x);
  __syncthreads();
  out[blockIdx.x * n + t] = s[n - 1 - t];
}

// Threads at different __syncthreads() calls (undefined in CUDA: an error here).
extern "C" __global__ void t_divergent_barrier(int* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
    out[threadIdx.x] = 1;
  } else {
    __syncthreads();
    out[threadIdx.x] = 2;
  }
}

// Lane 0 waits at a block barrier while the others wait at a shuffle: a deadlock.
extern "C" __global__ void t_deadlock(int* out) {
  if (threadIdx.x == 0) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x), 0);
  }
}

// A mask without the calling lane.
extern "C" __global__ void t_bad_mask(int* out) {
  out[threadIdx.x] = __shfl_sync(0x2u, 1, 1);
}

extern "C" __global__ void t_trap(int* out) {
  if (threadIdx.x == 5) __trap();
  out[threadIdx.x] = 1;
}

// Writes through `p` (null: a fault the emulator reports).
extern "C" __global__ void t_fault(int* p) {
  if (threadIdx.x == 3) p[blockIdx.x] = 1;
}

__device__ int deep_recursion(int n) {
  volatile char buf[512];
  buf[0] = static_cast<char>(n);
  return n == 0 ? buf[0] : deep_recursion(n - 1) + buf[0];
}

// Overflows a fiber's stack.
extern "C" __global__ void t_stack_overflow(int* out) { out[0] = deep_recursion(1 << 20); }

// Threads >= `live` return at once; the rest meet at a barrier twice (exited threads count as
// arrived), then lanes of a warp with exited lanes shuffle among the living.
extern "C" __global__ void t_early_exit(int live, int* out) {
  const int t = threadIdx.x;
  if (t >= live) return;
  __shared__ int s[1024];
  s[t] = t;
  __syncthreads();
  int v = s[live - 1 - t];
  __syncthreads();
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[t] = v;
}

// A full-mask butterfly sum in a block whose last warp is partial: lanes that do not exist
// give poison to their partners.
extern "C" __global__ void t_partial_warp_sum(const float* in, float* out) {
  float v = in[threadIdx.x];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  out[threadIdx.x] = v;
}

// Two half-warps synchronise independently with their own masks.
extern "C" __global__ void t_half_warps(int* out) {
  const unsigned t = threadIdx.x;
  const unsigned mask = t < 16 ? 0x0000ffffu : 0xffff0000u;
  __syncwarp(mask);
  out[t] = __shfl_sync(mask, static_cast<int>(t), t < 16 ? 15 : 16);
}

// Many threads, a few barriers and shuffles: for timing.
extern "C" __global__ void t_busy(float* out) {
  __shared__ float s[1024];
  float v = static_cast<float>(threadIdx.x);
  for (int it = 0; it < 4; ++it) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    s[threadIdx.x] = v;
    __syncthreads();
    v = s[(threadIdx.x + 1) % blockDim.x] * 0.5f;
    __syncthreads();
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

// One warp multiplies A (16x16, row-major bf16 bits) by B (16x8, row-major k x n bf16 bits)
// plus C (16x8 f32, row-major) through the prelude's tensor-core helper, packing fragments as
// PTX documents them; D is 16x8 f32 row-major.
extern "C" __global__ void t_mma(const unsigned short* A, const unsigned short* B, const float* C,
                                 float* D) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  unsigned a[4], b[2];
  a[0] = A[g * 16 + 2 * t] | (static_cast<unsigned>(A[g * 16 + 2 * t + 1]) << 16);
  a[1] = A[(g + 8) * 16 + 2 * t] | (static_cast<unsigned>(A[(g + 8) * 16 + 2 * t + 1]) << 16);
  a[2] = A[g * 16 + 2 * t + 8] | (static_cast<unsigned>(A[g * 16 + 2 * t + 9]) << 16);
  a[3] = A[(g + 8) * 16 + 2 * t + 8] | (static_cast<unsigned>(A[(g + 8) * 16 + 2 * t + 9]) << 16);
  b[0] = B[(2 * t) * 8 + g] | (static_cast<unsigned>(B[(2 * t + 1) * 8 + g]) << 16);
  b[1] = B[(2 * t + 8) * 8 + g] | (static_cast<unsigned>(B[(2 * t + 9) * 8 + g]) << 16);
  const float c[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t],
                      C[(g + 8) * 8 + 2 * t + 1]};
  float d[4];
  fz_mma_m16n8k16_bf16(d, a, b, c);
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
  D[(g + 8) * 8 + 2 * t] = d[2];
  D[(g + 8) * 8 + 2 * t + 1] = d[3];
}
