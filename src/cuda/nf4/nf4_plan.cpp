// The NF4 GEMM planner (nf4_plan.h). Plain C++: built into every qmm library, CUDA or not.
//
// Auto, in order:
//  1. the small-M kernels for few rows, where they can run (forward and gate_up up to kAutoSmallMRows; the input
//     gradient only on large weights, up to kAutoSmallMBackwardRowsLarge), and among them the slice kernel where
//     it fits and wins (bf16 activations, up to 16 rows: slice_wins), then the pair kernel where it fits, the GEMV
//     at one row, the table kernel otherwise;
//  2. the fused wgmma kernel (sm_90a) for tens to hundreds of rows where it can run: on large weights from just
//     above the small-M range, on smaller ones from kAutoFusedMinRows and only when its grid fills the GPU;
//  3. dequantize + cuBLASLt otherwise.
// A forced path (SmallM, SmallMSlice, Fused, FusedShared, FusedMma) takes its kernel where it can run and is
// Unsupported otherwise; DequantGemm always runs. Measurements behind the thresholds: docs/BENCHMARKS.md.
#include "cuda/nf4/nf4_plan.h"

#include <algorithm>
#include <cstdint>

namespace qmm::cuda {

namespace {

// ---- the thresholds: every rule Auto applies -------------------------------------------------------------------

// Forward and gate_up: the small-M kernels beat dequantize + cuBLASLt up to their 32-row limit on the model shapes.
constexpr std::int64_t kAutoSmallMRows = 32;
// Input gradient: the small-M kernel wins only on large weights, and there only up to 8 rows.
constexpr std::int64_t kAutoSmallMBackwardRowsLarge = 8;
// A "large" weight: between the two model sizes measured (Qwen2.5-1.5B 13.8M and Llama-3-8B 58.7M elements).
constexpr std::int64_t kLargeWeightElements = 32ll << 20;
// The in-loop fused kernel loses to dequantize + cuBLASLt at thousands of rows (it dequantizes a weight tile once
// per 256 activation rows); it wins up to here.
constexpr std::int64_t kAutoFusedMaxRows = 512;
// On smaller weights dequantizing is cheap: the fused kernel wins only from this many rows...
constexpr std::int64_t kAutoFusedMinRows = 32;
// ...and only where its last wave of CTAs keeps this share of the SMs busy (wave quantization decides there).
constexpr double kMinWaveFill = 0.9;
// The pair kernel reads bf16 A as it is, or packed in fragment order by a kernel of its own (always for f32 A):
// packing pays back with two n8 tiles (9+ rows) and a long reduction (K of 4096 or more).
constexpr std::int64_t kPairPackMinRows = 9;
constexpr std::int64_t kPairPackMinK = 4096;
// Among the small-M kernels the slice kernel wins for bf16 activations from 2 to 16 rows on every model shape, and
// at one row on weights with N >= K (gate, up) and for gate_up; at one row with N < K (down) the pair kernel is as
// fast or faster. f32 activations (the pair kernel packs them) stay with the pair kernel: not timed.
// Auto never takes FusedShared (slower than dequantize + cuBLASLt under sustained load) nor FusedMma (not yet timed
// against the others).

// ---- what each kernel needs (the kernels' own constants; their .cu files static_assert these) -----------------

constexpr std::int64_t kSmallMMaxRows = 32;           // nf4_small_m.h kNf4SmallMMaxRows
constexpr std::int64_t kSmallMBackwardMaxRows = 16;   // nf4_small_m.h kNf4SmallMBackwardMaxRows
constexpr std::int64_t kPairMaxRows = 16;             // two n8 tiles
constexpr std::int64_t kSliceMaxRows = 16;            // small_m::kSliceMaxRows (dev/nf4_slice_kernel.cuh)
constexpr std::int64_t kPairSharedBytes = 224256;     // small_m::kPairSharedBytes: 219 KB (sm_90 gives it)
constexpr std::int64_t kGemvChunk = 64;               // small_m::kGemvChunk
constexpr std::int64_t kGemvGroupK = 2048;            // small_m::kGemvGroupK
constexpr std::int64_t kGemvSums = 256;               // small_m::kGemvSums
constexpr std::int64_t kGemvSharedBytes = 110592;     // small_m::kGemvSharedBytes: 108 KB
constexpr std::int64_t kFusedBlockW = 128, kFusedBlockA = 256, kFusedBlockK = 64;  // fused::kBlock{W,A,K}
constexpr std::int64_t kMmaSharedBytes = 78848;       // fused_mma::kSmemBytes: 77 KB

bool aligned(int align, int bytes) { return align >= bytes; }
bool act_dtype_ok(DType t) { return t == DType::F32 || t == DType::BF16; }

// nf4_small_m.cu, forward (table, pair and GEMV kernels): M <= 32, K a multiple of 64, blocks of at least 64,
// 16-byte aligned A and codes.
bool small_m_fits(const Nf4Problem& p, const Nf4WeightFacts& w) {
  return p.m >= 1 && p.m <= kSmallMMaxRows && w.cols % 64 == 0 && w.block_size >= 64 && aligned(p.act_align, 16) &&
         aligned(w.codes_align, 16) && act_dtype_ok(p.act);
}
constexpr const char* kSmallMNeeds =
    "M <= 32, K a multiple of 64, NF4 blocks of at least 64, 16-byte aligned A and codes";

// nf4_small_m.cu, input gradient: M <= 16, K a multiple of 32, blocks of at least 32, 16-byte aligned codes.
bool small_m_backward_fits(const Nf4Problem& p) {
  return p.m >= 1 && p.m <= kSmallMBackwardMaxRows && p.w.cols % 32 == 0 && p.w.block_size >= 32 &&
         aligned(p.w.codes_align, 16) && act_dtype_ok(p.act);
}
constexpr const char* kSmallMBackwardNeeds = "M <= 16, K a multiple of 32, 16-byte aligned codes";

// The pair kernel beyond the small-M conditions: M <= 16, blocks of 64, K a multiple of 256, absmax read in
// aligned pairs (plain: 8 bytes) or q in aligned words (double-quantized: 4), and 219 KB of shared memory.
bool pair_fits(const Nf4Problem& p, const Nf4WeightFacts& w, const Nf4Device& d) {
  return p.m <= kPairMaxRows && w.block_size == 64 && w.cols % 256 == 0 &&
         aligned(w.absmax_align, w.double_quant ? 4 : 8) && d.smem_per_block_optin >= kPairSharedBytes;
}

// The GEMV beyond the small-M conditions: 64-element chunks inside one block, its (row, k group) sums in shared
// memory, code2 16-byte aligned, and 108 KB of shared memory.
bool gemv_fits(const Nf4WeightFacts& w, const Nf4Device& d) {
  const std::int64_t K = w.cols;
  return K % kGemvChunk == 0 && w.block_size >= kGemvChunk && (K + kGemvGroupK - 1) / kGemvGroupK <= kGemvSums &&
         (!w.double_quant || aligned(w.code2_align, 16)) && d.smem_per_block_optin >= kGemvSharedBytes;
}

// dev/nf4_slice.cu: the pair kernel's conditions for both weights, one scale format, M <= 16 (its shared memory is
// less than the pair kernel's: dev/nf4_slice.cu static_asserts it).
bool slice_fits(const Nf4Problem& p, const Nf4WeightFacts& w0, const Nf4WeightFacts& w1, const Nf4Device& d) {
  return p.m <= kSliceMaxRows && small_m_fits(p, w0) && small_m_fits(p, w1) && w0.rows == w1.rows &&
         pair_fits(p, w0, d) && pair_fits(p, w1, d) && w0.double_quant == w1.double_quant;
}
// Auto's slice rule (the measurements above kAutoSmallMRows); slice_fits is checked apart.
bool slice_wins(const Nf4Problem& p, bool gate_up) {
  return p.act == DType::BF16 && (p.m >= 2 || gate_up || p.w.rows >= p.w.cols);
}
constexpr const char* kSliceNeeds =
    "M <= 16, blocks of 64, K a multiple of 256, one scale format, aligned A, codes and absmax, and sm_90's shared "
    "memory";

// Every fused kernel's stages of 64 along K and 16-byte rows; the first unmet condition, or null.
const char* fused_shape_unmet(const Nf4Problem& p, const Nf4WeightFacts& w, bool backward) {
  if (w.cols % 64 != 0) return "K a multiple of 64";
  if (backward && w.rows % 8 != 0) return "N a multiple of 8 (16-byte dC rows)";
  if (w.block_size % 64 != 0) return "a block size that is a multiple of 64";
  if ((p.act == DType::BF16 && !aligned(p.act_align, 16)) || !aligned(w.codes_align, 16))
    return "16-byte aligned bf16 activations and codes";
  return nullptr;
}

// nf4_fused.cu (InLoop and SharedDequant): an sm_90a build on a compute capability 9.0 GPU.
const char* fused_unmet(const Nf4Problem& p, const Nf4WeightFacts& w, bool backward, const Nf4Device& d) {
  if (!d.sm90a_code) return "a build with sm_90a (QMM_CUDA_ARCHS containing 90a)";
  if (d.cc != 90) return "a compute capability 9.0 GPU (Hopper)";
  return fused_shape_unmet(p, w, backward);
}

// FusedShared and FusedMma are development kernels (src/cuda/dev/), in builds configured with them only.
constexpr const char* kDevKernelsNeeded = "a build with the development kernels (-DQMM_DEV_KERNELS=ON)";

// dev/nf4_fused_mma.cu: a build with the development kernels, compute capability 8.0 or newer with 77 KB of shared
// memory per block.
const char* fused_mma_unmet(const Nf4Problem& p, const Nf4WeightFacts& w, bool backward, const Nf4Device& d) {
  if (!d.dev_kernels) return kDevKernelsNeeded;
  if (d.cc < 80) return "a GPU of compute capability 8.0 or newer";
  if (d.smem_per_block_optin < kMmaSharedBytes) return "77 KB of shared memory per block";
  return fused_shape_unmet(p, w, backward);
}

// The fused wgmma kernels' grid: tiles of 128 outputs (n_out) x 256 activation rows, split over k_red only when
// the tiles fill less than half the GPU, and only as far as one wave (each split adds an fp32 partial of the
// output written and read back), never below 4 k tiles a split.
Nf4FusedGrid fused_grid(std::int64_t sms, std::int64_t M, std::int64_t n_out, std::int64_t k_red) {
  Nf4FusedGrid g;
  g.tiles_n = (n_out + kFusedBlockW - 1) / kFusedBlockW;
  g.tiles_m = (M + kFusedBlockA - 1) / kFusedBlockA;
  const std::int64_t tiles = g.tiles_n * g.tiles_m;
  const std::int64_t k_tiles = (k_red + kFusedBlockK - 1) / kFusedBlockK;
  g.splits = 1;
  if (2 * tiles <= sms)
    g.splits = std::clamp<std::int64_t>(sms / std::max<std::int64_t>(tiles, 1), 1, std::max<std::int64_t>(1, k_tiles / 4));
  g.k_tiles_per_split = (k_tiles + g.splits - 1) / g.splits;
  g.splits = (k_tiles + g.k_tiles_per_split - 1) / g.k_tiles_per_split;
  return g;
}

Nf4FusedGrid fused_grid_for(const Nf4Problem& p, const Nf4Device& d, bool backward) {
  return fused_grid(d.sm_count, p.m, backward ? p.w.cols : p.w.rows, backward ? p.w.rows : p.w.cols);
}

// How full the fused grid's last wave keeps the GPU, in (0, 1]: CTAs over whole waves of one CTA per SM.
double wave_fill(const Nf4FusedGrid& g, std::int64_t sms) {
  const std::int64_t ctas = g.tiles_n * g.tiles_m * g.splits;
  const std::int64_t waves = std::max<std::int64_t>((ctas + sms - 1) / sms, 1);
  return static_cast<double>(ctas) / static_cast<double>(waves * sms);
}

Nf4Plan unsupported(const char* why) {
  Nf4Plan plan;
  plan.why = why;
  return plan;
}

// The small-M forward kernel and its instance for a problem small_m_fits takes (weights w0, w1: gate_up's two, or
// the one twice).
Nf4Plan small_m_forward(const Nf4Problem& p, const Nf4WeightFacts& w0, const Nf4WeightFacts& w1,
                        const Nf4Device& d, const char* why) {
  Nf4Plan plan;
  plan.why = why;
  if (pair_fits(p, w0, d) && pair_fits(p, w1, d) && w0.double_quant == w1.double_quant) {
    plan.kernel = Nf4Kernel::SmallMPair;
    plan.n8_tiles = p.m <= 8 ? 1 : 2;
    plan.packed_a = p.act == DType::F32 || (p.m >= kPairPackMinRows && w0.cols >= kPairPackMinK);
    return plan;
  }
  if (p.m == 1 && gemv_fits(w0, d) && gemv_fits(w1, d)) {
    plan.kernel = Nf4Kernel::SmallMGemv;
    return plan;
  }
  plan.kernel = Nf4Kernel::SmallMTable;
  plan.n8_tiles = p.m <= 8 ? 1 : p.m <= 16 ? 2 : 4;
  return plan;
}

}  // namespace

const char* nf4_op_name(Nf4Op op) {
  switch (op) {
    case Nf4Op::Forward: return "nf4_gemm";
    case Nf4Op::BackwardA: return "nf4_gemm_backward_a";
    case Nf4Op::GateUp: return "nf4_gate_up";
  }
  return "?";
}

const char* nf4_kernel_name(Nf4Kernel k) {
  switch (k) {
    case Nf4Kernel::Unsupported: return "unsupported";
    case Nf4Kernel::DequantGemm: return "dequant+cublaslt";
    case Nf4Kernel::SmallMPair: return "small-m pair";
    case Nf4Kernel::SmallMGemv: return "small-m gemv";
    case Nf4Kernel::SmallMTable: return "small-m table";
    case Nf4Kernel::SmallMBackward: return "small-m backward";
    case Nf4Kernel::FusedInLoop: return "fused in-loop";
    case Nf4Kernel::FusedShared: return "fused shared-dequant";
    case Nf4Kernel::FusedMma: return "fused mma.sync";
    case Nf4Kernel::SmallMSlice: return "small-m slice";
  }
  return "?";
}

namespace {
int alignment_of(const void* p) {
  const auto v = reinterpret_cast<std::uintptr_t>(p);
  for (int a = 16; a > 1; a /= 2)
    if (v % static_cast<std::uintptr_t>(a) == 0) return a;
  return 1;
}
}  // namespace

Nf4WeightFacts nf4_weight_facts(const Nf4Weight& w) {
  Nf4WeightFacts f;
  f.rows = w.rows;
  f.cols = w.cols;
  f.block_size = w.block_size;
  f.double_quant = w.double_quant();
  f.codes_align = alignment_of(w.codes.data());
  f.absmax_align = alignment_of(w.absmax.data());
  f.code2_align = w.double_quant() ? alignment_of(w.code2.data()) : 16;
  return f;
}

Nf4Problem nf4_problem(Nf4Op op, const TensorView& act, const Nf4Weight& w, const Nf4Weight* w_up, DType out,
                       const Nf4GemmOptions& opts) {
  Nf4Problem p;
  p.op = op;
  p.m = act.dim(0);
  p.w = nf4_weight_facts(w);
  p.w_up = w_up ? nf4_weight_facts(*w_up) : p.w;
  p.act = act.dtype();
  p.act_align = alignment_of(act.data());
  p.out = out;
  p.beta = opts.beta;
  p.path = opts.path;
  return p;
}

Nf4Problem nf4_problem_of_shape(Nf4Op op, std::int64_t m, std::int64_t n, std::int64_t k, DType act,
                                bool double_quant, Nf4Path path) {
  Nf4Problem p;
  p.op = op;
  p.m = m;
  p.w.rows = n;
  p.w.cols = k;
  p.w.double_quant = double_quant;
  p.w_up = p.w;
  p.act = act;
  p.path = path;
  return p;
}

Nf4Plan plan_nf4(const Nf4Problem& p, const Nf4Device& d) {
  const bool backward = p.op == Nf4Op::BackwardA;
  const bool gate_up = p.op == Nf4Op::GateUp;
  const Nf4WeightFacts& w_up = gate_up ? p.w_up : p.w;
  const bool large = p.w.rows * p.w.cols >= kLargeWeightElements;
  if (p.path == nf4_forced::kReference) return unsupported("runs on the CPU backend only (use a CPU context)");
  if (p.path == nf4_forced::kSmallMSlice) {
    if (backward) return unsupported("the forward or gate_up: the slice kernel has no input gradient");
    if (!slice_fits(p, p.w, w_up, d)) return unsupported(kSliceNeeds);
    Nf4Plan plan;
    plan.kernel = Nf4Kernel::SmallMSlice;
    plan.n8_tiles = p.m <= 8 ? 1 : 2;
    plan.why = "forced (path small_m_slice)";
    return plan;
  }

  // 1. Small M.
  const std::int64_t auto_rows = !backward ? kAutoSmallMRows : large ? kAutoSmallMBackwardRowsLarge : 0;
  const bool wants_small_m = p.path == nf4_forced::kSmallM || (p.path == Nf4Path::Auto && p.m <= auto_rows);
  const bool small_m_ok = backward ? small_m_backward_fits(p)
                                   : small_m_fits(p, p.w) && small_m_fits(p, w_up) && p.w.rows == w_up.rows;
  if (wants_small_m && small_m_ok) {
    const char* why = p.path == nf4_forced::kSmallM ? "forced (path small_m)"
                      : backward ? "M <= 8 on a large weight: the small-M input gradient beats dequantize + GEMM"
                                 : "M <= 32: the small-M kernels beat dequantize + GEMM";
    if (!backward && p.path == Nf4Path::Auto && slice_wins(p, gate_up) && slice_fits(p, p.w, w_up, d)) {
      Nf4Plan plan;
      plan.kernel = Nf4Kernel::SmallMSlice;
      plan.n8_tiles = p.m <= 8 ? 1 : 2;
      plan.why = "bf16 rows, up to 16: the slice kernel beats the pair kernel";
      return plan;
    }
    if (!backward) return small_m_forward(p, p.w, w_up, d, why);
    Nf4Plan plan;
    plan.kernel = Nf4Kernel::SmallMBackward;
    plan.n8_tiles = p.m <= 8 ? 1 : 2;
    plan.why = why;
    return plan;
  }
  if (p.path == nf4_forced::kSmallM) return unsupported(backward ? kSmallMBackwardNeeds : kSmallMNeeds);

  // 2. Fused: forced, or Auto's row ranges.
  Nf4Kernel fused = Nf4Kernel::Unsupported;
  const char* why = "";
  if (p.path == Nf4Path::Fused) fused = Nf4Kernel::FusedInLoop, why = "forced (path fused)";
  else if (p.path == nf4_forced::kFusedShared) fused = Nf4Kernel::FusedShared, why = "forced (path fused_shared)";
  else if (p.path == nf4_forced::kFusedMma) fused = Nf4Kernel::FusedMma, why = "forced (path fused_mma)";
  else if (p.path == Nf4Path::Auto) {
    // Large weights: from where the small-M kernels stop (the forward's 32 rows; the input gradient's small-M range
    // was taken above where it applied).
    const std::int64_t min_rows = large ? (backward ? 0 : kAutoSmallMRows + 1) : kAutoFusedMinRows;
    if (p.m >= min_rows && p.m <= kAutoFusedMaxRows &&
        (large || wave_fill(fused_grid_for(p, d, backward), d.sm_count) >= kMinWaveFill)) {
      fused = Nf4Kernel::FusedInLoop;
      why = large ? "tens to hundreds of rows on a large weight: fused beats dequantize + GEMM"
                  : "tens to hundreds of rows and the fused grid fills the GPU: fused beats dequantize + GEMM";
    }
  }
  if (fused != Nf4Kernel::Unsupported) {
    auto unmet = [&](const Nf4WeightFacts& w) -> const char* {
      if (fused == Nf4Kernel::FusedMma) return fused_mma_unmet(p, w, backward, d);
      if (fused == Nf4Kernel::FusedShared && !d.dev_kernels) return kDevKernelsNeeded;
      return fused_unmet(p, w, backward, d);
    };
    const char* missing = unmet(p.w);
    if (!missing && gate_up) missing = unmet(w_up);
    if (!missing) {
      Nf4Plan plan;
      plan.kernel = fused;
      plan.why = why;
      if (fused != Nf4Kernel::FusedMma) plan.grid = fused_grid_for(p, d, backward);
      return plan;
    }
    if (p.path != Nf4Path::Auto) return unsupported(missing);
  }

  // 3. Dequantize + cuBLASLt.
  Nf4Plan plan;
  plan.kernel = Nf4Kernel::DequantGemm;
  plan.why = p.path == Nf4Path::DequantGemm ? "forced (path dequant_gemm)"
             : fused != Nf4Kernel::Unsupported
                 ? "fused would win here but cannot run (device, build or shape): dequantize + GEMM"
             : wants_small_m ? "the small-M kernels cannot run this problem (shape or alignment): dequantize + GEMM"
                             : "outside the small-M and fused ranges: dequantize + GEMM";
  return plan;
}

std::string nf4_plan_summary(const Nf4Plan& plan) {
  std::string s = nf4_kernel_name(plan.kernel);
  const bool small_m = plan.kernel == Nf4Kernel::SmallMPair || plan.kernel == Nf4Kernel::SmallMTable ||
                       plan.kernel == Nf4Kernel::SmallMBackward || plan.kernel == Nf4Kernel::SmallMSlice;
  if (small_m) {
    s.append(" x").append(std::to_string(plan.n8_tiles));
    s.append(plan.kernel == Nf4Kernel::SmallMBackward ? " m8" : " n8");
  }
  if (plan.kernel == Nf4Kernel::SmallMPair) s.append(plan.packed_a ? ", packed A" : ", direct A");
  if (plan.kernel == Nf4Kernel::FusedInLoop || plan.kernel == Nf4Kernel::FusedShared) {
    s.append(", ").append(std::to_string(plan.grid.tiles_n)).append("x").append(std::to_string(plan.grid.tiles_m));
    s.append(" tiles, split-K ").append(std::to_string(plan.grid.splits));
  }
  return s.append(": ").append(plan.why);
}

}  // namespace qmm::cuda
