// Multi-document QA items and the answer check (the prompt: prompt.ipp).
// Compiled into libcomb (src/qa.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <sstream>

#include "comb/detail/json.hpp"
#include "comb/error.hpp"
#include "comb/qa.hpp"

namespace comb {

COMB_INLINE void for_each_text_line(const std::string& path, const std::function<bool(int64_t, const std::string&)>& fn,
                                   const DataLimits& limits) {
  gzFile f = gzopen(path.c_str(), "rb");
  COMB_CHECK(f, "cannot open data file '{}'", path);
  std::string line;
  char buffer[1 << 16];
  int64_t number = 0, total = 0;
  // gzgets stops alike at the end of the file and at a damaged or cut-short gzip stream; only
  // gzerror tells them apart, so every read is checked (a truncated download must not read as a
  // shorter data set).
  auto check_stream = [&] {
    int code = Z_OK;
    const char* message = gzerror(f, &code);
    COMB_CHECK(code == Z_OK || code == Z_STREAM_END, "'{}' is damaged or cut short ({} lines read whole): {}", path, number,
               message ? message : "read error");
  };
  auto check_limits = [&](size_t got) {
    total += static_cast<int64_t>(got);
    COMB_CHECK(static_cast<int64_t>(line.size()) <= limits.max_line_bytes,
               "'{}' line {}: longer than {} bytes (the longest item read; DataLimits::max_line_bytes)", path,
               number + 1, limits.max_line_bytes);
    COMB_CHECK(total <= limits.max_total_bytes, "'{}': more than {} bytes of text at line {} (DataLimits::max_total_bytes)",
               path, limits.max_total_bytes, number + 1);
    if (total > limits.ratio_after_bytes) {
      const int64_t packed = std::max<int64_t>(1, static_cast<int64_t>(gzoffset(f)));
      COMB_CHECK(static_cast<double>(total) <= limits.max_ratio * static_cast<double>(packed),
                 "'{}': {} bytes of text from {} compressed bytes by line {}, more than {}x: refused as a decompression "
                 "bomb (DataLimits::max_ratio)",
                 path, total, packed, number + 1, limits.max_ratio);
    }
  };
  try {
    for (;;) {
      line.clear();
      bool got = false;
      for (z_off_t before = gztell(f); gzgets(f, buffer, sizeof(buffer)); before = gztell(f)) {
        got = true;
        const size_t n = std::strlen(buffer);
        // gzgets stops at a newline or a full buffer, never at a NUL: bytes read past strlen are NULs
        COMB_CHECK(static_cast<z_off_t>(n) == gztell(f) - before, "'{}' line {}: a NUL byte: not text", path, number + 1);
        line.append(buffer, n);
        check_limits(n);
        if (!line.empty() && line.back() == '\n') break;
      }
      check_stream();
      if (!got) break;
      ++number;
      if (!line.empty() && line.back() == '\n') line.pop_back();
      if (!fn(number, line)) break;
    }
  } catch (...) {
    gzclose(f);
    throw;
  }
  gzclose(f);
}

namespace detail::qa {  // this file's own helpers
// Calls fn(line number, object) for each non-blank line of a JSON Lines file (gzip or plain) until
// fn returns false. A line that is not a JSON object, a damaged gzip stream and a JSON type error
// in fn are errors naming the file and line; so is input beyond DataLimits (a line too long, too
// many bytes in all, a decompression bomb), refused while streaming, before it is held.
COMB_INLINE void each_json_line(const std::string& path, const std::function<bool(int64_t, const nlohmann::json&)>& fn,
                                const DataLimits& limits = {}) {
  for_each_text_line(
      path,
      [&](int64_t number, const std::string& line) {
        if (line.find_first_not_of(" \t\r\n") == std::string::npos) return true;
        nlohmann::json j = detail::parse_json(line, fmt::format("'{}' line {}", path, number), /*invalid_ok=*/true);
        COMB_CHECK(!j.is_discarded() && j.is_object(), "'{}' line {}: not valid JSON (expected one object per line)",
                   path, number);
        try {
          return fn(number, j);
        } catch (const nlohmann::json::exception& e) {
          COMB_FAIL("'{}' line {}: {}", path, number, e.what());
        }
      },
      limits);
}

// A field that is not what it must be, said with the file, the line and the field.
[[noreturn]] COMB_INLINE void refuse(const std::string& path, int64_t number, const std::string& field, const std::string& expected,
                         const nlohmann::json& found) {
  COMB_FAIL("'{}' line {}: '{}' must be {}, found {}", path, number, field, expected,
            found.is_null()        ? std::string("null")
            : found.is_structured() ? fmt::format("{} of {} entries", found.type_name(), found.size())
                                    : std::string(found.type_name()) + " " + found.dump().substr(0, 60));
}
}  // namespace detail::qa

COMB_INLINE std::vector<QaItem> read_qa_items(const std::string& path, int64_t limit, const DataLimits& limits) {
  std::vector<QaItem> items;
  static const nlohmann::json missing;  // what an absent document field is reported as
  detail::qa::each_json_line(path, [&](int64_t number, const nlohmann::json& j) {
    // Callers test first, so field names are formatted only for the message.
    auto bad = [&](const std::string& field, const std::string& expected, const nlohmann::json& found) {
      detail::qa::refuse(path, number, field, expected, found);
    };
    for (const char* key : {"id", "question", "answers", "documents"})
      COMB_CHECK(j.contains(key), "'{}' line {}: missing '{}' (expected id, question, answers, documents)", path,
                 number, key);
    QaItem item;
    const auto& id = j["id"];
    if (!id.is_string() && !id.is_number_integer()) bad("id", "a string or a whole number", id);
    item.id = id.is_string() ? id.get<std::string>() : id.dump();
    if (!j["question"].is_string()) bad("question", "a string", j["question"]);
    item.question = j["question"].get<std::string>();
    const auto& answers = j["answers"];
    // An empty list is read (training skips such items); comb eval refuses it.
    if (!answers.is_array()) bad("answers", "a list of strings", answers);
    for (size_t a = 0; a < answers.size(); ++a) {
      if (!answers[a].is_string()) bad(fmt::format("answers[{}]", a), "a string", answers[a]);
      item.answers.push_back(answers[a].get<std::string>());
    }
    const auto& documents = j["documents"];
    if (!documents.is_array()) bad("documents", "a list of {title, text} objects", documents);
    for (size_t d = 0; d < documents.size(); ++d) {
      const auto& doc = documents[d];
      if (!doc.is_object()) bad(fmt::format("documents[{}]", d), "an object {title, text}", doc);
      auto text_of = [&](const char* key) -> const std::string& {
        auto at = doc.find(key);
        const nlohmann::json& value = at == doc.end() ? missing : *at;
        if (!value.is_string()) bad(fmt::format("documents[{}].{}", d, key), "a string", value);
        return value.get_ref<const std::string&>();
      };
      item.documents.push_back({text_of("title"), text_of("text")});  // read in this order
    }
    if (j.contains("gold_index")) {
      const auto& gold = j["gold_index"];
      // Read as unsigned first where it is one: 2^64 - 1 must not wrap to -1.
      bool ok = gold.is_number_integer() &&
                (gold.is_number_unsigned() ? gold.get<uint64_t>() < item.documents.size()
                                           : gold.get<int64_t>() >= -1 &&
                                                 gold.get<int64_t>() < static_cast<int64_t>(item.documents.size()));
      if (!ok) bad("gold_index", fmt::format("-1 or a document's index below {}", item.documents.size()), gold);
      item.gold_index = gold.get<int64_t>();
    } else {
      item.gold_index = -1;
    }
    items.push_back(std::move(item));
    return limit <= 0 || static_cast<int64_t>(items.size()) < limit;
  }, limits);
  COMB_CHECK(!items.empty(), "'{}' holds no items", path);
  return items;
}

// ------------------------------------------------------------------------------------------------
// Data sets made from their public source files
// ------------------------------------------------------------------------------------------------

namespace detail::qa {  // this file's own helpers
// rng() % n: the same draws on every platform (std::uniform_int_distribution is not).
COMB_INLINE size_t draw(std::mt19937_64& rng, size_t n) { return static_cast<size_t>(rng() % n); }
}  // namespace detail::qa

COMB_INLINE std::vector<QaItem> nq_multidoc_items(const std::string& source, const NqMultidocOptions& o) {
  COMB_CHECK(o.documents >= 1, "an nq-multidoc item needs at least one document (the gold one), found {}", o.documents);
  struct Question {
    std::string question;
    std::vector<std::string> answers;
    QaDocument gold;
  };
  std::vector<Question> questions;
  detail::qa::each_json_line(source, [&](int64_t number, const nlohmann::json& j) {
    auto bad = [&](const std::string& field, const std::string& expected, const nlohmann::json& found) {
      detail::qa::refuse(source, number, field, expected, found);
    };
    static const nlohmann::json missing;
    auto field = [&](const nlohmann::json& obj, const std::string& key) -> const nlohmann::json& {
      auto at = obj.find(key);
      return at == obj.end() ? missing : *at;
    };
    Question q;
    const auto& question = field(j, "question");
    if (!question.is_string()) bad("question", "a string", question);
    q.question = question.get<std::string>();
    const auto& answers = field(j, "answers");
    if (!answers.is_array() || answers.empty()) bad("answers", "a non-empty list of strings", answers);
    for (size_t a = 0; a < answers.size(); ++a) {
      if (!answers[a].is_string()) bad(fmt::format("answers[{}]", a), "a string", answers[a]);
      q.answers.push_back(answers[a].get<std::string>());
    }
    // The gold passage: the ctx marked isgold, else the annotated long answer.
    bool found = false;
    const auto& ctxs = field(j, "ctxs");
    if (!ctxs.is_null() && !ctxs.is_array()) bad("ctxs", "a list of {title, text, isgold} objects", ctxs);
    for (size_t c = 0; !found && ctxs.is_array() && c < ctxs.size(); ++c) {
      const auto& ctx = ctxs[c];
      if (!ctx.is_object()) bad(fmt::format("ctxs[{}]", c), "an object {title, text, isgold}", ctx);
      if (field(ctx, "isgold") != true) continue;
      for (const char* key : {"title", "text"})
        if (!field(ctx, key).is_string()) bad(fmt::format("ctxs[{}].{}", c, key), "a string", field(ctx, key));
      q.gold = {ctx["title"].get<std::string>(), ctx["text"].get<std::string>()};
      found = true;
    }
    const auto& annotated = field(j, "nq_annotated_gold");
    if (!found && annotated.is_object()) {
      if (!field(annotated, "title").is_string()) bad("nq_annotated_gold.title", "a string", field(annotated, "title"));
      const auto& text = field(annotated, "chunked_long_answer");
      if (!text.is_string()) bad("nq_annotated_gold.chunked_long_answer", "a string", text);
      q.gold = {annotated["title"].get<std::string>(), text.get<std::string>()};
      found = true;
    }
    COMB_CHECK(found, "'{}' line {}: no gold passage (expected a ctx with \"isgold\": true or nq_annotated_gold)", source,
               number);
    questions.push_back(std::move(q));
    return o.items <= 0 || static_cast<int64_t>(questions.size()) < o.items;
  });
  COMB_CHECK(!questions.empty(), "'{}' holds no questions", source);
  // The distractor pool: every question's gold passage once (title and text).
  std::vector<QaDocument> pool;
  {
    std::set<std::pair<std::string, std::string>> seen;
    for (const auto& q : questions)
      if (seen.insert({q.gold.title, q.gold.text}).second) pool.push_back(q.gold);
  }
  std::vector<std::string> pool_text;  // what the answer check reads: title and text
  for (const auto& d : pool) pool_text.push_back(d.title + "\n" + d.text);
  std::mt19937_64 rng(o.seed);
  std::vector<QaItem> items;
  for (size_t i = 0; i < questions.size(); ++i) {
    const Question& q = questions[i];
    // Candidates in a random order (Fisher-Yates with draw()); the first documents - 1 that are
    // not the gold passage and hold none of the answers are the distractors.
    std::vector<size_t> order(pool.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::vector<QaDocument> distractors;
    for (size_t k = 0; k < order.size() && static_cast<int64_t>(distractors.size()) + 1 < o.documents; ++k) {
      std::swap(order[k], order[k + detail::qa::draw(rng, order.size() - k)]);
      const QaDocument& d = pool[order[k]];
      if ((d.title == q.gold.title && d.text == q.gold.text) || answer_correct(pool_text[order[k]], q.answers)) continue;
      distractors.push_back(d);
    }
    COMB_CHECK(static_cast<int64_t>(distractors.size()) + 1 == o.documents,
               "'{}': question {} ('{}') has {} passages without its answer to draw from; {} documents need {}", source,
               i, q.question.substr(0, 60), distractors.size(), o.documents, o.documents - 1);
    QaItem item;
    item.id = fmt::format("{}-{:04d}", o.id_prefix, i);
    item.question = q.question;
    item.answers = q.answers;
    item.gold_index = static_cast<int64_t>(detail::qa::draw(rng, o.documents));
    item.documents = std::move(distractors);
    item.documents.insert(item.documents.begin() + item.gold_index, q.gold);
    items.push_back(std::move(item));
  }
  return items;
}

COMB_INLINE std::vector<QaItem> kv_retrieval_items(const std::string& source, const KvRetrievalOptions& o) {
  COMB_CHECK(o.pairs_per_document >= 1, "a key-value document holds at least one pair, found {}",
             o.pairs_per_document);
  std::vector<QaItem> items;
  detail::qa::each_json_line(source, [&](int64_t number, const nlohmann::json& j) {
    static const nlohmann::json missing;
    auto field = [&](const std::string& key) -> const nlohmann::json& {
      auto at = j.find(key);
      return at == j.end() ? missing : *at;
    };
    const auto& records = field("ordered_kv_records");
    if (!records.is_array() || records.empty())
      detail::qa::refuse(source, number, "ordered_kv_records", "a non-empty list of [key, value] pairs", records);
    for (const char* k : {"key", "value"})
      if (!field(k).is_string()) detail::qa::refuse(source, number, k, "a string", field(k));
    const std::string key = j["key"].get<std::string>(), value = j["value"].get<std::string>();
    QaItem item;
    item.id = fmt::format("{}-{:04d}", o.id_prefix, items.size());
    item.question = fmt::format("Extract the value corresponding to the key \"{}\" from the JSON objects above.", key);
    item.answers = {value};
    std::string text;
    int64_t in_doc = 0;
    bool holds_key = false;
    auto close = [&] {
      item.documents.push_back({"", text + "}"});
      if (holds_key) item.gold_index = static_cast<int64_t>(item.documents.size()) - 1;
      text.clear();
      in_doc = 0;
      holds_key = false;
    };
    for (size_t r = 0; r < records.size(); ++r) {
      const auto& pair = records[r];
      if (!pair.is_array() || pair.size() != 2 || !pair[0].is_string() || !pair[1].is_string())
        detail::qa::refuse(source, number, fmt::format("ordered_kv_records[{}]", r), "a [key, value] pair of strings",
                           pair);
      // Written as a JSON object: {"key": "value", "key": "value"}.
      text += (in_doc == 0 ? "{" : ", ") + nlohmann::json(pair[0]).dump() + ": " + nlohmann::json(pair[1]).dump();
      if (pair[0] == key) {
        COMB_CHECK(pair[1] == value, "'{}' line {}: the record of key '{}' holds '{}', not the item's value '{}'",
                   source, number, key, pair[1].get<std::string>(), value);
        holds_key = true;
      }
      if (++in_doc == o.pairs_per_document) close();
    }
    if (in_doc > 0) close();
    COMB_CHECK(item.gold_index >= 0, "'{}' line {}: key '{}' is not among its records", source, number, key);
    items.push_back(std::move(item));
    return o.items <= 0 || static_cast<int64_t>(items.size()) < o.items;
  });
  COMB_CHECK(!items.empty(), "'{}' holds no items", source);
  return items;
}

COMB_INLINE std::vector<std::string> essay_paragraphs(const std::string& dir, size_t words, const std::string& split) {
  COMB_CHECK(split == "all" || split == "train" || split == "test",
             "essay split expects all, train or test, found '{}'", split);
  COMB_CHECK(std::filesystem::is_directory(dir), "--essays '{}' is not a directory", dir);
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".txt") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::vector<std::string> out;
  for (size_t f = 0; f < files.size(); ++f) {
    if (split != "all" && (f % 4 == 0) != (split == "test")) continue;
    std::ifstream in(files[f], std::ios::binary);
    COMB_CHECK(in.good(), "cannot read '{}'", files[f].string());
    std::stringstream text;
    text << in.rdbuf();
    // Paragraphs of about `words` words, cut after a word that ends a sentence.
    std::string current, word;
    size_t n = 0;
    auto push_word = [&] {
      if (word.empty()) return;
      current += (current.empty() ? "" : " ") + word;
      ++n;
      const bool sentence_end = word.back() == '.' || word.back() == '?' || word.back() == '!';
      word.clear();
      if (n >= words && sentence_end) {
        out.push_back(std::move(current));
        current.clear();
        n = 0;
      }
    };
    for (char c : text.str()) {
      if (std::isspace(static_cast<unsigned char>(c))) push_word();
      else word += c;
    }
    push_word();  // a last paragraph shorter than `words` is dropped
  }
  COMB_CHECK(!out.empty(), "--essays '{}' holds no *.txt prose for the {} split", dir, split);
  return out;
}

COMB_INLINE QaItem needle_item(const std::vector<std::string>& paragraphs, int64_t n_documents, bool test_keys,
                   std::mt19937_64& rng) {
  COMB_CHECK(!paragraphs.empty(), "needle items need filler paragraphs");
  COMB_CHECK(n_documents >= 1, "a needle item needs at least one document, found {}", n_documents);
  static const char* const words[] = {"amber",  "basil",   "cobalt", "dune",   "ember",   "fjord",  "garnet", "harbor",
                                      "indigo", "juniper", "kelp",   "lagoon", "marble",  "nectar", "onyx",   "pepper",
                                      "quartz", "raven",   "saffron", "tundra", "umber",  "velvet", "willow", "zephyr"};
  constexpr uint64_t n_words = sizeof(words) / sizeof(words[0]);
  auto key_word = [&] {  // test keys: every fourth word; train keys: the others
    uint64_t w = rng() % (test_keys ? n_words / 4 : n_words - n_words / 4);
    return words[test_keys ? 4 * w : w + w / 3 + 1];
  };
  auto draw = [&](uint64_t lo, uint64_t hi) { return lo + rng() % (hi - lo + 1); };
  QaItem item;
  const std::string key = std::string(key_word()) + "-" + key_word();
  const std::string number = std::to_string(draw(1000000, 9999999));
  item.gold_index = static_cast<int64_t>(draw(0, static_cast<uint64_t>(n_documents) - 1));
  for (int64_t d = 0; d < n_documents; ++d) {
    std::string text = paragraphs[rng() % paragraphs.size()];
    if (d == item.gold_index) {  // after a random sentence end, or at the start
      std::vector<size_t> ends = {0};
      for (size_t i = 0; i + 1 < text.size(); ++i)
        if ((text[i] == '.' || text[i] == '?' || text[i] == '!') && text[i + 1] == ' ') ends.push_back(i + 2);
      text.insert(ends[rng() % ends.size()], "The special magic number for " + key + " is " + number + ". ");
    }
    item.documents.push_back({"Essay", std::move(text)});
  }
  item.question = "What is the special magic number for " + key + "?";
  item.answers = {number};
  return item;
}

COMB_INLINE std::vector<QaItem> needle_items(const std::vector<std::string>& paragraphs, const NeedleOptions& o) {
  COMB_CHECK(o.split == "train" || o.split == "test", "--split expects train or test, found '{}'", o.split);
  COMB_CHECK(o.items > 0, "--items must be > 0, found {}", o.items);
  COMB_CHECK(o.min_documents >= 1 && o.max_documents >= o.min_documents,
             "documents per item: need 1 <= min ({}) <= max ({})", o.min_documents, o.max_documents);
  std::mt19937_64 rng(o.seed);
  std::vector<QaItem> items;
  for (int64_t i = 0; i < o.items; ++i) {
    const int64_t n = o.min_documents + static_cast<int64_t>(rng() % static_cast<uint64_t>(o.max_documents - o.min_documents + 1));
    QaItem item = needle_item(paragraphs, n, o.split == "test", rng);
    item.id = fmt::format("{}-{}-{}-{:04d}", o.id_prefix, o.split, o.seed, i);
    items.push_back(std::move(item));
  }
  return items;
}

COMB_INLINE void write_qa_items(const std::string& path, const std::vector<QaItem>& items) {
  const bool gz = path.size() > 3 && path.compare(path.size() - 3, 3, ".gz") == 0;
  const std::string tmp = path + ".part";
  std::string data;
  for (const auto& it : items) {
    // Fields in the order the format lists them (ordered_json keeps insertion order).
    nlohmann::ordered_json docs = nlohmann::ordered_json::array();
    for (const auto& d : it.documents) docs.push_back({{"title", d.title}, {"text", d.text}});
    data += nlohmann::ordered_json{{"id", it.id}, {"question", it.question}, {"answers", it.answers},
                                   {"documents", docs}, {"gold_index", it.gold_index}}
                .dump() +
            "\n";
  }
  if (gz) {
    // mtime 0 in the header (gzopen writes none), so the same items give the same bytes.
    gzFile f = gzopen(tmp.c_str(), "wb9");
    COMB_CHECK(f, "cannot write '{}'", tmp);
    const bool ok = gzwrite(f, data.data(), static_cast<unsigned>(data.size())) == static_cast<int>(data.size());
    COMB_CHECK(gzclose(f) == Z_OK && ok, "writing '{}' failed", tmp);
  } else {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << data;
    out.close();
    COMB_CHECK(out.good(), "writing '{}' failed", tmp);
  }
  std::filesystem::rename(tmp, path);
}

COMB_INLINE std::string normalize_answer(const std::string& s) {
  std::string t;
  // Punctuation is dropped, not turned into a space: "Destiny's Child" -> "destinys child", and
  // "The A-Team" keeps its "ateam" (as the SQuAD-style scorer the data's README follows does).
  for (unsigned char c : s)
    if (!std::ispunct(c)) t += static_cast<char>(std::tolower(c));
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

COMB_INLINE bool answer_correct(const std::string& prediction, const std::vector<std::string>& answers) {
  std::string p = normalize_answer(prediction);
  for (const auto& a : answers) {
    std::string n = normalize_answer(a);
    if (!n.empty() && p.find(n) != std::string::npos) return true;
  }
  return false;
}

}  // namespace comb
