// Public SwiGLU entry points: validate (shapes, dtypes, devices, which aliasing is allowed), then route.
#include <cmath>
#include <cstdint>
#include <string>

#include "core/gpu_backend.h"
#include "core/reference_backend.h"
#include "core/validate.h"
#include "qmm/ops.h"

namespace qmm {
namespace {


struct Arg {
  const char* name;
  const TensorView& t;
};

bool same_memory(const TensorView& a, const TensorView& b) { return a.data() == b.data() && a.nbytes() == b.nbytes(); }

// All tensors: valid data on ctx's device, f32 or bf16, the shape and dtype of the first.
void check_operands(const Context& ctx, const char* op, std::initializer_list<Arg> args) {
  for (const Arg& x : args) detail::require_tensor(ctx, op, x.name, x.t);
  const Arg& first = *args.begin();
  detail::require_dtype(op, first.name, first.t, {DType::F32, DType::BF16});
  for (const Arg& x : args) {
    detail::require_same_shape(op, first.name, first.t, x.name, x.t);
    detail::require_same_dtype(op, first.name, first.t, x.name, x.t);
  }
}

// An output may be exactly the memory of `input` (in place, element i reads then writes index i), never a part.
void check_alias_allowed(const char* op, const Arg& out, const Arg& input) {
  QMM_REQUIRE(!detail::overlaps(out.t, input.t) || same_memory(out.t, input.t), ErrorCode::InvalidArgument, op,
              std::string(out.name) + " and " + input.name +
                  " overlap in memory without being the same tensor (only an exact in-place alias is allowed)");
}

// The adapters' operands against gate [M, N] (SwiGluAdapters in ops.h), and none of them overlapping an output.
// The dh term belongs to the backward only.
void check_adapters(const Context& ctx, const char* op, const TensorView& gate, const SwiGluAdapters& ad, bool backward,
                    std::initializer_list<Arg> outputs) {
  if (ad.empty()) return;
  detail::require_rank(op, "gate", gate, 2);
  const std::int64_t m = gate.dim(0), n = gate.dim(1);
  const auto require_matrix = [&](const Arg& x) {
    detail::require_tensor(ctx, op, x.name, x.t);
    detail::require_rank(op, x.name, x.t, 2);
    detail::require_same_dtype(op, x.name, x.t, "gate", gate);
  };
  for (const Arg& b : {Arg{"adapters.b_gate", ad.b_gate}, Arg{"adapters.b_up", ad.b_up}}) {
    if (b.t.empty()) continue;
    require_matrix(b);
    QMM_REQUIRE(b.t.dim(0) == n && b.t.dim(1) >= 1, ErrorCode::ShapeMismatch, op,
                std::string(b.name) + " is " + b.t.shape().str() +
                    " but must be [N, r] with gate's N = " + std::to_string(n) + " and r >= 1");
  }
  const std::int64_t r_gate = ad.b_gate.empty() ? 0 : ad.b_gate.dim(1), r_up = ad.b_up.empty() ? 0 : ad.b_up.dim(1);
  const bool up_apart = !ad.t_up.empty();
  const std::int64_t ranks = r_gate + (up_apart ? 0 : r_up);  // t's columns
  if (up_apart) {
    QMM_REQUIRE(!ad.b_up.empty(), ErrorCode::InvalidArgument, op,
                "adapters.t_up is given but adapters.b_up is empty: t_up is up's t, for up's term");
    require_matrix({"adapters.t_up", ad.t_up});
    QMM_REQUIRE(ad.t_up.dim(0) == m && ad.t_up.dim(1) >= r_up, ErrorCode::ShapeMismatch, op,
                "adapters.t_up is " + ad.t_up.shape().str() + " but must be [M, R] with gate's M = " +
                    std::to_string(m) + " and R >= up's rank " + std::to_string(r_up));
  }
  if (ranks > 0) {
    require_matrix({"adapters.t", ad.t});
    QMM_REQUIRE(ad.t.dim(0) == m && ad.t.dim(1) >= ranks, ErrorCode::ShapeMismatch, op,
                "adapters.t is " + ad.t.shape().str() + " but must be [M, R] with gate's M = " + std::to_string(m) +
                    (up_apart ? " and R >= gate's rank " : " and R >= the two ranks' sum ") + std::to_string(ranks));
  }
  QMM_REQUIRE(std::isfinite(ad.gate_scale) && std::isfinite(ad.up_scale), ErrorCode::InvalidArgument, op,
              "adapters' scales are " + std::to_string(ad.gate_scale) + " and " + std::to_string(ad.up_scale) +
                  " but must be finite");
  if (!ad.dh_a.empty() || !ad.dh_t.empty()) {
    QMM_REQUIRE(backward, ErrorCode::InvalidArgument, op,
                "adapters.dh_t and adapters.dh_a are the backward's (dh's term); the forward has no dh");
    require_matrix({"adapters.dh_t", ad.dh_t});
    require_matrix({"adapters.dh_a", ad.dh_a});
    const std::int64_t r = ad.dh_a.dim(0);
    QMM_REQUIRE(r >= 1 && ad.dh_a.dim(1) == n && ad.dh_t.dim(0) == m && ad.dh_t.dim(1) == r, ErrorCode::ShapeMismatch,
                op,
                "adapters.dh_t is " + ad.dh_t.shape().str() + " and adapters.dh_a " + ad.dh_a.shape().str() +
                    " but must be [M, r] and [r, N] with gate's M = " + std::to_string(m) +
                    ", N = " + std::to_string(n) + " and r >= 1");
  }
  for (const Arg& out : outputs)
    for (const Arg& in : {Arg{"adapters.t", ad.t}, Arg{"adapters.t_up", ad.t_up}, Arg{"adapters.b_gate", ad.b_gate},
                          Arg{"adapters.b_up", ad.b_up}, Arg{"adapters.dh_t", ad.dh_t}, Arg{"adapters.dh_a", ad.dh_a}})
      if (!in.t.empty()) detail::require_no_overlap(op, out.name, out.t, in.name, in.t);
}

}  // namespace

void swiglu(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& h,
            const SwiGluAdapters& adapters) {
  const char* op = "swiglu";
  const Arg G{"gate", gate}, U{"up", up}, H{"h", h};
  check_operands(ctx, op, {G, U, H});
  check_alias_allowed(op, H, G);
  check_alias_allowed(op, H, U);
  check_adapters(ctx, op, gate, adapters, false, {H});
  if (h.numel() == 0) return;
  if (ctx.device().is_cpu()) return reference_backend().swiglu(gate, up, h, adapters);
  require_gpu_backend(op).swiglu(ctx, gate, up, h, adapters);
}

void swiglu_backward(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
                     const TensorView& dgate, const TensorView& dup, const SwiGluAdapters& adapters,
                     const TensorView& h) {
  const char* op = "swiglu_backward";
  const Arg G{"gate", gate}, U{"up", up}, DH{"dh", dh}, DG{"dgate", dgate}, DU{"dup", dup}, H{"h", h};
  check_operands(ctx, op, {G, U, DH, DG, DU});
  // dgate may be gate and dup may be up (in place); every other overlap with an output is rejected.
  check_alias_allowed(op, DG, G);
  check_alias_allowed(op, DU, U);
  detail::require_no_overlap(op, "dgate", dgate, "up", up);
  detail::require_no_overlap(op, "dgate", dgate, "dh", dh);
  detail::require_no_overlap(op, "dup", dup, "gate", gate);
  detail::require_no_overlap(op, "dup", dup, "dh", dh);
  detail::require_no_overlap(op, "dgate", dgate, "dup", dup);
  if (!h.empty()) {
    detail::require_rank(op, "gate", gate, 2);
    check_operands(ctx, op, {G, H});
    for (const Arg& other : {G, U, DH, DG, DU}) detail::require_no_overlap(op, "h", h, other.name, other.t);
  }
  check_adapters(ctx, op, gate, adapters, true, {DG, DU, H});
  if (dgate.numel() == 0) return;
  if (ctx.device().is_cpu()) return reference_backend().swiglu_backward(gate, up, dh, dgate, dup, adapters, h);
  require_gpu_backend(op).swiglu_backward(ctx, gate, up, dh, dgate, dup, adapters, h);
}

}  // namespace qmm
