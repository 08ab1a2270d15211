// PICacheStore: tiers, LRU, pinning, disk format with checksums (see comb/store.hpp).
// Compiled into libcomb (src/store.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <xxhash.h>

#include <array>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "comb/cuda_backend.hpp"
#include "comb/detail/decode_step.hpp"
#include "comb/detail/mapped_file.hpp"
#include "comb/detail/redis_tier.hpp"
#include "comb/error.hpp"
#include "comb/log.hpp"
#include "comb/store.hpp"

namespace fs = std::filesystem;

namespace comb {

COMB_INLINE std::string CacheKey::hex() const { return fmt::format("{:016x}{:016x}", high, low); }

COMB_INLINE CacheKey CacheKey::from_hex(const std::string& hex) {
  COMB_CHECK(hex.size() == 32 && hex.find_first_not_of("0123456789abcdef") == std::string::npos,
             "'{}' is not a cache key (32 lower-case hex digits)", hex);
  return {std::stoull(hex.substr(0, 16), nullptr, 16), std::stoull(hex.substr(16), nullptr, 16)};
}

COMB_INLINE CacheKey PICacheStore::key(const std::vector<int32_t>& tokens, const std::string& plugin_fingerprint,
                           const std::string& tenant) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  auto put = [&](const void* p, uint64_t n) {
    XXH3_128bits_update(state, &n, sizeof(n));  // length first: no two inputs run together
    XXH3_128bits_update(state, p, n);
  };
  put(tokens.data(), tokens.size() * sizeof(int32_t));
  put(plugin_fingerprint.data(), plugin_fingerprint.size());
  put(tenant.data(), tenant.size());
  XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  return {h.high64, h.low64};
}

namespace detail::store {  // this file's own helpers

struct KeyHash {
  size_t operator()(const CacheKey& k) const { return static_cast<size_t>(k.low ^ (k.high * 0x9E3779B97F4A7C15ull)); }
};

// ---- Disk format -------------------------------------------------------------------------------
COMB_INLINE constexpr char kMagic[8] = {'C', 'O', 'M', 'B', 'K', 'V', '\0', '\1'};
struct DiskHeader {
  char magic[8];
  uint32_t version;  // 1
  uint32_t dtype;    // 0 float32, 1 bfloat16, 2 float16; int8: 3 (float32 scales, keys per channel,
                     // values per row; written before), 4 (float16 scales, keys per channel), 5
                     // (float16 scales, keys per row); int4 values (float16 scales): 6 and 7 (int8
                     // keys per channel, per row), 10 and 11 (int4 keys rotated, per channel, per
                     // row; 8 and 9 were int4 keys not rotated, written before: refused), 12 (int4
                     // keys rotated, per channel, the scales coded: per head 2 + head_dim / 2 bytes),
                     // 13 (as 12, centred: per head the coded scales, then head_dim int8 centres)
  uint32_t n_blocks, n_head_kv, head_dim, reserved;
  uint64_t n_tokens, payload_bytes, checksum;  // checksum: XXH3-64 of the payload
  uint64_t key_high, key_low;
};
static_assert(sizeof(DiskHeader) == 72, "disk header layout");

COMB_INLINE uint32_t dtype_code(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    case at::kChar: return 3;
    case kCacheInt8Int4: return 6;
    case kCacheInt4: return 10;
    default:
      COMB_FAIL("cache storage dtype must be float32, bfloat16, float16, int8, int8-int4 or int4, found {}",
                c10::toString(t));
  }
}
// The element types of an entry of code `c`'s keys and values (uint8: int4 codes, two a byte).
COMB_INLINE c10::ScalarType code_key_type(uint32_t c) {
  return c == 0 ? at::kFloat : c == 1 ? at::kBFloat16 : c == 2 ? at::kHalf : c <= 7 ? at::kChar : at::kByte;
}
COMB_INLINE c10::ScalarType code_value_type(uint32_t c) { return c <= 5 ? code_key_type(c) : at::kByte; }
COMB_INLINE bool code_key_rows(uint32_t c) { return c == 5 || c == 7 || c == 11; }
// Whether an entry of code `c` keeps its key scales coded (int4 keys: code_int4_key_scales).
COMB_INLINE bool code_key_scales_coded(uint32_t c) { return c == 12 || c == 13; }
// A head's coded key scales in an entry of code 12 or 13 (centred keys: their centres after them).
COMB_INLINE uint64_t coded_key_scale_bytes(uint32_t c, uint64_t head_dim) {
  return static_cast<uint64_t>(DocumentKV::coded_key_scale_bytes(static_cast<int64_t>(head_dim), c == 13));
}
// int8 entries: 4 with float16 scales and keys scaled per channel, 5 with float16 scales and keys
// per row (as quantize_int8_cpu writes them), 3 with float32 scales and keys per channel (as comb
// wrote int8 before).
COMB_INLINE uint32_t entry_code(const DocumentKV& kv) {
  const uint32_t c = dtype_code(kv.dtype());
  if (c < 3) return c;
  const at::Tensor& ks = kv.key_scales.at(0);
  if (ks.scalar_type() == at::kByte) {  // coded int4 key scales: checked as a reader checks them
    COMB_CHECK(c == 10, "{} entry: key scales of uint8 (coded int4 key scales belong to int4 entries)",
               cache_dtype_name(kv.dtype()));
    return int4_key_centres(kv.keys.at(0), ks).defined() ? 13 : 12;  // checked; a view, no copy
  }
  // [n_head_kv, 1, head_dim] per channel, [n_head_kv, n_tokens, 1] per row (the same numbers when
  // both are 1: a one-token document of head_dim 1).
  const bool per_channel = ks.size(1) == 1 && ks.size(2) == kv.head_dim();
  const bool half = ks.scalar_type() == at::kHalf;
  COMB_CHECK(half || (c == 3 && ks.scalar_type() == at::kFloat && per_channel),
             "{} entry: key scales [{}] of {}; expected float16{}", cache_dtype_name(kv.dtype()),
             fmt::join(ks.sizes(), ", "), c10::toString(ks.scalar_type()), c == 3 ? ", or float32 per channel" : "");
  if (c == 3) return !half ? 3 : per_channel ? 4 : 5;
  return c + (per_channel ? 0 : 1);
}
COMB_INLINE c10::ScalarType scale_dtype(uint32_t code) { return code == 3 ? at::kFloat : at::kHalf; }

