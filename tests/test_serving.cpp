// The serving engine: continuous batching gives each request the tokens it gets alone, blocks go
// back to the pool, overload and cancellation, stop strings.
#include <catch2/catch.hpp>

#include <atomic>
#include <future>

#include "helpers.hpp"

using namespace comb;
using comb::test::logits_bound;
using comb::test::magnitude;
using comb::test::max_diff;
using comb::test::path_bound;
using comb::test::same_greedy;

namespace {

const Model& model_with_plugin() {
  static const Model model = [] {
    Options o;
    o.plugin = test::env_or("COMB_SHIPPED_PLUGIN", "");
    return Model::load(test::model_path(), o);
  }();
  return model;
}

std::vector<QaDocument> documents(int which) {
  std::vector<QaDocument> all = {
      {"Harbor", "The harbor of Velmora was rebuilt in 1874 after a storm destroyed the old pier."},
      {"Orchard", "The orchard grows pears and quinces; its oldest tree was planted by Anna Lind."},
      {"Bridge", "The Caldon bridge has seven arches and was opened to traffic in 1921."},
      {"Library", "The town library keeps a map of the coast drawn by the cartographer Ivo Marek."},
  };
  std::vector<QaDocument> out;
  for (int i = 0; i < 3; ++i) out.push_back(all[(which + i) % all.size()]);
  return out;
}

struct Waiter {
  std::promise<ServeResult> done;
  std::string streamed;
};

ServeRequest make(const Model& m, int i, Method method, int64_t max_tokens) {
  static const char* questions[] = {"When was the harbor rebuilt?", "Who planted the oldest tree?",
                                    "How many arches does the bridge have?", "Who drew the map of the coast?"};
  ServeRequest r;
  if (i % 4 == 3) {  // no documents: a plain chat prompt
    r.prompt.suffix = m.chat_prompt(questions[i % 4]);
  } else {
    r.prompt = qa_request(m, documents(i), questions[i % 4]);
  }
  r.method = method;
  r.max_tokens = max_tokens;
  return r;
}

std::vector<ServeResult> run_all(ServeEngine& engine, std::vector<ServeRequest> requests, bool together,
                                 std::vector<std::string>* streamed = nullptr) {
  std::vector<std::unique_ptr<Waiter>> waiters;
  std::vector<ServeResult> out;
  for (auto& r : requests) {
    waiters.push_back(std::make_unique<Waiter>());
    Waiter* w = waiters.back().get();
    r.on_text = [w](const std::string& piece, const std::vector<comb::TokenLogprob>&) { w->streamed += piece; };
    r.on_done = [w](const ServeResult& result) { w->done.set_value(result); };
    engine.submit(std::move(r));
    if (!together) out.push_back(w->done.get_future().get());
  }
  if (together)
    for (auto& w : waiters) out.push_back(w->done.get_future().get());
  if (streamed)
    for (auto& w : waiters) streamed->push_back(w->streamed);
  return out;
}

}  // namespace

TEST_CASE("serving: greedy tokens are the same alone and in a batch, for every method", "[serving]") {
  const Model& m = model_with_plugin();
  ServeOptions o;
  o.prefill_chunk = 24;  // prompts computed in several chunks between decoding steps
  o.max_running = 16;
  ServeEngine engine(m, o);
  const Method methods[] = {Method::comb, Method::full, Method::prefix, Method::naive, Method::epic, Method::cacheblend};
  std::vector<ServeRequest> requests;
  for (int i = 0; i < 12; ++i) requests.push_back(make(m, i, methods[i % 6], 6 + i % 5));
  std::vector<ServeRequest> again = requests;
  std::vector<std::string> streamed;
  auto alone = run_all(engine, std::move(requests), false);
  const auto before = engine.stats();
  auto together = run_all(engine, std::move(again), true, &streamed);
  const auto after = engine.stats();
  REQUIRE(alone.size() == together.size());
  for (size_t i = 0; i < alone.size(); ++i) {
    INFO("request " << i << " (" << method_name(alone[i].method) << ")");
    CHECK(alone[i].finish_reason != "error");
    CHECK(!alone[i].tokens.empty());
    CHECK(alone[i].tokens == together[i].tokens);
    CHECK(alone[i].text == together[i].text);
    CHECK(streamed[i] == together[i].text);  // the streamed pieces add up to the text
  }
  // The second round ran batched: steps with more than one row happened.
  const uint64_t single_before = before.batch_size.counts[0], single_after = after.batch_size.counts[0];
  CHECK(after.batch_size.count - before.batch_size.count > single_after - single_before);
  CHECK(after.blocks_free == after.blocks_total);
  CHECK(after.tokens_in_flight == 0);
  // Documents were read from the shared store the second time.
  for (size_t i = 0; i < together.size(); ++i)
    if (together[i].method != Method::full && i % 4 != 3) CHECK(together[i].cached_tokens > 0);
}

