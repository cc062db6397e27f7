"""The decoding engine: iteration-level continuous batching of plain and speculative steps.

One ``step()``:
  1. admit waiting requests into free KV slots (lowest slot first keeps the attention range tight);
  2. ask the decision function for every decoding request's K (0 = plain step);
  3. ask each proposer, once per step, for the draft tokens of the requests that use it;
  4. one target forward over a ragged batch: decoding requests feed their pending token plus
     their drafts (K + 1 tokens), prefilling requests feed a prompt chunk within the step's
     token budget;
  5. verify every request at its frontier (workers/rejection_sampler.py): accepted drafts,
     then a recovered or bonus token; a plain step is the K = 0 case of the same call;
  6. roll the KV length back to the accepted prefix (just a number), commit the tokens,
     detokenize, check EOS / stop strings / max_tokens, free finished requests' slots.

Nothing here imports Ray; the Serve target worker drives it through ``AsyncEngine``.
"""

from __future__ import annotations

import collections
import itertools
import secrets
import time
from typing import Any, Callable, Iterable, Sequence

import torch
from pydantic import ValidationError

from workers.config import EngineConfig
from workers.decision import DecideFn, SpecCandidate, Speculation, fixed_k
from workers.detokenizer import IncrementalDetokenizer
from workers.errors import InvalidRequestError
from workers.model_loader import LoadedModel
from workers.proposers.base import ProposalRequest, Proposer
from workers.proposers.draft_model import common_prefix_len
from workers.rejection_sampler import verify, verify_coupled
from workers.request import Request, RequestOutput, Status, StepEvent, TokenLogprob
from workers.hardware import resolve_dtype
from workers.logprobs import token_logprobs
from workers.penalties import penalize_rows
from workers.runner import ModelRunner, StepBatch, pick_device
from workers.sampler import make_generator, position_key
from workers.sampling_params import SamplingParams
from workers.stats import AcceptanceTracker, Ema, LoadSnapshot, SpecDecodeStats

