#pragma once
// COMB_INLINE marks every definition in include/comb/impl/: empty when libcomb compiles them once
// (the default, comb::comb), `inline` when an application defines COMB_HEADER_ONLY and compiles
// them in its own translation units (comb::header_only: only the op registration, the fused CPU
// kernels, the Redis tier, the CUDA loader and the log callback stay compiled, in comb_core).
#ifdef COMB_HEADER_ONLY
#define COMB_INLINE inline
#else
#define COMB_INLINE
#endif
