// Row normalization (LayerNorm, RMSNorm; L2Normalization: x / sqrt(sum(x^2) + eps), no gamma)
// forward and backward, as in TE (catalog 2.7, 2.8).
//
// Why: one block per row in the forward keeps the whole row in registers (16-byte vectors), so x
// is read once and y written once; statistics are exact two-pass sums over the registers, in
// fp32. The backward gives each block a fixed, strided set of rows and sums dgamma/dbeta for its
// columns, then writes one fp32 partial row per block; a column-sum kernel adds the partials in
// block order. No atomics, so the parameter grads are identical run to run.
// Where the backward sums its partials (generator/stages/norm/tuning.py:
// norm_bwd_shared_partials): in shared memory when they fit in 96 KB (row_norm_bwd_shared: about 2 vectors a thread, x and dy
// read again after the row's reduction, two blocks an SM), else in registers
// (row_norm_bwd_registers: wider rows, and L2Normalization, which has none).
// Threads per block (generator/stages/norm/tuning.py: norm_threads): the forward's give each
// thread about 4 of the row's H / VEC vectors (128 to 512 threads: the row's loads in flight together, cheaper
// barriers); the shared-memory backward's about 2, the register backward's one, up to 1024
// threads. Each thread holds NV = ceil(H / VEC / THREADS) vectors, the last ones guarded when
// THREADS does not divide.
// Launch: forward grid = rows; backward grid = S >= 1 row splits, partials sized [S, M * H]: the
// launcher's S is one wave, as many blocks as the device holds at once (at most rows), so every
// SM works through its rows to the end together (bench/NOTES.md: up to 38% faster than a fixed
// 256 splits).
// Every T pointer must be VEC * sizeof(T)-byte aligned (16 bytes from torch allocations); gamma
// and beta are T too. Static shared memory is tiny (2 * THREADS / 32 floats at most); the
// shared-memory backward also takes M * H * 4 bytes of dynamic shared memory.
#pragma once
#include "amax.cuh"        // an FP8 GEMM's x: its amax kept as it is stored (the _amax variants)
#include "column_sum.cuh"  // and common.cuh

