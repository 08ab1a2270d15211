// Training: the differentiable forward equals the inference path; a run lowers its loss, holds
// items out, and a resumed run ends exactly where an uninterrupted one does.
#include <catch2/catch.hpp>
#include <c10/core/GradMode.h>

#include <filesystem>
#include <fstream>

#include "helpers.hpp"

using namespace comb;
using namespace comb::test;
namespace fs = std::filesystem;

namespace {

std::vector<int32_t> random_tokens(std::mt19937& rng, int64_t n) {
  std::vector<int32_t> t(n);
  for (auto& x : t) x = 1000 + rng() % 40000;
  return t;
}

// Examples with random tokens: 1 to 3 documents of different lengths each.
std::vector<TrainExample> random_examples(int64_t n, uint64_t seed) {
  std::mt19937 rng(seed);
  std::vector<TrainExample> out(n);
  for (auto& e : out) {
    int64_t n_docs = 1 + rng() % 3;
    for (int64_t d = 0; d < n_docs; ++d)
      e.documents.push_back(std::make_shared<const std::vector<int32_t>>(random_tokens(rng, 5 + rng() % 20)));
    e.prefix = random_tokens(rng, 6);
    e.suffix = random_tokens(rng, 3 + rng() % 9);
    e.answer = random_tokens(rng, 1 + rng() % 5);
  }
  return out;
}

std::string write_items(const std::string& dir) {
  std::string path = dir + "/items.jsonl";
  std::ofstream f(path);
  const char* cities[] = {"Paris", "Lima", "Oslo", "Quito", "Hanoi"};
  for (int i = 0; i < 5; ++i) {
    nlohmann::json docs = nlohmann::json::array();
    for (int d = 0; d < 3; ++d)
      docs.push_back({{"title", fmt::format("Place {}", d)},
                      {"text", d == 1 ? fmt::format("The meeting number {} takes place in {}.", i, cities[i])
                                      : fmt::format("Filler text {} about nothing in particular, number {}.", d, i)}});
    f << nlohmann::json{{"id", fmt::format("item-{}", i)},
                        {"question", fmt::format("Where does meeting number {} take place?", i)},
                        {"answers", {cities[i]}},
                        {"documents", docs},
                        {"gold_index", 1}}
                .dump()
      << "\n";
  }
  return path;
}

// Training data of the items write_items puts in dir alone (no generated lookups or needles), at
// most 3 documents linked per example.
TrainDataOptions items_only(const std::string& dir) {
  TrainDataOptions d;
  d.files = {write_items(dir)};
  d.kv_share = 0;
  d.needle_share = 0;
  d.max_documents = 3;
  return d;
}

std::vector<at::Tensor> weights_of(Plugin& p) {
  std::vector<at::Tensor> out;
  for (auto& [name, t] : plugin_parameters(p.config(), p.mutable_weights())) out.push_back(t->detach().clone());
  return out;
}

}  // namespace

namespace {
// A plug-in of the layout that reads from the start (encoder of the base's layers, sinks, RoPE
// from the document's end, an encoder prefix token), with its weights moved off their start.
std::shared_ptr<Plugin> reads_plugin(const Decoder& base, bool joint = false, bool after_prefix = false) {
  PluginInitOptions init;
  init.reads = true;
  init.joint_attention = joint;
  init.documents_after_prefix = after_prefix;
  init.cross_layers = {1, 2};
  init.encoder_prefix = {7};
  std::mt19937 rng(4);
  for (int i = 0; i < 3; ++i) init.probes.push_back(random_tokens(rng, 12 + i));
  auto plugin = std::make_shared<Plugin>(Plugin::fresh(base, init));
  auto gen = at::detail::createCPUGenerator(5);
  for (auto& b : plugin->mutable_weights().cross)
    if (joint)
      b.doc_bias.add_(at::randn(b.doc_bias.sizes(), gen));
    else
      b.wq.add_(at::randn(b.wq.sizes(), gen) * 0.05);
  for (auto& wk : plugin->mutable_weights().wk) wk.add_(at::randn(wk.sizes(), gen) * 0.05);
  plugin->refresh_fingerprint();
  return plugin;
}
}  // namespace

