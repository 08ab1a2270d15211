// `comb eval`: one method on a multi-document QA file, cold and warm, with accuracy and TTFT.
#include <ATen/ATen.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <cstring>
#include <filesystem>
#include <random>

#include "args.hpp"
#include "comb/comb.hpp"

namespace comb::cli {

namespace {

// One JSON object per line; gzip or plain (zlib reads both).
std::vector<nlohmann::json> read_items(const std::string& path, int64_t limit) {
  gzFile f = gzopen(path.c_str(), "rb");
  COMB_CHECK(f, "cannot open data file '{}'", path);
  std::vector<nlohmann::json> items;
  std::string line;
  char buffer[1 << 16];
  int64_t number = 0;
  while (limit <= 0 || static_cast<int64_t>(items.size()) < limit) {
    line.clear();
    bool got = false;
    while (gzgets(f, buffer, sizeof(buffer))) {
      got = true;
      line += buffer;
      if (!line.empty() && line.back() == '\n') break;
    }
    if (!got) break;
    ++number;
    if (line.find_first_not_of(" \t\r\n") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    COMB_CHECK(!j.is_discarded(), "'{}' line {}: not valid JSON", path, number);
    for (const char* key : {"id", "question", "answers", "documents"})
      COMB_CHECK(j.contains(key), "'{}' line {}: missing '{}' (expected id, question, answers, documents)", path,
                 number, key);
    items.push_back(std::move(j));
  }
  gzclose(f);
  COMB_CHECK(!items.empty(), "'{}' holds no items", path);
  return items;
}

// Lower case, ASCII punctuation and the articles a/an/the removed, white space collapsed.
std::string normalize(const std::string& s) {
  std::string t;
  for (unsigned char c : s) t += std::ispunct(c) ? ' ' : static_cast<char>(std::tolower(c));
  std::string out, word;
  auto flush = [&] {
    if (!word.empty() && word != "a" && word != "an" && word != "the") out += (out.empty() ? "" : " ") + word;
    word.clear();
  };
  for (char c : t) {
    if (std::isspace(static_cast<unsigned char>(c))) flush();
    else word += c;
  }
  flush();
  return out;
}

bool is_correct(const std::string& prediction, const nlohmann::json& answers) {
  std::string p = normalize(prediction);
  for (const auto& a : answers) {
    std::string n = normalize(a.get<std::string>());
    if (!n.empty() && p.find(n) != std::string::npos) return true;
  }
  return false;
}

constexpr const char* kInstruction =
    "Write a high-quality answer for the given question using only the provided documents (some of which might be "
    "irrelevant).";

// The prompt every method reads: chat header + instruction | each document alone | question + footer.
PicRequest make_request(const Model& model, const nlohmann::json& item, const std::vector<size_t>& order,
                        const std::string& question) {
  const std::string marker = "\x01";
  std::string rendered = model.chat_template().apply({{"user", marker}}, true);
  size_t at = rendered.find(marker);
  std::string head = rendered.substr(0, at), tail = rendered.substr(at + marker.size());
  const Tokenizer& tok = model.tokenizer();
  PicRequest r;
  r.prefix = tok.encode(head + kInstruction + "\n\n");
  if (tok.add_bos() && tok.bos_id()) r.prefix.insert(r.prefix.begin(), *tok.bos_id());
  for (size_t i : order) {
    const auto& d = item["documents"][i];
    r.documents.push_back(tok.encode("Title: " + d.value("title", "") + "\n" + d.value("text", "") + "\n\n", false));
  }
  r.suffix = tok.encode("Question: " + question + tail);
  return r;
}


std::string clock_text(double seconds) {
  int64_t s = static_cast<int64_t>(seconds);
  return s >= 3600 ? fmt::format("{}h{:02}m", s / 3600, s / 60 % 60) : fmt::format("{}m{:02}s", s / 60, s % 60);
}

}  // namespace

int cmd_eval(Args& args, Model& model) {
  const std::string data = args.str("data");
  COMB_CHECK(!data.empty(), "eval needs --data FILE (JSON Lines, optionally gzip)");
  Method method = parse_method(args.str("method", "full"));
  PicOptions options;
  options.blend_ratio = args.num<double>("blend-ratio", options.blend_ratio);
  options.check_layer = args.num<int64_t>("check-layer", options.check_layer);
  options.epic_k = args.num<int64_t>("epic-k", options.epic_k);
  options.prefix_block = args.num<int64_t>("prefix-block", options.prefix_block);
  const int64_t limit = args.num<int64_t>("limit", 0);
  const std::string out_path = args.str("out");
  GenerateOptions gen;
  gen.max_tokens = args.num<int64_t>("max-new-tokens", 32);
  args.check_all_used();

  auto items = read_items(data, limit);
  PicEngine engine(model, method, options);
  std::ofstream out;
  if (!out_path.empty()) {
    out.open(out_path);
    COMB_CHECK(out.good(), "cannot write '{}'", out_path);
  }
  const bool tty = ::isatty(fileno(stderr));
  std::mt19937 rng(1234);
  std::vector<double> cold_ms, warm_ms;
  double computed_warm = 0, reused_warm = 0;
  int64_t correct = 0, done = 0;
  auto t_start = std::chrono::steady_clock::now();
  for (size_t k = 0; k < items.size(); ++k) {
    const auto& item = items[k];
    std::vector<size_t> order(item["documents"].size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    PicRequest request = make_request(model, item, order, item["question"].get<std::string>());
    // Cold: nothing of this item cached.
    engine.clear();
    PicCounts cold_stats, warm_stats;
    GenerationResult cold = engine.generate(request, gen, &cold_stats);
    // Warm: every document cached by another request, in another order, with another question.
    engine.clear();
    std::vector<size_t> shuffled = order;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    if (shuffled == order && shuffled.size() > 1) std::reverse(shuffled.begin(), shuffled.end());
    const auto& other = items[(k + 1) % items.size()];
    engine.prefill(make_request(model, item, shuffled, other["question"].get<std::string>()), 1);
    GenerationResult warm = engine.generate(request, gen, &warm_stats);
    bool ok = is_correct(warm.text, item["answers"]);
    correct += ok;
    ++done;
    cold_ms.push_back(cold.ttft_ms);
    warm_ms.push_back(warm.ttft_ms);
    computed_warm += warm_stats.computed;
    reused_warm += warm_stats.reused;
    if (out.is_open())
      out << nlohmann::json{{"id", item["id"]},
                            {"prediction", warm.text},
                            {"prediction_cold", cold.text},
                            {"correct", ok},
                            {"ttft_cold_ms", cold.ttft_ms},
                            {"ttft_warm_ms", warm.ttft_ms},
                            {"computed_tokens_cold", cold_stats.computed},
                            {"reused_tokens_cold", cold_stats.reused},
                            {"computed_tokens_warm", warm_stats.computed},
                            {"reused_tokens_warm", warm_stats.reused}}
                 .dump()
          << "\n";
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    double eta = elapsed / done * (items.size() - done);
    if (tty || done % 10 == 0 || done == static_cast<int64_t>(items.size())) {
      int width = 30, filled = static_cast<int>(width * done / items.size());
      fmt::print(stderr, "{}[eval {}] [{}{}] {}/{} acc {:.1f}% elapsed {} eta {}{}", tty ? "\r" : "",
                 method_name(method), std::string(filled, '#'), std::string(width - filled, '.'), done, items.size(),
                 100.0 * correct / done, clock_text(elapsed), clock_text(eta), tty ? "" : "\n");
    }
  }
  if (tty) fmt::print(stderr, "\n");
  std::string name = std::filesystem::path(data).filename().string();
  for (const char* ext : {".gz", ".jsonl", ".json"})
    if (name.size() > strlen(ext) && name.compare(name.size() - strlen(ext), strlen(ext), ext) == 0)
      name.resize(name.size() - strlen(ext));
  nlohmann::json summary = {{"method", method_name(method)},
                            {"data", name},
                            {"n", done},
                            {"accuracy", double(correct) / done},
                            {"ttft_cold_ms_p50", median(cold_ms)},
                            {"ttft_warm_ms_p50", median(warm_ms)},
                            {"computed_tokens_warm_mean", computed_warm / done},
                            {"reused_tokens_warm_mean", reused_warm / done},
                            {"cache_bytes_per_token", engine.cache_bytes_per_token()}};
  std::cout << summary.dump() << std::endl;
  return 0;
}

}  // namespace comb::cli
