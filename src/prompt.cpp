// The compiled form of include/comb/impl/prompt.ipp (comb::comb).
#include "comb/impl/prompt.ipp"
