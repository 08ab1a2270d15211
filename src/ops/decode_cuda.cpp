// comb's fused decoder ops on CUDA (adapters of decode_kernels.hpp: checks, then the launch on the
// current stream) and the one-launch decoding step built from them (detail/decode_step.hpp): the
// step's kernels and cuBLAS GEMMs over static buffers, captured once as a CUDA graph and replayed.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CachingHostAllocator.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_profiler_api.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>

#include "comb/detail/decode_step.hpp"
#include "comb/error.hpp"
#include "decode_kernels.hpp"

namespace comb::ops {

namespace {

namespace k = comb::detail::cuda;

k::Half half_type(const at::Tensor& t, const char* op) {
  COMB_CHECK(t.is_cuda() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf),
             "{}: expected a float16 or bfloat16 CUDA tensor, found {} on {}", op, c10::toString(t.scalar_type()),
             t.device().str());
  return t.scalar_type() == at::kBFloat16 ? k::Half::bf16 : k::Half::f16;
}

void check_launch(cudaError_t err, const char* op) {
  COMB_CHECK(err == cudaSuccess, "{}: CUDA launch failed: {}", op, cudaGetErrorString(err));
}

void check_like(const at::Tensor& t, const at::Tensor& like, const char* what, const char* op) {
  COMB_CHECK(t.device() == like.device() && t.scalar_type() == like.scalar_type() && t.is_contiguous(),
             "{}: {} should be contiguous {} on {}, found {} on {}{}", op, what, c10::toString(like.scalar_type()),
             like.device().str(), c10::toString(t.scalar_type()), t.device().str(),
             t.is_contiguous() ? "" : " (strided)");
}

// One layer's cache at `position`, passed to the kernel as arguments (no copy to the device, so no
// wait for the stream: the host keeps launching ahead of the GPU).
k::CacheAt cache_at(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t position) {
  k::CacheAt at;
  at.position = position, at.capacity = k_cache.size(2);
  at.keys = k_cache.data_ptr(), at.values = v_cache.data_ptr();
  return at;
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& like, const char* op) {
  check_like(k_cache, like, "the key cache", op);
  check_like(v_cache, like, "the value cache", op);
  COMB_CHECK(k_cache.dim() == 4 && k_cache.size(0) == 1 && v_cache.sizes() == k_cache.sizes(),
             "{}: caches [1, n_head_kv, capacity, head_dim] of one sequence, found keys [{}] and values [{}]", op,
             fmt::join(k_cache.sizes(), ", "), fmt::join(v_cache.sizes(), ", "));
}

// residual [.., dim] (in place) += delta (when defined); returns RMSNorm(residual) * weight.
at::Tensor add_rms_norm(const at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  const char* op = "comb::add_rms_norm";
  const k::Half type = half_type(residual, op);
  check_like(residual, residual, "residual", op);
  const int64_t dim = residual.size(-1);
  check_like(weight, residual, "weight", op);
  COMB_CHECK(weight.dim() == 1 && weight.size(0) == dim, "{}: weight [{}] for rows of {}", op,
             fmt::join(weight.sizes(), ", "), dim);
  if (delta.defined()) {
    check_like(delta, residual, "delta", op);
    COMB_CHECK(delta.sizes() == residual.sizes(), "{}: delta [{}] and residual [{}] differ", op,
               fmt::join(delta.sizes(), ", "), fmt::join(residual.sizes(), ", "));
  }
  c10::cuda::CUDAGuard guard(residual.device());
  at::Tensor out = at::empty_like(residual);
  check_launch(k::add_rms_norm(type, residual.data_ptr(), delta.defined() ? delta.data_ptr() : nullptr,
                               weight.data_ptr(), out.data_ptr(), residual.numel() / dim, dim, static_cast<float>(eps),
                               at::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

at::Tensor rope_append(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, int64_t position, int64_t n_head) {
  const char* op = "comb::rope_append";
  const k::Half type = half_type(qkv, op);
  check_like(qkv, qkv, "qkv", op);
  check_like(cos, qkv, "cos", op);
  check_like(sin, qkv, "sin", op);
  check_cache(k_cache, v_cache, qkv, op);
  const int64_t n_kv = k_cache.size(1), hd = k_cache.size(3), n = qkv.size(0);
  COMB_CHECK(qkv.dim() == 2 && qkv.size(1) == (n_head + 2 * n_kv) * hd && hd % 2 == 0,
             "{}: qkv [n, {}] for {} query heads and {} KV heads of {}, found [{}]", op, (n_head + 2 * n_kv) * hd,
             n_head, n_kv, hd, fmt::join(qkv.sizes(), ", "));
  COMB_CHECK(position >= 0 && position + n <= k_cache.size(2) && position + n <= cos.size(0) &&
                 cos.sizes() == sin.sizes() && cos.size(1) == hd,
             "{}: positions [{}, {}) past the cache's {} or the tables' {}", op, position, position + n,
             k_cache.size(2), cos.size(0));
  c10::cuda::CUDAGuard guard(qkv.device());
  at::Tensor q = at::empty({n, n_head, hd}, qkv.options());
  check_launch(k::rope_store(type, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), cache_at(k_cache, v_cache, position),
                             q.data_ptr(), n, n_head, n_kv, hd, at::cuda::getCurrentCUDAStream()),
               op);
  return q;
}

void place_keys(const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                int64_t position) {
  const char* op = "comb::place_keys";
  const k::Half type = half_type(k_cache, op);
  check_like(k_cache, k_cache, "the key cache", op);
  check_like(cos, k_cache, "cos", op);
  check_like(sin, k_cache, "sin", op);
  COMB_CHECK(k.device() == k_cache.device() && k.scalar_type() == k_cache.scalar_type() && k.dim() == 4 &&
                 k.size(0) == 1 && k_cache.dim() == 4 && k_cache.size(0) == 1 && k.size(1) == k_cache.size(1) &&
                 k.size(3) == k_cache.size(3) && k.stride(3) == 1,
             "{}: keys [1, {}, n, {}] {} on {} (last dimension contiguous), found [{}] {} on {}", op, k_cache.size(1),
             k_cache.size(3), c10::toString(k_cache.scalar_type()), k_cache.device().str(), fmt::join(k.sizes(), ", "),
             c10::toString(k.scalar_type()), k.device().str());
  const int64_t n = k.size(2), hd = k.size(3);
  COMB_CHECK(position >= 0 && position + n <= k_cache.size(2) && position < cos.size(0) && cos.size(1) == hd &&
                 sin.sizes() == cos.sizes(),
             "{}: positions [{}, {}) past the cache's {} or the tables' {}", op, position, position + n,
             k_cache.size(2), cos.size(0));
  COMB_CHECK(!k.is_alias_of(k_cache), "{}: the keys must not be the cache's own", op);
  c10::cuda::CUDAGuard guard(k.device());
  check_launch(k::rotate_keys(type, k.data_ptr(), k.stride(1), k.stride(2), cos[position].data_ptr(),
                              sin[position].data_ptr(), k_cache.data_ptr(), k_cache.size(2), position, n, k.size(1), hd,
                              at::cuda::getCurrentCUDAStream()),
               op);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const char* op = "comb::silu_mul";
  const k::Half type = half_type(gate_up, op);
  check_like(gate_up, gate_up, "gate_up", op);
  COMB_CHECK(gate_up.size(-1) % 2 == 0, "{}: an odd last dimension {}", op, gate_up.size(-1));
  const int64_t n_ff = gate_up.size(-1) / 2;
  std::vector<int64_t> shape = gate_up.sizes().vec();
  shape.back() = n_ff;
  c10::cuda::CUDAGuard guard(gate_up.device());
  at::Tensor out = at::empty(shape, gate_up.options());
  check_launch(k::silu_mul(type, gate_up.data_ptr(), out.data_ptr(), gate_up.numel() / (2 * n_ff), n_ff,
                           at::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

// Splits of each row's keys: enough blocks to fill the device twice, none of fewer than 32 keys.
int64_t split_count(const at::Tensor& on, int64_t n_head_kv, int64_t n_rows, int64_t longest) {
  const int sms = at::cuda::getDeviceProperties(on.device().index())->multiProcessorCount;
  const int64_t fill = (2 * sms + n_head_kv * n_rows - 1) / (n_head_kv * n_rows);
  return std::clamp<int64_t>(std::min(fill, (longest + 31) / 32), 1, 64);
}

// Checks q [n, n_head, head_dim] against n_kv KV heads of head_dim hd; returns n_head.
int64_t check_queries(const at::Tensor& q, int64_t n_kv, int64_t hd, const char* op) {
  check_like(q, q, "q", op);
  COMB_CHECK(q.dim() == 3 && q.size(2) == hd && q.size(1) % n_kv == 0 &&
                 (hd == 32 || hd == 64 || hd == 128 || hd == 256),
             "{}: q [n, n_head, head_dim] with head_dim 32, 64, 128 or 256 and n_head a multiple of {}, found [{}]", op,
             n_kv, fmt::join(q.sizes(), ", "));
  return q.size(1);
}

// The rows kernel over the cache `at` names (one sequence's or a pool's), with the joined keys
// checked: rows_attention and paged_attention. context: the most context keys a row reads.
// joined_params (defined: instead of the joined tensors): int64 [rows, kJoinedParams] on the device,
// each row's joined keys read by the kernel when it runs (RowsAttention::joined_params).
at::Tensor attend_rows(const at::Tensor& q, const k::CacheAt& at, int64_t n_kv, int64_t context,
                       const at::Tensor& joined_keys, const at::Tensor& joined_values, const at::Tensor& joined_bias,
                       int64_t anchor, const char* op, const at::Tensor& joined_params = {}) {
  const k::Half type = half_type(q, op);
  const int64_t n = q.size(0), n_head = q.size(1), hd = q.size(2);
  int64_t m = 0;
  if (joined_keys.defined()) {
    check_like(joined_keys, q, "joined keys", op);
    check_like(joined_values, q, "joined values", op);
    COMB_CHECK(joined_keys.dim() == 3 && joined_keys.size(0) == n_kv && joined_keys.size(2) == hd &&
                   joined_values.sizes() == joined_keys.sizes(),
               "{}: joined keys [{}] and values [{}] should be [{}, m, {}]", op, fmt::join(joined_keys.sizes(), ", "),
               fmt::join(joined_values.sizes(), ", "), n_kv, hd);
    m = joined_keys.size(1);
  }
  if (joined_params.defined())
    COMB_CHECK(!joined_keys.defined() && joined_params.is_cuda() && joined_params.device() == q.device() &&
                   joined_params.scalar_type() == at::kLong && joined_params.is_contiguous() &&
                   joined_params.dim() == 2 && joined_params.size(0) == n && joined_params.size(1) == k::kJoinedParams,
               "{}: joined parameters int64 [{}, {}] on {} (and no joined tensors), found {} [{}]", op, n,
               k::kJoinedParams, q.device().str(), c10::toString(joined_params.scalar_type()),
               fmt::join(joined_params.sizes(), ", "));
  if (joined_bias.defined())
    COMB_CHECK(joined_bias.is_cuda() && joined_bias.device() == q.device() &&
                   joined_bias.scalar_type() == at::kFloat && joined_bias.is_contiguous() && joined_bias.numel() == n_head,
               "{}: joined_bias should be float32 [{}] on {}", op, n_head, q.device().str());
  c10::cuda::CUDAGuard guard(q.device());
  k::RowsAttention a;
  a.n_rows = n, a.n_head = n_head, a.n_head_kv = n_kv, a.head_dim = hd;
  a.n_split = split_count(q, n_kv, n, m + context);
  at::Tensor partial = at::empty({n, n_head, a.n_split, hd + 2}, q.options().dtype(at::kFloat));
  at::Tensor out = at::empty_like(q);
  a.q = q.data_ptr(), a.cache = at, a.out = out.data_ptr(), a.partial = partial.data_ptr<float>();
  if (m > 0) {
    a.joined_keys = joined_keys.data_ptr(), a.joined_values = joined_values.data_ptr(), a.n_joined = m;
    a.anchor = anchor;
    if (joined_bias.defined()) a.joined_bias = joined_bias.data_ptr<float>();
  }
  if (joined_params.defined()) a.joined_params = joined_params.data_ptr<int64_t>(), a.joined_row_stride = k::kJoinedParams;
  check_launch(k::rows_attention(type, a, at::cuda::getCurrentCUDAStream()), op);
  return out;
}

at::Tensor rows_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t start,
                          const at::Tensor& joined_keys, const at::Tensor& joined_values, const at::Tensor& joined_bias,
                          int64_t anchor) {
  const char* op = "comb::rows_attention";
  half_type(q, op);
  check_cache(k_cache, v_cache, q, op);
  const int64_t n_kv = k_cache.size(1);
  check_queries(q, n_kv, k_cache.size(3), op);
  const int64_t n = q.size(0);
  COMB_CHECK(n >= 1 && n <= 65535 && start >= 0 && start + n <= k_cache.size(2),
             "{}: {} rows after {} positions in a cache of {}", op, n, start, k_cache.size(2));
  return attend_rows(q, cache_at(k_cache, v_cache, start), n_kv, start + n, joined_keys, joined_values, joined_bias,
                     anchor, op);
}

// The paged forms: a pool [n_blocks, n_head_kv, block_tokens, head_dim], each row's block table
// (int32 [rows, max_blocks]) and position (int64 [rows]) on the device.
k::CacheAt paged_at(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
                    const at::Tensor& positions, int64_t rows, const at::Tensor& like, const char* op) {
  check_like(k_pool, like, "the key pool", op);
  check_like(v_pool, like, "the value pool", op);
  COMB_CHECK(k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
             "{}: pools [n_blocks, n_head_kv, block_tokens, head_dim], found keys [{}] and values [{}]", op,
             fmt::join(k_pool.sizes(), ", "), fmt::join(v_pool.sizes(), ", "));
  COMB_CHECK(table.is_cuda() && table.device() == like.device() && table.scalar_type() == at::kInt &&
                 table.is_contiguous() && table.dim() == 2 && table.size(0) == rows && table.size(1) >= 1,
             "{}: block tables int32 [{}, max_blocks] on {}, found {} [{}] on {}", op, rows, like.device().str(),
             c10::toString(table.scalar_type()), fmt::join(table.sizes(), ", "), table.device().str());
  COMB_CHECK(positions.is_cuda() && positions.device() == like.device() && positions.scalar_type() == at::kLong &&
                 positions.is_contiguous() && positions.numel() == rows,
             "{}: positions int64 [{}] on {}, found {} [{}] on {}", op, rows, like.device().str(),
             c10::toString(positions.scalar_type()), fmt::join(positions.sizes(), ", "), positions.device().str());
  k::CacheAt at;
  at.keys = k_pool.data_ptr(), at.values = v_pool.data_ptr();
  at.paged.table = table.data_ptr<int32_t>(), at.paged.positions = positions.data_ptr<int64_t>();
  at.paged.max_blocks = table.size(1), at.paged.block_tokens = k_pool.size(2);
  return at;
}

// qkv [rows, (n_head + 2 n_head_kv) head_dim], each row at its own position: rotated keys and the
// values into its blocks of the pools; returns the rotated queries [rows, n_head, head_dim]. The
// caller keeps positions within the tables and the RoPE tables (Decoder::step_paged checks them).
at::Tensor paged_rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
                            const at::Tensor& positions, int64_t n_head) {
  const char* op = "comb::paged_rope_store";
  const k::Half type = half_type(qkv, op);
  check_like(qkv, qkv, "qkv", op);
  check_like(cos, qkv, "cos", op);
  check_like(sin, qkv, "sin", op);
  const int64_t n = qkv.size(0);
  const k::CacheAt at = paged_at(k_pool, v_pool, table, positions, n, qkv, op);
  const int64_t n_kv = k_pool.size(1), hd = k_pool.size(3);
  COMB_CHECK(qkv.dim() == 2 && qkv.size(1) == (n_head + 2 * n_kv) * hd && hd % 2 == 0 && cos.size(1) == hd &&
                 cos.sizes() == sin.sizes(),
             "{}: qkv [n, {}] for {} query heads and {} KV heads of {}, found [{}]", op, (n_head + 2 * n_kv) * hd,
             n_head, n_kv, hd, fmt::join(qkv.sizes(), ", "));
  c10::cuda::CUDAGuard guard(qkv.device());
  at::Tensor q = at::empty({n, n_head, hd}, qkv.options());
  check_launch(k::rope_store(type, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), at, q.data_ptr(), n, n_head, n_kv,
                             hd, at::cuda::getCurrentCUDAStream()),
               op);
  return q;
}

// The paged attention's checks and launch, the joined keys as tensors or as joined_params.
at::Tensor attend_paged(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
                        const at::Tensor& positions, int64_t longest, const at::Tensor& joined_keys,
                        const at::Tensor& joined_values, const at::Tensor& joined_bias, int64_t anchor,
                        const at::Tensor& joined_params, const char* op) {
  half_type(q, op);
  const int64_t n = q.size(0);
  const k::CacheAt at = paged_at(k_pool, v_pool, table, positions, n, q, op);
  const int64_t n_kv = k_pool.size(1);
  check_queries(q, n_kv, k_pool.size(3), op);
  COMB_CHECK(n >= 1 && n <= 65535 && longest >= 1, "{}: {} rows reading up to {} keys", op, n, longest);
  return attend_rows(q, at, n_kv, longest, joined_keys, joined_values, joined_bias, anchor, op, joined_params);
}

// Rows q [rows, n_head, head_dim], each over its own sequence's positions [0, positions[r]] in the
// pools (longest: the most positions a row reads, the joined keys apart, for the split count); joined
// keys and values [n_head_kv, m, head_dim] (undefined: none) read by every row at positions >=
// anchor in the same softmax, each score plus joined_bias [n_head] (float32; undefined: 0).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& table, const at::Tensor& positions, int64_t longest,
                           const at::Tensor& joined_keys, const at::Tensor& joined_values,
                           const at::Tensor& joined_bias, int64_t anchor) {
  return attend_paged(q, k_pool, v_pool, table, positions, longest, joined_keys, joined_values, joined_bias, anchor, {},
                      "comb::paged_attention");
}

// paged_attention with each row's own joined keys, named by joined [rows, kJoinedParams] int64 on
// the device: [keys, values, bias (0: none), m (0: none), anchor], the addresses of contiguous
// [n_head_kv, m, head_dim] tensors in q's dtype and of a float32 [n_head] bias, read when the
// kernel runs (a captured graph reads what was written there before its replay). The caller keeps
// them alive and well formed.
at::Tensor paged_attention_joined(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& table, const at::Tensor& positions, int64_t longest,
                                  const at::Tensor& joined) {
  const char* op = "comb::paged_attention_joined";
  COMB_CHECK(joined.defined(), "{}: no joined parameters", op);
  return attend_paged(q, k_pool, v_pool, table, positions, longest, {}, {}, {}, 0, joined, op);
}

int64_t free_memory(int index) {
  std::optional<c10::cuda::CUDAGuard> guard;
  if (index >= 0) guard.emplace(static_cast<c10::DeviceIndex>(index));
  size_t free = 0, total = 0;
  check_launch(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return static_cast<int64_t>(free);
}

bool profiler_range(bool start) {
  const cudaError_t err = start ? cudaProfilerStart() : cudaProfilerStop();
  if (err == cudaSuccess) return true;
  (void)cudaGetLastError();  // a profiler's range is no reason to stop a benchmark: clear it, report false
  return false;
}

std::vector<at::Tensor> pin_host(const std::vector<at::Tensor>& parts) {
  const char* op = "comb::pin_host";
  bool there = true;
  std::optional<c10::Device> cuda;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& p = parts[i];
    COMB_CHECK(p.defined() && (p.device().is_cpu() || p.is_cuda()) && (!cuda || !p.is_cuda() || p.device() == *cuda),
               "{}: part {} of {} is not a defined CPU tensor or one on the other parts' CUDA device", op, i,
               parts.size());
    if (p.is_cuda()) cuda = p.device();
    there = there && p.device().is_cpu() && p.is_pinned();
  }
  if (there) return parts;
  // One page-locked allocation for all the parts (LibTorch's caching host allocator rounds each
  // allocation up to a power of two), each part a view at a 64-byte boundary.
  constexpr int64_t kAlign = 64;
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const at::Tensor& p : parts) {
    offsets.push_back(total);
    total += (p.numel() * p.element_size() + kAlign - 1) / kAlign * kAlign;
  }
  // Freed blocks are kept for requests of their own size only: when page-locked memory runs out,
  // they go back to the system and the allocation is tried once more.
  auto allocate = [&] {
    return at::empty({std::max<int64_t>(total, kAlign)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  };
  at::Tensor buffer;
  try {
    buffer = allocate();
  } catch (const c10::Error&) {
    at::getHostAllocator(at::kCUDA)->empty_cache();
    buffer = allocate();
  }
  std::optional<c10::cuda::CUDAGuard> guard;
  if (cuda) guard.emplace(*cuda);
  std::vector<at::Tensor> out;
  out.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& p = parts[i];
    at::Tensor view = buffer.narrow(0, offsets[i], p.numel() * p.element_size()).view(p.scalar_type()).view(p.sizes());
    view.copy_(p, /*non_blocking=*/p.is_cuda());  // from the device: queued, then waited for below
    out.push_back(std::move(view));
  }
  // The host waits for the copies from the device, so the sources may go at once.
  if (cuda) at::cuda::getCurrentCUDAStream().synchronize();
  return out;
}

// A stream of comb's own per device for copies to it (not one of the pool's, which also capture
// graphs), made once and kept for the process.
at::cuda::CUDAStream copy_stream(c10::DeviceIndex index) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, cudaStream_t> streams;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(index);
  if (it == streams.end()) {
    cudaStream_t stream = nullptr;
    check_launch(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    it = streams.emplace(index, stream).first;
  }
  return at::cuda::getStreamFromExternal(it->second, index);
}

std::vector<at::Tensor> to_device_async(const std::vector<at::Tensor>& from, c10::Device device) {
  const char* op = "comb::to_device_async";
  COMB_CHECK(device.is_cuda(), "{}: expected a CUDA device, found {}", op, device.str());
  for (size_t i = 0; i < from.size(); ++i)
    COMB_CHECK(from[i].defined() && from[i].device().is_cpu(), "{}: tensor {} of {} is not a defined CPU tensor", op,
               i, from.size());
  const c10::cuda::CUDAGuard guard(device);
  const at::cuda::CUDAStream current = at::cuda::getCurrentCUDAStream();
  const at::cuda::CUDAStream side = copy_stream(current.device_index());
  std::vector<at::Tensor> out;
  out.reserve(from.size());
  {
    // Allocated and written on the side stream: the caching allocator hands it memory that no
    // work of its own still uses, whatever is queued on the current stream.
    const c10::cuda::CUDAStreamGuard on_side(side);
    for (const at::Tensor& t : from) out.push_back(t.to(t.options().device(device), /*non_blocking=*/t.is_pinned()));
  }
  at::cuda::CUDAEvent copied;
  copied.record(side);
  copied.block(current);
  // Freed later by work on the current stream: the allocator then waits for that stream too.
  for (at::Tensor& t : out) t.record_stream(current);
  return out;
}

// Host values into `dst` (a contiguous device tensor, as many elements of its dtype) without the
// host waiting for the device's queue: staged in pinned memory, which the caching host allocator
// keeps until the copy has run (a copy from pageable memory would wait for every launch before it).
void stage_into(const at::Tensor& dst, const void* values) {
  at::Tensor host = at::empty(dst.sizes(), dst.options().device(at::kCPU).pinned_memory(true));
  std::memcpy(host.data_ptr(), values, static_cast<size_t>(dst.numel() * dst.element_size()));
  const_cast<at::Tensor&>(dst).copy_(host, /*non_blocking=*/true);
}

// A descriptor table in device memory, copied from pinned memory without waiting (the caching host
// allocator keeps the buffer until the copy has run).
template <typename Piece>
at::Tensor upload(const std::vector<Piece>& pieces, const at::Tensor& like) {
  at::Tensor device = at::empty({static_cast<int64_t>(pieces.size() * sizeof(Piece))}, like.options().dtype(at::kByte));
  stage_into(device, pieces.data());
  return device;
}

// The pieces' table uploaded, then `launch(the device's first piece, count)` for each 65,535 of them
// (a launch's grid holds one piece a block row), each launch checked.
template <typename Piece, typename Launch>
void launch_pieces(const std::vector<Piece>& pieces, const at::Tensor& like, const char* op, const Launch& launch) {
  if (pieces.empty()) return;
  c10::cuda::CUDAGuard guard(like.device());
  at::Tensor table = upload(pieces, like);
  const auto* all = reinterpret_cast<const Piece*>(table.data_ptr());
  for (size_t from = 0; from < pieces.size(); from += 65535) {
    const auto count = static_cast<int64_t>(std::min<size_t>(65535, pieces.size() - from));
    check_launch(launch(all + from, count), op);
  }
}

void join_documents(const std::vector<comb::detail::JoinPart>& parts, const std::vector<at::Tensor>& out_keys,
                    const std::vector<at::Tensor>& out_values, const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "comb::join_documents";
  COMB_CHECK(!out_keys.empty() && out_values.size() == out_keys.size(), "{}: {} key and {} value outputs", op,
             out_keys.size(), out_values.size());
  const at::Tensor& o = out_keys[0];
  const k::Half type = half_type(o, op);
  COMB_CHECK(o.dim() == 4, "{}: outputs [rows, n_head_kv, m, head_dim], found [{}]", op, fmt::join(o.sizes(), ", "));
  const int64_t rows = o.size(0), n_kv = o.size(1), m = o.size(2), hd = o.size(3);
  for (size_t b = 0; b < out_keys.size(); ++b)
    for (const at::Tensor* t : {&out_keys[b], &out_values[b]}) {
      check_like(*t, o, "an output", op);
      COMB_CHECK(t->sizes() == o.sizes(), "{}: block {}'s output [{}], block 0's [{}]", op, b,
                 fmt::join(t->sizes(), ", "), fmt::join(o.sizes(), ", "));
    }
  for (const at::Tensor* t : {&cos, &sin})
    COMB_CHECK(t->device() == o.device() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                   t->size(1) == hd && t->sizes() == cos.sizes(),
               "{}: RoPE tables should be contiguous float32 [n_ctx, {}] on {}, found [{}] {} on {}", op, hd,
               o.device().str(), fmt::join(t->sizes(), ", "), c10::toString(t->scalar_type()), t->device().str());
  COMB_CHECK(hd % 2 == 0, "{}: head_dim {} should be even", op, hd);
  std::vector<k::JoinPiece> pieces(parts.size());
  int64_t longest = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const comb::detail::JoinPart& p = parts[i];
    COMB_CHECK(p.block >= 0 && p.block < static_cast<int64_t>(out_keys.size()), "{}: part {} names block {} of {}",
               op, i, p.block, out_keys.size());
    const at::Tensor& kt = p.keys;
    COMB_CHECK(kt.defined() && kt.device() == o.device() && kt.is_contiguous() && kt.dim() == 3 && kt.size(0) == n_kv &&
                   kt.size(2) == hd && p.values.defined() && p.values.sizes() == kt.sizes() &&
                   p.values.scalar_type() == kt.scalar_type() && p.values.device() == o.device() &&
                   p.values.is_contiguous(),
               "{}: part {}: keys and values should be contiguous [{}, len, {}] of one dtype on {}", op, i, n_kv, hd,
               o.device().str());
    const int64_t len = kt.size(1);
    COMB_CHECK(p.row >= 0 && p.row < rows && p.offset >= 0 && p.offset + len <= m && std::abs(p.angle) < cos.size(0),
               "{}: part {} at row {}, positions [{}, {}), turn {}: outside outputs of {} rows of {} or tables of {}",
               op, i, p.row, p.offset, p.offset + len, p.angle, rows, m, cos.size(0));
    k::JoinPiece& piece = pieces[i];
    if (kt.scalar_type() == at::kChar) {
      const at::Tensor& ks = p.key_scales;
      const at::Tensor& vs = p.value_scales;
      const bool per_channel = ks.defined() && ks.dim() == 3 && ks.size(1) == 1 && ks.size(2) == hd;
      COMB_CHECK(ks.defined() && vs.defined() && ks.scalar_type() == at::kHalf && vs.scalar_type() == at::kHalf &&
                     ks.device() == o.device() && vs.device() == o.device() && ks.is_contiguous() &&
                     vs.is_contiguous() && ks.dim() == 3 && ks.size(0) == n_kv &&
                     (per_channel || (ks.size(1) == len && ks.size(2) == 1)) &&
                     vs.sizes() == c10::IntArrayRef({n_kv, len, 1}),
                 "{}: part {}: int8 K/V need float16 scales, keys [{}, 1, {}] or [{}, {}, 1] and values [{}, {}, 1]", op,
                 i, n_kv, hd, n_kv, len, n_kv, len);
      piece.source = k::JoinSource::int8;
      piece.key_scales = ks.data_ptr(), piece.value_scales = vs.data_ptr();
      piece.keys_per_channel = per_channel ? 1 : 0;
    } else {
      COMB_CHECK(kt.scalar_type() == at::kFloat || kt.scalar_type() == o.scalar_type(),
                 "{}: part {}: K/V of {}, expected int8, float32 or {}", op, i, c10::toString(kt.scalar_type()),
                 c10::toString(o.scalar_type()));
      piece.source = kt.scalar_type() == at::kFloat ? k::JoinSource::f32 : k::JoinSource::half;
    }
    piece.keys = kt.data_ptr(), piece.values = p.values.data_ptr();
    piece.out_keys = out_keys[p.block].data_ptr(), piece.out_values = out_values[p.block].data_ptr();
    piece.len = len, piece.m = m, piece.row = p.row, piece.offset = p.offset, piece.angle = p.angle;
    longest = std::max(longest, len);
  }
  launch_pieces(pieces, o, op, [&](const k::JoinPiece* from, int64_t count) {
    return k::join_documents(type, from, count, longest, n_kv, hd, cos.data_ptr<float>(), sin.data_ptr<float>(),
                             at::cuda::getCurrentCUDAStream());
  });
}

void quantize_int8(const std::vector<std::vector<std::array<at::Tensor, 2>>>& kv,
                   std::vector<std::vector<std::array<at::Tensor, 4>>>& out) {
  const char* op = "comb::quantize_int8";
  out.assign(kv.size(), {});
  std::vector<k::QuantPiece> pieces;
  const at::Tensor* first = nullptr;
  std::optional<at::ScalarType> half;  // the one half type among the sources
  int64_t longest = 0;
  for (size_t d = 0; d < kv.size(); ++d) {
    COMB_CHECK(!kv[d].empty(), "{}: document {} has no blocks", op, d);
    const at::Tensor& k0 = kv[d][0][0];
    if (!first) first = &k0;
    COMB_CHECK(k0.defined() && k0.is_cuda() && k0.dim() == 3 && k0.device() == first->device() &&
                   k0.size(0) == first->size(0) && k0.size(2) == first->size(2),
               "{}: document {}: keys [n_head_kv, len, head_dim] on one CUDA device, found [{}] on {}", op, d,
               fmt::join(k0.sizes(), ", "), k0.device().str());
    const int64_t n_kv = k0.size(0), len = k0.size(1), hd = k0.size(2), blocks = static_cast<int64_t>(kv[d].size());
    const bool per_channel = 2 * len >= hd;  // DocumentKV::keys_per_channel
    const int64_t n_key_scales = per_channel ? n_kv * hd : n_kv * len, n_rows = n_kv * len;
    // One allocation per document (its entry owns it alone): codes [blocks, 2, ...], scales [blocks, ...].
    at::Tensor codes = at::empty({blocks, 2, n_kv, len, hd}, k0.options().dtype(at::kChar));
    at::Tensor scales = at::empty({blocks, n_key_scales + n_rows}, k0.options().dtype(at::kHalf));
    for (int64_t b = 0; b < blocks; ++b) {
      for (const at::Tensor* t : {&kv[d][b][0], &kv[d][b][1]}) {
        COMB_CHECK(t->defined() && t->device() == k0.device() && t->is_contiguous() && t->sizes() == k0.sizes() &&
                       (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16 ||
                        t->scalar_type() == at::kHalf),
                   "{}: document {} block {}: K/V should be contiguous float32 or half [{}] on {}", op, d, b,
                   fmt::join(k0.sizes(), ", "), k0.device().str());
        if (t->scalar_type() != at::kFloat) {
          COMB_CHECK(!half || *half == t->scalar_type(), "{}: sources of both float16 and bfloat16", op);
          half = t->scalar_type();
        }
      }
      k::QuantPiece p;
      p.keys = kv[d][b][0].data_ptr(), p.values = kv[d][b][1].data_ptr();
      p.source = kv[d][b][0].scalar_type() == at::kFloat ? k::JoinSource::f32 : k::JoinSource::half;
      COMB_CHECK(kv[d][b][1].scalar_type() == kv[d][b][0].scalar_type(), "{}: document {} block {}: K and V differ",
                 op, d, b);
      at::Tensor kc = codes[b][0], vc = codes[b][1];
      at::Tensor ks = scales[b].narrow(0, 0, n_key_scales).view(per_channel ? at::IntArrayRef{n_kv, 1, hd}
                                                                           : at::IntArrayRef{n_kv, len, 1});
      at::Tensor vs = scales[b].narrow(0, n_key_scales, n_rows).view({n_kv, len, 1});
      p.key_codes = kc.data_ptr<int8_t>(), p.value_codes = vc.data_ptr<int8_t>();
      p.key_scales = ks.data_ptr(), p.value_scales = vs.data_ptr();
      p.len = len, p.keys_per_channel = per_channel ? 1 : 0;
      pieces.push_back(p);
      out[d].push_back({kc, ks, vc, vs});
      longest = std::max(longest, len);
    }
  }
  if (pieces.empty()) return;
  const k::Half type = half && *half == at::kHalf ? k::Half::f16 : k::Half::bf16;  // the loader of half sources
  launch_pieces(pieces, *first, op, [&](const k::QuantPiece* from, int64_t count) {
    return k::quantize_int8(type, from, count, longest, first->size(0), first->size(2),
                            at::cuda::getCurrentCUDAStream());
  });
}

// qkv [.., (n_head + 2 n_head_kv) head_dim] rows (in place): each row's queries and keys turned by
// its row of cos, sin [rows, head_dim].
void rope_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t n_head, int64_t n_head_kv) {
  const char* op = "comb::rope_rows";
  const k::Half type = half_type(qkv, op);
  check_like(qkv, qkv, "qkv", op);
  check_like(cos, qkv, "cos", op);
  check_like(sin, qkv, "sin", op);
  COMB_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) % 2 == 0 && n_head > 0 && n_head_kv >= 0,
             "{}: cos and sin [rows, head_dim] (head_dim even) for {} query and {} key heads, found [{}] and [{}]", op,
             n_head, n_head_kv, fmt::join(cos.sizes(), ", "), fmt::join(sin.sizes(), ", "));
  const int64_t hd = cos.size(1), width = (n_head + 2 * n_head_kv) * hd;
  COMB_CHECK(qkv.dim() >= 1 && qkv.size(-1) == width && qkv.numel() == cos.size(0) * width,
             "{}: qkv of {} rows of {} values, found [{}]", op, cos.size(0), width, fmt::join(qkv.sizes(), ", "));
  c10::cuda::CUDAGuard guard(qkv.device());
  check_launch(k::rope_rows(type, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.size(0), n_head, n_head_kv, hd,
                            at::cuda::getCurrentCUDAStream()),
               op);
}

