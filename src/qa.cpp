// The compiled form of include/comb/impl/qa.ipp (comb::comb).
#include "comb/impl/qa.ipp"
