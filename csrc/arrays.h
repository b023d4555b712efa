// Argument checks and raw pointers for the numpy buffers the ops receive (torch tensors pass theirs with
// .numpy(); bf16 tensors as int16 views). Shared by every source file of sicl_fast.ops._C.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace sicl {

namespace py = pybind11;

// kind: 'f' float32, 'i' int64, 'n' int32, 'h' 16-bit (bf16 bits, passed as int16 or uint16); shape -1 = any size
inline void check_array(const py::array& arr, const char* name, char kind, std::vector<py::ssize_t> shape,
                        bool writable) {
    const auto dt = arr.dtype();
    const bool ok_dtype = kind == 'f'   ? dt.is(py::dtype::of<float>())
                          : kind == 'i' ? dt.is(py::dtype::of<int64_t>())
                          : kind == 'n' ? dt.is(py::dtype::of<int32_t>())
                                        : (dt.is(py::dtype::of<int16_t>()) || dt.is(py::dtype::of<uint16_t>()));
    if (!ok_dtype) {
        const char* want = kind == 'f'   ? "float32"
                           : kind == 'i' ? "int64"
                           : kind == 'n' ? "int32"
                                         : "16-bit (bf16 bits)";
        throw std::invalid_argument(std::string(name) + " must be " + want + ", got " + std::string(py::str(dt)));
    }
    if (!(arr.flags() & py::array::c_style)) throw std::invalid_argument(std::string(name) + " must be C-contiguous");
    if (writable && !arr.writeable()) throw std::invalid_argument(std::string(name) + " must be writable");
    if (static_cast<size_t>(arr.ndim()) != shape.size()) {
        throw std::invalid_argument(std::string(name) + " must have " + std::to_string(shape.size()) + " dims, got " +
                                    std::to_string(arr.ndim()));
    }
    for (size_t k = 0; k < shape.size(); ++k) {
        if (shape[k] >= 0 && arr.shape(k) != shape[k]) {
            throw std::invalid_argument(std::string(name) + ": dim " + std::to_string(k) + " is " +
                                        std::to_string(arr.shape(k)) + ", expected " + std::to_string(shape[k]));
        }
    }
}

// an optional input: None -> nullptr, else a checked array's data (C++ callers test the pointer)
inline const void* optional_data(const py::object& o, const char* name, char kind, std::vector<py::ssize_t> shape) {
    if (o.is_none()) return nullptr;
    // the caller's own array (no conversion: a converted copy would be freed on return); the caller holds it
    if (!py::isinstance<py::array>(o)) throw std::invalid_argument(std::string(name) + " must be an array or None");
    const py::array a = py::reinterpret_borrow<py::array>(o);
    check_array(a, name, kind, std::move(shape), false);
    return a.data();
}

inline const float* cf(const py::array& a) { return static_cast<const float*>(a.data()); }
inline float* mf(py::array& a) { return static_cast<float*>(a.mutable_data()); }
inline const uint16_t* ch(const py::array& a) { return static_cast<const uint16_t*>(a.data()); }
inline uint16_t* mh(py::array& a) { return static_cast<uint16_t*>(a.mutable_data()); }
inline const int64_t* ci(const py::array& a) { return static_cast<const int64_t*>(a.data()); }

}  // namespace sicl
