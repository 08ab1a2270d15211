// The GGUF (v2/v3) reader: metadata, tensors, dequantization, grouped weights kept as stored (see comb/gguf.hpp).
// Compiled into libcomb (src/gguf.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "comb/detail/json.hpp"
#include "comb/error.hpp"
#include "comb/gguf.hpp"
#include "comb/log.hpp"
#include "comb/quantized.hpp"
#include "comb/detail/mapped_file.hpp"
#include "comb/detail/files.hpp"

namespace comb {

// ================================================================================================
// GGUF
// ================================================================================================

namespace detail::gguf {  // this file's own helpers

enum GgufValueType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

// Bounds-checked little-endian reader over the mapped file.
struct Cursor {
  const uint8_t* base;
  size_t size;
  size_t pos;
  const std::string& path;

  void need(uint64_t n, const std::string& what) const {
    COMB_CHECK(n <= size - pos, "'{}': truncated or corrupt GGUF: {} needs {} bytes at offset {}, but the file ends at {}",
               path, what, n, pos, size);
  }
  // `n` items of at least `each` bytes: compared by division, so a count that would wrap a
  // multiplication is refused as well.
  void need_items(uint64_t n, uint64_t each, const std::string& what) const {
    COMB_CHECK(n <= (size - pos) / each,
               "'{}': truncated or corrupt GGUF: {} of at least {} bytes each do not fit in the {} bytes left at offset {}",
               path, what, each, size - pos, pos);
  }
  template <typename T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string read_string(const std::string& what) {
    uint64_t n = read<uint64_t>(what + " (string length)");
    need(n, what);
    std::string s(reinterpret_cast<const char*>(base + pos), n);
    pos += n;
    return s;
  }
};

COMB_INLINE size_t gguf_scalar_size(uint32_t type) {
  switch (type) {
    case kU8: case kI8: case kBool: return 1;
    case kU16: case kI16: return 2;
    case kU32: case kI32: case kF32: return 4;
    case kU64: case kI64: case kF64: return 8;
    case kString: return 8;  // at least its length
    default: return 0;
  }
}

COMB_INLINE nlohmann::json read_gguf_value(Cursor& c, uint32_t type, const std::string& key, int depth = 0) {
  switch (type) {
    case kU8: return c.read<uint8_t>(key);
    case kI8: return c.read<int8_t>(key);
    case kU16: return c.read<uint16_t>(key);
    case kI16: return c.read<int16_t>(key);
    case kU32: return c.read<uint32_t>(key);
    case kI32: return c.read<int32_t>(key);
    case kF32: return static_cast<double>(c.read<float>(key));
    case kBool: return c.read<uint8_t>(key) != 0;
    case kString: return c.read_string(key);
    case kU64: return c.read<uint64_t>(key);
    case kI64: return c.read<int64_t>(key);
    case kF64: return c.read<double>(key);
    case kArray: {
      COMB_CHECK(depth < 4, "'{}': GGUF metadata '{}' nests arrays too deeply", c.path, key);
      uint32_t elem = c.read<uint32_t>(key + " (array type)");
      uint64_t n = c.read<uint64_t>(key + " (array length)");
      // A nested array takes at least its type and length (12 bytes).
      size_t min_size = elem == kArray ? 12 : gguf_scalar_size(elem);
      COMB_CHECK(min_size > 0, "'{}': GGUF metadata '{}' has unknown array element type {} (at offset {})", c.path,
                 key, elem, c.pos - 12);
      c.need_items(n, min_size, fmt::format("'{}' (an array of {} elements)", key, n));
      nlohmann::json out = nlohmann::json::array();
      out.get_ref<nlohmann::json::array_t&>().reserve(n);
      for (uint64_t i = 0; i < n; ++i) out.push_back(read_gguf_value(c, elem, key, depth + 1));
      return out;
    }
    default: COMB_FAIL("'{}': GGUF metadata '{}' has unknown value type {} (at offset {})", c.path, key, type, c.pos);
  }
}

// Block size (weights) and bytes per block of the types comb reads; {0, 0} for others.
COMB_INLINE std::pair<int64_t, int64_t> ggml_block(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::F32: return {1, 4};
    case GgmlType::F16: return {1, 2};
    case GgmlType::BF16: return {1, 2};
    case GgmlType::Q8_0: return {32, 34};
    case GgmlType::Q4_0: return {32, 18};
    case GgmlType::Q4_1: return {32, 20};
  }
  return {0, 0};
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Dequantizes `n_blocks` blocks of `type` at `src` into `dst` (float32).
COMB_INLINE void dequantize(uint32_t type, const uint8_t* src, float* dst, int64_t n_blocks) {
  const auto [block_, block_bytes_] = ggml_block(type);
  const int64_t block = block_, block_bytes = block_bytes_;  // lambdas may not capture bindings (C++17)
  at::parallel_for(0, n_blocks, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* in = src + b * block_bytes;
      float* out = dst + b * block;
      switch (static_cast<GgmlType>(type)) {
        case GgmlType::Q8_0: {
          float d = half_to_float(in);
          const int8_t* q = reinterpret_cast<const int8_t*>(in + 2);
          for (int j = 0; j < 32; ++j) out[j] = d * q[j];
          break;
        }
        case GgmlType::Q4_0: {
          float d = half_to_float(in);
          const uint8_t* q = in + 2;
          for (int j = 0; j < 16; ++j) {
            out[j] = d * ((q[j] & 0xF) - 8);
            out[j + 16] = d * ((q[j] >> 4) - 8);
          }
          break;
        }
        case GgmlType::Q4_1: {
          float d = half_to_float(in), m = half_to_float(in + 2);
          const uint8_t* q = in + 4;
          for (int j = 0; j < 16; ++j) {
            out[j] = d * (q[j] & 0xF) + m;
            out[j + 16] = d * (q[j] >> 4) + m;
          }
          break;
        }
        default: break;
      }
    }
  });
}

}  // namespace detail::gguf

