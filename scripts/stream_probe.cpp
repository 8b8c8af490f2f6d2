// The memory bound of an optimizer step, measured: the same arrays, access pattern,
// threads and thread split as the CPU kernels (kernels/cpu_simd.h), with the
// arithmetic taken out. Each element reads `reads` fp32 arrays and writes the first
// `writes` of them back (unchanged: scale is 0 at run time, which the compiler cannot
// know), e.g. Adam: 4 reads (p, g, m, v), 3 writes (p, m, v). Built and timed by
// scripts/bench_adam.py; an optimizer step cannot run faster than this on the machine.
#include "cpu_simd.h"

namespace {

// R reads, the first W written back. R and W are compile-time constants for the optimizers'
// patterns, so the loop is as tight as a kernel's (pointers in registers, fully unrolled);
// R = W = 0 takes the run-time counts, for any other pattern.
template <int R, int W>
void probe_span(float* const* arrays, int reads, int writes, float scale, int64_t begin, int64_t end) {
  if (R > 0) reads = R, writes = W;
  float* ptr[8];
  for (int a = 0; a < reads; ++a) ptr[a] = arrays[a];
  int64_t i = begin;
#if defined(__AVX512F__) || defined(__AVX2__)
  using S = ds::Simd;
  const auto k = S::set1(scale);
  for (; i + S::kWidth <= end; i += S::kWidth) {
    auto sum = S::set1(0.0f);
    for (int a = 0; a < reads; ++a) sum = S::add(sum, S::load(ptr[a] + i));
    for (int a = 0; a < writes; ++a) S::store(ptr[a] + i, S::fma(k, sum, S::load(ptr[a] + i)));
  }
#endif
  for (; i < end; ++i) {
    float sum = 0.0f;
    for (int a = 0; a < reads; ++a) sum += ptr[a][i];
    for (int a = 0; a < writes; ++a) ptr[a][i] = std::fma(scale, sum, ptr[a][i]);
  }
}

}  // namespace

// Returns 0, or -1 for a pattern it cannot run (more writes than reads, or over 8 arrays).
DS_EXPORT int ds_stream_probe(int64_t numel, float* const* arrays, int32_t reads, int32_t writes, float scale,
                              int32_t num_threads) {
  if (writes > reads || reads < 1 || reads > 8 || writes < 0) return -1;
  auto span = &probe_span<0, 0>;
  if (reads == 4 && writes == 3) span = &probe_span<4, 3>;  // Adam
  if (reads == 3 && writes == 2) span = &probe_span<3, 2>;  // Lion, Adagrad
  const int64_t numels[1] = {numel};
  ds::for_each_span(1, numels, num_threads,
                    [&](int64_t, int64_t b, int64_t e) { span(arrays, reads, writes, scale, b, e); });
  return 0;
}
