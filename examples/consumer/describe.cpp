// A second translation unit that includes comb: header-only use must link two of them.
#include <comb/comb.hpp>

#include <string>

std::string describe(const comb::Model& model) {
  return std::to_string(model.config().n_layer) + " layers, vocabulary of " + std::to_string(model.tokenizer().n_vocab());
}
