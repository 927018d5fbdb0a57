// Public entry points of the train ops (cast, add, add_bias, dropout, mse_loss, grad_norm, adamw_step, zero):
// validate every argument before anything is written, then route by the context's device.
#include "qmm/train_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/gpu_backend.h"
#include "core/reference_backend.h"
#include "core/train_math.h"
#include "core/validate.h"
#include "qmm/ops.h"

namespace qmm {
namespace {


#define QMM_TRAIN_ROUTE(ctx, op, fn, ...)                        \
  ((ctx).device().is_cpu() ? reference_backend().fn(__VA_ARGS__) \
                           : require_gpu_backend(op).fn((ctx), __VA_ARGS__))

// v with 9 significant digits, as an ostringstream of precision 9 writes it, but without iostreams: built with one,
// every qmm.rms_norm call crashed inside PyTorch's process on the GPU machine.
std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// An output may be exactly the memory of an input (each element is read before it is written), never a part of it.
void require_exact_alias_or_disjoint(const char* op, const char* out_name, const TensorView& out, const char* in_name,
                                     const TensorView& in) {
  const bool exact = out.data() == in.data() && out.nbytes() == in.nbytes();
  QMM_REQUIRE(exact || !detail::overlaps(out, in), ErrorCode::InvalidArgument, op,
              std::string(out_name) + " and " + in_name +
                  " overlap in memory without being the same tensor (only an exact in-place alias is allowed)");
}

// f32 or bf16, on the context's device, non-null.
void require_float_tensor(const Context& ctx, const char* op, const char* name, const TensorView& t) {
  detail::require_tensor(ctx, op, name, t);
  detail::require_dtype(op, name, t, {DType::F32, DType::BF16});
}

// `like`'s shape and dtype.
void require_like(const Context& ctx, const char* op, const char* name, const TensorView& t, const char* like_name,
                  const TensorView& like) {
  detail::require_tensor(ctx, op, name, t);
  detail::require_same_shape(op, name, t, like_name, like);
  detail::require_same_dtype(op, name, t, like_name, like);
}

// A one-element f32 result (loss, norm) on the context's device.
void require_scalar_output(const Context& ctx, const char* op, const char* name, const TensorView& t) {
  detail::require_tensor(ctx, op, name, t);
  detail::require_dtype(op, name, t, {DType::F32});
  QMM_REQUIRE(t.numel() == 1, ErrorCode::ShapeMismatch, op,
              std::string(name) + " must have one element but is " + t.shape().str());
}

void require_finite(const char* op, const char* name, double v) {
  QMM_REQUIRE(std::isfinite(v), ErrorCode::InvalidArgument, op,
              std::string(name) + " is " + num(v) + " but must be finite");
}

void require_in_range(const char* op, const char* name, double v, double lo, double hi, const char* range) {
  QMM_REQUIRE(v >= lo && v < hi, ErrorCode::InvalidArgument, op,
              std::string(name) + " is " + num(v) + " but must be in " + range);
}

// ---- adamw_step's per-tensor checks -----------------------------------------------------------------------------

constexpr const char* kFieldNames[] = {"param", "grad", "m", "v"};
const TensorView& field(const AdamWParam& p, int f) { return f == 0 ? p.param : f == 1 ? p.grad : f == 2 ? p.m : p.v; }
std::string field_name(std::size_t i, int f) { return "params[" + std::to_string(i) + "]." + kFieldNames[f]; }

// A byte range that the step reads (a gradient) or writes (parameter, moments, norm).
struct Range {
  std::uintptr_t begin, end;
  bool written;
  std::size_t entry;
  int field;  // 0..3 as kFieldNames; 4 = norm
};

std::string range_name(const Range& r) { return r.field == 4 ? std::string("norm") : field_name(r.entry, r.field); }

// Every overlap of a written range with any other range, found in one sweep over the ranges sorted by start:
// a range overlaps an earlier one exactly when it starts before the furthest end seen so far.
void require_no_write_overlaps(const char* op, std::vector<Range>& ranges) {
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  const Range* far_any = nullptr;      // the range reaching furthest so far
  const Range* far_written = nullptr;  // the written range reaching furthest so far
  for (const Range& r : ranges) {
    const Range* hit = r.written ? far_any : far_written;
    if (hit && r.begin < hit->end)
      detail::fail(ErrorCode::InvalidArgument, op,
                   range_name(*hit) + " and " + range_name(r) + " overlap in memory (the step writes " +
                       range_name(r.written ? r : *hit) + ")");
    if (!far_any || r.end > far_any->end) far_any = &r;
    if (r.written && (!far_written || r.end > far_written->end)) far_written = &r;
  }
}

void validate_adamw_options(const char* op, const AdamWOptions& o, int step) {
  QMM_REQUIRE(step >= 1, ErrorCode::InvalidArgument, op, "step is " + std::to_string(step) + " but counts from 1");
  require_finite(op, "opts.lr", o.lr);
  QMM_REQUIRE(o.lr >= 0, ErrorCode::InvalidArgument, op, "opts.lr is " + num(o.lr) + " but must be >= 0");
  require_in_range(op, "opts.beta1", o.beta1, 0.0, 1.0, "[0, 1)");
  require_in_range(op, "opts.beta2", o.beta2, 0.0, 1.0, "[0, 1)");
  require_finite(op, "opts.eps", o.eps);
  QMM_REQUIRE(o.eps >= 0, ErrorCode::InvalidArgument, op, "opts.eps is " + num(o.eps) + " but must be >= 0");
  require_finite(op, "opts.weight_decay", o.weight_decay);
  QMM_REQUIRE(o.weight_decay >= 0, ErrorCode::InvalidArgument, op,
              "opts.weight_decay is " + num(o.weight_decay) + " but must be >= 0");
  require_finite(op, "opts.max_grad_norm", o.max_grad_norm);
  QMM_REQUIRE(o.max_grad_norm >= 0, ErrorCode::InvalidArgument, op,
              "opts.max_grad_norm is " + num(o.max_grad_norm) + " but must be >= 0 (0: no clipping)");
}

void validate_adamw_params(const Context& ctx, const char* op, std::span<const AdamWParam> params,
                           const TensorView& norm) {
  QMM_REQUIRE(!params.empty(), ErrorCode::InvalidArgument, op, "params is empty");
  std::vector<Range> ranges;
  ranges.reserve(params.size() * 4 + 1);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const TensorView& p = params[i].param;
    for (int f = 0; f < 4; ++f) {
      const TensorView& t = field(params[i], f);
      // Names are built only when a check fails: a step over hundreds of tensors validates on every call.
      if ((t.data() == nullptr && t.numel() != 0) || !(t.device() == ctx.device()) || t.dtype() != DType::F32) {
        const std::string name = field_name(i, f);
        detail::require_tensor(ctx, op, name.c_str(), t);
        detail::require_dtype(op, name.c_str(), t, {DType::F32});
      }
      if (!(t.shape() == p.shape()))
        detail::require_same_shape(op, field_name(i, f).c_str(), t, field_name(i, 0).c_str(), p);
      if (t.numel() > 0) {
        const auto b = reinterpret_cast<std::uintptr_t>(t.data());
        ranges.push_back({b, b + t.nbytes(), f != 1, i, f});
      }
    }
  }
  if (!norm.empty()) {
    require_scalar_output(ctx, op, "norm", norm);
    const auto b = reinterpret_cast<std::uintptr_t>(norm.data());
    ranges.push_back({b, b + norm.nbytes(), true, 0, 4});
  }
  require_no_write_overlaps(op, ranges);
}

}  // namespace

