// The fused decoder ops on CUDA against the ATen compositions they replace, and the one-launch
// decoding step against the generic path. Every case needs a CUDA device and comb's CUDA ops; on a
// machine without them each case says so and checks nothing else.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <future>
#include <thread>
#include <optional>
#include <string>

#include "comb/comb.hpp"
#include "comb/detail/decode_step.hpp"
#include "helpers.hpp"

using namespace comb;
using namespace comb::test;

namespace {

// Whether the CUDA ops can be checked here (a device and comb's CUDA module); WARNs why not.
bool cuda_ops_here() {
  if (!cuda_available()) {
    WARN("no CUDA device: the fused CUDA ops are not checked here");
    return false;
  }
  if (!load_cuda_backend().comb_ops) {
    WARN("comb was built without its CUDA ops (no CUDA compiler): nothing to check");
    return false;
  }
  return true;
}

// Calls comb::<name> through the dispatcher (boxed: no C++ signature to match); its tensor, if any.
at::Tensor call(const char* name, std::vector<c10::IValue> args) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  std::vector<c10::IValue> stack(std::move(args));
  op.callBoxed(&stack);
  return stack.empty() ? at::Tensor() : stack.back().toTensor();  // an op returning () leaves none
}

// One unit in the last place, relative, of each half type: 2^-7 (bfloat16: 8 significant bits) and
// 2^-10 (float16: 11).
double ulp(at::ScalarType t) { return t == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024; }

// A decoding step made with its attention fused or not (COMB_CUDA_FUSED_ATTENTION=1 or 0, read when
// it is made; the variable set back as it was after), whatever the caller's environment says.
std::unique_ptr<comb::detail::DecodeStep> decode_step(const comb::detail::DecodeStepSpec& spec, bool graph,
                                                      bool fused_attention) {
  const char* was = std::getenv("COMB_CUDA_FUSED_ATTENTION");
  const std::optional<std::string> old = was ? std::optional<std::string>(was) : std::nullopt;
  ::setenv("COMB_CUDA_FUSED_ATTENTION", fused_attention ? "1" : "0", 1);
  auto step = comb::detail::decode_step_factory()(spec, graph);
  if (old)
    ::setenv("COMB_CUDA_FUSED_ATTENTION", old->c_str(), 1);
  else
    ::unsetenv("COMB_CUDA_FUSED_ATTENTION");
  return step;
}

const std::vector<at::ScalarType> kHalfTypes{at::kBFloat16, at::kHalf};

// Two half-precision computations of the same logits, `got` (comb's kernels) and `ref` (the
// composition they replace or the same kernels launched otherwise), each against float32's `want`:
// the largest and the root mean square difference of each.
struct Spread {
  double err_got, rms_got, err_ref, rms_ref;
};
Spread spread(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& want) {
  auto err = [&](const at::Tensor& t) { return (t - want).abs().max().item<double>(); };
  auto rms = [&](const at::Tensor& t) { return (t - want).pow(2).mean().sqrt().item<double>(); };
  return {err(got), rms(got), err(ref), rms(ref)};
}

// got's top token is ref's wherever ref's is clear of its runner-up by more than `margin` (both
// paths' distance to float32, twice).
void check_clear_top(const at::Tensor& got, const at::Tensor& ref, double margin) {
  at::Tensor top2 = std::get<0>(ref.topk(2, -1));
  at::Tensor clear = (top2.select(-1, 0) - top2.select(-1, 1)) > margin;
  CHECK(at::equal(got.argmax(-1).masked_select(clear), ref.argmax(-1).masked_select(clear)));
}

// comb's CUDA ops table, for a case that has checked cuda_ops_here().
const comb::detail::CudaLayerOps& layer_ops() {
  const comb::detail::CudaLayerOps* ops = comb::detail::cuda_layer_ops();
  REQUIRE(ops);
  return *ops;
}

// The model the CUDA cases load: COMB_CUDA_MODEL, else the default one.
std::string cuda_model_path() { return env_or("COMB_CUDA_MODEL", model_path()); }
// That model in bfloat16 on the GPU.
Model cuda_bf16_model() { return Model::load(cuda_model_path(), Options{"cuda", "bfloat16"}); }
// That model on the GPU twice: in float32 (the reference) and in bfloat16.
struct CudaModels {
  Model f32, bf16;
};
CudaModels cuda_models() {
  const std::string path = cuda_model_path();
  return {Model::load(path, Options{"cuda"}), Model::load(path, Options{"cuda", "bfloat16"})};
}
}  // namespace

TEST_CASE("detail::upload and upload_ints put host values on the device queued behind its work", "[ops][cuda]") {
  if (!cuda_available()) return;
  c10::InferenceMode guard;
  auto gen = at::detail::createCPUGenerator(5);
  // Queued behind a long product: copies the host did not wait for land in order on the stream,
  // before the reads below (which wait).
  const at::Tensor big = at::randn({2048, 2048}, at::TensorOptions().device(at::kCUDA));
  const at::Tensor busy = at::mm(big, big);
  const at::Tensor ids = at::randint(0, 49152, {3, 7}, gen, at::kLong);
  const at::Tensor strided = ids.t();  // not contiguous: copied as its values
  const at::Tensor floats = at::randn({5, 4}, gen);
  const at::Tensor on_ids = comb::detail::upload(ids, at::kCUDA), on_strided = comb::detail::upload(strided, at::kCUDA);
  const at::Tensor on_floats = comb::detail::upload(floats, at::kCUDA);
  const at::Tensor ints = comb::detail::upload_ints(std::vector<int64_t>{4, -3, 1LL << 40}, at::kLong, at::kCUDA);
  const at::Tensor ints32 = comb::detail::upload_ints(std::vector<int32_t>{7, -9}, at::kInt, at::kCUDA);
  CHECK(on_ids.is_cuda());
  CHECK(on_ids.sizes() == ids.sizes());
  CHECK(at::equal(on_ids.cpu(), ids));
  CHECK(at::equal(on_strided.cpu(), strided));
  CHECK(at::equal(on_floats.cpu(), floats));
  CHECK(at::equal(ints.cpu(), at::tensor(std::vector<int64_t>{4, -3, 1LL << 40}, at::kLong)));
  CHECK(at::equal(ints32.cpu(), at::tensor(std::vector<int32_t>{7, -9}, at::kInt)));
  CHECK(at::isfinite(busy).all().item<bool>());
  // On the host or already on the device: the tensor itself.
  CHECK(comb::detail::upload(ids, at::kCPU).is_same(ids));
  CHECK(comb::detail::upload(on_ids, at::kCUDA).is_same(on_ids));
}

// Model::decode on a GPU reads a greedy token back as its id, logit and the row's log-sum-exp (not
// the row): the same tokens and log-probabilities as the logits of one forward over the prompt and
// those tokens, log-softmaxed on the host.
TEST_CASE("Model::generate on CUDA reads a greedy token and its log-probability, not the row", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  const Model m = Model::load(cuda_model_path(), Options{"cuda"});
  const std::vector<int32_t> prompt = m.chat_prompt("Name three colours.");
  GenerateOptions o;
  o.max_tokens = 12;
  const GenerationResult r = m.generate(prompt, o);
  REQUIRE(!r.tokens.empty());
  REQUIRE(r.logprobs.size() == r.tokens.size());
  std::vector<int64_t> all(prompt.begin(), prompt.end());
  all.insert(all.end(), r.tokens.begin(), r.tokens.end());
  KVCache cache = m.decoder().make_cache(1, static_cast<int64_t>(all.size()));
  const at::Tensor logits =
      m.decoder().forward(at::tensor(all, at::kLong).view({1, -1}), cache, LogitsMode::all)[0].to(at::kCPU, at::kFloat);
  const int64_t p = static_cast<int64_t>(prompt.size());
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    const at::Tensor row = logits[p - 1 + static_cast<int64_t>(i)];
    const float want = at::log_softmax(row, 0)[r.tokens[i]].item<float>();
    INFO("token " << i);
    // float32 throughout: one forward against steps after a cache differ by float32 sums' order.
    CHECK(std::abs(r.logprobs[i] - want) <= 1e-3f * std::max(1.0f, std::abs(want)));
    const auto top = row.topk(2);
    const float gap = std::get<0>(top)[0].item<float>() - std::get<0>(top)[1].item<float>();
    if (gap > 1e-3f) CHECK(r.tokens[i] == std::get<1>(top)[0].item<int64_t>());
  }
}

TEST_CASE("comb::add_rms_norm equals the residual add and RMSNorm in ATen", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  auto gen = at::detail::createCPUGenerator(3);
  for (auto type : kHalfTypes)
    for (int64_t rows : {1, 3, 7})
      for (int64_t dim : {576, 733, 2048}) {
        auto make = [&](double s) { return (at::randn({rows, dim}, gen) * s).to(at::kCUDA, type); };
        at::Tensor residual = make(1.0), delta = make(0.5), weight = make(1.0)[0].contiguous();
        at::Tensor want_residual = residual + delta;
        at::Tensor want = rms_norm(want_residual, weight, 1e-5);
        at::Tensor got_residual = residual.clone();
        at::Tensor got = call("comb::add_rms_norm", {got_residual, delta, weight, 1e-5});
        INFO(c10::toString(type) << " rows " << rows << " dim " << dim);
        // The add rounds once, as ATen's: equal.
        CHECK(at::equal(got_residual, want_residual));
        // The sum of squares in another order moves the scale by a few float ulps, which can flip
        // the rounding of x * scale and then of weight * that: at most two ulps of the type.
        CHECK(at::allclose(got.to(at::kFloat), want.to(at::kFloat), 2 * ulp(type), 1e-6));
        // No delta: the norm alone, the residual untouched.
        at::Tensor alone = call("comb::add_rms_norm", {residual, c10::IValue(), weight, 1e-5});
        CHECK(at::allclose(alone.to(at::kFloat), rms_norm(residual, weight, 1e-5).to(at::kFloat), 2 * ulp(type), 1e-6));
      }
}

TEST_CASE("comb::rope_append equals apply_rope and the cache writes in ATen", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  auto gen = at::detail::createCPUGenerator(5);
  for (auto type : kHalfTypes)
    for (auto [n_head, n_kv, hd] : {std::tuple{9, 3, 64}, std::tuple{4, 4, 32}, std::tuple{8, 2, 128}})
      for (int64_t n : {1, 5})
        for (int64_t position : {0, 37}) {
          const int64_t capacity = 64;
          at::Tensor angles = at::arange(capacity, at::kFloat).unsqueeze(1) * at::rand({1, hd}, gen);
          at::Tensor cos = angles.cos().to(at::kCUDA, type), sin = angles.sin().to(at::kCUDA, type);
          at::Tensor qkv = at::randn({n, (n_head + 2 * n_kv) * hd}, gen).to(at::kCUDA, type);
          at::Tensor k_cache = at::zeros({1, n_kv, capacity, hd}, qkv.options()), v_cache = at::zeros_like(k_cache);
          at::Tensor q = call("comb::rope_append", {qkv, cos, sin, k_cache, v_cache, position, int64_t(n_head)});
          // The composition: [n, heads, hd] -> [heads, n, hd].
          auto heads = [&](int64_t offset, int64_t count) {
            return qkv.narrow(1, offset * hd, count * hd).view({n, count, hd}).transpose(0, 1);
          };
          at::Tensor c = cos.narrow(0, position, n), s = sin.narrow(0, position, n);
          at::Tensor want_q = apply_rope(heads(0, n_head), c, s).transpose(0, 1);
          at::Tensor want_k = apply_rope(heads(n_head, n_kv), c, s);
          at::Tensor want_v = heads(n_head + n_kv, n_kv);
          INFO(c10::toString(type) << " heads " << n_head << "/" << n_kv << " hd " << hd << " n " << n << " at "
                                   << position);
          // Each product and the sum rounded where ATen rounds them: equal.
          CHECK(at::equal(q, want_q));
          CHECK(at::equal(k_cache[0].narrow(1, position, n), want_k));
          CHECK(at::equal(v_cache[0].narrow(1, position, n), want_v));
          // Nothing else written.
          CHECK(k_cache.abs().sum().item<double>() == Approx(want_k.abs().sum().item<double>()));
        }
}

TEST_CASE("comb::place_keys equals apply_rope at the new position in ATen", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  auto gen = at::detail::createCPUGenerator(6);
  for (auto type : kHalfTypes)
    for (auto [n_kv, hd] : {std::pair{3, 64}, std::pair{8, 128}, std::pair{1, 32}})
      for (int64_t n : {1, 19})
        for (int64_t position : {1, 40}) {
          const int64_t capacity = 64;
          at::Tensor angles = at::arange(capacity, at::kFloat).unsqueeze(1) * at::rand({1, hd}, gen);
          at::Tensor cos = angles.cos().to(at::kCUDA, type), sin = angles.sin().to(at::kCUDA, type);
          // Rows of a wider tensor: strided heads and rows, as a store's entry may hold them.
          at::Tensor k = at::randn({1, n_kv, n + 3, hd}, gen).to(at::kCUDA, type).narrow(2, 1, n);
          at::Tensor k_cache = at::zeros({1, n_kv, capacity, hd}, k.options());
          call("comb::place_keys", {k, cos, sin, k_cache, position});
          at::Tensor want = apply_rope(k, cos.narrow(0, position, 1), sin.narrow(0, position, 1));
          INFO(c10::toString(type) << " heads " << n_kv << " hd " << hd << " n " << n << " at " << position);
          CHECK(at::equal(k_cache.narrow(2, position, n), want));  // the same roundings: equal
          CHECK(k_cache.abs().sum().item<double>() == Approx(want.abs().sum().item<double>()));
        }
}

