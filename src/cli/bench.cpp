// comb bench: prefill and decode throughput, placing cached tokens, the tokenizer, a decode profile, memory.
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <stdlib.h>

#include <filesystem>
#include <limits>
#include <numeric>
#include <random>

#include "comb/detail/decode_step.hpp"
#include "commands.hpp"

namespace comb::cli {

// Time by operation over decode steps: a thread-local RecordFunction callback (LibTorch's ATen ops
// and comb's own kernels, which name themselves "comb::..."), each operation's own time without
// the operations it calls. Main thread only: the work of worker threads is inside the op that
// started it.
namespace op_profile {
struct Stat {
  int64_t calls = 0, self_ns = 0, total_ns = 0, inner = 0;  // inner: operations called inside it, at any depth
};
struct Frame {
  std::string name;
  int64_t start_ns = 0, child_ns = 0, inner = 0;
};
std::map<std::string, Stat> stats;
std::vector<Frame> stack;
int64_t top_level_ns = 0;
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
  stack.push_back({fn.name(), now_ns(), 0, 0});
  return nullptr;
}
void leave(const at::RecordFunction&, at::ObserverContext*) {
  if (stack.empty()) return;
  Frame f = std::move(stack.back());
  stack.pop_back();
  const int64_t total = now_ns() - f.start_ns;
  Stat& s = stats[f.name];
  ++s.calls;
  s.total_ns += total;
  s.self_ns += total - f.child_ns;
  s.inner += f.inner;
  if (stack.empty()) {
    top_level_ns += total;
  } else {
    stack.back().child_ns += total;
    stack.back().inner += 1 + f.inner;
  }
}
// Runs `work` under the callback; returns its wall time in microseconds (stats and top_level_ns
// hold what it recorded).
template <class F>
double record(const F& work) {
  stats.clear();
  stack.clear();
  top_level_ns = 0;
  auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(enter, leave).needsInputs(false).scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
  const int64_t t0 = now_ns();
  work();
  const double us = (now_ns() - t0) / 1e3;
  at::removeCallback(handle);
  return us;
}
// Prints what `record` measured per unit (`per` units ran: steps, requests), the 16 operations of
// most own time first; json lines carry `tags`.
void print(const std::string& title, const std::string& unit, int64_t per, double wall_us, const nlohmann::json& tags, bool json,
           size_t top = 16) {
  std::vector<std::pair<std::string, Stat>> rows(stats.begin(), stats.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.self_ns > b.second.self_ns; });
  const double unit_us = wall_us / per;
  const double outside_us = unit_us - top_level_ns / 1e3 / per;
  auto line = [&](const std::string& op, double calls, double us) {
    nlohmann::json j = tags;
    j["op"] = op;
    if (calls >= 0) j["calls_per_" + unit] = calls;
    j["self_us_per_" + unit] = us;
    if (const auto it = stats.find(op); it != stats.end()) {
      j["total_us_per_" + unit] = it->second.total_ns / 1e3 / per;
      j["inner_ops_per_" + unit] = double(it->second.inner) / per;
    }
    j[unit + "_us"] = unit_us;
    std::cout << j.dump() << std::endl;
  };
  // The `top` of most own time, and comb's own scopes (their inner operations say what they launch).
  auto shown_row = [&](size_t r) { return r < top || rows[r].first.rfind("comb::", 0) == 0; };
  if (json) {
    for (size_t r = 0; r < rows.size(); ++r)
      if (shown_row(r)) line(rows[r].first, double(rows[r].second.calls) / per, rows[r].second.self_ns / 1e3 / per);
  } else {
    fmt::print("{} (profiled: {:.0f} us a {})\n", title, unit_us, unit);
    fmt::print("  {:<44} {:>10} {:>12} {:>7} {:>12} {:>10}\n", "operation", "calls/" + unit, "own us/" + unit, "share",
               "with inner", "inner ops");
  }
  double shown = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    if (!shown_row(r)) continue;
    const double us = rows[r].second.self_ns / 1e3 / per;
    shown += us;
    if (!json)
      fmt::print("  {:<44} {:>10.1f} {:>12.1f} {:>6.1f}% {:>12.1f} {:>10.1f}\n", rows[r].first,
                 double(rows[r].second.calls) / per, us, 100 * us / unit_us, rows[r].second.total_ns / 1e3 / per,
                 double(rows[r].second.inner) / per);
  }
  const double rest = top_level_ns / 1e3 / per - shown;
  if (json) {
    line("(every other operation)", -1, rest);
    line("(outside every operation)", -1, outside_us);
  } else {
    fmt::print("  {:<44} {:>10} {:>12.1f} {:>6.1f}%\n", "(every other operation)", "", rest, 100 * rest / unit_us);
    fmt::print("  {:<44} {:>10} {:>12.1f} {:>6.1f}%\n", "(outside every operation)", "", outside_us, 100 * outside_us / unit_us);
  }
}
}  // namespace op_profile

