// The store's remote tier on Redis (hiredis): lazy connections, a back-off after any failure, and
// one writer thread behind a bounded queue.
#include "comb/detail/redis_tier.hpp"

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "comb/error.hpp"
#include "comb/log.hpp"

namespace comb::detail {

std::string RedisAddress::text() const { return fmt::format("{}:{}/{}", host, port, db); }

RedisAddress parse_redis_url(const std::string& url) {
  const std::string expected = "expected redis://[:PASSWORD@]HOST[:PORT][/DB]";
  const std::string scheme = "redis://";
  COMB_CHECK(url.compare(0, scheme.size(), scheme) == 0, "cache URL '{}': {} (only plain redis:// is supported)",
             url, expected);
  std::string rest = url.substr(scheme.size());
  RedisAddress a;
  if (auto at = rest.rfind('@'); at != std::string::npos) {
    std::string auth = rest.substr(0, at);
    rest = rest.substr(at + 1);
    COMB_CHECK(!auth.empty() && auth[0] == ':', "cache URL '{}': {} (a user name is not supported)", url, expected);
    a.password = auth.substr(1);
  }
  std::string hostport = rest, db;
  if (auto slash = rest.find('/'); slash != std::string::npos) {
    hostport = rest.substr(0, slash);
    db = rest.substr(slash + 1);
  }
  auto number = [&](const std::string& s, const char* what, long lo, long hi) {
    COMB_CHECK(!s.empty() && s.find_first_not_of("0123456789") == std::string::npos && s.size() <= 9,
               "cache URL '{}': {} must be a number, found '{}' ({})", url, what, s, expected);
    long v = std::stol(s);
    COMB_CHECK(v >= lo && v <= hi, "cache URL '{}': {} must be in [{}, {}], found {}", url, what, lo, hi, v);
    return static_cast<int>(v);
  };
  if (auto colon = hostport.rfind(':'); colon != std::string::npos) {
    a.port = number(hostport.substr(colon + 1), "the port", 1, 65535);
    hostport = hostport.substr(0, colon);
  }
  COMB_CHECK(!hostport.empty(), "cache URL '{}': no host ({})", url, expected);
  a.host = hostport;
  if (!db.empty()) a.db = number(db, "the database", 0, 1 << 20);
  return a;
}

namespace {

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

// Writing to a connection the server closed raises SIGPIPE, whose default kills the process. A
// library must not change the process's handlers: the signal is blocked in this thread around the
// call (the write then fails with EPIPE) and a SIGPIPE it raised is taken off the pending set.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~SigpipeGuard() {
    sigset_t pending;
    sigpending(&pending);
    if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
      timespec zero{0, 0};
      sigtimedwait(&pipe_, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

 private:
  sigset_t pipe_, old_;
  bool was_pending_ = false;
};

timeval to_timeval(int64_t ms) {
  timeval tv;
  tv.tv_sec = static_cast<time_t>(ms / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms % 1000) * 1000);
  return tv;
}

}  // namespace

struct RedisTier::Impl {
  RedisTierOptions options;

  // State shared by readers and the writer: the back-off and the counters.
  mutable std::mutex state_mutex;
  RedisTierStats counters;
  std::chrono::steady_clock::time_point off_until{};
  bool announced_off = false;

  // The reading connection (get() calls take turns on it).
  std::mutex read_mutex;
  redisContext* read_conn = nullptr;

  // The writer thread, its queue and its own connection.
  struct Job {
    std::string key;
    int64_t size = 0;
    std::function<std::string()> make;  // the value; null for a DEL
  };
  std::mutex queue_mutex;
  std::condition_variable queue_cv, idle_cv;
  std::deque<Job> queue;
  int64_t queued_bytes = 0;
  bool busy = false, stopping = false;
  redisContext* write_conn = nullptr;
  std::thread writer;

  bool is_off() {
    std::lock_guard<std::mutex> lock(state_mutex);
    return std::chrono::steady_clock::now() < off_until;
  }

