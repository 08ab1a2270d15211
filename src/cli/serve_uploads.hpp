#pragma once
// `comb serve`'s documents: what the server keeps of each uploaded one (StoredDocument), their
// registry on disk beside the store's disk tier (Registry), and the room that owns both (Uploads:
// the /v1/documents handlers' work, and the tokens of every document a request names).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <mutex>

#include "comb/detail/json.hpp"
#include "comb/detail/mapped_file.hpp"
#include "comb/error.hpp"
#include "comb/serving.hpp"
#include "serve_api.hpp"

namespace comb::cli {

struct StoredDocument {
  std::string id, title, salt;
  std::vector<int32_t> tokens;
  int64_t created = 0;
  std::vector<std::string> methods;  // whose caches were computed on upload
};

// The uploaded documents' registry kept beside the disk tier (--cache-dir), so that ids outlive a
// restart as their caches do: a log of one JSON line per upload or delete, appended and flushed
// before the request is answered, replayed and rewritten compact at start. A line cut short by a
// kill is dropped; any other line that does not read is skipped with a warning.
class Registry {
 public:
  Registry() = default;
  explicit Registry(std::string dir) : path_(dir.empty() ? "" : dir + "/documents.jsonl") {}
  bool enabled() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

  using Docs = std::map<std::pair<std::string, std::string>, StoredDocument>;

  // Replays the log into `docs` (ids with more than `max_tokens` tokens or ids outside the
  // vocabulary are dropped) and rewrites it with one line per document.
  void load(std::map<std::pair<std::string, std::string>, StoredDocument>& docs, int64_t n_vocab, int64_t max_tokens,
            int64_t max_documents) {
    if (!enabled() || !std::filesystem::exists(path_)) return;
    std::ifstream in(path_);
    COMB_CHECK(in.good(), "cannot read the document registry '{}'", path_);
    std::string line;
    int64_t number = 0, skipped = 0;
    while (std::getline(in, line)) {
      ++number;
      if (line.empty()) continue;
      try {
        const nlohmann::json j = detail::parse_json(line, fmt::format("'{}' line {}", path_, number));
        const std::pair<std::string, std::string> key{j.at("salt").get<std::string>(), j.at("id").get<std::string>()};
        if (j.at("op") == "delete") {
          docs.erase(key);
          continue;
        }
        StoredDocument d;
        d.salt = key.first;
        d.id = key.second;
        d.title = j.at("title").get<std::string>();
        d.created = j.at("created").get<int64_t>();
        d.methods = j.at("methods").get<std::vector<std::string>>();
        d.tokens = j.at("tokens").get<std::vector<int32_t>>();
        COMB_CHECK(!d.tokens.empty() && static_cast<int64_t>(d.tokens.size()) <= max_tokens, "{} tokens", d.tokens.size());
        for (int32_t t : d.tokens) COMB_CHECK(t >= 0 && t < n_vocab, "token {} outside the vocabulary", t);
        if (static_cast<int64_t>(docs.size()) < max_documents || docs.count(key)) docs[key] = std::move(d);
      } catch (const std::exception& e) {
        ++skipped;
        if (in.peek() != EOF)  // the last line may have been cut short by a kill: not worth a warning
          fmt::print(stderr, "[serve] warning: '{}' line {} skipped: {}\n", path_, number, std::string(e.what()).substr(0, 200));
      }
    }
    in.close();
    compact(docs);
    fmt::print(stderr, "[serve] {} uploaded documents from {} ({} lines skipped)\n", docs.size(), path_, skipped);
  }

  // Appends and flushes one change (`docs` already holds it); false when the registry could not be
  // written. A log grown past twice its compact size (and 16 MiB) is rewritten compact, so that
  // the same upload repeated cannot grow it without bound.
  bool put(const StoredDocument& d, const Docs& docs) { return append(line_of(d), docs); }
  bool erase(const std::string& salt, const std::string& id, const Docs& docs) {
    return append(line_json({{"op", "delete"}, {"salt", salt}, {"id", id}}), docs);
  }

 private:
  void compact(const Docs& docs) {
    std::string text;
    for (const auto& [key, d] : docs) text += line_of(d) + "\n";
    detail::write_file_atomic(path_, text, 0600);
    compact_bytes_ = static_cast<int64_t>(text.size());
    appended_bytes_ = 0;
  }
  bool append(const std::string& line, const Docs& docs) {
    if (!enabled()) return true;
    appended_bytes_ += static_cast<int64_t>(line.size()) + 1;
    // After a failed append (a line perhaps written in part) the file is rewritten whole, so that
    // the next line does not join that fragment.
    if (broken_ || appended_bytes_ > std::max<int64_t>(int64_t(16) << 20, 2 * compact_bytes_)) {
      try {
        compact(docs);
        broken_ = false;
        return true;
      } catch (const Error&) {
        broken_ = true;
        return false;
      }
    }
    broken_ = !append_line(line);
    return !broken_;
  }
  int64_t compact_bytes_ = 0, appended_bytes_ = 0;
  bool broken_ = false;
  static std::string line_of(const StoredDocument& d) {
    return line_json({{"op", "put"}, {"salt", d.salt}, {"id", d.id}, {"title", d.title}, {"created", d.created},
                      {"methods", d.methods}, {"tokens", d.tokens}});
  }
  bool append_line(const std::string& line) {
    FILE* f = std::fopen(path_.c_str(), "a");
    if (!f) return false;
    const bool ok = std::fwrite(line.data(), 1, line.size(), f) == line.size() && std::fputc('\n', f) != EOF &&
                    std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
    return std::fclose(f) == 0 && ok;
  }
  static std::string line_json(const nlohmann::json& j) {
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  std::string path_;
};

// The server's documents: those uploaded (by cache salt and id, kept in the registry) and the
// tokens of any document a request names, uploaded or given in full, rendered in one place.
// Thread-safe: the HTTP handlers call it at once.
class Uploads {
 public:
  static constexpr int64_t kMaxUploads = 100000;  // entries of the registry

  // Loads the registry kept in `cache_dir` ("" : none, uploads last as long as the process).
  Uploads(const Model& model, ServeEngine& engine, const std::string& cache_dir);

  // POST /v1/documents: the document's tokens, its cache computed for `method` (comb, naive, epic
  // or cacheblend) unless the store holds it, registered under its id; the answer's JSON. Throws
  // ApiError (too many documents, a document longer than the plug-in's encoder takes).
  nlohmann::json upload(const serve::DocumentUpload& u, Method method);
  // GET /v1/documents, GET and DELETE /v1/documents/{id} (404 for an unknown id).
  nlohmann::json list(const std::string& salt);
  nlohmann::json get(const std::string& salt, const std::string& id);
  nlohmann::json erase(const std::string& salt, const std::string& id);

  // The tokens of a request's document `i`: an uploaded one's (under `salt`; 400 if there is none)
  // or one given in full, rendered as every prompt holds it.
  std::vector<int32_t> tokens(const serve::DocumentRef& ref, size_t i, const std::string& salt);

 private:
  std::vector<int32_t> render(const std::string& title, const std::string& text) const;
  static nlohmann::json to_json(const StoredDocument& d);
  void check_room() const;  // docs_mutex_ held

  const Model& model_;
  ServeEngine& engine_;
  std::mutex docs_mutex_;
  Registry::Docs docs_;  // (salt, id)
  Registry registry_;
};

}  // namespace comb::cli
