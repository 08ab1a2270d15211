#pragma once
// safetensors reader (memory-mapped, single file or sharded index) and atomic writer.
#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "comb/tensor_source.hpp"

namespace comb {

namespace detail {
class MappedFile;
}

class SafetensorsFile : public TensorSource {
 public:
  // Memory-maps and validates `path` (header length, JSON, dtypes, offsets within the file).
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile() override;

  // The optional "__metadata__" string map.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  std::vector<std::string> names() const override;
  const TensorInfo* find(const std::string& name) const override;
  at::Tensor load(const std::string& name, c10::ScalarType dtype) const override;
  std::string where() const override;

 private:
  struct Entry {
    TensorInfo info;
    c10::ScalarType type;
    uint64_t begin = 0;  // from the start of the file
    uint64_t end = 0;
  };
  std::unique_ptr<detail::MappedFile> file_;
  std::map<std::string, std::string> metadata_;
  std::vector<Entry> entries_;
  std::unordered_map<std::string, size_t> index_;
};

// A sharded checkpoint: model.safetensors.index.json ({"weight_map": {tensor: file}}).
class ShardedSafetensors : public TensorSource {
 public:
  explicit ShardedSafetensors(const std::string& index_path);
  std::vector<std::string> names() const override;
  const TensorInfo* find(const std::string& name) const override;
  at::Tensor load(const std::string& name, c10::ScalarType dtype) const override;
  std::string where() const override { return index_path_; }

 private:
  std::string index_path_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, const SafetensorsFile*> owner_;
};

// Writes tensors (any device; copied to CPU, made contiguous) and string metadata to `path`
// atomically: the file either appears whole or not at all.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/safetensors.ipp"
#endif
