// What the fused NF4 GEMMs on Hopper share (nf4_fused.cu, and the shared-dequantization variant in
// dev/nf4_fused_shared.cu): the tiling and the pipeline's shared-memory layout, the producer's loads, the
// consumers' dequantization and wgmma steps, the output epilogue, and the TMA tensor maps of the operands.
// nf4_fused.cu's top comment describes the design.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/common/sm80_ptx.cuh"  // ldmatrix, cp.async
#include "cuda/nf4/nf4_small_m.h"    // launch_nf4_split_k_reduce
#include "core/nf4_lut.h"            // block tables and their byte-permute lookups (shared with a CPU test)
#include "cuda/nf4/nf4_device.cuh"  // Scales, load_scale, finish_scale, store_out
#include "qmm/error.h"

namespace qmm::cuda {

namespace fused {

using nf4_lut::block_table;
using nf4_lut::BlockTable;
using small_m::RawScale;
using small_m::Scales;
using common::sw128_offset;
using small_m::shared_address;

constexpr int kBlockW = 128;  // weight rows (outputs n) per CTA: two consumer warpgroups of m64
constexpr int kBlockA = 256;  // activation rows (outputs m) per CTA: wgmma n256
constexpr int kBlockK = 64;   // k per stage: one NF4 block, one 128-byte swizzle row of bf16
constexpr int kStages = 4;
constexpr int kProducerThreads = 128;  // one warpgroup (setmaxnreg works per warpgroup): TMA, block scales
constexpr int kThreads = kProducerThreads + 256;
constexpr int kWTileBytes = kBlockW * kBlockK * 2;     // 16 KB, written by the input gradient's consumers
constexpr int kATileBytes = kBlockA * kBlockK * 2;     // 32 KB
constexpr int kCodeTileBytes = kBlockW * kBlockK / 2;  // 4 KB
constexpr int kStageBytes = kWTileBytes + kATileBytes + kCodeTileBytes;
// Each stage's 128 block tables (forward; block_table: the block's 16 dequantized values as byte planes, 32 bytes)
// or 128 finished fp32 scales (input gradient) are written by the producer warpgroup, one per thread, from scales
// it loads ahead: no consumer thread has a global load in flight when its per-stage fence.proxy.async runs (it
// compiles to MEMBAR.ALL.CTA, which waits for them: with the scale loads in the consumers every stage paid a
// global-memory latency). Forward rows are shared by a quad's four lanes, so one table per row saves the
// consumers 4 x 32 instructions; the input gradient's threads each own their rows.
constexpr int kBlockTableBytes = 32;
constexpr int kBlockTablesOffset = kStages * kStageBytes;
constexpr int kCode2Offset = kBlockTablesOffset + kStages * kBlockW * kBlockTableBytes;
constexpr int kBarriersOffset = kCode2Offset + small_m::kCode2Bytes;
constexpr int kCPitch = kBlockW + 4;  // floats per row of the staged output tile [kBlockA][kCPitch]
[[maybe_unused]] constexpr int kCBf16Pitch = kBlockW * 2 + 16;  // bytes per row of the staged bf16 output tile
static_assert(kBlockA * kCPitch * 4 <= kCode2Offset, "the output tile is staged in the pipeline's shared memory");
static_assert(kWTileBytes % 1024 == 0 && kATileBytes % 1024 == 0 && kStageBytes % 1024 == 0,
              "tiles stay 1024-byte aligned (the swizzle patterns)");
constexpr int kSmemBytes = kBarriersOffset + 2 * kStages * 8 + 1024;  // + slack to align the base to 1024
static_assert(kSmemBytes <= 227 * 1024, "an sm_90 block has at most 227 KB of shared memory");
// setmaxnreg moves registers between warpgroups within the CTA's launch allocation (kThreads x kLaunchRegs, the
// cap __launch_bounds__ gives ptxas): the producer gives nearly all up, the consumers take them. An increase that
// the pool cannot cover never returns (a hang).
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;  // 168
[[maybe_unused]] constexpr int kProducerRegs = 56;
[[maybe_unused]] constexpr int kConsumerRegs = 224;
[[maybe_unused]] constexpr int kScalesAhead = 4;  // stages of raw scales a producer thread holds in flight
static_assert(kProducerThreads * kProducerRegs + 256 * kConsumerRegs <= kThreads * kLaunchRegs,
              "setmaxnreg must stay within the CTA's register allocation");

__device__ __forceinline__ void mbar_init(std::uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(std::uint32_t bar, int bytes) {
  asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(std::uint32_t bar, std::uint32_t parity) {
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// TMA: the tensor map's box at (column k, row) into shared memory; its bytes complete on `bar`.
__device__ __forceinline__ void tma_load_2d(std::uint32_t dst, const CUtensorMap* map, int k, int row,
                                            std::uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(k), "r"(row), "r"(bar)
      : "memory");
}

// TMA store: the shared-memory box at `src` to the tensor map's box at (column, row), as one bulk group.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, int col, int row, std::uint32_t src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
               "cp.async.bulk.commit_group;\n" ::"l"(reinterpret_cast<std::uint64_t>(map)),
               "r"(col), "r"(row), "r"(src)
               : "memory");
}
// Waits until at most kPending of this thread's bulk stores have yet to read their shared memory.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// wgmma shared-memory descriptor of a K-major tile with 128-byte rows and the 128-byte swizzle: 8-row core
// groups 1024 bytes apart (stride byte offset); the leading byte offset is unused for this layout. Moving 16
// elements along k is +32 bytes on the start address (the swizzle is applied to absolute address bits, hence the
// 1024-byte aligned tiles).
__device__ __forceinline__ std::uint64_t sw128_desc(std::uint32_t addr) {
  return static_cast<std::uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<std::uint64_t>(1024 >> 4) << 32) |
         (1ull << 62);
}

// The same for an M-major operand of 64 rows (one 128-byte swizzle atom wide along M, so the leading byte offset,
// the step between such atoms, is never used): k groups of 8 rows of 128 bytes are 1024 bytes apart.
__device__ __forceinline__ std::uint64_t sw128_mn_desc(std::uint32_t addr) {
  return static_cast<std::uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<std::uint64_t>(8192 >> 4) << 16) |
         (static_cast<std::uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ RawScale load_scale_or_zero(const Scales& scales, bool valid, std::int64_t e) {
  return valid ? small_m::load_scale(scales, e >> scales.block_shift) : RawScale{0.0f, 0u};
}

// 8 dequantized codes as the 16-byte vector that goes to shared memory.
__device__ __forceinline__ uint4 dequant_vec(std::uint32_t w, const BlockTable& t) {
  const nf4_lut::Bf16x8 v = nf4_lut::dequant_word(w, t);
  return make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]);
}

