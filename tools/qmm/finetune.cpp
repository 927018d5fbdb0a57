// qmm finetune: QLoRA end to end. A frozen base is quantized to NF4 (or read as NF4 from a bitsandbytes
// checkpoint); the target is the dense base plus a hidden low-rank change; LoRA adapters on the NF4 base learn that
// change with AdamW on an MSE loss. The adapters' best is known: the NF4 base with the true change loaded as
// adapters (the quantization floor), so the run reports how close it got, not only that the loss fell.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <numbers>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "commands.h"
#include "qmm/checkpoint.h"
#include "qmm/qmm.h"
#include "ranks.h"

namespace qmm::tool {
namespace {

constexpr int kMaxBatches = 64;  // fixed training batches, cycled: enough data that the adapters generalize
constexpr int kEvalBatches = 4;  // held out: the start, final and floor losses are measured on these

[[noreturn]] void fail(ErrorCode code, const std::string& what) { throw Error(code, "finetune: " + what); }

std::string fmt(const char* f, ...) {
  char buf[512];
  va_list args;
  va_start(args, f);
  std::vsnprintf(buf, sizeof buf, f, args);
  va_end(args);
  return buf;
}

std::string bytes_str(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  double b = static_cast<double>(bytes);
  int u = 0;
  for (; b >= 1024 && u < 3; ++u) b /= 1024;
  return fmt(u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

float* f32(const Tensor& t) { return t.data_as<float>(); }

Tensor gaussian(Shape shape, std::mt19937_64& rng, double stddev) {
  Tensor t(DType::F32, shape);
  std::normal_distribution<float> dist(0.0f, static_cast<float>(stddev));
  for (std::int64_t i = 0; i < t.numel(); ++i) f32(t)[i] = dist(rng);
  return t;
}

// A host f32 copy of a host tensor of any float dtype.
Tensor as_f32(const Tensor& t, const std::string& name) {
  if (t.dtype() == DType::U8) fail(ErrorCode::DTypeMismatch, "'" + name + "' is u8 but must be f32, bf16 or f16");
  Tensor out(DType::F32, t.shape());
  const auto* half = t.data_as<const std::uint16_t>();
  for (std::int64_t i = 0; i < t.numel(); ++i)
    f32(out)[i] = t.dtype() == DType::F32    ? f32(t)[i]
                  : t.dtype() == DType::BF16 ? bf16_to_float(half[i])
                                             : f16_to_float(half[i]);
  return out;
}

// A device copy of a host f32 tensor in `dtype` (bf16: rounded to nearest even).
Tensor on_device(const Context& ctx, const Tensor& host_f32, DType dtype) {
  Tensor host(dtype, host_f32.shape());
  cast(Context::cpu(), host_f32, host);
  return to_device(host, ctx.device());
}

// ---- the frozen weights -----------------------------------------------------------------------------------------

// What the job trains on, as host f32 "pretrained" weights: an MLP (gate, up, down) or one linear layer.
struct Source {
  std::string what;              // for the header
  std::vector<Tensor> dense;     // [N,K] each; for a 4-bit checkpoint its dequantized weight
  std::optional<Nf4Tensor> nf4;  // a 4-bit checkpoint's weight as stored: the base, unchanged
  Tensor bias;                   // [N] (linear layer only), or undefined
  bool mlp() const { return dense.size() == 3; }
};

Source embedded_mlp(std::int64_t h, std::int64_t i, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Source s;
  s.what = "embedded seeded SwiGLU MLP";
  for (Shape shape : {Shape{i, h}, Shape{i, h}, Shape{h, i}})  // N(0,1)/sqrt(fan_in)
    s.dense.push_back(gaussian(shape, rng, 1.0 / std::sqrt(static_cast<double>(shape[1]))));
  return s;
}

// A float tensor of the file with every value finite (NF4 has no code for NaN or infinity, and training on one
// only ends in "loss did not fall"): the error names the file, the tensor and the first bad index.
Tensor finite(Tensor t, const std::string& path, const std::string& name) {
  for (std::int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(f32(t)[i]))
      fail(ErrorCode::InvalidArgument, path + ": '" + name + "' holds " + std::to_string(f32(t)[i]) + " at index " +
                                           std::to_string(i) + "; the weights must be finite");
  return t;
}

Tensor dense_weight(const SafetensorsFile& f, const std::string& path, const std::string& name) {
  const Tensor t = f.tensor(name);
  if (t.shape().rank != 2)
    fail(ErrorCode::ShapeMismatch, path + ": '" + name + "' is " + t.shape().str() + ", not 2-D");
  return finite(as_f32(t, name), path, name);
}

// The bias beside a weight named "<p>weight", when the file has one.
Tensor optional_bias(const SafetensorsFile& f, const std::string& path, const std::string& weight, std::int64_t n) {
  const std::string name = weight.substr(0, weight.size() - 6) + "bias";
  if (!ends_with(weight, "weight") || !f.contains(name)) return {};
  Tensor b = finite(as_f32(f.tensor(name), name), path, name);
  if (b.shape() != Shape{n})
    fail(ErrorCode::ShapeMismatch,
         path + ": '" + name + "' is " + b.shape().str() + " but its weight has " + std::to_string(n) + " outputs");
  return b;
}

Source from_file(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  const std::vector<std::string> names = f.names();
  Source s;
  // (a) A bitsandbytes 4-bit layer (the loader reports FP4 as unsupported).
  for (const std::string& n : names) {
    const std::string suffix = ".quant_state.bitsandbytes__nf4";  // same length as the fp4 key
    if (!ends_with(n, suffix) && !ends_with(n, ".quant_state.bitsandbytes__fp4")) continue;
    const std::string prefix = n.substr(0, n.size() - suffix.size());
    s.nf4 = load_bnb_nf4_weight(path, prefix);
    Tensor w(DType::F32, {s.nf4->rows, s.nf4->cols});
    nf4_dequantize(Context::cpu(), *s.nf4, w);
    s.what = "bitsandbytes 4-bit layer '" + prefix + "' of " + path;
    s.dense.push_back(w);
    s.bias = optional_bias(f, path, prefix, s.nf4->rows);
    return s;
  }
  // (b) An MLP: the first in name order whose three projections are all there.
  for (const std::string& n : names) {
    if (!ends_with(n, "gate_proj.weight")) continue;
    const std::string p = n.substr(0, n.size() - 16);
    if (!f.contains(p + "up_proj.weight") || !f.contains(p + "down_proj.weight")) continue;
    s.what = "MLP '" + p + "{gate,up,down}_proj' of " + path + ", quantized to NF4 here";
    for (const char* proj : {"gate_proj.weight", "up_proj.weight", "down_proj.weight"})
      s.dense.push_back(dense_weight(f, path, p + proj));
    const std::int64_t i = s.dense[0].dim(0), h = s.dense[0].dim(1);
    if (s.dense[1].shape() != Shape{i, h} || s.dense[2].shape() != Shape{h, i})
      fail(ErrorCode::ShapeMismatch, path + ": gate_proj is " + s.dense[0].shape().str() + ", up_proj " +
                                         s.dense[1].shape().str() + ", down_proj " + s.dense[2].shape().str() +
                                         " but they must be [I,H], [I,H], [H,I]");
    return s;
  }
  // (c) One 2-D float weight: a linear layer.
  std::vector<std::string> weights;
  for (const std::string& n : names) {
    const SafetensorsEntry& e = f.entry(n);
    if ((n == "weight" || ends_with(n, ".weight")) && e.shape.size() == 2 &&
        (e.dtype == "F32" || e.dtype == "BF16" || e.dtype == "F16"))
      weights.push_back(n);
  }
  if (weights.size() != 1) {
    std::string list;
    for (const std::string& n : weights.empty() ? names : weights) list += (list.empty() ? "" : ", ") + n;
    fail(ErrorCode::InvalidArgument,
         path + (weights.empty() ? ": no bitsandbytes 4-bit layer, no gate_proj/up_proj/down_proj MLP and no 2-D "
                                   "f32/bf16/f16 \"weight\" (tensors: "
                                 : ": several 2-D weights and no MLP; finetune trains one linear layer (weights: ") +
             list + ")");
  }
  s.what = "linear layer '" + weights[0] + "' of " + path + ", quantized to NF4 here";
  s.dense.push_back(dense_weight(f, path, weights[0]));
  s.bias = optional_bias(f, path, weights[0], s.dense[0].dim(0));
  return s;
}

// One projection W [N,K]: its frozen NF4 base, the dense target W + U·V (activation dtype), both on the device,
// and the change as host adapters A = [V; 0] [rank,K], B = [U/s, 0] [N,rank] (what LoRA's y += s·x·Aᵀ·Bᵀ adds).
struct Projection {
  Nf4Tensor base;
  Tensor target, a_true, b_true;
};

Projection make_projection(const Context& ctx, const Source& src, std::size_t p, const LoraConfig& cfg, int r_true,
                           DType act, std::mt19937_64& rng) {
  const Tensor& w = src.dense[p];
  const std::int64_t n = w.dim(0), k = w.dim(1), rank = cfg.rank;
  double sq = 0;
  for (std::int64_t e = 0; e < w.numel(); ++e) sq += static_cast<double>(f32(w)[e]) * f32(w)[e];
  const double rms = std::sqrt(sq / static_cast<double>(w.numel()));
  // V ~ N(0,1/K), LoRA's own scale for A; U makes the change half the weight's RMS: far above NF4's error (about a
  // tenth of it), yet within Adam's reach in a few hundred steps.
  const Tensor v = gaussian({r_true, k}, rng, 1.0 / std::sqrt(static_cast<double>(k)));
  const Tensor u = gaussian({n, r_true}, rng, 0.5 * rms * std::sqrt(static_cast<double>(k) / r_true));
  Tensor target(DType::F32, {n, k}), a(DType::F32, {rank, k}), b(DType::F32, {n, rank});
  std::fill_n(f32(a), a.numel(), 0.0f);
  std::fill_n(f32(b), b.numel(), 0.0f);
  std::copy_n(f32(v), v.numel(), f32(a));
  const float s = cfg.alpha / static_cast<float>(cfg.rank);
  for (std::int64_t i = 0; i < n; ++i) {
    for (int q = 0; q < r_true; ++q) f32(b)[i * rank + q] = f32(u)[i * r_true + q] / s;
    for (std::int64_t j = 0; j < k; ++j) {
      double acc = f32(w)[i * k + j];
      for (int q = 0; q < r_true; ++q) acc += static_cast<double>(f32(u)[i * r_true + q]) * f32(v)[q * k + j];
      f32(target)[i * k + j] = static_cast<float>(acc);
    }
  }
  Projection out{{}, on_device(ctx, target, act), a, b};
  if (!src.nf4) {
    out.base = nf4_quantize(ctx, to_device(w, ctx.device()), /*double_quant=*/true);
    return out;
  }
  out.base = *src.nf4;
  out.base.codes = to_device(src.nf4->codes, ctx.device());
  out.base.absmax = to_device(src.nf4->absmax, ctx.device());
  if (src.nf4->absmax2.defined()) out.base.absmax2 = to_device(src.nf4->absmax2, ctx.device());
  if (src.nf4->code2.defined()) out.base.code2 = to_device(src.nf4->code2, ctx.device());
  return out;
}

// ---- training ---------------------------------------------------------------------------------------------------

// A SwiGLU MLP (three bases) or one linear layer (one base), behind one interface.
class Net {
 public:
  Net(const Context& ctx, const std::vector<BaseWeight>& w, const LoraConfig& cfg, const TensorView& bias) {
    if (w.size() == 3) mlp_.emplace(ctx, w[0], w[1], w[2], cfg);
    else linear_.emplace(ctx, w[0], cfg, bias);
  }
  Net(const Net&) = delete;  // the optimizer keeps the layers' addresses

  void forward(const TensorView& x, const TensorView& y, ForwardMode m) {
    mlp_ ? mlp_->forward(x, y, m) : linear_->forward(x, y, m);
  }
  void backward(const TensorView& x, const TensorView& dy) {
    mlp_ ? mlp_->backward(x, dy, {}) : linear_->backward(x, dy, {});  // no input gradient: nothing below
  }
  void reserve(std::int64_t rows) { mlp_ ? mlp_->reserve(rows) : linear_->reserve(rows); }
  void add_to(AdamW& opt) { mlp_ ? opt.add(*mlp_) : opt.add(*linear_); }
  std::vector<LoraLinear*> layers() {
    if (mlp_) return {&mlp_->gate(), &mlp_->up(), &mlp_->down()};
    return {&*linear_};
  }
  template <class T>
  T sum(T (LoraLinear::*of)() const) {
    T total = 0;
    for (LoraLinear* l : layers()) total += (l->*of)();
    return total;
  }
  std::size_t saved_bytes() const { return mlp_ ? mlp_->saved_bytes() : linear_->saved_bytes(); }
  std::size_t scratch_bytes() { return layers()[0]->scratch()->bytes(); }  // shared by an MLP's projections

 private:
  std::optional<SwiGluMlp> mlp_;
  std::optional<LoraLinear> linear_;
};

struct Data {
  std::vector<Tensor> x, target;  // on the device
};

// Random inputs (from a host generator, copied once) and the teacher's outputs for them.
Data make_data(const Context& ctx, Net& teacher, int batches, Shape x_shape, Shape y_shape, DType act,
               std::mt19937_64& rng) {
  Data d;
  for (int b = 0; b < batches; ++b) {
    d.x.push_back(on_device(ctx, gaussian(x_shape, rng, 1.0), act));
    d.target.emplace_back(act, y_shape, ctx.device());
    teacher.forward(d.x.back(), d.target.back(), ForwardMode::Eval);
  }
  return d;
}

// Rows [r0, r0 + n) of a row-major 2-D tensor: a rank's share of a batch.
TensorView rows(const Tensor& t, std::int64_t r0, std::int64_t n) {
  return TensorView(static_cast<char*>(t.data()) + r0 * t.dim(1) * static_cast<std::int64_t>(dtype_size(t.dtype())),
                    t.dtype(), {n, t.dim(1)}, t.device());
}

TensorView slot(const Tensor& losses, std::int64_t i, std::int64_t n = 1) {
  return TensorView(f32(losses) + i, DType::F32, {n}, losses.device());
}

// Reads losses[from, from + n) back (this waits for the device) and returns their mean.
double mean_loss(const Context& ctx, const Tensor& losses, std::int64_t from, std::int64_t n) {
  Tensor host(DType::F32, {n});
  copy(ctx, host, slot(losses, from, n));
  ctx.synchronize();
  double sum = 0;
  for (std::int64_t i = 0; i < n; ++i) sum += f32(host)[i];
  return sum / static_cast<double>(n);
}

double eval_loss(const Context& ctx, Net& net, const Data& d, const Tensor& y, const Tensor& losses) {
  for (std::size_t b = 0; b < d.x.size(); ++b) {
    net.forward(d.x[b], y, ForwardMode::Eval);
    mse_loss(ctx, y, d.target[b], slot(losses, static_cast<std::int64_t>(b)), y);
  }
  return mean_loss(ctx, losses, 0, static_cast<std::int64_t>(d.x.size()));
}

// Linear warmup over the first 5% of the steps, then a cosine down to a tenth of the peak.
float lr_at(int step, int steps, float peak) {
  const int warmup = std::max(1, steps / 20);
  if (step < warmup) return peak * static_cast<float>(step + 1) / static_cast<float>(warmup);
  const double t = static_cast<double>(step - warmup) / std::max(1, steps - warmup);
  return static_cast<float>(peak * (0.1 + 0.45 * (1 + std::cos(std::numbers::pi * t))));
}

std::string bar(int done, int total) {
  const int width = 30, filled = width * done / total;
  return "[" + std::string(static_cast<std::size_t>(filled), '#') +
         std::string(static_cast<std::size_t>(width - filled), '.') + "] " + std::to_string(100 * done / total) + "%";
}

}  // namespace

FinetuneResult finetune(const FinetuneOptions& o, std::ostream& out_rank0, bool tty) {
  if (o.rank < 1) fail(ErrorCode::InvalidArgument, "--rank is " + std::to_string(o.rank) + " but must be >= 1");
  if (!(o.lr > 0.0f) || !std::isfinite(o.lr)) fail(ErrorCode::InvalidArgument, "--lr must be finite and > 0");
  if (o.steps < 0 || o.tokens < 0 || o.hidden < 0 || o.intermediate < 0 || o.log_every < 1)
    fail(ErrorCode::InvalidArgument, "--steps, --tokens and the sizes must be >= 0 (0: default), --log-every >= 1");

  if (o.gpus < 1) fail(ErrorCode::InvalidArgument, "--gpus must be >= 1");
  // Data parallel: this process is rank re.rank of re.world (set by run_finetune's supervisor), on GPU re.rank,
  // training rows [rank * local, (rank + 1) * local) of every batch; only rank 0 prints.
  const RankEnv re = rank_env();
  const int world = re.world;
  if (world != o.gpus)
    fail(ErrorCode::InvalidArgument, "--gpus " + std::to_string(o.gpus) + " but this process is one of " +
                                         std::to_string(world) + " ranks (QMM_WORLD_SIZE); run the qmm command, "
                                         "which starts the ranks");
  const bool gpu = !o.cpu && Context::cuda_device_count() > 0;
  if (world > 1 && (!gpu || Context::cuda_device_count() < world))
    fail(ErrorCode::Unsupported, "--gpus " + std::to_string(world) + " needs that many GPUs (this machine has " +
                                     std::to_string(o.cpu ? 0 : Context::cuda_device_count()) + " usable)");
  const Context ctx = gpu ? Context::cuda(re.rank) : Context::cpu();
  std::ostream silent(nullptr);
  std::ostream& out = re.rank == 0 ? out_rank0 : silent;
  const DType act = gpu ? DType::BF16 : DType::F32;  // the CPU reference backend runs exact f32
  const int steps = o.steps > 0 ? o.steps : (gpu ? 300 : 200);
  const std::int64_t tokens = o.tokens > 0 ? o.tokens : (gpu ? 2048 : 64);
  const Source src = !o.path.empty() ? from_file(o.path)
                                     : embedded_mlp(o.hidden > 0 ? o.hidden : (gpu ? 1024 : 128),
                                                    o.intermediate > 0 ? o.intermediate : (gpu ? 2816 : 352), o.seed);
  const LoraConfig cfg{o.rank, 2.0f * static_cast<float>(o.rank), 0.0f, act, gpu ? MathMode::BF16 : MathMode::FP32,
                       o.seed};
  const int r_true = std::max(1, o.rank / 2);
  if (tokens % world != 0)
    fail(ErrorCode::InvalidArgument, "--tokens " + std::to_string(tokens) + " is not a multiple of --gpus " +
                                         std::to_string(world) + " (each GPU takes an equal share of a batch)");
  const std::int64_t local = tokens / world, row0 = re.rank * local;
  std::optional<Communicator> comm;
  if (world > 1) {
    const char* rendezvous = std::getenv("QMM_RENDEZVOUS");
    if (!rendezvous || !*rendezvous) fail(ErrorCode::InvalidArgument, "QMM_RENDEZVOUS is not set for the ranks");
    comm.emplace(ctx, re.rank, world, rendezvous);
  }

  std::mt19937_64 rng(o.seed ^ 0x5EEDC0DEull);
  std::vector<Projection> proj;
  std::vector<BaseWeight> nf4_bases, dense_targets;
  for (std::size_t p = 0; p < src.dense.size(); ++p)
    proj.push_back(make_projection(ctx, src, p, cfg, r_true, act, rng));
  for (const Projection& p : proj) {
    nf4_bases.emplace_back(p.base);
    dense_targets.emplace_back(p.target);
  }
  const Tensor bias = src.bias.defined() ? to_device(src.bias, ctx.device()) : Tensor();
  // The student learns; the teacher (B = 0: its dense base alone) makes the targets; `best` is the floor.
  Net student(ctx, nf4_bases, cfg, bias), teacher(ctx, dense_targets, cfg, bias), best(ctx, nf4_bases, cfg, bias);
  for (std::size_t p = 0; p < proj.size(); ++p) best.layers()[p]->load_adapters(proj[p].a_true, proj[p].b_true);

  // Losses are compared on held-out batches: on the training batches, adapter rank beyond the change's can fit
  // part of the NF4 error and pass the floor.
  const std::int64_t in = src.dense.back().dim(src.mlp() ? 0 : 1), out_f = src.mlp() ? in : src.dense[0].dim(0);
  const int batches = std::min(steps, kMaxBatches);
  std::mt19937_64 data_rng(o.seed ^ 0xDA7Aull);
  const Data train = make_data(ctx, teacher, batches, {tokens, in}, {tokens, out_f}, act, data_rng);
  const Data held_out = make_data(ctx, teacher, kEvalBatches, {tokens, in}, {tokens, out_f}, act, data_rng);
  const Tensor y(act, {tokens, out_f}, ctx.device()), y_local(act, {local, out_f}, ctx.device());
  const Tensor losses(DType::F32, {std::max(steps, kEvalBatches)}, ctx.device());
  student.reserve(tokens);
  const double start = eval_loss(ctx, student, held_out, y, losses);
  const double floor = eval_loss(ctx, best, held_out, y, losses);

  const std::size_t frozen = student.sum(&LoraLinear::frozen_bytes), bf16 = student.sum(&LoraLinear::frozen_bf16_bytes);
  const std::int64_t trainable = student.sum(&LoraLinear::trainable_parameters);
  // Per adapter parameter: fp32 master, gradient and two moments, plus a bf16 working copy with bf16 activations.
  const std::size_t adapters = static_cast<std::size_t>(trainable) * (act == DType::BF16 ? 18 : 16);
  // Constant after reserve() (a step allocates nothing), so the lines show the total and the header its parts.
  auto total_memory = [&] { return bytes_str(frozen + adapters + student.saved_bytes() + student.scratch_bytes()); };
  const long long h_or_k = in, i_or_n = src.dense[0].dim(0);
  out << "qmm finetune: QLoRA on the " << src.what << "\n"
      << "  device     " << ctx.device().str() << " (" << (gpu ? ctx.device_name() : "reference backend") << "), "
      << dtype_name(act) << " activations" << (gpu ? "" : ", FP32 math") << "\n"
      << (src.mlp() ? fmt("  model      SwiGLU MLP H=%lld I=%lld, NF4 bases (double-quantized), LoRA rank %d "
                          "alpha %.0f on gate, up, down\n", h_or_k, i_or_n, o.rank, cfg.alpha)
                    : fmt("  model      linear %lld -> %lld%s, NF4 base, LoRA rank %d alpha %.0f\n", h_or_k, i_or_n,
                          bias.defined() ? " + bias" : "", o.rank, cfg.alpha))
      << "  frozen     " << bytes_str(frozen) << " as NF4 vs " << bytes_str(bf16) << " as bf16"
      << fmt(" (%.2fx smaller)\n", static_cast<double>(bf16) / static_cast<double>(frozen))
      << "  trainable  " << trainable << " parameters; the target is the base + a hidden rank-" << r_true
      << " change\n"
      << fmt("  training   %d steps of %lld tokens (%d fixed batches, %d held out), AdamW lr %g (warmup, cosine), "
             "seed %llu\n", steps, static_cast<long long>(tokens), batches, kEvalBatches, o.lr,
             static_cast<unsigned long long>(o.seed))
      << (world > 1 ? fmt("  parallel   data parallel on %d GPUs (one process each, NCCL all-reduce of the adapter "
                          "gradients), %lld tokens per GPU per step\n", world, static_cast<long long>(local))
                    : std::string())
      << "  memory     " << total_memory() << " = " << bytes_str(frozen) << " frozen + " << bytes_str(adapters)
      << " adapters/optimizer + " << bytes_str(student.saved_bytes()) << " saved activations + "
      << bytes_str(student.scratch_bytes()) << " scratch\n"
      << fmt("  held out   start loss %.6g (the NF4 base alone), floor %.6g (NF4 base + the exact change as "
             "adapters)\n", start, floor)
      << std::flush;

  AdamWOptions adamw;
  adamw.lr = o.lr;
  AdamW opt(ctx, adamw);
  student.add_to(opt);
  if (comm) opt.all_reduce_with(&*comm);
  std::vector<TensorView> masters;  // the fp32 adapters, compared across the ranks
  for (LoraLinear* l : student.layers())
    for (const AdamWParam& p : l->parameters()) masters.push_back(p.param);
  int logged = 0;  // steps whose loss has been read back
  auto t0 = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    const std::size_t b = static_cast<std::size_t>(step % batches);
    opt.options().lr = lr_at(step, steps, o.lr);
    const TensorView x = rows(train.x[b], row0, local), target = rows(train.target[b], row0, local);
    student.forward(x, y_local, ForwardMode::Train);
    mse_loss(ctx, y_local, target, slot(losses, step), y_local);  // y_local becomes dy
    student.backward(x, y_local);
    opt.step();
    opt.zero_grad();
    if ((step + 1) % o.log_every != 0 && step + 1 != steps) continue;
    // The only read-back: it waits for the device, which is also what makes tokens/s honest. With several ranks
    // the losses are first averaged over them (the global batch's loss), and the adapters are checked identical.
    if (comm) {
      comm->all_reduce_mean({slot(losses, logged, step + 1 - logged)});
      if (!comm->same_on_all_ranks(masters))
        fail(ErrorCode::Distributed, fmt("the adapters differ between the ranks after step %d", step + 1));
    }
    const double loss = mean_loss(ctx, losses, logged, step + 1 - logged);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string line = fmt("step %5d/%d  loss %-10.6g %9.0f tokens/s  mem ", step + 1, steps, loss,
                                 static_cast<double>(tokens) * (step + 1 - logged) / secs) + total_memory();
    if (tty) out << "\r\033[K" << line << "\n" << bar(step + 1, steps) << std::flush;
    else out << line << "\n";
    logged = step + 1;
    t0 = std::chrono::steady_clock::now();
  }
  if (tty) out << "\r\033[K";

  const FinetuneResult r{start, eval_loss(ctx, student, held_out, y, losses), floor};
  out << fmt("final loss %.6g = %.3g%% of the start %.6g; floor %.6g (final/floor %.3g)\n", r.final_loss,
             100.0 * r.final_loss / r.start_loss, r.start_loss, r.floor_loss, r.final_loss / r.floor_loss);
  return r;
}

int run_finetune(const FinetuneOptions& opts, const std::vector<std::string>& argv) {
  if (opts.gpus > 1 && std::getenv("QMM_WORLD_SIZE") == nullptr) {  // the supervisor: start the ranks
    const int have = opts.cpu ? 0 : Context::cuda_device_count();
    if (have < opts.gpus)
      fail(ErrorCode::Unsupported, "--gpus " + std::to_string(opts.gpus) + " needs that many GPUs (this machine "
                                   "has " + std::to_string(have) + " usable)");
    const std::string rendezvous = "/tmp/qmm-rendezvous-" + std::to_string(getpid());
    std::remove(rendezvous.c_str());
    setenv("QMM_RENDEZVOUS", rendezvous.c_str(), 1);
    std::vector<std::string> args = argv;
    args.at(0) = "/proc/self/exe";  // this very program, wherever it was started from
    try {
      run_ranks(args, opts.gpus);
    } catch (...) {
      std::remove(rendezvous.c_str());
      throw;
    }
    std::remove(rendezvous.c_str());
    return 0;
  }
  const bool rank0 = rank_env().rank == 0;
  const FinetuneResult r = finetune(opts, std::cout, rank0 && isatty(STDOUT_FILENO) != 0);
  if (std::isfinite(r.final_loss) && r.final_loss < r.start_loss) return 0;
  std::cerr << "qmm finetune: the loss did not fall (start " << r.start_loss << ", final " << r.final_loss << ")\n";
  return 1;
}

}  // namespace qmm::tool
