// safetensors reader and writer. Every fault in a file is reported as Error(Io, "safetensors: <file>: <what>");
// the header is validated completely when the file is opened, so later accessors cannot run off the data.
#include "qmm/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "qmm/error.h"

namespace qmm {
namespace {

using Json = nlohmann::json;

// A header larger than this is refused before it is parsed (the reference implementation's limit).
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

[[noreturn]] void io_fail(const std::string& source, const std::string& what) {
  throw Error(ErrorCode::Io, "safetensors: " + source + ": " + what);
}

// Bytes per element of the dtypes the format defines; 0 for names it does not (their sizes are not checked).
std::uint64_t element_size(const std::string& dtype) {
  static const std::pair<const char*, std::uint64_t> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},   {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1}, {"I16", 2}, {"U16", 2},
      {"F16", 2},  {"BF16", 2}, {"I32", 4}, {"U32", 4},     {"F32", 4},     {"I64", 8},     {"U64", 8}, {"F64", 8}};
  for (const auto& [name, size] : kSizes)
    if (dtype == name) return size;
  return 0;
}

const char* file_dtype(DType d) {
  switch (d) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::U8: return "U8";
  }
  return "?";
}

bool qmm_dtype(const std::string& name, DType& out) {
  for (DType d : {DType::F32, DType::BF16, DType::F16, DType::U8})
    if (name == file_dtype(d)) {
      out = d;
      return true;
    }
  return false;
}

std::string quoted(const std::string& s) { return "'" + s + "'"; }

// A JSON value that is a non-negative integer fitting in 64 bits.
bool as_unsigned(const Json& v, std::uint64_t& out) {
  if (v.is_number_unsigned()) {
    out = v.get<std::uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
    out = static_cast<std::uint64_t>(v.get<std::int64_t>());
    return true;
  }
  return false;
}

SafetensorsEntry parse_entry(const std::string& source, const std::string& name, const Json& v,
                             std::uint64_t data_size) {
  const std::string where = "tensor " + quoted(name);
  if (!v.is_object()) io_fail(source, where + " is not a JSON object");
  SafetensorsEntry e;

  const auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) io_fail(source, where + " has no string \"dtype\"");
  e.dtype = dt->get<std::string>();

  const auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) io_fail(source, where + " has no \"shape\" array");
  std::uint64_t numel = 1;
  bool overflow = false;
  for (const Json& d : *sh) {
    std::uint64_t extent = 0;
    if (!as_unsigned(d, extent) || extent > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      io_fail(source, where + " has shape " + sh->dump() + ": extents must be non-negative integers");
    e.shape.push_back(static_cast<std::int64_t>(extent));
    if (extent != 0 && numel > std::numeric_limits<std::uint64_t>::max() / extent) overflow = true;
    numel *= extent;
  }

  const auto off = v.find("data_offsets");
  std::uint64_t begin = 0, end = 0;
  if (off == v.end() || !off->is_array() || off->size() != 2 || !as_unsigned((*off)[0], begin) ||
      !as_unsigned((*off)[1], end))
    io_fail(source, where + " has no \"data_offsets\" [begin, end] of non-negative integers");
  if (begin > end)
    io_fail(source, where + " has data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                        "]: begin is past end");
  if (end > data_size)
    io_fail(source, where + " has data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                        "] out of range: the data section holds " + std::to_string(data_size) + " bytes");
  e.begin = begin;
  e.end = end;

  if (const std::uint64_t size = element_size(e.dtype); size != 0) {
    if (!overflow && numel > std::numeric_limits<std::uint64_t>::max() / size) overflow = true;
    if (overflow || numel * size != end - begin)
      io_fail(source, where + " is " + e.dtype + " of shape " + sh->dump() + " (" +
                          (overflow ? std::string("an overflowing size") : std::to_string(numel * size) + " bytes") +
                          ") but its data_offsets span " + std::to_string(end - begin) + " bytes");
  }
  return e;
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) io_fail(path, "no such file");
  if (std::filesystem::is_directory(path, ec)) io_fail(path, "is a directory, not a file");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) io_fail(path, std::string("cannot open for reading (") + std::strerror(errno) + ")");
  const std::streamoff size = in.tellg();
  if (size < 0) io_fail(path, "cannot determine the file size");
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size)) io_fail(path, "read failed");
  return parse(std::move(bytes), path);
}

