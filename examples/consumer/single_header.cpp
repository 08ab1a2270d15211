// comb through one header alone, header-only: with COMB_HEADER_ONLY (comb::header_only),
// <comb/gguf.hpp> brings its own definitions and those of what it needs, inline; nothing of
// libcomb is linked. Prints what a GGUF file declares.
#include <comb/gguf.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: comb_single_header MODEL.gguf\n");
    return 2;
  }
  try {
    comb::GgufFile file(argv[1]);
    const std::string arch = file.get_string("general.architecture");
    std::printf("GGUF v%u: %s, %zu tensors, %lld layers\n", file.version(), arch.c_str(), file.names().size(),
                static_cast<long long>(file.get_int(arch + ".block_count")));
  } catch (const comb::Error& e) {
    std::fprintf(stderr, "comb_single_header: %s\n", e.what());
    return 1;
  }
  return 0;
}