// The 128 fp32 accumulators of a wgmma m64n256: their operand list in the PTX string and as asm outputs.
#define QMM_WGMMA_D_REGS \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define QMM_WGMMA_D_OUTPUTS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// D[64x256] += A[64x16] * B[16x256]^T, both operands in shared memory (descriptors), fp32 accumulators, B
// K-major; A K-major (kTransA = 0) or M-major (kTransA = 1: its 64 rows contiguous along each k).
template <int kTransA>
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&d)[128], std::uint64_t desc_a, std::uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" QMM_WGMMA_D_REGS "}, %128, %129, p, 1, 1, %131, 0;\n"
      "}\n"
      : QMM_WGMMA_D_OUTPUTS(d)
      : "l"(desc_a), "l"(desc_b), "r"(1), "n"(kTransA));
}

// The same with A from registers: the thread's four bf16 pairs of the m64 x k16 fragment (mma.m16n8k16's A
// layout per warp: rows g and g + 8 of the warp's 16, k 2t, 2t + 1 and 2t + 8, 2t + 9), B K-major in shared memory.
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const std::uint32_t* a, std::uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" QMM_WGMMA_D_REGS "}, {%128, %129, %130, %131}, "
      "%132, p, 1, 1, 0;\n"
      "}\n"
      : QMM_WGMMA_D_OUTPUTS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// The accumulator pair (i, i + 1) that a thread gives matrix q of a stmatrix.x4.trans over activation rows
