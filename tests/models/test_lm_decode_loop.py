"""``CausalLM.generate`` through the C++ ``decode_loop`` against its Python loop.

On the CPU, an eval-mode SRU++ language model generates in chunks of
``tuning().decode_chunk`` tokens per C++ call: sampling, the embedding, the stack (the
kernels of ``stack_step``) and the output layer, with no Python between. The
Python loop (``_step_chunks``: ``sample``, then ``model.step``, whose stack runs
the same ``stack_step`` kernel) is its reference. Both run the same kernels and
the same ATen sampling ops, so they must agree exactly: the same tokens, the same
streamed tokens, the same random draws left in a seeded generator. The chunk is
cut to 3 tokens here, so that the state is handed from call to call many times
(the memory window sliding across the hand-overs too).
"""

import copy

import importlib

import pytest
import torch

import srupp.models.lm as lm_module
from srupp.nn.stack_step import output_args
from srupp.ops.layer_step import decode_loop
from srupp.ops import cpu_kernels
from srupp.ops.layer_step import use_step_backend
from srupp.ops.settings import tuning

# the module, not srupp.ops's function of the same name
layer_step_module = importlib.import_module("srupp.ops.layer_step")

from lm_helpers import tiny_srupp_lm

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cpu_kernels.is_available(),
                                 reason=f"the C++ extension is unavailable "
                                        f"({cpu_kernels.build_error()})")]

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])

CASES = {
    "plain": dict(),
    "heads": dict(num_heads=2),
    "tied": dict(tie_embeddings=True),
    "layer_norm_post": dict(layer_norm=True, normalize_after=True),
    "attention_every_2": dict(num_layers=3, attention_every_n_layers=2),
    "no_attention": dict(attention_last_n_layers=0),
    "window_slides": dict(mem_len=4),
    "no_memory": dict(mem_len=0),
}
PROMPTS = [[3, 1, 4, 1, 5], [9], [2, 6]]           # left-padded: the memory has a pad mask


def make(dtype=torch.float32, **kw):
    m = tiny_srupp_lm(**kw)
    with torch.no_grad():  # the biases start at 0: move everything off its init
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return m.to(dtype)


@pytest.fixture
def loop_calls(monkeypatch):
    """Chunks of 3 tokens, and how many chunks the C++ loop ran."""
    calls = []
    real = layer_step_module.decode_loop_kernel()

    def counted(*args):
        calls.append(args[layer_step_module.DECODE_LOOP_PARAMS.index("n")])  # the chunk's tokens
        return real(*args)

    monkeypatch.setattr(layer_step_module, "decode_loop_kernel", lambda: counted)
    with tuning().use(decode_chunk=3):
        yield calls


def python_loop(m, *args, **kw):
    """generate through the Python loop (sample, then model.step per token)."""
    with tuning().use(decode_chunk=0):
        return m.generate(*args, **kw)


def same(fused, python):
    """Whether both runs gave the same tokens, streams and generator states."""
    return fused[:2] == python[:2] and (fused[2] is None or torch.equal(fused[2], python[2]))


def both(m, prompts, n, seed=None, **kw):
    """(fused, python): the tokens, the streamed tokens and, with a seed, the generator's
    state afterwards, from the C++ loop and from the Python loop."""
    out = []
    for run in (m.generate, lambda *a, **k: python_loop(m, *a, **k)):
        streamed = []
        g = None if seed is None else torch.Generator().manual_seed(seed)
        tokens = run(prompts, n, generator=g, on_tokens=lambda t: streamed.append(t.tolist()),
                     **kw)
        out.append((tokens, streamed, None if g is None else g.get_state()))
    return out


@torch.no_grad()
@DTYPES
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_tokens_equal_the_python_loop(case, dtype, loop_calls):
    m = make(dtype, **CASES[case])
    fused, python = both(m, PROMPTS, 10, seed=3, top_k=6, top_p=0.9, temperature=0.8)
    assert loop_calls == [1, 2, 3, 3, 1]   # it ran: streaming, chunks start at 1 and double
    assert fused[0] == python[0] and all(len(t) == 10 for t in fused[0])
    assert fused[1] == python[1]           # streamed the same, one step at a time
    assert torch.equal(fused[2], python[2])  # and drew as many random numbers
    greedy_fused, greedy_python = both(m, PROMPTS, 7, temperature=0)
    assert greedy_fused[0] == greedy_python[0]


