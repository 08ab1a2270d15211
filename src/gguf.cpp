// The compiled form of include/comb/impl/gguf.ipp (comb::comb).
#include "comb/impl/gguf.ipp"
