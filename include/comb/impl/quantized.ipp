// Weight matrices kept quantized (see include/comb/quantized.hpp).
// Compiled into libcomb (src/quantized.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include "comb/quantized.hpp"

#include <ATen/record_function.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdlib>
#include <map>
#include <optional>

#include "comb/detail/cpu_kernels.hpp"
#include "comb/error.hpp"
#include "comb/tensor_source.hpp"

namespace comb {

namespace impl_quantized {  // this file's own helpers
// Rows up to this many go through the Q8_0 kernel; more are multiplied in chunks of dequantized rows.
COMB_INLINE constexpr int64_t kQ8KernelRows = 32;
COMB_INLINE constexpr int64_t kQ8ChunkRows = 4096;  // output rows dequantized at a time (9 MB of float32 at 576 columns)
}  // namespace impl_quantized
using namespace impl_quantized;

COMB_INLINE at::Tensor GroupedWeights::dequantize() const {
  const int64_t groups = cols() / QuantizedMatrix::kGroup;
  at::Tensor qf = q.to(at::kFloat).view({rows(), groups, QuantizedMatrix::kGroup});
  at::Tensor s = scale.unsqueeze(-1);
  at::Tensor w = centered ? (qf - 8) * s : kind == Kind::q8 ? qf * s : qf * s + min.unsqueeze(-1);
  return w.view({rows(), cols()});
}

COMB_INLINE GroupedWeights GroupedWeights::select_rows(const at::Tensor& index) const {
  GroupedWeights out = *this;
  out.q = q.index_select(0, index).contiguous();
  out.scale = scale.index_select(0, index).contiguous();
  out.min = min.index_select(0, index).contiguous();
  return out;
}

COMB_INLINE GroupedWeights GroupedWeights::cat(const std::vector<GroupedWeights>& parts) {
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
  out.as_stored = parts[0].as_stored;
  out.q = at::cat(q, 0);
  out.scale = at::cat(s, 0);
  out.min = at::cat(m, 0);
  return out;
}

COMB_INLINE GroupedWeights GroupedWeights::quantize(const at::Tensor& weights, Kind kind) {
  COMB_CHECK(weights.dim() == 2 && weights.size(1) % QuantizedMatrix::kGroup == 0,
             "only a matrix of whole groups of 32 columns is quantized, found shape [{}]", fmt::join(weights.sizes(), ", "));
  const int64_t rows = weights.size(0), cols = weights.size(1), groups = cols / QuantizedMatrix::kGroup;
  at::Tensor w = weights.to(at::kFloat).reshape({rows, groups, QuantizedMatrix::kGroup});
  GroupedWeights g;
  g.kind = kind;
  g.as_stored = false;
  if (kind == Kind::q8) {
    at::Tensor scale = w.abs().amax(-1) / 127;  // [rows, groups]
    at::Tensor safe = at::where(scale > 0, scale, at::ones_like(scale));
    g.q = (w / safe.unsqueeze(-1)).round().clamp(-127, 127).to(at::kChar).reshape({rows, cols});
    g.scale = scale;
    g.min = at::zeros_like(scale);
  } else {
    at::Tensor lo = w.amin(-1), hi = w.amax(-1);
    at::Tensor scale = (hi - lo) / 15;
    at::Tensor safe = at::where(scale > 0, scale, at::ones_like(scale));
    g.q = ((w - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).round().clamp(0, 15).to(at::kByte).reshape({rows, cols});
    g.scale = scale;
    g.min = lo;
  }
  return g;
}

namespace impl_quantized {  // this file's own helpers
class QuantizingSource : public TensorSource {
 public:
  QuantizingSource(std::unique_ptr<TensorSource> inner, GroupedWeights::Kind kind) : inner_(std::move(inner)), kind_(kind) {
    for (const auto& name : inner_->names()) {
      TensorInfo info = *inner_->find(name);
      if (info.shape.size() == 2 && info.shape[1] % QuantizedMatrix::kGroup == 0)
        info.dtype = kind_of(name) == GroupedWeights::Kind::q8 ? "Q8_0" : "Q4_1";  // what load_grouped() will give
      infos_[name] = info;
    }
  }
  std::vector<std::string> names() const override { return inner_->names(); }
  const TensorInfo* find(const std::string& name) const override {
    auto it = infos_.find(name);
    return it == infos_.end() ? nullptr : &it->second;
  }
  at::Tensor load(const std::string& name, c10::ScalarType dtype) const override { return inner_->load(name, dtype); }
  std::optional<GroupedWeights> load_grouped(const std::string& name) const override {
    const TensorInfo* info = find(name);
    if (!info || info->shape.size() != 2 || info->shape[1] % QuantizedMatrix::kGroup != 0) return std::nullopt;
    return GroupedWeights::quantize(inner_->load(name, at::kFloat), kind_of(name));
  }
  // The embedding and the output head stay int8 whatever the layers get: a lookup reads int8 rows
  // directly, and the head's error reaches every logit.
  GroupedWeights::Kind kind_of(const std::string& name) const {
    for (const char* head : {"embed_tokens", "token_embd", "lm_head", "output.weight"})
      if (name.find(head) != std::string::npos) return GroupedWeights::Kind::q8;
    return kind_;
  }
  std::string where() const override { return inner_->where(); }

 private:
  std::unique_ptr<TensorSource> inner_;
  GroupedWeights::Kind kind_;
  std::map<std::string, TensorInfo> infos_;
};
}  // namespace impl_quantized
using namespace impl_quantized;

COMB_INLINE std::unique_ptr<TensorSource> quantizing_source(std::unique_ptr<TensorSource> source, GroupedWeights::Kind kind) {
  return std::make_unique<QuantizingSource>(std::move(source), kind);
}

COMB_INLINE QuantizedMatrix QuantizedMatrix::from(const GroupedWeights& w) {
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
    at::Tensor scales = at::stack({w.scale.t(), zero.t()}, -1).contiguous();  // [cols / 32, rows, 2] float32
    m.scales_ = scales.to(at::kBFloat16);
    const char* exact = std::getenv("COMB_INT4_FLOAT32");
    if (exact && *exact && std::string(exact) != "0") m.float_scales_ = scales;
  } else {
    m.format_ = Format::q8_0;
    m.packed_ = w.q.to(at::kChar).contiguous();
    m.scales_ = w.scale.to(at::kFloat).contiguous();
  }
  return m;
}

COMB_INLINE at::Tensor QuantizedMatrix::dequantize() const {
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

COMB_INLINE at::Tensor QuantizedMatrix::apply(const at::Tensor& x) const {
  COMB_CHECK(defined(), "apply() of an empty quantized matrix");
  COMB_CHECK(x.size(-1) == cols_, "quantized matrix [{}, {}] applied to input with {} columns", rows_, cols_, x.size(-1));
  COMB_CHECK(x.device().is_cpu(), "quantized weights run on the CPU only, found input on {}", x.device().str());
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = rows_;
  const int64_t n = x.numel() / cols_;
  RECORD_FUNCTION(format_ == Format::int4 ? "comb::int4_matmul" : "comb::q8_matmul", std::vector<c10::IValue>());
  if (format_ == Format::int4 && float_scales_.defined()) {
    at::Tensor flat = x.reshape({n, cols_}).to(at::kFloat).contiguous();
    return at::_weight_int4pack_mm_for_cpu(flat, packed_, kGroup, float_scales_).view(shape);
  }
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

COMB_INLINE at::Tensor QuantizedMatrix::gather_rows(const at::Tensor& ids) const {
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

COMB_INLINE int64_t QuantizedMatrix::bytes() const {
  return packed_.numel() * packed_.element_size() + scales_.numel() * scales_.element_size();
}

}  // namespace comb
