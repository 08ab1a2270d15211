// Runs fuzz inputs through their harness outside libFuzzer: the suite replays every input a fuzzer
// found a problem with (tests/fuzz/regressions/TARGET/) and the seeds, so a fixed reader stays fixed.
//   comb_fuzz_replay TARGET FILE_OR_FOLDER...
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <iterator>

#include "harness.hpp"

namespace {
std::vector<std::string> files_in(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  if (!S_ISDIR(st.st_mode)) return {path};
  std::vector<std::string> out;
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') out.push_back(path + "/" + e->d_name);
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || !comb::fuzz::harnesses().count(argv[1])) {
    std::fprintf(stderr, "usage: comb_fuzz_replay TARGET FILE_OR_FOLDER...\ntargets:");
    for (const auto& [name, h] : comb::fuzz::harnesses()) std::fprintf(stderr, " %s", name.c_str());
    std::fprintf(stderr, "\n");
    return 2;
  }
  at::set_num_threads(1);
  c10::InferenceMode guard;
  const auto harness = comb::fuzz::harnesses().at(argv[1]);
  int n = 0;
  for (int i = 2; i < argc; ++i) {
    for (const std::string& file : files_in(argv[i])) {
      std::ifstream in(file, std::ios::binary);
      std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::printf("%s (%zu bytes)\n", file.c_str(), bytes.size());
      std::fflush(stdout);
      harness(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++n;
    }
  }
  if (n == 0) {
    std::fprintf(stderr, "comb_fuzz_replay: no input files under the paths given\n");
    return 1;
  }
  std::printf("%d input(s) replayed through '%s', none crashed\n", n, argv[1]);
  return 0;
}
