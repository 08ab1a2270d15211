#pragma once
// A small pool of worker threads for many short parallel loops in a row (a decoding step runs a
// few hundred): workers spin between loops for a while, then sleep, so that a loop that follows
// another starts at once, and an idle pool costs nothing. OpenMP's pool, which at::parallel_for
// uses, puts its workers to sleep after a few microseconds once a process has more OpenMP threads
// than cores (a thread of its own plus the main thread's), and waking them costs more than a
// small loop takes. No LibTorch here.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace comb::detail {

class SpinPool {
 public:
  // `threads` in all: the caller of run() and threads - 1 workers.
  explicit SpinPool(int threads, std::chrono::microseconds spin = std::chrono::microseconds(300)) : spin_(spin) {
    const int workers = threads > 1 ? threads - 1 : 0;
    parked_ = std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(workers) + 1);
    for (int w = 0; w < workers; ++w) {
      parked_[w].store(0);
      workers_.emplace_back([this, w] { work(w); });
    }
  }
  ~SpinPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  SpinPool(const SpinPool&) = delete;
  SpinPool& operator=(const SpinPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i) for every i in [0, n) on the pool and the calling thread; returns when all ran
  // (rethrowing the first exception of fn, after every call ended). One caller at a time. Which
  // thread runs which i is not fixed: fn(i) must not depend on it.
  void run(int64_t n, const std::function<void(int64_t)>& fn) {
    if (n <= 0) return;
    if (workers_.empty() || n == 1) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    n_ = n;
    fn_ = &fn;
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t g = generation_.fetch_add(1) + 1;  // sequentially consistent with sleepers_ below
    if (sleepers_.load() > 0) {
      {
        std::lock_guard<std::mutex> lock(mutex_);  // a worker about to sleep sees g, or is woken
      }
      wake_.notify_all();
    }
    claim();
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) wait_a_little(spins);
    for (size_t w = 0; w < workers_.size(); ++w)  // every worker is out of this loop before the next
      for (int spins = 0; parked_[w].load(std::memory_order_acquire) != g; ++spins) wait_a_little(spins);
    if (failed_.load()) {  // the first exception of fn, once every call has ended
      failed_.store(false);
      std::exception_ptr e = std::move(error_);
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  // Spins, then lets other threads run (a worker may wait for a core the caller holds).
  static void wait_a_little(int spins) {
    if (spins < 4096) pause();
    else std::this_thread::yield();
  }

  void claim() {
    for (int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n_;) {
      try {
        (*fn_)(i);
      } catch (...) {
        bool expected = false;
        if (failed_.compare_exchange_strong(expected, true)) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void work(int w) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = generation_.load(std::memory_order_acquire);
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 0; g == seen && !stop_.load(std::memory_order_relaxed); ++spins) {
        pause();
        if ((spins & 255) == 255 && std::chrono::steady_clock::now() - start > spin_) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleepers_.fetch_add(1);  // before the last look at the generation: run() then sees it
          wake_.wait(lock, [&] { return generation_.load() != seen || stop_.load(); });
          sleepers_.fetch_sub(1);
        }
        g = generation_.load(std::memory_order_acquire);
      }
      if (stop_.load()) return;
      seen = g;
      claim();
      parked_[w].store(g, std::memory_order_release);
    }
  }

  std::vector<std::thread> workers_;
  std::unique_ptr<std::atomic<uint64_t>[]> parked_;  // per worker: the last loop it left
  std::chrono::microseconds spin_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0}, done_{0};
  int64_t n_ = 0;
  const std::function<void(int64_t)>* fn_ = nullptr;
  std::atomic<bool> stop_{false};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;  // written by the thread that set failed_, read by run() after the join
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace comb::detail