TEST_CASE("comb::gemv equals the matrix product in float32", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  auto gen = at::detail::createCPUGenerator(8);
  for (auto type : kHalfTypes)
    for (auto [n, k] : {std::pair{1, 8}, std::pair{7, 64}, std::pair{733, 576}, std::pair{3072, 2048},
                        std::pair{4096, 14336}, std::pair{49152, 576}}) {
      at::Tensor w = (at::randn({n, k}, gen) * 0.05).to(at::kCUDA, type);
      at::Tensor x = at::randn({1, k}, gen).to(at::kCUDA, type);
      at::Tensor got = call("comb::gemv", {w, x});
      REQUIRE(got.sizes() == at::IntArrayRef{1, n});
      at::Tensor want = at::mm(x.to(at::kFloat), w.to(at::kFloat).t());
      // float32 sums of k products in another order: at most k * 2^-24 of sum |w x| apart; then
      // one rounding to the type: half an ulp of |y|.
      at::Tensor scale = at::mm(x.to(at::kFloat).abs(), w.to(at::kFloat).abs().t());
      at::Tensor bound = scale * (k * std::ldexp(1.0, -24)) + want.abs() * ulp(type) / 2;
      INFO(c10::toString(type) << " n " << n << " k " << k);
      CHECK(((got.to(at::kFloat) - want).abs() <= bound + 1e-30).all().item<bool>());
    }
}

TEST_CASE("comb::silu_mul equals silu(gate) * up in ATen", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  auto gen = at::detail::createCPUGenerator(7);
  for (auto type : kHalfTypes)
    for (int64_t rows : {1, 3})
      for (int64_t n_ff : {1536, 733}) {
        at::Tensor gate_up = (at::randn({rows, 2 * n_ff}, gen) * 3).to(at::kCUDA, type);
        at::Tensor got = call("comb::silu_mul", {gate_up});
        auto halves = gate_up.chunk(2, -1);
        at::Tensor want = at::silu(halves[0]) * halves[1];
        INFO(c10::toString(type) << " rows " << rows << " n_ff " << n_ff);
        // expf against ATen's exp may differ in a float ulp, flipping at most the two roundings.
        CHECK(at::allclose(got.to(at::kFloat), want.to(at::kFloat), 2 * ulp(type), 1e-6));
      }
}

TEST_CASE("comb::rows_attention equals SDPA over the cache and the joined keys", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  auto gen = at::detail::createCPUGenerator(9);
  int cases = 0;
  for (auto type : kHalfTypes)
    for (auto [n_head, n_kv, hd] :
         {std::tuple{9, 3, 64}, std::tuple{4, 4, 32}, std::tuple{32, 8, 128}, std::tuple{16, 1, 64}, std::tuple{4, 2, 256}})
      for (auto [n, start] : {std::pair{1, 0}, std::pair{1, 18}, std::pair{1, 732}, std::pair{1, 1023}, std::pair{5, 14},
                              std::pair{3, 700}})
        for (int64_t m : {0, 1, 37}) {
          if (m > 0 && (start % 2 == 1 || type == at::kHalf)) continue;  // fewer cases with documents
          const int64_t capacity = 1024, anchor = start + n / 2;
          at::Tensor k_cache = at::randn({1, n_kv, capacity, hd}, gen).to(at::kCUDA, type);
          at::Tensor v_cache = at::randn({1, n_kv, capacity, hd}, gen).to(at::kCUDA, type);
          at::Tensor q = at::randn({n, n_head, hd}, gen).to(at::kCUDA, type);
          at::Tensor jk, jv, bias;
          if (m > 0) {
            jk = at::randn({n_kv, m, hd}, gen).to(at::kCUDA, type);
            jv = at::randn({n_kv, m, hd}, gen).to(at::kCUDA, type);
            bias = at::randn({n_head}, gen).to(at::kCUDA);
          }
          at::Tensor got = call("comb::rows_attention", {q, k_cache, v_cache, int64_t(start),
                                                         jk.defined() ? c10::IValue(jk) : c10::IValue(),
                                                         jv.defined() ? c10::IValue(jv) : c10::IValue(),
                                                         bias.defined() ? c10::IValue(bias) : c10::IValue(), anchor});
          // The reference, row by row in float32 from the same rounded inputs: the joined keys (for
          // rows at or past the anchor, each score plus the head's bias) before the causal context.
          double max_v = v_cache.abs().max().item<double>();
          std::vector<at::Tensor> rows;
          for (int64_t r = 0; r < n; ++r) {
            const int64_t pos = start + r;
            at::Tensor keys = k_cache[0].narrow(1, 0, pos + 1).to(at::kFloat);
            at::Tensor values = v_cache[0].narrow(1, 0, pos + 1).to(at::kFloat);
            at::Tensor mask = at::zeros({n_head, 1, pos + 1});
            if (m > 0 && pos >= anchor) {
              keys = at::cat({jk.to(at::kFloat), keys}, 1);
              values = at::cat({jv.to(at::kFloat), values}, 1);
              mask = at::cat({bias.cpu().view({n_head, 1, 1}).expand({n_head, 1, m}), mask}, 2);
              max_v = std::max(max_v, jv.abs().max().item<double>());
            }
            rows.push_back(at::scaled_dot_product_attention(q[r].to(at::kFloat).view({1, n_head, 1, hd}), keys.unsqueeze(0),
                                                            values.unsqueeze(0), mask.to(at::kCUDA).unsqueeze(0), 0.0,
                                                            false, std::nullopt, /*enable_gqa=*/true)
                               .view({n_head, hd}));
          }
          at::Tensor want = at::stack(rows);
          INFO(c10::toString(type) << " heads " << n_head << "/" << n_kv << " hd " << hd << " rows " << n << " after "
                                   << start << ", " << m << " joined keys");
          // Both sum in float32 (their difference: about length * 2^-24 of the largest value, under
          // 1e-4 here); the kernel's output is then rounded once to the type: half an ulp of |out|,
          // and |out| <= max |v|.
          CHECK(at::allclose(got.to(at::kFloat), want, ulp(type), 1e-4 * max_v));
          ++cases;
        }
  CHECK(cases > 50);
}

TEST_CASE("the fused CUDA layers and the one-launch decoding step match the generic path", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  // Any Llama-family model whose head_dim the step takes (the default model's is 64).
  CudaModels models = cuda_models();
  const Model &f32 = models.f32, &bf16 = models.bf16;
  const Decoder& graph = bf16.decoder();
  Decoder generic(graph.config(), graph.weights(), graph.dtype(), graph.device());
  generic.set_cuda_kernels(false);
  const auto& c = graph.config();
  auto gen = at::detail::createCPUGenerator(13);
  at::Tensor prompt = at::randint(c.n_vocab, {1, 120}, gen);
  at::Tensor fed = at::randint(c.n_vocab, {24}, gen);
  // Teacher-forced: the same tokens fed to each decoder, the logits of every position kept: a
  // prompt of 100 (FlashAttention), 20 more after it (the rows kernel), then one-token steps.
  auto steps = [&](const Decoder& d) {
    KVCache cache = d.make_cache(1, 160);
    std::vector<at::Tensor> out;
    out.push_back(d.forward(prompt.narrow(1, 0, 100), cache, LogitsMode::all)[0].cpu());
    out.push_back(d.forward(prompt.narrow(1, 100, 20), cache, LogitsMode::all)[0].cpu());
    for (int64_t i = 0; i < fed.size(0); ++i) out.push_back(d.forward(fed.narrow(0, i, 1).view({1, 1}), cache)[0].cpu());
    return std::make_pair(at::cat(out), cache.keys(c.n_layer - 1).narrow(2, 0, cache.length()).cpu());
  };
  {
    KVCache probe = graph.make_cache(1, 8);
    REQUIRE(graph.cuda_graph_applies(probe));
    REQUIRE_FALSE(generic.cuda_graph_applies(probe));
    REQUIRE(graph.cuda_kernels_apply(probe));
    REQUIRE_FALSE(generic.cuda_kernels_apply(probe));
    REQUIRE_FALSE(f32.decoder().cuda_graph_applies(f32.decoder().make_cache(1, 8)));
  }
  auto [want, want_k] = steps(f32.decoder());
  auto [got, got_k] = steps(graph);
  auto [ref, ref_k] = steps(generic);
  const auto [err_graph, rms_graph, err_generic, rms_generic] = spread(got, ref, want);
  INFO("|logit - float32| over 144 positions, max and root mean square: fused " << err_graph << ", " << rms_graph
                                                                               << "; generic bf16 " << err_generic
                                                                               << ", " << rms_generic);
  // Both round at the same steps to bfloat16 and differ only in the order of their float32 sums:
  // the fused path is to be as close to float32 as the composition it replaces. Over 7 million
  // logits the root mean square of two such equally rounded walks differs by a few percent (10%
  // allowed); a single largest difference spreads more (half again allowed).
  CHECK(rms_graph <= 1.1 * rms_generic);
  CHECK(err_graph <= 1.5 * err_generic);
  // The same top token as the generic path wherever that one is clear of its runner-up by more
  // than both paths' distance to float32.
  check_clear_top(got, ref, 2 * (err_graph + err_generic));
  // The keys the fused path wrote (the last layer's) as far from the generic path's, relative to
  // their size, as the logits are from float32's (twice, for the two paths' walks).
  const double rms = [](const at::Tensor& t) { return t.to(at::kFloat).pow(2).mean().sqrt().item<double>(); }(ref_k);
  const double rms_dk = (got_k.to(at::kFloat) - ref_k.to(at::kFloat)).pow(2).mean().sqrt().item<double>();
  CHECK(rms_dk / rms <= 2 * rms_generic / want.pow(2).mean().sqrt().item<double>());

  // Replayed graph against the same kernels launched one by one: equal, step after step.
  // And the graph with RoPE, the cache append, attention and the merge in one launch
  // (COMB_CUDA_FUSED_ATTENTION=1): the same values rounded at the same steps, equal too.
  auto spec = graph.decode_step_spec();
  auto launched = decode_step(spec, /*graph=*/false, /*fused_attention=*/false);
  auto replayed = decode_step(spec, /*graph=*/true, /*fused_attention=*/false);
  auto fused = decode_step(spec, /*graph=*/true, /*fused_attention=*/true);
  KVCache a = graph.make_cache(1, 32), b = graph.make_cache(1, 32), f = graph.make_cache(1, 32);
  std::vector<at::Tensor> ak, av, bk, bv, fk, fv;
  for (int64_t l = 0; l < c.n_layer; ++l) {
    ak.push_back(a.keys(l)), av.push_back(a.values(l)), bk.push_back(b.keys(l)), bv.push_back(b.values(l));
    fk.push_back(f.keys(l)), fv.push_back(f.values(l));
  }
  for (int64_t pos = 0; pos < 20; ++pos) {
    const int64_t token = fed[pos % fed.size(0)].item<int64_t>();
    at::Tensor x = launched->run({token}, pos, ak, av, {});
    at::Tensor y = replayed->run({token}, pos, bk, bv, {});
    at::Tensor z = fused->run({token}, pos, fk, fv, {});
    INFO("position " << pos);
    REQUIRE(at::equal(x, y));
    REQUIRE(at::equal(x, z));
  }
  for (int64_t l = 0; l < c.n_layer; ++l) {  // the 20 positions written (the rest was never set)
    CHECK(at::equal(a.keys(l).narrow(2, 0, 20), b.keys(l).narrow(2, 0, 20)));
    CHECK(at::equal(a.values(l).narrow(2, 0, 20), b.values(l).narrow(2, 0, 20)));
    CHECK(at::equal(a.keys(l).narrow(2, 0, 20), f.keys(l).narrow(2, 0, 20)));
    CHECK(at::equal(a.values(l).narrow(2, 0, 20), f.values(l).narrow(2, 0, 20)));
  }
  // Past the cache: an error naming it, nothing launched.
  CHECK_THROWS_WITH(replayed->run({1}, 32, bk, bv, {}), Catch::Contains("past the cache's capacity 32"));
  CHECK_THROWS_WITH(replayed->run({1, 2, 3}, 30, bk, bv, {}), Catch::Contains("3 rows at position 30 past"));
}

TEST_CASE("CUDA graphs are captured while the store's writer copies device entries to the host", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  Model bf16 = cuda_bf16_model();
  const Decoder& d = bf16.decoder();
  const c10::Device cuda = d.device();
  StoreOptions options;
  options.device = cuda;
  options.device_bytes = int64_t(64) << 20;
  options.host_bytes = 0;
  options.disk_bytes = int64_t(1) << 30;
  options.disk_dir = temp_dir("capture-disk");
  options.disk_queue_bytes = int64_t(8) << 20;  // the writer busy throughout
  PICacheStore store(options);
  std::atomic<bool> stop{false}, failed{false};
  std::atomic<int> put{0};
  // Another thread puts entries of 4 MiB made on the device; the store's writer copies each to the
  // host (on a stream of its own) while this thread captures graphs. A capture in the global mode
  // refuses the writer's copies (a failed write) or is broken by them.
  std::thread producer([&] {
    try {
      c10::InferenceMode inner;
      for (int i = 0; !stop && i < 100000; ++i) {
        DocumentKV kv;
        kv.n_tokens = 512;
        for (int b = 0; b < 4; ++b) {
          kv.keys.push_back(at::rand({4, 512, 64}, at::TensorOptions().device(cuda)));
          kv.values.push_back(at::rand({4, 512, 64}, at::TensorOptions().device(cuda)));
        }
        store.put(PICacheStore::key({i}, "capture"), kv);
        ++put;
      }
    } catch (...) {
      failed = true;
    }
  });
  while (put < 2 && !failed) std::this_thread::yield();
  const auto spec = d.decode_step_spec();
  const auto& c = d.config();
  for (int k = 0; k < 6 && !failed; ++k) {
    auto launched = decode_step(spec, /*graph=*/false, /*fused_attention=*/false);
    auto replayed = decode_step(spec, /*graph=*/true, /*fused_attention=*/false);  // captured at its first run
    KVCache a = d.make_cache(1, 8), b = d.make_cache(1, 8);
    std::vector<at::Tensor> ak, av, bk, bv;
    for (int64_t l = 0; l < c.n_layer; ++l)
      ak.push_back(a.keys(l)), av.push_back(a.values(l)), bk.push_back(b.keys(l)), bv.push_back(b.values(l));
    for (int64_t pos = 0; pos < 3; ++pos) {
      const int64_t token = 1000 + 37 * k + pos;
      INFO("graph " << k << ", position " << pos);
      REQUIRE(at::equal(launched->run({token}, pos, ak, av, {}), replayed->run({token}, pos, bk, bv, {})));
    }
  }
  stop = true;
  producer.join();
  REQUIRE_FALSE(failed);
  store.flush();
  const StoreStats s = store.stats();
  CHECK(s.write_errors == 0);
  CHECK(s.disk.entries + s.disk.evictions == put.load());  // every entry written (the oldest evicted past 1 GiB)
  remove_dir(options.disk_dir);
}

