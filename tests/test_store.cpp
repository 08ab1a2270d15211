// PICacheStore: keys, LRU eviction, budgets, pinning, persistence, corruption, concurrency.
// LibTorch before Catch: c10 defines its own CHECK (fatal), and the later definition wins. The
// ThreadSanitizer build compiles this file without the test PCH, which has the same order.
#include "helpers.hpp"

#include "comb/detail/decode_step.hpp"
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <filesystem>
#include <fstream>
#include <thread>
#include <tuple>
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
DocumentKV random_entry(int64_t len, uint64_t seed);
CacheKey key_of(int i) { return PICacheStore::key({i, i + 1, i + 2}, "plugin-a"); }
bool holds(const std::shared_ptr<const DocumentKV>& kv, float tag) {
  return kv && kv->keys[1].eq(tag).all().item<bool>() && kv->values[0].eq(-tag).all().item<bool>();
}
const int64_t kEntryBytes = entry(0).bytes();  // 2 blocks x 2 x 8 x 4 floats = 512 bytes
// Writes a disk entry's bytes to `path` with the checksum (header bytes 48-55) made right for its
// payload (after the 72-byte header), so that a reader gets past the checksum to what was changed.
void write_sealed(const std::string& path, std::string bytes) {
  const uint64_t sum = XXH3_64bits(bytes.data() + 72, bytes.size() - 72);
  std::memcpy(&bytes[48], &sum, 8);
  write_bytes(path, bytes);
}
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
  store.flush();  // every queued disk write made
  CHECK(store.stats().disk_queued == 0);
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

TEST_CASE("the disk tier is written in the background: queued entries are found, the queue is bounded, "
          "flush and the destructor write every one", "[store]") {
  StoreOptions options;
  options.host_bytes = 0;  // disk only: an entry not yet written is found in the queue or nowhere
  options.disk_bytes = 1 << 20;
  const int64_t file_bytes = 72 + kEntryBytes;
  auto path = [&](int i) { return options.disk_dir + "/" + key_of(i).hex() + ".kv"; };
  SECTION("get() finds every entry at once, queued or written; flush() writes them all") {
    options.disk_dir = temp_dir("queued");
    PICacheStore store(options);
    for (int i = 0; i < 6; ++i) store.put(key_of(i), entry(i));
    for (int i = 0; i < 6; ++i) CHECK(holds(store.get(key_of(i)), i));
    StoreStats s = store.stats();
    CHECK(s.disk.hits == 6);
    CHECK(s.disk.misses == 0);
    CHECK(s.disk.bytes <= options.disk_bytes);
    store.flush();
    s = store.stats();
    CHECK(s.disk_queued == 0);
    CHECK(s.disk.entries == 6);
    CHECK(s.disk.bytes == 6 * file_bytes);
    CHECK(s.write_errors == 0);
    for (int i = 0; i < 6; ++i) CHECK(int64_t(fs::file_size(path(i))) == file_bytes);
  }
  SECTION("the destructor writes what is queued") {
    options.disk_dir = temp_dir("drained");
    {
      PICacheStore store(options);
      for (int i = 0; i < 5; ++i) store.put(key_of(i), entry(i, 64));
    }
    PICacheStore reopened(options);
    CHECK(reopened.stats().disk.entries == 5);
    for (int i = 0; i < 5; ++i) CHECK(holds(reopened.get(key_of(i)), i));
  }
  SECTION("a queue of 0 bytes: put() returns once its entry is on disk") {
    options.disk_dir = temp_dir("queue0");
    options.disk_queue_bytes = 0;
    PICacheStore store(options);
    for (int i = 0; i < 4; ++i) {
      store.put(key_of(i), entry(i));
      CHECK(int64_t(fs::file_size(path(i))) == file_bytes);
      CHECK(store.stats().disk_queued == 0);
      CHECK(store.stats().disk.entries == i + 1);
    }
  }
  SECTION("a queue of one entry's bytes holds at most one entry after put() returns") {
    options.disk_dir = temp_dir("queue1");
    options.disk_queue_bytes = file_bytes;
    PICacheStore store(options);
    for (int i = 0; i < 12; ++i) {
      store.put(key_of(i), entry(i));
      CHECK(store.stats().disk_queued <= 1);
    }
    store.flush();
    CHECK(store.stats().disk.entries == 12);
  }
  SECTION("callers take turns: threads putting into a one-entry queue, one entry over the bound, all written") {
    options.disk_dir = temp_dir("queue-turns");
    options.disk_queue_bytes = file_bytes;
    PICacheStore store(options);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&, t] {
        for (int i = 0; i < 10; ++i) store.put(key_of(100 * t + i), entry(t + i));
        if (t == 0) store.put(key_of(1000), entry(7, 64));  // 8x the bound: waits for an empty queue, in turn
      });
    for (auto& th : threads) th.join();
    store.flush();
    const StoreStats s = store.stats();
    CHECK(s.disk.entries == 41);
    CHECK(s.disk_queued == 0);
    CHECK(s.write_errors == 0);
    CHECK(holds(store.get(key_of(1000)), 7));
  }
  SECTION("an entry larger than the disk budget is not queued") {
    options.disk_dir = temp_dir("too-big");
    options.disk_bytes = file_bytes - 1;
    PICacheStore store(options);
    store.put(key_of(1), entry(1));
    CHECK(store.stats().disk_queued == 0);
    CHECK(store.get(key_of(1)) == nullptr);
    store.flush();
    CHECK(store.stats().disk.entries == 0);
    CHECK(store.stats().write_errors == 0);
  }
  SECTION("a negative queue is refused") {
    options.disk_dir = temp_dir("queue-negative");
    options.disk_queue_bytes = -1;
    CHECK_THROWS_WITH(PICacheStore(options), Catch::Contains("queue must be >= 0 bytes, found -1"));
  }
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
  SECTION("dtype auto (the default) keeps each entry in the dtype it came in, on disk and back") {
    REQUIRE(options.dtype == c10::ScalarType::Undefined);
    options.disk_bytes = 1 << 20;
    options.disk_dir = temp_dir("auto");
    {
      PICacheStore store(options);
      CHECK(store.put(key_of(1), entry(1.5))->keys[0].scalar_type() == at::kFloat);
      CHECK(store.put(key_of(2), entry(2.5).to(at::kCPU, at::kBFloat16))->keys[0].scalar_type() == at::kBFloat16);
      const DocumentKV q = random_entry(40, 3).to(at::kCPU, at::kChar);
      auto stored = store.put(key_of(3), q);
      CHECK(stored->quantized());
      CHECK(store.stats().host.bytes == kEntryBytes + kEntryBytes / 2 + q.bytes());  // each at its own size
    }
    options.host_bytes = 0;  // from disk: the same dtypes
    PICacheStore reader(options);
    CHECK(reader.get(key_of(1))->keys[0].scalar_type() == at::kFloat);
    CHECK(holds(reader.get(key_of(1)), 1.5));
    CHECK(reader.get(key_of(2))->keys[0].scalar_type() == at::kBFloat16);
    CHECK(holds(reader.get(key_of(2)), 2.5));
    CHECK(reader.get(key_of(3))->quantized());
  }
  SECTION("a disk header whose sizes wrap around is a corrupt entry, not a crash") {
    options.host_bytes = 0;
    options.disk_bytes = 1 << 20;
    options.disk_dir = temp_dir("wrap");
    PICacheStore store(options);
    store.put(key_of(1), entry(1));
    store.flush();
    const std::string path = options.disk_dir + "/" + key_of(1).hex() + ".kv";
    // The documented header (docs/formats.md): 1 block of 1 head x (2^62 + 1) tokens x 1 float,
    // whose byte count wraps to 4 per tensor, with a matching 8-byte payload and checksum.
    std::string bytes = read_bytes(path).substr(0, 72) + std::string(8, '\x01');
    auto put32 = [&](size_t at, uint32_t v) { std::memcpy(&bytes[at], &v, 4); };
    auto put64 = [&](size_t at, uint64_t v) { std::memcpy(&bytes[at], &v, 8); };
    put32(12, 0);                                      // float32
    put32(16, 1), put32(20, 1), put32(24, 1);          // n_blocks, n_head_kv, head_dim
    put64(32, (uint64_t(1) << 62) + 1), put64(40, 8);  // n_tokens, payload_bytes
    write_sealed(path, bytes);
    CHECK(store.get(key_of(1)) == nullptr);
    CHECK(store.stats().corrupt == 1);
    CHECK_FALSE(fs::exists(path));
  }
}

