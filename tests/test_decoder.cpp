// The decoder against Hugging Face transformers, the KV cache, generation, and model-level errors.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <set>

#include "helpers.hpp"

using namespace comb;
using namespace comb::test;
namespace fs = std::filesystem;

namespace {
at::Tensor full_logits(const Decoder& dec, const at::Tensor& ids) {
  KVCache cache = dec.make_cache(1, ids.size(1));
  return dec.forward(ids, cache, LogitsMode::all)[0];  // [n, vocab]
}
}  // namespace

namespace {
bool mapped(const std::string& library) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find(library) != std::string::npos) return true;
  return false;
}
}  // namespace

// First in this file (the [decoder] run's first test): nothing before it asked for CUDA.
TEST_CASE("a CPU model loads none of LibTorch's CUDA libraries; a CUDA request loads them", "[decoder][cuda]") {
  Model model = Model::load(model_path());
  CHECK(model.generate(model.chat_prompt("Hi"), GenerateOptions{2}).tokens.size() <= 2);
  CHECK_FALSE(mapped("libtorch_cuda.so"));
  CHECK_FALSE(mapped("libcublas"));
  const CudaBackend& backend = load_cuda_backend();
  INFO(backend.detail);
  CHECK(&backend == &load_cuda_backend());  // once per process
  CHECK(backend.loaded == mapped("libtorch_cuda.so"));
  CHECK(backend.comb_ops == mapped("libcomb_cuda.so"));
  if (!backend.loaded) {
    CHECK_THROWS_WITH(Model::load(model_path(), Options{"cuda"}), Catch::Contains("no CUDA device"));
  } else if (!at::hasCUDA()) {
    CHECK_FALSE(cuda_available());
    CHECK_THROWS_WITH(Model::load(model_path(), Options{"cuda"}), Catch::Contains("no CUDA device"));
  } else {
    CHECK(cuda_available());
  }
}

TEST_CASE("logits match transformers on the same GGUF (fp32, CPU)", "[decoder][parity]") {
  c10::InferenceMode guard;
  const Model& model = default_model();
  SafetensorsFile ref(oracle_dir() + "/decoder_reference.safetensors");
  int n_prompts = 0;
  for (int i = 0; ref.find("p" + std::to_string(i) + ".ids"); ++i, ++n_prompts) {
    std::string p = "p" + std::to_string(i) + ".";
    at::Tensor ids = ref.load(p + "ids", at::kLong).unsqueeze(0);
    at::Tensor positions = ref.load(p + "positions", at::kLong);
    at::Tensor want = ref.load(p + "logits", at::kFloat);
    at::Tensor got = full_logits(model.decoder(), ids).index_select(0, positions);
    double diff = (got - want).abs().max().item<double>();
    INFO("prompt " << i << ": " << ids.size(1) << " tokens, max |diff| " << diff);
    CHECK(ids.size(1) >= 10);
    CHECK(ids.size(1) <= 500);
    CHECK(diff <= logits_bound(model, ids.size(1), want));  // transformers' kernels against comb's (helpers.hpp)
    WARN("prompt " << i << " (" << ids.size(1) << " tokens): max |logit diff| vs transformers = " << diff);
  }
  CHECK(n_prompts >= 5);
}

TEST_CASE("greedy 64-token continuations match transformers", "[decoder][parity]") {
  c10::InferenceMode guard;
  const Decoder& dec = default_model().decoder();
  SafetensorsFile ref(oracle_dir() + "/decoder_reference.safetensors");
  for (int i = 0; ref.find("p" + std::to_string(i) + ".ids"); ++i) {
    std::string p = "p" + std::to_string(i) + ".";
    at::Tensor ids = ref.load(p + "ids", at::kLong).unsqueeze(0);
    auto want = to_ids(ref.load(p + "greedy", at::kLong));
    KVCache cache = dec.make_cache(1, ids.size(1) + want.size());
    at::Tensor logits = dec.forward(ids, cache);
    std::vector<int32_t> got;
    for (size_t k = 0; k < want.size(); ++k) {
      int64_t next = logits[0][-1].argmax().item<int64_t>();
      got.push_back(static_cast<int32_t>(next));
      logits = dec.forward(at::full({1, 1}, next, at::kLong), cache);
    }
    INFO("prompt " << i);
    CHECK(got == want);
  }
}

