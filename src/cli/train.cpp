// comb train: trains a plug-in for a frozen decoder (docs/training.md).
#include "commands.hpp"

namespace comb::cli {

namespace {
std::pair<std::string, int64_t> file_count(const std::string& spec) {
  size_t colon = spec.rfind(':');
  COMB_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < spec.size(),
             "--holdout expects FILE:N (the first N items of FILE), found '{}'", spec);
  std::string n = spec.substr(colon + 1);
  COMB_CHECK(n.find_first_not_of("0123456789") == std::string::npos, "--holdout '{}': N must be a count", spec);
  return {spec.substr(0, colon), std::stoll(n)};
}
// --dev FILE:N (the first N items) or FILE:A-B (items A..B-1).
struct DevSpec {
  std::string file;
  int64_t first = 0, end = 0;
};
DevSpec dev_spec(const std::string& spec) {
  size_t colon = spec.rfind(':');
  COMB_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < spec.size(),
             "--dev expects FILE:N (the first N items of FILE) or FILE:A-B (items A to B-1), found '{}'", spec);
  const std::string range = spec.substr(colon + 1);
  const size_t dash = range.find('-');
  const std::string a = dash == std::string::npos ? "0" : range.substr(0, dash);
  const std::string b = dash == std::string::npos ? range : range.substr(dash + 1);
  COMB_CHECK(!a.empty() && !b.empty() && a.size() < 10 && b.size() < 10 &&
                 (a + b).find_first_not_of("0123456789") == std::string::npos,
             "--dev '{}': expected a count N or a range A-B of item numbers", spec);
  DevSpec d{spec.substr(0, colon), std::stoll(a), std::stoll(b)};
  COMB_CHECK(d.first < d.end, "--dev '{}': the range {}-{} holds no item", spec, d.first, d.end);
  return d;
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
  o.targets = args.str("targets", o.targets);
  COMB_CHECK(o.targets == "gold" || o.targets == "teacher",
             "--targets expects gold (the items' answers) or teacher (the decoder's own answers with the documents "
             "in context), found '{}'", o.targets);
  o.teacher_file = args.str("teacher");
  o.teacher_tokens = args.num<int64_t>("teacher-tokens", o.teacher_tokens);
  o.teacher_top_k = args.num<int64_t>("teacher-top-k", o.teacher_top_k);
  if (args.has("teacher-batched")) {
    const std::string b = args.str("teacher-batched");
    COMB_CHECK(b == "0" || b == "1" || b == "auto", "--teacher-batched expects 0, 1 or auto, found '{}'", b);
    o.teacher_batched = b == "auto" ? -1 : b == "1";
  }
  COMB_CHECK(o.teacher_tokens >= 1 && o.teacher_top_k >= 1,
             "--teacher-tokens and --teacher-top-k must be >= 1, found {} and {}", o.teacher_tokens, o.teacher_top_k);
  o.open_gates = args.num<double>("open-gates", o.open_gates);
  o.seed = args.num<uint64_t>("seed", o.seed);
  o.save_every = args.num<int64_t>("save-every", o.save_every);
  o.log_every = args.num<int64_t>("log-every", o.log_every);
  o.resume = args.num<int>("resume", 1) != 0;
  o.reading_check = args.num<int>("reading-check", 0) != 0;
  // --cache-dtype: the plug-in declares it (as plugin convert does), and training reads its
  // documents as that dtype keeps them.
  const std::string cache_dtype = args.str("cache-dtype");
  if (!cache_dtype.empty()) o.document_dtype = parse_cache_dtype(cache_dtype);
  COMB_CHECK(cache_dtype.empty() || o.document_dtype != c10::ScalarType::Undefined,
             "--cache-dtype for train names a dtype (float32, bfloat16, float16, int8, int8-int4 or int4), found 'auto'");
  // The held-out check along the run: greedy answers of the comb method on dev items, scored as
  // comb eval scores them. Items of a training file must be held out from training.
  std::vector<QaItem> dev_items;
  const std::string dev = args.str("dev");
  if (!dev.empty()) {
    const DevSpec d = dev_spec(dev);
    if (std::find(data.files.begin(), data.files.end(), d.file) != data.files.end()) {
      int64_t held = 0;
      for (const auto& [file, n] : data.holdout)
        if (file == d.file) held = std::max(held, n);
      COMB_CHECK(d.end <= held,
                 "--dev '{}': items {}-{} of a training file are trained on unless held out: add --holdout {}:{} "
                 "(now {} held out)", dev, d.first, d.end, d.file, d.end, held);
    }
    dev_items = read_qa_items(d.file, d.end);
    COMB_CHECK(static_cast<int64_t>(dev_items.size()) > d.first, "--dev '{}': '{}' has {} items, none from item {}",
               dev, d.file, dev_items.size(), d.first);
    dev_items.erase(dev_items.begin(), dev_items.begin() + d.first);
  }
  o.dev_every = args.num<int64_t>("dev-every", dev_items.empty() ? 0 : o.save_every);
  COMB_CHECK(o.dev_every >= 0, "--dev-every expects a number of steps >= 0 (0: none), found {}", o.dev_every);
  const int64_t dev_tokens = args.num<int64_t>("dev-tokens", 32);
  COMB_CHECK(dev_tokens >= 1, "--dev-tokens must be >= 1, found {}", dev_tokens);
  PluginInitOptions init;
  init.n_encoder_layers = args.num<int64_t>("encoder-layers", init.n_encoder_layers);
  init.cross_layers = parse_int_list(args.str("cross-layers"), "cross-layers");
  COMB_CHECK(init.cross_layers.empty() || !args.has("encoder-layers") ||
                 static_cast<int64_t>(init.cross_layers.size()) == init.n_encoder_layers,
             "--encoder-layers {} and --cross-layers with {} layers disagree (one encoder layer per cross block)",
             init.n_encoder_layers, init.cross_layers.size());
  init.seed = o.seed;
  const std::string init_from = args.str("init", "first");
  COMB_CHECK(init_from == "first" || init_from == "spread" || init_from == "reads" || init_from == "joint",
             "--init expects first (encoder = the decoder's first layers, cross blocks after them), spread, reads "
             "(the base's own attention over the documents' states, needs --cross-layers) or joint (reads, the "
             "blocks joining their layers' attention), found '{}'",
             init_from);
  init.first_layers = init_from == "first";
  init.reads = init_from == "reads" || init_from == "joint";
  init.joint_attention = init_from == "joint";
  init.documents_after_prefix = args.num<int>("documents-after-prefix", 0) != 0;
  COMB_CHECK(!init.documents_after_prefix || init.joint_attention, "--documents-after-prefix 1 is a layout of --init joint");
  init.consecutive_documents = args.num<int>("consecutive-documents", 0) != 0;
  COMB_CHECK(!init.consecutive_documents || init.joint_attention, "--consecutive-documents 1 is a layout of --init joint");
  const std::string save_dtype = args.str("save-dtype", "bfloat16");
  args.check_all_used();
  const c10::ScalarType out_dtype = parse_dtype(save_dtype);

