// comb eval: one caching method over a multi-document QA file; accuracy, TTFT cold and warm.
#include "commands.hpp"

namespace comb::cli {

namespace {
// What the store holds for the request's documents, per document token (scales included); 0 for
// the methods that cache no document.
double stored_bytes_per_token(PicEngine& engine, const PicRequest& request) {
  if (engine.method() == Method::full || engine.method() == Method::prefix) return 0;
  int64_t bytes = 0, tokens = 0;
  for (const auto& d : request.documents)
    if (auto kv = engine.store().get(engine.document_key(d, request.tenant))) {
      bytes += kv->bytes();
      tokens += kv->n_tokens;
    }
  return tokens > 0 ? double(bytes) / double(tokens) : engine.cache_bytes_per_token();
}
}  // namespace

int cmd_eval(Args& args, Model& model) {
  const std::string data = args.str("data");
  COMB_CHECK(!data.empty(), "eval needs --data FILE (JSON Lines, optionally gzip)");
  Method method = parse_method(args.str("method", "full"));
  PicOptions options = pic_method_options(args);
  options.cache_url = args.str("cache-url");
  options.cache_dtype = parse_cache_dtype(args.str("cache-dtype", "auto"));
  options.cache_ttl_s = args.num<int64_t>("cache-ttl", 0);
  const int64_t limit = args.num<int64_t>("limit", 0);
  const int64_t offset = args.num<int64_t>("offset", 0);
  COMB_CHECK(limit >= 0 && offset >= 0, "--limit and --offset must be >= 0 (found {} and {})", limit, offset);
  const std::string out_path = args.str("out");
  const std::string priming = args.str("priming", "auto");
  COMB_CHECK(priming == "auto" || priming == "always", "--priming: expected auto or always, found '{}'", priming);
  const std::string label = args.str("label");
  COMB_CHECK(label.size() <= 64 && std::all_of(label.begin(), label.end(), [](char ch) {
               return std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == '.';
             }),
             "--label: up to 64 letters, digits, '-', '_' or '.', found '{}'", label);
  const bool prime_all = priming == "always";
  GenerateOptions gen;
  gen.max_tokens = args.num<int64_t>("max-new-tokens", 32);
  COMB_CHECK(gen.max_tokens >= 1, "--max-new-tokens must be >= 1 (TTFT and the answer need a token), found {}",
             gen.max_tokens);
  args.check_all_used();

  // Items [offset, offset + limit), and the one after them: its question primes the last item's
  // warm run (prefix, or --priming always), so a chunk of a long evaluation runs each item as the
  // whole would.
  auto items = read_qa_items(data, limit > 0 ? offset + limit + 1 : 0);
  COMB_CHECK(offset < static_cast<int64_t>(items.size()), "--offset {} is past the last item of '{}' ({} items)",
             offset, data, items.size());
  const size_t end = limit > 0 ? std::min<size_t>(offset + limit, items.size()) : items.size();
  const size_t n_items = end - offset;
  for (size_t k = offset; k < end; ++k)
    COMB_CHECK(!items[k].answers.empty(), "'{}' item {} (id '{}') has no answers: it could never be scored correct",
               data, k, items[k].id);
  PicEngine engine(model, method, options);
  const std::string name = data_name(data);
  std::ofstream out;
  if (!out_path.empty()) {
    out.open(out_path);
    COMB_CHECK(out.good(), "cannot write '{}'", out_path);
  }
  const bool tty = ::isatty(fileno(stderr));
  std::vector<nlohmann::json> rows;
  int64_t correct = 0;
  auto t_start = std::chrono::steady_clock::now();
  double last_report = 0;
  for (size_t k = offset; k < end; ++k) {
    const auto& item = items[k];
    try {
      // The priming request (used by prefix, or by every method with --priming always): the same
      // documents in another order (seeded by the item's index, so a chunk of a run shuffles as the
      // whole run does), with the next item's question.
      std::mt19937 rng(1234 + k);
      std::vector<QaDocument> shuffled = item.documents;
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      if (shuffled.size() > 1 && std::equal(shuffled.begin(), shuffled.end(), item.documents.begin(),
                                            [](const QaDocument& a, const QaDocument& b) { return a.text == b.text; }))
        std::reverse(shuffled.begin(), shuffled.end());
      // Another question: the next item's, or where that is the same text (a one-item file), this
      // one's with "Once more: " before it.
      std::string other = items[(k + 1) % items.size()].question;
      if (other == item.question) other = "Once more: " + other;
      const PicRequest request = qa_request(model, item.documents, item.question);
      ColdWarm t = run_cold_warm(engine, request, qa_request(model, shuffled, other), gen, prime_all);
      const GenerationResult& warm = t.warm;
      bool ok = answer_correct(warm.text, item.answers);
      correct += ok;
      rows.push_back({{"method", method_name(method)},
                      {"data", name},
                      {"index", k},
                      {"id", item.id},
                      {"prediction", warm.text},
                      {"correct", ok},
                      {"ttft_cold_ms", t.cold.ttft_ms},
                      {"ttft_warm_ms", warm.ttft_ms},
                      {"computed_tokens_cold", t.cold_counts.computed},
                      {"reused_tokens_cold", t.cold_counts.reused},
                      {"computed_tokens_warm", t.warm_counts.computed},
                      {"reused_tokens_warm", t.warm_counts.reused},
                      {"cache_bytes_per_token", stored_bytes_per_token(engine, request)},
                      {"priming", priming}});
      if (!label.empty()) rows.back()["label"] = label;
      if (out.is_open()) {
        out << rows.back().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)  // cut-off UTF-8: U+FFFD
            << std::endl;  // flushed: a stopped run keeps the items it finished
        COMB_CHECK(out.good(), "writing '{}' failed at item {} (is the disk full?)", out_path, k);
      }
    } catch (const std::exception& e) {
      if (tty) fmt::print(stderr, "\n");
      COMB_FAIL("'{}' item {} (id '{}'): {}", data, k, item.id, e.what());
    }
    const size_t done = rows.size();
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    double eta = elapsed / done * (n_items - done);
    // On a terminal the bar is redrawn after every item; in a log, every 10 items and after any
    // item that ends a minute or more after the last line (a kv-75 item can take minutes).
    if (tty || done % 10 == 0 || done == n_items || elapsed - last_report >= 60) {
      last_report = elapsed;
      int width = 30, filled = static_cast<int>(width * done / n_items);
      fmt::print(stderr, "{}[eval {}] [{}{}] {}/{} acc {:.1f}% elapsed {} eta {}{}", tty ? "\r" : "",
                 method_name(method), std::string(filled, '#'), std::string(width - filled, '.'), done, n_items,
                 100.0 * correct / done, clock_text(elapsed), clock_text(eta), tty ? "\x1b[K" : "\n");
    }
  }
  if (tty) fmt::print(stderr, "\n");
  if (out.is_open()) {
    out.close();
    COMB_CHECK(!out.fail(), "writing '{}' failed when closing it (is the disk full?)", out_path);
  }
  std::cout << summarize_eval(rows, "--data " + data).dump() << std::endl;
  return 0;
}

// The title a document file gets: its file name without the extension, dashes and underscores
// as spaces, the first letter upper case ("mount-everest.txt" -> "Mount everest").

}  // namespace comb::cli