namespace {
// --pic-data: caching methods' TTFT on the same QA items in one process, the methods alternated
// item by item (each item cold, then warm `repeat` times, a method after the other), so that a
// drift of the machine falls on all of them alike; the ratio against the first method is taken
// per item, then its median. Separate processes (bench/cost_table.sh) differ by 10% from load.
// With `profile`, each method's cold and warm requests run once more over the items under the
// operation profile (host time by operation: on a GPU, launches and the waits of copies to the host),
// after cold requests over as many further items of the file, whose lengths the process has not met
// (on a GPU a new shape can cost what a seen one does not), each after a fresh store as in the
// timed pass.
// The median of xs, or null when there is none (a JSON field).
nlohmann::json p50(const std::vector<double>& xs) { return xs.empty() ? nlohmann::json() : nlohmann::json(median(xs)); }

int bench_pic(comb::Model& model, const std::string& data, int64_t n_items, const std::string& method_list,
              const comb::PicOptions& options, int repeat, bool json, bool profile) {
  std::vector<comb::Method> methods;
  for (const auto& name : split_items(method_list, "pic-methods")) methods.push_back(comb::parse_method(name));
  if (methods.size() < 2) throw Error("--pic-methods: expected two methods or more, comma separated, found '" + method_list + "'");
  // With `profile`, as many further items too (one read of the file), kept apart for its first section.
  auto items = comb::read_qa_items(data, profile ? 2 * n_items : n_items);
  if (items.empty()) throw Error("--pic-data: no item in '" + data + "'");
  std::vector<comb::QaItem> further;
  if (static_cast<int64_t>(items.size()) > n_items) {
    further.assign(items.begin() + n_items, items.end());
    items.resize(static_cast<size_t>(n_items));
  }
  std::vector<std::unique_ptr<comb::PicEngine>> engines;
  for (auto m : methods) engines.push_back(std::make_unique<comb::PicEngine>(model, m, options));
  comb::GenerateOptions first;
  first.max_tokens = 1;
  const size_t k = methods.size();
  std::vector<std::vector<double>> cold(k), warm(k), cold_ratio(k), warm_ratio(k);
  std::vector<int64_t> warm_device_hits(k), warm_host_hits(k);  // the store's, over the warm requests
  // A warm request against the prefill of its new tokens alone (the tokens it computed, on a fresh
  // cache, the first token read back as a request's is): that prefill's median over `repeat` runs
  // after one untimed run, by length (items share lengths).
  const comb::Decoder& dec = model.decoder();
  std::map<int64_t, double> prefill_ms;
  auto new_prefill_ms = [&](int64_t n) {
    auto it = prefill_ms.find(n);
    if (it != prefill_ms.end()) return it->second;
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(n));
    const at::Tensor ids = at::randint(std::min<int64_t>(1000, dec.config().n_vocab / 2), dec.config().n_vocab, {1, n}, gen);
    std::vector<double> times;
    for (int r = 0; r <= repeat; ++r) {
      comb::KVCache cache = dec.make_cache(1, n);
      const auto t0 = std::chrono::steady_clock::now();
      dec.forward(ids, cache)[0][-1].argmax().item<int64_t>();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) times.push_back(ms);
    }
    return prefill_ms[n] = median(times);
  };
  std::vector<std::vector<double>> new_tokens(k), new_ms(k), new_ratio(k);
  for (size_t i = 0; i < items.size(); ++i) {
    const comb::PicRequest request = comb::qa_request(model, items[i].documents, items[i].question);
    std::vector<double> c(k), w(k);
    for (size_t m = 0; m < k; ++m) {
      engines[m]->clear();
      c[m] = engines[m]->generate(request, first).ttft_ms;
    }
    std::vector<std::vector<double>> ws(k);
    std::vector<comb::StoreStats> before(k);
    for (size_t m = 0; m < k; ++m) before[m] = engines[m]->store().stats();
    std::vector<comb::PicCounts> counts(k);  // the last warm request's
    for (int r = 0; r < repeat; ++r)
      for (size_t m = 0; m < k; ++m) ws[m].push_back(engines[m]->generate(request, first, &counts[m]).ttft_ms);
    for (size_t m = 0; m < k; ++m) {
      const comb::StoreStats after = engines[m]->store().stats();
      warm_device_hits[m] += after.device.hits - before[m].device.hits;
      warm_host_hits[m] += after.host.hits - before[m].host.hits;
    }
    for (size_t m = 0; m < k; ++m) {
      w[m] = median(ws[m]);
      cold[m].push_back(c[m]);
      warm[m].push_back(w[m]);
      cold_ratio[m].push_back(c[m] / c[0]);
      warm_ratio[m].push_back(w[m] / w[0]);
      if (counts[m].computed > 0) {
        const double p = new_prefill_ms(counts[m].computed);
        new_tokens[m].push_back(static_cast<double>(counts[m].computed));
        new_ms[m].push_back(p);
        new_ratio[m].push_back(w[m] / p);
      }
    }
    fmt::print(stderr, "[bench] item {}/{}\r", i + 1, items.size());
  }
  fmt::print(stderr, "\n");
  for (size_t m = 0; m < k; ++m) {
    const std::string name = comb::method_name(methods[m]);
    if (json) {
      std::cout << nlohmann::json{{"bench", "pic"}, {"method", name}, {"items", items.size()},
                                  {"ttft_cold_ms_p50", median(cold[m])}, {"ttft_warm_ms_p50", median(warm[m])},
                                  {"cold_ratio_p50", median(cold_ratio[m])}, {"warm_ratio_p50", median(warm_ratio[m])},
                                  {"against", comb::method_name(methods[0])},
                                  {"warm_tier_hits", {{"device", warm_device_hits[m]}, {"host", warm_host_hits[m]}}},
                                  {"warm_new_tokens_p50", p50(new_tokens[m])},
                                  {"new_prefill_ms_p50", p50(new_ms[m])},
                                  {"warm_over_new_prefill_p50", p50(new_ratio[m])}}
                       .dump()
                << std::endl;
    } else {
      fmt::print("{:<10} {} items  cold p50 {:>8.1f} ms  warm p50 {:>7.1f} ms  per item against {}: cold {:.3f}, warm {:.3f}\n",
                 name, items.size(), median(cold[m]), median(warm[m]), comb::method_name(methods[0]),
                 median(cold_ratio[m]), median(warm_ratio[m]));
      if (!new_ratio[m].empty())
        fmt::print("{:<10} warm requests computed {:.0f} tokens (p50); the prefill of those alone {:.1f} ms (p50); "
                   "warm against it, per item: {:.3f}\n",
                   name, median(new_tokens[m]), median(new_ms[m]), median(new_ratio[m]));
      if (model.decoder().device().is_cuda())  // beside a device tier: where the warm requests found their documents
        fmt::print("{:<10} warm requests' document hits: device tier {}, host tier {}\n", name, warm_device_hits[m],
                   warm_host_hits[m]);
    }
  }
  if (profile) {
    std::vector<comb::PicRequest> requests, unseen;
    for (const auto& item : items) requests.push_back(comb::qa_request(model, item.documents, item.question));
    for (const auto& item : further) unseen.push_back(comb::qa_request(model, item.documents, item.question));
    if (unseen.empty())
      fmt::print(stderr, "[bench] --profile: the file has no items beyond the {} measured: no profile of lengths not met "
                 "before\n", items.size());
    const auto n = static_cast<int64_t>(requests.size());
    for (size_t m = 0; m < k; ++m) {
      const std::string name = comb::method_name(methods[m]);
      if (!unseen.empty()) {
        // As the timed pass's cold requests: each after a fresh store (its making profiled too),
        // each of lengths new to this method (the first method meets them first of all).
        const double new_us = op_profile::record([&] {
          for (const auto& r : unseen) {
            engines[m]->clear();
            engines[m]->generate(r, first);
          }
        });
        op_profile::print(name + ": cold requests of further items (lengths not met before, each after a fresh store)",
                          "request",
                          static_cast<int64_t>(unseen.size()), new_us,
                          nlohmann::json{{"bench", "pic_profile"}, {"method", name}, {"phase", "cold_unseen"}}, json, 12);
      }
      engines[m]->clear();
      // Cold: the engine's store emptied once, so each item's documents are new to it (a document
      // that two items share is warm the second time).
      const double cold_us = op_profile::record([&] {
        for (const auto& r : requests) engines[m]->generate(r, first);
      });
      op_profile::print(name + ": cold requests", "request", n, cold_us,
                        nlohmann::json{{"bench", "pic_profile"}, {"method", name}, {"phase", "cold"}}, json, 12);
      const double warm_us = op_profile::record([&] {
        for (const auto& r : requests) engines[m]->generate(r, first);
      });
      op_profile::print(name + ": warm requests", "request", n, warm_us,
                        nlohmann::json{{"bench", "pic_profile"}, {"method", name}, {"phase", "warm"}}, json, 12);
    }
  }
  return 0;
}
}  // namespace

