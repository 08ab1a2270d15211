// The COMB plug-in: identity when off or fresh, order invariance, caches equal fresh encodings,
// checkpoints, the custom op, and bad input.
#include <catch2/catch.hpp>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <algorithm>
#include <filesystem>
#include <functional>
#include <numeric>

#include "helpers.hpp"

using namespace comb;
using namespace comb::test;
namespace fs = std::filesystem;

namespace {

const Model& tiny_model() {
  static const Model model = Model::load(oracle_dir() + "/tiny-llama");
  return model;
}

std::vector<std::vector<int32_t>> sample_documents(int64_t n, int64_t len, uint64_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> docs(n);
  for (auto& d : docs) {
    d.resize(len + rng() % 7);
    for (auto& t : d) t = 1000 + rng() % 40000;
  }
  return docs;
}

// Each document through `model` (and `store`, if given), in order.
std::vector<std::shared_ptr<const DocumentKV>> documents_of(const Model& model,
                                                            const std::vector<std::vector<int32_t>>& tokens,
                                                            PICacheStore* store = nullptr) {
  std::vector<std::shared_ptr<const DocumentKV>> out;
  for (const auto& d : tokens) out.push_back(documents_in(model, store).get(d));
  return out;
}

// Keys a prompt of n tokens reads with `docs` linked: its own and every linked document's (the
// longest sum of a bound, helpers.hpp).
int64_t keys_read(int64_t n, const LinkedDocuments* docs = nullptr) {
  if (docs)
    for (const auto& d : docs->held) n += d->n_tokens;
  return n;
}

// Two float32 paths to `want`, the logits of `model` for a prompt of n tokens that reads `docs`
// (helpers.hpp's logits_bound: the decoder's layers, the plug-in's encoder layers, the head).
double bound(const Model& model, int64_t n, const LinkedDocuments* docs, const at::Tensor& want) {
  return logits_bound(model, keys_read(n, docs), want);
}

at::Tensor logits_with(const Model& model, const at::Tensor& ids, const LinkedDocuments* docs) {
  KVCache cache = model.decoder().make_cache(ids.size(0), ids.size(1));
  return model.forward(ids, cache, docs, LogitsMode::all);
}

// Calls f(linked, k) with `docs` linked in each of their orders (k: 0, 1, ...); returns how many.
int for_each_order(const std::vector<std::shared_ptr<const DocumentKV>>& docs, const Linker& linker,
                   const std::function<void(const LinkedDocuments&, int)>& f, int64_t anchor = 0) {
  std::vector<size_t> order(docs.size());
  std::iota(order.begin(), order.end(), 0);
  int k = 0;
  do {
    std::vector<std::shared_ptr<const DocumentKV>> permuted;
    for (size_t i : order) permuted.push_back(docs[i]);
    LinkedDocuments linked = linker.link(permuted);
    linked.anchor = anchor;
    f(linked, k++);
  } while (std::next_permutation(order.begin(), order.end()));
  return k;
}

// Where a QA prompt's documents end for `model`'s plug-in: after the instruction prefix when it
// reads them there (documents_after_prefix), else before the prompt.
int64_t qa_anchor(const Model& model) {
  return model.plugin()->config().documents_after_prefix ? static_cast<int64_t>(qa_prefix(model).size()) : 0;
}

at::Tensor prompt_ids(int64_t n, uint64_t seed = 5) {
  return at::randint(1000, 40000, {1, n}, at::detail::createCPUGenerator(seed), at::kLong);
}

// Without documents (none linked, or an empty link) `with` gives the bare decoder's logits and
// greedy tokens bit for bit.
void check_off_is_bare(const Model& with, const Model& bare) {
  SafetensorsFile ref(oracle_dir() + "/decoder_reference.safetensors");
  at::Tensor ids = ref.load("p3.ids", at::kLong).unsqueeze(0);
  CHECK(logits_with(with, ids, nullptr).equal(logits_with(bare, ids, nullptr)));
  LinkedDocuments none;
  CHECK(logits_with(with, ids, &none).equal(logits_with(bare, ids, nullptr)));
  GenerateOptions options;
  options.max_tokens = 24;
  auto prompt = bare.chat_prompt("Name three colors.");
  CHECK(with.generate(prompt, options).tokens == bare.generate(prompt, options).tokens);
}

}  // namespace

TEST_CASE("documents off: the model with a plug-in is bit-identical to the bare decoder", "[plugin]") {
  c10::InferenceMode guard;
  const Model& bare = default_model();
  Model with = Model::load(model_path());
  with.set_plugin(random_plugin(with.decoder(), 2));
  check_off_is_bare(with, bare);
}

// The trained plug-in the repository ships for the default model, as comb eval, qa and the demo use it.
TEST_CASE("the shipped plug-in: off is the bare decoder bit for bit; in any document order it answers from them",
          "[plugin][shipped]") {
  c10::InferenceMode guard;
  const std::string path = env_or("COMB_SHIPPED_PLUGIN", "examples/plugins/smollm2-135m-instruct.comb.safetensors");
  REQUIRE(fs::exists(path));
  const Model& bare = default_model();
  Options options;
  options.plugin = path;
  Model with = Model::load(model_path(), options);
  REQUIRE(with.plugin());

  // Documents off: no linked documents, or an empty link, is the bare decoder.
  check_off_is_bare(with, bare);
  GenerateOptions greedy;
  greedy.max_tokens = 40;

  // Three documents of examples/documents in each of their 6 orders, each cache computed once: the
  // answer holds the summit's height in every order. A plug-in whose documents all end where the
  // prompt begins (not consecutive_documents) gives the same answer in every order; one whose
  // documents lie in a row in the order linked reads them as a prompt would, order and all.
  const std::string dir = env_or("COMB_EXAMPLES", "examples") + "/documents/";
  std::vector<std::shared_ptr<const DocumentKV>> docs;
  for (const char* name : {"eiffel-tower", "mount-everest", "mariana-trench"}) {
    std::string text = read_bytes(dir + name + ".txt");
    docs.push_back(Documents(with).get(Documents::tokens(with, {name, text})));
  }
  std::vector<int32_t> prompt = qa_prefix(with);
  const auto suffix = qa_suffix(with, "How high is the summit of Mount Everest above sea level?");
  prompt.insert(prompt.end(), suffix.begin(), suffix.end());
  Linker linker(c10::kCPU);
  const bool order_free = !with.plugin()->config().consecutive_documents;
  std::vector<int32_t> first;
  at::Tensor first_logits;
  double worst = 0, worst_bound = 0;
  const int orders = for_each_order(docs, linker, [&](const LinkedDocuments& linked, int k) {
    auto answer = with.generate(prompt, greedy, &linked).tokens;
    const std::string text = with.tokenizer().decode(answer);
    INFO("order " << k << ": " << text);
    CHECK((text.find("8,849") != std::string::npos || text.find("8849") != std::string::npos));
    at::Tensor logits = logits_with(with, ids_tensor(prompt), &linked);
    if (k == 0) {
      first = answer, first_logits = logits;
      CHECK_FALSE(answer == bare.generate(prompt, greedy).tokens);  // the documents change the answer
    } else if (order_free) {
      CHECK(answer == first);
      worst = std::max(worst, (logits - first_logits).abs().max().item<double>());
      worst_bound = std::max(worst_bound, bound(with, static_cast<int64_t>(prompt.size()), &linked, first_logits));
    }
  }, qa_anchor(with));
  CHECK(orders == 6);
  INFO("worst |logit diff| over orders " << worst);
  CHECK(worst <= worst_bound);  // the same softmax over the documents in other orders

  // It reads: notes as `comb make-data --split test` writes them (words no training split holds),
  // the QA prompt as comb eval builds it. The bare decoder cannot know a word; the plug-in copies
  // it from the right note (7 of these 8 when this test was written; the held-back tables are in
  // docs/training.md).
  struct Note {
    std::vector<std::pair<std::string, std::string>> notes;  // name, word
    std::string who;
  };
  const std::vector<Note> items = {
      {{{"Sam", "kitten"}, {"David", "ribbon"}, {"Ben", "shadow"}}, "Sam"},
      {{{"Sam", "salmon"}}, "Sam"},
      {{{"Ben", "lantern"}, {"Rosa", "jungle"}}, "Ben"},
      {{{"Noah", "rocket"}, {"Grace", "pebble"}, {"Iris", "panda"}}, "Iris"},
      {{{"Leo", "apple"}}, "Leo"},
      {{{"Kate", "pebble"}}, "Kate"},
      {{{"Frank", "wizard"}}, "Frank"},
      {{{"Emma", "eagle"}}, "Emma"},
  };
  GenerateOptions brief;
  brief.max_tokens = 16;
  int read = 0, guessed = 0;
  for (const auto& item : items) {
    std::vector<std::shared_ptr<const DocumentKV>> notes;
    std::string word;
    for (const auto& [name, w] : item.notes) {
      notes.push_back(Documents(with).get(Documents::tokens(
          with, {"Note about " + name, "The secret code word of " + name + " is " + w + "."})));
      if (name == item.who) word = w;
    }
    std::vector<int32_t> ask = qa_prefix(with);
    const auto question = qa_suffix(with, "What is the secret code word of " + item.who + "?");
    ask.insert(ask.end(), question.begin(), question.end());
    LinkedDocuments linked = linker.link(notes);
    linked.anchor = qa_anchor(with);
    read += answer_correct(with.tokenizer().decode(with.generate(ask, brief, &linked).tokens), {word});
    guessed += answer_correct(bare.tokenizer().decode(bare.generate(ask, brief).tokens), {word});
  }
  CHECK(read >= 6);
  CHECK(guessed == 0);
}

TEST_CASE("a fresh plug-in (gates 0) with documents equals the decoder without documents", "[plugin]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  PluginInitOptions init;
  init.n_encoder_layers = 2;
  model.set_plugin(std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init)));
  auto docs = documents_of(model, sample_documents(3, 20, 1));
  LinkedDocuments linked = Linker(c10::kCPU).link(docs);
  at::Tensor ids = prompt_ids(40);
  CHECK(logits_with(model, ids, &linked).equal(logits_with(tiny_model(), ids, nullptr)));
}

TEST_CASE("document order does not matter (random plug-in, open gates)", "[plugin]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  model.set_plugin(random_plugin(model.decoder()));
  auto tokens = sample_documents(4, 25, 2);
  auto docs = documents_of(model, tokens);
  at::Tensor ids = prompt_ids(30);
  Linker linker(c10::kCPU);
  LinkedDocuments base_link = linker.link(docs);
  at::Tensor want = logits_with(model, ids, &base_link);
  CHECK_FALSE(want.equal(logits_with(tiny_model(), ids, nullptr)));  // the documents matter
  double worst = 0;
  const int permutations = for_each_order(docs, linker, [&](const LinkedDocuments& linked, int) {
    worst = std::max(worst, (logits_with(model, ids, &linked) - want).abs().max().item<double>());
  });
  CHECK(permutations == 24);
  INFO("worst |diff| over permutations " << worst);
  CHECK(worst <= bound(model, ids.size(1), &base_link, want));  // the same sums in other orders
}

TEST_CASE("a plug-in's cache dtype: its documents kept so under a store of dtype auto", "[plugin][store]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  auto plugin = random_plugin(model.decoder());
  const std::string before = plugin->fingerprint();
  plugin->set_cache_dtype("int8");
  CHECK(plugin->fingerprint() != before);  // caches kept otherwise are never mixed up
  CHECK(PluginConfig::from_json(plugin->config().to_json(), "test").cache_dtype == "int8");
  plugin->set_cache_dtype("int4");
  CHECK(PluginConfig::from_json(plugin->config().to_json(), "test").cache_dtype == "int4");
  CHECK_THROWS_WITH(plugin->set_cache_dtype("int2"),
                    Catch::Contains("float32, bfloat16, float16, int8, int8-int4 or int4, found 'int2'"));
  nlohmann::json bad = plugin->config().to_json();
  bad["cache_dtype"] = 8;
  CHECK_THROWS_WITH(PluginConfig::from_json(bad, "x.safetensors"), Catch::Contains("x.safetensors: plug-in config 'cache_dtype'"));
  model.set_plugin(plugin);
  auto tokens = sample_documents(2, 20, 4);
  // No store, a store of dtype auto: int8 (what a cache would hand a later request); a store
  // given float32 keeps float32.
  CHECK(Documents(model).get(tokens)[0]->quantized());
  PICacheStore auto_store{StoreOptions{}};
  auto kept = documents_in(model, &auto_store).get(tokens);
  CHECK(kept[1]->quantized());
  std::vector<bool> from_cache;
  auto again = documents_in(model, &auto_store).get(tokens, "", &from_cache);
  CHECK(from_cache == std::vector<bool>{true, true});
  CHECK(again[0].get() == kept[0].get());
  StoreOptions f32;
  f32.dtype = at::kFloat;
  PICacheStore float_store(f32);
  CHECK(documents_in(model, &float_store).get(tokens)[0]->keys[0].scalar_type() == at::kFloat);
  CHECK_FALSE(documents_in(model, &float_store).get(tokens)[0]->quantized());
}