void cast(const Context& ctx, const TensorView& src, const TensorView& dst) {
  const char* op = "cast";
  require_float_tensor(ctx, op, "src", src);
  require_float_tensor(ctx, op, "dst", dst);
  QMM_REQUIRE(src.numel() == dst.numel(), ErrorCode::ShapeMismatch, op,
              "dst is " + dst.shape().str() + " (" + std::to_string(dst.numel()) + " elements) but src is " +
                  src.shape().str() + " (" + std::to_string(src.numel()) + " elements)");
  require_exact_alias_or_disjoint(op, "dst", dst, "src", src);
  if (dst.numel() == 0 || (dst.data() == src.data() && dst.dtype() == src.dtype())) return;
  QMM_TRAIN_ROUTE(ctx, op, cast, std::span<const TensorView>(&src, 1), std::span<const TensorView>(&dst, 1));
}

void cast(const Context& ctx, std::span<const TensorView> src, std::span<const TensorView> dst) {
  const char* op = "cast";
  QMM_REQUIRE(src.size() == dst.size(), ErrorCode::InvalidArgument, op,
              "src has " + std::to_string(src.size()) + " tensors but dst has " + std::to_string(dst.size()));
  std::vector<TensorView> todo_src, todo_dst;
  // Argument names on the stack: a passing call allocates no string.
  auto name = [](char (&buf)[32], const char* what, std::size_t i) {
    std::snprintf(buf, sizeof buf, "%s[%zu]", what, i);
    return buf;
  };
  char s[32], d[32], other[32];
  for (std::size_t i = 0; i < src.size(); ++i) {
    name(s, "src", i);
    name(d, "dst", i);
    require_float_tensor(ctx, op, s, src[i]);
    require_float_tensor(ctx, op, d, dst[i]);
    QMM_REQUIRE(src[i].numel() == dst[i].numel(), ErrorCode::ShapeMismatch, op,
                std::string(d) + " is " + dst[i].shape().str() + " (" + std::to_string(dst[i].numel()) +
                    " elements) but " + s + " is " + src[i].shape().str() + " (" + std::to_string(src[i].numel()) +
                    " elements)");
    require_exact_alias_or_disjoint(op, d, dst[i], s, src[i]);
    for (std::size_t j = 0; j < src.size(); ++j) {
      if (j == i) continue;
      detail::require_no_overlap(op, d, dst[i], name(other, "src", j), src[j]);
      if (j < i) detail::require_no_overlap(op, d, dst[i], name(other, "dst", j), dst[j]);
    }
    if (dst[i].numel() == 0 || (dst[i].data() == src[i].data() && dst[i].dtype() == src[i].dtype())) continue;
    todo_src.push_back(src[i]);
    todo_dst.push_back(dst[i]);
  }
  if (todo_src.empty()) return;
  QMM_TRAIN_ROUTE(ctx, op, cast, std::span<const TensorView>(todo_src), std::span<const TensorView>(todo_dst));
}

