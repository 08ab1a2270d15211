// The store's Redis tier against a real redis-server (started here on a free loopback port, with a
// throw-away directory): sharing between stores, promotion, corrupt and foreign entries, a server
// that goes away and comes back, and writers racing on one entry.
#include "helpers.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <thread>

#include "comb/detail/redis_tier.hpp"

using namespace comb;

namespace {

// A free TCP port on the loopback interface (the kernel's pick).
int free_port() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  REQUIRE(::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  socklen_t n = sizeof(a);
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &n);
  ::close(s);
  return ntohs(a.sin_port);
}

bool port_open(int port) {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = ::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(s);
  return ok;
}

// redis-server on `port`, nothing saved, stopped (SIGTERM) by stop() or the destructor.
class RedisServer {
 public:
  explicit RedisServer(int port) : port_(port) {
    dir_ = test::temp_dir("redis-" + std::to_string(port));
    start();
  }
  ~RedisServer() {
    stop();
    test::remove_dir(dir_);
  }
  void start() {
    const std::string exe = test::env_or("COMB_REDIS_SERVER", "redis-server");
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      const std::string port = std::to_string(port_), dir = dir_, log = dir_ + "/redis.log";
      ::execlp(exe.c_str(), exe.c_str(), "--port", port.c_str(), "--bind", "127.0.0.1", "--dir", dir.c_str(),
               "--save", "", "--appendonly", "no", "--logfile", log.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 500 && !port_open(port_); ++i) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        FAIL("redis-server (" << exe << ") exited at start (status " << status
                              << "); scripts/setup.sh installs it, COMB_REDIS_SERVER names another");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    REQUIRE(port_open(port_));
  }
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_) + "/0"; }
  int port() const { return port_; }

 private:
  int port_;
  pid_t pid_ = -1;
  std::string dir_;
};

DocumentKV entry(float tag, int64_t len = 16) {
  DocumentKV kv;
  kv.n_tokens = len;
  for (int b = 0; b < 3; ++b) {
    kv.keys.push_back(at::randn({2, len, 8}) + tag);
    kv.values.push_back(at::randn({2, len, 8}) - tag);
  }
  return kv;
}
bool same(const DocumentKV& a, const DocumentKV& b) {
  if (a.n_tokens != b.n_tokens || a.keys.size() != b.keys.size()) return false;
  for (size_t i = 0; i < a.keys.size(); ++i)
    if (!a.keys[i].equal(b.keys[i]) || !a.values[i].equal(b.values[i])) return false;
  return true;
}
StoreOptions remote_store(const std::string& url, int64_t host_bytes = int64_t(1) << 26) {
  StoreOptions o;
  o.host_bytes = host_bytes;
  o.remote_url = url;
  o.remote_backoff_ms = 200;
  o.remote_timeout_ms = 300;
  return o;
}
comb::detail::RedisTierOptions raw_options(const RedisServer& server) {
  comb::detail::RedisTierOptions o;
  o.address = comb::detail::parse_redis_url(server.url());
  return o;
}
CacheKey key_of(int i, const std::string& tenant = "") { return PICacheStore::key({i, 7, 9}, "plugin-r", tenant); }

}  // namespace

TEST_CASE("a Redis URL is parsed or refused with what was expected", "[redis][errors]") {
  auto a = comb::detail::parse_redis_url("redis://:secret@cache.example:6380/3");
  CHECK(a.host == "cache.example");
  CHECK(a.port == 6380);
  CHECK(a.db == 3);
  CHECK(a.password == "secret");
  CHECK(a.text() == "cache.example:6380/3");  // no password in messages
  auto b = comb::detail::parse_redis_url("redis://10.0.0.2");
  CHECK((b.port == 6379 && b.db == 0 && b.password.empty()));
  CHECK_THROWS_WITH(comb::detail::parse_redis_url("http://h:1"), Catch::Contains("expected redis://"));
  CHECK_THROWS_WITH(comb::detail::parse_redis_url("redis://h:99999"), Catch::Contains("the port must be in [1, 65535]"));
  CHECK_THROWS_WITH(comb::detail::parse_redis_url("redis://h:x1"), Catch::Contains("the port must be a number, found 'x1'"));
  CHECK_THROWS_WITH(comb::detail::parse_redis_url("redis://user:pw@h"), Catch::Contains("a user name is not supported"));
  CHECK_THROWS_WITH(comb::detail::parse_redis_url("redis:///0"), Catch::Contains("no host"));
  StoreOptions o;
  o.remote_url = "rediss://h";
  CHECK_THROWS_WITH(PICacheStore(o), Catch::Contains("cache URL 'rediss://h'"));
  // With a disk tier too: the refusal is an exception, with no disk writer left running.
  const std::string dir = test::temp_dir("redis-bad-url");
  o.disk_dir = dir;
  o.disk_bytes = 1 << 20;
  CHECK_THROWS_WITH(PICacheStore(o), Catch::Contains("cache URL 'rediss://h'"));
  test::remove_dir(dir);
}