TEST_CASE("linked caches from every tier equal fresh encodings", "[plugin][store]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  model.set_plugin(random_plugin(model.decoder()));
  auto tokens = sample_documents(3, 30, 3);
  at::Tensor ids = prompt_ids(25);
  auto fresh = documents_of(model, tokens);
  LinkedDocuments fresh_link = Linker(c10::kCPU).link(fresh);
  at::Tensor want = logits_with(model, ids, &fresh_link);

  std::string dir = temp_dir("tiers");
  StoreOptions options;
  options.disk_dir = dir;
  options.disk_bytes = 64 << 20;
  {
    PICacheStore store(options);
    auto first = documents_of(model, tokens, &store);   // encodes, puts
    auto second = documents_of(model, tokens, &store);  // host-tier hits
    CHECK(store.stats().host.hits == 3);
    LinkedDocuments a = Linker(c10::kCPU).link(first), b = Linker(c10::kCPU).link(second);
    CHECK(logits_with(model, ids, &a).equal(want));
    CHECK(logits_with(model, ids, &b).equal(want));
  }
  {
    PICacheStore reopened(options);  // a new store over the same directory: disk-tier hits
    auto from_disk = documents_of(model, tokens, &reopened);
    CHECK(reopened.stats().disk.hits == 3);
    LinkedDocuments c = Linker(c10::kCPU).link(from_disk);
    CHECK(logits_with(model, ids, &c).equal(want));
  }
  {
    StoreOptions bf16 = options;
    bf16.dtype = at::kBFloat16;
    bf16.disk_dir = temp_dir("tiers-bf16");
    PICacheStore store(bf16);
    auto stored = documents_of(model, tokens, &store);
    CHECK(stored[0]->keys[0].scalar_type() == at::kBFloat16);
    LinkedDocuments l = Linker(c10::kCPU).link(stored);
    // Every layer (and the encoder's) reads K/V rounded to bfloat16 (bounds.hpp), besides float32's
    // rounding in other orders.
    const int64_t layers = model.config().n_layer + 1 + model.plugin()->config().n_encoder_layers();
    CHECK(max_diff(logits_with(model, ids, &l), want) <=
          layers_bound_relative(layers, kUnitRoundoffBf16, magnitude(want)) + bound(model, ids.size(1), &l, want));
  }
}

TEST_CASE("a batch of requests with different document sets equals each alone", "[plugin]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  model.set_plugin(random_plugin(model.decoder()));
  auto tokens = sample_documents(3, 12, 4);
  auto docs = documents_of(model, tokens);
  at::Tensor a = prompt_ids(16, 1), b = prompt_ids(16, 2);
  Linker linker(c10::kCPU);
  LinkedDocuments batch = linker.link_batch({{docs[0], docs[2]}, {docs[1]}});
  at::Tensor both = logits_with(model, at::cat({a, b}, 0), &batch);
  LinkedDocuments la = linker.link({docs[0], docs[2]}), lb = linker.link({docs[1]});
  at::Tensor alone_a = logits_with(model, a, &la)[0], alone_b = logits_with(model, b, &lb)[0];
  CHECK(max_diff(both[0], alone_a) <= bound(model, a.size(1), &la, alone_a));  // padded rows: other paths
  CHECK(max_diff(both[1], alone_b) <= bound(model, b.size(1), &lb, alone_b));
}

TEST_CASE("plug-in files: round trip, GGUF base + plug-in equals the merged checkpoint", "[plugin][checkpoint]") {
  c10::InferenceMode guard;
  Model base = Model::load(model_path());
  auto plugin = random_plugin(base.decoder(), 1, 9);
  std::string dir = temp_dir("ckpt");
  plugin->save(dir + "/plugin.safetensors");
  Options options;
  options.plugin = dir + "/plugin.safetensors";
  Model loaded = Model::load(model_path(), options);
  REQUIRE(loaded.plugin());
  CHECK(loaded.plugin()->fingerprint() == plugin->fingerprint());
  auto tokens = sample_documents(2, 15, 6);
  at::Tensor ids = prompt_ids(12);
  base.set_plugin(plugin);
  auto d1 = documents_of(base, tokens), d2 = documents_of(loaded, tokens);
  LinkedDocuments l1 = Linker(c10::kCPU).link(d1), l2 = Linker(c10::kCPU).link(d2);
  at::Tensor want = logits_with(base, ids, &l1);
  CHECK(logits_with(loaded, ids, &l2).equal(want));

  loaded.save(dir + "/merged");  // reference layout: combllama config, language_model.* + chunk_model.*
  auto config = nlohmann::json::parse(read_bytes(dir + "/merged/config.json"));
  CHECK(config["model_type"] == "combllama");
  CHECK(config["num_hidden_layers"] == 31);
  // The default model ties its output head to the embedding: the top level says so as text_config
  // does, so a reader of the top level does not look for an lm_head.weight that is not written.
  CHECK(config["tie_word_embeddings"] == true);
  CHECK(config["text_config"]["tie_word_embeddings"] == true);
  Model merged = Model::load(dir + "/merged");
  REQUIRE(merged.plugin());
  // The merged layout names no base: the plug-in is bound to the one it is loaded on, so its
  // fingerprint (and every cache key of its documents) is the plug-in file's, not base-free.
  CHECK(merged.plugin()->config().base_fingerprint == base_fingerprint(merged.decoder()));
  CHECK(merged.plugin()->fingerprint() == loaded.plugin()->fingerprint());
  auto d3 = documents_of(merged, tokens);
  LinkedDocuments l3 = Linker(c10::kCPU).link(d3);
  CHECK(logits_with(merged, ids, &l3).equal(want));
  CHECK(merged.chat_prompt("hi") == base.chat_prompt("hi"));  // the tokenizer came along
}

TEST_CASE("bad plug-ins and documents get clear errors", "[plugin][errors]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  std::string dir = temp_dir("badplugin");
  // A plug-in built for another base.
  random_plugin(default_model().decoder(), 1)->save(dir + "/other.safetensors");
  CHECK_THROWS_WITH(Plugin::load(dir + "/other.safetensors", model.decoder()),
                    Catch::Contains("built for another base decoder"));
  // Shapes that do not fit the base (same fingerprint, wrong tensors).
  auto plugin = random_plugin(model.decoder(), 2);
  auto named = plugin->named_tensors();
  for (auto& [name, t] : named)
    if (name == "chunk_model.k_proj.1.weight") t = at::zeros({7, 64});
  save_safetensors(dir + "/shapes.safetensors", named,
                   {{"comb.plugin", plugin->config().to_json().dump()}});
  CHECK_THROWS_WITH(Plugin::load(dir + "/shapes.safetensors", model.decoder()),
                    Catch::Contains("'chunk_model.k_proj.1.weight' has shape [7, 64], expected [32, 64]"));
  save_safetensors(dir + "/plain.safetensors", {{"w", at::ones({2})}});
  CHECK_THROWS_WITH(Plugin::load(dir + "/plain.safetensors", model.decoder()), Catch::Contains("not a comb plug-in"));
  CHECK_THROWS_WITH(Documents(model).get({1, 2, 3}), Catch::Contains("need a plug-in"));

  model.set_plugin(plugin);
  CHECK_THROWS_WITH(Documents(model).get(std::vector<int32_t>{}), Catch::Contains("empty"));
  std::vector<int32_t> too_long(plugin->config().max_document_tokens + 1, 1000);
  CHECK_THROWS_WITH(Documents(model).get(too_long), Catch::Contains("at most 1024"));
  CHECK_THROWS_WITH(Documents(model).get({1, -5}), Catch::Contains("outside the vocabulary"));
  PluginInitOptions init;
  init.cross_layers = {2, 1};
  CHECK_THROWS_WITH(Plugin::fresh(model.decoder(), init), Catch::Contains("must increase"));
  init.cross_layers = {0, 9};
  CHECK_THROWS_WITH(Plugin::fresh(model.decoder(), init), Catch::Contains("the base has 3 layers"));
}

// ---- The custom op -------------------------------------------------------------------------------

namespace {
// SDPA over the concatenated documents of each request, heads repeated: the plain reference.
at::Tensor reference_cross_attention(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                                     const std::vector<at::Tensor>& values, const std::vector<int64_t>& counts,
                                     double scale) {
  std::vector<at::Tensor> out;
  size_t d = 0;
  for (size_t b = 0; b < counts.size(); ++b) {
    at::Tensor qb = q[b].transpose(0, 1).to(at::kFloat);  // [n_head, n, hd]
    if (counts[b] == 0) {
      out.push_back(at::zeros_like(q[b]).to(at::kFloat));
      continue;
    }
    std::vector<at::Tensor> ks(keys.begin() + d, keys.begin() + d + counts[b]),
        vs(values.begin() + d, values.begin() + d + counts[b]);
    d += counts[b];
    at::Tensor k = at::cat(ks, 1).to(at::kFloat), v = at::cat(vs, 1).to(at::kFloat);
    int64_t group = q.size(2) / k.size(0);
    k = k.repeat_interleave(group, 0);
    v = v.repeat_interleave(group, 0);
    out.push_back(at::scaled_dot_product_attention(qb, k, v, {}, 0.0, false, scale).transpose(0, 1));
  }
  return at::stack(out, 0);
}
}  // namespace

TEST_CASE("comb::cross_attention equals SDPA over concatenated K/V", "[ops]") {
  c10::InferenceMode guard;
  std::vector<c10::Device> devices{c10::kCPU};
  if (comb::cuda_available()) devices.emplace_back(c10::kCUDA);
  else WARN("no CUDA device: the CUDA op is not checked here");
  auto gen = at::detail::createCPUGenerator(11);
  int cases = 0;
  for (auto device : devices)
    for (auto [n_head, n_kv] : {std::pair{9, 3}, std::pair{4, 4}, std::pair{6, 1}})
      for (int64_t hd : {16, 19, 64})
        for (int64_t n : {1, 7})
          for (const std::vector<int64_t>& counts : std::vector<std::vector<int64_t>>{{1}, {3}, {2, 0, 1}}) {
            int64_t total = 0;
            for (auto c : counts) total += c;
            std::vector<int64_t> lens{1, 3, 7, 19, 733, 5};
            std::vector<at::Tensor> keys, values;
            for (int64_t i = 0; i < total; ++i) {
              keys.push_back(at::randn({n_kv, lens[i % lens.size()], hd}, gen).to(device));
              values.push_back(at::randn({n_kv, lens[i % lens.size()], hd}, gen).to(device));
            }
            at::Tensor q = at::randn({static_cast<int64_t>(counts.size()), n, n_head, hd}, gen).to(device);
            double scale = 1.0 / std::sqrt(double(hd));
            at::Tensor got = ops::cross_attention(q, keys, values, counts, scale).cpu();
            std::vector<at::Tensor> kc, vc;
            for (auto& t : keys) kc.push_back(t.cpu());
            for (auto& t : values) vc.push_back(t.cpu());
            at::Tensor want = reference_cross_attention(q.cpu(), kc, vc, counts, scale);
            INFO("heads " << n_head << "/" << n_kv << ", head_dim " << hd << ", n " << n << ", docs " << total);
            REQUIRE(max_diff(got, want) <= attention_bound(q.cpu(), kc, vc, scale));  // helpers.hpp
            ++cases;
          }
  CHECK(cases >= 54);
  // Half-precision documents, float queries.
  std::vector<at::Tensor> keys{at::randn({3, 11, 16}, gen).to(at::kBFloat16)}, values{at::randn({3, 11, 16}, gen).to(at::kBFloat16)};
  at::Tensor q = at::randn({1, 2, 6, 16}, gen);
  at::Tensor got = ops::cross_attention(q, keys, values, {1}, 0.25);
  at::Tensor want = reference_cross_attention(q, keys, values, {1}, 0.25);
  CHECK(max_diff(got, want) <= attention_bound(q, keys, values, 0.25));  // bfloat16 keys are float32 numbers
  CHECK_THROWS_WITH(ops::cross_attention(q, keys, values, {2}, 0.25), Catch::Contains("add up to 2"));
}

// ---- Memory -----------------------------------------------------------------------------------------

TEST_CASE("bytes per cached document token are L_E/L of the decoder's KV", "[plugin][memory]") {
  c10::InferenceMode guard;
  const Model& model = default_model();
  const auto& c = model.config();
  PluginInitOptions init;
  init.n_encoder_layers = 4;
  Plugin plugin = Plugin::fresh(model.decoder(), init);
  std::vector<int32_t> doc(100, 1500);
  DocumentKV kv = plugin.encode(model.decoder(), doc);
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    double comb_per_token = double(kv.to(c10::kCPU, dtype).bytes()) / doc.size();
    double decoder_per_token = 2.0 * c.n_layer * c.kv_dim() * c10::elementSize(dtype);
    INFO(c10::toString(dtype) << ": " << comb_per_token << " vs " << decoder_per_token << " bytes per token");
    CHECK(comb_per_token / decoder_per_token <= double(init.n_encoder_layers) / c.n_layer + 1e-12);
  }
}

