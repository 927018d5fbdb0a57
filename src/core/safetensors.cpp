// safetensors reader and writer. Every fault in a file is reported as Error(Io, "safetensors: <file>: <what>");
// the header is validated completely, against the file's real size, before any tensor data is read or mapped, so a
// lying header costs nothing and later accessors cannot run off the data.
#include "qmm/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/json_depth.h"
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
    case DType::I32: return "I32";
  }
  return "?";
}

bool qmm_dtype(const std::string& name, DType& out) {
  for (DType d : {DType::F32, DType::BF16, DType::F16, DType::U8, DType::I32})
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

// A JSON value for an error message: at most a line of it (a hostile header can make any value huge).
std::string brief(const Json& v) {
  std::string text = v.dump();
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
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
  // The product of the non-zero extents must fit in int64: then every partial product a reader forms, in any
  // order, fits too (a zero extent makes the product 0 but not the partial products before it).
  std::int64_t nonzero = 1;
  bool empty = false;
  for (const Json& d : *sh) {
    std::uint64_t extent = 0;
    if (!as_unsigned(d, extent) || extent > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      io_fail(source, where + " has shape " + brief(*sh) + ": extents must be non-negative integers below 2^63");
    e.shape.push_back(static_cast<std::int64_t>(extent));
    if (extent == 0)
      empty = true;
    else if (__builtin_mul_overflow(nonzero, static_cast<std::int64_t>(extent), &nonzero))
      io_fail(source, where + " has shape " + brief(*sh) + ", whose element count overflows int64");
  }
  const std::uint64_t numel = empty ? 0 : static_cast<std::uint64_t>(nonzero);

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
    std::uint64_t bytes = 0;
    const bool overflow = __builtin_mul_overflow(numel, size, &bytes);
    if (overflow || bytes != end - begin)
      io_fail(source, where + " is " + e.dtype + " of shape " + brief(*sh) + " (" +
                          (overflow ? std::string("a byte size that overflows") : std::to_string(bytes) + " bytes") +
                          ") but its data_offsets span " + std::to_string(end - begin) + " bytes");
  }
  return e;
}

// The deepest JSON nesting a header may have; the format needs 3 ({name: {"shape": [...]}}).
constexpr int kMaxHeaderDepth = 32;

void check_depth(const std::string& source, const char* text, std::uint64_t len) {
  if (detail::json_depth(text, static_cast<std::size_t>(len)) > kMaxHeaderDepth)
    io_fail(source, "header nests JSON deeper than " + std::to_string(kMaxHeaderDepth) + " levels");
}

// The header length field, checked against the limit and against the bytes that follow it.
std::uint64_t header_length(const std::string& source, const std::uint8_t field[8], std::uint64_t file_size) {
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | field[i];  // little endian
  const std::uint64_t after = file_size - 8;
  if (header_len > kMaxHeaderBytes)
    io_fail(source, "header length " + std::to_string(header_len) + " exceeds the limit of " +
                        std::to_string(kMaxHeaderBytes) + " bytes");
  if (header_len > after)
    io_fail(source, "header length " + std::to_string(header_len) + " exceeds the " + std::to_string(after) +
                        " bytes that follow the length field (truncated file?)");
  return header_len;
}

void require_length_field(const std::string& source, std::uint64_t size) {
  if (size < 8) io_fail(source, "file is " + std::to_string(size) + " bytes, too short for the 8-byte header length");
}

struct Header {
  std::map<std::string, SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
};

// Parses and validates the header against a data section of `data_size` bytes.
Header parse_header(const std::string& source, const char* text, std::uint64_t len, std::uint64_t data_size) {
  check_depth(source, text, len);
  Json header;
  try {
    header = Json::parse(text, text + len);
  } catch (const Json::exception& e) {
    io_fail(source, std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.is_object()) io_fail(source, "header is JSON but not an object");

  Header h;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) io_fail(source, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string())
          io_fail(source, "__metadata__ value of " + quoted(m.key()) + " is " + m->type_name() +
                              ", but metadata values must be strings");
        h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    h.entries[it.key()] = parse_entry(source, it.key(), *it, data_size);
  }

  // No two tensors may share a byte (empty tensors occupy none).
  std::vector<std::pair<const std::string*, const SafetensorsEntry*>> order;
  for (const auto& [name, e] : h.entries)
    if (e.end > e.begin) order.push_back({&name, &e});
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (std::size_t i = 1; i < order.size(); ++i)
    if (order[i].second->begin < order[i - 1].second->end)
      io_fail(source, "tensors " + quoted(*order[i - 1].first) + " and " + quoted(*order[i].first) +
                          " overlap in the data section");
  return h;
}

