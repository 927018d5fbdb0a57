// Element-wise and optimizer ops that LoRA layers and trainers need besides the GEMMs. Same rules as ops.h:
// every entry point validates its arguments before touching any output, throws qmm::Error naming the op and the
// argument, and runs on the context's device (asynchronously on a CUDA context's stream). Each has a CPU
// reference (the oracle of the tests) and a CUDA kernel.
#pragma once

#include <cstdint>
#include <span>

#include "qmm/context.h"
#include "qmm/tensor.h"

namespace qmm {

// dst = src converted element by element (f32 <-> bf16 or same dtype; to bf16 rounds to nearest even).
// Same element count; shapes may differ (a flat copy).
void cast(const Context& ctx, const TensorView& src, const TensorView& dst);
// dst[i] = src[i] converted for every i, each pair as above; on a GPU every f32 -> bf16 pair goes in one launch
// (up to 64 per launch), so a LoRA layer's adapter copies cost one launch, not one per matrix. No dst may overlap
// another pair's src or dst.
void cast(const Context& ctx, std::span<const TensorView> src, std::span<const TensorView> dst);

// out = a + alpha * b, all the same shape and dtype (f32 or bf16); out may be a or b (in place).
void add(const Context& ctx, const TensorView& a, const TensorView& b, const TensorView& out, float alpha = 1.0f);

// y[M,N] += bias[N] broadcast over rows; y f32 or bf16, bias f32 or y's dtype.
void add_bias(const Context& ctx, const TensorView& y, const TensorView& bias);

// Inverted dropout: out[i] = keep(seed, i) ? x[i] / (1 - p) : 0, with keep(seed, i) a counter-based hash of
// (seed, flat index i) that is the same on every device and every call (so backward re-applies the same mask by
// calling this again with the same seed on the gradient). 0 <= p < 1; p = 0 copies. out may be x (in place).
void dropout(const Context& ctx, const TensorView& x, const TensorView& out, float p, std::uint64_t seed);
// Whether element i is kept: the mask dropout() uses (host function, for tests and oracles).
bool dropout_keep(std::uint64_t seed, std::int64_t index, float p);

// Mean squared error: loss = mean((y - target)^2) written to `loss` (f32, one element, on the context's device);
// dy = scale * 2 * (y - target) / numel (dy may alias y; dy has y's dtype). y, target f32 or bf16, same shape.
void mse_loss(const Context& ctx, const TensorView& y, const TensorView& target, const TensorView& loss,
              const TensorView& dy, float scale = 1.0f);

// A causal LM's head and loss in one: the mean cross-entropy of the logits z = h·Wᵀ against labels, without
// the [T, V] logits ever held whole (they go through in chunks of tokens and of the vocabulary:
// linear_cross_entropy_chunks).
//   loss[0] = Σ_{t: labels[t] != ignore_index} (logsumexp(z_t) − z_t[labels[t]]) / n,  n = the count of such t
// h [T,H] f32 or bf16; w [V,H] of h's dtype (a separate head or the tied embedding); labels [T] i32, each in
// [0, V) or ignore_index; loss [1] f32, written. With all tokens ignored (n = 0) the loss is 0 and the gradients
// are 0. The products multiply bf16 (or f32) operands with fp32 sums and the logits are rounded to h's dtype (as a
// bf16 model's head writes them); the log-sum-exp is fp32 (fp64 on the CPU backend). Gradients of the mean loss:
// dh [T,H] of h's dtype, written, where given (empty: none); dw [V,H] f32, where given: accumulated
// (dw += ∂loss/∂W), or with opts.accumulate_dw false written without its old contents being read (a fresh buffer
// needs no zeroing). On a GPU the products that make the gradients take their left operand rounded to h's dtype:
// the gradient rows (softmax − onehot) / n where the vocabulary is whole, or exp(z − running maximum) without the
// label's term where it is split (the label's term and the normalization then join in fp32).
// Labels out of range: with opts.check_labels (the default) the labels are read on the host first (a GPU's are
// copied: the call waits for the device) and the first one out of range is InvalidArgument, nothing written;
// without, nothing waits (a CUDA graph can capture the call) and a label out of range makes the loss NaN and its
// token's dh row NaN (and dw where given). h and w are not scanned for non-finite values (a pass over h would cost
// what the loss does): a NaN or Inf in a token's hidden state makes the loss non-finite (NaN, or +Inf) and that
// token's dh row NaN (dw where given); the other tokens' dh rows stay finite.
struct CrossEntropyOptions {
  std::int32_t ignore_index = -100;
  std::int64_t chunk_tokens = 0;  // rows of h per chunk (0: linear_cross_entropy_chunks chooses)
  bool check_labels = true;
  bool accumulate_dw = true;
  std::int64_t chunk_vocab = 0;  // columns of the logits per chunk (0: chosen; >= V: the vocabulary is not split)
};
void linear_cross_entropy(const Context& ctx, const TensorView& h, const TensorView& w, const TensorView& labels,
                          const TensorView& loss, const TensorView& dh = {}, const TensorView& dw = {},
                          const CrossEntropyOptions& opts = {});
// How linear_cross_entropy's GPU path splits T tokens, hidden size H and vocabulary V (h's dtype), and the device
// memory it takes beyond its inputs and outputs. Without dw the chunks fit in 5% of the fp32 logits' bytes (at
// least 32 MiB): whole rows where min(T, 1024) tokens' rows fit; otherwise a chunk of tokens whose f32
// accumulator for dh [tokens, H] takes a quarter of that, and vocabulary chunks of the rest, over which each row
// keeps a running maximum and sum (the log-sum-exp comes out at the end) and dh accumulates exp(z − maximum)·W,
// rescaled when the maximum grows. With dw the vocabulary stays whole (dw's rows need the row's final log-sum-exp),
// and a chunk holds as many tokens as 1 GiB of logits does (each chunk reads and writes the f32 dw once, which
// costs more than rereading the head). opts.chunk_tokens and opts.chunk_vocab, where positive, override the
// choice (chunk_vocab >= V: whole rows).
struct CrossEntropyChunks {
  std::int64_t tokens = 0;       // rows of h per chunk
  std::int64_t vocab = 0;        // logits' columns per chunk; V where the vocabulary is not split
  std::int64_t extra_bytes = 0;  // device scratch: a chunk's logits in h's dtype, the loss terms, the running state
};
CrossEntropyChunks linear_cross_entropy_chunks(std::int64_t tokens, std::int64_t hidden, std::int64_t vocab,
                                               DType dtype, bool with_dh, bool with_dw,
                                               const CrossEntropyOptions& opts = {});

// RMSNorm over the last dimension, as Hugging Face's LlamaRMSNorm and Qwen2RMSNorm compute it: per row
// rstd = 1 / sqrt(mean(x²) + eps) in fp32, then y = w · x̂ with x̂ = x · rstd rounded to x's dtype first (the
// product rounded again). x, y [T, H] f32 or bf16 (y may be x); w [H] of x's dtype; rstd [T] f32, written for the
// backward where given (empty: not kept). eps finite and >= 0.
void rms_norm(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& y,
              const TensorView& rstd, float eps);
// A decoder layer's residual add and the RMSNorm after it in one pass: h = x + r rounded to x's dtype (as a bf16
// tensor add rounds it), then y = rms_norm(h, w) as above, rstd from h. x, r, h, y [T, H] of one dtype (f32 or bf16);
// h and y are each x, r or disjoint from every argument, and not each other; w and rstd as for rms_norm.
void add_rms_norm(const Context& ctx, const TensorView& x, const TensorView& r, const TensorView& w,
                  const TensorView& h, const TensorView& y, const TensorView& rstd, float eps);
// Its backward from the forward's rstd: dx = rstd · (g − x̂ · mean(g · x̂)) with g = dy · w and x̂ = x · rstd (fp32),
// written in x's dtype (dx may be dy); dw [H] f32 accumulated, dw += Σ_t dy · x̂, summed over the rows in a fixed
// order (the same bits for any thread count or GPU); dx or dw may be empty (not wanted). dres, where given (x's shape
// and dtype; dx may be it), is a gradient that reaches x by another path, the residual stream around the norm: it is
// added to dx in fp32 before dx's one rounding, so that the two gradients' sum takes no launch of its own. (For
// add_rms_norm, x is its h, and dx is the gradient of both its x and its r.)
void rms_norm_backward(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& rstd,
                       const TensorView& dy, const TensorView& dx, const TensorView& dw, const TensorView& dres = {});

// Rotary position embedding on q and k, the half-split rotation of Hugging Face's apply_rotary_pos_emb (Llama,
// Qwen2, Mistral): with x = [x1, x2] (the halves of the head dimension D) and cos = [c1, c2], sin = [s1, s2]
//   forward:  y1 = x1·c1 − x2·s1,  y2 = x2·c2 + x1·s2
//   inverse:  y1 = x1·c1 + x2·s2,  y2 = x2·c2 − x1·s1   (the transpose: the forward's backward, on the gradients)
// computed in fp32 (fp64 on the CPU backend) from the stored values and rounded once to x's dtype. (Hugging Face's
// module rounds each product and the sum to x's dtype: three roundings, so bf16 results may differ from its by an
// ulp or so.) q [B, S, Hq, D] and k [B, S, Hk, D] (the projections' output viewed per head, before Hugging Face's
// transpose), f32 or bf16, one dtype, D even and >= 2; k may be absent (with k_out: default views). cos, sin
// [Bc, S, D] with Bc 1 (broadcast over the batch) or B, both x's dtype or both f32. q_out, k_out of q's and k's
// shape and dtype, each either its input (in place) or disjoint from every other argument. One launch covers q and
// k on a GPU.
void rope(const Context& ctx, const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
          const TensorView& q_out, const TensorView& k_out, bool inverse = false);

// One tensor the optimizer updates: parameter, its gradient and the two moment buffers, all f32, one shape.
struct AdamWParam {
  TensorView param;
  TensorView grad;
  TensorView m;
  TensorView v;
};

struct AdamWOptions {
  float lr = 1e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: param -= lr * weight_decay * param
  float max_grad_norm = 0.0f; // > 0: gradients are scaled by min(1, max_grad_norm / (norm + 1e-6)) first
};

// The global L2 norm of all gradients, sqrt(sum over every tensor of g^2), into `norm` (f32, one element, on the
// context's device). Deterministic (fixed reduction order).
void grad_norm(const Context& ctx, std::span<const TensorView> grads, const TensorView& norm);

// One AdamW step over every tensor in `params` (on a CUDA context: one norm reduction when clipping, then one
// fused launch over all tensors). `step` counts from 1 (bias correction 1 - beta^step). When `norm` is given it
// receives the gradient norm before clipping (computed whenever max_grad_norm > 0 or norm is given). Gradients
// are left unchanged; the caller zeroes them.
void adamw_step(const Context& ctx, std::span<const AdamWParam> params, const AdamWOptions& opts, int step,
                const TensorView& norm = {});

// Sets every element of t to zero (any dtype).
void zero(const Context& ctx, const TensorView& t);

}  // namespace qmm
