// The `qmm._qmm` extension: qmm's ops on DLPack tensors (PyTorch, NumPy, ...) in place, without copies.
// This layer only converts arguments; python/qmm/__init__.py allocates outputs and adds autograd. Every check that
// the library makes stays the library's: an op's qmm::Error reaches Python as qmm.Error with its code.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/nf4_forced.h"
#include "qmm/checkpoint.h"
#include "qmm/qmm.h"

namespace nb = nanobind;

namespace {

using In = nb::ndarray<nb::ro>;  // read-only arrays (NumPy's may be) are fine as inputs
using Out = nb::ndarray<>;

[[noreturn]] void fail(qmm::ErrorCode code, const char* op, const std::string& what) {
  throw qmm::Error(code, std::string(op) + ": " + what);
}

qmm::DType dtype_of(const nb::dlpack::dtype& t, const char* op, const char* name) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == static_cast<std::uint8_t>(Code::Float) && t.bits == 32) return qmm::DType::F32;
    if (t.code == static_cast<std::uint8_t>(Code::Bfloat) && t.bits == 16) return qmm::DType::BF16;
    if (t.code == static_cast<std::uint8_t>(Code::Float) && t.bits == 16) return qmm::DType::F16;
    if (t.code == static_cast<std::uint8_t>(Code::UInt) && t.bits == 8) return qmm::DType::U8;
    if (t.code == static_cast<std::uint8_t>(Code::Int) && t.bits == 32) return qmm::DType::I32;
  }
  fail(qmm::ErrorCode::DTypeMismatch, op,
       std::string("argument '") + name + "' has a dtype qmm does not take (code " + std::to_string(t.code) +
           ", " + std::to_string(t.bits) + " bits; qmm takes float32, bfloat16, float16, uint8 and int32)");
}

// A real address on `device` for arrays without elements, whose data pointer frameworks leave null: qmm's ops take
// a view with null data as an argument not given (TensorView::empty), and a tensor of M = 0 rows is a given one
// (an adapter's t in a backward over no tokens: its gradients are zeros, not left unwritten). Never read or written.
void* no_elements_at(const qmm::Device& device) {
  static std::mutex mutex;
  // One small allocation per device, never freed (not even at exit, when the CUDA runtime may be gone).
  static auto* held = new std::map<std::pair<bool, int>, qmm::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  const std::pair<bool, int> key{device.is_cpu(), device.index};
  auto it = held->find(key);
  if (it == held->end()) it = held->emplace(key, qmm::Tensor(qmm::DType::U8, {256}, device)).first;
  return it->second.data();
}