// NOTE: a full forward runs GEMMs (oneDNN or BLAS) and ATen's attention, a single token the fused
// GEMV and attention kernels: the same logits up to float32 rounding in other orders, which depend
// on the CPU's vector widths. Bounded as helpers.hpp's logits_bound: every layer and the head, the
// attention rows over up to n_keys keys.
double path_tolerance(const Decoder& dec, int64_t n_keys, const at::Tensor& want) {
  return path_bound(dec.config(), dec.config().n_layer + 1, n_keys, magnitude(want));
}

TEST_CASE("incremental decoding with the KV cache equals a full forward", "[decoder]") {
  c10::InferenceMode guard;
  const Decoder& dec = default_model().decoder();
  SafetensorsFile ref(oracle_dir() + "/decoder_reference.safetensors");
  at::Tensor ids = ref.load("p3.ids", at::kLong).unsqueeze(0);
  const int64_t n = ids.size(1);
  at::Tensor full = full_logits(dec, ids);
  SECTION("one token at a time") {
    KVCache cache = dec.make_cache(1, n);
    for (int64_t t = 0; t < n; ++t) {
      at::Tensor step = dec.forward(ids.narrow(1, t, 1), cache)[0][0];
      REQUIRE(max_diff(step, full[t]) <= path_tolerance(dec, n, full[t]));
    }
    CHECK(cache.length() == n);
  }
  SECTION("in uneven chunks") {
    KVCache cache = dec.make_cache(1, n);
    std::vector<at::Tensor> parts;
    for (int64_t start = 0, len = 1; start < n; start += len, len = len * 2 + 1) {
      int64_t take = std::min(len, n - start);
      parts.push_back(dec.forward(ids.narrow(1, start, take), cache, LogitsMode::all)[0]);
      len = take;
    }
    CHECK(max_diff(at::cat(parts, 0), full) <= path_tolerance(dec, n, full));
  }
  SECTION("a batch of two equals each alone") {
    at::Tensor other = ids.flip(1);
    KVCache cache = dec.make_cache(2, n);
    at::Tensor both = dec.forward(at::cat({ids, other}, 0), cache, LogitsMode::all);
    CHECK(max_diff(both[0], full) <= path_tolerance(dec, n, full));
    at::Tensor other_full = full_logits(dec, other);
    CHECK(max_diff(both[1], other_full) <= path_tolerance(dec, n, other_full));
  }
}

