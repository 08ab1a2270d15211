// comb::Sampler: greedy, temperature, top-k and top-p sampling.
// Compiled into libcomb (src/sampler.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "comb/detail/upload.hpp"
#include "comb/error.hpp"
#include "comb/sampler.hpp"

namespace comb {

COMB_INLINE Sampler::Sampler(SamplingOptions options) : options_(options), rng_(options.seed) {
  COMB_CHECK(options.temperature >= 0, "temperature must be >= 0, found {}", options.temperature);
  COMB_CHECK(options.top_k >= 0, "top-k must be >= 0, found {}", options.top_k);
  COMB_CHECK(options.top_p > 0 && options.top_p <= 1, "top-p must be in (0, 1], found {}", options.top_p);
}

namespace detail::sampling {

// A row's highest tokens by scaled logit s = logit / temperature: descending, ties the lower id
// first (NaN never among them).
struct Candidates {
  std::vector<float> values;
  std::vector<int32_t> ids;
  float max = 0;    // the row's largest s (values[0])
  double mass = 0;  // the sum over the whole row of exp(s - max)
  int64_t n = 0;    // the row's tokens
};

// A token: its scaled logit, id and (where a selection by weight needs it) weight exp(s - max).
struct Item {
  float value;
  int32_t id;
  double weight;
};
// a is ordered before b: a higher s, or the same and a lower id.
inline bool item_before(const Item& a, const Item& b) {
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

// The candidates in order from tokens in any order.
COMB_INLINE void set_candidates(std::vector<Item>& top, Candidates& c) {
  std::sort(top.begin(), top.end(), item_before);
  c.values.resize(top.size());
  c.ids.resize(top.size());
  for (size_t i = 0; i < top.size(); ++i) c.values[i] = top[i].value, c.ids[i] = top[i].id;
  c.max = top.empty() ? 0.0f : top[0].value;
}

// The `want` highest of s_i = logits[i] / t (every one when want >= n).
COMB_INLINE void highest(const float* logits, int64_t n, float t, int64_t want, Candidates& c) {
  std::vector<Item> top;
  top.reserve(static_cast<size_t>(std::min(want, n)));
  for (int64_t i = 0; i < n; ++i) {
    const float v = logits[i] / t;
    if (std::isnan(v)) continue;
    if (static_cast<int64_t>(top.size()) < want) {
      top.push_back({v, static_cast<int32_t>(i), 0.0});
      std::push_heap(top.begin(), top.end(), item_before);  // front: the last in order kept
    } else if (v > top.front().value) {  // a later id enters only above the last kept
      std::pop_heap(top.begin(), top.end(), item_before);
      top.back() = {v, static_cast<int32_t>(i), 0.0};
      std::push_heap(top.begin(), top.end(), item_before);
    }
  }
  set_candidates(top, c);
  c.n = n;
}

// The token drawn by `u01` (in [0, 1)) from the candidates (Sampler's rule), or -1 where they are
// too few to decide it.
COMB_INLINE int64_t pick(const Candidates& c, const SamplingOptions& o, double u01) {
  const auto have = static_cast<int64_t>(c.ids.size());
  if (have == 0) return -1;
  if (!std::isfinite(c.max) || !std::isfinite(c.mass)) return c.ids[0];  // an infinite or NaN row: its first
  std::vector<double> e(static_cast<size_t>(have));
  for (int64_t j = 0; j < have; ++j) e[j] = std::exp(static_cast<double>(c.values[j]) - c.max);
  // The kept tokens' mass: the candidates' own sum where they hold them all (the walk below adds
  // the same numbers in the same order, so it ends on a token of weight above 0), else the row's.
  auto kept_mass = [&](int64_t k) { return k <= have ? std::accumulate(e.begin(), e.begin() + k, 0.0) : c.mass; };
  int64_t keep = o.top_k > 0 ? std::min(c.n, o.top_k) : c.n;
  if (keep < c.n && keep > have) return -1;
  if (o.top_p < 1) {  // the shortest prefix whose mass reaches top_p of the kept tokens'
    const double goal = o.top_p * kept_mass(keep);
    double mass = 0;
    int64_t i = 0;
    while (i < keep && mass < goal) {
      if (i >= have) return -1;
      mass += e[static_cast<size_t>(i++)];
    }
    keep = std::max<int64_t>(i, 1);
  }
  const double u = u01 * kept_mass(keep);
  int64_t j = 0;
  for (double acc = e[0]; acc < u && j + 1 < keep; acc += e[static_cast<size_t>(++j)])
    if (j + 1 >= have) return -1;
  return c.ids[static_cast<size_t>(j)];
}

// Of `items`, the one at which the cumulative weight in the order (value descending, ties the lower
// id first) first reaches `target` (the last one where none does): a selection by weight, each
// round splitting the items in place at a pivot value and keeping the side the target falls in
// (linear in the items where pivots split them; a full sort after 64 rounds that did not).
COMB_INLINE Item first_reaching(std::vector<Item>& items, double target) {
  double before = 0;
  auto lo = items.begin(), hi = items.end();
  for (int round = 0;; ++round) {
    if (hi - lo <= 32 || round == 64) {
      std::sort(lo, hi, item_before);
      for (auto it = lo; it != hi; ++it)
        if ((before += it->weight) >= target) return *it;
      return *(hi - 1);
    }
    const float a = lo->value, b = (lo + (hi - lo) / 2)->value, c = (hi - 1)->value;
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // the median of three
    const auto greater = std::partition(lo, hi, [pivot](const Item& it) { return it.value > pivot; });
    const auto equal = std::partition(greater, hi, [pivot](const Item& it) { return it.value == pivot; });
    double above = 0;
    for (auto it = lo; it != greater; ++it) above += it->weight;
    if (greater != lo && before + above >= target) {
      hi = greater;
      continue;
    }
    before += above;
    std::sort(greater, equal, item_before);  // one value: by id
    for (auto it = greater; it != equal; ++it)
      if ((before += it->weight) >= target) return *it;
    if (equal == hi) return *(equal - 1);
    lo = equal;
  }
}

// The token of draw u01 from a row of float logits [n] on the host: its highest tokens ordered
// (top_k of them, else 64); where the draw falls past them, a selection by weight over every token.
COMB_INLINE int32_t draw(const float* logits, int64_t n, const SamplingOptions& o, double u01) {
  Candidates c;
  highest(logits, n, o.temperature, std::min(n, o.top_k > 0 ? o.top_k : 64), c);
  if (c.ids.empty()) return 0;  // every logit NaN
  const at::Tensor l = at::from_blob(const_cast<float*>(logits), {n}, at::kFloat);
  // A temperature so small that scaled logits overflow: its limit, the argmax.
  if (c.max == std::numeric_limits<float>::infinity()) return static_cast<int32_t>(l.argmax().item<int64_t>());
  const at::Tensor e = at::exp(l.div(o.temperature).sub_(c.max)).contiguous();  // every token's weight
  c.mass = e.sum(at::kDouble).item<double>();  // read where every token is kept (no top_k, or one >= n)
  const int64_t j = pick(c, o, u01);
  if (j >= 0) return static_cast<int32_t>(j);
  // Past the highest 64 (no top_k below n here: with one, the candidates are every kept token).
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(n));
  const float* w = e.data_ptr<float>();
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = logits[i] / o.temperature;
    if (std::isnan(v) || w[i] == 0) continue;  // a token of no weight is never drawn
    items.push_back({v, static_cast<int32_t>(i), static_cast<double>(w[i])});
    total += w[i];
  }
  if (o.top_p < 1) {  // the kept: every token ordered up to the one where the mass reaches top_p
    const Item last = first_reaching(items, o.top_p * total);
    std::vector<Item> kept;
    total = 0;
    for (const Item& it : items)
      if (!item_before(last, it)) {
        kept.push_back(it);
        total += it.weight;
      }
    items = std::move(kept);
  }
  return first_reaching(items, u01 * total).id;
}

}  // namespace detail::sampling

