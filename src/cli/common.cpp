// What the commands share: the default model and plug-in, option checks made before a model loads, loading it, and the cold/warm timing of eval and qa.
#include "commands.hpp"

#include <limits>

namespace comb::cli {

std::string default_model() {
  if (const char* env = std::getenv("COMB_MODEL"); env && *env) return env;
  return COMB_DEFAULT_MODEL;
}

// The trained plug-in shipped for the default model (docs/training.md), used by eval, qa and
// generate when neither --model nor COMB_MODEL names another model and no --plugin is given.
std::string default_plugin() {
  if (const char* env = std::getenv("COMB_PLUGIN"); env && *env) return env;
  return COMB_DEFAULT_PLUGIN;
}

// Input files and directories the options name, checked before a model loads (seconds) so that a
// mistyped path is refused at once, naming the option.
void check_inputs(const Args& args) {
  namespace fs = std::filesystem;
  for (const char* option : {"data", "document"})
    for (const auto& path : args.peek_all(option)) {
      std::error_code ec;
      COMB_CHECK(fs::is_regular_file(path, ec), "--{}: cannot open '{}' ({})", option, path,
                 fs::exists(path, ec) ? "not a regular file" : "no such file");
    }
  for (const auto& dir : args.peek_all("essays")) {
    std::error_code ec;
    COMB_CHECK(fs::is_directory(dir, ec), "--essays: '{}' is not a directory", dir);
  }
}

// Every numeric option any command takes, checked on a copy of the options (nothing is marked
// used) before a model loads, so that "--max-tokens 1x" is refused at once, naming the option.
void check_numbers(const Args& args) {
  Args probe = args;
  for (const char* o : {"accumulate", "batch", "block-tokens", "cache-mb", "cache-ttl", "cached", "check-layer", "comb-recompute-last",
                        "decode-tokens", "default-max-tokens", "device-cache-mb", "docs", "document-tokens", "drain-timeout", "encoder-layers", "epic-k",
                        "items", "kv-mb", "limit", "log-every", "max-docs", "max-document-tokens", "max-documents",
                        "max-new-tokens", "max-queued", "max-request-document-tokens", "max-connections", "max-connections-per-client", "max-running", "max-tokens", "max-tokens-in-flight", "min-docs",
                        "min-documents", "offset", "pairs-per-document", "place", "port", "prefill-chunk",
                        "prefix-block", "sample", "save-every", "steps", "store-put", "teacher-tokens", "teacher-top-k", "tokenize", "top-k",
                        "warm", "warmup"})
    probe.num<int64_t>(o, 0);
  for (const char* o : {"comb-recompute-linked", "consecutive-documents", "cpu-kernels", "documents-after-prefix", "encoder-prefix", "mixed-step", "profile", "reading-check",
                        "relative-positions", "repeat", "resume", "threads"})
    probe.num<int>(o, 0);
  probe.num<int>("log-requests", 0);
  for (const char* o : {"blend-ratio", "clip", "gate-lr-scale", "kl-weight", "kv-share", "lr", "min-lr-ratio",
                        "needle-share", "duration", "piece-ms", "prefill-share", "request-timeout", "open-gate", "open-gates", "weight-decay"})
    probe.num<double>(o, 0);
  probe.num<float>("temperature", 0), probe.num<float>("top-p", 0);
  probe.num<uint64_t>("seed", 0);
  if (probe.has("cache-dtype")) parse_cache_dtype(probe.str("cache-dtype"));
  cache_queue_bytes(probe);  // a number, and in range
}

comb::Model load_model(Args& args, bool shipped_plugin, bool as_stored) {
  check_inputs(args);
  check_numbers(args);
  const bool default_base = !args.has("model") && default_model() == COMB_DEFAULT_MODEL;
  std::string path = args.str("model", default_model());
  if (path.empty()) throw Error("no model: pass --model FILE or set COMB_MODEL");
  comb::Options options;
  options.device = args.str("device", "cpu");
  options.dtype = args.str("dtype", "float32");
  options.quantize = args.str("quantize", as_stored ? "auto" : "none");
  options.threads = args.num<int>("threads", 0);
  options.cpu_kernels = args.num<int>("cpu-kernels", 1) != 0;
  options.plugin = args.str("plugin");
  if (options.plugin == "none") options.plugin.clear();
  else if (options.plugin.empty() && shipped_plugin && default_base && !default_plugin().empty()) {
    options.plugin = default_plugin();
    COMB_CHECK(std::filesystem::exists(options.plugin),
               "the shipped plug-in '{}' is missing (pass --plugin FILE, or --plugin none for the bare decoder)",
               options.plugin);
  }
  auto t0 = std::chrono::steady_clock::now();
  comb::Model model = comb::Model::load(path, options);
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const auto& c = model.config();
  const std::string& kept = model.decoder().weights().quantization;
  fmt::print(stderr, "[comb] loaded {} ({} layers, {} heads / {} kv, vocab {}) on {} {}{} in {:.0f} ms, {} threads\n",
             path, c.n_layer, c.n_head, c.n_head_kv, c.n_vocab, options.device, options.dtype,
             kept.empty() ? "" : fmt::format(", weights kept quantized ({})", kept), ms, at::get_num_threads());
  return model;
}


int64_t cache_queue_bytes(Args& args) {
  const int64_t mb = args.num<int64_t>("cache-queue-mb", 256);
  if (mb < 0 || mb > (std::numeric_limits<int64_t>::max() >> 20))
    throw Error("--cache-queue-mb: expected MiB >= 0 (and below 2^43), found " + std::to_string(mb));
  return mb << 20;
}

PicOptions pic_method_options(Args& args, PicOptions o) {
  o.blend_ratio = args.num<double>("blend-ratio", o.blend_ratio);
  o.check_layer = args.num<int64_t>("check-layer", o.check_layer);
  o.epic_k = args.num<int64_t>("epic-k", o.epic_k);
  o.prefix_block = args.num<int64_t>("prefix-block", o.prefix_block);
  o.comb_recompute_last = args.num<int64_t>("comb-recompute-last", o.comb_recompute_last);
  o.comb_recompute_linked = args.num<int>("comb-recompute-linked", o.comb_recompute_linked ? 1 : 0) != 0;
  return o;
}

std::string clock_text(double seconds) {
  int64_t s = static_cast<int64_t>(seconds);
  return s >= 3600 ? fmt::format("{}h{:02}m", s / 3600, s / 60 % 60) : fmt::format("{}m{:02}s", s / 60, s % 60);
}

std::string data_name(const std::string& path) {
  std::string name = std::filesystem::path(path).filename().string();
  for (const char* ext : {".gz", ".jsonl", ".json"})
    if (name.size() > strlen(ext) && name.compare(name.size() - strlen(ext), strlen(ext), ext) == 0)
      name.resize(name.size() - strlen(ext));
  return name;
}



ColdWarm run_cold_warm(PicEngine& engine, const PicRequest& request, const PicRequest& priming,
                       const GenerateOptions& gen, bool prime_all) {
  ColdWarm r;
  const Method method = engine.method();
  engine.clear();
  if (method == Method::full && !prime_all) {
    r.warm = engine.generate(request, gen, &r.warm_counts);
    r.cold = r.warm;
    r.cold_counts = r.warm_counts;
    return r;
  }
  GenerateOptions first = gen;
  first.max_tokens = 1;
  r.cold = engine.generate(request, first, &r.cold_counts);
  if (method != Method::full && (prime_all || method == Method::prefix)) {
    engine.clear();
    engine.prefill(priming, 1);
  }
  r.warm = engine.generate(request, gen, &r.warm_counts);
  return r;
}

nlohmann::json summarize_eval(const std::vector<nlohmann::json>& rows, const std::string& where) {
  COMB_CHECK(!rows.empty(), "{}: no evaluated items to summarize", where);
  std::vector<double> cold_ms, warm_ms;
  double computed = 0, reused = 0;
  int64_t correct = 0;
  for (const auto& r : rows) {
    correct += r.at("correct").get<bool>();
    cold_ms.push_back(r.at("ttft_cold_ms").get<double>());
    warm_ms.push_back(r.at("ttft_warm_ms").get<double>());
    computed += r.at("computed_tokens_warm").get<double>();
    reused += r.at("reused_tokens_warm").get<double>();
  }
  const double n = static_cast<double>(rows.size());
  return {{"method", rows[0].at("method")},
          {"data", rows[0].at("data")},
          {"n", rows.size()},
          {"accuracy", correct / n},
          {"ttft_cold_ms_p50", median(cold_ms)},
          {"ttft_warm_ms_p50", median(warm_ms)},
          {"computed_tokens_warm_mean", computed / n},
          {"reused_tokens_warm_mean", reused / n},
          {"cache_bytes_per_token", rows[0].at("cache_bytes_per_token")}};
}

// A --document FILE: its title from the file name ("mount-everest.txt": "Mount everest"), its text
// without trailing blanks.
QaDocument read_document(const std::string& path) {
  std::string title = std::filesystem::path(path).stem().string();
  std::replace(title.begin(), title.end(), '-', ' ');
  std::replace(title.begin(), title.end(), '_', ' ');
  if (!title.empty() && title[0] >= 'a' && title[0] <= 'z') title[0] = static_cast<char>(title[0] - 'a' + 'A');
  QaDocument d{title, detail::read_text_file(path)};
  while (!d.text.empty() && (d.text.back() == '\n' || d.text.back() == ' ')) d.text.pop_back();
  COMB_CHECK(!d.text.empty(), "document '{}' is empty", path);
  return d;
}

}  // namespace comb::cli
