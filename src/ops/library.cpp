// Every schema of comb's Torch ops, in one table. Backends register in their own files.
#include <torch/library.h>

TORCH_LIBRARY(comb, m) {
  m.def("cross_attention(Tensor q, Tensor[] keys, Tensor[] values, int[] doc_counts, float scale, Tensor? sinks=None) -> Tensor");
}