TEST_CASE("a plug-in cut to some of its blocks: each kept block's K/V as before, the encoder as deep as they read",
          "[plugin][memory]") {
  c10::InferenceMode guard;
  const Model& model = default_model();
  PluginInitOptions init;
  init.reads = true, init.joint_attention = true;
  init.cross_layers = {1, 3, 5, 7, 9, 11};  // each block reads the depth of its layer: an encoder of 11
  const Plugin plugin = Plugin::fresh(model.decoder(), init);
  const Plugin cut = plugin.with_blocks({0, 2, 3}, model.decoder());
  CHECK(cut.config().cross_layers == std::vector<int64_t>{1, 5, 7});
  CHECK(cut.config().n_blocks() == 3);
  CHECK(cut.config().read_depth(0) == 1);
  CHECK(cut.config().read_depth(1) == 5);
  CHECK(cut.config().read_depth(2) == 7);
  REQUIRE(plugin.config().n_encoder_layers() == 11);
  CHECK(cut.config().n_encoder_layers() == 7);  // the deepest kept block reads depth 7
  std::vector<int32_t> doc(40);
  for (size_t i = 0; i < doc.size(); ++i) doc[i] = static_cast<int32_t>(300 + 11 * i);
  const DocumentKV all = plugin.encode(model.decoder(), doc), some = cut.encode(model.decoder(), doc);
  REQUIRE(some.keys.size() == 3);
  const std::vector<size_t> from{0, 2, 3};
  for (size_t k = 0; k < from.size(); ++k) {  // the same causal layers over the same tokens: equal
    CHECK(at::equal(some.keys[k], all.keys[from[k]]));
    CHECK(at::equal(some.values[k], all.values[from[k]]));
  }
  CHECK(some.bytes() * 6 == all.bytes() * 3);  // bytes in proportion to the blocks kept
  // Saved and loaded, the same plug-in.
  const std::string dir = temp_dir("plugin-cut");
  cut.save(dir + "/cut.safetensors");
  CHECK(Plugin::load(dir + "/cut.safetensors", model.decoder()).fingerprint() == cut.fingerprint());
  remove_dir(dir);
  // A plug-in with an encoder of its own layers: cut to the depth its kept blocks read.
  PluginInitOptions own;
  own.n_encoder_layers = 4;  // block k reads depth k + 1
  const Plugin mine = Plugin::fresh(model.decoder(), own);
  REQUIRE_FALSE(mine.config().encoder_from_base);
  const Plugin mine_cut = mine.with_blocks({0, 2}, model.decoder());
  CHECK(mine_cut.config().n_encoder_layers() == 3);
  CHECK(mine_cut.weights().encoder.size() == 3);
  const DocumentKV mine_all = mine.encode(model.decoder(), doc), mine_some = mine_cut.encode(model.decoder(), doc);
  REQUIRE(mine_some.keys.size() == 2);
  CHECK(at::equal(mine_some.keys[1], mine_all.keys[2]));
  CHECK(at::equal(mine_some.values[1], mine_all.values[2]));
  CHECK_THROWS_WITH(plugin.with_blocks({}, model.decoder()), Catch::Contains("no block to keep"));
  CHECK_THROWS_WITH(plugin.with_blocks({1, 1}, model.decoder()), Catch::Contains("(repeated)"));
  CHECK_THROWS_WITH(plugin.with_blocks({2, 1}, model.decoder()), Catch::Contains("found 1 at place 1"));
  CHECK_THROWS_WITH(plugin.with_blocks({6}, model.decoder()), Catch::Contains("increasing in [0, 6)"));
}

// ---- Sinks, gradients, and the layout that reads from the start ---------------------------------

namespace {
// Softmax over [scores | sink] written out, then the sink's column dropped: the plain reference.
at::Tensor reference_with_sinks(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                                const std::vector<at::Tensor>& values, const std::vector<int64_t>& counts,
                                double scale, const at::Tensor& sinks) {
  std::vector<at::Tensor> out;
  size_t d = 0;
  for (size_t b = 0; b < counts.size(); ++b) {
    if (counts[b] == 0) {
      out.push_back(at::zeros_like(q[b]));
      continue;
    }
    std::vector<at::Tensor> ks(keys.begin() + d, keys.begin() + d + counts[b]),
        vs(values.begin() + d, values.begin() + d + counts[b]);
    d += counts[b];
    const int64_t group = q.size(2) / ks[0].size(0);
    at::Tensor k = at::cat(ks, 1).repeat_interleave(group, 0), v = at::cat(vs, 1).repeat_interleave(group, 0);
    at::Tensor qb = q[b].transpose(0, 1);                            // [n_head, n, hd]
    at::Tensor scores = at::matmul(qb, k.transpose(1, 2)) * scale;  // [n_head, n, len]
    at::Tensor sink = sinks.view({-1, 1, 1}).expand({scores.size(0), scores.size(1), 1});
    at::Tensor p = at::softmax(at::cat({scores, sink}, 2), 2).narrow(2, 0, scores.size(2));
    out.push_back(at::matmul(p, v).transpose(0, 1));
  }
  return at::stack(out, 0);
}
}  // namespace

TEST_CASE("comb::cross_attention with sinks: a zero-valued key of the sink's score, differentiable", "[ops]") {
  auto gen = at::detail::createCPUGenerator(21);
  std::vector<int64_t> counts{2, 0, 1};
  std::vector<at::Tensor> keys, values;
  for (int64_t len : {5, 9, 3}) {
    keys.push_back(at::randn({3, len, 16}, gen).requires_grad_());
    values.push_back(at::randn({3, len, 16}, gen).requires_grad_());
  }
  at::Tensor q = at::randn({3, 4, 6, 16}, gen).requires_grad_();
  at::Tensor sinks = (at::randn({6}, gen) * 2).requires_grad_();
  at::Tensor weight = at::randn({3, 4, 6, 16}, gen);
  at::Tensor got = ops::cross_attention(q, keys, values, counts, 0.25, sinks);
  at::Tensor want = reference_with_sinks(q, keys, values, counts, 0.25, sinks);
  // The sink is one key more, its score given (helpers.hpp).
  std::vector<at::Tensor> with_sink = keys;
  with_sink.push_back(at::zeros({1, 16}));
  CHECK(max_diff(got, want) <= attention_bound(q, with_sink, values, 0.25));
  CHECK(got[1].abs().max().item<double>() == 0);  // no documents: nothing read, sink or not
  // A sink takes weight from the documents: with a very low one the output is the plain op's.
  {
    c10::InferenceMode guard;
    at::Tensor low = ops::cross_attention(q.detach(), {keys[0].detach(), keys[1].detach(), keys[2].detach()},
                                          {values[0].detach(), values[1].detach(), values[2].detach()}, counts, 0.25,
                                          at::full({6}, -1e4));
    at::Tensor plain = ops::cross_attention(q.detach(), {keys[0].detach(), keys[1].detach(), keys[2].detach()},
                                            {values[0].detach(), values[1].detach(), values[2].detach()}, counts, 0.25);
    CHECK(max_diff(low, plain) <= attention_bound(q, keys, values, 0.25));  // exp(-1e4 - max) is 0 in float32
    CHECK((plain - got.detach()).abs().max().item<double>() > 1e-3);
  }
  // Gradients of the op (its Autograd kernel) equal the reference's, for every input.
  std::vector<at::Tensor> inputs{q, sinks};
  inputs.insert(inputs.end(), keys.begin(), keys.end());
  inputs.insert(inputs.end(), values.begin(), values.end());
  auto g_got = torch::autograd::grad({(got * weight).sum()}, inputs);
  auto g_want = torch::autograd::grad({(want * weight).sum()}, inputs);
  REQUIRE(g_got.size() == g_want.size());
  for (size_t i = 0; i < g_got.size(); ++i) {
    INFO("input " << i);
    REQUIRE(g_got[i].defined());
    CHECK(g_got[i].abs().max().item<double>() > 0);
    CHECK(max_diff(g_got[i], g_want[i]) <= gradient_bound(16, g_want[i]));  // sums of at most 16 terms
  }
  CHECK_THROWS_WITH(ops::cross_attention(q, keys, values, counts, 0.25, at::zeros({5})),
                    Catch::Contains("sinks should be [6]"));
}

TEST_CASE("a plug-in that reads from the start: saved and loaded, order-free, off is the bare decoder", "[plugin]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  PluginInitOptions init;
  init.reads = true;
  init.cross_layers = {1, 2};
  init.encoder_prefix = {7};
  for (uint64_t s = 0; s < 3; ++s) {
    at::Tensor p = prompt_ids(12 + s, 40 + s)[0];
    init.probes.push_back(std::vector<int32_t>(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel()));
  }
  auto plugin = std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init));
  const PluginConfig& c = plugin->config();
  CHECK(c.encoder_from_base);
  CHECK(c.encoder_causal);
  CHECK(c.attention_sinks);
  CHECK(c.relative_positions);
  CHECK_FALSE(c.qk_norm);
  CHECK_FALSE(c.cross_mlp);
  CHECK(c.read_depths == std::vector<int64_t>{1, 2});
  CHECK(c.n_encoder_layers() == 2);
  // Each block starts as its decoder layer's attention: its q/o projections are that layer's.
  const auto& layer2 = model.decoder().weights().layers[2];
  CHECK(plugin->weights().cross[1].wq.equal(layer2.wqkv.narrow(0, 0, model.config().q_dim())));
  CHECK(plugin->weights().cross[1].wo.equal(layer2.wo));
  CHECK(std::isfinite(plugin->weights().cross[0].sinks.sum().item<double>()));
  model.set_plugin(plugin);

  auto tokens = sample_documents(3, 15, 9);
  auto docs = documents_of(model, tokens);
  at::Tensor ids = prompt_ids(20);
  LinkedDocuments linked = Linker(c10::kCPU).link(docs);
  at::Tensor want = logits_with(model, ids, &linked);
  CHECK_FALSE(want.equal(logits_with(tiny_model(), ids, nullptr)));  // it reads the documents
  LinkedDocuments none;
  CHECK(logits_with(model, ids, &none).equal(logits_with(tiny_model(), ids, nullptr)));  // off: the bare decoder
  LinkedDocuments reversed = Linker(c10::kCPU).link({docs[2], docs[1], docs[0]});
  CHECK(max_diff(logits_with(model, ids, &reversed), want) <= bound(model, ids.size(1), &linked, want));

  // The file holds no encoder layers (they are the base's) and loads to the same plug-in.
  std::string path = temp_dir("reads") + "/reads.safetensors";
  plugin->save(path);
  SafetensorsFile file(path);
  for (const auto& name : file.names()) CHECK(name.find("chunk_model.layers.") == std::string::npos);
  Model loaded = Model::load(oracle_dir() + "/tiny-llama");
  loaded.set_plugin(std::make_shared<Plugin>(Plugin::load(path, loaded.decoder())));
  CHECK(loaded.plugin()->fingerprint() == plugin->fingerprint());
  LinkedDocuments again = Linker(c10::kCPU).link(documents_of(loaded, tokens));
  CHECK(logits_with(loaded, ids, &again).equal(want));
  // Decoding one token after a cached prompt reads with the query at its real position.
  KVCache cache = model.decoder().make_cache(1, ids.size(1));
  model.forward(ids.narrow(1, 0, ids.size(1) - 1), cache, &linked, LogitsMode::all);
  at::Tensor last = model.forward(ids.narrow(1, ids.size(1) - 1, 1), cache, &linked, LogitsMode::all);
  CHECK(max_diff(last[0][0], want[0][ids.size(1) - 1]) <= bound(model, ids.size(1), &linked, want));
}

TEST_CASE("joint_attention is one softmax over the joined keys and the causal context", "[ops]") {
  auto gen = at::detail::createCPUGenerator(11);
  const int64_t batch = 2, n_head = 4, n_kv = 2, d = 8, start = 3, n = 5, m = 6;
  at::Tensor q = at::randn({batch, n_head, n, d}, gen).requires_grad_();
  at::Tensor keys = at::randn({batch, n_kv, start + n, d}, gen).requires_grad_();
  at::Tensor values = at::randn({batch, n_kv, start + n, d}, gen);
  JointKV joint;
  joint.keys = at::randn({batch, n_kv, m, d}, gen).requires_grad_();
  joint.values = at::randn({batch, n_kv, m, d}, gen).requires_grad_();
  joint.valid = at::ones({batch, m}, at::kBool);
  joint.valid[1].narrow(0, 4, 2).fill_(false);  // row 1 has 4 real keys
  joint.bias = at::randn({n_head}, gen).requires_grad_();
  at::Tensor got = joint_attention(q, keys, values, start, joint);
  // Written out row by row: the scores of the real joined keys plus the bias, then of the visible
  // context keys, one softmax.
  at::Tensor want = at::zeros_like(got);
  const double scale = 1.0 / std::sqrt(double(d));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < n_head; ++h)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t g = h / (n_head / n_kv), real = b == 1 ? 4 : m;
        at::Tensor qi = q[b][h][i];
        at::Tensor s_doc = at::mv(joint.keys[b][g].narrow(0, 0, real), qi) * scale + joint.bias[h];
        at::Tensor s_own = at::mv(keys[b][g].narrow(0, 0, start + i + 1), qi) * scale;
        at::Tensor p = at::softmax(at::cat({s_doc, s_own}), 0);
        at::Tensor v = at::cat({joint.values[b][g].narrow(0, 0, real), values[b][g].narrow(0, 0, start + i + 1)});
        want[b][h][i] = at::mv(v.t(), p);
      }
  CHECK(max_diff(got, want) <= attention_bound(q, {keys, joint.keys}, {values, joint.values}, scale));  // helpers.hpp
  // Gradients (the bias's through the mask) equal the written-out ones.
  at::Tensor w = at::randn(got.sizes(), gen);
  auto g1 = torch::autograd::grad({(got * w).sum()}, {q, keys, joint.keys, joint.values, joint.bias});
  auto g2 = torch::autograd::grad({(want * w).sum()}, {q, keys, joint.keys, joint.values, joint.bias});
  for (size_t i = 0; i < g1.size(); ++i) {
    INFO("gradient " << i);
    CHECK(max_diff(g1[i], g2[i]) <= gradient_bound(start + n + m, g2[i]));  // sums of at most start + n + m terms
  }
  // No valid joined key: exactly the context's causal attention.
  c10::InferenceMode guard;
  JointKV none = joint;
  none.valid = at::zeros({batch, m}, at::kBool);
  none.bias = at::Tensor();  // and no bias: the path without one
  at::Tensor alone = at::scaled_dot_product_attention(
      q.detach(), keys.detach().repeat_interleave(2, 1).narrow(2, 0, start + n),
      values.repeat_interleave(2, 1), visible_keys(at::arange(start, start + n, at::kLong), start + n));
  CHECK(max_diff(joint_attention(q.detach(), keys.detach(), values, start, none), alone) <=
        attention_bound(q, {keys}, {values}, 1.0 / std::sqrt(double(d))));
  JointKV wrong = joint;
  wrong.keys = at::zeros({batch, n_kv + 1, m, d});
  CHECK_THROWS_WITH(joint_attention(q.detach(), keys.detach(), values, start, wrong),
                    Catch::Contains("joint attention: keys"));
}

