// comb::ServeEngine (see comb/serving.hpp). Compiled into libcomb
// (src/serving.cpp), or inline in every translation unit that defines COMB_HEADER_ONLY.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "comb/detail/cpu_kernels.hpp"
#include "comb/detail/decode_step.hpp"
#include "comb/detail/spin_pool.hpp"
#include "comb/detail/utf8.hpp"
#include "comb/error.hpp"
#include "comb/serving.hpp"

namespace comb {

COMB_INLINE void Histogram::add(double seconds) {
  size_t i = 0;
  while (i < bounds.size() && seconds > bounds[i]) ++i;
  ++counts[i];
  sum += seconds;
  ++count;
}

// ================================================================================================
// ServeEngine
// ================================================================================================

struct ServeEngine::Sequence {
  using clock = std::chrono::steady_clock;
  Id id = 0;
  ServeRequest request;
  Method method = Method::comb;
  clock::time_point submitted, last_token;
  int64_t decoder_tokens = 0;  // positions the prompt fills in the decoder
  int64_t reserve = 0;         // tokens reserved: decoder_tokens + max_tokens
  std::vector<int32_t> blocks;
  // Prompt
  size_t docs_warmed = 0;
  int64_t warm_computed = 0;   // document tokens computed by warming, before start()
  std::unique_ptr<DocumentWork> document_work;  // the document being computed, a piece per turn
  PieceRate rate;              // its last whole piece, for sizing the next
  int64_t piece_asked = 0;     // the tokens its last piece was asked for
  bool started = false;        // it has computed tokens in a piece (a prompt under way)
  bool mix = true;             // its pieces may ride on the decoding steps (not after one failed there)
  std::unique_ptr<PicPrefill> prefill;
  std::vector<CacheKey> pinned;
  // Whether its next prefill step takes one of its documents (found in the store, or a piece of it
  // computed): a method that caches documents one by one, before its start().
  bool document_turn() const {
    return !prefill && method != Method::full && method != Method::prefix &&
           docs_warmed < request.prompt.documents.size();
  }
  // Decoding
  int64_t length = 0;          // positions held in `blocks`
  int32_t next = -1;           // the token to feed at position `length`
  LinkedDocuments documents;   // comb: the linked entries it holds
  std::unique_ptr<DocumentReads> reads;  // comb: what its decoding steps read of them
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<StreamDecoder> stream;
  size_t emitted = 0;          // bytes of result.text handed to on_text
  size_t logprobs_sent = 0;    // entries of result.logprobs handed to on_text
  bool done = false;
  ServeResult result;
};

namespace detail::serving {  // this file's own helpers
COMB_INLINE double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
COMB_INLINE std::vector<double> latency_bounds() {
  return {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}
}  // namespace detail::serving

COMB_INLINE ServeEngine::ServeEngine(const Model& model, ServeOptions options)
    : model_(model), options_(std::move(options)) {
  const Decoder& dec = model.decoder();
  const auto& c = dec.config();
  COMB_CHECK((dec.device().is_cpu() && dec.dtype() == at::kFloat) ||
                 (dec.device().is_cuda() &&
                  (dec.dtype() == at::kFloat || dec.dtype() == at::kBFloat16 || dec.dtype() == at::kHalf)),
             "the serving engine runs on the CPU with float32 activations (weights float32 or kept quantized) or on a "
             "CUDA device in float32, bfloat16 or float16, found {} {}",
             dec.device().str(), c10::toString(dec.dtype()));
  COMB_CHECK(options_.max_running > 0, "max running requests must be > 0, found {}", options_.max_running);
  COMB_CHECK(options_.max_queued >= 0, "max queued requests must be >= 0, found {}", options_.max_queued);
  COMB_CHECK(options_.prefill_chunk >= 0, "prefill chunk must be >= 0 tokens (0: sized at start), found {}",
             options_.prefill_chunk);
  if (options_.prefill_chunk == 0) options_.prefill_chunk = dec.device().is_cuda() ? 2048 : 256;
  first_piece_ = std::min<int64_t>(options_.prefill_chunk, dec.device().is_cuda() ? options_.prefill_chunk / 4 : 64);
  COMB_CHECK(options_.piece_ms >= 0 && std::isfinite(options_.piece_ms), "piece time must be >= 0 ms, found {}",
             options_.piece_ms);
  COMB_CHECK(options_.prefill_share >= 0 && std::isfinite(options_.prefill_share),
             "prefill share must be >= 0, found {}", options_.prefill_share);
  COMB_CHECK(options_.block_tokens > 0 && options_.block_tokens <= 1024, "block size must be 1 to 1024 tokens, found {}",
             options_.block_tokens);
  // Its steps warm every document of a request before start() and read them all when decoding.
  COMB_CHECK(options_.pic.comb_recompute_last == 0,
             "the serving engine links every document: comb_recompute_last must be 0, found {}",
             options_.pic.comb_recompute_last);
  if (options_.method == Method::comb)
    COMB_CHECK(model.plugin(), "the default method comb needs a plug-in (--plugin FILE, or another --method)");
  StoreOptions so = options_.pic.store_options(dec.device());  // on a GPU: a device tier first
  so.disk_dir = options_.cache_dir;
  so.disk_bytes = options_.cache_dir.empty() ? 0 : options_.cache_disk_bytes;
  so.disk_queue_bytes = options_.cache_queue_bytes;
  store_ = std::make_shared<PICacheStore>(so);
  documents_ = std::make_shared<Documents>(model, store_);
  prefix_ = std::make_shared<PrefixCache>(options_.pic.prefix_block, options_.pic.cache_bytes);
  // The pool holds K/V in the decoder's dtype on its device (GPU memory on a GPU).
  COMB_CHECK(options_.kv_bytes >= 0, "KV memory must be >= 0 bytes (0: sized at start), found {}", options_.kv_bytes);
  if (options_.kv_bytes == 0) {
    const int64_t gib = int64_t(1) << 30;
    options_.kv_bytes = gib;
    const detail::CudaLayerOps* ops = detail::cuda_layer_ops();
    if (dec.device().is_cuda() && ops && ops->free_memory) {
      const int64_t free = ops->free_memory(dec.device().has_index() ? dec.device().index() : -1);
      options_.kv_bytes = std::max(gib, free / 10 * 9 - 2 * options_.pic.cache_bytes - 2 * gib);
    }
  }
  const int64_t block_bytes = BlockPool::block_bytes(c, options_.block_tokens, dec.dtype());
  const int64_t n_blocks = options_.kv_bytes / block_bytes;
  COMB_CHECK(n_blocks >= 1, "KV memory of {} bytes holds no block of {} tokens ({} bytes)", options_.kv_bytes,
             options_.block_tokens, block_bytes);
  pool_ = std::make_unique<BlockPool>(c, n_blocks, options_.block_tokens, dec.dtype(), dec.device());
  if (options_.max_tokens_in_flight <= 0) options_.max_tokens_in_flight = n_blocks * options_.block_tokens;
  const Tokenizer& tok = model.tokenizer();
  if (auto eos = tok.eos_id()) stop_tokens_.push_back(*eos);
  try {
    if (auto eot = tok.find_token(model.chat_template().end_of_turn())) stop_tokens_.push_back(*eot);
  } catch (const Error&) {  // a model without a chat template: EOS only
  }
  stats_.ttft = Histogram(detail::serving::latency_bounds());
  stats_.inter_token = Histogram(detail::serving::latency_bounds());
  stats_.batch_size = Histogram({1, 2, 4, 8, 16, 32, 64});
  engine(options_.method);  // checks the default method's options now
  const int threads = at::get_num_threads();
  thread_ = std::thread([this, threads] {
    workers_ = std::make_unique<detail::SpinPool>(threads);  // the decoding step's loops
    loop();
    workers_.reset();
  });
}

COMB_INLINE ServeEngine::~ServeEngine() {
  try {
    shutdown(false);
  } catch (...) {
  }
}

COMB_INLINE void ServeEngine::wait_for_device() const {
  const c10::Device d = model_.decoder().device();
  if (!d.is_cuda()) return;
  c10::impl::getDeviceGuardImpl(d.type())
      ->synchronizeDevice(d.has_index() ? d.index() : c10::impl::getDeviceGuardImpl(d.type())->getDevice().index());
}

COMB_INLINE PicEngine& ServeEngine::engine(Method m) {
  auto& e = engines_[m];
  if (!e) e = std::make_unique<PicEngine>(model_, m, options_.pic, documents_, prefix_);
  return *e;
}

COMB_INLINE ServeEngine::Id ServeEngine::submit(ServeRequest request) {
  const auto& c = model_.config();
  auto s = std::make_unique<Sequence>();
  s->method = request.method.value_or(options_.method);
  if (s->method == Method::comb)
    COMB_CHECK(model_.plugin(), "method comb needs a plug-in, and this server has none");
  const PicRequest& p = request.prompt;
  COMB_CHECK(!p.suffix.empty(), "the prompt is empty");
  for (size_t d = 0; d < p.documents.size(); ++d) COMB_CHECK(!p.documents[d].empty(), "document {} is empty", d);
  int64_t total = static_cast<int64_t>(p.prefix.size() + p.suffix.size()), docs = 0;
  for (const auto& d : p.documents) docs += static_cast<int64_t>(d.size());
  if (s->method == Method::comb && model_.plugin())
    for (size_t d = 0; d < p.documents.size(); ++d)
      COMB_CHECK(static_cast<int64_t>(p.documents[d].size()) <= model_.plugin()->config().max_document_tokens ||
                     model_.plugin()->config().max_document_tokens <= 0,
                 "document {} has {} tokens; the plug-in's encoder takes at most {}", d, p.documents[d].size(),
                 model_.plugin()->config().max_document_tokens);
  s->decoder_tokens = s->method == Method::comb ? total : total + docs;
  COMB_CHECK(request.max_tokens >= 1, "max_tokens must be at least 1, found {}", request.max_tokens);
  COMB_CHECK(request.top_logprobs >= 0 && request.top_logprobs <= ServeRequest::kMaxTopLogprobs,
             "top_logprobs should be 0 to {}, found {}", ServeRequest::kMaxTopLogprobs, request.top_logprobs);
  COMB_CHECK(s->decoder_tokens < c.n_ctx && request.max_tokens <= c.n_ctx - s->decoder_tokens,
             "this model's context holds {} tokens; the request asks for {} prompt tokens (in the decoder) and {} to "
             "generate",
             c.n_ctx, s->decoder_tokens, request.max_tokens);
  s->reserve = s->decoder_tokens + request.max_tokens;
  COMB_CHECK(pool_->blocks_for(s->reserve) <= pool_->n_blocks() && s->reserve <= options_.max_tokens_in_flight,
             "the request needs {} tokens of KV memory; the server holds {} at most", s->reserve,
             std::min(pool_->n_blocks() * pool_->block_tokens(), options_.max_tokens_in_flight));
  s->result.method = s->method;
  s->result.prompt_tokens = total + docs;
  s->request = std::move(request);
  s->sampler = std::make_unique<Sampler>(s->request.sampling);
  s->stream = std::make_unique<StreamDecoder>(model_.tokenizer());
  s->submitted = Sequence::clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopping_) {
    ++stats_.refused;
    throw Overloaded("the server is shutting down");
  }
  // Every request passes through the queue; those that a free running slot will take at the
  // scheduler's next turn do not count against max_queued.
  const int64_t free_slots =
      std::max<int64_t>(0, options_.max_running - static_cast<int64_t>(running_.size() + prefilling_.size()));
  if (static_cast<int64_t>(queue_.size()) >= options_.max_queued + free_slots) {
    ++stats_.refused;
    throw Overloaded(fmt::format("{} requests are already waiting (the limit is {})", queue_.size(),
                                 options_.max_queued));
  }
  s->id = next_id_++;
  Id id = s->id;
  queue_.push_back(std::move(s));
  wake_.notify_all();
  return id;
}

COMB_INLINE void ServeEngine::cancel(Id id) {
  std::lock_guard<std::mutex> lock(mutex_);
  cancels_.push_back(id);
  wake_.notify_all();
}

COMB_INLINE void ServeEngine::shutdown(bool finish) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stopping_) finish_on_stop_ = finish;
    if (!finish) finish_on_stop_ = false;
    stopping_ = true;
    wake_.notify_all();
  }
  std::lock_guard<std::mutex> join(join_mutex_);  // one caller joins; the others find it joined
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

