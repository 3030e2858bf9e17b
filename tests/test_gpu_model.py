"""benchmarks/gpu_model.py: the counts of single ops, the rules applied to them, the
Python backward against torch's, and the whole model on the tiny recipe.

The traces run the trainer's step on fake CUDA tensors in a subprocess (the script's
own worker), a few seconds each; the rest is in-process on meta tensors."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "shakespeare-cpu.toml")
TINY = ["model.d_model=64", "model.proj_size=16", "model.num_layers=2", "train.batch_size=2",
        "train.unroll=16"]

sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import gpu_model as gm
    import step_profile  # gpu_check's profile step: its KERNEL_KINDS
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_one_gemm_counts_its_flops_and_bytes():
    M, K, N = 96, 64, 40
    a, b = meta(M, K, dtype=torch.bfloat16), meta(K, N, dtype=torch.bfloat16)
    (r,) = gm.record_ops(torch.mm, a, b)
    assert (r["name"], r["kind"], r["launches"], r["dtype"]) == ("mm", "gemm", 1, "bfloat16")
    assert r["flops"] == 2 * M * K * N
    assert r["read"] + r["written"] == (M * K + K * N + M * N) * 2


def test_element_wise_ops_count_bytes_and_views_cost_nothing():
    x, bias = meta(32, 48), meta(48)
    recs = gm.record_ops(lambda: (x + bias, x.t(), x.view(-1), x.mul_(2.0)))
    assert [r["name"] for r in recs] == ["add", "mul_"]  # the views launch nothing
    add, mul = recs
    assert add["kind"] == mul["kind"] == "elementwise" and add["flops"] == 0
    # the broadcast bias is read once; in place reads and writes x
    assert (add["read"], add["written"]) == ((32 * 48 + 48) * 4, 32 * 48 * 4)
    assert (mul["read"], mul["written"]) == (32 * 48 * 4, 32 * 48 * 4)
    # a cast is a cast, a copy that keeps the dtype is data movement
    cast, copy = gm.record_ops(lambda: (x.to(torch.bfloat16), x.clone()))
    assert (cast["kind"], copy["kind"]) == ("casts", "other")


def test_foreach_launches_follow_multi_tensor_apply():
    assert gm.foreach_launches([100] * 110, 1) == 1
    assert gm.foreach_launches([100] * 111, 1) == 2  # 110 tensors a launch
    assert gm.foreach_launches([100] * 37, 4) == 2  # 36 with four lists
    assert gm.foreach_launches([gm.FOREACH_CHUNK * 320], 1) == 1
    assert gm.foreach_launches([gm.FOREACH_CHUNK * 321], 1) == 2  # 320 blocks a launch


def test_the_recurrence_is_counted_as_recurrence_and_priced_by_its_latency():
    import srupp.ops.recurrence  # noqa: F401 - registers srupp::sru_fwd

    B, L, D = 2, 512, 64
    U, x = meta(B, L, 3, D, dtype=torch.bfloat16), meta(B, L, D, dtype=torch.bfloat16)
    (r,) = gm.record_ops(torch.ops.srupp.sru_fwd, U, x, meta(2, D), meta(2, D), meta(B, D),
                         None, None, 1.0, False, True, True)
    assert r["kind"] == "recurrence" and r["extra"]["L"] == L
    measured = gm.read_gpu_json()
    gpu = gm.gpu_set("h200", measured)
    row = next(x for x in measured["recurrence"]["rows"] if x["dtype"] == "bf16" and x["L"] == L)
    # a few kilobytes: the time is L steps of the measured per-step latency
    assert gm.op_ms(r, gpu, "plain", 0.7) == pytest.approx(row["forward_ms"])
    moved = (r["read"] + r["written"]) / (0.7 * gpu["copy_GBps"] * 1e9) * 1e3
    assert gm.op_ms(r, gpu, "pipelined", 0.7) == pytest.approx(moved)


def test_attention_counts_the_visible_pairs():
    full = gm.attention_cost(2, 1, 64, 128, 32, 32, "dense", "efficient", 2)
    lower = gm.attention_cost(2, 1, 64, 128, 32, 32, "causal_lower_right", "efficient", 2)
    assert full["forward"]["flops"] == 2 * 2 * 64 * 128 * (32 + 32)
    assert lower["forward"]["flops"] == 2 * 2 * (64 * 64 + 64 * 65 // 2) * (32 + 32)
    math_ = gm.attention_cost(2, 1, 64, 128, 32, 32, "dense", "math", 2)
    assert math_["forward"]["read"] > full["forward"]["read"]  # the scores go through memory


def test_compiled_fuses_a_layers_element_wise_run_to_its_boundary():
    def rec(name, kind, reads, writes, layer=0):
        return {"name": name, "kind": kind, "phase": "forward", "layer": layer, "flops": 0,
                "read": sum(n for _, n in reads), "written": sum(n for _, n in writes),
                "launches": 1, "dtype": "float32", "reads": reads, "writes": writes}

    # a -> [mul -> b, add b -> c] -> mm reads c; b is an intermediate nothing else reads
    records = [rec("mul", "elementwise", [[1, 100]], [[2, 100]]),
               rec("add", "elementwise", [[2, 100]], [[3, 100]]),
               rec("mm", "gemm", [[3, 100]], [[4, 10]]),
               rec("mul", "elementwise", [[4, 10]], [[5, 10]], layer=None)]
    fused = gm.fuse_compiled(records)
    assert [r["name"] for r in fused] == ["fused[2 ops]", "mm", "mul"]
    assert (fused[0]["launches"], fused[0]["read"], fused[0]["written"]) == (1, 100, 100)
    assert fused[2] is records[3]  # outside the layers nothing changes


def test_gemm_waves_count_the_blocks_that_fill_the_sms():
    tm, tn = gm.GEMM_TILE
    sms = 132
    assert gm.gemm_wave_efficiency([1, tm * 132, 64, tn], sms) == 1.0      # one full wave
    # one block past a wave: 133 blocks of 128 x 256, or 67 x 2 = 134 of 256 x 128 (better)
    assert gm.gemm_wave_efficiency([1, tm * 133, 64, tn], sms) == pytest.approx(134 / 264)
    assert gm.gemm_wave_efficiency([2, tm * 66, 64, tn], sms) == 1.0       # batch counts
    # fewer blocks than SMs: a long K is split to fill them, a short one is not
    assert gm.gemm_wave_efficiency([1, tm, 64, tm], sms) == pytest.approx(1 / 132)
    assert gm.gemm_wave_efficiency([1, tm * 66, 2 * gm.GEMM_SPLIT_K_MIN, tn], sms) == 1.0
    # the better orientation of the tile
    assert gm.gemm_wave_efficiency([1, tn * 132, 64, tm], sms) == 1.0
    # the full-wave rate is the measured 8192^3 rate over that product's own efficiency
    measured = gm.read_gpu_json()
    gpu = gm.gpu_set("h200", measured)
    calib = gm.gemm_wave_efficiency([1, *gm.GEMM_CALIBRATION], 132)
    assert calib < 1 and gpu["full_wave_half_tflops"] == pytest.approx(
        measured["bounds"]["gemm_bf16_TFLOPs"] / calib)
    r = {"name": "mm", "kind": "gemm", "flops": 2 * 8192 ** 3, "read": 0, "written": 0,
         "launches": 1, "dtype": "bfloat16", "gemm": [1, 8192, 8192, 8192]}
    assert gm.op_ms(r, gpu, "plain", 0.7) == pytest.approx(
        r["flops"] / (measured["bounds"]["gemm_bf16_TFLOPs"] * 1e12) * 1e3)


def test_attention_shares_follow_their_sources():
    eff = gm.attention_share("efficient", 768, (9, 0))
    assert eff == pytest.approx(156 / 312 * 0.35 / 0.73)
    assert gm.attention_share("efficient", 768, (8, 0)) == pytest.approx(156 / 312)
    assert gm.attention_share("efficient", 128, (9, 0)) == pytest.approx(178 / 312 * 0.35 / 0.73)
    assert gm.attention_share("efficient", 136, (9, 0)) == eff  # the kMaxK=65536 kernel
    flash = gm.attention_share("flash", 128, (9, 0))
    assert flash == pytest.approx(0.30)
    assert gm.attention_share("cudnn", 128, (9, 0)) == pytest.approx(2 * flash)
    with pytest.raises(ValueError, match="math"):
        gm.attention_share("math", 64, (9, 0))


def test_visible_blocks_match_a_brute_force_count():
    def brute(L, S, mask, bq, bk):
        off = S - L if mask == "causal_lower_right" else 0
        n = 0
        for q0 in range(0, L, bq):
            for k0 in range(0, S, bk):
                seen = any(k <= off + q for q in range(q0, min(q0 + bq, L))
                           for k in range(k0, min(k0 + bk, S))) if mask != "none" else True
                n += seen
        return n

    for L, S, mask in ((40, 40, "causal"), (40, 72, "causal_lower_right"), (33, 50, "none")):
        assert gm.visible_blocks(L, S, mask, 8, 16) == brute(L, S, mask, 8, 16)


def test_the_efficient_backward_at_large_head_dims_pays_its_grid_and_accumulators():
    # enwik8-base: one head of 768, B 16, 1024 queries over 2048 keys
    small = gm.attention_cost(16, 1, 1024, 2048, 128, 128, "causal_lower_right",
                              "efficient", 2)
    large = gm.attention_cost(16, 1, 1024, 2048, 768, 768, "causal_lower_right",
                              "efficient", 2)
    flash = gm.attention_cost(16, 1, 1024, 2048, 768, 768, "causal_lower_right", "flash", 2)
    # num_splits_key = ceil(2048 / 64) = 32, capped at 200 // 16 = 12 past K 128
    assert small["backward"]["ctas"] == 32 * 16 and large["backward"]["ctas"] == 12 * 16
    # fp32 accumulators through global memory: only the K > 128 kernels
    plain = lambda c, hd: c["backward"]["read"] - (  # noqa: E731 - q, k, v, 2 o and lse
        16 * (1024 * hd + 2048 * 2 * hd + 2 * 1024 * hd) * 2 + 16 * 1024 * 4)
    assert plain(small, 128) == 0 and plain(flash, 768) == 0 and plain(large, 768) > 0
    assert large["forward"]["read"] > flash["forward"]["read"]
    gpu = gm.gpu_set("h200", gm.read_gpu_json())

    def rec(cost, hd, ctas):
        return dict(cost["backward"], name="scaled_dot_product_attention_backward",
                    kind="attention", dtype="bfloat16",
                    extra={"backend": "efficient", "head_dim": hd, "dv": hd, "ctas": ctas})

    # 192 blocks on 132 SMs: two waves, the second 60/132 full
    assert gm.op_rate_tflops(rec(large, 768, 192), gpu) == pytest.approx(
        989.0 * gm.attention_share("efficient", 768, (9, 0)) * 192 / 264)
    # its time: the slower of its FLOPs at that rate and its bytes at copy bandwidth
    r = rec(large, 768, 192)
    assert gm.op_ms(r, gpu, "plain", 0.7) == pytest.approx(1e3 * max(
        r["flops"] / (gm.op_rate_tflops(r, gpu) * 1e12),
        (r["read"] + r["written"]) / (gpu["copy_GBps"] * 1e9)))
    compute = dict(r, read=0, written=0)
    assert gm.op_ms(compute, gpu, "plain", 0.7) > gm.op_ms(dict(compute, extra=dict(
        r["extra"], ctas=264)), gpu, "plain", 0.7)


def _rec(ms_flops, launches=1, calls=1, syncs=0, phase="forward"):
    return {"name": "mm", "kind": "gemm", "phase": phase, "layer": None, "flops": ms_flops,
            "read": 0, "written": 0, "launches": launches, "dtype": "bfloat16",
            "calls_before": calls, "syncs_before": syncs, "reads": [], "writes": []}


def test_the_timeline_waits_for_the_slower_of_host_and_device():
    # device-bound: 3 kernels of 1 ms; the host queues each in 10 us
    recs = [_rec(0), _rec(0), _rec(0)]
    line = gm.timeline(recs, [1.0, 1.0, 1.0], call_us=5.0, launch_us=5.0)
    assert line["device_ms"] == 3.0 and line["host_ms"] == pytest.approx(0.03)
    assert line["synced_ms"] == pytest.approx(3.01)  # the first launch, then back to back
    # host-bound: 100 calls before each 10 us kernel
    recs_h = [_rec(0, calls=100) for _ in range(3)]
    line = gm.timeline(recs_h, [0.01] * 3, call_us=5.0, launch_us=5.0)
    assert line["host_ms"] == pytest.approx(3 * 0.505)
    assert line["synced_ms"] == pytest.approx(3 * 0.505 + 0.01)
    # a sync before the last record makes the host wait for the first two kernels
    recs_s = [_rec(0), _rec(0), _rec(0, syncs=1)]
    line = gm.timeline(recs_s, [1.0, 1.0, 1.0], call_us=5.0, launch_us=5.0)
    assert line["host_ms"] == pytest.approx(2.01 + 0.01)
    assert line["synced_ms"] == pytest.approx(3.01 + 0.01)


def test_profile_kinds_are_gpu_checks_and_name_the_kernels_it_would_see():
    theirs = {k for k, _ in step_profile.KERNEL_KINDS} | {"other element-wise"}
    assert set(gm.PROFILE_KINDS) == theirs
    assert set(gm.PROFILE_KIND_OF_OP.values()) <= theirs
    # the kernels each op launches on CUDA, and the kind gpu_check gives their names
    kernels = {
        "scaled_dot_product_attention": "fmha_cutlassF_bf16_aligned_32x128_gmem_sm80",
        "scaled_dot_product_attention_backward": "fmha_cutlassB_bf16_aligned_128x64_k65536_sm80",
        "sru_fwd": "_sru_fwd_kernel", "sru_bwd": "_sru_bwd_kernel",
        "mm": "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT",
        "bmm": "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64",
        "native_layer_norm": "void at::native::vectorized_layer_norm_kernel<float, float>",
        "_log_softmax": "void at::native::cunn_SoftMaxForward<4, float, float, float>",
        "nll_loss_forward": "void at::native::nll_loss_forward_reduce_cuda_kernel_2d<float>",
        "native_dropout": "void at::native::fused_dropout_kernel_vec<c10::BFloat16, float>",
        "native_dropout_backward": "void at::native::masked_scale_kernel<c10::BFloat16>",
        "_to_copy": "void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>",
        "cat": "void at::native::CatArrayBatchedCopy<at::native::OpaqueType<2u>, 4, 64>",
        "_foreach_mul_": "void at::native::multi_tensor_apply_kernel<TensorListMetadata<1>>",
        "mul": "void at::native::vectorized_elementwise_kernel<4, BinaryFunctor<MulFunctor>>",
        "add": "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>",
    }
    for op, kernel in kernels.items():
        assert gm.profile_kind({"name": op}) == step_profile.kernel_kind(kernel), op


def test_compare_to_profile_pairs_the_kinds_and_the_step():
    prediction = {"by_profile_kind": {k: 1.0 for k in gm.PROFILE_KINDS},
                  "predicted_step_ms": 50.0, "device_ms": 9.0}
    prediction["by_profile_kind"]["attention"] = 4.0
    profile = {"step_ms": 100.0, "device_busy_ms": 90.0,
               "by_kind_ms": {"attention": 8.0, "gemm": 2.0, "new kind": 3.0}}
    out = gm.compare_to_profile(prediction, {"ok": True, "result": profile})
    assert out["kinds"]["attention"] == {"predicted_ms": 4.0, "measured_ms": 8.0, "ratio": 0.5}
    assert out["kinds"]["gemm"]["ratio"] == 0.5
    assert out["kinds"]["norm"]["measured_ms"] == 0.0 and out["kinds"]["norm"]["ratio"] is None
    assert out["kinds"]["new kind"] == {"predicted_ms": 0.0, "measured_ms": 3.0, "ratio": 0.0}
    assert out["unmapped_profile_kinds"] == ["new kind"]
    assert out["step"]["ratio"] == 0.5 and out["device_busy"]["ratio"] == 0.1
    with pytest.raises(ValueError, match="by_profile_kind"):
        gm.compare_to_profile({"predicted_step_ms": 1.0}, profile)
    with pytest.raises(ValueError, match="by_kind_ms"):
        gm.compare_to_profile(prediction, {"step_ms": 1.0})


@pytest.fixture(scope="module")
def traces():
    """The tiny recipe on fake CUDA, on meta, and with srupp's matmul attention; the
    calibration step and gpu_check's layer step (one process)."""
    base = {"recipe": RECIPE, "sets": TINY, "precision": "bf16", "capability": [9, 0]}
    run = gm.read_gpu_json()["enwik8"]
    calibration = {"calibration": True, "batch": run["batch"], "precision": "bf16",
                   "capability": [9, 0], "mode": "fake-cuda"}
    shape = gm.read_gpu_json()["layer"]["shape"]
    layer = {"workload": "layer", "d": shape["d"], "proj": shape["proj"], "L": shape["L"],
             "B": shape["B"], "precision": "bf16", "capability": [9, 0], "mode": "fake-cuda"}
    return gm.run_traces([dict(base, mode="fake-cuda"), dict(base, mode="meta"), calibration,
                          layer, dict(base, mode="fake-cuda", attention="matmul")])


