// The NF4 planner (src/cuda/nf4/nf4_plan.h) without a GPU: Auto's choices for H100, H200 and A100 capabilities over
// the model shapes, pinned as a table so that a threshold change shows as a diff here; forced paths and the
// device- and alignment-dependent rules one by one.
#include <gtest/gtest.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/nf4/nf4_plan.h"

namespace qmm::cuda {
namespace {

Nf4Device h100() { return {90, 132, 50ll << 20, 232448, 233472, true}; }
Nf4Device h200() { return {90, 132, 60ll << 20, 232448, 233472, true}; }
Nf4Device a100() { return {80, 108, 40ll << 20, 166912, 167936, true}; }

struct Shape {
  const char* label;
  std::int64_t k, n;
};
// bench/shapes.h's projections, and K not a multiple of 256 (1088 = 17 x 64) or of 64 (1056 = 33 x 32).
const std::vector<Shape> kShapes = {{"qwen-gate_up", 1536, 8960}, {"qwen-down", 8960, 1536},
                                    {"llama-gate_up", 4096, 14336}, {"llama-down", 14336, 4096},
                                    {"k1088", 1088, 4096},           {"k1056", 1056, 2048}};
const std::vector<std::int64_t> kRows = {1, 2, 8, 9, 16, 17, 32, 33, 64, 256, 512, 513, 1024, 2048, 4096};

Nf4Problem problem(Nf4Op op, std::int64_t m, const Shape& s, DType act, bool dq, float beta = 0.0f,
                   Nf4Path path = Nf4Path::Auto) {
  Nf4Problem p = nf4_problem_of_shape(op, m, s.n, s.k, act, dq, path);
  p.beta = beta;
  return p;
}

// A plan in a few characters: P pair (1/2 n8 tiles, d direct / p packed A), G GEMV, T table (n8 tiles),
// B small-M input gradient (m8 tiles), L small-M slice (n8 tiles), F fused in-loop (split-K), S fused shared, M fused
// mma, D dequantize + GEMM, U unsupported.
std::string code(const Nf4Plan& p) {
  switch (p.kernel) {
    case Nf4Kernel::SmallMPair: return "P" + std::to_string(p.n8_tiles) + (p.packed_a ? "p" : "d");
    case Nf4Kernel::SmallMGemv: return "G";
    case Nf4Kernel::SmallMTable: return "T" + std::to_string(p.n8_tiles);
    case Nf4Kernel::SmallMBackward: return "B" + std::to_string(p.n8_tiles);
    case Nf4Kernel::FusedInLoop: return "F" + std::to_string(p.grid.splits);
    case Nf4Kernel::FusedShared: return "S" + std::to_string(p.grid.splits);
    case Nf4Kernel::FusedMma: return "M";
    case Nf4Kernel::SmallMSlice: return "L" + std::to_string(p.n8_tiles);
    case Nf4Kernel::DequantGemm: return "D";
    case Nf4Kernel::Unsupported: return "U";
  }
  return "?";
}

// One line per (op, shape, activation dtype, double quant): Auto's plan at each of kRows.
std::string auto_table(const Nf4Device& d) {
  std::ostringstream out;
  for (Nf4Op op : {Nf4Op::Forward, Nf4Op::BackwardA, Nf4Op::GateUp})
    for (const Shape& s : kShapes)
      for (DType act : {DType::F32, DType::BF16})
        for (bool dq : {false, true}) {
          out << nf4_op_name(op) << ' ' << s.label << ' ' << (act == DType::F32 ? "f32" : "bf16") << (dq ? " dq" : "")
              << ":";
          for (std::int64_t m : kRows) out << ' ' << code(plan_nf4(problem(op, m, s, act, dq), d));
          out << '\n';
        }
  return out.str();
}

// The tables below were written by the planner and checked against the dispatch it replaced (nf4_gemm.cu,
// nf4_small_m.cu's launch_rows and launch_pair, nf4_fused.cu's fused_grid at commit 7c2278a). M columns:
// 1 2 8 9 16 17 32 33 64 256 512 513 1024 2048 4096.
const char* const kH100 = R"(
nf4_gemm qwen-gate_up f32: P1p P1p P1p P2p P2p T4 T4 D D D D D D D D
nf4_gemm qwen-gate_up f32 dq: P1p P1p P1p P2p P2p T4 T4 D D D D D D D D
nf4_gemm qwen-gate_up bf16: L1 L1 L1 L2 L2 T4 T4 D D D D D D D D
nf4_gemm qwen-gate_up bf16 dq: L1 L1 L1 L2 L2 T4 T4 D D D D D D D D
nf4_gemm qwen-down f32: P1p P1p P1p P2p P2p T4 T4 F11 F11 F11 F5 D D D D
nf4_gemm qwen-down f32 dq: P1p P1p P1p P2p P2p T4 T4 F11 F11 F11 F5 D D D D
nf4_gemm qwen-down bf16: P1d L1 L1 L2 L2 T4 T4 F11 F11 F11 F5 D D D D
nf4_gemm qwen-down bf16 dq: P1d L1 L1 L2 L2 T4 T4 F11 F11 F11 F5 D D D D
nf4_gemm llama-gate_up f32: P1p P1p P1p P2p P2p T4 T4 F1 F1 F1 F1 D D D D
nf4_gemm llama-gate_up f32 dq: P1p P1p P1p P2p P2p T4 T4 F1 F1 F1 F1 D D D D
nf4_gemm llama-gate_up bf16: L1 L1 L1 L2 L2 T4 T4 F1 F1 F1 F1 D D D D
nf4_gemm llama-gate_up bf16 dq: L1 L1 L1 L2 L2 T4 T4 F1 F1 F1 F1 D D D D
nf4_gemm llama-down f32: P1p P1p P1p P2p P2p T4 T4 F4 F4 F4 F2 D D D D
nf4_gemm llama-down f32 dq: P1p P1p P1p P2p P2p T4 T4 F4 F4 F4 F2 D D D D
nf4_gemm llama-down bf16: P1d L1 L1 L2 L2 T4 T4 F4 F4 F4 F2 D D D D
nf4_gemm llama-down bf16 dq: P1d L1 L1 L2 L2 T4 T4 F4 F4 F4 F2 D D D D
nf4_gemm k1088 f32: G T1 T1 T2 T2 T4 T4 F4 F4 F4 F2 D D D D
nf4_gemm k1088 f32 dq: G T1 T1 T2 T2 T4 T4 F4 F4 F4 F2 D D D D
nf4_gemm k1088 bf16: G T1 T1 T2 T2 T4 T4 F4 F4 F4 F2 D D D D
nf4_gemm k1088 bf16 dq: G T1 T1 T2 T2 T4 T4 F4 F4 F4 F2 D D D D
nf4_gemm k1056 f32: D D D D D D D D D D D D D D D
nf4_gemm k1056 f32 dq: D D D D D D D D D D D D D D D
nf4_gemm k1056 bf16: D D D D D D D D D D D D D D D
nf4_gemm k1056 bf16 dq: D D D D D D D D D D D D D D D
nf4_gemm_backward_a qwen-gate_up f32: D D D D D D F11 F11 F11 F11 F5 D D D D
nf4_gemm_backward_a qwen-gate_up f32 dq: D D D D D D F11 F11 F11 F11 F5 D D D D
nf4_gemm_backward_a qwen-gate_up bf16: D D D D D D F11 F11 F11 F11 F5 D D D D
nf4_gemm_backward_a qwen-gate_up bf16 dq: D D D D D D F11 F11 F11 F11 F5 D D D D
nf4_gemm_backward_a qwen-down f32: D D D D D D D D D D D D D D D
nf4_gemm_backward_a qwen-down f32 dq: D D D D D D D D D D D D D D D
nf4_gemm_backward_a qwen-down bf16: D D D D D D D D D D D D D D D
nf4_gemm_backward_a qwen-down bf16 dq: D D D D D D D D D D D D D D D
nf4_gemm_backward_a llama-gate_up f32: B1 B1 B1 F4 F4 F4 F4 F4 F4 F4 F2 D D D D
nf4_gemm_backward_a llama-gate_up f32 dq: B1 B1 B1 F4 F4 F4 F4 F4 F4 F4 F2 D D D D
nf4_gemm_backward_a llama-gate_up bf16: B1 B1 B1 F4 F4 F4 F4 F4 F4 F4 F2 D D D D
nf4_gemm_backward_a llama-gate_up bf16 dq: B1 B1 B1 F4 F4 F4 F4 F4 F4 F4 F2 D D D D
nf4_gemm_backward_a llama-down f32: B1 B1 B1 F1 F1 F1 F1 F1 F1 F1 F1 D D D D
nf4_gemm_backward_a llama-down f32 dq: B1 B1 B1 F1 F1 F1 F1 F1 F1 F1 F1 D D D D
nf4_gemm_backward_a llama-down bf16: B1 B1 B1 F1 F1 F1 F1 F1 F1 F1 F1 D D D D
nf4_gemm_backward_a llama-down bf16 dq: B1 B1 B1 F1 F1 F1 F1 F1 F1 F1 F1 D D D D
nf4_gemm_backward_a k1088 f32: D D D D D D D D D D F7 D D D D
nf4_gemm_backward_a k1088 f32 dq: D D D D D D D D D D F7 D D D D
nf4_gemm_backward_a k1088 bf16: D D D D D D D D D D F7 D D D D
nf4_gemm_backward_a k1088 bf16 dq: D D D D D D D D D D F7 D D D D
nf4_gemm_backward_a k1056 f32: D D D D D D D D D D D D D D D
nf4_gemm_backward_a k1056 f32 dq: D D D D D D D D D D D D D D D
nf4_gemm_backward_a k1056 bf16: D D D D D D D D D D D D D D D
nf4_gemm_backward_a k1056 bf16 dq: D D D D D D D D D D D D D D D
nf4_gate_up qwen-gate_up f32: P1p P1p P1p P2p P2p T4 T4 D D D D D D D D
nf4_gate_up qwen-gate_up f32 dq: P1p P1p P1p P2p P2p T4 T4 D D D D D D D D
nf4_gate_up qwen-gate_up bf16: L1 L1 L1 L2 L2 T4 T4 D D D D D D D D
nf4_gate_up qwen-gate_up bf16 dq: L1 L1 L1 L2 L2 T4 T4 D D D D D D D D
nf4_gate_up qwen-down f32: P1p P1p P1p P2p P2p T4 T4 F11 F11 F11 F5 D D D D
nf4_gate_up qwen-down f32 dq: P1p P1p P1p P2p P2p T4 T4 F11 F11 F11 F5 D D D D
nf4_gate_up qwen-down bf16: L1 L1 L1 L2 L2 T4 T4 F11 F11 F11 F5 D D D D
nf4_gate_up qwen-down bf16 dq: L1 L1 L1 L2 L2 T4 T4 F11 F11 F11 F5 D D D D
nf4_gate_up llama-gate_up f32: P1p P1p P1p P2p P2p T4 T4 F1 F1 F1 F1 D D D D
nf4_gate_up llama-gate_up f32 dq: P1p P1p P1p P2p P2p T4 T4 F1 F1 F1 F1 D D D D
nf4_gate_up llama-gate_up bf16: L1 L1 L1 L2 L2 T4 T4 F1 F1 F1 F1 D D D D
nf4_gate_up llama-gate_up bf16 dq: L1 L1 L1 L2 L2 T4 T4 F1 F1 F1 F1 D D D D
nf4_gate_up llama-down f32: P1p P1p P1p P2p P2p T4 T4 F4 F4 F4 F2 D D D D
nf4_gate_up llama-down f32 dq: P1p P1p P1p P2p P2p T4 T4 F4 F4 F4 F2 D D D D
nf4_gate_up llama-down bf16: L1 L1 L1 L2 L2 T4 T4 F4 F4 F4 F2 D D D D
nf4_gate_up llama-down bf16 dq: L1 L1 L1 L2 L2 T4 T4 F4 F4 F4 F2 D D D D
nf4_gate_up k1088 f32: G T1 T1 T2 T2 T4 T4 F4 F4 F4 F2 D D D D
nf4_gate_up k1088 f32 dq: G T1 T1 T2 T2 T4 T4 F4 F4 F4 F2 D D D D
nf4_gate_up k1088 bf16: G T1 T1 T2 T2 T4 T4 F4 F4 F4 F2 D D D D
nf4_gate_up k1088 bf16 dq: G T1 T1 T2 T2 T4 T4 F4 F4 F4 F2 D D D D
nf4_gate_up k1056 f32: D D D D D D D D D D D D D D D
nf4_gate_up k1056 f32 dq: D D D D D D D D D D D D D D D
nf4_gate_up k1056 bf16: D D D D D D D D D D D D D D D
nf4_gate_up k1056 bf16 dq: D D D D D D D D D D D D D D D
)" + 1;
const char* const kA100 = R"(
nf4_gemm qwen-gate_up f32: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm qwen-gate_up f32 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm qwen-gate_up bf16: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm qwen-gate_up bf16 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm qwen-down f32: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm qwen-down f32 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm qwen-down bf16: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm qwen-down bf16 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm llama-gate_up f32: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm llama-gate_up f32 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm llama-gate_up bf16: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm llama-gate_up bf16 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm llama-down f32: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm llama-down f32 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm llama-down bf16: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm llama-down bf16 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm k1088 f32: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm k1088 f32 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm k1088 bf16: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm k1088 bf16 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gemm k1056 f32: D D D D D D D D D D D D D D D
nf4_gemm k1056 f32 dq: D D D D D D D D D D D D D D D
nf4_gemm k1056 bf16: D D D D D D D D D D D D D D D
nf4_gemm k1056 bf16 dq: D D D D D D D D D D D D D D D
nf4_gemm_backward_a qwen-gate_up f32: D D D D D D D D D D D D D D D
nf4_gemm_backward_a qwen-gate_up f32 dq: D D D D D D D D D D D D D D D
nf4_gemm_backward_a qwen-gate_up bf16: D D D D D D D D D D D D D D D
nf4_gemm_backward_a qwen-gate_up bf16 dq: D D D D D D D D D D D D D D D
nf4_gemm_backward_a qwen-down f32: D D D D D D D D D D D D D D D
nf4_gemm_backward_a qwen-down f32 dq: D D D D D D D D D D D D D D D
nf4_gemm_backward_a qwen-down bf16: D D D D D D D D D D D D D D D
nf4_gemm_backward_a qwen-down bf16 dq: D D D D D D D D D D D D D D D
nf4_gemm_backward_a llama-gate_up f32: B1 B1 B1 D D D D D D D D D D D D
nf4_gemm_backward_a llama-gate_up f32 dq: B1 B1 B1 D D D D D D D D D D D D
nf4_gemm_backward_a llama-gate_up bf16: B1 B1 B1 D D D D D D D D D D D D
nf4_gemm_backward_a llama-gate_up bf16 dq: B1 B1 B1 D D D D D D D D D D D D
nf4_gemm_backward_a llama-down f32: B1 B1 B1 D D D D D D D D D D D D
nf4_gemm_backward_a llama-down f32 dq: B1 B1 B1 D D D D D D D D D D D D
nf4_gemm_backward_a llama-down bf16: B1 B1 B1 D D D D D D D D D D D D
nf4_gemm_backward_a llama-down bf16 dq: B1 B1 B1 D D D D D D D D D D D D
nf4_gemm_backward_a k1088 f32: D D D D D D D D D D D D D D D
nf4_gemm_backward_a k1088 f32 dq: D D D D D D D D D D D D D D D
nf4_gemm_backward_a k1088 bf16: D D D D D D D D D D D D D D D
nf4_gemm_backward_a k1088 bf16 dq: D D D D D D D D D D D D D D D
nf4_gemm_backward_a k1056 f32: D D D D D D D D D D D D D D D
nf4_gemm_backward_a k1056 f32 dq: D D D D D D D D D D D D D D D
nf4_gemm_backward_a k1056 bf16: D D D D D D D D D D D D D D D
nf4_gemm_backward_a k1056 bf16 dq: D D D D D D D D D D D D D D D
nf4_gate_up qwen-gate_up f32: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up qwen-gate_up f32 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up qwen-gate_up bf16: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up qwen-gate_up bf16 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up qwen-down f32: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up qwen-down f32 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up qwen-down bf16: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up qwen-down bf16 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up llama-gate_up f32: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up llama-gate_up f32 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up llama-gate_up bf16: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up llama-gate_up bf16 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up llama-down f32: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up llama-down f32 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up llama-down bf16: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up llama-down bf16 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up k1088 f32: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up k1088 f32 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up k1088 bf16: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up k1088 bf16 dq: G T1 T1 T2 T2 T4 T4 D D D D D D D D
nf4_gate_up k1056 f32: D D D D D D D D D D D D D D D
nf4_gate_up k1056 f32 dq: D D D D D D D D D D D D D D D
nf4_gate_up k1056 bf16: D D D D D D D D D D D D D D D
nf4_gate_up k1056 bf16 dq: D D D D D D D D D D D D D D D
)" + 1;