namespace {
// The paged step of `dec` against each row's cached forward, step after step: two sequences with
// their blocks taken from the pool's free list (not in order), the second's last block part-filled.
void check_paged_step(const Model& model, const Decoder& dec, bool row_wise) {
  const std::vector<std::vector<int32_t>> prompts = {model.chat_prompt("Name three rivers of Europe."),
                                                     model.chat_prompt("What is two plus two?")};
  std::vector<KVCache> caches;
  std::vector<std::vector<int32_t>> blocks;
  BlockPool pool(dec.config(), 16, 16);
  std::vector<Decoder::PagedRow> rows;
  for (const auto& p : prompts) {
    const int64_t n = static_cast<int64_t>(p.size());
    at::Tensor ids = ids_tensor(p);
    // Training's pass (generic ops, no cache) against the cached forward.
    at::Tensor hidden = dec.hidden(ids);  // [1, n, n_embd]
    CHECK(hidden.size(1) == n);
    at::Tensor trained = at::linear(hidden[0], dec.weights().output).to(at::kFloat);
    at::Tensor full = full_logits(dec, ids);
    CHECK(max_diff(trained, full) <= path_tolerance(dec, n, full));
    caches.push_back(dec.make_cache(1, n + 8));
    at::Tensor last = dec.forward(ids, caches.back())[0][-1];
    blocks.push_back(pool.allocate(pool.blocks_for(n + 8)));
    REQUIRE(!blocks.back().empty());
    pool.load(caches.back(), n, blocks.back());
    rows.push_back({last.argmax().item<int64_t>(), n, nullptr, nullptr});
  }
  for (size_t r = 0; r < rows.size(); ++r) rows[r].blocks = &blocks[r];
  for (int step = 0; step < 6; ++step) {
    at::Tensor paged = dec.step_paged(pool, rows);  // [2, n_vocab]
    REQUIRE(paged.size(0) == 2);
    for (size_t r = 0; r < rows.size(); ++r) {
      at::Tensor alone = dec.forward(at::full({1, 1}, rows[r].token, at::kLong), caches[r])[0][0];
      INFO("step " << step << " row " << r);
      CHECK(max_diff(paged[r], alone) <= path_tolerance(dec, rows[r].position + 1, alone));
      CHECK(paged[r].argmax().item<int64_t>() == alone.argmax().item<int64_t>());
      rows[r].token = alone.argmax().item<int64_t>();
      ++rows[r].position;
    }
  }
  // The pool holds what each row's own cache holds: every position, every layer (the paged step
  // wrote each new token's K/V into its row's block and offset). The same RoPE and projections on
  // one row or several: within a layer's bound of the cache's.
  for (size_t r = 0; r < rows.size(); ++r)
    for (int64_t l : {int64_t(0), dec.config().n_layer - 1}) {  // the first and the last layer
      const int64_t n = rows[r].position;
      at::Tensor want = caches[r].keys(l)[0].narrow(1, 0, n);  // [n_head_kv, n, head_dim]
      std::vector<at::Tensor> parts;
      for (int64_t p0 = 0, j = 0; p0 < n; p0 += pool.block_tokens(), ++j)
        parts.push_back(pool.keys(l)[blocks[r][j]].narrow(1, 0, std::min(pool.block_tokens(), n - p0)));
      at::Tensor got = at::cat(parts, 1);
      INFO("row " << r << " layer " << l);
      CHECK(max_diff(got, want) <= path_bound(dec.config(), l + 1, n, magnitude(want)));
    }
  at::Tensor both = dec.step_paged(pool, rows);
  at::Tensor first = dec.step_paged(pool, {rows[0]});
  if (row_wise) {  // a row alone is the same as in the batch: row-wise kernels
    CHECK(at::equal(both[0], first[0]));
  } else {  // the batch's GEMMs (and padded attention) against one row's: within the path's bound
    CHECK(max_diff(both[0], first[0]) <= path_tolerance(dec, rows[0].position + 1, first[0]));
  }
  // A prompt's piece beside the rows (the GPU server's mixed step): its rows go through every
  // matrix with the decoding rows'. The rows' logits are those of the step without it, the piece's
  // forward()'s over the same cache, and its K/V land in its cache, each within the path's bound.
  const std::vector<int32_t> prompt = model.chat_prompt("Which sea is the saltiest?");
  const int64_t n_prompt = static_cast<int64_t>(prompt.size()), head = n_prompt / 2;
  const at::Tensor prompt_ids = ids_tensor(prompt);
  KVCache mixed_cache = dec.make_cache(1, n_prompt), alone_cache = dec.make_cache(1, n_prompt);
  dec.forward(prompt_ids.narrow(1, 0, head), mixed_cache);
  dec.forward(prompt_ids.narrow(1, 0, head), alone_cache);
  Decoder::PagedPiece piece{prompt_ids.narrow(1, head, n_prompt - head), &mixed_cache, nullptr, {}};
  if (row_wise) {  // the fused step computes rows one by one: no piece
    CHECK_THROWS_WITH(dec.step_paged(pool, rows, nullptr, &piece), Catch::Contains("generic path"));
  } else {
    at::Tensor with_piece = dec.step_paged(pool, rows, nullptr, &piece);
    at::Tensor without = dec.step_paged(pool, rows);  // the same K/V written again in place
    at::Tensor want = dec.forward(prompt_ids.narrow(1, head, n_prompt - head), alone_cache)[0][0];
    CHECK(mixed_cache.length() == n_prompt);
    REQUIRE(piece.logits.defined());
    CHECK(max_diff(piece.logits, want) <= path_tolerance(dec, n_prompt, want));
    for (size_t r = 0; r < rows.size(); ++r) {
      INFO("row " << r << " beside a piece");
      CHECK(max_diff(with_piece[r], without[r]) <= path_tolerance(dec, rows[r].position + 1, without[r]));
    }
    const int64_t last = dec.config().n_layer - 1;
    at::Tensor got = mixed_cache.keys(last).narrow(2, head, n_prompt - head);
    at::Tensor expected = alone_cache.keys(last).narrow(2, head, n_prompt - head);
    CHECK(max_diff(got, expected) <= path_bound(dec.config(), last + 1, n_prompt, magnitude(expected)));
    // A piece past its cache's capacity is refused with what was found.
    Decoder::PagedPiece over{prompt_ids, &mixed_cache, nullptr, {}};
    CHECK_THROWS_WITH(dec.step_paged(pool, rows, nullptr, &over), Catch::Contains("a piece of"));
  }
  // A position past the row's blocks is refused with what was found.
  Decoder::PagedRow past = rows[0];
  past.position = static_cast<int64_t>(blocks[0].size()) * pool.block_tokens();
  CHECK_THROWS_WITH(dec.step_paged(pool, {past}), Catch::Contains("past the row's"));
  // A pool of another dtype than the decoder's is refused.
  BlockPool half(dec.config(), 2, 16, at::kBFloat16);
  CHECK_THROWS_WITH(dec.step_paged(half, {rows[0]}), Catch::Contains("block pool of BFloat16"));
}
}  // namespace

