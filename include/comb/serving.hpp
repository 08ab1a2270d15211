#pragma once
// comb::ServeEngine: many requests served at once. One scheduler thread steps every running
// request together (continuous batching): each decoding step is one batched forward over all
// running sequences, whatever their lengths, with their K/V in blocks of a pool sized at start;
// new requests' prompts are computed between steps, a chunk at a time, so that a long prompt does
// not stall the running ones. Per-document caches live in one PICacheStore shared by every request
// and every caching method (see pic.hpp), salted per tenant. The HTTP server (`comb serve`) is a
// thin layer over this class.
#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comb/detail/spin_pool.hpp"
#include "comb/error.hpp"
#include "comb/pic.hpp"

namespace comb {

struct ServeOptions {
  Method method = Method::comb;  // the default caching method (a request may name another)
  PicOptions pic;                // the methods' options; cache_bytes: the document store's memory
  std::string cache_dir;         // the document store's disk tier ("" : none); it survives restarts
  int64_t cache_disk_bytes = int64_t(4) << 30;
  int64_t cache_queue_bytes = int64_t(256) << 20;  // its writes waiting (StoreOptions::disk_queue_bytes)
  // The block pool of running sequences, in bytes. 0: sized at start, 1 GiB on the CPU; on a GPU
  // 90% of its free memory once the model is loaded, less the store's device tier and the prefix
  // cache (pic.cache_bytes each) and 2 GiB left for prompts' own caches and the forwards'
  // activations, at least 1 GiB (1 GiB where comb's CUDA ops are not loaded). options().kv_bytes
  // then holds the size taken.
  int64_t kv_bytes = 0;
  int64_t block_tokens = 16;
  int64_t max_running = 16;      // sequences decoding together
  int64_t max_queued = 64;       // requests waiting beyond them; more are refused (overloaded)
  int64_t max_tokens_in_flight = 0;  // prompt + max_tokens summed over running requests (0: what the pool holds)
  // Prompt or document tokens computed between two decoding steps, at most. 0: sized at start, 256
  // on the CPU; on a GPU 2048, where a forward of a few hundred rows costs little more than one
  // row's (the weights are read once: the 8B shape's prefill of 128 tokens took 7.1 ms on one H200,
  // of 512 tokens 13.0 ms). options().prefill_chunk then holds the size taken.
  int64_t prefill_chunk = 0;
  // A piece of a prompt or document is sized to take about this long (from its last piece's time
  // and tokens; at least 16 tokens, at most prefill_chunk; a request's first piece 64 tokens on the
  // CPU, a quarter of prefill_chunk on a GPU): about the longest a new request waits for the
  // scheduler. 0: prefill_chunk tokens each.
  double piece_ms = 100;
  // While requests decode, each piece's t ms are owed to the decoding steps: they run t /
  // prefill_share ms before the next piece of a prompt or upload under way (pieces then take about
  // share / (1 + share) of the time, and a long prompt slows the others' tokens by about 1 +
  // prefill_share); work under way waits at most piece_ms / prefill_share. A new request's first
  // piece goes at once. 0: a piece between every two decoding steps.
  double prefill_share = 0.3;
  // Off the fused CPU kernels (a GPU's engine), a piece of a prompt or of a document's decoder K/V
  // (naive, EPIC, CacheBlend) goes through the decoding step's forward beside the decoding rows
  // (Decoder::step_paged's piece: one read of the weights for both) instead of a forward of its
  // own before it; sized and owed time as a piece alone is. The CPU's fused step computes rows one
  // by one and takes none; an encoder's pieces (comb) run apart.
  bool mixed_step = true;
};

// Thrown by submit() when the queue is full or the engine is stopping: try again later.
class Overloaded : public Error {
 public:
  using Error::Error;
};

struct ServeResult {
  std::vector<int32_t> tokens;  // generated (a stop token excluded)
  std::string text;             // their text, a stop string and what follows it cut
  std::string finish_reason;    // "stop", "length", "cancelled" or "error"
  std::string error;            // with "error": what went wrong
  std::vector<TokenLogprob> logprobs;  // per token of `tokens`, when the request asked for them
  Method method = Method::full;
  int64_t prompt_tokens = 0;    // every prompt token, documents included
  int64_t cached_tokens = 0;    // of them, K/V read from a cache (documents, prefix blocks)
  int64_t computed_tokens = 0;  // of them, computed for this request (decoder and encoder)
  double queue_ms = 0, ttft_ms = 0, total_ms = 0;  // from submit()
};

struct ServeRequest {
  PicRequest prompt;              // prefix, documents, suffix (without documents: all in one)
  std::optional<Method> method;   // unset: ServeOptions::method
  int64_t max_tokens = 128;
  SamplingOptions sampling;
  std::vector<std::string> stop;  // stop strings (not part of the text)
  bool ignore_eos = false;        // go on past end-of-sequence and end-of-turn tokens (benchmarks)
  // Each generated token's log-probability (ServeResult::logprobs), and with top_logprobs > 0
  // that many most likely tokens at each step (at most kMaxTopLogprobs).
  bool logprobs = false;
  int64_t top_logprobs = 0;
  static constexpr int64_t kMaxTopLogprobs = 20;
  // Called on the engine's thread, in order: each piece of text once no stop string can take it
  // back, with the log-probabilities of the tokens generated since the previous piece (empty
  // unless `logprobs`; a piece may be empty when its tokens' text is held back), then the result.
  // Keep them short (hand the piece to another thread).
  std::function<void(const std::string& piece, const std::vector<TokenLogprob>& logprobs)> on_text;
  std::function<void(const ServeResult& result)> on_done;
};

// Latency histogram with Prometheus's cumulative buckets (seconds).
struct Histogram {
  std::vector<double> bounds;
  std::vector<uint64_t> counts;  // per bound, then +Inf
  double sum = 0;
  uint64_t count = 0;
  explicit Histogram(std::vector<double> b = {}) : bounds(std::move(b)), counts(bounds.size() + 1) {}
  void add(double seconds);
};

struct ServeStats {
  int64_t running = 0, queued = 0, prefilling = 0;
  int64_t blocks_total = 0, blocks_free = 0, block_tokens = 0;
  int64_t tokens_in_flight = 0;
  uint64_t finished = 0, cancelled = 0, failed = 0, refused = 0;
  uint64_t prompt_tokens = 0, cached_tokens = 0, computed_tokens = 0, generated_tokens = 0;
  uint64_t decode_steps = 0;
  double decode_seconds = 0;      // inside batched decoding steps
  uint64_t mixed_steps = 0, mixed_tokens = 0;  // of them, steps with a piece of work, and its tokens
  uint64_t mixed_document_tokens = 0;          // of those, tokens of documents' decoder K/V
  Histogram ttft, inter_token, batch_size;
  std::map<int64_t, std::pair<uint64_t, double>> steps_by_batch;  // rows -> (steps, seconds), without a piece
  StoreStats store;
  int64_t prefix_bytes = 0, prefix_blocks = 0;
};

class ServeEngine {
 public:
  using Id = uint64_t;
  // On the CPU (float32 activations; weights float32 or kept quantized) or a CUDA device (float32,
  // bfloat16 or float16; the block pool and the document store's first tier in its memory).
  // Starts the scheduler thread.
  ServeEngine(const Model& model, ServeOptions options);
  ~ServeEngine();  // shutdown(false)
  ServeEngine(const ServeEngine&) = delete;
  ServeEngine& operator=(const ServeEngine&) = delete;