@torch.no_grad()
@pytest.mark.parametrize("kind", ["int8", "w8a8"])
def test_quantized_models_take_the_loop(kind, loop_calls):
    m = make(tie_embeddings=True).quantize(kind)
    fused, python = both(m, PROMPTS, 8, seed=5)
    assert loop_calls and same(fused, python)


@torch.no_grad()
def test_eos_ends_rows_and_the_loop_as_the_python_loop_does(loop_calls):
    m = make()
    free = python_loop(m, PROMPTS, 12, generator=torch.Generator().manual_seed(0))
    eos = free[1][4]                       # a token row 1 samples fifth: it ends there
    fused, python = both(m, PROMPTS, 12, seed=0, eos_id=eos)
    assert same(fused, python)
    assert fused[0][1][-1] == eos and len(fused[0][1]) <= 5
    # every row ends at once: the loop stops there (the Python loop steps no further)
    first = python_loop(m, [[1, 2]], 1, generator=torch.Generator().manual_seed(0))[0][0]
    fused, python = both(m, [[1, 2]], 12, seed=0, eos_id=first)
    assert same(fused, python) and fused[0] == [[first]]
    # ... and at the last token of a chunk (the 3rd): no step, no state handed on
    drawn = python_loop(m, [[1, 2]], 12, generator=torch.Generator().manual_seed(0))[0]
    ends = [i for i in (2, 5, 8) if drawn[i] not in drawn[:i]]  # chunk ends, first draws
    assert ends, f"no chunk ends on a new token in {drawn}: pick another seed"
    fused, python = both(m, [[1, 2]], 12, seed=0, eos_id=drawn[ends[0]])
    assert same(fused, python) and fused[0] == [drawn[:ends[0] + 1]]


@torch.no_grad()
def test_what_the_loop_cannot_take_runs_the_python_loop(loop_calls):
    m = make()
    # stop strings are checked on decoded text after every token
    got = m.generate([[1, 2]], 6, temperature=0, stop_strings=["x"],
                     decode=lambda ids: "".join("ab"[i % 2] for i in ids))
    assert got == python_loop(m, [[1, 2]], 6, temperature=0) and not loop_calls
    with use_step_backend("modules"):     # a forced module-by-module step
        m.generate([[1, 2]], 4, temperature=0)
    assert not loop_calls
    m.generate([[1, 2]], 0)
    assert not loop_calls
    # an output layer the loop does not know (here: a subclass with its own forward)
    odd = copy.deepcopy(m)

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = Scaled(8, 11)
    scaled.load_state_dict(m.output.state_dict())
    odd.output = scaled.eval()
    assert odd.generate([[1, 2]], 4, temperature=0) == python_loop(odd, [[1, 2]], 4,
                                                                   temperature=0)
    assert not loop_calls
    # training mode samples through forward (dropout and all)
    m.train()
    m.generate([[1, 2]], 4)
    assert not loop_calls


@torch.no_grad()
def test_generation_continues_the_prompt_as_recomputation_does(loop_calls):
    """Greedy tokens from the loop are the argmax of a full forward over prompt + output
    (the chain: loop == Python loop here, step == forward in test_lm.py)."""
    m = make()
    prompt = [1, 5, 2, 7]
    got = m.generate([prompt], 8, temperature=0)[0]
    assert loop_calls
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
    assert got == seq[len(prompt):]


@torch.no_grad()
@DTYPES
@pytest.mark.parametrize("case", ["plain", "attention_every_2", "window_slides", "no_memory"])
def test_the_kernel_leaves_the_python_loops_logits_and_state(case, dtype):
    """decode_loop itself, greedy for 5 steps after a left-padded prefill: the next logits
    and the state (c, memory, keys and values, pad mask) equal model.step's, bit for bit."""
    m = make(dtype, **CASES[case])
    prompts = torch.tensor([[3, 1, 4, 1, 5], [0, 0, 9, 2, 6]])
    pad = torch.tensor([[False] * 5, [True, True, False, False, False]])

    def prefill():
        out = m(prompts, m.generation_state(2), mask_pad=pad)
        return out.logits[:, -1], out.state

    logits, state = prefill()
    for _ in range(5):
        logits, state = m.step(logits.argmax(-1), state)
    start_logits, start = prefill()
    like = m.embedding.weight.new_empty(2, 8)
    plan = m.backbone.decode_plan(start, 5, like)
    tokens, c, got, memory, kvs, shift = decode_loop(
        start_logits, torch.zeros(2, dtype=torch.bool), m.embedding.weight,
        output_args(m.output, like), plan.stack_args(), mem_len=plan.mem_len, n=5,
        final=False, temperature=0.0, top_k=None, top_p=None, generator=None, eos_id=None)
    after = plan.state_after(c, memory, kvs, shift)
    assert tokens.shape == (2, 5) and torch.equal(got, logits)
    assert torch.equal(after.c, state.c)
    for mine, theirs in zip(after.memory, state.memory):
        assert (mine is None) == (theirs is None) and (mine is None or torch.equal(mine, theirs))
    for mine, theirs in zip(after.kv_cache, state.kv_cache):
        assert (mine is None) == (theirs is None) and (mine is None or torch.equal(mine.kv,
                                                                                 theirs.kv))
    assert (after.memory_mask_pad is None) == (state.memory_mask_pad is None)
    if after.memory_mask_pad is not None:
        assert torch.equal(after.memory_mask_pad, state.memory_mask_pad)
    assert any(t is not None for t in after.memory) == (case != "no_memory")


