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


@pytest.fixture(scope="module")
def traces():
    """The tiny recipe on fake CUDA and on meta, and the calibration step (one process)."""
    base = {"recipe": RECIPE, "sets": TINY, "precision": "bf16", "capability": [9, 0]}
    run = gm.read_gpu_json()["enwik8"]
    calibration = {"calibration": True, "batch": run["batch"], "precision": "bf16",
                   "capability": [9, 0], "mode": "fake-cuda"}
    return gm.run_traces([dict(base, mode="fake-cuda"), dict(base, mode="meta"), calibration])


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


def test_the_calibration_step_is_the_gpu_runs_model(traces):
    cal, run = traces[2], gm.read_gpu_json()["enwik8"]
    assert cal["params"] == run["params"] and cal["flops_per_token"] == run["flops_per_token"]
    assert (cal["batch"], cal["unroll"]) == (run["batch"], run["unroll"])


def test_options_take_launches_and_time_away(traces):
    t, gpu = traces[0], gm.gpu_set("h200", gm.read_gpu_json())
    base = gm.predict(t, gpu)
    assert base["predicted_step_ms"] == pytest.approx(sum(base["by_kind"].values()), abs=1e-2)
    compiled = gm.predict(t, gpu, compiled=True)
    fused = gm.predict(t, gpu, fused_optimizer=True)
    pipelined = gm.predict(t, gpu, recurrence="pipelined")
    assert compiled["launches"] < base["launches"] and fused["launches"] < base["launches"]
    assert compiled["by_kind"]["gemm"] == base["by_kind"]["gemm"]
    assert pipelined["by_kind"]["recurrence"] < base["by_kind"]["recurrence"]
    a100 = gm.gpu_set("a100", gm.read_gpu_json())
    gemm_ms = [sum(gm.op_ms(r, g, "plain", 0.7) for r in t["records"] if r["kind"] == "gemm")
               for g in (gpu, a100)]
    assert 0 < gemm_ms[0] < gemm_ms[1]


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
    assert set(res["by_kind"]) >= {"gemm", "attention", "recurrence", "elementwise", "casts",
                                   "optimizer", "launch_overhead"}
    assert res["launches"] > 0 and res["top"] and res["assumptions"]["launch_us"] > 0
    assert sum(res["attention_backends"]["by_backend"].values()) == 2  # one per layer
    cal, run = res["calibration"], gm.read_gpu_json()["enwik8"]
    assert cal["measured_ms"] == pytest.approx(
        run["batch"] * run["unroll"] / run["tokens_per_s"] * 1e3, abs=1e-3)
    assert math.isfinite(cal["predicted_ms"]) and cal["predicted_ms"] > 0
    assert cal["ratio"] == pytest.approx(cal["predicted_ms"] / cal["measured_ms"], abs=1e-3)