namespace fg {

template <int H, int VEC, int THREADS>
struct RowTiling {
  static_assert(H % VEC == 0, "VEC must divide H");
  static_assert(THREADS % 32 == 0 && THREADS >= 32 && THREADS <= 1024, "THREADS: whole warps, at most 1024");
  static constexpr int NVEC = H / VEC;                           // vectors per row
  static constexpr int NV = (NVEC + THREADS - 1) / THREADS;      // vectors per thread
  static __device__ __forceinline__ bool valid(int i) { return threadIdx.x + i * THREADS < NVEC; }
  static __device__ __forceinline__ int col(int i) { return (threadIdx.x + i * THREADS) * VEC; }
};

// No elementwise ops before (or after) the norm.
struct NoOps {
  __host__ __device__ static constexpr bool active() { return false; }
  template <int VEC>
  __device__ __forceinline__ void operator()(float (&)[VEC], long long, int, int) const {}
};

// A norm forward, optionally with elementwise ops applied to x first (a Prologue: Bias, Dropout,
// ... before the residual add) and a residual added: h = prologue(x) [+ r], rounded to T, is
// written to residual_out whenever it differs from x (the residual stream, and what the backward
// reads; a null residual_out: a forward without autograd whose caller does not want it; mean and
// rstd likewise); and with elementwise ops applied to the normalized row before it is stored (an
// Epilogue: Dropout, ...). Both are functors over one fp32 vector of a row, given its offset in
// the row-major [rows, H] tensor, its column and its row.
enum class Norm { RMS, LAYER, L2 };  // L2: rstd = rsqrt(sum(x^2) + eps) (no mean), no gamma

template <typename T, int H, int VEC, int THREADS, bool HOLD_PARAMS, bool LOADS_FIRST, Norm KIND, bool RESIDUAL,
          bool ZERO_CENTERED, class Prologue, class Epilogue>
__device__ __forceinline__ void row_norm_fwd(const T* __restrict__ x, const T* __restrict__ residual,
                                             const T* __restrict__ gamma, const T* __restrict__ beta,
                                             T* __restrict__ y, T* __restrict__ residual_out,
                                             float* __restrict__ mean, float* __restrict__ rstd, int rows,
                                             float eps, const Prologue prologue, const Epilogue epilogue,
                                             float* __restrict__ amax) {
  constexpr bool LAYERNORM = KIND == Norm::LAYER;
  constexpr bool WRITE_H = RESIDUAL || Prologue::active();
  using Tile = RowTiling<H, VEC, THREADS>;
  static_assert((VEC & (VEC - 1)) == 0 && VEC * sizeof(T) <= 16, "VEC: power of two, at most 16 bytes");
  __shared__ float smem[THREADS / 32];
  const int row = blockIdx.x;
  if (row >= rows) return;  // whole block leaves together, before any barrier
  const long long base = (long long)row * H;
  // HOLD_PARAMS: gamma and beta requested before the row and held as loaded (16-bit: half the
  // registers); loaded after the reduction's barriers they are a second round trip to memory.
  // LOADS_FIRST: a row that writes h issues all its loads before its first store (the compiler
  // keeps a load after a store in order, so each of a thread's vectors would otherwise be a round
  // trip of its own). Both shorten a block's latency, the kernel's at a few rows, and both cost
  // registers; where each pays is the generator's choice (stages/norm/tuning.py: norm_fwd_holds).
  static_assert(!HOLD_PARAMS || KIND != Norm::L2, "HOLD_PARAMS: a norm with parameters");
  Vec<T, VEC> gamma_early[HOLD_PARAMS ? Tile::NV : 1], beta_early[HOLD_PARAMS && LAYERNORM ? Tile::NV : 1];
  if (HOLD_PARAMS) {
#pragma unroll
    for (int i = 0; i < Tile::NV; ++i) {
      if (!Tile::valid(i)) continue;
      gamma_early[i] = load_raw<T, VEC>(gamma + Tile::col(i));
      if (LAYERNORM) beta_early[i] = load_raw<T, VEC>(beta + Tile::col(i));
    }
  }
  static_assert(!LOADS_FIRST || WRITE_H, "LOADS_FIRST: a row that writes h");
  Vec<T, VEC> x_early[LOADS_FIRST ? Tile::NV : 1], r_early[LOADS_FIRST && RESIDUAL ? Tile::NV : 1];
  if (LOADS_FIRST) {
#pragma unroll
    for (int i = 0; i < Tile::NV; ++i) {
      if (!Tile::valid(i)) continue;
      x_early[i] = load_raw<T, VEC>(x + base + Tile::col(i));
      if (RESIDUAL) r_early[i] = load_raw<T, VEC>(residual + base + Tile::col(i));
    }
  }
  float h[Tile::NV][VEC];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < Tile::NV; ++i) {
    if (!Tile::valid(i)) continue;
    if (LOADS_FIRST) to_floats<T, VEC>(x_early[i], h[i]);
    else load<T, VEC>(x + base + Tile::col(i), h[i]);
    prologue(h[i], base + Tile::col(i), Tile::col(i), row);
    if (WRITE_H) {
      // h = prologue(x) [+ r], rounded to T: the stored residual stream and what the backward reads.
      float r[VEC];
      if (RESIDUAL && LOADS_FIRST) to_floats<T, VEC>(r_early[i], r);
      else if (RESIDUAL) load<T, VEC>(residual + base + Tile::col(i), r);
#pragma unroll
      for (int k = 0; k < VEC; ++k) h[i][k] = to_float<T>(from_float<T>(RESIDUAL ? h[i][k] + r[k] : h[i][k]));
      if (residual_out != nullptr) store<T, VEC>(residual_out + base + Tile::col(i), h[i]);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) sum += LAYERNORM ? h[i][k] : h[i][k] * h[i][k];
  }
  sum = block_sum<THREADS>(sum, smem);
  float mu = 0.f, inv;
  if (LAYERNORM) {
    mu = sum / H;
    float m2 = 0.f;
#pragma unroll
    for (int i = 0; i < Tile::NV; ++i) {
      if (!Tile::valid(i)) continue;
#pragma unroll
      for (int k = 0; k < VEC; ++k) m2 += (h[i][k] - mu) * (h[i][k] - mu);
    }
    inv = rsqrtf(block_sum<THREADS>(m2, smem) / H + eps);
  } else {
    inv = rsqrtf((KIND == Norm::L2 ? sum : sum / H) + eps);
  }
  if (threadIdx.x == 0 && rstd != nullptr) {  // null: a forward without autograd, nothing reads them
    if (LAYERNORM) mean[row] = mu;
    rstd[row] = inv;
  }
  int amax_bits = 0;  // (an FP8 GEMM's x: max |y| as stored, amax.cuh)
#pragma unroll
  for (int i = 0; i < Tile::NV; ++i) {
    if (!Tile::valid(i)) continue;
    float g[VEC], b[VEC], out[VEC];
    if (KIND == Norm::L2) {
      fill<VEC>(1.f, g);
    } else if (HOLD_PARAMS) {
      to_floats<T, VEC>(gamma_early[i], g);
      if (LAYERNORM) to_floats<T, VEC>(beta_early[i], b);
    } else {
      load<T, VEC>(gamma + Tile::col(i), g);
      if (LAYERNORM) load<T, VEC>(beta + Tile::col(i), b);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float gk = ZERO_CENTERED ? g[k] + 1.f : g[k];
      out[k] = (h[i][k] - mu) * inv * gk + (LAYERNORM ? b[k] : 0.f);
    }
    epilogue(out, base + Tile::col(i), Tile::col(i), row);
    if (amax != nullptr) max_stored<T, VEC>(out, amax_bits);
    store<T, VEC>(y + base + Tile::col(i), out);
  }
  if (amax != nullptr) warp_amax_to(amax, amax_bits);
}

