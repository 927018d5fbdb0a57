// The bitsandbytes 4-bit checkpoint loader (against the golden Linear4bit file, qmm-written files and every
// malformed field) and the `qmm finetune` job run in-process on the CPU at tiny sizes.
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/test_util.h"
#include "qmm/checkpoint.h"

// The job lives in the tool (tools/qmm/finetune.cpp, built into the qmm binary and, by tests/CMakeLists.txt, into
// this test binary too), so the test calls it directly, with no subprocess.
#include "commands.h"

namespace qmm {
namespace {

const Context& cpu_ctx() {
  static const Context ctx = Context::cpu();
  return ctx;
}

std::string golden_linear4bit() { return test::data_dir() + "/nf4-bnb/linear4bit_state_dict.safetensors"; }

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "qmm_ft_" + std::to_string(getpid()) + "_" + name + ".safetensors";
}

// A state dict in memory: edit it, write it, load it.
using StateDict = std::map<std::string, Tensor>;

StateDict read_all(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  StateDict d;
  for (const std::string& n : f.names()) d[n] = f.tensor(n);
  return d;
}

// Tensors share their storage when copied: corruptions edit a deep copy.
StateDict clone(const StateDict& d) {
  StateDict out;
  for (const auto& [n, t] : d) out[n] = test::host_copy(t);
  return out;
}

// A file written for one test, removed when the test is done with it.
struct TempFile {
  std::string path;
  explicit TempFile(std::string p) : path(std::move(p)) {}
  TempFile(const TempFile&) = delete;
  ~TempFile() { std::remove(path.c_str()); }
};

TempFile write(const StateDict& d, const std::string& name) {
  std::vector<std::pair<std::string, TensorView>> list;
  for (const auto& [n, t] : d) list.emplace_back(n, t.view());
  const std::string path = temp_path(name);
  save_safetensors(path, list);
  return TempFile(path);
}

Tensor json_bytes(const std::string& text) {
  Tensor t(DType::U8, {static_cast<std::int64_t>(text.size())});
  std::memcpy(t.data(), text.data(), text.size());
  return t;
}

nlohmann::json quant_state(const StateDict& d, const std::string& prefix = "weight") {
  const Tensor& t = d.at(prefix + ".quant_state.bitsandbytes__nf4");
  const auto* p = t.data_as<const char>();
  return nlohmann::json::parse(p, p + t.numel());
}

void set_quant_state(StateDict& d, const nlohmann::json& qs, const std::string& prefix = "weight") {
  d[prefix + ".quant_state.bitsandbytes__nf4"] = json_bytes(qs.dump());
}

// A bnb-style state dict of a weight quantized here (plain or double-quantized scales).
StateDict bnb_dict(const Tensor& w, bool double_quant, const std::string& prefix) {
  const Nf4Tensor q = nf4_quantize(cpu_ctx(), w, double_quant);
  StateDict d;
  Tensor codes(DType::U8, {q.codes.numel(), 1});  // bnb's [N·K/2, 1] layout
  copy(codes, q.codes);
  d[prefix] = codes;
  d[prefix + ".absmax"] = q.absmax;
  nlohmann::json qs = {{"quant_type", "nf4"}, {"blocksize", q.block_size}, {"dtype", "float32"},
                       {"shape", {q.rows, q.cols}}};
  if (double_quant) {
    d[prefix + ".nested_absmax"] = q.absmax2;
    d[prefix + ".nested_quant_map"] = q.code2;
    qs["nested_blocksize"] = 256;
    qs["nested_dtype"] = "float32";
    qs["nested_offset"] = static_cast<double>(q.offset);
  }
  set_quant_state(d, qs, prefix);
  return d;
}

Tensor dequantized(const Nf4Weight& w) {
  Tensor out(DType::F32, {w.rows, w.cols});
  test::poison(out);
  nf4_dequantize(cpu_ctx(), w, out);
  return out;
}

// ---- the loader -------------------------------------------------------------------------------------------------

TEST(BnbCheckpoint, GoldenLinear4bitDequantizesBitForBit) {
  const Nf4Tensor w = load_bnb_nf4_weight(golden_linear4bit());
  EXPECT_EQ(w.rows, 256);
  EXPECT_EQ(w.cols, 512);
  EXPECT_EQ(w.block_size, 64);
  EXPECT_TRUE(w.view().double_quant());
  EXPECT_EQ(w.offset, 0.05196034163236618f);
  const SafetensorsFile f = SafetensorsFile::open(golden_linear4bit());
  EXPECT_TRUE(test::bytes_equal(dequantized(w), f.tensor("_ref.weight_dequant", DType::F32)));
  // The SafetensorsFile overload reads the same.
  EXPECT_TRUE(has_bnb_4bit_weight(f));
  EXPECT_FALSE(has_bnb_4bit_weight(f, "bias"));
  EXPECT_TRUE(test::bytes_equal(dequantized(load_bnb_nf4_weight(f, "weight")), f.tensor("_ref.weight_dequant")));
}

TEST(BnbCheckpoint, QmmWrittenPlainAndNestedRoundTrip) {
  const Tensor w = test::random_tensor(DType::F32, {40, 200}, 7);  // 8000 elements: 125 blocks, a partial group
  for (bool dq : {false, true}) {
    SCOPED_TRACE(dq ? "double-quantized" : "plain");
    const TempFile file = write(bnb_dict(w, dq, "layer.weight"), dq ? "rt_dq" : "rt_plain");
    const Nf4Tensor got = load_bnb_nf4_weight(file.path, "layer.weight");
    EXPECT_EQ(got.view().double_quant(), dq);
    EXPECT_TRUE(test::bytes_equal(dequantized(got), dequantized(nf4_quantize(cpu_ctx(), w, dq))));
  }
}

struct Corruption {
  const char* what;
  std::function<void(StateDict&, nlohmann::json&)> edit;  // edits the dict and the quant state
  ErrorCode code;
  std::vector<std::string> needles;
};

TEST(BnbCheckpoint, EveryMalformedFieldIsNamed) {
  const StateDict golden = read_all(golden_linear4bit());
  using J = nlohmann::json;
  const std::vector<Corruption> cases = {
      {"no quant state", [](StateDict& d, J&) { d.erase("weight.quant_state.bitsandbytes__nf4"); }, ErrorCode::Io,
       {"weight.quant_state.bitsandbytes__nf4", "not a bitsandbytes 4-bit weight"}},
      {"fp4", [](StateDict& d, J&) {
         d["weight.quant_state.bitsandbytes__fp4"] = d["weight.quant_state.bitsandbytes__nf4"];
         d.erase("weight.quant_state.bitsandbytes__nf4");
       }, ErrorCode::Unsupported, {"FP4"}},
      {"quant type", [](StateDict&, J& qs) { qs["quant_type"] = "fp4"; }, ErrorCode::Unsupported, {"quant_type"}},
      {"no quant type", [](StateDict&, J& qs) { qs.erase("quant_type"); }, ErrorCode::Io, {"quant_type"}},
      {"no blocksize", [](StateDict&, J& qs) { qs.erase("blocksize"); }, ErrorCode::Io, {"blocksize"}},
      {"blocksize string", [](StateDict&, J& qs) { qs["blocksize"] = "64"; }, ErrorCode::Io, {"blocksize"}},
      {"blocksize 48", [](StateDict&, J& qs) { qs["blocksize"] = 48; }, ErrorCode::Io,
       {"blocksize 48", "power of two"}},
      {"blocksize 32", [](StateDict&, J& qs) { qs["blocksize"] = 32; }, ErrorCode::Unsupported, {"blocksize 32"}},
      {"1-D shape", [](StateDict&, J& qs) { qs["shape"] = {131072}; }, ErrorCode::Io, {"shape [131072]"}},
      {"zero shape", [](StateDict&, J& qs) { qs["shape"] = {256, 0}; }, ErrorCode::Io, {"shape"}},
      {"no shape", [](StateDict&, J& qs) { qs.erase("shape"); }, ErrorCode::Io, {"shape (none)"}},
      {"shape vs codes", [](StateDict&, J& qs) { qs["shape"] = {128, 512}; }, ErrorCode::Io,
       {"'weight' has 65536 elements", "32768"}},
      {"no codes", [](StateDict& d, J&) { d.erase("weight"); }, ErrorCode::Io, {"no tensor 'weight'"}},
      {"codes f32", [](StateDict& d, J&) { d["weight"] = Tensor(DType::F32, {16384}); }, ErrorCode::Io,
       {"'weight' is F32", "U8"}},
      {"no absmax", [](StateDict& d, J&) { d.erase("weight.absmax"); }, ErrorCode::Io, {"'weight.absmax'"}},
      {"absmax bf16", [](StateDict& d, J&) { d["weight.absmax"] = Tensor(DType::BF16, {2048}); }, ErrorCode::Io,
       {"'weight.absmax' is BF16"}},
      {"absmax count", [](StateDict& d, J&) { d["weight.absmax"] = Tensor(DType::U8, {2047}); }, ErrorCode::Io,
       {"'weight.absmax' has 2047 elements", "2048"}},
      {"no nested absmax", [](StateDict& d, J&) { d.erase("weight.nested_absmax"); }, ErrorCode::Io,
       {"'weight.nested_absmax'"}},
      {"nested absmax count", [](StateDict& d, J&) { d["weight.nested_absmax"] = test::filled(DType::F32, {9}, 1); },
       ErrorCode::Io, {"'weight.nested_absmax' has 9 elements", "8"}},
      {"nested absmax nan", [](StateDict& d, J&) {
         d["weight.nested_absmax"].data_as<float>()[3] = std::nanf("");
       }, ErrorCode::Io, {"'weight.nested_absmax'", "non-finite", "index 3"}},
      {"no nested map", [](StateDict& d, J&) { d.erase("weight.nested_quant_map"); }, ErrorCode::Io,
       {"'weight.nested_quant_map'"}},
      {"nested map values", [](StateDict& d, J&) { d["weight.nested_quant_map"].data_as<float>()[10] += 1e-3f; },
       ErrorCode::Unsupported, {"'weight.nested_quant_map'", "index 10"}},
      {"quant map values", [](StateDict& d, J&) { d["weight.quant_map"].data_as<float>()[15] = 0.9f; },
       ErrorCode::Unsupported, {"'weight.quant_map'", "index 15"}},
      {"quant map count", [](StateDict& d, J&) { d["weight.quant_map"] = test::filled(DType::F32, {15}, 0); },
       ErrorCode::Io, {"'weight.quant_map' has 15 elements"}},
      {"no offset", [](StateDict&, J& qs) { qs.erase("nested_offset"); }, ErrorCode::Io, {"nested_offset"}},
      {"offset string", [](StateDict&, J& qs) { qs["nested_offset"] = "0.05"; }, ErrorCode::Io, {"nested_offset"}},
      {"nested blocksize", [](StateDict&, J& qs) { qs["nested_blocksize"] = 128; }, ErrorCode::Unsupported,
       {"nested_blocksize 128"}},
      {"nested dtype", [](StateDict&, J& qs) { qs["nested_dtype"] = "float16"; }, ErrorCode::Unsupported,
       {"nested_dtype"}},
      {"plain absmax with offset", [](StateDict& d, J&) { d["weight.absmax"] = test::filled(DType::F32, {2048}, 1); },
       ErrorCode::Io, {"nested_offset", "'weight.absmax' is F32"}},
      {"plain absmax inf", [](StateDict& d, J& qs) {
         d["weight.absmax"] = test::filled(DType::F32, {2048}, 1);
         d["weight.absmax"].data_as<float>()[2047] = INFINITY;
         qs.erase("nested_offset");
       }, ErrorCode::Io, {"'weight.absmax'", "non-finite", "index 2047"}},
      {"quant state f32", [](StateDict& d, J&) {
         d["weight.quant_state.bitsandbytes__nf4"] = test::filled(DType::F32, {4}, 0);
       }, ErrorCode::Io, {"'weight.quant_state.bitsandbytes__nf4' is F32"}},
  };
  for (const Corruption& c : cases) {
    SCOPED_TRACE(c.what);
    StateDict d = clone(golden);
    nlohmann::json qs = quant_state(d);
    c.edit(d, qs);
    const auto qs_entry = d.find("weight.quant_state.bitsandbytes__nf4");
    if (qs_entry != d.end() && qs_entry->second.dtype() == DType::U8) set_quant_state(d, qs);
    const TempFile file = write(d, "bad");
    const std::string& path = file.path;
    std::vector<std::string> needles = c.needles;
    needles.insert(needles.begin(), {"load_bnb_nf4_weight", path});
    for (const std::string& needle : needles)
      EXPECT_TRUE(test::throws_error([&] { load_bnb_nf4_weight(path); }, c.code, {needle}));
  }
  // The quant state must be a JSON object.
  for (const std::string& text : {std::string("{not json"), std::string("[1, 2]")}) {
    StateDict d = clone(golden);
    d["weight.quant_state.bitsandbytes__nf4"] = json_bytes(text);
    const TempFile file = write(d, "bad_json");
    const std::string& path = file.path;
    EXPECT_TRUE(test::throws_error([&] { load_bnb_nf4_weight(path); }, ErrorCode::Io,
                                   {"'weight.quant_state.bitsandbytes__nf4'", "JSON"}));
  }
  EXPECT_TRUE(test::throws_error([] { load_bnb_nf4_weight(temp_path("missing_file")); }, ErrorCode::Io,
                                 {"no such file"}));
}

// ---- the finetune job -------------------------------------------------------------------------------------------

tool::FinetuneResult run(tool::FinetuneOptions o, std::string* log = nullptr) {
  o.cpu = true;
  std::ostringstream out;
  const tool::FinetuneResult r = tool::finetune(o, out);
  if (log) *log = out.str();
  return r;
}

TEST(Finetune, EmbeddedMlpLossFallsTowardTheFloor) {
  tool::FinetuneOptions o;
  o.hidden = 64;
  o.intermediate = 176;
  o.tokens = 64;
  o.steps = 60;
  o.rank = 8;
  o.lr = 1e-2f;  // a short run: a high peak (observed: 7.8% of the start)
  std::string log;
  const tool::FinetuneResult r = run(o, &log);
  SCOPED_TRACE(log);
  // The hidden change makes the untrained loss many times NF4's floor; 60 steps remove most of the gap.
  EXPECT_GT(r.start_loss, 10 * r.floor_loss);
  EXPECT_GT(r.floor_loss, 0.0);
  EXPECT_LT(r.final_loss, 0.25 * r.start_loss);
  EXPECT_NE(log.find("floor"), std::string::npos);
  EXPECT_NE(log.find("step    60/60"), std::string::npos);
  EXPECT_NE(log.find("tokens/s"), std::string::npos);
}

TEST(Finetune, GoldenLinear4bitCheckpoint) {
  tool::FinetuneOptions o;
  o.path = golden_linear4bit();
  o.tokens = 64;
  o.steps = 60;
  o.rank = 4;
  o.lr = 1e-2f;
  std::string log;
  const tool::FinetuneResult r = run(o, &log);
  SCOPED_TRACE(log);
  EXPECT_NE(log.find("linear 512 -> 256 + bias"), std::string::npos);
  EXPECT_LT(r.final_loss, 0.25 * r.start_loss);  // observed: 3.9%
  // The base is the checkpoint's NF4 weight unchanged, so the floor is only the GEMMs' bf16 rounding.
  EXPECT_LT(r.floor_loss, 1e-4 * r.start_loss);
}

TEST(Finetune, DenseMlpAndLinearFiles) {
  StateDict mlp;  // an MLP among other tensors, bf16 like a real checkpoint
  auto bf16 = [](Shape s, std::uint64_t seed) { return test::random_tensor(DType::BF16, s, seed, -0.1f, 0.1f); };
  mlp["model.embed_tokens.weight"] = bf16({10, 48}, 1);
  mlp["model.layers.0.mlp.gate_proj.weight"] = bf16({96, 48}, 2);
  mlp["model.layers.0.mlp.up_proj.weight"] = bf16({96, 48}, 3);
  mlp["model.layers.0.mlp.down_proj.weight"] = bf16({48, 96}, 4);
  std::string log;
  tool::FinetuneOptions o;
  o.tokens = 64;
  o.steps = 60;
  o.rank = 4;
  o.lr = 1e-2f;
  const TempFile mlp_file = write(mlp, "mlp");
  o.path = mlp_file.path;
  tool::FinetuneResult r = run(o, &log);
  EXPECT_NE(log.find("SwiGLU MLP H=48 I=96"), std::string::npos) << log;
  EXPECT_LT(r.final_loss, 0.25 * r.start_loss) << log;

  StateDict lin;  // one weight with its bias
  lin["proj.weight"] = test::random_tensor(DType::F32, {24, 40}, 5);
  lin["proj.bias"] = test::random_tensor(DType::F32, {24}, 6);
  const TempFile linear_file = write(lin, "linear");
  o.path = linear_file.path;
  r = run(o, &log);
  EXPECT_NE(log.find("linear 40 -> 24 + bias"), std::string::npos) << log;
  EXPECT_LT(r.final_loss, 0.25 * r.start_loss) << log;
}

TEST(Finetune, DataParallelOptionsAreChecked) {
  tool::FinetuneOptions o;
  o.gpus = 2;
  // In process, without the supervisor's rank variables: the job refuses rather than training alone.
  EXPECT_TRUE(test::throws_error([&] { run(o); }, ErrorCode::InvalidArgument, {"--gpus 2", "1 ranks"}));
  // The command on the CPU backend: no GPUs to start ranks on.
  o.cpu = true;
  EXPECT_TRUE(test::throws_error([&] { tool::run_finetune(o, {"qmm", "finetune", "--gpus", "2", "--cpu"}); },
                                 ErrorCode::Unsupported, {"--gpus 2", "GPUs"}));
  // A rank of a CPU job (world size 2) is refused with the same reason.
  setenv("QMM_RANK", "1", 1);
  setenv("QMM_WORLD_SIZE", "2", 1);
  EXPECT_TRUE(test::throws_error([&] { run(o); }, ErrorCode::Unsupported, {"--gpus 2", "GPUs"}));
  unsetenv("QMM_RANK");
  unsetenv("QMM_WORLD_SIZE");
}

TEST(Finetune, ClearErrors) {
  tool::FinetuneOptions o;
  o.path = temp_path("does_not_exist");
  EXPECT_TRUE(test::throws_error([&] { run(o); }, ErrorCode::Io, {"no such file"}));

  // A weight or bias holding NaN or infinity: refused before training, naming the file, the tensor and the index.
  for (const char* name : {"proj.weight", "proj.bias"}) {
    StateDict lin;
    lin["proj.weight"] = test::random_tensor(DType::BF16, {24, 40}, 5);
    lin["proj.bias"] = test::random_tensor(DType::F32, {24}, 6);
    if (std::string(name) == "proj.bias") lin[name].data_as<float>()[7] = INFINITY;
    else lin[name].data_as<std::uint16_t>()[123] = 0x7fc0;  // a bf16 NaN
    const TempFile bad = write(lin, "non_finite");
    o.path = bad.path;
    EXPECT_TRUE(test::throws_error([&] { run(o); }, ErrorCode::InvalidArgument,
                                   {bad.path, std::string("'") + name + "'", std::string(name) == "proj.bias" ?
                                   "at index 7" : "at index 123", "finite"}));
  }

  StateDict nothing;
  nothing["scale"] = test::filled(DType::F32, {4}, 1);
  nothing["table.weight"] = test::filled(DType::F32, {2, 3, 4}, 1);
  const TempFile nothing_file = write(nothing, "nothing");
  o.path = nothing_file.path;
  EXPECT_TRUE(test::throws_error([&] { run(o); }, ErrorCode::InvalidArgument,
                                 {"finetune", "no bitsandbytes 4-bit layer", "scale", "table.weight"}));

  StateDict two;
  two["a.weight"] = test::filled(DType::F32, {4, 4}, 1);
  two["b.weight"] = test::filled(DType::F32, {4, 4}, 1);
  const TempFile two_file = write(two, "two");
  o.path = two_file.path;
  EXPECT_TRUE(test::throws_error([&] { run(o); }, ErrorCode::InvalidArgument,
                                 {"several 2-D weights", "a.weight, b.weight"}));

  StateDict bad_mlp;
  bad_mlp["gate_proj.weight"] = test::filled(DType::F32, {8, 4}, 1);
  bad_mlp["up_proj.weight"] = test::filled(DType::F32, {8, 4}, 1);
  bad_mlp["down_proj.weight"] = test::filled(DType::F32, {8, 4}, 1);
  const TempFile bad_mlp_file = write(bad_mlp, "bad_mlp");
  o.path = bad_mlp_file.path;
  EXPECT_TRUE(test::throws_error([&] { run(o); }, ErrorCode::ShapeMismatch, {"down_proj [8,4]", "[H,I]"}));

  StateDict bad_bias;
  bad_bias["weight"] = test::filled(DType::F32, {8, 4}, 1);
  bad_bias["bias"] = test::filled(DType::F32, {4}, 1);
  const TempFile bad_bias_file = write(bad_bias, "bad_bias");
  o.path = bad_bias_file.path;
  EXPECT_TRUE(test::throws_error([&] { run(o); }, ErrorCode::ShapeMismatch, {"'bias' is [4]", "8 outputs"}));

  tool::FinetuneOptions bad;
  bad.rank = 0;
  EXPECT_TRUE(test::throws_error([&] { run(bad); }, ErrorCode::InvalidArgument, {"--rank"}));
  bad = {};
  bad.lr = -1.0f;
  EXPECT_TRUE(test::throws_error([&] { run(bad); }, ErrorCode::InvalidArgument, {"--lr"}));
}

}  // namespace
}  // namespace qmm
