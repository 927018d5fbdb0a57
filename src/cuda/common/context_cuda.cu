// Context creation, memory and copies for the CUDA backend.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "cuda/common/check.h"
#include "cuda/common/cuda_state.h"
#include "cuda/cuda_backend.h"

namespace qmm::cuda {

namespace {
constexpr std::size_t kLtWorkspaceBytes = 32u << 20;  // cuBLASLt's recommendation for Hopper is 32 MiB
}

void throw_cuda(cudaError_t err, const char* what, const char* file, int line) {
  throw Error(ErrorCode::Cuda, std::string("CUDA error ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                                   ") in " + what + " at " + file + ":" + std::to_string(line));
}

void throw_cublas(cublasStatus_t st, const char* what, const char* file, int line) {
  throw Error(ErrorCode::Cublas, std::string("cuBLASLt error ") + cublasLtGetStatusName(st) + " (" +
                                     cublasLtGetStatusString(st) + ") in " + what + " at " + file + ":" +
                                     std::to_string(line));
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls report their own
    return 0;
  }
  return n;
}

std::string unavailable_reason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("no usable CUDA device: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  }
  return n == 0 ? "no CUDA device found" : "";
}

namespace {
// Makes the calling thread's stream-capture mode relaxed while it lives. A context may be made while a stream of
// this thread is being captured into a CUDA graph (PyTorch captures on a stream of its own, which qmm first sees
// then): its setup allocates and uploads, which is not stream work and, in the default (global) mode, would
// invalidate the capture.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// Uploads `bytes` from the host through a private stream: a synchronous cudaMemcpy runs on the legacy default
// stream, which waits for (and so would join) a blocking stream being captured.
void upload_private(void* dst, const void* src, std::size_t bytes) {
  cudaStream_t s = nullptr;
  QMM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  QMM_CUDA_CHECK(err);
}
}  // namespace

void init_context(Context::Impl& impl, int device, void* stream) {
  const RelaxedCapture relaxed;
  const int n = device_count();
  if (n == 0) throw Error(ErrorCode::NoDevice, "Context::cuda: " + unavailable_reason());
  if (device < 0 || device >= n)
    throw Error(ErrorCode::NoDevice, "Context::cuda: device " + std::to_string(device) + " requested but " +
                                         std::to_string(n) + " CUDA device(s) present");
  auto owned = std::make_unique<CudaState>();
  CudaState& s = *owned;
  impl.backend = std::move(owned);
  s.device = device;
  s.stream = static_cast<cudaStream_t>(stream);
  QMM_CUDA_CHECK(cudaSetDevice(device));
  QMM_CUDA_CHECK(cudaGetDeviceProperties(&s.props, device));
  QMM_CUBLAS_CHECK(cublasLtCreate(&s.lt));
  s.workspace_bytes = kLtWorkspaceBytes;
  QMM_CUDA_CHECK(cudaMalloc(&s.workspace, s.workspace_bytes));
  cudaMemPoolProps pool_props{};
  pool_props.allocType = cudaMemAllocationTypePinned;
  pool_props.location.type = cudaMemLocationTypeDevice;
  pool_props.location.id = device;
  QMM_CUDA_CHECK(cudaMemPoolCreate(&s.pool, &pool_props));
  std::uint64_t keep = UINT64_MAX;  // never trim between ops: scratch sizes repeat from call to call
  QMM_CUDA_CHECK(cudaMemPoolSetAttribute(s.pool, cudaMemPoolAttrReleaseThreshold, &keep));
  QMM_CUDA_CHECK(cudaMalloc(&s.code2, kNf4Code2Size * sizeof(float)));
  upload_private(s.code2, nf4_code2_table(), kNf4Code2Size * sizeof(float));
  impl.name = s.props.name;
}

void* create_owned_stream(Context::Impl& impl) {
  CudaState& s = static_cast<CudaState&>(*impl.backend);
  QMM_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  s.owns_stream = true;
  return s.stream;
}

CudaState::~CudaState() {
  cudaSetDevice(device);
  if (stream) cudaStreamSynchronize(stream); else cudaDeviceSynchronize();
  if (lt) cublasLtDestroy(lt);
  cudaFree(workspace);
  cudaFree(code2);
  if (pool) cudaMemPoolDestroy(pool);
  if (owns_stream) cudaStreamDestroy(stream);
}

ScratchBuffer::ScratchBuffer(const CudaState& st, std::size_t bytes) : stream_(st.stream) {
  QMM_CUDA_CHECK(cudaMallocFromPoolAsync(&ptr_, bytes == 0 ? 1 : bytes, st.pool, stream_));
}

ScratchBuffer::~ScratchBuffer() {
  if (ptr_) cudaFreeAsync(ptr_, stream_);  // a destructor cannot throw; a failure here resurfaces at the next check
}

void set_device(const Context& ctx) {
  // Always set, never skip when cudaGetDevice already answers this device: in a new host thread no context is
  // current until cudaSetDevice makes the primary one current, and cuBLASLt's driver calls need it.
  QMM_CUDA_CHECK(cudaSetDevice(state(ctx).device));
}

void synchronize(const Context& ctx) {
  set_device(ctx);
  QMM_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
}

void copy_bytes_async(const Context& ctx, void* dst, const void* src, std::size_t bytes) {
  set_device(ctx);
  QMM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_of(ctx)));
}

