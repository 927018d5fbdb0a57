// The shared-dequantization variant of the fused NF4 GEMM on Hopper (forced path fused_shared; a development kernel:
// Auto does not take it, measured slower than dequantize + cuBLASLt under sustained load), W [N,K] NF4, forward and
// input gradient as nf4_fused.cu's kernel, whose tiling, pipeline and epilogue it shares (nf4_fused_common.cuh).
#include "cuda/dev/nf4_fused_shared.h"

#include "cuda/nf4/nf4_fused_common.cuh"

namespace qmm::cuda {

namespace fused {

// ---- Shared dequantization (forced path fused_shared): each weight tile dequantized once per launch ----
//
// The kernel above dequantizes its 128-row weight strip in every CTA that uses it: at M = 4096 that is 16 times
// the weight, and the dequantization's ALU work is what keeps it from the tensor cores' rate. Here the CTAs that
// share a strip (same 128 weight rows, different activation tiles: neighbours in launch order, grid x) share its
// dequantization instead: the producer warpgroup's warps 1-3 claim the strip's k tiles one at a time from a
// per-strip counter (atomicAdd: every tile goes to exactly one CTA, and a CTA keeps claiming until none are
// left, so no tile waits for a CTA that is not running), write them as bf16 into a workspace of W's size (the
// layout nf4_dequantize writes) and publish each with a release flag. Warp 0's thread 0 waits for a stage's flag
// (acquire), then loads the tile with TMA from the workspace, mostly from L2 while the strip's CTAs run together;
// the consumers only multiply (both operands from shared memory). The workspace's 8 KB tiles reach the async
// proxy (TMA) through a proxy fence on both sides of the flag.
constexpr int kShStageBytes = kWTileBytes + kATileBytes;  // the T tile by TMA, the activation tile
constexpr int kShStages = 4;
// The persistent launch's epilogue stages its output outside the pipeline, which is by then loading the CTA's
// next tile: two 8 KB TMA boxes per consumer warpgroup (store_bf16_tile_tma), or with beta != 0 64 rows at a time
// through store_bf16_tile.
constexpr int kShEpilogueRows = 64;
constexpr int kShEpilogueOffset = kShStages * kShStageBytes;
constexpr int kShEpilogueBytes = std::max(2 * 2 * 8192, kShEpilogueRows * kCBf16Pitch);
constexpr int kShCodebookOffset = kShEpilogueOffset + kShEpilogueBytes;
constexpr int kShCode2Offset = kShCodebookOffset + 64;
constexpr int kShSlotOffset = kShCode2Offset + small_m::kCode2Bytes;  // the tile the dequantizing warps claimed
constexpr int kShBarriersOffset = kShSlotOffset + 16;
constexpr int kShSmemBytes = kShBarriersOffset + 2 * kShStages * 8 + 1024;
static_assert(kBlockA * kCPitch * 4 <= kShCodebookOffset, "the output tile is staged in the pipeline's shared memory");
static_assert(kShSmemBytes <= 227 * 1024, "an sm_90 block has at most 227 KB of shared memory");
[[maybe_unused]] constexpr int kDequantThreads = kProducerThreads - 32;  // producer warps 1-3
[[maybe_unused]] constexpr int kTileRuns = kBlockW * kBlockK / 32;       // 32-element runs per dequantized tile
[[maybe_unused]] constexpr int kRunsPerThread = (kTileRuns + kDequantThreads - 1) / kDequantThreads;

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// The tiles: t = m_tile + tiles_m * (n_tile + tiles_n * split), so that a strip's tiles (same n_tile and split,
// different activation tiles) are neighbours. CTA b takes tiles b, b + gridDim.x, ...: one each when the grid has
// a CTA per tile; a persistent grid (one CTA per SM where the bf16 epilogue serves the output: bf16 out, no
// split-K) loops, and its producer loads and its dequantizing warps claim for the next tile while the consumers
// finish the current one, whose epilogue then stages its output outside the pipeline (c_map: the output's TMA
// boxes, used with beta = 0). `sync` (zeroed before the launch): [splits][tiles_n] claim counters, then
// [tiles_n][k tiles of k_red] ready flags. t_map: the workspace w16 [N][K] bf16, boxes of 128 rows x 64 columns
// (forward: T = W's rows) or 64 x 64 (input gradient: W's rows k_red, two boxes side by side along K = n_out).
struct ShTile {
  int m0, split, kt_begin, k_tiles;
  std::int64_t n0;
  int* claims;
  int* ready;
};

template <bool kBackward, bool kCBf16>
__global__ void __launch_bounds__(kThreads, 1)
    nf4_shared_dequant_gemm_kernel(const __grid_constant__ CUtensorMap b_map, const __grid_constant__ CUtensorMap t_map,
                                   const __grid_constant__ CUtensorMap c_map, const std::uint8_t* __restrict__ codes,
                                   Scales scales, __nv_bfloat16* __restrict__ w16, int* __restrict__ sync,
                                   std::int64_t M, std::int64_t rows, std::int64_t cols, int tiles_m, int tiles_n,
                                   int splits, int k_tiles_per_split, int a_box_rows, float* __restrict__ partial,
                                   void* __restrict__ c, float alpha, float beta) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (shared_address(smem_raw) & 1023u)) & 1023u);
  float* codebook = reinterpret_cast<float*>(smem + kShCodebookOffset);
  float* code2_shared = reinterpret_cast<float*>(smem + kShCode2Offset);
  volatile int* slots = reinterpret_cast<volatile int*>(smem + kShSlotOffset);  // claims, by round parity
  const std::uint32_t tiles = shared_address(smem);
  const std::uint32_t bars = shared_address(smem + kShBarriersOffset);
  auto w_tile = [&](int s) { return tiles + s * kShStageBytes; };
  auto a_tile = [&](int s) { return tiles + s * kShStageBytes + kWTileBytes; };
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kShStages + s); };

  const std::int64_t n_out = kBackward ? cols : rows, k_red = kBackward ? rows : cols;
  const int tid = threadIdx.x, wg = tid / 128;
  const int k_tiles_total = static_cast<int>((k_red + kBlockK - 1) / kBlockK);
  const int num_tiles = tiles_m * tiles_n * splits;
  // The epilogue that launch_shared_dequant sized the grid for: persistent (staged outside the pipeline), and then
  // by TMA where nothing is read back.
  const bool persistent = kCBf16 && bf16_epilogue_fits(partial != nullptr, n_out, c);
  const bool tma_store = persistent && beta == 0.0f;
  auto tile_at = [&](int t) {
    ShTile x;
    const int m_tile = t % tiles_m, rest = t / tiles_m, n_tile = rest % tiles_n, split = rest / tiles_n;
    x.m0 = m_tile * kBlockA;
    x.split = split;
    x.n0 = static_cast<std::int64_t>(n_tile) * kBlockW;
    x.kt_begin = split * k_tiles_per_split;
    x.k_tiles = min(k_tiles_per_split, k_tiles_total - x.kt_begin);
    x.claims = sync + split * tiles_n + n_tile;
    x.ready = sync + static_cast<std::int64_t>(tiles_n) * splits + static_cast<std::int64_t>(n_tile) * k_tiles_total;
    return x;
  };

  if (tid == 0) {
    for (int s = 0; s < kShStages; ++s) {
      mbar_init(full(s), 1);     // thread 0's arrival with the stage's TMA bytes
      mbar_init(empty(s), 256);  // every consumer thread
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(&b_map)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(&t_map)) : "memory");
    if (tma_store) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(&c_map)) : "memory");
  }
  if (tid < 16) codebook[tid] = nf4_code_value(tid);
  if (!scales.absmax)
    for (int i = tid; i < kNf4Code2Size; i += kThreads) code2_shared[i] = __ldg(scales.code2 + i);
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (tid == 0) {
      // ---- TMA: per stage, once its tile is in the workspace, T and the activation tile; the stage ring runs
      // on across the CTA's tiles (it counts every stage this thread loads) ----
      int it = 0;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const ShTile x = tile_at(t);
        for (int i = 0; i < x.k_tiles; ++i, ++it) {
          const int s = it % kShStages, kt = x.kt_begin + i;
          mbar_wait(empty(s), ((it / kShStages) & 1) ^ 1);  // passes at once on the first round
          while (ld_acquire_gpu(x.ready + kt) == 0) __nanosleep(32);
          fence_proxy_async_global();  // the flag's acquire, then the async proxy's reads of the tile
          mbar_expect_tx(full(s), a_box_rows * (kBlockK * 2) + kWTileBytes);
          tma_load_2d(a_tile(s), &b_map, kt * kBlockK, x.m0, full(s));
          if constexpr (kBackward) {  // W rows 64 kt.., columns n0.. and n0 + 64..: each warpgroup's M-major half
            tma_load_2d(w_tile(s), &t_map, static_cast<int>(x.n0), kt * kBlockK, full(s));
            tma_load_2d(w_tile(s) + 64 * 128, &t_map, static_cast<int>(x.n0) + 64, kt * kBlockK, full(s));
          } else {
            tma_load_2d(w_tile(s), &t_map, kt * kBlockK, static_cast<int>(x.n0), full(s));
          }
          mbar_arrive(full(s));
        }
      }
    } else if (tid >= 32) {
      // ---- warps 1-3: per tile of the CTA, claim its strip's k tiles until none are left, dequantize each into
      // the workspace ----
      // A tile is 256 runs of 32 elements (16 code bytes, one NF4 block): forward W row n0 + q / 2, k 64 kt +
      // 32 (q % 2); input gradient W row 64 kt + q / 4, column n0 + 32 (q % 4). Each thread loads its (up to)
      // three runs at once, then converts and stores them; the next claim is in flight meanwhile.
      const int dt = tid - 32;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const ShTile x = tile_at(t);
        if (dt == 0) slots[0] = atomicAdd(x.claims, 1);
        asm volatile("bar.sync 4, %0;\n" ::"n"(kDequantThreads) : "memory");
        for (int round = 0;; ++round) {
          const int i = slots[round & 1];
          if (i >= x.k_tiles) break;  // every thread read the same claim
          const int next = dt == 0 ? atomicAdd(x.claims, 1) : 0;
          const int kt = x.kt_begin + i;
          uint4 words[kRunsPerThread];
          small_m::RawScale raw[kRunsPerThread];
          std::int64_t at[kRunsPerThread];
#pragma unroll
          for (int u = 0; u < kRunsPerThread; ++u) {
            const int q = dt + u * kDequantThreads;
            const std::int64_t r = kBackward ? 64ll * kt + q / 4 : x.n0 + q / 2;
            const std::int64_t col = kBackward ? x.n0 + 32 * (q % 4) : 64ll * kt + 32 * (q % 2);
            at[u] = q < kTileRuns && r < rows && col < cols ? r * cols + col : -1;
            words[u] = at[u] >= 0 ? __ldg(reinterpret_cast<const uint4*>(codes + (at[u] >> 1)))
                                  : make_uint4(0, 0, 0, 0);
            raw[u] = at[u] >= 0 ? small_m::load_scale(scales, at[u] >> scales.block_shift)
                                : small_m::RawScale{0.0f, 0u};
          }
#pragma unroll
          for (int u = 0; u < kRunsPerThread; ++u) {
            if (at[u] < 0) continue;
            const float sc = small_m::finish_scale(scales, raw[u], code2_shared);
            const std::uint32_t w4[4] = {words[u].x, words[u].y, words[u].z, words[u].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // 8 elements per word
              float v[8];
              nf4_lut::scaled_word(w4[j], sc, codebook, v);
              *reinterpret_cast<uint4*>(w16 + at[u] + 8 * j) =
                  make_uint4(nf4_lut::pack_bf16x2(v[0], v[1]), nf4_lut::pack_bf16x2(v[2], v[3]),
                             nf4_lut::pack_bf16x2(v[4], v[5]), nf4_lut::pack_bf16x2(v[6], v[7]));
            }
          }
          fence_proxy_async_global();  // this thread's stores, before the flag, for the async proxy
          asm volatile("fence.acq_rel.gpu;\n" ::: "memory");  // ... and for the other CTAs (dt 0 releases it)
          if (dt == 0) slots[(round + 1) & 1] = next;
          asm volatile("bar.sync 4, %0;\n" ::"n"(kDequantThreads) : "memory");
          if (dt == 0) st_release_gpu(x.ready + kt, 1);
        }
        asm volatile("bar.sync 4, %0;\n" ::"n"(kDequantThreads) : "memory");  // slots read before the next tile's claim
      }
    }
    return;
  }

  // ---- consumers: both operands from shared memory ----
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int cw = wg - 1, wt = tid % 128, warp = wt / 32, lane = tid % 32, et = tid - kProducerThreads;
  const std::uint32_t staging = shared_address(smem + kShEpilogueOffset);
  float acc[128];
  int it = 0;  // stages consumed, over the CTA's tiles (the producer's count)
  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const ShTile x = tile_at(t);
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    for (int i = 0; i < x.k_tiles; ++i, ++it) {
      const int s = it % kShStages;
      mbar_wait(full(s), (it / kShStages) & 1);
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      const std::uint64_t da = sw128_desc(a_tile(s));
      if constexpr (kBackward) {  // T M-major: k step kk is the 16 weight rows 16 kk.., 2048 bytes further on
        const std::uint64_t dw = sw128_mn_desc(w_tile(s) + cw * 64 * 128);
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) wgmma_m64n256k16_ss<1>(acc, dw + (2048 >> 4) * kk, da + 2 * kk);
      } else {  // T K-major: this warpgroup's 64 rows
        const std::uint64_t dw = sw128_desc(w_tile(s) + cw * 64 * 128);
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) wgmma_m64n256k16_ss<0>(acc, dw + 2 * kk, da + 2 * kk);
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      // The previous stage's wgmmas have finished reading shared memory once at most this one is pending.
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      if (i > 0) mbar_arrive(empty((it - 1) % kShStages));
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    if (x.k_tiles > 0) mbar_arrive(empty((it - 1) % kShStages));  // the tile's last stage is free too
    const int tile_rows = M - x.m0 < kBlockA ? static_cast<int>(M - x.m0) : kBlockA;
    if (tma_store) {
      store_bf16_tile_tma(acc, staging + cw * 2 * 8192, &c_map, cw, warp, lane, wt, tile_rows, x.m0, x.n0, alpha);
    } else if (persistent) {
      store_bf16_tile<kShEpilogueRows>(acc, staging, smem + kShEpilogueOffset, cw, warp, lane, et, tile_rows, x.m0,
                                       x.n0, n_out, static_cast<__nv_bfloat16*>(c), alpha, beta);
    } else {
      store_output_tile<kCBf16>(acc, smem, cw, warp, lane, et, M, x.m0, x.n0, n_out, partial, x.split, c, alpha,
                                beta);
    }
  }
  if (tma_store && wt == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // before the CTA's exit
#endif
}

}  // namespace fused