COMB_INLINE std::string serialize(const CacheKey& key, const DocumentKV& kv) {
  DiskHeader h{};
  std::memcpy(h.magic, kMagic, 8);
  h.version = 1;
  h.dtype = entry_code(kv);
  h.n_blocks = static_cast<uint32_t>(kv.keys.size());
  h.n_head_kv = static_cast<uint32_t>(kv.keys[0].size(0));
  h.head_dim = static_cast<uint32_t>(kv.head_dim());
  h.n_tokens = static_cast<uint64_t>(kv.n_tokens);
  h.key_high = key.high;
  h.key_low = key.low;
  std::string payload;
  // Per block: K, V, then (int8) the key scales ([n_head_kv, head_dim] per channel, [n_head_kv,
  // n_tokens] per row) and the value scales [n_head_kv, n_tokens].
  for (size_t b = 0; b < kv.keys.size(); ++b) {
    std::vector<const at::Tensor*> parts{&kv.keys[b], &kv.values[b]};
    if (kv.quantized()) parts.insert(parts.end(), {&kv.key_scales.at(b), &kv.value_scales.at(b)});
    for (size_t i = 0; i < parts.size(); ++i) {
      at::Tensor c = parts[i]->to(at::kCPU).contiguous();
      // Both scales in the entry's scale dtype, except coded key scales: their bytes. Every block's
      // key scales in block 0's layout.
      const bool coded_scales = i == 2 && code_key_scales_coded(h.dtype);
      if (i == 2)
        COMB_CHECK((c.scalar_type() == at::kByte) == coded_scales &&
                       (!coded_scales ||
                        c.sizes() == at::IntArrayRef({h.n_head_kv, 1,
                                                      static_cast<int64_t>(coded_key_scale_bytes(h.dtype, h.head_dim))})),
                   "{} entry: block {} has key scales {} [{}]; expected them in block 0's layout",
                   cache_dtype_name(kv.dtype()), b, c10::toString(c.scalar_type()), fmt::join(c.sizes(), ", "));
      if (i >= 2 && !coded_scales) c = c.to(scale_dtype(h.dtype));
      payload.append(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
    }
  }
  h.payload_bytes = payload.size();
  h.checksum = XXH3_64bits(payload.data(), payload.size());
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h)) + payload;
}

