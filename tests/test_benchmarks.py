"""Every benchmark script runs end to end at tiny shapes and prints its JSON.

These time nothing (timings are the scripts' job, on an idle machine); they
keep the scripts from rotting: a benchmark that crashes only shows up when
someone needs its figure. Each runs in a subprocess, as a user would run it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lm_helpers import TINY, config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "shakespeare-cpu.toml")


def run_benchmark(script: str, *args: str, timeout: float = 300) -> dict:
    """Run benchmarks/<script> and return the last JSON object it printed."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-3000:]}"
    out, decoder, pos, last = proc.stdout, json.JSONDecoder(), 0, None
    while True:  # a script may print a note object before its result
        start = out.find("{", pos)
        if start < 0:
            break
        last, pos = decoder.raw_decode(out, start)
    assert isinstance(last, dict), f"{script} printed no JSON object:\n{out[-2000:]}"
    return last


def test_recurrence():
    r = run_benchmark("recurrence.py", "--quick", "--no-reference", "--repeats", "1",
                      "--copy-mb", "4", "--dtype", "float32", "float16")
    assert r["copy"]["GBps"] > 0
    assert set(r["cpu_kernel"]) >= {"forward", "backward", "forward_inference"}
    # a row per dtype: the C++ kernel where it computes the dtype, skipped where not
    fp32, fp16 = r["rows"]
    assert (fp32["dtype"], fp32["kernel"], fp16["dtype"], fp16["kernel"]) == (
        "fp32", "cpu", "fp16", "reference") and "skipped" in fp16
    assert fp32["forward_share"] > 0 and r["worst_share"] == min(fp32["forward_share"],
                                                                 fp32["backward_share"])
    assert r["cpu_kernel"]["forward"]["MB_moved"] == round(fp32["forward_bytes"] / 1e6, 1)


def test_layer_with_ablation():
    r = run_benchmark("layer.py", "--L", "8", "--B", "2", "--d", "16", "--proj", "8",
                      "--rounds", "1", "--reps", "1", "--ablate-recurrence")
    assert {"srupp_fp32", "srupp_bf16", "srupp_fp32_no_recurrence", "lstm_fp32",
            "transformer_fp32"} <= set(r["tokens_per_s"])


def test_layer_floor():
    L, B, d, P = 8, 2, 16, 8
    r = run_benchmark("layer_floor.py", "--L", str(L), "--B", str(B), "--d", str(d),
                      "--proj", str(P), "--rounds", "1", "--reps", "1", "--peak-n", "32")
    # every call of the step was captured: 3 projections, 1 attention, 1 recurrence a layer
    assert r["config"]["calls_per_step"] == {"projections": 6, "attention": 2,
                                             "recurrence": 2}
    # and the projections' products are exactly the step's: forward, input and weight
    # gradient of W1 (d->P), W2 (P->2P), W3 (P->3d) in two layers, less layer 0's
    # input gradient of W1 (its input needs none)
    per_layer = d * P + P * 2 * P + P * 3 * d
    expected = 2 * L * B * (2 * 3 * per_layer - d * P)
    for prec in ("fp32", "bf16"):
        p = r["precisions"][prec]
        assert p["projection_flop"] == expected
        assert p["floor_ms"] > 0 and p["step_ms"] > 0
        assert "ceiling_ratio_to_reference" in p  # `make` installs the reference package


def test_attention():
    r = run_benchmark("attention.py", "--B", "2", "--L", "16", "--d", "8", "--rounds", "1",
                      "--reps", "1", "--blocks", "4")
    assert {"default_fp32", "srupp_matmul_bf16", "srupp_one_block_fp32",
            "srupp_block4_bf16"} <= set(r["ms"])


def test_kernel_ab():
    """The same sources as the other version: a second build (of the recurrence alone,
    cached by its files' hash after the first run), the same results."""
    other = ROOT / "src" / "srupp" / "ops" / "csrc"
    r = run_benchmark("kernel_ab.py", str(other), "--L", "4", "--B", "2", "--d", "16",
                      "--rounds", "1", "--reps", "1", timeout=900)
    assert r["max_abs_difference"] == {"float32": 0.0, "bfloat16": 0.0}