  // Records a failure: counted always, logged once per back-off period.
  void failed(const std::string& why) {
    std::lock_guard<std::mutex> lock(state_mutex);
    ++counters.errors;
    off_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(options.backoff_ms);
    if (!announced_off) {
      announced_off = true;
      log(LogLevel::warning, "cache store: Redis at {} failed ({}); going on with the local tiers, retrying in {} ms",
          options.address.text(), why, options.backoff_ms);
    }
  }
  void succeeded() {
    std::lock_guard<std::mutex> lock(state_mutex);
    if (announced_off) {
      announced_off = false;
      log(LogLevel::warning, "cache store: Redis at {} is back", options.address.text());
    }
  }

  static bool closed_by_server(const redisContext* c) {
    if (c->err == REDIS_ERR_EOF) return true;
    if (c->err != REDIS_ERR_IO) return false;
    const std::string why = c->errstr;  // hiredis keeps strerror(errno) there
    return why == std::strerror(EPIPE) || why == std::strerror(ECONNRESET);
  }

  static void drop(redisContext*& c) {
    if (c) redisFree(c);
    c = nullptr;
  }

  // A connected context in `c` (connecting, authenticating and selecting the database if needed),
  // or false after recording why not.
  bool connect(redisContext*& c) {
    if (c) return true;
    const RedisAddress& a = options.address;
    c = redisConnectWithTimeout(a.host.c_str(), a.port, to_timeval(options.timeout_ms));
    if (!c || c->err) {
      std::string why = c ? c->errstr : "cannot allocate a connection";
      drop(c);
      failed("connect: " + why);
      return false;
    }
    redisSetTimeout(c, to_timeval(options.timeout_ms));
    auto setup = [&](Reply r) {
      if (!r) return std::string(c->errstr);
      if (r->type == REDIS_REPLY_ERROR) return std::string(r->str, r->len);
      return std::string();
    };
    std::string why;
    SigpipeGuard guard;
    if (!a.password.empty())
      why = setup(Reply(static_cast<redisReply*>(redisCommand(c, "AUTH %b", a.password.data(), a.password.size()))));
    if (why.empty() && a.db != 0) why = setup(Reply(static_cast<redisReply*>(redisCommand(c, "SELECT %d", a.db))));
    if (!why.empty()) {
      drop(c);
      failed(why);
      return false;
    }
    return true;
  }

  // Runs one command on `c`; a failed or erring command drops the connection and starts a back-off.
  // A connection kept from before that the server has closed since (a restart, an idle timeout)
  // is replaced once and the command sent again; a timeout is not retried.
  template <typename... Args>
  Reply command(redisContext*& c, const char* format, Args... args) {
    const bool reused = c != nullptr;
    if (!connect(c)) return nullptr;
    SigpipeGuard guard;
    Reply r(static_cast<redisReply*>(redisCommand(c, format, args...)));
    if (!r && reused && closed_by_server(c)) {
      drop(c);
      if (!connect(c)) return nullptr;
      r.reset(static_cast<redisReply*>(redisCommand(c, format, args...)));
    }
    if (!r) {
      std::string why = c->errstr;
      drop(c);  // a timed-out connection may still deliver the late reply: never reuse it
      failed(why);
      return nullptr;
    }
    if (r->type == REDIS_REPLY_ERROR) {
      failed(std::string(r->str, r->len));
      return nullptr;
    }
    succeeded();
    return r;
  }

  void write_loop() {
    std::unique_lock<std::mutex> lock(queue_mutex);
    for (;;) {
      queue_cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (queue.empty()) break;  // stopping, and nothing left
      Job job = std::move(queue.front());
      queue.pop_front();
      queued_bytes -= job.size;
      busy = true;
      lock.unlock();
      const bool remove = !job.make;
      bool ok = false;
      int64_t written = 0;
      if (!is_off()) {
        Reply r;
        if (remove) {
          r = command(write_conn, "DEL %b", job.key.data(), job.key.size());
        } else {
          std::string bytes;
          try {
            bytes = job.make();
          } catch (const std::exception& e) {
            log(LogLevel::warning, "cache store: an entry for Redis could not be made: {}", e.what());
          }
          if (!bytes.empty() && options.ttl_s > 0)
            r = command(write_conn, "SET %b %b EX %lld", job.key.data(), job.key.size(), bytes.data(), bytes.size(),
                        static_cast<long long>(options.ttl_s));
          else if (!bytes.empty())
            r = command(write_conn, "SET %b %b", job.key.data(), job.key.size(), bytes.data(), bytes.size());
          written = static_cast<int64_t>(bytes.size());
        }
        ok = r != nullptr;
      }
      {
        std::lock_guard<std::mutex> s(state_mutex);
        if (ok && !remove) {
          ++counters.writes;
          counters.bytes_written += written;
        } else if (!ok && !remove) {
          ++counters.dropped_writes;
        }
      }
      lock.lock();
      busy = false;
      idle_cv.notify_all();
    }
    drop(write_conn);
  }

