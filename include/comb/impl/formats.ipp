// File formats: memory-mapped files, GGUF (v2/v3) and safetensors readers, the safetensors
// writer, and opening a checkpoint by path.
// Compiled into libcomb (src/formats.cpp), or inline in every translation unit that
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
#include "comb/safetensors.hpp"
#include "comb/detail/mapped_file.hpp"

namespace fs = std::filesystem;

namespace comb {

namespace detail {

// ================================================================================================
// Files
// ================================================================================================

COMB_INLINE MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  COMB_CHECK(fd >= 0, "cannot open '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    COMB_FAIL("'{}' is not a regular file", path);
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    ::close(fd);
    COMB_CHECK(p != MAP_FAILED, "cannot map '{}': {}", path, std::strerror(err));
    data_ = static_cast<const uint8_t*>(p);
  } else {
    ::close(fd);
  }
}

COMB_INLINE void MappedFile::release(const uint8_t* begin, size_t n) const {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  if (!data_ || begin < data_ || n == 0) return;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page;
  const uintptr_t hi = std::min(reinterpret_cast<uintptr_t>(begin) + n, reinterpret_cast<uintptr_t>(data_) + size_) / page * page;
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // advice only: failure is harmless
}

COMB_INLINE MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

COMB_INLINE std::string read_text_file(const std::string& path, int64_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  COMB_CHECK(in.good(), "cannot open '{}': {}", path, std::strerror(errno));
  std::error_code ec;
  const auto size = fs::file_size(path, ec);  // a pipe or device has none: read up to the bound
  COMB_CHECK(ec || size <= static_cast<uintmax_t>(max_bytes), "'{}' holds {} bytes, more than the {} read whole", path,
             size, max_bytes);
  std::string out;
  char chunk[1 << 16];
  while (in.read(chunk, sizeof(chunk)) || in.gcount() > 0) {
    out.append(chunk, static_cast<size_t>(in.gcount()));
    COMB_CHECK(static_cast<int64_t>(out.size()) <= max_bytes, "'{}' holds more than the {} bytes read whole", path,
               max_bytes);
  }
  return out;
}

namespace formats {  // this file's own helpers
// Writes a file under a temporary name in the same directory; commit() makes it appear whole.
class AtomicWriter {
 public:
  explicit AtomicWriter(const std::string& path, unsigned mode = 0666) : path_(path) {
    fs::path p(path);
    std::string dir = p.parent_path().empty() ? "." : p.parent_path().string();
    dir_ = dir;
    // open(O_EXCL) with `mode` rather than mkstemp (always 0600): the file gets the permissions the
    // umask gives any new file, like a file written in place would.
    static std::atomic<uint64_t> counter{0};
    for (int attempt = 0; fd_ < 0; ++attempt) {
      tmp_ = fmt::format("{}/.{}.tmp-{}-{}", dir, p.filename().string(), ::getpid(), counter++);
      fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, static_cast<mode_t>(mode));
      COMB_CHECK(fd_ >= 0 || (errno == EEXIST && attempt < 100), "cannot write '{}' (temporary file in '{}'): {}",
                 path, dir, std::strerror(errno));
    }
  }
  ~AtomicWriter() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  void write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      COMB_CHECK(w > 0, "cannot write '{}': {}", path_, std::strerror(errno));
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  void commit() {
    COMB_CHECK(::fsync(fd_) == 0, "cannot write '{}': {}", path_, std::strerror(errno));
    const int closed = ::close(fd_);
    fd_ = -1;
    COMB_CHECK(closed == 0, "cannot write '{}': {}", path_, std::strerror(errno));
    COMB_CHECK(::rename(tmp_.c_str(), path_.c_str()) == 0, "cannot write '{}': {}", path_, std::strerror(errno));
    committed_ = true;
    // The rename is durable once the directory is synced; a file system that cannot sync a
    // directory still has the file whole under its name, so that failure is not an error.
    const int d = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d >= 0) {
      ::fsync(d);
      ::close(d);
    }
  }

 private:
  std::string path_, tmp_, dir_;
  int fd_ = -1;
  bool committed_ = false;
};
}  // namespace formats

COMB_INLINE void write_file_atomic(const std::string& path, const std::string& bytes, unsigned mode) {
  detail::formats::AtomicWriter writer(path, mode);
  writer.write(bytes.data(), bytes.size());
  writer.commit();
}

}  // namespace detail

// ================================================================================================
// GGUF
// ================================================================================================

