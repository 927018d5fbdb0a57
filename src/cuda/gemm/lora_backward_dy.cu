// lora_backward_dy's one-pass kernel (bf16): dt = scale·dy·B and grad_b += scale·dyᵀ·t from one read of dy.
// The two cuBLASLt GEMMs it replaces each read all of dy [M,N] for a rank-r result; here each dy tile is loaded
// into shared memory once and feeds both products on the tensor cores (mma.sync m16n8k16, fp32 accumulation).
//
// A CTA owns a strip of kStripCols columns of dy (the same rows of b and of grad_b) and walks every splits-th
// tile of kTileRows rows through a kStages-deep cp.async ring (rows past M and columns past N arrive as zeros):
//  - dt: warp w multiplies rows 16 (w % 2).. of the tile by its part w / 2 (kDtCols columns) of the strip (A = dy,
//    B = the strip of b); the parts are added in shared memory and the strip's share written to
//    dt_part[strip][M][r];
//  - grad_b: warp w multiplies columns kGbCols w.. of dyᵀ (dy read transposed by ldmatrix.trans) by the tile's t,
//    accumulating in registers over all of the CTA's tiles, then writes gb_part[split][N][r].
// A second kernel adds the partials in a fixed order, so results do not depend on scheduling: dt = scale·Σ
// rounded once to bf16, grad_b = scale·Σ + grad_b. Several adapters of one M (a layer's q, k and v) run as one
// launch of each kernel: grid z picks the adapter, and the row splits are shared out by the adapters' widths.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/common/sm80_ptx.cuh"
#include "cuda/cuda_backend.h"