// A TensorView of a dense row-major array. Strided arrays are refused rather than copied: an output written into a
// copy would be lost, and a silent copy of an input hides a cost.
template <class Array>
qmm::TensorView view_of(const Array& a, const char* op, const char* name) {
  const int rank = static_cast<int>(a.ndim());
  if (rank > qmm::kMaxRank)
    fail(qmm::ErrorCode::ShapeMismatch, op,
         std::string("argument '") + name + "' has rank " + std::to_string(rank) + " (at most 4)");
  qmm::Shape shape;
  shape.rank = rank;
  bool empty = false;  // an empty tensor holds no element: any strides describe it, and qmm reads none
  for (int i = 0; i < rank; ++i) {
    shape.dims[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(a.shape(static_cast<std::size_t>(i)));
    empty = empty || shape.dims[static_cast<std::size_t>(i)] == 0;
  }
  std::int64_t expected = 1;
  for (int i = rank - 1; i >= 0 && !empty; --i) {
    const std::int64_t extent = shape.dims[static_cast<std::size_t>(i)];
    if (extent > 1 && a.stride(static_cast<std::size_t>(i)) != expected)
      fail(qmm::ErrorCode::InvalidArgument, op,
           std::string("argument '") + name + "' is not contiguous (qmm takes dense row-major tensors)");
    expected *= extent;
  }
  qmm::Device device;
  if (a.device_type() == nb::device::cpu::value) {
    device = qmm::Device::cpu();
  } else if (a.device_type() == nb::device::cuda::value) {
    device = qmm::Device::cuda(static_cast<int>(a.device_id()));
  } else {
    fail(qmm::ErrorCode::DeviceMismatch, op,
         std::string("argument '") + name + "' is on a device qmm does not run on (DLPack device type " +
             std::to_string(a.device_type()) + ")");
  }
  void* data = const_cast<void*>(static_cast<const void*>(a.data()));
  if (data == nullptr && empty) data = no_elements_at(device);
  return qmm::TensorView(data, dtype_of(a.dtype(), op, name), shape, device);
}

// An optional argument: None is the absent (empty) view. Array is In or Out. The view outlives the array made here
// (a DLPack capsule is released with it): the caller keeps the tensor referenced until the op returns
// (qmm._base._call does).
template <class Array>
qmm::TensorView view_or_empty(const nb::object& a, const char* op, const char* name) {
  if (a.is_none()) return {};
  return view_of(nb::cast<Array>(a), op, name);
}

// SwiGLU's adapters from a binding's optional arguments (ops.h, SwiGluAdapters; None: absent).
qmm::SwiGluAdapters swiglu_adapters_of(const nb::object& t, const nb::object& b_gate, float gate_scale,
                                       const nb::object& b_up, float up_scale, const nb::object& dh_t,
                                       const nb::object& dh_a, const char* op) {
  return {view_or_empty<In>(t, op, "t"),
          view_or_empty<In>(b_gate, op, "b_gate"),
          gate_scale,
          view_or_empty<In>(b_up, op, "b_up"),
          up_scale,
          view_or_empty<In>(dh_t, op, "dh_t"),
          view_or_empty<In>(dh_a, op, "dh_a")};
}

// One Context per (GPU, stream), kept for the life of the process: a CUDA context holds a cuBLASLt handle, its
// workspace and the plan cache, too costly to make per call. The map is never destroyed on purpose: at exit the
// CUDA runtime may already be gone when static destructors run.
struct CudaContexts {
  std::mutex mutex;
  std::map<std::pair<int, std::uintptr_t>, qmm::Context> by_device_and_stream;
};
CudaContexts& cuda_contexts() {
  static auto* contexts = new CudaContexts();
  return *contexts;
}

qmm::Context context_for(const qmm::TensorView& first, std::uintptr_t stream) {
  if (first.device().is_cpu()) {
    static const qmm::Context cpu = qmm::Context::cpu();
    return cpu;
  }
  CudaContexts& all = cuda_contexts();
  std::lock_guard<std::mutex> lock(all.mutex);
  const auto key = std::make_pair(first.device().index, stream);
  auto it = all.by_device_and_stream.find(key);
  if (it == all.by_device_and_stream.end())
    it = all.by_device_and_stream.emplace(key, qmm::Context::cuda(key.first, reinterpret_cast<void*>(stream))).first;
  return it->second;
}

// The contexts this process made on `device` (one per stream that ran qmm ops there).
std::vector<qmm::Context> contexts_on(int device) {
  CudaContexts& all = cuda_contexts();
  std::lock_guard<std::mutex> lock(all.mutex);
  std::vector<qmm::Context> out;
  for (const auto& [key, ctx] : all.by_device_and_stream)
    if (key.first == device) out.push_back(ctx);
  return out;
}

// The enum value whose library name (math_mode_name, nf4_path_name) is `name`; the error lists the names.
template <class Enum, std::size_t N>
Enum enum_of(const std::string& name, const Enum (&values)[N], const char* (*name_of)(Enum), const char* op,
             const char* what) {
  for (Enum v : values)
    if (name == name_of(v)) return v;
  std::string names;
  for (Enum v : values) names += std::string(names.empty() ? "" : ", ") + name_of(v);
  fail(qmm::ErrorCode::InvalidArgument, op, std::string(what) + " must be one of " + names + ", not '" + name + "'");
}

qmm::MathMode math_of(const std::string& name, const char* op) {
  using M = qmm::MathMode;
  static constexpr M kModes[] = {M::FP32, M::TF32, M::BF16};
  return enum_of(name, kModes, qmm::math_mode_name, op, "math");
}

qmm::Nf4Path path_of(const std::string& name, const char* op) {
  return enum_of(name, qmm::nf4_forced::kAllPaths, qmm::nf4_path_name, op, "path");
}

// The NF4 weight from any object with the attributes of qmm.Nf4Weight (codes, absmax, absmax2, code2, offset,
// shape, block_size); absmax2 and code2 are None unless double-quantized.
qmm::Nf4Weight nf4_of(const nb::handle& w, const char* op, bool writable = false) {
  qmm::Nf4Weight v;
  auto field = [&](const char* name) {
    return writable ? view_or_empty<Out>(w.attr(name), op, name) : view_or_empty<In>(w.attr(name), op, name);
  };
  v.codes = field("codes");
  v.absmax = field("absmax");
  v.absmax2 = field("absmax2");
  v.code2 = field("code2");
  v.offset = nb::cast<float>(w.attr("offset"));
  const nb::object shape = w.attr("shape");
  if (nb::len(shape) != 2) fail(qmm::ErrorCode::ShapeMismatch, op, "the NF4 weight's shape must be (rows, cols)");
  v.rows = nb::cast<std::int64_t>(shape[0]);
  v.cols = nb::cast<std::int64_t>(shape[1]);
  v.block_size = nb::cast<int>(w.attr("block_size"));
  return v;
}

// An NF4 weight converted once (qmm.Nf4Weight makes one when it is built): the views, and references to the
// tensors they point into (not to the weight object, which holds the handle: no reference cycle). Ops take it
// instead of the Python object, so a call imports only its activations.
struct Nf4Handle {
  qmm::Nf4Weight view;
  nb::object codes, absmax, absmax2, code2;
};

// A state dict's fields for qmm::check_bnb_nf4_weight: `meta` maps each name to (file dtype, shape), and `read`
// returns a name's bytes as a 1-D contiguous host uint8 array (called only for the fields the checks read).
class StateDictSource final : public qmm::TensorSource {
 public:
  StateDictSource(nb::dict meta, nb::callable read) : meta_(std::move(meta)), read_(std::move(read)) {}
  bool contains(const std::string& name) const override { return meta_.contains(name.c_str()); }
  std::string dtype(const std::string& name) const override { return nb::cast<std::string>(entry(name)[0]); }
  std::vector<std::int64_t> shape(const std::string& name) const override {
    return nb::cast<std::vector<std::int64_t>>(entry(name)[1]);
  }
  std::vector<std::uint8_t> bytes(const std::string& name) const override {
    const auto a = nb::cast<nb::ndarray<const std::uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>>(
        read_(name.c_str()));
    return {a.data(), a.data() + a.size()};
  }
  std::string kind() const override { return "the state dict"; }

 private:
  nb::tuple entry(const std::string& name) const { return nb::cast<nb::tuple>(meta_[name.c_str()]); }
  nb::dict meta_;
  nb::callable read_;
};

qmm::GemmOptions gemm_options(float alpha, float beta, const std::string& math, const char* op) {
  return {alpha, beta, math_of(math, op)};
}

qmm::Nf4GemmOptions nf4_options(float alpha, float beta, const std::string& path, const char* op) {
  return {alpha, beta, path_of(path, op)};
}

// Runs an op with the GIL released: the arguments are plain views by now.
template <class F>
void run(F&& f) {
  nb::gil_scoped_release nogil;
  f();
}

// ---- one call per fused LoRA projection (qmm/_impl.py) ------------------------------------------------------------
// The public ops of one projection's forward or backward in a single binding call: per projection that saves the
// Python wrappers and binding calls of the four or five separate ops. The operands' shapes, dtypes and devices are
// all checked first, so that a bad call writes nothing; _impl passes freshly made outputs.

// `t` must be [rows, cols] of `dtype` on `device`.
void require_matrix(const char* op, const char* name, const qmm::TensorView& t, std::int64_t rows, std::int64_t cols,
                    qmm::DType dtype, qmm::Device device) {
  if (t.rank() != 2 || t.dim(0) != rows || t.dim(1) != cols)
    fail(qmm::ErrorCode::ShapeMismatch, op,
         std::string(name) + " is " + t.shape().str() + " but must be [" + std::to_string(rows) + ", " +
             std::to_string(cols) + "]");
  if (t.dtype() != dtype)
    fail(qmm::ErrorCode::DTypeMismatch, op,
         std::string(name) + " is " + qmm::dtype_name(t.dtype()) + " but must be " + qmm::dtype_name(dtype));
  if (t.device() != device)
    fail(qmm::ErrorCode::DeviceMismatch, op,
         std::string(name) + " is on " + t.device().str() + " but the input is on " + device.str());
}

// An adapter's operands: xd (its input, x itself where empty), a [r, K] and b [N, r] (f32 or x's dtype), their
// working copies in x's dtype (a_w, b_w: empty where a and b are in x's dtype already), t [M, r] in x's dtype.
struct AdapterViews {
  qmm::TensorView xd, a, b, a_w, b_w, t;
  float scale = 1.0f;
  std::int64_t rank() const { return a.rank() == 2 ? a.dim(0) : 0; }
  const qmm::TensorView& a_used() const { return a_w.empty() ? a : a_w; }
  const qmm::TensorView& b_used() const { return b_w.empty() ? b : b_w; }
};

void check_adapter(const char* op, const AdapterViews& ad, const qmm::TensorView& x, std::int64_t n) {
  const std::int64_t m = x.dim(0), k = x.dim(1), r = ad.rank();
  if (r < 1) fail(qmm::ErrorCode::ShapeMismatch, op, "a is " + ad.a.shape().str() + " but must be [r, K], r >= 1");
  const qmm::DType p = ad.a.dtype();
  if (p != qmm::DType::F32 && p != x.dtype())
    fail(qmm::ErrorCode::DTypeMismatch, op, std::string("a is ") + qmm::dtype_name(p) + ": float32 or x's dtype");
  require_matrix(op, "a", ad.a, r, k, p, x.device());
  require_matrix(op, "b", ad.b, n, r, p, x.device());
  if (!ad.xd.empty()) require_matrix(op, "xd", ad.xd, m, k, x.dtype(), x.device());
  if (p != x.dtype() && (ad.a_w.empty() || ad.b_w.empty()))
    fail(qmm::ErrorCode::InvalidArgument, op, "a_w and b_w are needed where a and b are not in x's dtype");
  if (!ad.a_w.empty()) require_matrix(op, "a_w", ad.a_w, r, k, x.dtype(), x.device());
  if (!ad.b_w.empty()) require_matrix(op, "b_w", ad.b_w, n, r, x.dtype(), x.device());
  require_matrix(op, "t", ad.t, m, r, x.dtype(), x.device());
}

// Several adapters of one input x, stacked (lora_nf4_linears, lora_adapters): each a cast into its rows of a_all
// (x's dtype), each b used as it is (in x's dtype) or cast into its b_w; the casts as one (from, to) list. Checks
// the shapes before anything is written: a_i [r_i, K] and b_i [N_i, r_i] (N_i = ys[i]'s columns) in one dtype,
// a_all [R, K] and t [M, R] in x's dtype (R = Σ r_i; both may be None where no entry has an adapter).
struct StackedAdapters {
  std::vector<qmm::TensorView> from, to, b_used;  // b_used[i]: b_i or its working copy; empty without an adapter
  qmm::TensorView a_all, t;
};

StackedAdapters stack_adapters(const char* op, const qmm::TensorView& x, const std::vector<qmm::TensorView>& ys,
                               const std::vector<nb::object>& as, const std::vector<nb::object>& bs,
                               const std::vector<nb::object>& b_ws, const std::vector<float>& scales,
                               const nb::object& a_all, const nb::object& t) {
  const std::size_t n = ys.size();
  if (as.size() != n || bs.size() != n || b_ws.size() != n || scales.size() != n)
    fail(qmm::ErrorCode::InvalidArgument, op, "every per-projection list must have one entry per output");
  if (x.rank() != 2) fail(qmm::ErrorCode::ShapeMismatch, op, "x is " + x.shape().str() + ": [M, K]");
  StackedAdapters st;
  st.a_all = view_or_empty<Out>(a_all, op, "a_all");
  st.t = view_or_empty<Out>(t, op, "t");
  const std::int64_t m = x.dim(0), k = x.dim(1);
  std::int64_t row = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const qmm::TensorView ai = view_or_empty<In>(as[i], op, "a"), bi = view_or_empty<In>(bs[i], op, "b"),
                          bwi = view_or_empty<Out>(b_ws[i], op, "b_w");
    st.b_used.emplace_back();
    if (ai.empty()) continue;
    const std::int64_t r = ai.rank() == 2 ? ai.dim(0) : 0;
    if (r < 1) fail(qmm::ErrorCode::ShapeMismatch, op, "a is " + ai.shape().str() + " but must be [r, K]");
    require_matrix(op, "a", ai, r, k, ai.dtype(), x.device());
    require_matrix(op, "b", bi, ys[i].rank() == 2 ? ys[i].dim(1) : 0, r, ai.dtype(), x.device());
    if (bwi.empty() && bi.dtype() != x.dtype())
      fail(qmm::ErrorCode::InvalidArgument, op, "b_w is needed where b is not in x's dtype");
    if (st.a_all.rank() != 2 || st.a_all.dim(0) < row + r)
      fail(qmm::ErrorCode::ShapeMismatch, op,
           "a_all is " + st.a_all.shape().str() + " but must hold every adapter's a, stacked: [R, K]");
    st.from.push_back(ai);
    const auto elem = static_cast<std::int64_t>(qmm::dtype_size(st.a_all.dtype()));
    st.to.emplace_back(static_cast<char*>(st.a_all.data()) + row * k * elem, st.a_all.dtype(), qmm::Shape{r, k},
                       st.a_all.device());
    if (!bwi.empty()) {
      require_matrix(op, "b_w", bwi, bi.dim(0), r, x.dtype(), x.device());
      st.from.push_back(bi);
      st.to.push_back(bwi);
    }
    st.b_used.back() = bwi.empty() ? bi : bwi;
    row += r;
  }
  if (row > 0) {
    require_matrix(op, "a_all", st.a_all, row, k, x.dtype(), x.device());
    require_matrix(op, "t", st.t, m, row, x.dtype(), x.device());
  } else {
    st.a_all = st.t = qmm::TensorView();
  }
  return st;
}