// Every forward runs the one layer (detail::decoder::layer_body) with its own kernels and attention:
// training's differentiable pass, the cached forward and the server's paged step agree, on the
// fused CPU path and on the generic one (the path a GPU's server takes).
TEST_CASE("one layer on three paths: training's pass, the cached forward and the paged step agree", "[decoder]") {
  c10::InferenceMode guard;
  const Model& model = default_model();
  REQUIRE(model.decoder().cpu_kernels());
  SECTION("fused CPU kernels") { check_paged_step(model, model.decoder(), true); }
  SECTION("generic ATen ops") {
    Options o;
    o.cpu_kernels = false;
    const Model generic = Model::load(model_path(), o);
    REQUIRE(!generic.decoder().cpu_kernels());
    check_paged_step(generic, generic.decoder(), false);
  }
}

TEST_CASE("a chunk after cached positions equals the same rows of one forward, on both CPU paths", "[decoder]") {
  // A chunk after a cache attends to the cached keys and to its own keys apart and merges the two
  // (exact): it must give the logits of the same rows in one causal forward.
  c10::InferenceMode guard;
  SafetensorsFile ref(oracle_dir() + "/decoder_reference.safetensors");
  at::Tensor ids = ref.load("p3.ids", at::kLong).unsqueeze(0);
  const int64_t n = ids.size(1), split = n / 3;
  REQUIRE(split > 4);  // both parts take the prefill path, not the few-row decode kernels
  auto check = [&](const Decoder& dec) {
    at::Tensor full = full_logits(dec, ids);
    KVCache cache = dec.make_cache(1, n);
    dec.forward(ids.narrow(1, 0, split), cache);
    at::Tensor rest = dec.forward(ids.narrow(1, split, n - split), cache, LogitsMode::all)[0];
    CHECK(max_diff(rest, full.narrow(0, split, n - split)) <= path_tolerance(dec, n, full));
    CHECK(cache.length() == n);
  };
  SECTION("fused kernels") { check(default_model().decoder()); }
  SECTION("generic ATen ops") {
    Options options;
    options.cpu_kernels = false;
    check(Model::load(model_path(), options).decoder());
  }
}

TEST_CASE("layer_at on chosen positions equals the same rows of a whole layer", "[decoder]") {
  // CacheBlend and EPIC recompute chosen rows over a filled cache with layer_at. Three shapes take
  // three CPU paths: rows scattered over the cache (more than one call's worth, so they are split
  // into calls by position), a contiguous tail, and every row.
  c10::InferenceMode guard;
  const Decoder& dec = default_model().decoder();
  const int64_t n = 400;
  at::Tensor ids = (at::arange(n, at::kLong) * 7919 % 20000 + 5).unsqueeze(0);
  at::Tensor x = dec.embed(ids);
  KVCache whole = dec.make_cache(1, n);
  at::Tensor want = dec.layer(0, x, whole)[0];
  auto error_at = [&](const std::vector<int64_t>& rows) {
    KVCache cache = dec.make_cache(1, n);
    cache.write(0, 0, whole.keys(0).narrow(2, 0, n), whole.values(0).narrow(2, 0, n));
    at::Tensor pos = at::tensor(rows, at::kLong);
    at::Tensor got = dec.layer_at(0, x.index_select(1, pos), pos, cache, n)[0];
    REQUIRE(got.sizes() == want.index_select(0, pos).sizes());
    return (got - want.index_select(0, pos)).abs().max().item<double>();
  };
  // One layer by two paths (helpers.hpp), its attention rows over up to n keys.
  const double bound = path_bound(dec.config(), 1, n, magnitude(want));
  std::vector<int64_t> scattered, tail, every;
  for (int64_t p = 1; p < n; p += 3) scattered.push_back(p);
  for (int64_t p = 250; p < n; ++p) tail.push_back(p);
  for (int64_t p = 0; p < n; ++p) every.push_back(p);
  REQUIRE(scattered.size() > 128);
  CHECK(error_at(scattered) <= bound);
  CHECK(error_at(tail) <= bound);
  CHECK(error_at(every) <= bound);
  CHECK(error_at({0, 7, 399}) <= bound);
}

