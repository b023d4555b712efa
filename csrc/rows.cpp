// The difference form's row epilogues (sicl_fast/models/rows.py holds the torch references: norm_rows_reference,
// rope_rows_reference, gated_rows_reference; the Python wrappers are sicl_fast/ops/cpp_ops.py's CppDecoderOps).
// Each reads a product's output in difference form (bf16 values and differences, rows.h), works on the float32
// rows and writes what the next product or the attention takes, in one call:
//
//   norm_rows(x[R,d] f32, y[R,d] bf16 | None, bias[d] | None, post_w[d] | None, w[d] | None, eps, anchor[B], lead,
//             T, x_out[R,d] f32 | None, h[R,d] bf16, y_ref[V,d] f32 | None, h_ref[V,d] f32 | None, y_scale)
//       y given: x_out = x + y_scale (rms_norm(y', post_w) or y'), y' the float32 rows of y (its value rows against
//       y_ref) plus the bias, y_scale Granite's residual multiplier (1: none); h = the difference form of
//       rms_norm(x_out, w) (its value rows against h_ref), or of x_out itself without w (OLMo 2: no norm before the
//       next block). y None: h = the difference form of rms_norm(x, w) or x (x_out and y_ref unused)
//   rope_rows(qkv[R,(H+2Hk)hd] bf16, bias | None, anchor[B], lead, T, pos0, cos[n,rot], sin[n,rot],
//             q_norm[hd] or [H*hd] | None, k_norm[hd] or [Hk*hd] | None, eps, H, Hk, q[R,H*hd] f32,
//             k_out[R,Hk*hd] f32, v_out[R,Hk*hd] f32, qkv_ref[V,(H+2Hk)hd] f32 | None)
//       the float32 rows of q | k | v (the value rows against qkv_ref; plus the bias); q / k rms norms when given:
//       per head ([hd] weights: Qwen3, Gemma 3) or over the whole projection ([H*hd] / [Hk*hd]: OLMo 2); the first
//       rot elements of each q and k head rotated at each row's position (lead row r: r; batch rows: pos0 + t; rot
//       = hd, or fewer with partial rotary: Phi-3), the rest as they are; v copied
//   gated_rows(y[R,2I] bf16, bias[2I] | None, act, anchor[B], lead, T, out[R,I] bf16, y_ref[V,2I] f32 | None,
//              a_ref[V,I] f32 | None)
//       act(gate) * up on the float32 rows of y (gate | up stacked; the value rows against y_ref) plus the bias, in
//       difference form (the value rows against a_ref)
//
// The references (rows.h) are the value rows' float32 rows of the same products, V of them; None: the value rows
// are rounded as they are. A reference changes what a value row reads and writes, not the work: the same one call.
//
// rms_norm(z, w) = (z / sqrt(mean(z^2) + eps)) * w in float32 (Gemma's 1 + w comes as w: the same formula in
// float32); act: 0 SiLU, g / (1 + exp(-g)), 1 GELU with the tanh approximation, torch's formula operation for
// operation (its 1 + tanh cancels for g below about -3: the differences of such rows are that rounding, which the
// form's rows must share with the reference); exp is our own (Cody-Waite reduction, degree-7 polynomial, ~1 ulp) so
// that the loops vectorise, the tanh rounded from float64 as torch's (Sleef's) is to within half an ulp. A
// difference needs its anchor's float32 result (the norm's, the activation's): norm_rows and gated_rows make a
// position's B batch rows in one task (rows.h, for_position_tasks); rope_rows reads the anchor's bf16 row from
// memory, row by row. Float32 throughout; the rotary and the reconstruction are the reference's
// operations one by one, the norms' sums of squares and the activations within a few ulp of torch's. NaN and inf
// flow through as in the reference.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "arrays.h"
#include "rowmath.h"
#include "rows.h"
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

constexpr float kGeluBeta = 0.7978845608028654f, kGeluKappa = 0.044715f;  // sqrt(2 / pi), as torch's
constexpr float kTanhOne = 8.664339742f;  // past this |y|, torch's tanh (Sleef's) is exactly +-1

