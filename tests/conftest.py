"""Shared test settings, and the device the agreement tests run on.

``pytest`` runs everything on the CPU. ``pytest --device cuda`` runs, on the
GPU, only the tests that take the ``device`` fixture and are not marked
``cpu_only``: the agreement tests that mean something on a GPU (ops, layers,
state and decoding, models, Hugging Face, ONNX export's torch side, a trainer
smoke run). The rest (tokenisers, configs, the CLI's parsing, the C++ kernel)
do not depend on the device, or exist only on the CPU, and are deselected.
Collecting with ``--device cuda`` works on a machine without CUDA: each test
is then skipped, saying why.
"""

import os

import pytest

DEVICES = ("cpu", "cuda")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=DEVICES,
                     help="where the agreement tests run (default: cpu). With cuda, only "
                          "the tests that take the `device` fixture are collected.")


def pytest_configure(config):
    # Test modules are imported after this hook, so the settings below reach
    # them before anything imports triton (which reads TRITON_INTERPRET at first
    # import; set later, it reports "0 active drivers" on CPU-only machines).
    device = config.getoption("device")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        raise pytest.UsageError("--device cuda runs the Triton kernels on the GPU, but "
                                "TRITON_INTERPRET=1 would run them in the interpreter; "
                                "unset TRITON_INTERPRET")
    # The srupp CLI tunes glibc's malloc for its process (srupp.allocator); tests call
    # the CLI in this process and in children, and shouldn't change the runner's malloc
    # or depend on it. tests/test_allocator.py tests the setting in child processes.
    os.environ.setdefault("SRUPP_TUNE_ALLOCATOR", "0")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # `make test` runs one worker per core (pytest -n auto): each worker's torch
        # on one thread, so that workers do not oversubscribe the cores
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    config.addinivalue_line("markers", "cpu_only: meaningful on the CPU only (the C++ "
                            "kernel, CPU features); not collected with --device cuda")
    # pytest-xdist's load scheduling first hands each worker a quarter of its share of
    # the tests, consecutive ones: SLOW_FIRST's would all go to the first worker. Two at
    # a time instead, as the workers free up (a --maxschedchunk given wins).
    if getattr(config.option, "maxschedchunk", False) is None:
        config.option.maxschedchunk = 2


# The slowest tests (``pytest --durations``), slowest first, and started first: under
# ``pytest -n auto`` (``make test``) a long test that starts last keeps one core busy while
# the other has finished. Handed out two at a time as the workers free up (--maxschedchunk,
# pytest_configure), these are shared out between the workers, and the run ends on short
# tests.
# (Seconds under make test on 2 cores; a test that shares a module fixture with tests
# left in place stays out: moving it away would set the fixture up twice.)
SLOW_FIRST = (
    "test_compiles_for_sm80_and_sm90_without_spills",  # 43: test_triton_compile's compiling
    "test_gpu_check_dry_run",                          # 33
    "test_sigkill_of_the_launcher",                    # 22, 18
    "test_benchmarks.py::test_serve_load",             # 16
    "test_accumulation_syncing_once",                  # 13
    "test_crossover",                                  # 12
    "test_training_scale",                             # 11
    "test_signals_at_random_moments_resume",           # 11
    "test_device_cuda_collects_the_agreement_tests",   # 9
    "test_benchmarks.py::test_triton_compile",         # 9
    "test_benchmarks.py::test_kernel_ab",              # 3 (20 when its build is not cached)
    "test_a_killed_srupp_train_leaves_no_stale_lock",  # 8
    "test_gpu_check_pytest_cut_short",                 # 8 (mostly waiting)
    "test_quantized_graphs_run_in_onnxruntime",        # 7
    "test_two_launchers_meet_at_a_rendezvous",         # 7
    "test_rank_0_refuses_a_run_another_process",       # 7
    "test_two_ranks_equal_one_process_and_agree",      # 7, 7
    "test_classification_on_two_ranks",                # 6
    "test_benchmarks.py::test_gpu_model",              # 6
    "test_onnxruntime_matches_pytorch_over_many",      # 6, 3
    "test_benchmarks.py::test_allocator",              # 6
    "test_batch_size_must_divide_by_world_size",       # 5
    "test_example_generates_the_greedy_text",          # 5, 5
    "test_benchmarks.py::test_decode",                 # 5
    "test_compare_translation",                        # 5
    "test_compare_writes_results_and_skips",           # 5
    "test_sigkill_loses_only_steps_since_checkpoint",  # 5
    "test_compare_classification_and_skipping",       # 5
    "test_cli_export_needs_a_window",                  # 4
    "test_schedule_is_refitted_when_calibration",      # 4
    "test_schedule_follows_a_speed_change",            # 4
    "test_benchmarks.py::test_step_profile",           # 4, 3
    "test_main_prints_the_prediction_and_its",         # 4
    "test_a_dead_rank_ends_the_job",                   # 4
    "test_benchmarks.py::test_generation",             # 4
    "test_a_state_saved_mid_decoding_resumes",         # 4, 4, 3
    "test_a_given_call_cost_is_used_without",          # 4
    "test_import_srupp_stays_light",                   # 3, 3
    "test_benchmarks.py::test_equal_params",           # 3
    "test_benchmarks.py::test_int8_kernels",           # 3
    "test_sigkill_during_writes_leaves_only_whole",    # 3
    "test_time_budget_fixes_the_schedule_length",      # 3
    "test_sigkill_at_a_random_moment_then_resume",     # 3, 3
)


