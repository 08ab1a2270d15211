// comb plugin init | memory: writes a fresh plug-in; bytes per cached document token.
#include "commands.hpp"

namespace comb::cli {

namespace {
// How `plugin memory` and `plugin convert` name a plug-in's document span ("" when off).
std::string span_words(const comb::PluginConfig& p) {
  if (p.document_span <= 0) return "";
  return fmt::format(", their distances shrunk past {} tokens{}", p.document_span,
                     p.document_near > 0 ? fmt::format(" (kept up to {})", p.document_near) : "");
}
}  // namespace

int cmd_plugin_memory(Args& args) {
  // The shipped plug-in for the default model unless --plugin or --encoder-layers says otherwise.
  const bool fresh_layout = args.has("encoder-layers");
  comb::Model model = load_model(args, /*shipped_plugin=*/!fresh_layout);
  int64_t n_encoder = args.num<int64_t>("encoder-layers", 4);
  const int64_t n_doc = args.num<int64_t>("document-tokens", 128);
  COMB_CHECK(n_doc >= 1, "--document-tokens should be at least 1, found {}", n_doc);
  args.check_all_used();
  std::optional<comb::Plugin> fresh;  // with --encoder-layers (or no plug-in): a fresh one of that many
  const comb::Plugin* plugin = fresh_layout ? nullptr : model.plugin();
  if (!plugin) {
    comb::PluginInitOptions init;
    init.n_encoder_layers = n_encoder;
    plugin = &fresh.emplace(comb::Plugin::fresh(model.decoder(), init));
  }
  c10::InferenceMode guard;
  const auto& c = model.config();
  const auto& p = plugin->config();
  COMB_CHECK(n_doc <= p.max_document_tokens, "--document-tokens {}: the encoder takes at most {}", n_doc,
             p.max_document_tokens);
  // A document of n_doc tokens, encoded: what the store would hold for it.
  std::vector<int32_t> doc;
  for (int64_t i = 0; i < n_doc; ++i) doc.push_back(static_cast<int32_t>(1000 + (i * 7919) % 20000));
  comb::DocumentKV kv = plugin->encode(model.decoder(), doc);
  const double decoder_fp32 = 2.0 * c.n_layer * c.kv_dim() * 4;  // the decoder's own K/V, float32
  fmt::print("plug-in: {}, {} cross blocks at decoder layers {}; encoder: {} layers, {} (L_E/L = {}/{} = {:.4f}){}{}\n",
             model.plugin() && !fresh_layout ? "loaded" : "fresh", p.n_blocks(), fmt::join(p.cross_layers, ","),
             p.n_encoder_layers(), p.encoder_from_base ? "the base's first ones" : "its own", p.n_encoder_layers(),
             c.n_layer, double(p.n_encoder_layers()) / c.n_layer,
             !p.joint_attention ? ""
             : p.documents_after_prefix ? (p.consecutive_documents ? ", joint, documents in a row after the prefix"
                                                                   : ", joint, documents after the prefix")
                                        : (p.consecutive_documents ? ", joint, documents in a row" : ", joint"),
             span_words(p));
  fmt::print("bytes per cached token of a {}-token document (int8, int4: scales included), against the decoder's "
             "float32 K/V ({:.0f} bytes/token); kept by default (--cache-dtype auto) in {}\n\n",
             n_doc, decoder_fp32, p.cache_dtype.empty() ? "float32" : p.cache_dtype);
  fmt::print("| cache dtype | decoder KV bytes/token | COMB bytes/token | vs decoder KV, same dtype | "
             "vs decoder KV, float32 |\n|---|---:|---:|---:|---:|\n");
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kChar, comb::kCacheInt8Int4, comb::kCacheInt4}) {
    if (dtype == comb::kCacheInt4 && !comb::DocumentKV::rotates_int4_keys(c.head_dim)) {  // rotated keys need 2^k
      fmt::print("| int4 | - | - | - | - (keys rotated by a Walsh-Hadamard matrix: head_dim {} is not a power of "
                 "two) |\n",
                 c.head_dim);
      continue;
    }
    comb::DocumentKV stored = kv.to(c10::kCPU, dtype);
    double comb_bytes = double(stored.bytes()) / n_doc;
    double decoder_bytes =
        double(comb::DocumentKV::storage_bytes(dtype, c.n_layer, c.n_head_kv, c.head_dim, n_doc)) / n_doc;
    fmt::print("| {} | {:.0f} | {:.0f} | {:.1f}% | {:.1f}% |\n", comb::cache_dtype_name(dtype), decoder_bytes,
               comb_bytes, 100 * comb_bytes / decoder_bytes, 100 * comb_bytes / decoder_fp32);
  }
  return 0;
}

