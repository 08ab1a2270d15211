// The compiled form of include/comb/impl/store.ipp (comb::comb).
#include "comb/impl/store.ipp"
