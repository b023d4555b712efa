// AVX-512 forms of vecmath.h's helpers, for the loops written with intrinsics (attention.cpp, diff.cpp,
// span_head.cpp through softmax_rows.h), and the one test of whether this CPU has AVX-512.
#pragma once
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <limits>

#include "vecmath.h"

// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized and -Wuninitialized on their own _mm512_undefined_ps in
// masked, unpacked and shuffled forms (a false positive of those headers); off for the files that include this
// one, which use those forms
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace sicl {

// the plain forms everywhere, as on a CPU without AVX-512 (set_plain_forms: so that tests run them here too)
inline std::atomic<bool> g_plain_forms{false};

// does this CPU run AVX-512, and are its forms on (the intrinsic forms are called only where it does)
inline bool has_avx512() {
    static const bool yes = __builtin_cpu_supports("avx512f");
    return yes && !g_plain_forms.load(std::memory_order_relaxed);
}

// exp_f32 (vecmath.h) on 16 lanes: the same clamp, reduction and polynomial, with fused multiply-adds (within a
// few ulp of it); NaN stays NaN (max / min return their second operand, x, on NaN), and past ln(FLT_MAX) +inf
__attribute__((target("avx512f"))) SICL_INLINE __m512 exp16(__m512 x0) {
    __m512 x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x0));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    p = _mm512_scalef_ps(p, n);
    const __mmask16 big = _mm512_cmp_ps_mask(x0, _mm512_set1_ps(88.72284f), _CMP_GT_OQ);
    return _mm512_mask_blend_ps(big, p, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

// cap tanh(x / cap) = cap (1 - 2 / (exp(2 x / cap) + 1)), as softcap_f32
__attribute__((target("avx512f"))) SICL_INLINE __m512 softcap16(__m512 x, float cap) {
    const __m512 e = exp16(_mm512_mul_ps(_mm512_set1_ps(2.0f / cap), x));
    return _mm512_mul_ps(_mm512_set1_ps(cap), _mm512_sub_ps(_mm512_set1_ps(1.0f),
                         _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f)))));
}

// 16 bf16 values (their bits) as float32, and back: from_bf16 / to_bf16 (vecmath.h) on 16 lanes, the same bits
__attribute__((target("avx512f"))) SICL_INLINE __m512 load_bf16x16(const uint16_t* p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

__attribute__((target("avx512f"))) SICL_INLINE void store_bf16x16(uint16_t* p, __m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
    const __m512i h = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(h));
}

// the largest and the sum of a vector's 16 lanes (a store and a loop: GCC 12's reduce intrinsics warn, see above)
__attribute__((target("avx512f"))) SICL_INLINE float hmax16(__m512 v) {
    alignas(64) float h[16];
    _mm512_store_ps(h, v);
    float m = h[0];
    for (int i = 1; i < 16; ++i) m = h[i] > m ? h[i] : m;
    return m;
}

__attribute__((target("avx512f"))) SICL_INLINE float hsum16(__m512 v) {
    alignas(64) float h[16];
    _mm512_store_ps(h, v);
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += h[i];
    return s;
}

// the first `left` lanes (all 16 when left >= 16): the tail of a loop over a row
SICL_INLINE __mmask16 lanes16(int64_t left) {
    return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

}  // namespace sicl
