// `comb eval`: one method on a multi-document QA file, cold and warm, with accuracy and TTFT.
// `comb train`: trains a plug-in for the loaded decoder.
#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>

#include "args.hpp"
#include "comb/comb.hpp"
#include "comb/detail/mapped_file.hpp"

namespace comb::cli {

namespace {

std::string clock_text(double seconds) {
  int64_t s = static_cast<int64_t>(seconds);
  return s >= 3600 ? fmt::format("{}h{:02}m", s / 3600, s / 60 % 60) : fmt::format("{}m{:02}s", s / 60, s % 60);
}

// "nq-multidoc-10.dev" for ".../nq-multidoc-10.dev.jsonl.gz".
std::string data_name(const std::string& path) {
  std::string name = std::filesystem::path(path).filename().string();
  for (const char* ext : {".gz", ".jsonl", ".json"})
    if (name.size() > strlen(ext) && name.compare(name.size() - strlen(ext), strlen(ext), ext) == 0)
      name.resize(name.size() - strlen(ext));
  return name;
}

// One request timed cold (nothing cached, to its first token only: decoding on would repeat the
// warm answer) and warm (the documents already cached). Warm follows a priming
// request (the same documents in another order, another question) when `prime_all` is set or
// the method is `prefix`, whose cache depends on order. Without `prime_all`, the per-document
// methods run warm right after cold: each document's cache is computed alone from position 0, so
// what the cold request cached is what any other request would have (tested in test_pic.cpp), and
// `full`, which caches nothing, runs once and reports that request as both.
struct ColdWarm {
  GenerationResult cold, warm;
  PicCounts cold_counts, warm_counts;
};

ColdWarm run_cold_warm(PicEngine& engine, const PicRequest& request, const PicRequest& priming,
                       const GenerateOptions& gen, bool prime_all) {
  ColdWarm r;
  const Method method = engine.method();
  engine.clear();
  if (method == Method::full && !prime_all) {
    r.warm = engine.generate(request, gen, &r.warm_counts);
    r.cold = r.warm;
    r.cold_counts = r.warm_counts;
    return r;
  }
  GenerateOptions first = gen;
  first.max_tokens = 1;
  r.cold = engine.generate(request, first, &r.cold_counts);
  if (method != Method::full && (prime_all || method == Method::prefix)) {
    engine.clear();
    engine.prefill(priming, 1);
  }
  r.warm = engine.generate(request, gen, &r.warm_counts);
  return r;
}

}  // namespace

nlohmann::json summarize_eval(const std::vector<nlohmann::json>& rows, const std::string& where) {
  COMB_CHECK(!rows.empty(), "{}: no evaluated items to summarize", where);
  std::vector<double> cold_ms, warm_ms;
  double computed = 0, reused = 0;
  int64_t correct = 0;
  for (const auto& r : rows) {
    correct += r.at("correct").get<bool>();
    cold_ms.push_back(r.at("ttft_cold_ms").get<double>());
    warm_ms.push_back(r.at("ttft_warm_ms").get<double>());
    computed += r.at("computed_tokens_warm").get<double>();
    reused += r.at("reused_tokens_warm").get<double>();
  }
  const double n = static_cast<double>(rows.size());
  return {{"method", rows[0].at("method")},
          {"data", rows[0].at("data")},
          {"n", rows.size()},
          {"accuracy", correct / n},
          {"ttft_cold_ms_p50", median(cold_ms)},
          {"ttft_warm_ms_p50", median(warm_ms)},
          {"computed_tokens_warm_mean", computed / n},
          {"reused_tokens_warm_mean", reused / n},
          {"cache_bytes_per_token", rows[0].at("cache_bytes_per_token")}};
}

int cmd_report(std::vector<std::string> args) {
  // Options and files read left to right:
  //   --markdown    a table instead of JSON lines
  //   --first N     only items with index < N, so that rows measured on more items compare on the same
  //   --data FILE   once per data set: each item's stored prediction is scored again against that
  //                 file's answers, by this build's rule (otherwise a line keeps the verdict of the
  //                 build that wrote it)
  struct Rescore {
    std::string path;
    std::map<std::string, std::vector<std::string>> answers;  // item id -> answers
    int64_t items = 0, changed = 0;
  };
  std::map<std::string, Rescore> rescore;  // data name -> its file's answers
  bool markdown = false;
  int64_t first_n = -1;
  std::vector<std::string> files;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--markdown") {
      markdown = true;
    } else if (a == "--first" || a == "--data") {
      COMB_CHECK(i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0, "report: {} needs {}", a,
                 a == "--first" ? "a count" : "a data file");
      const std::string value = args[++i];
      if (a == "--first") {
        COMB_CHECK(!value.empty() && value.find_first_not_of("0123456789") == std::string::npos && value.size() < 18 &&
                       std::stoll(value) > 0,
                   "report: --first expects a count > 0, found '{}'", value);
        first_n = std::stoll(value);
      } else {
        Rescore& r = rescore[data_name(value)];
        COMB_CHECK(r.path.empty(), "report: --data {} and {} are the same data set '{}'", r.path, value,
                   data_name(value));
        r.path = value;
        for (auto& item : read_qa_items(value)) r.answers[item.id] = std::move(item.answers);
      }
    } else {
      COMB_CHECK(a.rfind("--", 0) != 0,
                 "report takes eval --out files, --markdown, --first N and --data FILE, found option '{}'", a);
      files.push_back(a);
    }
  }
  COMB_CHECK(!files.empty(),
             "report needs the --out files of comb eval runs (comb report [--markdown] [--first N] [--data FILE] FILE...)");
  // Rows grouped by (data, method), in the order first seen; an item counted once per group.
  std::vector<std::pair<std::string, std::vector<nlohmann::json>>> groups;
  std::map<std::string, std::string> seen;  // group + index -> where it was read
  for (const auto& path : files) {
    std::ifstream in(path);
    COMB_CHECK(in.good(), "cannot read '{}'", path);
    std::string line;
    for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
      if (line.empty()) continue;
      const std::string where = fmt::format("{}:{}", path, line_no);
      nlohmann::json r = nlohmann::json::parse(line, nullptr, false);
      COMB_CHECK(!r.is_discarded() && r.is_object(), "{}: not a JSON object", where);
      for (const char* key : {"method", "data", "index", "correct", "ttft_cold_ms", "ttft_warm_ms",
                              "computed_tokens_warm", "reused_tokens_warm", "cache_bytes_per_token"})
        COMB_CHECK(r.contains(key), "{}: an item line of comb eval --out has '{}'; this one does not", where, key);
      // Each field of the type comb eval writes, checked here where the file and line are known.
      auto expect = [&](const char* key, bool ok, const char* expected) {
        COMB_CHECK(ok, "{}: '{}' must be {}, found {}", where, key, expected, r[key].dump().substr(0, 60));
      };
      for (const char* key : {"method", "data"}) expect(key, r[key].is_string(), "a string");
      expect("index", r["index"].is_number_integer() && r["index"].get<int64_t>() >= 0, "a whole number >= 0");
      expect("correct", r["correct"].is_boolean(), "true or false");
      for (const char* key : {"ttft_cold_ms", "ttft_warm_ms", "computed_tokens_warm", "reused_tokens_warm",
                              "cache_bytes_per_token"})
        expect(key, r[key].is_number(), "a number");
      for (const char* key : {"id", "prediction", "priming"})
        if (r.contains(key)) expect(key, r[key].is_string(), "a string");
      if (first_n > 0 && r["index"].get<int64_t>() >= first_n) continue;
      if (auto d = rescore.find(r["data"].get<std::string>()); d != rescore.end()) {
        COMB_CHECK(r.contains("id") && r.contains("prediction"),
                   "{}: scoring again (--data) needs the item's 'id' and 'prediction'; this line lacks one", where);
        auto a = d->second.answers.find(r["id"].get<std::string>());
        COMB_CHECK(a != d->second.answers.end(), "{}: item '{}' is not in {}", where, r["id"].get<std::string>(),
                   d->second.path);
        const bool ok = answer_correct(r["prediction"].get<std::string>(), a->second);
        d->second.items += 1;
        d->second.changed += ok != r["correct"].get<bool>();
        r["correct"] = ok;
      }
      const std::string group = r["data"].get<std::string>() + " " + r["method"].get<std::string>();
      const std::string key = group + " #" + std::to_string(r["index"].get<int64_t>());
      auto [it, fresh] = seen.emplace(key, where);
      COMB_CHECK(fresh, "{}: item {} of {} / {} was already read at {}", where, r["index"].get<int64_t>(),
                 r["data"].get<std::string>(), r["method"].get<std::string>(), it->second);
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& p) { return p.first == group; });
      if (g == groups.end()) g = groups.insert(groups.end(), {group, {}});
      // One group, one protocol: lines from before --priming existed ran as "always".
      const std::string priming = r.value("priming", "always");
      if (!g->second.empty()) {
        const std::string other = g->second[0].value("priming", "always");
        COMB_CHECK(priming == other, "{}: item {} of {} / {} ran with --priming {}, the items before it with {}",
                   where, r["index"].get<int64_t>(), r["data"].get<std::string>(), r["method"].get<std::string>(),
                   priming, other);
      }
      g->second.push_back(std::move(r));
    }
  }
  COMB_CHECK(!groups.empty(), "report: no items in {} file(s){}", files.size(),
             first_n > 0 ? fmt::format(" with an index below {}", first_n) : "");
  for (const auto& [name, r] : rescore) {
    COMB_CHECK(r.items > 0, "report: --data {} is data set '{}', which no item read belongs to", r.path, name);
    fmt::print(stderr, "report: {} scored again against {}: {} of {} lines change their verdict\n", name, r.path,
               r.changed, r.items);
  }
  // Data in the order first read, methods in the engine's order (full first).
  std::vector<std::string> data_order;
  for (const auto& g : groups)
    if (std::find(data_order.begin(), data_order.end(), g.second[0]["data"]) == data_order.end())
      data_order.push_back(g.second[0]["data"].get<std::string>());
  auto rank = [&](const std::vector<nlohmann::json>& rows) {
    auto d = std::find(data_order.begin(), data_order.end(), rows[0]["data"].get<std::string>()) - data_order.begin();
    return std::make_pair(d, static_cast<int>(parse_method(rows[0]["method"].get<std::string>())));
  };
  std::stable_sort(groups.begin(), groups.end(), [&](const auto& a, const auto& b) { return rank(a.second) < rank(b.second); });
  // Full's warm answers by (data, index): how often a method answers exactly as full does.
  std::map<std::pair<std::string, int64_t>, std::string> full_answers;
  for (const auto& [group, rows] : groups)
    for (const auto& r : rows)
      if (r["method"] == "full" && r.contains("prediction"))
        full_answers[{r["data"].get<std::string>(), r["index"].get<int64_t>()}] = r["prediction"].get<std::string>();
  std::vector<nlohmann::json> summaries;
  for (const auto& [group, rows] : groups) {
    // Items must run from one index on without gaps, so that a table's "first N items" is true.
    std::vector<int64_t> idx;
    for (const auto& r : rows) idx.push_back(r["index"].get<int64_t>());
    std::sort(idx.begin(), idx.end());
    nlohmann::json s = summarize_eval(rows, group);
    s["first_index"] = idx.front();
    s["contiguous"] = idx.back() - idx.front() + 1 == static_cast<int64_t>(idx.size());
    int64_t compared = 0, same = 0;
    if (rows[0]["method"] != "full")  // full against itself says nothing
      for (const auto& r : rows) {
        auto f = full_answers.find({r["data"].get<std::string>(), r["index"].get<int64_t>()});
        if (f == full_answers.end() || !r.contains("prediction")) continue;
        ++compared;
        same += r["prediction"].get<std::string>() == f->second;
      }
    s["compared_with_full"] = compared;
    s["same_answer_as_full"] = compared ? double(same) / compared : 0.0;
    if (!markdown) std::cout << s.dump() << std::endl;
    summaries.push_back(std::move(s));
  }
  if (markdown) {
    // One row per (data, method); warm TTFT also against full's on the same data when present.
    fmt::print("| data | method | items | accuracy | TTFT cold p50 (ms) | TTFT warm p50 (ms) | warm / full warm | "
               "tokens computed (warm, mean) | tokens reused (warm, mean) | cache bytes/token | same answer as full |\n"
               "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const auto& s : summaries) {
      const std::string data = s["data"].get<std::string>();
      std::string ratio = "-";
      for (const auto& f : summaries)
        if (f["data"] == data && f["method"] == "full" && s["method"] != "full")
          ratio = fmt::format("{:.1f}%", 100.0 * s["ttft_warm_ms_p50"].get<double>() / f["ttft_warm_ms_p50"].get<double>());
      const int64_t n = s["n"].get<int64_t>();
      const int64_t first = s["first_index"].get<int64_t>();
      const int64_t compared = s["compared_with_full"].get<int64_t>();
      const std::string same =
          compared == 0 ? "-"
                        : fmt::format("{:.1f}% ({}/{})", 100.0 * s["same_answer_as_full"].get<double>(),
                                      std::lround(s["same_answer_as_full"].get<double>() * compared), compared);
      fmt::print("| {} | {} | {}{} | {:.1f}% ({}/{}) | {:.0f} | {:.0f} | {} | {:.1f} | {:.1f} | {:.0f} | {} |\n", data,
                 s["method"].get<std::string>(),
                 first == 0 ? fmt::format("first {}", n) : fmt::format("{}..{}", first, first + n - 1),
                 s["contiguous"].get<bool>() ? "" : " (with gaps)", 100.0 * s["accuracy"].get<double>(),
                 std::lround(s["accuracy"].get<double>() * n), n, s["ttft_cold_ms_p50"].get<double>(),
                 s["ttft_warm_ms_p50"].get<double>(), ratio, s["computed_tokens_warm_mean"].get<double>(),
                 s["reused_tokens_warm_mean"].get<double>(), s["cache_bytes_per_token"].get<double>(), same);
    }
  }
  return 0;
}

