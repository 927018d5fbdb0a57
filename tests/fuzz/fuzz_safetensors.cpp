// A seeded random-mutation fuzzer for the safetensors reader (SafetensorsFile::parse and open) and the
// bitsandbytes NF4 loader on top of it (load_bnb_nf4_weight). Self-contained (no libFuzzer: CI's compiler is g++),
// deterministic (input i of seed S is the same on every machine), and meant to run under ASan + UBSan.
//
// Every input must either be accepted or rejected with qmm::Error; any other exception, a crash or a sanitizer
// report fails. Accepted files must also be self-consistent: each entry's bytes are within the file and match its
// shape and dtype, a tensor that loads holds exactly those bytes, a weight that loads has the sizes its shape needs
// and dequantizes, and open() on the same bytes on disk agrees with parse(), message for message.
//
// Inputs are valid seed images (a file with tensors of every kind, plain and double-quantized bitsandbytes layers)
// mutated structurally (shapes, dtypes, offsets, names, the quant-state JSON; the file stays consistent around the
// edit so the deep checks are reached), as JSON text (numbers made huge or negative, keys dropped, values of the
// wrong type, deep nesting) and as bytes (flips, inserts, deletes, header-length edits).
//
//   qmm_fuzz_safetensors [--iterations N] [--seed S] [--first I] [--replay DIR|FILE]... [--crash-dir DIR]
//                        [--histogram 1]   (counts of each kind of rejection: which checks the inputs reach)
//
// --replay runs each file of DIR (the kept regression inputs) before the random inputs. A failing input is written
// to DIR (--crash-dir, default the working directory) as fuzz-crash-<seed>-<input>.bin, also on a crash or a
// sanitizer report; keep it in tests/data/fuzz-regressions/ so every later run replays it. `--first I
// --iterations 1` reruns one random input.
#include <fcntl.h>
#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <typeinfo>
#include <vector>

#include "qmm/checkpoint.h"
#include "qmm/qmm.h"

#if defined(__SANITIZE_ADDRESS__)
#define QMM_FUZZ_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define QMM_FUZZ_SANITIZED 1
#endif
#endif
#ifdef QMM_FUZZ_SANITIZED
#include <sanitizer/common_interface_defs.h>
#endif

