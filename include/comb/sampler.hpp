#pragma once
// Token sampling: greedy, or temperature with top-k and top-p, from a seeded generator.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>

namespace comb {

struct SamplingOptions {
  float temperature = 0.0f;  // 0: greedy
  int64_t top_k = 0;         // 0: no limit
  float top_p = 1.0f;        // 1: no limit
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(SamplingOptions options);
  // Picks a token from float logits [n_vocab] (any device).
  int32_t sample(const at::Tensor& logits);

 private:
  SamplingOptions options_;
  std::mt19937_64 rng_;
};

}  // namespace comb