// tanh(y) rounded to float32 as torch's CPU kernels have it (Sleef's tanhf: about half an ulp from the true value;
// here 1 - 2 / (exp(2|y|) + 1) in float64, rounded: absolute error ~1e-16, what GELU's 1 + tanh needs), +-1 past
// kTanhOne as Sleef's; NaN stays NaN
SICL_INLINE float tanh_torch(float y) {
    const float a = std::fabs(y);
    if (a > kTanhOne) return std::copysign(1.0f, y);
    const double e = std::exp(2.0 * static_cast<double>(a));
    return std::copysign(static_cast<float>(1.0 - 2.0 / (e + 1.0)), y);
}

// torch's GELU with the tanh approximation, operation for operation: 0.5 g (1 + tanh(beta (g + kappa g^3))). Where
// the tanh is near -1 (g below about -3) its 1 + tanh cancels and keeps few bits; the same float32 tanh gives the
// same bits, which the difference form's rows must share with the reference (their differences are that small)
SICL_INLINE float act_gelu_tanh(float g) {
    const float inner = kGeluBeta * (g + kGeluKappa * (g * g * g));
    return (0.5f * g) * (1.0f + tanh_torch(inner));
}

}  // namespace

// gated activations of one token row y = (gate | up) [2I]: a[j] = act(y[j]) * y[I + j] from element j0 on (the
// AVX-512 form's tail). One function per activation: no branch in the loop, which vectorises.
#define SICL_GATED_ROW(ACT)                                                                                       \
    __attribute__((target_clones("avx512f", "avx2", "default"))) void gated_row_##ACT(const float* y, float* a,   \
                                                                                       int64_t I, int64_t j0) {   \
        for (int64_t j = j0; j < I; ++j) a[j] = act_##ACT(y[j]) * y[I + j];                                      \
    }

SICL_GATED_ROW(silu)
SICL_GATED_ROW(gelu_tanh)
#undef SICL_GATED_ROW

#pragma GCC pop_options

// ----------------------------------------------------------------------------------------- AVX-512 forms
// GCC vectorises the activation loop 8 lanes wide even for AVX-512 (its cost model), and leaves GELU's float64
// tanh scalar; this is the same loop on 16 lanes, written with intrinsics: the same formulas, exp16 (within a few
// ulp of exp_f32), the tanh's float64 exp a polynomial. The last I % 16 elements take the plain form.

namespace {

__attribute__((target("avx512f"))) SICL_INLINE __m512 neg16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}

// exp(x) in float64 on 8 lanes, for x in [0, 2 kTanhOne]: x = n ln 2 + r, a degree-11 polynomial in r (|r| <= 0.35:
// relative error ~1e-14), times 2^n
__attribute__((target("avx512f"))) SICL_INLINE __m512d exp8_f64(__m512d x) {
    const __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(1.4426950408889634)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), x);  // ln 2 = hi + lo
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);
    __m512d p = _mm512_set1_pd(1.0 / 39916800.0);
    for (double c : {1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0,
                     1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0})
        p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(c));
    return _mm512_scalef_pd(p, n);
}

// 1 - 2 / (exp(2 a) + 1) in float64 for 8 float32 a, rounded back to float32
__attribute__((target("avx512f"))) SICL_INLINE __m256 tanh8_abs(__m256 a) {
    const __m512d e = exp8_f64(_mm512_mul_pd(_mm512_set1_pd(2.0), _mm512_cvtps_pd(a)));
    const __m512d one = _mm512_set1_pd(1.0);
    return _mm512_cvtpd_ps(_mm512_sub_pd(one, _mm512_div_pd(_mm512_set1_pd(2.0), _mm512_add_pd(e, one))));
}

// tanh_torch on 16 lanes (the same float32 results but for a rare last-bit rounding of the float64 value)
__attribute__((target("avx512f"))) SICL_INLINE __m512 tanh16_torch(__m512 y) {
    const __m512i sign = _mm512_set1_epi32(INT32_MIN);
    const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(y)));
    const __m256 lo = tanh8_abs(_mm512_castps512_ps256(a));
    const __m256 hi = tanh8_abs(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m512 t = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)),
                                                   _mm256_castps_pd(hi), 1));
    t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(kTanhOne), _CMP_GT_OQ), t, _mm512_set1_ps(1.0f));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),
                                               _mm512_and_si512(sign, _mm512_castps_si512(y))));
}