COMB_INLINE void ServeEngine::run(const std::function<void()>& job) { run_job(job, false); }

COMB_INLINE void ServeEngine::run_job(const std::function<void()>& job, bool piece) {
  struct State {
    std::atomic<bool> done{false};
    std::exception_ptr error;
  };
  auto state = std::make_shared<State>();
  std::unique_lock<std::mutex> lock(mutex_);
  if (stopped_) throw Overloaded("the server is shutting down");
  jobs_.push_back({[job, state] {
                     try {
                       job();
                     } catch (...) {
                       state->error = std::current_exception();
                     }
                     state->done = true;  // read by the caller once the loop notifies under the mutex
                   },
                   piece});
  wake_.notify_all();
  job_done_.wait(lock, [&] { return state->done || stopped_; });
  if (!state->done) throw Overloaded("the server is shutting down");
  if (state->error) std::rethrow_exception(state->error);
}

COMB_INLINE bool ServeEngine::warm_document(const std::vector<int32_t>& tokens, Method method, const std::string& tenant) {
  if (method == Method::comb) COMB_CHECK(model_.plugin(), "method comb needs a plug-in, and this server has none");
  // A piece per job: the scheduler runs the others' prefill and decoding between two pieces. Each
  // upload being computed holds its document's K/V so far outside the block pool: at most
  // max_running of them at once (more are Overloaded, a 429).
  struct Slot {
    std::atomic<int64_t>& n;
    ~Slot() { --n; }
  };
  if (++uploads_ > options_.max_running) {
    --uploads_;
    throw Overloaded(fmt::format("{} documents are being computed for uploads (the limit): try again", options_.max_running));
  }
  Slot slot{uploads_};
  std::unique_ptr<DocumentWork> work;
  run([&] { work = engine(method).begin_document(tokens, tenant); });
  if (!work) return false;
  PieceRate rate;
  for (bool complete = false; !complete;)
    run_job(
        [&] {
          const int64_t before = work->done, asked = piece_tokens(rate);
          const auto t0 = std::chrono::steady_clock::now();
          try {
            complete = engine(method).continue_document(*work, asked);
            wait_for_device();
          } catch (...) {
            owe_decoding(detail::serving::seconds_since(t0) * 1e3);
            throw;
          }
          const double ms = detail::serving::seconds_since(t0) * 1e3;
          rate.record(asked, work->done - before, ms);
          owe_decoding(ms);
        },
        /*piece=*/true);
  return true;
}

