// Layers for LoRA/QLoRA fine-tuning, written only in terms of the public ops (ops.h, train_ops.h), so the same
// code runs on a CPU context (the fp64 reference backend) and on a CUDA context.
//
//  LoraLinear   y = x·W0ᵀ + s·(dropout(x)·Aᵀ)·Bᵀ (+ bias), s = alpha/rank. W0 [N,K] frozen (dense or NF4);
//               A [r,K] and B [N,r] trainable.
//  SwiGluMlp    y = down(silu(gate(x)) · up(x)) with three LoraLinears.
//  AdamW        one optimizer step over the adapters of any number of layers.
//
// Ownership: a layer owns its adapters (fp32 masters, fp32 gradients, AdamW moments, bf16 working copies), the
// activations it saves from forward to backward, and (through a shared Scratch) its transient buffers, all on the
// context's device. The frozen base weight and bias are views: their memory belongs to the caller and must outlive
// the layer. The caller also keeps a layer's input x alive from forward to backward and passes it again to
// backward (the layer does not copy it).
//
// Calls on a CUDA context are asynchronous: forward and backward enqueue work on the context's stream and never
// wait for the device. The only allocations happen when a buffer must grow (the first call at a larger row count;
// reserve() does them up front), and a device allocation or free may synchronize the device.
// A layer is not thread-safe: one forward/backward at a time.
//
// Errors: every public entry point validates its arguments first and throws qmm::Error naming the layer, the
// method and the argument ("LoraLinear::forward: x is ...").
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "qmm/context.h"
#include "qmm/dist.h"
#include "qmm/nf4.h"
#include "qmm/ops.h"
#include "qmm/tensor.h"
#include "qmm/train_ops.h"

namespace qmm {

// The frozen base weight W0 [N,K] (out_features, in_features) of a linear layer: dense (f32 or bf16, the layer's
// activation dtype) or NF4. A non-owning view; temporaries are refused so a view cannot outlive its tensor.
class BaseWeight {
 public:
  BaseWeight() = default;
  BaseWeight(const TensorView& w) : dense_(w) {}                          // NOLINT: implicit on purpose
  BaseWeight(const Tensor& w) : dense_(w.view()) {}                       // NOLINT
  BaseWeight(const Nf4Weight& w) : nf4_(w), is_nf4_(true) {}              // NOLINT
  BaseWeight(const Nf4Tensor& w) : nf4_(w.view()), is_nf4_(true) {}      // NOLINT
  BaseWeight(Tensor&&) = delete;
  BaseWeight(Nf4Tensor&&) = delete;

  bool is_nf4() const { return is_nf4_; }
  bool empty() const { return is_nf4_ ? nf4_.codes.empty() : dense_.empty(); }
  const TensorView& dense() const { return dense_; }
  const Nf4Weight& nf4() const { return nf4_; }
  std::int64_t out_features() const { return is_nf4_ ? nf4_.rows : dense_.dim(0); }
  std::int64_t in_features() const { return is_nf4_ ? nf4_.cols : dense_.dim(1); }
  Device device() const { return is_nf4_ ? nf4_.device() : dense_.device(); }
  // Bytes as stored (NF4: codes + scales + the double-quantization tables).
  std::size_t nbytes() const;

 private:
  TensorView dense_;
  Nf4Weight nf4_;
  bool is_nf4_ = false;
};

// Transient buffers of layer calls (a dropped-out input, intermediate gradients, recomputed activations): nothing in
// them lives from a forward to its backward. Layers that run one after another on one stream may share one Scratch
// (set_scratch), so a model holds one set of transient buffers instead of one per layer; the layers size it as they
// need. Not for concurrent use from several threads.
class Scratch {
 public:
  std::size_t bytes() const;  // device memory held