TEST_CASE("joint_attention_probs are joint_attention's one softmax, written out", "[ops]") {
  c10::InferenceMode guard;
  auto gen = at::detail::createCPUGenerator(12);
  const int64_t batch = 2, n_head = 4, n_kv = 2, d = 8, start = 3, n = 5, m = 6;
  at::Tensor q = at::randn({batch, n_head, n, d}, gen), keys = at::randn({batch, n_kv, start + n, d}, gen);
  at::Tensor values = at::randn({batch, n_kv, start + n, d}, gen);
  JointKV joint;
  joint.keys = at::randn({batch, n_kv, m, d}, gen);
  joint.values = at::randn({batch, n_kv, m, d}, gen);
  joint.valid = at::ones({batch, m}, at::kBool);
  joint.valid[1].narrow(0, 4, 2).fill_(false);  // row 1 has 4 real keys
  joint.bias = at::randn({n_head}, gen);
  joint.anchor = start + 2;  // the first two rows read no document
  at::Tensor p = joint_attention_probs(q, keys, start, &joint);
  REQUIRE(p.sizes() == at::IntArrayRef({batch, n_head, n, m + start + n}));
  // A distribution per row (float32 sums of at most 14 terms), exactly 0 where a row may not read.
  CHECK(max_diff(p.sum(-1), at::ones({batch, n_head, n})) <= 1e-5);
  CHECK(p.narrow(3, 0, m).narrow(2, 0, 2).abs().max().item<float>() == 0.0f);  // before the anchor
  CHECK(p[1].narrow(2, 4, 2).abs().max().item<float>() == 0.0f);              // padded joined keys
  for (int64_t i = 0; i < n; ++i)  // the context after each row's own position
    if (start + i + 1 < start + n) CHECK(p.select(2, i).narrow(2, m + start + i + 1, n - i - 1).abs().max().item<float>() == 0.0f);
  CHECK(p.narrow(3, 0, m).narrow(2, 2, n - 2).min().item<float>() >= 0.0f);
  CHECK(p.narrow(3, 0, m)[0].narrow(1, 2, n - 2).min().item<float>() > 0.0f);  // read after the anchor
  // The probabilities times the values are joint_attention's output (query head h reads KV head
  // h / 2), within the bound of two orders of the same sums (helpers.hpp).
  at::Tensor v = at::cat({joint.values, values}, 2).repeat_interleave(n_head / n_kv, 1);
  const double scale = 1.0 / std::sqrt(double(d));
  CHECK(max_diff(at::matmul(p, v), joint_attention(q, keys, values, start, joint)) <=
        attention_bound(q, {keys, joint.keys}, {values, joint.values}, scale));
  // No joined keys: the causal context alone, as scaled_dot_product_attention weighs it.
  at::Tensor alone = joint_attention_probs(q, keys, start, nullptr);
  REQUIRE(alone.sizes() == at::IntArrayRef({batch, n_head, n, start + n}));
  at::Tensor sdpa = at::scaled_dot_product_attention(q, keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1),
                                                     visible_keys(at::arange(start, start + n, at::kLong), start + n));
  CHECK(max_diff(at::matmul(alone, values.repeat_interleave(2, 1)), sdpa) <=
        attention_bound(q, {keys}, {values}, scale));
  CHECK_THROWS_WITH(joint_attention_probs(q, keys.narrow(2, 0, start + n - 1), start, nullptr),
                    Catch::Contains("7 context keys for 3 earlier and 5 new positions"));
}

TEST_CASE("row_attention: the last row's probabilities in the forward a prompt runs, documents first", "[plugin]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  PluginInitOptions init;
  init.reads = init.joint_attention = init.documents_after_prefix = true;
  init.cross_layers = {0, 2};  // not every layer reads the documents
  auto plugin = std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init));
  auto gen = at::detail::createCPUGenerator(9);
  for (auto& b : plugin->mutable_weights().cross) b.doc_bias.add_(at::randn(b.doc_bias.sizes(), gen));
  plugin->refresh_fingerprint();
  model.set_plugin(plugin);
  const Decoder& base = model.decoder();
  const ModelConfig& c = model.config();
  auto docs = documents_of(model, sample_documents(3, 9, 41));
  const int64_t anchor = 5;
  int64_t total = 0;
  for (const auto& d : docs) total += d->n_tokens;
  LinkedDocuments linked = Linker(c10::kCPU).link(docs);
  DocumentReads reads = DocumentReads::joined(
      *plugin, plugin->joint_kv(plugin->weights(), linked.keys, linked.values, linked.doc_counts, anchor));
  at::Tensor ids = prompt_ids(11);
  for (int64_t n : {int64_t(3), ids.size(1)}) {
    INFO(n << " tokens");
    at::Tensor t = ids.narrow(1, 0, n);
    RowAttention a = row_attention(base, t, &reads);
    // The forward is a prompt's: its rows before the last, then the last, bit for bit.
    KVCache cache = base.make_cache(1, n);
    base.forward(t.narrow(1, 0, n - 1), cache, LogitsMode::last, &reads);
    CHECK(a.logits.equal(base.forward(t.narrow(1, n - 1, 1), cache, LogitsMode::last, &reads)));
    REQUIRE(a.probs.size() == static_cast<size_t>(c.n_layer));
    for (int64_t l = 0; l < c.n_layer; ++l) {
      INFO("layer " << l);
      const bool reads_docs = l == 0 || l == 2;
      CHECK(a.joined[l] == (reads_docs ? total : 0));
      REQUIRE(a.probs[l].sizes() == at::IntArrayRef({c.n_head, a.joined[l] + n}));
      CHECK(max_diff(a.probs[l].sum(-1), at::ones({c.n_head})) <= 1e-5);
      CHECK(a.probs[l].min().item<float>() >= 0.0f);
      if (reads_docs) {
        const float on_documents = a.probs[l].narrow(1, 0, total).sum().item<float>();
        if (n - 1 < anchor) CHECK(on_documents == 0.0f);  // the prefix reads no document
        else CHECK(on_documents > 0.0f);
      }
    }
  }
  // Layer 0 by hand: its query and keys from the embeddings, one softmax (the documents' bias
  // added), against the probabilities; within the bound of two orders of the same sums.
  {
    const int64_t n = ids.size(1);
    RowAttention a = row_attention(base, ids, &reads);
    const LayerWeights& l0 = base.weights().layers[0];
    at::Tensor x = reads.before(0, base.embed(ids), 0);
    auto [q, k, v] = split_qkv(project(l0, Proj::qkv, comb::rms_norm(x, l0.attn_norm, c.rms_eps)), c);
    q = apply_rope(q, base.rope_cos().narrow(0, 0, n), base.rope_sin().narrow(0, 0, n)).select(2, n - 1)[0];
    k = apply_rope(k, base.rope_cos().narrow(0, 0, n), base.rope_sin().narrow(0, 0, n))[0];
    const JointKV& j = *reads.joint(0);
    const int64_t groups = c.n_head / c.n_head_kv;
    for (int64_t h = 0; h < c.n_head; ++h) {
      INFO("head " << h);
      at::Tensor s_doc = at::mv(j.keys[0][h / groups], q[h]) / std::sqrt(double(c.head_dim)) + j.bias[h];
      at::Tensor s_own = at::mv(k[h / groups], q[h]) / std::sqrt(double(c.head_dim));
      at::Tensor want = at::softmax(at::cat({s_doc, s_own}), 0);
      CHECK(max_diff(a.probs[0][h], want) <= 1e-5);
    }
  }
  // Without documents: the bare decoder's forward, and only the context.
  RowAttention bare = row_attention(base, ids.narrow(1, 0, 5), nullptr);
  CHECK(bare.probs[0].sizes() == at::IntArrayRef({c.n_head, 5}));
  KVCache cache = base.make_cache(1, 5);
  base.forward(ids.narrow(1, 0, 4), cache);
  CHECK(bare.logits.equal(base.forward(ids.narrow(1, 4, 1), cache)));
  CHECK_THROWS_WITH(row_attention(base, ids.view({11, 1}), nullptr), Catch::Contains("expected tokens [1, n > 0]"));
}

TEST_CASE("encode_packed: documents packed in one row sequence give encode_many's K/V", "[plugin]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  const Decoder& base = model.decoder();
  const auto& c = base.config();
  std::mt19937 rng(21);
  std::uniform_int_distribution<int32_t> token(1000, static_cast<int32_t>(c.n_vocab) - 1);
  std::vector<std::vector<int32_t>> docs;
  for (int64_t len : {5, 9, 3, 9}) {
    docs.emplace_back();
    for (int64_t j = 0; j < len; ++j) docs.back().push_back(token(rng));
  }
  std::vector<const std::vector<int32_t>*> ptrs;
  for (const auto& d : docs) ptrs.push_back(&d);
  for (bool with_prefix : {false, true})
    for (bool relative : {false, true}) {
      INFO("encoder prefix " << with_prefix << ", relative positions " << relative);
      PluginInitOptions init;
      init.reads = true;
      init.joint_attention = relative;  // joint blocks read documents at relative positions only
      init.relative_positions = relative;
      init.cross_layers = {0, 1, 2};
      if (!relative) init.probes = {{11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22}};  // the reading blocks' sinks come from probe prompts
      if (with_prefix) init.encoder_prefix = {11, 12, 13, 14};
      const Plugin plugin = Plugin::fresh(base, init);
      const KVCache states = plugin.encoder_prefix_states(base);
      const int64_t pre = static_cast<int64_t>(init.encoder_prefix.size());
      const std::vector<DocumentKV> want = plugin.encode_many(base, docs, &states);
      const std::vector<DocumentKV> got = plugin.encode_packed(base, ptrs, states, /*varlen=*/false);
      REQUIRE(got.size() == docs.size());
      for (size_t d = 0; d < docs.size(); ++d) {
        INFO("document " << d);
        const auto len = static_cast<int64_t>(docs[d].size());
        CHECK(got[d].n_tokens == len);
        REQUIRE(got[d].keys.size() == want[d].keys.size());
        for (size_t k = 0; k < got[d].keys.size(); ++k) {
          INFO("block " << k);
          REQUIRE(got[d].keys[k].sizes() == want[d].keys[k].sizes());
          // The same causal computation, packed against padded (and on the fused CPU path against
          // the generic one): the block's depth in layers plus its projection, attention rows over
          // the prefix and the document, helpers.hpp's path_bound.
          const int64_t layers = plugin.config().read_depth(static_cast<int64_t>(k)) + 1;
          CHECK(max_diff(got[d].keys[k], want[d].keys[k]) <= path_bound(c, layers, pre + len, magnitude(want[d].keys[k])));
          CHECK(max_diff(got[d].values[k], want[d].values[k]) <=
                path_bound(c, layers, pre + len, magnitude(want[d].values[k])));
        }
      }
      CHECK_THROWS_WITH(plugin.encode_packed(base, ptrs, states, /*varlen=*/true),
                        Catch::Contains("runs on a CUDA bfloat16 or float16 decoder"));
    }
}

