#pragma once
// The CUDA module's one-launch decoding step, seen from libcomb. libcomb links no CUDA library, so
// the step (fused kernels, cuBLAS, a captured CUDA graph) lives in the comb_cuda module, which
// registers its factory here when it is loaded (comb::load_cuda_backend); Decoder::forward takes
// it for short forwards (up to kStepRowsMax tokens: decoding steps, a warm request's question, with
// or without a plug-in's joint blocks) of a dense float16 or bfloat16 decoder on a CUDA device.
#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace comb::detail {

// Whether the environment leaves the CUDA path's switch `name` on: unset, or anything but "0".
inline bool env_on(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// What the step reads of a decoder: its sizes and dense weights (all on one CUDA device, one dtype).
struct DecodeStepSpec {
  int64_t n_layer = 0, n_embd = 0, n_ff = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_vocab = 0;
  double rms_eps = 1e-5;
  at::Tensor tok_embd;              // [n_vocab, n_embd]
  at::Tensor output_norm;           // [n_embd]
  at::Tensor output;                // [n_vocab, n_embd]
  at::Tensor rope_cos, rope_sin;    // [n_ctx, head_dim]
  // Per layer: attn_norm [n_embd], wqkv [q_dim + 2 kv_dim, n_embd], wo [n_embd, q_dim], ffn_norm
  // [n_embd], w_gate_up [2 n_ff, n_embd], w_down [n_embd, n_ff].
  std::vector<std::array<at::Tensor, 6>> layers;
};

// The most rows one step takes, and the bucket a step of n rows runs in: 1, 2, 4, ..., kStepRowsMax
// (one graph each).
inline constexpr int64_t kStepRowsMax = 128;
inline int64_t step_bucket(int64_t n) {
  int64_t b = 1;
  while (b < n) b *= 2;
  return b;
}
// The most rows Decoder::forward gives the step: 64, or COMB_CUDA_STEP_ROWS (1 to kStepRowsMax;
// else 64). A cold COMB request's prompt (an instruction and a question, ~65 rows) falls just past
// 64 onto the fused layers; 128 puts it on a graph at the cost of the rows kernel's attention over
// more rows, a trade measured on a GPU (bench/gpu_check.sh step 5) before it becomes the default.
inline int64_t step_rows() {
  static const int64_t rows = [] {
    const char* v = std::getenv("COMB_CUDA_STEP_ROWS");
    if (v == nullptr || *v == '\0') return int64_t(64);
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    return *end == '\0' && n >= 1 && n <= kStepRowsMax ? static_cast<int64_t>(n) : int64_t(64);
  }();
  return rows;
}

// What one layer's attention reads beside its context in a step (a plug-in's joint block): keys
// and values [n_head_kv, m, head_dim] (or [1, n_head_kv, m, head_dim]), contiguous, in the step's
// dtype on its device; bias float32 [n_head] or undefined (0); rows at positions before `anchor`
// read none. Undefined keys: the layer reads nothing.
struct StepJoined {
  at::Tensor keys, values, bias;
  int64_t anchor = 0;
};

class DecodeStep {
 public:
  virtual ~DecodeStep() = default;
  // Feeds tokens (1 to kStepRowsMax) at positions [position, position + n) of one sequence whose
  // caches are keys[l], values[l] [1, n_head_kv, capacity, head_dim], each layer l also reading
  // joined[l] (joined empty, or one per layer); position + n <= capacity. The step runs in the
  // bucket of n rows, step_bucket(n), padded with token 0 after the real rows; the padding neither
  // writes the cache nor attends, so nothing past position + n is touched. Returns float32 logits
  // [1, 1, n_vocab] of the last real row (a tensor of its own). Not thread-safe: one caller at a
  // time.
  virtual at::Tensor run(const std::vector<int64_t>& tokens, int64_t position, const std::vector<at::Tensor>& keys,
                         const std::vector<at::Tensor>& values, const std::vector<StepJoined>& joined) = 0;
};

// One document's K/V of one cross block for CudaLayerOps::join_documents: keys and values
// [n_head_kv, len, head_dim], contiguous, on the outputs' device: int8 with float16 scales (keys
// [n_head_kv, 1, head_dim] per channel or [n_head_kv, len, 1] per row, values [n_head_kv, len, 1]),
// float32, or the outputs' dtype. Placed in block `block`'s outputs at row `row`, positions
// [offset, offset + len), its keys turned by the RoPE angle `angle` (negative: back).
struct JoinPart {
  int64_t block = 0, row = 0, offset = 0, angle = 0;
  at::Tensor keys, values, key_scales, value_scales;
};

// The server's paged decoding step (Decoder::step_paged, rows without documents or reading a
// plug-in's joint blocks) as CUDA graphs, one per batch-size bucket, table width and whether rows
// read documents, each over static device buffers: ids [bucket] int64, positions [bucket] int64,
// block tables [bucket, max_blocks] int32, and where rows read documents each row's joined keys per
// layer, int64 [n_layer, bucket, 5] (CudaLayerOps::paged_attention_joined's parameters; zeros for
// a row or layer without them).
class PagedGraphs {
 public:
  virtual ~PagedGraphs() = default;
  // The step computed from the buffers alone (nothing read from the host): its output. joined:
  // undefined where no row reads documents.
  using Body = std::function<at::Tensor(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& table,
                                        const at::Tensor& joined)>;
  // Copies ids, positions (bucket values each), table (bucket * max_blocks) and joined (empty: no
  // row reads documents; else n_layer * bucket * 5 values) into the graph's buffers and replays it,
  // captured on its first run (after one plain run of body on a side stream); returns a copy of the
  // output. body's kernels must outlive the graphs; the tensors joined names must be alive until
  // the replay has run.
  virtual at::Tensor run(int64_t bucket, int64_t max_blocks, const std::vector<int64_t>& ids,
                         const std::vector<int64_t>& positions, const std::vector<int32_t>& table,
                         const std::vector<int64_t>& joined, const Body& body) = 0;
};

// The fused ops a CUDA layer of the generic forward runs (float16 or bfloat16, one sequence):
// the same kernels as the step's, as functions of tensors.
struct CudaLayerOps {
  // residual [rows, dim] += delta (when defined; in place); returns RMSNorm(residual) * weight.
  at::Tensor (*add_rms_norm)(const at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                             double eps) = nullptr;
  // qkv [n, (n_head + 2 n_head_kv) head_dim] at positions [position, position + n): rotated keys and
  // the values into the caches [1, n_head_kv, capacity, head_dim]; returns the rotated queries
  // [n, n_head, head_dim].
  at::Tensor (*rope_append)(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t position,
                            int64_t n_head) = nullptr;
  // Keys k [1, n_head_kv, n, head_dim] computed at positions [0, n) (last dimension contiguous)
  // rotated by position's angle into k_cache [1, n_head_kv, capacity, head_dim] at [position,
  // position + n) (cos, sin: the RoPE tables [n_ctx, head_dim]): a reused document placed.
  void (*place_keys)(const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                     int64_t position) = nullptr;
  // gate_up [.., 2 n_ff] -> silu(gate) * up [.., n_ff].
  at::Tensor (*silu_mul)(const at::Tensor& gate_up) = nullptr;
  // Rows q [n, n_head, head_dim] at positions [start, start + n) over the caches, causal; with
  // joined keys and values [n_head_kv, m, head_dim] (undefined: none) read in the same softmax by
  // rows at positions >= anchor, each score plus joined_bias [n_head] (float32; undefined: 0).
  // Returns [n, n_head, head_dim].
  at::Tensor (*rows_attention)(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               int64_t start, const at::Tensor& joined_keys, const at::Tensor& joined_values,
                               const at::Tensor& joined_bias, int64_t anchor) = nullptr;
  // Every part into out_keys[part.block], out_values[part.block] [rows, n_head_kv,
  // m, head_dim] (float16 or bfloat16, contiguous; what no part covers is left as it is), in one
  // launch: keys dequantized and rotated in float32 (cos, sin: float32 RoPE tables [n_ctx,
  // head_dim]), values copied, each rounded once.
  void (*join_documents)(const std::vector<JoinPart>& parts, const std::vector<at::Tensor>& out_keys,
                         const std::vector<at::Tensor>& out_values, const at::Tensor& cos,
                         const at::Tensor& sin) = nullptr;
  // Each document's K/V of each block, kv[d][b] = {keys, values} [n_head_kv, len, head_dim]
  // (float32 or one half type, contiguous, one CUDA device; a document's blocks of one length), in
  // int8 as the CPU quantizes them (document_kv.ipp's quantize_int8_cpu), bit for bit: out[d][b] =
  // {key codes, key scales, value codes, value scales} (float16 scales), one allocation per
  // document, two launches (each 65,535 document blocks).
  void (*quantize_int8)(const std::vector<std::vector<std::array<at::Tensor, 2>>>& kv,
                        std::vector<std::vector<std::array<at::Tensor, 4>>>& out) = nullptr;
  // The server's paged step (Decoder::step_paged): rows of several sequences whose K/V lie in a
  // block pool [n_blocks, n_head_kv, block_tokens, head_dim], each with its block table (int32
  // [rows, max_blocks]) and position (int64 [rows]) on the device.
  // qkv [rows, (n_head + 2 n_head_kv) head_dim]: each row's rotated key and value into its block;
  // returns the rotated queries [rows, n_head, head_dim].
  at::Tensor (*paged_rope_store)(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                 const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
                                 const at::Tensor& positions, int64_t n_head) = nullptr;
  // q [rows, n_head, head_dim], each row over its own positions [0, position] (longest: the most
  // positions a row reads, the joined keys apart), joined keys as rows_attention's for every row; returns
  // [rows, n_head, head_dim].
  at::Tensor (*paged_attention)(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                const at::Tensor& table, const at::Tensor& positions, int64_t longest,
                                const at::Tensor& joined_keys, const at::Tensor& joined_values,
                                const at::Tensor& joined_bias, int64_t anchor) = nullptr;
  // The free memory of CUDA device `index` (-1: the current one), in bytes (cudaMemGetInfo: what
  // LibTorch's allocator caches counts as used).
  int64_t (*free_memory)(int index) = nullptr;
  // An empty set of paged-step graphs on `device`.
  std::unique_ptr<PagedGraphs> (*paged_graphs)(c10::Device device) = nullptr;
  // CPU or CUDA tensors (one device) copied into one page-locked host allocation, a view each
  // (themselves when all are page-locked already): a host tier entry beside a CUDA device tier,
  // whose copies to the device then need no staging. The host waits for copies from the device.
  std::vector<at::Tensor> (*pin_host)(const std::vector<at::Tensor>& parts) = nullptr;
  // Host tensors copied to CUDA `device` on a stream of comb's own, without the host waiting
  // (page-locked ones; others are staged as a plain copy would). The device's current stream waits
  // for the copies on the device (an event): everything launched on it after the call reads them,
  // and what was queued on it before runs beside them. Other streams are not ordered after them.
  // The copies are allocated on comb's stream and marked as used by the current one (their memory,
  // once freed, is reused for comb's stream); sources from LibTorch's page-locked allocator are
  // kept until their copy has run.
  std::vector<at::Tensor> (*to_device_async)(const std::vector<at::Tensor>& from, c10::Device device) = nullptr;
  // paged_attention with each row's own joined keys, named by joined int64 [rows, 5] on the device:
  // [keys, values, bias (0: none), m (0: none), anchor] per row, the addresses of contiguous
  // [n_head_kv, m, head_dim] keys and values in q's dtype and of a float32 [n_head] bias, read when
  // the kernel runs (the paged graphs' joined table). The caller keeps them alive and well formed.
  at::Tensor (*paged_attention_joined)(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                       const at::Tensor& table, const at::Tensor& positions, int64_t longest,
                                       const at::Tensor& joined) = nullptr;
  // One block's K/V of each document copied out of a batch's, in one launch (each 65,535
  // documents): keys and values [batch, n_head_kv, n, head_dim] (the last dimension contiguous,
  // other strides any; one dtype of 2 or 4 bytes; a CUDA device), document d at batch row
  // rows[d][0], positions [rows[d][1], rows[d][1] + rows[d][2]), into outs[d] [blocks, 2, n_head_kv,
  // len, head_dim] (contiguous, the sources' dtype and device) at [block][0] (keys) and [block][1].
  void (*split_documents)(const at::Tensor& keys, const at::Tensor& values,
                          const std::vector<std::array<int64_t, 3>>& rows, const std::vector<at::Tensor>& outs,
                          int64_t block) = nullptr;
  // Rows qkv [.., (n_head + 2 n_head_kv) head_dim] (contiguous), in place: each row's query and key
  // heads turned by its own row of cos, sin [rows, head_dim] (qkv's dtype), as apply_rope rounds
  // (each product and the sum); value heads left (Decoder::layer_packed's rows). n_head_kv 0: rows
  // of n_head heads, every one turned (a cross block's document keys, Plugin::block_kv).
  void (*rope_rows)(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t n_head,
                    int64_t n_head_kv) = nullptr;
  // Opens (start) or closes the range a device profiler started with its capture off records
  // (cudaProfilerStart, cudaProfilerStop; `ncu --profile-from-start off`): `comb bench --profile 1`
  // opens it around the profiled decoding steps. Without a profiler attached it does nothing.
  // False where the runtime refused (its error cleared).
  bool (*profiler_range)(bool start) = nullptr;
  // Packed sequences' keys and values as the variable-length FlashAttention reads them, in one
  // launch: returns {keys, values} [n_seq * pre + rows, n_head_kv, head_dim] (contiguous), sequence
  // s's rows the first `pre` positions of prefix_keys, prefix_values [1, n_head_kv, >= pre,
  // head_dim] (undefined when pre is 0), then its own rows [first[s], first[s + 1]) of keys, values
  // [rows, n_head_kv, head_dim] (the last dimension contiguous, other strides any; one dtype of 2
  // or 4 bytes, the prefix's too; one CUDA device). The same as Decoder::PackedRows::gather's
  // index_select over [prefix; rows] (Decoder::layer_packed).
  std::array<at::Tensor, 2> (*pack_keys)(const at::Tensor& keys, const at::Tensor& values,
                                         const at::Tensor& prefix_keys, const at::Tensor& prefix_values,
                                         const std::vector<int64_t>& first, int64_t pre) = nullptr;
};

// graph: capture the step as a CUDA graph on its first run and replay it after (else: launch the
// same kernels one by one, for checking the graph against them).
using DecodeStepFactory = std::unique_ptr<DecodeStep> (*)(const DecodeStepSpec& spec, bool graph);

// Set by the comb_cuda module when it loads; null until then (or when comb has no CUDA ops).
void set_decode_step_factory(DecodeStepFactory factory);
DecodeStepFactory decode_step_factory();
void set_cuda_layer_ops(const CudaLayerOps* ops);
// The module's ops, or null: not loaded, or turned off with COMB_CUDA_KERNELS=0 (every caller then
// takes its ATen path).
const CudaLayerOps* cuda_layer_ops();

}  // namespace comb::detail
