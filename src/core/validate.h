// Argument checks shared by every public entry point. Each throws qmm::Error with "op: message".
#pragma once

#include <initializer_list>
#include <string>

#include "qmm/context.h"
#include "qmm/error.h"
#include "qmm/nf4.h"
#include "qmm/tensor.h"

namespace qmm::detail {

[[noreturn]] void fail(ErrorCode code, const char* op, const std::string& message);


// Data non-null (unless the tensor has no elements), on the context's device.
void require_tensor(const Context& ctx, const char* op, const char* name, const TensorView& t);
// The same against a device rather than a context's.
void require_tensor(Device device, const char* op, const char* name, const TensorView& t);
void require_rank(const char* op, const char* name, const TensorView& t, int rank);
void require_dtype(const char* op, const char* name, const TensorView& t, std::initializer_list<DType> allowed);
void require_same_dtype(const char* op, const char* name_a, const TensorView& a, const char* name_b,
                        const TensorView& b);
void require_same_shape(const char* op, const char* name_a, const TensorView& a, const char* name_b,
                        const TensorView& b);
// Checks every field of an NF4 weight: shapes, dtypes, devices, block size, double-quantization fields.
void require_nf4_weight(const Context& ctx, const char* op, const char* name, const Nf4Weight& w);
void require_nf4_weight(Device device, const char* op, const char* name, const Nf4Weight& w);
// Two views whose byte ranges overlap (used to reject outputs aliasing inputs where that is not allowed).
bool overlaps(const TensorView& a, const TensorView& b);
void require_no_overlap(const char* op, const char* name_a, const TensorView& a, const char* name_b,
                        const TensorView& b);

}  // namespace qmm::detail

// Throws qmm::Error(code, "op: message") unless `ok`. A macro so that the message, often built from shapes and
// numbers, is made only when the check fails: a call that passes its checks builds no string.
#define QMM_REQUIRE(ok, code, op, message)                          \
  do {                                                              \
    if (!(ok)) ::qmm::detail::fail((code), (op), (message));        \
  } while (false)
