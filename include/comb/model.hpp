#pragma once
// comb::Model: a loaded decoder with its tokenizer and chat template, and generation.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comb/chat_template.hpp"
#include "comb/config.hpp"
#include "comb/decoder.hpp"
#include "comb/plugin.hpp"
#include "comb/sampler.hpp"
#include "comb/tokenizer.hpp"

namespace comb {

struct Options {
  std::string device = "cpu";     // "cpu", "cuda", "cuda:1", ...
  std::string dtype = "float32";  // "float32", "bfloat16", "float16" (fp16 on CUDA only)
  int threads = 0;                // CPU threads; 0 leaves LibTorch's default
  bool cpu_kernels = true;        // fused fp32 CPU kernels (off: generic ATen ops only)
  std::string plugin;             // a plug-in-only file to apply on top of the base ("" : none)
  // "none": every weight is expanded to `dtype` on load; "gguf": a GGUF file's Q4_0/Q4_1/Q8_0
  // matrices stay quantized (int4 and int8 groups of 32) and are multiplied as they are (CPU,
  // float32 activations around them; docs/formats.md); "auto": gguf for a GGUF file on the CPU
  // with float32 activations, else none (the command line's default for running a model);
  // "int8", "int4": float weights quantized on load.
  std::string quantize = "none";
};

struct GenerateOptions {
  int64_t max_tokens = 128;
  SamplingOptions sampling;
  std::vector<int32_t> stop_tokens;  // added to the model's end-of-turn and EOS tokens
  // Called with each new token and the text it completes; return false to stop.
  std::function<bool(int32_t token, const std::string& text)> on_token;
};

struct GenerationResult {
  std::vector<int32_t> tokens;  // generated ids (the stop token, if one ended it, excluded)
  std::vector<float> logprobs;  // log-probability of each generated token under the model
  std::string text;
  std::string stop_reason;      // "stop_token", "max_tokens", "context_full" or "callback"
  int64_t n_prompt = 0;
  double ttft_ms = 0;           // prompt in -> first token out
  double prefill_ms = 0;
  double decode_ms = 0;         // after the first token
  double prefill_tokens_per_s() const { return prefill_ms > 0 ? n_prompt * 1e3 / prefill_ms : 0; }
  double decode_tokens_per_s() const {
    return decode_ms > 0 && tokens.size() > 1 ? (tokens.size() - 1) * 1e3 / decode_ms : 0;
  }
};

class Model {
 public:
  // Loads a .gguf file, or a Hugging Face directory (config.json, tokenizer.json, and
  // model.safetensors or a sharded model.safetensors.index.json); a directory whose config says
  // `model_type: combllama` brings its plug-in along.
  static Model load(const std::string& path, const Options& options = {});

  const ModelConfig& config() const { return decoder_->config(); }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  // The model's chat template; an error for a model that ships none.
  const ChatTemplate& chat_template() const;
  const Decoder& decoder() const { return *decoder_; }

  // Token ids of one user message through the chat template, ready for generation.
  std::vector<int32_t> chat_prompt(const std::string& user_message) const;
  // A conversation through the chat template, every message's content read as data (control
  // tokens written in it stay text, as in a server's requests); the assistant's turn opened at the
  // end when `add_generation_prompt`.
  std::vector<int32_t> chat_prompt(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true) const;

  // The plug-in, or nullptr. A plug-in must have been built for this base decoder.
  const Plugin* plugin() const { return plugin_.get(); }
  void set_plugin(std::shared_ptr<const Plugin> plugin);
  // The plug-in's encoder prefix states, computed once through all of the decoder's layers (the
  // encoder reads its own first layers; a prompt that starts with the same tokens, as the QA
  // instruction does, takes the rest instead of computing them). nullptr unless
  // Plugin::encoder_is_base().
  const KVCache* encoder_prefix_states() const;
  // The decoder's forward with linked documents read by the cross blocks; without documents (or
  // without a plug-in) exactly Decoder::forward.
  // What the decoder's layers read of linked `documents` (checked against the plug-in), as
  // forward() reads them: joined blocks (Plugin::joint_kv, kept in documents->joined) or residual
  // blocks over the documents in place (they must outlive the reads). A paged step off the fused
  // CPU path reads these (Decoder::step_paged).
  std::unique_ptr<DocumentReads> document_reads(const LinkedDocuments& documents, int64_t batch = 1) const;
  at::Tensor forward(const at::Tensor& tokens, KVCache& cache, const LinkedDocuments* documents = nullptr,
                     LogitsMode mode = LogitsMode::last) const;
  // Generates after `prompt`, reading `documents` when given; throws comb::Error when the prompt
  // does not fit the context.
  GenerationResult generate(const std::vector<int32_t>& prompt, const GenerateOptions& options,
                            const LinkedDocuments* documents = nullptr) const;
  // Decoding after a prompt already in `cache`: `logits` [n_vocab] (float) are those of the last
  // prompt token, `started` is when the request began (time to first token counts from it).
  GenerationResult decode(KVCache& cache, at::Tensor logits, const GenerateOptions& options,
                          const LinkedDocuments* documents, std::chrono::steady_clock::time_point started,
                          int64_t n_prompt) const;
  // Writes a merged checkpoint (reference COMB layout when a plug-in is set, else Llama) into `dir`.
  void save(const std::string& dir) const;

 private:
  std::shared_ptr<Decoder> decoder_;
  std::shared_ptr<const Plugin> plugin_;
  // The plug-in's encoder prefix through the decoder's layers (Plugin::encoder_prefix_states):
  // computed for the first document or prompt that needs it and read by every later one; renewed
  // with the plug-in.
  struct EncoderPrefix {
    std::once_flag once;
    std::optional<KVCache> states;
  };
  std::shared_ptr<EncoderPrefix> encoder_prefix_ = std::make_shared<EncoderPrefix>();
  std::shared_ptr<Tokenizer> tokenizer_;
  std::shared_ptr<ChatTemplate> chat_template_;
};


}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/model.ipp"
#endif