// act_silu / act_gelu_tanh on 16 lanes (Act 0 / 1)
template <int Act>
__attribute__((target("avx512f"))) SICL_INLINE __m512 act16(__m512 g) {
    if (Act == 0) return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(neg16(g))));
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 inner =
        _mm512_mul_ps(_mm512_set1_ps(kGeluBeta), _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(kGeluKappa), g3)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g),
                         _mm512_add_ps(_mm512_set1_ps(1.0f), tanh16_torch(inner)));
}

template <int Act>
__attribute__((target("avx512f"))) void gated_row_avx512(const float* y, float* a, int64_t I, int64_t j0) {
    int64_t j = j0;
    for (; j + 16 <= I; j += 16)
        _mm512_storeu_ps(a + j, _mm512_mul_ps(act16<Act>(_mm512_loadu_ps(y + j)), _mm512_loadu_ps(y + I + j)));
    (Act == 0 ? gated_row_silu : gated_row_gelu_tanh)(y, a, I, j);
}

// ----------------------------------------------------------------------------------------- ops

// a float32 [rows, n] array's checks and data (row-major)
float* out_f32(py::array& a, const char* name, int64_t rows, int64_t n) {
    check_array(a, name, 'f', {rows, n}, true);
    return mf(a);
}

void norm_rows(py::array x, py::object y, py::object bias, py::object post_w, py::object w, double eps,
               py::array anchor, int64_t lead, int64_t T, py::object x_out, py::array h, py::object y_ref,
               py::object h_ref, double y_scale) {
    const RowForm f = row_form(anchor, lead, T, "norm_rows");
    const int64_t R = f.R();
    check_array(x, "x", 'f', {R, -1}, false);
    const int64_t d = x.shape(1);
    const auto* wp = static_cast<const float*>(optional_data(w, "w", 'f', {d}));
    check_array(h, "h", 'h', {R, d}, true);
    const auto* yp = static_cast<const uint16_t*>(optional_data(y, "y", 'h', {R, d}));
    const auto* bp = static_cast<const float*>(optional_data(bias, "bias", 'f', {d}));
    const auto* pw = static_cast<const float*>(optional_data(post_w, "post_w", 'f', {d}));
    const float* yr = yp ? row_reference(y_ref, f, d, "y_ref") : nullptr;
    const float* hr = row_reference(h_ref, f, d, "h_ref");
    float* xo = nullptr;
    if (yp) {
        if (x_out.is_none()) throw std::invalid_argument("norm_rows: x_out is needed with y");
        py::array xa = py::reinterpret_borrow<py::array>(x_out);
        xo = out_f32(xa, "x_out", R, d);
    }
    const float* xp = cf(x);
    uint16_t* hp = mh(h);
    const float e = static_cast<float>(eps), ys = static_cast<float>(y_scale);
    py::gil_scoped_release nogil;
    // scratch: each row's y' (then its norm) as float32
    for_position_tasks(f, d, threads_for(R * d * (yp ? 8 : 4)), [&](const int64_t* rows, const int64_t* anc,
                                                                     int64_t n, float* nrm) {
        for (int64_t i = 0; i < n; ++i) {
            const int64_t r = rows[i];
            float* s = nrm + i * d;
            const float* z = xp + r * d;
            if (yp) {
                float_row(yp + r * d, anc[i] != i ? yp + rows[anc[i]] * d : nullptr, f.ref_of(yr, r, d), bp, s, d);
                if (pw) scale_row(s, inv_rms(s, d, e), pw, s, d);
                if (ys != 1.0f) mul_row(s, ys, s, d);
                add_row(z, s, xo + r * d, d);
                z = xo + r * d;
            }
            if (wp) scale_row(z, inv_rms(z, d, e), wp, s, d);
            else std::memcpy(s, z, sizeof(float) * d);
        }
        for (int64_t i = 0; i < n; ++i)
            form_row(nrm + i * d, anc[i] != i ? nrm + anc[i] * d : f.ref_of(hr, rows[i], d), hp + rows[i] * d, d);
    });
}

