// Multi-document QA items, the shared prompt and the answer check.
#include <zlib.h>

#include <cctype>

#include "comb/error.hpp"
#include "comb/qa.hpp"

namespace comb {

const char* const kQaInstruction =
    "Write a high-quality answer for the given question using only the provided documents (some of which might be "
    "irrelevant).";

std::vector<QaItem> read_qa_items(const std::string& path, int64_t limit) {
  gzFile f = gzopen(path.c_str(), "rb");
  COMB_CHECK(f, "cannot open data file '{}'", path);
  std::vector<QaItem> items;
  std::string line;
  char buffer[1 << 16];
  int64_t number = 0;
  // gzgets stops alike at the end of the file and at a damaged or cut-short gzip stream; only
  // gzerror tells them apart, so every read is checked (a truncated download must not read as a
  // shorter data set).
  auto check_stream = [&] {
    int code = Z_OK;
    const char* message = gzerror(f, &code);
    COMB_CHECK(code == Z_OK || code == Z_STREAM_END, "'{}' is damaged or cut short ({} lines read whole): {}", path, number,
               message ? message : "read error");
  };
  // A field that is not what it must be, said with the file, the line and the field. Callers
  // test first, so field names are formatted only for the message.
  auto refuse = [&](const std::string& field, const std::string& expected, const nlohmann::json& found) {
    COMB_FAIL("'{}' line {}: '{}' must be {}, found {}", path, number, field, expected,
              found.is_null() ? std::string("null") : std::string(found.type_name()) + " " + found.dump().substr(0, 60));
  };
  static const nlohmann::json missing;  // what an absent document field is reported as
  try {
    while (limit <= 0 || static_cast<int64_t>(items.size()) < limit) {
      line.clear();
      bool got = false;
      while (gzgets(f, buffer, sizeof(buffer))) {
        got = true;
        line += buffer;
        if (!line.empty() && line.back() == '\n') break;
      }
      check_stream();
      if (!got) break;
      ++number;
      if (line.find_first_not_of(" \t\r\n") == std::string::npos) continue;
      nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      COMB_CHECK(!j.is_discarded() && j.is_object(), "'{}' line {}: not valid JSON (expected one object per line)", path,
                 number);
      for (const char* key : {"id", "question", "answers", "documents"})
        COMB_CHECK(j.contains(key), "'{}' line {}: missing '{}' (expected id, question, answers, documents)", path,
                   number, key);
      QaItem item;
      const auto& id = j["id"];
      if (!id.is_string() && !id.is_number_integer()) refuse("id", "a string or a whole number", id);
      item.id = id.is_string() ? id.get<std::string>() : id.dump();
      if (!j["question"].is_string()) refuse("question", "a string", j["question"]);
      item.question = j["question"].get<std::string>();
      const auto& answers = j["answers"];
      // An empty list is read (training skips such items); comb eval refuses it.
      if (!answers.is_array()) refuse("answers", "a list of strings", answers);
      for (size_t a = 0; a < answers.size(); ++a) {
        if (!answers[a].is_string()) refuse(fmt::format("answers[{}]", a), "a string", answers[a]);
        item.answers.push_back(answers[a].get<std::string>());
      }
      const auto& documents = j["documents"];
      if (!documents.is_array()) refuse("documents", "a list of {title, text} objects", documents);
      for (size_t d = 0; d < documents.size(); ++d) {
        const auto& doc = documents[d];
        if (!doc.is_object()) refuse(fmt::format("documents[{}]", d), "an object {title, text}", doc);
        auto text_of = [&](const char* key) -> const std::string& {
          auto at = doc.find(key);
          const nlohmann::json& value = at == doc.end() ? missing : *at;
          if (!value.is_string()) refuse(fmt::format("documents[{}].{}", d, key), "a string", value);
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
        if (!ok) refuse("gold_index", fmt::format("-1 or a document's index below {}", item.documents.size()), gold);
        item.gold_index = gold.get<int64_t>();
      } else {
        item.gold_index = -1;
      }
      items.push_back(std::move(item));
    }
  } catch (const nlohmann::json::exception& e) {
    gzclose(f);
    COMB_FAIL("'{}' line {}: {}", path, number, e.what());
  } catch (...) {
    gzclose(f);
    throw;
  }
  gzclose(f);
  COMB_CHECK(!items.empty(), "'{}' holds no items", path);
  return items;
}

std::string normalize_answer(const std::string& s) {
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

bool answer_correct(const std::string& prediction, const std::vector<std::string>& answers) {
  std::string p = normalize_answer(prediction);
  for (const auto& a : answers) {
    std::string n = normalize_answer(a);
    if (!n.empty() && p.find(n) != std::string::npos) return true;
  }
  return false;
}

std::vector<int32_t> qa_document_tokens(const Model& model, const QaDocument& d) {
  return model.tokenizer().encode("Title: " + d.title + "\n" + d.text + "\n\n", false);
}

namespace {
// The chat template around one user message: what comes before it and after it.
std::pair<std::string, std::string> user_turn(const Model& model) {
  const std::string marker = "\x01";
  std::string rendered = model.chat_template().apply({{"user", marker}}, true);
  size_t at = rendered.find(marker);
  COMB_CHECK(at != std::string::npos, "the chat template drops the user's message (rendered: '{}')", rendered);
  return {rendered.substr(0, at), rendered.substr(at + marker.size())};
}
}  // namespace

std::vector<int32_t> qa_prefix(const Model& model) {
  const Tokenizer& tok = model.tokenizer();
  std::vector<int32_t> prefix = tok.encode(user_turn(model).first + kQaInstruction + "\n\n");
  if (tok.add_bos() && tok.bos_id()) prefix.insert(prefix.begin(), *tok.bos_id());
  return prefix;
}

std::vector<int32_t> qa_suffix(const Model& model, const std::string& question) {
  // The question is data, like a document: "<|im_end|>" written in it stays text. Only the
  // template's own tail is read for control tokens.
  const Tokenizer& tok = model.tokenizer();
  std::vector<int32_t> ids = tok.encode("Question: " + question, false);
  std::vector<int32_t> tail = tok.encode(user_turn(model).second);
  ids.insert(ids.end(), tail.begin(), tail.end());
  return ids;
}

PicRequest qa_request(const Model& model, const std::vector<QaDocument>& documents, const std::string& question) {
  PicRequest r;
  r.prefix = qa_prefix(model);
  for (const auto& d : documents) r.documents.push_back(qa_document_tokens(model, d));
  r.suffix = qa_suffix(model, question);
  return r;
}

}  // namespace comb

namespace comb {
std::vector<std::vector<int32_t>> qa_probe_prompts(const Model& model) {
  static const char* const questions[] = {
      "who wrote the book that the film was based on",      "when was the bridge over the river first opened",
      "what is the name of the largest city in the region", "how many people live in the country today",
      "which team won the championship that year",          "where did the author spend the last years of his life",
      "what does the word mean in the original language",   "who was the first person to hold the office"};
  std::vector<std::vector<int32_t>> out;
  const std::vector<int32_t> prefix = qa_prefix(model);
  for (const char* q : questions) {
    std::vector<int32_t> p = prefix;
    std::vector<int32_t> s = qa_suffix(model, q);
    p.insert(p.end(), s.begin(), s.end());
    out.push_back(std::move(p));
  }
  return out;
}
}  // namespace comb
