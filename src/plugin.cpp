// The compiled form of include/comb/impl/plugin.ipp (comb::comb).
#include "comb/impl/plugin.ipp"
