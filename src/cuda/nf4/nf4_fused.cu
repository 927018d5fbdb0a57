// The fused NF4 GEMMs on Hopper (sm_90a), W [N,K] NF4:
//   forward         C[M,N]  = alpha * A[M,K] * dequant(W)^T + beta * C
//   input gradient  dA[M,K] = alpha * dC[M,N] * dequant(W) + beta * dA
//
// Two kernels: nf4_fused_gemm_kernel dequantizes each CTA's weight tiles inside its main loop (Nf4Path::Fused,
// described first); nf4_shared_dequant_gemm_kernel (Nf4Path::FusedShared, below) dequantizes each tile once per
// call into a bf16 workspace that the CTAs sharing it load with TMA. Both share the tiling and the epilogue.
//
// Both are computed transposed, out^T = T * B^T with T the dequantized weight tile (W, or W^T for the input
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
#ifdef QMM_DEV_KERNELS
#include "cuda/dev/nf4_fused_mma.h"
#endif
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

// ---- Shared dequantization (Nf4Path::FusedShared): each weight tile dequantized once per launch ----
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

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
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
CUtensorMap tensor_map_2d(const void* base, CUtensorMapDataType type, int elem_bytes, std::int64_t rows,
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
CUtensorMap activation_map(const void* a16, std::int64_t M, std::int64_t K, int box_rows) {
  return tensor_map_2d(a16, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, M, K, box_rows, fused::kBlockK,
                       CU_TENSOR_MAP_SWIZZLE_128B);
}

// Rows per activation box: kBlockA, or for M below that the rows M has, rounded up to 8 (one swizzle atom). The
// tile's rows past the box keep stale data, which only reaches output rows >= M, never stored. (TMA's zero fill of
// rows past M was slow: with M = 64 the forward on Llama-3-8B gate/up took 80 us, with M = 256 51; now 49 at 64.)
int activation_box_rows(std::int64_t M) {
  return M >= fused::kBlockA ? fused::kBlockA : static_cast<int>((M + 7) / 8 * 8);
}

// The weight codes as bytes [N][K/2]: the forward's stage tile is 128 rows x 32 bytes, the input gradient's 64 rows
// x 64 bytes (the producer kernel's load_code_tile); the swizzle spreads the producer's 16-byte reads over banks.
CUtensorMap code_map(const Nf4Weight& w, bool backward) {
  return backward ? tensor_map_2d(w.codes.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w.rows, w.cols / 2,
                                  fused::kBlockK, fused::kBlockW / 2, CU_TENSOR_MAP_SWIZZLE_64B)
                  : tensor_map_2d(w.codes.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w.rows, w.cols / 2,
                                  fused::kBlockW, fused::kBlockK / 2, CU_TENSOR_MAP_SWIZZLE_32B);
}

}  // namespace

// nf4_plan.cpp plans with these tiles (fused_grid) and conditions (fused_shape_unmet: stages of 64 along K).
static_assert(fused::kBlockW == 128 && fused::kBlockA == 256 && fused::kBlockK == 64, "nf4_plan.cpp's fused_grid");

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

void launch_nf4_gemm_fused(const Context& ctx, const Nf4Plan& plan, const void* a16, std::int64_t M,
                           const Nf4Weight& w, const TensorView& c, float alpha, float beta) {
#ifdef QMM_DEV_KERNELS  // the planner takes FusedMma only where the build has it (Nf4Device::dev_kernels)
  if (plan.kernel == Nf4Kernel::FusedMma) return launch_nf4_fused_mma(ctx, a16, M, w, c, alpha, beta, false);
#endif
  if (plan.kernel == Nf4Kernel::FusedShared) launch_shared_dequant<false>(ctx, plan.grid, a16, M, w, c, alpha, beta);
  else launch_fused<false>(ctx, plan.grid, a16, M, w, c, alpha, beta);
}

void launch_nf4_gemm_backward_fused(const Context& ctx, const Nf4Plan& plan, const void* dc16, std::int64_t M,
                                    const Nf4Weight& w, const TensorView& da, float alpha, float beta) {
#ifdef QMM_DEV_KERNELS
  if (plan.kernel == Nf4Kernel::FusedMma) return launch_nf4_fused_mma(ctx, dc16, M, w, da, alpha, beta, true);
#endif
  if (plan.kernel == Nf4Kernel::FusedShared)
    launch_shared_dequant<true>(ctx, plan.grid, dc16, M, w, da, alpha, beta);
  else launch_fused<true>(ctx, plan.grid, dc16, M, w, da, alpha, beta);
}

}  // namespace qmm::cuda
