// The compiled form of include/comb/impl/tensor_source.ipp (comb::comb).
#include "comb/impl/tensor_source.ipp"