TEST_CASE("serving: a request's greedy answer is PicEngine::generate's", "[serving]") {
  const Model& m = model_with_plugin();
  ServeEngine engine(m, {});
  for (Method method : {Method::full, Method::comb, Method::naive}) {
    ServeRequest r = make(m, 1, method, 10);
    PicRequest prompt = r.prompt;
    auto served = run_all(engine, {r}, false);
    PicEngine pic(m, method);
    GenerateOptions g;
    g.max_tokens = 10;
    GenerationResult direct = pic.generate(prompt, g);
    INFO(method_name(method) << ": served '" << served[0].text << "', direct '" << direct.text << "'");
    CHECK(served[0].tokens == direct.tokens);
  }
}

TEST_CASE("serving: logprobs are the decoder's log-softmax at each generated token", "[serving]") {
  const Model& m = model_with_plugin();
  ServeEngine engine(m, {});
  ServeRequest r = make(m, 3, Method::full, 6);  // a chat prompt without documents
  r.ignore_eos = true;
  r.logprobs = true;
  r.top_logprobs = 3;
  std::vector<TokenLogprob> streamed;
  std::promise<ServeResult> done;
  const std::vector<int32_t> prompt = r.prompt.suffix;
  r.on_text = [&](const std::string&, const std::vector<TokenLogprob>& lps) {
    streamed.insert(streamed.end(), lps.begin(), lps.end());
  };
  r.on_done = [&](const ServeResult& result) { done.set_value(result); };
  engine.submit(std::move(r));
  const ServeResult got = done.get_future().get();
  REQUIRE(got.tokens.size() == 6);
  REQUIRE(got.logprobs.size() == got.tokens.size());
  REQUIRE(streamed.size() == got.logprobs.size());  // every entry streamed once, in order
  // The same numbers from one forward over the prompt and the generated tokens.
  std::vector<int64_t> ids(prompt.begin(), prompt.end());
  ids.insert(ids.end(), got.tokens.begin(), got.tokens.end() - 1);
  const Decoder& dec = m.decoder();
  KVCache cache = dec.make_cache(1, static_cast<int64_t>(ids.size()));
  at::Tensor all = dec.forward(at::tensor(ids, at::kLong).unsqueeze(0), cache, LogitsMode::all)[0];
  at::Tensor lp = at::log_softmax(all.narrow(0, static_cast<int64_t>(prompt.size()) - 1, 6), -1);
  // The served step (the paged kernels) and one forward are two paths to the logits: each logit
  // within helpers.hpp's logits_bound, which moves a log-softmax by at most twice that.
  const double margin = 2 * logits_bound(m, static_cast<int64_t>(ids.size()), all);
  for (size_t i = 0; i < got.tokens.size(); ++i) {
    INFO("token " << i);
    const TokenLogprob& e = got.logprobs[i];
    CHECK(e.token == got.tokens[i]);
    CHECK(streamed[i].token == e.token);
    CHECK(streamed[i].logprob == e.logprob);
    CHECK(e.logprob == Approx(lp[static_cast<int64_t>(i)][e.token].item<float>()).margin(margin));
    REQUIRE(e.top.size() == 3);
    CHECK(e.top[0].first == e.token);  // greedy: the most likely token
    CHECK(e.top[0].second >= e.top[1].second);
    CHECK(e.top[1].second >= e.top[2].second);
    at::Tensor best = std::get<1>(lp[static_cast<int64_t>(i)].topk(3));
    for (int64_t k = 0; k < 3; ++k) CHECK(e.top[static_cast<size_t>(k)].first == best[k].item<int64_t>());
    CHECK(e.logprob <= 0);
  }
  // Without logprobs asked, none are kept.
  ServeRequest plain = make(m, 3, Method::full, 3);
  CHECK(run_all(engine, {plain}, false)[0].logprobs.empty());
}