TEST_CASE("the training forward equals the inference path, document by document", "[train]") {
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  const int layout = GENERATE(0, 1, 2, 3);
  INFO((layout == 0   ? "reference layout"
        : layout == 1 ? "layout that reads from the start"
        : layout == 2 ? "joint blocks"
                      : "joint blocks, documents after the prefix"));
  auto plugin = layout == 0 ? random_plugin(model.decoder(), 2, 3)
                            : reads_plugin(model.decoder(), layout >= 2, layout == 3);
  model.set_plugin(plugin);
  auto examples = random_examples(4, 11);
  TrainBatch batch = make_train_batch(examples, c10::kCPU);
  at::Tensor got;
  {
    c10::AutoGradMode no_grad(false);
    got = plugin_train_logits(model.decoder(), *plugin, plugin->weights(), batch);
  }
  c10::InferenceMode guard;
  std::vector<at::Tensor> want;
  int64_t n_keys = 0;  // the most keys a row reads: its documents' and its own
  for (const auto& e : examples) {
    int64_t keys = static_cast<int64_t>(e.prefix.size() + e.suffix.size() + e.answer.size());
    for (const auto& d : e.documents) keys += static_cast<int64_t>(d->size());
    n_keys = std::max(n_keys, keys);
    std::vector<std::shared_ptr<const DocumentKV>> docs;
    for (const auto& d : e.documents) docs.push_back(Documents(model).get(*d));
    LinkedDocuments linked = Linker(c10::kCPU).link(docs);
    if (layout == 3) linked.anchor = static_cast<int64_t>(e.prefix.size());
    std::vector<int32_t> seq = e.prefix;
    seq.insert(seq.end(), e.suffix.begin(), e.suffix.end());
    const int64_t at = seq.size();
    seq.insert(seq.end(), e.answer.begin(), e.answer.end());
    KVCache cache = model.decoder().make_cache(1, seq.size());
    at::Tensor logits = model.forward(ids_tensor(seq), cache, &linked, LogitsMode::all)[0];
    want.push_back(logits.narrow(0, at - 1, e.answer.size()));
  }
  at::Tensor w = at::cat(want, 0);
  REQUIRE(got.sizes() == w.sizes());
  double diff = (got - w).abs().max().item<double>();
  INFO("max |training - inference| = " << diff);
  CHECK(diff <= logits_bound(model, n_keys, w));  // generic ops against the inference kernels (helpers.hpp)
}