TEST_CASE("without gradients on CPU, joint attention and joined keys take direct paths with the same results",
          "[ops][plugin]") {
  // joint_attention: the context and the documents attended apart and merged by their log-sum-exp,
  // against the written-out softmax (taken while gradients are recorded).
  auto gen = at::detail::createCPUGenerator(13);
  const int64_t n_head = 6, n_kv = 2, d = 16, m = 9;
  for (int64_t start : {0, 4})
    for (int64_t n : {1, 5})
      for (int64_t anchor : {int64_t(0), start + 2, start + n + 1}) {
        INFO("start " << start << ", n " << n << ", anchor " << anchor);
        at::Tensor q = at::randn({1, n_head, n, d}, gen);
        at::Tensor keys = at::randn({1, n_kv, start + n, d}, gen), values = at::randn({1, n_kv, start + n, d}, gen);
        JointKV joint;
        joint.keys = at::randn({1, n_kv, m, d}, gen);
        joint.values = at::randn({1, n_kv, m, d}, gen);
        joint.bias = at::randn({n_head}, gen);
        joint.anchor = anchor;
        at::Tensor written, direct, merged;
        {
          at::AutoGradMode on(true);
          written = joint_attention(q, keys, values, start, joint);
        }
        {
          at::NoGradGuard off;
          direct = joint_attention(q, keys, values, start, joint);
          merged = joint_attention_merged(q, keys, values, start, joint);
        }
        CHECK(max_diff(written, merged) <=
              attention_bound(q, {keys, joint.keys}, {values, joint.values}, 1.0 / std::sqrt(double(d))));
        CHECK(direct.equal(merged));  // the path taken without gradients
      }

  // joint_attention_rows (the fused kernel for few rows) against the merged path: a batch of two
  // over a cache with room past the new rows, heads grouped 3 to a KV head at head_dim 64 (the
  // AVX-512 kernel where the CPU has it) and 2 to a KV head at head_dim 16 (the portable one).
  for (auto [n_head_r, n_kv_r, d_r] : {std::tuple<int64_t, int64_t, int64_t>{9, 3, 64}, {6, 2, 16}})
    for (int64_t start : {0, 7})
      for (int64_t n : {1, 6})
        for (int64_t anchor : {int64_t(0), start + 3, start + n + 1})
          for (bool with_bias : {true, false}) {
            INFO("heads " << n_head_r << "/" << n_kv_r << ", head_dim " << d_r << ", start " << start << ", n " << n
                          << ", anchor " << anchor << ", bias " << with_bias);
            at::NoGradGuard off;
            const int64_t batch = 2, capacity = start + n + 5, m_r = 11;
            at::Tensor q = at::randn({batch, n_head_r, n, d_r}, gen);
            at::Tensor k_cache = at::randn({batch, n_kv_r, capacity, d_r}, gen);
            at::Tensor v_cache = at::randn({batch, n_kv_r, capacity, d_r}, gen);
            JointKV joint;
            joint.keys = at::randn({batch, n_kv_r, m_r, d_r}, gen);
            joint.values = at::randn({batch, n_kv_r, m_r, d_r}, gen);
            if (with_bias) joint.bias = at::randn({n_head_r}, gen);
            joint.anchor = anchor;
            at::Tensor merged = joint_attention_merged(q, k_cache.narrow(2, 0, start + n),
                                                       v_cache.narrow(2, 0, start + n), start, joint);
            at::Tensor rows = joint_attention_rows(q.transpose(1, 2).contiguous(), k_cache, v_cache, start, joint);
            REQUIRE(rows.sizes() == at::IntArrayRef({batch, n, n_head_r * d_r}));
            CHECK(max_diff(rows.view({batch, n, n_head_r, d_r}).transpose(1, 2), merged) <=
                  attention_bound(q, {k_cache, joint.keys}, {v_cache, joint.values}, 1.0 / std::sqrt(double(d_r))));
          }

  // joint_kv: each key rotated once into place (float32 and int8 entries) against the tensor ops,
  // with consecutive documents after an anchor and a batch of rows of different lengths.
  at::NoGradGuard off;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  PluginInitOptions init = joint_at_every_layer(model);
  init.consecutive_documents = init.documents_after_prefix = true;
  auto plugin = std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init));
  model.set_plugin(plugin);
  auto tokens = sample_documents(3, 10, 47);
  tokens[1].resize(6);
  auto docs = documents_of(model, tokens);
  {
    // Each block's K/V of the documents written in one pass (documents_kv), against block_kv's
    // tensor ops, taken while gradients are recorded; documents of 10 and 6 tokens padded together.
    at::AutoGradMode on(true);
    std::vector<DocumentKV> ops = plugin->encode_many(model.decoder(), {tokens[0], tokens[1], tokens[2]},
                                                      model.encoder_prefix_states());
    for (size_t i = 0; i < ops.size(); ++i)
      for (int64_t k = 0; k < plugin->config().n_blocks(); ++k) {
        INFO("document " << i << ", block " << k);
        REQUIRE(ops[i].keys[k].sizes() == docs[i]->keys[k].sizes());
        CHECK(docs[i]->keys[k].is_contiguous());
        // The encoder's layers up to block k's and its K/V projection, by two paths (helpers.hpp).
        const int64_t layers = plugin->config().read_depth(k) + 1, n_keys = docs[i]->n_tokens + static_cast<int64_t>(init.encoder_prefix.size());
        CHECK(max_diff(ops[i].keys[k], docs[i]->keys[k]) <= path_bound(model.config(), layers, n_keys, magnitude(docs[i]->keys[k])));
        CHECK(max_diff(ops[i].values[k], docs[i]->values[k]) <=
              path_bound(model.config(), layers, n_keys, magnitude(docs[i]->values[k])));
      }
  }
  std::vector<std::shared_ptr<const DocumentKV>> int8;
  for (const auto& doc : docs) int8.push_back(std::make_shared<const DocumentKV>(doc->to(at::kCPU, at::kChar)));
  const int64_t anchor = 7;
  auto general = [&](const LinkedDocuments& l) {
    at::AutoGradMode on(true);
    return plugin->joint_kv(plugin->weights(), l.keys, l.values, l.doc_counts, anchor);
  };
  int64_t max_position = anchor;
  for (const auto& doc : docs) max_position += doc->n_tokens;
  auto same = [&](const std::vector<JointKV>& a, const std::vector<JointKV>& b) {
    REQUIRE(a.size() == b.size());
    double worst = 0;
    for (size_t k = 0; k < a.size(); ++k) {
      REQUIRE(a[k].keys.sizes() == b[k].keys.sizes());
      CHECK(a[k].valid.defined() == b[k].valid.defined());
      if (a[k].valid.defined()) CHECK(a[k].valid.equal(b[k].valid));
      CHECK(a[k].anchor == b[k].anchor);
      // Keys rotated into place by two kernels: helpers.hpp's rope_bound at the farthest position.
      worst = std::max({worst, max_diff(a[k].keys, b[k].keys) / rope_bound(max_position, magnitude(b[k].keys)),
                        max_diff(a[k].values, b[k].values) / rope_bound(max_position, magnitude(b[k].values))});
    }
    return worst;  // in units of the bound
  };
  for (const auto& batch : std::vector<std::vector<std::vector<size_t>>>{{{0, 1, 2}}, {{2}, {1, 0}}}) {
    std::vector<std::vector<std::shared_ptr<const DocumentKV>>> as_float, as_int8;
    for (const auto& row : batch) {
      as_float.emplace_back();
      as_int8.emplace_back();
      for (size_t i : row) {
        as_float.back().push_back(docs[i]);
        as_int8.back().push_back(int8[i]);
      }
    }
    INFO("rows " << batch.size());
    LinkedDocuments f = Linker(c10::kCPU).link_batch(as_float);
    auto direct = plugin->joint_kv_direct(plugin->weights(), f.keys, f.values, f.doc_counts, anchor, {}, {});
    REQUIRE(direct.has_value());  // the path joint_kv takes here
    CHECK(same(*direct, general(f)) <= 1);
    CHECK(same(plugin->joint_kv(plugin->weights(), f.keys, f.values, f.doc_counts, anchor), *direct) == 0);
    // int8 linked as stored and placed from it, against the same entries read as float32 first.
    LinkedDocuments kept = Linker(c10::kCPU, true).link_batch(as_int8);
    REQUIRE(kept.keys[0][0].scalar_type() == at::kChar);
    LinkedDocuments read = Linker(c10::kCPU).link_batch(as_int8);
    REQUIRE(read.keys[0][0].scalar_type() == at::kFloat);
    auto direct8 = plugin->joint_kv_direct(plugin->weights(), kept.keys, kept.values, kept.doc_counts, anchor,
                                           kept.key_scales, kept.value_scales);
    REQUIRE(direct8.has_value());
    CHECK(same(*direct8, general(read)) <= 1);
    // With gradients recorded, int8 entries are dequantized for the general path.
    at::AutoGradMode on(true);
    CHECK(same(plugin->joint_kv(plugin->weights(), kept.keys, kept.values, kept.doc_counts, anchor,
                                kept.key_scales, kept.value_scales),
               general(read)) <= 1);
  }
  // int8 entries with float32 key scales per channel (as comb wrote them before float16 scales) are
  // placed as they are read; the default ones above have float16 scales, per channel on the
  // 10-token documents and per row on the 6-token one (head_dim 16).
  std::vector<std::shared_ptr<const DocumentKV>> per_channel;
  for (const auto& doc : docs) {
    DocumentKV old = doc->to(at::kCPU, at::kChar);
    for (size_t k = 0; k < old.keys.size(); ++k) {
      old.key_scales[k] = doc->keys[k].abs().amax(1, true) / 127.0;
      old.keys[k] = (doc->keys[k] / old.key_scales[k]).round().clamp(-127, 127).to(at::kChar);
    }
    per_channel.push_back(std::make_shared<const DocumentKV>(std::move(old)));
  }
  {
    LinkedDocuments kept = Linker(c10::kCPU, true).link(per_channel);
    REQUIRE(kept.key_scales[0][0].sizes() == at::IntArrayRef({2, 1, 16}));
    REQUIRE(kept.key_scales[0][0].scalar_type() == at::kFloat);
    REQUIRE(int8[1]->key_scales[0].sizes() == at::IntArrayRef({2, 6, 1}));
    REQUIRE(int8[0]->key_scales[0].scalar_type() == at::kHalf);
    LinkedDocuments read = Linker(c10::kCPU).link(per_channel);
    auto direct8 = plugin->joint_kv_direct(plugin->weights(), kept.keys, kept.values, kept.doc_counts, anchor,
                                           kept.key_scales, kept.value_scales);
    REQUIRE(direct8.has_value());
    CHECK(same(*direct8, general(read)) <= 1);
  }
  // A plug-in without joint blocks refuses documents linked int8.
  PluginInitOptions cross;  // a fresh plug-in of cross blocks
  cross.cross_layers = init.cross_layers;
  Model other = Model::load(oracle_dir() + "/tiny-llama");
  other.set_plugin(std::make_shared<Plugin>(Plugin::fresh(other.decoder(), cross)));
  std::vector<std::shared_ptr<const DocumentKV>> other_int8;
  for (const auto& doc : documents_of(other, tokens))
    other_int8.push_back(std::make_shared<const DocumentKV>(doc->to(at::kCPU, at::kChar)));
  LinkedDocuments kept = Linker(c10::kCPU, true).link(other_int8);
  CHECK_THROWS_WITH(logits_with(other, prompt_ids(5), &kept), Catch::Contains("Linker(device)"));
}

TEST_CASE("a cold request's documents and prompt in one pass: encoding first, then the prompt, up to rounding; "
          "a warm request reads what it stored",
          "[plugin][store]") {
  c10::InferenceMode guard;
  for (const std::string dtype : {"", "int8", "int8-int4", "int4"}) {
    INFO("plug-in cache dtype '" << dtype << "'");
    Model model = Model::load(oracle_dir() + "/tiny-llama");
    PluginInitOptions init = joint_at_every_layer(model);
    init.consecutive_documents = init.documents_after_prefix = true;
    init.encoder_prefix = {1, 2};
    auto plugin = std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init));
    auto gen = at::detail::createCPUGenerator(17);
    for (auto& b : plugin->mutable_weights().cross) b.doc_bias.add_(at::randn(b.doc_bias.sizes(), gen));
    if (!dtype.empty()) plugin->set_cache_dtype(dtype);
    plugin->refresh_fingerprint();
    model.set_plugin(plugin);
    REQUIRE(plugin->encodes_alongside(model.decoder()));

    auto tokens = sample_documents(4, 11, 53);
    tokens[1].resize(5);
    tokens[3] = tokens[0];  // linked twice: encoded once
    const int64_t anchor = 6;
    at::Tensor ids = prompt_ids(14);
    at::Tensor prefix = ids.narrow(1, 0, anchor), rest = ids.narrow(1, anchor, ids.size(1) - anchor);
    auto run = [&](PICacheStore& store, std::vector<bool>& cached, LinkedDocuments& linked, KVCache& cache) {
      cache = model.decoder().make_cache(1, ids.size(1) + 1);
      model.decoder().forward(prefix, cache);  // the instruction, as the prefix cache gives it
      return documents_in(model, &store).get_with_prompt(tokens, "", &cached, rest, cache, anchor, linked);
    };
    // In one pass.
    PICacheStore together{StoreOptions{}};
    std::vector<bool> cached;
    LinkedDocuments linked;
    KVCache cache = model.decoder().make_cache(1, 1);
    at::Tensor once = run(together, cached, linked, cache);
    REQUIRE(once.defined());
    CHECK(cached == std::vector<bool>{false, false, false, true});
    CHECK(cache.length() == ids.size(1));
    CHECK(linked.anchor == anchor);
    CHECK(linked.keys[0][0].scalar_type() == (dtype.empty() ? at::kFloat : at::kChar));
    // Encoding first (Documents::get), then the prompt reading them.
    PICacheStore apart_store{StoreOptions{}};
    auto docs = documents_in(model, &apart_store).get(tokens);
    LinkedDocuments apart = Linker(c10::kCPU, true).link(docs);
    apart.anchor = anchor;
    KVCache apart_cache = model.decoder().make_cache(1, ids.size(1) + 1);
    model.decoder().forward(prefix, apart_cache);
    at::Tensor twice = model.forward(rest, apart_cache, &apart);
    // The same numbers by other paths (helpers.hpp): the documents' K/V through the encoder, then
    // the decoder reading them.
    const double logits_tolerance = bound(model, ids.size(1), &linked, twice);
    CHECK(max_diff(once, twice) <= logits_tolerance);
    // The caches stored: the same up to rounding (int8: one step of a code at most). int4 keys are
    // coded rotated: an element's rounding difference r is at most sqrt(head_dim) r in a rotated
    // row's norm, a code at most one step off in each rotated channel, so sqrt(head_dim) (r + step)
    // bounds a rotated-back element, and coding again as int8 adds a step of its own.
    const double rotated = dtype == "int4" ? std::sqrt(double(model.config().head_dim)) : 1.0;
    for (size_t i = 0; i < 3; ++i) {
      auto a = together.get(Documents(model).key(tokens[i])), b = apart_store.get(Documents(model).key(tokens[i]));
      REQUIRE(a);
      REQUIRE(b);
      DocumentKV af = a->to(c10::kCPU, at::kFloat), bf = b->to(c10::kCPU, at::kFloat);
      for (size_t k : {size_t(0), af.keys.size() - 1}) {
        // The largest scale (int4 keys' coded scales decoded: the bytes are no scale).
        const double step = dtype.empty()     ? 0.0
                            : dtype == "int4" ? int4_key_scales(a->keys[k], a->key_scales[k]).max().item<double>()
                                              : a->key_scales[k].max().item<double>();
        const double step8 = dtype == "int4" ? a->int8_codes().key_scales[k].max().item<double>() : 0.0;
        const double rounding = path_bound(model.config(), plugin->config().read_depth(k) + 1,
                                           af.n_tokens + static_cast<int64_t>(init.encoder_prefix.size()),
                                           magnitude(bf.keys[k]));
        CHECK(max_diff(af.keys[k], bf.keys[k]) <= rotated * (rounding + 1.01 * step) + 1.01 * step8);
      }
    }
    // The next decoding step reads the joined keys the pass built.
    at::Tensor next = at::full({1, 1}, 7, at::kLong);
    at::Tensor step_once = model.forward(next, cache, &linked), step_apart = model.forward(next, apart_cache, &apart);
    CHECK(max_diff(step_once, step_apart) <= bound(model, ids.size(1) + 1, &linked, step_apart));
    // Warm: nothing to encode, so nothing computed here; the prompt then reads the stored entries,
    // which are what the pass read.
    std::vector<bool> warm_cached;
    LinkedDocuments warm;
    KVCache warm_cache = model.decoder().make_cache(1, 1);
    CHECK_FALSE(run(together, warm_cached, warm, warm_cache).defined());
    CHECK(warm_cached == std::vector<bool>{true, true, true, true});
    CHECK(warm_cache.length() == anchor);
    at::Tensor warm_logits = model.forward(rest, warm_cache, &warm);
    CHECK(max_diff(warm_logits, once) <= logits_tolerance);
    // One document cached, the others new: the pass reads the cached one as stored.
    PICacheStore mixed{StoreOptions{}};
    documents_in(model, &mixed).get(std::vector<std::vector<int32_t>>{tokens[1]});
    std::vector<bool> mixed_cached;
    LinkedDocuments mixed_linked;
    KVCache mixed_cache = model.decoder().make_cache(1, 1);
    at::Tensor part = run(mixed, mixed_cached, mixed_linked, mixed_cache);
    REQUIRE(part.defined());
    CHECK(mixed_cached == std::vector<bool>{false, true, false, true});
    CHECK(max_diff(part, twice) <= logits_tolerance);
  }
}

