#pragma once
// Opening a checkpoint by path, whatever its format.
#include <memory>
#include <string>

#include "comb/gguf.hpp"
#include "comb/safetensors.hpp"
#include "comb/tensor_source.hpp"

namespace comb {

// Opens a checkpoint by path: a .gguf file, a .safetensors file, a sharded
// model.safetensors.index.json, or a directory holding one of the latter two.
std::unique_ptr<TensorSource> open_tensor_source(const std::string& path);

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/checkpoint.ipp"
#endif