// What every measurement of `comb bench` (without --pic-data) shares: the model, the options,
// the prompts' random source (drawn in the order the measurements run) and the output.
struct Bench {
  const comb::Model& model;
  const comb::Decoder& dec;
  int repeat;
  bool json;
  std::mt19937_64 rng{1234};
  // Deterministic prompts of ordinary tokens (ids past the special ones at the start of the vocabulary).
  at::Tensor prompt(int64_t n) {
    std::uniform_int_distribution<int64_t> pick(1000, model.config().n_vocab - 1);
    std::vector<int64_t> ids(n);
    for (auto& id : ids) id = pick(rng);
    return at::tensor(ids, at::kLong).unsqueeze(0);
  }
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  // first_ms: the first run's time (a length the process had not run before), or < 0.
  void report(const std::string& what, int64_t tokens, double tps, int64_t after = 0, double first_ms = -1) const {
    if (json) {
      nlohmann::json line{{"bench", what}, {"tokens", tokens}, {"tokens_per_s", tps}};
      if (what == "prefill") line["cached"] = after;
      if (first_ms >= 0) line["first_ms"] = first_ms;
      std::cout << line.dump() << std::endl;
    } else if (after > 0) {
      fmt::print("{:<8} {:>6} tokens  {:>10.1f} tokens/s  after {} cached\n", what, tokens, tps, after);
    } else {
      fmt::print("{:<8} {:>6} tokens  {:>10.1f} tokens/s\n", what, tokens, tps);
    }
  }
};

