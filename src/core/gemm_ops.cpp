// Public dense GEMM entry points: validate everything, map the variant onto one GemmProblem, route to the backend
// of the context's device.
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "core/gemm_problem.h"
#include "core/gpu_backend.h"
#include "core/reference_backend.h"
#include "core/validate.h"
#include "qmm/ops.h"
#include "qmm/train_ops.h"

namespace qmm {

const char* math_mode_name(MathMode mode) {
  switch (mode) {
    case MathMode::FP32: return "fp32";
    case MathMode::TF32: return "tf32";
    case MathMode::BF16: return "bf16";
  }
  return "?";
}

std::string GemmProblem::key() const {
  auto s = [](std::int64_t v) { return std::to_string(v); };
  return std::string("gemm|") + dtype_name(ab_dtype) + "->" + dtype_name(c_dtype) + "|" + math_mode_name(math) + "|b" +
         s(batch) + "|m" + s(m) + "|n" + s(n) + "|k" + s(k) + "|" + (trans_a ? "T" : "N") + (trans_b ? "T" : "N") +
         "|s" + s(stride_a) + "," + s(stride_b) + "," + s(stride_c) + "|ld" + s(lda()) + "," + s(ldb()) + "," +
         s(ldc()) + (bias ? "|bias" : "");
}

namespace {


struct Arg {
  const char* name;
  const TensorView& t;
};

// Checks shared by every variant that need no shape arithmetic: data, device, rank, dtypes, scalars, math mode.
void check_common(const Context& ctx, const char* op, const Arg& a, const Arg& b, const Arg& c, int rank,
                  const GemmOptions& opts) {
  for (const Arg* x : {&a, &b, &c}) detail::require_tensor(ctx, op, x->name, x->t);
  for (const Arg* x : {&a, &b, &c}) detail::require_rank(op, x->name, x->t, rank);
  detail::require_dtype(op, a.name, a.t, {DType::F32, DType::BF16});
  detail::require_same_dtype(op, a.name, a.t, b.name, b.t);
  QMM_REQUIRE(c.t.dtype() == a.t.dtype() || c.t.dtype() == DType::F32, ErrorCode::DTypeMismatch, op,
              std::string(c.name) + " is " + dtype_name(c.t.dtype()) + " but must be " + dtype_name(a.t.dtype()) +
                  (a.t.dtype() == DType::F32 ? "" : " or f32") + " (the inputs' dtype or f32)");
  QMM_REQUIRE(std::isfinite(opts.alpha), ErrorCode::InvalidArgument, op,
              "alpha is " + std::to_string(opts.alpha) + " but must be finite");
  QMM_REQUIRE(std::isfinite(opts.beta), ErrorCode::InvalidArgument, op,
              "beta is " + std::to_string(opts.beta) + " but must be finite");
  QMM_REQUIRE(opts.math == MathMode::FP32 || opts.math == MathMode::TF32 || opts.math == MathMode::BF16,
              ErrorCode::InvalidArgument, op,
              "math mode " + std::to_string(static_cast<int>(opts.math)) + " is unknown");
}

void check_output_shape(const char* op, const Arg& c, const Shape& want) {
  QMM_REQUIRE(c.t.shape() == want, ErrorCode::ShapeMismatch, op,
              std::string(c.name) + " is " + c.t.shape().str() + " but must be " + want.str());
}

void check_no_overlap(const char* op, const Arg& a, const Arg& b, const Arg& c) {
  detail::require_no_overlap(op, c.name, c.t, a.name, a.t);
  detail::require_no_overlap(op, c.name, c.t, b.name, b.t);
}

// The addend, where given: c's shape and dtype, and either c itself or memory apart from it.
void check_addend(const Context& ctx, const char* op, const Arg& c, const GemmOptions& opts) {
  const TensorView& d = opts.addend;
  if (d.empty()) return;
  detail::require_tensor(ctx, op, "addend", d);
  QMM_REQUIRE(d.shape() == c.t.shape(), ErrorCode::ShapeMismatch, op,
              "addend is " + d.shape().str() + " but must be " + c.name + "'s shape " + c.t.shape().str());
  detail::require_same_dtype(op, c.name, c.t, "addend", d);
  if (d.data() != c.t.data()) detail::require_no_overlap(op, c.name, c.t, "addend", d);
}

GemmProblem make_problem(const TensorView& a, const TensorView& b, const TensorView& c, const GemmOptions& opts) {
  GemmProblem p;
  p.a = a.data();
  p.b = b.data();
  p.c = c.data();
  p.ab_dtype = a.dtype();
  p.c_dtype = c.dtype();
  p.alpha = opts.alpha;
  p.beta = opts.beta;
  p.math = opts.math;
  if (!opts.addend.empty() && opts.addend.data() != c.data()) p.c_in = opts.addend.data();
  return p;
}

void run(const Context& ctx, const char* op, const GemmProblem& p) { detail::run_gemm(ctx, op, p); }

}  // namespace

namespace detail {

// Empty M or N: nothing to write. Empty K still runs: C = beta * C (zeros for beta = 0).
void run_gemm(const Context& ctx, const char* op, const GemmProblem& p) {
  if (p.batch == 0 || p.m == 0 || p.n == 0) return;
  if (ctx.device().is_cpu()) {
    reference_backend().gemm(p);
    return;
  }
  require_gpu_backend(op).gemm(ctx, p);
}

void lora_backward_dy_pitched(const Context& ctx, const char* op, const TensorView& dy, const TensorView& b,
                              const TensorView& t, std::int64_t ld_t, const TensorView& dt, std::int64_t ld_dt,
                              const TensorView& grad_b, float scale, MathMode math, float beta) {
  const LoraDyProblem one{dy, b, t, ld_t, dt, ld_dt, grad_b, scale, beta};
  if (ctx.device().is_cuda() && require_gpu_backend(op).lora_backward_dy(ctx, std::span(&one, 1))) return;
  const std::int64_t m = dy.dim(0), n = dy.dim(1), r = b.dim(1);
  GemmProblem p = make_problem(dy, b, dt, {scale, 0.0f, math});  // dt = scale·dy·b
  p.m = m;
  p.n = r;
  p.k = n;
  p.pitch_c = ld_dt == r ? 0 : ld_dt;
  run_gemm(ctx, op, p);
  GemmProblem q = make_problem(dy, t, grad_b, {scale, beta, math});  // grad_b = scale·dyᵀ·t + beta·grad_b
  q.m = n;
  q.n = r;
  q.k = m;
  q.trans_a = true;
  q.pitch_b = ld_t == r ? 0 : ld_t;
  run_gemm(ctx, op, q);
}

namespace {

// Columns col.. (r of them) of m [rows, R] as a [rows, r] view; its rows lie R apart, which callers pass as the pitch.
TensorView columns(const TensorView& m, std::int64_t col, std::int64_t r) {
  return TensorView(static_cast<char*>(m.data()) + col * static_cast<std::int64_t>(dtype_size(m.dtype())), m.dtype(),
                    {m.dim(0), r}, m.device());
}

}  // namespace

void lora_adapters_unchecked(const Context& ctx, const char* op, const TensorView& x, std::span<const LoraTerm> terms,
                             const TensorView& a, const TensorView& t) {
  const std::int64_t m = x.dim(0), rank = a.dim(0);
  if (m == 0) return;
  GemmProblem first = make_problem(x, a, t, {});  // t = x·aᵀ
  first.m = m;
  first.n = rank;
  first.k = x.dim(1);
  first.trans_b = true;
  run_gemm(ctx, op, first);
  std::int64_t col = 0;
  for (const LoraTerm& term : terms) {  // y_i += scale_i·t_i·b_iᵀ
    const std::int64_t r = term.b.dim(1);
    GemmProblem p = make_problem(columns(t, col, r), term.b, term.y, {term.scale, 1.0f});
    p.m = m;
    p.n = term.b.dim(0);
    p.k = r;
    p.trans_b = true;
    p.pitch_a = r == rank ? 0 : rank;
    run_gemm(ctx, op, p);
    col += r;
  }
}

void lora_adapters_backward_unchecked(const Context& ctx, const char* op, const TensorView& x,
                                      std::span<const LoraTermGrad> terms, const TensorView& a, const TensorView& t,
                                      const TensorView& dt, const TensorView& grad_a, const TensorView& dx,
                                      float dx_beta) {
  const std::int64_t m = x.dim(0), k = x.dim(1), rank = a.dim(0);
  if (m == 0) {  // empty sums over M
    for (const LoraTermGrad& term : terms) zero(ctx, term.grad_b);
    if (!grad_a.empty()) zero(ctx, grad_a);
    return;
  }
  // dt_i and grad_b_i from one read of dy_i; on a GPU every adapter's in one launch where the kernel takes them all
  std::vector<LoraDyProblem> each;
  std::int64_t col = 0;
  for (const LoraTermGrad& term : terms) {
    const std::int64_t r = term.b.dim(1);
    each.push_back(
        {term.dy, term.b, columns(t, col, r), rank, columns(dt, col, r), rank, term.grad_b, term.scale, 0.0f});
    col += r;
  }
  if (!(ctx.device().is_cuda() && each.size() > 1 && require_gpu_backend(op).lora_backward_dy(ctx, each)))
    for (const LoraDyProblem& d : each)
      lora_backward_dy_pitched(ctx, op, d.dy, d.b, d.t, d.ld_t, d.dt, d.ld_dt, d.grad_b, d.scale, MathMode::FP32,
                               d.beta);
  if (!grad_a.empty()) {  // grad_a = dtᵀ·x
    GemmProblem g = make_problem(dt, x, grad_a, {});
    g.m = rank;
    g.n = k;
    g.k = m;
    g.trans_a = true;
    run_gemm(ctx, op, g);
  }
  if (!dx.empty()) {  // dx = dt·a + dx_beta·dx
    GemmProblem d = make_problem(dt, a, dx, {1.0f, dx_beta});
    d.m = m;
    d.n = k;
    d.k = rank;
    run_gemm(ctx, op, d);
  }
}

}  // namespace detail

namespace {

// What lora_adapters and its backward check of x, the adapters' b (R = their ranks summed), a and t; returns R.
template <class Term>
std::int64_t check_adapters(const Context& ctx, const char* op, const TensorView& x, std::span<const Term> terms,
                            const TensorView& a, const TensorView& t) {
  const Arg X{"x", x}, A{"a", a}, T{"t", t};
  for (const Arg* v : {&X, &A, &T}) {
    detail::require_tensor(ctx, op, v->name, v->t);
    detail::require_rank(op, v->name, v->t, 2);
  }
  detail::require_dtype(op, "x", x, {DType::F32, DType::BF16});
  detail::require_same_dtype(op, "a", a, "x", x);
  detail::require_same_dtype(op, "t", t, "x", x);
  QMM_REQUIRE(!terms.empty(), ErrorCode::InvalidArgument, op, "no adapters given");
  std::int64_t rank = 0;
  for (std::size_t i = 0; i < terms.size(); ++i) {
    const std::string name = "b[" + std::to_string(i) + "]";
    detail::require_tensor(ctx, op, name.c_str(), terms[i].b);
    detail::require_rank(op, name.c_str(), terms[i].b, 2);
    detail::require_same_dtype(op, name.c_str(), terms[i].b, "x", x);
    QMM_REQUIRE(terms[i].b.dim(1) >= 1, ErrorCode::ShapeMismatch, op,
                name + " is " + terms[i].b.shape().str() + " but must be [N,r] with r >= 1");
    QMM_REQUIRE(std::isfinite(terms[i].scale), ErrorCode::InvalidArgument, op,
                "scale[" + std::to_string(i) + "] is " + std::to_string(terms[i].scale) + " but must be finite");
    rank += terms[i].b.dim(1);
  }
  check_output_shape(op, A, {rank, x.dim(1)});
  return rank;
}

}  // namespace

void gemm(const Context& ctx, const TensorView& a, const TensorView& b, const TensorView& c,
          const GemmOptions& opts) {
  const char* op = "gemm";
  const Arg A{"A", a}, B{"B", b}, C{"C", c};
  check_common(ctx, op, A, B, C, 2, opts);
  QMM_REQUIRE(a.dim(1) == b.dim(0), ErrorCode::ShapeMismatch, op,
              "A is " + a.shape().str() + " but B is " + b.shape().str() + ": inner dimensions differ");
  check_output_shape(op, C, {a.dim(0), b.dim(1)});
  check_no_overlap(op, A, B, C);
  check_addend(ctx, op, C, opts);
  GemmProblem p = make_problem(a, b, c, opts);
  p.m = a.dim(0);
  p.n = b.dim(1);
  p.k = a.dim(1);
  run(ctx, op, p);
}

void gemm_bt(const Context& ctx, const TensorView& a, const TensorView& b, const TensorView& c,
             const GemmOptions& opts) {
  const char* op = "gemm_bt";
  const Arg A{"A", a}, B{"B", b}, C{"C", c};
  check_common(ctx, op, A, B, C, 2, opts);
  QMM_REQUIRE(a.dim(1) == b.dim(1), ErrorCode::ShapeMismatch, op,
              "A is " + a.shape().str() + " but B is " + b.shape().str() +
                  ": inner dimensions differ (B is [N,K], its last dimension must equal A's)");
  check_output_shape(op, C, {a.dim(0), b.dim(0)});
  check_no_overlap(op, A, B, C);
  check_addend(ctx, op, C, opts);
  GemmProblem p = make_problem(a, b, c, opts);
  p.m = a.dim(0);
  p.n = b.dim(0);
  p.k = a.dim(1);
  p.trans_b = true;
  run(ctx, op, p);
}

void gemm_backward_a(const Context& ctx, const TensorView& dc, const TensorView& b, const TensorView& da,
                     const GemmOptions& opts) {
  const char* op = "gemm_backward_a";
  const Arg DC{"dC", dc}, B{"B", b}, DA{"dA", da};
  check_common(ctx, op, DC, B, DA, 2, opts);
  // dA[M,K] = dC[M,N] * B[K,N]^T: the contraction runs over N.
  QMM_REQUIRE(dc.dim(1) == b.dim(1), ErrorCode::ShapeMismatch, op,
              "dC is " + dc.shape().str() + " but B is " + b.shape().str() +
                  ": inner dimensions differ (dC is [M,N], B is [K,N]; their N must agree)");
  check_output_shape(op, DA, {dc.dim(0), b.dim(0)});
  check_no_overlap(op, DC, B, DA);
  check_addend(ctx, op, DA, opts);
  GemmProblem p = make_problem(dc, b, da, opts);
  p.m = dc.dim(0);
  p.n = b.dim(0);
  p.k = dc.dim(1);
  p.trans_b = true;  // B [K,N] is op(B)^T for op(B) [N,K]
  run(ctx, op, p);
}

void gemm_backward_b(const Context& ctx, const TensorView& a, const TensorView& dc, const TensorView& db,
                     const GemmOptions& opts) {
  const char* op = "gemm_backward_b";
  const Arg A{"A", a}, DC{"dC", dc}, DB{"dB", db};
  check_common(ctx, op, A, DC, DB, 2, opts);
  // dB[K,N] = A[M,K]^T * dC[M,N]: the contraction runs over M.
  QMM_REQUIRE(a.dim(0) == dc.dim(0), ErrorCode::ShapeMismatch, op,
              "A is " + a.shape().str() + " but dC is " + dc.shape().str() +
                  ": inner dimensions differ (A is [M,K], dC is [M,N]; their M must agree)");
  check_output_shape(op, DB, {a.dim(1), dc.dim(1)});
  check_no_overlap(op, A, DC, DB);
  check_addend(ctx, op, DB, opts);
  GemmProblem p = make_problem(a, dc, db, opts);
  p.m = a.dim(1);
  p.n = dc.dim(1);
  p.k = a.dim(0);
  p.trans_a = true;  // A [M,K] stored is op(A)^T for op(A) [K,M]
  run(ctx, op, p);
}

void lora_backward_dy(const Context& ctx, const TensorView& dy, const TensorView& b, const TensorView& t,
                      const TensorView& dt, const TensorView& grad_b, float scale, MathMode math, float beta) {
  const char* op = "lora_backward_dy";
  const Arg DY{"dy", dy}, B{"b", b}, T{"t", t}, DT{"dt", dt}, GB{"grad_b", grad_b};
  for (const Arg* x : {&DY, &B, &T, &DT, &GB}) detail::require_tensor(ctx, op, x->name, x->t);
  for (const Arg* x : {&DY, &B, &T, &DT, &GB}) detail::require_rank(op, x->name, x->t, 2);
  detail::require_dtype(op, "dy", dy, {DType::F32, DType::BF16});
  for (const Arg* x : {&B, &T, &DT}) detail::require_same_dtype(op, x->name, x->t, "dy", dy);
  detail::require_dtype(op, "grad_b", grad_b, {DType::F32});
  const std::int64_t m = dy.dim(0), n = dy.dim(1), r = b.dim(1);
  QMM_REQUIRE(b.dim(0) == n, ErrorCode::ShapeMismatch, op,
              "dy is " + dy.shape().str() + " but b is " + b.shape().str() + ": b must be [N,r] with dy's N");
  check_output_shape(op, T, {m, r});
  check_output_shape(op, DT, {m, r});
  check_output_shape(op, GB, {n, r});
  QMM_REQUIRE(std::isfinite(scale), ErrorCode::InvalidArgument, op,
              "scale is " + std::to_string(scale) + " but must be finite");
  QMM_REQUIRE(std::isfinite(beta), ErrorCode::InvalidArgument, op,
              "beta is " + std::to_string(beta) + " but must be finite");
  QMM_REQUIRE(math == MathMode::FP32 || math == MathMode::TF32 || math == MathMode::BF16, ErrorCode::InvalidArgument,
              op, "math mode " + std::to_string(static_cast<int>(math)) + " is unknown");
  for (const Arg* out : {&DT, &GB})
    for (const Arg* in : {&DY, &B, &T}) detail::require_no_overlap(op, out->name, out->t, in->name, in->t);
  detail::require_no_overlap(op, "dt", dt, "grad_b", grad_b);
  detail::lora_backward_dy_pitched(ctx, op, dy, b, t, r, dt, r, grad_b, scale, math, beta);
}

void lora_adapters(const Context& ctx, const TensorView& x, std::span<const LoraTerm> terms, const TensorView& a,
                   const TensorView& t) {
  const char* op = "lora_adapters";
  const std::int64_t rank = check_adapters(ctx, op, x, terms, a, t);
  check_output_shape(op, {"t", t}, {x.dim(0), rank});
  std::vector<Arg> outs{{"t", t}};
  std::vector<std::string> names;
  for (std::size_t i = 0; i < terms.size(); ++i) names.push_back("y[" + std::to_string(i) + "]");
  for (std::size_t i = 0; i < terms.size(); ++i) {
    const Arg Y{names[i].c_str(), terms[i].y};
    detail::require_tensor(ctx, op, Y.name, Y.t);
    detail::require_rank(op, Y.name, Y.t, 2);
    detail::require_same_dtype(op, Y.name, Y.t, "x", x);
    check_output_shape(op, Y, {x.dim(0), terms[i].b.dim(0)});
    outs.push_back(Y);
  }
  for (std::size_t i = 0; i < outs.size(); ++i) {
    for (const Arg& in : {Arg{"x", x}, Arg{"a", a}})
      detail::require_no_overlap(op, outs[i].name, outs[i].t, in.name, in.t);
    for (std::size_t j = 0; j < terms.size(); ++j)
      detail::require_no_overlap(op, outs[i].name, outs[i].t, "b", terms[j].b);
    for (std::size_t j = i + 1; j < outs.size(); ++j)
      detail::require_no_overlap(op, outs[i].name, outs[i].t, outs[j].name, outs[j].t);
  }
  detail::lora_adapters_unchecked(ctx, op, x, terms, a, t);
}

void lora_adapters_backward(const Context& ctx, const TensorView& x, std::span<const LoraTermGrad> terms,
                            const TensorView& a, const TensorView& t, const TensorView& dt, const TensorView& grad_a,
                            const TensorView& dx, float dx_beta) {
  const char* op = "lora_adapters_backward";
  const std::int64_t rank = check_adapters(ctx, op, x, terms, a, t);
  const std::int64_t m = x.dim(0), k = x.dim(1);
  check_output_shape(op, {"t", t}, {m, rank});
  QMM_REQUIRE(std::isfinite(dx_beta), ErrorCode::InvalidArgument, op,
              "dx_beta is " + std::to_string(dx_beta) + " but must be finite");
  std::vector<Arg> ins{{"x", x}, {"a", a}, {"t", t}}, outs{{"dt", dt}};
  std::vector<std::string> dy_names, gb_names;  // kept alive for the Args that point at them
  for (std::size_t i = 0; i < terms.size(); ++i) {
    dy_names.push_back("dy[" + std::to_string(i) + "]");
    gb_names.push_back("grad_b[" + std::to_string(i) + "]");
  }
  for (std::size_t i = 0; i < terms.size(); ++i) {
    const Arg DY{dy_names[i].c_str(), terms[i].dy}, GB{gb_names[i].c_str(), terms[i].grad_b};
    for (const Arg* v : {&DY, &GB}) {
      detail::require_tensor(ctx, op, v->name, v->t);
      detail::require_rank(op, v->name, v->t, 2);
    }
    detail::require_same_dtype(op, DY.name, DY.t, "x", x);
    detail::require_dtype(op, GB.name, GB.t, {DType::F32});
    check_output_shape(op, DY, {m, terms[i].b.dim(0)});
    check_output_shape(op, GB, {terms[i].b.dim(0), terms[i].b.dim(1)});
    ins.push_back(DY);
    ins.push_back({"b", terms[i].b});
    outs.push_back(GB);
  }
  detail::require_tensor(ctx, op, "dt", dt);
  detail::require_rank(op, "dt", dt, 2);
  detail::require_same_dtype(op, "dt", dt, "x", x);
  check_output_shape(op, {"dt", dt}, {m, rank});
  if (!grad_a.empty()) {
    detail::require_tensor(ctx, op, "grad_a", grad_a);
    detail::require_rank(op, "grad_a", grad_a, 2);
    detail::require_dtype(op, "grad_a", grad_a, {DType::F32});
    check_output_shape(op, {"grad_a", grad_a}, {rank, k});
    outs.push_back({"grad_a", grad_a});
  }
  if (!dx.empty()) {
    detail::require_tensor(ctx, op, "dx", dx);
    detail::require_rank(op, "dx", dx, 2);
    detail::require_same_dtype(op, "dx", dx, "x", x);
    check_output_shape(op, {"dx", dx}, {m, k});
    outs.push_back({"dx", dx});
  }
  for (std::size_t i = 0; i < outs.size(); ++i) {
    for (const Arg& in : ins) detail::require_no_overlap(op, outs[i].name, outs[i].t, in.name, in.t);
    for (std::size_t j = i + 1; j < outs.size(); ++j)
      detail::require_no_overlap(op, outs[i].name, outs[i].t, outs[j].name, outs[j].t);
  }
  detail::lora_adapters_backward_unchecked(ctx, op, x, terms, a, t, dt, grad_a, dx, dx_beta);
}

void batched_gemm(const Context& ctx, const TensorView& a, const TensorView& b, const TensorView& c,
                  bool transpose_b, const GemmOptions& opts) {
  const char* op = "batched_gemm";
  const Arg A{"A", a}, B{"B", b}, C{"C", c};
  check_common(ctx, op, A, B, C, 4, opts);
  QMM_REQUIRE(a.dim(0) == b.dim(0) && a.dim(1) == b.dim(1), ErrorCode::ShapeMismatch, op,
              "A is " + a.shape().str() + " but B is " + b.shape().str() + ": batch dimensions [b,h] differ");
  const std::int64_t m = a.dim(2), k = a.dim(3);
  const std::int64_t bk = transpose_b ? b.dim(3) : b.dim(2), n = transpose_b ? b.dim(2) : b.dim(3);
  QMM_REQUIRE(k == bk, ErrorCode::ShapeMismatch, op,
              "A is " + a.shape().str() + " but B is " + b.shape().str() + ": inner dimensions differ" +
                  (transpose_b ? " (transpose_b: B is [b,h,n,k])" : " (B is [b,h,k,n])"));
  check_output_shape(op, C, {a.dim(0), a.dim(1), m, n});
  check_no_overlap(op, A, B, C);
  check_addend(ctx, op, C, opts);
  GemmProblem p = make_problem(a, b, c, opts);
  p.batch = a.dim(0) * a.dim(1);
  p.m = m;
  p.n = n;
  p.k = k;
  p.trans_b = transpose_b;
  p.stride_a = m * k;
  p.stride_b = k * n;
  p.stride_c = m * n;
  run(ctx, op, p);
}

}  // namespace qmm
