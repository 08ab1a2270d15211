#pragma once
// Host values onto a device without the host waiting for the device's queue (defined in
// impl/decoder.ipp and, upload(), impl/document_kv.ipp; compiled into libcomb).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace comb::detail {
// Host integers as a tensor of `type` (int64 or int32) on `device`. On a CUDA device they are copied
// from page-locked memory without the host waiting for the device's queue (LibTorch's host allocator
// keeps that memory until the copy has run): a plain copy from pageable memory would wait for every
// launch queued before it. Elsewhere at::tensor's tensor.
at::Tensor upload_ints(const std::vector<int64_t>& values, c10::ScalarType type, c10::Device device);
at::Tensor upload_ints(const std::vector<int32_t>& values, c10::ScalarType type, c10::Device device);
// `t` on `device`: from the host to a CUDA device the same way (through page-locked memory, the host
// not waiting; a plain copy where no page-locked memory is left); elsewhere t.to(device).
// DocumentKV::to moves every part this way.
at::Tensor upload(const at::Tensor& t, c10::Device device);
}  // namespace comb::detail
