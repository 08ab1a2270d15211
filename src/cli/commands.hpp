#pragma once
// The commands of the `comb` tool, one file each (generate.cpp, qa.cpp, eval.cpp, report.cpp,
// train.cpp, make_data.cpp, plugin.cpp, bench.cpp; main.cpp dispatches), and what they share
// (common.cpp). Precompiled for every file of the tool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "args.hpp"
#include "comb/comb.hpp"
#include "comb/detail/mapped_file.hpp"

namespace comb::cli {

// ---- The commands ----------------------------------------------------------------------------
int cmd_generate(Args& args);                 // generate.cpp
int cmd_qa(Args& args, Model& model);         // qa.cpp
int cmd_eval(Args& args, Model& model);       // eval.cpp
int cmd_attention(Args& args, Model& model);  // attention.cpp
int cmd_report(std::vector<std::string> args);  // report.cpp
int cmd_train(Args& args, Model& model);      // train.cpp
int cmd_make_data(Args& args);                // make_data.cpp
int cmd_plugin(int argc, char** argv);        // plugin.cpp: plugin init, plugin memory
int cmd_bench(Args& args);                    // bench.cpp
int cmd_serve(Args& args);                    // serve.cpp: the HTTP server
int cmd_loadgen(Args& args);                  // loadgen.cpp: load for the server
extern const char* const kUsage;              // main.cpp: the help text

// ---- Shared (common.cpp) ---------------------------------------------------------------------
// $COMB_MODEL, else the model the set-up installed.
std::string default_model();
// The trained plug-in shipped for the default model (docs/training.md), used by eval, qa and
// generate when neither --model nor COMB_MODEL names another model and no --plugin is given.
std::string default_plugin();
// Checks the options' input files and numbers, then loads the model (--model, --device, --dtype,
// --quantize, --threads, --cpu-kernels, --plugin). `shipped_plugin`: apply default_plugin() to
// the default model when no --plugin is given.
// `as_stored`: --quantize defaults to auto (a GGUF file's quantized matrices kept as stored on the
// CPU), else to none (every weight expanded: training, plug-in tools).
Model load_model(Args& args, bool shipped_plugin = false, bool as_stored = false);
// The caching methods' options (--epic-k, --blend-ratio, --check-layer, --prefix-block) over `o`:
// eval, bench --pic-data and serve read them alike.
PicOptions pic_method_options(Args& args, PicOptions o = {});
// --cache-queue-mb N in bytes (default 256 MiB): the document store's disk writes that may wait for
// its writer thread (StoreOptions::disk_queue_bytes).
int64_t cache_queue_bytes(Args& args);
// "1m05s", "2h03m".
std::string clock_text(double seconds);
// "nq-multidoc-10.dev" for ".../nq-multidoc-10.dev.jsonl.gz".
std::string data_name(const std::string& path);
// A --document FILE as a QaDocument: its title from the file name, its text without trailing
// blanks (refused when empty).
QaDocument read_document(const std::string& path);
// One request timed cold (nothing cached, to its first token only: decoding on would repeat the
// warm answer) and warm (the documents already cached). Warm follows a priming
// request (the same documents in another order, another question) when `prime_all` is set or
// the method is `prefix`, whose cache depends on order. Without `prime_all`, the per-document
// methods run warm right after cold: each document's cache is computed alone from position 0, so
// what the cold request cached is what any other request would have (tested in test_pic.cpp), and
// `full`, which caches nothing, runs once and reports that request as both.
struct ColdWarm {
  GenerationResult cold, warm;
  PicCounts cold_counts, warm_counts;
};
ColdWarm run_cold_warm(PicEngine& engine, const PicRequest& request, const PicRequest& priming,
                       const GenerateOptions& gen, bool prime_all);
// One summary of `comb eval --out` rows (one method, one data file).
nlohmann::json summarize_eval(const std::vector<nlohmann::json>& rows, const std::string& where);

}  // namespace comb::cli
