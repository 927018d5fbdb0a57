// qmm check: every op on every available device against an oracle, at a few realistic sizes.
// On the GPU the oracle is the CPU backend; the CPU backend itself is checked against naive loops written here,
// independent of src/cpu/, with the same rounding contracts.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "commands.h"
#include "qmm/qmm.h"

namespace qmm::tool {
namespace {

using Outputs = std::vector<Tensor>;
using Reference = std::vector<std::vector<double>>;

struct Case {
  std::string op;
  std::string shape;
  std::function<Outputs(const Context&)> run;  // runs the op on ctx; returns its outputs (on ctx's device)
  std::function<Reference()> naive;            // independent host reference
  double tol_cpu;                              // relative Frobenius error limits
  double tol_gpu;
};

double value_at(const Tensor& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::F32: return t.data_as<float>()[i];
    case DType::BF16: return bf16_to_float(t.data_as<std::uint16_t>()[i]);
    case DType::F16: return f16_to_float(t.data_as<std::uint16_t>()[i]);
    case DType::U8: return t.data_as<std::uint8_t>()[i];
    case DType::I32: return t.data_as<std::int32_t>()[i];
  }
  return 0;
}

std::vector<double> values(const TensorView& t) {
  Tensor h(t.dtype(), t.shape());
  copy(h, t);
  std::vector<double> v(static_cast<std::size_t>(h.numel()));
  for (std::int64_t i = 0; i < h.numel(); ++i) v[static_cast<std::size_t>(i)] = value_at(h, i);
  return v;
}

Tensor random(DType dtype, Shape shape, std::uint64_t seed, float scale = 1.0f) {
  Tensor t(dtype, shape);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const float x = dist(rng);
    if (dtype == DType::F32) t.data_as<float>()[i] = x;
    else t.data_as<std::uint16_t>()[i] = float_to_bf16(x);
  }
  return t;
}

Tensor on(const Context& ctx, const TensorView& host) { return to_device(host, ctx.device()); }

Tensor poisoned(const Context& ctx, DType dtype, Shape shape) {
  Tensor h(dtype, shape);
  for (std::int64_t i = 0; i < h.numel(); ++i) {
    if (dtype == DType::F32) h.data_as<float>()[i] = std::nanf("");
    else h.data_as<std::uint16_t>()[i] = 0x7FC0;
  }
  return on(ctx, h);
}

Nf4Tensor nf4_on(const Context& ctx, const Nf4Tensor& w) {
  Nf4Tensor out = w;
  out.codes = on(ctx, w.codes);
  out.absmax = on(ctx, w.absmax);
  if (w.absmax2.defined()) out.absmax2 = on(ctx, w.absmax2);
  if (w.code2.defined()) out.code2 = on(ctx, w.code2);
  return out;
}

// Operand roundings of the contracts, written out again here on purpose (independent of the library's).
double as_operand(double x, MathMode math, DType storage) {
  if (storage == DType::BF16) return x;  // already exact bf16
  const float f = static_cast<float>(x);
  switch (math) {
    case MathMode::FP32: return f;
    case MathMode::TF32: return round_to_tf32(f);
    case MathMode::BF16: return bf16_to_float(float_to_bf16_trunc(f));
  }
  return f;
}
double round_to_bf16(double x) { return bf16_to_float(float_to_bf16(static_cast<float>(x))); }

// Naive row-major C[m,n] = sum_k A(i,k) B(k,j) with accessors.
std::vector<double> naive_gemm(std::int64_t m, std::int64_t n, std::int64_t k,
                               const std::function<double(std::int64_t, std::int64_t)>& a,
                               const std::function<double(std::int64_t, std::int64_t)>& b) {
  std::vector<double> bt(static_cast<std::size_t>(n * k));
  for (std::int64_t p = 0; p < k; ++p)
    for (std::int64_t j = 0; j < n; ++j) bt[static_cast<std::size_t>(j * k + p)] = b(p, j);
  std::vector<double> c(static_cast<std::size_t>(m * n));
#pragma omp parallel for
  for (std::int64_t i = 0; i < m; ++i) {
    std::vector<double> row(static_cast<std::size_t>(k));
    for (std::int64_t p = 0; p < k; ++p) row[static_cast<std::size_t>(p)] = a(i, p);
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0;
      const double* bj = &bt[static_cast<std::size_t>(j * k)];
      for (std::int64_t p = 0; p < k; ++p) s += row[static_cast<std::size_t>(p)] * bj[p];
      c[static_cast<std::size_t>(i * n + j)] = s;
    }
  }
  return c;
}

std::vector<double> dequant_naive(const Nf4Tensor& w) {
  const Nf4Weight v = w.view();
  std::vector<double> out(static_cast<std::size_t>(v.numel()));
  for (std::int64_t e = 0; e < v.numel(); ++e) {
    const float scale = nf4_block_scale(v, e / v.block_size);
    out[static_cast<std::size_t>(e)] = nf4_code_value(nf4_unpack(w.codes.data_as<std::uint8_t>(), e)) * scale;
  }
  return out;
}

std::string dims(std::int64_t m, std::int64_t k, std::int64_t n) {
  return std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
}