// LayerNorm / RMSNorm forward.
template <typename T, int H, int VEC, int THREADS, bool HOLD_PARAMS, bool LOADS_FIRST, bool LAYERNORM, bool RESIDUAL,
          bool ZERO_CENTERED, class Prologue = NoOps, class Epilogue = NoOps>
__device__ __forceinline__ void norm_fwd(const T* __restrict__ x, const T* __restrict__ residual,
                                         const T* __restrict__ gamma, const T* __restrict__ beta,
                                         T* __restrict__ y, T* __restrict__ residual_out,
                                         float* __restrict__ mean, float* __restrict__ rstd, int rows,
                                         float eps, const Prologue prologue = Prologue(),
                                         const Epilogue epilogue = Epilogue(), float* amax = nullptr) {
  row_norm_fwd<T, H, VEC, THREADS, HOLD_PARAMS, LOADS_FIRST, LAYERNORM ? Norm::LAYER : Norm::RMS, RESIDUAL,
               ZERO_CENTERED>(
      x, residual, gamma, beta, y, residual_out, mean, rstd, rows, eps, prologue, epilogue, amax);
}

// L2Normalization forward (gamma and beta unused).
template <typename T, int H, int VEC, int THREADS, bool LOADS_FIRST, bool RESIDUAL, class Prologue = NoOps,
          class Epilogue = NoOps>
__device__ __forceinline__ void l2norm_fwd(const T* __restrict__ x, const T* __restrict__ residual,
                                           const T* __restrict__ gamma, const T* __restrict__ beta,
                                           T* __restrict__ y, T* __restrict__ residual_out,
                                           float* __restrict__ mean, float* __restrict__ rstd, int rows,
                                           float eps, const Prologue prologue = Prologue(),
                                           const Epilogue epilogue = Epilogue(), float* amax = nullptr) {
  row_norm_fwd<T, H, VEC, THREADS, false, LOADS_FIRST, Norm::L2, RESIDUAL, false>(
      x, residual, gamma, beta, y, residual_out, mean, rstd, rows, eps, prologue, epilogue, amax);
}

