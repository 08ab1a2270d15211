// Weight matrices kept quantized (see include/comb/quantized.hpp).
// Compiled into libcomb (src/quantized.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include "comb/quantized.hpp"

#include <ATen/record_function.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <map>
#include <optional>

#include "comb/detail/cpu_kernels.hpp"
#include "comb/error.hpp"
#include "comb/tensor_source.hpp"

// LibTorch exports this (its ahead-of-time compiler uses it) but ships no header for it (see
// decoder.ipp); weak, so that a LibTorch without it leaves the GEMM path on a copy.
namespace at::native {
__attribute__((weak)) void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
}

namespace comb {

namespace detail::quantized {  // this file's own helpers
// Past kKernelRows: output rows dequantized at a time (a layer's matrices whole; the 49,152-row head
// of the default model in 12 chunks of 9 MB).
COMB_INLINE constexpr int64_t kChunkRows = 4096;
// A new oneDNN tensor [rows, cols] whose memory is a plain row-major float array (its pointer in
// *data), or an undefined tensor where LibTorch does not give that (checked once).
COMB_INLINE at::Tensor plain_onednn(int64_t rows, int64_t cols, float** data) {
  static const bool plain = [] {
    if (!at::hasMKLDNN() || !at::native::data_ptr_from_mkldnn) return false;
    at::Tensor probe = at::empty({3, 5}, at::TensorOptions().dtype(at::kFloat).layout(at::kMkldnn));
    float* p = static_cast<float*>(at::native::data_ptr_from_mkldnn(probe));
    if (!p) return false;
    for (int i = 0; i < 15; ++i) p[i] = static_cast<float>(i);
    return probe.to_dense().equal(at::arange(15, at::kFloat).view({3, 5}));
  }();
  if (!plain) return at::Tensor();
  at::Tensor t = at::empty({rows, cols}, at::TensorOptions().dtype(at::kFloat).layout(at::kMkldnn));
  *data = static_cast<float*>(at::native::data_ptr_from_mkldnn(t));
  return t;
}
}  // namespace detail::quantized

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

namespace detail::quantized {  // this file's own helpers
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
}  // namespace detail::quantized

COMB_INLINE std::unique_ptr<TensorSource> quantizing_source(std::unique_ptr<TensorSource> source, GroupedWeights::Kind kind) {
  return std::make_unique<detail::quantized::QuantizingSource>(std::move(source), kind);
}

COMB_INLINE QuantizedMatrix QuantizedMatrix::from(const GroupedWeights& w) {
  const int64_t rows = w.rows(), cols = w.cols();
  COMB_CHECK(cols % kGroup == 0 && w.scale.size(0) == rows && w.scale.size(1) == cols / kGroup,
             "quantized matrix [{}, {}]: columns must be whole groups of {} with one scale each (found scales [{}, {}])",
             rows, cols, kGroup, w.scale.size(0), w.scale.size(1));
  QuantizedMatrix m;
  m.rows_ = rows;
  m.cols_ = cols;
  m.scales_ = w.scale.to(at::kFloat).contiguous();
  if (w.kind == GroupedWeights::Kind::q4) {
    m.format_ = Format::int4;
    // Two weights a byte: a group's weight j in the low nibble of its byte j, weight 16 + j in the high one.
    at::Tensor q = w.q.to(at::kByte).view({rows, cols / kGroup, 2, kGroup / 2});
    m.packed_ = (q.select(2, 0) | q.select(2, 1).mul(16)).reshape({rows, cols / 2}).contiguous();
    m.mins_ = w.min.to(at::kFloat).contiguous();  // Q4_0: -8 scale
  } else {
    m.format_ = Format::q8_0;
    m.packed_ = w.q.to(at::kChar).contiguous();
  }
  return m;
}

COMB_INLINE void QuantizedMatrix::dequantize_rows(int64_t begin, int64_t end, float* out) const {
  at::parallel_for(begin, end, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* w = out + (r - begin) * cols_;
      if (format_ == Format::q8_0)
        detail::cpu::dequantize_q8_row(packed_.data_ptr<int8_t>() + r * cols_, scales_.data_ptr<float>() + r * (cols_ / kGroup),
                                       cols_, w);
      else
        detail::cpu::dequantize_q4_row(packed_.data_ptr<uint8_t>() + r * (cols_ / 2),
                                       scales_.data_ptr<float>() + r * (cols_ / kGroup),
                                       mins_.data_ptr<float>() + r * (cols_ / kGroup), cols_, w);
    }
  });
}