void add_dense_cases(std::vector<Case>& cases, std::int64_t m, std::int64_t k, std::int64_t n) {
  struct Mode {
    DType dtype;
    MathMode math;
    const char* name;
  };
  const Mode modes[] = {{DType::F32, MathMode::FP32, "f32/fp32"},
                        {DType::F32, MathMode::TF32, "f32/tf32"},
                        {DType::F32, MathMode::BF16, "f32/bf16"},
                        {DType::BF16, MathMode::FP32, "bf16"}};
  for (const Mode& mode : modes) {
    const double tol_c = mode.dtype == DType::BF16 ? 5e-3 : 1e-6;  // bf16 output rounding, else fp32 rounding
    const double tol_g = mode.dtype == DType::BF16 ? 8e-3 : (mode.math == MathMode::TF32 ? 2e-3 : 1e-5);
    const DType dt = mode.dtype;
    const MathMode math = mode.math;
    auto A = std::make_shared<Tensor>(random(dt, {m, k}, 11));
    auto B = std::make_shared<Tensor>(random(dt, {k, n}, 12));
    auto Bt = std::make_shared<Tensor>(random(dt, {n, k}, 13));
    auto dC = std::make_shared<Tensor>(random(dt, {m, n}, 14));
    auto dA0 = std::make_shared<Tensor>(random(dt, {m, k}, 15));
    auto op = [&](const Tensor& t) { return [t, math, dt](std::int64_t i) { return as_operand(value_at(t, i), math, dt); }; };
    auto fa = op(*A), fb = op(*B), fbt = op(*Bt), fdc = op(*dC);
    auto finish = [dt](std::vector<double> c) {
      if (dt == DType::BF16) for (double& x : c) x = round_to_bf16(x);
      return Reference{c};
    };
    cases.push_back({std::string("gemm ") + mode.name, dims(m, k, n),
                     [=](const Context& ctx) {
                       Tensor a = on(ctx, *A), b = on(ctx, *B), c = poisoned(ctx, dt, {m, n});
                       gemm(ctx, a, b, c, {1, 0, math});
                       return Outputs{c};
                     },
                     [=] { return finish(naive_gemm(m, n, k, [&](auto i, auto p) { return fa(i * k + p); },
                                                    [&](auto p, auto j) { return fb(p * n + j); })); },
                     tol_c, tol_g});
    cases.push_back({std::string("gemm_bt ") + mode.name, dims(m, k, n),
                     [=](const Context& ctx) {
                       Tensor a = on(ctx, *A), b = on(ctx, *Bt), c = poisoned(ctx, dt, {m, n});
                       gemm_bt(ctx, a, b, c, {1, 0, math});
                       return Outputs{c};
                     },
                     [=] { return finish(naive_gemm(m, n, k, [&](auto i, auto p) { return fa(i * k + p); },
                                                    [&](auto p, auto j) { return fbt(j * k + p); })); },
                     tol_c, tol_g});
    // dA += dC * B^T (accumulating into a random dA)
    cases.push_back({std::string("gemm_backward_a+= ") + mode.name, dims(m, n, k),
                     [=](const Context& ctx) {
                       Tensor dc = on(ctx, *dC), b = on(ctx, *B), da = on(ctx, *dA0);
                       gemm_backward_a(ctx, dc, b, da, {1, 1, math});
                       return Outputs{da};
                     },
                     [=] {
                       auto c = naive_gemm(m, k, n, [&](auto i, auto p) { return fdc(i * n + p); },
                                           [&](auto p, auto j) { return fb(j * n + p); });
                       for (std::int64_t i = 0; i < m * k; ++i) c[static_cast<std::size_t>(i)] += value_at(*dA0, i);
                       return finish(c);
                     },
                     tol_c, tol_g});
    cases.push_back({std::string("gemm_backward_b ") + mode.name, dims(k, m, n),
                     [=](const Context& ctx) {
                       Tensor a = on(ctx, *A), dc = on(ctx, *dC), db = poisoned(ctx, dt, {k, n});
                       gemm_backward_b(ctx, a, dc, db, {1, 0, math});
                       return Outputs{db};
                     },
                     [=] { return finish(naive_gemm(k, n, m, [&](auto i, auto p) { return fa(p * k + i); },
                                                    [&](auto p, auto j) { return fdc(p * n + j); })); },
                     tol_c, tol_g});
  }
}

void add_batched_case(std::vector<Case>& cases, std::int64_t bsz, std::int64_t heads, std::int64_t seq,
                      std::int64_t hd) {
  auto Q = std::make_shared<Tensor>(random(DType::BF16, {bsz, heads, seq, hd}, 21));
  auto K = std::make_shared<Tensor>(random(DType::BF16, {bsz, heads, seq, hd}, 22));
  const std::string shape = std::to_string(bsz) + "x" + std::to_string(heads) + "x" + std::to_string(seq) + "x" +
                            std::to_string(hd);
  cases.push_back({"batched_gemm Q*K^T bf16", shape,
                   [=](const Context& ctx) {
                     Tensor q = on(ctx, *Q), kk = on(ctx, *K), s = poisoned(ctx, DType::F32, {bsz, heads, seq, seq});
                     batched_gemm(ctx, q, kk, s, true);
                     return Outputs{s};
                   },
                   [=] {
                     std::vector<double> out;
                     for (std::int64_t b = 0; b < bsz * heads; ++b) {
                       const std::int64_t off = b * seq * hd;
                       auto c = naive_gemm(seq, seq, hd, [&](auto i, auto p) { return value_at(*Q, off + i * hd + p); },
                                           [&](auto p, auto j) { return value_at(*K, off + j * hd + p); });
                       out.insert(out.end(), c.begin(), c.end());
                     }
                     return Reference{out};
                   },
                   1e-6, 1e-5});
}