// A tensor as an error message names it: "BFloat16 [2, 3] on cuda:0", or "undefined".
std::string described(const at::Tensor& t) {
  return t.defined() ? fmt::format("{} [{}] on {}", c10::toString(t.scalar_type()), fmt::join(t.sizes(), ", "),
                                   t.device().str())
                     : std::string("undefined");
}

// The keys and values split_documents' kernel copies from: `dim` dimensions (`layout`), the last
// contiguous, other strides any, 2- or 4-byte elements on a CUDA device; values as the keys.
void check_copy_sources(const at::Tensor& keys, const at::Tensor& values, int64_t dim, const char* layout,
                        const char* op) {
  COMB_CHECK(keys.defined() && keys.is_cuda() && keys.dim() == dim && keys.stride(dim - 1) == 1 &&
                 (keys.element_size() == 2 || keys.element_size() == 4),
             "{}: keys {} of 2- or 4-byte elements on a CUDA device, the last dimension contiguous, found {}", op,
             layout, described(keys));
  COMB_CHECK(values.defined() && values.device() == keys.device() && values.scalar_type() == keys.scalar_type() &&
                 values.sizes() == keys.sizes() && values.stride(dim - 1) == 1,
             "{}: values as the keys ({}), found {}", op, described(keys), described(values));
}

