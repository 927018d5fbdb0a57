// bitsandbytes 4-bit weights from safetensors state dicts. Everything is checked on the host, field against
// field, before a byte is copied to the device: a malformed file fails with the field named, never later in a
// kernel.
#include "qmm/checkpoint.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/json_depth.h"
#include "qmm/error.h"

namespace qmm {
namespace {

using Json = nlohmann::json;

constexpr int kCode2Size = 256;

// A safetensors file as a TensorSource.
class FileSource final : public TensorSource {
 public:
  explicit FileSource(const SafetensorsFile& f) : f_(f) {}
  bool contains(const std::string& name) const override { return f_.contains(name); }
  std::string dtype(const std::string& name) const override { return f_.entry(name).dtype; }
  std::vector<std::int64_t> shape(const std::string& name) const override { return f_.entry(name).shape; }
  std::vector<std::uint8_t> bytes(const std::string& name) const override { return f_.bytes(name); }
  std::string kind() const override { return "the file"; }

 private:
  const SafetensorsFile& f_;
};

// Names the file (when known) and the field in every message.
class Reader {
 public:
  Reader(const TensorSource& src, std::string prefix, std::string source, std::string op)
      : src_(src), prefix_(std::move(prefix)), source_(std::move(source)), op_(std::move(op)) {}

  [[noreturn]] void fail(ErrorCode code, const std::string& what) const {
    throw Error(code, op_ + ": " + (source_.empty() ? "" : source_ + ": ") + what);
  }
  std::string key(const char* suffix) const { return prefix_ + suffix; }
  static std::string quoted(const std::string& s) { return "'" + s + "'"; }
  [[noreturn]] void missing(const std::string& name, const std::string& why = "") const {
    fail(ErrorCode::Io, src_.kind() + " has no tensor " + quoted(name) + why);
  }

  // The entry `name` with one of the file dtypes given ("U8", "F32"); returns its dtype.
  std::string require_entry(const std::string& name, std::initializer_list<const char*> dtypes) const {
    if (!src_.contains(name)) missing(name);
    const std::string dtype = src_.dtype(name);
    std::string allowed;
    for (const char* d : dtypes) {
      if (dtype == d) return dtype;
      allowed += allowed.empty() ? d : std::string(" or ") + d;
    }
    fail(ErrorCode::Io, quoted(name) + " is " + dtype + " but must be " + allowed);
  }

  // An element count that overflows is reported as such (a source other than a checked file may declare any
  // shape).
  std::int64_t numel(const std::string& name) const {
    std::int64_t n = 1;
    for (std::int64_t d : src_.shape(name)) {
      if (d < 0) fail(ErrorCode::Io, quoted(name) + " has a negative extent " + std::to_string(d));
      if (d != 0 && n > std::numeric_limits<std::int64_t>::max() / d)
        fail(ErrorCode::Io, quoted(name) + " has a shape whose element count overflows");
      n *= d;
    }
    return n;
  }

  void require_numel(const std::string& name, std::int64_t want, const std::string& why) const {
    const std::int64_t got = numel(name);
    if (got != want)
      fail(ErrorCode::Io, quoted(name) + " has " + std::to_string(got) + " elements but " + why + " needs " +
                              std::to_string(want));
  }

  // The f32 values of `name` (whose dtype and count were checked).
  std::vector<float> floats(const std::string& name) const {
    const std::vector<std::uint8_t> raw = src_.bytes(name);
    if (raw.size() != static_cast<std::size_t>(numel(name)) * sizeof(float))
      fail(ErrorCode::Io, quoted(name) + " has " + std::to_string(raw.size()) + " bytes for " +
                              std::to_string(numel(name)) + " F32 values");
    std::vector<float> out(raw.size() / sizeof(float));
    if (!out.empty()) std::memcpy(out.data(), raw.data(), raw.size());
    return out;
  }

  void require_finite(const std::string& name, const std::vector<float>& values) const {
    for (std::size_t i = 0; i < values.size(); ++i)
      if (!std::isfinite(values[i]))
        fail(ErrorCode::Io, quoted(name) + " holds a non-finite value (" + std::to_string(values[i]) +
                                ") at index " + std::to_string(i));
  }

  const TensorSource& source() const { return src_; }