void add(const Context& ctx, const TensorView& a, const TensorView& b, const TensorView& out, float alpha) {
  const char* op = "add";
  require_float_tensor(ctx, op, "a", a);
  require_like(ctx, op, "b", b, "a", a);
  require_like(ctx, op, "out", out, "a", a);
  require_finite(op, "alpha", alpha);
  require_exact_alias_or_disjoint(op, "out", out, "a", a);
  require_exact_alias_or_disjoint(op, "out", out, "b", b);
  if (out.numel() == 0) return;
  QMM_TRAIN_ROUTE(ctx, op, add, a, b, out, alpha);
}

void add_bias(const Context& ctx, const TensorView& y, const TensorView& bias) {
  const char* op = "add_bias";
  require_float_tensor(ctx, op, "y", y);
  detail::require_tensor(ctx, op, "bias", bias);
  detail::require_rank(op, "y", y, 2);
  detail::require_rank(op, "bias", bias, 1);
  if (y.dtype() == DType::F32)
    detail::require_dtype(op, "bias", bias, {DType::F32});
  else
    detail::require_dtype(op, "bias", bias, {DType::F32, DType::BF16});
  QMM_REQUIRE(bias.dim(0) == y.dim(1), ErrorCode::ShapeMismatch, op,
              "bias is " + bias.shape().str() + " but y is " + y.shape().str() + ": bias must have y's last dimension");
  detail::require_no_overlap(op, "y", y, "bias", bias);
  if (y.numel() == 0) return;
  QMM_TRAIN_ROUTE(ctx, op, add_bias, y, bias);
}