TEST_CASE("serving: joint layouts answer as PicEngine::generate, with float32 and int8 document caches",
          "[serving]") {
  // Consecutive documents (before or after the prefix: the decoding step reads the joined keys) and
  // the shared layout (it reads each linked document; int8 ones are dequantized for it).
  for (int layout : {0, 1, 2})
    for (c10::ScalarType dtype : {c10::ScalarType::Undefined, at::kChar}) {
      Model m = Model::load(test::model_path());
      PluginInitOptions init;
      init.reads = init.joint_attention = true;
      init.consecutive_documents = layout < 2;
      init.documents_after_prefix = layout == 1;
      for (int64_t l = 0; l < m.config().n_layer; ++l) init.cross_layers.push_back(l);
      init.probes = qa_probe_prompts(m);
      init.encoder_prefix = {init.probes[0][0]};
      m.set_plugin(std::make_shared<Plugin>(Plugin::fresh(m.decoder(), init)));
      ServeOptions options;
      options.pic.cache_dtype = dtype;
      ServeEngine engine(m, options);
      for (int i : {0, 1}) {
        ServeRequest r = make(m, i, Method::comb, 8);
        PicRequest prompt = r.prompt;
        auto served = run_all(engine, {r}, false);
        PicEngine pic(m, Method::comb, options.pic);
        GenerateOptions g;
        g.max_tokens = 8;
        GenerationResult direct = pic.generate(prompt, g);
        INFO("layout " << layout << ", cache dtype " << c10::toString(dtype) << ", request " << i << ": served '"
                       << served[0].text << "', direct '" << direct.text << "'");
        CHECK(served[0].tokens == direct.tokens);
      }
    }
}

// The comparison the generic path's cases use: a different token passes only as a tie within the
// paths' rounding, at the first step where the answers part.
TEST_CASE("serving: same_greedy takes a tie within rounding, not a clear choice", "[serving]") {
  const Model& m = model_with_plugin();
  const int64_t n_vocab = m.config().n_vocab;
  at::Tensor logits = at::zeros({3, n_vocab});
  logits[0][5] = 10, logits[1][6] = 10, logits[2][7] = 10;
  const double bound = logits_bound(m, 100 + 3, logits[1]);
  logits[1][9] = 10 - bound;  // within 2 * bound of the top: a tie
  logits[1][8] = 10 - 3 * bound;  // past it
  auto given = [&] { return logits; };
  std::string why;
  CHECK(same_greedy(m, 100, {5, 6, 7}, {5, 6, 7}, given, why));
  CHECK(why == "equal");
  CHECK(same_greedy(m, 100, {5, 9, 1}, {5, 6, 7}, given, why));  // parted at a tie; after it nothing compared
  CHECK(!same_greedy(m, 100, {5, 8, 7}, {5, 6, 7}, given, why));
  CHECK(!same_greedy(m, 100, {4, 6, 7}, {5, 6, 7}, given, why));
  CHECK(!same_greedy(m, 100, {5, 6}, {5, 6, 7}, given, why));  // stopped early: its stop token unknown
  CHECK(!same_greedy(m, 100, {5, 6, 7, 7}, {5, 6, 7}, given, why));  // past the rows given
}