 private:
  friend class LoraLinear;
  friend class SwiGluMlp;
  // One slot per kind of buffer, so that a layer calling another (the MLP calling its projections) never hands out
  // the same memory twice.
  enum Slot : int {
    kLoraInput,      // LoraLinear: dropout(x), then the dropped-out part of dx
    kLoraGrad,       // LoraLinear: dt = s·dy·B
    kMlpGate,        // SwiGluMlp with recompute: gate and up pre-activations, rebuilt in backward
    kMlpUp,
    kMlpHidden,      // SwiGluMlp: h = silu(gate)·up
    kMlpHiddenGrad,  // SwiGluMlp: dh
    kNumSlots
  };
  TensorView get(Slot slot, Device device, DType dtype, std::int64_t rows, std::int64_t cols);
  std::array<Tensor, kNumSlots> slots_;  // each grown to the largest view asked of it
};

struct LoraConfig {
  int rank = 8;
  float alpha = 16.0f;              // scale s = alpha / rank, applied at compute time (GEMM alpha), never folded into B
  float dropout = 0.0f;             // on the adapter's input only (PEFT's lora_dropout), 0 <= dropout < 1
  DType activations = DType::BF16;  // dtype of x, y, dy, dx: f32 or bf16
  // How the dense GEMMs multiply f32 activations. BF16 (operands truncated to bf16, fp32 accumulation) by default:
  // the numerics of the bf16 and NF4 paths at tensor-core speed; FP32 for exact math (tests, debugging).
  // bf16 activations always multiply bf16 operands. NF4 base GEMMs always round their operands to bf16.
  MathMode math = MathMode::BF16;
  std::uint64_t seed = 0;  // A's initialisation and the dropout masks
};

// Train: dropout with a fresh mask. Eval: no dropout. Recompute: the last forward again, with the same mask
// (activation recomputation); it needs a previous forward with the same number of rows.
enum class ForwardMode { Train, Eval, Recompute };

class LoraLinear {
 public:
  // A ~ uniform(±1/sqrt(K)) from config.seed (PEFT's kaiming_uniform(a=sqrt(5))), B = 0, gradients and moments 0.
  // bias: empty, or [N], f32 or the activation dtype, frozen. Both base and bias are views (see the top).
  LoraLinear(const Context& ctx, const BaseWeight& base, const LoraConfig& config, const TensorView& bias = {});
  LoraLinear(const LoraLinear&) = delete;
  LoraLinear& operator=(const LoraLinear&) = delete;
  LoraLinear(LoraLinear&&) = default;
  LoraLinear& operator=(LoraLinear&&) = default;
  ~LoraLinear() = default;

  // y [M,N] = x [M,K]·W0ᵀ + s·(dropout(x)·Aᵀ)·Bᵀ + bias. Saves t = dropout(x)·Aᵀ [M,r] and the dropout seed
  // (the mask is regenerated, never stored). y must not overlap x.
  void forward(const TensorView& x, const TensorView& y, ForwardMode mode = ForwardMode::Train);
  // The same when y already holds x·W0ᵀ (computed elsewhere, e.g. by nf4_gate_up): adds the adapter and the bias.
  void forward_on_base(const TensorView& x, const TensorView& y, ForwardMode mode = ForwardMode::Train);
  // For the last forward, with the same x: grad_a += dAᵀ, grad_b += dB (fp32, accumulated), and, when dx is
  // given, dx [M,K] = dx_beta·dx + dy·W0 + s·dropout'(dy·B·A) (dx_beta = 0 overwrites; dx may be empty when
  // the input gradient is not needed). dy [M,N] in the activation dtype; dx must not overlap x or dy.
  void backward(const TensorView& x, const TensorView& dy, const TensorView& dx, float dx_beta = 0.0f);

  // Copies the adapters from a and b (f32 [r,K] and [N,r], any device) into the masters and refreshes the working
  // copies: checkpoint loading, and tests that want B nonzero.
  void load_adapters(const TensorView& a, const TensorView& b);
  // Re-derives the bf16 working copies of A and B from the fp32 masters (no-op with f32 activations). Call after
  // every change of the masters made outside this class (an optimizer step: AdamW::step does it).
  void refresh_working_copies();
  // {A, dA, mA, vA} and {B, dB, mB, vB}, all f32 on the context's device, for adamw_step.
  std::vector<AdamWParam> parameters();
  void zero_grad();
  // Allocates the saved and scratch buffers for up to max_rows rows, so later calls do not allocate.
  void reserve(std::int64_t max_rows);
  void set_scratch(std::shared_ptr<Scratch> scratch);
  const std::shared_ptr<Scratch>& scratch() const { return scratch_; }