def test_gemm():
    r = run_benchmark("gemm.py", "--rows", "64", "--rounds", "1", "--reps", "1")
    if "note" in r:
        pytest.skip(r["note"])  # a torch build without the oneDNN fp32 linear op
    assert len(r["gflops"]) == 9 and all(s > 0 for s in r["onednn_speedup"].values())


def test_allocator():
    r = run_benchmark("allocator.py", "--rounds", "1", "--steps", "1", timeout=600)
    assert r["default"]["ms_per_step"] > 0 and r["tuned"]["ms_per_step"] > 0


@pytest.mark.parametrize("script", ["lm_backends.py", "trainer_overhead.py"])
def test_recipe_step_benchmarks(script, corpus):
    r = run_benchmark(script, RECIPE, "--steps", "1", "--rounds", "1",
                      "--set", *TINY, f"data.corpus={corpus}")
    if script == "lm_backends.py":
        assert len(r["tokens_per_s"]) == 2 and min(r["tokens_per_s"].values()) > 0
    else:
        assert r["trainer_s_per_step"] > 0 and r["bare_s_per_step"] > 0


def test_step_profile_of_the_trainer(corpus):
    r = run_benchmark("step_profile.py", "--tiny", "--shapes", "trainer", "--precisions", "fp32",
                      "--set", f"data.corpus={corpus}")
    prof = r["shapes"]["trainer"]["fp32"]
    assert prof["steps_profiled"] == 1 and prof["steps_timed"] == 2 and prof["step_ms"] > 0
    assert {"gemm", "recurrence", "optimizer"} <= set(prof["by_kind_ms"])
    assert prof["device_busy_ms"] == pytest.approx(sum(prof["by_kind_ms"].values()), abs=0.1)
    assert prof["top"][0]["ms_per_step"] >= prof["top"][-1]["ms_per_step"] > 0


def test_step_profile():
    r = run_benchmark("step_profile.py", "--tiny")
    assert r["cpu"]["name"] and r["torch"] and {"avx512_bf16", "amx_bf16"} <= set(r["cpu"])
    assert set(r["shapes"]) == {"recipe", "layer"}
    for shape in r["shapes"].values():
        for precision in ("fp32", "bf16"):
            split = shape[precision]
            assert split["step_ms"] > 0
            cats = split["categories"]
            assert set(cats) == {"gemm", "attention", "recurrence", "other"}
            # every category is present, and together they are the whole split
            assert all(c["ms"] > 0 for c in cats.values())
            assert abs(sum(c["share"] for c in cats.values()) - 1) < 1e-3
            assert split["top_other_ops"]
    assert r["shapes"]["recipe"]["fp32"]["optimizer_ms"] > 0


def test_equal_params():
    r = run_benchmark("equal_params.py", "--params", "200000", "--precisions", "fp32",
                      "--rounds", "1", "--steps", "1", "--warmup", "1",
                      "--set", "train.batch_size=2", "train.unroll=8")
    # both models sized to the target (within compare's 10%), and the ratio reported
    assert all(abs(m["params"] - 200000) <= 20000 for m in r["models"].values())
    assert r["srupp_over_sru"]["fp32_eager"] > 0


def test_training_scale(corpus):
    r = run_benchmark("training_scale.py", RECIPE, "--steps", "2", "--rounds", "1",
                      "--set", *TINY, f"data.corpus={corpus}", "train.batch_size=4")
    assert set(r["tokens_per_s"]) == {"1 process", "2 processes"}
    assert min(r["tokens_per_s"].values()) > 0 and r["gemm_gflops_per_thread"] > 0


def test_generation(tmp_path, corpus):
    from srupp.train import Trainer

    run = tmp_path / "run"
    Trainer(config(corpus, "train.max_steps=2"), run, progress=False).train()
    r = run_benchmark("generation.py", str(run), "--rounds", "1", "--prompt", "4",
                      "--new", "3")
    assert r["new_tokens"] == 3 and r["tokens_per_s"]["run"] > 0