// The engine off the fused CPU kernels takes the path a GPU's server takes (Decoder::step_paged's
// generic ATen ops, the documents read as a forward reads them, Model::document_reads): every
// method's greedy answer is PicEngine::generate's on the same path, alone and in a batch.
TEST_CASE("serving on the generic path (a GPU's): greedy answers are PicEngine::generate's, alone and batched",
          "[serving]") {
  Options o;
  o.plugin = test::env_or("COMB_SHIPPED_PLUGIN", "");
  o.cpu_kernels = false;
  const Model m = Model::load(test::model_path(), o);
  REQUIRE(!m.decoder().cpu_kernels());
  ServeOptions options;
  options.prefill_chunk = 24;
  options.block_tokens = 8;  // rows over several blocks, padded to the longest in the batch
  ServeEngine engine(m, options);
  const Method methods[] = {Method::comb, Method::full, Method::prefix, Method::naive, Method::epic, Method::cacheblend};
  std::vector<ServeRequest> requests;
  for (int i = 0; i < 8; ++i) requests.push_back(make(m, i, methods[i % 6], 8));
  // Together first: documents' decoder K/V (naive, EPIC, CacheBlend) and prompts are computed in
  // pieces while other requests decode, riding on their steps. Then alone, and together again with
  // the documents from the store (prompts soon done: several rows decode at once).
  // A long answer decodes while they arrive, so that their first pieces (EPIC's and CacheBlend's
  // documents among them) find a decoding step to ride on.
  ServeRequest longer = make(m, 3, Method::full, 96);
  longer.ignore_eos = true;
  std::promise<void> first_text;
  std::promise<ServeResult> longer_done;
  std::atomic<bool> started{false};
  longer.on_text = [&](const std::string&, const std::vector<comb::TokenLogprob>&) {
    if (!started.exchange(true)) first_text.set_value();
  };
  longer.on_done = [&](const ServeResult& r) {
    if (!started.exchange(true)) first_text.set_value();
    longer_done.set_value(r);
  };
  engine.submit(std::move(longer));
  first_text.get_future().wait();
  auto fresh = run_all(engine, requests, true);
  CHECK(longer_done.get_future().get().tokens.size() == 96);
  CHECK(engine.stats().mixed_document_tokens > 0);
  auto alone = run_all(engine, requests, false);
  auto together = run_all(engine, requests, true);
  for (size_t i = 0; i < requests.size(); ++i) {
    PicEngine pic(m, alone[i].method, options.pic);
    GenerateOptions g;
    g.max_tokens = 8;
    GenerationResult direct = pic.generate(requests[i].prompt, g);
    INFO("request " << i << " (" << method_name(alone[i].method) << "): served '" << alone[i].text << "', batched '"
                    << together[i].text << "', batched with its documents computed '" << fresh[i].text
                    << "', direct '" << direct.text << "'");
    CHECK(alone[i].finish_reason != "error");
    CHECK(!alone[i].tokens.empty());
    // Two float32 paths (the batched paged step, one sequence's forward): the same tokens, or the
    // same up to a tie within their rounding (helpers.hpp's same_greedy).
    auto logits = [&] {
      return test::answer_logits(m, alone[i].method, options.pic, requests[i].prompt, direct.tokens, 8);
    };
    for (const ServeResult* r : {&alone[i], &together[i], &fresh[i]}) {
      std::string why;
      const bool same = same_greedy(m, r->prompt_tokens, r->tokens, direct.tokens, logits, why);
      INFO(why);
      CHECK(same);
    }
  }
  const auto stats = engine.stats();
  CHECK(stats.blocks_free == stats.blocks_total);
  CHECK(stats.batch_size.count > stats.batch_size.counts[0]);  // steps with several rows ran
  // Prompts' pieces went through decoding steps (the mixed step), and their answers are above.
  CHECK(stats.mixed_steps > 0);
  CHECK(stats.mixed_tokens >= stats.mixed_steps);

  // A plug-in of residual cross blocks (read before each layer, row by row) on the same path.
  Model residual = Model::load(test::model_path(), o);
  residual.set_plugin(test::random_plugin(residual.decoder()));
  REQUIRE(!residual.plugin()->config().joint_attention);
  ServeEngine residual_engine(residual, options);
  std::vector<ServeRequest> comb_requests;
  for (int i : {0, 1, 2}) comb_requests.push_back(make(residual, i, Method::comb, 6));
  auto served = run_all(residual_engine, comb_requests, true);
  for (size_t i = 0; i < comb_requests.size(); ++i) {
    PicEngine pic(residual, Method::comb, options.pic);
    GenerateOptions g;
    g.max_tokens = 6;
    GenerationResult direct = pic.generate(comb_requests[i].prompt, g);
    auto logits = [&] {
      return test::answer_logits(residual, Method::comb, options.pic, comb_requests[i].prompt, direct.tokens, 6);
    };
    std::string why;
    const bool same = same_greedy(residual, served[i].prompt_tokens, served[i].tokens, direct.tokens, logits, why);
    INFO("residual plug-in, request " << i << ": served '" << served[i].text << "', direct '" << direct.text << "': "
                                      << why);
    CHECK(same);
  }
}

