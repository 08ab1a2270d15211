// The compiled form of include/comb/impl/model.ipp (comb::comb).
#include "comb/impl/model.ipp"
