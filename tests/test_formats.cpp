// GGUF and safetensors: dequantization, round trips, and clear errors for bad files.
#include <c10/util/Half.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <random>
#include <algorithm>
#include <iterator>
#include <map>
#include <set>
#include <fstream>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "comb/detail/json.hpp"
#include "helpers.hpp"

using namespace comb;
using namespace comb::test;
namespace fs = std::filesystem;

namespace {

std::string f16(float v) {
  uint16_t h = c10::detail::fp16_ieee_from_fp32_value(v);
  return std::string(reinterpret_cast<const char*>(&h), 2);
}

// 64 weights of one block type, with the expected float values computed by the format's formula.
struct Blocks {
  std::string bytes;
  std::vector<float> expected;
};

Blocks make_blocks(GgmlType type, uint32_t seed) {
  std::mt19937 rng(seed);
  Blocks b;
  for (int block = 0; block < 2; ++block) {
    float d = 0.01f + 0.1f * block, m = -0.3f + 0.05f * block;
    float dh = c10::detail::fp16_ieee_to_fp32_value(c10::detail::fp16_ieee_from_fp32_value(d));
    float mh = c10::detail::fp16_ieee_to_fp32_value(c10::detail::fp16_ieee_from_fp32_value(m));
    std::vector<float> out(32);
    if (type == GgmlType::Q8_0) {
      b.bytes += f16(d);
      for (int j = 0; j < 32; ++j) {
        int8_t q = static_cast<int8_t>(static_cast<int>(rng() % 256) - 128);
        b.bytes += static_cast<char>(q);
        out[j] = dh * q;
      }
    } else {
      b.bytes += f16(d);
      if (type == GgmlType::Q4_1) b.bytes += f16(m);
      for (int j = 0; j < 16; ++j) {
        uint8_t q = static_cast<uint8_t>(rng() % 256);
        b.bytes += static_cast<char>(q);
        if (type == GgmlType::Q4_0) {
          out[j] = dh * ((q & 0xF) - 8);
          out[j + 16] = dh * ((q >> 4) - 8);
        } else {
          out[j] = dh * (q & 0xF) + mh;
          out[j + 16] = dh * (q >> 4) + mh;
        }
      }
    }
    b.expected.insert(b.expected.end(), out.begin(), out.end());
  }
  return b;
}

// A small valid GGUF: metadata and one tensor of each supported type.
GgufWriter sample_gguf() {
  GgufWriter w;
  w.kv_str("general.architecture", "llama");
  w.kv_u32("llama.block_count", 2);
  w.kv_f32("llama.rope.freq_base", 10000.0f);
  w.kv_strs("tokenizer.ggml.tokens", {"a", "b", "c"});
  std::string f32(4 * 6, '\0');
  for (int i = 0; i < 6; ++i) {
    float v = i * 0.5f;
    std::memcpy(&f32[4 * i], &v, 4);
  }
  w.tensor("f32", {3, 2}, 0, f32);
  std::string half;
  for (int i = 0; i < 6; ++i) half += f16(i * 0.25f);
  w.tensor("f16", {6}, 1, half);
  std::string bf16;
  for (int i = 0; i < 4; ++i) {
    float v = 1.5f * i;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    uint16_t top = bits >> 16;
    bf16.append(reinterpret_cast<const char*>(&top), 2);
  }
  w.tensor("bf16", {4}, 30, bf16);
  w.tensor("q8_0", {32, 2}, 8, make_blocks(GgmlType::Q8_0, 1).bytes);
  w.tensor("q4_0", {32, 2}, 2, make_blocks(GgmlType::Q4_0, 2).bytes);
  w.tensor("q4_1", {64}, 3, make_blocks(GgmlType::Q4_1, 3).bytes);
  return w;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("GGUF reads metadata and every supported tensor type", "[formats]") {
  auto dir = temp_dir("gguf");
  for (uint32_t version : {2u, 3u}) {
    write_bytes(dir + "/ok.gguf", sample_gguf().bytes(version));
    GgufFile g(dir + "/ok.gguf");
    CHECK(g.version() == version);
    CHECK(g.get_string("general.architecture") == "llama");
    CHECK(g.get_int("llama.block_count") == 2);
    CHECK(g.get_float("llama.rope.freq_base") == 10000.0);
    CHECK(g.get("tokenizer.ggml.tokens").size() == 3);
    CHECK(g.find("f32")->shape == std::vector<int64_t>{2, 3});
    CHECK(g.load("f32", at::kFloat).equal(at::arange(6, at::kFloat).view({2, 3}) * 0.5));
    CHECK(g.load("f16", at::kFloat).equal(at::arange(6, at::kFloat) * 0.25));
    CHECK(g.load("bf16", at::kFloat).equal(at::arange(4, at::kFloat) * 1.5));
    for (auto [name, type, seed] : {std::tuple{"q8_0", GgmlType::Q8_0, 1u}, std::tuple{"q4_0", GgmlType::Q4_0, 2u},
                                    std::tuple{"q4_1", GgmlType::Q4_1, 3u}}) {
      at::Tensor got = g.load(name, at::kFloat).flatten();
      auto want = make_blocks(type, seed).expected;
      REQUIRE(got.numel() == 64);
      for (int i = 0; i < 64; ++i) CHECK(got[i].item<float>() == want[i]);
    }
    CHECK(g.load("q4_1", at::kBFloat16).scalar_type() == at::kBFloat16);
  }
}

TEST_CASE("GGUF errors name the file and the problem", "[formats][errors]") {
  auto dir = temp_dir("gguf-bad");
  std::string good = sample_gguf().bytes();

  CHECK_THAT(error_of([&] { GgufFile(dir + "/missing.gguf"); }), Catch::Contains("cannot open") &&
                                                                     Catch::Contains("missing.gguf"));
  CHECK_THAT(error_of([&] { open_tensor_source(dir + "/missing.gguf"); }), Catch::Contains("does not exist"));

  std::string bad_magic = good;
  bad_magic[0] = 'X';
  write_bytes(dir + "/magic.gguf", bad_magic);
  CHECK_THAT(error_of([&] { GgufFile(dir + "/magic.gguf"); }), Catch::Contains("not a GGUF file") &&
                                                                   Catch::Contains("magic.gguf"));

  std::string bad_version = good;
  bad_version[4] = 7;
  write_bytes(dir + "/version.gguf", bad_version);
  CHECK_THAT(error_of([&] { GgufFile(dir + "/version.gguf"); }), Catch::Contains("version 7"));

  // Every truncation is an error, never a crash or a silent success.
  for (size_t cut : {size_t(0), size_t(3), size_t(10), size_t(30), size_t(100), good.size() / 2, good.size() - 30}) {
    write_bytes(dir + "/cut.gguf", good.substr(0, cut));
    CAPTURE(cut);
    CHECK_THAT(error_of([&] { GgufFile(dir + "/cut.gguf"); }), Catch::Contains("cut.gguf"));
  }

  // A string length far past the end of the file.
  std::string long_key = good;
  uint64_t huge = uint64_t(1) << 50;
  std::memcpy(&long_key[24], &huge, 8);  // the first metadata key's length
  write_bytes(dir + "/keylen.gguf", long_key);
  CHECK_THAT(error_of([&] { GgufFile(dir + "/keylen.gguf"); }), Catch::Contains("truncated or corrupt"));

  // A tensor offset out of range.
  GgufWriter w;
  w.tensor("t", {32}, 0, std::string(128, '\0'));
  std::string bytes = w.bytes();
  size_t at_offset = bytes.find('t') + 1 + 4 + 8 + 4;  // name, rank, dim, type
  uint64_t far = 1 << 20;
  std::memcpy(&bytes[at_offset], &far, 8);
  write_bytes(dir + "/offset.gguf", bytes);
  CHECK_THAT(error_of([&] { GgufFile(dir + "/offset.gguf"); }), Catch::Contains("past the end of the file") &&
                                                                    Catch::Contains("'t'"));

  // A tensor type comb cannot read opens, and reading it says which tensor and type.
  GgufWriter q6;
  q6.tensor("blk.0.q6", {256}, 14, std::string(210, '\0'));
  write_bytes(dir + "/q6k.gguf", q6.bytes());
  GgufFile g(dir + "/q6k.gguf");
  CHECK_THAT(error_of([&] { g.load("blk.0.q6", at::kFloat); }),
             Catch::Contains("blk.0.q6") && Catch::Contains("Q6_K") && Catch::Contains("cannot read"));
  CHECK_THAT(error_of([&] { g.get_int("llama.block_count"); }), Catch::Contains("'llama.block_count' is missing"));
}

TEST_CASE("GGUF random corruption is an error or a valid file, never a crash", "[formats][errors]") {
  auto dir = temp_dir("gguf-fuzz");
  std::string good = sample_gguf().bytes();
  std::mt19937 rng(99);
  int errors = 0;
  for (int i = 0; i < 300; ++i) {
    std::string bytes = good;
    size_t header_end = good.size() - 6 * 32 - 32 * 4;  // corrupt the header and tables, not only data
    for (int k = 0; k < 3; ++k) bytes[rng() % header_end] ^= static_cast<char>(1 + rng() % 255);
    write_bytes(dir + "/fuzz.gguf", bytes);
    try {
      GgufFile g(dir + "/fuzz.gguf");
      for (const auto& name : g.names()) g.load(name, at::kFloat);
    } catch (const Error&) {
      ++errors;
    }
  }
  CHECK(errors > 0);
}

TEST_CASE("safetensors round trip keeps tensors, dtypes and metadata", "[formats]") {
  auto dir = temp_dir("st");
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"a.weight", at::randn({3, 5})},
      {"b", at::randn({7}).to(at::kBFloat16)},
      {"c", at::arange(10, at::kLong).view({2, 5})},
      {"empty", at::zeros({0, 4})},
  };
  save_safetensors(dir + "/m.safetensors", tensors, {{"format", "pt"}, {"note", "hello"}});
  SafetensorsFile f(dir + "/m.safetensors");
  CHECK(f.metadata().at("note") == "hello");
  for (const auto& [name, t] : tensors) {
    REQUIRE(f.find(name));
    CHECK(f.find(name)->shape == t.sizes().vec());
    CHECK(f.load(name, t.scalar_type()).equal(t));
  }
  CHECK(f.load("b", at::kFloat).equal(tensors[1].second.to(at::kFloat)));
  // Nothing but the file itself is left in the directory.
  int n = 0;
  for (auto& e : fs::directory_iterator(dir)) n += e.is_regular_file();
  CHECK(n == 1);
}