void dropout(const Context& ctx, const TensorView& x, const TensorView& out, float p, std::uint64_t seed) {
  const char* op = "dropout";
  require_float_tensor(ctx, op, "x", x);
  require_like(ctx, op, "out", out, "x", x);
  require_in_range(op, "p", p, 0.0, 1.0, "[0, 1)");
  require_exact_alias_or_disjoint(op, "out", out, "x", x);
  if (out.numel() == 0) return;
  QMM_TRAIN_ROUTE(ctx, op, dropout, x, out, p, seed);
}

bool dropout_keep(std::uint64_t seed, std::int64_t index, float p) {
  const char* op = "dropout_keep";
  require_in_range(op, "p", p, 0.0, 1.0, "[0, 1)");
  QMM_REQUIRE(index >= 0, ErrorCode::InvalidArgument, op, "index is " + std::to_string(index) + " but must be >= 0");
  return train::dropout_keep_at(train::dropout_key(seed), index, train::dropout_threshold(p));
}

void mse_loss(const Context& ctx, const TensorView& y, const TensorView& target, const TensorView& loss,
              const TensorView& dy, float scale) {
  const char* op = "mse_loss";
  require_float_tensor(ctx, op, "y", y);
  require_like(ctx, op, "target", target, "y", y);
  require_like(ctx, op, "dy", dy, "y", y);
  require_scalar_output(ctx, op, "loss", loss);
  QMM_REQUIRE(y.numel() > 0, ErrorCode::InvalidArgument, op, "y is " + y.shape().str() + ": the mean of no elements");
  require_finite(op, "scale", scale);
  require_exact_alias_or_disjoint(op, "dy", dy, "y", y);
  require_exact_alias_or_disjoint(op, "dy", dy, "target", target);
  detail::require_no_overlap(op, "loss", loss, "y", y);
  detail::require_no_overlap(op, "loss", loss, "target", target);
  detail::require_no_overlap(op, "loss", loss, "dy", dy);
  QMM_TRAIN_ROUTE(ctx, op, mse_loss, y, target, loss, dy, scale);
}

// RMSNorm's operands, forward and backward: x [T, H] (f32 or bf16), `like` (y or dy) of x's shape and dtype, w [H] of
// x's dtype, and rstd [T] f32 where given.
void require_norm_operands(const Context& ctx, const char* op, const TensorView& x, const char* like_name,
                           const TensorView& like, const TensorView& w, const TensorView& rstd) {
  require_float_tensor(ctx, op, "x", x);
  detail::require_rank(op, "x", x, 2);
  require_like(ctx, op, like_name, like, "x", x);
  detail::require_tensor(ctx, op, "w", w);
  detail::require_same_dtype(op, "w", w, "x", x);
  QMM_REQUIRE(w.rank() == 1 && w.dim(0) == x.dim(1), ErrorCode::ShapeMismatch, op,
              "w is " + w.shape().str() + " but must be [" + std::to_string(x.dim(1)) + "] (x's last dimension)");
  if (rstd.empty()) return;
  detail::require_tensor(ctx, op, "rstd", rstd);
  detail::require_dtype(op, "rstd", rstd, {DType::F32});
  QMM_REQUIRE(rstd.rank() == 1 && rstd.dim(0) == x.dim(0), ErrorCode::ShapeMismatch, op,
              "rstd is " + rstd.shape().str() + " but must be [" + std::to_string(x.dim(0)) + "] (x's rows)");
}

void rms_norm(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& y, const TensorView& rstd,
              float eps) {
  const char* op = "rms_norm";
  require_norm_operands(ctx, op, x, "y", y, w, rstd);
  QMM_REQUIRE(std::isfinite(eps) && eps >= 0.0f, ErrorCode::InvalidArgument, op,
              "eps is " + num(eps) + " but must be finite and >= 0");
  require_exact_alias_or_disjoint(op, "y", y, "x", x);
  detail::require_no_overlap(op, "y", y, "w", w);
  for (const auto& [name, in] : {std::pair<const char*, const TensorView*>{"x", &x}, {"w", &w}, {"y", &y}})
    detail::require_no_overlap(op, "rstd", rstd, name, *in);
  if (x.numel() == 0) return;
  QMM_TRAIN_ROUTE(ctx, op, rms_norm, x, TensorView{}, w, TensorView{}, y, rstd, eps);
}

