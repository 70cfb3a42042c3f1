/* The vector instructions the CPU libraries of a stage are built with (-march=native, stages/cpu_build.py).

   STRATA_ISA is 512 with AVX-512 (F), 256 with AVX2 and FMA (and no AVX-512), 0 with neither; each library's
   `*_isa()` returns it, and its Python module refuses the library when it is 0. The kernels of both widths run the
   same operations per output in the same order, so a product has the same value bit for bit on either. */
#ifndef STRATA_CPU_ISA_H
#define STRATA_CPU_ISA_H

#if defined(__AVX512F__)
#define STRATA_ISA 512
#elif defined(__AVX2__) && defined(__FMA__)
#define STRATA_ISA 256
#else
#define STRATA_ISA 0
#endif

#if STRATA_ISA
#include <immintrin.h>
#endif

#if STRATA_ISA == 256
/* The sum of 16 lanes held as two vectors (lanes 0-7 in lo, 8-15 in hi) in the tree of GCC's
   _mm512_reduce_add_ps: halves, then quarters, then pairs. */
static inline float strata_reduce16(__m256 lo, __m256 hi) {
    const __m256 t3 = _mm256_add_ps(hi, lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1)));
}
#endif

#endif