void split_documents(const at::Tensor& keys, const at::Tensor& values, const std::vector<std::array<int64_t, 3>>& rows,
                     const std::vector<at::Tensor>& outs, int64_t block) {
  const char* op = "comb::split_documents";
  check_copy_sources(keys, values, 4, "[batch, n_head_kv, n, head_dim]", op);
  COMB_CHECK(outs.size() == rows.size(), "{}: {} outputs for {} documents", op, outs.size(), rows.size());
  const int64_t batch = keys.size(0), n_kv = keys.size(1), n = keys.size(2), hd = keys.size(3);
  std::vector<k::SplitPiece> pieces;
  int64_t longest = 0;
  for (size_t d = 0; d < rows.size(); ++d) {
    const auto [row, first, len] = rows[d];
    COMB_CHECK(0 <= row && row < batch && 0 < len && 0 <= first && first + len <= n,
               "{}: document {}: batch row {}, positions [{}, {}) of a batch [{}, {}]", op, d, row, first, first + len,
               batch, n);
    const at::Tensor& o = outs[d];
    COMB_CHECK(o.defined() && o.device() == keys.device() && o.scalar_type() == keys.scalar_type() &&
                   o.is_contiguous() && o.dim() == 5 && 0 <= block && block < o.size(0) && o.size(1) == 2 &&
                   o.size(2) == n_kv && o.size(3) == len && o.size(4) == hd,
               "{}: document {}: output [blocks > {}, 2, {}, {}, {}] {} on {}, contiguous, found {}", op, d, block, n_kv,
               len, hd, c10::toString(keys.scalar_type()), keys.device().str(), described(o));
    const int64_t es = keys.element_size(), each = n_kv * len * hd;
    k::SplitPiece p;
    p.keys = static_cast<const char*>(keys.data_ptr()) + (row * keys.stride(0) + first * keys.stride(2)) * es;
    p.values = static_cast<const char*>(values.data_ptr()) + (row * values.stride(0) + first * values.stride(2)) * es;
    p.key_head_stride = keys.stride(1), p.key_row_stride = keys.stride(2);
    p.value_head_stride = values.stride(1), p.value_row_stride = values.stride(2);
    p.out_keys = static_cast<char*>(o.data_ptr()) + 2 * block * each * es;
    p.out_values = static_cast<char*>(o.data_ptr()) + (2 * block + 1) * each * es;
    p.len = len, p.out_head_stride = len * hd, p.out_row_stride = hd;  // [n_head_kv, len, head_dim]
    pieces.push_back(p);
    longest = std::max(longest, len);
  }
  launch_pieces(pieces, keys, op, [&](const k::SplitPiece* from, int64_t count) {
    return k::split_documents(static_cast<int>(keys.element_size()), from, count, longest, n_kv, hd,
                              at::cuda::getCurrentCUDAStream());
  });
}