def test_int8_kernels():
    r = run_benchmark("int8_kernels.py", "--shapes", "tiny", "--rows", "1,3", "--rounds", "1")
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert list(r["shapes"]) == ["tiny R=1", "tiny R=3"] and r["w8a8_kernel"] in ("vnni", "plain")
    assert r["bf16_gemm_peak_gflops"] > 0
    from srupp.ops import cpu_kernels

    # the pair-packed format exactly where the extension has AVX512-BF16 products
    pairs = ("bf16_pairs",) if cpu_kernels.load().linear_rows_bf16_native() else ()
    assert ("bf16_pairs" in r["shapes"]["tiny R=1"]) == bool(pairs)
    for res in r["shapes"].values():
        for k in ("bf16", "int8", "w8a8", "w8a8_plain", "copy_bf16", "copy_int8") + pairs:
            assert res[k]["us"] > 0 and res[k]["GBps"] > 0
        for k in ("bf16", "int8", "w8a8", "w8a8_plain") + pairs:
            assert res[k]["share_of_gemm_peak"] > 0


def test_decode():
    r = run_benchmark("decode.py", "--quick", "--dtypes", "fp32,bf16,int8,w8a8")
    names = ["srupp", "sru", "lstm", "transformer"]
    assert list(r["models"]) == names and min(m["params"] for m in r["models"].values()) > 0
    assert list(r["dtypes"]) == ["fp32", "bf16", "int8", "w8a8"]
    assert r["dtypes"]["w8a8"]["kernel"] in ("vnni", "plain")
    fp32, int8 = (r["dtypes"][d]["bounds"]["srupp"]["weight_bytes"] for d in ("fp32", "int8"))
    assert fp32 / 4 < int8 < fp32 / 3  # a byte per weight, and the float embedding row etc.
    assert r["copy_large_buffer"]["GBps"] > 0
    for dtype, res in r["dtypes"].items():
        if "skipped" in res:
            assert dtype == "bf16" and not r["cpu_has_native_bf16"]
            continue
        gen = res["batch1"]["srupp_generate"]
        assert gen["same_tokens"] and gen["cpp_loop_tokens_per_s"] > 0
        assert gen["cpp_over_python"] == pytest.approx(
            gen["cpp_loop_tokens_per_s"] / gen["python_loop_tokens_per_s"], abs=1e-3)
        assert set(gen["parts_us"]) == {"stack_kernel", "output_module", "argmax",
                                        "embedding_module"}
        assert min(gen["parts_us"].values()) > 0
        for n in names:
            b, one = res["bounds"][n], res["batch1"][n]
            assert b["weight_bytes"] > 0 and one["tokens_per_s"] > 0
            assert one["same_tokens_as_generate"]
            for which in ("weight_buffer", "large_buffer"):
                bound = b[f"bound_tokens_per_s_{which}"]
                assert one[f"fraction_of_bound_{which}"] == pytest.approx(
                    one["tokens_per_s"] / bound, abs=1e-3)
            assert min(res["batched"][n].values()) > 0
        ctx = res["context"]
        speed, mem = ctx["tokens_per_s"], ctx["state_bytes"]
        for n in names:
            assert list(speed[n]) == ["32", "64"] and min(speed[n].values()) > 0
            assert all(mem[n][c] >= ctx["state_logical_bytes"][n][c] > 0 for c in mem[n])
            assert ctx["largest_over_smallest_context_tokens_per_s"][n] == pytest.approx(
                speed[n]["64"] / speed[n]["32"], abs=1e-3)
        for c in ("32", "64"):
            assert ctx["ratios"]["srupp_over_transformer_tokens_per_s"][c] == pytest.approx(
                speed["srupp"][c] / speed["transformer"][c], abs=1e-3)
            assert ctx["ratios"]["srupp_over_transformer_state_bytes"][c] == pytest.approx(
                mem["srupp"][c] / mem["transformer"][c], abs=1e-3)
        # the KV cache grows with the context; SRU++'s state is bounded by its window
        # (16 in --quick, below both contexts): no more than the window's steps apart
        assert mem["transformer"]["64"] > mem["transformer"]["32"]
        m = r["models"]["srupp"]
        per_step = m["num_layers"] * (m["d_model"] + 2 * m["proj_size"]) * 4
        assert mem["srupp"]["64"] <= mem["srupp"]["32"] + m["attention_window"] * per_step


