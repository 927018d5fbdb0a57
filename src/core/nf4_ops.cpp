// Public NF4 entry points: validate every argument (shapes against W [N,K], dtypes, devices, every weight field,
// aliasing), then route to the backend of the context's device. Nothing is written before validation passes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/gemm_problem.h"
#include "core/gpu_backend.h"
#include "core/nf4_forced.h"
#include "core/reference_backend.h"
#include "core/validate.h"
#include "qmm/ops.h"

namespace qmm {

namespace {

// Every path an entry point accepts: the public intents and the kernels tests and benchmarks force.
constexpr std::pair<Nf4Path, const char*> kPathNames[] = {
    {Nf4Path::Auto, "auto"},
    {Nf4Path::DequantGemm, "dequant_gemm"},
    {Nf4Path::Fused, "fused"},
    {nf4_forced::kReference, "reference"},
    {nf4_forced::kSmallM, "small_m"},
    {nf4_forced::kFusedShared, "fused_shared"},
    {nf4_forced::kFusedMma, "fused_mma"},
    {nf4_forced::kSmallMSlice, "small_m_slice"},
};

const char* known_path_name(Nf4Path path) {
  for (const auto& [p, name] : kPathNames)
    if (p == path) return name;
  return nullptr;
}

}  // namespace

const char* nf4_path_name(Nf4Path path) {
  const char* name = known_path_name(path);
  return name ? name : "?";
}

namespace {

using detail::fail;

struct Part {
  std::string name;
  TensorView t;
};

std::string dims(std::int64_t r, std::int64_t c) {
  return std::string("[") + std::to_string(r) + "," + std::to_string(c) + "]";
}

// The tensors of a (validated) weight, for overlap checks.
std::vector<Part> weight_parts(const std::string& name, const Nf4Weight& w) {
  std::vector<Part> parts{{name + ".codes", w.codes}, {name + ".absmax", w.absmax}};
  if (w.double_quant()) {
    parts.push_back({name + ".absmax2", w.absmax2});
    parts.push_back({name + ".code2", w.code2});
  }
  return parts;
}

void require_disjoint(const char* op, const Part& out, const std::vector<Part>& others) {
  for (const Part& p : others) detail::require_no_overlap(op, out.name.c_str(), out.t, p.name.c_str(), p.t);
}

// A 2-D activation or output of an NF4 GEMM: f32 or bf16, on the context's device.
void require_matrix(const Context& ctx, const char* op, const char* name, const TensorView& t) {
  detail::require_tensor(ctx, op, name, t);
  detail::require_rank(op, name, t, 2);
  detail::require_dtype(op, name, t, {DType::F32, DType::BF16});
}

void require_shape(const char* op, const char* name, const TensorView& t, std::int64_t rows, std::int64_t cols,
                   const std::string& why) {
  if (t.dim(0) != rows || t.dim(1) != cols)
    fail(ErrorCode::ShapeMismatch, op,
         std::string(name) + " is " + t.shape().str() + " but must be " + dims(rows, cols) + " (" + why + ")");
}

void require_options(const char* op, const Nf4GemmOptions& opts) {
  if (!std::isfinite(opts.alpha))
    fail(ErrorCode::InvalidArgument, op, "alpha is " + std::to_string(opts.alpha) + " but must be finite");
  if (!std::isfinite(opts.beta))
    fail(ErrorCode::InvalidArgument, op, "beta is " + std::to_string(opts.beta) + " but must be finite");
  if (!known_path_name(opts.path))
    fail(ErrorCode::InvalidArgument, op, "path " + std::to_string(static_cast<int>(opts.path)) + " is unknown");
}

// The CPU backend is the reference: it serves Auto and the forced reference, nothing else.
void require_cpu_path(const char* op, Nf4Path path) {
  if (path != Nf4Path::Auto && path != nf4_forced::kReference)
    fail(ErrorCode::Unsupported, op,
         std::string("path ") + nf4_path_name(path) +
             " is not available on the CPU backend (it runs only the auto and reference paths)");
}

// The quantizer's input: a non-empty 2-D f32, bf16 or f16 weight on the context's device.
void require_quantize_input(const Context& ctx, const char* op, const TensorView& w) {
  detail::require_tensor(ctx, op, "W", w);
  detail::require_rank(op, "W", w, 2);
  detail::require_dtype(op, "W", w, {DType::F32, DType::BF16, DType::F16});
  if (w.dim(0) < 1 || w.dim(1) < 1)
    fail(ErrorCode::InvalidArgument, op, "W is " + w.shape().str() + " but must have at least one row and one column");
}

// The index of the first NaN or infinity among n elements of a host buffer of dtype `dtype` (f32, bf16 or f16),
// or -1: an all-ones exponent field.
std::int64_t first_non_finite_host(const void* data, DType dtype, std::int64_t n) {
  if (dtype == DType::F32) {
    const float* v = static_cast<const float*>(data);
    for (std::int64_t i = 0; i < n; ++i)
      if (!std::isfinite(v[i])) return i;
    return -1;
  }
  const std::uint16_t exponent = dtype == DType::BF16 ? 0x7f80 : 0x7c00;
  const std::uint16_t* v = static_cast<const std::uint16_t*>(data);
  for (std::int64_t i = 0; i < n; ++i)
    if ((v[i] & exponent) == exponent) return i;
  return -1;
}

// NF4 has no code for NaN or infinity: a block holding one would quantize to garbage (a NaN is dropped by the
// block's absmax and lands on -absmax; an infinity makes the scale, and with double quantization the offset,
// infinite). So quantize rejects them first, naming the first. A GPU weight is scanned on the host in chunks of
// rows (quantization is a one-time step; the copy costs about as much as the quantization itself).
void require_finite_weight(const Context& ctx, const char* op, const TensorView& w) {
  const std::int64_t rows = w.dim(0), cols = w.dim(1);
  auto report = [&](std::int64_t index) {
    const std::int64_t r = index / cols, c = index % cols;
    fail(ErrorCode::InvalidArgument, op,
         "W holds a NaN or infinity at index " + std::to_string(index) + " (row " + std::to_string(r) + ", column " +
             std::to_string(c) + "); NF4 has no code for non-finite values");
  };
  if (w.device().is_cpu()) {
    const std::int64_t bad = first_non_finite_host(w.data(), w.dtype(), w.numel());
    if (bad >= 0) report(bad);
    return;
  }
  const std::int64_t chunk_rows = std::max<std::int64_t>(1, (std::int64_t{16} << 20) / (cols * dtype_size(w.dtype())));
  Tensor host(w.dtype(), {std::min(chunk_rows, rows), cols});
  for (std::int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const std::int64_t n = std::min(chunk_rows, rows - r0);
    const TensorView part(static_cast<std::uint8_t*>(w.data()) + r0 * cols * dtype_size(w.dtype()), w.dtype(),
                          {n, cols}, w.device());
    const TensorView dst(host.data(), w.dtype(), {n, cols}, Device::cpu());
    copy(ctx, dst, part);
    ctx.synchronize();
    const std::int64_t bad = first_non_finite_host(host.data(), w.dtype(), n * cols);
    if (bad >= 0) report(r0 * cols + bad);
  }
}

void round_to_bf16(const float* src, std::uint16_t* dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// gate and up are computed in fp32 (into the caller's f32 outputs where given, else into temporaries); h comes
// from those fp32 values, never from a rounded bf16 gate or up, as on the GPU; bf16 outputs are rounded once.
// beta != 0 only without h (checked by the caller).
void cpu_gate_up(const TensorView& a, const Nf4Weight& w_gate, const Nf4Weight& w_up, const GateUpOutputs& out,
                 float alpha, float beta) {
  const std::int64_t m = a.dim(0), n = w_gate.rows;
  const bool want_h = !out.h.empty();
  struct Side {
    const TensorView& out;
    const Nf4Weight& w;
    Tensor tmp;
    TensorView f32;
  };
  Side sides[2] = {{out.gate, w_gate, {}, {}}, {out.up, w_up, {}, {}}};
  for (Side& s : sides) {
    if (s.out.empty() && !want_h) continue;
    if (!want_h) {  // the output alone: the GEMM rounds once into its dtype
      reference_backend().nf4_gemm(a, s.w, s.out, alpha, beta);
      continue;
    }
    if (!s.out.empty() && s.out.dtype() == DType::F32) {
      s.f32 = s.out;
    } else {
      s.tmp = Tensor(DType::F32, {m, n});
      s.f32 = s.tmp;
    }
    reference_backend().nf4_gemm(a, s.w, s.f32, alpha, 0.0f);
    if (!s.out.empty() && s.out.dtype() == DType::BF16)
      round_to_bf16(s.f32.data_as<const float>(), s.out.data_as<std::uint16_t>(), m * n);
  }
  if (!want_h) return;
  if (out.h.dtype() == DType::F32) return reference_backend().swiglu(sides[0].f32, sides[1].f32, out.h, {});
  Tensor h32(DType::F32, {m, n});
  reference_backend().swiglu(sides[0].f32, sides[1].f32, h32, {});
  round_to_bf16(h32.data_as<const float>(), out.h.data_as<std::uint16_t>(), m * n);
}

}  // namespace

void nf4_quantize(const Context& ctx, const TensorView& w, Nf4Weight& out) {
  const char* op = "nf4_quantize";
  require_quantize_input(ctx, op, w);
  detail::require_nf4_weight(ctx, op, "out", out);
  if (out.rows != w.dim(0) || out.cols != w.dim(1))
    fail(ErrorCode::ShapeMismatch, op, "W is " + w.shape().str() + " but out is sized for " + dims(out.rows, out.cols));
  const std::vector<Part> parts = weight_parts("out", out);
  for (std::size_t i = 0; i < parts.size(); ++i) {
    require_disjoint(op, parts[i], {{"W", w}});
    require_disjoint(op, parts[i], std::vector<Part>(parts.begin() + static_cast<std::ptrdiff_t>(i) + 1, parts.end()));
  }
  require_finite_weight(ctx, op, w);
  if (ctx.device().is_cpu()) return reference_backend().nf4_quantize(w, out);
  require_gpu_backend(op).nf4_quantize(ctx, w, out);
}

Nf4Tensor nf4_quantize(const Context& ctx, const TensorView& w, bool double_quant, int block_size) {
  const char* op = "nf4_quantize";
  require_quantize_input(ctx, op, w);
  // The rule of require_nf4_weight (src/core/nf4.cpp), checked here so the error names this op.
  if (block_size < 64 || block_size > 4096 || (block_size & (block_size - 1)) != 0)
    fail(ErrorCode::InvalidArgument, op,
         "block size " + std::to_string(block_size) + " must be a power of two in [64, 4096] (bitsandbytes' range)");
  Nf4Tensor t = Nf4Tensor::allocate(w.dim(0), w.dim(1), double_quant, ctx.device(), block_size);
  Nf4Weight v = t.view();
  nf4_quantize(ctx, w, v);
  t.offset = v.offset;
  return t;
}

void nf4_dequantize(const Context& ctx, const Nf4Weight& w, const TensorView& out) {
  const char* op = "nf4_dequantize";
  detail::require_nf4_weight(ctx, op, "W", w);
  require_matrix(ctx, op, "out", out);
  require_shape(op, "out", out, w.rows, w.cols, "W's shape");
  require_disjoint(op, {"out", out}, weight_parts("W", w));
  if (ctx.device().is_cpu()) return reference_backend().nf4_dequantize(w, out);
  require_gpu_backend(op).nf4_dequantize(ctx, w, out);
}

void nf4_gemm(const Context& ctx, const TensorView& a, const Nf4Weight& w, const TensorView& c,
              const Nf4GemmOptions& opts) {
  const char* op = "nf4_gemm";
  require_matrix(ctx, op, "A", a);
  require_matrix(ctx, op, "C", c);
  detail::require_nf4_weight(ctx, op, "W", w);
  if (a.dim(1) != w.cols)
    fail(ErrorCode::ShapeMismatch, op,
         "A is " + a.shape().str() + " but W is " + dims(w.rows, w.cols) +
             ": inner dimensions differ (A is [M,K], W is [N,K])");
  require_shape(op, "C", c, a.dim(0), w.rows, "[M,N] for A [M,K] and W [N,K]");
  require_options(op, opts);
  std::vector<Part> inputs = weight_parts("W", w);
  inputs.push_back({"A", a});
  require_disjoint(op, {"C", c}, inputs);
  if (ctx.device().is_cpu()) {
    require_cpu_path(op, opts.path);
    if (a.dim(0) == 0) return;
    return reference_backend().nf4_gemm(a, w, c, opts.alpha, opts.beta);
  }
  require_gpu_backend(op).nf4_gemm(ctx, a, w, c, opts);
}

void nf4_gemm_backward_a(const Context& ctx, const TensorView& dc, const Nf4Weight& w, const TensorView& da,
                         const Nf4GemmOptions& opts) {
  const char* op = "nf4_gemm_backward_a";
  require_matrix(ctx, op, "dC", dc);
  require_matrix(ctx, op, "dA", da);
  detail::require_nf4_weight(ctx, op, "W", w);
  if (dc.dim(1) != w.rows)
    fail(ErrorCode::ShapeMismatch, op,
         "dC is " + dc.shape().str() + " but W is " + dims(w.rows, w.cols) +
             ": inner dimensions differ (dC is [M,N], W is [N,K])");
  require_shape(op, "dA", da, dc.dim(0), w.cols, "[M,K] for dC [M,N] and W [N,K]");
  require_options(op, opts);
  std::vector<Part> inputs = weight_parts("W", w);
  inputs.push_back({"dC", dc});
  require_disjoint(op, {"dA", da}, inputs);
  if (ctx.device().is_cpu()) {
    require_cpu_path(op, opts.path);
    if (dc.dim(0) == 0) return;
    return reference_backend().nf4_gemm_backward_a(dc, w, da, opts.alpha, opts.beta);
  }
  require_gpu_backend(op).nf4_gemm_backward_a(ctx, dc, w, da, opts);
}

void nf4_gate_up(const Context& ctx, const TensorView& a, const Nf4Weight& w_gate, const Nf4Weight& w_up,
                 const GateUpOutputs& out, const Nf4GemmOptions& opts) {
  const char* op = "nf4_gate_up";
  require_matrix(ctx, op, "A", a);
  detail::require_nf4_weight(ctx, op, "w_gate", w_gate);
  detail::require_nf4_weight(ctx, op, "w_up", w_up);
  if (w_gate.rows != w_up.rows || w_gate.cols != w_up.cols)
    fail(ErrorCode::ShapeMismatch, op,
         "w_gate is " + dims(w_gate.rows, w_gate.cols) + " but w_up is " + dims(w_up.rows, w_up.cols) +
             ": both weights must have the same shape");
  if (a.dim(1) != w_gate.cols)
    fail(ErrorCode::ShapeMismatch, op,
         "A is " + a.shape().str() + " but w_gate is " + dims(w_gate.rows, w_gate.cols) +
             ": inner dimensions differ (A is [M,K], the weights [N,K])");
  const std::vector<Part> outs_all{{"gate", out.gate}, {"up", out.up}, {"h", out.h}};
  std::vector<Part> outs;
  for (const Part& p : outs_all)
    if (!p.t.empty()) outs.push_back(p);
  if (outs.empty()) fail(ErrorCode::InvalidArgument, op, "no output given: at least one of gate, up, h is needed");
  for (const Part& p : outs) {
    require_matrix(ctx, op, p.name.c_str(), p.t);
    require_shape(op, p.name.c_str(), p.t, a.dim(0), w_gate.rows, "[M,N] for A [M,K] and weights [N,K]");
  }
  require_options(op, opts);
  if (opts.beta != 0.0f && !out.h.empty())
    fail(ErrorCode::InvalidArgument, op,
         "beta is " + std::to_string(opts.beta) + " but must be 0 when h is requested (h is not accumulated)");
  std::vector<Part> inputs = weight_parts("w_gate", w_gate);
  for (Part& p : weight_parts("w_up", w_up)) inputs.push_back(std::move(p));
  inputs.push_back({"A", a});
  for (std::size_t i = 0; i < outs.size(); ++i) {
    require_disjoint(op, outs[i], inputs);
    require_disjoint(op, outs[i], std::vector<Part>(outs.begin() + static_cast<std::ptrdiff_t>(i) + 1, outs.end()));
  }
  if (ctx.device().is_cpu()) {
    require_cpu_path(op, opts.path);
    if (a.dim(0) == 0) return;
    return cpu_gate_up(a, w_gate, w_up, out, opts.alpha, opts.beta);
  }
  require_gpu_backend(op).nf4_gate_up(ctx, a, w_gate, w_up, out, opts);
}

namespace {

// The checks lora_nf4_linears and its backward share: x, the weights against x, the adapters' b_i (r_i each,
// summed into R), a [R,K] and t [M,R], the options. Returns R.
template <class P>
std::int64_t check_linears(const Context& ctx, const char* op, const TensorView& x, std::span<const P> ps,
                           const TensorView& a, const TensorView& t, const Nf4GemmOptions& opts,
                           std::vector<Part>& inputs) {
  require_matrix(ctx, op, "x", x);
  if (ps.empty()) fail(ErrorCode::InvalidArgument, op, "no projections given");
  require_options(op, opts);
  if (opts.alpha != 1.0f || opts.beta != 0.0f)
    fail(ErrorCode::InvalidArgument, op,
         "alpha " + std::to_string(opts.alpha) + " and beta " + std::to_string(opts.beta) +
             " must be 1 and 0 (each projection's beta says whether it accumulates)");
  const std::int64_t m = x.dim(0), k = x.dim(1);
  std::int64_t rank = 0;
  inputs.push_back({"x", x});
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const std::string at = "projection " + std::to_string(i);
    detail::require_nf4_weight(ctx, op, (at + " w").c_str(), ps[i].w);
    if (ps[i].w.cols != k)
      fail(ErrorCode::ShapeMismatch, op,
           "x is " + x.shape().str() + " but " + at + "'s w is " + dims(ps[i].w.rows, ps[i].w.cols) +
               ": inner dimensions differ (x is [M,K], every w [N,K])");
    for (Part& p : weight_parts(at + " w", ps[i].w)) inputs.push_back(std::move(p));
    if (!std::isfinite(ps[i].scale))
      fail(ErrorCode::InvalidArgument, op, at + "'s scale is " + std::to_string(ps[i].scale) + " but must be finite");
    if (ps[i].b.empty()) continue;
    const std::string name = at + " b";
    require_matrix(ctx, op, name.c_str(), ps[i].b);
    detail::require_same_dtype(op, name.c_str(), ps[i].b, "x", x);
    if (ps[i].b.dim(0) != ps[i].w.rows || ps[i].b.dim(1) < 1)
      fail(ErrorCode::ShapeMismatch, op,
           name + " is " + ps[i].b.shape().str() + " but must be [N,r] with r >= 1 for w " +
               dims(ps[i].w.rows, ps[i].w.cols));
    inputs.push_back({name, ps[i].b});
    rank += ps[i].b.dim(1);
  }
  if (rank > 0 || !a.empty()) {
    require_matrix(ctx, op, "a", a);
    detail::require_same_dtype(op, "a", a, "x", x);
    require_shape(op, "a", a, rank, k, "[R,K]: the adapters' A stacked, R their ranks summed");
  }
  if (rank > 0 || !t.empty()) {
    require_matrix(ctx, op, "t", t);
    detail::require_same_dtype(op, "t", t, "x", x);
    require_shape(op, "t", t, m, rank, "[M,R] for x [M,K] and R the adapters' ranks summed");
  }
  if (rank > 0) inputs.push_back({"a", a});
  return rank;
}

}  // namespace

void lora_nf4_linears(const Context& ctx, const TensorView& x, std::span<const Nf4Projection> ps, const TensorView& a,
                      const TensorView& t, const Nf4GemmOptions& opts) {
  const char* op = "lora_nf4_linears";
  std::vector<Part> inputs;
  const std::int64_t rank = check_linears(ctx, op, x, ps, a, t, opts, inputs);
  const std::int64_t m = x.dim(0);
  std::vector<Part> outs;
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const std::string name = "projection " + std::to_string(i) + " y";
    require_matrix(ctx, op, name.c_str(), ps[i].y);
    detail::require_same_dtype(op, name.c_str(), ps[i].y, "x", x);
    require_shape(op, name.c_str(), ps[i].y, m, ps[i].w.rows, "[M,N] for x [M,K] and w [N,K]");
    if (ps[i].beta != 0.0f && ps[i].beta != 1.0f)
      fail(ErrorCode::InvalidArgument, op, name + "'s beta is " + std::to_string(ps[i].beta) + " but must be 0 or 1");
    outs.push_back({name, ps[i].y});
    if (ps[i].bias.empty()) continue;
    const std::string bias = "projection " + std::to_string(i) + " bias";
    detail::require_tensor(ctx, op, bias.c_str(), ps[i].bias);
    detail::require_same_dtype(op, bias.c_str(), ps[i].bias, "x", x);
    if (ps[i].bias.rank() != 1 || ps[i].bias.dim(0) != ps[i].w.rows)
      fail(ErrorCode::ShapeMismatch, op,
           bias + " is " + ps[i].bias.shape().str() + " but must be [" + std::to_string(ps[i].w.rows) + "] for w " +
               dims(ps[i].w.rows, ps[i].w.cols));
    inputs.push_back({bias, ps[i].bias});
  }
  if (rank > 0) outs.push_back({"t", t});
  for (std::size_t i = 0; i < outs.size(); ++i) {
    require_disjoint(op, outs[i], inputs);
    require_disjoint(op, outs[i], std::vector<Part>(outs.begin() + static_cast<std::ptrdiff_t>(i) + 1, outs.end()));
  }
  if (ctx.device().is_cpu()) require_cpu_path(op, opts.path);
  if (m == 0) return;

