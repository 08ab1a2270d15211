// Memory-mapped files, whole-file writes and TensorSource's defaults (see comb/tensor_source.hpp
// and comb/detail/mapped_file.hpp).
// Compiled into libcomb (src/tensor_source.cpp), or inline in every translation unit that
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

#include "comb/error.hpp"
#include "comb/log.hpp"
#include "comb/detail/mapped_file.hpp"
#include "comb/detail/files.hpp"
#include "comb/quantized.hpp"  // GroupedWeights
#include "comb/tensor_source.hpp"

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


COMB_INLINE void write_file_atomic(const std::string& path, const std::string& bytes, unsigned mode) {
  files::AtomicWriter writer(path, mode);
  writer.write(bytes.data(), bytes.size());
  writer.commit();
}

}  // namespace detail

COMB_INLINE std::optional<GroupedWeights> TensorSource::load_grouped(const std::string&) const { return std::nullopt; }

}  // namespace comb
