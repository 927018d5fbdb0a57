// NF4, bitsandbytes-compatible: the format layer, shared by host and device code. docs/FORMAT.md explains it.
#pragma once

#include <cstdint>
#include <string>

#include "qmm/tensor.h"

#if defined(__CUDACC__)
#define QMM_HOST_DEVICE __host__ __device__
#else
#define QMM_HOST_DEVICE
#endif

namespace qmm {

constexpr int kNf4DefaultBlockSize = 64;
constexpr int kNf4NestedBlockSize = 256;  // blocks per absmax2 group when double-quantized
constexpr int kNf4Code2Size = 256;        // values in the double-quantization map code2
constexpr std::uint8_t kNf4ZeroCode = 7;  // code of 0.0, fills the unused low nibble of an odd tail
// Double quantization's offset is the mean of the fp32 absmax values summed in double in chunks of this many, in
// index order, then the chunk sums in order: the producer's (bitsandbytes') mean, reproduced bit for bit by every
// backend.
constexpr std::int64_t kNf4MeanChunk = 1024;

// The 16 NF4 values, ascending.
QMM_HOST_DEVICE inline float nf4_code_value(int code) {
  constexpr float kCodebook[16] = {
      -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
      -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
      0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
      0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
  return kCodebook[code & 15];
}

// The 15 decision thresholds between neighbouring codes (bitsandbytes' constants), ascending.
QMM_HOST_DEVICE inline float nf4_threshold(int i) {
  constexpr float kMid[15] = {
      -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
      -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
      0.1202552504837513f, 0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f,
      0.5016634166240692f, 0.6427869200706482f, 0.8614784181118011f};
  return kMid[i];
}

// Nearest code to a value already scaled into [-1, 1]: the number of thresholds strictly below it, so a value
// exactly on a threshold goes to the lower code. NaN (an all-zero block scaled by 1/0) compares false everywhere
// and gives code 0; its scale is 0, so it dequantizes to 0, never NaN.
QMM_HOST_DEVICE inline int nf4_nearest_code(float x) {
  int code = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 15; ++i) code += (x > nf4_threshold(i)) ? 1 : 0;
  return code;
}

// Packed byte i holds elements 2i (high nibble) and 2i+1 (low nibble).
QMM_HOST_DEVICE inline int nf4_unpack(const std::uint8_t* codes, std::int64_t element) {
  const std::uint8_t byte = codes[element >> 1];
  return (element & 1) ? (byte & 15) : (byte >> 4);
}

// A non-owning view of an NF4 weight W [rows, cols] = [N, K] (out_features, in_features).
//  codes:   u8 [ceil(N*K/2)]
//  plain:   absmax f32 [nblocks]
//  double:  absmax u8 [nblocks] (indices into code2), absmax2 f32 [ceil(nblocks/256)], code2 f32 [256], offset
// nblocks = ceil(N*K / block_size). All tensors on one device.
struct Nf4Weight {
  TensorView codes;
  TensorView absmax;
  TensorView absmax2;  // empty unless double-quantized
  TensorView code2;    // empty unless double-quantized
  float offset = 0.0f;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  int block_size = kNf4DefaultBlockSize;

  bool double_quant() const { return absmax.dtype() == DType::U8; }
  std::int64_t numel() const { return rows * cols; }
  std::int64_t num_blocks() const { return (numel() + block_size - 1) / block_size; }
  std::int64_t num_groups() const { return (num_blocks() + kNf4NestedBlockSize - 1) / kNf4NestedBlockSize; }
  Device device() const { return codes.device(); }
};

// Owning storage for an NF4 weight, allocated with the right sizes.
struct Nf4Tensor {
  Tensor codes, absmax, absmax2, code2;
  float offset = 0.0f;
  std::int64_t rows = 0, cols = 0;
  int block_size = kNf4DefaultBlockSize;

  static Nf4Tensor allocate(std::int64_t rows, std::int64_t cols, bool double_quant, Device device = Device::cpu(),
                            int block_size = kNf4DefaultBlockSize);
  Nf4Weight view() const;
  operator Nf4Weight() const { return view(); }  // NOLINT
};

// Checks that w is a consistent NF4 weight, all of it on its codes' device (shape, block size, each buffer's dtype
// and size, a finite offset): what every NF4 op checks first. Throws Error naming `op` and the field.
void validate_nf4_weight(const Nf4Weight& w, const std::string& op = "Nf4Weight");

// The kNf4Code2Size (256) values of bitsandbytes' signed "dynamic" 8-bit map, ascending, used by double quantization.
const float* nf4_code2_table();

// The rebuilt fp32 scale of block i: absmax[i] (plain) or code2[q[i]]*absmax2[i/256] + offset (double). Host memory.
float nf4_block_scale(const Nf4Weight& w, std::int64_t block);

}  // namespace qmm