@torch.no_grad()
@DTYPES
@pytest.mark.parametrize("case", ["plain", "window_slides", "no_memory"])
def test_first_tokens_and_per_row_sampling_equal_steps_row_by_row(case, dtype):
    """What the engine runs: ``first`` tokens fed in the same call, then each row sampled by
    its own settings and generator. Against model.step and each row sampled alone: the
    same tokens, the same generator states, and a state that decodes on to the same bits
    (whose buffers the next call appends to in place: the rows reserved and not fed are
    given back)."""
    m = make(dtype, **CASES[case])
    B, n = 4, 5
    settings = [dict(temperature=0.0, top_k=None, top_p=None),
                dict(temperature=0.8, top_k=6, top_p=0.9),
                dict(temperature=1.2, top_k=None, top_p=None),
                dict(temperature=0.0, top_k=3, top_p=None)]
    window = m.config.mem_len or 8
    state = m.backbone.padded_state(B, window)
    _, state = m.prefill(torch.tensor([[3, 1, 4], [1, 5, 9], [2, 6, 5], [3, 5, 8]]), state)
    first = torch.tensor([7, 0, 2, 9])

    def gens():
        return [torch.Generator().manual_seed(40 + i) for i in range(B)]

    # reference: one model.step per token, each row drawn alone (as Engine._sample does)
    g_ref, st, fed, want = gens(), state, first, []
    for t in range(n):
        logits, st = m.step(fed, st)                                      # (B, V)
        fed = torch.cat([lm_module.sample(logits[i:i + 1], generator=g_ref[i], **settings[i])
                         for i in range(B)])
        want.append(fed)
    want = torch.stack(want, 1)                                           # (B, n)
    next_ref, _ = m.step(fed, st)

    g = gens()
    emb = m.embedding
    steps, output = m.fused_decoder(state, n, emb.weight.new_empty(B, emb.embedding_dim))
    tokens, _, after = steps.decode(
        first.new_empty(0, 0), torch.zeros(B, dtype=torch.bool), emb.weight, output, final=True,
        temperature=[p["temperature"] for p in settings], top_k=[p["top_k"] for p in settings],
        top_p=[p["top_p"] for p in settings], generator=g, eos_id=None, first=first)
    assert torch.equal(tokens, want)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(g, g_ref))
    buffers = [None if mem is None else mem.untyped_storage().data_ptr()
               for mem in after.memory]
    next_fused, later = m.step(tokens[:, -1], after)
    assert torch.equal(next_fused.contiguous().view(torch.uint8),
                       next_ref.contiguous().view(torch.uint8))
    if case == "plain":  # room was left: the step appended in place, no copy
        assert [None if mem is None else mem.untyped_storage().data_ptr()
                for mem in later.memory] == buffers


@torch.no_grad()
def test_first_tokens_need_final():
    m = make()
    state = m.backbone.padded_state(1, 8)
    _, state = m.prefill(torch.tensor([[3, 1]]), state)
    emb = m.embedding
    steps, output = m.fused_decoder(state, 3, emb.weight.new_empty(1, emb.embedding_dim))
    with pytest.raises(ValueError, match="first: feeding tokens before the loop needs final"):
        steps.decode(torch.empty(0, 0), torch.zeros(1, dtype=torch.bool), emb.weight, output,
                     final=False, temperature=0, top_k=None, top_p=None, generator=None,
                     eos_id=None, first=torch.tensor([1]))


