// comb generate: answers a prompt, with documents through the plug-in when given.
#include "commands.hpp"

namespace comb::cli {

int cmd_generate(Args& args) {
  comb::Model model = load_model(args, args.has("document"), /*as_stored=*/true);
  std::string prompt = args.str("prompt");
  if (!args.has("prompt")) throw Error("generate needs --prompt TEXT");
  bool raw = args.has("raw"), json = args.has("json");
  args.str("raw"), args.str("json");
  std::vector<std::string> document_paths = args.all("document");
  std::string cache_dir = args.str("cache-dir");
  int64_t cache_mb = args.num<int64_t>("cache-mb", 1024);
  std::string cache_url = args.str("cache-url");
  int64_t cache_ttl = args.num<int64_t>("cache-ttl", 0);
  const c10::ScalarType cache_dtype = parse_cache_dtype(args.str("cache-dtype", "auto"));
  const int64_t cache_queue = cache_queue_bytes(args);
  comb::GenerateOptions options;
  options.max_tokens = args.num<int64_t>("max-tokens", 128);
  options.sampling.temperature = args.num<float>("temperature", 0.0f);
  options.sampling.top_k = args.num<int64_t>("top-k", 0);
  options.sampling.top_p = args.num<float>("top-p", 1.0f);
  options.sampling.seed = args.num<uint64_t>("seed", 0);
  args.check_all_used();
  std::vector<int32_t> ids = raw ? model.tokenizer().encode(prompt) : model.chat_prompt(prompt);
  if (raw && model.tokenizer().add_bos() && model.tokenizer().bos_id()) ids.insert(ids.begin(), *model.tokenizer().bos_id());
  if (!json) {
    options.on_token = [](int32_t, const std::string& text) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
      return true;
    };
  }
  comb::LinkedDocuments linked;
  // Outlives the generation: its Redis writes (in the background) overlap it, and the process
  // waits for them only at the end.
  std::shared_ptr<comb::PICacheStore> store;
  if (!document_paths.empty()) {
    comb::StoreOptions store_options;
    store_options.host_bytes = cache_mb << 20;
    if (model.decoder().device().is_cuda()) {  // the documents' caches kept where the decoder reads them
      store_options.device = model.decoder().device();
      store_options.device_bytes = cache_mb << 20;
    }
    if (!cache_dir.empty()) {
      store_options.disk_dir = cache_dir;
      store_options.disk_bytes = cache_mb << 20;
      store_options.disk_queue_bytes = cache_queue;
    }
    store_options.remote_url = cache_url;
    store_options.dtype = cache_dtype;
    store_options.remote_ttl_s = cache_ttl;
    store = std::make_shared<comb::PICacheStore>(store_options);
    // The documents as every prompt holds them (title and text: the prompt module's), found in
    // the store or encoded.
    comb::Documents docs(model, store);
    std::vector<comb::QaDocument> given;
    for (const auto& path : document_paths) given.push_back(read_document(path));
    auto t0 = std::chrono::steady_clock::now();
    const std::vector<std::vector<int32_t>> texts = comb::qa_documents(model, given);
    int64_t n_tokens = 0;
    for (const auto& d : texts) n_tokens += static_cast<int64_t>(d.size());
    std::vector<std::shared_ptr<const comb::DocumentKV>> documents = docs.get(texts);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    auto stats = store->stats();
    const int64_t hits = stats.device.hits + stats.host.hits + stats.disk.hits + stats.remote.hits;
    fmt::print(stderr, "[comb] {} documents, {} tokens: {} from the cache, {} encoded, in {:.1f} ms{}\n",
               documents.size(), n_tokens, hits, documents.size() - hits, ms,
               cache_url.empty() ? "" : fmt::format(" ({} from Redis)", stats.remote.hits));
    int64_t anchor = 0;
    if (model.plugin()->config().documents_after_prefix) {
      // The plug-in reads documents placed between the instruction prefix and the question, as
      // comb qa and serve place them: the prompt becomes that question.
      COMB_CHECK(!raw, "--raw: this plug-in reads documents after the instruction prefix of a question; give the "
                 "prompt without --raw");
      ids = comb::qa_prefix(model);
      anchor = static_cast<int64_t>(ids.size());
      const auto q = comb::qa_suffix(model, prompt);
      ids.insert(ids.end(), q.begin(), q.end());
    }
    linked = docs.link(documents, anchor);
  }
  comb::GenerationResult r = model.generate(ids, options, linked.empty() ? nullptr : &linked);
  if (json) {
    nlohmann::json j = {{"text", r.text},
                        {"tokens", r.tokens},
                        {"logprobs", r.logprobs},
                        {"n_prompt", r.n_prompt},
                        {"stop_reason", r.stop_reason},
                        {"timings",
                         {{"ttft_ms", r.ttft_ms},
                          {"prefill_tokens_per_s", r.prefill_tokens_per_s()},
                          {"decode_tokens_per_s", r.decode_tokens_per_s()}}}};
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  } else {
    std::cout << std::endl;
  }
  fmt::print(stderr, "[comb] {} prompt tokens, {} generated ({}); ttft {:.1f} ms, prefill {:.1f} tok/s, decode {:.1f} tok/s\n",
             r.n_prompt, r.tokens.size(), r.stop_reason, r.ttft_ms, r.prefill_tokens_per_s(), r.decode_tokens_per_s());
  return 0;
}


// Bytes per cached document token against the decoder's own KV cache, measured on a document.

}  // namespace comb::cli