TEST(Nf4Plan, AutoOnH100) { EXPECT_EQ(auto_table(h100()), kH100); }

// No rule reads the L2 size yet: H200 plans as H100.
TEST(Nf4Plan, AutoOnH200) { EXPECT_EQ(auto_table(h200()), kH100); }

// No wgmma kernel (compute capability 8.0) and no pair kernel (163 KB of shared memory per block).
TEST(Nf4Plan, AutoOnA100) { EXPECT_EQ(auto_table(a100()), kA100); }

// beta and the output dtype change no plan.
TEST(Nf4Plan, BetaAndOutputDtypeChangeNothing) {
  for (const Nf4Device& d : {h100(), a100()})
    for (Nf4Op op : {Nf4Op::Forward, Nf4Op::BackwardA, Nf4Op::GateUp})
      for (const Shape& s : kShapes)
        for (std::int64_t m : kRows) {
          const Nf4Plan base = plan_nf4(problem(op, m, s, DType::BF16, true), d);
          Nf4Problem p = problem(op, m, s, DType::BF16, true, 1.0f);
          p.out = DType::F32;
          EXPECT_EQ(nf4_plan_summary(plan_nf4(p, d)), nf4_plan_summary(base)) << nf4_op_name(op) << ' ' << s.label << ' ' << m;
        }
}