TEST_CASE("bf16 on CUDA is as close to float32 as transformers' bf16 on the same weights", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  // transformers' float32 and bfloat16 logits of COMB_CUDA_MODEL's folder on this GPU
  // (tests/oracle/bf16_reference.py --device cuda; bench/gpu_check.sh step 1 makes them), fed as
  // there: a prompt of 100 (FlashAttention), 20 rows after it with every row's logits (the fused
  // layers' rows kernel), 3 pieces of 7 with their last row's (the graph bucket of 8), 24 one-token
  // steps (the decoding step's graph).
  const std::string ref = env_or("COMB_CUDA_BF16_REF", "");
  if (ref.empty()) {
    WARN("COMB_CUDA_BF16_REF names no reference (tests/oracle/bf16_reference.py --model COMB_CUDA_MODEL "
         "--device cuda): comb's bf16 against transformers' is not checked here");
    return;
  }
  const AgainstTransformers bf16 = against_transformers(cuda_model_path(), ref, Options{"cuda", "bfloat16"});
  const AgainstTransformers f32 = against_transformers(cuda_model_path(), ref, Options{"cuda"});
  INFO(describe(bf16, f32));
  // As on the CPU ("bf16 on CPU is as close to float32 as transformers' bf16...", which argues the
  // factors): the fused kernels round at no more points than transformers' composition does.
  // Hence comb's bf16 within 2.5x transformers' root mean square distance to float32 of
  // transformers' bf16 (triangle inequality): the tolerance the issue asks for, stated.
  CHECK(bf16.rms <= 1.5 * bf16.rms_hf);
  CHECK(bf16.max <= 2 * bf16.max_hf);
  // float32 on the GPU as on the CPU: no half-precision or TF32 rounding on the way.
  CHECK(f32.rms <= bf16.rms_hf / 16);
}

namespace {
int layer_cuda_calls = 0;  // comb::layer_cuda records seen by count_layer_cuda
std::unique_ptr<at::ObserverContext> count_layer_cuda(const at::RecordFunction& fn) {
  if (std::string(fn.name()) == "comb::layer_cuda") ++layer_cuda_calls;
  return nullptr;
}

// Joint blocks for a decoder's forward: joint[layer] where defined, nothing else (no residual block).
class TestJoint final : public LayerReads {
 public:
  explicit TestJoint(std::vector<JointKV> joint) : joint_(std::move(joint)) {}
  bool changes_state() const override { return false; }
  const JointKV* joint(int64_t layer) const override {
    return joint_[layer].keys.defined() ? &joint_[layer] : nullptr;
  }

 private:
  std::vector<JointKV> joint_;
};
}  // namespace

TEST_CASE("the graph step runs short forwards in buckets of rows, with joint blocks, as the fused layers do",
          "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  CudaModels models = cuda_models();
  const Decoder& f32 = models.f32.decoder();
  const Decoder& bf16 = models.bf16.decoder();
  const auto& c = bf16.config();
  auto gen = at::detail::createCPUGenerator(29);
  // Joined keys for two layers (30 and 7 of them, a bias on one), read by rows from position 20 on.
  const int64_t anchor = 20;
  std::vector<JointKV> joint_bf16(c.n_layer), joint_f32(c.n_layer);
  for (int64_t layer : {int64_t(1), c.n_layer - 1}) {
    const int64_t m = layer == 1 ? 30 : 7;
    at::Tensor k = (at::randn({1, c.n_head_kv, m, c.head_dim}, gen) * 2).to(at::kCUDA, at::kBFloat16);
    at::Tensor v = at::randn({1, c.n_head_kv, m, c.head_dim}, gen).to(at::kCUDA, at::kBFloat16);
    at::Tensor bias = layer == 1 ? at::randn({c.n_head}, gen).to(at::kCUDA) : at::Tensor();
    joint_bf16[layer] = JointKV{k, v, {}, bias, anchor};
    joint_f32[layer] = JointKV{k.to(at::kFloat), v.to(at::kFloat), {}, bias, anchor};  // the same values
  }
  const TestJoint reads_bf16(joint_bf16), reads_f32(joint_f32);
  at::Tensor fed = at::randint(c.n_vocab, {1, 240}, gen);
  // Pieces of 1, 3 (a bucket of 4), 17 (32), 64 and 12 tokens, then one-token steps: the last
  // row's logits of each, the pieces straddling the anchor.
  const std::vector<int64_t> pieces{1, 3, 17, 64, 12, 1, 1, 1};
  // How each forward runs: the graph step (the last row), or the fused layers (every row, the
  // last kept) which a forward asking for every row's logits takes.
  auto run = [&](const Decoder& d, const LayerReads* reads, LogitsMode mode) {
    KVCache cache = d.make_cache(1, 200);
    std::vector<at::Tensor> out;
    int64_t at = 0;
    for (int64_t n : pieces) {
      at::Tensor logits = d.forward(fed.narrow(1, at, n).to(d.device()), cache, mode, reads);
      out.push_back(logits[0][-1].cpu());
      at += n;
    }
    return std::make_pair(at::stack(out), cache.keys(c.n_layer - 1).narrow(2, 0, at).cpu());
  };
  for (const bool with_documents : {false, true}) {
    INFO((with_documents ? "with" : "without") << " joint blocks");
    const LayerReads* rb = with_documents ? &reads_bf16 : nullptr;
    const LayerReads* rf = with_documents ? &reads_f32 : nullptr;
    REQUIRE(bf16.cuda_graph_applies(bf16.make_cache(1, 8)));
    auto [want, want_k] = run(f32, rf, LogitsMode::last);
    layer_cuda_calls = 0;
    auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback(count_layer_cuda).needsInputs(false));
    auto [layers, layers_k] = run(bf16, rb, LogitsMode::all);
    const int by_layers = layer_cuda_calls;
    auto [got, got_k] = run(bf16, rb, LogitsMode::last);
    at::removeCallback(handle);
    // The fused layers ran the four pieces of several tokens (one-token ones take the step either
    // way); the forwards asking for the last row alone ran none.
    CHECK(by_layers == 4 * c.n_layer);
    CHECK(layer_cuda_calls == by_layers);
    const auto [err_got, rms_got, err_layers, rms_layers] = spread(got, layers, want);
    INFO("|logit - float32|, max and root mean square: graph step " << err_got << ", " << rms_got << "; fused layers "
                                                                   << err_layers << ", " << rms_layers);
    // The same roundings at the same steps; the sums' order differs: cuBLAS's GEMMs see a bucket's
    // rows (up to 64) instead of the piece's, the attention's split count is the bucket's, and the
    // output norm is the fused kernel instead of Decoder::logits' ATen one. Two equally rounded
    // walks, each as near float32 as the other; over 8 rows of logits (fewer than the one-token
    // case's 144) as the paged step's 18-row case allows: half again, twice for the largest.
    CHECK(rms_got <= 1.5 * rms_layers);
    CHECK(err_got <= 2 * err_layers);
    check_clear_top(got, layers, 2 * (err_got + err_layers));
    // The last layer's keys as near each other, relative to their size, as the logits are to
    // float32's (twice, for the two walks), as in the one-token case.
    const auto rms = [](const at::Tensor& t) { return t.to(at::kFloat).pow(2).mean().sqrt().item<double>(); };
    CHECK(rms(got_k.to(at::kFloat) - layers_k.to(at::kFloat)) / rms(layers_k) <= 2 * rms_layers / rms(want));
  }

  // A bucket wider than the cache has room for (17 tokens run as 32 rows, 20 positions held): the
  // step, its padding touching nothing past the real rows.
  {
    layer_cuda_calls = 0;
    auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback(count_layer_cuda).needsInputs(false));
    KVCache tight = bf16.make_cache(1, 20);
    for (int64_t l = 0; l < c.n_layer; ++l) tight.keys(l).fill_(7.0), tight.values(l).fill_(7.0);
    at::Tensor by_step = bf16.forward(fed.narrow(1, 0, 17).to(at::kCUDA), tight, LogitsMode::last);
    CHECK(layer_cuda_calls == 0);
    CHECK(tight.length() == 17);
    for (int64_t l = 0; l < c.n_layer; ++l) {
      CHECK(at::all(tight.keys(l).narrow(2, 17, 3) == 7.0).item<bool>());
      CHECK(at::all(tight.values(l).narrow(2, 17, 3) == 7.0).item<bool>());
    }
    // Where the step does not fit, the forward runs the layers: joined keys with a padding mask.
    std::vector<JointKV> masked = joint_bf16;
    masked[1].valid = at::ones({1, masked[1].keys.size(2)}, at::TensorOptions().dtype(at::kBool).device(at::kCUDA));
    const TestJoint reads_masked(masked);
    KVCache roomy = bf16.make_cache(1, 64);
    layer_cuda_calls = 0;
    at::Tensor masked_logits = bf16.forward(fed.narrow(1, 0, 5).to(at::kCUDA), roomy, LogitsMode::last, &reads_masked);
    at::removeCallback(handle);
    // Every layer but 1, whose joined keys carry a mask, takes the fused path (layer 1 the generic one).
    CHECK(layer_cuda_calls == c.n_layer - 1);
    CHECK(roomy.length() == 5);
    // The step's last row as the layers compute it with room to spare: two bfloat16 walks (2^-8
    // relative a rounding) differ by a few roundings of the logits' size; a wrong row, position or
    // padding written into the context would differ by the logits themselves.
    KVCache room = bf16.make_cache(1, 64);
    const at::Tensor by_layers = bf16.forward(fed.narrow(1, 0, 17).to(at::kCUDA), room, LogitsMode::all)[0][-1];
    const double scale = by_layers.abs().max().item<double>();
    CHECK((by_step.view({-1}) - by_layers).abs().max().item<double>() <= 0.05 * scale);
    CHECK(at::isfinite(masked_logits).all().item<bool>());
  }

  // Replayed against launched, in every bucket, with the joined keys: equal, and the same caches.
  // The fused attention's graph (COMB_CUDA_FUSED_ATTENTION=1) as well: rows reading the keys of the
  // rows before them from the same launch, padding rows, the joined keys; equal too.
  auto spec = bf16.decode_step_spec();
  auto launched = decode_step(spec, /*graph=*/false, /*fused_attention=*/false);
  auto replayed = decode_step(spec, /*graph=*/true, /*fused_attention=*/false);
  auto fused = decode_step(spec, /*graph=*/true, /*fused_attention=*/true);
  KVCache a = bf16.make_cache(1, 260), b = bf16.make_cache(1, 260), f = bf16.make_cache(1, 260);
  std::vector<at::Tensor> ak, av, bk, bv, fk, fv;
  std::vector<comb::detail::StepJoined> joined(c.n_layer);
  for (int64_t l = 0; l < c.n_layer; ++l) {
    for (const KVCache* kv : {&a, &b, &f}) kv->keys(l).fill_(7.0), kv->values(l).fill_(7.0);  // a sentinel past the rows
    ak.push_back(a.keys(l)), av.push_back(a.values(l)), bk.push_back(b.keys(l)), bv.push_back(b.values(l));
    fk.push_back(f.keys(l)), fv.push_back(f.values(l));
    if (joint_bf16[l].keys.defined())
      joined[l] = {joint_bf16[l].keys[0].contiguous(), joint_bf16[l].values[0].contiguous(), joint_bf16[l].bias, anchor};
  }
  int64_t at = 0;
  // Every bucket up to kStepRowsMax (100 rows: 128, which Decoder::forward takes with
  // COMB_CUDA_STEP_ROWS=128); the last in a bucket of 4: one padding row past the end.
  for (int64_t n : {1, 2, 3, 5, 9, 17, 33, 64, 100, 1, 3}) {
    const at::Tensor t = fed[0].narrow(0, at % 70, n).contiguous();
    const std::vector<int64_t> ids(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
    at::Tensor x = launched->run(ids, at, ak, av, joined);
    at::Tensor y = replayed->run(ids, at, bk, bv, joined);
    at::Tensor z = fused->run(ids, at, fk, fv, joined);
    INFO(n << " rows at position " << at);
    REQUIRE(at::equal(x, y));
    REQUIRE(at::equal(x, z));
    at += n;
  }
  for (int64_t l = 0; l < c.n_layer; ++l) {  // the real rows' positions; past them, untouched
    CHECK(at::equal(a.keys(l), b.keys(l)));
    CHECK(at::equal(a.values(l), b.values(l)));
    CHECK(at::equal(a.keys(l), f.keys(l)));
    CHECK(at::equal(a.values(l), f.values(l)));
    CHECK(at::all(b.keys(l).narrow(2, at, 260 - at) == 7.0).item<bool>());
    CHECK(at::all(b.values(l).narrow(2, at, 260 - at) == 7.0).item<bool>());
  }
  // Joined keys of another type: refused by name, nothing run.
  std::vector<comb::detail::StepJoined> wrong = joined;
  wrong[1].keys = wrong[1].keys.to(at::kFloat);
  CHECK_THROWS_WITH(replayed->run({1}, at, bk, bv, wrong), Catch::Contains("layer 1's joined keys"));
}

