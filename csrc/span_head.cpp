// The span head's log-sum-exp over one vocabulary chunk. sicl_fast/ops/cpp_ops.py's CppStepOps.span_head runs the
// head's products with torch, a chunk of the vocabulary at a time into one buffer small enough to stay in cache,
// and calls this on each chunk (the torch reference is sicl_fast.logprobs.gather_logprobs_chunked; the same online
// form in torch is vocab_chunked_logprobs):
//
//   lse_chunk(z[M, c] f32, v0, tgt[M] i64, cap, m[M] f32, s[M] f32, picked[M] f32)
//     z: each row's logits for vocabulary entries v0 .. v0+c-1, soft-capped here in place when cap > 0
//     (cap tanh(z / cap)); m, s: each row's running max and sum of exp(logit - m) over the chunks so far (-inf
//     and 0 before the first), updated; picked[r] = z[r, tgt[r] - v0] where the row's target falls in the chunk.
//   After the last chunk a row's log-probability of its target is picked - (m + log s).
//
// One pass of the chunk for the max, one for the sum (softmax_rows.h), on AVX-512 registers where the CPU has it;
// rows in parallel. Float32, summed in another order than the reference (a few ulp); NaN and +inf logits give a
// NaN sum, as torch's.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "arrays.h"
#include "softmax_rows.h"
#include "threads.h"

namespace sicl {

namespace {

void lse_chunk(py::array z, int64_t v0, py::array tgt, double cap, py::array m, py::array s, py::array picked) {
    check_array(z, "z", 'f', {-1, -1}, true);
    const int64_t M = z.shape(0), c = z.shape(1);
    check_array(tgt, "tgt", 'i', {M}, false);
    check_array(m, "m", 'f', {M}, true);
    check_array(s, "s", 'f', {M}, true);
    check_array(picked, "picked", 'f', {M}, true);
    if (c < 1) throw std::invalid_argument("lse_chunk: z has no columns");
    float *zp = mf(z), *mp = mf(m), *sp = mf(s), *pp = mf(picked);
    const int64_t* tp = static_cast<const int64_t*>(tgt.data());
    const float cp = static_cast<float>(cap);
    const bool vec = has_avx512();
    py::gil_scoped_release nogil;
    // an exp costs about as much as 8 plain element operations
#pragma omp parallel for schedule(static) num_threads(threads_for(M * c * 8))
    for (int64_t r = 0; r < M; ++r) {
        float* row = zp + r * c;
        const float cm = vec ? capped_max_avx512(row, c, cp) : capped_max_plain(row, c, cp);
        const float cs = vec ? exp_sum_avx512<false>(row, c, cm) : exp_sum_plain<false>(row, c, cm);
        // the running pair (m, s) and the chunk's (cm, cs), both rescaled to the larger max; exp(-inf) = 0 before
        // the first chunk, and a NaN in either max or sum stays NaN
        const float mn = cm > mp[r] ? cm : mp[r];
        sp[r] = sp[r] * std::exp(mp[r] - mn) + cs * std::exp(cm - mn);
        mp[r] = std::isnan(cm) ? cm : mn;
        const int64_t j = tp[r] - v0;
        if (j >= 0 && j < c) pp[r] = row[j];
    }
}

}  // namespace

void register_span_head_ops(py::module_& m) {
    m.def("lse_chunk", &lse_chunk, py::arg("z"), py::arg("v0"), py::arg("tgt"), py::arg("cap"), py::arg("m"),
          py::arg("s"), py::arg("picked"),
          "the span head's online log-sum-exp over one vocabulary chunk z [M, c] float32 (soft-capped in place)");
}

}  // namespace sicl