TEST(Nf4Plan, BuildWithoutSm90aTakesNoWgmmaKernel) {
  Nf4Device d = h100();
  d.sm90a_code = false;
  const Shape llama_up = kShapes[2];
  EXPECT_EQ(plan_nf4(problem(Nf4Op::Forward, 64, llama_up, DType::BF16, true), d).kernel, Nf4Kernel::DequantGemm);
  const Nf4Plan forced = plan_nf4(problem(Nf4Op::Forward, 64, llama_up, DType::BF16, true, 0.0f, Nf4Path::Fused), d);
  EXPECT_EQ(forced.kernel, Nf4Kernel::Unsupported);
  EXPECT_STREQ(forced.why, "a build with sm_90a (QMM_CUDA_ARCHS containing 90a)");
}

TEST(Nf4Plan, ForcedPaths) {
  const Shape llama_up = kShapes[2], odd = kShapes[5];
  auto plan = [&](Nf4Op op, std::int64_t m, const Shape& s, Nf4Path path, const Nf4Device& d) {
    return plan_nf4(problem(op, m, s, DType::BF16, false, 0.0f, path), d);
  };
  EXPECT_EQ(plan(Nf4Op::Forward, 4096, llama_up, Nf4Path::Fused, h100()).kernel, Nf4Kernel::FusedInLoop);
  Nf4Device h100_dev = h100();  // builds with the development kernels (src/cuda/dev/)
  h100_dev.dev_kernels = true;
  EXPECT_EQ(plan(Nf4Op::Forward, 4096, llama_up, nf4_forced::kFusedShared, h100_dev).kernel, Nf4Kernel::FusedShared);
  EXPECT_STREQ(plan(Nf4Op::Forward, 4096, llama_up, nf4_forced::kFusedShared, h100()).why,
               "a build with the development kernels (-DQMM_DEV_KERNELS=ON)");
  Nf4Device a100_dev = a100();
  a100_dev.dev_kernels = true;
  EXPECT_EQ(plan(Nf4Op::BackwardA, 8, llama_up, nf4_forced::kFusedMma, a100_dev).kernel, Nf4Kernel::FusedMma);
  EXPECT_STREQ(plan(Nf4Op::BackwardA, 8, llama_up, nf4_forced::kFusedMma, a100()).why,
               "a build with the development kernels (-DQMM_DEV_KERNELS=ON)");
  EXPECT_EQ(plan(Nf4Op::Forward, 8, llama_up, Nf4Path::DequantGemm, h100()).kernel, Nf4Kernel::DequantGemm);
  EXPECT_EQ(plan(Nf4Op::BackwardA, 16, kShapes[0], nf4_forced::kSmallM, h100()).kernel, Nf4Kernel::SmallMBackward);
  EXPECT_STREQ(plan(Nf4Op::Forward, 4096, llama_up, Nf4Path::Fused, a100()).why,
               "a compute capability 9.0 GPU (Hopper)");
  EXPECT_STREQ(plan(Nf4Op::Forward, 64, odd, Nf4Path::Fused, h100()).why, "K a multiple of 64");
  EXPECT_STREQ(plan(Nf4Op::Forward, 33, llama_up, nf4_forced::kSmallM, h100()).why,
               "M <= 32, K a multiple of 64, NF4 blocks of at least 64, 16-byte aligned A and codes");
  EXPECT_STREQ(plan(Nf4Op::BackwardA, 17, llama_up, nf4_forced::kSmallM, h100()).why,
               "M <= 16, K a multiple of 32, 16-byte aligned codes");
  EXPECT_EQ(plan(Nf4Op::Forward, 8, llama_up, nf4_forced::kReference, h100()).kernel, Nf4Kernel::Unsupported);
  Nf4Device old = a100_dev;
  old.cc = 75;
  EXPECT_STREQ(plan(Nf4Op::Forward, 256, llama_up, nf4_forced::kFusedMma, old).why,
               "a GPU of compute capability 8.0 or newer");
}