COMB_INLINE at::Tensor QuantizedMatrix::dequantize() const {
  COMB_CHECK(defined(), "dequantize() of an empty quantized matrix");
  at::Tensor w = at::empty({rows_, cols_}, at::kFloat);
  dequantize_rows(0, rows_, w.data_ptr<float>());
  return w;
}

COMB_INLINE void QuantizedMatrix::apply_rows(const float* x, int64_t n, float* y, int64_t begin, int64_t end) const {
  COMB_CHECK(n <= kKernelRows && begin >= 0 && begin <= end && end <= rows_,
             "apply_rows: {} rows of input (at most {}), output rows [{}, {}) of {}", n, kKernelRows, begin, end, rows_);
  if (format_ == Format::q8_0)
    detail::cpu::gemv_q8_rows(x, n, packed_.data_ptr<int8_t>(), scales_.data_ptr<float>(), cols_, y, rows_, begin, end);
  else
    detail::cpu::gemv_q4_rows(x, n, packed_.data_ptr<uint8_t>(), scales_.data_ptr<float>(), mins_.data_ptr<float>(),
                              cols_, y, rows_, begin, end);
}

COMB_INLINE at::Tensor QuantizedMatrix::apply(const at::Tensor& x) const {
  COMB_CHECK(defined(), "apply() of an empty quantized matrix");
  COMB_CHECK(x.size(-1) == cols_, "quantized matrix [{}, {}] applied to input with {} columns", rows_, cols_, x.size(-1));
  COMB_CHECK(x.device().is_cpu(), "quantized weights run on the CPU only, found input on {}", x.device().str());
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = rows_;
  const int64_t n = x.numel() / cols_;
  RECORD_FUNCTION(format_ == Format::int4 ? "comb::int4_matmul" : "comb::q8_matmul", std::vector<c10::IValue>());
  at::Tensor in = x.reshape({n, cols_}).to(at::kFloat).contiguous();
  at::Tensor out = at::empty({n, rows_}, in.options());
  if (n <= kKernelRows) {  // rows up to the decoder's own bound for its float row kernel: the same numbers
    at::parallel_for(0, rows_, 256,
                     [&](int64_t b, int64_t e) { apply_rows(in.data_ptr<float>(), n, out.data_ptr<float>(), b, e); });
  } else {
    // oneDNN's GEMM over the dequantized floats in their plain layout: the float path's own prefill
    // GEMM (Decoder::prepack_onednn), so the same numbers there too when a matrix fits one chunk.
    // The weights are dequantized straight into a oneDNN tensor (no copy) where LibTorch allows.
    const int64_t chunk = std::min(rows_, detail::quantized::kChunkRows);
    at::Tensor in_onednn = at::hasMKLDNN() ? in.to_mkldnn() : at::Tensor();
    for (int64_t r = 0; r < rows_; r += chunk) {
      const int64_t len = std::min(chunk, rows_ - r);
      float* data = nullptr;
      at::Tensor w = detail::quantized::plain_onednn(len, cols_, &data), y;
      if (w.defined()) {
        dequantize_rows(r, r + len, data);
        y = at::mkldnn_linear(in_onednn, w).to_dense();
      } else {
        at::Tensor dense = at::empty({len, cols_}, at::kFloat);
        dequantize_rows(r, r + len, dense.data_ptr<float>());
        y = in_onednn.defined() ? at::mkldnn_linear(in_onednn, dense.to_mkldnn()).to_dense() : at::linear(in, dense);
      }
      if (len == rows_) return y.view(shape);
      out.narrow(1, r, len).copy_(y);
    }
  }
  return out.view(shape);
}

COMB_INLINE at::Tensor QuantizedMatrix::gather_rows(const at::Tensor& ids) const {
  COMB_CHECK(defined(), "gather_rows() of an empty quantized matrix");
  at::Tensor flat = ids.reshape({-1}).to(at::kLong);
  std::vector<int64_t> shape = ids.sizes().vec();
  shape.push_back(cols_);
  at::Tensor out = at::empty({flat.numel(), cols_}, at::kFloat);
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    COMB_CHECK(id[i] >= 0 && id[i] < rows_, "row {} of a quantized matrix of {} rows", id[i], rows_);
    dequantize_rows(id[i], id[i] + 1, out.data_ptr<float>() + i * cols_);
  }
  return out.view(shape);
}

COMB_INLINE int64_t QuantizedMatrix::bytes() const {
  int64_t n = packed_.numel() * packed_.element_size() + scales_.numel() * scales_.element_size();
  if (mins_.defined()) n += mins_.numel() * mins_.element_size();
  return n;
}

}  // namespace comb