TEST_CASE("training encodes its documents as inference does: encode_many's numbers exactly, and within rounding of "
          "the generic padded batch, gradients included",
          "[train]") {
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  const Decoder& base = model.decoder();
  const ModelConfig& c = base.config();
  auto plugin = reads_plugin(base, /*joint=*/true, /*after_prefix=*/true);
  REQUIRE(plugin->config().kv_norm);  // the gradient's scale below relies on the states normed
  REQUIRE(train_encodes_as_inference(base, *plugin, plugin->weights()));
  auto examples = random_examples(6, 23);
  TrainBatch batch = make_train_batch(examples, c10::kCPU);
  const auto n_docs = static_cast<int64_t>(batch.documents.size());
  const int64_t n_blocks = plugin->config().n_blocks();
  int64_t longest = 0, total = 0;
  for (int64_t len : batch.doc_lens) longest = std::max(longest, len), total += len;
  const int64_t n_keys = longest + static_cast<int64_t>(plugin->config().encoder_prefix.size());

  // Without gradients and with the plug-in's own weights: encode_many's K/V, bit for bit.
  {
    c10::InferenceMode guard;
    TrainDocumentKV got = train_document_kv(base, *plugin, plugin->weights(), batch, /*as_inference=*/true);
    std::vector<DocumentKV> want = plugin->encode_many(base, batch.documents);
    for (int64_t k = 0; k < n_blocks; ++k)
      for (int64_t d = 0; d < n_docs; ++d) {
        CHECK(got.keys[k][d].equal(want[d].keys[k]));
        CHECK(got.values[k][d].equal(want[d].values[k]));
      }
  }

  // With gradients, against the generic padded batch (Plugin::encode_batch): the same computation
  // by other kernels, so within rounding, forward and backward.
  auto trainable = [&] {
    PluginWeights w = plugin->weights();
    for (auto* list : {&w.wk, &w.wv, &w.kv_norm})
      for (auto& t : *list) t = t.detach().clone().requires_grad_();
    return w;
  };
  PluginWeights wa = trainable(), wb = trainable();
  TrainDocumentKV a = train_document_kv(base, *plugin, wa, batch, true);
  TrainDocumentKV b = train_document_kv(base, *plugin, wb, batch, false);
  auto gen = at::detail::createCPUGenerator(41);
  at::Tensor la = at::zeros({}), lb = at::zeros({});
  double probe_max = 0;
  for (int64_t k = 0; k < n_blocks; ++k) {
    // K at block k: the states after read_depth(k) layers, then the norm and projection and the
    // rotation (two layers more).
    const int64_t layers = plugin->config().read_depth(k) + 2;
    for (int64_t d = 0; d < n_docs; ++d) {
      INFO("block " << k << ", document " << d);
      REQUIRE(a.keys[k][d].sizes() == b.keys[k][d].sizes());
      REQUIRE(a.values[k][d].sizes() == b.values[k][d].sizes());
      CHECK(max_diff(a.keys[k][d], b.keys[k][d]) <= path_bound(c, layers, n_keys, magnitude(b.keys[k][d])));
      CHECK(max_diff(a.values[k][d], b.values[k][d]) <= path_bound(c, layers, n_keys, magnitude(b.values[k][d])));
      at::Tensor rk = at::randn(b.keys[k][d].sizes(), gen), rv = at::randn(b.values[k][d].sizes(), gen);
      probe_max = std::max({probe_max, magnitude(rk), magnitude(rv)});
      la = la + (a.keys[k][d] * rk).sum() + (a.values[k][d] * rv).sum();
      lb = lb + (b.keys[k][d] * rk).sum() + (b.values[k][d] * rv).sum();
    }
  }
  la.backward();
  lb.backward();
  // A projection's gradient sums, over the batch's `total` tokens, a probe (<= probe_max) times a
  // normed state (each element <= sqrt(n_embd) times the norm's largest weight; the rotation keeps
  // a pair's length): that worst-case sum is the scale the two paths' difference is bounded by,
  // through the states' layers, the projection, the rotation and the sum (one layer more).
  for (int64_t k = 0; k < n_blocks; ++k) {
    INFO("block " << k);
    const int64_t layers = plugin->config().read_depth(k) + 3;
    const double states = std::sqrt(static_cast<double>(c.n_embd)) * magnitude(wb.kv_norm[k]);
    const double scale = static_cast<double>(total) * probe_max * std::sqrt(2.0) * states;
    const int64_t k_sum = std::max(longest_sum(c, n_keys), total);
    for (auto [ga, gb] : {std::pair{wa.wk[k].grad(), wb.wk[k].grad()}, std::pair{wa.wv[k].grad(), wb.wv[k].grad()}}) {
      REQUIRE(ga.defined());
      REQUIRE(gb.defined());
      const double bound = layers_bound(layers, k_sum, scale);
      CHECK(bound < 0.05 * magnitude(gb));  // the check can tell a wrong gradient from rounding
      CHECK(max_diff(ga, gb) <= bound);
    }
    CHECK(max_diff(wa.kv_norm[k].grad(), wb.kv_norm[k].grad()) <=
          layers_bound(layers + 1, k_sum, scale * magnitude(plugin->weights().wk[k]) * c.n_embd));
  }
}

