#pragma once
// A document's cached K/V (DocumentKV: per block, float or int8 with scales), as a store keeps it,
// and a request's documents linked in order for the decoder (LinkedDocuments, Linker).
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comb/decoder.hpp"  // JointKV

namespace comb {

// The cache forms beyond ATen's dtypes, named by scalar types ATen never uses for K/V: int4 keys
// and values (kCacheInt4), int8 keys with int4 values (kCacheInt8Int4). `comb::parse_cache_dtype`
// spells them "int4" and "int8-int4".
inline constexpr c10::ScalarType kCacheInt4 = c10::ScalarType::QUInt4x2;
inline constexpr c10::ScalarType kCacheInt8Int4 = c10::ScalarType::QUInt2x4;

// Stored as float32, bfloat16, float16, int8 or int4. int8 (symmetric, round to nearest) keeps
// float16 scales: one per value row ([n_head_kv, n_tokens, 1]) and, for keys, one per channel over
// the document's tokens ([n_head_kv, 1, head_dim]: keys have outlier channels) or, for documents of
// fewer than head_dim / 2 tokens, one per row (where per-channel scales would cost more than the
// codes' savings); the element is q * scale. A NaN element counts for nothing in its scale and is
// coded -levels, an infinite one gives its scale 65504 and saturates, alike on every path (int8
// codes, int4 values and int4 keys under head_dim tokens, there per rotated element, in which one
// NaN key makes its row NaN; centred keys below take NaN as 0). Entries written with float32 scales per key channel
// (disk dtype 3) are still read as they are. int4 codes lie in [-7, 7] (scale amax / 7; centred
// keys, below, [-8, 7]), two to a
// byte: a uint8 tensor [n_head_kv, n_tokens, head_dim / 2] whose byte j holds channel 2j in its low
// nibble and 2j + 1 in its high one, each as q + 8. int4 values are scaled as int8 values, and
// unpacked they are an int8 entry's codes with the same scales. int4 keys (kCacheInt4) are coded
// rotated: each row times the normalized Walsh-Hadamard matrix of order head_dim (a power of two;
// hadamard_rows), which spreads a row's outlier channels over all of them so that fifteen levels
// lose less, with a scale per channel of the rotated rows at every length. Read (int8_codes), they
// are rotated back and coded again as int8 keys, which every reader takes. Under head_dim tokens,
// where float16 scales per channel would cost more a token than one per row, int4 keys keep their
// scales per channel coded (see code_int4_key_scales): a uint8 tensor [n_head_kv, 1, 2 + head_dim
// / 2], per head the float16 bits of the head's scale S (little-endian), then a 4-bit exponent e
// per channel packed as int4 codes are (channel 2j low); channel j's scale is float16(S * 2^(-e/8))
// (the float32 product of S and kInt4ScaleSteps[e], rounded to float16), and the codes are
// computed with it. Readers take it as the float16 scales it stands for (int4_key_scales). From
// head_dim tokens on, int4 keys are coded centred (centres_int4_keys): a channel's keys lie mostly
// on one side of zero, so fifteen levels around zero waste half their range. The scales are coded
// as above, followed per head by an int8 centre m_j per channel ([n_head_kv, 1, 2 + head_dim / 2 +
// head_dim] uint8); the codes lie in [-8, 7] and the element is (q + m_j) * s_j. The writer takes
// per channel lo and hi (the least and largest rotated key; NaN keys taken as 0, infinite ones as
// +-65504 * 127), mid = (lo + hi) * 0.5, the scale max((hi - lo) / 15, |mid| / 127) rounded up to
// float16 (2^-14 to 65504; 1 for a channel of zeros) and coded as above (s_j, at least that),
// m_j = round(mid / s_j + 0.5) within [-127, 127] and q = round(x / s_j - m_j) within [-8, 7]
// (rounding half to even): every element within half a step of its key, float32 rounding aside
// (int4_key_centres reads the centres).
struct DocumentKV {
  std::vector<at::Tensor> keys;    // per block: [n_head_kv, n_tokens, head_dim]
  std::vector<at::Tensor> values;  // per block: [n_head_kv, n_tokens, head_dim]
  std::vector<at::Tensor> key_scales, value_scales;  // per block, int8 only (else empty)
  int64_t n_tokens = 0;
  bool quantized() const { return !key_scales.empty(); }
  // The keys' head_dim (int4 keys keep two channels a byte).
  int64_t head_dim() const;
  // The storage form: a dtype (kChar for int8), kCacheInt4 or kCacheInt8Int4.
  c10::ScalarType dtype() const;
  int64_t bytes() const;           // scales included
  // A copy on `device` in `dtype` (kChar: quantized to int8; from int8: dequantized).
  DocumentKV to(c10::Device device, c10::ScalarType dtype) const;
  // As an int8 entry, on the same device (itself when no part is int4): int4 values as int8 codes
  // with the same scales; int4 keys read as float32, rotated back and quantized again as int8 (new
  // scales). int8_block: one block's key codes, key scales, value codes and value scales so.
  DocumentKV int8_codes() const;
  std::array<at::Tensor, 4> int8_block(size_t block) const;
  // Whether a stored dtype or form keeps int4 codes (kCacheInt4, kCacheInt8Int4), or codes at all.
  static bool packs_int4(c10::ScalarType form) { return form == kCacheInt4 || form == kCacheInt8Int4; }
  static bool is_quantized_form(c10::ScalarType form) { return form == at::kChar || packs_int4(form); }
  // Whether keys of this head_dim have the int4 form: rotated by a Walsh-Hadamard matrix of order
  // head_dim, which exists for powers of two (2 and up).
  static bool rotates_int4_keys(int64_t head_dim) { return head_dim >= 2 && (head_dim & (head_dim - 1)) == 0; }
  // Whether the keys of a document of `n_tokens` in `form` are scaled per channel (else per row):
  // int8 and int8-int4 keys from head_dim / 2 tokens on, rotated int4 keys always (per row they
  // lose more than the scales' bytes save).
  static bool keys_per_channel(int64_t n_tokens, int64_t head_dim, c10::ScalarType form = at::kChar);
  // Whether int4 keys of a document of `n_tokens` keep their scales per channel coded (a float16
  // scale per head and 4 bits per channel): under head_dim tokens, where head_dim float16 scales
  // would cost more than 2 bytes a token (a scale per row's cost).
  static bool codes_int4_key_scales(int64_t n_tokens, int64_t head_dim) { return n_tokens < head_dim; }
  // Whether int4 keys of a document of `n_tokens` are coded centred (coded scales and an int8 centre
  // per channel, head_dim * 3 / 2 + 2 bytes a head): from head_dim tokens on, where that takes fewer
  // bytes than float16 scales did (2 * head_dim), and the centres at most 1 byte a token a head.
  static bool centres_int4_keys(int64_t n_tokens, int64_t head_dim) { return n_tokens >= head_dim; }
  // How the keys of a document of `n_tokens` in `form` keep their scales: float16 per row or per
  // channel (keys_per_channel), coded per channel (int4 under head_dim tokens) or coded with
  // centres (int4 from head_dim tokens on).
  enum class KeyScaleForm { per_row, per_channel, coded, centred };
  static KeyScaleForm key_scale_form(c10::ScalarType form, int64_t n_tokens, int64_t head_dim);
  // Bytes of one head's coded int4 key scales: a float16 and 4 bits a channel, then for centred
  // keys an int8 centre a channel.
  static int64_t coded_key_scale_bytes(int64_t head_dim, bool centred) {
    return 2 + head_dim / 2 + (centred ? head_dim : 0);
  }
  // Bytes a document of `n_tokens` takes in `dtype` (or form) with `n_blocks` blocks of [n_head_kv,
  // head_dim].
  static int64_t storage_bytes(c10::ScalarType dtype, int64_t n_blocks, int64_t n_head_kv, int64_t head_dim,
                               int64_t n_tokens);
};

// int4 codes (uint8, two to a byte, [..., head_dim / 2]) as int8 codes [..., head_dim], and back
// (the codes must lie in [-8, 7]: [-7, 7] as symmetric quantizing makes them, -8 too for centred
// keys; others are not checked, for a GPU's sake, and do not round-trip). Element-wise tensor ops:
// any device.
at::Tensor unpack_int4(const at::Tensor& packed);
at::Tensor pack_int4(const at::Tensor& codes);
// A stored part's codes as int8: int4 ones (uint8) unpacked, any other tensor itself. For the
// values of an int4 form; int4 keys are rotated (DocumentKV::int8_block reads them).
at::Tensor as_int8_codes(const at::Tensor& part);
// x (float32, any device) times the normalized Walsh-Hadamard matrix H of order x.size(-1), a power
// of two, row by row: butterflies (a + b, a - b) over strides 1, 2, 4, ..., then a product with
// 1 / sqrt(order). H is symmetric and orthogonal, so the function is its own inverse (up to
// rounding), and every device computes the same floats.
at::Tensor hadamard_rows(const at::Tensor& x);
// The rotated int4 keys of one block ([n_head_kv, n_tokens, head_dim / 2] codes, their float16
// scales per channel or per row, or coded per channel, with centres or without) read as float32 and
// rotated back: hadamard_rows((codes + centres) * scales). On the CPU one pass over each head (the
// same floats), elsewhere those tensor ops.
at::Tensor rotated_int4_keys_float(const at::Tensor& packed, const at::Tensor& scales);

// 2^(-e/8) for e = 0..15 in float32: the steps of int4 keys' coded scales (DocumentKV).
inline constexpr float kInt4ScaleSteps[16] = {
    1.0f, 0.917004049f, 0.840896428f, 0.771105409f, 0.707106769f, 0.648419797f, 0.594603539f, 0.545253873f,
    0.5f, 0.458502024f, 0.420448214f, 0.385552704f, 0.353553385f, 0.324209899f, 0.297301769f, 0.272626936f};
// Float16 scales per channel ([n_head_kv, 1, head_dim], finite and positive) coded: per head S,
// the largest over the channels `zero` does not mark (1 where it marks all), and for each channel
// the largest e whose float16(S * kInt4ScaleSteps[e]) is at least that channel's scale (e = 15
// where `zero` marks a channel of zeros: its codes are 0 under any scale). Returns the coded form ([n_head_kv, 1, 2 + head_dim / 2] uint8) and the float16 scales it
// stands for, with which the codes are computed. Any device; the same bytes on each.
std::pair<at::Tensor, at::Tensor> code_int4_key_scales(const at::Tensor& scales, const at::Tensor& zero);
// int4 keys' scales as float16: coded ones ([n_head_kv, 1, 2 + head_dim / 2] uint8, or centred
// [n_head_kv, 1, 2 + head_dim * 3 / 2]) decoded to [n_head_kv, 1, head_dim]; float16 ones (per
// channel or row) as they are. Checked against the keys `packed` ([n_head_kv, n_tokens, head_dim /
// 2] uint8). Centred keys' elements are (code + centre) * scale: int4_key_centres reads the centres.
at::Tensor int4_key_scales(const at::Tensor& packed, const at::Tensor& scales);
// int4 keys' centres: the int8 m_j of centred keys ([n_head_kv, 1, head_dim] int8, a view of scales
// [n_head_kv, 1, 2 + head_dim * 3 / 2] uint8 sharing their memory, not contiguous where n_head_kv >
// 1); an undefined tensor for every other form of scales.
at::Tensor int4_key_centres(const at::Tensor& packed, const at::Tensor& scales);
namespace detail::document_kv {
// code_int4_key_scales and int4_key_scales by tensor ops, as they run off the CPU (declared for the
// tests that compare them with the CPU's loops); decode_int4_key_scales_ops takes coded scales
// without centres ([n_head_kv, 1, 2 + head_dim / 2]).
std::pair<at::Tensor, at::Tensor> code_int4_key_scales_ops(const at::Tensor& scales, const at::Tensor& zero);
at::Tensor decode_int4_key_scales_ops(const at::Tensor& coded);
// Coded int4 key scales ([n_head_kv, 1, 2 + head_dim / 2] uint8, or centred [n_head_kv, 1, 2 +
// head_dim * 3 / 2]) checked against their keys `packed`; returns head_dim / 2.
int64_t check_coded_key_scales(const at::Tensor& packed, const at::Tensor& scales);
// int4_key_scales and int4_key_centres with one check: the float16 scales and the centres (a view
// of `scales`, which may not be contiguous; undefined unless centred).
std::pair<at::Tensor, at::Tensor> int4_key_scales_and_centres(const at::Tensor& packed, const at::Tensor& scales);
// Rotated keys [n_head_kv, n_tokens, head_dim] (float32) coded centred by tensor ops, as run off the
// CPU: the int8 codes in [-8, 7] (to be packed) and the coded scales with the centres. The CPU's
// loops give the same bytes (declared for the tests that compare them).
std::pair<at::Tensor, at::Tensor> code_centred_int4_keys_ops(const at::Tensor& rotated);
// Keys [n_head_kv, n_tokens, head_dim] (float32; int4 keys rotated) quantized by tensor ops, as off
// the CPU: the codes (int8, int4 ones unpacked) and the scales of `form` at `levels` (127 or 7).
// The CPU's loops give the same numbers, NaN and infinite keys included (declared for the tests).
std::pair<at::Tensor, at::Tensor> quantize_keys_ops(const at::Tensor& k, float levels, DocumentKV::KeyScaleForm form);
}  // namespace detail::document_kv

namespace detail {
// Documents' entries filled a block at a time from a batch's K/V ([batch, n_head_kv, n, head_dim]
// a block; document d at batch row rows[d][0], positions [rows[d][1], rows[d][1] + rows[d][2])),
// each as its own tensors: on a CUDA device with comb's ops and without gradients one launch a
// block into one allocation per document, its blocks views of it (CudaLayerOps::split_documents);
// else a copy per document and block. Only the block being added is held besides the documents'
// own entries (Plugin::split_rows, the packed encoder, Documents::decoder_kv_many).
class DocumentSplit {
 public:
  DocumentSplit(std::vector<std::array<int64_t, 3>> rows, int64_t n_blocks);
  void add(int64_t block, const at::Tensor& keys, const at::Tensor& values);
  // The entries, once; every block must have been added.
  std::vector<DocumentKV> take();