// The entry in bytes [data, data + size), or nullopt (with the reason) when anything about it is
// wrong.
COMB_INLINE std::optional<DocumentKV> deserialize(const uint8_t* data, size_t size, const CacheKey& key, std::string& why) {
  if (size < sizeof(DiskHeader)) return why = "shorter than its header", std::nullopt;
  DiskHeader h;
  std::memcpy(&h, data, sizeof(h));
  if (std::memcmp(h.magic, kMagic, 8) != 0 || h.version != 1 || h.dtype > 13) return why = "bad magic or version", std::nullopt;
  if (h.dtype == 8 || h.dtype == 9) return why = "int4 keys not rotated (written by an older build)", std::nullopt;
  if (h.key_high != key.high || h.key_low != key.low) return why = "holds another key", std::nullopt;
  const c10::ScalarType key_type = code_key_type(h.dtype), value_type = code_value_type(h.dtype);
  // Sizes multiplied with overflow checks: a header whose product wraps around is refused here,
  // not trusted to size a tensor.
  // key_block, value_block: one block's K or V (int4: head_dim / 2 bytes a row); scales: a
  // quantized block's key and value scales (float16; float32 for dtype 3).
  const bool int8 = h.dtype >= 3, key_rows = code_key_rows(h.dtype), coded = code_key_scales_coded(h.dtype);
  if ((key_type == at::kByte || value_type == at::kByte) && h.head_dim % 2 != 0)
    return why = "int4 codes with an odd head_dim", std::nullopt;
  if (key_type == at::kByte && !DocumentKV::rotates_int4_keys(static_cast<int64_t>(h.head_dim)))
    return why = "rotated int4 keys with a head_dim that is not a power of two", std::nullopt;
  auto row_bytes = [&](c10::ScalarType t) {
    return t == at::kByte ? uint64_t(h.head_dim) / 2 : uint64_t(h.head_dim) * c10::elementSize(t);
  };
  const uint64_t scale_bytes = c10::elementSize(scale_dtype(h.dtype));
  // A head's key scales: coded (2 + head_dim / 2 bytes), per row or per channel.
  uint64_t key_block = 0, value_block = 0, scales = 0, kv_bytes = 0, per_block = 0, total = 0;
  uint64_t key_scale_bytes = coded_key_scale_bytes(h.dtype, h.head_dim), value_scale_bytes = 0, head_scale_bytes = 0;
  const bool wraps = (!coded && __builtin_mul_overflow(uint64_t(key_rows ? h.n_tokens : h.head_dim), scale_bytes,
                                                       &key_scale_bytes)) ||
                     __builtin_mul_overflow(uint64_t(h.n_head_kv) * row_bytes(key_type), h.n_tokens, &key_block) ||
                     __builtin_mul_overflow(uint64_t(h.n_head_kv) * row_bytes(value_type), h.n_tokens, &value_block) ||
                     __builtin_mul_overflow(uint64_t(h.n_tokens), scale_bytes, &value_scale_bytes) ||
                     __builtin_add_overflow(key_scale_bytes, value_scale_bytes, &head_scale_bytes) ||
                     __builtin_mul_overflow(uint64_t(h.n_head_kv), head_scale_bytes, &scales) ||
                     __builtin_add_overflow(key_block, value_block, &kv_bytes) ||
                     __builtin_add_overflow(kv_bytes, int8 ? scales : 0, &per_block) ||
                     __builtin_mul_overflow(per_block, uint64_t(h.n_blocks), &total);
  if (wraps || h.n_blocks == 0 || key_block == 0 || h.payload_bytes != total ||
      size != sizeof(DiskHeader) + h.payload_bytes)
    return why = "truncated or sizes inconsistent", std::nullopt;
  const uint8_t* payload = data + sizeof(DiskHeader);
  if (XXH3_64bits(payload, h.payload_bytes) != h.checksum) return why = "checksum mismatch", std::nullopt;
  DocumentKV kv;
  kv.n_tokens = static_cast<int64_t>(h.n_tokens);
  auto shape = [&](c10::ScalarType t) {
    return std::vector<int64_t>{h.n_head_kv, static_cast<int64_t>(h.n_tokens),
                                t == at::kByte ? h.head_dim / 2 : h.head_dim};
  };
  for (uint32_t b = 0; b < h.n_blocks; ++b) {
    const uint8_t* src = payload + b * per_block;
    at::Tensor k = at::empty(shape(key_type), key_type), v = at::empty(shape(value_type), value_type);
    std::memcpy(k.data_ptr(), src, key_block);
    std::memcpy(v.data_ptr(), src + key_block, value_block);
    kv.keys.push_back(k);
    kv.values.push_back(v);
    if (!int8) continue;
    const c10::ScalarType scale_type = scale_dtype(h.dtype);
    at::Tensor ks = coded     ? at::empty({h.n_head_kv, 1, static_cast<int64_t>(key_scale_bytes)}, at::kByte)
                    : key_rows ? at::empty({h.n_head_kv, static_cast<int64_t>(h.n_tokens), 1}, scale_type)
                               : at::empty({h.n_head_kv, 1, h.head_dim}, scale_type);
    at::Tensor vs = at::empty({h.n_head_kv, static_cast<int64_t>(h.n_tokens), 1}, scale_type);
    const uint64_t ks_bytes = ks.numel() * ks.element_size();
    std::memcpy(ks.data_ptr(), src + kv_bytes, ks_bytes);
    std::memcpy(vs.data_ptr(), src + kv_bytes + ks_bytes, vs.numel() * scale_bytes);
    // Scales are checked like the rest: a scale that is not a finite positive number is refused
    // (coded ones as the float16 scales they stand for).
    const at::Tensor kf = coded ? int4_key_scales(k, ks) : ks;
    if (!(kf > 0).all().item<bool>() || !(vs > 0).all().item<bool>() || !kf.isfinite().all().item<bool>() ||
        !vs.isfinite().all().item<bool>())
      return why = "an int8 scale is not a finite positive number", std::nullopt;
    kv.key_scales.push_back(ks);
    kv.value_scales.push_back(vs);
  }
  return kv;
}

COMB_INLINE std::optional<DocumentKV> deserialize(const std::string& path, const CacheKey& key, std::string& why) {
  detail::MappedFile f(path);
  return deserialize(f.data(), f.size(), key, why);
}

COMB_INLINE std::string remote_key(const CacheKey& key) { return "comb:kv:" + key.hex(); }

// ---- Tiers -------------------------------------------------------------------------------------
struct MemoryTier {
  struct Slot {
    std::shared_ptr<const DocumentKV> kv;
    std::list<CacheKey>::iterator lru;
    int64_t bytes;
    bool pinned;
  };
  int64_t budget = 0;
  c10::Device device = c10::kCPU;
  TierStats stats;
  std::list<CacheKey> lru;  // front: most recently used
  std::unordered_map<CacheKey, Slot, KeyHash> slots;

  bool enabled() const { return budget > 0; }
  void touch(Slot& s, const CacheKey& key) {
    lru.erase(s.lru);
    lru.push_front(key);
    s.lru = lru.begin();
  }
  void erase(const CacheKey& key) {
    auto it = slots.find(key);
    stats.bytes -= it->second.bytes;
    lru.erase(it->second.lru);
    slots.erase(it);
  }
};

// Every part of an entry: per block its keys and values, then (int8 or int4) its scales.
COMB_INLINE std::vector<at::Tensor> parts_of(const DocumentKV& kv) {
  std::vector<at::Tensor> parts;
  for (const auto* v : {&kv.keys, &kv.values, &kv.key_scales, &kv.value_scales})
    parts.insert(parts.end(), v->begin(), v->end());
  return parts;
}
// An entry like `like` whose parts are `parts` (parts_of's order).
COMB_INLINE DocumentKV with_parts(const DocumentKV& like, std::vector<at::Tensor> parts) {
  DocumentKV out;
  out.n_tokens = like.n_tokens;
  size_t i = 0;
  for (auto [from, to] : {std::pair{&like.keys, &out.keys}, std::pair{&like.values, &out.values},
                          std::pair{&like.key_scales, &out.key_scales}, std::pair{&like.value_scales, &out.value_scales}})
    for (size_t b = 0; b < from->size(); ++b) to->push_back(std::move(parts.at(i++)));
  return out;
}
// `kv` with every part in one page-locked host allocation (itself when it is there already).
COMB_INLINE std::shared_ptr<const DocumentKV> pinned(std::shared_ptr<const DocumentKV> kv,
                                                    const detail::CudaLayerOps& ops) {
  std::vector<at::Tensor> parts = parts_of(*kv);
  std::vector<at::Tensor> out = ops.pin_host(parts);
  bool same = true;
  for (size_t i = 0; i < parts.size(); ++i) same = same && out[i].is_same(parts[i]);
  return same ? kv : std::make_shared<const DocumentKV>(with_parts(*kv, std::move(out)));
}