COMB_INLINE ServeStats ServeEngine::stats() const {
  ServeStats s;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    s = stats_;
    s.queued = static_cast<int64_t>(queue_.size());
    s.prefilling = static_cast<int64_t>(prefilling_.size());
    s.running = static_cast<int64_t>(running_.size());
    s.tokens_in_flight = in_flight_;
    s.blocks_total = pool_->n_blocks();
    s.block_tokens = pool_->block_tokens();
  }
  s.store = store_->stats();
  return s;
}

// Admits queued requests in order while there is room: running requests, tokens in flight, blocks.
COMB_INLINE void ServeEngine::admit(std::unique_lock<std::mutex>&) {
  while (!queue_.empty()) {
    Sequence& s = *queue_.front();
    if (static_cast<int64_t>(prefilling_.size() + running_.size()) >= options_.max_running) break;
    if (in_flight_ + s.reserve > options_.max_tokens_in_flight) break;
    std::vector<int32_t> blocks = pool_->allocate(pool_->blocks_for(s.reserve));
    if (blocks.empty()) break;
    s.blocks = std::move(blocks);
    in_flight_ += s.reserve;
    s.result.queue_ms = detail::serving::seconds_since(s.submitted) * 1e3;
    prefilling_.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  stats_.blocks_free = pool_->n_free();
}

COMB_INLINE void ServeEngine::loop() {
  c10::InferenceMode guard;
  last_continued_ = Sequence::clock::now();
  for (;;) {
    std::vector<std::function<void()>> jobs;
    bool continued = false;  // a piece of work under way taken this turn
    std::vector<Id> cancels;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] {
        return stopping_ || !queue_.empty() || !prefilling_.empty() || !running_.empty() || !jobs_.empty() ||
               !cancels_.empty();
      });
      if (stopping_ && !finish_on_stop_) {
        for (auto& s : queue_) cancels.push_back(s->id);
        for (auto& s : prefilling_) cancels.push_back(s->id);
        for (auto& s : running_) cancels.push_back(s->id);
      }
      if (stopping_ && queue_.empty() && prefilling_.empty() && running_.empty() && cancels.empty() &&
          cancels_.empty()) {
        stopped_ = true;
        for (auto& j : jobs_) jobs.push_back(std::move(j.run));  // never run: their callers are told
        jobs_.clear();
        job_done_.notify_all();
        return;
      }
      // Other jobs run now; at most one piece of work under way (an upload's piece here, else a
      // prompt's below) per turn, and only when the decoding steps are not owed time.
      const bool may = may_continue();
      std::deque<Job> kept;
      for (auto& j : jobs_) {
        if (j.piece && (!may || continued)) {
          kept.push_back(std::move(j));
          continue;
        }
        continued = continued || j.piece;
        jobs.push_back(std::move(j.run));
      }
      jobs_.swap(kept);
      cancels.insert(cancels.end(), cancels_.begin(), cancels_.end());
      cancels_.clear();
    }
    for (auto& job : jobs) {
      job();
      std::lock_guard<std::mutex> lock(mutex_);
      job_done_.notify_all();
    }
    if (continued) last_continued_ = Sequence::clock::now();
    if (!cancels.empty()) {
      std::unique_lock<std::mutex> lock(mutex_);
      for (Id id : cancels) {
        for (auto it = queue_.begin(); it != queue_.end(); ++it)
          if ((*it)->id == id) {
            auto s = std::move(*it);
            queue_.erase(it);
            lock.unlock();
            finish(*s, "cancelled");
            lock.lock();
            break;
          }
        for (auto* list : {&prefilling_, &running_})
          for (auto& s : *list)
            if (s->id == id && !s->done) {
              lock.unlock();
              finish(*s, "cancelled");
              lock.lock();
            }
      }
    }
    {
      std::unique_lock<std::mutex> lock(mutex_);
      auto gone = [](const std::unique_ptr<Sequence>& s) { return s->done; };
      prefilling_.erase(std::remove_if(prefilling_.begin(), prefilling_.end(), gone), prefilling_.end());
      running_.erase(std::remove_if(running_.begin(), running_.end(), gone), running_.end());
      admit(lock);
    }
    // The prompt whose turn it is: a new request's (one that has computed no piece yet) at once; a
    // prompt under way when no piece of work under way ran this turn and may_continue().
    Sequence* first = nullptr;
    bool under_way = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const bool may = !continued && may_continue();
      for (auto& p : prefilling_)
        if (!p->started || may) {
          first = p.get();
          under_way = p->started;
          break;
        }
    }
    // Where a prompt ended or took its turn: running once complete, else behind the others.
    auto settle = [&](Sequence* s) {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = std::find_if(prefilling_.begin(), prefilling_.end(), [&](const auto& p) { return p.get() == s; });
      if (it == prefilling_.end()) return;
      if (s->done || s->next >= 0) {
        if (!s->done) running_.push_back(std::move(*it));
        prefilling_.erase(it);
      } else {  // its next piece waits for one of each other prompt's: a long one holds none of them
        std::rotate(it, it + 1, prefilling_.end());
      }
    };
    Sequence* rider = nullptr;  // a prompt whose piece goes through this turn's decoding step
    if (first) {
      const auto t0 = Sequence::clock::now();
      try {
        // Steps that compute no piece of tokens (a document found in the store; the method's
        // start(), which for EPIC and CacheBlend is their whole recomputation, not split) go on in
        // the same turn, up to a piece that computes tokens (or rides on the decoding step) or the
        // end of the prompt.
        for (int64_t tokens = 0; tokens == 0 && !first->done && first->next < 0 &&
                                 detail::serving::seconds_since(t0) * 1e3 <= std::max(1.0, options_.piece_ms);) {
          if (mixes(*first)) {
            rider = first;
            break;
          }
          const auto t1 = Sequence::clock::now();
          const bool document_step = first->document_turn();  // not start() nor a piece of the prompt
          tokens = prefill_step(*first);
          // A piece's time is the device's, and so is start()'s (EPIC's and CacheBlend's whole
          // recomputation); a document found in the store (linked by a launch or two) is not
          // waited for: its work goes on queued.
          if (tokens > 0 || !document_step) wait_for_device();
          if (tokens > 0) first->started = true;
          first->rate.record(first->piece_asked, tokens, detail::serving::seconds_since(t1) * 1e3);
        }
      } catch (const std::exception& e) {
        finish(*first, "error", e.what());
      }
      const double ms = detail::serving::seconds_since(t0) * 1e3;
      if (under_way && !rider) last_continued_ = Sequence::clock::now();
      if (!rider) settle(first);
      owe_decoding(ms);  // the time the requests decoding waited
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.prefix_bytes = prefix_->bytes();
      stats_.prefix_blocks = prefix_->n_blocks();
    }
    bool any = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      any = !running_.empty();
    }
    if (!any && rider) settle(rider);  // no step to ride on after all: its piece waits for its turn
    if (any) {
      try {
        const auto t0 = Sequence::clock::now();
        const double piece_ms = decode_step(rider);
        owed_ms_ = std::max(0.0, owed_ms_ - (detail::serving::seconds_since(t0) * 1e3 - piece_ms));
        if (rider) {
          owe_decoding(piece_ms);
          if (under_way) last_continued_ = Sequence::clock::now();
          settle(rider);
        }
      } catch (const std::exception& e) {
        if (rider) settle(rider);
        std::vector<Sequence*> rows;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          for (auto& s : running_) rows.push_back(s.get());
        }
        for (Sequence* s : rows)
          if (!s->done) finish(*s, "error", e.what());
      }
    }
  }
}

