// The span head's log-sum-exp over one vocabulary chunk. sicl_fast/ops/cpp_ops.py runs the head's products with
// torch, a chunk of the vocabulary at a time into one buffer small enough to stay in cache, and calls one of these
// on each chunk:
//
//   lse_chunk(z[M, c] f32, v0, tgt[M] i64, cap, m[M] f32, s[M] f32, picked[M] f32)          (CppStepOps.span_head)
//     z: each row's logits for vocabulary entries v0 .. v0+c-1, soft-capped here in place when cap > 0
//     (cap tanh(z / cap)); m, s: each row's running max and sum of exp(logit - m) over the chunks so far (-inf
//     and 0 before the first), updated; picked[r] = z[r, tgt[r] - v0] where the row's target falls in the chunk.
//     After the last chunk a row's log-probability of its target is picked - (m + log s).
//     The torch reference: step.logprobs.vocab_chunked_logprobs (the same online form).
//
//   lse_chunk_rows(zd[M-r0, c] bf16, r0, h[M, d] bf16, w[c, d] bf16, zf[M, c] f32, v0, V, targets[P] i64,
//                  anchor[B] i64, cap, m[M], s[M], picked[M], out[M] f32, z_ref[Vb, P, V] f32 | None,
//                  value_slot[B] i64 | None)                                           (CppStepOps.span_head_rows)
//     the same fold for a difference-form pass (rows.h: B batch rows of P positions, M = B*P rows, anchor[B]):
//     h holds the hidden rows as values (or their changes from a reference) and differences, w the chunk's weight
//     rows; zd the bf16 product h[r0:] @ w^T (torch's, rows from r0 on: every row before r0 is a value row). With
//     z_ref, the value rows' reference logits (value batch row j's at z_ref[value_slot[j]]; value_slot None: the
//     value rows' order), r0 is 0 and a value row's logits are its reference's chunk plus its change from the
//     same product as the differences, z_r = float(zd_r) + z_ref[slot, p, v0 ..] (the chunk read in place, row
//     stride V). Without it the value rows' logits are made here in float32 (their bf16 hidden rows times w,
//     accumulated in float32: a logit rounded to bf16 would move by up to 0.03). Every difference row's as its
//     anchor's plus its own bf16 difference, z_r = z_a + float(zd_r), into zf; then soft-capped and folded as
//     lse_chunk. m, s, picked start at -inf, 0, 0 at the first chunk (v0 == 0); the last (v0 + c == V) writes
//     out = picked - (m + log s). The torch reference: step.logprobs.rows_logprobs.
//
// One pass of the chunk for the max, one for the sum (softmax_rows.h), on AVX-512 registers where the CPU has it;
// rows in parallel. Float32, summed in another order than the reference (a few ulp); NaN and +inf logits give a
// NaN sum, as torch's.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "arrays.h"
#include "rows.h"
#include "softmax_rows.h"
#include "threads.h"
#include "vecmath512.h"