COMB_INLINE std::string ggml_type_name(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::F32: return "F32";
    case GgmlType::F16: return "F16";
    case GgmlType::BF16: return "BF16";
    case GgmlType::Q8_0: return "Q8_0";
    case GgmlType::Q4_0: return "Q4_0";
    case GgmlType::Q4_1: return "Q4_1";
  }
  static const char* others[] = {nullptr, nullptr, nullptr, nullptr, "Q4_2", "Q4_3", "Q5_0", "Q5_1", nullptr,
                                 "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K"};
  if (type < 16 && others[type]) return others[type];
  return fmt::format("type {}", type);
}

COMB_INLINE GgufFile::GgufFile(const std::string& path) : file_(std::make_unique<detail::MappedFile>(path)) {
  detail::gguf::Cursor c{file_->data(), file_->size(), 0, path};
  c.need(4, "the magic number");
  COMB_CHECK(std::memcmp(file_->data(), "GGUF", 4) == 0,
             "'{}' is not a GGUF file: expected the magic 'GGUF' at offset 0, found bytes {:02x} {:02x} {:02x} {:02x}",
             path, file_->data()[0], file_->data()[1], file_->data()[2], file_->data()[3]);
  c.pos = 4;
  version_ = c.read<uint32_t>("the version");
  COMB_CHECK(version_ == 2 || version_ == 3, "'{}': GGUF version {} is not supported (expected 2 or 3)", path,
             version_);
  uint64_t n_tensors = c.read<uint64_t>("the tensor count");
  uint64_t n_kv = c.read<uint64_t>("the metadata count");
  // Every entry takes at least 8 (+4) bytes: a count past the end of the file is corrupt.
  c.need_items(n_kv, 12, fmt::format("{} metadata entries", n_kv));
  metadata_ = nlohmann::json::object();
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = c.read_string(fmt::format("metadata key {}", i));
    uint32_t type = c.read<uint32_t>(key + " (type)");
    metadata_[key] = detail::gguf::read_gguf_value(c, type, key);
  }
  c.need_items(n_tensors, 24, fmt::format("{} tensor descriptions", n_tensors));
  entries_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    Entry e;
    e.info.name = c.read_string(fmt::format("tensor {} name", i));
    uint32_t n_dims = c.read<uint32_t>(e.info.name + " (rank)");
    COMB_CHECK(n_dims >= 1 && n_dims <= 4, "'{}': tensor '{}' has rank {} (expected 1 to 4)", path, e.info.name, n_dims);
    std::vector<int64_t> dims(n_dims);
    for (auto& d : dims) {
      uint64_t v = c.read<uint64_t>(e.info.name + " (dims)");
      COMB_CHECK(v > 0 && v < (uint64_t(1) << 40), "'{}': tensor '{}' has dimension {} (expected 1 to 2^40 - 1)",
                 path, e.info.name, v);
      d = static_cast<int64_t>(v);
    }
    e.info.shape.assign(dims.rbegin(), dims.rend());  // GGUF lists the fastest dimension first
    e.type = c.read<uint32_t>(e.info.name + " (type)");
    e.info.dtype = ggml_type_name(e.type);
    e.offset = c.read<uint64_t>(e.info.name + " (offset)");
    COMB_CHECK(index_.emplace(e.info.name, entries_.size()).second, "'{}': tensor '{}' appears twice", path,
               e.info.name);
    entries_.push_back(std::move(e));
  }
  uint64_t alignment = 32;
  if (metadata_.contains("general.alignment")) {
    const auto& a = metadata_["general.alignment"];
    COMB_CHECK(a.is_number_unsigned() && a.get<uint64_t>() > 0 && a.get<uint64_t>() < (uint64_t(1) << 32) &&
                   (a.get<uint64_t>() & (a.get<uint64_t>() - 1)) == 0,
               "'{}': general.alignment must be a power of two below 2^32 (a uint32), found {}", path, a.dump());
    alignment = a.get<uint64_t>();
  }
  const uint64_t size = file_->size();
  const uint64_t data_start = (c.pos + alignment - 1) / alignment * alignment;
  for (auto& e : entries_) {
    const auto [block, block_bytes] = detail::gguf::ggml_block(e.type);
    COMB_CHECK(e.offset % alignment == 0, "'{}': tensor '{}' offset {} is not a multiple of the alignment {}", path,
               e.info.name, e.offset, alignment);
    if (block == 0) continue;  // unknown type: its size is unknown, reading it is refused later
    COMB_CHECK(e.info.shape.back() % block == 0, "'{}': tensor '{}' rows of {} are not whole {} blocks of {}", path,
               e.info.name, e.info.shape.back(), e.info.dtype, block);
    // Sizes and offsets with overflow checks: a product or sum that wraps around would otherwise
    // pass the bounds check and point anywhere in the file.
    uint64_t numel = 1;
    bool wraps = false;
    for (auto d : e.info.shape) wraps = wraps || __builtin_mul_overflow(numel, uint64_t(d), &numel);
    wraps = wraps || __builtin_mul_overflow(numel / block, uint64_t(block_bytes), &e.n_bytes);
    COMB_CHECK(!wraps && data_start <= size && e.offset <= size - data_start &&
                   e.n_bytes <= size - data_start - e.offset,
               "'{}': tensor '{}' ({} of shape [{}]) at offset {} after the data start {} lies past the end of the file "
               "({} bytes): truncated or corrupt",
               path, e.info.name, e.info.dtype, fmt::join(e.info.shape, ", "), e.offset, data_start, size);
    e.offset += data_start;
  }
}

