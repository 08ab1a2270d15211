// `comb make-data`: QA items in comb's data format (docs/data.md), generated (--kind codeword,
// records, long-records, needle) or made from the public source files of the evaluation sets
// (--kind nq-multidoc, --kind kv).
#include "commands.hpp"

namespace comb::cli {

namespace {

// The options of the generated kinds that take --split: --out, --items, --seed, --split, read and
// checked; `own` reads the kind's own options before the set is closed (check_all_used).
struct Generated {
  std::string out_path;
  int64_t n = 0;
  uint64_t seed = 0;
  std::string split;
  bool sentence = false;  // --answer-form sentence: the first answer a whole sentence, the short one second
};
Generated generated_options(Args& args, const std::function<void()>& own = {}) {
  Generated g{args.str("out"), args.num<int64_t>("items", 1000), 0, ""};
  g.seed = args.num<uint64_t>("seed", 0);
  g.split = args.str("split", "train");
  const std::string form = args.str("answer-form", "short");
  g.sentence = form == "sentence";
  if (own) own();
  args.check_all_used();
  COMB_CHECK(g.split == "train" || g.split == "test", "--split expects train or test, found '{}'", g.split);
  COMB_CHECK(form == "short" || form == "sentence", "--answer-form expects short or sentence, found '{}'", form);
  COMB_CHECK(!g.out_path.empty(), "make-data needs --out FILE");
  COMB_CHECK(g.n > 0, "--items must be > 0, found {}", g.n);
  return g;
}

// `comb make-data --kind codeword`: items whose answer is only in a document. Each has 1-3 notes "The
// secret code word of <name> is <word>." for different people and asks for one person's word, so
// the decoder cannot answer without reading (and picking) the right document. A quick check that a
// plug-in learns to read: the bare decoder guesses, full prefill copies. --split test draws its
// words from a quarter of the list that --split train never uses.
int make_codeword(Args& args) {
  const auto [out_path, n, seed, split, sentence] = generated_options(args);
  static const char* const names[] = {"Anna", "Ben",  "Clara", "David", "Emma", "Frank", "Grace",
                                      "Henry", "Iris", "Jack", "Kate", "Leo", "Mia", "Noah",
                                      "Olga", "Paul", "Rosa", "Sam", "Tina", "Victor"};
  static const char* const words[] = {
      "apple",   "river",   "candle",  "garden",  "pencil",  "mirror",  "window",  "basket",  "rocket",  "violin",
      "tiger",   "forest",  "bottle",  "castle",  "dragon",  "engine",  "feather", "guitar",  "hammer",  "island",
      "jacket",  "kettle",  "ladder",  "marble",  "needle",  "orange",  "parrot",  "pocket",  "rabbit",  "saddle",
      "tunnel",  "umbrella", "valley", "wallet",  "yellow",  "zebra",   "anchor",  "bridge",  "cactus",  "desert",
      "eagle",   "falcon",  "glacier", "harbor",  "jungle",  "koala",   "lemon",   "meadow",  "nickel",  "oyster",
      "pepper",  "quartz",  "ribbon",  "silver",  "thunder", "velvet",  "walnut",  "canyon",  "copper",  "cotton",
      "crystal", "diamond", "emerald", "fossil",  "galaxy",  "helmet",  "iceberg", "jasmine", "lantern", "magnet",
      "nectar",  "olive",   "pebble",  "planet",  "puzzle",  "saturn",  "shadow",  "spider",  "summer",  "sunset",
      "tomato",  "turtle",  "walrus",  "winter",  "wizard",  "blossom", "compass", "cookie",  "dolphin", "garlic",
      "hazel",   "insect",  "kitten",  "lobster", "mango",   "onion",   "panda",   "pirate",  "pumpkin", "robot",
      "salmon",  "tulip",   "vanilla", "wagon"};
  constexpr size_t n_names = sizeof(names) / sizeof(names[0]), n_all_words = sizeof(words) / sizeof(words[0]);
  // Disjoint words: every fourth word is a test word, so a test answer was never a training answer.
  std::vector<const char*> vocabulary;
  for (size_t w = 0; w < n_all_words; ++w)
    if ((w % 4 == 0) == (split == "test")) vocabulary.push_back(words[w]);
  const size_t n_words = vocabulary.size();
  std::mt19937_64 rng(seed);
  auto pick = [&](size_t count) { return static_cast<size_t>(rng() % count); };  // the same on every platform
  const std::string tmp = out_path + ".part";
  {
    std::ofstream out(tmp);
    COMB_CHECK(out.good(), "cannot write '{}'", tmp);
    for (int64_t i = 0; i < n; ++i) {
      const size_t n_docs = 1 + pick(3);
      std::vector<size_t> who, what;  // distinct people, distinct words
      while (who.size() < n_docs) {
        size_t a = pick(n_names), b = pick(n_words);
        if (std::find(who.begin(), who.end(), a) == who.end() && std::find(what.begin(), what.end(), b) == what.end())
          who.push_back(a), what.push_back(b);
      }
      const size_t gold = pick(n_docs);
      nlohmann::json docs = nlohmann::json::array();
      for (size_t d = 0; d < n_docs; ++d)
        docs.push_back({{"title", fmt::format("Note about {}", names[who[d]])},
                        {"text", fmt::format("The secret code word of {} is {}.", names[who[d]], vocabulary[what[d]])}});
      out << nlohmann::json{{"id", fmt::format("codeword-{}-{}-{}", split, seed, i)},
                            {"question", fmt::format("What is the secret code word of {}?", names[who[gold]])},
                            // the sentence form's first answer is the gold note's own sentence
                            {"answers", sentence ? nlohmann::json{docs[gold]["text"], vocabulary[what[gold]]}
                                                 : nlohmann::json{vocabulary[what[gold]]}},
                            {"documents", docs},
                            {"gold_index", gold}}
                 .dump()
          << "\n";
    }
    COMB_CHECK(out.good(), "writing '{}' failed", tmp);
  }
  std::filesystem::rename(tmp, out_path);
  fmt::print(stderr, "[comb] wrote {} codeword items ({} words, seed {}) to {}\n", n, split, seed, out_path);
  return 0;
}

// The staff-record kinds' lists: first and last names, cities, jobs, instruments. Every fourth
// entry of each belongs to the test split only, so no test person or answer was ever trained on.
struct RecordLists {
  std::vector<std::string> firsts, lasts, cities, jobs, instruments;
};
RecordLists record_lists(const std::string& split) {
  static const std::vector<std::string> firsts = {
      "Anna", "Ben", "Clara", "David", "Emma", "Felix", "Greta", "Hugo", "Ines", "Jonas", "Karin", "Lukas", "Maria",
      "Nils", "Olivia", "Peter", "Rita", "Simon", "Teresa", "Viktor", "Alma", "Bruno", "Carla", "Dario", "Elena",
      "Fabian", "Hanna", "Igor", "Julia", "Konrad", "Lena", "Marco"};
  static const std::vector<std::string> lasts = {
      "Keller", "Fischer", "Weber", "Wagner", "Becker", "Hoffmann", "Schulz", "Koch", "Richter", "Klein",
      "Wolf", "Neumann", "Schwarz", "Braun", "Zimmer", "Kruger", "Hartmann", "Lange", "Werner", "Krause",
      "Lehmann", "Kaiser", "Fuchs", "Vogel", "Jung", "Roth", "Frank", "Berger", "Winter", "Sommer", "Brandt", "Haas"};
  static const std::vector<std::string> cities = {
      "Lyon", "Porto", "Graz", "Turin", "Bergen", "Ghent", "Krakow", "Seville", "Tartu", "Aarhus", "Bilbao",
      "Brno", "Cork", "Dresden", "Geneva", "Leeds", "Malaga", "Nantes", "Padua", "Riga", "Salzburg", "Tampere",
      "Utrecht", "Verona", "Zagreb", "Basel", "Bruges", "Cadiz", "Lille", "Lund", "Parma", "Split", "Arles", "Bonn",
      "Coimbra", "Delft", "Espoo", "Faro", "Gdansk", "Hamar"};
  static const std::vector<std::string> jobs = {
      "pharmacist", "carpenter", "librarian", "pilot", "architect", "baker", "dentist", "electrician", "florist",
      "geologist", "jeweler", "locksmith", "mechanic", "nurse", "optician", "plumber", "surveyor", "tailor",
      "translator", "veterinarian", "welder", "zoologist", "chemist", "editor", "firefighter", "gardener",
      "historian", "journalist", "lawyer", "musician", "photographer", "sculptor", "accountant", "brewer",
      "cartographer", "dietitian", "engineer", "fisherman", "glazier", "hairdresser"};
  static const std::vector<std::string> instruments = {
      "cello", "violin", "flute", "trumpet", "harp", "oboe", "clarinet", "piano", "banjo", "accordion", "bassoon",
      "drums", "guitar", "mandolin", "saxophone", "trombone", "tuba", "ukulele", "viola", "xylophone", "organ",
      "harmonica", "lute", "sitar", "bagpipes", "cornet", "dulcimer", "euphonium", "fiddle", "glockenspiel",
      "harpsichord", "kazoo", "marimba", "ocarina", "piccolo", "recorder", "spinet", "tambourine", "vibraphone",
      "zither"};
  auto part = [&](const std::vector<std::string>& all) {
    std::vector<std::string> out;
    for (size_t i = 0; i < all.size(); ++i)
      if ((i % 4 == 0) == (split == "test")) out.push_back(all[i]);
    return out;
  };
  return {part(firsts), part(lasts), part(cities), part(jobs), part(instruments)};
}

// Whether `lists` hold k distinct records (names, cities, jobs, instruments).
bool records_fit(const RecordLists& l, int64_t k) {
  return static_cast<int64_t>(l.firsts.size() * l.lasts.size()) >= 2 * k &&
         static_cast<int64_t>(l.cities.size()) >= k && static_cast<int64_t>(l.jobs.size()) >= k &&
         static_cast<int64_t>(l.instruments.size()) >= k;
}

// k look-alike staff records ("Record: Anna Keller. Born in 1974 in Lyon. Works as a pharmacist.
// Plays the cello."), people whose first or last names repeat, and one attribute of one of them
// asked: the right record has to be told from its look-alikes by the whole name.
struct Records {
  std::vector<std::string> texts;
  size_t gold = 0;
  std::string question, said;  // said: the answer as a sentence
  std::vector<std::string> answers;
};
Records look_alike_records(const RecordLists& l, size_t k, const std::function<size_t(size_t)>& pick) {
  const auto &F = l.firsts, &L = l.lasts, &C = l.cities, &J = l.jobs, &I = l.instruments;
  auto distinct = [&](size_t count, size_t n) {  // n distinct indices of [0, count)
    std::vector<size_t> out;
    while (out.size() < n) {
      size_t x = pick(count);
      if (std::find(out.begin(), out.end(), x) == out.end()) out.push_back(x);
    }
    return out;
  };
  // Names from two or three first names and as many last names, so that each half of a name is
  // shared with another record; the full names are distinct.
  const auto fs = distinct(F.size(), 3), ls = distinct(L.size(), 3);
  std::vector<std::pair<size_t, size_t>> people;
  while (people.size() < k) {
    std::pair<size_t, size_t> who{fs[pick(3)], ls[pick(3)]};
    if (k > 9) who = {pick(F.size()), ls[pick(3)]};  // 3 x 3 names cover at most 9 records
    if (std::find(people.begin(), people.end(), who) == people.end()) people.push_back(who);
  }
  const auto city = distinct(C.size(), k), job = distinct(J.size(), k), inst = distinct(I.size(), k);
  std::vector<int> years;
  while (years.size() < k) {
    int y = 1950 + static_cast<int>(pick(50));
    if (std::find(years.begin(), years.end(), y) == years.end()) years.push_back(y);
  }
  Records r;
  auto name_of = [&](size_t d) { return F[people[d].first] + " " + L[people[d].second]; };
  auto job_of = [&](size_t d) {  // "a pharmacist", "an architect"
    return (std::string("aeiou").find(J[job[d]][0]) == std::string::npos ? "a " : "an ") + J[job[d]];
  };
  for (size_t d = 0; d < k; ++d)
    r.texts.push_back(fmt::format("Record: {}. Born in {} in {}. Works as {}. Plays the {}.", name_of(d), years[d],
                                  C[city[d]], job_of(d), I[inst[d]]));
  const size_t gold = r.gold = pick(k);
  const std::string name = name_of(gold);
  switch (pick(4)) {
    case 0: r.question = fmt::format("In which city was {} born?", name), r.answers = {C[city[gold]]};
            r.said = fmt::format("{} was born in {}.", name, C[city[gold]]); break;
    case 1: r.question = fmt::format("In which year was {} born?", name), r.answers = {std::to_string(years[gold])};
            r.said = fmt::format("{} was born in {}.", name, years[gold]); break;
    case 2: r.question = fmt::format("What does {} work as?", name), r.answers = {J[job[gold]]};
            r.said = fmt::format("{} works as {}.", name, job_of(gold)); break;
    default: r.question = fmt::format("Which instrument does {} play?", name), r.answers = {I[inst[gold]]};
             r.said = fmt::format("{} plays the {}.", name, I[inst[gold]]);
  }
  return r;
}

// `comb make-data --kind records`: documents that compete. Each item has --docs (default 8) staff
// records of the same shape (look_alike_records) and asks one attribute of one person. --split
// test draws every name and value from the quarter of each list that --split train never uses.
int make_records(Args& args) {
  int64_t n_docs = 8;
  const auto [out_path, n, seed, split, sentence] = generated_options(args, [&] { n_docs = args.num<int64_t>("docs", 8); });
  COMB_CHECK(n_docs >= 2 && n_docs <= 16, "--docs must be 2 to 16 for records, found {}", n_docs);
  const RecordLists lists = record_lists(split);
  COMB_CHECK(records_fit(lists, n_docs), "--docs {}: the {} split's lists are too short for that many distinct records",
             n_docs, split);
  std::mt19937_64 rng(seed);
  auto pick = [&](size_t count) { return static_cast<size_t>(rng() % count); };  // the same on every platform
  std::vector<QaItem> items;
  for (int64_t i = 0; i < n; ++i) {
    Records r = look_alike_records(lists, static_cast<size_t>(n_docs), pick);
    QaItem item;
    item.id = fmt::format("records-{}-{}-{}", split, seed, i);
    for (const auto& text : r.texts) item.documents.push_back({"Staff record", text});
    item.question = r.question;
    item.answers = r.answers;
    if (sentence) item.answers.insert(item.answers.begin(), r.said);
    item.gold_index = static_cast<int64_t>(r.gold);
    items.push_back(std::move(item));
  }
  write_qa_items(out_path, items);
  fmt::print(stderr, "[comb] wrote {} records items ({} split, {} documents each, seed {}) to {}\n", n, split, n_docs,
             seed, out_path);
  return 0;
}

// `comb make-data --kind long-records --essays DIR`: many long documents compete. Each item has
// --min-docs to --max-docs (default 12 to 24) staff files of one to three filler paragraphs (the
// essays of DIR, the split's own) each; --records of them (default 8) also hold a look-alike staff
// record, planted between paragraphs, and in half the items a second file repeats the asked
// person's record, so one or two documents hold the answer among 2,000 to 8,000 tokens. --split
// test draws names, values and filler that --split train never uses.
int make_long_records(Args& args) {
  std::string essays;
  int64_t min_docs = 12, max_docs = 24, n_records = 8;
  const auto [out_path, n, seed, split, sentence] = generated_options(args, [&] {
    essays = args.str("essays");
    min_docs = args.num<int64_t>("min-docs", min_docs);
    max_docs = args.num<int64_t>("max-docs", max_docs);
    n_records = args.num<int64_t>("records", n_records);
  });
  COMB_CHECK(!essays.empty(), "make-data --kind long-records needs --essays DIR (plain-text prose, *.txt)");
  COMB_CHECK(min_docs >= 2 && max_docs >= min_docs && max_docs <= 64,
             "--min-docs and --max-docs: need 2 <= min ({}) <= max ({}) <= 64", min_docs, max_docs);
  const RecordLists lists = record_lists(split);
  COMB_CHECK(n_records >= 2 && n_records < min_docs && records_fit(lists, n_records),
             "--records {}: needs 2 to --min-docs - 1 ({}) records that the {} split's lists can tell apart (at most 10 "
             "on test)", n_records, min_docs - 1, split);
  const auto paragraphs = essay_paragraphs(essays, 80, split);
  COMB_CHECK(!paragraphs.empty(), "make-data --kind long-records: no paragraphs in '{}' for the {} split", essays, split);
  std::mt19937_64 rng(seed);
  auto pick = [&](size_t count) { return static_cast<size_t>(rng() % count); };  // the same on every platform
  std::vector<QaItem> items;
  for (int64_t i = 0; i < n; ++i) {
    const size_t k = static_cast<size_t>(min_docs + static_cast<int64_t>(pick(max_docs - min_docs + 1)));
    Records r = look_alike_records(lists, static_cast<size_t>(n_records), pick);
    // What each file plants: record j (j < n_records), the asked record again, or nothing.
    std::vector<int64_t> plant(k, -1);
    for (size_t j = 0; j < r.texts.size(); ++j) plant[j] = static_cast<int64_t>(j);
    if (pick(2) == 1) plant[r.texts.size()] = static_cast<int64_t>(r.gold);
    for (size_t j = k - 1; j > 0; --j) std::swap(plant[j], plant[pick(j + 1)]);  // files in a drawn order
    QaItem item;
    item.id = fmt::format("long-records-{}-{}-{}", split, seed, i);
    item.gold_index = -1;
    for (size_t d = 0; d < k; ++d) {
      const size_t n_par = 1 + pick(3), at = pick(n_par + 1);
      std::string text;
      for (size_t p = 0; p <= n_par; ++p) {
        if (p == at && plant[d] >= 0) text += (text.empty() ? "" : "\n\n") + r.texts[plant[d]];
        if (p < n_par) text += (text.empty() ? "" : "\n\n") + paragraphs[pick(paragraphs.size())];
      }
      if (plant[d] == static_cast<int64_t>(r.gold) && item.gold_index < 0) item.gold_index = static_cast<int64_t>(d);
      item.documents.push_back({fmt::format("Staff file {}", d + 1), text});
    }
    item.question = r.question;
    item.answers = r.answers;
    if (sentence) item.answers.insert(item.answers.begin(), r.said);
    items.push_back(std::move(item));
  }
  write_qa_items(out_path, items);
  fmt::print(stderr, "[comb] wrote {} long-records items ({} split: {} paragraphs, {}-{} documents, {} records, seed {}) "
             "to {}\n", n, split, paragraphs.size(), min_docs, max_docs, n_records, seed, out_path);
  return 0;
}

// `comb make-data --kind nq-multidoc|kv --from SOURCE`: the source file converted (docs/data.md).
int make_from_source(Args& args, const std::string& kind) {
  const std::string from = args.str("from"), out_path = args.str("out");
  COMB_CHECK(!from.empty(), "make-data --kind {} needs --from FILE (the public source file, docs/data.md)", kind);
  COMB_CHECK(!out_path.empty(), "make-data needs --out FILE");
  COMB_CHECK(std::filesystem::exists(from), "--from: '{}' does not exist", from);
  std::vector<QaItem> items;
  if (kind == "nq-multidoc") {
    NqMultidocOptions o;
    o.documents = args.num<int64_t>("docs", o.documents);
    o.seed = args.num<uint64_t>("seed", o.seed);
    o.items = args.num<int64_t>("items", o.items);
    o.id_prefix = args.str("id-prefix", o.id_prefix);
    args.check_all_used();
    COMB_CHECK(o.documents >= 1, "--docs must be >= 1 (the gold passage), found {}", o.documents);
    COMB_CHECK(o.items >= 0, "--items must be >= 0 (0: all), found {}", o.items);
    items = nq_multidoc_items(from, o);
    fmt::print(stderr, "[comb] wrote {} nq-multidoc items ({} documents each, seed {}) from {} to {}\n", items.size(),
               o.documents, o.seed, from, out_path);
  } else {
    KvRetrievalOptions o;
    o.pairs_per_document = args.num<int64_t>("pairs-per-document", o.pairs_per_document);
    o.items = args.num<int64_t>("items", o.items);
    o.id_prefix = args.str("id-prefix", o.id_prefix);
    args.check_all_used();
    COMB_CHECK(o.pairs_per_document >= 1, "--pairs-per-document must be >= 1, found {}", o.pairs_per_document);
    COMB_CHECK(o.items >= 0, "--items must be >= 0 (0: all), found {}", o.items);
    items = kv_retrieval_items(from, o);
    fmt::print(stderr, "[comb] wrote {} kv items ({} pairs per document) from {} to {}\n", items.size(),
               o.pairs_per_document, from, out_path);
  }
  write_qa_items(out_path, items);
  return 0;
}

// `comb make-data --kind needle --essays DIR`: facts planted in filler paragraphs (needle_items).
int make_needle(Args& args) {
  const std::string essays = args.str("essays"), out_path = args.str("out");
  NeedleOptions o;
  o.items = args.num<int64_t>("items", o.items);
  o.seed = args.num<uint64_t>("seed", o.seed);
  o.split = args.str("split", o.split);
  o.min_documents = args.num<int64_t>("min-docs", o.min_documents);
  o.max_documents = args.num<int64_t>("max-docs", o.max_documents);
  o.id_prefix = args.str("id-prefix", o.id_prefix);
  args.check_all_used();
  COMB_CHECK(!essays.empty(), "make-data --kind needle needs --essays DIR (plain-text prose, *.txt)");
  COMB_CHECK(!out_path.empty(), "make-data needs --out FILE");
  COMB_CHECK(o.split == "train" || o.split == "test", "--split expects train or test, found '{}'", o.split);
  COMB_CHECK(o.items > 0, "--items must be > 0, found {}", o.items);
  COMB_CHECK(o.min_documents >= 1 && o.max_documents >= o.min_documents,
             "--min-docs and --max-docs: need 1 <= min ({}) <= max ({})", o.min_documents, o.max_documents);
  const auto paragraphs = essay_paragraphs(essays, 80, o.split);
  write_qa_items(out_path, needle_items(paragraphs, o));
  fmt::print(stderr, "[comb] wrote {} needle items ({} split: {} paragraphs, {}-{} documents, seed {}) to {}\n",
             o.items, o.split, paragraphs.size(), o.min_documents, o.max_documents, o.seed, out_path);
  return 0;
}

}  // namespace

int cmd_make_data(Args& args) {
  const std::string kind = args.str("kind", "codeword");
  if (kind == "codeword") return make_codeword(args);
  if (kind == "needle") return make_needle(args);
  if (kind == "records") return make_records(args);
  if (kind == "long-records") return make_long_records(args);
  if (kind == "nq-multidoc" || kind == "kv") return make_from_source(args, kind);
  throw Error(fmt::format("make-data --kind expects codeword, records, long-records, needle, nq-multidoc or kv, found '{}'",
                          kind));
}

}  // namespace comb::cli