def test_the_trace_holds_every_kind_of_a_training_step(traces):
    t = traces[0]
    assert t["mode"] == "fake-cuda" and t["tokens_per_step"] == 2 * 16
    kinds = {r["kind"] for r in t["records"]}
    assert {"gemm", "attention", "recurrence", "elementwise", "casts", "optimizer"} <= kinds
    phases = {r["phase"] for r in t["records"]}
    assert {"forward", "backward", "clip", "optimizer"} <= phases
    # each layer's recurrence runs forward and backward, on the Triton custom ops
    rec = [r["name"] for r in t["records"] if r["kind"] == "recurrence"]
    assert sorted(rec) == ["sru_bwd"] * 2 + ["sru_fwd"] * 2
    assert t["optimizer_impl"] == "foreach"  # RAdam on CUDA
    assert all(c["mask"] == "causal_lower_right" for c in t["attention_calls"])  # memory
    assert traces[1]["mode"] == "meta" and traces[1]["records"]


def test_every_dispatcher_call_is_counted_once_before_its_record(traces):
    for t in traces:
        laid_out = sum(r["calls_before"] for r in t["records"]) + t["calls_after"]
        assert laid_out == sum(t["calls"].values())
        # views and CPU scalar work are calls without a kernel: more calls than records
        assert laid_out > len(t["records"])