TEST_CASE("join_documents places int8, float32 and half documents as a float32 rotation would", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  const comb::detail::CudaLayerOps& ops = layer_ops();
  REQUIRE(ops.join_documents);
  auto gen = at::detail::createCPUGenerator(21);
  const int64_t n_ctx = 512;
  int checked = 0;
  for (auto type : kHalfTypes)
    for (int64_t hd : {32, 64, 128}) {
      const int64_t n_kv = 3, rows = 2, blocks = 2;
      // RoPE tables as a decoder of this type keeps them, read as float32.
      at::Tensor angles = at::arange(n_ctx, at::kDouble).unsqueeze(1) *
                          at::pow(10000.0, -at::arange(0, hd, 2, at::kDouble) / double(hd)).repeat({2}).unsqueeze(0);
      at::Tensor cos = angles.cos().to(type).to(at::kFloat), sin = angles.sin().to(type).to(at::kFloat);
      // Row 0: three documents (int8 per channel, int8 per row, float32); row 1: one in half.
      struct Doc {
        int64_t row, offset, angle, len;
        int kind;  // 0 int8, 1 float32, 2 half
      };
      const std::vector<Doc> docs{{0, 0, -300, 70, 0}, {0, 70, 5, 9, 0}, {0, 79, 0, 40, 1}, {1, 3, 411, 50, 2}};
      const int64_t m = 119;
      std::vector<at::Tensor> out_k, out_v;
      for (int64_t b = 0; b < blocks; ++b) {  // a sentinel where no part is placed
        out_k.push_back(at::full({rows, n_kv, m, hd}, 7.0, at::TensorOptions().dtype(type).device(at::kCUDA)));
        out_v.push_back(at::full({rows, n_kv, m, hd}, 7.0, at::TensorOptions().dtype(type).device(at::kCUDA)));
      }
      std::vector<comb::detail::JoinPart> parts;
      std::vector<at::Tensor> src_k, src_v;  // each part's values as float32 (exact: int8 code x float16 scale)
      for (int64_t b = 0; b < blocks; ++b)
        for (const Doc& d : docs) {
          DocumentKV kv;
          kv.n_tokens = d.len;
          kv.keys.push_back(at::randn({n_kv, d.len, hd}, gen) * 3);
          kv.values.push_back(at::randn({n_kv, d.len, hd}, gen));
          comb::detail::JoinPart p;
          p.block = b, p.row = d.row, p.offset = d.offset, p.angle = d.angle;
          if (d.kind == 0) {
            DocumentKV q = kv.to(at::kCUDA, at::kChar);
            p.keys = q.keys[0], p.values = q.values[0], p.key_scales = q.key_scales[0], p.value_scales = q.value_scales[0];
            src_k.push_back(p.keys.cpu().to(at::kFloat) * p.key_scales.cpu().to(at::kFloat));
            src_v.push_back(p.values.cpu().to(at::kFloat) * p.value_scales.cpu().to(at::kFloat));
          } else {
            const auto dt = d.kind == 1 ? at::kFloat : type;
            p.keys = kv.keys[0].to(at::kCUDA, dt).contiguous(), p.values = kv.values[0].to(at::kCUDA, dt).contiguous();
            src_k.push_back(p.keys.cpu().to(at::kFloat));
            src_v.push_back(p.values.cpu().to(at::kFloat));
          }
          parts.push_back(std::move(p));
        }
      CHECK(parts[0].key_scales.size(1) == 1);            // 70 tokens: keys scaled per channel
      CHECK(parts[1].key_scales.size(2) == 1);            // 9: per row
      ops.join_documents(parts, out_k, out_v, cos.to(at::kCUDA), sin.to(at::kCUDA));
      std::vector<at::Tensor> got_k, got_v;
      for (int64_t b = 0; b < blocks; ++b) got_k.push_back(out_k[b].cpu()), got_v.push_back(out_v[b].cpu());
      std::vector<at::Tensor> covered(blocks);
      for (int64_t b = 0; b < blocks; ++b) covered[b] = at::zeros({rows, n_kv, m, hd}, at::kBool);
      for (size_t i = 0; i < parts.size(); ++i) {
        const auto& p = parts[i];
        const int64_t len = p.keys.size(1), half = hd / 2, a = std::abs(p.angle);
        // The turn in float64 from the float32 inputs.
        at::Tensor x = src_k[i].to(at::kDouble);
        at::Tensor c = cos[a].to(at::kDouble), s = sin[a].to(at::kDouble) * (p.angle < 0 ? -1.0 : 1.0);
        at::Tensor x1 = x.narrow(2, 0, half), x2 = x.narrow(2, half, half);
        at::Tensor want = at::cat({x1 * c.narrow(0, 0, half) - x2 * s.narrow(0, 0, half),
                                   x2 * c.narrow(0, half, half) + x1 * s.narrow(0, half, half)},
                                  2);
        at::Tensor gk = got_k[p.block][p.row].narrow(1, p.offset, len).to(at::kDouble);
        at::Tensor gv = got_v[p.block][p.row].narrow(1, p.offset, len);
        INFO(c10::toString(type) << " head_dim " << hd << " part " << i << " (turn " << p.angle << ")");
        // Rounded once to the type: within half an ulp (2^-8 or 2^-11 of |want|) of the float32
        // value, which is within 2 float32 roundings (2^-23 of |x1| + |x2| <= 2 max |x|) of want.
        const double max_x = x.abs().max().item<double>();
        CHECK(at::allclose(gk, want, ulp(type) / 2, std::ldexp(max_x, -21)));
        // Values: the float32 value rounded once, as ATen rounds it.
        CHECK(at::equal(gv, src_v[i].to(type)));
        covered[p.block][p.row].narrow(1, p.offset, len).fill_(true);
        ++checked;
      }
      for (int64_t b = 0; b < blocks; ++b) {  // the rest untouched
        CHECK(got_k[b].masked_select(covered[b].logical_not()).eq(7).all().item<bool>());
        CHECK(got_v[b].masked_select(covered[b].logical_not()).eq(7).all().item<bool>());
      }
      // A part past its output: an error naming it, nothing written.
      std::vector<comb::detail::JoinPart> bad{parts[2]};
      bad[0].offset = m - 10;
      CHECK_THROWS_WITH(ops.join_documents(bad, out_k, out_v, cos.to(at::kCUDA), sin.to(at::kCUDA)),
                        Catch::Contains("outside outputs"));
    }
  CHECK(checked == 2 * 3 * 8);
}

TEST_CASE("quantize_int8 on CUDA makes the CPU's int8 codes and scales, bit for bit", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  const comb::detail::CudaLayerOps& ops = layer_ops();
  REQUIRE(ops.quantize_int8);
  auto gen = at::detail::createCPUGenerator(23);
  int checked = 0;
  for (auto source : {at::kFloat, at::kBFloat16, at::kHalf})
    for (int64_t hd : {64, 128}) {
      const int64_t n_kv = 2, blocks = 3;
      // Documents of 1 to 200 tokens: keys per row below head_dim / 2 tokens, per channel from it
      // (int4 keys centred from head_dim tokens); one block all zeros (scale 1) and one with tiny
      // values (the 2^-14 floor).
      std::vector<int64_t> lens{1, 9, hd / 2 - 1, hd / 2, 200};
      std::vector<std::vector<std::array<at::Tensor, 2>>> in;
      std::vector<DocumentKV> want;
      for (int64_t len : lens) {
        DocumentKV cpu;  // the same values as float32 on the CPU
        cpu.n_tokens = len;
        in.emplace_back();
        for (int64_t b = 0; b < blocks; ++b) {
          at::Tensor k = at::randn({n_kv, len, hd}, gen) * 4, v = at::randn({n_kv, len, hd}, gen);
          // block 0's channels off zero by up to a few times their spread (centred int4 keys)
          if (b == 0) k.add_(at::randn({n_kv, 1, hd}, gen) * 16);
          if (b == 1) k.zero_();
          if (b == 2) v.mul_(1e-7);
          // NaN and infinite elements: in int8, NaN counts for nothing in a scale and is coded -127,
          // an infinity gives its scale 65504 and saturates; every path below as the CPU's
          if (b == 1) k[1][0][2] = INFINITY, k[0][len - 1][5] = NAN;
          if (b == 2) v[0][0][3] = NAN, v[1][len - 1][0] = -INFINITY;
          k = k.to(source).to(at::kFloat), v = v.to(source).to(at::kFloat);
          cpu.keys.push_back(k), cpu.values.push_back(v);
          in.back().push_back({k.to(at::kCUDA, source), v.to(at::kCUDA, source)});
        }
        want.push_back(cpu.to(at::kCPU, at::kChar));
      }
      std::vector<std::vector<std::array<at::Tensor, 4>>> out;
      ops.quantize_int8(in, out);
      REQUIRE(out.size() == lens.size());
      for (size_t d = 0; d < lens.size(); ++d)
        for (int64_t b = 0; b < blocks; ++b) {
          INFO(c10::toString(source) << " head_dim " << hd << ", " << lens[d] << " tokens, block " << b);
          const auto& [kc, ks, vc, vs] = out[d][b];
          CHECK(at::equal(kc.cpu(), want[d].keys[b]));
          CHECK(at::equal(ks.cpu(), want[d].key_scales[b]));
          CHECK(at::equal(vc.cpu(), want[d].values[b]));
          CHECK(at::equal(vs.cpu(), want[d].value_scales[b]));
          ++checked;
        }
      // The tensor-op conversion on the device (DocumentKV::to) gives the same entries.
      for (size_t d = 0; d < lens.size(); ++d) {
        DocumentKV on_device;
        on_device.n_tokens = lens[d];
        for (int64_t b = 0; b < blocks; ++b) on_device.keys.push_back(in[d][b][0]), on_device.values.push_back(in[d][b][1]);
        DocumentKV q = on_device.to(at::kCUDA, at::kChar);
        for (int64_t b = 0; b < blocks; ++b) {
          INFO(c10::toString(source) << " head_dim " << hd << ", " << lens[d] << " tokens, block " << b << " (tensor ops)");
          CHECK(at::equal(q.keys[b].cpu(), want[d].keys[b]));
          CHECK(at::equal(q.key_scales[b].cpu(), want[d].key_scales[b]));
          CHECK(at::equal(q.values[b].cpu(), want[d].values[b]));
          CHECK(at::equal(q.value_scales[b].cpu(), want[d].value_scales[b]));
        }
        // And the int4 forms: the CPU's packed codes and scales, and linked as the same int8 codes.
        DocumentKV cpu = on_device.to(at::kCPU, at::kFloat);
        for (const c10::ScalarType form : {comb::kCacheInt4, comb::kCacheInt8Int4}) {
          const DocumentKV want4 = cpu.to(at::kCPU, form), got4 = on_device.to(at::kCUDA, form);
          REQUIRE(got4.dtype() == form);
          for (int64_t b = 0; b < blocks; ++b) {
            INFO(c10::toString(source) << " head_dim " << hd << ", " << lens[d] << " tokens, block " << b << ", "
                                       << cache_dtype_name(form));
            CHECK(at::equal(got4.keys[b].cpu(), want4.keys[b]));
            CHECK(at::equal(got4.key_scales[b].cpu(), want4.key_scales[b]));
            CHECK(at::equal(got4.values[b].cpu(), want4.values[b]));
            CHECK(at::equal(got4.value_scales[b].cpu(), want4.value_scales[b]));
            CHECK(at::equal(got4.int8_codes().values[b].cpu(), want4.int8_codes().values[b]));
            // int4 keys rotated back on the device by tensor ops, on the CPU in one pass: the same.
            CHECK(at::equal(got4.int8_codes().keys[b].cpu(), want4.int8_codes().keys[b]));
            CHECK(at::equal(got4.int8_codes().key_scales[b].cpu(), want4.int8_codes().key_scales[b]));
          }
        }
      }
    }
  CHECK(checked == 3 * 2 * 5 * 3);
}

