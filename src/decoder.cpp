// The compiled form of include/comb/impl/decoder.ipp (comb::comb).
#include "comb/impl/decoder.ipp"