@torch.no_grad()
def test_a_final_chunk_gives_back_the_row_it_did_not_feed():
    """A ``final`` call reserves n rows and feeds n - 1: the next step appends after them
    in the same buffers (before, every chunk copied the whole memory to fresh ones)."""
    m = make()
    state = m.backbone.padded_state(2, 64)
    logits, state = m.prefill(torch.tensor([[3, 1, 4], [1, 5, 9]]), state)   # (B, V)
    emb = m.embedding
    steps, output = m.fused_decoder(state, 4, emb.weight.new_empty(2, emb.embedding_dim))
    tokens, _, after = steps.decode(logits, torch.zeros(2, dtype=torch.bool), emb.weight, output,
                                    final=True, temperature=0, top_k=None, top_p=None,
                                    generator=None, eos_id=None)
    storage = [mem.untyped_storage().data_ptr() for mem in after.memory if mem is not None]
    _, later = m.step(tokens[:, -1], after)
    assert [mem.untyped_storage().data_ptr() for mem in later.memory if mem is not None] == storage


@torch.no_grad()
@DTYPES
def test_greedy_picks_what_torch_argmax_picks(dtype):
    """The loop's greedy pick (a plain loop over each row, not ATen's reduction) is
    torch.argmax's: the first index of a row's maximum (ties included), the first NaN of a
    row that has one, and logits given at any row stride. One sample, from logits given."""
    m = make(dtype)
    rows = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 0.0],         # ties: the first
                         [-3.0, -1.0, -2.0, -1.0, -5.0, -4.0],    # all negative, a tie
                         [1.0, float("nan"), 3.0, float("nan"), 0.0, 9.0],  # the first NaN
                         [float("nan")] * 6,
                         [float("-inf")] * 6,
                         [7.0, 1.0, 1.0, 1.0, 1.0, 7.0]])
    V = m.config.vocab_size
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(rows) + 20, 2 * V, generator=g)
    logits[:len(rows), :6] = rows
    logits[:len(rows), 6:] = -10.0
    logits[4] = float("-inf")                                           # a row of -inf only
    logits = logits.to(dtype)[:, :V]                                  # rows 2V apart
    B = logits.shape[0]
    like = m.embedding.weight.new_empty(B, 8)
    plan = m.backbone.decode_plan(m.generation_state(B), 1, like)
    tokens, *_ = decode_loop(
        logits, torch.zeros(B, dtype=torch.bool), m.embedding.weight, output_args(m.output, like),
        plan.stack_args(), mem_len=plan.mem_len, n=1, final=True, temperature=0.0, top_k=None,
        top_p=None, generator=None, eos_id=None)
    assert torch.equal(tokens[:, 0], logits.argmax(-1))
    assert tokens[:6, 0].tolist() == [1, 1, 1, 0, 0, 0]


def row_groups(B, temperature=(0.0,), generator=(None,), *, few_rows=64, quant="pairs",
               route="rows", eos_id=-1):
    """The (first row, rows) groups decode_loop runs a batch of B rows in (4 layers)."""
    from srupp.ops.layer_step import OUTPUT_ROUTES, QUANT
    return cpu_kernels.function("decode_row_groups")(
        B, few_rows, [QUANT[quant]] * 4, OUTPUT_ROUTES[route], eos_id, list(temperature),
        list(generator))


