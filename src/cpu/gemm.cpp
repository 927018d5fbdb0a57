// The CPU reference GEMM: every variant through one GemmProblem.
// Operands are rounded per the math-mode contract, widened to double and summed in fp64 in index order (p = 0,
// 1, ..., k-1), so the result does not depend on tiling or thread count. The loops are blocked (tiles of C per
// thread, operands packed into small double panels) so that realistic LLM shapes stay quick enough for tests.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/cpu_backend.h"
#include "qmm/tensor.h"

namespace qmm::cpu {
namespace {

// Micro-tile of C kept in registers, and the tile of C (kMc x kNc) that one thread owns at a time; kKc is the
// depth of one packed panel. Panels: A kMc*kKc and B kNc*kKc doubles (128 KiB + 256 KiB), within L2.
constexpr std::int64_t kMr = 4;
constexpr std::int64_t kNr = 8;
constexpr std::int64_t kMc = 64;
constexpr std::int64_t kNc = 128;
constexpr std::int64_t kKc = 256;
static_assert(kMc % kMr == 0 && kNc % kNr == 0);

// One operand's element, rounded as the contract says. bf16 storage is exact already; f32 storage is rounded
// per math mode (TF32: nearest at a 10-bit mantissa; BF16: low 16 bits cleared).
struct OperandReader {
  const void* base;
  DType dtype;
  MathMode math;