// The weights' format and bytes.
void bench_weights(Bench& b) {
  const comb::Decoder& dec = b.dec;
  const bool json = b.json;
  const auto& w = dec.weights();
  std::string format = w.quantized() ? "kept quantized (" : std::string(c10::toString(dec.dtype()));
  if (w.quantized()) {
    std::vector<std::string> parts;
    if (!w.layers.empty() && w.layers[0].quantized) parts.push_back(std::string("layers ") + w.layers[0].quantized->wqkv.format_name());
    if (w.output_q) parts.push_back(std::string("head ") + w.output_q->format_name());
    format += fmt::format("{})", fmt::join(parts, ", "));
  }
  const double weights_mb = w.bytes() / 1048576.0;
  if (json)
    std::cout << nlohmann::json{{"bench", "weights"}, {"format", format}, {"weight_bytes", w.bytes()}}.dump() << std::endl;
  else
    fmt::print("weights  {}, {:.1f} MiB\n", format, weights_mb);
}

// Prefill throughput of each length, after `cached` positions computed untimed.
void bench_prefill(Bench& b, const std::vector<int64_t>& lengths, int64_t cached) {
  const comb::Model& model = b.model;
  const comb::Decoder& dec = b.dec;
  auto prompt = [&](int64_t n) { return b.prompt(n); };
  auto now = &Bench::now;
  const int repeat = b.repeat;
  at::Tensor before = prompt(cached);
  for (int64_t n : lengths) {
    if (n <= 0) throw Error("--prompt-tokens: expected lengths > 0, found " + std::to_string(n));
    if (cached + n > model.config().n_ctx)
      throw Error(fmt::format("--prompt-tokens: {} tokens after {} cached exceed the model's context ({})", n, cached,
                              model.config().n_ctx));
    at::Tensor ids = prompt(n);
    std::vector<double> times;
    double first_ms = 0;
    for (int r = 0; r <= repeat; ++r) {  // the first run warms up (its time is reported apart)
      comb::KVCache cache = dec.make_cache(1, cached + n);
      if (cached > 0) dec.forward(before, cache);  // not timed
      auto t0 = now();
      at::Tensor logits = dec.forward(ids, cache);
      logits.cpu();
      const double seconds = std::chrono::duration<double>(now() - t0).count();
      if (r > 0) times.push_back(seconds);
      else first_ms = seconds * 1e3;
    }
    b.report("prefill", n, n / median(times), cached, first_ms);
  }
}