namespace qmm::cuda {
namespace {

// 8 warps, one CTA per SM (shared memory). ncu finds the kernel latency-bound, yet 16 warps (128 registers)
// measured slower (docs/BENCHMARKS.md, LoRA MLP block).
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileRows = 32;
constexpr int kStripCols = 512;
constexpr int kStages = 4;  // three tiles in flight while one is multiplied
constexpr int kDtParts = kWarps / 2;               // column parts of dt (two 16-row halves of the tile each)
constexpr int kDtCols = kStripCols / kDtParts;     // 128
constexpr int kGbCols = kStripCols / kWarps;       // 64: grad_b rows (dy columns) per warp
constexpr int kGbTiles = kGbCols / 16;             // their m16 tiles
static_assert(kTileRows == 32 && kDtCols % 16 == 0 && kGbCols % 16 == 0, "the warp layout above");
// Row pitches in bytes: an odd number of 16-byte units, so the 8 rows an ldmatrix reads fall on distinct banks.
constexpr int kDyPitch = kStripCols * 2 + 16;

template <int kR>
struct Layout {
  static constexpr int kNt = kR / 8;                                        // n8 tiles of the rank
  static constexpr int kRPitch = 16 * (kNt % 2 == 0 ? kNt + 1 : kNt + 2);  // b strip and t tile rows
  static constexpr int kDyBytes = kTileRows * kDyPitch;
  static constexpr int kStageBytes = kDyBytes + kTileRows * kRPitch;      // dy tile, then its t rows
  static constexpr int kStripBytes = kStripCols * kRPitch;
  static constexpr int kDtSumBytes = (kDtParts - 1) * kTileRows * kR * 4;  // parts 1.. of dt, fp32
  static constexpr int kBytes = kStages * kStageBytes + kStripBytes + kDtSumBytes;
};

using common::cp_async_16_or_zero;
using common::cp_async_commit;
using common::cp_async_wait;
using common::ldmatrix_x2_trans;
using common::ldmatrix_x4;
using common::ldmatrix_x4_trans;
using common::mma_bf16_16816;
using common::shared_address;

// The mma B fragments (k16 x n8, one pair per n8 tile) of the 16 rows k0.. of a [k][kR] bf16 array in shared
// memory (row pitch kRPitch): ldmatrix.trans turns its rows (k) into the fragment's columns.
template <int kR>
__device__ __forceinline__ void load_b_frags(std::uint32_t (&b)[kR / 8][2], std::uint32_t base, int k0, int lane) {
  using L = Layout<kR>;
  const int k = k0 + lane % 8 + 8 * ((lane / 8) % 2);
  if constexpr (L::kNt == 1) {
    ldmatrix_x2_trans(b[0][0], b[0][1], base + k * L::kRPitch);
  } else {
#pragma unroll
    for (int j = 0; j < L::kNt; j += 2) {  // n8 tiles j and j + 1
      std::uint32_t r[4];
      ldmatrix_x4_trans(r, base + k * L::kRPitch + 2 * (8 * j + 8 * (lane / 16)));
      b[j][0] = r[0];
      b[j][1] = r[1];
      b[j + 1][0] = r[2];
      b[j + 1][1] = r[3];
    }
  }
}

// One adapter of a launch: its operands, its grid (strips x splits of grid x and y; blocks past them leave) and its
// partial sums (dt_part [strips][M][r], gb_part [splits][N][r]).
struct DyAdapter {
  const __nv_bfloat16* dy;
  const __nv_bfloat16* b;
  const __nv_bfloat16* t;
  std::int64_t ld_t, n;
  int strips, splits;
  float* dt_part;
  float* gb_part;
};
constexpr int kMaxAdapters = 4;
struct DyAdapters {
  DyAdapter at[kMaxAdapters];
};

template <int kR>
__global__ void __launch_bounds__(kThreads, 1)
    lora_backward_dy_kernel(const DyAdapters adapters, std::int64_t M, int row_tiles) {
  using L = Layout<kR>;
  constexpr int kNt = L::kNt;
  const DyAdapter& z = adapters.at[blockIdx.z];
  const int strip = blockIdx.x, split = blockIdx.y, splits = z.splits;
  if (strip >= z.strips || split >= splits) return;  // the whole block, before any barrier
  const __nv_bfloat16* __restrict__ dy = z.dy;
  const __nv_bfloat16* __restrict__ b = z.b;
  const __nv_bfloat16* __restrict__ t = z.t;
  const std::int64_t ld_t = z.ld_t, N = z.n;
  float* __restrict__ dt_part = z.dt_part;
  float* __restrict__ gb_part = z.gb_part;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* strip_s = smem + kStages * L::kStageBytes;
  float* dt_sum = reinterpret_cast<float*>(strip_s + L::kStripBytes);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  const std::int64_t n0 = static_cast<std::int64_t>(strip) * kStripCols;

  // The strip of b (rows n0.., all r columns), loaded once with the first tile.
  for (int c = tid; c < kStripCols * kNt; c += kThreads) {
    const int row = c / kNt, chunk = c % kNt;
    const bool ok = n0 + row < N;
    cp_async_16_or_zero(shared_address(strip_s + row * L::kRPitch + 16 * chunk), ok ? b + (n0 + row) * kR + 8 * chunk : b, ok);
  }
  auto load_tile = [&](int stage, int tile) {
    unsigned char* st = smem + stage * L::kStageBytes;
    const std::int64_t m0 = static_cast<std::int64_t>(tile) * kTileRows;
    for (int c = tid; c < kTileRows * (kStripCols / 8); c += kThreads) {  // 8 per thread, a warp per 512 bytes
      const int row = c / (kStripCols / 8), chunk = c % (kStripCols / 8);
      const bool ok = m0 + row < M && n0 + 8 * chunk < N;
      cp_async_16_or_zero(shared_address(st + row * kDyPitch + 16 * chunk), ok ? dy + (m0 + row) * N + n0 + 8 * chunk : dy, ok);
    }
    for (int c = tid; c < kTileRows * kNt; c += kThreads) {
      const int row = c / kNt, chunk = c % kNt;
      const bool ok = m0 + row < M;
      cp_async_16_or_zero(shared_address(st + L::kDyBytes + row * L::kRPitch + 16 * chunk),
                          ok ? t + (m0 + row) * ld_t + 8 * chunk : t, ok);
    }
  };

  float gb[kGbTiles][kNt][4] = {};  // grad_b: columns kGbCols warp + 16 mt + g (+8), ranks 8 j + 2 q (+1)
  const int dt_rows = 16 * (warp % 2), dt_part_index = warp / 2;
  // The ring: tiles split, split + splits, ... in stages 0, 1, 2, 3, 0, ...; one commit group per tile (empty
  // past the last), the strip in the first.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    const int tile = split + s * splits;
    if (tile < row_tiles) load_tile(s, tile);
    cp_async_commit();
  }
  int stage = 0;
  for (int tile = split; tile < row_tiles; tile += splits, stage = (stage + 1) % kStages) {
    cp_async_wait<kStages - 2>();  // this tile has landed
    __syncthreads();  // ... for every thread; and every thread is done with the previous tile's stage and sums
    const int ahead = tile + (kStages - 1) * splits;
    if (ahead < row_tiles) load_tile((stage + kStages - 1) % kStages, ahead);
    cp_async_commit();
    const std::uint32_t dy_s = shared_address(smem + stage * L::kStageBytes);
    const std::uint32_t t_s = dy_s + L::kDyBytes, strip_a = shared_address(strip_s);

    // dt: rows dt_rows.. x this warp's kDtCols columns of the strip.
    float dt[kNt][4] = {};
#pragma unroll
    for (int ks = 0; ks < kDtCols / 16; ++ks) {
      const int k0 = kDtCols * dt_part_index + 16 * ks;
      std::uint32_t a[4];
      ldmatrix_x4(a, dy_s + (dt_rows + lane % 16) * kDyPitch + 2 * (k0 + 8 * (lane / 16)));
      std::uint32_t bf[kNt][2];
      load_b_frags<kR>(bf, strip_a, k0, lane);
#pragma unroll
      for (int j = 0; j < kNt; ++j) mma_bf16_16816(dt[j], a, bf[j][0], bf[j][1]);
    }
    // grad_b: columns kGbCols warp.. of dyᵀ (rows of the product) x the tile's rows (the reduction).
#pragma unroll
    for (int ks = 0; ks < kTileRows / 16; ++ks) {
      std::uint32_t tf[kNt][2];
      load_b_frags<kR>(tf, t_s, 16 * ks, lane);
#pragma unroll
      for (int mt = 0; mt < kGbTiles; ++mt) {
        std::uint32_t a[4];
        ldmatrix_x4_trans(a, dy_s + (16 * ks + lane % 8 + 8 * (lane / 16)) * kDyPitch +
                                 2 * (kGbCols * warp + 16 * mt + 8 * ((lane / 8) % 2)));
#pragma unroll
        for (int j = 0; j < kNt; ++j) mma_bf16_16816(gb[mt][j], a, tf[j][0], tf[j][1]);
      }
    }
    // Parts 1.. hand their dt to part 0, which writes the strip's share.
    if (dt_part_index > 0) {
      float* sums = dt_sum + (dt_part_index - 1) * kTileRows * kR;
#pragma unroll
      for (int j = 0; j < kNt; ++j)
#pragma unroll
        for (int i = 0; i < 4; i += 2)
          *reinterpret_cast<float2*>(sums + (dt_rows + g + 4 * i) * kR + 8 * j + 2 * q) =
              make_float2(dt[j][i], dt[j][i + 1]);
    }
    __syncthreads();
    if (dt_part_index == 0) {
      const std::int64_t m0 = static_cast<std::int64_t>(tile) * kTileRows;
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        const std::int64_t m = m0 + dt_rows + g + 4 * i;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < kNt; ++j) {
          float2 v = make_float2(dt[j][i], dt[j][i + 1]);
#pragma unroll
          for (int o = 0; o < kDtParts - 1; ++o) {  // parts 1, 2, ... in order
            const float2 w = *reinterpret_cast<const float2*>(dt_sum + (o * kTileRows + dt_rows + g + 4 * i) * kR +
                                                              8 * j + 2 * q);
            v.x += w.x;
            v.y += w.y;
          }
          *reinterpret_cast<float2*>(dt_part + (static_cast<std::int64_t>(strip) * M + m) * kR + 8 * j + 2 * q) = v;
        }
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < kGbTiles; ++mt)
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
      const std::int64_t n = n0 + kGbCols * warp + 16 * mt + g + 4 * i;
      if (n >= N) continue;
#pragma unroll
      for (int j = 0; j < kNt; ++j)
        *reinterpret_cast<float2*>(gb_part + (static_cast<std::int64_t>(split) * N + n) * kR + 8 * j + 2 * q) =
            make_float2(gb[mt][j][i], gb[mt][j][i + 1]);
    }
}

