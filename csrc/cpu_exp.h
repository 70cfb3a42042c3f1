/* e^x in float32 for the CPU libraries (cpu_paged_decode.c, cpu_layer_ops.c), computed here rather than by libm
   so the loops that call it vectorize without libmvec (with -fno-trapping-math, stages/cpu_build.py rule 1: the
   clamp's comparisons are then selects, not branches).

   x = n ln2 + f with n the integer nearest x / ln2 (rounded by adding and taking away 1.5 * 2^23, which
   vectorizes where floorf does not), |f| <= ln2 / 2, e^f by its Taylor series to f^6 (relative error under
   2e-7), 2^n put into the exponent bits; x clamped to [-87, 88], where float32's e^x is finite and normal. */
#ifndef STRATA_CPU_EXP_H
#define STRATA_CPU_EXP_H
#include <stdint.h>
#include <string.h>

static inline float exp_f(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    const float f = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    const float e = 1.0f + f * (1.0f + f * (0.5f + f * (1.6666667e-1f + f * (4.1666668e-2f + f * (8.3333338e-3f +
                    f * 1.3888889e-3f)))));
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return e * scale;
}
#endif
