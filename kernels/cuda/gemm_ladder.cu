// The CUDA C++ GEMM ladder: C = A @ B in fp32, A (M, K), B (K, N), C (M, N) row-major, one kernel per
// step, each changing one thing. Launched by kernels.gemm.cuda_ladder (grid and block per step);
// compiled ahead of time by the gemm-tiling chapter, which reads each step's SASS. Steps 3-5 assume
// M, N and K are multiples of their tile (the launcher refuses other shapes by name).

// Step 1, naive: one thread per element of C, threadIdx.x walking the ROWS. The 32 lanes of a warp
// read 32 different rows of A (addresses K floats apart) and write 32 rows of C: uncoalesced.
extern "C" __global__ void sgemm_naive(int M, int N, int K, const float* A, const float* B, float* C) {
  int row = blockIdx.x * blockDim.x + threadIdx.x;
  int col = blockIdx.y * blockDim.y + threadIdx.y;
  if (row < M && col < N) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += A[row * K + k] * B[k * N + col];   // c_ij = sum_k a_ik b_kj
    C[row * N + col] = acc;
  }
}

// Step 2, coalesced: the same arithmetic, threadIdx.x walking the COLUMNS: a warp reads one row of A
// (one address, broadcast) and 32 consecutive floats of B (one 128-byte line), and writes one line of C.
extern "C" __global__ void sgemm_coalesced(int M, int N, int K, const float* A, const float* B, float* C) {
  int col = blockIdx.x * blockDim.x + threadIdx.x;
  int row = blockIdx.y * blockDim.y + threadIdx.y;
  if (row < M && col < N) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += A[row * K + k] * B[k * N + col];
    C[row * N + col] = acc;
  }
}

// Step 3, shared-memory tiles: a 32x32 block of threads stages 32x32 tiles of A and B in shared
// memory; each global element is read once per tile instead of 32 times.
#define TS 32
extern "C" __global__ void sgemm_smem(int M, int N, int K, const float* A, const float* B, float* C) {
  __shared__ float As[TS][TS];
  __shared__ float Bs[TS][TS];
  int tx = threadIdx.x, ty = threadIdx.y;
  int row = blockIdx.y * TS + ty, col = blockIdx.x * TS + tx;
  float acc = 0.f;
  for (int k0 = 0; k0 < K; k0 += TS) {
    As[ty][tx] = A[row * K + k0 + tx];            // coalesced: tx along a row of A
    Bs[ty][tx] = B[(k0 + ty) * N + col];          // coalesced: tx along a row of B
    __syncthreads();
    for (int k = 0; k < TS; ++k) acc += As[ty][k] * Bs[k][tx];   // As[ty][k]: broadcast; Bs[k][tx]: 32 banks
    __syncthreads();
  }
  C[row * N + col] = acc;
}

// Step 4, 1-D register blocking: a 64x64 tile of C per block of 512 threads, each thread TM = 8
// elements of one column. Each B value read from shared memory feeds 8 FMAs from registers.
#define BM4 64
#define BN4 64
#define BK4 8
#define TM4 8
extern "C" __global__ void __launch_bounds__(512) sgemm_blocktile_1d(int M, int N, int K, const float* A,
                                                                     const float* B, float* C) {
  __shared__ float As[BM4 * BK4];
  __shared__ float Bs[BK4 * BN4];
  int tid = threadIdx.x;
  int tcol = tid % BN4, trow = tid / BN4;                     // trow in [0, 8): rows trow*8 .. trow*8+7
  int ar = tid / BK4, ac = tid % BK4, br = tid / BN4, bc = tid % BN4;
  A += (long)blockIdx.y * BM4 * K;
  B += blockIdx.x * BN4;
  C += (long)blockIdx.y * BM4 * N + blockIdx.x * BN4;
  float acc[TM4] = {0.f};
  for (int k0 = 0; k0 < K; k0 += BK4) {
    As[ar * BK4 + ac] = A[ar * K + ac];
    Bs[br * BN4 + bc] = B[br * N + bc];
    __syncthreads();
    A += BK4;
    B += BK4 * N;
    for (int k = 0; k < BK4; ++k) {
      float b = Bs[k * BN4 + tcol];                           // one shared load ...
      for (int i = 0; i < TM4; ++i) acc[i] += As[(trow * TM4 + i) * BK4 + k] * b;   // ... 8 FMAs
    }
    __syncthreads();
  }
  for (int i = 0; i < TM4; ++i) C[(trow * TM4 + i) * N + tcol] = acc[i];
}

