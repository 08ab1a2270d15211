// comb::load_cuda_backend: dlopen of the comb_cuda module (beside libcomb), or of LibTorch's
// libtorch_cuda (beside libtorch_cpu) when comb was built without its CUDA ops.
#include "comb/cuda_backend.hpp"

#include "comb/detail/decode_step.hpp"

#include <ATen/Context.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace comb {

namespace {

// An object of libcomb's own: its address names libcomb to dladdr (a function's address may be a
// program's PLT entry instead).
const char kAnchor = 0;

// The folder of the shared object that holds `symbol` ("" when unknown).
std::string folder_of(const void* symbol) {
  Dl_info info{};
  if (dladdr(symbol, &info) == 0 || info.dli_fname == nullptr) return "";
  std::string path = info.dli_fname;
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

// dlopen with RTLD_GLOBAL (LibTorch's registrations and symbols must be seen by everything after);
// on failure, appends dlerror()'s reason to `why`.
bool open_global(const std::string& path, std::string& why) {
  if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) return true;
  const char* err = dlerror();
  why += (why.empty() ? "" : "; ") + std::string(err ? err : path + ": unknown dlopen error");
  return false;
}

CudaBackend load() {
  CudaBackend backend;
  std::string why;
#ifdef COMB_CUDA_MODULE
  const std::string module = folder_of(&kAnchor) + "/libcomb_cuda.so";
  if (open_global(module, why)) {
    backend.loaded = backend.comb_ops = true;
    backend.detail = "comb's CUDA ops and LibTorch's CUDA libraries (" + module + ")";
    return backend;
  }
#endif
  const std::string torch_cuda =
      folder_of(reinterpret_cast<const void*>(&at::globalContext)) + "/libtorch_cuda.so";
  if (open_global(torch_cuda, why)) {
    backend.loaded = true;
    backend.detail = "LibTorch's CUDA libraries (" + torch_cuda + "); comb was built without its CUDA ops";
  } else {
    backend.detail = "no CUDA backend: " + why;
  }
  return backend;
}

}  // namespace

const CudaBackend& load_cuda_backend() {
  static const CudaBackend backend = load();
  return backend;
}

bool cuda_available() { return load_cuda_backend().loaded && at::hasCUDA(); }

namespace detail {
namespace {
std::atomic<DecodeStepFactory> decode_step_factory_{nullptr};
std::atomic<const CudaLayerOps*> cuda_layer_ops_{nullptr};
}  // namespace
void set_cuda_layer_ops(const CudaLayerOps* ops) { cuda_layer_ops_.store(ops); }
const CudaLayerOps* cuda_layer_ops() {
  static const bool off = [] {
    const char* v = std::getenv("COMB_CUDA_KERNELS");
    return v != nullptr && std::strcmp(v, "0") == 0;
  }();
  return off ? nullptr : cuda_layer_ops_.load();
}
void set_decode_step_factory(DecodeStepFactory factory) { decode_step_factory_.store(factory); }
DecodeStepFactory decode_step_factory() { return decode_step_factory_.load(); }
}  // namespace detail

}  // namespace comb
