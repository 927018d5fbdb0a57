// The fused NF4 GEMMs on Hopper (sm_90a), W [N,K] NF4:
//   forward         C[M,N]  = alpha * A[M,K] * dequant(W)^T + beta * C
//   input gradient  dA[M,K] = alpha * dC[M,N] * dequant(W) + beta * dA
//
// nf4_fused_gemm_kernel dequantizes each CTA's weight tiles inside its main loop (Nf4Path::Fused). A variant that
// dequantizes each tile once per call into a bf16 workspace which the CTAs sharing it load with TMA
// (forced path fused_shared, not taken by Auto) is in dev/nf4_fused_shared.cu; both share the tiling, the pipeline
// and the epilogue (nf4_fused_common.cuh).
//
// The product is computed transposed, out^T = T * B^T with T the dequantized weight tile (W, or W^T for the input
// gradient) as the wgmma's 64-row A operand and the wider activation tile (A, or dC) its 256-column B operand:
// per k step the CTA dequantizes 128 x 64 weight elements (not 256 x 64) for 128 x 256 x 64 multiply-adds.
//
// A CTA is three warpgroups. Warpgroup 0 produces: per stage its thread 0 loads, with TMA, the activation tile
// [256 rows][64 k] (128-byte swizzle, zero fill past the edges) and the weight codes of the stage (forward: 128
// rows x 32 bytes; input gradient: 64 rows x 64 bytes), and its 128 threads write, from scales each loaded
// kScalesAhead stages ahead, the stage's 128 block tables (forward) or finished block scales (input gradient) to
// shared memory. Warpgroups 1 and 2 consume: each owns 64 rows of the dequantized tile T and dequantizes them
// itself for stage i + 1 (32 elements per thread) while its wgmma m64n256k16 of stage i run. The forward looks
// its elements up in the producer's tables and keeps them in registers as the wgmma's A fragments (RS form); the
// input gradient builds one table per thread from the scales and writes W's rows as they are into a
// 128-byte-swizzled tile that the wgmma reads M-major (T = W^T without a transpose), both operands from shared
// memory. (The RS forward measured faster than shared-memory T, and the input gradient's own tables faster than
// the producer's: docs/history/benchmarks-notebook-2026-12.md.)
// (A producer warpgroup that dequantized all 128 rows was the limiter: one warp per scheduler, bound by its own
// instruction latencies, while the consumer warps waited; ncu: tensor pipe 60% busy.)
// kStages stages, each with a "full" (TMA -> consumers) and an "empty" (consumers -> producer) mbarrier.
//
// Dequantization is exactly nf4_dequantize's (fp32 code * fp32 scale, rounded to bf16), so the result is the bf16
// GEMM on the dequantized weight up to fp32 summation order.
#include "cuda/nf4/nf4_fused.h"

#include <memory>

#include "cuda/nf4/nf4_fused_common.cuh"
#ifdef QMM_DEV_KERNELS
#include "cuda/dev/nf4_fused_mma.h"
#include "cuda/dev/nf4_fused_shared.h"
#endif