// Decode throughput after a 128-token prompt, and with `profile` the time per step by operation.
void bench_decode(Bench& b, int64_t n_decode, bool profile) {
  const comb::Decoder& dec = b.dec;
  auto prompt = [&](int64_t n) { return b.prompt(n); };
  auto now = &Bench::now;
  const int repeat = b.repeat;
  const bool json = b.json;
  // A 128-token prompt (not timed), then `run` with the call that decodes n_decode tokens after it.
  auto after_prompt = [&](const auto& run) {
    comb::KVCache cache = dec.make_cache(1, 128 + n_decode);
    int64_t token = dec.forward(prompt(128), cache)[0][-1].argmax().item<int64_t>();
    run([&] {
      for (int64_t i = 0; i < n_decode; ++i)
        token = dec.forward(at::full({1, 1}, token, at::kLong), cache)[0][-1].argmax().item<int64_t>();
    });
  };
  std::vector<double> rates;
  for (int r = 0; r <= repeat; ++r)
    after_prompt([&](const auto& decode) {
      auto t0 = now();
      decode();
      if (r > 0) rates.push_back(n_decode / std::chrono::duration<double>(now() - t0).count());
    });
  b.report("decode", n_decode, median(rates));
  if (profile) {
    double step_us = 0;
    // On a GPU the profiled steps are also the range a device profiler started with its capture off
    // records (`ncu --profile-from-start off`: their kernels, graph nodes included, and no others).
    const comb::detail::CudaLayerOps* ops = dec.device().is_cuda() ? comb::detail::cuda_layer_ops() : nullptr;
    auto range = [&](bool start) {
      c10::OptionalDeviceGuard on;  // the range is the current device's context's: the model's
      if (ops) on.reset_device(dec.device());
      if (ops && ops->profiler_range && !ops->profiler_range(start))
        fmt::print(stderr, "[bench] the CUDA runtime refused to {} the profiler's range\n", start ? "open" : "close");
    };
    after_prompt([&](const auto& decode) {
      step_us = op_profile::record([&] {
        range(true);
        decode();
        range(false);
      });
    });
    op_profile::print(fmt::format("decode profile, {} steps", n_decode), "step", n_decode, step_us,
                      nlohmann::json{{"bench", "decode_profile"}}, json);
  }
}

// The serving engine's batched decoding step with B sequences running: B requests of 128 prompt
// tokens each, decoding `n_decode` past end-of-sequence; the steps that ran all B. The batch sizes
// take turns, --repeat rounds, and each figure is the median of its rounds.
void bench_batch_decode(Bench& bench, const std::vector<int64_t>& sizes, int64_t n_decode,
                        const comb::SamplingOptions& sampling) {
  const comb::Model& model = bench.model;
  auto prompt = [&](int64_t n) { return bench.prompt(n); };
  const int repeat = bench.repeat;
  const bool json = bench.json;
  for (int64_t b : sizes)
    if (b <= 0) throw Error("--batch-decode: expected batch sizes > 0, found " + std::to_string(b));
  std::map<int64_t, std::vector<double>> rates, step_ms;
  for (int r = 0; r < repeat; ++r)
    for (int64_t b : sizes) {
      comb::ServeOptions o;
      o.method = comb::Method::full;
      o.max_running = b;
      o.prefill_share = 0;  // prompts between every two steps: all B soon decode together
      o.kv_bytes = std::max<int64_t>(int64_t(1) << 30, b * (128 + n_decode + 16) *
                                                     comb::BlockPool::block_bytes(model.config(), 1,
                                                                                  model.decoder().dtype()));
      comb::ServeEngine engine(model, o);
      std::vector<std::promise<void>> done(static_cast<size_t>(b));
      for (int64_t i = 0; i < b; ++i) {
        comb::ServeRequest req;
        at::Tensor ids = prompt(128);
        req.prompt.suffix.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
        req.max_tokens = n_decode;
        req.ignore_eos = true;
        req.sampling = sampling;
        req.sampling.seed = static_cast<uint64_t>(i);
        req.on_done = [&done, i](const comb::ServeResult&) { done[static_cast<size_t>(i)].set_value(); };
        engine.submit(std::move(req));
      }
      for (auto& d : done) d.get_future().wait();
      const auto st = engine.stats();
      auto it = st.steps_by_batch.find(b);
      if (it == st.steps_by_batch.end() || it->second.first == 0)
        throw Error(fmt::format("--batch-decode {}: no decoding step ran all {} sequences (raise --decode-tokens)", b, b));
      rates[b].push_back(double(b) * double(it->second.first) / it->second.second);
      step_ms[b].push_back(1e3 * it->second.second / double(it->second.first));
    }
  const double one = rates.count(1) ? median(rates[1]) : 0;
  std::vector<int64_t> reported;
  for (int64_t b : sizes) {
    if (std::find(reported.begin(), reported.end(), b) != reported.end()) continue;  // a size given twice
    reported.push_back(b);
    const double tps = median(rates[b]), ms = median(step_ms[b]);
    if (json)
      std::cout << nlohmann::json{{"bench", "batch_decode"}, {"batch", b}, {"rounds", rates[b].size()},
                                  {"step_ms", ms}, {"tokens_per_s", tps}, {"vs_batch_1", one > 0 ? tps / one : 0.0},
                                  {"temperature", sampling.temperature}, {"top_p", sampling.top_p}}
                       .dump()
                << std::endl;
    else
      fmt::print("batch {:>3}  {:>8.2f} ms/step  {:>9.1f} tokens/s  (median of {}){}{}\n", b, ms, tps, rates[b].size(),
                 one > 0 && b != 1 ? fmt::format("  {:.2f}x batch 1", tps / one) : "",
                 sampling.temperature > 0
                     ? fmt::format("  sampled (temperature {}, top-p {})", sampling.temperature, sampling.top_p)
                     : "");
  }
}