namespace {
// Random K/V with an outlier key channel, as real keys have: 3 blocks of [2 kv heads, len, 16].
DocumentKV random_entry(int64_t len, uint64_t seed) {
  at::manual_seed(seed);
  DocumentKV kv;
  kv.n_tokens = len;
  for (int b = 0; b < 3; ++b) {
    at::Tensor k = at::randn({2, len, 16});
    k.select(2, 5).mul_(20);  // one channel 20x the others
    kv.keys.push_back(k);
    kv.values.push_back(at::randn({2, len, 16}));
  }
  return kv;
}
// int4 key scales coded as DocumentKV's header describes it, by plain loops: for float16 scales per
// channel [heads, 1, d] and a mask of all-zero channels, the coded bytes [heads, 1, 2 + d / 2] and
// the float16 scales they stand for.
std::pair<at::Tensor, at::Tensor> coded_scales_reference(const at::Tensor& scales, const at::Tensor& zero) {
  const int64_t heads = scales.size(0), d = scales.size(2);
  at::Tensor bytes = at::zeros({heads, 1, 2 + d / 2}, at::kByte), used = at::empty({heads, 1, d}, at::kHalf);
  for (int64_t h = 0; h < heads; ++h) {
    float top = 0;
    for (int64_t j = 0; j < d; ++j)
      if (!zero[h][0][j].item<bool>()) top = std::max(top, scales[h][0][j].item<float>());
    const at::Half big(top > 0 ? top : 1.0f);
    bytes[h][0][0] = int(big.x & 0xff), bytes[h][0][1] = int(big.x >> 8);
    for (int64_t j = 0; j < d; ++j) {
      int e = 15;
      if (!zero[h][0][j].item<bool>())
        for (e = 0; e < 15; ++e)  // the last step at least the scale: the next one is under it
          if (float(at::Half(float(big) * kInt4ScaleSteps[e + 1])) < scales[h][0][j].item<float>()) break;
      used[h][0][j] = float(at::Half(float(big) * kInt4ScaleSteps[e]));
      bytes[h][0][2 + j / 2] = bytes[h][0][2 + j / 2].item<int>() | (j % 2 == 0 ? e : e << 4);
    }
  }
  return {bytes, used};
}

// Rotated keys [heads, n, d] coded centred as DocumentKV's header describes it, by plain loops
// (std::nearbyint for rounding): the int8 codes in [-8, 7] and the coded scales with the centres
// [heads, 1, 2 + d / 2 + d].
std::pair<at::Tensor, at::Tensor> centred_reference(const at::Tensor& x) {
  const int64_t heads = x.size(0), n = x.size(1), d = x.size(2);
  at::Tensor s = at::empty({heads, 1, d}, at::kHalf), zero = at::empty({heads, 1, d}, at::kBool);
  std::vector<float> mid(heads * d);
  auto a = x.accessor<float, 3>();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < d; ++j) {
      float lo = a[h][0][j], hi = a[h][0][j];
      for (int64_t t = 1; t < n; ++t) lo = std::min(lo, a[h][t][j]), hi = std::max(hi, a[h][t][j]);
      mid[h * d + j] = (lo + hi) * 0.5f;
      const float w = std::max((hi - lo) / 15.0f, std::fabs(mid[h * d + j]) / 127.0f);
      at::Half scale(w > 0 ? std::min(std::max(w, 6.103515625e-05f), 65504.0f) : 1.0f);
      if (float(scale) < w && float(scale) < 65504.0f) scale.x += 1;  // rounded up to float16
      s[h][0][j] = float(scale);
      zero[h][0][j] = !(w > 0);
    }
  auto [bytes, used] = coded_scales_reference(s, zero);
  at::Tensor centres = at::empty({heads, 1, d}, at::kChar), q = at::empty({heads, n, d}, at::kChar);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < d; ++j) {
      const float sc = used[h][0][j].item<float>();
      const float m = std::min(127.0f, std::max(-127.0f, std::nearbyint(mid[h * d + j] / sc + 0.5f)));
      centres[h][0][j] = int(m);
      for (int64_t t = 0; t < n; ++t) q[h][t][j] = int(std::min(7.0f, std::max(-8.0f, std::nearbyint(a[h][t][j] / sc - m))));
    }
  return {q, at::cat({bytes, centres.view(at::kByte)}, -1)};
}

// Largest error of `q` (read back as float32) against `kv`, relative to each tensor's largest value.
double relative_error(const DocumentKV& q, const DocumentKV& kv) {
  DocumentKV back = q.to(at::kCPU, at::kFloat);
  double worst = 0;
  for (size_t b = 0; b < kv.keys.size(); ++b)
    for (auto [x, y] : {std::pair{&back.keys[b], &kv.keys[b]}, std::pair{&back.values[b], &kv.values[b]}})
      worst = std::max(worst, ((*x - *y).abs().amax() / y->abs().amax()).item<double>());
  return worst;
}
}  // namespace

namespace {
int aten_calls = 0;  // operations seen by count_aten
std::unique_ptr<at::ObserverContext> count_aten(const at::RecordFunction&) {
  ++aten_calls;
  return nullptr;
}
}  // namespace

TEST_CASE("an entry already on the device and in the dtype asked for is itself, without an operation", "[store]") {
  c10::InferenceMode guard;
  auto gen = at::detail::createCPUGenerator(5);
  DocumentKV kv;
  kv.n_tokens = 6;
  for (int b = 0; b < 3; ++b) {
    kv.keys.push_back(at::randn({2, 6, 16}, gen));
    kv.values.push_back(at::randn({2, 6, 16}, gen));
  }
  const DocumentKV int8 = kv.to(at::kCPU, at::kChar);
  REQUIRE(int8.quantized());
  for (const DocumentKV* e : {static_cast<const DocumentKV*>(&kv), &int8}) {
    aten_calls = 0;
    auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback(count_aten).needsInputs(false));
    const DocumentKV same = e->to(at::kCPU, e->dtype());
    at::removeCallback(handle);
    CHECK(aten_calls == 0);
    CHECK(same.n_tokens == e->n_tokens);
    for (size_t b = 0; b < e->keys.size(); ++b) {
      CHECK(same.keys[b].is_same(e->keys[b]));
      CHECK(same.values[b].is_same(e->values[b]));
      if (e->quantized()) CHECK(same.key_scales[b].is_same(e->key_scales[b]));
      if (e->quantized()) CHECK(same.value_scales[b].is_same(e->value_scales[b]));
    }
  }
  // Anything else still converts: another dtype, a part not contiguous, parts of two dtypes.
  const DocumentKV bf16 = kv.to(at::kCPU, at::kBFloat16);
  CHECK(bf16.keys[1].scalar_type() == at::kBFloat16);
  CHECK(bf16.values[2].scalar_type() == at::kBFloat16);
  DocumentKV strided = kv;
  strided.keys[1] = at::randn({2, 16, 6}, gen).transpose(1, 2);
  const DocumentKV made = strided.to(at::kCPU, at::kFloat);
  CHECK(made.keys[1].is_contiguous());
  CHECK(at::equal(made.keys[1], strided.keys[1]));
  CHECK(made.keys[0].is_same(kv.keys[0]));  // (a contiguous part in the same dtype is still itself)
  DocumentKV mixed = kv;
  mixed.values[2] = mixed.values[2].to(at::kBFloat16);
  const DocumentKV evened = mixed.to(at::kCPU, at::kFloat);
  CHECK(evened.values[2].scalar_type() == at::kFloat);
}

