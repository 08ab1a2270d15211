// The `comb` command-line tool: the help text and the dispatch to one command (commands.hpp).
#include "commands.hpp"

namespace comb::cli {

const char* const kUsage = R"(usage: comb <command> [options]

commands:
  generate      answer a prompt with a model (with documents: through the COMB plug-in)
  qa            answer a question over documents with each caching method: answers, TTFT
  plugin init   write a fresh plug-in for a model
  plugin memory bytes per cached document token, COMB against the decoder's KV cache
  plugin convert
                a plug-in written again: weights in another dtype, the cache dtype it declares
  eval          one method on a multi-document QA file: accuracy, TTFT cold and warm
  report [--markdown] [--paired] [--first N] [--data FILE]... FILE...
                the summary of eval --out files (chunks of runs): per data, method and label, a JSON
                line, or with --markdown one table; --first N: items 0..N-1 only; --data FILE:
                score the stored predictions again against that data file's answers; --paired:
                each accuracy's 95% interval (Wilson's), and every two methods on a data set
                item by item (items only one of them answers, McNemar's exact test), each
                data set's verdicts named: as stored, or scored again against --data
  attention     where the row that predicts the answer looks: the gold document's share of the
                attention with every document in the context (full) and linked (comb), by layer,
                position and count
  train         train a plug-in for a model (decoder frozen)
  make-data     write QA items: generated (--kind codeword, records, long-records, needle), or made from a public source file
                (--kind nq-multidoc, --kind kv)
  bench         measure prefill and decode throughput
  serve         an OpenAI-compatible HTTP server (continuous batching, documents, every caching method)
  loadgen       Poisson load over QA items for a running `comb serve`: requests/s, tokens/s, TTFT
  version       print the version

options of every command that loads a model (all but make-data and report):
  --model FILE        model file (.gguf) or Hugging Face directory
                      (default: $COMB_MODEL, else the model the set-up installed)
  --device DEV        cpu (default), cuda, cuda:N
  --dtype T           float32 (default), bfloat16, float16 (CUDA only)
  --quantize auto|none|gguf|int8|int4  auto (the default of generate, qa, eval, serve, bench): gguf
                      for a GGUF file on the CPU in float32, else none; gguf: a GGUF file's
                      Q4_0/Q4_1/Q8_0 matrices kept as stored and multiplied quantized; none (the
                      default of train and plugin): every weight expanded to --dtype on load; int8,
                      int4: float weights quantized on load in groups of 32 (embedding and head
                      int8). Kept quantized: CPU and float32 only; not for train
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
  --document FILE     a document for the encoder; repeat for several, in any order (with a plug-in
                      that reads documents after the instruction prefix, as the shipped one does,
                      the prompt is asked as a question about them, as comb qa asks it)
  --cache-dir DIR     keep document caches on disk in DIR (survives restarts), written by a
                      thread of their own
  --cache-queue-mb N  most MiB of document caches waiting to be written to DIR (default 256; more
                      and the request waits; 0: each written before the request goes on)
  --cache-mb N        cache budget per tier in MiB (default 1024)
  --cache-url URL     share document caches through Redis (redis://HOST[:PORT][/DB]): looked up after
                      the local tiers, written in the background; also for qa and eval
  --cache-ttl S       expiry of the entries written to Redis, in seconds (default 0: none)
  --cache-dtype T     storage of cached document K/V in every tier: auto (default: the decoder's
                      K/V as computed, a plug-in's documents in the dtype it declares, int8 for the
                      shipped one), float32, bfloat16, float16, int8 (float16 scales: keys per
                      channel, per row on documents under head_dim/2 tokens; values per
                      row), int8-int4 (int8 keys, int4 values), int4 (both, codes in [-7, 7];
                      keys rotated by a Walsh-Hadamard matrix first and scaled per channel,
                      head_dim a power of two); also for qa, eval and serve

plugin memory options:
  --plugin FILE       the plug-in to measure (default: the shipped one for the default model)
  --encoder-layers N  measure a fresh plug-in of N encoder layers instead
  --document-tokens N the document encoded for the figures (default 128 tokens)

plugin convert options:
  --plugin FILE       the plug-in to read
  --out FILE          where to write it
  --save-dtype T      its weights: bfloat16 (default), float32, float16
  --cache-dtype T     the dtype its document caches are kept in under --cache-dtype auto:
                      float32, bfloat16, float16, int8, int8-int4, int4 (default: as it was)
  --keep-blocks LIST  only these cross blocks (indices from 0, increasing, comma separated), each as
                      it was, the encoder cut to the deepest depth they read: caches of fewer
                      blocks, untrained (default: every block)
  --document-span N   consecutive documents: when a request's documents hold more than N tokens,
                      their distances from the question shrink in proportion (0: off; default: as
                      it was)
  --document-near N   with --document-span: distances up to N tokens kept, only those beyond
                      shrink (default 0: all shrink in proportion)

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
  --consecutive-documents 0|1  joint: the linked documents lie one after another in the order linked, as
                            in a full prompt, instead of each ending right before the prompt (default 0)

qa options:
  --document FILE     a document (its title: the file name); repeat for several
  --question TEXT     the question
  --methods LIST      comma separated (default full,naive,epic,cacheblend,comb; comb only with a
                      plug-in: the shipped one for the default model, or --plugin)
  --max-new-tokens N  greedy tokens per answer (default 48)
  --plugin FILE       the plug-in for comb (default: the shipped one; none: leave comb out)
  --cache-url URL, --cache-ttl S, --cache-dtype T   as for generate

eval options:
  --method M          full (default), prefix, naive, cacheblend, epic, comb
  --data FILE         items (JSON Lines, gzip or plain): id, question, answers, documents
  --limit N           N items (default: all)
  --offset N          start at item N (default 0): a long evaluation split into chunks
  --out FILE          one JSON line per item (comb report merges such files)
  --label NAME        written on each line: comb report keeps runs of one method under different
                      labels apart (a variant of a plug-in, say), as "comb [NAME]"
  --max-new-tokens N  greedy tokens per warm answer (default 32; the cold run stops at the first)
  --priming auto|always
                      what warms the caches (default auto): prefix is primed by a request with
                      the documents in another order and another question; the per-document
                      methods reuse what their cold request cached (the same K/V any request
                      leaves); full runs once, reported as cold and warm. always: every method
                      but full is primed, and full runs twice
  --blend-ratio R     cacheblend: share of document tokens recomputed (default 0.3)
  --check-layer L     cacheblend: layer that picks them (default 1)
  --epic-k K          epic: leading tokens recomputed per document (default 16)
  --comb-recompute-last N
                      comb: the last N documents given to the decoder as text before the question
                      (computed on every request, reading the linked ones), the others linked
                      (default 0: all linked)
  --comb-recompute-linked 0|1
                      1: those documents linked as well, read both ways (default 0: as text only)
  --prefix-block N    prefix: tokens per cached block (default 16)
  --cache-dtype T     storage of cached document K/V (as for generate)
  --cache-url URL, --cache-ttl S   as for generate; with a shared Redis, "cold" means the local tiers

attention options:
  --data FILE         items with gold_index (JSON Lines, gzip or plain)
  --limit N, --offset N   as for eval
  --out FILE          one CSV row per item, for full and comb: the documents' mass, the gold
                      document's share of it, the share of layers where it has the most, the best
                      head's gold share (means over the layers comb reads)
  --cache-dtype T     the documents' storage as comb reads them (as for generate; default: the
                      plug-in's)
  --plugin FILE       a plug-in whose blocks join their layers' attention (default: the shipped one)
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
  --teacher-batched auto|0|1  compute a batch's missing teacher answers together, one forward per
                      answer token over all of them (auto, the default: on a GPU; the CPU is faster
                      one example at a time)
  --encoder-layers N  for a fresh plug-in (default 4); --plugin FILE continues from a plug-in
  --cross-layers LIST for a fresh plug-in: the decoder layers its cross blocks run before
  --init first|spread|reads|joint fresh plug-in: copies of the first decoder layers, cross blocks
                      after them (default) or at --cross-layers, each with its decoder layer's
                      attention; or copies of the layers the blocks are spread over; or reads
                      (as plugin init --init reads or joint, at --cross-layers)
  --documents-after-prefix 0|1  joint: as plugin init (default 0)
  --consecutive-documents 0|1   joint: as plugin init (default 0)
  --seed N            data order and initialisation (default 0)
  --cache-dtype T     the plug-in's cache dtype (as plugin convert sets it), and training reads
                      each document's K/V as that dtype keeps them (forward: the stored numbers;
                      backward: straight through); default: as computed, the dtype unchanged
  --reading-check 0|1 also score each batch with the documents swapped between its examples (no
                      gradient; loss.csv's ce_swapped against ce shows reading) (default 0)
  --dev FILE:N|FILE:A-B  a held-out check along the run: greedy answers (comb) on the first N items
                      of FILE (or items A to B-1), scored as eval scores them, rows in DIR/dev.csv;
                      items of a --data file must be held out (--holdout FILE:M, M >= N or B)
  --dev-every N       steps between dev checks, and at the last (default: --save-every)
  --dev-tokens N      greedy tokens per dev answer (default 32)
  --save-every N (200)  --log-every N (10)  --resume 0|1 (1)

make-data options (docs/data.md):
  --kind codeword     (default) generated: notes "The secret code word of <name> is <word>."
    --out FILE  --items N (1000)  --seed N (0)
    --split train|test  test items use words (answers) that train items never use
    --answer-form short|sentence  short (default): the answer alone; sentence: a whole sentence
                        first ("The secret code word of Anna is apple."), the short answer second
                        (train takes the first as its target, eval accepts either)
  --kind records      generated: --docs (8) staff records of look-alike people, one attribute of
                      one person asked; --out, --items, --seed, --split and --answer-form as for
                      codeword ("Anna Keller was born in Lyon."); test items use names, cities,
                      jobs and instruments that train items never use
  --kind long-records generated: --min-docs to --max-docs (12 to 24) files of essay paragraphs,
                      --records (8) of them holding look-alike staff records, one or two the asked
                      person's; --essays DIR and the rest as for records
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
  --batch-decode LIST    also the serving engine's batched decoding step with each number of
                         sequences running (128-token prompts, --decode-tokens each)
  --temperature T, --top-p P  with --batch-decode: every row samples (temperature T, top-p P, a seed a
                         row) instead of taking the argmax (default 0: greedy)
  --sample N             also time N draws of a token from the model's logits (--temperature, default
                         1, and --top-p) against the same draws ordering the whole vocabulary
                         (default 0: off)
  --store-put N          also time N put() calls of a document's cache (the decoder's K/V of 128
                         tokens) into a store with a disk tier in a new folder under --cache-dir
                         (default: the temporary folder), its writes queued (256 MiB) against
                         waited for one by one (as with --cache-queue-mb 0), alternated (default 0: off)
  --repeat N             runs per figure; the median is reported (default 3)
  --profile 0|1          also profile --decode-tokens decode steps: time per step by operation (its own
                         time, without the operations it calls), and the time outside every operation
                         (the decoder's own C++ between them); with --pic-data, each method's cold
                         and warm requests once more over the items, time per request by operation
                         (host time: on a GPU, launches and waits), after cold requests over as many
                         further items of the file, of lengths not met before; on a GPU the profiled
                         decode steps are also a device profiler's range (cudaProfilerStart/Stop:
                         ncu --profile-from-start off; bench/decode_kernels.py) (default 0)
  --pic-data FILE        instead: caching methods' TTFT on QA items (data format) in one process,
                         the methods alternated item by item: each item cold, then warm --repeat
                         times; p50s and the per-item ratio against the first method; and each
                         warm request against the prefill of the tokens it computed alone (a fresh
                         cache, the first token read back)
  --pic-items N          items of --pic-data (default 20)
  --device-cache-mb N    with --pic-data on a GPU: the document store's device tier in MiB (default: the
                         store's whole budget, 4096); smaller than an item's documents, its warm requests
                         read the rest from the host tier behind it (page-locked with
                         COMB_CUDA_PINNED_HOST=1), and the hits of each tier are printed
  --pic-methods LIST     methods, comma separated (default naive,comb; comb uses the shipped plug-in
                         unless --plugin names another)
  --json                 one JSON object per figure

