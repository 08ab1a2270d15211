// Loads a model through the installed comb package and answers one prompt.
//   comb_consumer MODEL.gguf "Your question"
#include <comb/comb.hpp>

#include <iostream>
#include <string>

std::string describe(const comb::Model& model);  // describe.cpp

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: comb_consumer MODEL PROMPT\n";
    return 2;
  }
  try {
    comb::Model model = comb::Model::load(argv[1]);
    comb::GenerateOptions options;
    options.max_tokens = 16;
    comb::GenerationResult r = model.generate(model.chat_prompt(argv[2]), options);
    std::cout << "comb " << COMB_VERSION_STRING << ": " << describe(model) << ", generated " << r.tokens.size()
              << " tokens: " << r.text << std::endl;
  } catch (const comb::Error& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
