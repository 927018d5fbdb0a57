// LoraLinear, BaseWeight and the buffers the layers share, built from the public ops only.
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "core/validate.h"
#include "nn/buffers.h"
#include "nn/check.h"
#include "qmm/nn.h"

namespace qmm {
namespace {

using detail::fail;
using nn_detail::dims;

// splitmix64's finaliser: a bijective 64-bit mix, so distinct (seed, index) pairs stay distinct.
std::uint64_t mix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [-1, 1) from (seed, index), 24 random bits so every value is exact in f32. A hash rather than a
// std:: distribution: the same adapters on every platform and device.
float uniform_pm1(std::uint64_t seed, std::int64_t index) {
  const std::uint64_t h = mix64(seed ^ mix64(static_cast<std::uint64_t>(index)));
  return static_cast<float>(static_cast<double>(h >> 40) * 0x1.0p-23 - 1.0);
}

constexpr std::uint64_t kDropoutSalt = 0xD50F0A7E5EED0001ull;  // keeps mask seeds apart from A's init seed

Tensor zeros(const Context& ctx, DType dtype, Shape shape) {
  Tensor t(dtype, shape, ctx.device());
  zero(ctx, t);
  return t;
}

void check_config(const char* op, const LoraConfig& c) {
  QMM_REQUIRE(c.rank >= 1, ErrorCode::InvalidArgument, op,
              "config.rank is " + std::to_string(c.rank) + " but must be >= 1");
  QMM_REQUIRE(std::isfinite(c.alpha) && c.alpha > 0.0f, ErrorCode::InvalidArgument, op,
              "config.alpha is " + std::to_string(c.alpha) + " but must be finite and > 0");
  QMM_REQUIRE(c.dropout >= 0.0f && c.dropout < 1.0f, ErrorCode::InvalidArgument, op,
              "config.dropout is " + std::to_string(c.dropout) + " but must be in [0, 1)");
  QMM_REQUIRE(c.activations == DType::F32 || c.activations == DType::BF16, ErrorCode::DTypeMismatch, op,
              std::string("config.activations is ") + dtype_name(c.activations) + " but must be f32 or bf16");
  QMM_REQUIRE(c.math == MathMode::FP32 || c.math == MathMode::TF32 || c.math == MathMode::BF16,
              ErrorCode::InvalidArgument, op,
              "config.math " + std::to_string(static_cast<int>(c.math)) + " is unknown");
}

void check_base(const Context& ctx, const char* op, const BaseWeight& base, DType activations) {
  QMM_REQUIRE(!base.empty(), ErrorCode::InvalidArgument, op, "base is empty");
  if (base.is_nf4()) {
    detail::require_nf4_weight(ctx, op, "base", base.nf4());
  } else {
    detail::require_tensor(ctx, op, "base", base.dense());
    detail::require_rank(op, "base", base.dense(), 2);
    QMM_REQUIRE(base.dense().dtype() == activations, ErrorCode::DTypeMismatch, op,
                std::string("base is ") + dtype_name(base.dense().dtype()) + " but a dense base must have the " +
                    "activation dtype " + dtype_name(activations) + " (or be NF4)");
  }
  QMM_REQUIRE(base.out_features() >= 1 && base.in_features() >= 1, ErrorCode::ShapeMismatch, op,
              "base is " + dims(base.out_features(), base.in_features()) + " but must be [N,K] with N, K >= 1");
}

void check_bias(const Context& ctx, const char* op, const TensorView& bias, std::int64_t n, DType activations) {
  if (bias.empty()) return;
  detail::require_tensor(ctx, op, "bias", bias);
  detail::require_rank(op, "bias", bias, 1);
  detail::require_dtype(op, "bias", bias, {DType::F32, activations});
  QMM_REQUIRE(bias.dim(0) == n, ErrorCode::ShapeMismatch, op,
              "bias is " + bias.shape().str() + " but must be [" + std::to_string(n) + "] (the base's N)");
}

}  // namespace

// ---- BaseWeight, buffers -------------------------------------------------------------------------------------

std::size_t BaseWeight::nbytes() const {
  auto bytes = [](const TensorView& t) { return t.empty() ? std::size_t{0} : t.nbytes(); };
  if (!is_nf4_) return bytes(dense_);
  return bytes(nf4_.codes) + bytes(nf4_.absmax) + bytes(nf4_.absmax2) + bytes(nf4_.code2);
}

TensorView grown_view(Tensor& storage, Device device, DType dtype, std::int64_t rows, std::int64_t cols) {
  const auto need = static_cast<std::int64_t>(static_cast<std::size_t>(rows * cols) * dtype_size(dtype));
  if (!storage.defined() || storage.numel() < need || !(storage.device() == device)) {
    // Grow by at least half again, so a slowly rising row count reallocates only a few times.
    const std::int64_t grown = storage.defined() && storage.device() == device ? storage.numel() * 3 / 2 : 0;
    storage = Tensor();  // free first: the peak is the new buffer alone
    storage = Tensor(DType::U8, {std::max({need, grown, std::int64_t{1}})}, device);
  }
  return TensorView(storage.data(), dtype, {rows, cols}, device);
}

std::size_t held_bytes(const Tensor& storage) { return storage.defined() ? storage.nbytes() : 0; }

TensorView Scratch::get(Slot slot, Device device, DType dtype, std::int64_t rows, std::int64_t cols) {
  return grown_view(slots_[static_cast<std::size_t>(slot)], device, dtype, rows, cols);
}

std::size_t Scratch::bytes() const {
  std::size_t sum = 0;
  for (const Tensor& b : slots_) sum += held_bytes(b);
  return sum;
}

// ---- LoraLinear ----------------------------------------------------------------------------------------------

LoraLinear::LoraLinear(const Context& ctx, const BaseWeight& base, const LoraConfig& config, const TensorView& bias)
    : ctx_(ctx), base_(base), bias_(bias), config_(config), scratch_(std::make_shared<Scratch>()) {
  const char* op = "LoraLinear";
  check_config(op, config);
  check_base(ctx, op, base, config.activations);
  check_bias(ctx, op, bias, base.out_features(), config.activations);
  const std::int64_t r = config.rank, k = in_features(), n = out_features();
  scale_ = config.alpha / static_cast<float>(config.rank);

  // A ~ uniform(±1/sqrt(K)), built on the host and copied once (construction may wait; forward never does).
  Tensor a_host(DType::F32, {r, k});
  const float bound = 1.0f / std::sqrt(static_cast<float>(k));
  for (std::int64_t i = 0; i < r * k; ++i) a_host.data_as<float>()[i] = bound * uniform_pm1(config.seed, i);
  a_ = Tensor(DType::F32, {r, k}, ctx.device());
  copy(ctx, a_, a_host);
  b_ = zeros(ctx, DType::F32, {n, r});
  grad_a_ = zeros(ctx, DType::F32, {r, k});
  grad_b_ = zeros(ctx, DType::F32, {n, r});
  m_a_ = zeros(ctx, DType::F32, {r, k});
  v_a_ = zeros(ctx, DType::F32, {r, k});
  m_b_ = zeros(ctx, DType::F32, {n, r});
  v_b_ = zeros(ctx, DType::F32, {n, r});
  if (config.activations == DType::BF16) {
    a_work_ = Tensor(DType::BF16, {r, k}, ctx.device());
    b_work_ = Tensor(DType::BF16, {n, r}, ctx.device());
    refresh_working_copies();
  }
}

namespace {
void check_mode(const char* op, ForwardMode mode, std::int64_t saved_rows, std::int64_t rows) {
  QMM_REQUIRE(mode == ForwardMode::Train || mode == ForwardMode::Eval || mode == ForwardMode::Recompute,
              ErrorCode::InvalidArgument, op, "mode " + std::to_string(static_cast<int>(mode)) + " is unknown");
  if (mode != ForwardMode::Recompute) return;
  QMM_REQUIRE(saved_rows >= 0, ErrorCode::InvalidArgument, op, "mode Recompute needs a previous forward");
  QMM_REQUIRE(saved_rows == rows, ErrorCode::ShapeMismatch, op,
              "mode Recompute: x has " + std::to_string(rows) + " rows but the last forward had " +
                  std::to_string(saved_rows));
}
}  // namespace

void LoraLinear::check_x(const char* op, const TensorView& x) const {
  nn_detail::require_activation(ctx_, op, "x", x, config_.activations, -1, in_features());
}


void LoraLinear::check_forward(const char* op, const TensorView& x, const TensorView& y, ForwardMode mode) const {
  check_x(op, x);
  nn_detail::require_activation(ctx_, op, "y", y, config_.activations, x.dim(0), out_features());
  detail::require_no_overlap(op, "y", y, "x", x);
  check_mode(op, mode, saved_rows_, x.dim(0));
}

// Dense bases: the adapter's product goes first and the base GEMM accumulates onto it (beta = 1 costs the
// compute-bound GEMM little), where adding the adapter afterwards would be another read and write of y.
// NF4 bases keep the base first: from 33 to 512 rows their base GEMM is the fused kernel, whose accumulating
// epilogue reads the old output back, and adapter-first measured slower there for the layer and the MLP block
// (docs/BENCHMARKS.md, LoRA MLP block).
bool LoraLinear::adapter_first() const { return !base_.is_nf4(); }

void LoraLinear::forward(const TensorView& x, const TensorView& y, ForwardMode mode) {
  check_forward("LoraLinear::forward", x, y, mode);
  if (adapter_first()) {
    adapter_forward(x, y, mode, 0.0f);
    gemm_bt(ctx_, x, base_.dense(), y, gemm_opts(1.0f, 1.0f));
  } else {
    base_forward(x, y);
    adapter_forward(x, y, mode, 1.0f);
  }
  add_bias_if_any(y);
}

void LoraLinear::base_forward(const TensorView& x, const TensorView& y) const {
  if (base_.is_nf4())
    nf4_gemm(ctx_, x, base_.nf4(), y);
  else
    gemm_bt(ctx_, x, base_.dense(), y, gemm_opts(1.0f, 0.0f));
}

void LoraLinear::base_backward_a(const TensorView& dy, const TensorView& dx, float beta) const {
  if (base_.is_nf4())
    nf4_gemm_backward_a(ctx_, dy, base_.nf4(), dx, {1.0f, beta});
  else
    gemm(ctx_, dy, base_.dense(), dx, gemm_opts(1.0f, beta));
}

void LoraLinear::forward_on_base(const TensorView& x, const TensorView& y, ForwardMode mode) {
  check_forward("LoraLinear::forward_on_base", x, y, mode);
  adapter_forward(x, y, mode, 1.0f);
  add_bias_if_any(y);
}

void LoraLinear::add_bias_if_any(const TensorView& y) const {
  if (!bias_.empty()) add_bias(ctx_, y, bias_);
}

// y = s·(dropout(x)·Aᵀ)·Bᵀ + y_beta·y; saves t and the mask seed. Arguments are already checked.
void LoraLinear::adapter_forward(const TensorView& x, const TensorView& y, ForwardMode mode, float y_beta) {
  const TensorView t = first_product(x, mode);
  gemm_bt(ctx_, t, working_b(), y, gemm_opts(scale_, y_beta));  // y = s·t·Bᵀ + y_beta·y  [M,N]
}

TensorView LoraLinear::saved_t() {
  return grown_view(saved_t_, ctx_.device(), config_.activations, saved_rows_, config_.rank);  // already that size
}

// t = dropout(x)·Aᵀ [M,r] into the saved t, with the mask's seed; arguments (and a Recompute's rows) are checked
// by the caller.
TensorView LoraLinear::first_product(const TensorView& x, ForwardMode mode) {
  const std::int64_t m = x.dim(0);
  const DType act = config_.activations;
  const Device dev = ctx_.device();
  bool drop = false;
  std::uint64_t seed = 0;
  if (mode == ForwardMode::Train && config_.dropout > 0.0f) {
    drop = true;
    seed = mix64(config_.seed ^ kDropoutSalt ^ mix64(++dropout_calls_));
  } else if (mode == ForwardMode::Recompute) {
    drop = saved_dropout_;
    seed = saved_seed_;
  }
  saved_rows_ = -1;  // until this forward has completed

  TensorView xa = x;
  if (drop) {
    xa = scratch_->get(Scratch::kLoraInput, dev, act, m, in_features());
    dropout(ctx_, x, xa, config_.dropout, seed);
  }
  const TensorView t = grown_view(saved_t_, dev, act, m, config_.rank);
  gemm_bt(ctx_, xa, working_a(), t, gemm_opts(1.0f, 0.0f));  // t = dropout(x)·Aᵀ  [M,r]

  saved_rows_ = m;
  saved_seed_ = seed;
  saved_dropout_ = drop;
  return t;
}

void LoraLinear::backward(const TensorView& x, const TensorView& dy, const TensorView& dx, float dx_beta) {
  const char* op = "LoraLinear::backward";
  QMM_REQUIRE(saved_rows_ >= 0, ErrorCode::InvalidArgument, op, "no saved forward: call forward first");
  check_x(op, x);
  QMM_REQUIRE(x.dim(0) == saved_rows_, ErrorCode::ShapeMismatch, op,
              "x is " + x.shape().str() + " but the last forward had " + std::to_string(saved_rows_) + " rows");
  nn_detail::require_activation(ctx_, op, "dy", dy, config_.activations, saved_rows_, out_features());
  if (!dx.empty()) {
    nn_detail::require_activation(ctx_, op, "dx", dx, config_.activations, saved_rows_, in_features());
    detail::require_no_overlap(op, "dx", dx, "x", x);
    detail::require_no_overlap(op, "dx", dx, "dy", dy);
  }
  nn_detail::require_finite_beta(op, dx_beta);

  const std::int64_t m = saved_rows_;
  const DType act = config_.activations;
  const Device dev = ctx_.device();
  const TensorView t = grown_view(saved_t_, dev, act, m, config_.rank);  // same rows as forward: the saved memory
  const TensorView dt = scratch_->get(Scratch::kLoraGrad, dev, act, m, config_.rank);
  lora_backward_dy(ctx_, dy, working_b(), t, dt, grad_b_, scale_, config_.math);  // dt = s·dy·B, dB += s·dyᵀ·t
  TensorView xa = x;
  if (saved_dropout_) {  // the mask again, from its seed
    xa = scratch_->get(Scratch::kLoraInput, dev, act, m, in_features());
    dropout(ctx_, x, xa, config_.dropout, saved_seed_);
  }
  gemm_backward_b(ctx_, dt, xa, grad_a_, gemm_opts(1.0f, 1.0f));      // dA += dtᵀ·dropout(x)  [r,K]
  if (dx.empty()) return;

  // dx = dx_beta·dx + dy·W0 + dropout'(dt·A). dropout' applies the forward's mask and 1/(1-p) scaling, so
  // dropout() itself computes it. The adapter's term goes first where forward's does (adapter_first), except
  // with dropout onto an accumulating dx (the mask must not touch dx's old value).
  if (adapter_first() && (!saved_dropout_ || dx_beta == 0.0f)) {
    gemm(ctx_, dt, working_a(), dx, gemm_opts(1.0f, saved_dropout_ ? 0.0f : dx_beta));  // dx = dt·A + beta·dx
    if (saved_dropout_) dropout(ctx_, dx, dx, config_.dropout, saved_seed_);
    base_backward_a(dy, dx, 1.0f);
    return;
  }
  base_backward_a(dy, dx, dx_beta);
  if (!saved_dropout_) {
    gemm(ctx_, dt, working_a(), dx, gemm_opts(1.0f, 1.0f));  // dx += dt·A
    return;
  }
  const TensorView part = scratch_->get(Scratch::kLoraInput, dev, act, m, in_features());  // dropout(x) is dead
  gemm(ctx_, dt, working_a(), part, gemm_opts(1.0f, 0.0f));
  dropout(ctx_, part, part, config_.dropout, saved_seed_);
  add(ctx_, dx, part, dx);
}

void LoraLinear::load_adapters(const TensorView& a, const TensorView& b) {
  const char* op = "LoraLinear::load_adapters";
  auto check = [&](const char* name, const TensorView& t, const Shape& want) {
    QMM_REQUIRE(t.data() != nullptr, ErrorCode::InvalidArgument, op, std::string(name) + " has null data");
    detail::require_dtype(op, name, t, {DType::F32});
    QMM_REQUIRE(t.shape() == want, ErrorCode::ShapeMismatch, op,
                std::string(name) + " is " + t.shape().str() + " but must be " + want.str());
    QMM_REQUIRE(t.device().is_cpu() || t.device() == ctx_.device(), ErrorCode::DeviceMismatch, op,
                std::string(name) + " is on " + t.device().str() + " but must be on the host or " +
                    ctx_.device().str());
  };
  check("a", a, a_.shape());
  check("b", b, b_.shape());
  copy(ctx_, a_, a);
  copy(ctx_, b_, b);
  refresh_working_copies();
}

void LoraLinear::refresh_working_copies() {
  if (!a_work_.defined()) return;
  cast(ctx_, a_, a_work_);
  cast(ctx_, b_, b_work_);
}

std::vector<AdamWParam> LoraLinear::parameters() {
  return {{a_, grad_a_, m_a_, v_a_}, {b_, grad_b_, m_b_, v_b_}};
}

void LoraLinear::zero_grad() {
  zero(ctx_, grad_a_);
  zero(ctx_, grad_b_);
}

void LoraLinear::reserve(std::int64_t max_rows) {
  QMM_REQUIRE(max_rows >= 0, ErrorCode::InvalidArgument, "LoraLinear::reserve",
              "max_rows is " + std::to_string(max_rows) + " but must be >= 0");
  const DType act = config_.activations;
  const Device dev = ctx_.device();
  saved_rows_ = -1;  // a grown buffer has lost what it held
  grown_view(saved_t_, dev, act, max_rows, config_.rank);
  scratch_->get(Scratch::kLoraGrad, dev, act, max_rows, config_.rank);
  if (config_.dropout > 0.0f) scratch_->get(Scratch::kLoraInput, dev, act, max_rows, in_features());
}

void LoraLinear::set_scratch(std::shared_ptr<Scratch> scratch) {
  QMM_REQUIRE(scratch != nullptr, ErrorCode::InvalidArgument, "LoraLinear::set_scratch", "scratch is null");
  scratch_ = std::move(scratch);
}

std::int64_t LoraLinear::trainable_parameters() const {
  return static_cast<std::int64_t>(config_.rank) * (in_features() + out_features());
}

std::size_t LoraLinear::frozen_bytes() const { return base_.nbytes() + (bias_.empty() ? 0 : bias_.nbytes()); }

std::size_t LoraLinear::frozen_bf16_bytes() const {
  const std::int64_t n = out_features();
  return static_cast<std::size_t>(n * in_features() + (bias_.empty() ? 0 : n)) * dtype_size(DType::BF16);
}

std::size_t LoraLinear::saved_bytes() const { return held_bytes(saved_t_); }

}  // namespace qmm
