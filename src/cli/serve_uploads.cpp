// `comb serve`'s documents (serve_uploads.hpp): uploads, their registry, and the tokens of every
// document a request names.
#include "serve_uploads.hpp"

#include <xxhash.h>

#include <algorithm>
#include <ctime>

#include "comb/documents.hpp"
#include "comb/model.hpp"
#include "comb/prompt.hpp"

namespace comb::cli {

using json = nlohmann::json;
using serve::ApiError;

Uploads::Uploads(const Model& model, ServeEngine& engine, const std::string& cache_dir)
    : model_(model), engine_(engine), registry_(cache_dir) {
  registry_.load(docs_, model.config().n_vocab, model.config().n_ctx, kMaxUploads);
}

std::vector<int32_t> Uploads::render(const std::string& title, const std::string& text) const {
  return qa_documents(model_, {{title, text}}).front();  // as every prompt holds it
}

json Uploads::to_json(const StoredDocument& d) {
  json j = {{"id", d.id}, {"object", "document"}, {"title", d.title}, {"tokens", d.tokens.size()},
            {"created", d.created}, {"methods", d.methods}};
  if (!d.salt.empty()) j["cache_salt"] = d.salt;
  return j;
}

void Uploads::check_room() const {
  if (static_cast<int64_t>(docs_.size()) >= kMaxUploads)
    throw ApiError(400, fmt::format("the server holds {} uploaded documents (the limit): delete some first",
                                    docs_.size()), "", "too_many_documents");
}

json Uploads::upload(const serve::DocumentUpload& u, Method method) {
  if (method == Method::full || method == Method::prefix)
    throw ApiError(400, fmt::format("method {} keeps no per-document cache: upload for comb, naive, epic or cacheblend",
                                    method_name(method)), "method");
  {
    std::lock_guard<std::mutex> lock(docs_mutex_);
    check_room();
  }
  StoredDocument d;
  d.tokens = render(u.title, u.text);
  if (method == Method::comb && model_.plugin()->config().max_document_tokens > 0 &&
      static_cast<int64_t>(d.tokens.size()) > model_.plugin()->config().max_document_tokens)
    throw ApiError(400, fmt::format("the document has {} tokens; the plug-in's encoder takes at most {}",
                                    d.tokens.size(), model_.plugin()->config().max_document_tokens), "text");
  d.id = fmt::format("doc-{:016x}", XXH3_64bits(d.tokens.data(), d.tokens.size() * sizeof(int32_t)));
  d.title = u.title;
  d.salt = u.cache_salt;
  d.created = std::time(nullptr);
  const bool computed = engine_.warm_document(d.tokens, method, u.cache_salt);  // outside the lock: long
  {
    std::lock_guard<std::mutex> lock(docs_mutex_);
    if (!docs_.count({d.salt, d.id})) check_room();
    auto& slot = docs_[{d.salt, d.id}];  // the same document again keeps the methods it was cached for
    d.methods = std::move(slot.methods);
    if (std::find(d.methods.begin(), d.methods.end(), method_name(method)) == d.methods.end())
      d.methods.push_back(method_name(method));
    slot = d;
    if (!registry_.put(d, docs_))
      fmt::print(stderr, "[serve] warning: cannot write the document registry '{}'\n", registry_.path());
  }
  json j = to_json(d);
  j["cached"] = !computed;
  return j;
}

json Uploads::list(const std::string& salt) {
  json data = json::array();
  std::lock_guard<std::mutex> lock(docs_mutex_);
  for (const auto& [key, d] : docs_)
    if (key.first == salt) data.push_back(to_json(d));
  return {{"object", "list"}, {"data", data}};
}

json Uploads::get(const std::string& salt, const std::string& id) {
  std::lock_guard<std::mutex> lock(docs_mutex_);
  auto it = docs_.find({salt, id});
  if (it == docs_.end()) throw ApiError(404, fmt::format("no document '{}'", id), "id");
  return to_json(it->second);
}

json Uploads::erase(const std::string& salt, const std::string& id) {
  std::lock_guard<std::mutex> lock(docs_mutex_);
  if (docs_.erase({salt, id}) == 0) throw ApiError(404, fmt::format("no document '{}'", id), "id");
  if (!registry_.erase(salt, id, docs_))
    fmt::print(stderr, "[serve] warning: cannot write the document registry '{}'\n", registry_.path());
  return {{"id", id}, {"object", "document"}, {"deleted", true}};
}

std::vector<int32_t> Uploads::tokens(const serve::DocumentRef& ref, size_t i, const std::string& salt) {
  if (ref.id.empty()) return render(ref.title, ref.text);
  std::lock_guard<std::mutex> lock(docs_mutex_);
  auto it = docs_.find({salt, ref.id});
  if (it == docs_.end())
    throw ApiError(400, fmt::format("documents[{}]: no document '{}' was uploaded with this cache_salt", i, ref.id),
                   fmt::format("documents[{}].id", i), "document_not_found");
  return it->second.tokens;
}

}  // namespace comb::cli
