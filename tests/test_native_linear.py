"""The native linear (workers/kernels/invariant_linear.c): a row's result is bit-identical whatever the rest
of the call holds (row count, the row's place, the thread count), and close to ``F.linear``; the runner with
``cpu_gemm="native"`` uses it, and falls back to oneDNN where the library cannot be built."""

from __future__ import annotations

import ctypes
import logging
import platform
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from workers import native_attention
from workers.config import EngineConfig
from workers.runner import ModelRunner, StepBatch
from workers.step_index import StepIndex

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def linear():
    lin = native_attention.load_linear()
    if lin is None:
        pytest.skip("no C compiler: the runner uses oneDNN")
    return lin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(131, 1000), (37, 53), (64, 576)])
def test_rows_are_invariant_and_match_torch(linear, dtype, n, k):
    """Every row of an M-row call equals that row alone, for M across 1..130 (full and tail tiles of rows
    and weight rows, odd K), at 1, 2 and 3 threads (131 x 1000 is large enough to run threaded), whether the
    weights are prefetched into L2 or L1 (``stream``, alternating)."""
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(130, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([linear(x[i : i + 1], w) for i in range(130)])  # [130, n]
        rng = random.Random(k)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 127, 130):
                rows = rng.sample(range(130), m)  # random rows in a random order: each at a random place
                got = linear(x[rows], w, stream=m % 2 == 1)
                assert torch.equal(got, alone[rows]), f"M={m} threads={threads}"
    finally:
        torch.set_num_threads(before)
    ref = F.linear(x.double(), w.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the result's own rounding (8 bits)
    torch.testing.assert_close(alone.double(), ref, atol=tol * k**0.5, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_weights_give_the_plain_weights_bits(linear, dtype):
    """A weight in the tiled layout (``NativeLinear.tile``: a tile's four rows interleaved 64 bytes at a time)
    gives every row the bits the plain [N, K] weight gives, for M across 1..40 (one-row tiles, widened blocks on
    AVX2), at 1 and 2 threads, streamed or not; the layout is the documented one."""
    gen = torch.Generator().manual_seed(9)
    ck = 64 // torch.empty(0, dtype=dtype).element_size()
    n, k = 132, 3 * ck * 4  # 33 tiles of rows, 12 chunks
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(40, k, generator=gen).to(dtype)
    tiled = linear.tile(w)
    assert tiled.shape == (n // 4, k // ck, 4, ck)
    assert torch.equal(tiled, w.view(n // 4, 4, k // ck, ck).permute(0, 2, 1, 3))
    assert native_attention.linear_shape(tiled) == (n, k) == native_attention.linear_shape(w)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 3, 4, 5, 8, 9, 17, 40):
                for stream in (False, True):
                    assert torch.equal(linear(x[:m], tiled, stream=stream), linear(x[:m], w, stream=stream)), (
                        m,
                        threads,
                    )
    finally:
        torch.set_num_threads(before)


def test_only_whole_tiles_and_chunks_are_tiled(linear, monkeypatch):
    """A weight whose rows are not whole tiles of 4, or not whole 64-byte chunks, stays plain; a 4-d weight
    that is not a tiled one is refused. A runner tiles a weight only where the build reads its dtype faster
    tiled, and not with SPECSERVE_TILED_WEIGHTS=0."""
    assert linear.can_tile(torch.zeros(8, 32, dtype=torch.bfloat16)) and linear.can_tile(torch.zeros(8, 16))
    assert not linear.can_tile(torch.zeros(6, 32, dtype=torch.bfloat16))
    assert not linear.can_tile(torch.zeros(8, 16, dtype=torch.bfloat16)) and not linear.can_tile(torch.zeros(8, 24))
    with pytest.raises(ValueError, match="tile"):
        linear.tile(torch.zeros(6, 32))
    with pytest.raises(ValueError, match="tiled"):
        linear(torch.zeros(1, 32), torch.zeros(2, 2, 4, 8))
    w = torch.zeros(8, 32)
    for wins in (True, False):
        monkeypatch.setitem(linear._tiled_wins, torch.float32, wins)
        assert linear.tiles(w) is wins
    monkeypatch.setenv(native_attention.ENV_TILED, "0")
    assert not linear.tiles(w)


def test_bad_operands_are_refused(linear):
    with pytest.raises(ValueError, match="do not multiply"):
        linear(torch.zeros(2, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="fp32 or both bf16"):
        linear(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        linear(torch.zeros(2, 8), torch.zeros(4, 8), out=torch.zeros(2, 5))
    assert torch.equal(linear(torch.ones(3, 0), torch.ones(4, 0)), torch.zeros(3, 4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_runner_with_tiled_weights_writes_the_plain_runners_bits(tiny_loaded, linear, dtype, monkeypatch):
    """The runner tiles its GEMM weights where every shape allows it (and the build reads them faster so: made
    so here for both dtypes); its logits are those of a runner that keeps them plain, for a prefill step and a
    decode step of two requests and a lone decode step."""
    monkeypatch.setitem(linear._tiled_wins, dtype, True)
    tiled = ModelRunner(tiny_loaded.model, 2, 128, dtype=dtype, cpu_gemm="native", batch_invariant=True)
    monkeypatch.setenv(native_attention.ENV_TILED, "0")
    plain = ModelRunner(tiny_loaded.model, 2, 128, dtype=dtype, cpu_gemm="native", batch_invariant=True)
    assert tiled.lm_head.dim() == 4 and all(tiled.layers[0][n].dim() == 4 for n in ("qkv", "o", "gate_up", "down"))
    assert plain.lm_head.dim() == 2 and tiled.native_layers is not None and tiled.native_layers.tiled
    steps = [
        StepBatch([0, 1], [0, 0], [list(range(5, 40)), list(range(7, 29))], [[34], [21]]),
        StepBatch([0, 1], [35, 22], [[9], [11]], [[0], [0]]),
        StepBatch([1], [23], [[4]], [[0]]),
    ]
    for b in steps:
        assert torch.equal(tiled.forward(b).logits, plain.forward(b).logits)


def test_runner_logits_match_the_library_gemm(tiny_loaded, linear):
    """The same model through the native linears and through F.linear: the same logits up to summation order."""
    ids = list(range(5, 45))
    native = ModelRunner(tiny_loaded.model, 1, 64, cpu_gemm="native")
    assert native.cpu_gemm == "native"
    ref = ModelRunner(tiny_loaded.model, 1, 64, cpu_gemm="mkl").forward_tokens(0, 0, ids)
    torch.testing.assert_close(native.forward_tokens(0, 0, ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layers_in_one_native_call_equal_the_calls_one_by_one(tiny_loaded, linear, dtype):
    """With every GEMM native, a forward's layers run as one C loop making the same calls: the logits and
    the caches it writes are bit-identical to the calls made one by one from Python, for a step that mixes
    prefill chunks and decode rows of requests whose blocks are scattered over the pool, and for decode steps of
    three requests and of one."""
    from workers.runner import StepBatch

    runners = [
        ModelRunner(tiny_loaded.model, 4, 128, dtype=dtype, cpu_gemm="native", batch_invariant=True, num_blocks=40)
        for _ in range(2)
    ]
    assert runners[0].native_layers is not None
    runners[1].fused_layers = False
    # the fused call prefetches the weights into L2, the one-by-one calls into L1
    assert runners[0].native_layers is not None
    runners[0].native_layers.stream, runners[1].stream_weights = True, False
    blocks = random.Random(3).sample(range(40), 24)  # each request its own blocks, scattered over the pool
    tables = [blocks[i * 8 : (i + 1) * 8] for i in range(3)]
    first = StepBatch([0, 1, 2], [0, 0, 0], [list(range(5, 40)), list(range(7, 29)), [3, 4, 5]], [[34], [21], [2]])
    first.block_tables = tables
    nxt = StepBatch([0, 1, 2], [35, 22, 3], [[9], [11, 12, 13, 14], [8]], [[0], [0, 1, 2, 3], [0]])
    nxt.block_tables = tables
    # a decode step (one row per request), where each attention item ropes its own heads
    dec = StepBatch([0, 1, 2], [36, 26, 4], [[3], [5], [6]], [[0], [0], [0]])
    dec.block_tables = tables
    # one row, fewer than the threads: each thread keeps its own residual stream and norms
    solo = StepBatch([0], [37], [[4]], [[0]])
    solo.block_tables = tables[:1]
    assert torch.get_num_threads() > 1
    outs = [[r.forward(b).logits for b in (first, nxt, dec, solo)] for r in runners]
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    for (ka, va), (kb, vb) in zip(
        zip(runners[0]._k_storage, runners[0].v_cache), zip(runners[1]._k_storage, runners[1].v_cache)
    ):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_caller_that_reads_the_outputs_at_once_gets_the_same_buffers_back(tiny_loaded, linear, dtype):
    """With ``reuse_outputs`` (the engine reads a step's outputs before its next), the fused forward hands out the
    last call's buffers of as many rows again, with this call's values in them: the same bits as fresh ones. By
    default every call's outputs are its own and keep their values through later calls."""
    runner = ModelRunner(tiny_loaded.model, 2, 64, dtype=dtype, cpu_gemm="native", batch_invariant=True)
    assert runner.native_layers is not None and runner.fused_layers

    def step(start: int, tokens: list[list[int]], reuse: bool):
        rows = [[len(t) - 1] for t in tokens]
        b = StepBatch([0, 1][: len(tokens)], [start] * len(tokens), tokens, rows, reuse_outputs=reuse)
        return runner.forward(b)

    step(0, [list(range(5, 30)), list(range(7, 32))], False)  # two prompts of 25 tokens
    fresh = [step(25 + i, [[3 + i], [9 + i]], False) for i in range(3)]  # three decode steps, fresh outputs
    kept = [(o.logits.clone(), o.hidden.clone(), list(o.argmax)) for o in fresh]
    for o, (logits, hidden, argmax) in zip(fresh, kept):  # each kept its values through the calls after it
        assert torch.equal(o.logits, logits) and torch.equal(o.hidden, hidden) and o.argmax == argmax
    assert len({o.logits.data_ptr() for o in fresh}) == 3
    # the same steps again (the same positions: the same cache writes), their outputs reused
    again = []
    for i in range(3):
        o = step(25 + i, [[3 + i], [9 + i]], True)
        again.append(o.logits)
        assert torch.equal(o.logits, kept[i][0]) and torch.equal(o.hidden, kept[i][1]) and o.argmax == kept[i][2]
        assert o.argmax == o.logits.argmax(dim=-1).tolist()
    assert again[0] is again[1] is again[2]
    one = step(28, [[6]], True)  # another row count: its own buffers
    assert one.logits.shape[0] == 1 and one.logits is not again[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_fused_call_makes_the_embeddings_the_layers_and_the_head(tiny_loaded, linear, dtype):
    """A step's forward is one native call from token ids (the embedding gather in the call) to fp32 logits (a
    bf16 model's widened in the call): the same bits as the embedding rows given as the residual stream, and
    the final norm and LM head of the rows made one call at a time. A token id outside the vocabulary or a
    logits row outside the step is refused by name, before the cache is written."""
    runner = ModelRunner(tiny_loaded.model, 2, 64, dtype=dtype, cpu_gemm="native", batch_invariant=True)
    nl = runner.native_layers
    assert nl is not None

    def index(ids: list[int], pos: list[int], kv: list[int], rows: list[int]) -> StepIndex:
        return StepIndex(ids, pos, kv, [0] * len(ids), [p + 1 for p in pos], rows, [[0, 1, 2, 3]], max(pos) + 1)

    ids, pos = [5, 17, 3, 40], [0, 1, 2, 3]
    h_ids, delta_ids, hs, logits, _ = nl.forward(index(ids, pos, pos, [3, 0]), 0.125)
    h_ids, delta_ids = h_ids.clone(), delta_ids.clone()
    h_given = runner.embed.index_select(0, torch.tensor(ids))
    delta_given = nl(h_given, index(ids, pos, pos, []), 0.125)
    assert torch.equal(h_ids, h_given) and torch.equal(delta_ids, delta_given)
    assert logits.dtype == torch.float32 and logits.shape == (2, runner.vocab_size)
    hs_calls = runner._final_norm(h_given, delta_given, torch.tensor([3, 0]))
    assert torch.equal(hs, hs_calls) and torch.equal(logits, runner._lm_head(hs_calls))
    # no logits rows (a prompt chunk before the last): the layers alone
    _, _, hs0, logits0, _ = nl.forward(index(ids, pos, pos, []), 0.125)
    assert hs0.shape == (0, runner.hidden_size) and logits0.shape == (0, runner.vocab_size)
    k_before = [k.clone() for k in runner._k_storage]
    with pytest.raises(ValueError, match="vocabulary"):
        nl.forward(index([5, runner.vocab_size], [0, 1], [8, 9], [1]), 0.125)
    with pytest.raises(ValueError, match="logits row"):
        nl.forward(index([5, 17], [0, 1], [8, 9], [0, 2]), 0.125)
    assert all(torch.equal(a, b) for a, b in zip(k_before, runner._k_storage))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_head_finds_each_rows_argmax_as_torch_does(tiny_loaded, linear, dtype, threads, monkeypatch):
    """Each logits row's argmax comes back from the fused call beside the logits, torch's answer (the first
    maximal index; the first NaN's where a row holds one), whether a row is one thread's unit or, with fewer
    rows than threads, split in chunks across them: ties of one value in three chunks, NaN in two."""
    monkeypatch.setenv(native_attention.ENV_TILED, "0")  # the LM head's rows plain, to be written below
    runner = ModelRunner(tiny_loaded.model, 2, 64, dtype=dtype, cpu_gemm="native", batch_invariant=True)
    nl, W = runner.native_layers, runner.lm_head  # W: [V, hidden], the rows the call reads
    assert nl is not None and W.dim() == 2 and W.shape[0] > 3 * 4096

    def forward(rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        index = StepIndex([5, 17, 3, 40], [0, 1, 2, 3], [0, 1, 2, 3], [0] * 4, [1, 2, 3, 4], rows, [[0, 1, 2, 3]], 4)
        _, _, hs, logits, argmax = nl.forward(index, 0.125)
        return hs, logits, argmax

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in ([3], [3, 0], [0, 1, 2, 3]):
            _, logits, argmax = forward(rows)
            assert argmax == logits.argmax(dim=-1).tolist()
        hs = forward([3])[0]
        for j in (7, 4096 + 7, 3 * 4096):  # one logit, the row's largest, in three chunks
            W[j] = hs[0] * 8
        _, logits, argmax = forward([3])
        assert logits[0, 7] == logits[0, 4096 + 7] == logits[0, 3 * 4096] == logits.max()
        assert argmax == [7] == logits.argmax(dim=-1).tolist()
        W[3 * 4096 + 5], W[4096 + 3] = float("nan"), float("nan")
        _, logits, argmax = forward([3, 1])
        assert argmax == [4096 + 3] * 2 == logits.argmax(dim=-1).tolist()
    finally:
        torch.set_num_threads(before)


def test_weights_larger_than_the_last_level_cache_are_streamed(tiny_loaded, linear, monkeypatch):
    """A runner whose weights exceed the last-level cache prefetches them into L2 in every native GEMM
    (they are read from memory each step anyway); one whose weights fit keeps them cached; an unknown
    cache size keeps them cached. The logits are the same bits either way."""
    from workers import hardware

    ids = list(range(5, 45))
    logits = {}
    for llc, streams in ((1 << 10, True), (1 << 40, False), (None, False)):
        monkeypatch.setattr(hardware, "last_level_cache_bytes", lambda llc=llc: llc)
        runner = ModelRunner(tiny_loaded.model, 1, 64, cpu_gemm="native", batch_invariant=True)
        assert runner.stream_weights is streams
        assert runner.native_layers is not None and runner.native_layers.stream is streams
        logits[llc] = runner.forward_tokens(0, 0, ids)
    assert torch.equal(logits[1 << 10], logits[1 << 40]) and torch.equal(logits[None], logits[1 << 40])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_kernel_thread_preempted_mid_unit_changes_no_bit(tmp_path, linear, dtype, monkeypatch):
    """A kernel thread that stalls while it holds units (as a preempted one does: the serving processes share
    the cores) holds the others back only briefly: with a decode step's workspace, where the layers write their
    intermediates into a ring of slots, the other thread computes the held units again and goes on alone (the
    team's takeover), up to where the ring wraps (12 layers, more than it holds); with the shared
    buffers of a prefill chunk it waits. Either way the logits and the caches are bit-identical to an
    unstalled runner's, for a prefill step, a three-request decode step and a one-row step."""
    from tests.conftest import make_tiny_llama
    from workers.model_loader import load_model
    from workers.runner import StepBatch

    loaded = load_model(str(make_tiny_llama(tmp_path / "m12", seed=5, layers=12)))
    assert torch.get_num_threads() > 1
    blocks = random.Random(7).sample(range(40), 24)  # each request its own blocks, scattered over the pool
    tables = [blocks[i * 8 : (i + 1) * 8] for i in range(3)]
    steps = [
        StepBatch([0, 1, 2], [0, 0, 0], [list(range(5, 40)), list(range(7, 29)), [3, 4, 5]], [[34], [21], [2]]),
        StepBatch([0, 1, 2], [35, 22, 3], [[3], [5], [6]], [[0], [0], [0]]),
        StepBatch([0], [36], [[4]], [[0]]),
    ]
    for b in steps:
        b.block_tables = tables[: len(b.slots)]

    def run(stall_phase: int, shared: bool) -> tuple[list[torch.Tensor], ModelRunner]:
        runner = ModelRunner(loaded.model, 4, 128, dtype=dtype, cpu_gemm="native", batch_invariant=True, num_blocks=40)
        assert runner.native_layers is not None
        monkeypatch.setattr(native_attention.BoundLayers, "WORKSPACE_BYTES", 0 if shared else 2 << 20)
        # long against the OS's scheduling noise (a waiter takes held units over within ~2 ms)
        native_attention.stall_kernel_thread(0, stall_phase, 0.1 if stall_phase else 0.0)
        try:
            return [runner.forward(b).logits for b in steps], runner
        finally:
            native_attention.stall_kernel_thread(0, 0, 0.0)

    ref, ref_runner = run(0, shared=False)
    # phase 1: the first layer's qkv GEMM; 14: the third layer's o projection in a decode step (five
    # phases a layer: the row-wise ones are each thread's own)
    for phase, shared in ((1, False), (14, False), (1, True)):
        before = native_attention.team_takeovers()
        got, runner = run(phase, shared)
        for a, b in zip(ref, got):
            assert torch.equal(a, b), f"phase {phase}, shared buffers {shared}"
        for (ka, va), (kb, vb) in zip(
            zip(ref_runner._k_storage, ref_runner.v_cache), zip(runner._k_storage, runner.v_cache)
        ):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
        if not shared:  # with shared buffers the layers only wait (the head may still take over, or not)
            assert native_attention.team_takeovers() > before, f"no takeover at phase {phase}"


def test_config_names_a_bad_backend():
    with pytest.raises(ValidationError, match="cpu_gemm"):
        EngineConfig(cpu_gemm="blas")
    assert EngineConfig(cpu_gemm="native").cpu_gemm == "native"


def test_without_the_library_native_falls_back_to_onednn(tiny_loaded, monkeypatch, caplog):
    monkeypatch.setenv(native_attention.ENV_DISABLE, "0")
    native_attention.clear_cache()
    try:
        with caplog.at_level(logging.WARNING, logger="workers.runner"):
            r = ModelRunner(tiny_loaded.model, 1, 64, cpu_gemm="native", batch_invariant=True)
        assert r.cpu_gemm == "onednn" and r.native_gemm is None
        assert "using oneDNN" in caplog.text
        assert r.forward_tokens(0, 0, [5, 6, 7]).shape == (3, tiny_loaded.model.config.vocab_size)
    finally:
        monkeypatch.undo()
        native_attention.clear_cache()


def _build(tmp_path, march: str) -> ctypes.CDLL | None:
    """The linear kernel alone, built for ``march`` instead of this CPU (None where the compiler refuses)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = tmp_path / f"linear-{march}.so"
    src = native_attention._KERNELS / "invariant_linear.c"
    flags = [f for f in native_attention.FLAGS if f != "-march=native"]
    if subprocess.run([cc, *flags, f"-march={march}", str(src), "-o", str(out)], capture_output=True).returncode:
        return None
    return ctypes.CDLL(str(out))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction sets")
def test_every_instruction_set_sums_fp32_in_the_same_order(linear, tmp_path):
    """The AVX2 + FMA path and the portable C one (built here for older x86-64 levels, run where this CPU has
    their instructions) give rows invariant as above and, in fp32, the very bits of the native build. In bf16 a
    row of a many-row call (weights widened once per block on AVX2) equals the row alone (widened per load)."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(19, 301, generator=gen), torch.randn(67, 301, generator=gen)
    want = linear(x, w)
    tried = 0
    for march, needs in (("x86-64-v3", ("avx2", "fma")), ("x86-64-v2", ())):
        dll = _build(tmp_path, march)
        if dll is None or not all(f" {n} " in flags for n in needs):
            continue
        other = native_attention.NativeLinear(dll)
        assert torch.equal(other(x, w), want), march
        assert torch.equal(other(x[7:8], w), want[7:8]), march
        xb, wb = x.bfloat16(), w.bfloat16()
        whole = other(xb, wb)  # 19 rows: on AVX2 each weight block widened once for all rows
        assert torch.equal(whole[3:9], other(xb[3:9], wb)), march  # 6 rows: widened per load
        assert torch.equal(whole[7:8], other(xb[7:8], wb)), march
        xt, wt = torch.randn(19, 320, generator=gen).bfloat16(), torch.randn(68, 320, generator=gen).bfloat16()
        want_t = linear(xt, wt)  # tiled: the unpacking of a widened block, the chunk addressing of one-row tiles
        assert torch.equal(other(xt, other.tile(wt)), want_t) and torch.equal(other(xt, wt), want_t), march
        assert torch.equal(other(xt[5:6], other.tile(wt)), want_t[5:6]), march
        tried += 1
    if not tried:
        pytest.skip("no other x86-64 level builds or runs here")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bits, every NaN made one NaN: a NaN's sign and payload follow the operand order each
    instruction happens to take, which no value depends on."""
    t = torch.where(t.isnan(), torch.full_like(t, float("nan")), t)
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction sets")
def test_the_avx2_build_of_every_kernel_gives_the_native_builds_bits(tiny_loaded, tmp_path, monkeypatch):
    """Built for AVX2 + FMA (x86-64-v3) and run on this CPU, the row-wise ops, the argmax and the attention give
    the native build's bits: AVX2 computes a 16-lane comparison, select or bf16 rounding with other
    instructions, and none of them may change a value. The whole forward is compared with GEMMs that are the
    same in both (fp32 native, whose bits are the same on every instruction set, and bf16 through ``F.linear``:
    bf16 native pairs k differently with AVX512-BF16); a bf16 native forward on the AVX2 build keeps every row
    invariant."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not all(f" {n} " in flags for n in ("avx2", "fma")):
        pytest.skip("this CPU cannot run an AVX2 build")
    ops = native_attention.load_layer_ops()
    if ops is None:
        pytest.skip("no C compiler")
    prompts, decode = [list(range(5, 40)), list(range(7, 29))], [[9], [11]]

    def forwards(dtype: torch.dtype, cpu_gemm: str) -> list[torch.Tensor]:
        r = ModelRunner(tiny_loaded.model, 2, 128, dtype=dtype, cpu_gemm=cpu_gemm, batch_invariant=True)
        assert r.native_layers is not None or cpu_gemm != "native"
        out = [r.forward(StepBatch([0, 1], [0, 0], prompts, [[34], [21]])).logits]
        return out + [r.forward(StepBatch([0, 1], [35, 22], decode, [[0], [0]])).logits]

    cells = ((torch.float32, "native"), (torch.bfloat16, "mkl"))
    want = {cell: forwards(*cell) for cell in cells}
    monkeypatch.setattr(
        native_attention,
        "FLAGS",
        tuple("-march=x86-64-v3" if f == "-march=native" else f for f in native_attention.FLAGS),
    )
    native_attention.clear_cache()
    try:
        v3 = native_attention.load_layer_ops()
        assert v3 is not None
        gen = torch.Generator().manual_seed(11)
        special = torch.tensor([-200.0, 200.0, 0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-40, -1e-40])
        for dtype in DTYPES:
            gu = (4 * torch.randn(9, 2 * 1536, generator=gen)).to(dtype)
            gu[0, : len(special)], gu[1, 1536 : 1536 + len(special)] = special, special  # gates, then ups
            assert torch.equal(_bits(ops.silu_mul(gu)), _bits(v3.silu_mul(gu))), dtype
            h, delta = torch.randn(2, 9, 576, generator=gen).to(dtype)
            h[3, :5] = special[4:].to(dtype)  # a row of NaN and infinities, and values that round to subnormals
            w = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
            outs = []
            for o in (ops, v3):
                hh, out = h.clone(), torch.empty_like(h)
                o.add_rms_norm(hh, delta, w, out, 1e-5)
                outs.append((_bits(hh), _bits(out)))
            assert all(torch.equal(a, b) for a, b in zip(*outs)), dtype
        x = torch.randn(5, 49155, generator=gen)
        x[1] = torch.randint(-3, 3, (49155,), generator=gen).float()  # ties
        x[2, 7], x[3, 40000], x[4, -1] = float("nan"), float("inf"), 1e9
        assert torch.equal(v3.argmax(x), ops.argmax(x)) and torch.equal(v3.argmax(x), x.argmax(dim=-1))
        for cell in cells:
            assert all(torch.equal(a, b) for a, b in zip(forwards(*cell), want[cell])), cell
        both = forwards(torch.bfloat16, "native")  # both requests in each step (the prompts widened once per block)
        r = ModelRunner(tiny_loaded.model, 2, 128, dtype=torch.bfloat16, cpu_gemm="native", batch_invariant=True)
        alone = r.forward(StepBatch([1], [0], prompts[1:], [[21]])).logits
        assert torch.equal(alone, both[0][1:])
        assert torch.equal(r.forward(StepBatch([1], [22], decode[1:], [[0]])).logits, both[1][1:])
    finally:
        monkeypatch.undo()
        native_attention.clear_cache()


def test_dtype_auto_is_bf16_on_avx2_only_where_the_native_kernels_build(tiny_loaded, monkeypatch):
    """On a CPU with AVX2 + FMA and no bf16 instructions, ``dtype: auto`` is bf16 because the GEMMs run on the
    native kernel; where it cannot be built they fall back to oneDNN, which would multiply bf16 through fp32
    copies, and the dtype stays fp32."""
    from workers import hardware
    from workers.engine import LLMEngine

    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    config = EngineConfig(max_num_seqs=1, max_model_len=64, proposers=[])
    assert LLMEngine(config, tiny_loaded).dtype == torch.bfloat16
    monkeypatch.setenv(native_attention.ENV_DISABLE, "0")
    native_attention.clear_cache()
    try:
        assert LLMEngine(config, tiny_loaded).dtype == torch.float32
    finally:
        monkeypatch.undo()
        native_attention.clear_cache()


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_steps_in_one_call_are_the_greedy_steps_one_at_a_time(tiny_loaded, linear, dtype):
    """``decode_steps``: n greedy steps in one native call, each row's argmax fed back, give the tokens and the
    cache writes of n forwards made one at a time with those tokens fed, bit for bit, for three requests whose
    scattered blocks the steps cross into, and for one alone (fewer rows than threads); with a pick between the
    steps, it sees each step's logits and its tokens are the ones fed. A step that is not one
    decode row per request, or block tables that do not cover the n positions, are refused by name."""
    runners = [
        ModelRunner(tiny_loaded.model, 4, 128, dtype=dtype, cpu_gemm="native", batch_invariant=True, num_blocks=40)
        for _ in range(2)
    ]
    assert all(r.runs_decode_steps for r in runners)
    blocks = random.Random(5).sample(range(40), 24)
    tables = [blocks[i * 8 : (i + 1) * 8] for i in range(3)]
    lengths = [13, 30, 5]  # the 7 steps cross block boundaries (16 positions a block) at different steps
    prompts = [[(7 * i + 3 * j) % 90 + 2 for j in range(n)] for i, n in enumerate(lengths)]
    for r in runners:
        r.forward(StepBatch([0, 1, 2], [0, 0, 0], prompts, [[n - 1] for n in lengths], block_tables=tables))
    pending = [11, 12, 13]
    n = 7

    def batch(tokens: list[int], start: list[int]) -> StepBatch:
        return StepBatch([-1] * len(tokens), start, [[t] for t in tokens], [[0]] * len(tokens), block_tables=tables)

    one_at_a_time, fed = [], list(pending)
    for s in range(n):
        out = runners[0].forward(batch(fed, [L + s for L in lengths]))
        assert out.argmax is not None
        one_at_a_time.append(out.argmax)
        fed = out.argmax
    assert runners[1].decode_steps(batch(pending, list(lengths)), n) == one_at_a_time
    for (ka, va), (kb, vb) in zip(
        zip(runners[0]._k_storage, runners[0].v_cache), zip(runners[1]._k_storage, runners[1].v_cache)
    ):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    # one request alone, on from where the three stopped
    solo = StepBatch([-1], [lengths[0] + n], [[one_at_a_time[-1][0]]], [[0]], block_tables=tables[:1])
    alone = [runners[0].forward(solo).argmax]
    for s in range(1, 3):
        alone.append(
            runners[0]
            .forward(StepBatch([-1], [lengths[0] + n + s], [alone[-1]], [[0]], block_tables=tables[:1]))
            .argmax
        )
    assert runners[1].decode_steps(solo, 3) == alone
    # a pick between the steps (a sampler's place): it sees each step's logits, and what it returns is fed back
    start = [lengths[0] + n + 3]
    picked, seen, fed = [], [], [alone[-1][0]]
    for s in range(4):
        out = runners[0].forward(StepBatch([-1], [start[0] + s], [fed], [[0]], block_tables=tables[:1]))
        assert out.argmax is not None
        seen.append(out.logits.clone())
        fed = [(out.argmax[0] * 7 + s) % 90 + 2]
        picked.append(fed)
    got_logits: list[torch.Tensor] = []

    def pick(s: int, logits: torch.Tensor, argmax: list[int]) -> list[int]:
        got_logits.append(logits.clone())
        return [(argmax[0] * 7 + s) % 90 + 2]

    picks = StepBatch([-1], start, [[alone[-1][0]]], [[0]], block_tables=tables[:1])
    assert runners[1].decode_steps(picks, 4, pick) == picked
    assert all(torch.equal(a, b) for a, b in zip(got_logits, seen)) and len(got_logits) == 4
    with pytest.raises(ValueError, match="one new token per request"):
        runners[1].decode_steps(StepBatch([-1], [5], [[3, 4]], [[1]], block_tables=tables[:1]), 2)
    with pytest.raises(ValueError, match="cannot hold"):
        runners[1].decode_steps(StepBatch([-1], [120], [[3]], [[0]], block_tables=[tables[0]]), 9)