namespace sicl {

namespace {

// Row r's running (m, s, picked) folded with its chunk row[0, c) (soft-capped in place when cap > 0); j: the row's
// target's index in the chunk (outside [0, c): not in it)
inline void fold_row(float* row, int64_t c, float cap, bool vec, int64_t j, float& m, float& s, float& picked) {
    const float cm = vec ? capped_max_avx512(row, c, cap) : capped_max_plain(row, c, cap);
    const float cs = vec ? exp_sum_avx512<false>(row, c, cm) : exp_sum_plain<false>(row, c, cm);
    // the running pair (m, s) and the chunk's (cm, cs), both rescaled to the larger max; exp(-inf) = 0 before the
    // first chunk, and a NaN in either max or sum stays NaN
    const float mn = cm > m ? cm : m;
    s = s * std::exp(m - mn) + cs * std::exp(cm - mn);
    m = std::isnan(cm) ? cm : mn;
    if (j >= 0 && j < c) picked = row[j];
}

void lse_chunk(py::array z, int64_t v0, py::array tgt, double cap, py::array m, py::array s, py::array picked) {
    check_array(z, "z", 'f', {-1, -1}, true);
    const int64_t M = z.shape(0), c = z.shape(1);
    check_array(tgt, "tgt", 'i', {M}, false);
    check_array(m, "m", 'f', {M}, true);
    check_array(s, "s", 'f', {M}, true);
    check_array(picked, "picked", 'f', {M}, true);
    if (c < 1) throw std::invalid_argument("lse_chunk: z has no columns");
    float *zp = mf(z), *mp = mf(m), *sp = mf(s), *pp = mf(picked);
    const int64_t* tp = ci(tgt);
    const float cp = static_cast<float>(cap);
    const bool vec = has_avx512();
    py::gil_scoped_release nogil;
    // an exp costs about as much as 8 plain element operations
#pragma omp parallel for schedule(static) num_threads(threads_for(M * c * 8))
    for (int64_t r = 0; r < M; ++r) fold_row(zp + r * c, c, cp, vec, tp[r] - v0, mp[r], sp[r], pp[r]);
}

// ----------------------------------------------------------------------------------------- value rows' logits
// z[4 rr + cc] = sum_k h[rr][k] float(w[cc][k]) for a block of 4 float32 hidden rows x 4 bf16 weight rows of d:
// the products of bf16 values are exact in float32, their sums float32 (in 16 lanes, then across them)

void dots4x4_plain(const float* const* h, const uint16_t* const* w, int64_t d, float* z) {
    for (int rr = 0; rr < 4; ++rr) {
        for (int cc = 0; cc < 4; ++cc) {
            float acc = 0.0f;
            for (int64_t k = 0; k < d; ++k) acc += h[rr][k] * from_bf16(w[cc][k]);
            z[4 * rr + cc] = acc;
        }
    }
}

// lane i: the sum of v[i]'s 16 lanes (pairs of lanes, then of 128-bit blocks, added in registers)
__attribute__((target("avx512f"))) SICL_INLINE __m512 lane_sums16(const __m512* v) {
    __m512 a[8], b[4];
    for (int k = 0; k < 8; ++k)  // per block: v[2k] lanes 0+2, v[2k+1] 0+2, v[2k] 1+3, v[2k+1] 1+3
        a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; ++k)  // per block: the block's sums of v[4k], v[4k+1], v[4k+2], v[4k+3]
        b[k] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // the four blocks of each b[k] summed, b[k]'s total in block k
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// dots4x4_plain on 16 lanes (the last d % 16 elements added after the lanes' sums)
__attribute__((target("avx512f"))) void dots4x4_avx512(const float* const* h, const uint16_t* const* w, int64_t d,
                                                       float* z) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= d; k += 16) {
        __m512 wv[4];
        for (int cc = 0; cc < 4; ++cc) wv[cc] = load_bf16x16(w[cc] + k);
        for (int rr = 0; rr < 4; ++rr) {
            const __m512 hv = _mm512_loadu_ps(h[rr] + k);
            for (int cc = 0; cc < 4; ++cc) acc[4 * rr + cc] = _mm512_fmadd_ps(hv, wv[cc], acc[4 * rr + cc]);
        }
    }
    _mm512_storeu_ps(z, lane_sums16(acc));
    for (; k < d; ++k)
        for (int rr = 0; rr < 4; ++rr)
            for (int cc = 0; cc < 4; ++cc) z[4 * rr + cc] += h[rr][k] * from_bf16(w[cc][k]);
}

