#pragma once
// TensorSource: a checkpoint's named tensors, whatever the file format (GGUF, safetensors).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace comb {

struct GroupedWeights;  // comb/quantized.hpp

// What a checkpoint says about one tensor before it is read.
struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;  // row-major (PyTorch) order, slowest dimension first
  std::string dtype;           // the stored type as the format names it ("Q4_1", "BF16", ...)
};

class TensorSource {
 public:
  virtual ~TensorSource() = default;
  // Every tensor name, in file order.
  virtual std::vector<std::string> names() const = 0;
  // The tensor's description, or nullptr when the checkpoint has no such tensor.
  virtual const TensorInfo* find(const std::string& name) const = 0;
  // Reads (and dequantizes) a tensor into a new CPU tensor of `dtype`; throws comb::Error if absent.
  virtual at::Tensor load(const std::string& name, c10::ScalarType dtype) const = 0;
  // A 2-D tensor stored in groups of 32 (GGUF Q4_0, Q4_1, Q8_0), unpacked but not dequantized;
  // nullopt when it is stored otherwise (floats) or the format has no such types.
  virtual std::optional<GroupedWeights> load_grouped(const std::string& name) const;
  // The file (or files) the tensors come from, for messages.
  virtual std::string where() const = 0;
};

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/tensor_source.ipp"
#endif