def test_the_calibration_step_is_the_gpu_runs_model(traces):
    cal, run = traces[2], gm.read_gpu_json()["enwik8"]
    assert cal["params"] == run["params"] and cal["flops_per_token"] == run["flops_per_token"]
    assert (cal["batch"], cal["unroll"]) == (run["batch"], run["unroll"])


def test_the_layer_step_is_gpu_checks_layer(traces):
    t, shape = traces[3], gm.read_gpu_json()["layer"]["shape"]
    assert t["workload"] == "layer" and t["tokens_per_step"] == shape["L"] * shape["B"]
    assert {r["phase"] for r in t["records"]} == {"forward", "backward"}  # no optimizer
    rec = sorted(r["name"] for r in t["records"] if r["kind"] == "recurrence")
    assert rec == ["sru_bwd", "sru_fwd"]
    # one head of d' over the segment, no memory: causal, on the memory-efficient kernel
    assert [(c["mask"], c["head_dim"], c["backend"]) for c in t["attention_calls"]] == [
        ("causal", shape["proj"], "efficient")]
    gemms = {tuple(r["gemm"][1:]) for r in t["records"] if "gemm" in r}
    assert (shape["L"] * shape["B"], shape["d"], shape["proj"]) in gemms  # [M, K, N]


def test_matmul_attention_is_products_and_passes_over_p(traces):
    sdpa, matmul = traces[0], traces[4]
    assert matmul["attention"] == "matmul"
    att = [r for r in matmul["records"] if r["kind"] == "attention"]
    names = {r["name"] for r in att}
    assert "bmm" in names and "_softmax" in names and "_softmax_backward_data" in names
    assert not names & set(gm._SDPA_OPS)
    # its products are priced as GEMMs, by their shapes
    assert all("gemm" in r for r in att if r["name"] == "bmm")
    assert {r["phase"] for r in att} == {"forward", "backward"}
    n_att = sum(r["launches"] for r in sdpa["records"] if r["kind"] == "attention")
    assert sum(r["launches"] for r in att) > n_att