TEST_CASE("the generic path (fused kernels off) matches transformers too", "[decoder][parity]") {
  c10::InferenceMode guard;
  Options options;
  options.cpu_kernels = false;
  Model generic = Model::load(model_path(), options);
  SafetensorsFile ref(oracle_dir() + "/decoder_reference.safetensors");
  at::Tensor ids = ref.load("p2.ids", at::kLong).unsqueeze(0);
  auto want = to_ids(ref.load("p2.greedy", at::kLong));
  KVCache cache = generic.decoder().make_cache(1, ids.size(1) + want.size());
  at::Tensor logits = generic.decoder().forward(ids, cache);
  std::vector<int32_t> got;
  for (size_t k = 0; k < want.size(); ++k) {
    int64_t next = logits[0][-1].argmax().item<int64_t>();
    got.push_back(static_cast<int32_t>(next));
    logits = generic.decoder().forward(at::full({1, 1}, next, at::kLong), cache);
  }
  CHECK(got == want);
}

TEST_CASE("bf16 on CPU stays close to fp32", "[decoder]") {
  c10::InferenceMode guard;
  Options options;
  options.dtype = "bfloat16";
  Model bf16 = Model::load(model_path(), options);
  SafetensorsFile ref(oracle_dir() + "/decoder_reference.safetensors");
  at::Tensor ids = ref.load("p1.ids", at::kLong).unsqueeze(0);
  at::Tensor want = full_logits(default_model().decoder(), ids);
  at::Tensor got = full_logits(bf16.decoder(), ids);
  CHECK(got.scalar_type() == at::kFloat);
  // Same top token at most positions, and the distributions close.
  double agree = (got.argmax(-1) == want.argmax(-1)).to(at::kFloat).mean().item<double>();
  CHECK(agree >= 0.8);
  double kl = at::kl_div(at::log_softmax(got, -1), at::log_softmax(want, -1), at::Reduction::Mean, true).item<double>();
  CHECK(kl < 0.05);
}

TEST_CASE("bf16 on CPU is as close to float32 as transformers' bf16 on the same weights", "[decoder][parity]") {
  // The tiny model (stored float32, llama3 RoPE, untied head) and transformers' logits of it in
  // float32 and bfloat16, teacher-forced: a prompt of 100, 20 rows after it, 3 pieces of 7 (their
  // last rows), 24 steps of one token.
  // COMB_BF16_MODEL and COMB_BF16_REF name another model folder and its reference
  // (tests/oracle/bf16_reference.py --model DIR --out REF).
  const std::string dir = env_or("COMB_BF16_MODEL", oracle_dir() + "/tiny-llama");
  const std::string ref = env_or("COMB_BF16_REF", oracle_dir() + "/tiny_bf16_reference.safetensors");
  Options bf16_options;
  bf16_options.dtype = "bfloat16";
  const AgainstTransformers bf16 = against_transformers(dir, ref, bf16_options);
  const AgainstTransformers f32 = against_transformers(dir, ref, Options{});
  INFO(describe(bf16, f32));
  // Both round to bfloat16 at about the same points (the weights, each projection's and norm's
  // output, the residual stream) and differ in the order of their float32 sums and in a few
  // intermediate roundings: two such walks over 7 million logits have root mean squares within a
  // few percent of each other, allowed half again; a single largest one spreads more, allowed
  // twice. (By the triangle inequality comb's bf16 then lies within 2.5x transformers' root mean
  // square distance of transformers' bf16, the form of the bound the GPU check states.)
  CHECK(bf16.rms <= 1.5 * bf16.rms_hf);
  CHECK(bf16.max <= 2 * bf16.max_hf);
  // float32 on both sides: its rounding (2^-24) is 2^16 times finer than bfloat16's (2^-8); a
  // sixteenth of bfloat16's distance leaves room for the longer sums' growth and still fails any
  // path that rounds to a half type (or to TF32) on the way.
  CHECK(f32.rms <= bf16.rms_hf / 16);
}