COMB_INLINE int64_t ServeEngine::piece_tokens(const PieceRate& last) const {
  const int64_t most = options_.prefill_chunk, least = std::min<int64_t>(most, 16);
  if (options_.piece_ms <= 0) return most;
  if (last.tokens <= 0 || last.ms <= 0) return std::max<int64_t>(first_piece_, least);  // a first piece
  // A piece's time is about a fixed part (a read of every weight) plus a part per token that grows
  // with its position: scaled from the last piece, at most doubled or halved at once.
  const double scaled = static_cast<double>(last.tokens) * options_.piece_ms / last.ms;
  const double n = std::clamp(scaled, last.tokens / 2.0, last.tokens * 2.0);
  return std::clamp<int64_t>(static_cast<int64_t>(n), least, most);
}

COMB_INLINE bool ServeEngine::may_continue() const {
  if (running_.empty() || owed_ms_ <= 0 || stopping_ || options_.prefill_share <= 0) return true;
  // Work under way waits at most one full piece's worth of decoding, however many new requests'
  // first pieces keep the decoding steps owed time.
  const double cap = std::max(options_.piece_ms, 1.0) / options_.prefill_share;
  return detail::serving::seconds_since(last_continued_) * 1e3 >= cap;
}

COMB_INLINE void ServeEngine::owe_decoding(double ms) {
  // Owed whether or not a request decodes now: one that starts decoding after a piece of a long
  // prompt gets its share before the next. At most one full piece's worth.
  if (options_.prefill_share <= 0) return;
  const double cap = std::max(options_.piece_ms, ms) / options_.prefill_share;
  owed_ms_ = std::min(cap, owed_ms_ + ms / options_.prefill_share);
}

