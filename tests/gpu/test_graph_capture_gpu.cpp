// Capturing qmm's training-step ops into a CUDA graph the way PyTorch does (torch.cuda.graph and
// torch.compile(mode="reduce-overhead")): global capture mode, on a stream qmm first sees while it is being
// captured, so that the Context for it is made inside the capture (the Python package makes one per stream on
// first use). Nothing may synchronize or allocate outside the graph, and each replay must compute what the same
// ops compute eagerly.
#include <optional>
#include <vector>

#include "common/test_util.h"

#ifdef QMM_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace qmm {
namespace {

#ifdef QMM_WITH_CUDA
#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// The device tensors of one decoder layer's worth of ops: the QLoRA projections (NF4 base, bf16 adapter; two of one
// input as one op, lora_nf4_linears), gate+up with SwiGLU, RMSNorm, RoPE and the head's cross-entropy, forward and
// backward.
struct StepBuffers {
  static constexpr std::int64_t kTokens = 130, kHidden = 256, kFfn = 512, kRank = 16, kVocab = 1000;
  static constexpr std::int64_t kHeads = 4, kHeadDim = 64, kBatch = 2, kSeq = kTokens / kBatch;
  Device dev;
  Nf4Tensor w_up, w_gate, w_down;
  Tensor x, a_master, b_master, norm_w, cos, sin, head_w, labels, dy;  // inputs
  Tensor a, b, y, t, h, h2, gate, up, xn, rstd, dx, dt, grad_a, grad_b;  // outputs
  Tensor dgate, dup, dxn, dnorm_w, q_rot, loss, dh_head, dw_head, y_small;
  Tensor a2, bias2, dy2, y2a, y2b, t2, dt2, grad_a2, grad_b2a, grad_b2b, dx2;  // two projections of x, adapters stacked

  explicit StepBuffers(const Context& ctx) : dev(ctx.device()) {
    std::uint64_t seed = 4100;
    const auto in = [&](DType dt, Shape s, float lo = -1.0f, float hi = 1.0f) {
      return to_device(test::random_tensor(dt, s, ++seed, lo, hi), dev);
    };
    const auto out = [&](DType dt, Shape s) { return Tensor(dt, s, dev); };
    const auto nf4 = [&](std::int64_t n, std::int64_t k) {
      return nf4_quantize(ctx, in(DType::BF16, {n, k}), /*double_quant=*/true);
    };
    w_up = nf4(kFfn, kHidden);
    w_gate = nf4(kFfn, kHidden);
    w_down = nf4(kHidden, kFfn);
    x = in(DType::BF16, {kTokens, kHidden});
    a_master = in(DType::F32, {kRank, kHidden}, -0.1f, 0.1f);  // PEFT's fp32 adapters, cast each step
    b_master = in(DType::F32, {kFfn, kRank}, -0.1f, 0.1f);
    a = out(DType::BF16, {kRank, kHidden});
    b = out(DType::BF16, {kFfn, kRank});
    norm_w = in(DType::BF16, {kHidden}, 0.5f, 1.5f);
    cos = in(DType::BF16, {1, kSeq, kHeadDim});
    sin = in(DType::BF16, {1, kSeq, kHeadDim});
    head_w = in(DType::BF16, {kVocab, kHidden}, -0.1f, 0.1f);
    Tensor lab(DType::I32, {kTokens});
    for (std::int64_t i = 0; i < kTokens; ++i)
      lab.data_as<std::int32_t>()[i] = i % 5 == 4 ? -100 : static_cast<std::int32_t>((i * 7919 + 3) % kVocab);
    labels = to_device(lab, dev);
    dy = in(DType::BF16, {kTokens, kFfn});
    y = out(DType::BF16, {kTokens, kFfn});
    t = out(DType::BF16, {kTokens, kRank});
    gate = out(DType::BF16, {kTokens, kFfn});
    up = out(DType::BF16, {kTokens, kFfn});
    h = out(DType::BF16, {kTokens, kFfn});
    h2 = out(DType::BF16, {kTokens, kFfn});
    xn = out(DType::BF16, {kTokens, kHidden});
    rstd = out(DType::F32, {kTokens});
    q_rot = out(DType::BF16, {kBatch, kSeq, kHeads, kHeadDim});
    dx = out(DType::BF16, {kTokens, kHidden});
    dt = out(DType::BF16, {kTokens, kRank});
    grad_a = out(DType::F32, {kRank, kHidden});
    grad_b = out(DType::F32, {kFfn, kRank});
    dgate = out(DType::BF16, {kTokens, kFfn});
    dup = out(DType::BF16, {kTokens, kFfn});
    dxn = out(DType::BF16, {kTokens, kHidden});
    dnorm_w = out(DType::F32, {kHidden});
    loss = out(DType::F32, {1});
    dh_head = out(DType::BF16, {kTokens, kHidden});
    dw_head = out(DType::F32, {kVocab, kHidden});
    y_small = out(DType::BF16, {7, kFfn});
    a2 = in(DType::BF16, {2 * kRank, kHidden}, -0.1f, 0.1f);
    dy2 = in(DType::BF16, {kTokens, kFfn});
    y2a = out(DType::BF16, {kTokens, kFfn});
    y2b = out(DType::BF16, {kTokens, kFfn});
    t2 = out(DType::BF16, {kTokens, 2 * kRank});
    dt2 = out(DType::BF16, {kTokens, 2 * kRank});
    grad_a2 = out(DType::F32, {2 * kRank, kHidden});
    grad_b2a = out(DType::F32, {kFfn, kRank});
    grad_b2b = out(DType::F32, {kFfn, kRank});
    dx2 = out(DType::BF16, {kTokens, kHidden});
    bias2 = in(DType::BF16, {kFfn});
  }

