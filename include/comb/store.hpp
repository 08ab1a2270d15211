#pragma once
// PICacheStore: per-document encoder K/V, keyed by content, in tiers (device, host, disk).
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comb/document_kv.hpp"

namespace comb {

// XXH3-128 of a document's token ids, the plug-in's fingerprint and a tenant salt.
struct CacheKey {
  uint64_t high = 0, low = 0;
  std::string hex() const;
  static CacheKey from_hex(const std::string& hex);  // throws comb::Error on a malformed string
  bool operator==(const CacheKey& o) const { return high == o.high && low == o.low; }
};

struct StoreOptions {
  int64_t device_bytes = 0;            // device-memory tier budget (a tier only when `device` is CUDA)
  int64_t host_bytes = int64_t(1) << 30;  // host-memory tier budget (0: no host tier)
  int64_t disk_bytes = 0;              // disk tier budget (0: no disk tier)
  std::string disk_dir;                // the disk tier's directory; entries survive restarts
  // The disk tier is written by a thread of the store's own: put() queues an entry and returns
  // (an entry on a device is copied to the host there, after the work queued on the device's
  // current stream at put(); until then it holds its device memory, even if evicted). When more
  // than this many bytes would wait, put() waits for the writer, callers in the order they came (0:
  // put() returns once its own entry is written; an entry over the bound waits for an empty queue). A queued entry is found by get() as a disk hit; flush() and the destructor wait for
  // every queued write.
  int64_t disk_queue_bytes = int64_t(256) << 20;
  // Storage dtype of K/V: float32, bfloat16, float16, int8 (kChar: float16 scales, keys per
  // channel or, on documents under head_dim / 2 tokens, per row; values per row), int8 keys with
  // int4 values (kCacheInt8Int4) or int4 (kCacheInt4: keys coded rotated, scaled per channel;
  // head_dim a power of two) (DocumentKV); Undefined
  // ("auto", the default): each entry in the dtype it is put in.
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::kCPU;      // the device tier's device
  // With an enabled CUDA device tier: the host tier keeps each entry in one page-locked allocation
  // (copied there straight from the device when demoted), and an entry promoted back to the
  // device is copied on a stream of comb's own without the host waiting for the copy (unless the
  // promotion demotes another entry: that copy to the host waits for all the current stream's
  // work, the promotion's included). The device's current stream waits for it on the device;
  // readers on other streams must wait for that stream. The budget counts the entries' bytes;
  // LibTorch's caching host allocator rounds each allocation up to a power of two and keeps a
  // freed one for requests of its size only, so the page-locked memory held is up to twice the
  // budget for each size class that peaks, and more when entries' sizes change over time (it is
  // given back when an allocation fails; an entry that still cannot be page-locked is kept in
  // pageable memory, logged once). Needs comb's CUDA ops (not with COMB_CUDA_KERNELS=0). Off
  // (pageable memory, plain copies) until a benchmark measures it (its CUDA tests pass on one
  // H200; `comb bench --device-cache-mb` is that benchmark, not yet run on a GPU);
  // PicOptions::store_options turns it on with COMB_CUDA_PINNED_HOST=1.
  bool pinned_host = false;
  // The remote tier, shared by replicas: a Redis server, "redis://[:PASSWORD@]HOST[:PORT][/DB]"
  // ("": none). Looked up after the disk tier; a hit is promoted into the local tiers. Entries are
  // the disk tier's bytes under "comb:kv:<key hex>", written in the background.
  std::string remote_url;
  int64_t remote_ttl_s = 0;            // expiry of the entries it writes (0: none; Redis's policy evicts)
  int64_t remote_timeout_ms = 500;     // connect and per-command limit
  int64_t remote_backoff_ms = 30000;   // after a failure, the tier is off this long (logged once)
};

struct TierStats {
  int64_t hits = 0, misses = 0, evictions = 0, bytes = 0, entries = 0, budget = 0;
};

struct StoreStats {
  TierStats device, host, disk;
  TierStats remote;             // hits: valid entries read; bytes: written by this store
  int64_t remote_errors = 0;    // failed connections and commands (each starts a back-off)
  int64_t remote_dropped = 0;   // writes not made: the tier was off, or too much was queued
  bool remote_online = false;   // a remote tier is set and not in a back-off period
  int64_t corrupt = 0;      // disk entries that failed their checks (dropped, to be recomputed)
  int64_t write_errors = 0; // disk writes that failed (the entry is not on disk; in memory while a tier keeps it)
  int64_t disk_queued = 0;  // entries queued for the disk tier, not yet written
};

// Thread-safe. get() returns shared ownership, so an evicted entry stays valid for the requests
// still reading it. Memory tiers hold an entry in one place (LRU, demoted device -> host on
// eviction); the disk tier is written on put() in the background (StoreOptions::disk_queue_bytes)
// and checked (checksum) on every read; the
// remote tier (Redis) is written in the background on put() and checked like the disk tier. A
// failing remote tier never fails a call: it is a miss, and the store goes on with its local tiers.
class PICacheStore {
 public:
  explicit PICacheStore(StoreOptions options);
  ~PICacheStore();
  PICacheStore(const PICacheStore&) = delete;
  PICacheStore& operator=(const PICacheStore&) = delete;

  static CacheKey key(const std::vector<int32_t>& tokens, const std::string& plugin_fingerprint,
                      const std::string& tenant = "");

  // The entry, from the fastest tier that has it (promoted to the fastest memory tier when it fits
  // there; a remote hit is also written to the disk tier), or nullptr. An entry read from disk or
  // Redis comes in the storage dtype, whatever store wrote it.
  std::shared_ptr<const DocumentKV> get(const CacheKey& key);
  // Stores `kv` (converted to the storage dtype) and returns the stored entry. Replacing an entry
  // keeps its pin. The store may keep `kv`'s own tensors (already where and in the dtype it
  // stores) and copy them to disk or Redis later, after the work queued on their device's current
  // stream at this call: they must not be written in place after it.
  std::shared_ptr<const DocumentKV> put(const CacheKey& key, const DocumentKV& kv);
  // Pinned entries are never evicted from memory, and an entry that cannot fit beside a tier's
  // pinned ones evicts nothing there. pin() is false when no memory tier holds the key.
  bool pin(const CacheKey& key);
  void unpin(const CacheKey& key);
  StoreStats stats() const;
  const StoreOptions& options() const;
  // Waits until the disk tier has made and the remote tier has tried every queued write (the
  // destructor does too).
  void flush();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A cache storage dtype: parse_dtype()'s names, "int8", "int8-int4" (kCacheInt8Int4) and "int4"
// (kCacheInt4); throws comb::Error on anything else.
c10::ScalarType parse_cache_dtype(const std::string& name);
std::string cache_dtype_name(c10::ScalarType dtype);

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/store.ipp"
#endif