TEST_CASE("training can read documents as a cache dtype keeps them: the stored numbers forward, straight through "
          "backward",
          "[train]") {
  auto gen = at::detail::createCPUGenerator(31);
  at::Tensor k = (at::randn({2, 40, 16}, gen) * 3).requires_grad_(), v = at::randn({2, 40, 16}, gen).requires_grad_();
  at::Tensor wk = at::randn({2, 40, 16}, gen), wv = at::randn({2, 40, 16}, gen);
  for (const c10::ScalarType form : {kCacheInt4, at::kChar, at::kBFloat16}) {
    INFO(cache_dtype_name(form));
    auto [kq, vq] = read_as_stored(k, v, form);
    DocumentKV one;
    one.n_tokens = 40;
    one.keys = {k.detach()};
    one.values = {v.detach()};
    const DocumentKV stored = one.to(at::kCPU, form).to(at::kCPU, at::kFloat);
    CHECK(kq.detach().equal(stored.keys[0]));
    CHECK(vq.detach().equal(stored.values[0]));
    CHECK_FALSE(kq.detach().equal(k.detach()));  // it did round
    k.mutable_grad() = at::Tensor();
    v.mutable_grad() = at::Tensor();
    ((kq * wk).sum() + (vq * wv).sum()).backward();
    CHECK(k.grad().equal(wk));
    CHECK(v.grad().equal(wv));
  }
  // Through the whole training forward: logits differ from the float path's, and every trained
  // tensor that the documents reach still gets a gradient.
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  auto plugin = reads_plugin(model.decoder(), true, true);
  TrainBatch batch = make_train_batch(random_examples(3, 12), c10::kCPU);
  PluginWeights w = plugin->weights();
  REQUIRE_FALSE(w.wk.empty());
  for (auto& wk_b : w.wk) wk_b.requires_grad_();
  at::Tensor as_computed = plugin_train_logits(model.decoder(), *plugin, w, batch);
  at::Tensor as_int4 = plugin_train_logits(model.decoder(), *plugin, w, batch, kCacheInt4);
  CHECK(as_int4.sizes() == as_computed.sizes());
  CHECK((as_int4 - as_computed).abs().max().item<double>() > 0);
  at::cross_entropy_loss(as_int4, batch.targets).backward();
  for (const auto& wk_b : w.wk) {
    REQUIRE(wk_b.grad().defined());
    CHECK(wk_b.grad().abs().sum().item<double>() > 0);
    CHECK(wk_b.grad().isfinite().all().item<bool>());
  }
}

TEST_CASE("training lowers the loss, holds items out, and resumes exactly", "[train]") {
  const Model& model = default_model();
  std::string dir = temp_dir("comb-train");
  TrainDataOptions d = items_only(dir);
  d.holdout = {{d.files[0], 1}};
  TrainData data(model, d);
  CHECK(data.n_items() == 4);
  CHECK(data.n_held_out() == 1);
  // Every example comes from the 4 kept items, with the answer's document linked.
  std::mt19937_64 rng(7);
  for (int i = 0; i < 20; ++i) {
    TrainExample e = data.sample(rng);
    std::string q = model.tokenizer().decode(e.suffix);
    CHECK(q.find("meeting number 0 ") == std::string::npos);
    bool has_gold = false;
    for (const auto& doc : e.documents)
      has_gold |= model.tokenizer().decode(*doc).find("takes place in") != std::string::npos;
    CHECK(has_gold);
  }

  PluginInitOptions init;
  init.n_encoder_layers = 1;
  TrainOptions o;
  o.steps = 6;
  o.batch_size = 2;
  o.lr = 2e-3;
  o.warmup_steps = 1;
  o.log_every = 1;
  o.save_every = 3;
  o.seed = 5;

  // The loss on a fixed batch before and after.
  std::mt19937_64 fixed(99);
  std::vector<TrainExample> probe;
  for (int i = 0; i < 4; ++i) probe.push_back(data.sample(fixed));
  TrainBatch probe_batch = make_train_batch(probe, c10::kCPU);
  auto probe_loss = [&](const Plugin& p) {
    c10::AutoGradMode no_grad(false);
    return at::cross_entropy_loss(plugin_train_logits(model.decoder(), p, p.weights(), probe_batch),
                                  probe_batch.targets).item<double>();
  };

  Plugin whole = Plugin::fresh(model.decoder(), init);
  const double before = probe_loss(whole);
  o.dir = dir + "/whole";
  TrainResult r = train_plugin(model, whole, data, o);
  CHECK(r.steps == 6);
  const double after = probe_loss(whole);
  INFO("probe loss " << before << " -> " << after);
  CHECK(after < before);
  CHECK(fs::exists(o.dir + "/checkpoint.safetensors"));

  // Interrupted after step 4 (last checkpoint at 3), then resumed: the same weights at the end.
  Plugin part = Plugin::fresh(model.decoder(), init);
  o.dir = dir + "/resumed";
  o.on_progress = [](const TrainProgress& p) {
    if (p.step == 4) throw std::runtime_error("interrupted");
  };
  CHECK_THROWS_WITH(train_plugin(model, part, data, o), "interrupted");
  o.on_progress = nullptr;
  Plugin resumed = Plugin::fresh(model.decoder(), init);
  TrainResult r2 = train_plugin(model, resumed, data, o);
  CHECK(r2.resumed_from == 3);
  CHECK(r2.steps == 6);
  auto a = weights_of(whole), b = weights_of(resumed);
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  INFO("max |uninterrupted - resumed| = " << worst);
  // The same steps on the same numbers (the checkpoint holds the weights and the optimiser's state
  // as they were), by the same kernels in one process: exactly.
  CHECK(worst == 0);
  // The loss log holds each step once.
  std::ifstream csv(o.dir + "/loss.csv");
  std::vector<int64_t> steps;
  std::string line;
  std::getline(csv, line);
  while (std::getline(csv, line)) steps.push_back(std::stoll(line.substr(0, line.find(','))));
  CHECK(steps == std::vector<int64_t>{1, 2, 3, 4, 5, 6});
  // The saved plug-in loads as one for this base.
  Plugin::load(o.dir + "/checkpoint.safetensors", model.decoder());
}