void add_rms_norm(const Context& ctx, const TensorView& x, const TensorView& r, const TensorView& w,
                  const TensorView& h, const TensorView& y, const TensorView& rstd, float eps) {
  const char* op = "add_rms_norm";
  require_norm_operands(ctx, op, x, "y", y, w, rstd);
  require_like(ctx, op, "r", r, "x", x);
  require_like(ctx, op, "h", h, "x", x);
  QMM_REQUIRE(std::isfinite(eps) && eps >= 0.0f, ErrorCode::InvalidArgument, op,
              "eps is " + num(eps) + " but must be finite and >= 0");
  for (const auto& [name, out] : {std::pair<const char*, const TensorView*>{"h", &h}, {"y", &y}}) {
    require_exact_alias_or_disjoint(op, name, *out, "x", x);
    require_exact_alias_or_disjoint(op, name, *out, "r", r);
    detail::require_no_overlap(op, name, *out, "w", w);
  }
  detail::require_no_overlap(op, "y", y, "h", h);
  for (const auto& [name, in] :
       {std::pair<const char*, const TensorView*>{"x", &x}, {"r", &r}, {"w", &w}, {"h", &h}, {"y", &y}})
    detail::require_no_overlap(op, "rstd", rstd, name, *in);
  if (x.numel() == 0) return;
  QMM_TRAIN_ROUTE(ctx, op, rms_norm, x, r, w, h, y, rstd, eps);
}

void rms_norm_backward(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& rstd,
                       const TensorView& dy, const TensorView& dx, const TensorView& dw, const TensorView& dres) {
  const char* op = "rms_norm_backward";
  QMM_REQUIRE(!rstd.empty(), ErrorCode::ShapeMismatch, op,
              "rstd is missing but must be [" + std::to_string(x.rank() == 2 ? x.dim(0) : 0) + "] (the forward's)");
  require_norm_operands(ctx, op, x, "dy", dy, w, rstd);
  if (!dx.empty()) {
    require_like(ctx, op, "dx", dx, "x", x);
    require_exact_alias_or_disjoint(op, "dx", dx, "dy", dy);
    for (const auto& [name, in] : {std::pair<const char*, const TensorView*>{"x", &x}, {"w", &w}, {"rstd", &rstd}})
      detail::require_no_overlap(op, "dx", dx, name, *in);
  }
  if (!dres.empty()) {
    QMM_REQUIRE(!dx.empty(), ErrorCode::InvalidArgument, op, "dres is given but dx is not: dres is added to dx");
    require_like(ctx, op, "dres", dres, "x", x);
    require_exact_alias_or_disjoint(op, "dx", dx, "dres", dres);
  }
  if (!dw.empty()) {
    detail::require_tensor(ctx, op, "dw", dw);
    detail::require_dtype(op, "dw", dw, {DType::F32});
    QMM_REQUIRE(dw.shape() == w.shape(), ErrorCode::ShapeMismatch, op,
                "dw is " + dw.shape().str() + " but must be w's shape " + w.shape().str());
    for (const auto& [name, in] : {std::pair<const char*, const TensorView*>{"x", &x},
                                   {"w", &w},
                                   {"rstd", &rstd},
                                   {"dy", &dy},
                                   {"dx", &dx},
                                   {"dres", &dres}})
      detail::require_no_overlap(op, "dw", dw, name, *in);
  }
  if (x.numel() == 0) return;
  QMM_TRAIN_ROUTE(ctx, op, rms_norm_backward, x, w, rstd, dy, dx, dw, dres);
}

