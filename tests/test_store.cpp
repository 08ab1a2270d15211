// PICacheStore: keys, LRU eviction, budgets, pinning, persistence, corruption, concurrency.
// LibTorch before Catch: c10 defines its own CHECK (fatal), and the later definition wins. The
// ThreadSanitizer build compiles this file without the test PCH, which has the same order.
#include "helpers.hpp"

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <unistd.h>

#define XXH_INLINE_ALL  // the disk format's checksum, without linking xxHash
#include <xxhash.h>

using namespace comb;
using namespace comb::test;
namespace fs = std::filesystem;

namespace {
// An entry whose every value is `tag`: 2 blocks of [1 kv head, len, 4].
DocumentKV entry(float tag, int64_t len = 8) {
  DocumentKV kv;
  kv.n_tokens = len;
  for (int b = 0; b < 2; ++b) {
    kv.keys.push_back(at::full({1, len, 4}, tag));
    kv.values.push_back(at::full({1, len, 4}, -tag));
  }
  return kv;
}
CacheKey key_of(int i) { return PICacheStore::key({i, i + 1, i + 2}, "plugin-a"); }
bool holds(const std::shared_ptr<const DocumentKV>& kv, float tag) {
  return kv && kv->keys[1].eq(tag).all().item<bool>() && kv->values[0].eq(-tag).all().item<bool>();
}
const int64_t kEntryBytes = entry(0).bytes();  // 2 blocks x 2 x 8 x 4 floats = 512 bytes
}  // namespace

TEST_CASE("cache keys separate documents, plug-ins and tenants", "[store]") {
  CacheKey a = PICacheStore::key({1, 2, 3}, "p1"), b = PICacheStore::key({1, 2, 3}, "p1");
  CHECK(a == b);
  CHECK_FALSE(a == PICacheStore::key({1, 2, 4}, "p1"));
  CHECK_FALSE(a == PICacheStore::key({1, 2, 3}, "p2"));
  CHECK_FALSE(a == PICacheStore::key({1, 2, 3}, "p1", "tenant-b"));
  CHECK(CacheKey::from_hex(a.hex()) == a);
  CHECK_THROWS_WITH(CacheKey::from_hex("xyz"), Catch::Contains("not a cache key"));
}

TEST_CASE("host tier evicts the least recently used unpinned entry", "[store]") {
  StoreOptions options;
  options.host_bytes = 2 * kEntryBytes;
  PICacheStore store(options);
  store.put(key_of(1), entry(1));
  store.put(key_of(2), entry(2));
  CHECK(holds(store.get(key_of(1)), 1));  // 1 is now the most recent
  store.put(key_of(3), entry(3));         // evicts 2
  CHECK(store.get(key_of(2)) == nullptr);
  CHECK(holds(store.get(key_of(1)), 1));
  CHECK(holds(store.get(key_of(3)), 3));
  auto s = store.stats();
  CHECK(s.host.evictions == 1);
  CHECK(s.host.entries == 2);
  CHECK(s.host.bytes == 2 * kEntryBytes);

  SECTION("pinned entries stay") {
    CHECK(store.pin(key_of(1)));
    CHECK(store.pin(key_of(3)));
    store.put(key_of(4), entry(4));  // no room and nothing to evict: not kept
    CHECK(store.get(key_of(4)) == nullptr);
    CHECK(holds(store.get(key_of(1)), 1));
    store.unpin(key_of(1));
    store.put(key_of(5), entry(5));
    CHECK(store.get(key_of(1)) == nullptr);
    CHECK(holds(store.get(key_of(3)), 3));
    CHECK_FALSE(store.pin(key_of(42)));
  }
  SECTION("an entry still in use survives its eviction") {
    auto held = store.get(key_of(1));
    store.put(key_of(4), entry(4));
    store.put(key_of(5), entry(5));
    CHECK(store.get(key_of(1)) == nullptr);
    CHECK(holds(held, 1));
  }
}

TEST_CASE("budgets are never exceeded", "[store]") {
  std::string dir = temp_dir("budget");
  StoreOptions options;
  options.host_bytes = 5 * kEntryBytes + 100;
  options.disk_bytes = 7 * (kEntryBytes + 72) + 10;
  options.disk_dir = dir;
  PICacheStore store(options);
  std::mt19937 rng(3);
  for (int i = 0; i < 400; ++i) {
    int k = rng() % 30;
    if (rng() % 2) store.put(key_of(k), entry(k, 4 + k % 8));
    else if (auto kv = store.get(key_of(k))) REQUIRE(holds(kv, k));
    auto s = store.stats();
    REQUIRE(s.host.bytes <= options.host_bytes);
    REQUIRE(s.disk.bytes <= options.disk_bytes);
  }
  int64_t on_disk = 0;
  for (const auto& e : fs::directory_iterator(dir)) on_disk += e.file_size();
  CHECK(on_disk <= options.disk_bytes);
  CHECK(on_disk == store.stats().disk.bytes);
  CHECK(store.stats().disk.evictions > 0);
}

