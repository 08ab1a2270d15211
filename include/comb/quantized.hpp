#pragma once
// Weight matrices kept quantized and multiplied as they are (CPU): GGUF's Q4_0 and Q4_1 as 4-bit
// groups of 32 (two weights a byte), Q8_0 as int8 groups of 32, each with float32 scales (and
// offsets). Few rows (decoding, short prompts) go through comb's row kernels, which dequantize a
// block of weights into L1 and multiply it as the float path does: for a GGUF file the same
// numbers as its weights expanded to float32, bit for bit. Many rows: dequantized chunks and a GEMM.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace comb {

// One matrix [rows, cols] in groups of 32 along each row, unpacked from a checkpoint's blocks:
// w = scale * q + min.
struct GroupedWeights {
  enum class Kind { q4, q8 };
  Kind kind = Kind::q4;
  at::Tensor q;      // [rows, cols]: uint8 in [0, 16) (q4) or int8 (q8)
  at::Tensor scale;  // [rows, cols / 32] float32
  at::Tensor min;    // [rows, cols / 32] float32 (q8: zeros)
  bool centered = false;  // GGUF Q4_0: w = scale * (q - 8), and min = -8 scale
  bool as_stored = true;  // dequantize() gives the checkpoint's own values (false: quantized on load)
  int64_t rows() const { return q.size(0); }
  int64_t cols() const { return q.size(1); }
  // The float32 matrix, computed as the checkpoint's own dequantization computes it (bit for bit).
  at::Tensor dequantize() const;
  // The same rows in another order: row r of the result is row index[r] (int64 [rows]).
  GroupedWeights select_rows(const at::Tensor& index) const;
  // Rows of several matrices of one kind, stacked (q|k|v, gate|up).
  static GroupedWeights cat(const std::vector<GroupedWeights>& parts);
  // A float matrix [rows, cols] quantized in groups of 32 along its rows: q4, w ~ scale * q + min
  // with the group's minimum and (max - min) / 15; q8, w ~ scale * q with max |w| / 127.
  static GroupedWeights quantize(const at::Tensor& w, Kind kind);
};

class TensorSource;
// `source` with its 2-D tensors of whole groups of 32 columns offered as groups (load_grouped),
// quantized on load to `kind`; everything else passes through. For --quantize int8 and int4.
std::unique_ptr<TensorSource> quantizing_source(std::unique_ptr<TensorSource> source, GroupedWeights::Kind kind);

class QuantizedMatrix {
 public:
  enum class Format { int4, q8_0 };
  static constexpr int64_t kGroup = 32;

  QuantizedMatrix() = default;
  // q4 weights -> 4 bits a weight, q8 -> int8; scales and offsets in float32. Nothing is quantized
  // again: the stored integers are the checkpoint's.
  static QuantizedMatrix from(const GroupedWeights& w);

  bool defined() const { return rows_ > 0; }
  Format format() const { return format_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  // x [..., cols] -> [..., rows] float32 (float32 activations throughout).
  at::Tensor apply(const at::Tensor& x) const;
  // The row kernels alone, for callers that split the work across their own threads: y[r, o] for
  // output rows o in [begin, end), x [n, cols] float32 with n <= kKernelRows, y [n, rows].
  static constexpr int64_t kKernelRows = 64;
  void apply_rows(const float* x, int64_t n, float* y, int64_t begin, int64_t end) const;
  // The float32 matrix [rows, cols] these weights stand for.
  at::Tensor dequantize() const;
  // Rows `ids` (int64, any shape) as float32 [ids..., cols]: an embedding lookup.
  at::Tensor gather_rows(const at::Tensor& ids) const;
  int64_t bytes() const;
  const char* format_name() const { return format_ == Format::int4 ? "int4 (groups of 32)" : "Q8_0 (int8, groups of 32)"; }

 private:
  // Rows [begin, end) as float32 into out [end - begin, cols].
  void dequantize_rows(int64_t begin, int64_t end, float* out) const;
  Format format_ = Format::int4;
  int64_t rows_ = 0, cols_ = 0;
  at::Tensor packed_;  // int4: [rows, cols / 2] uint8 (see detail::cpu::gemv_q4_rows); q8_0: int8 [rows, cols]
  at::Tensor scales_;  // [rows, cols / 32] float32
  at::Tensor mins_;    // int4: [rows, cols / 32] float32 (w = q * scale + min)
};

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/quantized.ipp"
#endif
