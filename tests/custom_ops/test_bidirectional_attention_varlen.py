"""``bidirectional_attention`` over packed sequences (``seq_start``: an embedding model's texts in one row, no
padding): the reference against each sequence attended alone (empty and one-token sequences, GQA, float32 and
bfloat16), the ``sdpa`` backend against the reference, the refusals of a malformed ``seq_start`` and of a bias
beside it, each backend's ``supports``, the fake through opcheck and torch.export with a dynamic token count, and on
a GPU the ``varlen`` and ``sdpa`` backends against the reference (``varlen`` under CUDA graph capture too). The same
with a bidirectional sliding ``window`` (ModernBERT's local layers), packed and not."""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.export import Dim

from autodeploy.autotuner import relative_error, tolerance
from autodeploy.custom_ops import bidirectional_attention as module
from autodeploy.custom_ops import canonical_ops
from autodeploy.custom_ops.bidirectional_attention import bidirectional_attention_reference, bidirectional_attention_sdpa

op = torch.ops.autodeploy.bidirectional_attention
HEADS = pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
# One-token sequences, empty ones (repeated starts) first, in the middle and last, and longer ones.
LENGTHS = [0, 3, 1, 0, 5, 1, 2, 0]


def packed(lengths: list[int], q_heads: int, kv_heads: int, dtype=torch.float32, device="cpu", seed=0, head_dim=8,
           value_dim=8) -> tuple:
    """``(q, k, v, scale, seq_start)``: ``len(lengths)`` sequences packed into one row of ``sum(lengths)`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q = torch.randn(1, tokens, q_heads, head_dim, generator=generator)
    k = torch.randn(1, tokens, kv_heads, head_dim, generator=generator)
    v = torch.randn(1, tokens, kv_heads, value_dim, generator=generator)
    seq_start = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return (*(t.to(device, dtype) for t in (q, k, v)), 1 / math.sqrt(head_dim), seq_start.to(device))


def each_alone(q, k, v, scale, seq_start) -> torch.Tensor:
    """Each sequence through the reference without ``seq_start``, the outputs concatenated along the row."""
    starts = seq_start.tolist()
    return torch.cat([bidirectional_attention_reference(q[:, a:b], k[:, a:b], v[:, a:b], scale)
                      for a, b in zip(starts, starts[1:])], dim=1)


def naive(q, k, v, scale, seq_start, window=None) -> torch.Tensor:
    """Float64 softmax attention of each sequence over its own keys (those at most ``window`` from the query, with a
    window), outside the code under test."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2).double(), v.repeat_interleave(group, dim=2).double()
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    starts = seq_start.tolist()
    for a, b in zip(starts, starts[1:]):
        logits = torch.einsum("ihd,jhd->hij", q[0, a:b].double(), k[0, a:b]) * scale
        if window is not None:
            for i in range(b - a):
                for j in range(b - a):
                    if abs(i - j) > window:
                        logits[:, i, j] = -math.inf
        out[0, a:b] = torch.einsum("hij,jhd->ihd", logits.softmax(-1), v[0, a:b])
    return out


@HEADS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_packed_reference_is_each_sequence_attended_alone(q_heads, kv_heads, dtype):
    args = packed(LENGTHS, q_heads, kv_heads, dtype)
    out = bidirectional_attention_reference(*args[:4], seq_start=args[4])
    assert out.shape == (1, sum(LENGTHS), q_heads, 8) and out.dtype == dtype
    assert torch.equal(out, each_alone(*args))
    within = 1e-5 if dtype == torch.float32 else 2**-8  # bfloat16: the float32 result rounded once
    torch.testing.assert_close(out.double(), naive(*args), atol=within, rtol=within)
    # Through the op, and with int64 starts: the same.
    assert torch.equal(op(*args[:4], None, args[4].long()), out)


def test_a_sequence_sees_none_of_its_neighbours_keys():
    q, k, v, scale, seq_start = packed([3, 4, 2], 4, 2)
    out = bidirectional_attention_reference(q, k, v, scale, seq_start=seq_start)
    k2, v2 = k.clone(), v.clone()
    k2[:, 3:7] += 1  # the middle sequence's keys and values
    v2[:, 3:7] -= 1
    changed = bidirectional_attention_reference(q, k2, v2, scale, seq_start=seq_start)
    assert torch.equal(changed[:, :3], out[:, :3]) and torch.equal(changed[:, 7:], out[:, 7:])
    assert not torch.allclose(changed[:, 3:7], out[:, 3:7])