// 8 j0 .. 8 j0 + 15 (two 8-row groups, q / 2) and its warp's 16 weight rows (two halves, q % 2): accumulator
// d[4j + i] holds weight row 64 cw + 16 warp + g + 8 (i >> 1) and activation row 8j + 2t + (i & 1).
__device__ __forceinline__ int stmatrix_acc(int j0, int q) { return 4 * (j0 + q / 2) + 2 * (q % 2); }

// The bf16 epilogue (bf16 out in 16-byte aligned rows, no split): the accumulators of warpgroup cw (et = 0..255:
// consumer thread) transposed with stmatrix into a bf16 staging tile of kPassRows activation rows (pitch
// kCBf16Pitch: the eight 16-byte rows of a matrix hit distinct banks), then 16-byte copies along n, one pass per
// kPassRows rows of the tile. With beta != 0 the old values come into the staging tile first (16-byte cp.async
// along n, as the stores go) and each warp reads its fragments' old values back with ldmatrix.trans, the inverse
// of its stmatrix.trans, so alpha * sum + beta * old is rounded once, as on the other paths. Every pass ends at a
// consumer barrier, so the staging tile can be written again at once.
template <int kPassRows>
__device__ __forceinline__ void store_bf16_tile(const float (&acc)[128], std::uint32_t tile_s, const unsigned char* tile,
                                                int cw, int warp, int lane, int et, int tile_rows, int m0,
                                                std::int64_t n0, std::int64_t n_out, __nv_bfloat16* __restrict__ c,
                                                float alpha, float beta) {
  static_assert(kBlockA % kPassRows == 0 && kPassRows % 16 == 0, "passes of whole 16-row matrix pairs");
  const int chunk = et % 16;  // 8 outputs along n
  const std::int64_t n = n0 + 8 * chunk;
  const bool accumulate = beta != 0.0f;
  const int mat = lane / 8, r = lane % 8;  // the row of matrix `mat` whose address this lane gives
#pragma unroll
  for (int row0 = 0; row0 < kBlockA; row0 += kPassRows) {
    const int rows = min(kPassRows, tile_rows - row0);  // rows of this pass that exist (may be <= 0)
    if (accumulate) {
      if (n < n_out) {
        const auto* old = c + (m0 + row0 + et / 16) * n_out + n;
        for (int ml = et / 16; ml < rows; ml += 16, old += 16 * n_out)
          common::cp_async_16(tile_s + ml * kCBf16Pitch + 16 * chunk, old);
      }
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      asm volatile("bar.sync 1, 256;\n" ::: "memory");
    }
#pragma unroll
    for (int j0 = row0 / 8; j0 < (row0 + kPassRows) / 8; j0 += 2) {
      const std::uint32_t at = tile_s + (8 * (j0 - row0 / 8 + mat / 2) + r) * kCBf16Pitch +
                               2 * (64 * cw + 16 * warp + 8 * (mat % 2));
      float old[8] = {};  // matrix q's pair at 2q, 2q + 1
      if (accumulate) {
        std::uint32_t o[4];
        common::ldmatrix_x4_trans(o, at);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          old[2 * q] = __uint_as_float(o[q] << 16);
          old[2 * q + 1] = __uint_as_float(o[q] & 0xFFFF0000u);
        }
      }
      std::uint32_t v[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int i = stmatrix_acc(j0, q);
        v[q] = nf4_lut::pack_bf16x2(alpha * acc[i] + beta * old[2 * q], alpha * acc[i + 1] + beta * old[2 * q + 1]);
      }
      asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                   ::"r"(at), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
    }
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    if (n < n_out) {
      auto* out = c + (m0 + row0 + et / 16) * n_out + n;
#pragma unroll 4
      for (int ml = et / 16; ml < rows; ml += 16, out += 16 * n_out)
        *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(tile + ml * kCBf16Pitch + 16 * chunk);
    }
    asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the staging tile is read before anyone writes it again
  }
}

