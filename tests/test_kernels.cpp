// comb's CPU kernels on each instruction set this CPU has: a result never depends on the rows or
// outputs computed beside it (exact), the paths agree within their rounding bounds (bounds.hpp),
// and COMB_CPU_ISA caps what the kernels use.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "bounds.hpp"
#include "comb/detail/cpu_kernels.hpp"

using namespace comb::test;
namespace cpu = comb::detail::cpu;

namespace {

struct Gemv {
  int64_t m, k, n;
  std::vector<float> x, w;
};

Gemv random_gemv(int64_t m, int64_t k, int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  Gemv g{m, k, n, std::vector<float>(m * k), std::vector<float>(n * k)};
  for (float& v : g.x) v = normal(gen);
  for (float& v : g.w) v = normal(gen);
  return g;
}

std::vector<float> run(cpu::Isa isa, const Gemv& g) {
  std::vector<float> y(g.m * g.n);
  cpu::gemv_rows_on(isa, g.x.data(), g.m, g.w.data(), g.k, y.data(), g.n, 0, g.n);
  return y;
}

int64_t depth(cpu::Isa isa, int64_t k) {
  switch (isa) {
    case cpu::Isa::avx512: return gemv_depth_avx512(k);
    case cpu::Isa::avx2: return gemv_depth_avx2(k);
    default: return gemv_depth_scalar(k);
  }
}

// Every output of two paths within (gamma(h_a) + gamma(h_b)) sum_i |x_i w_i| (bounds.hpp); the
// sums of magnitudes in double. Returns the largest difference as a fraction of its bound.
double worst_against_bound(cpu::Isa a, cpu::Isa b, const Gemv& g) {
  const std::vector<float> ya = run(a, g), yb = run(b, g);
  const double per_unit = gamma32(depth(a, g.k)) + gamma32(depth(b, g.k));
  double worst = 0;
  for (int64_t r = 0; r < g.m; ++r)
    for (int64_t o = 0; o < g.n; ++o) {
      double magnitude = 0;
      for (int64_t i = 0; i < g.k; ++i) magnitude += std::fabs(double(g.x[r * g.k + i]) * g.w[o * g.k + i]);
      const double diff = std::fabs(double(ya[r * g.n + o]) - yb[r * g.n + o]);
      worst = std::max(worst, diff / (per_unit * magnitude));
    }
  return worst;
}

const int64_t kLengths[] = {1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 576, 1536};

}  // namespace

TEST_CASE("kernels: a gemv result depends on its own row and output only, on every instruction set", "[kernels]") {
  for (cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512}) {
    if (isa > cpu::cpu_isa()) continue;
    INFO(cpu::isa_name(isa));
    for (int64_t k : kLengths) {
      // 11 rows: every row tile (4, 2, 1); 21 outputs: whole blocks of 4 and 8 and the ones after.
      const Gemv g = random_gemv(11, k, 21, static_cast<uint32_t>(k));
      const std::vector<float> all = run(isa, g);
      INFO("k = " << k);
      for (int64_t r = 0; r < g.m; ++r) {  // each row alone, its outputs in two ranges
        std::vector<float> alone(g.n);
        const int64_t split = 5;
        cpu::gemv_rows_on(isa, g.x.data() + r * k, 1, g.w.data(), k, alone.data(), g.n, 0, split);
        cpu::gemv_rows_on(isa, g.x.data() + r * k, 1, g.w.data(), k, alone.data(), g.n, split, g.n);
        for (int64_t o = 0; o < g.n; ++o) REQUIRE(alone[o] == all[r * g.n + o]);  // the same operations in order
      }
    }
  }
}

TEST_CASE("kernels: AVX-512 against AVX2 gemv, within both paths' rounding bounds", "[kernels]") {
  if (cpu::cpu_isa() < cpu::Isa::avx512) {
    WARN("skipped: this CPU has no AVX-512 (its widest path is " << cpu::isa_name(cpu::cpu_isa())
                                                                  << "); the comparison runs where it has");
    return;
  }
  for (int64_t k : kLengths) {
    INFO("k = " << k);
    // Bound per output: (gamma(ceil(k/16) + 4) + gamma(k/8 + 3 + k%8 + 1)) sum|x_i w_i| (bounds.hpp).
    CHECK(worst_against_bound(cpu::Isa::avx512, cpu::Isa::avx2, random_gemv(9, k, 19, 100 + k)) <= 1.0);
  }
}

TEST_CASE("kernels: AVX2 gemv against the portable (scalar) path, within both paths' rounding bounds", "[kernels]") {
  if (cpu::cpu_isa() < cpu::Isa::avx2) {
    WARN("skipped: this CPU has no AVX2 with FMA; only the scalar path runs here");
    return;
  }
  for (int64_t k : kLengths) {
    INFO("k = " << k);
    // Bound per output: (gamma(k/8 + 3 + k%8 + 1) + gamma(k + 1)) sum|x_i w_i| (bounds.hpp).
    CHECK(worst_against_bound(cpu::Isa::avx2, cpu::Isa::scalar, random_gemv(9, k, 19, 200 + k)) <= 1.0);
  }
}

TEST_CASE("kernels: COMB_CPU_ISA caps the instruction set the kernels use", "[kernels]") {
  const char* cap = std::getenv("COMB_CPU_ISA");
  const cpu::Isa want = cap && *cap ? std::min(cpu::cpu_isa(), cpu::parse_isa(cap)) : cpu::cpu_isa();
  INFO("COMB_CPU_ISA=" << (cap ? cap : "(unset)") << ", CPU " << cpu::isa_name(cpu::cpu_isa()));
  CHECK(cpu::kernel_isa() == want);
  // gemv_rows is gemv_rows_on(kernel_isa()): the same numbers.
  const Gemv g = random_gemv(3, 100, 9, 7);
  std::vector<float> y(g.m * g.n);
  cpu::gemv_rows(g.x.data(), g.m, g.w.data(), g.k, y.data(), g.n, 0, g.n);
  CHECK(y == run(cpu::kernel_isa(), g));
  CHECK(cpu::parse_isa("avx2") == cpu::Isa::avx2);
  CHECK_THROWS_WITH(cpu::parse_isa("avx"), Catch::Contains("COMB_CPU_ISA: expected avx512, avx2 or scalar, found 'avx'"));
  if (cpu::cpu_isa() < cpu::Isa::avx512)
    CHECK_THROWS_WITH(run(cpu::Isa::avx512, g), Catch::Contains("this CPU has no avx512"));
}
