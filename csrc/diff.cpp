// Difference-product epilogues of the fast backend (sicl_fast/models/diff.py holds the torch reference and the
// Python wrappers). A perturbation batch's rows 1..R are close to row 0, so the projections multiply row 0 in
// float32 and the rows' differences from it in bf16; these ops move between the two forms:
//
//   diff_rows(x[B,n] f32, out[B-1,n] bf16)             out[i-1] = bf16(x[i] - x[0])
//   add_rows(y0[n] f32, yd[R,n] bf16, out[R+1,n] f32)  out[0] = y0; out[i] = y0 + yd[i-1]
//   gated_diff(y0[M,2I] f32, yd[R,M,2I] bf16, act, a0[M,I] f32, dx[R,M,I] bf16)
//       a(y) = act(y[:, :I]) * y[:, I:]  (gate | up stacked);  a0 = a(y0);  dx[i] = bf16(a(y0 + yd[i]) - a0)
//
// bf16 travels as its 16 bits (int16 / uint16 arrays); float -> bf16 rounds to nearest even, as torch's cast.
// act: 0 SiLU, 1 GELU with the tanh approximation; exp is our own (Cody-Waite reduction, degree-7 polynomial,
// ~1 ulp) so that the loops vectorise; the inner loops are compiled for AVX-512, AVX2 and plain x86-64 and
// picked at load time. NaN and inf flow through as in the reference (vecmath.h).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "arrays.h"
#include "threads.h"

// Not finite-math-only: a NaN or inf in the rows (a damaged model's) must come out non-finite, as torch's, not
// clamped into a plausible number; the clamps and selects still become vector min / max / blends.
#pragma GCC push_options
#pragma GCC optimize("no-signed-zeros", "no-trapping-math", "no-math-errno")
#include "vecmath.h"  // under the pragma: its helpers are compiled as the loops that inline them
#include "vecmath512.h"

namespace sicl {

namespace {

SICL_INLINE float act_silu(float g) { return g / (1.0f + exp_f32(-g)); }

// 0.5 g (1 + tanh(z)) written as g * sigmoid(2 z): no cancellation where tanh(z) is near -1
SICL_INLINE float act_gelu_tanh(float g) {
    const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);  // sqrt(2 / pi)
    return g / (1.0f + exp_f32(-2.0f * z));
}

}  // namespace

// ----------------------------------------------------------------------------------------- inner loops

__attribute__((target_clones("avx512f", "avx2", "default"))) void diff_row(const float* x, const float* x0,
                                                                         uint16_t* o, int64_t n) {
    for (int64_t j = 0; j < n; ++j) o[j] = to_bf16(x[j] - x0[j]);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void add_row(const float* y0, const uint16_t* yd,
                                                                        float* o, int64_t n) {
    for (int64_t j = 0; j < n; ++j) o[j] = y0[j] + from_bf16(yd[j]);
}

// gated activations: a = act(g) * u for one token row y = (gate | up) [2I] (rows: y0 + yd, written as bf16
// differences from a0; gated_diff from element j0 on, the AVX-512 form's tail). One function per activation and
// form: no branches in the loops, which vectorise.
#define SICL_GATED_ROWS(ACT)                                                                                      \
    __attribute__((target_clones("avx512f", "avx2", "default"))) void gated_base_##ACT(const float* y0, float* a, \
                                                                                        int64_t I) {              \
        for (int64_t j = 0; j < I; ++j) a[j] = act_##ACT(y0[j]) * y0[I + j];                                     \
    }                                                                                                             \
    __attribute__((target_clones("avx512f", "avx2", "default"))) void gated_diff_##ACT(                          \
        const float* y0, const uint16_t* yd, const float* a0, uint16_t* dx, int64_t I, int64_t j0) {              \
        for (int64_t j = j0; j < I; ++j) {                                                                        \
            const float g = y0[j] + from_bf16(yd[j]), u = y0[I + j] + from_bf16(yd[I + j]);                       \
            dx[j] = to_bf16(act_##ACT(g) * u - a0[j]);                                                            \
        }                                                                                                         \
    }

SICL_GATED_ROWS(silu)
SICL_GATED_ROWS(gelu_tanh)
#undef SICL_GATED_ROWS

#pragma GCC pop_options

// ----------------------------------------------------------------------------------------- AVX-512 forms
// GCC vectorises the bf16 loops above only 8 lanes wide, even for AVX-512 (its cost model, with the 16-bit loads and
// stores); these are the same loops on 16 lanes, written with intrinsics: the same formulas and bf16 bits, exp16
// (within a few ulp of exp_f32). The last I % 16 elements take the plain form.

namespace {

__attribute__((target("avx512f"))) SICL_INLINE __m512 neg16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}

// act_silu / act_gelu_tanh on 16 lanes (Act 0 / 1)
template <int Act>
__attribute__((target("avx512f"))) SICL_INLINE __m512 act16(__m512 g) {
    __m512 e;
    if (Act == 0) {
        e = exp16(neg16(g));
    } else {
        const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), g), g);
        const __m512 z = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_add_ps(g, g3));
        e = exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), z));
    }
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