  void enqueue(Job job) {
    {
      std::lock_guard<std::mutex> lock(queue_mutex);
      const int64_t n = job.size;
      if (!is_off() && queued_bytes + n <= options.max_queued_bytes) {
        queued_bytes += n;
        queue.push_back(std::move(job));
        queue_cv.notify_one();
        return;
      }
    }
    if (job.make) {
      std::lock_guard<std::mutex> s(state_mutex);
      ++counters.dropped_writes;
    }
  }
};

RedisTier::RedisTier(RedisTierOptions options) : impl_(std::make_unique<Impl>()) {
  COMB_CHECK(options.ttl_s >= 0, "cache TTL must be >= 0 seconds, found {}", options.ttl_s);
  COMB_CHECK(options.timeout_ms > 0, "cache timeout must be > 0 ms, found {}", options.timeout_ms);
  COMB_CHECK(options.backoff_ms >= 0, "cache back-off must be >= 0 ms, found {}", options.backoff_ms);
  impl_->options = std::move(options);
  impl_->writer = std::thread([this] { impl_->write_loop(); });
}

RedisTier::~RedisTier() {
  {
    std::lock_guard<std::mutex> lock(impl_->queue_mutex);
    impl_->stopping = true;
  }
  impl_->queue_cv.notify_all();
  impl_->writer.join();
  Impl::drop(impl_->read_conn);
}

std::optional<std::string> RedisTier::get(const std::string& key) {
  std::optional<std::string> out;
  read(key, [&](const char* data, size_t size) {
    out = std::string(data, size);
    return true;
  });
  return out;
}

bool RedisTier::read(const std::string& key, const std::function<bool(const char*, size_t)>& use) {
  bool hit = false;
  if (!impl_->is_off()) {
    Reply r;
    {
      std::lock_guard<std::mutex> lock(impl_->read_mutex);
      r = impl_->command(impl_->read_conn, "GET %b", key.data(), key.size());
    }
    if (r && r->type == REDIS_REPLY_STRING) hit = use(r->str, r->len);
  }
  std::lock_guard<std::mutex> s(impl_->state_mutex);
  ++(hit ? impl_->counters.hits : impl_->counters.misses);
  return hit;
}

void RedisTier::put(const std::string& key, std::string bytes) {
  const int64_t size = static_cast<int64_t>(bytes.size());
  auto shared = std::make_shared<std::string>(std::move(bytes));
  impl_->enqueue({key, size, [shared] { return std::move(*shared); }});
}

void RedisTier::put_lazy(const std::string& key, int64_t size, std::function<std::string()> make_bytes) {
  COMB_CHECK(make_bytes, "RedisTier::put_lazy needs a function that makes the bytes");
  impl_->enqueue({key, size, std::move(make_bytes)});
}

void RedisTier::remove(const std::string& key) { impl_->enqueue({key, 0, nullptr}); }

void RedisTier::flush() {
  std::unique_lock<std::mutex> lock(impl_->queue_mutex);
  impl_->idle_cv.wait(lock, [&] { return impl_->queue.empty() && !impl_->busy; });
}

RedisTierStats RedisTier::stats() const {
  std::lock_guard<std::mutex> s(impl_->state_mutex);
  RedisTierStats out = impl_->counters;
  out.online = std::chrono::steady_clock::now() >= impl_->off_until;
  return out;
}

const RedisTierOptions& RedisTier::options() const { return impl_->options; }

}  // namespace comb::detail
