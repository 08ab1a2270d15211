#pragma once
// Helpers of the file readers and writers (tensor_source.ipp, gguf.ipp, safetensors.ipp):
// writing a file whole or not at all, and a tensor copied out of mapped bytes.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "comb/error.hpp"

namespace comb::detail::files {

// Writes a file under a temporary name in the same directory; commit() makes it appear whole.
class AtomicWriter {
 public:
  explicit AtomicWriter(const std::string& path, unsigned mode = 0666) : path_(path) {
    std::filesystem::path p(path);
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

// A tensor of `stored` elements read from mapped bytes and converted to `dtype`, always a copy.
// Bytes not aligned to their element (GGUF general.alignment 1 or 2, a safetensors offset) are
// copied as bytes first: the element type may not be read from them in place.
inline at::Tensor tensor_from_bytes(const uint8_t* src, uint64_t n_bytes, const std::vector<int64_t>& shape,
                             c10::ScalarType stored, c10::ScalarType dtype) {
  if (reinterpret_cast<uintptr_t>(src) % c10::elementSize(stored) != 0) {
    at::Tensor out = at::empty(shape, stored);
    if (n_bytes > 0) std::memcpy(out.data_ptr(), src, n_bytes);  // an empty tensor has no data pointer
    return out.to(dtype);
  }
  return at::from_blob(const_cast<uint8_t*>(src), shape, at::TensorOptions().dtype(stored))
      .to(dtype, false, /*copy=*/true);
}

}  // namespace comb::detail::files