TEST_CASE("stores share entries through Redis; a hit is promoted into the local tiers", "[redis]") {
  RedisServer server(free_port());
  const DocumentKV kv = entry(1);
  {
    PICacheStore writer(remote_store(server.url()));
    writer.put(key_of(1), kv);
    writer.flush();
    auto s = writer.stats();
    CHECK(s.remote.bytes > kv.bytes());  // the entry and its header
    CHECK(s.remote_errors == 0);
    CHECK(s.remote_online);
  }
  const std::string dir = test::temp_dir("redis-disk");
  StoreOptions o = remote_store(server.url());
  o.disk_dir = dir;
  o.disk_bytes = int64_t(1) << 24;
  {
    PICacheStore reader(o);
    auto hit = reader.get(key_of(1));
    REQUIRE(hit);
    CHECK(same(*hit, kv));  // bit for bit
    CHECK(reader.get(key_of(2)) == nullptr);
    auto again = reader.get(key_of(1));  // now from the host tier
    REQUIRE(again);
    reader.flush();  // the disk tier's copy written
    auto s = reader.stats();
    CHECK(s.remote.hits == 1);
    CHECK(s.remote.misses == 1);
    CHECK(s.host.hits == 1);
    CHECK(s.disk.entries == 1);  // promoted to disk as well
  }
  {  // the disk copy serves a store with Redis gone
    server.stop();
    PICacheStore local(o);
    auto hit = local.get(key_of(1));
    REQUIRE(hit);
    CHECK(same(*hit, kv));
    CHECK(local.stats().disk.hits == 1);
  }
  test::remove_dir(dir);
}

TEST_CASE("int8 entries go through Redis as int8, scales included", "[redis]") {
  RedisServer server(free_port());
  const DocumentKV q = entry(1).to(at::kCPU, at::kChar);
  StoreOptions o = remote_store(server.url());
  o.dtype = at::kChar;
  {
    PICacheStore writer(o);
    writer.put(key_of(4), q);
    writer.flush();
    CHECK(writer.stats().remote.bytes == 72 + q.bytes());
  }
  PICacheStore reader(o);
  auto hit = reader.get(key_of(4));
  REQUIRE(hit);
  REQUIRE(hit->quantized());
  CHECK(same(*hit, q));
  for (size_t b = 0; b < q.keys.size(); ++b) {
    CHECK(hit->key_scales[b].equal(q.key_scales[b]));
    CHECK(hit->value_scales[b].equal(q.value_scales[b]));
  }
  CHECK(reader.stats().remote.hits == 1);
}

TEST_CASE("a corrupt, foreign or other tenant's Redis entry is never used", "[redis]") {
  RedisServer server(free_port());
  const DocumentKV kv = entry(2);
  PICacheStore writer(remote_store(server.url()));
  writer.put(key_of(3, "tenant-a"), kv);
  writer.flush();
  comb::detail::RedisTier raw(raw_options(server));
  auto bytes = raw.get("comb:kv:" + key_of(3, "tenant-a").hex());
  REQUIRE(bytes);

  SECTION("another tenant's key finds nothing") {
    PICacheStore reader(remote_store(server.url()));
    CHECK(reader.get(key_of(3, "tenant-b")) == nullptr);
    CHECK(reader.get(key_of(3)) == nullptr);
    REQUIRE(reader.get(key_of(3, "tenant-a")));
    CHECK(reader.stats().corrupt == 0);
  }
  SECTION("a flipped payload byte is detected, dropped from Redis and recomputed") {
    std::string bad = *bytes;
    bad[bad.size() - 5] ^= 0x40;
    raw.put("comb:kv:" + key_of(3, "tenant-a").hex(), bad);
    raw.flush();
    PICacheStore reader(remote_store(server.url()));
    CHECK(reader.get(key_of(3, "tenant-a")) == nullptr);
    CHECK(reader.stats().corrupt == 1);
    reader.flush();
    CHECK_FALSE(raw.get("comb:kv:" + key_of(3, "tenant-a").hex()));  // deleted
    reader.put(key_of(3, "tenant-a"), kv);  // the caller computes it again
    reader.flush();
    PICacheStore third(remote_store(server.url()));
    auto hit = third.get(key_of(3, "tenant-a"));
    REQUIRE(hit);
    CHECK(same(*hit, kv));
  }
  SECTION("an entry stored under another key's name is refused") {
    raw.put("comb:kv:" + key_of(4).hex(), *bytes);
    raw.flush();
    PICacheStore reader(remote_store(server.url()));
    CHECK(reader.get(key_of(4)) == nullptr);
    CHECK(reader.stats().corrupt == 1);
  }
  SECTION("a truncated entry is refused") {
    raw.put("comb:kv:" + key_of(5).hex(), bytes->substr(0, 40));
    raw.flush();
    PICacheStore reader(remote_store(server.url()));
    CHECK(reader.get(key_of(5)) == nullptr);
    CHECK(reader.stats().corrupt == 1);
  }
}