def _slow_rank(item) -> int:
    """The place of the item's test in SLOW_FIRST; the others after them all."""
    return next((i for i, name in enumerate(SLOW_FIRST) if name in item.nodeid),
                len(SLOW_FIRST))


def pytest_collection_modifyitems(config, items):
    if config.getoption("device") == "cpu":
        items.sort(key=_slow_rank)  # (stable: the rest keep their order)
        return
    keep, drop = [], []
    for item in items:
        on_device = ("device" in getattr(item, "fixturenames", ())
                     and item.get_closest_marker("cpu_only") is None)
        (keep if on_device else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.fixture
def device(request):
    """The ``torch.device`` of ``--device``; skips, saying why, when it is absent."""
    import torch

    name = request.config.getoption("device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda, but torch.cuda.is_available() is False on this machine")
    return torch.device(name)


@pytest.fixture
def corpus(tmp_path):
    """A small text file: the tiny corpus of lm_helpers, repeated."""
    from lm_helpers import TEXT

    p = tmp_path / "corpus.txt"
    p.write_text(TEXT * 40)
    return p


# --------------------------------------------------------------------------- fp32 on CUDA
# fp32 means IEEE fp32 on CUDA. The agreement tests compare two fp32 computations
# of the same values (step against forward, a padded batch against each row alone)
# within 1e-5 or less. On CUDA, cuDNN's RNNs (the LSTM and GRU backbones) take TF32
# by default, which reads 10 bits of each fp32 mantissa: two paths would then differ
# by ~1e-3. For each test run with ``--device cuda``, cuDNN and cuBLAS compute fp32
# in IEEE fp32, and the previous settings are put back afterwards. The fixture does
# not take ``device``, so it adds no test to what ``--device cuda`` collects.


def _fp32_flags():
    """[(object, attribute, IEEE value)] of the settings that let fp32 work run in TF32.

    The legacy flags, which every torch reads (from 2.9 on, setting them sets the
    per-operator ``fp32_precision`` settings too). torch refuses to read them once they
    and the per-operator settings disagree (someone set the latter alone): then those.
    """
    import torch  # here, not at the top: see pytest_configure

    backends = torch.backends
    try:
        backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32
    except RuntimeError:
        return [(backends.cuda.matmul, "fp32_precision", "ieee"),
                (backends.cudnn.conv, "fp32_precision", "ieee"),
                (backends.cudnn.rnn, "fp32_precision", "ieee")]
    return [(backends.cudnn, "allow_tf32", False), (backends.cuda.matmul, "allow_tf32", False)]


@pytest.fixture(autouse=True)
def ieee_fp32_on_cuda(request):
    if request.config.getoption("device") != "cuda":
        yield
        return
    import torch

    if not torch.cuda.is_available():
        yield
        return
    changed = []  # (object, attribute, value before)
    for obj, name, value in _fp32_flags():
        before = getattr(obj, name)
        if before != value:
            setattr(obj, name, value)
            changed.append((obj, name, before))
    try:
        yield
    finally:
        for obj, name, before in reversed(changed):
            setattr(obj, name, before)


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
    """``once_per_run(name, compute)``: ``compute()``'s result (JSON), computed once per
    test run, by the first worker that asks; under ``pytest -n`` the other workers wait
    for it and read it from a file beside their temporary folders. For an expensive
    result that several tests read, wherever xdist runs them and whatever the order (a
    module fixture runs once per worker that needs it, and again when SLOW_FIRST moved
    one of its tests away from the others)."""
    import json

    from filelock import FileLock  # (a dependency of torch)

    results = {}
    shared = tmp_path_factory.getbasetemp().parent  # the run's workers share it

    def get(name, compute):
        if name not in results:
            if not os.environ.get("PYTEST_XDIST_WORKER"):
                results[name] = compute()
            else:
                path = shared / f"{name}.json"
                with FileLock(f"{path}.lock"):
                    if not path.is_file():
                        path.write_text(json.dumps(compute()))
                    results[name] = json.loads(path.read_text())
        return results[name]

    return get


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny shapes: a second thread only adds waits,
    and on a busy machine its spinning made such files several times slower. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``; the count is put back after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
