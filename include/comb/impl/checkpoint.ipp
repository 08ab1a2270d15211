// Opening a checkpoint by path (see comb/checkpoint.hpp).
// Compiled into libcomb (src/checkpoint.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"

#include <filesystem>
#include <memory>
#include <string>

#include "comb/checkpoint.hpp"
#include "comb/error.hpp"

namespace comb {

COMB_INLINE std::unique_ptr<TensorSource> open_tensor_source(const std::string& path) {
  std::filesystem::path p(path);
  std::error_code ec;
  COMB_CHECK(std::filesystem::exists(p, ec), "model file '{}' does not exist", path);
  if (std::filesystem::is_directory(p)) {
    if (std::filesystem::exists(p / "model.safetensors.index.json"))
      return std::make_unique<ShardedSafetensors>((p / "model.safetensors.index.json").string());
    if (std::filesystem::exists(p / "model.safetensors")) return std::make_unique<SafetensorsFile>((p / "model.safetensors").string());
    COMB_FAIL("directory '{}' holds neither model.safetensors nor model.safetensors.index.json", path);
  }
  std::string name = p.filename().string();
  if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".gguf") == 0) return std::make_unique<GgufFile>(path);
  if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".json") == 0)
    return std::make_unique<ShardedSafetensors>(path);
  return std::make_unique<SafetensorsFile>(path);
}

}  // namespace comb
