#pragma once
// GGUF reader (versions 2 and 3): metadata, tensor table, and dequantization to a compute dtype.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "comb/tensor_source.hpp"

namespace comb {

namespace detail {
class MappedFile;
}

// The GGML tensor types comb reads. Others are reported by number, never read wrongly.
enum class GgmlType : uint32_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, BF16 = 30 };

// The name GGML gives a tensor type ("Q4_1"), or "type N" when comb does not know it.
std::string ggml_type_name(uint32_t type);

class GgufFile : public TensorSource {
 public:
  // Memory-maps and validates `path`; throws comb::Error naming the path and the byte offset.
  explicit GgufFile(const std::string& path);
  ~GgufFile() override;

  uint32_t version() const { return version_; }
  // Every metadata key-value pair; arrays become JSON arrays, floats doubles.
  const nlohmann::json& metadata() const { return metadata_; }
  bool has(const std::string& key) const { return metadata_.contains(key); }
  // Typed metadata access; a missing or mistyped key is an error naming the key and the file.
  const nlohmann::json& get(const std::string& key) const;
  std::string get_string(const std::string& key) const;
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;

  std::vector<std::string> names() const override;
  const TensorInfo* find(const std::string& name) const override;
  at::Tensor load(const std::string& name, c10::ScalarType dtype) const override;
  std::optional<GroupedWeights> load_grouped(const std::string& name) const override;
  std::string where() const override;

 private:
  struct Entry {
    TensorInfo info;
    uint32_t type = 0;
    uint64_t offset = 0;  // from the start of the file
    uint64_t n_bytes = 0;
  };
  std::unique_ptr<detail::MappedFile> file_;
  uint32_t version_ = 0;
  nlohmann::json metadata_;
  std::vector<Entry> entries_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/gguf.ipp"
#endif