using GemmFn = void (*)(const qmm::Context&, const qmm::TensorView&, const qmm::TensorView&,
                        const qmm::TensorView&, const qmm::GemmOptions&);

template <GemmFn fn>
void def_gemm(nb::module_& m, const char* name, const char* x_name, const char* y_name, const char* out_name,
              const char* doc) {
  m.def(
      name,
      [name, x_name, y_name, out_name](const In& x, const In& y, const Out& out, float alpha, float beta,
                                       const std::string& math, std::uintptr_t stream) {
        const qmm::TensorView xv = view_of(x, name, x_name), yv = view_of(y, name, y_name),
                              ov = view_of(out, name, out_name);
        const qmm::GemmOptions opts = gemm_options(alpha, beta, math, name);
        const qmm::Context ctx = context_for(xv, stream);
        run([&] { fn(ctx, xv, yv, ov, opts); });
      },
      nb::arg(x_name), nb::arg(y_name), nb::arg(out_name), nb::arg("alpha") = 1.0f, nb::arg("beta") = 0.0f,
      nb::arg("math") = "fp32", nb::arg("stream") = 0, doc);
}

using Nf4GemmFn = void (*)(const qmm::Context&, const qmm::TensorView&, const qmm::Nf4Weight&,
                           const qmm::TensorView&, const qmm::Nf4GemmOptions&);

template <Nf4GemmFn fn>
void def_nf4_gemm(nb::module_& m, const char* name, const char* x_name, const char* out_name, const char* doc) {
  m.def(
      name,
      [name, x_name, out_name](const In& x, const Nf4Handle& w, const Out& out, float alpha, float beta,
                               const std::string& path, std::uintptr_t stream) {
        const qmm::TensorView xv = view_of(x, name, x_name), ov = view_of(out, name, out_name);
        const qmm::Nf4Weight wv = w.view;
        const qmm::Nf4GemmOptions opts = nf4_options(alpha, beta, path, name);
        const qmm::Context ctx = context_for(xv, stream);
        run([&] { fn(ctx, xv, wv, ov, opts); });
      },
      nb::arg(x_name), nb::arg("w"), nb::arg(out_name), nb::arg("alpha") = 1.0f, nb::arg("beta") = 0.0f,
      nb::arg("path") = "auto", nb::arg("stream") = 0, doc);
}

}  // namespace