TEST_CASE("document reads: segments only from reads built for a paged step; residual reads in place equal a copy",
          "[plugin]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  PluginInitOptions init;
  init.reads = init.joint_attention = true;
  init.cross_layers = {0, 1};
  auto joint = std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init));
  model.set_plugin(joint);
  LinkedDocuments linked = Linker(c10::kCPU).link(documents_of(model, sample_documents(2, 12, 21)));
  std::vector<JointKV> blocks = joint->joint_kv(joint->weights(), linked.keys, linked.values, linked.doc_counts, 0);
  for (auto& b : blocks) {
    b.keys = b.keys.to(at::kFloat).contiguous();
    b.values = b.values.to(at::kFloat).contiguous();
  }
  // The biases a paged step reads are built once, for reads made for it; others do not build them.
  const DocumentReads plain = DocumentReads::joined(*joint, blocks);
  CHECK(plain.joint(0) != nullptr);
  CHECK_THROWS_WITH(plain.segments(0), Catch::Contains("paged = true"));
  const DocumentReads paged = DocumentReads::joined(*joint, blocks, /*paged=*/true);
  const JointSegments s = paged.segments(1);
  REQUIRE(s.lengths.size() == 1);
  CHECK(s.lengths[0] == blocks[1].keys.size(2));
  CHECK(s.keys[0] == blocks[1].keys.data_ptr<float>());
  REQUIRE(s.bias != nullptr);
  CHECK(s.bias[0] == joint->weights().cross[1].doc_bias[0].item<float>());

  // Reads whose documents come as segments alone (the fused CPU paged step's) are refused by every
  // other forward, which would otherwise run without the documents, before it writes anything.
  std::vector<std::vector<at::Tensor>> seg_keys, seg_values;
  for (const auto& b : blocks) {
    seg_keys.push_back({b.keys[0].contiguous()});
    seg_values.push_back({b.values[0].contiguous()});
  }
  const DocumentReads segments_alone = DocumentReads::segmented(*joint, seg_keys, seg_values);
  CHECK(segments_alone.segments_only());
  CHECK_FALSE(paged.segments_only());
  CHECK_FALSE(plain.segments_only());
  CHECK(segments_alone.joint(1) == nullptr);
  REQUIRE(segments_alone.segments(1).lengths.size() == 1);
  CHECK(segments_alone.segments(1).lengths[0] == blocks[1].keys.size(2));
  const at::Tensor ids = at::full({1, 3}, 5, at::kLong);
  const Decoder& dec = model.decoder();
  KVCache cache = dec.make_cache(1, 8);
  CHECK_THROWS_WITH(dec.forward(ids, cache, LogitsMode::last, &segments_alone), Catch::Contains("as segments"));
  CHECK(cache.length() == 0);
  CHECK_THROWS_WITH(dec.hidden(ids, &segments_alone), Catch::Contains("as segments"));
  Options generic;
  generic.cpu_kernels = false;
  const Model off = Model::load(oracle_dir() + "/tiny-llama", generic);
  REQUIRE(!off.decoder().cpu_kernels());
  BlockPool pool(off.config(), 4, 8);
  const std::vector<int32_t> row_blocks = pool.allocate(1);
  REQUIRE(row_blocks.size() == 1);
  const std::vector<Decoder::PagedRow> rows{{5, 0, &row_blocks, &segments_alone}};
  CHECK_THROWS_WITH(off.decoder().step_paged(pool, rows), Catch::Contains("as segments"));
  const std::vector<Decoder::PagedRow> plain_rows{{5, 0, &row_blocks, nullptr}};
  CHECK(off.decoder().step_paged(pool, plain_rows).size(0) == 1);  // the same row without documents runs

  // Residual blocks over linked documents read in place (a decoding step builds these) equal the
  // same over a copy of the linked tensors (training's form).
  Model residual = Model::load(oracle_dir() + "/tiny-llama");
  auto plugin = random_plugin(residual.decoder());
  residual.set_plugin(plugin);
  LinkedDocuments rl = Linker(c10::kCPU).link(documents_of(residual, sample_documents(2, 12, 22)));
  const DocumentReads in_place = DocumentReads::residual(*plugin, rl);
  const DocumentReads copied = DocumentReads::residual(*plugin, plugin->weights(), rl.keys, rl.values, rl.doc_counts);
  at::Tensor x = at::randn({1, 5, residual.config().n_embd});
  int changed = 0;
  for (int64_t l = 0; l < residual.config().n_layer; ++l) {
    at::Tensor a = in_place.before(l, x, 3);
    CHECK(at::equal(a, copied.before(l, x, 3)));
    changed += !at::equal(a, x);
  }
  CHECK(changed == plugin->config().n_blocks());  // each block read its documents
}

TEST_CASE("joint blocks at every layer read one document exactly as the decoder reads it in context", "[plugin]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  PluginInitOptions init = joint_at_every_layer(model);
  auto plugin = std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init));
  const PluginConfig& c = plugin->config();
  CHECK(c.joint_attention);
  CHECK(c.relative_positions);
  CHECK_FALSE(c.attention_sinks);
  CHECK(plugin->weights().cross[0].doc_bias.equal(at::zeros({model.config().n_head})));
  CHECK_FALSE(plugin->weights().cross[0].wq.defined());
  model.set_plugin(plugin);

  // A document read through the plug-in, the prompt after it: relative positions put the document
  // right before the prompt, each block's keys are its layer's keys of the document's own states,
  // and the softmax is shared, so this is the decoder over document + prompt.
  auto tokens = sample_documents(3, 12, 21);
  at::Tensor ids = prompt_ids(9);
  LinkedDocuments one = Linker(c10::kCPU).link(documents_of(model, {tokens[0]}));
  at::Tensor got = logits_with(model, ids, &one)[0];
  std::vector<int64_t> whole(tokens[0].begin(), tokens[0].end());
  for (int64_t i = 0; i < ids.size(1); ++i) whole.push_back(ids[0][i].item<int64_t>());
  at::Tensor in_context = logits_with(tiny_model(), at::tensor(whole, at::kLong).unsqueeze(0), nullptr)[0];
  const int64_t n_doc = static_cast<int64_t>(tokens[0].size());
  at::Tensor want_in_context = in_context.narrow(0, n_doc, ids.size(1));
  CHECK(max_diff(got, want_in_context) <= bound(model, ids.size(1), &one, want_in_context));

  // Several documents: any order gives the same logits; none is the bare decoder, bit for bit.
  auto docs = documents_of(model, tokens);
  LinkedDocuments linked = Linker(c10::kCPU).link(docs);
  at::Tensor want = logits_with(model, ids, &linked);
  LinkedDocuments reversed = Linker(c10::kCPU).link({docs[2], docs[0], docs[1]});
  CHECK(max_diff(logits_with(model, ids, &reversed), want) <= bound(model, ids.size(1), &linked, want));
  LinkedDocuments none;
  CHECK(logits_with(model, ids, &none).equal(logits_with(tiny_model(), ids, nullptr)));
  // A batch of two requests with different documents equals each alone (rows padded).
  LinkedDocuments pair = Linker(c10::kCPU).link_batch({{docs[0]}, {docs[1], docs[2]}});
  at::Tensor both = logits_with(model, at::cat({ids, ids}), &pair);
  LinkedDocuments second = Linker(c10::kCPU).link({docs[1], docs[2]});
  CHECK(max_diff(both[0], got) <= bound(model, ids.size(1), &one, got));  // padded rows: other paths
  at::Tensor alone_second = logits_with(model, ids, &second)[0];
  CHECK(max_diff(both[1], alone_second) <= bound(model, ids.size(1), &second, alone_second));
  // Decoding after a cached prompt reads the documents with the query at its real position.
  KVCache cache = model.decoder().make_cache(1, ids.size(1));
  model.forward(ids.narrow(1, 0, ids.size(1) - 1), cache, &linked, LogitsMode::all);
  at::Tensor last = model.forward(ids.narrow(1, ids.size(1) - 1, 1), cache, &linked, LogitsMode::all);
  CHECK(max_diff(last[0][0], want[0][ids.size(1) - 1]) <= bound(model, ids.size(1), &linked, want));

  // The file holds the K/V projections and biases only, and loads to the same plug-in.
  std::string path = temp_dir("joint") + "/joint.safetensors";
  plugin->save(path);
  SafetensorsFile file(path);
  for (const auto& name : file.names()) {
    CHECK(name.find("chunk_model.layers.") == std::string::npos);
    CHECK(name.find("q_proj") == std::string::npos);
  }
  Model loaded = Model::load(oracle_dir() + "/tiny-llama");
  loaded.set_plugin(std::make_shared<Plugin>(Plugin::load(path, loaded.decoder())));
  CHECK(loaded.plugin()->fingerprint() == plugin->fingerprint());
  CHECK(loaded.plugin()->config().joint_attention);
  LinkedDocuments again = Linker(c10::kCPU).link(documents_of(loaded, tokens));
  CHECK(logits_with(loaded, ids, &again).equal(want));
}