  set_log_callback([](LogLevel level, const std::string& m) {
    if (level != LogLevel::debug) fmt::print(stderr, "[comb] {}\n", m);
  });
  // A plug-in given with --plugin continues from its weights; otherwise a fresh one.
  if (init.reads && !model.plugin()) {
    init.probes = qa_probe_prompts(model);
    init.encoder_prefix = {init.probes[0][0]};  // the prompt's first token
  }
  Plugin plugin = model.plugin() ? *model.plugin() : Plugin::fresh(model.decoder(), init);
  if (!cache_dtype.empty()) plugin.set_cache_dtype(cache_dtype);
  TrainData examples(model, data);
  fmt::print(stderr, "[train] {} QA items ({} held out), kv share {}, needle share {}; {} steps of {} x {} examples; "
             "plug-in: {} encoder layers, cross blocks before [{}]\n", examples.n_items(), examples.n_held_out(),
             data.kv_share, data.needle_share, o.steps, o.accumulation, o.batch_size,
             plugin.config().n_encoder_layers(), fmt::join(plugin.config().cross_layers, ", "));
  const bool tty = ::isatty(fileno(stderr));
  o.on_progress = [&](const TrainProgress& p) {
    const std::string reading =
        std::isnan(p.ce_swapped) ? "" : fmt::format(" ce {:.3f} (documents swapped {:.3f})", p.ce, p.ce_swapped);
    fmt::print(stderr, "{}[train] step {}/{} loss {:.4f}{} lr {:.2e} |g| {:.3f} {:.1f}k tok/s gates {:.3f}/{:.3f} "
               "elapsed {} eta {}{}", tty ? "\r" : "", p.step, p.steps, p.loss, reading, p.lr, p.grad_norm,
               p.tokens_per_s / 1e3, p.attn_gate, p.mlp_gate, clock_text(p.elapsed_s), clock_text(p.eta_s),
               tty ? "   " : "\n");
  };
  if (!dev_items.empty())
    o.dev_check = [&](const Plugin& p) {
      std::shared_ptr<const Plugin> before = model.plugin() ? std::make_shared<const Plugin>(*model.plugin()) : nullptr;
      model.set_plugin(std::make_shared<const Plugin>(p));
      PicEngine engine(model, Method::comb);  // its own store: nothing cached from the weights before
      GenerateOptions gen;
      gen.max_tokens = dev_tokens;
      int64_t right = 0;
      for (size_t i = 0; i < dev_items.size(); ++i) {
        const QaItem& item = dev_items[i];
        right += answer_correct(engine.generate(qa_request(model, item.documents, item.question), gen).text, item.answers);
        if (tty) fmt::print(stderr, "\r[train] dev check: {}/{} items, {} right", i + 1, dev_items.size(), right);
      }
      fmt::print(stderr, "{}[train] dev check: {} of {} items right ({:.1f}%)\n", tty ? "\r" : "", right,
                 dev_items.size(), 100.0 * double(right) / double(dev_items.size()));
      model.set_plugin(before);
      return DevCheck{double(right) / double(dev_items.size()), static_cast<int64_t>(dev_items.size())};
    };
  TrainResult r = train_plugin(model, plugin, examples, o);
  if (tty) fmt::print(stderr, "\n");
  plugin.save(out, out_dtype);
  std::cout << nlohmann::json{{"out", out},      {"dir", o.dir},           {"steps", r.steps},
                              {"resumed_from", r.resumed_from}, {"loss", r.last_loss}, {"seconds", r.seconds},
                              {"teacher_computed", r.teacher_computed}, {"teacher_reused", r.teacher_reused},
                              {"dev_accuracy", std::isnan(r.dev_accuracy) ? nlohmann::json() : nlohmann::json(r.dev_accuracy)}}
                   .dump()
            << std::endl;
  return 0;
}

}  // namespace comb::cli