// Drawing a token from the model's logits (the last row of a 128-token prompt's forward): `n`
// draws by Sampler::sample (its highest tokens ordered) against as many by the rule's whole
// ordering (a stable sort of the vocabulary, its softmax, the same walk: how the sampler drew
// before), in the same run on the same logits, --repeat rounds; the medians per draw and their ratio.
void bench_sample(Bench& b, int64_t n, const comb::SamplingOptions& options) {
  comb::KVCache cache = b.dec.make_cache(1, 128);
  const at::Tensor logits = b.dec.forward(b.prompt(128), cache)[0][-1].to(at::kCPU, at::kFloat).contiguous();
  std::vector<double> fast, sorted;
  int64_t agree = 0;
  for (int r = 0; r < b.repeat; ++r) {
    comb::SamplingOptions o = options;
    o.seed = static_cast<uint64_t>(r);
    comb::Sampler sampler(o);
    std::vector<int32_t> got(static_cast<size_t>(n));
    auto t0 = Bench::now();
    for (auto& t : got) t = sampler.sample(logits);
    fast.push_back(std::chrono::duration<double>(Bench::now() - t0).count() / double(n));
    std::mt19937_64 same(o.seed);
    t0 = Bench::now();
    for (int64_t i = 0; i < n; ++i)
      agree += comb::detail::sorted_draw(logits, o, std::uniform_real_distribution<double>(0.0, 1.0)(same)) ==
               got[static_cast<size_t>(i)];
    sorted.push_back(std::chrono::duration<double>(Bench::now() - t0).count() / double(n));
  }
  const double f = median(fast) * 1e6, w = median(sorted) * 1e6;
  const int64_t total = n * b.repeat;
  if (b.json)
    std::cout << nlohmann::json{{"bench", "sample"}, {"vocab", logits.numel()}, {"draws", n},
                                {"temperature", options.temperature}, {"top_p", options.top_p},
                                {"us_per_draw", f}, {"whole_sort_us_per_draw", w}, {"speedup", w / f},
                                {"same_token", double(agree) / double(total)}}
                     .dump()
              << std::endl;
  else
    fmt::print("sample   {:>6} tokens  {:>8.1f} us a draw, {:.1f} us ordering them all ({:.1f}x); the same token "
               "in {} of {} draws (temperature {}, top-p {})\n",
               logits.numel(), f, w, w / f, agree, total, options.temperature, options.top_p);
}

// Placing `n_place` cached tokens, in documents of 64 moved to where they land (keys rotated).
void bench_place(Bench& b, int64_t n_place) {
  const comb::Decoder& dec = b.dec;
  auto prompt = [&](int64_t n) { return b.prompt(n); };
  auto now = &Bench::now;
  const int repeat = b.repeat;
  const int64_t doc_len = std::min<int64_t>(64, n_place);
  comb::KVCache doc = dec.make_cache(1, doc_len);
  dec.forward(prompt(doc_len), doc);  // one document's K/V at positions [0, doc_len), reused throughout
  std::vector<double> times;
  for (int r = 0; r <= repeat; ++r) {
    comb::KVCache cache = dec.make_cache(1, n_place);
    auto t0 = now();
    for (int64_t pos = 0; pos < n_place; pos += doc_len) {
      const int64_t m = std::min(doc_len, n_place - pos);
      for (int64_t l = 0; l < cache.n_layers(); ++l)
        dec.place(l, cache, pos, doc.keys(l).narrow(2, 0, m), doc.values(l).narrow(2, 0, m));
    }
    if (r > 0) times.push_back(std::chrono::duration<double>(now() - t0).count());
  }
  b.report("place", n_place, n_place / median(times));
}

// The tokenizer on one word of `n_tokenize` random letters, a new one each run.
void bench_tokenize(Bench& b, int64_t n_tokenize) {
  const comb::Model& model = b.model;
  auto now = &Bench::now;
  const int repeat = b.repeat;
  const bool json = b.json;
  std::mt19937_64& rng = b.rng;
  std::uniform_int_distribution<int> letter('a', 'z');
  std::vector<double> times;
  size_t n_ids = 0;
  for (int r = 0; r <= repeat; ++r) {
    std::string word(static_cast<size_t>(n_tokenize), 'a');
    for (auto& ch : word) ch = static_cast<char>(letter(rng));  // a new word: the piece cache cannot answer
    auto t0 = now();
    n_ids = model.tokenizer().encode(word, /*parse_special=*/false).size();
    if (r > 0) times.push_back(std::chrono::duration<double>(now() - t0).count());
  }
  const double cps = n_tokenize / median(times);
  if (json)
    std::cout << nlohmann::json{{"bench", "tokenize"}, {"chars", n_tokenize}, {"tokens", n_ids}, {"chars_per_s", cps}}.dump()
              << std::endl;
  else
    fmt::print("{:<8} {:>6} chars   {:>10.1f} chars/s  ({} tokens)\n", "tokenize", n_tokenize, cps, n_ids);
}

