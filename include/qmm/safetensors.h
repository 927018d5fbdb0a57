// A small safetensors reader and writer (https://huggingface.co/docs/safetensors): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then the data.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "qmm/tensor.h"

namespace qmm {

struct SafetensorsEntry {
  std::string dtype;                // as written in the file: "F32", "BF16", "U8", "I64", ...
  std::vector<std::int64_t> shape;  // any rank
  std::uint64_t begin = 0;          // byte offsets into the data section
  std::uint64_t end = 0;
};

class SafetensorsFile {
 public:
  // Reads and validates a whole file; throws Error(Io) naming the file and the fault.
  static SafetensorsFile open(const std::string& path);
  // Validates an in-memory image; `source` names it in error messages.
  static SafetensorsFile parse(std::vector<std::uint8_t> bytes, const std::string& source = "<memory>");

  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const SafetensorsEntry& entry(const std::string& name) const;  // throws Io when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The raw bytes of one tensor.
  std::vector<std::uint8_t> bytes(const std::string& name) const;
  // A host copy of one tensor as a qmm Tensor; throws Unsupported for dtypes qmm lacks (F32, BF16, F16, U8
  // are supported) or rank > 4. `expected` (when given) is checked: Io on a dtype mismatch.
  Tensor tensor(const std::string& name) const;
  Tensor tensor(const std::string& name, DType expected) const;

 private:
  std::string source_;
  std::vector<std::uint8_t> data_;  // the data section
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes host tensors (any device is copied to host first) and string metadata; throws Error(Io) on failure.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace qmm
