// The memory bound of an optimizer step, measured: the same arrays, access pattern,
// threads and chunking as the CPU kernels (kernels/cpu_simd.h), with the
// arithmetic taken out. Each element reads `reads` fp32 arrays and writes the first
// `writes` of them back (unchanged: scale is 0 at run time, which the compiler cannot
// know), e.g. Adam: 4 reads (p, g, m, v), 3 writes (p, m, v). Built and timed by
// scripts/bench_adam.py; an optimizer step cannot run faster than this on the machine.
#include "cpu_simd.h"

namespace {

void probe_span(float* const* arrays, int reads, int writes, float scale, int64_t begin, int64_t end) {
  int64_t i = begin;
#if defined(__AVX512F__) || defined(__AVX2__)
  using S = ds::Simd;
  const auto k = S::set1(scale);
  for (; i + S::kWidth <= end; i += S::kWidth) {
    auto sum = S::set1(0.0f);
    for (int a = 0; a < reads; ++a) {
      sum = S::add(sum, S::load(arrays[a] + i));
    }
    for (int a = 0; a < writes; ++a) S::store(arrays[a] + i, S::fma(k, sum, S::load(arrays[a] + i)));
  }
#endif
  for (; i < end; ++i) {
    float sum = 0.0f;
    for (int a = 0; a < reads; ++a) sum += arrays[a][i];
    for (int a = 0; a < writes; ++a) arrays[a][i] += scale * sum;
  }
}

}  // namespace

DS_EXPORT int ds_stream_probe(int64_t numel, float* const* arrays, int32_t reads, int32_t writes, float scale,
                              int32_t num_threads) {
  if (writes > reads || reads < 1) return -1;
  const int64_t numels[1] = {numel};
  ds::for_each_span(1, numels, num_threads,
                    [&](int64_t, int64_t b, int64_t e) { probe_span(arrays, reads, writes, scale, b, e); });
  return 0;
}