DeviceInfo device_info(const Context& ctx) {
  const cudaDeviceProp& p = state(ctx).props;
  DeviceInfo d;
  d.name = p.name;
  d.compute_capability = p.major * 10 + p.minor;
  d.sm_count = p.multiProcessorCount;
  d.l2_bytes = static_cast<std::size_t>(p.l2CacheSize);
  d.memory_bytes = p.totalGlobalMem;
  return d;
}

namespace {
std::size_t pool_attribute(cudaMemPool_t pool, cudaMemPoolAttr attr) {
  std::uint64_t value = 0;
  QMM_CUDA_CHECK(cudaMemPoolGetAttribute(pool, attr, &value));
  return static_cast<std::size_t>(value);
}
}  // namespace

MemoryStats memory_stats(const Context& ctx) {
  const CudaState& s = state(ctx);
  MemoryStats m;
  m.fixed_bytes = s.workspace_bytes + kNf4Code2Size * sizeof(float);
  m.scratch_reserved_bytes = pool_attribute(s.pool, cudaMemPoolAttrReservedMemCurrent);
  m.scratch_in_use_bytes = pool_attribute(s.pool, cudaMemPoolAttrUsedMemCurrent);
  // A peak is never below the current use, whatever a reset left the pool's high marks at.
  m.scratch_reserved_peak_bytes =
      std::max(m.scratch_reserved_bytes, pool_attribute(s.pool, cudaMemPoolAttrReservedMemHigh));
  m.scratch_in_use_peak_bytes = std::max(m.scratch_in_use_bytes, pool_attribute(s.pool, cudaMemPoolAttrUsedMemHigh));
  return m;
}

void reset_peak_memory_stats(const Context& ctx) {
  std::uint64_t zero = 0;  // the only value these attributes take: it resets the high mark to the current use
  QMM_CUDA_CHECK(cudaMemPoolSetAttribute(state(ctx).pool, cudaMemPoolAttrReservedMemHigh, &zero));
  QMM_CUDA_CHECK(cudaMemPoolSetAttribute(state(ctx).pool, cudaMemPoolAttrUsedMemHigh, &zero));
}

void release_cached_memory(const Context& ctx) {
  synchronize(ctx);  // scratch freed on the stream returns to the pool only once the stream reaches the free
  QMM_CUDA_CHECK(cudaMemPoolTrimTo(state(ctx).pool, 0));
}

std::vector<double> time_calls(const Context& ctx, const std::function<void(int)>& fn, int warmup, int repeats) {
  set_device(ctx);
  cudaStream_t s = stream_of(ctx);
  std::vector<cudaEvent_t> events(static_cast<std::size_t>(repeats) * 2);
  for (auto& e : events) QMM_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<double> ms(static_cast<std::size_t>(repeats));
  try {
    for (int i = 0; i < warmup; ++i) fn(i);
    for (int r = 0; r < repeats; ++r) {
      QMM_CUDA_CHECK(cudaEventRecord(events[2 * r], s));
      fn(warmup + r);
      QMM_CUDA_CHECK(cudaEventRecord(events[2 * r + 1], s));
    }
    QMM_CUDA_CHECK(cudaStreamSynchronize(s));
    for (int r = 0; r < repeats; ++r) {
      float t = 0;
      QMM_CUDA_CHECK(cudaEventElapsedTime(&t, events[2 * r], events[2 * r + 1]));
      ms[static_cast<std::size_t>(r)] = t;
    }
  } catch (...) {
    for (auto& e : events) cudaEventDestroy(e);
    throw;
  }
  for (auto& e : events) cudaEventDestroy(e);
  return ms;
}