namespace {

using qmm::DType;
using qmm::Error;
using qmm::ErrorCode;
using qmm::SafetensorsFile;
using qmm::Tensor;
using Bytes = std::vector<std::uint8_t>;

// ---- randomness: input i of seed s depends on (s, i) alone ----

struct Rng {
  std::uint64_t state;
  std::uint64_t next() {  // splitmix64
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::size_t below(std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(next() % n); }
  bool one_in(std::size_t n) { return below(n) == 0; }
  template <class T>
  const T& pick(const std::vector<T>& v) { return v[below(v.size())]; }
};

// Numbers that sit on the edges of every check: zero, signs, int64/uint64 limits and just past them, powers of two
// whose products overflow, floats, exponents that overflow a double.
const std::vector<std::string> kNumbers = {
    "0", "1", "2", "3", "4", "7", "8", "15", "16", "63", "64", "65", "128", "255", "256", "4096", "65536", "-1", "-0",
    "-9223372036854775808", "9223372036854775807", "9223372036854775808", "18446744073709551615",
    "18446744073709551616", "4611686018427387904", "2305843009213693952", "4294967296", "4294967295",
    "1099511627776", "1.5", "1e3", "1e400", "-1e400", "0.0", "1E2", "00", "1e-400"};
const std::vector<std::string> kDtypes = {"F32", "BF16", "F16", "U8",  "I8",      "I64", "U64", "F64",
                                          "BOOL", "I32", "U16", "F8_E4M3", "X", "", "f32", "F32 "};
const std::vector<std::string> kValues = {"null", "true", "false", "\"s\"", "\"\"", "[]", "{}", "[1]", "{\"a\":1}",
                                          "[[[[[[[[]]]]]]]]", "1.5", "-1", "\"nf4\"", "\"fp4\""};

// ---- the structured form of a file, so that mutations can keep it consistent around an edit ----

struct Entry {
  std::string name;
  std::string dtype;
  std::vector<std::string> shape;  // JSON number texts
  Bytes data;
  bool u8_auto_shape = false;  // shape follows data.size() (U8 tensors that hold text)
  std::string offsets;         // raw JSON of data_offsets; empty: the consistent value
  std::string extra;           // raw text added inside the entry's object (",\"k\":v")
};

struct Model {
  std::vector<Entry> entries;
  std::vector<std::pair<std::string, std::string>> metadata;  // key, raw JSON value
  std::string prefix;                                         // the loader's prefix for this seed
};

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string header_text(const Model& m) {
  std::string h = "{";
  bool first = true;
  if (!m.metadata.empty()) {
    h += "\"__metadata__\":{";
    for (std::size_t i = 0; i < m.metadata.size(); ++i)
      h += (i ? "," : "") + json_string(m.metadata[i].first) + ":" + m.metadata[i].second;
    h += "}";
    first = false;
  }
  std::uint64_t offset = 0;
  for (const Entry& e : m.entries) {
    h += first ? "" : ",";
    first = false;
    h += json_string(e.name) + ":{\"dtype\":" + json_string(e.dtype) + ",\"shape\":[";
    if (e.u8_auto_shape) {
      h += std::to_string(e.data.size());
    } else {
      for (std::size_t i = 0; i < e.shape.size(); ++i) h += (i ? "," : "") + e.shape[i];
    }
    h += "],\"data_offsets\":";
    h += e.offsets.empty() ? "[" + std::to_string(offset) + "," + std::to_string(offset + e.data.size()) + "]"
                           : e.offsets;
    h += e.extra + "}";
    offset += e.data.size();
  }
  return h + "}";
}

Bytes image(const std::string& header, const Bytes& data, std::uint64_t length_field) {
  Bytes out(8 + header.size() + data.size());
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(length_field >> (8 * i));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + static_cast<std::ptrdiff_t>(header.size()));
  return out;
}

Bytes data_section(const Model& m) {
  Bytes d;
  for (const Entry& e : m.entries) d.insert(d.end(), e.data.begin(), e.data.end());
  return d;
}

Bytes serialize(const Model& m) {
  const std::string h = header_text(m);
  return image(h, data_section(m), h.size());
}

// ---- seeds ----

template <class T>
Bytes raw(const T* p, std::size_t n) {
  const auto* b = reinterpret_cast<const std::uint8_t*>(p);
  return Bytes(b, b + n * sizeof(T));
}

Bytes tensor_bytes(const Tensor& t) { return raw(static_cast<const std::uint8_t*>(t.data()), t.nbytes()); }

std::string dims_text(std::int64_t v) { return std::to_string(v); }

Entry entry(const std::string& name, const std::string& dtype, std::vector<std::int64_t> shape, Bytes data) {
  Entry e;
  e.name = name;
  e.dtype = dtype;
  for (std::int64_t d : shape) e.shape.push_back(dims_text(d));
  e.data = std::move(data);
  return e;
}

Bytes pattern(std::size_t n, std::uint8_t salt) {
  Bytes b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(i * 37 + salt);
  return b;
}

Model plain_file() {
  Model m;
  m.metadata = {{"format", "\"pt\""}, {"k", "\"v\""}};
  std::vector<float> f32(6);
  for (std::size_t i = 0; i < f32.size(); ++i) f32[i] = 0.25f * static_cast<float>(i) - 0.5f;
  m.entries.push_back(entry("a.f32", "F32", {2, 3}, raw(f32.data(), f32.size())));
  m.entries.push_back(entry("b.bf16", "BF16", {4}, pattern(8, 1)));
  m.entries.push_back(entry("c.u8", "U8", {5}, pattern(5, 2)));  // odd: the next tensor starts unaligned
  m.entries.push_back(entry("d.f16", "F16", {1, 2, 1, 2}, pattern(8, 3)));
  m.entries.push_back(entry("e.i64", "I64", {1}, pattern(8, 4)));  // a dtype qmm does not load
  m.entries.push_back(entry("f.empty", "F32", {0, 3}, {}));
  m.entries.push_back(entry("g.scalar", "BF16", {}, pattern(2, 5)));
  m.entries.push_back(entry("h.r5", "U8", {1, 1, 1, 1, 2}, pattern(2, 6)));  // rank 5: bytes only
  m.entries.push_back(entry("i.huge_empty", "F32", {9223372036854775807, 0}, {}));
  m.prefix = "weight";
  return m;
}

// A bitsandbytes Linear4bit state dict of a small weight quantized here, as bnb writes it.
Model bnb_layer(bool double_quant, const std::string& prefix) {
  const qmm::Context cpu = qmm::Context::cpu();
  Tensor w(DType::F32, {2, 96});  // 192 elements: 3 blocks of 64
  for (std::int64_t i = 0; i < w.numel(); ++i)
    w.data_as<float>()[i] = std::sin(0.37f * static_cast<float>(i)) * (1.0f + 0.01f * static_cast<float>(i));
  const qmm::Nf4Tensor q = qmm::nf4_quantize(cpu, w, double_quant);
  Model m;
  m.prefix = prefix;
  m.entries.push_back(entry(prefix, "U8", {q.codes.numel(), 1}, tensor_bytes(q.codes)));
  m.entries.push_back(entry(prefix + ".absmax", double_quant ? "U8" : "F32", {q.absmax.numel()},
                            tensor_bytes(q.absmax)));
  std::vector<float> map(16);
  for (int i = 0; i < 16; ++i) map[static_cast<std::size_t>(i)] = qmm::nf4_code_value(i);
  m.entries.push_back(entry(prefix + ".quant_map", "F32", {16}, raw(map.data(), map.size())));
  std::string qs = "{\"quant_type\":\"nf4\",\"blocksize\":" + std::to_string(q.block_size) +
                   ",\"dtype\":\"float32\",\"shape\":[" + std::to_string(q.rows) + "," + std::to_string(q.cols) + "]";
  if (double_quant) {
    m.entries.push_back(
        entry(prefix + ".nested_absmax", "F32", {q.absmax2.numel()}, tensor_bytes(q.absmax2)));
    m.entries.push_back(entry(prefix + ".nested_quant_map", "F32", {256}, tensor_bytes(q.code2)));
    char offset[64];
    std::snprintf(offset, sizeof offset, "%.17g", static_cast<double>(q.offset));
    qs += ",\"nested_blocksize\":256,\"nested_dtype\":\"float32\",\"nested_offset\":" + std::string(offset);
  }
  qs += "}";
  Entry state = entry(prefix + ".quant_state.bitsandbytes__nf4", "U8", {}, Bytes(qs.begin(), qs.end()));
  state.u8_auto_shape = true;
  m.entries.push_back(state);
  m.entries.push_back(entry("bias", "F32", {2}, pattern(8, 9)));
  return m;
}

std::vector<Model> seeds() {
  return {plain_file(), bnb_layer(false, "weight"), bnb_layer(true, "weight"),
          bnb_layer(true, "model.layers.0.mlp.down_proj.weight")};
}

// ---- mutations ----

// The end of the JSON value starting at `i` (a best effort on broken text: stops at the text's end).
std::size_t value_end(const std::string& s, std::size_t i) {
  if (i >= s.size()) return s.size();
  if (s[i] == '"') {
    for (++i; i < s.size(); ++i) {
      if (s[i] == '\\') ++i;
      else if (s[i] == '"') return i + 1;
    }
    return s.size();
  }
  if (s[i] == '{' || s[i] == '[') {
    int depth = 0;
    bool in_string = false;
    for (; i < s.size(); ++i) {
      const char c = s[i];
      if (in_string) {
        if (c == '\\') ++i;
        else if (c == '"') in_string = false;
      } else if (c == '"') {
        in_string = true;
      } else if (c == '{' || c == '[') {
        ++depth;
      } else if ((c == '}' || c == ']') && --depth == 0) {
        return i + 1;
      }
    }
    return s.size();
  }
  while (i < s.size() && s[i] != ',' && s[i] != '}' && s[i] != ']') ++i;
  return i;
}

// Positions of the starts of number tokens outside strings.
std::vector<std::size_t> number_starts(const std::string& s) {
  std::vector<std::size_t> out;
  bool in_string = false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if ((c == '-' || (c >= '0' && c <= '9')) && (i == 0 || std::strchr(",[:", s[i - 1]))) {
      out.push_back(i);
    }
  }
  return out;
}