def test_triton_compile():
    # (one compiling process: a second would start torch and triton for one variant)
    r = run_benchmark("triton_compile.py", "--limit", "2", "--archs", "90", "--workers", "1")
    assert r["compilations"] == 2 and not r["errors"] and not r["spilling"]


def test_gpu_model():
    r = run_benchmark("gpu_model.py", "--recipe", RECIPE, "--json", "--set", "model.d_model=64",
                      "model.proj_size=16", "model.num_layers=2")
    assert r["predicted_step_ms"] > 0 and r["calibration"]["measured_ms"] > 0


def test_gpu_check_dry_run(tmp_path):
    """benchmarks/gpu_check.py's every step, on the CPU at tiny sizes: the command a
    GPU window runs must not arrive broken."""
    r = run_benchmark("gpu_check.py", "--dry-run", "--out", str(tmp_path), timeout=900)
    report = json.loads((tmp_path / "gpu.json").read_text())
    steps = report["steps"]
    assert list(steps) == ["environment", "pytest", "bounds", "recurrence", "sweep", "layer",
                           "side_by_side", "profile"]
    assert r["ok"], {k: v.get("error") for k, v in steps.items() if not v["ok"]}
    assert steps["environment"]["result"]["torch"]
    assert steps["pytest"]["result"]["counts"]["passed"] > 0
    bounds = steps["bounds"]["result"]
    assert bounds["copy_GBps"] > 0 and bounds["gemm_bf16_TFLOPs"] > 0
    rows = steps["recurrence"]["result"]["rows"]
    assert {(x["dtype"], x["L"]) for x in rows} == {(d, L) for d in ("fp32", "bf16", "fp16")
                                                   for L in (8, 16)}
    assert all(x["forward_share"] > 0 for x in rows if "skipped" not in x)
    # the Triton kernels, which a GPU runs, ran too (under the interpreter), in every dtype
    assert {x["dtype"] for x in rows if x["kernel"] == "triton" and x["backward_GBps"] > 0} \
        == {"fp32", "bf16", "fp16"}
    _check_layer(steps["layer"]["result"])
    _check_side_by_side(steps["side_by_side"]["result"])
    # every launch configuration of the sweep computes what the default does, to the bit
    sweep = steps["sweep"]["result"]
    assert [(x["dtype"], x["config"]) for x in sweep["rows"]] == [
        (d, c) for d in ("bf16", "fp32") for c in (sweep["default_config"],
                                                     *_bench("_gpu_steps").DRY_SWEEP)]
    assert all(x["max_abs_diff_to_first"] == 0 and x["forward_ms"] > 0 for x in sweep["rows"])
    assert [x["default"] for x in sweep["rows"]] == [True, False, False] * 2
    assert not sweep["cut_short"] and set(sweep["best_config"]) == {"fp32", "bf16"}
    assert sweep["best_launch"]["bf16"] == next(
        [x["block"], x["num_warps"], x["stages"], x["steps"]] for x in sweep["rows"]
        if x["config"] == sweep["best_config"]["bf16"])
    # the side-by-side row on the sweep's fastest recurrence trained with that launch
    (row,) = [r for r in steps["side_by_side"]["result"]["rows"] if "launch" in r["backends"]]
    assert row["launch"] == sweep["best_launch"]["bf16"]
    prof = steps["profile"]["result"]
    assert prof["steps_profiled"] == 2 == prof["steps_timed"] and prof["step_ms"] > 0
    # the model's prediction beside the profile, kind by kind
    model = prof["model"]
    assert model["step"]["measured_ms"] == pytest.approx(prof["step_ms"], abs=1e-3)
    assert model["step"]["predicted_ms"] > 0 and {"gemm", "recurrence"} <= set(model["kinds"])
    assert prof["top"]
    assert sum(prof["by_kind_ms"].values()) > 0


