// The compiled form of include/comb/impl/weights.ipp (comb::comb).
#include "comb/impl/weights.ipp"