  const Context& context() const { return ctx_; }
  const BaseWeight& base() const { return base_; }
  const TensorView& bias() const { return bias_; }
  const LoraConfig& config() const { return config_; }
  float scale() const { return scale_; }
  std::int64_t in_features() const { return base_.in_features(); }
  std::int64_t out_features() const { return base_.out_features(); }
  TensorView lora_a() const { return a_; }  // f32 [r,K] master
  TensorView lora_b() const { return b_; }  // f32 [N,r] master
  TensorView grad_a() const { return grad_a_; }
  TensorView grad_b() const { return grad_b_; }
  bool has_saved_forward() const { return saved_rows_ >= 0; }
  std::uint64_t dropout_seed() const { return saved_seed_; }    // mask seed of the last forward
  bool dropout_active() const { return saved_dropout_; }        // whether the last forward dropped anything

  std::int64_t trainable_parameters() const;  // r·(K + N)
  std::size_t frozen_bytes() const;           // W0 as stored + bias
  std::size_t frozen_bf16_bytes() const;      // the same parameters stored as bf16 (the figure NF4 is compared to)
  std::size_t saved_bytes() const;            // activations held from forward to backward (capacity)

 private:
  friend class SwiGluMlp;  // sums gate's and up's second products inside its SwiGLU (SwiGluMlp::adapters_in_swiglu)
  void check_x(const char* op, const TensorView& x) const;
  void check_forward(const char* op, const TensorView& x, const TensorView& y, ForwardMode mode) const;
  void adapter_forward(const TensorView& x, const TensorView& y, ForwardMode mode, float y_beta);
  TensorView first_product(const TensorView& x, ForwardMode mode);    // t = dropout(x)·Aᵀ, saved; returns it
  TensorView saved_t();                                               // the last forward's t [M, r]
  void base_forward(const TensorView& x, const TensorView& y) const;  // y = x·W0ᵀ
  void base_backward_a(const TensorView& dy, const TensorView& dx, float beta) const;  // dx = dy·W0 + beta·dx
  void add_bias_if_any(const TensorView& y) const;
  bool adapter_first() const;  // whether forward writes the adapter's product before the base GEMM adds onto it
  TensorView working_a() const { return a_work_.defined() ? a_work_.view() : a_.view(); }
  TensorView working_b() const { return b_work_.defined() ? b_work_.view() : b_.view(); }
  GemmOptions gemm_opts(float alpha, float beta) const { return {alpha, beta, config_.math}; }

  Context ctx_;
  BaseWeight base_;
  TensorView bias_;
  LoraConfig config_;
  float scale_ = 0.0f;
  Tensor a_, b_, grad_a_, grad_b_, m_a_, v_a_, m_b_, v_b_;  // f32
  Tensor a_work_, b_work_;                                    // bf16, only with bf16 activations
  std::shared_ptr<Scratch> scratch_;
  Tensor saved_t_;  // grown to the largest forward (see reserve)
  std::int64_t saved_rows_ = -1;  // rows of the last forward; -1 before the first
  std::uint64_t saved_seed_ = 0;
  bool saved_dropout_ = false;
  std::uint64_t dropout_calls_ = 0;  // drives a fresh mask seed per training forward
};

struct MlpOptions {
  // Save only x (the caller's) and recompute gate and up in backward, instead of saving both [M,I].
  bool recompute = false;
  // When gate and up are both NF4, compute their base parts with one nf4_gate_up (one read of x).
  bool fuse_gate_up = true;
};

// y [M,H] = down(silu(gate(x))·up(x)), gate and up [I,H] (out, in), down [H,I].
// Saved from forward to backward: gate and up pre-activations [M,I] (none with recompute; their base products
// alone where adapters_in_swiglu) plus each projection's t [M,r]; the hidden h is rebuilt in backward.
class SwiGluMlp {
 public:
  // Takes three layers of one device and activation dtype; they share one Scratch from then on.
  SwiGluMlp(LoraLinear gate, LoraLinear up, LoraLinear down, const MlpOptions& options = {});
  // One LoraConfig for all three projections (their seeds are derived from config.seed, so the three A's and
  // dropout masks differ). No biases.
  SwiGluMlp(const Context& ctx, const BaseWeight& gate, const BaseWeight& up, const BaseWeight& down,
            const LoraConfig& config, const MlpOptions& options = {});