def test_row_groups_only_where_no_row_can_depend_on_another():
    """tuning().decode_row_group rows at a time (a remainder under half a group joins the
    last); all rows at once wherever grouping could change a row's tokens."""
    read = cpu_kernels.function("decode_row_group")   # the C++ global the setting sets
    with tuning().use(decode_row_group=16):
        assert read() == 16 and row_groups(32) == [(0, 16), (16, 16)]
        assert row_groups(40) == [(0, 16), (16, 16), (32, 8)]
        assert row_groups(33) == [(0, 16), (16, 17)]          # one row alone: it joins
        assert row_groups(23) == [(0, 23)]                    # under a group and a half
        g = [torch.Generator() for _ in range(32)]
        per_row = [0.0, 0.7] * 16
        assert row_groups(32, per_row, g) == [(0, 16), (16, 16)]      # each its own generator
        assert row_groups(32, per_row, [g[0]] * 32) == [(0, 32)]      # one shared: draw order
        assert row_groups(32, per_row, [None] * 32) == [(0, 32)]      # the global generator
        assert row_groups(32, [0.0] * 32, [None] * 32) == [(0, 16), (16, 16)]  # all greedy
        assert row_groups(32, (0.7,), (g[0],)) == [(0, 32)]   # the batch drawn in one call
        assert row_groups(32, few_rows=16) == [(0, 32)]       # BLAS's blocking depends on B
        assert row_groups(32, route="aten") == [(0, 32)]      # so does ATen's output GEMM
        assert row_groups(32, quant="int8") == [(0, 32)]      # and int8 rows' bits
        assert row_groups(32, route="int8") == [(0, 32)]
        assert row_groups(32, quant="w8a8", route="w8a8") == [(0, 16), (16, 16)]  # rows alone
        assert row_groups(32, quant="float") == [(0, 16), (16, 16)]
        assert row_groups(32, eos_id=3) == [(0, 32)]          # rows may stop apart
    with tuning().use(decode_row_group=0):
        assert read() == 0 and row_groups(128) == [(0, 128)]
    with tuning().use(decode_row_group=2):
        assert row_groups(7) == [(0, 2), (2, 2), (4, 2), (6, 1)]
    with tuning().use(decode_row_group=3):
        assert row_groups(7) == [(0, 3), (3, 4)]
    with pytest.raises(RuntimeError, match="one each, or one per row"):
        row_groups(32, [0.0] * 32, [None] * 31)


@torch.no_grad()
@DTYPES
@pytest.mark.parametrize("case", ["plain", "attention_every_2", "window_slides", "no_memory"])
@pytest.mark.parametrize("group", [2, 3])
def test_row_groups_give_what_all_rows_at_once_give(case, dtype, group):
    """decode_loop with the batch in row groups (each running every token of the call in
    turn) against all rows at once: the same tokens, logits, state (c, memory, keys and
    values) and generator states, bit for bit; greedy from given logits after a
    left-padded prefill, and per-row sampling after ``first`` tokens."""
    from srupp.ops.matmul import batch_invariant

    m = make(dtype, **CASES[case])
    B, n = 7, 5
    prompts = torch.tensor([[3, 1, 4, 1, 5], [0, 0, 9, 2, 6], [2, 7, 1, 8, 2], [0, 5, 3, 5, 8],
                            [9, 7, 9, 3, 2], [0, 0, 0, 3, 8], [4, 6, 2, 6, 4]])
    pad = prompts == 0
    settings = [dict(temperature=0.8 * (i % 3 != 0), top_k=[None, 6][i % 2],
                     top_p=[None, 0.9][i % 2 == 0]) for i in range(B)]

    def run(rows_at_once: int, per_row: bool):
        with tuning().use(decode_row_group=rows_at_once), batch_invariant(B):
            out = m(prompts, m.generation_state(B), mask_pad=pad)
            state = out.state
            like = m.embedding.weight.new_empty(B, 8)
            plan = m.backbone.decode_plan(state, n, like)
            g = [torch.Generator().manual_seed(10 + i) for i in range(B)]
            sampling = dict(temperature=0.0, top_k=None, top_p=None, generator=None)
            first = None
            if per_row:
                sampling = {k: [s[k] for s in settings] for k in ("temperature", "top_k", "top_p")}
                sampling["generator"] = g
                first = torch.arange(B) % 5
            got = decode_loop(out.logits[:, -1], torch.zeros(B, dtype=torch.bool),
                              m.embedding.weight, output_args(m.output, like),
                              plan.stack_args(), mem_len=plan.mem_len, n=n, final=per_row,
                              eos_id=None, first=first, **sampling)
            return got, [x.get_state() for x in g]

    for per_row in (False, True):
        (tokens, c, logits, memory, kvs, shift), gens = run(group, per_row)
        (tokens0, c0, logits0, memory0, kvs0, shift0), gens0 = run(0, per_row)
        assert torch.equal(tokens, tokens0) and tokens.shape == (B, n) and shift == shift0
        assert torch.equal(c, c0) and torch.equal(logits, logits0)
        for a, b in zip(memory + kvs, memory0 + kvs0):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        assert all(torch.equal(a, b) for a, b in zip(gens, gens0))
    with tuning().use(decode_row_group=group):   # both runs above did split the batch
        assert len(row_groups(B, few_rows=B)) > 1
        temperatures = [s["temperature"] for s in settings]
        own = [torch.Generator() for _ in range(B)]
        assert len(row_groups(B, temperatures, own, few_rows=B)) > 1