// A plug-in written again: its weights in --save-dtype, its declared cache dtype set.
int cmd_plugin_convert(Args& args) {
  const std::string in = args.str("plugin"), out = args.str("out");
  COMB_CHECK(!in.empty() && !out.empty(), "plugin convert needs --plugin FILE and --out FILE");
  COMB_CHECK(!std::filesystem::exists(out) || !std::filesystem::equivalent(in, out), "plugin convert: --out '{}' is the input; name another file",
             out);
  const c10::ScalarType save = parse_dtype(args.str("save-dtype", "bfloat16"));
  const bool set_cache = args.has("cache-dtype");
  const std::string cache = args.str("cache-dtype");
  const bool set_span = args.has("document-span");
  const int64_t span = args.num<int64_t>("document-span", 0);
  COMB_CHECK(span >= 0, "plugin convert: --document-span expects 0 (off) or a number of tokens, found {}", span);
  const int64_t near = args.num<int64_t>("document-near", 0);
  COMB_CHECK(!args.has("document-near") || set_span, "plugin convert: --document-near goes with --document-span");
  const bool cut = args.has("keep-blocks");
  const std::string keep_list = args.str("keep-blocks");
  // Parsed before the model loads: every comma-separated item a block index (none empty);
  // with_blocks checks each against the plug-in's blocks.
  std::vector<int64_t> keep;
  if (cut) {
    COMB_CHECK(!keep_list.empty(), "plugin convert: --keep-blocks expects block indices, comma separated, found none");
    keep = comb::cli::parse_int_list(keep_list, "keep-blocks");
    for (int64_t k : keep)
      COMB_CHECK(k >= 0, "plugin convert: --keep-blocks expects block indices (0 and up), found {} in '{}'", k, keep_list);
  }
  comb::Model model = load_model(args);
  args.check_all_used();
  COMB_CHECK(model.plugin(), "plugin convert: no plug-in loaded from '{}'", in);
  comb::Plugin plugin = *model.plugin();
  if (cut) {
    const int64_t before = plugin.config().n_blocks(), depth = plugin.config().n_encoder_layers();
    plugin = plugin.with_blocks(keep, model.decoder());
    fmt::print(stderr, "[comb] kept {} of {} cross blocks (before layers {}), the encoder {} of {} layers deep\n",
               plugin.config().n_blocks(), before, fmt::join(plugin.config().cross_layers, ","),
               plugin.config().n_encoder_layers(), depth);
  }
  if (set_cache) plugin.set_cache_dtype(cache);
  if (set_span) plugin.set_document_span(span, near);
  plugin.save(out, save);
  fmt::print(stderr, "[comb] wrote {} ({} weights, documents cached in {} by default{})\n", out, c10::toString(save),
             plugin.config().cache_dtype.empty() ? "float32" : plugin.config().cache_dtype,
             span_words(plugin.config()));
  return 0;
}

int cmd_plugin(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[2]) == "memory") {
    Args args(argc, argv, 3, {});
    return cmd_plugin_memory(args);
  }
  if (argc >= 3 && std::string(argv[2]) == "convert") {
    Args args(argc, argv, 3, {});
    return cmd_plugin_convert(args);
  }
  if (argc < 3 || std::string(argv[2]) != "init")
    throw Error("usage: comb plugin init --out FILE [options] | comb plugin memory [--plugin FILE | --encoder-layers N] "
                "| comb plugin convert --plugin FILE --out FILE [--save-dtype T] [--cache-dtype T] [--keep-blocks LIST] "
                "[--document-span N [--document-near N]]");
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
  init.consecutive_documents = args.num<int>("consecutive-documents", 0) != 0;
  if (init.consecutive_documents && !init.joint_attention)
    throw Error("--consecutive-documents 1 is a layout of --init joint");
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

}  // namespace comb::cli