int cmd_eval(Args& args, Model& model) {
  const std::string data = args.str("data");
  COMB_CHECK(!data.empty(), "eval needs --data FILE (JSON Lines, optionally gzip)");
  Method method = parse_method(args.str("method", "full"));
  PicOptions options;
  options.blend_ratio = args.num<double>("blend-ratio", options.blend_ratio);
  options.check_layer = args.num<int64_t>("check-layer", options.check_layer);
  options.epic_k = args.num<int64_t>("epic-k", options.epic_k);
  options.prefix_block = args.num<int64_t>("prefix-block", options.prefix_block);
  options.cache_url = args.str("cache-url");
  options.cache_ttl_s = args.num<int64_t>("cache-ttl", 0);
  const int64_t limit = args.num<int64_t>("limit", 0);
  const int64_t offset = args.num<int64_t>("offset", 0);
  COMB_CHECK(limit >= 0 && offset >= 0, "--limit and --offset must be >= 0 (found {} and {})", limit, offset);
  const std::string out_path = args.str("out");
  const std::string priming = args.str("priming", "auto");
  COMB_CHECK(priming == "auto" || priming == "always", "--priming: expected auto or always, found '{}'", priming);
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
      ColdWarm t = run_cold_warm(engine, qa_request(model, item.documents, item.question),
                                 qa_request(model, shuffled, other), gen, prime_all);
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
                      {"cache_bytes_per_token", engine.cache_bytes_per_token()},
                      {"priming", priming}});
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
std::string document_title(const std::string& path) {
  std::string t = std::filesystem::path(path).stem().string();
  std::replace(t.begin(), t.end(), '-', ' ');
  std::replace(t.begin(), t.end(), '_', ' ');
  if (!t.empty() && t[0] >= 'a' && t[0] <= 'z') t[0] = static_cast<char>(t[0] - 'a' + 'A');
  return t;
}

