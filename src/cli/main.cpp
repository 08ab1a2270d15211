// The `comb` command-line tool: generate, plugin, bench and version here; eval, qa, report and train
// in eval.cpp, make-data in make_data.cpp.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "comb/comb.hpp"
#include "comb/detail/mapped_file.hpp"
#include "args.hpp"

namespace comb::cli {
int cmd_eval(Args& args, comb::Model& model);
int cmd_train(Args& args, comb::Model& model);
int cmd_report(std::vector<std::string> files);
int cmd_qa(Args& args, comb::Model& model);
int cmd_make_data(Args& args);
comb::Model load_model(Args& args, bool shipped_plugin = false);
}  // namespace comb::cli

namespace comb::cli {
std::string default_model() {
  if (const char* env = std::getenv("COMB_MODEL"); env && *env) return env;
  return COMB_DEFAULT_MODEL;
}

// The trained plug-in shipped for the default model (docs/training.md), used by eval, qa and
// generate when neither --model nor COMB_MODEL names another model and no --plugin is given.
std::string default_plugin() {
  if (const char* env = std::getenv("COMB_PLUGIN"); env && *env) return env;
  return COMB_DEFAULT_PLUGIN;
}

// Input files and directories the options name, checked before a model loads (seconds) so that a
// mistyped path is refused at once, naming the option.
void check_inputs(const Args& args) {
  namespace fs = std::filesystem;
  for (const char* option : {"data", "document"})
    for (const auto& path : args.peek_all(option)) {
      std::error_code ec;
      COMB_CHECK(fs::is_regular_file(path, ec), "--{}: cannot open '{}' ({})", option, path,
                 fs::exists(path, ec) ? "not a regular file" : "no such file");
    }
  for (const auto& dir : args.peek_all("essays")) {
    std::error_code ec;
    COMB_CHECK(fs::is_directory(dir, ec), "--essays: '{}' is not a directory", dir);
  }
}

// Every numeric option any command takes, checked on a copy of the options (nothing is marked
// used) before a model loads, so that "--max-tokens 1x" is refused at once, naming the option.
void check_numbers(const Args& args) {
  Args probe = args;
  for (const char* o : {"accumulate", "batch", "cache-mb", "cache-ttl", "cached", "check-layer", "decode-tokens", "docs",
                        "encoder-layers", "epic-k", "items", "limit", "log-every", "max-docs", "max-document-tokens",
                        "max-documents", "max-new-tokens", "max-tokens", "min-docs", "min-documents", "offset",
                        "pairs-per-document", "place", "prefix-block", "save-every", "steps", "teacher-tokens",
                        "teacher-top-k", "tokenize", "top-k", "warmup"})
    probe.num<int64_t>(o, 0);
  for (const char* o : {"cpu-kernels", "documents-after-prefix", "encoder-prefix", "reading-check", "relative-positions",
                        "repeat", "resume", "threads"})
    probe.num<int>(o, 0);
  for (const char* o : {"blend-ratio", "clip", "gate-lr-scale", "kl-weight", "kv-share", "lr", "min-lr-ratio",
                        "needle-share", "open-gate", "open-gates", "weight-decay"})
    probe.num<double>(o, 0);
  probe.num<float>("temperature", 0), probe.num<float>("top-p", 0);
  probe.num<uint64_t>("seed", 0);
}

comb::Model load_model(Args& args, bool shipped_plugin) {
  check_inputs(args);
  check_numbers(args);
  const bool default_base = !args.has("model") && default_model() == COMB_DEFAULT_MODEL;
  std::string path = args.str("model", default_model());
  if (path.empty()) throw Error("no model: pass --model FILE or set COMB_MODEL");
  comb::Options options;
  options.device = args.str("device", "cpu");
  options.dtype = args.str("dtype", "float32");
  options.quantize = args.str("quantize", "none");
  options.threads = args.num<int>("threads", 0);
  options.cpu_kernels = args.num<int>("cpu-kernels", 1) != 0;
  options.plugin = args.str("plugin");
  if (options.plugin == "none") options.plugin.clear();
  else if (options.plugin.empty() && shipped_plugin && default_base && !default_plugin().empty()) {
    options.plugin = default_plugin();
    COMB_CHECK(std::filesystem::exists(options.plugin),
               "the shipped plug-in '{}' is missing (pass --plugin FILE, or --plugin none for the bare decoder)",
               options.plugin);
  }
  auto t0 = std::chrono::steady_clock::now();
  comb::Model model = comb::Model::load(path, options);
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const auto& c = model.config();
  fmt::print(stderr, "[comb] loaded {} ({} layers, {} heads / {} kv, vocab {}) on {} {} in {:.0f} ms, {} threads\n",
             path, c.n_layer, c.n_head, c.n_head_kv, c.n_vocab, options.device, options.dtype, ms,
             at::get_num_threads());
  return model;
}

}  // namespace comb::cli