double silu(double x) { return x / (1.0 + std::exp(-x)); }

void add_swiglu_cases(std::vector<Case>& cases, std::int64_t n) {
  for (DType dt : {DType::F32, DType::BF16}) {
    auto G = std::make_shared<Tensor>(random(dt, {n}, 31, 3.0f));
    auto U = std::make_shared<Tensor>(random(dt, {n}, 32));
    auto DH = std::make_shared<Tensor>(random(dt, {n}, 33));
    const double tol = dt == DType::BF16 ? 5e-3 : 1e-6;
    auto fin = [dt](double x) { return dt == DType::BF16 ? round_to_bf16(x) : static_cast<double>(static_cast<float>(x)); };
    cases.push_back({std::string("swiglu ") + dtype_name(dt), std::to_string(n),
                     [=](const Context& ctx) {
                       Tensor g = on(ctx, *G), u = on(ctx, *U), h = poisoned(ctx, dt, {n});
                       swiglu(ctx, g, u, h);
                       return Outputs{h};
                     },
                     [=] {
                       std::vector<double> h(static_cast<std::size_t>(n));
                       for (std::int64_t i = 0; i < n; ++i)
                         h[static_cast<std::size_t>(i)] = fin(silu(value_at(*G, i)) * value_at(*U, i));
                       return Reference{h};
                     },
                     tol, tol});
    cases.push_back({std::string("swiglu_backward ") + dtype_name(dt), std::to_string(n),
                     [=](const Context& ctx) {
                       Tensor g = on(ctx, *G), u = on(ctx, *U), dh = on(ctx, *DH);
                       Tensor dg = poisoned(ctx, dt, {n}), du = poisoned(ctx, dt, {n});
                       swiglu_backward(ctx, g, u, dh, dg, du);
                       return Outputs{dg, du};
                     },
                     [=] {
                       std::vector<double> dg(static_cast<std::size_t>(n)), du(static_cast<std::size_t>(n));
                       for (std::int64_t i = 0; i < n; ++i) {
                         const double x = value_at(*G, i), s = 1.0 / (1.0 + std::exp(-x));
                         dg[static_cast<std::size_t>(i)] = fin(value_at(*DH, i) * value_at(*U, i) * s * (1 + x * (1 - s)));
                         du[static_cast<std::size_t>(i)] = fin(value_at(*DH, i) * x * s);
                       }
                       return Reference{dg, du};
                     },
                     tol, tol});
  }
}

void add_nf4_cases(std::vector<Case>& cases, std::int64_t m, std::int64_t k, std::int64_t n) {
  const Context cpu = Context::cpu();
  auto Wg = std::make_shared<Tensor>(random(DType::BF16, {n, k}, 41, 0.02f));
  auto Wu = std::make_shared<Tensor>(random(DType::BF16, {n, k}, 42, 0.02f));
  auto Qg = std::make_shared<Nf4Tensor>(nf4_quantize(cpu, *Wg, true));
  auto Qu = std::make_shared<Nf4Tensor>(nf4_quantize(cpu, *Wu, true));
  auto A = std::make_shared<Tensor>(random(DType::BF16, {m, k}, 43));
  auto dC = std::make_shared<Tensor>(random(DType::BF16, {m, n}, 44));
  auto Wdq = std::make_shared<std::vector<double>>(dequant_naive(*Qg));
  auto Wuq = std::make_shared<std::vector<double>>(dequant_naive(*Qu));
  const std::string shape = dims(m, k, n);

  cases.push_back({"nf4_quantize (dq) + dequantize bf16", std::to_string(n) + "x" + std::to_string(k),
                   [=](const Context& ctx) {
                     Tensor w = on(ctx, *Wg);
                     Nf4Tensor q = nf4_quantize(ctx, w, true);
                     Tensor out = poisoned(ctx, DType::BF16, {n, k});
                     nf4_dequantize(ctx, q, out);
                     return Outputs{out};
                   },
                   [=] {
                     std::vector<double> r(*Wdq);
                     for (double& x : r) x = round_to_bf16(x);
                     return Reference{r};
                   },
                   0.0, 0.0});  // byte-identical codes and scales give identical values
  auto gemm_ref = [=](const std::vector<double>& w) {  // A * round_bf16(W)^T, f32 out
    return naive_gemm(m, n, k, [&](auto i, auto p) { return value_at(*A, i * k + p); },
                      [&](auto p, auto j) { return round_to_bf16(w[static_cast<std::size_t>(j * k + p)]); });
  };
  auto f32 = [](std::vector<double> v) { for (double& x : v) x = static_cast<float>(x); return v; };
  // The GPU's small-M forward (M <= 16, bf16 A) applies each block's scale after its product (ops.h): its weights
  // are bf16(code) * scale rather than bf16(code * scale), both within 2^-9 of code * scale, which leaves ~2e-3
  // relative Frobenius error against this reference (measured at 1x1536x4096).
  const double tol_forward_gpu = m <= 16 ? 5e-3 : 1e-5;
  cases.push_back({"nf4_gemm bf16->f32", shape,
                   [=](const Context& ctx) {
                     Tensor a = on(ctx, *A), c = poisoned(ctx, DType::F32, {m, n});
                     nf4_gemm(ctx, a, nf4_on(ctx, *Qg), c);
                     return Outputs{c};
                   },
                   [=] { return Reference{f32(gemm_ref(*Wdq))}; }, 1e-6, tol_forward_gpu});
  cases.push_back({"nf4_gemm_backward_a bf16->f32", dims(m, n, k),
                   [=](const Context& ctx) {
                     Tensor dc = on(ctx, *dC), da = poisoned(ctx, DType::F32, {m, k});
                     nf4_gemm_backward_a(ctx, dc, nf4_on(ctx, *Qg), da);
                     return Outputs{da};
                   },
                   [=] {
                     return Reference{f32(naive_gemm(m, k, n, [&](auto i, auto p) { return value_at(*dC, i * n + p); },
                                                     [&](auto p, auto j) {
                                                       return round_to_bf16((*Wdq)[static_cast<std::size_t>(p * k + j)]);
                                                     }))};
                   },
                   1e-6, 1e-5});
  cases.push_back({"nf4_gate_up + swiglu f32", shape,
                   [=](const Context& ctx) {
                     Tensor a = on(ctx, *A);
                     Tensor g = poisoned(ctx, DType::F32, {m, n}), u = poisoned(ctx, DType::F32, {m, n}),
                            h = poisoned(ctx, DType::F32, {m, n});
                     nf4_gate_up(ctx, a, nf4_on(ctx, *Qg), nf4_on(ctx, *Qu), {g, u, h});
                     return Outputs{g, u, h};
                   },
                   [=] {
                     auto g = f32(gemm_ref(*Wdq)), u = f32(gemm_ref(*Wuq));
                     std::vector<double> h(g.size());
                     for (std::size_t i = 0; i < g.size(); ++i) h[i] = static_cast<float>(silu(g[i]) * u[i]);
                     return Reference{g, u, h};
                   },
                   1e-6, tol_forward_gpu});
}

