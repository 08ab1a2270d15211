// The compiled form of include/comb/impl/document_kv.ipp (comb::comb).
#include "comb/impl/document_kv.ipp"
