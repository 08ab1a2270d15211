// The prompt every method reads (comb/prompt.hpp): the chat template around the instruction,
// the documents and the question.
// Compiled into libcomb (src/prompt.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"

#include <string>
#include <utility>

#include "comb/error.hpp"
#include "comb/prompt.hpp"

namespace comb {

COMB_INLINE const char* const kQaInstruction =
    "Write a high-quality answer for the given question using only the provided documents (some of which might be "
    "irrelevant).";

COMB_INLINE std::string qa_question_text(const std::string& question) { return "Question: " + question; }

namespace detail::prompt {  // this file's own helpers
// The chat template around one user message: what comes before it and after it.
COMB_INLINE std::pair<std::string, std::string> user_turn(const Model& model) {
  const std::string marker = "\x01";
  std::string rendered = model.chat_template().apply({{"user", marker}}, true);
  size_t at = rendered.find(marker);
  COMB_CHECK(at != std::string::npos, "the chat template drops the user's message (rendered: '{}')", rendered);
  return {rendered.substr(0, at), rendered.substr(at + marker.size())};
}
}  // namespace detail::prompt

COMB_INLINE std::vector<int32_t> qa_prefix(const Model& model) {
  const Tokenizer& tok = model.tokenizer();
  std::vector<int32_t> prefix = tok.encode(detail::prompt::user_turn(model).first + kQaInstruction + "\n\n");
  if (tok.add_bos() && tok.bos_id()) prefix.insert(prefix.begin(), *tok.bos_id());
  return prefix;
}

COMB_INLINE std::vector<int32_t> qa_suffix(const Model& model, const std::string& question) {
  // The question is data, like a document: "<|im_end|>" written in it stays text. Only the
  // template's own tail is read for control tokens.
  const Tokenizer& tok = model.tokenizer();
  std::vector<int32_t> ids = tok.encode(qa_question_text(question), false);
  std::vector<int32_t> tail = tok.encode(detail::prompt::user_turn(model).second);
  ids.insert(ids.end(), tail.begin(), tail.end());
  return ids;
}

COMB_INLINE std::vector<std::vector<int32_t>> qa_documents(const Model& model, const std::vector<QaDocument>& documents) {
  std::vector<std::vector<int32_t>> out;
  for (const auto& d : documents) out.push_back(Documents::tokens(model, d));
  return out;
}

COMB_INLINE PicRequest qa_request(const Model& model, const std::vector<QaDocument>& documents, const std::string& question) {
  PicRequest r;
  r.prefix = qa_prefix(model);
  r.documents = qa_documents(model, documents);
  r.suffix = qa_suffix(model, question);
  return r;
}


COMB_INLINE std::vector<std::vector<int32_t>> qa_probe_prompts(const Model& model) {
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