namespace {

using comb::Error;
using comb::cli::Args;
using comb::cli::load_model;
using comb::cli::median;

constexpr const char* kUsage = R"(usage: comb <command> [options]

commands:
  generate      answer a prompt with a model (with documents: through the COMB plug-in)
  qa            answer a question over documents with each caching method: answers, TTFT
  plugin init   write a fresh plug-in for a model
  plugin memory bytes per cached document token, COMB against the decoder's KV cache
  eval          one method on a multi-document QA file: accuracy, TTFT cold and warm
  report [--markdown] [--first N] [--data FILE]... FILE...
                the summary of eval --out files (chunks of runs): per data and method, a JSON
                line, or with --markdown one table; --first N: items 0..N-1 only; --data FILE:
                score the stored predictions again against that data file's answers
  train         train a plug-in for a model (decoder frozen)
  make-data     write QA items: generated (--kind codeword, needle), or made from a public source file
                (--kind nq-multidoc, --kind kv)
  bench         measure prefill and decode throughput
  version       print the version

options of every command that loads a model (all but make-data and report):
  --model FILE        model file (.gguf) or Hugging Face directory
                      (default: $COMB_MODEL, else the model the set-up installed)
  --device DEV        cpu (default), cuda, cuda:N
  --dtype T           float32 (default), bfloat16, float16 (CUDA only)
  --quantize none|gguf|int8|int4  none (default): every weight expanded to --dtype on load; gguf: a
                      GGUF file's Q4_0/Q4_1/Q8_0 matrices kept as stored and multiplied quantized;
                      int8, int4: float weights quantized on load in groups of 32 (embedding and head
                      int8). CPU and float32 only; not for train
  --threads N         CPU threads (default: LibTorch's choice)
  --cpu-kernels 0|1   fused fp32 CPU kernels (default 1; 0 runs generic ATen ops only)

environment:
  COMB_MODEL          the default model file
  COMB_KEEP_FREED_MEMORY=0
                      leave the C allocator's defaults (by default comb keeps freed blocks of
                      up to 32 MiB for reuse instead of faulting them in again at each prefill)

generate options:
  --prompt TEXT       the user message (sent through the model's chat template)
  --raw               send the prompt as is, without the chat template
  --max-tokens N      most tokens to generate (default 128)
  --temperature T     0 = greedy (default), else sample
  --top-k N           sample among the N most likely tokens (default 0: all)
  --top-p P           sample from the smallest set with mass P (default 1)
  --seed N            random seed for sampling (default 0)
  --json              print token ids, logprobs and timings as JSON instead of text
  --plugin FILE       a plug-in-only file to apply; with the default model, eval, qa and generate
                      --document use the shipped one (examples/plugins/, COMB_PLUGIN overrides;
                      --plugin none: the bare decoder)
  --document FILE     a document for the encoder; repeat for several, in any order
  --cache-dir DIR     keep document caches on disk in DIR (survives restarts)
  --cache-mb N        cache budget per tier in MiB (default 1024)
  --cache-url URL     share document caches through Redis (redis://HOST[:PORT][/DB]): looked up after
                      the local tiers, written in the background; also for qa and eval
  --cache-ttl S       expiry of the entries written to Redis, in seconds (default 0: none)

plugin memory options:
  --plugin FILE       the plug-in whose encoder layers count (else --encoder-layers)
  --encoder-layers N  encoder layers (default 4)

plugin init options:
  --out FILE          where to write the plug-in (safetensors)
  --encoder-layers N  encoder layers = cross blocks (default 4)
  --cross-layers LIST decoder layers the cross blocks run before (default: spread evenly)
  --random-init       random encoder and cross blocks (default: copies of decoder layers)
  --seed N            random seed (default 0)
  --init identity|reads|joint  identity (default): gates closed, so the plug-in changes nothing until
                      trained; reads: the encoder is the base's first layers (causal, not stored),
                      each block at --cross-layers L is layer L's attention over the documents'
                      depth-L states, with attention sinks measured on probe prompts (docs/training.md);
                      joint: as reads, but each block joins layer L's own attention (one softmax over
                      the documents and the context, a learned bias per head on the documents)
  --open-gate X       reads: tanh of the attention gates (default 0.995)
  --relative-positions 0|1  reads: RoPE with documents before the prompt (default 1), or none
  --encoder-prefix 0|1|2    reads: the encoder reads nothing (0), the prompt's first token (1, default) or the
                            whole instruction prefix (2) before each document
  --documents-after-prefix 0|1  joint: the documents sit between the instruction prefix and the question;
                            the prefix reads none, so a warm request takes it from the prefix cache (default 0)

qa options:
  --document FILE     a document (its title: the file name); repeat for several
  --question TEXT     the question
  --methods LIST      comma separated (default full,naive,epic,cacheblend,comb; comb only with a
                      plug-in: the shipped one for the default model, or --plugin)
  --max-new-tokens N  greedy tokens per answer (default 48)
  --plugin FILE       the plug-in for comb (default: the shipped one; none: leave comb out)
  --cache-url URL, --cache-ttl S   as for generate

eval options:
  --method M          full (default), prefix, naive, cacheblend, epic, comb
  --data FILE         items (JSON Lines, gzip or plain): id, question, answers, documents
  --limit N           N items (default: all)
  --offset N          start at item N (default 0): a long evaluation split into chunks
  --out FILE          one JSON line per item (comb report merges such files)
  --max-new-tokens N  greedy tokens per warm answer (default 32; the cold run stops at the first)
  --priming auto|always
                      what warms the caches (default auto): prefix is primed by a request with
                      the documents in another order and another question; the per-document
                      methods reuse what their cold request cached (the same K/V any request
                      leaves); full runs once, reported as cold and warm. always: every method
                      but full is primed, and full runs twice
  --blend-ratio R     cacheblend: share of document tokens recomputed (default 0.15)
  --check-layer L     cacheblend: layer that picks them (default 1)
  --epic-k K          epic: leading tokens recomputed per document (default 8)
  --prefix-block N    prefix: tokens per cached block (default 16)
  --cache-url URL, --cache-ttl S   as for generate; with a shared Redis, "cold" means the local tiers
                      empty (a document another process computed comes from Redis)
  --plugin FILE       comb: the plug-in (default: the shipped one for the default model)

train options:
  --out FILE          the trained plug-in (safetensors, --save-dtype, default bfloat16)
  --dir DIR           checkpoints and loss.csv (default: OUT.run); a run there resumes
  --data FILE         QA items to train on; repeat for several
  --holdout FILE:N    never train on the first N items of FILE (by id, in every file); repeatable
  --essays DIR        *.txt filler for generated needle examples
  --kv-share S        share of generated key-value lookups (default 0.2)
  --needle-share S    share of generated needle examples (default 0.15 with --essays)
  --min-documents N, --max-documents N   documents linked per example (default 1..10)
  --max-document-tokens N                longer documents are cut (default 320)
  --steps N (1000)  --batch N (16)  --accumulate N (1)  --lr X (3e-4)  --warmup N (50)
  --min-lr-ratio X (0.1)  --weight-decay X (0.01)  --gate-lr-scale X (10)  --clip X (1.0)
  --open-gates X      start a fresh run's attention gates at tanh(gate) = X (default 0)
  --kl-weight X       add X * KL(full-context decoder || plug-in) on answer tokens (default 0)
  --targets gold|teacher  gold (default): the items' answers; teacher: the decoder's own greedy
                      answers with all the example's documents in its context (self-distillation;
                      with --kl-weight, KL over its stored top-k log-probabilities)
  --teacher FILE      teacher answers kept across runs (default DIR/teacher.jsonl)
  --teacher-tokens N (24)  --teacher-top-k N (16)
  --encoder-layers N  for a fresh plug-in (default 4); --plugin FILE continues from a plug-in
  --cross-layers LIST for a fresh plug-in: the decoder layers its cross blocks run before
  --init first|spread|reads|joint fresh plug-in: copies of the first decoder layers, cross blocks
                      after them (default) or at --cross-layers, each with its decoder layer's
                      attention; or copies of the layers the blocks are spread over; or reads
                      (as plugin init --init reads or joint, at --cross-layers)
  --documents-after-prefix 0|1  joint: as plugin init (default 0)
  --seed N            data order and initialisation (default 0)
  --reading-check 0|1 also score each batch with the documents swapped between its examples (no
                      gradient; loss.csv's ce_swapped against ce shows reading) (default 0)
  --save-every N (200)  --log-every N (10)  --resume 0|1 (1)

make-data options (docs/data.md):
  --kind codeword     (default) generated: notes "The secret code word of <name> is <word>."
    --out FILE  --items N (1000)  --seed N (0)
    --split train|test  test items use words (answers) that train items never use
  --kind needle       generated: "The special magic number for <key> is <7 digits>." planted
                      in one of several paragraphs of filler prose
    --essays DIR  --out FILE  --items N (100)  --seed N (0)  --min-docs N (2)  --max-docs N (6)
    --split train|test  test items use every fourth essay (by name) and key words that train
                        items never use
  --kind nq-multidoc  from the public Natural Questions oracle file (nq-open-oracle.jsonl.gz):
                      each question's gold passage and distractors drawn from the other
                      questions' gold passages that hold none of its answers
    --from FILE  --out FILE  --docs N (10)  --seed N (0)  --items N (0: all)  --id-prefix P (nq)
  --kind kv           from a public key-value retrieval file (kv-retrieval-75_keys.jsonl.gz)
    --from FILE  --out FILE  --pairs-per-document N (5)  --items N (0: all)  --id-prefix P (kv)
  An --out name ending in .gz is written compressed.

bench options:
  --prompt-tokens LIST   prompt lengths for prefill, comma separated (default 128,512,2048)
  --cached N             each prefill follows N cached positions (default 0): the rows
                         that prefix caching or a chunked prefill computes
  --decode-tokens N      tokens decoded after a 128-token prompt (default 64)
  --place N              also time placing N cached tokens, in documents of 64 tokens each moved
                         to where it lands (keys rotated), as naive, CacheBlend and EPIC do (default 0: off)
  --tokenize N           also time the tokenizer on one word of N random letters, a new one
                         each run (BPE merges inside one pre-tokenized piece) (default 0: off)
  --repeat N             runs per figure; the median is reported (default 3)
  --profile 0|1          also profile --decode-tokens decode steps: time per step by operation (its own
                         time, without the operations it calls), and the time outside every operation
                         (the decoder's own C++ between them) (default 0)
  --json                 one JSON object per figure
)";

int cmd_generate(Args& args) {
  comb::Model model = load_model(args, args.has("document"));
  std::string prompt = args.str("prompt");
  if (!args.has("prompt")) throw Error("generate needs --prompt TEXT");
  bool raw = args.has("raw"), json = args.has("json");
  args.str("raw"), args.str("json");
  std::vector<std::string> document_paths = args.all("document");
  std::string cache_dir = args.str("cache-dir");
  int64_t cache_mb = args.num<int64_t>("cache-mb", 1024);
  std::string cache_url = args.str("cache-url");
  int64_t cache_ttl = args.num<int64_t>("cache-ttl", 0);
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
  std::optional<comb::PICacheStore> store;
  if (!document_paths.empty()) {
    comb::StoreOptions store_options;
    store_options.host_bytes = cache_mb << 20;
    if (!cache_dir.empty()) {
      store_options.disk_dir = cache_dir;
      store_options.disk_bytes = cache_mb << 20;
    }
    store_options.remote_url = cache_url;
    store_options.remote_ttl_s = cache_ttl;
    store.emplace(store_options);
    std::vector<std::shared_ptr<const comb::DocumentKV>> documents;
    int64_t n_tokens = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (const auto& path : document_paths) {
      std::string text = comb::detail::read_text_file(path);
      auto tokens = model.tokenizer().encode(text, /*parse_special=*/false);
      if (tokens.empty()) throw Error("document '" + path + "' is empty");
      n_tokens += static_cast<int64_t>(tokens.size());
      documents.push_back(model.document(tokens, &*store));
    }
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    auto stats = store->stats();
    const int64_t hits = stats.host.hits + stats.disk.hits + stats.remote.hits;
    fmt::print(stderr, "[comb] {} documents, {} tokens: {} from the cache, {} encoded, in {:.1f} ms{}\n",
               documents.size(), n_tokens, hits, documents.size() - hits, ms,
               cache_url.empty() ? "" : fmt::format(" ({} from Redis)", stats.remote.hits));
    linked = comb::Linker(model.decoder().device()).link(documents);
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
int cmd_plugin_memory(Args& args) {
  comb::Model model = load_model(args);
  int64_t n_encoder = args.num<int64_t>("encoder-layers", 4);
  args.check_all_used();
  std::optional<comb::Plugin> fresh;  // without --plugin: a fresh one with --encoder-layers
  const comb::Plugin* plugin = model.plugin();
  if (!plugin) {
    comb::PluginInitOptions init;
    init.n_encoder_layers = n_encoder;
    plugin = &fresh.emplace(comb::Plugin::fresh(model.decoder(), init));
  }
  c10::InferenceMode guard;
  const auto& c = model.config();
  std::vector<int32_t> doc = model.tokenizer().encode(std::string(2000, 'a') + " the end", false);
  comb::DocumentKV kv = plugin->encode(model.decoder(), doc);
  comb::KVCache full = model.decoder().make_cache(1, static_cast<int64_t>(doc.size()));
  fmt::print("| dtype | decoder KV bytes/token | COMB bytes/token | ratio | L_E/L |\n|---|---:|---:|---:|---:|\n");
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    double comb_bytes = double(kv.to(c10::kCPU, dtype).bytes()) / doc.size();
    double decoder_bytes = 0;
    for (int64_t l = 0; l < c.n_layer; ++l)
      decoder_bytes += double(full.keys(l).numel() + full.values(l).numel()) * c10::elementSize(dtype);
    decoder_bytes /= doc.size();
    fmt::print("| {} | {:.0f} | {:.0f} | {:.4f} | {}/{} = {:.4f} |\n", c10::toString(dtype), decoder_bytes, comb_bytes,
               comb_bytes / decoder_bytes, plugin->config().n_encoder_layers(), c.n_layer,
               double(plugin->config().n_encoder_layers()) / c.n_layer);
  }
  return 0;
}

int cmd_plugin(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[2]) == "memory") {
    Args args(argc, argv, 3, {});
    return cmd_plugin_memory(args);
  }
  if (argc < 3 || std::string(argv[2]) != "init")
    throw Error("usage: comb plugin init --out FILE [options] | comb plugin memory [--plugin FILE | --encoder-layers N]");
  Args args(argc, argv, 3, {"random-init"});
  std::string out = args.str("out");
  if (out.empty()) throw Error("plugin init needs --out FILE");
  comb::PluginInitOptions init;
  init.n_encoder_layers = args.num<int64_t>("encoder-layers", init.n_encoder_layers);
  init.seed = args.num<uint64_t>("seed", 0);
  init.copy_decoder_layers = !args.has("random-init");
  args.str("random-init");
  init.cross_layers = comb::cli::parse_int_list(args.str("cross-layers"), "cross-layers");
  const std::string how = args.str("init", "identity");
  if (how != "identity" && how != "reads" && how != "joint")
    throw Error(fmt::format("--init must be identity, reads or joint, found '{}'", how));
  init.reads = how == "reads" || how == "joint";
  init.joint_attention = how == "joint";
  init.open_gate = args.num<double>("open-gate", init.open_gate);
  const int encoder_prefix = args.num<int>("encoder-prefix", 1);
  if (encoder_prefix < 0 || encoder_prefix > 2)
    throw Error(fmt::format("--encoder-prefix must be 0, 1 or 2, found {}", encoder_prefix));
  init.relative_positions = args.num<int>("relative-positions", 1) != 0;
  init.documents_after_prefix = args.num<int>("documents-after-prefix", 0) != 0;
  if (init.documents_after_prefix && !init.joint_attention)
    throw Error("--documents-after-prefix 1 is a layout of --init joint");
  comb::Model model = load_model(args);
  args.check_all_used();
  if (init.reads) {
    init.probes = comb::qa_probe_prompts(model);
    if (encoder_prefix == 1) init.encoder_prefix = {init.probes[0][0]};  // the prompt's first token
    if (encoder_prefix == 2) {  // the whole instruction prefix
      auto p = comb::qa_prefix(model);
      init.encoder_prefix.assign(p.begin(), p.end());
    }
  }
  comb::Plugin plugin = comb::Plugin::fresh(model.decoder(), init);
  plugin.save(out);
  if (init.joint_attention)
    fmt::print(stderr,
               "[comb] wrote a plug-in that reads from the start (encoder: the base's first {} layers, causal; "
               "joint blocks at layers {}, each joining that layer's attention), untrained: the trained one for "
               "the default model is {}; to {}\n",
               plugin.config().n_encoder_layers(), fmt::join(plugin.config().cross_layers, ", "),
               COMB_DEFAULT_PLUGIN, out);
  else if (init.reads)
    fmt::print(stderr,
               "[comb] wrote a plug-in that reads from the start (encoder: the base's first {} layers, causal; "
               "cross blocks before layers {}, each that layer's attention) to {}\n",
               plugin.config().n_encoder_layers(), fmt::join(plugin.config().cross_layers, ", "), out);
  else
    fmt::print(stderr,
               "[comb] wrote a fresh plug-in ({} encoder layers, cross blocks before layers {}) to {}: its gates are "
               "closed, so it is the identity (answers with documents are the bare decoder's) until trained\n",
               plugin.config().n_encoder_layers(), fmt::join(plugin.config().cross_layers, ", "), out);
  return 0;
}

// Time by operation over decode steps: a thread-local RecordFunction callback (LibTorch's ATen ops
// and comb's own kernels, which name themselves "comb::..."), each operation's own time without
// the operations it calls. Main thread only: the work of worker threads is inside the op that
// started it.
namespace op_profile {
struct Stat {
  int64_t calls = 0, self_ns = 0, total_ns = 0;
};
struct Frame {
  std::string name;
  int64_t start_ns = 0, child_ns = 0;
};
std::map<std::string, Stat> stats;
std::vector<Frame> stack;
int64_t top_level_ns = 0;
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
  stack.push_back({fn.name(), now_ns(), 0});
  return nullptr;
}
void leave(const at::RecordFunction&, at::ObserverContext*) {
  if (stack.empty()) return;
  Frame f = std::move(stack.back());
  stack.pop_back();
  const int64_t total = now_ns() - f.start_ns;
  Stat& s = stats[f.name];
  ++s.calls;
  s.total_ns += total;
  s.self_ns += total - f.child_ns;
  if (stack.empty())
    top_level_ns += total;
  else
    stack.back().child_ns += total;
}
}  // namespace op_profile

