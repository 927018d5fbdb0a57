// The ops. Every entry point validates its arguments before touching any output, throws qmm::Error naming the op
// and the argument, and runs on the context's device (all tensors must live there).
// Calls on a CUDA context are asynchronous with respect to the host (ordered on the context's stream).
#pragma once

#include <span>

#include "qmm/context.h"
#include "qmm/nf4.h"
#include "qmm/tensor.h"

namespace qmm {

// How f32-storage GEMMs multiply. bf16-storage GEMMs always use bf16 operands with fp32 accumulation
// and accept any mode.
enum class MathMode {
  FP32,  // strict IEEE fp32 products and sums
  TF32,  // operands rounded to tf32 (10-bit mantissa, round to nearest), fp32 accumulation
  BF16,  // operands truncated to bf16 (low 16 bits cleared), fp32 accumulation:
         // C[i,j] = sum_k trunc(A[i,k]) * trunc(B[k,j])
};
const char* math_mode_name(MathMode mode);

// out = alpha * product + beta * out. beta = 0 overwrites (out's old contents are never read, NaN included).
// With an addend, out = alpha * product + beta * addend: a tensor of out's shape and dtype read in place of out's
// old contents (a residual stream added in the GEMM's epilogue instead of a pass of its own); it may be out itself
// but no other memory that out overlaps.
struct GemmOptions {
  float alpha = 1.0f;
  float beta = 0.0f;
  MathMode math = MathMode::FP32;
  TensorView addend{};  // empty: out
};

// Dense GEMM family. A and B share one dtype (f32 or bf16); the output is that dtype or f32.
// C[M,N] = A[M,K] * B[K,N]
void gemm(const Context& ctx, const TensorView& a, const TensorView& b, const TensorView& c,
          const GemmOptions& opts = {});
// C[M,N] = A[M,K] * B^T, B given as [N,K] (a linear layer's weight)
void gemm_bt(const Context& ctx, const TensorView& a, const TensorView& b, const TensorView& c,
             const GemmOptions& opts = {});
// dA[M,K] = dC[M,N] * B^T for B [K,N] (the input gradient of gemm); beta = 1 accumulates into dA.
void gemm_backward_a(const Context& ctx, const TensorView& dc, const TensorView& b, const TensorView& da,
                     const GemmOptions& opts = {});
// dB[K,N] = A^T * dC for A [M,K], dC [M,N] (the weight gradient of gemm); beta = 1 accumulates into dB.
void gemm_backward_b(const Context& ctx, const TensorView& a, const TensorView& dc, const TensorView& db,
                     const GemmOptions& opts = {});
// LoRA's two backward products that read the output gradient dy [M,N], for an adapter B [N,r] and the saved
// t = x·Aᵀ [M,r]:  dt [M,r] = scale·dy·B (overwritten)  and  grad_b [N,r] = scale·dyᵀ·t + beta·grad_b (beta = 1
// accumulates; beta = 0 overwrites without reading grad_b, which saves zeroing it first).
// dy, b, t and dt share one dtype (f32 or bf16); grad_b is f32. The result is that of gemm(dy, b, dt, {scale, 0,
// math}) followed by gemm_backward_b(dy, t, grad_b, {scale, beta, math}); on a CUDA context with bf16 operands,
// r in {8, 16, 32}, N a multiple of 8 and 16-byte aligned dy, b and t, one kernel computes both in one read of
// dy (fp32 accumulation, deterministic), otherwise the two GEMMs run. dt and grad_b must not overlap the inputs.
void lora_backward_dy(const Context& ctx, const TensorView& dy, const TensorView& b, const TensorView& t,
                      const TensorView& dt, const TensorView& grad_b, float scale,
                      MathMode math = MathMode::FP32, float beta = 1.0f);
// LoRA adapters of one input x [M,K], their first products stacked: t = x·aᵀ [M,R] for a [R,K], the adapters'
// A matrices one above another in the order of `terms` (R = Σ r_i), t_i projection i's r_i columns of t. Then
//   y_i += scale_i·t_i·b_iᵀ   for b_i [N_i, r_i]
// (the LoRA term added onto a base product already in y_i). x, a, t, b_i and y_i share one dtype (f32 or bf16),
// fp32 sums. One GEMM for t on any number of adapters: an attention's q, k and v, an MLP's gate and up.
struct LoraTerm {
  TensorView y;        // [M, N_i], accumulated onto
  TensorView b;        // [N_i, r_i]
  float scale = 1.0f;  // alpha / r
};
void lora_adapters(const Context& ctx, const TensorView& x, std::span<const LoraTerm> terms, const TensorView& a,
                   const TensorView& t);
// The gradients of lora_adapters for its outputs' gradients dy_i, with its x, a and t:
//   dt [M,R]: dt_i = scale_i·dy_i·b_i;  grad_b_i [N_i,r_i] f32 = scale_i·dy_iᵀ·t_i;  grad_a [R,K] f32 = dtᵀ·x
//   (may be empty);  dx [M,K] = dt·a + dx_beta·dx (may be empty).
// dt, grad_b_i and grad_a are written; each dt_i and grad_b_i come from one read of dy_i (lora_backward_dy), grad_a
// and dx from one GEMM each over every adapter.
struct LoraTermGrad {
  TensorView dy;  // [M, N_i]
  TensorView b;   // [N_i, r_i]
  float scale = 1.0f;
  TensorView grad_b;  // f32 [N_i, r_i]
};
void lora_adapters_backward(const Context& ctx, const TensorView& x, std::span<const LoraTermGrad> terms,
                            const TensorView& a, const TensorView& t, const TensorView& dt, const TensorView& grad_a,
                            const TensorView& dx, float dx_beta = 0.0f);
// Batched 4-D GEMM over [batch, heads]: C[b,h] = A[b,h] * op(B[b,h]).
// A [b,h,m,k]; B [b,h,k,n], or [b,h,n,k] with transpose_b (attention's Q*K^T); C [b,h,m,n].
void batched_gemm(const Context& ctx, const TensorView& a, const TensorView& b, const TensorView& c,
                  bool transpose_b = false, const GemmOptions& opts = {});

// Adapters' terms added to SwiGLU's operands inside its kernel, never stored (an MLP's gate and up projections with
// their LoRA second products left out of the GEMMs):
//   gate' = gate + gate_scale·t_g·b_gateᵀ,   up' = up + up_scale·t_u·b_upᵀ
// t [M, R] holds t_g in its first r_g columns and t_u in the next r_u, as lora_adapters stacks them (R ≥ r_g +
// r_u), or t_u comes apart in t_up [M, R_u] (R_u ≥ r_u; then t needs only gate's r_g columns), as two layers that
// keep their own t have it; b_gate [N, r_g] and b_up [N, r_u], an empty one for no term. The backward may also
// take the down projection's adapter share of its input gradient: dh' = dh + dh_t·dh_a (dh_t [M, r_d] that
// adapter's dt, dh_a [r_d, N] its A), both empty for none. Every term shares gate's dtype and sums in fp32 (on a
// CUDA context bf16 with ranks ≤ kSwiGluAdaptersMmaRank on the tensor cores, anything else one element a thread).
inline constexpr int kSwiGluAdaptersMmaRank = 32;  // the largest rank of a term the tensor-core path takes
struct SwiGluAdapters {
  TensorView t;
  TensorView b_gate;
  float gate_scale = 1.0f;
  TensorView b_up;
  float up_scale = 1.0f;
  TensorView dh_t;  // backward only
  TensorView dh_a;
  TensorView t_up;  // up's t where it is not stacked in t (empty: it is)
  bool empty() const { return b_gate.empty() && b_up.empty() && dh_t.empty() && dh_a.empty(); }
};
// SwiGLU: h = silu(gate) * up, silu(x) = x / (1 + exp(-x)). Same shape and dtype (f32 or bf16) for all;
// h may be the same memory as gate or up (in place). With adapters, gate and up are [M, N] and stand for gate' and
// up' above.
void swiglu(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& h,
            const SwiGluAdapters& adapters = {});
// Backward: dgate = dh * up * silu'(gate), dup = dh * silu(gate) (at gate', up' and dh' with adapters: the
// gradients of gate' and up', which are also those of gate and up). dgate may alias gate and dup may alias up.
// A non-empty h (gate then [M, N]) receives the forward's h again (for a caller that did not keep it: the down
// projection's adapter gradient needs it), computed on the way.
void swiglu_backward(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
                     const TensorView& dgate, const TensorView& dup, const SwiGluAdapters& adapters = {},
                     const TensorView& h = {});

// NF4 quantize W [N,K] (f32, bf16 or f16) into `out`, whose buffers are sized for W's shape
// (Nf4Tensor::allocate does that); out.absmax is u8 to ask for double quantization, f32 otherwise.
// Byte-identical to bitsandbytes' quantize_4bit(quant_type="nf4").
void nf4_quantize(const Context& ctx, const TensorView& w, Nf4Weight& out);
// Convenience: allocates on the context's device and quantizes.
Nf4Tensor nf4_quantize(const Context& ctx, const TensorView& w, bool double_quant,
                       int block_size = kNf4DefaultBlockSize);
// out [N,K] (f32 or bf16) = codebook[code] * scale, computed in fp32, rounded to nearest even for bf16.
void nf4_dequantize(const Context& ctx, const Nf4Weight& w, const TensorView& out);

// How an NF4 GEMM runs, by intent: Auto (the planner chooses by problem and device), DequantGemm (dequantize the
// weight into scratch, then cuBLASLt: any shape, a bf16 copy of W in scratch), Fused (the tensor-core GEMM that
// dequantizes inside its main loop, no copy of W: sm_90a builds on Hopper, K and block size multiples of 64, N a
// multiple of 8 for the input gradient). A CPU context runs its reference loops for Auto and refuses the others.
// Every path follows the one numerical contract below. A path that cannot serve the problem throws Unsupported,
// naming what it needs.
enum class Nf4Path { Auto, DequantGemm, Fused };
const char* nf4_path_name(Nf4Path path);

struct Nf4GemmOptions {
  float alpha = 1.0f;
  float beta = 0.0f;
  Nf4Path path = Nf4Path::Auto;
};

// One numerical contract for every NF4 GEMM and path: C = sum_k bf16(A[m,k]) * w[n,k], summed in fp32 (the order
// depends on the kernel), where w is the weight's value code * scale held to within 2^-9 relative (half a bf16
// ulp): bf16(code * scale) where the weight is dequantized before the product, bf16(code) * scale where a kernel
// applies each block's scale to its fp32 partial sum (the small-M forward does at M <= 16 on sm_90). A and C are
// f32 or bf16, independently. So every path is within 2^-8 * sum_k |bf16(A)| |w| of the fp64 product of bf16(A) and
// the dequantized weight, plus the output's own rounding for bf16 C: the bound the package's tests hold every path
// to (the C++ GPU tests hold each kernel to its own rounding, tighter).
// C[M,N] = A[M,K] * dequant(W)^T, W [N,K]
void nf4_gemm(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
              const Nf4GemmOptions& opts = {});
// dA[M,K] = dC[M,N] * dequant(W), W [N,K]; beta = 1 accumulates.
void nf4_gemm_backward_a(const Context& ctx, const TensorView& dc, const Nf4Weight& w, const TensorView& da,
                         const Nf4GemmOptions& opts = {});

// Both MLP input projections from one input: gate = A*dequant(Wg)^T, up = A*dequant(Wu)^T, and optionally
// h = silu(gate)*up. Any of the three outputs may be left empty (a default TensorView) when not needed,
// but at least one must be given. Outputs are [M,N], f32 or bf16. opts.alpha scales gate and up (before the
// SwiGLU). opts.beta = 0 overwrites; otherwise gate and up accumulate (gate = alpha*A*dequant(Wg)^T + beta*gate)
// and h must be empty.
struct GateUpOutputs {
  TensorView gate;
  TensorView up;
  TensorView h;
};
void nf4_gate_up(const Context& ctx, const TensorView& a, const Nf4Weight& w_gate, const Nf4Weight& w_up,
                 const GateUpOutputs& out, const Nf4GemmOptions& opts = {});

// Several LoRA projections of one input x [M,K] on NF4 bases (an attention's q, k and v), their adapters stacked
// as lora_adapters stacks them (a [R,K] and t [M,R] over the projections that have one, in order):
//   y_i = x·dequant(W_i)ᵀ + beta_i·y_i + bias_i + scale_i·t_i·b_iᵀ
// x, y_i, bias_i, a, b_i and t share x's dtype (f32 or bf16); every product accumulates in fp32 (opts.path picks the
// NF4 path as for nf4_gemm; opts.alpha and opts.beta must be 1 and 0). On a GPU one dequantize launch serves every
// base product that dequantizes, whose GEMM adds the bias before it rounds (a linear layer's bias epilogue), and
// one GEMM every adapter's first product (lora_adapters). A projection without an adapter has an empty b, one
// without a bias an empty bias; a and t are empty where none has an adapter.
struct Nf4Projection {
  Nf4Weight w;         // [N_i, K]
  TensorView y;        // [M, N_i], written (or accumulated onto, beta 1)
  float beta = 0.0f;   // 0 or 1
  TensorView b;        // the adapter's B [N_i, r_i] in x's dtype, or empty
  float scale = 1.0f;  // the adapter's scale (alpha / r)
  TensorView bias;     // [N_i] in x's dtype, added to every row of y, or empty
};
void lora_nf4_linears(const Context& ctx, const TensorView& x, std::span<const Nf4Projection> ps, const TensorView& a,
                      const TensorView& t, const Nf4GemmOptions& opts = {});

// The gradients of lora_nf4_linears for the gradients dy_i of its outputs, with its x, a and t:
//   dt [M,R]: dt_i = scale_i·dy_i·b_i (written);  grad_b_i [N_i,r_i] f32 = scale_i·dy_iᵀ·t_i (written);
//   grad_a [R,K] f32 = dtᵀ·x (written; may be empty);  dx [M,K] = Σ dy_i·dequant(W_i) + dt·a + dx_beta·dx (may be
//   empty: no input gradient).
// An empty dy_i (its output had no gradient) adds nothing; a projection with an adapter needs its dy. On a GPU one
// dequantize launch serves every input-gradient product that dequantizes, one GEMM grad_a and one the adapters'
// share of dx; each adapter's dt_i and grad_b_i come from one read of dy_i (lora_backward_dy).
struct Nf4ProjectionGrad {
  Nf4Weight w;    // [N_i, K]
  TensorView dy;  // [M, N_i] in x's dtype, or empty
  TensorView b;   // as in the forward
  float scale = 1.0f;
  TensorView grad_b;  // f32 [N_i, r_i], written (empty without an adapter)
};
void lora_nf4_linears_backward(const Context& ctx, const TensorView& x, std::span<const Nf4ProjectionGrad> ps,
                               const TensorView& a, const TensorView& t, const TensorView& dt, const TensorView& grad_a,
                               const TensorView& dx, float dx_beta = 0.0f, const Nf4GemmOptions& opts = {});

}  // namespace qmm