void lse_chunk_rows(py::array zd, int64_t r0, py::array h, py::array w, py::array zf, int64_t v0, int64_t V,
                    py::array targets, py::array anchor, double cap, py::array m, py::array s, py::array picked,
                    py::array out, py::object z_ref, py::object value_slot) {
    check_array(targets, "targets", 'i', {-1}, false);
    const int64_t P = targets.shape(0);
    const RowForm f = row_form(anchor, 0, std::max<int64_t>(P, 1), "lse_chunk_rows");
    const int64_t M = f.B * P;
    check_array(h, "h", 'h', {M, -1}, false);
    const int64_t d = h.shape(1);
    check_array(w, "w", 'h', {-1, d}, false);
    const int64_t c = w.shape(0);
    if (c < 1 || v0 < 0 || v0 + c > V) throw std::invalid_argument("lse_chunk_rows: bad chunk");
    if (r0 < 0 || r0 > M || r0 % std::max<int64_t>(P, 1)) throw std::invalid_argument("lse_chunk_rows: bad r0");
    for (int64_t j = 0; j < r0 / std::max<int64_t>(P, 1); ++j)
        if (f.anchor[j] != j) throw std::invalid_argument("lse_chunk_rows: zd must hold every difference row");
    check_array(zd, "zd", 'h', {M - r0, c}, false);
    check_array(zf, "zf", 'f', {M, c}, true);
    check_array(m, "m", 'f', {M}, true);
    check_array(s, "s", 'f', {M}, true);
    check_array(picked, "picked", 'f', {M}, true);
    check_array(out, "out", 'f', {M}, true);
    const auto* zr = static_cast<const float*>(optional_data(z_ref, "z_ref", 'f', {-1, P, V}));
    std::vector<int64_t> slot = f.slot;  // the value rows' places in z_ref
    if (zr) {
        if (r0 != 0) throw std::invalid_argument("lse_chunk_rows: with z_ref, zd must hold every row (r0 0)");
        const auto* vs = static_cast<const int64_t*>(optional_data(value_slot, "value_slot", 'i', {f.B}));
        const int64_t Vb = py::reinterpret_borrow<py::array>(z_ref).shape(0);
        for (int64_t j = 0; j < f.B; ++j) {
            if (vs) slot[j] = vs[j];
            if (f.anchor[j] == j && (slot[j] < 0 || slot[j] >= Vb))
                throw std::invalid_argument("lse_chunk_rows: a value slot outside z_ref");
        }
    }
    const uint16_t *zdp = ch(zd), *hp = ch(h), *wp = ch(w);
    const int64_t* tp = ci(targets);
    float *zp = mf(zf), *mp = mf(m), *sp = mf(s), *pp = mf(picked), *op = mf(out);
    std::vector<int64_t> values;  // the value batch rows
    for (int64_t j = 0; j < f.B; ++j)
        if (f.anchor[j] == j) values.push_back(j);
    const float cp = static_cast<float>(cap);
    const bool vec = has_avx512(), first = v0 == 0, last = v0 + c == V;
    auto dots = vec ? dots4x4_avx512 : dots4x4_plain;
    const int64_t nv = static_cast<int64_t>(values.size()), tasks = (P + 3) / 4;
    py::gil_scoped_release nogil;
    // a task: 4 positions of every batch row (a difference's anchor row is at its own position: in the same task, so
    // that the call has no barrier but its end; on a machine shared with other work a barrier waits for whichever
    // thread the scheduler took off its core)
#pragma omp parallel num_threads(threads_for((zr ? 0 : nv * P * c * d * 2) + M * c * 8))
    {
        std::vector<float> hf(zr ? 0 : 4 * d);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t p0 = task * 4, np = std::min<int64_t>(4, P - p0);
            for (const int64_t jv : values) {  // the value rows' float32 logits
                if (zr) {  // the reference's plus the change
                    for (int64_t t = p0; t < p0 + np; ++t)
                        anchored_row(zr + (slot[jv] * P + t) * V + v0, zdp + (jv * P + t) * c, zp + (jv * P + t) * c,
                                     c);
                    continue;
                }
                const float* hr[4];
                for (int rr = 0; rr < 4; ++rr) {  // past the last position: the last row again (not stored)
                    const int64_t r = jv * P + p0 + std::min<int64_t>(rr, np - 1);
                    for (int64_t k = 0; k < d; ++k) hf[rr * d + k] = from_bf16(hp[r * d + k]);
                    hr[rr] = hf.data() + rr * d;
                }
                for (int64_t j0 = 0; j0 < c; j0 += 4) {
                    const uint16_t* wr[4];
                    for (int cc = 0; cc < 4; ++cc) wr[cc] = wp + std::min(j0 + cc, c - 1) * d;
                    float z[16];
                    dots(hr, wr, d, z);
                    for (int64_t rr = 0; rr < np; ++rr)
                        for (int cc = 0; cc < 4 && j0 + cc < c; ++cc)
                            zp[(jv * P + p0 + rr) * c + j0 + cc] = z[4 * rr + cc];
                }
            }
            for (int64_t j = 0; j < f.B; ++j) {  // the differences' from their anchors' (before any is soft-capped)
                if (f.anchor[j] == j) continue;
                for (int64_t r = j * P + p0; r < j * P + p0 + np; ++r)
                    anchored_row(zp + f.anchor_row(r) * c, zdp + (r - r0) * c, zp + r * c, c);
            }
            for (int64_t j = 0; j < f.B; ++j) {  // every row folded into its running max and sum
                for (int64_t r = j * P + p0; r < j * P + p0 + np; ++r) {
                    if (first) mp[r] = -std::numeric_limits<float>::infinity(), sp[r] = 0.0f, pp[r] = 0.0f;
                    fold_row(zp + r * c, c, cp, vec, tp[r % P] - v0, mp[r], sp[r], pp[r]);
                    if (last) op[r] = pp[r] - (mp[r] + std::log(sp[r]));
                }
            }
        }
    }
}

}  // namespace

void register_span_head_ops(py::module_& m) {
    m.def("lse_chunk", &lse_chunk, py::arg("z"), py::arg("v0"), py::arg("tgt"), py::arg("cap"), py::arg("m"),
          py::arg("s"), py::arg("picked"),
          "the span head's online log-sum-exp over one vocabulary chunk z [M, c] float32 (soft-capped in place)");
    m.def("lse_chunk_rows", &lse_chunk_rows, py::arg("zd"), py::arg("r0"), py::arg("h"), py::arg("w"), py::arg("zf"),
          py::arg("v0"), py::arg("V"), py::arg("targets"), py::arg("anchor"), py::arg("cap"), py::arg("m"),
          py::arg("s"), py::arg("picked"), py::arg("out"), py::arg("z_ref") = py::none(),
          py::arg("value_slot") = py::none(),
          "the span head's online log-sum-exp over one vocabulary chunk of a difference-form pass (bf16 rows)");
}

}  // namespace sicl