// Packed sequences' keys and values as the variable-length attention reads them (split_documents'
// kernel, out [keys, n_head_kv, head_dim]): sequence s's pre prefix rows, then its own rows [first[s],
// first[s + 1]) of keys [rows, n_head_kv, head_dim]; one launch (each 65,535 pieces).
std::array<at::Tensor, 2> pack_keys(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& prefix_keys,
                                    const at::Tensor& prefix_values, const std::vector<int64_t>& first, int64_t pre) {
  const char* op = "comb::pack_keys";
  check_copy_sources(keys, values, 3, "[rows, n_head_kv, head_dim]", op);
  const int64_t rows = keys.size(0), n_kv = keys.size(1), hd = keys.size(2);
  COMB_CHECK(first.size() >= 2 && first.front() == 0 && first.back() == rows,
             "{}: row offsets from 0 to the {} rows, one more than the sequences, found {} offsets ({} to {})", op,
             rows, first.size(), first.empty() ? 0 : first.front(), first.empty() ? 0 : first.back());
  for (size_t s = 0; s + 1 < first.size(); ++s)
    COMB_CHECK(first[s] < first[s + 1], "{}: sequence {} has rows [{}, {})", op, s, first[s], first[s + 1]);
  COMB_CHECK(pre >= 0, "{}: {} prefix positions", op, pre);
  if (pre > 0)
    for (const at::Tensor* t : {&prefix_keys, &prefix_values})
      COMB_CHECK(t->defined() && t->device() == keys.device() && t->scalar_type() == keys.scalar_type() &&
                     t->dim() == 4 && t->size(0) == 1 && t->size(1) == n_kv && t->size(2) >= pre &&
                     t->size(3) == hd && t->stride(3) == 1,
                 "{}: prefix keys and values [1, {}, >= {}, {}] {} on {}, the last dimension contiguous, found {}", op,
                 n_kv, pre, hd, c10::toString(keys.scalar_type()), keys.device().str(), described(*t));
  const int64_t n_seq = static_cast<int64_t>(first.size()) - 1, total = n_seq * pre + rows;
  const int64_t es = keys.element_size(), row_bytes = n_kv * hd * es;
  at::Tensor out = at::empty({2, total, n_kv, hd}, keys.options());
  char* out_k = static_cast<char*>(out.data_ptr());
  char* out_v = out_k + total * row_bytes;
  std::vector<k::SplitPiece> pieces;
  int64_t longest = pre;
  for (int64_t s = 0; s < n_seq; ++s) {
    const int64_t at_row = s * pre + first[s], len = first[s + 1] - first[s];
    k::SplitPiece p;
    p.out_head_stride = hd, p.out_row_stride = n_kv * hd;  // [keys, n_head_kv, head_dim]
    if (pre > 0) {
      p.keys = prefix_keys.data_ptr(), p.values = prefix_values.data_ptr();
      p.key_head_stride = prefix_keys.stride(1), p.key_row_stride = prefix_keys.stride(2);
      p.value_head_stride = prefix_values.stride(1), p.value_row_stride = prefix_values.stride(2);
      p.out_keys = out_k + at_row * row_bytes, p.out_values = out_v + at_row * row_bytes;
      p.len = pre;
      pieces.push_back(p);
    }
    p.keys = static_cast<const char*>(keys.data_ptr()) + first[s] * keys.stride(0) * es;
    p.values = static_cast<const char*>(values.data_ptr()) + first[s] * values.stride(0) * es;
    p.key_head_stride = keys.stride(1), p.key_row_stride = keys.stride(0);
    p.value_head_stride = values.stride(1), p.value_row_stride = values.stride(0);
    p.out_keys = out_k + (at_row + pre) * row_bytes, p.out_values = out_v + (at_row + pre) * row_bytes;
    p.len = len;
    pieces.push_back(p);
    longest = std::max(longest, len);
  }
  launch_pieces(pieces, keys, op, [&](const k::SplitPiece* from, int64_t count) {
    return k::split_documents(static_cast<int>(es), from, count, longest, n_kv, hd, at::cuda::getCurrentCUDAStream());
  });
  return {out[0], out[1]};
}

