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