  double operator()(std::int64_t idx) const {
    if (dtype == DType::BF16) return bf16_to_float(static_cast<const std::uint16_t*>(base)[idx]);
    const float x = static_cast<const float*>(base)[idx];
    switch (math) {
      case MathMode::FP32: return x;
      case MathMode::TF32: return round_to_tf32(x);
      case MathMode::BF16: return bf16_to_float(float_to_bf16_trunc(x));
    }
    return x;
  }
};

// acc[kMr x kNr] (row stride ldc) += a_panel * b_panel over kc steps; a_panel is [kc][kMr], b_panel [kc][kNr].
// Each accumulator sums in index order; vectorising across the kNr columns keeps that order.
inline void micro_kernel(std::int64_t kc, const double* __restrict a, const double* __restrict b,
                         double* __restrict acc, std::int64_t ldc) {
  double r[kMr][kNr];
  for (std::int64_t i = 0; i < kMr; ++i)
    for (std::int64_t j = 0; j < kNr; ++j) r[i][j] = acc[i * ldc + j];
  for (std::int64_t p = 0; p < kc; ++p) {
    const double* ap = a + p * kMr;
    const double* bp = b + p * kNr;
    for (std::int64_t i = 0; i < kMr; ++i)
      for (std::int64_t j = 0; j < kNr; ++j) r[i][j] += ap[i] * bp[j];
  }
  for (std::int64_t i = 0; i < kMr; ++i)
    for (std::int64_t j = 0; j < kNr; ++j) acc[i * ldc + j] = r[i][j];
}

// Per-thread panels, sized for the problem so that small calls do not allocate the full tiles.
struct Buffers {
  std::vector<double> a_pack, b_pack, acc;
  explicit Buffers(const GemmProblem& p) {
    const std::int64_t mc = std::min(kMc, (p.m + kMr - 1) / kMr * kMr);
    const std::int64_t nc = std::min(kNc, (p.n + kNr - 1) / kNr * kNr);
    const std::int64_t kc = std::max<std::int64_t>(1, std::min(kKc, p.k));
    a_pack.resize(static_cast<std::size_t>(mc * kc));
    b_pack.resize(static_cast<std::size_t>(nc * kc));
    acc.resize(static_cast<std::size_t>(mc * kNc));  // rows of stride kNc, as compute_tile indexes them
  }
};

// Computes the C tile rows [i0, i0+mc), cols [j0, j0+nc) of batch entry `bi`.
void compute_tile(const GemmProblem& p, std::int64_t bi, std::int64_t i0, std::int64_t mc, std::int64_t j0,
                  std::int64_t nc, Buffers& buf) {
  const OperandReader ra{p.a, p.ab_dtype, p.math};
  const OperandReader rb{p.b, p.ab_dtype, p.math};
  const std::int64_t a_off = bi * p.stride_a, b_off = bi * p.stride_b;
  const std::int64_t lda = p.lda(), ldb = p.ldb();
  const std::int64_t mc_pad = (mc + kMr - 1) / kMr * kMr, nc_pad = (nc + kNr - 1) / kNr * kNr;
  double* acc = buf.acc.data();  // [mc_pad][kNc]
  std::fill(acc, acc + mc_pad * kNc, 0.0);

  for (std::int64_t p0 = 0; p0 < p.k; p0 += kKc) {
    const std::int64_t kc = std::min(kKc, p.k - p0);
    // Pack op(A) rows into [panel][kc][kMr], zero rows past mc (their results are never stored).
    for (std::int64_t ip = 0; ip < mc_pad; ip += kMr) {
      double* dst = buf.a_pack.data() + ip * kc;
      for (std::int64_t r = 0; r < kMr; ++r) {
        const std::int64_t i = i0 + ip + r;
        const bool valid = ip + r < mc;
        for (std::int64_t q = 0; q < kc; ++q) {
          const std::int64_t pk = p0 + q;
          dst[q * kMr + r] = valid ? ra(a_off + (p.trans_a ? pk * lda + i : i * lda + pk)) : 0.0;
        }
      }
    }
    // Pack op(B) columns into [panel][kc][kNr], zero columns past nc.
    for (std::int64_t jp = 0; jp < nc_pad; jp += kNr) {
      double* dst = buf.b_pack.data() + jp * kc;
      for (std::int64_t q = 0; q < kc; ++q) {
        const std::int64_t pk = p0 + q;
        for (std::int64_t c = 0; c < kNr; ++c) {
          const std::int64_t j = j0 + jp + c;
          const bool valid = jp + c < nc;
          dst[q * kNr + c] = valid ? rb(b_off + (p.trans_b ? j * ldb + pk : pk * ldb + j)) : 0.0;
        }
      }
    }
    for (std::int64_t ip = 0; ip < mc_pad; ip += kMr)
      for (std::int64_t jp = 0; jp < nc_pad; jp += kNr)
        micro_kernel(kc, buf.a_pack.data() + ip * kc, buf.b_pack.data() + jp * kc, acc + ip * kNc + jp, kNc);
  }

  // C = alpha * sum + beta * C_old (+ bias), rounded once to C's dtype; C_old is the addend where one is given.
  // beta == 0 never reads it (NaN there is overwritten).
  const double alpha = p.alpha, beta = p.beta;
  const std::int64_t c_off = bi * p.stride_c, ldc = p.ldc();
  const void* c_old = p.c_in ? p.c_in : p.c;
  for (std::int64_t i = 0; i < mc; ++i) {
    for (std::int64_t j = 0; j < nc; ++j) {
      const std::int64_t idx = c_off + (i0 + i) * ldc + (j0 + j);
      // K == 0: the product is empty, so C = beta * C exactly (no alpha * 0 term to flip a zero's sign).
      double v = p.k == 0 ? 0.0 : alpha * acc[i * kNc + j];
      if (p.c_dtype == DType::F32) {
        float* c = static_cast<float*>(p.c);
        const float* old = static_cast<const float*>(c_old);
        if (beta != 0.0) v = p.k == 0 ? beta * old[idx] : v + beta * old[idx];
        if (p.bias) v += static_cast<const float*>(p.bias)[j0 + j];
        c[idx] = static_cast<float>(v);
      } else {
        std::uint16_t* c = static_cast<std::uint16_t*>(p.c);
        const std::uint16_t* old = static_cast<const std::uint16_t*>(c_old);
        if (beta != 0.0) v = p.k == 0 ? beta * bf16_to_float(old[idx]) : v + beta * bf16_to_float(old[idx]);
        if (p.bias) v += bf16_to_float(static_cast<const std::uint16_t*>(p.bias)[j0 + j]);
        c[idx] = float_to_bf16(static_cast<float>(v));
      }
    }
  }
}

}  // namespace

void gemm(const GemmProblem& p) {
  if (p.batch <= 0 || p.m <= 0 || p.n <= 0) return;
  const std::int64_t tiles_m = (p.m + kMc - 1) / kMc, tiles_n = (p.n + kNc - 1) / kNc;
  const std::int64_t tiles = p.batch * tiles_m * tiles_n;
  // Threads only pay off beyond a few hundred thousand multiply-adds.
  const bool parallel = tiles > 1 && p.batch * p.m * p.n * std::max<std::int64_t>(p.k, 1) > (1 << 18);
#pragma omp parallel if (parallel)
  {
    Buffers buf(p);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t t = 0; t < tiles; ++t) {
      const std::int64_t bi = t / (tiles_m * tiles_n);
      const std::int64_t rest = t % (tiles_m * tiles_n);
      const std::int64_t i0 = (rest / tiles_n) * kMc, j0 = (rest % tiles_n) * kNc;
      compute_tile(p, bi, i0, std::min(kMc, p.m - i0), j0, std::min(kNc, p.n - j0), buf);
    }
  }
}

}  // namespace qmm::cpu