int gemv_blocks(const at::Tensor& on) {
  return 4 * at::cuda::getDeviceProperties(on.device().index())->multiProcessorCount;
}

// x [k] (or [1, k]) times w [n, k] transposed: [n] (or [1, n]).
at::Tensor gemv(const at::Tensor& w, const at::Tensor& x) {
  const char* op = "comb::gemv";
  const k::Half type = half_type(w, op);
  check_like(w, w, "w", op);
  check_like(x, w, "x", op);
  COMB_CHECK(w.dim() == 2 && x.numel() == w.size(1) && w.size(1) % 8 == 0 && w.size(1) * 2 <= k::kGemvMaxShared,
             "{}: w [n, k] with k a multiple of 8 up to {} and x of k values, found w [{}] and x [{}]", op,
             k::kGemvMaxShared / 2, fmt::join(w.sizes(), ", "), fmt::join(x.sizes(), ", "));
  c10::cuda::CUDAGuard guard(w.device());
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = w.size(0);
  at::Tensor y = at::empty(shape, x.options());
  check_launch(k::gemv(type, w.data_ptr(), x.data_ptr(), y.data_ptr(), w.size(0), w.size(1), gemv_blocks(w),
                       at::cuda::getCurrentCUDAStream()),
               op);
  return y;
}

