// comb plugin init | memory: writes a fresh plug-in; bytes per cached document token.
#include "commands.hpp"

namespace comb::cli {

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

}  // namespace comb::cli