// One adapter's sums: dt[m][c] = bf16(scale·Σ_s dt_part[s][i]) for i = m·r + c < mr (dt's rows ld_dt apart), then
// grad_b[j] = scale·Σ_z gb_part[z][j] + beta·grad_b[j], sums in order; beta = 0 does not read grad_b (a GEMM's
// beta = 0).
struct DySums {
  const float* dt_part;
  int strips;
  std::int64_t mr, ld_dt;
  __nv_bfloat16* dt;
  const float* gb_part;
  int splits;
  std::int64_t nr;
  float* grad_b;
  float scale, beta;
};
struct DySumsAll {
  DySums at[kMaxAdapters];
  int count;
};

// Every adapter's sums, one element a thread over them all in turn (a float4 version, a quarter of the threads,
// measured slower).
__global__ void __launch_bounds__(kThreads) lora_backward_dy_reduce_kernel(const DySumsAll sums, int r) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  std::int64_t total = 0;
  for (int z = 0; z < sums.count; ++z) total += sums.at[z].mr + sums.at[z].nr;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    std::int64_t j = i;
    int z = 0;
    while (j >= sums.at[z].mr + sums.at[z].nr) j -= sums.at[z].mr + sums.at[z].nr, ++z;
    const DySums& s = sums.at[z];
    float sum = 0.0f;
    if (j < s.mr) {
      for (int p = 0; p < s.strips; ++p) sum += s.dt_part[p * s.mr + j];
      s.dt[(j / r) * s.ld_dt + j % r] = __float2bfloat16_rn(s.scale * sum);
    } else {
      j -= s.mr;
      for (int p = 0; p < s.splits; ++p) sum += s.gb_part[p * s.nr + j];
      s.grad_b[j] = s.beta == 0.0f ? s.scale * sum : s.scale * sum + s.beta * s.grad_b[j];
    }
  }
}