// The Torch ops' forms (optional tensors).
at::Tensor add_rms_norm_op(const at::Tensor& residual, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                           double eps) {
  return add_rms_norm(residual, delta.value_or(at::Tensor()), weight, eps);
}
at::Tensor rows_attention_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t start,
                             const std::optional<at::Tensor>& joined_keys, const std::optional<at::Tensor>& joined_values,
                             const std::optional<at::Tensor>& joined_bias, int64_t anchor) {
  return rows_attention(q, k_cache, v_cache, start, joined_keys.value_or(at::Tensor()),
                        joined_values.value_or(at::Tensor()), joined_bias.value_or(at::Tensor()), anchor);
}

// ---- The one-launch decoding step ---------------------------------------------------------------

// A CUDA graph of `body` as the decoding steps capture one: one plain run on a side stream first
// (cuBLAS sets up its workspace for a stream on first use, which a capture may not do; the plain
// run writes what the replay after it writes), then the capture there, in `pool` if given. A body
// that throws ends the capture (the stream usable again) and rethrows. The caller's stream is
// synchronized first, and the side stream after.
std::unique_ptr<at::cuda::CUDAGraph> capture_on_side(c10::Device device, const std::function<void()>& body,
                                                     std::optional<c10::MempoolId_t> pool = std::nullopt) {
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device.index());
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device.index());
  side.synchronize();
  caller.synchronize();
  c10::cuda::CUDAStreamGuard on_side(side);
  body();
  side.synchronize();
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  // Thread-local capture: other threads may go on with their own device work meanwhile (the
  // document store's writers copy entries to the host), which the global mode would refuse them.
  graph->capture_begin(pool.value_or(c10::MempoolId_t{0, 0}), cudaStreamCaptureModeThreadLocal);
  try {
    body();
  } catch (...) {
    try {
      graph->capture_end();
    } catch (...) {
    }
    throw;
  }
  graph->capture_end();
  side.synchronize();
  return graph;
}

// The short-forward step (comb::detail::DecodeStep): per bucket of rows (1, 2, 4, ..., 128) static
// buffers and a graph over them. Everything a replay reads of the request lies in the bucket's
// parameter block, copied to the device before each run:
//   [kParamPosition, kParamCapacity, kParamRows (the real rows)], each layer's keys then values address
//   (k::kParamCaches, 2 n_layer), each layer's joined keys as k::RowsAttention::joined_params reads
//   them (k::kJoinedParams each), the bucket's tokens (rows), the last real row's index.
class GraphDecodeStep final : public comb::detail::DecodeStep {
 public:
  GraphDecodeStep(const comb::detail::DecodeStepSpec& spec, bool graph) : s_(spec), graph_wanted_(graph) {
    const at::Tensor& e = s_.tok_embd;
    type_ = half_type(e, "the decoding step");
    device_ = e.device();
    const int64_t L = s_.n_layer, hd = s_.head_dim;
    COMB_CHECK(static_cast<int64_t>(s_.layers.size()) == L && (hd == 32 || hd == 64 || hd == 128 || hd == 256),
               "the decoding step: {} layers of weights for {}, head_dim {} (32, 64, 128 or 256)", s_.layers.size(), L,
               hd);
    auto check = [&](const at::Tensor& t, const char* what) {
      COMB_CHECK(t.device() == device_ && t.scalar_type() == e.scalar_type() && t.is_contiguous(),
                 "the decoding step: {} should be contiguous {} on {}", what, c10::toString(e.scalar_type()),
                 device_.str());
    };
    check(s_.output_norm, "output_norm");
    check(s_.output, "output");
    check(s_.rope_cos, "rope_cos");
    check(s_.rope_sin, "rope_sin");
    for (const auto& l : s_.layers)
      for (const at::Tensor& t : l) check(t, "a layer weight");
    // NOTE: comb's GEMV took 5.18 ms a token at the 8B shape on an H200 against cuBLAS's 4.82
    // (docs/benchmarks.md): cuBLAS by default, comb's with COMB_CUDA_GEMV=1 (one row only).
    const char* gemv_env = std::getenv("COMB_CUDA_GEMV");
    gemv_ = gemv_env != nullptr && std::string(gemv_env) == "1";
    gemv_blocks_ = gemv_blocks(e);
    // RoPE, the cache append, attention and the splits' merge in one launch a layer instead of three
    // (k::rope_attention, the same values bit for bit): with COMB_CUDA_FUSED_ATTENTION=1, until a
    // GPU run has timed it against the three (bench/gpu_check.sh step 12).
    const char* fused_env = std::getenv("COMB_CUDA_FUSED_ATTENTION");
    fused_attention_ = fused_env != nullptr && std::string(fused_env) == "1";
  }