def test_options_take_launches_and_time_away(traces):
    t, gpu = traces[0], gm.gpu_set("h200", gm.read_gpu_json())
    base = gm.predict(t, gpu)
    assert base["device_ms"] == pytest.approx(sum(base["by_kind"].values()), abs=1e-2)
    assert base["device_ms"] == pytest.approx(sum(base["by_profile_kind"].values()), abs=1e-2)
    assert base["predicted_step_ms"] == pytest.approx(max(base["device_ms"], base["host_ms"]),
                                                      abs=1e-3)
    compiled = gm.predict(t, gpu, compiled=True)
    fused = gm.predict(t, gpu, fused_optimizer=True)
    pipelined = gm.predict(t, gpu, recurrence="pipelined")
    assert compiled["launches"] < base["launches"] and fused["launches"] < base["launches"]
    assert compiled["host_ms"] < base["host_ms"] and fused["host_ms"] < base["host_ms"]
    assert compiled["by_kind"]["gemm"] == base["by_kind"]["gemm"]
    assert pipelined["by_kind"]["recurrence"] < base["by_kind"]["recurrence"]
    a100 = gm.gpu_set("a100", gm.read_gpu_json())
    gemm_ms = [sum(gm.op_ms(r, g, "plain", 0.7) for r in t["records"] if r["kind"] == "gemm")
               for g in (gpu, a100)]
    assert 0 < gemm_ms[0] < gemm_ms[1]