// False, launching nothing, where the GPU has less shared memory per block than the kernel needs (163-192 KB).
// One CTA per SM (shared memory): the adapters share one wave of CTAs by their widths, each adapter's row splits
// as many as its share fills, at most one per tile.
template <int kR>
bool launch(const Context& ctx, std::span<const LoraDyProblem> ads) {
  if (static_cast<std::size_t>(Layout<kR>::kBytes) > state(ctx).props.sharedMemPerBlockOptin) return false;
  set_device(ctx);
  const std::int64_t M = ads[0].dy.dim(0), mr = M * kR;
  const int row_tiles = static_cast<int>((M + kTileRows - 1) / kTileRows);
  std::int64_t n_all = 0;
  for (const LoraDyProblem& d : ads) n_all += d.dy.dim(1);
  const std::int64_t sms = state(ctx).sm_count();
  DyAdapters args{};
  DySumsAll sums{};
  sums.count = static_cast<int>(ads.size());
  std::size_t part_at[kMaxAdapters] = {}, floats = 0;
  int max_strips = 1, max_splits = 1;
  std::int64_t elems = 0;
  for (std::size_t z = 0; z < ads.size(); ++z) {
    const std::int64_t N = ads[z].dy.dim(1), nr = N * kR;
    const int strips = static_cast<int>((N + kStripCols - 1) / kStripCols);
    const int share = static_cast<int>(std::max<std::int64_t>(1, sms * N / n_all));
    const int splits = std::clamp(share / strips, 1, row_tiles);
    max_strips = std::max(max_strips, strips);
    max_splits = std::max(max_splits, splits);
    part_at[z] = floats;
    floats += static_cast<std::size_t>(strips * mr + splits * nr);
    elems += mr + nr;
    args.at[z] = {ads[z].dy.data_as<const __nv_bfloat16>(),
                  ads[z].b.data_as<const __nv_bfloat16>(),
                  ads[z].t.data_as<const __nv_bfloat16>(),
                  ads[z].ld_t,
                  N,
                  strips,
                  splits,
                  nullptr,
                  nullptr};
    sums.at[z] = {nullptr,
                  strips,
                  mr,
                  ads[z].ld_dt,
                  ads[z].dt.data_as<__nv_bfloat16>(),
                  nullptr,
                  splits,
                  nr,
                  ads[z].grad_b.data_as<float>(),
                  ads[z].scale,
                  ads[z].beta};
  }
  ScratchBuffer part(state(ctx), floats * sizeof(float));
  for (std::size_t z = 0; z < ads.size(); ++z) {
    float* dt_part = part.at<float>(0) + part_at[z];
    float* gb_part = dt_part + args.at[z].strips * mr;
    args.at[z].dt_part = dt_part;
    sums.at[z].dt_part = dt_part;
    args.at[z].gb_part = gb_part;
    sums.at[z].gb_part = gb_part;
  }

  const auto kernel = lora_backward_dy_kernel<kR>;
  allow_dynamic_shared(reinterpret_cast<const void*>(kernel), Layout<kR>::kBytes);
  const dim3 grid(static_cast<unsigned>(max_strips), static_cast<unsigned>(max_splits),
                  static_cast<unsigned>(ads.size()));
  kernel<<<grid, kThreads, Layout<kR>::kBytes, stream_of(ctx)>>>(args, M, row_tiles);
  QMM_CUDA_CHECK_LAUNCH("lora_backward_dy_kernel");
  const unsigned reduce_grid = grid_for(ctx, lora_backward_dy_reduce_kernel, kThreads, elems);
  lora_backward_dy_reduce_kernel<<<reduce_grid, kThreads, 0, stream_of(ctx)>>>(sums, kR);
  QMM_CUDA_CHECK_LAUNCH("lora_backward_dy_reduce_kernel");
  return true;
}

}  // namespace

bool lora_backward_dy_fused(const Context& ctx, std::span<const LoraDyProblem> adapters) {
  if (adapters.empty() || adapters.size() > static_cast<std::size_t>(kMaxAdapters)) return false;
  const std::int64_t M = adapters[0].dy.dim(0), r = adapters[0].b.dim(1);
  for (const LoraDyProblem& d : adapters) {
    const std::int64_t N = d.dy.dim(1);
    if (d.dy.dtype() != DType::BF16 || d.dy.dim(0) != M || d.b.dim(1) != r || M == 0 || N == 0 || N % 8 != 0 ||
        d.ld_t % 8 != 0)
      return false;
    if (!aligned16(d.dy.data()) || !aligned16(d.b.data()) || !aligned16(d.t.data())) return false;
  }
  switch (r) {
    case 8:
      return launch<8>(ctx, adapters);
    case 16:
      return launch<16>(ctx, adapters);
    case 32:
      return launch<32>(ctx, adapters);
    default:
      return false;
  }
}

}  // namespace qmm::cuda