  at::Tensor run(const std::vector<int64_t>& tokens, int64_t position, const std::vector<at::Tensor>& keys,
                 const std::vector<at::Tensor>& values, const std::vector<comb::detail::StepJoined>& joined) override {
    const int64_t L = s_.n_layer, n = static_cast<int64_t>(tokens.size());
    COMB_CHECK(n >= 1 && n <= comb::detail::kStepRowsMax, "the decoding step: {} tokens (1 to {})", n,
               comb::detail::kStepRowsMax);
    COMB_CHECK(static_cast<int64_t>(keys.size()) == L && static_cast<int64_t>(values.size()) == L,
               "the decoding step: caches of {} and {} layers for {}", keys.size(), values.size(), L);
    COMB_CHECK(joined.empty() || static_cast<int64_t>(joined.size()) == L,
               "the decoding step: joined keys for {} layers of {} (none, or one entry a layer)", joined.size(), L);
    for (int64_t t : tokens)
      COMB_CHECK(t >= 0 && t < s_.n_vocab, "the decoding step: token {} outside [0, {})", t, s_.n_vocab);
    const int64_t rows = comb::detail::step_bucket(n);
    const int64_t capacity = keys[0].size(2);
    COMB_CHECK(position >= 0 && position + n <= capacity && position + n <= s_.rope_cos.size(0),
               "the decoding step: {} rows at position {} past the cache's capacity {} or the context's {}", n,
               position, capacity, s_.rope_cos.size(0));
    const int64_t P = k::kParamCaches + 2 * L, T = P + k::kJoinedParams * L;
    std::vector<int64_t> p(T + rows + 1, 0);
    p[k::kParamPosition] = position;
    p[k::kParamCapacity] = capacity;
    p[k::kParamRows] = n;  // the bucket's padding past them writes and reads no cache
    for (int64_t l = 0; l < L; ++l) {
      for (const at::Tensor* t : {&keys[l], &values[l]}) {
        COMB_CHECK(t->device() == device_ && t->scalar_type() == s_.tok_embd.scalar_type() && t->is_contiguous() &&
                       t->dim() == 4 && t->size(0) == 1 && t->size(1) == s_.n_head_kv && t->size(2) == capacity &&
                       t->size(3) == s_.head_dim,
                   "the decoding step: layer {}'s cache should be contiguous [1, {}, {}, {}] {} on {}, found [{}]", l,
                   s_.n_head_kv, capacity, s_.head_dim, c10::toString(s_.tok_embd.scalar_type()), device_.str(),
                   fmt::join(t->sizes(), ", "));
      }
      p[k::kParamCaches + l] = reinterpret_cast<int64_t>(keys[l].data_ptr());
      p[k::kParamCaches + L + l] = reinterpret_cast<int64_t>(values[l].data_ptr());
      if (joined.empty() || !joined[l].keys.defined()) continue;
      const comb::detail::StepJoined& j = joined[l];
      const int64_t m = j.keys.dim() >= 2 ? j.keys.size(-2) : 0;
      for (const at::Tensor* t : {&j.keys, &j.values}) {
        COMB_CHECK(t->defined() && t->device() == device_ && t->scalar_type() == s_.tok_embd.scalar_type() &&
                       t->is_contiguous() && (t->dim() == 3 || (t->dim() == 4 && t->size(0) == 1)) &&
                       t->size(-3) == s_.n_head_kv && t->size(-2) == m && t->size(-1) == s_.head_dim,
                   "the decoding step: layer {}'s joined keys and values should be contiguous [{}, m, {}] {} on {}",
                   l, s_.n_head_kv, s_.head_dim, c10::toString(s_.tok_embd.scalar_type()), device_.str());
      }
      if (j.bias.defined())
        COMB_CHECK(j.bias.device() == device_ && j.bias.scalar_type() == at::kFloat && j.bias.is_contiguous() &&
                       j.bias.numel() == s_.n_head,
                   "the decoding step: layer {}'s joined bias should be contiguous float32 [{}] on {}", l, s_.n_head,
                   device_.str());
      if (m == 0) continue;
      int64_t* at = p.data() + P + k::kJoinedParams * l;
      at[0] = reinterpret_cast<int64_t>(j.keys.data_ptr());
      at[1] = reinterpret_cast<int64_t>(j.values.data_ptr());
      at[2] = j.bias.defined() ? reinterpret_cast<int64_t>(j.bias.data_ptr()) : 0;
      at[3] = m;
      at[4] = j.anchor;
    }
    std::copy(tokens.begin(), tokens.end(), p.begin() + T);  // the padding: token 0
    p[T + rows] = n - 1;
    c10::cuda::CUDAGuard guard(device_);
    Bucket& b = bucket(rows);
    stage_into(b.params, p.data());  // queued behind what the stream runs, the host not waiting
    if (!graph_wanted_) {
      body(b);
    } else {
      if (!b.graph) {
        if (!pool_) pool_ = at::cuda::graph_pool_handle();
        b.graph = capture_on_side(device_, [&] { body(b); }, pool_);
      }
      b.graph->replay();
    }
    return b.logits_f32.clone().view({1, 1, s_.n_vocab});
  }

 private:
  struct Bucket {
    int64_t rows = 0, n_split = 1;
    at::Tensor params;                   // int64, the layout above
    at::Tensor x, normed, o, down;       // [rows, n_embd]
    at::Tensor qkv, q, attn, gate_up, act, partial;
    at::Tensor counters;                 // int32 [rows, n_head_kv], zeros (k::rope_attention)
    at::Tensor last;                     // [1, n_embd]: the last real row's normed state
    at::Tensor logits, logits_f32;       // [1, n_vocab]
    std::unique_ptr<at::cuda::CUDAGraph> graph;
  };

  Bucket& bucket(int64_t rows) {
    auto it = buckets_.find(rows);
    if (it != buckets_.end()) return it->second;
    // Plain tensors whatever mode the first run of this bucket was in: a later run outside
    // InferenceMode writes them in place.
    c10::InferenceMode plain(false);
    Bucket b;
    const auto opts = s_.tok_embd.options();
    const int64_t L = s_.n_layer, hd = s_.head_dim, q_dim = s_.n_head * hd, qkv_dim = q_dim + 2 * s_.n_head_kv * hd;
    b.rows = rows;
    b.params = at::zeros({k::kParamCaches + (2 + k::kJoinedParams) * L + rows + 1}, opts.dtype(at::kLong));
    for (at::Tensor* t : {&b.x, &b.normed, &b.o, &b.down}) *t = at::empty({rows, s_.n_embd}, opts);
    b.qkv = at::empty({rows, qkv_dim}, opts);
    b.q = at::empty({rows, q_dim}, opts);
    b.attn = at::zeros({rows, q_dim}, opts);  // finite where rope_attention writes no padding row
    b.gate_up = at::empty({rows, 2 * s_.n_ff}, opts);
    b.act = at::empty({rows, s_.n_ff}, opts);
    b.last = at::empty({1, s_.n_embd}, opts);
    b.logits = at::empty({1, s_.n_vocab}, opts);
    b.logits_f32 = at::empty({1, s_.n_vocab}, opts.dtype(at::kFloat));
    // NOTE: the graph's grid is fixed: as many splits as fill the device, whatever the length
    // (splits past a short context find no key and end at once).
    b.n_split = split_count(s_.tok_embd, s_.n_head_kv, rows, int64_t(1) << 20);
    // Zeros: padding rows merge what is there (finite) and are never read.
    b.partial = at::zeros({rows, s_.n_head, b.n_split, hd + 2}, opts.dtype(at::kFloat));
    b.counters = at::zeros({rows, s_.n_head_kv}, opts.dtype(at::kInt));
    return buckets_.emplace(rows, std::move(b)).first->second;
  }

  // out [rows, n] = in [rows, k] times w [n, k] transposed: cuBLAS, or with COMB_CUDA_GEMV=1 comb's
  // GEMV for one row where it takes the shapes.
  void linear(const at::Tensor& out, const at::Tensor& in, const at::Tensor& w, cudaStream_t stream) {
    if (gemv_ && in.size(0) == 1 &&
        k::gemv(type_, w.data_ptr(), in.data_ptr(), out.data_ptr(), w.size(0), w.size(1), gemv_blocks_, stream) ==
            cudaSuccess)
      return;
    (void)cudaGetLastError();  // a refused launch leaves no error behind
    at::mm_out(const_cast<at::Tensor&>(out), in, w.t());
  }