 private:
  // The op's form: one dtype of 2 or 4 bytes on a CUDA device, channels contiguous, no gradients,
  // the documents' allocations (once made) of that dtype, device and head shape.
  bool on_device(const at::Tensor& keys, const at::Tensor& values) const;

  std::vector<std::array<int64_t, 3>> rows_;
  std::vector<DocumentKV> out_;
  int64_t n_blocks_ = 0;
  std::vector<at::Tensor> buffers_;  // [blocks, 2, n_head_kv, len, head_dim] a document, once on the device
  bool taken_ = false;
};
}  // namespace detail

// Documents linked int8 as stored (Linker with keep_int8): keys and values [block][document], the
// scales beside them (undefined for a document of another dtype; empty: none). Each int8 one is
// read as float32 in place (q * scale), as DocumentKV::to does; packed int4 keys (uint8) are the
// rotated ones of the int4 form, read as int8_codes reads them (rotated back, coded again as int8).
void dequantize_linked(std::vector<std::vector<at::Tensor>>& keys, std::vector<std::vector<at::Tensor>>& values,
                       const std::vector<std::vector<at::Tensor>>& key_scales,
                       const std::vector<std::vector<at::Tensor>>& value_scales);

// Documents linked for the decoder's cross-attention: per cross block, the documents of every
// request in order, without copying them into one tensor.
struct LinkedDocuments {
  std::vector<std::vector<at::Tensor>> keys;    // [block][document]: [n_head_kv, len, head_dim]
  std::vector<std::vector<at::Tensor>> values;  // [block][document]
  std::vector<int64_t> doc_counts;              // [batch]: documents of each request
  // Linker with keep_int8: int8 entries are linked as stored, their scales here [block][document]
  // (undefined for a document of another dtype); only joint-attention plug-ins read them so.
  // Empty otherwise (every linked K/V is float).
  std::vector<std::vector<at::Tensor>> key_scales, value_scales;
  std::vector<std::shared_ptr<const DocumentKV>> held;  // keeps every linked entry alive
  // A plug-in with documents_after_prefix: the prompt position the documents end at (the length
  // of the instruction prefix); positions before it do not read them. 0: every position does.
  int64_t anchor = 0;
  bool empty() const { return held.empty(); }
  // A joint-attention plug-in's view of them (Plugin::joint_kv), built by the first
  // Model::forward that reads them and reused by every decoding step after it.
  struct Joined {
    std::mutex mutex;
    std::string plugin;  // the fingerprint of the plug-in that built `blocks`
    int64_t anchor = 0;  // and the anchor they were built for
    std::vector<JointKV> blocks;
  };
  std::shared_ptr<Joined> joined = std::make_shared<Joined>();
};

class Linker {
 public:
  // keep_int8: int8 entries on `device` linked as stored, with their scales (a joint-attention
  // plug-in reads them so, dequantizing while it places them), int4 ones as their int8 codes;
  // otherwise read as float32.
  explicit Linker(c10::Device device, bool keep_int8 = false) : device_(device), keep_int8_(keep_int8) {}
  // One request's documents, in the order given.
  LinkedDocuments link(const std::vector<std::shared_ptr<const DocumentKV>>& documents) const;
  // A batch of requests, each with its own documents.
  LinkedDocuments link_batch(const std::vector<std::vector<std::shared_ptr<const DocumentKV>>>& documents) const;

 private:
  c10::Device device_;
  bool keep_int8_ = false;
};

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/document_kv.ipp"
#endif
