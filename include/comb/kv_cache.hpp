#pragma once
// K/V caches: one sequence's (KVCache, preallocated per layer) and many sequences' in blocks
// (BlockPool, the server's), and the rotary embedding's tables.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "comb/config.hpp"

namespace comb {

// Per-layer key/value cache, preallocated to `capacity` positions.
class KVCache {
 public:
  KVCache(const ModelConfig& config, int64_t batch, int64_t capacity, c10::ScalarType dtype, c10::Device device);

  int64_t length() const { return length_; }
  int64_t capacity() const { return capacity_; }
  int64_t batch() const { return batch_; }
  int64_t n_layers() const { return static_cast<int64_t>(k_.size()); }
  // Stores k, v [batch, n_head_kv, n, head_dim] of `layer` at positions [length, length + n) and
  // returns views of the cache over [0, length + n). The length moves on with advance().
  std::pair<at::Tensor, at::Tensor> append(int64_t layer, const at::Tensor& k, const at::Tensor& v);
  void advance(int64_t n);
  // Forgets every position from `n` on.
  void truncate(int64_t n);
  // Declares positions [0, n) filled (by write() or layer_at()); n <= capacity.
  void set_length(int64_t n);
  // Writes k, v [batch, n_head_kv, n, head_dim] of `layer` at positions [pos, pos + n).
  void write(int64_t layer, int64_t pos, const at::Tensor& k, const at::Tensor& v);
  // The whole preallocated cache of `layer`: [batch, n_head_kv, capacity, head_dim].
  const at::Tensor& keys(int64_t layer) const { return k_[layer]; }
  const at::Tensor& values(int64_t layer) const { return v_[layer]; }

 private:
  std::vector<at::Tensor> k_, v_;  // per layer: [batch, n_head_kv, capacity, head_dim]
  int64_t batch_ = 0;
  int64_t capacity_ = 0;
  int64_t length_ = 0;
};

// A paged K/V cache for many sequences at once (the server's running requests): per layer, keys
// and values [n_blocks, n_head_kv, block_tokens, head_dim] in the decoder's dtype, on its device
// (float32 on the CPU), allocated once; a sequence holds whole blocks, listed in its block table.
class BlockPool {
 public:
  BlockPool(const ModelConfig& config, int64_t n_blocks, int64_t block_tokens, c10::ScalarType dtype = c10::kFloat,
            c10::Device device = c10::kCPU);
  // Bytes of one block over every layer (keys and values) in `dtype`.
  static int64_t block_bytes(const ModelConfig& config, int64_t block_tokens, c10::ScalarType dtype);
  // `n` free blocks, or an empty list (and nothing taken) when fewer are free.
  std::vector<int32_t> allocate(int64_t n);
  void release(const std::vector<int32_t>& blocks);
  // Copies positions [0, n) of a one-sequence cache into `blocks` (enough of them for n).
  void load(const KVCache& cache, int64_t n, const std::vector<int32_t>& blocks);
  const at::Tensor& keys(int64_t layer) const { return k_[layer]; }
  const at::Tensor& values(int64_t layer) const { return v_[layer]; }
  int64_t block_tokens() const { return block_tokens_; }
  int64_t n_blocks() const { return n_blocks_; }
  int64_t n_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t bytes() const;  // of the whole pool
  int64_t blocks_for(int64_t tokens) const { return (tokens + block_tokens_ - 1) / block_tokens_; }
  // What the decoder stepping over this pool keeps with it (the CUDA graphs of its paged step,
  // which hold the pool's addresses), released with the pool.
  std::shared_ptr<void>& step_state() { return step_state_; }

 private:
  std::shared_ptr<void> step_state_;
  std::vector<at::Tensor> k_, v_;
  std::vector<int32_t> free_;
  int64_t n_blocks_, block_tokens_;
};

// cos/sin tables of the rotary embedding for positions [0, n_pos): each [n_pos, head_dim].
std::pair<at::Tensor, at::Tensor> rope_tables(const ModelConfig& config, const at::Tensor& rope_freqs, int64_t n_pos,
                                              c10::ScalarType dtype, c10::Device device);
// The inverse frequencies [head_dim / 2] (fp32) after scaling.
at::Tensor rope_inv_freq(const ModelConfig& config, const at::Tensor& rope_freqs);

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/kv_cache.ipp"
#endif