TEST_CASE("split_documents on CUDA copies each document's rows of a block, into one allocation per document",
          "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  const comb::detail::CudaLayerOps& ops = layer_ops();
  REQUIRE(ops.split_documents);
  auto gen = at::detail::createCPUGenerator(29);
  const int64_t batch = 2, n_kv = 3, n = 40, hd = 64, blocks = 3;
  // (batch row, first position, length): a document at a batch row's start, one inside, one of a
  // single token, one the whole row.
  const std::vector<std::array<int64_t, 3>> rows{{0, 0, 5}, {1, 3, 7}, {0, 39, 1}, {1, 0, n}};
  int checked = 0;
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    std::vector<at::Tensor> keys, values;
    for (int64_t b = 0; b < blocks; ++b) {
      // Keys as a projection's view ([batch, n, n_kv, hd] transposed: heads hd apart, rows n_kv * hd
      // apart), values contiguous.
      keys.push_back(at::randn({batch, n, n_kv, hd}, gen).to(at::kCUDA, dtype).transpose(1, 2));
      values.push_back(at::randn({batch, n_kv, n, hd}, gen).to(at::kCUDA, dtype));
    }
    REQUIRE_FALSE(keys[0].is_contiguous());
    // The op a block at a time into the documents' allocations, and Plugin::split_rows through it.
    std::vector<at::Tensor> outs;
    for (const auto& r : rows) outs.push_back(at::full({blocks, 2, n_kv, r[2], hd}, 7.0, keys[0].options()));
    for (int64_t b = 0; b < blocks; ++b) ops.split_documents(keys[b], values[b], rows, outs, b);
    const std::vector<DocumentKV> via_plugin = Plugin::split_rows(keys, values, rows);
    REQUIRE(via_plugin.size() == rows.size());
    for (size_t d = 0; d < rows.size(); ++d) {
      const auto [row, first, len] = rows[d];
      CHECK(via_plugin[d].n_tokens == len);
      for (int64_t b = 0; b < blocks; ++b) {
        INFO(c10::toString(dtype) << ", document " << d << ", block " << b);
        const at::Tensor want_k = keys[b][row].narrow(1, first, len), want_v = values[b][row].narrow(1, first, len);
        CHECK(at::equal(outs[d][b][0], want_k));  // a copy: exactly, every element written
        CHECK(at::equal(outs[d][b][1], want_v));
        CHECK(via_plugin[d].keys[b].is_contiguous());
        CHECK(via_plugin[d].keys[b].sizes() == want_k.sizes());
        CHECK(at::equal(via_plugin[d].keys[b], want_k));
        CHECK(at::equal(via_plugin[d].values[b], want_v));
        // Every block of a document in its one allocation, apart from every other document's.
        CHECK(via_plugin[d].keys[b].storage().data() == via_plugin[d].keys[0].storage().data());
        CHECK(via_plugin[d].values[b].storage().data() == via_plugin[d].keys[0].storage().data());
        if (d > 0) CHECK(via_plugin[d].keys[b].storage().data() != via_plugin[d - 1].keys[0].storage().data());
        ++checked;
      }
      // The entry's bytes are its own tokens' (the store's budget counts them).
      CHECK(via_plugin[d].bytes() == 2 * blocks * n_kv * len * hd * static_cast<int64_t>(keys[0].element_size()));
    }
    // Bad input says what was expected, what was found and where.
    CHECK_THROWS_WITH(ops.split_documents(keys[0], values[0], {{2, 0, 1}}, {outs[0]}, 0),
                      Catch::Contains("document 0: batch row 2, positions [0, 1) of a batch [2, 40]"));
    CHECK_THROWS_WITH(ops.split_documents(keys[0], values[0], {{0, 35, 6}}, {outs[0]}, 0),
                      Catch::Contains("positions [35, 41)"));
    CHECK_THROWS_WITH(ops.split_documents(keys[0], values[0], {rows[0]}, {outs[1]}, 0),
                      Catch::Contains("document 0: output [blocks > 0, 2, 3, 5, 64]"));
    CHECK_THROWS_WITH(ops.split_documents(keys[0], values[0], {rows[0]}, {outs[0]}, blocks),
                      Catch::Contains("output [blocks > 3"));
    const at::Tensor other = values[1].to(dtype == at::kFloat ? at::kBFloat16 : at::kFloat);
    CHECK_THROWS_WITH(ops.split_documents(keys[1], other, rows, outs, 1), Catch::Contains("values as the keys"));
  }
  CHECK(checked == 3 * 4 * 3);
}

TEST_CASE("pack_keys lays packed sequences' keys after the prefix's as the gather over [prefix; rows] does, exactly",
          "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  const comb::detail::CudaLayerOps& ops = layer_ops();
  REQUIRE(ops.pack_keys);
  auto gen = at::detail::createCPUGenerator(41);
  const int64_t n_head = 4, n_kv = 2, hd = 64, heads = n_head + 2 * n_kv, capacity = 9;
  // Sequences of 5, 1 and 12 rows (a one-row one between), packed one after another.
  const std::vector<int64_t> first{0, 5, 6, 18};
  const int64_t rows = first.back();
  int checked = 0;
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    // Keys and values as views of a layer's qkv product [rows, heads, head_dim] (rows heads * hd
    // apart), the prefix as a cache holds it [1, n_head_kv, capacity, head_dim].
    const at::Tensor qkv = at::randn({rows, heads, hd}, gen).to(at::kCUDA, dtype);
    const at::Tensor own_k = qkv.narrow(1, n_head, n_kv), own_v = qkv.narrow(1, n_head + n_kv, n_kv);
    const at::Tensor prefix_k = at::randn({1, n_kv, capacity, hd}, gen).to(at::kCUDA, dtype);
    const at::Tensor prefix_v = at::randn({1, n_kv, capacity, hd}, gen).to(at::kCUDA, dtype);
    for (int64_t pre : {0, 6}) {
      INFO(c10::toString(dtype) << ", " << pre << " prefix positions");
      // Decoder::layer_packed's gather: sequence s's keys the prefix's pre, then its own rows.
      std::vector<int64_t> gather;
      for (size_t s = 0; s + 1 < first.size(); ++s) {
        for (int64_t p = 0; p < pre; ++p) gather.push_back(p);
        for (int64_t r = first[s]; r < first[s + 1]; ++r) gather.push_back(pre + r);
      }
      const at::Tensor index = at::tensor(gather, at::kLong).to(at::kCUDA);
      auto want = [&](const at::Tensor& own, const at::Tensor& prefix) {
        at::Tensor all = own;
        if (pre > 0) all = at::cat({prefix[0].narrow(1, 0, pre).transpose(0, 1), all}, 0);
        return all.index_select(0, index);
      };
      const auto got = ops.pack_keys(own_k, own_v, pre > 0 ? prefix_k : at::Tensor(),
                                     pre > 0 ? prefix_v : at::Tensor(), first, pre);
      for (int part = 0; part < 2; ++part) {
        const at::Tensor w = part == 0 ? want(own_k, prefix_k) : want(own_v, prefix_v);
        REQUIRE(got[part].sizes() == w.sizes());
        CHECK(got[part].sizes() == at::IntArrayRef{3 * pre + rows, n_kv, hd});
        CHECK(got[part].is_contiguous());
        CHECK(at::equal(got[part], w));  // a copy: exactly, every element written
        ++checked;
      }
    }
    // Bad input says what was expected, what was found and where.
    CHECK_THROWS_WITH(ops.pack_keys(own_k, own_v, prefix_k, prefix_v, {0, 5, 17}, 6),
                      Catch::Contains("row offsets from 0 to the 18 rows"));
    CHECK_THROWS_WITH(ops.pack_keys(own_k, own_v, prefix_k, prefix_v, {0, 5, 5, 18}, 6),
                      Catch::Contains("sequence 1 has rows [5, 5)"));
    CHECK_THROWS_WITH(ops.pack_keys(own_k, own_v, prefix_k, prefix_v, first, capacity + 1),
                      Catch::Contains("prefix keys and values [1, 2, >= 10, 64]"));
    CHECK_THROWS_WITH(ops.pack_keys(own_k, own_v, at::Tensor(), at::Tensor(), first, 2),
                      Catch::Contains("found undefined"));
    const at::Tensor other = prefix_v.to(dtype == at::kFloat ? at::kBFloat16 : at::kFloat);
    CHECK_THROWS_WITH(ops.pack_keys(own_k, own_v, prefix_k, other, first, 6), Catch::Contains("prefix keys and values"));
    CHECK_THROWS_WITH(ops.pack_keys(own_k, own_v.to(other.scalar_type()), prefix_k, prefix_v, first, 6),
                      Catch::Contains("values as the keys"));
  }
  CHECK(checked == 3 * 2 * 2);
}

TEST_CASE("sample_rows on CUDA: the rows' highest tokens read back draw what the host draws from whole rows",
          "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  auto gen = at::detail::createCPUGenerator(61);
  // Rows as a model's logits, a small-temperature one, a flat one (its draws fall past the 64
  // tokens read back: the whole row is read), and greedy rows with a tie at the maximum.
  at::Tensor logits = at::randn({6, 49152}, gen) * 3;
  logits[3] = at::randn({49152}, gen) * 0.01;
  logits[5][11] = 40.0f, logits[5][20] = 40.0f;
  const std::vector<SamplingOptions> options{{0.7f, 0, 1.0f, 1}, {1.0f, 0, 0.9f, 2}, {1.0f, 50, 1.0f, 3},
                                             {2.0f, 0, 1.0f, 4}, {0.0f, 0, 1.0f, 5}, {0.0f, 0, 1.0f, 6}};
  std::vector<std::unique_ptr<Sampler>> on_device, on_host;
  std::vector<Sampler*> ptrs;
  for (const auto& o : options) {
    on_device.push_back(std::make_unique<Sampler>(o));
    on_host.push_back(std::make_unique<Sampler>(o));
    ptrs.push_back(on_device.back().get());
  }
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    INFO(c10::toString(dtype));
    const at::Tensor device = logits.to(at::kCUDA, dtype);
    const at::Tensor host = device.to(at::kCPU, at::kFloat);  // the same values, as the host reads them
    int draws = 0, differ = 0;
    for (int step = 0; step < 30; ++step) {
      const std::vector<int32_t> got = Sampler::sample_rows(ptrs, device);
      REQUIRE(got.size() == options.size());
      for (size_t r = 0; r < options.size(); ++r) {
        const int32_t want = on_host[r]->sample(host[static_cast<int64_t>(r)]);
        if (options[r].temperature == 0) {
          CHECK(got[r] == want);  // the argmax: the lowest index among equal maxima on both
        } else {
          differ += got[r] != want;
          ++draws;
        }
      }
    }
    CHECK(on_device[5]->sample(host[5]) == 11);
    // The device's and the host's exponentials and sums round differently (float32 exp, a float64
    // sum of a different order): a draw can differ only where it lands within ~1e-6 of a boundary
    // between two tokens' cumulative masses.
    INFO(differ << " of " << draws << " sampled draws differ");
    CHECK(differ <= 1);
  }
  // A tie that the 64th place cuts (ranks 63 to 65 equal, ids out of order): the host orders it by
  // id; the device's draws that reach it read the whole row, with or without a top_k of 64.
  at::Tensor cut = at::full({1, 8000}, -20.0f);
  for (int64_t j = 0; j < 62; ++j) cut[0][100 + j] = 2.0f - 0.01f * static_cast<float>(j);
  for (int64_t id : {7000, 5, 900}) cut[0][id] = 1.0f;
  for (int64_t top_k : {0, 64}) {
    INFO("top_k " << top_k);
    Sampler a(SamplingOptions{1.0f, top_k, 1.0f, 17}), b(SamplingOptions{1.0f, top_k, 1.0f, 17});
    std::vector<Sampler*> one{&a};
    const at::Tensor device = cut.to(at::kCUDA);
    int in_tie = 0, differ = 0;
    for (int i = 0; i < 400; ++i) {
      const int32_t got = Sampler::sample_rows(one, device)[0], want = b.sample(cut[0]);
      differ += got != want;
      in_tie += want == 5 || want == 900 || want == 7000;
    }
    INFO(in_tie << " draws in the tie, " << differ << " differ");
    CHECK(in_tie > 0);
    CHECK(differ <= 1);
  }
}

TEST_CASE("rope_rows turns each packed row's queries and keys in place, exactly as apply_rope", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  const comb::detail::CudaLayerOps& ops = layer_ops();
  REQUIRE(ops.rope_rows);
  auto gen = at::detail::createCPUGenerator(37);
  const int64_t n = 37, n_head = 4, n_kv = 2, hd = 64, heads = n_head + 2 * n_kv;
  // Each row at its own position (packed documents restart), angles of the rotate-half layout.
  const at::Tensor pos = at::randint(0, 4096, {n, 1}, gen).to(at::kFloat);
  const at::Tensor freq = at::pow(10000.0, -at::arange(0, hd / 2, at::kFloat) * 2 / hd).repeat({2}).unsqueeze(0);
  for (auto dtype : kHalfTypes) {
    INFO(c10::toString(dtype));
    const at::Tensor cos = at::cos(pos * freq).to(at::kCUDA, dtype), sin = at::sin(pos * freq).to(at::kCUDA, dtype);
    const at::Tensor qkv = at::randn({1, n, heads * hd}, gen).to(at::kCUDA, dtype);
    const at::Tensor before = qkv.clone().view({n, heads, hd});
    ops.rope_rows(qkv, cos, sin, n_head, n_kv);
    const at::Tensor after = qkv.view({n, heads, hd});
    // apply_rope over [heads, rows, head_dim] with each row's cos and sin.
    const at::Tensor want = apply_rope(before.narrow(1, 0, n_head + n_kv).transpose(0, 1), cos, sin).transpose(0, 1);
    CHECK(at::equal(after.narrow(1, 0, n_head + n_kv), want));
    CHECK(at::equal(after.narrow(1, n_head + n_kv, n_kv), before.narrow(1, n_head + n_kv, n_kv)));  // values as they were
    CHECK_THROWS_WITH(ops.rope_rows(qkv, cos.narrow(0, 0, n - 1), sin.narrow(0, 0, n - 1), n_head, n_kv),
                      Catch::Contains("qkv of 36 rows of 512 values, found [1, 37, 512]"));
    // Rows of keys alone (n_head_kv 0, a cross block's documents): every head turned.
    const at::Tensor keys = at::randn({n, n_kv * hd}, gen).to(at::kCUDA, dtype);
    const at::Tensor keys_before = keys.clone().view({n, n_kv, hd});
    ops.rope_rows(keys, cos, sin, n_kv, 0);
    CHECK(at::equal(keys.view({n, n_kv, hd}), apply_rope(keys_before.transpose(0, 1), cos, sin).transpose(0, 1)));
  }
}

