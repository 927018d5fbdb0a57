// Public SwiGLU entry points: validate (shapes, dtypes, devices, which aliasing is allowed), then route.
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

}  // namespace

void swiglu(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& h) {
  const char* op = "swiglu";
  const Arg G{"gate", gate}, U{"up", up}, H{"h", h};
  check_operands(ctx, op, {G, U, H});
  check_alias_allowed(op, H, G);
  check_alias_allowed(op, H, U);
  if (h.numel() == 0) return;
  if (ctx.device().is_cpu()) return reference_backend().swiglu(gate, up, h);
  require_gpu_backend(op).swiglu(ctx, gate, up, h);
}

void swiglu_backward(const Context& ctx, const TensorView& gate, const TensorView& up, const TensorView& dh,
                     const TensorView& dgate, const TensorView& dup) {
  const char* op = "swiglu_backward";
  const Arg G{"gate", gate}, U{"up", up}, DH{"dh", dh}, DG{"dgate", dgate}, DU{"dup", dup};
  check_operands(ctx, op, {G, U, DH, DG, DU});
  // dgate may be gate and dup may be up (in place); every other overlap with an output is rejected.
  check_alias_allowed(op, DG, G);
  check_alias_allowed(op, DU, U);
  detail::require_no_overlap(op, "dgate", dgate, "up", up);
  detail::require_no_overlap(op, "dgate", dgate, "dh", dh);
  detail::require_no_overlap(op, "dup", dup, "gate", gate);
  detail::require_no_overlap(op, "dup", dup, "dh", dh);
  detail::require_no_overlap(op, "dgate", dgate, "dup", dup);
  if (dgate.numel() == 0) return;
  if (ctx.device().is_cpu()) return reference_backend().swiglu_backward(gate, up, dh, dgate, dup);
  require_gpu_backend(op).swiglu_backward(ctx, gate, up, dh, dgate, dup);
}

}  // namespace qmm