_ROLES = ("system", "user", "assistant")


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
    ) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.tokenizer = loaded.tokenizer
        hf_cfg = loaded.model.config
        self.vocab_size = hf_cfg.vocab_size
        self.max_model_len = min(config.max_model_len, getattr(hf_cfg, "max_position_embeddings", 1 << 30))
        device = pick_device(config.device)
        self.dtype = resolve_dtype(config.dtype, device)
        self.runner = ModelRunner(
            loaded.model, config.max_num_seqs, self.max_model_len, self.dtype, device, cpu_gemm=config.cpu_gemm,
            batch_invariant=config.batch_invariant,
        )
        eos = getattr(hf_cfg, "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos_ids)
        self.proposers: dict[str, Proposer] = dict(proposers or {})
        for name, p in self.proposers.items():  # a draft's token ids and q rows must be the target's
            draft_vocab = getattr(p, "vocab_size", None)
            if draft_vocab is not None and draft_vocab != self.vocab_size:
                raise ValueError(
                    f"proposer {name!r}: draft vocabulary {draft_vocab} != target vocabulary {self.vocab_size}"
                )
        # proposers that read the target's hidden states (EAGLE): only their requests pay for keeping them
        self._hidden_proposers = {n for n, p in self.proposers.items() if getattr(p, "needs_hidden_states", False)}
        self.default_proposer = config.proposers[0].name if config.proposers and self.proposers else None
        if self.default_proposer not in self.proposers:
            self.default_proposer = next(iter(self.proposers), None)
        self.decide: DecideFn = decide or fixed_k(config.num_speculative_tokens)
        # (tokens in the step, seconds, decoding requests if no prefill rode along else None):
        # feeds the policy's online step-cost model
        self.on_step = on_step
        self.on_verify = on_verify  # (proposer, num_draft, num_accepted) per speculative verify: metrics

        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.free_slots = list(range(config.max_num_seqs))
        # per slot: the tokens whose KV a *free* slot still holds, from the request that last used it
        # (a running request's valid KV is its own all_ids()[:num_computed]); read by _reuse_prefix
        self._slot_tokens: list[list[int]] = [[] for _ in range(config.max_num_seqs)]
        self.prefix_cache_queries = 0  # prompt tokens admitted with prefix caching on
        self.prefix_cache_hits = 0  # of those, reused from cached KV instead of prefilled
        self.stats: dict[str, SpecDecodeStats] = collections.defaultdict(SpecDecodeStats)
        # per proposer, what the goodput policy reads (workers/stats.py says why these estimators)
        self.acceptance = AcceptanceTracker()
        self.step_time_ema = Ema(0.1)
        self.tokens_per_step_ema = Ema(0.1)
        self.step_costs: collections.deque[tuple[int, float]] = collections.deque(maxlen=512)  # (tokens, seconds)
        self.num_steps = 0
        # Cumulative since start, published in every snapshot: a reader takes the rate over any
        # window it likes from two snapshots (the switchback benchmark does, per policy window).
        self.num_output_tokens = 0
        self.num_spec_request_steps = 0  # decode request-steps that verified drafts
        self.num_plain_request_steps = 0  # decode request-steps without drafts
        self._tokens_last_step = 0
        self._num_recording = 0  # requests in flight that record per-step events (tracing); 0: no event work

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
    ) -> None:
        """Validate and queue a request. Raises ``InvalidRequestError`` naming the bad field.

        ``record_events``: keep a ``StepEvent`` per engine step of this request (for its trace),
        handed back on its final output; off by default, and then no step does any event work.
        """
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", param="request_id")
        if isinstance(params, dict) or params is None:
            try:
                params = SamplingParams(**(params or {}))
            except ValidationError as e:
                err = e.errors()[0]
                field = ".".join(str(x) for x in err["loc"]) or None
                raise InvalidRequestError(f"{field}: {err['msg']}", param=field) from None
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
        if speculation not in ("auto", "on", "off"):
            raise InvalidRequestError(f"speculation must be 'auto', 'on' or 'off', not {speculation!r}", param="speculation")
        if proposer is not None and proposer not in self.proposers:
            raise InvalidRequestError(
                f"unknown proposer {proposer!r}; configured: {sorted(self.proposers)}", param="proposer"
            )
        req = Request(
            request_id=request_id,
            prompt_ids=prompt,
            params=params,
            proposer=proposer or self.default_proposer,
            speculation=speculation,
            detok=IncrementalDetokenizer(self.tokenizer, prompt, params.stop),
            generator=None,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            seed=params.seed if params.seed is not None else secrets.randbits(64),
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )
        if self.config.verification == "rejection" and not params.greedy:
            req.generator = make_generator(req.seed, self.runner.device)
        if record_events:
            req.events = []
            self._num_recording += 1
        self.requests[request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request: its KV slot and its proposers' state are freed at once."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        self._finish(req, "abort")
        return self._output(req, [], final=True)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        rec = self._num_recording > 0  # per-step event timestamps only while some request records them
        t0_ns = time.time_ns() if rec else 0
        self._admit()
        if not self.running:
            return []
        budget = self.config.max_num_batched_tokens
        decoding = [r for r in self.running if not r.in_prefill]
        ks = self._decide_k(decoding, budget)
        drafts, draft_probs = self._propose(decoding, ks)
        t_prop_ns = time.time_ns() if rec else 0

        # Build the ragged batch: decoding requests first (latency-critical), then prefill chunks.
        sched: list[tuple[Request, list[int], bool]] = []  # (request, tokens fed, at frontier)
        for r, d in zip(decoding, drafts):
            sched.append((r, [r.all_ids()[r.num_computed]] + d, True))
            budget -= 1 + len(d)
        if decoding:  # running streams wait for this step: keep the prefill part of it short
            budget = min(budget, self.config.max_prefill_tokens_while_decoding)
        for r in self.running:
            if r.in_prefill and budget > 0:
                chunk = r.prompt_ids[r.num_computed : r.num_computed + budget]
                budget -= len(chunk)
                sched.append((r, chunk, r.num_computed + len(chunk) == len(r.prompt_ids)))
        frontier_drafts = {id(r): d for r, d in zip(decoding, drafts)}
        frontier_probs = {id(r): p for r, p in zip(decoding, draft_probs)}

        # Logits: the frontier rows (the last fed token, plus one per draft), and every prompt row of a
        # request that scores its prompt (prompt_logprobs).
        scoring = [r.params.prompt_logprobs is not None and r.in_prefill for r, _, _ in sched]
        logits_rows = [list(range(len(toks))) if sc else
                       list(range(len(toks)))[-(len(frontier_drafts.get(id(r), [])) + 1):] if f else []
                       for (r, toks, f), sc in zip(sched, scoring)]
        batch = StepBatch(
            slots=[r.slot for r, _, _ in sched],
            start_pos=[r.num_computed for r, _, _ in sched],
            token_ids=[toks for _, toks, _ in sched],
            logits_rows=logits_rows,
        )
        want_hidden = [r.proposer in self._hidden_proposers for r, _, _ in sched] if self._hidden_proposers else []
        if any(want_hidden):
            batch.hidden_rows = [list(range(len(toks))) if w else [] for (_, toks, _), w in zip(sched, want_hidden)]
        out = self.runner.forward(batch)
        if out.extra_hidden is not None:
            self._keep_hidden(sched, want_hidden, out.extra_hidden)
        if any(scoring):  # take the prompt rows out: verify sees only the frontier rows
            out.logits = self._score_prompts(sched, scoring, logits_rows, out.logits)

        at_frontier = [(r, toks) for r, toks, f in sched if f]
        for r, toks, f in sched:
            if not f:
                r.num_computed += len(toks)
                if rec and r.events is not None:
                    r.events.append(StepEvent(t0_ns, time.time_ns(), "prefill", 0, 0, t_prop_ns))
        row_start = list(itertools.accumulate((len(frontier_drafts.get(id(r), [])) + 1 for r, _ in at_frontier),
                                              initial=0))[:-1]  # first verify row of each frontier request
        logits = self._penalized(out.logits, at_frontier, frontier_drafts, row_start)
        if self.config.verification == "coupled":
            result = verify_coupled(
                logits,
                [frontier_drafts.get(id(r), []) for r, _ in at_frontier],
                [r.params for r, _ in at_frontier],
                [self._row_keys(r, len(frontier_drafts.get(id(r), []))) for r, _ in at_frontier],
            )
        else:
            result = verify(
                logits,
                [frontier_drafts.get(id(r), []) for r, _ in at_frontier],
                [frontier_probs.get(id(r)) for r, _ in at_frontier],
                [r.params for r, _ in at_frontier],
                [r.generator for r, _ in at_frontier],
            )
        outputs: list[RequestOutput] = []
        logprobs = self._logprobs(out.logits, at_frontier, row_start, result.output_token_ids)
        for (r, toks), new_ids, n_acc, lps in zip(at_frontier, result.output_token_ids, result.num_accepted, logprobs):
            n_draft = len(frontier_drafts.get(id(r), []))
            kind = "prefill" if r.in_prefill else ("spec" if n_draft else "plain")
            if rec and r.events is not None:
                r.events.append(StepEvent(t0_ns, time.time_ns(), kind, n_draft, n_acc, t_prop_ns))
            self.num_spec_request_steps += kind == "spec"
            self.num_plain_request_steps += kind == "plain"
            r.num_computed += len(toks) - (n_draft - n_acc)  # KV of rejected drafts is now stale: length moves back
            self._record(r, n_draft, n_acc)
            outputs.append(self._commit(r, new_ids, lps))
            self.num_output_tokens += len(outputs[-1].token_ids)

        self.num_steps += 1
        self._tokens_last_step = sum(len(t) for t in batch.token_ids)
        dt = time.perf_counter() - t0
        self.step_time_ema.update(dt)
        self.tokens_per_step_ema.update(self._tokens_last_step)
        self.step_costs.append((self._tokens_last_step, dt))
        if self.on_step is not None:
            self.on_step(self._tokens_last_step, dt, len(decoding) if len(sched) == len(decoding) else None)
        return outputs

    @staticmethod
    def _row_keys(r: Request, num_draft: int) -> list[int]:
        """Noise keys of the output positions a verify of ``num_draft`` drafts decides (none if greedy)."""
        if r.params.greedy:
            return []
        t0 = len(r.output_ids)
        return [position_key(r.seed, t0 + j) for j in range(num_draft + 1)]

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            r = self.waiting.popleft()
            self.free_slots.sort()
            r.slot = self.free_slots.pop(0)
            r.status = Status.RUNNING
            if (self.config.enable_prefix_caching and r.proposer not in self._hidden_proposers
                    and r.params.prompt_logprobs is None):  # scoring needs every prompt row computed
                self._reuse_prefix(r)
            self.running.append(r)

    def _reuse_prefix(self, r: Request) -> None:
        """Start ``r`` after the longest prefix of its prompt whose KV some slot already holds.

        Candidates: every free slot (the KV of the request that last used it stays until
        overwritten) and every running request (its KV up to ``num_computed``). The request keeps
        the lowest free slot it was given, which keeps the attention slot range tight; when the
        best match lives elsewhere, that prefix's KV is copied in (``ModelRunner.copy_kv``). The
        last prompt token is always fed, since its logits give the first output token. Why whole
        slots and not vLLM's hashed blocks: our cache is slot-based, and a closed loop of chat
        requests hands each arrival the slot just freed by a request with the same system prompt.
        """
        prompt = r.prompt_ids[:-1]
        cands = [(s, self._slot_tokens[s]) for s in [r.slot, *self.free_slots]]
        cands += [(o.slot, o.all_ids()[: o.num_computed]) for o in self.running]
        best, src = 0, r.slot
        for s, toks in cands:
            n = common_prefix_len(toks, prompt)
            if n > best:  # strict: on a tie the request's own slot (first) wins and nothing is copied
                best, src = n, s
        if best and src != r.slot:
            self.runner.copy_kv(src, r.slot, best)
        r.num_computed = r.num_cached_tokens = best
        self.prefix_cache_queries += len(r.prompt_ids)
        self.prefix_cache_hits += best

    def _decide_k(self, decoding: list[Request], budget: int) -> list[int]:
        if not decoding:
            return []
        k_cap = self.config.num_speculative_tokens
        cands = [
            SpecCandidate(
                request_id=r.request_id,
                proposer=r.proposer,
                speculation=r.speculation,
                # never draft past max_tokens (the verify emits accepted + 1) or past the context
                k_max=max(0, min(k_cap, r.params.max_tokens - len(r.output_ids) - 1, self.max_model_len - r.num_tokens - 1)),
            )
            for r in decoding
        ]
        ks = self.decide(self.snapshot(), cands)
        ks = [max(0, min(int(k), c.k_max)) if c.proposer else 0 for k, c in zip(ks, cands)]
        # Every decoding request gets its 1 pending token; drafts share what is left of the budget.
        spare = budget - len(decoding)
        for i, k in enumerate(ks):
            ks[i] = max(0, min(k, spare))
            spare -= ks[i]
        return ks

    def _propose(self, decoding: list[Request], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        drafts: list[list[int]] = [[] for _ in decoding]
        probs: list[torch.Tensor | None] = [None for _ in decoding]
        by_proposer: dict[str, list[int]] = collections.defaultdict(list)
        for i, (r, k) in enumerate(zip(decoding, ks)):
            if k > 0 and r.proposer:
                by_proposer[r.proposer].append(i)
        for name, idxs in by_proposer.items():
            reqs = [
                ProposalRequest(
                    request_id=decoding[i].request_id,
                    token_ids=decoding[i].all_ids(),
                    num_prompt_tokens=len(decoding[i].prompt_ids),
                    k=ks[i],
                    eos_token_ids=decoding[i].eos_token_ids,
                    sampling=decoding[i].params.model_copy(update={"seed": decoding[i].seed}),
                    coupled=self.config.verification == "coupled",
                    hidden_states=None if decoding[i].hidden is None else decoding[i].hidden[: decoding[i].num_computed],
                )
                for i in idxs
            ]
            props = self.proposers[name].propose(reqs)
            for j, i in enumerate(idxs):
                d = list(props.draft_token_ids[j])[: ks[i]]
                drafts[i] = d
                self.acceptance.on_proposal(name, len(d), ks[i])
                p = props.draft_probs[j]
                probs[i] = p[: len(d)] if (p is not None and d) else None
        return drafts, probs

    def _keep_hidden(
        self,
        sched: list[tuple[Request, list[int], bool]],
        want: list[bool],
        hidden: torch.Tensor,  # [sum of fed tokens of the wanting requests, hidden] in schedule order
    ) -> None:
        """Write each fed row's hidden state at its position. Rows of drafts the verify rejects sit past
        ``num_computed`` afterwards and are overwritten by the next step, like the KV cache."""
        off = 0
        for (r, toks, _), w in zip(sched, want):
            if not w:
                continue
            if r.hidden is None:
                cap = min(self.max_model_len, len(r.prompt_ids) + r.params.max_tokens + self.config.num_speculative_tokens + 1)
                r.hidden = hidden.new_zeros(cap, hidden.shape[1])  # [capacity, hidden]
            r.hidden[r.num_computed : r.num_computed + len(toks)] = hidden[off : off + len(toks)]
            off += len(toks)

    def _record(self, r: Request, n_draft: int, n_acc: int) -> None:
        r.spec.record_verify(n_draft, n_acc)
        if r.proposer and n_draft:
            self.stats[r.proposer].record_verify(n_draft, n_acc)
            self.acceptance.on_verify(r.proposer, n_draft, n_acc)
            self.proposers[r.proposer].observe(r.request_id, n_draft, n_acc)
            if self.on_verify is not None:
                self.on_verify(r.proposer, n_draft, n_acc)
        elif r.proposer:
            self.stats[r.proposer].plain_steps += 1

    def _score_prompts(
        self,
        sched: list[tuple[Request, list[int], bool]],
        scoring: list[bool],
        logits_rows: list[list[int]],
        logits: torch.Tensor,  # [sum_i len(logits_rows_i), vocab]
    ) -> torch.Tensor:  # the frontier rows only, in order
        """Log probability of each prompt token given the ones before it, from the rows that fed them
        (with batch-invariant kernels, the same numbers whatever the chunking)."""
        keep: list[int] = []
        pos = 0
        for (r, toks, f), sc, rows in zip(sched, scoring, logits_rows):
            if sc:
                assert r.prompt_logprobs is not None
                first = r.num_computed + 1  # the prompt token the chunk's first row predicts
                targets = r.prompt_ids[first : first + len(rows)]  # the last prompt row predicts output instead
                r.prompt_logprobs.extend(token_logprobs(logits[pos : pos + len(targets)], targets,
                                                        r.params.prompt_logprobs or 0))
                if f:
                    keep.append(pos + len(rows) - 1)  # the last prompt row decides the first output token
            elif f:
                keep.extend(range(pos, pos + len(rows)))
            pos += len(rows)
        return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]

    @staticmethod
    def _penalized(
        logits: torch.Tensor,  # [sum_i (num_draft_i + 1), vocab] the frontier requests' rows
        at_frontier: list[tuple[Request, list[int]]],
        drafts: dict[int, list[int]],
        row_start: list[int],  # per frontier request: its first row
    ) -> torch.Tensor:
        """The rows the tokens are chosen from: penalized where a request asks (workers/penalties.py).
        Logprobs stay those of the raw logits."""
        if not any(r.params.penalized for r, _ in at_frontier):
            return logits
        logits = logits.clone()
        for (r, _), start in zip(at_frontier, row_start):
            if r.params.penalized:
                d = drafts.get(id(r), [])
                logits[start : start + len(d) + 1] = penalize_rows(
                    logits[start : start + len(d) + 1], r.prompt_ids, r.output_ids, d, r.params)
        return logits

    @staticmethod
    def _logprobs(
        logits: torch.Tensor,  # [sum_i (num_draft_i + 1), vocab] the verify rows of the frontier requests
        at_frontier: list[tuple[Request, list[int]]],
        row_start: list[int],  # per frontier request: its first row
        new_ids: list[list[int]],  # per frontier request: the tokens verify committed
    ) -> list[list[TokenLogprob] | None]:
        """Log probabilities of the committed tokens, from the rows that decided them (under speculation,
        the verify rows): with batch-invariant kernels, the same numbers as plain decoding's."""
        return [None if r.params.logprobs is None else
                token_logprobs(logits[start : start + len(ids)], ids, r.params.logprobs)
                for (r, _), start, ids in zip(at_frontier, row_start, new_ids)]

    def _commit(self, r: Request, new_ids: Iterable[int], logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        committed: list[int] = []
        if r.params.max_tokens == 0:  # scoring only: the prompt is read, nothing is written
            self._finish(r, "length")
            return self._output(r, [], final=True)
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
        for t in new_ids:
            r.output_ids.append(t)
            committed.append(t)
            if t in r.eos_token_ids:
                self._finish(r, "stop")
                break
            if r.detok.add(t):
                self._finish(r, "stop")
                break
            if len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
                self._finish(r, "length")
                break
        lps = None if logprobs is None else logprobs[: len(committed)]
        return self._output(r, committed, final=r.status is Status.FINISHED, logprobs=lps)

    def _output(self, r: Request, token_ids: list[int], final: bool,
                logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=r.request_id,
            token_ids=token_ids,
            text=r.detok.take(final),
            finished=final,
            finish_reason=r.finish_reason,
            num_prompt_tokens=len(r.prompt_ids),
            num_output_tokens=len(r.output_ids),
            num_cached_tokens=r.num_cached_tokens,
            proposer=r.proposer,
            spec=r.spec,
            first_token_time=r.first_token_time,
            arrival_time=r.arrival_time,
            events=r.events if final else None,
            logprobs=logprobs,
            prompt_logprobs=self._take_prompt_logprobs(r),
        )

    @staticmethod
    def _take_prompt_logprobs(r: Request) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs, once, on the request's first output after its prefill."""
        if r.prompt_logprobs is None or r.prompt_logprobs_sent or r.in_prefill:
            return None
        r.prompt_logprobs_sent = True
        return r.prompt_logprobs

    def _finish(self, r: Request, reason: str) -> None:
        if r.status is Status.FINISHED:
            return
        if r.status is Status.RUNNING:
            self.running.remove(r)
            self._slot_tokens[r.slot] = r.all_ids()[: r.num_computed]
            self.free_slots.append(r.slot)
            r.slot = -1
            for p in self.proposers.values():
                p.finish(r.request_id, r.all_ids())
        if r.events is not None:
            self._num_recording -= 1
        r.status = Status.FINISHED
        r.finish_reason = reason
        self.requests.pop(r.request_id, None)

    # ----------------------------------------------------------------- load

    def snapshot(self) -> LoadSnapshot:
        return self.acceptance.fill(LoadSnapshot(
            running=len(self.running),
            decoding=sum(1 for r in self.running if not r.in_prefill),
            waiting=len(self.waiting),
            tokens_last_step=self._tokens_last_step,
            kv_tokens_in_use=sum(r.num_computed for r in self.running),
            kv_tokens_capacity=self.config.max_num_seqs * self.max_model_len,
            step_time_ema_s=self.step_time_ema.value or 0.0,
            tokens_per_step_ema=self.tokens_per_step_ema.value or 0.0,
            num_steps=self.num_steps,
            output_tokens=self.num_output_tokens,
            spec_request_steps=self.num_spec_request_steps,
            plain_request_steps=self.num_plain_request_steps,
            timestamp=time.time(),
            dtype=str(self.dtype).removeprefix("torch."),
            batch_invariant=self.config.batch_invariant,
        ))

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