std::vector<double> time_graph(const Context& ctx, const std::function<void(int)>& fn, int calls, int replays) {
  set_device(ctx);
  cudaStream_t s = stream_of(ctx);
  if (s == nullptr)
    throw Error(ErrorCode::Unsupported, "time_graph: the legacy default stream cannot be captured "
                                        "(use Context::cuda_with_new_stream or pass a stream)");
  // Relaxed mode: the ops' own non-stream calls (cudaFuncSetAttribute, cudaGetDevice) stay legal while capturing.
  QMM_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  cudaGraph_t graph = nullptr;
  // When fn throws: end the capture so the stream is usable again, and drop the partial graph.
  auto abandon_capture = [&] {
    cudaStreamEndCapture(s, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
  };
  try {
    for (int i = 0; i < calls; ++i) fn(i);
  } catch (const Error& e) {
    abandon_capture();
    throw Error(ErrorCode::Unsupported, std::string("time_graph: the calls cannot be captured: ") + e.what());
  } catch (...) {
    abandon_capture();
    throw;
  }
  const cudaError_t end = cudaStreamEndCapture(s, &graph);
  if (end != cudaSuccess || graph == nullptr) {
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw Error(ErrorCode::Unsupported, std::string("time_graph: capture failed: ") + cudaGetErrorName(end));
  }
  cudaGraphExec_t exec = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<double> ms;
  auto release = [&] {
    if (exec) cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  };
  try {
    QMM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    QMM_CUDA_CHECK(cudaEventCreate(&start));
    QMM_CUDA_CHECK(cudaEventCreate(&stop));
    QMM_CUDA_CHECK(cudaGraphLaunch(exec, s));  // warm-up: first replay pays for uploading the graph
    for (int r = 0; r < replays; ++r) {
      QMM_CUDA_CHECK(cudaEventRecord(start, s));
      QMM_CUDA_CHECK(cudaGraphLaunch(exec, s));
      QMM_CUDA_CHECK(cudaEventRecord(stop, s));
      QMM_CUDA_CHECK(cudaEventSynchronize(stop));
      float t = 0;
      QMM_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
      ms.push_back(static_cast<double>(t) / calls);
    }
  } catch (...) {
    release();
    throw;
  }
  release();
  return ms;
}

void* device_alloc(std::size_t bytes, int device) {
  QMM_CUDA_CHECK(cudaSetDevice(device));
  void* p = nullptr;
  QMM_CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

void device_free(void* ptr, int device) noexcept {
  cudaSetDevice(device);
  cudaFree(ptr);
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) {
  if (dst_device.is_cuda()) QMM_CUDA_CHECK(cudaSetDevice(dst_device.index));
  else if (src_device.is_cuda()) QMM_CUDA_CHECK(cudaSetDevice(src_device.index));
  // cudaMemcpy with cudaMemcpyDefault infers the direction (unified addressing) and is ordered against the
  // legacy default stream; contexts on other streams must synchronize before reading results on the host.
  QMM_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
}

// Raises a kernel's dynamic shared-memory limit when a launch needs more than it was last given, keyed by the
// kernel itself (instances of one template share a function type, so the key cannot be the type) and the current
// device (the attribute is per device).
void allow_dynamic_shared(const void* kernel, int bytes) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> allowed;
  int device = 0;
  QMM_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  int& have = allowed[{kernel, device}];
  if (bytes > have) {
    QMM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    have = bytes;
  }
}

bool kernel_has_pdl_wait(const void* kernel) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, bool> cache;
  int device = 0;
  QMM_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  const auto [it, added] = cache.try_emplace({kernel, device}, false);
  if (added) {
    cudaFuncAttributes attr{};
    QMM_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    it->second = attr.ptxVersion >= 90;
  }
  return it->second;
}

std::int64_t wave_blocks(const Context& ctx, const void* kernel, int threads) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, int> per_sm_cache;
  const int device = state(ctx).device;
  int per_sm = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = per_sm_cache.find({kernel, threads, device});
    if (it != per_sm_cache.end()) per_sm = it->second;
  }
  if (per_sm == 0) {
    set_device(ctx);
    QMM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
    per_sm = std::max(1, per_sm);
    std::lock_guard<std::mutex> lock(mutex);
    per_sm_cache[{kernel, threads, device}] = per_sm;
  }
  return static_cast<std::int64_t>(state(ctx).sm_count()) * per_sm;
}

}  // namespace qmm::cuda