TEST_CASE("the disk tier persists across stores and drops corrupt entries", "[store]") {
  std::string dir = temp_dir("disk");
  StoreOptions options;
  options.host_bytes = 0;  // disk only
  options.disk_bytes = 1 << 20;
  options.disk_dir = dir;
  {
    PICacheStore store(options);
    for (int i = 0; i < 4; ++i) store.put(key_of(i), entry(i));
  }
  PICacheStore store(options);
  CHECK(store.stats().disk.entries == 4);
  CHECK(holds(store.get(key_of(0)), 0));

  auto path = [&](int i) { return dir + "/" + key_of(i).hex() + ".kv"; };
  // Entries hold documents' K/V: readable by their owner only, whatever the umask.
  CHECK((fs::status(path(0)).permissions() & fs::perms::all) == (fs::perms::owner_read | fs::perms::owner_write));
  std::string bytes = read_bytes(path(1));
  bytes[bytes.size() - 5] ^= 0x10;  // a flipped bit in the payload
  write_bytes(path(1), bytes);
  CHECK(store.get(key_of(1)) == nullptr);
  CHECK(store.stats().corrupt == 1);
  CHECK_FALSE(fs::exists(path(1)));
  store.put(key_of(1), entry(1));  // recomputed and stored again
  CHECK(holds(store.get(key_of(1)), 1));

  bytes = read_bytes(path(2));
  write_bytes(path(2), bytes.substr(0, bytes.size() - 16));  // truncated
  CHECK(store.get(key_of(2)) == nullptr);
  bytes = read_bytes(path(3));
  bytes[20] ^= 0x01;  // header damage
  write_bytes(path(3), bytes);
  CHECK(store.get(key_of(3)) == nullptr);
  CHECK(store.stats().corrupt == 3);
  CHECK(holds(store.get(key_of(0)), 0));  // the rest is still fine
}

TEST_CASE("pins hold through replacements and full tiers; entries come in the storage dtype", "[store]") {
  StoreOptions options;
  SECTION("an entry that cannot fit beside the pinned ones evicts nothing") {
    options.host_bytes = 3 * kEntryBytes;
    PICacheStore store(options);
    for (int i = 1; i <= 3; ++i) store.put(key_of(i), entry(i));
    CHECK(store.pin(key_of(1)));
    CHECK(store.pin(key_of(2)));
    store.put(key_of(4), entry(4, 16));  // 2 entries' bytes; only 1 is not pinned
    CHECK(store.get(key_of(4)) == nullptr);
    CHECK(holds(store.get(key_of(3)), 3));
    CHECK(store.stats().host.evictions == 0);
  }
  SECTION("replacing a pinned entry keeps its pin") {
    options.host_bytes = 2 * kEntryBytes;
    PICacheStore store(options);
    store.put(key_of(1), entry(1));
    CHECK(store.pin(key_of(1)));
    store.put(key_of(1), entry(11));
    store.put(key_of(2), entry(2));
    store.put(key_of(3), entry(3));  // evicts 2, the only unpinned entry
    CHECK(holds(store.get(key_of(1)), 11));
    CHECK(store.get(key_of(2)) == nullptr);
    CHECK(holds(store.get(key_of(3)), 3));
  }
  SECTION("a disk entry written at another storage dtype is converted on its way in") {
    options.disk_bytes = 1 << 20;
    options.disk_dir = temp_dir("dtype");
    options.dtype = at::kBFloat16;
    {
      PICacheStore writer(options);
      CHECK(writer.put(key_of(1), entry(1.5))->keys[0].scalar_type() == at::kBFloat16);
    }
    for (int64_t host : {int64_t(1) << 20, int64_t(0)}) {  // with and without a memory tier
      options.dtype = at::kFloat;
      options.host_bytes = host;
      PICacheStore reader(options);
      auto kv = reader.get(key_of(1));
      REQUIRE(kv);
      CHECK(kv->keys[0].scalar_type() == at::kFloat);
      CHECK(kv->values[1].scalar_type() == at::kFloat);
      CHECK(holds(kv, 1.5));
    }
  }
  SECTION("a disk header whose sizes wrap around is a corrupt entry, not a crash") {
    options.host_bytes = 0;
    options.disk_bytes = 1 << 20;
    options.disk_dir = temp_dir("wrap");
    PICacheStore store(options);
    store.put(key_of(1), entry(1));
    const std::string path = options.disk_dir + "/" + key_of(1).hex() + ".kv";
    // The documented header (docs/formats.md): 1 block of 1 head x (2^62 + 1) tokens x 1 float,
    // whose byte count wraps to 4 per tensor, with a matching 8-byte payload and checksum.
    std::string bytes = read_bytes(path).substr(0, 72) + std::string(8, '\x01');
    auto put32 = [&](size_t at, uint32_t v) { std::memcpy(&bytes[at], &v, 4); };
    auto put64 = [&](size_t at, uint64_t v) { std::memcpy(&bytes[at], &v, 8); };
    put32(12, 0);                                      // float32
    put32(16, 1), put32(20, 1), put32(24, 1);          // n_blocks, n_head_kv, head_dim
    put64(32, (uint64_t(1) << 62) + 1), put64(40, 8);  // n_tokens, payload_bytes
    put64(48, XXH3_64bits(bytes.data() + 72, 8));
    write_bytes(path, bytes);
    CHECK(store.get(key_of(1)) == nullptr);
    CHECK(store.stats().corrupt == 1);
    CHECK_FALSE(fs::exists(path));
  }
}