TEST_CASE("safetensors errors name the file and the problem", "[formats][errors]") {
  auto dir = temp_dir("st-bad");
  save_safetensors(dir + "/good.safetensors", {{"w", at::randn({4, 4})}});
  std::string good = read_bytes(dir + "/good.safetensors");

  auto bad = [&](const std::string& name, const std::string& bytes) {
    write_bytes(dir + "/" + name, bytes);
    return error_of([&] { SafetensorsFile(dir + "/" + name); });
  };
  CHECK_THAT(bad("short.safetensors", "abc"), Catch::Contains("not a safetensors file"));
  std::string long_header = good;
  uint64_t huge = good.size() * 2;
  std::memcpy(&long_header[0], &huge, 8);
  CHECK_THAT(bad("header.safetensors", long_header), Catch::Contains("header length") &&
                                                          Catch::Contains("header.safetensors"));
  std::string not_json = good;
  not_json[8] = '[';
  not_json[9] = '[';
  CHECK_THAT(bad("json.safetensors", not_json), Catch::Contains("not valid JSON") || Catch::Contains("JSON object"));
  CHECK_THAT(bad("cut.safetensors", good.substr(0, good.size() - 8)), Catch::Contains("outside the data section"));
  std::string header = R"({"w":{"dtype":"F32","shape":[4,4],"data_offsets":[0,60]}})";
  std::string bytes(8, '\0');
  uint64_t n = header.size();
  std::memcpy(&bytes[0], &n, 8);
  CHECK_THAT(bad("size.safetensors", bytes + header + std::string(64, '\0')), Catch::Contains("needs 64"));
  header = R"({"w":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}})";
  n = header.size();
  std::memcpy(&bytes[0], &n, 8);
  CHECK_THAT(bad("dtype.safetensors", bytes + header + std::string(4, '\0')),
             Catch::Contains("'F8_E4M3'") && Catch::Contains("'w'"));

  // A directory one cannot write into: an error, and no partial file.
  if (::geteuid() != 0) {
    fs::create_directories(dir + "/ro");
    fs::permissions(dir + "/ro", fs::perms::owner_read | fs::perms::owner_exec);
    CHECK_THAT(error_of([&] { save_safetensors(dir + "/ro/x.safetensors", {{"w", at::ones({2})}}); }),
               Catch::Contains("cannot write"));
  }
  CHECK_THAT(error_of([&] { save_safetensors(dir + "/nodir/x.safetensors", {{"w", at::ones({2})}}); }),
             Catch::Contains("cannot write") && Catch::Contains("nodir"));
}