namespace qmm::cuda {

namespace fused {

// Both directions are one GEMM shape for the consumers: out[M][n_out] = B[M][k_red] * T^T with T the dequantized
// tile operand [n_out][k_red], K-major in shared memory.
//  forward:        T = W [N][K] as stored (n_out = N, k_red = K), B = A.
//  input gradient: T = W^T (n_out = K, k_red = N), B = dC; the consumers write W's rows, the wgmma reads them M-major.
// Grid: x over 128-row tiles of n_out, y over 256-row tiles of M, z over k_red ranges (split-K). With `partial`
// the CTA writes its raw fp32 sums to partial[z][M][n_out] for a reduction; otherwise alpha * sum + beta * out.
template <bool kBackward, bool kCBf16>
__global__ void __launch_bounds__(kThreads, 1)
    nf4_fused_gemm_kernel(const __grid_constant__ CUtensorMap b_map, const __grid_constant__ CUtensorMap code_map,
                          std::int64_t M, std::int64_t rows,
                          std::int64_t cols, Scales scales,
                          int k_tiles_per_split, int a_box_rows, float* __restrict__ partial,
                          void* __restrict__ c, float alpha, float beta) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  // Aligned by offsetting the shared array itself (not through an integer): the compiler then knows every pointer
  // below is shared memory and emits LDS/STS with 32-bit addresses, not generic loads and stores.
  unsigned char* smem = smem_raw + ((1024u - (shared_address(smem_raw) & 1023u)) & 1023u);
  float* code2_shared = reinterpret_cast<float*>(smem + kCode2Offset);
  const std::uint32_t tiles = shared_address(smem);
  const std::uint32_t bars = shared_address(smem + kBarriersOffset);
  auto w_tile = [&](int s) { return tiles + s * kStageBytes; };
  auto a_tile = [&](int s) { return tiles + s * kStageBytes + kWTileBytes; };
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kStages + s); };
  auto code_tile = [&](int s) { return tiles + s * kStageBytes + kWTileBytes + kATileBytes; };
  // Stage s's block table of tile row (forward) or producer slot r: lo planes, then hi planes.
  auto block_table_at = [&](int s, int r) {
    return reinterpret_cast<uint4*>(smem + kBlockTablesOffset + (s * kBlockW + r) * kBlockTableBytes);
  };
  // The input gradient's stage s: the 128 finished block scales (fp32) in the same place.
  auto stage_scales = [&](int s) { return reinterpret_cast<float*>(smem + kBlockTablesOffset) + s * kBlockW; };

  const std::int64_t n_out = kBackward ? cols : rows, k_red = kBackward ? rows : cols;
  const int tid = threadIdx.x, wg = tid / 128;
  const std::int64_t n0 = static_cast<std::int64_t>(blockIdx.x) * kBlockW;
  const int m0 = static_cast<int>(blockIdx.y) * kBlockA;
  const int kt_begin = static_cast<int>(blockIdx.z) * k_tiles_per_split;
  const int k_tiles = min(k_tiles_per_split, static_cast<int>((k_red + kBlockK - 1) / kBlockK) - kt_begin);

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), kProducerThreads);  // every producer thread, once its table or scale is written (+ TMA bytes)
      mbar_init(empty(s), 256);  // every consumer thread (each has read the stage's scales)
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(&b_map)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(&code_map)) : "memory");
  }
  if (!scales.absmax)  // code2 for double-quantized scales (the NF4 values are registers: block_table)
    for (int i = tid; i < kNf4Code2Size; i += kThreads) code2_shared[i] = __ldg(scales.code2 + i);
  __syncthreads();

  if (wg == 0) {
    // ---- producer: thread 0 loads each stage's activation tile and codes with TMA; every thread writes one
    // block table (forward: weight row n0 + p) or scale (input gradient: weight row 64 kt + p % 64 for
    // the columns n0 + 64 (p / 64) ..., one block since blocks are multiples of 64), loaded kScalesAhead ahead.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    const int p = tid;
    auto raw_scale = [&](int kt) {
      if constexpr (kBackward) {
        const std::int64_t n = static_cast<std::int64_t>(kt) * kBlockK + p % 64, k = n0 + 64 * (p / 64);
        return load_scale_or_zero(scales, n < rows && k < cols, n * cols + k);
      } else {
        const std::int64_t n = n0 + p;
        return load_scale_or_zero(scales, n < rows, n * cols + static_cast<std::int64_t>(kt) * kBlockK);
      }
    };
    static_assert(kScalesAhead == 4, "the in-flight scales below are four register pairs");
    RawScale r0 = raw_scale(kt_begin), r1 = raw_scale(kt_begin + min(1, k_tiles - 1)),
             r2 = raw_scale(kt_begin + min(2, k_tiles - 1)), r3 = raw_scale(kt_begin + min(3, k_tiles - 1));
    for (int i = 0; i < k_tiles; ++i) {
      const int s = i % kStages, kt = kt_begin + i;
      const RawScale cur = r0;
      r0 = r1, r1 = r2, r2 = r3;
      if (i + kScalesAhead < k_tiles) r3 = raw_scale(kt + kScalesAhead);
      mbar_wait(empty(s), ((i / kStages) & 1) ^ 1);  // passes at once on the first round
      if (p == 0) {
        mbar_expect_tx(full(s), a_box_rows * (kBlockK * 2) + kCodeTileBytes);
        tma_load_2d(a_tile(s), &b_map, kt * kBlockK, m0, full(s));
        // The codes: forward [128 rows][32 bytes] at (32 kt bytes, row n0), 32-byte swizzle; input gradient
        // [64 rows][64 bytes] at (n0 / 2 bytes, row 64 kt), 64-byte swizzle (conflict-light reads below).
        if constexpr (kBackward)
          tma_load_2d(code_tile(s), &code_map, static_cast<int>(n0 / 2), kt * kBlockK, full(s));
        else
          tma_load_2d(code_tile(s), &code_map, kt * (kBlockK / 2), static_cast<int>(n0), full(s));
      }
      const float scale = small_m::finish_scale(scales, cur, code2_shared);
      if constexpr (kBackward) {
        stage_scales(s)[p] = scale;
      } else {
        const BlockTable t = block_table(scale);
        uint4* at = block_table_at(s, p);
        at[0] = make_uint4(t.lo[0], t.lo[1], t.lo[2], t.lo[3]);
        at[1] = make_uint4(t.hi[0], t.hi[1], t.hi[2], t.hi[3]);
      }
      mbar_arrive(full(s));  // release: the consumers' wait makes the scale visible
    }
    return;
  }

  // ---- consumers ----
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int cw = wg - 1;       // rows 64 cw .. 64 cw + 63 of the tile T: this warpgroup dequantizes and multiplies them
  const int wt = tid % 128;    // thread within the warpgroup
  const int warp = wt / 32, lane = tid % 32;
  // Stage s's block table of T row r, built by the producer.
  auto table_of = [&](int s, int r) {
    const uint4* at = block_table_at(s, r);
    const uint4 lo = at[0], hi = at[1];
    return BlockTable{{lo.x, lo.y, lo.z, lo.w}, {hi.x, hi.y, hi.z, hi.w}};
  };
  auto codes_of = [&](int s) { return smem + s * kStageBytes + kWTileBytes + kATileBytes; };
  auto release = [&](int i) {  // after stage i's wgmmas completed. Every thread arrives, not one per warp: its own
    // reads of the stage (codes, tables, scales) are then ordered before the producer's next writes of that slot.
    mbar_arrive(empty(i % kStages));
  };
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;

  if constexpr (kBackward) {
    // Input gradient: T = W^T is written to the stage's shared-memory tile M-major, that is as W's own rows
    // (weight row r of the stage: its 64 columns n0 + 64 cw ... as one 128-byte-swizzled row), and the wgmma reads
    // it transposed (imm-trans-a), so the dequantization is the forward's row-wise one: thread wt takes weight row
    // wt / 2, elements 32 (wt % 2) .. + 31 of the warpgroup's 64 columns, one block, one table, four 16-byte stores.
    // (Before, T was written K-major: two tables per thread and 16 transposing 4-byte stores.)
    auto dequantize = [&](int i) {
      const int s = i % kStages;
      mbar_wait(full(s), (i / kStages) & 1);
      const unsigned char* ct = codes_of(s);
      unsigned char* wtile = smem + s * kStageBytes + cw * 64 * 128;
      const int r = wt / 2, half = wt % 2;
      // Codes [64 rows][64 bytes], 64-byte swizzle (16-byte chunk ^= (row >> 1) & 3): chunk 2 cw + half of row r.
      const uint4 c = *reinterpret_cast<const uint4*>(ct + r * 64 + (((2 * cw + half) ^ ((r >> 1) & 3)) << 4));
      const std::uint32_t words[4] = {c.x, c.y, c.z, c.w};
      const BlockTable t = block_table(stage_scales(s)[64 * cw + r]);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<uint4*>(wtile + sw128_offset(r, 4 * half + j)) = dequant_vec(words[j], t);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic-proxy writes -> wgmma reads
    };
    // This warpgroup's threads all wrote their part of the stage before any of them issues its wgmma.
    auto sync_warpgroup = [&] { asm volatile("bar.sync %0, 128;\n" ::"r"(2 + cw) : "memory"); };
    dequantize(0);
    sync_warpgroup();
    for (int i = 0; i < k_tiles; ++i) {
      const int s = i % kStages;
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      // T M-major: k step kk is the 16 weight rows 16 kk .. 16 kk + 15, 2048 bytes further on.
      const std::uint64_t dw = sw128_mn_desc(w_tile(s) + cw * 64 * 128), da = sw128_desc(a_tile(s));
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) wgmma_m64n256k16_ss<1>(acc, dw + (2048 >> 4) * kk, da + 2 * kk);
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      // While they run: the next stage's rows of T.
      if (i + 1 < k_tiles) dequantize(i + 1);
      // The previous stage's wgmmas have finished reading shared memory once at most this one is pending.
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      if (i > 0) release(i - 1);
      sync_warpgroup();
    }
  } else {
    // Forward: T from registers (wgmma's RS form), so no shared-memory tile, fence or warpgroup barrier per stage.
    // Thread (warp, g = lane / 4, t = lane % 4) holds T rows 64 cw + 16 warp + g and + 8 at k 2t, 2t + 1, 2t + 8,
    // 2t + 9 of each 16: of each row's 32 code bytes, bytes t, t + 4, ..., t + 28, whose dequantized pairs are
    // exactly those fragment registers. Two fragment sets: one is filled while the wgmmas of the other run.
    const int g = lane / 4, t = lane % 4;
    auto fragments = [&](int i, std::uint32_t (&f)[16]) {
      const int s = i % kStages;
      mbar_wait(full(s), (i / kStages) & 1);
      const unsigned char* ct = codes_of(s);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 64 * cw + 16 * warp + g + 8 * h;
        const int flip = (r >> 2) & 1;  // codes [128 rows][32 bytes], 32-byte swizzle: 16-byte chunk ^= flip
        const uint4 c0 = *reinterpret_cast<const uint4*>(ct + r * 32 + (flip << 4));
        const uint4 c1 = *reinterpret_cast<const uint4*>(ct + r * 32 + ((1 ^ flip) << 4));
        const std::uint32_t v[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        std::uint32_t row[8];
        nf4_lut::row_fragment(v, t, table_of(s, r), row);
        // kk's registers: {row g, k 2t}, {row g + 8, k 2t}, {row g, k 2t + 8}, {row g + 8, k 2t + 8}
#pragma unroll
        for (int j = 0; j < 8; ++j) f[2 * j + h] = row[j];
      }
    };
    auto mma_stage = [&](int i, const std::uint32_t (&f)[16]) {
      const std::uint64_t da = sw128_desc(a_tile(i % kStages));
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) wgmma_m64n256k16_rs(acc, f + 4 * kk, da + 2 * kk);
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    };
    // Once stage i's wgmmas are issued: wait for stage i - 1's (they read the other fragment set), keep that set
    // live up to here (the compiler must not reuse its registers while a wgmma may still read them), release.
    auto retire_previous = [&](int i, std::uint32_t (&f)[16]) {
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
#pragma unroll
      for (int j = 0; j < 16; ++j) asm volatile("" : "+r"(f[j])::"memory");
      if (i > 0) release(i - 1);
    };
    std::uint32_t fa[16], fb[16];
    fragments(0, fa);
    for (int i = 0; i < k_tiles; i += 2) {
      mma_stage(i, fa);
      retire_previous(i, fb);
      if (i + 1 >= k_tiles) break;
      fragments(i + 1, fb);
      mma_stage(i + 1, fb);
      retire_previous(i + 1, fa);
      if (i + 2 < k_tiles) fragments(i + 2, fa);
    }
  }
  store_output_tile<kCBf16>(acc, smem, cw, warp, lane, tid - kProducerThreads, M, m0, n0, n_out, partial,
                            static_cast<int>(blockIdx.z), c, alpha, beta);