// For an entry on a device: an event recorded on the device's current stream, after the work
// queued there that makes the entry, for another thread to wait on before it reads the entry
// (serialize() copies it to the host on that thread's own stream). Null for a host entry.
COMB_INLINE std::shared_ptr<const c10::Event> readiness_of(const DocumentKV& kv) {
  const c10::Device device = kv.keys.at(0).device();
  if (device.is_cpu()) return nullptr;
  c10::impl::VirtualGuardImpl impl(device.type());
  auto event = std::make_shared<c10::Event>(device.type());
  event->record(impl.getStream(device));
  return event;
}

// serialize(key, kv) on another thread than the one that made `kv`: after the work `ready` marks
// (readiness_of), and for an entry on a device with its copies to the host on a stream of the
// device's high-priority pool (its copies then overlap the work on the device's other streams,
// where the default stream would wait for that work and hold it up; CUDA graphs are captured on
// the low-priority pool's streams, never on these).
COMB_INLINE std::string serialize_when_ready(const CacheKey& key, const DocumentKV& kv, const c10::Event* ready) {
  if (!ready) return serialize(key, kv);
  ready->synchronize();
  const c10::Device device = kv.keys.at(0).device();
  c10::impl::VirtualGuardImpl impl(device.type());
  const c10::StreamGuard on_side(impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true));
  return serialize(key, kv);
}

}  // namespace detail::store

struct PICacheStore::Impl {
  StoreOptions options;
  mutable std::mutex mutex;
  std::vector<detail::store::MemoryTier> memory;  // [0] device (when CUDA), then host
  // Disk tier: files "<key hex>.kv"; LRU order and sizes kept here.
  TierStats disk;
  std::list<CacheKey> disk_lru;
  struct DiskFile {
    std::list<CacheKey>::iterator lru;
    int64_t bytes = 0;
    uint64_t generation = 0;  // which file of this key (a key's file may be evicted and written again)
  };
  std::unordered_map<CacheKey, DiskFile, detail::store::KeyHash> disk_files;
  uint64_t disk_generation = 0;
  int64_t corrupt = 0, write_errors = 0;
  // The disk tier's writes, made by `writer` in the order put() queued them: `disk_queue` holds
  // the keys not yet taken, `disk_pending` every entry not yet written (taken or not), whose bytes
  // `disk_queued_bytes` counts. Guarded by `mutex`; `disk_progress` is notified when a write ends.
  struct PendingWrite {
    std::shared_ptr<const DocumentKV> kv;
    std::shared_ptr<const c10::Event> ready;  // an entry on a device: recorded after the work making it
    uint64_t seq = 0;                         // its place in the queue (1, 2, ...)
  };
  std::deque<CacheKey> disk_queue;
  std::unordered_map<CacheKey, PendingWrite, detail::store::KeyHash> disk_pending;
  int64_t disk_queued_bytes = 0;
  // Writes queued so far, and how many of the first ones have ended (written or failed).
  uint64_t disk_queued_seq = 0, disk_done_seq = 0;
  // Callers of disk_write() take a ticket and are let into the queue in that order, so that a large
  // entry waiting for room is not overtaken for ever by smaller ones.
  uint64_t disk_tickets = 0, disk_admitting = 0;
  bool writer_stop = false;
  std::condition_variable disk_work, disk_progress;
  std::thread writer;
  // Remote tier (Redis): its own locking; the store's mutex is never held across a network call.
  std::unique_ptr<detail::RedisTier> remote;
  TierStats remote_stats;

  bool disk_enabled() const { return options.disk_bytes > 0 && !options.disk_dir.empty(); }
  // comb's CUDA ops when memory tier `t` is the host tier beside an enabled CUDA device tier and
  // keeps its entries page-locked (StoreOptions::pinned_host); else null.
  const detail::CudaLayerOps* pinning(size_t t) const {
    if (!options.pinned_host || t == 0 || !memory[0].device.is_cuda() || !memory[0].enabled() ||
        !memory[t].device.is_cpu())
      return nullptr;
    const detail::CudaLayerOps* ops = detail::cuda_layer_ops();
    return ops && ops->pin_host && ops->to_device_async ? ops : nullptr;
  }
  // A host tier entry (tier `t`) copied to the device tier in the storage dtype: page-locked ones
  // on a side stream (to_device_async), others as DocumentKV::to copies.
  DocumentKV promoted(size_t t, const DocumentKV& kv) const {
    const detail::CudaLayerOps* ops = pinning(t);
    if (!ops || kv.dtype() != dtype_for(kv)) return kv.to(memory[0].device, dtype_for(kv));
    return detail::store::with_parts(kv, ops->to_device_async(detail::store::parts_of(kv), memory[0].device));
  }
  std::string path_of(const CacheKey& k) const { return options.disk_dir + "/" + k.hex() + ".kv"; }
  // `kv` as memory tier `t` keeps it: on its device, in the storage dtype, page-locked where it
  // pins (copied there straight from the device when the dtype is the storage one). Where
  // page-locked memory runs out, the entry is kept in pageable memory (logged once).
  std::shared_ptr<const DocumentKV> converted(size_t t, std::shared_ptr<const DocumentKV> kv) {
    if (const detail::CudaLayerOps* pin = pinning(t)) {
      if (kv->dtype() != dtype_for(*kv)) kv = std::make_shared<const DocumentKV>(kv->to(memory[t].device, dtype_for(*kv)));
      try {
        return detail::store::pinned(kv, *pin);
      } catch (const std::exception& e) {
        warn_unpinned(e);
      }
    }
    if (kv->keys[0].device() != memory[t].device || kv->dtype() != dtype_for(*kv))
      kv = std::make_shared<const DocumentKV>(kv->to(memory[t].device, dtype_for(*kv)));
    return kv;
  }
  bool warned_unpinned = false;
  void warn_unpinned(const std::exception& e) {
    if (!warned_unpinned)
      log(LogLevel::warning, "cache store: host tier entries kept in pageable memory (page-locked memory failed: {})",
          e.what());
    warned_unpinned = true;
  }

