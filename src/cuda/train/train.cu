// Host side of the train ops: vector widths from pointer alignment, grids from the SM count, multi-tensor batches,
// stream-ordered scratch for reduction partials, every launch checked, all on ctx's stream.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/cuda_backend.h"
#include "cuda/train/train.cuh"

namespace qmm::cuda {

namespace {

using namespace train_detail;

static_assert(sizeof(Batch<AdamWSlot>) + sizeof(AdamWScalars) + sizeof(const float*) <= 4096,
              "adamw_kernel's parameters must fit the 4 KiB kernel parameter space");

template <class T, int kIn, class F>
void launch_map(const Context& ctx, const std::array<const void*, kIn>& in, void* out, std::int64_t n, F f) {
  constexpr int V = Elem<T>::kVec;
  MapArgs<T, kIn> a{};
  bool vec = aligned16(out);
  for (int k = 0; k < kIn; ++k) {
    a.in[k] = static_cast<const T*>(in[static_cast<std::size_t>(k)]);
    vec = vec && aligned16(in[static_cast<std::size_t>(k)]);
  }
  a.out = static_cast<T*>(out);
  a.n = n;
  a.nvec = vec ? n / V : 0;
  const std::int64_t items = a.nvec + (n - a.nvec * V);
  auto kernel = map_kernel<T, kIn, F>;
  kernel<<<grid_for(ctx, kernel, kThreads, items), kThreads, 0, stream_of(ctx)>>>(a, f);
  QMM_CUDA_CHECK_LAUNCH("map_kernel");
}

// ---- multi-tensor batches ---------------------------------------------------------------------------------------

// Blocks per tensor: each launch (a batch of up to kMaxTensors tensors) gets about one wave of `wave` blocks,
// shared in proportion to size; at least one per tensor and never more than its 4-element vectors can use.
std::vector<int> share_blocks(std::int64_t wave, const std::vector<std::int64_t>& sizes) {
  std::vector<int> blocks;
  blocks.reserve(sizes.size());
  for (std::size_t start = 0; start < sizes.size(); start += kMaxTensors) {
    const std::size_t end = std::min(sizes.size(), start + kMaxTensors);
    double total = 0;
    for (std::size_t k = start; k < end; ++k) total += static_cast<double>(sizes[k]);
    for (std::size_t k = start; k < end; ++k) {
      const std::int64_t n = sizes[k];
      const std::int64_t need = ((n + 3) / 4 + kThreads - 1) / kThreads;
      const auto share =
          static_cast<std::int64_t>(std::ceil(static_cast<double>(wave) * static_cast<double>(n) / total));
      blocks.push_back(static_cast<int>(std::max<std::int64_t>(1, std::min(need, share))));
    }
  }
  return blocks;
}

// Cuts `slots` into batches of at most kMaxTensors and calls launch(batch, blocks_in_batch, first_block) for each;
// first_block counts the blocks of the earlier batches (where this batch's partials start). Returns all blocks.
template <class Slot, class Launch>
int for_each_batch(const std::vector<Slot>& slots, const std::vector<int>& blocks, Launch&& launch) {
  int first_block = 0;
  for (std::size_t start = 0; start < slots.size(); start += kMaxTensors) {
    Batch<Slot> b{};
    b.count = static_cast<int>(std::min<std::size_t>(kMaxTensors, slots.size() - start));
    int end = 0;
    for (int k = 0; k < b.count; ++k) {
      b.t[k] = slots[start + static_cast<std::size_t>(k)];
      end += blocks[start + static_cast<std::size_t>(k)];
      b.block_end[k] = end;
    }
    launch(b, end, first_block);
    first_block += end;
  }
  return first_block;
}

// The L2 norm of every tensor in `grads` together: partial sums of squares per block (several launches when there
// are more than kMaxTensors tensors), then one block sums them in order and writes the f32 norm to norm_out and/or
// its clip coefficient to clip_out (both device memory; either may be null).
void reduce_norm(const Context& ctx, const std::vector<NormSlot>& grads, float* norm_out, float* clip_out,
                 float max_norm) {
  std::vector<std::int64_t> sizes;
  for (const NormSlot& g : grads) sizes.push_back(g.n);
  const std::vector<int> blocks = share_blocks(wave_blocks(ctx, sum_squares_kernel, kThreads), sizes);
  int total = 0;
  for (int b : blocks) total += b;
  ScratchBuffer partials(state(ctx), static_cast<std::size_t>(std::max(total, 1)) * sizeof(double));
  double* base = partials.at<double>(0);
  for_each_batch(grads, blocks, [&](const Batch<NormSlot>& b, int nblocks, int first_block) {
    sum_squares_kernel<<<static_cast<unsigned>(nblocks), kThreads, 0, stream_of(ctx)>>>(b, base + first_block);
    QMM_CUDA_CHECK_LAUNCH("sum_squares_kernel");
  });
  finish_sum_kernel<<<1, kThreads, 0, stream_of(ctx)>>>(base, total, 1, 1.0, norm_out, clip_out, max_norm);
  QMM_CUDA_CHECK_LAUNCH("finish_sum_kernel");
}

NormSlot norm_slot(const TensorView& g) {
  return {g.data(), g.numel(), g.dtype() == DType::BF16 ? 1 : 0, aligned16(g.data()) ? 1 : 0};
}

template <class T>
void launch_mse(const Context& ctx, const TensorView& y, const TensorView& target, const TensorView& loss,
                const TensorView& dy, float scale) {
  constexpr int V = Elem<T>::kVec;
  const std::int64_t n = y.numel();
  const bool vec = aligned16(y.data()) && aligned16(target.data()) && aligned16(dy.data());
  const std::int64_t nvec = vec ? n / V : 0;
  const unsigned blocks = grid_for(ctx, mse_loss_kernel<T>, kThreads, nvec + (n - nvec * V));
  ScratchBuffer partials(state(ctx), blocks * sizeof(double));
  mse_loss_kernel<T><<<blocks, kThreads, 0, stream_of(ctx)>>>(y.data_as<const T>(), target.data_as<const T>(),
                                                              dy.data_as<T>(), n, nvec, train::mse_grad_coef(scale, n),
                                                              partials.at<double>(0));
  QMM_CUDA_CHECK_LAUNCH("mse_loss_kernel");
  finish_sum_kernel<<<1, kThreads, 0, stream_of(ctx)>>>(partials.at<double>(0), static_cast<int>(blocks), 0,
                                                        static_cast<double>(n), loss.data_as<float>(), nullptr, 0.0f);
  QMM_CUDA_CHECK_LAUNCH("finish_sum_kernel");
}

}  // namespace

void cast(const Context& ctx, const TensorView& src, const TensorView& dst) {
  const std::int64_t n = dst.numel();
  if (n == 0) return;
  set_device(ctx);
  if (src.dtype() == dst.dtype()) return copy_bytes_async(ctx, dst.data(), src.data(), dst.nbytes());
  const std::int64_t nvec8 = aligned16(src.data()) && aligned16(dst.data()) ? n / 8 : 0;
  const std::int64_t items = nvec8 + (n - nvec8 * 8);
  if (dst.dtype() == DType::BF16) {
    const unsigned blocks = grid_for(ctx, cast_f32_to_bf16_kernel, kThreads, items);
    cast_f32_to_bf16_kernel<<<blocks, kThreads, 0, stream_of(ctx)>>>(src.data_as<const float>(),
                                                                     dst.data_as<std::uint16_t>(), n, nvec8);
    QMM_CUDA_CHECK_LAUNCH("cast_f32_to_bf16_kernel");
  } else {
    const unsigned blocks = grid_for(ctx, cast_bf16_to_f32_kernel, kThreads, items);
    cast_bf16_to_f32_kernel<<<blocks, kThreads, 0, stream_of(ctx)>>>(src.data_as<const std::uint16_t>(),
                                                                     dst.data_as<float>(), n, nvec8);
    QMM_CUDA_CHECK_LAUNCH("cast_bf16_to_f32_kernel");
  }
}

void cast(const Context& ctx, std::span<const TensorView> src, std::span<const TensorView> dst) {
  set_device(ctx);
  std::vector<CastSlot> slots;
  std::vector<std::int64_t> sizes;
  for (std::size_t i = 0; i < src.size(); ++i) {
    const std::int64_t n = dst[i].numel();
    if (n == 0) continue;
    if (src[i].dtype() != DType::F32 || dst[i].dtype() != DType::BF16) {
      cuda::cast(ctx, src[i], dst[i]);  // qualified: ADL would find qmm::cast too
      continue;
    }
    const bool vec = aligned16(src[i].data()) && aligned16(dst[i].data());
    slots.push_back({src[i].data_as<const float>(), dst[i].data_as<std::uint16_t>(), n, vec ? n / 8 : 0});
    sizes.push_back(n);
  }
  if (slots.empty()) return;
  const std::vector<int> blocks = share_blocks(wave_blocks(ctx, cast_batch_f32_to_bf16_kernel, kThreads), sizes);
  for_each_batch(slots, blocks, [&](const Batch<CastSlot>& b, int nblocks, int) {
    cast_batch_f32_to_bf16_kernel<<<static_cast<unsigned>(nblocks), kThreads, 0, stream_of(ctx)>>>(b);
    QMM_CUDA_CHECK_LAUNCH("cast_batch_f32_to_bf16_kernel");
  });
}

void add(const Context& ctx, const TensorView& a, const TensorView& b, const TensorView& out, float alpha) {
  if (out.numel() == 0) return;
  set_device(ctx);
  const std::array<const void*, 2> in{a.data(), b.data()};
  if (out.dtype() == DType::BF16)
    launch_map<__nv_bfloat16, 2>(ctx, in, out.data(), out.numel(), AddOp{alpha});
  else
    launch_map<float, 2>(ctx, in, out.data(), out.numel(), AddOp{alpha});
}

void add_bias(const Context& ctx, const TensorView& y, const TensorView& bias) {
  if (y.numel() == 0) return;
  set_device(ctx);
  const std::array<const void*, 1> in{y.data()};
  const std::int64_t cols = y.dim(1);
  if (y.dtype() == DType::F32)
    launch_map<float, 1>(ctx, in, y.data(), y.numel(), BiasOp<float>{bias.data_as<const float>(), cols});
  else if (bias.dtype() == DType::F32)
    launch_map<__nv_bfloat16, 1>(ctx, in, y.data(), y.numel(), BiasOp<float>{bias.data_as<const float>(), cols});
  else
    launch_map<__nv_bfloat16, 1>(ctx, in, y.data(), y.numel(),
                                 BiasOp<__nv_bfloat16>{bias.data_as<const __nv_bfloat16>(), cols});
}

void dropout(const Context& ctx, const TensorView& x, const TensorView& out, float p, std::uint64_t seed) {
  if (out.numel() == 0) return;
  set_device(ctx);
  const DropoutOp op{train::dropout_key(seed), train::dropout_threshold(p), train::dropout_scale(p)};
  const std::array<const void*, 1> in{x.data()};
  if (out.dtype() == DType::BF16)
    launch_map<__nv_bfloat16, 1>(ctx, in, out.data(), out.numel(), op);
  else
    launch_map<float, 1>(ctx, in, out.data(), out.numel(), op);
}

void mse_loss(const Context& ctx, const TensorView& y, const TensorView& target, const TensorView& loss,
              const TensorView& dy, float scale) {
  set_device(ctx);
  if (y.dtype() == DType::BF16)
    launch_mse<__nv_bfloat16>(ctx, y, target, loss, dy, scale);
  else
    launch_mse<float>(ctx, y, target, loss, dy, scale);
}

void grad_norm(const Context& ctx, std::span<const TensorView> grads, const TensorView& norm) {
  set_device(ctx);
  std::vector<NormSlot> slots;
  for (const TensorView& g : grads)
    if (g.numel() > 0) slots.push_back(norm_slot(g));
  reduce_norm(ctx, slots, norm.data_as<float>(), nullptr, 0.0f);
}

void adamw_step(const Context& ctx, std::span<const AdamWParam> params, const AdamWOptions& opts, int step,
                const TensorView& norm) {
  set_device(ctx);
  std::vector<AdamWSlot> slots;
  std::vector<NormSlot> grads;
  std::vector<std::int64_t> sizes;
  for (const AdamWParam& p : params) {
    const std::int64_t n = p.param.numel();
    if (n == 0) continue;
    const bool vec =
        aligned16(p.param.data()) && aligned16(p.grad.data()) && aligned16(p.m.data()) && aligned16(p.v.data());
    slots.push_back({p.param.data_as<float>(), p.grad.data_as<const float>(), p.m.data_as<float>(),
                     p.v.data_as<float>(), n, vec ? 1 : 0});
    grads.push_back(norm_slot(p.grad));
    sizes.push_back(n);
  }
  // The clip coefficient stays in device memory from the norm's last block to the update kernels.
  const bool clip = opts.max_grad_norm > 0;
  std::unique_ptr<ScratchBuffer> coef;
  if (clip) coef = std::make_unique<ScratchBuffer>(state(ctx), sizeof(float));
  if (clip || !norm.empty())
    reduce_norm(ctx, grads, norm.empty() ? nullptr : norm.data_as<float>(), clip ? coef->at<float>(0) : nullptr,
                opts.max_grad_norm);
  if (slots.empty()) return;

  const double bc1 = 1.0 - std::pow(static_cast<double>(opts.beta1), step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(opts.beta2), step);
  AdamWScalars s{};
  s.lr_wd = static_cast<float>(static_cast<double>(opts.lr) * opts.weight_decay);
  s.beta1 = opts.beta1;
  s.one_minus_beta1 = 1.0f - opts.beta1;
  s.beta2 = opts.beta2;
  s.one_minus_beta2 = 1.0f - opts.beta2;
  s.step_size = static_cast<float>(opts.lr / bc1);
  s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  s.eps = opts.eps;
  const float* clip_ptr = clip ? coef->at<float>(0) : nullptr;
  const std::vector<int> blocks = share_blocks(wave_blocks(ctx, adamw_kernel, kThreads), sizes);
  for_each_batch(slots, blocks, [&](const Batch<AdamWSlot>& b, int nblocks, int) {
    adamw_kernel<<<static_cast<unsigned>(nblocks), kThreads, 0, stream_of(ctx)>>>(b, s, clip_ptr);
    QMM_CUDA_CHECK_LAUNCH("adamw_kernel");
  });
}

void zero(const Context& ctx, const TensorView& t) {
  if (t.numel() == 0) return;
  set_device(ctx);
  QMM_CUDA_CHECK(cudaMemsetAsync(t.data(), 0, t.nbytes(), stream_of(ctx)));
}

}  // namespace qmm::cuda