// put() of `n` documents' caches (the decoder's K/V of 128 tokens, on its device and in its dtype:
// what naive reuse stores) into a store with memory tiers (on a GPU a device tier first, as a
// server's) and a disk tier in a new folder under `parent`, the disk writes queued for the store's
// writer (the default) or waited for one by one (disk_queue_bytes 0: as every put() did before the
// writer), the two alternated round by round; and the time flush() then takes to write what is
// queued. Each round's folder is removed once it is checked.
void bench_store_put(Bench& b, int64_t n, const std::string& parent) {
  namespace fs = std::filesystem;
  const comb::ModelConfig& c = b.model.config();
  const int64_t tokens = 128;
  comb::DocumentKV kv;
  kv.n_tokens = tokens;
  const auto options = at::TensorOptions().device(b.dec.device()).dtype(b.dec.dtype());
  for (int64_t l = 0; l < c.n_layer; ++l) {
    kv.keys.push_back(at::randn({c.n_head_kv, tokens, c.head_dim}, options));
    kv.values.push_back(at::randn({c.n_head_kv, tokens, c.head_dim}, options));
  }
  std::string pattern = (fs::path(parent.empty() ? fs::temp_directory_path().string() : parent) / "comb-bench-store-XXXXXX").string();
  COMB_CHECK(::mkdtemp(pattern.data()) != nullptr, "--store-put: cannot make a folder under '{}'", fs::path(pattern).parent_path().string());
  const std::string root = pattern;
  const int64_t queue_default = comb::StoreOptions{}.disk_queue_bytes;
  std::map<int64_t, std::vector<double>> put_us, flush_ms;  // by queue bytes: medians of each round
  const int64_t file_bytes = 72 + kv.bytes();  // the disk format's header (docs/formats.md) and the entry
  try {
    for (int r = 0; r < b.repeat; ++r)
      for (int64_t queue : {queue_default, int64_t(0)}) {
        comb::StoreOptions o;
        o.host_bytes = n * kv.bytes();
        if (b.dec.device().is_cuda()) {
          o.device = b.dec.device();
          o.device_bytes = n * kv.bytes();
        }
        o.disk_bytes = n * file_bytes;  // every entry kept
        o.disk_dir = fmt::format("{}/r{}-q{}", root, r, queue);
        o.disk_queue_bytes = queue;
        {
          comb::PICacheStore store(o);
          std::vector<double> us;
          for (int64_t i = 0; i < n; ++i) {
            const comb::CacheKey key = comb::PICacheStore::key({static_cast<int32_t>(i), r}, "bench");
            auto t0 = Bench::now();
            store.put(key, kv);
            us.push_back(std::chrono::duration<double, std::micro>(Bench::now() - t0).count());
        }
        auto t0 = Bench::now();
        store.flush();
        flush_ms[queue].push_back(std::chrono::duration<double, std::milli>(Bench::now() - t0).count());
        put_us[queue].push_back(median(us));
        const comb::StoreStats s = store.stats();
        COMB_CHECK(s.disk.entries == n && s.write_errors == 0, "--store-put: {} of {} entries written, {} failed",
                   s.disk.entries, n, s.write_errors);
        }
        std::error_code ec;
        fs::remove_all(o.disk_dir, ec);
      }
  } catch (...) {
    std::error_code ec;
    fs::remove_all(root, ec);
    throw;
  }
  std::error_code ec;
  fs::remove_all(root, ec);
  const double queued = median(put_us[queue_default]), waited = median(put_us[0]);
  const double drain = median(flush_ms[queue_default]);
  const double mib = double(kv.bytes()) / double(1 << 20);
  if (b.json)
    std::cout << nlohmann::json{{"bench", "store_put"}, {"entries", n}, {"entry_mib", mib},
                                {"queued_put_us", queued}, {"waited_put_us", waited}, {"ratio", waited / queued},
                                {"queued_flush_ms", drain}}
                     .dump()
              << std::endl;
  else
    fmt::print("store    {:>6} puts    {:>10.1f} us a put, disk writes queued; {:.1f} us waiting for each write "
               "({:.1f}x); entries of {:.2f} MiB, {:.1f} ms to write the queue\n",
               n, queued, waited, waited / queued, mib, drain);
}

