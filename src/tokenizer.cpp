// The compiled form of include/comb/impl/tokenizer.ipp (comb::comb).
#include "comb/impl/tokenizer.ipp"