void rope(const Context& ctx, const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
          const TensorView& q_out, const TensorView& k_out, bool inverse) {
  const char* op = "rope";
  require_float_tensor(ctx, op, "q", q);
  detail::require_rank(op, "q", q, 4);
  const std::int64_t batch = q.dim(0), seq = q.dim(1), head_dim = q.dim(3);
  QMM_REQUIRE(head_dim >= 2 && head_dim % 2 == 0, ErrorCode::ShapeMismatch, op,
              "q is " + q.shape().str() + " but its head dimension D (the last) must be even and >= 2");
  require_like(ctx, op, "q_out", q_out, "q", q);
  // k is present where either of k, k_out is given (not a default view): one without the other is a caller's slip.
  const auto absent = [](const TensorView& t) { return t.rank() == 0 && t.data() == nullptr; };
  const bool has_k = !absent(k) || !absent(k_out);
  if (has_k) {
    QMM_REQUIRE(!absent(k), ErrorCode::InvalidArgument, op, "k is missing but k_out is given");
    QMM_REQUIRE(!absent(k_out), ErrorCode::InvalidArgument, op, "k_out is missing but k is given");
    detail::require_tensor(ctx, op, "k", k);
    detail::require_rank(op, "k", k, 4);
    detail::require_same_dtype(op, "k", k, "q", q);
    QMM_REQUIRE(k.dim(0) == batch && k.dim(1) == seq && k.dim(3) == head_dim, ErrorCode::ShapeMismatch, op,
                "k is " + k.shape().str() + " but q is " + q.shape().str() +
                    ": k must be [B, S, Hk, D] with q's B, S, D");
    require_like(ctx, op, "k_out", k_out, "k", k);
  }
  detail::require_tensor(ctx, op, "cos", cos);
  if (q.dtype() == DType::F32)
    detail::require_dtype(op, "cos", cos, {DType::F32});
  else
    detail::require_dtype(op, "cos", cos, {DType::F32, q.dtype()});
  const std::string cs_shape = "[1 or " + std::to_string(batch) + ", " + std::to_string(seq) + ", " +
                               std::to_string(head_dim) + "] (q's B or 1, S, D)";
  QMM_REQUIRE(cos.rank() == 3 && (cos.dim(0) == 1 || cos.dim(0) == batch) && cos.dim(1) == seq &&
                  cos.dim(2) == head_dim,
              ErrorCode::ShapeMismatch, op, "cos is " + cos.shape().str() + " but must be " + cs_shape);
  require_like(ctx, op, "sin", sin, "cos", cos);
  // Outputs: their own input exactly or disjoint; never any other argument (cos and sin may share memory: both read).
  require_exact_alias_or_disjoint(op, "q_out", q_out, "q", q);
  for (const auto& [name, in] :
       {std::pair<const char*, const TensorView*>{"k", &k}, {"k_out", &k_out}, {"cos", &cos}, {"sin", &sin}})
    detail::require_no_overlap(op, "q_out", q_out, name, *in);
  if (has_k) {
    require_exact_alias_or_disjoint(op, "k_out", k_out, "k", k);
    for (const auto& [name, in] : {std::pair<const char*, const TensorView*>{"q", &q}, {"cos", &cos}, {"sin", &sin}})
      detail::require_no_overlap(op, "k_out", k_out, name, *in);
  }
  if (q.numel() == 0 && (!has_k || k.numel() == 0)) return;  // (an absent view counts one element)
  QMM_TRAIN_ROUTE(ctx, op, rope, q, k, cos, sin, q_out, k_out, inverse);
}

