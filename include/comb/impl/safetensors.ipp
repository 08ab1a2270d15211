// The safetensors reader (one file, or shards with an index) and writer (see comb/safetensors.hpp).
// Compiled into libcomb (src/safetensors.cpp), or inline in every translation unit that
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
#include "comb/log.hpp"
#include "comb/safetensors.hpp"
#include "comb/detail/mapped_file.hpp"
#include "comb/detail/files.hpp"

namespace fs = std::filesystem;

namespace comb {

// ================================================================================================
// safetensors
// ================================================================================================

namespace detail::safetensors {  // this file's own helpers

COMB_INLINE c10::ScalarType safetensors_dtype(const std::string& name, const std::string& path, const std::string& tensor) {
  static const std::pair<const char*, c10::ScalarType> table[] = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16}, {"I64", at::kLong},
      {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},   {"U8", at::kByte},       {"BOOL", at::kBool}};
  for (auto& [n, t] : table)
    if (name == n) return t;
  COMB_FAIL("'{}': tensor '{}' has dtype '{}', which comb cannot read (supported: F64, F32, F16, BF16, I64, I32, I16, "
            "I8, U8, BOOL)",
            path, tensor, name);
}

COMB_INLINE const char* safetensors_dtype_name(c10::ScalarType t) {
  switch (t) {
    case at::kDouble: return "F64";
    case at::kFloat: return "F32";
    case at::kHalf: return "F16";
    case at::kBFloat16: return "BF16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: COMB_FAIL("safetensors cannot store dtype {}", c10::toString(t));
  }
}

}  // namespace detail::safetensors

COMB_INLINE SafetensorsFile::SafetensorsFile(const std::string& path) : file_(std::make_unique<detail::MappedFile>(path)) {
  const size_t size = file_->size();
  COMB_CHECK(size >= 8, "'{}' is not a safetensors file: {} bytes, shorter than the 8-byte header length", path, size);
  uint64_t n;
  std::memcpy(&n, file_->data(), 8);
  COMB_CHECK(n >= 2 && n <= size - 8 && n <= (uint64_t(100) << 20),
             "'{}': safetensors header length {} does not fit the file ({} bytes): truncated or not safetensors", path,
             n, size);
  const nlohmann::json header = detail::parse_json(
      std::string_view(reinterpret_cast<const char*>(file_->data()) + 8, n), fmt::format("'{}': safetensors header", path));
  COMB_CHECK(header.is_object(), "'{}': safetensors header should be a JSON object", path);
  const uint64_t data_start = 8 + n, data_size = size - data_start;
  for (auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      COMB_CHECK(value.is_object(), "'{}': __metadata__ should be an object of strings", path);
      for (auto& [k, v] : value.items()) {
        COMB_CHECK(v.is_string(), "'{}': __metadata__['{}'] should be a string", path, k);
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    COMB_CHECK(value.is_object() && value.contains("dtype") && value.contains("shape") &&
                   value.contains("data_offsets"),
               "'{}': tensor '{}' needs dtype, shape and data_offsets", path, name);
    Entry e;
    e.info.name = name;
    COMB_CHECK(value["dtype"].is_string(), "'{}': tensor '{}' dtype should be a string, found {}", path, name,
               value["dtype"].type_name());
    e.info.dtype = value["dtype"].get<std::string>();
    e.type = detail::safetensors::safetensors_dtype(e.info.dtype, path, name);
    const auto& shape = value["shape"];
    COMB_CHECK(shape.is_array() && shape.size() <= 8, "'{}': tensor '{}' shape should be a list of at most 8 sizes, found {}",
               path, name, shape.is_array() ? fmt::format("{} entries", shape.size()) : std::string(shape.type_name()));
    uint64_t numel = 1;
    bool wraps = false;
    for (const auto& d : shape) {
      COMB_CHECK(d.is_number_unsigned(), "'{}': tensor '{}' shape should hold sizes >= 0, found {}", path, name,
                 d.is_primitive() ? d.dump() : std::string(d.type_name()));
      e.info.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
      wraps = wraps || d.get<uint64_t>() > uint64_t(INT64_MAX) || __builtin_mul_overflow(numel, d.get<uint64_t>(), &numel);
    }
    const auto& off = value["data_offsets"];
    COMB_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
               "'{}': tensor '{}' data_offsets should be two unsigned integers, found {}", path, name, off.dump());
    uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    COMB_CHECK(b <= en && en <= data_size,
               "'{}': tensor '{}' data_offsets [{}, {}) lie outside the data section ({} bytes): truncated or corrupt",
               path, name, b, en, data_size);
    uint64_t expected = 0;
    wraps = wraps || __builtin_mul_overflow(numel, uint64_t(c10::elementSize(e.type)), &expected);
    COMB_CHECK(!wraps && en - b == expected, "'{}': tensor '{}' holds {} bytes but its shape {} of {} needs {}", path,
               name, en - b, shape.dump(), e.info.dtype,
               wraps ? std::string("more than 2^64") : std::to_string(expected));
    e.begin = data_start + b;
    e.end = data_start + en;
    entries_.push_back(std::move(e));
  }
  std::sort(entries_.begin(), entries_.end(), [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  // No two tensors may share bytes (empty tensors take none).
  const Entry* last = nullptr;
  for (const auto& e : entries_) {
    if (e.begin == e.end) continue;
    COMB_CHECK(!last || e.begin >= last->end, "'{}': tensors '{}' [{}, {}) and '{}' [{}, {}) overlap in the data section",
               path, last ? last->info.name : "", last ? last->begin - data_start : 0, last ? last->end - data_start : 0,
               e.info.name, e.begin - data_start, e.end - data_start);
    last = &e;
  }
  for (size_t i = 0; i < entries_.size(); ++i) index_[entries_[i].info.name] = i;
}

COMB_INLINE SafetensorsFile::~SafetensorsFile() = default;

COMB_INLINE std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.info.name);
  return out;
}

