// The compiled form of include/comb/impl/chat_template.ipp (comb::comb).
#include "comb/impl/chat_template.ipp"