// a q / k norm's weights: [hd] (per head) or [heads * hd] (over the whole projection); -> (data, whole) or null
const float* qk_norm(const py::object& o, const char* name, int64_t hd, int64_t heads, bool& whole) {
    whole = false;
    if (o.is_none()) return nullptr;
    if (!py::isinstance<py::array>(o)) throw std::invalid_argument(std::string(name) + " must be an array or None");
    const py::array a = py::reinterpret_borrow<py::array>(o);
    whole = a.ndim() == 1 && a.shape(0) == heads * hd && heads > 1;
    check_array(a, name, 'f', {whole ? heads * hd : hd}, false);
    return cf(a);
}

void rope_rows(py::array qkv, py::object bias, py::array anchor, int64_t lead, int64_t T, int64_t pos0,
               py::array cos, py::array sin, py::object q_norm, py::object k_norm, double eps, int64_t H, int64_t Hk,
               py::array q, py::array k_out, py::array v_out, py::object qkv_ref) {
    const RowForm f = row_form(anchor, lead, T, "rope_rows");
    const int64_t R = f.R();
    check_array(cos, "cos", 'f', {-1, -1}, false);
    const int64_t npos = cos.shape(0), rot = cos.shape(1);
    check_array(sin, "sin", 'f', {npos, rot}, false);
    check_array(qkv, "qkv", 'h', {R, -1}, false);
    if (H < 1 || Hk < 1 || qkv.shape(1) % (H + 2 * Hk)) throw std::invalid_argument("rope_rows: bad heads");
    const int64_t hd = qkv.shape(1) / (H + 2 * Hk), n = (H + 2 * Hk) * hd;
    if (hd % 2 || hd > kMaxHeadDim || rot % 2 || rot > hd) {
        throw std::invalid_argument("rope_rows: a head_dim that is odd or above 512, or a rotary width that is odd "
                                    "or above head_dim");
    }
    if (R > 0 && std::max(lead, pos0 + T) > npos) throw std::invalid_argument("rope_rows: cos / sin too short");
    const auto* bp = static_cast<const float*>(optional_data(bias, "bias", 'f', {n}));
    const float* yr = row_reference(qkv_ref, f, n, "qkv_ref");
    bool q_whole, k_whole;
    const float* qn = qk_norm(q_norm, "q_norm", hd, H, q_whole);
    const float* kn = qk_norm(k_norm, "k_norm", hd, Hk, k_whole);
    if (!qn != !kn) throw std::invalid_argument("rope_rows: q_norm and k_norm come together");
    float* qo = out_f32(q, "q", R, H * hd);
    float* ko = out_f32(k_out, "k_out", R, Hk * hd);
    float* vo = out_f32(v_out, "v_out", R, Hk * hd);
    const uint16_t* yp = ch(qkv);
    const float *cp = cf(cos), *sp = cf(sin);
    const float e = static_cast<float>(eps);
    py::gil_scoped_release nogil;
#pragma omp parallel num_threads(threads_for(R * n * 4))
    {
        std::vector<float> row(n);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; ++r) {
            const int64_t a = f.anchor_row(r);
            float* z = row.data();
            float_row(yp + r * n, a != r ? yp + a * n : nullptr, f.ref_of(yr, r, n), bp, z, n);
            const int64_t p = r < lead ? r : pos0 + (r - lead) % T;
            const float *c = cp + p * rot, *s = sp + p * rot;
            if (q_whole) scale_row(z, inv_rms(z, H * hd, e), qn, z, H * hd);  // OLMo 2: over the whole projection
            if (k_whole) scale_row(z + H * hd, inv_rms(z + H * hd, Hk * hd, e), kn, z + H * hd, Hk * hd);
            for (int64_t hh = 0; hh < H + Hk; ++hh) {  // q's heads, then k's
                float* head = z + hh * hd;
                const bool is_q = hh < H;
                if (qn && !(is_q ? q_whole : k_whole)) scale_row(head, inv_rms(head, hd, e), is_q ? qn : kn, head, hd);
                rope_head(head, c, s, is_q ? qo + (r * H + hh) * hd : ko + (r * Hk + hh - H) * hd, hd, rot);
            }
            std::memcpy(vo + r * Hk * hd, z + (H + Hk) * hd, sizeof(float) * Hk * hd);
        }
    }
}

