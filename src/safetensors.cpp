// The compiled form of include/comb/impl/safetensors.ipp (comb::comb).
#include "comb/impl/safetensors.ipp"
