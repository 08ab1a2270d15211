#pragma once
// How far apart two float32 computations of the same numbers may be, from their arithmetic alone.
// A comparison in tests/ between two paths (whole and in pieces, batched and alone, fused and
// composed, one instruction set and another) is either exact by construction (the same kernel in
// the same order: at::equal) or takes its bound from here, with the reason written beside it.
//
// The rule (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1): a sum
// of products in float32, in any order, in which every product passes through at most h roundings
// (a fused multiply-add is one), is within gamma(h) = h u / (1 - h u) times the sum of the terms'
// magnitudes of the exact value; u = 2^-24. Two such computations of one sum are therefore within
// (gamma(h1) + gamma(h2)) * sum|terms| of each other, whatever the CPU and the order each took.
#include <algorithm>
#include <cstdint>

namespace comb::test {

// float32's unit roundoff.
constexpr double kUnitRoundoff = 1.0 / (1 << 24);

// gamma(h) = h u / (1 - h u), for h u < 1.
constexpr double gamma32(int64_t h) { return h * kUnitRoundoff / (1 - h * kUnitRoundoff); }

// The most roundings a product passes through in detail::cpu::gemv_rows_on's paths for a dot
// product of length k (cpu_kernels.hpp says how each sums):
// AVX-512: one lane's ceil(k / 16) fused multiply-adds, then the 4 levels of the horizontal sum.
constexpr int64_t gemv_depth_avx512(int64_t k) { return (k + 15) / 16 + 4; }
// AVX2: one lane's k / 8 fused multiply-adds, the 3 levels of the horizontal sum, then the last
// k % 8 products added one by one, each perhaps rounded before it is added (+1).
constexpr int64_t gemv_depth_avx2(int64_t k) { return k / 8 + 3 + k % 8 + 1; }
// Scalar (portable loops): each product rounded, k / 8 additions in its partial sum, the 3 levels
// of their pairwise sum, then the last k % 8 products added one by one.
constexpr int64_t gemv_depth_scalar(int64_t k) { return 1 + k / 8 + 3 + k % 8; }

// Through a stack of layers (a decoder, an encoder), no such bound follows from the arithmetic
// alone: a layer's output depends on its input through the weights, not only through rounding. So
// the comparisons of two paths through `layers` layers use this first-order model, and say so:
//   - each layer's rounding is at most gamma(k) of its magnitude per path, k its longest
//     accumulation (the longest dot product: n_ff for the down projection, or the number of keys
//     an attention row sums over, whichever is longer), the magnitude being the compared tensor's
//     largest absolute value `scale` (RMSNorm brings every layer's input back to one scale);
//   - a difference that enters a layer leaves it no larger relative to that scale (first order:
//     the normalised input's relative error is the residual's);
// hence at most 2 * layers * gamma(k) * scale between two paths. gamma(k) is the worst case of
// every rounding pushing the same way; rounding errors of opposite signs make the typical error
// about sqrt(k) u (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019), so the bound keeps a
// margin of sqrt(k) (25 to 40 at these widths) for the amplification the first-order model leaves out.
constexpr double layers_bound_relative(int64_t layers, double relative, double scale) {
  return 2.0 * std::max<int64_t>(layers, 1) * relative * std::max(scale, 1.0);
}
constexpr double layers_bound(int64_t layers, int64_t k, double scale) {
  return layers_bound_relative(layers, gamma32(k), scale);
}

// bfloat16's unit roundoff (8 significant bits): K/V kept in it are within this of their float32
// values, relatively; a layer reading them carries that much more (layers_bound_relative).
constexpr double kUnitRoundoffBf16 = 1.0 / 256;

}  // namespace comb::test