TEST_CASE("safetensors checkpoint (sharded, untied, llama3 RoPE) matches transformers", "[decoder][parity]") {
  c10::InferenceMode guard;
  std::string dir = oracle_dir() + "/tiny-llama";
  Model tiny = Model::load(dir);
  CHECK(tiny.config().rope_scaling.type == "llama3");
  CHECK_FALSE(tiny.config().tie_embeddings);
  SafetensorsFile ref(oracle_dir() + "/tiny_reference.safetensors");
  at::Tensor ids = ref.load("ids", at::kLong).unsqueeze(0);
  at::Tensor want = ref.load("logits", at::kFloat);
  at::Tensor got = full_logits(tiny.decoder(), ids);
  double diff = (got - want).abs().max().item<double>();
  INFO("max |diff| " << diff);
  CHECK(diff <= logits_bound(tiny, ids.size(1), want));  // transformers' kernels against comb's (helpers.hpp)

  SECTION("decoding token by token (fused CPU kernels) equals the full forward") {
    KVCache cache = tiny.decoder().make_cache(2, ids.size(1));
    at::Tensor pair = at::cat({ids, ids.flip(1)}, 0);
    at::Tensor other = full_logits(tiny.decoder(), ids.flip(1));
    for (int64_t t = 0; t < ids.size(1); ++t) {
      at::Tensor step = tiny.decoder().forward(pair.narrow(1, t, 1), cache);  // a batch of 2, one token each
      REQUIRE(max_diff(step[0][0], got[t]) <= path_tolerance(tiny.decoder(), ids.size(1), got[t]));
      REQUIRE(max_diff(step[1][0], other[t]) <= path_tolerance(tiny.decoder(), ids.size(1), other[t]));
    }
  }
  SECTION("save and load again gives the same logits") {
    std::string out = temp_dir("resave");
    save_safetensors(out + "/model.safetensors", llama_weights_hf_named(tiny.decoder().weights(), tiny.config()));
    comb::detail::write_file_atomic(out + "/config.json", tiny.config().to_hf_json().dump(2));
    fs::copy_file(dir + "/tokenizer.json", out + "/tokenizer.json");
    Model again = Model::load(out);
    CHECK(full_logits(again.decoder(), ids).equal(got));
  }
  SECTION("a config inconsistent with the tensors names every bad tensor") {
    std::string out = temp_dir("badcfg");
    for (const auto& e : fs::directory_iterator(dir)) fs::copy_file(e.path(), out + "/" + e.path().filename().string());
    auto config = nlohmann::json::parse(read_bytes(dir + "/config.json"));
    config["intermediate_size"] = 128;
    comb::detail::write_file_atomic(out + "/config.json", config.dump());
    try {
      Model::load(out);
      FAIL("loading should fail");
    } catch (const Error& e) {
      std::string msg = e.what();
      CHECK_THAT(msg, Catch::Contains("9 weight problem(s)"));
      CHECK_THAT(msg, Catch::Contains("'model.layers.2.mlp.down_proj.weight' has shape [64, 160], expected [64, 128]"));
    }
  }
  SECTION("a missing tensor is named") {
    std::string out = temp_dir("missing");
    auto named = llama_weights_hf_named(tiny.decoder().weights(), tiny.config());
    named.erase(std::remove_if(named.begin(), named.end(),
                               [](const auto& p) { return p.first == "model.layers.1.self_attn.k_proj.weight"; }),
                named.end());
    save_safetensors(out + "/model.safetensors", named);
    comb::detail::write_file_atomic(out + "/config.json", tiny.config().to_hf_json().dump());
    fs::copy_file(dir + "/tokenizer.json", out + "/tokenizer.json");
    CHECK_THROWS_WITH(Model::load(out), Catch::Contains("missing 'model.layers.1.self_attn.k_proj.weight'"));
  }
}

TEST_CASE("a prompt longer than the context is refused", "[decoder][errors]") {
  Model tiny = Model::load(oracle_dir() + "/tiny-llama");
  std::vector<int32_t> prompt(tiny.config().n_ctx, 1000);
  GenerateOptions options;
  options.max_tokens = 4;
  CHECK_THROWS_WITH(tiny.generate(prompt, options), Catch::Contains("1024 tokens") && Catch::Contains("context"));
  CHECK_THROWS_WITH(tiny.generate({}, options), Catch::Contains("empty"));
  CHECK_THROWS_WITH(tiny.generate({1, 999999}, options), Catch::Contains("outside the vocabulary"));
  KVCache cache = tiny.decoder().make_cache(1, 4);
  CHECK_THROWS_WITH(tiny.decoder().forward(at::ones({1, 5}, at::kLong), cache), Catch::Contains("KV cache full"));
  // Generation stops cleanly when the context fills up.
  std::vector<int32_t> near_full(tiny.config().n_ctx - 3, 1000);
  options.max_tokens = 50;
  auto r = tiny.generate(near_full, options);
  CHECK(r.stop_reason == "context_full");
  CHECK(r.tokens.size() == 4);  // the last one is read off the full context
}