// One piece of a request's prompt: one document's cache found in the store, or piece_tokens() of
// its tokens computed (a long document takes several turns, so it never holds the decoding of
// others, and a request cancelled meanwhile stops between two pieces), then the method's start(),
// then piece_tokens() at a time; when complete, its K/V move into its blocks and its first token
// is sampled.
COMB_INLINE int64_t ServeEngine::prefill_step(Sequence& s) {
  const PicRequest& p = s.request.prompt;
  PicEngine& e = engine(s.method);
  const std::string& tenant = p.tenant.empty() ? options_.pic.tenant : p.tenant;
  int64_t computed = 0;
  if (!s.prefill) {
    if (s.document_turn()) {
      // One document's cache, pinned in memory so that start() finds it (and, for comb, every
      // decoding step after it).
      const auto& d = p.documents[s.docs_warmed];
      if (!s.document_work) {
        s.document_work = e.begin_document(d, tenant);
        if (s.document_work && mixes(s)) return 0;  // its pieces ride on the decoding steps
      }
      if (s.document_work) {
        const int64_t before = s.document_work->done;
        s.piece_asked = piece_tokens(s.rate);
        const bool complete = e.continue_document(*s.document_work, s.piece_asked);
        computed = s.document_work->done - before;
        if (!complete) return computed;
      }
      document_done(s);
      return computed;
    }
    s.prefill = std::make_unique<PicPrefill>(e.start(p, 1));
    // Documents warmed above were read back as cached (all of them, pinned; the bound is for a
    // memory tier too small to hold them, where one may have been computed twice).
    const int64_t moved = std::min(s.warm_computed, s.prefill->reused);
    s.prefill->computed += moved;
    s.prefill->reused -= moved;
    if (s.method != Method::comb) unpin_all(s);  // their K/V are in the prompt's own cache now
    if (!s.prefill->done()) return 0;
  } else {
    const int64_t before = s.prefill->cache.length();
    s.piece_asked = piece_tokens(s.rate);
    const bool complete = e.advance(*s.prefill, s.piece_asked);
    computed = s.prefill->cache.length() - before;
    if (!complete) return computed;
  }
  prefill_done(s);
  return computed;
}