// Resident memory now and at its peak (the whole process: LibTorch, the model, the runs above).
void bench_memory(const Bench& b) {
  const bool json = b.json;
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  const double peak_mb = usage.ru_maxrss / 1024.0;  // Linux: KiB
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  const double resident_mb = resident * static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1048576.0;
  if (json)
    std::cout << nlohmann::json{{"bench", "memory"}, {"resident_mib", resident_mb}, {"peak_resident_mib", peak_mb}}.dump()
              << std::endl;
  else
    fmt::print("memory   resident {:.1f} MiB, peak {:.1f} MiB\n", resident_mb, peak_mb);
}

int cmd_bench(Args& args) {
  const std::string pic_data = args.str("pic-data");
  // The list options are read before the model loads: a mistyped list costs no load.
  std::vector<int64_t> lengths, batch_sizes;
  if (pic_data.empty()) {
    lengths = comb::cli::parse_int_list(args.str("prompt-tokens", "128,512,2048"), "prompt-tokens");
    batch_sizes = comb::cli::parse_int_list(args.str("batch-decode"), "batch-decode");
  }
  comb::Model model = load_model(args, /*shipped_plugin=*/!pic_data.empty(), /*as_stored=*/true);
  if (!pic_data.empty()) {
    const int64_t items = args.num<int64_t>("pic-items", 20);
    if (items <= 0) throw Error("--pic-items: expected a number of items > 0, found " + std::to_string(items));
    const std::string list = args.str("pic-methods", "naive,comb");
    const int repeat = std::max(1, args.num<int>("repeat", 3));
    comb::PicOptions options = pic_method_options(args);
    if (args.has("device-cache-mb")) {
      const int64_t mb = args.num<int64_t>("device-cache-mb", 0);
      if (mb < 0 || mb > (std::numeric_limits<int64_t>::max() >> 20))
        throw Error("--device-cache-mb: expected MiB >= 0 (and below 2^43), found " + std::to_string(mb));
      if (!model.decoder().device().is_cuda())
        fmt::print(stderr, "[bench] --device-cache-mb: the model is on the CPU, whose store has no device tier\n");
      options.device_cache_bytes = mb << 20;
    }
    const bool json = args.has("json");
    const bool profile = args.num<int>("profile", 0) != 0;
    args.str("json");
    args.check_all_used();
    c10::InferenceMode guard;
    return bench_pic(model, pic_data, items, list, options, repeat, json, profile);
  }
  int64_t n_decode = args.num<int64_t>("decode-tokens", 64);
  int64_t cached = args.num<int64_t>("cached", 0);
  if (cached < 0) throw Error("--cached: expected a number of positions >= 0, found " + std::to_string(cached));
  int64_t n_place = args.num<int64_t>("place", 0);
  if (n_place < 0 || n_place > model.config().n_ctx)
    throw Error(fmt::format("--place: expected a number of tokens in [0, {}] (the model's context), found {}",
                            model.config().n_ctx, n_place));
  const int64_t n_sample = args.num<int64_t>("sample", 0);
  if (n_sample < 0) throw Error("--sample: expected a number of draws >= 0, found " + std::to_string(n_sample));
  const int64_t n_store = args.num<int64_t>("store-put", 0);
  if (n_store < 0 || n_store > 100000)
    throw Error("--store-put: expected a number of puts in [0, 100000], found " + std::to_string(n_store));
  const std::string store_parent = args.str("cache-dir");
  int64_t n_tokenize = args.num<int64_t>("tokenize", 0);
  if (n_tokenize < 0) throw Error("--tokenize: expected a number of characters >= 0, found " + std::to_string(n_tokenize));
  int repeat = std::max(1, args.num<int>("repeat", 3));
  const bool profile = args.num<int>("profile", 0) != 0;
  comb::SamplingOptions sampling;  // --batch-decode's rows: greedy, or sampled
  sampling.temperature = args.num<float>("temperature", 0.0f);
  sampling.top_p = args.num<float>("top-p", 1.0f);
  comb::Sampler check(sampling);  // its limits, before any run
  (void)check;
  bool json = args.has("json");
  args.str("json");
  args.check_all_used();
  c10::InferenceMode guard;
  Bench b{model, model.decoder(), repeat, json};
  bench_weights(b);
  bench_prefill(b, lengths, cached);
  if (n_decode > 0) bench_decode(b, n_decode, profile);
  if (!batch_sizes.empty()) bench_batch_decode(b, batch_sizes, n_decode, sampling);
  if (n_place > 0) bench_place(b, n_place);
  if (n_tokenize > 0) bench_tokenize(b, n_tokenize);
  if (n_sample > 0) {
    comb::SamplingOptions o = sampling;
    if (o.temperature == 0) o.temperature = 1.0f;  // a draw, not the argmax
    bench_sample(b, n_sample, o);
  }
  if (n_store > 0) bench_store_put(b, n_store, store_parent);
  bench_memory(b);
  return 0;
}
}  // namespace comb::cli
