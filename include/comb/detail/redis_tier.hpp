#pragma once
// The store's remote tier: entries (the disk tier's bytes) in a Redis server shared by replicas.
// It never fails a request: a Redis that errs or times out turns the tier off for a back-off
// period (logged once) and every call in it is a miss or a dropped write. Writes go through one
// background thread and a bounded queue, so put() never waits for the network.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace comb::detail {

struct RedisAddress {
  std::string host = "127.0.0.1";
  int port = 6379;
  int db = 0;
  std::string password;  // empty: no AUTH
  std::string text() const;  // host:port/db, without the password
};
// redis://[:PASSWORD@]HOST[:PORT][/DB]; throws comb::Error saying what was expected otherwise.
RedisAddress parse_redis_url(const std::string& url);

struct RedisTierOptions {
  RedisAddress address;
  int64_t ttl_s = 0;                           // expiry of written entries (0: none, Redis's policy evicts)
  int64_t timeout_ms = 500;                    // connect and per-command limit
  int64_t backoff_ms = 30000;                  // how long the tier stays off after a failure
  int64_t max_queued_bytes = int64_t(256) << 20;  // writes beyond it are dropped (counted)
};

struct RedisTierStats {
  int64_t hits = 0, misses = 0;
  int64_t writes = 0, bytes_written = 0;
  int64_t dropped_writes = 0;  // not written: the tier was off or the queue full
  int64_t errors = 0;          // failed connections and commands
  bool online = true;          // false during a back-off period
};

class RedisTier {
 public:
  explicit RedisTier(RedisTierOptions options);  // connects lazily, on the first call
  ~RedisTier();                                  // waits for queued writes (each bounded by the timeout)
  RedisTier(const RedisTier&) = delete;
  RedisTier& operator=(const RedisTier&) = delete;

  // The bytes stored under `key`, or nullopt on a miss, an error, or during a back-off period.
  std::optional<std::string> get(const std::string& key);
  // As get(), without a copy: `use` reads the bytes where the reply holds them (during the call
  // only) and says whether they were an entry (counted as a hit) or not (a miss). False on a miss.
  bool read(const std::string& key, const std::function<bool(const char* data, size_t size)>& use);
  // Queued; written by the background thread (SET, with EX when a TTL is set).
  void put(const std::string& key, std::string bytes);
  // As put(), with the bytes made by the background thread (`size`: what they will take, for the
  // queue's bound): the caller does not wait for the copy either.
  void put_lazy(const std::string& key, int64_t size, std::function<std::string()> make_bytes);
  void remove(const std::string& key);  // queued, like put()
  void flush();                         // returns when every queued write has been tried
  RedisTierStats stats() const;
  const RedisTierOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace comb::detail
