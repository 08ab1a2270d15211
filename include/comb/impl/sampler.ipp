// comb::Sampler: greedy, temperature, top-k and top-p sampling.
// Compiled into libcomb (src/sampler.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "comb/error.hpp"
#include "comb/sampler.hpp"

namespace comb {

COMB_INLINE Sampler::Sampler(SamplingOptions options) : options_(options), rng_(options.seed) {
  COMB_CHECK(options.temperature >= 0, "temperature must be >= 0, found {}", options.temperature);
  COMB_CHECK(options.top_k >= 0, "top-k must be >= 0, found {}", options.top_k);
  COMB_CHECK(options.top_p > 0 && options.top_p <= 1, "top-p must be in (0, 1], found {}", options.top_p);
}

COMB_INLINE int32_t Sampler::sample(const at::Tensor& logits) {
  at::Tensor l = logits.to(at::kCPU, at::kFloat).contiguous();
  if (options_.temperature == 0) return static_cast<int32_t>(l.argmax().item<int64_t>());
  at::Tensor sorted, order;
  std::tie(sorted, order) = (l / options_.temperature).sort(/*dim=*/-1, /*descending=*/true);
  int64_t keep = sorted.size(0);
  if (options_.top_k > 0) keep = std::min(keep, options_.top_k);
  at::Tensor probs = at::softmax(sorted.narrow(0, 0, keep), 0);
  const float* p = probs.data_ptr<float>();
  if (options_.top_p < 1) {  // smallest prefix whose mass reaches top_p
    double mass = 0;
    int64_t i = 0;
    while (i < keep && mass < options_.top_p) mass += p[i++];
    keep = std::max<int64_t>(i, 1);
  }
  double total = std::accumulate(p, p + keep, 0.0);
  double u = std::uniform_real_distribution<double>(0.0, total)(rng_);
  int64_t pick = 0;
  for (double acc = p[0]; acc < u && pick + 1 < keep; acc += p[++pick]) {
  }
  return static_cast<int32_t>(order[pick].item<int64_t>());
}

COMB_INLINE TokenLogprob token_logprob(const at::Tensor& logits, int32_t token, int64_t top) {
  at::Tensor l = at::log_softmax(logits.to(at::kCPU, at::kFloat).reshape({-1}), 0).contiguous();
  const int64_t n = l.size(0);
  COMB_CHECK(token >= 0 && token < n, "token {} is outside the logits' {} entries", token, n);
  COMB_CHECK(top >= 0 && top <= n, "top log-probabilities should be 0 to {}, found {}", n, top);
  const float* p = l.data_ptr<float>();
  TokenLogprob r;
  r.token = token;
  r.logprob = p[token];
  if (top > 0) {
    std::vector<int32_t> ids(static_cast<size_t>(n));
    std::iota(ids.begin(), ids.end(), 0);
    auto higher = [p](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
    std::partial_sort(ids.begin(), ids.begin() + top, ids.end(), higher);
    r.top.reserve(static_cast<size_t>(top));
    for (int64_t i = 0; i < top; ++i) r.top.emplace_back(ids[i], p[ids[i]]);
  }
  return r;
}

}  // namespace comb
