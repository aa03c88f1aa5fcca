// Attributes of the handlers that bind the dictionary of all their attributes (.Attrs()) instead
// of each by name: so that an attribute may be absent (one added later, which programs exported
// before it do not pass), and an unknown name is refused rather than silently ignored. Each
// function returns "" or the problem, for the handler to prefix with its name.
#ifndef JAX_FP4_CUDA_ATTRIBUTES_H_
#define JAX_FP4_CUDA_ATTRIBUTES_H_

#include <algorithm>
#include <initializer_list>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace cuda {

// "" when every attribute's name is one of `known`.
inline std::string CheckAttributeNames(const xla::ffi::Dictionary& attrs,
                                       std::initializer_list<std::string_view> known) {
  for (const std::string_view name : attrs) {
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      return "unknown attribute " + std::string(name);
    }
  }
  return "";
}

// Reads attribute `name` into *out; an absent one is a problem unless `optional` (*out kept).
template <typename V>
std::string ReadAttribute(const xla::ffi::Dictionary& attrs, std::string_view name, V* out,
                          bool optional = false) {
  if (!attrs.contains(name)) return optional ? "" : "missing attribute " + std::string(name);
  xla::ffi::ErrorOr<V> value = attrs.get<V>(name);
  if (!value.has_value()) {
    return "attribute " + std::string(name) + " has the wrong type (" + value.error().message() +
           ")";
  }
  *out = *value;
  return "";
}

}  // namespace cuda
}  // namespace jax_fp4

#endif  // JAX_FP4_CUDA_ATTRIBUTES_H_