// The slice kernel, forced: forward and gate_up up to 16 rows where the pair kernel fits, f32 A too, in every
// build; otherwise Unsupported, saying what is missing.
TEST(Nf4Plan, ForcedSlice) {
  const Shape llama_up = kShapes[2], k1088 = kShapes[4];
  auto plan = [&](Nf4Op op, std::int64_t m, const Shape& s, const Nf4Device& d, DType act = DType::BF16) {
    return plan_nf4(problem(op, m, s, act, true, 0.0f, nf4_forced::kSmallMSlice), d);
  };
  EXPECT_EQ(code(plan(Nf4Op::Forward, 1, llama_up, h100())), "L1");
  EXPECT_EQ(code(plan(Nf4Op::Forward, 8, llama_up, h100())), "L1");
  EXPECT_EQ(code(plan(Nf4Op::Forward, 9, llama_up, h100(), DType::F32)), "L2");
  EXPECT_EQ(code(plan(Nf4Op::GateUp, 16, kShapes[0], h100())), "L2");
  EXPECT_STREQ(plan(Nf4Op::Forward, 16, llama_up, h100()).why, "forced (path small_m_slice)");
  const char* needs = "M <= 16, blocks of 64, K a multiple of 256, one scale format, aligned A, codes and absmax, "
                      "and sm_90's shared memory";
  EXPECT_STREQ(plan(Nf4Op::Forward, 17, llama_up, h100()).why, needs);
  EXPECT_STREQ(plan(Nf4Op::Forward, 4, k1088, h100()).why, needs);
  EXPECT_STREQ(plan(Nf4Op::Forward, 4, llama_up, a100()).why, needs);  // 163 KB of shared memory per block
  EXPECT_STREQ(plan(Nf4Op::BackwardA, 4, llama_up, h100()).why,
               "the forward or gate_up: the slice kernel has no input gradient");
  EXPECT_EQ(code(plan(Nf4Op::Forward, 4, llama_up, h100())), "L1");  // not a development kernel: every build has it
  Nf4Problem mixed = problem(Nf4Op::GateUp, 4, llama_up, DType::BF16, true, 0.0f, nf4_forced::kSmallMSlice);
  mixed.w_up.double_quant = false;  // one kernel instance serves both weights
  EXPECT_STREQ(plan_nf4(mixed, h100()).why, needs);
  Nf4Problem misaligned = problem(Nf4Op::Forward, 4, llama_up, DType::BF16, true, 0.0f, nf4_forced::kSmallMSlice);
  misaligned.act_align = 8;
  EXPECT_EQ(plan_nf4(misaligned, h100()).kernel, Nf4Kernel::Unsupported);
}

