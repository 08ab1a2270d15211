// `comb eval`: one method on a multi-document QA file, cold and warm, with accuracy and TTFT.
// `comb train`: trains a plug-in for the loaded decoder.
#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <cstring>
#include <filesystem>
#include <random>

#include "args.hpp"
#include "comb/comb.hpp"

namespace comb::cli {

namespace {

std::string clock_text(double seconds) {
  int64_t s = static_cast<int64_t>(seconds);
  return s >= 3600 ? fmt::format("{}h{:02}m", s / 3600, s / 60 % 60) : fmt::format("{}m{:02}s", s / 60, s % 60);
}

}  // namespace

int cmd_eval(Args& args, Model& model) {
  const std::string data = args.str("data");
  COMB_CHECK(!data.empty(), "eval needs --data FILE (JSON Lines, optionally gzip)");
  Method method = parse_method(args.str("method", "full"));
  PicOptions options;
  options.blend_ratio = args.num<double>("blend-ratio", options.blend_ratio);
  options.check_layer = args.num<int64_t>("check-layer", options.check_layer);
  options.epic_k = args.num<int64_t>("epic-k", options.epic_k);
  options.prefix_block = args.num<int64_t>("prefix-block", options.prefix_block);
  const int64_t limit = args.num<int64_t>("limit", 0);
  const int64_t offset = args.num<int64_t>("offset", 0);
  COMB_CHECK(limit >= 0 && offset >= 0, "--limit and --offset must be >= 0 (found {} and {})", limit, offset);
  const std::string out_path = args.str("out");
  GenerateOptions gen;
  gen.max_tokens = args.num<int64_t>("max-new-tokens", 32);
  args.check_all_used();

  // Items [offset, offset + limit), and the one after them: its question primes the last item's
  // warm run, so a long evaluation split into chunks runs each item as the whole would.
  auto items = read_qa_items(data, limit > 0 ? offset + limit + 1 : 0);
  COMB_CHECK(offset < static_cast<int64_t>(items.size()), "--offset {} is past the last item of '{}' ({} items)",
             offset, data, items.size());
  const size_t end = limit > 0 ? std::min<size_t>(offset + limit, items.size()) : items.size();
  const size_t n_items = end - offset;
  PicEngine engine(model, method, options);
  std::ofstream out;
  if (!out_path.empty()) {
    out.open(out_path);
    COMB_CHECK(out.good(), "cannot write '{}'", out_path);
  }
  const bool tty = ::isatty(fileno(stderr));
  std::mt19937 rng(1234);
  std::vector<double> cold_ms, warm_ms;
  double computed_warm = 0, reused_warm = 0;
  int64_t correct = 0, done = 0;
  auto t_start = std::chrono::steady_clock::now();
  for (size_t k = offset; k < end; ++k) {
    const auto& item = items[k];
    PicRequest request = qa_request(model, item.documents, item.question);
    // Cold: nothing of this item cached.
    engine.clear();
    PicCounts cold_stats, warm_stats;
    GenerationResult cold = engine.generate(request, gen, &cold_stats);
    // Warm: every document cached by another request, in another order, with another question.
    engine.clear();
    std::vector<QaDocument> shuffled = item.documents;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    if (shuffled.size() > 1 && std::equal(shuffled.begin(), shuffled.end(), item.documents.begin(),
                                          [](const QaDocument& a, const QaDocument& b) { return a.text == b.text; }))
      std::reverse(shuffled.begin(), shuffled.end());
    engine.prefill(qa_request(model, shuffled, items[(k + 1) % items.size()].question), 1);  // another question
    GenerationResult warm = engine.generate(request, gen, &warm_stats);
    bool ok = answer_correct(warm.text, item.answers);
    correct += ok;
    ++done;
    cold_ms.push_back(cold.ttft_ms);
    warm_ms.push_back(warm.ttft_ms);
    computed_warm += warm_stats.computed;
    reused_warm += warm_stats.reused;
    if (out.is_open())
      out << nlohmann::json{{"id", item.id},
                            {"prediction", warm.text},
                            {"prediction_cold", cold.text},
                            {"correct", ok},
                            {"ttft_cold_ms", cold.ttft_ms},
                            {"ttft_warm_ms", warm.ttft_ms},
                            {"computed_tokens_cold", cold_stats.computed},
                            {"reused_tokens_cold", cold_stats.reused},
                            {"computed_tokens_warm", warm_stats.computed},
                            {"reused_tokens_warm", warm_stats.reused}}
                 .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)  // a cut-off UTF-8 sequence: U+FFFD
          << std::endl;  // flushed: a stopped run keeps the items it finished
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    double eta = elapsed / done * (n_items - done);
    if (tty || done % 10 == 0 || done == static_cast<int64_t>(n_items)) {
      int width = 30, filled = static_cast<int>(width * done / n_items);
      fmt::print(stderr, "{}[eval {}] [{}{}] {}/{} acc {:.1f}% elapsed {} eta {}{}", tty ? "\r" : "",
                 method_name(method), std::string(filled, '#'), std::string(width - filled, '.'), done, n_items,
                 100.0 * correct / done, clock_text(elapsed), clock_text(eta), tty ? "" : "\n");
    }
  }
  if (tty) fmt::print(stderr, "\n");
  std::string name = std::filesystem::path(data).filename().string();
  for (const char* ext : {".gz", ".jsonl", ".json"})
    if (name.size() > strlen(ext) && name.compare(name.size() - strlen(ext), strlen(ext), ext) == 0)
      name.resize(name.size() - strlen(ext));
  nlohmann::json summary = {{"method", method_name(method)},
                            {"data", name},
                            {"n", done},
                            {"accuracy", double(correct) / done},
                            {"ttft_cold_ms_p50", median(cold_ms)},
                            {"ttft_warm_ms_p50", median(warm_ms)},
                            {"computed_tokens_warm_mean", computed_warm / done},
                            {"reused_tokens_warm_mean", reused_warm / done},
                            {"cache_bytes_per_token", engine.cache_bytes_per_token()}};
  std::cout << summary.dump() << std::endl;
  return 0;
}