// Train ops. n elements for the element-wise ops; AdamW over rank-16 adapter factors of a [hidden, inter] MLP.
void add_train_cases(std::vector<Case>& cases, std::int64_t n, std::int64_t hidden, std::int64_t inter) {
  const std::string len = std::to_string(n);
  auto X = std::make_shared<Tensor>(random(DType::F32, {n}, 51));
  auto Y = std::make_shared<Tensor>(random(DType::F32, {n}, 52));
  auto Xb = std::make_shared<Tensor>(random(DType::BF16, {n}, 53));
  auto each = [](std::int64_t count, const std::function<double(std::int64_t)>& f) {
    std::vector<double> v(static_cast<std::size_t>(count));
    for (std::int64_t i = 0; i < count; ++i) v[static_cast<std::size_t>(i)] = f(i);
    return v;
  };
  cases.push_back({"cast f32->bf16", len,
                   [=](const Context& ctx) {
                     Tensor out = poisoned(ctx, DType::BF16, {n});
                     cast(ctx, on(ctx, *X), out);
                     return Outputs{out};
                   },
                   [=] { return Reference{each(n, [&](auto i) { return round_to_bf16(value_at(*X, i)); })}; }, 0.0,
                   0.0});
  cases.push_back({"add f32 (alpha -0.5)", len,
                   [=](const Context& ctx) {
                     Tensor out = poisoned(ctx, DType::F32, {n});
                     add(ctx, on(ctx, *X), on(ctx, *Y), out, -0.5f);
                     return Outputs{out};
                   },
                   [=] {
                     return Reference{each(n, [&](auto i) {
                       return static_cast<double>(static_cast<float>(value_at(*X, i) - 0.5 * value_at(*Y, i)));
                     })};
                   },
                   1e-7, 1e-7});
  const std::int64_t cols = 1000, rows = n / cols;
  auto Bias = std::make_shared<Tensor>(random(DType::F32, {cols}, 54));
  cases.push_back({"add_bias bf16 + f32 bias", std::to_string(rows) + "x" + std::to_string(cols),
                   [=](const Context& ctx) {
                     Tensor y = on(ctx, TensorView(Xb->data(), DType::BF16, {rows, cols}));
                     add_bias(ctx, y, on(ctx, *Bias));
                     return Outputs{y};
                   },
                   [=] {
                     return Reference{each(rows * cols, [&](auto i) {
                       return round_to_bf16(value_at(*Xb, i) + value_at(*Bias, i % cols));
                     })};
                   },
                   1e-3, 1e-3});  // one bf16 rounding of the same sum; differs at most by a rare last-bit tie
  cases.push_back({"dropout bf16 p=0.1", len,
                   [=](const Context& ctx) {
                     Tensor out = poisoned(ctx, DType::BF16, {n});
                     dropout(ctx, on(ctx, *Xb), out, 0.1f, 2024);
                     return Outputs{out};
                   },
                   [=] {
                     const double scale = 1.0f / 0.9f;  // the fp32 scale the contract multiplies by
                     return Reference{each(n, [&](auto i) {
                       return dropout_keep(2024, i, 0.1f) ? round_to_bf16(value_at(*Xb, i) * scale) : 0.0;
                     })};
                   },
                   0.0, 0.0});  // one mask definition, one rounding: identical everywhere
  cases.push_back({"mse_loss f32 (loss, dy)", len,
                   [=](const Context& ctx) {
                     Tensor loss = poisoned(ctx, DType::F32, {1}), dy = poisoned(ctx, DType::F32, {n});
                     mse_loss(ctx, on(ctx, *X), on(ctx, *Y), loss, dy);
                     return Outputs{loss, dy};
                   },
                   [=] {
                     double sum = 0;
                     for (std::int64_t i = 0; i < n; ++i) sum += std::pow(value_at(*X, i) - value_at(*Y, i), 2);
                     return Reference{{static_cast<float>(sum / n)}, each(n, [&](auto i) {
                                        return static_cast<double>(
                                            static_cast<float>(2.0 * (value_at(*X, i) - value_at(*Y, i)) / n));
                                      })};
                   },
                   1e-6, 1e-6});
  cases.push_back({"grad_norm f32 + bf16", len + "+" + len,
                   [=](const Context& ctx) {
                     Tensor norm = poisoned(ctx, DType::F32, {1});
                     const Tensor a = on(ctx, *X), b = on(ctx, *Xb);
                     const TensorView grads[] = {a, b};
                     grad_norm(ctx, grads, norm);
                     return Outputs{norm};
                   },
                   [=] {
                     double sum = 0;
                     for (std::int64_t i = 0; i < n; ++i) sum += value_at(*X, i) * value_at(*X, i);
                     for (std::int64_t i = 0; i < n; ++i) sum += value_at(*Xb, i) * value_at(*Xb, i);
                     return Reference{{static_cast<float>(std::sqrt(sum))}};
                   },
                   1e-6, 1e-6});
  // AdamW, one step from zero moments with weight decay and active clipping (the gradients' norm is ~sqrt(numel)
  // times 0.01); outputs the norm, then every parameter and both moments.
  const std::vector<Shape> shapes = {{16, hidden}, {inter, 16}, {16, hidden}, {inter, 16}, {16, inter}, {hidden, 16}};
  auto P = std::make_shared<std::vector<Tensor>>(), G = std::make_shared<std::vector<Tensor>>();
  for (std::size_t k = 0; k < shapes.size(); ++k) {
    P->push_back(random(DType::F32, shapes[k], 60 + k, 0.02f));
    G->push_back(random(DType::F32, shapes[k], 70 + k, 0.01f));
  }
  const AdamWOptions opts{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1.0f};
  std::int64_t params = 0;
  for (const Shape& sh : shapes) params += sh.numel();
  cases.push_back({"adamw_step clip+decay (6 tensors)", std::to_string(params),
                   [=](const Context& ctx) {
                     Outputs out{poisoned(ctx, DType::F32, {1})};
                     std::vector<AdamWParam> ps;
                     std::vector<Tensor> grads;  // alive until the step is enqueued (views do not own memory)
                     for (std::size_t k = 0; k < shapes.size(); ++k) {
                       Tensor p = on(ctx, (*P)[k]), g = on(ctx, (*G)[k]);
                       Tensor m = on(ctx, Tensor(DType::F32, shapes[k])), v = on(ctx, Tensor(DType::F32, shapes[k]));
                       zero(ctx, m);
                       zero(ctx, v);
                       ps.push_back({p, g, m, v});
                       out.insert(out.end(), {p, m, v});
                       grads.push_back(g);
                     }
                     adamw_step(ctx, ps, opts, 1, out[0]);
                     return out;
                   },
                   [=] {
                     double sum = 0;
                     for (const Tensor& g : *G)
                       for (std::int64_t i = 0; i < g.numel(); ++i) sum += value_at(g, i) * value_at(g, i);
                     const double norm = std::sqrt(sum), clip = std::min(1.0, opts.max_grad_norm / (norm + 1e-6));
                     const double lr = opts.lr, b1 = opts.beta1, b2 = opts.beta2, wd = opts.weight_decay;
                     Reference ref{{static_cast<float>(norm)}};
                     for (std::size_t k = 0; k < shapes.size(); ++k) {
                       std::vector<double> p, m, v;
                       for (std::int64_t i = 0; i < (*P)[k].numel(); ++i) {
                         const double g = value_at((*G)[k], i) * clip;
                         const double mk = (1 - b1) * g, vk = (1 - b2) * g * g;
                         const double w = value_at((*P)[k], i) * (1 - lr * wd);
                         // Step 1: the bias corrections divide by exactly the (1 - beta) factors.
                         p.push_back(static_cast<float>(w - lr * (mk / (1 - b1)) / (std::sqrt(vk / (1 - b2)) + opts.eps)));
                         m.push_back(static_cast<float>(mk));
                         v.push_back(static_cast<float>(vk));
                       }
                       ref.insert(ref.end(), {p, m, v});
                     }
                     return ref;
                   },
                   1e-6, 1e-5});  // fp64 with one rounding vs the GPU's fp32 chain (~10 roundings in the update)
  cases.push_back({"zero bf16", len,
                   [=](const Context& ctx) {
                     Tensor t = on(ctx, *Xb);
                     zero(ctx, t);
                     return Outputs{t};
                   },
                   [=] { return Reference{std::vector<double>(static_cast<std::size_t>(n), 0.0)}; }, 0.0, 0.0});
}