// Positions just after `"key":` (the start of a value that belongs to a key).
std::vector<std::pair<std::size_t, std::size_t>> keyed_values(const std::string& s) {
  std::vector<std::pair<std::size_t, std::size_t>> out;  // (key start, value start)
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '"') continue;
    const std::size_t end = value_end(s, i);
    if (end < s.size() && s[end] == ':') out.push_back({i, end + 1});
    i = end > i ? end - 1 : i;
  }
  return out;
}

// One JSON-aware edit of a text (a header or the quant state).
void mutate_json(std::string& s, Rng& rng) {
  switch (rng.below(8)) {
    case 0:
    case 1: {  // a number replaced by an edge value
      const auto at = number_starts(s);
      if (at.empty()) break;
      const std::size_t i = rng.pick(at);
      s.replace(i, value_end(s, i) - i, rng.pick(kNumbers));
      break;
    }
    case 2: {  // a key dropped with its value
      const auto kv = keyed_values(s);
      if (kv.empty()) break;
      const auto [k, v] = rng.pick(kv);
      std::size_t end = value_end(s, v);
      std::size_t begin = k;
      if (end < s.size() && s[end] == ',') ++end;  // "k":v, -> ""
      else if (begin > 0 && s[begin - 1] == ',') --begin;
      s.erase(begin, end - begin);
      break;
    }
    case 3: {  // a value of another type
      const auto kv = keyed_values(s);
      if (kv.empty()) break;
      const std::size_t v = rng.pick(kv).second;
      s.replace(v, value_end(s, v) - v, rng.pick(kValues));
      break;
    }
    case 4: {  // a key-value pair duplicated (the later one wins in the parser)
      const auto kv = keyed_values(s);
      if (kv.empty()) break;
      const auto [k, v] = rng.pick(kv);
      const std::size_t end = value_end(s, v);
      s.insert(end, "," + s.substr(k, end - k));
      break;
    }
    case 5: {  // an array gains an element
      const std::size_t i = s.find('[', rng.below(s.size() + 1));
      if (i == std::string::npos) break;
      s.insert(i + 1, rng.pick(kNumbers) + (i + 1 < s.size() && s[i + 1] == ']' ? "" : ","));
      break;
    }
    case 6: {  // nesting deeper than any header needs
      const std::size_t depth = 1 + rng.below(80);
      const std::string deep = std::string(depth, '[') + std::string(depth, ']');
      const auto kv = keyed_values(s);
      if (kv.empty()) break;
      const std::size_t v = rng.pick(kv).second;
      s.replace(v, value_end(s, v) - v, deep);
      break;
    }
    default: {  // a structural character inserted, or the text cut
      if (rng.one_in(2) && !s.empty()) {
        s.resize(rng.below(s.size()));
      } else {
        static const char kChars[] = "{}[]\",:0-\\ ";
        s.insert(rng.below(s.size() + 1), 1, kChars[rng.below(sizeof kChars - 1)]);
      }
    }
  }
}