namespace {
std::pair<std::string, int64_t> file_count(const std::string& spec) {
  size_t colon = spec.rfind(':');
  COMB_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < spec.size(),
             "--holdout expects FILE:N (the first N items of FILE), found '{}'", spec);
  std::string n = spec.substr(colon + 1);
  COMB_CHECK(n.find_first_not_of("0123456789") == std::string::npos, "--holdout '{}': N must be a count", spec);
  return {spec.substr(0, colon), std::stoll(n)};
}
}  // namespace

int cmd_train(Args& args, Model& model) {
  const std::string out = args.str("out");
  COMB_CHECK(!out.empty(), "train needs --out FILE (the trained plug-in)");
  TrainDataOptions data;
  data.files = args.all("data");
  for (const auto& spec : args.all("holdout")) data.holdout.push_back(file_count(spec));
  data.essays_dir = args.str("essays");
  data.kv_share = args.num<double>("kv-share", data.kv_share);
  data.needle_share = args.num<double>("needle-share", data.essays_dir.empty() ? 0.0 : data.needle_share);
  data.min_documents = args.num<int64_t>("min-documents", data.min_documents);
  data.max_documents = args.num<int64_t>("max-documents", data.max_documents);
  data.max_document_tokens = args.num<int64_t>("max-document-tokens", data.max_document_tokens);
  TrainOptions o;
  o.dir = args.str("dir", out + ".run");
  o.steps = args.num<int64_t>("steps", o.steps);
  o.batch_size = args.num<int64_t>("batch", o.batch_size);
  o.accumulation = args.num<int64_t>("accumulate", o.accumulation);
  o.lr = args.num<double>("lr", o.lr);
  o.warmup_steps = args.num<int64_t>("warmup", o.warmup_steps);
  o.min_lr_ratio = args.num<double>("min-lr-ratio", o.min_lr_ratio);
  o.weight_decay = args.num<double>("weight-decay", o.weight_decay);
  o.gate_lr_scale = args.num<double>("gate-lr-scale", o.gate_lr_scale);
  o.clip = args.num<double>("clip", o.clip);
  o.kl_weight = args.num<double>("kl-weight", o.kl_weight);
  o.open_gates = args.num<double>("open-gates", o.open_gates);
  o.seed = args.num<uint64_t>("seed", o.seed);
  o.save_every = args.num<int64_t>("save-every", o.save_every);
  o.log_every = args.num<int64_t>("log-every", o.log_every);
  o.resume = args.num<int>("resume", 1) != 0;
  PluginInitOptions init;
  init.n_encoder_layers = args.num<int64_t>("encoder-layers", init.n_encoder_layers);
  init.seed = o.seed;
  const std::string init_from = args.str("init", "first");
  COMB_CHECK(init_from == "first" || init_from == "spread",
             "--init expects first (encoder = the decoder's first layers, cross blocks after them) or spread, found '{}'",
             init_from);
  init.first_layers = init_from == "first";
  const std::string save_dtype = args.str("save-dtype", "bfloat16");
  args.check_all_used();
  const c10::ScalarType out_dtype = parse_dtype(save_dtype);

  set_log_callback([](LogLevel level, const std::string& m) {
    if (level != LogLevel::debug) fmt::print(stderr, "[comb] {}\n", m);
  });
  // A plug-in given with --plugin continues from its weights; otherwise a fresh one.
  Plugin plugin = model.plugin() ? *model.plugin() : Plugin::fresh(model.decoder(), init);
  TrainData examples(model, data);
  fmt::print(stderr, "[train] {} QA items ({} held out), kv share {}, needle share {}; {} steps of {} x {} examples; "
             "plug-in: {} encoder layers, cross blocks before [{}]\n", examples.n_items(), examples.n_held_out(),
             data.kv_share, data.needle_share, o.steps, o.accumulation, o.batch_size,
             plugin.config().n_encoder_layers(), fmt::join(plugin.config().cross_layers, ", "));
  const bool tty = ::isatty(fileno(stderr));
  o.on_progress = [&](const TrainProgress& p) {
    fmt::print(stderr, "{}[train] step {}/{} loss {:.4f} lr {:.2e} |g| {:.3f} {:.1f}k tok/s gates {:.3f}/{:.3f} elapsed {} "
               "eta {}{}", tty ? "\r" : "", p.step, p.steps, p.loss, p.lr, p.grad_norm, p.tokens_per_s / 1e3,
               p.attn_gate, p.mlp_gate, clock_text(p.elapsed_s), clock_text(p.eta_s), tty ? "   " : "\n");
  };
  TrainResult r = train_plugin(model, plugin, examples, o);
  if (tty) fmt::print(stderr, "\n");
  plugin.save(out, out_dtype);
  std::cout << nlohmann::json{{"out", out},      {"dir", o.dir},           {"steps", r.steps},
                              {"resumed_from", r.resumed_from}, {"loss", r.last_loss}, {"seconds", r.seconds}}
                   .dump()
            << std::endl;
  return 0;
}

}  // namespace comb::cli