// Auto's slice rule: bf16 rows from 2 to 16, and one row where N >= K or for gate_up; the pair kernel at one row
// with N < K and for f32 rows; nothing where the slice kernel cannot run (A100's shared memory: the table kernel).
TEST(Nf4Plan, AutoSliceRule) {
  const Shape qwen_up = kShapes[0], qwen_down = kShapes[1], llama_down = kShapes[3];
  auto plan = [](Nf4Op op, std::int64_t m, const Shape& s, DType act = DType::BF16, const Nf4Device& d = h100()) {
    return code(plan_nf4(problem(op, m, s, act, true), d));
  };
  EXPECT_EQ(plan(Nf4Op::Forward, 1, qwen_up), "L1");
  EXPECT_EQ(plan(Nf4Op::Forward, 1, llama_down), "P1d");
  EXPECT_EQ(plan(Nf4Op::Forward, 2, llama_down), "L1");
  EXPECT_EQ(plan(Nf4Op::Forward, 16, qwen_down), "L2");
  EXPECT_EQ(plan(Nf4Op::Forward, 17, qwen_down), "T4");
  EXPECT_EQ(plan(Nf4Op::GateUp, 1, qwen_down), "L1");
  EXPECT_EQ(plan(Nf4Op::Forward, 8, qwen_up, DType::F32), "P1p");
  EXPECT_EQ(plan(Nf4Op::Forward, 8, qwen_up, DType::BF16, a100()), "T1");
  EXPECT_STREQ(plan_nf4(problem(Nf4Op::Forward, 8, qwen_up, DType::BF16, true), h100()).why,
               "bf16 rows, up to 16: the slice kernel beats the pair kernel");
}

