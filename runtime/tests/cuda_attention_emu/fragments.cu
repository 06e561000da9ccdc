// Test kernels for the prelude's tensor-core building blocks as the attention kernels use them:
// ldmatrix fragments, cp.async groups, the f16 mma, 16-bit packing and ex2.approx.

// Four 8x8 matrices of 16-bit values, m[32][8] row-major (matrix i is rows 8i .. 8i+7), copied
// to dynamic shared memory; lane l passes row l. out[l][0..3] = fz_ldmatrix_x4,
// out[l][4..7] = fz_ldmatrix_x4_trans.
extern "C" __global__ void t_ldmatrix(const unsigned short* m, unsigned* out) {
  FZ_DYNAMIC_SMEM(unsigned short, sm);
  const int lane = threadIdx.x;
  for (int i = 0; i < 8; ++i) sm[lane * 8 + i] = m[lane * 8 + i];
  __syncthreads();
  unsigned r[4], t[4];
  fz_ldmatrix_x4(r, fz_smem(sm + lane * 8));
  fz_ldmatrix_x4_trans(t, fz_smem(sm + lane * 8));
  for (int i = 0; i < 4; ++i) {
    out[lane * 8 + i] = r[i];
    out[lane * 8 + 4 + i] = t[i];
  }
}

// 32 threads; thread i copies src[4i .. 4i+3] (zeros for odd i) to shared slot i in group 1 and
// src[128 + 4i ..] to slot 32 + i in group 2. out[i] = slot i as read before any wait (the
// poison of fresh shared memory), out[32 + i] = slot 32 + i after wait<1> (still poison: its
// group is the newest), out[64 + 4i ..] = slot i of thread 31 - i after wait<1> and a barrier,
// out[192 + 4i ..] = slot 32 + i of thread 31 - i after wait<0> and a barrier.
extern "C" __global__ void t_cp_async(const float* src, float* out) {
  FZ_DYNAMIC_SMEM(float, sm);
  const int i = threadIdx.x, j = 31 - i;
  fz_cp_async16(fz_smem(sm + 4 * i), src + 4 * i, (i & 1) == 0);
  fz_cp_async_commit();
  fz_cp_async16(fz_smem(sm + 128 + 4 * i), src + 128 + 4 * i, true);
  fz_cp_async_commit();
  out[i] = sm[4 * i];
  fz_cp_async_wait<1>();
  out[32 + i] = sm[128 + 4 * i];
  __syncthreads();
  for (int k = 0; k < 4; ++k) out[64 + 4 * i + k] = sm[4 * j + k];
  fz_cp_async_wait<0>();
  __syncthreads();
  for (int k = 0; k < 4; ++k) out[192 + 4 * i + k] = sm[128 + 4 * j + k];
}

// A misaligned cp.async (an error in the emulator, as on the GPU).
extern "C" __global__ void t_cp_async_misaligned(const float* src, float* out) {
  FZ_DYNAMIC_SMEM(float, sm);
  fz_cp_async16(fz_smem(sm + 1), src, true);
  fz_cp_async_wait<0>();
  out[0] = sm[1];
}

// t_mma's layout with IEEE binary16 inputs.
extern "C" __global__ void t_mma_f16(const unsigned short* A, const unsigned short* B,
                                     const float* C, float* D) {
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
  fz_mma_m16n8k16_f16(d, a, b, c);
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
  D[(g + 8) * 8 + 2 * t] = d[2];
  D[(g + 8) * 8 + 2 * t + 1] = d[3];
}

// Element-wise: pk[i] = fz_pack2<bf16_t>(x[2i], x[2i+1]), ph[i] = fz_pack2<f16_t>(...),
// e[i] = fz_exp2_approx(y[i]).
extern "C" __global__ void t_pack_exp2(const float* x, unsigned* pb, unsigned* ph, const float* y,
                                       float* e, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    pb[i] = fz_pack2<bf16_t>(x[2 * i], x[2 * i + 1]);
    ph[i] = fz_pack2<f16_t>(x[2 * i], x[2 * i + 1]);
    e[i] = fz_exp2_approx(y[i]);
  }
}
