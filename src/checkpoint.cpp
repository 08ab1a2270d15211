// The compiled form of include/comb/impl/checkpoint.ipp (comb::comb).
#include "comb/impl/checkpoint.ipp"