  // Queues a request. Throws comb::Error for a request that can never run (too long for the
  // context or the pool, a method without its plug-in), Overloaded when the queue is full or the
  // engine stops.
  Id submit(ServeRequest request);
  // The request ends at the next step with "cancelled" and its blocks go back to the pool.
  void cancel(Id id);
  // Stops taking requests; finishes the running and queued ones (`finish`) or cancels them; then
  // ends the scheduler thread. Idempotent.
  void shutdown(bool finish);
  // Runs `job` on the scheduler thread between two steps and waits for it (work on the model
  // outside requests, such as precomputing a document's cache); its exception is rethrown here.
  void run(const std::function<void()>& job);
  // One document's cache computed (or found) now for `method` and `tenant`: true when computed.
  bool warm_document(const std::vector<int32_t>& tokens, Method method, const std::string& tenant);
  ServeStats stats() const;
  // The owner of every request's documents: their tokens (Documents::tokens), caches and pins.
  const Documents& documents() const { return *documents_; }
  const ServeOptions& options() const { return options_; }
  const Model& model() const { return model_; }

 private:
  struct Sequence;
  void loop();
  void admit(std::unique_lock<std::mutex>& lock);
  // Computes one piece of s's prompt; the tokens computed in a piece sized by piece_tokens() (0
  // for a step that is not: a document found in the store, the method's start()).
  int64_t prefill_step(Sequence& s);
  // s's prompt is complete (s.prefill done): its K/V move into its blocks and its first token is sampled.
  void prefill_done(Sequence& s);
  // s's document docs_warmed is in the store (computed, or found): pinned, and the next one's turn.
  void document_done(Sequence& s);
  // Whether s's next piece goes through the next decoding step (ServeOptions::mixed_step): a prompt
  // under way or a document's decoder K/V, requests decoding, the decoder off the fused CPU kernels
  // (scheduler thread).
  bool mixes(const Sequence& s) const;
  // A piece of work's last whole piece (the tokens it was asked for, all computed) and its time,
  // which sizes the next; a piece cut short (a document's tail) does not.
  struct PieceRate {
    int64_t tokens = 0;  // 0: none yet
    double ms = 0;
    void record(int64_t asked, int64_t computed, double took_ms) {
      if (computed > 0 && computed == asked) tokens = computed, ms = took_ms;
    }
  };
  // The tokens of the next piece of work whose last whole piece was `last`, under
  // ServeOptions::piece_ms and prefill_chunk.
  int64_t piece_tokens(const PieceRate& last) const;
  // A piece took `ms`: the decoding steps are owed ms / prefill_share before the next (scheduler thread).
  void owe_decoding(double ms);
  // Waits for the decoder's device to finish what was launched (a GPU's), so that a piece's time
  // is measured as the device spent it; nothing on the CPU.
  void wait_for_device() const;
  // Whether a piece of a prompt or upload under way may run now (scheduler thread, mutex held).
  bool may_continue() const;
  void run_job(const std::function<void()>& job, bool piece);
  // One decoding step of every running request, with a piece of `rider`'s prompt (mixes()) if
  // given; returns the piece's share of the step's time in ms (0 without one).
  double decode_step(Sequence* rider = nullptr);
  // picked >= 0: the token, its argmax read already (logits then unread).
  bool emit(Sequence& s, const at::Tensor& logits, int32_t picked = -1);
  void hand_out(Sequence& s, size_t upto);
  void finish(Sequence& s, const std::string& reason, const std::string& error = "");
  // A document pinned for the request while it reads it (Documents counts pins across requests).
  void pin(Sequence& s, const CacheKey& key);
  void unpin_all(Sequence& s);
  PicEngine& engine(Method m);
  at::Tensor batched_forward(const std::vector<Sequence*>& rows, Decoder::PagedPiece* piece = nullptr);