COMB_INLINE const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second].info;
}

COMB_INLINE std::string SafetensorsFile::where() const { return file_->path(); }

COMB_INLINE at::Tensor SafetensorsFile::load(const std::string& name, c10::ScalarType dtype) const {
  auto it = index_.find(name);
  COMB_CHECK(it != index_.end(), "'{}': no tensor named '{}'", file_->path(), name);
  const Entry& e = entries_[it->second];
  at::Tensor out =
      detail::files::tensor_from_bytes(file_->data() + e.begin, e.end - e.begin, e.info.shape, e.type, dtype);
  file_->release(file_->data() + e.begin, e.end - e.begin);
  return out;
}

COMB_INLINE ShardedSafetensors::ShardedSafetensors(const std::string& index_path) : index_path_(index_path) {
  const nlohmann::json index =
      detail::parse_json(detail::read_text_file(index_path, detail::kMaxJsonFileBytes), fmt::format("'{}'", index_path));
  COMB_CHECK(index.contains("weight_map") && index["weight_map"].is_object(), "'{}': no \"weight_map\" object",
             index_path);
  fs::path dir = fs::path(index_path).parent_path();
  std::map<std::string, const SafetensorsFile*> by_file;
  for (auto& [tensor, file] : index["weight_map"].items()) {
    COMB_CHECK(file.is_string(), "'{}': the weight map's entry for '{}' should be a file name, found {}", index_path,
               tensor, file.type_name());
    std::string f = file.get<std::string>();
    // Shards sit beside the index: a name with a directory in it ('../x', '/x') is refused.
    COMB_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..",
               "'{}': the weight map puts '{}' in '{}'; expected a file name in the index's directory", index_path,
               tensor, f);
    if (!by_file.count(f)) {
      shards_.push_back(std::make_unique<SafetensorsFile>((dir / f).string()));
      by_file[f] = shards_.back().get();
    }
    const SafetensorsFile* shard = by_file[f];
    COMB_CHECK(shard->find(tensor), "'{}': the weight map puts '{}' in '{}', which does not hold it", index_path,
               tensor, f);
    owner_[tensor] = shard;
    names_.push_back(tensor);
  }
}

COMB_INLINE std::vector<std::string> ShardedSafetensors::names() const { return names_; }

COMB_INLINE const TensorInfo* ShardedSafetensors::find(const std::string& name) const {
  auto it = owner_.find(name);
  return it == owner_.end() ? nullptr : it->second->find(name);
}

COMB_INLINE at::Tensor ShardedSafetensors::load(const std::string& name, c10::ScalarType dtype) const {
  auto it = owner_.find(name);
  COMB_CHECK(it != owner_.end(), "'{}': no tensor named '{}'", index_path_, name);
  return it->second->load(name, dtype);
}

COMB_INLINE void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    COMB_CHECK(name != "__metadata__" && !header.contains(name), "'{}': tensor name '{}' used twice or reserved", path,
               name);
    at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    uint64_t n = t.numel() * t.element_size();
    header[name] = {{"dtype", detail::safetensors::safetensors_dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
    data.push_back(std::move(t));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t n = text.size();
  detail::files::AtomicWriter writer(path);
  writer.write(&n, 8);
  writer.write(text.data(), text.size());
  for (const auto& t : data) writer.write(t.data_ptr(), t.numel() * t.element_size());
  writer.commit();
}

}  // namespace comb
