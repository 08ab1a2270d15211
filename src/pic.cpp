// The compiled form of include/comb/impl/pic.ipp (comb::comb).
#include "comb/impl/pic.ipp"
