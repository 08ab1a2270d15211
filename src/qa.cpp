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
  try {
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
      COMB_CHECK(!j.is_discarded() && j.is_object(), "'{}' line {}: not valid JSON (expected one object per line)", path,
                 number);
      for (const char* key : {"id", "question", "answers", "documents"})
        COMB_CHECK(j.contains(key), "'{}' line {}: missing '{}' (expected id, question, answers, documents)", path,
                   number, key);
      COMB_CHECK(j["answers"].is_array() && j["documents"].is_array(),
                 "'{}' line {}: 'answers' and 'documents' must be lists", path, number);
      QaItem item;
      item.id = j["id"].is_string() ? j["id"].get<std::string>() : j["id"].dump();
      item.question = j["question"].get<std::string>();
      for (const auto& a : j["answers"]) item.answers.push_back(a.get<std::string>());
      for (const auto& d : j["documents"]) {
        COMB_CHECK(d.is_object(), "'{}' line {}: a document must be an object {{title, text}}", path, number);
        item.documents.push_back({d.value("title", ""), d.value("text", "")});
      }
      item.gold_index = j.value("gold_index", int64_t(-1));
      COMB_CHECK(item.gold_index < static_cast<int64_t>(item.documents.size()),
                 "'{}' line {}: gold_index {} but only {} documents", path, number, item.gold_index,
                 item.documents.size());
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
  return model.tokenizer().encode("Question: " + question + user_turn(model).second);
}

PicRequest qa_request(const Model& model, const std::vector<QaDocument>& documents, const std::string& question) {
  PicRequest r;
  r.prefix = qa_prefix(model);
  for (const auto& d : documents) r.documents.push_back(qa_document_tokens(model, d));
  r.suffix = qa_suffix(model, question);
  return r;
}

}  // namespace comb
