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

// Temperature sampling: the tokens ordered by logit (highest first, ties: the lower id first), the
// first top_k kept (0: all), then the shortest prefix of them whose probability reaches top_p, and
// one of those drawn in proportion to exp(logit / temperature) by one uniform draw of the
// generator (the inverse of their cumulative mass). Only the highest tokens are ordered: as many as
// top_k, else 64, more only when a draw falls past them.
class Sampler {
 public:
  explicit Sampler(SamplingOptions options);
  // Picks a token from float logits [n_vocab] (any device).
  int32_t sample(const at::Tensor& logits);
  // Whether sample() is the argmax (temperature 0): the lowest index among equal maxima.
  bool greedy() const { return options_.temperature == 0; }
  // One token a row of logits [rows, n_vocab] (any device, any float type), row r by samplers[r]
  // as its sample() would draw it (each sampler's generator advanced as there). On a CUDA device
  // the rows' highest tokens, maxima and masses are computed there and read back in one copy; a
  // row whose draw falls past them copies its whole row (rare). Elsewhere each row's sample().
  static std::vector<int32_t> sample_rows(const std::vector<Sampler*>& samplers, const at::Tensor& logits);

 private:
  SamplingOptions options_;
  std::mt19937_64 rng_;
};

namespace detail {
// Sampler's rule over the whole vocabulary sorted (a stable sort: ties the lower id first; a float32
// softmax of the kept logits), for one uniform draw u01 in [0, 1): how the sampler drew before it
// ordered only the highest tokens, the reference its tests and `comb bench --sample` hold it to.
int32_t sorted_draw(const at::Tensor& logits, const SamplingOptions& options, double u01);
}  // namespace detail

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
