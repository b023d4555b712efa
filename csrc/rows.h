// The difference form's rows (sicl_fast/models/rows.py) as the C++ ops read and write them, shared by rows.cpp
// (norm_rows, rope_rows, gated_rows), attention.cpp (attention_rows) and span_head.cpp (lse_chunk_rows).
//
// A pass has R = lead + B*T rows: the lead rows (values, positions 0 .. lead-1), then batch row j's T rows (at
// positions pos0 ..); anchor[j] is the batch row that row j is a difference from (anchor[j] == j: a value row).
// The value rows may be taken against a float32 reference ref [V, n] of the value rows alone (V = lead + the value
// batch rows' T each: the lead rows, then each value batch row's T rows in order; slot[j]: value batch row j's
// place among them). A product's output y [R, n] (bf16) holds the value rows' changes from the product's output
// reference (or the values themselves, without one) and the difference rows' changes from their anchors; its
// float32 rows are y_r + ref_r for a value row r and y_r + (y_a + ref_a) for a difference row r of anchor row a
// (ref 0 without a reference); a float32 result goes back to the form as bf16(x_r - ref_r) or bf16(x_r - x_a).
// bf16 travels as its 16 bits, rounded to nearest even as torch's cast (vecmath.h).
//
//   RowForm                              the layout: anchor_row(r) (r itself for a value row), ref_of(ref, r, n)
//                                        (the reference row of r's anchor: its own for a value row; null without)
//   float_row(y, ya, ra, bias, o, n)     o = (float(y) + (float(ya) + ra)) + bias     ya / ra / bias null: left out
//   form_row(x, xa, o, n)                o = bf16(x - xa), or bf16(x) when xa is null (xa: the anchor's float32
//                                        row for a difference row, the reference row for a value row)
//   anchored_row(za, dz, o, n)           o = float(dz) + za   (a float32 row from its anchor's float32 row, or a
//                                        value row's from its reference row)
//   for_position_tasks(form, ...)        the lead rows one by one and each position's B batch rows together, in
//                                        parallel (an op whose differences need their anchors' float32 results)
//
// The sums are the reference's (sicl_fast.models.rows.from_rows, then the bias), operation for operation, so the
// float32 rows are bit-identical to its; each helper has a plain form and an AVX-512 form on 16 lanes (the same
// bits), the latter's tail the plain form.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "arrays.h"
#include "vecmath.h"
#include "vecmath512.h"

namespace sicl {

struct RowForm {
    int64_t lead, B, T;
    const int64_t* anchor;      // [B]
    std::vector<int64_t> slot;  // [B]: value batch row j's place among the value batch rows (0 for a difference)
    int64_t V;                  // the value rows: a reference's rows

    int64_t R() const { return lead + B * T; }
    int64_t row(int64_t j, int64_t t) const { return lead + j * T + t; }
    // the row that row r is a difference from; r itself for a value row (the lead rows and the anchors' rows)
    int64_t anchor_row(int64_t r) const {
        if (r < lead) return r;
        const int64_t j = (r - lead) / T, t = (r - lead) % T;
        return row(anchor[j], t);
    }
    // the row of a reference [V, n] that holds value row r's (r a lead row or a value batch row's)
    int64_t ref_index(int64_t r) const {
        if (r < lead) return r;
        const int64_t j = (r - lead) / T, t = (r - lead) % T;
        return lead + slot[j] * T + t;
    }
    // the reference row behind row r: its anchor's (its own for a value row); null without a reference
    const float* ref_of(const float* ref, int64_t r, int64_t n) const {
        return ref ? ref + ref_index(anchor_row(r)) * n : nullptr;
    }
};

// The layout of a pass from its anchors (int64 [B]): each an earlier or the same batch row that is its own anchor
// (RowLayout.build checks the same; here it guards the raw buffers)
inline RowForm row_form(const py::array& anchor, int64_t lead, int64_t T, const char* op) {
    check_array(anchor, "anchor", 'i', {-1}, false);
    const int64_t B = anchor.shape(0);
    const int64_t* a = ci(anchor);
    if (lead < 0 || T < 0 || (B > 0 && T < 1)) throw std::invalid_argument(std::string(op) + ": bad lead or T");
    for (int64_t j = 0; j < B; ++j) {
        if (a[j] < 0 || a[j] > j || a[a[j]] != a[j]) {
            throw std::invalid_argument(std::string(op) + ": anchor " + std::to_string(j) +
                                        " must name an earlier or the same row that is its own anchor");
        }
    }
    RowForm f{lead, B, T, a, std::vector<int64_t>(B, 0), lead};
    for (int64_t j = 0, n = 0; j < B; ++j) {
        if (a[j] == j) f.slot[j] = n++, f.V += T;
    }
    return f;
}

// An optional reference [V, n] of the value rows (float32, contiguous): None -> nullptr
inline const float* row_reference(const py::object& ref, const RowForm& f, int64_t n, const char* name) {
    return static_cast<const float*>(optional_data(ref, name, 'f', {f.V, n}));
}

// ----------------------------------------------------------------------------------------- plain forms

inline void float_row_plain(const uint16_t* y, const uint16_t* ya, const float* ra, const float* bias, float* o,
                            int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
        float v = from_bf16(y[j]);
        if (ya) v = v + (ra ? from_bf16(ya[j]) + ra[j] : from_bf16(ya[j]));
        else if (ra) v = v + ra[j];
        if (bias) v = v + bias[j];
        o[j] = v;
    }
}

