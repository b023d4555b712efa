// A row's soft-capping, maximum and sum of exponentials, the two passes of a softmax or a log-sum-exp (attention.cpp's
// softmax over a query's keys, span_head.cpp's log-sum-exp over a vocabulary chunk), on AVX-512 registers and in
// plain loops. NaN stays NaN through both: a NaN entry makes the sum NaN (through exp), as does an entry of +inf
// (exp(inf - inf)); -inf entries add exp(-87), about 1e-38, not 0 (exp_f32's clamp).
#pragma once
#include <cstdint>
#include <limits>

#include "vecmath.h"
#include "vecmath512.h"

namespace sicl {

// t[0, n) -> cap tanh(t / cap) in place when cap > 0; returns the largest (-inf for n = 0)
__attribute__((target("avx512f"))) inline float capped_max_avx512(float* t, int64_t n, float cap) {
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = lanes16(n - j);
        __m512 x = _mm512_maskz_loadu_ps(k, t + j);
        if (cap > 0.0f) {
            x = softcap16(x, cap);
            _mm512_mask_storeu_ps(t + j, k, x);
        }
        mv = _mm512_mask_max_ps(mv, k, x, mv);  // a NaN lane may or may not reach the max: exp carries it anyway
    }
    return hmax16(mv);
}

// sum of exp(t[j] - m) over j < n; with Store, t[j] = exp(t[j] - m) too
template <bool Store>
__attribute__((target("avx512f"))) inline float exp_sum_avx512(float* t, int64_t n, float m) {
    const __m512 mv = _mm512_set1_ps(m);
    __m512 lv = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = lanes16(n - j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, t + j), mv));
        if (Store) _mm512_mask_storeu_ps(t + j, k, e);
        lv = _mm512_mask_add_ps(lv, k, lv, e);
    }
    return hsum16(lv);
}

inline float capped_max_plain(float* t, int64_t n, float cap) {
    if (cap > 0.0f)
        for (int64_t j = 0; j < n; ++j) t[j] = softcap_f32(t[j], cap);
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) m = t[j] > m ? t[j] : m;
    return m;
}

template <bool Store>
inline float exp_sum_plain(float* t, int64_t n, float m) {
    float l = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
        const float e = exp_f32(t[j] - m);
        if (Store) t[j] = e;
        l += e;
    }
    return l;
}

}  // namespace sicl
