// The compiled form of include/comb/impl/documents.ipp (comb::comb).
#include "comb/impl/documents.ipp"
