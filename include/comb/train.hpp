#pragma once
// Training a plug-in on a frozen decoder (LibTorch autograd): the examples, the differentiable
// forward, and the loop (AdamW, warmup then cosine decay, clipping, accumulation, checkpoints).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "comb/model.hpp"
#include "comb/plugin.hpp"
#include "comb/qa.hpp"

namespace comb {

// One training example, as it is used: each document tokenized alone, the decoder's own prompt
// (chat header, instruction, question; no documents) and the answer it should give.
struct TrainExample {
  std::vector<std::shared_ptr<const std::vector<int32_t>>> documents;  // in the order linked
  std::vector<int32_t> prefix;  // chat header and instruction
  std::vector<int32_t> suffix;  // question and assistant header
  std::vector<int32_t> answer;  // target tokens, end of turn included
};

struct TrainDataOptions {
  std::vector<std::string> files;                          // QA JSON Lines files (gzip or plain)
  std::vector<std::pair<std::string, int64_t>> holdout;    // first N items of a file: never trained on (by id, in every file)
  std::string essays_dir;                                  // *.txt filler for needle examples ("" : none)
  double kv_share = 0.2;          // share of generated key-value lookups
  double needle_share = 0.15;     // share of generated facts hidden in filler (needs essays_dir)
  int64_t min_documents = 1;      // documents linked per example: a random subset, gold included
  int64_t max_documents = 10;
  int64_t max_document_tokens = 320;  // every longer document is cut to this many tokens (the answer's too)
};

// The examples comb train draws from: QA items of the given files (held-out ids removed) and
// generated ones, each drawn with a fresh random subset and order of its documents.
class TrainData {
 public:
  TrainData(const Model& model, const TrainDataOptions& options);
  // A random example; the same rng state gives the same example.
  TrainExample sample(std::mt19937_64& rng) const;
  int64_t n_items() const { return static_cast<int64_t>(items_.size()); }
  int64_t n_held_out() const { return n_held_out_; }

