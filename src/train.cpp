// The compiled form of include/comb/impl/train.ipp (comb::comb).
#include "comb/impl/train.ipp"