TEST_CASE("a cache directory that cannot be written is a clear error; the store stays usable", "[store][errors]") {
  std::string dir = temp_dir("nowrite");
  write_bytes(dir + "/file", "x");
  StoreOptions options;
  options.disk_bytes = 1 << 20;
  options.disk_dir = dir + "/file/cache";
  CHECK_THROWS_WITH(PICacheStore(options), Catch::Contains("cache directory") && Catch::Contains("file/cache"));
  if (::geteuid() != 0) {
    fs::create_directories(dir + "/ro");
    fs::permissions(dir + "/ro", fs::perms::owner_read | fs::perms::owner_exec);
    options.disk_dir = dir + "/ro";
    CHECK_THROWS_WITH(PICacheStore(options), Catch::Contains("not writable"));
  }
  // The directory disappears under a running store: writes fail, memory keeps working.
  options.disk_dir = dir + "/gone";
  PICacheStore store(options);
  fs::remove_all(dir + "/gone");
  write_bytes(dir + "/gone", "now a file");
  store.put(key_of(1), entry(1));
  CHECK(store.stats().write_errors == 1);
  CHECK(holds(store.get(key_of(1)), 1));
  options.dtype = at::kDouble;
  CHECK_THROWS_WITH(PICacheStore(options), Catch::Contains("float32, bfloat16 or float16"));
}

TEST_CASE("concurrent get and put from several threads", "[store][threads]") {
  std::string dir = temp_dir("threads");
  StoreOptions options;
  options.host_bytes = 6 * kEntryBytes;
  options.disk_bytes = 10 * (kEntryBytes + 72);
  options.disk_dir = dir;
  PICacheStore store(options);
  std::atomic<int> wrong{0}, hits{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 300; ++i) {
        int k = rng() % 16;
        if (rng() % 3 == 0) {
          store.put(key_of(k), entry(k));
        } else if (auto kv = store.get(key_of(k))) {
          ++hits;
          if (!holds(kv, k)) ++wrong;
        }
        if (rng() % 50 == 0) store.pin(key_of(k)), store.unpin(key_of(k));
      }
    });
  for (auto& th : threads) th.join();
  CHECK(wrong == 0);
  CHECK(hits > 0);
  auto s = store.stats();
  CHECK(s.host.bytes <= options.host_bytes);
  CHECK(s.disk.bytes <= options.disk_bytes);
  CHECK(s.corrupt == 0);
}

TEST_CASE("the device tier demotes to host memory and promotes back (CUDA)", "[store][cuda]") {
  if (!comb::cuda_available()) {
    WARN("no CUDA device: the device tier is not checked here");
    return;
  }
  StoreOptions options;
  options.device = c10::Device(c10::kCUDA, 0);
  options.device_bytes = 2 * kEntryBytes;
  options.host_bytes = 4 * kEntryBytes;
  PICacheStore store(options);
  for (int i = 0; i < 3; ++i) store.put(key_of(i), entry(i));
  auto s = store.stats();
  CHECK(s.device.entries == 2);
  CHECK(s.host.entries == 1);  // the least recently used went down a tier
  auto kv = store.get(key_of(0));
  REQUIRE(kv);
  CHECK(kv->keys[0].is_cuda());
  CHECK(holds(std::make_shared<const DocumentKV>(kv->to(c10::kCPU, at::kFloat)), 0));
}
