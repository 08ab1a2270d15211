// The compiled form of include/comb/impl/quantized.ipp (comb::comb).
#include "comb/impl/quantized.ipp"
