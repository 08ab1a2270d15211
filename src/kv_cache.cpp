// The compiled form of include/comb/impl/kv_cache.ipp (comb::comb).
#include "comb/impl/kv_cache.ipp"
