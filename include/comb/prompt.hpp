#pragma once
// The prompt every method reads, in the server, `comb generate`, `comb qa` and `comb eval` alike:
// the chat template's user turn around the instruction, the documents (each rendered alone) and
// the question, then the assistant header.
#include <cstdint>
#include <string>
#include <vector>

#include "comb/documents.hpp"
#include "comb/pic.hpp"

namespace comb {


// The instruction that opens every prompt.
extern const char* const kQaInstruction;

// The question as every prompt holds it, after the documents: "Question: <question>".
std::string qa_question_text(const std::string& question);
// The segments around the documents: chat header + instruction, and "Question: <question>" +
// the assistant header. Documents and the question are data: control tokens written in them stay
// text (encoded without parsing special tokens).
std::vector<int32_t> qa_prefix(const Model& model);
std::vector<int32_t> qa_suffix(const Model& model, const std::string& question);
// Prompts without documents (qa_prefix | qa_suffix of a few fixed, generic questions): what a
// plug-in's attention sinks are measured on.
std::vector<std::vector<int32_t>> qa_probe_prompts(const Model& model);
// The documents as every prompt holds them, each alone ("Title: <title>\n<text>\n\n", read as
// data): the one place a prompt's documents become tokens. No chat template needed.
std::vector<std::vector<int32_t>> qa_documents(const Model& model, const std::vector<QaDocument>& documents);
// qa_prefix | qa_documents | qa_suffix.
PicRequest qa_request(const Model& model, const std::vector<QaDocument>& documents, const std::string& question);

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/prompt.ipp"
#endif