COMB_INLINE void ServeEngine::document_done(Sequence& s) {
  const PicRequest& p = s.request.prompt;
  const auto& d = p.documents[s.docs_warmed];
  if (s.document_work) {
    s.document_work.reset();
    s.warm_computed += static_cast<int64_t>(d.size());
  }
  ++s.docs_warmed;
  pin(s, engine(s.method).document_key(d, p.tenant.empty() ? options_.pic.tenant : p.tenant));
}

COMB_INLINE bool ServeEngine::mixes(const Sequence& s) const {
  const bool piece_under_way = (s.prefill && !s.prefill->done()) || (s.document_work && s.document_work->decoder);
  if (!options_.mixed_step || !s.mix || !model_.decoder().paged_piece_applies() || !piece_under_way || s.done)
    return false;
  std::lock_guard<std::mutex> lock(mutex_);
  return !running_.empty();
}

COMB_INLINE void ServeEngine::prefill_done(Sequence& s) {
  PicPrefill& f = *s.prefill;
  pool_->load(f.cache, f.n_prompt, s.blocks);
  s.length = f.n_prompt;
  s.result.cached_tokens = f.reused;
  s.result.computed_tokens = f.computed;
  if (!f.documents.empty()) {
    // What its decoding steps read of them, built once: segments for the fused CPU step
    // (Documents::paged_reads), else as a forward reads them (Model::document_reads).
    s.documents = std::move(f.documents);
    s.reads = model_.decoder().cpu_kernels() ? documents_->paged_reads(s.documents)
                                             : model_.document_reads(s.documents);
  }
  at::Tensor logits = f.logits;
  s.prefill.reset();  // the prompt's own cache goes
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.prompt_tokens += s.result.prompt_tokens;
    stats_.cached_tokens += s.result.cached_tokens;
    stats_.computed_tokens += s.result.computed_tokens;
  }
  emit(s, logits);
}

