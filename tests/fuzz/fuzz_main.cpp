// One libFuzzer target: COMB_FUZZ_HARNESS names the harness (tests/fuzz/harness.hpp).
#include "harness.hpp"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  c10::InferenceMode guard;
  return comb::fuzz::COMB_FUZZ_HARNESS(data, size);
}