void mutate_model(Model& m, Rng& rng) {
  if (m.entries.empty()) return;
  Entry& e = m.entries[rng.below(m.entries.size())];
  switch (rng.below(11)) {
    case 0: {  // a shape extent
      e.u8_auto_shape = false;
      const auto at = [&](std::size_t n) { return e.shape.begin() + static_cast<std::ptrdiff_t>(rng.below(n)); };
      if (e.shape.empty() || rng.one_in(4)) e.shape.insert(at(e.shape.size() + 1), rng.pick(kNumbers));
      else if (rng.one_in(4)) e.shape.erase(at(e.shape.size()));
      else e.shape[rng.below(e.shape.size())] = rng.pick(kNumbers);
      break;
    }
    case 1: e.dtype = rng.pick(kDtypes); break;
    case 2: m.entries.erase(m.entries.begin() + static_cast<std::ptrdiff_t>(&e - m.entries.data())); break;
    case 3: {  // data resized (the shape then no longer matches unless it follows the data)
      if (rng.one_in(2) && !e.data.empty()) e.data.resize(rng.below(e.data.size()));
      else e.data.resize(e.data.size() + 1 + rng.below(8), 0x5A);
      break;
    }
    case 4: {  // data values: NaN, infinities, random bytes
      if (e.data.empty()) break;
      if (e.dtype == "F32" && e.data.size() >= 4) {
        const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 3e38f, 1e-45f};
        const float v = specials[rng.below(7)];
        std::memcpy(&e.data[rng.below(e.data.size() / 4) * 4], &v, 4);
      } else {
        e.data[rng.below(e.data.size())] = static_cast<std::uint8_t>(rng.next());
      }
      break;
    }
    case 5: {  // data_offsets written out of line
      const std::string a = rng.pick(kNumbers), b = rng.pick(kNumbers);
      switch (rng.below(4)) {
        case 0: e.offsets = "[" + a + "," + b + "]"; break;
        case 1: e.offsets = "[" + a + "]"; break;
        case 2: e.offsets = rng.pick(kValues); break;
        default: e.offsets = "[0," + std::to_string(e.data.size() + rng.below(3)) + "]";  // overlaps another
      }
      break;
    }
    case 6: {  // renamed: onto a sibling's name, the metadata key, or a look-alike
      static const std::vector<std::string> suffixes = {
          "", ".absmax", ".nested_absmax", ".nested_quant_map", ".quant_map", ".quant_state.bitsandbytes__nf4",
          ".quant_state.bitsandbytes__fp4"};
      const int kind = static_cast<int>(rng.below(4));
      if (kind == 0) e.name = m.prefix + rng.pick(suffixes);
      else if (kind == 1) e.name = "__metadata__";
      else if (kind == 2) e.name = "";
      else e.name += static_cast<char>(rng.below(2) ? '\x01' : '"');
      break;
    }
    case 7: {  // the quant state's JSON edited (its shape follows its length, so the edit reaches the loader)
      for (Entry& s : m.entries) {
        if (s.name.find(".quant_state.") == std::string::npos) continue;
        std::string text(s.data.begin(), s.data.end());
        const std::size_t edits = 1 + rng.below(2);
        for (std::size_t i = 0; i < edits; ++i) mutate_json(text, rng);
        s.data.assign(text.begin(), text.end());
        break;
      }
      break;
    }
    case 8: {  // metadata: non-string values, odd keys
      if (rng.one_in(2)) m.metadata.push_back({"n", rng.pick(kValues)});
      else m.metadata.push_back({rng.pick(kNumbers), "\"x\""});
      break;
    }
    case 9: e.extra = "," + json_string(rng.one_in(2) ? "dtype" : "extra") + ":" + rng.pick(kValues); break;
    default: {  // an entry duplicated under a new name, or an empty tensor of a huge extent added
      Entry copy = e;
      copy.name += ".copy";
      if (rng.one_in(2)) {
        copy.dtype = rng.pick(kDtypes);
        copy.shape = {rng.pick(kNumbers), rng.pick(kNumbers), "0"};
        copy.data.clear();
        copy.u8_auto_shape = false;
      }
      m.entries.push_back(copy);
    }
  }
}

