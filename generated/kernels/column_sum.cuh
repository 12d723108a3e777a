// Deterministic column reductions: out[c] = the sum over splits s of partials[s][c].
// The fp32 partials come from norm and elementwise backward kernels, one row per block of theirs:
// as many rows as their grid's wave holds (up to a few thousand at narrow widths). The column_sum
// kernel adds them in a second launch; a norm backward of few rows adds them itself, after a barrier
// across its grid (a single cooperative launch: finish_column_sums), and an elementwise backward of
// few rows sums whole columns in each block (sum_row_lanes).
//
// column_sum:
// A block takes COLS consecutive columns with LANES threads each: lane l sums splits l, l + LANES,
// ... (a warp reads COLS consecutive floats of one split), then lane 0 adds the LANES lane sums in
// lane order. The order is fixed, so the result is the same run to run; both levels are
// compensated (Kahan), so thousands of fp32 partials lose no more than a rounding or two.
#pragma once
#include "common.cuh"

namespace fg {

constexpr int COLUMN_SUM_COLS = 32;   // blockDim.x: columns per block
constexpr int COLUMN_SUM_LANES = 32;  // blockDim.y: threads summing one column

struct Compensated {
  float total = 0.f, carry = 0.f;
  __device__ __forceinline__ void add(float v) {
    const float y = v - carry;
    const float t = total + y;
    carry = (t - total) - y;
    total = t;
  }
};

template <typename T, int N>
__device__ __forceinline__ void column_sum(const float* __restrict__ partials, T* __restrict__ out, int splits) {
  __shared__ float lane_sums[COLUMN_SUM_LANES][COLUMN_SUM_COLS + 1];  // +1: no bank conflicts
  const int c = blockIdx.x * COLUMN_SUM_COLS + threadIdx.x;
  Compensated lane;
  if (c < N) {
    for (int s = threadIdx.y; s < splits; s += COLUMN_SUM_LANES) lane.add(partials[(long long)s * N + c]);
  }
  lane_sums[threadIdx.y][threadIdx.x] = lane.total;
  __syncthreads();
  if (threadIdx.y != 0 || c >= N) return;
  Compensated column;
#pragma unroll
  for (int l = 0; l < COLUMN_SUM_LANES; ++l) column.add(lane_sums[l][threadIdx.x]);
  out[c] = from_float<T>(column.total);
}

// A barrier across the whole grid, for a kernel launched cooperatively (the runtime's
// Kernel.launch(..., cooperative=True): cuLaunchCooperativeKernel, which starts the grid only if
// every block is resident at once). The barrier word is in the driver's grid workspace, whose
// address a cooperative launch passes in %envreg1 (high half) and %envreg2 (low): the ABI that
// cooperative_groups' grid.sync() reads (cooperative_groups/details/driver_abi.h, sync.h). Its
// header is not included because it needs CCCL's, which the pinned toolchain does not ship.
// Block 0 adds 0x80000000 - (blocks - 1), every other block 1: the word's top bit flips once all
// have arrived, whatever the word held before, so it needs no reset and barriers may follow.
__device__ __forceinline__ void grid_sync() {
  __syncthreads();  // the block's writes happen before its arrival (released by the atomic)
  if (threadIdx.x + threadIdx.y + threadIdx.z == 0) {
    unsigned int high, low;
    asm volatile("mov.u32 %0, %%envreg1;" : "=r"(high));
    asm volatile("mov.u32 %0, %%envreg2;" : "=r"(low));
    // struct grid_workspace { unsigned int size, barrier; }
    unsigned int* barrier = reinterpret_cast<unsigned int*>(((unsigned long long)high << 32) | low) + 1;
    const unsigned int blocks = gridDim.x * gridDim.y * gridDim.z;
    const unsigned int arrive = blockIdx.x + blockIdx.y + blockIdx.z == 0 ? 0x80000000u - (blocks - 1) : 1u;
    unsigned int before, now;
    asm volatile("atom.add.release.gpu.u32 %0, [%1], %2;" : "=r"(before) : "l"(barrier), "r"(arrive) : "memory");
    do {
      asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(barrier) : "memory");
    } while (((before ^ now) & 0x80000000u) == 0);
  }
  __syncthreads();
}

// A backward's parameter grads in the same launch: with `grads` given (the launcher launched the
// kernel cooperatively, for at most a few dozen row splits: the runtime's SUMS_IN_KERNEL_SPLITS),
// once every block has written its partials row, each thread of the grid sums whole columns over
// the splits in order (compensated, as column_sum does). Partials are read through L2
// (ld.global.cg): other blocks wrote them during this kernel, so no L1 or read-only-cache copy may
// serve them. Every thread of the block must call this.
template <typename T>
__device__ __forceinline__ void finish_column_sums(const float* partials, T* grads, int splits, int columns) {
  if (grads == nullptr) return;
  grid_sync();
  const int threads = blockDim.x * blockDim.y;
  const int first = (blockIdx.y * gridDim.x + blockIdx.x) * threads + threadIdx.y * blockDim.x + threadIdx.x;
  for (int c = first; c < columns; c += gridDim.x * gridDim.y * threads) {
    Compensated column;
#pragma unroll 8  // independent loads in flight; the sum's order stays fixed
    for (int s = 0; s < splits; ++s) column.add(__ldcg(partials + (long long)s * columns + c));
    grads[c] = from_float<T>(column.total);
  }
}

// A column-tiled backward's parameter grads (templates/elementwise/elementwise_bwd.cu.j2,
// launched for a few rows with blockDim.y row lanes and one block a column tile): lane y has
// summed rows y, y + blockDim.y, ... of the thread's VEC columns; the lanes' sums meet in shared memory (blockDim.x * blockDim.y *
// VEC floats of dynamic shared memory) and lane 0 adds them in lane order and writes the grads, so
// no barrier across the grid and no second launch is needed. Deterministic. Every thread of the
// block must call this (it has barriers); ``active``: the thread's columns lie in the row.
template <typename T, int VEC>
__device__ __forceinline__ void sum_row_lanes(const float (&sums)[VEC], T* grads, bool active) {
  extern __shared__ __align__(32) float lane_sums[];  // [blockDim.y][blockDim.x][VEC]
  store<float, VEC>(lane_sums + (threadIdx.y * blockDim.x + threadIdx.x) * VEC, sums);
  __syncthreads();
  if (threadIdx.y == 0 && active) {
    float total[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) total[k] = sums[k];
    for (int lane = 1; lane < blockDim.y; ++lane) {
      float t[VEC];
      load<float, VEC>(lane_sums + (lane * blockDim.x + threadIdx.x) * VEC, t);
#pragma unroll
      for (int k = 0; k < VEC; ++k) total[k] += t[k];
    }
    store<T, VEC>(grads, total);
  }
  __syncthreads();  // the next grad's call reuses lane_sums
}

}  // namespace fg
