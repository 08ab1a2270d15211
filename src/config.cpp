// The compiled form of include/comb/impl/config.ipp (comb::comb).
#include "comb/impl/config.ipp"
