#pragma once
// A read-only memory-mapped file (RAII). Errors name the path and the system's reason.
#include <cstddef>
#include <cstdint>
#include <string>

namespace comb::detail {

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Drops the whole pages of [begin, begin + n) from the process's resident memory once they have
  // been copied out (the file stays in the page cache; a later read maps them again). A loader
  // calls it after each tensor, so a model file is never resident whole beside its copy.
  void release(const uint8_t* begin, size_t n) const;

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Reads a whole file into a string; throws comb::Error naming the path when it cannot, or when
// the file holds more than `max_bytes` (checked before reading).
std::string read_text_file(const std::string& path, int64_t max_bytes = int64_t(1) << 30);

// Writes `bytes` to `path` atomically: a temporary file in the same directory, fsync, rename.
// The file is created with `mode` less the umask.
void write_file_atomic(const std::string& path, const std::string& bytes, unsigned mode = 0666);

}  // namespace comb::detail
