// The shapes qmm is measured at (../shared/DESIGN.md): MLP projections of Qwen2.5-1.5B and Llama-3-8B for
// M tokens, and attention's batched products.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qmm::bench {

struct Projection {
  std::string label;  // "qwen2.5-1.5b gate_up"
  std::int64_t k;     // in_features
  std::int64_t n;     // out_features
};

inline std::vector<Projection> projections() {
  return {{"qwen2.5-1.5b gate_up", 1536, 8960},
          {"qwen2.5-1.5b down", 8960, 1536},
          {"llama3-8b gate_up", 4096, 14336},
          {"llama3-8b down", 14336, 4096}};
}

// The attention projections' weights (q and o share a shape, as k and v do), for the NF4 conversions: a training
// step dequantizes them too, and at these sizes a kernel's launch and tail weigh more.
inline std::vector<Projection> attention_projections() {
  return {{"qwen2.5-1.5b q_proj", 1536, 1536},
          {"qwen2.5-1.5b k_proj", 1536, 256},
          {"llama3-8b q_proj", 4096, 4096},
          {"llama3-8b k_proj", 4096, 1024}};
}

inline std::vector<std::int64_t> token_counts() { return {1, 16, 64, 512, 2048, 4096}; }

struct Attention {
  std::string label;
  std::int64_t batch, heads, seq, head_dim;
};

inline std::vector<Attention> attention_shapes() {
  return {{"attn b4 h12 s512", 4, 12, 512, 128},
          {"attn b4 h12 s2048", 4, 12, 2048, 128},
          {"attn b1 h32 s2048", 1, 32, 2048, 128}};
}

}  // namespace qmm::bench