#endif
}

}  // namespace fused

namespace {

template <bool kBackward>
void launch_fused(const Context& ctx, const Nf4FusedGrid& g, const void* b16, std::int64_t M, const Nf4Weight& w,
                  const TensorView& out, float alpha, float beta) {
  const std::int64_t n_out = kBackward ? w.cols : w.rows, k_red = kBackward ? w.rows : w.cols;
  const int a_box_rows = activation_box_rows(M);
  const CUtensorMap map = activation_map(b16, M, k_red, a_box_rows), codes = code_map(w, kBackward);
  const small_m::Scales scales = small_m::scales_of(w);
  const std::int64_t splits = g.splits, per_split = g.k_tiles_per_split;
  std::unique_ptr<ScratchBuffer> scratch;
  float* partial = nullptr;
  if (splits > 1) {
    scratch = std::make_unique<ScratchBuffer>(state(ctx), static_cast<std::size_t>(splits * M * n_out) * 4);
    partial = scratch->at<float>(0);
  }
  const dim3 grid(static_cast<unsigned>(g.tiles_n), static_cast<unsigned>(g.tiles_m), static_cast<unsigned>(splits));
  auto launch = [&](auto kernel) {
    allow_dynamic_shared(reinterpret_cast<const void*>(kernel), fused::kSmemBytes);
    kernel<<<grid, fused::kThreads, fused::kSmemBytes, stream_of(ctx)>>>(
        map, codes, M, w.rows, w.cols, scales, static_cast<int>(per_split), a_box_rows, partial,
        out.data(), alpha, beta);
  };
  if (out.dtype() == DType::BF16) launch(fused::nf4_fused_gemm_kernel<kBackward, true>);
  else launch(fused::nf4_fused_gemm_kernel<kBackward, false>);
  QMM_CUDA_CHECK_LAUNCH("nf4_fused_gemm_kernel");
  if (partial) launch_nf4_split_k_reduce(ctx, partial, static_cast<int>(splits), M * n_out, out, alpha, beta);
}

}  // namespace