TEST_CASE("encode_packed on CUDA: one FlashAttention launch over variable lengths gives the padded batch's K/V",
          "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  Model model = cuda_bf16_model();
  const Decoder& dec = model.decoder();
  PluginInitOptions init;
  init.reads = init.joint_attention = true;
  for (int64_t l = 0; l + 1 < dec.config().n_layer; ++l) init.cross_layers.push_back(l);
  init.encoder_prefix = {11, 12, 13, 14, 15};
  const Plugin plugin = Plugin::fresh(dec, init);
  const KVCache states = plugin.encoder_prefix_states(dec);
  std::vector<std::vector<int32_t>> docs;
  for (int64_t len : {5, 40, 17, 64}) {
    docs.emplace_back();
    for (int64_t j = 0; j < len; ++j) docs.back().push_back(static_cast<int32_t>(1000 + 37 * j + len));
  }
  std::vector<const std::vector<int32_t>*> ptrs;
  for (const auto& d : docs) ptrs.push_back(&d);
  const std::vector<DocumentKV> padded = plugin.encode_padded(dec, ptrs, states);
  const std::vector<DocumentKV> varlen = plugin.encode_packed(dec, ptrs, states, /*varlen=*/true);
  const std::vector<DocumentKV> apart = plugin.encode_packed(dec, ptrs, states, /*varlen=*/false);
  {
    // The packed keys laid out by pack_keys' one launch (the default) and by the gather it replaces
    // (the ops table without it): the same keys, so the same K/V, bit for bit.
    const comb::detail::CudaLayerOps* ops = comb::detail::cuda_layer_ops();
    REQUIRE(ops);
    comb::detail::CudaLayerOps without = *ops;
    without.pack_keys = nullptr;
    comb::detail::set_cuda_layer_ops(&without);
    std::vector<DocumentKV> gathered;
    try {
      gathered = plugin.encode_packed(dec, ptrs, states, /*varlen=*/true);
    } catch (...) {
      comb::detail::set_cuda_layer_ops(ops);
      throw;
    }
    comb::detail::set_cuda_layer_ops(ops);
    for (size_t d = 0; d < docs.size(); ++d)
      for (size_t k = 0; k < varlen[d].keys.size(); ++k) {
        INFO("document " << d << ", block " << k << ": pack_keys against the gather");
        CHECK(at::equal(varlen[d].keys[k], gathered[d].keys[k]));
        CHECK(at::equal(varlen[d].values[k], gathered[d].values[k]));
      }
  }
  int checked = 0;
  for (size_t d = 0; d < docs.size(); ++d)
    for (size_t k = 0; k < padded[d].keys.size(); ++k) {
      INFO("document " << d << ", block " << k);
      for (const auto* got : {&varlen, &apart}) {
        REQUIRE((*got)[d].keys[k].sizes() == padded[d].keys[k].sizes());
        CHECK(at::isfinite((*got)[d].keys[k]).all().item<bool>());
        // Cut from the batch in one launch: every block of a document in its one allocation.
        CHECK((*got)[d].keys[k].is_contiguous());
        CHECK((*got)[d].values[k].storage().data() == (*got)[d].keys[0].storage().data());
      }
      if (plugin.config().read_depth(static_cast<int64_t>(k)) > 1) continue;
      // Within one encoder layer of the embeddings: each path rounds to bfloat16 (2^-9 relative)
      // at the layer's norm, its two products, the rotation, the attention's output and the
      // residual sums, a few roundings each of values no larger than the largest: within 2^-5 of
      // it. A wrong mask or position would differ by the values themselves.
      for (const auto* got : {&varlen, &apart}) {
        for (bool keys : {true, false}) {
          const at::Tensor a = (keys ? (*got)[d].keys[k] : (*got)[d].values[k]).to(at::kFloat).cpu();
          const at::Tensor b = (keys ? padded[d].keys[k] : padded[d].values[k]).to(at::kFloat).cpu();
          CHECK((a - b).abs().max().item<double>() <= std::ldexp(b.abs().max().item<double>(), -5));
        }
        ++checked;
      }
    }
  CHECK(checked == 2 * 2 * 4);  // depths 0 and 1, two packed forms, four documents
}

namespace {
int copy_calls = 0;  // aten::copy_ calls seen by count_copies
std::unique_ptr<at::ObserverContext> count_copies(const at::RecordFunction& fn) {
  if (std::string(fn.name()) == "aten::copy_") ++copy_calls;
  return nullptr;
}
}  // namespace

TEST_CASE("the prefix cache fills a CUDA half cache in one launch, exactly", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  Model model = cuda_bf16_model();
  const Decoder& dec = model.decoder();
  std::vector<int32_t> tokens(40);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(100 + 7 * i);
  KVCache cache = dec.make_cache(1, 48);
  dec.forward(token_ids(tokens, 0, 40), cache);
  PrefixCache prefix(16, int64_t(1) << 30);
  copy_calls = 0;
  auto counting = at::addThreadLocalCallback(at::RecordFunctionCallback(count_copies).needsInputs(false));
  prefix.insert(tokens, 40, cache);
  at::removeCallback(counting);
  // Each new block one allocation, every block's rows of a layer in one launch (split_documents),
  // which uploads its table of pieces: a copy a layer, where a copy a block, layer, keys and values
  // would be 2 x n_layer x 2.
  CHECK(copy_calls <= dec.config().n_layer);
  const std::vector<uint64_t> held = prefix.acquire(tokens);
  REQUIRE(held.size() == 2);  // two whole blocks of 16
  KVCache filled = dec.make_cache(1, 48);
  for (int64_t l = 0; l < dec.config().n_layer; ++l) {  // what no block covers stays as it was
    filled.keys(l).fill_(7);
    filled.values(l).fill_(-7);
  }
  copy_calls = 0;
  auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback(count_copies).needsInputs(false));
  prefix.fill(held, filled);
  at::removeCallback(handle);
  // The one launch uploads its table of pieces (one host-to-device copy); a copy a block and layer
  // would be 2 x n_layer x 2.
  CHECK(copy_calls <= 1);
  for (int64_t l = 0; l < dec.config().n_layer; ++l) {
    INFO("layer " << l);
    CHECK(at::equal(filled.keys(l).narrow(2, 0, 32), cache.keys(l).narrow(2, 0, 32)));
    CHECK(at::equal(filled.values(l).narrow(2, 0, 32), cache.values(l).narrow(2, 0, 32)));
    CHECK(filled.keys(l).narrow(2, 32, 16).eq(7).all().item<bool>());
    CHECK(filled.values(l).narrow(2, 32, 16).eq(-7).all().item<bool>());
  }
  prefix.release(held);
}

TEST_CASE("many short documents on CUDA: more (document, block) pieces than one launch takes, every one cut and "
          "quantized", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  Model model = cuda_bf16_model();
  PluginInitOptions init;
  init.reads = init.joint_attention = true;
  for (int64_t l = 0; l + 1 < model.config().n_layer; ++l) init.cross_layers.push_back(l);
  auto plugin = std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init));
  plugin->set_cache_dtype("int8");
  model.set_plugin(plugin);
  const int64_t blocks = plugin->config().n_blocks();
  // Enough two-token documents for 65,535 / blocks + 10 of them: one encoding batch (16,384 padded
  // tokens hold 8,192 of them), quantized in one call of two launches.
  const int64_t n_docs = 65535 / blocks + 10;
  if (2 * n_docs > 16384) {
    WARN("a model of " << blocks << " blocks: more documents than one encoding batch holds; not checked");
    return;
  }
  std::vector<std::vector<int32_t>> docs;
  for (int64_t d = 0; d < n_docs; ++d)
    docs.push_back({static_cast<int32_t>(100 + d % 3000), static_cast<int32_t>(200 + d / 3000)});
  Documents documents(model);
  const auto entries = documents.get(docs, "");
  REQUIRE(static_cast<int64_t>(entries.size()) == n_docs);
  int64_t int8 = 0;
  for (const auto& e : entries) {
    REQUIRE(e);
    REQUIRE(static_cast<int64_t>(e->keys.size()) == blocks);
    if (e->n_tokens == 2 && e->dtype() == at::kChar && e->keys.back().size(1) == 2 && e->keys.back().is_cuda()) ++int8;
  }
  CHECK(int8 == n_docs);
  // The document whose pieces straddle the first launch's end, and the last one: their codes and
  // scales are the int8 of their own dequantized values (each scale's largest code 127), which
  // memory no launch wrote (at::empty's) would not be.
  for (const int64_t d : {65535 / blocks, n_docs - 1}) {
    const auto& e = entries[static_cast<size_t>(d)];
    const DocumentKV again = e->to(at::kCPU, at::kFloat).to(at::kCPU, at::kChar);
    for (int64_t b = 0; b < blocks; ++b) {
      INFO("document " << d << ", block " << b);
      CHECK(at::equal(e->keys[b].cpu(), again.keys[b]));
      CHECK(at::equal(e->values[b].cpu(), again.values[b]));
      CHECK(at::equal(e->key_scales[b].cpu(), again.key_scales[b]));
      CHECK(at::equal(e->value_scales[b].cpu(), again.value_scales[b]));
    }
  }
}

TEST_CASE("split_documents and join_documents over more than 65,535 pieces: every chunk's pieces copied, exactly",
          "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  const comb::detail::CudaLayerOps& ops = layer_ops();
  REQUIRE(ops.split_documents);
  REQUIRE(ops.join_documents);
  auto gen = at::detail::createCPUGenerator(29);
  const int64_t n = 65600;  // one-token pieces: two launches
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  {  // split: row i of a batch's K/V into document i's own output (views of one sentinel tensor)
    const at::Tensor keys = at::randn({1, 1, n, 8}, gen).to(at::kCUDA);
    const at::Tensor values = at::randn({1, 1, n, 8}, gen).to(at::kCUDA);
    const at::Tensor all = at::full({n, 1, 2, 1, 1, 8}, 7.0, cuda);
    std::vector<std::array<int64_t, 3>> rows;
    std::vector<at::Tensor> outs;
    for (int64_t i = 0; i < n; ++i) rows.push_back({0, i, 1}), outs.push_back(all[i]);
    ops.split_documents(keys, values, rows, outs, 0);
    CHECK(at::equal(all.select(2, 0).reshape({n, 8}), keys.reshape({n, 8})));
    CHECK(at::equal(all.select(2, 1).reshape({n, 8}), values.reshape({n, 8})));
  }
  for (auto type : kHalfTypes) {  // join: part i at offset i, turned by angle 0 (cos 1, sin 0): copied
    INFO(c10::toString(type));
    const int64_t hd = 64;
    const at::Tensor src_k = at::randn({n, 1, 1, hd}, gen).to(cuda.dtype(type));
    const at::Tensor src_v = at::randn({n, 1, 1, hd}, gen).to(cuda.dtype(type));
    const at::Tensor cos = at::ones({8, hd}, cuda.dtype(at::kFloat)), sin = at::zeros({8, hd}, cuda.dtype(at::kFloat));
    const at::Tensor out_k = at::full({1, 1, n, hd}, 7.0, cuda.dtype(type));
    const at::Tensor out_v = at::full({1, 1, n, hd}, 7.0, cuda.dtype(type));
    std::vector<comb::detail::JoinPart> parts(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      auto& p = parts[static_cast<size_t>(i)];
      p.block = 0, p.row = 0, p.offset = i, p.angle = 0;
      p.keys = src_k[i], p.values = src_v[i];
    }
    ops.join_documents(parts, {out_k}, {out_v}, cos, sin);
    CHECK(at::equal(out_k.reshape({n, hd}), src_k.reshape({n, hd})));
    CHECK(at::equal(out_v.reshape({n, hd}), src_v.reshape({n, hd})));
  }
}