CrossEntropyChunks linear_cross_entropy_chunks(std::int64_t tokens, std::int64_t hidden, std::int64_t vocab,
                                               DType dtype, bool with_dh, bool with_dw,
                                               const CrossEntropyOptions& opts) {
  const char* op = "linear_cross_entropy_chunks";
  QMM_REQUIRE(tokens >= 0, ErrorCode::InvalidArgument, op, "tokens is " + std::to_string(tokens) + ", below 0");
  QMM_REQUIRE(hidden >= 1, ErrorCode::InvalidArgument, op, "hidden is " + std::to_string(hidden) + ", below 1");
  QMM_REQUIRE(vocab >= 1, ErrorCode::InvalidArgument, op, "vocab is " + std::to_string(vocab) + ", below 1");
  QMM_REQUIRE(dtype == DType::F32 || dtype == DType::BF16, ErrorCode::DTypeMismatch, op,
              std::string("dtype is ") + dtype_name(dtype) + " but must be f32 or bf16");
  QMM_REQUIRE(opts.chunk_tokens >= 0 && opts.chunk_vocab >= 0, ErrorCode::InvalidArgument, op,
              "chunk_tokens is " + std::to_string(opts.chunk_tokens) + " and chunk_vocab " +
                  std::to_string(opts.chunk_vocab) + " but both must be >= 0");
  const std::int64_t es = static_cast<std::int64_t>(dtype_size(dtype)), t = std::max<std::int64_t>(tokens, 1);
  const auto padded = [](std::int64_t bytes) { return (bytes + 255) / 256 * 256; };
  const auto round_down = [](std::int64_t v, std::int64_t step) { return std::max(step, v / step * step); };
  CrossEntropyChunks c;
  if (with_dw) {  // the vocabulary whole: dw's rows need each token's final log-sum-exp
    c.vocab = vocab;
    c.tokens = opts.chunk_tokens > 0 ? opts.chunk_tokens
                                     : std::max<std::int64_t>(512, (std::int64_t{1} << 30) / (vocab * es) / 128 * 128);
  } else {
    // 5% of the fp32 logits, at least 32 MiB: whole rows where enough tokens' rows fit for the GEMMs to run near
    // their peak; otherwise a quarter for dh's f32 accumulator and the rest for a chunk's logits
    const std::int64_t budget = std::max<std::int64_t>(std::int64_t{32} << 20, t * vocab * 4 / 20);
    const std::int64_t whole = budget / (vocab * es);  // tokens whose whole rows fit
    if (opts.chunk_vocab >= vocab || (opts.chunk_vocab == 0 && whole >= std::min<std::int64_t>(t, 1024))) {
      c.vocab = vocab;
      c.tokens = opts.chunk_tokens > 0 ? opts.chunk_tokens : round_down(whole, 128);
    } else {
      c.tokens = opts.chunk_tokens > 0 ? opts.chunk_tokens : round_down(budget / 4 / (hidden * 4), 128);
      c.tokens = std::min(c.tokens, t);
      const std::int64_t state = (with_dh ? c.tokens * hidden * 4 : 0) + c.tokens * 16;
      c.vocab = opts.chunk_vocab > 0 ? opts.chunk_vocab
                                     : round_down(std::max<std::int64_t>(budget - state, 0) / (c.tokens * es), 128);
    }
  }
  c.tokens = std::min(c.tokens, t);
  c.vocab = std::min(c.vocab, vocab);
  // The pieces linear_cross_entropy carves from one scratch buffer, each on a 256-byte boundary: the chunk's logits,
  // every token's fp64 loss term, where the vocabulary is split the running state (dh's f32 accumulator, 16 bytes a
  // row), and 16 bytes of label counts.
  c.extra_bytes = padded(c.tokens * c.vocab * es) + padded(t * 8) + 16;
  if (c.vocab < vocab) c.extra_bytes += (with_dh ? padded(c.tokens * hidden * 4) : 0) + padded(c.tokens * 16);
  return c;
}

