"""The SRU++ language model: loss, carried state, generation, saving."""

import pytest
import torch
import torch.nn.functional as F

from srupp.errors import UserError
from srupp.models import CausalLM, SRUppConfig, config_from_dict, sample

from lm_helpers import greedy_by_recomputing, tiny_srupp_lm
from models_on_device import across_shapes, generators

TOL = dict(rtol=1e-5, atol=1e-6)


make = tiny_srupp_lm  # the tiny model of every test here


def test_loss_is_cross_entropy_and_counts_every_parameter(device):
    m = make(device)
    t = torch.randint(0, 11, (3, 6)).to(device)
    y = torch.randint(0, 11, (3, 6)).to(device)
    y[0, 0] = -100
    out = m(t, targets=y)
    assert out.logits.shape == (3, 6, 11)
    expected = F.cross_entropy(out.logits.reshape(-1, 11), y.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    assert m.num_parameters() == sum(p.numel() for p in m.parameters())
    tied = make(device, tie_embeddings=True)
    assert tied.output.weight is tied.embedding.weight
    assert tied.num_parameters() == m.num_parameters() - 11 * 8


def test_segments_with_state_match_one_pass(device):
    m = make(device)
    t = torch.randint(0, 11, (2, 12)).to(device)
    full = m(t).logits
    a = m(t[:, :5])
    b = m(t[:, 5:], a.state.detach())
    torch.testing.assert_close(torch.cat([a.logits, b.logits], 1), full,
                               **across_shapes(device, **TOL))


def test_greedy_generation_matches_recomputation(device):
    m = make(device)
    prompt = [1, 5, 2, 7]
    got = m.generate([prompt], 8, temperature=0)[0]
    assert got == greedy_by_recomputing(m, prompt, 8)


def test_batched_left_padded_generation_matches_single(device):
    m = make(device)
    prompts = [[3, 1, 4, 1, 5], [9], [2, 6]]
    batched = m.generate(prompts, 6, temperature=0)
    for p, got in zip(prompts, batched):
        assert got == m.generate([p], 6, temperature=0)[0]


@pytest.mark.parametrize("adaptive", [False, True], ids=["plain", "adaptive"])
def test_prefill_reads_a_chunk_as_forward_does(adaptive, device):
    """prefill = forward without the logits of all but the last position (adaptive:
    log-probabilities, as forward gives); decoding goes on from its state the same."""
    extra = dict(vocab_size=20, adaptive_cutoffs=[6, 12], div_val=2) if adaptive else {}
    m = make(device, **extra)
    V = m.config.vocab_size
    t = torch.randint(0, V, (2, 6)).to(device)
    head = t[:, :5].contiguous()
    with torch.no_grad():
        out = m(head, m.initial_state(2, mem_len=4))
        last, state = m.prefill(head, m.initial_state(2, mem_len=4))
        assert last.shape == (2, V)
        torch.testing.assert_close(last, out.logits[:, -1], **TOL)
        torch.testing.assert_close(state.c, out.state.c, **TOL)
        assert state.memory_length == out.state.memory_length == 4
        after, _ = m.step(t[:, 5].contiguous(), state)
        torch.testing.assert_close(after, m(t[:, 5:].contiguous(), out.state).logits[:, -1],
                                   **TOL)
    for bad in (t[0], t[:, :0]):
        with pytest.raises(ValueError, match="prefill takes tokens"):
            m.prefill(bad, None)


def test_seeded_sampling_repeats(device):
    m = make(device)
    # a CPU generator samples a model on any device; on a GPU, so does one of the GPU's
    for g3, g3_again, g4 in zip(generators(device, 3), generators(device, 3),
                                generators(device, 4)):
        a = m.generate([[1, 2]], 10, generator=g3, top_k=5, top_p=0.9)
        b = m.generate([[1, 2]], 10, generator=g3_again, top_k=5, top_p=0.9)
        c = m.generate([[1, 2]], 10, generator=g4, top_k=5, top_p=0.9)
        assert a == b and a != c


def test_eos_and_stop_strings(device):
    m = make(device)
    free = m.generate([[1, 2]], 8, temperature=0)[0]
    eos = free[2]
    first = free.index(eos)
    assert m.generate([[1, 2]], 8, temperature=0, eos_id=eos)[0] == free[:first + 1]
    decode = lambda ids: "".join(chr(97 + i) for i in ids)  # noqa: E731
    stop = decode(free[3:5])
    cut = m.generate([[1, 2]], 8, temperature=0, stop_strings=[stop], decode=decode)[0]
    text = decode(free)
    assert decode(cut) == text[:text.index(stop)]


def test_sampling_filters(device):
    logits = torch.tensor([[0.1, 3.0, 0.5, 2.9]], device=device)
    for g in generators(device, 0):
        assert sample(logits, top_k=1, generator=g).item() == 1
        assert sample(logits, top_p=1e-3, generator=g).item() == 1
        drawn = [sample(logits, top_k=2, generator=g) for _ in range(50)]
        assert all(d.device == logits.device for d in drawn)
        assert {d.item() for d in drawn} == {1, 3}
    assert sample(logits, temperature=0).item() == 1


def test_save_and_load(tmp_path, device):
    m = make(device, tie_embeddings=True)
    m.save_pretrained(tmp_path / "m")
    back = CausalLM.from_pretrained(tmp_path / "m", device=device)
    assert not back.training and back.config == m.config
    assert back.output.weight is back.embedding.weight
    assert back.device == m.device
    t = torch.randint(0, 11, (2, 5)).to(device)
    torch.testing.assert_close(back(t).logits, m(t).logits, rtol=0, atol=0)


def test_corrupt_or_missing_checkpoint_is_a_user_error(tmp_path):
    m = make()
    m.save_pretrained(tmp_path)
    blob = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(UserError, match="truncated or corrupt"):
        CausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt"):
        CausalLM.from_pretrained(tmp_path)
    with pytest.raises(UserError, match="no config.json"):
        CausalLM.from_pretrained(tmp_path / "nowhere")


def test_bad_arguments_are_plain_errors_in_the_python_api_s_names():
    for bad, match in [(lambda: SRUppConfig(proj_size=6, num_heads=4),
                        r"^num_heads \(4\) must divide proj_size \(6\)$"),
                       (lambda: SRUppConfig(num_layers=2, attention_last_n_layers=3),
                        r"^attention_last_n_layers must be -1 \(off\) or 0..num_layers "
                        r"\(2\), got 3$"),
                       (lambda: config_from_dict({"d_modle": 3}), "unknown config key 'd_modle'"),
                       (lambda: make().generate([[]], 3), "every prompt needs a token")]:
        with pytest.raises(ValueError, match=match) as e:
            bad()
        assert type(e.value) is ValueError and "model." not in str(e.value)