struct Result {
  double rel = 0;
  bool finite = true;
};

// linear_cross_entropy: loss and dh against the definition.
void add_loss_cases(std::vector<Case>& cases, std::int64_t t, std::int64_t hidden, std::int64_t vocab) {
  auto H = std::make_shared<Tensor>(random(DType::F32, {t, hidden}, 91));
  auto W = std::make_shared<Tensor>(random(DType::F32, {vocab, hidden}, 92));
  auto L = std::make_shared<Tensor>(DType::I32, Shape{t});
  for (std::int64_t i = 0; i < t; ++i)  // every fifth token ignored
    L->data_as<std::int32_t>()[i] = i % 5 == 2 ? -100 : static_cast<std::int32_t>((i * 7919) % vocab);
  cases.push_back({"linear_cross_entropy f32 (loss, dh)", dims(t, hidden, vocab),
                   [=](const Context& ctx) {
                     Tensor loss = poisoned(ctx, DType::F32, {1}), dh = poisoned(ctx, DType::F32, {t, hidden});
                     linear_cross_entropy(ctx, on(ctx, *H), on(ctx, *W), on(ctx, *L), loss, dh);
                     return Outputs{loss, dh};
                   },
                   [=] {
                     std::vector<double> dh(static_cast<std::size_t>(t * hidden), 0.0);
                     double total = 0;
                     std::int64_t n = 0;
                     for (std::int64_t i = 0; i < t; ++i) n += L->data_as<std::int32_t>()[i] != -100;
                     for (std::int64_t i = 0; i < t; ++i) {
                       const std::int32_t y = L->data_as<std::int32_t>()[i];
                       if (y == -100) continue;
                       std::vector<double> p(static_cast<std::size_t>(vocab));
                       double sum = 0;
                       for (std::int64_t v = 0; v < vocab; ++v) {
                         double z = 0;
                         for (std::int64_t k = 0; k < hidden; ++k)
                           z += value_at(*H, i * hidden + k) * value_at(*W, v * hidden + k);
                         p[static_cast<std::size_t>(v)] = std::exp(z);  // random(±1) inputs: no overflow
                         sum += p[static_cast<std::size_t>(v)];
                       }
                       total -= std::log(p[static_cast<std::size_t>(y)] / sum);
                       for (std::int64_t v = 0; v < vocab; ++v) {
                         const double g = (p[static_cast<std::size_t>(v)] / sum - (v == y)) / static_cast<double>(n);
                         for (std::int64_t k = 0; k < hidden; ++k)
                           dh[static_cast<std::size_t>(i * hidden + k)] += g * value_at(*W, v * hidden + k);
                       }
                     }
                     return Reference{{total / static_cast<double>(n)}, dh};
                   },
                   1e-6, 1e-5});
}

