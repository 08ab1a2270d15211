// The compiled form of include/comb/impl/sampler.ipp (comb::comb).
#include "comb/impl/sampler.ipp"
