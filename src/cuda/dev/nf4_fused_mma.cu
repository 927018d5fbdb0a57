// The fused NF4 GEMM for any GPU from Ampere on (sm_80+; forced path fused_mma), W [N,K] NF4:
//   forward         C[M,N]  = alpha * A[M,K] * dequant(W)^T + beta * C
//   input gradient  dA[M,K] = alpha * dC[M,N] * dequant(W) + beta * dA
// with the dequantization inside the GEMM's main loop, on mma.sync (the tensor-core instruction Ampere and Ada
// have; the Hopper kernels in nf4_fused.cu use wgmma and TMA).
//
// Both directions are one GEMM: out[M][n_out] = X[M][k_red] * T^T, X the activations (A, or dC) and T the
// dequantized weight as [n_out][k_red]: forward T = W (n_out = N, k_red = K), input gradient T = W^T (n_out = K,
// k_red = N). A CTA (8 warps) computes a 128 x 128 output tile in stages of 64 along k_red. Per stage:
//  - cp.async brings the stage's X tile [128 rows][64] (bf16, 16-byte chunks XOR-swizzled by row so that
//    ldmatrix reads 8 rows without bank conflicts) and the weight codes of the stage: forward 128 weight rows x 32
//    bytes, input gradient 64 weight rows x 64 bytes. Each thread copies 16 code bytes, the same ones it
//    dequantizes, so the codes need no barrier of their own. Three stages are in flight.
//  - every thread dequantizes its 16 code bytes (32 elements of one weight row, inside one NF4 block) with one
//    block table (nf4_lut: the block's 16 values bf16(code * scale), exactly nf4_dequantize's contract) into the
//    shared bf16 tile of W as stored: forward [128 weight rows][64 k], input gradient [64 weight rows][128 columns];
//  - the warps multiply: warp tile 64 x 32, A fragments of X by ldmatrix, B fragments of the W tile by ldmatrix
//    (forward: W's rows are k-contiguous, the mma's column-major B) or ldmatrix.trans (input gradient: W's rows
//    run along the outputs), fp32 accumulators.
// The weight's raw scales are loaded one stage ahead into registers. Two barriers per stage (before the
// dequantization, which overwrites the tile the last stage's products read, and before the products); two CTAs
// per SM (77 KB of shared memory, 128 registers) overlap one CTA's dequantization with the other's products.
// Edges: X rows past M and columns past k_red load as zeros; weight rows or columns outside W dequantize to zero
// (zero codes, zero scale); outputs past M or n_out are not stored. With split-K the CTA writes raw fp32 sums to
// partial[split][M][n_out] and launch_nf4_split_k_reduce finishes.
#include "cuda/dev/nf4_fused_mma.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "core/nf4_lut.h"
#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/common/sm80_ptx.cuh"
#include "cuda/nf4/nf4_device.cuh"  // Scales, load_scale, finish_scale, store_out
#include "cuda/nf4/nf4_small_m.h"    // launch_nf4_split_k_reduce