double rounded_to(DType dtype, double x) { return dtype == DType::BF16 ? round_to_bf16(x) : static_cast<float>(x); }

// RMSNorm's outputs written out from the definitions: y, rstd, dx, dw of rms_norm and its backward on x, or with
// R, h = round(x + R) first and the outputs of add_rms_norm (h, y, rstd) and of the backward on h with DRES added to
// dx (dx, dw); one rounding of each result to its dtype (x·rstd rounded, then ·w, for y).
Reference norm_reference(DType dt, std::int64_t rows, std::int64_t hidden, float eps, const Tensor& X, const Tensor* R,
                         const Tensor& W, const Tensor& DY, const Tensor* DRES) {
  Reference r(R ? 5 : 4);
  const std::size_t out = R ? 1 : 0;  // y's index
  r[out + 3].assign(static_cast<std::size_t>(hidden), 0.0);
  std::vector<double> x(static_cast<std::size_t>(hidden));
  for (std::int64_t i = 0; i < rows; ++i) {
    double ss = 0, dot = 0;
    for (std::int64_t k = 0; k < hidden; ++k) {
      double v = value_at(X, i * hidden + k);
      if (R) r[0].push_back(v = rounded_to(dt, v + value_at(*R, i * hidden + k)));
      x[static_cast<std::size_t>(k)] = v;
      ss += v * v;
    }
    const double rs = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(hidden) + eps));
    r[out + 1].push_back(rs);
    for (std::int64_t k = 0; k < hidden; ++k) {
      const double xv = x[static_cast<std::size_t>(k)], w = value_at(W, k), dy = value_at(DY, i * hidden + k);
      r[out].push_back(rounded_to(dt, w * rounded_to(dt, xv * rs)));
      dot += dy * w * xv * rs;
      r[out + 3][static_cast<std::size_t>(k)] += dy * xv * rs;
    }
    for (std::int64_t k = 0; k < hidden; ++k) {
      const double xv = x[static_cast<std::size_t>(k)], g = value_at(DY, i * hidden + k) * value_at(W, k);
      const double extra = DRES ? value_at(*DRES, i * hidden + k) : 0.0;
      r[out + 2].push_back(rounded_to(dt, rs * (g - xv * rs * dot / static_cast<double>(hidden)) + extra));
    }
  }
  return r;
}