void launch_nf4_gemm_fused(const Context& ctx, const Nf4Plan& plan, const void* a16, std::int64_t M,
                           const Nf4Weight& w, const TensorView& c, float alpha, float beta) {
#ifdef QMM_DEV_KERNELS  // the planner takes these only where the build has them (Nf4Device::dev_kernels)
  if (plan.kernel == Nf4Kernel::FusedMma) return launch_nf4_fused_mma(ctx, a16, M, w, c, alpha, beta, false);
  if (plan.kernel == Nf4Kernel::FusedShared)
    return launch_nf4_fused_shared(ctx, plan.grid, a16, M, w, c, alpha, beta, false);
#endif
  launch_fused<false>(ctx, plan.grid, a16, M, w, c, alpha, beta);
}

void launch_nf4_gemm_backward_fused(const Context& ctx, const Nf4Plan& plan, const void* dc16, std::int64_t M,
                                    const Nf4Weight& w, const TensorView& da, float alpha, float beta) {
#ifdef QMM_DEV_KERNELS
  if (plan.kernel == Nf4Kernel::FusedMma) return launch_nf4_fused_mma(ctx, dc16, M, w, da, alpha, beta, true);
  if (plan.kernel == Nf4Kernel::FusedShared)
    return launch_nf4_fused_shared(ctx, plan.grid, dc16, M, w, da, alpha, beta, true);
#endif
  launch_fused<true>(ctx, plan.grid, dc16, M, w, da, alpha, beta);
}

}  // namespace qmm::cuda
