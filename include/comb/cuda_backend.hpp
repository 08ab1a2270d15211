#pragma once
// comb's CUDA backend, loaded on demand. libcomb links LibTorch's CPU libraries only; LibTorch's CUDA
// libraries (about 320 MiB resident once loaded) and comb's CUDA ops (the comb_cuda module) are
// loaded into the process the first time a CUDA device is asked for. Model::load and PICacheStore
// do that themselves; a program that touches CUDA tensors before either calls load_cuda_backend()
// first. LibTorch decides once per process whether CUDA exists: anything that asks it (at::hasCUDA(),
// torch::cuda::is_available()) before the backend is loaded makes CUDA unavailable for good.
#include <string>

namespace comb {

struct CudaBackend {
  bool loaded = false;     // LibTorch's CUDA libraries are in the process
  bool comb_ops = false;   // and comb's CUDA ops (the comb_cuda module) with them
  std::string detail;      // what was loaded from where, or why nothing could be
};

// Loads the backend once (later calls return the first call's result); never throws.
const CudaBackend& load_cuda_backend();

// True when a CUDA device can be used: loads the backend, then asks LibTorch.
bool cuda_available();

}  // namespace comb
