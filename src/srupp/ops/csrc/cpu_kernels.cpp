// srupp's C++ CPU kernels as one Python module (srupp/ops/cpu_kernels.py builds every .cpp
// file of this folder into it and loads it): the bindings of each kernel family, whose
// code lives in its own file beside this one (common.h lists them and what they share).

#include "common.h"

// what <torch/extension.h> would bring that this file uses, at a third of its parsing:
// pybind11 with torch's type casters, and the dispatcher registration
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <string>

namespace {

// The vector ISA this build was compiled for (the flags that srupp/ops/cpu_kernels.py
// passes to every file).
std::string capability() {
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#else
  return "default";
#endif
}

}  // namespace

// srupp::layer_step is a dispatcher op (its schema, fake kernel and reference live in
// srupp/ops/layer_step.py, which defines the schema before this library loads): eager
// calls reach this kernel through C++ only.
TORCH_LIBRARY_IMPL(srupp, CPU, m) { m.impl("layer_step", &srupp_cpu::layer_step_cpu); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace srupp_cpu;
  m.doc() = "srupp: fused multithreaded CPU kernels of the SRU recurrence";
  // The kernels touch no Python object: they let go of the GIL while they run, so that
  // another Python thread (a server's event loop beside its decoding thread) runs then
  // instead of waiting for the interpreter's switch interval.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("sru_fwd", &sru_fwd_cpu, "SRU recurrence forward (CPU)", nogil);
  m.def("sru_bwd", &sru_bwd_cpu, "SRU recurrence backward (CPU)", nogil);
  m.def("linear_rows", &linear_rows_cpu, "x @ weight^T (+ bias) for a few rows (decoding)",
        nogil);
  m.def("stack_step", &stack_step_cpu,
        "an SRU++ stack's decoding step: layer_step for each layer, in one call", nogil);
  m.def("decode_loop", &decode_loop_cpu,
        "up to n tokens of an LM with an SRU++ stack: sample, embed, stack_step, output", nogil);
  m.def("attend_one_query", &attend_one_query_cpu,
        "softmax(scale q K^T) V for one query per (batch, head) (decoding)", nogil);
  m.def("pack_pairs_bf16", &pack_pairs_bf16_cpu,
        "bf16 weight (O, I) -> (I/2, O, 2), the layout linear_pairs_bf16 reads", nogil);
  m.def("linear_pairs_bf16", &linear_pairs_bf16_cpu,
        "x @ W^T (+ bias) with W pair-packed (AVX512-BF16 CPUs)", nogil);
  m.def("linear_rows_bf16_native", &linear_rows_bf16_native,
        "whether linear_rows' bf16 products use AVX512-BF16 dot products");
  m.def("linear_int8_rows", &linear_int8_rows_cpu,
        "(x @ int8 weight^T) * scale (+ bias) for a few rows (decoding)", nogil);
  m.def("linear_int8_rows_avx512", &linear_int8_rows_avx512,
        "whether linear_int8_rows runs its AVX-512 loop");
  m.def("linear_w8a8_rows", &linear_w8a8_rows_cpu,
        "(int8 x per row . int8 weight^T) * scales (+ bias) for a few rows (decoding)", nogil);
  m.def("linear_w8a8_rows_vnni", &linear_w8a8_rows_vnni,
        "whether linear_w8a8_rows runs its VNNI loop");
  m.def("empty_cache", []() { return static_cast<int64_t>(empty_cache()); },
        "free the cached output blocks; returns the bytes released");
  m.def("set_cache_limit", [](int64_t bytes) { set_cache_limit(static_cast<size_t>(std::max<int64_t>(0, bytes))); },
        "most bytes of freed output blocks to keep for reuse (0: none)");
  m.def("cache_limit", []() { return static_cast<int64_t>(cache_limit()); },
        "current limit of the output-block cache, in bytes");
  m.def("cached_bytes", []() { return static_cast<int64_t>(cached_bytes()); },
        "bytes held in the output-block cache");
  m.def("capability", &capability, "vector ISA the extension was compiled for");
  // srupp.ops.settings.tuning().layer_step_team sets it (and reads it back in its tests)
  m.def("set_layer_step_team", [](bool on) { layer_step_impl::team_enabled.store(on); },
        "whether a layer's step at few rows runs in one parallel region (default on)");
  m.def("layer_step_team", []() { return layer_step_impl::team_enabled.load(); },
        "whether a layer's step at few rows runs in one parallel region");
  // srupp.ops.settings.tuning().decode_row_group sets it (and reads it back in its tests)
  m.def("set_decode_row_group", [](int64_t rows) { row_group_rows.store(rows); },
        "rows the token loop runs at once where it may split the batch (0: all)");
  m.def("decode_row_group", []() { return row_group_rows.load(); },
        "rows the token loop runs at once where it may split the batch (0: all)");
  m.def("decode_row_groups", &decode_row_groups,
        "the (first row, rows) groups decode_loop runs a batch in (tests read the rule)");
  m.def("vector_width", []() { return static_cast<int64_t>(kW); }, "floats per vector");
}
