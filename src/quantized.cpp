// Weight matrices kept quantized (see include/comb/quantized.hpp).
#include "comb/quantized.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "comb/detail/cpu_kernels.hpp"
#include "comb/error.hpp"

namespace comb {

namespace {
// Rows up to this many go through the Q8_0 kernel; more are multiplied in chunks of dequantized rows.
constexpr int64_t kQ8KernelRows = 4;
constexpr int64_t kQ8ChunkRows = 4096;  // output rows dequantized at a time (9 MB of float32 at 576 columns)
}  // namespace

at::Tensor GroupedWeights::dequantize() const {
  const int64_t groups = cols() / QuantizedMatrix::kGroup;
  at::Tensor qf = q.to(at::kFloat).view({rows(), groups, QuantizedMatrix::kGroup});
  at::Tensor s = scale.unsqueeze(-1);
  at::Tensor w = centered ? (qf - 8) * s : kind == Kind::q8 ? qf * s : qf * s + min.unsqueeze(-1);
  return w.view({rows(), cols()});
}

GroupedWeights GroupedWeights::select_rows(const at::Tensor& index) const {
  GroupedWeights out = *this;
  out.q = q.index_select(0, index).contiguous();
  out.scale = scale.index_select(0, index).contiguous();
  out.min = min.index_select(0, index).contiguous();
  return out;
}

GroupedWeights GroupedWeights::cat(const std::vector<GroupedWeights>& parts) {
  COMB_CHECK(!parts.empty(), "GroupedWeights::cat needs at least one part");
  std::vector<at::Tensor> q, s, m;
  for (const auto& p : parts) {
    COMB_CHECK(p.kind == parts[0].kind && p.cols() == parts[0].cols(),
               "quantized matrices stacked together must share kind and columns ({} and {} columns)", p.cols(),
               parts[0].cols());
    q.push_back(p.q), s.push_back(p.scale), m.push_back(p.min);
  }
  GroupedWeights out;
  out.kind = parts[0].kind;
  for (const auto& p : parts)
    COMB_CHECK(p.centered == parts[0].centered, "quantized matrices stacked together must share their type (Q4_0 and Q4_1 mixed)");
  out.centered = parts[0].centered;
  out.q = at::cat(q, 0);
  out.scale = at::cat(s, 0);
  out.min = at::cat(m, 0);
  return out;
}

QuantizedMatrix QuantizedMatrix::from(const GroupedWeights& w) {
  const int64_t rows = w.rows(), cols = w.cols();
  COMB_CHECK(cols % kGroup == 0 && w.scale.size(0) == rows && w.scale.size(1) == cols / kGroup,
             "quantized matrix [{}, {}]: columns must be whole groups of {} with one scale each (found scales [{}, {}])",
             rows, cols, kGroup, w.scale.size(0), w.scale.size(1));
  QuantizedMatrix m;
  m.rows_ = rows;
  m.cols_ = cols;
  if (w.kind == GroupedWeights::Kind::q4) {
    m.format_ = Format::int4;
    // ATen's int4 weights: w = (q - 8) * scale + zero, so zero = min + 8 scale.
    m.packed_ = at::_convert_weight_to_int4pack_for_cpu(w.q.to(at::kInt).contiguous(), 1);
    at::Tensor zero = w.min + 8 * w.scale;
    m.scales_ = at::stack({w.scale.t(), zero.t()}, -1).to(at::kBFloat16).contiguous();  // [cols / 32, rows, 2]
  } else {
    m.format_ = Format::q8_0;
    m.packed_ = w.q.to(at::kChar).contiguous();
    m.scales_ = w.scale.to(at::kFloat).contiguous();
  }
  return m;
}

at::Tensor QuantizedMatrix::dequantize() const {
  COMB_CHECK(defined(), "dequantize() of an empty quantized matrix");
  if (format_ == Format::q8_0)
    return (packed_.to(at::kFloat).view({rows_, cols_ / kGroup, kGroup}) * scales_.unsqueeze(-1)).view({rows_, cols_});
  // The packed layout is ATen's own: the kernel itself unpacks it. With unit scales and zero
  // offsets, the identity through it gives q - 8 exactly (small integers are exact in bfloat16);
  // the scales are then applied in float32, as the kernel applies them.
  at::Tensor eye = at::eye(cols_, at::TensorOptions().dtype(at::kBFloat16));
  at::Tensor unit = at::stack({at::ones({cols_ / kGroup, rows_}), at::zeros({cols_ / kGroup, rows_})}, -1).to(at::kBFloat16);
  at::Tensor q = at::_weight_int4pack_mm_for_cpu(eye, packed_, kGroup, unit).to(at::kFloat).t();  // [rows, cols]
  at::Tensor sz = scales_.to(at::kFloat);                                                         // [groups, rows, 2]
  at::Tensor scale = sz.select(-1, 0).t().unsqueeze(-1), zero = sz.select(-1, 1).t().unsqueeze(-1);
  return (q.reshape({rows_, cols_ / kGroup, kGroup}) * scale + zero).reshape({rows_, cols_}).contiguous();
}

at::Tensor QuantizedMatrix::apply(const at::Tensor& x) const {
  COMB_CHECK(defined(), "apply() of an empty quantized matrix");
  COMB_CHECK(x.size(-1) == cols_, "quantized matrix [{}, {}] applied to input with {} columns", rows_, cols_, x.size(-1));
  COMB_CHECK(x.device().is_cpu(), "quantized weights run on the CPU only, found input on {}", x.device().str());
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = rows_;
  const int64_t n = x.numel() / cols_;
  if (format_ == Format::int4) {
    at::Tensor flat = x.reshape({n, cols_}).to(at::kBFloat16).contiguous();
    return at::_weight_int4pack_mm_for_cpu(flat, packed_, kGroup, scales_).to(at::kFloat).view(shape);
  }
  at::Tensor in = x.reshape({n, cols_}).to(at::kFloat).contiguous();
  at::Tensor out = at::empty({n, rows_}, in.options());
  if (n <= kQ8KernelRows) {
    at::parallel_for(0, rows_, 256, [&](int64_t b, int64_t e) {
      detail::cpu::gemv_q8_rows(in.data_ptr<float>(), n, packed_.data_ptr<int8_t>(), scales_.data_ptr<float>(), cols_,
                                out.data_ptr<float>(), rows_, b, e);
    });
  } else {
    for (int64_t r = 0; r < rows_; r += kQ8ChunkRows) {
      const int64_t len = std::min(kQ8ChunkRows, rows_ - r);
      at::Tensor w = (packed_.narrow(0, r, len).to(at::kFloat).view({len, cols_ / kGroup, kGroup}) *
                      scales_.narrow(0, r, len).unsqueeze(-1))
                         .view({len, cols_});
      out.narrow(1, r, len).copy_(at::linear(in, w));
    }
  }
  return out.view(shape);
}

at::Tensor QuantizedMatrix::gather_rows(const at::Tensor& ids) const {
  COMB_CHECK(defined(), "gather_rows() of an empty quantized matrix");
  at::Tensor flat = ids.reshape({-1}).to(at::kLong);
  std::vector<int64_t> shape = ids.sizes().vec();
  shape.push_back(cols_);
  if (format_ == Format::q8_0) {
    at::Tensor q = packed_.index_select(0, flat).to(at::kFloat).view({-1, cols_ / kGroup, kGroup});
    return (q * scales_.index_select(0, flat).unsqueeze(-1)).view(shape);
  }
  return dequantize().index_select(0, flat).view(shape);  // not used by GGUF models (embeddings are Q8_0 or float)
}

int64_t QuantizedMatrix::bytes() const {
  return packed_.numel() * packed_.element_size() + scales_.numel() * scales_.element_size();
}

}  // namespace comb