TEST_CASE("int8 entries: keys scaled per channel (per row when short), values per row; kept through disk, sizes counted",
          "[store]") {
  const DocumentKV kv = random_entry(40, 7);
  const DocumentKV q = kv.to(at::kCPU, at::kChar);
  REQUIRE(q.quantized());
  CHECK(q.dtype() == at::kChar);
  CHECK(q.keys[0].scalar_type() == at::kChar);
  CHECK(q.key_scales[0].sizes() == at::IntArrayRef({2, 1, 16}));
  CHECK(q.key_scales[0].scalar_type() == at::kHalf);
  CHECK(q.value_scales[0].scalar_type() == at::kHalf);
  CHECK(q.value_scales[0].sizes() == at::IntArrayRef({2, 40, 1}));
  // Every element within half a step of its scale: |x - q s| <= s / 2.
  DocumentKV back = q.to(at::kCPU, at::kFloat);
  for (size_t b = 0; b < 3; ++b) {
    CHECK(((back.keys[b] - kv.keys[b]).abs() <= q.key_scales[b].to(at::kFloat) * 0.5001).all().item<bool>());
    CHECK(((back.values[b] - kv.values[b]).abs() <= q.value_scales[b].to(at::kFloat) * 0.5001).all().item<bool>());
  }
  CHECK(relative_error(q, kv) < 0.01);
  // Per channel keeps the small key channels: with one scale per row they would lose most of their
  // resolution to the outlier channel. Measured on the small channels only.
  at::Tensor small = at::ones({16}, at::kBool);
  small[5] = false;
  at::Tensor k = kv.keys[0].index({at::indexing::Slice(), at::indexing::Slice(), small});
  at::Tensor kq = back.keys[0].index({at::indexing::Slice(), at::indexing::Slice(), small});
  at::Tensor row_scale = kv.keys[0].abs().amax(2, true) / 127;
  at::Tensor k_row = (kv.keys[0] / row_scale).round() * row_scale;
  at::Tensor kr = k_row.index({at::indexing::Slice(), at::indexing::Slice(), small});
  CHECK((kq - k).abs().mean().item<double>() < 0.25 * (kr - k).abs().mean().item<double>());
  // Bytes: one per element, a float16 scale per key channel and per value row.
  const int64_t expected = 3 * (2 * 2 * 40 * 16 + 2 * 2 * 16 + 2 * 2 * 40);
  CHECK(q.bytes() == expected);
  CHECK(DocumentKV::storage_bytes(at::kChar, 3, 2, 16, 40) == expected);
  CHECK(DocumentKV::storage_bytes(at::kFloat, 3, 2, 16, 40) == 3 * 2 * 2 * 40 * 16 * 4);
  // Under head_dim / 2 tokens, keys are scaled per row: per-channel scales would cost more a
  // token than the row's (here 16 scales for 4 rows).
  const DocumentKV short_kv = random_entry(4, 8);
  const DocumentKV short_q = short_kv.to(at::kCPU, at::kChar);
  CHECK(short_q.key_scales[0].sizes() == at::IntArrayRef({2, 4, 1}));
  CHECK(short_q.bytes() == 3 * (2 * 2 * 4 * 16 + 2 * 2 * 4 + 2 * 2 * 4));
  CHECK(DocumentKV::storage_bytes(at::kChar, 3, 2, 16, 4) == short_q.bytes());
  CHECK(DocumentKV::keys_per_channel(8, 16));
  CHECK_FALSE(DocumentKV::keys_per_channel(7, 16));
  CHECK_FALSE(DocumentKV::keys_per_channel(7, 16, kCacheInt8Int4));  // int8 keys: int8's rule
  CHECK(DocumentKV::keys_per_channel(1, 16, kCacheInt4));            // rotated int4 keys: always
  // int4 under head_dim tokens: per head a float16 scale and 4 bits a channel for the keys.
  CHECK(DocumentKV::storage_bytes(kCacheInt4, 3, 2, 16, 4) == 3 * (2 * 4 * 8 * 2 + 2 * (2 + 8) + 2 * 2 * 4));
  // From head_dim tokens on: those and an int8 centre a channel.
  CHECK(DocumentKV::storage_bytes(kCacheInt4, 3, 2, 16, 16) == 3 * (2 * 16 * 8 * 2 + 2 * (2 + 8 + 16) + 2 * 2 * 16));
  CHECK(DocumentKV::storage_bytes(at::kFloat, 3, 2, 16, 40) == 3 * 2 * 2 * 40 * 16 * 4);
  // int8 again is the same codes; zeros stay zeros (scale 1, no division by zero).
  CHECK(q.to(at::kCPU, at::kChar).keys[1].equal(q.keys[1]));
  DocumentKV zeros = kv;
  zeros.values[0] = at::zeros_like(kv.values[0]);
  DocumentKV zq = zeros.to(at::kCPU, at::kChar);
  CHECK(zq.value_scales[0].eq(1).all().item<bool>());
  CHECK(zq.to(at::kCPU, at::kFloat).values[0].eq(0).all().item<bool>());
  // The one-pass CPU quantizer gives exactly the codes and scales of the tensor ops: float16 scales
  // of amax / 127 (1 for a zero channel or row, at least 2^-14), round half to even, clamp.
  DocumentKV tiny = kv;
  tiny.keys[2] = kv.keys[2] * 1e-6;  // scales under float16's smallest normal
  for (const DocumentKV* entry : std::vector<const DocumentKV*>{&kv, &zeros, &short_kv, &tiny})
    for (size_t b = 0; b < 3; ++b) {
      const int dim = entry->n_tokens >= 8 ? 1 : 2;
      auto scales = [](const at::Tensor& amax) {
        at::Tensor s = amax / 127.0;
        return at::where(s > 0, s.clamp_min(6.103515625e-05), at::ones_like(s)).to(at::kHalf).to(at::kFloat);
      };
      at::Tensor ks = scales(entry->keys[b].abs().amax(dim, true)), vs = scales(entry->values[b].abs().amax(2, true));
      const DocumentKV got = entry->to(at::kCPU, at::kChar);
      CHECK(got.key_scales[b].to(at::kFloat).equal(ks));
      CHECK(got.value_scales[b].to(at::kFloat).equal(vs));
      CHECK(got.keys[b].equal((entry->keys[b] / ks).round().clamp(-127, 127).to(at::kChar)));
      CHECK(got.values[b].equal((entry->values[b] / vs).round().clamp(-127, 127).to(at::kChar)));
    }
  CHECK(tiny.to(at::kCPU, at::kChar).key_scales[2].gt(0).all().item<bool>());
  // Ties round to even, as the tensor ops do: 0.5 and 2.5 steps become 0 and 2.
  DocumentKV ties = kv;
  ties.keys[0] = at::zeros_like(kv.keys[0]);
  ties.keys[0].select(1, 0).fill_(127.0f);  // channel scales 1
  ties.keys[0].select(1, 1).fill_(0.5f);
  ties.keys[0].select(1, 2).fill_(2.5f);
  const DocumentKV tq = ties.to(at::kCPU, at::kChar);
  CHECK(tq.key_scales[0].eq(1).all().item<bool>());
  CHECK(tq.keys[0].select(1, 1).eq(0).all().item<bool>());
  CHECK(tq.keys[0].select(1, 2).eq(2).all().item<bool>());

  SECTION("a store of int8 holds int8 in memory and on disk, and a float32 store reads it back") {
    StoreOptions options;
    options.dtype = at::kChar;
    options.disk_bytes = 1 << 20;
    options.disk_dir = temp_dir("int8");
    {
      PICacheStore writer(options);
      auto stored = writer.put(key_of(1), kv);
      REQUIRE(stored->quantized());
      CHECK(stored->keys[0].equal(q.keys[0]));
      CHECK(writer.stats().host.bytes == expected);
      writer.flush();
      // The disk file: the 72-byte header and exactly the entry's bytes.
      CHECK(int64_t(fs::file_size(options.disk_dir + "/" + key_of(1).hex() + ".kv")) == 72 + expected);
    }
    options.host_bytes = 0;  // from disk, as int8
    {
      PICacheStore reader(options);
      auto hit = reader.get(key_of(1));
      REQUIRE(hit);
      REQUIRE(hit->quantized());
      for (size_t b = 0; b < 3; ++b) {
        CHECK(hit->keys[b].equal(q.keys[b]));
        CHECK(hit->values[b].equal(q.values[b]));
        CHECK(hit->key_scales[b].equal(q.key_scales[b]));
        CHECK(hit->value_scales[b].equal(q.value_scales[b]));
      }
    }
    // An entry with float32 scales (dtype 3, as comb wrote int8 before) is read back with its
    // scales as they were; a short one's per-row keys too.
    DocumentKV old = q;
    for (size_t b = 0; b < 3; ++b) {
      old.key_scales[b] = kv.keys[b].abs().amax(1, true) / 127.0;
      old.keys[b] = (kv.keys[b] / old.key_scales[b]).round().clamp(-127, 127).to(at::kChar);
      old.value_scales[b] = kv.values[b].abs().amax(2, true) / 127.0;
      old.values[b] = (kv.values[b] / old.value_scales[b]).round().clamp(-127, 127).to(at::kChar);
    }
    options.host_bytes = 1 << 20;
    {
      PICacheStore writer(options);
      writer.put(key_of(2), old);
      writer.put(key_of(3), short_q);
    }
    options.host_bytes = 0;
    {
      PICacheStore reader(options);
      auto hit = reader.get(key_of(2));
      REQUIRE(hit);
      CHECK(hit->key_scales[1].sizes() == at::IntArrayRef({2, 1, 16}));
      CHECK(hit->key_scales[1].scalar_type() == at::kFloat);
      CHECK(hit->key_scales[1].equal(old.key_scales[1]));
      CHECK(hit->keys[1].equal(old.keys[1]));
      CHECK(hit->value_scales[1].equal(old.value_scales[1]));
      auto short_hit = reader.get(key_of(3));
      REQUIRE(short_hit);
      CHECK(short_hit->key_scales[0].equal(short_q.key_scales[0]));
      CHECK(short_hit->keys[2].equal(short_q.keys[2]));
      CHECK(short_hit->value_scales[2].equal(short_q.value_scales[2]));
    }
    options.dtype = at::kFloat;
    options.host_bytes = 1 << 20;
    PICacheStore reader(options);
    auto hit = reader.get(key_of(1));
    REQUIRE(hit);
    CHECK_FALSE(hit->quantized());
    CHECK(hit->keys[0].scalar_type() == at::kFloat);
    CHECK(hit->keys[2].equal(back.keys[2]));
    auto old_hit = reader.get(key_of(2));
    REQUIRE(old_hit);
    CHECK((old_hit->keys[0] - old.keys[0].to(at::kFloat) * old.key_scales[0]).abs().max().item<double>() == 0);
  }
  SECTION("an int8 file whose scale is not a positive number is a corrupt entry") {
    StoreOptions options;
    options.dtype = at::kChar;
    options.host_bytes = 0;
    options.disk_bytes = 1 << 20;
    options.disk_dir = temp_dir("int8-bad");
    PICacheStore store(options);
    store.put(key_of(2), kv);
    store.flush();
    const std::string path = options.disk_dir + "/" + key_of(2).hex() + ".kv";
    std::string bytes = read_bytes(path);
    // Block 0's first key scale, after its K and V codes, made -1 (and the checksum made right).
    const float bad = -1;
    std::memcpy(&bytes[72 + 2 * 2 * 40 * 16], &bad, 4);
    write_sealed(path, bytes);
    CHECK(store.get(key_of(2)) == nullptr);
    CHECK(store.stats().corrupt == 1);
  }
  SECTION("the linker reads int8 entries as float32") {
    auto entry_q = std::make_shared<const DocumentKV>(q);
    LinkedDocuments linked = Linker(at::kCPU).link({entry_q});
    CHECK(linked.keys[1][0].scalar_type() == at::kFloat);
    CHECK(linked.keys[1][0].equal(back.keys[1]));
    CHECK(linked.values[2][0].equal(back.values[2]));
  }
}

