#pragma once
// Multi-document QA data: items in the data format (JSON Lines, optionally gzip), the generated and
// converted sets, and the answer check. Used by `comb eval`, `comb train` and `comb make-data`; the
// prompt every method reads is comb/prompt.hpp.
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "comb/prompt.hpp"

namespace comb {

struct QaItem {
  std::string id, question;
  std::vector<std::string> answers;
  std::vector<QaDocument> documents;
  int64_t gold_index = -1;  // the document holding the answer, or -1 when unknown
};

// Bounds on a data file, checked while it streams (before anything is held): every data reader
// (read_qa_items, the make-data sources) refuses input past them with comb::Error naming the bound.
struct DataLimits {
  int64_t max_line_bytes = int64_t(64) << 20;    // one item (the largest shipped set's is 14 KB)
  int64_t max_total_bytes = int64_t(4) << 30;    // the whole file, as text (after decompression)
  double max_ratio = 100;                        // text bytes per compressed byte (gzip of JSON: 2-10) ...
  int64_t ratio_after_bytes = int64_t(32) << 20; // ... checked once this much text was read
};

// Calls fn(line number, line) for each line of a text file, its newline removed, until fn returns
// false: gzip-compressed or plain, read alike (so `comb report` reads `.jsonl` and `.jsonl.gz`).
// A file that cannot be opened, a damaged or cut-short gzip stream, a NUL byte and input past
// `limits` are errors (comb::Error) naming the file and line.
void for_each_text_line(const std::string& path, const std::function<bool(int64_t, const std::string&)>& fn,
                        const DataLimits& limits = {});

// Reads items `id, question, answers, documents[{title, text}]` (and `gold_index` when present),
// one JSON object per line, gzip or plain; the first `limit` items when limit > 0. Throws
// comb::Error naming the file and line of a malformed item.
// Nesting deeper than detail::kMaxJsonDepth and input past `limits` are refused the same way.
std::vector<QaItem> read_qa_items(const std::string& path, int64_t limit = 0, const DataLimits& limits = {});

// Data sets made from public source files (docs/data.md).
struct NqMultidocOptions {
  int64_t documents = 10;      // per item: the gold passage and documents - 1 distractors
  uint64_t seed = 0;           // distractors and the gold passage's place
  int64_t items = 0;           // the first `items` questions only (0: all)
  std::string id_prefix = "nq";  // ids <prefix>-0000, -0001, ...
};
// Multi-document QA from the Natural Questions oracle file of the lost-in-the-middle repository
// (qa_data/nq-open-oracle.jsonl.gz: question, answers, ctxs with the gold passage marked
// "isgold": true, or nq_annotated_gold {title, chunked_long_answer}). Each item keeps its gold
// passage and draws documents - 1 distractors among the other questions' gold passages that hold
// none of its answers (the answer check's normalization), the gold one at a random place.
std::vector<QaItem> nq_multidoc_items(const std::string& source, const NqMultidocOptions& options);

struct KvRetrievalOptions {
  int64_t pairs_per_document = 5;
  int64_t items = 0;            // the first `items` only (0: all)
  std::string id_prefix = "kv";
};
// Key-value retrieval from the same repository's kv_retrieval_data/kv-retrieval-N_keys.jsonl.gz
// (ordered_kv_records [[key, value], ...], key, value): the records in order, pairs_per_document
// to a document written as a JSON object, the question asking for the key's value.
std::vector<QaItem> kv_retrieval_items(const std::string& source, const KvRetrievalOptions& options);

// Filler prose: every *.txt file of `dir`, in name order, cut into paragraphs of about `words` words
// on sentence ends. split "all", or "train" / "test": every fourth essay (by name) is a test essay,
// the others train essays, so a test split's filler never occurs in a training split.
std::vector<std::string> essay_paragraphs(const std::string& dir, size_t words = 80, const std::string& split = "all");

struct NeedleOptions {
  int64_t items = 100;
  int64_t min_documents = 2, max_documents = 6;  // per item, the needle's paragraph among them
  uint64_t seed = 0;
  std::string split = "train";  // "test": test essays and key words that "train" never uses
  std::string id_prefix = "needle";
};
// Facts planted in filler: each item's documents are random paragraphs of `paragraphs`, one with
// "The special magic number for <key> is <7 digits>." inserted after a random sentence end; the
// question asks for that key's number. Keys are two words ("amber-quartz"); a test split draws
// both words from a quarter of the word list that "train" never uses.
std::vector<QaItem> needle_items(const std::vector<std::string>& paragraphs, const NeedleOptions& options);
// One such item from `rng` (the generator behind needle_items and comb train's generated needles).
QaItem needle_item(const std::vector<std::string>& paragraphs, int64_t n_documents, bool test_keys,
                   std::mt19937_64& rng);

// Writes items in the data format (gzip when `path` ends in .gz), whole or not at all.
void write_qa_items(const std::string& path, const std::vector<QaItem>& items);

// Lower case, ASCII punctuation removed (not replaced by a space), then the words a/an/the
// dropped and white space collapsed.
std::string normalize_answer(const std::string& text);
// True when a normalized answer is a substring of the normalized prediction.
bool answer_correct(const std::string& prediction, const std::vector<std::string>& answers);

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/qa.ipp"
#endif