  const Model& model_;
  ServeOptions options_;
  std::shared_ptr<PICacheStore> store_;
  std::shared_ptr<Documents> documents_;  // the owner of every request's documents (over store_): pins
  std::shared_ptr<PrefixCache> prefix_;
  std::map<Method, std::unique_ptr<PicEngine>> engines_;
  std::unique_ptr<BlockPool> pool_;
  std::vector<int32_t> stop_tokens_;
  std::unique_ptr<detail::SpinPool> workers_;  // the scheduler thread's, for the decoding step

  mutable std::mutex mutex_;
  std::mutex join_mutex_;
  std::condition_variable wake_, job_done_;
  std::deque<std::unique_ptr<Sequence>> queue_;
  std::atomic<int64_t> uploads_{0};  // warm_document calls in progress
  std::vector<std::unique_ptr<Sequence>> prefilling_, running_;
  struct Job {
    std::function<void()> run;
    bool piece = false;  // a piece of an upload: waits while decoding is owed time
  };
  std::deque<Job> jobs_;
  std::vector<Id> cancels_;
  Id next_id_ = 1;
  int64_t in_flight_ = 0;  // tokens reserved by admitted requests
  bool stopping_ = false, finish_on_stop_ = true, stopped_ = false;
  ServeStats stats_;
  double owed_ms_ = 0;  // decoding time owed before the next piece (scheduler thread)
  int64_t first_piece_ = 64;  // a request's first piece, in tokens (before its time is known)
  std::chrono::steady_clock::time_point last_continued_;  // the last piece of work under way ended
  std::thread thread_;
};

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/serving.ipp"
#endif