// Backward, parameter-grad partials in registers: rows too wide for shared memory, and L2 (none).
template <typename T, int H, int VEC, int THREADS, Norm KIND, bool ADD_DRESIDUAL, bool ZERO_CENTERED>
__device__ __forceinline__ void row_norm_bwd_registers(const T* __restrict__ dy, const T* __restrict__ x,
                                             const float* __restrict__ mean, const float* __restrict__ rstd,
                                             const T* __restrict__ gamma, const T* __restrict__ dresidual,
                                             T* __restrict__ dx, float* __restrict__ partials, int rows) {
  using Tile = RowTiling<H, VEC, THREADS>;
  static_assert((VEC & (VEC - 1)) == 0 && VEC * sizeof(T) <= 16, "VEC: power of two, at most 16 bytes");
  constexpr bool LAYERNORM = KIND == Norm::LAYER;
  // partial rows per block: dgamma (and dbeta); none for L2 (no parameters)
  constexpr int M = KIND == Norm::L2 ? 0 : LAYERNORM ? 2 : 1;
  __shared__ float smem[2 * (THREADS / 32)];
  float g[Tile::NV][VEC];
  float dgamma[Tile::NV][VEC] = {}, dbeta[Tile::NV][VEC] = {};
#pragma unroll
  for (int i = 0; i < Tile::NV; ++i) {
    if (!Tile::valid(i)) continue;
    if (KIND == Norm::L2) fill<VEC>(1.f, g[i]);
    else load<T, VEC>(gamma + Tile::col(i), g[i]);
#pragma unroll
    for (int k = 0; k < VEC; ++k) g[i][k] = ZERO_CENTERED ? g[i][k] + 1.f : g[i][k];
  }
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const long long base = (long long)row * H;
    const float mu = LAYERNORM ? mean[row] : 0.f, inv = rstd[row];
    float xhat[Tile::NV][VEC], dyg[Tile::NV][VEC];
    float sum_dyg = 0.f, sum_dyg_xhat = 0.f;
#pragma unroll
    for (int i = 0; i < Tile::NV; ++i) {
      if (!Tile::valid(i)) continue;
      float xv[VEC], dyv[VEC];
      load<T, VEC>(x + base + Tile::col(i), xv);
      load<T, VEC>(dy + base + Tile::col(i), dyv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        xhat[i][k] = (xv[k] - mu) * inv;
        dyg[i][k] = dyv[k] * g[i][k];
        sum_dyg += dyg[i][k];
        sum_dyg_xhat += dyg[i][k] * xhat[i][k];
        dgamma[i][k] += dyv[k] * xhat[i][k];
        if (LAYERNORM) dbeta[i][k] += dyv[k];
      }
    }
    // Both row sums in one reduction (sum_dyg is simply unused for RMS).
    block_sum2<THREADS>(sum_dyg, sum_dyg_xhat, smem);
    const float mean_dyg = LAYERNORM ? sum_dyg / H : 0.f;
    const float mean_dyg_xhat = KIND == Norm::L2 ? sum_dyg_xhat : sum_dyg_xhat / H;  // L2: a sum, no mean
#pragma unroll
    for (int i = 0; i < Tile::NV; ++i) {
      if (!Tile::valid(i)) continue;
      float out[VEC], dres[VEC];
      if (ADD_DRESIDUAL) load<T, VEC>(dresidual + base + Tile::col(i), dres);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        out[k] = inv * (dyg[i][k] - mean_dyg - xhat[i][k] * mean_dyg_xhat);
        if (ADD_DRESIDUAL) out[k] += dres[k];
      }
      store<T, VEC>(dx + base + Tile::col(i), out);
    }
  }
  if (M == 0) return;
  float* part = partials + (long long)blockIdx.x * (M * H);
#pragma unroll
  for (int i = 0; i < Tile::NV; ++i) {
    if (!Tile::valid(i)) continue;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      part[Tile::col(i) + k] = dgamma[i][k];
      if (LAYERNORM) part[H + Tile::col(i) + k] = dbeta[i][k];
    }
  }
}