TEST_CASE("sizes that wrap around, shared bytes and shard paths outside the directory are refused",
          "[formats][errors]") {
  auto dir = temp_dir("wrap");
  auto gguf_error = [&](const std::string& name, const std::string& bytes) {
    write_bytes(dir + "/" + name, bytes);
    return error_of([&] { GgufFile(dir + "/" + name); });  // any other exception fails the test
  };
  auto put64 = [](std::string& bytes, size_t at, uint64_t v) { std::memcpy(&bytes[at], &v, 8); };

  // GGUF: a tensor offset that wraps past 2^64 back into the header.
  GgufWriter one;
  one.tensor("t", {32}, 0, std::string(128, '\0'));
  std::string bytes = one.bytes();
  put64(bytes, bytes.find('t') + 1 + 4 + 8 + 4, ~uint64_t(0) - 31);  // 2^64 - 32: a multiple of 32
  CHECK_THAT(gguf_error("offset-wraps.gguf", bytes), Catch::Contains("'t'") && Catch::Contains("past the end"));

  // GGUF: dims whose byte count wraps to 0 (2^31 x 2^31 floats = 2^64 bytes), with no data.
  GgufWriter huge;
  huge.tensor("t", {uint64_t(1) << 31, uint64_t(1) << 31}, 0, "");
  CHECK_THAT(gguf_error("bytes-wrap.gguf", huge.bytes()), Catch::Contains("'t'") && Catch::Contains("past the end"));

  // GGUF: counts whose multiplication by the least item size wraps to a few bytes.
  GgufWriter array;
  array.kv_strs("k", {"a"});
  const size_t count_at = 24 + 8 + 1 + 4 + 4;  // key length, "k", type, element type
  bytes = array.bytes();
  put64(bytes, count_at, (uint64_t(1) << 61) + 1);  // x 8 bytes = 8 (mod 2^64)
  CHECK_THAT(gguf_error("array-wraps.gguf", bytes), Catch::Contains("truncated or corrupt") && Catch::Contains("'k'"));
  bytes = array.bytes();
  uint32_t nested = 9;  // an array of 2^40 arrays
  std::memcpy(&bytes[count_at - 4], &nested, 4);
  put64(bytes, count_at, uint64_t(1) << 40);
  CHECK_THAT(gguf_error("nested-count.gguf", bytes), Catch::Contains("truncated or corrupt"));
  bytes = sample_gguf().bytes();
  put64(bytes, 8, 0x0AAAAAAAAAAAAAABull);  // x 24 bytes = 8 (mod 2^64)
  CHECK_THAT(gguf_error("tensor-count.gguf", bytes), Catch::Contains("tensor descriptions"));

  // safetensors: field types, a byte count past 2^64, two tensors on the same bytes.
  auto st_error = [&](const std::string& name, const std::string& header, size_t data) {
    std::string out(8, '\0');
    uint64_t n = header.size();
    std::memcpy(&out[0], &n, 8);
    write_bytes(dir + "/" + name, out + header + std::string(data, '\0'));
    return error_of([&] { SafetensorsFile(dir + "/" + name); });
  };
  CHECK_THAT(st_error("dtype.safetensors", R"({"w":{"dtype":1,"shape":[1],"data_offsets":[0,4]}})", 4),
             Catch::Contains("'w' dtype should be a string"));
  CHECK_THAT(st_error("shape.safetensors", R"({"w":{"dtype":"F32","shape":5,"data_offsets":[0,4]}})", 4),
             Catch::Contains("'w' shape should be a list"));
  CHECK_THAT(st_error("shape-wraps.safetensors",
                      R"({"w":{"dtype":"F64","shape":[2147483648,1073741824],"data_offsets":[0,0]}})", 0),
             Catch::Contains("more than 2^64"));
  CHECK_THAT(st_error("overlap.safetensors",
                      R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16),
             Catch::Contains("overlap") && Catch::Contains("'a'") && Catch::Contains("'b'"));
  CHECK(st_error("empty-inside.safetensors",  // an empty tensor takes no bytes: no overlap
                 R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                 R"("e":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}})", 16) == "");

  // A sharded index names files beside it only.
  save_safetensors(dir + "/shard.safetensors", {{"w", at::ones({2})}});
  fs::create_directories(dir + "/model");
  auto index_error = [&](const std::string& map) {
    write_bytes(dir + "/model/model.safetensors.index.json", R"({"weight_map":)" + map + "}");
    return error_of([&] { ShardedSafetensors(dir + "/model/model.safetensors.index.json"); });
  };
  CHECK_THAT(index_error(R"({"w":"../shard.safetensors"})"), Catch::Contains("expected a file name"));
  CHECK_THAT(index_error(R"({"w":")" + dir + R"(/shard.safetensors"})"), Catch::Contains("expected a file name"));
  CHECK_THAT(index_error(R"({"w":1})"), Catch::Contains("should be a file name"));
  fs::copy_file(dir + "/shard.safetensors", dir + "/model/shard.safetensors");
  CHECK(index_error(R"({"w":"shard.safetensors"})") == "");
}