int cmd_bench(Args& args) {
  comb::Model model = load_model(args);
  std::string lengths = args.str("prompt-tokens", "128,512,2048");
  int64_t n_decode = args.num<int64_t>("decode-tokens", 64);
  int64_t cached = args.num<int64_t>("cached", 0);
  if (cached < 0) throw Error("--cached: expected a number of positions >= 0, found " + std::to_string(cached));
  int64_t n_place = args.num<int64_t>("place", 0);
  if (n_place < 0 || n_place > model.config().n_ctx)
    throw Error(fmt::format("--place: expected a number of tokens in [0, {}] (the model's context), found {}",
                            model.config().n_ctx, n_place));
  int64_t n_tokenize = args.num<int64_t>("tokenize", 0);
  if (n_tokenize < 0) throw Error("--tokenize: expected a number of characters >= 0, found " + std::to_string(n_tokenize));
  int repeat = std::max(1, args.num<int>("repeat", 3));
  const bool profile = args.num<int>("profile", 0) != 0;
  bool json = args.has("json");
  args.str("json");
  args.check_all_used();
  c10::InferenceMode guard;
  const comb::Decoder& dec = model.decoder();
  {
    const auto& w = dec.weights();
    std::string format = w.quantized() ? "kept quantized (" : std::string(c10::toString(dec.dtype()));
    if (w.quantized()) {
      std::vector<std::string> parts;
      if (!w.layers.empty() && w.layers[0].quantized) parts.push_back(std::string("layers ") + w.layers[0].quantized->wqkv.format_name());
      if (w.output_q) parts.push_back(std::string("head ") + w.output_q->format_name());
      format += fmt::format("{})", fmt::join(parts, ", "));
    }
    const double weights_mb = w.bytes() / 1048576.0;
    if (json)
      std::cout << nlohmann::json{{"bench", "weights"}, {"format", format}, {"weight_bytes", w.bytes()}}.dump() << std::endl;
    else
      fmt::print("weights  {}, {:.1f} MiB\n", format, weights_mb);
  }
  // Deterministic prompts of ordinary tokens (ids past the special ones at the start of the vocabulary).
  std::mt19937_64 rng(1234);
  auto prompt = [&](int64_t n) {
    std::uniform_int_distribution<int64_t> pick(1000, model.config().n_vocab - 1);
    std::vector<int64_t> ids(n);
    for (auto& id : ids) id = pick(rng);
    return at::tensor(ids, at::kLong).unsqueeze(0);
  };
  auto now = [] { return std::chrono::steady_clock::now(); };
  auto report = [&](const std::string& what, int64_t tokens, double tps, int64_t after = 0) {
    if (json) {
      nlohmann::json line{{"bench", what}, {"tokens", tokens}, {"tokens_per_s", tps}};
      if (what == "prefill") line["cached"] = after;
      std::cout << line.dump() << std::endl;
    } else if (after > 0) {
      fmt::print("{:<8} {:>6} tokens  {:>10.1f} tokens/s  after {} cached\n", what, tokens, tps, after);
    } else {
      fmt::print("{:<8} {:>6} tokens  {:>10.1f} tokens/s\n", what, tokens, tps);
    }
  };
  at::Tensor before = prompt(cached);
  for (int64_t n : comb::cli::parse_int_list(lengths, "prompt-tokens")) {
    if (n <= 0) throw Error("--prompt-tokens: expected lengths > 0, found " + std::to_string(n));
    if (cached + n > model.config().n_ctx)
      throw Error(fmt::format("--prompt-tokens: {} tokens after {} cached exceed the model's context ({})", n, cached,
                              model.config().n_ctx));
    at::Tensor ids = prompt(n);
    std::vector<double> times;
    for (int r = 0; r <= repeat; ++r) {  // the first run warms up
      comb::KVCache cache = dec.make_cache(1, cached + n);
      if (cached > 0) dec.forward(before, cache);  // not timed
      auto t0 = now();
      at::Tensor logits = dec.forward(ids, cache);
      logits.cpu();
      if (r > 0) times.push_back(std::chrono::duration<double>(now() - t0).count());
    }
    report("prefill", n, n / median(times), cached);
  }
  if (n_decode > 0) {
    std::vector<double> rates;
    for (int r = 0; r <= repeat; ++r) {
      comb::KVCache cache = dec.make_cache(1, 128 + n_decode);
      at::Tensor logits = dec.forward(prompt(128), cache);
      int64_t token = logits[0][-1].argmax().item<int64_t>();
      auto t0 = now();
      for (int64_t i = 0; i < n_decode; ++i) {
        logits = dec.forward(at::full({1, 1}, token, at::kLong), cache);
        token = logits[0][-1].argmax().item<int64_t>();
      }
      if (r > 0) rates.push_back(n_decode / std::chrono::duration<double>(now() - t0).count());
    }
    report("decode", n_decode, median(rates));
    if (profile) {
      comb::KVCache cache = dec.make_cache(1, 128 + n_decode);
      at::Tensor logits = dec.forward(prompt(128), cache);
      int64_t token = logits[0][-1].argmax().item<int64_t>();
      op_profile::stats.clear();
      op_profile::top_level_ns = 0;
      auto handle = at::addThreadLocalCallback(
          at::RecordFunctionCallback(op_profile::enter, op_profile::leave).needsInputs(false).scopes(
              {at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
      const int64_t t0 = op_profile::now_ns();
      for (int64_t i = 0; i < n_decode; ++i) {
        logits = dec.forward(at::full({1, 1}, token, at::kLong), cache);
        token = logits[0][-1].argmax().item<int64_t>();
      }
      const double step_us = (op_profile::now_ns() - t0) / 1e3 / n_decode;
      at::removeCallback(handle);
      std::vector<std::pair<std::string, op_profile::Stat>> rows(op_profile::stats.begin(), op_profile::stats.end());
      std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.self_ns > b.second.self_ns; });
      const double outside_us = step_us - op_profile::top_level_ns / 1e3 / n_decode;
      if (json) {
        for (const auto& [name, st] : rows)
          std::cout << nlohmann::json{{"bench", "decode_profile"}, {"op", name}, {"calls_per_step", double(st.calls) / n_decode},
                                      {"self_us_per_step", st.self_ns / 1e3 / n_decode}}.dump() << std::endl;
        std::cout << nlohmann::json{{"bench", "decode_profile"}, {"op", "(outside every operation)"},
                                    {"self_us_per_step", outside_us}, {"step_us", step_us}}.dump() << std::endl;
      } else {
        fmt::print("decode profile, {} steps (profiled: {:.0f} us a step)\n", n_decode, step_us);
        fmt::print("  {:<44} {:>10} {:>12} {:>7}\n", "operation", "calls/step", "own us/step", "share");
        double shown = 0;
        for (size_t r = 0; r < rows.size() && r < 16; ++r) {
          const double us = rows[r].second.self_ns / 1e3 / n_decode;
          shown += us;
          fmt::print("  {:<44} {:>10.1f} {:>12.1f} {:>6.1f}%\n", rows[r].first, double(rows[r].second.calls) / n_decode, us,
                     100 * us / step_us);
        }
        const double rest = op_profile::top_level_ns / 1e3 / n_decode - shown;
        fmt::print("  {:<44} {:>10} {:>12.1f} {:>6.1f}%\n", "(every other operation)", "", rest, 100 * rest / step_us);
        fmt::print("  {:<44} {:>10} {:>12.1f} {:>6.1f}%\n", "(outside every operation)", "", outside_us, 100 * outside_us / step_us);
      }
    }
  }
  if (n_place > 0) {
    const int64_t doc_len = std::min<int64_t>(64, n_place);
    comb::KVCache doc = dec.make_cache(1, doc_len);
    dec.forward(prompt(doc_len), doc);  // one document's K/V at positions [0, doc_len), reused throughout
    std::vector<double> times;
    for (int r = 0; r <= repeat; ++r) {
      comb::KVCache cache = dec.make_cache(1, n_place);
      auto t0 = now();
      for (int64_t pos = 0; pos < n_place; pos += doc_len) {
        const int64_t m = std::min(doc_len, n_place - pos);
        for (int64_t l = 0; l < cache.n_layers(); ++l)
          dec.place(l, cache, pos, doc.keys(l).narrow(2, 0, m), doc.values(l).narrow(2, 0, m));
      }
      if (r > 0) times.push_back(std::chrono::duration<double>(now() - t0).count());
    }
    report("place", n_place, n_place / median(times));
  }
  if (n_tokenize > 0) {
    std::uniform_int_distribution<int> letter('a', 'z');
    std::vector<double> times;
    size_t n_ids = 0;
    for (int r = 0; r <= repeat; ++r) {
      std::string word(static_cast<size_t>(n_tokenize), 'a');
      for (auto& ch : word) ch = static_cast<char>(letter(rng));  // a new word: the piece cache cannot answer
      auto t0 = now();
      n_ids = model.tokenizer().encode(word, /*parse_special=*/false).size();
      if (r > 0) times.push_back(std::chrono::duration<double>(now() - t0).count());
    }
    const double cps = n_tokenize / median(times);
    if (json)
      std::cout << nlohmann::json{{"bench", "tokenize"}, {"chars", n_tokenize}, {"tokens", n_ids}, {"chars_per_s", cps}}.dump()
                << std::endl;
    else
      fmt::print("{:<8} {:>6} chars   {:>10.1f} chars/s  ({} tokens)\n", "tokenize", n_tokenize, cps, n_ids);
  }
  // Resident memory now and at its peak (the whole process: LibTorch, the model, the runs above).
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  const double peak_mb = usage.ru_maxrss / 1024.0;  // Linux: KiB
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  const double resident_mb = resident * static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1048576.0;
  if (json)
    std::cout << nlohmann::json{{"bench", "memory"}, {"resident_mib", resident_mb}, {"peak_resident_mib", peak_mb}}.dump()
              << std::endl;
  else
    fmt::print("memory   resident {:.1f} MiB, peak {:.1f} MiB\n", resident_mb, peak_mb);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "help" || std::string(argv[1]) == "--help") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  // Large activation blocks are reused instead of faulted in again at every prefill (see
  // comb/allocator.hpp); COMB_KEEP_FREED_MEMORY=0 keeps the allocator's defaults, for comparison.
  if (const char* keep = std::getenv("COMB_KEEP_FREED_MEMORY"); keep == nullptr || std::string(keep) != "0")
    comb::keep_freed_memory();
  // The library's warnings (a cache tier that failed, a dropped corrupt entry) reach the user;
  // train replaces this to print its progress as well.
  comb::set_log_callback([](comb::LogLevel level, const std::string& m) {
    if (level == comb::LogLevel::warning) fmt::print(stderr, "[comb] {}\n", m);
  });
  try {
    if (cmd == "version" || cmd == "--version") {
      std::cout << "comb " << COMB_VERSION_STRING << std::endl;
      return 0;
    }
    if (cmd == "generate") {
      Args args(argc, argv, 2, {"raw", "json"});
      return cmd_generate(args);
    }
    if (cmd == "plugin") return cmd_plugin(argc, argv);
    if (cmd == "eval") {
      Args args(argc, argv, 2, {});
      comb::Model model = load_model(args, true);
      return comb::cli::cmd_eval(args, model);
    }
    if (cmd == "qa") {
      Args args(argc, argv, 2, {});
      comb::Model model = load_model(args, true);
      return comb::cli::cmd_qa(args, model);
    }
    if (cmd == "make-data") {
      Args args(argc, argv, 2, {});
      return comb::cli::cmd_make_data(args);
    }
    if (cmd == "report") return comb::cli::cmd_report(std::vector<std::string>(argv + 2, argv + argc));
    if (cmd == "train") {
      Args args(argc, argv, 2, {});
      comb::Model model = load_model(args);
      return comb::cli::cmd_train(args, model);
    }
    if (cmd == "bench") {
      Args args(argc, argv, 2, {"json"});
      return cmd_bench(args);
    }
    throw Error("unknown command '" + cmd + "' (expected generate, qa, eval, report, train, make-data, plugin, bench or version)");
  } catch (const Error& e) {
    if (std::string(e.what()) == "help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    const char* debug = std::getenv("COMB_DEBUG");
    if (debug && *debug && std::string(debug) != "0" && !e.where().empty())
      fmt::print(stderr, "comb: error: {} (at {})\n", e.what(), e.where());
    else
      fmt::print(stderr, "comb: error: {}\n", e.what());
    return 1;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "comb: internal error: {}\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "comb: error: {}\n", e.what());
    return 1;
  }
}