// Samples the next token from `logits` and hands out what it completes; false (and the request
// finished) when it is the last.
COMB_INLINE bool ServeEngine::emit(Sequence& s, const at::Tensor& logits, int32_t picked) {
  // A prompt's first token on a GPU without log-probabilities: its argmax (or its sampling
  // candidates) read back, not the row (Sampler::sample_rows, the same token as sample()).
  if (picked < 0 && logits.is_cuda() && !s.request.logprobs)
    picked = Sampler::sample_rows({s.sampler.get()}, logits.reshape({1, -1}))[0];
  const int32_t token = picked >= 0 ? picked : s.sampler->sample(logits);
  const auto now = Sequence::clock::now();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (s.result.tokens.empty()) {
      s.result.ttft_ms = detail::serving::seconds_since(s.submitted) * 1e3;
      stats_.ttft.add(s.result.ttft_ms / 1e3);
    } else {
      stats_.inter_token.add(std::chrono::duration<double>(now - s.last_token).count());
    }
    ++stats_.generated_tokens;
  }
  s.last_token = now;
  if (!s.request.ignore_eos && std::find(stop_tokens_.begin(), stop_tokens_.end(), token) != stop_tokens_.end()) {
    finish(s, "stop");
    return false;
  }
  s.result.tokens.push_back(token);
  if (s.request.logprobs) s.result.logprobs.push_back(token_logprob(logits, token, s.request.top_logprobs));
  s.result.text += s.stream->push(token);
  std::string& text = s.result.text;
  size_t longest = 0;
  for (const auto& stop : s.request.stop) longest = std::max(longest, stop.size());
  if (longest > 0) {
    size_t from = s.emitted, cut = std::string::npos;
    for (const auto& stop : s.request.stop) {
      if (stop.empty()) continue;
      size_t at = text.find(stop, from);
      if (at != std::string::npos) cut = std::min(cut, at);
    }
    if (cut != std::string::npos) {
      text.resize(cut);
      s.stream->flush();  // an unfinished character after the stop string goes with it
      finish(s, "stop");
      return false;
    }
  }
  // Text that a stop string could still claim is held back.
  size_t safe = text.size() >= longest ? text.size() - (longest > 0 ? longest - 1 : 0) : 0;
  safe = detail::utf8_cut(text, safe);
  hand_out(s, safe);
  if (static_cast<int64_t>(s.result.tokens.size()) >= s.request.max_tokens || s.length >= model_.config().n_ctx) {
    finish(s, "length");
    return false;
  }
  s.next = token;
  return true;
}

// Gives on_text the text up to byte `upto` not handed out yet, with the log-probabilities not handed
// out; nothing when there is neither.
COMB_INLINE void ServeEngine::hand_out(Sequence& s, size_t upto) {
  upto = std::max(upto, s.emitted);
  if (upto == s.emitted && s.result.logprobs.size() == s.logprobs_sent) return;
  const std::string piece = s.result.text.substr(s.emitted, upto - s.emitted);
  std::vector<TokenLogprob> logprobs(s.result.logprobs.begin() + static_cast<std::ptrdiff_t>(s.logprobs_sent),
                                     s.result.logprobs.end());
  s.emitted = upto;
  s.logprobs_sent = s.result.logprobs.size();
  try {
    if (s.request.on_text) s.request.on_text(piece, logprobs);
  } catch (...) {  // a callback's failure is the caller's
  }
}

COMB_INLINE void ServeEngine::finish(Sequence& s, const std::string& reason, const std::string& error) {
  if (s.done) return;
  s.done = true;
  if (reason != "cancelled" && reason != "error") s.result.text += s.stream->flush();
  s.result.finish_reason = reason;
  s.result.error = error;
  s.result.total_ms = detail::serving::seconds_since(s.submitted) * 1e3;
  // Everything the request holds goes back before its callbacks run (they may fail).
  unpin_all(s);
  s.prefill.reset();
  s.reads.reset();
  s.documents = LinkedDocuments();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!s.blocks.empty()) {
      pool_->release(s.blocks);
      s.blocks.clear();
      in_flight_ -= s.reserve;
    }
    stats_.blocks_free = pool_->n_free();
    if (reason == "cancelled") ++stats_.cancelled;
    else if (reason == "error") ++stats_.failed;
    else ++stats_.finished;
  }
  if (reason != "error") hand_out(s, s.result.text.size());
  s.emitted = s.result.text.size();
  try {
    if (s.request.on_done) s.request.on_done(s.result);
  } catch (...) {  // a callback's failure is the caller's; the engine goes on
  }
}

COMB_INLINE void ServeEngine::pin(Sequence& s, const CacheKey& key) {
  if (documents_->pin(key)) s.pinned.push_back(key);  // else not in a memory tier: nothing to hold
}

COMB_INLINE void ServeEngine::unpin_all(Sequence& s) {
  for (const auto& key : s.pinned) documents_->unpin(key);
  s.pinned.clear();
}