COMB_INLINE int32_t detail::sorted_draw(const at::Tensor& logits, const SamplingOptions& o, double u01) {
  const at::Tensor s = logits.to(at::kCPU, at::kFloat).contiguous().reshape({-1}) / o.temperature;
  auto [sorted, order] = s.sort(/*stable=*/true, 0, /*descending=*/true);
  int64_t keep = sorted.size(0);
  if (o.top_k > 0) keep = std::min(keep, o.top_k);
  const at::Tensor p = at::softmax(sorted.narrow(0, 0, keep), 0).contiguous();
  const float* pp = p.data_ptr<float>();
  if (o.top_p < 1) {
    double mass = 0;
    int64_t i = 0;
    while (i < keep && mass < o.top_p) mass += pp[i++];
    keep = std::max<int64_t>(i, 1);
  }
  const double u = u01 * std::accumulate(pp, pp + keep, 0.0);
  int64_t pick = 0;
  for (double acc = pp[0]; acc < u && pick + 1 < keep; acc += pp[++pick]) {
  }
  return static_cast<int32_t>(order[pick].item<int64_t>());
}

COMB_INLINE int32_t Sampler::sample(const at::Tensor& logits) {
  at::Tensor l = logits.to(at::kCPU, at::kFloat).contiguous();
  if (options_.temperature == 0) return static_cast<int32_t>(l.argmax().item<int64_t>());
  const double u01 = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
  return detail::sampling::draw(l.data_ptr<float>(), l.numel(), options_, u01);
}