// Step 5, 2-D register blocking with 16-byte loads: a 128x128 tile per block of 256 threads, each
// thread an 8x8 sub-tile (64 accumulators in registers). A and B arrive as float4 (LDG.E.128); A is
// stored transposed in shared memory so a thread reads its 8 A values as two float4 (LDS.128);
// every k step is 8 + 8 loaded values for 64 FMAs.
#define BM5 128
#define BN5 128
#define BK5 8
#define TM5 8
#define TN5 8
extern "C" __global__ void __launch_bounds__(256) sgemm_vectorized(int M, int N, int K, const float* A,
                                                                   const float* B, float* C) {
  __shared__ float As[BK5 * BM5];                             // transposed: As[k][m]
  __shared__ float Bs[BK5 * BN5];
  int tid = threadIdx.x;
  int trow = tid / (BN5 / TN5), tcol = tid % (BN5 / TN5);     // 16 x 16 threads
  int ar = tid / (BK5 / 4), ac = (tid % (BK5 / 4)) * 4;       // A tile 128 x 8: one float4 per thread
  int br = tid / (BN5 / 4), bc = (tid % (BN5 / 4)) * 4;       // B tile 8 x 128: one float4 per thread
  A += (long)blockIdx.y * BM5 * K;
  B += blockIdx.x * BN5;
  C += (long)blockIdx.y * BM5 * N + blockIdx.x * BN5;
  float acc[TM5 * TN5] = {0.f};
  float ra[TM5], rb[TN5];
  for (int k0 = 0; k0 < K; k0 += BK5) {
    float4 a4 = reinterpret_cast<const float4*>(&A[ar * K + ac])[0];
    As[(ac + 0) * BM5 + ar] = a4.x;
    As[(ac + 1) * BM5 + ar] = a4.y;
    As[(ac + 2) * BM5 + ar] = a4.z;
    As[(ac + 3) * BM5 + ar] = a4.w;
    reinterpret_cast<float4*>(&Bs[br * BN5 + bc])[0] = reinterpret_cast<const float4*>(&B[br * N + bc])[0];
    __syncthreads();
    A += BK5;
    B += BK5 * N;
    for (int k = 0; k < BK5; ++k) {
      for (int i = 0; i < TM5; i += 4) {
        float4 v = reinterpret_cast<const float4*>(&As[k * BM5 + trow * TM5 + i])[0];
        ra[i] = v.x; ra[i + 1] = v.y; ra[i + 2] = v.z; ra[i + 3] = v.w;
      }
      for (int j = 0; j < TN5; j += 4) {
        float4 v = reinterpret_cast<const float4*>(&Bs[k * BN5 + tcol * TN5 + j])[0];
        rb[j] = v.x; rb[j + 1] = v.y; rb[j + 2] = v.z; rb[j + 3] = v.w;
      }
      for (int i = 0; i < TM5; ++i)
        for (int j = 0; j < TN5; ++j) acc[i * TN5 + j] += ra[i] * rb[j];   // outer product: 64 FMAs
    }
    __syncthreads();
  }
  for (int i = 0; i < TM5; ++i)
    for (int j = 0; j < TN5; j += 4)
      reinterpret_cast<float4*>(&C[(trow * TM5 + i) * N + tcol * TN5 + j])[0] =
          make_float4(acc[i * TN5 + j], acc[i * TN5 + j + 1], acc[i * TN5 + j + 2], acc[i * TN5 + j + 3]);
}