namespace {

// The shared-dequantization kernel: the same tiles and split-K as launch_fused, ordered so that a strip's tiles
// are neighbours, plus one scratch allocation for the bf16 workspace of W's size, the claim counters and ready
// flags (zeroed here, in stream order) and the split-K partials. Where the bf16 epilogue serves the output (no
// split-K), the grid is persistent: one CTA per SM at most, each looping over tiles.
template <bool kBackward>
void launch_shared_dequant(const Context& ctx, const Nf4FusedGrid& g, const void* b16, std::int64_t M,
                           const Nf4Weight& w, const TensorView& out, float alpha, float beta) {
  const std::int64_t n_out = kBackward ? w.cols : w.rows, k_red = kBackward ? w.rows : w.cols;
  const int a_box_rows = activation_box_rows(M);
  const std::int64_t sms = state(ctx).sm_count();
  const std::int64_t k_tiles = (k_red + fused::kBlockK - 1) / fused::kBlockK;
  const std::size_t w16_bytes = static_cast<std::size_t>(w.numel()) * 2;
  const std::size_t sync_bytes = static_cast<std::size_t>(g.tiles_n * (g.splits + k_tiles)) * 4;
  const std::size_t sync_at = (w16_bytes + 255) / 256 * 256, partial_at = (sync_at + sync_bytes + 255) / 256 * 256;
  const std::size_t partial_bytes = g.splits > 1 ? static_cast<std::size_t>(g.splits * M * n_out) * 4 : 0;
  ScratchBuffer scratch(state(ctx), partial_at + partial_bytes);
  auto* w16 = scratch.at<__nv_bfloat16>(0);
  int* sync = scratch.at<int>(sync_at);
  float* partial = partial_bytes ? scratch.at<float>(partial_at) : nullptr;
  QMM_CUDA_CHECK(cudaMemsetAsync(sync, 0, sync_bytes, stream_of(ctx)));
  const CUtensorMap map = activation_map(b16, M, k_red, a_box_rows);
  const CUtensorMap t_map = tensor_map_2d(w16, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w.rows, w.cols,
                                          kBackward ? 64 : fused::kBlockW, fused::kBlockK, CU_TENSOR_MAP_SWIZZLE_128B);
  const small_m::Scales scales = small_m::scales_of(w);
  const std::int64_t tiles = g.tiles_m * g.tiles_n * g.splits;
  // The kernel derives the same from its arguments (its epilogue).
  const bool persistent =
      out.dtype() == DType::BF16 && fused::bf16_epilogue_fits(partial != nullptr, n_out, out.data());
  const auto grid = static_cast<unsigned>(persistent ? std::min(tiles, sms) : tiles);
  // The output's TMA boxes for the persistent epilogue with beta = 0 (unused otherwise: t_map stands in).
  const CUtensorMap c_map = persistent && beta == 0.0f
                                ? tensor_map_2d(out.data(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, M, n_out, 64, 64,
                                                CU_TENSOR_MAP_SWIZZLE_128B)
                                : t_map;
  auto launch = [&](auto kernel) {
    allow_dynamic_shared(reinterpret_cast<const void*>(kernel), fused::kShSmemBytes);
    kernel<<<grid, fused::kThreads, fused::kShSmemBytes, stream_of(ctx)>>>(
        map, t_map, c_map, w.codes.data_as<const std::uint8_t>(), scales, w16, sync, M, w.rows, w.cols,
        static_cast<int>(g.tiles_m), static_cast<int>(g.tiles_n), static_cast<int>(g.splits),
        static_cast<int>(g.k_tiles_per_split), a_box_rows, partial, out.data(), alpha, beta);
  };
  if (out.dtype() == DType::BF16) launch(fused::nf4_shared_dequant_gemm_kernel<kBackward, true>);
  else launch(fused::nf4_shared_dequant_gemm_kernel<kBackward, false>);
  QMM_CUDA_CHECK_LAUNCH("nf4_shared_dequant_gemm_kernel");
  if (partial)
    launch_nf4_split_k_reduce(ctx, partial, static_cast<int>(g.splits), M * n_out, out, alpha, beta);
}

}  // namespace

void launch_nf4_fused_shared(const Context& ctx, const Nf4FusedGrid& grid, const void* b16, std::int64_t M,
                             const Nf4Weight& w, const TensorView& out, float alpha, float beta, bool backward) {
  if (backward) launch_shared_dequant<true>(ctx, grid, b16, M, w, out, alpha, beta);
  else launch_shared_dequant<false>(ctx, grid, b16, M, w, out, alpha, beta);
}

}  // namespace qmm::cuda