TEST_CASE("joint blocks with the documents after the prefix: the prefix reads none and comes from the prefix cache",
          "[plugin]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  PluginInitOptions init = joint_at_every_layer(model);
  init.documents_after_prefix = true;
  auto plugin = std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init));
  REQUIRE(plugin->config().documents_after_prefix);
  auto gen = at::detail::createCPUGenerator(8);
  for (auto& b : plugin->mutable_weights().cross) b.doc_bias.add_(at::randn(b.doc_bias.sizes(), gen));
  plugin->refresh_fingerprint();
  model.set_plugin(plugin);

  auto tokens = sample_documents(3, 12, 31);
  auto docs = documents_of(model, tokens);
  at::Tensor ids = prompt_ids(13);
  const int64_t anchor = 6;  // the first 6 prompt tokens are the prefix
  LinkedDocuments linked = Linker(c10::kCPU).link(docs);
  linked.anchor = anchor;
  at::Tensor got = logits_with(model, ids, &linked)[0];
  at::Tensor bare = logits_with(tiny_model(), ids, nullptr)[0];
  // The prefix's positions read no document: the bare decoder's; the question's do.
  CHECK(max_diff(got.narrow(0, 0, anchor), bare.narrow(0, 0, anchor)) <= logits_bound(tiny_model(), anchor, bare));
  CHECK((got.narrow(0, anchor, ids.size(1) - anchor) - bare.narrow(0, anchor, ids.size(1) - anchor))
            .abs().max().item<double>() > 1e-3);
  // Any order of the documents gives the same logits.
  LinkedDocuments reversed = Linker(c10::kCPU).link({docs[2], docs[1], docs[0]});
  reversed.anchor = anchor;
  CHECK(max_diff(logits_with(model, ids, &reversed)[0], got) <= bound(model, ids.size(1), &linked, got));
  // Decoding after a cached prompt: the same anchor, the query at its real position.
  KVCache cache = model.decoder().make_cache(1, ids.size(1));
  model.forward(ids.narrow(1, 0, ids.size(1) - 1), cache, &linked, LogitsMode::all);
  at::Tensor last = model.forward(ids.narrow(1, ids.size(1) - 1, 1), cache, &linked, LogitsMode::all);
  CHECK(max_diff(last[0][0], got[ids.size(1) - 1]) <= bound(model, ids.size(1), &linked, got));

  // The keys move to end before the anchor: a query at anchor + j scores them as a query at j
  // scores the keys of anchor 0 (RoPE depends on the distance only).
  auto k0 = plugin->joint_kv(plugin->weights(), linked.keys, linked.values, linked.doc_counts, 0);
  auto ka = plugin->joint_kv(plugin->weights(), linked.keys, linked.values, linked.doc_counts, anchor);
  REQUIRE(ka[1].anchor == anchor);
  const int64_t hd = model.config().head_dim;
  at::Tensor q = at::randn({1, 1, 1, hd}, gen);
  const auto& dec = model.decoder();
  for (int64_t j : {0, 3}) {
    at::Tensor qa = apply_rope(q, dec.rope_cos()[anchor + j].view({1, 1, 1, hd}), dec.rope_sin()[anchor + j].view({1, 1, 1, hd}));
    at::Tensor qj = apply_rope(q, dec.rope_cos()[j].view({1, 1, 1, hd}), dec.rope_sin()[j].view({1, 1, 1, hd}));
    at::Tensor sa = at::matmul(qa, ka[1].keys.narrow(1, 0, 1).transpose(-1, -2));
    at::Tensor s0 = at::matmul(qj, k0[1].keys.narrow(1, 0, 1).transpose(-1, -2));
    // Query and key each rotated by other angles to the same distance, each off by at most
    // rho = (2 p + 15) u of its length (helpers.hpp's rope_bound), then dot products of head_dim
    // terms: |difference| <= (2 rho + 2 gamma(hd)) |q| max |k|.
    const double rho = (2.0 * (anchor + j + keys_read(0, &linked)) + 15) * kUnitRoundoff;
    const double lengths = qj.norm().item<double>() * k0[1].keys.narrow(1, 0, 1).norm(2, -1).max().item<double>();
    CHECK(max_diff(sa, s0) <= (2 * rho + 2 * gamma32(hd)) * lengths);
  }

  // A plug-in without the layout refuses an anchor; the layout survives a save and load.
  init.documents_after_prefix = false;
  Model other = Model::load(oracle_dir() + "/tiny-llama");
  other.set_plugin(std::make_shared<Plugin>(Plugin::fresh(other.decoder(), init)));
  LinkedDocuments plain = Linker(c10::kCPU).link(documents_of(other, tokens));
  plain.anchor = anchor;
  CHECK_THROWS_WITH(logits_with(other, ids, &plain), Catch::Contains("documents_after_prefix"));
  std::string path = temp_dir("after-prefix") + "/p.safetensors";
  plugin->save(path);
  CHECK(Plugin::load(path, model.decoder()).config().documents_after_prefix);

  // Through the engine: a warm request takes the prefix's whole blocks from the prefix cache and
  // computes the rest, with the logits of a cold one.
  PicRequest r;
  for (int64_t i = 0; i < 20; ++i) r.prefix.push_back(static_cast<int32_t>(ids[0][i % ids.size(1)].item<int64_t>()));
  int64_t doc_tokens = 0;
  for (const auto& t : tokens) {
    r.documents.emplace_back(t.begin(), t.end());
    doc_tokens += static_cast<int64_t>(t.size());
  }
  r.suffix = {11, 12, 13, 14, 15};
  PicOptions o;
  o.prefix_block = 8;
  PicEngine engine(model, Method::comb, o);
  PicPrefill cold = engine.prefill(r, 1);
  CHECK(cold.reused == 0);
  CHECK(cold.computed == 20 + 5 + doc_tokens);  // prefix, question, the documents
  std::reverse(r.documents.begin(), r.documents.end());
  PicPrefill warm = engine.prefill(r, 1);
  CHECK(warm.reused == 16 + doc_tokens);  // two whole prefix blocks of 8, the documents
  CHECK(warm.computed == 4 + 5);        // the prefix's last 4 tokens and the question
  const int64_t all_tokens = static_cast<int64_t>(r.prefix.size() + r.suffix.size()) + doc_tokens;
  CHECK(max_diff(warm.logits, cold.logits) <= logits_bound(model, all_tokens, cold.logits));
  PicPrefill fresh = PicEngine(model, Method::comb, o).prefill(r, 1);
  CHECK(max_diff(warm.logits, fresh.logits) <= logits_bound(model, all_tokens, fresh.logits));

  // A prompt that starts with the plug-in's encoder prefix: on a cold request those tokens' K/V
  // come from the states the model holds for the encoder (through every decoder layer), with the
  // logits of the prompt computed in full.
  init.documents_after_prefix = true;
  init.encoder_prefix.assign(r.prefix.begin(), r.prefix.begin() + 10);
  Model held = Model::load(oracle_dir() + "/tiny-llama");
  held.set_plugin(std::make_shared<Plugin>(Plugin::fresh(held.decoder(), init)));
  const KVCache* states = held.encoder_prefix_states();
  REQUIRE(states);
  KVCache own = held.decoder().make_cache(1, 10);
  held.decoder().forward(at::tensor(init.encoder_prefix, at::kLong).unsqueeze(0), own);
  for (int64_t l = 0; l < held.config().n_layer; ++l) {  // every layer, not the encoder's alone
    INFO("layer " << l);
    // Layers [0, l) and layer l's projection by two paths (helpers.hpp).
    at::Tensor want_k = own.keys(l).narrow(2, 0, 10), want_v = own.values(l).narrow(2, 0, 10);
    CHECK(max_diff(states->keys(l).narrow(2, 0, 10), want_k) <= path_bound(held.config(), l + 1, 10, magnitude(want_k)));
    CHECK(max_diff(states->values(l).narrow(2, 0, 10), want_v) <= path_bound(held.config(), l + 1, 10, magnitude(want_v)));
  }
  PicPrefill seeded = PicEngine(held, Method::comb, o).prefill(r, 1);
  CHECK(seeded.reused == 10);
  CHECK(seeded.computed == 10 + 5 + doc_tokens);
  KVCache full_prompt = held.decoder().make_cache(1, 25 + doc_tokens);
  held.decoder().forward(at::tensor(std::vector<int64_t>(r.prefix.begin(), r.prefix.end()), at::kLong).unsqueeze(0),
                         full_prompt);
  LinkedDocuments unused;
  at::Tensor computed = Documents(held).get_with_prompt(r.documents, "", nullptr,
                                                  at::tensor(std::vector<int64_t>(r.suffix.begin(), r.suffix.end()),
                                                             at::kLong).unsqueeze(0),
                                                  full_prompt, 20, unused);
  REQUIRE(computed.defined());
  CHECK(max_diff(seeded.logits, computed[0][-1]) <= logits_bound(held, 25 + doc_tokens, computed[0][-1]));
  // One token different: nothing taken.
  r.prefix[3] = r.prefix[3] == 1 ? 2 : 1;
  CHECK(PicEngine(held, Method::comb, o).prefill(r, 1).reused == 0);
}

TEST_CASE("joint blocks with consecutive documents: at step 0, naive reuse's attention; the order linked counts",
          "[plugin]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  PluginInitOptions init = joint_at_every_layer(model);
  init.consecutive_documents = true;  // no encoder prefix
  auto plugin = std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init));
  REQUIRE(plugin->config().consecutive_documents);
  model.set_plugin(plugin);

  // Each document's encoder states are the decoder's own for it alone from position 0, which is
  // what naive reuse caches; lying one after another before the question, they are read at the
  // distances naive reuse places them at. So the question's logits are naive reuse's.
  PicRequest r;
  for (const auto& t : sample_documents(3, 9, 41)) r.documents.emplace_back(t.begin(), t.end());
  r.documents[1].resize(5);  // documents of different lengths
  r.suffix = {11, 12, 13, 14, 15, 16};
  PicEngine naive(model, Method::naive), comb(model, Method::comb);
  at::Tensor want = naive.prefill(r, 1).logits, got = comb.prefill(r, 1).logits;
  int64_t all_tokens = static_cast<int64_t>(r.suffix.size());
  for (const auto& d : r.documents) all_tokens += static_cast<int64_t>(d.size());
  CHECK(max_diff(got, want) <= logits_bound(model, all_tokens, want));  // naive's kernels against comb's
  // Another order: naive reuse's answer for that order, not the first one's.
  std::swap(r.documents[0], r.documents[2]);
  at::Tensor want2 = naive.prefill(r, 1).logits, got2 = comb.prefill(r, 1).logits;
  CHECK(max_diff(got2, want2) <= logits_bound(model, all_tokens, want2));
  // Where the order shows: each document's keys turned back by the tokens linked after it.
  auto docs = documents_of(model, {std::vector<int32_t>(r.documents[0].begin(), r.documents[0].end()),
                                   std::vector<int32_t>(r.documents[1].begin(), r.documents[1].end())});
  LinkedDocuments two = Linker(c10::kCPU).link(docs);
  auto joined = plugin->joint_kv(plugin->weights(), two.keys, two.values, two.doc_counts);
  const int64_t hd = model.config().head_dim, n0 = docs[0]->n_tokens, n1 = docs[1]->n_tokens;
  const auto& dec = model.decoder();
  for (int64_t b : {int64_t(0), model.config().n_layer - 1}) {
    at::Tensor first = joined[b].keys[0].narrow(1, 0, n0), second = joined[b].keys[0].narrow(1, n0, n1);
    at::Tensor turned = apply_rope(docs[0]->keys[b], dec.rope_cos()[n1].view({1, 1, hd}), -dec.rope_sin()[n1].view({1, 1, hd}));
    CHECK(max_diff(first, turned) <= rope_bound(n0 + n1, magnitude(turned)));  // turned back by n1, two kernels
    CHECK(second.equal(docs[1]->keys[b]));  // the last one stays where it was encoded
    CHECK((first - docs[0]->keys[b]).abs().max().item<double>() > 1e-2);
  }

  // One document: the same as the shared layout (the last document ends at -1 in both).
  PluginInitOptions shared_init = init;
  shared_init.consecutive_documents = false;
  Model shared = Model::load(oracle_dir() + "/tiny-llama");
  shared.set_plugin(std::make_shared<Plugin>(Plugin::fresh(shared.decoder(), shared_init)));
  auto one = sample_documents(1, 11, 43);
  at::Tensor ids = prompt_ids(7);
  LinkedDocuments a = Linker(c10::kCPU).link(documents_of(model, one));
  LinkedDocuments b = Linker(c10::kCPU).link(documents_of(shared, one));
  CHECK(logits_with(model, ids, &a).equal(logits_with(shared, ids, &b)));

  // The layout survives a save and load, and needs joint blocks.
  std::string path = temp_dir("consecutive") + "/p.safetensors";
  plugin->save(path);
  CHECK(Plugin::load(path, model.decoder()).config().consecutive_documents);
}

