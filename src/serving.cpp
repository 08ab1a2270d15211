// The compiled form of include/comb/impl/serving.ipp (comb::comb).
#include "comb/impl/serving.ipp"