@HEADS
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_the_sdpa_backend_matches_the_reference(q_heads, kv_heads, dtype, atol):
    args = packed(LENGTHS, q_heads, kv_heads, dtype, value_dim=5)
    expected = bidirectional_attention_reference(*args[:4], seq_start=args[4])
    got = torch.ops.autodeploy.bidirectional_attention_sdpa(*args[:4], None, args[4])
    assert got.shape == expected.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)
    torch.testing.assert_close(bidirectional_attention_sdpa(*args[:4], seq_start=args[4].long()), expected, atol=atol, rtol=atol)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), heads=st.sampled_from([(4, 4), (4, 2), (3, 1)]),
       lengths=st.lists(st.integers(0, 6), min_size=1, max_size=6).filter(lambda lengths: sum(lengths) > 0),
       window=st.none() | st.integers(0, 7))
def test_any_packing_gives_the_sdpa_backend_and_the_reference_each_sequences_own_attention(seed, heads, lengths, window):
    args = packed(lengths, *heads, seed=seed)
    expected = naive(*args, window)
    torch.testing.assert_close(bidirectional_attention_reference(*args[:4], seq_start=args[4], window=window).double(),
                               expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bidirectional_attention_sdpa(*args[:4], seq_start=args[4], window=window).double(),
                               expected, atol=1e-5, rtol=1e-5)


WINDOWS = pytest.mark.parametrize("window", [0, 1, 3])


@HEADS
@WINDOWS
def test_a_window_shows_each_query_the_keys_within_it_of_its_own_sequence(q_heads, kv_heads, window):
    """Query ``i`` sees key ``j`` iff ``|i - j| ≤ window``: counted within the sequence when packed (the row's distance
    is the sequence's), over the whole row when not."""
    lengths = [9, 0, 1, 6, 12]
    args = packed(lengths, q_heads, kv_heads)
    out = op(*args[:4], None, args[4], window)
    torch.testing.assert_close(out.double(), naive(*args, window), atol=1e-5, rtol=1e-5)
    starts = args[4].tolist()
    alone = torch.cat([op(args[0][:, a:b], args[1][:, a:b], args[2][:, a:b], args[3], window=window)
                       for a, b in zip(starts, starts[1:])], dim=1)
    assert torch.equal(out, alone)
    whole = torch.tensor([0, sum(lengths)], dtype=torch.int32)  # unpacked: the row is one sequence
    torch.testing.assert_close(op(*args[:4], window=window).double(), naive(*args[:4], whole, window), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, op(*args[:4], None, args[4]))  # the window hides keys the sequence would show


@HEADS
@WINDOWS
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_the_sdpa_backend_matches_the_reference_with_a_window(q_heads, kv_heads, window, dtype, atol):
    args = packed(LENGTHS + [11], q_heads, kv_heads, dtype, value_dim=5)
    sdpa = torch.ops.autodeploy.bidirectional_attention_sdpa
    torch.testing.assert_close(sdpa(*args[:4], None, args[4], window), op(*args[:4], None, args[4], window),
                               atol=atol, rtol=atol)
    torch.testing.assert_close(sdpa(*args[:4], window=window), op(*args[:4], window=window), atol=atol, rtol=atol)
    q, k, v, scale = (a[:, :6] if isinstance(a, torch.Tensor) else a for a in args[:4])
    bias = torch.randn(1, q_heads, 6, 6, generator=torch.Generator().manual_seed(3)).to(dtype)  # a bias and a window
    torch.testing.assert_close(sdpa(q, k, v, scale, bias, None, window), op(q, k, v, scale, bias, None, window),
                               atol=atol, rtol=atol)


def test_a_window_below_0_or_over_other_keys_is_refused():
    q, k, v, scale, seq_start = packed([3, 4], 4, 2)
    with pytest.raises(ValueError, match=r"a window is a distance ≥ 0 .* got window=-1 with S=7, Sk=7"):
        op(q, k, v, scale, None, seq_start, -1)
    with pytest.raises(ValueError, match=r"keys Sk = queries S\); got window=2 with S=7, Sk=5"):
        op(q, k[:, :5], v[:, :5], scale, window=2)


def test_module_docstring_examples():
    results = doctest.testmod(module)
    assert results.attempted > 0 and results.failed == 0


