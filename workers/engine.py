"""The decoding engine: iteration-level continuous batching of plain and speculative steps.

One ``step()``, in three parts that can each be read and tested alone (as in vLLM v1):
  1. schedule (workers/scheduler.py): admit waiting requests into free KV blocks, ask the routing
     policy for every decoding request's K (0 = plain step), and size each prompt chunk from the
     step-cost model within the step's latency budget;
  2. execute (``_execute``): the proposers' drafts, then one target forward over a ragged batch:
     decoding requests feed their pending token plus their drafts (K + 1 tokens), prefilling
     requests their chunk;
  3. process outputs (workers/output_processor.py): verify every request at its frontier, roll the
     KV length back to the accepted prefix (just a number), commit, detokenize, check EOS / stop
     strings / max_tokens, free finished requests' blocks (their full blocks stay in the prefix cache).

Nothing here imports Ray; the Serve target worker drives it through ``AsyncEngine``.
"""

from __future__ import annotations

import collections
import secrets
import time
from typing import Any, Callable, Sequence

import torch
from pydantic import ValidationError

from workers import native_attention
from workers.config import EngineConfig
from workers.cost_model import StepCostModel
from workers.decision import DecideFn, SpecCandidate, Speculation, fixed_k
from workers.detokenizer import IncrementalDetokenizer, text_decoder
from workers.errors import InvalidRequestError
from workers.grammar import Grammar, GrammarRuntime
from workers.hardware import resolve_cpu_gemm, resolve_dtype
from workers.kv_blocks import KVCacheManager, kv_bytes_per_token, pool_blocks
from workers.logprobs import token_logprobs
from workers.model_loader import LoadedModel
from workers.output_processor import FrontierRow, OutputProcessor, output
from workers.proposers.base import ProposalRequest, Proposer
from workers.request import Request, RequestOutput, Status, StepEvent
from workers.runner import ModelRunner, StepBatch, pick_device
from workers.sampler import make_generator
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerOutput
from workers.stats import AcceptanceTracker, Ema, LoadSnapshot, SpecDecodeStats

_ROLES = ("system", "user", "assistant")