TEST_CASE("a dev check along the run scores a detached copy of the plug-in and is logged per step", "[train]") {
  const Model& model = default_model();
  std::string dir = temp_dir("comb-train-dev");
  TrainDataOptions d = items_only(dir);
  TrainData data(model, d);
  PluginInitOptions init;
  init.n_encoder_layers = 1;
  TrainOptions o;
  o.steps = 3;
  o.batch_size = 1;
  o.lr = 2e-3;
  o.warmup_steps = 1;
  o.log_every = 1;
  o.save_every = 1;
  o.dir = dir + "/run";
  o.dev_every = 2;
  std::vector<double> probes;  // one weight's sum at each check: training moves it
  bool any_grad = false;
  o.dev_check = [&](const Plugin& p) {
    double sum = 0;
    for (auto& [name, t] : plugin_parameters(p.config(), const_cast<PluginWeights&>(p.weights()))) {
      any_grad |= t->requires_grad();
      sum += t->to(at::kDouble).sum().item<double>();
    }
    probes.push_back(sum);
    return DevCheck{0.25 * double(probes.size()), 4};
  };
  Plugin plugin = Plugin::fresh(model.decoder(), init);
  TrainResult r = train_plugin(model, plugin, data, o);
  CHECK_FALSE(any_grad);
  REQUIRE(probes.size() == 2);  // steps 2 and 3 (the last)
  CHECK(probes[0] != probes[1]);
  CHECK(r.dev_accuracy == 0.5);
  auto rows = [&] {
    std::ifstream csv(o.dir + "/dev.csv");
    std::vector<std::string> out;
    std::string line;
    std::getline(csv, line);
    CHECK(line == "step,accuracy,items,seconds");
    while (std::getline(csv, line)) out.push_back(line.substr(0, line.find(',', line.find(',') + 1)));
    return out;
  };
  CHECK(rows() == std::vector<std::string>{"2,0.25000", "3,0.50000"});
  // Resumed at step 3 for two more steps: the rows so far kept, then steps 4 and 5.
  o.steps = 5;
  probes.clear();
  Plugin again = Plugin::fresh(model.decoder(), init);
  TrainResult r2 = train_plugin(model, again, data, o);
  CHECK(r2.resumed_from == 3);
  CHECK(rows() == std::vector<std::string>{"2,0.25000", "3,0.50000", "4,0.25000", "5,0.50000"});
  // The live plug-in still trains: its weights take gradients until the run ends, then are detached.
  for (auto& [name, t] : plugin_parameters(again.config(), again.mutable_weights())) CHECK_FALSE(t->requires_grad());
}