int cmd_qa(Args& args, Model& model) {
  const std::vector<std::string> paths = args.all("document");
  const std::string question = args.str("question");
  COMB_CHECK(!paths.empty(), "qa needs at least one --document FILE");
  COMB_CHECK(!question.empty(), "qa needs --question TEXT");
  std::vector<Method> methods;
  for (const auto& n :
       split_list(args.str("methods", model.plugin() ? "full,naive,epic,cacheblend,comb" : "full,naive,epic,cacheblend"))) {
    if (n.empty()) continue;
    methods.push_back(parse_method(n));
    COMB_CHECK(methods.back() != Method::comb || model.plugin(),
               "--methods names comb, which needs a plug-in (--plugin FILE; the default model has a shipped one)");
  }
  COMB_CHECK(!methods.empty(), "--methods needs at least one method (full, prefix, naive, cacheblend, epic, comb)");
  GenerateOptions gen;
  gen.max_tokens = args.num<int64_t>("max-new-tokens", 48);
  PicOptions options;
  options.cache_url = args.str("cache-url");
  options.cache_ttl_s = args.num<int64_t>("cache-ttl", 0);
  args.check_all_used();

  std::vector<QaDocument> documents;
  int64_t n_document_tokens = 0;
  for (const auto& path : paths) {
    QaDocument d{document_title(path), detail::read_text_file(path)};
    while (!d.text.empty() && (d.text.back() == '\n' || d.text.back() == ' ')) d.text.pop_back();
    COMB_CHECK(!d.text.empty(), "document '{}' is empty", path);
    n_document_tokens += static_cast<int64_t>(qa_document_tokens(model, d).size());
    documents.push_back(std::move(d));
  }
  const PicRequest request = qa_request(model, documents, question);
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
  o.targets = args.str("targets", o.targets);
  COMB_CHECK(o.targets == "gold" || o.targets == "teacher",
             "--targets expects gold (the items' answers) or teacher (the decoder's own answers with the documents "
             "in context), found '{}'", o.targets);
  o.teacher_file = args.str("teacher");
  o.teacher_tokens = args.num<int64_t>("teacher-tokens", o.teacher_tokens);
  o.teacher_top_k = args.num<int64_t>("teacher-top-k", o.teacher_top_k);
  COMB_CHECK(o.teacher_tokens >= 1 && o.teacher_top_k >= 1,
             "--teacher-tokens and --teacher-top-k must be >= 1, found {} and {}", o.teacher_tokens, o.teacher_top_k);
  o.open_gates = args.num<double>("open-gates", o.open_gates);
  o.seed = args.num<uint64_t>("seed", o.seed);
  o.save_every = args.num<int64_t>("save-every", o.save_every);
  o.log_every = args.num<int64_t>("log-every", o.log_every);
  o.resume = args.num<int>("resume", 1) != 0;
  o.reading_check = args.num<int>("reading-check", 0) != 0;
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
  TrainResult r = train_plugin(model, plugin, examples, o);
  if (tty) fmt::print(stderr, "\n");
  plugin.save(out, out_dtype);
  std::cout << nlohmann::json{{"out", out},      {"dir", o.dir},           {"steps", r.steps},
                              {"resumed_from", r.resumed_from}, {"loss", r.last_loss}, {"seconds", r.seconds},
                              {"teacher_computed", r.teacher_computed}, {"teacher_reused", r.teacher_reused}}
                   .dump()
            << std::endl;
  return 0;
}

}  // namespace comb::cli
