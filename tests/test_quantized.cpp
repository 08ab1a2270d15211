// Weights kept quantized (Options::quantize = "gguf"): the matrices against their dequantized
// floats, and the default model (Q4_1 layers, Q8_0 embedding and head) against its float path.
#include <catch2/catch.hpp>
#include <cstdlib>

#include "comb/detail/cpu_kernels.hpp"

#include "helpers.hpp"

using namespace comb;
using namespace comb::test;

namespace {

GroupedWeights random_grouped(GroupedWeights::Kind kind, int64_t rows, int64_t cols, bool centered = false,
                              uint64_t seed = 1) {
  at::manual_seed(seed);
  GroupedWeights g;
  g.kind = kind;
  g.centered = centered;
  const int64_t groups = cols / 32;
  if (kind == GroupedWeights::Kind::q8) {
    g.q = at::randint(-127, 128, {rows, cols}, at::kChar);
    g.min = at::zeros({rows, groups});
  } else {
    g.q = at::randint(0, 16, {rows, cols}, at::kByte);
    g.min = centered ? at::Tensor() : at::randn({rows, groups}) * 0.02;
  }
  g.scale = at::rand({rows, groups}) * 0.01 + 0.001;
  if (centered) g.min = -8 * g.scale;
  return g;
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

// x w^T by two kernels (ours, a GEMM's), each within gamma(k) |x| |w|^T of the exact products'
// sums whatever its order (bounds.hpp): true where every output is within twice that.
bool within_rounding(const at::Tensor& a, const at::Tensor& b, const at::Tensor& x, const at::Tensor& w) {
  const at::Tensor magnitude = at::matmul(x.abs().to(at::kDouble), w.abs().to(at::kDouble).t());
  return ((a - b).abs().to(at::kDouble) <= 2 * gamma32(x.size(-1)) * magnitude).all().item<bool>();
}

at::Tensor all_logits(const Decoder& dec, const at::Tensor& ids) {
  KVCache cache = dec.make_cache(1, ids.size(1));
  return dec.forward(ids, cache, LogitsMode::all)[0];
}

const Model& quantized_model() {
  static const Model model = [] {
    Options o;
    o.quantize = "gguf";
    return Model::load(model_path(), o);
  }();
  return model;
}

}  // namespace

// gemv_rows over float weights: what the float path computes for up to 64 rows.
at::Tensor float_rows(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor y = at::empty({x.size(0), w.size(0)});
  comb::detail::cpu::gemv_rows(x.data_ptr<float>(), x.size(0), w.data_ptr<float>(), w.size(1), y.data_ptr<float>(), w.size(0),
                         0, w.size(0));
  return y;
}

TEST_CASE("Q8_0 groups multiply as their floats: bit for bit on the row kernels, close on the chunked path",
          "[quantized]") {
  c10::InferenceMode guard;
  GroupedWeights g = random_grouped(GroupedWeights::Kind::q8, 80, 96);
  g.scale = g.scale.to(at::kHalf).to(at::kFloat);  // as GGUF stores them
  QuantizedMatrix m = QuantizedMatrix::from(g);
  at::Tensor w = g.dequantize();
  CHECK(m.format() == QuantizedMatrix::Format::q8_0);
  CHECK(m.dequantize().equal(w));  // int8 times a float32 scale: exact
  for (int64_t rows : {1, 3, 4, 9, 64, 70}) {  // up to 64 rows: the row kernels; more: dequantized chunks
    at::Tensor x = at::randn({rows, 96});
    INFO(rows << " input rows");
    if (rows <= QuantizedMatrix::kKernelRows) CHECK(m.apply(x).equal(float_rows(x, w)));
    CHECK(within_rounding(m.apply(x), at::linear(x, w), x, w));  // only the order of the sums differs
  }
  at::Tensor ids = at::tensor(std::vector<int64_t>{5, 0, 79, 5}, at::kLong).view({2, 2});
  at::Tensor rows = m.gather_rows(ids);
  CHECK(rows.sizes() == at::IntArrayRef({2, 2, 96}));
  CHECK(rows[1][0].equal(w[79]));
  CHECK(rows[0][0].equal(w[5]));
  CHECK(m.bytes() == 80 * 96 + 80 * 3 * 4);
}

TEST_CASE("Q4_1 and Q4_0 groups, two weights a byte: their floats exactly, and multiplied as the float path",
          "[quantized]") {
  c10::InferenceMode guard;
  for (bool centered : {false, true}) {
    INFO((centered ? "Q4_0" : "Q4_1"));
    GroupedWeights g = random_grouped(GroupedWeights::Kind::q4, 72, 128, centered);
    g.scale = g.scale.to(at::kHalf).to(at::kFloat);  // as GGUF stores them: q * scale is exact in float32
    g.min = centered ? -8 * g.scale : g.min.to(at::kHalf).to(at::kFloat);
    QuantizedMatrix m = QuantizedMatrix::from(g);
    CHECK(m.format() == QuantizedMatrix::Format::int4);
    at::Tensor exact = g.dequantize();
    CHECK(m.dequantize().equal(exact));
    for (int64_t rows : {1, 2, 5, 16, 64, 65}) {
      INFO(rows << " input rows");
      at::Tensor x = at::randn({rows, 128});
      if (rows <= QuantizedMatrix::kKernelRows) CHECK(m.apply(x).equal(float_rows(x, exact)));
      CHECK(within_rounding(m.apply(x), at::linear(x, exact), x, exact));
    }
    // Output rows split across callers (the serving engine's threads): the same numbers.
    at::Tensor x = at::randn({7, 128}), y = at::empty({7, 72});
    for (int64_t b = 0; b < 72; b += 20) m.apply_rows(x.data_ptr<float>(), 7, y.data_ptr<float>(), b, std::min<int64_t>(72, b + 20));
    CHECK(y.equal(m.apply(x)));
    CHECK(m.bytes() == 72 * 64 + 72 * 4 * 4 * 2);  // 4 bits a weight, a float32 scale and offset a group
    at::Tensor ids = at::tensor(std::vector<int64_t>{71, 3}, at::kLong);
    CHECK(m.gather_rows(ids)[0].equal(exact[71]));
  }
  GroupedWeights bad = random_grouped(GroupedWeights::Kind::q4, 16, 64);
  bad.scale = bad.scale.narrow(1, 0, 1);
  CHECK_THROWS_WITH(QuantizedMatrix::from(bad), Catch::Contains("whole groups of 32"));
  GroupedWeights q8 = random_grouped(GroupedWeights::Kind::q8, 16, 64);
  CHECK_THROWS_WITH(GroupedWeights::cat({random_grouped(GroupedWeights::Kind::q4, 16, 64), q8}),
                    Catch::Contains("share kind and columns"));
  QuantizedMatrix m = QuantizedMatrix::from(random_grouped(GroupedWeights::Kind::q4, 16, 64));
  at::Tensor x = at::randn({65, 64}), y = at::empty({65, 16});
  CHECK_THROWS_WITH(m.apply_rows(x.data_ptr<float>(), 65, y.data_ptr<float>(), 0, 16), Catch::Contains("at most 64"));
}

TEST_CASE("the default model with its GGUF weights kept quantized: under a quarter of the bytes, the float path's numbers",
          "[quantized]") {
  c10::InferenceMode guard;
  const Model& dense = default_model();
  const Model& q = quantized_model();
  const auto& w = q.decoder().weights();
  REQUIRE(w.quantized());
  CHECK(w.layers.back().quantized);
  CHECK(w.tok_embd_q);
  CHECK(w.output_q == w.tok_embd_q);  // a tied head: one matrix
  CHECK_FALSE(w.layers[0].wqkv.defined());
  INFO("bytes: kept quantized " << w.bytes() << ", float32 " << dense.decoder().weights().bytes());
  CHECK(w.bytes() * 4 < dense.decoder().weights().bytes());
  // The same model: the float load's fingerprint, so plug-ins built for it apply; its caches are
  // kept apart from the float model's.
  CHECK(base_fingerprint(q.decoder()) == base_fingerprint(dense.decoder()));
  CHECK(w.cache_tag() != dense.decoder().weights().cache_tag());

  // Up to 64 tokens at a time (decoding, short prompts) both paths run the row kernels over the
  // same float weights: the same logits, bit for bit. A longer prompt goes through dequantized
  // chunks and a GEMM, the float path through oneDNN's packed GEMM: the same up to the order of sums.
  SafetensorsFile ref(oracle_dir() + "/decoder_reference.safetensors");
  at::Tensor ids = ref.load("p1.ids", at::kLong).unsqueeze(0);
  REQUIRE(ids.size(1) <= 64);
  CHECK(all_logits(q.decoder(), ids).equal(all_logits(dense.decoder(), ids)));
  at::Tensor long_ids = at::randint(100, 20000, {1, 150}, at::kLong);
  at::Tensor want = all_logits(dense.decoder(), long_ids), got = all_logits(q.decoder(), long_ids);
  INFO("150 tokens: largest logit difference " << rel_diff(got, want));
  CHECK(max_diff(got, want) <= logits_bound(dense, 150, want));  // two paths (helpers.hpp)
  CHECK(got.argmax(-1).equal(want.argmax(-1)));
  // The last position's logits (the head on one row): with oneDNN, the layers' prefill GEMMs are the
  // float path's own over the same floats, so the same numbers there too.
  if (at::hasMKLDNN()) {
    KVCache a = q.decoder().make_cache(1, 150), b = dense.decoder().make_cache(1, 150);
    CHECK(q.decoder().forward(long_ids, a).equal(dense.decoder().forward(long_ids, b)));
  }

  // Both CPU paths (fused kernels, generic ops) read the quantized weights alike.
  Options generic_options;
  generic_options.quantize = "gguf";
  generic_options.cpu_kernels = false;
  Model generic = Model::load(model_path(), generic_options);
  at::Tensor fused_logits = all_logits(q.decoder(), ids);
  CHECK(max_diff(all_logits(generic.decoder(), ids), fused_logits) <= logits_bound(q, ids.size(1), fused_logits));

  // Generation: the same tokens and log-probabilities.
  GenerateOptions g;
  g.max_tokens = 24;
  auto prompt = dense.chat_prompt("What is the capital of France?");
  GenerationResult a = q.generate(prompt, g), b = dense.generate(prompt, g);
  CHECK(a.tokens == b.tokens);
  CHECK(a.logprobs == b.logprobs);
}

TEST_CASE("--quantize auto: a GGUF file kept quantized on the CPU in float32, expanded elsewhere", "[quantized]") {
  c10::InferenceMode guard;
  Options o;
  o.quantize = "auto";
  Model m = Model::load(model_path(), o);
  CHECK(m.decoder().weights().quantized());
  CHECK(m.decoder().weights().quantization == "gguf");
  o.dtype = "bfloat16";
  Model bf = Model::load(model_path(), o);
  CHECK_FALSE(bf.decoder().weights().quantized());
}

TEST_CASE("the shipped plug-in on a quantized decoder: off is the bare decoder, and it reads", "[quantized]") {
  c10::InferenceMode guard;
  Options o;
  o.quantize = "gguf";
  o.plugin = env_or("COMB_SHIPPED_PLUGIN", "");
  REQUIRE_FALSE(o.plugin.empty());
  Model with = Model::load(model_path(), o);  // the fingerprint check passes
  const Model& bare = quantized_model();
  auto prompt = bare.chat_prompt("Name a color.");
  GenerateOptions g;
  g.max_tokens = 8;
  auto a = with.generate(prompt, g), b = bare.generate(prompt, g);
  CHECK(a.tokens == b.tokens);
  CHECK(a.logprobs == b.logprobs);  // bit for bit: no documents, no plug-in
  // With a document that holds a word the model cannot guess, the answer copies it.
  auto doc = with.tokenizer().encode("The code word for the blue door is 'marzipan'.", false);
  PICacheStore store(StoreOptions{});
  auto linked = Linker(with.decoder().device()).link({documents_in(with, &store).get(doc)});
  g.max_tokens = 20;
  // The question asked as comb qa asks it; a plug-in that reads documents after the instruction
  // prefix has them end there.
  std::vector<int32_t> ask = qa_prefix(with);
  if (with.plugin()->config().documents_after_prefix) linked.anchor = static_cast<int64_t>(ask.size());
  const auto question = qa_suffix(with, "What is the code word for the blue door? Answer with the word only.");
  ask.insert(ask.end(), question.begin(), question.end());
  auto answer = with.generate(ask, g, &linked);
  INFO("answer: " << answer.text);
  CHECK(answer.text.find("arzipan") != std::string::npos);
}

TEST_CASE("weights kept quantized: what is refused, and why", "[quantized][errors]") {
  Options o;
  o.quantize = "int3";
  CHECK_THROWS_WITH(Model::load(model_path(), o), Catch::Contains("--quantize: expected auto"));
  o.quantize = "gguf";
  o.dtype = "bfloat16";
  CHECK_THROWS_WITH(Model::load(model_path(), o), Catch::Contains("--quantize gguf runs on the CPU with --dtype float32"));
  o.quantize = "int4";
  CHECK_THROWS_WITH(Model::load(model_path(), o), Catch::Contains("--quantize int4 runs on the CPU with --dtype float32"));
  Options tiny;
  tiny.quantize = "gguf";
  CHECK_THROWS_WITH(Model::load(oracle_dir() + "/tiny-llama", tiny), Catch::Contains("is not a GGUF file"));
}

TEST_CASE("float weights quantized on load (int8, int4) stay close to the float path, fingerprint unchanged",
          "[quantized]") {
  c10::InferenceMode guard;
  const Model& dense = default_model();
  SafetensorsFile ref(oracle_dir() + "/decoder_reference.safetensors");
  at::Tensor ids = ref.load("p1.ids", at::kLong).unsqueeze(0);
  at::Tensor want = all_logits(dense.decoder(), ids);
  for (const char* mode : {"int8", "int4"}) {
    INFO("--quantize " << mode);
    Options o;
    o.quantize = mode;
    Model q = Model::load(model_path(), o);
    const auto& w = q.decoder().weights();
    REQUIRE(w.layers[0].quantized);
    CHECK(w.layers[0].quantized->wqkv.format() ==
          (std::string(mode) == "int8" ? QuantizedMatrix::Format::q8_0 : QuantizedMatrix::Format::int4));
    CHECK(w.output_q->format() == QuantizedMatrix::Format::q8_0);  // the head stays int8
    CHECK(base_fingerprint(q.decoder()) == base_fingerprint(dense.decoder()));
    CHECK(w.cache_tag() == std::string("+quantized-") + mode);
    at::Tensor got = all_logits(q.decoder(), ids);
    const double agree = (got.argmax(-1) == want.argmax(-1)).to(at::kFloat).mean().item<double>();
    const double kl =
        at::kl_div(at::log_softmax(got, -1), at::log_softmax(want, -1), at::Reduction::Mean, true).item<double>();
    INFO("top-1 agreement " << agree << ", KL " << kl);
    CHECK(agree >= (std::string(mode) == "int8" ? 0.95 : 0.7));
    CHECK(kl < (std::string(mode) == "int8" ? 0.01 : 0.2));
  }
  // A safetensors model (float weights) takes int8 too.
  Options tiny;
  tiny.quantize = "int8";
  Model t = Model::load(oracle_dir() + "/tiny-llama", tiny);
  Model t_dense = Model::load(oracle_dir() + "/tiny-llama");
  at::Tensor tids = at::arange(5, 25, at::kLong).unsqueeze(0);
  CHECK(rel_diff(all_logits(t.decoder(), tids), all_logits(t_dense.decoder(), tids)) < 0.05);
}
