// comb report: the summary of eval --out files, per data file and method.
#include "comb/detail/json.hpp"
#include "commands.hpp"

namespace comb::cli {

namespace {

// Wilson's score interval at 95% for k of n (as fractions).
std::pair<double, double> wilson95(int64_t k, int64_t n) {
  const double z = 1.959963984540054, nn = static_cast<double>(n), p = static_cast<double>(k) / nn;
  const double den = 1 + z * z / nn, centre = (p + z * z / (2 * nn)) / den;
  const double half = z * std::sqrt(p * (1 - p) / nn + z * z / (4 * nn * nn)) / den;
  return {std::max(0.0, centre - half), std::min(1.0, centre + half)};
}

// McNemar's exact test, two-sided: the chance of a split at least as uneven as (a, b) of the a + b
// items the two methods disagree on, were each way equally likely (1 when they never disagree).
double mcnemar_exact(int64_t a, int64_t b) {
  const int64_t n = a + b, k = std::min(a, b);
  if (n == 0) return 1.0;
  double tail = 0;  // P(X <= k), X ~ Binomial(n, 1/2), summed in logs
  for (int64_t i = 0; i <= k; ++i)
    tail += std::exp(std::lgamma(n + 1.0) - std::lgamma(i + 1.0) - std::lgamma(n - i + 1.0) - n * std::log(2.0));
  return std::min(1.0, 2 * tail);
}

// A row's or a summary's method as the table shows it: "comb", or "comb [LABEL]" for a labelled run.
std::string shown_name(const nlohmann::json& r) {
  const std::string method = r["method"].get<std::string>();
  return r.contains("label") && !r["label"].get<std::string>().empty()
             ? fmt::format("{} [{}]", method, r["label"].get<std::string>())
             : method;
}

}  // namespace

int cmd_report(std::vector<std::string> args) {
  // Options and files read left to right:
  //   --markdown    a table instead of JSON lines
  //   --first N     only items with index < N, so that rows measured on more items compare on the same
  //   --data FILE   once per data set: each item's stored prediction is scored again against that
  //                 file's answers, by this build's rule (otherwise a line keeps the verdict of the
  //                 build that wrote it)
  //   --paired      each accuracy with its 95% interval (Wilson's), and every two methods on one
  //                 data set compared item by item: the items each answers and the other does not,
  //                 and McNemar's exact test of that split
  struct Rescore {
    std::string path;
    std::map<std::string, std::vector<std::string>> answers;  // item id -> answers
    int64_t items = 0, changed = 0;
  };
  std::map<std::string, Rescore> rescore;  // data name -> its file's answers
  bool markdown = false, paired = false;
  int64_t first_n = -1;
  std::vector<std::string> files;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--markdown") {
      markdown = true;
    } else if (a == "--paired") {
      paired = true;
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
                 "report takes eval --out files, --markdown, --paired, --first N and --data FILE, found option '{}'", a);
      files.push_back(a);
    }
  }
  COMB_CHECK(!files.empty(),
             "report needs the --out files of comb eval runs (comb report [--markdown] [--paired] [--first N] [--data FILE] "
             "FILE...)");
  // Rows grouped by (data, method, label), in the order first seen; an item counted once per group.
  std::vector<std::pair<std::string, std::vector<nlohmann::json>>> groups;
  std::map<std::string, std::string> seen;  // group + index -> where it was read
  for (const auto& path : files) {
    COMB_CHECK(std::ifstream(path).good(), "cannot read '{}'", path);
    // .jsonl or .jsonl.gz alike (docs/results keeps them compressed).
    for_each_text_line(path, [&](int64_t line_no, const std::string& line) {
      if (line.empty()) return true;
      const std::string where = fmt::format("{}:{}", path, line_no);
      nlohmann::json r = comb::detail::parse_json(line, where, /*invalid_ok=*/true);
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
      for (const char* key : {"id", "prediction", "priming", "label"})
        if (r.contains(key)) expect(key, r[key].is_string(), "a string");
      // A labelled run (eval --label) is a method of its own here: "comb [even]".
      if (r.contains("label") && r["label"].get<std::string>().empty()) r.erase("label");  // as unlabelled
      if (first_n > 0 && r["index"].get<int64_t>() >= first_n) return true;
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
      const std::string shown = shown_name(r);
      const std::string group = r["data"].get<std::string>() + " " + shown;
      const std::string key = group + " #" + std::to_string(r["index"].get<int64_t>());
      auto [it, fresh] = seen.emplace(key, where);
      COMB_CHECK(fresh, "{}: item {} of {} / {} was already read at {}", where, r["index"].get<int64_t>(),
                 r["data"].get<std::string>(), shown, it->second);
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& p) { return p.first == group; });
      if (g == groups.end()) g = groups.insert(groups.end(), {group, {}});
      // One group, one protocol: lines from before --priming existed ran as "always".
      const std::string priming = r.value("priming", "always");
      if (!g->second.empty()) {
        const std::string other = g->second[0].value("priming", "always");
        COMB_CHECK(priming == other, "{}: item {} of {} / {} ran with --priming {}, the items before it with {}",
                   where, r["index"].get<int64_t>(), r["data"].get<std::string>(), shown, priming, other);
      }
      g->second.push_back(std::move(r));
      return true;
    });
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
      if (r["method"] == "full" && !r.contains("label") && r.contains("prediction"))
        full_answers[{r["data"].get<std::string>(), r["index"].get<int64_t>()}] = r["prediction"].get<std::string>();
  std::vector<nlohmann::json> summaries;
  for (const auto& [group, rows] : groups) {
    // Items must run from one index on without gaps, so that a table's "first N items" is true.
    std::vector<int64_t> idx;
    for (const auto& r : rows) idx.push_back(r["index"].get<int64_t>());
    std::sort(idx.begin(), idx.end());
    nlohmann::json s = summarize_eval(rows, group);
    if (rows[0].contains("label")) s["label"] = rows[0]["label"];
    s["first_index"] = idx.front();
    s["contiguous"] = idx.back() - idx.front() + 1 == static_cast<int64_t>(idx.size());
    int64_t compared = 0, same = 0;
    if (rows[0]["method"] != "full" || rows[0].contains("label"))  // (the unlabelled full against itself says nothing)
      for (const auto& r : rows) {
        auto f = full_answers.find({r["data"].get<std::string>(), r["index"].get<int64_t>()});
        if (f == full_answers.end() || !r.contains("prediction")) continue;
        ++compared;
        same += r["prediction"].get<std::string>() == f->second;
      }
    s["compared_with_full"] = compared;
    s["same_answer_as_full"] = compared ? double(same) / compared : 0.0;
    if (paired) {
      const auto n = s["n"].get<int64_t>();
      const auto [low, high] = wilson95(std::llround(s["accuracy"].get<double>() * n), n);
      s["accuracy_wilson95"] = {low, high};
    }
    if (!markdown) std::cout << s.dump() << std::endl;
    summaries.push_back(std::move(s));
  }
  if (markdown) {
    // One row per (data, method, label); warm TTFT also against the unlabelled full's on the same data.
    fmt::print("| data | method | items | accuracy | TTFT cold p50 (ms) | TTFT warm p50 (ms) | warm / full warm | "
               "tokens computed (warm, mean) | tokens reused (warm, mean) | cache bytes/token | same answer as full |\n"
               "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const auto& s : summaries) {
      const std::string data = s["data"].get<std::string>();
      std::string ratio = "-";
      for (const auto& f : summaries)
        if (f["data"] == data && f["method"] == "full" && !f.contains("label") && !(s["method"] == "full" && !s.contains("label")))
          ratio = fmt::format("{:.1f}%", 100.0 * s["ttft_warm_ms_p50"].get<double>() / f["ttft_warm_ms_p50"].get<double>());
      const int64_t n = s["n"].get<int64_t>();
      const int64_t first = s["first_index"].get<int64_t>();
      const int64_t compared = s["compared_with_full"].get<int64_t>();
      const std::string same =
          compared == 0 ? "-"
                        : fmt::format("{:.1f}% ({}/{})", 100.0 * s["same_answer_as_full"].get<double>(),
                                      std::lround(s["same_answer_as_full"].get<double>() * compared), compared);
      const std::string interval =
          paired ? fmt::format("; {:.1f}-{:.1f}", 100.0 * s["accuracy_wilson95"][0].get<double>(),
                               100.0 * s["accuracy_wilson95"][1].get<double>())
                 : "";
      fmt::print("| {} | {} | {}{} | {:.1f}% ({}/{}{}) | {:.0f} | {:.0f} | {} | {:.1f} | {:.1f} | {:.0f} | {} |\n", data,
                 shown_name(s),
                 first == 0 ? fmt::format("first {}", n) : fmt::format("{}..{}", first, first + n - 1),
                 s["contiguous"].get<bool>() ? "" : " (with gaps)", 100.0 * s["accuracy"].get<double>(),
                 std::lround(s["accuracy"].get<double>() * n), n, interval, s["ttft_cold_ms_p50"].get<double>(),
                 s["ttft_warm_ms_p50"].get<double>(), ratio, s["computed_tokens_warm_mean"].get<double>(),
                 s["reused_tokens_warm_mean"].get<double>(), s["cache_bytes_per_token"].get<double>(), same);
    }
  }
  if (paired) {
    // Which verdicts a pair counts: the files' own, or those of scoring again against --data.
    auto verdicts_of = [&](const std::string& data) {
      auto d = rescore.find(data);
      return d == rescore.end() ? std::string("as stored in the files") : "scored again against " + d->second.path;
    };
    // Every two methods on one data set, over the items both answered, in the table's order.
    if (markdown)
      fmt::print("\n| data | method A | method B | items | A right, B wrong | B right, A wrong | McNemar exact p |\n"
                 "|---|---|---|---:|---:|---:|---:|\n");
    for (size_t i = 0; i < groups.size(); ++i)
      for (size_t j = i + 1; j < groups.size(); ++j) {
        const auto& a = groups[i].second;
        const auto& b = groups[j].second;
        if (a[0]["data"] != b[0]["data"]) continue;
        std::map<int64_t, bool> b_correct;
        for (const auto& r : b) b_correct[r["index"].get<int64_t>()] = r["correct"].get<bool>();
        int64_t items = 0, a_only = 0, b_only = 0;
        for (const auto& r : a) {
          auto it = b_correct.find(r["index"].get<int64_t>());
          if (it == b_correct.end()) continue;
          ++items;
          const bool ra = r["correct"].get<bool>();
          a_only += ra && !it->second;
          b_only += !ra && it->second;
        }
        if (items == 0) continue;
        const double p = mcnemar_exact(a_only, b_only);
        if (markdown)
          fmt::print("| {} | {} | {} | {} | {} | {} | {:.3g} |\n", a[0]["data"].get<std::string>(),
                     shown_name(a[0]), shown_name(b[0]), items, a_only, b_only, p);
        else
          std::cout << nlohmann::json{{"paired", true},          {"data", a[0]["data"]}, {"a", shown_name(a[0])},
                                      {"b", shown_name(b[0])},   {"items", items},       {"a_only", a_only},
                                      {"b_only", b_only},        {"mcnemar_exact_p", p},
                                      {"verdicts", verdicts_of(a[0]["data"].get<std::string>())}}
                           .dump()
                    << std::endl;
      }
    if (markdown) {
      fmt::print("\n");
      for (const auto& data : data_order) fmt::print("Verdicts of {}: {}.\n", data, verdicts_of(data));
    }
  }
  return 0;
}

}  // namespace comb::cli
