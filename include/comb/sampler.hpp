#pragma once
// Token sampling: greedy, or temperature with top-k and top-p, from a seeded generator.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

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
  // Whether sample() is the argmax (temperature 0): the lowest index among equal maxima.
  bool greedy() const { return options_.temperature == 0; }

 private:
  SamplingOptions options_;
  std::mt19937_64 rng_;
};

// A generated token's log-probability under the model (the log-softmax of the raw logits, before
// temperature and top-p, as OpenAI and vLLM report it) and the `top` most likely tokens with
// theirs, most likely first (ties: the lower id first).
struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};
// logits [n_vocab] (any device, any float type); top: 0 to n_vocab.
TokenLogprob token_logprob(const at::Tensor& logits, int32_t token, int64_t top);

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/sampler.ipp"
#endif