  // Inserts into memory tier `t` (or the ones after it), evicting LRU unpinned entries; never
  // exceeds a budget. An entry evicted from a tier moves to the next memory tier, if any.
  // Returns the entry as stored (converted to its tier's device), or as given if no tier took it.
  std::shared_ptr<const DocumentKV> insert(size_t t, const CacheKey& key, std::shared_ptr<const DocumentKV> kv) {
    for (; t < memory.size(); ++t) {
      detail::store::MemoryTier& tier = memory[t];
      // Storage bytes are known before any copy: an entry this tier cannot hold beside its pinned
      // ones is neither copied to its device nor allowed to evict anything.
      const int64_t bytes = storage_bytes(*kv);
      if (!fits(tier, bytes)) continue;
      kv = converted(t, std::move(kv));
      std::vector<std::pair<CacheKey, std::shared_ptr<const DocumentKV>>> evicted;
      while (tier.stats.bytes + bytes > tier.budget) {  // ends: the unpinned bytes cover the excess
        auto victim = tier.lru.rbegin();
        while (tier.slots.at(*victim).pinned) ++victim;
        CacheKey vk = *victim;
        evicted.emplace_back(vk, tier.slots.at(vk).kv);
        tier.erase(vk);
        ++tier.stats.evictions;
      }
      tier.lru.push_front(key);
      tier.slots[key] = {kv, tier.lru.begin(), bytes, false};
      tier.stats.bytes += bytes;
      for (auto& [vk, vkv] : evicted) insert(t + 1, vk, vkv);
      return kv;
    }
    return kv;
  }

  // The dtype `kv` is stored in: the store's, or with the store's dtype "auto" (Undefined) its own.
  c10::ScalarType dtype_for(const DocumentKV& kv) const {
    return options.dtype == c10::ScalarType::Undefined ? kv.dtype() : options.dtype;
  }
  // Bytes `kv` takes once converted to the storage dtype (its own where it is kept as it is: an
  // entry of the storage dtype, whose scales may be of another layout than this build writes, as
  // an int4 entry read from an older build's file).
  int64_t storage_bytes(const DocumentKV& kv) const {
    if (kv.quantized() && kv.dtype() == dtype_for(kv)) return kv.bytes();
    const at::Tensor& k = kv.keys.at(0);
    return DocumentKV::storage_bytes(dtype_for(kv), static_cast<int64_t>(kv.keys.size()), k.size(0), kv.head_dim(),
                                     k.size(1));
  }
  // Whether `tier` can hold `bytes` beside its pinned entries (evicting unpinned ones as needed).
  static bool fits(const detail::store::MemoryTier& tier, int64_t bytes) {
    if (!tier.enabled()) return false;
    int64_t pinned = 0;
    for (const auto& [k, slot] : tier.slots)
      if (slot.pinned) pinned += slot.bytes;
    return bytes <= tier.budget - pinned;
  }

  // Queues `kv` for the disk tier (the caller holds `lock` on `mutex`): the writer thread
  // serializes and writes it, so put() waits neither for the file nor for its fsync, nor, for an
  // entry on a device, for the device to finish the work that makes it (readiness_of()). The
  // queue's memory is bounded and no write is dropped: while the entries waiting and this one
  // would take more than StoreOptions::disk_queue_bytes, this waits for the writer (an entry over
  // the bound alone waits for an empty queue, then for its own write; callers are let in in the
  // order they came). Throws nothing: an entry that cannot be queued is a failed write (logged,
  // counted), not on disk.
  void disk_write(std::unique_lock<std::mutex>& lock, const CacheKey& key, std::shared_ptr<const DocumentKV> kv) {
    auto known = [&] { return disk_files.count(key) || disk_pending.count(key); };
    if (!disk_enabled() || known()) return;
    const int64_t bytes = static_cast<int64_t>(sizeof(detail::store::DiskHeader)) + kv->bytes();
    if (bytes > options.disk_bytes) return;  // could never be written (serialize() makes exactly these bytes)
    const uint64_t ticket = disk_tickets++;
    struct Turn {  // the next caller's turn, however this one leaves
      Impl& impl;
      ~Turn() {
        ++impl.disk_admitting;
        impl.disk_progress.notify_all();
      }
    };
    try {
      disk_progress.wait(lock, [&] {
        return disk_admitting == ticket &&
               (disk_queued_bytes + bytes <= options.disk_queue_bytes || disk_pending.empty());
      });
      const Turn turn{*this};
      if (known()) return;  // queued or written by another caller meanwhile
      std::shared_ptr<const c10::Event> ready = detail::store::readiness_of(*kv);
      const uint64_t seq = disk_queued_seq + 1;
      disk_queue.push_back(key);
      try {
        disk_pending.emplace(key, PendingWrite{std::move(kv), std::move(ready), seq});
      } catch (...) {
        disk_queue.pop_back();
        throw;
      }
      disk_queued_seq = seq;
      disk_queued_bytes += bytes;
    } catch (const std::exception& e) {
      ++write_errors;
      log(LogLevel::warning, "cache store: an entry could not be queued for the disk, it is not written there: {}",
          e.what());
      return;
    }
    disk_work.notify_one();
    disk_progress.wait(lock, [&] { return disk_queued_bytes <= options.disk_queue_bytes || !disk_pending.count(key); });
  }