namespace qmm::cuda {

namespace fused_mma {

using common::cp_async_16_or_zero;
using common::ldmatrix_x4;
using common::ldmatrix_x4_trans;
using common::mma_bf16_16816;
using common::shared_address;
using small_m::RawScale;
using small_m::Scales;

constexpr int kThreads = 256;  // 8 warps: 2 along M x 4 along the outputs, each 64 x 32
constexpr int kTileM = 128;    // activation rows (outputs m) per CTA
constexpr int kTileN = 128;    // outputs n per CTA
constexpr int kTileK = 64;     // k_red per stage: one NF4 block of a forward weight row
constexpr int kStages = 3;
constexpr int kXTileBytes = kTileM * kTileK * 2;     // 16 KB
constexpr int kCodeTileBytes = kTileN * kTileK / 2;  // 4 KB
constexpr int kStageBytes = kXTileBytes + kCodeTileBytes;
constexpr int kWTileOffset = kStages * kStageBytes;
constexpr int kWTileBytes = kTileN * kTileK * 2;     // 16 KB, the dequantized weight of one stage
constexpr int kCode2Offset = kWTileOffset + kWTileBytes;
constexpr int kSmemBytes = kCode2Offset + small_m::kCode2Bytes;  // 77 KB: two CTAs fit an sm_80 SM
static_assert(kThreads * 16 == kCodeTileBytes, "each thread copies and dequantizes 16 code bytes per stage");
static_assert(kThreads == small_m::kCode2Bytes / 4, "one code2 value per thread");

// The X tile and the forward's W tile have 128-byte rows (8 chunks), swizzled as common::sw128_offset.
__device__ __forceinline__ std::uint32_t swizzle128(int row, int chunk) {
  return static_cast<std::uint32_t>(common::sw128_offset(row, chunk));
}
// The input gradient's W tile (256-byte rows, 16 chunks): the same XOR, and bit 1 flipped in the upper 8 chunks,
// so that the dequantizing threads' stores (two rows x four chunks 8 apart per 8 lanes) hit 8 bank groups too.
__device__ __forceinline__ std::uint32_t swizzle256(int row, int chunk) {
  return static_cast<std::uint32_t>(row * 256 + ((chunk ^ (row & 7) ^ ((chunk >> 3) << 1)) << 4));
}

// Where thread `tid` copies and dequantizes its 16 code bytes: weight row `row` of the stage (forward: of the
// CTA's 128; input gradient: of the stage's 64) and its `part`-th 32 elements along the row.
struct CodeSlot {
  int row, part;
};
template <bool kBackward>
__device__ __forceinline__ CodeSlot code_slot(int tid) {
  return kBackward ? CodeSlot{tid >> 2, tid & 3} : CodeSlot{tid >> 1, tid & 1};
}

template <bool kBackward, bool kCBf16>
__global__ void __launch_bounds__(kThreads, 2)
    nf4_fused_mma_kernel(const __nv_bfloat16* __restrict__ x, const std::uint8_t* __restrict__ codes, Scales scales,
                         std::int64_t M, std::int64_t rows, std::int64_t cols, int k_tiles_per_split,
                         float* __restrict__ partial, void* __restrict__ c, float alpha, float beta) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;  // the warp's 64 rows and 32 outputs of the tile
  const std::int64_t n_out = kBackward ? cols : rows, k_red = kBackward ? rows : cols;
  const std::int64_t n0 = static_cast<std::int64_t>(blockIdx.x) * kTileN;
  const std::int64_t m0 = static_cast<std::int64_t>(blockIdx.y) * kTileM;
  const std::int64_t k_tiles = (k_red + kTileK - 1) / kTileK;
  const std::int64_t kt0 = static_cast<std::int64_t>(blockIdx.z) * k_tiles_per_split;
  const int stages = static_cast<int>(std::min<std::int64_t>(k_tiles - kt0, k_tiles_per_split));
  const std::uint32_t smem_s = shared_address(smem);
  const std::uint32_t w_tile = smem_s + kWTileOffset;
  float* code2_shared = reinterpret_cast<float*>(smem + kCode2Offset);

  // This thread's share of a stage's copies, as addresses that advance by a fixed step per stage. X: rows
  // x_row + 32 j (j < 4) at chunk x_chunk. Codes: weight row n0 + row (forward) or 64 s + row (input gradient) of
  // the stage, elements 32 part.. of the stage's (forward) or the tile's columns (input gradient).
  const int x_row = tid >> 3, x_chunk = tid & 7;
  const int x_rows = static_cast<int>(std::clamp<std::int64_t>((M - m0 - x_row + 31) / 32, 0, 4));  // rows < M
  const std::uint32_t x_dst = swizzle128(x_row, x_chunk);  // + 4096 j: 32 rows on
  const CodeSlot cs = code_slot<kBackward>(tid);
  const std::int64_t half_cols = cols / 2;  // code bytes per weight row
  const std::int64_t row0 = kBackward ? 64 * kt0 + cs.row : n0 + cs.row;            // at stage 0
  const std::int64_t col0 = kBackward ? n0 + 32 * cs.part : 64 * kt0 + 32 * cs.part;  // its first element
  const std::int64_t code_step = kBackward ? 64 * half_cols : 32;                     // bytes per stage
  const std::int64_t elem_step = kBackward ? 64 * cols : 64;                          // elements per stage
  // Whether the stage's 32 elements lie inside W (otherwise zero codes and a zero scale).
  auto code_valid = [&](int s) { return (kBackward ? row0 + 64 * s : row0) < rows && col0 < cols; };
  const std::uint32_t code_offset = static_cast<std::uint32_t>(kXTileBytes + 16 * tid);  // within a stage
  const __nv_bfloat16* x_at = x + (m0 + x_row) * k_red + 64 * kt0 + 8 * x_chunk;
  const std::uint8_t* code_at = codes + row0 * half_cols + col0 / 2;