TEST_CASE("serving: a long document is computed in pieces, and other requests answer meanwhile", "[serving]") {
  const Model& m = model_with_plugin();
  std::string text;
  for (int i = 0; i < 30; ++i) text += fmt::format("Line {}: the tide tables of the northern harbor were revised. ", i);
  const std::vector<int32_t> long_doc = Documents::tokens(m, {"Tides", text});
  REQUIRE(long_doc.size() > 400);
  // In pieces or whole, the same cache (naive: the decoder's K/V; comb: the encoder's, if the
  // shipped plug-in takes a document this long, else a shorter one).
  for (Method method : {Method::naive, Method::comb}) {
    std::vector<int32_t> doc = long_doc;
    const int64_t cap = method == Method::comb ? m.plugin()->config().max_document_tokens : 0;
    if (cap > 0 && static_cast<int64_t>(doc.size()) > cap) doc.resize(static_cast<size_t>(cap));
    PicOptions f32;  // the computation compared as computed (a plug-in's int8 cache would round it)
    f32.cache_dtype = at::kFloat;
    PicEngine whole(m, method, f32), pieces(m, method, f32);
    REQUIRE(whole.warm(doc, ""));
    auto work = pieces.begin_document(doc, "");
    REQUIRE(work);
    int calls = 1;
    while (!pieces.continue_document(*work, 37)) ++calls;
    CHECK(calls == static_cast<int>((doc.size() + 36) / 37));
    CHECK(pieces.begin_document(doc, "") == nullptr);  // stored: nothing left to compute
    auto a = whole.store().get(whole.document_key(doc, "")), b = pieces.store().get(pieces.document_key(doc, ""));
    REQUIRE(a);
    REQUIRE(b);
    REQUIRE(a->keys.size() == b->keys.size());
    for (size_t l = 0; l < a->keys.size(); ++l) {
      INFO(method_name(method) << " layer/block " << l);
      // Whole or in pieces (attention merged by log-sum-exp, other blockings): the layers up to
      // this one's K/V by two paths (helpers.hpp's path_bound): decoder layer l's after l layers,
      // a plug-in block's after the encoder layers it reads.
      const int64_t layers = (method == Method::comb ? m.plugin()->config().read_depth(static_cast<int64_t>(l))
                                                     : static_cast<int64_t>(l)) + 1;
      const int64_t n_keys = static_cast<int64_t>(doc.size() + m.plugin()->config().encoder_prefix.size());
      CHECK(max_diff(a->keys[l], b->keys[l]) <= path_bound(m.config(), layers, n_keys, magnitude(a->keys[l])));
      CHECK(max_diff(a->values[l], b->values[l]) <= path_bound(m.config(), layers, n_keys, magnitude(a->values[l])));
    }
  }
  // A request with the long document, then a short one: the short one is answered before the long
  // one's first token (prompt pieces take turns; before, the oldest prompt went first, whole).
  ServeOptions o;
  o.prefill_chunk = 16;
  ServeEngine engine(m, o);
  ServeRequest slow;
  slow.prompt = qa_request(m, {{"Tides", text}}, "What was revised?");
  slow.method = Method::naive;
  slow.max_tokens = 3;
  ServeRequest quick = make(m, 3, Method::naive, 6);  // no documents
  std::atomic<int> slow_pieces{0};
  std::atomic<bool> quick_done_first{false};
  Waiter a, b;
  slow.on_text = [&](const std::string&, const std::vector<comb::TokenLogprob>&) { ++slow_pieces; };
  slow.on_done = [&](const ServeResult& r) { a.done.set_value(r); };
  quick.on_done = [&](const ServeResult& r) {
    quick_done_first = slow_pieces == 0;
    b.done.set_value(r);
  };
  engine.submit(std::move(slow));
  engine.submit(std::move(quick));
  const ServeResult rb = b.done.get_future().get(), ra = a.done.get_future().get();
  CHECK(ra.finish_reason != "error");
  CHECK(rb.finish_reason != "error");
  CHECK(!rb.tokens.empty());
  CHECK(quick_done_first);
  CHECK(ra.computed_tokens >= static_cast<int64_t>(long_doc.size()));  // its document was computed, in pieces
}