TEST_CASE("COMB on a CUDA half model: documents kept int8 on the device, joined by one kernel, warm = cold",
          "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  Model model = cuda_bf16_model();
  if (!model.plugin() || !model.plugin()->config().joint_attention) {
    // A model without the shipped plug-in (a random one made on the GPU machine): a fresh one of
    // the shipped layout (speed and placement do not depend on its training).
    PluginInitOptions init;
    init.reads = init.joint_attention = init.consecutive_documents = init.documents_after_prefix = true;
    for (int64_t l = 0; l < model.config().n_layer; ++l) init.cross_layers.push_back(l);
    const auto instruction = qa_prefix(model);  // the encoder reads the whole instruction first, as the shipped one
    init.encoder_prefix.assign(instruction.begin(), instruction.end());
    model.set_plugin(std::make_shared<Plugin>(Plugin::fresh(model.decoder(), init)));
  }
  if (model.plugin()->config().cache_dtype != "int8") {
    auto kept = std::make_shared<Plugin>(*model.plugin());
    kept->set_cache_dtype("int8");
    model.set_plugin(kept);
  }
  PicRequest r = qa_request(model,
                            {{"Alpha", "The alpha station was built in 1931 on the northern ridge."},
                             {"Beta", "Beta is a river town; its bridge opened in 1904."},
                             {"Gamma", "Gamma Lake freezes every winter, and skaters cross it to the island."}},
                            "When did the bridge in Beta open?");
  // Prefix blocks longer than any prompt: the warm request computes the same rows as the cold one
  // (with the default blocks it takes the instruction's whole blocks from the prefix cache and
  // computes fewer rows, and cuBLAS may round a product of another row count differently).
  PicOptions same_rows;
  same_rows.prefix_block = 1 << 20;
  PicEngine engine(model, Method::comb, same_rows);
  PicPrefill cold = engine.prefill(r, 4);
  {
    // The instruction's K/V are the model's encoder-prefix states, placed in one launch: equal.
    const auto& instruction = model.plugin()->config().encoder_prefix;
    const auto pre = static_cast<int64_t>(instruction.size());
    REQUIRE(pre > 0);
    REQUIRE(pre <= static_cast<int64_t>(r.prefix.size()));
    REQUIRE(std::equal(instruction.begin(), instruction.end(), r.prefix.begin()));
    const KVCache* states = model.encoder_prefix_states();
    REQUIRE(states);
    for (int64_t l = 0; l < model.config().n_layer; ++l) {
      CHECK(at::equal(cold.cache.keys(l).narrow(2, 0, pre), states->keys(l)));
      CHECK(at::equal(cold.cache.values(l).narrow(2, 0, pre), states->values(l)));
    }
  }
  const StoreStats s = engine.store().stats();
  CHECK(s.device.entries == 3);  // the engine's store keeps them in device memory
  CHECK(s.host.entries == 0);
  auto entry = engine.documents().get(r.documents[0], "");
  REQUIRE(entry);
  CHECK(entry->keys[0].is_cuda());
  CHECK(entry->keys[0].scalar_type() == at::kChar);  // quantized on the device
  // Read back as float32 and quantized again on the CPU, the entry is unchanged: its codes and
  // scales follow the CPU's rule (each scale's largest code is 127). The kernel's bit-for-bit
  // equality with the CPU is the quantize_int8 case above.
  DocumentKV again = entry->to(at::kCPU, at::kFloat).to(at::kCPU, at::kChar);
  for (size_t b = 0; b < entry->keys.size(); ++b) {
    CHECK(at::equal(entry->keys[b].cpu(), again.keys[b]));
    CHECK(at::equal(entry->key_scales[b].cpu(), again.key_scales[b]));
    CHECK(at::equal(entry->values[b].cpu(), again.values[b]));
    CHECK(at::equal(entry->value_scales[b].cpu(), again.value_scales[b]));
  }
  // The joined blocks a layer reads: the decoder's dtype, biases float32.
  const int64_t anchor = model.plugin()->config().documents_after_prefix ? 9 : 0;
  LinkedDocuments linked = engine.documents().link({entry}, anchor);
  std::vector<JointKV> blocks = model.plugin()->joint_kv(model.plugin()->weights(), linked.keys, linked.values,
                                                         linked.doc_counts, anchor, linked.key_scales,
                                                         linked.value_scales);
  REQUIRE_FALSE(blocks.empty());
  CHECK(blocks[0].keys.scalar_type() == at::kBFloat16);
  CHECK((!blocks[0].bias.defined() || blocks[0].bias.scalar_type() == at::kFloat));
  // A warm request reads exactly what the cold one computed.
  PicPrefill warm = engine.prefill(r, 4);
  CHECK(warm.reused > 0);
  CHECK(at::equal(cold.logits, warm.logits));

  // Naive reuse: every piece of every layer placed by one launch, against Decoder::place piece by
  // piece (fused place_keys, each product rounded to bfloat16 as apply_rope rounds).
  PicEngine naive(model, Method::naive);
  PicPrefill a = naive.prefill(r, 4);
  PicPrefill b = naive.prefill(r, 4);
  CHECK(b.reused > a.reused);
  CHECK(at::equal(a.logits, b.logits));
  // The cold request computed its four pieces (prefix and documents) in one packed forward (the
  // fused norms, rope_rows, one FlashAttention launch a layer); each piece alone runs the fused
  // one-sequence path, another number of GEMM rows. Layer 0's K/V do not depend on
  // the context: K = RoPE(Wk RMSNorm(e)), V = Wv RMSNorm(e), each path rounding the norm, the
  // product (float32 sums) and the rotation's products and sum to bfloat16: at most four roundings
  // of 2^-9 relative to values bounded by the largest, so within 2^-6 of the largest |K| or |V|.
  {
    const std::vector<int32_t>& doc = r.documents[1];
    auto together = naive.documents().decoder_kv(doc, "");
    bool computed = false;
    auto alone = Documents(model).decoder_kv(doc, "", &computed);
    REQUIRE(computed);
    for (const auto& [x, y] : {std::pair{together->keys[0], alone->keys[0]}, std::pair{together->values[0], alone->values[0]}}) {
      at::Tensor got = x.to(at::kFloat).cpu(), want = y.to(at::kFloat).cpu();
      REQUIRE(got.sizes() == want.sizes());
      CHECK((got - want).abs().max().item<double>() <= std::ldexp(want.abs().max().item<double>(), -6));
    }
    // Layer 1's K/V read layer 0's attention over the piece alone (a wrong mask or position in the
    // packed forward would differ by the values themselves): each path rounds to bfloat16 at layer
    // 0's norms, products, rotation, attention output and residual sums, then at layer 1's norm,
    // product and rotation, a few roundings each of values no larger than the largest: within 2^-5
    // of it (the packed encoder's bound after one layer).
    for (const auto& [x, y] : {std::pair{together->keys[1], alone->keys[1]}, std::pair{together->values[1], alone->values[1]}}) {
      at::Tensor got = x.to(at::kFloat).cpu(), want = y.to(at::kFloat).cpu();
      REQUIRE(got.sizes() == want.sizes());
      CHECK((got - want).abs().max().item<double>() <= std::ldexp(want.abs().max().item<double>(), -5));
    }
  }
  const Decoder& dec = model.decoder();
  KVCache manual = dec.make_cache(1, b.cache.capacity());
  int64_t pos = 0;
  std::vector<std::vector<int32_t>> pieces{r.prefix};
  pieces.insert(pieces.end(), r.documents.begin(), r.documents.end());
  for (const auto& tokens : pieces) {
    auto kv = naive.documents().decoder_kv(tokens, "");
    for (int64_t l = 0; l < dec.config().n_layer; ++l)
      dec.place(l, manual, pos, kv->keys[l].unsqueeze(0), kv->values[l].unsqueeze(0));
    pos += static_cast<int64_t>(tokens.size());
  }
  for (int64_t l = 0; l < dec.config().n_layer; ++l) {
    INFO("layer " << l);
    at::Tensor got = b.cache.keys(l).narrow(2, 0, pos).to(at::kFloat).cpu();
    at::Tensor want = manual.keys(l).narrow(2, 0, pos).to(at::kFloat).cpu();
    // place_keys rounds two products and their sum to bfloat16 (2^-9 of each, relative), the launch
    // the float32 sum once: for a pair whose larger input is M, products <= M and sums <= sqrt(2) M,
    // so |got - want| <= 2^-9 (2 + 2 sqrt(2)) M; and M <= sqrt(2) max |placed key| (a rotation keeps
    // the pair's norm): under 3.5 * 2^-8 of the largest placed key.
    CHECK((got - want).abs().max().item<double>() <= 3.5 * std::ldexp(want.abs().max().item<double>(), -8));
    CHECK(at::equal(b.cache.values(l).narrow(2, 0, pos), manual.values(l).narrow(2, 0, pos)));
  }
}

TEST_CASE("a CUDA block pool loads a cache as the CPU's does, whole blocks in one copy a layer", "[ops][cuda]") {
  if (!cuda_available()) {
    WARN("no CUDA device: the CUDA block pool is not checked here");
    return;
  }
  c10::InferenceMode guard;
  const ModelConfig& c = default_model().config();
  auto gen = at::detail::createCPUGenerator(21);
  KVCache cpu(c, 1, 70, at::kFloat, at::kCPU);
  for (int64_t l = 0; l < c.n_layer; ++l)
    cpu.write(l, 0, at::randn({1, c.n_head_kv, 70, c.head_dim}, gen), at::randn({1, c.n_head_kv, 70, c.head_dim}, gen));
  KVCache gpu(c, 1, 70, at::kBFloat16, at::kCUDA);
  for (int64_t l = 0; l < c.n_layer; ++l) gpu.write(l, 0, cpu.keys(l), cpu.values(l));
  const std::vector<int32_t> blocks = {5, 1, 7, 0, 3};  // 4 whole blocks of 16 and 3 positions of a fifth
  for (int64_t n : {int64_t(67), int64_t(64), int64_t(9)}) {
    BlockPool on_cpu(c, 8, 16, at::kBFloat16), on_gpu(c, 8, 16, at::kBFloat16, at::kCUDA);
    KVCache cpu_bf16(c, 1, 70, at::kBFloat16, at::kCPU);
    for (int64_t l = 0; l < c.n_layer; ++l) cpu_bf16.write(l, 0, gpu.keys(l).cpu(), gpu.values(l).cpu());
    on_cpu.load(cpu_bf16, n, blocks);
    on_gpu.load(gpu, n, blocks);
    INFO(n << " positions");
    CHECK(on_gpu.keys(0).is_cuda());
    CHECK(on_gpu.bytes() == on_cpu.bytes());
    for (int64_t l = 0; l < c.n_layer; ++l) {
      CHECK(at::equal(on_gpu.keys(l).cpu(), on_cpu.keys(l)));
      CHECK(at::equal(on_gpu.values(l).cpu(), on_cpu.values(l)));
    }
  }
}

// The server's paged step on a GPU: comb's paged kernels (RoPE into each row's block, attention
// through each row's block table, a row's documents in the same softmax) against the generic ATen
// path in the same dtype, both against float32.
TEST_CASE("the paged step on CUDA: the paged kernels match the generic path, documents included", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  CudaModels models = cuda_models();
  const Model &f32 = models.f32, &bf16 = models.bf16;
  const Decoder& fused = bf16.decoder();
  Decoder generic(fused.config(), fused.weights(), fused.dtype(), fused.device());
  generic.set_cuda_kernels(false);
  const auto& c = fused.config();
  auto gen = at::detail::createCPUGenerator(17);
  // Three sequences of 37, 16 and 70 tokens in blocks of 16 taken out of order; the second reads
  // joined keys (64 of them, a bias per head) as a COMB row does.
  const std::vector<int64_t> lengths = {37, 16, 70};
  at::Tensor joined_k = at::randn({1, c.n_head_kv, 64, c.head_dim}, gen), joined_v = at::randn_like(joined_k);
  at::Tensor bias = at::randn({c.n_head}, gen) * 0.5;
  struct Joined final : LayerReads {
    JointKV kv;
    const JointKV* joint(int64_t) const override { return &kv; }
  };
  auto reads_on = [&](const Decoder& d) {
    auto r = std::make_unique<Joined>();
    r->kv.keys = joined_k.to(d.device(), d.dtype());
    r->kv.values = joined_v.to(d.device(), d.dtype());
    r->kv.bias = bias.to(d.device());
    return r;
  };
  std::vector<at::Tensor> prompts;
  for (int64_t n : lengths) prompts.push_back(at::randint(c.n_vocab, {1, n}, gen));
  at::Tensor fed = at::randint(c.n_vocab, {6, 3}, gen);
  // Teacher-forced: each decoder's pool filled from its own cached forward, then 6 steps.
  auto steps = [&](const Decoder& d) {
    BlockPool pool(c, 16, 16, d.dtype(), d.device());
    std::vector<std::vector<int32_t>> blocks = {{9, 2, 3, 14}, {0, 5}, {1, 12, 7, 4, 6, 11}};
    auto reads = reads_on(d);
    for (size_t r = 0; r < lengths.size(); ++r) {
      KVCache cache = d.make_cache(1, lengths[r]);
      d.forward(prompts[r], cache);
      pool.load(cache, lengths[r], blocks[r]);
    }
    std::vector<at::Tensor> out;
    for (int64_t s = 0; s < fed.size(0); ++s) {
      std::vector<Decoder::PagedRow> rows;
      for (size_t r = 0; r < lengths.size(); ++r)
        rows.push_back({fed[s][r].item<int64_t>(), lengths[r] + s, &blocks[r], r == 1 ? reads.get() : nullptr});
      out.push_back(d.step_paged(pool, rows).cpu());
    }
    return at::cat(out);  // [6 * 3, n_vocab]
  };
  at::Tensor want = steps(f32.decoder()), got = steps(fused), ref = steps(generic);
  const auto [err_fused, rms_fused, err_generic, rms_generic] = spread(got, ref, want);
  INFO("|logit - float32|, max and root mean square: paged kernels " << err_fused << ", " << rms_fused
                                                                      << "; generic bf16 " << err_generic << ", "
                                                                      << rms_generic);
  // Both round at the same steps to bfloat16 and differ in the order of their float32 sums (as the
  // fused layers above); over 18 rows of logits the spread is wider than over 144 (half again, and
  // twice for the single largest difference).
  CHECK(rms_fused <= 1.5 * rms_generic);
  CHECK(err_fused <= 2 * err_generic);
  check_clear_top(got, ref, 2 * (err_fused + err_generic));
}