TEST(Nf4Plan, AlignmentAndFormatRules) {
  const Shape qwen_up = kShapes[0], llama_up = kShapes[2];
  // Misaligned A: no small-M kernel. An f32 A is rounded into aligned scratch for the fused kernel, so at M = 32 on
  // a smaller weight whose grid fills the GPU (Qwen down) the fused kernel still runs; a bf16 one cannot.
  Nf4Problem p = problem(Nf4Op::Forward, 32, kShapes[1], DType::F32, false);
  p.act_align = 4;
  EXPECT_EQ(plan_nf4(p, h100()).kernel, Nf4Kernel::FusedInLoop);
  p.act = DType::BF16;
  p.act_align = 2;
  EXPECT_EQ(plan_nf4(p, h100()).kernel, Nf4Kernel::DequantGemm);
  // absmax read in pairs (plain) or words (double-quantized): misaligned, the pair kernel gives way to the table.
  p = problem(Nf4Op::Forward, 4, llama_up, DType::BF16, false);
  p.w.absmax_align = 4;
  p.w_up = p.w;
  EXPECT_EQ(plan_nf4(p, h100()).kernel, Nf4Kernel::SmallMTable);
  p.w.double_quant = true;
  p.w_up = p.w;
  EXPECT_EQ(plan_nf4(p, h100()).kernel, Nf4Kernel::SmallMSlice);  // bf16 rows: the slice kernel, the pair's conditions
  p.act = DType::F32;
  EXPECT_EQ(plan_nf4(p, h100()).kernel, Nf4Kernel::SmallMPair);
  p.act = DType::BF16;
  // The GEMV reads code2 as 16-byte vectors.
  p = problem(Nf4Op::Forward, 1, qwen_up, DType::BF16, true);
  EXPECT_EQ(plan_nf4(p, a100()).kernel, Nf4Kernel::SmallMGemv);
  p.w.code2_align = 8;
  EXPECT_EQ(plan_nf4(p, a100()).kernel, Nf4Kernel::SmallMTable);
  // gate_up with one plain and one double-quantized weight: the pair kernel takes one scale format.
  p = problem(Nf4Op::GateUp, 4, llama_up, DType::BF16, false);
  p.w_up.double_quant = true;
  EXPECT_EQ(plan_nf4(p, h100()).kernel, Nf4Kernel::SmallMTable);
  // gate_up's fused path needs both weights to fit: a misaligned up weight leaves dequantize + GEMM.
  p = problem(Nf4Op::GateUp, 64, llama_up, DType::BF16, false);
  EXPECT_EQ(plan_nf4(p, h100()).kernel, Nf4Kernel::FusedInLoop);
  p.w_up.codes_align = 8;
  EXPECT_EQ(plan_nf4(p, h100()).kernel, Nf4Kernel::DequantGemm);
  // Blocks of 128: the small-M table and fused kernels run, the pair kernel (blocks of 64) does not.
  p = problem(Nf4Op::Forward, 4, llama_up, DType::BF16, false);
  p.w.block_size = p.w_up.block_size = 128;
  EXPECT_EQ(plan_nf4(p, h100()).kernel, Nf4Kernel::SmallMTable);
}

TEST(Nf4Plan, SummaryNamesKernelTilesAndWhy) {
  const Nf4Plan p = plan_nf4(problem(Nf4Op::Forward, 64, kShapes[3], DType::BF16, true), h100());
  EXPECT_EQ(nf4_plan_summary(p),
            "fused in-loop, 32x1 tiles, split-K 4: tens to hundreds of rows on a large weight: fused beats "
            "dequantize + GEMM");
}

}  // namespace
}  // namespace qmm::cuda