TEST_CASE("serving: cancellation frees blocks, overload is refused, stop strings cut", "[serving]") {
  const Model& m = model_with_plugin();
  ServeOptions o;
  o.max_running = 1;
  o.max_queued = 1;
  ServeEngine engine(m, o);
  const int64_t total = engine.stats().blocks_total;
  CHECK(engine.options().prefill_chunk == 256);  // sized at start: the CPU's
  o.prefill_chunk = -1;
  CHECK_THROWS_WITH(ServeEngine(m, o), Catch::Contains("prefill chunk must be >= 0 tokens"));
  o.prefill_chunk = 0;
  o.pic.comb_recompute_last = 1;
  CHECK_THROWS_WITH(ServeEngine(m, o), Catch::Contains("comb_recompute_last must be 0"));
  o.pic.comb_recompute_last = 0;

  // A long request, cancelled after its first pieces.
  std::promise<ServeResult> long_done;
  std::atomic<int> pieces{0};
  ServeRequest r = make(m, 0, Method::full, 200);
  r.on_text = [&](const std::string&, const std::vector<comb::TokenLogprob>&) { ++pieces; };
  r.on_done = [&](const ServeResult& res) { long_done.set_value(res); };
  auto id = engine.submit(std::move(r));
  while (pieces.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  // It runs; the queue holds one more; a third is refused.
  std::promise<ServeResult> second_done;
  ServeRequest r2 = make(m, 3, Method::full, 4);
  r2.on_done = [&](const ServeResult& res) { second_done.set_value(res); };
  engine.submit(std::move(r2));
  CHECK_THROWS_AS(engine.submit(make(m, 3, Method::full, 4)), Overloaded);
  CHECK(engine.stats().blocks_free < total);
  engine.cancel(id);
  ServeResult cancelled = long_done.get_future().get();
  CHECK(cancelled.finish_reason == "cancelled");
  CHECK(cancelled.tokens.size() < 200);
  CHECK(second_done.get_future().get().finish_reason != "error");
  auto s = engine.stats();
  CHECK(s.blocks_free == total);
  CHECK(s.cancelled == 1);
  CHECK(s.refused == 1);

  // Stop strings: the text ends before the first one, which is not part of it.
  ServeRequest plain = make(m, 3, Method::full, 40);
  auto full_text = run_all(engine, {plain}, false)[0].text;
  REQUIRE(full_text.size() > 6);
  std::string stop = full_text.substr(3, 3);
  plain.stop = {stop};
  std::vector<std::string> streamed;
  auto stopped = run_all(engine, {plain}, false, &streamed)[0];
  CHECK(stopped.finish_reason == "stop");
  CHECK(stopped.text == full_text.substr(0, full_text.find(stop)));
  CHECK(streamed[0] == stopped.text);

  // Requests that can never run are refused at once, with what was wrong.
  ServeRequest huge = make(m, 3, Method::full, m.config().n_ctx);
  CHECK_THROWS_WITH(engine.submit(std::move(huge)), Catch::Contains("context holds"));
  ServeRequest empty;
  CHECK_THROWS_WITH(engine.submit(std::move(empty)), Catch::Contains("prompt is empty"));
}

TEST_CASE("serving: shutdown finishes or cancels what is in flight", "[serving]") {
  const Model& m = model_with_plugin();
  for (bool finish : {true, false}) {
    ServeEngine engine(m, {});
    std::vector<std::promise<ServeResult>> done(3);
    for (int i = 0; i < 3; ++i) {
      ServeRequest r = make(m, i, Method::naive, 8);
      r.on_done = [&done, i](const ServeResult& res) { done[i].set_value(res); };
      engine.submit(std::move(r));
    }
    engine.shutdown(finish);
    for (auto& d : done) {
      auto res = d.get_future().get();
      CHECK(res.finish_reason == (finish ? res.finish_reason : std::string("cancelled")));
      if (finish) CHECK(res.finish_reason != "cancelled");
    }
    CHECK_THROWS_AS(engine.submit(make(m, 0, Method::naive, 4)), Overloaded);
    CHECK(engine.stats().blocks_free == engine.stats().blocks_total);
  }
}