  // The writer thread: takes queued entries in order, serializes and writes each outside the
  // lock. The bytes of the file being written are counted in `disk.bytes` from the moment room is
  // made for them (older files evicted), so the budget holds throughout. Ends when stopped and
  // every queued entry is written. Nothing escapes it: a write that fails in any way is counted.
  void write_loop() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      disk_work.wait(lock, [&] { return writer_stop || !disk_queue.empty(); });
      if (disk_queue.empty()) return;  // stopped, nothing left
      const CacheKey key = disk_queue.front();
      disk_queue.pop_front();
      auto found = disk_pending.find(key);
      if (found == disk_pending.end()) continue;
      const PendingWrite job = found->second;
      const int64_t queued = static_cast<int64_t>(sizeof(detail::store::DiskHeader)) + job.kv->bytes();
      std::string failure;
      try {
        write_one(lock, key, job, failure);
      } catch (const std::exception& e) {
        failure = e.what();
      } catch (...) {
        failure = "unknown error";
      }
      if (!lock.owns_lock()) lock.lock();
      if (!failure.empty()) {
        ++write_errors;
        log(LogLevel::warning, "cache store: disk write failed, the entry is not on disk: {}", failure);
      }
      disk_pending.erase(key);
      disk_queued_bytes -= queued;
      disk_done_seq = job.seq;
      disk_progress.notify_all();
    }
  }

  // One queued entry serialized and written (the caller holds `lock`; it is released around the
  // work, and held again on a normal return). Sets `failure` when the entry is not written.
  void write_one(std::unique_lock<std::mutex>& lock, const CacheKey& key, const PendingWrite& job, std::string& failure) {
    lock.unlock();
    std::string bytes;
    try {
      bytes = detail::store::serialize_when_ready(key, *job.kv, job.ready.get());
    } catch (const std::exception& e) {
      failure = e.what();
    }
    const auto size = static_cast<int64_t>(bytes.size());
    lock.lock();
    if (!failure.empty() || size > options.disk_bytes) return;
    while (disk.bytes + size > options.disk_bytes && !disk_lru.empty()) disk_remove(disk_lru.back(), /*evicted=*/true);
    disk.bytes += size;  // room held for the file while it is written
    lock.unlock();
    bool written = false;
    try {
      detail::write_file_atomic(path_of(key), bytes, 0600);  // documents' K/V: the owner's only
      written = true;
    } catch (const std::exception& e) {
      failure = e.what();
    }
    lock.lock();
    if (!written) {
      disk.bytes -= size;
      return;
    }
    try {
      disk_lru.push_front(key);
      disk_files[key] = {disk_lru.begin(), size, ++disk_generation};
    } catch (...) {  // out of memory: the file stays uncounted until a restart finds it
      if (!disk_lru.empty() && disk_lru.front() == key && !disk_files.count(key)) disk_lru.pop_front();
      disk.bytes -= size;
      throw;
    }
  }

  // Waits until every disk write queued before the call has been made or has failed (the caller
  // holds `lock`); writes queued meanwhile by other callers are not waited for.
  void wait_for_disk(std::unique_lock<std::mutex>& lock) {
    const uint64_t until = disk_queued_seq;
    disk_progress.wait(lock, [&] { return disk_done_seq >= until; });
  }

  ~Impl() { stop_writer(); }  // every queued disk write made before the tiers go

  void stop_writer() {
    if (!writer.joinable()) return;
    {
      std::lock_guard<std::mutex> guard(mutex);
      writer_stop = true;
    }
    disk_work.notify_all();
    writer.join();
  }

  void disk_remove(const CacheKey& key, bool evicted) {
    auto it = disk_files.find(key);
    if (it == disk_files.end()) return;
    std::error_code ec;
    fs::remove(path_of(key), ec);
    disk.bytes -= it->second.bytes;
    disk_lru.erase(it->second.lru);
    disk_files.erase(it);
    if (evicted) ++disk.evictions;
  }

  // The entry from the memory tiers or the disk tier's queue (the caller holds `mutex`), or
  // nullptr; `disk_path` is then the entry's file when the disk tier has one (and `generation`
  // which), to be read without the lock (read_disk()).
  std::shared_ptr<const DocumentKV> get_local(const CacheKey& key, std::string& disk_path, uint64_t& generation);
  // The disk tier's file of `key` read (the caller does not hold `mutex`: other calls go on
  // meanwhile), checked and promoted, or nullptr. A file that fails its checks is dropped unless
  // it was evicted (or evicted and written again) while it was read.
  std::shared_ptr<const DocumentKV> read_disk(const CacheKey& key, const std::string& path, uint64_t generation);

  void scan_disk() {
    std::error_code ec;
    fs::create_directories(options.disk_dir, ec);
    COMB_CHECK(fs::is_directory(options.disk_dir), "cache directory '{}' cannot be created: {}", options.disk_dir,
               ec ? ec.message() : "a file of that name is in the way");
    std::string probe = options.disk_dir + "/.comb-write-probe";
    try {
      detail::write_file_atomic(probe, "ok");
    } catch (const Error& e) {
      COMB_FAIL("cache directory '{}' is not writable: {}", options.disk_dir, e.what());
    }
    fs::remove(probe, ec);
    std::vector<std::pair<fs::file_time_type, std::pair<CacheKey, int64_t>>> found;
    for (const auto& e : fs::directory_iterator(options.disk_dir)) {
      std::string name = e.path().filename().string();
      if (!e.is_regular_file() || name.size() != 35 || name.substr(32) != ".kv") continue;
      try {
        found.push_back({e.last_write_time(), {CacheKey::from_hex(name.substr(0, 32)), int64_t(e.file_size())}});
      } catch (const Error&) {
      }
    }
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (const auto& [time, entry] : found) {
      disk_lru.push_back(entry.first);
      disk_files[entry.first] = {std::prev(disk_lru.end()), entry.second, ++disk_generation};
      disk.bytes += entry.second;
    }
    while (disk.bytes > options.disk_bytes && !disk_lru.empty()) disk_remove(disk_lru.back(), true);
  }
};

