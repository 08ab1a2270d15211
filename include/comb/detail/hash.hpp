#pragma once
// 128-bit hashes of tensors (xxHash XXH3): the fingerprints of a base decoder and of a plug-in.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <xxhash.h>

#include <string>

namespace comb::detail::hash {

inline std::string hex128(XXH128_hash_t h) { return fmt::format("{:016x}{:016x}", h.high64, h.low64); }

// Feeds a tensor's bytes (on the CPU, contiguous) to `state`.
inline void hash_tensor(XXH3_state_t* state, const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  XXH3_128bits_update(state, c.data_ptr(), c.numel() * c.element_size());
}

}  // namespace comb::detail::hash