// ---- files on disk ----

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// What a stat mode is, for "is a FIFO (named pipe), not a regular file".
const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

void require_regular(const std::string& path, mode_t mode) {
  if (S_ISREG(mode)) return;
  if (S_ISDIR(mode)) io_fail(path, "is a directory, not a file");
  io_fail(path, std::string("is ") + file_kind(mode) + ", not a regular file");
}

std::string errno_text() { return std::strerror(errno); }

// Reads exactly `size` bytes at `offset`; the file shrinking underneath is an error, not a short result.
void read_exact(const std::string& path, int fd, std::uint8_t* dst, std::uint64_t size, std::uint64_t offset,
                const char* what) {
  while (size > 0) {
    const std::size_t chunk = static_cast<std::size_t>(std::min<std::uint64_t>(size, 1u << 30));
    const ssize_t n = ::pread(fd, dst, chunk, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      io_fail(path, std::string("cannot read the ") + what + " (" + errno_text() + ")");
    }
    if (n == 0) io_fail(path, std::string("the file ended while reading the ") + what + " (changed while open?)");
    dst += n;
    size -= static_cast<std::uint64_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  // stat first: opening a FIFO for reading would block until a writer comes, and a device may never end.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) io_fail(path, "no such file");
    io_fail(path, "cannot stat (" + errno_text() + ")");
  }
  require_regular(path, st.st_mode);
  // O_NONBLOCK: should the path be swapped for a FIFO after the stat, open still returns (fstat then refuses it).
  const Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (fd.get() < 0) io_fail(path, "cannot open for reading (" + errno_text() + ")");
  if (::fstat(fd.get(), &st) != 0) io_fail(path, "cannot stat (" + errno_text() + ")");
  require_regular(path, st.st_mode);
  if (st.st_size < 0) io_fail(path, "has a negative size");
  const std::uint64_t file_size = static_cast<std::uint64_t>(st.st_size);

  require_length_field(path, file_size);
  std::uint8_t field[8];
  read_exact(path, fd.get(), field, 8, 0, "header length");
  const std::uint64_t header_len = header_length(path, field, file_size);
  std::string text(static_cast<std::size_t>(header_len), '\0');
  read_exact(path, fd.get(), reinterpret_cast<std::uint8_t*>(text.data()), header_len, 8, "header");
  const std::uint64_t data_begin = 8 + header_len;
  const std::uint64_t data_size = file_size - data_begin;
  Header h = parse_header(path, text.data(), header_len, data_size);  // every entry checked against the file size

  SafetensorsFile f;
  f.source_ = path;
  f.entries_ = std::move(h.entries);
  f.metadata_ = std::move(h.metadata);
  f.data_size_ = data_size;
  if (data_size == 0) return f;  // nothing to map (mmap refuses length 0); every tensor is empty
  if (data_size > std::numeric_limits<std::size_t>::max())
    io_fail(path, "the data section (" + std::to_string(data_size) + " bytes) does not fit in the address space");

  // Map from the page holding the data section's first byte (mmap offsets are page-aligned) to the end.
  const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  const std::uint64_t map_begin = data_begin / page * page;
  const std::size_t map_len = static_cast<std::size_t>(file_size - map_begin);
  void* base = ::mmap(nullptr, map_len, PROT_READ, MAP_PRIVATE, fd.get(), static_cast<off_t>(map_begin));
  if (base != MAP_FAILED) {
    f.storage_ =
        std::shared_ptr<const void>(base, [map_len](const void* p) { ::munmap(const_cast<void*>(p), map_len); });
    f.data_ = static_cast<const std::uint8_t*>(base) + (data_begin - map_begin);
    f.mapped_ = true;
    return f;
  }
  // A file system that cannot map files: read the data section instead.
  auto data = std::make_shared<std::vector<std::uint8_t>>(static_cast<std::size_t>(data_size));
  read_exact(path, fd.get(), data->data(), data_size, data_begin, "data section");
  f.data_ = data->data();
  f.storage_ = std::move(data);
  return f;
}