TEST_CASE("with Redis down the store goes on locally, and shares again once it is back", "[redis]") {
  const int port = free_port();
  auto server = std::make_unique<RedisServer>(port);
  PICacheStore store(remote_store(server->url()));
  store.put(key_of(10), entry(10));
  store.flush();
  server.reset();  // stopped mid-run

  const DocumentKV e11 = entry(11);
  auto t0 = std::chrono::steady_clock::now();
  auto stored = store.put(key_of(11), e11);  // no error: kept locally
  REQUIRE(stored);
  CHECK(store.get(key_of(12)) == nullptr);  // a miss, not an error
  store.flush();
  REQUIRE(store.get(key_of(11)));  // from the host tier
  auto s = store.stats();
  CHECK(s.remote_errors >= 1);
  CHECK(s.remote_dropped >= 1);
  CHECK_FALSE(s.remote_online);
  // Off for the back-off period: further calls do not wait for the network.
  for (int i = 20; i < 30; ++i) CHECK(store.get(key_of(i)) == nullptr);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));

  server = std::make_unique<RedisServer>(port);  // back (empty: it saved nothing); the store's
                                                 // writer still holds a connection to the old one
  std::this_thread::sleep_for(std::chrono::milliseconds(250));  // past the back-off
  const DocumentKV e13 = entry(13);
  store.put(key_of(13), e13);
  store.flush();
  CHECK(store.stats().remote_online);
  PICacheStore other(remote_store(server->url()));
  auto hit = other.get(key_of(13));
  REQUIRE(hit);
  CHECK(same(*hit, e13));
}

TEST_CASE("a Redis that was never there costs one failed connection per back-off", "[redis]") {
  StoreOptions o = remote_store("redis://127.0.0.1:" + std::to_string(free_port()));
  o.remote_backoff_ms = 60000;
  PICacheStore store(o);
  for (int i = 0; i < 5; ++i) {
    store.put(key_of(40 + i), entry(1));
    CHECK(store.get(key_of(50 + i)) == nullptr);
  }
  store.flush();
  auto s = store.stats();
  CHECK(s.remote_errors >= 1);  // the writer's connection, and the reader's if it tried first
  CHECK(s.remote_errors <= 2);
  CHECK(s.remote_dropped == 5);
  CHECK(s.host.entries == 5);
}

TEST_CASE("replicas writing one entry at once both succeed; a reader never sees half of it", "[redis][threads]") {
  RedisServer server(free_port());
  const DocumentKV kv = entry(7, 512);  // 3 blocks x 2 x 2 x 512 x 8 floats: 196 KB an entry
  PICacheStore a(remote_store(server.url())), b(remote_store(server.url()));
  std::atomic<bool> done{false};
  std::atomic<int> hits{0}, wrong{0};
  std::thread reader([&] {
    while (!done) {
      PICacheStore r(remote_store(server.url(), /*host_bytes=*/0));  // no memory tier: every get asks Redis
      for (int i = 0; i < 20; ++i)
        if (auto got = r.get(key_of(77))) same(*got, kv) ? ++hits : ++wrong;
      if (r.stats().corrupt) ++wrong;
    }
  });
  std::thread wa([&] {
    for (int i = 0; i < 30; ++i) a.put(key_of(77), kv), a.flush();
  });
  std::thread wb([&] {
    for (int i = 0; i < 30; ++i) b.put(key_of(77), kv), b.flush();
  });
  wa.join();
  wb.join();
  done = true;
  reader.join();
  CHECK(wrong == 0);
  const int64_t entry_bytes = 72 + kv.bytes();  // header and payload, as on disk
  CHECK(a.stats().remote.bytes == 30 * entry_bytes);
  CHECK(b.stats().remote.bytes == 30 * entry_bytes);
  CHECK(a.stats().remote_errors == 0);
  CHECK(b.stats().remote_errors == 0);
  PICacheStore last(remote_store(server.url()));
  auto got = last.get(key_of(77));
  REQUIRE(got);
  CHECK(same(*got, kv));
  INFO("reads that found the entry: " << hits);
}