// The GPU's server: every method's greedy answers in float32 are PicEngine::generate's on the same
// device, alone and batched; in bfloat16 it serves every method through the paged kernels.
TEST_CASE("the serving engine on CUDA answers as PicEngine::generate, alone and batched", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  const std::string path = cuda_model_path();
  for (const char* dtype : {"float32", "bfloat16"}) {
    Model m = Model::load(path, Options{"cuda", dtype});
    if (!m.plugin()) {  // a fresh plug-in of the shipped layout (answers, not accuracy, are compared)
      PluginInitOptions init;
      init.reads = init.joint_attention = init.consecutive_documents = init.documents_after_prefix = true;
      for (int64_t l = 0; l < m.config().n_layer; ++l) init.cross_layers.push_back(l);
      const auto instruction = qa_prefix(m);
      init.encoder_prefix.assign(instruction.begin(), instruction.end());
      m.set_plugin(std::make_shared<Plugin>(Plugin::fresh(m.decoder(), init)));
    }
    ServeOptions o;
    o.kv_bytes = int64_t(256) << 20;
    CHECK(ServeEngine(m, o).options().prefill_chunk == 2048);  // sized at start: a GPU's
    o.prefill_chunk = 32;  // prompts in several pieces (the first 16 tokens), riding decoding steps
    ServeEngine engine(m, o);
    const Method methods[] = {Method::comb, Method::full, Method::prefix, Method::naive, Method::epic,
                              Method::cacheblend};
    std::vector<ServeRequest> requests;
    for (int i = 0; i < 6; ++i) {
      ServeRequest r;
      r.prompt = qa_request(m,
                            {{"Alpha", "The alpha station was built in 1931 on the northern ridge."},
                             {"Beta", "Beta is a river town; its bridge opened in 1904."},
                             {"Gamma", "Gamma Lake freezes every winter, and skaters cross it to the island."}},
                            i % 2 ? "When did the bridge in Beta open?" : "What do skaters cross?");
      r.method = methods[i];
      r.max_tokens = 8;
      requests.push_back(r);
    }
    auto run = [&](bool together) {
      std::vector<std::shared_ptr<std::promise<ServeResult>>> done;
      std::vector<ServeResult> out;
      for (auto r : requests) {
        done.push_back(std::make_shared<std::promise<ServeResult>>());
        auto p = done.back();
        r.on_done = [p](const ServeResult& result) { p->set_value(result); };
        engine.submit(std::move(r));
        if (!together) out.push_back(done.back()->get_future().get());
      }
      if (together)
        for (auto& p : done) out.push_back(p->get_future().get());
      return out;
    };
    const auto alone = run(false), together = run(true);
    for (size_t i = 0; i < requests.size(); ++i) {
      PicEngine pic(m, *requests[i].method, o.pic);
      GenerateOptions g;
      g.max_tokens = 8;
      const GenerationResult direct = pic.generate(requests[i].prompt, g);
      INFO(dtype << " " << method_name(*requests[i].method) << ": served '" << alone[i].text << "', batched '"
                 << together[i].text << "', direct '" << direct.text << "'");
      CHECK(alone[i].finish_reason != "error");
      if (std::string(dtype) == "float32") {  // two float32 paths: the same tokens, or a tie within rounding
        auto logits = [&] {
          return answer_logits(m, *requests[i].method, o.pic, requests[i].prompt, direct.tokens, 8);
        };
        for (const ServeResult* r : {&alone[i], &together[i]}) {
          std::string why;
          const bool same = same_greedy(m, r->prompt_tokens, r->tokens, direct.tokens, logits, why);
          INFO(why);
          CHECK(same);
        }
      } else {  // bfloat16 rounds differently on the paged and the cached path (the case above bounds it)
        CHECK(!alone[i].tokens.empty());
        CHECK(!together[i].tokens.empty());
      }
    }
    const auto stats = engine.stats();
    CHECK(stats.blocks_free == stats.blocks_total);
  }
}

// The paged step replayed as a CUDA graph per bucket of rows against the same kernels launched one
// by one: 3 rows (a bucket of 4, the last row repeated), then 8 (a bucket of 8), step after step;
// both against float32.
TEST_CASE("the paged step's CUDA graphs match its kernels launched one by one", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  CudaModels models = cuda_models();
  const Model &f32 = models.f32, &bf16 = models.bf16;
  const Decoder& base = bf16.decoder();
  Decoder eager(base.config(), base.weights(), base.dtype(), base.device());
  Decoder graphs(base.config(), base.weights(), base.dtype(), base.device());
  eager.set_cuda_paged_graphs(false);
  graphs.set_cuda_paged_graphs(true);
  const auto& c = base.config();
  auto gen = at::detail::createCPUGenerator(29);
  // Rows 1 and 2 read joint blocks as COMB's rows do (joint blocks alone: the graphs take them),
  // each its own joined keys (40 and 9 at two layers, a bias on row 1's), row 2 from position 37 on.
  std::vector<std::vector<JointKV>> joints(2, std::vector<JointKV>(c.n_layer));
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t layer : {int64_t(0), c.n_layer / 2}) {
      const int64_t m = r == 0 ? 40 : 9;
      JointKV& j = joints[r][layer];
      j.keys = at::randn({1, c.n_head_kv, m, c.head_dim}, gen) * 2;
      j.values = at::randn({1, c.n_head_kv, m, c.head_dim}, gen);
      if (r == 0) j.bias = at::randn({c.n_head}, gen) * 0.5;
      j.anchor = r == 0 ? 0 : 37;  // row 2 steps from 35: its first two read none
    }
  auto reads_on = [&](const Decoder& d, int64_t r) {
    std::vector<JointKV> on = joints[r];
    for (JointKV& j : on)
      if (j.keys.defined()) {
        j.keys = j.keys.to(d.device(), d.dtype()), j.values = j.values.to(d.device(), d.dtype());
        if (j.bias.defined()) j.bias = j.bias.to(d.device());
      }
    return std::make_unique<TestJoint>(std::move(on));
  };
  for (int64_t n_rows : {int64_t(3), int64_t(8)}) {
    std::vector<int64_t> lengths;
    std::vector<at::Tensor> prompts;
    for (int64_t r = 0; r < n_rows; ++r) {
      lengths.push_back(9 + 13 * r);
      prompts.push_back(at::randint(c.n_vocab, {1, lengths.back()}, gen));
    }
    at::Tensor fed = at::randint(c.n_vocab, {5, n_rows}, gen);
    auto steps = [&](const Decoder& d) {
      BlockPool pool(c, 64, 16, d.dtype(), d.device());
      std::vector<std::vector<int32_t>> blocks;
      for (int64_t r = 0; r < n_rows; ++r) {
        KVCache cache = d.make_cache(1, lengths[r]);
        d.forward(prompts[r], cache);
        blocks.push_back(pool.allocate(pool.blocks_for(lengths[r] + 8)));
        REQUIRE(!blocks.back().empty());
        pool.load(cache, lengths[r], blocks.back());
      }
      std::vector<at::Tensor> out;
      const auto reads1 = reads_on(d, 0), reads2 = reads_on(d, 1);
      for (int64_t s = 0; s < fed.size(0); ++s) {
        std::vector<Decoder::PagedRow> rows;
        for (int64_t r = 0; r < n_rows; ++r)
          rows.push_back({fed[s][r].item<int64_t>(), lengths[r] + s, &blocks[r],
                          r == 1 ? reads1.get() : r == 2 ? reads2.get() : nullptr});
        at::Tensor logits = d.step_paged(pool, rows);
        REQUIRE(logits.size(0) == n_rows);
        out.push_back(logits.cpu());
      }
      CHECK(static_cast<bool>(pool.step_state()) == (&d == &graphs));  // the graphs ran (only) there
      return at::cat(out);
    };
    at::Tensor want = steps(f32.decoder()), got = steps(graphs), ref = steps(eager);
    const auto [err_graph, rms_graph, err_eager, rms_eager] = spread(got, ref, want);
    INFO(n_rows << " rows; |logit - float32|, max and root mean square: graphs " << err_graph << ", " << rms_graph
                << "; kernels one by one " << err_eager << ", " << rms_eager);
    // The same kernels; the graph's GEMMs take the bucket's rows and its attention the context's
    // split count, so their float32 sums may run in another order: as close to float32 as the
    // launched ones (the spread of two equally rounded walks over 15 to 40 rows of logits).
    CHECK(rms_graph <= 1.5 * rms_eager);
    CHECK(err_graph <= 2 * err_eager);
    CHECK((got - ref).abs().max().item<double>() <= err_eager);  // the two walks correlated
    check_clear_top(got, ref, 2 * (err_graph + err_eager));
  }
}

// The mixed step on a GPU: a prompt's piece (80 tokens: past the rows kernel's 64, so its
// attention is SDPA's over its cache) and a second (20 tokens, the rows kernel) beside three
// decoding rows, in bfloat16 through comb's kernels, against the piece's forward alone and the
// rows' step alone in the same dtype, both against float32.
TEST_CASE("the mixed step on CUDA: a prompt's piece beside the decoding rows as its forward alone", "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  c10::InferenceMode guard;
  CudaModels models = cuda_models();
  const Model &f32 = models.f32, &bf16 = models.bf16;
  const auto& c = bf16.config();
  auto gen = at::detail::createCPUGenerator(31);
  const std::vector<int64_t> lengths = {23, 40, 7};
  std::vector<at::Tensor> prompts;
  for (int64_t n : lengths) prompts.push_back(at::randint(c.n_vocab, {1, n}, gen));
  const at::Tensor fed = at::randint(c.n_vocab, {3}, gen), piece_ids = at::randint(c.n_vocab, {1, 130}, gen);
  // The rows' step apart launched kernel by kernel, as the mixed step's are (not a graph's bucket).
  const Decoder& base = bf16.decoder();
  Decoder eager(base.config(), base.weights(), base.dtype(), base.device());
  eager.set_cuda_paged_graphs(false);
  for (int64_t n_piece : {int64_t(80), int64_t(20)}) {
    // Each decoder's pool and the piece's cache (its first 30 tokens computed before); then one
    // step with the piece beside the rows, or the rows' step and the piece's forward apart.
    auto run = [&](const Decoder& d, bool mixed) {
      BlockPool pool(c, 16, 16, d.dtype(), d.device());
      std::vector<std::vector<int32_t>> blocks = {{3, 1}, {0, 7, 9}, {4}};
      std::vector<Decoder::PagedRow> rows;
      for (size_t r = 0; r < lengths.size(); ++r) {
        KVCache cache = d.make_cache(1, lengths[r]);
        d.forward(prompts[r], cache);
        pool.load(cache, lengths[r], blocks[r]);
        rows.push_back({fed[r].item<int64_t>(), lengths[r], &blocks[r], nullptr});
      }
      KVCache prompt_cache = d.make_cache(1, 130);
      d.forward(piece_ids.narrow(1, 0, 30), prompt_cache);
      const at::Tensor piece_tokens = piece_ids.narrow(1, 30, n_piece);
      at::Tensor rows_logits, piece_logits;
      if (mixed) {
        Decoder::PagedPiece piece{piece_tokens, &prompt_cache, nullptr, {}};
        rows_logits = d.step_paged(pool, rows, nullptr, &piece);
        piece_logits = piece.logits;
      } else {
        rows_logits = d.step_paged(pool, rows);
        piece_logits = d.forward(piece_tokens.to(d.device()), prompt_cache)[0][0];
      }
      CHECK(prompt_cache.length() == 30 + n_piece);
      return at::cat({rows_logits, piece_logits.view({1, -1})}).cpu();  // [4, n_vocab]
    };
    at::Tensor want = run(f32.decoder(), false), got = run(bf16.decoder(), true), ref = run(eager, false);
    const auto [err_mixed, rms_mixed, err_apart, rms_apart] = spread(got, ref, want);
    INFO(n_piece << "-token piece; |logit - float32|, max and root mean square: mixed " << err_mixed << ", "
                 << rms_mixed << "; apart " << err_apart << ", " << rms_apart);
    // The same kernels; the GEMMs take 3 + n rows instead of 3 and n, so their float32 sums may
    // run in another order: as close to float32 as apart (4 rows of logits spread as in the cases
    // above).
    CHECK(rms_mixed <= 1.5 * rms_apart);
    CHECK(err_mixed <= 2 * err_apart);
    check_clear_top(got, ref, 2 * (err_mixed + err_apart));
  }
}

TEST_CASE("pin_host and to_device_async: one page-locked allocation, a copy the current stream waits for",
          "[ops][cuda]") {
  if (!cuda_ops_here()) return;
  const comb::detail::CudaLayerOps* ops = comb::detail::cuda_layer_ops();
  if (ops == nullptr) {
    WARN("COMB_CUDA_KERNELS=0: comb's CUDA ops are off, nothing to check");
    return;
  }
  const c10::Device cuda(c10::kCUDA, 0);
  // Parts of several dtypes and sizes, as a quantized entry has them.
  const std::vector<at::Tensor> parts{at::randn({3, 1000, 64}), at::randint(-127, 128, {3, 1000, 64}).to(at::kChar),
                                      at::randn({3, 1, 64}).to(at::kHalf), at::randn({5})};
  auto check_pinned = [&](const std::vector<at::Tensor>& got) {
    REQUIRE(got.size() == parts.size());
    for (size_t i = 0; i < parts.size(); ++i) {
      CHECK(got[i].device().is_cpu());
      CHECK(got[i].is_pinned());
      CHECK(got[i].is_alias_of(got[0]));  // one allocation
      CHECK(at::equal(got[i], parts[i]));
    }
  };
  const std::vector<at::Tensor> pinned = ops->pin_host(parts);
  check_pinned(pinned);
  CHECK(ops->pin_host(pinned)[1].is_same(pinned[1]));  // page-locked already: themselves
  std::vector<at::Tensor> on_device;
  for (const at::Tensor& p : parts) on_device.push_back(p.to(cuda));
  check_pinned(ops->pin_host(on_device));  // straight from the device
  // Back to the device, page-locked or not, equal.
  for (const auto* from : {&pinned, &parts}) {
    const std::vector<at::Tensor> back = ops->to_device_async(*from, cuda);
    for (size_t i = 0; i < parts.size(); ++i) CHECK(at::equal(back[i].cpu(), parts[i]));
  }
  // 256 MiB: the copy takes milliseconds, and the current stream reads it at once.
  const int64_t n = int64_t(64) << 20;
  const at::Tensor want = at::full({n}, 1.5f, at::TensorOptions().device(cuda));
  at::Tensor big = at::empty({n}, at::TensorOptions().pinned_memory(true)).fill_(1.5f);
  std::vector<at::Tensor> got = ops->to_device_async({big}, cuda);
  CHECK(at::equal(got[0], want));
  // The source dropped while its copy runs: a new page-locked tensor of its size written at once
  // must not land in its memory before the copy has read it.
  got = ops->to_device_async({big}, cuda);
  big.reset();
  const at::Tensor other = at::empty({n}, at::TensorOptions().pinned_memory(true)).fill_(-2.0f);
  CHECK(at::equal(got[0], want));
}