def test_calibration_reports_both_points_with_the_same_constants(traces):
    measured = gm.read_gpu_json()
    cal = gm.calibration(traces[2], measured, layer_trace=traces[3])
    shape = measured["layer"]["shape"]
    tps = measured["layer"]["tokens_per_s"]["srupp_bf16_train"]
    assert cal["layer_measured_ms"] == pytest.approx(shape["L"] * shape["B"] / tps * 1e3,
                                                     abs=1e-3)
    lp = gm.predict(traces[3], gm.gpu_set("h200", measured), timing="synced")
    assert cal["layer_predicted_ms"] == lp["predicted_step_ms"]
    assert cal["layer"]["timing"] == "synced" and cal["step"]["timing"] == "steady"
    for point in (cal["step"], cal["layer"]):
        assert point["device_ms"] > 0 and point["host_ms"] > 0
        assert point["by_kind"]["attention"] > 0 and point["by_kind"]["recurrence"] > 0
    # a miss says what the model lacks; a hit would not
    assert ("lacks" in cal) == (not cal["within_25_percent_both"])
    # other costs, other predictions: the constants reach both points
    dearer = gm.calibration(traces[2], measured, call_us=2 * gm.CALL_US, layer_trace=traces[3])
    assert dearer["layer"]["host_ms"] > cal["layer"]["host_ms"]
    assert dearer["step"]["host_ms"] > cal["step"]["host_ms"]