COMB_INLINE PICacheStore::PICacheStore(StoreOptions options) : impl_(std::make_unique<Impl>()) {
  if (options.dtype != c10::ScalarType::Undefined)
    detail::store::dtype_code(options.dtype);  // validates (Undefined: auto)
  COMB_CHECK(options.device_bytes >= 0 && options.host_bytes >= 0 && options.disk_bytes >= 0,
             "cache budgets must be >= 0 (device {}, host {}, disk {})", options.device_bytes, options.host_bytes,
             options.disk_bytes);
  COMB_CHECK(options.disk_bytes == 0 || !options.disk_dir.empty(), "a disk budget needs a cache directory");
  COMB_CHECK(options.disk_queue_bytes >= 0, "the disk tier's queue must be >= 0 bytes, found {}",
             options.disk_queue_bytes);
  impl_->options = options;
  if (options.device.is_cuda()) {
    load_cuda_backend();  // before anything asks LibTorch about CUDA
    detail::store::MemoryTier device;
    device.budget = options.device_bytes;
    device.device = options.device;
    impl_->memory.push_back(std::move(device));
  }
  detail::store::MemoryTier host;
  host.budget = options.host_bytes;
  impl_->memory.push_back(std::move(host));
  if (impl_->disk_enabled()) impl_->scan_disk();
  if (!options.remote_url.empty()) {
    detail::RedisTierOptions remote;
    remote.address = detail::parse_redis_url(options.remote_url);
    remote.ttl_s = options.remote_ttl_s;
    remote.timeout_ms = options.remote_timeout_ms;
    remote.backoff_ms = options.remote_backoff_ms;
    impl_->remote = std::make_unique<detail::RedisTier>(remote);
  }
  // Last: nothing after it throws (and ~Impl stops it when a later member's destructor runs).
  if (impl_->disk_enabled()) impl_->writer = std::thread([impl = impl_.get()] { impl->write_loop(); });
}

COMB_INLINE PICacheStore::~PICacheStore() = default;  // ~Impl: every queued disk write made first

COMB_INLINE void PICacheStore::flush() {
  {
    std::unique_lock<std::mutex> lock(impl_->mutex);
    impl_->wait_for_disk(lock);
  }
  if (impl_->remote) impl_->remote->flush();
}

COMB_INLINE const StoreOptions& PICacheStore::options() const { return impl_->options; }

COMB_INLINE std::shared_ptr<const DocumentKV> PICacheStore::get(const CacheKey& key) {
  std::string disk_path;
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (auto hit = impl_->get_local(key, disk_path, generation)) return hit;
  }
  if (!disk_path.empty())
    if (auto hit = impl_->read_disk(key, disk_path, generation)) return hit;
  if (!impl_->remote) return nullptr;
  std::string why;
  std::optional<DocumentKV> kv;
  bool found = false;
  impl_->remote->read(detail::store::remote_key(key), [&](const char* data, size_t size) {
    found = true;
    try {  // straight from the reply's buffer: one copy, into the entry's tensors
      kv = detail::store::deserialize(reinterpret_cast<const uint8_t*>(data), size, key, why);
    } catch (const std::exception& e) {
      why = e.what();
    }
    return kv.has_value();
  });
  std::unique_lock<std::mutex> lock(impl_->mutex);
  if (!kv) {
    ++impl_->remote_stats.misses;
    if (found) {  // there, but not an entry of this key: dropped, to be computed and written again
      ++impl_->corrupt;
      log(LogLevel::warning, "cache store: dropped corrupt Redis entry {} ({})", key.hex(), why);
      impl_->remote->remove(detail::store::remote_key(key));
    }
    return nullptr;
  }
  ++impl_->remote_stats.hits;
  // Another caller may have stored it while this one read: theirs stands.
  for (auto& tier : impl_->memory)
    if (auto it = tier.slots.find(key); it != tier.slots.end()) return it->second.kv;
  if (kv->dtype() != impl_->dtype_for(*kv)) *kv = kv->to(at::kCPU, impl_->dtype_for(*kv));
  auto entry = std::make_shared<const DocumentKV>(std::move(*kv));
  auto stored = impl_->insert(0, key, entry);
  impl_->disk_write(lock, key, entry);  // last: it may wait, letting other calls change the tiers
  return stored;
}

COMB_INLINE std::shared_ptr<const DocumentKV> PICacheStore::Impl::get_local(const CacheKey& key, std::string& disk_path,
                                                                          uint64_t& generation) {
  for (size_t t = 0; t < memory.size(); ++t) {
    auto it = memory[t].slots.find(key);
    if (it == memory[t].slots.end()) {
      ++memory[t].stats.misses;
      continue;
    }
    ++memory[t].stats.hits;
    std::shared_ptr<const DocumentKV> kv = it->second.kv;
    if (t > 0 && !it->second.pinned && fits(memory[0], it->second.bytes)) {  // promote to the fastest tier
      // The copy first: if it throws (device memory), the entry stays where it was.
      auto moved = std::make_shared<const DocumentKV>(promoted(t, *kv));
      memory[t].erase(key);
      return insert(0, key, moved);
    }
    memory[t].touch(it->second, key);
    return kv;
  }
  if (disk_enabled()) {
    // An entry queued for the disk tier and not yet written is there already.
    if (auto p = disk_pending.find(key); p != disk_pending.end()) {
      ++disk.hits;
      return insert(0, key, p->second.kv);
    }
    if (auto f = disk_files.find(key); f != disk_files.end()) {
      disk_path = path_of(key);
      generation = f->second.generation;
    } else {
      ++disk.misses;
    }
  }
  return nullptr;
}