TEST_CASE("int4 forms (int4, int8-int4): int8's scales for codes in [-7, 7], two a byte; kept through memory and "
          "disk, sizes counted, read as int8 codes",
          "[store]") {
  // Every pair of codes packs into one byte and back, low nibble first.
  at::Tensor all = at::arange(-7, 8, at::kChar);
  at::Tensor pairs = at::stack({all.repeat_interleave(15), all.repeat({15})}, 1).reshape({1, 225, 2});
  at::Tensor packed = pack_int4(pairs);
  REQUIRE(packed.scalar_type() == at::kByte);
  REQUIRE(packed.sizes() == at::IntArrayRef({1, 225, 1}));
  CHECK(unpack_int4(packed).equal(pairs));
  CHECK(packed[0][0][0].item<uint8_t>() == (1 | (1 << 4)));  // -7, -7 as q + 8
  CHECK(packed[0][224][0].item<uint8_t>() == (15 | (15 << 4)));
  CHECK_THROWS_WITH(pack_int4(at::zeros({2, 3}, at::kChar)), Catch::Contains("even last dimension"));
  CHECK_THROWS_WITH(unpack_int4(at::zeros({2, 3}, at::kChar)), Catch::Contains("found Char"));

  CHECK(parse_cache_dtype("int4") == kCacheInt4);
  CHECK(parse_cache_dtype("int8-int4") == kCacheInt8Int4);
  CHECK(cache_dtype_name(kCacheInt4) == "int4");
  CHECK(cache_dtype_name(kCacheInt8Int4) == "int8-int4");
  CHECK_THROWS_WITH(parse_cache_dtype("int2"), Catch::Contains("int8-int4 or int4"));

  const DocumentKV kv = random_entry(40, 7), short_kv = random_entry(4, 8);
  // The codes and scales of the tensor ops at `levels`: float16 scales of amax / levels (at least
  // 2^-14), round half to even, clamp.
  auto reference = [](const at::Tensor& x, int dim, double levels) {
    at::Tensor s = x.abs().amax(dim, true) / levels;
    s = at::where(s > 0, s.clamp_min(6.103515625e-05), at::ones_like(s)).to(at::kHalf);
    return std::make_pair((x / s.to(at::kFloat)).round().clamp(-levels, levels).to(at::kChar), s);
  };
  for (const c10::ScalarType form : {kCacheInt4, kCacheInt8Int4}) {
    const bool keys4 = form == kCacheInt4;
    INFO(cache_dtype_name(form));
    for (const DocumentKV* in : {&kv, &short_kv}) {
      const int64_t n = in->n_tokens;
      INFO(n << " tokens");
      const DocumentKV q = in->to(at::kCPU, form);
      REQUIRE(q.quantized());
      CHECK(q.dtype() == form);
      CHECK(q.keys[0].scalar_type() == (keys4 ? at::kByte : at::kChar));
      CHECK(q.keys[0].sizes() == at::IntArrayRef({2, n, keys4 ? 8 : 16}));
      CHECK(q.values[0].scalar_type() == at::kByte);
      CHECK(q.values[0].sizes() == at::IntArrayRef({2, n, 8}));
      const DocumentKV codes = q.int8_codes();
      CHECK(codes.dtype() == at::kChar);
      const DocumentKV back = q.to(at::kCPU, at::kFloat);
      // int4 keys are scaled per channel at every length (the scales coded under 16 tokens);
      // int8-int4's and int8's from 8 tokens on.
      const int dim = DocumentKV::keys_per_channel(n, 16, form) ? 1 : 2;
      CHECK(dim == (keys4 || n >= 8 ? 1 : 2));
      const bool coded = keys4 && n < 16, centred = keys4 && n >= 16;
      CHECK(DocumentKV::codes_int4_key_scales(n, 16) == (n < 16));
      CHECK(DocumentKV::centres_int4_keys(n, 16) == (n >= 16));
      const int dim8 = DocumentKV::keys_per_channel(n, 16) ? 1 : 2;
      for (size_t b = 0; b < 3; ++b) {
        // int4 keys are coded rotated (hadamard_rows), int8-int4's as they are.
        auto [kq, ks] = reference(keys4 ? hadamard_rows(in->keys[b]) : in->keys[b], dim, keys4 ? 7.0 : 127.0);
        auto [vq, vs] = reference(in->values[b], 2, 7.0);
        if (coded) {  // the coded scales, and the codes of the scales they stand for
          const at::Tensor x = hadamard_rows(in->keys[b]);
          auto [bytes, used] = coded_scales_reference(ks, x.abs().amax(1, true) == 0);
          CHECK(q.key_scales[b].equal(bytes));
          CHECK(int4_key_scales(q.keys[b], q.key_scales[b]).equal(used));
          CHECK((used.to(at::kFloat) >= ks.to(at::kFloat)).all().item<bool>());
          kq = (x / used.to(at::kFloat)).round().clamp(-7, 7).to(at::kChar);
          ks = used;
        } else if (centred) {  // the coded scales with the centres, codes in [-8, 7]
          auto [cq, cbytes] = centred_reference(hadamard_rows(in->keys[b]));
          CHECK(q.key_scales[b].equal(cbytes));
          kq = cq;
          ks = int4_key_scales(q.keys[b], q.key_scales[b]);
        } else {
          CHECK(q.key_scales[b].equal(ks));
        }
        CHECK(q.value_scales[b].equal(vs));
        CHECK(codes.values[b].equal(vq));
        CHECK(((back.values[b] - in->values[b]).abs() <= vs.to(at::kFloat) * 0.5001).all().item<bool>());
        if (!keys4) {
          CHECK(codes.keys[b].equal(kq));
          CHECK(codes.key_scales[b].equal(ks));
          // Read back within half a step (a scale rounded to float16 under amax / 7 leaves the
          // clamped end at most 7 * 2^-11 steps out, well inside).
          CHECK(((back.keys[b] - in->keys[b]).abs() <= ks.to(at::kFloat) * 0.5001).all().item<bool>());
        } else {
          CHECK(unpack_int4(q.keys[b]).equal(kq));
          // Read: the rotated rows rotated back and coded again as int8 keys; the CPU's one pass
          // gives the tensor ops' numbers exactly.
          const at::Tensor centre = centred ? int4_key_centres(q.keys[b], q.key_scales[b]).to(at::kFloat)
                                            : at::zeros({1}, at::kFloat);
          auto [k8, ks8] = reference(hadamard_rows((kq.to(at::kFloat) + centre) * ks.to(at::kFloat)), dim8, 127.0);
          CHECK(codes.keys[b].equal(k8));
          CHECK(codes.key_scales[b].equal(ks8));
          // Within a bound from the arithmetic: each rotated element is off by at most half its
          // step, so a rotated row's error has a norm of at most half the steps' norm; rotating
          // back keeps the norm, which bounds each element; then int8's half step.
          at::Tensor steps = ks.to(at::kFloat).expand({2, n, 16});
          at::Tensor bound = steps.pow(2).sum(-1, true).sqrt() * 0.5001 + ks8.to(at::kFloat) * 0.5001;
          CHECK(((back.keys[b] - in->keys[b]).abs() <= bound).all().item<bool>());
          // Linked as stored, the packed rotated keys read as float32 are read as every reader reads
          // them (rotated back, coded again as int8).
          std::vector<std::vector<at::Tensor>> lk{{q.keys[b]}}, lv{{q.values[b]}}, lks{{q.key_scales[b]}}, lvs{{vs}};
          dequantize_linked(lk, lv, lks, lvs);
          CHECK(lk[0][0].equal(back.keys[b]));
          CHECK(lv[0][0].equal(back.values[b]));
        }
        // As int8 codes they read as the same numbers, bit for bit.
        CHECK(back.keys[b].equal(q.to(at::kCPU, at::kChar).to(at::kCPU, at::kFloat).keys[b]));
      }
      // Bytes: half a byte a code (a byte for int8 keys), the int8 layout's float16 scales (int4
      // keys' coded: 2 + 8 bytes a head, with the centres 2 + 8 + 16).
      const int64_t key_scales = coded ? 2 * (2 + 8) : centred ? 2 * (2 + 8 + 16) : 2 * 2 * (dim == 1 ? 16 : n);
      const int64_t expected = 3 * ((keys4 ? 2 * n * 8 : 2 * n * 16) + 2 * n * 8 + key_scales + 2 * 2 * n);
      CHECK(q.bytes() == expected);
      CHECK(DocumentKV::storage_bytes(form, 3, 2, 16, n) == expected);
      // The same form again: the same bytes, moved.
      CHECK(q.to(at::kCPU, form).values[2].equal(q.values[2]));
    }
    // Linked as stored for a joint-attention plug-in: the int8 codes and their scales; otherwise
    // read as float32 as DocumentKV::to reads them.
    auto entry4 = std::make_shared<const DocumentKV>(kv.to(at::kCPU, form));
    LinkedDocuments kept = Linker(c10::kCPU, true).link({entry4});
    REQUIRE(kept.keys[1][0].scalar_type() == at::kChar);
    CHECK(kept.keys[1][0].equal(entry4->int8_codes().keys[1]));
    CHECK(kept.values[2][0].equal(entry4->int8_codes().values[2]));
    CHECK(kept.key_scales[1][0].equal(entry4->int8_codes().key_scales[1]));
    CHECK(kept.value_scales[1][0].equal(entry4->value_scales[1]));
    if (form == kCacheInt8Int4) CHECK(kept.key_scales[1][0].equal(entry4->key_scales[1]));  // int8 keys: as stored
    LinkedDocuments read = Linker(c10::kCPU).link({entry4});
    CHECK(read.values[0][0].equal(entry4->to(at::kCPU, at::kFloat).values[0]));
    dequantize_linked(kept.keys, kept.values, kept.key_scales, kept.value_scales);
    CHECK(kept.keys[2][0].equal(read.keys[2][0]));

    SECTION("a store of " + cache_dtype_name(form) + " keeps it in memory and on disk; another store converts") {
      StoreOptions options;
      options.dtype = form;
      options.disk_bytes = 1 << 20;
      options.disk_dir = temp_dir("int4");
      const DocumentKV q = kv.to(at::kCPU, form), short_q = short_kv.to(at::kCPU, form);
      {
        PICacheStore writer(options);
        auto stored = writer.put(key_of(1), kv);
        REQUIRE(stored->dtype() == form);
        CHECK(stored->keys[0].equal(q.keys[0]));
        CHECK(writer.stats().host.bytes == q.bytes());
        writer.put(key_of(2), short_kv);
        writer.flush();
        CHECK(int64_t(fs::file_size(options.disk_dir + "/" + key_of(1).hex() + ".kv")) == 72 + q.bytes());
        CHECK(int64_t(fs::file_size(options.disk_dir + "/" + key_of(2).hex() + ".kv")) == 72 + short_q.bytes());
      }
      options.host_bytes = 0;  // from disk, as stored
      {
        PICacheStore reader(options);
        for (const auto& [key, want] : {std::make_pair(key_of(1), &q), std::make_pair(key_of(2), &short_q)}) {
          auto hit = reader.get(key);
          REQUIRE(hit);
          REQUIRE(hit->dtype() == form);
          for (size_t b = 0; b < 3; ++b) {
            CHECK(hit->keys[b].equal(want->keys[b]));
            CHECK(hit->values[b].equal(want->values[b]));
            CHECK(hit->key_scales[b].equal(want->key_scales[b]));
            CHECK(hit->value_scales[b].equal(want->value_scales[b]));
          }
        }
      }
      // A truncated file is a corrupt entry, dropped, not read past its end.
      const std::string path = options.disk_dir + "/" + key_of(1).hex() + ".kv";
      std::string bytes = read_bytes(path);
      if (form == kCacheInt4) {
        // int4 keys are written as dtype 13 (centred, from head_dim tokens on) and 12 (under); 10
        // and 11 (float16 scales per channel, per row) are read; 8 and 9, the int4 keys an older
        // build wrote without the rotation, are refused, not misread.
        uint32_t code = 0;
        std::memcpy(&code, &bytes[12], 4);
        CHECK(code == 13);
        std::string old_bytes = bytes;
        const uint32_t old_code = 8;
        std::memcpy(&old_bytes[12], &old_code, 4);
        write_bytes(path, old_bytes);
        PICacheStore reader(options);
        CHECK_FALSE(reader.get(key_of(1)));
        CHECK(reader.stats().corrupt == 1);
        std::string short_bytes = read_bytes(options.disk_dir + "/" + key_of(2).hex() + ".kv");
        std::memcpy(&code, &short_bytes[12], 4);
        CHECK(code == 12);  // 4 tokens: per channel, the scales coded
        {  // one token: coded too, through disk and back
          const DocumentKV one = random_entry(1, 9).to(at::kCPU, kCacheInt4);
          REQUIRE(one.key_scales[0].sizes() == at::IntArrayRef({2, 1, 10}));
          {
            PICacheStore writer(options);
            writer.put(key_of(4), one);
          }
          PICacheStore one_reader(options);
          auto hit = one_reader.get(key_of(4));
          REQUIRE(hit);
          CHECK(hit->keys[2].equal(one.keys[2]));
          CHECK(hit->key_scales[2].equal(one.key_scales[2]));
          CHECK(hit->int8_codes().keys[2].equal(one.int8_codes().keys[2]));
        }
        // Rotated int4 keys scaled per row (dtype 11; this build writes none) are read too.
        DocumentKV rows = short_q;
        for (size_t b = 0; b < 3; ++b) {
          auto [kq, ks] = reference(hadamard_rows(short_kv.keys[b]), 2, 7.0);
          rows.keys[b] = pack_int4(kq), rows.key_scales[b] = ks;
        }
        {
          PICacheStore writer(options);
          writer.put(key_of(3), rows);
        }
        std::string row_bytes = read_bytes(options.disk_dir + "/" + key_of(3).hex() + ".kv");
        std::memcpy(&code, &row_bytes[12], 4);
        CHECK(code == 11);
        PICacheStore row_reader(options);
        auto hit = row_reader.get(key_of(3));
        REQUIRE(hit);
        for (size_t b = 0; b < 3; ++b) {
          CHECK(hit->keys[b].equal(rows.keys[b]));
          CHECK(hit->key_scales[b].equal(rows.key_scales[b]));
          at::Tensor back_rows = unpack_int4(rows.keys[b]).to(at::kFloat) * rows.key_scales[b].to(at::kFloat);
          auto [k8, ks8] = reference(hadamard_rows(back_rows), 2, 127.0);  // 4 tokens: int8 keys per row
          CHECK(hit->int8_codes().keys[b].equal(k8));
          CHECK(hit->int8_codes().key_scales[b].equal(ks8));
        }
      }
      {
        std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size() - 3);
        PICacheStore reader(options);
        CHECK_FALSE(reader.get(key_of(1)));
      }
      options.dtype = at::kChar;  // an int8 store reads the int4 file as int8: the same codes
      options.host_bytes = 1 << 20;
      PICacheStore reader(options);
      auto hit = reader.get(key_of(2));
      REQUIRE(hit);
      CHECK(hit->dtype() == at::kChar);
      CHECK(hit->keys[1].equal(short_q.int8_codes().keys[1]));
      CHECK(hit->values[1].equal(short_q.int8_codes().values[1]));
    }
  }
  // An odd head_dim has no int4 form.
  DocumentKV odd;
  odd.n_tokens = 3;
  odd.keys = {at::randn({1, 3, 5})};
  odd.values = {at::randn({1, 3, 5})};
  CHECK_THROWS_WITH(odd.to(at::kCPU, kCacheInt4), Catch::Contains("even head_dim"));
  // An even one that is not a power of two has no rotation for int4 keys; int8-int4 keeps it.
  DocumentKV six;
  six.n_tokens = 3;
  six.keys = {at::randn({1, 3, 6})};
  six.values = {at::randn({1, 3, 6})};
  CHECK_THROWS_WITH(six.to(at::kCPU, kCacheInt4), Catch::Contains("power of two; found head_dim 6"));
  CHECK(six.to(at::kCPU, kCacheInt8Int4).dtype() == kCacheInt8Int4);
}