// Named barrier 2 + cw among consumer warpgroup cw's 128 threads (literal ids: a register id makes ptxas reserve
// all 16).
__device__ __forceinline__ void warpgroup_barrier(int cw) {
  if (cw == 0) asm volatile("bar.sync 2, 128;\n" ::: "memory");
  else asm volatile("bar.sync 3, 128;\n" ::: "memory");
}

// The persistent kernel's bf16 epilogue when nothing is read back (beta = 0): warpgroup cw stores its 64 output
// columns (weight rows n0 + 64 cw ..) of the tile in passes of 64 activation rows, each through one of its two
// 8 KB boxes (wt = 0..127: its thread; the box is [64 m][64 n] bf16 in the 128-byte swizzle of c_map, so that
// stmatrix.trans's eight 16-byte rows per matrix hit distinct banks). Its thread 0 hands a filled box to TMA and
// the warpgroup moves on (the next pass, then the next tile's wgmmas) while the copy engine writes it out, so the
// stores no longer hold up the tensor cores (v14's whole epilogue, timed by leaving it out, took ~3 µs per tile).
// A box is written again only after its previous store has read it. TMA clips rows past M and columns past n_out.
__device__ __forceinline__ void store_bf16_tile_tma(const float (&acc)[128], std::uint32_t boxes,
                                                    const CUtensorMap* c_map, int cw, int warp, int lane, int wt,
                                                    int tile_rows, int m0, std::int64_t n0, float alpha) {
  const int mat = lane / 8, r = lane % 8;  // the row of matrix `mat` whose address this lane gives
  const int chunk = 2 * warp + mat % 2;    // its 16-byte chunk of a box row: weight rows 16 warp + 8 (mat % 2) ..
#pragma unroll
  for (int pass = 0; pass < kBlockA / 64; ++pass) {
    if (64 * pass >= tile_rows) break;
    const std::uint32_t box = boxes + (pass % 2) * 8192;
    if (wt == 0) bulk_wait_read<1>();  // the store of two passes ago (this box's) has read it
    warpgroup_barrier(cw);
#pragma unroll
    for (int jj = 0; jj < 8; jj += 2) {  // the pass's 8-row groups, two per stmatrix.x4
      const int row = 8 * (jj + mat / 2) + r;
      const std::uint32_t at = box + 128 * row + 16 * (chunk ^ (row % 8));
      const int j0 = 8 * pass + jj;
      std::uint32_t v[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int i = stmatrix_acc(j0, q);
        v[q] = nf4_lut::pack_bf16x2(alpha * acc[i], alpha * acc[i + 1]);
      }
      asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                   ::"r"(at), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the stmatrix writes, for the copy engine
    warpgroup_barrier(cw);
    if (wt == 0) tma_store_2d(c_map, static_cast<int>(n0) + 64 * cw, m0 + 64 * pass, box);
  }
}

// Whether the bf16 epilogue serves a bf16 output: 16-byte aligned rows, no split-K partials.
__host__ __device__ inline bool bf16_epilogue_fits(bool split, std::int64_t n_out, const void* c) {
  return !split && n_out % 8 == 0 && (reinterpret_cast<std::uintptr_t>(c) & 15u) == 0;
}

// The epilogue of both kernels, run by the 256 consumer threads (et = 0..255: warpgroup cw, its warp, lane) once
// their wgmmas are issued: the m64n256 accumulators of warpgroup cw to rows m0.. and columns n0.. of the output
// (alpha * sum + beta * out), or raw to split `split` of `partial` [splits][M][n_out] for the split-K reduction.
// The tile goes through shared memory (the pipeline's, idle now: every stage the producer loaded has been
// consumed) so that global stores run along n.
template <bool kCBf16>
__device__ __forceinline__ void store_output_tile(float (&acc)[128], unsigned char* smem, int cw, int warp, int lane,
                                                  int et, std::int64_t M, int m0, std::int64_t n0,
                                                  std::int64_t n_out, float* __restrict__ partial, int split,
                                                  void* __restrict__ c, float alpha, float beta) {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");

  // Accumulator d[4j + i] holds weight row (output n) 64 cw + 16 warp + g + 8 (i >> 1) and activation row
  // (output m) 8j + 2t + (i & 1).
  asm volatile("bar.sync 1, 256;\n" ::: "memory");  // every consumer's wgmmas are done with the stages
  const int g = lane / 4, t = lane % 4;
  // Output rows of this tile (activation rows m0 ..): kBlockA, or what is left of M.
  const int tile_rows = M - m0 < kBlockA ? static_cast<int>(M - m0) : kBlockA;
  if (kCBf16 && bf16_epilogue_fits(partial != nullptr, n_out, c)) {
    store_bf16_tile<kBlockA>(acc, shared_address(smem), smem, cw, warp, lane, et, tile_rows, m0, n0, n_out,
                             static_cast<__nv_bfloat16*>(c), alpha, beta);
    return;
  }
  // Any other output (f32, bf16 rows that are not 16-byte aligned, split-K partials): the fp32 tile as
  // [256 m][128 n] (the row pitch makes the fragment writes conflict-free), then each thread takes 4 columns and
  // every 8th row.
  float* tile = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < 32; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      tile[(8 * j + 2 * t + (i & 1)) * kCPitch + cw * 64 + warp * 16 + g + 8 * (i >> 1)] = acc[4 * j + i];
  asm volatile("bar.sync 1, 256;\n" ::: "memory");

  float* out_f32 = partial ? partial + static_cast<std::int64_t>(split) * M * n_out : static_cast<float*>(c);
  const float a_mul = partial ? 1.0f : alpha, b_mul = partial ? 0.0f : beta;
  const bool bf16_out = !partial && kCBf16;
  const void* out_base = partial ? static_cast<void*>(partial) : c;
  const bool vec = n_out % 4 == 0 && (reinterpret_cast<std::uintptr_t>(out_base) & 15u) == 0;
  const int q = et % 32;  // columns n0 + 4q ..
  const std::int64_t n = n0 + 4 * q;
  if (n >= n_out) return;
  if (vec && b_mul != 0.0f) {
    // Accumulating: a row's old values must be read before its store, and the compiler may not hoist a later
    // row's loads above an earlier row's store (they could alias), so one row at a time paid a memory round trip
    // per row. Loading kBatch rows' old values first pays one per kBatch rows.
    constexpr int kBatch = 8;
    for (int ml0 = et / 32; ml0 < tile_rows; ml0 += 8 * kBatch) {
      float old[kBatch][4];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int ml = ml0 + 8 * b;
        if (ml >= tile_rows) break;
        const std::int64_t at = (m0 + ml) * n_out + n;
        if (bf16_out) {
          const uint2 o = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(c) + at);
          const __nv_bfloat162 o0 = *reinterpret_cast<const __nv_bfloat162*>(&o.x);
          const __nv_bfloat162 o1 = *reinterpret_cast<const __nv_bfloat162*>(&o.y);
          old[b][0] = __low2float(o0);
          old[b][1] = __high2float(o0);
          old[b][2] = __low2float(o1);
          old[b][3] = __high2float(o1);
        } else {
          const float4 o = *reinterpret_cast<const float4*>(out_f32 + at);
          old[b][0] = o.x;
          old[b][1] = o.y;
          old[b][2] = o.z;
          old[b][3] = o.w;
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int ml = ml0 + 8 * b;
        if (ml >= tile_rows) break;
        const std::int64_t at = (m0 + ml) * n_out + n;
        const float4 v = *reinterpret_cast<const float4*>(tile + ml * kCPitch + 4 * q);
        float r[4] = {a_mul * v.x, a_mul * v.y, a_mul * v.z, a_mul * v.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) r[u] += b_mul * old[b][u];
        if (bf16_out)
          *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(c) + at) =
              make_uint2(nf4_lut::pack_bf16x2(r[0], r[1]), nf4_lut::pack_bf16x2(r[2], r[3]));
        else
          *reinterpret_cast<float4*>(out_f32 + at) = make_float4(r[0], r[1], r[2], r[3]);
      }
    }
    return;
  }
  for (int ml = et / 32; ml < tile_rows; ml += 8) {
    const float4 v = *reinterpret_cast<const float4*>(tile + ml * kCPitch + 4 * q);
    const std::int64_t at = (m0 + ml) * n_out + n;
    if (vec) {  // nothing to read back here (beta != 0 took the batched loop above)
      if (bf16_out)
        *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(c) + at) = make_uint2(
            nf4_lut::pack_bf16x2(a_mul * v.x, a_mul * v.y), nf4_lut::pack_bf16x2(a_mul * v.z, a_mul * v.w));
      else
        *reinterpret_cast<float4*>(out_f32 + at) = make_float4(a_mul * v.x, a_mul * v.y, a_mul * v.z, a_mul * v.w);
    } else {
      const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (n + u >= n_out) break;
        if (bf16_out) small_m::store_out(c, true, at + u, e[u], a_mul, b_mul);
        else small_m::store_out(out_f32, false, at + u, e[u], a_mul, b_mul);
      }
    }
  }
}

}  // namespace fused