 private:
  const TensorSource& src_;
  std::string prefix_;
  std::string source_;
  std::string op_;
};

bool is_power_of_two(std::int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

// A JSON field that must be a (non-boolean) integer.
std::int64_t json_int(const Reader& r, const Json& qs, const std::string& where, const char* field) {
  const auto it = qs.find(field);
  if (it == qs.end() || !it->is_number_integer())
    r.fail(ErrorCode::Io, where + " has no integer \"" + field + "\"");
  return it->get<std::int64_t>();
}

Json parse_quant_state(const Reader& r, const std::string& name) {
  r.require_entry(name, {"U8"});
  const std::vector<std::uint8_t> bytes = r.source().bytes(name);
  constexpr int kMaxDepth = 8;  // the quant state needs 2 ({"shape": [N, K]})
  if (detail::json_depth(reinterpret_cast<const char*>(bytes.data()), bytes.size()) > kMaxDepth)
    r.fail(ErrorCode::Io, Reader::quoted(name) + " nests JSON deeper than " + std::to_string(kMaxDepth) + " levels");
  Json qs;
  try {
    qs = Json::parse(bytes.begin(), bytes.end());
  } catch (const Json::exception& e) {
    r.fail(ErrorCode::Io, Reader::quoted(name) + " is not valid JSON text (" + e.what() + ")");
  }
  if (!qs.is_object()) r.fail(ErrorCode::Io, Reader::quoted(name) + " is JSON but not an object");
  return qs;
}

Bnb4bitLayout check(const Reader& r, const std::string& prefix) {
  const TensorSource& src = r.source();
  const std::string qs_name = r.key(".quant_state.bitsandbytes__nf4");
  if (!src.contains(qs_name)) {
    if (src.contains(r.key(".quant_state.bitsandbytes__fp4")))
      r.fail(ErrorCode::Unsupported, Reader::quoted(prefix) + " is FP4-quantized; qmm reads NF4 only");
    r.missing(qs_name, " (not a bitsandbytes 4-bit weight under the prefix " + Reader::quoted(prefix) + ")");
  }
  const Json qs = parse_quant_state(r, qs_name);
  const std::string where = Reader::quoted(qs_name);

  const auto type = qs.find("quant_type");
  if (type == qs.end() || !type->is_string()) r.fail(ErrorCode::Io, where + " has no string \"quant_type\"");
  if (*type != "nf4") r.fail(ErrorCode::Unsupported, where + " has quant_type " + type->dump() + "; qmm reads \"nf4\"");

  const std::int64_t block = json_int(r, qs, where, "blocksize");
  if (!is_power_of_two(block)) r.fail(ErrorCode::Io, where + " has blocksize " + std::to_string(block) +
                                                         " but it must be a power of two");
  if (block < 64 || block > 4096)
    r.fail(ErrorCode::Unsupported, where + " has blocksize " + std::to_string(block) + "; qmm's NF4 takes 64 to 4096");

  const auto shape = qs.find("shape");
  if (shape == qs.end() || !shape->is_array() || shape->size() != 2 || !(*shape)[0].is_number_integer() ||
      !(*shape)[1].is_number_integer() || (*shape)[0].get<std::int64_t>() < 1 || (*shape)[1].get<std::int64_t>() < 1)
    r.fail(ErrorCode::Io, where + " has shape " + (shape == qs.end() ? std::string("(none)") : shape->dump()) +
                              " but it must be [N, K] with N, K >= 1");
  const std::int64_t rows = (*shape)[0].get<std::int64_t>(), cols = (*shape)[1].get<std::int64_t>();
  if (rows > std::numeric_limits<std::int64_t>::max() / 2 / cols)
    r.fail(ErrorCode::Io, where + " has shape " + shape->dump() + ", whose element count overflows");
  const std::string dims = "[" + std::to_string(rows) + "," + std::to_string(cols) + "]";

  r.require_entry(prefix, {"U8"});
  r.require_numel(prefix, (rows * cols + 1) / 2, "a packed " + dims + " weight (two codes per byte)");

  const std::string absmax_name = r.key(".absmax");
  const bool nested = r.require_entry(absmax_name, {"U8", "F32"}) == "U8";
  const std::int64_t nblocks = (rows * cols + block - 1) / block;
  r.require_numel(absmax_name, nblocks, "a " + dims + " weight in blocks of " + std::to_string(block));
  const bool has_offset = qs.contains("nested_offset");
  if (!nested && has_offset)
    r.fail(ErrorCode::Io, where + " has a nested_offset but " + Reader::quoted(absmax_name) +
                              " is F32 (not double-quantized)");

  if (src.contains(r.key(".quant_map"))) {  // the codebook; kernels use the built-in one, so it must be that
    const std::string name = r.key(".quant_map");
    r.require_entry(name, {"F32"});
    r.require_numel(name, 16, "the NF4 codebook");
    const std::vector<float> map = r.floats(name);
    for (int i = 0; i < 16; ++i)
      if (map[static_cast<std::size_t>(i)] != nf4_code_value(i))
        r.fail(ErrorCode::Unsupported, Reader::quoted(name) + " differs from the NF4 codebook at index " +
                                           std::to_string(i) + ": not NF4");
  }

  Bnb4bitLayout layout{rows, cols, static_cast<int>(block), nested, 0.0f};
  if (!nested) {
    r.require_finite(absmax_name, r.floats(absmax_name));
    return layout;
  }
  if (!has_offset) r.fail(ErrorCode::Io, where + " has no \"nested_offset\" but " + Reader::quoted(absmax_name) +
                                             " is U8 (double-quantized)");
  const auto& off = qs.at("nested_offset");
  if (!off.is_number() || !std::isfinite(off.get<double>()))
    r.fail(ErrorCode::Io, where + " has nested_offset " + off.dump() + " but it must be a finite number");
  layout.offset = static_cast<float>(off.get<double>());  // an fp32 value printed as a double: exact
  if (!std::isfinite(layout.offset))
    r.fail(ErrorCode::Io, where + " has nested_offset " + off.dump() + ", beyond float32's range");
  const std::int64_t nested_block = json_int(r, qs, where, "nested_blocksize");
  if (nested_block != kNf4NestedBlockSize)
    r.fail(ErrorCode::Unsupported, where + " has nested_blocksize " + std::to_string(nested_block) +
                                       "; qmm's double quantization uses " + std::to_string(kNf4NestedBlockSize));
  if (qs.contains("nested_dtype") && qs.at("nested_dtype") != "float32")
    r.fail(ErrorCode::Unsupported,
           where + " has nested_dtype " + qs.at("nested_dtype").dump() + "; qmm reads float32");

  const std::string absmax2_name = r.key(".nested_absmax");
  r.require_entry(absmax2_name, {"F32"});
  const std::int64_t groups = (nblocks + kNf4NestedBlockSize - 1) / kNf4NestedBlockSize;
  r.require_numel(absmax2_name, groups,
                  std::to_string(nblocks) + " blocks in groups of " + std::to_string(kNf4NestedBlockSize));
  r.require_finite(absmax2_name, r.floats(absmax2_name));

  const std::string code2_name = r.key(".nested_quant_map");
  r.require_entry(code2_name, {"F32"});
  r.require_numel(code2_name, kCode2Size, "the 8-bit dynamic map");
  const std::vector<float> code2 = r.floats(code2_name);
  for (int i = 0; i < kCode2Size; ++i)
    if (std::memcmp(&code2[static_cast<std::size_t>(i)], &nf4_code2_table()[i], sizeof(float)) != 0)
      r.fail(ErrorCode::Unsupported,
             Reader::quoted(code2_name) + " differs from bitsandbytes' dynamic map at index " + std::to_string(i));
  return layout;
}

Nf4Tensor load(const SafetensorsFile& f, const std::string& prefix, Device device, const std::string& source) {
  const FileSource src(f);
  const Reader r(src, prefix, source, "load_bnb_nf4_weight");
  const Bnb4bitLayout layout = check(r, prefix);
  Nf4Tensor host = Nf4Tensor::allocate(layout.rows, layout.cols, layout.double_quant, Device::cpu(),
                                       layout.block_size);
  copy(host.codes, f.tensor(prefix));
  copy(host.absmax, f.tensor(r.key(".absmax")));
  if (layout.double_quant) {
    host.offset = layout.offset;
    copy(host.absmax2, f.tensor(r.key(".nested_absmax")));
    // host.code2 already holds the table (allocate fills it; check compared the file's map with it).
  }
  if (device.is_cpu()) return host;
  Nf4Tensor out = host;
  out.codes = to_device(host.codes, device);
  out.absmax = to_device(host.absmax, device);
  if (layout.double_quant) {
    out.absmax2 = to_device(host.absmax2, device);
    out.code2 = to_device(host.code2, device);
  }
  return out;
}

}  // namespace

Bnb4bitLayout check_bnb_nf4_weight(const TensorSource& src, const std::string& prefix, const std::string& source,
                                   const std::string& op) {
  return check(Reader(src, prefix, source, op), prefix);
}

bool has_bnb_4bit_weight(const SafetensorsFile& f, const std::string& prefix) {
  return f.contains(prefix + ".quant_state.bitsandbytes__nf4") || f.contains(prefix + ".quant_state.bitsandbytes__fp4");
}

Nf4Tensor load_bnb_nf4_weight(const SafetensorsFile& f, const std::string& prefix, Device device) {
  return load(f, prefix, device, "");
}

Nf4Tensor load_bnb_nf4_weight(const std::string& path, const std::string& prefix, Device device) {
  return load(SafetensorsFile::open(path), prefix, device, path);
}

}  // namespace qmm
