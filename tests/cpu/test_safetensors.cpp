// safetensors reader and writer: round trips of every qmm dtype, the golden files, and one malformed image per
// check of the reader, each of which must throw Error(Io) naming the file and the fault.
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "common/test_util.h"

namespace qmm {
namespace {

std::string temp_path(const std::string& name) { return ::testing::TempDir() + "qmm_st_" + name; }

std::string golden_path(const std::string& name) { return test::data_dir() + "/nf4-bnb/" + name; }

std::vector<std::uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A file image from a header text and a data section, with the length field written as given.
std::vector<std::uint8_t> image(const std::string& header, std::size_t data_bytes, std::uint64_t length_field) {
  std::vector<std::uint8_t> out(8 + header.size() + data_bytes);
  for (std::size_t i = 0; i < 8; ++i) out[i] = static_cast<std::uint8_t>(length_field >> (8 * i));
  for (std::size_t i = 0; i < header.size(); ++i) out[8 + i] = static_cast<std::uint8_t>(header[i]);
  for (std::size_t i = 0; i < data_bytes; ++i) out[8 + header.size() + i] = static_cast<std::uint8_t>(i * 7 + 1);
  return out;
}
std::vector<std::uint8_t> image(const std::string& header, std::size_t data_bytes) {
  return image(header, data_bytes, header.size());
}

// Parses `bytes` under the name "bad.safetensors" and expects Io with the name and every fault word.
::testing::AssertionResult rejects(const std::vector<std::uint8_t>& bytes, std::initializer_list<std::string> fault) {
  std::vector<std::string> needles{"safetensors", "bad.safetensors"};
  needles.insert(needles.end(), fault.begin(), fault.end());
  try {
    SafetensorsFile::parse(bytes, "bad.safetensors");
  } catch (const Error& e) {
    if (e.code() != ErrorCode::Io)
      return ::testing::AssertionFailure() << "code " << error_code_name(e.code()) << ": " << e.what();
    for (const auto& n : needles)
      if (std::string(e.what()).find(n) == std::string::npos)
        return ::testing::AssertionFailure() << "message \"" << e.what() << "\" lacks \"" << n << "\"";
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

TEST(Safetensors, RoundTripsEveryDtypeAndRank) {
  Tensor f32 = test::random_tensor(DType::F32, {3, 5}, 1);
  Tensor bf16 = test::random_tensor(DType::BF16, {7}, 2);
  Tensor f16 = test::random_tensor(DType::F16, {2, 3, 4}, 3);
  Tensor u8 = test::random_int_tensor(DType::U8, {1001}, 4, 100);  // odd size: the next tensor starts unaligned
  Tensor r4 = test::random_tensor(DType::F32, {2, 1, 3, 2}, 5);
  Tensor scalar = test::random_tensor(DType::BF16, Shape{}, 6);
  Tensor empty(DType::F32, {0, 3});
  const std::vector<std::pair<std::string, TensorView>> tensors{
      {"w.f32", f32}, {"b.bf16", bf16}, {"h.f16", f16}, {"a.u8", u8}, {"z.rank4", r4}, {"s", scalar}, {"e", empty}};
  const std::map<std::string, std::string> meta{{"format", "pt"}, {"note", "round trip"}};
  const std::string path = temp_path("roundtrip.safetensors");
  save_safetensors(path, tensors, meta);

  const std::vector<std::uint8_t> raw = read_file(path);
  ASSERT_GE(raw.size(), 8u);
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | raw[static_cast<std::size_t>(i)];
  EXPECT_EQ(header_len % 8, 0u) << "header padded to a multiple of 8";
  EXPECT_EQ(raw[8], '{');

  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a.u8", "b.bf16", "e", "h.f16", "s", "w.f32", "z.rank4"}));
  EXPECT_EQ(f.metadata(), meta);
  for (const auto& [name, view] : tensors) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(f.contains(name));
    const Tensor back = f.tensor(name);
    EXPECT_EQ(back.dtype(), view.dtype());
    EXPECT_EQ(back.shape(), view.shape());
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(back.data()) % 64, 0u) << "host copy is aligned";
    if (view.numel() > 0) EXPECT_TRUE(test::bytes_equal(back, view));
    const Tensor typed = f.tensor(name, view.dtype());
    EXPECT_EQ(typed.shape(), view.shape());
  }
  EXPECT_EQ(f.entry("w.f32").dtype, "F32");
  EXPECT_EQ(f.entry("b.bf16").dtype, "BF16");
  EXPECT_EQ(f.entry("h.f16").dtype, "F16");
  EXPECT_EQ(f.entry("a.u8").dtype, "U8");
  EXPECT_EQ(f.entry("z.rank4").shape, (std::vector<std::int64_t>{2, 1, 3, 2}));
  EXPECT_TRUE(f.entry("s").shape.empty());
  // Data in name order, back to back.
  EXPECT_EQ(f.entry("a.u8").begin, 0u);
  EXPECT_EQ(f.entry("b.bf16").begin, 1001u);
  EXPECT_EQ(f.bytes("a.u8").size(), 1001u);
  EXPECT_EQ(std::memcmp(f.bytes("a.u8").data(), u8.data(), 1001), 0);

  // The in-memory parser sees the same file.
  const SafetensorsFile g = SafetensorsFile::parse(raw, "mem");
  EXPECT_EQ(g.names(), f.names());
  EXPECT_TRUE(test::bytes_equal(g.tensor("h.f16"), f16));
}

TEST(Safetensors, AccessorsRejectMissingNamesAndWrongDtypes) {
  Tensor t = test::random_tensor(DType::F32, {4}, 7);
  const std::string path = temp_path("access.safetensors");
  save_safetensors(path, {{"t", t}});
  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_TRUE(test::throws_error([&] { f.entry("nope"); }, ErrorCode::Io, {"safetensors", path, "nope"}));
  EXPECT_TRUE(test::throws_error([&] { f.tensor("nope"); }, ErrorCode::Io, {path, "nope"}));
  EXPECT_TRUE(test::throws_error([&] { f.bytes("nope"); }, ErrorCode::Io, {path, "nope"}));
  EXPECT_TRUE(test::throws_error([&] { f.tensor("t", DType::BF16); }, ErrorCode::Io, {path, "'t'", "F32", "BF16"}));
}

TEST(Safetensors, DtypesOutsideQmmAreReadableAsBytesButNotAsTensors) {
  const std::string h = R"({"i":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},)"
                        R"("r5":{"dtype":"U8","shape":[1,1,1,1,2],"data_offsets":[16,18]}})";
  const SafetensorsFile f = SafetensorsFile::parse(image(h, 18), "other.safetensors");
  EXPECT_EQ(f.bytes("i").size(), 16u);
  EXPECT_TRUE(test::throws_error([&] { f.tensor("i"); }, ErrorCode::Unsupported, {"other.safetensors", "I64"}));
  EXPECT_TRUE(test::throws_error([&] { f.tensor("r5"); }, ErrorCode::Unsupported, {"other.safetensors", "rank 5"}));
}

TEST(Safetensors, WriterRejectsBadInputs) {
  Tensor t = test::random_tensor(DType::F32, {4}, 8);
  const std::string path = temp_path("bad_write.safetensors");
  EXPECT_TRUE(test::throws_error(
      [&] {
        save_safetensors(path, {{"t", t}, {"t", t}});
      },
      ErrorCode::Io, {"safetensors", path, "twice"}));
  EXPECT_TRUE(test::throws_error(
      [&] {
        save_safetensors(path, {{"__metadata__", t}});
      },
      ErrorCode::Io, {path, "reserved"}));
  EXPECT_TRUE(test::throws_error(
      [&] {
        save_safetensors(path, {{"n", TensorView(nullptr, DType::F32, {3})}});
      },
      ErrorCode::Io, {path, "null"}));
  const std::string dir_path = ::testing::TempDir() + "qmm_no_such_dir/x.safetensors";
  EXPECT_TRUE(test::throws_error(
      [&] {
        save_safetensors(dir_path, {{"t", t}});
      },
      ErrorCode::Io, {dir_path, "cannot open"}));
}

TEST(Safetensors, ReadsEveryGoldenFile) {
  const std::vector<std::uint8_t> manifest = read_file(golden_path("manifest.json"));
  const std::string text(manifest.begin(), manifest.end());
  int files = 0;
  for (std::size_t at = text.find(".safetensors"); at != std::string::npos; at = text.find(".safetensors", at + 1)) {
    const std::size_t q = text.rfind('"', at);
    const std::string name = text.substr(q + 1, at + 12 - q - 1);
    SCOPED_TRACE(name);
    const SafetensorsFile f = SafetensorsFile::open(golden_path(name));
    const std::int64_t n = std::stoll(f.metadata().at("N")), k = std::stoll(f.metadata().at("K"));
    const Tensor input = f.tensor("input");
    EXPECT_EQ(input.shape(), (Shape{n, k}));
    const Tensor codes = f.tensor("codes", DType::U8);
    EXPECT_EQ(codes.numel(), (n * k + 1) / 2);
    const Tensor cb = f.tensor("codebook", DType::F32);
    ASSERT_EQ(cb.numel(), 16);
    for (int i = 0; i < 16; ++i) EXPECT_EQ(cb.data_as<float>()[i], nf4_code_value(i)) << i;
    ++files;
  }
  EXPECT_EQ(files, 10);

  const SafetensorsFile lin = SafetensorsFile::open(golden_path("linear4bit_state_dict.safetensors"));
  EXPECT_EQ(lin.entry("weight").shape, (std::vector<std::int64_t>{65536, 1}));
  EXPECT_EQ(lin.tensor("_ref.x").dtype(), DType::BF16);
  EXPECT_EQ(lin.tensor("weight.absmax").dtype(), DType::U8);
  EXPECT_TRUE(lin.metadata().count("producer"));
}

// One malformed image per check, all derived from this valid one.
const std::string kGood = R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
                          R"("b":{"dtype":"U8","shape":[3],"data_offsets":[16,19]}})";

TEST(Safetensors, MalformedImagesThrowIoNamingTheFault) {
  ASSERT_NO_THROW(SafetensorsFile::parse(image(kGood, 19), "good"));

  EXPECT_TRUE(rejects({1, 2, 3, 4, 5}, {"5 bytes", "too short"}));
  EXPECT_TRUE(rejects(image(kGood, 19, kGood.size() + 100), {"header length", "exceeds"}));
  EXPECT_TRUE(rejects(image(kGood, 19, 200'000'000), {"header length", "limit"}));
  EXPECT_TRUE(rejects(image("{\"a\": [1, 2", 0), {"not valid JSON"}));
  EXPECT_TRUE(rejects(image("[1, 2, 3]", 0), {"not an object"}));
  EXPECT_TRUE(rejects(image(R"({"a": 5})", 0), {"'a'", "not a JSON object"}));
  EXPECT_TRUE(rejects(image(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4), {"'a'", "dtype"}));
  EXPECT_TRUE(rejects(image(R"({"a":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", 4), {"'a'", "dtype"}));
  EXPECT_TRUE(rejects(image(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4), {"'a'", "shape"}));
  EXPECT_TRUE(rejects(image(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4), {"'a'", "shape"}));
  EXPECT_TRUE(rejects(image(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4), {"'a'", "shape"}));
  EXPECT_TRUE(rejects(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4), {"'a'", "data_offsets"}));
  EXPECT_TRUE(
      rejects(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8), {"'a'", "begin is past end"}));
  // Offsets past the data: a file cut short.
  EXPECT_TRUE(rejects(image(kGood, 17), {"'b'", "out of range", "17 bytes"}));
  EXPECT_TRUE(rejects(image(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", 12),
                      {"'a'", "F32", "16 bytes", "12 bytes"}));
  EXPECT_TRUE(rejects(image(R"({"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})", 4), {"'a'", "BF16"}));
  EXPECT_TRUE(rejects(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                            12),
                      {"'a'", "'b'", "overlap"}));
  EXPECT_TRUE(rejects(image(R"({"__metadata__":{"n":5}})", 0), {"__metadata__", "'n'", "strings"}));
  EXPECT_TRUE(rejects(image(R"({"__metadata__":[1]})", 0), {"__metadata__", "not an object"}));
  // Shape extents whose product overflows 64 bits.
  EXPECT_TRUE(rejects(image(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4),
                      {"'a'", "overflow"}));
}

TEST(Safetensors, FilesOnDiskNameThePath) {
  const std::string missing = temp_path("does_not_exist.safetensors");
  EXPECT_TRUE(test::throws_error([&] { SafetensorsFile::open(missing); }, ErrorCode::Io,
                                 {"safetensors", missing, "no such file"}));
  EXPECT_TRUE(test::throws_error([&] { SafetensorsFile::open(::testing::TempDir()); }, ErrorCode::Io, {"directory"}));

  // A golden file cut in the middle of its data section.
  std::vector<std::uint8_t> bytes = read_file(golden_path("case2_7x100_f32.safetensors"));
  bytes.resize(bytes.size() - 100);
  const std::string cut = temp_path("truncated.safetensors");
  write_file(cut, bytes);
  EXPECT_TRUE(test::throws_error([&] { SafetensorsFile::open(cut); }, ErrorCode::Io, {cut, "out of range"}));
  // Cut inside the header.
  bytes.resize(200);
  write_file(cut, bytes);
  EXPECT_TRUE(test::throws_error([&] { SafetensorsFile::open(cut); }, ErrorCode::Io, {cut, "header length"}));
  bytes.resize(3);
  write_file(cut, bytes);
  EXPECT_TRUE(test::throws_error([&] { SafetensorsFile::open(cut); }, ErrorCode::Io, {cut, "too short"}));
}

}  // namespace
}  // namespace qmm