  // Issues the next stage's copies into its slot (one commit group, empty past the last stage).
  int issued = 0;
  auto issue = [&] {
    if (issued < stages) {
      const std::uint32_t slot = smem_s + (issued % kStages) * kStageBytes;
      const bool cols_ok = 64 * (kt0 + issued) + 8 * x_chunk < k_red;  // whole 8-element chunks (k_red % 8 == 0)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool ok = j < x_rows && cols_ok;
        cp_async_16_or_zero(slot + x_dst + 4096 * j, ok ? x_at + 32 * j * k_red : x, ok);
      }
      const bool ok = code_valid(issued);
      cp_async_16_or_zero(slot + code_offset, ok ? code_at : codes, ok);
      x_at += kTileK;
      code_at += code_step;
    }
    common::cp_async_commit();
    ++issued;
  };
  static_assert(kTileM * 8 == 4 * kThreads, "four X chunks per thread");
  // The raw scale of stage s (loaded one stage ahead), zero outside W.
  auto raw_scale = [&](int s) {
    return s < stages && code_valid(s)
               ? small_m::load_scale(scales, (row0 * cols + col0 + elem_step * s) >> scales.block_shift)
               : RawScale{0.0f, 0u};
  };

  if (!scales.absmax) code2_shared[tid] = __ldg(scales.code2 + tid);
  issue();
  issue();
  RawScale scale_now = raw_scale(0);

  // ldmatrix addresses, per lane. A (X): matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
  // (rows 8-15, k 8-15) of a 16 x 16 fragment; lane L gives row L % 16's address in the k half L / 16.
  const int a_row = 64 * wm + (lane & 15), a_half = lane >> 4;
  // B: two n8 tiles per ldmatrix.x4, giving b0, b1 of the first, then of the second.
  //  forward (W tile [n][k], as stored): lane L gives output row 8 (L / 16) + L % 8 in the k half (L / 8) % 2;
  //  input gradient (W tile [k][n], .trans): k row L % 8 + 8 ((L / 8) % 2), output chunk L / 16.
  const int b_n = 32 * wn + 8 * (lane >> 4) + (lane & 7), b_half = (lane >> 3) & 1;
  const int b_k = (lane & 7) + 8 * ((lane >> 3) & 1), b_chunk = 4 * wn + (lane >> 4);

  float acc[4][4][4] = {};  // [m16 tile][n8 tile][fragment]
  for (int s = 0; s < stages; ++s) {
    const RawScale scale_next = raw_scale(s + 1);
    common::cp_async_wait<1>();  // stage s has landed (s + 1 may be in flight)
    __syncthreads();             // ... for every thread; and every warp is done with stage s - 1's products
    issue();                     // stage s + 2, into stage s - 1's slot

    // Dequantize this thread's 32 elements into the W tile.
    const std::uint32_t slot = smem_s + (s % kStages) * kStageBytes;
    {
      uint4 w;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                   : "r"(slot + code_offset)
                   : "memory");
      const float sc = code_valid(s) ? small_m::finish_scale(scales, scale_now, code2_shared) : 0.0f;
      const nf4_lut::BlockTable tb = nf4_lut::block_table(sc);
      const std::uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const nf4_lut::Bf16x8 v = nf4_lut::dequant_word(words[j], tb);
        const int chunk = 4 * cs.part + j;
        const std::uint32_t at = w_tile + (kBackward ? swizzle256(cs.row, chunk) : swizzle128(cs.row, chunk));
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(v.w[0]), "r"(v.w[1]), "r"(v.w[2]),
                     "r"(v.w[3])
                     : "memory");
      }
    }
    scale_now = scale_next;
    __syncthreads();  // the W tile is complete