TEST_CASE("training input errors are clear", "[train][errors]") {
  const Model& model = default_model();
  TrainDataOptions none;
  none.kv_share = 0;
  none.needle_share = 0;
  CHECK_THROWS_WITH(TrainData(model, none), Catch::Contains("no training examples"));
  TrainDataOptions bad;
  bad.min_documents = 3;
  bad.max_documents = 2;
  CHECK_THROWS_WITH(TrainData(model, bad), Catch::Contains("min (3) <= max (2)"));
  CHECK_THROWS_WITH(make_train_batch({}, c10::kCPU), Catch::Contains("at least one example"));
  TrainDataOptions missing;
  missing.files = {"/nonexistent/items.jsonl"};
  CHECK_THROWS_WITH(TrainData(model, missing), Catch::Contains("/nonexistent/items.jsonl"));
}

TEST_CASE("top-k KL is the KL over the teacher's top tokens and the rest as one bucket", "[train][teacher]") {
  auto gen = at::detail::createCPUGenerator(3);
  at::Tensor teacher = at::randn({5, 40}, gen) * 2, student = at::randn({5, 40}, gen) * 2;
  at::Tensor lp = at::log_softmax(teacher, -1);
  // k = the whole vocabulary: the exact KL (the rest bucket is empty).
  auto [all_lp, all_ids] = lp.topk(40, -1);
  at::Tensor exact = at::kl_div(at::log_softmax(student, -1), lp, at::Reduction::None, true).sum(-1).mean();
  CHECK(top_k_kl(student, all_ids, all_lp).item<double>() == Approx(exact.item<double>()).epsilon(1e-5));
  // k = 4: written out per row, the rest of the vocabulary as one bucket.
  auto [lp4, ids4] = lp.topk(4, -1);
  at::Tensor lq = at::log_softmax(student, -1);
  double want = 0;
  for (int64_t r = 0; r < 5; ++r) {
    double p_top = 0, q_top = 0, row = 0;
    for (int64_t j = 0; j < 4; ++j) {
      double p = std::exp(lp4[r][j].item<double>()), q = std::exp(lq[r][ids4[r][j].item<int64_t>()].item<double>());
      row += p * (std::log(p) - std::log(q));
      p_top += p;
      q_top += q;
    }
    row += (1 - p_top) * (std::log(1 - p_top) - std::log(1 - q_top));
    want += row / 5;
  }
  CHECK(top_k_kl(student, ids4, lp4).item<double>() == Approx(want).epsilon(1e-4));
  // A student equal to the teacher: 0; a gradient reaches the student's logits.
  // Both sides are the same log-softmax of the same logits: every term and the bucket are 0 exactly.
  CHECK(top_k_kl(teacher, ids4, lp4).item<double>() == 0);
  at::Tensor s = student.clone().requires_grad_(true);
  top_k_kl(s, ids4, lp4).backward();
  CHECK(s.grad().abs().sum().item<double>() > 0);
  CHECK_THROWS_WITH(top_k_kl(student, ids4, lp4.narrow(1, 0, 3)), Catch::Contains("expected logits [m, vocab]"));
}