  if (ctx.device().is_cpu()) {
    for (const Nf4Projection& p : ps) reference_backend().nf4_gemm(x, p.w, p.y, 1.0f, p.beta, p.bias);
  } else {
    std::vector<Nf4Weight> ws;
    std::vector<TensorView> ys, biases;
    std::vector<float> betas;
    for (const Nf4Projection& p : ps)
      ws.push_back(p.w), ys.push_back(p.y), betas.push_back(p.beta), biases.push_back(p.bias);
    require_gpu_backend(op).nf4_gemms(ctx, x, ws, ys, betas, biases, opts);
  }
  if (rank == 0) return;
  std::vector<LoraTerm> terms;
  for (const Nf4Projection& p : ps)
    if (!p.b.empty()) terms.push_back({p.y, p.b, p.scale});
  detail::lora_adapters_unchecked(ctx, op, x, terms, a, t);
}

void lora_nf4_linears_backward(const Context& ctx, const TensorView& x, std::span<const Nf4ProjectionGrad> ps,
                               const TensorView& a, const TensorView& t, const TensorView& dt, const TensorView& grad_a,
                               const TensorView& dx, float dx_beta, const Nf4GemmOptions& opts) {
  const char* op = "lora_nf4_linears_backward";
  std::vector<Part> inputs;
  const std::int64_t rank = check_linears(ctx, op, x, ps, a, t, opts, inputs);
  const std::int64_t m = x.dim(0), k = x.dim(1);
  if (rank > 0) inputs.push_back({"t", t});
  std::vector<Part> outs;
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const std::string at = "projection " + std::to_string(i);
    const Nf4ProjectionGrad& p = ps[i];
    if (p.dy.empty()) {
      if (!p.b.empty()) fail(ErrorCode::InvalidArgument, op, at + " has an adapter but no dy (its gradients need one)");
    } else {
      const std::string name = at + " dy";
      require_matrix(ctx, op, name.c_str(), p.dy);
      detail::require_same_dtype(op, name.c_str(), p.dy, "x", x);
      require_shape(op, name.c_str(), p.dy, m, p.w.rows, "[M,N] for x [M,K] and w [N,K]");
      inputs.push_back({name, p.dy});
    }
    if (p.b.empty()) continue;
    const std::string name = at + " grad_b";
    require_matrix(ctx, op, name.c_str(), p.grad_b);
    detail::require_dtype(op, name.c_str(), p.grad_b, {DType::F32});
    require_shape(op, name.c_str(), p.grad_b, p.b.dim(0), p.b.dim(1), "b's shape");
    outs.push_back({name, p.grad_b});
  }
  if (rank > 0) {
    require_matrix(ctx, op, "dt", dt);
    detail::require_same_dtype(op, "dt", dt, "x", x);
    require_shape(op, "dt", dt, m, rank, "t's shape");
    outs.push_back({"dt", dt});
    if (!grad_a.empty()) {
      require_matrix(ctx, op, "grad_a", grad_a);
      detail::require_dtype(op, "grad_a", grad_a, {DType::F32});
      require_shape(op, "grad_a", grad_a, rank, k, "a's shape");
      outs.push_back({"grad_a", grad_a});
    }
  }
  if (!dx.empty()) {
    require_matrix(ctx, op, "dx", dx);
    detail::require_same_dtype(op, "dx", dx, "x", x);
    require_shape(op, "dx", dx, m, k, "x's shape");
    outs.push_back({"dx", dx});
  }
  if (!std::isfinite(dx_beta))
    fail(ErrorCode::InvalidArgument, op, "dx_beta is " + std::to_string(dx_beta) + " but must be finite");
  for (std::size_t i = 0; i < outs.size(); ++i) {
    require_disjoint(op, outs[i], inputs);
    require_disjoint(op, outs[i], std::vector<Part>(outs.begin() + static_cast<std::ptrdiff_t>(i) + 1, outs.end()));
  }
  if (ctx.device().is_cpu()) require_cpu_path(op, opts.path);
  std::vector<LoraTermGrad> terms;
  for (const Nf4ProjectionGrad& p : ps)
    if (!p.b.empty()) terms.push_back({p.dy, p.b, p.scale, p.grad_b});
  if (m == 0) {  // empty sums: grad_a and every grad_b are zeros (dx and dt have no rows)
    if (rank > 0) detail::lora_adapters_backward_unchecked(ctx, op, x, terms, a, t, dt, grad_a, dx, dx_beta);
    return;
  }

  // dx = Σ dy_i·dequant(W_i) + dx_beta·dx: written by the first product present.
  bool dx_written = false;
  if (!dx.empty()) {
    std::vector<Nf4Weight> ws;
    std::vector<TensorView> dys;
    for (const Nf4ProjectionGrad& p : ps) ws.push_back(p.w), dys.push_back(p.dy);
    if (ctx.device().is_cpu()) {
      float beta = dx_beta;
      for (const Nf4ProjectionGrad& p : ps) {
        if (p.dy.empty()) continue;
        reference_backend().nf4_gemm_backward_a(p.dy, p.w, dx, 1.0f, beta);
        beta = 1.0f;
      }
    } else {
      require_gpu_backend(op).nf4_gemms_backward_a(ctx, dys, ws, dx, {1.0f, dx_beta, opts.path});
    }
    for (const Nf4ProjectionGrad& p : ps) dx_written = dx_written || !p.dy.empty();
  }
  if (rank == 0) {
    if (!dx.empty() && !dx_written) {  // no gradient reached any projection: dx = dx_beta·dx
      GemmProblem z;
      z.m = m;
      z.n = k;
      z.a = z.b = z.c = dx.data();
      z.ab_dtype = z.c_dtype = x.dtype();
      z.beta = dx_beta;
      detail::run_gemm(ctx, op, z);
    }
    return;
  }
  detail::lora_adapters_backward_unchecked(ctx, op, x, terms, a, t, dt, grad_a, dx, dx_written ? 1.0f : dx_beta);
}

}  // namespace qmm
