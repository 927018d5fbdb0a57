// SwiGluMlp: y = down(silu(gate(x))·up(x)) over three LoraLinears, from the public ops only.
#include <algorithm>
#include <array>
#include <string>
#include <utility>

#include "core/validate.h"
#include "nn/buffers.h"
#include "nn/check.h"
#include "qmm/nn.h"

namespace qmm {
namespace {

using nn_detail::dims;

std::string shape_of(const LoraLinear& l) { return dims(l.out_features(), l.in_features()); }

// The three projections agree on device, activation dtype and shapes: gate, up [I,H], down [H,I].
void check_projections(const LoraLinear& gate, const LoraLinear& up, const LoraLinear& down) {
  const char* op = "SwiGluMlp";
  const Device dev = gate.context().device();
  QMM_REQUIRE(up.context().device() == dev && down.context().device() == dev, ErrorCode::DeviceMismatch, op,
              "gate, up and down run on " + dev.str() + ", " + up.context().device().str() + " and " +
                  down.context().device().str() + " but must share one device");
  const DType act = gate.config().activations;
  QMM_REQUIRE(up.config().activations == act && down.config().activations == act, ErrorCode::DTypeMismatch, op,
              std::string("gate, up and down have activations ") + dtype_name(act) + ", " +
                  dtype_name(up.config().activations) + " and " + dtype_name(down.config().activations) +
                  " but must share one dtype");
  QMM_REQUIRE(up.out_features() == gate.out_features() && up.in_features() == gate.in_features(),
              ErrorCode::ShapeMismatch, op,
              "up is " + shape_of(up) + " but gate is " + shape_of(gate) + ": they must agree");
  QMM_REQUIRE(down.in_features() == gate.out_features() && down.out_features() == gate.in_features(),
              ErrorCode::ShapeMismatch, op,
              "down is " + shape_of(down) + " but must be " + dims(gate.in_features(), gate.out_features()) +
                  " for gate " + shape_of(gate));
}

// A projection from the convenience constructor; its errors name the MLP and the projection.
LoraLinear projection(const Context& ctx, const BaseWeight& base, LoraConfig config, int index, const char* name) {
  config.seed = config.seed * 3 + static_cast<std::uint64_t>(index);  // distinct A's and masks per projection
  try {
    return LoraLinear(ctx, base, config);
  } catch (const Error& e) {
    throw Error(e.code(), std::string("SwiGluMlp (") + name + "): " + e.what());
  }
}

}  // namespace

SwiGluMlp::SwiGluMlp(LoraLinear gate, LoraLinear up, LoraLinear down, const MlpOptions& options)
    : gate_(std::move(gate)), up_(std::move(up)), down_(std::move(down)), options_(options) {
  check_projections(gate_, up_, down_);
  set_scratch(gate_.scratch());
}

SwiGluMlp::SwiGluMlp(const Context& ctx, const BaseWeight& gate, const BaseWeight& up, const BaseWeight& down,
                     const LoraConfig& config, const MlpOptions& options)
    : SwiGluMlp(projection(ctx, gate, config, 0, "gate"), projection(ctx, up, config, 1, "up"),
                projection(ctx, down, config, 2, "down"), options) {}

bool SwiGluMlp::fused_gate_up() const {
  return options_.fuse_gate_up && gate_.base().is_nf4() && up_.base().is_nf4();
}

bool SwiGluMlp::adapters_in_swiglu(ForwardMode mode) const {
  const std::array<const LoraLinear*, 3> layers{&gate_, &up_, &down_};
  if (std::ranges::any_of(layers, [](const LoraLinear* l) { return !l->bias().empty(); })) return false;
  if (down_.config().dropout > 0.0f && mode != ForwardMode::Eval) return false;  // its dh share joins unmasked
  const bool bf16 = gate_.config().activations == DType::BF16;
  if (gate_.context().device().is_cpu()) {
    // The kernel sums the terms exactly from t and B as stored; f32 activations under a reduced math mode would
    // lose the operand rounding the adapters' own GEMMs apply.
    return bf16 || std::ranges::all_of(layers, [](const LoraLinear* l) { return l->config().math == MathMode::FP32; });
  }
  const int most = std::max({gate_.config().rank, up_.config().rank, down_.config().rank});
  return bf16 && most <= kSwiGluAdaptersMmaRank;
}

SwiGluAdapters SwiGluMlp::swiglu_terms() {
  return {.t = gate_.saved_t(),
          .b_gate = gate_.working_b(),
          .gate_scale = gate_.scale(),
          .b_up = up_.working_b(),
          .up_scale = up_.scale(),
          .dh_t = {},  // the backward adds down's term
          .dh_a = {},
          .t_up = up_.saved_t()};
}

// gate and up (pre-activation, adapters and biases included) into g and u; with terms_in_swiglu_ their base
// products alone, and each adapter's t saved for the SwiGLU kernel.
void SwiGluMlp::gate_up_forward(const TensorView& x, const TensorView& g, const TensorView& u, ForwardMode mode) {
  if (terms_in_swiglu_) {
    if (fused_gate_up()) {
      nf4_gate_up(gate_.context(), x, gate_.base().nf4(), up_.base().nf4(), {g, u, {}});
    } else {
      gate_.base_forward(x, g);
      up_.base_forward(x, u);
    }
    gate_.first_product(x, mode);
    up_.first_product(x, mode);
    return;
  }
  if (!fused_gate_up()) {
    gate_.forward(x, g, mode);
    up_.forward(x, u, mode);
    return;
  }
  // One read of x for both NF4 bases; the adapters go on top before any SwiGLU sees the values.
  nf4_gate_up(gate_.context(), x, gate_.base().nf4(), up_.base().nf4(), {g, u, {}});
  gate_.forward_on_base(x, g, mode);
  up_.forward_on_base(x, u, mode);
}

void SwiGluMlp::forward(const TensorView& x, const TensorView& y, ForwardMode mode) {
  const char* op = "SwiGluMlp::forward";
  const Context& ctx = gate_.context();
  const DType act = gate_.config().activations;
  const std::int64_t h = hidden_features(), i = intermediate_features();
  nn_detail::require_activation(ctx, op, "x", x, act, -1, h);
  const std::int64_t m = x.dim(0);
  nn_detail::require_activation(ctx, op, "y", y, act, m, h);
  detail::require_no_overlap(op, "y", y, "x", x);
  QMM_REQUIRE(mode == ForwardMode::Train || mode == ForwardMode::Eval || mode == ForwardMode::Recompute,
              ErrorCode::InvalidArgument, op, "mode " + std::to_string(static_cast<int>(mode)) + " is unknown");
  if (mode == ForwardMode::Recompute)
    QMM_REQUIRE(last_rows_ == m, ErrorCode::InvalidArgument, op,
                "mode Recompute needs a previous forward with " + std::to_string(m) + " rows");
  saved_ = false;  // until this forward has completed
  if (mode != ForwardMode::Recompute) terms_in_swiglu_ = adapters_in_swiglu(mode);  // a Recompute repeats it

  const Device dev = ctx.device();
  Scratch& scratch = *gate_.scratch();
  const TensorView g = options_.recompute ? scratch.get(Scratch::kMlpGate, dev, act, m, i)
                                          : grown_view(saved_gate_, dev, act, m, i);
  const TensorView u = options_.recompute ? scratch.get(Scratch::kMlpUp, dev, act, m, i)
                                          : grown_view(saved_up_, dev, act, m, i);
  gate_up_forward(x, g, u, mode);
  const TensorView hidden = scratch.get(Scratch::kMlpHidden, dev, act, m, i);
  swiglu(ctx, g, u, hidden, terms_in_swiglu_ ? swiglu_terms() : SwiGluAdapters{});
  down_.forward(hidden, y, mode);
  last_rows_ = m;
  saved_ = true;
}

void SwiGluMlp::backward(const TensorView& x, const TensorView& dy, const TensorView& dx, float dx_beta) {
  const char* op = "SwiGluMlp::backward";
  const Context& ctx = gate_.context();
  const DType act = gate_.config().activations;
  const std::int64_t h = hidden_features(), i = intermediate_features();
  QMM_REQUIRE(saved_, ErrorCode::InvalidArgument, op,
              "no saved forward: call forward first (each backward consumes its forward)");
  const std::int64_t m = last_rows_;
  nn_detail::require_activation(ctx, op, "x", x, act, -1, h);
  QMM_REQUIRE(x.dim(0) == m, ErrorCode::ShapeMismatch, op,
              "x is " + x.shape().str() + " but the last forward had " + std::to_string(m) + " rows");
  nn_detail::require_activation(ctx, op, "dy", dy, act, m, h);
  if (!dx.empty()) {
    nn_detail::require_activation(ctx, op, "dx", dx, act, m, h);
    detail::require_no_overlap(op, "dx", dx, "x", x);
    detail::require_no_overlap(op, "dx", dx, "dy", dy);
  }
  nn_detail::require_finite_beta(op, dx_beta);

  const Device dev = ctx.device();
  Scratch& scratch = *gate_.scratch();
  TensorView g, u;
  if (options_.recompute) {
    g = scratch.get(Scratch::kMlpGate, dev, act, m, i);
    u = scratch.get(Scratch::kMlpUp, dev, act, m, i);
    gate_up_forward(x, g, u, ForwardMode::Recompute);  // the same masks as the forward
  } else {
    g = grown_view(saved_gate_, dev, act, m, i);
    u = grown_view(saved_up_, dev, act, m, i);
  }
  const TensorView hidden = scratch.get(Scratch::kMlpHidden, dev, act, m, i);
  const TensorView dhidden = scratch.get(Scratch::kMlpHiddenGrad, dev, act, m, i);
  if (terms_in_swiglu_) {
    // dh = dy·W_down; the down adapter's share dt·A joins it inside the SwiGLU kernel, which writes h again on
    // the way (for that adapter's A gradient, dA += dtᵀ·h).
    down_.base_backward_a(dy, dhidden, 0.0f);
    const LoraConfig& dc = down_.config();
    const TensorView dt = scratch.get(Scratch::kLoraGrad, dev, act, m, dc.rank);
    lora_backward_dy(ctx, dy, down_.working_b(), down_.saved_t(), dt, down_.grad_b_, down_.scale(), dc.math);
    SwiGluAdapters terms = swiglu_terms();
    terms.dh_t = dt;
    terms.dh_a = down_.working_a();
    swiglu_backward(ctx, g, u, dhidden, g, u, terms, hidden);  // in place: g, u become dgate, dup
    gemm_backward_b(ctx, dt, hidden, down_.grad_a_, {1.0f, 1.0f, dc.math});
  } else {
    // h is cheaper to rebuild than to keep: one element-wise pass.
    swiglu(ctx, g, u, hidden);
    down_.backward(hidden, dy, dhidden, 0.0f);
    swiglu_backward(ctx, g, u, dhidden, g, u);  // in place: g, u become dgate, dup
  }
  saved_ = false;
  gate_.backward(x, g, dx, dx_beta);
  up_.backward(x, u, dx, dx.empty() ? 0.0f : 1.0f);
}

std::vector<AdamWParam> SwiGluMlp::parameters() {
  std::vector<AdamWParam> all;
  for (LoraLinear* l : {&gate_, &up_, &down_})
    for (const AdamWParam& p : l->parameters()) all.push_back(p);
  return all;
}

void SwiGluMlp::zero_grad() {
  for (LoraLinear* l : {&gate_, &up_, &down_}) l->zero_grad();
}

void SwiGluMlp::refresh_working_copies() {
  for (LoraLinear* l : {&gate_, &up_, &down_}) l->refresh_working_copies();
}

void SwiGluMlp::reserve(std::int64_t max_rows) {
  QMM_REQUIRE(max_rows >= 0, ErrorCode::InvalidArgument, "SwiGluMlp::reserve",
              "max_rows is " + std::to_string(max_rows) + " but must be >= 0");
  for (LoraLinear* l : {&gate_, &up_, &down_}) l->reserve(max_rows);
  const Device dev = gate_.context().device();
  const DType act = gate_.config().activations;
  const std::int64_t i = intermediate_features();
  Scratch& scratch = *gate_.scratch();
  last_rows_ = -1;  // a grown buffer has lost what it held
  saved_ = false;
  if (options_.recompute) {
    scratch.get(Scratch::kMlpGate, dev, act, max_rows, i);
    scratch.get(Scratch::kMlpUp, dev, act, max_rows, i);
  } else {
    grown_view(saved_gate_, dev, act, max_rows, i);
    grown_view(saved_up_, dev, act, max_rows, i);
  }
  scratch.get(Scratch::kMlpHidden, dev, act, max_rows, i);
  scratch.get(Scratch::kMlpHiddenGrad, dev, act, max_rows, i);
}

void SwiGluMlp::set_scratch(std::shared_ptr<Scratch> scratch) {
  QMM_REQUIRE(scratch != nullptr, ErrorCode::InvalidArgument, "SwiGluMlp::set_scratch", "scratch is null");
  for (LoraLinear* l : {&gate_, &up_, &down_}) l->set_scratch(scratch);
}

std::int64_t SwiGluMlp::trainable_parameters() const {
  return gate_.trainable_parameters() + up_.trainable_parameters() + down_.trainable_parameters();
}

std::size_t SwiGluMlp::frozen_bytes() const {
  return gate_.frozen_bytes() + up_.frozen_bytes() + down_.frozen_bytes();
}

std::size_t SwiGluMlp::frozen_bf16_bytes() const {
  return gate_.frozen_bf16_bytes() + up_.frozen_bf16_bytes() + down_.frozen_bf16_bytes();
}

std::size_t SwiGluMlp::saved_bytes() const {
  return held_bytes(saved_gate_) + held_bytes(saved_up_) + gate_.saved_bytes() + up_.saved_bytes() + down_.saved_bytes();
}

}  // namespace qmm
