#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <ftw.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <vector>
#include <unistd.h>

#include "helpers.hpp"

namespace comb::test {

void remove_dir(const std::string& dir);

namespace {
// The directories temp_dir made, removed when the test process exits (kept when
// COMB_KEEP_TEST_DIRS is set, to look into after a failure).
struct TempDirs {
  std::mutex mutex;
  std::vector<std::string> dirs;
  const pid_t owner = ::getpid();  // a forked child that exits leaves them to its parent
  ~TempDirs() {
    if (std::getenv("COMB_KEEP_TEST_DIRS") || ::getpid() != owner) return;
    for (const auto& d : dirs) remove_dir(d);
  }
};
TempDirs& temp_dirs() {
  static TempDirs dirs;
  return dirs;
}
}  // namespace

std::string temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("comb-test-" + name + "-" + std::to_string(::getpid()) + "-" + std::to_string(std::random_device{}()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  TempDirs& all = temp_dirs();
  std::lock_guard<std::mutex> lock(all.mutex);
  all.dirs.push_back(dir.string());
  return dir.string();
}

// With nftw: LibTorch's library exports its own std::filesystem::remove_all, which the dynamic
// linker binds first and which crashes on a directory with files in it.
void remove_dir(const std::string& dir) {
  ::nftw(dir.c_str(), [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 16,
         FTW_DEPTH | FTW_PHYS);
}

std::string GgufWriter::bytes(uint32_t version) const {
  std::string out = "GGUF";
  auto put = [&](auto v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put(version);
  put(uint64_t(tensors_.size()));
  put(n_kv_);
  out += kv_;
  uint64_t offset = 0;
  std::vector<uint64_t> offsets;
  for (const auto& t : tensors_) {
    put(uint64_t(t.name.size()));
    out += t.name;
    put(uint32_t(t.dims.size()));
    for (auto d : t.dims) put(d);
    put(t.type);
    put(offset);
    offsets.push_back(offset);
    offset += (t.data.size() + 31) / 32 * 32;
  }
  out.append((32 - out.size() % 32) % 32, '\0');
  for (const auto& t : tensors_) {
    out += t.data;
    out.append((32 - t.data.size() % 32) % 32, '\0');
  }
  return out;
}

}  // namespace comb::test