TEST_CASE("bad options get clear errors", "[decoder][errors]") {
  Options options;
  options.dtype = "float64";
  CHECK_THROWS_WITH(Model::load(model_path(), options), Catch::Contains("unknown dtype 'float64'"));
  options.dtype = "float16";
  CHECK_THROWS_WITH(Model::load(model_path(), options), Catch::Contains("CUDA only"));
  options = {};
  options.device = "tpu:9";
  CHECK_THROWS_WITH(Model::load(model_path(), options), Catch::Contains("unknown device"));
  CHECK_THROWS_WITH(Model::load("/nonexistent/model.gguf"), Catch::Contains("does not exist"));
  CHECK_THROWS_WITH(Sampler(SamplingOptions{1.0f, 0, 0.0f, 0}), Catch::Contains("top-p"));
}

TEST_CASE("sampling is repeatable and its limits behave", "[decoder][sampling]") {
  at::Tensor logits = at::randn({1000}, at::TensorOptions().dtype(at::kFloat));
  int64_t best = logits.argmax().item<int64_t>();
  Sampler greedy(SamplingOptions{});
  CHECK(greedy.sample(logits) == best);
  Sampler top1(SamplingOptions{1.5f, 1, 1.0f, 3});
  Sampler tiny_p(SamplingOptions{1.0f, 0, 1e-6f, 3});
  for (int i = 0; i < 20; ++i) {
    CHECK(top1.sample(logits) == best);
    CHECK(tiny_p.sample(logits) == best);
  }
  std::vector<int32_t> a, b;
  Sampler s1(SamplingOptions{1.0f, 50, 0.9f, 42}), s2(SamplingOptions{1.0f, 50, 0.9f, 42});
  for (int i = 0; i < 50; ++i) a.push_back(s1.sample(logits)), b.push_back(s2.sample(logits));
  CHECK(a == b);
  auto top50 = std::get<1>(logits.topk(50));
  for (int32_t t : a) CHECK((top50 == t).any().item<bool>());
  CHECK(std::set<int32_t>(a.begin(), a.end()).size() > 1);
}

// comb::detail::sorted_draw is Sampler's rule over the whole vocabulary sorted: the reference.
TEST_CASE("sampling orders only the highest tokens and draws the token the whole sort would", "[decoder][sampling]") {
  auto gen = at::detail::createCPUGenerator(53);
  // A vocabulary's logits as a model's (spread), a small one, and a flat one whose draws fall far
  // down the order (past 64, 512 and 4,096 ordered tokens: each widening of the order is met).
  const std::vector<at::Tensor> rows{at::randn({49152}, gen) * 3, at::randn({1000}, gen),
                                     at::randn({49152}, gen) * 0.01};
  const std::vector<SamplingOptions> options{{0.7f, 0, 1.0f, 0},  {1.0f, 0, 0.9f, 0},   {1.3f, 50, 1.0f, 0},
                                             {1.0f, 40, 0.8f, 0}, {2.0f, 0, 1.0f, 0},   {1.0f, 0, 0.999f, 0},
                                             {0.5f, 5000, 0.95f, 0}};
  int draws = 0, differ = 0;
  for (size_t r = 0; r < rows.size(); ++r)
    for (size_t k = 0; k < options.size(); ++k) {
      SamplingOptions o = options[k];
      o.seed = 100 * r + k;
      Sampler sampler(o);
      std::mt19937_64 same(o.seed);  // the generator's draws, one a token, as the sampler takes them
      for (int i = 0; i < 60; ++i) {
        const double u01 = std::uniform_real_distribution<double>(0.0, 1.0)(same);
        const int32_t want = comb::detail::sorted_draw(rows[r], o, u01), got = sampler.sample(rows[r]);
        differ += want != got;
        ++draws;
      }
    }
  // The two sum the same probabilities in another order and precision (the reference's float32
  // softmax against float64 sums of exponentials): a draw can differ only where it lands within
  // ~1e-6 of a boundary between two tokens' cumulative masses, about one draw in a million.
  INFO(differ << " of " << draws << " draws differ");
  CHECK(draws == 3 * 7 * 60);
  CHECK(differ <= 1);
  // Ties: the lower id first, as the stable sort orders them.
  at::Tensor tied = at::full({100}, -5.0f);
  tied[7] = 3.0f, tied[3] = 3.0f, tied[50] = 2.9f;
  Sampler first(SamplingOptions{1.0f, 1, 1.0f, 9});
  for (int i = 0; i < 5; ++i) CHECK(first.sample(tied) == 3);
  Sampler two(SamplingOptions{1.0f, 2, 1.0f, 9});
  std::mt19937_64 same(9);
  std::set<int32_t> seen;
  for (int i = 0; i < 40; ++i) {
    const int32_t t = two.sample(tied);
    const double u01 = std::uniform_real_distribution<double>(0.0, 1.0)(same);
    CHECK(t == comb::detail::sorted_draw(tied, SamplingOptions{1.0f, 2, 1.0f, 9}, u01));
    seen.insert(t);
  }
  CHECK(seen == std::set<int32_t>{3, 7});
  // A temperature so small that the scaled logits overflow: the argmax, not the first infinite one.
  Sampler cold(SamplingOptions{1e-38f, 0, 1.0f, 9});
  at::Tensor two_peaks = at::full({10}, -1.0f);
  two_peaks[2] = 5.0f, two_peaks[6] = 6.0f;  // over 1e-38: both past float's largest
  CHECK(cold.sample(two_peaks) == 6);
  // Every logit -inf but one; every one NaN.
  at::Tensor lone = at::full({100}, -std::numeric_limits<float>::infinity());
  lone[42] = 0.0f;
  CHECK(Sampler(SamplingOptions{1.0f, 0, 0.9f, 9}).sample(lone) == 42);
  CHECK(Sampler(SamplingOptions{1.0f, 0, 1.0f, 9}).sample(at::full({100}, std::nanf(""))) == 0);
}