  // The step's launches, every one over the bucket's buffers.
  void body(Bucket& b) {
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    const float eps = static_cast<float>(s_.rms_eps);
    const int64_t L = s_.n_layer, R = b.rows, P = k::kParamCaches + 2 * L, T = P + k::kJoinedParams * L;
    const int64_t* params = b.params.data_ptr<int64_t>();
    k::CacheAt at;  // each layer's cache through the parameter block, read at replay
    at.params = params, at.n_layer = L;
    at::index_select_out(b.x, s_.tok_embd, 0, b.params.narrow(0, T, R));
    check_launch(k::add_rms_norm(type_, b.x.data_ptr(), nullptr, s_.layers[0][0].data_ptr(), b.normed.data_ptr(), R,
                                 s_.n_embd, eps, stream),
                 "the decoding step");
    for (int64_t l = 0; l < L; ++l) {
      const auto& w = s_.layers[l];
      linear(b.qkv, b.normed, w[1], stream);
      at.layer = l;
      k::RowsAttention a;
      a.q = b.q.data_ptr(), a.cache = at, a.out = b.attn.data_ptr(), a.joined_params = params + P + k::kJoinedParams * l;
      a.partial = b.partial.data_ptr<float>(), a.n_rows = R, a.n_split = b.n_split, a.n_head = s_.n_head;
      a.n_head_kv = s_.n_head_kv, a.head_dim = s_.head_dim;
      if (fused_attention_) {
        a.q = b.qkv.data_ptr();
        k::FusedRope rope;
        rope.cos = s_.rope_cos.data_ptr(), rope.sin = s_.rope_sin.data_ptr(), rope.counters = b.counters.data_ptr<int>();
        check_launch(k::rope_attention(type_, a, rope, stream), "the decoding step");
      } else {
        check_launch(k::rope_store(type_, b.qkv.data_ptr(), s_.rope_cos.data_ptr(), s_.rope_sin.data_ptr(), at,
                                   b.q.data_ptr(), R, s_.n_head, s_.n_head_kv, s_.head_dim, stream),
                     "the decoding step");
        check_launch(k::rows_attention(type_, a, stream), "the decoding step");
      }
      linear(b.o, b.attn, w[2], stream);
      check_launch(k::add_rms_norm(type_, b.x.data_ptr(), b.o.data_ptr(), w[3].data_ptr(), b.normed.data_ptr(), R,
                                   s_.n_embd, eps, stream),
                   "the decoding step");
      linear(b.gate_up, b.normed, w[4], stream);
      check_launch(k::silu_mul(type_, b.gate_up.data_ptr(), b.act.data_ptr(), R, s_.n_ff, stream), "the decoding step");
      linear(b.down, b.act, w[5], stream);
      // The residual add, then the next layer's norm (or the output norm).
      const at::Tensor& next_norm = l + 1 < L ? s_.layers[l + 1][0] : s_.output_norm;
      check_launch(k::add_rms_norm(type_, b.x.data_ptr(), b.down.data_ptr(), next_norm.data_ptr(), b.normed.data_ptr(),
                                   R, s_.n_embd, eps, stream),
                   "the decoding step");
    }
    // The head over the last real row alone (its index read at replay).
    at::index_select_out(b.last, b.normed, 0, b.params.narrow(0, T + R, 1));
    linear(b.logits, b.last, s_.output, stream);
    b.logits_f32.copy_(b.logits);
  }

  comb::detail::DecodeStepSpec s_;
  bool graph_wanted_;
  k::Half type_ = k::Half::bf16;
  c10::Device device_{c10::kCUDA};
  bool gemv_ = false;
  int gemv_blocks_ = 1;
  bool fused_attention_ = false;
  std::map<int64_t, Bucket> buckets_;  // by rows
  std::optional<c10::MempoolId_t> pool_;  // every bucket's graph: they replay one after another on one stream
};

// The paged step's graphs, one per bucket (comb::detail::PagedGraphs).
class CudaPagedGraphs final : public comb::detail::PagedGraphs {
 public:
  explicit CudaPagedGraphs(c10::Device device) : device_(device) {}

  at::Tensor run(int64_t bucket, int64_t max_blocks, const std::vector<int64_t>& ids,
                 const std::vector<int64_t>& positions, const std::vector<int32_t>& table,
                 const std::vector<int64_t>& joined, const Body& body) override {
    COMB_CHECK(bucket >= 1 && max_blocks >= 1 && static_cast<int64_t>(ids.size()) == bucket &&
                   static_cast<int64_t>(positions.size()) == bucket &&
                   static_cast<int64_t>(table.size()) == bucket * max_blocks &&
                   static_cast<int64_t>(joined.size()) % (bucket * k::kJoinedParams) == 0,
               "paged graphs: {} ids, {} positions, {} table entries and {} joined parameters for a bucket of {} "
               "rows of {} blocks", ids.size(), positions.size(), table.size(), joined.size(), bucket, max_blocks);
    c10::cuda::CUDAGuard guard(device_);
    const auto n_joined = static_cast<int64_t>(joined.size());
    const Key key{bucket, max_blocks, n_joined > 0};
    Bucket& b = buckets_[key];
    if (!b.graph) {
      // Plain tensors whatever mode this first run is in: later runs write them in place.
      c10::InferenceMode plain(false);
      const auto on = at::TensorOptions().device(device_);
      b.ids = at::zeros({bucket}, on.dtype(at::kLong));
      b.positions = at::zeros({bucket}, on.dtype(at::kLong));
      b.table = at::zeros({bucket, max_blocks}, on.dtype(at::kInt));
      if (n_joined > 0) b.joined = at::zeros({n_joined}, on.dtype(at::kLong));
    }
    COMB_CHECK(b.joined.defined() ? b.joined.numel() == n_joined : n_joined == 0,
               "paged graphs: {} joined parameters for a bucket captured with {}", n_joined,
               b.joined.defined() ? b.joined.numel() : 0);
    // Queued on the stream the replay runs on, the host not waiting (stage_into).
    stage_into(b.ids, ids.data());
    stage_into(b.positions, positions.data());
    stage_into(b.table, table.data());
    if (n_joined > 0) stage_into(b.joined, joined.data());
    if (!b.graph) {
      // Every bucket's graph in one memory pool: they replay one after another on one stream, and
      // each output is copied out, so a new bucket mid-serve takes little memory of its own.
      if (!pool_) pool_ = at::cuda::graph_pool_handle();
      try {
        b.graph = capture_on_side(device_, [&] { b.out = body(b.ids, b.positions, b.table, b.joined); }, pool_);
      } catch (...) {  // the bucket left to capture anew
        buckets_.erase(key);
        throw;
      }
    }
    b.graph->replay();
    return b.out.clone();
  }

 private:
  struct Bucket {
    std::unique_ptr<at::cuda::CUDAGraph> graph;
    at::Tensor ids, positions, table, joined, out;  // joined: only where rows read documents
  };
  using Key = std::tuple<int64_t, int64_t, bool>;  // (rows, table width, rows reading documents)
  c10::Device device_;
  std::map<Key, Bucket> buckets_;
  std::optional<c10::MempoolId_t> pool_;
};

std::unique_ptr<comb::detail::PagedGraphs> make_paged_graphs(c10::Device device) {
  return std::make_unique<CudaPagedGraphs>(device);
}

std::unique_ptr<comb::detail::DecodeStep> make_decode_step(const comb::detail::DecodeStepSpec& spec, bool graph) {
  return std::make_unique<GraphDecodeStep>(spec, graph);
}

const comb::detail::CudaLayerOps kLayerOps{&add_rms_norm,   &rope_append,   &place_keys,       &silu_mul,
                                           &rows_attention, &join_documents, &quantize_int8, &paged_rope_store,
                                           &paged_attention, &free_memory,  &make_paged_graphs, &pin_host,
                                           &to_device_async, &paged_attention_joined, &split_documents,
                                           &rope_rows,      &profiler_range,  &pack_keys};

// Registered when the module loads (comb::load_cuda_backend).
[[maybe_unused]] const bool registered = (comb::detail::set_decode_step_factory(&make_decode_step),
                                          comb::detail::set_cuda_layer_ops(&kLayerOps), true);

}  // namespace

}  // namespace comb::ops

TORCH_LIBRARY_IMPL(comb, CUDA, m) {
  m.impl("add_rms_norm", &comb::ops::add_rms_norm_op);
  m.impl("rope_append", &comb::ops::rope_append);
  m.impl("place_keys", &comb::ops::place_keys);
  m.impl("gemv", &comb::ops::gemv);
  m.impl("silu_mul", &comb::ops::silu_mul);
  m.impl("rows_attention", &comb::ops::rows_attention_op);
}