COMB_INLINE GgufFile::~GgufFile() = default;

COMB_INLINE const nlohmann::json& GgufFile::get(const std::string& key) const {
  auto it = metadata_.find(key);
  COMB_CHECK(it != metadata_.end(), "'{}': GGUF metadata key '{}' is missing", file_->path(), key);
  return *it;
}

COMB_INLINE std::string GgufFile::get_string(const std::string& key) const {
  const auto& v = get(key);
  COMB_CHECK(v.is_string(), "'{}': GGUF metadata '{}' should be a string, found {}", file_->path(), key, v.type_name());
  return v.get<std::string>();
}

COMB_INLINE int64_t GgufFile::get_int(const std::string& key) const {
  const auto& v = get(key);
  COMB_CHECK(v.is_number_integer(), "'{}': GGUF metadata '{}' should be an integer, found {}", file_->path(), key,
             v.type_name());
  return v.get<int64_t>();
}

COMB_INLINE double GgufFile::get_float(const std::string& key) const {
  const auto& v = get(key);
  COMB_CHECK(v.is_number(), "'{}': GGUF metadata '{}' should be a number, found {}", file_->path(), key, v.type_name());
  return v.get<double>();
}

COMB_INLINE std::vector<std::string> GgufFile::names() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.info.name);
  return out;
}