TEST_CASE("teacher answers: the decoder's own full-context answer, kept in a file and reused", "[train][teacher]") {
  const Model& model = default_model();
  std::string dir = temp_dir("comb-teacher");
  TrainDataOptions d = items_only(dir);
  TrainData data(model, d);
  std::mt19937_64 rng(11);
  TrainExample e = data.sample(rng);

  TeacherAnswer t = teacher_answer(model, e, 12, 5);
  // The greedy answer of the bare decoder with prefix, documents and suffix as one prompt.
  std::vector<int32_t> prompt = e.prefix;
  for (const auto& doc : e.documents) prompt.insert(prompt.end(), doc->begin(), doc->end());
  prompt.insert(prompt.end(), e.suffix.begin(), e.suffix.end());
  GenerateOptions g;
  g.max_tokens = 12;
  GenerationResult r = model.generate(prompt, g);
  REQUIRE(t.answer.size() >= r.tokens.size());
  CHECK(std::vector<int32_t>(t.answer.begin(), t.answer.begin() + r.tokens.size()) == r.tokens);
  CHECK(t.answer.size() == r.tokens.size() + (r.stop_reason == "stop_token" ? 1 : 0));
  REQUIRE(t.top_ids.size() == t.answer.size());
  for (size_t j = 0; j < t.answer.size(); ++j) {
    REQUIRE(t.top_ids[j].size() == 5);
    // Sorted, and the greedy token is among the top (first, up to ties).
    for (int k = 0; k + 1 < 5; ++k) CHECK(t.top_logprobs[j][k] >= t.top_logprobs[j][k + 1]);
    CHECK(std::find(t.top_ids[j].begin(), t.top_ids[j].end(), t.answer[j]) != t.top_ids[j].end());
    CHECK(t.top_logprobs[j][0] <= 0);
  }

  // Several examples at once (one forward per answer token over all of them, no cache): the
  // answers and top-k of one example at a time, up to rounding.
  std::vector<TrainExample> several = {e};
  for (int i = 0; i < 3; ++i) several.push_back(data.sample(rng));
  std::vector<TeacherAnswer> together = teacher_answers(model, several, 12, 5);
  // The logits the log-probabilities come from, one forward of each full prompt: their scale.
  double logprob_margin = 0;
  for (const TrainExample& x : several) {
    c10::InferenceMode guard;
    std::vector<int32_t> full = x.prefix;
    for (const auto& doc : x.documents) full.insert(full.end(), doc->begin(), doc->end());
    full.insert(full.end(), x.suffix.begin(), x.suffix.end());
    KVCache c = model.decoder().make_cache(1, static_cast<int64_t>(full.size()));
    at::Tensor logits = model.decoder().forward(ids_tensor(full), c, LogitsMode::all)[0];
    logprob_margin = std::max(logprob_margin, 2 * logits_bound(model, static_cast<int64_t>(full.size()) + 12, logits));
  }
  REQUIRE(together.size() == several.size());
  for (size_t i = 0; i < several.size(); ++i) {
    TeacherAnswer alone = i == 0 ? t : teacher_answer(model, several[i], 12, 5);
    CHECK(together[i].answer == alone.answer);
    REQUIRE(together[i].top_ids.size() == alone.answer.size());
    for (size_t j = 0; j < alone.answer.size(); ++j) {
      CHECK(together[i].top_ids[j][0] == alone.top_ids[j][0]);
      // Two paths to the logits (padded rows, other blockings), each within helpers.hpp's
      // logits_bound (taken at the largest logit a log-probability can come from, below the
      // answer's length in keys), which moves a log-softmax by at most twice that.
      CHECK(together[i].top_logprobs[j][0] == Approx(alone.top_logprobs[j][0]).margin(logprob_margin));
    }
  }
  CHECK(teacher_answers(model, {}, 12, 5).empty());

  // The file: written, read back, refused for other settings, a cut-short last line dropped.
  const std::string path = dir + "/teacher.jsonl";
  const std::string base = base_fingerprint(model.decoder());
  const std::string key = TeacherCache::key(e);
  {
    TeacherCache c(path, base, 12, 5);
    CHECK(c.size() == 0);
    CHECK(c.find(key) == nullptr);
    c.add(key, t);
  }
  {
    TeacherCache c(path, base, 12, 5);
    REQUIRE(c.find(key) != nullptr);
    CHECK(c.find(key)->answer == t.answer);
    CHECK(c.find(key)->top_ids == t.top_ids);
    CHECK(c.find(key)->top_logprobs == t.top_logprobs);
  }
  CHECK_THROWS_WITH(TeacherCache(path, base, 12, 6), Catch::Contains("with top_k 5, this run needs 6"));
  CHECK_THROWS_WITH(TeacherCache(path, "another", 12, 5), Catch::Contains("base"));
  // Another example (other documents or order) has another key.
  TrainExample other = e;
  std::reverse(other.documents.begin(), other.documents.end());
  if (other.documents.size() > 1) CHECK(TeacherCache::key(other) != key);
  {
    std::ofstream f(path, std::ios::app);
    f << "{\"key\":\"abc\",\"answer\":[1,2";  // an interrupted write
  }
  {
    TeacherCache c(path, base, 12, 5);
    CHECK(c.size() == 1);
  }
  {
    std::ofstream f(path, std::ios::app);
    f << "not json\n{\"key\":\"k\",\"answer\":[],\"top_ids\":[],\"top_logprobs\":[]}\n";
  }
  CHECK_THROWS_WITH(TeacherCache(path, base, 12, 5), Catch::Contains("teacher.jsonl' line 3: not a JSON object"));

  // Training on teacher targets: computed once, reused by a second run over the same examples.
  PluginInitOptions init;
  init.n_encoder_layers = 1;
  TrainOptions o;
  o.steps = 1;
  o.batch_size = 2;
  o.targets = "teacher";
  o.teacher_tokens = 6;
  o.teacher_top_k = 4;
  o.kl_weight = 1;
  o.teacher_file = dir + "/shared-teacher.jsonl";
  o.dir = dir + "/run1";
  Plugin p1 = Plugin::fresh(model.decoder(), init);
  TrainResult r1 = train_plugin(model, p1, data, o);
  CHECK(r1.teacher_computed == 2);
  CHECK(r1.teacher_reused == 0);
  std::ifstream csv(o.dir + "/loss.csv");
  std::string header, row;
  std::getline(csv, header);
  std::getline(csv, row);
  CHECK(std::isfinite(std::stod(row.substr(row.find(',') + 1))));
  // Without the reading check the swapped column is nan.
  CHECK(header.substr(header.rfind(',') + 1) == "ce_swapped");
  CHECK(row.substr(row.rfind(',') + 1) == "nan");

  // The same run with the batch's answers computed together (teacher_answers): a fresh file gets
  // the same two answers, and a second run reuses them.
  o.teacher_batched = 1;
  o.teacher_file = dir + "/batched-teacher.jsonl";
  o.dir = dir + "/run-batched";
  Plugin p3 = Plugin::fresh(model.decoder(), init);
  TrainResult r3 = train_plugin(model, p3, data, o);
  CHECK(r3.teacher_computed == 2);
  CHECK(r3.teacher_reused == 0);
  o.dir = dir + "/run-batched-again";
  Plugin p4 = Plugin::fresh(model.decoder(), init);
  TrainResult r4 = train_plugin(model, p4, data, o);
  CHECK(r4.teacher_computed == 0);
  CHECK(r4.teacher_reused == 2);
  o.teacher_batched = -1;
  o.dir = dir + "/run2";
  Plugin p2 = Plugin::fresh(model.decoder(), init);
  TrainResult r2 = train_plugin(model, p2, data, o);
  CHECK(r2.teacher_computed == 0);
  CHECK(r2.teacher_reused == 2);
  {
    // The reading check: the same batch with its examples' documents swapped, scored beside ce.
    o.dir = dir + "/run3";
    o.reading_check = true;
    Plugin p3 = Plugin::fresh(model.decoder(), init);
    train_plugin(model, p3, data, o);
    std::ifstream log3(o.dir + "/loss.csv");
    std::string h3, r3;
    std::getline(log3, h3);
    std::getline(log3, r3);
    const double swapped = std::stod(r3.substr(r3.rfind(',') + 1));
    // ce is the third column; a fresh plug-in's gates are closed, so it reads nothing and the same
    // targets score the same with any documents.
    size_t c1 = r3.find(','), c2 = r3.find(',', c1 + 1), c3 = r3.find(',', c2 + 1);
    const double ce = std::stod(r3.substr(c2 + 1, c3 - c2 - 1));
    CHECK(std::isfinite(swapped));
    CHECK(swapped == Approx(ce).epsilon(1e-4));
    o.reading_check = false;
  }
  o.targets = "silver";
  CHECK_THROWS_WITH(train_plugin(model, p2, data, o), Catch::Contains("targets must be gold"));
}
