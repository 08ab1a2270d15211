// comb::Model: loading a checkpoint (decoder, tokenizer, chat template, plug-in), generation, saving.
// Compiled into libcomb (src/model.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/record_function.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <filesystem>

#include "comb/checkpoint.hpp"
#include "comb/cuda_backend.hpp"
#include "comb/detail/mapped_file.hpp"
#include "comb/detail/json.hpp"
#include "comb/error.hpp"
#include "comb/gguf.hpp"
#include "comb/model.hpp"
#include "comb/plugin.hpp"
#include "comb/safetensors.hpp"
#include "comb/weights.hpp"

namespace fs = std::filesystem;

namespace comb {


namespace detail::model {  // this file's own helpers
COMB_INLINE c10::Device parse_device(const std::string& name) {
  try {
    return c10::Device(name);
  } catch (const c10::Error&) {
    COMB_FAIL("unknown device '{}' (expected cpu, cuda or cuda:N)", name);
  }
}
// BOS first when the tokenizer adds one and the rendered template does not begin with it.
COMB_INLINE std::vector<int32_t> bos_before(const Tokenizer& tok, const std::string& text) {
  auto bos = tok.bos_id();
  if (tok.add_bos() && bos && text.rfind(tok.token_bytes(*bos), 0) != 0) return {*bos};
  return {};
}

// NOTE: LibTorch's SDPA prefers cuDNN's attention for half types on recent GPUs, and cuDNN builds a
// plan for each new shape: the first prompt of every new length paid tens of milliseconds that later
// ones did not. Loading a CUDA model turns cuDNN's attention off for the process, so that SDPA takes
// FlashAttention or the memory-efficient kernel, which need no plan. COMB_CUDNN_ATTENTION=1 keeps it.
COMB_INLINE void attention_without_shape_plans() {
  const char* keep = std::getenv("COMB_CUDNN_ATTENTION");
  if (keep != nullptr && std::string(keep) == "1") return;
  at::globalContext().setSDPUseCuDNN(false);
}
}  // namespace detail::model

COMB_INLINE Model Model::load(const std::string& path, const Options& options) {
  c10::Device device = detail::model::parse_device(options.device);
  c10::ScalarType dtype = parse_dtype(options.dtype);
  COMB_CHECK(!(device.is_cpu() && dtype == at::kHalf), "float16 is supported on CUDA only; use float32 or bfloat16 on CPU");
  if (device.is_cuda()) {
    COMB_CHECK(cuda_available(), "device '{}' asked for, but this machine (or this LibTorch) has no CUDA device ({})",
               options.device, load_cuda_backend().detail);
    detail::model::attention_without_shape_plans();
    // "cuda" names the current device: its index made explicit, so that the decoder's device
    // compares equal to its tensors' (cuda:N) wherever one is checked against the other.
    if (!device.has_index())
      device = c10::Device(c10::kCUDA, c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index());
  }
  if (options.threads > 0) at::set_num_threads(options.threads);
  // No autograd while loading, but ordinary tensors (not inference tensors), so that training can
  // run the frozen decoder under autograd.
  c10::AutoGradMode no_grad(false);
  Model m;
  std::unique_ptr<TensorSource> source = open_tensor_source(path);
  ModelConfig config;
  std::string hf_prefix;
  std::optional<PluginConfig> combined;  // a COMB checkpoint's plug-in
  if (auto* gguf = dynamic_cast<GgufFile*>(source.get())) {
    config = ModelConfig::from_gguf(*gguf);
    m.tokenizer_ = std::make_shared<Tokenizer>(Tokenizer::from_gguf(*gguf));
  } else {
    fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
    std::string config_path = (dir / "config.json").string();
    nlohmann::json j = detail::parse_json(detail::read_text_file(config_path, detail::kMaxJsonFileBytes),
                                          fmt::format("'{}'", config_path));
    COMB_CHECK(j.is_object(), "'{}': expected a JSON object, found {}", config_path, j.type_name());
    if (j.value("model_type", "") == "combllama") {
      // The reference layout: the decoder under language_model.*, text_config its config, and
      // num_hidden_layers counting decoder layers plus cross blocks.
      COMB_CHECK(j.contains("text_config") && j.contains("cross_attention_layers"),
                 "'{}': a combllama config needs text_config and cross_attention_layers", config_path);
      nlohmann::json text = j["text_config"];
      combined = PluginConfig::from_json(j, config_path);
      if (j.contains("comb")) combined->max_document_tokens = j["comb"].value("max_document_tokens", int64_t(0));
      int64_t total = j.value("num_hidden_layers", text.value("num_hidden_layers", int64_t(0)));
      text["num_hidden_layers"] = total - combined->n_blocks();
      text["model_type"] = "llama";
      config = ModelConfig::from_hf_json(text, config_path + " (text_config)");
      hf_prefix = "language_model.";
    } else {
      config = ModelConfig::from_hf_json(j, config_path);
    }
    m.tokenizer_ = std::make_shared<Tokenizer>(Tokenizer::from_hf_file((dir / "tokenizer.json").string()));
  }
  COMB_CHECK(m.tokenizer_->n_vocab() <= config.n_vocab, "'{}': the tokenizer has {} tokens but the model only {}", path,
             m.tokenizer_->n_vocab(), config.n_vocab);
  COMB_CHECK(options.quantize == "none" || options.quantize == "auto" || options.quantize == "gguf" ||
                 options.quantize == "int8" || options.quantize == "int4",
             "--quantize: expected auto (gguf for a GGUF file on the CPU in float32, else none), none, gguf (GGUF "
             "Q4_0/Q4_1/Q8_0 kept as stored), int8 or int4 (quantized on load), found '{}'", options.quantize);
  std::string quantize = options.quantize;
  if (quantize == "auto")
    quantize = dynamic_cast<GgufFile*>(source.get()) && device.is_cpu() && dtype == at::kFloat ? "gguf" : "none";
  const bool keep_quantized = quantize != "none";
  if (keep_quantized) {
    COMB_CHECK(quantize != "gguf" || dynamic_cast<GgufFile*>(source.get()),
               "--quantize gguf keeps a GGUF file's quantized tensors; '{}' is not a GGUF file (--quantize int8 or int4 "
               "quantizes float weights on load)", path);
    COMB_CHECK(device.is_cpu() && dtype == at::kFloat, "--quantize {} runs on the CPU with --dtype float32 (asked: "
               "{} {})", quantize, options.device, options.dtype);
    if (quantize != "gguf")  // every matrix, in groups of 32: int8 (embedding and head too) or int4 layers
      source = quantizing_source(std::move(source), quantize == "int8" ? GroupedWeights::Kind::q8
                                                                        : GroupedWeights::Kind::q4);
  }
  LlamaWeights weights = load_llama_weights(*source, config, dtype, device, hf_prefix, keep_quantized);
  if (weights.quantized()) weights.quantization = quantize;
  m.decoder_ = std::make_shared<Decoder>(std::move(config), std::move(weights), dtype, device);
  m.decoder_->set_cpu_kernels(options.cpu_kernels);
  if (combined) m.plugin_ = std::make_shared<Plugin>(Plugin::from_checkpoint(*source, *combined, *m.decoder_));
  if (!options.plugin.empty()) {
    COMB_CHECK(!combined, "'{}' already carries a plug-in; --plugin cannot add another", path);
    m.plugin_ = std::make_shared<Plugin>(Plugin::load(options.plugin, *m.decoder_));
  }
  if (!m.tokenizer_->chat_template().empty()) {
    m.chat_template_ = std::make_shared<ChatTemplate>(ChatTemplate::from_source(m.tokenizer_->chat_template()));
  }
  return m;
}

COMB_INLINE void Model::set_plugin(std::shared_ptr<const Plugin> plugin) {
  if (plugin) {
    std::string fp = base_fingerprint(*decoder_);
    COMB_CHECK(plugin->config().base_fingerprint.empty() || plugin->config().base_fingerprint == fp,
               "the plug-in was built for another base decoder (fingerprint {}); this model's is {}",
               plugin->config().base_fingerprint, fp);
  }
  plugin_ = std::move(plugin);
  encoder_prefix_ = std::make_shared<EncoderPrefix>();
}

COMB_INLINE const KVCache* Model::encoder_prefix_states() const {
  if (!plugin_ || !plugin_->encoder_is_base()) return nullptr;
  EncoderPrefix& e = *encoder_prefix_;
  std::call_once(e.once, [&] { e.states.emplace(plugin_->encoder_prefix_states(*decoder_, config().n_layer)); });
  return &*e.states;
}

COMB_INLINE std::unique_ptr<DocumentReads> Model::document_reads(const LinkedDocuments& documents, int64_t batch) const {
  COMB_CHECK(plugin_, "documents need a plug-in: load one with Options::plugin (--plugin FILE)");
  COMB_CHECK(static_cast<int64_t>(documents.doc_counts.size()) == batch,
             "linked documents are for a batch of {}, the tokens a batch of {}", documents.doc_counts.size(), batch);
  COMB_CHECK(static_cast<int64_t>(documents.keys.size()) == plugin_->config().n_blocks(),
             "linked documents have {} blocks, the plug-in {}", documents.keys.size(), plugin_->config().n_blocks());
  COMB_CHECK(!plugin_->config().documents_after_prefix || documents.anchor > 0,
             "this plug-in reads its documents after the instruction prefix: set LinkedDocuments::anchor to the "
             "prefix's length (qa_prefix(model).size(), as PicEngine and comb generate do); with anchor 0 every "
             "prompt token would read them, which it was not trained for");
  if (plugin_->config().joint_attention) {  // the blocks join their layers' attention
    auto& joined = *documents.joined;
    std::vector<JointKV> joint;
    {
      std::lock_guard<std::mutex> lock(joined.mutex);
      if (joined.plugin != plugin_->fingerprint() || joined.anchor != documents.anchor) {
        joined.blocks = plugin_->joint_kv(plugin_->weights(), documents.keys, documents.values, documents.doc_counts,
                                          documents.anchor, documents.key_scales, documents.value_scales);
        joined.plugin = plugin_->fingerprint();
        joined.anchor = documents.anchor;
      }
      joint = joined.blocks;  // tensors are shared, not copied
    }
    return std::make_unique<DocumentReads>(DocumentReads::joined(*plugin_, std::move(joint)));
  }
  COMB_CHECK(documents.anchor == 0, "documents anchored after a prefix need a plug-in with documents_after_prefix");
  COMB_CHECK(documents.key_scales.empty(),
             "documents linked int8 (Linker with keep_int8) are read by joint-attention plug-ins only; link them "
             "with Linker(device) for this plug-in");
  return std::make_unique<DocumentReads>(DocumentReads::residual(*plugin_, documents));  // reads them in place
}

COMB_INLINE at::Tensor Model::forward(const at::Tensor& tokens, KVCache& cache, const LinkedDocuments* documents,
                          LogitsMode mode) const {
  if (!documents || documents->empty()) return decoder_->forward(tokens, cache, mode);
  const std::unique_ptr<DocumentReads> reads = document_reads(*documents, tokens.size(0));
  return decoder_->forward(tokens, cache, mode, reads.get());
}

COMB_INLINE void Model::save(const std::string& dir) const {
  std::error_code ec;
  fs::create_directories(dir, ec);
  COMB_CHECK(fs::is_directory(dir), "cannot create directory '{}': {}", dir, ec.message());
  const auto& c = config();
  nlohmann::json text = c.to_hf_json();
  auto tensors = llama_weights_hf_named(decoder_->weights(), c);
  nlohmann::json j = text;
  if (plugin_) {
    for (auto& [name, t] : tensors) name = "language_model." + name;
    auto extra = plugin_->named_tensors();
    tensors.insert(tensors.end(), extra.begin(), extra.end());
    int64_t n_blocks = plugin_->config().n_blocks();
    text["num_hidden_layers"] = c.n_layer + n_blocks;
    j = {{"model_type", "combllama"},
         {"architectures", {"CombLlamaForConditionalGeneration"}},
         {"text_config", text},
         {"cross_attention_layers", plugin_->config().cross_layers},
         {"num_hidden_layers", c.n_layer + n_blocks},
         {"tie_word_embeddings", c.tie_embeddings},
         {"comb", {{"max_document_tokens", plugin_->config().max_document_tokens}}}};
    // A layout other than the reference's names its keys beside cross_attention_layers.
    const nlohmann::json layout = plugin_->config().to_json();
    for (const auto& [key, value] : layout.items())
      if (key != "cross_attention_layers" && key != "max_document_tokens" && key != "base_fingerprint") j[key] = value;
  }
  save_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  detail::write_file_atomic(dir + "/config.json", j.dump(2));
  tokenizer_->save_hf(dir);
}

COMB_INLINE const ChatTemplate& Model::chat_template() const {
  COMB_CHECK(chat_template_, "this model ships no chat template (none in its GGUF metadata, tokenizer_config.json "
             "or chat_template.jinja); send the prompt raw instead (comb generate --raw)");
  return *chat_template_;
}

COMB_INLINE std::vector<int32_t> Model::chat_prompt(const std::string& user_message) const {
  std::string text = chat_template().apply({{"user", user_message}}, true);
  std::vector<int32_t> ids = detail::model::bos_before(*tokenizer_, text);
  auto body = tokenizer_->encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

COMB_INLINE std::vector<int32_t> Model::chat_prompt(const std::vector<ChatMessage>& messages,
                                                   bool add_generation_prompt) const {
  // The template rendered with a marker per content; its own parts encoded with control tokens,
  // the contents without.
  const Tokenizer& tok = *tokenizer_;
  std::vector<ChatMessage> marked;
  for (size_t i = 0; i < messages.size(); ++i) marked.push_back({messages[i].role, fmt::format("\x1f{}\x1f", i)});
  const std::string text = chat_template().apply(marked, add_generation_prompt);
  std::vector<int32_t> ids = detail::model::bos_before(tok, text);
  size_t at = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string marker = fmt::format("\x1f{}\x1f", i);
    const size_t found = text.find(marker, at);
    COMB_CHECK(found != std::string::npos, "the chat template dropped message {}", i);
    auto part = tok.encode(text.substr(at, found - at));
    ids.insert(ids.end(), part.begin(), part.end());
    auto content = tok.encode(messages[i].content, false);
    ids.insert(ids.end(), content.begin(), content.end());
    at = found + marker.size();
  }
  auto tail = tok.encode(text.substr(at));
  ids.insert(ids.end(), tail.begin(), tail.end());
  return ids;
}

COMB_INLINE GenerationResult Model::generate(const std::vector<int32_t>& prompt, const GenerateOptions& options,
                                 const LinkedDocuments* documents) const {
  const auto& c = config();
  COMB_CHECK(!prompt.empty(), "the prompt is empty");
  COMB_CHECK(static_cast<int64_t>(prompt.size()) < c.n_ctx,
             "the prompt has {} tokens but the model's context holds {} (one more is needed to answer)", prompt.size(),
             c.n_ctx);
  COMB_CHECK(options.max_tokens >= 0, "max tokens must be >= 0, found {}", options.max_tokens);
  for (int32_t id : prompt)
    COMB_CHECK(id >= 0 && id < c.n_vocab, "prompt token {} is outside the vocabulary [0, {})", id, c.n_vocab);
  c10::InferenceMode guard;
  auto started = std::chrono::steady_clock::now();
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  KVCache cache = decoder_->make_cache(1, std::min<int64_t>(c.n_ctx, n_prompt + options.max_tokens));
  at::Tensor logits = forward(token_ids(prompt, 0, n_prompt), cache, documents)[0][-1];
  return decode(cache, logits, options, documents, started, n_prompt);
}

COMB_INLINE GenerationResult Model::decode(KVCache& cache, at::Tensor logits, const GenerateOptions& options,
                               const LinkedDocuments* documents, std::chrono::steady_clock::time_point started,
                               int64_t n_prompt) const {
  using clock = std::chrono::steady_clock;
  const auto& c = config();
  c10::InferenceMode guard;
  std::vector<int32_t> stops = options.stop_tokens;
  if (auto eos = tokenizer_->eos_id()) stops.push_back(*eos);
  if (chat_template_)
    if (auto eot = tokenizer_->find_token(chat_template_->end_of_turn())) stops.push_back(*eot);
  GenerationResult r;
  r.n_prompt = n_prompt;
  Sampler sampler(options.sampling);
  StreamDecoder stream(*tokenizer_);
  auto t0 = clock::now();
  r.stop_reason = "max_tokens";
  const int64_t limit = std::min(c.n_ctx, cache.capacity());
  for (int64_t step = 0; step < options.max_tokens; ++step) {
    int32_t token = 0;
    float logprob = 0;  // read here on a GPU's greedy path; else from `host` once the token is kept
    at::Tensor host;
    if (logits.is_cuda() && sampler.greedy()) {
      // A greedy token on a GPU: its id, its logit and the row's log-sum-exp read back in one copy
      // of three numbers, where the whole row and a log-softmax on the host took a copy of the
      // vocabulary and a pass over it.
      const at::Tensor f = logits.to(at::kFloat).reshape({-1});
      const at::Tensor three =
          at::stack({f.argmax().to(at::kDouble), f.max().to(at::kDouble), at::logsumexp(f, 0).to(at::kDouble)})
              .to(at::kCPU);
      const double* v = three.data_ptr<double>();
      token = static_cast<int32_t>(v[0]);
      logprob = static_cast<float>(v[1] - v[2]);
    } else {
      // The logits on the host once (from a GPU: one copy, one wait): the token and its
      // log-probability both read there.
      host = logits.to(at::kCPU, at::kFloat).contiguous();
      token = sampler.sample(host);
    }
    if (step == 0) {
      auto now = clock::now();
      r.ttft_ms = std::chrono::duration<double, std::milli>(now - started).count();
      r.prefill_ms = std::chrono::duration<double, std::milli>(now - started).count();
      t0 = now;
    }
    if (std::find(stops.begin(), stops.end(), token) != stops.end()) {
      r.stop_reason = "stop_token";
      break;
    }
    r.tokens.push_back(token);
    r.logprobs.push_back(host.defined() ? at::log_softmax(host, 0)[token].item<float>() : logprob);
    std::string piece = stream.push(token);
    r.text += piece;
    if (options.on_token && !options.on_token(token, piece)) {
      r.stop_reason = "callback";
      break;
    }
    if (step + 1 == options.max_tokens) break;
    if (cache.length() >= limit) {
      r.stop_reason = "context_full";
      break;
    }
    logits = forward(at::full({1, 1}, static_cast<int64_t>(token), at::kLong), cache, documents)[0][-1];
  }
  std::string rest = stream.flush();
  r.text += rest;
  if (!rest.empty() && options.on_token) options.on_token(-1, rest);
  if (!r.tokens.empty()) r.decode_ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
  return r;
}

}  // namespace comb