namespace detail::formats {  // this file's own helpers

// A tensor of `stored` elements read from mapped bytes and converted to `dtype`, always a copy.
// Bytes not aligned to their element (GGUF general.alignment 1 or 2, a safetensors offset) are
// copied as bytes first: the element type may not be read from them in place.
COMB_INLINE at::Tensor tensor_from_bytes(const uint8_t* src, uint64_t n_bytes, const std::vector<int64_t>& shape,
                             c10::ScalarType stored, c10::ScalarType dtype) {
  if (reinterpret_cast<uintptr_t>(src) % c10::elementSize(stored) != 0) {
    at::Tensor out = at::empty(shape, stored);
    if (n_bytes > 0) std::memcpy(out.data_ptr(), src, n_bytes);  // an empty tensor has no data pointer
    return out.to(dtype);
  }
  return at::from_blob(const_cast<uint8_t*>(src), shape, at::TensorOptions().dtype(stored))
      .to(dtype, false, /*copy=*/true);
}

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

}  // namespace detail::formats

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
  detail::formats::Cursor c{file_->data(), file_->size(), 0, path};
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
    metadata_[key] = detail::formats::read_gguf_value(c, type, key);
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
    const auto [block, block_bytes] = detail::formats::ggml_block(e.type);
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
  const int64_t block = detail::formats::ggml_block(e.type).first;
  COMB_CHECK(block > 0, "'{}': tensor '{}' has type {}, which comb cannot read (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)",
             file_->path(), name, e.info.dtype);
  void* src = const_cast<uint8_t*>(file_->data() + e.offset);
  auto type = static_cast<GgmlType>(e.type);
  if (type == GgmlType::F32 || type == GgmlType::F16 || type == GgmlType::BF16) {
    auto stored = type == GgmlType::F32 ? at::kFloat : type == GgmlType::F16 ? at::kHalf : at::kBFloat16;
    at::Tensor out =
        detail::formats::tensor_from_bytes(static_cast<const uint8_t*>(src), e.n_bytes, e.info.shape, stored, dtype);
    file_->release(static_cast<const uint8_t*>(src), e.n_bytes);
    return out;
  }
  at::Tensor out = at::empty(e.info.shape, at::kFloat);
  detail::formats::dequantize(e.type, static_cast<const uint8_t*>(src), out.data_ptr<float>(), out.numel() / block);
  file_->release(static_cast<const uint8_t*>(src), e.n_bytes);
  return dtype == at::kFloat ? out : out.to(dtype);
}

COMB_INLINE std::optional<GroupedWeights> TensorSource::load_grouped(const std::string&) const { return std::nullopt; }

COMB_INLINE std::optional<GroupedWeights> GgufFile::load_grouped(const std::string& name) const {
  auto it = index_.find(name);
  COMB_CHECK(it != index_.end(), "'{}': no tensor named '{}'", file_->path(), name);
  const Entry& e = entries_[it->second];
  const auto type = static_cast<GgmlType>(e.type);
  if ((type != GgmlType::Q4_0 && type != GgmlType::Q4_1 && type != GgmlType::Q8_0) || e.info.shape.size() != 2)
    return std::nullopt;
  const int64_t rows = e.info.shape[0], cols = e.info.shape[1], groups = cols / 32;
  // A local the lambda below may capture (C++17).
  const int64_t block_bytes = detail::formats::ggml_block(e.type).second;
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
      scale[b] = detail::formats::half_to_float(in);
      if (type == GgmlType::Q8_0) {
        std::memcpy(out, in + 2, 32);
      } else {
        const uint8_t* nibbles = in + (type == GgmlType::Q4_1 ? 4 : 2);
        // Q4_0: w = d (q - 8) = d q - 8 d; Q4_1: w = d q + m.
        min[b] = type == GgmlType::Q4_1 ? detail::formats::half_to_float(in + 2) : -8 * scale[b];
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

// ================================================================================================
// safetensors
// ================================================================================================

namespace detail::formats {  // this file's own helpers

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

}  // namespace detail::formats

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
    e.type = detail::formats::safetensors_dtype(e.info.dtype, path, name);
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
      detail::formats::tensor_from_bytes(file_->data() + e.begin, e.end - e.begin, e.info.shape, e.type, dtype);
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
    header[name] = {{"dtype", detail::formats::safetensors_dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
    data.push_back(std::move(t));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t n = text.size();
  detail::formats::AtomicWriter writer(path);
  writer.write(&n, 8);
  writer.write(text.data(), text.size());
  for (const auto& t : data) writer.write(t.data_ptr(), t.numel() * t.element_size());
  writer.commit();
}

// ================================================================================================
// Opening a checkpoint by path
// ================================================================================================

COMB_INLINE std::unique_ptr<TensorSource> open_tensor_source(const std::string& path) {
  fs::path p(path);
  std::error_code ec;
  COMB_CHECK(fs::exists(p, ec), "model file '{}' does not exist", path);
  if (fs::is_directory(p)) {
    if (fs::exists(p / "model.safetensors.index.json"))
      return std::make_unique<ShardedSafetensors>((p / "model.safetensors.index.json").string());
    if (fs::exists(p / "model.safetensors")) return std::make_unique<SafetensorsFile>((p / "model.safetensors").string());
    COMB_FAIL("directory '{}' holds neither model.safetensors nor model.safetensors.index.json", path);
  }
  std::string name = p.filename().string();
  if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".gguf") == 0) return std::make_unique<GgufFile>(path);
  if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".json") == 0)
    return std::make_unique<ShardedSafetensors>(path);
  return std::make_unique<SafetensorsFile>(path);
}

}  // namespace comb