template <int Act>
__attribute__((target("avx512f"))) void gated_diff_avx512(const float* y0, const uint16_t* yd, const float* a0,
                                                         uint16_t* dx, int64_t I, int64_t j0) {
    int64_t j = j0;
    for (; j + 16 <= I; j += 16) {
        const __m512 g = _mm512_add_ps(_mm512_loadu_ps(y0 + j), load_bf16x16(yd + j));
        const __m512 u = _mm512_add_ps(_mm512_loadu_ps(y0 + I + j), load_bf16x16(yd + I + j));
        store_bf16x16(dx + j, _mm512_sub_ps(_mm512_mul_ps(act16<Act>(g), u), _mm512_loadu_ps(a0 + j)));
    }
    (Act == 0 ? gated_diff_silu : gated_diff_gelu_tanh)(y0, yd, a0, dx, I, j);
}

__attribute__((target("avx512f"))) void diff_row_avx512(const float* x, const float* x0, uint16_t* o, int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        store_bf16x16(o + j, _mm512_sub_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(x0 + j)));
    diff_row(x + j, x0 + j, o + j, n - j);
}

}  // namespace

// ----------------------------------------------------------------------------------------- ops

namespace {

// body(i, j0, len) over rows i < R and column chunks [j0, j0 + len) of n columns, in parallel: rows alone would
// leave threads idle when R is small and n large.
template <class Body>
void for_row_chunks(int64_t R, int64_t n, Body body) {
    const int64_t chunk = 4096, per_row = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(threads_for(R * n))
    for (int64_t t = 0; t < R * per_row; ++t) {
        const int64_t i = t / per_row, j0 = (t % per_row) * chunk;
        body(i, j0, std::min(chunk, n - j0));
    }
}

void diff_rows(py::array x, py::array out) {
    check_array(x, "x", 'f', {-1, -1}, false);
    const int64_t B = x.shape(0), n = x.shape(1);
    if (B < 2) throw std::invalid_argument("diff_rows: x needs at least 2 rows");
    check_array(out, "out", 'h', {B - 1, n}, true);
    const float* xp = cf(x);
    uint16_t* op = mh(out);
    auto row = has_avx512() ? diff_row_avx512 : diff_row;
    for_row_chunks(B - 1, n, [&](int64_t i, int64_t j0, int64_t len) {
        row(xp + (i + 1) * n + j0, xp + j0, op + i * n + j0, len);
    });
}

void add_rows(py::array y0, py::array yd, py::array out) {
    check_array(y0, "y0", 'f', {-1}, false);
    const int64_t n = y0.shape(0);
    check_array(yd, "yd", 'h', {-1, n}, false);
    const int64_t R = yd.shape(0);
    check_array(out, "out", 'f', {R + 1, n}, true);
    const float* y0p = cf(y0);
    const uint16_t* ydp = ch(yd);
    float* op = mf(out);
    std::memcpy(op, y0p, sizeof(float) * n);
    for_row_chunks(R, n, [&](int64_t i, int64_t j0, int64_t len) {
        add_row(y0p + j0, ydp + i * n + j0, op + (i + 1) * n + j0, len);
    });
}

void gated_diff(py::array y0, py::array yd, int act, py::array a0, py::array dx) {
    check_array(y0, "y0", 'f', {-1, -1}, false);
    const int64_t M = y0.shape(0), I2 = y0.shape(1), I = I2 / 2;
    if (I2 % 2) throw std::invalid_argument("gated_diff: y0's last dim must be even (gate | up)");
    check_array(yd, "yd", 'h', {-1, M, I2}, false);
    const int64_t R = yd.shape(0);
    check_array(a0, "a0", 'f', {M, I}, true);
    check_array(dx, "dx", 'h', {R, M, I}, true);
    if (act != 0 && act != 1) throw std::invalid_argument("gated_diff: act must be 0 (silu) or 1 (gelu_tanh)");
    auto base = act == 0 ? gated_base_silu : gated_base_gelu_tanh;
    auto diff = has_avx512() ? (act == 0 ? gated_diff_avx512<0> : gated_diff_avx512<1>)
                             : (act == 0 ? gated_diff_silu : gated_diff_gelu_tanh);
    const float* y0p = cf(y0);
    const uint16_t* ydp = ch(yd);
    float* a0p = mf(a0);
    uint16_t* dxp = mh(dx);
    // an activation costs a few element operations (exp or tanh, products)
#pragma omp parallel for schedule(static) num_threads(threads_for(M * I * 8))
    for (int64_t m = 0; m < M; ++m) base(y0p + m * I2, a0p + m * I, I);
#pragma omp parallel for schedule(static) num_threads(threads_for(R * M * I * 8))
    for (int64_t t = 0; t < R * M; ++t) {
        const int64_t m = t % M;
        diff(y0p + m * I2, ydp + t * I2, a0p + m * I, dxp + t * I, I, 0);
    }
}

}  // namespace

void register_diff_ops(py::module_& m) {
    m.def("diff_rows", &diff_rows, py::arg("x"), py::arg("out"), "out[i-1] = bf16(x[i] - x[0]), x [B, n] float32");
    m.def("add_rows", &add_rows, py::arg("y0"), py::arg("yd"), py::arg("out"),
          "out[0] = y0, out[i] = y0 + float(yd[i-1]); y0 [n] float32, yd [R, n] bf16 bits");
    m.def("gated_diff", &gated_diff, py::arg("y0"), py::arg("yd"), py::arg("act"), py::arg("a0"), py::arg("dx"),
          "gated activations a0 = act(g0) u0 [M, I] and bf16 differences dx [R, M, I] of rows y0 + yd");
}

}  // namespace sicl