inline void form_row_plain(const float* x, const float* xa, uint16_t* o, int64_t n) {
    if (xa) {
        for (int64_t j = 0; j < n; ++j) o[j] = to_bf16(x[j] - xa[j]);
    } else {
        for (int64_t j = 0; j < n; ++j) o[j] = to_bf16(x[j]);
    }
}

inline void anchored_row_plain(const float* za, const uint16_t* dz, float* o, int64_t n) {
    for (int64_t j = 0; j < n; ++j) o[j] = from_bf16(dz[j]) + za[j];
}

// ----------------------------------------------------------------------------------------- AVX-512 forms

__attribute__((target("avx512f"))) inline void float_row_avx512(const uint16_t* y, const uint16_t* ya,
                                                                const float* ra, const float* bias, float* o,
                                                                int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 v = load_bf16x16(y + j);
        if (ya) {
            const __m512 a = load_bf16x16(ya + j);
            v = _mm512_add_ps(v, ra ? _mm512_add_ps(a, _mm512_loadu_ps(ra + j)) : a);
        } else if (ra) {
            v = _mm512_add_ps(v, _mm512_loadu_ps(ra + j));
        }
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
        _mm512_storeu_ps(o + j, v);
    }
    float_row_plain(y + j, ya ? ya + j : nullptr, ra ? ra + j : nullptr, bias ? bias + j : nullptr, o + j, n - j);
}

__attribute__((target("avx512f"))) inline void form_row_avx512(const float* x, const float* xa, uint16_t* o,
                                                               int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        store_bf16x16(o + j, xa ? _mm512_sub_ps(v, _mm512_loadu_ps(xa + j)) : v);
    }
    form_row_plain(x + j, xa ? xa + j : nullptr, o + j, n - j);
}

__attribute__((target("avx512f"))) inline void anchored_row_avx512(const float* za, const uint16_t* dz, float* o,
                                                                   int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(o + j, _mm512_add_ps(load_bf16x16(dz + j), _mm512_loadu_ps(za + j)));
    anchored_row_plain(za + j, dz + j, o + j, n - j);
}

inline void float_row(const uint16_t* y, const uint16_t* ya, const float* ra, const float* bias, float* o,
                      int64_t n) {
    (has_avx512() ? float_row_avx512 : float_row_plain)(y, ya, ra, bias, o, n);
}

inline void form_row(const float* x, const float* xa, uint16_t* o, int64_t n) {
    (has_avx512() ? form_row_avx512 : form_row_plain)(x, xa, o, n);
}

inline void anchored_row(const float* za, const uint16_t* dz, float* o, int64_t n) {
    (has_avx512() ? anchored_row_avx512 : anchored_row_plain)(za, dz, o, n);
}

// ----------------------------------------------------------------------------------------- tasks

// body(rows, anc, n, scratch): one task's n rows, rows[i] their indices among the R rows and anc[i] the index
// among the task's rows of row i's anchor (i itself: a value row); scratch: `per_row` floats for each of them,
// the thread's own. The tasks: each lead row alone (n 1), then each position t's B batch rows (anchors first:
// an anchor is an earlier batch row), in parallel on `threads` threads, statically scheduled.
template <class Body>
void for_position_tasks(const RowForm& f, int64_t per_row, int threads, Body body) {
    const int64_t B = f.B, tasks = f.lead + (B > 0 ? f.T : 0);
#pragma omp parallel num_threads(threads)
    {
        std::vector<int64_t> rows(B > 0 ? B : 1), anc(B > 0 ? B : 1);
        std::vector<float> scratch((B > 0 ? B : 1) * per_row);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; ++task) {
            if (task < f.lead) {
                rows[0] = task, anc[0] = 0;
                body(rows.data(), anc.data(), int64_t(1), scratch.data());
                continue;
            }
            const int64_t t = task - f.lead;
            for (int64_t j = 0; j < B; ++j) rows[j] = f.row(j, t), anc[j] = f.anchor[j];
            body(rows.data(), anc.data(), B, scratch.data());
        }
    }
}

}  // namespace sicl
