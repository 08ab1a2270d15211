// Every schema of comb's Torch ops, in one table. Backends register in their own files.
#include <torch/library.h>

TORCH_LIBRARY(comb, m) {
  m.def("cross_attention(Tensor q, Tensor[] keys, Tensor[] values, int[] doc_counts, float scale, Tensor? sinks=None) -> Tensor");
  // The decoder's fused steps (CUDA, float16 or bfloat16; src/ops/decode_cuda.cpp).
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_append(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int position, "
        "int n_head) -> Tensor");
  m.def("place_keys(Tensor k, Tensor cos, Tensor sin, Tensor(a!) k_cache, int position) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gemv(Tensor w, Tensor x) -> Tensor");
  m.def("rows_attention(Tensor q, Tensor k_cache, Tensor v_cache, int start, Tensor? joined_keys=None, "
        "Tensor? joined_values=None, Tensor? joined_bias=None, int anchor=0) -> Tensor");
}