def _malformed():
    q, k, v, scale, seq_start = packed([3, 4], 4, 2)
    two = (torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]))

    def starts(*values):
        return torch.tensor(values, dtype=torch.int32)

    return [
        ("batch of two", (*two, scale, None, seq_start), r"batch of one; q has B=2"),
        ("fewer keys", (q, k[:, :5], v[:, :5], scale, None, starts(0, 2, 5)), r"keys Sk=5 must be the queries S=7"),
        ("float starts", (q, k, v, scale, None, seq_start.float()), r"must be int32 \(or int64\); got torch.float32"),
        ("no sequence", (q, k, v, scale, None, starts(7)), r"\[N \+ 1\] for N ≥ 1 sequences; got shape \(1,\)"),
        ("2-d", (q, k, v, scale, None, seq_start[None]), r"\[N \+ 1\] for N ≥ 1 sequences; got shape \(1, 3\)"),
        ("not from 0", (q, k, v, scale, None, starts(1, 3, 7)), r"start at 0; got seq_start\[0\] = 1"),
        ("short of S", (q, k, v, scale, None, starts(0, 3, 6)), r"end at the packed length S=7; got seq_start\[-1\] = 6"),
        ("past S", (q, k, v, scale, None, starts(0, 3, 8)), r"S=7; got seq_start\[-1\] = 8"),
        ("decreasing", (q, k, v, scale, None, starts(0, 5, 3, 7)), r"non-decreasing; got seq_start\[1\] = 5 > seq_start\[2\] = 3"),
        ("with a bias", (q, k, v, scale, torch.zeros(1, 4, 7, 7), seq_start),
         r"a bias together with seq_start \(packed sequences\) is not supported"),
    ]


MALFORMED = _malformed()