// ---- TMA tensor maps of the operands (host) ----

inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    QMM_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || p == nullptr)
      throw Error(ErrorCode::Unsupported, "nf4_gemm: path Fused needs cuTensorMapEncodeTiled from the CUDA driver");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A TMA tensor map of a row-major 2-D array [rows][cols] of 1- or 2-byte elements, boxes of [box_rows][box_cols],
// zeros past the edges.
inline CUtensorMap tensor_map_2d(const void* base, CUtensorMapDataType type, int elem_bytes, std::int64_t rows,
                                 std::int64_t cols, int box_rows, int box_cols, CUtensorMapSwizzle swizzle) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * elem_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error(ErrorCode::Cuda, "nf4_gemm: cuTensorMapEncodeTiled failed (" + std::to_string(static_cast<int>(r)) + ")");
  return map;
}

// The activation operand (A, or dC for the input gradient): bf16 [M][K], boxes of [box_rows][64 k], 128-byte
// swizzle (the wgmma operand layout).
inline CUtensorMap activation_map(const void* a16, std::int64_t M, std::int64_t K, int box_rows) {
  return tensor_map_2d(a16, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, M, K, box_rows, fused::kBlockK,
                       CU_TENSOR_MAP_SWIZZLE_128B);
}

// Rows per activation box: kBlockA, or for M below that the rows M has, rounded up to 8 (one swizzle atom). The
// tile's rows past the box keep stale data, which only reaches output rows >= M, never stored. (TMA's zero fill of
// rows past M was slow: with M = 64 the forward on Llama-3-8B gate/up took 80 us, with M = 256 51; now 49 at 64.)
inline int activation_box_rows(std::int64_t M) {
  return M >= fused::kBlockA ? fused::kBlockA : static_cast<int>((M + 7) / 8 * 8);
}

// The weight codes as bytes [N][K/2]: the forward's stage tile is 128 rows x 32 bytes, the input gradient's 64 rows
// x 64 bytes (the producer kernel's load_code_tile); the swizzle spreads the producer's 16-byte reads over banks.
inline CUtensorMap code_map(const Nf4Weight& w, bool backward) {
  return backward ? tensor_map_2d(w.codes.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w.rows, w.cols / 2,
                                  fused::kBlockK, fused::kBlockW / 2, CU_TENSOR_MAP_SWIZZLE_64B)
                  : tensor_map_2d(w.codes.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w.rows, w.cols / 2,
                                  fused::kBlockW, fused::kBlockK / 2, CU_TENSOR_MAP_SWIZZLE_32B);
}

// nf4_plan.cpp plans with these tiles (fused_grid) and conditions (fused_shape_unmet: stages of 64 along K).
static_assert(fused::kBlockW == 128 && fused::kBlockA == 256 && fused::kBlockK == 64, "nf4_plan.cpp's fused_grid");

}  // namespace qmm::cuda