 private:
  struct Item {
    std::vector<std::shared_ptr<const std::vector<int32_t>>> documents;
    int64_t gold = -1;
    std::vector<int32_t> suffix, answer;
  };
  TrainExample generated_kv(std::mt19937_64& rng) const;
  TrainExample generated_needle(std::mt19937_64& rng) const;
  TrainExample finish(std::vector<std::shared_ptr<const std::vector<int32_t>>> documents, int64_t gold,
                      std::vector<int32_t> suffix, std::vector<int32_t> answer, std::mt19937_64& rng) const;
  std::shared_ptr<const std::vector<int32_t>> document(const QaDocument& d) const;
  const Model& model_;
  TrainDataOptions options_;
  std::vector<Item> items_;
  std::vector<std::string> paragraphs_;  // filler
  std::vector<int32_t> prefix_, end_of_turn_;
  int64_t n_held_out_ = 0;
};

// A batch of examples as tensors.
struct TrainBatch {
  at::Tensor doc_tokens;   // [n_docs, max_len] int64, 0-padded
  at::Tensor doc_mask;     // [n_docs, max_len] bool: real tokens
  std::vector<int64_t> doc_lens;    // [n_docs] real tokens of each document row
  std::vector<int64_t> doc_counts;  // [batch] documents of each example (rows in order)
  std::vector<std::vector<int32_t>> documents;  // [n_docs] each document's tokens (rows in order)
  at::Tensor tokens;       // [batch, max_tokens] int64 decoder tokens: prefix, suffix, answer (0-padded)
  at::Tensor target_rows;  // [m] int64: flat rows of [batch * max_tokens] whose next token is a target
  at::Tensor targets;      // [m] int64
  int64_t real_tokens = 0; // document and decoder tokens, padding excluded
  int64_t prefix_tokens = -1;  // every example's prefix length when they are all alike, else -1
};
TrainBatch make_train_batch(const std::vector<TrainExample>& examples, c10::Device device);

// Logits [m, n_vocab] (float32) at the batch's target rows: every document through the encoder on
// its own, the decoder with its cross blocks reading each example's documents. Differentiable in
// `weights`, which may be float32 masters: they are cast to the base decoder's dtype.
// `documents_as` (a cache dtype or form; Undefined: as computed): each document's K/V read as a
// store of that dtype keeps them (forward: the stored numbers; backward: straight through).
at::Tensor plugin_train_logits(const Decoder& base, const Plugin& plugin, const PluginWeights& weights,
                               const TrainBatch& batch, c10::ScalarType documents_as = c10::ScalarType::Undefined);
// Every document's K/V per block ([block][document], [n_head_kv, len, head_dim], rows in order),
// differentiable in `weights`. `as_inference`: Plugin::encode_trainable, encode_many's batches and
// the base's cached forward without gradients (needs an encoder of the base's own layers); else
// Plugin::encode_batch, all documents in one padded batch through the generic layers.
// plugin_train_logits takes the first on the CPU where it applies (train_encodes_as_inference).
struct TrainDocumentKV {
  std::vector<std::vector<at::Tensor>> keys, values;
};
TrainDocumentKV train_document_kv(const Decoder& base, const Plugin& plugin, const PluginWeights& weights,
                                  const TrainBatch& batch, bool as_inference);
bool train_encodes_as_inference(const Decoder& base, const Plugin& plugin, const PluginWeights& weights);
// One document's K/V of one block ([n_head_kv, n_tokens, head_dim]) as a store of `dtype` keeps
// them, read back in their own dtype: DocumentKV::to's numbers forward, the identity backward.
std::pair<at::Tensor, at::Tensor> read_as_stored(const at::Tensor& keys, const at::Tensor& values,
                                                 c10::ScalarType dtype);
// The bare decoder's logits [m, n_vocab] at the target rows with every example's documents in its
// context (prefix, documents, suffix, answer): the KL term's teacher. No gradient.
at::Tensor full_context_logits(const Decoder& base, const std::vector<TrainExample>& examples, c10::Device device);

// Self-distillation: the frozen decoder's own greedy answer to an example with every one of its
// documents in its context (prefix, documents in the example's order, suffix), which a plug-in
// can always reach by reading, and the decoder's top-k log-probabilities at each answer position.
struct TeacherAnswer {
  std::vector<int32_t> answer;                    // greedy tokens, end of turn included when it ended there
  std::vector<std::vector<int32_t>> top_ids;      // [answer.size()][k], most likely first
  std::vector<std::vector<float>> top_logprobs;   // [answer.size()][k]
};
// Greedy decoding of `model`'s base decoder (the plug-in off) on the full-context prompt, at most
// max_tokens, then one forward over prompt + answer for the top-k log-probabilities.
TeacherAnswer teacher_answer(const Model& model, const TrainExample& example, int64_t max_tokens, int64_t top_k);
// The same for several examples at once: each answer token is one forward over every unfinished
// prompt (no cache: on a GPU a wide forward costs about what a narrow one does, where one token at
// a time is bound by launching kernels), then one forward for all the top-k. Rounding and greedy
// ties aside, the answers of teacher_answer; the CPU is faster with teacher_answer.
std::vector<TeacherAnswer> teacher_answers(const Model& model, const std::vector<TrainExample>& examples,
                                           int64_t max_tokens, int64_t top_k);

// Teacher answers computed once and kept in a JSON Lines file (docs/formats.md, "Teacher file"),
// so that resumed runs and sweeps over the same examples reuse them. The first line names the
// base decoder and the settings; a file of another decoder or other settings is refused. A line
// cut short by an interrupted run is dropped (with a warning); any other bad line is an error.
class TeacherCache {
 public:
  TeacherCache(std::string path, std::string base_fingerprint, int64_t max_tokens, int64_t top_k);
  // The key of an example's full-context prompt: XXH3-128 of its prefix, documents and suffix.
  static std::string key(const TrainExample& example);
  const TeacherAnswer* find(const std::string& key) const;
  // Keeps `answer` and appends it to the file (flushed).
  const TeacherAnswer& add(const std::string& key, TeacherAnswer answer);
  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t top_k() const { return top_k_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_, base_;
  int64_t max_tokens_, top_k_;
  std::unordered_map<std::string, TeacherAnswer> entries_;
};

// KL(teacher || student) per answer row over the teacher's top-k tokens and one bucket for the
// rest of the vocabulary (a lower bound of the full KL), mean over rows. `student_logits` [m,
// n_vocab]; top_ids [m, k] int64; top_logprobs [m, k] float.
at::Tensor top_k_kl(const at::Tensor& student_logits, const at::Tensor& top_ids, const at::Tensor& top_logprobs);

// What the loop reports every log_every steps.
struct TrainProgress {
  int64_t step = 0, steps = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0;
  double attn_gate = 0, mlp_gate = 0;  // mean tanh(gate) over the cross blocks
  double ce = 0;                       // answer-token cross-entropy (the loss less the KL term)
  double ce_swapped = 0;               // the same with documents swapped between examples (NaN: not measured)
  double elapsed_s = 0, eta_s = 0;
};

// What TrainOptions::dev_check returns: the share of dev items answered right, of how many.
struct DevCheck {
  double accuracy = 0;
  int64_t items = 0;
};

struct TrainOptions {
  int64_t steps = 1000;
  int64_t batch_size = 16;       // examples per micro-batch
  int64_t accumulation = 1;      // micro-batches per optimizer step
  double lr = 3e-4;
  int64_t warmup_steps = 50;
  double min_lr_ratio = 0.1;     // the cosine decays to lr * min_lr_ratio at the last step
  double weight_decay = 0.01;    // not on norms and gates
  double gate_lr_scale = 10;     // gates start at 0 and move at lr * this
  double clip = 1.0;             // global gradient-norm clip (0: none)
  double open_gates = 0;         // a fresh run starts the attention gates at tanh(gate) = this (0: closed)
  double kl_weight = 0;          // + kl_weight * KL(full-context decoder || plug-in) on answer tokens
  // "gold": the items' answers are the targets; "teacher": the frozen decoder's own full-context
  // greedy answers (self-distillation; the KL term then uses the stored top-k log-probabilities).
  std::string targets = "gold";
  std::string teacher_file;      // teacher answers kept across runs ("": <dir>/teacher.jsonl)
  int64_t teacher_tokens = 24;   // most tokens of a teacher answer
  int64_t teacher_top_k = 16;    // log-probabilities kept per answer position
  // Teacher answers a micro-batch lacks are computed together (teacher_answers): 1 yes, 0 one at a
  // time (teacher_answer), -1 yes on a GPU, one at a time on the CPU.
  int teacher_batched = -1;
  uint64_t seed = 0;
  std::string dir;               // checkpoint.safetensors, optimizer.safetensors, loss.csv
  int64_t save_every = 200;      // steps between checkpoints (and at the end)
  int64_t log_every = 10;
  bool resume = true;            // continue from dir's checkpoint when there is one
  // Also score each batch with every example reading the next one's documents (no gradient): the
  // loss log's ce_swapped, against ce the evidence that the plug-in reads. Costs one more forward.
  bool reading_check = false;
  // The documents' K/V read as a store of this cache dtype keeps them (plugin_train_logits'
  // documents_as): a plug-in trained for int4 caches, say. Undefined (the default): as computed.
  c10::ScalarType document_dtype = c10::ScalarType::Undefined;
  std::function<void(const TrainProgress&)> on_progress;
  // A held-out check along the run: every dev_every steps (and at the last) dev_check scores the
  // plug-in as it stands (a copy, no gradients; e.g. greedy answers on dev items, as comb eval
  // scores them), and the row "step,accuracy,items,seconds" goes to <dir>/dev.csv (a resumed run
  // keeps the rows of the steps it resumes after). dev_every 0 or no dev_check: none.
  int64_t dev_every = 0;
  std::function<DevCheck(const Plugin&)> dev_check;
};

struct TrainResult {
  int64_t steps = 0;        // optimizer steps done in total (resumed ones included)
  int64_t resumed_from = 0;
  double last_loss = 0;     // mean loss of the last logged window
  double seconds = 0;
  int64_t teacher_computed = 0;  // teacher answers computed in this run (targets = teacher)
  int64_t teacher_reused = 0;    // and found in the teacher file
  double dev_accuracy = std::nan("");  // the last dev check's (NaN: none ran)
};

// Trains `plugin` (decoder and embedding frozen) on examples from `data`. Its weights end in
// float32; checkpoints go to options.dir.
TrainResult train_plugin(const Model& model, Plugin& plugin, const TrainData& data, const TrainOptions& options);

// The plug-in's trainable tensors by name (gate|up fused as the plug-in keeps them): those its layout
// has, the encoder's only when it is the plug-in's own (not the base's layers).
std::vector<std::pair<std::string, at::Tensor*>> plugin_parameters(const PluginConfig& config, PluginWeights& weights);

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/train.ipp"
#endif
