#pragma once
// A process-wide allocator setting for the application to apply at start-up: the library never
// changes its host's allocator on its own.
//
// A prefill's activations are large (for 1,300 tokens of the default model, a layer's gate/up
// product alone is 16 MB). With glibc's defaults, most such blocks are served by mmap and handed
// back to the system when freed, so the next prefill faults every page in again; and freed memory
// at the top of the heap is trimmed away. keep_freed_memory() serves blocks up to 32 MiB from the
// heap and keeps freed heap memory for reuse: on the CPU, `comb eval --method full --priming
// always` over 6 items of nq-multidoc-10 took 2.7 million minor page faults before and 0.29
// million after, and its median time to first token fell from 5.1 s to 4.4 s
// (docs/benchmarks.md). The cost: the process
// keeps its peak heap size instead of returning memory between requests.
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace comb {

// Returns false where it does nothing (an allocator other than glibc's).
inline bool keep_freed_memory() {
#if defined(__GLIBC__)
  constexpr int kMmapThreshold = 32 << 20;  // glibc's largest allowed value on 64-bit systems
  constexpr int kTrimThreshold = 1 << 30;
  return mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 && mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1;
#else
  return false;
#endif
}

}  // namespace comb