// Backward, parameter-grad partials in shared memory (SHARED_PARTIALS: rows whose fp32 dgamma and
// dbeta fit, generator/stages/norm/tuning.py: norm_bwd_shared_partials). A thread holds its ~2
// vectors of x and dy only while it sums the row; after the row's reduction it loads them again (L1 hits: the
// block just read them) rather than keeping them in registers across the barriers, and it adds its
// columns' dgamma/dbeta into shared memory, not registers. About 64 registers a thread at 512
// threads, so two blocks share an SM and one's reduction overlaps the other's loads: H=8192 bf16 on
// an H100, LayerNorm 349 -> 320 µs, RMSNorm 321 -> 291 µs (bench/NOTES.md).
// Dynamic shared memory: M * H floats, as planes of C-float chunks (C = 4, or VEC when it is
// smaller) so that a warp's chunks are consecutive (no bank conflicts): chunk j of vector v of
// parameter m is at [(m * P + j) * NVEC + v]. Each thread only touches its own vectors' chunks, so
// no barrier guards them.
template <typename T, int H, int VEC, int THREADS, bool LAYERNORM, bool ADD_DRESIDUAL, bool ZERO_CENTERED>
__device__ __forceinline__ void row_norm_bwd_shared(const T* __restrict__ dy, const T* __restrict__ x,
                                                    const float* __restrict__ mean, const float* __restrict__ rstd,
                                                    const T* __restrict__ gamma, const T* __restrict__ dresidual,
                                                    T* __restrict__ dx, float* __restrict__ partials, int rows) {
  using Tile = RowTiling<H, VEC, THREADS>;
  static_assert((VEC & (VEC - 1)) == 0 && VEC * sizeof(T) <= 16, "VEC: power of two, at most 16 bytes");
  constexpr int M = LAYERNORM ? 2 : 1;  // partial rows: dgamma (and dbeta)
  constexpr int C = VEC < 4 ? VEC : 4, P = VEC / C, NVEC = Tile::NVEC;
  using Chunk = Vec<float, C>;
  __shared__ float smem[2 * (THREADS / 32)];
  extern __shared__ Chunk shared_partials[];  // [M][P][NVEC]
#pragma unroll
  for (int i = 0; i < Tile::NV; ++i) {
    if (!Tile::valid(i)) continue;
#pragma unroll
    for (int j = 0; j < M * P; ++j) {
      Chunk zero;
      fill<C>(0.f, zero.v);
      shared_partials[j * NVEC + threadIdx.x + i * THREADS] = zero;
    }
  }
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const long long base = (long long)row * H;
    const float mu = LAYERNORM ? mean[row] : 0.f, inv = rstd[row];
    // All the row's loads in flight together, held as loaded (16-byte vectors of T: half the
    // registers of floats at 16 bits) and converted where used: LayerNorm H=8192 bf16 319 -> 294 µs.
    Vec<T, VEC> x_raw[Tile::NV], dy_raw[Tile::NV];
#pragma unroll
    for (int i = 0; i < Tile::NV; ++i) {
      if (!Tile::valid(i)) continue;
      x_raw[i] = load_raw<T, VEC>(x + base + Tile::col(i));
      dy_raw[i] = load_raw<T, VEC>(dy + base + Tile::col(i));
    }
    float sum_dyg = 0.f, sum_dyg_xhat = 0.f;
#pragma unroll
    for (int i = 0; i < Tile::NV; ++i) {
      if (!Tile::valid(i)) continue;
      const int v = threadIdx.x + i * THREADS;
      float g[VEC], xv[VEC], dyv[VEC];
      load<T, VEC>(gamma + Tile::col(i), g);
      to_floats<T, VEC>(x_raw[i], xv);
      to_floats<T, VEC>(dy_raw[i], dyv);
#pragma unroll
      for (int j = 0; j < P; ++j) {
        Chunk dgamma = shared_partials[j * NVEC + v], dbeta;
        if (LAYERNORM) dbeta = shared_partials[(P + j) * NVEC + v];
#pragma unroll
        for (int q = 0; q < C; ++q) {
          const int k = j * C + q;
          const float gk = ZERO_CENTERED ? g[k] + 1.f : g[k];
          const float xhat = (xv[k] - mu) * inv, dyg = dyv[k] * gk;
          sum_dyg += dyg;
          sum_dyg_xhat += dyg * xhat;
          dgamma.v[q] += dyv[k] * xhat;
          if (LAYERNORM) dbeta.v[q] += dyv[k];
        }
        shared_partials[j * NVEC + v] = dgamma;
        if (LAYERNORM) shared_partials[(P + j) * NVEC + v] = dbeta;
      }
    }
    // Both row sums in one reduction (sum_dyg is simply unused for RMS).
    block_sum2<THREADS>(sum_dyg, sum_dyg_xhat, smem);
    const float mean_dyg = LAYERNORM ? sum_dyg / H : 0.f, mean_dyg_xhat = sum_dyg_xhat / H;
#pragma unroll
    for (int i = 0; i < Tile::NV; ++i) {
      if (!Tile::valid(i)) continue;
      float xr[VEC], dyr[VEC], g[VEC], out[VEC], dres[VEC];
      load<T, VEC>(x + base + Tile::col(i), xr);  // again: an L1 hit, cheaper than registers held
      load<T, VEC>(dy + base + Tile::col(i), dyr);
      load<T, VEC>(gamma + Tile::col(i), g);
      if (ADD_DRESIDUAL) load<T, VEC>(dresidual + base + Tile::col(i), dres);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float gk = ZERO_CENTERED ? g[k] + 1.f : g[k];
        const float xhat = (xr[k] - mu) * inv, dyg = dyr[k] * gk;
        out[k] = inv * (dyg - mean_dyg - xhat * mean_dyg_xhat);
        if (ADD_DRESIDUAL) out[k] += dres[k];
      }
      store<T, VEC>(dx + base + Tile::col(i), out);
    }
  }
  float* part = partials + (long long)blockIdx.x * (M * H);