COMB_INLINE std::shared_ptr<const DocumentKV> PICacheStore::Impl::read_disk(const CacheKey& key, const std::string& path,
                                                                          uint64_t generation) {
  std::string why;
  std::optional<DocumentKV> kv;
  try {
    kv = detail::store::deserialize(path, key, why);
  } catch (const std::exception& e) {  // comb::Error, c10::Error, std::bad_alloc: a bad file, not a crash
    why = e.what();
  }
  // A file written by a store of another storage dtype is converted, like every entry.
  if (kv && kv->dtype() != dtype_for(*kv)) *kv = kv->to(at::kCPU, dtype_for(*kv));
  std::lock_guard<std::mutex> lock(mutex);
  auto it = disk_files.find(key);
  if (!kv) {
    ++disk.misses;
    // Evicted while it was read: a miss. Still the file that was read: bad, dropped to be recomputed.
    if (it != disk_files.end() && it->second.generation == generation) {
      ++corrupt;
      log(LogLevel::warning, "cache store: dropped corrupt entry {} ({})", key.hex(), why);
      disk_remove(key, /*evicted=*/false);
    }
    return nullptr;
  }
  ++disk.hits;
  if (it != disk_files.end()) {
    disk_lru.erase(it->second.lru);
    disk_lru.push_front(key);
    it->second.lru = disk_lru.begin();
  }
  // Another caller may have stored it while this one read: theirs stands.
  for (auto& tier : memory)
    if (auto m = tier.slots.find(key); m != tier.slots.end()) return m->second.kv;
  return insert(0, key, std::make_shared<const DocumentKV>(std::move(*kv)));
}

COMB_INLINE std::shared_ptr<const DocumentKV> PICacheStore::put(const CacheKey& key, const DocumentKV& kv) {
  RECORD_FUNCTION("comb::store_put", std::vector<c10::IValue>());
  COMB_CHECK(!kv.keys.empty() && kv.keys.size() == kv.values.size(), "cache entry {} has no K/V blocks", key.hex());
  std::unique_lock<std::mutex> lock(impl_->mutex);
  bool pinned = false;  // a replaced entry keeps its pin
  for (auto& tier : impl_->memory)
    if (auto it = tier.slots.find(key); it != tier.slots.end()) {
      pinned = pinned || it->second.pinned;
      tier.erase(key);
    }
  // Converted on the first tier that can hold it (the device tier only when it fits there).
  const int64_t bytes = impl_->storage_bytes(kv);
  auto top = std::find_if(impl_->memory.begin(), impl_->memory.end(),
                          [&](const detail::store::MemoryTier& t) { return Impl::fits(t, bytes); });
  c10::Device where = top == impl_->memory.end() ? c10::Device(c10::kCPU) : top->device;
  const size_t tier = static_cast<size_t>(top - impl_->memory.begin());
  auto entry = top != impl_->memory.end() && impl_->pinning(tier)  // page-locked: one copy
                   ? impl_->converted(tier, std::make_shared<const DocumentKV>(kv))
                   : std::make_shared<const DocumentKV>(kv.to(where, impl_->dtype_for(kv)));
  auto stored = impl_->insert(0, key, entry);
  if (pinned)
    for (auto& tier : impl_->memory)
      if (auto it = tier.slots.find(key); it != tier.slots.end()) it->second.pinned = true;
  impl_->disk_write(lock, key, entry);  // last: it may wait, letting other calls change the tiers
  lock.unlock();
  if (impl_->remote)  // serialized and written by the tier's thread: put() waits for neither
    impl_->remote->put_lazy(detail::store::remote_key(key),
                            static_cast<int64_t>(sizeof(detail::store::DiskHeader)) + entry->bytes(),
                            [key, entry, ready = detail::store::readiness_of(*entry)] {
                              return detail::store::serialize_when_ready(key, *entry, ready.get());
                            });
  return stored;
}

COMB_INLINE bool PICacheStore::pin(const CacheKey& key) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (auto& tier : impl_->memory)
    if (auto it = tier.slots.find(key); it != tier.slots.end()) return it->second.pinned = true;
  return false;
}

COMB_INLINE void PICacheStore::unpin(const CacheKey& key) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (auto& tier : impl_->memory)
    if (auto it = tier.slots.find(key); it != tier.slots.end()) it->second.pinned = false;
}

COMB_INLINE StoreStats PICacheStore::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  StoreStats s;
  auto fill = [](const detail::store::MemoryTier& t) {
    TierStats out = t.stats;
    out.entries = static_cast<int64_t>(t.slots.size());
    out.budget = t.budget;
    return out;
  };
  const auto& memory = impl_->memory;
  if (memory.size() == 2) s.device = fill(memory[0]);
  s.host = fill(memory.back());
  s.disk = impl_->disk;
  s.disk.entries = static_cast<int64_t>(impl_->disk_files.size());
  s.disk.budget = impl_->options.disk_bytes;
  s.disk_queued = static_cast<int64_t>(impl_->disk_pending.size());
  s.corrupt = impl_->corrupt;
  s.write_errors = impl_->write_errors;
  if (impl_->remote) {
    detail::RedisTierStats r = impl_->remote->stats();
    s.remote = impl_->remote_stats;
    s.remote.bytes = r.bytes_written;
    s.remote_errors = r.errors;
    s.remote_dropped = r.dropped_writes;
    s.remote_online = r.online;
  }
  return s;
}

COMB_INLINE c10::ScalarType parse_cache_dtype(const std::string& name) {
  if (name == "auto") return c10::ScalarType::Undefined;
  if (name == "int8") return at::kChar;
  if (name == "int8-int4") return kCacheInt8Int4;
  if (name == "int4") return kCacheInt4;
  try {
    return parse_dtype(name);
  } catch (const Error&) {
    COMB_FAIL("unknown cache dtype '{}' (expected auto, float32, bfloat16, float16, int8, int8-int4 or int4)", name);
  }
}

COMB_INLINE std::string cache_dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kChar: return "int8";
    case kCacheInt8Int4: return "int8-int4";
    case kCacheInt4: return "int4";
    case c10::ScalarType::Undefined: return "auto";
    default: return c10::toString(dtype);
  }
}

}  // namespace comb