TEST_CASE("a written file gets the mode the umask gives a new file", "[formats]") {
  auto dir = temp_dir("mode");
  const mode_t before = ::umask(022);
  save_safetensors(dir + "/m.safetensors", {{"w", at::ones({2})}});
  ::umask(before);
  CHECK((fs::status(dir + "/m.safetensors").permissions() & fs::perms::all) ==
        (fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read));
  int leftovers = 0;
  for (const auto& e : fs::directory_iterator(dir)) leftovers += e.path().filename().string() != "m.safetensors";
  CHECK(leftovers == 0);
}

TEST_CASE("JSON nested past the bound is refused by every reader, naming the input and the field", "[formats][errors]") {
  auto dir = temp_dir("json-deep");
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  // A data item: the file, the line and the field (the process used to die of a stack overflow).
  write_bytes(dir + "/deep.jsonl", R"({"id":"a","question":"q","answers":["x"],"documents":[]})" "\n" +
                                       std::string(R"({"id":"b","question":"q","answers":)") + deep +
                                       R"(,"documents":[]})" "\n");
  std::string e = error_of([&] { read_qa_items(dir + "/deep.jsonl"); });
  CHECK_THAT(e, Catch::Contains("deep.jsonl' line 2") && Catch::Contains("nested deeper than 64 levels") &&
                    Catch::Contains("field 'answers'"));
  // Nesting up to the bound reads; one level more does not.
  auto nested = [](int levels) { return std::string(levels, '[') + std::string(levels, ']'); };
  CHECK(comb::detail::parse_json(nested(comb::detail::kMaxJsonDepth), "x").is_array());
  CHECK_THAT(error_of([&] { comb::detail::parse_json(nested(comb::detail::kMaxJsonDepth + 1), "x"); }),
             Catch::Contains("nested deeper than 64"));
  // A safetensors header.
  const std::string header = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":)" +
                             std::string(50000, '[') + std::string(50000, ']') + "}";
  std::string bytes(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(&bytes[0], &n, 8);
  write_bytes(dir + "/deep.safetensors", bytes + header + std::string(4, '\0'));
  CHECK_THAT(error_of([&] { SafetensorsFile(dir + "/deep.safetensors"); }),
             Catch::Contains("deep.safetensors': safetensors header") && Catch::Contains("nested deeper") &&
                 Catch::Contains("'__metadata__'"));
  // A model directory's config.json.
  fs::create_directories(dir + "/model");
  save_safetensors(dir + "/model/model.safetensors", {{"model.norm.weight", at::ones({4})}});
  write_bytes(dir + "/model/config.json", R"({"model_type":"llama","rope_scaling":)" + deep + "}");
  CHECK_THAT(error_of([&] { Model::load(dir + "/model"); }),
             Catch::Contains("config.json") && Catch::Contains("nested deeper") && Catch::Contains("'rope_scaling'"));
  remove_dir(dir);
}

TEST_CASE("data files past their bounds are refused while streaming: a decompression bomb, a long line",
          "[formats][errors]") {
  auto dir = temp_dir("data-bomb");
  // 64 MiB of one JSON line from about 64 KB of gzip (ratio about 1000): refused at the ratio bound,
  // after reading 32 MiB, not after inflating it all.
  {
    gzFile f = gzopen((dir + "/bomb.jsonl.gz").c_str(), "wb9");
    REQUIRE(f);
    const std::string chunk(1 << 20, ' ');
    gzwrite(f, R"({"id":"a","question":"q","answers":["x"],"documents":[],"pad":")", 63);
    for (int i = 0; i < 64; ++i) gzwrite(f, chunk.data(), static_cast<unsigned>(chunk.size()));
    gzwrite(f, "\"}\n", 3);
    gzclose(f);
  }
  CHECK(fs::file_size(dir + "/bomb.jsonl.gz") < (1 << 20));
  CHECK_THAT(error_of([&] { read_qa_items(dir + "/bomb.jsonl.gz"); }),
             Catch::Contains("bomb.jsonl.gz") && Catch::Contains("decompression bomb") && Catch::Contains("max_ratio"));
  // The same file read with a higher ratio bound stops at the line bound instead.
  DataLimits limits;
  limits.max_ratio = 1e9;
  limits.max_line_bytes = 40 << 20;
  CHECK_THAT(error_of([&] { read_qa_items(dir + "/bomb.jsonl.gz", 0, limits); }),
             Catch::Contains("line 1: longer than 41943040 bytes") && Catch::Contains("max_line_bytes"));
  // And a plain file past the total bound.
  std::string lines;
  for (int i = 0; i < 100; ++i)
    lines += fmt::format(R"({{"id":"{}","question":"q","answers":["x"],"documents":[]}})" "\n", i);
  write_bytes(dir + "/many.jsonl", lines);
  limits = DataLimits{};
  limits.max_total_bytes = 1000;
  CHECK_THAT(error_of([&] { read_qa_items(dir + "/many.jsonl", 0, limits); }),
             Catch::Contains("more than 1000 bytes of text") && Catch::Contains("max_total_bytes"));
  CHECK(read_qa_items(dir + "/many.jsonl").size() == 100);  // within the default bounds
  remove_dir(dir);
}

TEST_CASE("nq-multidoc and kv items are made from files in their public source layout", "[formats][data]") {
  const std::string src = test_data_dir() + "/source";
  NqMultidocOptions o;
  o.documents = 4;
  std::vector<QaItem> items = nq_multidoc_items(src + "/nq-open-mini.jsonl", o);
  REQUIRE(items.size() == 8);
  // The gold passages, in the source's order (the fourth from nq_annotated_gold: no ctx is marked gold).
  const char* titles[] = {"Mount Everest", "Amazon River", "Eiffel Tower", "Mariana Trench",
                          "Great Barrier Reef", "Sistine Chapel ceiling", "Gold", "Human skeleton"};
  std::set<int64_t> gold_places;
  for (size_t i = 0; i < items.size(); ++i) {
    const QaItem& it = items[i];
    INFO("item " << i);
    CHECK(it.id == fmt::format("nq-{:04d}", i));
    REQUIRE(it.documents.size() == 4);
    REQUIRE(it.gold_index >= 0);
    REQUIRE(it.gold_index < 4);
    gold_places.insert(it.gold_index);
    CHECK(it.documents[it.gold_index].title == titles[i]);
    CHECK(answer_correct(it.documents[it.gold_index].text, it.answers));
    std::set<std::string> seen;
    for (int64_t d = 0; d < 4; ++d) {
      CHECK(seen.insert(it.documents[d].title).second);  // no passage twice
      if (d != it.gold_index) CHECK_FALSE(answer_correct(it.documents[d].title + "\n" + it.documents[d].text, it.answers));
    }
  }
  CHECK(gold_places.size() > 1);  // the gold passage is not always in one place
  CHECK(items[6].answers == std::vector<std::string>{"aurum"});
  // The same seed gives the same items; another seed other draws.
  auto same = nq_multidoc_items(src + "/nq-open-mini.jsonl", o);
  auto titles_of = [](const std::vector<QaItem>& v) {
    std::vector<std::string> t;
    for (const auto& it : v)
      for (const auto& d : it.documents) t.push_back(d.title);
    return t;
  };
  CHECK(titles_of(same) == titles_of(items));
  o.seed = 1;
  CHECK(titles_of(nq_multidoc_items(src + "/nq-open-mini.jsonl", o)) != titles_of(items));
  o.documents = 9;  // 8 questions: 7 other passages at most
  CHECK_THROWS_WITH(nq_multidoc_items(src + "/nq-open-mini.jsonl", o),
                    Catch::Contains("has 7 passages without its answer to draw from; 9 documents need 8"));

  // Written and read back through the data reader, plain and gzip.
  const std::string dir = temp_dir("comb-make-data");
  for (const std::string name : {"/nq.jsonl", "/nq.jsonl.gz"}) {
    write_qa_items(dir + name, items);
    auto back = read_qa_items(dir + name);
    REQUIRE(back.size() == items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      CHECK(back[i].id == items[i].id);
      CHECK(back[i].question == items[i].question);
      CHECK(back[i].answers == items[i].answers);
      CHECK(back[i].gold_index == items[i].gold_index);
      CHECK(back[i].documents.back().text == items[i].documents.back().text);
    }
  }
  CHECK_FALSE(fs::exists(dir + "/nq.jsonl.gz.part"));

  // Key-value retrieval: 20 records in documents of 5, the key's document the gold one.
  std::vector<QaItem> kv = kv_retrieval_items(src + "/kv-retrieval-mini.jsonl", {});
  REQUIRE(kv.size() == 3);
  for (const auto& it : kv) {
    REQUIRE(it.documents.size() == 4);
    REQUIRE(it.answers.size() == 1);
    const std::string key = it.question.substr(it.question.find('"') + 1, 36);
    CHECK(it.question == fmt::format("Extract the value corresponding to the key \"{}\" from the JSON objects above.", key));
    for (int64_t d = 0; d < 4; ++d) {
      nlohmann::json obj = nlohmann::json::parse(it.documents[d].text);
      REQUIRE(obj.is_object());
      CHECK(obj.size() == 5);
      CHECK(obj.contains(key) == (d == it.gold_index));
      if (d == it.gold_index) CHECK(obj[key] == it.answers[0]);
    }
  }

  // Bad source lines are refused with the file, the line and the field.
  {
    std::ofstream f(dir + "/bad.jsonl");
    f << R"({"question": "q", "answers": ["a"], "ctxs": [{"title": "t", "text": "x", "isgold": true}]})" << "\n";
    f << R"({"question": "q2", "answers": "a"})" << "\n";
  }
  CHECK_THROWS_WITH(nq_multidoc_items(dir + "/bad.jsonl", {}),
                    Catch::Contains("bad.jsonl' line 2: 'answers' must be a non-empty list of strings, found string"));
  {
    std::ofstream f(dir + "/nogold.jsonl");
    f << R"({"question": "q", "answers": ["a"], "ctxs": [{"title": "t", "text": "x", "isgold": false}]})" << "\n";
  }
  CHECK_THROWS_WITH(nq_multidoc_items(dir + "/nogold.jsonl", {}), Catch::Contains("nogold.jsonl' line 1: no gold passage"));
  {
    std::ofstream f(dir + "/badkv.jsonl");
    f << R"({"ordered_kv_records": [["k1", "v1"], ["k2"]], "key": "k1", "value": "v1"})" << "\n";
  }
  CHECK_THROWS_WITH(kv_retrieval_items(dir + "/badkv.jsonl", {}),
                    Catch::Contains("badkv.jsonl' line 1: 'ordered_kv_records[1]' must be a [key, value] pair of strings"));
}

TEST_CASE("needle items: one planted fact per item, test filler and keys never in the train split", "[formats][data]") {
  const std::string essays = test_data_dir() + "/essays";
  // Every fourth essay by name (here the first of four) is a test essay.
  auto test_paragraphs = essay_paragraphs(essays, 80, "test");
  auto train_paragraphs = essay_paragraphs(essays, 80, "train");
  REQUIRE(test_paragraphs.size() == 1);
  REQUIRE(train_paragraphs.size() == 3);
  CHECK(test_paragraphs[0].rfind("The keeper climbed the stairs", 0) == 0);
  for (const auto& p : train_paragraphs) CHECK(p.find("climbed the stairs") == std::string::npos);
  CHECK(essay_paragraphs(essays, 80, "all").size() == 4);

  auto keys_of = [](const std::vector<QaItem>& items) {
    std::set<std::string> words;
    for (const auto& it : items) {
      const std::string q = it.question, lead = "What is the special magic number for ";
      REQUIRE(q.rfind(lead, 0) == 0);
      const std::string key = q.substr(lead.size(), q.size() - lead.size() - 1);
      const size_t dash = key.find('-');
      REQUIRE(dash != std::string::npos);
      words.insert(key.substr(0, dash));
      words.insert(key.substr(dash + 1));
    }
    return words;
  };
  NeedleOptions o;
  o.items = 40;
  o.min_documents = 2;
  o.max_documents = 5;
  std::map<std::string, std::vector<QaItem>> made;
  for (const std::string split : {"train", "test"}) {
    o.split = split;
    const auto& paragraphs = split == "test" ? test_paragraphs : train_paragraphs;
    std::vector<QaItem> items = needle_items(paragraphs, o);
    REQUIRE(items.size() == 40);
    std::set<size_t> counts;
    for (size_t i = 0; i < items.size(); ++i) {
      const QaItem& it = items[i];
      INFO(split << " item " << i);
      CHECK(it.id == fmt::format("needle-{}-0-{:04d}", split, i));
      REQUIRE(it.answers.size() == 1);
      CHECK(it.answers[0].size() == 7);
      counts.insert(it.documents.size());
      REQUIRE(it.gold_index >= 0);
      REQUIRE(it.gold_index < static_cast<int64_t>(it.documents.size()));
      const std::string key = it.question.substr(37, it.question.size() - 38);
      const std::string fact = "The special magic number for " + key + " is " + it.answers[0] + ".";
      for (size_t d = 0; d < it.documents.size(); ++d) {
        const bool planted = it.documents[d].text.find(fact) != std::string::npos;
        CHECK(planted == (static_cast<int64_t>(d) == it.gold_index));
        if (!planted) CHECK(std::find(paragraphs.begin(), paragraphs.end(), it.documents[d].text) != paragraphs.end());
      }
    }
    CHECK(*counts.begin() >= 2);
    CHECK(*counts.rbegin() <= 5);
    CHECK(counts.size() > 1);
    // The same seed gives the same items.
    CHECK(needle_items(paragraphs, o)[7].question == items[7].question);
    CHECK(needle_items(paragraphs, o)[7].answers == items[7].answers);
    made[split] = std::move(items);
  }
  std::set<std::string> train_words = keys_of(made["train"]), test_words = keys_of(made["test"]), both;
  std::set_intersection(train_words.begin(), train_words.end(), test_words.begin(), test_words.end(),
                        std::inserter(both, both.begin()));
  CHECK(both.empty());
  CHECK(test_words.size() > 1);

  o.split = "dev";
  CHECK_THROWS_WITH(needle_items(test_paragraphs, o), Catch::Contains("--split expects train or test, found 'dev'"));
  CHECK_THROWS_WITH(essay_paragraphs(essays + "/missing", 80, "test"), Catch::Contains("is not a directory"));
}