void write_length(Bytes& b, std::uint64_t v) {
  if (b.size() < 8) return;
  for (int i = 0; i < 8; ++i) b[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(v >> (8 * i));
}

std::uint64_t read_length(const Bytes& b) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0 && b.size() >= 8; --i) v = (v << 8) | b[static_cast<std::size_t>(i)];
  return v;
}

void mutate_bytes(Bytes& b, Rng& rng) {
  switch (rng.below(8)) {
    case 0:
      if (!b.empty()) b[rng.below(b.size())] ^= static_cast<std::uint8_t>(1u << rng.below(8));
      break;
    case 1:
      if (!b.empty()) b[rng.below(b.size())] = static_cast<std::uint8_t>(rng.next());
      break;
    case 2: {
      const std::size_t n = 1 + rng.below(8);
      Bytes ins(n);
      for (auto& x : ins) x = static_cast<std::uint8_t>(rng.next());
      b.insert(b.begin() + static_cast<std::ptrdiff_t>(rng.below(b.size() + 1)), ins.begin(), ins.end());
      break;
    }
    case 3: {
      if (b.empty()) break;
      const std::size_t at = rng.below(b.size());
      const std::size_t n = 1 + rng.below(std::min<std::size_t>(16, b.size() - at));
      b.erase(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + n));
      break;
    }
    case 4: {  // the header length: off by a little, zero, past the file, past the limit, random
      const std::uint64_t len = read_length(b);
      const std::uint64_t choices[] = {len + 1,        len - 1,          len + 8, 0, b.size(), b.size() - 7,
                                       100'000'000,     100'000'001,      ~0ull,   1ull << 63, rng.next()};
      write_length(b, choices[rng.below(sizeof choices / sizeof choices[0])]);
      break;
    }
    case 5:  // the file cut short
      b.resize(rng.below(b.size() + 1));
      break;
    case 6: {  // a chunk copied over another place
      if (b.size() < 2) break;
      const std::size_t from = rng.below(b.size()), to = rng.below(b.size());
      const std::size_t n = std::min({1 + rng.below(32), b.size() - from, b.size() - to});
      std::memmove(&b[to], &b[from], n);
      break;
    }
    default:  // trailing bytes after the data
      b.insert(b.end(), 1 + rng.below(16), 0);
  }
}