def _check_layer(layer):
    """One layer (layer.py's measure), srupp and the reference only, the reference in both
    precisions: a mode of the reference that fails (its CPU path takes no bf16) is an
    error, not a crash."""
    timed = set(layer["tokens_per_s"])
    assert min(layer["tokens_per_s"].values()) > 0 and layer["shape"]["d"] == 32
    assert {"srupp_fp32_train", "srupp_bf16_infer", "reference_fp32_train"} <= timed
    assert not any(k.startswith(("lstm", "transformer")) for k in timed)
    # every reference mode either timed or reported
    assert {f"reference_{p}_{m}" for p in ("fp32", "bf16") for m in ("train", "infer")} \
        == {k for k in timed if not k.startswith("srupp")} | {
            f"reference_{k}" for k in layer["reference_errors"]}


def _check_side_by_side(side):
    """Every SIDE_BY_SIDE row trained (CUDA graphs, CUDA-only, skipped with its reason),
    at the same batch and length, with SRU++ and the Transformer within 10% in size."""
    names = [r["name"] for r in side["rows"]]
    assert names == [row[0] for row in _bench("_gpu_training").SIDE_BY_SIDE]
    for r in side["rows"]:
        if "cudagraphs" in " ".join(r["settings"]):
            assert r["skipped"] == "CUDA graphs need a CUDA device"
        else:
            assert r.get("error") is None and r["steps"] == 6 and r["tokens_per_s"] > 0, r
            assert abs(r["params"] - side["params_target"]) <= 0.1 * side["params_target"]
    assert list(side)[0] == "srupp_over_transformer" and side["srupp_over_transformer"] > 0
    assert side["best"]["srupp"].startswith("srupp") and side["srupp_mfu"] > 0


def _bench(module: str):
    """benchmarks/<module>.py, imported as the scripts import each other."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_gpu_check_quick_runs_the_four_steps_in_its_budget():
    gpu_check = _bench("gpu_check")
    names, budget = gpu_check.plan(gpu_check.parse_args(["--quick"]))
    assert [n for n, _, _ in names] == ["environment", "bounds", "sweep", "side_by_side"]
    assert budget == gpu_check.QUICK_BUDGET <= 240  # two calls fit a 15-minute GPU loan
    names, budget = gpu_check.plan(gpu_check.parse_args(["--quick", "--only", "bounds", "layer"]))
    assert [n for n, _, _ in names] == ["bounds"] and budget == gpu_check.QUICK_BUDGET
    names, budget = gpu_check.plan(gpu_check.parse_args([]))
    assert len(names) == len(gpu_check.STEPS) and budget == 560


def test_gpu_check_reads_why_a_build_failed_and_names_kernel_kinds():
    common, step_profile = _bench("_common"), _bench("step_profile")
    log = ("[1/3] nvcc -c sru_cuda_kernel.cu\nFAILED: sru_cuda_kernel.cuda.o\n"
           "sru_cuda_kernel.cu(12): error: identifier \"THCState\" is undefined\n"
           "1 error detected in the compilation of \"sru_cuda_kernel.cu\".\n"
           "[2/3] g++ -c sru_cuda_impl.cpp\nninja: build stopped: subcommand failed.")
    assert common.compiler_errors(log).splitlines() == [
        'sru_cuda_kernel.cu(12): error: identifier "THCState" is undefined',
        '1 error detected in the compilation of "sru_cuda_kernel.cu".',
        "ninja: build stopped: subcommand failed."]
    kinds = {name: step_profile.kernel_kind(name) for name in (
        "_sru_fwd_kernel", "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>",
        "void at::native::vectorized_elementwise_kernel<4, at::native::sigmoid_kernel>")}
    assert list(kinds.values()) == ["recurrence", "gemm", "gemm", "attention", "optimizer",
                                    "other element-wise"]


def test_gpu_check_isolates_a_failing_step(tmp_path):
    """A step that fails is recorded with its error; the next one still runs."""
    r = run_benchmark("gpu_check.py", "--dry-run", "--out", str(tmp_path), "--only", "pytest",
                      "bounds", "--pytest-targets", "tests/no_such_file.py")
    steps = json.loads((tmp_path / "gpu.json").read_text())["steps"]
    assert not r["ok"] and not steps["pytest"]["ok"] and "pytest failed" in steps["pytest"]["error"]
    assert steps["bounds"]["ok"] and steps["bounds"]["result"]["copy_GBps"] > 0


def test_gpu_check_pytest_cut_short_keeps_what_ran(tmp_path):
    """pytest stopped at its time limit (its process group killed) still reports the
    tests it finished, and says it was cut short."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        "def pytest_addoption(parser):\n    parser.addoption('--device', default='cpu')\n")
    (suite / "test_some.py").write_text(
        "import time\n\n"
        + "".join(f"def test_quick_{i}():\n    pass\n\n" for i in range(3))
        + "def test_zz_never_ends():\n    time.sleep(600)\n")
    result = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--step",
                           "pytest", "--result", str(result), "--step-timeout", "18",
                           "--dry-run", "--pytest-targets", str(suite)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(result.read_text())
    assert not r["ok"] and "time limit" in r["error"] and not r["result"]["complete"]
    assert r["result"]["counts"] == {"passed": 3}  # from the streamed lines: no summary
    assert r["seconds"] < 60  # the sleeping test was killed, with its process group


