// The compiled form of include/comb/impl/inspect.ipp (comb::comb).
#include "comb/impl/inspect.ipp"
