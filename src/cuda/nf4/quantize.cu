// Host side of NF4 quantize and dequantize: alignment checks, grid sizing, the double-quantization offset.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/cuda_backend.h"
#include "cuda/nf4/quantize.cuh"
#include "cuda/nf4/quantize.h"
#include "qmm/error.h"

namespace qmm::cuda {

namespace {

using namespace nf4_detail;

bool aligned(const void* p, std::uintptr_t bytes) { return (reinterpret_cast<std::uintptr_t>(p) & (bytes - 1)) == 0; }

int log2_exact(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

template <class T>
void launch_quantize(const Context& ctx, const TensorView& w, int block_size, std::uint8_t* codes, float* absmax) {
  const std::int64_t n = w.numel();
  const std::int64_t nblocks = (n + block_size - 1) / block_size;
  const int lanes = std::min(32, block_size / kQuantChunk);
  const int chunks = block_size / kQuantChunk / lanes;
  const std::int64_t tasks = (nblocks + (32 / lanes) - 1) / (32 / lanes);  // one warp each
  const bool vec = aligned(w.data(), 16) && aligned(codes, 4);
  const T* src = w.data_as<const T>();
  auto kernel = chunks == 1 ? nf4_quantize_kernel<T, true> : nf4_quantize_kernel<T, false>;
  kernel<<<grid_for(ctx, kernel, kThreads, tasks * 32), kThreads, 0, stream_of(ctx)>>>(src, n, block_size, lanes, chunks, vec,
                                                                             codes, absmax, nblocks);
  QMM_CUDA_CHECK_LAUNCH("nf4_quantize_kernel");
}

Scales scales_of(const Nf4Weight& w) {
  Scales s{};
  if (w.double_quant()) {
    s.q = w.absmax.data_as<const std::uint8_t>();
    s.absmax2 = w.absmax2.data_as<const float>();
    s.code2 = w.code2.data_as<const float>();
    s.offset = w.offset;
  } else {
    s.absmax = w.absmax.data_as<const float>();
  }
  return s;
}

template <class T>
void launch_dequantize(const Context& ctx, const Nf4Weight& w, T* out) {
  const std::int64_t n = w.numel();
  const std::int64_t nchunks = (n + kDequantChunk - 1) / kDequantChunk;
  const bool vec = aligned(w.codes.data(), 4) && aligned(out, 16);
  nf4_dequantize_kernel<T><<<grid_for(ctx, nf4_dequantize_kernel<T>, kThreads, nchunks), kThreads, 0, stream_of(ctx)>>>(
      w.codes.data_as<const std::uint8_t>(), scales_of(w), log2_exact(w.block_size), n, vec, out);
  QMM_CUDA_CHECK_LAUNCH("nf4_dequantize_kernel");
}

}  // namespace

namespace {
// Double quantization of nblocks device scales; the offset comes from offset_dev (device) or offset_host.
void launch_double_quantize(const Context& ctx, const float* absmax, std::int64_t nblocks, const float* offset_dev,
                            float offset_host, Nf4Weight& out) {
  // code2 first (from the context's device copy): the kernel reads it back from out.code2.
  QMM_CUDA_CHECK(cudaMemcpyAsync(out.code2.data(), state(ctx).code2, kCode2Size * sizeof(float),
                                 cudaMemcpyDeviceToDevice, stream_of(ctx)));
  if (nblocks == 0) return;
  const std::int64_t groups = (nblocks + kNf4NestedBlockSize - 1) / kNf4NestedBlockSize;
  nf4_double_quant_kernel<<<static_cast<unsigned>(groups), kNf4NestedBlockSize, 0, stream_of(ctx)>>>(
      absmax, nblocks, offset_dev, offset_host, out.code2.data_as<const float>(), out.absmax.data_as<std::uint8_t>(),
      out.absmax2.data_as<float>());
  QMM_CUDA_CHECK_LAUNCH("nf4_double_quant_kernel");
}
}  // namespace

void nf4_double_quantize(const Context& ctx, const float* absmax, std::int64_t nblocks, float offset,
                         Nf4Weight& out) {
  set_device(ctx);
  out.offset = offset;
  launch_double_quantize(ctx, absmax, nblocks, nullptr, offset, out);
}

void nf4_quantize(const Context& ctx, const TensorView& w, Nf4Weight& out) {
  set_device(ctx);
  const std::int64_t n = w.numel();
  const std::int64_t nblocks = out.num_blocks();
  const bool dq = out.double_quant();
  if (n == 0) {
    if (dq) nf4_double_quantize(ctx, nullptr, 0, 0.0f, out);
    return;
  }
  // Plain: the fp32 absmax goes straight to out.absmax. Double: to scratch, then it is quantized into out.absmax.
  std::unique_ptr<ScratchBuffer> scratch;
  if (dq) scratch = std::make_unique<ScratchBuffer>(state(ctx), static_cast<std::size_t>(nblocks) * 4);
  float* absmax = dq ? scratch->at<float>(0) : out.absmax.data_as<float>();
  std::uint8_t* codes = out.codes.data_as<std::uint8_t>();
  switch (w.dtype()) {
    case DType::F32: launch_quantize<float>(ctx, w, out.block_size, codes, absmax); break;
    case DType::BF16: launch_quantize<__nv_bfloat16>(ctx, w, out.block_size, codes, absmax); break;
    case DType::F16: launch_quantize<__half>(ctx, w, out.block_size, codes, absmax); break;
    default: throw Error(ErrorCode::Internal, "nf4_quantize: unexpected input dtype");
  }
  if (!dq) return;

  // The offset, summed on the device in the CPU's order (identical bits), then the scales quantized with it.
  // Nf4Weight::offset is a host float, so the call ends by copying it back.
  const std::int64_t chunks = (nblocks + kNf4MeanChunk - 1) / kNf4MeanChunk;
  ScratchBuffer sums(state(ctx), static_cast<std::size_t>(chunks) * sizeof(double) + 16);
  double* chunk_sums = sums.at<double>(0);
  float* offset_dev = reinterpret_cast<float*>(chunk_sums + chunks);
  nf4_absmax_chunk_sum_kernel<<<static_cast<unsigned>((chunks + kSumWarps - 1) / kSumWarps), kSumWarps * 32, 0,
                                stream_of(ctx)>>>(absmax, nblocks, chunk_sums);
  QMM_CUDA_CHECK_LAUNCH("nf4_absmax_chunk_sum_kernel");
  nf4_absmax_mean_kernel<<<1, 32, 0, stream_of(ctx)>>>(chunk_sums, chunks, nblocks, offset_dev);
  QMM_CUDA_CHECK_LAUNCH("nf4_absmax_mean_kernel");
  launch_double_quantize(ctx, absmax, nblocks, offset_dev, 0.0f, out);
  QMM_CUDA_CHECK(cudaMemcpyAsync(&out.offset, offset_dev, sizeof(float), cudaMemcpyDeviceToHost, stream_of(ctx)));
  QMM_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
}

void nf4_dequantize(const Context& ctx, const Nf4Weight& w, const TensorView& out) {
  if (w.numel() == 0) return;
  set_device(ctx);
  if (out.dtype() == DType::BF16) launch_dequantize(ctx, w, out.data_as<__nv_bfloat16>());
  else launch_dequantize(ctx, w, out.data_as<float>());
}

void nf4_dequantize_many(const Context& ctx, std::span<const Nf4Weight> ws, void* dst) {
  set_device(ctx);
  auto* out = static_cast<__nv_bfloat16*>(dst);
  for (std::size_t first = 0; first < ws.size(); first += kDequantManyMax) {
    DequantParts parts{};
    std::int64_t most = 0;
    const std::size_t count = std::min<std::size_t>(kDequantManyMax, ws.size() - first);
    for (std::size_t i = 0; i < count; ++i) {
      const Nf4Weight& w = ws[first + i];
      parts.part[i] = {
          w.codes.data_as<const std::uint8_t>(),          scales_of(w), log2_exact(w.block_size), w.numel(),
          aligned(w.codes.data(), 4) && aligned(out, 16), out};
      most = std::max(most, (w.numel() + kDequantChunk - 1) / kDequantChunk);
      out += w.numel();
    }
    if (most == 0) continue;
    const unsigned grid = grid_for(ctx, nf4_dequantize_many_kernel, kThreads, most);
    nf4_dequantize_many_kernel<<<dim3(grid, static_cast<unsigned>(count)), kThreads, 0, stream_of(ctx)>>>(parts);
    QMM_CUDA_CHECK_LAUNCH("nf4_dequantize_many_kernel");
  }
}

}  // namespace qmm::cuda