  // Every output, in a fixed order, for comparing runs.
  std::vector<const Tensor*> outputs() const {
    return {&a, &b, &h2, &y, &t, &gate, &up, &h, &xn, &rstd, &q_rot, &dx, &dt, &grad_a, &grad_b, &dgate, &dup, &dxn,
            &dnorm_w, &loss, &dh_head, &dw_head, &y_small, &y2a, &y2b, &t2, &dt2, &grad_a2, &grad_b2a, &grad_b2b,
            &dx2};
  }

  void poison_outputs() const {
    for (const Tensor* o : outputs()) test::poison(*o);
  }

  // The ops, in the order a step runs them. Accumulated gradients are zeroed inside the step, as a training step
  // that is replayed must.
  void run(const Context& ctx) const {
    cast(ctx, a_master, a);
    cast(ctx, b_master, b);
    nf4_gemm(ctx, x, w_up, y);  // a QLoRA projection: base, then y += 2 · (x Aᵀ) Bᵀ
    gemm_bt(ctx, x, a, t);
    gemm_bt(ctx, t, b, y, {2.0f, 1.0f});
    nf4_gemm(ctx, TensorView(x.data(), DType::BF16, {7, kHidden}, dev), w_up, y_small);  // few tokens: small-M kernels
    // Two projections of x as one op (an attention's q, k and v): one dequantize launch, the adapters stacked, the
    // first's bias in its GEMM's epilogue.
    const std::vector<Nf4Projection> two{{w_gate, y2a, 0.0f, b, 2.0f, bias2}, {w_up, y2b, 0.0f, b, 0.5f}};
    lora_nf4_linears(ctx, x, two, a2, t2);
    nf4_gate_up(ctx, x, w_gate, w_up, {gate, up, h});
    swiglu(ctx, gate, up, h2);
    rms_norm(ctx, x, norm_w, xn, rstd, 1e-6f);
    rope(ctx, TensorView(xn.data(), DType::BF16, {kBatch, kSeq, kHeads, kHeadDim}, dev), {}, cos, sin, q_rot, {});
    CrossEntropyOptions ce;
    ce.check_labels = false;  // a checked label count waits for the device: not capturable
    ce.chunk_tokens = 64;
    zero(ctx, dw_head);
    linear_cross_entropy(ctx, xn, head_w, labels, loss, dh_head, dw_head, ce);
    // backward
    zero(ctx, grad_b);
    lora_backward_dy(ctx, dy, b, t, dt, grad_b, 2.0f);
    gemm_backward_b(ctx, dt, x, grad_a);
    nf4_gemm_backward_a(ctx, dy, w_up, dx);
    gemm(ctx, dt, a, dx, {1.0f, 1.0f});
    const std::vector<Nf4ProjectionGrad> two_grads{{w_gate, dy, b, 2.0f, grad_b2a}, {w_up, dy2, b, 0.5f, grad_b2b}};
    lora_nf4_linears_backward(ctx, x, two_grads, a2, t2, dt2, grad_a2, dx2);
    swiglu_backward(ctx, gate, up, dy, dgate, dup);
    zero(ctx, dnorm_w);
    rms_norm_backward(ctx, x, norm_w, rstd, dh_head, dxn, dnorm_w);
  }
};

TEST(GraphCapture, TrainStepOpsReplayOnAContextMadeWhileCapturing) {
  QMM_REQUIRE_GPU();
  const Context eager_ctx = Context::cuda_with_new_stream(0);
  const StepBuffers eager(eager_ctx), graphed(eager_ctx);
  eager.run(eager_ctx);
  eager_ctx.synchronize();

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  cudaGraph_t graph = nullptr;
  // Made inside the capture, as the Python package does, and kept past it (it synchronizes its stream when it dies).
  std::optional<Context> ctx;
  try {
    ctx = Context::cuda(0, stream);
    graphed.run(*ctx);
  } catch (const Error& e) {
    cudaStreamEndCapture(stream, &graph);
    FAIL() << "an op could not be captured: " << e.what();
  }
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    graphed.poison_outputs();  // written by the replay, not left over from the one before
    eager_ctx.synchronize();
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const auto want = eager.outputs(), got = graphed.outputs();
    // The same kernels and plans on the same inputs: the same bits.
    for (std::size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(test::bytes_equal(test::host_copy(*got[i]), test::host_copy(*want[i])))
          << "output " << i << " replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  ctx.reset();
  cudaStreamDestroy(stream);
}

struct NodeCounts {
  int kernels = 0, memsets = 0, all = 0;
};

// The nodes of what f launches on ctx's stream, captured (its plans made by a run outside the capture first).
// Counts out: CUDA_OK's fatal failure returns from a void function.
template <class F>
void count_captured_nodes(const Context& ctx, F&& f, NodeCounts& counts) {
  f();
  ctx.synchronize();
  cudaStream_t stream = static_cast<cudaStream_t>(ctx.stream());
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  cudaGraph_t graph = nullptr;
  f();
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  std::size_t n = 0;
  CUDA_OK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  CUDA_OK(cudaGraphGetNodes(graph, nodes.data(), &n));
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    CUDA_OK(cudaGraphNodeGetType(node, &type));
    counts.kernels += type == cudaGraphNodeTypeKernel;
    counts.memsets += type == cudaGraphNodeTypeMemset;
    ++counts.all;
  }
  cudaGraphDestroy(graph);
}

// A product over a short K (an adapter's second product y += t·Bᵀ, rank 16, at a Llama projection's size) takes an
// algorithm without cuBLASLt's workspace: its graph holds no memset node (the workspace algorithms zero part of it
// before every launch).
TEST(GraphCapture, ShortKProductsCaptureNoMemset) {
  QMM_REQUIRE_GPU();
  const Context ctx = Context::cuda_with_new_stream(0);
  const Device dev = ctx.device();
  const Tensor t = to_device(test::random_tensor(DType::BF16, {4096, 16}, 4301), dev);
  const Tensor b = to_device(test::random_tensor(DType::BF16, {4096, 16}, 4302), dev);
  Tensor y = to_device(test::random_tensor(DType::BF16, {4096, 4096}, 4303), dev);
  NodeCounts n;
  count_captured_nodes(
      ctx,
      [&] {
        gemm_bt(ctx, t, b, y, {1.0f, 1.0f});
      },
      n);
  EXPECT_GE(n.kernels, 1);
  EXPECT_EQ(n.memsets, 0) << n.kernels << " kernel node(s)";
}

// q, k and v's biases ride in their GEMMs' epilogue: a biased group launches what an unbiased one does.
TEST(GraphCapture, BiasedProjectionsLaunchNoMore) {
  QMM_REQUIRE_GPU();
  const Context ctx = Context::cuda_with_new_stream(0);
  const Device dev = ctx.device();
  constexpr std::int64_t kTokens = 512, kHidden = 256;
  const std::int64_t widths[] = {256, 64, 64};
  const Tensor x = to_device(test::random_tensor(DType::BF16, {kTokens, kHidden}, 4401), dev);
  std::vector<Nf4Tensor> ws;
  std::vector<Tensor> ys, biases;
  for (std::int64_t n : widths) {
    ws.push_back(nf4_quantize(ctx, to_device(test::random_tensor(DType::BF16, {n, kHidden}, 4402 + n), dev), true));
    ys.emplace_back(DType::BF16, Shape{kTokens, n}, dev);
    biases.push_back(to_device(test::random_tensor(DType::BF16, {n}, 4403 + n), dev));
  }
  const auto projections = [&](bool biased) {
    std::vector<Nf4Projection> ps;
    for (std::size_t i = 0; i < ws.size(); ++i)
      ps.push_back({ws[i].view(), ys[i], 0.0f, TensorView(), 1.0f, biased ? biases[i].view() : TensorView()});
    return ps;
  };
  NodeCounts plain, biased;
  count_captured_nodes(
      ctx, [&] { lora_nf4_linears(ctx, x, projections(false), TensorView(), TensorView()); }, plain);
  count_captured_nodes(
      ctx, [&] { lora_nf4_linears(ctx, x, projections(true), TensorView(), TensorView()); }, biased);
  EXPECT_GE(plain.kernels, 4);  // one dequantize launch and three GEMMs
  EXPECT_EQ(biased.all, plain.all) << biased.kernels << " kernel node(s) against " << plain.kernels;
}

// The bias epilogue's pointer is set on the plan's shared descriptor at each launch: a graph keeps the one it was
// captured with, whatever later launches of the same plan set.
TEST(GraphCapture, BiasEpilogueReplaysItsOwnBias) {
  QMM_REQUIRE_GPU();
  const Context ctx = Context::cuda_with_new_stream(0);
  const Device dev = ctx.device();
  constexpr std::int64_t kTokens = 512, kHidden = 256;
  const Tensor x = to_device(test::random_tensor(DType::BF16, {kTokens, kHidden}, 4501), dev);
  std::vector<Nf4Tensor> ws;
  for (std::int64_t n : {256, 64})
    ws.push_back(nf4_quantize(ctx, to_device(test::random_tensor(DType::BF16, {n, kHidden}, 4502 + n), dev), true));
  const Tensor bias_a = to_device(test::random_tensor(DType::BF16, {256}, 4503), dev);
  const Tensor bias_b = to_device(test::random_tensor(DType::BF16, {256}, 4504, 5.0f, 6.0f), dev);
  Tensor y0(DType::BF16, {kTokens, 256}, dev), y1(DType::BF16, {kTokens, 64}, dev);
  const auto run = [&](const Tensor& bias) {
    const std::vector<Nf4Projection> ps{{ws[0].view(), y0, 0.0f, TensorView(), 1.0f, bias},
                                        {ws[1].view(), y1, 0.0f, TensorView(), 1.0f, TensorView()}};
    lora_nf4_linears(ctx, x, ps, TensorView(), TensorView());
  };
  run(bias_a);  // the plans, outside the capture
  ctx.synchronize();
  const Tensor want = test::host_copy(y0);
  cudaStream_t stream = static_cast<cudaStream_t>(ctx.stream());
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  cudaGraph_t graph = nullptr;
  run(bias_a);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  run(bias_b);  // the same plan, its descriptor now pointing at bias_b
  ctx.synchronize();
  EXPECT_FALSE(test::bytes_equal(test::host_copy(y0), want)) << "bias_b changed nothing";
  test::poison(y0);
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_TRUE(test::bytes_equal(test::host_copy(y0), want));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}
#endif

}  // namespace
}  // namespace qmm