COMB_INLINE double ServeEngine::decode_step(Sequence* rider) {
  std::vector<Sequence*> rows;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& s : running_)
      if (!s->done) rows.push_back(s.get());
  }
  if (rows.empty()) return 0;
  const auto t0 = Sequence::clock::now();
  // When every row samples greedily without log-probabilities, each row's argmax is read back (8
  // bytes a row from a GPU) instead of its logits (n_vocab floats a row: 12.6 MB at 64 rows of a
  // 49,152-token vocabulary): the tokens the sampler would pick, argmax taking the lowest index
  // among equal maxima on either device (on the CPU, the same argmax over the same values).
  const bool argmax_only = std::all_of(rows.begin(), rows.end(), [](const Sequence* s) {
    return s->sampler->greedy() && !s->request.logprobs;
  });
  at::Tensor logits;  // [rows, n_vocab]; from a GPU in one copy (or left there, argmax_only)
  int64_t computed = 0;
  bool mixed = false, complete = false;
  if (rider) {
    Sequence& s = *rider;
    // A prompt's piece, or a document's (its decoder K/V).
    auto done = [&] { return s.prefill ? s.prefill->cache.length() : s.document_work->done; };
    const int64_t before = done();
    s.piece_asked = piece_tokens(s.rate);
    const PieceForward forward = [&](const at::Tensor& tokens, KVCache& cache, const LayerReads* reads) {
      Decoder::PagedPiece piece{tokens, &cache, reads, {}};
      logits = batched_forward(rows, &piece);
      return piece.logits.view({1, 1, -1});
    };
    try {
      PicEngine& e = engine(s.method);
      complete = s.prefill ? e.advance(*s.prefill, s.piece_asked, forward)
                           : e.continue_document(*s.document_work, s.piece_asked, forward);
      computed = done() - before;
      mixed = true;
    } catch (const std::exception&) {
      // The fault may be the piece's or the rows': the rows' step runs again without it (a row's
      // K/V written again in place are the same), and the piece runs alone at its next turn (its
      // cache advances only when its forward succeeds), where its own error fails its request.
      s.mix = false;
      logits = at::Tensor();
    }
  }
  if (!logits.defined()) logits = batched_forward(rows);
  // Each row's token where no row asks for log-probabilities: the argmax of every row (8 bytes a
  // row read back), or on a GPU the sampling rows' highest tokens read back with it
  // (Sampler::sample_rows); else every row's logits on the host (from a GPU through page-locked
  // memory, one copy).
  std::vector<int32_t> picked(rows.size(), -1);
  const bool sample_on_device = !argmax_only && logits.is_cuda() &&
                                std::none_of(rows.begin(), rows.end(), [](const Sequence* s) { return s->request.logprobs; });
  if (argmax_only) {
    const at::Tensor top = logits.argmax(-1).to(at::kCPU);
    for (size_t b = 0; b < rows.size(); ++b) picked[b] = static_cast<int32_t>(top.data_ptr<int64_t>()[b]);
  } else if (sample_on_device) {
    std::vector<Sampler*> samplers;
    for (Sequence* s : rows) samplers.push_back(s->sampler.get());
    picked = Sampler::sample_rows(samplers, logits);
  } else if (logits.is_cuda()) {
    at::Tensor host = at::empty(logits.sizes(), logits.options().device(at::kCPU).pinned_memory(true));
    host.copy_(logits);
    logits = host;
  }
  double piece_ms = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const double dt = detail::serving::seconds_since(t0);
    ++stats_.decode_steps;
    stats_.decode_seconds += dt;
    stats_.batch_size.add(static_cast<double>(rows.size()));
    auto& by = stats_.steps_by_batch[static_cast<int64_t>(rows.size())];
    if (mixed) {
      ++stats_.mixed_steps;
      stats_.mixed_tokens += static_cast<uint64_t>(computed);
      if (!rider->prefill) stats_.mixed_document_tokens += static_cast<uint64_t>(computed);
      // The piece's share: the step's time beyond a plain step of as many rows, at least 5% of it
      // (all of it before a plain step is known).
      const double plain = by.first > 0 ? by.second / static_cast<double>(by.first) : 0.0;
      piece_ms = (plain > 0 ? std::max(dt - plain, 0.05 * dt) : dt) * 1e3;
    } else if (!rider) {  // a plain step's time (not one whose piece failed)
      ++by.first;
      by.second += dt;
    }
  }
  // The piece's work first: its prompt or document is complete whatever the rows' sampling does.
  if (mixed) {
    Sequence& s = *rider;
    if (computed > 0) s.started = true;
    s.rate.record(s.piece_asked, computed, piece_ms);
    if (complete) {
      try {
        if (s.prefill) prefill_done(s);
        else document_done(s);
      } catch (const std::exception& e) {
        finish(s, "error", e.what());
      }
    }
  }
  for (size_t b = 0; b < rows.size(); ++b) {
    Sequence& s = *rows[b];
    ++s.length;
    emit(s, logits[static_cast<int64_t>(b)], picked[b]);
  }
  return piece_ms;
}

// One decoding step of every row: token s.next at position s.length, K/V written into its blocks,
// computed by the decoder (Decoder::step_paged) with its documents' reads.
COMB_INLINE at::Tensor ServeEngine::batched_forward(const std::vector<Sequence*>& rows, Decoder::PagedPiece* piece) {
  std::vector<Decoder::PagedRow> paged;
  paged.reserve(rows.size());
  for (const Sequence* s : rows) paged.push_back({s->next, s->length, &s->blocks, s->reads.get()});
  return model_.decoder().step_paged(
      *pool_, paged, [this](int64_t n, const std::function<void(int64_t)>& fn) { workers_->run(n, fn); }, piece);
}

}  // namespace comb
