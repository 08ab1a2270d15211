// comb qa: one question over documents with each caching method: answers, TTFT, tokens computed and reused.
#include "commands.hpp"

namespace comb::cli {

int cmd_qa(Args& args, Model& model) {
  const std::vector<std::string> paths = args.all("document");
  const std::string question = args.str("question");
  COMB_CHECK(!paths.empty(), "qa needs at least one --document FILE");
  COMB_CHECK(!question.empty(), "qa needs --question TEXT");
  std::vector<Method> methods;
  for (const auto& n :
       split_items(args.str("methods", model.plugin() ? "full,naive,epic,cacheblend,comb" : "full,naive,epic,cacheblend"),
                   "methods")) {
    methods.push_back(parse_method(n));
    COMB_CHECK(methods.back() != Method::comb || model.plugin(),
               "--methods names comb, which needs a plug-in (--plugin FILE; the default model has a shipped one)");
  }
  COMB_CHECK(!methods.empty(), "--methods needs at least one method (full, prefix, naive, cacheblend, epic, comb)");
  GenerateOptions gen;
  gen.max_tokens = args.num<int64_t>("max-new-tokens", 48);
  PicOptions options;
  options.cache_url = args.str("cache-url");
  options.cache_dtype = parse_cache_dtype(args.str("cache-dtype", "auto"));
  options.cache_ttl_s = args.num<int64_t>("cache-ttl", 0);
  args.check_all_used();

  std::vector<QaDocument> documents;
  for (const auto& path : paths) documents.push_back(read_document(path));
  const PicRequest request = qa_request(model, documents, question);
  int64_t n_document_tokens = 0;
  for (const auto& d : request.documents) n_document_tokens += static_cast<int64_t>(d.size());
  // What warms the caches: the same documents in reverse order with another question.
  std::vector<QaDocument> reversed(documents.rbegin(), documents.rend());
  const PicRequest other = qa_request(model, reversed, "Which of these documents is the longest?");
  fmt::print("{} documents ({} tokens), {} prompt tokens in all. Question: {}\n\n", documents.size(),
             n_document_tokens, request.tokens().size(), question);
  fmt::print("{:<11} {:>14} {:>14} {:>15} {:>14}  answer\n", "method", "TTFT cold (ms)", "TTFT warm (ms)",
             "computed (warm)", "reused (warm)");
  double full_warm = -1;
  for (Method m : methods) {
    PicEngine engine(model, m, options);
    ColdWarm t = run_cold_warm(engine, request, other, gen, /*prime_all=*/true);
    if (m == Method::full) full_warm = t.warm.ttft_ms;
    std::string answer = t.warm.text;
    std::replace(answer.begin(), answer.end(), '\n', ' ');
    std::string ratio =
        full_warm > 0 && m != Method::full ? fmt::format(" ({:.0f}%)", 100.0 * t.warm.ttft_ms / full_warm) : "";
    fmt::print("{:<11} {:>14.1f} {:>14} {:>15} {:>14}  {}\n", method_name(m), t.cold.ttft_ms,
               fmt::format("{:.1f}{}", t.warm.ttft_ms, ratio), t.warm_counts.computed, t.warm_counts.reused, answer);
    std::fflush(stdout);
  }
  fmt::print("\nTTFT: request start to first token, cache look-ups and document encoding included. Cold: nothing\n"
             "cached. Warm: the documents cached by an earlier request (another order, another question);\n"
             "full caches nothing, so its warm run is a full prefill again. (%): warm TTFT against full's.\n");
  return 0;
}

}  // namespace comb::cli
