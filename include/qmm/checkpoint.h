// Loading frozen weights from checkpoints: bitsandbytes 4-bit (NF4) layers as their state dicts store them.
// docs/FORMAT.md ("Loading a bitsandbytes checkpoint") maps the keys onto Nf4Weight.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qmm/nf4.h"
#include "qmm/safetensors.h"
#include "qmm/tensor.h"

namespace qmm {

// Where a bitsandbytes state dict's fields come from: a safetensors file, or another store of named tensors (the
// Python package's state dicts). Names, file dtype names ("U8", "F32", ...) and shapes; the bytes of a field are
// asked for only where a check reads them (the quant state's JSON, the code maps, the scales), never the codes.
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  virtual bool contains(const std::string& name) const = 0;
  virtual std::string dtype(const std::string& name) const = 0;                // a present name only
  virtual std::vector<std::int64_t> shape(const std::string& name) const = 0;  // a present name only
  virtual std::vector<std::uint8_t> bytes(const std::string& name) const = 0;  // a present name only, host copy
  // What the source is, for messages ("the file", "the state dict").
  virtual std::string kind() const = 0;
};

// The layout a checked bitsandbytes 4-bit weight declares.
struct Bnb4bitLayout {
  std::int64_t rows = 0, cols = 0;
  int block_size = 0;
  bool double_quant = false;
  float offset = 0.0f;  // the double quantization's offset (0 when plain)
};

// Checks every field of a bitsandbytes 4-bit weight stored under `prefix` (the keys below) against the others, as
// load_bnb_nf4_weight does before it copies anything. Messages read "<op>: <source>: <what>" (source may be empty).
// The Python package's Nf4Weight.from_bnb_state_dict runs the same checks.
Bnb4bitLayout check_bnb_nf4_weight(const TensorSource& src, const std::string& prefix = "weight",
                                   const std::string& source = "", const std::string& op = "check_bnb_nf4_weight");

// Whether `f` holds a bitsandbytes 4-bit weight under `prefix` (its "<prefix>.quant_state.bitsandbytes__*" entry).
bool has_bnb_4bit_weight(const SafetensorsFile& f, const std::string& prefix = "weight");

// Reads a bitsandbytes 4-bit weight stored under `prefix` (Linear4bit.state_dict() keys):
//   <prefix>                                      u8 packed codes, ceil(N·K/2) bytes (bnb writes [N·K/2, 1])
//   <prefix>.absmax                               f32 [nblocks] (plain) or u8 [nblocks] (double-quantized)
//   <prefix>.nested_absmax, .nested_quant_map     f32 [ngroups] and f32 [256] (double-quantized only)
//   <prefix>.quant_map                            f32 [16], optional: must be the NF4 codebook
//   <prefix>.quant_state.bitsandbytes__nf4        u8 bytes of a JSON text: quant_type, blocksize, shape [N,K],
//                                                 and when double-quantized nested_blocksize (256), nested_offset
// Every field is checked against the others before anything is returned. Throws Error(Io) naming the field for
// a missing or malformed one, Error(Unsupported) for a valid format qmm does not serve (FP4, a block size or
// nested block size bitsandbytes allows but NF4 here does not, a non-standard code map). The result lives on
// `device` (copied there after the checks).
Nf4Tensor load_bnb_nf4_weight(const SafetensorsFile& f, const std::string& prefix = "weight",
                              Device device = Device::cpu());
// The same from a file path; error messages start with the path.
Nf4Tensor load_bnb_nf4_weight(const std::string& path, const std::string& prefix = "weight",
                              Device device = Device::cpu());

}  // namespace qmm