TEST_CASE("sample_rows draws each row as its sampler's sample() would", "[decoder][sampling]") {
  auto gen = at::detail::createCPUGenerator(59);
  const at::Tensor logits = at::randn({5, 3000}, gen) * 2;
  const std::vector<SamplingOptions> options{{0.0f, 0, 1.0f, 1}, {0.8f, 0, 0.95f, 2}, {1.0f, 20, 1.0f, 3},
                                             {0.0f, 0, 1.0f, 4}, {1.5f, 0, 1.0f, 5}};
  std::vector<std::unique_ptr<Sampler>> rows, alone;
  std::vector<Sampler*> ptrs;
  for (const auto& o : options) {
    rows.push_back(std::make_unique<Sampler>(o));
    alone.push_back(std::make_unique<Sampler>(o));
    ptrs.push_back(rows.back().get());
  }
  for (int step = 0; step < 20; ++step) {
    const std::vector<int32_t> got = Sampler::sample_rows(ptrs, logits);
    REQUIRE(got.size() == options.size());
    for (size_t r = 0; r < options.size(); ++r) CHECK(got[r] == alone[r]->sample(logits[static_cast<int64_t>(r)]));
  }
  CHECK_THROWS_WITH(Sampler::sample_rows(ptrs, logits.narrow(0, 0, 4)),
                    Catch::Contains("logits [rows, n_vocab] for 5 samplers, found [4, 3000]"));
}

TEST_CASE("golden: greedy answer of a fixed chat prompt", "[decoder][golden]") {
  const Model& model = default_model();
  GenerateOptions options;
  options.max_tokens = 48;
  std::string streamed;
  options.on_token = [&](int32_t, const std::string& text) {
    streamed += text;
    return true;
  };
  auto r = model.generate(model.chat_prompt("What is the capital of France?"), options);
  CHECK(r.text == "The capital of France is Paris.");
  CHECK(streamed == r.text);
  CHECK(r.stop_reason == "stop_token");
  CHECK(r.tokens == std::vector<int32_t>{504, 3575, 282, 4649, 314, 7042, 30});
  CHECK(r.logprobs.size() == r.tokens.size());
  for (float lp : r.logprobs) CHECK(lp <= 0.0f);
  CHECK(r.ttft_ms > 0);
}

// Tagged apart so that ctest runs it in a process of its own: the setting lasts for the process.
TEST_CASE("keep_freed_memory applies on glibc and generation is unchanged by it", "[allocator]") {
  c10::InferenceMode guard;
  const Decoder& dec = default_model().decoder();
  SafetensorsFile ref(oracle_dir() + "/decoder_reference.safetensors");
  at::Tensor ids = ref.load("p3.ids", at::kLong).unsqueeze(0);
  at::Tensor before = full_logits(dec, ids);
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer replaces malloc, and with it mallopt (which then reports failure).
  WARN("AddressSanitizer build: mallopt is the sanitizer's, keep_freed_memory() is not checked");
  comb::keep_freed_memory();
#elif defined(__GLIBC__)
  CHECK(comb::keep_freed_memory());
#else
  CHECK_FALSE(comb::keep_freed_memory());
#endif
  CHECK(at::equal(full_logits(dec, ids), before));
}
