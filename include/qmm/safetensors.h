// A small safetensors reader and writer (https://huggingface.co/docs/safetensors): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then the data.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
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

// A validated file: its header is parsed and every entry checked when it is opened or parsed, so the accessors
// cannot run off the data. Copies are cheap and share the data (the file's mapping or the in-memory image), which
// lives as long as any copy does.
//
// Shapes: every extent is a non-negative int64 and the product of the non-zero extents must fit in int64 (so no
// element count a caller computes, in any order, wraps); for the dtypes the format defines, element count × size
// must equal the bytes the entry's data_offsets span. An empty tensor with a huge other extent (e.g. F32 of shape
// [2^63-1, 0], data_offsets [n, n]) is valid and loads as an empty Tensor of that shape.
class SafetensorsFile {
 public:
  // Opens a file on disk. Checks, in this order and before any tensor data is read or mapped: that the path is a
  // regular file (a FIFO, device, socket or directory is refused without being opened for reading), that it
  // holds the 8-byte header length, that the header fits in the file (and in 100 MB), then the header itself (a
  // JSON object nested at most 32 deep, string metadata) and every entry's dtype, shape and data_offsets against
  // the file's actual size (no two tensors overlapping). Only the length field and the
  // header are read; the data section is then mapped read-only (mmap) and tensors are copied out of the mapping
  // on request, so loading costs at most the file size in page cache plus the tensors kept (where the file cannot
  // be mapped, the data section is read into memory instead). Throws Error(Io) "safetensors: <path>: <what>".
  // As with any mapped file, truncating the file on disk while it is open makes later reads of the cut-off part
  // fault (SIGBUS): replace files by renaming, not by rewriting in place.
  static SafetensorsFile open(const std::string& path);
  // The same checks on an in-memory image (kept, whole, by the result); `source` names it in error messages.
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
  const std::uint8_t* data_of(const SafetensorsEntry& e) const;  // the entry's first byte, bounds checked
  void copy_out(const SafetensorsEntry& e, void* dst) const;      // the entry's bytes into dst

  std::string source_;
  std::shared_ptr<const void> storage_;  // owns the data section: the file's mapping or the in-memory image
  const std::uint8_t* data_ = nullptr;   // the data section (inside storage_)
  std::uint64_t data_size_ = 0;
  bool mapped_ = false;  // storage_ is a mapping of the file
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes host tensors (any device is copied to host first) and string metadata; throws Error(Io) on failure.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace qmm