SafetensorsFile SafetensorsFile::parse(std::vector<std::uint8_t> bytes, const std::string& source) {
  if (bytes.size() < 8)
    io_fail(source, "file is " + std::to_string(bytes.size()) + " bytes, too short for the 8-byte header length");
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[static_cast<std::size_t>(i)];  // little endian
  const std::uint64_t after = bytes.size() - 8;
  if (header_len > kMaxHeaderBytes)
    io_fail(source, "header length " + std::to_string(header_len) + " exceeds the limit of " +
                        std::to_string(kMaxHeaderBytes) + " bytes");
  if (header_len > after)
    io_fail(source, "header length " + std::to_string(header_len) + " exceeds the " + std::to_string(after) +
                        " bytes that follow the length field (truncated file?)");

  const char* text = reinterpret_cast<const char*>(bytes.data() + 8);
  Json header;
  try {
    header = Json::parse(text, text + header_len);
  } catch (const Json::exception& e) {
    io_fail(source, std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.is_object()) io_fail(source, "header is JSON but not an object");

  SafetensorsFile f;
  f.source_ = source;
  const std::uint64_t data_size = after - header_len;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) io_fail(source, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string())
          io_fail(source, "__metadata__ value of " + quoted(m.key()) + " is " + m->type_name() +
                              ", but metadata values must be strings");
        f.metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    f.entries_[it.key()] = parse_entry(source, it.key(), *it, data_size);
  }

  // No two tensors may share a byte (empty tensors occupy none).
  std::vector<std::pair<const std::string*, const SafetensorsEntry*>> order;
  for (const auto& [name, e] : f.entries_)
    if (e.end > e.begin) order.push_back({&name, &e});
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (std::size_t i = 1; i < order.size(); ++i)
    if (order[i].second->begin < order[i - 1].second->end)
      io_fail(source, "tensors " + quoted(*order[i - 1].first) + " and " + quoted(*order[i].first) +
                          " overlap in the data section");

  bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(8 + header_len));
  f.data_ = std::move(bytes);
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& kv : entries_) out.push_back(kv.first);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const { return entries_.count(name) != 0; }

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) io_fail(source_, "no tensor named " + quoted(name));
  return it->second;
}

std::vector<std::uint8_t> SafetensorsFile::bytes(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  return {data_.begin() + static_cast<std::ptrdiff_t>(e.begin), data_.begin() + static_cast<std::ptrdiff_t>(e.end)};
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  DType dtype;
  if (!qmm_dtype(e.dtype, dtype))
    throw Error(ErrorCode::Unsupported, "safetensors: " + source_ + ": tensor " + quoted(name) + " has dtype " +
                                            e.dtype + ", which qmm does not support (F32, BF16, F16, U8)");
  if (e.shape.size() > static_cast<std::size_t>(kMaxRank))
    throw Error(ErrorCode::Unsupported, "safetensors: " + source_ + ": tensor " + quoted(name) + " has rank " +
                                            std::to_string(e.shape.size()) + " but qmm tensors have rank <= 4");
  Shape shape;
  for (std::int64_t d : e.shape) shape.dims[static_cast<std::size_t>(shape.rank++)] = d;
  Tensor t(dtype, shape);  // 64-byte aligned, wherever the bytes sit in the file
  if (e.end > e.begin) std::memcpy(t.data(), data_.data() + e.begin, e.end - e.begin);
  return t;
}

Tensor SafetensorsFile::tensor(const std::string& name, DType expected) const {
  const SafetensorsEntry& e = entry(name);
  if (e.dtype != file_dtype(expected))
    io_fail(source_, "tensor " + quoted(name) + " is " + e.dtype + " but " + file_dtype(expected) + " was expected");
  return tensor(name);
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // Name order for the data, so that a file's bytes depend only on its contents.
  std::map<std::string, TensorView> sorted;
  for (const auto& [name, view] : tensors) {
    if (name.empty()) io_fail(path, "a tensor has an empty name");
    if (name == "__metadata__") io_fail(path, "\"__metadata__\" is reserved and cannot name a tensor");
    if (!sorted.emplace(name, view).second) io_fail(path, "tensor name " + quoted(name) + " is given twice");
    if (view.numel() > 0 && view.data() == nullptr) io_fail(path, "tensor " + quoted(name) + " has null data");
  }

  std::string header_text;
  try {
    Json header = Json::object();
    if (!metadata.empty()) {
      Json meta = Json::object();
      for (const auto& [k, v] : metadata) meta[k] = v;
      header["__metadata__"] = meta;
    }
    std::uint64_t offset = 0;
    for (const auto& [name, view] : sorted) {
      Json shape = Json::array();
      for (int i = 0; i < view.rank(); ++i) shape.push_back(view.dim(i));
      const std::uint64_t size = view.nbytes();
      header[name] = {{"dtype", file_dtype(view.dtype())}, {"shape", shape}, {"data_offsets", {offset, offset + size}}};
      offset += size;
    }
    header_text = header.dump();
  } catch (const Json::exception& e) {
    io_fail(path, std::string("cannot encode the header (") + e.what() + ")");
  }
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) io_fail(path, std::string("cannot open for writing (") + std::strerror(errno) + ")");
  std::uint8_t len[8];
  const std::uint64_t header_len = header_text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<std::uint8_t>(header_len >> (8 * i));  // little endian
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(header_text.data(), static_cast<std::streamsize>(header_text.size()));
  for (const auto& [name, view] : sorted) {
    if (view.numel() == 0) continue;
    const void* src = view.data();
    Tensor host;
    if (!view.device().is_cpu()) {
      host = Tensor(view.dtype(), view.shape());
      copy(host, view);
      src = host.data();
    }
    out.write(static_cast<const char*>(src), static_cast<std::streamsize>(view.nbytes()));
  }
  out.flush();
  if (!out) io_fail(path, "write failed");
}

}  // namespace qmm