@pytest.mark.parametrize("args, message", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_a_malformed_seq_start_or_one_beside_a_bias_is_refused_naming_the_problem(args, message):
    with pytest.raises(ValueError, match=r"^bidirectional_attention: .*" + message):
        bidirectional_attention_reference(*args)
    with pytest.raises(ValueError, match=message):
        op(*args)


def _backend(name: str):
    return next(b for b in canonical_ops()["bidirectional_attention"].backends if b.name == name)


def test_the_backends_say_what_they_do_not_take():
    q, k, v, scale, seq_start = (a.to("meta") if isinstance(a, torch.Tensor) else a
                                 for a in packed([3, 4], 4, 2, torch.bfloat16, head_dim=64, value_dim=64))
    bias, cuda = torch.zeros(1, 4, 7, 7, dtype=torch.bfloat16, device="meta"), torch.device("cuda")
    sdpa, varlen = _backend("sdpa"), _backend("varlen")
    assert sdpa.check([q, k, v, scale, None, seq_start], torch.device("cpu")) is None
    assert sdpa.check([q, k, v, scale, bias, seq_start], cuda) == (
        "a bias together with packed sequences (seq_start) is not supported")

    assert varlen.check([q, k, v, scale, None, seq_start], torch.device("cpu")) == (
        "flash attention's varlen kernel runs on CUDA GPUs only (the deploy runs on cpu)")
    assert varlen.check([q, k, v, scale], cuda) == "the varlen kernel serves packed sequences (seq_start) only"
    assert varlen.check([q, k, v, scale, bias, seq_start], cuda) == "flash attention's varlen kernel adds no bias"
    assert varlen.check([q.float(), k.float(), v.float(), scale, None, seq_start], cuda) == (
        "flash attention takes float16 or bfloat16 q, k and v (got torch.float32, torch.float32, torch.float32)")
    assert "(got D=64, Dv=32)" in varlen.check([q, k, v[..., :32], scale, None, seq_start], cuda)
    assert "(got D=12, Dv=12)" in varlen.check([q[..., :12], k[..., :12], v[..., :12], scale, None, seq_start], cuda)
    assert varlen.check([q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, scale, None, seq_start], cuda) == (
        "flash attention needs q, k and v with a contiguous last dim")
    assert varlen.capturable and sdpa.capturable  # neither reads seq_start on the host


def test_the_backends_say_which_windows_they_do_not_take(monkeypatch):
    q, k, v, scale, seq_start = (a.to("meta") if isinstance(a, torch.Tensor) else a
                                 for a in packed([3, 4], 4, 2, torch.bfloat16, head_dim=64, value_dim=64))
    sdpa, varlen, cuda = _backend("sdpa"), _backend("varlen"), torch.device("cuda")
    assert sdpa.check([q, k, v, scale, None, seq_start, 3], torch.device("cpu")) is None
    assert sdpa.check([q, k[:, :5], v[:, :5], scale, None, None, 3], cuda) == (
        "a window needs self-attention (as many keys as queries)")

    # A torch whose flash forward takes scale= but no window (supports reads the op's schema only)
    monkeypatch.setattr(module, "_flash_forward_keywords", lambda: frozenset({"scale"}))
    assert varlen.check([q, k, v, scale, None, seq_start, 3], cuda) == (
        f"torch {torch.__version__}'s flash attention forward takes no window_size_left= / window_size_right= (a sliding window)")
    assert "window_size" not in (varlen.check([q, k, v, scale, None, seq_start], cuda) or "")  # no window: asks none


def test_opcheck():
    args = packed([3, 0, 1, 4], 4, 2, value_dim=6)
    torch.library.opcheck(op, (*args[:4], None, args[4]))
    torch.library.opcheck(torch.ops.autodeploy.bidirectional_attention_sdpa.default, (*args[:4], None, args[4]))
    torch.library.opcheck(op, (*args[:4], None, args[4], 2))
    torch.library.opcheck(torch.ops.autodeploy.bidirectional_attention_sdpa.default, (*args[:4], None, args[4], 2))


class PackedEncoderAttention(torch.nn.Module):
    """A query, key and value projection, then attention over the packed row: an embedding model's layer's half."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 64)

    def forward(self, hidden, seq_start):
        q, k, v = self.qkv(hidden).split([32, 16, 16], dim=-1)
        out = op(q.unflatten(-1, (4, 8)), k.unflatten(-1, (2, 8)), v.unflatten(-1, (2, 8)), 8**-0.5, None, seq_start)
        return out.flatten(-2)


def test_export_keeps_the_token_and_sequence_counts_dynamic():
    torch.manual_seed(0)
    model = PackedEncoderAttention()
    program = torch.export.export(model, (torch.randn(1, 9, 32), torch.tensor([0, 2, 2, 9], dtype=torch.int32)),
                                  dynamic_shapes=({1: Dim("tokens")}, {0: Dim("starts")}))
    (node,) = [n for n in program.graph.nodes if n.target is op.default]
    assert isinstance(node.meta["val"].shape[1], torch.SymInt)
    hidden, seq_start = torch.randn(1, 13, 32), torch.tensor([0, 1, 6, 6, 13, 13], dtype=torch.int32)
    torch.testing.assert_close(program.module()(hidden, seq_start), model(hidden, seq_start))
    # The traced graph holds the op with its seq_start, so select may retarget it to a packed backend.
    assert node.args[-1].op == "placeholder"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths,window", [([5, 1, 0, 7, 3], None), ([1], None), ([0, 128, 1, 0, 300, 77, 2], None),
                                            *(([0, 128, 1, 0, 300, 77, 2], w) for w in (0, 1, 64))],
                         ids=["small", "one-token", "long", "window-0", "window-1", "window-64"])
@pytest.mark.parametrize("backend_name", ["varlen", "sdpa"])
@HEADS
def test_on_a_gpu_the_backends_match_the_reference_in_bfloat16(q_heads, kv_heads, backend_name, lengths, window):
    """Packed texts on a GPU; with a window, ModernBERT's local layers (texts longer and shorter than it)."""
    args = packed(lengths, q_heads, kv_heads, torch.bfloat16, "cuda", head_dim=64, value_dim=64)
    call = [*args[:4], None, args[4], *([window] if window is not None else [])]
    backend = _backend(backend_name)
    reason = backend.check([a.to("meta") if isinstance(a, torch.Tensor) else a for a in call], torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"{backend_name}: {reason}")
    expected = bidirectional_attention_reference(*call)
    got = backend.op(*call)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16 and got.device.type == "cuda"
    assert relative_error(got, expected) <= tolerance(torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_varlen_is_captured_once_and_replays_other_packings_of_the_row():
    """One capture over static buffers, then replays after other texts and other starts (as many tokens, more or
    fewer sequences than at capture: ``seq_start`` keeps its length, empty sequences fill it)."""
    varlen = _backend("varlen")
    packings = [[40, 24, 0, 0], [1, 62, 1, 0], [0, 0, 0, 64]]
    steps = [packed(lengths, 8, 2, torch.bfloat16, "cuda", seed=seed, head_dim=64, value_dim=64)
             for seed, lengths in enumerate(packings)]
    reason = varlen.check([a.to("meta") if isinstance(a, torch.Tensor) else a for a in (*steps[0][:4], None, steps[0][4])],
                          torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"varlen: {reason}")
    static = [t.clone() for t in (*steps[0][:3], steps[0][4])]
    scale = steps[0][3]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        varlen.op(*static[:3], scale, None, static[3])  # once eagerly before capture, as the engine does
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = varlen.op(*static[:3], scale, None, static[3])
    for step in steps:
        for buffer, value in zip(static, (*step[:3], step[4])):
            buffer.copy_(value)
        graph.replay()
        expected = bidirectional_attention_reference(*step[:4], seq_start=step[4])
        assert relative_error(out, expected) <= tolerance(torch.bfloat16)