TEST_CASE("hadamard_rows: the normalized Walsh-Hadamard matrix, row by row, its own inverse", "[store]") {
  // Order 4 on the identity: the rows of H / 2, exactly (halves are exact in float).
  at::Tensor h4 = hadamard_rows(at::eye(4));
  at::Tensor want = at::tensor({1.f, 1.f, 1.f, 1.f, 1.f, -1.f, 1.f, -1.f, 1.f, 1.f, -1.f, -1.f, 1.f, -1.f, -1.f, 1.f})
                        .view({4, 4}) * 0.5f;
  CHECK(h4.equal(want));
  // Order 64 against the product with the matrix built by Sylvester's doubling, and twice is the
  // identity, within the float32 roundings (unit 2^-24 < 6e-8) of sums bounded by the row's
  // 1-norm: the butterflies' 6 levels and the product's 63 additions, over 8 (exact); twice, the
  // first pass's error summed 64 times over 8 and the second's own: 12 units.
  at::manual_seed(5);
  at::Tensor x = at::randn({3, 7, 64});
  at::Tensor m = at::ones({1, 1});
  while (m.size(0) < 64) m = at::cat({at::cat({m, m}, 1), at::cat({m, -m}, 1)}, 0);
  at::Tensor y = hadamard_rows(x);
  const double scale = x.abs().sum(-1).max().item<double>();
  CHECK((y - at::matmul(x, m) / 8).abs().max().item<double>() <= 69.0 / 8 * scale * 6e-8);
  CHECK((hadamard_rows(y) - x).abs().max().item<double>() <= 16 * scale * 6e-8);
  CHECK(std::abs(y.pow(2).sum().item<double>() - x.pow(2).sum().item<double>()) <= 1e-4 * x.pow(2).sum().item<double>());
  // The CPU's own pass that reads int4 keys back makes the tensor ops' floats exactly: codes
  // times scales (per channel and per row), hadamard_rows.
  for (int64_t d : {2, 16, 64, 128})
    for (bool per_channel : {true, false}) {
      INFO("head_dim " << d << (per_channel ? ", per channel" : ", per row"));
      at::Tensor codes = at::randint(-7, 8, {3, 5, d}, at::kChar);
      at::Tensor scales = (at::rand(per_channel ? std::vector<int64_t>{3, 1, d} : std::vector<int64_t>{3, 5, 1}) + 0.01)
                              .to(at::kHalf);
      at::Tensor want = hadamard_rows(codes.to(at::kFloat) * scales.to(at::kFloat));
      CHECK(rotated_int4_keys_float(pack_int4(codes), scales).equal(want));
    }
  CHECK_THROWS_WITH(hadamard_rows(at::ones({2, 12})), Catch::Contains("power of two"));
  CHECK_THROWS_WITH(hadamard_rows(at::ones({2, 8}, at::kDouble)), Catch::Contains("float32"));
}

TEST_CASE("int8 codes round half to even as std::nearbyint does, ties and saturation included", "[store]") {
  // One head of 4 channels and 16 tokens (per channel: 2 * 16 >= 4). Channel 0 has 127 as its
  // largest magnitude (scale 1 exactly), so its codes are the values rounded: ties both ways.
  // Channel 1 reaches 1e30 (scale capped at 65504: quotients far beyond 2^22, saturated), channel 2
  // an infinity, channel 3 random values. Values are scaled per row: the same rule.
  const std::vector<float> ties = {127.f, 0.5f, 1.5f, 2.5f, 3.5f, -0.5f, -1.5f, -2.5f,
                                   -3.5f, 125.5f, -125.5f, 126.5f, -126.5f, 0.49999997f, 4194304.5f / 65536, -0.f};
  at::manual_seed(17);
  at::Tensor k = at::randn({1, 16, 4}) * 40;
  for (int64_t t = 0; t < 16; ++t) k[0][t][0] = ties[t];
  k[0][0][1] = 1e30f, k[0][1][1] = -3e29f, k[0][2][1] = 7e25f;
  k[0][0][2] = std::numeric_limits<float>::infinity(), k[0][3][2] = -1e38f;
  k[0][5][3] = std::numeric_limits<float>::quiet_NaN();  // no scale sees it; coded as nearbyint's NaN clamps
  DocumentKV f;
  f.n_tokens = 16;
  f.keys = {k};
  f.values = {k.clone()};
  const DocumentKV q = f.to(at::kCPU, at::kChar);
  auto want = [](float x, float scale) {
    return static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x / scale))));
  };
  const at::Tensor kc = q.keys[0], ks = q.key_scales[0].to(at::kFloat), vc = q.values[0], vs = q.value_scales[0].to(at::kFloat);
  REQUIRE(ks.sizes() == at::IntArrayRef({1, 1, 4}));
  CHECK(ks[0][0][0].item<float>() == 1.0f);
  CHECK(ks[0][0][1].item<float>() == 65504.0f);
  int64_t mismatches = 0;
  for (int64_t t = 0; t < 16; ++t)
    for (int64_t j = 0; j < 4; ++j) {
      const float x = k[0][t][j].item<float>();
      mismatches += kc[0][t][j].item<int8_t>() != want(x, ks[0][0][j].item<float>());
      mismatches += vc[0][t][j].item<int8_t>() != want(x, vs[0][t][0].item<float>());
    }
  CHECK(mismatches == 0);
  const std::vector<int> rounded = {127, 0, 2, 2, 4, 0, -2, -2, -4, 126, -126, 126, -126, 0, 64, 0};
  for (int64_t t = 0; t < 16; ++t) CHECK(kc[0][t][0].item<int8_t>() == rounded[t]);
}