  void forward(const TensorView& x, const TensorView& y, ForwardMode mode = ForwardMode::Train);
  // For the last forward, with the same x: every adapter gradient += its share; dx as in LoraLinear::backward.
  // Consumes the saved activations (gate and up are overwritten by their gradients): one backward per forward
  // (a forward in Recompute mode makes them again, with the same masks).
  void backward(const TensorView& x, const TensorView& dy, const TensorView& dx, float dx_beta = 0.0f);

  std::vector<AdamWParam> parameters();  // gate's, up's, down's
  void zero_grad();
  void refresh_working_copies();
  void reserve(std::int64_t max_rows);
  void set_scratch(std::shared_ptr<Scratch> scratch);

  LoraLinear& gate() { return gate_; }
  LoraLinear& up() { return up_; }
  LoraLinear& down() { return down_; }
  const LoraLinear& gate() const { return gate_; }
  const LoraLinear& up() const { return up_; }
  const LoraLinear& down() const { return down_; }
  const MlpOptions& options() const { return options_; }
  bool fused_gate_up() const;  // whether forward uses nf4_gate_up
  // Whether a forward in `mode` (and its backward) adds gate's and up's adapter terms (s·t·Bᵀ) inside the SwiGLU
  // kernel instead of onto gate and up, and the backward down's share of h's gradient there too (writing h again
  // for down's A gradient): where no projection has a bias, down drops nothing in that forward, and on a CUDA
  // context with bf16 activations and ranks up to kSwiGluAdaptersMmaRank (the kernel's tensor-core path); on a
  // CPU context with bf16 activations or FP32 math on all three (the kernel's sums do not round operands as
  // MathMode::BF16/TF32 GEMMs do). The sums then go unrounded into the SwiGLU (as in Python's lora_nf4_mlp).
  bool adapters_in_swiglu(ForwardMode mode = ForwardMode::Train) const;
  std::int64_t hidden_features() const { return down_.out_features(); }        // H
  std::int64_t intermediate_features() const { return gate_.out_features(); }  // I

  std::int64_t trainable_parameters() const;
  std::size_t frozen_bytes() const;
  std::size_t frozen_bf16_bytes() const;
  std::size_t saved_bytes() const;

 private:
  void gate_up_forward(const TensorView& x, const TensorView& g, const TensorView& u, ForwardMode mode);
  SwiGluAdapters swiglu_terms();  // gate's and up's terms from their last forward's t

  LoraLinear gate_, up_, down_;
  MlpOptions options_;
  Tensor saved_gate_, saved_up_;  // likewise
  std::int64_t last_rows_ = -1;  // rows of the last completed forward (what Recompute repeats); -1 before
  bool saved_ = false;           // whether that forward's activations are still there for backward
  bool terms_in_swiglu_ = false;  // whether that forward left gate's and up's adapter terms to the SwiGLU kernel
};

// AdamW over the adapters of the layers added to it. The layers must outlive the optimizer and stay at their
// address (it refreshes their bf16 working copies after each step).
class AdamW {
 public:
  AdamW(const Context& ctx, const AdamWOptions& options);
  void add(LoraLinear& layer);
  void add(SwiGluMlp& mlp);
  // One adamw_step over every parameter (step count from 1), then the working copies are refreshed. `norm`, when
  // given, receives the gradient norm before clipping (f32, one element, on the device; not read back here).
  void step(const TensorView& norm = {});
  void zero_grad();
  // Data parallelism: from now on every step first replaces each gradient by its mean over comm's ranks (comm
  // must outlive the optimizer's steps; nullptr detaches). Clipping then sees the global gradient.
  void all_reduce_with(Communicator* comm);
  int steps() const { return steps_; }
  AdamWOptions& options() { return options_; }  // e.g. for a learning-rate schedule
  const AdamWOptions& options() const { return options_; }

 private:
  Context ctx_;
  AdamWOptions options_;
  std::vector<LoraLinear*> layers_;
  std::vector<AdamWParam> params_;
  Communicator* comm_ = nullptr;
  int steps_ = 0;
};

}  // namespace qmm