Bytes make_input(const std::vector<Model>& seed_models, std::uint64_t seed, std::uint64_t index) {
  Rng rng{seed * 0xD1342543DE82EF95ull + index * 0x9E3779B97F4A7C15ull + 1};
  rng.next();
  Model m = rng.pick(seed_models);
  const std::size_t structural = rng.below(4);
  for (std::size_t i = 0; i < structural; ++i) mutate_model(m, rng);
  std::string header = header_text(m);
  if (rng.one_in(3)) {  // JSON text edits of the header, with the length field kept right
    const std::size_t edits = 1 + rng.below(2);
    for (std::size_t i = 0; i < edits; ++i) mutate_json(header, rng);
  }
  Bytes b = image(header, data_section(m), header.size());
  if (rng.one_in(3)) {
    const std::size_t edits = 1 + rng.below(3);
    for (std::size_t i = 0; i < edits; ++i) mutate_bytes(b, rng);
  }
  return b;
}

// ---- the target ----

struct Stats {
  std::uint64_t inputs = 0, parsed = 0, tensors = 0, loaded = 0, files = 0;
};

[[noreturn]] void fail(const std::string& what);

bool starts_with(const std::string& s, const char* p) { return s.rfind(p, 0) == 0; }

// With --histogram: how often each kind of rejection happened (messages with names and numbers blanked), to see
// which checks the mutations reach.
std::map<std::string, std::uint64_t>* g_histogram = nullptr;

void count(const std::string& msg) {
  std::string kind;
  bool in_quote = false;
  for (std::size_t i = 0; i < msg.size() && kind.size() < 90; ++i) {
    const char c = msg[i];
    if (c == '\'') {
      in_quote = !in_quote;
      kind += in_quote ? "'_" : "";
    } else if (!in_quote && !(c >= '0' && c <= '9')) {
      kind += c;
    }
  }
  ++(*g_histogram)[kind];
}

// Runs `f`; a qmm::Error is a valid outcome, and must come with a message in the library's style.
template <class F>
bool ok_or_error(const char* what, F&& f) {
  try {
    f();
    return true;
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (g_histogram) count(msg);
    // The reader's and the loader's own prefixes only: a Tensor or Shape error here would mean a size the reader
    // let through.
    if (!starts_with(msg, "safetensors: ") && !starts_with(msg, "load_bnb_nf4_weight: "))
      fail(std::string(what) + " threw qmm::Error(" + qmm::error_code_name(e.code()) + ") without naming the op: " +
           msg);
    return false;
  }
}

void check(bool cond, const std::string& what) {
  if (!cond) fail("property violated: " + what);
}

// Every accessor of an accepted file, and the loader under every prefix the file suggests.
void exercise(const SafetensorsFile& f, const std::string& seed_prefix, Stats& stats) {
  const std::vector<std::string> names = f.names();
  std::vector<std::string> prefixes = {seed_prefix, "weight"};
  for (const std::string& name : names) {
    check(f.contains(name), "contains(" + name + ")");
    const qmm::SafetensorsEntry& e = f.entry(name);
    check(e.begin <= e.end, "begin <= end for " + name);
    const Bytes b = f.bytes(name);
    check(b.size() == e.end - e.begin, "bytes(" + name + ") has the entry's size");
    Tensor t;
    if (ok_or_error("tensor", [&] { t = f.tensor(name); })) {
      ++stats.tensors;
      check(static_cast<std::size_t>(t.shape().rank) == e.shape.size(), "tensor rank");
      for (int i = 0; i < t.shape().rank; ++i) check(t.dim(i) == e.shape[static_cast<std::size_t>(i)], "tensor shape");
      check(t.nbytes() == b.size(), "tensor(" + name + ") holds the entry's bytes");
      check(b.empty() || std::memcmp(t.data(), b.data(), b.size()) == 0, "tensor(" + name + ") bytes equal");
    }
    if (&name == &names.front())  // the typed accessor once per input: its checks are the untyped one's + dtype
      ok_or_error("tensor(F32)", [&] { f.tensor(name, DType::F32); });
    for (const char* suffix : {".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4"}) {
      const std::size_t n = std::strlen(suffix);
      if (name.size() >= n && name.compare(name.size() - n, n, suffix) == 0)
        prefixes.push_back(name.substr(0, name.size() - n));
    }
  }
  check(!f.contains("no such tensor"), "contains(absent)");
  check(!ok_or_error("entry(absent)", [&] { f.entry("no such tensor"); }), "entry(absent) throws");
  for (const auto& [k, v] : f.metadata()) check(k.size() + v.size() < (1u << 30), "metadata sizes");

  std::sort(prefixes.begin(), prefixes.end());
  prefixes.erase(std::unique(prefixes.begin(), prefixes.end()), prefixes.end());
  for (const std::string& prefix : prefixes) {
    (void)qmm::has_bnb_4bit_weight(f, prefix);
    qmm::Nf4Tensor w;
    if (!ok_or_error("load_bnb_nf4_weight", [&] { w = qmm::load_bnb_nf4_weight(f, prefix); })) continue;
    ++stats.loaded;
    check(w.rows >= 1 && w.cols >= 1, "a loaded weight has rows and cols");
    check(w.codes.numel() == (w.rows * w.cols + 1) / 2, "a loaded weight has its codes");
    const std::int64_t blocks = (w.rows * w.cols + w.block_size - 1) / w.block_size;
    check(w.absmax.numel() == blocks, "a loaded weight has one scale per block");
    if (w.rows * w.cols <= (1 << 20)) {  // a loaded weight must be usable (an Error here fails the run)
      static const qmm::Context cpu = qmm::Context::cpu();
      Tensor out(DType::F32, {w.rows, w.cols});
      qmm::nf4_dequantize(cpu, w, out);
    }
  }
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return std::string(qmm::error_code_name(e.code())) + ": " + e.what();
  }
  return "";
}