TEST_CASE("int4 entries read as int8: one pass gives the numbers of the floats coded again, on any thread count",
          "[store]") {
  // DocumentKV::int8_codes reads rotated int4 keys straight to int8 codes on the CPU; they must be
  // those of rotated_int4_keys_float's floats coded as int8 (DocumentKV::to), and the values those
  // of the tensor ops' unpacking, at lengths scaled per channel (2n >= head_dim) and per row.
  at::manual_seed(23);
  struct Threads {  // the thread count restored however the case ends
    int before = at::get_num_threads();
    ~Threads() { at::set_num_threads(before); }
  } restore;
#if defined(__SANITIZE_THREAD__)
  const std::vector<int> thread_counts = {1};  // ThreadSanitizer does not see OpenMP's barriers
#else
  const std::vector<int> thread_counts = {1, 2};
#endif
  for (int64_t d : {2, 16, 64, 128})
    for (int64_t n : {1, 7, 40, 130}) {
      INFO("head_dim " << d << ", " << n << " tokens");
      DocumentKV f;
      f.n_tokens = n;
      for (int b = 0; b < 3; ++b) {
        f.keys.push_back(at::randn({3, n, d}) * (b + 1));
        f.values.push_back(at::randn({3, n, d}));
      }
      f.keys[1][0][0][0] = 30.0f;  // an outlier
      const DocumentKV q = f.to(at::kCPU, kCacheInt4);
      for (int t : thread_counts) {
        at::set_num_threads(t);
        const DocumentKV r = q.int8_codes();
        REQUIRE(r.keys.size() == 3);
        for (size_t b = 0; b < 3; ++b) {
          DocumentKV fl;
          fl.n_tokens = n;
          fl.keys = {rotated_int4_keys_float(q.keys[b], q.key_scales[b])};
          fl.values = {at::zeros({3, n, d})};
          const DocumentKV want = fl.to(at::kCPU, at::kChar);
          CHECK(r.keys[b].equal(want.keys[0]));
          CHECK(r.key_scales[b].equal(want.key_scales[0]));
          const at::Tensor lo = at::bitwise_and(q.values[b], 15).to(at::kChar) - 8;
          const at::Tensor hi = at::bitwise_right_shift(q.values[b], 4).to(at::kChar) - 8;
          CHECK(r.values[b].equal(at::stack({lo, hi}, -1).reshape({3, n, d})));
          const auto one = q.int8_block(b);  // one block alone, outside the parallel read
          CHECK(one[0].equal(r.keys[b]));
          CHECK(one[1].equal(r.key_scales[b]));
          CHECK(one[2].equal(r.values[b]));
        }
      }
    }
}

TEST_CASE("int4 key scales coded under head_dim tokens: a float16 scale a head, 4 bits a channel; loops and tensor "
          "ops give the same bytes; kept through disk; bad ones refused",
          "[store]") {
  for (int e = 0; e < 16; ++e) CHECK(kInt4ScaleSteps[e] == static_cast<float>(std::pow(2.0, -e / 8.0)));
  CHECK(DocumentKV::codes_int4_key_scales(63, 64));
  CHECK_FALSE(DocumentKV::codes_int4_key_scales(64, 64));
  using Form = DocumentKV::KeyScaleForm;
  CHECK(DocumentKV::key_scale_form(kCacheInt4, 63, 64) == Form::coded);
  CHECK(DocumentKV::key_scale_form(kCacheInt4, 64, 64) == Form::centred);
  CHECK(DocumentKV::key_scale_form(at::kChar, 31, 64) == Form::per_row);
  CHECK(DocumentKV::key_scale_form(at::kChar, 32, 64) == Form::per_channel);
  CHECK(DocumentKV::key_scale_form(kCacheInt8Int4, 32, 64) == Form::per_channel);
  CHECK(DocumentKV::coded_key_scale_bytes(64, false) == 34);
  CHECK(DocumentKV::coded_key_scale_bytes(64, true) == 98);
  // The default model's shape (28 blocks of 3 heads of 64): codes, value scales, key scales.
  CHECK(DocumentKV::storage_bytes(kCacheInt4, 28, 3, 64, 17) == 28 * 3 * (17 * 64 + 2 * 17 + (2 + 32)));

  at::manual_seed(31);
  // Scales from 2^-2 to 2^2 (some under their head's largest by more than the steps reach: the
  // last step), channels of zeros (int8_scale's 1), and a head of zeros only.
  at::Tensor zero = at::rand({4, 1, 64}) < 0.1;
  zero[3].fill_(true);
  at::Tensor s = at::where(zero, at::ones({4, 1, 64}), at::exp2(at::rand({4, 1, 64}) * 4 - 2)).to(at::kHalf);
  auto [bytes, used] = code_int4_key_scales(s, zero);
  auto [ref_bytes, ref_used] = coded_scales_reference(s, zero);
  CHECK(bytes.equal(ref_bytes));
  CHECK(used.equal(ref_used));
  auto [op_bytes, op_used] = comb::detail::document_kv::code_int4_key_scales_ops(s, zero);
  CHECK(op_bytes.equal(bytes));
  CHECK(op_used.equal(used));
  const at::Tensor packed = at::zeros({4, 5, 32}, at::kByte);
  CHECK(int4_key_scales(packed, bytes).equal(used));
  CHECK(comb::detail::document_kv::decode_int4_key_scales_ops(bytes).equal(used));
  CHECK(bytes[3][0][0].item<int>() == 0x00);  // the head of zeros: S = 1 (float16 0x3c00), every e 15
  CHECK(bytes[3][0][1].item<int>() == 0x3c);
  CHECK((bytes[3].narrow(-1, 2, 32) == 0xff).all().item<bool>());
  // Every other channel's scale is at least its own; above the last step, under 2^(1/8) times it
  // (the next step is under it; two float16 roundings of 2^-11 each at most).
  const at::Tensor e = at::stack({at::bitwise_and(bytes.narrow(-1, 2, 32), 15),
                                  at::bitwise_right_shift(bytes.narrow(-1, 2, 32), 4)}, -1)
                           .reshape({4, 1, 64});
  const at::Tensor sf = s.to(at::kFloat), uf = used.to(at::kFloat), live = zero.logical_not();
  CHECK((uf.masked_select(live) >= sf.masked_select(live)).all().item<bool>());
  const at::Tensor mid = live & (e < 15);
  CHECK(mid.sum().item<int64_t>() > 40);
  CHECK((uf.masked_select(mid) <= sf.masked_select(mid) * 1.09051 * 1.0010).all().item<bool>());
  CHECK((live & (e == 15)).any().item<bool>());  // the range reaches past the last step
  CHECK_THROWS_WITH(int4_key_scales(packed, bytes.narrow(-1, 0, 9).contiguous()),
                    Catch::Contains("expected coded scales [4, 1, 34] or, centred, [4, 1, 98] (uint8)"));
  CHECK_THROWS_WITH(code_int4_key_scales(s.to(at::kFloat), zero), Catch::Contains("expected float16 scales"));
  CHECK_THROWS_WITH(code_int4_key_scales(at::where(zero, at::full_like(s, NAN), s), zero),
                    Catch::Contains("finite positive"));

  // Keys coded by the CPU's loops (DocumentKV::to) and as the tensor ops off the CPU code them
  // (int8_scale's float16 scales, the scales coded, codes of the scales they stand for); head 0's
  // rows constant over the channels, so that its rotated channels 1-15 are zeros (a + b - (a + b)).
  DocumentKV nine;
  nine.n_tokens = 9;
  nine.keys = {at::randn({3, 9, 16})};
  nine.keys[0][0] = at::randn({9, 1}).expand({9, 16});
  nine.values = {at::randn({3, 9, 16})};
  const DocumentKV nine4 = nine.to(at::kCPU, kCacheInt4);
  const at::Tensor k = hadamard_rows(nine.keys[0]), amax = k.abs().amax(1, true);
  REQUIRE((amax[0][0].slice(0, 1) == 0).all().item<bool>());
  REQUIRE((amax[1] > 0).all().item<bool>());
  const at::Tensor s7 = amax / 7.0f;
  auto [kb, ku] = comb::detail::document_kv::code_int4_key_scales_ops(
      at::where(s7 > 0, s7.clamp(6.103515625e-05, 65504.0), at::ones_like(s7)).to(at::kHalf), (s7 > 0).logical_not());
  // The zero channels' e: 15; channel 0's (the head's largest): 0.
  CHECK(kb[0][0][2].item<int>() == 0xf0);
  CHECK((kb[0].narrow(-1, 3, 7) == 0xff).all().item<bool>());
  CHECK(nine4.key_scales[0].equal(kb));
  CHECK(unpack_int4(nine4.keys[0]).equal((k / ku.to(at::kFloat)).round().clamp(-7, 7).to(at::kChar)));

  // Through disk (dtype 12) and back; a coded head scale that is not a finite positive float16 is
  // a corrupt entry.
  StoreOptions options;
  options.dtype = kCacheInt4;
  options.disk_bytes = 1 << 20;
  options.disk_dir = temp_dir("coded");
  const DocumentKV kv = random_entry(5, 4), q = kv.to(at::kCPU, kCacheInt4);
  REQUIRE(q.key_scales[0].sizes() == at::IntArrayRef({2, 1, 10}));
  {
    PICacheStore writer(options);
    writer.put(key_of(1), kv);
  }
  options.host_bytes = 0;
  const std::string path = options.disk_dir + "/" + key_of(1).hex() + ".kv";
  const std::string stored = read_bytes(path);
  uint32_t code = 0;
  std::memcpy(&code, &stored[12], 4);
  CHECK(code == 12);
  CHECK(int64_t(stored.size()) == 72 + q.bytes());
  {
    PICacheStore reader(options);
    auto hit = reader.get(key_of(1));
    REQUIRE(hit);
    for (size_t b = 0; b < 3; ++b) CHECK(hit->key_scales[b].equal(q.key_scales[b]));
    CHECK(hit->int8_codes().keys[1].equal(q.int8_codes().keys[1]));
  }
  for (const uint16_t bad : {uint16_t(0x0000), uint16_t(0x7c00), uint16_t(0x7e00), uint16_t(0xbc00)}) {
    INFO("head scale bits " << bad);
    std::string b = stored;
    const size_t at = 72 + 2 * 2 * 5 * 8;  // block 0's key scales, after its K and V codes
    b[at] = char(bad & 0xff), b[at + 1] = char(bad >> 8);
    write_sealed(path, b);
    PICacheStore reader(options);
    CHECK(reader.get(key_of(1)) == nullptr);
    CHECK(reader.stats().corrupt == 1);
  }
}