NB_MODULE(_qmm, m) {
  m.doc() = "qmm's ops on DLPack tensors, in place (use the qmm package, which allocates outputs)";
  // Python does not free every object at exit: an Nf4Handle held by a module-level PyTorch model or an autograd
  // graph is still alive then, and nanobind would report it as a leak to every user of such a script.
  nb::set_leak_warnings(false);

  // qmm.Error(RuntimeError) with .code, the qmm::ErrorCode's name ("ShapeMismatch", ...).
  static PyObject* error_type = PyErr_NewException("qmm.Error", PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::handle(error_type);
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void*) {
        try {
          std::rethrow_exception(p);
        } catch (const qmm::Error& e) {
          // A message may quote bytes of a malformed file that are not UTF-8: replaced, never a decode error.
          const std::string what = e.what();
          nb::object text =
              nb::steal(PyUnicode_DecodeUTF8(what.data(), static_cast<Py_ssize_t>(what.size()), "replace"));
          nb::object value = nb::handle(error_type)(text);
          value.attr("code") = qmm::error_code_name(e.code());
          PyErr_SetObject(error_type, value.ptr());
        }
      },
      nullptr);

  nb::class_<Nf4Handle>(m, "Nf4Handle", "An NF4 weight as the ops take it (qmm.Nf4Weight builds one)");
  m.def(
      "nf4_handle",
      [](nb::handle w) {
        Nf4Handle h{nf4_of(w, "Nf4Weight"), w.attr("codes"), w.attr("absmax"), w.attr("absmax2"), w.attr("code2")};
        qmm::validate_nf4_weight(h.view, "Nf4Weight");
        return h;
      },
      nb::arg("w"), "Converts an object with qmm.Nf4Weight's tensors and fields once (checks dtypes and layout).");
  m.def(
      "check_bnb_nf4",
      [](nb::dict meta, nb::callable read, const std::string& prefix, const std::string& op) {
        const qmm::Bnb4bitLayout l = qmm::check_bnb_nf4_weight(StateDictSource(meta, read), prefix, "", op);
        return nb::make_tuple(l.rows, l.cols, l.block_size, l.double_quant, l.offset);
      },
      nb::arg("meta"), nb::arg("read"), nb::arg("prefix"), nb::arg("op"),
      "Checks a bitsandbytes 4-bit weight in a state dict as qmm's checkpoint loader does; returns (rows, cols, "
      "block_size, double_quant, offset).");

  m.def("cuda_device_count", &qmm::Context::cuda_device_count);
  m.def("nf4_codebook", [] {
    std::vector<float> values(16);
    for (int i = 0; i < 16; ++i) values[static_cast<std::size_t>(i)] = qmm::nf4_code_value(i);
    return values;
  }, "The 16 NF4 values (float32), ascending: bitsandbytes' quant_map for nf4.");
  m.def("cuda_unavailable_reason", &qmm::Context::cuda_unavailable_reason);
  m.def(
      "memory_stats",
      [](int device) {
        qmm::MemoryStats sum;
        for (const qmm::Context& ctx : contexts_on(device)) {
          const qmm::MemoryStats m = ctx.memory_stats();
          sum.fixed_bytes += m.fixed_bytes;
          sum.scratch_reserved_bytes += m.scratch_reserved_bytes;
          sum.scratch_reserved_peak_bytes += m.scratch_reserved_peak_bytes;
          sum.scratch_in_use_bytes += m.scratch_in_use_bytes;
          sum.scratch_in_use_peak_bytes += m.scratch_in_use_peak_bytes;
        }
        return nb::make_tuple(sum.fixed_bytes, sum.scratch_reserved_bytes, sum.scratch_reserved_peak_bytes,
                              sum.scratch_in_use_bytes, sum.scratch_in_use_peak_bytes);
      },
      nb::arg("device"),
      "Context::memory_stats summed over this process's contexts on a CUDA device: (fixed, "
      "scratch reserved, its peak, scratch in use, its peak) in bytes; zeros where none was made.");
  m.def(
      "reset_peak_memory_stats",
      [](int device) {
        for (const qmm::Context& ctx : contexts_on(device)) ctx.reset_peak_memory_stats();
      },
      nb::arg("device"));
  m.def(
      "release_cached_memory",
      [](int device) {
        for (const qmm::Context& ctx : contexts_on(device)) ctx.release_cached_memory();
      },
      nb::arg("device"));
  m.def("check_nf4_path", [](const std::string& name, const std::string& op) { path_of(name, op.c_str()); },
        nb::arg("path"), nb::arg("op"), "Throws qmm.Error unless `path` names an NF4 path (for an argument kept).");

  def_gemm<qmm::gemm>(m, "gemm", "a", "b", "c", "c = alpha * a[M,K] @ b[K,N] + beta * c");
  def_gemm<qmm::gemm_bt>(m, "gemm_bt", "a", "b", "c", "c = alpha * a[M,K] @ b[N,K]^T + beta * c");
  def_gemm<qmm::gemm_backward_a>(m, "gemm_backward_a", "dc", "b", "da", "da = alpha * dc @ b^T + beta * da");
  def_gemm<qmm::gemm_backward_b>(m, "gemm_backward_b", "a", "dc", "db", "db = alpha * a^T @ dc + beta * db");

  m.def(
      "lora_backward_dy",
      [](const In& dy, const In& b, const In& t, const Out& dt, const Out& grad_b, float scale, float beta,
         const std::string& math, std::uintptr_t stream) {
        const char* op = "lora_backward_dy";
        const qmm::TensorView dyv = view_of(dy, op, "dy"), bv = view_of(b, op, "b"), tv = view_of(t, op, "t"),
                              dtv = view_of(dt, op, "dt"), gbv = view_of(grad_b, op, "grad_b");
        const qmm::MathMode mode = math_of(math, op);
        const qmm::Context ctx = context_for(dyv, stream);
        run([&] { qmm::lora_backward_dy(ctx, dyv, bv, tv, dtv, gbv, scale, mode, beta); });
      },
      nb::arg("dy"), nb::arg("b"), nb::arg("t"), nb::arg("dt"), nb::arg("grad_b"), nb::arg("scale") = 1.0f,
      nb::arg("beta") = 1.0f, nb::arg("math") = "fp32", nb::arg("stream") = 0,
      "dt = scale * dy @ b (overwritten), grad_b = scale * dy^T @ t + beta * grad_b (LoRA's products of dy)");

  m.def(
      "batched_gemm",
      [](const In& a, const In& b, const Out& c, bool transpose_b, float alpha, float beta, const std::string& math,
         std::uintptr_t stream) {
        const char* op = "batched_gemm";
        const qmm::TensorView av = view_of(a, op, "a"), bv = view_of(b, op, "b"), cv = view_of(c, op, "c");
        const qmm::GemmOptions opts = gemm_options(alpha, beta, math, op);
        const qmm::Context ctx = context_for(av, stream);
        run([&] { qmm::batched_gemm(ctx, av, bv, cv, transpose_b, opts); });
      },
      nb::arg("a"), nb::arg("b"), nb::arg("c"), nb::arg("transpose_b") = false, nb::arg("alpha") = 1.0f,
      nb::arg("beta") = 0.0f, nb::arg("math") = "fp32", nb::arg("stream") = 0);

  m.def(
      "swiglu",
      [](const In& gate, const In& up, const Out& h, const nb::object& t, const nb::object& b_gate, float gate_scale,
         const nb::object& b_up, float up_scale, std::uintptr_t stream) {
        const char* op = "swiglu";
        const qmm::TensorView g = view_of(gate, op, "gate"), u = view_of(up, op, "up"), hv = view_of(h, op, "h");
        const qmm::SwiGluAdapters ad =
            swiglu_adapters_of(t, b_gate, gate_scale, b_up, up_scale, nb::none(), nb::none(), op);
        const qmm::Context ctx = context_for(g, stream);
        run([&] { qmm::swiglu(ctx, g, u, hv, ad); });
      },
      nb::arg("gate"), nb::arg("up"), nb::arg("h"), nb::arg("t").none() = nb::none(),
      nb::arg("b_gate").none() = nb::none(), nb::arg("gate_scale") = 1.0f, nb::arg("b_up").none() = nb::none(),
      nb::arg("up_scale") = 1.0f, nb::arg("stream") = 0,
      "h = silu(gate') * up' (gate' = gate + gate_scale * t[:, :r_g] @ b_gate^T, up' likewise with t's next r_u "
      "columns; without t, gate and up themselves)");

  m.def(
      "rms_norm",
      [](const In& x, const In& w, const Out& y, const nb::object& rstd, float eps, std::uintptr_t stream) {
        const char* op = "rms_norm";
        const qmm::TensorView xv = view_of(x, op, "x"), wv = view_of(w, op, "w"), yv = view_of(y, op, "y"),
                              rv = view_or_empty<Out>(rstd, op, "rstd");
        const qmm::Context ctx = context_for(xv, stream);
        run([&] { qmm::rms_norm(ctx, xv, wv, yv, rv, eps); });
      },
      nb::arg("x"), nb::arg("w"), nb::arg("y"), nb::arg("rstd").none(), nb::arg("eps"), nb::arg("stream") = 0);
  m.def(
      "add_rms_norm",
      [](const In& x, const In& r, const In& w, const Out& h, const Out& y, const nb::object& rstd, float eps,
         std::uintptr_t stream) {
        const char* op = "add_rms_norm";
        const qmm::TensorView xv = view_of(x, op, "x"), resv = view_of(r, op, "r"), wv = view_of(w, op, "w"),
                              hv = view_of(h, op, "h"), yv = view_of(y, op, "y"),
                              rv = view_or_empty<Out>(rstd, op, "rstd");
        const qmm::Context ctx = context_for(xv, stream);
        run([&] { qmm::add_rms_norm(ctx, xv, resv, wv, hv, yv, rv, eps); });
      },
      nb::arg("x"), nb::arg("r"), nb::arg("w"), nb::arg("h"), nb::arg("y"), nb::arg("rstd").none(), nb::arg("eps"),
      nb::arg("stream") = 0);
  m.def(
      "rms_norm_backward",
      [](const In& x, const In& w, const In& rstd, const In& dy, const nb::object& dx, const nb::object& dw,
         const nb::object& dres, std::uintptr_t stream) {
        const char* op = "rms_norm_backward";
        const qmm::TensorView xv = view_of(x, op, "x"), wv = view_of(w, op, "w"), rv = view_of(rstd, op, "rstd"),
                              dyv = view_of(dy, op, "dy"), dxv = view_or_empty<Out>(dx, op, "dx"),
                              dwv = view_or_empty<Out>(dw, op, "dw"), dresv = view_or_empty<In>(dres, op, "dres");
        const qmm::Context ctx = context_for(xv, stream);
        run([&] { qmm::rms_norm_backward(ctx, xv, wv, rv, dyv, dxv, dwv, dresv); });
      },
      nb::arg("x"), nb::arg("w"), nb::arg("rstd"), nb::arg("dy"), nb::arg("dx").none(), nb::arg("dw").none(),
      nb::arg("dres").none() = nb::none(), nb::arg("stream") = 0);

  m.def(
      "rope",
      [](const In& q, const nb::object& k, const In& cos, const In& sin, const Out& q_out, const nb::object& k_out,
         bool inverse, std::uintptr_t stream) {
        const char* op = "rope";
        const qmm::TensorView qv = view_of(q, op, "q"), kv = view_or_empty<In>(k, op, "k"),
                              cv = view_of(cos, op, "cos"), sv = view_of(sin, op, "sin"),
                              qov = view_of(q_out, op, "q_out"), kov = view_or_empty<Out>(k_out, op, "k_out");
        const qmm::Context ctx = context_for(qv, stream);
        run([&] { qmm::rope(ctx, qv, kv, cv, sv, qov, kov, inverse); });
      },
      nb::arg("q"), nb::arg("k").none(), nb::arg("cos"), nb::arg("sin"), nb::arg("q_out"), nb::arg("k_out").none(),
      nb::arg("inverse") = false, nb::arg("stream") = 0,
      "q_out, k_out = q, k [B, S, H, D] rotated by cos, sin [1 or B, S, D] (Hugging Face's rotary embedding)");

  m.def(
      "linear_cross_entropy",
      [](const In& h, const In& w, const In& labels, const Out& loss, const nb::object& dh, const nb::object& dw,
         std::int32_t ignore_index, std::int64_t chunk_tokens, bool check_labels, bool accumulate_dw,
         std::int64_t chunk_vocab, std::uintptr_t stream) {
        const char* op = "linear_cross_entropy";
        const qmm::TensorView hv = view_of(h, op, "h"), wv = view_of(w, op, "w"), lv = view_of(labels, op, "labels"),
                              lossv = view_of(loss, op, "loss"), dhv = view_or_empty<Out>(dh, op, "dh"),
                              dwv = view_or_empty<Out>(dw, op, "dw");
        const qmm::CrossEntropyOptions opts{ignore_index, chunk_tokens, check_labels, accumulate_dw, chunk_vocab};
        const qmm::Context ctx = context_for(hv, stream);
        run([&] { qmm::linear_cross_entropy(ctx, hv, wv, lv, lossv, dhv, dwv, opts); });
      },
      nb::arg("h"), nb::arg("w"), nb::arg("labels"), nb::arg("loss"), nb::arg("dh").none(), nb::arg("dw").none(),
      nb::arg("ignore_index") = -100, nb::arg("chunk_tokens") = 0, nb::arg("check_labels") = true,
      nb::arg("accumulate_dw") = true, nb::arg("chunk_vocab") = 0, nb::arg("stream") = 0,
      "loss = mean cross-entropy of h @ w^T against labels; dh written, dw accumulated (or written) where given");

  m.def(
      "swiglu_backward",
      [](const In& gate, const In& up, const In& dh, const Out& dgate, const Out& dup, const nb::object& t,
         const nb::object& b_gate, float gate_scale, const nb::object& b_up, float up_scale, const nb::object& dh_t,
         const nb::object& dh_a, const nb::object& h, std::uintptr_t stream) {
        const char* op = "swiglu_backward";
        const qmm::TensorView g = view_of(gate, op, "gate"), u = view_of(up, op, "up"), d = view_of(dh, op, "dh"),
                              dg = view_of(dgate, op, "dgate"), du = view_of(dup, op, "dup");
        const qmm::SwiGluAdapters ad = swiglu_adapters_of(t, b_gate, gate_scale, b_up, up_scale, dh_t, dh_a, op);
        const qmm::TensorView hv = view_or_empty<Out>(h, op, "h");
        const qmm::Context ctx = context_for(g, stream);
        run([&] { qmm::swiglu_backward(ctx, g, u, d, dg, du, ad, hv); });
      },
      nb::arg("gate"), nb::arg("up"), nb::arg("dh"), nb::arg("dgate"), nb::arg("dup"), nb::arg("t").none() = nb::none(),
      nb::arg("b_gate").none() = nb::none(), nb::arg("gate_scale") = 1.0f, nb::arg("b_up").none() = nb::none(),
      nb::arg("up_scale") = 1.0f, nb::arg("dh_t").none() = nb::none(), nb::arg("dh_a").none() = nb::none(),
      nb::arg("h").none() = nb::none(), nb::arg("stream") = 0,
      "dgate, dup at gate', up' (as swiglu's) and dh' = dh + dh_t @ dh_a; h, where given, receives swiglu's h");

  m.def(
      "cast",
      [](const std::vector<In>& src, const std::vector<Out>& dst, std::uintptr_t stream) {
        const char* op = "cast";
        std::vector<qmm::TensorView> sv, dv;
        for (const In& s : src) sv.push_back(view_of(s, op, "src"));
        for (const Out& d : dst) dv.push_back(view_of(d, op, "dst"));
        if (sv.empty()) return;
        const qmm::Context ctx = context_for(sv.front(), stream);
        run([&] { qmm::cast(ctx, sv, dv); });
      },
      nb::arg("src"), nb::arg("dst"), nb::arg("stream") = 0,
      "dst[i] = src[i] converted (f32 <-> bf16), the f32 -> bf16 pairs in one launch on a GPU");

  m.def(
      "nf4_quantize",
      [](const In& w, nb::handle out, std::uintptr_t stream) {
        const char* op = "nf4_quantize";
        const qmm::TensorView wv = view_of(w, op, "w");
        qmm::Nf4Weight ov = nf4_of(out, op, /*writable=*/true);
        const qmm::Context ctx = context_for(wv, stream);
        run([&] { qmm::nf4_quantize(ctx, wv, ov); });
        return ov.offset;
      },
      nb::arg("w"), nb::arg("out"), nb::arg("stream") = 0,
      "Quantizes w into out's buffers (sized for w); returns the double-quantization offset (0 when plain).");

  m.def(
      "nf4_dequantize",
      [](const Nf4Handle& w, const Out& out, std::uintptr_t stream) {
        const char* op = "nf4_dequantize";
        const qmm::Nf4Weight wv = w.view;
        const qmm::TensorView ov = view_of(out, op, "out");
        const qmm::Context ctx = context_for(ov, stream);
        run([&] { qmm::nf4_dequantize(ctx, wv, ov); });
      },
      nb::arg("w"), nb::arg("out"), nb::arg("stream") = 0);

  m.def(
      "lora_nf4_linear_forward",
      [](const In& x, const Nf4Handle& w, const Out& y, float beta, const std::string& path, const nb::object& xd,
         const nb::object& a, const nb::object& b, const nb::object& a_w, const nb::object& b_w, const nb::object& t,
         float scale, const nb::object& residual, std::uintptr_t stream) {
        const char* op = "lora_nf4_linear_forward";
        const qmm::TensorView xv = view_of(x, op, "x"), yv = view_of(y, op, "y");
        const qmm::TensorView rv = view_or_empty<In>(residual, op, "residual");
        const AdapterViews ad{view_or_empty<In>(xd, op, "xd"), view_or_empty<In>(a, op, "a"),
                              view_or_empty<In>(b, op, "b"),   view_or_empty<Out>(a_w, op, "a_w"),
                              view_or_empty<Out>(b_w, op, "b_w"), view_or_empty<Out>(t, op, "t"), scale};
        const qmm::Nf4Weight wv = w.view;
        const qmm::Nf4GemmOptions opts = nf4_options(1.0f, beta, path, op);
        if (xv.rank() != 2 || yv.rank() != 2 || yv.dim(0) != xv.dim(0))
          fail(qmm::ErrorCode::ShapeMismatch, op,
               "x is " + xv.shape().str() + " and y " + yv.shape().str() + ": both [M, *]");
        const bool adapter = !ad.a.empty();
        if (adapter) check_adapter(op, ad, xv, yv.dim(1));
        if (!rv.empty()) {
          // The residual rides in the adapter's second product (its GEMM's addend), which then runs first: w is
          // checked here, before y is written.
          if (!adapter || beta != 0.0f)
            fail(qmm::ErrorCode::InvalidArgument, op, "a residual needs an adapter and beta 0");
          require_matrix(op, "y", yv, xv.dim(0), wv.rows, xv.dtype(), xv.device());
          require_matrix(op, "residual", rv, xv.dim(0), wv.rows, xv.dtype(), xv.device());
          if (wv.cols != xv.dim(1))
            fail(qmm::ErrorCode::ShapeMismatch, op,
                 "w is [" + std::to_string(wv.rows) + ", " + std::to_string(wv.cols) + "] for x " + xv.shape().str());
          if (wv.device() != xv.device())
            fail(qmm::ErrorCode::DeviceMismatch, op,
                 "w is on " + wv.device().str() + " but x is on " + xv.device().str());
        }
        const qmm::Context ctx = context_for(xv, stream);
        run([&] {
          // Without a residual the NF4 product comes first (it checks w against x and y before anything is
          // written) and the adapter's term is added onto it; with one, y = residual + term (the residual as the
          // term's GEMM's addend), then the NF4 product is added.
          if (rv.empty()) qmm::nf4_gemm(ctx, xv, wv, yv, opts);
          if (!adapter) return;
          std::vector<qmm::TensorView> from, to;  // the working copies in one launch
          if (!ad.a_w.empty()) from.push_back(ad.a), to.push_back(ad.a_w);
          if (!ad.b_w.empty()) from.push_back(ad.b), to.push_back(ad.b_w);
          qmm::cast(ctx, from, to);
          qmm::gemm_bt(ctx, ad.xd.empty() ? xv : ad.xd, ad.a_used(), ad.t);
          qmm::gemm_bt(ctx, ad.t, ad.b_used(), yv, {ad.scale, 1.0f, qmm::MathMode::FP32, rv});
          if (!rv.empty()) qmm::nf4_gemm(ctx, xv, wv, yv, nf4_options(1.0f, 1.0f, path, op));
        });
      },
      nb::arg("x"), nb::arg("w"), nb::arg("y"), nb::arg("beta"), nb::arg("path"), nb::arg("xd").none(),
      nb::arg("a").none(), nb::arg("b").none(), nb::arg("a_w").none(), nb::arg("b_w").none(), nb::arg("t").none(),
      nb::arg("scale"), nb::arg("residual").none() = nb::none(), nb::arg("stream") = 0,
      "y = x @ dequant(W)^T + beta * y, then y += scale * (xd @ a^T) @ b^T in x's dtype where a is given; with a "
      "residual (an adapter and beta 0) y = residual + scale * (xd @ a^T) @ b^T, then the NF4 product added");
  m.def(
      "lora_nf4_linear_backward",
      [](const In& dy, const Nf4Handle& w, const std::string& path, const nb::object& dx, const nb::object& xs,
         const nb::object& t, const nb::object& a_w, const nb::object& b_w, float scale, const nb::object& dt,
         const nb::object& grad_a, const nb::object& grad_b, bool dropped, const nb::object& dxd, float dx_beta,
         std::uintptr_t stream) {
        const char* op = "lora_nf4_linear_backward";
        const qmm::TensorView dyv = view_of(dy, op, "dy"), dxv = view_or_empty<Out>(dx, op, "dx");
        const qmm::TensorView xsv = view_or_empty<In>(xs, op, "xs"), tv = view_or_empty<In>(t, op, "t");
        const qmm::TensorView awv = view_or_empty<In>(a_w, op, "a_w"), bwv = view_or_empty<In>(b_w, op, "b_w");
        const qmm::TensorView dtv = view_or_empty<Out>(dt, op, "dt"), gav = view_or_empty<Out>(grad_a, op, "grad_a");
        const qmm::TensorView gbv = view_or_empty<Out>(grad_b, op, "grad_b"), dxdv = view_or_empty<Out>(dxd, op, "dxd");
        const qmm::Nf4Weight wv = w.view;
        const qmm::Nf4GemmOptions opts = nf4_options(1.0f, dx_beta, path, op);
        if (dyv.rank() != 2) fail(qmm::ErrorCode::ShapeMismatch, op, "dy is " + dyv.shape().str() + ": [M, N]");
        const std::int64_t m_rows = dyv.dim(0), n = dyv.dim(1), k = wv.cols;
        const bool adapter = !tv.empty();
        if (!dxv.empty()) require_matrix(op, "dx", dxv, m_rows, k, dyv.dtype(), dyv.device());
        if (adapter) {
          const std::int64_t r = tv.rank() == 2 ? tv.dim(1) : 0;
          if (r < 1) fail(qmm::ErrorCode::ShapeMismatch, op, "t is " + tv.shape().str() + " but must be [M, r]");
          require_matrix(op, "t", tv, m_rows, r, dyv.dtype(), dyv.device());
          require_matrix(op, "xs", xsv, m_rows, k, dyv.dtype(), dyv.device());
          require_matrix(op, "a_w", awv, r, k, dyv.dtype(), dyv.device());
          require_matrix(op, "b_w", bwv, n, r, dyv.dtype(), dyv.device());
          require_matrix(op, "dt", dtv, m_rows, r, dyv.dtype(), dyv.device());
          require_matrix(op, "grad_b", gbv, n, r, qmm::DType::F32, dyv.device());
          if (!gav.empty()) require_matrix(op, "grad_a", gav, r, k, qmm::DType::F32, dyv.device());
          if (!dxdv.empty()) require_matrix(op, "dxd", dxdv, m_rows, k, dyv.dtype(), dyv.device());
        }
        const qmm::Context ctx = context_for(dyv, stream);
        if (wv.rows != n)
          fail(qmm::ErrorCode::ShapeMismatch, op,
               "dy is " + dyv.shape().str() + " but w has " + std::to_string(wv.rows) + " rows");
        run([&] {
          // The NF4 product first: it checks w in full before writing dx.
          if (!dxv.empty()) qmm::nf4_gemm_backward_a(ctx, dyv, wv, dxv, opts);
          if (!adapter) return;
          // dt = scale * dy @ b_w and grad_b (written: beta = 0) from one read of dy, then grad_a = dt^T @ xs
          qmm::lora_backward_dy(ctx, dyv, bwv, tv, dtv, gbv, scale, qmm::MathMode::FP32, 0.0f);
          if (!gav.empty()) qmm::gemm_backward_b(ctx, dtv, xsv, gav);
          if (dropped && !dxdv.empty()) qmm::gemm(ctx, dtv, awv, dxdv);  // its input was dropout(x): apart
          if (!dropped && !dxv.empty()) qmm::gemm(ctx, dtv, awv, dxv, {1.0f, 1.0f});
        });
      },
      nb::arg("dy"), nb::arg("w"), nb::arg("path"), nb::arg("dx").none(), nb::arg("xs").none(), nb::arg("t").none(),
      nb::arg("a_w").none(), nb::arg("b_w").none(), nb::arg("scale"), nb::arg("dt").none(),
      nb::arg("grad_a").none(), nb::arg("grad_b").none(), nb::arg("dropped"), nb::arg("dxd").none(),
      nb::arg("dx_beta") = 0.0f, nb::arg("stream") = 0,
      "dx = dy @ dequant(W) + dx_beta * dx (+ dt @ a_w, or dxd = dt @ a_w where the adapter's input was dropped out), "
      "dt = scale * dy @ b_w, grad_b = scale * dy^T @ t, grad_a = dt^T @ xs");

  // ---- several projections of one input as one op (qmm/_impl.py: an attention's q, k and v) --------------------
  // The adapters' working copies in one cast launch (each a into its rows of a_all, each b into its b_w where one
  // is given: b is not in x's dtype), then lora_nf4_linears; every shape checked before anything is written.
  m.def(
      "lora_nf4_linears_forward",
      [](const In& x, const std::vector<const Nf4Handle*>& ws, const std::vector<Out>& ys,
         const std::vector<float>& betas, const std::vector<nb::object>& biases, const std::vector<nb::object>& as,
         const std::vector<nb::object>& bs, const std::vector<nb::object>& b_ws, const std::vector<float>& scales,
         const nb::object& a_all, const nb::object& t, const std::string& path, std::uintptr_t stream) {
        const char* op = "lora_nf4_linears_forward";
        const std::size_t n = ws.size();
        if (ys.size() != n || betas.size() != n || biases.size() != n)
          fail(qmm::ErrorCode::InvalidArgument, op, "every per-projection list must have one entry per weight");
        const qmm::TensorView xv = view_of(x, op, "x");
        std::vector<qmm::TensorView> yv;
        for (std::size_t i = 0; i < n; ++i) {
          yv.push_back(view_of(ys[i], op, "y"));
          require_matrix(op, "y", yv[i], xv.rank() == 2 ? xv.dim(0) : 0, ws[i]->view.rows, xv.dtype(), xv.device());
        }
        const StackedAdapters st = stack_adapters(op, xv, yv, as, bs, b_ws, scales, a_all, t);
        std::vector<qmm::Nf4Projection> ps(n);
        for (std::size_t i = 0; i < n; ++i)
          ps[i] = {ws[i]->view, yv[i], betas[i], st.b_used[i], scales[i], view_or_empty<In>(biases[i], op, "bias")};
        const qmm::Context ctx = context_for(xv, stream);
        const qmm::Nf4GemmOptions opts = nf4_options(1.0f, 0.0f, path, op);
        run([&] {
          if (!st.from.empty()) qmm::cast(ctx, st.from, st.to);
          qmm::lora_nf4_linears(ctx, xv, ps, st.a_all, st.t, opts);
        });
      },
      nb::arg("x"), nb::arg("ws"), nb::arg("ys"), nb::arg("betas"), nb::arg("biases"), nb::arg("as"), nb::arg("bs"),
      nb::arg("b_ws"), nb::arg("scales"), nb::arg("a_all").none(), nb::arg("t").none(), nb::arg("path"),
      nb::arg("stream") = 0,
      "y_i = x @ dequant(W_i)^T + beta_i * y_i + bias_i + scale_i * t_i @ b_i^T, t = x @ a_all^T (bias_i: None or "
      "[N_i] in x's dtype; a_all: every a cast and stacked; b_w: b's working copy where given)");
  m.def(
      "lora_adapters_forward",
      [](const In& x, const std::vector<Out>& ys, const std::vector<nb::object>& as, const std::vector<nb::object>& bs,
         const std::vector<nb::object>& b_ws, const std::vector<float>& scales, const nb::object& a_all,
         const nb::object& t, bool second_products, std::uintptr_t stream) {
        const char* op = "lora_adapters_forward";
        const qmm::TensorView xv = view_of(x, op, "x");
        std::vector<qmm::TensorView> yv;
        for (const Out& y : ys) yv.push_back(view_of(y, op, "y"));
        const StackedAdapters st = stack_adapters(op, xv, yv, as, bs, b_ws, scales, a_all, t);
        std::vector<qmm::LoraTerm> terms;
        for (std::size_t i = 0; i < yv.size(); ++i)
          if (!st.b_used[i].empty()) terms.push_back({yv[i], st.b_used[i], scales[i]});
        const qmm::Context ctx = context_for(xv, stream);
        run([&] {
          if (!st.from.empty()) qmm::cast(ctx, st.from, st.to);
          if (second_products)
            qmm::lora_adapters(ctx, xv, terms, st.a_all, st.t);
          else
            qmm::gemm_bt(ctx, xv, st.a_all, st.t);
        });
      },
      nb::arg("x"), nb::arg("ys"), nb::arg("as"), nb::arg("bs"), nb::arg("b_ws"), nb::arg("scales"),
      nb::arg("a_all").none(), nb::arg("t").none(), nb::arg("second_products") = true, nb::arg("stream") = 0,
      "y_i += scale_i * t_i @ b_i^T, t = x @ a_all^T (a_all: every a cast and stacked; b_w: b's working copy where "
      "given); without second_products only the casts and t (ys give the shapes; swiglu's adapters add the terms)");
  m.def(
      "lora_nf4_linears_backward",
      [](const In& x, const std::vector<const Nf4Handle*>& ws, const std::vector<nb::object>& dys,
         const std::vector<nb::object>& bs, const std::vector<float>& scales, const std::vector<nb::object>& grad_bs,
         const nb::object& a_all, const nb::object& t, const nb::object& dt, const nb::object& grad_a,
         const nb::object& dx, float dx_beta, const std::string& path, std::uintptr_t stream) {
        const char* op = "lora_nf4_linears_backward";
        const std::size_t n = ws.size();
        if (dys.size() != n || bs.size() != n || scales.size() != n || grad_bs.size() != n)
          fail(qmm::ErrorCode::InvalidArgument, op, "every per-projection list must have one entry per weight");
        const qmm::TensorView xv = view_of(x, op, "x");
        std::vector<qmm::Nf4ProjectionGrad> ps(n);
        for (std::size_t i = 0; i < n; ++i)
          ps[i] = {ws[i]->view, view_or_empty<In>(dys[i], op, "dy"), view_or_empty<In>(bs[i], op, "b"), scales[i],
                   view_or_empty<Out>(grad_bs[i], op, "grad_b")};
        const qmm::Context ctx = context_for(xv, stream);
        const qmm::Nf4GemmOptions opts = nf4_options(1.0f, 0.0f, path, op);
        const qmm::TensorView av = view_or_empty<In>(a_all, op, "a_all"), tv = view_or_empty<In>(t, op, "t"),
                              dtv = view_or_empty<Out>(dt, op, "dt"), gav = view_or_empty<Out>(grad_a, op, "grad_a"),
                              dxv = view_or_empty<Out>(dx, op, "dx");
        run([&] { qmm::lora_nf4_linears_backward(ctx, xv, ps, av, tv, dtv, gav, dxv, dx_beta, opts); });
      },
      nb::arg("x"), nb::arg("ws"), nb::arg("dys"), nb::arg("bs"), nb::arg("scales"), nb::arg("grad_bs"),
      nb::arg("a_all").none(), nb::arg("t").none(), nb::arg("dt").none(), nb::arg("grad_a").none(),
      nb::arg("dx").none(), nb::arg("dx_beta"), nb::arg("path"), nb::arg("stream") = 0,
      "lora_nf4_linears' gradients: dt, grad_b_i, grad_a = dt^T @ x, dx = sum dy_i @ dequant(W_i) + dt @ a_all + "
      "dx_beta * dx");

  def_nf4_gemm<qmm::nf4_gemm>(m, "nf4_gemm", "a", "c", "c = alpha * a @ dequant(W)^T + beta * c");
  def_nf4_gemm<qmm::nf4_gemm_backward_a>(m, "nf4_gemm_backward_a", "dc", "da",
                                         "da = alpha * dc @ dequant(W) + beta * da");

  m.def(
      "nf4_gate_up",
      [](const In& a, const Nf4Handle& w_gate, const Nf4Handle& w_up, const nb::object& gate, const nb::object& up,
         const nb::object& h, float alpha, float beta, const std::string& path, std::uintptr_t stream) {
        const char* op = "nf4_gate_up";
        const qmm::TensorView av = view_of(a, op, "a");
        const qmm::Nf4Weight wg = w_gate.view, wu = w_up.view;
        const qmm::GateUpOutputs outs{view_or_empty<Out>(gate, op, "gate"), view_or_empty<Out>(up, op, "up"),
                                      view_or_empty<Out>(h, op, "h")};
        const qmm::Nf4GemmOptions opts = nf4_options(alpha, beta, path, op);
        const qmm::Context ctx = context_for(av, stream);
        run([&] { qmm::nf4_gate_up(ctx, av, wg, wu, outs, opts); });
      },
      nb::arg("a"), nb::arg("w_gate"), nb::arg("w_up"), nb::arg("gate").none(), nb::arg("up").none(),
      nb::arg("h").none(), nb::arg("alpha") = 1.0f, nb::arg("beta") = 0.0f, nb::arg("path") = "auto",
      nb::arg("stream") = 0);
}