// rms_norm forward and backward (y, rstd, dx, dw), add_rms_norm with the backward's dres (h, y, rstd, dx, dw), and
// rope forward and inverse, both storage dtypes, against the definitions written out here (norm_reference).
// Limits: f32 1e-6; bf16 4e-3 (a rounding of 2^-9 relative on every element, summed in Frobenius norm).
void add_norm_rope_cases(std::vector<Case>& cases, std::int64_t rows, std::int64_t hidden, std::int64_t batch,
                         std::int64_t seq, std::int64_t heads_q, std::int64_t heads_k, std::int64_t head_dim) {
  const float eps = 1e-6f;
  for (DType dt : {DType::F32, DType::BF16}) {
    const double tol = dt == DType::BF16 ? 4e-3 : 1e-6;
    auto X = std::make_shared<Tensor>(random(dt, {rows, hidden}, 71, 2.0f));
    auto W = std::make_shared<Tensor>(random(dt, {hidden}, 72, 0.3f));
    auto DY = std::make_shared<Tensor>(random(dt, {rows, hidden}, 73));
    cases.push_back({std::string("rms_norm+backward ") + dtype_name(dt), dims(rows, hidden, 1),
                     [=](const Context& ctx) {
                       Tensor y = poisoned(ctx, dt, {rows, hidden}), rstd = poisoned(ctx, DType::F32, {rows});
                       Tensor dx = poisoned(ctx, dt, {rows, hidden}), dw = on(ctx, Tensor(DType::F32, {hidden}));
                       zero(ctx, dw);
                       const Tensor x = on(ctx, *X), w = on(ctx, *W);
                       rms_norm(ctx, x, w, y, rstd, eps);
                       rms_norm_backward(ctx, x, w, rstd, on(ctx, *DY), dx, dw);
                       return Outputs{y, rstd, dx, dw};
                     },
                     [=] { return norm_reference(dt, rows, hidden, eps, *X, nullptr, *W, *DY, nullptr); }, tol, tol});
    auto R = std::make_shared<Tensor>(random(dt, {rows, hidden}, 76, 2.0f));
    auto DRES = std::make_shared<Tensor>(random(dt, {rows, hidden}, 77));
    cases.push_back({std::string("add_rms_norm+backward dres ") + dtype_name(dt), dims(rows, hidden, 1),
                     [=](const Context& ctx) {
                       Tensor h = poisoned(ctx, dt, {rows, hidden}), y = poisoned(ctx, dt, {rows, hidden});
                       Tensor rstd = poisoned(ctx, DType::F32, {rows}), dx = poisoned(ctx, dt, {rows, hidden});
                       Tensor dw = on(ctx, Tensor(DType::F32, {hidden}));
                       zero(ctx, dw);
                       const Tensor w = on(ctx, *W);
                       add_rms_norm(ctx, on(ctx, *X), on(ctx, *R), w, h, y, rstd, eps);
                       rms_norm_backward(ctx, h, w, rstd, on(ctx, *DY), dx, dw, on(ctx, *DRES));
                       return Outputs{h, y, rstd, dx, dw};
                     },
                     [=] { return norm_reference(dt, rows, hidden, eps, *X, R.get(), *W, *DY, DRES.get()); }, tol,
                     tol});
    const std::int64_t half = head_dim / 2;
    auto Q = std::make_shared<Tensor>(random(dt, {batch, seq, heads_q, head_dim}, 74));
    auto K = std::make_shared<Tensor>(random(dt, {batch, seq, heads_k, head_dim}, 75));
    auto C = std::make_shared<Tensor>(dt, Shape{1, seq, head_dim});
    auto S = std::make_shared<Tensor>(dt, Shape{1, seq, head_dim});
    for (std::int64_t p = 0; p < seq; ++p)
      for (std::int64_t j = 0; j < head_dim; ++j) {  // Hugging Face's angles: one per column pair, repeated
        const double angle = static_cast<double>(p) * std::pow(10000.0, -2.0 * static_cast<double>(j % half) /
                                                                             static_cast<double>(head_dim));
        const float c = static_cast<float>(std::cos(angle)), sn = static_cast<float>(std::sin(angle));
        if (dt == DType::F32) {
          C->data_as<float>()[p * head_dim + j] = c;
          S->data_as<float>()[p * head_dim + j] = sn;
        } else {
          C->data_as<std::uint16_t>()[p * head_dim + j] = float_to_bf16(c);
          S->data_as<std::uint16_t>()[p * head_dim + j] = float_to_bf16(sn);
        }
      }
    for (bool inverse : {false, true}) {
      cases.push_back({std::string(inverse ? "rope inverse " : "rope ") + dtype_name(dt),
                       dims(batch * seq, heads_q + heads_k, head_dim),
                       [=](const Context& ctx) {
                         Tensor qo = poisoned(ctx, dt, Q->shape()), ko = poisoned(ctx, dt, K->shape());
                         rope(ctx, on(ctx, *Q), on(ctx, *K), on(ctx, *C), on(ctx, *S), qo, ko, inverse);
                         return Outputs{qo, ko};
                       },
                       [=] {
                         Reference r(2);
                         for (int which = 0; which < 2; ++which) {
                           const Tensor& x = which == 0 ? *Q : *K;
                           const std::int64_t heads = which == 0 ? heads_q : heads_k;
                           for (std::int64_t row = 0; row < batch * seq * heads; ++row) {
                             const std::int64_t p = row / heads % seq;
                             for (std::int64_t j = 0; j < head_dim; ++j) {
                               const std::int64_t j1 = j % half, base = row * head_dim;
                               const double x1 = value_at(x, base + j1), x2 = value_at(x, base + j1 + half);
                               const double c = value_at(*C, p * head_dim + j);
                               // sin of the other half: the transpose pairs each column with its partner's
                               const double sn = value_at(*S, p * head_dim + (inverse ? (j < half ? j + half : j1)
                                                                                        : j));
                               const double y = j < half ? x1 * c + (inverse ? x2 : -x2) * sn
                                                         : x2 * c + (inverse ? -x1 : x1) * sn;
                               r[static_cast<std::size_t>(which)].push_back(rounded_to(dt, y));
                             }
                           }
                         }
                         return r;
                       },
                       tol, tol});
    }
  }
}