TEST_CASE("int4 keys coded centred from head_dim tokens: an int8 centre a channel, codes in [-8, 7]; loops, tensor "
          "ops and a reference give the same bytes; within half a step; kept through disk",
          "[store]") {
  CHECK_FALSE(DocumentKV::centres_int4_keys(63, 64));
  CHECK(DocumentKV::centres_int4_keys(64, 64));
  // The default model's shape: from 64 tokens on, the coded scales and 64 centres a head.
  CHECK(DocumentKV::storage_bytes(kCacheInt4, 28, 3, 64, 64) == 28 * 3 * (64 * 64 + 2 * 64 + (2 + 32 + 64)));
  CHECK(DocumentKV::storage_bytes(kCacheInt4, 28, 3, 64, 63) == 28 * 3 * (63 * 64 + 2 * 63 + (2 + 32)));

  // Rotated keys x of 3 heads, 20 tokens, head_dim 16: channels off zero by up to a few times
  // their spread, a channel of zeros, a constant one (no spread: its centre alone), and one whose
  // offset is 2,560 times its spread (its scale then |mid| / 127 or more). Multiples of 1/64 under
  // 2^9, so that the rotation and its inverse are exact: the writer rotates the keys back to x.
  at::manual_seed(41);
  const int64_t n = 20, d = 16;
  at::Tensor x = at::randn({3, n, d}) * at::exp2(at::rand({3, 1, d}) * 4 - 2) + at::randn({3, 1, d}) * 5;
  x[0].select(1, 3).fill_(0.0f);
  x[0].select(1, 4).fill_(-2.5f);
  x[1].select(1, 7).copy_(40.0f + (at::rand({n}) < 0.5).to(at::kFloat) / 64.0f);
  // A channel whose float16 scale to nearest would fall under (hi - lo) / 15 and put its centre
  // past 127 steps (119.546875 to 134.546875: w = 1.000369, rounded to nearest 1.0): rounded up,
  // every key stays within half a step. The head's other channels are made smaller, so that this
  // one's scale is the head's S, taken as it is (exponent 0).
  x[2].mul_(0.25f);
  x[2].select(1, 0).copy_(at::linspace(0, 15, n).round() + 119.546875f);
  x = (x * 64.0f).round() / 64.0f;
  DocumentKV kv;
  kv.n_tokens = n;
  kv.keys = {hadamard_rows(x)};
  kv.values = {at::randn({3, n, d})};
  REQUIRE(hadamard_rows(kv.keys[0]).equal(x));
  auto [ref_q, ref_bytes] = centred_reference(x);
  const DocumentKV q = kv.to(at::kCPU, kCacheInt4);
  REQUIRE(q.key_scales[0].sizes() == at::IntArrayRef({3, 1, 2 + 8 + 16}));
  CHECK(q.key_scales[0].equal(ref_bytes));
  CHECK(unpack_int4(q.keys[0]).equal(ref_q));
  auto [op_q, op_bytes] = comb::detail::document_kv::code_centred_int4_keys_ops(x);
  CHECK(op_bytes.equal(ref_bytes));
  CHECK(op_q.equal(ref_q));
  CHECK(ref_q.min().item<int>() == -8);  // the codes use all sixteen values
  CHECK(ref_q.max().item<int>() == 7);
  const at::Tensor used = int4_key_scales(q.keys[0], q.key_scales[0]).to(at::kFloat);
  const at::Tensor m = int4_key_centres(q.keys[0], q.key_scales[0]);
  REQUIRE(m.scalar_type() == at::kChar);
  CHECK(m.is_alias_of(q.key_scales[0]));  // a view: the read path copies nothing
  CHECK(m.equal(ref_bytes.narrow(-1, 10, 16).contiguous().view(at::kChar)));
  CHECK(m[0][0][3].item<int>() == 0);             // zeros: centre 0, codes 0
  CHECK((ref_q[0].select(1, 3) == 0).all().item<bool>());
  CHECK(m.min().item<int>() >= -127);
  CHECK(m.max().item<int>() <= 127);
  CHECK(int4_key_centres(q.keys[0], q.key_scales[0].narrow(-1, 0, 10).contiguous()).defined() == false);
  CHECK_FALSE(int4_key_centres(q.keys[0], used.to(at::kHalf)).defined());
  // Each element (q + m) * s within half its step of the key: the scale covers the channel's range
  // over 15 steps and its |mid| over 127 (float32 rounding aside), read on the CPU as the tensor ops
  // read it.
  const at::Tensor xr = (unpack_int4(q.keys[0]).to(at::kFloat) + m.to(at::kFloat)) * used;
  CHECK(((xr - x).abs() <= used * 0.5001).all().item<bool>());
  const at::Tensor back = rotated_int4_keys_float(q.keys[0], q.key_scales[0]);
  CHECK(back.equal(hadamard_rows(xr)));
  // The error against the symmetric codes of dtype 10 (a float16 scale per channel, fifteen levels
  // around zero): the same keys, about five times less on these offset channels.
  at::Tensor s7 = (x.abs().amax(1, true) / 7.0f).to(at::kHalf).to(at::kFloat);
  s7 = at::where(s7 > 0, s7, at::ones_like(s7));
  const at::Tensor sym = (x / s7).round().clamp(-7, 7) * s7;
  INFO("squared error: centred " << (xr - x).pow(2).sum().item<double>() << ", symmetric "
                                  << (sym - x).pow(2).sum().item<double>());
  CHECK((xr - x).pow(2).sum().item<double>() * 4 < (sym - x).pow(2).sum().item<double>());
  // Read as int8 (every reader): the rows rotated back, coded again as int8 keys.
  const DocumentKV codes = q.int8_codes();
  at::Tensor s8 = (hadamard_rows(xr).abs().amax(1, true) / 127.0f).to(at::kHalf);
  CHECK(codes.key_scales[0].equal(s8));
  CHECK(codes.keys[0].equal((hadamard_rows(xr) / s8.to(at::kFloat)).round().clamp(-127, 127).to(at::kChar)));
  std::vector<std::vector<at::Tensor>> lk{{q.keys[0]}}, lv{{q.values[0]}}, lks{{q.key_scales[0]}},
      lvs{{q.value_scales[0]}};
  dequantize_linked(lk, lv, lks, lvs);
  CHECK(lk[0][0].equal(q.to(at::kCPU, at::kFloat).keys[0]));
  CHECK(q.bytes() == DocumentKV::storage_bytes(kCacheInt4, 1, 3, 16, n));
  CHECK_THROWS_WITH(int4_key_scales(q.keys[0], q.key_scales[0].narrow(-1, 0, 20).contiguous()),
                    Catch::Contains("or, centred, [3, 1, 26]"));
  // NaN keys are coded as 0 and infinite ones as 65504 * 127, alike by the loops and the tensor ops
  // (no NaN reaches a conversion to int8).
  DocumentKV odd = kv;
  odd.keys[0] = kv.keys[0].clone();
  odd.keys[0][0][2][5] = NAN;
  odd.keys[0][1][4][2] = INFINITY;
  odd.keys[0][2][6][9] = -INFINITY;
  const DocumentKV odd4 = odd.to(at::kCPU, kCacheInt4);
  auto [odd_q, odd_bytes] = comb::detail::document_kv::code_centred_int4_keys_ops(hadamard_rows(odd.keys[0]));
  CHECK(odd4.key_scales[0].equal(odd_bytes));
  CHECK(unpack_int4(odd4.keys[0]).equal(odd_q));

  // Through disk as dtype 13 and back; a stored dtype-10 entry (float16 scales per channel, as
  // builds before wrote documents of head_dim tokens or more) is still read as it was.
  StoreOptions options;
  options.dtype = kCacheInt4;
  options.disk_bytes = 1 << 20;
  options.disk_dir = temp_dir("centred");
  const DocumentKV long_kv = random_entry(40, 12), lq = long_kv.to(at::kCPU, kCacheInt4);
  REQUIRE(lq.key_scales[0].sizes() == at::IntArrayRef({2, 1, 2 + 8 + 16}));
  DocumentKV old10 = lq;  // dtype 10
  for (size_t b = 0; b < 3; ++b) {
    const at::Tensor r = hadamard_rows(long_kv.keys[b]);
    const at::Tensor s10 = (r.abs().amax(1, true) / 7.0f).to(at::kHalf);
    old10.keys[b] = pack_int4((r / s10.to(at::kFloat)).round().clamp(-7, 7).to(at::kChar));
    old10.key_scales[b] = s10;
  }
  const DocumentKV& old = old10;
  {
    PICacheStore writer(options);
    writer.put(key_of(1), long_kv);
    writer.put(key_of(2), old);
  }
  options.host_bytes = 0;
  for (const auto& [i, want, code] : {std::make_tuple(1, &lq, 13u), std::make_tuple(2, &old, 10u)}) {
    INFO("dtype " << code);
    const std::string path = options.disk_dir + "/" + key_of(i).hex() + ".kv";
    const std::string stored = read_bytes(path);
    uint32_t c = 0;
    std::memcpy(&c, &stored[12], 4);
    CHECK(c == code);
    CHECK(int64_t(stored.size()) == 72 + want->bytes());
    PICacheStore reader(options);
    auto hit = reader.get(key_of(i));
    REQUIRE(hit);
    for (size_t b = 0; b < 3; ++b) {
      CHECK(hit->keys[b].equal(want->keys[b]));
      CHECK(hit->key_scales[b].equal(want->key_scales[b]));
    }
    CHECK(hit->int8_codes().keys[2].equal(want->int8_codes().keys[2]));
  }
  // A coded head scale that is not a finite positive float16 is a corrupt entry here too.
  const std::string path = options.disk_dir + "/" + key_of(1).hex() + ".kv";
  std::string bad = read_bytes(path);
  const size_t at = 72 + 2 * 2 * 40 * 8;  // block 0's key scales, after its K and V codes
  bad[at] = 0, bad[at + 1] = 0;
  write_sealed(path, bad);
  PICacheStore reader(options);
  CHECK(reader.get(key_of(1)) == nullptr);
  CHECK(reader.stats().corrupt == 1);
}