void linear_cross_entropy(const Context& ctx, const TensorView& h, const TensorView& w, const TensorView& labels,
                          const TensorView& loss, const TensorView& dh, const TensorView& dw,
                          const CrossEntropyOptions& opts) {
  const char* op = "linear_cross_entropy";
  require_float_tensor(ctx, op, "h", h);
  detail::require_rank(op, "h", h, 2);
  detail::require_tensor(ctx, op, "w", w);
  detail::require_rank(op, "w", w, 2);
  detail::require_same_dtype(op, "w", w, "h", h);
  const std::int64_t t = h.dim(0), hidden = h.dim(1), vocab = w.dim(0);
  QMM_REQUIRE(w.dim(1) == hidden && vocab >= 1 && hidden >= 1, ErrorCode::ShapeMismatch, op,
              "h is " + h.shape().str() + " but w is " + w.shape().str() +
                  ": w must be [V, H] with h's H, V and H >= 1");
  detail::require_tensor(ctx, op, "labels", labels);
  detail::require_dtype(op, "labels", labels, {DType::I32});
  QMM_REQUIRE(labels.rank() == 1 && labels.dim(0) == t, ErrorCode::ShapeMismatch, op,
              "labels is " + labels.shape().str() + " but must be [" + std::to_string(t) + "] (one per row of h)");
  require_scalar_output(ctx, op, "loss", loss);
  QMM_REQUIRE(opts.chunk_tokens >= 0 && opts.chunk_vocab >= 0, ErrorCode::InvalidArgument, op,
              "chunk_tokens is " + std::to_string(opts.chunk_tokens) + " and chunk_vocab " +
                  std::to_string(opts.chunk_vocab) + " but both must be >= 0");
  if (!dh.empty()) require_like(ctx, op, "dh", dh, "h", h);
  if (!dw.empty()) {
    detail::require_tensor(ctx, op, "dw", dw);
    detail::require_dtype(op, "dw", dw, {DType::F32});
    QMM_REQUIRE(dw.shape() == w.shape(), ErrorCode::ShapeMismatch, op,
                "dw is " + dw.shape().str() + " but must be w's shape " + w.shape().str());
  }
  const std::pair<const char*, const TensorView*> outputs[] = {{"loss", &loss}, {"dh", &dh}, {"dw", &dw}};
  const std::pair<const char*, const TensorView*> inputs[] = {{"h", &h}, {"w", &w}, {"labels", &labels}};
  for (const auto& [out_name, out] : outputs) {
    if (out->empty()) continue;
    for (const auto& [in_name, in] : inputs) detail::require_no_overlap(op, out_name, *out, in_name, *in);
  }
  detail::require_no_overlap(op, "dh", dh, "loss", loss);
  detail::require_no_overlap(op, "dw", dw, "loss", loss);
  detail::require_no_overlap(op, "dh", dh, "dw", dw);
  if (opts.check_labels) {  // every label in range, read on the host (a GPU's labels are copied: T * 4 bytes)
    Tensor host_labels;
    const std::int32_t* lab = labels.data_as<const std::int32_t>();
    if (!labels.device().is_cpu() && t > 0) {
      host_labels = Tensor(DType::I32, {t});
      copy(ctx, host_labels, labels);
      ctx.synchronize();
      lab = host_labels.data_as<const std::int32_t>();
    }
    for (std::int64_t i = 0; i < t; ++i)
      QMM_REQUIRE(lab[i] == opts.ignore_index || (lab[i] >= 0 && lab[i] < vocab), ErrorCode::InvalidArgument, op,
                  "labels[" + std::to_string(i) + "] is " + std::to_string(lab[i]) + " but must be in [0, " +
                      std::to_string(vocab) + ") or the ignore_index " + std::to_string(opts.ignore_index));
  }
  if (ctx.device().is_cpu())
    return reference_backend().linear_cross_entropy(h, w, labels, loss, dh, dw, opts.ignore_index,
                                                    opts.accumulate_dw);
  require_gpu_backend(op).linear_cross_entropy(ctx, h, w, labels, loss, dh, dw, opts);
}

void grad_norm(const Context& ctx, std::span<const TensorView> grads, const TensorView& norm) {
  const char* op = "grad_norm";
  QMM_REQUIRE(!grads.empty(), ErrorCode::InvalidArgument, op, "grads is empty");
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const std::string name = "grads[" + std::to_string(i) + "]";
    require_float_tensor(ctx, op, name.c_str(), grads[i]);
  }
  require_scalar_output(ctx, op, "norm", norm);
  for (std::size_t i = 0; i < grads.size(); ++i)
    if (detail::overlaps(norm, grads[i]))
      detail::require_no_overlap(op, "norm", norm, ("grads[" + std::to_string(i) + "]").c_str(), grads[i]);
  QMM_TRAIN_ROUTE(ctx, op, grad_norm, grads, norm);
}

void adamw_step(const Context& ctx, std::span<const AdamWParam> params, const AdamWOptions& opts, int step,
                const TensorView& norm) {
  const char* op = "adamw_step";
  validate_adamw_options(op, opts, step);
  validate_adamw_params(ctx, op, params, norm);
  QMM_TRAIN_ROUTE(ctx, op, adamw_step, params, opts, step, norm);
}

void zero(const Context& ctx, const TensorView& t) {
  const char* op = "zero";
  detail::require_tensor(ctx, op, "t", t);
  if (t.numel() == 0) return;
  QMM_TRAIN_ROUTE(ctx, op, zero, t);
}

#undef QMM_TRAIN_ROUTE

}  // namespace qmm