def test_run_backward_gives_torchs_gradients():
    """The Python backward that the trace uses, on real CPU tensors, against torch's."""
    from srupp.models import build_model
    from srupp.train import build_config

    cfg = build_config(RECIPE, TINY + ["model.dropout=0"])
    torch.manual_seed(0)
    model = build_model(cfg.model_config(256))
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    state = model(x, None, targets=y).state.detach()  # the memory: attention over it
    model(x, state, targets=y).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with gm.tracked_functions():
        loss = model(x, state, targets=y).loss
        gm.run_backward(loss, torch.ones_like(loss))
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-6, msg=n)


def test_main_prints_the_prediction_and_its_calibration(capsys):
    gm.main(["--recipe", RECIPE, "--set", *TINY, "--json"])
    res = json.loads(capsys.readouterr().out)
    for key in ("predicted_step_ms", "predicted_tokens_per_s", "predicted_mfu"):
        assert math.isfinite(res[key]) and res[key] > 0
    assert set(res["by_kind"]) == set(gm.KINDS)
    assert res["launches"] > 0 and res["top"] and res["assumptions"]["launch_us"] > 0
    assert res["host"]["calls"] > res["launches"] and res["host_ms"] > 0
    assert res["bound"] in ("device", "host")
    assert sum(res["attention_backends"]["by_backend"].values()) == 2  # one per layer
    cal, run = res["calibration"], gm.read_gpu_json()["enwik8"]
    assert cal["measured_ms"] == pytest.approx(
        run["batch"] * run["unroll"] / run["tokens_per_s"] * 1e3, abs=1e-3)
    assert math.isfinite(cal["predicted_ms"]) and cal["predicted_ms"] > 0
    assert cal["ratio"] == pytest.approx(cal["predicted_ms"] / cal["measured_ms"], abs=1e-3)
    assert cal["layer_predicted_ms"] > 0 and cal["layer_measured_ms"] > 0
    # the host's cost per call was measured here, and every host figure uses it
    host = res["host_measurement"]
    assert host["call_us"] > 0 and host["calls"] > 0 and host["cpu"]
    assert host["call_us"] == pytest.approx(host["step_ms"] * 1e3 / host["calls"], rel=0.01)
    assert res["host"]["call_us"] == host["call_us"] == cal["step"]["host"]["call_us"]
    assert "measured here" in res["assumptions"]["host"]["call_source"]


def test_a_given_call_cost_is_used_without_measuring(capsys):
    gm.main(["--recipe", RECIPE, "--set", *TINY, "--call-us", "6.8", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert "host_measurement" not in res and res["host"]["call_us"] == 6.8


def test_main_refuses_matmul_attention_in_compiled_layers(capsys):
    with pytest.raises(SystemExit) as e:
        gm.main(["--recipe", RECIPE, "--set", *TINY, "--compiled", "--attention", "matmul"])
    assert e.value.code == 2 and "SDPA" in capsys.readouterr().err