#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      std::uint32_t a[4][4], b[4][2];
#pragma unroll
      for (int i = 0; i < 4; ++i) ldmatrix_x4(a[i], slot + swizzle128(a_row + 16 * i, 2 * kk + a_half));
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        std::uint32_t r[4];
        if constexpr (kBackward) ldmatrix_x4_trans(r, w_tile + swizzle256(16 * kk + b_k, b_chunk + 2 * jp));
        else ldmatrix_x4(r, w_tile + swizzle128(b_n + 16 * jp, 2 * kk + b_half));
        b[2 * jp][0] = r[0], b[2 * jp][1] = r[1], b[2 * jp + 1][0] = r[2], b[2 * jp + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_bf16_16816(acc[i][j], a[i], b[j][0], b[j][1]);
    }
  }
  common::cp_async_wait<0>();  // no copy outlives the CTA

  // Fragment [i][j][e]: output row m0 + 64 wm + 16 i + lane / 4 + 8 (e / 2), column n0 + 32 wn + 8 j + 2 (lane % 4)
  // + e % 2. Raw sums to the split's partial, or alpha * sum + beta * old to C.
  float* out_f32 = partial ? partial + static_cast<std::int64_t>(blockIdx.z) * M * n_out : static_cast<float*>(c);
  const bool bf16_out = !partial && kCBf16;
  const float a_mul = partial ? 1.0f : alpha, b_mul = partial ? 0.0f : beta;
  // Pairs of neighbouring columns (n even) go out as one 4- or 8-byte store where both exist, nothing is read back
  // and the pair is aligned (even row length, aligned base).
  void* const base = bf16_out ? c : static_cast<void*>(out_f32);
  const bool pair_store = n_out % 2 == 0 && b_mul == 0.0f &&
                          reinterpret_cast<std::uintptr_t>(base) % (bf16_out ? 4 : 8) == 0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
      const std::int64_t m = m0 + 64 * wm + 16 * i + (lane >> 2) + 8 * e2;
      if (m >= M) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::int64_t n = n0 + 32 * wn + 8 * j + 2 * (lane & 3);
        if (n >= n_out) continue;
        const float v0 = acc[i][j][2 * e2], v1 = acc[i][j][2 * e2 + 1];
        const std::int64_t at = m * n_out + n;
        if (pair_store && n + 1 < n_out) {
          if (bf16_out)
            *reinterpret_cast<std::uint32_t*>(static_cast<__nv_bfloat16*>(c) + at) =
                nf4_lut::pack_bf16x2(a_mul * v0, a_mul * v1);
          else
            *reinterpret_cast<float2*>(out_f32 + at) = make_float2(a_mul * v0, a_mul * v1);
          continue;
        }
        small_m::store_out(base, bf16_out, at, v0, a_mul, b_mul);
        if (n + 1 < n_out) small_m::store_out(base, bf16_out, at + 1, v1, a_mul, b_mul);
      }
    }
}

}  // namespace fused_mma

// nf4_plan.cpp plans with this kernel's shared memory (kMmaSharedBytes) and stages of 64 (fused_shape_unmet).
static_assert(fused_mma::kSmemBytes == 78848 && fused_mma::kTileK == 64, "nf4_plan.cpp's fused_mma_unmet");

void launch_nf4_fused_mma(const Context& ctx, const void* x16, std::int64_t M, const Nf4Weight& w,
                          const TensorView& out, float alpha, float beta, bool backward) {
  using namespace fused_mma;
  const std::int64_t n_out = backward ? w.cols : w.rows, k_red = backward ? w.rows : w.cols;
  const std::int64_t sms = state(ctx).sm_count();
  const std::int64_t tiles_n = (n_out + kTileN - 1) / kTileN, tiles_m = (M + kTileM - 1) / kTileM;
  const std::int64_t tiles = tiles_n * tiles_m, k_tiles = (k_red + kTileK - 1) / kTileK;
  // Split k_red only where the tiles fill less than one CTA per SM (two fit), and never below 4 stages a split:
  // each split adds an fp32 partial of the output, written and read back.
  std::int64_t splits = 1;
  if (tiles < sms) splits = std::clamp<std::int64_t>(2 * sms / std::max<std::int64_t>(tiles, 1), 1,
                                                     std::max<std::int64_t>(1, k_tiles / 4));
  const std::int64_t per_split = (k_tiles + splits - 1) / splits;
  splits = (k_tiles + per_split - 1) / per_split;
  std::unique_ptr<ScratchBuffer> scratch;
  float* partial = nullptr;
  if (splits > 1) {
    scratch = std::make_unique<ScratchBuffer>(state(ctx), static_cast<std::size_t>(splits * M * n_out) * 4);
    partial = scratch->at<float>(0);
  }
  const small_m::Scales scales = small_m::scales_of(w);
  const dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(tiles_m), static_cast<unsigned>(splits));
  auto launch = [&](auto kernel) {
    allow_dynamic_shared(reinterpret_cast<const void*>(kernel), kSmemBytes);
    kernel<<<grid, kThreads, kSmemBytes, stream_of(ctx)>>>(
        static_cast<const __nv_bfloat16*>(x16), w.codes.data_as<const std::uint8_t>(), scales, M, w.rows, w.cols,
        static_cast<int>(per_split), partial, out.data(), alpha, beta);
  };
  const bool bf16 = out.dtype() == DType::BF16;
  if (backward) bf16 ? launch(nf4_fused_mma_kernel<true, true>) : launch(nf4_fused_mma_kernel<true, false>);
  else bf16 ? launch(nf4_fused_mma_kernel<false, true>) : launch(nf4_fused_mma_kernel<false, false>);
  QMM_CUDA_CHECK_LAUNCH("nf4_fused_mma_kernel");
  if (partial) launch_nf4_split_k_reduce(ctx, partial, static_cast<int>(splits), M * n_out, out, alpha, beta);
}

}  // namespace qmm::cuda