def as_sampling_params(params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    """Validate a request's sampling parameters; ``InvalidRequestError`` names the bad field."""
    if isinstance(params, SamplingParams):
        return params
    try:
        return SamplingParams(**(params or {}))
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or None
        raise InvalidRequestError(f"{field}: {err['msg']}", param=field) from None


class LLMEngine:
    """Synchronous engine core. Not thread-safe: one thread calls it (see ``AsyncEngine``)."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        proposers: dict[str, Proposer] | None = None,
        decide: DecideFn | None = None,
        on_step: Callable[[int, float, int | None], None] | None = None,
        on_verify: Callable[[str, int, int], None] | None = None,
        cost_model: StepCostModel | None = None,
    ) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.tokenizer = loaded.tokenizer
        self._decode_text = text_decoder(self.tokenizer)  # each request's detokenizer decodes through it
        hf_cfg = loaded.model.config
        self.vocab_size = hf_cfg.vocab_size
        self.max_model_len = min(config.max_model_len, getattr(hf_cfg, "max_position_embeddings", 1 << 30))
        device = pick_device(config.device)
        gemm = config.cpu_gemm
        # bf16 GEMMs on the native kernel pick bf16; where it cannot be built, the runner falls back to oneDNN,
        # and so does the dtype. Asked only where the answer can change the dtype (building it takes seconds).
        if (
            device.type == "cpu"
            and config.dtype == "auto"
            and resolve_cpu_gemm(gemm, torch.bfloat16) == "native"
            and native_attention.load_linear() is None
        ):
            gemm = "onednn"
        self.dtype = resolve_dtype(config.dtype, device, gemm)
        self.kv_dtype = self._kv_dtype()
        num_blocks = self._num_kv_blocks(hf_cfg)
        self.runner = ModelRunner(
            loaded.model,
            config.max_num_seqs,
            self.max_model_len,
            self.dtype,
            device,
            cpu_gemm=config.cpu_gemm,
            batch_invariant=config.batch_invariant,
            num_blocks=num_blocks,
            block_size=config.block_size,
            kv_dtype=self.kv_dtype,
        )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # what a snapshot says of the kernels: fixed once the runner is built, and made once (not every step)
        self._kernels: tuple[str, bool, str, str] = (
            str(self.dtype).removeprefix("torch."),
            config.batch_invariant,
            self.runner.attention_kernel,
            self.runner.cpu_gemm if self.runner.device.type == "cpu" else "cuda",
        )
        eos = getattr(hf_cfg, "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos_ids)
        # structured output: compiled grammars (cached by source) and the batch's masks
        self.grammars = GrammarRuntime(
            self.tokenizer, self.vocab_size, sorted(self.eos_token_ids), config.structured_outputs
        )
        self.proposers: dict[str, Proposer] = dict(proposers or {})
        for name, p in self.proposers.items():  # a draft's token ids and q rows must be the target's
            draft_vocab = getattr(p, "vocab_size", None)
            if draft_vocab is not None and draft_vocab != self.vocab_size:
                raise ValueError(
                    f"proposer {name!r}: draft vocabulary {draft_vocab} != target vocabulary {self.vocab_size}"
                )
        # proposers that read the target's hidden states (EAGLE): only their requests pay for keeping them
        self._hidden_proposers = {n for n, p in self.proposers.items() if getattr(p, "needs_hidden_states", False)}
        self.default_proposer: str | None = config.proposers[0].name if config.proposers and self.proposers else None
        if self.default_proposer not in self.proposers:
            self.default_proposer = next(iter(self.proposers), None)
        self.decide: DecideFn = decide or fixed_k(config.num_speculative_tokens)
        # (tokens in the step, seconds, decoding requests if no prefill rode along else None): metrics, traces
        self.on_step = on_step
        # Step cost of this hardware and model, measured every step: the scheduler sizes prompt chunks
        # from it, and a goodput policy handed the same model sizes K from it.
        self.cost_model = cost_model if cost_model is not None else StepCostModel()
        self.scheduler = Scheduler(
            config.scheduler,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.cost_model,
            self._decide_k,
            self.kv,
            time.monotonic,
            self._may_read_cache,
        )
        self.processor = OutputProcessor(
            config.verification, self.max_model_len, self.proposers, self._finish, on_verify, self.grammars
        )
        self.requests: dict[str, Request] = {}
        self.step_time_ema = Ema(0.1)
        self.tokens_per_step_ema = Ema(0.1)
        self.num_steps = 0
        self.num_handed = 0  # add_request calls, valid or not: the Router matches them against what it sent
        self.last_plan: SchedulerOutput | None = None  # the last step's schedule (traces, tests)
        self._tokens_last_step = 0
        self._num_recording = 0  # requests in flight that record per-step events (tracing); 0: no event work

    def _kv_dtype(self) -> torch.dtype:
        """``kv_cache_dtype`` resolved: 'auto' is the model's dtype. bf16 KV under fp32 weights (dtype 'auto'
        resolved to fp32 here) would round every key and value, so it is refused naming the key."""
        name = self.config.kv_cache_dtype
        if name == "auto":
            return self.dtype
        kv = getattr(torch, name)
        if kv == torch.bfloat16 and self.dtype == torch.float32:
            raise ValueError(
                "engine.kv_cache_dtype='bfloat16' with a float32 model (engine.dtype resolved to float32 on this "
                "hardware) would round every key and value and change output: use kv_cache_dtype 'auto' or 'float32'"
            )
        return kv

    def _num_kv_blocks(self, hf_cfg: Any) -> int:
        """Blocks of the KV pool: ``kv_cache_memory_gb`` over one block's bytes in every layer, capped at
        what ``max_num_seqs`` requests of ``max_model_len`` can hold; at least one such request."""
        cfg = self.config
        head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
        per_token = kv_bytes_per_token(
            hf_cfg.num_hidden_layers, hf_cfg.num_key_value_heads, head_dim, self.kv_dtype.itemsize
        )
        return pool_blocks(
            cfg.kv_cache_memory_gb,
            per_token,
            cfg.block_size,
            self.max_model_len,
            cfg.max_num_seqs,
            "engine.kv_cache_memory_gb",
        )

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens admitted that could read the prefix cache (vLLM's prefix_cache_queries)."""
        return self.kv.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, read from cached blocks instead of prefilled (vLLM's prefix_cache_hits)."""
        return self.kv.prefix_cache_hits

    # ----------------------------------------------------------------- requests in / out

    def tokenize_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Apply the model's chat template (with the generation prompt) and tokenize."""
        if not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in _ROLES:
                raise InvalidRequestError(f"messages[{i}].role must be one of {list(_ROLES)}", param="messages")
            if not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"messages[{i}].content must be a string", param="messages")
        text = self.tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in messages], tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokenize_text(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams | dict[str, Any] | None = None,
        proposer: str | None = None,
        speculation: Speculation = "auto",
        record_events: bool = False,
        resume_output_ids: Sequence[int] = (),
        grammar: Grammar | None = None,
    ) -> None:
        """Validate and queue a request. Raises ``InvalidRequestError`` naming the bad field.

        ``record_events``: keep a ``StepEvent`` per engine step of this request (for its trace),
        handed back on its final output; off by default, and then no step does any event work.
        ``resume_output_ids``: output tokens the request already wrote elsewhere (a stream whose
        replica died): they are prefilled with the prompt and count as output (max_tokens, stop
        strings, penalties, the noise position of the next token), and their text is not sent
        again. With the request's seed, what follows is what the uninterrupted run writes.
        ``grammar``: ``params.structured`` compiled already (``self.grammars.compile``, which blocks:
        the async front compiles off the step loop); None compiles it here.
        """
        self.num_handed += 1
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", param="request_id")
        params = as_sampling_params(params)
        prompt = list(prompt_ids)
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt has token ids outside [0, {self.vocab_size})", param="prompt")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens; this model's context is {self.max_model_len} tokens",
                param="prompt",
            )
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{self.max_model_len} tokens",
                param="max_tokens",
            )
        if self.kv.blocks_for(len(prompt) + params.max_tokens) > self.kv.num_blocks:  # never, while the pool holds
            raise InvalidRequestError(  # one full-length request
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the KV cache of "
                f"{self.kv.num_blocks * self.kv.block_size} tokens",
                param="max_tokens",
            )
        resumed = list(resume_output_ids)
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in resumed):
            raise InvalidRequestError(
                f"resumed output has token ids outside [0, {self.vocab_size})", param="resume_output_ids"
            )
        if resumed and len(resumed) >= params.max_tokens:
            raise InvalidRequestError(
                f"{len(resumed)} resumed tokens leave nothing of max_tokens ({params.max_tokens}) to write",
                param="resume_output_ids",
            )
        if speculation not in ("auto", "on", "off"):
            raise InvalidRequestError(
                f"speculation must be 'auto', 'on' or 'off', not {speculation!r}", param="speculation"
            )
        if proposer is not None and proposer not in self.proposers:
            raise InvalidRequestError(
                f"unknown proposer {proposer!r}; configured: {sorted(self.proposers)}", param="proposer"
            )
        if params.structured is None and grammar is not None:
            raise InvalidRequestError("a grammar was given for a request without structured output", param="grammar")
        if params.structured is not None and grammar is None:
            grammar = self.grammars.compile(params.structured)
        if grammar is not None and resumed and not grammar.resume(resumed, self.eos_token_ids):
            raise InvalidRequestError("resumed output does not follow the request's grammar", param="resume_output_ids")
        req = Request(
            request_id=request_id,
            prompt_ids=prompt,
            params=params,
            proposer=proposer or self.default_proposer,
            speculation=speculation,
            detok=IncrementalDetokenizer(self.tokenizer, prompt, params.stop, self._decode_text),
            generator=None,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            seed=params.seed if params.seed is not None else secrets.randbits(64),
            prompt_logprobs=None if params.prompt_logprobs is None or resumed else [None],  # sent before
            output_ids=resumed,
            num_resumed=len(resumed),
            grammar=grammar,
        )
        for t in resumed:  # the detokenizer's state as after writing them; their text was sent already
            req.detok.add(t)
        req.detok.take(False)
        if self.config.verification == "rejection" and not params.greedy:
            req.generator = make_generator(req.seed, self.runner.device)
        if record_events:
            req.events = []
            self._num_recording += 1
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request: its KV blocks and its proposers' state are freed at once."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, "abort")
        return output(req, [], final=True)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # The scheduler owns the queues and the requests' blocks; these read them.
    @property
    def waiting(self) -> collections.deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def stats(self) -> dict[str, SpecDecodeStats]:
        return self.processor.stats

    @property
    def acceptance(self) -> AcceptanceTracker:
        return self.processor.acceptance

    @property
    def num_output_tokens(self) -> int:
        return self.processor.counters.output_tokens

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, propose, one forward, verify and commit."""
        t0 = time.perf_counter()
        rec = self._num_recording > 0  # per-step event timestamps only while some request records them
        t0_ns = time.time_ns() if rec else 0
        plan = self.last_plan = self.scheduler.schedule()
        if not plan.decode and not plan.prefill:
            return []
        decoding = [r for r, _ in plan.decode]
        drafts, draft_probs = self._propose(decoding, [k for _, k in plan.decode])
        t_prop_ns = time.time_ns() if rec else 0
        n = self._steps_ahead(plan, decoding, drafts)
        if n > 1:
            return self._decode_steps(decoding, n, t0)

        # The ragged batch: decoding requests first (latency-critical), then prompt chunks.
        pending = [[r.token_at(r.num_computed)] + d for r, d in zip(decoding, drafts)]
        chunks = [(r, r.ids_between(r.num_computed, r.num_computed + n)) for r, n in plan.prefill]
        at_end = [r.num_computed + len(toks) == r.prefill_len for r, toks in chunks]  # the chunk ends the prefill
        reqs = decoding + [r for r, _ in chunks]
        fed = pending + [toks for _, toks in chunks]
        frontier = [
            FrontierRow(r, toks, d, p, min(len(r.forced), len(d)))
            for r, toks, d, p in zip(decoding, pending, drafts, draft_probs)
        ]
        frontier += [FrontierRow(r, toks) for (r, toks), end in zip(chunks, at_end) if end]
        logits, argmax = self._execute(reqs, fed, {id(f.request): len(f.drafts) for f in frontier})

        for (r, toks), end in zip(chunks, at_end):
            if not end:  # the prompt goes on next step; nothing to verify yet
                r.num_computed += len(toks)
                if rec and r.events is not None:
                    r.events.append(StepEvent(t0_ns, time.time_ns(), "prefill", 0, 0, t_prop_ns))
        outputs = self.processor.process(frontier, logits, (t0_ns, t_prop_ns) if rec else None, argmax)
        self._after_steps(reqs, 1, sum(len(t) for t in fed), t0, len(decoding), plan.prefill_tokens)
        return outputs

    def _after_steps(
        self, reqs: list[Request], steps: int, tokens: int, t0: float, decoding: int, prefill_tokens: int
    ) -> None:
        """What follows an iteration of ``steps`` model steps that fed ``tokens`` each (``decoding`` requests
        decoding, ``prefill_tokens`` of prompts) since ``t0``: newly full blocks of committed positions become
        prefix-cache entries, and the step counters, the cost model and ``on_step`` see the mean step."""
        if self.kv.enable_caching:
            for r in reqs:
                if r.status is Status.RUNNING:
                    self.kv.cache_full_blocks(r)
        self.num_steps += steps
        self._tokens_last_step = tokens
        dt = (time.perf_counter() - t0) / steps
        self.step_time_ema.update(dt)
        self.tokens_per_step_ema.update(tokens)
        self.cost_model.observe(tokens, dt, decoding, prefill_tokens)
        if self.on_step is not None:
            self.on_step(tokens, dt, decoding if not prefill_tokens else None)

    def _steps_ahead(self, plan: SchedulerOutput, decoding: list[Request], drafts: list[list[int]]) -> int:
        """How many plain decode steps this iteration runs with no commit between them (EngineConfig.decode_steps),
        with the KV of their positions reserved; 1: the usual step. Only where a token needs nothing between steps
        but its logits (and, sampled under coupled verification, its position's key) and nothing waits to be
        admitted (see the config key), and never past a request's max_tokens or the context."""
        n = self.config.decode_steps
        if n < 2 or plan.prefill or self.scheduler.waiting or not decoding or not self.runner.runs_decode_steps:
            return 1
        coupled = self.config.verification == "coupled"  # a sampled token then needs only its logits and key
        for r, d in zip(decoding, drafts):
            p = r.params
            if d or not (p.greedy or coupled) or p.penalized or p.logprobs is not None or r.grammar is not None:
                return 1
            if r.events is not None or r.proposer in self._hidden_proposers:
                return 1
            n = min(n, p.max_tokens - len(r.output_ids), self.max_model_len - r.num_tokens)
        if n < 2:
            return 1
        for r in decoding:  # blocks taken before a refusal stay with their request: its next steps use them
            if not self.kv.grow(r, r.num_computed + n):
                return 1
        return n

    def _decode_steps(self, decoding: list[Request], n: int, t0: float) -> list[RequestOutput]:
        """``n`` plain decode steps of ``decoding`` (runner.decode_steps: one native call when every request is
        greedy, else one a step with the plain step's sampling between), committed as ``n`` steps would commit
        them: each request's tokens up to its first stop."""
        batch = StepBatch(
            slots=[-1] * len(decoding),
            start_pos=[r.num_computed for r in decoding],
            token_ids=[[r.token_at(r.num_computed)] for r in decoding],
            logits_rows=[[0]] * len(decoding),
            block_tables=[r.block_table for r in decoding],
        )
        greedy = all(r.params.greedy for r in decoding)  # then the steps' argmax feeds back in one native call
        pick = None if greedy else self.processor.plain_picks(decoding)
        races = None if greedy else self.processor.plain_races(decoding, self.vocab_size)  # then one call too
        steps = self.runner.decode_steps(batch, n, pick, races)  # [ran][R]
        outputs = self.processor.commit_steps(decoding, [list(toks) for toks in zip(*steps)])
        self._after_steps(decoding, len(steps), len(decoding), t0, len(decoding), 0)
        return outputs

    def _execute(
        self,
        reqs: list[Request],
        fed: list[list[int]],
        frontier_drafts: dict[int, int],  # id(request) -> drafts, for requests whose step ends at the frontier
    ) -> tuple[torch.Tensor, list[int] | None]:
        """The runner call: logits at each frontier (the last fed token plus one row per draft), and every
        prompt row of a request that scores its prompt (prompt_logprobs), which are taken out here. Returns
        the rows verify decides from ([sum over frontier requests of (drafts + 1), vocab]) and their argmax
        ([that many] ints) where the runner found it beside them, else None."""
        scoring = [
            r.prompt_logprobs is not None and r.in_prefill and len(r.prompt_logprobs) < len(r.prompt_ids) for r in reqs
        ]  # a request preempted after its prompt was scored is not scored again
        logits_rows = [
            list(range(len(toks)))
            if sc
            else list(range(len(toks)))[-(frontier_drafts[id(r)] + 1) :]
            if id(r) in frontier_drafts
            else []
            for r, toks, sc in zip(reqs, fed, scoring)
        ]
        batch = StepBatch(
            slots=[-1] * len(reqs),
            start_pos=[r.num_computed for r in reqs],
            token_ids=fed,
            logits_rows=logits_rows,
            block_tables=[r.block_table for r in reqs],
            reuse_outputs=True,  # verify and the prompt scores read them in this step
        )
        want_hidden = [r.proposer in self._hidden_proposers for r in reqs] if self._hidden_proposers else []
        if any(want_hidden):
            batch.hidden_rows = [list(range(len(toks))) if w else [] for toks, w in zip(fed, want_hidden)]
        out = self.runner.forward(batch)
        if out.extra_hidden is not None:
            self._keep_hidden(reqs, fed, want_hidden, out.extra_hidden)
        if any(scoring):  # take the prompt rows out: verify sees only the frontier rows
            at_frontier = [id(r) in frontier_drafts for r in reqs]
            return self._score_prompts(reqs, scoring, logits_rows, at_frontier, out.logits), None
        return out.logits, out.argmax

    def _may_read_cache(self, r: Request) -> bool:
        """Whether ``r`` may start after the cached blocks of its prompt. Not when its proposer reads the
        target's hidden state at every prompt position (eagle), which a cached block lacks, nor when it
        scores its prompt (prompt_logprobs needs every prompt row computed)."""
        return r.proposer not in self._hidden_proposers and r.params.prompt_logprobs is None

    def _decide_k(self, decoding: list[Request], budget: int) -> list[int]:
        if not decoding:
            return []
        k_cap = self.config.num_speculative_tokens
        max_forced = self.config.structured_outputs.max_forced_tokens
        cands = []
        t0 = time.perf_counter()
        for r in decoding:
            room = min(r.params.max_tokens - len(r.output_ids) - 1, self.max_model_len - r.num_tokens - 1)
            # a request held plain takes no drafts, forced ones included: skip the grammar's lookahead
            held = r.speculation == "off"
            r.forced = r.grammar.forced(min(max_forced, room)) if r.grammar is not None and not held else []
            # never draft past max_tokens (the verify emits accepted + 1) or past the context
            cands.append(
                SpecCandidate(
                    request_id=r.request_id,
                    proposer=r.proposer,
                    speculation=r.speculation,
                    k_max=max(0, min(k_cap, room)),
                    forced=len(r.forced),
                )
            )
        self.grammars.seconds += time.perf_counter() - t0
        ks = self.decide(self.snapshot(), cands)
        ks = [max(0, min(int(k), max(c.k_max, c.forced))) if (c.proposer or c.forced) else 0 for k, c in zip(ks, cands)]
        # Every decoding request gets its 1 pending token; drafts share what is left of the budget.
        spare = budget - len(decoding)
        for i, k in enumerate(ks):
            ks[i] = max(0, min(k, spare))
            spare -= ks[i]
        return ks

    def _propose(self, decoding: list[Request], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Each request's drafts for a verify of ``ks[i]`` tokens: the grammar's forced tokens first, then
        the proposer's continuation after them, cut at the first token the grammar refuses."""
        drafts: list[list[int]] = [list(r.forced[:k]) for r, k in zip(decoding, ks)]
        probs: list[torch.Tensor | None] = [None for _ in decoding]
        by_proposer: dict[str, list[int]] = collections.defaultdict(list)
        for i, (r, k) in enumerate(zip(decoding, ks)):
            # after forced tokens, a proposer reading the target's hidden states has none for them: it waits
            if k > len(drafts[i]) and r.proposer and not (drafts[i] and r.proposer in self._hidden_proposers):
                by_proposer[r.proposer].append(i)
        for name, idxs in by_proposer.items():
            reqs = [
                ProposalRequest(
                    request_id=decoding[i].request_id,
                    token_ids=decoding[i].all_ids() + drafts[i],
                    num_prompt_tokens=len(decoding[i].prompt_ids),
                    k=ks[i] - len(drafts[i]),
                    eos_token_ids=decoding[i].eos_token_ids,
                    sampling=decoding[i].params.model_copy(update={"seed": decoding[i].seed}),
                    coupled=self.config.verification == "coupled",
                    hidden_states=None if (hid := decoding[i].hidden) is None else hid[: decoding[i].num_computed],
                )
                for i in idxs
            ]
            props = self.proposers[name].propose(reqs)
            for j, i in enumerate(idxs):
                want = ks[i] - len(drafts[i])
                d = list(props.draft_token_ids[j])[:want]
                self.acceptance.on_proposal(name, len(d), want)
                p = props.draft_probs[j]
                p = p[: len(d)] if (p is not None and d) else None
                if p is not None and drafts[i]:  # rejection verification: forced drafts have a one-hot q
                    p = torch.cat(
                        [
                            torch.nn.functional.one_hot(torch.tensor(drafts[i], device=p.device), p.shape[1]).to(
                                p.dtype
                            ),
                            p,
                        ]
                    )
                drafts[i] += d
                probs[i] = p
        t0 = time.perf_counter()
        for i, r in enumerate(decoding):
            if r.grammar is not None and len(drafts[i]) > len(r.forced[: ks[i]]):  # forced ones are valid already
                n = r.grammar.valid_prefix(drafts[i])
                drafts[i] = drafts[i][:n]
                q = probs[i]
                probs[i] = q[:n] if (q is not None and n) else None
        self.grammars.seconds += time.perf_counter() - t0
        return drafts, probs

    def _keep_hidden(
        self,
        reqs: list[Request],
        fed: list[list[int]],
        want: list[bool],
        hidden: torch.Tensor,  # [sum of fed tokens of the wanting requests, hidden] in schedule order
    ) -> None:
        """Write each fed row's hidden state at its position. Rows of drafts the verify rejects sit past
        ``num_computed`` afterwards and are overwritten by the next step, like the KV cache."""
        off = 0
        for r, toks, w in zip(reqs, fed, want):
            if not w:
                continue
            if r.hidden is None:
                cap = min(
                    self.max_model_len, len(r.prompt_ids) + r.params.max_tokens + self.config.num_speculative_tokens + 1
                )
                r.hidden = hidden.new_zeros(cap, hidden.shape[1])  # [capacity, hidden]
            r.hidden[r.num_computed : r.num_computed + len(toks)] = hidden[off : off + len(toks)]
            off += len(toks)

    def _score_prompts(
        self,
        reqs: list[Request],
        scoring: list[bool],
        logits_rows: list[list[int]],
        at_frontier: list[bool],
        logits: torch.Tensor,  # [sum_i len(logits_rows_i), vocab]
    ) -> torch.Tensor:  # the frontier rows only, in order
        """Log probability of each prompt token given the ones before it, from the rows that fed them
        (with batch-invariant kernels, the same numbers whatever the chunking)."""
        keep: list[int] = []
        pos = 0
        for r, sc, rows, f in zip(reqs, scoring, logits_rows, at_frontier):
            if sc:
                assert r.prompt_logprobs is not None
                first = r.num_computed + 1  # the prompt token the chunk's first row predicts
                targets = r.prompt_ids[first : first + len(rows)]  # the last prompt row predicts output instead
                r.prompt_logprobs.extend(
                    token_logprobs(logits[pos : pos + len(targets)], targets, r.params.prompt_logprobs or 0)
                )
                if f:
                    keep.append(pos + len(rows) - 1)  # the last prompt row decides the first output token
            elif f:
                keep.extend(range(pos, pos + len(rows)))
            pos += len(rows)
        return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]

    def _finish(self, r: Request, reason: str) -> None:
        if r.status is Status.FINISHED:
            return
        if r.status is Status.RUNNING:
            for p in self.proposers.values():
                p.finish(r.request_id, r.all_ids())
        self.scheduler.free(r)
        if r.events is not None:
            self._num_recording -= 1
        r.status = Status.FINISHED
        r.finish_reason = reason
        self.requests.pop(r.request_id, None)

    # ----------------------------------------------------------------- load

    def snapshot(self) -> LoadSnapshot:
        c = self.processor.counters
        dtype, invariant, attention, gemm = self._kernels
        return self.acceptance.fill(
            LoadSnapshot(
                running=len(self.running),
                decoding=sum(1 for r in self.running if not r.in_prefill),
                waiting=len(self.waiting),
                tokens_last_step=self._tokens_last_step,
                kv_tokens_in_use=self.kv.num_used * self.kv.block_size,
                kv_tokens_capacity=self.kv.num_blocks * self.kv.block_size,
                step_time_ema_s=self.step_time_ema.value or 0.0,
                tokens_per_step_ema=self.tokens_per_step_ema.value or 0.0,
                num_steps=self.num_steps,
                handed=self.num_handed,
                output_tokens=c.output_tokens,
                spec_request_steps=c.spec_request_steps,
                plain_request_steps=c.plain_request_steps,
                timestamp=time.time(),
                dtype=dtype,
                batch_invariant=invariant,
                attention_kernel=attention,
                gemm_kernel=gemm,
            )
        )

    # ----------------------------------------------------------------- convenience (tests, benchmarks)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[list[int]]:
        """Run prompts to completion in one continuous batch; returns each request's output ids."""
        base = f"gen{self.num_steps}-{id(prompts)}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            self.add_request(rid, p, params, **kwargs)
        outs: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self.requests for rid in ids):
            for o in self.step():
                if o.request_id in outs:
                    outs[o.request_id].extend(o.token_ids)
        return [outs[rid] for rid in ids]
