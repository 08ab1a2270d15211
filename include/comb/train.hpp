#pragma once
// Training a plug-in on a frozen decoder (LibTorch autograd): the examples, the differentiable
// forward, and the loop (AdamW, warmup then cosine decay, clipping, accumulation, checkpoints).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
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
  at::Tensor tokens;       // [batch, max_tokens] int64 decoder tokens: prefix, suffix, answer (0-padded)
  at::Tensor target_rows;  // [m] int64: flat rows of [batch * max_tokens] whose next token is a target
  at::Tensor targets;      // [m] int64
  int64_t real_tokens = 0; // document and decoder tokens, padding excluded
};
TrainBatch make_train_batch(const std::vector<TrainExample>& examples, c10::Device device);

// Logits [m, n_vocab] (float32) at the batch's target rows: every document through the encoder on
// its own, the decoder with its cross blocks reading each example's documents. Differentiable in
// `weights`, which may be float32 masters: they are cast to the base decoder's dtype.
at::Tensor plugin_train_logits(const Decoder& base, const Plugin& plugin, const PluginWeights& weights,
                               const TrainBatch& batch);
// The bare decoder's logits [m, n_vocab] at the target rows with every example's documents in its
// context (prefix, documents, suffix, answer): the KL term's teacher. No gradient.
at::Tensor full_context_logits(const Decoder& base, const std::vector<TrainExample>& examples, c10::Device device);

// What the loop reports every log_every steps.
struct TrainProgress {
  int64_t step = 0, steps = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0;
  double attn_gate = 0, mlp_gate = 0;  // mean tanh(gate) over the cross blocks
  double elapsed_s = 0, eta_s = 0;
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
  uint64_t seed = 0;
  std::string dir;               // checkpoint.safetensors, optimizer.safetensors, loss.csv
  int64_t save_every = 200;      // steps between checkpoints (and at the end)
  int64_t log_every = 10;
  bool resume = true;            // continue from dir's checkpoint when there is one
  std::function<void(const TrainProgress&)> on_progress;
};

struct TrainResult {
  int64_t steps = 0;        // optimizer steps done in total (resumed ones included)
  int64_t resumed_from = 0;
  double last_loss = 0;     // mean loss of the last logged window
  double seconds = 0;
};

// Trains `plugin` (decoder and embedding frozen) on examples from `data`. Its weights end in
// float32; checkpoints go to options.dir.
TrainResult train_plugin(const Model& model, Plugin& plugin, const TrainData& data, const TrainOptions& options);

// The plug-in's trainable tensors by name (gate|up fused as the plug-in keeps them): those its layout
// has, the encoder's only when it is the plug-in's own (not the base's layers).
std::vector<std::pair<std::string, at::Tensor*>> plugin_parameters(const PluginConfig& config, PluginWeights& weights);

}  // namespace comb