Result compare(const Outputs& got, const Reference& ref) {
  double d2 = 0, r2 = 0;
  bool finite = true;
  for (std::size_t o = 0; o < got.size(); ++o) {
    const std::vector<double> g = values(got[o]);
    for (std::size_t i = 0; i < g.size(); ++i) {
      if (!std::isfinite(g[i])) finite = false;
      const double d = g[i] - ref[o][i];
      d2 += d * d;
      r2 += ref[o][i] * ref[o][i];
    }
  }
  return {r2 > 0 ? std::sqrt(d2 / r2) : std::sqrt(d2), finite};
}

Reference as_reference(const Outputs& outs) {
  Reference r;
  for (const Tensor& t : outs) r.push_back(values(t));
  return r;
}

}  // namespace

int run_check(const CheckOptions& opts) {
  const Context cpu = Context::cpu();
  std::vector<std::pair<std::string, Context>> devices{{"cpu", cpu}};
  const int gpus = opts.cpu_only ? 0 : Context::cuda_device_count();
  for (int d = 0; d < gpus; ++d) devices.emplace_back("cuda:" + std::to_string(d), Context::cuda(d));
  if (opts.cpu_only) std::cout << "qmm check: CPU backend only (--cpu-only)\n";
  else if (gpus == 0) std::cout << "qmm check: no GPU found (" << Context::cuda_unavailable_reason()
                                << "); checking the CPU backend only\n";
  for (auto& [name, ctx] : devices) std::cout << "  device " << name << ": " << ctx.device_name() << "\n";

  // CPU sizes stay small enough for naive loops; GPU sizes are larger since the CPU backend is their oracle.
  const std::int64_t s = opts.quick ? 1 : 2;
  std::vector<Case> cpu_cases, gpu_cases;
  add_dense_cases(cpu_cases, 33 * s, 384 * s, 130 * s);
  add_batched_case(cpu_cases, 1, 2, 63 * s, 64);
  add_swiglu_cases(cpu_cases, 100003 * s);
  add_nf4_cases(cpu_cases, 17 * s, 512 * s, 192 * s);
  add_train_cases(cpu_cases, 100003 * s, 256 * s, 1000 * s);
  add_loss_cases(cpu_cases, 33 * s, 64, 130 * s);
  add_norm_rope_cases(cpu_cases, 33 * s, 256, 2, 7 * s, 4, 2, 64);
  if (gpus > 0) {
    add_dense_cases(gpu_cases, 256 * s, 1536, 1000 * s);
    add_batched_case(gpu_cases, 2, 4, 255 * s, 128);
    add_swiglu_cases(gpu_cases, (1 << 22) + 3);
    add_nf4_cases(gpu_cases, 65 * s, 1536, 2048 * s);
    add_nf4_cases(gpu_cases, 1, 4096, 1536);
    add_train_cases(gpu_cases, (1 << 22) + 3, 1536, 8960);
    add_loss_cases(gpu_cases, 300, 128, 32003);
    add_norm_rope_cases(gpu_cases, 2048, 4096, 2, 1024, 32, 8, 128);
  }

  int failures = 0, rows = 0;
  std::printf("\n%-38s %-8s %-18s %-10s %-9s %s\n", "op", "device", "shape", "rel err", "limit", "result");
  for (auto& [name, ctx] : devices) {
    const bool is_cpu = ctx.device().is_cpu();
    for (const Case& c : is_cpu ? cpu_cases : gpu_cases) {
      const double limit = is_cpu ? c.tol_cpu : c.tol_gpu;
      Result r;
      std::string note;
      try {
        Outputs got = c.run(ctx);
        ctx.synchronize();
        const Reference ref = is_cpu ? c.naive() : as_reference(c.run(cpu));
        r = compare(got, ref);
      } catch (const Error& e) {
        r.finite = false;
        note = std::string(" (") + e.what() + ")";
      }
      const bool pass = r.finite && r.rel <= limit;
      failures += pass ? 0 : 1;
      ++rows;
      std::printf("%-38s %-8s %-18s %-10.2e %-9.1e %s%s\n", c.op.c_str(), name.c_str(), c.shape.c_str(), r.rel,
                  limit, pass ? "PASS" : "FAIL", note.c_str());
    }
  }
  std::printf("\n%d checks: %d passed, %d failed\n", rows, rows - failures, failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace qmm::tool