// The current input, for the crash handlers.
const Bytes* g_input = nullptr;
std::string g_crash_path;
std::string g_temp_file;  // removed on a failure too

void save_input(const Bytes& b, const std::string& path) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  std::fprintf(stderr, "fuzz: the failing input (%zu bytes) is saved as %s; keep it in tests/data/fuzz-regressions/\n",
               b.size(), path.c_str());
}

void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz: FAILED: %s\n", what.c_str());
  if (g_input) save_input(*g_input, g_crash_path);
  if (!g_temp_file.empty()) std::remove(g_temp_file.c_str());
  std::exit(1);
}

// Async-signal-safe: raw writes of the input prepared before it ran.
void write_input_raw() {
  if (!g_input || g_crash_path.empty()) return;
  const int fd = ::open(g_crash_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return;
  std::size_t done = 0;
  while (done < g_input->size()) {
    const ssize_t n = ::write(fd, g_input->data() + done, g_input->size() - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  static const char msg[] = "fuzz: crashed; the input is saved (fuzz-crash-*.bin): keep it in "
                            "tests/data/fuzz-regressions/\n";
  (void)!::write(2, msg, sizeof msg - 1);
}

#ifndef QMM_FUZZ_SANITIZED
void on_signal(int sig) {
  write_input_raw();
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}
#endif

void install_crash_handlers() {
#ifdef QMM_FUZZ_SANITIZED
  __sanitizer_set_death_callback(write_input_raw);  // ASan and UBSan reports end here
#else
  // On a stack of its own: a stack overflow is one of the crashes to catch.
  static std::vector<char> alt(1 << 16);
  stack_t ss{};
  ss.ss_sp = alt.data();
  ss.ss_size = alt.size();
  ::sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_ONSTACK;
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) ::sigaction(sig, &sa, nullptr);
#endif
}

// One input: parse, then (for some inputs) the same bytes through open(), which must agree.
void run_one(const Bytes& input, const std::vector<std::string>& prefixes, bool via_file,
             const std::string& temp_file, Stats& stats) {
  g_input = &input;
  ++stats.inputs;
  const std::string source = via_file ? temp_file : std::string("fuzz");
  SafetensorsFile f;
  const bool parsed = ok_or_error("parse", [&] { f = SafetensorsFile::parse(input, source); });
  if (parsed) {
    ++stats.parsed;
    for (const std::string& p : prefixes) exercise(f, p, stats);
  }
  if (via_file) {
    ++stats.files;
    {
      std::ofstream out(temp_file, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(input.data()), static_cast<std::streamsize>(input.size()));
    }
    SafetensorsFile g;
    const std::string parse_error = error_of([&] { (void)SafetensorsFile::parse(input, source); });
    const std::string open_error = error_of([&] { g = SafetensorsFile::open(temp_file); });
    check(parse_error == open_error, "open() and parse() disagree:\n  parse: " + parse_error +
                                         "\n  open:  " + open_error);
    if (open_error.empty()) {
      check(g.names() == f.names() && g.metadata() == f.metadata(), "open() and parse() list the same tensors");
      for (const std::string& name : g.names())
        check(g.bytes(name) == f.bytes(name), "open() and parse() give the same bytes of " + name);
      for (const std::string& p : prefixes) exercise(g, p, stats);
    }
  }
  g_input = nullptr;
}

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

int usage() {
  std::fprintf(stderr,
               "usage: qmm_fuzz_safetensors [--iterations N] [--seed S] [--first I] [--replay DIR|FILE]... "
               "[--crash-dir DIR] [--histogram 1]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::uint64_t iterations = 100'000, seed = 1, first = 0;
  std::vector<std::string> replay;
  std::string crash_dir = ".";
  bool histogram = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage();
    const char* v = argv[++i];
    const bool number = v[0] >= '0' && v[0] <= '9';  // strtoull would take "-1" as 2^64-1
    if ((a == "--iterations" || a == "--seed" || a == "--first") && !number) return usage();
    char* end = nullptr;
    if (a == "--iterations") iterations = std::strtoull(v, &end, 10);
    else if (a == "--seed") seed = std::strtoull(v, &end, 10);
    else if (a == "--first") first = std::strtoull(v, &end, 10);
    else if (a == "--replay") replay.push_back(v);
    else if (a == "--crash-dir") crash_dir = v;
    else if (a == "--histogram") histogram = std::strcmp(v, "1") == 0;
    else return usage();
    if (end && *end) return usage();
  }
  install_crash_handlers();
  std::map<std::string, std::uint64_t> kinds;
  if (histogram) g_histogram = &kinds;
  omp_set_num_threads(1);  // every input is tiny: worker threads would only add their wake-ups
  const std::string temp_file =
      (std::filesystem::temp_directory_path() / ("qmm_fuzz_" + std::to_string(::getpid()) + ".safetensors")).string();
  g_temp_file = temp_file;

  try {
    Stats stats;
    const auto start = std::chrono::steady_clock::now();
    const std::vector<Model> models = seeds();
    // Every seed must load: otherwise the mutations start from files the loader rejects anyway.
    for (const Model& m : models) {
      g_crash_path = crash_dir + "/fuzz-crash-seed.bin";
      const Bytes b = serialize(m);
      g_input = &b;
      const SafetensorsFile f = SafetensorsFile::parse(b, "seed");
      if (m.prefix != "weight" || f.contains("weight")) (void)qmm::load_bnb_nf4_weight(f, m.prefix);
      g_input = nullptr;
    }

    // The kept regression inputs, each as parse() and as a file.
    std::size_t replayed = 0;
    for (const std::string& r : replay) {
      std::vector<std::string> files;
      if (std::filesystem::is_directory(r)) {
        for (const auto& de : std::filesystem::directory_iterator(r))
          if (de.is_regular_file() && de.path().extension() == ".bin") files.push_back(de.path().string());
      } else {
        files.push_back(r);
      }
      std::sort(files.begin(), files.end());
      for (const std::string& path : files) {
        const Bytes b = read_bytes(path);
        g_crash_path = crash_dir + "/fuzz-crash-replay.bin";
        run_one(b, {"weight", "model.layers.0.mlp.down_proj.weight"}, true, temp_file, stats);
        ++replayed;
      }
    }

    for (std::uint64_t i = first; i < first + iterations; ++i) {
      const Bytes b = make_input(models, seed, i);
      g_crash_path = crash_dir + "/fuzz-crash-" + std::to_string(seed) + "-" + std::to_string(i) + ".bin";
      run_one(b, {"model.layers.0.mlp.down_proj.weight"}, i % 64 == 0, temp_file, stats);
    }
    std::filesystem::remove(temp_file);

    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("fuzz: %zu regression inputs and %" PRIu64 " random inputs (seed %" PRIu64 ") in %.1f s (%.0f/s): "
                "%" PRIu64 " parsed, %" PRIu64 " tensors read, %" PRIu64 " weights loaded, %" PRIu64
                " through files\n",
                replayed, iterations, seed, seconds, static_cast<double>(stats.inputs) / seconds, stats.parsed,
                stats.tensors, stats.loaded, stats.files);
    for (const auto& [kind, n] : kinds) std::printf("%10" PRIu64 "  %s\n", n, kind.c_str());
    // The mutations must keep reaching the deep checks, or this run proved little.
    if (iterations >= 10'000 && (stats.parsed * 10 < iterations || stats.loaded * 50 < iterations)) {
      std::fprintf(stderr, "fuzz: FAILED: too few inputs parse (%" PRIu64 ") or load a weight (%" PRIu64
                           "): the mutations no longer reach the loader\n", stats.parsed, stats.loaded);
      return 1;
    }
  } catch (const std::exception& e) {
    fail(std::string("an exception other than qmm::Error: ") + typeid(e).name() + ": " + e.what());
  } catch (...) {
    fail("an exception that is not a std::exception");
  }
  return 0;
}