void gated_rows(py::array y, py::object bias, int act, py::array anchor, int64_t lead, int64_t T, py::array out,
                py::object y_ref, py::object a_ref) {
    const RowForm f = row_form(anchor, lead, T, "gated_rows");
    const int64_t R = f.R();
    check_array(y, "y", 'h', {R, -1}, false);
    const int64_t I2 = y.shape(1), I = I2 / 2;
    if (I2 % 2) throw std::invalid_argument("gated_rows: y's last dim must be even (gate | up)");
    if (act != 0 && act != 1) throw std::invalid_argument("gated_rows: act must be 0 (silu) or 1 (gelu_tanh)");
    check_array(out, "out", 'h', {R, I}, true);
    const auto* bp = static_cast<const float*>(optional_data(bias, "bias", 'f', {I2}));
    const float* yr = row_reference(y_ref, f, I2, "y_ref");
    const float* ar = row_reference(a_ref, f, I, "a_ref");
    const uint16_t* yp = ch(y);
    uint16_t* op = mh(out);
    auto gate = has_avx512() ? (act == 0 ? gated_row_avx512<0> : gated_row_avx512<1>)
                             : (act == 0 ? gated_row_silu : gated_row_gelu_tanh);
    py::gil_scoped_release nogil;
    // scratch per row: its float32 y (2I), then its activation (I); an activation costs a few element operations
    for_position_tasks(f, 3 * I, threads_for(R * I * 8), [&](const int64_t* rows, const int64_t* anc, int64_t n,
                                                             float* sc) {
        for (int64_t i = 0; i < n; ++i) {
            const int64_t r = rows[i];
            float* yf = sc + i * 3 * I;
            float_row(yp + r * I2, anc[i] != i ? yp + rows[anc[i]] * I2 : nullptr, f.ref_of(yr, r, I2), bp, yf, I2);
            gate(yf, yf + I2, I, 0);
        }
        for (int64_t i = 0; i < n; ++i) {
            const float* xa = anc[i] != i ? sc + anc[i] * 3 * I + I2 : f.ref_of(ar, rows[i], I);
            form_row(sc + i * 3 * I + I2, xa, op + rows[i] * I, I);
        }
    });
}

}  // namespace

void register_rows_ops(py::module_& m) {
    m.def("norm_rows", &norm_rows, py::arg("x"), py::arg("y"), py::arg("bias"), py::arg("post_w"), py::arg("w"),
          py::arg("eps"), py::arg("anchor"), py::arg("lead"), py::arg("T"), py::arg("x_out"), py::arg("h"),
          py::arg("y_ref") = py::none(), py::arg("h_ref") = py::none(), py::arg("y_scale") = 1.0,
          "x_out = x + y_scale (rms_norm(y', post_w) or y'), h = rms_norm(x_out, w) (or x_out without w) in "
          "difference form (bf16 bits)");
    m.def("rope_rows", &rope_rows, py::arg("qkv"), py::arg("bias"), py::arg("anchor"), py::arg("lead"), py::arg("T"),
          py::arg("pos0"), py::arg("cos"), py::arg("sin"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"),
          py::arg("H"), py::arg("Hk"), py::arg("q"), py::arg("k_out"), py::arg("v_out"),
          py::arg("qkv_ref") = py::none(),
          "the float32 rows of a q | k | v product in difference form, q / k normed (per head or whole) and rotated "
          "(the first rot elements of each head) into q, k_out, v_out");
    m.def("gated_rows", &gated_rows, py::arg("y"), py::arg("bias"), py::arg("act"), py::arg("anchor"),
          py::arg("lead"), py::arg("T"), py::arg("out"), py::arg("y_ref") = py::none(),
          py::arg("a_ref") = py::none(),
          "act(gate) * up of a gate | up product's float32 rows, in difference form (bf16 bits)");
}

}  // namespace sicl