SafetensorsFile SafetensorsFile::parse(std::vector<std::uint8_t> bytes, const std::string& source) {
  require_length_field(source, bytes.size());
  const std::uint64_t header_len = header_length(source, bytes.data(), bytes.size());
  const std::uint64_t data_begin = 8 + header_len;
  Header h = parse_header(source, reinterpret_cast<const char*>(bytes.data() + 8), header_len,
                          bytes.size() - data_begin);

  SafetensorsFile f;
  f.source_ = source;
  f.entries_ = std::move(h.entries);
  f.metadata_ = std::move(h.metadata);
  f.data_size_ = bytes.size() - data_begin;
  auto image = std::make_shared<std::vector<std::uint8_t>>(std::move(bytes));
  f.data_ = image->data() + data_begin;
  f.storage_ = std::move(image);
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

const std::uint8_t* SafetensorsFile::data_of(const SafetensorsEntry& e) const {
  if (e.begin > e.end || e.end > data_size_)  // parse_entry made this impossible
    throw Error(ErrorCode::Internal, "safetensors: " + source_ + ": an entry lies outside the data section");
  return data_ + e.begin;
}

// From a mapping the copy goes in slices, each slice's whole pages released after it: the file's pages then do not
// stay resident beside the copy, so reading a tensor costs its own size, not twice it (they are read again from the
// file if asked for again).
void SafetensorsFile::copy_out(const SafetensorsEntry& e, void* dst) const {
  const std::uint8_t* src = data_of(e);
  const std::uint64_t size = e.end - e.begin;
  if (!mapped_) {
    if (size > 0) std::memcpy(dst, src, size);
    return;
  }
  constexpr std::uint64_t kSlice = std::uint64_t{64} << 20;
  const std::uintptr_t page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  for (std::uint64_t done = 0; done < size; done += kSlice) {
    const std::uint64_t n = std::min(kSlice, size - done);
    std::memcpy(static_cast<std::uint8_t*>(dst) + done, src + done, n);
    const std::uintptr_t lo = (reinterpret_cast<std::uintptr_t>(src + done) + page - 1) / page * page;
    const std::uintptr_t hi = reinterpret_cast<std::uintptr_t>(src + done + n) / page * page;
    if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // advice: a failure costs memory only
  }
}

std::vector<std::uint8_t> SafetensorsFile::bytes(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(e.end - e.begin));
  copy_out(e, out.data());
  return out;
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  DType dtype;
  if (!qmm_dtype(e.dtype, dtype))
    throw Error(ErrorCode::Unsupported, "safetensors: " + source_ + ": tensor " + quoted(name) + " has dtype " +
                                            e.dtype + ", which qmm does not support (F32, BF16, F16, U8, I32)");
  if (e.shape.size() > static_cast<std::size_t>(kMaxRank))
    throw Error(ErrorCode::Unsupported, "safetensors: " + source_ + ": tensor " + quoted(name) + " has rank " +
                                            std::to_string(e.shape.size()) + " but qmm tensors have rank <= 4");
  Shape shape;
  for (std::int64_t d : e.shape) shape.dims[static_cast<std::size_t>(shape.rank++)] = d;
  // The header check made numel × size equal the entry's bytes (or numel 0), so this cannot overflow; checked
  // again because a wrong size here would copy past the tensor.
  std::uint64_t want = 0;
  if (__builtin_mul_overflow(static_cast<std::uint64_t>(shape.numel()), dtype_size(dtype), &want) ||
      want != e.end - e.begin)
    io_fail(source_, "tensor " + quoted(name) + " of shape " + shape.str() + " does not match its " +
                         std::to_string(e.end - e.begin) + " bytes");
  Tensor t(dtype, shape);  // 64-byte aligned, wherever the bytes sit in the file
  copy_out(e, t.data());
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