def test_serve_load():
    """Two load levels and one context on tiny models, through real servers."""
    r = run_benchmark("serve_load.py", "--tiny", "--levels", "1,2", "--tokens", "6",
                      "--prompt", "8", "--contexts", "24", "--context-tokens", "6",
                      "--context-streams", "2",
                      "--dtype", "fp32")
    assert r["bf16_gemm_peak_gflops"] > 0
    levels = r["load"][0]["levels"]
    assert [x["streams"] for x in levels] == [1, 2]
    for x in levels:
        assert x["tokens"] == 6 * x["streams"] and x["tokens_per_s_overall"] > 0
        itl = x["itl_ms"]  # None where every stream's tokens came in one event
        assert 0 < x["share_of_compute_bound"] and (itl["p50"] is None
                                                    or itl["p50"] <= itl["p99"])
    assert [x["streams"] for x in r["in_process"]] == [1, 2]
    assert all(x["bare_step_ms"] > 0 and x["engine_tokens_per_s"] > 0 for x in r["in_process"])
    ctx = r["contexts"][0]
    assert ctx["context"] == 24 and ctx["srupp_over_transformer_tokens_per_s"] > 0
    assert ctx["transformer"]["window"] == 24 and ctx["srupp"]["state_bytes_per_stream"] > 0


def test_every_script_is_smoke_tested_and_listed():
    """A script added to benchmarks/ gets a smoke test above and a row in its README."""
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    source = Path(__file__).read_text()
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    assert {s for s in scripts if f'"{s}"' not in source} == set()
    assert {s for s in scripts if f"`{s}`" not in readme} == set()


def test_crossover(tmp_path, corpus):
    """Two budgets (half a second and one) × one size of tiny runs through srupp compare,
    then the summary and the figure; a second call with --plot-only trains nothing and
    reads the same grid."""
    tiny = ["train.batch_size=2", "train.unroll=16", "train.log_every=10",
            "train.eval_max_batches=2", "eval.batch_size=2", "train.threads=1",
            "train.calibration_steps=5"]
    out = tmp_path / "grid"
    args = ["--corpus", str(corpus), "--budgets", "0.5,1", "--params", "20000",
            "--models", "srupp,sru", "--out", str(out), "--eval-every", "20", "--set", *tiny]
    r = run_benchmark("crossover.py", *args)
    assert set(r["cells"]) == {"p20000-b0.5", "p20000-b1"}
    for cell in r["cells"].values():
        assert set(cell["final"]) == {"srupp", "sru"}
        assert cell["winner"] in ("srupp", "sru") and cell["best_srupp_layout"] == "srupp"
        assert cell["best_srupp_minus_sru"] == pytest.approx(
            cell["final"]["srupp"] - cell["final"]["sru"], abs=2e-4)  # each rounded to 1e-4
    assert Path(r["figure"]).stat().st_size > 0
    again = run_benchmark("crossover.py", *args, "--plot-only")
    assert again["cells"] == r["cells"]