COMB_INLINE const TensorInfo* GgufFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second].info;
}

COMB_INLINE std::string GgufFile::where() const { return file_->path(); }

COMB_INLINE at::Tensor GgufFile::load(const std::string& name, c10::ScalarType dtype) const {
  auto it = index_.find(name);
  COMB_CHECK(it != index_.end(), "'{}': no tensor named '{}'", file_->path(), name);
  const Entry& e = entries_[it->second];
  const int64_t block = detail::gguf::ggml_block(e.type).first;
  COMB_CHECK(block > 0, "'{}': tensor '{}' has type {}, which comb cannot read (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)",
             file_->path(), name, e.info.dtype);
  void* src = const_cast<uint8_t*>(file_->data() + e.offset);
  auto type = static_cast<GgmlType>(e.type);
  if (type == GgmlType::F32 || type == GgmlType::F16 || type == GgmlType::BF16) {
    auto stored = type == GgmlType::F32 ? at::kFloat : type == GgmlType::F16 ? at::kHalf : at::kBFloat16;
    at::Tensor out =
        detail::files::tensor_from_bytes(static_cast<const uint8_t*>(src), e.n_bytes, e.info.shape, stored, dtype);
    file_->release(static_cast<const uint8_t*>(src), e.n_bytes);
    return out;
  }
  at::Tensor out = at::empty(e.info.shape, at::kFloat);
  detail::gguf::dequantize(e.type, static_cast<const uint8_t*>(src), out.data_ptr<float>(), out.numel() / block);
  file_->release(static_cast<const uint8_t*>(src), e.n_bytes);
  return dtype == at::kFloat ? out : out.to(dtype);
}

COMB_INLINE std::optional<GroupedWeights> GgufFile::load_grouped(const std::string& name) const {
  auto it = index_.find(name);
  COMB_CHECK(it != index_.end(), "'{}': no tensor named '{}'", file_->path(), name);
  const Entry& e = entries_[it->second];
  const auto type = static_cast<GgmlType>(e.type);
  if ((type != GgmlType::Q4_0 && type != GgmlType::Q4_1 && type != GgmlType::Q8_0) || e.info.shape.size() != 2)
    return std::nullopt;
  const int64_t rows = e.info.shape[0], cols = e.info.shape[1], groups = cols / 32;
  // A local the lambda below may capture (C++17).
  const int64_t block_bytes = detail::gguf::ggml_block(e.type).second;
  COMB_CHECK(cols % 32 == 0 && static_cast<uint64_t>(rows * groups * block_bytes) == e.n_bytes,
             "'{}': tensor '{}' ({}, [{}, {}]) is not whole blocks of 32", file_->path(), name, e.info.dtype, rows, cols);
  const uint8_t* src = file_->data() + e.offset;
  GroupedWeights w;
  w.kind = type == GgmlType::Q8_0 ? GroupedWeights::Kind::q8 : GroupedWeights::Kind::q4;
  w.centered = type == GgmlType::Q4_0;
  w.q = at::empty({rows, cols}, type == GgmlType::Q8_0 ? at::kChar : at::kByte);
  w.scale = at::empty({rows, groups}, at::kFloat);
  w.min = at::zeros({rows, groups}, at::kFloat);
  uint8_t* q = static_cast<uint8_t*>(w.q.data_ptr());
  float* scale = w.scale.data_ptr<float>();
  float* min = w.min.data_ptr<float>();
  at::parallel_for(0, rows * groups, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* in = src + b * block_bytes;
      uint8_t* out = q + b * 32;
      scale[b] = detail::gguf::half_to_float(in);
      if (type == GgmlType::Q8_0) {
        std::memcpy(out, in + 2, 32);
      } else {
        const uint8_t* nibbles = in + (type == GgmlType::Q4_1 ? 4 : 2);
        // Q4_0: w = d (q - 8) = d q - 8 d; Q4_1: w = d q + m.
        min[b] = type == GgmlType::Q4_1 ? detail::gguf::half_to_float(in + 2) : -8 * scale[b];
        for (int j = 0; j < 16; ++j) {
          out[j] = nibbles[j] & 0xF;
          out[j + 16] = nibbles[j] >> 4;
        }
      }
    }
  });
  file_->release(src, e.n_bytes);
  return w;
}

}  // namespace comb