#pragma unroll
  for (int i = 0; i < Tile::NV; ++i) {
    if (!Tile::valid(i)) continue;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int j = 0; j < P; ++j) {
        *reinterpret_cast<Chunk*>(part + m * H + Tile::col(i) + j * C) =
            shared_partials[(m * P + j) * NVEC + threadIdx.x + i * THREADS];
      }
    }
  }
}

// LayerNorm / RMSNorm backward; SHARED_PARTIALS: dgamma/dbeta summed in shared memory (launch with
// M * H * 4 bytes of dynamic shared memory), else in registers. With `grads` given (a cooperative
// launch) the grid then sums the partials itself (column_sum.cuh: finish_column_sums).
template <typename T, int H, int VEC, int THREADS, bool LAYERNORM, bool ADD_DRESIDUAL, bool ZERO_CENTERED,
          bool SHARED_PARTIALS>
__device__ __forceinline__ void norm_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                                         const float* __restrict__ mean, const float* __restrict__ rstd,
                                         const T* __restrict__ gamma, const T* __restrict__ dresidual,
                                         T* __restrict__ dx, float* __restrict__ partials, T* __restrict__ grads,
                                         int rows) {
  if (SHARED_PARTIALS) {
    row_norm_bwd_shared<T, H, VEC, THREADS, LAYERNORM, ADD_DRESIDUAL, ZERO_CENTERED>(
        dy, x, mean, rstd, gamma, dresidual, dx, partials, rows);
  } else {
    row_norm_bwd_registers<T, H, VEC, THREADS, LAYERNORM ? Norm::LAYER : Norm::RMS, ADD_DRESIDUAL, ZERO_CENTERED>(
        dy, x, mean, rstd, gamma, dresidual, dx, partials, rows);
  }
  finish_column_sums<T>(partials, grads, gridDim.x, (LAYERNORM ? 2 : 1) * H);
}

// L2Normalization backward: dx only (gamma, partials and grads unused).
template <typename T, int H, int VEC, int THREADS, bool ADD_DRESIDUAL>
__device__ __forceinline__ void l2norm_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                                           const float* __restrict__ mean, const float* __restrict__ rstd,
                                           const T* __restrict__ gamma, const T* __restrict__ dresidual,
                                           T* __restrict__ dx, float* __restrict__ partials, T* __restrict__ grads,
                                           int rows) {
  row_norm_bwd_registers<T, H, VEC, THREADS, Norm::L2, ADD_DRESIDUAL, false>(dy, x, mean, rstd, gamma, dresidual, dx,
                                                                             partials, rows);
}

}  // namespace fg