COMB_INLINE std::vector<int32_t> Sampler::sample_rows(const std::vector<Sampler*>& samplers, const at::Tensor& logits) {
  COMB_CHECK(logits.dim() == 2 && logits.size(0) == static_cast<int64_t>(samplers.size()),
             "sample_rows: logits [rows, n_vocab] for {} samplers, found [{}]", samplers.size(),
             fmt::join(logits.sizes(), ", "));
  const int64_t rows = logits.size(0), n = logits.size(1);
  std::vector<int32_t> out(static_cast<size_t>(rows));
  if (!logits.is_cuda()) {
    const at::Tensor host = logits.to(at::kCPU, at::kFloat).contiguous();
    for (int64_t r = 0; r < rows; ++r) out[r] = samplers[r]->sample(host[r]);
    return out;
  }
  // On the device: each row's argmax, and for the sampling rows their scaled logits' highest
  // `want` (ids and values), maximum and whole mass, read back in one copy of doubles (ids exact).
  std::vector<float> temperature(static_cast<size_t>(rows), 1.0f);
  int64_t want = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const SamplingOptions& o = samplers[r]->options_;
    if (o.temperature == 0) continue;
    temperature[r] = o.temperature;
    want = std::max(want, std::min(n, o.top_k > 0 ? o.top_k : 64));
  }
  const at::Tensor f = logits.to(at::kFloat);
  std::vector<at::Tensor> parts{f.argmax(1).to(at::kDouble).unsqueeze(1)};
  if (want > 0) {
    const at::Tensor t = detail::upload(at::tensor(temperature, at::kFloat), f.device()).unsqueeze(1);
    const at::Tensor scaled = f / t;  // as the host divides each logit
    // One more than wanted: where it equals the last wanted, the tie the boundary cuts is known.
    auto [values, ids] = scaled.topk(std::min(n, want + 1), 1, /*largest=*/true, /*sorted=*/true);
    const at::Tensor max = values.narrow(1, 0, 1);
    const at::Tensor mass = at::exp(scaled - max).sum(1, /*keepdim=*/true, at::kDouble);
    parts.insert(parts.end(), {max.to(at::kDouble), mass, values.to(at::kDouble), ids.to(at::kDouble)});
  }
  const int64_t take = want > 0 ? std::min(n, want + 1) : 0;
  const at::Tensor host = at::cat(parts, 1).to(at::kCPU).contiguous();  // [rows, 1 (+ 2 + 2 take)]
  const double* a = host.data_ptr<double>();
  const int64_t width = host.size(1);
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = a + r * width;
    Sampler& s = *samplers[r];
    if (s.options_.temperature == 0) {
      out[r] = static_cast<int32_t>(row[0]);
      continue;
    }
    const double u01 = std::uniform_real_distribution<double>(0.0, 1.0)(s.rng_);
    if (row[1] == std::numeric_limits<double>::infinity()) {  // scaled logits overflow: the argmax, as draw()
      out[r] = static_cast<int32_t>(row[0]);
      continue;
    }
    detail::sampling::Candidates c;
    std::vector<detail::sampling::Item> top;
    const double *v = row + 3, *id = row + 3 + take;
    // topk's order among equal values is not the host's (the lower id first): a group of equal
    // values that the last wanted place cuts is left out (a draw reaching it reads the whole row).
    const bool cut = take > want && v[want - 1] == v[want];
    for (int64_t j = 0; j < want; ++j)
      if (!std::isnan(v[j]) && !(cut && v[j] == v[want]))
        top.push_back({static_cast<float>(v[j]), static_cast<int32_t>(id[j]), 0.0});
    detail::sampling::set_candidates(top, c);  // ties: the lower id first, as on the host
    c.mass = row[2];
    c.n = n;
    int64_t j = detail::sampling::pick(c, s.options_, u01);
    if (j < 0) {  // the draw past the highest `want`: the whole row, on the host
      const at::Tensor whole = f[r].to(at::kCPU).contiguous();
      j = detail::sampling::draw(whole.data_ptr<float>(), n, s.options_, u01);
    }
    out[r] = static_cast<int32_t>(j);
  }
  return out;
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
