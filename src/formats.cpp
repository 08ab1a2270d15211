// The compiled form of include/comb/impl/formats.ipp (comb::comb).
#include "comb/impl/formats.ipp"