serve options (with the model options above; docs/serving.md):
  --host ADDR            address to listen on (default 127.0.0.1)
  --port N               port (default 8000; 0: any free port, see --port-file)
  --port-file FILE       write the port listened on into FILE once listening
  --served-model-name S[,ALIAS...]  the model's name in the API, then other names requests may use
                         (listed by /v1/models; answers carry the first) (default: the model file's
                         name without extension)
  --method M             the default caching method, a request's "method" overrides it: comb (default
                         with a plug-in), naive (default without), epic, cacheblend, prefix, full
  --max-running N        requests decoding together, one batched step (default 16)
  --max-queued N         requests waiting beyond them; more get 429 with Retry-After (default 64)
  --max-tokens-in-flight N  prompt + max_tokens summed over admitted requests (default: the pool's size)
  --kv-mb N              memory of the K/V block pool, allocated at start (default 1024 on the CPU;
                         on a GPU 90% of its free memory less twice --cache-mb and 2048, at least 1024)
  --block-tokens N       tokens per K/V block (default 16)
  --prefill-chunk N      prompt or document tokens computed between two decoding steps, at most
                         (default 256 on the CPU, 2048 on a GPU; a request's first piece is 64
                         tokens on the CPU, a quarter of N on a GPU)
  --piece-ms MS          a prompt or document piece is sized to take about MS (from its last piece's
                         time and tokens): about the longest a new request waits (default 100;
                         0: --prefill-chunk tokens each)
  --prefill-share R      while requests decode, a piece's t ms are owed to them: they decode t / R ms
                         before the next piece of work under way (which waits at most --piece-ms / R),
                         so a long prompt slows their tokens by about 1 + R (default 0.3; 0: a piece
                         between every two decoding steps)
  --mixed-step 0|1       off the CPU's fused kernels (a GPU's server), a prompt's piece goes through
                         the decoding step's forward beside the decoding rows (default 1)
  --max-documents N      documents per request (default 32)
  --max-request-document-tokens N  tokens of all a request's documents, cached or not; more get
                         413 (default 16384)
  --max-connections N    connections served at once; more are answered 503 and closed (default 256)
  --max-connections-per-client N  from one address; more are answered 429 and closed (default 128)
  --request-timeout S    a request's line, headers and body must arrive within S seconds of its
                         first byte, else 408 and the connection closes (default 10)
  --allowed-origins LIST origins (scheme://host:port, comma separated; * any) whose web pages may call
                         the server; a request with another Origin header gets 403 (default: none)
  --default-max-tokens N when a request gives no max_tokens (default 256, within the context)
  --cache-mb N, --cache-dir DIR, --cache-queue-mb N, --cache-url URL, --cache-ttl S, --cache-dtype T
                         the document store shared by all requests and methods (as for generate)
  --epic-k N, --blend-ratio R, --prefix-block N   the methods' options (as for eval)
  --drain-timeout S      after SIGTERM, how long requests in flight may take before being
                         cancelled (default 30)
  --log-requests 0|1     one line per request on stderr (default 1)

loadgen options (no model loaded; docs/benchmarks.md):
  --host ADDR, --port N  the server (default 127.0.0.1:8000)
  --data FILE            QA items (JSON Lines, gzip or plain); their documents are the shared pool
  --items N              the first N items (default 20)
  --methods A,B          caching methods, one run each per rate (default comb,prefix)
  --documents field|prompt  field (default): comb's 'documents' and 'method' fields; prompt: the
                         documents written into the user message (instruction, documents,
                         question: the text of comb's QA prompt), for any OpenAI-compatible server
                         (llama.cpp's llama-server); --methods then only labels the runs
  --rates R1,R2          Poisson arrival rates, requests per second (default 1)
  --concurrency N1,N2    instead of --rates: N closed-loop clients, each sending its next request when
                         its last is answered
  --prompt-words N       each request a user message of N words taken from the items' documents, with
                         no documents (a plain serving load; --methods default full)
  --duration S           seconds of arrivals per run (default 30); the run then waits for them
  --max-tokens N         per request (default 16)
  --temperature T        each request's sampling temperature (default 0: greedy; at most 2)
  --warm 0|1             before a method's runs, every item once (default 1)
  --served-model-name S  the model name to ask for (default: the one GET /v1/models lists)
  --seed N               arrivals, items and document orders (default 0)
  --json                 one JSON object per run
)";

}  // namespace comb::cli

using comb::Error;
using namespace comb::cli;

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
      comb::Model model = load_model(args, true, /*as_stored=*/true);
      return comb::cli::cmd_eval(args, model);
    }
    if (cmd == "attention") {
      Args args(argc, argv, 2, {});
      comb::Model model = load_model(args, true, /*as_stored=*/true);
      return comb::cli::cmd_attention(args, model);
    }
    if (cmd == "qa") {
      Args args(argc, argv, 2, {});
      comb::Model model = load_model(args, true, /*as_stored=*/true);
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
    if (cmd == "serve") {
      Args args(argc, argv, 2, {});
      return cmd_serve(args);
    }
    if (cmd == "loadgen") {
      Args args(argc, argv, 2, {"json"});
      return cmd_loadgen(args);
    }
    if (cmd == "bench") {
      Args args(argc, argv, 2, {"json"});
      return cmd_bench(args);
    }
    throw Error("unknown command '" + cmd + "' (expected generate, qa, eval, attention, report, train, make-data, plugin, bench, serve, loadgen or version)");
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

