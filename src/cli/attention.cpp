// comb attention: where the row that predicts an answer's first token looks, with every document
// in the context (full) and with the documents linked through the plug-in (comb).
#include <numeric>

#include "commands.hpp"

namespace comb::cli {

namespace {
// The last prompt row's attention at each of `layers`: the mass on each document (`spans` of the
// probabilities' columns at that layer) per head, [layer][document] of [n_head] (float64).
std::map<int64_t, std::vector<at::Tensor>> masses(
    const RowAttention& a, const std::vector<int64_t>& layers,
    const std::function<std::vector<std::pair<int64_t, int64_t>>(int64_t layer)>& spans) {
  std::map<int64_t, std::vector<at::Tensor>> m;
  for (int64_t layer : layers) {
    const at::Tensor p = a.probs[layer].to(at::kDouble);  // [n_head, columns]
    for (const auto& [at, len] : spans(layer)) m[layer].push_back(p.narrow(1, at, len).sum(1));
  }
  return m;
}

// Documents of `lens` tokens laid one after another from column `at`: [first column, length].
std::vector<std::pair<int64_t, int64_t>> consecutive(const std::vector<int64_t>& lens, int64_t at) {
  std::vector<std::pair<int64_t, int64_t>> s;
  for (int64_t len : lens) s.emplace_back(at, len), at += len;
  return s;
}

// A CSV field: quoted, its quotes doubled (ids are data).
std::string csv_field(const std::string& text) {
  std::string out = "\"";
  for (char ch : text) out += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return out + "\"";
}

// A layer's figures from its per-head masses [document] of [n_head].
struct LayerFigures {
  double documents = 0, share = 0, best = 0;  // heads averaged: the documents' mass, the gold's share of it;
  bool first = false;                         // the best head's gold share; gold has the most (heads averaged)
  LayerFigures(const std::vector<at::Tensor>& docs, int64_t gold) {
    const at::Tensor per_head = at::stack(docs, 1);  // [n_head, documents]
    const at::Tensor mean = per_head.mean(0), all = per_head.sum(1);
    documents = mean.sum().item<double>();
    share = documents > 0 ? mean[gold].item<double>() / documents : 0.0;
    first = mean.argmax().item<int64_t>() == gold;
    best = (per_head.select(1, gold) / all.clamp_min(1e-30)).max().item<double>();
  }
};

// One method's figures for an item: per layer read, and averaged over them.
struct Figures {
  std::map<int64_t, LayerFigures> layers;
  double documents = 0, share = 0, first = 0, best = 0;
  Figures(const std::map<int64_t, std::vector<at::Tensor>>& m, int64_t gold) {
    for (const auto& [layer, docs] : m) {
      const LayerFigures& f = layers.emplace(layer, LayerFigures(docs, gold)).first->second;
      documents += f.documents, share += f.share, first += f.first, best += f.best;
    }
    const double n = double(m.size());
    documents /= n, share /= n, first /= n, best /= n;
  }
};

struct Row {  // one item
  int64_t gold_tokens = 0, document_tokens = 0;
  Figures full, comb;
};

struct Group {
  int64_t items = 0;
  double full_documents = 0, full_share = 0, full_first = 0, full_best = 0, comb_documents = 0, comb_share = 0,
         comb_first = 0, comb_best = 0, uniform = 0;
  void add(const Row& r) {
    ++items;
    full_documents += r.full.documents, full_share += r.full.share, full_first += r.full.first;
    full_best += r.full.best;
    comb_documents += r.comb.documents, comb_share += r.comb.share, comb_first += r.comb.first;
    comb_best += r.comb.best;
    uniform += double(r.gold_tokens) / double(r.document_tokens);
  }
  void print(const std::string& name) const {
    if (items == 0) return;
    const double n = double(items);
    fmt::print("| {} | {} | {:.3f} | {:.3f} | {:.1f}% | {:.3f} | {:.3f} | {:.3f} | {:.1f}% | {:.3f} | {:.3f} |\n",
               name, items, full_documents / n, full_share / n, 100 * full_first / n, full_best / n,
               comb_documents / n, comb_share / n, 100 * comb_first / n, comb_best / n, uniform / n);
  }
};
}  // namespace

int cmd_attention(Args& args, Model& model) {
  const std::string data = args.str("data");
  COMB_CHECK(!data.empty(), "attention needs --data FILE (JSON Lines, optionally gzip, items with gold_index)");
  const int64_t limit = args.num<int64_t>("limit", 0);
  const int64_t offset = args.num<int64_t>("offset", 0);
  COMB_CHECK(limit >= 0 && offset >= 0, "--limit and --offset must be >= 0 (found {} and {})", limit, offset);
  const std::string out_path = args.str("out");
  StoreOptions store_options;
  store_options.dtype = parse_cache_dtype(args.str("cache-dtype", "auto"));
  args.check_all_used();
  const Plugin* plugin = model.plugin();
  COMB_CHECK(plugin && plugin->config().joint_attention,
             "attention compares the documents' share of one softmax: it needs a plug-in whose blocks join their "
             "layers' attention (the shipped one does; --plugin FILE)");

  auto items = read_qa_items(data, limit > 0 ? offset + limit : 0);
  COMB_CHECK(offset < static_cast<int64_t>(items.size()), "--offset {} is past the last item of '{}' ({} items)",
             offset, data, items.size());
  const size_t end = limit > 0 ? std::min<size_t>(offset + limit, items.size()) : items.size();
  for (size_t k = offset; k < end; ++k)
    COMB_CHECK(items[k].gold_index >= 0 && items[k].gold_index < static_cast<int64_t>(items[k].documents.size()),
               "'{}' item {} (id '{}') has no gold_index among its {} documents: the gold document's share needs one",
               data, k, items[k].id, items[k].documents.size());
  std::ofstream out;
  if (!out_path.empty()) {
    out.open(out_path);
    COMB_CHECK(out.good(), "cannot write '{}'", out_path);
    out << "index,id,documents,gold,gold_tokens,document_tokens,full_documents,full_gold_share,full_gold_first,"
           "full_best_head,comb_documents,comb_gold_share,comb_gold_first,comb_best_head\n";
  }

  c10::InferenceMode guard;
  const Decoder& decoder = model.decoder();
  Documents documents(model, std::make_shared<PICacheStore>(store_options));
  const int64_t n_layer = model.config().n_layer;
  std::vector<int64_t> read_layers;  // the layers whose attention reads COMB's documents
  std::vector<double> layer_full(n_layer, 0), layer_comb(n_layer, 0), layer_full_docs(n_layer, 0),
      layer_comb_docs(n_layer, 0), layer_full_best(n_layer, 0), layer_comb_best(n_layer, 0);
  Group all, by_position[3];
  std::map<int64_t, Group> by_count;
  const bool tty = ::isatty(fileno(stderr));
  auto t_start = std::chrono::steady_clock::now();
  for (size_t k = offset; k < end; ++k) {
    const QaItem& item = items[k];
    try {  // a failure names its item
      const PicRequest request = qa_request(model, item.documents, item.question);
      const int64_t n_docs = static_cast<int64_t>(request.documents.size()), gold = item.gold_index;
      const int64_t prefix = static_cast<int64_t>(request.prefix.size());
      std::vector<int64_t> lens;
      for (const auto& d : request.documents) lens.push_back(static_cast<int64_t>(d.size()));

      // COMB: the prefix and question as the prompt, the documents linked after the prefix.
      const int64_t anchor = plugin->config().documents_after_prefix ? prefix : 0;
      std::vector<int32_t> prompt = request.prefix;
      prompt.insert(prompt.end(), request.suffix.begin(), request.suffix.end());
      LinkedDocuments linked = documents.link(documents.get(request.documents), anchor);
      DocumentReads reads = DocumentReads::joined(
          *plugin, plugin->joint_kv(plugin->weights(), linked.keys, linked.values, linked.doc_counts, anchor,
                                    linked.key_scales, linked.value_scales));
      const at::Tensor prompt_ids = token_ids(prompt, 0, static_cast<int64_t>(prompt.size())).to(decoder.device());
      RowAttention comb = row_attention(decoder, prompt_ids, &reads);
      if (read_layers.empty()) {
        for (int64_t l = 0; l < n_layer; ++l)
          if (comb.joined[l] > 0) read_layers.push_back(l);
        COMB_CHECK(!read_layers.empty(), "the plug-in's blocks read no documents at any layer");
      }
      const int64_t total = std::accumulate(lens.begin(), lens.end(), int64_t(0));
      auto joined_spans = [&](int64_t layer) {
        COMB_CHECK(comb.joined[layer] == total, "layer {} joins {} document keys, the documents have {} tokens", layer,
                   comb.joined[layer], total);
        return consecutive(lens, 0);
      };
      // full: every document in the context, after the prefix, in the same order.
      std::vector<int32_t> whole = request.tokens();
      RowAttention full =
          row_attention(decoder, token_ids(whole, 0, static_cast<int64_t>(whole.size())).to(decoder.device()), nullptr);
      auto context_spans = [&](int64_t) { return consecutive(lens, prefix); };
      const Row r{lens[gold], total, Figures(masses(full, read_layers, context_spans), gold),
                  Figures(masses(comb, read_layers, joined_spans), gold)};
      for (int64_t l : read_layers) {
        const LayerFigures &f = r.full.layers.at(l), &c = r.comb.layers.at(l);
        layer_full_docs[l] += f.documents, layer_comb_docs[l] += c.documents;
        layer_full[l] += f.share, layer_comb[l] += c.share;
        layer_full_best[l] += f.best, layer_comb_best[l] += c.best;
      }
      all.add(r);
      by_position[std::min<int64_t>(2, 3 * gold / n_docs)].add(r);
      by_count[n_docs <= 8 ? 8 : n_docs <= 16 ? 16 : 24].add(r);
      if (out.is_open()) {
        out << fmt::format("{},{},{},{},{},{},{:.6f},{:.6f},{:.6f},{:.6f},{:.6f},{:.6f},{:.6f},{:.6f}\n", k,
                           csv_field(item.id), n_docs, gold, r.gold_tokens, total, r.full.documents, r.full.share,
                           r.full.first, r.full.best, r.comb.documents, r.comb.share, r.comb.first, r.comb.best)
            << std::flush;
        COMB_CHECK(out.good(), "writing '{}' failed at item {} (is the disk full?)", out_path, k);
      }
    } catch (const std::exception& e) {
      if (tty) fmt::print(stderr, "\n");
      COMB_FAIL("'{}' item {} (id '{}'): {}", data, k, item.id, e.what());
    }
    const size_t done = k + 1 - offset, n_items = end - offset;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    if (tty || done % 10 == 0 || done == n_items)
      fmt::print(stderr, "{}[attention] {}/{} elapsed {} eta {}{}", tty ? "\r" : "", done, n_items,
                 clock_text(elapsed), clock_text(elapsed / done * (n_items - done)), tty ? "\x1b[K" : "\n");
  }
  if (tty) fmt::print(stderr, "\n");
  if (out.is_open()) {
    out.close();
    COMB_CHECK(!out.fail(), "writing '{}' failed when closing it (is the disk full?)", out_path);
  }
  fmt::print("{}: the last prompt row's attention (it predicts the answer's first token), heads averaged, over "
             "the {} layers that read COMB's documents ({}); documents: their part of the row's attention; gold "
             "share: the gold document's part of that; gold first: layers where the gold document has the most; "
             "best head: the largest gold share of one head's document mass in the layer; uniform: the gold "
             "document's part of the document tokens (heads averaged but for best head; means over layers, then "
             "items)\n\n",
             data_name(data), read_layers.size(), fmt::join(read_layers, ", "));
  fmt::print("| items | n | full: documents | full: gold share | full: gold first | full: best head | comb: documents "
             "| comb: gold share | comb: gold first | comb: best head | uniform |\n"
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  all.print("all");
  const char* thirds[3] = {"gold in the first third", "gold in the middle third", "gold in the last third"};
  for (int i = 0; i < 3; ++i) by_position[i].print(thirds[i]);
  for (const auto& [bound, g] : by_count)
    g.print(bound == 8 ? "1-8 documents" : bound == 16 ? "9-16 documents" : "17 or more documents");
  fmt::print("\n| layer | full: documents | full: gold share | full: best head | comb: documents | comb: gold share "
             "| comb: best head |\n|---:|---:|---:|---:|---:|---:|---:|\n");
  const double n = double(all.items);
  for (int64_t l : read_layers)
    fmt::print("| {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} |\n", l, layer_full_docs[l] / n,
               layer_full[l] / n, layer_full_best[l] / n, layer_comb_docs[l] / n, layer_comb[l] / n,
               layer_comb_best[l] / n);
  return 0;
}

}  // namespace comb::cli