TEST_CASE("NaN and infinite elements: the CPU's loops and the tensor ops give the same codes and scales, every "
          "form and length",
          "[store]") {
  // The loops (float32 on the CPU) skip NaN in a largest magnitude (std::max keeps its first
  // argument) and code it -levels (the clamp's lower end); infinities take the largest scale and
  // saturate. The tensor ops, which quantize off the CPU (and any values not float32), do the same.
  using Form = DocumentKV::KeyScaleForm;
  for (const c10::ScalarType dtype : {at::kChar, kCacheInt4, kCacheInt8Int4})
    for (const int64_t len : {3, 12, 40}) {
      INFO(cache_dtype_name(dtype) << ", " << len << " tokens");
      DocumentKV odd = random_entry(len, 9);
      odd.keys[0][0][1][3] = NAN;
      odd.keys[0][1][2][0] = INFINITY;
      odd.keys[1][0][0][7] = -INFINITY;
      odd.values[0][0][1][3] = NAN;
      odd.values[0][1][2][4] = -INFINITY;
      odd.values[2][1][0][0] = INFINITY;
      const DocumentKV loops = odd.to(at::kCPU, dtype);
      const Form form = DocumentKV::key_scale_form(dtype, len, 16);
      const float levels = dtype == kCacheInt4 ? 7.0f : 127.0f;
      for (size_t b = 0; b < 3; ++b) {
        INFO("block " << b);
        const at::Tensor k = dtype == kCacheInt4 ? hadamard_rows(odd.keys[b]) : odd.keys[b];
        auto [kq, ks] = comb::detail::document_kv::quantize_keys_ops(k, levels, form);
        CHECK(ks.equal(loops.key_scales[b]));
        CHECK(kq.equal(dtype == kCacheInt4 ? unpack_int4(loops.keys[b]) : loops.keys[b]));
      }
      // NaN counts for nothing in a scale: int8 keys' and values' scales as with that element 0,
      // the element coded -127.
      DocumentKV clean = odd;
      clean.keys[0] = at::nan_to_num(odd.keys[0], 0.0, INFINITY, -INFINITY);
      clean.values[0] = at::nan_to_num(odd.values[0], 0.0, INFINITY, -INFINITY);
      const DocumentKV cleaned = clean.to(at::kCPU, dtype);
      CHECK(loops.value_scales[0].equal(cleaned.value_scales[0]));
      if (dtype != kCacheInt4) {
        CHECK(loops.key_scales[0].equal(cleaned.key_scales[0]));
        CHECK(loops.keys[0][0][1][3].item<int>() == -127);
      }
      // Values through DocumentKV::to: float16 ones go through the tensor ops (the same numbers as
      // float32 ones here, whose values float16 holds exactly).
      DocumentKV exact = odd, half = odd;
      for (size_t b = 0; b < 3; ++b) {
        half.values[b] = odd.values[b].to(at::kHalf);
        exact.values[b] = half.values[b].to(at::kFloat);
      }
      const DocumentKV by_loops = exact.to(at::kCPU, dtype), by_ops = half.to(at::kCPU, dtype);
      for (size_t b = 0; b < 3; ++b) {
        CHECK(by_ops.value_scales[b].equal(by_loops.value_scales[b]));
        CHECK(by_ops.values[b].equal(by_loops.values[b]));
      }
      CHECK((by_loops.value_scales[0][1].to(at::kFloat) == 65504.0f).any().item<bool>());  // the infinite row
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
  store.flush();
  CHECK(store.stats().write_errors == 1);
  CHECK(holds(store.get(key_of(1)), 1));
  options.dtype = at::kDouble;
  CHECK_THROWS_WITH(PICacheStore(options), Catch::Contains("float32, bfloat16, float16, int8, int8-int4 or int4"));
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

TEST_CASE("the disk tier writes a device entry after the work that makes it (CUDA)", "[store][cuda]") {
  if (!comb::cuda_available()) {
    WARN("no CUDA device: the disk tier's writes of device entries are not checked here");
    return;
  }
  const c10::Device cuda(c10::kCUDA, 0);
  StoreOptions options;
  options.device = cuda;
  options.device_bytes = int64_t(1) << 30;
  options.disk_bytes = int64_t(1) << 30;
  options.disk_dir = temp_dir("cuda-disk");
  std::vector<at::Tensor> made;
  {
    PICacheStore store(options);
    for (int i = 0; i < 4; ++i) {
      // The entry is the end of a chain of products queued on the current stream (milliseconds of
      // work), put at once: a write that did not wait for it would read other numbers.
      at::Tensor x = at::rand({2048, 2048}, at::TensorOptions().device(cuda));
      for (int j = 0; j < 20; ++j) x = at::sin(at::mm(x, x));
      DocumentKV kv;
      kv.n_tokens = 64;
      for (int64_t b = 0; b < 2; ++b) {
        kv.keys.push_back(x.narrow(0, 64 * b, 64).view({1, 64, 2048}));
        kv.values.push_back(x.narrow(0, 128 + 64 * b, 64).view({1, 64, 2048}));
      }
      store.put(key_of(i), kv);
      made.push_back(x);
    }
    store.flush();
    CHECK(store.stats().disk.entries == 4);
    CHECK(store.stats().write_errors == 0);
  }
  StoreOptions reader = options;  // the files alone, read on the host
  reader.device = c10::kCPU;
  reader.host_bytes = 0;
  PICacheStore files(reader);
  for (int i = 0; i < 4; ++i) {
    auto kv = files.get(key_of(i));
    REQUIRE(kv);
    const at::Tensor want = made[static_cast<size_t>(i)].cpu();
    for (int64_t b = 0; b < 2; ++b) {
      CHECK(at::equal(kv->keys[b].view({64, 2048}), want.narrow(0, 64 * b, 64)));
      CHECK(at::equal(kv->values[b].view({64, 2048}), want.narrow(0, 128 + 64 * b, 64)));
    }
  }
}

TEST_CASE("the host tier beside a CUDA device tier is page-locked and promotes on a side stream", "[store][cuda]") {
  if (!comb::cuda_available()) {
    WARN("no CUDA device: the page-locked host tier is not checked here");
    return;
  }
  // Without comb's CUDA ops (or with COMB_CUDA_KERNELS=0) the host tier stays pageable.
  const bool ops = comb::detail::cuda_layer_ops() != nullptr;
  if (!ops) WARN("comb's CUDA ops are not loaded: the host tier is checked to be pageable");
  const c10::Device cuda(c10::kCUDA, 0);
  auto parts = [](const DocumentKV& kv) {  // keys, values, then the scales
    std::vector<at::Tensor> out;
    for (const auto* v : {&kv.keys, &kv.values, &kv.key_scales, &kv.value_scales})
      out.insert(out.end(), v->begin(), v->end());
    return out;
  };
  for (const bool pinned_host : {true, false})
    for (const c10::ScalarType dtype : {c10::ScalarType::Undefined, at::kChar}) {
      CAPTURE(pinned_host, cache_dtype_name(dtype));
      // Entries of 64 MiB (float32) and 13 MiB (int8): a copy to the device takes a millisecond or
      // more, so a read that did not wait for it would find other numbers.
      const int64_t len = int64_t(1) << 20;
      // (No zeros: fresh device memory may hold them.)
      auto make = [&](int i) { return dtype == at::kChar ? random_entry(len / 16, 10 + i) : entry(i + 1, len); };
      const DocumentKV first = make(0);
      StoreOptions options;
      options.device = cuda;
      options.dtype = dtype;
      options.pinned_host = pinned_host;
      const int64_t bytes =
          DocumentKV::storage_bytes(dtype == at::kChar ? at::kChar : at::kFloat, static_cast<int64_t>(first.keys.size()),
                                    first.keys[0].size(0), first.head_dim(), first.n_tokens);
      options.device_bytes = 2 * bytes;
      options.host_bytes = 4 * bytes;
      PICacheStore store(options);
      store.put(key_of(0), first);
      for (int i = 1; i < 3; ++i) store.put(key_of(i), make(i));  // 0 goes down a tier, from the device
      REQUIRE(store.stats().host.entries == 1);
      // Every entry pinned: each read where it is, none moved.
      for (int i = 0; i < 3; ++i) REQUIRE(store.pin(key_of(i)));
      auto host = store.get(key_of(0));
      REQUIRE(host);
      CHECK(host->keys[0].device().is_cpu());
      std::vector<at::Tensor> want;
      for (const at::Tensor& t : parts(*host)) {
        CHECK(t.is_pinned() == (ops && pinned_host));
        want.push_back(t.clone());
      }
      for (int i = 0; i < 3; ++i) store.unpin(key_of(i));
      // Room on the device without demoting anything (1 and 2 replaced by small entries), so the
      // promotion's copy is not waited for by a copy to the host; read at once on the current stream.
      for (int i = 1; i < 3; ++i) store.put(key_of(i), entry(i, 8));
      REQUIRE(store.stats().device.entries == 2);
      auto moved = store.get(key_of(0));
      REQUIRE(moved);
      const std::vector<at::Tensor> got = parts(*moved);
      REQUIRE(got.size() == want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        CHECK(got[i].device() == cuda);
        CHECK(at::equal(got[i].cpu(), want[i]));
      }
      if (dtype != at::kChar) CHECK(holds(moved, 1.0f));  // the entry put, as it was put
      auto s = store.stats();
      CHECK(s.device.entries == 3);
      CHECK(s.host.entries == 0);
    }
}