TEST_CASE("a document span shrinks consecutive documents' distances in proportion, on every joining path",
          "[plugin]") {
  at::NoGradGuard off;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  PluginInitOptions init = joint_at_every_layer(model);
  init.consecutive_documents = true;
  auto plugin = std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init));
  model.set_plugin(plugin);
  auto tokens = sample_documents(3, 9, 53);
  tokens[1].resize(5);  // documents of different lengths
  auto docs = documents_of(model, tokens);
  LinkedDocuments l = Linker(c10::kCPU).link(docs);
  const int64_t hd = model.config().head_dim, span = 10;
  std::vector<int64_t> offsets, lens;  // where each document begins in the row; its tokens
  int64_t total = 0;
  for (const auto& d : docs) offsets.push_back(total), lens.push_back(d->keys[0].size(1)), total += lens.back();
  REQUIRE(total > span);

  // The arithmetic: unchanged up to the span, then in proportion, rounded down.
  Plugin spanned = *plugin;
  spanned.set_document_span(span);
  CHECK(spanned.config().document_offset(14, 23) == 6);  // 14 * 10 / 23 = 6.09
  CHECK(spanned.config().document_offset(9, 23) == 3);   // 90 / 23 = 3.9
  CHECK(spanned.config().document_offset(0, 23) == 0);
  CHECK(spanned.config().document_offset(7, span) == 7);  // rows within the span: as linked
  CHECK(plugin->config().document_offset(14, 23) == 14);
  CHECK(spanned.fingerprint() != plugin->fingerprint());  // caches keyed apart
  std::vector<int64_t> turns;  // each document's distance from the question (tokens after it), shrunk
  for (size_t i = 0; i < docs.size(); ++i) turns.push_back((total - offsets[i] - lens[i]) * span / total);
  REQUIRE(turns[0] > 0);
  REQUIRE(turns[2] == 0);

  // Both joining paths place document i turned back by its shrunk distance: the tensor ops (as
  // training runs them, gradients recorded) and the one-pass CPU path, each called by name so that
  // the test does not rest on joint_kv's choice.
  auto joined = [&](const Plugin& p, bool ops, int64_t anchor = 0) {
    if (ops) {
      at::AutoGradMode mode(true);
      return p.joint_kv(p.weights(), l.keys, l.values, l.doc_counts, anchor);
    }
    auto direct = p.joint_kv_direct(p.weights(), l.keys, l.values, l.doc_counts, anchor, {}, {});
    REQUIRE(direct.has_value());
    return std::move(*direct);
  };
  // Keys turned by `turn` positions (back when negative), with the decoder's RoPE tables.
  auto turned = [&](const at::Tensor& keys, int64_t turn) {
    if (turn == 0) return keys;
    const int64_t at = std::abs(turn);
    at::Tensor sin = model.decoder().rope_sin()[at].view({1, 1, hd});
    return apply_rope(keys, model.decoder().rope_cos()[at].view({1, 1, hd}), turn < 0 ? -sin : sin);
  };
  for (bool ops : {true, false}) {
    INFO((ops ? "tensor ops" : "one pass"));
    auto got = joined(spanned, ops);
    REQUIRE(got.size() == static_cast<size_t>(plugin->config().n_blocks()));
    for (int64_t b : {int64_t(0), plugin->config().n_blocks() - 1})
      for (size_t i = 0; i < docs.size(); ++i) {
        const at::Tensor part = got[b].keys[0].narrow(1, offsets[i], lens[i]);
        at::Tensor want = turned(docs[i]->keys[b], -turns[i]);
        CHECK(max_diff(part, want) <= rope_bound(total, magnitude(want)));
        CHECK(got[b].values[0].narrow(1, offsets[i], lens[i]).equal(docs[i]->values[b]));
      }
    // Against no span: the first document moved (turned by less), the last not.
    auto plain = joined(*plugin, ops);
    CHECK(max_diff(got[0].keys[0].narrow(1, 0, lens[0]), plain[0].keys[0].narrow(1, 0, lens[0])) > 1e-2);
    CHECK(got[0].keys[0].narrow(1, offsets[2], lens[2]).equal(plain[0].keys[0].narrow(1, offsets[2], lens[2])));
    // A span the row does not exceed changes nothing, bit for bit.
    Plugin wide = *plugin;
    wide.set_document_span(total);
    auto same = joined(wide, ops);
    for (size_t b = 0; b < same.size(); ++b) CHECK(same[b].keys.equal(plain[b].keys));
  }

  // With the distances up to `near` kept: a document ending within them is turned as linked, one
  // beyond them into (near, span] in proportion; on both paths.
  Plugin kept = *plugin;
  const int64_t near = 4;
  kept.set_document_span(span, near);
  CHECK(kept.config().document_offset(3, 23) == 3);      // within `near`: as linked
  CHECK(kept.config().document_offset(14, 23) == 7);     // 4 + (14 - 4) * (10 - 4) / (23 - 4) = 7.16
  CHECK(kept.config().document_offset(23, 23) == span);  // the farthest lands at the span
  CHECK(kept.config().document_offset(14, span) == 14);  // rows within the span: as linked
  CHECK(kept.fingerprint() != spanned.fingerprint());
  for (bool ops : {true, false}) {
    INFO((ops ? "tensor ops, near kept" : "one pass, near kept"));
    auto got = joined(kept, ops);
    const int64_t b = kept.config().n_blocks() - 1;
    for (size_t i = 0; i < docs.size(); ++i) {
      const int64_t after = total - offsets[i] - lens[i];
      const int64_t turn = after <= near ? after : near + (after - near) * (span - near) / (total - near);
      at::Tensor want = turned(docs[i]->keys[b], -turn);
      CHECK(max_diff(got[b].keys[0].narrow(1, offsets[i], lens[i]), want) <= rope_bound(total, magnitude(want)));
    }
  }

  // After an anchor (documents after the prefix, as the shipped plug-in places them): each document
  // turned back by its shrunk distance and forward by the anchor, on both paths.
  PluginInitOptions after_prefix = init;
  after_prefix.documents_after_prefix = true;
  Plugin anchored = Plugin::fresh(model.decoder(), after_prefix);
  anchored.set_document_span(span);
  const int64_t anchor = 5;
  for (bool ops : {true, false}) {
    INFO((ops ? "tensor ops, anchor 5" : "one pass, anchor 5"));
    auto got = joined(anchored, ops, anchor);
    const int64_t b = anchored.config().n_blocks() - 1;
    for (size_t i = 0; i < docs.size(); ++i) {
      at::Tensor want = turned(turned(docs[i]->keys[b], -turns[i]), anchor);
      // two turns against one (or two) of another kernel: twice the bound of one
      CHECK(max_diff(got[b].keys[0].narrow(1, offsets[i], lens[i]), want) <=
            2 * rope_bound(total + anchor, magnitude(want)));
    }
  }

  // It survives a save and load; a negative span, or one on documents that are not consecutive, is refused.
  std::string path = temp_dir("span") + "/p.safetensors";
  spanned.save(path);
  CHECK(Plugin::load(path, model.decoder()).config().document_span == span);
  const std::string before = spanned.fingerprint();
  CHECK_THROWS_WITH(spanned.set_document_span(-1), Catch::Contains("found -1"));
  CHECK(spanned.config().document_span == span);  // a refused span changes nothing
  CHECK(spanned.fingerprint() == before);
  PluginInitOptions apart = init;
  apart.consecutive_documents = false;
  Plugin shared = Plugin::fresh(model.decoder(), apart);
  CHECK_THROWS_WITH(shared.set_document_span(64), Catch::Contains("not consecutive"));
  CHECK(shared.config().document_span == 0);
  CHECK_THROWS_WITH(kept.set_document_span(span, span), Catch::Contains("document_near (10 tokens)"));
  CHECK_THROWS_WITH(kept.set_document_span(0, near), Catch::Contains("(0: none set)"));
  CHECK_THROWS_WITH(kept.set_document_span(span, -2), Catch::Contains("found -2"));
  CHECK(kept.config().document_near == near);
  kept.save(path);
  CHECK(Plugin::load(path, model.decoder()).config().document_near == near);
  CHECK(Plugin::load(path, model.decoder()).fingerprint() == kept.fingerprint());
  nlohmann::json j = spanned.config().to_json();
  CHECK(j["document_span"] == span);
  CHECK_FALSE(j.contains("document_near"));  // 0: not written
  j["document_span"] = -3;  // a file that says so is refused when loaded
  save_safetensors(path, spanned.named_tensors(), {{"comb.plugin", j.dump()}});
  CHECK_THROWS_WITH(Plugin::load(path, model.decoder()), Catch::Contains("document_span is 0 (off) or a number of "
                                                                         "tokens, found -3"));
  j["document_span"] = 1.5;
  CHECK_THROWS_WITH(PluginConfig::from_json(j, "test"), Catch::Contains("'document_span' should be an integer"));
}

TEST_CASE("documents encoded together equal each encoded alone; a request's order changes no cache", "[plugin]") {
  c10::InferenceMode guard;
  Model model = Model::load(oracle_dir() + "/tiny-llama");
  PluginInitOptions init = joint_at_every_layer(model);
  init.encoder_prefix = {1, 2, 3};  // read before every document, from states computed once
  auto plugin = std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init));
  REQUIRE(plugin->encoder_is_base());
  model.set_plugin(plugin);
  // Documents of several lengths (some batched together, some alone), one of them twice.
  std::vector<std::vector<int32_t>> docs;
  for (int64_t len : {5, 6, 6, 14, 3, 40}) docs.push_back(sample_documents(1, len, 50 + len + docs.size())[0]);
  docs.push_back(docs[1]);
  const KVCache states = plugin->encoder_prefix_states(model.decoder());
  std::vector<DocumentKV> together = plugin->encode_many(model.decoder(), docs, &states);
  REQUIRE(together.size() == docs.size());
  for (size_t i = 0; i < docs.size(); ++i) {
    // Alone, by the training path (the prefix read with the document, generic layers).
    auto [k, v] = plugin->encode_batch(model.decoder(), plugin->weights(),
                                       at::tensor(std::vector<int64_t>(docs[i].begin(), docs[i].end())).unsqueeze(0), {});
    REQUIRE(together[i].n_tokens == static_cast<int64_t>(docs[i].size()));
    for (int64_t b : {int64_t(0), plugin->config().n_blocks() - 1}) {
      // The encoder's layers up to block b's and its projection, by two paths (helpers.hpp).
      const int64_t layers = plugin->config().read_depth(b) + 1, n_keys = together[i].n_tokens + 3;
      CHECK(max_diff(together[i].keys[b], k[b][0]) <= path_bound(model.config(), layers, n_keys, magnitude(k[b][0])));
      CHECK(max_diff(together[i].values[b], v[b][0]) <= path_bound(model.config(), layers, n_keys, magnitude(v[b][0])));
    }
  }
  // Through the model and a store: each document once, the same caches in any order.
  PICacheStore store(StoreOptions{});
  std::vector<bool> cached;
  auto first = documents_in(model, &store).get(docs, "", &cached);
  CHECK(store.stats().host.entries == 6);
  CHECK(cached == std::vector<bool>{false, false, false, false, false, false, true});  // the repeat: not computed again
  CHECK(first[6] == first[1]);
  std::vector<std::vector<int32_t>> reversed(docs.rbegin(), docs.rend());
  auto second = Documents(model).get(reversed);
  for (size_t i = 0; i < docs.size(); ++i)
    for (size_t b = 0; b < first[i]->keys.size(); ++b) {
      CHECK(second[docs.size() - 1 - i]->keys[b].equal(first[i]->keys[b]));
      CHECK(second[docs.size() - 1 - i]->values[b].equal(first[i]->values[b]));
    }
}

TEST_CASE("split_rows copies each document's rows of every block, on the CPU a copy each", "[plugin]") {
  auto gen = at::detail::createCPUGenerator(31);
  const int64_t batch = 2, n_kv = 2, n = 12, hd = 8;
  std::vector<at::Tensor> keys, values;
  for (int b = 0; b < 2; ++b) {
    keys.push_back(at::randn({batch, n, n_kv, hd}, gen).transpose(1, 2));  // a projection's view
    values.push_back(at::randn({batch, n_kv, n, hd}, gen));
  }
  const std::vector<std::array<int64_t, 3>> rows{{0, 0, 3}, {1, 4, 8}, {0, 11, 1}};
  const std::vector<DocumentKV> docs = Plugin::split_rows(keys, values, rows);
  REQUIRE(docs.size() == rows.size());
  for (size_t d = 0; d < rows.size(); ++d) {
    const auto [row, first, len] = rows[d];
    CHECK(docs[d].n_tokens == len);
    REQUIRE(docs[d].keys.size() == 2);
    for (size_t b = 0; b < 2; ++b) {
      INFO("document " << d << ", block " << b);
      CHECK(docs[d].keys[b].is_contiguous());
      CHECK(at::equal(docs[d].keys[b], keys[b][row].narrow(1, first, len)));
      CHECK(at::equal(docs[d].values[b], values[b][row].narrow(1, first, len)));
    }
  }
  // split_documents: the first lens[d] positions of row d.
  const std::vector<DocumentKV> firsts = Plugin::split_documents(keys, values, {5, 12});
  CHECK(at::equal(firsts[1].keys[0], keys[0][1]));
  CHECK(at::equal(firsts[0].values[1], values[1][0].narrow(1, 0, 5)));
  CHECK_THROWS_WITH(Plugin::split_rows(keys, {values[0]}, rows), Catch::Contains("2 key and 1 value blocks"));
  CHECK_THROWS_WITH(Plugin::split_rows(keys, values, {{2, 0, 1}}),
                    Catch::Contains("document 0: batch row 2, positions [0, 1) of a batch [2, 12]"));
  CHECK_THROWS_WITH(Plugin::split_rows(keys, values, {{0, 0, 3}, {1, 10, 3}}),
                    Catch::Contains("document 1: batch row 1, positions [10, 13)"));
  CHECK_THROWS_WITH(Plugin::split_rows(keys, values, {{0, 2, 0}}), Catch::Contains("positions [2, 2)"));
  // One head: a document's slice is contiguous already, yet copied, so that its entry does not hold
  // the whole batch.
  const at::Tensor one = at::randn({1, 1, n, hd}, gen);
  const DocumentKV alone = Plugin::split_rows({one}, {one}, {{0, 4, 3}})[0];
  CHECK(at::equal(alone.keys[0], one[0].narrow(1, 4, 3)));
  CHECK(alone.keys[0].storage().nbytes() == static_cast<size_t>(3 * hd * 4));
  CHECK(alone.values[0].storage().nbytes() == static_cast<size_t>(3 * hd * 4));
  // The splitter hands its entries over once.
  comb::detail::DocumentSplit split({{0, 0, 2}}, 1);
  CHECK_THROWS_WITH(split.take(), Catch::Contains("block 0 of 1 was never added"));
  split.add(0, one, one);
  CHECK(split.take().size() == 1);
  CHECK_THROWS_WITH(split.take(), Catch::Contains("taken already"));
  CHECK_THROWS_WITH(split.add(0, one, one), Catch::Contains("added after the entries were taken"));
}
